#include "engine/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <set>

#include "engine/reduce_kernels.h"
#include "engine/wire.h"

namespace herring::engine {

// See Communicator::PruneOccurrences.
constexpr double kOccurrenceIdleFactor = 8.0;

// Everything one AllReduce call waits for. `remaining` counts the work that
// must finish for success; `inflight` counts posted transport operations and
// queued server tasks, which reference the batch and must drain before it
// may be freed.
struct Batch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
  size_t inflight = 0;
  bool failed = false;
  std::string error;
  uint32_t stream = 0;
  std::vector<int> group;
  int64_t started_ns = 0;
  std::vector<std::unique_ptr<Job>> jobs;
  // Every job's per-peer counters exist (StartJob ran for all): from then on
  // other threads may read them.
  std::atomic<bool> started{false};

  void AddInflight(size_t k) {
    std::lock_guard<std::mutex> lock(mu);
    inflight += k;
  }
  // `work` units of `remaining` and `ops` of `inflight` are done.
  void Complete(size_t work, size_t ops) {
    std::lock_guard<std::mutex> lock(mu);
    remaining -= work;
    inflight -= ops;
    if (remaining == 0 || inflight == 0) cv.notify_all();
  }
  bool Failed() {
    std::lock_guard<std::mutex> lock(mu);
    return failed;
  }
};

// One buffer's reduction within a batch: its geometry and per-message state.
struct Job {
  Batch* batch = nullptr;
  ReduceRequest req;
  Identity id;              // the request's, with its occurrence
  uint64_t tag_bits = 0;    // IdentityTagBits(id, stream)
  int n = 0;   // processes in the group
  int me = 0;  // this process's index in the group (= the part it serves)
  size_t elem = 0;
  size_t part_elems = 0;
  size_t chunk_elems = 0;
  size_t max_chunks = 0;

  std::vector<WireHeader> send_hdrs;     // [part][chunk] contributions sent
  std::vector<WireHeader> result_hdrs;   // [part][chunk] results received
  std::vector<WireHeader> contrib_hdrs;  // [peer][chunk] contributions received
  std::vector<WireHeader> out_hdrs;      // [chunk] results this server sends
  std::vector<PooledBuffer> staging;     // [peer] contributions to this part
  // [peer] devices in each contribution: written by the progress thread at
  // every chunk's arrival while a server thread may read it for another chunk.
  std::unique_ptr<std::atomic<uint32_t>[]> contributors;
  std::unique_ptr<std::atomic<int>[]> arrivals;       // [chunk] of this part
  std::unique_ptr<std::atomic<int>[]> contribs_from;  // [peer] chunks received
  std::unique_ptr<std::atomic<int>[]> results_from;   // [part] chunks received

  size_t PartBegin(int i) const { return std::min(req.count, i * part_elems); }
  size_t PartLen(int i) const {
    return std::min(req.count, (i + 1) * part_elems) - PartBegin(i);
  }
  size_t Chunks(int i) const { return (PartLen(i) + chunk_elems - 1) / chunk_elems; }
  size_t ChunkBegin(int i, size_t c) const { return PartBegin(i) + c * chunk_elems; }
  size_t ChunkLen(int i, size_t c) const {
    return std::min(chunk_elems, PartLen(i) - c * chunk_elems);
  }
  char* OutAt(size_t elem_index) const {
    return static_cast<char*>(req.out) + elem_index * elem;
  }
  const char* InAt(size_t elem_index) const {
    return static_cast<const char*>(req.in) + elem_index * elem;
  }
  std::string Describe() const {
    return std::string(DTypeName(req.dtype)) + "[" + std::to_string(req.count) + "] " +
           ReduceOpName(req.op) + " (key " + std::to_string(req.key) + "; " +
           DescribeIdentity(id) + ")";
  }
};

namespace {

WireHeader MakeHeader(const Job& job, MsgKind kind, uint64_t token, uint32_t src, int part,
                      size_t chunk, size_t payload_bytes, uint32_t contributors) {
  WireHeader h{};
  h.magic = kMagic;
  h.version = kWireVersion;
  h.kind = static_cast<uint8_t>(kind);
  h.dtype = static_cast<uint8_t>(job.req.dtype);
  h.token = token;
  h.key = job.req.key;
  SetHeaderIdentity(&h, job.id);
  h.src_rank = src;
  h.stream = job.batch->stream;
  h.part = static_cast<uint32_t>(part);
  h.chunk = static_cast<uint32_t>(chunk);
  h.payload_bytes = payload_bytes;
  h.total_elems = job.req.count;
  h.op = static_cast<uint8_t>(job.req.op);
  h.contributors = contributors;
  SealHeader(&h);
  return h;
}

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string RankList(const std::set<int>& ranks) {
  std::string s;
  for (int r : ranks) s += (s.empty() ? "" : ", ") + std::to_string(r);
  return "[" + s + "]";
}

}  // namespace

std::unique_ptr<Communicator> Communicator::Create(const CommConfig& config, Status* status) {
  if (config.size < 1 || config.size > kMaxRanks || config.rank < 0 ||
      config.rank >= config.size) {
    *status = Status::Error("invalid rank " + std::to_string(config.rank) + " of " +
                            std::to_string(config.size) + " (at most " +
                            std::to_string(kMaxRanks) + " processes)");
    return nullptr;
  }
  std::unique_ptr<Communicator> comm(new Communicator(config));
  transport::TransportOptions options = config.transport;
  options.post_timeout_s = config.timeout_s;
  // Every data message is one chunk and its header: all of them eager.
  options.eager_bytes = config.chunk_bytes + sizeof(WireHeader);
  comm->transport_ = transport::CreateFabricTransport(options, status);
  if (!status->ok()) return nullptr;
  size_t max_payload = comm->transport_->MaxMessageBytes() - sizeof(WireHeader);
  comm->config_.chunk_bytes = std::max<size_t>(64, std::min(config.chunk_bytes, max_payload));
  for (int i = 0; i < std::max(1, config.server_threads); ++i) {
    comm->servers_.emplace_back([c = comm.get()] { c->ServerLoop(); });
  }
  return comm;
}

