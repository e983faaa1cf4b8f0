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
//      buffers spread a node's data over its GPUs. With server-only
//      processes, their share of each slice is summed there (served.cc);
//   4. ready: it tells the others that its slice is final (kHostReady, the
//      staging address) and copies the slice into its own output (with one
//      host, step 2 already wrote it there);
//   5. all-gather: every process reads the others' slices into its output and
//      tells each owner when it is done (kHostDone). A call returns once it
//      has gathered; its staging buffers stay with its batch, which lingers
//      until every other process has said it read them (Linger).
// A reduce-scatter takes steps 1-3 and 5 without reading slices (each
// process's result is its own part, from step 3, or step 2 with one host); an
// all-gather steps 3-5 (no sum inside the host). Their slices are lists of
// ranges: process j's are the parts of the processes with local index j, one
// per host, so that step 3 exchanges exactly the parts that cross hosts.
// The bytes go through memory. The steps (arrive, ready, done) go through
// the host boards (host_board.h: each process publishes its entries on its own
// shared-memory board, and the others wait for them with futex, matched by the
// call's identity) or, where a host's processes could not map each other's
// boards (HERRING_HOST_BOARD=0, no pidfd_getfd), as small transport messages
// (host_messages.cc). Both are checked alike (mismatched reductions are named);
// liveness and aborts go through the transport either way. A call is set up
// and, when it fails, withdrawn by host_posting.cc; after a successful one,
// host_linger.cc keeps its staging buffers. Small all-reduces of one host
// take the direct path instead (host_direct.cc).
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
// - A failed call withdraws its inputs before it returns (host_posting.cc),
//   and nobody publishes or uses a slice read from inputs that were withdrawn:
//   on the boards the owner marks its posting withdrawn, and each reader,
//   after its last read of inputs and before it uses the slice (step 3 or 4),
//   checks that every owner's arrive posting is still the one it read (a
//   mark made later came after the reads, while the inputs were still
//   there); as messages the owner sends each local peer a withdrawal and
//   waits until each has said it is done reading (kHostReady, kHostDone, a
//   withdrawal of its own) or has exited: up to HERRING_TIMEOUT_S for a peer
//   whose arrive it has (that peer may be reading), 1 s (kArriveGrace,
//   host_posting.cc) for one whose arrive it has not (one that enters the
//   call later finds the withdrawal waiting).
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
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/communicator.h"
#include "engine/cross_memory.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {

namespace {

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

// The ranges local process q's slice holds (HostWait::slices).
std::vector<Range> SliceOf(const ReduceRequest& r, const GroupPlan& plan, int q) {
  const int p = static_cast<int>(plan.local.size());
  if (r.collective == Collective::kAllReduce) return {{SliceBegin(r, p, q), SliceLen(r, p, q)}};
  std::vector<Range> ranges;
  for (const std::vector<int>& host : plan.members) {
    const size_t i = std::lower_bound(plan.group.begin(), plan.group.end(), host[q]) -
                     plan.group.begin();
    ranges.push_back({r.parts[i], r.parts[i + 1] - r.parts[i]});
  }
  return ranges;
}

size_t Total(const std::vector<Range>& ranges) {
  size_t total = 0;
  for (const Range& range : ranges) total += range.len;
  return total;
}

// The parts of the stage across hosts for a slice: each range in turn.
std::vector<size_t> CrossParts(const std::vector<Range>& ranges) {
  std::vector<size_t> parts{0};
  for (const Range& range : ranges) parts.push_back(parts.back() + range.len);
  return parts;
}

// Whether the stage across hosts can keep a codec's blocks where they are in
// the buffer: a range that is not whole blocks must be followed by empty ones
// only. (Parts cut by herring_jax are whole blocks but for the last non-empty
// one; only hosts whose ranks interleave can put that one before another.)
bool CodecAligned(const ReduceRequest& r, const GroupPlan& plan) {
  if (r.codec == Codec::kNone || r.collective == Collective::kAllReduce) return true;
  for (size_t q = 0; q < plan.local.size(); ++q) {
    bool ragged = false;
    for (const Range& range : SliceOf(r, plan, static_cast<int>(q))) {
      if (ragged && range.len > 0) return false;
      ragged = ragged || range.len % kCodecBlock != 0;
    }
  }
  return true;
}

}  // namespace

