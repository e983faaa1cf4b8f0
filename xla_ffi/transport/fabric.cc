// libfabric implementation of the transport: one FI_EP_RDM endpoint with
// tagged messages, one completion queue polled by a progress thread.
//
// This is the only file of herring_jax that calls fi_*.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace herring::transport {
namespace {

constexpr uint32_t kFabricVersion = FI_VERSION(1, 9);
constexpr int kCqBatch = 16;
constexpr size_t kCqSize = 16384;
constexpr size_t kMaxIov = 4;

std::string FiError(const char* what, int ret) {
  return std::string(what) + " failed: " + fi_strerror(-ret) + " (" +
         std::to_string(ret) + ")";
}

// Owns one libfabric object; closing failures are logged, never thrown.
template <typename T>
struct FidCloser {
  void operator()(T* obj) const {
    if (obj == nullptr) return;
    int ret = fi_close(&obj->fid);
    if (ret != 0) {
      std::fprintf(stderr, "herring_jax: fi_close of a libfabric object (class %zu) failed: %s\n",
                   obj->fid.fclass, fi_strerror(-ret));
    }
  }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

struct InfoDeleter {
  void operator()(fi_info* info) const { fi_freeinfo(info); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

// The providers this machine offers with what herring_jax needs (an RDM
// endpoint with tagged messages), in libfabric's order of preference, for the
// error that says a requested one is missing: a misspelt name and a provider
// without its hardware (efa off AWS) look alike to fi_getinfo.
std::string AvailableProviders() {
  InfoPtr hints(fi_allocinfo());
  if (!hints) return "(fi_allocinfo failed)";
  hints->caps = FI_TAGGED;
  hints->ep_attr->type = FI_EP_RDM;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  fi_info* raw = nullptr;
  const int ret = fi_getinfo(kFabricVersion, nullptr, nullptr, 0, hints.get(), &raw);
  InfoPtr list(raw);
  if (ret != 0 || raw == nullptr) return std::string("none (") + fi_strerror(-ret) + ")";
  std::vector<std::string> names;
  for (const fi_info* i = raw; i != nullptr; i = i->next) {
    const std::string name = i->fabric_attr->prov_name ? i->fabric_attr->prov_name : "?";
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : ", ") + name;
  return text;
}

std::string MissingProvider(const std::string& errors) {
  return errors + ". Providers available here: " + AvailableProviders() +
         ". Set HERRING_FI_PROVIDER to one of them, or leave it empty (efa where the machine "
         "has it, else tcp;ofi_rxm); `fi_info -l` lists them too.";
}

bool LooksLikeIpAddress(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

// One operation, from Post to its completion. fi_context2 comes first so the
// provider's FI_CONTEXT/FI_CONTEXT2 scratch space is the op itself.
//
// Ops are recycled, never freed before Close, and reused oldest first with at
// least kRecycleDistance others in between: a second completion for one
// context (which libfabric promises never to deliver; the engine once crashed
// on what looked like one) then finds its op not `live` and is counted and
// dropped, instead of running a callback twice or on freed memory.
struct Op {
  fi_context2 ctx;
  Callback done;
  std::vector<fid_mr*> mrs;
  bool is_recv = false;
  bool counted = true;  // in outstanding_ (background receives are not)
  // What to post, kept for a post the provider refused with -FI_EAGAIN.
  fi_addr_t addr = FI_ADDR_UNSPEC;
  uint64_t tag = 0;
  uint64_t ignore = 0;
  iovec iovs[kMaxIov];
  void* desc[kMaxIov];
  size_t iov_count = 0;
  int peer = -1;             // destination rank of a send; -1 for receives
  int64_t deadline_ns = 0;   // a queued send gives up after it
  bool cancel = false;       // a queued receive was cancelled (post_mu_)
  bool control = false;      // SendControl: queues also after StopWaiting
  std::atomic<bool> posted{false};  // handed to the provider
  std::atomic<bool> live{false};    // between Post and its one completion
};

constexpr size_t kRecycleDistance = 1024;

int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class FabricTransport final : public Transport {
 public:
  ~FabricTransport() override { Shutdown(); }

  Status Open(const TransportOptions& options) {
    force_mr_ = options.force_mr;
    max_posted_ = options.max_posted;
    progress_slice_us_ = options.progress_slice_us;
    post_timeout_s_ = options.post_timeout_s;
    InfoPtr hints(fi_allocinfo());
    if (!hints) return Status::Error("fi_allocinfo failed");
    hints->caps = FI_TAGGED;
    hints->ep_attr->type = FI_EP_RDM;
    // Only the mode bits this file honours (FI_CONTEXT/2 via Op::ctx).
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    // Without FI_MR_LOCAL first: a provider that needs registered buffers
    // (EFA) then registers them itself, through its registration cache and
    // the memory monitor that invalidates it when XLA frees and reuses memory.
    // EFA opens that cache only when the application did not take FI_MR_LOCAL
    // (efa_domain.c, libfabric 1.17), so asking for it meant one fi_mr_reg and
    // one deregistration per message. Providers that cannot work that way are
    // asked again with FI_MR_LOCAL; HERRING_FI_FORCE_MR takes it always.
    const uint64_t mr_mode = FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
    hints->domain_attr->mr_mode = force_mr_ ? mr_mode | FI_MR_LOCAL : mr_mode;
    hints->domain_attr->threading = FI_THREAD_SAFE;
    hints->fabric_attr->prov_name = strdup(options.provider.c_str());

    const char* node = nullptr;
    uint64_t flags = 0;
    if (!options.interface.empty()) {
      if (LooksLikeIpAddress(options.interface)) {
        node = options.interface.c_str();
        flags = FI_SOURCE;
      } else if (std::getenv("FI_TCP_IFACE") == nullptr) {
        // Interface names reach the IP providers through FI_TCP_IFACE and
        // friends, which herring_jax sets at import (herring_jax/_src/
        // fabric_env.py): never setenv here, other threads may read the
        // environment.
        std::fprintf(stderr, "herring_jax: interface '%s' requested but FI_TCP_IFACE is "
                     "unset; set HERRING_FI_IFACE before importing herring_jax\n",
                     options.interface.c_str());
      }
    }
    if (options.eager_bytes > 0 && std::getenv("FI_OFI_RXM_EAGER_LIMIT") == nullptr) {
      // ofi_rxm sends messages above its eager limit (16 KiB by default) by
      // rendezvous: the receiver asks for the data with a read request. Over
      // tcp that request queues behind the receiver's own bulk sends on the
      // same connection, so when both directions are busy (every rank is
      // worker and server) each direction got half the link: measured on a
      // 250 Mbit/s flow, 127 Mbit/s each way with rendezvous, 238 eager.
      // herring_jax sets FI_OFI_RXM_EAGER_LIMIT at import (fabric_env.py).
      std::fprintf(stderr, "herring_jax: FI_OFI_RXM_EAGER_LIMIT is unset; ofi_rxm will send "
                   "chunks by rendezvous (half the rate on a link busy both ways)\n");
    }
    // Directed receives (a receive posted for one peer's address matches only
    // that peer's messages, whatever the tag's sender bits claim) and source
    // addresses in completions (who really sent a control message, whose
    // receive takes any sender): first with them, then, for a provider that
    // lacks them, without.
    fi_info* raw = nullptr;
    int ret = -FI_ENODATA;
    for (const uint64_t checks : {uint64_t{FI_DIRECTED_RECV | FI_SOURCE}, uint64_t{0}}) {
      hints->caps = FI_TAGGED | checks;
      hints->domain_attr->mr_mode = force_mr_ ? mr_mode | FI_MR_LOCAL : mr_mode;
      ret = fi_getinfo(kFabricVersion, node, nullptr, flags, hints.get(), &raw);
      if ((ret != 0 || raw == nullptr) && !force_mr_) {
        hints->domain_attr->mr_mode = mr_mode | FI_MR_LOCAL;
        ret = fi_getinfo(kFabricVersion, node, nullptr, flags, hints.get(), &raw);
      }
      if (ret == 0 && raw != nullptr) break;
    }
    if (ret != 0 || raw == nullptr) {
      no_provider_ = true;
      return Status::Error("no libfabric provider '" + options.provider +
                           "' with FI_EP_RDM and FI_TAGGED" +
                           (node ? std::string(" on ") + node : std::string()) + ": " +
                           fi_strerror(-ret));
    }
    info_.reset(raw);
    directed_ = (info_->caps & FI_DIRECTED_RECV) != 0;
    sources_ = (info_->caps & FI_SOURCE) != 0;
    // libfabric 1.17's ofi_rxd does not name a completion's sender by the
    // address its address vector gave out: over udp;ofi_rxd every control
    // message came "from rank 0's address" and was dropped (heartbeats, so
    // that live ranks were declared dead after HERRING_PEER_TIMEOUT_S;
    // aborts; the leave protocol's notices, so that every exit waited as
    // long). Its sources go unchecked, as a provider's that names none.
    if (std::strstr(info_->fabric_attr->prov_name, "ofi_rxd") != nullptr) sources_ = false;
    need_mr_ = force_mr_ || (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
    prov_key_ = (info_->domain_attr->mr_mode & FI_MR_PROV_KEY) != 0;
    if (info_->tx_attr->iov_limit < 2 || info_->rx_attr->iov_limit < 2) {
      return Status::Error("provider " + std::string(info_->fabric_attr->prov_name) +
                           " supports fewer than 2 iov entries per message");
    }

    fid_fabric* fabric = nullptr;
    if ((ret = fi_fabric(info_->fabric_attr, &fabric, nullptr)) != 0)
      return Status::Error(FiError("fi_fabric", ret));
    fabric_.reset(fabric);
    fid_domain* domain = nullptr;
    if ((ret = fi_domain(fabric_.get(), info_.get(), &domain, nullptr)) != 0)
      return Status::Error(FiError("fi_domain", ret));
    domain_.reset(domain);

    // Each direction may hand the provider as many operations as its queue
    // holds, and both together never more than the completion queue holds,
    // so that no completion can find the queue full. More wait in pending_.
    const size_t tx_size = info_->tx_attr->size > 0 ? info_->tx_attr->size : kCqSize / 2;
    const size_t rx_size = info_->rx_attr->size > 0 ? info_->rx_attr->size : kCqSize / 2;
    send_budget_ = std::min(tx_size, kCqSize / 2);
    recv_budget_ = std::min(rx_size, kCqSize / 2);
    if (max_posted_ > 0) {
      send_budget_ = std::min(send_budget_, max_posted_);
      recv_budget_ = std::min(recv_budget_, max_posted_);
    }
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.size = kCqSize;
    // A wait object lets the progress thread sleep in the kernel until data
    // arrives instead of spinning; providers without one (EFA) are polled,
    // and so is shm: its fi_cq_sread (libfabric 1.17) did not return within
    // its timeout while nothing completed, so the progress thread never came
    // back to post a send that waited in the queue (its first send to a peer
    // returns -FI_EAGAIN until the peer has mapped its region); 1 reduction
    // in 3 hung at its first message.
    const bool shm = std::string(info_->fabric_attr->prov_name).rfind("shm", 0) == 0;
    cq_attr.wait_obj = FI_WAIT_UNSPEC;
    fid_cq* cq = nullptr;
    ret = shm ? -FI_ENOSYS : fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr);
    if (ret != 0) {
      cq_attr.wait_obj = FI_WAIT_NONE;
      if ((ret = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr)) != 0)
        return Status::Error(FiError("fi_cq_open", ret));
    } else {
      can_wait_ = true;
      // tcp's progress is driven by its sockets, which the wait object
      // watches: nothing is due until one becomes ready or Wake signals the
      // queue. Other providers may keep timers (ofi_rxd retransmits) and
      // are read at least every millisecond.
      block_ms_ = std::string(info_->fabric_attr->prov_name).rfind("tcp", 0) == 0 ? 100 : 1;
    }
    cq_.reset(cq);

    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    fid_av* av = nullptr;
    if ((ret = fi_av_open(domain_.get(), &av_attr, &av, nullptr)) != 0)
      return Status::Error(FiError("fi_av_open", ret));
    av_.reset(av);

    fid_ep* ep = nullptr;
    if ((ret = fi_endpoint(domain_.get(), info_.get(), &ep, nullptr)) != 0)
      return Status::Error(FiError("fi_endpoint", ret));
    ep_.reset(ep);
    if ((ret = fi_ep_bind(ep_.get(), &av_->fid, 0)) != 0)
      return Status::Error(FiError("fi_ep_bind(av)", ret));
    if ((ret = fi_ep_bind(ep_.get(), &cq_->fid, FI_TRANSMIT | FI_RECV)) != 0)
      return Status::Error(FiError("fi_ep_bind(cq)", ret));
    if ((ret = fi_enable(ep_.get())) != 0) return Status::Error(FiError("fi_enable", ret));

    size_t len = 0;
    fi_getname(&ep_->fid, nullptr, &len);
    address_.resize(len);
    if ((ret = fi_getname(&ep_->fid, address_.data(), &len)) != 0)
      return Status::Error(FiError("fi_getname", ret));
    address_.resize(len);

    running_ = true;
    progress_ = std::thread([this] { ProgressLoop(); });
    return Status::Ok();
  }

  std::vector<uint8_t> Address() const override { return address_; }
  // Open failed because fi_getinfo found no such provider.
  bool no_provider() const { return no_provider_; }

  void SetFatalHandler(std::function<void(const std::string&)> handler) override {
    fatal_handler_ = std::move(handler);
  }

  Status SetPeers(const std::vector<std::vector<uint8_t>>& addrs) override {
    peers_.assign(addrs.size(), FI_ADDR_NOTAVAIL);
    unreachable_.reset(new std::atomic<bool>[addrs.size()]());
    {
      std::lock_guard<std::mutex> lock(post_mu_);
      lane_pending_.assign(addrs.size() + 1, 0);
    }
    for (size_t i = 0; i < addrs.size(); ++i) {
      int ret = fi_av_insert(av_.get(), addrs[i].data(), 1, &peers_[i], 0, nullptr);
      if (ret != 1) {
        return Status::Error("fi_av_insert of rank " + std::to_string(i) +
                             "'s address failed: " + fi_strerror(ret < 0 ? -ret : FI_EINVAL));
      }
    }
    return Status::Ok();
  }

  Status Send(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
              Callback done) override {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      return Status::Error("send to unknown rank " + std::to_string(peer));
    CountSend(iov, iov_count);
    return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
                /*background=*/false, peer, /*may_queue=*/true);
  }

  Status SendControl(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                     Callback done) override {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      return Status::Error("send to unknown rank " + std::to_string(peer));
    CountSend(iov, iov_count);
    return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
                /*background=*/false, peer, /*may_queue=*/true, /*control=*/true);
  }

