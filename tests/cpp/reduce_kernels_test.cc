// The reduction kernels against a plain element-by-element model: the same
// bits for every dtype, element count (whole blocks and tails), number of
// sources and divisor, also where dst and copy alias sources.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../cpp/check.h"
#include "engine/half.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {
namespace {

using test::Check;

// sum_k src[k][i] in order, in the accumulator type, then / divisor.
template <typename T, typename A, typename Load, typename Store>
std::vector<T> Model(const std::vector<std::vector<T>>& srcs, size_t count, double divisor,
                     Load load, Store store) {
  std::vector<T> out(count);
  for (size_t i = 0; i < count; ++i) {
    A acc = load(srcs[0][i]);
    for (size_t k = 1; k < srcs.size(); ++k) acc += load(srcs[k][i]);
    if (divisor != 1.0) acc = static_cast<A>(acc / static_cast<A>(divisor));
    out[i] = store(acc);
  }
  return out;
}

template <typename T>
bool Equal(const T* a, const std::vector<T>& b) {
  return b.empty() || std::memcmp(a, b.data(), b.size() * sizeof(T)) == 0;
}

template <typename T>
T Value(size_t k, size_t i) {
  const uint64_t x = (i * 2654435761u + k * 40503u) % 1000;
  return static_cast<T>(static_cast<double>(x) * 0.37 - 150.0);
}

template <typename T, typename A, typename Load, typename Store>
void CheckType(DType dtype, const char* name, Load load, Store store,
               T (*make)(size_t, size_t)) {
  for (size_t count : {0, 1, 7, 15, 16, 17, 33, 64, 1000, 1031}) {
    for (size_t n : {1, 2, 3, 5}) {
      for (double divisor : {1.0, 3.0}) {
        std::vector<std::vector<T>> srcs(n, std::vector<T>(count));
        for (size_t k = 0; k < n; ++k) {
          for (size_t i = 0; i < count; ++i) srcs[k][i] = make(k, i);
        }
        const std::vector<T> want = Model<T, A>(srcs, count, divisor, load, store);
        const std::string what = std::string(name) + " count " + std::to_string(count) +
                                 " sources " + std::to_string(n) + " divisor " +
                                 std::to_string(divisor);
        std::vector<const void*> ptrs(n);
        for (size_t k = 0; k < n; ++k) ptrs[k] = srcs[k].data();

        std::vector<T> dst(count + 1), copy(count + 1);
        ReduceIntoTwo(dtype, dst.data(), copy.data(), ptrs.data(), n, count, divisor);
        Check(Equal(dst.data(), want), what + ": dst");
        Check(Equal(copy.data(), want), what + ": copy");

        // In place: dst is the last source, copy the first (as the host
        // stage's output is its input where XLA reduces in place).
        std::vector<std::vector<T>> again = srcs;
        for (size_t k = 0; k < n; ++k) ptrs[k] = again[k].data();
        ReduceIntoTwo(dtype, again[n - 1].data(), n > 1 ? again[0].data() : nullptr,
                      ptrs.data(), n, count, divisor);
        Check(Equal(again[n - 1].data(), want), what + ": in place");
        Check(Equal(again[0].data(), want), what + ": copy in place");
      }
    }
  }
}

struct Same {
  template <typename T>
  T operator()(T v) const {
    return v;
  }
};

uint16_t HalfValue(size_t k, size_t i) { return FloatToHalf(Value<float>(k, i)); }
uint16_t BF16Value(size_t k, size_t i) { return FloatToBF16(Value<float>(k, i)); }

// Integer means over more devices than the element type counts: the sum (as
// the signed type) divided by the device count in 64 bits, truncated. Once
// the divisor was cast to the element type: an int8 mean over 200 devices
// divided by -56, over 256 by zero (SIGFPE), an int16 one over 40000 by -25536.
template <typename T>
void CheckWideDivisor(DType dtype, const char* name, double divisor) {
  std::vector<T> a, b;
  for (int64_t v : {100, -100, 7, 0, 1}) a.push_back(static_cast<T>(v));
  for (int64_t v : {20, -28, 0, 0, 1}) b.push_back(static_cast<T>(v));
  const void* srcs[2] = {a.data(), b.data()};
  std::vector<T> out(a.size());
  ReduceInto(dtype, out.data(), srcs, 2, a.size(), divisor);
  for (size_t i = 0; i < a.size(); ++i) {
    const T sum = static_cast<T>(a[i] + b[i]);  // wraps as the kernel's sum does
    const T want = static_cast<T>(static_cast<int64_t>(sum) / static_cast<int64_t>(divisor));
    Check(out[i] == want, std::string(name) + " mean over " + std::to_string(divisor) +
                              " devices, element " + std::to_string(i) + ": got " +
                              std::to_string(out[i]) + ", want " + std::to_string(want));
  }
}

}  // namespace
}  // namespace herring::engine

int main() {
  using namespace herring::engine;
  CheckType<float, float>(DType::kFloat32, "float32", Same(), Same(), &Value<float>);
  CheckType<double, double>(DType::kFloat64, "float64", Same(), Same(), &Value<double>);
  CheckType<uint16_t, float>(
      DType::kFloat16, "float16", [](uint16_t v) { return HalfToFloat(v); },
      [](float f) { return FloatToHalf(f); }, &HalfValue);
  CheckType<uint16_t, float>(
      DType::kBFloat16, "bfloat16", [](uint16_t v) { return BF16ToFloat(v); },
      [](float f) { return FloatToBF16(f); }, &BF16Value);
  CheckType<int32_t, int32_t>(DType::kInt32, "int32", Same(), Same(), &Value<int32_t>);
  CheckType<uint8_t, uint8_t>(
      DType::kUInt8, "uint8", Same(), [](uint8_t v) { return v; },
      +[](size_t k, size_t i) { return static_cast<uint8_t>((i * 7 + k * 13) % 251); });
  for (double divisor : {2.0, 127.0, 128.0, 200.0, 255.0, 256.0, 1000.0, 16777216.0}) {
    CheckWideDivisor<int8_t>(DType::kInt8, "int8", divisor);
    CheckWideDivisor<uint8_t>(DType::kUInt8, "uint8", divisor);
  }
  for (double divisor : {3.0, 40000.0, 65536.0}) {
    CheckWideDivisor<int16_t>(DType::kInt16, "int16", divisor);
  }
  CheckWideDivisor<int32_t>(DType::kInt32, "int32", 4294967296.0);
  return herring::test::Finish("REDUCE_KERNELS");
}
