// The state of one AllReduce call (a Batch) and of each buffer in it (a Job),
// shared by the communicator's rooms: communicator.cc (set-up and the call
// itself), data_path.cc (messages and sums), host_stage.cc, host_messages.cc
// and host_linger.cc (the processes of one host through memory), liveness.cc
// (heartbeats), control.cc (failure and abort), diagnostics.cc (what error
// texts say) and test_faults.cc (strangers that tests send).
// Internal to the engine.
#ifndef HERRING_ENGINE_BATCH_H_
#define HERRING_ENGINE_BATCH_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/communicator.h"
#include "engine/host_board.h"
#include "engine/wire.h"

namespace herring::engine {

struct HostWait;

// Everything one AllReduce call waits for. `remaining` counts the work that
// must finish for success; `inflight` counts posted transport operations and
// queued server tasks, which reference the batch and must drain before it
// may be freed.
struct Batch {
  std::mutex mu;
  std::condition_variable cv;
  size_t remaining = 0;
  size_t inflight = 0;
  size_t tasks = 0;  // server tasks among `inflight` (AddTask)
  // Receives among `inflight` posted straight into the caller's output (a
  // flat call's results without a codec, input and output apart).
  std::atomic<size_t> output_recvs{0};
  bool failed = false;
  std::string error;
  uint32_t stream = 0;
  std::vector<int> group;
  int64_t started_ns = 0;
  std::vector<std::unique_ptr<Job>> jobs;
  // Every job's per-peer counters exist (PostJob ran for all): from then on
  // other threads may read them.
  std::atomic<bool> started{false};
  // Its stall was reported (Communicator::ReportStalls): once per batch.
  std::atomic<bool> stall_reported{false};
  // The ranks it waits for were told where it waits (kStall): once per batch.
  std::atomic<bool> wait_noticed{false};
  // The host stage's state (host_stage.cc); null for a flat batch, whose jobs
  // then carry the per-peer counters. A host batch's jobs only describe.
  std::unique_ptr<HostWait> host;

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
  // A server task that touches the caller's buffers (a sum, a re-post) is in
  // flight, and counted apart: a failed call waits for these without a short
  // limit before it returns (they never block), since XLA frees the buffers
  // once it has.
  void AddTask() {
    std::lock_guard<std::mutex> lock(mu);
    ++inflight;
    ++tasks;
  }
  void CompleteTask(size_t work) {
    std::lock_guard<std::mutex> lock(mu);
    remaining -= work;
    --inflight;
    --tasks;
    cv.notify_all();
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
  // Parts: one per process of the batch's group that serves this buffer,
  // group[i] owning part i. The first `workers` of them contribute and
  // receive; the rest are server-only processes (served.cc), which only sum.
  int n = 0;
  int workers = 0;
  int me = 0;  // this process's index in the group (= the part it serves)
  // A reduce-scatter or all-gather through the servers is one job per block
  // (per worker's part, ReduceFlat): the block's owner, whose part and the
  // servers' are the only ones not empty. -1: every other job.
  int root = -1;
  size_t whole_count = 0;  // a block's job: the whole buffer's elements; 0 otherwise
  size_t elem = 0;
  std::vector<size_t> part_begin;  // [part] first element; n + 1 entries, the last count
  // Where `req.in` and `req.out` start in the buffer: a reduce-scatter's out
  // and an all-gather's in hold only this process's part.
  size_t in_base = 0;
  size_t out_base = 0;
  size_t chunk_elems = 0;
  size_t max_chunks = 0;
  // Bytes between chunks in the buffers that hold data as it travels (the
  // staging buffers; with a codec also wire_in and wire_out).
  size_t wire_stride = 0;
  // With a codec (req.codec): this process's contribution encoded, and the
  // results encoded (received, and for its own part sent), [part][chunk].
  // In place without a codec (results_staged): wire_out receives the results.
  PooledBuffer wire_in;
  PooledBuffer wire_out;
  // The input is the output (an allreduce_gradients bucket on XLA:CPU, the host
  // stage's slice): results are received apart and copied into the output
  // after their header check, since a receive posted into the output would be
  // posted into bytes this process has yet to send, and a stranger's message
  // (an old run's, say) matching its tag would overwrite them before the
  // check drops it: a wrong sum on every rank and no error (tests/test_engine.py,
  // HERRING_TEST_EARLY_STRANGERS, shows it happening without this).
  bool results_staged = false;

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

  size_t PartBegin(int i) const { return part_begin[i]; }
  size_t PartLen(int i) const { return part_begin[i + 1] - part_begin[i]; }
  // Contributions travel to the servers (not in an all-gather), results back
  // from them (not in a reduce-scatter).
  bool Contributes() const { return req.collective != Collective::kAllGather; }
  bool Returns() const { return req.collective != Collective::kReduceScatter; }
  // Chunks expected from process p: contributions to this process's part
  // (none from a server-only process), results of part p.
  int ContributionsFrom(int p) const {
    return Contributes() && p < workers ? static_cast<int>(Chunks(me)) : 0;
  }
  int ResultsFrom(int p) const {
    return p != me && ReceivesResults() ? static_cast<int>(Chunks(p)) : 0;
  }
  // Whether this process receives the other parts' results: in an all-reduce
  // and an all-gather, but not a block's owner its own block; in a
  // reduce-scatter only a block's owner, from the servers.
  bool ReceivesResults() const { return Returns() ? root != me : root == me; }
  // Whether this process sends to part i's process: contributions (not in an
  // all-gather); in an all-gather through the servers, the owner its block's
  // share and the others a header without data, by which the server learns
  // where to send it (served.cc).
  bool SendsTo(int i) const { return i != me && (Contributes() || (root >= 0 && i >= workers)); }
  // The part's number on the wire: a rooted job's server parts are numbered
  // apart from every other block's, since one server sums them all.
  uint32_t WirePart(int i) const {
    return static_cast<uint32_t>(root < 0 || i < workers ? i : workers + root * (n - workers) +
                                                                    (i - workers));
  }
  size_t Chunks(int i) const { return (PartLen(i) + chunk_elems - 1) / chunk_elems; }
  size_t ChunkBegin(int i, size_t c) const { return PartBegin(i) + c * chunk_elems; }
  size_t ChunkLen(int i, size_t c) const {
    return std::min(chunk_elems, PartLen(i) - c * chunk_elems);
  }
  bool Encoded() const { return req.codec != Codec::kNone; }
  // Results are received into wire_out, not into the output (OnResult moves them).
  bool ResultsApart() const { return Encoded() || results_staged; }
  // Bytes of chunk c of part i on the wire.
  size_t WireBytes(int i, size_t c) const {
    return Encoded() ? EncodedBytes(req.codec, ChunkLen(i, c)) : ChunkLen(i, c) * elem;
  }
  // Where part i's chunks sit in wire_in and wire_out: only parts that hold
  // elements have room there (a block's job: its owner's and the servers';
  // an all-reduce whose servers take all of it: the servers'). Set with
  // part_begin (SetSlots).
  std::vector<int> slot;
  int slots = 0;
  void SetSlots() {
    slot.assign(n, 0);
    slots = 0;
    for (int i = 0; i < n; ++i) {
      if (PartLen(i) > 0) slot[i] = slots++;
    }
    slots = std::max(slots, 1);
  }
  int Slot(int i) const { return slot[i]; }
  int Slots() const { return slots; }
  char* WireIn(int i, size_t c) const {
    return wire_in.data() + (Slot(i) * max_chunks + c) * wire_stride;
  }
  char* WireOut(int i, size_t c) const {
    return wire_out.data() + (Slot(i) * max_chunks + c) * wire_stride;
  }
  char* OutAt(size_t elem_index) const {
    return static_cast<char*>(req.out) + (elem_index - out_base) * elem;
  }
  const char* InAt(size_t elem_index) const {
    return static_cast<const char*>(req.in) + (elem_index - in_base) * elem;
  }
  std::string Describe() const {
    const std::string what = req.collective == Collective::kAllGather ? "all-gather"
                             : req.collective == Collective::kReduceScatter
                                 ? std::string(ReduceOpName(req.op)) + " reduce-scatter"
                                 : std::string(ReduceOpName(req.op));
    return std::string(DTypeName(req.dtype)) + "[" +
           std::to_string(root >= 0 ? whole_count : req.count) + "] " + what +
           (Encoded() ? std::string(" over ") + CodecName(req.codec) : "") +
           (root >= 0 ? ", block " + std::to_string(root) + " (" + std::to_string(req.count) +
                            " elements) through the servers"
                      : "") +
           " (key " + std::to_string(req.key) + "; " +
           DescribeIdentity(id) + ")";
  }
};

// Elements [begin, begin + len) of a buffer.
struct Range {
  size_t begin = 0;
  size_t len = 0;
};

// The host stage of one call (host_stage.cc): the messages exchanged with the
// other processes of the host that reduce in the same group. Steps: 0 arrive
// (inputs), 1 ready (result slices), 2 done (slice read).
struct HostWait {
  static constexpr int kSteps = 3;
  std::vector<int> local;  // ranks by local index
  int me = 0;              // this process's local index
  int hosts = 1;           // hosts of the group
  std::vector<int64_t> pids;  // [local index]
  // [local index] the steps received from that process, one bit each; set
  // under the batch's mutex (waiters check it there), read anywhere.
  std::unique_ptr<std::atomic<uint8_t>[]> got;
  // The step the caller waits for now (-1: none), for the peer watch.
  std::atomic<int> waiting{-1};
  // The call returned with success and the batch waits only for kHostDone
  // (Communicator::Linger): a failed receive then no longer fails anything.
  std::atomic<bool> lingering{false};
  // This process's arrive was published (others may read its inputs).
  std::atomic<bool> arrive_published{false};
  // [local index] a kHostDone (or a withdrawal) went to that process: at most
  // one of them per peer and call.
  std::unique_ptr<std::atomic<bool>[]> done_sent;
  std::vector<WireHeader> in_headers;               // [step * P + q]
  std::vector<std::vector<HostEntry>> in_entries;   // [step * P + q]
  WireHeader out_headers[kSteps];                   // sent to every peer
  WireHeader withdrawal;                            // kHostDone saying kHostWithdrawn
  std::vector<HostEntry> out_entries[kSteps];
  std::vector<PooledBuffer> staging;  // [buffer] this process's slice of the result
  // [buffer][local index] the ranges of the buffer that process's slice
  // holds, in the order of its staging: one for an all-reduce; for a
  // reduce-scatter or all-gather the parts of the processes with that local
  // index, hosts in order (the parts the stage across hosts exchanges).
  std::vector<std::vector<std::vector<Range>>> slices;
  // Through the host boards instead of messages (GroupPlan::board): this
  // call's key and posting on this process's board, the peers' board
  // indices, and per peer the posting (and its version) whose slices this
  // process reads, acked once it has read them (step 2).
  bool board = false;
  // The direct path (CommConfig::host_direct_bytes): the arrive entries name
  // staged copies of the whole inputs, which every peer reads and sums.
  bool direct = false;
  BoardKey key;
  int posting = -1;
  std::vector<int> board_index;    // [local index]
  std::vector<int> ready_posting;  // [local index]
  std::vector<uint32_t> ready_version;
  // [local index] the posting (and its version) whose inputs this process
  // read, checked again after the last read (CheckInputsStillPosted).
  std::vector<int> arrive_posting;
  std::vector<uint32_t> arrive_version;

