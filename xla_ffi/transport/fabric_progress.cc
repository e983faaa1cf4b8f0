// The libfabric transport's progress (fabric_transport.h): the thread that
// reads the completion queue (blocking where the provider has a wait object),
// posts what waits for room, and completes each operation once.
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <string>
#include <utility>

#include "transport/fabric_transport.h"

namespace herring::transport::fabric {

// The rank whose address `addr` is (FI_AV_TABLE numbers them in insertion
// order, i.e. by rank), or kSourceUnknown: no peer of this job.
int FabricTransport::RankOf(fi_addr_t addr) const {
  if (addr == FI_ADDR_NOTAVAIL || addr == FI_ADDR_UNSPEC) return kSourceUnknown;
  if (addr < peers_.size() && peers_[addr] == addr) return static_cast<int>(addr);
  for (size_t r = 0; r < peers_.size(); ++r) {
    if (peers_[r] == addr) return static_cast<int>(r);
  }
  return kSourceUnknown;
}

size_t FabricTransport::LiveOps() {
  std::lock_guard<std::mutex> lock(live_mu_);
  return live_.size();
}

void FabricTransport::Forget(Op* op) {
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    live_.erase(op);
  }
  if (op->counted) outstanding_.fetch_sub(1);
}

void FabricTransport::ReleaseRegistrations(Op* op) {
  for (fid_mr* mr : op->mrs) fi_close(&mr->fid);
  op->mrs.clear();
}

void FabricTransport::Finish(Op* op, const Completion& c) {
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
void FabricTransport::Fatal(const std::string& why) {
  std::fprintf(stderr, "herring_jax: transport failure: %s\n", why.c_str());
  std::call_once(fatal_once_, [&] {
    if (fatal_handler_) fatal_handler_(why);
  });
}

// Returns the number of completions handled. With `wait_ms` > 0 and a
// wait object, blocks up to that long for the first completion.
int FabricTransport::PollOnce(int wait_ms) {
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
void FabricTransport::AskForShortSlice(int us) {
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
void FabricTransport::Wake() {
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
void FabricTransport::ProgressLoop() {
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

}  // namespace herring::transport::fabric
