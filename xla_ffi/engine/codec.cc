#include "engine/codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/half.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace herring::engine {
namespace {

size_t Blocks(size_t count) { return (count + kCodecBlock - 1) / kCodecBlock; }

// int8: a block whose largest magnitude is below this encodes as zeros, so
// that 127 / m stays finite and far from subnormal arithmetic.
constexpr float kInt8Smallest = 0x1p-100f;

// The largest magnitude of the block's finite values, and whether it holds a
// value that is not finite. Branch-free, on the bits, so that it vectorises:
// the magnitude's bits order like its value, and exponent 0xff is inf/NaN.
float MaxAbsPortable(const float* x, size_t n, bool* non_finite) {
  uint32_t m = 0;
  uint32_t bad = 0;
  for (size_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    u &= 0x7fffffffu;
    const uint32_t finite = u < 0x7f800000u;
    bad |= finite ^ 1u;
    const uint32_t v = finite ? u : 0u;
    m = v > m ? v : m;
  }
  *non_finite = bad != 0;
  float f;
  std::memcpy(&f, &m, 4);
  return f;
}

// Rounds to the nearest integer, ties to even, for |v| < 2^22, in the
// default rounding mode (as nearbyint, but vectorisable): adding 1.5 * 2^23
// leaves no fraction bits.
inline float RoundEven(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

float Fp16Scale(float m) {
  if (m == 0.0f) return 1.0f;
  int e = 0;
  std::frexp(m, &e);
  return std::ldexp(1.0f, std::max(e - 15, -126));
}

// m / 127 with its 7 lowest mantissa bits cleared: 17 significant bits, so
// that v * s (|v| <= 127, 7 bits) is exact and no fused multiply-add in a
// model of the codec (jax's error feedback) can round it otherwise.
float Int8Scale(float m) {
  float s = m / 127.0f;
  uint32_t u;
  std::memcpy(&u, &s, 4);
  u &= ~0x7fu;
  std::memcpy(&s, &u, 4);
  return s;
}

// int8: v[i] = clamp(round_even(x[i] * inv), -127, 127), where inv = 127 / m
// and |x[i]| <= m, so that |x[i] * inv| stays within 127 and a rounding.
void ToInt8Portable(const float* x, size_t n, float inv, int8_t* v) {
  for (size_t i = 0; i < n; ++i) {
    const float q = RoundEven(x[i] * inv);
    v[i] = static_cast<int8_t>(static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, q))));
  }
}

// v[i] = half(x[i] * inv) and y[i] = float(v[i]) * s, with the F16C
// instructions where the CPU has them (x86-64 since 2012), else the
// vectorised integer conversions; the same bits either way: the hardware
// rounds to nearest even with IEEE subnormals (IeeeDenormals is in effect),
// and a group of 8 holding a NaN takes the portable path, which makes every
// NaN the one quiet NaN.
void ToHalfPortable(const float* x, size_t n, float inv, uint16_t* v) {
  for (size_t i = 0; i < n; ++i) v[i] = FloatToHalfSelect(x[i] * inv);
}
void FromHalfPortable(const uint16_t* v, size_t n, float s, float* y) {
  for (size_t i = 0; i < n; ++i) y[i] = HalfToFloatSelect(v[i]) * s;
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void ToHalfF16C(const float* x, size_t n, float inv,
                                                     uint16_t* v) {
  const __m256 scale = _mm256_set1_ps(inv);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
    if (_mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0) {
      ToHalfPortable(x + i, 8, inv, v + i);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + i),
                     _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  ToHalfPortable(x + i, n - i, inv, v + i);
}
__attribute__((target("avx,f16c"))) void FromHalfF16C(const uint16_t* v, size_t n, float s,
                                                       float* y) {
  const __m256 scale = _mm256_set1_ps(s);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i));
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_cvtph_ps(h), scale));
  }
  FromHalfPortable(v + i, n - i, s, y + i);
}
// AVX2 forms of MaxAbs and ToInt8, 32 elements at a time; the same results:
// the maximum is taken on the same bits, and the conversion to int32 rounds
// to nearest even in the default mode (as RoundEven) and cannot leave
// [-127, 127] (see ToInt8Portable), so the saturating packs never clamp.
__attribute__((target("avx2"))) float MaxAbsAvx2(const float* x, size_t n, bool* non_finite) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  __m256i m = _mm256_setzero_si256();
  __m256i bad = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_and_si256(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)), magnitude);
    const __m256i not_finite = _mm256_cmpgt_epi32(u, _mm256_sub_epi32(inf, _mm256_set1_epi32(1)));
    bad = _mm256_or_si256(bad, not_finite);
    m = _mm256_max_epu32(m, _mm256_andnot_si256(not_finite, u));
  }
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t best = 0;
  for (uint32_t lane : lanes) best = std::max(best, lane);
  bool tail_bad = false;
  const float tail = MaxAbsPortable(x + i, n - i, &tail_bad);
  uint32_t tail_bits;
  std::memcpy(&tail_bits, &tail, 4);
  best = std::max(best, tail_bits);
  *non_finite = tail_bad || !_mm256_testz_si256(bad, bad);
  float f;
  std::memcpy(&f, &best, 4);
  return f;
}
__attribute__((target("avx2"))) void ToInt8Avx2(const float* x, size_t n, float inv, int8_t* v) {
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
      q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * k), scale));
    }
    const __m256i lo = _mm256_packs_epi32(q[0], q[1]);
    const __m256i hi = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), bytes);
  }
  ToInt8Portable(x + i, n - i, inv, v + i);
}

