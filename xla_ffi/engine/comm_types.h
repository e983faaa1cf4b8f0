// What a communicator is made of and asked for (communicator.h): its
// configuration (CommConfig), one buffer to reduce (ReduceRequest), and its
// counters (CommStats). Knows only transport.h.
#ifndef HERRING_ENGINE_COMM_TYPES_H_
#define HERRING_ENGINE_COMM_TYPES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/codec.h"
#include "engine/dtype.h"
#include "transport/transport.h"

namespace herring::engine {

struct CommConfig {
  int rank = 0;
  int size = 1;
  uint64_t token = 0;            // job token; every message carries it
  // The pipelining unit inside a part. Between hosts each part travels in
  // chunks of about a kChunksPerPart-th of the part, between min_chunk_bytes
  // and chunk_bytes (chunking.h), so that a small part's results flow while
  // its later chunks' contributions still arrive; inside one host, where a
  // message costs more than that wait, in chunks of chunk_bytes. Both must be
  // the same on every process (herring_jax passes rank 0's values to all).
  size_t chunk_bytes = 1 << 20;
  size_t min_chunk_bytes = 16 << 10;
  int server_threads = 1;
  double timeout_s = 300.0;      // no reduction waits longer
  // Liveness: every rank sends a heartbeat to every other rank each
  // `heartbeat_s` (0: none; < 0: automatic, see Connect). A rank that a reduction waits for and that has
  // sent nothing (data or heartbeat) for `peer_timeout_s` is declared dead,
  // so a killed process or a lost host fails the job long before timeout_s.
  double heartbeat_s = 1.0;
  double peer_timeout_s = 30.0;
  // A reduction that has waited this long is reported once on stderr: whom it
  // waits for and what they do (0: never).
  double stall_s = 60.0;
  // Not used by the engine: how much longer than timeout_s a platform whose
  // reductions are a start and a done (XLA:CUDA, cuda_handlers.cc) lets the
  // done wait, since the device may take that long to reach the start's copy.
  // Kept here because it is per job, like every other knob the handlers read.
  double done_grace_s = 300.0;
  // A host-stage all-reduce on one host whose buffers hold at most this many
  // bytes together takes the direct path (host_stage.cc): every process reads
  // every peer's whole input, staged, and sums it itself, so the call waits
  // for its peers once instead of twice. 0: never. Must be the same on every
  // process of a host (herring_jax passes rank 0's value to all).
  size_t host_direct_bytes = 0;
  // Server-only processes (served.cc): ranks [workers, size) never reduce
  // buffers of their own, they only sum the parts the workers place on them.
  // 0: every rank is a worker. An all-reduce over every worker places the
  // share `server_share` of each buffer on them (< 0: ServerShare's split,
  // served.h), the rest on the workers' own server shards. A buffer of fewer
  // than `server_min_bytes` bytes stays on the workers' shards: there the
  // servers' messages cost more than the bytes they save. Both must be the
  // same on every worker (every worker lays parts out alike).
  int workers = 0;
  double server_share = -1.0;
  size_t server_min_bytes = 0;
  transport::TransportOptions transport;
  // Tests only: before every data message, send one copy with a stale job
  // token, which the receiver must drop (and re-post its receive for).
  bool test_stale_copies = false;
  // Tests only: each host-stage call sleeps this long before it gathers the
  // other processes' result slices (a slow reader).
  int test_gather_delay_ms = 0;
  // Tests only: at the start of every job on the data path, send each peer,
  // for every result it will receive from this process, a full-size result
  // with another job's token and a garbage payload, then wait 20 ms before
  // sending the contributions. The receiver must drop each one without its
  // bytes landing anywhere the job reads (with in == out, the contribution
  // not sent yet: Job::results_staged).
  bool test_early_strangers = false;
  // Tests only: a fault this process's first reduction that can have it
  // meets (HERRING_TEST_FAULT): "abort-at-start" (fails at once and tells
  // every rank), "no-staging" (the host stage finds no memory for its
  // staging), "no-posting" (nor a free board posting), "withdraw-after-ready"
  // (the host stage fails after publishing its result slice without telling
  // anyone, and overwrites its inputs before returning, as XLA reusing them
  // would), "bad-alloc" (std::bad_alloc on the flat path once its batch is
  // active). Empty: none.
  std::string test_fault;
  // Tests only: each host-stage call sleeps this long before it reads the
  // other processes' inputs (a slow reader of inputs).
  int test_read_delay_ms = 0;
  // Tests only: each reduction sleeps this long between its check of the
  // communicator's state and the moment its batch becomes visible to aborts.
  int test_activate_delay_ms = 0;
  // Tests only: this process's first host-stage call sends every other rank
  // an abort, and every other process of its host an arrive (its own
  // entries), forged to come from this rank (tag and header); -1: none.
  // Receivers must drop or never match them (directed receives, source
  // checks).
  int test_forge_as = -1;
};

// One buffer to reduce. `in` holds this process's contribution (already summed
// over its local devices), `out` receives the result; they may be equal.
// A reduce-scatter's `out` holds only this process's part, an all-gather's
// `in` only its own part (parts: see below).
struct ReduceRequest {
  DType dtype = DType::kInvalid;
  ReduceOp op = ReduceOp::kSum;
  Collective collective = Collective::kAllReduce;
  size_t count = 0;          // elements of the whole buffer
  // Reduce-scatter and all-gather: where each process's part begins, in the
  // group's order (group[i] owns [parts[i], parts[i + 1]); parts.back() ==
  // count). With a codec every part begins at a multiple of kCodecBlock.
  // An all-reduce cuts its own balanced parts and leaves this empty.
  std::vector<size_t> parts;
  uint64_t key = 0;          // what is reduced (shape, dtype, op): checked on the wire
  // Which reduction this is (see Identity in wire.h), the same on every
  // process whatever order calls start in; the engine adds the occurrence.
  int64_t run_id = 0;        // XLA's run id: the executable and its launch
  uint32_t slot = 0;         // call site in the executable
  uint32_t instance = 0;     // inlined copy of the call site
  uint32_t buffer = 0;       // operand of the call
  const void* in = nullptr;
  void* out = nullptr;
  uint32_t contributors = 1;  // devices summed into `in` (divisor for mean)
  // How the data travels between processes over the transport (codec.h):
  // other than kNone only for float32 sums and means. Inside a host the host
  // stage moves float32 through memory; a group of one process is exact.
  Codec codec = Codec::kNone;
  // Error feedback (a float32 sum or mean through a codec): `count` floats
  // (the input's coordinates) that get, for every element this process
  // encoded as a contribution, what the encoding lost (EncodingLoss), and 0
  // for every other: with the host stage that is this process's slice of its
  // host's sum where the sum crosses hosts, nothing on one host; flat, its
  // whole input. Summed over the processes, the losses are exactly what the
  // contributions lost on their way to the servers. nullptr: not asked.
  float* lost = nullptr;
};

struct CommStats {
  uint64_t reductions = 0;
  uint64_t bytes_reduced = 0;
  uint64_t messages_dropped = 0;  // strangers and malformed messages
  uint64_t heartbeats_received = 0;
  uint64_t peers_declared_dead = 0;
  uint64_t occurrence_entries = 0;  // counters held: bounded, however many runs go by
  uint64_t heartbeats_sent = 0;
  uint64_t leave_notices_sent = 0;  // kLeave and kReceipt (the leave protocol)
  uint64_t wait_notices_sent = 0;   // kStall: where a waiting reduction waits
  uint64_t failed_batches_kept = 0;  // failed batches whose operations never drained
  uint64_t host_stage_calls = 0;     // calls reduced through the host stage
  uint64_t host_bytes_read = 0;      // bytes read from other processes' memory
  uint64_t host_direct_calls = 0;    // of host_stage_calls, those of the direct path
  uint64_t batches_in_flight = 0;    // batches visible to aborts now (0 between calls)
  uint64_t served_jobs = 0;          // workers: buffers that placed parts on server processes
  uint64_t served_chunks = 0;        // server processes: chunks summed and sent back
  uint64_t served_bytes = 0;         //   their result bytes
  transport::TransportStats transport;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_COMM_TYPES_H_
