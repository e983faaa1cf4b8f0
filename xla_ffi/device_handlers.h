// The start/done pair of a collective (all-reduce, reduce-scatter or
// all-gather: the call's collective attribute) on a device with a stream, written
// against the device layer (device.h): XLA:CUDA's handlers (cuda_handlers.cc)
// run it on CUDA, the CPU double's (double_handlers.cc) on the double, so the
// CPU suite runs the same code. cuda_handlers.cc says why the reduction is
// split in two and which of XLA:CUDA's rules the code relies on.
#ifndef HERRING_DEVICE_HANDLERS_H_
#define HERRING_DEVICE_HANDLERS_H_

#include <cstdint>

#include "device.h"
#include "handler_common.h"
#include "xla/ffi/api/ffi.h"

namespace herring {

// The start: enqueues the copies of the operands (device buffers) into
// staging on `stream`, records an event after them, hands the rest (wait for
// the event, reduce on the host as the CPU handler does) to herring's
// threads, and returns at once. `rets`: one token buffer, whose address
// pairs the start with its done. The results' staging is sized from the
// operands and the group (a reduce-scatter's result is 1/G of its operand,
// an all-gather's G times it), since the start does not see the results.
ffi::Error StartOnDevice(Device& on, Device::Stream stream, int64_t run_id, int32_t device,
                         InstructionState* instruction, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, const CallAttrs& attrs);

// The done: waits on the calling thread for the reduction its token (args[0])
// started, then enqueues the copies of its results into `rets` on `stream`.
// Later operands are not read (other starts' tokens, for order).
ffi::Error DoneOnDevice(Device& on, Device::Stream stream, int64_t run_id, int32_t device,
                        ffi::RemainingArgs args, ffi::RemainingRets rets, int64_t comm_handle,
                        int64_t key);

}  // namespace herring

#endif  // HERRING_DEVICE_HANDLERS_H_
