// The wire format: the 64-bit tag used for matching and the header that
// travels in front of every payload and is checked before data is used.
#ifndef HERRING_ENGINE_WIRE_H_
#define HERRING_ENGINE_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "engine/codec.h"
#include "engine/dtype.h"

namespace herring::engine {

enum class MsgKind : uint8_t {
  kContribution = 1,  // worker -> server: one chunk of the worker's part
  kResult = 2,        // server -> worker: the reduced chunk
  kAbort = 3,         // any -> all: this rank failed; payload is the reason (text)
  kHeartbeat = 4,     // any -> all, every HERRING_HEARTBEAT_S: this rank is alive
  // The host stage (host_stage.cc) between the processes of one host, whose
  // data moves through memory; payload: one HostEntry per buffer of the call.
  kHostArrive = 5,    // here are my inputs (addresses in my process)
  kHostReady = 6,     // my slice of the result is ready (in my staging buffer)
  kHostDone = 7,      // I have read your slice: you may let go of it (no payload);
                      // with contributors == kHostWithdrawn: my call failed, I
                      // read nothing of yours any more and my inputs are gone
  // Control messages between ranks, besides aborts and heartbeats
  // (departures.cc): payload text.
  // kLeave: this rank shuts down (its reductions are done); its header's
  // `occurrence` counts the data messages it sent the receiver, and
  // `total_elems` those it took in from the receiver (leave_ledger.h).
  kLeave = 8,         // any -> all
  // kStall: what this rank waits in, with its call site, once a reduction has
  // waited a second (a heartbeat has no room for the call site).
  kStall = 9,         // any -> the ranks it waits for
  // kReceipt: the answer to a kLeave once every data message of the leaver
  // has arrived; `total_elems` counts those taken in.
  kReceipt = 10,      // any -> a rank that left
  // kAbortSeen: the answer to a kAbort once this rank has printed it, so that
  // the failing rank exits (and jax.distributed ends the others) only after
  // herring's line naming the failure comes first on every rank.
  kAbortSeen = 11,    // any -> a rank that aborted
  // kServed: worker -> a server-only process (served.cc): one chunk of a part
  // that process sums. Its own tag kind, so that the server's receives, posted
  // for any sender and reduction, match nothing else. Answered by kResult.
  kServed = 12,
};

// The `contributors` of a kHostDone that withdraws (host_posting.cc); a
// plain kHostDone says 1.
constexpr uint32_t kHostWithdrawn = 2;

inline bool IsControlKind(MsgKind kind) {
  return kind == MsgKind::kAbort || kind == MsgKind::kLeave || kind == MsgKind::kStall ||
         kind == MsgKind::kReceipt || kind == MsgKind::kAbortSeen;
}

inline bool IsHostKind(MsgKind kind) {
  return kind == MsgKind::kHostArrive || kind == MsgKind::kHostReady ||
         kind == MsgKind::kHostDone;
}

// One buffer of a call in a host-stage message. Addresses are in the sender's
// address space and are only read (process_vm_readv), never written.
struct HostEntry {
  uint64_t addr;          // arrive: the sender's input; ready: its result slice
  uint64_t key;           // the buffer's description (checked, as in the header)
  uint64_t count;         // elements of the whole buffer
  uint32_t contributors;  // arrive: devices summed into the input; ready: all of them
  uint8_t dtype;          // DType
  uint8_t op;             // ReduceOp
  uint8_t codec;          // Codec
  uint8_t reserved;       // zero
};
static_assert(sizeof(HostEntry) == 32, "host entry layout changed");

// Which reduction a message belongs to, derived the same way on every process
// and never from the order in which reductions happen to start (XLA runs
// independent custom calls concurrently, in a different order on each process,
// and several executables can be in flight at once):
//   run_id      XLA's RunId of the execution: a per-executable base (from the
//               executable's fingerprint, the same on every process that
//               compiled the same program) plus that executable's launch count;
//               or, under the launch identity (call_identity.cc), LaunchRun of
//               the instruction and its launch count.
//   slot        the call site within the lowered module (0, 1, 2, ...).
//   instance    which inlined copy of the call site (XLA inlines a jitted helper
//               called twice into two custom calls with equal attributes): the
//               instruction's number among equal ones in instantiate order.
//   occurrence  how often this (run, stream, group, slot, instance) reduced
//               before: iterations of a loop.
//   buffer      which operand of the call.
struct Identity {
  int64_t run_id = 0;
  uint32_t slot = 0;
  uint32_t instance = 0;
  uint64_t occurrence = 0;
  uint32_t buffer = 0;

