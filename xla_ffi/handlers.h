// Declarations of the XLA FFI handler symbols defined in handlers.cc.
#ifndef HERRING_HANDLERS_H_
#define HERRING_HANDLERS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "xla/ffi/api/api.h"

namespace herring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduce);
// call_identity.cc: the instantiate stage of both, numbering instructions.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduceInstantiate);

// simulated_compute.cc: a wait that uses no CPU, standing in for accelerator
// compute in benchmarks.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringSimulatedCompute);

// join.cc: the point after which a step's reduced buckets are used (XLA:CPU).
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringJoin);

// async_pair.cc: a reduction that starts in one execution and ends in a
// later one (XLA:CPU), paired by a runtime ticket. DrainAsync waits up to
// `timeout_s` until the communicator's started reductions have ended, drops
// their uncollected results (their tickets go to `dropped`) and returns how
// many were still running.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAsyncStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAsyncDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAsyncKnown);
size_t DrainAsync(int64_t comm_handle, double timeout_s, std::vector<int64_t>* dropped);

// double_handlers.cc: the XLA:CUDA start/done pair's code (device_handlers.cc)
// on XLA:CPU with the device layer's CPU double, for tests.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringDoubleStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringDoubleDone);

#ifdef HERRING_WITH_CUDA
// cuda_handlers.cc: the same reduction on XLA's CUDA platform, split into a
// start (copies to the host, reduces on herring's threads) and a done (waits,
// copies back), with the start's instantiate stage from call_identity.cc.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduceStartCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduceDoneCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduceInstantiateCuda);
#endif

// The per-instruction state type of the CPU (cuda: CUDA) handler: XLA must
// know it (type id in-out, deleter) before the handler is registered.
XLA_FFI_TypeId* InstructionStateTypeId(bool cuda);
const XLA_FFI_TypeInfo* InstructionStateTypeInfo(bool cuda);

// The numbers by which `platform`'s handler names this process's devices, in
// jax's local order: the attributes name devices by that local index.
void SetLocalDevices(const std::string& platform, std::vector<int64_t> numbers);

// Which identity `platform`'s reductions compiled from now on take: XLA's run
// ids (false, "program") or launch numbers per instruction (true, "launch");
// see call_identity.cc. The default: program on "cpu", launch on "cuda".
void SetLaunchIdentity(const std::string& platform, bool launch);
// For tests: one instruction under the launch identity called with these
// (run id, device) pairs, in order; each call's launch count, or "error: ...".
std::vector<std::string> CountLaunchesForTest(
    const std::vector<std::pair<int64_t, int32_t>>& calls);

}  // namespace herring

#endif  // HERRING_HANDLERS_H_