Communicator::Communicator(const CommConfig& config) : config_(config) {}

Communicator::~Communicator() {
  {
    std::lock_guard<std::mutex> lock(heartbeat_mu_);
    heartbeat_stop_ = true;
  }
  heartbeat_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (auto& t : servers_) t.join();
  transport_.reset();
}

Status Communicator::Connect(const std::vector<std::vector<uint8_t>>& addrs) {
  if (static_cast<int>(addrs.size()) != config_.size) {
    return Status::Error("expected " + std::to_string(config_.size) + " addresses, got " +
                         std::to_string(addrs.size()));
  }
  Status s = transport_->SetPeers(addrs);
  if (!s.ok()) return s;
  control_.resize(kControlRecvs);
  for (size_t i = 0; i < kControlRecvs; ++i) PostControlRecv(i);
  const int64_t now = NowNs();
  last_heard_.reset(new std::atomic<int64_t>[config_.size]);
  heartbeat_busy_.reset(new std::atomic<bool>[config_.size]);
  for (int r = 0; r < config_.size; ++r) {
    last_heard_[r] = now;
    heartbeat_busy_[r] = false;
  }
  connected_ = true;
  peer_wait_.resize(config_.size);
  if (config_.heartbeat_s < 0) {
    // Automatic: on, except over shm. With libfabric 1.17's shm provider a
    // heartbeat stream between large transfers lost a data message in about
    // one of 15 runs of 60 reductions (4 processes, heartbeats at 20 Hz; none
    // in 15 runs without heartbeats, none over tcp;ofi_rxm in 10 with them).
    // shm peers share one host, where the launcher sees a dead process.
    config_.heartbeat_s = transport_->Describe().rfind("shm", 0) == 0 ? 0.0 : 1.0;
  }
  if (config_.heartbeat_s > 0 && config_.size > 1) {
    heartbeat_out_.resize(config_.size);
    heartbeat_in_.resize(config_.size);
    for (int r = 0; r < config_.size; ++r) {
      if (r != config_.rank) PostHeartbeatRecv(r);
    }
    heartbeat_ = std::thread([this] { HeartbeatLoop(); });
  }
  return s;
}

void Communicator::Heard(uint32_t rank) {
  if (last_heard_ && rank < static_cast<uint32_t>(config_.size)) last_heard_[rank] = NowNs();
}

// One receive per sender, posted again after each heartbeat. Not one
// wildcard receive for all: with libfabric 1.17's shm provider, receives with
// ignore bits that are re-posted often made data messages match receives
// posted for another sender (seen as dropped chunks and hung reductions).
void Communicator::PostHeartbeatRecv(size_t slot) {
  transport::IoVec iov[1] = {{&heartbeat_in_[slot], sizeof(WireHeader)}};
  Status s = transport_->Recv(
      MakeHeartbeatTag(static_cast<uint32_t>(slot)), 0, iov, 1,
      [this, slot](const transport::Completion& c) { OnHeartbeat(slot, c); },
      /*background=*/true);
  if (!s.ok()) {
    std::fprintf(stderr, "herring_jax rank %d: cannot post a heartbeat receive: %s\n",
                 config_.rank, s.message().c_str());
  }
}

void Communicator::OnHeartbeat(size_t slot, const transport::Completion& c) {
  if (!c.ok) {
    // A heartbeat larger than a header is malformed; anything else is a
    // cancellation (shutdown or failure), after which nothing is re-posted.
    if (!c.truncated) return;
    CountDropped("oversized heartbeat");
  } else {
    const uint32_t sender = TagSender(c.tag);
    std::string why;
    const WireHeader& h = heartbeat_in_[slot];
    if (CheckControlHeader(h, c.len, MsgKind::kHeartbeat, config_.token, sender,
                           static_cast<uint32_t>(config_.size), &why)) {
      heartbeats_.fetch_add(1);
      Heard(sender);
      // A heartbeat also says what its sender waits for (contributors = 1):
      // dtype, count, op, key, identity and seconds (chunk).
      PeerWait wait;
      if (h.contributors == 1 && IsValidDType(h.dtype) && IsValidOp(h.op)) {
        wait.what = std::string(DTypeName(static_cast<DType>(h.dtype))) + "[" +
                    std::to_string(h.total_elems) + "] " +
                    ReduceOpName(static_cast<ReduceOp>(h.op)) + " (key " +
                    std::to_string(h.key) + "; " + DescribeIdentity(HeaderIdentity(h)) + ")";
        wait.seconds = h.chunk;
      }
      std::lock_guard<std::mutex> lock(peer_wait_mu_);
      peer_wait_[sender] = std::move(wait);
    } else {
      CountDropped(why);
    }
  }
  // Never post from the progress thread (see DropAndRepost).
  Enqueue([this, slot] { PostHeartbeatRecv(slot); });
}

