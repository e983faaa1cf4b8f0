// Page-fault avoidance for large buffers.
//
// XLA:CPU hands the handler freshly mmap'ed output buffers; writing 64 MiB of
// untouched 4 KiB pages costs ~16k page faults (measured: ~35 ms of a 64 MiB
// reduction on this machine). Asking for transparent huge pages before the
// first write makes that 32 faults. Harmless where THP is off or the pages
// already exist.
#ifndef HERRING_ENGINE_MEMORY_HINTS_H_
#define HERRING_ENGINE_MEMORY_HINTS_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>

namespace herring::engine {

constexpr size_t kHugePage = size_t{2} << 20;

inline void AdviseHugePages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  if (bytes < 2 * kHugePage) return;
  uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace herring::engine

#endif  // HERRING_ENGINE_MEMORY_HINTS_H_
