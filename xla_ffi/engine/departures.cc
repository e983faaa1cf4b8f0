// How ranks leave a job and what the others make of it: the abort of a
// program that fails (an uncaught exception: Abort), the leave protocol of an
// orderly shutdown (kLeave and kReceipt with the counts of leave_ledger.h:
// Leave, OnNotice, WatchLeavers), and the stall report of a reduction that
// waits too long (printed here; the ranks it waits for are told where it
// waits as kStall beforehand, so that every rank's report and error can name
// both ends). Where each reduction was written in the user's program
// (NoteCallSite) goes into these texts.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"

namespace herring::engine {

namespace {

// Seconds a host-stage call may still miss the step of a local process that
// has left before it fails. The host stage's steps are not counted
// (leave_ledger.h): through the boards they are in memory before the kLeave
// is sent, and the waiting call only has to look; as messages they may be
// overtaken by it where the provider does not order messages.
constexpr double kHostLeaveGraceS = 2.0;

// A leaving rank says whom it still waits for after this many seconds, and
// again every kLeaveReportEveryS.
constexpr double kLeaveReportS = 5.0;
constexpr double kLeaveReportEveryS = 30.0;

// A reduction that has waited this long (or HERRING_STALL_S, if shorter)
// tells the ranks it waits for where it waits (kStall). Reductions rarely
// wait this long in a healthy job, and then one message per peer is sent.
constexpr double kWaitNoticeS = 1.0;
// How long a stall report may wait beyond HERRING_STALL_S for the call site
// of a rank that waits too (its kStall), so that its first line names both.
constexpr double kStallSiteGraceS = 3.0;
// How long a failed rank's exit waits at most for its peers to acknowledge
// its abort (kAbortSeen); they answer from their progress threads, at once
// unless a process is stopped or its host saturated.
constexpr double kAbortToldWaitS = 10.0;

// One control message and its sends in flight; the callbacks keep it alive.
struct Outgoing {
  WireHeader header;
  std::string text;
  std::mutex mu;
  std::condition_variable cv;
  int pending = 0;
};

std::string Seconds(double s) { return std::to_string(static_cast<int64_t>(s)); }

}  // namespace

std::vector<int> Communicator::AllPeers() const {
  std::vector<int> peers;
  for (int r = 0; r < config_.size; ++r) {
    if (r != config_.rank) peers.push_back(r);
  }
  return peers;
}

void Communicator::TellPeers(MsgKind kind, const std::string& text,
                             const std::vector<int>& peers, double wait_s, bool report) {
  // (Abort, kLeave and kStall texts share the abort's receive buffers.)
  auto msg = std::make_shared<Outgoing>();
  msg->text = text.substr(0, kAbortTextBytes);
  msg->header = ControlHeader(kind, config_.token, config_.rank);
  msg->header.payload_bytes = msg->text.size();
  SealHeader(&msg->header);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(wait_s));
  const int rank = config_.rank;
  for (int peer : peers) {
    transport::IoVec iov[2] = {{&msg->header, sizeof(WireHeader)},
                               {msg->text.data(), msg->text.size()}};
    auto done = [msg, rank, peer, report](const transport::Completion& c) {
      if (!c.ok && report) {
        std::fprintf(stderr, "herring_jax rank %d: could not tell rank %d of the failure: %s\n",
                     rank, peer, c.error.c_str());
      }
      std::lock_guard<std::mutex> lock(msg->mu);
      --msg->pending;
      msg->cv.notify_all();
    };
    {
      std::lock_guard<std::mutex> lock(msg->mu);
      ++msg->pending;
    }
    // Queued where the provider is busy or the peer not yet connected, also
    // after a failure (SendControl); a dead peer's send gives up after the
    // post timeout, and nothing below waits past `wait_s`.
    Status s = transport_->SendControl(peer, MakeControlTag(static_cast<uint32_t>(rank)), iov,
                                       msg->text.empty() ? 1 : 2, done);
    if (!s.ok()) {
      {
        std::lock_guard<std::mutex> lock(msg->mu);
        --msg->pending;
      }
      if (report) {
        std::fprintf(stderr, "herring_jax rank %d: could not tell rank %d of the failure: %s\n",
                     rank, peer, s.message().c_str());
      }
    }
  }
  std::unique_lock<std::mutex> lock(msg->mu);
  msg->cv.wait_until(lock, deadline, [&] { return msg->pending == 0; });
}

