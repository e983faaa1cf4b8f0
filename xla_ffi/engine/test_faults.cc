// Fault injection for tests (CommConfig's test_* fields): messages from
// strangers that the receiving side must drop without a trace. Nothing here
// runs unless a test asks for it.
#include <cstring>
#include <new>
#include <string>

#include "engine/batch.h"
#include "engine/communicator.h"

namespace herring::engine {

void Communicator::SendStaleCopy(Batch* batch, int to_rank, uint64_t tag,
                                 const WireHeader& real) {
  // A header-only message with the tag of `real` and another job's token:
  // it matches the receive posted for `real`, which must drop it and post
  // again (HeaderVerdict::kStranger), as for a process of an old run.
  auto* stale = new WireHeader(real);
  stale->token ^= 0x5bd1e995u;
  stale->payload_bytes = 0;
  SealHeader(stale);
  transport::IoVec iov[1] = {{stale, sizeof(*stale)}};
  batch->AddInflight(1);
  Status s = transport_->Send(to_rank, tag, iov, 1, [batch, stale](const transport::Completion&) {
    delete stale;
    batch->Complete(0, 1);
  });
  if (!s.ok()) {
    delete stale;
    batch->Complete(0, 1);
  }
}

void Communicator::SendEarlyStrangers(Job* job, int p) {
  Batch* batch = job->batch;
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  for (size_t c = 0; c < job->Chunks(job->me); ++c) {
    // Header and payload in one allocation, freed when the send completes.
    const size_t len = job->WireBytes(job->me, c);
    auto* msg = new char[sizeof(WireHeader) + len];
    auto* h = new (msg) WireHeader(MakeHeader(*job, MsgKind::kResult, config_.token ^ 0x5bd1e995u,
                                              my_rank, job->me, c, len,
                                              job->req.contributors));
    std::memset(msg + sizeof(WireHeader), 0xa5, len);
    transport::IoVec iov[2] = {{h, sizeof(*h)}, {msg + sizeof(WireHeader), len}};
    batch->AddInflight(1);
    Status s = transport_->Send(
        batch->group[p], MakeTag(MsgKind::kResult, my_rank, batch->stream, job->tag_bits, c),
        iov, len > 0 ? 2 : 1, [batch, msg](const transport::Completion&) {
          delete[] msg;
          batch->Complete(0, 1);
        });
    if (!s.ok()) {
      delete[] msg;
      batch->Complete(0, 1);
    }
  }
}

}  // namespace herring::engine
