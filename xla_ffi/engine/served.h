// Server-only processes (BytePS's summation service on herring's parameter
// servers): processes that train nothing and only sum. The workers place a
// share of each all-reduce's parts on them; the split and the part layout
// are here, the server's side in served.cc. Internal to the engine.
#ifndef HERRING_ENGINE_SERVED_H_
#define HERRING_ENGINE_SERVED_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "engine/buffer_pool.h"
#include "engine/wire.h"

namespace herring::engine {

// Bytes each host sends per byte of the buffer, for a share `x` on `k`
// servers among `n` workers: a worker sends x / k to each server and
// 2 (1 - x) / n to each other worker (its contributions to their parts and
// its part's results), a server n x / k. The larger of the two, the time on
// links of one rate with no cap per flow.
inline double ServedLoad(int n, int k, double x) {
  const double worker = x + 2.0 * (1.0 - x) * (n - 1) / n;
  const double server = static_cast<double>(n) * x / k;
  return std::max(worker, server);
}

// The share of each buffer that `k` server-only processes take in a group of
// `n` workers: `requested` where it is in [0, 1], else a split that gives
// every flow a worker sends the same bytes. A host's link is shared alike by
// the flows that cross it (TCP, and the simulated network's classes), so a
// split that loads some flows more than others finishes with those alone,
// each at its per-flow cap, and leaves the link idle: the split at which the
// workers' and the servers' links would finish together (a / (n / k - 1 + a),
// a = 2 (n - 1) / n; 0.6 for n = 4, k = 2) took raw TCP 804-806 ms against
// 728-750 at 0.5, equal flows, on 4 hosts of 1 Gbit/s with 250 Mbit/s flows
// (64 MiB), and herring 1.36x against 1.53-1.54x over no servers
// (docs/guides/servers.md). Two
// splits load every flow alike: x = 2 k / (n + 2 k), where the n - 1 flows
// to workers and the k to servers each carry 2 / (n + 2 k) of the buffer, and
// x = 1, where only the k flows to servers carry it. Of the two, the one
// with the smaller ServedLoad; on a tie the first, whose flows are more and
// each carry less. n = 4: k = 1 1/3, k = 2 0.5, k = 3 0.6, k >= 4 1.
inline double ServerShare(int n, int k, double requested) {
  if (requested >= 0.0 && requested <= 1.0) return requested;
  if (k <= 0 || n <= 1) return 0.0;
  const double even = 2.0 * k / (n + 2.0 * k);
  return ServedLoad(n, k, 1.0) < ServedLoad(n, k, even) - 1e-12 ? 1.0 : even;
}

// Where each part of an all-reduce of `count` elements begins (n + k + 1
// entries, the last `count`): n workers' parts, then k servers' parts, which
// together hold about `share` of the buffer. Parts begin at multiples of
// `align` elements (except the empty ones at the end). Every worker computes
// the same layout; any layout sums each element in rank order.
inline std::vector<size_t> ServedParts(size_t count, int n, int k, double share,
                                       size_t align) {
  auto up = [align](size_t v) { return (v + align - 1) / align * align; };
  const size_t to_servers =
      std::min(count, static_cast<size_t>(std::llround(share * static_cast<double>(count))));
  // The workers' region ends where the servers' begins, on an alignment
  // boundary (or at the end, when the servers take nothing).
  const size_t workers_end = to_servers == 0 ? count : (count - to_servers) / align * align;
  const size_t per_worker = up((workers_end + n - 1) / n);
  const size_t per_server = up((count - workers_end + k - 1) / k);
  std::vector<size_t> begin;
  for (int i = 0; i < n; ++i) begin.push_back(std::min(workers_end, i * per_worker));
  for (int j = 0; j < k; ++j) begin.push_back(std::min(count, workers_end + j * per_server));
  begin.push_back(count);
  return begin;
}

// The share of each block (one worker's part) of a reduce-scatter or an
// all-gather that goes through the servers: x = k / (n + k), `requested`
// where it is in [0, 1].
// - A reduce-scatter: a worker sends every block but its own towards its
//   owner anyway, so the servers add bytes to its link ((n - 1 + x) b
//   against (n - 1) b, blocks of b). They pay only where one flow cannot
//   fill a link, as on clouds that cap each flow: with the link shared alike
//   by a worker's flows, the split of equal flows ((1 - x) b to each owner,
//   x n b / k to each server) is the fastest, 1.14x over no servers at
//   n = k = 4 with flows capped at a quarter of the link (1.2x at k = 2).
// - An all-gather: the owner sends x b once to the servers, and they send it
//   on to the n - 1 others. The same split was the fastest measured on 4
//   simulated hosts (1 Gbit/s, 250 Mbit/s flows; 64 MiB, k = 4: 371-403 ms
//   at 0.5 against 425-435 at 0.6, where a worker's and a server's links
//   carry the same bytes, and 594 without servers; k = 2: 443-446 ms at
//   0.35 against 462-495 at 0.3 and 0.4), since a server passes a chunk on
//   only once all of it has come.
inline double BlockShare(int n, int k, double requested) {
  if (requested >= 0.0 && requested <= 1.0) return requested;
  if (k <= 0 || n <= 1) return 0.0;
  return static_cast<double>(k) / (n + k);
}

// Where each part of a reduce-scatter's or all-gather's block of `count`
// elements begins when it goes through the servers (n + k + 1 entries): the
// owner's (`root`'s) part, then the k servers', which hold about `share` of
// it; the other workers' parts are empty.
inline std::vector<size_t> RootedParts(size_t count, int n, int root, int k, double share,
                                       size_t align) {
  std::vector<size_t> begin = ServedParts(count, 1, k, share, align);
  const size_t owner_end = begin[1];
  std::vector<size_t> out;
  for (int i = 0; i < n; ++i) out.push_back(i <= root ? 0 : owner_end);
  for (int j = 0; j < k; ++j) out.push_back(begin[1 + j]);
  out.push_back(count);
  return out;
}

// A server-only process's receive buffers hold the header here and the
// payload (at most CommConfig::chunk_bytes) from kServedPayloadAt on.
constexpr size_t kServedPayloadAt = 128;
static_assert(kServedPayloadAt >= sizeof(WireHeader), "served header does not fit");

// Which chunk of which reduction a contribution belongs to. The host stage's
// groups of one call (one per local index) share its identity: their first
// processes tell them apart.
using ServedKey = std::tuple<int64_t, uint64_t, uint32_t, uint32_t, uint32_t, uint32_t,
                             uint32_t, uint32_t, uint32_t>;
inline ServedKey KeyOf(const WireHeader& h) {
  // The part tells a rooted block's parts apart (Job::WirePart).
  return ServedKey{h.run_id, h.occurrence, h.slot,  h.instance, h.buffer,
                   h.stream, h.part,       h.chunk, UnpackServedGroup(h.served).first};
}

// One chunk being summed: every group member's message, kept until the last
// one is here.
struct ServedChunk {
  WireHeader first{};              // the first message's header: the others must agree
  std::vector<PooledBuffer> from;  // [position in the group] its message
  std::vector<int> ranks;          // [position] its sender, whom the sum goes back to
  int arrived = 0;
};

// What a server's sum is sent with: kept alive until every send of it completed.
struct ServedResult {
  WireHeader header{};
  PooledBuffer data;
  size_t offset = 0;  // where the payload begins in `data`
};

// The tag bits of a block's messages (Job::root; -1: not a block's): a
// block's must not match another's, whose identity is the same call's. The
// header's part tells them apart where these collide.
inline uint64_t BlockTagBits(uint64_t identity_bits, int root) {
  if (root < 0) return identity_bits;
  return (identity_bits + static_cast<uint64_t>(root + 1) * 0x9e3779b1ull) & kIdentityBits;
}

struct ServedState {
  size_t payload_bytes = 0;         // room for a payload in each receive
  std::vector<PooledBuffer> slots;  // [slot] the buffer its receive is posted into
  std::mutex mu;
  std::map<ServedKey, ServedChunk> chunks;
  std::atomic<uint64_t> chunks_summed{0};
  std::atomic<uint64_t> bytes_summed{0};
  std::atomic<uint64_t> failed_sends{0};
};

}  // namespace herring::engine

#endif  // HERRING_ENGINE_SERVED_H_
