// Wire codecs: how float32 data travels between processes when a reduction
// asks for compression. Contributions are encoded by their sender, decoded by
// the server, summed in float32 in rank order, and the result is encoded once
// more for the way back; every process (the server included) keeps the
// decoded result, so all of them hold the same bits.
//
// Formats, for `count` elements starting at a block boundary (the engine cuts
// parts and chunks at multiples of kCodecBlock elements from the buffer's
// start, so a buffer's encoding does not depend on how it was cut):
//   bf16  count bfloat16 values (round to nearest even).
//   fp16  one float32 scale per block of kCodecBlock elements, then count
//         float16 values: v = half(x / s), x' = v * s. s is a power of two
//         chosen so that the block's largest finite magnitude m stays below
//         2^15 (s = 2^(e - 15) for m = f * 2^e, 0.5 <= f < 1; at least
//         2^-126), which neither overflows float16 nor wastes its precision on
//         small gradients; x / s and v * s are exact.
//   int8  one float32 scale per block, then count int8 values:
//         v = clamp(round_even(x * (127 / m)), -127, 127), x' = v * s, with
//         s = m / 127 cut to 17 significant bits (its 7 lowest mantissa bits
//         cleared) so that v * s is exact: the same bits with or without a
//         fused multiply-add wherever the codec is modelled (error feedback
//         computes x - x' in jax). A block with m < 2^-100 (zeros, or values
//         so small that 127 / m would overflow) has s = 0 and decodes to
//         zeros; a block holding an
//         infinity or NaN has s = NaN, so it decodes to NaN rather than to
//         silently wrong finite numbers.
// tests/workers/common.py holds a numpy model of each, bit for bit.
#ifndef HERRING_ENGINE_CODEC_H_
#define HERRING_ENGINE_CODEC_H_

#include <cstddef>
#include <cstdint>

namespace herring::engine {

enum class Codec : uint8_t { kNone = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3 };

constexpr size_t kCodecBlock = 256;

inline bool IsValidCodec(uint8_t v) { return v <= 3; }

inline const char* CodecName(Codec c) {
  switch (c) {
    case Codec::kNone: return "none";
    case Codec::kBFloat16: return "bf16";
    case Codec::kFloat16: return "fp16";
    case Codec::kInt8: return "int8";
  }
  return "invalid";
}

// Bytes that `count` float32 elements take on the wire.
size_t EncodedBytes(Codec codec, size_t count);

// The element count whose encoding takes `bytes` bytes (the inverse of
// EncodedBytes, for chunks that begin at a block boundary); false if no
// count encodes to exactly that many bytes (a server-only process learns a
// chunk's length from its message alone).
bool EncodedCount(Codec codec, size_t bytes, size_t* count);

// Encodes `count` float32 elements of `src` into `dst` (EncodedBytes long).
void Encode(Codec codec, const float* src, size_t count, void* dst);

// Decodes EncodedBytes(codec, count) bytes of `src` into `count` floats.
void Decode(Codec codec, const void* src, size_t count, float* dst);

// What encoding lost: lost[i] = src[i] - x'[i], x' the decoding of
// `encoded` (Encode's output for the `count` elements of `src`); 0 where that
// difference is not finite (a value or block that holds inf or NaN, or a
// bfloat16 overflow), so that error feedback never carries a non-finite
// residual into the next step.
void EncodingLoss(Codec codec, const float* src, size_t count, const void* encoded,
                  float* lost);

// The server's sum: dst[i] = ((x'0[i] + x'1[i]) + ...) / divisor in float32,
// the sources (each an encoding of `count` elements) decoded and added in
// the order given, tile by tile so that the sums stay in cache: the same bits
// as decoding each and summing with ReduceInto. divisor == 1 skips the
// division.
void DecodeSum(Codec codec, const void* const* srcs, size_t num_srcs, size_t count,
               float divisor, float* dst);

// A part's sum as it travels back: DecodeSum into `sum` (`count` floats),
// then that encoded into `encoded` (EncodedBytes long). What a worker's
// shard and a server-only process both run for an encoded chunk, so that
// every rank gets the same bits whichever of them summed it.
void SumForTheWayBack(Codec codec, const void* const* srcs, size_t num_srcs, size_t count,
                      float divisor, float* sum, void* encoded);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_CODEC_H_
