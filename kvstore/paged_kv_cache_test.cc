// PagedKvCache against ContiguousKvCache on the real CPU backend (tiny random model): the same
// encoder chunks and decoder passes give bit-identical K/V rows, logits and denoise rows, while
// sliding blocks that fall out of the window go back to the pool.
#include "kvstore/paged_kv_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "common/testing/status_matchers.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/random_checkpoint.h"
#include "kvstore/test_util.h"

namespace dgserve::kv {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

constexpr int S = 0, F = 1;
constexpr int kBlock = 4;

class KvPagedCacheTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const fs::path dir =
        fs::temp_directory_path() / ("dgserve_kvstore_paged_test_" + std::to_string(::getpid()));
    ASSERT_THAT(WriteRandomCheckpoint(testing::MixedConfig(), GenerationConfig(), 7, dir.string()),
                IsOk());
    auto ckpt = LoadCheckpoint(dir.string());
    fs::remove_all(dir);
    ASSERT_THAT(ckpt, IsOk());
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() { delete checkpoint_; }

  void SetUp() override {
    ASSERT_NE(checkpoint_, nullptr);
    layout_ = KvLayout::FromConfig(config(), kBlock, "mixed");
    auto pool = BlockPool::Create(layout_, 64, 64);
    ASSERT_THAT(pool, IsOk());
    pool_ = std::move(*pool);
    backend_ = CreateCpuBackend(config(), checkpoint_->weights);
  }

  const ModelConfig& config() const { return checkpoint_->config; }
  std::vector<int32_t> Prompt(int n) const {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = (i * 37 + 11) % config().vocab_size;
    return p;
  }
  void Encode(KvCache& kv, std::span<const int32_t> tokens) {
    EncodeInput in{tokens, &kv};
    ASSERT_THAT(backend_->Encode({&in, 1}), IsOk());
  }
  std::vector<float> Logits(const KvCache& kv, const std::vector<int32_t>& canvas) {
    std::vector<float> logits(canvas.size() * config().vocab_size);
    DecodeInput in{canvas, nullptr, &kv, logits.data()};
    EXPECT_THAT(backend_->Decode({&in, 1}), IsOk());
    return logits;
  }
  struct Step {
    std::vector<RowResult> rows;
    std::vector<float> next_soft;
  };
  Step Denoise(const KvCache& kv, const std::vector<int32_t>& canvas, const float* sc) {
    const int C = int(canvas.size());
    Step out{std::vector<RowResult>(C), std::vector<float>(size_t(C) * config().hidden_size)};
    std::vector<float> uniforms(C);
    for (int i = 0; i < C; ++i) uniforms[i] = float(i) / C + 0.013f;
    DenoiseStepInput in;
    in.canvas = canvas;
    in.sc_soft = sc;
    in.kv = &kv;
    in.temperature = 0.7f;
    in.uniforms = uniforms;
    in.rows = out.rows.data();
    in.next_soft = out.next_soft.data();
    EXPECT_THAT(backend_->DenoiseStep({&in, 1}), IsOk());
    return out;
  }
  // Bit-exact comparison of every row the model may still read.
  void ExpectSameRows(const KvCache& want, const KvCache& got) {
    ASSERT_EQ(want.num_tokens(), got.num_tokens());
    const int n = got.num_tokens();
    for (int l = 0; l < config().num_layers; ++l) {
      const size_t bytes = sizeof(float) * config().KvHeads(l) * config().HeadDim(l);
      const int from = config().IsFull(l) ? 0 : layout_.SlidingKeepFrom(n);
      for (int p = from; p < n; ++p) {
        ASSERT_EQ(std::memcmp(want.KeyRow(l, p), got.KeyRow(l, p), bytes), 0) << l << " " << p;
        ASSERT_EQ(std::memcmp(want.ValueRow(l, p), got.ValueRow(l, p), bytes), 0) << l << " " << p;
      }
    }
  }
  // Sliding blocks a sequence of n committed tokens keeps: all but those wholly before
  // SlidingKeepFrom(n) − block_size.
  int RetainedSliding(int n) const {
    const int released = std::max(0, layout_.SlidingKeepFrom(n) / kBlock - 1);
    return layout_.BlocksFor(n) - released;
  }