void Communicator::HeartbeatLoop() {
  const auto interval = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(config_.heartbeat_s));
  std::unique_lock<std::mutex> lock(heartbeat_mu_);
  while (!heartbeat_cv_.wait_for(lock, interval, [this] { return heartbeat_stop_; })) {
    lock.unlock();
    SendHeartbeats();
    WatchPeers();
    lock.lock();
  }
}

std::string Communicator::OldestWait(WireHeader* h) {
  std::lock_guard<std::mutex> lock(active_mu_);
  const Batch* oldest = nullptr;
  for (const Batch* batch : active_) {
    if (oldest == nullptr || batch->started_ns < oldest->started_ns) oldest = batch;
  }
  if (oldest == nullptr) return "";
  const Job& job = *oldest->jobs.front();
  const double seconds = (NowNs() - oldest->started_ns) * 1e-9;
  if (h != nullptr) {
    h->contributors = 1;
    h->dtype = static_cast<uint8_t>(job.req.dtype);
    h->op = static_cast<uint8_t>(job.req.op);
    h->total_elems = job.req.count;
    h->key = job.req.key;
    SetHeaderIdentity(h, job.id);
    h->chunk = static_cast<uint32_t>(std::min(seconds, 4e9));
  }
  return job.Describe() + " for " + std::to_string(static_cast<int64_t>(seconds)) + " s";
}

std::string Communicator::PeerReport(const std::set<int>& ranks) const {
  if (!last_heard_ || config_.heartbeat_s <= 0) return "";
  const int64_t now = NowNs();
  std::string report;
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  for (int rank : ranks) {
    const double silent = (now - last_heard_[rank].load()) * 1e-9;
    std::string line = "rank " + std::to_string(rank);
    if (silent > 3 * config_.heartbeat_s + 1) {
      line += " has sent nothing for " + std::to_string(static_cast<int64_t>(silent)) + " s";
    } else if (peer_wait_[rank].what.empty()) {
      line += " is alive and waits in no reduction";
    } else {
      line += " is alive and has waited " +
              std::to_string(static_cast<int64_t>(peer_wait_[rank].seconds)) + " s in " +
              peer_wait_[rank].what;
    }
    report += (report.empty() ? "" : "; ") + line;
  }
  return report;
}

void Communicator::SendHeartbeats() {
  WireHeader base{};
  base.magic = kMagic;
  base.version = kWireVersion;
  base.kind = static_cast<uint8_t>(MsgKind::kHeartbeat);
  base.dtype = static_cast<uint8_t>(DType::kFloat32);
  base.token = config_.token;
  base.src_rank = static_cast<uint32_t>(config_.rank);
  base.stream = kControlStream;
  OldestWait(&base);
  SealHeader(&base);
  const int64_t now = NowNs();
  const double limit = std::min(config_.peer_timeout_s, config_.timeout_s);
  for (int peer = 0; peer < config_.size; ++peer) {
    // A peer silent past the limit is presumed dead: a post to it can stall
    // in the provider's connection attempts and delay the heartbeats to the
    // live ones.
    if (peer == config_.rank || (now - last_heard_[peer].load()) * 1e-9 > limit) continue;
    if (heartbeat_busy_[peer].exchange(true)) continue;
    // Only now, with no heartbeat to `peer` in flight, may its buffer change.
    heartbeat_out_[peer] = base;
    transport::IoVec iov[1] = {{&heartbeat_out_[peer], sizeof(WireHeader)}};
    // TrySend: a peer whose queue is full (dead, or busy with data that
    // proves it alive anyway) must not hold up the heartbeats to the others.
    Status s = transport_->TrySend(
        peer, MakeHeartbeatTag(static_cast<uint32_t>(config_.rank)), iov, 1,
        [this, peer](const transport::Completion&) { heartbeat_busy_[peer] = false; });
    if (!s.ok()) heartbeat_busy_[peer] = false;
  }
}

void Communicator::WatchPeers() {
  const double limit = std::min(config_.peer_timeout_s, config_.timeout_s);
  const int64_t now = NowNs();
  auto silent_s = [&](int rank) { return (now - last_heard_[rank].load()) * 1e-9; };
  std::lock_guard<std::mutex> lock(active_mu_);
  for (Batch* batch : active_) {
    if (batch->Failed()) continue;
    // Blame a rank this batch still lacks data from first. Any other silent
    // rank only holds it up through sends that cannot complete; and a live
    // rank's heartbeats can be late while its heartbeat thread waits on a
    // dead one's connection, so naming it first would name the wrong rank.
    int dead = -1;
    for (int rank : MissingRanks(*batch)) {
      if (rank != config_.rank && silent_s(rank) > limit) {
        dead = rank;
        break;
      }
    }
    for (size_t i = 0; dead < 0 && i < batch->group.size(); ++i) {
      const int rank = batch->group[i];
      if (rank != config_.rank && silent_s(rank) > limit) dead = rank;
    }
    if (dead < 0) continue;
    declared_dead_.fetch_add(1);
    const Job& job = *batch->jobs.front();
    char silent[32];
    std::snprintf(silent, sizeof(silent), "%.1f", silent_s(dead));
    Fail(batch, "rank " + std::to_string(dead) + " has sent nothing (no data, no " +
                    "heartbeat) for " + silent + " s while rank " +
                    std::to_string(config_.rank) + " waits for it in " + job.Describe() +
                    (batch->jobs.size() > 1
                         ? " and " + std::to_string(batch->jobs.size() - 1) + " more"
                         : std::string()) +
                    ": it died, hung or its host is unreachable. HERRING_PEER_TIMEOUT_S "
                    "(at most HERRING_TIMEOUT_S) sets the limit.");
    // After the batch has its reason: sends to the dead rank that wait for
    // queue room give up now (Fail has also told every waiting post to).
    transport_->SetPeerUnreachable(dead);
  }
}

