// What names an allreduce call the same way on every process, besides XLA's
// run id: which instruction it is (numbered at XLA's instantiate stage) and
// where the calling device stands among the call's participants (decoded from
// attributes that are the same on every process).
//
// Why the attributes must be the same everywhere. XLA's RunId is jax's launch
// id: a base derived from the executable's fingerprint plus that executable's
// launch count. The fingerprint covers the custom call's attributes, so a
// process-local value among them (a device id, a counter of lowerings) gives
// each process its own run ids and no reduction would ever match. Measured
// with jax 0.10.2 on two processes: equal attributes gave equal run ids (k-th
// launch, also with other executables run in between on one process); a
// single attribute that differed gave unrelated ones.
//
// Why instances. A jitted helper called twice inside another jitted function
// is lowered once, so both calls carry the same attributes (slot included),
// and XLA inlines them into two custom calls that may run concurrently.
// XLA:CPU instantiates each custom-call instruction once, when it compiles the
// executable, in the order of its thunk sequence (measured: 2 and 6 inlined
// copies got 2 and 6 states, numbered in program order in every one of several
// runs and on both processes; the local devices of a process share the
// state). Numbering instructions with equal attributes in instantiate order
// therefore tells the copies apart the same way on every process. The count
// is per process, not per executable (the instantiate stage does not say which
// executable it builds): processes must compile their reducing executables in
// the same order, as they run them.
//
// Two identities: program and launch. The program identity takes XLA's run id
// as it is, so that a reduction's run names its executable and launch: a rank
// that launches a program once more than its peers (a `cond` skipped the
// reduction) fails every rank naming both runs. That needs every process to
// compile the same program into the same executable. XLA:CUDA does not
// (measured on an H200, jax 0.11.2: two processes' executables of one jitted
// Flax step differed in eleven kernel choices, a dot's tile sizes and Triton
// fusions' `is_tma_allowed`, so their fingerprints and run ids differed and
// no reduction ever matched). The launch identity therefore replaces the
// executable by the instruction (its attribute hash and instance, the same on
// every process) and the launch by how many launches of that instruction
// came before on the device: XLA's launch ids of one executable are
// consecutive (jax: a fingerprint-derived base plus the executable's launch
// counter), so the run id minus the first one the instruction ran in counts
// them, whatever the base. What it gives up, and assumes:
// - a rank whose first launches of a program skipped a reduction pairs its
//   first one with its peers' first instead of failing;
// - the count starts at the first launch that reaches the instruction, so a
//   program's launches must reach it in order until then (the handlers count
//   on the launching thread). A later launch counted first is found when the
//   earlier one arrives, as are local devices whose first launches differ:
//   that call and every later one of the instruction fail (IdentityRun),
//   never a count one off;
// - nothing but instantiate order tells apart instructions with equal
//   attributes (the inlined copies of one jitted helper, equal-shaped
//   reductions of two programs): where each process compiles its own
//   executable, that order must still agree (to be confirmed on XLA:CUDA).
// The default is the program identity on XLA:CPU and the launch identity on
// XLA:CUDA; HERRING_IDENTITY chooses (runtime.py), the same on every rank.
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "engine/wire.h"
#include "handler_common.h"
#include "handlers.h"

