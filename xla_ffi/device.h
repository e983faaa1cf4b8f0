// The device layer under the start/done handlers (device_handlers.cc): what
// their logic needs of an accelerator, and nothing more. Two implementations:
//   CudaDevice (device_cuda.cc, built with a CUDA toolkit): XLA:CUDA's stream,
//     pinned host memory, cudaMemcpyAsync and events;
//   the CPU double (device_double.cc, always built): a stream of its own
//     (copies run in order on a thread, events complete when that thread
//     reaches them) with a fault hook that delays or fails a copy, so that
//     the CUDA handlers' code runs in the CPU suite (double_handlers.cc).
// Everything here may be called from any thread; nothing throws.
#ifndef HERRING_DEVICE_H_
#define HERRING_DEVICE_H_

#include <cstddef>
#include <string>
#include <utility>

#include "transport/transport.h"

namespace herring {

using DeviceStatus = transport::Status;

class Device {
 public:
  using Stream = void*;  // XLA's stream (a cudaStream_t), or one of the double's
  using Event = void*;   // made by CreateEvent, ended by WaitAndDestroy or DestroyEvent

  virtual ~Device() = default;

  // Whose local device table names the devices (call_identity.cc):
  // "cuda" for XLA:CUDA's ordinals, "cpu" for XLA:CPU's global ids.
  virtual const char* platform() const = 0;
  // How the handlers' messages name what they run on: "CUDA", "the CPU double".
  virtual const char* name() const = 0;

  // Staging: host memory the device copies into and out of asynchronously
  // (pinned on CUDA), pooled by the implementation. Null when none could be
  // had; StagingError() then says why.
  virtual void* AcquireStaging(size_t bytes, size_t* capacity) = 0;
  virtual void ReleaseStaging(void* data, size_t capacity) = 0;
  virtual std::string StagingError() = 0;

  // The device number of `stream` (for events and WaitAndDestroy).
  virtual DeviceStatus StreamDevice(Stream stream, int* device) = 0;
  // Enqueue a copy on `stream`; it runs after everything enqueued before it.
  // An error of the copy itself may only show at a later event.
  virtual DeviceStatus CopyToHost(void* host, const void* from, size_t bytes,
                                  Stream stream) = 0;
  virtual DeviceStatus CopyToDevice(void* to, const void* host, size_t bytes,
                                    Stream stream) = 0;
  // An event for a host thread to wait on.
  virtual DeviceStatus CreateEvent(Event* event) = 0;
  // Marks the point of `stream` reached once everything enqueued so far ran.
  virtual DeviceStatus RecordEvent(Event event, Stream stream) = 0;
  // Whether the stream has reached the event (an event never recorded has).
  virtual DeviceStatus QueryEvent(Event event, bool* reached) = 0;
  // Waits until the stream reached `event` (recorded on `device`), destroys
  // it, and says whether the work before it ran without error.
  virtual DeviceStatus WaitAndDestroy(int device, Event event) = 0;
  // Destroying an event whose work is still pending is allowed.
  virtual void DestroyEvent(Event event) = 0;
  // Waits on the host until everything enqueued on `stream` ran.
  virtual DeviceStatus SynchronizeStream(Stream stream) = 0;
};

// XLA:CUDA's device (device_cuda.cc; only in builds with a CUDA toolkit).
Device& CudaDevice();

// A staging buffer of a device's pool, given back to it when destroyed.
class StagingBuffer {
 public:
  StagingBuffer() = default;
  StagingBuffer(Device* device, size_t bytes) : device_(device) {
    data_ = device->AcquireStaging(bytes, &capacity_);
  }
  StagingBuffer(StagingBuffer&& o) noexcept { *this = std::move(o); }
  StagingBuffer& operator=(StagingBuffer&& o) noexcept {
    if (this != &o) {
      Give();
      device_ = std::exchange(o.device_, nullptr);
      data_ = std::exchange(o.data_, nullptr);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }
  StagingBuffer(const StagingBuffer&) = delete;
  StagingBuffer& operator=(const StagingBuffer&) = delete;
  ~StagingBuffer() { Give(); }

  char* data() const { return static_cast<char*>(data_); }
  bool ok() const { return data_ != nullptr; }

 private:
  void Give() {
    if (device_ != nullptr && data_ != nullptr) device_->ReleaseStaging(data_, capacity_);
    data_ = nullptr;
  }
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace herring

#endif  // HERRING_DEVICE_H_
