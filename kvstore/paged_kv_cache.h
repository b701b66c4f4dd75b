// The engine's KvCache interface over the block pool: one sequence's block table. Sliding
// layers release blocks that fall out of the window on Commit.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/model/kv_cache.h"
#include "kvstore/block_pool.h"

namespace dgserve::kv {

class PagedKvCache final : public KvCache {
 public:
  // An empty sequence that may grow to max_tokens positions (RESOURCE_EXHAUSTED beyond).
  PagedKvCache(BlockPool* pool, int max_tokens);
  // A sequence starting with a cached prefix (takes over the match's references).
  static std::unique_ptr<PagedKvCache> FromPrefix(BlockPool* pool, PrefixMatch match,
                                                  int max_tokens);
  // A sequence of `num_tokens` committed positions whose blocks were filled elsewhere (a KV
  // transfer); takes over the table's references. The table must cover the positions the
  // layout needs (all full blocks, sliding blocks from SlidingKeepFrom(num_tokens)).
  static std::unique_ptr<PagedKvCache> Adopt(BlockPool* pool, BlockTable table, int num_tokens,
                                             int max_tokens);
  // A second sequence with the same committed positions, for parallel samples of one prompt:
  // every whole block is shared by reference (one more reference each, no copy); the partially
  // filled last block of each kind, which later commits append to, is copied into a new block
  // (copy-on-write at fork time). A reservation in flight is not part of the fork.
  // RESOURCE_EXHAUSTED (nothing taken) when the pool cannot supply the copies;
  // FAILED_PRECONDITION while host_rows_stale() (sync the cache to the host first).
  absl::StatusOr<std::unique_ptr<PagedKvCache>> Fork() const;
  ~PagedKvCache() override;  // releases every block
  PagedKvCache(const PagedKvCache&) = delete;
  PagedKvCache& operator=(const PagedKvCache&) = delete;

  int num_tokens() const override { return num_tokens_; }
  // Allocates the blocks for `count` more positions (RESOURCE_EXHAUSTED and no change when the
  // pool or max_tokens cannot take them).
  absl::Status Reserve(int count) override;
  float* MutableKeyRow(int layer, int pos) override;
  float* MutableValueRow(int layer, int pos) override;
  const float* KeyRow(int layer, int pos) const override;
  const float* ValueRow(int layer, int pos) const override;
  // Commits reserved positions and releases sliding blocks wholly before
  // SlidingKeepFrom(num_tokens) − block_size (one spare block is kept so that a prefix ending
  // at the last whole block stays usable from the prefix index).
  void Commit(int count) override;
  // Where Commit's release leaves the sliding blocks once `num_tokens` positions are committed:
  // the first position of the block holding SlidingKeepFrom(num_tokens) − block_size (one spare
  // block before the window), 0 while that is not positive.
  int SlidingRetainedFrom(int num_tokens) const override;
  // sliding_window + 2·block_size − 2: the window's W − 1 rows, the spare block and the partial
  // blocks at both ends.
  int MaxSlidingRowsKept() const override;
  // The BlockPool::AllocationId of the block holding committed position `pos` of the full or
  // the sliding layers (blocks shared by reference give the same value); 0 for a position not
  // committed, outside the retained sliding window, or of a kind with no layers.
  uint64_t SharedRowsId(bool full, int pos) const override;

  const BlockTable& table() const { return table_; }
  BlockPool* pool() const { return pool_; }
  int max_tokens() const { return max_tokens_; }
  int reserved() const { return reserved_; }

 private:
  float* Row(int layer, int pos, bool value) const;

  BlockPool* pool_;
  int max_tokens_;
  int num_tokens_ = 0;
  int reserved_ = 0;
  BlockTable table_;
};

}  // namespace dgserve::kv
