// libFuzzer + AddressSanitizer/UBSan harness for the wire-header parser
// (xla_ffi/engine/wire.{h,cc}): everything in there that looks at bytes that
// came off the network.
//
// Build and run with tests/fuzz/run_fuzzer.sh; compiled together with
// xla_ffi/engine/wire.cc, xla_ffi/engine/reduce_kernels.cc and `-I xla_ffi`.
//
// Each input is split by FuzzedDataProvider into a choice of path and the
// values that path needs, so the fuzzer controls the raw header bytes, the
// received length and every expected value (Expectation, token, sender,
// ranks). The paths:
//
//   kRawHeader    fuzzer-written header bytes (optionally with magic, version
//                 and checksum repaired so that the field checks behind them
//                 are reached), a received length below, at or above
//                 sizeof(WireHeader), and an Expectation that is either
//                 arbitrary or copied from the header with some fields
//                 changed; checked by CheckHeader, CheckControlHeader and
//                 CheckAbortHeader.
//   kSealedHeader a valid header built and sealed with SealHeader, which must
//                 be accepted; then one fuzzer-chosen byte is flipped (or one
//                 expected field changed) and the verdict is checked.
//   kMeans        headers whose device counts (`contributors`) the fuzzer
//                 chooses, summed as a server sums them (AddContributors) when
//                 CheckHeader accepts them, and the total used as the divisor
//                 of an integer mean in the reduction kernel
//                 (reduce_kernels.cc): no count a peer can send may make it
//                 divide by zero or a negative number, or overflow.
//   kTags         the tag helpers: TagSender on any 64-bit tag, the layout
//                 round-trip of MakeTag / MakeControlTag / MakeHeartbeatTag,
//                 and IdentityTagBits (30 bits, deterministic).
//
// Every invariant below is one the code or its comments promise; a violation
// calls __builtin_trap(), which libFuzzer reports as a crash and saves the
// input. Memory errors are ASan's business: the header lives in an
// exactly-sized heap buffer, and the bytes of a short message that were never
// "received" are poisoned, so reading them is reported too.

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "header_checks.h"

