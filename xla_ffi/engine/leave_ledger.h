// The bookkeeping of the leave protocol (departures.cc): per peer, the data
// messages (contributions and results) this process sent to it and took in
// from it, what the peer's kLeave said of the same, and its receipt.
//
// Why counts. A send completes once the provider has the bytes (over
// tcp;ofi_rxm, once they are in the socket's buffer), so a process that
// closes its endpoint after its last reduction can take its last messages
// with it: a close with unread data resets the connection, and the peer's
// receive fails. And a kLeave can overtake the data sent before it where the
// provider does not order messages (shm, udp;ofi_rxd). The counts settle both
// exactly, without a grace period:
//   - the leaver waits until each peer has confirmed (a kReceipt, or its own
//     kLeave) that it took in every data message the leaver sent it;
//   - a peer whose reduction still lacks data of a rank that left knows
//     whether that data is on its way (taken in < sent: wait) or was never
//     sent (taken in == sent: the leaver never ran that reduction).
// Host-stage steps over the boards never cross the transport; a leaver's
// host-stage sends end before it leaves (its lingering batches wait for their
// readers), and they are not counted.
#ifndef HERRING_ENGINE_LEAVE_LEDGER_H_
#define HERRING_ENGINE_LEAVE_LEDGER_H_

#include <atomic>
#include <cstdint>
#include <memory>

namespace herring::engine {

class LeaveLedger {
 public:
  void Reset(int ranks) {
    peers_.reset(new Peer[ranks]);
  }

  // A data message to `peer` was posted (its send will complete or fail the
  // batch, which then breaks the communicator: no leave follows).
  void Sent(int peer) { peers_[peer].sent.fetch_add(1); }
  // A data message from `peer` passed its header check. Called after the
  // batch counted it (contribs_from, results_from): whoever sees the total
  // here sees the batch's count too.
  void Took(int peer) { peers_[peer].took.fetch_add(1); }
  uint64_t sent(int peer) const { return peers_[peer].sent.load(); }
  uint64_t took(int peer) const { return peers_[peer].took.load(); }

  // `peer`'s kLeave: it sent this process `sent_here` data messages and took
  // in `took_from_here` of this process's (final: its reductions have ended).
  void PeerLeft(int peer, uint64_t sent_here, uint64_t took_from_here, int64_t now_ns) {
    Peer& p = peers_[peer];
    p.leave_sent.store(sent_here);
    p.leave_took.store(took_from_here);
    p.left_ns.store(now_ns);  // last: Left() implies both counts are set
  }
  bool Left(int peer) const { return peers_[peer].left_ns.load() != 0; }
  int64_t left_ns(int peer) const { return peers_[peer].left_ns.load(); }
  // Every data message the rank that left sent here has been taken in.
  bool AllArrived(int peer) const {
    const Peer& p = peers_[peer];
    return p.left_ns.load() != 0 && p.took.load() >= p.leave_sent.load();
  }
  // Once: whether a receipt is due to `peer` now (it left, and all its data
  // is here).
  bool TakeReceiptDue(int peer) {
    return AllArrived(peer) && !peers_[peer].receipt_sent.exchange(true);
  }
  bool ReceiptSent(int peer) const { return peers_[peer].receipt_sent.load(); }

  // `peer`'s kReceipt: it took in `took_from_here` of this process's data
  // messages (and has this process's kLeave).
  void Receipt(int peer, uint64_t took_from_here) {
    peers_[peer].receipt.store(static_cast<int64_t>(took_from_here));
  }
  // Whether `peer` has said that it took in every data message this process
  // sent it: in a receipt (which also says it has this process's kLeave), or
  // in its own kLeave (final: nothing it does later needs more of ours).
  bool Confirmed(int peer) const {
    const Peer& p = peers_[peer];
    const uint64_t sent = p.sent.load();
    const int64_t receipt = p.receipt.load();
    if (receipt >= 0 && static_cast<uint64_t>(receipt) >= sent) return true;
    return p.left_ns.load() != 0 && p.leave_took.load() >= sent;
  }

  // A send to `peer` failed while this process was leaving: its endpoint is
  // gone (it closed, or died), so it reads nothing more of ours.
  void MarkGone(int peer) { peers_[peer].gone.store(true); }
  bool Gone(int peer) const { return peers_[peer].gone.load(); }

  // This leaving process waits no longer for `peer` (it confirmed, or is
  // gone, dead or exited): heartbeats to it stop.
  void MarkReleased(int peer) { peers_[peer].released.store(true); }
  bool Released(int peer) const { return peers_[peer].released.load(); }

 private:
  struct Peer {
    std::atomic<uint64_t> sent{0};
    std::atomic<uint64_t> took{0};
    std::atomic<uint64_t> leave_sent{0};
    std::atomic<uint64_t> leave_took{0};
    std::atomic<int64_t> left_ns{0};
    std::atomic<int64_t> receipt{-1};
    std::atomic<bool> receipt_sent{false};
    std::atomic<bool> gone{false};
    std::atomic<bool> released{false};
  };
  std::unique_ptr<Peer[]> peers_;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_LEAVE_LEDGER_H_