Status Communicator::GatherFrom(Batch* batch, int q, const std::vector<ReduceRequest>& requests) {
  HostWait& w = *batch->host;
  const std::vector<HostEntry>& ready = w.in_entries[1 * w.size() + q];
  for (size_t k = 0; k < requests.size(); ++k) {
    const ReduceRequest& r = requests[k];
    // A reduce-scatter's result is its own part: nothing to read, only the
    // acknowledgement below (its owner's posting is released by it).
    if (r.collective == Collective::kReduceScatter) continue;
    const size_t elem = ElementSize(r.dtype);
    uint64_t from = ready[k].addr;
    for (const Range& range : w.slices[k][q]) {
      const size_t len = range.len * elem;
      if (len == 0) continue;
      Status s = ReadProcessMemory(w.pids[q], from,
                                   static_cast<char*>(r.out) + range.begin * elem, len);
      if (!s.ok()) {
        return HostReadFailed(batch, q, "slice of " + batch->jobs[k]->Describe(), s);
      }
      host_bytes_read_ += len;
      from += len;
    }
  }
  if (w.board) {
    board_->Ack(w.board_index[q], w.ready_posting[q], w.ready_version[q]);
  } else {
    w.done_sent[q] = true;
    SendHost(batch, 2, q);
  }
  return Status::Ok();
}

Status Communicator::HostContributors(Batch* batch, size_t k, uint64_t* total) {
  const HostWait& w = *batch->host;
  *total = 0;
  for (int q = 0; q < w.size(); ++q) {
    if (!AddContributors(total, q == w.me ? batch->jobs[k]->req.contributors
                                          : w.in_entries[0 * w.size() + q][k].contributors)) {
      return Status::Error("rank " + std::to_string(config_.rank) + ": the processes of this "
                           "host count more than " + std::to_string(kMaxContributors) +
                           " devices in " + batch->jobs[k]->Describe());
    }
  }
  return Status::Ok();
}

Status Communicator::ReadInputPiece(Batch* batch, size_t k, size_t at, size_t bytes,
                                    const void* own, char* pieces,
                                    std::vector<const void*>* srcs) {
  const HostWait& w = *batch->host;
  for (int q = 0, slot = 0; q < w.size(); ++q) {
    if (q == w.me) {
      (*srcs)[q] = own;
      continue;
    }
    // The arrive entries of process q (step 0).
    char* into = pieces + (slot++) * kHostPieceBytes;
    Status s = ReadProcessMemory(w.pids[q], w.in_entries[0 * w.size() + q][k].addr + at, into,
                                 bytes);
    if (!s.ok()) return HostReadFailed(batch, q, "input of " + batch->jobs[k]->Describe(), s);
    host_bytes_read_ += bytes;
    (*srcs)[q] = into;
  }
  return Status::Ok();
}

