// The allreduce handler for XLA's CUDA platform. Built only when CMake finds
// a CUDA toolkit (HERRING_WITH_CUDA).
//
// Each device buffer is copied on XLA's stream into pinned host staging
// memory, reduced by the same engine as on the CPU (local devices first,
// then across processes), and copied back.
//
// Overlap on XLA:CUDA (not built yet; no GPU has been available to test it).
// On XLA:CPU the handler returns an ffi::Future and the engine finishes the
// reduction on its own threads (handlers.cc): XLA's executor keeps running
// the rest of the backward pass meanwhile (measured). On XLA:CUDA a custom
// call is complete once its work is enqueued on XLA's stream, so the same
// idea needs two calls, placed apart in the stream's order:
//   start: enqueue the device-to-host copy into pinned staging on XLA's
//          stream, record an event, hand the rest to herring's threads
//          (wait for the event there, reduce) and return at once; its result
//          is a small token buffer;
//   done:  (token, operands) -> results: enqueue on XLA's stream a wait for a
//          pinned host flag that herring's thread sets when the sum is in the
//          staging buffer (cuStreamWaitValue32 on the flag's device alias),
//          then the host-to-device copy into XLA's result. Neither call blocks
//          the host thread, and the GPU runs every kernel enqueued between
//          them while the bytes move. The done must take the operands so
//          that XLA keeps them alive, and must be placed where the optimizer
//          first reads the result.
// This handler is the synchronous form of that pair: it copies, waits on the
// host for the reduction, and copies back. Staging buffers come from a pool
// and are reused from call to call. Registering device memory with the
// provider (FI_HMEM, which EFA supports) would skip the staging copies; that
// belongs in the transport and needs no change to the engine.
#include <cuda_runtime_api.h>

#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "engine/buffer_pool.h"
#include "handler_common.h"
#include "handlers.h"

namespace herring {
namespace {

// Pinned host memory for the staging buffers, pooled (engine/buffer_pool.h:
// reused from call to call, what is kept is bounded): cudaHostAlloc is far
// too slow per call.
struct PinnedAllocator {
  static void* Allocate(size_t bytes) {
    void* p = nullptr;
    return cudaHostAlloc(&p, bytes, cudaHostAllocDefault) == cudaSuccess ? p : nullptr;
  }
  static void Free(void* p) { cudaFreeHost(p); }
};
using PinnedPool = engine::BasicBufferPool<PinnedAllocator>;
using PinnedBuffer = engine::BasicPooledBuffer<PinnedPool>;

PinnedPool& Pinned() {
  static auto* pool = new PinnedPool();  // never destroyed: handlers may run late
  return *pool;
}

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
    std::vector<PinnedBuffer> staging;  // back to the pool when this returns
    staging.reserve(2 * n);
    for (size_t k = 0; k < n; ++k) {
      const size_t bytes = call.counts[k] * engine::ElementSize(call.dtypes[k]);
      staging.emplace_back(&Pinned(), bytes);
      staging.emplace_back(&Pinned(), bytes);
      if (!staging[2 * k].ok() || !staging[2 * k + 1].ok()) {
        return ffi::Error::Internal(where + "cudaHostAlloc of " + std::to_string(bytes) +
                                    " bytes failed: " +
                                    cudaGetErrorString(cudaGetLastError()));
      }
      void* host_in = staging[2 * k].data();
      void* host_out = staging[2 * k + 1].data();
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

    std::vector<engine::PooledBuffer> zeros;
    error = PrepareBroadcast(call, &attrs.op, &zeros);
    if (error.failure()) return error;
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
