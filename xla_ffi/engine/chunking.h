// How a reduction's parts are cut into chunks, the messages that carry them.
// The same on every process of a job: each chunk's header is checked.
#ifndef HERRING_ENGINE_CHUNKING_H_
#define HERRING_ENGINE_CHUNKING_H_

#include <algorithm>
#include <cstddef>

#include "engine/wire.h"

namespace herring::engine {

// How many chunks a part is cut into at least while its chunks stay above
// CommConfig::min_chunk_bytes. With one chunk per part a server can send a
// part's result only after the part's last contribution has arrived whole, so
// each flow sits idle between the two; with 4, results flow while the last
// chunks' contributions arrive. 4 simulated hosts (1 Gbit hosts, 250 Mbit
// flows), two runs each: 256 KiB all-reduces went from 73/60% to 93/83% of
// the bound, 1 MiB from 81/79% to 87/88% (BENCHMARKS.md, "Small buffers
// across hosts").
constexpr size_t kChunksPerPart = 4;

// Elements per chunk of a job whose largest part holds `largest` elements of
// `elem` bytes: about largest / kChunksPerPart, kept between min_chunk_bytes
// and chunk_bytes (chunk_bytes wins where min_chunk_bytes is larger), a
// multiple of `align` elements: rounded down, so that no chunk exceeds
// chunk_bytes (the transport's eager limit), and up only for a chunk smaller
// than `align` or where a part would otherwise need more than
// kMaxChunksPerPart chunks.
inline size_t ChunkElems(size_t largest, size_t elem, size_t align, size_t chunk_bytes,
                         size_t min_chunk_bytes) {
  const size_t most = std::max<size_t>(1, chunk_bytes / elem);
  const size_t least = std::min(most, std::max<size_t>(1, min_chunk_bytes / elem));
  size_t chunk = std::clamp((largest + kChunksPerPart - 1) / kChunksPerPart, least, most);
  const size_t fewest = std::max<size_t>(1, (largest + kMaxChunksPerPart - 1) / kMaxChunksPerPart);
  const size_t down = chunk / align * align;
  if (down >= fewest) return down;
  chunk = std::max(chunk, fewest);
  return (chunk + align - 1) / align * align;
}

}  // namespace herring::engine

#endif  // HERRING_ENGINE_CHUNKING_H_