namespace {

// An Expectation with every field chosen by the fuzzer (enum values included:
// MsgKind, DType and ReduceOp have uint8_t underlying types, so any byte is a
// valid value of the type even when it names no enumerator).
Expectation ConsumeExpectation(FuzzedDataProvider& in) {
  Expectation want;
  want.kind = static_cast<MsgKind>(in.ConsumeIntegral<uint8_t>());
  want.token = in.ConsumeIntegral<uint64_t>();
  want.key = in.ConsumeIntegral<uint64_t>();
  want.id.run_id = in.ConsumeIntegral<int64_t>();
  want.id.slot = in.ConsumeIntegral<uint32_t>();
  want.id.instance = in.ConsumeIntegral<uint32_t>();
  want.id.occurrence = in.ConsumeIntegral<uint64_t>();
  want.id.buffer = in.ConsumeIntegral<uint32_t>();
  want.src_rank = in.ConsumeIntegral<uint32_t>();
  want.self_rank = in.ConsumeIntegral<uint32_t>();
  want.stream = in.ConsumeIntegral<uint32_t>();
  want.part = in.ConsumeIntegral<uint32_t>();
  want.chunk = in.ConsumeIntegral<uint32_t>();
  want.dtype = static_cast<DType>(in.ConsumeIntegral<uint8_t>());
  want.op = static_cast<ReduceOp>(in.ConsumeIntegral<uint8_t>());
  want.codec = static_cast<Codec>(in.ConsumeIntegral<uint8_t>());
  want.payload_bytes = in.ConsumeIntegral<uint64_t>();
  want.total_elems = in.ConsumeIntegral<uint64_t>();
  return want;
}

// The Expectation a header satisfies exactly (received by rank `self`).
Expectation ExpectationOf(const WireHeader& h, uint32_t self) {
  Expectation want;
  want.kind = static_cast<MsgKind>(h.kind);
  want.token = h.token;
  want.key = h.key;
  want.id = HeaderIdentity(h);
  want.src_rank = h.src_rank;
  want.self_rank = self;
  want.stream = h.stream;
  want.part = h.part;
  want.chunk = h.chunk;
  want.dtype = static_cast<DType>(h.dtype);
  want.op = static_cast<ReduceOp>(h.op);
  want.codec = static_cast<Codec>(h.codec);
  want.payload_bytes = h.payload_bytes;
  want.total_elems = h.total_elems;
  return want;
}

// The expected fields, for changing exactly one of them.
enum class Field {
  kToken, kKind, kSrcRank, kStream, kPart, kChunk,  // who sent it / which tag
  kRunId, kSlot, kInstance, kOccurrence, kBuffer,   // which reduction (identity)
  kKey, kDType, kOp, kCodec, kPayloadBytes, kTotalElems,  // what was reduced
  kCount,
};

// Changes `field` of `want` to a different value (xor with a non-zero delta
// of the field's width).
void Perturb(Expectation* want, Field field, uint64_t delta) {
  auto flip8 = [&](auto v) {
    using E = decltype(v);
    return static_cast<E>(static_cast<uint8_t>(v) ^ static_cast<uint8_t>(delta | 1));
  };
  const uint32_t d32 = static_cast<uint32_t>(delta) | 1;
  const uint64_t d64 = delta | 1;
  switch (field) {
    case Field::kToken: want->token ^= d64; break;
    case Field::kKind: want->kind = flip8(want->kind); break;
    case Field::kSrcRank: want->src_rank ^= d32; break;
    case Field::kStream: want->stream ^= d32; break;
    case Field::kPart: want->part ^= d32; break;
    case Field::kChunk: want->chunk ^= d32; break;
    case Field::kRunId: want->id.run_id ^= static_cast<int64_t>(d64); break;
    case Field::kSlot: want->id.slot ^= d32; break;
    case Field::kInstance: want->id.instance ^= d32; break;
    case Field::kOccurrence: want->id.occurrence ^= d64; break;
    case Field::kBuffer: want->id.buffer ^= d32; break;
    case Field::kKey: want->key ^= d64; break;
    case Field::kDType: want->dtype = flip8(want->dtype); break;
    case Field::kOp: want->op = flip8(want->op); break;
    case Field::kCodec: want->codec = flip8(want->codec); break;
    case Field::kPayloadBytes: want->payload_bytes ^= d64; break;
    case Field::kTotalElems: want->total_elems ^= d64; break;
    case Field::kCount: break;
  }
}

// Path kRawHeader: whatever bytes arrive.
void FuzzRawHeader(FuzzedDataProvider& in) {
  // Decisions first (taken from the end of the input), then the header bytes
  // (from the front), so the header bytes map directly onto the input.
  const uint8_t repair = in.ConsumeIntegral<uint8_t>();
  const int len_mode = in.ConsumeIntegralInRange<int>(0, 3);
  const uint64_t len_value = in.ConsumeIntegral<uint64_t>();
  const bool want_from_header = in.ConsumeBool();
  const uint32_t perturb_mask = in.ConsumeIntegral<uint32_t>();  // fields to change
  const uint64_t delta = in.ConsumeIntegral<uint64_t>();
  const uint32_t ranks = in.ConsumeIntegral<uint32_t>();
  const bool sender_from_header = in.ConsumeBool();
  const uint32_t sender_value = in.ConsumeIntegral<uint32_t>();
  const uint32_t self_rank = in.ConsumeIntegral<uint32_t>();

  uint8_t raw[kHeaderSize] = {};  // a short input leaves the tail zero
  const std::vector<uint8_t> given = in.ConsumeBytes<uint8_t>(kHeaderSize);
  if (!given.empty()) std::memcpy(raw, given.data(), given.size());
  HeaderBuffer buf(raw);
  // Optional repairs let the fuzzer get past the integrity checks (a 32-bit
  // magic and checksum are hard to guess) to the field checks behind them.
  auto* writable = reinterpret_cast<WireHeader*>(buf.bytes());
  if (repair & 1) writable->magic = kMagic;
  if (repair & 2) writable->version = kWireVersion;
  if (repair & 4) SealHeader(writable);
  const WireHeader& h = buf.header();

  // Received length: short (0..79 bytes, header partly written), exactly what
  // the header announces (wrapping if it announces more than size_t holds),
  // around a header's size, or anything.
  size_t len = 0;
  switch (len_mode) {
    case 0: len = len_value % kHeaderSize; break;
    case 1: len = kHeaderSize + static_cast<size_t>(h.payload_bytes); break;
    case 2: len = kHeaderSize - 8 + len_value % 24; break;
    default: len = static_cast<size_t>(len_value); break;
  }

  Expectation want = want_from_header ? ExpectationOf(h, self_rank) : ConsumeExpectation(in);
  for (int f = 0; f < static_cast<int>(Field::kCount); ++f) {
    if (perturb_mask & (1u << f)) Perturb(&want, static_cast<Field>(f), delta >> f);
  }
  CheckHeaderChecked(buf, len, want);

  // The same bytes as a control message (an abort or a heartbeat) from the
  // tag's sender, expected with the Expectation's kind and token.
  const uint32_t sender = sender_from_header ? h.src_rank : sender_value;
  CheckControlChecked(buf, len, want.kind, want.token, sender, ranks);
}

// Path kSealedHeader: a header as a peer sends it, then damaged.
void FuzzSealedHeader(FuzzedDataProvider& in) {
  WireHeader h;
  std::memset(&h, 0, sizeof(h));
  h.magic = kMagic;
  h.version = kWireVersion;
  h.kind = in.ConsumeIntegralInRange<uint8_t>(1, 7);  // the kinds CheckHeader takes
  h.dtype = in.ConsumeIntegralInRange<uint8_t>(1, 12);
  h.op = in.ConsumeIntegralInRange<uint8_t>(0, 1);
  h.codec = in.ConsumeIntegralInRange<uint8_t>(0, 3);
  h.token = in.ConsumeIntegral<uint64_t>();
  h.key = in.ConsumeIntegral<uint64_t>();
  h.run_id = in.ConsumeIntegral<int64_t>();
  h.slot = in.ConsumeIntegral<uint32_t>();
  h.instance = in.ConsumeIntegral<uint32_t>();
  h.occurrence = in.ConsumeIntegral<uint64_t>();
  h.buffer = in.ConsumeIntegral<uint32_t>();
  h.src_rank = in.ConsumeIntegral<uint32_t>();
  h.stream = in.ConsumeIntegral<uint32_t>();
  h.part = in.ConsumeIntegral<uint32_t>();
  h.chunk = in.ConsumeIntegral<uint32_t>();
  // Any length a message can have (header + payload must fit in a size_t).
  h.payload_bytes = in.ConsumeIntegralInRange<uint64_t>(
      0, std::numeric_limits<size_t>::max() - kHeaderSize);
  h.total_elems = in.ConsumeIntegral<uint64_t>();
  for (uint8_t& r : h.reserved) r = in.ConsumeIntegral<uint8_t>();
  // Every contribution and result sums at least one device, and at most
  // kMaxContributors (beyond either it is malformed).
  h.contributors = in.ConsumeIntegralInRange<uint32_t>(1, kMaxContributors);
  h.served = 0;  // as every sender of these kinds leaves it (WireHeader{})
  SealHeader(&h);
  const size_t len = kHeaderSize + static_cast<size_t>(h.payload_bytes);
  const Expectation want = ExpectationOf(h, in.ConsumeIntegral<uint32_t>());

  // The checksum is "of every other byte": the checksum field alone does not
  // enter it, the served group does.
  {
    WireHeader other = h;
    other.checksum = ~h.checksum;
    FUZZ_CHECK(HeaderChecksum(other) == h.checksum);
    other.served = h.served ^ 0xff;  // one byte: FNV-1a always sees it
    FUZZ_CHECK(HeaderChecksum(other) != h.checksum);
  }

  // As sealed, it is accepted: as the message expected, and as a control
  // message of its kind from its sender in a job that has that rank.
  HeaderBuffer sealed(reinterpret_cast<const uint8_t*>(&h));
  FUZZ_CHECK(CheckHeaderChecked(sealed, len, want) == HeaderVerdict::kOk);
  if (h.src_rank < std::numeric_limits<uint32_t>::max()) {
    FUZZ_CHECK(CheckControlChecked(sealed, len, static_cast<MsgKind>(h.kind), h.token,
                                   h.src_rank, h.src_rank + 1));
  }

  const uint8_t action = in.ConsumeIntegralInRange<uint8_t>(0, 1);
  if (action == 0) {
    // One damaged byte. FNV-1a changes its result for any single changed
    // byte (each step is a bijection of the running hash), so damage to the
    // covered bytes or to the checksum is always caught (and the served
    // group, covered too, must be zero outside kServed). Any damage is
    // kMalformed, never accepted and never a job-failing kMismatch.
    const size_t offset = in.ConsumeIntegralInRange<size_t>(0, kHeaderSize - 1);
    const uint8_t flip = in.ConsumeIntegralInRange<uint8_t>(1, 255);
    uint8_t damaged_bytes[kHeaderSize];
    std::memcpy(damaged_bytes, &h, kHeaderSize);
    damaged_bytes[offset] ^= flip;
    HeaderBuffer damaged(damaged_bytes);
    const HeaderVerdict v = CheckHeaderChecked(damaged, len, want);
    FUZZ_CHECK(v == HeaderVerdict::kMalformed);
    const bool control_ok =
        CheckControlChecked(damaged, len, static_cast<MsgKind>(h.kind), h.token, h.src_rank,
                            std::numeric_limits<uint32_t>::max());
    FUZZ_CHECK(!control_ok);
  } else {
    // One expected field differs from the header: never accepted. Where the
    // header comments say which kind of refusal it is, it must be that one:
    // a wrong token or sender/stream is a stranger (drop), another identity
    // from a genuine peer a tag collision and a different reduction under the
    // same identity a mismatch (both fail the job, never a drop).
    const Field field = static_cast<Field>(
        in.ConsumeIntegralInRange<int>(0, static_cast<int>(Field::kCount) - 1));
    Expectation other = want;
    Perturb(&other, field, in.ConsumeIntegral<uint64_t>());
    const HeaderVerdict v = CheckHeaderChecked(sealed, len, other);
    FUZZ_CHECK(v != HeaderVerdict::kOk);
    switch (field) {
      case Field::kToken:
      case Field::kSrcRank:
      case Field::kStream:
        FUZZ_CHECK(v == HeaderVerdict::kStranger);
        break;
      case Field::kRunId:
      case Field::kSlot:
      case Field::kInstance:
      case Field::kOccurrence:
      case Field::kBuffer:
        FUZZ_CHECK(v == HeaderVerdict::kCollision);
        break;
      case Field::kKey:
      case Field::kDType:
      case Field::kOp:
      case Field::kCodec:
      case Field::kPayloadBytes:
      case Field::kTotalElems:
        FUZZ_CHECK(v == HeaderVerdict::kMismatch);
        break;
      default:
        break;  // kind, part, chunk: only "not accepted" is promised
    }
  }
}

// An integer mean in the kernel, against a 64-bit model: the sum of the
// sources as T (wrapping), then divided by `divisor` truncating.
template <typename T>
void CheckIntegerMean(FuzzedDataProvider& in, DType dtype, uint64_t divisor) {
  constexpr size_t kCount = 9;  // a block of 64 bytes for int8 needs more: tails
  T a[kCount], b[kCount], out[kCount];
  for (size_t i = 0; i < kCount; ++i) {
    a[i] = in.ConsumeIntegral<T>();
    b[i] = in.ConsumeIntegral<T>();
  }
  const void* srcs[2] = {a, b};
  ReduceInto(dtype, out, srcs, 2, kCount, static_cast<double>(divisor));
  using Wide = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  using U = std::make_unsigned_t<T>;
  for (size_t i = 0; i < kCount; ++i) {
    const T sum = static_cast<T>(static_cast<U>(static_cast<U>(a[i]) + static_cast<U>(b[i])));
    const T want = divisor > 1 ? static_cast<T>(static_cast<Wide>(sum) / static_cast<Wide>(divisor))
                               : sum;
    FUZZ_CHECK(out[i] == want);
  }
}

// Path kMeans: device counts from peers' headers, as far as CheckHeader lets
// them through, summed and divided by.
void FuzzMeans(FuzzedDataProvider& in) {
  const int peers = in.ConsumeIntegralInRange<int>(1, 8);
  uint64_t total = 0;
  bool counted = true;
  for (int p = 0; p < peers && counted; ++p) {
    WireHeader h{};
    h.magic = kMagic;
    h.version = kWireVersion;
    h.kind = static_cast<uint8_t>(MsgKind::kContribution);
    h.dtype = static_cast<uint8_t>(DType::kInt8);
    h.op = static_cast<uint8_t>(ReduceOp::kMean);
    h.src_rank = static_cast<uint32_t>(p);
    h.contributors = in.ConsumeIntegral<uint32_t>();
    SealHeader(&h);
    HeaderBuffer buf(reinterpret_cast<const uint8_t*>(&h));
    const Expectation want = ExpectationOf(h, 0);
    if (CheckHeaderChecked(buf, kHeaderSize, want) != HeaderVerdict::kOk) continue;
    // The server's sum: a total beyond the cap fails the reduction instead.
    counted = AddContributors(&total, h.contributors);
    FUZZ_CHECK(total <= kMaxContributors);
  }
  if (!counted || total == 0) return;
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: CheckIntegerMean<int8_t>(in, DType::kInt8, total); break;
    case 1: CheckIntegerMean<uint8_t>(in, DType::kUInt8, total); break;
    case 2: CheckIntegerMean<int16_t>(in, DType::kInt16, total); break;
    case 3: CheckIntegerMean<int32_t>(in, DType::kInt32, total); break;
    case 4: CheckIntegerMean<int64_t>(in, DType::kInt64, total); break;
    default: CheckIntegerMean<uint32_t>(in, DType::kUInt32, total); break;
  }
}

