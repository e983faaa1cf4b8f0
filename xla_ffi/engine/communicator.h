// The Herring engine of one process: a worker that splits its buffers into
// balanced parts, one per server, and a server shard that sums the part this
// process owns. Knows only transport.h. Its configuration, requests and
// counters are in comm_types.h; the leave protocol's counts in
// leave_ledger.h.
#ifndef HERRING_ENGINE_COMMUNICATOR_H_
#define HERRING_ENGINE_COMMUNICATOR_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/chunking.h"
#include "engine/codec.h"
#include "engine/comm_types.h"
#include "engine/dtype.h"
#include "engine/host_board.h"
#include "engine/host_topology.h"
#include "engine/leave_ledger.h"
#include "engine/occurrence_table.h"
#include "engine/wire.h"
#include "transport/transport.h"

namespace herring::engine {

using transport::Status;

struct Job;
struct Batch;
struct HostWait;
struct ServedState;
struct ServedChunk;
struct ServedResult;

// Why `r` cannot be reduced in a group of `n` processes ("" if it can).
std::string CheckRequest(const ReduceRequest& r, int n);

class Communicator {
 public:
  static std::unique_ptr<Communicator> Create(const CommConfig& config, Status* status);
  ~Communicator();

  std::vector<uint8_t> Address() const { return transport_->Address(); }
  // Which processes share a host (see host_topology.h); before Connect. Never
  // set: every group reduces flat.
  Status SetTopology(const HostTopology& topology);
  // This process's host board (host_board.h): its descriptor for the other
  // processes of the host (-1 and `error` where it could not be created),
  // and mapping theirs ("" or why not) before SetTopology.
  int BoardFd(std::string* error) const;
  std::string AttachBoard(int host_index, int64_t pid, int fd);
  // Installs every rank's address (index = rank) and enables reductions.
  Status Connect(const std::vector<std::vector<uint8_t>>& addrs);

  // Reduces every request across the processes of `group` (sorted ranks that
  // include this one) with all requests in flight at once; returns when all
  // are done: through the host stage where the group's hosts allow it (see
  // host_topology.h), else flat. `stream` separates groups of one call that
  // share processes.
  // Thread-safe: calls may run concurrently and start in any order. Requests
  // of one (run, slot, instance) made one after another (a loop) are told
  // apart by their occurrence; every process must make them equally often.
  Status AllReduce(uint32_t stream, const std::vector<int>& group,
                   std::vector<ReduceRequest>& requests);

  // A server-only process (rank >= CommConfig::workers; served.cc): sums the
  // parts that the workers place here and sends the sums back, until every
  // worker has left (Ok) or the communicator broke (its error). Blocks; after
  // Connect.
  Status Serve();
  // A server-only process whose process is gone (its rendezvous connection
  // to rank 0 closed: killed or exited): its sums will never come, so every
  // reduction fails now, naming it, and the other ranks are told. Ignored
  // once this process leaves (a server also ends when every worker has).
  void ServerGone(int rank, const std::string& how);

  // This process is failing (its program raised): breaks the communicator,
  // fails what is in flight and tells every other rank `why`, waiting up to
  // `wait_s` until each has printed it (kAbortSeen; the process exits next).
  // Where this rank failed before and owes that abort, awaits that one.
  void Abort(const std::string& why, double wait_s);
  // The first fatal error ("" while the communicator works).
  std::string Broken();
  // Where in the user's program the reduction of `key` (the first buffer's)
  // at `slot` was written, for stall reports and errors (this process only).
  void NoteCallSite(uint64_t key, uint32_t slot, const std::string& site);

  int rank() const { return config_.rank; }
  int size() const { return config_.size; }
  const CommConfig& config() const { return config_; }
  std::string Describe() const;
  CommStats Stats() const;
  BufferPool& pool() { return pool_; }

 private:
  explicit Communicator(const CommConfig& config);