void Communicator::Abort(const std::string& why, double wait_s) {
  const std::string mine = "rank " + std::to_string(config_.rank) + " failed: " + why;
  bool broken_before;
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    broken_before = !broken_.empty();
    if (!broken_before) broken_ = mine;
  }
  if (broken_before) {
    // Broken before (a peer failed, or this rank did): every rank has been
    // told of that failure already, and this one is its consequence. Where
    // this rank's own failure is told from a server thread (abort_owed_),
    // that may not have happened yet: the process ends next (a fast exit
    // skips Leave), so it waits here, as Leave would, for the peers'
    // kAbortSeen.
    if (abort_owed_ && connected_ && config_.size >= 2) AwaitOwnAbortTold(wait_s);
    return;
  }
  transport_->StopWaiting();
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (Batch* batch : active_) Fail(batch, mine, /*tell_peers=*/false);
  }
  if (!connected_ || config_.size < 2) return;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(wait_s));
  // The peers prefix "rank R failed: " themselves. Once per rank: where this
  // rank has failed before, every peer has been told of that already.
  std::call_once(abort_once_, [&] {
    TellPeers(MsgKind::kAbort, why, AllPeers(), wait_s, true);
    AwaitAbortSeen(deadline);
  });
}

void Communicator::AwaitAbortSeen(std::chrono::steady_clock::time_point deadline) {
  const double limit = std::min(config_.peer_timeout_s, config_.timeout_s);
  std::unique_lock<std::mutex> lock(leave_mu_);
  for (;;) {
    bool all = true;
    const int64_t now = NowNs();
    for (int peer : AllPeers()) {
      if (abort_seen_[peer].load()) continue;
      // It ran every reduction and shut down: nothing of it waits for a reason.
      // Or a server-only process whose process is gone (ServerGone).
      if (ledger_.Left(peer) || gone_[peer].load()) continue;
      // Nobody to print it: dead by the peer watch's measure, or its process
      // on this host has exited.
      if (config_.heartbeat_s > 0 && (now - last_heard_[peer].load()) * 1e-9 > limit) continue;
      if (!topology_.empty() && topology_.host_of[peer] == topology_.host_of[config_.rank] &&
          ProcessExited(topology_.pid_of[peer])) {
        continue;
      }
      all = false;
      break;
    }
    if (all || std::chrono::steady_clock::now() >= deadline) return;
    leave_cv_.wait_until(lock, std::min(deadline, std::chrono::steady_clock::now() +
                                                      std::chrono::milliseconds(50)));
  }
}

double Communicator::AbortToldWaitS() const {
  return std::min(config_.timeout_s, kAbortToldWaitS);
}

void Communicator::AwaitOwnAbortTold(double wait_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(wait_s));
  // Blocks while a server thread sends it; sends it here if none has yet.
  BroadcastAbort(Broken());
  AwaitAbortSeen(deadline);
}

std::string Communicator::Broken() {
  std::lock_guard<std::mutex> lock(broken_mu_);
  return broken_;
}