// Path kTags: the matching tag. TagSender decodes a tag that arrived with a
// message; the Make* helpers must lay fields out as wire.h documents.
void FuzzTags(FuzzedDataProvider& in) {
  const uint64_t any_tag = in.ConsumeIntegral<uint64_t>();
  const uint32_t s = TagSender(any_tag);
  FUZZ_CHECK(s < static_cast<uint32_t>(kMaxRanks));
  FUZZ_CHECK(s == ((any_tag & kSenderBits) >> 49));

  const MsgKind kind = static_cast<MsgKind>(in.ConsumeIntegral<uint8_t>());
  const uint32_t src = in.ConsumeIntegral<uint32_t>();
  const uint32_t stream = in.ConsumeIntegral<uint32_t>();
  const uint64_t bits = in.ConsumeIntegral<uint64_t>();
  const uint64_t chunk = in.ConsumeIntegral<uint64_t>();
  const uint64_t tag = MakeTag(kind, src, stream, bits, chunk);
  // Each field lands in its own bits, truncated to their width (wire.h):
  // kind 63..62 (0 contribution, 1 result, 2 host stage, 3 served),
  // sender 61..49, stream 48..43, identity 42..13, chunk 12..0;
  // a host-stage message carries its step where a chunk index would be.
  const bool host = kind == MsgKind::kHostArrive || kind == MsgKind::kHostReady ||
                    kind == MsgKind::kHostDone;
  FUZZ_CHECK((tag >> 62) == (kind == MsgKind::kResult ? 1u
                             : host                     ? 2u
                             : kind == MsgKind::kServed ? 3u
                                                        : 0u));
  FUZZ_CHECK(TagSender(tag) == (src & 0x1fff));
  FUZZ_CHECK(((tag >> 43) & 0x3f) == (stream & 0x3f));
  FUZZ_CHECK(((tag >> 13) & 0x3fffffff) == (bits & 0x3fffffff));
  if (host) {
    FUZZ_CHECK((tag & 0x1fff) == static_cast<uint64_t>(kind) - 5);
  } else {
    FUZZ_CHECK((tag & 0x1fff) == (chunk & 0x1fff));
  }

  // The identity's tag bits: 30 of them, a function of identity and stream.
  Identity id;
  id.run_id = in.ConsumeIntegral<int64_t>();
  id.slot = in.ConsumeIntegral<uint32_t>();
  id.instance = in.ConsumeIntegral<uint32_t>();
  id.occurrence = in.ConsumeIntegral<uint64_t>();
  id.buffer = in.ConsumeIntegral<uint32_t>();
  const uint64_t id_bits = IdentityTagBits(id, stream);
  FUZZ_CHECK(id_bits <= 0x3fffffffull && id_bits == IdentityTagBits(id, stream));

  // Control tags: the sender's, in the control stream, aborts with identity
  // bits 0 and heartbeats with 1, everything else zero; a reduction (streams
  // 0 .. kMaxStreams - 2) never collides with one.
  const uint64_t control = MakeControlTag(src);
  const uint64_t heartbeat = MakeHeartbeatTag(src);
  FUZZ_CHECK(TagSender(control) == (src & 0x1fff) && TagSender(heartbeat) == (src & 0x1fff));
  FUZZ_CHECK(((control >> 43) & 0x3f) == kControlStream);
  FUZZ_CHECK(((heartbeat >> 43) & 0x3f) == kControlStream);
  FUZZ_CHECK((control & ~kSenderBits) == (uint64_t{kControlStream} << 43));
  FUZZ_CHECK((heartbeat & ~kSenderBits) == ((uint64_t{kControlStream} << 43) | (1ull << 13)));
  if ((stream & 0x3f) != kControlStream) FUZZ_CHECK(tag != control && tag != heartbeat);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: FuzzRawHeader(in); break;
    case 1: FuzzSealedHeader(in); break;
    case 2: FuzzMeans(in); break;
    default: FuzzTags(in); break;
  }
  return 0;
}