// CPUID leaf 1: F16C (ecx bit 29) and AVX (bit 28) with the OS saving the
// YMM registers (OSXSAVE, bit 27, and XCR0 bits 1-2).
bool CpuHasF16C() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  if (!(c & (1u << 27)) || !(c & (1u << 28)) || !(c & (1u << 29))) return false;
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & 6u) == 6u;
}
const bool kHasF16C = CpuHasF16C();
// CPUID leaf 7: AVX2 (ebx bit 5), with the OS saving YMM as for F16C.
bool CpuHasAvx2() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!CpuHasF16C() || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (b & (1u << 5)) != 0;
}
const bool kHasAvx2 = CpuHasAvx2();
#else
constexpr bool kHasF16C = false;
constexpr bool kHasAvx2 = false;
#endif

float MaxAbs(const float* x, size_t n, bool* non_finite) {
#if defined(__x86_64__)
  if (kHasAvx2) return MaxAbsAvx2(x, n, non_finite);
#endif
  return MaxAbsPortable(x, n, non_finite);
}
void ToInt8(const float* x, size_t n, float inv, int8_t* v) {
#if defined(__x86_64__)
  if (kHasAvx2) return ToInt8Avx2(x, n, inv, v);
#endif
  ToInt8Portable(x, n, inv, v);
}

void ToHalf(const float* x, size_t n, float inv, uint16_t* v) {
#if defined(__x86_64__)
  if (kHasF16C) return ToHalfF16C(x, n, inv, v);
#endif
  ToHalfPortable(x, n, inv, v);
}
void FromHalf(const uint16_t* v, size_t n, float s, float* y) {
#if defined(__x86_64__)
  if (kHasF16C) return FromHalfF16C(v, n, s, y);
#endif
  FromHalfPortable(v, n, s, y);
}

}  // namespace

size_t EncodedBytes(Codec codec, size_t count) {
  switch (codec) {
    case Codec::kNone: return count * 4;
    case Codec::kBFloat16: return count * 2;
    case Codec::kFloat16: return Blocks(count) * 4 + count * 2;
    case Codec::kInt8: return Blocks(count) * 4 + count;
  }
  return 0;
}

bool EncodedCount(Codec codec, size_t bytes, size_t* count) {
  switch (codec) {
    case Codec::kNone: *count = bytes / 4; break;
    case Codec::kBFloat16: *count = bytes / 2; break;
    case Codec::kFloat16:
    case Codec::kInt8: {
      // Every block but the last is whole: a scale and kCodecBlock values;
      // the last holds a scale and 1..kCodecBlock values.
      const size_t value = codec == Codec::kFloat16 ? 2 : 1;
      const size_t block = 4 + kCodecBlock * value;
      if (bytes == 0) {
        *count = 0;
      } else if (bytes < 4 + value) {
        return false;
      } else {
        const size_t whole = (bytes - 4 - value) / block;
        *count = whole * kCodecBlock + (bytes - whole * block - 4) / value;
      }
      break;
    }
    default: return false;
  }
  return EncodedBytes(codec, *count) == bytes;
}

