// The start/done pair of XLA:CUDA (device_handlers.cc) bound to XLA:CPU with
// the CPU double (device_double.h) as its device, for tests: registered as
// herring_double_allreduce_start / _done, which the lowering emits in place
// of herring_allreduce under HERRING_TEST_DEVICE_DOUBLE=1
// (herring_jax/_src/collectives/lowering.py). XLA:CPU's own path
// (handlers.cc) is untouched.
//
// What stands in for XLA:CUDA's stream order. On XLA:CUDA the calls only
// enqueue work, and whatever XLA runs later on the stream comes after it, so
// XLA may reuse an operand's memory as soon as the start returns. XLA:CPU
// frees and reads buffers when a call completes. So here:
// - the start returns at once (the host runs ahead, as on a GPU: the done is
//   called while the start's copies may still be in flight), and the done
//   takes the start's operands after the tokens (lowering.py), so XLA keeps
//   them until the done completes;
// - the done completes (its future) only when the double's stream has
//   reached the point where the done returned: after its copies into the
//   results, and after every copy enqueued before them (the starts').
// What the double does not imitate: a start whose done never runs (its
// execution failed in between) leaves its copies reading operands that XLA
// may free; XLA:CUDA's stream order covers that case.
#include <memory>
#include <string>
#include <utility>

#include "device_double.h"
#include "device_handlers.h"
#include "engine/async_runner.h"
#include "engine/registry.h"
#include "handler_common.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace herring {
namespace {

ffi::Error DoubleStartImpl(ffi::RunId run_id, int32_t device, InstructionState* instruction,
                           ffi::RemainingArgs args, ffi::RemainingRets rets,
                           HERRING_ATTR_PARAMS) {
  DeviceDouble& on = DeviceDouble::Get();
  return StartOnDevice(on, on.StreamFor(device), run_id.run_id, device, instruction, args, rets,
                       HERRING_ATTRS);
}

ffi::Future DoubleDoneImpl(ffi::RunId run_id, int32_t device, ffi::RemainingArgs args,
                           ffi::RemainingRets rets, int64_t comm_handle, int64_t key) {
  DeviceDouble& on = DeviceDouble::Get();
  Device::Stream stream = on.StreamFor(device);
  ffi::Error error =
      DoneOnDevice(on, stream, run_id.run_id, device, args, rets, comm_handle, key);
  ffi::Promise promise;
  ffi::Future future(promise);
  auto settle = [](ffi::Promise& p, ffi::Error e) {
    if (e.failure()) {
      p.SetError(std::move(e));
    } else {
      p.SetAvailable();
    }
  };
  // A copy of the done's that failed on the stream (its error sticks) would
  // leave the results unwritten: XLA:CUDA reports such an error at its next
  // stream operation; here the done's future does.
  std::shared_ptr<engine::Communicator> comm = engine::Registry::Get().Find(comm_handle);
  const std::string where =
      "herring allreduce on rank " + (comm ? std::to_string(comm->rank()) : "?") + ": ";
  comm.reset();
  auto or_stream_error = [where](ffi::Error e, const DeviceStatus& s) {
    if (e.failure() || s.ok()) return e;
    return ffi::Error::Internal(where + "the CPU double's stream failed after the done's "
                                "copies were enqueued: " + s.message());
  };
  Device::Event reached = nullptr;
  DeviceStatus status = on.CreateEvent(&reached);
  if (status.ok()) status = on.RecordEvent(reached, stream);
  if (!status.ok()) {
    // A broken stream (a failed copy) takes no more work: wait until it ran
    // what it has, then complete.
    if (reached != nullptr) on.DestroyEvent(reached);
    on.SynchronizeStream(stream);
    settle(promise, or_stream_error(std::move(error), status));
    return future;
  }
  // On herring's thread, never the stream's: setting the promise may run
  // XLA's next calls on the setting thread, and those may wait for the stream.
  engine::AsyncRunner::Get().Run(
      [&on, reached, device, promise, error, settle, or_stream_error]() mutable {
        DeviceStatus ran = on.WaitAndDestroy(device, reached);
        settle(promise, or_stream_error(std::move(error), ran));
      });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringDoubleStart, DoubleStartImpl,
    BindAllReduceAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()          // this execution, same on every device
                           .Ctx<ffi::DeviceOrdinal>()  // global id of the calling device
                           .Ctx<ffi::State<InstructionState>>()  // this instruction
                           .RemainingArgs()            // buffers to reduce
                           .RemainingRets()));         // one token buffer, for the done

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringDoubleDone, DoubleDoneImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::RunId>()          // this execution (pairs with the start)
        .Ctx<ffi::DeviceOrdinal>()  // the calling device (pairs too)
        .RemainingArgs()   // its start's token, the other starts' tokens, then its
                           // start's operands (kept alive, never read)
        .RemainingRets()   // results, the start's operands' types (a reduce-scatter's
                           // 1/G of their size, an all-gather's G times)
        .Attr<int64_t>("comm")
        .Attr<int64_t>("key"));

}  // namespace herring