  Status TrySend(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                 Callback done) override {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      return Status::Error("send to unknown rank " + std::to_string(peer));
    CountSend(iov, iov_count);
    return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
                /*background=*/false, peer, /*may_queue=*/false);
  }

  void SetPeerUnreachable(int peer) override {
    if (peer >= 0 && static_cast<size_t>(peer) < peers_.size()) unreachable_[peer] = true;
    Wake();
  }

  void StopWaiting() override {
    stop_waiting_ = true;
    Wake();
  }

  Status Recv(uint64_t tag, uint64_t ignore, const IoVec* iov, size_t iov_count,
              Callback done, bool background, int from) override {
    if (from >= static_cast<int>(peers_.size()))
      return Status::Error("receive from unknown rank " + std::to_string(from));
    const fi_addr_t addr = directed_ && from >= 0 ? peers_[from] : FI_ADDR_UNSPEC;
    return Post(/*is_recv=*/true, addr, tag, ignore, iov, iov_count, std::move(done),
                background);
  }

  void CancelAll() override {
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

  void Shutdown() override {
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

  size_t MaxMessageBytes() const override { return info_->ep_attr->max_msg_size; }

  std::string Describe() const override {
    return std::string(info_->fabric_attr->prov_name) + " (fabric " +
           info_->fabric_attr->name + ", domain " + info_->domain_attr->name +
           (need_mr_ ? ", registered buffers" : "") +
           (directed_ ? ", directed receives" : "") + (sources_ ? ", sources checked" : "") +
           (can_wait_ ? ", blocking progress" : ", polled progress") + ")";
  }

  size_t Outstanding() const override { return outstanding_.load(); }

  TransportStats Stats() const override {
    return TransportStats{posts_queued_.load(), duplicates_.load(), queue_errors_.load(),
                          sends_.load(), send_bytes_.load()};
  }

 private:
  Op* NewOp() {
    std::lock_guard<std::mutex> lock(ops_mu_);
    if (free_ops_.size() > kRecycleDistance) {
      Op* op = free_ops_.front();
      free_ops_.pop_front();
      return op;
    }
    all_ops_.push_back(std::make_unique<Op>());
    return all_ops_.back().get();
  }

  void Recycle(Op* op) {
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
  Status Post(bool is_recv, fi_addr_t addr, uint64_t tag, uint64_t ignore, const IoVec* iov,
              size_t iov_count, Callback done, bool background = false, int peer = -1,
              bool may_queue = true, bool control = false) {
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

  size_t Lane(const Op& op) const { return op.is_recv ? 0 : static_cast<size_t>(op.peer) + 1; }

  // post_mu_ held. Background receives (one per peer and a few for control,
  // completing at heartbeat rate) are outside the budgets: they would take
  // all of it in a large job.
  bool HasBudget(const Op& op) const {
    if (!op.counted) return true;
    return op.is_recv ? posted_recvs_ < recv_budget_ : posted_sends_ < send_budget_;
  }

  // post_mu_ held. 0, -FI_EAGAIN or another error. The op counts as posted
  // before the provider sees it: its completion may arrive (Finish, on the
  // progress thread) before the provider's call returns here.
  ssize_t PostToProvider(Op* op) {
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
  void PostQueued() {
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

  // The rank whose address `addr` is (FI_AV_TABLE numbers them in insertion
  // order, i.e. by rank), or kSourceUnknown: no peer of this job.
  int RankOf(fi_addr_t addr) const {
    if (addr == FI_ADDR_NOTAVAIL || addr == FI_ADDR_UNSPEC) return kSourceUnknown;
    if (addr < peers_.size() && peers_[addr] == addr) return static_cast<int>(addr);
    for (size_t r = 0; r < peers_.size(); ++r) {
      if (peers_[r] == addr) return static_cast<int>(r);
    }
    return kSourceUnknown;
  }

  size_t LiveOps() {
    std::lock_guard<std::mutex> lock(live_mu_);
    return live_.size();
  }

  void Forget(Op* op) {
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      live_.erase(op);
    }
    if (op->counted) outstanding_.fetch_sub(1);
  }

  static void ReleaseRegistrations(Op* op) {
    for (fid_mr* mr : op->mrs) fi_close(&mr->fid);
    op->mrs.clear();
  }

  void Finish(Op* op, const Completion& c) {
    if (!op->live.exchange(false)) {
      if (duplicates_.fetch_add(1) < 10) {
        std::fprintf(stderr, "herring_jax: the provider completed an operation twice "
                     "(tag %llx, %s); the second completion is ignored\n",
                     static_cast<unsigned long long>(c.tag), c.ok ? "ok" : c.error.c_str());
      }
      return;
    }
    {
      std::lock_guard<std::mutex> lock(post_mu_);
      if (op->posted.load() && op->counted) --(op->is_recv ? posted_recvs_ : posted_sends_);
    }
    Forget(op);
    ReleaseRegistrations(op);
    Callback done = std::move(op->done);
    Recycle(op);
    done(c);
  }

  // A failure of the completion queue itself: operations in flight may never
  // complete, so the engine must fail what waits for them (once).
  void Fatal(const std::string& why) {
    std::fprintf(stderr, "herring_jax: transport failure: %s\n", why.c_str());
    std::call_once(fatal_once_, [&] {
      if (fatal_handler_) fatal_handler_(why);
    });
  }

  // Returns the number of completions handled. With `wait_ms` > 0 and a
  // wait object, blocks up to that long for the first completion.
  int PollOnce(int wait_ms = 0) {
    fi_cq_tagged_entry entries[kCqBatch];
    fi_addr_t from[kCqBatch];
    const bool wait = wait_ms > 0 && can_wait_;
    ssize_t n = sources_ ? (wait ? fi_cq_sreadfrom(cq_.get(), entries, kCqBatch, from, nullptr,
                                                   wait_ms)
                                 : fi_cq_readfrom(cq_.get(), entries, kCqBatch, from))
                         : (wait ? fi_cq_sread(cq_.get(), entries, kCqBatch, nullptr, wait_ms)
                                 : fi_cq_read(cq_.get(), entries, kCqBatch));
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        Completion c;
        c.len = entries[i].len;
        c.tag = entries[i].tag;
        c.source = sources_ ? RankOf(from[i]) : kSourceUnchecked;
        Finish(static_cast<Op*>(entries[i].op_context), c);
      }
      return static_cast<int>(n);
    }
    // -FI_ECANCELED: fi_cq_signal (Wake) interrupted the wait.
    if (n == -FI_EAGAIN || n == -FI_ETIMEDOUT || n == -FI_EINTR || n == -FI_ECANCELED ||
        n == 0) {
      return 0;
    }
    if (n != -FI_EAVAIL) {
      Fatal(FiError("fi_cq_read", static_cast<int>(n)));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return 0;
    }
    fi_cq_err_entry err{};
    const ssize_t got = fi_cq_readerr(cq_.get(), &err, 0);
    if (got <= 0) {
      Fatal(FiError("fi_cq_readerr after -FI_EAVAIL", static_cast<int>(got == 0 ? -FI_EOTHER
                                                                                 : got)));
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return 0;
    }
    const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, nullptr, 0);
    const std::string error =
        std::string(fi_strerror(err.err)) + (detail ? std::string(": ") + detail : "");
    if (err.op_context == nullptr) {
      // An error of the provider's own (e.g. a connection it gave up on),
      // tied to no operation: the operations it affects fail on their own.
      if (queue_errors_.fetch_add(1) < 10) {
        std::fprintf(stderr, "herring_jax: completion-queue error without an operation: %s\n",
                     error.c_str());
      }
      return 1;
    }
    Completion c;
    c.ok = false;
    c.len = err.len;
    c.tag = err.tag;
    c.truncated = err.err == FI_ETRUNC;
    c.cut_off = c.truncated ? err.olen : 0;
    c.error = error;
    if (c.truncated) {
      char tag[32];
      std::snprintf(tag, sizeof(tag), "0x%016llx", static_cast<unsigned long long>(err.tag));
      c.error += " (" + std::to_string(err.len) + " bytes received, " +
                 std::to_string(err.olen) + " more cut off, tag " + tag + ")";
    }
    Finish(static_cast<Op*>(err.op_context), c);
    return 1;
  }

  // The progress thread runs for microseconds at a time, but a woken thread
  // waits its turn behind the threads that keep the cores busy (the host
  // stage's copies, XLA's compute): with 4 processes on 2 cores the host
  // stage's messages took 1.6-1.8 ms at the 90th percentile. EEVDF (Linux
  // 6.12+) lets a SCHED_OTHER thread ask for a shorter slice, which brings
  // its wake-ups forward (0.9 ms there) with no privilege; older kernels
  // ignore the field. The policy, nice value and reset-on-fork stay; failure
  // changes nothing, so it is not reported.
  static void AskForShortSlice(int us) {
    struct SchedAttr {  // the kernel's struct sched_attr, version 0 (48 bytes)
      uint32_t size;
      uint32_t policy;
      uint64_t flags;
      int32_t nice;
      uint32_t priority;
      uint64_t runtime;
      uint64_t deadline;
      uint64_t period;
    } attr{};
    if (syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0) != 0) return;
    if (attr.policy != SCHED_OTHER) return;
    attr.size = sizeof(attr);
    attr.flags &= 0x01;  // SCHED_FLAG_RESET_ON_FORK, the only flag of SCHED_OTHER to keep
    attr.runtime = static_cast<uint64_t>(us) * 1000;
    syscall(SYS_sched_setattr, 0, &attr, 0);
  }

  // Wakes the progress thread wherever it waits: on work_cv_, or in
  // fi_cq_sread (fi_cq_signal).
  void Wake() {
    work_cv_.notify_one();
    if (can_wait_) fi_cq_signal(cq_.get());
  }

  // Drives the provider. Providers such as tcp;ofi_rxm and EFA make progress
  // only when their completion queue is read, so while operations are in
  // flight the thread reads it continuously: blocking in fi_cq_sread where the
  // provider has a wait object, else polling and backing off. When nothing is
  // posted it sleeps on a condition variable (woken by Post) and still reads
  // the queue every millisecond, so that peers' connection requests and early
  // messages are answered. Some providers' sread spins (shm), which is why an
  // idle endpoint never calls it: an idle process must leave the cores to
  // XLA and to the other processes. Over tcp (block_ms_) the thread sleeps
  // in sread, idle or not, up to 100 ms, and every post wakes it. Every round
  // also posts what waits in the transport's queue.
  void ProgressLoop() {
    if (progress_slice_us_ > 0) AskForShortSlice(progress_slice_us_);
    int idle = 0;
    while (running_) {
      PostQueued();
      // Never block in sread while posts wait in the queue: shm's sread
      // does not return within its timeout when nothing completes, and the
      // queued post that would complete something would never be retried.
      // Over tcp it sleeps there idle or not, until a socket is ready or
      // Wake (a post, a cancel, shutdown): an idle process wakes about ten
      // times a second instead of a thousand.
      if (can_wait_ && pending_count_.load() == 0 &&
          (block_ms_ > 1 || outstanding_.load() > 0)) {
        PollOnce(block_ms_);
        continue;
      }
      if (outstanding_.load() == 0) {
        {
          std::unique_lock<std::mutex> lock(work_mu_);
          work_cv_.wait_for(lock, std::chrono::milliseconds(1),
                            [this] { return outstanding_.load() > 0 || !running_; });
        }
        PollOnce();
        idle = 0;
        continue;
      }
      if (PollOnce() > 0) {
        idle = 0;
      } else if (++idle < 256) {
        sched_yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(10));
      }
    }
  }