void Communicator::PostControlRecv(size_t slot) {
  ControlBuffer& b = control_[slot];
  transport::IoVec iov[2] = {{&b.header, sizeof(b.header)}, {b.text, sizeof(b.text)}};
  // Any sender: the sender bits of the tag are ignored.
  Status s = transport_->Recv(
      MakeControlTag(0), kSenderBits, iov, 2,
      [this, slot](const transport::Completion& c) { OnControl(slot, c); },
      /*background=*/true);
  if (!s.ok()) {
    std::fprintf(stderr, "herring_jax rank %d: cannot post a control receive: %s\n",
                 config_.rank, s.message().c_str());
  }
}

void Communicator::OnControl(size_t slot, const transport::Completion& c) {
  if (!c.ok) return;  // cancelled at shutdown or after a failure
  const ControlBuffer& b = control_[slot];
  const uint32_t sender = TagSender(c.tag);
  std::string why;
  if (!CheckControlHeader(b.header, c.len, MsgKind::kAbort, config_.token, sender,
                          static_cast<uint32_t>(config_.size), &why)) {
    CountDropped(why);
    Enqueue([this, slot] { PostControlRecv(slot); });
    return;
  }
  Heard(sender);
  const std::string reason(b.text, c.len - sizeof(WireHeader));
  const std::string mine = OldestWait();
  const std::string message = "rank " + std::to_string(sender) + " failed: " + reason +
                              (mine.empty() ? std::string()
                                            : " [rank " + std::to_string(config_.rank) +
                                                  " was waiting in " + mine + "]");
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.empty()) broken_ = message;
  }
  std::lock_guard<std::mutex> lock(active_mu_);
  for (Batch* batch : active_) Fail(batch, message, /*tell_peers=*/false);
}

void Communicator::CountDropped(const std::string& why) {
  if (dropped_.fetch_add(1) < 10) {
    std::fprintf(stderr, "herring_jax rank %d: dropped a message: %s\n", config_.rank,
                 why.c_str());
  }
}

void Communicator::DropAndRepost(Batch* batch, const std::string& why,
                                 std::function<void()> repost) {
  CountDropped(why);
  // The completed receive leaves flight; the queued re-post enters it until
  // it has posted the new receive (from a server thread: never post from the
  // progress thread, which must not wait on the transport's queues).
  batch->AddInflight(1);
  batch->Complete(0, 1);
  Enqueue([batch, repost = std::move(repost)] {
    repost();
    batch->Complete(0, 1);
  });
}

void Communicator::BroadcastAbort(const std::string& why) {
  std::call_once(abort_once_, [&] {
    const size_t len = std::min(why.size(), kAbortTextBytes);
    std::memcpy(abort_out_.text, why.data(), len);
    WireHeader& h = abort_out_.header;
    h = WireHeader{};
    h.magic = kMagic;
    h.version = kWireVersion;
    h.kind = static_cast<uint8_t>(MsgKind::kAbort);
    h.dtype = static_cast<uint8_t>(DType::kFloat32);
    h.token = config_.token;
    h.src_rank = static_cast<uint32_t>(config_.rank);
    h.stream = kControlStream;
    h.payload_bytes = len;
    SealHeader(&h);
    for (int peer = 0; peer < config_.size; ++peer) {
      if (peer == config_.rank) continue;
      transport::IoVec iov[2] = {{&abort_out_.header, sizeof(WireHeader)},
                                 {abort_out_.text, len}};
      // Best effort: a dead peer never completes this, and nothing waits on it.
      transport_->Send(peer, MakeControlTag(config_.rank), iov, len > 0 ? 2 : 1,
                       [](const transport::Completion&) {});
    }
  });
}

std::string Communicator::Describe() const {
  char heartbeat[48] = "no heartbeats";
  if (connected_ && config_.heartbeat_s > 0) {
    std::snprintf(heartbeat, sizeof(heartbeat), "heartbeats every %g s", config_.heartbeat_s);
  }
  return "rank " + std::to_string(config_.rank) + " of " + std::to_string(config_.size) +
         " over " + transport_->Describe() + ", " + heartbeat;
}

CommStats Communicator::Stats() const {
  CommStats stats{reductions_.load(), bytes_reduced_.load(), dropped_.load(),
                  heartbeats_.load(), declared_dead_.load()};
  std::lock_guard<std::mutex> lock(occurrences_mu_);
  stats.occurrence_entries = occurrences_.size();
  return stats;
}

// Why forgetting is safe. An entry matters only for a later reduction of the
// same (run, stream, group, slot, instance): the next iteration of a loop in
// the same execution. Every reduction finishes or fails within timeout_s, so an
// entry idle for kOccurrenceIdleFactor x timeout_s belongs to an execution that
// has ended, or that computed that long between two iterations of one loop
// without reducing there. Only the latter is affected: its next occurrence
// counts from 0 again on the processes that pruned. The processes start and
// finish each reduction together (within the skew of one message), so they all
// prune it, or (the gap within one prune interval of the limit) some do: then
// the occurrence differs, which the tag and header carry, and the job fails
// with both identities named at the timeout. Never a wrong sum.
void Communicator::PruneOccurrences(int64_t now_ns) {
  const double limit_s = kOccurrenceIdleFactor * config_.timeout_s;
  const int64_t limit_ns = static_cast<int64_t>(limit_s * 1e9);
  if (now_ns - last_prune_ns_ < limit_ns / 8) return;
  last_prune_ns_ = now_ns;
  occurrences_.Prune(now_ns - limit_ns);
}