namespace herring {

// The first run id each local device ran an instruction in (launch identity),
// and why it may no longer be counted (empty: it may).
struct LaunchBases {
  std::mutex mu;
  std::vector<std::pair<int32_t, int64_t>> first;  // (device, run id)
  std::string broken;
};

ffi::TypeId InstructionState::id = {};
ffi::TypeId CudaInstructionState::id = {};

namespace {

const ffi::TypeInfo kStateInfo = ffi::MakeTypeInfo<InstructionState>();
const ffi::TypeInfo kCudaStateInfo = ffi::MakeTypeInfo<CudaInstructionState>();

// Numbers of the devices of this process, per platform, in jax's local order
// (set by initialize(): global ids on XLA:CPU, local ordinals on XLA:CUDA).
struct LocalDevices {
  std::mutex mu;
  std::map<std::string, std::vector<int64_t>> numbers;
};
LocalDevices& Devices() {
  static auto* devices = new LocalDevices();  // never destroyed: handlers may run late
  return *devices;
}

struct Instances {
  std::mutex mu;
  uint64_t next_uid = 1;
  std::map<uint64_t, uint32_t> count;  // attribute hash -> instructions seen
};
Instances& InstanceTable() {
  static auto* table = new Instances();
  return *table;
}

constexpr const char* kLaunchOrderAdvice =
    "let a program's first launch reach its reductions before the next launch does (wait "
    "for its result, or dispatch from one thread), or use HERRING_IDENTITY=program where "
    "every process compiles the same executable";

// Whether instructions instantiated from now on take the launch identity:
// [0] XLA:CPU, [1] XLA:CUDA (set by initialize(), see SetLaunchIdentity).
std::atomic<bool> g_launch_identity[2] = {false, true};

uint64_t HashAttrs(const CallAttrs& a) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a over the values
  auto add = [&](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  auto add_span = [&](ffi::Span<const int64_t> s) {
    add(static_cast<int64_t>(s.size()));
    for (int64_t v : s) add(v);
  };
  add(a.comm);
  add(a.op);
  add(a.key);
  add(a.slot);
  add_span(a.device_procs);
  add_span(a.device_locals);
  add_span(a.device_groups);
  add_span(a.group_streams);
  add_span(a.group_ranks);
  add_span(a.group_offsets);
  add(a.collective);
  add_span(a.device_blocks);
  return h;
}

template <typename State>
ffi::ErrorOr<std::unique_ptr<State>> InstantiateImpl(HERRING_ATTR_PARAMS) {
  return InstantiateCall<State>(HERRING_ATTRS);
}

}  // namespace

template <typename State>
ffi::ErrorOr<std::unique_ptr<State>> InstantiateCall(const CallAttrs& attrs) {
  auto state = std::make_unique<State>();
  Instances& table = InstanceTable();
  std::lock_guard<std::mutex> lock(table.mu);
  state->uid = table.next_uid++;
  state->attrs_hash = HashAttrs(attrs);
  state->instance = table.count[state->attrs_hash]++;
  if (g_launch_identity[std::is_same_v<State, CudaInstructionState> ? 1 : 0].load()) {
    state->launches = std::make_shared<LaunchBases>();
  }
  PublishInstructionState(state.get());
  return state;
}
template ffi::ErrorOr<std::unique_ptr<InstructionState>> InstantiateCall(const CallAttrs&);
template ffi::ErrorOr<std::unique_ptr<CudaInstructionState>> InstantiateCall(const CallAttrs&);

ffi::Error LocateCall(const CallAttrs& attrs, int32_t device, const DecodedCall& call,
                      CallPlace* place) {
  const std::string& where = call.where;
  const size_t n = attrs.device_procs.size();
  const size_t groups = attrs.group_streams.size();
  if (n == 0 || attrs.device_locals.size() != n || attrs.device_groups.size() != n ||
      attrs.group_offsets.size() != groups + 1 || attrs.group_offsets[0] != 0 ||
      attrs.group_offsets[groups] != static_cast<int64_t>(attrs.group_ranks.size())) {
    return ffi::Error::InvalidArgument(where + "malformed group attributes");
  }
  for (size_t g = 0; g < groups; ++g) {
    if (attrs.group_offsets[g] > attrs.group_offsets[g + 1] || attrs.group_streams[g] < 0) {
      return ffi::Error::InvalidArgument(where + "malformed group attributes");
    }
  }
  const int me = call.comm->rank();
  int64_t local = -1;  // the calling device's index among this process's devices
  {
    LocalDevices& devices = Devices();
    std::lock_guard<std::mutex> lock(devices.mu);
    auto it = devices.numbers.find(call.platform);
    for (size_t i = 0; it != devices.numbers.end() && i < it->second.size(); ++i) {
      if (it->second[i] == device) local = static_cast<int64_t>(i);
    }
  }
  auto mine = [&](size_t j) {
    return attrs.device_procs[j] == kEveryProcess || attrs.device_procs[j] == me;
  };
  // A single-device computation may be lowered before its device is known:
  // Python then passes kAnyDevice, "whichever device runs this".
  int index = n == 1 && mine(0) && attrs.device_locals[0] == kAnyDevice ? 0 : -1;
  for (size_t j = 0; index < 0 && j < n; ++j) {
    if (mine(j) && local >= 0 && attrs.device_locals[j] == local) index = static_cast<int>(j);
  }
  if (index < 0) {
    return ffi::Error::InvalidArgument(
        where + "device " + std::to_string(device) + " (local index " + std::to_string(local) +
        ") is not among the participants of this call");
  }
  const int64_t group = attrs.device_groups[index];
  if (group < 0 || group >= static_cast<int64_t>(groups)) {
    return ffi::Error::InvalidArgument(where + "group out of range");
  }
  place->group = group;
  place->stream = static_cast<uint32_t>(attrs.group_streams[group]);
  place->ranks.clear();
  for (int64_t k = attrs.group_offsets[group]; k < attrs.group_offsets[group + 1]; ++k) {
    const int64_t rank = attrs.group_ranks[k];
    place->ranks.push_back(rank == kEveryProcess ? me : static_cast<int>(rank));
  }
  // Its place among the devices of this process in the same group: the order
  // of the local sum.
  place->position = 0;
  place->local_count = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!mine(j) || attrs.device_groups[j] != group) continue;
    if (static_cast<int>(j) < index) ++place->position;
    ++place->local_count;
  }
  return ffi::Error::Success();
}

