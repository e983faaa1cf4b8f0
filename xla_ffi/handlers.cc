// XLA FFI handlers: decode buffers and attributes, call the engine. Nothing
// thrown below may cross into XLA: every failure becomes an ffi::Error whose
// message names the rank and says what to do.
#include "handlers.h"
#include "handler_common.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "engine/async_runner.h"
#include "engine/buffer_pool.h"
#include "engine/communicator.h"
#include "engine/local_rendezvous.h"
#include "engine/memory_hints.h"
#include "engine/reduce_kernels.h"
#include "engine/timeline.h"
#include "engine/registry.h"
#include "xla/ffi/api/ffi.h"

namespace herring {

using engine::DType;
using engine::ReduceOp;

namespace {

// The engine's element type for an XLA type, and how many engine elements
// one XLA element is: complex numbers are reduced as pairs of their real
// type (a sum or mean of complex numbers is that of their parts).
struct EngineType {
  DType dtype;
  size_t per_element;
};

EngineType FromXla(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return {DType::kFloat32, 1};
    case ffi::DataType::F64: return {DType::kFloat64, 1};
    case ffi::DataType::BF16: return {DType::kBFloat16, 1};
    case ffi::DataType::F16: return {DType::kFloat16, 1};
    case ffi::DataType::S8: return {DType::kInt8, 1};
    case ffi::DataType::S16: return {DType::kInt16, 1};
    case ffi::DataType::S32: return {DType::kInt32, 1};
    case ffi::DataType::S64: return {DType::kInt64, 1};
    case ffi::DataType::U8: return {DType::kUInt8, 1};
    case ffi::DataType::U16: return {DType::kUInt16, 1};
    case ffi::DataType::U32: return {DType::kUInt32, 1};
    case ffi::DataType::U64: return {DType::kUInt64, 1};
    case ffi::DataType::C64: return {DType::kFloat32, 2};
    case ffi::DataType::C128: return {DType::kFloat64, 2};
    default: return {DType::kInvalid, 0};
  }
}

engine::LocalRendezvous& Rendezvous() {
  static auto* rendezvous = new engine::LocalRendezvous();
  return *rendezvous;
}

std::string GroupKey(int64_t stream, const std::vector<int>& group) {
  std::string key = std::to_string(stream) + ":";
  for (int64_t r : group) key += std::to_string(r) + ",";
  return key;
}

// Reduces the buffers of all local participants: first across the local
// devices (in position order), then across processes, then copies the result
// to every local device's output.
engine::Status ReduceAll(engine::Communicator& comm, ReduceOp op, engine::Codec codec,
                         uint64_t key,
                         int64_t run_id, uint32_t slot, uint32_t instance, uint32_t stream,
                         const std::vector<int>& group,
                         const std::vector<DType>& dtypes, const std::vector<size_t>& counts,
                         const std::vector<engine::LocalArrival>& arrivals) {
  const size_t num_buffers = dtypes.size();
  const size_t local = arrivals.size();
  std::vector<engine::ReduceRequest> requests(num_buffers);
  std::vector<engine::PooledBuffer> scratch(num_buffers);
  std::vector<const void*> srcs(local);
  for (const engine::LocalArrival& a : arrivals) {
    for (size_t k = 0; k < num_buffers; ++k) {
      engine::AdviseHugePages(a.out[k], counts[k] * engine::ElementSize(dtypes[k]));
    }
  }
  for (size_t k = 0; k < num_buffers; ++k) {
    engine::ReduceRequest& r = requests[k];
    r.dtype = dtypes[k];
    r.op = op;
    r.codec = codec;
    r.count = counts[k];
    r.key = key + k;
    r.run_id = run_id;
    r.slot = slot;
    r.instance = instance;
    r.buffer = static_cast<uint32_t>(k);
    r.out = arrivals[0].out[k];
    r.contributors = static_cast<uint32_t>(local);
    // Error feedback: the first device keeps what encoding the process's
    // contribution (its devices' sum) lost; the others' losses are zeros.
    if (!arrivals[0].lost.empty()) {
      r.lost = arrivals[0].lost[k];
      for (size_t d = 1; d < local; ++d) std::memset(arrivals[d].lost[k], 0, counts[k] * 4);
    }
    if (local == 1) {
      r.in = arrivals[0].in[k];
      continue;
    }
    scratch[k] = engine::PooledBuffer(&comm.pool(), counts[k] * engine::ElementSize(dtypes[k]));
    if (!scratch[k].ok()) return engine::Status::Error("out of memory for the local sum");
    for (size_t d = 0; d < local; ++d) srcs[d] = arrivals[d].in[k];
    engine::ReduceOpInto(op, dtypes[k], scratch[k].data(), nullptr, srcs.data(), local,
                         counts[k], 1.0);
    r.in = scratch[k].data();
  }
  engine::Status status = comm.AllReduce(stream, group, requests);
  if (!status.ok()) return status;
  for (size_t d = 1; d < local; ++d) {
    for (size_t k = 0; k < num_buffers; ++k) {
      std::memcpy(arrivals[d].out[k], arrivals[0].out[k],
                  counts[k] * engine::ElementSize(dtypes[k]));
    }
  }
  return status;
}

}  // namespace

