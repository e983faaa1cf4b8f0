// Unit test of the split between the workers' and the server-only processes'
// parts (xla_ffi/engine/served.h), run by tests/test_cpp_units.py. The last
// line on success is
//   SERVED_PARTS_OK checks=<n>
#include "check.h"
#include "engine/served.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using herring::engine::BlockShare;
using herring::engine::PackServedGroup;
using herring::engine::RootedParts;
using herring::engine::ServedGroup;
using herring::engine::ServedParts;
using herring::engine::ServerShare;
using herring::engine::UnpackServedGroup;
using herring::test::Check;

namespace {

bool Near(double a, double b) { return std::fabs(a - b) < 1e-12; }

// Parts in order, covering the buffer, beginning at multiples of align (or
// where the region they belong to ends), the servers' region about `share`.
void CheckLayout(size_t count, int n, int k, double share, size_t align) {
  const std::vector<size_t> b = ServedParts(count, n, k, share, align);
  const std::string what = "count=" + std::to_string(count) + " n=" + std::to_string(n) +
                           " k=" + std::to_string(k) + " share=" + std::to_string(share);
  Check(b.size() == static_cast<size_t>(n + k + 1), what + ": one part per process");
  Check(b.front() == 0 && b.back() == count, what + ": parts cover the buffer");
  for (size_t i = 1; i < b.size(); ++i) Check(b[i - 1] <= b[i], what + ": parts in order");
  const size_t workers_end = b[n];
  for (int i = 0; i < n + k; ++i) {
    Check(b[i] % align == 0 || b[i] == workers_end || b[i] == count, what + ": aligned parts");
  }
  const double servers = static_cast<double>(count - workers_end);
  Check(std::fabs(servers - share * count) <= align, what + ": the servers hold the share");
}

// A block's parts (a reduce-scatter's or all-gather's through the servers):
// every worker's empty but the owner's, which comes first, then the
// servers', which hold about `share` of it.
void CheckRooted(size_t count, int n, int root, int k, double share, size_t align) {
  const std::vector<size_t> b = RootedParts(count, n, root, k, share, align);
  const std::string what = "count=" + std::to_string(count) + " n=" + std::to_string(n) +
                           " root=" + std::to_string(root) + " k=" + std::to_string(k) +
                           " share=" + std::to_string(share);
  Check(b.size() == static_cast<size_t>(n + k + 1), what + ": one part per process");
  Check(b.front() == 0 && b.back() == count, what + ": parts cover the block");
  for (size_t i = 1; i < b.size(); ++i) Check(b[i - 1] <= b[i], what + ": parts in order");
  for (int i = 0; i < n; ++i) {
    Check(i == root || b[i] == b[i + 1], what + ": only the owner's worker part holds elements");
  }
  Check(b[root] == 0, what + ": the owner's part first");
  const double servers = static_cast<double>(count - b[n]);
  Check(std::fabs(servers - share * count) <= align, what + ": the servers hold the share");
}

}  // namespace

int main() {
  // The split that loads every flow of a worker alike.
  Check(Near(ServerShare(4, 1, -1.0), 1.0 / 3), "n=4, k=1: a third");
  Check(Near(ServerShare(4, 2, -1.0), 0.5), "n=4, k=2: half");
  Check(Near(ServerShare(4, 3, -1.0), 0.6), "n=4, k=3: 0.6");
  Check(Near(ServerShare(4, 4, -1.0), 1.0), "n=4, k=4: all");
  Check(Near(ServerShare(4, 8, -1.0), 1.0), "n=4, k=8: all");
  Check(Near(ServerShare(2, 1, -1.0), 0.5), "n=2, k=1: half");
  Check(Near(ServerShare(2, 2, -1.0), 2.0 / 3), "n=2, k=2: a tie, the split of more flows");
  Check(Near(ServerShare(8, 7, -1.0), 1.0), "n=8, k=7: all (8/7 of the buffer per server)");
  for (int n = 2; n <= 16; ++n) {
    for (int k = 1; k <= 16; ++k) {
      const double x = ServerShare(n, k, -1.0);
      const std::string what = "n=" + std::to_string(n) + " k=" + std::to_string(k);
      Check(x > 0.0 && x <= 1.0, what + ": a share in (0, 1]");
      // Every flow a worker sends carries the same bytes: x / k to each
      // server and, unless the servers take everything, 2 (1 - x) / n to
      // each other worker.
      Check(x == 1.0 || Near(x / k, 2.0 * (1.0 - x) / n), what + ": equal flows");
    }
  }
  Check(Near(ServerShare(4, 2, 0.25), 0.25), "a requested share holds");
  Check(Near(ServerShare(4, 0, -1.0), 0.0), "no servers, no share");
  for (size_t count : {size_t{1}, size_t{7}, size_t{16}, size_t{4097}, size_t{1} << 20}) {
    for (int n : {2, 3, 4}) {
      for (int k : {1, 2, 4}) {
        for (double share : {0.0, 0.3, ServerShare(n, k, -1.0), 1.0}) {
          CheckLayout(count, n, k, share, 16);
        }
      }
    }
  }
  // A block's share: a worker's flows carry alike in a reduce-scatter,
  // (1 - x) b to each owner and x n b / k to each server.
  Check(Near(BlockShare(4, 4, -1.0), 0.5), "blocks n=4, k=4: half");
  Check(Near(BlockShare(4, 2, -1.0), 1.0 / 3), "blocks n=4, k=2: a third");
  for (int n = 2; n <= 16; ++n) {
    for (int k = 1; k <= 16; ++k) {
      const double x = BlockShare(n, k, -1.0);
      const std::string what = "blocks n=" + std::to_string(n) + " k=" + std::to_string(k);
      Check(x > 0.0 && x < 1.0, what + ": a share in (0, 1)");
      Check(Near(1.0 - x, x * n / k), what + ": equal flows");
    }
  }
  Check(Near(BlockShare(4, 2, 0.7), 0.7), "a requested share holds for the blocks too");
  Check(Near(BlockShare(4, 0, -1.0), 0.0), "no servers, no block share");
  for (size_t count : {size_t{1}, size_t{7}, size_t{4097}, size_t{1} << 20}) {
    for (int n : {2, 3, 4}) {
      for (int root = 0; root < n; ++root) {
        for (double share : {0.0, 0.2, 0.6, 1.0}) CheckRooted(count, n, root, 2, share, 16);
      }
    }
  }
  // A served group's fields, the block's owner among them, survive the wire.
  ServedGroup g;
  g.first = 8191;
  g.size = 4;
  g.position = 3;
  g.root = 2;
  g.gather = true;
  const ServedGroup back = UnpackServedGroup(PackServedGroup(g));
  Check(back.first == 8191 && back.size == 4 && back.position == 3 && back.root == 2 &&
            back.gather && back.Rooted(),
        "a block's served group packs and unpacks");
  const ServedGroup plain = UnpackServedGroup(PackServedGroup(ServedGroup{}));
  Check(!plain.Rooted() && !plain.gather, "an all-reduce's group names no block");
  return herring::test::Finish("SERVED_PARTS");
}
