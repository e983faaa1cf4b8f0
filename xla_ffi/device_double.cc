// See device_double.h.
#include "device_double.h"

#include <signal.h>  // kill: the fault hook's kill
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <sstream>
#include <thread>
#include <utility>

namespace herring {
namespace {

// Where a recorded event stands. Recording again moves the mark on, as
// cudaEventRecord does; the stream reaching a record marks it reached.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;  // records made
  uint64_t reached = 0;   // of those, the last one the stream got to
  std::string error;      // the stream's error when it got there
};
using EventHandle = std::shared_ptr<EventState>;  // Device::Event points at one

EventHandle& AsHandle(Device::Event e) { return *static_cast<EventHandle*>(e); }

struct Counters {
  std::atomic<uint64_t> copies_to_host{0}, copies_to_device{0}, bytes_to_host{0},
      bytes_to_device{0}, events_reached{0}, waits_in_flight{0}, delayed{0}, failed{0};
};
Counters& Count() {
  static auto* counters = new Counters();
  return *counters;
}

}  // namespace

// One stream: its work in order, run by a thread of its own.
class DeviceDouble::DoubleStream {
 public:
  DoubleStream(int32_t device, bool held) : device_(device), held_(held) {
    // Detached and never ended: streams live as long as the process, as the
    // double does (handlers may run late).
    std::thread([this] { Loop(); }).detach();
  }
  int32_t device() const { return device_; }

  struct Op {
    // A copy (event null), or a record of `event`'s mark `mark`.
    void* to = nullptr;
    const void* from = nullptr;
    size_t bytes = 0;
    bool to_host = true;
    uint64_t number = 0;  // the copy's number that way (the fault hook's N)
    Fault fault;          // number 0: none
    EventHandle event;
    uint64_t mark = 0;
  };

  // Enqueues `op`, or says why not: an earlier copy's error sticks.
  DeviceStatus Enqueue(Op op) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return DeviceStatus::Error(error_);
    ops_.push_back(std::move(op));
    cv_.notify_all();
    return DeviceStatus::Ok();
  }

  void SetHeld(bool held) {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = held;
    cv_.notify_all();
  }

  DeviceStatus Synchronize() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ops_.empty() && !busy_; });
    return error_.empty() ? DeviceStatus::Ok() : DeviceStatus::Error(error_);
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !ops_.empty() && !held_; });
      Op op = std::move(ops_.front());
      ops_.pop_front();
      busy_ = true;
      const std::string error = error_;
      lock.unlock();
      std::string failed = Run(op, error);
      lock.lock();
      if (!failed.empty() && error_.empty()) error_ = failed;
      busy_ = false;
      cv_.notify_all();
    }
  }

  // Runs one op outside the lock; returns the error it leaves, if any.
  static std::string Run(const Op& op, const std::string& error) {
    if (op.event) {
      {
        std::lock_guard<std::mutex> lock(op.event->mu);
        if (op.mark > op.event->reached) op.event->reached = op.mark;
        op.event->error = error;
      }
      op.event->cv.notify_all();
      Count().events_reached++;
      return "";
    }
    if (!error.empty()) return "";  // a broken stream runs no more copies
    const char* way = op.to_host ? "to the host" : "to the device";
    if (op.fault.number != 0) {
      switch (op.fault.kind) {
        case Fault::kKill:
          std::fprintf(stderr, "herring_jax: the CPU double's fault hook kills this process "
                       "while copy %llu %s is in flight\n",
                       static_cast<unsigned long long>(op.number), way);
          std::fflush(stderr);
          ::kill(::getpid(), SIGKILL);
          break;
        case Fault::kFail:
          Count().failed++;
          return "copy " + std::to_string(op.number) + " " + way + " failed (the CPU double's "
                 "fault hook, HERRING_TEST_DEVICE_FAULT); the device may be unusable: restart "
                 "the job";
        case Fault::kDelay:
          Count().delayed++;
          std::this_thread::sleep_for(std::chrono::milliseconds(op.fault.delay_ms));
          break;
      }
    }
    if (op.bytes > 0) std::memcpy(op.to, op.from, op.bytes);
    Counters& c = Count();
    (op.to_host ? c.copies_to_host : c.copies_to_device)++;
    (op.to_host ? c.bytes_to_host : c.bytes_to_device) += op.bytes;
    return "";
  }

  const int32_t device_;
  std::mutex mu_;
  std::condition_variable cv_;  // work enqueued, or an op ended
  std::deque<Op> ops_;
  bool busy_ = false;  // the thread runs an op taken off ops_
  bool held_;          // HoldStreams: take up no work
  std::string error_;  // the first failed copy's, sticky
};

DeviceDouble& DeviceDouble::Get() {
  static auto* device = new DeviceDouble();
  return *device;
}

Device::Stream DeviceDouble::StreamFor(int32_t device) {
  std::lock_guard<std::mutex> lock(mu_);
  std::unique_ptr<DoubleStream>& stream = streams_[device];
  if (!stream) stream = std::make_unique<DoubleStream>(device, held_);
  return stream.get();
}

