// The CPU double of the device layer (device.h), for tests: what the CUDA
// handlers' logic (device_handlers.cc) sees of a GPU, imitated on the host, so
// that the CPU suite runs that logic (double_handlers.cc binds it to XLA:CPU).
//
// Each device has a stream: a thread of its own that runs the stream's work
// in the order it was enqueued, copies with memcpy, and marks an event
// reached when it gets to it, as a GPU stream does. Like CUDA's, an error of
// an enqueued copy sticks: it shows at the events after it, and every later
// call on that stream fails with it. A fault hook (SetFaults, from
// HERRING_TEST_DEVICE_FAULT) delays a copy, fails it, or kills the process
// while the copy is in flight.
#ifndef HERRING_DEVICE_DOUBLE_H_
#define HERRING_DEVICE_DOUBLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "device.h"
#include "engine/buffer_pool.h"

namespace herring {

// Counts of what the double did in this process, for tests to prove it ran.
struct DoubleStats {
  uint64_t copies_to_host = 0, copies_to_device = 0;
  uint64_t bytes_to_host = 0, bytes_to_device = 0;
  uint64_t events_reached = 0;
  // WaitAndDestroy calls that found their event not yet reached (a host
  // thread that waited for the stream: a copy was in flight).
  uint64_t waits_in_flight = 0;
  uint64_t delayed = 0, failed = 0;  // copies the fault hook delayed or failed
};

class DeviceDouble final : public Device {
 public:
  static DeviceDouble& Get();  // never destroyed: handlers may run late

  // The stream of `device` (XLA:CPU's DeviceOrdinal), made on first use.
  Stream StreamFor(int32_t device);

  // The fault hook: comma-separated rules KIND:WAY:N[:MS]. KIND is delay
  // (MS milliseconds before the copy runs), fail (the copy never runs and
  // its stream's error sticks) or kill (SIGKILL to this process when the
  // stream takes the copy up); WAY is host (copies to the host, the starts')
  // or device (to the device, the dones'); N counts this process's copies
  // that way from 1, in the order they were enqueued. "" clears the rules.
  // Returns "" or what is wrong with `spec`.
  std::string SetFaults(const std::string& spec);
  DoubleStats Stats() const;
  // For tests of timing: while held, no stream takes up work (enqueuing goes
  // on), so what a test reads of it cannot race a copy; releasing lets every
  // stream run what waits.
  void HoldStreams(bool hold);

  const char* platform() const override { return "cpu"; }
  const char* name() const override { return "CPU double"; }
  void* AcquireStaging(size_t bytes, size_t* capacity) override;
  void ReleaseStaging(void* data, size_t capacity) override;
  std::string StagingError() override { return "out of host memory"; }
  DeviceStatus StreamDevice(Stream stream, int* device) override;
  DeviceStatus CopyToHost(void* host, const void* from, size_t bytes, Stream stream) override;
  DeviceStatus CopyToDevice(void* to, const void* host, size_t bytes, Stream stream) override;
  DeviceStatus CreateEvent(Event* event) override;
  DeviceStatus RecordEvent(Event event, Stream stream) override;
  DeviceStatus QueryEvent(Event event, bool* reached) override;
  DeviceStatus WaitAndDestroy(int device, Event event) override;
  void DestroyEvent(Event event) override;
  DeviceStatus SynchronizeStream(Stream stream) override;

  struct Fault {
    enum Kind { kDelay, kFail, kKill } kind = kDelay;
    bool to_host = true;
    uint64_t number = 0;
    int delay_ms = 0;
  };
  class DoubleStream;  // device_double.cc

 private:
  DeviceDouble() = default;
  DeviceStatus Copy(void* to, const void* from, size_t bytes, bool to_host, Stream stream);

  mutable std::mutex mu_;
  std::map<int32_t, std::unique_ptr<DoubleStream>> streams_;
  std::vector<Fault> faults_;
  bool held_ = false;  // HoldStreams
  uint64_t enqueued_[2] = {0, 0};  // copies enqueued: [0] to the device, [1] to the host
  engine::BufferPool staging_;
};

}  // namespace herring

#endif  // HERRING_DEVICE_DOUBLE_H_