void Communicator::OnNotice(MsgKind kind, uint32_t sender, const WireHeader& header,
                            const std::string& text) {
  if (kind == MsgKind::kLeave || kind == MsgKind::kReceipt) {
    if (kind == MsgKind::kLeave) {
      ledger_.PeerLeft(static_cast<int>(sender), header.occurrence, header.total_elems, NowNs());
      // On a server thread: this runs on the progress thread, which never
      // posts itself.
      Enqueue([this, sender] { SendReceiptIfDue(static_cast<int>(sender)); });
    } else {
      ledger_.Receipt(static_cast<int>(sender), header.total_elems);
    }
    { std::lock_guard<std::mutex> lock(leave_mu_); }
    leave_cv_.notify_all();
    return;
  }
  if (kind == MsgKind::kAbortSeen) {
    abort_seen_[sender] = true;
    { std::lock_guard<std::mutex> lock(leave_mu_); }
    leave_cv_.notify_all();
    return;
  }
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  peer_wait_[sender].site = text;
}

void Communicator::TookFrom(int peer) {
  ledger_.Took(peer);
  if (ledger_.Left(peer)) Enqueue([this, peer] { SendReceiptIfDue(peer); });
}

void Communicator::SendReceiptIfDue(int peer) {
  if (ledger_.TakeReceiptDue(peer)) SendCount(MsgKind::kReceipt, peer, 0, ledger_.took(peer));
}

void Communicator::SendCount(MsgKind kind, int peer, uint64_t occurrence, uint64_t total_elems) {
  auto header = std::make_shared<WireHeader>(ControlHeader(kind, config_.token, config_.rank));
  header->occurrence = occurrence;
  header->total_elems = total_elems;
  SealHeader(header.get());
  transport::IoVec iov[1] = {{header.get(), sizeof(WireHeader)}};
  // SendControl: queued if need be, also to a peer never sent to before. A
  // send that fails while this rank leaves means the peer's endpoint is gone.
  Status s = transport_->SendControl(
      peer, MakeControlTag(static_cast<uint32_t>(config_.rank)), iov, 1,
      [this, header, peer](const transport::Completion& c) {
        if (c.ok || !leaving_) return;
        ledger_.MarkGone(peer);
        { std::lock_guard<std::mutex> lock(leave_mu_); }
        leave_cv_.notify_all();
      });
  if (s.ok()) {
    leave_notices_sent_.fetch_add(1);
  } else if (leaving_) {
    ledger_.MarkGone(peer);
  }
}

bool Communicator::LeaveReleased(int peer) {
  if (ledger_.Released(peer)) return true;
  bool released = ledger_.Confirmed(peer) || ledger_.Gone(peer);
  if (!released && config_.heartbeat_s > 0) {
    // Dead by the peer watch's measure.
    const double limit = std::min(config_.peer_timeout_s, config_.timeout_s);
    released = (NowNs() - last_heard_[peer].load()) * 1e-9 > limit;
  }
  if (!released && !topology_.empty() &&
      topology_.host_of[peer] == topology_.host_of[config_.rank]) {
    released = ProcessExited(topology_.pid_of[peer]);
  }
  if (released) ledger_.MarkReleased(peer);
  return released;
}

