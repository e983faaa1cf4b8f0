// The wire format: the 64-bit tag used for matching and the header that
// travels in front of every payload and is checked before data is used.
#ifndef HERRING_ENGINE_WIRE_H_
#define HERRING_ENGINE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/dtype.h"

namespace herring::engine {

enum class MsgKind : uint8_t {
  kContribution = 1,  // worker -> server: one chunk of the worker's part
  kResult = 2,        // server -> worker: the reduced chunk
  kAbort = 3,         // any -> all: this rank failed; payload is the reason (text)
  kHeartbeat = 4,     // any -> all, every HERRING_HEARTBEAT_S: this rank is alive
};

// Tag layout (matching only; the header is authoritative):
//   bit 63       kind (0 contribution, 1 result)
//   bits 62..50  sender rank (13 bits)
//   bits 49..44  stream: which group of the call (6 bits)
//   bits 43..30  slot: the call site and buffer within the executable (14 bits)
//   bits 29..14  round of that slot, modulo 2^16
//   bits 13..0   chunk index within the part (14 bits)
// XLA runs independent custom calls concurrently and in any order, so
// reductions are matched by what they are (slot, round), never by the order
// in which they happen to start. Wrap-around is harmless: a slot's round r+2^16
// cannot be in flight while round r still is.
constexpr int kMaxRanks = 1 << 13;
constexpr uint32_t kMaxStreams = 1u << 6;
constexpr uint64_t kMaxChunksPerPart = 1ull << 14;

inline uint64_t MakeTag(MsgKind kind, uint32_t src, uint32_t stream, uint64_t slot,
                        uint64_t round, uint64_t chunk) {
  return (static_cast<uint64_t>(kind == MsgKind::kResult) << 63) |
         (static_cast<uint64_t>(src & 0x1fff) << 50) |
         (static_cast<uint64_t>(stream & 0x3f) << 44) | ((slot & 0x3fff) << 30) |
         ((round & 0xffff) << 14) | (chunk & 0x3fff);
}

// The last stream is reserved for control messages (aborts in slot 0,
// heartbeats in slot 1); reductions use streams 0 .. kMaxStreams - 2.
constexpr uint32_t kControlStream = kMaxStreams - 1;
constexpr uint64_t kSenderBits = 0x1fffull << 50;
inline uint64_t MakeControlTag(uint32_t src) {
  return MakeTag(MsgKind::kContribution, src, kControlStream, 0, 0, 0);
}
inline uint64_t MakeHeartbeatTag(uint32_t src) {
  return MakeTag(MsgKind::kContribution, src, kControlStream, 1, 0, 0);
}
inline uint32_t TagSender(uint64_t tag) { return static_cast<uint32_t>((tag >> 50) & 0x1fff); }

constexpr uint32_t kMagic = 0x474e5248;  // "HRNG"
constexpr uint16_t kWireVersion = 1;

// Fixed-size, little-endian on the machines herring_jax supports (x86-64,
// aarch64); the version field guards layout changes.
struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;          // MsgKind
  uint8_t dtype;         // DType
  uint64_t token;        // job token from initialize()
  uint64_t key;          // caller's description of the reduction (hash)
  uint64_t round;        // how often this slot (call site) reduced before
  uint32_t src_rank;
  uint32_t stream;
  uint32_t part;         // which server's part
  uint32_t chunk;        // chunk index within the part
  uint64_t payload_bytes;
  uint64_t total_elems;  // elements of the whole buffer being reduced
  uint8_t op;            // ReduceOp
  uint8_t reserved[3];
  uint32_t contributors;  // devices summed into this message's data
  uint32_t checksum;      // of all bytes above
  uint32_t reserved2;     // zero: outside the checksum, so checked on its own
};
static_assert(sizeof(WireHeader) == 80, "wire header layout changed");

uint32_t HeaderChecksum(const WireHeader& h);
void SealHeader(WireHeader* h);

// What the receiver expects; fields are compared one by one so that a
// mismatch can be described precisely.
struct Expectation {
  MsgKind kind;
  uint64_t token;
  uint64_t key;
  uint64_t round;
  uint32_t src_rank;
  uint32_t stream;
  uint32_t part;
  uint32_t chunk;
  DType dtype;
  ReduceOp op;
  uint64_t payload_bytes;
  uint64_t total_elems;
};

enum class HeaderVerdict {
  kOk,
  kMalformed,  // too short, bad magic/version/checksum/enum values, reserved
               // bytes not zero: drop
  kStranger,   // wrong token, or sender/stream/part/chunk contradicting the
               // tag it matched on: drop
  kMismatch,   // a genuine peer reduced something different (key, shape,
               // dtype, op, or its round of this call site): fail the job
};

// Checks a received control message of `kind` (header, then `received_len` -
// header bytes of payload: an abort's reason text; heartbeats have none) from
// `sender` (the tag's sender) in a job of `ranks` processes.
bool CheckControlHeader(const WireHeader& h, size_t received_len, MsgKind kind,
                        uint64_t token, uint32_t sender, uint32_t ranks, std::string* why);
inline bool CheckAbortHeader(const WireHeader& h, size_t received_len, uint64_t token,
                             uint32_t sender, std::string* why) {
  return CheckControlHeader(h, received_len, MsgKind::kAbort, token, sender, kMaxRanks, why);
}

// Checks a received message: `header` points at its first sizeof(WireHeader)
// bytes (fewer were written if `received_len` is smaller) and `received_len`
// is the length of the whole message, header included. On anything but kOk
// `why` says what was wrong, in words fit for an error message.
HeaderVerdict CheckHeader(const void* header, size_t received_len, const Expectation& want,
                          std::string* why);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_WIRE_H_