  // The identities of a call's requests: one occurrence per (run, stream,
  // group, slot, instance), shared by the buffers of the call.
  std::vector<Identity> TakeIdentities(uint32_t stream, const std::vector<int>& group,
                                       const std::vector<ReduceRequest>& requests);
  const GroupPlan& PlanFor(const std::vector<int>& group);
  // The sharded parameter-server reduction (data_path.cc) over `order`: the
  // group's processes in summation order (server i is order[i]). For each
  // request whose `served` flag is set (ServedFlags; none if empty) the
  // server-only processes follow them as owners of parts of its buffer.
  Status ReduceFlat(uint32_t stream, const std::vector<int>& order,
                    const std::vector<ReduceRequest>& requests,
                    const std::vector<Identity>& ids, const std::vector<bool>& served = {});
  // Server-only processes (served.cc). How many there are; whether a call
  // over `group` places parts on them (every worker); and whether a
  // request does (an all-reduce without a codec, of at least
  // CommConfig::server_min_bytes).
  int ServerCount() const;
  bool ServersServe(const std::vector<int>& group) const;
  bool ServedJob(const ReduceRequest& r) const;
  // Per request of a call over `group`, whether its buffer goes through
  // them (the host stage asks with its whole buffers, then reduces slices).
  std::vector<bool> ServedFlags(const std::vector<int>& group,
                                const std::vector<ReduceRequest>& requests) const;
  // Their side: a receive into slot `slot` (any worker, any reduction); its
  // completion; the contribution it brought, kept until every worker's is
  // here, then summed and sent back.
  void PostServedRecv(size_t slot);
  void OnServed(size_t slot, const transport::Completion& c);
  void TakeServed(size_t slot, const transport::Completion& c);
  // Why a message received as kServed is not one ("" if it is).
  std::string CheckServed(const WireHeader& h, const transport::Completion& c) const;
  void PassOnGathered(ServedChunk chunk, const ServedGroup& group);
  void SendServedResult(std::shared_ptr<ServedResult> result, const std::vector<int>& ranks,
                        int only, int skip);
  void ServedCounts(uint64_t* chunks, uint64_t* bytes) const;
  // "rank R", or "server rank R" for a server-only process, for errors.
  std::string RankText(int rank) const;
  // The hierarchical reduction (host_stage.cc): through memory inside the
  // host, each process's slice across hosts with ReduceFlat, then the slices
  // gathered through memory.
  Status ReduceInHosts(uint32_t stream, const GroupPlan& plan,
                       const std::vector<ReduceRequest>& requests,
                       const std::vector<Identity>& ids);
  // Its steps after the arrive (2-5); false once the call failed (timed_out:
  // by its deadline).
  bool RunHostSteps(Batch* batch, uint32_t stream, const GroupPlan& plan,
                    const std::vector<ReduceRequest>& requests, const std::vector<Identity>& ids,
                    bool* timed_out);
  // Step 2's pieces, shared by both paths (host_stage.cc): the devices the
  // host's processes count together in buffer k (an error past
  // kMaxContributors), and `bytes` at byte `at` of every other process's input
  // k read into `pieces` (kHostPieceBytes apart), `own` standing for this
  // process's, as `srcs` for the sum.
  Status HostContributors(Batch* batch, size_t k, uint64_t* total);
  Status ReadInputPiece(Batch* batch, size_t k, size_t at, size_t bytes, const void* own,
                        char* pieces, std::vector<const void*>* srcs);
  // The direct path's steps after the arrive (host_stage.cc), likewise.
  bool RunHostDirect(Batch* batch, const std::vector<ReduceRequest>& requests,
                     bool* timed_out);
  // Where a call's inputs are published and withdrawn (host_posting.cc): its
  // staging, arrive entries and board posting; whether every input this
  // process read is still its owner's (an error naming the one withdrawn);
  // and a failed call's end: withdraws its inputs (WithdrawHost), keeps its
  // staging, EndFailed.
  Status PrepareHostCall(Batch* batch, const GroupPlan& plan,
                         const std::vector<ReduceRequest>& requests,
                         const std::vector<size_t>& slice_bytes);
  Status CheckInputsStillPosted(Batch* batch);
  Status EndHostCall(std::unique_ptr<Batch> batch, const std::vector<ReduceRequest>& requests,
                     bool timed_out);
  // Before a failed call returns (and XLA frees its inputs): on the boards,
  // marks its posting withdrawn; as messages, sends every local peer a
  // withdrawal and waits until each has said it is done reading or has exited
  // (up to HERRING_TIMEOUT_S for a peer that has arrived in the call, 1 s,
  // kArriveGrace, for one that has not).
  void WithdrawHost(Batch* batch);
  // Host-stage messages (host_stage.cc).
  void PostHostRecv(Batch* batch, int step, int peer);
  void OnHostMessage(Batch* batch, int step, int peer, const transport::Completion& c);
  void SendHost(Batch* batch, int step, int peer);
  // Waits until every local peer's message of `step` arrived (or the batch
  // failed, or timeout_s passed: false).
  bool WaitHost(Batch* batch, int step);
  // The same steps through the host boards (host_board.h): publishes this
  // process's entries of `step`; waits for every peer's (as WaitHost); waits
  // for a peer not in `have` to publish `step` (any of them, in the order
  // they do) and returns it, or -1 once the batch failed or `deadline` passed
  // (`timed_out`).
  void PublishHost(Batch* batch, int step);
  bool WaitBoard(Batch* batch, int step);
  int NextPosted(Batch* batch, int step, const std::vector<bool>& have,
                 std::chrono::steady_clock::time_point deadline, bool* timed_out);
  // Whether a peer's board entries of `step` match this call; false and the
  // batch failed (with every rank told) where they do not.
  bool CheckHostEntries(Batch* batch, int step, int q, const std::vector<HostEntry>& entries);
  // Reads peer `q`'s slices of the result (its kHostReady entries) into the
  // outputs, then tells it.
  Status GatherFrom(Batch* batch, int q, const std::vector<ReduceRequest>& requests);
  // The error of a failed read of local peer `q`'s memory (`what`: whose
  // buffer, `s`: the read's error). When q has exited, another process of
  // the host usually caused it and q's abort, naming the cause, may be on its
  // way: waits up to a second for the batch to fail by it (the first error
  // stays), and names every process of the host that has exited.
  Status HostReadFailed(Batch* batch, int q, const std::string& what, const Status& s);
  // The processes of this host (other than this one) that have exited, as
  // "; processes of this host that have exited: rank 2, ..." ("" if none).
  std::string ExitedHostPeers(const HostWait& w) const;
  // A failed call's error when local peer `rank` withdrew from the host
  // stage: the withdrawal says nothing of its cause, so it names the host's
  // processes that have exited (usually the cause, seen by the withdrawing
  // process first).
  std::string WithdrawnText(const HostWait& w, int rank, const std::string& describe) const;
  // A successful host-stage call returns before the other processes have
  // said that they read its slice: its batch (staging buffers, posted
  // receives of kHostDone) lingers until then. Linger frees the lingering
  // batches that have finished and adds `batch`.
  void Linger(std::unique_ptr<Batch> batch);
  // Frees the lingering batches that have finished (lingering_mu_ held).
  void SweepLingering();
  // Whether no other process can read `batch`'s staging any more: each has
  // said it read it (kHostDone) or has exited. False once a receive of
  // kHostDone was cancelled (the batch failed): the reader may still be at it.
  bool SlicesRead(const Batch& batch) const;
  // Before shutdown: waits (up to timeout_s) until every lingering batch's
  // slices are read (SlicesRead, or the batch failed); says so on stderr when
  // that takes over a few seconds. Does not wait once the communicator is
  // broken. Returns how many were still waited for.
  size_t DrainLingering();
  std::chrono::steady_clock::time_point Deadline() const;  // now + timeout_s
  // Batches in flight are visible to aborts, the peer watch and heartbeats.
  // Activate fails the batch (false) where the communicator broke after the
  // caller's own check: an abort's sweep (FailAll) may have run before the
  // batch was there to fail.
  bool Activate(Batch* batch);
  void Deactivate(Batch* batch);
  // After a batch failed (or `timed_out`): reports, cancels receives, waits
  // until nothing references the batch, frees it (or keeps it when its
  // operations never drain); returns its error.
  Status EndFailed(std::unique_ptr<Batch> batch, bool timed_out);
  // Fails `batch` with the timeout's error: what it waits for, and from whom.
  void FailTimedOut(Batch* batch);
  // Tests: whether CommConfig::test_fault (comma-separated names) holds
  // `name` and it has not fired yet (then it fires: once per communicator).
  bool TestFault(const char* name);
  bool FaultFired(const char* name) const;
  // `name`'s place in CommConfig::test_fault, or -1.
  int FaultIndex(const char* name) const;

