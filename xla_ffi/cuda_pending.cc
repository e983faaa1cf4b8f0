// See cuda_pending.h.
#include "cuda_pending.h"

#include <utility>

namespace herring {

void* PinnedAllocator::Allocate(size_t bytes) {
  void* p = nullptr;
  return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
}

void PinnedAllocator::Free(void* p) { cudaFreeHost(p); }

PinnedPool& Pinned() {
  static auto* pool = new PinnedPool();  // never destroyed: handlers may run late
  return *pool;
}

cudaError_t CreateWaitEvent(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventBlockingSync | cudaEventDisableTiming);
}

cudaError_t WaitAndDestroy(int cuda_device, cudaEvent_t event) {
  cudaError_t err = cudaSetDevice(cuda_device);
  if (err == cudaSuccess) err = cudaEventSynchronize(event);
  // Destroying an event whose work is still pending is allowed (the runtime
  // releases it once complete), so this is safe on every path.
  cudaEventDestroy(event);
  return err;
}

void PendingReduction::Finish(ffi::Error error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    error_ = std::move(error);
    finished_ = true;
    finished_at_ = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

bool PendingReduction::Wait(double seconds) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return finished_; });
}

ffi::Error PendingReduction::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool PendingReduction::FinishedBefore(std::chrono::steady_clock::time_point t) const {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ && finished_at_ < t;
}

void PendingReduction::Quarantine() {
  static std::mutex mu;
  static auto* kept = new std::vector<PinnedBuffer>();  // never freed, never reused
  std::lock_guard<std::mutex> lock(mu);
  for (PinnedBuffer& b : staging) kept->push_back(std::move(b));
  staging.clear();
}

PendingTable& PendingTable::Get() {
  static auto* table = new PendingTable();
  return *table;
}

bool PendingTable::Add(const PendingKey& key, std::shared_ptr<PendingReduction> pending) {
  std::lock_guard<std::mutex> lock(mu_);
  DropAbandoned();
  return pending_.emplace(key, std::move(pending)).second;
}

std::shared_ptr<PendingReduction> PendingTable::Claim(const PendingKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = pending_.find(key);
  if (it == pending_.end()) return nullptr;
  std::shared_ptr<PendingReduction> pending = std::move(it->second);
  pending_.erase(it);
  return pending;
}

void PendingTable::DropAbandoned() {
  const auto before = std::chrono::steady_clock::now() - kAbandoned;
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->second->FinishedBefore(before) ? pending_.erase(it) : std::next(it);
  }
}

}  // namespace herring
