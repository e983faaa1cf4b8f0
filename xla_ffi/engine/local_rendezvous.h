// The inside-the-process stage of the hierarchical reduction: XLA calls the
// handler once per local device, concurrently; the calls of one reduction
// meet here and the last one to arrive does the work for all of them.
#ifndef HERRING_ENGINE_LOCAL_RENDEZVOUS_H_
#define HERRING_ENGINE_LOCAL_RENDEZVOUS_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace herring::engine {

using transport::Status;

// What one device's call brings: its input and output buffers.
struct LocalArrival {
  std::vector<const void*> in;
  std::vector<void*> out;
};

class LocalRendezvous {
 public:
  using Work = std::function<Status(const std::vector<LocalArrival>&)>;

  // `group_key` names the reduction group; `position` is this device's place
  // among the `expected` local participants (0-based, the order of the local
  // sum). Calls are matched by their sequence number per (group, position).
  // Returns the work's status on every participant.
  Status Arrive(const std::string& group_key, int position, int expected,
                LocalArrival arrival, double timeout_s, const Work& work) {
    std::shared_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      uint64_t seq = sequence_[{group_key, position}]++;
      auto& entry = slots_[{group_key, seq}];
      if (!entry) {
        entry = std::make_shared<Slot>();
        entry->arrivals.resize(expected);
        entry->key = {group_key, seq};
      }
      slot = entry;
    }
    std::unique_lock<std::mutex> lock(slot->mu);
    if (position < 0 || position >= static_cast<int>(slot->arrivals.size())) {
      return Status::Error("local device position out of range");
    }
    slot->arrivals[position] = std::move(arrival);
    if (++slot->arrived == expected) {
      lock.unlock();
      Status status = work(slot->arrivals);
      lock.lock();
      slot->status = status;
      slot->done = true;
      slot->cv.notify_all();
    } else {
      bool done = slot->cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                    [&] { return slot->done; });
      if (!done) {
        return Status::Error("timed out waiting for the other local devices of this "
                             "process to reach the same reduction");
      }
    }
    Status result = slot->status;
    if (++slot->left == expected) {
      lock.unlock();
      std::lock_guard<std::mutex> guard(mu_);
      slots_.erase(slot->key);
    }
    return result;
  }

 private:
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<LocalArrival> arrivals;
    int arrived = 0;
    int left = 0;
    bool done = false;
    Status status;
    std::pair<std::string, uint64_t> key;
  };
  std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> sequence_;
  std::map<std::pair<std::string, uint64_t>, std::shared_ptr<Slot>> slots_;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_LOCAL_RENDEZVOUS_H_
