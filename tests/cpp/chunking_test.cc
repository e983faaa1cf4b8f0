// Unit test of how parts are cut into chunks (xla_ffi/engine/chunking.h), run
// by tests/test_cpp_units.py under AddressSanitizer + UBSan and
// ThreadSanitizer. The last line on success is
//   CHUNKING_OK checks=<n>
#include "check.h"
#include "engine/chunking.h"

#include <cstdio>
#include <string>

using herring::engine::ChunkElems;
using herring::engine::kMaxChunksPerPart;
using herring::test::Check;

namespace {

constexpr size_t KiB = 1024, MiB = 1024 * KiB;

// Every element of a part of `largest` is in some chunk, no chunk exceeds
// the limit (unless alignment or the chunk count forced it up), and the
// chunk is a multiple of align.
void CheckInvariants(size_t largest, size_t elem, size_t align, size_t most, size_t least) {
  const size_t chunk = ChunkElems(largest, elem, align, most, least);
  const std::string what = "largest=" + std::to_string(largest) + " elem=" +
                           std::to_string(elem) + " align=" + std::to_string(align) +
                           " chunk=" + std::to_string(chunk);
  Check(chunk > 0 && chunk % align == 0, what + ": a positive multiple of align");
  Check(largest == 0 || (largest + chunk - 1) / chunk <= kMaxChunksPerPart,
        what + ": at most kMaxChunksPerPart chunks");
  const bool forced_up = align * elem > most ||
                         (largest + kMaxChunksPerPart - 1) / kMaxChunksPerPart > most / elem;
  Check(forced_up || chunk * elem <= most, what + ": within chunk_bytes");
}

}  // namespace

int main() {
  const size_t f32 = 4, align = 16;  // 64 bytes of float32
  // Large parts: chunk_bytes (1 MiB) as before.
  Check(ChunkElems(4 * MiB, f32, align, MiB, 16 * KiB) * f32 == MiB, "16 MiB part: 1 MiB chunks");
  // A quarter of the part between the two limits: 256 KiB all-reduce on 4
  // processes (64 KiB parts) travels in 16 KiB chunks, 1 MiB (256 KiB parts)
  // in 64 KiB chunks, 16 MiB on 8 (2 MiB parts) in 512 KiB chunks.
  Check(ChunkElems(16 * KiB, f32, align, MiB, 16 * KiB) * f32 == 16 * KiB, "64 KiB part");
  Check(ChunkElems(64 * KiB, f32, align, MiB, 16 * KiB) * f32 == 64 * KiB, "256 KiB part");
  Check(ChunkElems(512 * KiB, f32, align, MiB, 16 * KiB) * f32 == 512 * KiB, "2 MiB part");
  // Small parts: not below min_chunk_bytes, so one chunk for an 8 KiB part.
  Check(ChunkElems(2 * KiB, f32, align, MiB, 16 * KiB) * f32 == 16 * KiB, "8 KiB part");
  // min_chunk_bytes >= chunk_bytes: fixed chunks of chunk_bytes (the old
  // geometry), and chunk_bytes below min_chunk_bytes wins.
  Check(ChunkElems(64 * KiB, f32, align, MiB, MiB) * f32 == MiB, "fixed 1 MiB chunks");
  Check(ChunkElems(64 * KiB, f32, align, 4 * KiB, 16 * KiB) * f32 == 4 * KiB,
        "chunk_bytes below min_chunk_bytes");
  // Rounded down to align, never above chunk_bytes: 100-byte limit, 64-byte
  // alignment: one 64-byte chunk (16 floats).
  Check(ChunkElems(1000, f32, align, 100, 16 * KiB) == 16, "100-byte limit: 64-byte chunks");
  // An odd part: a quarter of 10001 elements is 2501, down to 2496.
  Check(ChunkElems(10001, f32, align, MiB, 4 * KiB) == 2496, "odd part rounded down");
  // A codec's block (align 256) larger than the limit: rounded up to one block.
  Check(ChunkElems(4096, f32, 256, 512, 16 * KiB) == 256, "block above the limit");
  // More than kMaxChunksPerPart chunks of chunk_bytes: chunks grow instead.
  const size_t huge = 64 * kMaxChunksPerPart;
  Check(ChunkElems(huge, f32, align, 64, 64) == 64, "exactly kMaxChunksPerPart chunks");
  Check(ChunkElems(huge + 1, f32, align, 64, 64) == 80, "one more element: larger chunks");
  for (size_t largest : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{4097},
                         size_t{1} << 20, (size_t{1} << 20) + 3, size_t{1} << 28}) {
    for (size_t elem : {size_t{1}, size_t{2}, size_t{4}, size_t{8}}) {
      const size_t a = std::max<size_t>(1, 64 / elem);
      for (size_t most : {size_t{64}, size_t{100}, 4 * KiB, MiB}) {
        for (size_t least : {size_t{1}, 16 * KiB, 2 * MiB}) {
          CheckInvariants(largest, elem, a, most, least);
          CheckInvariants(largest, elem, 256, most, least);
        }
      }
    }
  }
  return herring::test::Finish("CHUNKING");
}
