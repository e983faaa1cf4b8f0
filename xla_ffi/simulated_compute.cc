// A stand-in for accelerator compute in benchmarks (herring-jax train-bench
// --simulated-accelerator): the call takes `us` microseconds to complete and
// uses no CPU meanwhile, as a GPU kernel looks from the host. It copies its
// operand to its result (so that it sits in the dataflow like a layer) and
// completes its future from herring's threads after the wait.
#include <chrono>
#include <cstring>
#include <thread>

#include "engine/async_runner.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace herring {
namespace {

namespace ffi = xla::ffi;

ffi::Future SimulatedComputeImpl(ffi::AnyBuffer in, ffi::Result<ffi::AnyBuffer> out,
                                 int64_t us) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (in.size_bytes() != out->size_bytes()) {
    promise.SetError(ffi::Error::InvalidArgument("simulated compute: result size differs"));
    return future;
  }
  const void* src = in.untyped_data();
  void* dst = out->untyped_data();
  const size_t bytes = in.size_bytes();
  engine::AsyncRunner::Get().Run([=]() mutable {
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    std::memcpy(dst, src, bytes);
    promise.SetAvailable();
  });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HerringSimulatedCompute, SimulatedComputeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()   // activations in
                                  .Ret<ffi::AnyBuffer>()   // the same bytes, `us` later
                                  .Attr<int64_t>("us"));   // how long the "kernel" runs

}  // namespace herring
