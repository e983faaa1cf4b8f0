// The libfabric transport's posting (fabric_transport.h): sends and receives
// handed to the provider within its queues' budgets, or queued in order per
// lane (receives; sends to each rank) for the progress thread to post when
// the provider has room; cancelling and shutting down.
#include <cstring>
#include <string>
#include <utility>

#include "transport/fabric_transport.h"

namespace herring::transport::fabric {

Status FabricTransport::Send(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                             Callback done) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
    return Status::Error("send to unknown rank " + std::to_string(peer));
  CountSend(iov, iov_count);
  data_sends_.fetch_add(1);  // after sends_ (Stats reads them the other way round)
  return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
              /*background=*/false, peer, /*may_queue=*/true);
}

Status FabricTransport::SendControl(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                                    Callback done) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
    return Status::Error("send to unknown rank " + std::to_string(peer));
  CountSend(iov, iov_count);
  return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
              /*background=*/false, peer, /*may_queue=*/true, /*control=*/true);
}

Status FabricTransport::TrySend(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                                Callback done) {
  if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
    return Status::Error("send to unknown rank " + std::to_string(peer));
  CountSend(iov, iov_count);
  return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
              /*background=*/false, peer, /*may_queue=*/false);
}

void FabricTransport::SetPeerUnreachable(int peer) {
  if (peer >= 0 && static_cast<size_t>(peer) < peers_.size()) unreachable_[peer] = true;
  Wake();
}

void FabricTransport::StopWaiting() {
  stop_waiting_ = true;
  Wake();
}

Status FabricTransport::Recv(uint64_t tag, uint64_t ignore, const IoVec* iov, size_t iov_count,
                             Callback done, bool background, int from) {
  if (from >= static_cast<int>(peers_.size()))
    return Status::Error("receive from unknown rank " + std::to_string(from));
  const fi_addr_t addr = directed_ && from >= 0 ? peers_[from] : FI_ADDR_UNSPEC;
  return Post(/*is_recv=*/true, addr, tag, ignore, iov, iov_count, std::move(done),
              background);
}

void FabricTransport::CancelAll() {
  // Queued receives are completed by the progress thread (callbacks run
  // there only); posted ones are cancelled in the provider, which reports
  // them as failed completions.
  std::lock_guard<std::mutex> post_lock(post_mu_);
  for (Op* op : pending_) {
    if (op->is_recv) op->cancel = true;
  }
  std::lock_guard<std::mutex> lock(live_mu_);
  for (Op* op : live_) {
    if (op->is_recv && op->posted.load()) fi_cancel(&ep_->fid, op);
  }
  Wake();
}

void FabricTransport::Shutdown() {
  if (progress_.joinable()) {
    CancelAll();
    // Give canceled and in-flight operations a moment to complete so their
    // callbacks (which reference engine state) run before teardown.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (LiveOps() > 0 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    running_ = false;
    Wake();
    progress_.join();
  }
  // The endpoint first: it holds the contexts of operations still posted,
  // which may be freed only once the provider has let go of them.
  ep_.reset();
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    pending_.clear();
    pending_count_ = 0;
  }
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_.clear();
  }
  for (auto& op : all_ops_) ReleaseRegistrations(op.get());
  all_ops_.clear();
  free_ops_.clear();
  av_.reset();
  cq_.reset();
  domain_.reset();
  fabric_.reset();
}

Op* FabricTransport::NewOp() {
  std::lock_guard<std::mutex> lock(ops_mu_);
  if (free_ops_.size() > kRecycleDistance) {
    Op* op = free_ops_.front();
    free_ops_.pop_front();
    return op;
  }
  all_ops_.push_back(std::make_unique<Op>());
  return all_ops_.back().get();
}

void FabricTransport::Recycle(Op* op) {
  op->done = nullptr;
  op->mrs.clear();
  op->cancel = false;
  op->control = false;
  op->posted = false;
  std::lock_guard<std::mutex> lock(ops_mu_);
  free_ops_.push_back(op);
}

