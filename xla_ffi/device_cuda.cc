// The device layer on XLA:CUDA (device.h): the CUDA runtime API only
// (statically linked), so that the module imports on machines without a
// driver and calls CUDA only on CUDA devices. Built only with a CUDA toolkit
// (HERRING_WITH_CUDA).
#include <cuda_runtime_api.h>

#include <string>

#include "device.h"
#include "engine/buffer_pool.h"

namespace herring {
namespace {

// Pinned host memory, pooled (engine/buffer_pool.h: reused from call to call,
// what is kept is bounded): cudaHostAlloc is far too slow per call. Portable:
// one pool serves every local device (with unified addressing it is anyway).
struct PinnedAllocator {
  static void* Allocate(size_t bytes) {
    void* p = nullptr;
    return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
  }
  static void Free(void* p) { cudaFreeHost(p); }
};
using PinnedPool = engine::BasicBufferPool<PinnedAllocator>;

DeviceStatus Check(cudaError_t err) {
  if (err == cudaSuccess) return DeviceStatus::Ok();
  return DeviceStatus::Error(std::string(cudaGetErrorString(err)) +
                             "; the CUDA context may be unusable: restart the job");
}

cudaStream_t AsStream(Device::Stream s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t AsEvent(Device::Event e) { return static_cast<cudaEvent_t>(e); }

class Cuda final : public Device {
 public:
  const char* platform() const override { return "cuda"; }
  const char* name() const override { return "CUDA"; }

  void* AcquireStaging(size_t bytes, size_t* capacity) override {
    return pool_.Acquire(bytes, capacity).release();
  }
  void ReleaseStaging(void* data, size_t capacity) override {
    pool_.Release(PinnedPool::Ptr(data), capacity);
  }
  std::string StagingError() override { return cudaGetErrorString(cudaGetLastError()); }

  DeviceStatus StreamDevice(Stream stream, int* device) override {
#if CUDART_VERSION >= 12080
    return Check(cudaStreamGetDevice(AsStream(stream), device));
#else
    // XLA made the stream's context current on this thread (it activates
    // the device's context for the whole execution), and the runtime
    // reports the device of the current primary context.
    (void)stream;
    return Check(cudaGetDevice(device));
#endif
  }

  DeviceStatus CopyToHost(void* host, const void* from, size_t bytes, Stream stream) override {
    return Check(cudaMemcpyAsync(host, from, bytes, cudaMemcpyDeviceToHost, AsStream(stream)));
  }
  DeviceStatus CopyToDevice(void* to, const void* host, size_t bytes, Stream stream) override {
    return Check(cudaMemcpyAsync(to, host, bytes, cudaMemcpyHostToDevice, AsStream(stream)));
  }

  // BlockingSync: the waiting thread sleeps instead of spinning a core (the
  // context's default, which XLA leaves at CU_CTX_SCHED_AUTO, may spin). No
  // timing: cheaper to record.
  DeviceStatus CreateEvent(Event* event) override {
    cudaEvent_t e = nullptr;
    cudaError_t err =
        cudaEventCreateWithFlags(&e, cudaEventBlockingSync | cudaEventDisableTiming);
    *event = e;
    return Check(err);
  }
  DeviceStatus RecordEvent(Event event, Stream stream) override {
    return Check(cudaEventRecord(AsEvent(event), AsStream(stream)));
  }
  DeviceStatus QueryEvent(Event event, bool* reached) override {
    cudaError_t err = cudaEventQuery(AsEvent(event));
    *reached = err == cudaSuccess;
    return Check(err == cudaErrorNotReady ? cudaSuccess : err);
  }
  // The device is made current first: the runtime then uses its primary
  // context, which XLA created (it retains primary contexts,
  // stream_executor/cuda/cuda_context.cc, CudaContext::Create), instead of
  // initialising device 0's on a herring thread that has none.
  DeviceStatus WaitAndDestroy(int device, Event event) override {
    cudaError_t err = cudaSetDevice(device);
    if (err == cudaSuccess) err = cudaEventSynchronize(AsEvent(event));
    // Destroying an event whose work is still pending is allowed (the
    // runtime releases it once complete), so this is safe on every path.
    cudaEventDestroy(AsEvent(event));
    return Check(err);
  }
  void DestroyEvent(Event event) override { cudaEventDestroy(AsEvent(event)); }
  DeviceStatus SynchronizeStream(Stream stream) override {
    return Check(cudaStreamSynchronize(AsStream(stream)));
  }

 private:
  PinnedPool pool_;
};

}  // namespace

Device& CudaDevice() {
  static auto* device = new Cuda();  // never destroyed: handlers may run late
  return *device;
}

}  // namespace herring