void Encode(Codec codec, const float* src, size_t count, void* dst_v) {
  IeeeDenormals ieee;
  char* dst = static_cast<char*>(dst_v);
  switch (codec) {
    case Codec::kNone:
      std::memcpy(dst, src, count * 4);
      return;
    case Codec::kBFloat16: {
      uint16_t* v = reinterpret_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) v[i] = FloatToBF16(src[i]);
      return;
    }
    case Codec::kFloat16:
    case Codec::kInt8: {
      const size_t blocks = Blocks(count);
      char* values = dst + blocks * 4;
      for (size_t b = 0; b < blocks; ++b) {
        const size_t begin = b * kCodecBlock;
        const size_t n = std::min(kCodecBlock, count - begin);
        const float* x = src + begin;
        bool non_finite = false;
        const float m = MaxAbs(x, n, &non_finite);
        if (codec == Codec::kFloat16) {
          const float s = Fp16Scale(m);
          const float inv = 1.0f / s;  // a power of two: exact
          ToHalf(x, n, inv, reinterpret_cast<uint16_t*>(values) + begin);
          std::memcpy(dst + b * 4, &s, 4);
        } else {
          int8_t* v = reinterpret_cast<int8_t*>(values) + begin;
          if (non_finite || m < kInt8Smallest) {
            std::memset(v, 0, n);
            const float s = non_finite ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
            std::memcpy(dst + b * 4, &s, 4);
            continue;
          }
          ToInt8(x, n, 127.0f / m, v);
          const float s = Int8Scale(m);
          std::memcpy(dst + b * 4, &s, 4);
        }
      }
      return;
    }
  }
}

void Decode(Codec codec, const void* src_v, size_t count, float* dst) {
  IeeeDenormals ieee;
  const char* src = static_cast<const char*>(src_v);
  switch (codec) {
    case Codec::kNone:
      std::memcpy(dst, src, count * 4);
      return;
    case Codec::kBFloat16: {
      const uint16_t* v = reinterpret_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = BF16ToFloat(v[i]);
      return;
    }
    case Codec::kFloat16:
    case Codec::kInt8: {
      const size_t blocks = Blocks(count);
      const char* values = src + blocks * 4;
      for (size_t b = 0; b < blocks; ++b) {
        const size_t begin = b * kCodecBlock;
        const size_t n = std::min(kCodecBlock, count - begin);
        float s;
        std::memcpy(&s, src + b * 4, 4);
        if (codec == Codec::kFloat16) {
          FromHalf(reinterpret_cast<const uint16_t*>(values) + begin, n, s, dst + begin);
        } else {
          const int8_t* v = reinterpret_cast<const int8_t*>(values) + begin;
          for (size_t i = 0; i < n; ++i) dst[begin + i] = static_cast<float>(v[i]) * s;
        }
      }
      return;
    }
  }
}

void EncodingLoss(Codec codec, const float* src, size_t count, const void* encoded,
                  float* lost) {
  Decode(codec, encoded, count, lost);
  for (size_t i = 0; i < count; ++i) {
    const float d = src[i] - lost[i];
    lost[i] = std::isfinite(d) ? d : 0.0f;
  }
}

void DecodeSum(Codec codec, const void* const* srcs, size_t num_srcs, size_t count,
               float divisor, float* dst) {
  IeeeDenormals ieee;
  float block[kCodecBlock];
  for (size_t b = 0; b * kCodecBlock < count; ++b) {
    const size_t begin = b * kCodecBlock;
    const size_t n = std::min(kCodecBlock, count - begin);
    float* acc = dst + begin;
    for (size_t k = 0; k < num_srcs; ++k) {
      const char* src = static_cast<const char*>(srcs[k]);
      float* into = k == 0 ? acc : block;
      switch (codec) {
        case Codec::kNone:
          std::memcpy(into, src + begin * 4, n * 4);
          break;
        case Codec::kBFloat16: {
          const uint16_t* v = reinterpret_cast<const uint16_t*>(src) + begin;
          for (size_t i = 0; i < n; ++i) into[i] = BF16ToFloat(v[i]);
          break;
        }
        case Codec::kFloat16:
        case Codec::kInt8: {
          const char* values = src + Blocks(count) * 4;
          float s;
          std::memcpy(&s, src + b * 4, 4);
          if (codec == Codec::kFloat16) {
            FromHalf(reinterpret_cast<const uint16_t*>(values) + begin, n, s, into);
          } else {
            const int8_t* v = reinterpret_cast<const int8_t*>(values) + begin;
            for (size_t i = 0; i < n; ++i) into[i] = static_cast<float>(v[i]) * s;
          }
          break;
        }
      }
      if (k > 0) {
        for (size_t i = 0; i < n; ++i) acc[i] += block[i];
      }
    }
    if (divisor != 1.0f) {
      for (size_t i = 0; i < n; ++i) acc[i] = acc[i] / divisor;
    }
  }
}

void SumForTheWayBack(Codec codec, const void* const* srcs, size_t num_srcs, size_t count,
                      float divisor, float* sum, void* encoded) {
  DecodeSum(codec, srcs, num_srcs, count, divisor, sum);
  Encode(codec, sum, count, encoded);
}

}  // namespace herring::engine