Status Communicator::ReduceInHosts(uint32_t stream, const GroupPlan& plan,
                                   const std::vector<ReduceRequest>& requests,
                                   const std::vector<Identity>& ids) {
  for (const ReduceRequest& r : requests) {
    // The same verdict on every process (it depends on parts and topology).
    if (!CodecAligned(r, plan)) {
      return ReduceFlat(stream, plan.group, requests, ids, ServedFlags(plan.group, requests));
    }
  }
  host_calls_ += 1;
  const int p = static_cast<int>(plan.local.size());
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
  batch->host = std::make_unique<HostWait>();
  HostWait& w = *batch->host;
  w.local = plan.local;
  w.me = plan.local_index;
  w.hosts = plan.hosts;
  for (int r : plan.local) w.pids.push_back(topology_.pid_of[r]);
  w.got.reset(new std::atomic<uint8_t>[p]());
  w.done_sent.reset(new std::atomic<bool>[p]());
  w.in_headers.resize(HostWait::kSteps * p);
  w.in_entries.resize(HostWait::kSteps * p);
  for (int q = 0; q < p; ++q) {
    w.in_entries[0 * p + q].resize(num);
    w.in_entries[1 * p + q].resize(num);
  }
  w.slices.resize(num);
  for (size_t k = 0; k < num; ++k) {
    for (int q = 0; q < p; ++q) w.slices[k].push_back(SliceOf(requests[k], plan, q));
  }
  // The direct path: the same verdict on every process of the host (the same
  // requests, plan and host_direct_bytes).
  size_t call_bytes = 0;
  bool direct = plan.board && num <= static_cast<size_t>(HostBoard::kEntries) &&
                plan.hosts == 1 && p > 1;
  for (const ReduceRequest& r : requests) {
    call_bytes += r.count * ElementSize(r.dtype);
    direct = direct && r.collective == Collective::kAllReduce;
  }
  w.direct = direct && call_bytes <= config_.host_direct_bytes;
  std::vector<size_t> slice_bytes;
  for (size_t k = 0; k < num; ++k) {
    const ReduceRequest& r = requests[k];
    // A reduce-scatter on one host sums straight into its output (its part).
    const bool staged = r.collective != Collective::kReduceScatter || plan.hosts > 1;
    // The direct path stages the whole input.
    slice_bytes.push_back(w.direct ? r.count * ElementSize(r.dtype)
                          : staged ? Total(w.slices[k][w.me]) * ElementSize(r.dtype)
                                   : 1);
  }
  if (w.direct) host_direct_calls_ += 1;
  Status prepared = PrepareHostCall(batch.get(), plan, requests, slice_bytes);
  if (!prepared.ok()) {
    // Nothing is published yet, but the others wait for this process's
    // inputs: they are told now, not at their timeouts.
    Fail(batch.get(), prepared.message());
    return prepared;
  }
  // Each step: a receive from and a send to every other process (none
  // through the boards). Set before anything is sent: completions read it.
  {
    std::lock_guard<std::mutex> lock(batch->mu);
    batch->remaining = w.board ? 0 : 2 * HostWait::kSteps * (p - 1);
  }
  batch->started = true;
  if (config_.test_forge_as >= 0) SendForgeries(batch.get());
  if (Activate(batch.get())) {
    for (int step = 0; !w.board && step < HostWait::kSteps; ++step) {
      for (int q = 0; q < p; ++q) {
        if (q != w.me) PostHostRecv(batch.get(), step, q);
      }
    }
    PublishHost(batch.get(), 0);
  }

  bool timed_out = false;
  bool ok = false;
  try {
    ok = !batch->Failed() &&
         (w.direct ? RunHostDirect(batch.get(), requests, &timed_out)
                   : RunHostSteps(batch.get(), stream, plan, requests, ids, &timed_out));
  } catch (const std::bad_alloc&) {
    // Posted receives and a published posting name this batch: it must go
    // the way of every failed one, never be freed by the unwinding.
    Fail(batch.get(), "rank " + std::to_string(config_.rank) +
                          " ran out of memory in the host stage of " +
                          batch->jobs.front()->Describe());
  }
  if (ok) {
    // Done here; the other processes may still be reading this one's slice.
    w.waiting = -1;
    w.lingering = true;
    Deactivate(batch.get());
    Linger(std::move(batch));
    return Status::Ok();
  }
  return EndHostCall(std::move(batch), requests, timed_out);
}