  bool operator==(const Identity& o) const {
    return run_id == o.run_id && slot == o.slot && instance == o.instance &&
           occurrence == o.occurrence && buffer == o.buffer;
  }
  bool operator!=(const Identity& o) const { return !(*this == o); }
};

// splitmix64's finalizer: every input bit flips about half the output bits.
inline uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A launch identity's run: bit 61 set (XLA's run ids are 32-bit values,
// sign-extended; the async pair's tickets set bit 62), a 29-bit hash of the
// instruction in bits 32..60, its launch count in bits 0..31.
constexpr int64_t kLaunchRunBit = int64_t{1} << 61;
inline int64_t LaunchRun(uint64_t instruction, uint32_t launch) {
  return kLaunchRunBit | static_cast<int64_t>((instruction >> 35) << 32) |
         static_cast<int64_t>(launch);
}
inline bool IsLaunchRun(int64_t run) {
  return (static_cast<uint64_t>(run) >> 61) == 1;  // bits 63, 62 clear, 61 set
}
inline uint32_t LaunchOf(int64_t run) { return static_cast<uint32_t>(run); }
// An async reduction's run (xla_ffi/async_pair.cc): its ticket with bit 62.
inline bool IsTicketRun(int64_t run) { return (static_cast<uint64_t>(run) >> 62) == 1; }
// XLA run ids of one call this close come from one executable (a base plus
// its launch count; two executables' bases are hashes, far apart).
constexpr int64_t kNearRuns = 1 << 16;
inline uint32_t LaunchInstruction(int64_t run) {
  return static_cast<uint32_t>((run & ~kLaunchRunBit) >> 32);
}

// "run R, slot S, instance I, occurrence O, buffer B", for messages ("launch
// L of instruction T, slot S, ..." under the launch identity).
std::string DescribeIdentity(const Identity& id);

// Tag layout (matching only; the header is authoritative):
//   bits 63..62  kind (0 contribution, 1 result, 2 host stage, 3 served)
//   bits 61..49  sender rank (13 bits)
//   bits 48..43  stream: which group of the call (6 bits)
//   bits 42..13  a 30-bit hash of the identity and the stream
//   bits 12..0   chunk index within the part (13 bits); for host-stage
//                messages the step (0 arrive, 1 ready, 2 done)
// The hash can collide: two reductions in flight at once whose hashes agree
// could match each other's messages. The header carries the whole identity and
// the receiver compares it exactly, so a collision fails the job with both
// identities named (HeaderVerdict::kCollision); it is never a wrong sum.
constexpr int kMaxRanks = 1 << 13;
constexpr uint32_t kMaxStreams = 1u << 6;
constexpr uint64_t kMaxChunksPerPart = 1ull << 13;
constexpr uint64_t kIdentityBits = 0x3fffffffull;
constexpr int kSenderShift = 49;
constexpr int kStreamShift = 43;
constexpr int kIdentityShift = 13;

// The identity's 30 tag bits (mixed so that neighbouring run ids, slots and
// occurrences differ in many bits).
uint64_t IdentityTagBits(const Identity& id, uint32_t stream);

inline uint64_t TagKindBits(MsgKind kind) {
  return kind == MsgKind::kResult ? 1 : IsHostKind(kind) ? 2 : kind == MsgKind::kServed ? 3 : 0;
}

inline uint64_t MakeTag(MsgKind kind, uint32_t src, uint32_t stream, uint64_t identity_bits,
                        uint64_t chunk) {
  if (IsHostKind(kind)) {
    chunk = static_cast<uint64_t>(kind) - static_cast<uint64_t>(MsgKind::kHostArrive);
  }
  return (TagKindBits(kind) << 62) | (static_cast<uint64_t>(src & 0x1fff) << kSenderShift) |
         (static_cast<uint64_t>(stream & 0x3f) << kStreamShift) |
         ((identity_bits & kIdentityBits) << kIdentityShift) | (chunk & 0x1fff);
}

// The last stream is reserved for control messages (aborts with identity bits
// 0, heartbeats with 1); reductions use streams 0 .. kMaxStreams - 2.
constexpr uint32_t kControlStream = kMaxStreams - 1;
constexpr uint64_t kSenderBits = 0x1fffull << kSenderShift;
inline uint64_t MakeControlTag(uint32_t src) {
  return MakeTag(MsgKind::kContribution, src, kControlStream, 0, 0);
}
inline uint64_t MakeHeartbeatTag(uint32_t src) {
  return MakeTag(MsgKind::kContribution, src, kControlStream, 1, 0);
}
inline uint32_t TagSender(uint64_t tag) {
  return static_cast<uint32_t>((tag >> kSenderShift) & 0x1fff);
}

// Devices summed into one message's data at most (the `contributors` of a
// header or host entry): far beyond any job, and small enough that the sum
// over kMaxRanks processes fits 64 bits many times over and a group's total
// fits the header's 32 bits. A header above it is malformed; a total above it
// fails the reduction (AddContributors). Without a cap a peer's header could
// wrap a 32-bit total to 0, the divisor of a mean.
constexpr uint32_t kMaxContributors = 1u << 24;

// Adds one message's device count to a running total; false (and the total
// unchanged) where the total would exceed kMaxContributors.
inline bool AddContributors(uint64_t* total, uint64_t more) {
  if (more > kMaxContributors || *total + more > kMaxContributors) return false;
  *total += more;
  return true;
}

constexpr uint32_t kMagic = 0x474e5248;  // "HRNG"
// Version 2: the header carries the whole identity (run id, slot, instance,
// occurrence, buffer) instead of version 1's per-slot round. Version 3: the
// host stage's kinds, and a 2-bit kind in the tag (13-bit chunk index).
// Version 4: the codec byte (codec.h); payloads of data messages are encoded.
// Version 5: a kHostDone may withdraw (kHostWithdrawn); at most
// kMaxContributors devices per message. Version 6: the leave protocol's
// counts in kLeave, and kReceipt. Version 7: kServed (tag kind 3). Version 8:
// a kServed message names its sending group (`served`, ServedGroup), and the
// checksum covers every byte but its own. Version 9: a kServed message may
// name a block's owner (ServedGroup::root, gather): reduce-scatters and
// all-gathers through the servers.
constexpr uint16_t kWireVersion = 9;

// Fixed-size, little-endian on the machines herring_jax supports (x86-64,
// aarch64); the version field guards layout changes.
struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;          // MsgKind
  uint8_t dtype;         // DType
  uint64_t token;        // job token from initialize()
  uint64_t key;          // caller's description of the reduction (hash)
  int64_t run_id;        // Identity
  uint64_t occurrence;   //   "
  uint32_t slot;         //   "
  uint32_t instance;     //   "
  uint32_t buffer;       //   "
  uint32_t src_rank;
  uint32_t stream;
  uint32_t part;         // which server's part
  uint32_t chunk;        // chunk index within the part
  uint32_t contributors;  // devices summed into this message's data
  uint64_t payload_bytes;
  uint64_t total_elems;  // elements of the whole buffer being reduced
  uint8_t op;            // ReduceOp
  uint8_t codec;         // Codec of the payload (data messages)
  uint8_t reserved[2];
  uint32_t checksum;     // of every other byte of the header
  uint64_t served;       // kServed: PackServedGroup; zero in every other message
};
static_assert(sizeof(WireHeader) == 104, "wire header layout changed");