void Communicator::Enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(queue_mu_);
    queue_.push_back(std::move(task));
  }
  queue_cv_.notify_one();
}

void Communicator::ServerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(queue_mu_);
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

void Communicator::Fail(Batch* batch, const std::string& why, bool tell_peers) {
  {
    std::lock_guard<std::mutex> lock(batch->mu);
    if (!batch->failed) {
      batch->failed = true;
      batch->error = why;
    }
  }
  batch->cv.notify_all();
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (broken_.empty()) broken_ = why;
  }
  // The communicator is unusable from here on: a post waiting for room in a
  // queue (e.g. to a dead rank that this batch's failure did not name) must
  // give up now, or the caller's thread stays in StartJob until the timeout.
  transport_->StopWaiting();
  // Sent from a server thread: Fail also runs on the progress thread, which
  // must never wait on the transport's queues itself.
  if (tell_peers && connected_) Enqueue([this, why] { BroadcastAbort(why); });
}

Status Communicator::AllReduce(uint32_t stream, const std::vector<int>& group,
                               std::vector<ReduceRequest>& requests) {
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) {
      return Status::Error("communicator unusable after an earlier failure: " + broken_);
    }
  }
  if (!connected_) return Status::Error("communicator is not connected; call initialize()");
  auto self = std::find(group.begin(), group.end(), config_.rank);
  if (group.empty() || !std::is_sorted(group.begin(), group.end()) || self == group.end() ||
      group.front() < 0 || group.back() >= config_.size ||
      std::adjacent_find(group.begin(), group.end()) != group.end()) {
    return Status::Error("invalid process group for rank " + std::to_string(config_.rank));
  }
  for (const ReduceRequest& r : requests) {
    if (ElementSize(r.dtype) == 0) return Status::Error("unsupported dtype");
    bytes_reduced_ += r.count * ElementSize(r.dtype);
  }
  reductions_ += requests.size();

  const int n = static_cast<int>(group.size());
  // Only groups that reach the wire need a stream id that fits in the tag; a
  // group of this process alone (any number of them) never does.
  if (n > 1 && stream >= kControlStream) return Status::Error("stream id out of range");
  if (n == 1) {
    for (ReduceRequest& r : requests) {
      const void* src = r.in;
      double divisor = r.op == ReduceOp::kMean ? r.contributors : 1.0;
      ReduceInto(r.dtype, r.out, &src, 1, r.count, divisor);
    }
    return Status::Ok();
  }

  auto batch = std::make_unique<Batch>();
  batch->stream = stream;
  batch->group = group;
  batch->started_ns = NowNs();
  {
    std::lock_guard<std::mutex> lock(occurrences_mu_);
    const int64_t now = NowNs();
    PruneOccurrences(now);
    const uint32_t group_id =
        group_ids_.emplace(group, static_cast<uint32_t>(group_ids_.size())).first->second;
    // One occurrence per call: the buffers of one (run, slot, instance) share
    // it (they come one after another in `requests`).
    OccurrenceKey last;
    uint64_t occurrence = 0;
    for (size_t k = 0; k < requests.size(); ++k) {
      const ReduceRequest& r = requests[k];
      const OccurrenceKey key{r.run_id, stream, group_id, r.slot, r.instance};
      if (k == 0 || !(key == last)) occurrence = occurrences_.Take(key, now);
      last = key;
      auto job = std::make_unique<Job>();
      job->batch = batch.get();
      job->req = r;
      job->id = Identity{r.run_id, r.slot, r.instance, occurrence, r.buffer};
      job->tag_bits = IdentityTagBits(job->id, stream);
      batch->jobs.push_back(std::move(job));
    }
  }
  if (batch->jobs.empty()) return Status::Ok();
  // Active (visible to aborts and the peer watch) once `jobs` is complete:
  // from here on only the jobs' own atomics change under other threads.
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    active_.insert(batch.get());
  }
  struct Deactivate {
    Communicator* comm;
    Batch* batch;
    ~Deactivate() {
      std::lock_guard<std::mutex> lock(comm->active_mu_);
      comm->active_.erase(batch);
    }
  } deactivate{this, batch.get()};
  // Geometry first, so that `remaining` is complete before anything is posted.
  for (auto& job : batch->jobs) {
    Job& j = *job;
    j.n = n;
    j.me = static_cast<int>(self - group.begin());
    j.elem = ElementSize(j.req.dtype);
    const size_t align = std::max<size_t>(1, 64 / j.elem);
    j.part_elems = ((j.req.count + n - 1) / n + align - 1) / align * align;
    j.chunk_elems = std::max<size_t>(1, config_.chunk_bytes / j.elem);
    j.chunk_elems = std::max(j.chunk_elems, (j.part_elems + kMaxChunksPerPart - 1) /
                                                kMaxChunksPerPart);
    j.max_chunks = j.part_elems == 0 ? 0 : (j.part_elems + j.chunk_elems - 1) / j.chunk_elems;
    const size_t mine = j.Chunks(j.me);
    // Server: n-1 receives, one sum and n-1 result sends per chunk.
    batch->remaining += mine * (2 * (n - 1) + 1);
    // Worker: one send and one result receive per chunk of every other part.
    for (int i = 0; i < n; ++i) {
      if (i != j.me) batch->remaining += 2 * j.Chunks(i);
    }
  }

  Status status;
  for (auto& job : batch->jobs) {
    status = StartJob(batch.get(), job.get());
    if (!status.ok()) {
      Fail(batch.get(), status.message());
      break;
    }
  }
  if (status.ok()) batch->started = true;

  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(config_.timeout_s));
  std::unique_lock<std::mutex> lock(batch->mu);
  bool done = batch->cv.wait_until(lock, deadline,
                                   [&] { return batch->remaining == 0 || batch->failed; });
  if (done && !batch->failed) return Status::Ok();
  if (!done) {
    lock.unlock();
    Fail(batch.get(), "herring allreduce timed out after " +
                          std::to_string(static_cast<int>(config_.timeout_s)) + " s on rank " +
                          std::to_string(config_.rank) + ": " + MissingReport(*batch) +
                          " A process may have died or hung, or the processes issued "
                          "different reductions (different executables or shapes, or "
                          "launches of a reducing executable a different number of times). "
                          "HERRING_TIMEOUT_S sets the limit.");
    lock.lock();
  } else {
    // Failed by a peer's abort, a mismatch or the peer watch: the error
    // names the cause; this rank's own view goes to the log.
    lock.unlock();
    std::fprintf(stderr, "herring_jax rank %d: state of the failed reduction: %s\n",
                 config_.rank, MissingReport(*batch).c_str());
    lock.lock();
  }
  std::string error = batch->error;
  lock.unlock();
  // Receives may still point into XLA's buffers: cancel them and wait until
  // the transport has let go of every buffer before returning.
  transport_->CancelAll();
  lock.lock();
  batch->cv.wait_for(lock, std::chrono::seconds(5), [&] { return batch->inflight == 0; });
  lock.unlock();
  // A failed batch is never freed, drained or not: operations to a dead peer
  // may never complete, and once (chaos test, before StopWaiting existed)
  // every survivor crashed in OnContribution on a freed job after a drained
  // batch was freed, i.e. a completion arrived that the count did not
  // expect. The communicator is unusable from here on, so the leak is
  // bounded: one batch per communicator.
  batch.release();
  return Status::Error(error);
}