bool Communicator::RunHostSteps(Batch* batch, uint32_t stream, const GroupPlan& plan,
                                const std::vector<ReduceRequest>& requests,
                                const std::vector<Identity>& ids, bool* timed_out) {
  HostWait& w = *batch->host;
  const int p = w.size();
  const int me = w.me;
  const size_t num = requests.size();
  const bool board = w.board;
  bool ok = true;
  auto wait = [&](int step) {
    if (ok && !(board ? WaitBoard(batch, step) : WaitHost(batch, step))) *timed_out = true;
    ok = ok && !*timed_out && !batch->Failed();
  };
  auto fail = [&](const Status& s, bool tell_peers) {
    if (!s.ok() && ok) {
      Fail(batch, s.message(), tell_peers);
      ok = false;
    }
  };

  // 2. reduce-scatter (not for an all-gather: nothing to sum inside the host,
  // nor any input to read, so nothing to wait for: the ready step checks the
  // peers' entries as the arrive step would).
  const bool gather_only =
      std::all_of(requests.begin(), requests.end(),
                  [](const ReduceRequest& r) { return r.collective == Collective::kAllGather; });
  if (!gather_only) wait(0);
  std::vector<uint64_t> contributors(num, 0);
  for (size_t k = 0; gather_only && k < num; ++k) contributors[k] = requests[k].contributors;
  for (size_t k = 0; ok && !gather_only && k < num; ++k) {
    fail(HostContributors(batch, k, &contributors[k]), true);
  }
  if (ok && config_.test_read_delay_ms > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(config_.test_read_delay_ms));
  }
  if (ok) {
    PooledBuffer pieces(&pool_, std::max<size_t>(1, (p - 1) * kHostPieceBytes));
    if (!pieces.ok()) fail(Status::Error("out of memory for the host stage"), true);
    std::vector<const void*> srcs(p);
    for (size_t k = 0; ok && k < num; ++k) {
      const ReduceRequest& r = requests[k];
      if (r.collective == Collective::kAllGather) continue;
      const size_t elem = ElementSize(r.dtype);
      const size_t piece = std::max<size_t>(1, kHostPieceBytes / elem);
      const double divisor =
          r.op == ReduceOp::kMean && w.hosts == 1 ? static_cast<double>(contributors[k]) : 1.0;
      size_t staged = 0;  // elements of the slice summed so far
      for (const Range& range : w.slices[k][me]) {
        // Between pieces: a call that failed meanwhile (an abort, a withdrawal)
        // stops reading at once.
        for (size_t off = 0; ok && off < range.len;
             off += piece, ok = ok && !batch->Failed()) {
          const size_t n = std::min(piece, range.len - off);
          const size_t at = (range.begin + off) * elem;
          fail(ReadInputPiece(batch, k, at, n * elem, static_cast<const char*>(r.in) + at,
                              pieces.data(), &srcs),
               true);
          if (!ok) break;
          char* slice = w.staging[k].data() + (staged + off) * elem;
          if (w.hosts > 1) {
            ReduceOpInto(r.op, r.dtype, slice, nullptr, srcs.data(), p, n, divisor);
          } else if (r.collective == Collective::kReduceScatter) {
            // One host: the slice is this process's part, final: its output.
            ReduceOpInto(r.op, r.dtype, static_cast<char*>(r.out) + (staged + off) * elem,
                         nullptr, srcs.data(), p, n, divisor);
          } else {
            // One host: the slice is final, into the output at once too.
            ReduceOpInto(r.op, r.dtype, slice, static_cast<char*>(r.out) + at, srcs.data(), p,
                         n, divisor);
          }
        }
        staged += range.len;
      }
    }
  }
  // The last read of the others' inputs is done: were they still there? (An
  // all-gather read none, and found no peer's arrive posting to check.)
  if (ok && !gather_only) fail(CheckInputsStillPosted(batch), true);

  // 3. across hosts: this process's slice with the same slice of every host
  // (a reduce-scatter's result lands in its output; an all-gather's parts
  // of every host with this local index land in its staging).
  if (ok && w.hosts > 1) {
    std::vector<ReduceRequest> slices(requests);
    // Error feedback: this process encodes its slice of the host's sum, and
    // keeps what that lost (its host's other processes keep nothing of it).
    std::vector<PooledBuffer> lost(num);
    for (size_t k = 0; k < num; ++k) {
      ReduceRequest& slice = slices[k];
      slice.lost = nullptr;
      if (requests[k].lost != nullptr) {
        lost[k] = PooledBuffer(&pool_, std::max<size_t>(1, Total(w.slices[k][me])) * 4);
        if (!lost[k].ok()) {
          fail(Status::Error("out of memory for the host stage"), true);
          break;
        }
        // The stage across hosts encodes every element of the slice; zeros
        // all the same, so that nothing stale could ever be kept.
        std::memset(lost[k].data(), 0, Total(w.slices[k][me]) * 4);
        slice.lost = reinterpret_cast<float*>(lost[k].data());
      }
      slice.count = Total(w.slices[k][me]);
      slice.contributors = static_cast<uint32_t>(contributors[k]);
      slice.in = w.staging[k].data();
      slice.out = w.staging[k].data();
      if (slice.collective != Collective::kAllReduce) slice.parts = CrossParts(w.slices[k][me]);
      if (slice.collective == Collective::kReduceScatter) slice.out = requests[k].out;
      if (slice.collective == Collective::kAllGather) slice.in = requests[k].in;
    }
    // Server-only processes take their share of the slices of the buffers
    // that would use them on the flat path (judged by the whole buffer: the
    // same verdict on every process). A slice holds an nth of the host's
    // bytes, but each host's processes send theirs at once, so the servers
    // carry the host's whole buffer, as on the flat path with one process
    // per host; their share is the one for as many workers as hosts.
    std::vector<bool> served = ServedFlags(plan.group, requests);
    for (size_t k = 0; k < num; ++k) served[k] = served[k] && slices[k].count > 0;
    // Its failure has been told to every rank already.
    if (ok) fail(ReduceFlat(stream, plan.cross, slices, ids, served), /*tell_peers=*/false);
    for (size_t k = 0; ok && k < num; ++k) {
      if (requests[k].lost == nullptr) continue;
      size_t staged = 0;
      for (const Range& range : w.slices[k][me]) {
        std::memcpy(requests[k].lost + range.begin, lost[k].data() + staged * 4,
                    range.len * 4);
        staged += range.len;
      }
    }
  }

  // 4. ready, and this process's own slice into its output (an all-gather's
  // on one host: its input, staged for the others to read).
  if (ok) {
    for (size_t k = 0; k < num; ++k) {
      const ReduceRequest& r = requests[k];
      if (r.collective == Collective::kAllGather && w.hosts == 1) {
        std::memcpy(w.staging[k].data(), r.in, Total(w.slices[k][me]) * ElementSize(r.dtype));
      }
      HostEntry e = w.out_entries[0][k];
      e.addr = reinterpret_cast<uint64_t>(w.staging[k].data());
      e.contributors = static_cast<uint32_t>(contributors[k]);
      w.out_entries[1].push_back(e);
    }
    w.out_headers[1] = MakeHeader(*batch->jobs.front(), MsgKind::kHostReady, config_.token,
                                  static_cast<uint32_t>(config_.rank), me, 0,
                                  num * sizeof(HostEntry), 1);
    PublishHost(batch, 1);
    for (size_t k = 0; k < num; ++k) {
      const ReduceRequest& r = requests[k];
      const bool copy = r.collective == Collective::kAllGather ||
                        (r.collective == Collective::kAllReduce && w.hosts > 1);
      const size_t elem = ElementSize(r.dtype);
      size_t staged = 0;
      for (const Range& range : w.slices[k][me]) {
        if (copy) {
          std::memcpy(static_cast<char*>(r.out) + range.begin * elem,
                      w.staging[k].data() + staged * elem, range.len * elem);
        }
        staged += range.len;
      }
    }
  }
  // Tests: this call fails here without telling anyone, as when another
  // rank's abort reached this process first (WithdrawHost, host_posting.cc).
  if (ok && TestFault("withdraw-after-ready")) {
    fail(Status::Error("rank " + std::to_string(config_.rank) +
                           ": test fault withdraw-after-ready (HERRING_TEST_FAULT)"),
         /*tell_peers=*/false);
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
      next = NextPosted(batch, 1, gathered, Deadline(), timed_out);
      ok = next >= 0 && !batch->Failed();
      if (!ok) break;
      gathered[next] = true;
      fail(GatherFrom(batch, next, requests), true);
      continue;
    }
    w.waiting = 1;
    {
      std::unique_lock<std::mutex> lock(batch->mu);
      *timed_out = !batch->cv.wait_until(lock, Deadline(), [&] {
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
    ok = !*timed_out && !batch->Failed();
    if (!ok) break;
    gathered[next] = true;
    fail(GatherFrom(batch, next, requests), true);
  }
  return ok;
}

}  // namespace herring::engine
