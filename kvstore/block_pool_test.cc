#include "kvstore/block_pool.h"

#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <thread>

#include "common/testing/status_matchers.h"
#include "kvstore/test_util.h"

namespace dgserve::kv {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

constexpr LayerKind kS = LayerKind::kSliding;
constexpr LayerKind kF = LayerKind::kFull;
constexpr int S = 0, F = 1;

KvLayout MixedLayout() { return KvLayout::FromConfig(testing::MixedConfig(), 4, "m"); }  // W=6

std::unique_ptr<BlockPool> MakePool(int64_t sliding, int64_t full) {
  auto pool = BlockPool::Create(MixedLayout(), sliding, full);
  EXPECT_THAT(pool, IsOk());
  return std::move(*pool);
}

std::vector<int32_t> Tokens(int n, int start = 0) {
  std::vector<int32_t> t(n);
  std::iota(t.begin(), t.end(), start);
  return t;
}

// A table of `full` full blocks and sliding blocks first .. first+sliding−1, freshly allocated.
BlockTable AllocTable(BlockPool& pool, int full, int first, int sliding) {
  BlockTable t;
  t.full = *pool.Allocate(kF, full);
  t.first_sliding_block = first;
  t.sliding = *pool.Allocate(kS, sliding);
  return t;
}

TEST(KvBlockPoolTest, CreateValidates) {
  KvLayout empty;
  EXPECT_THAT(BlockPool::Create(empty, 4, 4), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(BlockPool::Create(MixedLayout(), -1, 4),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // Memory that cannot exist: RESOURCE_EXHAUSTED, not a crash.
  KvLayout huge = MixedLayout();
  huge.row_width[F] = 1 << 30;
  EXPECT_THAT(BlockPool::Create(huge, 1, int64_t(1) << 30),
              StatusIs(absl::StatusCode::kResourceExhausted));
  // A kind without layers gets no blocks.
  ModelConfig c = testing::MixedConfig();
  c.layer_types.assign(c.num_layers, LayerType::kFull);
  auto pool = BlockPool::Create(KvLayout::FromConfig(c, 4, "f"), 10, 3);
  ASSERT_THAT(pool, IsOk());
  EXPECT_EQ((*pool)->stats().total[S], 0);
  EXPECT_EQ((*pool)->stats().total[F], 3);
  EXPECT_THAT((*pool)->Allocate(kS, 1), StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(KvBlockPoolTest, AllocateReleaseAndRefcounts) {
  auto pool = MakePool(8, 5);
  auto a = pool->Allocate(kF, 3);
  ASSERT_THAT(a, IsOk());
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ(std::set<int32_t>(a->begin(), a->end()).size(), 3u);
  for (int32_t b : *a) EXPECT_TRUE(b >= 0 && b < 5);
  PoolStats st = pool->stats();
  EXPECT_EQ(st.total[F], 5);
  EXPECT_EQ(st.total[S], 8);
  EXPECT_EQ(st.used[F], 3);
  EXPECT_EQ(st.free_blocks[F], 2);
  EXPECT_EQ(st.used[S], 0);
  // Block storage is distinct and writable.
  const size_t floats = pool->layout().BlockFloats(kF);
  EXPECT_EQ(pool->BlockData(kF, (*a)[1]) - pool->BlockData(kF, (*a)[0]) != 0, true);
  std::fill_n(pool->BlockData(kF, (*a)[0]), floats, 1.5f);
  EXPECT_EQ(pool->BlockData(kF, (*a)[0])[floats - 1], 1.5f);

  // A second reference keeps a block alive through one release.
  pool->Ref(kF, std::span<const int32_t>(a->data(), 1));
  pool->Release(kF, *a);
  st = pool->stats();
  EXPECT_EQ(st.used[F], 1);
  EXPECT_EQ(st.free_blocks[F], 4);
  pool->Release(kF, std::span<const int32_t>(a->data(), 1));
  EXPECT_EQ(pool->stats().used[F], 0);
  EXPECT_EQ(pool->stats().free_blocks[F], 5);
  EXPECT_EQ(pool->stats().cached[F], 0);  // never indexed: back to free, not cached
  // Zero blocks is fine.
  auto none = pool->Allocate(kS, 0);
  ASSERT_THAT(none, IsOk());
  EXPECT_TRUE(none->empty());
}

TEST(KvBlockPoolTest, ExhaustionAllocatesNothing) {
  auto pool = MakePool(8, 5);
  EXPECT_THAT(pool->Allocate(kF, 6), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool->stats().used[F], 0);
  auto a = pool->Allocate(kF, 4);
  ASSERT_THAT(a, IsOk());
  EXPECT_THAT(pool->Allocate(kF, 2), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool->stats().used[F], 4);
  auto b = pool->Allocate(kF, 1);
  ASSERT_THAT(b, IsOk());
  EXPECT_EQ(pool->stats().free_blocks[F], 0);
  pool->Release(kF, *a);
  pool->Release(kF, *b);
  EXPECT_EQ(pool->stats().used[F], 0);
}

TEST(KvBlockPoolTest, PrefixInsertAndMatch) {
  auto pool = MakePool(8, 8);
  const std::vector<int32_t> tokens = Tokens(14);  // 3 whole blocks of 4 + 2 positions
  BlockTable t = AllocTable(*pool, 4, 0, 4);
  pool->InsertPrefix(tokens, t);
  pool->Release(t);
  PoolStats st = pool->stats();
  EXPECT_EQ(st.used[F], 0);
  EXPECT_EQ(st.used[S], 0);
  EXPECT_EQ(st.cached[F], 3);  // whole blocks 0..2 indexed, the partial block 3 free
  EXPECT_EQ(st.cached[S], 3);
  EXPECT_EQ(st.free_blocks[F], 8);

  // The same tokens: 3 blocks; sliding layers need positions [SlidingKeepFrom(12) = 7, 12),
  // i.e. sliding blocks 1 and 2.
  PrefixMatch m = pool->MatchPrefix(tokens);
  EXPECT_EQ(m.num_tokens, 12);
  EXPECT_EQ(m.table.full, std::vector<int32_t>(t.full.begin(), t.full.begin() + 3));
  EXPECT_EQ(m.table.first_sliding_block, 1);
  EXPECT_EQ(m.table.sliding, std::vector<int32_t>(t.sliding.begin() + 1, t.sliding.begin() + 3));
  st = pool->stats();
  EXPECT_EQ(st.used[F], 3);  // references taken
  EXPECT_EQ(st.used[S], 2);
  EXPECT_EQ(st.cached[F], 0);
  EXPECT_EQ(st.cached[S], 1);
  EXPECT_EQ(st.prefix_queries, 1);
  EXPECT_EQ(st.prefix_hits, 1);
  EXPECT_EQ(st.prefix_hit_tokens, 12);

  // A second sequence shares the blocks: two references each.
  PrefixMatch m2 = pool->MatchPrefix(Tokens(20));  // longer query, same first 12 tokens
  EXPECT_EQ(m2.num_tokens, 12);
  EXPECT_EQ(m2.table.full, m.table.full);
  pool->Release(m.table);
  EXPECT_EQ(pool->stats().used[F], 3);  // still referenced by m2
  pool->Release(m2.table);
  EXPECT_EQ(pool->stats().used[F], 0);
  EXPECT_EQ(pool->stats().cached[F], 3);

  // Diverging in block 2: two blocks match (sliding needs [3, 8): blocks 0 and 1).
  std::vector<int32_t> other = tokens;
  other[9] = 99;
  PrefixMatch m3 = pool->MatchPrefix(other);
  EXPECT_EQ(m3.num_tokens, 8);
  EXPECT_EQ(m3.table.first_sliding_block, 0);
  EXPECT_EQ(m3.table.sliding.size(), 2u);
  pool->Release(m3.table);
  // Different first block, or shorter than a block: no hit.
  other[0] = 77;
  EXPECT_EQ(pool->MatchPrefix(other).num_tokens, 0);
  EXPECT_EQ(pool->MatchPrefix(Tokens(3)).num_tokens, 0);
  st = pool->stats();
  EXPECT_EQ(st.prefix_queries, 5);
  EXPECT_EQ(st.prefix_hits, 3);
  EXPECT_EQ(st.prefix_hit_tokens, 32);
  EXPECT_EQ(st.used[F], 0);
  EXPECT_EQ(st.used[S], 0);
}

TEST(KvBlockPoolTest, SlidingCoverageRule) {
  auto pool = MakePool(8, 8);
  const std::vector<int32_t> tokens = Tokens(16, 5);
  // A sequence of 16 tokens that kept only sliding blocks 2 and 3.
  BlockTable t = AllocTable(*pool, 4, 2, 2);
  pool->InsertPrefix(tokens, t);
  pool->Release(t);
  // 4 blocks: needs sliding [SlidingKeepFrom(16) = 11, 16) = blocks 2, 3: a hit.
  PrefixMatch m = pool->MatchPrefix(tokens);
  EXPECT_EQ(m.num_tokens, 16);
  EXPECT_EQ(m.table.first_sliding_block, 2);
  EXPECT_EQ(m.table.sliding, t.sliding);
  pool->Release(m.table);
  // 3 blocks: needs [7, 12) = blocks 1, 2; block 1 is gone, and so are the sliding blocks of
  // every shorter prefix: no hit although the full blocks are there.
  EXPECT_EQ(pool->MatchPrefix(std::span<const int32_t>(tokens).first(15)).num_tokens, 0);
  EXPECT_EQ(pool->stats().used[F], 0);
}

TEST(KvBlockPoolTest, LruEvictionOrderDropsIndexEntries) {
  auto pool = MakePool(4, 4);
  const std::vector<int32_t> a = Tokens(4, 100), b = Tokens(4, 200);
  BlockTable ta = AllocTable(*pool, 1, 0, 1);
  pool->InsertPrefix(a, ta);
  pool->Release(ta);
  BlockTable tb = AllocTable(*pool, 1, 0, 1);
  pool->InsertPrefix(b, tb);
  pool->Release(tb);
  EXPECT_EQ(pool->stats().cached[F], 2);
  EXPECT_EQ(pool->stats().cached[S], 2);
  // Touch A: B becomes the least recently used.
  PrefixMatch ma = pool->MatchPrefix(a);
  ASSERT_EQ(ma.num_tokens, 4);
  pool->Release(ma.table);
  // Free blocks go first: no eviction.
  auto x = pool->Allocate(kF, 2);
  ASSERT_THAT(x, IsOk());
  EXPECT_EQ(pool->stats().evictions, 0);
  EXPECT_EQ(pool->stats().cached[F], 2);
  // Then the LRU cached block: B's. Its entry leaves the index (its sliding block is freed).
  auto y = pool->Allocate(kF, 1);
  ASSERT_THAT(y, IsOk());
  EXPECT_EQ((*y)[0], tb.full[0]);
  PoolStats st = pool->stats();
  EXPECT_EQ(st.evictions, 1);
  EXPECT_EQ(st.cached[F], 1);
  EXPECT_EQ(st.cached[S], 1);
  EXPECT_EQ(pool->MatchPrefix(b).num_tokens, 0);
  PrefixMatch again = pool->MatchPrefix(a);
  EXPECT_EQ(again.num_tokens, 4);
  // A referenced block is never evicted: A is now in use, nothing else is left.
  EXPECT_THAT(pool->Allocate(kF, 1), StatusIs(absl::StatusCode::kResourceExhausted));
  pool->Release(again.table);
  auto z = pool->Allocate(kF, 1);
  ASSERT_THAT(z, IsOk());
  EXPECT_EQ((*z)[0], ta.full[0]);
  EXPECT_EQ(pool->stats().evictions, 2);
  EXPECT_EQ(pool->MatchPrefix(a).num_tokens, 0);
  pool->Release(kF, *x);
  pool->Release(kF, *y);
  pool->Release(kF, *z);
  st = pool->stats();
  EXPECT_EQ(st.used[F], 0);
  EXPECT_EQ(st.used[S], 0);
  EXPECT_EQ(st.cached[F], 0);
  EXPECT_EQ(st.cached[S], 0);
}

// AllocationId: a new number at each allocation, unique across kinds; kept while the block keeps
// its rows (released into the cache, matched again); new once the block is handed out afresh.
TEST(KvBlockPoolTest, AllocationIdsNameOneAllocation) {
  auto pool = MakePool(2, 2);
  EXPECT_EQ(pool->AllocationId(kF, 0), 0u);  // never allocated
  EXPECT_EQ(pool->AllocationId(kF, 2), 0u);  // outside the pool
  EXPECT_EQ(pool->AllocationId(kF, -1), 0u);
  const std::vector<int32_t> a = Tokens(4, 100);
  BlockTable ta = AllocTable(*pool, 1, 0, 1);
  const uint64_t full_id = pool->AllocationId(kF, ta.full[0]),
                 sliding_id = pool->AllocationId(kS, ta.sliding[0]);
  EXPECT_NE(full_id, 0u);
  EXPECT_NE(sliding_id, 0u);
  EXPECT_NE(full_id, sliding_id);
  pool->InsertPrefix(a, ta);
  pool->Release(ta);  // cached: its rows stay
  EXPECT_EQ(pool->AllocationId(kF, ta.full[0]), full_id);
  PrefixMatch m = pool->MatchPrefix(a);
  ASSERT_EQ(m.num_tokens, 4);
  ASSERT_EQ(m.table.full[0], ta.full[0]);
  EXPECT_EQ(pool->AllocationId(kF, ta.full[0]), full_id);
  pool->Ref(kF, m.table.full);  // a second holder: the same rows
  EXPECT_EQ(pool->AllocationId(kF, ta.full[0]), full_id);
  pool->Release(kF, m.table.full);
  pool->Release(m.table);
  // Both full blocks handed out: the free one, then the cached one evicted. Each gets a number
  // never given before.
  auto x = pool->Allocate(kF, 2);
  ASSERT_THAT(x, IsOk());
  std::set<uint64_t> ids = {full_id, sliding_id};
  for (int32_t b : *x) EXPECT_TRUE(ids.insert(pool->AllocationId(kF, b)).second) << b;
  EXPECT_NE(pool->AllocationId(kF, ta.full[0]), full_id);
  // Another pool's blocks: other numbers (a backend may hold caches of both).
  auto other = MakePool(2, 2);
  auto y = other->Allocate(kF, 2);
  ASSERT_THAT(y, IsOk());
  for (int32_t b : *y) EXPECT_TRUE(ids.insert(other->AllocationId(kF, b)).second) << b;
  other->Release(kF, *y);
  pool->Release(kF, *x);
}

TEST(KvBlockPoolTest, ReinsertingKeepsExistingEntries) {
  auto pool = MakePool(8, 8);
  const std::vector<int32_t> tokens = Tokens(8);
  BlockTable t1 = AllocTable(*pool, 2, 0, 2);
  pool->InsertPrefix(tokens, t1);
  BlockTable t2 = AllocTable(*pool, 2, 0, 2);  // same tokens computed again elsewhere
  pool->InsertPrefix(tokens, t2);
  pool->Release(t2);
  EXPECT_EQ(pool->stats().cached[F], 0);  // t2's blocks were not indexed: free again
  pool->Release(t1);
  EXPECT_EQ(pool->stats().cached[F], 2);
  PrefixMatch m = pool->MatchPrefix(tokens);
  EXPECT_EQ(m.table.full, t1.full);
  pool->Release(m.table);
}

TEST(KvBlockPoolTest, ConcurrentUseKeepsCountsConsistent) {
  auto pool = MakePool(64, 64);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      for (int round = 0; round < 300; ++round) {
        // Two threads share each prompt, so matches and inserts race on the same entries.
        const std::vector<int32_t> tokens = Tokens(8 + 4 * (round % 3), 1000 * (t % 2));
        PrefixMatch m = pool->MatchPrefix(tokens);
        auto full = pool->Allocate(kF, 2);
        auto sliding = pool->Allocate(kS, 2);
        if (full.ok() && sliding.ok()) {
          BlockTable table = m.table;
          table.full.insert(table.full.end(), full->begin(), full->end());
          table.sliding.insert(table.sliding.end(), sliding->begin(), sliding->end());
          pool->InsertPrefix(tokens, table);
          pool->Release(table);
        } else {
          if (full.ok()) pool->Release(kF, *full);
          if (sliding.ok()) pool->Release(kS, *sliding);
          pool->Release(m.table);
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  const PoolStats st = pool->stats();
  EXPECT_EQ(st.used[F], 0);
  EXPECT_EQ(st.used[S], 0);
  EXPECT_EQ(st.prefix_queries, 4 * 300);
  EXPECT_GT(st.prefix_hits, 0);
  EXPECT_EQ(st.free_blocks[F], 64);
}

}  // namespace
}  // namespace dgserve::kv
