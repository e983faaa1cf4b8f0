// The start/done pair on a device with a stream (device_handlers.h), written
// against the device layer (device.h) only: no CUDA here. cuda_handlers.cc
// binds it to XLA:CUDA and says which of XLA's rules it relies on;
// double_handlers.cc binds it to XLA:CPU with the CPU double as its device.
#include "device_handlers.h"

#include <algorithm>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "device_pending.h"
#include "engine/async_runner.h"
#include "engine/buffer_pool.h"
#include "engine/registry.h"
#include "engine/timeline.h"

namespace herring {
namespace {

ffi::Error DeviceError(const std::string& where, const char* what, const DeviceStatus& s) {
  return ffi::Error::Internal(where + what + " failed: " + s.message());
}

// The host side of one start, for herring's thread: what ReduceCall needs
// (attributes copied out of XLA's call frame) and where the bytes are staged.
struct DeviceStart {
  int64_t run_id = 0;
  int32_t device = 0;
  InstructionState instruction;
  OwnedAttrs attrs;
  DecodedCall call;  // arrival points at the staging buffers
  std::vector<engine::PooledBuffer> zeros;  // a broadcast's contribution off the root
  std::shared_ptr<PendingReduction> pending;
  Device::Event copied = nullptr;  // after the copies to staging
  engine::TimelineEvent event;
};

// On herring's thread: waits until the operands are on the host, then
// reduces exactly as the CPU handler does.
void ReduceStarted(const std::shared_ptr<DeviceStart>& task) {
  PendingReduction& pending = *task->pending;
  DeviceStatus copied = pending.device->WaitAndDestroy(pending.stream_device, task->copied);
  task->event.begun_ns = engine::Timeline::NowNs();
  ffi::Error done;
  if (!copied.ok()) {
    pending.Quarantine();  // the copy into staging may not have finished
    done = DeviceError(pending.where, "waiting for the copy to the host", copied);
  } else {
    done = NoThrow("herring allreduce start (device)", [&] {
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

// How long a done waits for its reduction before it gives up: the engine's
// own timeout, plus time for the device to reach the start's copy (the work
// enqueued before it) and for a slow host (HERRING_CUDA_DONE_GRACE_S).
double WaitLimitSeconds(const std::shared_ptr<engine::Communicator>& comm) {
  static const engine::CommConfig kDefaults;
  const engine::CommConfig& config = comm ? comm->config() : kDefaults;
  return config.timeout_s + config.done_grace_s;
}

}  // namespace

ffi::Error StartOnDevice(Device& on, Device::Stream stream, int64_t run_id, int32_t device,
                         InstructionState* instruction, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, const CallAttrs& call_attrs) {
  const std::string what = std::string("herring allreduce start (") + on.name() + ")";
  return NoThrow(what.c_str(), [&]() -> ffi::Error {
    auto task = std::make_shared<DeviceStart>();
    task->device = device;
    ReceiveInstructionState(instruction);
    task->instruction = *instruction;
    task->attrs = OwnedAttrs(call_attrs);
    const OwnedAttrs& attrs = task->attrs;
    task->call.platform = on.platform();
    ffi::Error error = DecodeOperands(args, attrs.View(), &task->call);
    if (error.failure()) return error;
    const std::string& where = task->call.where;
    // Here, on the thread that launches the program: launches come in order.
    error = IdentityRun(run_id, device, *instruction, where, &task->run_id);
    if (error.failure()) return error;
    // The results' sizes: the start returns only a token, and the reduction
    // (on herring's thread, before the done is called) needs its results'
    // staging now.
    size_t blocks = 1;
    if (attrs.collective != kCollectiveAllReduce) {
      CallPlace place;
      error = LocateCall(attrs.View(), device, task->call, &place);
      if (error.failure()) return error;
      blocks = GroupBlocks(attrs.View(), place);
      if (blocks == 0) return ffi::Error::InvalidArgument(where + "the group has no devices");
    }
    if (rets.size() != 1) {
      return ffi::Error::InvalidArgument(where + "the start returns one token buffer");
    }
    auto token = rets.get<ffi::AnyBuffer>(0);
    if (token.has_error()) return token.error();

    auto pending = std::make_shared<PendingReduction>();
    task->pending = pending;
    pending->where = where;
    pending->key = attrs.key;
    pending->device = &on;
    DeviceStatus status = on.StreamDevice(stream, &pending->stream_device);
    if (!status.ok()) return DeviceError(where, "finding the stream's device", status);
    const bool feedback = OpFeedback(attrs.op);
    const size_t n = task->call.dtypes.size();
    pending->staging.reserve(2 * n);
    for (size_t k = 0; k < n; ++k) {
      auto in = args.get<ffi::AnyBuffer>(k);
      if (in.has_error()) return in.error();
      const size_t bytes = in->size_bytes();
      if (feedback && in->element_type() != ffi::DataType::F32) {
        return ffi::Error::InvalidArgument(where + "error feedback takes float32 operands only");
      }
      // A reduce-scatter's operand holds G blocks (lowering.py gives it the
      // shape (G, ...)); an all-gather's result does.
      size_t out_elements = in->element_count();
      if (attrs.collective == kCollectiveReduceScatter) {
        if (out_elements % blocks != 0) {
          return ffi::Error::InvalidArgument(
              where + "a reduce-scatter's operand " + std::to_string(k) + " has " +
              std::to_string(out_elements) + " elements, not a multiple of the group's " +
              std::to_string(blocks) + " devices; this is a herring_jax bug: please report it");
        }
        out_elements /= blocks;
      } else if (attrs.collective == kCollectiveAllGather) {
        out_elements *= blocks;
      }
      const size_t per = std::max<size_t>(1, in->element_count());  // the lowering's are > 0
      const size_t out_bytes = bytes / per * out_elements;
      pending->types.push_back(in->element_type());
      pending->elements.push_back(in->element_count());
      pending->bytes.push_back(bytes);
      pending->out_elements.push_back(out_elements);
      pending->out_bytes.push_back(out_bytes);
      task->call.out_counts.push_back(task->call.counts[k] / per * out_elements);
      pending->staging.emplace_back(&on, bytes);
      pending->staging.emplace_back(&on, out_bytes);  // an all-gather's: larger
      if (feedback) pending->lost.emplace_back(&on, bytes);
      if (!pending->staging[2 * k].ok() || !pending->staging[2 * k + 1].ok() ||
          (feedback && !pending->lost[k].ok())) {
        return ffi::Error::Internal(where + "staging memory of " +
                                    std::to_string(bytes + out_bytes) +
                                    " bytes could not be had (" + on.StagingError() +
                                    "): lower the fusion buffer size or free host memory");
      }
      task->event.bytes += bytes;
    }
    status = on.CreateEvent(&task->copied);
    if (!status.ok()) return DeviceError(where, "creating an event", status);

    // From here copies into the staging buffers may be in flight: every exit
    // either hands them to herring's thread or waits for the stream first.
    auto fail = [&](ffi::Error e) {
      on.SynchronizeStream(stream);
      on.DestroyEvent(task->copied);
      return e;
    };
    for (size_t k = 0; k < n; ++k) {
      void* host_in = pending->staging[2 * k].data();
      if (pending->bytes[k] > 0) {
        status = on.CopyToHost(host_in, task->call.arrival.in[k], pending->bytes[k], stream);
        if (!status.ok()) return fail(DeviceError(where, "the copy to the host", status));
      }
      task->call.arrival.in[k] = host_in;
      task->call.arrival.out.push_back(pending->staging[2 * k + 1].data());
      if (feedback) {
        task->call.arrival.lost.push_back(reinterpret_cast<float*>(pending->lost[k].data()));
      }
    }
    status = on.RecordEvent(task->copied, stream);
    if (!status.ok()) return fail(DeviceError(where, "recording an event", status));

    const PendingKey pairing{&on, run_id, device,
                             reinterpret_cast<uintptr_t>((*token)->untyped_data())};
    if (!PendingTable::Get().Add(pairing, pending)) {
      return fail(ffi::Error::Internal(
          where + "a reduction started earlier on device " + std::to_string(device) +
          " in this execution has the same token address and was never collected; this is "
          "a herring_jax bug (its start and done are emitted together): please report it"));
    }
    task->event.key = attrs.key;
    task->event.slot = attrs.slot;
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

ffi::Error DoneOnDevice(Device& on, Device::Stream stream, int64_t run_id, int32_t device,
                        ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_handle,
                        int64_t key) {
  const std::string what = std::string("herring allreduce done (") + on.name() + ")";
  return NoThrow(what.c_str(), [&]() -> ffi::Error {
    std::shared_ptr<engine::Communicator> comm = engine::Registry::Get().Find(comm_handle);
    const std::string where =
        "herring allreduce on rank " + (comm ? std::to_string(comm->rank()) : "?") + ": ";
    if (args.size() < 1) {
      return ffi::Error::InvalidArgument(where + "the done takes its start's token first");
    }
    auto token = args.get<ffi::AnyBuffer>(0);
    if (token.has_error()) return token.error();
    std::shared_ptr<PendingReduction> pending = PendingTable::Get().Claim(
        {&on, run_id, device, reinterpret_cast<uintptr_t>(token->untyped_data())});
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
    // What the done copies into result k: the reduced buffers (their own
    // sizes), then the losses (error feedback: float32 of their operands' sizes).
    auto result_elements = [&](size_t k) {
      return k < num ? pending->out_elements[k] : pending->elements[k - num];
    };
    auto result_bytes = [&](size_t k) {
      return k < num ? pending->out_bytes[k] : pending->bytes[k - num];
    };
    std::vector<void*> results;
    for (size_t k = 0; k < rets.size(); ++k) {
      auto out = rets.get<ffi::AnyBuffer>(k);
      if (out.has_error()) return out.error();
      if ((*out)->element_type() != pending->types[k % num] ||
          (*out)->element_count() != result_elements(k)) {
        return ffi::Error::Internal(where + "result " + std::to_string(k) +
                                    " does not match its start's operand; this is a "
                                    "herring_jax bug: please report it");
      }
      results.push_back((*out)->untyped_data());
    }

    // Blocks XLA's host thread; cuda_handlers.cc says why that is safe.
    const double limit = WaitLimitSeconds(comm);
    if (!pending->Wait(limit)) {
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                        where + "the reduction started for this done has not ended after " +
                            std::to_string(static_cast<int>(limit)) +
                            " s (HERRING_TIMEOUT_S + HERRING_CUDA_DONE_GRACE_S): the " +
                            on.name() + " device has not reached its copy to the host, or "
                            "the engine is stuck; check the device and the other ranks' logs");
    }
    ffi::Error error = pending->error();
    if (error.failure()) return error;

    auto release_after_stream = [&](ffi::Error e) {
      on.SynchronizeStream(stream);  // the copies out of staging, if any
      return e;
    };
    for (size_t k = 0; k < results.size(); ++k) {
      if (result_bytes(k) == 0) continue;
      const void* from = k < num ? pending->staging[2 * k + 1].data()
                                 : pending->lost[k - num].data();
      DeviceStatus status = on.CopyToDevice(results[k], from, result_bytes(k), stream);
      if (!status.ok()) {
        return release_after_stream(DeviceError(where, "the copy to the device", status));
      }
    }
    // The staging buffers go back to the pool once the copies out of them
    // have run: a herring thread waits for an event after them, so that
    // neither XLA's thread nor the stream waits (a host function on the
    // stream would hold the stream while it ran).
    Device::Event copied = nullptr;
    DeviceStatus status = on.CreateEvent(&copied);
    if (status.ok()) status = on.RecordEvent(copied, stream);
    if (!status.ok()) {
      if (copied != nullptr) on.DestroyEvent(copied);
      return release_after_stream(ffi::Error::Success());
    }
    const int stream_device = pending->stream_device;
    engine::AsyncRunner::Get().Run([pending, copied, stream_device]() mutable {
      if (!pending->device->WaitAndDestroy(stream_device, copied).ok()) pending->Quarantine();
      pending.reset();  // staging back to the pool
    });
    return ffi::Error::Success();
  });
}

}  // namespace herring
