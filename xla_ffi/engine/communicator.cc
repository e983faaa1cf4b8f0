// The communicator's set-up and the AllReduce call: a batch's identities and
// geometry, and waiting for it. The rest lives in rooms of their own:
// data_path.cc; host_stage.cc, host_messages.cc, host_posting.cc and
// host_linger.cc; liveness.cc, control.cc, diagnostics.cc, and test_faults.cc
// (fault injection for tests).
#include "engine/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "engine/batch.h"
#include "engine/served.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {

// See Communicator::PruneOccurrences.
constexpr double kOccurrenceIdleFactor = 8.0;

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
  // Per-rank state exists before anything is posted: callbacks read it.
  const int64_t now = NowNs();
  comm->last_heard_.reset(new std::atomic<int64_t>[config.size]);
  comm->last_sent_.reset(new std::atomic<int64_t>[config.size]);
  comm->waiter_until_.reset(new std::atomic<int64_t>[config.size]);
  comm->heartbeat_busy_.reset(new std::atomic<bool>[config.size]);
  comm->abort_seen_.reset(new std::atomic<bool>[config.size]);
  comm->gone_.reset(new std::atomic<bool>[config.size]);
  comm->ledger_.Reset(config.size);
  for (int r = 0; r < config.size; ++r) {
    comm->last_heard_[r] = now;
    comm->last_sent_[r] = 0;
    comm->waiter_until_[r] = 0;
    comm->heartbeat_busy_[r] = false;
    comm->abort_seen_[r] = false;
    comm->gone_[r] = false;
  }
  comm->peer_wait_.resize(config.size);
  comm->transport_->SetFatalHandler([c = comm.get()](const std::string& why) {
    c->FailAll("the transport failed on rank " + std::to_string(c->config_.rank) + ": " + why,
               /*tell_peers=*/true);
  });
  size_t max_payload = comm->transport_->MaxMessageBytes() - sizeof(WireHeader);
  comm->config_.chunk_bytes = std::max<size_t>(64, std::min(config.chunk_bytes, max_payload));
  for (int i = 0; i < std::max(1, config.server_threads); ++i) {
    comm->servers_.emplace_back([c = comm.get()] { c->ServerLoop(); });
  }
  return comm;
}

Communicator::Communicator(const CommConfig& config)
    : config_(config), board_(std::make_unique<HostBoard>()) {}

Communicator::~Communicator() {
  // Other processes of the host may still be reading the last results'
  // slices: everything below (heartbeats included) keeps running until they
  // are done.
  if (DrainLingering() > 0) {
    std::fprintf(stderr, "herring_jax rank %d: shutting down while another process of this "
                 "host has not said it read this one's last results\n", config_.rank);
  }
  // Every reduction of this rank has ended: every peer learns it, and the
  // endpoint stays open until each has taken in this rank's last messages
  // (Leave). After a failure every rank has been told already.
  Leave();
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
  // Callbacks of cancelled operations run inside Shutdown and may still use
  // transport_ (Fail calls StopWaiting): it must stay set until they are done.
  // Null when Create could not open one (this destructor then runs from
  // Create's failure path).
  if (transport_) {
    transport_->Shutdown();
    transport_.reset();
  }
  // Memory that another process may still read is never freed (a freed
  // buffer stays mapped and is reused: the reader would get wrong bytes and
  // succeed): the staging of failed host-stage calls, and of successful ones
  // whose readers did not all finish.
  std::lock_guard<std::mutex> lingering_lock(lingering_mu_);
  for (const std::unique_ptr<Batch>& b : lingering_) {
    std::lock_guard<std::mutex> batch_lock(b->mu);
    if (!SlicesRead(*b)) {
      for (PooledBuffer& buffer : b->host->staging) buffer.Leak();
    }
  }
  std::lock_guard<std::mutex> kept_lock(kept_mu_);
  for (PooledBuffer& buffer : kept_staging_) buffer.Leak();
}

bool Communicator::ShuttingDown() {
  std::lock_guard<std::mutex> lock(queue_mu_);
  return stopping_;
}

Status Communicator::Connect(const std::vector<std::vector<uint8_t>>& addrs) {
  if (static_cast<int>(addrs.size()) != config_.size) {
    return Status::Error("expected " + std::to_string(config_.size) + " addresses, got " +
                         std::to_string(addrs.size()));
  }
  Status s = transport_->SetPeers(addrs);
  if (!s.ok()) return s;
  const int64_t now = NowNs();
  for (int r = 0; r < config_.size; ++r) last_heard_[r] = now;
  control_.resize(kControlRecvs);
  for (size_t i = 0; i < kControlRecvs; ++i) PostControlRecv(i);
  connected_ = true;
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
  }
  if (config_.size > 1) heartbeat_ = std::thread([this] { WatchLoop(); });
  return s;
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
    // Tests: a saturated host, whose server threads run late once the job
    // has failed (what is told from them arrives late).
    if (!config_.test_fault.empty() && !Broken().empty() && TestFault("slow-server-threads")) {
      std::this_thread::sleep_for(std::chrono::seconds(2));
    }
    task();
  }
}