  static Checkpoint* checkpoint_;
  KvLayout layout_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<ModelBackend> backend_;
};
Checkpoint* KvPagedCacheTest::checkpoint_ = nullptr;

TEST_F(KvPagedCacheTest, MatchesContiguousBitForBit) {
  const int C = config().canvas_length, D = config().hidden_size;
  const std::vector<int32_t> prompt = Prompt(29);  // W = 6, blocks of 4
  ContiguousKvCache want(config(), 256);
  {
    PagedKvCache got(pool_.get(), 256);
    int at = 0;
    for (int n : {5, 1, 13, 10}) {
      Encode(want, std::span<const int32_t>(prompt).subspan(at, n));
      Encode(got, std::span<const int32_t>(prompt).subspan(at, n));
      at += n;
      ExpectSameRows(want, got);
      const PoolStats st = pool_->stats();
      EXPECT_EQ(st.used[F], layout_.BlocksFor(at)) << at;
      EXPECT_EQ(st.used[S], RetainedSliding(at)) << at;
      EXPECT_EQ(got.table().first_sliding_block, layout_.BlocksFor(at) - RetainedSliding(at));
      // What the cache says it keeps is where its sliding blocks start.
      EXPECT_EQ(got.SlidingRetainedFrom(at), got.table().first_sliding_block * kBlock) << at;
    }
    // 29 tokens: 8 full blocks; sliding layers need [24, 29): blocks 6, 7, plus the spare 5.
    EXPECT_EQ(pool_->stats().used[S], 3);
    EXPECT_EQ(got.table().first_sliding_block, 5);
    EXPECT_EQ(got.SlidingRetainedFrom(29), 20);
    // Before the window's start passes a spare block nothing is released: 6 tokens keep
    // [1, 6), 9 tokens [4, 9) (limit 0: 0), 13 tokens [8, 13) (limit 4: block 1 on).
    EXPECT_EQ(got.SlidingRetainedFrom(6), 0);
    EXPECT_EQ(got.SlidingRetainedFrom(9), 0);
    EXPECT_EQ(got.SlidingRetainedFrom(13), 4);
    EXPECT_EQ(want.SlidingRetainedFrom(29), 24);
    EXPECT_EQ(want.SlidingRetainedFrom(3), 0);
    // The bound a device backend sizes its sliding rings by: the most rows kept at any count.
    int most_paged = 0, most_contiguous = 0;
    for (int n = 0; n < 200; ++n) {
      most_paged = std::max(most_paged, n - got.SlidingRetainedFrom(n));
      most_contiguous = std::max(most_contiguous, n - want.SlidingRetainedFrom(n));
    }
    EXPECT_EQ(most_paged, 12);  // at n = 12 (nothing released yet), 16, 20, …
    EXPECT_EQ(got.MaxSlidingRowsKept(), 12);
    EXPECT_EQ(most_contiguous, 5);
    EXPECT_EQ(want.MaxSlidingRowsKept(), 5);

    std::vector<int32_t> canvas(C);
    for (int i = 0; i < C; ++i) canvas[i] = (i * 131 + 17) % config().vocab_size;
    const std::vector<float> lw = Logits(want, canvas), lg = Logits(got, canvas);
    ASSERT_EQ(lw.size(), lg.size());
    EXPECT_EQ(std::memcmp(lw.data(), lg.data(), lw.size() * sizeof(float)), 0);

    std::vector<float> sc(size_t(C) * D);
    for (size_t i = 0; i < sc.size(); ++i) sc[i] = std::sin(0.37f * float(i));
    for (const float* soft : std::vector<const float*>{nullptr, sc.data()}) {
      const Step sw = Denoise(want, canvas, soft), sg = Denoise(got, canvas, soft);
      for (int r = 0; r < C; ++r) {
        EXPECT_EQ(sw.rows[r].argmax, sg.rows[r].argmax) << r;
        EXPECT_EQ(sw.rows[r].sampled, sg.rows[r].sampled) << r;
        EXPECT_EQ(std::memcmp(&sw.rows[r].entropy, &sg.rows[r].entropy, sizeof(float)), 0) << r;
        EXPECT_EQ(std::memcmp(&sw.rows[r].lse, &sg.rows[r].lse, sizeof(float)), 0) << r;
      }
      EXPECT_EQ(std::memcmp(sw.next_soft.data(), sg.next_soft.data(), sw.next_soft.size() * 4), 0);
    }

    // Commit the canvas as context (the next diffusion block), then decode again.
    Encode(want, canvas);
    Encode(got, canvas);
    ExpectSameRows(want, got);
    EXPECT_EQ(pool_->stats().used[S], RetainedSliding(29 + C));
    EXPECT_EQ(pool_->stats().used[F], layout_.BlocksFor(29 + C));
    const std::vector<float> lw2 = Logits(want, canvas), lg2 = Logits(got, canvas);
    EXPECT_EQ(std::memcmp(lw2.data(), lg2.data(), lw2.size() * sizeof(float)), 0);
  }
  // Destruction releases everything.
  const PoolStats st = pool_->stats();
  EXPECT_EQ(st.used[S], 0);
  EXPECT_EQ(st.used[F], 0);
  EXPECT_EQ(st.free_blocks[S], 64);
  EXPECT_EQ(st.free_blocks[F], 64);
}

