// The host stage's messages (host_stage.cc): each step's small message to and
// from every other process of the host through the transport, their checks,
// and the wait for a step's messages from all of them.
#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"

namespace herring::engine {

namespace {

constexpr MsgKind kStepKinds[HostWait::kSteps] = {MsgKind::kHostArrive, MsgKind::kHostReady,
                                                  MsgKind::kHostDone};

std::string DescribeEntry(const HostEntry& e) {
  if (!IsValidDType(e.dtype) || !IsValidOp(e.op) || !IsValidCodec(e.codec)) {
    return "an invalid buffer";
  }
  const Codec codec = static_cast<Codec>(e.codec);
  return std::string(DTypeName(static_cast<DType>(e.dtype))) + "[" + std::to_string(e.count) +
         "] " + ReduceOpName(static_cast<ReduceOp>(e.op)) +
         (codec != Codec::kNone ? std::string(" over ") + CodecName(codec) : "") + " (key " +
         std::to_string(e.key) + ")";
}

// Why the entries a peer (`from`) published for a call do not describe the
// buffers this process (`me`) reduces in it ("" if they do).
std::string EntriesMismatch(const Batch& batch, int from, int me,
                            const std::vector<HostEntry>& entries) {
  if (entries.size() != batch.jobs.size()) {
    return "mismatched reductions: rank " + std::to_string(from) + " reduces " +
           std::to_string(entries.size()) + " buffers in one call where rank " +
           std::to_string(me) + " reduces " + std::to_string(batch.jobs.size()) + " in " +
           batch.jobs.front()->Describe() +
           "; every process must run the same reductions in the same executables";
  }
  for (size_t k = 0; k < entries.size(); ++k) {
    const HostEntry& e = entries[k];
    const ReduceRequest& mine = batch.jobs[k]->req;
    if (e.key != mine.key || e.count != mine.count ||
        e.dtype != static_cast<uint8_t>(mine.dtype) || e.op != static_cast<uint8_t>(mine.op) ||
        e.codec != static_cast<uint8_t>(mine.codec)) {
      return "mismatched reductions: rank " + std::to_string(from) + " reduces " +
             DescribeEntry(e) + " as buffer " + std::to_string(k) + " where rank " +
             std::to_string(me) + " reduces " + batch.jobs[k]->Describe() +
             "; every process must run the same reductions (shapes, dtypes, ops, codecs) in "
             "the same executables";
    }
    const uint8_t direct = batch.host && batch.host->direct ? 1 : 0;
    if (e.reserved <= 1 && e.reserved != direct) {
      return "mismatched host-stage paths: rank " + std::to_string(from) +
             (e.reserved ? " takes" : " does not take") + " the direct path for " +
             batch.jobs[k]->Describe() + " where rank " + std::to_string(me) +
             (direct ? " does" : " does not") + "; HERRING_HOST_DIRECT_BYTES must be the same "
             "on every process (herring_jax.initialize() passes rank 0's to all)";
    }
    if (e.addr == 0 || e.contributors == 0 || e.contributors > kMaxContributors ||
        e.reserved > 1) {
      return "rank " + std::to_string(from) + " sent a malformed host-stage entry for " +
             batch.jobs[k]->Describe();
    }
  }
  return "";
}

// How long a board wait sleeps before it looks at the call's state again
// (failed by a peer's abort or the peer watch, or past its deadline).
constexpr int kBoardSliceUs = 2000;
// How often a board wait looks for peers of the host that have exited.
constexpr std::chrono::milliseconds kExitCheckEvery(100);

}  // namespace

void Communicator::PostHostRecv(Batch* batch, int step, int q) {
  HostWait& w = *batch->host;
  const Job& job = *batch->jobs.front();
  WireHeader* h = &w.in_headers[step * w.size() + q];
  std::vector<HostEntry>& entries = w.in_entries[step * w.size() + q];
  transport::IoVec iov[2] = {{h, sizeof(*h)},
                             {entries.data(), entries.size() * sizeof(HostEntry)}};
  batch->AddInflight(1);
  Status s = transport_->Recv(
      MakeTag(kStepKinds[step], static_cast<uint32_t>(w.local[q]), batch->stream, job.tag_bits,
              0),
      0, iov, entries.empty() ? 1 : 2,
      [this, batch, step, q](const transport::Completion& c) {
        OnHostMessage(batch, step, q, c);
      },
      /*background=*/false, /*from=*/w.local[q]);
  if (!s.ok()) {
    Fail(batch, "posting a receive: " + s.message());
    batch->Complete(1, 1);
  }
}

void Communicator::OnHostMessage(Batch* batch, int step, int q,
                                 const transport::Completion& done) {
  HostWait& w = *batch->host;
  const Job& job = *batch->jobs.front();
  const int from = w.local[q];
  const WireHeader& h = w.in_headers[step * w.size() + q];
  std::string why;
  if (ReceiveFailed(done, job, from, config_.rank, h, config_.token, &why)) {
    if (w.lingering.load()) {
      // The call succeeded; this is a kHostDone receive cancelled by a later
      // failure or by shutdown. Its staging is kept (Linger), nobody is told.
      std::lock_guard<std::mutex> lock(batch->mu);
      batch->failed = true;
    } else if (!batch->Failed()) {
      Fail(batch, why);
    }
    batch->Complete(1, 1);
    return;
  }
  Expectation want = Expect(job, kStepKinds[step], from, q, 0);
  want.payload_bytes = w.in_entries[step * w.size() + q].size() * sizeof(HostEntry);
  if (!AcceptHeader(batch, h, done.len, want,
                    [this, batch, step, q] { PostHostRecv(batch, step, q); })) {
    return;
  }
  Heard(static_cast<uint32_t>(from));
  // The header described the first buffer; the entries (arrive, ready)
  // describe them all.
  if (step < 2) {
    why = EntriesMismatch(*batch, from, config_.rank, w.in_entries[step * w.size() + q]);
  }
  if (!why.empty()) {
    Fail(batch, why);
    batch->Complete(1, 1);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(batch->mu);
    w.got[q].fetch_or(static_cast<uint8_t>(1u << step));
  }
  batch->cv.notify_all();
  if (step == 2 && h.contributors == kHostWithdrawn) {
    // Its call failed: it reads nothing of this process's any more (its
    // inputs' owner may stop waiting for it, done above), and its own inputs
    // are going away. Everything of this process fails, the cross-host step
    // of this call included: it cannot succeed without that process.
    FailAll(WithdrawnText(w, from, job.Describe()), /*tell_peers=*/true);
  }
  batch->Complete(1, 1);
}

void Communicator::SendHost(Batch* batch, int step, int q) {
  HostWait& w = *batch->host;
  Job* job = batch->jobs.front().get();
  const int to = w.local[q];
  std::vector<HostEntry>& entries = w.out_entries[step];
  const uint64_t tag =
      MakeTag(kStepKinds[step], static_cast<uint32_t>(config_.rank), batch->stream,
              job->tag_bits, 0);
  if (config_.test_stale_copies) SendStaleCopy(batch, to, tag, w.out_headers[step]);
  transport::IoVec iov[2] = {{&w.out_headers[step], sizeof(WireHeader)},
                             {entries.data(), entries.size() * sizeof(HostEntry)}};
  batch->AddInflight(1);
  Status s = transport_->Send(
      to, tag, iov, entries.empty() ? 1 : 2,
      [this, job, to](const transport::Completion& c) { SendDone(job, to, c); });
  if (!s.ok()) {
    Fail(batch, "sending to rank " + std::to_string(to) + ": " + s.message());
    batch->Complete(1, 1);
  }
}

bool Communicator::WaitHost(Batch* batch, int step) {
  HostWait& w = *batch->host;
  w.waiting = step;
  std::unique_lock<std::mutex> lock(batch->mu);
  const bool arrived = batch->cv.wait_until(lock, Deadline(), [&] {
    if (batch->failed) return true;
    for (int q = 0; q < w.size(); ++q) {
      if (q != w.me && !w.Got(q, step)) return false;
    }
    return true;
  });
  return arrived;
}

void Communicator::PublishHost(Batch* batch, int step) {
  HostWait& w = *batch->host;
  if (step == 0) w.arrive_published = true;  // before anyone can read the inputs
  if (!w.board) {
    for (int q = 0; q < w.size(); ++q) {
      if (q != w.me) SendHost(batch, step, q);
    }
    return;
  }
  board_->Publish(w.posting, step, w.out_entries[step].data(), w.out_entries[step].size());
}

bool Communicator::CheckHostEntries(Batch* batch, int step, int q,
                                    const std::vector<HostEntry>& entries) {
  HostWait& w = *batch->host;
  const std::string why = EntriesMismatch(*batch, w.local[q], config_.rank, entries);
  if (!why.empty()) {
    Fail(batch, why);
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(batch->mu);
    w.got[q].fetch_or(static_cast<uint8_t>(1u << step));
  }
  return true;
}

bool Communicator::WaitBoard(Batch* batch, int step) {
  HostWait& w = *batch->host;
  const auto deadline = Deadline();
  std::vector<bool> have(w.size(), false);
  have[w.me] = true;
  for (int left = w.size() - 1; left > 0; --left) {
    bool timed_out = false;
    const int q = NextPosted(batch, step, have, deadline, &timed_out);
    if (q < 0) return !timed_out;
    have[q] = true;
  }
  return true;
}

int Communicator::NextPosted(Batch* batch, int step, const std::vector<bool>& have,
                             std::chrono::steady_clock::time_point deadline, bool* timed_out) {
  HostWait& w = *batch->host;
  w.waiting = step;
  std::vector<int> boards;
  std::vector<uint32_t> seen;
  auto next_exit_check = std::chrono::steady_clock::now() + kExitCheckEvery;
  for (;;) {
    if (batch->Failed()) return -1;
    boards.clear();
    seen.clear();
    for (int q = 0; q < w.size(); ++q) {
      if (have[q]) continue;
      // The generation first: a publication after it wakes the wait below.
      boards.push_back(w.board_index[q]);
      seen.push_back(board_->Generation(w.board_index[q]));
      std::vector<HostEntry>& entries = w.in_entries[step * w.size() + q];
      uint32_t version = 0;
      const int k = board_->Find(w.board_index[q], w.key, step, &entries, &version);
      if (k == HostBoard::kWithdrawnPosting) {
        // Its call failed; whoever caused that may not have told anyone.
        Fail(batch, WithdrawnText(w, w.local[q], batch->jobs.front()->Describe()));
        return -1;
      }
      if (k < 0) continue;
      if (step == 0) {
        w.arrive_posting[q] = k;
        w.arrive_version[q] = version;
      } else {
        w.ready_posting[q] = k;
        w.ready_version[q] = version;
      }
      return CheckHostEntries(batch, step, q, entries) ? q : -1;
    }
    const auto now = std::chrono::steady_clock::now();
    if (boards.empty() || now >= deadline) {
      *timed_out = !boards.empty();
      return -1;
    }
    // A peer that has exited never posts (a posting outlives its owner's
    // call until every reader acks it, so one that finished is found above).
    // Without this, where no heartbeats flow (shm) nothing else would notice
    // before HERRING_TIMEOUT_S.
    if (now >= next_exit_check) {
      next_exit_check = now + kExitCheckEvery;
      for (int q = 0; q < w.size(); ++q) {
        if (have[q] || !ProcessExited(w.pids[q])) continue;
        Fail(batch, "rank " + std::to_string(w.local[q]) + " of this host exited before it " +
                        "posted its " + (step == 0 ? "inputs" : "result slices") + " for " +
                        batch->jobs.front()->Describe() + " (rank " +
                        std::to_string(config_.rank) + " waited for it on the host's boards)" +
                        ExitedHostPeers(w));
        return -1;
      }
    }
    board_->WaitAny(boards, seen, kBoardSliceUs);
  }
}

}  // namespace herring::engine
