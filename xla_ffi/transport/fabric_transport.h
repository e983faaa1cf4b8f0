// The libfabric transport's endpoint, shared by the files that implement it:
// fabric_setup.cc (the provider, the endpoint, the peers' addresses),
// fabric_posting.cc (operations handed to the provider or queued for room)
// and fabric_progress.cc (the progress thread and completions). One
// FI_EP_RDM endpoint with tagged messages, one completion queue polled by a
// progress thread. These are the only files of herring_jax that call fi_*;
// the engine sees transport.h.
#ifndef HERRING_TRANSPORT_FABRIC_TRANSPORT_H_
#define HERRING_TRANSPORT_FABRIC_TRANSPORT_H_

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "transport/transport.h"

namespace herring::transport::fabric {

constexpr uint32_t kFabricVersion = FI_VERSION(1, 9);
constexpr int kCqBatch = 16;
constexpr size_t kCqSize = 16384;
constexpr size_t kMaxIov = 4;
constexpr size_t kRecycleDistance = 1024;

// "what failed: libfabric's text (code)".
std::string FiError(const char* what, int ret);

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

inline int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class FabricTransport final : public Transport {
 public:
  ~FabricTransport() override { Shutdown(); }

  // Set-up (fabric_setup.cc).
  Status Open(const TransportOptions& options);

  std::vector<uint8_t> Address() const override { return address_; }
  // Open failed because fi_getinfo found no such provider.
  bool no_provider() const { return no_provider_; }

  void SetFatalHandler(std::function<void(const std::string&)> handler) override {
    fatal_handler_ = std::move(handler);
  }

  Status SetPeers(const std::vector<std::vector<uint8_t>>& addrs) override;
  std::string Describe() const override;

  // Posting (fabric_posting.cc).
  Status Send(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
              Callback done) override;
  Status SendControl(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                     Callback done) override;
  Status TrySend(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                 Callback done) override;
  void SetPeerUnreachable(int peer) override;
  void StopWaiting() override;
  Status Recv(uint64_t tag, uint64_t ignore, const IoVec* iov, size_t iov_count,
              Callback done, bool background, int from) override;
  void CancelAll() override;
  void Shutdown() override;

  size_t MaxMessageBytes() const override { return info_->ep_attr->max_msg_size; }

  size_t Outstanding() const override { return outstanding_.load(); }

  TransportStats Stats() const override {
    // data_sends_ first: Send counts in sends_ and then (seq_cst) in
    // data_sends_, so a snapshot never holds more data sends than sends.
    const uint64_t data_sends = data_sends_.load();
    return TransportStats{posts_queued_.load(), duplicates_.load(), queue_errors_.load(),
                          sends_.load(), send_bytes_.load(), data_sends};
  }

 private:
  // Posting (fabric_posting.cc). `peer` is the destination rank of a send
  // (-1 for receives); a send with `may_queue` false fails at once where it
  // would have to queue; a `control` one queues also after StopWaiting.
  Op* NewOp();
  void Recycle(Op* op);
  Status Post(bool is_recv, fi_addr_t addr, uint64_t tag, uint64_t ignore, const IoVec* iov,
              size_t iov_count, Callback done, bool background = false, int peer = -1,
              bool may_queue = true, bool control = false);
  size_t Lane(const Op& op) const { return op.is_recv ? 0 : static_cast<size_t>(op.peer) + 1; }
  bool HasBudget(const Op& op) const;
  ssize_t PostToProvider(Op* op);
  void PostQueued();
  void CountSend(const IoVec* iov, size_t iov_count);

  // Progress and completions (fabric_progress.cc).
  int RankOf(fi_addr_t addr) const;
  size_t LiveOps();
  void Forget(Op* op);
  static void ReleaseRegistrations(Op* op);
  void Finish(Op* op, const Completion& c);
  void Fatal(const std::string& why);
  int PollOnce(int wait_ms = 0);
  static void AskForShortSlice(int us);
  void Wake();
  void ProgressLoop();

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
  std::atomic<uint64_t> data_sends_{0};

  std::atomic<uint64_t> duplicates_{0};
  std::atomic<uint64_t> queue_errors_{0};
  std::thread progress_;
  std::mutex work_mu_;
  std::condition_variable work_cv_;
  std::mutex live_mu_;
  std::unordered_set<Op*> live_;
};

}  // namespace herring::transport::fabric

#endif  // HERRING_TRANSPORT_FABRIC_TRANSPORT_H_