inline Identity HeaderIdentity(const WireHeader& h) {
  return Identity{h.run_id, h.slot, h.instance, h.occurrence, h.buffer};
}
inline void SetHeaderIdentity(WireHeader* h, const Identity& id) {
  h->run_id = id.run_id;
  h->slot = id.slot;
  h->instance = id.instance;
  h->occurrence = id.occurrence;
  h->buffer = id.buffer;
}

// A kServed message's group (WireHeader::served): a server-only process
// sums the parts of any group of workers (every worker on the flat path; the
// processes with one local index, one per host, in the host stage), so each
// message says which group sent it (its first process), how many processes
// the group has and where in its summation order the sender is. A
// reduce-scatter or all-gather through the servers goes one block (one
// worker's part) at a time, and names that block's owner, its `root`: a
// reduce-scatter's sum goes back to the root alone; an all-gather's block
// comes from the root alone (`gather`: the others send headers without
// data), and goes to every other member unchanged.
struct ServedGroup {
  static constexpr uint32_t kNoRoot = 0x7fff;
  uint32_t first = 0;     // the group's first process (rank), which tells groups apart
  uint32_t size = 0;      // its processes: contributions to each chunk
  uint32_t position = 0;  // the sender's place in the summation order
  uint32_t root = kNoRoot;  // the block's owner (its position), or none: an all-reduce
  bool gather = false;      // an all-gather's block (root set)
  bool Rooted() const { return root != kNoRoot; }
};
inline uint64_t PackServedGroup(const ServedGroup& g) {
  return (static_cast<uint64_t>(g.gather) << 63) |
         (static_cast<uint64_t>(g.root & 0x7fff) << 48) |
         (static_cast<uint64_t>(g.first & 0xffff) << 32) |
         (static_cast<uint64_t>(g.size & 0xffff) << 16) | (g.position & 0xffff);
}
inline ServedGroup UnpackServedGroup(uint64_t bits) {
  ServedGroup g;
  g.first = static_cast<uint32_t>((bits >> 32) & 0xffff);
  g.size = static_cast<uint32_t>((bits >> 16) & 0xffff);
  g.position = static_cast<uint32_t>(bits & 0xffff);
  g.root = static_cast<uint32_t>((bits >> 48) & 0x7fff);
  g.gather = (bits >> 63) != 0;
  return g;
}
static_assert(kMaxRanks < ServedGroup::kNoRoot, "a served group's root holds 15 bits");
static_assert(kMaxRanks <= 0xffff, "a served group's fields hold 16 bits");

