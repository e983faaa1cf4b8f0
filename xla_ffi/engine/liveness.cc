// Liveness: heartbeats between ranks, and the watch that declares a silent
// rank dead when a reduction waits for it (CommConfig::heartbeat_s).
#include "engine/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/batch.h"

namespace herring::engine {

void Communicator::Heard(uint32_t rank) {
  if (rank < static_cast<uint32_t>(config_.size)) last_heard_[rank] = NowNs();
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
      /*background=*/true, /*from=*/static_cast<int>(slot));
  // Without it rank `slot` would look dead to this rank's peer watch: no
  // silent degradation, break now.
  if (!s.ok() && !ShuttingDown()) {
    FailAll("rank " + std::to_string(config_.rank) + " cannot post a heartbeat receive for " +
                "rank " + std::to_string(slot) + ": " + s.message(),
            /*tell_peers=*/true);
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
                           static_cast<uint32_t>(config_.size), &why) &&
        FromSender(c, sender, &why)) {
      heartbeats_.fetch_add(1);
      Heard(sender);
      // A heartbeat also says what its sender waits for (contributors = 1):
      // dtype, count, op, key, identity and seconds (chunk).
      PeerWait wait;
      if (h.contributors == 1) {
        // It waits in a reduction: answer at the full rate for a while.
        waiter_until_[sender] = NowNs() + static_cast<int64_t>(3e9 * config_.heartbeat_s);
      }
      if (h.contributors == 1 && IsValidDType(h.dtype) && IsValidOp(h.op) &&
          IsValidCodec(h.codec)) {
        const Codec codec = static_cast<Codec>(h.codec);
        wait.what = std::string(DTypeName(static_cast<DType>(h.dtype))) + "[" +
                    std::to_string(h.total_elems) + "] " +
                    ReduceOpName(static_cast<ReduceOp>(h.op)) +
                    (codec != Codec::kNone ? std::string(" over ") + CodecName(codec) : "") +
                    " (key " +
                    std::to_string(h.key) + "; " + DescribeIdentity(HeaderIdentity(h)) + ")";
        wait.seconds = h.chunk;
        wait.run_id = h.run_id;
        wait.key = h.key;
        wait.slot = h.slot;
        wait.instance = h.instance;
      }
      std::lock_guard<std::mutex> lock(peer_wait_mu_);
      // Its kStall stays while it still waits in something (PeerReport
      // checks that it is about the same reduction).
      if (!wait.what.empty()) wait.site = std::move(peer_wait_[sender].site);
      peer_wait_[sender] = std::move(wait);
    } else {
      CountDropped(why);
    }
  }
  // Never post from the progress thread (see DropAndRepost).
  Enqueue([this, slot] { PostHeartbeatRecv(slot); });
}

void Communicator::WatchLoop() {
  const bool heartbeats = config_.heartbeat_s > 0;
  const auto interval = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(heartbeats ? config_.heartbeat_s : 1.0));
  std::unique_lock<std::mutex> lock(heartbeat_mu_);
  while (!heartbeat_cv_.wait_for(lock, interval, [this] { return heartbeat_stop_; })) {
    lock.unlock();
    if (heartbeats) {
      SendHeartbeats();
      WatchPeers();
    }
    WatchLeavers();
    ReportStalls();
    FailMismatchedPrograms();
    // Receipts go out as the leavers' data arrives (TookFrom); this catches
    // any whose trigger raced with the kLeave.
    for (int r = 0; r < config_.size; ++r) {
      if (r != config_.rank && ledger_.Left(r)) SendReceiptIfDue(r);
    }
    lock.lock();
  }
}

