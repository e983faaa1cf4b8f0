// Where a host-stage call's inputs are published and withdrawn: its set-up
// (staging, arrive entries, board posting), the check that the inputs it read
// were still their owners' when it finished reading, and the end of a failed
// call, which withdraws its inputs before XLA frees them (host_stage.cc says
// why that keeps every slice that anyone uses exact).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"

namespace herring::engine {

namespace {

// How long a failed call waits, as messages, for a local peer that has not
// arrived in it to say that it stopped: the peer's arrive may be on its way
// (it publishes its inputs before it reads others'); one that has not entered
// the call finds the withdrawal waiting when it does.
constexpr auto kArriveGrace = std::chrono::seconds(1);

}  // namespace

Status Communicator::PrepareHostCall(Batch* batch, const GroupPlan& plan,
                                     const std::vector<ReduceRequest>& requests,
                                     const std::vector<size_t>& slice_bytes) {
  HostWait& w = *batch->host;
  const int p = w.size();
  const size_t num = requests.size();
  for (size_t k = 0; k < num; ++k) {
    const ReduceRequest& r = requests[k];
    w.staging.emplace_back(&pool_, std::max<size_t>(1, slice_bytes[k]));
    if (!w.staging.back().ok() || TestFault("no-staging")) {
      return Status::Error("rank " + std::to_string(config_.rank) +
                           " is out of memory for the host stage of " +
                           batch->jobs[k]->Describe());
    }
    HostEntry e{};
    e.addr = reinterpret_cast<uint64_t>(r.in);
    if (w.direct) {
      // The peers read this copy, never the input: it stays until every one
      // of them has acked it (Linger), however soon this call returns.
      std::memcpy(w.staging.back().data(), r.in, r.count * ElementSize(r.dtype));
      e.addr = reinterpret_cast<uint64_t>(w.staging.back().data());
      e.reserved = 1;
    }
    e.key = r.key;
    e.count = r.count;
    e.contributors = r.contributors;
    e.dtype = static_cast<uint8_t>(r.dtype);
    e.op = static_cast<uint8_t>(r.op);
    e.codec = static_cast<uint8_t>(r.codec);
    w.out_entries[0].push_back(e);
  }
  const Job& first = *batch->jobs.front();
  // Through the boards where this host's processes share them; a call of
  // more buffers than a posting holds goes through messages (the same on
  // every process, which all reduce the same buffers).
  w.board = plan.board && num <= static_cast<size_t>(HostBoard::kEntries);
  if (w.board) {
    w.key = BoardKey{batch->stream, first.id};
    w.board_index = plan.board_index;
    w.ready_posting.assign(p, -1);
    w.ready_version.assign(p, 0);
    w.arrive_posting.assign(p, -1);
    w.arrive_version.assign(p, 0);
    const auto deadline = Deadline();
    const bool no_posting = TestFault("no-posting");
    while (no_posting || (w.posting = board_->Acquire(w.key, num)) < 0) {
      {
        std::lock_guard<std::mutex> lock(lingering_mu_);
        SweepLingering();
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        return Status::Error(
            "rank " + std::to_string(config_.rank) + ": more than " +
            std::to_string(HostBoard::kPostings) + " host-stage reductions were in flight " +
            "or waiting for their readers for HERRING_TIMEOUT_S=" +
            std::to_string(config_.timeout_s) + " s; HERRING_HOST_BOARD=0 sends the host " +
            "stage's steps as messages, without this limit");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  w.out_headers[0] = MakeHeader(first, MsgKind::kHostArrive, config_.token, my_rank, w.me, 0,
                                num * sizeof(HostEntry), 1);
  w.out_headers[2] = MakeHeader(first, MsgKind::kHostDone, config_.token, my_rank, w.me, 0, 0, 1);
  // A withdrawal (WithdrawHost, below) is a kHostDone that says so.
  w.withdrawal = MakeHeader(first, MsgKind::kHostDone, config_.token, my_rank, w.me, 0, 0,
                            kHostWithdrawn);
  return Status::Ok();
}

Status Communicator::CheckInputsStillPosted(Batch* batch) {
  HostWait& w = *batch->host;
  if (!w.board) {
    // As messages a withdrawal fails the call when it arrives (OnHostMessage);
    // the owner waits meanwhile (WithdrawHost), so what was read is exact.
    std::lock_guard<std::mutex> lock(batch->mu);
    return batch->failed ? Status::Error(batch->error) : Status::Ok();
  }
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.me) continue;
    // Only the postings found in the arrive wait can be checked; reading at
    // index -1 would read another table of the peer's board.
    if (w.arrive_posting[q] < 0 || w.arrive_posting[q] >= HostBoard::kPostings) {
      return Status::Error("rank " + std::to_string(config_.rank) + ": internal error: no " +
                           "posting of rank " + std::to_string(w.local[q]) + " was found " +
                           "for " + batch->jobs.front()->Describe() + " before its inputs " +
                           "were checked (please report this)");
    }
    if (board_->StillPosted(w.board_index[q], w.arrive_posting[q], w.arrive_version[q])) {
      continue;
    }
    return Status::Error("rank " + std::to_string(w.local[q]) + " withdrew its inputs to the " +
                         "host stage of " + batch->jobs.front()->Describe() + " while rank " +
                         std::to_string(config_.rank) + " read them (its reduction failed); " +
                         "what was read is discarded");
  }
  return Status::Ok();
}

void Communicator::WithdrawHost(Batch* batch) {
  HostWait& w = *batch->host;
  if (!w.arrive_published) return;  // nobody knows where the inputs are
  if (w.board) {
    board_->Withdraw(w.posting);
    return;
  }
  for (int q = 0; q < w.size(); ++q) {
    if (q == w.me || w.done_sent[q].exchange(true)) continue;
    const int to = w.local[q];
    Job* job = batch->jobs.front().get();
    transport::IoVec iov[1] = {{&w.withdrawal, sizeof(WireHeader)}};
    batch->AddInflight(1);
    // SendControl: this call has failed (the transport stopped waiting for
    // ordinary sends), and the withdrawal must get there.
    Status s = transport_->SendControl(
        to, MakeTag(MsgKind::kHostDone, static_cast<uint32_t>(config_.rank), batch->stream,
                    job->tag_bits, 0),
        iov, 1, [this, job, to](const transport::Completion& c) {
          SendDone(job, to, c);
        });
    if (!s.ok()) batch->Complete(1, 1);  // the wait below still covers that peer
  }
  // Until every peer that may read this process's inputs has said it stopped:
  // its kHostReady (after its last read), any kHostDone, or its exit.
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = Deadline();
  bool said = false;
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    std::string waiting;
    for (int q = 0; q < w.size(); ++q) {
      if (q == w.me || w.Got(q, 1) || w.Got(q, 2)) continue;
      if (now >= (w.Got(q, 0) ? deadline : start + kArriveGrace)) continue;
      if (ProcessExited(w.pids[q])) continue;
      waiting += (waiting.empty() ? "" : ", ") + std::to_string(w.local[q]);
    }
    if (waiting.empty()) return;
    if (!said && now - start > std::chrono::seconds(5)) {
      said = true;
      std::fprintf(stderr, "herring_jax rank %d: the failed host-stage call waits for rank(s) "
                   "%s of this host to stop reading its inputs (up to HERRING_TIMEOUT_S=%g s)\n",
                   config_.rank, waiting.c_str(), config_.timeout_s);
    }
    std::unique_lock<std::mutex> lock(batch->mu);
    batch->cv.wait_for(lock, std::chrono::milliseconds(10));
  }
}

Status Communicator::EndHostCall(std::unique_ptr<Batch> batch,
                                 const std::vector<ReduceRequest>& requests, bool timed_out) {
  // The error first: a withdrawal tells the others that this call failed.
  if (timed_out) FailTimedOut(batch.get());
  WithdrawHost(batch.get());
  if (FaultFired("withdraw-after-ready")) {
    // Tests: the inputs are gone, as once XLA reuses their memory.
    for (const ReduceRequest& r : requests) {
      std::memset(const_cast<void*>(r.in), 0xa5, r.count * ElementSize(r.dtype));
    }
  }
  HostWait& w = *batch->host;
  {
    std::lock_guard<std::mutex> lock(kept_mu_);
    for (PooledBuffer& b : w.staging) kept_staging_.push_back(std::move(b));
  }
  // `w.waiting` still names the step that was due: the error text reports who
  // had not sent it.
  return EndFailed(std::move(batch), /*timed_out=*/false);
}

Status Communicator::HostReadFailed(Batch* batch, int q, const std::string& what,
                                   const Status& s) {
  const HostWait& w = *batch->host;
  std::string text = "rank " + std::to_string(config_.rank) + " cannot read rank " +
                     std::to_string(w.local[q]) + "'s " + what + ": " + s.message();
  if (!ProcessExited(w.pids[q])) return Status::Error(text);
  {
    std::unique_lock<std::mutex> lock(batch->mu);
    batch->cv.wait_until(lock, std::min(Deadline(), std::chrono::steady_clock::now() +
                                                        std::chrono::seconds(1)),
                         [&] { return batch->failed; });
  }
  return Status::Error(text + ExitedHostPeers(w));
}

std::string Communicator::ExitedHostPeers(const HostWait& w) const {
  std::string exited;
  for (int i = 0; i < w.size(); ++i) {
    if (i != w.me && ProcessExited(w.pids[i])) {
      exited += (exited.empty() ? "" : ", ") + std::string("rank ") + std::to_string(w.local[i]);
    }
  }
  return exited.empty() ? "" : "; processes of this host that have exited: " + exited;
}

std::string Communicator::WithdrawnText(const HostWait& w, int rank,
                                        const std::string& describe) const {
  return "rank " + std::to_string(rank) + " withdrew from the host stage of " + describe +
         " (its reduction failed)" + ExitedHostPeers(w);
}

}  // namespace herring::engine