std::set<int> Communicator::MissingRanks(const Batch& batch) {
  std::set<int> missing;
  if (!batch.started.load()) return missing;
  for (const auto& job : batch.jobs) {
    for (int p = 0; p < job->n; ++p) {
      if (p == job->me) continue;
      if (job->contribs_from[p].load() < static_cast<int>(job->Chunks(job->me)) ||
          job->results_from[p].load() < static_cast<int>(job->Chunks(p))) {
        missing.insert(batch.group[p]);
      }
    }
  }
  return missing;
}

std::string Communicator::MissingReport(const Batch& batch) const {
  std::set<int> missing;
  std::string what, detail;
  for (const auto& job : batch.jobs) {
    if (!job->contribs_from || !job->results_from) continue;  // never started
    bool incomplete = false;
    for (int p = 0; p < job->n; ++p) {
      if (p == job->me) continue;
      const int rank = batch.group[p];
      const int contribs = job->contribs_from[p].load();
      const int results = job->results_from[p].load();
      const int want_contribs = static_cast<int>(job->Chunks(job->me));
      const int want_results = static_cast<int>(job->Chunks(p));
      if (contribs < want_contribs || results < want_results) {
        missing.insert(rank);
        if (what.empty() || incomplete) {
          detail += std::string(detail.empty() ? "" : ", ") + "from rank " +
                    std::to_string(rank) + ": " + std::to_string(contribs) + "/" +
                    std::to_string(want_contribs) + " contribution and " +
                    std::to_string(results) + "/" + std::to_string(want_results) +
                    " result chunks";
        }
        incomplete = true;
      }
    }
    if (incomplete && what.empty()) what = job->Describe();
  }
  size_t remaining, inflight;
  {
    std::lock_guard<std::mutex> lock(const_cast<Batch&>(batch).mu);
    remaining = batch.remaining;
    inflight = batch.inflight;
  }
  const std::string counts = " (" + std::to_string(remaining) + " operations left, " +
                             std::to_string(inflight) + " in flight)";
  if (missing.empty()) {
    return "no data missing, but the reduction did not finish" + counts + ".";
  }
  const std::string peers = PeerReport(missing);
  return "waiting for rank(s) " + RankList(missing) + " in " + what + " (" + detail + ")" +
         counts + "." + (peers.empty() ? std::string() : " " + peers + ".");
}

