// Declarations of the XLA FFI handler symbols defined in handlers.cc.
#ifndef HERRING_HANDLERS_H_
#define HERRING_HANDLERS_H_

#include "xla/ffi/api/api.h"

namespace herring {

XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduce);

// simulated_compute.cc: a wait that uses no CPU, standing in for accelerator
// compute in benchmarks.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringSimulatedCompute);

#ifdef HERRING_WITH_CUDA
// cuda_handlers.cc: the same call on XLA's CUDA platform.
XLA_FFI_DECLARE_HANDLER_SYMBOL(HerringAllReduceCuda);
#endif

}  // namespace herring

#endif  // HERRING_HANDLERS_H_
