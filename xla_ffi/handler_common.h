// The part of the allreduce handler shared by every platform: decoding the
// call and running the hierarchical reduction on host buffers. A platform's
// handler (CPU: handlers.cc, CUDA: cuda_handlers.cc) decodes, points the
// arrival at host memory (staging it if needed), and calls ReduceCall.
#ifndef HERRING_HANDLER_COMMON_H_
#define HERRING_HANDLER_COMMON_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/communicator.h"
#include "engine/local_rendezvous.h"
#include "xla/ffi/api/ffi.h"

#if defined(__SANITIZE_THREAD__)
#define HERRING_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define HERRING_TSAN 1
#endif
#endif
#ifdef HERRING_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace herring {

namespace ffi = xla::ffi;

// The custom call's attributes (see BindAllReduceAttrs). They are the same
// on every process: XLA's run id derives from the executable's fingerprint,
// which covers them, and must agree across processes (see call_identity.cc).
struct CallAttrs {
  int64_t comm;
  int64_t op;
  int64_t key;
  int64_t slot;
  ffi::Span<const int64_t> device_procs;
  ffi::Span<const int64_t> device_locals;
  ffi::Span<const int64_t> device_groups;
  ffi::Span<const int64_t> group_streams;
  ffi::Span<const int64_t> group_ranks;
  ffi::Span<const int64_t> group_offsets;
  int64_t collective;
  ffi::Span<const int64_t> device_blocks;
};

// Per-instruction state from XLA's instantiate stage (call_identity.cc).
// XLA:CPU instantiates every custom-call instruction once, when it compiles
// the executable, in the order of its thunk sequence, and all local devices
// share the state: two inlined copies of one call site get two states.
struct LaunchBases;  // call_identity.cc
struct InstructionState {
  static ffi::TypeId id;
  InstructionState() = default;
  InstructionState(const InstructionState&) = default;
  InstructionState& operator=(const InstructionState&) = default;
  ~InstructionState();  // below: tells ThreadSanitizer of the hand-off first
  uint64_t uid = 0;       // unique in this process: names the local meeting
  uint32_t instance = 0;  // its number among instructions with equal attributes
  uint64_t attrs_hash = 0;  // of its attributes: the same on every process
  // Launch identity (see IdentityRun): the first run id each local device ran
  // this instruction in; null under the program identity. Shared by copies.
  std::shared_ptr<LaunchBases> launches;
};
// XLA hands the state from its instantiate stage (often a compile thread) to
// the execute stage (another thread) through its own synchronisation, which
// ThreadSanitizer cannot see: jaxlib is not instrumented. In a TSan build
// (.ci/sanitizers.sh) these tell it about that hand-off, and nothing else;
// otherwise they are empty.
inline void PublishInstructionState(InstructionState* state) {
#ifdef HERRING_TSAN
  __tsan_release(state);
#else
  (void)state;
#endif
}
inline void ReceiveInstructionState(InstructionState* state) {
#ifdef HERRING_TSAN
  __tsan_acquire(state);
#else
  (void)state;
#endif
}
// XLA destroys the state on yet another thread (the executable's owner),
// again through synchronisation TSan cannot see; `launches` is the member
// whose destruction reads what the instantiate stage wrote.
inline InstructionState::~InstructionState() { ReceiveInstructionState(this); }

// The same for XLA's CUDA platform, whose plugin numbers types on its own.
struct CudaInstructionState : InstructionState {
  static ffi::TypeId id;
};

// The run part of a reduction's identity (engine::Identity::run_id) for a
// call of `instruction` that XLA runs in `run_id` on `device`: XLA's run id
// itself under the program identity; under the launch identity a value made
// of the instruction (its attribute hash and instance) and how many launches
// of it came before on this device (see call_identity.cc). Call it where the
// handler is entered, in launch order, never on herring's threads.
ffi::Error IdentityRun(int64_t run_id, int32_t device, const InstructionState& instruction,
                       const std::string& where, int64_t* out);

// Where the calling device stands in the call: its group (stream and
// processes) and its place among the local devices of that group.
struct CallPlace {
  uint32_t stream = 0;
  std::vector<int> ranks;
  int position = 0;
  int local_count = 0;
  int64_t group = 0;  // its index in the attributes' groups
};

// device_procs: each process's own device; device_locals: whichever device
// runs this (a single-device computation lowered before its device is known).
constexpr int64_t kEveryProcess = -1;
constexpr int64_t kAnyDevice = -1;

