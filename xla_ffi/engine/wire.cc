#include "engine/wire.h"

#include <cstring>

namespace herring::engine {

uint32_t HeaderChecksum(const WireHeader& h) {
  // FNV-1a over every byte but the checksum field's: catches corruption and
  // truncated or foreign headers; authenticity comes from the job token.
  const auto* p = reinterpret_cast<const uint8_t*>(&h);
  uint32_t hash = 2166136261u;
  for (size_t i = 0; i < sizeof(WireHeader); ++i) {
    if (i >= offsetof(WireHeader, checksum) &&
        i < offsetof(WireHeader, checksum) + sizeof(h.checksum)) {
      continue;
    }
    hash ^= p[i];
    hash *= 16777619u;
  }
  return hash;
}

void SealHeader(WireHeader* h) { h->checksum = HeaderChecksum(*h); }

std::string DescribeIdentity(const Identity& id) {
  const std::string run =
      IsLaunchRun(id.run_id)
          ? "launch " + std::to_string(LaunchOf(id.run_id)) + " of instruction " +
                std::to_string(LaunchInstruction(id.run_id))
          : "run " + std::to_string(id.run_id);
  return run + ", slot " + std::to_string(id.slot) +
         ", instance " + std::to_string(id.instance) + ", occurrence " +
         std::to_string(id.occurrence) + ", buffer " + std::to_string(id.buffer);
}

namespace {
std::string Describe(DType dtype, uint64_t elems, ReduceOp op, uint64_t key) {
  return std::string(DTypeName(dtype)) + "[" + std::to_string(elems) + "] " +
         ReduceOpName(op) + " (key " + std::to_string(key) + ")";
}
}  // namespace

uint64_t IdentityTagBits(const Identity& id, uint32_t stream) {
  uint64_t h = Mix64(static_cast<uint64_t>(id.run_id) ^ 0x9e3779b97f4a7c15ull);
  h = Mix64(h ^ ((static_cast<uint64_t>(id.slot) << 32) | id.instance));
  h = Mix64(h ^ id.occurrence);
  h = Mix64(h ^ ((static_cast<uint64_t>(id.buffer) << 32) | stream));
  return h >> 34;  // the top 30 bits
}

bool CheckControlHeader(const WireHeader& h, size_t len, MsgKind kind, uint64_t token,
                        uint32_t sender, uint32_t ranks, std::string* why) {
  if (len < sizeof(WireHeader) || h.magic != kMagic || h.version != kWireVersion ||
      h.checksum != HeaderChecksum(h) || h.served != 0) {
    *why = "malformed control message";
    return false;
  }
  if (h.token != token) {
    *why = "control message with a wrong job token (a process of another job or an old run)";
    return false;
  }
  if (h.kind != static_cast<uint8_t>(kind) || h.src_rank != sender || sender >= ranks ||
      h.payload_bytes != len - sizeof(WireHeader)) {
    *why = "control message with wrong kind, sender or length";
    return false;
  }
  return true;
}

HeaderVerdict CheckHeader(const void* header, size_t len, const Expectation& want,
                          std::string* why) {
  if (len < sizeof(WireHeader)) {
    *why = "message of " + std::to_string(len) + " bytes is shorter than a header";
    return HeaderVerdict::kMalformed;
  }
  WireHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kMagic || h.version != kWireVersion) {
    *why = "bad magic or version";
    return HeaderVerdict::kMalformed;
  }
  if (h.checksum != HeaderChecksum(h)) {
    *why = "header checksum mismatch";
    return HeaderVerdict::kMalformed;
  }
  if (h.served != 0) {
    *why = "a served group in a message that is not kServed";
    return HeaderVerdict::kMalformed;
  }
  if (!IsValidDType(h.dtype) || !IsValidOp(h.op) || !IsValidCodec(h.codec) ||
      h.kind < static_cast<uint8_t>(MsgKind::kContribution) ||
      h.kind > static_cast<uint8_t>(MsgKind::kHostDone)) {
    *why = "invalid dtype, op, codec or kind";
    return HeaderVerdict::kMalformed;
  }
  if (h.payload_bytes != len - sizeof(WireHeader)) {
    *why = "header announces " + std::to_string(h.payload_bytes) + " payload bytes, " +
           std::to_string(len - sizeof(WireHeader)) + " arrived";
    return HeaderVerdict::kMalformed;
  }
  if (h.contributors == 0 || h.contributors > kMaxContributors) {
    // Every contribution and result sums at least one device; 0 would become
    // the divisor of a mean (inf/NaN, or SIGFPE for integers), and more than
    // kMaxContributors is no job's (a sum of such counts could wrap).
    *why = "header counts " + std::to_string(h.contributors) + " contributing devices";
    return HeaderVerdict::kMalformed;
  }
  if (h.token != want.token) {
    *why = "wrong job token (a process of another job or an old run)";
    return HeaderVerdict::kStranger;
  }
  // The part is not in the tag: it is compared after the identity, since a
  // reduction whose tag bits collide with this one's may number its parts
  // otherwise (a block's server parts, Job::WirePart), and must fail the job
  // as a collision rather than be dropped.
  if (h.kind != static_cast<uint8_t>(want.kind) || h.src_rank != want.src_rank ||
      h.stream != want.stream || h.chunk != want.chunk) {
    auto fields = [](uint32_t kind, uint32_t src, uint32_t stream, uint32_t part,
                     uint32_t chunk) {
      return "kind " + std::to_string(kind) + " from rank " + std::to_string(src) +
             ", stream " + std::to_string(stream) + ", part " + std::to_string(part) +
             ", chunk " + std::to_string(chunk);
    };
    *why = "header (" + fields(h.kind, h.src_rank, h.stream, h.part, h.chunk) +
           ") differs from the tag it was matched on (" +
           fields(static_cast<uint32_t>(want.kind), want.src_rank, want.stream, want.part,
                  want.chunk) +
           ")";
    return HeaderVerdict::kStranger;
  }
  const Identity theirs = HeaderIdentity(h);
  const std::string what_theirs =
      Describe(static_cast<DType>(h.dtype), h.total_elems, static_cast<ReduceOp>(h.op), h.key);
  const std::string what_mine = Describe(want.dtype, want.total_elems, want.op, want.key);
  if (theirs != want.id) {
    // Same token, sender, stream and chunk as the tag, other identity:
    // the tag bits of two reductions in flight at once collided. The message
    // belongs to another reduction that now never gets it: fail, never drop.
    *why = "tag collision: rank " + std::to_string(h.src_rank) + " sent " + what_theirs +
           " (" + DescribeIdentity(theirs) + "), which matched the receive of rank " +
           std::to_string(want.self_rank) + " for " + what_mine + " (" +
           DescribeIdentity(want.id) + "); two reductions in flight at once share their "
           "30-bit tag hash. Rerunning will most likely not collide again";
    return HeaderVerdict::kCollision;
  }
  if (h.part != want.part) {
    *why = "header names part " + std::to_string(h.part) + " where the receive it matched "
           "(from rank " + std::to_string(want.src_rank) + ", chunk " +
           std::to_string(want.chunk) + ") is for part " + std::to_string(want.part);
    return HeaderVerdict::kStranger;
  }
  if (h.codec != static_cast<uint8_t>(want.codec)) {
    *why = "rank " + std::to_string(h.src_rank) + " sends " + what_theirs + " with codec " +
           CodecName(static_cast<Codec>(h.codec)) + " where rank " +
           std::to_string(want.self_rank) + " reduces it with codec " +
           CodecName(want.codec) + " (" + DescribeIdentity(want.id) + "); every process "
           "must ask for the same compression in the same reduction";
    return HeaderVerdict::kMismatch;
  }
  if (h.key != want.key || h.dtype != static_cast<uint8_t>(want.dtype) ||
      h.op != static_cast<uint8_t>(want.op) || h.total_elems != want.total_elems ||
      h.payload_bytes != want.payload_bytes) {
    *why = "rank " + std::to_string(h.src_rank) + " reduces " + what_theirs + " where rank " +
           std::to_string(want.self_rank) + " reduces " + what_mine + " under the same "
           "identity (" + DescribeIdentity(want.id) + "); every process must run the same "
           "reductions (shapes, dtypes, ops) in the same executables";
    return HeaderVerdict::kMismatch;
  }
  return HeaderVerdict::kOk;
}

