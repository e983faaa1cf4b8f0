// The inside-the-process stage of the hierarchical reduction: XLA calls the
// handler once per local device, concurrently; the calls of one reduction
// meet here and the last one to arrive does the work for all of them.
//
// Identity. A meeting is named by XLA's run id (one value shared by every
// device of one execution, new for each execution), the instruction (an id
// unique in this process, given at XLA's instantiate stage: inlined copies of
// one call site are different instructions) and the group. Nothing is keyed
// on counters that outlive one execution, so computations that group the same
// devices differently, or the same computation dispatched twice without
// waiting, can never pair each other's calls. Inside one execution an
// instruction can run several times per device (a loop); those calls are
// numbered per device, since one device runs them in program order.
//
// Lifetime. A device that gives up waiting for the others (timeout) withdraws
// its buffers before it returns and marks the meeting abandoned: a device that
// arrives later gets an error and never sees the buffers of a call that has
// returned. Once every device has arrived the work runs to its end (it is
// bounded by the communicator's own timeout) and every participant waits for
// it, so no output is written after its call returned.
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
#include <tuple>
#include <vector>

#include "transport/transport.h"

namespace herring::engine {

using transport::Status;

// What one device's call brings: its input and output buffers.
struct LocalArrival {
  std::vector<const void*> in;
  std::vector<void*> out;
  // Error feedback: per buffer, float32 of the input's size, for what this
  // device's contribution lost (ReduceRequest::lost); empty: not asked.
  std::vector<float*> lost;
};

// Names the reduction that local devices meet for (see the file comment).
struct MeetingKey {
  int64_t run_id = 0;        // XLA's id of this execution
  uint64_t instruction = 0;  // the custom call, unique in this process
  std::string group;         // the group's stream and processes
  bool operator<(const MeetingKey& o) const {
    return std::tie(run_id, instruction, group) <
           std::tie(o.run_id, o.instruction, o.group);
  }
};

class LocalRendezvous {
 public:
  using Work = std::function<Status(const std::vector<LocalArrival>&)>;

  // `position` is this device's place among the `expected` local participants
  // (0-based, the order of the local sum). Waits at most `timeout_s` for the
  // others to arrive. Returns the work's status on every participant.
  Status Arrive(const MeetingKey& key, int position, int expected, LocalArrival arrival,
                double timeout_s, const Work& work) {
    if (expected < 1 || position < 0 || position >= expected) {
      return Status::Error("local device position " + std::to_string(position) +
                           " out of range for " + std::to_string(expected) + " devices");
    }
    std::unique_lock<std::mutex> lock(mu_);
    auto it = meetings_.find(key);
    if (it == meetings_.end()) {
      it = meetings_.emplace(key, Meeting{}).first;
      it->second.next.assign(expected, 0);
    }
    Meeting& meeting = it->second;
    if (static_cast<int>(meeting.next.size()) != expected) {
      return Status::Error("local devices disagree on how many of them take part in this "
                           "reduction (" + std::to_string(meeting.next.size()) + " vs " +
                           std::to_string(expected) + ")");
    }
    const uint64_t seq = meeting.next[position]++;
    std::shared_ptr<Slot>& entry = meeting.slots[seq];
    if (!entry) {
      entry = std::make_shared<Slot>();
      entry->arrivals.resize(expected);
    }
    std::shared_ptr<Slot> slot = entry;
    ++slot->touched;
    if (slot->abandoned) {
      Leave(it, seq, *slot);
      return Status::Error(kAbandoned);
    }
    slot->arrivals[position] = std::move(arrival);
    if (++slot->arrived == expected) {
      slot->running = true;
      lock.unlock();
      Status status = work(slot->arrivals);
      lock.lock();
      slot->status = status;
      slot->done = true;
      slot->cv.notify_all();
    } else {
      const bool all_here = slot->cv.wait_for(
          lock, std::chrono::duration<double>(timeout_s),
          [&] { return slot->running || slot->abandoned; });
      if (!all_here || slot->abandoned) {
        // Withdraw this call's buffers: nobody may write them after we return.
        slot->arrivals[position] = LocalArrival{};
        const bool first = !slot->abandoned;
        slot->abandoned = true;
        slot->cv.notify_all();
        Leave(it, seq, *slot);
        return Status::Error(first ? kTimedOut : kAbandoned);
      }
      // Everyone is here: the work is running and is bounded by the
      // communicator's own timeout; its outputs include ours.
      slot->cv.wait(lock, [&] { return slot->done; });
    }
    Status result = slot->status;
    Leave(it, seq, *slot);
    return result;
  }

  // Meetings that still hold state (for tests: 0 when nothing is in flight).
  size_t PendingForTesting() {
    std::lock_guard<std::mutex> lock(mu_);
    return meetings_.size();
  }

 private:
  static constexpr const char* kTimedOut =
      "timed out waiting for the other local devices of this process to reach the same "
      "reduction (they run a different program, or one of them is stuck before it)";
  static constexpr const char* kAbandoned =
      "another local device of this process gave up waiting for this reduction (timed out); "
      "its buffers were withdrawn and nothing was reduced";

  struct Slot {
    std::condition_variable cv;
    std::vector<LocalArrival> arrivals;
    int arrived = 0;   // buffers deposited
    int touched = 0;   // calls that reached this slot, abandoned or not
    int left = 0;      // calls that are done with it
    bool running = false;
    bool done = false;
    bool abandoned = false;
    Status status;
  };
  struct Meeting {
    std::vector<uint64_t> next;  // [position] sequence number of its next call
    std::map<uint64_t, std::shared_ptr<Slot>> slots;
  };

  // Called with mu_ held by each participant when it is done with `slot`.
  // The slot goes once every expected device has touched it and left; the
  // meeting goes once it has no slot and no device is ahead of another, so the
  // next call of the same instruction in the same run starts from 0 everywhere.
  void Leave(std::map<MeetingKey, Meeting>::iterator it, uint64_t seq, Slot& slot) {
    Meeting& meeting = it->second;
    const int expected = static_cast<int>(meeting.next.size());
    if (++slot.left < expected || slot.touched < expected) return;
    meeting.slots.erase(seq);
    if (!meeting.slots.empty()) return;
    for (uint64_t n : meeting.next) {
      if (n != meeting.next.front()) return;
    }
    meetings_.erase(it);
  }

  std::mutex mu_;
  std::map<MeetingKey, Meeting> meetings_;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_LOCAL_RENDEZVOUS_H_
