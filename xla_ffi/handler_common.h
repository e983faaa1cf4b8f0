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

#include "engine/communicator.h"
#include "engine/local_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace herring {

namespace ffi = xla::ffi;

// The custom call's attributes (see the binding in handlers.cc).
struct CallAttrs {
  int64_t comm;
  int64_t op;
  int64_t key;
  int64_t slot;
  int64_t site;
  ffi::Span<const int64_t> local_devices;
  ffi::Span<const int64_t> device_streams;
  ffi::Span<const int64_t> stream_ranks;
  ffi::Span<const int64_t> stream_offsets;
};

struct DecodedCall {
  std::shared_ptr<engine::Communicator> comm;
  std::string where;               // "herring allreduce on rank R: "
  engine::LocalArrival arrival;    // XLA's buffer pointers, one per operand
  std::vector<engine::DType> dtypes;
  std::vector<size_t> counts;
};

// Adds the attributes every allreduce handler takes, in CallAttrs order, to
// a binding that already has its context, operands and results.
template <typename Binding>
auto BindAllReduceAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<int64_t>("comm")                   // communicator handle (registry)
      .template Attr<int64_t>("op")                     // 0 sum, 1 mean
      .template Attr<int64_t>("key")                    // description hash, checked on the wire
      .template Attr<int64_t>("slot")                   // call site id, same on every process
      .template Attr<int64_t>("site")                   // call site id, unique in this process
      .template Attr<ffi::Span<const int64_t>>("local_devices")    // this process's devices
      .template Attr<ffi::Span<const int64_t>>("device_streams")   // group of each of them
      .template Attr<ffi::Span<const int64_t>>("stream_ranks")     // processes of each group,
      .template Attr<ffi::Span<const int64_t>>("stream_offsets");  // concatenated; offsets
}

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

// Finds the communicator and checks and collects the buffers.
ffi::Error DecodeCall(ffi::RemainingArgs args, ffi::RemainingRets rets, const CallAttrs& attrs,
                      DecodedCall* call);

// Reduces `call.arrival` (host memory) with the other local devices of the
// same group and across processes; the result lands in `call.arrival.out`.
// `run_id` is XLA's id of the execution: with `attrs.site` it names the
// meeting of the local devices (see engine/local_rendezvous.h).
ffi::Error ReduceCall(int64_t run_id, int32_t device, const CallAttrs& attrs, DecodedCall& call);

}  // namespace herring

#endif  // HERRING_HANDLER_COMMON_H_