// `peer` is the destination rank of a send (-1 for receives); a send with
// `may_queue` false fails at once where it would have to queue; a
// `control` one queues also after StopWaiting (SendControl).
Status FabricTransport::Post(bool is_recv, fi_addr_t addr, uint64_t tag, uint64_t ignore,
                             const IoVec* iov, size_t iov_count, Callback done, bool background,
                             int peer, bool may_queue, bool control) {
  if (iov_count == 0 || iov_count > kMaxIov || iov_count > info_->tx_attr->iov_limit)
    return Status::Error("bad iov count " + std::to_string(iov_count));
  if (!running_) return Status::Error("the transport is shut down");
  Op* op = NewOp();
  std::memset(&op->ctx, 0, sizeof(op->ctx));
  op->done = std::move(done);
  op->is_recv = is_recv;
  op->counted = !background;
  op->addr = addr;
  op->tag = tag;
  op->ignore = ignore;
  op->iov_count = iov_count;
  op->peer = peer;
  op->control = control;
  for (size_t i = 0; i < iov_count; ++i) {
    op->iovs[i].iov_base = iov[i].base;
    op->iovs[i].iov_len = iov[i].len;
    op->desc[i] = nullptr;
    if (need_mr_ && iov[i].len > 0) {
      fid_mr* mr = nullptr;
      uint64_t key = prov_key_ ? 0 : next_key_.fetch_add(1);
      int ret = fi_mr_reg(domain_.get(), iov[i].base, iov[i].len, FI_SEND | FI_RECV, 0, key,
                          0, &mr, nullptr);
      if (ret != 0) {
        ReleaseRegistrations(op);
        Recycle(op);
        return Status::Error(FiError("fi_mr_reg", ret));
      }
      op->mrs.push_back(mr);
      op->desc[i] = fi_mr_desc(mr);
    }
  }
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_.insert(op);
  }
  op->live = true;
  if (op->counted) outstanding_.fetch_add(1);

  std::string refused;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    const size_t lane = Lane(*op);
    // Behind queued operations of its lane, or over budget: queue (keeps a
    // lane's order). Else try the provider once. A send that may not queue
    // (a heartbeat, an abort: one per peer at most) tries at once, whatever
    // waits in its lane and whatever the budget.
    if (!may_queue || (lane_pending_[lane] == 0 && HasBudget(*op))) {
      const ssize_t ret = PostToProvider(op);
      if (ret == 0) {
        Wake();
        return Status::Ok();
      }
      if (ret != -FI_EAGAIN) {
        refused = FiError(is_recv ? "fi_trecvv" : "fi_tsendv", static_cast<int>(ret));
      }
    }
    if (refused.empty()) {
      const bool stopped = stop_waiting_.load() && !control;
      if (!is_recv && (!may_queue || stopped || unreachable_[peer].load())) {
        refused = std::string("fi_tsendv is busy (-FI_EAGAIN)") +
                  (!may_queue ? std::string()
                   : stopped  ? " after a failure"
                                          : " and rank " + std::to_string(peer) +
                                                " is unreachable");
      } else {
        // The progress thread posts it when the provider has room.
        op->deadline_ns = SteadyNs() + static_cast<int64_t>(post_timeout_s_ * 1e9);
        pending_.push_back(op);
        pending_count_.fetch_add(1);
        ++lane_pending_[lane];
        posts_queued_.fetch_add(1);
        Wake();
        return Status::Ok();
      }
    }
  }
  op->live = false;
  Forget(op);
  ReleaseRegistrations(op);
  Recycle(op);
  return Status::Error(refused);
}

// post_mu_ held. Background receives (one per peer and a few for control,
// completing at heartbeat rate) are outside the budgets: they would take
// all of it in a large job.
bool FabricTransport::HasBudget(const Op& op) const {
  if (!op.counted) return true;
  return op.is_recv ? posted_recvs_ < recv_budget_ : posted_sends_ < send_budget_;
}

// post_mu_ held. 0, -FI_EAGAIN or another error. The op counts as posted
// before the provider sees it: its completion may arrive (Finish, on the
// progress thread) before the provider's call returns here.
ssize_t FabricTransport::PostToProvider(Op* op) {
  op->posted = true;
  size_t& posted = op->is_recv ? posted_recvs_ : posted_sends_;
  if (op->counted) ++posted;
  ssize_t ret = op->is_recv ? fi_trecvv(ep_.get(), op->iovs, op->desc, op->iov_count,
                                        op->addr, op->tag, op->ignore, op)
                            : fi_tsendv(ep_.get(), op->iovs, op->desc, op->iov_count,
                                        op->addr, op->tag, op);
  if (ret != 0) {
    op->posted = false;
    if (op->counted) --posted;
  }
  return ret;
}

// Progress thread: posts queued operations the provider now has room for,
// in order within each lane; a lane the provider refuses waits for the next
// round without holding up the others. Fails queued sends that gave up.
void FabricTransport::PostQueued() {
  std::vector<std::pair<Op*, std::string>> failed;
  {
    std::lock_guard<std::mutex> lock(post_mu_);
    if (pending_.empty()) return;
    const int64_t now = SteadyNs();
    std::vector<bool> blocked(lane_pending_.size(), false);
    for (auto it = pending_.begin(); it != pending_.end();) {
      Op* op = *it;
      const size_t lane = Lane(*op);
      std::string why;
      if (op->cancel) {
        why = "cancelled";
      } else if (!op->is_recv && stop_waiting_.load() && !op->control) {
        why = "fi_tsendv is busy (-FI_EAGAIN) after a failure";
      } else if (!op->is_recv && unreachable_[op->peer].load()) {
        why = "fi_tsendv is busy (-FI_EAGAIN) and rank " + std::to_string(op->peer) +
              " is unreachable";
      } else if (!op->is_recv && now > op->deadline_ns) {
        why = "fi_tsendv stayed busy (-FI_EAGAIN) for " +
              std::to_string(static_cast<int>(post_timeout_s_)) +
              " s: the peer is unreachable or not making progress";
      } else if (blocked[lane] || !HasBudget(*op)) {
        // Over budget: wait, but let the lane's background receives (which
        // need none) pass. Refused by the provider: the lane waits.
        ++it;
        continue;
      } else {
        const ssize_t ret = PostToProvider(op);
        if (ret == -FI_EAGAIN) {
          blocked[lane] = true;
          ++it;
          continue;
        }
        if (ret != 0) why = FiError(op->is_recv ? "fi_trecvv" : "fi_tsendv",
                                    static_cast<int>(ret));
      }
      if (!why.empty()) failed.emplace_back(op, why);
      --lane_pending_[lane];
      pending_count_.fetch_sub(1);
      it = pending_.erase(it);
    }
  }
  for (auto& [op, why] : failed) {
    Completion c;
    c.ok = false;
    c.error = why;
    Finish(op, c);
  }
}

void FabricTransport::CountSend(const IoVec* iov, size_t iov_count) {
  size_t bytes = 0;
  for (size_t i = 0; i < iov_count; ++i) bytes += iov[i].len;
  sends_.fetch_add(1, std::memory_order_relaxed);
  send_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

}  // namespace herring::transport::fabric