  Status PostJob(Batch* batch, Job* job);
  Status SendJob(Batch* batch, Job* job);
  // Control plane: a failing rank tells every other rank at once, so that
  // nobody waits for HERRING_TIMEOUT_S on a job that cannot finish.
  void PostControlRecv(size_t slot);
  void OnControl(size_t slot, const transport::Completion& c);
  void BroadcastAbort(const std::string& why);
  // Departures (departures.cc). Sends `kind` with `text` to `peers`, best
  // effort (a busy queue is retried until `wait_s` has passed), and waits up
  // to `wait_s` for the sends to complete; logs what failed if `report`.
  void TellPeers(MsgKind kind, const std::string& text, const std::vector<int>& peers,
                 double wait_s, bool report);
  std::vector<int> AllPeers() const;
  // A notice from `sender` (kLeave, kStall, kReceipt, kAbortSeen; `header`
  // and its payload `text`) arrived.
  void OnNotice(MsgKind kind, uint32_t sender, const WireHeader& header,
                const std::string& text);
  // The leave protocol (leave_ledger.h), run by the destructor once every
  // reduction of this rank has ended: tells every peer (kLeave with the
  // counts) and waits, up to timeout_s, until each has confirmed that it
  // took in every data message of this rank, or exited, failed, went silent
  // or closed its endpoint; says on stderr whom it waits for after a few
  // seconds. Progress, server and watch threads keep running meanwhile.
  void Leave();
  // Sends `peer` a control message of `kind` (kLeave, kReceipt) whose header
  // carries `occurrence` and `total_elems`; not waited for.
  void SendCount(MsgKind kind, int peer, uint64_t occurrence, uint64_t total_elems);
  // Sends `peer` its kReceipt if it left and all its data is here (once).
  void SendReceiptIfDue(int peer);
  // Whether the leave waits no longer for `peer` (see Leave).
  bool LeaveReleased(int peer);
  // A data message from `peer` was taken in (after the batch counted it).
  void TookFrom(int peer);
  // The error of a batch that waits for `rank`, which has left without
  // sending it anything more.
  std::string LeftText(const Batch& batch, int rank) const;
  // Fails the batches that still wait for a rank that has shut down.
  void WatchLeavers();
  // Tells the ranks that the oldest batch waits for where it waits (kStall),
  // and reports (once each) the batches that have waited longer than stall_s.
  void ReportStalls();
  // Fails (telling every peer) each batch that can never pair: it has waited
  // a few seconds, and every rank it waits for has waited a while too, alive,
  // in this same call under another compiled program (the program identity
  // tells: a far other run id). A batch of another size on one rank does
  // this; without it the job would wait for HERRING_TIMEOUT_S.
  void FailMismatchedPrograms();
  // Whether each of `ranks` waits, by its last heartbeat, in `job`'s call
  // under another compiled program (see FailMismatchedPrograms).
  bool InOtherPrograms(const Job& job, const std::set<int>& ranks, int64_t now) const;
  // Whether the stall report of a batch missing `ranks` can name where each
  // of them waits: none waits (as its heartbeat says) in a reduction whose
  // kStall has not arrived.
  bool SitesKnown(const std::set<int>& ranks) const;
  // After Abort's kAbort: waits until every peer has answered kAbortSeen,
  // has exited, left or is silent, or until `deadline`.
  void AwaitAbortSeen(std::chrono::steady_clock::time_point deadline);
  // A rank that failed and owes its peers the abort (abort_owed_), at its
  // exit: sends the abort if a server thread has not yet, and keeps the
  // endpoint open (at most `wait_s`) until every peer has acknowledged it,
  // so that no peer meets the closed connection before the reason.
  void AwaitOwnAbortTold(double wait_s);
  // How long a failed rank's exit waits at most for its peers' kAbortSeen.
  double AbortToldWaitS() const;
  // A send to or receive from `peer` of `batch` failed in the transport (a
  // reset connection, say): `why`. Where the peer itself failed, its abort
  // is on its way and names the cause that the transport's error hides, so
  // the batch fails with the first of that abort (within a grace) or `why`;
  // then the operation is counted complete. On a server thread.
  void FailOnTransportError(Batch* batch, std::string why);
  // A receive of `batch` from `from` failed (`why`): the batch fails naming
  // the cause (a rank that left, else FailOnTransportError), the receive
  // counted complete.
  void FailReceive(Batch* batch, int from, const std::string& why);
  // "float32[1000] sum (key ...; run ...) at train.py:42 (step)".
  std::string DescribeJob(const Job& job) const;
  // Whether a control message whose tag and header name `sender` came from
  // that rank's address (or the provider does not say); `why` if not.
  static bool FromSender(const transport::Completion& c, uint32_t sender, std::string* why);
  // A message that failed its header check: counted, logged (the first 10),
  // and its receive posted again.
  void CountDropped(const std::string& why);
  void DropAndRepost(Batch* batch, const std::string& why, std::function<void()> repost);
  // The header check of a completed data receive: true if the message is the
  // one expected; otherwise fails the batch (collision, mismatch) or drops the
  // message and re-posts the receive, and completes the receive's work.
  bool AcceptHeader(Batch* batch, const WireHeader& h, size_t len, const Expectation& want,
                    std::function<void()> repost);
  // Tests (test_faults.cc): sends `header` (another job's token) and
  // header.payload_bytes of garbage to `to_rank` with `tag`.
  void SendStranger(Batch* batch, int to_rank, uint64_t tag, const WireHeader& header);
  // Tests (CommConfig::test_stale_copies): sends a stale copy of `real`.
  void SendStaleCopy(Batch* batch, int to_rank, uint64_t tag, const WireHeader& real);
  // Tests (CommConfig::test_early_strangers): sends peer p a stranger for each
  // result chunk of this process's part.
  void SendEarlyStrangers(Job* job, int p);
  // Tests (CommConfig::test_forge_as): the forged abort and arrives of a
  // host-stage call set up (PrepareHostCall) and not yet published.
  void SendForgeries(Batch* batch);
  void SendForged(Batch* batch, int to_rank, uint64_t tag, const WireHeader& header,
                  const void* payload);
  // Liveness (see CommConfig::heartbeat_s).
  void PostHeartbeatRecv(size_t slot);
  void OnHeartbeat(size_t slot, const transport::Completion& c);
  void Heard(uint32_t rank);
  // The watch thread: heartbeats and the peer watch (where heartbeats are
  // on), departures and stall reports, every heartbeat_s (1 s without them).
  void WatchLoop();
  void SendHeartbeats();
  void WatchPeers();
  void PostContributionRecv(Job* job, int peer_index, size_t chunk);
  void PostResultRecv(Job* job, int part, size_t chunk);
  // What a message from `from_rank` for `part`, `chunk` of `job` must say.
  Expectation Expect(const Job& job, MsgKind kind, int from_rank, int part, size_t chunk) const;
  void OnContribution(Job* job, int peer_index, size_t chunk, const transport::Completion& c);
  void OnResult(Job* job, int part, size_t chunk, const transport::Completion& c);
  void ReduceChunk(Job* job, size_t chunk);
  void SendDone(Job* job, int to_rank, const transport::Completion& c);
  // Sends chunk c of this server's part (`payload`, `bytes`, out_hdrs[c]
  // as its header) to the process at position p of the group.
  void SendResult(Job* job, int p, size_t c, const void* payload, size_t bytes);
  void SetServedGroup(const Job* job, WireHeader* h) const;
  Status SendPart(Job* job, int i, size_t c, MsgKind kind, WireHeader* h, const char* data,
                  size_t len);
  Status SendGatherShares(Job* job);
  // Fails the batch; the first failure of this process also breaks the
  // communicator and (with `tell_peers`) is broadcast to every other rank.
  void Fail(Batch* batch, const std::string& why, bool tell_peers = true);
  // Breaks the communicator and fails every batch in flight with `why`.
  void FailAll(const std::string& why, bool tell_peers);
  // Records `why` as the communicator's failure unless it failed before;
  // returns the first failure, which is what the peers are told.
  std::string FirstFailure(const std::string& why);
  // Shutting down (the destructor runs): failures of background posts are
  // expected then, not errors.
  bool ShuttingDown();
  void Enqueue(std::function<void()> task);
  void ServerLoop();
  std::string MissingReport(const Batch& batch) const;
  // The ranks `batch` still lacks contributions or results from.
  static std::set<int> MissingRanks(const Batch& batch);
  // What this rank waits for longest (empty if nothing); fills `h`'s wait
  // fields for a heartbeat when given.
  std::string OldestWait(WireHeader* h = nullptr);
  // For error messages: whether each rank is alive and what it waits for,
  // as its heartbeats said.
  std::string PeerReport(const std::set<int>& ranks) const;
  // What the missing ranks' waits say of why `job` stalls (empty: nothing):
  // a rank in another run of the same call runs another executable of the
  // program, or is at another launch of it. Takes peer_wait_mu_.
  std::string Verdict(const Job& job, const std::set<int>& missing) const;

