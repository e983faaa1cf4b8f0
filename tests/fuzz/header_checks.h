// The checked parsers of the wire-header fuzzer (header_fuzzer.cc): a
// header-sized buffer as the transport hands it over, and CheckHeader,
// CheckControlHeader and CheckAbortHeader run with what each verdict
// promises checked. One translation unit includes it: the harness.
#ifndef HERRING_TESTS_FUZZ_HEADER_CHECKS_H_
#define HERRING_TESTS_FUZZ_HEADER_CHECKS_H_

#include <fuzzer/FuzzedDataProvider.h>
#include <sanitizer/asan_interface.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "engine/dtype.h"
#include "engine/reduce_kernels.h"
#include "engine/wire.h"

namespace {

using herring::engine::AddContributors;
using herring::engine::CheckAbortHeader;
using herring::engine::kMaxContributors;
using herring::engine::ReduceInto;
using herring::engine::Codec;
using herring::engine::IsValidCodec;
using herring::engine::CheckControlHeader;
using herring::engine::CheckHeader;
using herring::engine::DType;
using herring::engine::Expectation;
using herring::engine::HeaderChecksum;
using herring::engine::HeaderIdentity;
using herring::engine::HeaderVerdict;
using herring::engine::Identity;
using herring::engine::IdentityTagBits;
using herring::engine::IsValidDType;
using herring::engine::IsValidOp;
using herring::engine::kControlStream;
using herring::engine::kMagic;
using herring::engine::kMaxRanks;
using herring::engine::kSenderBits;
using herring::engine::kWireVersion;
using herring::engine::MakeControlTag;
using herring::engine::MakeHeartbeatTag;
using herring::engine::MakeTag;
using herring::engine::MsgKind;
using herring::engine::ReduceOp;
using herring::engine::SealHeader;
using herring::engine::TagSender;
using herring::engine::WireHeader;

constexpr size_t kHeaderSize = sizeof(WireHeader);

// Aborts the run (libFuzzer saves the input as crash-*) when `cond` is false.
#define FUZZ_CHECK(cond)           \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

// A header-sized buffer as the transport hands it to the parser: exactly
// sizeof(WireHeader) bytes on the heap (so ASan sees any read past its end),
// aligned for WireHeader (operator new aligns to alignof(max_align_t)). When
// the message was shorter than a header, only its first `received` bytes were
// written; the rest are poisoned while the parser runs, since a parser that
// looked at them would act on garbage.
class HeaderBuffer {
 public:
  explicit HeaderBuffer(const uint8_t* bytes) : h_(new WireHeader) {
    std::memcpy(h_.get(), bytes, kHeaderSize);
  }
  ~HeaderBuffer() { Unpoison(); }
  HeaderBuffer(const HeaderBuffer&) = delete;
  HeaderBuffer& operator=(const HeaderBuffer&) = delete;

  // Poisons the bytes a message of `received_len` bytes did not write.
  void PoisonUnreceived(size_t received_len) {
    Unpoison();
    if (received_len < kHeaderSize) {
      poisoned_from_ = received_len;
      ASAN_POISON_MEMORY_REGION(bytes() + received_len, kHeaderSize - received_len);
    }
  }
  void Unpoison() {
    if (poisoned_from_ < kHeaderSize) {
      ASAN_UNPOISON_MEMORY_REGION(bytes() + poisoned_from_, kHeaderSize - poisoned_from_);
      poisoned_from_ = kHeaderSize;
    }
  }

  const WireHeader& header() const { return *h_; }
  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(h_.get()); }

 private:
  std::unique_ptr<WireHeader> h_;
  size_t poisoned_from_ = kHeaderSize;
};

// What a header passing the integrity checks looks like: long enough, right
// magic and version, checksum matching the covered bytes.
bool Intact(const WireHeader& h, size_t len) {
  return len >= kHeaderSize && h.magic == kMagic && h.version == kWireVersion &&
         h.checksum == HeaderChecksum(h);
}