  int size() const { return static_cast<int>(local.size()); }
  bool Got(int q, int step) const { return (got[q].load() >> step) & 1; }
};

// A control message's header (heartbeat or abort) from `rank` of the job
// `token`, before its kind-specific fields and SealHeader.
inline WireHeader ControlHeader(MsgKind kind, uint64_t token, int rank) {
  WireHeader h{};
  h.magic = kMagic;
  h.version = kWireVersion;
  h.kind = static_cast<uint8_t>(kind);
  h.dtype = static_cast<uint8_t>(DType::kFloat32);
  h.token = token;
  h.src_rank = static_cast<uint32_t>(rank);
  h.stream = kControlStream;
  return h;
}

// A data message's header (contribution, result or host stage) for `job`.
inline WireHeader MakeHeader(const Job& job, MsgKind kind, uint64_t token, uint32_t src,
                             int part, size_t chunk, size_t payload_bytes,
                             uint32_t contributors) {
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
  h.part = job.WirePart(part);
  h.chunk = static_cast<uint32_t>(chunk);
  h.payload_bytes = payload_bytes;
  h.total_elems = job.req.count;
  h.op = static_cast<uint8_t>(job.req.op);
  h.codec = static_cast<uint8_t>(job.req.codec);
  h.contributors = contributors;
  SealHeader(&h);
  return h;
}

// Whether a completed data receive failed: a failed or truncated completion is
// fatal (unless the batch already failed and cancelled it), and `why` says
// what happened. `header` is the receive's header buffer: on truncation the
// provider fills the posted buffers as far as they go, so a genuine peer's
// header is there and says what that peer reduces (data_path.cc).
bool ReceiveFailed(const transport::Completion& done, const Job& job, int from_rank,
                   int my_rank, const WireHeader& header, uint64_t token, std::string* why);

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace herring::engine

#endif  // HERRING_ENGINE_BATCH_H_
