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

// Copies `len` bytes at `remote` in process `pid` to `local`, all of them or
// an error that names the process and errno (the process is gone: ESRCH; not
// permitted: EPERM, see AllowPeersToRead).
Status ReadProcessMemory(int64_t pid, uint64_t remote, void* local, size_t len);

// Whether process `pid` has exited: it is gone, or a zombie (an exited child
// its parent has not reaped yet, whose memory can no longer be read).
bool ProcessExited(int64_t pid);

// Where Yama restricts ptrace to descendants (kernel.yama.ptrace_scope = 1,
// Ubuntu's default), lets any process of this user read this one's memory,
// as Open MPI's shared-memory transport does; elsewhere does nothing. Returns
// what it did, for the log ("" if nothing).
std::string AllowPeersToRead();

}  // namespace herring::engine

#endif  // HERRING_ENGINE_CROSS_MEMORY_H_
