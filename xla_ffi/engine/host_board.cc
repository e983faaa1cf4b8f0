#include "engine/host_board.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <algorithm>
#include <cstring>
#include <ctime>

namespace herring::engine {

namespace {

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
constexpr long kSysFutexWaitv = 449;  // the same number on x86-64 and aarch64

std::string Errno(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

uint32_t* Word(const std::atomic<uint32_t>& w) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex word");
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint32_t>*>(&w));
}

// Where a call's posting is looked for first: the identity's tag bits (the
// same mix the transport's tags use).
int Home(const BoardKey& key, int postings) {
  return static_cast<int>(IdentityTagBits(key.id, key.stream) % static_cast<uint64_t>(postings));
}

}  // namespace

HostBoard::HostBoard() {
  fd_ = static_cast<int>(
      syscall(SYS_memfd_create, "herring-host-board", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd_ < 0) {
    error_ = Errno("memfd_create");
    return;
  }
  if (ftruncate(fd_, sizeof(Page)) != 0) {
    error_ = Errno("ftruncate of the board");
    return;
  }
  void* m = mmap(nullptr, sizeof(Page), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (m == MAP_FAILED) {
    error_ = Errno("mmap of the board");
    return;
  }
  own_ = static_cast<Page*>(m);  // zero-filled: every posting free, version 0
  // Every process of the host can take this descriptor (pidfd_getfd). Sealed,
  // no holder can shrink the board under its mappings (which would end the
  // owner and every reader with SIGBUS at their next access), grow it, or map
  // it writable from now on (F_SEAL_FUTURE_WRITE, Linux 5.1+; this process's
  // own writable mapping above stays), and no seal can be taken off again.
  // Without the seals the board is not offered (error_): the host's steps
  // then go as transport messages.
  int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
#ifdef F_SEAL_FUTURE_WRITE
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_FUTURE_WRITE) != 0 && errno != EINVAL) {
    error_ = Errno("sealing the board against writers (F_SEAL_FUTURE_WRITE)");
    return;
  }
#endif
  if (fcntl(fd_, F_ADD_SEALS, seals) != 0) {
    error_ = Errno("sealing the board (F_ADD_SEALS)");
    return;
  }
}

HostBoard::~HostBoard() {
  for (size_t i = 0; i < peers_.size(); ++i) {
    if (peers_[i] != nullptr && peers_[i] != own_) munmap(peers_[i], sizeof(Page));
  }
  if (own_ != nullptr) munmap(own_, sizeof(Page));
  if (fd_ >= 0) close(fd_);
}

void HostBoard::SetSelf(int index) {
  self_ = index;
  if (index >= 0 && index < kPeers) peers_[index] = own_;
}

std::string HostBoard::Attach(int index, int64_t pid, int fd) {
  if (!error_.empty()) return error_;
  if (index < 0 || index >= kPeers) {
    return "more than " + std::to_string(kPeers) + " processes on the host";
  }
  const int pidfd = static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd < 0) return Errno("pidfd_open");
  const int local = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd, fd, 0));
  const int err = errno;
  close(pidfd);
  if (local < 0) {
    errno = err;
    return Errno("pidfd_getfd");
  }
  // Read-only: a process writes only its own board.
  void* m = mmap(nullptr, sizeof(Page), PROT_READ, MAP_SHARED, local, 0);
  const int map_err = errno;
  close(local);
  if (m == MAP_FAILED) {
    errno = map_err;
    return Errno("mmap of a peer's board");
  }
  if (peers_[index] != nullptr && peers_[index] != own_) munmap(peers_[index], sizeof(Page));
  peers_[index] = static_cast<Page*>(m);
  return "";
}

int HostBoard::Acquire(const BoardKey& key, size_t num) {
  if (own_ == nullptr || num > static_cast<size_t>(kEntries)) return -1;
  int k = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int home = Home(key, kPostings);
    for (int i = 0; i < kPostings && k < 0; ++i) {
      const int at = (home + i) % kPostings;
      if (free_[at]) k = at;
    }
    if (k < 0) return -1;
    free_[k] = false;
  }
  Posting& p = own_->postings[k];
  p.version.fetch_add(1, std::memory_order_acq_rel);  // odd: being rewritten
  std::atomic_thread_fence(std::memory_order_release);
  p.steps.store(0, std::memory_order_relaxed);
  p.key = key;
  p.num = static_cast<uint32_t>(num);
  p.version.fetch_add(1, std::memory_order_release);  // even: stable
  return k;
}

