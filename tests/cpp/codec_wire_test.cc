// Unit test of the wire codecs (xla_ffi/engine/codec.h), of what a
// truncated receive is said to be (DescribeTruncation, engine/wire.h) and of
// the launch identity's runs (LaunchRun, engine/wire.h), run by
// tests/test_cpp_units.py under AddressSanitizer + UBSan and ThreadSanitizer.
// The last line on success is
//   CODEC_WIRE_OK checks=<n>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "engine/codec.h"
#include "engine/half.h"
#include "engine/wire.h"

namespace {

using herring::engine::Codec;
using herring::engine::Decode;
using herring::engine::Encode;
using herring::engine::EncodedBytes;
using herring::engine::kCodecBlock;
using herring::test::Check;

std::vector<float> RoundTrip(Codec codec, const std::vector<float>& x) {
  std::vector<char> wire(EncodedBytes(codec, x.size()) + 1, 0x5a);
  Encode(codec, x.data(), x.size(), wire.data());
  Check(wire.back() == 0x5a, "encode stays inside EncodedBytes");
  std::vector<float> out(x.size());
  Decode(codec, wire.data(), x.size(), out.data());
  return out;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Values of every magnitude, blocks of one scale and of mixed scales, and a
// partial last block.
std::vector<float> Data(size_t n) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    const float scale = std::ldexp(1.0f, static_cast<int>(i / kCodecBlock) % 40 - 20);
    x[i] = scale * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  }
  return x;
}

void TestSizes() {
  Check(EncodedBytes(Codec::kNone, 1000) == 4000, "none: 4 bytes per element");
  Check(EncodedBytes(Codec::kBFloat16, 1000) == 2000, "bf16: 2 bytes per element");
  Check(EncodedBytes(Codec::kFloat16, 1000) == 2000 + 4 * 4, "fp16: 2 bytes + 4 per block");
  Check(EncodedBytes(Codec::kInt8, 1000) == 1000 + 4 * 4, "int8: 1 byte + 4 per block");
  Check(EncodedBytes(Codec::kInt8, 0) == 0, "nothing encodes to nothing");
}

void TestBFloat16() {
  // Round to nearest even at the 16th bit: 1 + 2^-8 is a tie between 1 and
  // 1 + 2^-7 and goes to the even 1; 1 + 3 * 2^-8 goes up to 1 + 2^-6.
  const std::vector<float> x = {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
                                -2.5f, std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN()};
  const std::vector<float> y = RoundTrip(Codec::kBFloat16, x);
  Check(y[0] == 1.0f, "bf16: ties to even (down)");
  Check(y[1] == 1.0f + std::ldexp(1.0f, -6), "bf16: ties to even (up)");
  Check(y[2] == -2.5f, "bf16: exact values stay");
  Check(std::isinf(y[3]) && y[3] > 0, "bf16: inf stays");
  Check(std::isnan(y[4]), "bf16: NaN stays NaN");
  const std::vector<float> d = Data(1000);
  const std::vector<float> r = RoundTrip(Codec::kBFloat16, d);
  bool bounded = true;
  for (size_t i = 0; i < d.size(); ++i) {
    bounded &= std::fabs(r[i] - d[i]) <= std::fabs(d[i]) * std::ldexp(1.0f, -8);
  }
  Check(bounded, "bf16: relative error at most 2^-8");
}

