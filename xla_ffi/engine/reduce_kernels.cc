#include "engine/reduce_kernels.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "engine/half.h"


namespace herring::engine {
namespace {

// Elements summed together: 64 bytes of accumulators, four SSE registers.
// Each block reads every source once and writes dst once, with the sum kept
// in registers. (Summing a 1024-element tile source by source through an
// array on the stack left GCC's loop scalar: ~3x slower on L2-resident
// pieces, the host stage's case; see BENCHMARKS.md.)
template <typename A>
constexpr size_t kLanes = 64 / sizeof(A);

// How two accumulated values combine: a sum, or a maximum or minimum in which
// a NaN wins (v != v only for NaN; integers never are).
struct Add {
  template <typename A>
  A operator()(A acc, A v) const {
    return acc + v;
  }
};
struct Max {
  template <typename A>
  A operator()(A acc, A v) const {
    return (v > acc || v != v) ? v : acc;
  }
};
struct Min {
  template <typename A>
  A operator()(A acc, A v) const {
    return (v < acc || v != v) ? v : acc;
  }
};

// Elements [i, i + L) of every source: all of them are read before dst or
// copy is written, so either may alias a source at the same elements.
template <size_t L, typename T, typename A, typename Combine, typename Load, typename Store,
          typename Divide>
inline void ReduceBlock(T* dst, T* copy, const void* const* srcs, size_t n, size_t i, Load load,
                        Store store, Divide divide) {
  A acc[L];
  const T* s0 = static_cast<const T*>(srcs[0]) + i;
  for (size_t j = 0; j < L; ++j) acc[j] = load(s0[j]);
  for (size_t k = 1; k < n; ++k) {
    const T* s = static_cast<const T*>(srcs[k]) + i;
    for (size_t j = 0; j < L; ++j) acc[j] = Combine()(acc[j], load(s[j]));
  }
  T out[L];
  for (size_t j = 0; j < L; ++j) out[j] = store(divide(acc[j]));
  std::memcpy(dst + i, out, sizeof(out));
  if (copy != nullptr) std::memcpy(copy + i, out, sizeof(out));
}

// Storage type T, accumulator A; Load/Store convert between them.
// `copy` (may be null) receives the same bits as `dst`.
template <typename T, typename A, typename Combine = Add, typename Load, typename Store,
          typename Divide>
void Reduce(void* dst_v, void* copy_v, const void* const* srcs_v, size_t n, size_t count,
            Load load, Store store, Divide divide) {
  T* dst = static_cast<T*>(dst_v);
  T* copy = static_cast<T*>(copy_v);
  constexpr size_t L = kLanes<A>;
  size_t i = 0;
  for (; i + L <= count; i += L) {
    ReduceBlock<L, T, A, Combine>(dst, copy, srcs_v, n, i, load, store, divide);
  }
  for (; i < count; ++i) ReduceBlock<1, T, A, Combine>(dst, copy, srcs_v, n, i, load, store, divide);
}

// Function objects, not function pointers: the kernels must inline the
// conversions to vectorise (a pointer per element made them ~10x slower).
struct Same {
  template <typename T>
  T operator()(T v) const {
    return v;
  }
};
struct FromHalf {
  float operator()(uint16_t v) const { return HalfToFloat(v); }
};
struct ToHalf {
  uint16_t operator()(float v) const { return FloatToHalf(v); }
};
struct FromBF16 {
  float operator()(uint16_t v) const { return BF16ToFloat(v); }
};
struct ToBF16 {
  uint16_t operator()(float v) const { return FloatToBF16(v); }
};

// Integers add in unsigned arithmetic so overflow wraps like numpy's instead
// of being undefined behaviour; a mean divides the sum, read as S, in 64 bits.
// The divisor (a count of devices) cast to S instead would turn negative or
// zero for narrow types (an int8 mean over 128-255 devices divided by a
// negative number, over 256 by zero: SIGFPE). Dividing by a positive 64-bit
// number cannot overflow, and the quotient's magnitude is at most the sum's,
// so it fits S again.
template <typename U, typename S>
void ReduceInt(void* dst, void* copy, const void* const* srcs, size_t n, size_t count,
               double divisor, bool div) {
  using Wide = std::conditional_t<std::is_signed_v<S>, int64_t, uint64_t>;
  // Never below 1 (callers count at least one device; no division by zero
  // whatever reaches here), at most what 64 bits hold.
  const Wide d = divisor >= 9.2e18 ? std::numeric_limits<Wide>::max()
                 : divisor >= 1.0  ? static_cast<Wide>(divisor)
                                   : Wide{1};
  if (div && d > 1) {
    Reduce<U, U>(dst, copy, srcs, n, count, Same(), Same(), [=](U a) {
      return static_cast<U>(static_cast<S>(static_cast<Wide>(static_cast<S>(a)) / d));
    });
  } else {
    Reduce<U, U>(dst, copy, srcs, n, count, Same(), Same(), Same());
  }
}

// The divide-or-not decision is a template parameter so that the common
// sum case has no per-element branch.
template <typename T, typename A, typename Load, typename Store>
void Dispatch(void* dst, void* copy, const void* const* srcs, size_t n, size_t count,
              A divisor, bool div) {
  if (div) {
    Reduce<T, A>(dst, copy, srcs, n, count, Load(), Store(), [=](A a) { return a / divisor; });
  } else {
    Reduce<T, A>(dst, copy, srcs, n, count, Load(), Store(), Same());
  }
}

// The maximum or minimum (Combine) in the storage type's own order: signed
// and unsigned integers as themselves, floats in float.
template <typename Combine>
void Extreme(DType dtype, void* dst, void* copy, const void* const* srcs, size_t n,
             size_t count) {
  switch (dtype) {
    case DType::kFloat32:
      return Reduce<float, float, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kFloat64:
      return Reduce<double, double, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kFloat16:
      return Reduce<uint16_t, float, Combine>(dst, copy, srcs, n, count, FromHalf(), ToHalf(),
                                              Same());
    case DType::kBFloat16:
      return Reduce<uint16_t, float, Combine>(dst, copy, srcs, n, count, FromBF16(), ToBF16(),
                                              Same());
    case DType::kInt8:
      return Reduce<int8_t, int8_t, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kInt16:
      return Reduce<int16_t, int16_t, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kInt32:
      return Reduce<int32_t, int32_t, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kInt64:
      return Reduce<int64_t, int64_t, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kUInt8:
      return Reduce<uint8_t, uint8_t, Combine>(dst, copy, srcs, n, count, Same(), Same(), Same());
    case DType::kUInt16:
      return Reduce<uint16_t, uint16_t, Combine>(dst, copy, srcs, n, count, Same(), Same(),
                                                 Same());
    case DType::kUInt32:
      return Reduce<uint32_t, uint32_t, Combine>(dst, copy, srcs, n, count, Same(), Same(),
                                                 Same());
    case DType::kUInt64:
      return Reduce<uint64_t, uint64_t, Combine>(dst, copy, srcs, n, count, Same(), Same(),
                                                 Same());
    default:
      return;
  }
}

}  // namespace

void ReduceOpInto(ReduceOp op, DType dtype, void* dst, void* copy, const void* const* srcs,
                  size_t n, size_t count, double divisor) {
  if (n == 0 || count == 0) return;
  switch (op) {
    case ReduceOp::kMax: {
      IeeeDenormals ieee;
      return Extreme<Max>(dtype, dst, copy, srcs, n, count);
    }
    case ReduceOp::kMin: {
      IeeeDenormals ieee;
      return Extreme<Min>(dtype, dst, copy, srcs, n, count);
    }
    case ReduceOp::kMean:
      return ReduceIntoTwo(dtype, dst, copy, srcs, n, count, divisor);
    default:
      return ReduceIntoTwo(dtype, dst, copy, srcs, n, count, 1.0);
  }
}

void ReduceInto(DType dtype, void* dst, const void* const* srcs, size_t n, size_t count,
                double divisor) {
  ReduceIntoTwo(dtype, dst, nullptr, srcs, n, count, divisor);
}

void ReduceIntoTwo(DType dtype, void* dst, void* copy, const void* const* srcs, size_t n,
                   size_t count, double divisor) {
  if (n == 0 || count == 0) return;
  IeeeDenormals ieee;
  const bool div = divisor != 1.0;
  switch (dtype) {
    case DType::kFloat32:
      Dispatch<float, float, Same, Same>(dst, copy, srcs, n, count, static_cast<float>(divisor), div);
      break;
    case DType::kFloat64:
      Dispatch<double, double, Same, Same>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kFloat16:
      Dispatch<uint16_t, float, FromHalf, ToHalf>(dst, copy, srcs, n, count,
                                                  static_cast<float>(divisor), div);
      break;
    case DType::kBFloat16:
      Dispatch<uint16_t, float, FromBF16, ToBF16>(dst, copy, srcs, n, count,
                                                  static_cast<float>(divisor), div);
      break;
    case DType::kInt32:
      ReduceInt<uint32_t, int32_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kInt64:
      ReduceInt<uint64_t, int64_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kInt8:
      ReduceInt<uint8_t, int8_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kInt16:
      ReduceInt<uint16_t, int16_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kUInt8:
      ReduceInt<uint8_t, uint8_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kUInt16:
      ReduceInt<uint16_t, uint16_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kUInt32:
      ReduceInt<uint32_t, uint32_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    case DType::kUInt64:
      ReduceInt<uint64_t, uint64_t>(dst, copy, srcs, n, count, divisor, div);
      break;
    default:
      break;
  }
}

}  // namespace herring::engine