  CommConfig config_;
  std::unique_ptr<transport::Transport> transport_;
  BufferPool pool_;
  std::atomic<bool> connected_{false};

  HostTopology topology_;  // set before Connect, read-only afterwards
  std::unique_ptr<HostBoard> board_;  // created with the communicator
  std::mutex plans_mu_;
  std::map<std::vector<int>, GroupPlan> plans_;  // per group (groups are few)
  // Result slices of failed host-stage calls: other processes of the host may
  // still read them (they know the address), so they are never reused while
  // this communicator lives. After pool_: destroyed before it.
  std::mutex kept_mu_;
  std::vector<PooledBuffer> kept_staging_;
  // Host-stage batches that returned and wait for kHostDone (Linger). After
  // pool_ and transport_: destroyed once Shutdown has run their callbacks.
  std::mutex lingering_mu_;
  std::vector<std::unique_ptr<Batch>> lingering_;

  // Occurrences: how often each (run, stream, group, slot, instance) was
  // reduced before. Not keyed by the request's key, which stays a checked
  // description: a peer reducing something else under the same identity is
  // then reported as a mismatch instead of waiting on a counter of its own.
  // Forgets entries idle for kOccurrenceIdleFactor x timeout_s
  // (occurrences_mu_ held); see the definition for why that is safe.
  void PruneOccurrences(int64_t now_ns);
  mutable std::mutex occurrences_mu_;
  OccurrenceTable occurrences_;
  std::map<std::vector<int>, uint32_t> group_ids_;  // groups seen, numbered
  int64_t last_prune_ns_ = 0;