ffi::Error DecodeOperands(ffi::RemainingArgs args, const CallAttrs& attrs, DecodedCall* call) {
  call->comm = engine::Registry::Get().Find(attrs.comm);
  if (!call->comm) {
    // Nobody may read this error: a step still queued when shutdown() ran,
    // whose results nothing held (shutdown() waits for live results only).
    // Said once on stderr, since the other processes fail waiting for it.
    static std::once_flag said;
    std::call_once(said, [] {
      std::fprintf(stderr,
                   "herring_jax: a reduction ran after herring_jax.shutdown() in this "
                   "process: its jitted step was still queued (jax dispatches "
                   "asynchronously) and nothing held its results, so shutdown() could not "
                   "wait for it. Keep the step's results, or call jax.block_until_ready on "
                   "them, before shutdown().\n");
    });
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "herring_jax is not initialized (or was shut down) in this process: "
                      "call herring_jax.initialize() before reducing");
  }
  call->where = "herring allreduce on rank " + std::to_string(call->comm->rank()) + ": ";
  const std::string& where = call->where;
  const int64_t kind = OpKind(attrs.op);
  const int64_t codec = OpCodec(attrs.op);
  if (kind < kOpSum || kind >= kOpBroadcast + call->comm->size()) {
    return ffi::Error::InvalidArgument(where + "op must be 0 (sum), 1 (mean), 2 (max), 3 "
                                       "(min) or 4 + a rank (broadcast from it)");
  }
  if (codec < 0 || codec > static_cast<int64_t>(engine::Codec::kInt8) ||
      (codec != 0 && kind > kOpMean)) {
    return ffi::Error::InvalidArgument(where + "op's codec bits must name a codec (0 none, "
                                       "1 bf16, 2 fp16, 3 int8), for a sum or mean only");
  }
  if (OpFeedback(attrs.op) && (codec == 0 || attrs.collective == kCollectiveAllGather ||
                               (attrs.op >> (kOpFeedbackShift + 1)) != 0)) {
    return ffi::Error::InvalidArgument(where + "error feedback (op bit 32) needs a codec and "
                                       "a sum or mean to contribute to");
  }
  if (attrs.collective < kCollectiveAllReduce || attrs.collective > kCollectiveAllGather ||
      (attrs.collective != kCollectiveAllReduce && kind >= kOpBroadcast)) {
    return ffi::Error::InvalidArgument(where + "collective must be 0 (all-reduce), 1 "
                                       "(reduce-scatter) or 2 (all-gather), which broadcasts "
                                       "never are");
  }
  for (size_t k = 0; k < args.size(); ++k) {
    auto in = args.get<ffi::AnyBuffer>(k);
    if (in.has_error()) return in.error();
    const EngineType type = FromXla(in->element_type());
    if (type.dtype == DType::kInvalid) {
      return ffi::Error::InvalidArgument(
          where + "unsupported element type for operand " + std::to_string(k) +
          "; supported: float16/32/64, bfloat16, complex64/128, (u)int8/16/32/64");
    }
    call->dtypes.push_back(type.dtype);
    call->counts.push_back(in->element_count() * type.per_element);
    call->arrival.in.push_back(in->untyped_data());
  }
  return ffi::Error::Success();
}

