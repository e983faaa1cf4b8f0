// The allreduce handler for XLA's CUDA platform. Built only when CMake finds
// a CUDA toolkit (HERRING_WITH_CUDA).
//
// Each device buffer is copied on XLA's stream into pinned host staging
// memory, reduced by the same engine as on the CPU (local devices first,
// then across processes), and copied back. Staging buffers come from a pool
// and are reused from call to call. Registering device memory with the
// provider (FI_HMEM, which EFA supports) would skip the staging copies; that
// belongs in the transport and needs no change to the engine.
#include <cuda_runtime_api.h>

#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "handler_common.h"
#include "handlers.h"

namespace herring {
namespace {

// Pinned host buffers, reused: cudaHostAlloc is far too slow per call.
class PinnedPool {
 public:
  static PinnedPool& Get() {
    static auto* pool = new PinnedPool();  // never destroyed: handlers may run late
    return *pool;
  }
  void* Acquire(size_t bytes, std::string* error) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + 4096) {
        void* p = it->second;
        sizes_[p] = it->first;
        free_.erase(it);
        return p;
      }
    }
    void* p = nullptr;
    size_t rounded = (bytes + 4095) / 4096 * 4096;
    cudaError_t err = cudaHostAlloc(&p, rounded == 0 ? 4096 : rounded, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      *error = std::string("cudaHostAlloc of ") + std::to_string(bytes) +
               " bytes failed: " + cudaGetErrorString(err);
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    sizes_[p] = rounded == 0 ? 4096 : rounded;
    return p;
  }
  void Release(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mu_);
    free_.emplace(sizes_[p], p);
  }

 private:
  std::mutex mu_;
  std::multimap<size_t, void*> free_;
  std::map<void*, size_t> sizes_;
};

// Staging buffers of one call, given back to the pool when the call ends.
struct Staging {
  std::vector<void*> buffers;
  ~Staging() {
    for (void* p : buffers) PinnedPool::Get().Release(p);
  }
};

ffi::Error CudaError(const std::string& where, const char* what, cudaError_t err) {
  return ffi::Error::Internal(where + what + " failed: " + cudaGetErrorString(err));
}

ffi::Error CudaAllReduceImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                             CudaInstructionState* instruction, ffi::RemainingArgs args,
                             ffi::RemainingRets rets, int64_t comm_handle, int64_t op,
                             int64_t key, int64_t slot, ffi::Span<const int64_t> device_procs,
                             ffi::Span<const int64_t> device_locals,
                             ffi::Span<const int64_t> device_groups,
                             ffi::Span<const int64_t> group_streams,
                             ffi::Span<const int64_t> group_ranks,
                             ffi::Span<const int64_t> group_offsets) {
  return NoThrow("herring allreduce (CUDA)", [&]() -> ffi::Error {
    CallAttrs attrs{comm_handle,   op,           key,           slot,
                    device_procs,  device_locals, device_groups, group_streams,
                    group_ranks,   group_offsets};
    DecodedCall call;
    call.platform = "cuda";
    ffi::Error error = DecodeCall(args, rets, attrs, &call);
    if (error.failure()) return error;
    const std::string& where = call.where;

    const size_t n = call.dtypes.size();
    const std::vector<const void*> device_in = call.arrival.in;
    std::vector<void*> device_out = call.arrival.out;
    Staging staging;
    for (size_t k = 0; k < n; ++k) {
      const size_t bytes = call.counts[k] * engine::ElementSize(call.dtypes[k]);
      std::string why;
      void* host_in = PinnedPool::Get().Acquire(bytes, &why);
      if (host_in == nullptr) return ffi::Error::Internal(where + why);
      staging.buffers.push_back(host_in);
      void* host_out = PinnedPool::Get().Acquire(bytes, &why);
      if (host_out == nullptr) return ffi::Error::Internal(where + why);
      staging.buffers.push_back(host_out);
      if (bytes > 0) {
        cudaError_t err =
            cudaMemcpyAsync(host_in, device_in[k], bytes, cudaMemcpyDeviceToHost, stream);
        if (err != cudaSuccess) return CudaError(where, "cudaMemcpyAsync to host", err);
      }
      call.arrival.in[k] = host_in;
      call.arrival.out[k] = host_out;
    }
    cudaError_t err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return CudaError(where, "cudaStreamSynchronize", err);

    error = ReduceCall(run_id.run_id, device, *instruction, attrs, call);
    if (error.failure()) return error;

    for (size_t k = 0; k < n; ++k) {
      const size_t bytes = call.counts[k] * engine::ElementSize(call.dtypes[k]);
      if (bytes == 0) continue;
      err = cudaMemcpyAsync(device_out[k], call.arrival.out[k], bytes, cudaMemcpyHostToDevice,
                            stream);
      if (err != cudaSuccess) return CudaError(where, "cudaMemcpyAsync to device", err);
    }
    // The staging buffers go back to the pool when this returns, so the
    // copies out of them must be finished.
    err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return CudaError(where, "cudaStreamSynchronize", err);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduceCuda, CudaAllReduceImpl,
    BindAllReduceAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::RunId>()          // this execution, same on every device
                           .Ctx<ffi::DeviceOrdinal>()  // local ordinal of the calling device
                           .Ctx<ffi::State<CudaInstructionState>>()  // this instruction
                           .RemainingArgs()            // device buffers to reduce
                           .RemainingRets()));         // reduced device buffers

}  // namespace herring
