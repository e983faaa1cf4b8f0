// When each reduction was issued by XLA, taken up by herring's threads and
// finished, for timelines of a training step (herring-jax train-bench and
// HERRING_TIMELINE's Chrome traces, herring_jax/_src/process/timeline.py). Times
// are CLOCK_MONOTONIC nanoseconds, the clock of Python's time.monotonic_ns().
// The last kCapacity events are kept; recording is a lock and a copy.
#ifndef HERRING_ENGINE_TIMELINE_H_
#define HERRING_ENGINE_TIMELINE_H_

#include <time.h>

#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

namespace herring::engine {

struct TimelineEvent {
  int64_t key = 0;        // what is reduced (lowering.key): names it, with slot
  int64_t slot = 0;       // call site in its module
  int64_t device = 0;     // the device whose call this was
  uint64_t bytes = 0;     // this device's operands
  int64_t issued_ns = 0;  // XLA called the handler
  int64_t begun_ns = 0;   // a herring thread took it up
  int64_t ended_ns = 0;   // the result was complete (or failed)
  bool ok = true;
};

class Timeline {
 public:
  static Timeline& Get() {
    static auto* timeline = new Timeline();  // never destroyed: handlers may run late
    return *timeline;
  }
  static int64_t NowNs() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
  }
  void Record(const TimelineEvent& e) {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(e);
    if (events_.size() > kCapacity) events_.pop_front();
  }
  // Returns the events recorded so far and forgets them.
  std::vector<TimelineEvent> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<TimelineEvent> out(events_.begin(), events_.end());
    events_.clear();
    return out;
  }

 private:
  static constexpr size_t kCapacity = 1 << 14;
  std::mutex mu_;
  std::deque<TimelineEvent> events_;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_TIMELINE_H_
