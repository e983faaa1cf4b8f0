// How often each (run, stream, group, slot, instance) was reduced before: the
// occurrence part of a reduction's identity (see Identity in wire.h), with
// entries forgotten once idle (see Communicator::PruneOccurrences for why that
// is safe).
//
// A flat open-addressing table in one vector, not a node-based map: a new run
// adds an entry on every reduction, and a long-lived small heap node per
// reduction, carved out of the large transient buffers freed around it,
// fragmented glibc's heap (measured: a std::map here grew a process by
// ~280 KiB per reduction of 1.6 MB, 0.5 GiB over 2000 reductions, flat with
// this table). Memory changes only when the table doubles or is rebuilt.
#ifndef HERRING_ENGINE_OCCURRENCE_TABLE_H_
#define HERRING_ENGINE_OCCURRENCE_TABLE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace herring::engine {

struct OccurrenceKey {
  int64_t run_id = 0;
  uint32_t stream = 0;
  uint32_t group = 0;  // the caller's number for the process group
  uint32_t slot = 0;
  uint32_t instance = 0;
  bool operator==(const OccurrenceKey& o) const {
    return run_id == o.run_id && stream == o.stream && group == o.group && slot == o.slot &&
           instance == o.instance;
  }
};

class OccurrenceTable {
 public:
  explicit OccurrenceTable(size_t capacity = 1024) : slots_(RoundUp(capacity)) {}

  // The key's next occurrence (0 the first time); marks it used at `now_ns`.
  uint64_t Take(const OccurrenceKey& key, int64_t now_ns) {
    if (2 * (used_ + 1) > slots_.size()) Rebuild(2 * slots_.size(), INT64_MIN);
    Slot& slot = Find(slots_, key);
    if (!slot.used) {
      slot.used = true;
      slot.key = key;
      ++used_;
    }
    slot.last_ns = now_ns;
    return slot.next++;
  }

  // Forgets every entry last used before `cutoff_ns`.
  void Prune(int64_t cutoff_ns) { Rebuild(slots_.size(), cutoff_ns); }

  size_t size() const { return used_; }

 private:
  struct Slot {
    OccurrenceKey key;
    uint64_t next = 0;
    int64_t last_ns = 0;
    bool used = false;
  };

  static size_t RoundUp(size_t n) {
    size_t c = 16;
    while (c < n) c *= 2;
    return c;
  }

  static uint64_t Hash(const OccurrenceKey& k) {
    uint64_t h = static_cast<uint64_t>(k.run_id) * 0x9e3779b97f4a7c15ull;
    h ^= (static_cast<uint64_t>(k.stream) << 32 | k.group) + 0x632be59bd9b4e019ull + (h << 6);
    h ^= (static_cast<uint64_t>(k.slot) << 32 | k.instance) + 0x85ebca6b0b6a2f27ull + (h >> 2);
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 29);
  }

  // The key's slot, or the empty slot where it belongs (the table is never
  // full: at most half used).
  static Slot& Find(std::vector<Slot>& slots, const OccurrenceKey& key) {
    const size_t mask = slots.size() - 1;
    for (size_t i = Hash(key) & mask;; i = (i + 1) & mask) {
      if (!slots[i].used || slots[i].key == key) return slots[i];
    }
  }

  // Copies the entries used at or after `cutoff_ns` into a table of
  // `capacity` slots (grown so that they fill at most half of it).
  void Rebuild(size_t capacity, int64_t cutoff_ns) {
    size_t keep = 0;
    for (const Slot& s : slots_) keep += s.used && s.last_ns >= cutoff_ns;
    while (2 * (keep + 1) > capacity) capacity *= 2;
    std::vector<Slot> fresh(capacity);
    for (const Slot& s : slots_) {
      if (s.used && s.last_ns >= cutoff_ns) Find(fresh, s.key) = s;
    }
    slots_.swap(fresh);
    used_ = keep;
  }

  std::vector<Slot> slots_;
  size_t used_ = 0;
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_OCCURRENCE_TABLE_H_
