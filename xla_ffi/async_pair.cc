// herring_async_start / herring_async_done (XLA:CPU): a reduction that starts
// in one execution of a jitted step and ends in a later one (Streaming
// DiLoCo's overlapped fragments, herring_jax/_src/transforms/streaming.py).
//
// Every other reduction starts and ends inside one XLA execution, its buffers
// XLA's. Here the start copies its operands into memory of the engine's pool,
// hands the reduction to herring's threads and returns at once; the done, in
// a later execution, waits for it (within HERRING_TIMEOUT_S) and copies the
// result out.
//
// Across processes the start is named by its attributes' slot and instance,
// as every reduction (call_identity.cc), and by a runtime `ticket` (int32
// scalar: the step count of the start) in place of XLA's run id: the start
// and the done run in different executions, and two executions of one step
// have different run ids. The ticket is the same on every process where the
// program is (the step count is).
//
// In this process the done finds its start by the token the start returns
// (the caller keeps it, in the optimizer state, and hands it to the done): an
// id this start alone has, so that two optimizers reducing buffers of equal
// shapes at equal step counts, or a second training run in the same process,
// never take each other's results. The id's high half is drawn at random
// once per process, so a token restored from a checkpoint of an earlier
// process names nothing here (the done says so) rather than a reduction of
// this process. The done also checks that its ticket is its start's.
//
// herring_async_known tells whether a token names a start of this process
// that no done has collected yet: a token restored from a checkpoint of an
// earlier process does not, and local_sgd then starts the reduction again
// from the state's copy of what was sent (streaming.py).
//
// A process that shuts down with a start still in flight waits for it first
// (DrainAsync, from herring_jax.shutdown), so that its peers' matching
// reduction ends normally; then the unclaimed results are dropped.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/async_runner.h"
#include "engine/buffer_pool.h"
#include "engine/communicator.h"
#include "engine/registry.h"
#include "handler_common.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace herring {
namespace {

// Run ids of async reductions: the ticket with bit 62 set, apart from the
// launch ids XLA gives executions (32-bit values in every error seen here,
// e.g. -723189425).
constexpr int64_t kTicketRunBit = int64_t{1} << 62;

struct Started {
  int64_t key = 0;  // the call's description hash, which the done's must equal
  std::vector<size_t> bytes;
  std::vector<engine::PooledBuffer> in, out;  // the engine's copies
  // Error feedback (handler_common.h's OpFeedback): per operand, what this
  // process's encoding lost, which the done returns after the results.
  std::vector<engine::PooledBuffer> lost;
  int64_t ticket = 0;

  std::mutex mu;
  std::condition_variable cv;
  bool finished = false;
  ffi::Error error;
};

struct PairKey {
  int64_t comm;
  uint64_t token;
  bool operator<(const PairKey& o) const {
    return std::tie(comm, token) < std::tie(o.comm, o.token);
  }
};

// A start's id: a random high half per process, a count below it (never 0:
// a token of zeros is what an optimizer state holds before any start).
uint64_t NextToken() {
  static const uint64_t epoch = [] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) | 0x80000000ull;
  }();
  static std::atomic<uint32_t> count{0};
  return epoch ^ (static_cast<uint64_t>(++count) & 0x7fffffffull);
}

struct PairTable {
  std::mutex mu;
  std::condition_variable cv;              // a start finished
  std::map<PairKey, std::shared_ptr<Started>> started;
  std::map<int64_t, size_t> running;       // per communicator: starts not yet finished
};

PairTable& Table() {
  static auto* table = new PairTable();  // never destroyed: handlers may run late
  return *table;
}

ffi::Error ReadTicket(ffi::Buffer<ffi::S32> ticket, const std::string& where, int64_t* out) {
  if (ticket.element_count() != 1) {
    return ffi::Error::InvalidArgument(where + "the ticket must be one int32");
  }
  *out = ticket.typed_data()[0];
  return ffi::Error::Success();
}

std::string TicketText(int64_t ticket) { return "ticket " + std::to_string(ticket); }

