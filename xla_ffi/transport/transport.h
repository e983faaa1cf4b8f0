// The transport interface the engine is written against: tagged, reliable,
// connectionless messages between ranks, completed through callbacks.
//
// The engine never sees libfabric. Everything provider-specific (memory
// registration, progress, message size limits, queueing on -FI_EAGAIN) lives
// behind this interface, so that a provider feature such as FI_HMEM (device
// memory sent directly) can be added inside the transport alone.
#ifndef HERRING_TRANSPORT_TRANSPORT_H_
#define HERRING_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace herring::transport {

// A small status type: the engine and transport report failures as values;
// nothing throws across the FFI boundary.
class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) {
    Status s;
    s.ok_ = false;
    s.message_ = std::move(message);
    return s;
  }
  bool ok() const { return ok_; }
  const std::string& message() const { return message_; }

 private:
  bool ok_ = true;
  std::string message_;
};

struct IoVec {
  void* base;
  size_t len;
};

// Completion::source where the sender's address is no rank's of this job, or
// where the provider does not report senders; Recv's `from` for any sender.
constexpr int kSourceUnknown = -1;
constexpr int kSourceUnchecked = -2;
constexpr int kAnyPeer = -1;

// Outcome of one posted operation, passed to its callback on the transport's
// progress thread. Callbacks must be short and must not block.
struct Completion {
  bool ok = true;
  size_t len = 0;       // bytes received (receives) or sent (sends)
  uint64_t tag = 0;     // the tag the message carried (receives)
  bool truncated = false;  // the message was longer than the posted buffers
  size_t cut_off = 0;      // truncated: bytes the provider says it cut off
  // Receives: the rank whose address the message came from, as the provider
  // saw it; kSourceUnknown where that address is no rank's of this job, and
  // kSourceUnchecked where the provider does not report sources.
  int source = kSourceUnchecked;
  std::string error;    // provider's description when !ok
};

using Callback = std::function<void(const Completion&)>;

struct TransportOptions {
  std::string provider;       // libfabric provider name, e.g. "tcp;ofi_rxm"
  std::string interface;      // network interface or node to bind, may be empty
  bool force_mr = false;      // register every buffer even if not required
  // How long a post may wait for room in the provider's queues (-FI_EAGAIN),
  // e.g. while a connection to an unreachable peer hangs.
  double post_timeout_s = 300.0;
  // Messages up to this size should be sent eagerly rather than by
  // rendezvous where the provider lets the transport choose (0: its default).
  size_t eager_bytes = 0;
  // At most this many operations of each direction (sends, receives) handed
  // to the provider at once; more wait in the transport's queue. 0: the
  // provider's queue sizes, within the completion queue's.
  size_t max_posted = 0;
  // The time slice the progress thread asks for (sched_setattr's
  // sched_runtime for SCHED_OTHER, Linux 6.12+); 0 keeps the kernel's.
  int progress_slice_us = 0;
};

struct TransportStats {
  uint64_t posts_queued = 0;           // posts that waited in the transport's queue
  uint64_t duplicate_completions = 0;  // second completions of one operation, ignored
  uint64_t queue_errors = 0;           // completion-queue errors without an operation
  uint64_t sends = 0;                  // messages handed to Send/TrySend (data and control)
  uint64_t send_bytes = 0;             // their bytes, headers included
  // Of `sends`, those handed to Send (the data path's chunks and the host
  // stage's messages; control messages go through SendControl and TrySend).
  // A counter of its own: a snapshot of two counters can split a control
  // send that one has counted and the other not yet.
  uint64_t data_sends = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  // This endpoint's address, to be published to the peers.
  virtual std::vector<uint8_t> Address() const = 0;

  // Installs the addresses of all ranks (index = rank). Must be called once
  // before any send.
  virtual Status SetPeers(const std::vector<std::vector<uint8_t>>& addrs) = 0;

  // Called at most once, on the progress thread, when the transport cannot go
  // on (its completion queue failed): operations in flight may never
  // complete. Set before SetPeers.
  virtual void SetFatalHandler(std::function<void(const std::string&)> handler) = 0;

  // Posts a send of the concatenation of `iov` to `peer` with `tag`. The
  // buffers must stay valid and unmodified until the callback runs.
  //
  // Posting never waits for the provider: where its queues are full
  // (-FI_EAGAIN) the operation waits in the transport's queue, one lane per
  // destination (receives share one), and the progress thread posts it when
  // there is room. A queued send gives up (its callback reports the error)
  // after post_timeout_s, after StopWaiting, or when its peer is declared
  // unreachable. Ok means the callback runs exactly once; an error means it
  // never runs.
  virtual Status Send(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                      Callback done) = 0;

  // Like Send, but never queued: tries the provider at once (ahead of queued
  // sends to `peer`) and returns an error where Send would queue. For
  // best-effort messages such as heartbeats and aborts, which must not pile
  // up behind one unreachable peer.
  virtual Status TrySend(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                         Callback done) = 0;

  // Like Send, for a few small control messages that must get through after a
  // failure too (an abort, a withdrawal, the first heartbeat to a peer): it
  // may wait in the queue also after StopWaiting, since a provider that
  // connects on the first send (tcp;ofi_rxm) refuses every send to a peer not
  // yet connected until the connection is up, and a process that failed
  // before it ever sent to a peer would otherwise never reach it. It gives up
  // after post_timeout_s, or when its peer is declared unreachable.
  virtual Status SendControl(int peer, uint64_t tag, const IoVec* iov, size_t iov_count,
                             Callback done) = 0;

  // Declares `peer` unreachable: sends to it stop waiting for queue room
  // (including queued sends) and fail instead.
  virtual void SetPeerUnreachable(int peer) = 0;

  // Sends stop waiting for queue room, to any peer, from now on (including
  // queued ones): after a failure nothing is worth the wait, and a send to a
  // dead peer that no watchdog has named yet must not wait for the post
  // timeout. SendControl's messages still wait.
  virtual void StopWaiting() = 0;

  // Posts a receive matching a message whose tag equals `tag` on the bits
  // not set in `ignore`, scattered into `iov`: from rank `from`'s address
  // alone where the provider has directed receives (else, and with kAnyPeer,
  // from any sender; the tag's sender bits are only what a sender claims). A
  // `background` receive (one kept posted for rare control messages) does
  // not count as work in flight, so an idle endpoint stays idle.
  virtual Status Recv(uint64_t tag, uint64_t ignore, const IoVec* iov, size_t iov_count,
                      Callback done, bool background = false, int from = kAnyPeer) = 0;

  // Cancels every posted or queued receive; their callbacks run with
  // ok == false.
  virtual void CancelAll() = 0;

  // Cancels receives, lets their callbacks run (up to 2 s), stops the
  // progress thread and closes the endpoint. No callback runs afterwards;
  // operations still in flight are freed without one. Idempotent; the
  // destructor calls it.
  virtual void Shutdown() = 0;

  // Largest message (all iov entries together) the provider accepts.
  virtual size_t MaxMessageBytes() const = 0;

  // Human-readable provider and fabric description for logs and errors.
  virtual std::string Describe() const = 0;

  // Operations posted and not yet completed (background receives excluded).
  virtual size_t Outstanding() const = 0;

  virtual TransportStats Stats() const = 0;
};

// Opens a libfabric RDM endpoint with tagged messages.
std::unique_ptr<Transport> CreateFabricTransport(const TransportOptions& options,
                                                 Status* status);

}  // namespace herring::transport

#endif  // HERRING_TRANSPORT_TRANSPORT_H_
