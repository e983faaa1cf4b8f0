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

#include <algorithm>
#include <arpa/inet.h>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_set>

#include "transport/transport.h"

namespace herring::transport {
namespace {

constexpr uint32_t kFabricVersion = FI_VERSION(1, 9);
constexpr int kCqBatch = 16;
constexpr size_t kCqSize = 4096;
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
      std::fprintf(stderr, "herring_jax: fi_close failed: %s\n", fi_strerror(-ret));
    }
  }
};
template <typename T>
using FidPtr = std::unique_ptr<T, FidCloser<T>>;

struct InfoDeleter {
  void operator()(fi_info* info) const { fi_freeinfo(info); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoDeleter>;

bool LooksLikeIpAddress(const std::string& s) {
  unsigned char buf[16];
  return inet_pton(AF_INET, s.c_str(), buf) == 1 || inet_pton(AF_INET6, s.c_str(), buf) == 1;
}

// One posted operation. fi_context2 comes first so the provider's
// FI_CONTEXT/FI_CONTEXT2 scratch space is the op itself.
struct Op {
  fi_context2 ctx;
  Callback done;
  std::vector<fid_mr*> mrs;
  bool is_recv = false;
  bool counted = true;  // in outstanding_ (background receives are not)
};

class FabricTransport final : public Transport {
 public:
  ~FabricTransport() override { Close(); }

  Status Open(const TransportOptions& options) {
    force_mr_ = options.force_mr;
    post_timeout_s_ = options.post_timeout_s;
    InfoPtr hints(fi_allocinfo());
    if (!hints) return Status::Error("fi_allocinfo failed");
    hints->caps = FI_TAGGED;
    hints->ep_attr->type = FI_EP_RDM;
    // Only the mode bits this file honours (FI_CONTEXT/2 via Op::ctx).
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->domain_attr->mr_mode =
        FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
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
    fi_info* raw = nullptr;
    int ret = fi_getinfo(kFabricVersion, node, nullptr, flags, hints.get(), &raw);
    if (ret != 0 || raw == nullptr) {
      return Status::Error("no libfabric provider '" + options.provider +
                           "' with FI_EP_RDM and FI_TAGGED" +
                           (node ? std::string(" on ") + node : std::string()) + ": " +
                           fi_strerror(-ret) +
                           ". Check `fi_info -p <provider>` and HERRING_FI_PROVIDER.");
    }
    info_.reset(raw);
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

    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.size = kCqSize;
    // A wait object lets the progress thread sleep in the kernel until data
    // arrives instead of spinning; providers without one (EFA) are polled.
    cq_attr.wait_obj = FI_WAIT_UNSPEC;
    fid_cq* cq = nullptr;
    ret = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr);
    if (ret != 0) {
      cq_attr.wait_obj = FI_WAIT_NONE;
      if ((ret = fi_cq_open(domain_.get(), &cq_attr, &cq, nullptr)) != 0)
        return Status::Error(FiError("fi_cq_open", ret));
    } else {
      can_wait_ = true;
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

  Status SetPeers(const std::vector<std::vector<uint8_t>>& addrs) override {
    peers_.assign(addrs.size(), FI_ADDR_NOTAVAIL);
    unreachable_.reset(new std::atomic<bool>[addrs.size()]());
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
    return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
                /*background=*/false, peer, /*may_wait=*/true);
  }

  Status TrySend(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                 Callback done) override {
    if (peer < 0 || static_cast<size_t>(peer) >= peers_.size())
      return Status::Error("send to unknown rank " + std::to_string(peer));
    return Post(/*is_recv=*/false, peers_[peer], tag, 0, iov, iov_count, std::move(done),
                /*background=*/false, peer, /*may_wait=*/false);
  }

  void SetPeerUnreachable(int peer) override {
    if (peer >= 0 && static_cast<size_t>(peer) < peers_.size()) unreachable_[peer] = true;
  }

  void StopWaiting() override { stop_waiting_ = true; }

  Status Recv(uint64_t tag, uint64_t ignore, const IoVec* iov, size_t iov_count,
              Callback done, bool background) override {
    return Post(/*is_recv=*/true, FI_ADDR_UNSPEC, tag, ignore, iov, iov_count, std::move(done),
                background);
  }

  void CancelAll() override {
    std::lock_guard<std::mutex> lock(live_mu_);
    for (Op* op : live_) {
      if (op->is_recv) fi_cancel(&ep_->fid, op);
    }
  }

  size_t MaxMessageBytes() const override { return info_->ep_attr->max_msg_size; }

  std::string Describe() const override {
    return std::string(info_->fabric_attr->prov_name) + " (fabric " +
           info_->fabric_attr->name + ", domain " + info_->domain_attr->name +
           (need_mr_ ? ", registered buffers" : "") +
           (can_wait_ ? ", blocking progress" : ", polled progress") + ")";
  }

  size_t Outstanding() const override { return outstanding_.load(); }

 private:
  // `peer` is the destination rank of a send (-1 for receives); a send with
  // `may_wait` false gives up at the first -FI_EAGAIN.
  Status Post(bool is_recv, fi_addr_t addr, uint64_t tag, uint64_t ignore, const IoVec* iov,
              size_t iov_count, Callback done, bool background = false, int peer = -1,
              bool may_wait = true) {
    if (iov_count == 0 || iov_count > kMaxIov || iov_count > info_->tx_attr->iov_limit)
      return Status::Error("bad iov count " + std::to_string(iov_count));
    auto op = std::make_unique<Op>();
    std::memset(&op->ctx, 0, sizeof(op->ctx));
    op->done = std::move(done);
    op->is_recv = is_recv;
    op->counted = !background;
    iovec iovs[kMaxIov];
    void* desc[kMaxIov] = {};
    for (size_t i = 0; i < iov_count; ++i) {
      iovs[i].iov_base = iov[i].base;
      iovs[i].iov_len = iov[i].len;
      if (need_mr_ && iov[i].len > 0) {
        fid_mr* mr = nullptr;
        uint64_t key = prov_key_ ? 0 : next_key_.fetch_add(1);
        int ret = fi_mr_reg(domain_.get(), iov[i].base, iov[i].len, FI_SEND | FI_RECV, 0, key,
                            0, &mr, nullptr);
        if (ret != 0) {
          ReleaseRegistrations(op.get());
          return Status::Error(FiError("fi_mr_reg", ret));
        }
        op->mrs.push_back(mr);
        desc[i] = fi_mr_desc(mr);
      }
    }
    Op* raw = op.release();
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      live_.insert(raw);
    }
    if (raw->counted) outstanding_.fetch_add(1);
    // -FI_EAGAIN means the provider's queues are full: the progress thread
    // drains them, so wait for it rather than fail, but not forever (a peer
    // that died keeps its connection's queue full).
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(post_timeout_s_));
    for (int spins = 0;; ++spins) {
      ssize_t ret = is_recv
                        ? fi_trecvv(ep_.get(), iovs, desc, iov_count, addr, tag, ignore, raw)
                        : fi_tsendv(ep_.get(), iovs, desc, iov_count, addr, tag, raw);
      if (ret == 0) break;
      const bool busy = ret == -FI_EAGAIN;
      const bool expired = busy && std::chrono::steady_clock::now() > deadline;
      const bool give_up =
          busy && (stop_waiting_.load() ||
                   (peer >= 0 && (!may_wait || unreachable_[peer].load())));
      if (!busy || !running_ || expired || give_up) {
        Forget(raw);
        ReleaseRegistrations(raw);
        delete raw;
        const char* what = is_recv ? "fi_trecvv" : "fi_tsendv";
        if (give_up) {
          return Status::Error(
              std::string(what) + " is busy (-FI_EAGAIN)" +
              (stop_waiting_.load() ? " after a failure"
               : may_wait           ? " and rank " + std::to_string(peer) + " is unreachable"
                                    : std::string()));
        }
        return Status::Error(
            expired ? std::string(what) + " stayed busy (-FI_EAGAIN) for " +
                          std::to_string(static_cast<int>(post_timeout_s_)) +
                          " s: the peer is unreachable or not making progress"
                    : FiError(what, static_cast<int>(ret)));
      }
      if (spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
      else sched_yield();
    }
    work_cv_.notify_one();
    return Status::Ok();
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
    Forget(op);
    ReleaseRegistrations(op);
    op->done(c);
    delete op;
  }

  // Returns the number of completions handled. With `wait_ms` > 0 and a
  // wait object, blocks up to that long for the first completion.
  int PollOnce(int wait_ms = 0) {
    fi_cq_tagged_entry entries[kCqBatch];
    ssize_t n = wait_ms > 0 && can_wait_
                    ? fi_cq_sread(cq_.get(), entries, kCqBatch, nullptr, wait_ms)
                    : fi_cq_read(cq_.get(), entries, kCqBatch);
    if (n > 0) {
      for (ssize_t i = 0; i < n; ++i) {
        Completion c;
        c.len = entries[i].len;
        c.tag = entries[i].tag;
        Finish(static_cast<Op*>(entries[i].op_context), c);
      }
      return static_cast<int>(n);
    }
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(cq_.get(), &err, 0) > 0 && err.op_context != nullptr) {
        Completion c;
        c.ok = false;
        c.len = err.len;
        c.tag = err.tag;
        c.truncated = err.err == FI_ETRUNC;
        const char* detail = fi_cq_strerror(cq_.get(), err.prov_errno, err.err_data, nullptr, 0);
        c.error = std::string(fi_strerror(err.err)) + (detail ? std::string(": ") + detail : "");
        Finish(static_cast<Op*>(err.op_context), c);
        return 1;
      }
    }
    return 0;
  }

  // Drives the provider. Providers such as tcp;ofi_rxm and EFA make progress
  // only when their completion queue is read, so while operations are in
  // flight the thread reads it continuously: blocking in fi_cq_sread where the
  // provider has a wait object, else polling and backing off. When nothing is
  // posted it sleeps on a condition variable (woken by Post) and still reads
  // the queue every millisecond, so that peers' connection requests and early
  // messages are answered. Some providers' sread spins (shm), which is why an
  // idle endpoint never calls it: an idle process must leave the cores to
  // XLA and to the other processes.
  void ProgressLoop() {
    int idle = 0;
    while (running_) {
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
      if (can_wait_) {
        PollOnce(/*wait_ms=*/1);
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

  void Close() {
    if (progress_.joinable()) {
      CancelAll();
      // Give canceled and in-flight operations a moment to complete so their
      // callbacks (which reference engine state) run before teardown.
      auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (LiveOps() > 0 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      running_ = false;
      work_cv_.notify_all();
      progress_.join();
    }
    {
      std::lock_guard<std::mutex> lock(live_mu_);
      for (Op* op : live_) {
        ReleaseRegistrations(op);
        delete op;
      }
      live_.clear();
    }
    ep_.reset();
    av_.reset();
    cq_.reset();
    domain_.reset();
    fabric_.reset();
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
  double post_timeout_s_ = 300.0;
  bool need_mr_ = false;
  bool prov_key_ = false;
  bool can_wait_ = false;
  std::atomic<uint64_t> next_key_{1};

  std::atomic<bool> running_{false};
  std::atomic<bool> stop_waiting_{false};
  std::atomic<size_t> outstanding_{0};
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
    if (!status->ok()) return nullptr;
    return transport;
  }
  // Default: EFA where the machine has it, else TCP with the RDM utility layer.
  std::string errors;
  for (const char* provider : {"efa", "tcp;ofi_rxm"}) {
    TransportOptions attempt = options;
    attempt.provider = provider;
    auto transport = std::make_unique<FabricTransport>();
    *status = transport->Open(attempt);
    if (status->ok()) return transport;
    errors += std::string(errors.empty() ? "" : "; ") + status->message();
  }
  *status = Status::Error(errors);
  return nullptr;
}

}  // namespace herring::transport
