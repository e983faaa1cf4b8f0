// Reusable, page-aligned host buffers for server staging and local sums, so
// that steady-state training allocates (and page-faults) nothing per step.
#ifndef HERRING_ENGINE_BUFFER_POOL_H_
#define HERRING_ENGINE_BUFFER_POOL_H_

#include <cstddef>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "engine/memory_hints.h"

namespace herring::engine {

// Page-aligned host memory from the C allocator. Buffers of 4 MiB and more are
// aligned to huge pages and advised to use them: other processes of the host
// read them with process_vm_readv (the host stage's slices), which pins each
// page it reads, and 2 MiB pages are far fewer to look up and pin.
struct HostAllocator {
  static void* Allocate(size_t bytes) {
    if (bytes < 2 * kHugePage) return std::aligned_alloc(4096, bytes);
    const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, rounded);
    if (p != nullptr) AdviseHugePages(p, rounded);
    return p;
  }
  static void Free(void* p) { std::free(p); }
};

// A pool of buffers from `Allocator` (Allocate(bytes) -> pointer or nullptr,
// Free(pointer)): the CUDA handler uses it with pinned host memory.
template <typename Allocator>
class BasicBufferPool {
 public:
  struct Free {
    void operator()(void* p) const {
      if (p != nullptr) Allocator::Free(p);
    }
  };
  using Ptr = std::unique_ptr<void, Free>;

  // A buffer of at least `bytes` (null if the allocator failed); give it back
  // with Release.
  Ptr Acquire(size_t bytes, size_t* capacity) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      // Reuse only buffers not much larger than asked, so one huge buffer
      // does not serve (and pin) many small requests.
      if (it != free_.end() && it->first <= 2 * bytes + 4096) {
        *capacity = it->first;
        Ptr p = std::move(it->second);
        free_.erase(it);
        held_ -= *capacity;
        return p;
      }
    }
    size_t rounded = (bytes + 4095) / 4096 * 4096;
    if (rounded == 0) rounded = 4096;
    *capacity = rounded;
    return Ptr(Allocator::Allocate(rounded));
  }

  void Release(Ptr p, size_t capacity) {
    if (!p) return;
    std::lock_guard<std::mutex> lock(mu_);
    // Bound what is kept; beyond it buffers go back to the allocator.
    if (held_ + capacity > kMaxHeld) return;
    held_ += capacity;
    free_.emplace(capacity, std::move(p));
  }

 private:
  static constexpr size_t kMaxHeld = size_t{2} << 30;
  std::mutex mu_;
  std::multimap<size_t, Ptr> free_;
  size_t held_ = 0;
};

using BufferPool = BasicBufferPool<HostAllocator>;

// Scoped buffer from a pool.
template <typename Pool>
class BasicPooledBuffer {
 public:
  BasicPooledBuffer() = default;
  BasicPooledBuffer(Pool* pool, size_t bytes) : pool_(pool) {
    ptr_ = pool->Acquire(bytes, &capacity_);
  }
  BasicPooledBuffer(BasicPooledBuffer&&) = default;
  BasicPooledBuffer& operator=(BasicPooledBuffer&&) = default;
  ~BasicPooledBuffer() {
    if (pool_ != nullptr) pool_->Release(std::move(ptr_), capacity_);
  }
  char* data() const { return static_cast<char*>(ptr_.get()); }
  bool ok() const { return ptr_ != nullptr; }
  // Gives the memory up for good: never reused, never freed (another process
  // may still read it; see Communicator::~Communicator).
  void Leak() {
    (void)ptr_.release();
    pool_ = nullptr;
  }

 private:
  Pool* pool_ = nullptr;
  typename Pool::Ptr ptr_;
  size_t capacity_ = 0;
};

using PooledBuffer = BasicPooledBuffer<BufferPool>;

}  // namespace herring::engine

#endif  // HERRING_ENGINE_BUFFER_POOL_H_