Status Communicator::SetTopology(const HostTopology& topology) {
  if (connected_) return Status::Error("the host topology must be set before Connect");
  const std::string invalid = topology.Validate(config_.size);
  if (!invalid.empty()) return Status::Error(invalid);
  topology_ = topology;
  board_->SetSelf(topology.IndexOnHost(config_.rank));
  return Status::Ok();
}

int Communicator::BoardFd(std::string* error) const {
  *error = board_->error();
  return error->empty() ? board_->fd() : -1;
}

std::string Communicator::AttachBoard(int host_index, int64_t pid, int fd) {
  if (connected_) return "boards must be attached before Connect";
  return board_->Attach(host_index, pid, fd);
}

const GroupPlan& Communicator::PlanFor(const std::vector<int>& group) {
  std::lock_guard<std::mutex> lock(plans_mu_);
  auto it = plans_.find(group);
  if (it == plans_.end()) {
    it = plans_.emplace(group, PlanGroup(topology_, group, config_.rank)).first;
  }
  return it->second;
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
  if (ServerCount() > 0 && group.back() >= config_.workers) {
    // A server-only process reduces nothing of its own: it would never come.
    return Status::Error("rank " + std::to_string(config_.rank) + ": process group names " +
                         RankText(group.back()) + ", a server-only process; groups hold "
                         "workers only (ranks 0.." + std::to_string(config_.workers - 1) + ")");
  }
  const int n = static_cast<int>(group.size());
  for (const ReduceRequest& r : requests) {
    const std::string invalid = CheckRequest(r, n);
    if (!invalid.empty()) return Status::Error(invalid);
    bytes_reduced_ += r.count * ElementSize(r.dtype);
  }
  // Nothing lost where nothing is encoded (the paths below write the loss
  // of what this process encodes, and only that).
  for (const ReduceRequest& r : requests) {
    if (r.lost != nullptr) std::memset(r.lost, 0, r.count * sizeof(float));
  }
  reductions_ += requests.size();

  if (n > 1 && TestFault("abort-at-start")) {
    const std::string why = "rank " + std::to_string(config_.rank) +
                            ": test fault abort-at-start (HERRING_TEST_FAULT)";
    FailAll(why, /*tell_peers=*/true);
    return Status::Error(why);
  }
  // Only groups that reach the wire need a stream id that fits in the tag; a
  // group of this process alone (any number of them) never does.
  if (n > 1 && stream >= kControlStream) return Status::Error("stream id out of range");
  if (n == 1) {
    // This process's part is the whole buffer.
    for (ReduceRequest& r : requests) {
      const void* src = r.in;
      double divisor = r.op == ReduceOp::kMean ? r.contributors : 1.0;
      ReduceOpInto(r.op, r.dtype, r.out, nullptr, &src, 1, r.count, divisor);
    }
    return Status::Ok();
  }
  if (requests.empty()) return Status::Ok();
  const std::vector<Identity> ids = TakeIdentities(stream, group, requests);
  const GroupPlan& plan = PlanFor(group);
  if (plan.hierarchical) return ReduceInHosts(stream, plan, requests, ids);
  return ReduceFlat(stream, group, requests, ids, ServedFlags(group, requests));
}

std::string CheckRequest(const ReduceRequest& r, int n) {
  if (ElementSize(r.dtype) == 0) return "unsupported dtype";
  if (static_cast<uint8_t>(r.op) > static_cast<uint8_t>(ReduceOp::kMin)) return "unknown op";
  if (r.codec != Codec::kNone &&
      (r.dtype != DType::kFloat32 || (r.op != ReduceOp::kSum && r.op != ReduceOp::kMean))) {
    return std::string("codec ") + CodecName(r.codec) + " compresses float32 sums and means " +
           "only; this reduction is a " + ReduceOpName(r.op) + " of " + DTypeName(r.dtype) +
           " (use codec none for it)";
  }
  if (r.lost != nullptr && (r.codec == Codec::kNone || r.collective == Collective::kAllGather)) {
    return "error feedback (lost) needs a codec and a sum or mean to contribute to";
  }
  if (r.collective == Collective::kAllReduce) {
    return r.parts.empty() ? "" : "an all-reduce cuts its own parts";
  }
  if (r.collective != Collective::kReduceScatter && r.collective != Collective::kAllGather) {
    return "unknown collective";
  }
  if (static_cast<int>(r.parts.size()) != n + 1 || r.parts.front() != 0 ||
      r.parts.back() != r.count || !std::is_sorted(r.parts.begin(), r.parts.end())) {
    return std::string("a ") + CollectiveName(r.collective) + " needs one part per process, " +
           "in order, covering the buffer";
  }
  for (size_t begin : r.parts) {
    if (r.codec != Codec::kNone && begin != r.count && begin % kCodecBlock != 0) {
      return std::string("codec ") + CodecName(r.codec) + " needs parts that begin at " +
             "multiples of " + std::to_string(kCodecBlock) + " elements";
    }
  }
  return "";
}

