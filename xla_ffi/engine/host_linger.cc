// After a host-stage call: its staging buffers stay until every other
// process of the host has read its slice (kHostDone), and shutting down waits
// for slow readers (host_stage.cc says why this is what keeps the reads safe).
#include <algorithm>
#include <chrono>
#include <cstdio>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"

namespace herring::engine {

void Communicator::Linger(std::unique_ptr<Batch> batch) {
  std::lock_guard<std::mutex> lock(lingering_mu_);
  SweepLingering();
  if (batch) lingering_.push_back(std::move(batch));
}

void Communicator::SweepLingering() {
  auto finished = [this](const std::unique_ptr<Batch>& b) {
    std::lock_guard<std::mutex> batch_lock(b->mu);
    if (b->inflight != 0) return false;  // callbacks may still run
    const HostWait& w = *b->host;
    if (w.board && !b->failed) {
      // Through the boards: until every reader has acked (or exited).
      if (!SlicesRead(*b)) return false;
      board_->Release(w.posting);
      return true;
    }
    if (b->remaining != 0 || b->failed) {
      // A kHostDone never came (a reader failed, or the receive was
      // cancelled): the reader may still know the address.
      std::lock_guard<std::mutex> kept_lock(kept_mu_);
      for (PooledBuffer& s : b->host->staging) kept_staging_.push_back(std::move(s));
    }
    return true;
  };
  lingering_.erase(std::remove_if(lingering_.begin(), lingering_.end(), finished),
                   lingering_.end());
}

bool Communicator::SlicesRead(const Batch& batch) const {
  const HostWait& w = *batch.host;
  if (batch.failed) return false;
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.me) continue;
    const bool read = w.board ? board_->Acked(w.board_index[q], w.board_index[w.me], w.posting)
                              : w.Got(q, 2);
    if (!read && !ProcessExited(w.pids[q])) return false;
  }
  return true;
}

size_t Communicator::DrainLingering() {
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = Deadline();
  bool said = false;
  size_t left = 0;
  {
    // After a failure, readers may never answer (the job is broken): what
    // they may still read stays allocated (~Communicator), nothing waits.
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return 0;
  }
  std::lock_guard<std::mutex> lock(lingering_mu_);
  for (const std::unique_ptr<Batch>& b : lingering_) {
    std::unique_lock<std::mutex> batch_lock(b->mu);
    // A cancelled receive of kHostDone (the batch failed) never completes:
    // nothing to wait for, its staging stays (~Communicator).
    while (!b->failed && !SlicesRead(*b)) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= deadline) {
        ++left;
        break;
      }
      if (!said && now - start > std::chrono::seconds(5)) {
        said = true;
        std::fprintf(stderr, "herring_jax rank %d: shutting down waits for the other processes "
                     "of this host to read its last results (up to HERRING_TIMEOUT_S=%g s)\n",
                     config_.rank, config_.timeout_s);
      }
      // kHostDone notifies; an exited reader is polled.
      b->cv.wait_until(batch_lock, std::min(deadline, now + std::chrono::milliseconds(10)));
    }
  }
  return left;
}

}  // namespace herring::engine