uint32_t HeaderChecksum(const WireHeader& h);
void SealHeader(WireHeader* h);

// What the receiver expects; fields are compared one by one so that a
// mismatch can be described precisely.
struct Expectation {
  MsgKind kind;
  uint64_t token;
  uint64_t key;
  Identity id;
  uint32_t src_rank;   // the sender the tag names
  uint32_t self_rank;  // the receiving rank (for messages)
  uint32_t stream;
  uint32_t part;
  uint32_t chunk;
  DType dtype;
  ReduceOp op;
  Codec codec = Codec::kNone;
  uint64_t payload_bytes;
  uint64_t total_elems;
};

enum class HeaderVerdict {
  kOk,
  kMalformed,  // too short, bad magic/version/checksum/enum values, reserved
               // bytes not zero: drop
  kStranger,   // wrong token, or sender/stream/part/chunk contradicting the
               // tag it was matched on: drop
  kCollision,  // a genuine peer's message of another reduction (identity)
               // whose tag bits collided with this receive's: fail the job
  kMismatch,   // a genuine peer reduced something different (key, shape,
               // dtype, op, codec) under the same identity: fail the job
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

// A data receive that the provider completed as truncated, and what it wrote
// of the message's header (a genuine peer's header if it checks out).
struct TruncatedReceive {
  const WireHeader* header = nullptr;
  uint64_t token = 0;          // this job's
  Identity id;                 // of the reduction the receive waits for
  uint64_t key = 0;            //   "
  std::string receive;         // "rank R's receive for <reduction>"
  int from_rank = 0;           // the sender the tag names
  size_t received_len = 0;     // bytes the provider delivered, header included
  size_t cut_off = 0;          // bytes it says it cut off
  std::string provider_error;  // its words
};

// What a truncated receive means, for the error that fails the job: a tag
// collision (the header names another reduction), a provider that lost bytes
// of the very message expected (same reduction, and the provider cut off
// nothing: no program is at fault), or processes that reduce different
// things.
std::string DescribeTruncation(const TruncatedReceive& t);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_WIRE_H_
