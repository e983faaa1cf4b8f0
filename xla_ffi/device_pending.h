// Reductions that a device's start handler has begun and its done handler has
// not yet collected (device_handlers.cc), with the staging memory they hold
// their bytes in (device.h: pinned memory on CUDA, the CPU double's own).
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
#ifndef HERRING_DEVICE_PENDING_H_
#define HERRING_DEVICE_PENDING_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "device.h"
#include "xla/ffi/api/ffi.h"

namespace herring {

namespace ffi = xla::ffi;

// One started reduction. Written by the start (before it is shared), then by
// herring's thread that reduces (Finish), read by the done after Wait.
class PendingReduction {
 public:
  std::string where;    // "herring allreduce on rank R: "
  int64_t key = 0;      // the call's description hash, which the done's must equal
  Device* device = nullptr;  // what the copies run on
  int stream_device = 0;     // the device of XLA's stream (Device::StreamDevice)
  std::vector<ffi::DataType> types;   // each operand's element type
  std::vector<size_t> elements;       // and element count
  std::vector<size_t> bytes;          // and size
  // Each result's element count and size: its operand's for an all-reduce,
  // 1/G of it for a reduce-scatter, G times it for an all-gather (G the
  // group's devices, handler_common.h's GroupBlocks).
  std::vector<size_t> out_elements;
  std::vector<size_t> out_bytes;
  // Staging, two per operand (2k: the copy of operand k, 2k + 1: its result,
  // out_bytes[k]). Held until the last copy that reads or writes them is
  // known finished.
  std::vector<StagingBuffer> staging;
  // Error feedback (handler_common.h's OpFeedback): one per operand, the
  // loss of its encoding, which the done copies into its results after the
  // reduced buffers; empty otherwise.
  std::vector<StagingBuffer> lost;

  // Marks the reduction ended (error: success or why not) and wakes the done.
  void Finish(ffi::Error error);
  // Waits until Finish, at most `seconds`; false if it has not ended by then.
  bool Wait(double seconds);
  ffi::Error error() const;
  bool FinishedBefore(std::chrono::steady_clock::time_point t) const;
  // A copy into the staging buffers may still be in flight (a failed wait on
  // the device): never hand them to another call.
  void Quarantine();

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  ffi::Error error_;
  std::chrono::steady_clock::time_point finished_at_;
};

struct PendingKey {
  const Device* on;    // the CUDA device layer, or the CPU double
  int64_t run_id;
  int32_t device;      // XLA's DeviceOrdinal
  uintptr_t token;     // device address of the start's token buffer
  bool operator<(const PendingKey& o) const {
    return std::tie(on, run_id, device, token) < std::tie(o.on, o.run_id, o.device, o.token);
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

#endif  // HERRING_DEVICE_PENDING_H_