ffi::Error AsyncStartImpl(int32_t device, InstructionState* instruction,
                     ffi::Buffer<ffi::S32> ticket_buffer, ffi::RemainingArgs args,
                     ffi::Result<ffi::AnyBuffer> token, HERRING_ATTR_PARAMS) {
  return NoThrow("herring async start", [&]() -> ffi::Error {
    ReceiveInstructionState(instruction);
    auto task = std::make_shared<Started>();
    auto attrs = std::make_shared<OwnedAttrs>(HERRING_ATTRS);
    auto call = std::make_shared<DecodedCall>();
    ffi::Error decoded = DecodeOperands(args, attrs->View(), call.get());
    if (decoded.failure()) return decoded;
    call->where = "herring async reduction on rank " + std::to_string(call->comm->rank()) + ": ";
    if (OpKind(op) > kOpMean || collective != kCollectiveAllReduce) {
      return ffi::Error::InvalidArgument(call->where + "an async reduction is a sum or a mean");
    }
    ffi::Error read = ReadTicket(ticket_buffer, call->where, &task->ticket);
    if (read.failure()) return read;
    const bool feedback = OpFeedback(op);
    for (size_t k = 0; k < call->dtypes.size(); ++k) {
      const size_t bytes = call->counts[k] * engine::ElementSize(call->dtypes[k]);
      if (feedback && call->dtypes[k] != engine::DType::kFloat32) {
        return ffi::Error::InvalidArgument(call->where + "error feedback takes float32 "
                                           "operands only");
      }
      task->bytes.push_back(bytes);
      task->in.emplace_back(&call->comm->pool(), bytes);
      task->out.emplace_back(&call->comm->pool(), bytes);
      if (feedback) {
        task->lost.emplace_back(&call->comm->pool(), std::max<size_t>(1, bytes));
        if (!task->lost.back().ok()) {
          return ffi::Error::Internal(call->where + "out of memory for an async reduction's "
                                      "losses");
        }
        call->arrival.lost.push_back(reinterpret_cast<float*>(task->lost.back().data()));
      }
      if (!task->in.back().ok() || !task->out.back().ok()) {
        return ffi::Error::Internal(call->where + "out of memory for an async reduction's "
                                    "copy of its operands");
      }
      // XLA may reuse the operand's buffer once this call returns.
      std::memcpy(task->in.back().data(), call->arrival.in[k], bytes);
      call->arrival.in[k] = task->in.back().data();
      call->arrival.out.push_back(task->out.back().data());
    }
    if (token->size_bytes() != sizeof(uint64_t)) {
      return ffi::Error::InvalidArgument(call->where + "the token must be 8 bytes");
    }
    task->key = key;
    const uint64_t id = NextToken();
    std::memcpy(token->untyped_data(), &id, sizeof(id));
    PairTable& table = Table();
    {
      std::lock_guard<std::mutex> lock(table.mu);
      table.started.emplace(PairKey{comm_handle, id}, task);
      ++table.running[comm_handle];
    }
    // The ticket names the reduction on every process: no launch counting.
    const InstructionState state = *instruction;
    const int64_t run_id = kTicketRunBit | (task->ticket & (kTicketRunBit - 1));
    const int64_t handle = comm_handle;
    engine::AsyncRunner::Get().Run([task, attrs, call, state, run_id, device, handle]() mutable {
      ffi::Error done = NoThrow("herring async reduction", [&] {
        return ReduceCall(run_id, device, state, attrs->View(), *call);
      });
      // Let go of the communicator before anyone is told: shutdown() must
      // hold its last reference (see handlers.cc).
      call.reset();
      {
        std::lock_guard<std::mutex> lock(task->mu);
        task->error = std::move(done);
        task->finished = true;
      }
      task->cv.notify_all();
      PairTable& table = Table();
      {
        std::lock_guard<std::mutex> lock(table.mu);
        if (--table.running[handle] == 0) table.running.erase(handle);
      }
      table.cv.notify_all();
    });
    return ffi::Error::Success();
  });
}

