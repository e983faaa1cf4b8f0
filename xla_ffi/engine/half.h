// Conversions between float32 and the 16-bit floating-point formats, in
// integer arithmetic so that they give the same bits whatever the FPU's
// rounding and denormal modes: float16 (IEEE binary16) and bfloat16, both
// rounded to nearest even, NaN kept quiet. Shared by the reduction kernels
// and the wire codecs (codec.h).
#ifndef HERRING_ENGINE_HALF_H_
#define HERRING_ENGINE_HALF_H_

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace herring::engine {

// The handler runs on XLA's threads, which may flush denormals to zero; the
// reduction must give the same bits as an IEEE sum everywhere, so clear
// FTZ/DAZ for the duration of a kernel.
class IeeeDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  IeeeDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~(0x8000u | 0x0040u)); }
  ~IeeeDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned saved_;
#endif
};

inline float HalfToFloat(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int shift = 0;
    while ((mant & 0x400) == 0) {
      mant <<= 1;
      ++shift;
    }
    bits = sign | static_cast<uint32_t>(113 - shift) << 23 | ((mant & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, integer arithmetic only (independent of MXCSR).
inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffff;
  uint32_t o;
  if (x >= 0x47800000) {  // >= 65536: inf, or NaN (kept quiet)
    o = x > 0x7f800000 ? 0x7e00 : 0x7c00;
  } else if (x < 0x38800000) {  // below the smallest normal half
    if (x < 0x33000000) {
      o = 0;
    } else {
      uint32_t e = x >> 23;
      uint32_t m = (x & 0x7fffff) | 0x800000;
      uint32_t shift = 126 - e;
      o = m >> shift;
      uint32_t rem = m & ((1u << shift) - 1);
      uint32_t half = 1u << (shift - 1);
      if (rem > half || (rem == half && (o & 1))) ++o;
    }
  } else {
    uint32_t odd = (x >> 13) & 1;
    x += (static_cast<uint32_t>(15 - 127) << 23) + 0xfff + odd;
    o = x >> 13;
  }
  return static_cast<uint16_t>(o | sign);
}

// All ones where `c`, else zero; and a select on it (no branch).
inline uint32_t Mask(bool c) { return 0u - static_cast<uint32_t>(c); }
inline uint32_t Select(bool c, uint32_t a, uint32_t b) { return (a & Mask(c)) | (b & ~Mask(c)); }

// The same two conversions without branches, so that loops over them
// vectorise (the wire codecs): every case is computed and one selected. They
// give FloatToHalf's and HalfToFloat's bits for every input (NaNs quiet) in
// the default rounding mode with IEEE denormals (IeeeDenormals), since the
// subnormal cases round through a float addition.
inline uint16_t FloatToHalfSelect(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  // >= 65520 (rounds to inf), inf or NaN.
  const uint32_t big = 0x7c00u | (Mask(x > 0x7f800000u) & 0x0200u);
  // Below the smallest normal half: align the value's bits with the half's
  // subnormal ones by adding 0.5 (exponent 126), rounding to nearest even.
  float sub_f;
  std::memcpy(&sub_f, &x, 4);
  sub_f += 0.5f;
  uint32_t sub_u;
  std::memcpy(&sub_u, &sub_f, 4);
  const uint32_t sub = sub_u - 0x3f000000u;
  // Normal: rebias the exponent and round the 13 dropped bits to even.
  const uint32_t normal = (x + (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu +
                           ((x >> 13) & 1u)) >> 13;
  const uint32_t o = Select(x >= 0x477ff000u, big, Select(x < 0x38800000u, sub, normal));
  return static_cast<uint16_t>(o | sign);
}

inline float HalfToFloatSelect(uint16_t h) {
  const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = magnitude & 0x0f800000u;
  const uint32_t normal = magnitude + (static_cast<uint32_t>(127 - 15) << 23);
  const uint32_t special = normal + (static_cast<uint32_t>(128 - 16) << 23);  // inf / NaN
  // Subnormal (and zero): its mantissa times 2^-24, through a float subtraction.
  float sub_f;
  const uint32_t sub_u = normal + (1u << 23);
  std::memcpy(&sub_f, &sub_u, 4);
  sub_f -= 6.103515625e-05f;  // 2^-14
  uint32_t sub;
  std::memcpy(&sub, &sub_f, 4);
  uint32_t o = Select(exp == 0x0f800000u, special, Select(exp == 0, sub, normal));
  o |= static_cast<uint32_t>(h & 0x8000u) << 16;
  float f;
  std::memcpy(&f, &o, 4);
  return f;
}

inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBF16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((x >> 16) | 0x40);
  x += 0x7fff + ((x >> 16) & 1);
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace herring::engine

#endif  // HERRING_ENGINE_HALF_H_