ffi::Error DecodeCall(ffi::RemainingArgs args, ffi::RemainingRets rets, const CallAttrs& attrs,
                      DecodedCall* call) {
  ffi::Error decoded = DecodeOperands(args, attrs, call);
  if (decoded.failure()) return decoded;
  const bool feedback = OpFeedback(attrs.op);
  if ((feedback ? 2 : 1) * args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        call->where + (feedback ? "with error feedback a call returns twice as many results "
                                  "as it takes operands (the reduced buffers, then the losses)"
                                : "operand and result counts differ"));
  }
  for (size_t k = 0; feedback && k < args.size(); ++k) {
    auto in = args.get<ffi::AnyBuffer>(k);
    auto lost = rets.get<ffi::AnyBuffer>(args.size() + k);
    if (in.has_error()) return in.error();
    if (lost.has_error()) return lost.error();
    if ((*lost)->element_type() != ffi::DataType::F32 ||
        in->element_type() != ffi::DataType::F32 ||
        (*lost)->element_count() != in->element_count()) {
      return ffi::Error::InvalidArgument(call->where + "loss result " + std::to_string(k) +
                                         " must be float32 of its float32 operand's size");
    }
    call->arrival.lost.push_back(static_cast<float*>((*lost)->untyped_data()));
  }
  for (size_t k = 0; k < args.size(); ++k) {
    auto in = args.get<ffi::AnyBuffer>(k);
    auto out = rets.get<ffi::AnyBuffer>(k);
    if (in.has_error()) return in.error();
    if (out.has_error()) return out.error();
    // A reduce-scatter's result is a block of its operand, an all-gather's
    // the blocks of every device (checked against the group in
    // scatter_gather.cc).
    if ((*out)->element_type() != in->element_type() ||
        (attrs.collective == kCollectiveAllReduce &&
         (*out)->element_count() != in->element_count())) {
      return ffi::Error::InvalidArgument(call->where + "result " + std::to_string(k) +
                                         " does not match its operand");
    }
    call->arrival.out.push_back((*out)->untyped_data());
    call->out_counts.push_back((*out)->element_count() * FromXla(in->element_type()).per_element);
  }
  return ffi::Error::Success();
}

ffi::Error PrepareBroadcast(DecodedCall& call, int64_t* op,
                            std::vector<engine::PooledBuffer>* zeros) {
  if (OpKind(*op) < kOpBroadcast) return ffi::Error::Success();
  const int64_t root = *op - kOpBroadcast;
  *op = kOpSum;
  if (call.comm->rank() == root) return ffi::Error::Success();
  for (size_t k = 0; k < call.dtypes.size(); ++k) {
    const size_t bytes = call.counts[k] * engine::ElementSize(call.dtypes[k]);
    zeros->emplace_back(&call.comm->pool(), bytes);
    if (!zeros->back().ok()) {
      return ffi::Error::Internal(call.where + "out of memory for a broadcast's zeros");
    }
    std::memset(zeros->back().data(), 0, bytes);
    call.arrival.in[k] = zeros->back().data();
  }
  return ffi::Error::Success();
}

ffi::Error ReduceCall(int64_t run_id, int32_t device, const InstructionState& instruction,
                      const CallAttrs& attrs, DecodedCall& call) {
  const std::string& where = call.where;
  CallPlace place;
  ffi::Error located = LocateCall(attrs, device, call, &place);
  if (located.failure()) return located;
  const int64_t stream = place.stream;
  const int position = place.position;
  const int local_count = place.local_count;
  const std::vector<int>& ranks = place.ranks;

  auto work = [&](const std::vector<engine::LocalArrival>& all) {
    if (attrs.collective != kCollectiveAllReduce) {
      return ScatterGatherAll(*call.comm, attrs, place, run_id, instruction.instance, call, all);
    }
    return ReduceAll(*call.comm, static_cast<ReduceOp>(OpKind(attrs.op)),
                     static_cast<engine::Codec>(OpCodec(attrs.op)),
                     static_cast<uint64_t>(attrs.key), run_id, static_cast<uint32_t>(attrs.slot),
                     instruction.instance, static_cast<uint32_t>(stream), ranks, call.dtypes,
                     call.counts, all);
  };
  engine::Status status;
  if (local_count == 1) {
    status = work({call.arrival});
  } else {
    // Matched by execution and instruction, never by arrival order: XLA may
    // start a device's independent calls in any order.
    engine::MeetingKey meeting{run_id, instruction.uid, GroupKey(stream, ranks)};
    status = Rendezvous().Arrive(meeting, position, local_count, call.arrival,
                                 call.comm->config().timeout_s + 10.0, work);
  }
  if (!status.ok()) return ffi::Error(ffi::ErrorCode::kInternal, where + status.message());
  return ffi::Error::Success();
}

