// See device_pending.h.
#include "device_pending.h"

#include <utility>

namespace herring {

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
  // Kept reachable (a leak checker sees memory in use), never freed, never reused.
  static std::mutex mu;
  static auto* kept = new std::vector<StagingBuffer>();
  std::lock_guard<std::mutex> lock(mu);
  for (StagingBuffer& b : staging) kept->push_back(std::move(b));
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
