// Device K/V blocks shared between sequences (CudaBackendOptions::share_kv_blocks, issue 34
// item 1: the prefix cache reading device blocks; label `gpu`, and `gpu-emu` under the
// emulation; built into cuda_backend_test / cuda_backend_emu_test beside
// cuda_prefix_cache_test.cc). On the tiny-v512 random checkpoint (W = 8) and kvstore's paged
// pool in blocks of 4 tokens, with device blocks of 4 and of 8 (two host blocks each), against a
// backend with the same options and no sharing (every sequence uploads its own rows):
//   - a prefix hit takes the device blocks of the prompt it shares (live, or cached after its
//     cache is gone) and uploads only the rows of its last partial device block (byte counts by
//     hand), with the same logits bit for bit;
//   - a fork (parallel samples) takes its parent's whole blocks; both then append their own rows
//     without disturbing each other;
//   - a block is shared only when every one of its positions has the same host identity (a
//     device block of 8 whose second host block differs is uploaded), and only when every row
//     of it was written (a sliding block the upload filled from the window's start on is not
//     registered): each of these, broken on purpose, gives other logits here;
//   - a registered block moved by a compaction of its pool at the bound is found at its new id;
//     a compaction drops only the least recently released cached blocks it needs (counts and a
//     hit on the prompt released last by hand).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "kvstore/block_pool.h"
#include "kvstore/kv_layout.h"
#include "kvstore/paged_kv_cache.h"

namespace dgserve::kv {
namespace {

constexpr int kHostBlock = 4;   // kvstore's block: tokens per host block
constexpr int kMaxTokens = 64;  // every cache's limit
constexpr int kCanvas = 8;      // canvas rows decoded (the emulation is slow)

struct SharingMode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  bool own_projections;
  bool tensor_core_attention;  // bf16 device blocks on the full layers of this shape
  int kv_block_size;           // CudaBackendOptions::kv_block_size: device positions per block
};
void PrintTo(const SharingMode& m, std::ostream* os) { *os << m.name; }

class CudaKvSharingTest : public backend_testing::CpuGpuTest<CudaKvSharingTest, SharingMode> {
 public:
  static std::unique_ptr<Checkpoint> MakeCheckpoint() {
    return backend_testing::TinyV512Checkpoint("cuda_kv_sharing_test");
  }

 protected:
  CudaBackendOptions GpuOptions() const override {
    CudaBackendOptions options = CpuGpuTest::GpuOptions();
    options.tensor_core_attention = GetParam().tensor_core_attention;
    options.kv_block_size = GetParam().kv_block_size;
    return options;
  }
  void SetUp() override {
    CpuGpuTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    ASSERT_TRUE(GpuOptions().share_kv_blocks);  // gpu_: the default
    ASSERT_EQ(config().sliding_window, 8);
    CudaBackendOptions plain_options = GpuOptions();
    plain_options.share_kv_blocks = false;
    auto plain = CreateCudaBackend(config(), checkpoint_->weights, plain_options);
    ASSERT_TRUE(plain.ok()) << plain.status();
    plain_ = std::move(*plain);
    layout_ = KvLayout::FromConfig(config(), kHostBlock, "tiny-v512");
    auto pool = BlockPool::Create(layout_, 256, 256);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    canvas_ = Tokens(kCanvas, 9);
  }
  void TearDown() override {
    // The backends' mirrors name caches of pool_.
    plain_.reset();
    gpu_.reset();
    pool_.reset();
    CpuGpuTest::TearDown();
  }