TEST_F(KvPagedCacheTest, CachedPrefixGivesTheSameResult) {
  const int C = config().canvas_length;
  const std::vector<int32_t> prompt = Prompt(29);
  const auto chunk = [&](int at, int n) { return std::span<const int32_t>(prompt).subspan(at, n); };
  ContiguousKvCache want(config(), 256);
  for (auto [at, n] : {std::pair{0, 13}, {13, 15}, {28, 1}}) Encode(want, chunk(at, n));
  {
    PagedKvCache first(pool_.get(), 256);
    Encode(first, chunk(0, 13));
    Encode(first, chunk(13, 15));  // 28 tokens = 7 whole blocks
    pool_->InsertPrefix(std::span<const int32_t>(prompt).first(28), first.table());
  }
  EXPECT_EQ(pool_->stats().used[F], 0);
  EXPECT_EQ(pool_->stats().cached[F], 7);
  PrefixMatch match = pool_->MatchPrefix(prompt);
  ASSERT_EQ(match.num_tokens, 28);
  {
    auto got = PagedKvCache::FromPrefix(pool_.get(), std::move(match), 256);
    EXPECT_EQ(got->num_tokens(), 28);
    Encode(*got, chunk(28, 1));
    ExpectSameRows(want, *got);
    std::vector<int32_t> canvas(C);
    for (int i = 0; i < C; ++i) canvas[i] = (i * 53 + 3) % config().vocab_size;
    const std::vector<float> lw = Logits(want, canvas), lg = Logits(*got, canvas);
    EXPECT_EQ(std::memcmp(lw.data(), lg.data(), lw.size() * sizeof(float)), 0);
  }
  EXPECT_EQ(pool_->stats().used[F], 0);
  EXPECT_EQ(pool_->stats().used[S], 0);
}

TEST_F(KvPagedCacheTest, ReserveReplacesUncommittedReservation) {
  PagedKvCache kv(pool_.get(), 40);
  ASSERT_THAT(kv.Reserve(10), IsOk());  // 3 blocks of each kind
  EXPECT_EQ(pool_->stats().used[F], 3);
  EXPECT_EQ(pool_->stats().used[S], 3);
  ASSERT_THAT(kv.Reserve(3), IsOk());  // replaces it: 1 block
  EXPECT_EQ(kv.reserved(), 3);
  EXPECT_EQ(pool_->stats().used[F], 1);
  EXPECT_EQ(pool_->stats().used[S], 1);
  kv.Commit(5);  // commits at most the reservation
  EXPECT_EQ(kv.num_tokens(), 3);
  EXPECT_EQ(kv.reserved(), 0);
  // Beyond max_tokens: RESOURCE_EXHAUSTED, nothing changes.
  EXPECT_THAT(kv.Reserve(38), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool_->stats().used[F], 1);
  EXPECT_EQ(kv.num_tokens(), 3);
  // Rows written through one reservation read back after Commit.
  testing::AppendPattern(kv, layout_, 9, 3);
  EXPECT_EQ(kv.num_tokens(), 12);
}