std::vector<Identity> Communicator::TakeIdentities(uint32_t stream,
                                                   const std::vector<int>& group,
                                                   const std::vector<ReduceRequest>& requests) {
  std::vector<Identity> ids;
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
    ids.push_back(Identity{r.run_id, r.slot, r.instance, occurrence, r.buffer});
  }
  return ids;
}

Status Communicator::ReduceFlat(uint32_t stream, const std::vector<int>& order,
                                const std::vector<ReduceRequest>& requests,
                                const std::vector<Identity>& ids,
                                const std::vector<bool>& served_flags) {
  auto batch = std::make_unique<Batch>();
  batch->stream = stream;
  batch->group = order;
  // The server-only processes own the parts after the group's (ServedParts).
  const bool any_served =
      std::find(served_flags.begin(), served_flags.end(), true) != served_flags.end();
  const int num_servers = any_served ? ServerCount() : 0;
  for (int j = 0; j < num_servers; ++j) batch->group.push_back(config_.workers + j);
  batch->started_ns = NowNs();
  const int n = static_cast<int>(order.size());
  const int me =
      static_cast<int>(std::find(order.begin(), order.end(), config_.rank) - order.begin());
  // The servers' share of each collective's buffers (or of its blocks).
  auto share_of = [&](Collective c) {
    if (num_servers == 0) return 0.0;
    const double requested = config_.server_share;
    return c == Collective::kAllReduce ? ServerShare(n, num_servers, requested)
                                       : BlockShare(n, num_servers, requested);
  };
  std::vector<bool> job_served;
  auto add_job = [&](const ReduceRequest& r, const Identity& id, bool served, int root,
                     size_t whole_count) {
    auto job = std::make_unique<Job>();
    job->batch = batch.get();
    job->req = r;
    job->id = id;
    job->root = root;
    job->whole_count = whole_count;
    job->tag_bits = BlockTagBits(IdentityTagBits(id, stream), root);
    batch->jobs.push_back(std::move(job));
    job_served.push_back(served);
  };
  for (size_t k = 0; k < requests.size(); ++k) {
    const ReduceRequest& r = requests[k];
    const bool served = num_servers > 0 && served_flags[k] && share_of(r.collective) > 0;
    const bool all_reduce = r.collective == Collective::kAllReduce;
    const bool blocks = served && !all_reduce && n >= 2;
    if ((served && all_reduce) || blocks) served_jobs_.fetch_add(1);  // a buffer
    if (!blocks) {
      add_job(r, ids[k], served && all_reduce, -1, 0);
      continue;
    }
    // Through the servers, a reduce-scatter or all-gather goes block by
    // block: the servers sum (or pass on) a share of each block, and send it
    // to its owner alone (or to the others).
    // Each process starts with its own block, then the next one's: the
    // processes do not all send to the same owner at the same moment.
    const size_t elem = ElementSize(r.dtype);
    for (int step = 0; step < n; ++step) {
      const int root = (me + step) % n;
      const size_t begin = r.parts[root];
      const size_t len = r.parts[root + 1] - begin;
      if (len == 0) continue;
      ReduceRequest block = r;
      block.count = len;
      block.parts.clear();
      if (r.collective == Collective::kReduceScatter) {
        block.in = static_cast<const char*>(r.in) + begin * elem;
        block.out = root == me ? r.out : nullptr;
        block.lost = r.lost != nullptr ? r.lost + begin : nullptr;
      } else {
        block.in = root == me ? r.in : nullptr;
        block.out = static_cast<char*>(r.out) + begin * elem;
      }
      add_job(block, ids[k], true, root, r.count);
    }
  }
  // Inside one host (the transport over loopback or shared memory) a message
  // costs more than the wait for a part's last bytes: whole chunks there.
  const bool one_host =
      !topology_.empty() &&
      std::all_of(order.begin(), order.end(),
                  [&](int r) { return topology_.host_of[r] == topology_.host_of[order[0]]; });
  const size_t min_chunk_bytes = one_host ? config_.chunk_bytes : config_.min_chunk_bytes;
  // Geometry first, so that `remaining` is complete before anything is posted.
  for (size_t k = 0; k < batch->jobs.size(); ++k) {
    Job& j = *batch->jobs[k];
    const bool served = job_served[k];
    j.n = served ? n + num_servers : n;
    j.workers = n;
    j.me = me;
    j.elem = ElementSize(j.req.dtype);
    // A codec's scale blocks start at multiples of kCodecBlock elements of
    // the buffer, so parts and chunks are cut there.
    const size_t align =
        j.Encoded() ? kCodecBlock : std::max<size_t>(1, 64 / j.elem);
    const size_t count = j.req.count;
    if (served && j.root >= 0) {
      j.part_begin =
          RootedParts(count, n, j.root, num_servers, share_of(j.req.collective), align);
    } else if (served) {
      j.part_begin = ServedParts(count, n, num_servers, share_of(j.req.collective), align);
    } else if (j.req.collective == Collective::kAllReduce) {
      const size_t part_elems = ((count + n - 1) / n + align - 1) / align * align;
      for (int i = 0; i <= n; ++i) j.part_begin.push_back(std::min(count, i * part_elems));
    } else {
      j.part_begin = j.req.parts;
    }
    // A block's buffers hold the block alone (the caller's, offset).
    if (j.root < 0 && j.req.collective == Collective::kAllGather) j.in_base = j.PartBegin(me);
    if (j.root < 0 && j.req.collective == Collective::kReduceScatter) j.out_base = j.PartBegin(me);
    j.SetSlots();
    size_t largest = 0;
    for (int i = 0; i < j.n; ++i) largest = std::max(largest, j.PartLen(i));
    j.chunk_elems = ChunkElems(largest, j.elem, align, config_.chunk_bytes, min_chunk_bytes);
    j.wire_stride = j.Encoded() ? EncodedBytes(j.req.codec, j.chunk_elems)
                                : j.chunk_elems * j.elem;
    j.max_chunks = largest == 0 ? 0 : (largest + j.chunk_elems - 1) / j.chunk_elems;
    const size_t mine = j.Chunks(j.me);
    const size_t in = j.Contributes() ? n - 1 : 0;  // from the other workers
    const size_t out = j.Returns() ? n - 1 : 0;
    // Server: per chunk, n-1 receives (none in an all-gather), one sum (in an
    // all-gather, its own part taken as the result) and n-1 result sends
    // (none in a reduce-scatter).
    batch->remaining += mine * (in + 1 + out);
    // Worker: per chunk of every other part, a send and a result receive
    // (only the send in a reduce-scatter, only the receive in an all-gather;
    // Job::SendsTo and ResultsFrom say which for a block's job).
    for (int i = 0; i < j.n; ++i) {
      if (i == j.me) continue;
      batch->remaining += (j.SendsTo(i) ? j.Chunks(i) : 0) + j.ResultsFrom(i);
    }
  }
  if (batch->remaining == 0) return Status::Ok();  // only empty parts
  // Active (visible to aborts and the peer watch) once `jobs` is complete:
  // from here on only the jobs' own atomics change under other threads.
  if (!Activate(batch.get())) return EndFailed(std::move(batch), /*timed_out=*/false);

  Status status;
  try {
    if (TestFault("bad-alloc")) throw std::bad_alloc();
    for (auto& job : batch->jobs) {
      status = PostJob(batch.get(), job.get());
      if (!status.ok()) break;
    }
    for (size_t k = 0; status.ok() && k < batch->jobs.size(); ++k) {
      status = SendJob(batch.get(), batch->jobs[k].get());
    }
  } catch (const std::bad_alloc&) {
    // Receives may be posted into the batch, which is active: it must end as
    // every failed batch does, never be freed by the unwinding.
    status = Status::Error("rank " + std::to_string(config_.rank) +
                           " ran out of memory starting " + batch->jobs.front()->Describe());
  }
  if (status.ok()) {
    batch->started = true;
  } else {
    Fail(batch.get(), status.message());
  }

  std::unique_lock<std::mutex> lock(batch->mu);
  // Success needs every operation drained too, not only the work done: a
  // re-post task of DropAndRepost ends (batch->Complete) after its receive was
  // posted, and that receive can complete the work first.
  bool done = batch->cv.wait_until(lock, Deadline(), [&] {
    return (batch->remaining == 0 && batch->inflight == 0) || batch->failed;
  });
  const bool ok = done && !batch->failed;
  lock.unlock();
  if (ok) {
    Deactivate(batch.get());
    return Status::Ok();
  }
  return EndFailed(std::move(batch), /*timed_out=*/!done);
}

std::chrono::steady_clock::time_point Communicator::Deadline() const {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(
             std::chrono::duration<double>(config_.timeout_s));
}

}  // namespace herring::engine