std::string DeviceDouble::SetFaults(const std::string& spec) {
  std::vector<Fault> faults;
  std::stringstream rules(spec);
  std::string rule;
  while (std::getline(rules, rule, ',')) {
    if (rule.empty()) continue;
    std::vector<std::string> parts;
    std::stringstream fields(rule);
    for (std::string f; std::getline(fields, f, ':');) parts.push_back(f);
    Fault fault;
    const bool kind_ok = !parts.empty() && (parts[0] == "delay" || parts[0] == "fail" ||
                                            parts[0] == "kill");
    const size_t want = kind_ok && parts[0] == "delay" ? 4 : 3;
    long long number = 0, ms = 0;
    bool ok = kind_ok && parts.size() == want && (parts[1] == "host" || parts[1] == "device");
    try {
      if (ok) number = std::stoll(parts[2]);
      if (ok && want == 4) ms = std::stoll(parts[3]);
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok || number < 1 || ms < 0 || ms > 600000) {
      return "HERRING_TEST_DEVICE_FAULT: '" + rule + "' is not KIND:WAY:N[:MS]: KIND delay "
             "(with MS, 0 to 600000), fail or kill, WAY host or device, N a copy number from 1 "
             "(e.g. delay:host:2:1500,kill:device:3)";
    }
    fault.kind = parts[0] == "delay" ? Fault::kDelay
                 : parts[0] == "fail" ? Fault::kFail : Fault::kKill;
    fault.to_host = parts[1] == "host";
    fault.number = static_cast<uint64_t>(number);
    fault.delay_ms = static_cast<int>(ms);
    faults.push_back(fault);
  }
  std::lock_guard<std::mutex> lock(mu_);
  faults_ = std::move(faults);
  enqueued_[0] = enqueued_[1] = 0;
  return "";
}

DoubleStats DeviceDouble::Stats() const {
  const Counters& c = Count();
  DoubleStats s;
  s.copies_to_host = c.copies_to_host;
  s.copies_to_device = c.copies_to_device;
  s.bytes_to_host = c.bytes_to_host;
  s.bytes_to_device = c.bytes_to_device;
  s.events_reached = c.events_reached;
  s.waits_in_flight = c.waits_in_flight;
  s.delayed = c.delayed;
  s.failed = c.failed;
  return s;
}

void* DeviceDouble::AcquireStaging(size_t bytes, size_t* capacity) {
  return staging_.Acquire(bytes, capacity).release();
}

void DeviceDouble::ReleaseStaging(void* data, size_t capacity) {
  staging_.Release(engine::BufferPool::Ptr(data), capacity);
}

DeviceStatus DeviceDouble::StreamDevice(Stream stream, int* device) {
  *device = static_cast<DoubleStream*>(stream)->device();
  return DeviceStatus::Ok();
}

void DeviceDouble::HoldStreams(bool hold) {
  std::lock_guard<std::mutex> lock(mu_);
  held_ = hold;
  for (auto& [device, stream] : streams_) stream->SetHeld(hold);
}

DeviceStatus DeviceDouble::Copy(void* to, const void* from, size_t bytes, bool to_host,
                                Stream stream) {
  DoubleStream::Op op;
  op.to = to;
  op.from = from;
  op.bytes = bytes;
  op.to_host = to_host;
  {
    // Numbered under the lock that orders them, so N means enqueue order.
    std::lock_guard<std::mutex> lock(mu_);
    op.number = ++enqueued_[to_host ? 1 : 0];
    for (const Fault& f : faults_) {
      if (f.to_host == to_host && f.number == op.number) op.fault = f;
    }
    return static_cast<DoubleStream*>(stream)->Enqueue(std::move(op));
  }
}

DeviceStatus DeviceDouble::CopyToHost(void* host, const void* from, size_t bytes,
                                      Stream stream) {
  return Copy(host, from, bytes, true, stream);
}

DeviceStatus DeviceDouble::CopyToDevice(void* to, const void* host, size_t bytes,
                                        Stream stream) {
  return Copy(to, host, bytes, false, stream);
}

DeviceStatus DeviceDouble::CreateEvent(Event* event) {
  *event = new EventHandle(std::make_shared<EventState>());
  return DeviceStatus::Ok();
}

DeviceStatus DeviceDouble::RecordEvent(Event event, Stream stream) {
  EventHandle state = AsHandle(event);
  DoubleStream::Op op;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    op.mark = ++state->recorded;
  }
  op.event = std::move(state);
  return static_cast<DoubleStream*>(stream)->Enqueue(std::move(op));
}

DeviceStatus DeviceDouble::QueryEvent(Event event, bool* reached) {
  EventState& state = *AsHandle(event);
  std::lock_guard<std::mutex> lock(state.mu);
  *reached = state.reached >= state.recorded;
  return *reached && !state.error.empty() ? DeviceStatus::Error(state.error)
                                          : DeviceStatus::Ok();
}

DeviceStatus DeviceDouble::WaitAndDestroy(int device, Event event) {
  (void)device;  // one double serves every device
  EventHandle state = AsHandle(event);
  DestroyEvent(event);
  std::unique_lock<std::mutex> lock(state->mu);
  if (state->reached < state->recorded) Count().waits_in_flight++;
  state->cv.wait(lock, [&] { return state->reached >= state->recorded; });
  return state->error.empty() ? DeviceStatus::Ok() : DeviceStatus::Error(state->error);
}

void DeviceDouble::DestroyEvent(Event event) { delete static_cast<EventHandle*>(event); }

DeviceStatus DeviceDouble::SynchronizeStream(Stream stream) {
  return static_cast<DoubleStream*>(stream)->Synchronize();
}

}  // namespace herring