ffi::Error AsyncDoneImpl(ffi::Buffer<ffi::S32> ticket_buffer, ffi::AnyBuffer token,
                    ffi::RemainingRets rets, int64_t comm_handle, int64_t key) {
  return NoThrow("herring async done", [&]() -> ffi::Error {
    auto comm = engine::Registry::Get().Find(comm_handle);
    if (!comm) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                        "herring_jax is not initialized (or was shut down) in this process: "
                        "call herring_jax.initialize() before reducing");
    }
    const std::string where =
        "herring async reduction on rank " + std::to_string(comm->rank()) + ": ";
    const double timeout_s = comm->config().timeout_s;
    comm.reset();
    int64_t ticket = 0;
    ffi::Error read = ReadTicket(ticket_buffer, where, &ticket);
    if (read.failure()) return read;
    if (token.size_bytes() != sizeof(uint64_t)) {
      return ffi::Error::InvalidArgument(where + "the token must be 8 bytes");
    }
    uint64_t id = 0;
    std::memcpy(&id, token.untyped_data(), sizeof(id));
    std::shared_ptr<Started> task;
    {
      PairTable& table = Table();
      std::lock_guard<std::mutex> lock(table.mu);
      auto it = table.started.find(PairKey{comm_handle, id});
      if (it != table.started.end() && it->second->key == key &&
          it->second->ticket == ticket) {
        task = std::move(it->second);
        table.started.erase(it);
      } else if (it != table.started.end()) {
        return ffi::Error::InvalidArgument(
            where + "the token handed to this done belongs to a reduction of other buffers "
            "or another ticket (" + TicketText(it->second->ticket) + ", this done's " +
            TicketText(ticket) + "): pass each done the token of its own start");
      }
    }
    if (!task) {
      return ffi::Error(
          ffi::ErrorCode::kFailedPrecondition,
          where + "no reduction was started with " + TicketText(ticket) + " and this token "
          "in this process, or its result was collected already, so there is nothing to "
          "finish. Its start ran in an earlier life of the process (a state restored from a "
          "checkpoint saved while a reduction was in flight), or never ran. Save checkpoints "
          "where no reduction is in flight, or start the reduction again.");
    }
    {
      std::unique_lock<std::mutex> lock(task->mu);
      // The reduction fails by itself at HERRING_TIMEOUT_S with the engine's
      // error, which says whom it waited for; this bound is only a backstop.
      if (!task->cv.wait_for(lock, std::chrono::duration<double>(timeout_s + 30.0),
                             [&] { return task->finished; })) {
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                          where + "the reduction started with " + TicketText(ticket) +
                              " has not ended after HERRING_TIMEOUT_S (" +
                              std::to_string(timeout_s) + " s) and 30 s more");
      }
      if (task->error.failure()) return task->error;
    }
    const size_t num = task->bytes.size();
    const size_t want = task->lost.empty() ? num : 2 * num;
    if (rets.size() != want) {
      return ffi::Error::InvalidArgument(where + "the done has " + std::to_string(rets.size()) +
                                         " results but its start reduced " +
                                         std::to_string(num) + " buffers" +
                                         (task->lost.empty() ? "" : " with their losses"));
    }
    // The reduced buffers, then (error feedback) what encoding them lost.
    for (size_t k = 0; k < rets.size(); ++k) {
      auto out = rets.get<ffi::AnyBuffer>(k);
      if (out.has_error()) return out.error();
      if ((*out)->size_bytes() != task->bytes[k % num]) {
        return ffi::Error::InvalidArgument(where + "result " + std::to_string(k) +
                                           " is not the size of its start's operand");
      }
      const engine::PooledBuffer& from = k < num ? task->out[k] : task->lost[k - num];
      std::memcpy((*out)->untyped_data(), from.data(), task->bytes[k % num]);
    }
    return ffi::Error::Success();
  });
}

ffi::Error AsyncKnownImpl(ffi::AnyBuffer token, ffi::Result<ffi::Buffer<ffi::S32>> known,
                          int64_t comm_handle) {
  return NoThrow("herring async known", [&]() -> ffi::Error {
    if (token.size_bytes() != sizeof(uint64_t) || known->element_count() != 1) {
      return ffi::Error::InvalidArgument(
          "herring async known: the token must be 8 bytes and the result one int32");
    }
    uint64_t id = 0;
    std::memcpy(&id, token.untyped_data(), sizeof(id));
    PairTable& table = Table();
    std::lock_guard<std::mutex> lock(table.mu);
    known->typed_data()[0] = table.started.count(PairKey{comm_handle, id}) ? 1 : 0;
    return ffi::Error::Success();
  });
}

}  // namespace

size_t DrainAsync(int64_t comm_handle, double timeout_s, std::vector<int64_t>* dropped) {
  PairTable& table = Table();
  std::unique_lock<std::mutex> lock(table.mu);
  table.cv.wait_for(lock, std::chrono::duration<double>(timeout_s),
                    [&] { return table.running.count(comm_handle) == 0; });
  const size_t left = table.running.count(comm_handle) ? table.running[comm_handle] : 0;
  // What no done will collect any more: the results of this communicator.
  for (auto it = table.started.begin(); it != table.started.end();) {
    bool finished = false;
    if (it->first.comm == comm_handle) {
      std::lock_guard<std::mutex> task_lock(it->second->mu);
      finished = it->second->finished;
      if (finished && dropped) dropped->push_back(it->second->ticket);
    }
    it = finished ? table.started.erase(it) : std::next(it);
  }
  return left;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    HerringAsyncStart, AsyncStartImpl,
    BindAllReduceAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::DeviceOrdinal>()
                           .Ctx<ffi::State<InstructionState>>()
                           .Arg<ffi::Buffer<ffi::S32>>()   // ticket
                           .RemainingArgs()                // buffers to reduce
                           .Ret<ffi::AnyBuffer>()));       // token: this start's id

XLA_FFI_DEFINE_HANDLER_SYMBOL(HerringAsyncDone, AsyncDoneImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ticket
                                  .Arg<ffi::AnyBuffer>()         // its start's token
                                  .RemainingRets()               // the reduced buffers
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(HerringAsyncKnown, AsyncKnownImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // a start's token
                                  .Ret<ffi::Buffer<ffi::S32>>()    // 1: a start of this process
                                  .Attr<int64_t>("comm"));

}  // namespace herring