std::string DescribeTruncation(const TruncatedReceive& t) {
  const WireHeader& h = *t.header;
  const bool readable = h.magic == kMagic && h.version == kWireVersion &&
                        h.checksum == HeaderChecksum(h) && h.token == t.token &&
                        IsValidDType(h.dtype) && IsValidOp(h.op);
  const std::string from = "rank " + std::to_string(t.from_rank);
  if (!readable) {
    return "mismatched reductions: " + from + " sent a larger message than expected to " +
           t.receive + "; every process must run the same reductions (shapes, dtypes, ops) in "
           "the same executables [provider: " + t.provider_error + "]";
  }
  const std::string theirs =
      Describe(static_cast<DType>(h.dtype), h.total_elems, static_cast<ReduceOp>(h.op), h.key);
  const std::string message = "kind " + std::to_string(h.kind) + ", part " +
                              std::to_string(h.part) + ", chunk " + std::to_string(h.chunk) +
                              ", " + std::to_string(h.payload_bytes) + " payload bytes";
  const std::string detail = " [the message: " + message + "; provider: " + t.provider_error + "]";
  if (HeaderIdentity(h) != t.id) {
    return "tag collision: " + from + " sent " + theirs + " (" +
           DescribeIdentity(HeaderIdentity(h)) + "), a larger message that matched " +
           t.receive + "; two reductions in flight at once share their 30-bit tag hash. "
           "Rerunning will most likely not collide again" + detail;
  }
  const uint64_t sent = sizeof(WireHeader) + h.payload_bytes;
  if (h.key == t.key && t.cut_off == 0 && t.received_len < sent) {
    // The sender's header describes the message this receive was posted
    // for, yet fewer bytes arrived than it says it sent, and the provider
    // cut nothing off: it lost part of the message on the way.
    return "the provider lost data: " + from + "'s message for " + t.receive + " arrived "
           "incomplete (" + std::to_string(t.received_len) + " of the " + std::to_string(sent) +
           " bytes sent, and nothing reported cut off), so none of it can be used. Both "
           "processes run the same reduction; the provider is at fault, not the program "
           "(seen with udp;ofi_rxd when the network drops packets under load). Use a "
           "reliable provider: tcp;ofi_rxm, or efa on AWS" + detail;
  }
  return "mismatched reductions: " + from + " sent a larger message than expected for " +
         theirs + " to " + t.receive + "; every process must run the same reductions "
         "(shapes, dtypes, ops) in the same executables" + detail;
}

}  // namespace herring::engine
