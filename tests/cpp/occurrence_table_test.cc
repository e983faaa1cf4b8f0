// Unit test of the occurrence counters (xla_ffi/engine/occurrence_table.h),
// run by tests/test_cpp_units.py under AddressSanitizer + UBSan and
// ThreadSanitizer. The last line on success is
//   OCCURRENCE_TABLE_OK checks=<n>
#include "check.h"
#include "engine/occurrence_table.h"

#include <cstdio>
#include <string>

using herring::engine::OccurrenceKey;
using herring::engine::OccurrenceTable;

namespace {

using herring::test::Check;

OccurrenceKey Key(int64_t run, uint32_t slot, uint32_t instance = 0, uint32_t stream = 0) {
  OccurrenceKey k;
  k.run_id = run;
  k.stream = stream;
  k.slot = slot;
  k.instance = instance;
  return k;
}

}  // namespace

int main() {
  OccurrenceTable table(4);
  // Every key counts on its own, from 0.
  Check(table.Take(Key(1, 0), 10) == 0, "first occurrence is 0");
  Check(table.Take(Key(1, 0), 11) == 1, "second occurrence is 1");
  Check(table.Take(Key(1, 1), 12) == 0, "another slot counts on its own");
  Check(table.Take(Key(1, 0, 1), 12) == 0, "another instance counts on its own");
  Check(table.Take(Key(1, 0, 0, 3), 12) == 0, "another stream counts on its own");
  Check(table.Take(Key(2, 0), 12) == 0, "another run counts on its own");
  Check(table.Take(Key(-7, 0), 12) == 0, "negative run ids are keys too");
  Check(table.size() == 6, "six keys");

  // Growth keeps every count (many keys, far beyond the initial capacity).
  for (int64_t run = 100; run < 5100; ++run) table.Take(Key(run, run % 7), 20);
  for (int64_t run = 100; run < 5100; ++run) {
    if (table.Take(Key(run, run % 7), 30) != 1) {
      Check(false, "count lost while growing, run " + std::to_string(run));
      break;
    }
  }
  Check(table.size() == 5006, "5006 keys after growth");
  Check(table.Take(Key(1, 0), 30) == 2, "old key kept its count through growth");

  // Pruning forgets exactly the entries last used before the cutoff.
  table.Prune(25);  // the 5000 runs (used at 30) and Key(1, 0) stay
  Check(table.size() == 5001, "prune kept the recently used keys");
  Check(table.Take(Key(1, 1), 40) == 0, "a pruned key counts from 0 again");
  Check(table.Take(Key(100, 100 % 7), 40) == 2, "a kept key keeps counting");
  table.Prune(1000);
  Check(table.size() == 0, "prune of everything leaves nothing");
  Check(table.Take(Key(1, 0), 50) == 0, "empty table counts from 0");

  return herring::test::Finish("OCCURRENCE_TABLE");
}
