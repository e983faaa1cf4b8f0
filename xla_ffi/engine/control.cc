// The abort control plane: a failing rank fails its batches and tells every
// other rank at once, so that nobody waits for HERRING_TIMEOUT_S on a job that
// cannot finish; the batches in flight that an abort reaches, and how a
// failed one ends; and the dropped-message count.
#include "engine/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "engine/batch.h"

namespace herring::engine {

void Communicator::PostControlRecv(size_t slot) {
  ControlBuffer& b = control_[slot];
  transport::IoVec iov[2] = {{&b.header, sizeof(b.header)}, {b.text, sizeof(b.text)}};
  // Any sender: the sender bits of the tag are ignored, and OnControl checks
  // them against the address the message came from.
  Status s = transport_->Recv(
      MakeControlTag(0), kSenderBits, iov, 2,
      [this, slot](const transport::Completion& c) { OnControl(slot, c); },
      /*background=*/true);
  // Without it this rank would never hear another rank's abort and would wait
  // for HERRING_TIMEOUT_S instead: no silent degradation, break now.
  if (!s.ok() && !ShuttingDown()) {
    FailAll("rank " + std::to_string(config_.rank) + " cannot post a control receive: " +
                s.message(),
            /*tell_peers=*/true);
  }
}

void Communicator::OnControl(size_t slot, const transport::Completion& c) {
  const ControlBuffer& b = control_[slot];
  const uint32_t sender = TagSender(c.tag);
  std::string why;
  if (!c.ok && !c.truncated) return;  // cancelled at shutdown or after a failure
  if (c.truncated) {
    // Longer than any abort (a header and kAbortTextBytes of text): not one
    // of ours. Dropped; the receive is posted again like any other drop.
    CountDropped("oversized control message from rank " + std::to_string(sender));
    Enqueue([this, slot] { PostControlRecv(slot); });
    return;
  }
  // The kind is checked against itself: any control kind is welcome here.
  const MsgKind kind = static_cast<MsgKind>(b.header.kind);
  if (!IsControlKind(kind) ||
      !CheckControlHeader(b.header, c.len, kind, config_.token, sender,
                          static_cast<uint32_t>(config_.size), &why) ||
      !FromSender(c, sender, &why)) {
    CountDropped(why.empty() ? "control message of unknown kind" : why);
    Enqueue([this, slot] { PostControlRecv(slot); });
    return;
  }
  Heard(sender);
  const std::string reason(b.text, c.len - sizeof(WireHeader));
  if (kind != MsgKind::kAbort) {
    // Notices (departures.cc): taken in, and the receive posted again.
    OnNotice(kind, sender, b.header, reason);
    Enqueue([this, slot] { PostControlRecv(slot); });
    return;
  }
  const std::string mine = OldestWait();
  const std::string message = "rank " + std::to_string(sender) + " failed: " + reason +
                              (mine.empty() ? std::string()
                                            : " [rank " + std::to_string(config_.rank) +
                                                  " was waiting in " + mine + "]");
  bool first;
  {
    std::lock_guard<std::mutex> lock(broken_mu_);
    first = broken_.empty();
  }
  if (first) {
    // At once, whatever this rank is doing (computing, compiling, waiting in
    // jax): a rank that waits in no reduction would otherwise say nothing
    // until jax.distributed ends it with its own abort, once the failed rank
    // (its coordinator, for rank 0) has exited. Printed before kAbortSeen,
    // which that exit waits for.
    std::fprintf(stderr, "herring_jax rank %d: %s. The job cannot go on: this rank's "
                 "reductions fail from here on, and jax.distributed may end this process\n",
                 config_.rank, message.c_str());
    std::fflush(stderr);
  }
  told_by_peer_ = true;
  FailAll(message, /*tell_peers=*/false);
  // From a server thread: the progress thread never posts itself.
  Enqueue([this, sender] {
    TellPeers(MsgKind::kAbortSeen, "", {static_cast<int>(sender)}, 0.0, false);
  });
}

bool Communicator::FromSender(const transport::Completion& c, uint32_t sender,
                              std::string* why) {
  // The job token is no proof of who sent a message (README, "Security"):
  // where the provider names the sending address, it must be the rank's.
  if (c.source == transport::kSourceUnchecked || c.source == static_cast<int>(sender)) {
    return true;
  }
  *why = "a control message that claims to come from rank " + std::to_string(sender) +
         " came from " + (c.source == transport::kSourceUnknown
                              ? std::string("an address of no rank of this job")
                              : "rank " + std::to_string(c.source) + "'s address");
  return false;
}

void Communicator::CountDropped(const std::string& why) {
  if (dropped_.fetch_add(1) < 10) {
    std::fprintf(stderr, "herring_jax rank %d: dropped a message: %s\n", config_.rank,
                 why.c_str());
  }
}

void Communicator::BroadcastAbort(const std::string& why) {
  // Queued if need be, also after this rank's failure (SendControl): a peer
  // it never sent to before is not connected yet. Not waited for: this runs
  // on a server thread; one to a dead peer gives up after its post timeout,
  // and the peers it does not reach learn of the failure from their own
  // timeout or peer watch. Failures are logged.
  // Not to a server-only process that is gone (ServerGone): nothing reaches it.
  std::call_once(abort_once_, [&] {
    std::vector<int> peers;
    for (int peer : AllPeers()) {
      if (!gone_[peer].load()) peers.push_back(peer);
    }
    TellPeers(MsgKind::kAbort, why, peers, 0.0, true);
  });
}

// The first failure of this communicator: what its abort tells the peers.
// Every later one follows from it (StopWaiting fails the queued sends "after
// a failure"); were one of those told, a peer that hears this rank before the
// failed one would report the echo and never the cause.
std::string Communicator::FirstFailure(const std::string& why) {
  std::lock_guard<std::mutex> lock(broken_mu_);
  if (broken_.empty()) broken_ = why;
  return broken_;
}

void Communicator::FailAll(const std::string& why, bool tell_peers) {
  const std::string first = FirstFailure(why);
  transport_->StopWaiting();
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (Batch* batch : active_) Fail(batch, why, /*tell_peers=*/false);
  }
  if (tell_peers && connected_) {
    abort_owed_ = true;
    Enqueue([this, first] { BroadcastAbort(first); });
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
  const std::string first = FirstFailure(why);
  // The communicator is unusable from here on: a post waiting for room in a
  // queue (e.g. to a dead rank that this batch's failure did not name) must
  // give up now, or the caller's thread stays in SendJob until the timeout.
  transport_->StopWaiting();
  // Sent from a server thread: Fail also runs on the progress thread, which
  // must never wait on the transport's queues itself.
  if (tell_peers && connected_) {
    abort_owed_ = true;
    Enqueue([this, first] { BroadcastAbort(first); });
  }
}

bool Communicator::Activate(Batch* batch) {
  if (config_.test_activate_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(config_.test_activate_delay_ms));
  }
  std::lock_guard<std::mutex> lock(active_mu_);
  active_.insert(batch);
  // FailAll sets broken_ before it sweeps active_ (under active_mu_): either
  // it is set by now, or the sweep comes after this insertion and fails it.
  std::string broken;
  {
    std::lock_guard<std::mutex> broken_lock(broken_mu_);
    broken = broken_;
  }
  if (broken.empty()) return true;
  Fail(batch, "communicator unusable after an earlier failure: " + broken, /*tell_peers=*/false);
  return false;
}

