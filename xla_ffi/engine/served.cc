// Server-only processes: the side of a process that trains nothing (rank >=
// CommConfig::workers), and the workers' choice of which calls use them.
// Such a process never knows what the workers reduce: its receives take a
// kServed message of any reduction from any worker; the headers say which
// chunk of which reduction each is, and which group of workers sends it
// (every worker on the flat path; in the host stage, the processes with one
// local index, one per host: WireHeader::served). Once every group member's
// message of a chunk is here it sums them in the group's order with the
// kernel the workers' own server shards use (so every element has the same
// bits whichever process summed it) and sends the sum back to every member
// as that part's kResult (a reduce-scatter's block: to its owner alone). An
// all-gather's block (ServedGroup::gather) comes from its owner alone, the
// others sending headers without data: once all are here the owner's message
// goes on, unchanged, to the others. With a wire codec the messages and the
// sum travel encoded (codec.h): decoded, summed in float32 and encoded again,
// as a worker's shard does.
// Runs on the transport's progress thread (OnServed) and the server threads
// (TakeServed: receives are re-posted there, never from the progress thread).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/codec.h"
#include "engine/communicator.h"
#include "engine/reduce_kernels.h"
#include "engine/served.h"

namespace herring::engine {

namespace {

// Receives kept posted per worker: the provider buffers what arrives beyond them.
constexpr size_t kServedRecvsPerWorker = 4;
constexpr size_t kServedRecvsMin = 16;
constexpr uint64_t kServedTag = uint64_t{3} << 62;
constexpr uint64_t kServedIgnore = ~kServedTag;

std::string Fields(const WireHeader& h) {
  return std::string(DTypeName(static_cast<DType>(h.dtype))) + "[" +
         std::to_string(h.total_elems) + "] " + ReduceOpName(static_cast<ReduceOp>(h.op)) +
         " (key " + std::to_string(h.key) + "; " + DescribeIdentity(HeaderIdentity(h)) +
         "), part " + std::to_string(h.part) + " chunk " + std::to_string(h.chunk) + " of " +
         std::to_string(h.payload_bytes) + " bytes";
}

}  // namespace

int Communicator::ServerCount() const {
  return config_.workers > 0 ? config_.size - config_.workers : 0;
}

bool Communicator::ServersServe(const std::vector<int>& group) const {
  // Only a call over every worker (ranks 0 .. workers - 1; the group is
  // sorted and unique): the servers' share of the job's traffic is planned
  // for the whole job, and a call of some workers runs beside the others'.
  return ServerCount() > 0 && config_.rank < config_.workers &&
         static_cast<int>(group.size()) == config_.workers;
}

bool Communicator::ServedJob(const ReduceRequest& r) const {
  // Judged by the bytes the buffer puts on the wire (encoded, with a codec):
  // what the servers save is wire time, what they cost is per message.
  const size_t wire_bytes = r.codec == Codec::kNone ? r.count * ElementSize(r.dtype)
                                                    : EncodedBytes(r.codec, r.count);
  // Every collective: a reduce-scatter's and an all-gather's blocks go
  // through them one at a time (ReduceFlat).
  return r.count > 0 && wire_bytes >= config_.server_min_bytes;
}

std::vector<bool> Communicator::ServedFlags(const std::vector<int>& group,
                                            const std::vector<ReduceRequest>& requests) const {
  std::vector<bool> flags(requests.size(), false);
  if (!ServersServe(group)) return flags;
  for (size_t k = 0; k < requests.size(); ++k) flags[k] = ServedJob(requests[k]);
  return flags;
}

void Communicator::ServerGone(int rank, const std::string& how) {
  if (leaving_ || rank < config_.workers || rank >= config_.size) return;
  declared_dead_.fetch_add(1);
  gone_[rank] = true;
  transport_->SetPeerUnreachable(rank);
  const std::string why =
      RankText(rank) + " is gone (" + how + "): the parts of every all-reduce that it sums "
      "will never come, so the job fails; rank " + std::to_string(config_.rank) +
      " saw its connection close";
  // Only this rank watches the servers: the other workers learn of it from
  // this rank's abort alone. So they are told, and have acknowledged it
  // (bounded), before this rank's own reductions fail: a program that ends
  // at once on that error (os._exit, or jax.distributed's coordinator going
  // with it) would otherwise take the reason along, and a worker waiting
  // for the gone server would hear nothing until its peer watch. On the
  // watch thread (servers.Rendezvous.watch), which may wait.
  FirstFailure(why);
  if (connected_) {
    abort_owed_ = true;
    AwaitOwnAbortTold(AbortToldWaitS());
  }
  FailAll(why, /*tell_peers=*/true);
}

std::string Communicator::RankText(int rank) const {
  return (ServerCount() > 0 && rank >= config_.workers ? "server rank " : "rank ") +
         std::to_string(rank);
}

void Communicator::ServedCounts(uint64_t* chunks, uint64_t* bytes) const {
  *chunks = served_ ? served_->chunks_summed.load() : 0;
  *bytes = served_ ? served_->bytes_summed.load() : 0;
}

Status Communicator::Serve() {
  if (ServerCount() <= 0 || config_.rank < config_.workers) {
    return Status::Error("rank " + std::to_string(config_.rank) +
                         " is a worker, not a server-only process (CommConfig::workers " +
                         std::to_string(config_.workers) + ")");
  }
  if (!connected_) return Status::Error("serve before connect");
  if (served_) return Status::Error("this process serves already");
  auto state = std::make_unique<ServedState>();
  // A chunk is at most HERRING_CHUNK_BYTES on the wire, but a codec's chunk
  // is at least one block (ChunkElems rounds up to it): with fp16 516 bytes.
  state->payload_bytes = std::max(config_.chunk_bytes, EncodedBytes(Codec::kFloat16, kCodecBlock));
  const size_t slots = std::max(kServedRecvsMin, kServedRecvsPerWorker * config_.workers);
  for (size_t i = 0; i < slots; ++i) {
    state->slots.emplace_back(&pool_, kServedPayloadAt + state->payload_bytes);
    if (!state->slots.back().ok()) return Status::Error("out of memory for served receives");
  }
  served_ = std::move(state);
  for (size_t i = 0; i < slots; ++i) PostServedRecv(i);
  for (;;) {
    const std::string broken = Broken();
    if (!broken.empty()) return Status::Error(broken);
    bool all_left = true;
    for (int w = 0; w < config_.workers && all_left; ++w) all_left = ledger_.Left(w);
    if (all_left) return Status::Ok();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Communicator::PostServedRecv(size_t slot) {
  char* base = served_->slots[slot].data();
  transport::IoVec iov[2] = {{base, sizeof(WireHeader)},
                             {base + kServedPayloadAt, served_->payload_bytes}};
  // Background: a server waits for work without being busy.
  Status s = transport_->Recv(
      kServedTag, kServedIgnore, iov, 2,
      [this, slot](const transport::Completion& c) { OnServed(slot, c); },
      /*background=*/true);
  if (!s.ok() && !ShuttingDown()) {
    FailAll("server rank " + std::to_string(config_.rank) + " cannot post a receive: " +
                s.message(),
            /*tell_peers=*/true);
  }
}

void Communicator::OnServed(size_t slot, const transport::Completion& c) {
  if (!c.ok && !c.truncated) return;  // cancelled: shutting down
  Enqueue([this, slot, c] { TakeServed(slot, c); });
}

std::string Communicator::CheckServed(const WireHeader& h,
                                      const transport::Completion& c) const {
  if (c.truncated) {
    return "a message longer than a chunk (" + std::to_string(served_->payload_bytes) +
           " bytes) arrived: the workers cut chunks larger than HERRING_CHUNK_BYTES says";
  }
  if (c.len < sizeof(WireHeader)) return "message shorter than a header";
  if (h.magic != kMagic || h.version != kWireVersion) return "bad magic or version";
  if (h.checksum != HeaderChecksum(h)) return "header checksum mismatch";
  if (h.token != config_.token) return "wrong job token (a process of another job or an old run)";
  if (h.kind != static_cast<uint8_t>(MsgKind::kServed) || !IsValidDType(h.dtype) ||
      !IsValidOp(h.op) || !IsValidCodec(h.codec)) {
    return "invalid kind, dtype, op or codec";
  }
  const Codec codec = static_cast<Codec>(h.codec);
  const ReduceOp op = static_cast<ReduceOp>(h.op);
  if (codec != Codec::kNone && (static_cast<DType>(h.dtype) != DType::kFloat32 ||
                                (op != ReduceOp::kSum && op != ReduceOp::kMean))) {
    return std::string("codec ") + CodecName(codec) + " on a " + ReduceOpName(op) + " of " +
           DTypeName(static_cast<DType>(h.dtype)) + " (codecs carry float32 sums and means)";
  }
  const ServedGroup g = UnpackServedGroup(h.served);
  // An all-gather's block comes from its owner: the others send its header.
  const bool carries = !g.gather || g.position == g.root;
  size_t elems = 0;
  if (h.payload_bytes != c.len - sizeof(WireHeader) || (!carries && h.payload_bytes != 0) ||
      (carries && (codec == Codec::kNone
                       ? h.payload_bytes % ElementSize(static_cast<DType>(h.dtype)) != 0
                       : !EncodedCount(codec, h.payload_bytes, &elems)))) {
    return "payload of " + std::to_string(c.len - sizeof(WireHeader)) +
           " bytes, the header says " + std::to_string(h.payload_bytes) + " (codec " +
           CodecName(codec) + ")";
  }
  if (h.contributors == 0 || h.contributors > kMaxContributors) {
    return "header counts " + std::to_string(h.contributors) + " contributing devices";
  }
  if (h.src_rank >= static_cast<uint32_t>(config_.workers) || h.src_rank != TagSender(c.tag) ||
      (c.source != transport::kSourceUnchecked && c.source != static_cast<int>(h.src_rank))) {
    return "sender " + std::to_string(h.src_rank) + " is no worker, or not where it came from";
  }
  // The group: of workers, the sender in it, and this server's part the one
  // after the group's own (ServedParts: n workers' parts, then the servers';
  // a block's: n + root k + this server's index, Job::WirePart).
  const uint32_t workers = static_cast<uint32_t>(config_.workers);
  const uint32_t server = static_cast<uint32_t>(config_.rank - config_.workers);
  const uint32_t part = g.size + (g.Rooted() ? g.root * ServerCount() : 0) + server;
  if (g.size < 2 || g.size > workers || g.position >= g.size || g.first >= workers ||
      (g.position == 0) != (h.src_rank == g.first) ||
      (g.Rooted() && g.root >= g.size) || (g.gather && !g.Rooted()) || h.part != part) {
    return "a served group that cannot be (first rank " + std::to_string(g.first) + ", " +
           std::to_string(g.size) + " processes, the sender at position " +
           std::to_string(g.position) + ", part " + std::to_string(h.part) +
           (g.Rooted() ? ", block of position " + std::to_string(g.root) : std::string()) +
           "): this server sums part n + " + std::to_string(server) +
           " of groups of n = 2.." + std::to_string(workers) + " workers (of a block r: n + r k + " +
           std::to_string(server) + ", k = " + std::to_string(ServerCount()) + ")";
  }
  return "";
}

void Communicator::TakeServed(size_t slot, const transport::Completion& c) {
  ServedState& st = *served_;
  PooledBuffer message;
  if (c.ok && c.len == sizeof(WireHeader)) {
    // A header without data (an all-gather's, from a worker that is not the
    // block's owner): kept alone, and the slot's buffer posted again.
    message = PooledBuffer(&pool_, kServedPayloadAt);
    if (message.ok()) std::memcpy(message.data(), st.slots[slot].data(), sizeof(WireHeader));
  } else {
    message = std::move(st.slots[slot]);
    st.slots[slot] = PooledBuffer(&pool_, kServedPayloadAt + st.payload_bytes);
  }
  if (!message.ok() || !st.slots[slot].ok()) {
    FailAll("server rank " + std::to_string(config_.rank) + " ran out of memory", true);
    return;
  }
  if (!ShuttingDown()) PostServedRecv(slot);
  WireHeader h;
  std::memcpy(&h, message.data(), sizeof(h));
  const std::string why = CheckServed(h, c);
  if (!why.empty()) {
    CountDropped("server rank " + std::to_string(config_.rank) + ": " + why);
    return;
  }
  const int from = static_cast<int>(h.src_rank);
  Heard(h.src_rank);
  TookFrom(from);
  const ServedGroup group = UnpackServedGroup(h.served);
  const int members = static_cast<int>(group.size);
  ServedChunk chunk;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    ServedChunk& entry = st.chunks[KeyOf(h)];
    if (entry.from.empty()) {
      entry.first = h;
      entry.from.resize(members);
      entry.ranks.assign(members, -1);
    }
    const WireHeader& f = entry.first;
    std::string mismatch;
    const ServedGroup fg = UnpackServedGroup(f.served);
    if (f.key != h.key || f.dtype != h.dtype || f.op != h.op || f.codec != h.codec ||
        f.total_elems != h.total_elems ||
        (!group.gather && f.payload_bytes != h.payload_bytes) || fg.size != group.size ||
        fg.root != group.root || fg.gather != group.gather) {
      mismatch = "mismatched reductions at server rank " + std::to_string(config_.rank) +
                 ": rank " + std::to_string(f.src_rank) + " sent " + Fields(f) + " in a group of " +
                 std::to_string(fg.size) + ", rank " +
                 std::to_string(h.src_rank) + " " + Fields(h) + " in a group of " +
                 std::to_string(group.size);
    } else if (entry.from[group.position].ok()) {
      mismatch = "server rank " + std::to_string(config_.rank) + " got " + Fields(h) +
                 " twice from position " + std::to_string(group.position) + " of the group " +
                 "of rank " + std::to_string(group.first) + " (ranks " +
                 std::to_string(entry.ranks[group.position]) + " and " + std::to_string(from) +
                 ")";
    }
    if (!mismatch.empty()) {
      st.chunks.erase(KeyOf(h));
      FailAll(mismatch, /*tell_peers=*/true);
      return;
    }
    entry.from[group.position] = std::move(message);
    entry.ranks[group.position] = from;
    if (++entry.arrived < members) return;
    chunk = std::move(entry);
    st.chunks.erase(KeyOf(h));
  }

  if (group.gather) {
    PassOnGathered(std::move(chunk), group);
    return;
  }
  // Every member's contribution is here: the sum in the group's order.
  const WireHeader& f = chunk.first;
  const DType dtype = static_cast<DType>(f.dtype);
  const ReduceOp op = static_cast<ReduceOp>(f.op);
  const Codec codec = static_cast<Codec>(f.codec);
  size_t count = f.payload_bytes / ElementSize(dtype);
  if (codec != Codec::kNone) EncodedCount(codec, f.payload_bytes, &count);  // CheckServed held
  std::vector<const void*> srcs(members);
  uint64_t contributors = 0;
  for (int w = 0; w < members; ++w) {
    srcs[w] = chunk.from[w].data() + kServedPayloadAt;
    WireHeader hw;
    std::memcpy(&hw, chunk.from[w].data(), sizeof(hw));
    if (!AddContributors(&contributors, hw.contributors)) {
      FailAll("server rank " + std::to_string(config_.rank) + ": the contributions to " +
                  Fields(f) + " count more than " + std::to_string(kMaxContributors) +
                  " devices together; a worker's headers are wrong",
              true);
      return;
    }
  }
  auto result = std::make_shared<ServedResult>();
  result->data = PooledBuffer(&pool_, std::max<size_t>(1, f.payload_bytes));
  if (!result->data.ok()) {
    FailAll("server rank " + std::to_string(config_.rank) + " ran out of memory", true);
    return;
  }
  const double divisor = op == ReduceOp::kMean ? static_cast<double>(contributors) : 1.0;
  if (codec == Codec::kNone) {
    ReduceOpInto(op, dtype, result->data.data(), nullptr, srcs.data(), members, count, divisor);
  } else {
    // As a worker's shard sums an encoded part (Communicator::ReduceChunk):
    // every contribution decoded, summed in float32 in the group's order,
    // and the sum encoded for the way back; each worker decodes that, as it
    // decodes a worker shard's result, so every rank holds the same bits.
    // The shard also keeps the decoded sum; a server keeps nothing.
    PooledBuffer sum(&pool_, std::max<size_t>(1, count * sizeof(float)));
    if (!sum.ok()) {
      FailAll("server rank " + std::to_string(config_.rank) + " ran out of memory", true);
      return;
    }
    float* acc = reinterpret_cast<float*>(sum.data());
    SumForTheWayBack(codec, srcs.data(), members, count, static_cast<float>(divisor), acc,
                     result->data.data());
  }
  chunk.from.clear();  // the contributions' buffers go back to the pool
  result->header = f;
  result->header.contributors = static_cast<uint32_t>(contributors);
  // A reduce-scatter's block goes back to its owner alone.
  SendServedResult(std::move(result), chunk.ranks, group.Rooted() ? group.root : -1, -1);
}

// An all-gather's block (ServedGroup::gather): the owner's message, once
// every member's header is here, goes on unchanged (encoded, with a codec,
// as the owner keeps it decoded) to every member but the owner.
void Communicator::PassOnGathered(ServedChunk chunk, const ServedGroup& group) {
  auto result = std::make_shared<ServedResult>();
  std::memcpy(&result->header, chunk.from[group.root].data(), sizeof(WireHeader));
  result->data = std::move(chunk.from[group.root]);
  result->offset = kServedPayloadAt;
  chunk.from.clear();
  SendServedResult(std::move(result), chunk.ranks, -1, static_cast<int>(group.root));
}

// Sends a served chunk's result (its header still the kServed one it came
// with) to the members at `ranks` (by position): only to position `only`
// where it is >= 0, else to all but position `skip` (-1: none).
void Communicator::SendServedResult(std::shared_ptr<ServedResult> result,
                                    const std::vector<int>& ranks, int only, int skip) {
  ServedState& st = *served_;
  const WireHeader f = result->header;
  result->header.kind = static_cast<uint8_t>(MsgKind::kResult);
  result->header.src_rank = static_cast<uint32_t>(config_.rank);
  result->header.served = 0;
  SealHeader(&result->header);
  const uint32_t rank = static_cast<uint32_t>(config_.rank);
  const ServedGroup group = UnpackServedGroup(f.served);
  const uint64_t tag =
      MakeTag(MsgKind::kResult, rank, f.stream,
              BlockTagBits(IdentityTagBits(HeaderIdentity(f), f.stream),
                           group.Rooted() ? static_cast<int>(group.root) : -1),
              f.chunk);
  st.chunks_summed.fetch_add(1);
  st.bytes_summed.fetch_add(f.payload_bytes);
  const int members = static_cast<int>(ranks.size());
  // Starting at a different member for each part, as the workers' shards do.
  for (int step = 0; step < members; ++step) {
    const int position = static_cast<int>((f.part + step) % members);
    if ((only >= 0 && position != only) || position == skip) continue;
    const int to = ranks[position];
    transport::IoVec iov[2] = {{&result->header, sizeof(WireHeader)},
                               {result->data.data() + result->offset, f.payload_bytes}};
    Status s = transport_->Send(to, tag, iov, f.payload_bytes > 0 ? 2 : 1,
                                [this, result, to](const transport::Completion& done) {
                                  // A worker that is gone fails (or has failed) on its own
                                  // side, and its peers with it.
                                  if (!done.ok) served_->failed_sends.fetch_add(1);
                                });
    if (!s.ok()) {
      st.failed_sends.fetch_add(1);
      continue;
    }
    ledger_.Sent(to);
  }
}

}  // namespace herring::engine