// fp16 and int8: every element within the codec's bound of its block's
// largest magnitude m: fp16 2^-11 relative to 2^15 below the scale, so at
// most m * 2^-10 (and exact where the value is one of fp16's); int8 half a
// step, m / 254, and m * 2^-16 for the scale's 17 bits.
void TestBlockCodec(Codec codec, float bound_per_max) {
  const std::vector<float> d = Data(5 * kCodecBlock + 77);
  const std::vector<float> r = RoundTrip(codec, d);
  bool bounded = true;
  for (size_t b = 0; b * kCodecBlock < d.size(); ++b) {
    float m = 0;
    const size_t end = std::min(d.size(), (b + 1) * kCodecBlock);
    for (size_t i = b * kCodecBlock; i < end; ++i) m = std::max(m, std::fabs(d[i]));
    for (size_t i = b * kCodecBlock; i < end; ++i) {
      bounded &= std::fabs(r[i] - d[i]) <= m * bound_per_max;
    }
  }
  Check(bounded, std::string(herring::engine::CodecName(codec)) + ": within its bound");
  // The block's largest magnitude decodes exactly (fp16: 2^15 scaled values
  // of 11 bits are not all exact, but a power of two is; int8: +-127 * m/127).
  std::vector<float> p(kCodecBlock, 0.0f);
  p[3] = 0.75f;
  p[9] = -0.25f;
  const std::vector<float> q = RoundTrip(codec, p);
  Check(q[3] == 0.75f || codec == Codec::kInt8, "fp16: scaled values of fp16 stay exact");
  Check(std::fabs(q[3] - 0.75f) <= 0.75f * std::ldexp(1.0f, -16),
        "the block's maximum comes back");
  Check(q[0] == 0.0f, "zero stays zero");
  // A block of tiny values (largest magnitude below 2^-100 for int8: zeros)
  // stays finite.
  const std::vector<float> t = RoundTrip(codec, std::vector<float>(kCodecBlock, 1e-39f));
  bool finite = true;
  for (float v : t) finite &= std::isfinite(v);
  Check(finite, "a block of subnormals decodes to finite values");
  // A zero block, and a block holding a NaN or an inf.
  const std::vector<float> z = RoundTrip(codec, std::vector<float>(kCodecBlock, 0.0f));
  bool zeros = true;
  for (float v : z) zeros &= Bits(v) == 0;
  Check(zeros, "a zero block decodes to +0");
  std::vector<float> bad = Data(2 * kCodecBlock);
  bad[kCodecBlock + 5] = std::numeric_limits<float>::infinity();
  const std::vector<float> rb = RoundTrip(codec, bad);
  Check(std::isfinite(rb[0]) && std::isfinite(rb[kCodecBlock - 1]),
        "a non-finite value leaves other blocks alone");
  if (codec == Codec::kInt8) {
    bool all_nan = true;
    for (size_t i = kCodecBlock; i < 2 * kCodecBlock; ++i) all_nan &= std::isnan(rb[i]);
    Check(all_nan, "int8: a block holding inf decodes to NaN, never to finite numbers");
  } else {
    Check(std::isinf(rb[kCodecBlock + 5]), "fp16: inf stays inf");
    Check(std::isfinite(rb[kCodecBlock + 6]), "fp16: its finite neighbours stay finite");
  }
}

// The branch-free conversions the fp16 codec uses give the reference
// conversions' bits: every half, and a spread of floats over every exponent
// (all 2^32 agree too; that takes seconds, too long under the sanitizers).
void TestSelectConversions() {
  using namespace herring::engine;
  IeeeDenormals ieee;
  bool same = true;
  for (uint32_t h = 0; h < 65536; ++h) {
    same &= Bits(HalfToFloat(static_cast<uint16_t>(h))) ==
            Bits(HalfToFloatSelect(static_cast<uint16_t>(h)));
  }
  Check(same, "HalfToFloatSelect == HalfToFloat for every half");
  same = true;
  for (uint64_t u = 0; u < (1ull << 32); u += 4093) {
    for (uint32_t d : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x2000u}) {  // around rounding ties
      const uint32_t x = static_cast<uint32_t>(u) ^ d;
      float f;
      std::memcpy(&f, &x, 4);
      same &= FloatToHalf(f) == FloatToHalfSelect(f);
    }
  }
  Check(same, "FloatToHalfSelect == FloatToHalf");
}

// The fp16 codec (F16C instructions where present) against the reference
// conversions, bit for bit: the scale per block as codec.h says, then
// FloatToHalf / HalfToFloat.
void TestFp16Bits() {
  using namespace herring::engine;
  std::vector<float> x = Data(9 * kCodecBlock + 5);
  x[17] = std::ldexp(1.0f, -30);   // a half subnormal after scaling
  x[300] = 65519.0f * 1024;        // rounds near the top of the range
  x[301] = -x[300];
  x[2 * kCodecBlock + 3] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> got = RoundTrip(Codec::kFloat16, x);
  IeeeDenormals ieee;
  bool same = true;
  for (size_t b = 0; b * kCodecBlock < x.size(); ++b) {
    const size_t end = std::min(x.size(), (b + 1) * kCodecBlock);
    float m = 0;
    for (size_t i = b * kCodecBlock; i < end; ++i) {
      if (std::isfinite(x[i])) m = std::max(m, std::fabs(x[i]));
    }
    int e = 0;
    std::frexp(m, &e);
    const float s = m == 0 ? 1.0f : std::ldexp(1.0f, std::max(e - 15, -126));
    for (size_t i = b * kCodecBlock; i < end; ++i) {
      const float want = HalfToFloat(FloatToHalf(x[i] * (1.0f / s))) * s;
      same &= std::isnan(want) ? std::isnan(got[i]) : Bits(want) == Bits(got[i]);
    }
  }
  Check(same, "fp16: the reference conversions' bits");
}