// The attributes copied out of XLA's call frame: its spans are only
// guaranteed while the handler runs, and an asynchronous reduction runs on
// after it has returned.
struct OwnedAttrs {
  int64_t comm = 0, op = 0, key = 0, slot = 0;
  std::vector<int64_t> device_procs, device_locals, device_groups, group_streams, group_ranks,
      group_offsets;
  int64_t collective = 0;
  std::vector<int64_t> device_blocks;

  OwnedAttrs() = default;
  explicit OwnedAttrs(const CallAttrs& a)
      : comm(a.comm), op(a.op), key(a.key), slot(a.slot),
        device_procs(a.device_procs.begin(), a.device_procs.end()),
        device_locals(a.device_locals.begin(), a.device_locals.end()),
        device_groups(a.device_groups.begin(), a.device_groups.end()),
        group_streams(a.group_streams.begin(), a.group_streams.end()),
        group_ranks(a.group_ranks.begin(), a.group_ranks.end()),
        group_offsets(a.group_offsets.begin(), a.group_offsets.end()),
        collective(a.collective),
        device_blocks(a.device_blocks.begin(), a.device_blocks.end()) {}

  CallAttrs View() const {
    return CallAttrs{comm,          op,            key,           slot,
                     device_procs,  device_locals, device_groups, group_streams,
                     group_ranks,   group_offsets, collective,    device_blocks};
  }
};

struct DecodedCall {
  std::shared_ptr<engine::Communicator> comm;
  const char* platform = "cpu";    // whose local device table names devices
  std::string where;               // "herring allreduce on rank R: "
  engine::LocalArrival arrival;    // XLA's buffer pointers, one per operand
  std::vector<engine::DType> dtypes;
  std::vector<size_t> counts;      // engine elements of each operand
  std::vector<size_t> out_counts;  // and of each result (a reduce-scatter's are
                                   // its blocks, an all-gather's whole buffers)
};

// Adds the attributes every allreduce handler takes, in CallAttrs order, to
// a binding that already has its context, operands and results.
template <typename Binding>
auto BindAllReduceAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("comm")                   // communicator handle (registry)
      .template Attr<int64_t>("op")                     // kOp* below, and the codec
      .template Attr<int64_t>("key")                    // description hash, checked on the wire
      .template Attr<int64_t>("slot")                   // call site in the module
      .template Attr<ffi::Span<const int64_t>>("device_procs")   // each device's process
      .template Attr<ffi::Span<const int64_t>>("device_locals")  // its local index there
      .template Attr<ffi::Span<const int64_t>>("device_groups")  // the group it reduces in
      .template Attr<ffi::Span<const int64_t>>("group_streams")  // each group's stream
      .template Attr<ffi::Span<const int64_t>>("group_ranks")    // processes of each group,
      .template Attr<ffi::Span<const int64_t>>("group_offsets")  // concatenated; offsets
      .template Attr<int64_t>("collective")                      // kCollective* below
      .template Attr<ffi::Span<const int64_t>>("device_blocks");  // each device's block
}

// The handlers' attribute parameters, in CallAttrs order, and their CallAttrs.
#define HERRING_ATTR_PARAMS                                                                \
  int64_t comm_handle, int64_t op, int64_t key, int64_t slot,                              \
      ffi::Span<const int64_t> device_procs, ffi::Span<const int64_t> device_locals,       \
      ffi::Span<const int64_t> device_groups, ffi::Span<const int64_t> group_streams,      \
      ffi::Span<const int64_t> group_ranks, ffi::Span<const int64_t> group_offsets,        \
      int64_t collective, ffi::Span<const int64_t> device_blocks
#define HERRING_ATTRS                                                                      \
  CallAttrs {                                                                              \
    comm_handle, op, key, slot, device_procs, device_locals, device_groups, group_streams, \
        group_ranks, group_offsets, collective, device_blocks                              \
  }

// The instantiate stage: numbers the instruction (call_identity.cc).
template <typename State>
ffi::ErrorOr<std::unique_ptr<State>> InstantiateCall(const CallAttrs& attrs);

// Finds the calling device (`device`: XLA's DeviceOrdinal) among the call's
// participants and its group; `call.where` prefixes errors.
ffi::Error LocateCall(const CallAttrs& attrs, int32_t device, const DecodedCall& call,
                      CallPlace* place);

// Runs a handler body so that no C++ exception crosses into XLA: anything
// thrown becomes an ffi::Error that says where it came from.
template <typename Body>
ffi::Error NoThrow(const char* what, Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(what) + ": " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(what) + ": unknown C++ exception");
  }
}

