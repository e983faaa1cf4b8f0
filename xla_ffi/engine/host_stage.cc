// The host stage of the hierarchical reduction: the processes of one host that
// reduce in the same group do so through memory, and only each host's share
// crosses the network. For a call (one or more buffers):
//
//   1. arrive: every process tells the others where its inputs are
//      (kHostArrive, one HostEntry per buffer);
//   2. reduce-scatter: process j owns slice j of every buffer (equal slices,
//      64-byte aligned) and sums it over the host's processes in local order,
//      reading the others' inputs with process_vm_readv (cross_memory.h) in
//      cache-sized pieces, into a staging buffer of its own;
//   3. across hosts: that slice is reduced with the same slice of every other
//      host by ReduceFlat over the processes with local index j, one per host,
//      in host order. Every process of a host serves and sends its slice, so
//      all of them keep the host's flows busy, as Herring's balanced fusion
//      buffers spread a node's data over its GPUs;
//   4. ready: it tells the others that its slice is final (kHostReady, the
//      staging address) and copies the slice into its own output (with one
//      host, step 2 already wrote it there);
//   5. all-gather: every process reads the others' slices into its output and
//      tells each owner when it is done (kHostDone). A call returns once it
//      has gathered; its staging buffers stay with its batch, which lingers
//      until every other process has said it read them (Linger).
// The bytes go through memory. The steps (arrive, ready, done) go through
// the host boards (host_board.h: each process publishes its entries on its own
// shared-memory board, and the others wait for them with futex, matched by the
// call's identity) or, where a host's processes could not map each other's
// boards (HERRING_HOST_BOARD=0, no pidfd_getfd), as small transport messages
// (host_messages.cc). Both are checked alike (mismatched reductions are named);
// liveness and aborts go through the transport either way. After a call,
// host_linger.cc keeps its staging buffers.
//
// Order of the sum (the numpy reference in tests/workers/common.py): the
// devices of a process, then the processes of a host in rank order, then the
// hosts in the order of their lowest rank. float16/bfloat16 accumulate in
// float32 and round once per stage. With one host a mean divides in step 2;
// across hosts the servers of step 3 divide.
//
// Safety: a process reads other processes' memory, never writes it (nor
// their boards: a reader's "done" is an ack on its own board). Below,
// kHostArrive, kHostReady and kHostDone stand as well for the boards' arrive
// and ready publications and the reader's ack, which keep the same order.
// - Inputs are read while their owner is inside the call, whenever the reader
//   succeeds: reader r reads q's input in r's step 2, and r succeeds only after
//   q's kHostDone, which q sends from inside its call after reading r's slice,
//   i.e. after r's kHostReady, i.e. after r's step 2.
// - Inputs are no longer read once their owner returns: it returns after
//   gathering every peer's slice, i.e. after every peer's kHostReady, which a
//   peer sends after its step 2, its last read of inputs.
// - Where XLA reduces in place (the input is the output), an input slice is
//   overwritten only when nobody reads it any more: process q reads only slice
//   q of the others' inputs; each process writes its own slice (steps 2 and 4)
//   and slice q only in step 5, after q's kHostReady, i.e. after q's step 2.
// - Result slices are read from the owner's staging buffer, never from XLA's
//   output: the buffer goes back to the pool only after every reader's
//   kHostDone (the batch lingers after a successful call until then), and a
//   failed call keeps its staging buffers as long as the communicator lives
//   (a reader may still be at it). So a process whose peer failed can read
//   stale bytes only in a call that fails.
// - Shutting down does not cut a slow reader short: the communicator first
//   waits until every lingering slice was read or its reader exited
//   (DrainLingering), and what may still be read is never freed
//   (~Communicator). A process that exits without shutting down (os._exit)
//   makes a reader still at its slice fail with an error naming it (ESRCH),
//   never read wrong bytes; a normal exit passes jax.distributed's shutdown
//   barrier, which waits for every process.
// - A dead process is named: its memory can no longer be read (ESRCH), and the
//   peer watch sees its heartbeats stop.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {

namespace {

// Pieces of the reduce-scatter: one per process at a time stays in L2.
constexpr size_t kPieceBytes = 256 << 10;

// Slices of a buffer among `p` processes: equal, 64-byte aligned, the last
// ones possibly shorter or empty (as the flat path's parts).
size_t SliceElems(const ReduceRequest& r, int p) {
  // With a codec, at the codec's blocks (as the flat path's parts).
  const size_t align = r.codec != Codec::kNone ? kCodecBlock
                                               : std::max<size_t>(1, 64 / ElementSize(r.dtype));
  return ((r.count + p - 1) / p + align - 1) / align * align;
}
size_t SliceBegin(const ReduceRequest& r, int p, int i) {
  return std::min(r.count, i * SliceElems(r, p));
}
size_t SliceLen(const ReduceRequest& r, int p, int i) {
  return std::min(r.count, (i + 1) * SliceElems(r, p)) - SliceBegin(r, p, i);
}

}  // namespace

Status Communicator::GatherFrom(Batch* batch, int q, const std::vector<ReduceRequest>& requests) {
  HostWait& w = *batch->host;
  const std::vector<HostEntry>& ready = w.in_entries[1 * w.size() + q];
  for (size_t k = 0; k < requests.size(); ++k) {
    const ReduceRequest& r = requests[k];
    const size_t elem = ElementSize(r.dtype);
    const size_t len = SliceLen(r, w.size(), q) * elem;
    if (len == 0) continue;
    Status s = ReadProcessMemory(w.pids[q], ready[k].addr,
                                 static_cast<char*>(r.out) + SliceBegin(r, w.size(), q) * elem,
                                 len);
    if (!s.ok()) {
      return HostReadFailed(batch, q, "slice of " + batch->jobs[k]->Describe(), s);
    }
    host_bytes_read_ += len;
  }
  if (w.board) {
    board_->Ack(w.board_index[q], w.ready_posting[q], w.ready_version[q]);
  } else {
    SendHost(batch, 2, q);
  }
  return Status::Ok();
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
  std::string exited;
  for (int i = 0; i < w.size(); ++i) {
    if (i != w.me && ProcessExited(w.pids[i])) {
      exited += (exited.empty() ? "" : ", ") + std::string("rank ") + std::to_string(w.local[i]);
    }
  }
  return Status::Error(text + "; processes of this host that have exited: " + exited);
}

