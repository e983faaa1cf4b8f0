// The handler side of a reduce-scatter and an all-gather: which blocks of the
// buffer each process of the group holds (its devices' blocks, from the
// device_blocks attribute), the engine's parts, and moving the local devices'
// blocks into and out of them.
//
// The engine gives every process one contiguous part (ReduceRequest::parts,
// in the group's rank order). A process's part is its devices' blocks side by
// side, in ascending block order, so the engine's buffer holds the blocks
// process by process. Where that is the buffer's own order (the usual case:
// one device per process, or a mesh whose devices are laid out process by
// process) the devices' buffers are used as they are; otherwise the blocks
// are copied into that order before (reduce-scatter) or out of it after
// (all-gather) the reduction.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "handler_common.h"
#include "engine/memory_hints.h"
#include "engine/reduce_kernels.h"

namespace herring {

namespace {

// Where the blocks of a group's buffer are (see the top of this file).
struct BlockLayout {
  size_t n = 0;      // elements of the whole buffer
  size_t block = 0;  // elements of a block (the last ones may be shorter or empty)
  std::vector<int64_t> order;      // [engine position] block index
  std::vector<size_t> offset;      // [engine position] where it starts; one more: n
  std::vector<size_t> parts;       // [process in the group] its part's first element
  std::vector<int64_t> mine;       // this process's blocks, ascending
  std::vector<int64_t> local;      // [local position] that device's block
  bool in_place = true;            // order[j] == j: the buffer's own order

