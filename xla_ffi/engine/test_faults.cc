// Fault injection for tests (CommConfig's test_* fields): messages from
// strangers, and messages forged to come from another rank, that the
// receiving side must drop (or never match) without a trace. Nothing here
// runs unless a test asks for it.
#include <algorithm>
#include <cstring>
#include <string>
#include <string_view>

#include "engine/batch.h"
#include "engine/communicator.h"

namespace herring::engine {

namespace {

// Flipped into a real header's token: the message of another job.
constexpr uint64_t kStrangerToken = 0x5bd1e995u;

}  // namespace

void Communicator::SendStranger(Batch* batch, int to_rank, uint64_t tag,
                                const WireHeader& header) {
  SendForged(batch, to_rank, tag, header, nullptr);  // payload: garbage bytes
}

void Communicator::SendStaleCopy(Batch* batch, int to_rank, uint64_t tag,
                                 const WireHeader& real) {
  // A header-only message with the tag of `real` and another job's token:
  // it matches the receive posted for `real`, which must drop it and post
  // again (HeaderVerdict::kStranger), as for a process of an old run.
  WireHeader stale(real);
  stale.token ^= kStrangerToken;
  stale.payload_bytes = 0;
  SealHeader(&stale);
  SendStranger(batch, to_rank, tag, stale);
}

void Communicator::SendEarlyStrangers(Job* job, int p) {
  Batch* batch = job->batch;
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  for (size_t c = 0; c < job->Chunks(job->me); ++c) {
    SendStranger(batch, batch->group[p],
                 MakeTag(MsgKind::kResult, my_rank, batch->stream, job->tag_bits, c),
                 MakeHeader(*job, MsgKind::kResult, config_.token ^ kStrangerToken, my_rank,
                            job->me, c, job->WireBytes(job->me, c), job->req.contributors));
  }
}

void Communicator::SendForgeries(Batch* batch) {
  const int as = config_.test_forge_as;
  if (as < 0 || as >= config_.size || as == config_.rank || forged_.exchange(true)) return;
  static const char kReason[] = "forged abort";
  for (int peer = 0; peer < config_.size; ++peer) {
    if (peer == config_.rank || peer == as) continue;
    WireHeader h = ControlHeader(MsgKind::kAbort, config_.token, as);
    h.payload_bytes = sizeof(kReason) - 1;
    SealHeader(&h);
    SendForged(batch, peer, MakeControlTag(static_cast<uint32_t>(as)), h, kReason);
  }
  const HostWait& w = *batch->host;
  const auto victim = std::find(w.local.begin(), w.local.end(), as);
  if (w.board || victim == w.local.end()) return;  // boards: nothing to forge
  WireHeader h = w.out_headers[0];
  h.src_rank = static_cast<uint32_t>(as);
  h.part = static_cast<uint32_t>(victim - w.local.begin());
  SealHeader(&h);
  const uint64_t tag = MakeTag(MsgKind::kHostArrive, static_cast<uint32_t>(as), batch->stream,
                               batch->jobs.front()->tag_bits, 0);
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.me || w.local[q] == as) continue;
    SendForged(batch, w.local[q], tag, h, w.out_entries[0].data());
  }
}

void Communicator::SendForged(Batch* batch, int to_rank, uint64_t tag, const WireHeader& header,
                              const void* payload) {
  // Header and payload in one allocation, freed when the send completes; no
  // payload given: len garbage bytes.
  const size_t len = header.payload_bytes;
  auto* msg = new char[sizeof(WireHeader) + len];
  std::memcpy(msg, &header, sizeof(WireHeader));
  if (payload != nullptr) {
    std::memcpy(msg + sizeof(WireHeader), payload, len);
  } else {
    std::memset(msg + sizeof(WireHeader), 0xa5, len);
  }
  transport::IoVec iov[2] = {{msg, sizeof(WireHeader)}, {msg + sizeof(WireHeader), len}};
  batch->AddInflight(1);
  Status s = transport_->Send(to_rank, tag, iov, len > 0 ? 2 : 1,
                              [batch, msg](const transport::Completion&) {
                                delete[] msg;
                                batch->Complete(0, 1);
                              });
  if (!s.ok()) {
    delete[] msg;
    batch->Complete(0, 1);
  }
}

int Communicator::FaultIndex(const char* name) const {
  const std::string& list = config_.test_fault;
  if (list.empty()) return -1;
  const std::string_view wanted(name);
  int index = 0;
  for (size_t start = 0;; ++index) {
    const size_t end = std::min(list.find(',', start), list.size());
    if (std::string_view(list).substr(start, end - start) == wanted) {
      return index < 32 ? index : -1;  // fault_fired_'s bits
    }
    if (end == list.size()) return -1;
    start = end + 1;
  }
}

bool Communicator::TestFault(const char* name) {
  const int i = FaultIndex(name);
  if (i < 0) return false;
  const uint32_t bit = 1u << i;
  return (fault_fired_.fetch_or(bit) & bit) == 0;
}

bool Communicator::FaultFired(const char* name) const {
  const int i = FaultIndex(name);
  return i >= 0 && (fault_fired_.load() & (1u << i)) != 0;
}

}  // namespace herring::engine
