// Reading another process's memory on the same host (Linux cross-memory
// attach, process_vm_readv), as libfabric's shm provider does: one copy, by
// the kernel, straight out of the other process's buffer. Only reads: the host
// stage never writes into another process.
#ifndef HERRING_ENGINE_CROSS_MEMORY_H_
#define HERRING_ENGINE_CROSS_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/transport.h"

namespace herring::engine {

using transport::Status;

// The host stage reads other processes' inputs in pieces of this size: one
// per process at a time stays in L2.
constexpr size_t kHostPieceBytes = 256 << 10;

// Copies `len` bytes at `remote` in process `pid` to `local`, all of them or
// an error that names the process and errno (the process is gone: ESRCH; not
// permitted: EPERM, see SetPtracer).
Status ReadProcessMemory(int64_t pid, uint64_t remote, void* local, size_t len);

// Whether process `pid` has exited: it is gone, a zombie (an exited child
// its parent has not reaped yet, whose memory can no longer be read), or
// killed and still ending its threads, its memory already gone.
bool ProcessExited(int64_t pid);

// Where Yama restricts ptrace to descendants (kernel.yama.ptrace_scope = 1,
// Ubuntu's default), declares who else may read this process's memory:
// process `tracer` and its descendants (tracer > 0), any process of this user
// (kPtracerAny, what Open MPI and UCX declare), or nobody again (0).
// herring_jax/_src/process/topology.py decides (the narrowest: the nearest common
// ancestor of the host's processes). Returns "" or why prctl refused.
constexpr int64_t kPtracerAny = -1;
std::string SetPtracer(int64_t tracer);

}  // namespace herring::engine

#endif  // HERRING_ENGINE_CROSS_MEMORY_H_
