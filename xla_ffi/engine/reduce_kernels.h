// Element-wise reduction kernels used by the server shards and by the local
// (inside-the-process) stage of the hierarchical reduction.
#ifndef HERRING_ENGINE_REDUCE_KERNELS_H_
#define HERRING_ENGINE_REDUCE_KERNELS_H_

#include <cstddef>

#include "engine/dtype.h"

namespace herring::engine {

// dst[i] = (((src[0][i] + src[1][i]) + src[2][i]) + ...) / divisor
//
// The sources are added strictly in the order given, so the result depends
// only on the inputs and their order: every rank and every run computes the
// same bits. float16 and bfloat16 accumulate in float32 and are rounded once
// (to nearest even). divisor == 1 skips the division; integer types divide
// only for divisor > 1 (truncating, as C does). dst may alias any source.
void ReduceInto(DType dtype, void* dst, const void* const* srcs, size_t num_srcs,
                size_t count, double divisor);

// The same, storing the result to `dst` and to `copy`: one pass where a sum
// and a copy of it would read it again. Either may alias a source at the same
// elements (each tile of every source is read before it is written), as the
// host stage's output does when XLA reduces in place.
void ReduceIntoTwo(DType dtype, void* dst, void* copy, const void* const* srcs,
                   size_t num_srcs, size_t count, double divisor);

// `op` of the sources into `dst` and (if not null) `copy`: a sum or mean as
// ReduceIntoTwo (the mean divides by `divisor`), or the element-wise maximum
// or minimum, where a NaN in any source gives NaN (as XLA's maximum and
// minimum; 16-bit floats compare as float32). Aliasing as ReduceIntoTwo.
void ReduceOpInto(ReduceOp op, DType dtype, void* dst, void* copy, const void* const* srcs,
                  size_t num_srcs, size_t count, double divisor);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_REDUCE_KERNELS_H_
