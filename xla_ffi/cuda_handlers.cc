// The allreduce handlers for XLA's CUDA platform: a start and a done, so that
// the bytes move while the GPU computes. Built only when CMake finds a CUDA
// toolkit (HERRING_WITH_CUDA); compile-checked in CI, run on one H200 by the
// GPU check (docs/guides/gpus.md).
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
// paired by the token's address (cuda_pending.h says why that is exact).
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
// Only the CUDA runtime API is used (statically linked): the module imports
// on machines without a driver and calls CUDA only on CUDA devices.
//
// Registering device memory with the provider (FI_HMEM, which EFA supports)
// would skip the staging copies; that belongs in the transport.
#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cuda_pending.h"
#include "engine/async_runner.h"
#include "engine/buffer_pool.h"
#include "engine/registry.h"
#include "engine/timeline.h"
#include "handler_common.h"
#include "handlers.h"

namespace herring {
namespace {

ffi::Error CudaError(const std::string& where, const char* what, cudaError_t err) {
  return ffi::Error::Internal(where + what + " failed: " + cudaGetErrorString(err) +
                              "; the CUDA context may be unusable: restart the job");
}

// The CUDA device of XLA's stream, on which events must be created.
cudaError_t StreamDevice(cudaStream_t stream, int* device) {
#if CUDART_VERSION >= 12080
  return cudaStreamGetDevice(stream, device);
#else
  // XLA made the stream's context current on this thread (see above), and
  // the runtime reports the device of the current primary context.
  (void)stream;
  return cudaGetDevice(device);
#endif
}

// The host side of one start, for herring's thread: what ReduceCall needs
// (attributes copied out of XLA's call frame) and where the bytes are staged.
struct CudaStart {
  int64_t run_id = 0;
  int32_t device = 0;
  InstructionState instruction;
  OwnedAttrs attrs;
  DecodedCall call;  // arrival points at the staging buffers
  std::vector<engine::PooledBuffer> zeros;  // a broadcast's contribution off the root
  std::shared_ptr<PendingReduction> pending;
  cudaEvent_t copied = nullptr;  // after the copies to staging
  engine::TimelineEvent event;
};

// On herring's thread: waits until the operands are on the host, then
// reduces exactly as the CPU handler does.
void ReduceStarted(const std::shared_ptr<CudaStart>& task) {
  PendingReduction& pending = *task->pending;
  cudaError_t err = WaitAndDestroy(pending.cuda_device, task->copied);
  task->event.begun_ns = engine::Timeline::NowNs();
  ffi::Error done;
  if (err != cudaSuccess) {
    pending.Quarantine();  // the copy into staging may not have finished
    done = CudaError(pending.where, "waiting for the copy to the host", err);
  } else {
    done = NoThrow("herring allreduce start (CUDA)", [&] {
      ffi::Error error = PrepareBroadcast(task->call, &task->attrs.op, &task->zeros);
      if (error.failure()) return error;
      return ReduceCall(task->run_id, task->device, task->instruction, task->attrs.View(),
                        task->call);
    });
  }
  task->event.ended_ns = engine::Timeline::NowNs();
  task->event.ok = !done.failure();
  engine::Timeline::Get().Record(task->event);
  // Drop the task's hold on the communicator (its pooled zeros first) before
  // the done may go on, as handlers.cc does: once it has, the program can
  // call herring_jax.shutdown(), which must hold the last reference, so that
  // the communicator's destructor runs there and not here, on herring's
  // thread, behind the program's back (see ReleaseCall).
  ReleaseCall(&task->call, &task->zeros);
  pending.Finish(std::move(done));
}

ffi::Error StartImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                     CudaInstructionState* instruction, ffi::RemainingArgs args,
                     ffi::RemainingRets rets, HERRING_ATTR_PARAMS) {
  return NoThrow("herring allreduce start (CUDA)", [&]() -> ffi::Error {
    auto task = std::make_shared<CudaStart>();
    task->device = device;
    ReceiveInstructionState(instruction);
    task->instruction = *instruction;
    task->attrs = OwnedAttrs(HERRING_ATTRS);
    task->call.platform = "cuda";
    ffi::Error error = DecodeOperands(args, task->attrs.View(), &task->call);
    if (error.failure()) return error;
    const std::string& where = task->call.where;
    // Here, on the thread that launches the program: launches come in order.
    error = IdentityRun(run_id.run_id, device, *instruction, where, &task->run_id);
    if (error.failure()) return error;
    if (collective != kCollectiveAllReduce) {
      return ffi::Error(ffi::ErrorCode::kUnimplemented,
                        where + "reduce-scatter and all-gather run on XLA:CPU only so far");
    }
    if (rets.size() != 1) {
      return ffi::Error::InvalidArgument(where + "the start returns one token buffer");
    }
    auto token = rets.get<ffi::AnyBuffer>(0);
    if (token.has_error()) return token.error();

    auto pending = std::make_shared<PendingReduction>();
    task->pending = pending;
    pending->where = where;
    pending->key = key;
    cudaError_t err = StreamDevice(stream, &pending->cuda_device);
    if (err != cudaSuccess) return CudaError(where, "finding the stream's device", err);
    const size_t n = task->call.dtypes.size();
    pending->staging.reserve(2 * n);
    for (size_t k = 0; k < n; ++k) {
      auto in = args.get<ffi::AnyBuffer>(k);
      if (in.has_error()) return in.error();
      const size_t bytes = in->size_bytes();
      if (OpFeedback(op) && in->element_type() != ffi::DataType::F32) {
        return ffi::Error::InvalidArgument(where + "error feedback takes float32 operands only");
      }
      pending->types.push_back(in->element_type());
      pending->elements.push_back(in->element_count());
      pending->bytes.push_back(bytes);
      pending->staging.emplace_back(&Pinned(), bytes);
      pending->staging.emplace_back(&Pinned(), bytes);
      if (OpFeedback(op)) pending->lost.emplace_back(&Pinned(), bytes);
      if (!pending->staging[2 * k].ok() || !pending->staging[2 * k + 1].ok() ||
          (OpFeedback(op) && !pending->lost[k].ok())) {
        return ffi::Error::Internal(where + "cudaHostAlloc of " + std::to_string(bytes) +
                                    " bytes failed (" + cudaGetErrorString(cudaGetLastError()) +
                                    "): lower the fusion buffer size or free host memory");
      }
      task->event.bytes += bytes;
    }
    err = CreateWaitEvent(&task->copied);
    if (err != cudaSuccess) return CudaError(where, "cudaEventCreate", err);

    // From here copies into the staging buffers may be in flight: every exit
    // either hands them to herring's thread or waits for the stream first.
    auto fail = [&](ffi::Error e) {
      cudaStreamSynchronize(stream);
      cudaEventDestroy(task->copied);
      return e;
    };
    for (size_t k = 0; k < n; ++k) {
      void* host_in = pending->staging[2 * k].data();
      if (pending->bytes[k] > 0) {
        err = cudaMemcpyAsync(host_in, task->call.arrival.in[k], pending->bytes[k],
                              cudaMemcpyDeviceToHost, stream);
        if (err != cudaSuccess) return fail(CudaError(where, "cudaMemcpyAsync to host", err));
      }
      task->call.arrival.in[k] = host_in;
      task->call.arrival.out.push_back(pending->staging[2 * k + 1].data());
      if (OpFeedback(op)) {
        task->call.arrival.lost.push_back(reinterpret_cast<float*>(pending->lost[k].data()));
      }
    }
    err = cudaEventRecord(task->copied, stream);
    if (err != cudaSuccess) return fail(CudaError(where, "cudaEventRecord", err));

    const PendingKey pairing{run_id.run_id, device,
                             reinterpret_cast<uintptr_t>((*token)->untyped_data())};
    if (!PendingTable::Get().Add(pairing, pending)) {
      return fail(ffi::Error::Internal(
          where + "a reduction started earlier on device " + std::to_string(device) +
          " in this execution has the same token address and was never collected; this is "
          "a herring_jax bug (its start and done are emitted together): please report it"));
    }
    task->event.key = key;
    task->event.slot = slot;
    task->event.device = device;
    task->event.issued_ns = engine::Timeline::NowNs();
    try {
      engine::AsyncRunner::Get().Run([task] { ReduceStarted(task); });
    } catch (const std::exception& e) {
      PendingTable::Get().Claim(pairing);
      return fail(ffi::Error::Internal(where + "could not start a herring thread (" + e.what() +
                                       "): the process is out of threads or memory"));
    }
    return ffi::Error::Success();
  });
}

// How long a done waits for its reduction before it gives up: the engine's
// own timeout, plus time for the GPU to reach the start's copy (the work
// enqueued before it) and for a slow host (HERRING_CUDA_DONE_GRACE_S).
double WaitLimitSeconds(const std::shared_ptr<engine::Communicator>& comm) {
  static const engine::CommConfig kDefaults;
  const engine::CommConfig& config = comm ? comm->config() : kDefaults;
  return config.timeout_s + config.done_grace_s;
}

ffi::Error DoneImpl(cudaStream_t stream, ffi::RunId run_id, int32_t device,
                    ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_handle,
                    int64_t key) {
  return NoThrow("herring allreduce done (CUDA)", [&]() -> ffi::Error {
    std::shared_ptr<engine::Communicator> comm = engine::Registry::Get().Find(comm_handle);
    const std::string where =
        "herring allreduce on rank " + (comm ? std::to_string(comm->rank()) : "?") + ": ";
    if (args.size() < 1) {
      return ffi::Error::InvalidArgument(where + "the done takes its start's token first");
    }
    auto token = args.get<ffi::AnyBuffer>(0);
    if (token.has_error()) return token.error();
    std::shared_ptr<PendingReduction> pending = PendingTable::Get().Claim(
        {run_id.run_id, device, reinterpret_cast<uintptr_t>(token->untyped_data())});
    if (!pending) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          where + "no reduction was started for this done on device " + std::to_string(device) +
              " (its start failed, or XLA copied the token between them); rerun with "
              "the first error of this rank, and report it if there was none");
    }
    const size_t num = pending->types.size();
    const bool feedback = !pending->lost.empty();
    if (pending->key != key || (feedback ? 2 : 1) * num != rets.size()) {
      return ffi::Error::Internal(where + "this done does not match the reduction its token "
                                  "started; this is a herring_jax bug: please report it");
    }
    std::vector<void*> results;
    for (size_t k = 0; k < rets.size(); ++k) {
      auto out = rets.get<ffi::AnyBuffer>(k);
      if (out.has_error()) return out.error();
      // The losses (error feedback) are float32 of their operands' sizes.
      if ((*out)->element_type() != pending->types[k % num] ||
          (*out)->element_count() != pending->elements[k % num]) {
        return ffi::Error::Internal(where + "result " + std::to_string(k) +
                                    " does not match its start's operand; this is a "
                                    "herring_jax bug: please report it");
      }
      results.push_back((*out)->untyped_data());
    }

    // Blocks XLA's host thread; see the top of this file for why that is safe.
    const double limit = WaitLimitSeconds(comm);
    if (!pending->Wait(limit)) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        where + "the reduction started for this done has not ended after " +
                            std::to_string(static_cast<int>(limit)) +
                            " s (HERRING_TIMEOUT_S + HERRING_CUDA_DONE_GRACE_S): the GPU "
                            "has not reached its copy to the host, or the engine is stuck; "
                            "check the GPU and the other ranks' logs");
    }
    ffi::Error error = pending->error();
    if (error.failure()) return error;

    auto release_after_stream = [&](ffi::Error e) {
      cudaStreamSynchronize(stream);  // the copies out of staging, if any
      return e;
    };
    for (size_t k = 0; k < results.size(); ++k) {
      if (pending->bytes[k % num] == 0) continue;
      const void* from = k < num ? pending->staging[2 * k + 1].data()
                                 : pending->lost[k - num].data();
      cudaError_t err = cudaMemcpyAsync(results[k], from, pending->bytes[k % num],
                                        cudaMemcpyHostToDevice, stream);
      if (err != cudaSuccess) {
        return release_after_stream(CudaError(where, "cudaMemcpyAsync to device", err));
      }
    }
    // The staging buffers go back to the pool once the copies out of them
    // have run: a herring thread waits for an event after them, so that
    // neither XLA's thread nor the stream waits (a host function on the
    // stream would hold the stream while it ran).
    cudaEvent_t copied = nullptr;
    cudaError_t err = CreateWaitEvent(&copied);
    if (err == cudaSuccess) err = cudaEventRecord(copied, stream);
    if (err != cudaSuccess) {
      if (copied != nullptr) cudaEventDestroy(copied);
      return release_after_stream(ffi::Error::Success());
    }
    const int cuda_device = pending->cuda_device;
    engine::AsyncRunner::Get().Run([pending, copied, cuda_device]() mutable {
      if (WaitAndDestroy(cuda_device, copied) != cudaSuccess) pending->Quarantine();
      pending.reset();  // staging back to the pool
    });
    return ffi::Error::Success();
  });
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
        .RemainingRets()   // reduced device buffers, the start's operands' types
        .Attr<int64_t>("comm")   // communicator handle, for the rank in messages
        .Attr<int64_t>("key"));  // the start's description hash, checked

}  // namespace herring