void Communicator::Deactivate(Batch* batch) {
  std::lock_guard<std::mutex> lock(active_mu_);
  active_.erase(batch);
}

void Communicator::FailTimedOut(Batch* batch) {
  const std::string verdict =
      batch->jobs.empty() ? "" : Verdict(*batch->jobs.front(), MissingRanks(*batch));
  Fail(batch, "herring allreduce timed out after " +
                  std::to_string(static_cast<int>(config_.timeout_s)) + " s on rank " +
                  std::to_string(config_.rank) + ": " + MissingReport(*batch) + verdict +
                  " A process may have hung, or the processes issued different "
                  "reductions (other shapes or code, or a reducing step run a "
                  "different number of times). HERRING_TIMEOUT_S sets the limit.");
}

Status Communicator::EndFailed(std::unique_ptr<Batch> batch, bool timed_out) {
  if (timed_out) {
    FailTimedOut(batch.get());
  } else if (!told_by_peer_) {
    // Failed by a mismatch or the peer watch: the error names the cause;
    // this rank's own view goes to the log (a peer's abort names its own).
    std::fprintf(stderr, "herring_jax rank %d: state of the failed reduction: %s\n",
                 config_.rank, MissingReport(*batch).c_str());
  }
  std::unique_lock<std::mutex> lock(batch->mu);
  std::string error = batch->error;
  lock.unlock();
  // Receives may still point into XLA's buffers: cancel them and wait until
  // the transport has let go of every buffer before returning.
  transport_->CancelAll();
  lock.lock();
  // Sums and re-posts first, however long: they write into XLA's buffers,
  // which XLA frees once this returns, and they cannot block (posting never
  // waits), so only a stalled thread (a debugger, SIGSTOP) makes this wait.
  batch->cv.wait(lock, [&] { return batch->tasks == 0; });
  bool drained =
      batch->cv.wait_for(lock, std::chrono::seconds(5), [&] { return batch->inflight == 0; });
  // A receive into XLA's output that the provider did not cancel (one it has
  // matched and is still filling: a streaming provider whose sender stopped
  // mid-message) would write there after XLA reused the memory: never
  // return while one is posted, however long that takes. The sends that may
  // never complete (to a dead peer) only read.
  for (int waited_s = 5; !drained && batch->output_recvs.load() > 0; ++waited_s) {
    if (waited_s == 5) {
      std::fprintf(stderr, "herring_jax rank %d: the failed reduction waits for %zu receives "
                   "into its output that the provider could not cancel (a peer stopped in "
                   "the middle of a message?)\n", config_.rank, batch->output_recvs.load());
    }
    drained = batch->cv.wait_for(lock, std::chrono::seconds(1),
                                 [&] { return batch->inflight == 0; });
  }
  const size_t left = batch->inflight;
  lock.unlock();
  Deactivate(batch.get());
  // A rank that owes its peers the abort has posted it before its program
  // hears of the failure (a program may end at once on it); where the abort
  // is being told and awaited (ServerGone: only this rank knows), this waits
  // until that is done.
  if (abort_owed_) BroadcastAbort(Broken());
  if (!drained) {
    // Sends to a dead peer may never complete, and their callbacks reference
    // the batch: it is kept (the communicator is unusable from here on, so
    // this happens at most once per communicator; counted in the stats).
    kept_batches_.fetch_add(1);
    std::fprintf(stderr, "herring_jax rank %d: %s operations of the failed reduction did "
                 "not finish within 5 s; its state is kept\n", config_.rank,
                 std::to_string(left).c_str());
    batch.release();
  }
  return Status::Error(error);
}

}  // namespace herring::engine