TEST_F(KvPagedCacheTest, PoolExhaustionChangesNothing) {
  auto small = BlockPool::Create(layout_, 2, 3);
  ASSERT_THAT(small, IsOk());
  BlockPool& pool = **small;
  PagedKvCache kv(&pool, 1000);
  testing::AppendPattern(kv, layout_, 8, 1);  // 2 blocks of each kind
  // 4 more positions need a third sliding block: the full block is not kept either.
  EXPECT_THAT(kv.Reserve(4), StatusIs(absl::StatusCode::kResourceExhausted));
  EXPECT_EQ(pool.stats().used[F], 2);
  EXPECT_EQ(pool.stats().used[S], 2);
  EXPECT_EQ(kv.num_tokens(), 8);
  EXPECT_EQ(kv.reserved(), 0);
  testing::ExpectPattern(kv, layout_, 1);
}

TEST_F(KvPagedCacheTest, AdoptTakesOverTheTable) {
  PagedKvCache src(pool_.get(), 100);
  testing::AppendPattern(src, layout_, 17, 5);
  // Copy src's blocks into a fresh table, as a transfer would.
  BlockTable t;
  t.full = *pool_->Allocate(LayerKind::kFull, int(src.table().full.size()));
  t.first_sliding_block = src.table().first_sliding_block;
  t.sliding = *pool_->Allocate(LayerKind::kSliding, int(src.table().sliding.size()));
  for (size_t i = 0; i < t.full.size(); ++i) {
    std::memcpy(pool_->BlockData(LayerKind::kFull, t.full[i]),
                pool_->BlockData(LayerKind::kFull, src.table().full[i]),
                layout_.BlockBytes(LayerKind::kFull));
  }
  for (size_t i = 0; i < t.sliding.size(); ++i) {
    std::memcpy(pool_->BlockData(LayerKind::kSliding, t.sliding[i]),
                pool_->BlockData(LayerKind::kSliding, src.table().sliding[i]),
                layout_.BlockBytes(LayerKind::kSliding));
  }
  const PoolStats before = pool_->stats();
  {
    auto kv = PagedKvCache::Adopt(pool_.get(), t, 17, 100);
    EXPECT_EQ(pool_->stats().used[F], before.used[F]);  // references taken over, not added
    testing::ExpectPattern(*kv, layout_, 5);
    testing::AppendPattern(*kv, layout_, 6, 5);  // and it grows like any sequence
    testing::ExpectPattern(*kv, layout_, 5);
  }
  EXPECT_EQ(pool_->stats().used[F], int64_t(src.table().full.size()));
  EXPECT_EQ(pool_->stats().used[S], int64_t(src.table().sliding.size()));
}