  InfoPtr info_;
  FidPtr<fid_fabric> fabric_;
  FidPtr<fid_domain> domain_;
  FidPtr<fid_cq> cq_;
  FidPtr<fid_av> av_;
  FidPtr<fid_ep> ep_;
  std::vector<uint8_t> address_;
  std::vector<fi_addr_t> peers_;
  std::unique_ptr<std::atomic<bool>[]> unreachable_;  // [rank]
  bool force_mr_ = false;
  bool no_provider_ = false;
  bool directed_ = false;  // FI_DIRECTED_RECV: receives from one peer's address
  bool sources_ = false;   // FI_SOURCE: completions name their sender
  double post_timeout_s_ = 300.0;
  bool need_mr_ = false;
  bool prov_key_ = false;
  bool can_wait_ = false;
  // How long the progress thread may sleep in fi_cq_sread (can_wait_ only).
  int block_ms_ = 1;
  int progress_slice_us_ = 0;
  std::atomic<uint64_t> next_key_{1};
  std::function<void(const std::string&)> fatal_handler_;
  std::once_flag fatal_once_;

  // Posting (post_mu_): operations handed to the provider per direction
  // (at most its budget), and those waiting for room, with their count per
  // lane (0: receives; 1 + rank: sends to that rank).
  std::mutex post_mu_;
  size_t max_posted_ = 0;
  size_t send_budget_ = kCqSize / 2;
  size_t recv_budget_ = kCqSize / 2;
  size_t posted_sends_ = 0;
  size_t posted_recvs_ = 0;
  std::list<Op*> pending_;
  std::atomic<size_t> pending_count_{0};  // pending_.size(), read without post_mu_
  std::vector<size_t> lane_pending_ = std::vector<size_t>(1, 0);

