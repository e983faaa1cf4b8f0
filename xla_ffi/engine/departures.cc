// How ranks leave a job and what the others make of it: the abort of a
// program that fails (an uncaught exception: Abort), the notice of an orderly
// shutdown (kLeave, sent once every reduction of the rank has ended), and the
// stall report of a reduction that waits too long (printed here, and sent as
// kStall to the ranks it waits for, so that their errors can name both ends).
// Where each reduction was written in the user's program (NoteCallSite) goes
// into these texts.
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

namespace herring::engine {

namespace {

// Seconds a rank that said it shut down gets before a batch that still
// misses its data fails: a notice may overtake the rank's last data messages
// on providers that do not order messages.
constexpr double kLeaveGraceS = 1.0;

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
  {
    // Broken before (a peer failed, or this rank did): every rank has been
    // told of that failure already, and this one is its consequence.
    std::lock_guard<std::mutex> lock(broken_mu_);
    if (!broken_.empty()) return;
    broken_ = mine;
  }
  transport_->StopWaiting();
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (Batch* batch : active_) Fail(batch, mine, /*tell_peers=*/false);
  }
  if (!connected_ || config_.size < 2) return;
  // The peers prefix "rank R failed: " themselves. Once per rank: where this
  // rank has failed before, every peer has been told of that already.
  std::call_once(abort_once_, [&] { TellPeers(MsgKind::kAbort, why, AllPeers(), wait_s, true); });
}

std::string Communicator::Broken() {
  std::lock_guard<std::mutex> lock(broken_mu_);
  return broken_;
}

void Communicator::OnNotice(MsgKind kind, uint32_t sender, const std::string& text) {
  if (kind == MsgKind::kLeave) {
    left_ns_[sender] = NowNs();
    return;
  }
  std::lock_guard<std::mutex> lock(peer_wait_mu_);
  peer_wait_[sender].report = text;
}

void Communicator::WatchLeavers() {
  const int64_t now = NowNs();
  std::lock_guard<std::mutex> lock(active_mu_);
  for (Batch* batch : active_) {
    if (batch->Failed()) continue;
    for (int rank : MissingRanks(*batch)) {
      const int64_t left = left_ns_[rank].load();
      if (left == 0 || (now - left) * 1e-9 < kLeaveGraceS) continue;
      Fail(batch, "rank " + std::to_string(rank) + " has shut down herring_jax (its "
                      "herring_jax.shutdown() or the end of its program) while rank " +
                      std::to_string(config_.rank) + " still waits for it in " +
                      DescribeJob(*batch->jobs.front()) + ": every process must run the "
                      "same reductions, as many times, before it shuts down (did its "
                      "training loop run fewer steps, or leave it early?)");
      break;
    }
  }
}

void Communicator::ReportStalls() {
  if (config_.stall_s <= 0) return;
  const int64_t now = NowNs();
  struct Stall {
    std::string text;
    std::string notice;
    std::set<int> missing;
  };
  std::vector<Stall> stalls;
  {
    std::lock_guard<std::mutex> lock(active_mu_);
    for (Batch* batch : active_) {
      const double waited = (now - batch->started_ns) * 1e-9;
      if (waited < config_.stall_s || batch->Failed() || batch->stall_reported.exchange(true)) {
        continue;
      }
      const Job& job = *batch->jobs.front();
      Stall stall;
      stall.missing = MissingRanks(*batch);
      stall.notice = "has waited " + Seconds(waited) + " s in " + DescribeJob(job);
      std::string verdict;
      {
        std::lock_guard<std::mutex> peers_lock(peer_wait_mu_);
        for (int rank : stall.missing) {
          const PeerWait& peer = peer_wait_[rank];
          if (!peer.what.empty() && peer.run_id != job.id.run_id) {
            verdict += " Rank " + std::to_string(rank) + " runs a different compiled " +
                       "program: the processes' shapes or code differ, or they run their " +
                       "reducing programs in a different order.";
          }
        }
      }
      stall.text = "herring_jax rank " + std::to_string(config_.rank) + ": a reduction has " +
                   "made no progress for " + Seconds(waited) + " s: " + MissingReport(*batch) +
                   verdict + " (reported once after HERRING_STALL_S=" +
                   Seconds(config_.stall_s) + " s; it fails after HERRING_TIMEOUT_S=" +
                   Seconds(config_.timeout_s) + " s)";
      stalls.push_back(std::move(stall));
    }
  }
  for (const Stall& stall : stalls) {
    std::fprintf(stderr, "%s\n", stall.text.c_str());
    std::fflush(stderr);
    std::vector<int> peers(stall.missing.begin(), stall.missing.end());
    peers.erase(std::remove(peers.begin(), peers.end(), config_.rank), peers.end());
    if (!peers.empty()) TellPeers(MsgKind::kStall, stall.notice, peers, 0.0, false);
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