Status Communicator::ReduceInHosts(uint32_t stream, const GroupPlan& plan,
                                   const std::vector<ReduceRequest>& requests,
                                   const std::vector<Identity>& ids) {
  host_calls_ += 1;
  const int p = static_cast<int>(plan.local.size());
  const int me = plan.local_index;
  const size_t num = requests.size();
  auto batch = std::make_unique<Batch>();
  batch->stream = stream;
  batch->group = plan.local;
  batch->started_ns = NowNs();
  for (size_t k = 0; k < num; ++k) {
    auto job = std::make_unique<Job>();
    job->batch = batch.get();
    job->req = requests[k];
    job->id = ids[k];
    job->tag_bits = IdentityTagBits(job->id, stream);
    job->elem = ElementSize(job->req.dtype);
    batch->jobs.push_back(std::move(job));
  }
  auto host = std::make_unique<HostWait>();
  HostWait& w = *host;
  w.local = plan.local;
  w.me = me;
  w.hosts = plan.hosts;
  for (int r : plan.local) w.pids.push_back(topology_.pid_of[r]);
  w.got.reset(new std::atomic<uint8_t>[p]());
  w.in_headers.resize(HostWait::kSteps * p);
  w.in_entries.resize(HostWait::kSteps * p);
  for (int q = 0; q < p; ++q) {
    w.in_entries[0 * p + q].resize(num);
    w.in_entries[1 * p + q].resize(num);
  }
  for (size_t k = 0; k < num; ++k) {
    const ReduceRequest& r = requests[k];
    w.staging.emplace_back(&pool_, std::max<size_t>(1, SliceLen(r, p, me) * ElementSize(r.dtype)));
    if (!w.staging.back().ok()) return Status::Error("out of memory for the host stage");
    HostEntry e{};
    e.addr = reinterpret_cast<uint64_t>(r.in);
    e.key = r.key;
    e.count = r.count;
    e.contributors = r.contributors;
    e.dtype = static_cast<uint8_t>(r.dtype);
    e.op = static_cast<uint8_t>(r.op);
    e.codec = static_cast<uint8_t>(r.codec);
    w.out_entries[0].push_back(e);
  }
  const Job& first = *batch->jobs.front();
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  // Through the boards where this host's processes share them; a call of
  // more buffers than a posting holds goes through messages (the same on
  // every process, which all reduce the same buffers).
  w.board = plan.board && num <= static_cast<size_t>(HostBoard::kEntries);
  if (w.board) {
    w.key = BoardKey{stream, first.id};
    w.board_index = plan.board_index;
    w.ready_posting.assign(p, -1);
    w.ready_version.assign(p, 0);
    const auto deadline = Deadline();
    while ((w.posting = board_->Acquire(w.key, num)) < 0) {
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
  w.out_headers[0] = MakeHeader(first, MsgKind::kHostArrive, config_.token, my_rank, me, 0,
                                num * sizeof(HostEntry), 1);
  w.out_headers[2] = MakeHeader(first, MsgKind::kHostDone, config_.token, my_rank, me, 0, 0, 1);
  batch->host = std::move(host);
  // Each step: a receive from and a send to every other process (none
  // through the boards).
  const bool board = w.board;
  batch->remaining = board ? 0 : 2 * HostWait::kSteps * (p - 1);
  batch->started = true;
  Activate(batch.get());

  for (int step = 0; !board && step < HostWait::kSteps; ++step) {
    for (int q = 0; q < p; ++q) {
      if (q != me) PostHostRecv(batch.get(), step, q);
    }
  }
  PublishHost(batch.get(), 0);

  bool timed_out = false;
  bool ok = true;
  auto wait = [&](int step) {
    if (ok && !(board ? WaitBoard(batch.get(), step) : WaitHost(batch.get(), step))) {
      timed_out = true;
    }
    ok = ok && !timed_out && !batch->Failed();
  };
  auto fail = [&](const Status& s, bool tell_peers) {
    if (!s.ok() && ok) {
      Fail(batch.get(), s.message(), tell_peers);
      ok = false;
    }
  };

  // 2. reduce-scatter.
  wait(0);
  std::vector<uint64_t> contributors(num, 0);
  if (ok) {
    for (size_t k = 0; ok && k < num; ++k) {
      for (int q = 0; q < p; ++q) {
        if (!AddContributors(&contributors[k], q == me ? requests[k].contributors
                                                       : w.in_entries[0 * p + q][k].contributors)) {
          fail(Status::Error("rank " + std::to_string(config_.rank) + ": the processes of this "
                             "host count more than " + std::to_string(kMaxContributors) +
                             " devices in " + batch->jobs[k]->Describe()), true);
          break;
        }
      }
    }
    PooledBuffer pieces(&pool_, std::max<size_t>(1, (p - 1) * kPieceBytes));
    if (!pieces.ok()) fail(Status::Error("out of memory for the host stage"), true);
    std::vector<const void*> srcs(p);
    for (size_t k = 0; ok && k < num; ++k) {
      const ReduceRequest& r = requests[k];
      const size_t elem = ElementSize(r.dtype);
      const size_t piece = std::max<size_t>(1, kPieceBytes / elem);
      const size_t begin = SliceBegin(r, p, me);
      const size_t len = SliceLen(r, p, me);
      const double divisor =
          r.op == ReduceOp::kMean && w.hosts == 1 ? static_cast<double>(contributors[k]) : 1.0;
      for (size_t off = 0; ok && off < len; off += piece) {
        const size_t n = std::min(piece, len - off);
        const size_t at = (begin + off) * elem;
        for (int q = 0, slot = 0; ok && q < p; ++q) {
          if (q == me) {
            srcs[q] = static_cast<const char*>(r.in) + at;
            continue;
          }
          // The arrive entries of process q (step 0).
          const uint64_t from = w.in_entries[0 * p + q][k].addr + at;
          char* into = pieces.data() + (slot++) * kPieceBytes;
          Status s = ReadProcessMemory(w.pids[q], from, into, n * elem);
          if (!s.ok()) {
            fail(HostReadFailed(batch.get(), q, "input of " + batch->jobs[k]->Describe(), s),
                 true);
            break;
          }
          host_bytes_read_ += n * elem;
          srcs[q] = into;
        }
        // With one host the slice is final: into the output at once too.
        char* out = w.hosts == 1 ? static_cast<char*>(r.out) + (begin + off) * elem : nullptr;
        if (ok) {
          ReduceIntoTwo(r.dtype, w.staging[k].data() + off * elem, out, srcs.data(), p, n,
                        divisor);
        }
      }
    }
  }

  // 3. across hosts: this process's slice with the same slice of every host.
  if (ok && w.hosts > 1) {
    std::vector<ReduceRequest> slices(requests);
    for (size_t k = 0; k < num; ++k) {
      slices[k].count = SliceLen(requests[k], p, me);
      slices[k].in = w.staging[k].data();
      slices[k].out = w.staging[k].data();
      slices[k].contributors = static_cast<uint32_t>(contributors[k]);
    }
    // Its failure has been told to every rank already.
    fail(ReduceFlat(stream, plan.cross, slices, ids), /*tell_peers=*/false);
  }

  // 4. ready, and this process's own slice into its output.
  if (ok) {
    for (size_t k = 0; k < num; ++k) {
      HostEntry e = w.out_entries[0][k];
      e.addr = reinterpret_cast<uint64_t>(w.staging[k].data());
      e.contributors = static_cast<uint32_t>(contributors[k]);
      w.out_entries[1].push_back(e);
    }
    w.out_headers[1] = MakeHeader(first, MsgKind::kHostReady, config_.token, my_rank, me, 0,
                                  num * sizeof(HostEntry), 1);
    PublishHost(batch.get(), 1);
    for (size_t k = 0; w.hosts > 1 && k < num; ++k) {
      const ReduceRequest& r = requests[k];
      const size_t elem = ElementSize(r.dtype);
      std::memcpy(static_cast<char*>(r.out) + SliceBegin(r, p, me) * elem, w.staging[k].data(),
                  SliceLen(r, p, me) * elem);
    }
  }

  // 5. all-gather, in the order the slices become ready.
  std::vector<bool> gathered(p, false);
  gathered[me] = true;
  if (ok && config_.test_gather_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(config_.test_gather_delay_ms));
  }
  for (int left = p - 1; ok && left > 0; --left) {
    int next = -1;
    if (board) {
      next = NextPosted(batch.get(), 1, gathered, Deadline(), &timed_out);
      ok = next >= 0 && !batch->Failed();
      if (!ok) break;
      gathered[next] = true;
      fail(GatherFrom(batch.get(), next, requests), true);
      continue;
    }
    w.waiting = 1;
    {
      std::unique_lock<std::mutex> lock(batch->mu);
      timed_out = !batch->cv.wait_until(lock, Deadline(), [&] {
        if (batch->failed) return true;
        for (int q = 0; q < p; ++q) {
          if (!gathered[q] && w.Got(q, 1)) {
            next = q;
            return true;
          }
        }
        return false;
      });
    }
    ok = !timed_out && !batch->Failed();
    if (!ok) break;
    gathered[next] = true;
    fail(GatherFrom(batch.get(), next, requests), true);
  }

  if (ok) {
    // Done here; the other processes may still be reading this one's slice.
    w.waiting = -1;
    w.lingering = true;
    Deactivate(batch.get());
    Linger(std::move(batch));
    return Status::Ok();
  }
  {
    std::lock_guard<std::mutex> lock(kept_mu_);
    for (PooledBuffer& b : w.staging) kept_staging_.push_back(std::move(b));
  }
  // `w.waiting` still names the step that was due: the error text reports who
  // had not sent it.
  return EndFailed(std::move(batch), timed_out);
}

}  // namespace herring::engine
