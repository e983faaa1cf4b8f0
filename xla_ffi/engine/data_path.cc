// The data path: a job's contributions go to every part's server, the server
// sums its part in rank order and sends the result back. A reduce-scatter is
// the first half (the server keeps its sum), an all-gather the second (the
// server's "sum" is its own part); through server-only processes, those two
// go one block at a time (Job::root, ReduceFlat). Runs on the caller's thread
// (PostJob, SendJob), the transport's progress thread (On* callbacks) and the server threads
// (ReduceChunk, re-posts).
#include "engine/communicator.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "engine/batch.h"
#include "engine/codec.h"
#include "engine/reduce_kernels.h"

namespace herring::engine {

namespace {

// How long a transport error on a peer's connection waits for that peer's
// abort, which names the cause (FailOnTransportError).
constexpr double kPeerReasonGraceS = 1.0;

}  // namespace

void Communicator::DropAndRepost(Batch* batch, const std::string& why,
                                 std::function<void()> repost) {
  CountDropped(why);
  // The completed receive leaves flight; the queued re-post enters it until
  // it has posted the new receive (from a server thread: never post from the
  // progress thread, which must not wait on the transport's queues).
  batch->AddTask();
  batch->Complete(0, 1);
  Enqueue([this, batch, repost = std::move(repost)] {
    if (!batch->Failed()) repost();
    // Tests: widen the window between the new receive and the end of this
    // task, in which a success path that waited only for `remaining` once
    // freed the batch under it.
    if (config_.test_stale_copies) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    batch->CompleteTask(0);
  });
}

bool Communicator::AcceptHeader(Batch* batch, const WireHeader& h, size_t len,
                                const Expectation& want, std::function<void()> repost) {
  std::string why;
  switch (CheckHeader(&h, len, want, &why)) {
    case HeaderVerdict::kOk:
      return true;
    case HeaderVerdict::kCollision:
      Fail(batch, why);
      batch->Complete(1, 1);
      return false;
    case HeaderVerdict::kMismatch:
      Fail(batch, "mismatched reductions: " + why);
      batch->Complete(1, 1);
      return false;
    default:
      DropAndRepost(batch, why, std::move(repost));
      return false;
  }
}

namespace {

// Error feedback: what encoding chunk c of part i of this process's
// contribution lost (ReduceRequest::lost), from its encoding as it travels.
// On the caller's thread, before the chunk is sent: the input is intact.
void KeepLoss(Job* job, int i, size_t c) {
  if (job->req.lost == nullptr) return;
  const size_t begin = job->ChunkBegin(i, c);
  EncodingLoss(job->req.codec, reinterpret_cast<const float*>(job->InAt(begin)),
               job->ChunkLen(i, c), job->WireIn(i, c), job->req.lost + (begin - job->in_base));
}

}  // namespace

// Its buffers, and every receive it needs: ReduceFlat posts those of every
// job of a call before any job sends (SendJob), so that peers' messages find
// posted buffers, also those of a later job (a later block, a later bucket).
Status Communicator::PostJob(Batch* batch, Job* job) {
  const int n = job->n;
  const int me = job->me;
  const size_t chunks_me = job->Chunks(me);
  job->send_hdrs.resize(n * job->max_chunks);
  job->result_hdrs.resize(n * job->max_chunks);
  job->contrib_hdrs.resize(n * job->max_chunks);
  job->out_hdrs.resize(job->max_chunks);
  job->contributors.reset(new std::atomic<uint32_t>[n]);
  for (int p = 0; p < n; ++p) job->contributors[p].store(0, std::memory_order_relaxed);
  job->contributors[me].store(job->req.contributors, std::memory_order_relaxed);
  job->arrivals.reset(new std::atomic<int>[std::max<size_t>(1, chunks_me)]());
  job->contribs_from.reset(new std::atomic<int>[n]());
  job->results_from.reset(new std::atomic<int>[n]());
  job->staging.resize(n);

  job->results_staged = !job->Encoded() && job->req.in == job->req.out &&
                        job->req.collective == Collective::kAllReduce;
  if (job->ResultsApart()) {
    job->wire_out = PooledBuffer(&pool_, job->Slots() * job->max_chunks * job->wire_stride);
    if (!job->wire_out.ok()) return Status::Error("out of memory for received results");
  }
  if (job->Encoded() && (job->Contributes() || job->root == me)) {
    job->wire_in = PooledBuffer(&pool_, job->Slots() * job->max_chunks * job->wire_stride);
    if (!job->wire_in.ok()) return Status::Error("out of memory for encoded buffers");
  }
  if (job->Encoded() && job->Contributes()) {
    // This process's contribution to its own part, encoded before any
    // receive is posted: a server task may sum a chunk as soon as the other
    // contributions to it have arrived, and it sums this one as decoded.
    for (size_t c = 0; c < chunks_me; ++c) {
      Encode(job->req.codec, reinterpret_cast<const float*>(job->InAt(job->ChunkBegin(me, c))),
             job->ChunkLen(me, c), job->WireIn(me, c));
      KeepLoss(job, me, c);
    }
  }
  if (config_.test_early_strangers) {
    // Strangers that reach the peers' result receives before the peers have
    // sent their contributions (they wait too, below). Before this process
    // posts its own receives: a peer's contributions already here would
    // complete them at once, and a server task would send this part's
    // results, ahead of the strangers on the same lane, before they left.
    for (int p = 0; p < n; ++p) {
      if (p != me && p < job->workers) SendEarlyStrangers(job, p);
    }
  }
  // Receives before sends, so that peers' messages find posted buffers.
  if (chunks_me > 0 && job->Contributes()) {
    for (int p = 0; p < job->workers; ++p) {
      if (p == me) continue;
      job->staging[p] = PooledBuffer(&pool_, chunks_me * job->wire_stride);
      if (!job->staging[p].ok()) return Status::Error("out of memory for staging buffers");
      for (size_t c = 0; c < chunks_me; ++c) PostContributionRecv(job, p, c);
    }
  }
  for (int i = 0; i < n; ++i) {
    for (int c = 0; c < job->ResultsFrom(i); ++c) PostResultRecv(job, i, c);
  }
  return Status::Ok();
}

// What this process sends of the job (PostJob ran for every job of the call).
Status Communicator::SendJob(Batch* batch, Job* job) {
  const int n = job->n;
  const int me = job->me;
  const size_t chunks_me = job->Chunks(me);
  if (!job->Contributes() && job->root >= 0) {
    Status s = SendGatherShares(job);
    if (!s.ok()) return s;
  }
  if (!job->Contributes() && job->Encoded()) {
    // An all-gather through a codec: server tasks encode this process's
    // part chunk by chunk and send it.
    for (size_t c = 0; c < chunks_me; ++c) {
      batch->AddTask();
      Enqueue([this, job, c] { ReduceChunk(job, c); });
    }
    return Status::Ok();
  }
  if (!job->Contributes()) {
    // An all-gather: this process's part is its result as it is. It goes
    // straight from the input, chunk-major and starting at the next process
    // (as contributions do), and into this process's own output.
    if (chunks_me == 0) return Status::Ok();  // a block of another worker
    const size_t begin = job->PartBegin(me);
    std::memcpy(job->OutAt(begin), job->InAt(begin), job->PartLen(me) * job->elem);
    batch->Complete(chunks_me, 0);  // every chunk "summed"
    const uint32_t rank = static_cast<uint32_t>(config_.rank);
    for (size_t c = 0; c < chunks_me; ++c) {
      const size_t bytes = job->ChunkLen(me, c) * job->elem;
      job->out_hdrs[c] = MakeHeader(*job, MsgKind::kResult, config_.token, rank, me, c, bytes,
                                    job->req.contributors);
    }
    const int workers = job->workers;
    for (size_t c = 0; c < chunks_me; ++c) {
      for (int step = 1; step < workers; ++step) {
        SendResult(job, (me + step) % workers, c, job->InAt(job->ChunkBegin(me, c)),
                   job->ChunkLen(me, c) * job->elem);
      }
    }
    return Status::Ok();
  }
  if (config_.test_early_strangers) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  // Contributions, chunk-major and starting at the next server, so that the
  // processes do not all send to the same server at the same moment. A
  // server-only process's part goes as kServed: its receives take any
  // reduction's (served.cc).
  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  // With a codec each chunk is encoded just before it is sent.
  for (size_t c = 0; c < job->max_chunks; ++c) {
    for (int step = 1; step < n; ++step) {
      const int i = (me + step) % n;
      if (c >= job->Chunks(i)) continue;
      const size_t len = job->WireBytes(i, c);
      char* data = const_cast<char*>(job->InAt(job->ChunkBegin(i, c)));
      if (job->Encoded()) {
        Encode(job->req.codec, reinterpret_cast<const float*>(data), job->ChunkLen(i, c),
               job->WireIn(i, c));
        KeepLoss(job, i, c);
        data = job->WireIn(i, c);
      }
      const MsgKind kind = i < job->workers ? MsgKind::kContribution : MsgKind::kServed;
      WireHeader& h = job->send_hdrs[i * job->max_chunks + c];
      h = MakeHeader(*job, kind, config_.token, my_rank, i, c, len, job->req.contributors);
      if (kind == MsgKind::kServed) SetServedGroup(job, &h);
      Status s = SendPart(job, i, c, kind, &h, data, len);
      if (!s.ok()) return s;
    }
  }
  return Status::Ok();
}

// Which group sends a kServed message, and its block's owner: a server sums
// any group's parts (served.cc).
void Communicator::SetServedGroup(const Job* job, WireHeader* h) const {
  ServedGroup g;
  g.first = static_cast<uint32_t>(job->batch->group[0]);
  g.size = static_cast<uint32_t>(job->workers);
  g.position = static_cast<uint32_t>(job->me);
  if (job->root >= 0) {
    g.root = static_cast<uint32_t>(job->root);
    g.gather = job->req.collective == Collective::kAllGather;
  }
  h->served = PackServedGroup(g);
  SealHeader(h);
}

// Sends chunk c of part i (`h` its header, `len` bytes at `data`) to the
// part's process, as work of the batch.
Status Communicator::SendPart(Job* job, int i, size_t c, MsgKind kind, WireHeader* h,
                              const char* data, size_t len) {
  Batch* batch = job->batch;
  const int to = batch->group[i];
  transport::IoVec iov[2] = {{h, sizeof(*h)}, {const_cast<char*>(data), len}};
  const uint64_t tag =
      MakeTag(kind, static_cast<uint32_t>(config_.rank), batch->stream, job->tag_bits, c);
  if (config_.test_stale_copies) SendStaleCopy(batch, to, tag, *h);
  batch->AddInflight(1);
  Status s = transport_->Send(
      to, tag, iov, len > 0 ? 2 : 1,
      [this, job, to](const transport::Completion& done) { SendDone(job, to, done); });
  if (!s.ok()) {
    batch->Complete(1, 1);
    return Status::Error("sending to rank " + std::to_string(to) + ": " + s.message());
  }
  ledger_.Sent(to);
  return Status::Ok();
}

// An all-gather's block through the servers: its owner sends the servers'
// share of it (encoded with a codec, and then kept as decoded in its own
// output, as its own part is) and the other workers a header without data
// for each of its chunks, by which each server learns whom to send it to.
Status Communicator::SendGatherShares(Job* job) {
  const bool owner = job->root == job->me;
  for (size_t c = 0; c < job->max_chunks; ++c) {
    for (int i = job->workers; i < job->n; ++i) {
      if (c >= job->Chunks(i)) continue;
      const size_t begin = job->ChunkBegin(i, c);
      const size_t count = job->ChunkLen(i, c);
      const char* data = nullptr;
      size_t len = 0;
      if (owner && job->Encoded()) {
        Encode(job->req.codec, reinterpret_cast<const float*>(job->InAt(begin)), count,
               job->WireIn(i, c));
        Decode(job->req.codec, job->WireIn(i, c), count,
               reinterpret_cast<float*>(job->OutAt(begin)));
        data = job->WireIn(i, c);
        len = job->WireBytes(i, c);
      } else if (owner) {
        std::memcpy(job->OutAt(begin), job->InAt(begin), count * job->elem);
        data = job->InAt(begin);
        len = count * job->elem;
      }
      WireHeader& h = job->send_hdrs[i * job->max_chunks + c];
      h = MakeHeader(*job, MsgKind::kServed, config_.token,
                     static_cast<uint32_t>(config_.rank), i, c, len, job->req.contributors);
      SetServedGroup(job, &h);
      Status s = SendPart(job, i, c, MsgKind::kServed, &h, data, len);
      if (!s.ok()) return s;
    }
  }
  return Status::Ok();
}

void Communicator::PostContributionRecv(Job* job, int p, size_t c) {
  Batch* batch = job->batch;
  const int me = job->me;
  WireHeader* h = &job->contrib_hdrs[p * job->max_chunks + c];
  const size_t len = job->WireBytes(me, c);
  transport::IoVec iov[2] = {{h, sizeof(*h)}, {job->staging[p].data() + c * job->wire_stride, len}};
  batch->AddInflight(1);
  Status s = transport_->Recv(
      MakeTag(MsgKind::kContribution, batch->group[p], batch->stream, job->tag_bits, c), 0,
      iov, 2,
      [this, job, p, c](const transport::Completion& done) { OnContribution(job, p, c, done); },
      /*background=*/false, /*from=*/batch->group[p]);
  if (!s.ok()) {
    Fail(batch, "posting a receive: " + s.message());
    batch->Complete(1, 1);
  }
}

void Communicator::PostResultRecv(Job* job, int i, size_t c) {
  Batch* batch = job->batch;
  WireHeader* h = &job->result_hdrs[i * job->max_chunks + c];
  const size_t len = job->WireBytes(i, c);
  char* into = job->ResultsApart() ? job->WireOut(i, c) : job->OutAt(job->ChunkBegin(i, c));
  transport::IoVec iov[2] = {{h, sizeof(*h)}, {into, len}};
  batch->AddInflight(1);
  if (!job->ResultsApart()) batch->output_recvs.fetch_add(1);
  Status s = transport_->Recv(
      MakeTag(MsgKind::kResult, batch->group[i], batch->stream, job->tag_bits, c), 0, iov, 2,
      [this, job, i, c](const transport::Completion& done) { OnResult(job, i, c, done); },
      /*background=*/false, /*from=*/batch->group[i]);
  if (!s.ok()) {
    if (!job->ResultsApart()) batch->output_recvs.fetch_sub(1);
    Fail(batch, "posting a receive: " + s.message());
    batch->Complete(1, 1);
  }
}

bool ReceiveFailed(const transport::Completion& done, const Job& job, int from_rank,
                   int my_rank, const WireHeader& header, uint64_t token, std::string* why) {
  if (done.ok) return false;
  if (!done.truncated) {
    *why = "receive from rank " + std::to_string(from_rank) + " failed for " + job.Describe() +
           ": " + done.error;
    return true;
  }
  TruncatedReceive t;
  t.header = &header;
  t.token = token;
  t.id = job.id;
  t.key = job.req.key;
  t.receive = "rank " + std::to_string(my_rank) + "'s receive for " + job.Describe();
  t.from_rank = from_rank;
  t.received_len = done.len;
  t.cut_off = done.cut_off;
  t.provider_error = done.error;
  *why = DescribeTruncation(t);
  return true;
}

Expectation Communicator::Expect(const Job& job, MsgKind kind, int from_rank, int part,
                                 size_t chunk) const {
  Expectation want;
  want.kind = kind;
  want.token = config_.token;
  want.key = job.req.key;
  want.id = job.id;
  want.src_rank = static_cast<uint32_t>(from_rank);
  want.self_rank = static_cast<uint32_t>(config_.rank);
  want.stream = job.batch->stream;
  want.part = job.WirePart(part);
  want.chunk = static_cast<uint32_t>(chunk);
  want.dtype = job.req.dtype;
  want.op = job.req.op;
  want.codec = job.req.codec;
  // A host-stage job has no parts (its caller sets what the message carries).
  want.payload_bytes = IsHostKind(kind) ? 0 : job.WireBytes(part, chunk);
  want.total_elems = job.req.count;
  return want;
}

void Communicator::OnContribution(Job* job, int p, size_t c, const transport::Completion& done) {
  Batch* batch = job->batch;
  const int from = batch->group[p];
  std::string why;
  const WireHeader& h = job->contrib_hdrs[p * job->max_chunks + c];
  if (ReceiveFailed(done, *job, from, config_.rank, h, config_.token, &why)) {
    FailReceive(batch, from, why);
    return;
  }
  if (!AcceptHeader(batch, h, done.len,
                    Expect(*job, MsgKind::kContribution, from, job->me, c),
                    [this, job, p, c] { PostContributionRecv(job, p, c); })) {
    return;
  }
  Heard(static_cast<uint32_t>(from));
  job->contributors[p].store(h.contributors, std::memory_order_relaxed);
  job->contribs_from[p].fetch_add(1);
  TookFrom(from);
  if (job->arrivals[c].fetch_add(1) + 1 == job->workers - 1) {
    batch->AddTask();
    Enqueue([this, job, c] { ReduceChunk(job, c); });
  }
  batch->Complete(1, 1);
}

void Communicator::ReduceChunk(Job* job, size_t c) {
  Batch* batch = job->batch;
  const int n = job->workers;  // a part's contributors and receivers
  const int me = job->me;
  const size_t sends = job->Returns() ? n - 1 : 0;
  if (batch->Failed()) {
    batch->CompleteTask(1 + sends);
    return;
  }
  const size_t begin = job->ChunkBegin(me, c);
  const size_t count = job->ChunkLen(me, c);
  // Rank order, whichever contribution arrived first: the sum is the same
  // bits on every run. An all-gather's only source is this process's part.
  const int sources = job->Contributes() ? n : 1;
  std::vector<const void*> srcs(n);
  uint64_t contributors = 0;
  bool counted = true;
  for (int p = 0; p < sources; ++p) {
    srcs[p] = p == me || !job->Contributes()
                  ? static_cast<const void*>(job->InAt(begin))
                  : job->staging[p].data() + c * job->wire_stride;
    counted = counted &&
              AddContributors(&contributors, job->contributors[p].load(std::memory_order_relaxed));
  }
  if (!counted) {
    Fail(batch, "rank " + std::to_string(config_.rank) + ": the contributions to " +
                    job->Describe() + " count more than " + std::to_string(kMaxContributors) +
                    " devices together; a peer's headers are wrong");
    batch->CompleteTask(1 + sends);
    return;
  }
  if (!job->Contributes()) contributors = job->req.contributors;
  const double divisor = job->req.op == ReduceOp::kMean ? contributors : 1.0;
  char* dst = job->OutAt(begin);
  const char* payload = dst;
  size_t payload_bytes = count * job->elem;
  if (job->Encoded() && !job->Contributes()) {
    // This process's part as it travels, and as decoded here too, so every
    // process holds the same bits.
    Encode(job->req.codec, reinterpret_cast<const float*>(job->InAt(begin)), count,
           job->WireOut(me, c));
    Decode(job->req.codec, job->WireOut(me, c), count, reinterpret_cast<float*>(dst));
    payload = job->WireOut(me, c);
    payload_bytes = job->WireBytes(me, c);
  } else if (job->Encoded()) {
    // Every contribution as decoded (this process's own from its encoding),
    // summed in float32 in rank order; the result encoded for the way back,
    // and kept as decoded here too, so every process holds the same bits.
    const Codec codec = job->req.codec;
    srcs[me] = job->WireIn(me, c);
    SumForTheWayBack(codec, srcs.data(), n, count, static_cast<float>(divisor),
                     reinterpret_cast<float*>(dst), job->WireOut(me, c));
    Decode(codec, job->WireOut(me, c), count, reinterpret_cast<float*>(dst));
    payload = job->WireOut(me, c);
    payload_bytes = job->WireBytes(me, c);
  } else {
    ReduceOpInto(job->req.op, job->req.dtype, dst, nullptr, srcs.data(), sources, count,
                 divisor);
  }

  const uint32_t my_rank = static_cast<uint32_t>(config_.rank);
  WireHeader& h = job->out_hdrs[c];
  h = MakeHeader(*job, MsgKind::kResult, config_.token, my_rank, me, c, payload_bytes,
                 static_cast<uint32_t>(contributors));
  // Starting at the next process, as contributions do: the servers do not
  // all send to the same worker at the same moment.
  for (int step = 1; step <= static_cast<int>(sends); ++step) {
    SendResult(job, (me + step) % n, c, payload, payload_bytes);
  }
  batch->CompleteTask(1);
}

void Communicator::SendResult(Job* job, int p, size_t c, const void* payload, size_t bytes) {
  Batch* batch = job->batch;
  const WireHeader& h = job->out_hdrs[c];
  transport::IoVec iov[2] = {{const_cast<WireHeader*>(&h), sizeof(h)},
                             {const_cast<void*>(payload), bytes}};
  const uint64_t tag = MakeTag(MsgKind::kResult, static_cast<uint32_t>(config_.rank),
                               batch->stream, job->tag_bits, c);
  if (config_.test_stale_copies) SendStaleCopy(batch, batch->group[p], tag, h);
  batch->AddInflight(1);
  Status s = transport_->Send(batch->group[p], tag, iov, bytes > 0 ? 2 : 1,
                              [this, job, to = batch->group[p]](const transport::Completion& done) {
                                SendDone(job, to, done);
                              });
  if (!s.ok()) {
    Fail(batch, "sending to rank " + std::to_string(batch->group[p]) + ": " + s.message());
    batch->Complete(1, 1);
    return;
  }
  ledger_.Sent(batch->group[p]);
}

void Communicator::OnResult(Job* job, int i, size_t c, const transport::Completion& done) {
  Batch* batch = job->batch;
  // The provider is done with the output (EndFailed may wait for this).
  if (!job->ResultsApart()) batch->output_recvs.fetch_sub(1);
  const int from = batch->group[i];
  std::string why;
  const WireHeader& h = job->result_hdrs[i * job->max_chunks + c];
  if (ReceiveFailed(done, *job, from, config_.rank, h, config_.token, &why)) {
    FailReceive(batch, from, why);
    return;
  }
  if (!AcceptHeader(batch, h, done.len, Expect(*job, MsgKind::kResult, from, i, c),
                    [this, job, i, c] { PostResultRecv(job, i, c); })) {
    return;
  }
  Heard(static_cast<uint32_t>(from));
  if (job->Encoded()) {
    Decode(job->req.codec, job->WireOut(i, c), job->ChunkLen(i, c),
           reinterpret_cast<float*>(job->OutAt(job->ChunkBegin(i, c))));
  } else if (job->results_staged) {
    std::memcpy(job->OutAt(job->ChunkBegin(i, c)), job->WireOut(i, c),
                job->ChunkLen(i, c) * job->elem);
  }
  job->results_from[i].fetch_add(1);
  TookFrom(from);
  batch->Complete(1, 1);
}

void Communicator::SendDone(Job* job, int to_rank, const transport::Completion& done) {
  Batch* batch = job->batch;
  if (!done.ok && !batch->Failed()) {
    // A rank that left ran all its reductions before: this is none of them
    // (and it closes its endpoint only once this rank has its kLeave).
    if (!ledger_.Left(to_rank)) {
      FailOnTransportError(batch, "sending to " + RankText(to_rank) + " failed for " +
                                      job->Describe() + ": " + done.error);
      return;
    }
    Fail(batch, LeftText(*batch, to_rank));
  }
  batch->Complete(1, 1);
}

void Communicator::FailReceive(Batch* batch, int from, const std::string& why) {
  if (batch->Failed()) {
    batch->Complete(1, 1);
  } else if (ledger_.AllArrived(from)) {
    // A rank that left with all its data here never sends this one: its
    // closed connection is only the symptom.
    Fail(batch, LeftText(*batch, from));
    batch->Complete(1, 1);
  } else {
    FailOnTransportError(batch, why);
  }
}

void Communicator::FailOnTransportError(Batch* batch, std::string why) {
  // The operation becomes a task, which a failed call's end waits for
  // without limit (the task touches the batch); on a server thread, not the
  // progress thread, which delivers the abort being waited for.
  batch->AddTask();
  batch->Complete(0, 1);
  Enqueue([this, batch, why = std::move(why)] {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(kPeerReasonGraceS));
    // An abort fails every active batch (this one among them) with its reason.
    while (!batch->Failed() && Broken().empty() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    // Broken meanwhile: the transport's error follows from that failure,
    // whose reason this batch gives (the sweep that would fail it with that
    // reason may still be on its way: ServerGone tells the peers first).
    if (!batch->Failed()) {
      const std::string broken = Broken();
      Fail(batch, broken.empty() ? why : broken);
    }
    batch->CompleteTask(1);  // the last touch: the batch may end from here
  });
}

}  // namespace herring::engine