// Parallel samples of one prompt: a fork shares every whole block by reference and copies only
// the partial last block, so appending to one sequence never changes the other's rows.
TEST_F(KvPagedCacheTest, ForkSharesWholeBlocksAndCopiesThePartialOne) {
  const int C = config().canvas_length;
  const std::vector<int32_t> prompt = Prompt(29);  // 7 whole blocks of 4 + 1 token
  std::vector<int32_t> a(C), b(C);
  for (int i = 0; i < C; ++i) {
    a[i] = (i * 131 + 17) % config().vocab_size;
    b[i] = (i * 71 + 5) % config().vocab_size;
  }
  ContiguousKvCache want_a(config(), 256), want_b(config(), 256);
  Encode(want_a, prompt);
  Encode(want_a, a);
  Encode(want_b, prompt);
  Encode(want_b, b);
  {
    PagedKvCache parent(pool_.get(), 256);
    Encode(parent, prompt);
    // Full blocks 0..7; sliding blocks 5, 6, 7 (SlidingKeepFrom(29) = 24, one spare).
    ASSERT_EQ(pool_->stats().used[F], 8);
    ASSERT_EQ(pool_->stats().used[S], 3);
    auto child = parent.Fork();
    ASSERT_THAT(child, IsOk());
    PoolStats st = pool_->stats();
    EXPECT_EQ(st.used[F], 8 + 1);  // the 7 whole blocks once, the partial block twice
    EXPECT_EQ(st.shared[F], 7);
    EXPECT_EQ(st.used[S], 3 + 1);
    EXPECT_EQ(st.shared[S], 2);
    EXPECT_EQ((*child)->num_tokens(), 29);
    EXPECT_EQ((*child)->table().first_sliding_block, 5);
    for (int i = 0; i < 7; ++i) EXPECT_EQ((*child)->table().full[i], parent.table().full[i]);
    EXPECT_NE((*child)->table().full[7], parent.table().full[7]);
    // Their row identities (KvCache::SharedRowsId): equal on the shared blocks, not on the
    // copied one; none outside the committed positions or behind the retained sliding blocks.
    for (int p = 0; p < 29; ++p) {
      for (bool full : {true, false}) {
        if (!full && p < 20) {
          EXPECT_EQ(parent.SharedRowsId(full, p), 0u) << p;
          continue;
        }
        const uint64_t id = parent.SharedRowsId(full, p);
        EXPECT_NE(id, 0u) << full << " " << p;
        if (p < 28) {
          EXPECT_EQ((*child)->SharedRowsId(full, p), id) << full << " " << p;
        } else {
          EXPECT_NE((*child)->SharedRowsId(full, p), id) << full << " " << p;
          EXPECT_NE((*child)->SharedRowsId(full, p), 0u) << full << " " << p;
        }
      }
      // One block's positions share one identity; the next block's is another.
      if (p % 4 != 0) EXPECT_EQ(parent.SharedRowsId(true, p), parent.SharedRowsId(true, p - 1));
      if (p % 4 == 0 && p > 0) {
        EXPECT_NE(parent.SharedRowsId(true, p), parent.SharedRowsId(true, p - 1)) << p;
      }
    }
    EXPECT_EQ(parent.SharedRowsId(true, 29), 0u);
    EXPECT_EQ(parent.SharedRowsId(true, -1), 0u);
    ContiguousKvCache contiguous(config(), 64);
    EXPECT_EQ(contiguous.SharedRowsId(true, 0), 0u);
    // Different canvases appended to each: each equals its own sequence computed alone.
    Encode(**child, a);
    Encode(parent, b);
    ExpectSameRows(want_a, **child);
    ExpectSameRows(want_b, parent);
    child->reset();
    st = pool_->stats();
    EXPECT_EQ(st.shared[F], 0);
    EXPECT_EQ(st.shared[S], 0);
    EXPECT_EQ(st.used[F], layout_.BlocksFor(29 + C));
  }
  EXPECT_EQ(pool_->stats().used[F], 0);
  EXPECT_EQ(pool_->stats().used[S], 0);

  // A prompt of whole blocks is forked without any copy.
  PagedKvCache whole(pool_.get(), 256);
  Encode(whole, std::span<const int32_t>(prompt).first(28));
  const PoolStats before = pool_->stats();
  auto f1 = whole.Fork(), f2 = whole.Fork();
  ASSERT_THAT(f1, IsOk());
  ASSERT_THAT(f2, IsOk());
  EXPECT_EQ(pool_->stats().used[F], before.used[F]);
  EXPECT_EQ(pool_->stats().used[S], before.used[S]);
  EXPECT_EQ(pool_->stats().shared[F], 7);
  // A cache whose newest rows are still in a device backend's memory is not forked: the copy
  // of its partial block would take stale host rows.
  whole.set_host_rows_stale(true);
  EXPECT_THAT(whole.Fork(), StatusIs(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(pool_->stats().shared[F], 7);
  whole.set_host_rows_stale(false);
  EXPECT_THAT(whole.Fork(), IsOk());
}

TEST_F(KvPagedCacheTest, ForkWithoutRoomForTheCopyTakesNothing) {
  auto small = BlockPool::Create(layout_, 8, 3);
  ASSERT_THAT(small, IsOk());
  BlockPool& pool = **small;
  PagedKvCache kv(&pool, 1000);
  testing::AppendPattern(kv, layout_, 9, 1);  // 3 full blocks, the last one partial
  const PoolStats before = pool.stats();
  EXPECT_THAT(kv.Fork(), StatusIs(absl::StatusCode::kResourceExhausted));
  const PoolStats after = pool.stats();
  for (int k : {S, F}) {
    EXPECT_EQ(after.used[k], before.used[k]) << k;
    EXPECT_EQ(after.shared[k], 0) << k;
  }
  testing::ExpectPattern(kv, layout_, 1);
}

}  // namespace
}  // namespace dgserve::kv