// Runs CheckHeader on `buf` and checks what every verdict promises. Returns the
// verdict for path-specific checks.
HeaderVerdict CheckHeaderChecked(HeaderBuffer& buf, size_t len, const Expectation& want) {
  uint8_t before[kHeaderSize];
  std::memcpy(before, buf.bytes(), kHeaderSize);

  buf.PoisonUnreceived(len);
  std::string why;
  const HeaderVerdict v = CheckHeader(buf.bytes(), len, want, &why);
  // Deterministic: the same message gets the same verdict and reason.
  std::string why_again;
  FUZZ_CHECK(CheckHeader(buf.bytes(), len, want, &why_again) == v);
  buf.Unpoison();
  FUZZ_CHECK(why_again == why);

  // The header is const: the parser must not have written to it.
  FUZZ_CHECK(std::memcmp(before, buf.bytes(), kHeaderSize) == 0);

  const WireHeader& h = buf.header();
  switch (v) {
    case HeaderVerdict::kOk:
      // Accepted: intact, valid enums, the payload length matches both what
      // arrived and what was expected, and every field is the expected one.
      FUZZ_CHECK(Intact(h, len));
      FUZZ_CHECK(IsValidDType(h.dtype) && IsValidOp(h.op));
      FUZZ_CHECK(h.payload_bytes == len - kHeaderSize);
      FUZZ_CHECK(h.payload_bytes == want.payload_bytes);
      FUZZ_CHECK(h.token == want.token);
      FUZZ_CHECK(h.kind == static_cast<uint8_t>(want.kind));
      FUZZ_CHECK(h.src_rank == want.src_rank && h.stream == want.stream);
      FUZZ_CHECK(h.part == want.part && h.chunk == want.chunk);
      FUZZ_CHECK(HeaderIdentity(h) == want.id && h.key == want.key);
      FUZZ_CHECK(h.dtype == static_cast<uint8_t>(want.dtype));
      FUZZ_CHECK(h.op == static_cast<uint8_t>(want.op));
      FUZZ_CHECK(IsValidCodec(h.codec) && h.codec == static_cast<uint8_t>(want.codec));
      FUZZ_CHECK(h.total_elems == want.total_elems);
      break;
    case HeaderVerdict::kCollision:
    case HeaderVerdict::kMismatch:
      // Both fail the job, so only for "a genuine peer": intact, valid enums,
      // consistent length, right token and the sender, stream, chunk and
      // kind of the tag it was matched on (and, for a mismatch, the part: a
      // colliding reduction may number its parts otherwise); and the reason
      // names the sender and this rank.
      FUZZ_CHECK(Intact(h, len));
      FUZZ_CHECK(IsValidDType(h.dtype) && IsValidOp(h.op));
      FUZZ_CHECK(h.payload_bytes == len - kHeaderSize);
      FUZZ_CHECK(h.token == want.token);
      FUZZ_CHECK(h.kind == static_cast<uint8_t>(want.kind));
      FUZZ_CHECK(h.src_rank == want.src_rank && h.stream == want.stream);
      FUZZ_CHECK(h.chunk == want.chunk);
      FUZZ_CHECK(v == HeaderVerdict::kCollision || h.part == want.part);
      FUZZ_CHECK(why.find("rank " + std::to_string(h.src_rank)) != std::string::npos);
      FUZZ_CHECK(why.find("rank " + std::to_string(want.self_rank)) != std::string::npos);
      // A collision is exactly "another identity"; a mismatch is the same
      // identity with another description.
      FUZZ_CHECK((v == HeaderVerdict::kCollision) == (HeaderIdentity(h) != want.id));
      break;
    case HeaderVerdict::kStranger:
    case HeaderVerdict::kMalformed:
      FUZZ_CHECK(!why.empty());
      break;
    default:
      FUZZ_CHECK(false);  // not a HeaderVerdict
  }
  // kMalformed covers "too short, bad magic/version/checksum/enum values",
  // and a count of 0 contributing devices (it would divide a mean) or of more
  // than kMaxContributors (a sum of them could wrap).
  if (!Intact(h, len) || !IsValidDType(h.dtype) || !IsValidOp(h.op) ||
      !IsValidCodec(h.codec) ||
      (len >= kHeaderSize && (h.contributors == 0 || h.contributors > kMaxContributors))) {
    FUZZ_CHECK(v == HeaderVerdict::kMalformed);
  }
  if (v == HeaderVerdict::kOk) FUZZ_CHECK(h.contributors >= 1 && h.contributors <= kMaxContributors);
  return v;
}

// Runs CheckControlHeader (and CheckAbortHeader) and checks what acceptance
// promises. Returns whether the message was accepted.
bool CheckControlChecked(HeaderBuffer& buf, size_t len, MsgKind kind, uint64_t token,
                         uint32_t sender, uint32_t ranks) {
  buf.PoisonUnreceived(len);
  std::string why;
  const bool ok = CheckControlHeader(buf.header(), len, kind, token, sender, ranks, &why);
  std::string abort_why;
  const bool abort_ok = CheckAbortHeader(buf.header(), len, token, sender, &abort_why);
  buf.Unpoison();

  const WireHeader& h = buf.header();
  if (ok) {
    FUZZ_CHECK(Intact(h, len));
    FUZZ_CHECK(h.token == token);
    FUZZ_CHECK(h.kind == static_cast<uint8_t>(kind));
    FUZZ_CHECK(h.src_rank == sender);
    FUZZ_CHECK(h.payload_bytes == len - kHeaderSize);
  } else {
    FUZZ_CHECK(!why.empty());
  }
  // A sender outside the job is never accepted.
  if (sender >= ranks) FUZZ_CHECK(!ok);

  // CheckAbortHeader: the same for an abort from any valid rank number.
  if (abort_ok) {
    FUZZ_CHECK(Intact(h, len));
    FUZZ_CHECK(h.token == token);
    FUZZ_CHECK(h.kind == static_cast<uint8_t>(MsgKind::kAbort));
    FUZZ_CHECK(h.src_rank == sender && sender < static_cast<uint32_t>(kMaxRanks));
    FUZZ_CHECK(h.payload_bytes == len - kHeaderSize);
  } else {
    FUZZ_CHECK(!abort_why.empty());
  }
  if (!Intact(h, len)) FUZZ_CHECK(!ok && !abort_ok);
  return ok;
}

}  // namespace

#endif  // HERRING_TESTS_FUZZ_HEADER_CHECKS_H_