// Why the last message cannot be lost. A rank closes its endpoint only once
// every peer has confirmed, with counts, that it took in every data message
// the rank sent it (or is gone): what the close may still drop (a reset
// connection discards the unsent bytes) is control messages alone. Those are
// not needed either: a peer that is sent a receipt already counts as
// confirmed by the leaver's kLeave, which its receipt answered; and a peer
// that misses a kLeave stops waiting once the leaver's process has exited
// (same host), a send to it fails (its endpoint is gone) or it falls silent.
void Communicator::Leave() {
  if (!connected_ || config_.size < 2) return;
  if (!Broken().empty()) {
    // A failure has been told to every rank, or is being told by this one:
    // then its peers hear the reason before they meet the closed endpoint
    // (a reset connection would otherwise be all a peer could report).
    if (abort_owed_) AwaitOwnAbortTold(AbortToldWaitS());
    return;
  }
  leaving_ = true;
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int> peers = AllPeers();
  // Every data send of this rank has completed (its batches have ended), so
  // the counts are final. Not to a peer that left before and has this rank's
  // receipt (its counts are final too, and it may have closed its endpoint:
  // a send would only try to connect).
  for (int peer : peers) {
    if (ledger_.ReceiptSent(peer) && ledger_.Confirmed(peer)) continue;
    SendCount(MsgKind::kLeave, peer, ledger_.sent(peer), ledger_.took(peer));
  }
  const auto deadline = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                    std::chrono::duration<double>(config_.timeout_s));
  auto report_at = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                               std::chrono::duration<double>(kLeaveReportS));
  for (;;) {
    std::vector<int> waiting;
    // A failure anywhere has been told to every rank: nothing is worth waiting for.
    if (!Broken().empty()) break;
    for (int peer : peers) {
      if (!LeaveReleased(peer)) waiting.push_back(peer);
    }
    if (waiting.empty()) break;
    const auto now = std::chrono::steady_clock::now();
    const double waited = std::chrono::duration<double>(now - start).count();
    std::string who;
    for (int peer : waiting) {
      who += (who.empty() ? "" : ", ") + std::to_string(peer) +
             (ledger_.Left(peer) ? " (has left)" : " (still running)");
    }
    if (now >= deadline) {
      std::fprintf(stderr, "herring_jax rank %d: exits although rank(s) %s did not confirm "
                   "within HERRING_TIMEOUT_S=%s s that they received its last messages: a "
                   "reduction of theirs may fail\n", config_.rank, who.c_str(),
                   Seconds(config_.timeout_s).c_str());
      break;
    }
    if (now >= report_at) {
      std::fprintf(stderr, "herring_jax rank %d: exiting; has waited %s s for rank(s) %s to "
                   "receive its last messages (it stops waiting for a rank that confirms, "
                   "fails, exits or is silent for HERRING_PEER_TIMEOUT_S, and after "
                   "HERRING_TIMEOUT_S=%s s in all)\n", config_.rank, Seconds(waited).c_str(),
                   who.c_str(), Seconds(config_.timeout_s).c_str());
      std::fflush(stderr);
      report_at = now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(kLeaveReportEveryS));
    }
    // Woken by receipts, kLeaves and failed sends; the tick re-checks the
    // peer watch and exited processes.
    std::unique_lock<std::mutex> lock(leave_mu_);
    leave_cv_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(100)));
  }
}

std::string Communicator::LeftText(const Batch& batch, int rank) const {
  return "rank " + std::to_string(rank) + " has shut down herring_jax (its "
         "herring_jax.shutdown() or the end of its program) while rank " +
         std::to_string(config_.rank) + " still waits for it in " +
         DescribeJob(*batch.jobs.front()) + ": every process must run the same reductions, "
         "as many times, before it shuts down (did its training loop run fewer steps, or "
         "leave it early?)";
}

void Communicator::WatchLeavers() {
  const int64_t now = NowNs();
  // First whose data is all here, then the batches: a message counted here
  // has been counted by its batch before (TookFrom), so a batch that misses a
  // rank whose data is all here will never get it.
  std::vector<bool> arrived(config_.size, false);
  for (int r = 0; r < config_.size; ++r) {
    if (r != config_.rank) arrived[r] = ledger_.AllArrived(r);
  }
  std::lock_guard<std::mutex> lock(active_mu_);
  for (Batch* batch : active_) {
    if (batch->Failed()) continue;
    for (int rank : MissingRanks(*batch)) {
      if (!ledger_.Left(rank)) continue;
      if (batch->host) {
        const int64_t since = std::max(ledger_.left_ns(rank), batch->started_ns);
        if ((now - since) * 1e-9 < kHostLeaveGraceS) continue;
      } else if (!arrived[rank]) {
        continue;  // its last messages are on their way
      }
      Fail(batch, LeftText(*batch, rank));
      break;
    }
  }
}

