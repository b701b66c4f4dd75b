// The paged KV block pool (design §1.4): fixed-size blocks per layer kind, reference counts, a
// prefix index (hash chain over the token ids of full blocks) and LRU eviction of unreferenced
// cached blocks. Thread-safe.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvstore/kv_layout.h"

namespace dgserve::kv {

// A sequence's blocks. full[i] covers positions [i·B, (i+1)·B) of the full layers;
// sliding[i] covers [(first_sliding_block + i)·B, …) of the sliding layers (older sliding blocks
// are released once outside the window).
struct BlockTable {
  std::vector<int32_t> full;
  int first_sliding_block = 0;
  std::vector<int32_t> sliding;
};

// A cached prefix found by BlockPool::MatchPrefix. The pool has taken one reference on every
// block listed; hand them to PagedKvCache::FromPrefix (or Release them).
struct PrefixMatch {
  int num_tokens = 0;  // a multiple of block_size; 0 = no hit
  BlockTable table;    // full blocks 0 .. num_tokens/B − 1; sliding blocks covering the window
};

struct PoolStats {
  int64_t total[kNumKinds] = {0, 0};
  int64_t used[kNumKinds] = {0, 0};    // referenced (by a sequence or a transfer)
  int64_t cached[kNumKinds] = {0, 0};  // unreferenced but indexed (evictable)
  int64_t shared[kNumKinds] = {0, 0};  // referenced more than once (e.g. by forked sequences)
  int64_t free_blocks[kNumKinds] = {0, 0};  // total − used (cached blocks count as free)
  int64_t prefix_queries = 0;          // MatchPrefix calls
  int64_t prefix_hit_tokens = 0;       // tokens matched in total
  int64_t prefix_hits = 0;             // MatchPrefix calls with num_tokens > 0
  int64_t evictions = 0;               // cached blocks reused for new allocations
};

class BlockPool {
 public:
  // INVALID_ARGUMENT for a layout with no layers or counts < 0; RESOURCE_EXHAUSTED when the
  // memory cannot be allocated. A kind with no layers gets no blocks.
  static absl::StatusOr<std::unique_ptr<BlockPool>> Create(const KvLayout& layout,
                                                           int64_t sliding_blocks,
                                                           int64_t full_blocks);
  virtual ~BlockPool() = default;

  virtual const KvLayout& layout() const = 0;

  // `count` blocks of `kind`, each with reference count 1, contents unspecified. Takes free
  // blocks first, then evicts unreferenced cached blocks, least recently used first (dropping
  // them from the prefix index). RESOURCE_EXHAUSTED (nothing allocated) when too few.
  virtual absl::StatusOr<std::vector<int32_t>> Allocate(LayerKind kind, int count) = 0;
  virtual void Ref(LayerKind kind, std::span<const int32_t> blocks) = 0;
  // Drops one reference each; a block reaching 0 becomes cached if it is in the prefix index,
  // free otherwise.
  virtual void Release(LayerKind kind, std::span<const int32_t> blocks) = 0;
  void Release(const BlockTable& table) {
    Release(LayerKind::kFull, table.full);
    Release(LayerKind::kSliding, table.sliding);
  }

  // Block storage, BlockFloats(kind) floats laid out as KvLayout::RowOffset says. Stable for
  // the pool's lifetime.
  virtual float* BlockData(LayerKind kind, int32_t block) = 0;
  virtual const float* BlockData(LayerKind kind, int32_t block) const = 0;
  // A number Allocate gives `block` each time it hands it out, unique in the process (every
  // pool, every kind; never 0): the same while the block keeps its rows (held, shared, cached and
  // matched again), another once it is allocated afresh. 0 for a block never allocated or an id
  // outside the pool.
  virtual uint64_t AllocationId(LayerKind kind, int32_t block) const = 0;

  // Longest cached prefix of `tokens` usable by a new sequence: k whole blocks with every full
  // block 0..k−1 indexed and sliding blocks covering positions [SlidingKeepFrom(k·B), k·B)
  // indexed. Takes a reference on each returned block and marks them recently used.
  virtual PrefixMatch MatchPrefix(std::span<const int32_t> tokens) = 0;
  // Indexes the whole blocks of a sequence whose first `num_tokens` positions are `tokens`
  // (positions ≥ num_tokens are ignored): entry i maps the hash chain of blocks 0..i to the full
  // block i and, if the table still holds it, the sliding block i. Blocks already indexed under
  // the same hash keep the existing entry.
  virtual void InsertPrefix(std::span<const int32_t> tokens, const BlockTable& table) = 0;

  virtual PoolStats stats() const = 0;
};

}  // namespace dgserve::kv