Status Communicator::StartJob(Batch* batch, Job* job) {
  const int n = job->n;
  const int me = job->me;
  const size_t chunks_me = job->Chunks(me);
  job->send_hdrs.resize(n * job->max_chunks);
  job->result_hdrs.resize(n * job->max_chunks);
  job->contrib_hdrs.resize(n * job->max_chunks);
  job->out_hdrs.resize(job->max_chunks);
  job->contributors.reset(new std::atomic<uint32_t>[n]);
  for (int p = 0; p < n; ++p) job->contributors[p].store(0, std::memory_order_relaxed);
  job->contributors[me].store(job->req.contributors, std::memory_order_relaxed);
  job->arrivals.reset(new std::atomic<int>[std::max<size_t>(1, chunks_me)]());
  job->contribs_from.reset(new std::atomic<int>[n]());
  job->results_from.reset(new std::atomic<int>[n]());
  job->staging.resize(n);

  // Receives before sends, so that peers' messages find posted buffers.
  if (chunks_me > 0) {
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      job->staging[p] = PooledBuffer(&pool_, job->PartLen(me) * job->elem);
      if (!job->staging[p].ok()) return Status::Error("out of memory for staging buffers");
      for (size_t c = 0; c < chunks_me; ++c) PostContributionRecv(job, p, c);
    }
  }
  for (int i = 0; i < n; ++i) {
    if (i == me) continue;
    for (size_t c = 0; c < job->Chunks(i); ++c) PostResultRecv(job, i, c);
  }
  // Contributions, chunk-major and starting at the next server, so that the
  // processes do not all send to the same server at the same moment.
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  for (size_t c = 0; c < job->max_chunks; ++c) {
    for (int step = 1; step < n; ++step) {
      const int i = (me + step) % n;
      if (c >= job->Chunks(i)) continue;
      const size_t len = job->ChunkLen(i, c) * job->elem;
      WireHeader& h = job->send_hdrs[i * job->max_chunks + c];
      h = MakeHeader(*job, MsgKind::kContribution, config_.token, my_rank, i, c, len,
                     job->req.contributors);
      transport::IoVec iov[2] = {{&h, sizeof(h)},
                                 {const_cast<char*>(job->InAt(job->ChunkBegin(i, c))), len}};
      batch->AddInflight(1);
      Status s = transport_->Send(batch->group[i],
                                  MakeTag(MsgKind::kContribution, my_rank, batch->stream,
                                          job->tag_bits, c),
                                  iov, len > 0 ? 2 : 1,
                                  [this, job, to = batch->group[i]](
                                      const transport::Completion& done) {
                                    SendDone(job, to, done);
                                  });
      if (!s.ok()) {
        batch->Complete(1, 1);
        return Status::Error("sending to rank " + std::to_string(batch->group[i]) + ": " +
                             s.message());
      }
    }
  }
  return Status::Ok();
}

void Communicator::PostContributionRecv(Job* job, int p, size_t c) {
  Batch* batch = job->batch;
  const int me = job->me;
  WireHeader* h = &job->contrib_hdrs[p * job->max_chunks + c];
  const size_t len = job->ChunkLen(me, c) * job->elem;
  transport::IoVec iov[2] = {{h, sizeof(*h)},
                             {job->staging[p].data() + c * job->chunk_elems * job->elem, len}};
  batch->AddInflight(1);
  Status s = transport_->Recv(
      MakeTag(MsgKind::kContribution, batch->group[p], batch->stream, job->tag_bits, c), 0,
      iov,
      2, [this, job, p, c](const transport::Completion& done) {
        OnContribution(job, p, c, done);
      });
  if (!s.ok()) {
    Fail(batch, "posting a receive: " + s.message());
    batch->Complete(1, 1);
  }
}

void Communicator::PostResultRecv(Job* job, int i, size_t c) {
  Batch* batch = job->batch;
  WireHeader* h = &job->result_hdrs[i * job->max_chunks + c];
  const size_t len = job->ChunkLen(i, c) * job->elem;
  transport::IoVec iov[2] = {{h, sizeof(*h)}, {job->OutAt(job->ChunkBegin(i, c)), len}};
  batch->AddInflight(1);
  Status s = transport_->Recv(
      MakeTag(MsgKind::kResult, batch->group[i], batch->stream, job->tag_bits, c), 0, iov, 2,
      [this, job, i, c](const transport::Completion& done) { OnResult(job, i, c, done); });
  if (!s.ok()) {
    Fail(batch, "posting a receive: " + s.message());
    batch->Complete(1, 1);
  }
}

namespace {
// Shared by both receive kinds: a failed or truncated completion is fatal
// (unless the batch already failed and cancelled it).
// `header` is the receive's header buffer: on truncation the provider fills
// the posted buffers as far as they go, so a genuine peer's header is there
// and says what that peer reduces.
bool ReceiveFailed(const transport::Completion& done, const Job& job, int from_rank,
                   int my_rank, const WireHeader& header, uint64_t token, std::string* why) {
  if (done.ok) return false;
  if (!done.truncated) {
    *why = "receive from rank " + std::to_string(from_rank) + " failed for " + job.Describe() +
           ": " + done.error;
    return true;
  }
  const bool readable = header.magic == kMagic && header.version == kWireVersion &&
                        header.checksum == HeaderChecksum(header) && header.token == token &&
                        IsValidDType(header.dtype) && IsValidOp(header.op);
  std::string theirs;
  if (readable) {
    theirs = std::string(DTypeName(static_cast<DType>(header.dtype))) + "[" +
             std::to_string(header.total_elems) + "] " +
             ReduceOpName(static_cast<ReduceOp>(header.op)) + " (key " +
             std::to_string(header.key) + "; " + DescribeIdentity(HeaderIdentity(header)) + ")";
  }
  const std::string mine = "rank " + std::to_string(my_rank) + "'s receive for " + job.Describe();
  if (readable && HeaderIdentity(header) != job.id) {
    *why = "tag collision: rank " + std::to_string(from_rank) + " sent " + theirs +
           ", a larger message that matched " + mine + "; two reductions in flight at once "
           "share their 30-bit tag hash. Rerunning will most likely not collide again";
  } else {
    *why = "mismatched reductions: rank " + std::to_string(from_rank) + " sent a larger "
           "message than expected" + (readable ? " for " + theirs : std::string()) + " to " +
           mine + "; every process must run the same reductions (shapes, dtypes, ops) in "
           "the same executables";
  }
  return true;
}
}  // namespace

