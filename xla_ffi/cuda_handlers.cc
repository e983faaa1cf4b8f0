// The collective handlers for XLA's CUDA platform (all-reduce, reduce-scatter
// and all-gather, the call's collective attribute): a start and a done, so that
// the bytes move while the GPU computes. Built only when CMake finds a CUDA
// toolkit (HERRING_WITH_CUDA); compile-checked in CI, run on one H200 by the
// GPU check (docs/guides/gpus.md). Their logic is device_handlers.cc, written
// against the device layer (device.h; CUDA's is device_cuda.cc), which the
// CPU suite also runs against the layer's CPU double (double_handlers.cc).
//
// On XLA:CPU one asynchronous call does it all (handlers.cc). On XLA:CUDA a
// custom call is a host function that XLA's thread calls in the order of the
// thunk sequence while the GPU runs behind; its work is whatever it enqueues on
// the stream it is given. So the reduction is split in two calls:
//   start (operands -> token): enqueues the copies of the operands into pinned
//     staging memory on XLA's stream, records an event after them, hands the
//     rest to herring's threads (wait for the event, reduce on the host
//     exactly as the CPU path does) and returns at once;
//   done (token, other tokens -> results): waits on the host for that
//     reduction, then enqueues the copies of the sums into XLA's result
//     buffers on XLA's stream.
// Between the two, XLA's thread enqueues the rest of the backward pass, which
// the GPU runs while herring's threads move the bytes. allreduce_gradients
// (herring_jax/_src/collectives/split.py) makes every done depend on every bucket's
// token, so that no done (and no host wait) comes before the last bucket's
// start, i.e. before the backward pass is enqueued. A start and its done are
// paired by the token's address (device_pending.h says why that is exact).
//
// What this relies on, read in XLA's sources (xla/backends/gpu/runtime/
// custom_call_thunk.cc, xla/service/gpu/gpu_executable.cc):
// - Stream order is the contract for buffers. CustomCallThunk::ExecuteOnStream
//   passes the thunk's stream (GetStreamForExecution) and the device addresses
//   of operands and results (BuildCallFrame); XLA treats the call as done with
//   them once its work is enqueued, and may hand an operand's memory to a later
//   instruction, whose kernels it enqueues later on the same stream (or behind
//   an event on another). So the start must read operands only through work
//   enqueued on that stream (the copies to staging), never from the host after
//   returning; the done must write results only through work enqueued on it.
//   Staging is herring's own: it is kept until the copies out of it are known
//   finished (an event a herring thread waits on) before it is reused.
// - The host runs ahead: ExecuteThunksImpl walks the thunk sequence on the
//   calling thread without waiting for the GPU (it blocks only at the end, and
//   only if the allocator cannot free asynchronously), and
//   ExecuteAsyncOnStreamImpl activates the device's context on that thread for
//   the whole execution. A done that blocks this thread therefore holds back
//   only what comes after it in the sequence; the kernels enqueued before it,
//   and the copy of every start before it, run on. The wait ends: what the
//   done waits for needs only work already enqueued (its start ran before it
//   on this thread: the done reads the start's token), the engine, which fails
//   a reduction after its timeout, and the other processes' starts. Those come
//   before any of their dones in allreduce_gradients (split.py); a reduction
//   bound on its own is a start then its done, so such reductions must come
//   in the same order on every process, as they do in one program compiled
//   the same way (the synchronous handler needed the same). Other local
//   devices run their own thunk sequences on their own
//   threads (xla/pjrt/pjrt_stream_executor_client.cc, Execute: one
//   ExecuteHelper per device on its execute_thread), so one blocked done
//   cannot stop another device's start. While it waits, that device's
//   execute thread does nothing else (PjRt also schedules transfers on it).
// - RunId comes from CollectiveParams, which ExecuteThunksImpl creates for every
//   execution; DeviceOrdinal is BufferAllocations::device_ordinal(), the same
//   for every call of one execution on one device (BuildCallOptions).
// - The instantiate stage runs once per instruction when the thunk is created
//   (CustomCallThunk::Create), as on the CPU: the start numbers its
//   instruction there (call_identity.cc). The done keeps no state.
// - Neither call may be captured into a CUDA graph, which would replay the
//   enqueued copies without calling the host code: XLA converts a custom call
//   into a command buffer only when its handler was registered with the
//   COMMAND_BUFFER_COMPATIBLE trait (CommandBufferScheduling::IsCommand,
//   command_buffer_scheduling.cc; CommandBufferConversionPass), and herring's
//   are registered without traits.
// - has_side_effect (set by the lowering) keeps XLA from deleting or merging
//   either call.
// Only the CUDA runtime API is used (statically linked, device_cuda.cc): the
// module imports on machines without a driver and calls CUDA only on CUDA
// devices.
//
// Registering device memory with the provider (FI_HMEM, which EFA supports)
// would skip the staging copies; that belongs in the transport.
#include <cuda_runtime_api.h>

#include "device.h"
#include "device_handlers.h"
#include "handler_common.h"
#include "handlers.h"

namespace herring {
namespace {

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     CudaInstructionState* instruction, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, HERRING_ATTR_PARAMS) {
  return StartOnDevice(CudaDevice(), stream, run_id.run_id, device, instruction, args, rets,
                       HERRING_ATTRS);
}

ffi::Error DoneImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_handle,
                    int64_t key) {
  return DoneOnDevice(CudaDevice(), stream, run_id.run_id, device, args, rets, comm_handle,
                      key);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduceStartCuda, StartImpl,
    BindAllReduceAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::RunId>()          // this execution, same on every device
                           .Ctx<ffi::DeviceOrdinal>()  // local ordinal of the calling device
                           .Ctx<ffi::State<CudaInstructionState>>()  // this instruction
                           .RemainingArgs()            // device buffers to reduce
                           .RemainingRets()));         // one token buffer, for the done

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduceDoneCuda, DoneImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
        .Ctx<ffi::RunId>()                         // this execution (pairs with the start)
        .Ctx<ffi::DeviceOrdinal>()                 // the calling device (pairs too)
        .RemainingArgs()   // its start's token, then the other buckets' (order only)
        .RemainingRets()   // device results, the start's operands' types (a
                           // reduce-scatter's 1/G of their size, an all-gather's G times)
        .Attr<int64_t>("comm")   // communicator handle, for the rank in messages
        .Attr<int64_t>("key"));  // the start's description hash, checked

}  // namespace herring