void HostBoard::Publish(int k, int step, const HostEntry* entries, size_t num) {
  Posting& p = own_->postings[k];
  std::memcpy(p.entries[step], entries, num * sizeof(HostEntry));
  p.steps.fetch_or(1u << step, std::memory_order_release);
  Bump();
}

void HostBoard::Release(int k) {
  own_->postings[k].steps.store(0, std::memory_order_release);
  std::lock_guard<std::mutex> lock(mu_);
  free_[k] = true;
}

void HostBoard::Withdraw(int k) {
  own_->postings[k].steps.fetch_or(kWithdrawnBit, std::memory_order_seq_cst);
  Bump();  // wakes the readers that wait for this posting's next step
}

bool HostBoard::StillPosted(int index, int k, uint32_t version) const {
  const Posting& p = peers_[index]->postings[k];
  // seq_cst, after the reads (system calls that have returned): a withdrawal
  // not seen here was made after them.
  return !(p.steps.load(std::memory_order_seq_cst) & kWithdrawnBit) &&
         p.version.load(std::memory_order_seq_cst) == version;
}

void HostBoard::Bump() {
  own_->generation.fetch_add(1, std::memory_order_acq_rel);
  syscall(SYS_futex, Word(own_->generation), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

int HostBoard::Find(int index, const BoardKey& key, int step, std::vector<HostEntry>* out,
                    uint32_t* version) const {
  const Page* page = peers_[index];
  const int home = Home(key, kPostings);
  for (int i = 0; i < kPostings; ++i) {
    const int k = (home + i) % kPostings;
    const Posting& p = page->postings[k];
    const uint32_t v = p.version.load(std::memory_order_acquire);
    if (v & 1u) continue;
    const uint32_t steps = p.steps.load(std::memory_order_acquire);
    if (!(steps & ((1u << step) | kWithdrawnBit))) continue;
    if (p.key.stream != key.stream || p.key.id != key.id) continue;
    if (steps & kWithdrawnBit) {
      // The key was read while the version was stable: this call's posting.
      std::atomic_thread_fence(std::memory_order_acquire);
      if (p.version.load(std::memory_order_relaxed) == v) return kWithdrawnPosting;
      continue;
    }
    const size_t num = std::min<size_t>(p.num, kEntries);
    out->assign(p.entries[step], p.entries[step] + num);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (p.version.load(std::memory_order_relaxed) != v) continue;  // rewritten meanwhile
    *version = v;
    return k;
  }
  return -1;
}

void HostBoard::Ack(int index, int k, uint32_t version) {
  own_->acks[index][k].store(version, std::memory_order_release);
}

uint32_t HostBoard::Generation(int index) const {
  return peers_[index]->generation.load(std::memory_order_acquire);
}

void HostBoard::WaitAny(const std::vector<int>& indices, const std::vector<uint32_t>& seen,
                        int timeout_us) const {
  if (indices.empty()) return;
  if (indices.size() > 1 && waitv_.load(std::memory_order_relaxed)) {
    // struct futex_waitv of <linux/futex.h> (5.16+), spelt out for older headers.
    struct Waiter {
      uint64_t val;
      uint64_t uaddr;
      uint32_t flags;
      uint32_t reserved;
    };
    constexpr uint32_t kFutex32 = 2;  // FUTEX2_SIZE_U32; shared (not FUTEX2_PRIVATE)
    Waiter waiters[kPeers];
    const size_t n = std::min<size_t>(indices.size(), kPeers);
    for (size_t i = 0; i < n; ++i) {
      waiters[i] = {seen[i], reinterpret_cast<uint64_t>(Word(peers_[indices[i]]->generation)),
                    kFutex32, 0};
    }
    timespec until{};
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_nsec += static_cast<long>(timeout_us) * 1000;
    until.tv_sec += until.tv_nsec / 1000000000;
    until.tv_nsec %= 1000000000;
    if (syscall(kSysFutexWaitv, waiters, n, 0, &until, CLOCK_MONOTONIC) >= 0 ||
        errno != ENOSYS) {
      return;
    }
    waitv_.store(false, std::memory_order_relaxed);
  }
  const int slice = indices.size() > 1 ? std::min(timeout_us, 200) : timeout_us;
  timespec ts{slice / 1000000, static_cast<long>(slice % 1000000) * 1000};
  syscall(SYS_futex, Word(peers_[indices[0]]->generation), FUTEX_WAIT, seen[0], &ts, nullptr,
          0);
}

}  // namespace herring::engine