  // The first fatal error; afterwards every call fails with it, because
  // messages of the failed reduction may still be in flight.
  std::mutex broken_mu_;
  std::string broken_;

  // Batches in flight, failed all at once when a peer aborts.
  mutable std::mutex active_mu_;
  std::set<Batch*> active_;

  static constexpr size_t kControlRecvs = 2;
  static constexpr size_t kAbortTextBytes = 2048;
  struct ControlBuffer {
    WireHeader header;
    char text[kAbortTextBytes];
  };
  std::vector<ControlBuffer> control_;  // posted receives
  std::once_flag abort_once_;  // a rank broadcasts one abort
  // This rank failed and tells every peer (BroadcastAbort queued or sent):
  // its exit waits for their kAbortSeen (AwaitOwnAbortTold).
  std::atomic<bool> abort_owed_{false};
  // A peer's abort broke the communicator: its message names the cause, and
  // this rank's own view of the batches it failed is no news.
  std::atomic<bool> told_by_peer_{false};
  // [rank] it has printed this rank's abort (kAbortSeen); AwaitAbortSeen is
  // woken through leave_cv_.
  std::unique_ptr<std::atomic<bool>[]> abort_seen_;
  // [rank] a server-only process whose process is gone (ServerGone): no
  // message to it can arrive, nor an answer come.
  std::unique_ptr<std::atomic<bool>[]> gone_;
  // The leave protocol's counts (leave_ledger.h); leaving_ once Leave runs,
  // leave_cv_ woken by the notices and failed sends it waits for.
  LeaveLedger ledger_;
  std::atomic<bool> leaving_{false};
  std::mutex leave_mu_;
  std::condition_variable leave_cv_;
  mutable std::mutex call_sites_mu_;
  std::map<std::pair<uint64_t, uint32_t>, std::string> call_sites_;  // (key, slot)