ffi::Error IdentityRun(int64_t run_id, int32_t device, const InstructionState& instruction,
                       const std::string& where, int64_t* out) {
  if (!instruction.launches) {
    *out = run_id;
    return ffi::Error::Success();
  }
  LaunchBases& bases = *instruction.launches;
  int64_t first = run_id;
  {
    std::lock_guard<std::mutex> lock(bases.mu);
    if (!bases.broken.empty()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + bases.broken);
    }
    bool known = false;
    for (const auto& [d, run] : bases.first) {
      if (d == device) first = run, known = true;
    }
    if (!known) {
      // Every local device runs the same launches: their first ones agree,
      // or one device's count would run behind the others' for good.
      for (const auto& [d, run] : bases.first) {
        if (run != run_id) {
          bases.broken = "the launch identity (HERRING_IDENTITY=launch) saw device " +
                         std::to_string(device) + " reach this reduction first in run " +
                         std::to_string(run_id) + " and device " + std::to_string(d) +
                         " in run " + std::to_string(run) + ", so their launch counts " +
                         "disagree and no reduction of it can be named safely any more; " +
                         kLaunchOrderAdvice;
          return ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + bases.broken);
        }
      }
      bases.first.emplace_back(device, run_id);
    }
    // XLA's launch ids are 32-bit and wrap: count in 32 bits.
    const int32_t launch =
        static_cast<int32_t>(static_cast<uint32_t>(run_id) - static_cast<uint32_t>(first));
    if (launch < 0) {
      // An earlier launch arrived after a later one counted as the first:
      // every count since is one off. Nothing of this instruction may pair
      // any more (the job fails with this error, never with a wrong sum
      // from here on).
      bases.broken = "a launch of this program reached this reduction before an earlier "
                     "launch did (run " + std::to_string(run_id) + " after run " +
                     std::to_string(first) + "), so the launch identity "
                     "(HERRING_IDENTITY=launch) counted from the wrong launch and can name "
                     "no reduction of it safely any more; " + kLaunchOrderAdvice;
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, where + bases.broken);
    }
    const uint64_t instance = engine::Mix64(uint64_t{instruction.instance} + 1);
    const uint64_t instruction_id = engine::Mix64(instruction.attrs_hash ^ instance);
    *out = engine::LaunchRun(instruction_id, static_cast<uint32_t>(launch));
  }
  return ffi::Error::Success();
}

std::vector<std::string> CountLaunchesForTest(
    const std::vector<std::pair<int64_t, int32_t>>& calls) {
  InstructionState state;
  state.attrs_hash = 12345;
  state.launches = std::make_shared<LaunchBases>();
  std::vector<std::string> out;
  for (const auto& [run, device] : calls) {
    int64_t named = 0;
    ffi::Error error = IdentityRun(run, device, state, "", &named);
    out.push_back(error.failure() ? "error: " + error.message()
                                  : std::to_string(engine::LaunchOf(named)));
  }
  return out;
}

void SetLaunchIdentity(const std::string& platform, bool launch) {
  g_launch_identity[platform == "cuda" ? 1 : 0].store(launch);
}

void SetLocalDevices(const std::string& platform, std::vector<int64_t> numbers) {
  LocalDevices& devices = Devices();
  std::lock_guard<std::mutex> lock(devices.mu);
  devices.numbers[platform] = std::move(numbers);
}

XLA_FFI_TypeId* InstructionStateTypeId(bool cuda) {
  return cuda ? &CudaInstructionState::id : &InstructionState::id;
}

const XLA_FFI_TypeInfo* InstructionStateTypeInfo(bool cuda) {
  return cuda ? &kCudaStateInfo : &kStateInfo;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduceInstantiate, InstantiateImpl<InstructionState>,
    BindAllReduceAttrs(ffi::Ffi::BindInstantiate()));  // the execute stage's attributes

#ifdef HERRING_WITH_CUDA
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAllReduceInstantiateCuda, InstantiateImpl<CudaInstructionState>,
    BindAllReduceAttrs(ffi::Ffi::BindInstantiate()));  // the execute stage's attributes
#endif

}  // namespace herring