  size_t Len(int64_t g) const {
    const size_t begin = std::min(n, static_cast<size_t>(g) * block);
    return std::min(n, begin + block) - begin;
  }
  // Where this process's block g starts in its part.
  size_t InPart(int64_t g) const {
    size_t at = 0;
    for (int64_t h : mine) {
      if (h == g) break;
      at += Len(h);
    }
    return at;
  }
};

engine::Status MakeLayout(const CallAttrs& attrs, const CallPlace& place, int me, size_t n,
                          size_t block, BlockLayout* layout) {
  layout->n = n;
  layout->block = block;
  const size_t procs = place.ranks.size();
  std::vector<std::vector<int64_t>> blocks(procs);  // per process in the group
  auto index_of = [&](int rank) {
    return std::find(place.ranks.begin(), place.ranks.end(), rank) - place.ranks.begin();
  };
  const size_t devices = attrs.device_procs.size();
  if (attrs.device_blocks.size() != devices) {
    return engine::Status::Error("malformed device_blocks attribute");
  }
  for (size_t j = 0; j < devices; ++j) {
    if (attrs.device_groups[j] != place.group) continue;
    const int64_t proc = attrs.device_procs[j];
    const bool mine = proc == kEveryProcess || proc == me;
    for (size_t i = 0; i < procs; ++i) {
      if (proc != kEveryProcess && proc != place.ranks[i]) continue;
      // kEveryProcess with no block of its own: the process's place.
      const int64_t g = attrs.device_blocks[j] < 0 ? static_cast<int64_t>(i)
                                                   : attrs.device_blocks[j];
      blocks[i].push_back(g);
    }
    if (mine) {
      layout->local.push_back(attrs.device_blocks[j] < 0 ? index_of(me) : attrs.device_blocks[j]);
    }
  }
  const size_t count = [&] {
    size_t c = 0;
    for (const auto& b : blocks) c += b.size();
    return c;
  }();
  std::vector<bool> seen(count, false);
  for (auto& b : blocks) {
    std::sort(b.begin(), b.end());
    for (int64_t g : b) {
      if (g < 0 || g >= static_cast<int64_t>(count) || seen[g]) {
        return engine::Status::Error("device_blocks must number the group's devices 0.." +
                                     std::to_string(count - 1) + " once each");
      }
      seen[g] = true;
    }
  }
  if (count * block < n || (block == 0 && n != 0)) {
    return engine::Status::Error(std::to_string(count) + " blocks of " + std::to_string(block) +
                                 " elements cannot hold " + std::to_string(n));
  }
  layout->offset.push_back(0);
  for (size_t i = 0; i < procs; ++i) {
    layout->parts.push_back(layout->offset.back());
    for (int64_t g : blocks[i]) {
      layout->in_place = layout->in_place && g == static_cast<int64_t>(layout->order.size());
      layout->order.push_back(g);
      layout->offset.push_back(layout->offset.back() + layout->Len(g));
    }
  }
  layout->parts.push_back(n);
  layout->mine = blocks[index_of(me)];
  return engine::Status::Ok();
}

}  // namespace

size_t GroupBlocks(const CallAttrs& attrs, const CallPlace& place) {
  size_t count = 0;
  for (size_t j = 0; j < attrs.device_procs.size() && j < attrs.device_groups.size(); ++j) {
    if (attrs.device_groups[j] != place.group) continue;
    // kEveryProcess: one device on each process of the group (MakeLayout).
    count += attrs.device_procs[j] == kEveryProcess ? place.ranks.size() : 1;
  }
  return count;
}

engine::Status ScatterGatherAll(engine::Communicator& comm, const CallAttrs& attrs,
                                const CallPlace& place, int64_t run_id, uint32_t instance,
                                const DecodedCall& call,
                                const std::vector<engine::LocalArrival>& all) {
  const bool scatter = attrs.collective == kCollectiveReduceScatter;
  const size_t num = call.dtypes.size();
  const size_t local = all.size();
  const int me = comm.rank();
  const size_t self = std::find(place.ranks.begin(), place.ranks.end(), me) - place.ranks.begin();
  std::vector<engine::ReduceRequest> requests(num);
  std::vector<BlockLayout> layouts(num);
  std::vector<engine::PooledBuffer> ins(num), outs(num), losts(num);
  std::vector<const void*> srcs(local);
  for (size_t k = 0; k < num; ++k) {
    const engine::DType dtype = call.dtypes[k];
    const size_t elem = engine::ElementSize(dtype);
    const size_t n = scatter ? call.counts[k] : call.out_counts[k];
    const size_t block = scatter ? call.out_counts[k] : call.counts[k];
    BlockLayout& layout = layouts[k];
    engine::Status s = MakeLayout(attrs, place, me, n, block, &layout);
    if (!s.ok()) return s;
    if (layout.local.size() != local) return engine::Status::Error("local devices disagree");
    // XLA's fresh outputs take a page fault per 4 KiB page where huge pages
    // are not asked for (an all-gather's whole buffer: 16k faults per 64 MiB).
    for (size_t d = 0; d < local; ++d) {
      engine::AdviseHugePages(all[d].out[k], call.out_counts[k] * elem);
    }
    engine::ReduceRequest& r = requests[k];
    r.dtype = dtype;
    r.op = scatter ? static_cast<engine::ReduceOp>(OpKind(attrs.op)) : engine::ReduceOp::kSum;
    r.codec = static_cast<engine::Codec>(OpCodec(attrs.op));
    r.collective = scatter ? engine::Collective::kReduceScatter : engine::Collective::kAllGather;
    r.count = n;
    r.parts = layout.parts;
    r.key = static_cast<uint64_t>(attrs.key) + k;
    r.run_id = run_id;
    r.slot = static_cast<uint32_t>(attrs.slot);
    r.instance = instance;
    r.buffer = static_cast<uint32_t>(k);
    r.contributors = static_cast<uint32_t>(local);
    const size_t part = layout.parts[self + 1] - layout.parts[self];
    if (scatter) {
      // In: the local devices' sum, block by block in the engine's order.
      if (local == 1 && layout.in_place) {
        r.in = all[0].in[k];
      } else {
        ins[k] = engine::PooledBuffer(&comm.pool(), std::max<size_t>(1, n * elem));
        if (!ins[k].ok()) return engine::Status::Error("out of memory for a reduce-scatter");
        for (size_t j = 0; j < layout.order.size(); ++j) {
          const int64_t g = layout.order[j];
          for (size_t d = 0; d < local; ++d) {
            srcs[d] = static_cast<const char*>(all[d].in[k]) + g * block * elem;
          }
          engine::ReduceOpInto(r.op, dtype, ins[k].data() + layout.offset[j] * elem, nullptr,
                               srcs.data(), local, layout.Len(g), 1.0);
        }
        r.in = ins[k].data();
      }
      // Error feedback: the loss of the input, in the engine's order, for
      // the first device (the others' are zeros).
      if (!all[0].lost.empty()) {
        for (size_t d = 1; d < local; ++d) std::memset(all[d].lost[k], 0, n * 4);
        if (local == 1 && layout.in_place) {
          r.lost = all[0].lost[k];
        } else {
          losts[k] = engine::PooledBuffer(&comm.pool(), std::max<size_t>(1, n) * 4);
          if (!losts[k].ok()) return engine::Status::Error("out of memory for a reduce-scatter");
          r.lost = reinterpret_cast<float*>(losts[k].data());
        }
      }
      // Out: this process's part; straight into the device's block if it
      // has one device here.
      if (local == 1) {
        r.out = all[0].out[k];
      } else {
        outs[k] = engine::PooledBuffer(&comm.pool(), std::max<size_t>(1, part * elem));
        if (!outs[k].ok()) return engine::Status::Error("out of memory for a reduce-scatter");
        r.out = outs[k].data();
      }
    } else {
      // In: this process's part, its devices' blocks in ascending order.
      if (local == 1) {
        r.in = all[0].in[k];
      } else {
        ins[k] = engine::PooledBuffer(&comm.pool(), std::max<size_t>(1, part * elem));
        if (!ins[k].ok()) return engine::Status::Error("out of memory for an all-gather");
        for (size_t d = 0; d < local; ++d) {
          const int64_t g = layout.local[d];
          std::memcpy(ins[k].data() + layout.InPart(g) * elem, all[d].in[k], layout.Len(g) * elem);
        }
        r.in = ins[k].data();
      }
      if (layout.in_place) {
        r.out = all[0].out[k];
      } else {
        outs[k] = engine::PooledBuffer(&comm.pool(), std::max<size_t>(1, n * elem));
        if (!outs[k].ok()) return engine::Status::Error("out of memory for an all-gather");
        r.out = outs[k].data();
      }
    }
  }
  engine::Status status = comm.AllReduce(place.stream, place.ranks, requests);
  if (!status.ok()) return status;
  for (size_t k = 0; k < num; ++k) {
    const BlockLayout& layout = layouts[k];
    const size_t elem = engine::ElementSize(call.dtypes[k]);
    if (scatter) {
      if (losts[k].ok() && !all[0].lost.empty()) {
        for (size_t j = 0; j < layout.order.size(); ++j) {
          std::memcpy(all[0].lost[k] + layout.order[j] * layout.block,
                      losts[k].data() + layout.offset[j] * 4, layout.Len(layout.order[j]) * 4);
        }
      }
      for (size_t d = 0; d < local; ++d) {
        const int64_t g = layout.local[d];
        char* out = static_cast<char*>(all[d].out[k]);
        if (local > 1) {
          std::memcpy(out, outs[k].data() + layout.InPart(g) * elem, layout.Len(g) * elem);
        }
        // A block past the end of the buffer is padding: zeros.
        std::memset(out + layout.Len(g) * elem, 0, (layout.block - layout.Len(g)) * elem);
      }
      continue;
    }
    char* first = static_cast<char*>(all[0].out[k]);
    if (!layout.in_place) {
      for (size_t j = 0; j < layout.order.size(); ++j) {
        std::memcpy(first + layout.order[j] * layout.block * elem,
                    outs[k].data() + layout.offset[j] * elem, layout.Len(layout.order[j]) * elem);
      }
    }
    for (size_t d = 1; d < local; ++d) std::memcpy(all[d].out[k], first, layout.n * elem);
  }
  return status;
}

}  // namespace herring