Expectation Communicator::Expect(const Job& job, MsgKind kind, int from_rank, int part,
                                 size_t chunk) const {
  Expectation want;
  want.kind = kind;
  want.token = config_.token;
  want.key = job.req.key;
  want.id = job.id;
  want.src_rank = static_cast<uint32_t>(from_rank);
  want.self_rank = static_cast<uint32_t>(config_.rank);
  want.stream = job.batch->stream;
  want.part = static_cast<uint32_t>(part);
  want.chunk = static_cast<uint32_t>(chunk);
  want.dtype = job.req.dtype;
  want.op = job.req.op;
  want.payload_bytes = job.ChunkLen(part, chunk) * job.elem;
  want.total_elems = job.req.count;
  return want;
}

void Communicator::OnContribution(Job* job, int p, size_t c, const transport::Completion& done) {
  Batch* batch = job->batch;
  const int from = batch->group[p];
  std::string why;
  const WireHeader& h = job->contrib_hdrs[p * job->max_chunks + c];
  if (ReceiveFailed(done, *job, from, config_.rank, h, config_.token, &why)) {
    if (!batch->Failed()) Fail(batch, why);
    batch->Complete(1, 1);
    return;
  }
  const Expectation want = Expect(*job, MsgKind::kContribution, from, job->me, c);
  switch (CheckHeader(&h, done.len, want, &why)) {
    case HeaderVerdict::kOk:
      break;
    case HeaderVerdict::kCollision:
      Fail(batch, why);
      batch->Complete(1, 1);
      return;
    case HeaderVerdict::kMismatch:
      Fail(batch, "mismatched reductions: " + why);
      batch->Complete(1, 1);
      return;
    default:
      DropAndRepost(batch, why, [this, job, p, c] { PostContributionRecv(job, p, c); });
      return;
  }
  Heard(static_cast<uint32_t>(from));
  job->contributors[p].store(h.contributors, std::memory_order_relaxed);
  job->contribs_from[p].fetch_add(1);
  if (job->arrivals[c].fetch_add(1) + 1 == job->n - 1) {
    batch->AddInflight(1);
    Enqueue([this, job, c] { ReduceChunk(job, c); });
  }
  batch->Complete(1, 1);
}

void Communicator::ReduceChunk(Job* job, size_t c) {
  Batch* batch = job->batch;
  const int n = job->n;
  const int me = job->me;
  if (batch->Failed()) {
    batch->Complete(1 + (n - 1), 1);
    return;
  }
  const size_t begin = job->ChunkBegin(me, c);
  const size_t count = job->ChunkLen(me, c);
  // Rank order, whichever contribution arrived first: the sum is the same
  // bits on every run.
  std::vector<const void*> srcs(n);
  uint32_t contributors = 0;
  for (int p = 0; p < n; ++p) {
    srcs[p] = p == me ? static_cast<const void*>(job->InAt(begin))
                      : job->staging[p].data() + c * job->chunk_elems * job->elem;
    contributors += job->contributors[p].load(std::memory_order_relaxed);
  }
  const double divisor = job->req.op == ReduceOp::kMean ? contributors : 1.0;
  char* dst = job->OutAt(begin);
  ReduceInto(job->req.dtype, dst, srcs.data(), n, count, divisor);

  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  WireHeader& h = job->out_hdrs[c];
  h = MakeHeader(*job, MsgKind::kResult, config_.token, my_rank, me, c, count * job->elem,
                 contributors);
  size_t unposted = n - 1;
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    transport::IoVec iov[2] = {{&h, sizeof(h)}, {dst, count * job->elem}};
    batch->AddInflight(1);
    Status s = transport_->Send(
        batch->group[p], MakeTag(MsgKind::kResult, my_rank, batch->stream, job->tag_bits, c),
        iov,
        count > 0 ? 2 : 1,
        [this, job, to = batch->group[p]](const transport::Completion& done) {
          SendDone(job, to, done);
        });
    --unposted;
    if (!s.ok()) {
      Fail(batch, "sending to rank " + std::to_string(batch->group[p]) + ": " + s.message());
      batch->Complete(1, 1);
    }
  }
  batch->Complete(1 + unposted, 1);
}

void Communicator::OnResult(Job* job, int i, size_t c, const transport::Completion& done) {
  Batch* batch = job->batch;
  const int from = batch->group[i];
  std::string why;
  const WireHeader& h = job->result_hdrs[i * job->max_chunks + c];
  if (ReceiveFailed(done, *job, from, config_.rank, h, config_.token, &why)) {
    if (!batch->Failed()) Fail(batch, why);
    batch->Complete(1, 1);
    return;
  }
  const Expectation want = Expect(*job, MsgKind::kResult, from, i, c);
  switch (CheckHeader(&h, done.len, want, &why)) {
    case HeaderVerdict::kOk:
      Heard(static_cast<uint32_t>(from));
      job->results_from[i].fetch_add(1);
      batch->Complete(1, 1);
      return;
    case HeaderVerdict::kCollision:
      Fail(batch, why);
      batch->Complete(1, 1);
      return;
    case HeaderVerdict::kMismatch:
      Fail(batch, "mismatched reductions: " + why);
      batch->Complete(1, 1);
      return;
    default:
      DropAndRepost(batch, why, [this, job, i, c] { PostResultRecv(job, i, c); });
      return;
  }
}

void Communicator::SendDone(Job* job, int to_rank, const transport::Completion& done) {
  Batch* batch = job->batch;
  if (!done.ok && !batch->Failed()) {
    Fail(batch, "sending to rank " + std::to_string(to_rank) + " failed for " + job->Describe() +
                    ": " + done.error);
  }
  batch->Complete(1, 1);
}

}  // namespace herring::engine
