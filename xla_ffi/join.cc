// herring_join (XLA:CPU): the point in a training step after which its
// buckets' reduced gradients are used. split.split_reductions passes every
// bucket's result through one such call, whose results alias its operands
// (operand_output_aliases), so it copies nothing. What it does is keep every
// bucket's buffer live until all the step's reductions have ended: otherwise
// XLA:CPU schedules a bucket's use (the optimizer's update) right after its
// reduction and hands the buffer to the rest of the backward pass, whose
// computations its executor then holds until that reduction has ended
// (herring_jax/_src/collectives/lowering.py, join_cpu).
#include <cstring>
#include <string>

#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace herring {
namespace {

namespace ffi = xla::ffi;

ffi::Error JoinImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("herring_join: " + std::to_string(args.size()) +
                                       " operands but " + std::to_string(rets.size()) +
                                       " results");
  }
  for (size_t k = 0; k < args.size(); ++k) {
    auto in = args.get<ffi::AnyBuffer>(k);
    if (in.has_error()) return in.error();
    auto out = rets.get<ffi::AnyBuffer>(k);
    if (out.has_error()) return out.error();
    if ((*out)->size_bytes() != in->size_bytes()) {
      return ffi::Error::InvalidArgument("herring_join: result " + std::to_string(k) +
                                         " is not the size of its operand");
    }
    // Aliased, as lowered; should XLA ever give the result a buffer of its
    // own, the bytes still arrive.
    if ((*out)->untyped_data() != in->untyped_data()) {
      std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HerringJoin, JoinImpl,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()    // reduced buckets
                                  .RemainingRets());  // the same buffers (aliased)

}  // namespace herring