// Heartbeats scale with what reductions need. A rank hears from a peer at the
// full rate (every heartbeat_s) only while one of them waits in a reduction
// the other belongs to: this rank sends at the full rate to the members of its
// batches in flight, and to ranks whose last heartbeat said they wait. Every
// other peer gets one every quarter of the peer limit, enough for the peer
// watch never to call a live rank dead. An idle job of N ranks sends
// N(N-1) / (limit / 4) heartbeats a second instead of N(N-1) / heartbeat_s, and
// a reduction over small groups keeps the full rate inside its groups.
void Communicator::SendHeartbeats() {
  WireHeader base = ControlHeader(MsgKind::kHeartbeat, config_.token, config_.rank);
  OldestWait(&base);
  SealHeader(&base);
  const int64_t now = NowNs();
  const double limit = std::min(config_.peer_timeout_s, config_.timeout_s);
  std::vector<bool> busy_with(config_.size, false);
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (const Batch* batch : active_) {
      for (int rank : batch->group) busy_with[rank] = true;
    }
  }
  // 0.9: the loop ticks every heartbeat_s, a little late each time.
  const int64_t full_ns = static_cast<int64_t>(0.9e9 * config_.heartbeat_s);
  const int64_t slow_ns = std::max(full_ns, static_cast<int64_t>(1e9 * limit / 4));
  const int64_t silent_ns = std::max(slow_ns, static_cast<int64_t>(1e9 * limit));
  for (int peer = 0; peer < config_.size; ++peer) {
    if (peer == config_.rank) continue;
    // A peer silent past the limit is presumed dead, yet it gets one every
    // `limit`: never again, and a process stopped (SIGSTOP, a debugger) for
    // longer than the limit found on its return that every peer had stopped
    // writing to it while it, hearing nobody, wrote to none of them, for
    // good, so that its next reduction was declared dead. Only one every
    // `limit`: a post to a dead peer can stall in the provider's connection
    // attempts and delay the heartbeats to the live ones.
    const bool silent = (now - last_heard_[peer].load()) * 1e-9 > limit;
    // A leaving rank (Leave) sends nothing to the peers it no longer waits
    // for, whose endpoints may be closing (a message unread at a close resets
    // the connection), and the full rate to the others: a failed heartbeat
    // then says soon that a peer's endpoint is gone.
    if (leaving_ && ledger_.Released(peer)) continue;
    const bool full = !silent && (busy_with[peer] || waiter_until_[peer].load() > now ||
                                  leaving_);
    if (now - last_sent_[peer].load() < (silent ? silent_ns : full ? full_ns : slow_ns)) continue;
    if (heartbeat_busy_[peer].exchange(true)) continue;
    // Only now, with no heartbeat to `peer` in flight, may its buffer change.
    heartbeat_out_[peer] = base;
    transport::IoVec iov[1] = {{&heartbeat_out_[peer], sizeof(WireHeader)}};
    // TrySend: a peer whose queue is full (dead, or busy with data that
    // proves it alive anyway) must not hold up the heartbeats to the others.
    // The first heartbeat to a peer may queue (SendControl, also after a
    // failure): a provider that connects on the first send (tcp;ofi_rxm)
    // refuses sends until then, and where no data goes to that peer (the
    // host stage's boards carry a host's steps) nothing else would ever
    // connect the two.
    auto done = [this, peer](const transport::Completion& c) {
      heartbeat_busy_[peer] = false;
      if (!c.ok && leaving_) {
        ledger_.MarkGone(peer);
        { std::lock_guard<std::mutex> lock(leave_mu_); }
        leave_cv_.notify_all();
      }
    };
    const uint64_t tag = MakeHeartbeatTag(static_cast<uint32_t>(config_.rank));
    Status s = last_sent_[peer].load() == 0 ? transport_->SendControl(peer, tag, iov, 1, done)
                                            : transport_->TrySend(peer, tag, iov, 1, done);
    if (!s.ok()) {
      heartbeat_busy_[peer] = false;
      if (silent) last_sent_[peer] = now;  // the next try one `limit` later
    } else {
      last_sent_[peer] = now;
      heartbeats_sent_.fetch_add(1);
    }
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
    Fail(batch, RankText(dead) + " has sent nothing (no data, no " +
                    "heartbeat) for " + silent + " s while rank " +
                    std::to_string(config_.rank) + " waits for it in " + DescribeJob(job) +
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

}  // namespace herring::engine
