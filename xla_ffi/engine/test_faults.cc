// Fault injection for tests (CommConfig's test_* fields): messages from
// strangers that the receiving side must drop without a trace. Nothing here
// runs unless a test asks for it.
#include <cstring>
#include <new>

#include "engine/batch.h"
#include "engine/communicator.h"

namespace herring::engine {

namespace {

// Flipped into a real header's token: the message of another job.
constexpr uint64_t kStrangerToken = 0x5bd1e995u;

}  // namespace

void Communicator::SendStranger(Batch* batch, int to_rank, uint64_t tag,
                                const WireHeader& header) {
  // Header and payload (garbage bytes) in one allocation, freed when the send
  // completes.
  const size_t len = header.payload_bytes;
  auto* msg = new char[sizeof(WireHeader) + len];
  auto* h = new (msg) WireHeader(header);
  std::memset(msg + sizeof(WireHeader), 0xa5, len);
  transport::IoVec iov[2] = {{h, sizeof(*h)}, {msg + sizeof(WireHeader), len}};
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

}  // namespace herring::engine
