// The host stage's shared-memory board: how the processes of one host tell
// each other where their inputs and result slices are, without the transport.
//
// Every process owns one board: an anonymous memfd that it alone writes and
// that the other processes of its host map read-only (MAP_SHARED through
// pidfd_getfd, which needs the same permission as process_vm_readv). The memfd
// is sealed: no holder can resize it (SIGBUS for its owner and readers) or map
// it writable. Nothing has a name, so nothing is left behind after a SIGKILL.
//
// A board holds postings, one per host-stage call in flight or lingering: the
// call's identity (stream, run, slot, instance, occurrence), its arrive
// entries (the inputs) and, once the slice is reduced, its ready entries
// (the staging buffers). Calls are matched by identity, never by order: XLA
// may start a process's independent calls in a different order on each
// process. A reader that has gathered a posting's slices records the
// posting's version in an ack table on its own board; the owner frees the
// posting (and the staging it names) once every reader's ack matches.
//
// Waiting: each board has a generation word, bumped after every publication,
// which readers wait on with futex (shared, so it works across processes) in
// bounded slices, checking between slices whether the call has failed.
#ifndef HERRING_ENGINE_HOST_BOARD_H_
#define HERRING_ENGINE_HOST_BOARD_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "engine/wire.h"
#include "transport/transport.h"

namespace herring::engine {

using transport::Status;

// A call's identity on the board: its stream and its first buffer's identity.
struct BoardKey {
  uint32_t stream = 0;
  Identity id;
};

class HostBoard {
 public:
  // Calls in flight or lingering at once in one process (a call waits for a
  // free posting up to the timeout), and buffers per call (more: that call
  // goes as messages). 2 MiB of address space per board, of which only the
  // pages of postings used become memory.
  static constexpr int kPostings = 256;
  static constexpr int kEntries = 128;
  static constexpr int kPeers = 64;        // processes per host (more: the messages)
  static constexpr int kSteps = 2;         // arrive, ready
  static constexpr uint32_t kWithdrawnBit = 1u << 31;

  HostBoard();
  ~HostBoard();
  HostBoard(const HostBoard&) = delete;
  HostBoard& operator=(const HostBoard&) = delete;

  // This process's board; "" or why it could not be created.
  const std::string& error() const { return error_; }
  int fd() const { return fd_; }

  // Maps the board of the process at host index `index` (pid `pid`, its
  // board's descriptor `fd` in that process). "" or why not.
  std::string Attach(int index, int64_t pid, int fd);

  // Takes a free posting of this board for `key` (-1: all in use).
  int Acquire(const BoardKey& key, size_t num);
  // Publishes step `step`'s entries of posting `k` (num of them).
  void Publish(int k, int step, const HostEntry* entries, size_t num);
  // Whether the process at host index `reader` has acked the current version
  // of this board's posting `k` (read its slices); `me`: this process's host
  // index.
  bool Acked(int reader, int me, int k) const {
    return peers_[reader]->acks[me][k].load(std::memory_order_acquire) ==
           own_->postings[k].version.load(std::memory_order_acquire);
  }
  // Makes posting `k` free again (its readers are done).
  void Release(int k);
  // Marks posting `k` withdrawn: its call failed and its inputs are going
  // away. Never released while this board lives (a reader may still know it).
  void Withdraw(int k);
  // Whether posting `k` of host index `index`'s board still is the version
  // `version` that was read, and not withdrawn.
  bool StillPosted(int index, int k, uint32_t version) const;

  // Looks for `key`'s step `step` on the board of host index `index`: copies
  // its entries (num, checked by the caller) into `out` and returns the
  // posting and its version; -1 if not published yet, kWithdrawnPosting if
  // the call's posting was withdrawn.
  static constexpr int kWithdrawnPosting = -2;
  int Find(int index, const BoardKey& key, int step, std::vector<HostEntry>* out,
           uint32_t* version) const;
  // This process has read the slices of posting `k` (version `version`) on the
  // board of host index `index`.
  void Ack(int index, int k, uint32_t version);
  // The generation of `index`'s board, and a wait of at most `timeout_us`
  // until the generation of one of the boards `indices` differs from what
  // `seen` says was read (futex_waitv, Linux 5.16+; before that, the first
  // board is waited on in slices of at most 200 us).
  uint32_t Generation(int index) const;
  void WaitAny(const std::vector<int>& indices, const std::vector<uint32_t>& seen,
               int timeout_us) const;

  void SetSelf(int index);

 private:
  struct alignas(64) Posting {
    std::atomic<uint32_t> version;  // odd while rewritten, even while stable
    std::atomic<uint32_t> steps;    // bit s: step s's entries are published;
                                    // kWithdrawnBit: withdrawn
    uint32_t num;
    BoardKey key;
    HostEntry entries[kSteps][kEntries];
  };
  struct Page {
    alignas(64) std::atomic<uint32_t> generation;
    // acks[i][k]: the version of host index i's posting k whose slices this
    // process has read.
    alignas(64) std::atomic<uint32_t> acks[kPeers][kPostings];
    Posting postings[kPostings];
  };

  void Bump();

  std::string error_;
  int fd_ = -1;
  int self_ = -1;
  Page* own_ = nullptr;
  std::vector<Page*> peers_ = std::vector<Page*>(kPeers, nullptr);  // [host index]
  std::mutex mu_;                                                   // free_
  std::vector<bool> free_ = std::vector<bool>(kPostings, true);
  mutable std::atomic<bool> waitv_{true};  // futex_waitv exists (until ENOSYS)
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_HOST_BOARD_H_