  std::mutex ops_mu_;
  std::vector<std::unique_ptr<Op>> all_ops_;
  std::deque<Op*> free_ops_;

  std::atomic<bool> running_{false};
  std::atomic<bool> stop_waiting_{false};
  std::atomic<size_t> outstanding_{0};
  std::atomic<uint64_t> posts_queued_{0};
  std::atomic<uint64_t> sends_{0};
  std::atomic<uint64_t> send_bytes_{0};

  void CountSend(const IoVec* iov, size_t iov_count) {
    size_t bytes = 0;
    for (size_t i = 0; i < iov_count; ++i) bytes += iov[i].len;
    sends_.fetch_add(1, std::memory_order_relaxed);
    send_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  }
  std::atomic<uint64_t> duplicates_{0};
  std::atomic<uint64_t> queue_errors_{0};
  std::thread progress_;
  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::mutex live_mu_;
  std::unordered_set<Op*> live_;
};

}  // namespace

std::unique_ptr<Transport> CreateFabricTransport(const TransportOptions& options,
                                                 Status* status) {
  if (!options.provider.empty()) {
    auto transport = std::make_unique<FabricTransport>();
    *status = transport->Open(options);
    if (!status->ok()) {
      if (transport->no_provider()) *status = Status::Error(MissingProvider(status->message()));
      return nullptr;
    }
    return transport;
  }
  // Default: EFA where the machine has it, else TCP with the RDM utility layer.
  std::string errors;
  bool missing = true;
  for (const char* provider : {"efa", "tcp;ofi_rxm"}) {
    TransportOptions attempt = options;
    attempt.provider = provider;
    auto transport = std::make_unique<FabricTransport>();
    *status = transport->Open(attempt);
    if (status->ok()) return transport;
    missing = missing && transport->no_provider();
    errors += std::string(errors.empty() ? "" : "; ") + status->message();
  }
  *status = Status::Error(missing ? MissingProvider(errors) : errors);
  return nullptr;
}

}  // namespace herring::transport