// The int8 codec (AVX2 where present) against its definition in codec.h,
// bit for bit, with blocks of every size class and a partial last block.
void TestInt8Bits() {
  using namespace herring::engine;
  std::vector<float> x = Data(7 * kCodecBlock + 45);
  x[5] = 0.0f;
  x[kCodecBlock + 1] = -0.0f;
  const std::vector<float> got = RoundTrip(Codec::kInt8, x);
  bool same = true;
  for (size_t b = 0; b * kCodecBlock < x.size(); ++b) {
    const size_t end = std::min(x.size(), (b + 1) * kCodecBlock);
    float m = 0;
    for (size_t i = b * kCodecBlock; i < end; ++i) m = std::max(m, std::fabs(x[i]));
    float s = m / 127.0f;
    uint32_t u = Bits(s) & ~0x7fu;
    std::memcpy(&s, &u, 4);
    const float inv = 127.0f / m;
    for (size_t i = b * kCodecBlock; i < end; ++i) {
      const float q = std::max(-127.0f, std::min(127.0f, std::nearbyint(x[i] * inv)));
      same &= Bits(q * s) == Bits(got[i]) || (q * s == 0.0f && got[i] == 0.0f);
    }
  }
  Check(same, "int8: its definition's bits");
}

// DecodeSum: each source decoded, added in order in float32, then divided.
void TestDecodeSum() {
  using namespace herring::engine;
  const size_t n = 3 * kCodecBlock + 11;
  for (Codec codec : {Codec::kNone, Codec::kBFloat16, Codec::kFloat16, Codec::kInt8}) {
    std::vector<std::vector<char>> wires(3);
    std::vector<std::vector<float>> decoded(3);
    std::vector<const void*> srcs;
    for (int k = 0; k < 3; ++k) {
      std::vector<float> x = Data(n);
      for (float& v : x) v *= static_cast<float>(k + 1) * 0.3f;
      wires[k].resize(EncodedBytes(codec, n));
      Encode(codec, x.data(), n, wires[k].data());
      decoded[k].resize(n);
      Decode(codec, wires[k].data(), n, decoded[k].data());
      srcs.push_back(wires[k].data());
    }
    std::vector<float> got(n);
    DecodeSum(codec, srcs.data(), 3, n, 3.0f, got.data());
    bool same = true;
    for (size_t i = 0; i < n; ++i) {
      const float want = ((decoded[0][i] + decoded[1][i]) + decoded[2][i]) / 3.0f;
      same &= Bits(want) == Bits(got[i]);
    }
    Check(same, std::string("DecodeSum in rank order: ") + CodecName(codec));
  }
}

// EncodingLoss: x - x' of the encoding itself, and 0 where that is not
// finite (an int8 block holding inf decodes to NaN; bf16 overflows to inf).
void TestEncodingLoss() {
  using namespace herring::engine;
  const size_t n = 2 * kCodecBlock + 5;
  for (Codec codec : {Codec::kBFloat16, Codec::kFloat16, Codec::kInt8}) {
    std::vector<float> x = Data(n);
    x[3] = std::numeric_limits<float>::infinity();  // block 0 holds inf
    x[kCodecBlock + 1] = 3.0e38f;                   // bf16 rounds it to inf
    std::vector<char> wire(EncodedBytes(codec, n));
    Encode(codec, x.data(), n, wire.data());
    std::vector<float> decoded(n), lost(n, 7.0f);
    Decode(codec, wire.data(), n, decoded.data());
    EncodingLoss(codec, x.data(), n, wire.data(), lost.data());
    bool same = true, any = false;
    for (size_t i = 0; i < n; ++i) {
      const float d = x[i] - decoded[i];
      same &= Bits(lost[i]) == Bits(std::isfinite(d) ? d : 0.0f);
      any |= lost[i] != 0.0f;
    }
    Check(same && any, std::string("EncodingLoss: x - x', 0 where not finite: ") +
                           CodecName(codec));
  }
}

