// The host stage's direct path (host_stage.cc has the two-step one and the
// rules both keep): a small all-reduce of one host's processes in one wait.
#include <algorithm>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {

// The direct path, for small all-reduces on one host: one wait instead of
// two. Each process has staged a copy of its whole input (PrepareHostCall) and
// published where it is; it waits for every peer's, reads them whole and sums
// every element itself, in local order as step 2 does (so the bits equal the
// two-step path's), acks each peer's posting, and returns. Its staged copy
// lingers until every peer has acked it. It reads (p - 1) whole inputs where
// the two steps read (p - 1) slices twice, which pays only where the wait
// costs more than the bytes: on 2 processes with a core each it took 30 us
// from the last arrival to the last return for 4 bytes against 54 us in two
// steps, the same at 64 KiB, and longer at 256 KiB (BENCHMARKS.md, small
// buffers), hence herring_jax's default limit of 32 KiB.
bool Communicator::RunHostDirect(Batch* batch, const std::vector<ReduceRequest>& requests,
                                 bool* timed_out) {
  HostWait& w = *batch->host;
  const int p = w.size();
  const int me = w.me;
  bool ok = true;
  auto fail = [&](const Status& s) {
    if (!s.ok() && ok) {
      Fail(batch, s.message(), /*tell_peers=*/true);
      ok = false;
    }
  };
  if (!WaitBoard(batch, 0)) *timed_out = true;
  ok = !*timed_out && !batch->Failed();
  if (ok && config_.test_read_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(config_.test_read_delay_ms));
  }
  PooledBuffer pieces(&pool_, std::max<size_t>(1, (p - 1) * kHostPieceBytes));
  if (ok && !pieces.ok()) fail(Status::Error("out of memory for the host stage"));
  std::vector<const void*> srcs(p);
  for (size_t k = 0; ok && k < requests.size(); ++k) {
    const ReduceRequest& r = requests[k];
    uint64_t contributors = 0;
    fail(HostContributors(batch, k, &contributors));
    const size_t elem = ElementSize(r.dtype);
    const size_t piece = std::max<size_t>(1, kHostPieceBytes / elem);
    const double divisor = r.op == ReduceOp::kMean ? static_cast<double>(contributors) : 1.0;
    for (size_t off = 0; ok && off < r.count; off += piece) {
      const size_t n = std::min(piece, r.count - off);
      const size_t at = off * elem;
      // Its own staged copy: the output may be the input (in place).
      fail(ReadInputPiece(batch, k, at, n * elem, w.staging[k].data() + at, pieces.data(),
                          &srcs));
      if (!ok) break;
      ReduceOpInto(r.op, r.dtype, static_cast<char*>(r.out) + at, nullptr, srcs.data(), p, n,
                   divisor);
      ok = !batch->Failed();
    }
  }
  // As the two steps do before a slice is used: the inputs read were still
  // their owners' (a failed call withdraws them).
  if (ok) fail(CheckInputsStillPosted(batch));
  // Tests: this call fails here without telling anyone, as the two steps'
  // fault of the same name does after its ready.
  if (ok && TestFault("withdraw-after-ready")) {
    Fail(batch, "rank " + std::to_string(config_.rank) +
                    ": test fault withdraw-after-ready (HERRING_TEST_FAULT)",
         /*tell_peers=*/false);
    ok = false;
  }
  // Done with the peers' copies: each owner may free its own once every
  // reader has acked.
  for (int q = 0; ok && q < p; ++q) {
    if (q != me) board_->Ack(w.board_index[q], w.arrive_posting[q], w.arrive_version[q]);
  }
  return ok;
}

}  // namespace herring::engine