  // Device bytes of `full` rows of every full layer and `sliding` rows of every sliding layer,
  // K and V, as the device blocks store them (bf16 on the tensor-core layers: head_dim a
  // multiple of 32).
  int64_t DeviceBytes(int full, int sliding) const {
    int64_t bytes = 0;
    for (int l = 0; l < config().num_layers; ++l) {
      const bool bf16 = GetParam().tensor_core_attention && config().HeadDim(l) % 32 == 0;
      bytes += 2 * int64_t(config().IsFull(l) ? full : sliding) * config().KvHeads(l) *
               config().HeadDim(l) * (bf16 ? 2 : 4);
    }
    return bytes;
  }
  int64_t UploadBytes() const { return GetCudaKvCopyStats(*gpu_)->upload_bytes; }
  int64_t Taken() const { return GetCudaKvPoolStats(*gpu_)->shared_blocks_taken; }
  // The logits over canvas_ from gpu_ and from plain_ equal bit for bit (plain_ uploads every
  // row the cache's host arrays hold: the cache's host rows must be current).
  void ExpectPlainLogits(const KvCache& kv, const std::vector<float>& got,
                         const std::string& what) {
    const std::vector<float> want = Logits(*plain_, kv, canvas_);
    ASSERT_EQ(want.size(), got.size()) << what;
    size_t differ = 0;
    for (size_t i = 0; i < want.size(); ++i) differ += std::memcmp(&want[i], &got[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << what << ": logits differ at " << differ << " of " << want.size();
  }
  // A prompt of `n` tokens encoded on gpu_ one host block per pass, synced and indexed as its
  // blocks fill (the prefill worker's chunks in small).
  // (On `gpu`, gpu_ when null.)
  std::unique_ptr<PagedKvCache> EncodePrompt(const std::vector<int32_t>& prompt,
                                             ModelBackend* gpu = nullptr) {
    ModelBackend& b = gpu != nullptr ? *gpu : *gpu_;
    auto kv = std::make_unique<PagedKvCache>(pool_.get(), kMaxTokens);
    for (size_t at = 0; at < prompt.size(); at += kHostBlock) {
      const size_t n = std::min<size_t>(kHostBlock, prompt.size() - at);
      Encode(b, *kv, std::vector<int32_t>(prompt.begin() + at, prompt.begin() + at + n));
      EXPECT_TRUE(b.SyncKvToHost(*kv).ok());
      pool_->InsertPrefix(std::span<const int32_t>(prompt).first(at + n), kv->table());
    }
    return kv;
  }
  // A's first `shared` tokens, then others.
  std::vector<int32_t> SharingPrompt(const std::vector<int32_t>& a, int shared) const {
    std::vector<int32_t> b(a.begin(), a.begin() + shared);
    const std::vector<int32_t> own = Tokens(6, 40 + shared);
    b.insert(b.end(), own.begin(), own.end());
    if (b[shared] == a[shared]) b[shared] = (b[shared] + 1) % config().vocab_size;
    return b;
  }
  // The hit at `shared` tokens of a prompt indexed in pool_.
  std::unique_ptr<PagedKvCache> Hit(const std::vector<int32_t>& prompt, int shared) {
    PrefixMatch match = pool_->MatchPrefix(prompt);
    EXPECT_EQ(match.num_tokens, shared);
    return PagedKvCache::FromPrefix(pool_.get(), std::move(match), kMaxTokens);
  }

  // Why a test whose block counts at a bound of a few KiB are written for blocks of 4 with
  // bf16 full layers skips ("" where it runs).
  std::string BoundedBlockCountsSkip() const {
    if (!backend_testing::SmallKvGranules()) {
      return "K/V pools of a few KiB: the emulation's granules only";
    }
    if (GetParam().kv_block_size != 4 || !GetParam().tensor_core_attention) {
      return "blocks of 4 with bf16 full layers only (the bound's block counts)";
    }
    return "";
  }

  // A backend bounded at 108 KiB (64 full-layer blocks of 1 KiB, then 11 sliding ones of 4 KiB)
  // holding the cached blocks of five gone 8-token prompts (two of each kind each), released one
  // prompt per pass in the order 2, 0, 4, 1, 3 (not their ids' order), beside `q`, a live 4-token
  // sequence: full pool 64 blocks (1 held, 10 cached, 53 free), sliding pool 11 (1 held, 10 cached,
  // none free). The prompts are indexed in pool_.
  struct CachedPrompts {
    std::unique_ptr<ModelBackend> gpu;
    std::vector<std::vector<int32_t>> prompts;
    std::unique_ptr<ContiguousKvCache> q;
  };
  CachedPrompts CacheFivePrompts() {
    CachedPrompts c;
    CudaBackendOptions bounded = GpuOptions();
    bounded.kv_pool_max_bytes = 64 * 1024 + 11 * 4096;
    auto created = CreateCudaBackend(config(), checkpoint_->weights, bounded);
    EXPECT_TRUE(created.ok()) << created.status();
    if (!created.ok()) return c;
    c.gpu = std::move(*created);
    std::vector<std::unique_ptr<PagedKvCache>> kv;
    for (int i = 0; i < 5; ++i) {
      c.prompts.push_back(Tokens(8, 60 + i));
      kv.push_back(EncodePrompt(c.prompts.back(), c.gpu.get()));
    }
    c.q = std::make_unique<ContiguousKvCache>(config(), 64);
    Encode(*c.gpu, *c.q, Tokens(4, 70));
    for (int i : {2, 0, 4, 1, 3}) {
      kv[i].reset();
      Logits(*c.gpu, *c.q, canvas_);  // a pass: the prompt's mirror goes, its blocks cached
    }
    const CudaKvPoolStats st = GetCudaKvPoolStats(*c.gpu).value();
    EXPECT_EQ(st.full_blocks, 64);
    EXPECT_EQ(st.full_blocks_cached, 10);
    EXPECT_EQ(st.sliding_blocks, 11);
    EXPECT_EQ(st.sliding_blocks_in_use, 1);
    EXPECT_EQ(st.sliding_blocks_cached, 10);
    return c;
  }

  std::unique_ptr<ModelBackend> plain_;
  KvLayout layout_;
  std::unique_ptr<BlockPool> pool_;
  std::vector<int32_t> canvas_;
};

// A hit at every host block boundary of a 22-token prompt whose blocks are on the device: the
// whole device blocks of [0, shared) on the full layers and of the window [shared − 7, shared) on
// the sliding ones are taken, so only the rows of the last partial device block are uploaded
// (none at a device block boundary). Then the prompt's cache is gone: its registered blocks stay
// cached, and a hit still takes them.
TEST_P(CudaKvSharingTest, PrefixHitTakesTheDeviceBlocks) {
  const int B = GetParam().kv_block_size;
  const std::vector<int32_t> a = Tokens(22, 1);
  std::unique_ptr<PagedKvCache> kv_a = EncodePrompt(a);
  ASSERT_FALSE(HasFatalFailure());
  for (int shared = 8; shared <= 20; shared += kHostBlock) {
    SCOPED_TRACE(shared);
    const std::unique_ptr<PagedKvCache> hit = Hit(SharingPrompt(a, shared), shared);
    const int64_t uploaded = UploadBytes(), taken = Taken();
    const std::vector<float> logits = Logits(*gpu_, *hit, canvas_);
    // Full layers: the whole device blocks of [0, shared), the rest uploaded. Sliding layers:
    // the whole device blocks from the window's, (shared − 7) / B, whose every position the hit
    // holds (its host blocks from the one of position shared − 7 on), and the window's other
    // rows uploaded.
    const int host_from = (shared - 7) / kHostBlock * kHostBlock;
    int sliding_taken = 0, sliding_rows = 7;
    for (int i = (shared - 7) / B; (i + 1) * B <= shared; ++i) {
      if (i * B < host_from) continue;
      ++sliding_taken;
      sliding_rows -= std::min(shared, (i + 1) * B) - std::max(shared - 7, i * B);
    }
    EXPECT_EQ(UploadBytes() - uploaded, DeviceBytes(shared % B, sliding_rows));
    EXPECT_EQ(Taken() - taken, shared / B + sliding_taken);
    ExpectPlainLogits(*hit, logits, "hit");
  }
  // The prompt's cache is gone; its mirror at the next pass (another sequence's).
  kv_a.reset();
  PagedKvCache other(pool_.get(), kMaxTokens);
  Encode(*gpu_, other, Tokens(3, 2));
  const CudaKvPoolStats st = GetCudaKvPoolStats(*gpu_).value();
  EXPECT_EQ(st.full_blocks_cached, 22 / B);
  EXPECT_GT(st.sliding_blocks_cached, 0);
  EXPECT_EQ(st.full_blocks_in_use, 1);
  const std::unique_ptr<PagedKvCache> hit = Hit(SharingPrompt(a, 16), 16);
  const int64_t uploaded = UploadBytes();
  const std::vector<float> logits = Logits(*gpu_, *hit, canvas_);
  EXPECT_EQ(UploadBytes() - uploaded, 0);  // 16: a multiple of both block sizes
  EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->full_blocks_cached, 22 / B - 16 / B);
  ExpectPlainLogits(*hit, logits, "hit after the prompt's cache is gone");
  // Its own tokens, then the same logits as without sharing.
  Encode(*gpu_, *hit, Tokens(5, 3));
  ASSERT_TRUE(gpu_->SyncKvToHost(*hit).ok());
  ExpectPlainLogits(*hit, Logits(*gpu_, *hit, canvas_), "hit, own tokens");
}

// Parallel samples: a 22-token prompt encoded in one pass (its sliding rows from position 8
// only), synced and forked. The child takes every whole device block of the parent's rows (the
// full layers' blocks below 22 rounded down to the device block, the sliding layers' from the
// window's block) and uploads the rest; its logits are the parent's. Each then appends its own
// tokens; both keep the logits of a backend that shares nothing.
TEST_P(CudaKvSharingTest, ForkedSamplesShareTheirBlocks) {
  const int B = GetParam().kv_block_size;
  PagedKvCache parent(pool_.get(), kMaxTokens);
  Encode(*gpu_, parent, Tokens(22, 4));
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu_->SyncKvToHost(parent).ok());
  auto child = parent.Fork();
  ASSERT_TRUE(child.ok()) << child.status();
  const std::vector<float> parent_logits = Logits(*gpu_, parent, canvas_);
  const int64_t uploaded = UploadBytes(), taken = Taken();
  const std::vector<float> child_logits = Logits(*gpu_, **child, canvas_);
  EXPECT_EQ(UploadBytes() - uploaded, DeviceBytes(22 % B, 22 % B));
  EXPECT_EQ(Taken() - taken, 22 / B + (22 / B - 15 / B));
  ASSERT_EQ(parent_logits.size(), child_logits.size());
  EXPECT_EQ(std::memcmp(parent_logits.data(), child_logits.data(), 4 * parent_logits.size()), 0);
  Encode(*gpu_, **child, Tokens(9, 5));
  Encode(*gpu_, parent, Tokens(6, 6));
  ASSERT_TRUE(gpu_->SyncKvToHost(**child).ok());
  ASSERT_TRUE(gpu_->SyncKvToHost(parent).ok());
  ExpectPlainLogits(**child, Logits(*gpu_, **child, canvas_), "child");
  ExpectPlainLogits(parent, Logits(*gpu_, parent, canvas_), "parent");
}

// A cache whose first 12 positions are a hit on a prompt's blocks and whose positions 12 … 15
// are its own (written on the host by the CPU backend): the device block of positions 8 … 15
// (blocks of 8) holds the prompt's rows 8 … 11 but not its 12 … 15, so it is uploaded, not
// taken. A lookup by one position's identity alone would take the prompt's block.
TEST_P(CudaKvSharingTest, SharedBlocksNeedEveryPositionsRows) {
  const int B = GetParam().kv_block_size;
  const std::vector<int32_t> a = Tokens(22, 7);
  const std::unique_ptr<PagedKvCache> kv_a = EncodePrompt(a);
  ASSERT_FALSE(HasFatalFailure());
  const std::vector<int32_t> b = SharingPrompt(a, 12);
  const std::unique_ptr<PagedKvCache> kv = Hit(b, 12);
  Encode(*cpu_, *kv, std::vector<int32_t>(b.begin() + 12, b.begin() + 16));
  ASSERT_FALSE(HasFatalFailure());
  const int64_t taken = Taken();
  const std::vector<float> logits = Logits(*gpu_, *kv, canvas_);
  // Taken: the whole blocks of A's rows alone, [0, 12) rounded down to B, on the full layers;
  // on the sliding ones those from the window [9, 16) up to 12.
  EXPECT_EQ(Taken() - taken, 12 / B + (12 / B - 9 / B));
  ExpectPlainLogits(*kv, logits, "a block of two prompts' rows");
}

// A cache whose rows the CPU backend wrote (20 positions) is decoded on the device: its sliding
// layers upload only the window [13, 20), so the device block holding position 12 lacks rows it
// covers and is not registered; the prompt is then indexed, and a hit at 16 (window [9, 16))
// uploads those rows rather than reading the block's unwritten ones. The full layers' blocks,
// uploaded whole, are taken.
TEST_P(CudaKvSharingTest, PartlyWrittenBlocksAreNotShared) {
  const int B = GetParam().kv_block_size;
  const std::vector<int32_t> a = Tokens(20, 8);
  PagedKvCache kv_a(pool_.get(), kMaxTokens);
  Encode(*cpu_, kv_a, a);
  ASSERT_FALSE(HasFatalFailure());
  Logits(*gpu_, kv_a, canvas_);  // its mirror: full rows [0, 20), sliding [13, 20)
  pool_->InsertPrefix(a, kv_a.table());
  const std::unique_ptr<PagedKvCache> hit = Hit(SharingPrompt(a, 16), 16);
  const int64_t taken = Taken();
  const std::vector<float> logits = Logits(*gpu_, *hit, canvas_);
  // Sliding: the blocks wholly in [13, 16): none (4: block 3 holds 12; 8: block 1 holds 8 … 12).
  EXPECT_EQ(Taken() - taken, 16 / B);
  ExpectPlainLogits(*hit, logits, "hit on rows the device has from the window on");
}

// A pass refused after the hit's mirror took the prompt's blocks (here: its host rows marked as
// held by another backend, FAILED_PRECONDITION) keeps them; the next pass uploads none of their
// rows (it used to upload every row through them, writing blocks other sequences hold).
TEST_P(CudaKvSharingTest, ARefusedPassKeepsTheBlocksItTook) {
  const std::vector<int32_t> a = Tokens(22, 9);
  const std::unique_ptr<PagedKvCache> kv_a = EncodePrompt(a);
  ASSERT_FALSE(HasFatalFailure());
  const std::unique_ptr<PagedKvCache> hit = Hit(SharingPrompt(a, 16), 16);
  hit->set_host_rows_stale(true);
  std::vector<float> logits(canvas_.size() * config().vocab_size);
  DecodeInput in{canvas_, nullptr, hit.get(), logits.data()};
  EXPECT_EQ(gpu_->Decode({&in, 1}).code(), absl::StatusCode::kFailedPrecondition);
  hit->set_host_rows_stale(false);
  const int64_t uploaded = UploadBytes();
  logits = Logits(*gpu_, *hit, canvas_);
  // 16: whole device blocks of 4 and 8 on the full layers; on the sliding ones the window
  // [9, 16) lies in blocks the hit's host blocks (from 8) cover.
  EXPECT_EQ(UploadBytes() - uploaded, 0);
  ExpectPlainLogits(*hit, logits, "after a refused pass");
}

// At kv_pool_max_bytes (80 KiB: 64 full-layer blocks of 1 KiB, then 4 sliding ones of 4 KiB) a
// sliding block for the last of two sequences encoded in one pass comes from the full pool's
// blocks no sequence holds: the full pool is compacted to the 6 its live sequences hold, ids
// 11 … 16 (a gone 60-position sequence held 0 … 14, the free list hands out the last released
// first), which move below 6. The parent's two full blocks (ids 15 and 16) are registered under
// their host blocks' identities: the registry follows the move, and a fork of the parent takes
// them at their new ids (4 blocks taken by the rule of ForkedSamplesShareTheirBlocks: 8 / B full,
// 8 / B − 1 / B sliding), with the parent's logits bit for bit. (Checked by hand: without the
// registry's update the fork finds only the sliding blocks: 2 taken.)
TEST_P(CudaKvSharingTest, CompactionMovesRegisteredBlocks) {
  if (const std::string why = BoundedBlockCountsSkip(); !why.empty()) GTEST_SKIP() << why;
  CudaBackendOptions bounded = GpuOptions();
  bounded.kv_pool_max_bytes = 64 * 1024 + 4 * 4096;
  auto created = CreateCudaBackend(config(), checkpoint_->weights, bounded);
  ASSERT_TRUE(created.ok()) << created.status();
  std::unique_ptr<ModelBackend> gpu = std::move(*created);
  auto filler = std::make_unique<ContiguousKvCache>(config(), 64);
  Encode(*gpu, *filler, Tokens(60, 20));  // full ids 0 … 14, sliding 0 and 1
  PagedKvCache parent(pool_.get(), kMaxTokens);
  Encode(*gpu, parent, Tokens(8, 21));  // full 15, 16 (registered); sliding 2, 3
  ASSERT_FALSE(HasFatalFailure());
  ASSERT_TRUE(gpu->SyncKvToHost(parent).ok());
  EXPECT_EQ(GetCudaKvPoolStats(*gpu)->sliding_blocks_in_use, 4);
  filler.reset();  // its blocks go back at the next pass
  ContiguousKvCache y(config(), 64), z(config(), 64);
  const std::vector<int32_t> ty = Tokens(8, 22), tz = Tokens(8, 23);
  const EncodeInput both[] = {{ty, &y}, {tz, &z}};
  ASSERT_TRUE(gpu->Encode(both).ok());
  CudaKvPoolStats st = GetCudaKvPoolStats(*gpu).value();
  EXPECT_EQ(st.compactions, 1);
  EXPECT_EQ(st.blocks_moved, 6);
  EXPECT_EQ(st.full_blocks, 6);
  auto child = parent.Fork();
  ASSERT_TRUE(child.ok()) << child.status();
  const int64_t taken = GetCudaKvPoolStats(*gpu)->shared_blocks_taken;
  const std::vector<float> child_logits = Logits(*gpu, **child, canvas_);
  const int B = GetParam().kv_block_size;
  EXPECT_EQ(GetCudaKvPoolStats(*gpu)->shared_blocks_taken - taken, 8 / B + (8 / B - 1 / B));
  const std::vector<float> parent_logits = Logits(*gpu, parent, canvas_);
  ASSERT_EQ(parent_logits.size(), child_logits.size());
  EXPECT_EQ(std::memcmp(parent_logits.data(), child_logits.data(), 4 * parent_logits.size()), 0);
  ExpectPlainLogits(parent, parent_logits, "parent through its moved blocks");
  gpu.reset();  // its mirrors name caches of pool_
}

// A long sequence needs more full blocks than the full pool holds (66: the free ones, then the
// cached ones), so the sliding pool is compacted. It drops only the least recently released
// cached blocks that give back the room for an eighth of the full pool (8 KiB: prompt 2's 2
// blocks), and the full pool grows into half of it (4 blocks: 68); the long sequence's own 2
// sliding blocks are then prompt 0's. It used to drop all 10 (the full pool grew to 84 blocks,
// and no prompt kept its blocks). A hit on the last prompt released (3) takes its two sliding
// blocks (window [1, 8)) and uploads only the full layers' rows; one on the first (2) takes none;
// both with the logits of a backend that shares nothing.
TEST_P(CudaKvSharingTest, CompactionDropsOnlyTheCachedBlocksItNeeds) {
  if (const std::string why = BoundedBlockCountsSkip(); !why.empty()) GTEST_SKIP() << why;
  CachedPrompts c = CacheFivePrompts();
  ASSERT_FALSE(HasFailure());
  ContiguousKvCache long_kv(config(), 288);
  Encode(*c.gpu, long_kv, Tokens(264, 71));
  const CudaKvPoolStats st = GetCudaKvPoolStats(*c.gpu).value();
  EXPECT_EQ(st.compactions, 1);
  EXPECT_EQ(st.full_blocks, 68);
  EXPECT_EQ(st.full_blocks_in_use, 67);
  EXPECT_EQ(st.sliding_blocks, 9);
  EXPECT_EQ(st.sliding_blocks_in_use, 3);
  EXPECT_EQ(st.sliding_blocks_cached, 6);
  for (const auto& [i, taken, sliding_rows] : {std::tuple{3, 2, 0}, std::tuple{2, 0, 7}}) {
    SCOPED_TRACE(i);
    const std::unique_ptr<PagedKvCache> hit = Hit(SharingPrompt(c.prompts[i], 8), 8);
    const int64_t taken_before = GetCudaKvPoolStats(*c.gpu)->shared_blocks_taken;
    const int64_t uploaded = GetCudaKvCopyStats(*c.gpu)->upload_bytes;
    const std::vector<float> logits = Logits(*c.gpu, *hit, canvas_);
    EXPECT_EQ(GetCudaKvPoolStats(*c.gpu)->shared_blocks_taken - taken_before, taken);
    EXPECT_EQ(GetCudaKvCopyStats(*c.gpu)->upload_bytes - uploaded, DeviceBytes(8, sliding_rows));
    ExpectPlainLogits(*hit, logits, "hit");
  }
  ASSERT_TRUE(c.gpu->SyncKvToHost(long_kv).ok());
  ExpectPlainLogits(long_kv, Logits(*c.gpu, long_kv, canvas_), "the long sequence");
  c.gpu.reset();  // its mirrors name caches of pool_
}

// A hit on the least recently released prompt (2) with 250 tokens of its own encoded in one
// pass: its mirror takes the prompt's 2 full and 2 sliding blocks before it allocates any (its
// 63 new full blocks need a growth past the bound, which compacts the sliding pool and drops
// the least recently released cached blocks). When the sliding blocks were taken after the full
// ones were allocated, that compaction dropped them first and the hit uploaded their rows: 2
// blocks taken, not 4.
TEST_P(CudaKvSharingTest, AHitTakesItsBlocksBeforeACompactionDropsThem) {
  if (const std::string why = BoundedBlockCountsSkip(); !why.empty()) GTEST_SKIP() << why;
  CachedPrompts c = CacheFivePrompts();
  ASSERT_FALSE(HasFailure());
  std::vector<int32_t> prompt = c.prompts[2];
  const std::vector<int32_t> own = Tokens(250, 72);
  prompt.insert(prompt.end(), own.begin(), own.end());
  PrefixMatch match = pool_->MatchPrefix(prompt);
  ASSERT_EQ(match.num_tokens, 8);
  auto hit = PagedKvCache::FromPrefix(pool_.get(), std::move(match), 288);
  const int64_t taken = GetCudaKvPoolStats(*c.gpu)->shared_blocks_taken;
  Encode(*c.gpu, *hit, own);
  const CudaKvPoolStats st = GetCudaKvPoolStats(*c.gpu).value();
  EXPECT_EQ(st.compactions, 1);
  EXPECT_EQ(st.shared_blocks_taken - taken, 4);
  ASSERT_TRUE(c.gpu->SyncKvToHost(*hit).ok());
  ExpectPlainLogits(*hit, Logits(*c.gpu, *hit, canvas_), "the hit");
  hit.reset();
  c.gpu.reset();  // its mirrors name caches of pool_
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaKvSharingTest,
                         ::testing::Values(SharingMode{"bf16_tc_blocks4", cuda::GemmInput::kBf16,
                                                       cpu::GemmInput::kBf16, true, true, 4},
                                           SharingMode{"bf16_tc_blocks8", cuda::GemmInput::kBf16,
                                                       cpu::GemmInput::kBf16, true, true, 8},
                                           SharingMode{"bf16_blocks8", cuda::GemmInput::kBf16,
                                                       cpu::GemmInput::kBf16, true, false, 8}),
                         [](const ::testing::TestParamInfo<SharingMode>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace dgserve::kv