void TestTruncationWords() {
  using herring::engine::DescribeTruncation;
  using herring::engine::Identity;
  using herring::engine::TruncatedReceive;
  using herring::engine::WireHeader;
  WireHeader h{};
  h.magic = herring::engine::kMagic;
  h.version = herring::engine::kWireVersion;
  h.kind = 1;
  h.dtype = static_cast<uint8_t>(herring::engine::DType::kFloat32);
  h.token = 77;
  h.key = 5;
  h.run_id = 9;
  h.part = 1;
  h.chunk = 3;
  h.payload_bytes = 1 << 20;
  h.total_elems = 1 << 24;
  h.contributors = 1;
  herring::engine::SealHeader(&h);
  TruncatedReceive t;
  t.header = &h;
  t.token = 77;
  t.id = Identity{9, 0, 0, 0, 0};
  t.key = 5;
  t.receive = "rank 1's receive for float32[16777216] sum";
  t.from_rank = 0;
  t.received_len = 1040040;
  t.cut_off = 0;
  t.provider_error = "Truncation error";
  const std::string lost = DescribeTruncation(t);
  Check(lost.find("the provider lost data") == 0 && lost.find("1040040 of the 1048680") !=
                                                        std::string::npos,
        "the same reduction's message arriving short is the provider's loss: " + lost);
  t.cut_off = 4096;
  Check(DescribeTruncation(t).find("mismatched reductions") == 0,
        "a message cut off by the posted size is a mismatch");
  t.cut_off = 0;
  t.key = 6;
  Check(DescribeTruncation(t).find("mismatched reductions") == 0,
        "another key under the same identity is a mismatch");
  t.key = 5;
  t.id.occurrence = 1;
  Check(DescribeTruncation(t).find("tag collision") == 0,
        "another identity is a tag collision");
  t.id.occurrence = 0;
  t.token = 78;
  Check(DescribeTruncation(t).find("mismatched reductions") == 0,
        "an unreadable header says what it can");
}

// A launch identity's run keeps its launch count and instruction, never
// equals an XLA run id (32-bit, sign-extended) or an async ticket (bit 62),
// and reads as such in messages.
void TestLaunchRuns() {
  using herring::engine::IsLaunchRun;
  using herring::engine::LaunchInstruction;
  using herring::engine::LaunchOf;
  using herring::engine::LaunchRun;
  const uint64_t instruction = 0xfedcba9876543210ull;
  for (uint32_t launch : {0u, 1u, 7u, 0x7fffffffu, 0xffffffffu}) {
    const int64_t run = LaunchRun(instruction, launch);
    Check(IsLaunchRun(run), "a launch run is one");
    Check(LaunchOf(run) == launch, "the launch count survives");
    Check(LaunchInstruction(run) == static_cast<uint32_t>(instruction >> 35),
          "the instruction's 29 bits survive");
    Check(LaunchRun(instruction ^ (uint64_t{1} << 40), launch) != run,
          "other instructions give other runs");
  }
  for (int64_t xla : {int64_t{0}, int64_t{1}, int64_t{-1}, int64_t{-723189425},
                      int64_t{2147483647}, int64_t{-2147483647 - 1}}) {
    Check(!IsLaunchRun(xla), "an XLA run id is no launch run");
  }
  Check(!IsLaunchRun((int64_t{1} << 62) | 5), "an async ticket is no launch run");
  herring::engine::Identity id;
  id.run_id = LaunchRun(instruction, 3);
  const std::string text = herring::engine::DescribeIdentity(id);
  Check(text.rfind("launch 3 of instruction ", 0) == 0, "described as a launch: " + text);
  id.run_id = -723189425;
  Check(herring::engine::DescribeIdentity(id).rfind("run -723189425, slot 0", 0) == 0,
        "an XLA run id is described as a run");
}

}  // namespace

int main() {
  TestSizes();
  TestBFloat16();
  TestBlockCodec(Codec::kFloat16, std::ldexp(1.0f, -10));
  // int8: half a step, and the scale cut to 17 bits (m * 2^-16).
  TestBlockCodec(Codec::kInt8, 1.0f / 254 + std::ldexp(1.0f, -16));
  TestSelectConversions();
  TestFp16Bits();
  TestInt8Bits();
  TestDecodeSum();
  TestEncodingLoss();
  TestTruncationWords();
  TestLaunchRuns();
  return herring::test::Finish("CODEC_WIRE");
}