bool Communicator::SitesKnown(const std::set<int>& ranks) const {
  if (!last_heard_ || config_.heartbeat_s <= 0) return true;
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  for (int rank : ranks) {
    if (rank == config_.rank) continue;
    const PeerWait& wait = peer_wait_[rank];
    const bool silent = (now - last_heard_[rank].load()) * 1e-9 > 3 * config_.heartbeat_s + 1;
    if (!silent && !wait.what.empty() && !SiteMatches(wait)) {
      return false;
    }
  }
  return true;
}

void Communicator::ReportStalls() {
  const int64_t now = NowNs();
  struct Stall {
    std::string text;
    std::set<int> missing;
  };
  std::vector<Stall> stalls;
  std::string notice;
  std::vector<int> notice_to;
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    // The oldest batch is what the heartbeats say this rank waits in; its
    // kStall gives the ranks it waits for the call site to go with it, so
    // that their first stall line names where both ends wait.
    Batch* oldest = nullptr;
    for (Batch* batch : active_) {
      if (!batch->Failed() && (oldest == nullptr || batch->started_ns < oldest->started_ns)) {
        oldest = batch;
      }
    }
    const double notice_after_s =
        config_.stall_s > 0 ? std::min(kWaitNoticeS, config_.stall_s) : kWaitNoticeS;
    if (oldest != nullptr && (now - oldest->started_ns) * 1e-9 >= notice_after_s) {
      std::set<int> missing = MissingRanks(*oldest);
      missing.erase(config_.rank);
      if (!missing.empty() && !oldest->wait_noticed.exchange(true)) {
        notice = DescribeJob(*oldest->jobs.front());
        notice_to.assign(missing.begin(), missing.end());
      }
    }
    for (Batch* batch : active_) {
      const double waited = (now - batch->started_ns) * 1e-9;
      if (config_.stall_s <= 0 || waited < config_.stall_s || batch->Failed() ||
          batch->stall_reported.load()) {
        continue;
      }
      const Job& job = *batch->jobs.front();
      Stall stall;
      stall.missing = MissingRanks(*batch);
      // A rank that waits in a reduction whose call site has not arrived yet
      // (it began waiting later than this one) is given a moment to send it.
      if (!SitesKnown(stall.missing) && waited < config_.stall_s + kStallSiteGraceS) continue;
      batch->stall_reported = true;
      const std::string verdict = Verdict(job, stall.missing);
      stall.text = "herring_jax rank " + std::to_string(config_.rank) + ": a reduction has " +
                   "made no progress for " + Seconds(waited) + " s: " + MissingReport(*batch) +
                   verdict + " (reported once after HERRING_STALL_S=" +
                   Seconds(config_.stall_s) + " s; it fails after HERRING_TIMEOUT_S=" +
                   Seconds(config_.timeout_s) + " s)";
      stalls.push_back(std::move(stall));
    }
  }
  if (!notice_to.empty()) {
    wait_notices_sent_.fetch_add(notice_to.size());
    TellPeers(MsgKind::kStall, notice, notice_to, 0.0, false);
  }
  for (const Stall& stall : stalls) {
    std::fprintf(stderr, "%s\n", stall.text.c_str());
    std::fflush(stderr);
  }
}

void Communicator::NoteCallSite(uint64_t key, uint32_t slot, const std::string& site) {
  std::lock_guard<std::mutex> lock(call_sites_mu_);
  // Bounded: a program that lowers ever new reductions keeps the first ones.
  if (call_sites_.size() < 4096) call_sites_[{key, slot}] = site;
}

std::string Communicator::DescribeJob(const Job& job) const {
  std::string site;
  {
    std::lock_guard<std::mutex> lock(call_sites_mu_);
    auto it = call_sites_.find({job.req.key - job.req.buffer, job.id.slot});
    if (it != call_sites_.end()) site = " at " + it->second;
  }
  return job.Describe() + site;
}

}  // namespace herring::engine