// op attribute values: a sum, a mean, a maximum, a minimum, or
// (kOpBroadcast + r) a broadcast from rank r, which is a sum to which every
// other rank contributes zeros; so that the compiled program (and so XLA's
// run id) is the same on every process, the root travels in the attribute
// and the zeros are made here.
constexpr int64_t kOpSum = 0;
constexpr int64_t kOpMean = 1;
constexpr int64_t kOpMax = 2;
constexpr int64_t kOpMin = 3;
constexpr int64_t kOpBroadcast = 4;

// collective attribute values. A reduce-scatter gives each device one block
// of the result, an all-gather each device every device's block; which block
// is each device's is in device_blocks (its index in its group, as lax's
// axis_index; kEveryProcess's entry: the process's place in the group).
// Block g of a buffer of n elements is [g * B, min((g + 1) * B, n)), B the
// reduce-scatter's result (the all-gather's operand) count.
constexpr int64_t kCollectiveAllReduce = 0;
constexpr int64_t kCollectiveReduceScatter = 1;
constexpr int64_t kCollectiveAllGather = 2;
// Bits 24..31 of the op attribute carry the wire codec of a sum or mean
// (engine/codec.h; 0: none), so that it is part of the attributes every
// process compiles alike; bits 0..23 are the operation above.
// Bit 32 asks for error feedback: the call returns, after the reduced
// buffers, one float32 buffer per operand (its shape) with what this device's
// contribution lost in encoding (engine::ReduceRequest::lost; the first local
// device of a process keeps the loss of their sum, the others zeros).
constexpr int kOpCodecShift = 24;
constexpr int kOpFeedbackShift = 32;
inline int64_t OpKind(int64_t op) { return op & ((int64_t{1} << kOpCodecShift) - 1); }
inline int64_t OpCodec(int64_t op) { return (op >> kOpCodecShift) & 0xff; }
inline bool OpFeedback(int64_t op) { return (op >> kOpFeedbackShift) & 1; }

// For a broadcast (op >= kOpBroadcast): off the root, points `call`'s inputs
// at zeroed buffers kept in `zeros`; returns the engine's op (a sum) in *op.
ffi::Error PrepareBroadcast(DecodedCall& call, int64_t* op,
                            std::vector<engine::PooledBuffer>* zeros);

// What a reduction task holds of its communicator, let go of before the task
// tells XLA it is done (the zeros come from the communicator's pool, so they
// go first). From then on the program may call herring_jax.shutdown(), which
// must drop the last reference: the communicator's destructor (it waits for
// the host's slow readers) then runs there, not on herring's thread behind
// the program's back while the process exits.
inline void ReleaseCall(DecodedCall* call, std::vector<engine::PooledBuffer>* zeros) {
  zeros->clear();
  call->comm.reset();
}

// Finds the communicator and checks and collects the buffers.
ffi::Error DecodeCall(ffi::RemainingArgs args, ffi::RemainingRets rets, const CallAttrs& attrs,
                      DecodedCall* call);
// The same for the operands alone, for a call whose results are not the
// reduced buffers (XLA:CUDA's start returns a token); `call.arrival.out` stays
// empty.
ffi::Error DecodeOperands(ffi::RemainingArgs args, const CallAttrs& attrs, DecodedCall* call);

// Reduces `call.arrival` (host memory) with the other local devices of the
// same group and across processes; the result lands in `call.arrival.out`.
// `run_id` is the run part of the identity (IdentityRun) and `instruction` the custom call's
// instantiate-stage state: with the slot they name the reduction on every
// process, and (run id, instruction uid) the meeting of the local devices
// (see engine/local_rendezvous.h).
ffi::Error ReduceCall(int64_t run_id, int32_t device, const InstructionState& instruction,
                      const CallAttrs& attrs, DecodedCall& call);

// G, the blocks of a reduce-scatter's operand (an all-gather's result) in
// `place`'s group: one per device of the group (scatter_gather.cc). A start
// that returns a token (XLA:CUDA's) sizes the results' staging by it: a
// reduce-scatter's result is its operand / G, an all-gather's its operand x G.
size_t GroupBlocks(const CallAttrs& attrs, const CallPlace& place);

// A reduce-scatter or all-gather of the local devices' arrivals (`all`, in
// local position order) across the processes of `place`'s group
// (scatter_gather.cc); the ReduceAll of those collectives.
engine::Status ScatterGatherAll(engine::Communicator& comm, const CallAttrs& attrs,
                                const CallPlace& place, int64_t run_id, uint32_t instance,
                                const DecodedCall& call,
                                const std::vector<engine::LocalArrival>& all);

}  // namespace herring

#endif  // HERRING_HANDLER_COMMON_H_