  std::vector<WireHeader> heartbeat_in_;  // [sender] posted receives
  std::vector<WireHeader> heartbeat_out_;  // [rank] rewritten only when not busy
  // Heartbeats scale with what reductions need (see SendHeartbeats): [rank]
  // steady_clock nanoseconds of the last heartbeat sent to it, and until when
  // it asked for heartbeats at the full rate (it waits in a reduction).
  // [rank] what its last heartbeat said it waits for (empty: nothing).
  struct PeerWait {
    std::string what;
    double seconds = 0;
    int64_t run_id = 0;   // of what it waits in (its program's executable)
    uint64_t key = 0;     // and the rest of that call's identity
    uint32_t slot = 0, instance = 0;
    // What it said it waits in (kStall): the reduction's description with
    // its call site; kept while it still waits (SiteMatches).
    std::string site;
  };
  // Whether `wait.site` is about the reduction its heartbeat says it waits
  // in: the site contains the "(key K; run R, ...)" part of `wait.what` (the
  // rest of the two descriptions may differ: a heartbeat does not say which
  // collective a reduction serves).
  static bool SiteMatches(const PeerWait& wait);
  mutable std::mutex peer_wait_mu_;
  std::vector<PeerWait> peer_wait_;
  // [rank] steady_clock nanoseconds of the last valid message from it.
  std::unique_ptr<std::atomic<int64_t>[]> last_heard_;
  // [rank] a heartbeat to it is still in flight: send no other.
  std::unique_ptr<std::atomic<bool>[]> heartbeat_busy_;
  std::unique_ptr<std::atomic<int64_t>[]> last_sent_;
  std::unique_ptr<std::atomic<int64_t>[]> waiter_until_;
  std::mutex heartbeat_mu_;
  std::condition_variable heartbeat_cv_;
  bool heartbeat_stop_ = false;
  std::thread heartbeat_;  // the watch thread (WatchLoop)

  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::vector<std::thread> servers_;

  std::atomic<uint64_t> reductions_{0};
  std::atomic<uint64_t> bytes_reduced_{0};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<uint64_t> heartbeats_{0};
  std::atomic<uint64_t> declared_dead_{0};
  std::atomic<uint64_t> heartbeats_sent_{0};
  std::atomic<uint64_t> leave_notices_sent_{0};
  std::atomic<uint64_t> wait_notices_sent_{0};
  std::atomic<uint64_t> kept_batches_{0};
  std::atomic<uint64_t> host_calls_{0};
  std::atomic<uint64_t> host_direct_calls_{0};
  std::atomic<uint64_t> host_bytes_read_{0};
  std::atomic<uint32_t> fault_fired_{0};  // bit i: test_fault's i-th name fired
  std::atomic<bool> forged_{false};
  std::atomic<uint64_t> served_jobs_{0};
  // A server-only process's receives and the chunks it is summing (Serve).
  // Destroyed after the destructor's body, which shuts the transport down:
  // the callbacks of its cancelled receives still find it.
  std::unique_ptr<ServedState> served_;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_COMMUNICATOR_H_
