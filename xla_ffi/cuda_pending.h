// Reductions that XLA:CUDA's start handler has begun and its done handler has
// not yet collected (cuda_handlers.cc), with the pinned host memory they stage
// their bytes in. Built only with a CUDA toolkit (HERRING_WITH_CUDA).
//
// A start and its done are two custom calls of one device's thunk sequence.
// The done finds its start's reduction by what XLA hands both: the run id,
// the device ordinal and the device address of the token buffer that the
// start returns and the done takes as its first operand. One buffer, one
// value: while a token is live (from its start until its last reader, a done)
// no other live token shares its address, so two starts in flight cannot be
// confused, whatever order XLA runs them and their dones in (inlined copies of
// one call site carry equal attributes; loops run one body many times), and
// the key needs no cross-process agreement: it only pairs calls of one device.
// (Which reduction it is across processes is decided by the start, as on the
// CPU: run id, slot, instance; see call_identity.cc.)
#ifndef HERRING_CUDA_PENDING_H_
#define HERRING_CUDA_PENDING_H_

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "engine/buffer_pool.h"
#include "xla/ffi/api/ffi.h"

namespace herring {

namespace ffi = xla::ffi;

// Pinned host memory, pooled (engine/buffer_pool.h: reused from call to call,
// what is kept is bounded): cudaHostAlloc is far too slow per call. Portable:
// one pool serves every local device (with unified addressing it is anyway).
struct PinnedAllocator {
  static void* Allocate(size_t bytes);
  static void Free(void* p);
};
using PinnedPool = engine::BasicBufferPool<PinnedAllocator>;
using PinnedBuffer = engine::BasicPooledBuffer<PinnedPool>;
PinnedPool& Pinned();

// An event for a host thread to wait on. BlockingSync: the waiting thread
// sleeps instead of spinning a core (the context's default, which XLA leaves
// at CU_CTX_SCHED_AUTO, may spin). No timing: cheaper to record.
cudaError_t CreateWaitEvent(cudaEvent_t* event);

// Waits on a herring thread for `event` (recorded on `cuda_device`) and
// destroys it. The device is made current first: the runtime then uses its
// primary context, which XLA created (it retains primary contexts,
// stream_executor/cuda/cuda_context.cc, CudaContext::Create), instead of
// initialising device 0's on a thread that has none.
cudaError_t WaitAndDestroy(int cuda_device, cudaEvent_t event);

// One started reduction. Written by the start (before it is shared), then by
// herring's thread that reduces (Finish), read by the done after Wait.
class PendingReduction {
 public:
  std::string where;    // "herring allreduce on rank R: "
  int64_t key = 0;      // the call's description hash, which the done's must equal
  int cuda_device = 0;  // the CUDA device of XLA's stream
  std::vector<ffi::DataType> types;   // each operand's element type
  std::vector<size_t> elements;       // and element count
  std::vector<size_t> bytes;          // and size
  // Staging, two per operand (2k: the copy of operand k, 2k + 1: its sum).
  // Held until the last copy that reads or writes them is known finished.
  std::vector<PinnedBuffer> staging;
  // Error feedback (handler_common.h's OpFeedback): one per operand, the
  // loss of its encoding, which the done copies into its results after the
  // reduced buffers; empty otherwise.
  std::vector<PinnedBuffer> lost;

  // Marks the reduction ended (error: success or why not) and wakes the done.
  void Finish(ffi::Error error);
  // Waits until Finish, at most `seconds`; false if it has not ended by then.
  bool Wait(double seconds);
  ffi::Error error() const;
  bool FinishedBefore(std::chrono::steady_clock::time_point t) const;
  // A copy into the staging buffers may still be in flight (a failed wait on
  // the GPU): never hand them to another call.
  void Quarantine();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  ffi::Error error_;
  std::chrono::steady_clock::time_point finished_at_;
};

struct PendingKey {
  int64_t run_id;
  int32_t device;      // XLA's DeviceOrdinal
  uintptr_t token;     // device address of the start's token buffer
  bool operator<(const PendingKey& o) const {
    return std::tie(run_id, device, token) < std::tie(o.run_id, o.device, o.token);
  }
};

class PendingTable {
 public:
  static PendingTable& Get();  // never destroyed: handlers may run late

  // Registers a started reduction; false if one is already registered under
  // `key` (two live tokens at one address: XLA broke its own buffer rules, or
  // a done never ran and its run id came round again).
  bool Add(const PendingKey& key, std::shared_ptr<PendingReduction> pending);
  // Removes and returns the reduction started under `key`, or null.
  std::shared_ptr<PendingReduction> Claim(const PendingKey& key);

 private:
  // An execution that failed between a start and its done never runs the
  // done; its finished reduction would hold pinned memory for ever. A done
  // runs on XLA's host thread right after its step's starts were issued (the
  // host runs ahead of the GPU), so a reduction that ended this long ago and
  // is still unclaimed has no done coming. Dropping it is safe: the copy into
  // its staging ended before it was marked finished, and with no done no copy
  // out of it was ever enqueued.
  static constexpr std::chrono::minutes kAbandoned{10};
  void DropAbandoned();  // mu_ held

  std::mutex mu_;
  std::map<PendingKey, std::shared_ptr<PendingReduction>> pending_;
};

}  // namespace herring

#endif  // HERRING_CUDA_PENDING_H_