namespace {

// What a reduction needs after the handler has returned.
struct AsyncCall {
  int64_t run_id = 0;
  int32_t device = 0;
  InstructionState instruction;
  OwnedAttrs attrs;
  DecodedCall call;
  std::vector<engine::PooledBuffer> zeros;  // a broadcast's contribution off the root
};

// Asynchronous: the handler decodes the call, hands the blocking part (the
// meeting of the local devices, the reduction across processes) to herring's
// own threads and returns a future at once, so XLA keeps computing (the rest
// of the backward pass) while the bytes move; whatever reads the result waits
// for the future. XLA keeps the operand and result buffers until then.
ffi::Future AllReduceImpl(ffi::RunId run_id, int32_t device, InstructionState* instruction,
                          ffi::RemainingArgs args, ffi::RemainingRets rets,
                          HERRING_ATTR_PARAMS) {
  ffi::Promise promise;
  ffi::Future future(promise);
  ffi::Error error = NoThrow("herring allreduce", [&]() -> ffi::Error {
    auto task = std::make_shared<AsyncCall>();
    task->device = device;
    ReceiveInstructionState(instruction);
    task->instruction = *instruction;
    task->attrs = OwnedAttrs(HERRING_ATTRS);
    ffi::Error decoded = DecodeCall(args, rets, task->attrs.View(), &task->call);
    if (decoded.failure()) return decoded;
    ffi::Error named =
        IdentityRun(run_id.run_id, device, *instruction, task->call.where, &task->run_id);
    if (named.failure()) return named;
    ffi::Error prepared = PrepareBroadcast(task->call, &task->attrs.op, &task->zeros);
    if (prepared.failure()) return prepared;
    engine::TimelineEvent event;
    event.key = key;
    event.slot = slot;
    event.device = device;
    for (size_t k = 0; k < task->call.counts.size(); ++k) {
      event.bytes += task->call.counts[k] * engine::ElementSize(task->call.dtypes[k]);
    }
    event.issued_ns = engine::Timeline::NowNs();
    engine::AsyncRunner::Get().Run([task, promise, event]() mutable {
      event.begun_ns = engine::Timeline::NowNs();
      ffi::Error done = NoThrow("herring allreduce", [&] {
        return ReduceCall(task->run_id, task->device, task->instruction, task->attrs.View(),
                          task->call);
      });
      event.ended_ns = engine::Timeline::NowNs();
      event.ok = !done.failure();
      engine::Timeline::Get().Record(event);
      // Drop the call (and its reference to the communicator) before XLA may
      // go on: once the future is set, the caller can return and call
      // herring_jax.shutdown(), which must hold the last reference so that
      // the communicator's destructor (waiting for slow readers of this
      // host's last results) runs in shutdown() and not here, behind it, in a
      // process that may already be exiting.
      task.reset();
      if (done.failure()) {
        promise.SetError(std::move(done));
      } else {
        promise.SetAvailable();
      }
    });
    return ffi::Error::Success();
  });
  if (error.failure()) promise.SetError(std::move(error));
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduce, AllReduceImpl,
    BindAllReduceAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()          // this execution, same on every device
                           .Ctx<ffi::DeviceOrdinal>()  // global id of the calling device
                           .Ctx<ffi::State<InstructionState>>()  // this instruction (instance)
                           .RemainingArgs()            // buffers to reduce
                           .RemainingRets()));         // reduced buffers, same types

}  // namespace herring
