// The prefix cache on the CUDA backend (issue 34 item 4; label `gpu`, and `gpu-emu` under the
// emulation; built into cuda_backend_test / cuda_backend_emu_test: kvstore/ sits above engine/
// in the layers, so this file, not engine/cuda/, may use both). On kvstore's paged pool (blocks
// of 4 tokens; the tiny-v512 shape's window W = 8, so a prompt of 22 wraps every sliding layer's
// ring), a prompt A is encoded cold, one block per pass, its whole blocks indexed as they fill.
// For every block boundary b of A, a prompt B that shares exactly A's first b blocks takes them
// the way the prefill worker does (BlockPool::MatchPrefix, PagedKvCache::FromPrefix: a cache
// object the backend has not seen, so its device mirror uploads the shared rows from the host
// pool) and encodes only the rest. Against B encoded cold in one pass on the same backend: every
// K/V row the model still reads and the decoder's logits over a fixed canvas are equal bit for
// bit at every boundary, and so are three chained denoising steps (tokens, entropy, lse,
// next_soft) at two of them. The backend's passes
// are row invariant (a row's bits depend neither on the rows batched beside it nor on the pass
// that computed its context), so nothing but equality is right; the boundaries' caches share
// their passes (one encoder pass for the hits, one for the cold prompts) for that reason.
//
// StaleMirrorAtTheSameAddressIsUploadedAgain: a cache holding A's first 4b tokens but the last
// changed is encoded and freed, and a cache holding A's shared blocks is made at the same address
// (placement new: the allocator alone does not promise the address), so the backend finds a
// mirror under that address whose rows 0 … 4b−2 are the new cache's own and whose row 4b−1 is
// not: only the cache's identity (KvCache::lifetime) tells them apart.
//
// The encoder passes leave their rows on the device (CudaBackendOptions::defer_kv_host_copy)
// except in the bf16_tc_copy mode; the tests call SyncKvToHost before the host rows are read or
// indexed, as the prefill worker does before it indexes and ships a prompt.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <new>
#include <ostream>
#include <span>
#include <string>
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

constexpr int kBlock = 4;       // tokens per KV block: a boundary every 4 tokens
constexpr int kPromptA = 22;    // 5 whole blocks and 2 tokens; > W = 8 of tiny-v512
constexpr int kOwnTokens = 9;   // B's tokens after the shared blocks (> W: the ring wraps)
constexpr int kMaxTokens = 64;  // every cache's limit
constexpr int kCanvas = 8;      // canvas rows (half the model's canvas: the emulation is slow)
constexpr int kSteps = 3;       // chained denoising steps compared

// The GEMM input (bf16, the default, with the batch-invariant projections) and the attention
// kernels (float32, or bf16 on tensor cores).
struct PrefixMode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  bool own_projections;
  bool tensor_core_attention;
  // CudaBackendOptions::defer_kv_host_copy (the default): new rows reach the host cache at
  // SyncKvToHost, not in the encoder pass.
  bool defer_kv_host_copy = true;
};
void PrintTo(const PrefixMode& m, std::ostream* os) { *os << m.name; }

class CudaPrefixCacheTest : public backend_testing::CpuGpuTest<CudaPrefixCacheTest, PrefixMode> {
 public:
  static std::unique_ptr<Checkpoint> MakeCheckpoint() {
    return backend_testing::TinyV512Checkpoint("cuda_prefix_cache_test");
  }

 protected:
  CudaBackendOptions GpuOptions() const override {
    CudaBackendOptions options = CpuGpuTest::GpuOptions();
    options.tensor_core_attention = GetParam().tensor_core_attention;
    options.defer_kv_host_copy = GetParam().defer_kv_host_copy;
    return options;
  }
  void SetUp() override {
    CpuGpuTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    layout_ = KvLayout::FromConfig(config(), kBlock, "tiny-v512");
    ASSERT_GT(layout_.layers[KindIndex(LayerKind::kSliding)], 0);
    ASSERT_GT(layout_.layers[KindIndex(LayerKind::kFull)], 0);
    ASSERT_LT(config().sliding_window, kPromptA);
    // Room for every cache of a test with A's indexed blocks never evicted.
    auto pool = BlockPool::Create(layout_, 512, 512);
    ASSERT_TRUE(pool.ok()) << pool.status();
    pool_ = std::move(*pool);
    const int V = config().vocab_size;
    ASSERT_LE(kCanvas, config().canvas_length);
    canvas_.resize(kCanvas);
    for (size_t i = 0; i < canvas_.size(); ++i) canvas_[i] = int32_t((i * 131 + 17) % V);
    a_ = Tokens(kPromptA, 1);
  }
  void TearDown() override {
    kv_a_.reset();
    gpu_.reset();  // its mirrors name caches of pool_
    pool_.reset();
    CpuGpuTest::TearDown();
  }

  // A cold on the GPU, one block per pass, its whole blocks indexed as they fill (a sliding block
  // leaves the table once outside the window: indexed before, every boundary of A is matchable).
  void EncodeA() {
    kv_a_ = std::make_unique<PagedKvCache>(pool_.get(), kMaxTokens);
    for (int at = 0; at < kPromptA; at += kBlock) {
      const int n = std::min(kBlock, kPromptA - at);
      Encode(*gpu_, *kv_a_, std::vector<int32_t>(a_.begin() + at, a_.begin() + at + n));
      ASSERT_FALSE(HasFatalFailure());
      ASSERT_TRUE(gpu_->SyncKvToHost(*kv_a_).ok());  // before its blocks are indexed
      pool_->InsertPrefix(std::span<const int32_t>(a_).first(size_t(at + n)), kv_a_->table());
    }
  }
  // A's first `shared` tokens, then kOwnTokens others (the first of them not A's).
  std::vector<int32_t> SharingPrompt(int shared) const {
    const int V = config().vocab_size;
    std::vector<int32_t> b(a_.begin(), a_.begin() + shared);
    for (int i = 0; i < kOwnTokens; ++i) b.push_back(int32_t((i * 53 + 7 + shared * 29) % V));
    if (shared < kPromptA && b[shared] == a_[shared]) b[shared] = (a_[shared] + 1) % V;
    return b;
  }
  // One encoder pass over the given caches and tokens.
  void EncodeBatch(const std::vector<KvCache*>& kvs,
                   const std::vector<std::vector<int32_t>>& tokens) {
    std::vector<EncodeInput> in;
    for (size_t i = 0; i < kvs.size(); ++i) in.push_back(EncodeInput{tokens[i], kvs[i]});
    const absl::Status st = gpu_->Encode(in);
    ASSERT_TRUE(st.ok()) << st;
  }
  // Every row the model may still read (full layers all, sliding layers from SlidingKeepFrom)
  // equal bit for bit; the first difference is reported.
  void ExpectSameRows(KvCache& want, KvCache& got, const std::string& what) {
    // The rows the host keeps, from the device where they are (defer_kv_host_copy).
    ASSERT_TRUE(gpu_->SyncKvToHost(want).ok()) << what;
    ASSERT_TRUE(gpu_->SyncKvToHost(got).ok()) << what;
    ASSERT_EQ(want.num_tokens(), got.num_tokens()) << what;
    const int n = got.num_tokens();
    for (int l = 0; l < config().num_layers; ++l) {
      const size_t bytes = sizeof(float) * config().KvHeads(l) * config().HeadDim(l);
      const int from = config().IsFull(l) ? 0 : layout_.SlidingKeepFrom(n);
      for (int p = from; p < n; ++p) {
        ASSERT_EQ(std::memcmp(want.KeyRow(l, p), got.KeyRow(l, p), bytes), 0)
            << what << ": K of layer " << l << " position " << p;
        ASSERT_EQ(std::memcmp(want.ValueRow(l, p), got.ValueRow(l, p), bytes), 0)
            << what << ": V of layer " << l << " position " << p;
      }
    }
  }

  // One denoising step's results.
  struct Step {
    std::vector<RowResult> rows;
    std::vector<float> next_soft;
  };
  // Per cache: the logits over canvas_ (one decoder pass for all), then, with `steps`, kSteps
  // chained DenoiseSteps from canvas_ (one step for all caches at a time): each step's sampled
  // tokens are the cache's next canvas and its next_soft the next self-conditioning input.
  struct Results {
    std::vector<float> logits;
    std::vector<Step> steps;
  };
  std::vector<Results> Run(const std::vector<const KvCache*>& kvs, bool steps) {
    const int C = int(canvas_.size()), V = config().vocab_size, D = config().hidden_size;
    std::vector<Results> out(kvs.size());
    std::vector<DecodeInput> dec;
    for (size_t i = 0; i < kvs.size(); ++i) {
      out[i].logits.resize(size_t(C) * V);
      dec.push_back(DecodeInput{canvas_, nullptr, kvs[i], out[i].logits.data()});
    }
    const absl::Status st = gpu_->Decode(dec);
    EXPECT_TRUE(st.ok()) << st;
    std::vector<std::vector<int32_t>> canvas(kvs.size(), canvas_);
    std::vector<float> uniforms(C);
    for (int i = 0; i < C; ++i) uniforms[i] = float(i) / C + 0.013f;
    for (int s = 0; steps && s < kSteps; ++s) {
      std::vector<DenoiseStepInput> in(kvs.size());
      for (size_t i = 0; i < kvs.size(); ++i) {
        out[i].steps.push_back(Step{std::vector<RowResult>(C), std::vector<float>(size_t(C) * D)});
        in[i].canvas = canvas[i];
        in[i].sc_soft = s == 0 ? nullptr : out[i].steps[s - 1].next_soft.data();
        in[i].kv = kvs[i];
        in[i].temperature = 0.8f;
        in[i].uniforms = uniforms;
        in[i].rows = out[i].steps[s].rows.data();
        in[i].next_soft = out[i].steps[s].next_soft.data();
      }
      const absl::Status st = gpu_->DenoiseStep(in);
      EXPECT_TRUE(st.ok()) << st;
      for (size_t i = 0; i < kvs.size(); ++i) {
        for (int r = 0; r < C; ++r) canvas[i][r] = out[i].steps[s].rows[r].sampled;
      }
    }
    return out;
  }
  // Logits and every step's rows and next_soft equal bit for bit.
  static void ExpectSameResults(const Results& cold, const Results& hit, const std::string& what) {
    ASSERT_EQ(cold.logits.size(), hit.logits.size());
    size_t differ = 0;
    for (size_t i = 0; i < cold.logits.size(); ++i) {
      differ += std::memcmp(&cold.logits[i], &hit.logits[i], sizeof(float)) != 0;
    }
    EXPECT_EQ(differ, 0u) << what << ": logits differ at " << differ << " of "
                          << cold.logits.size();
    ASSERT_EQ(cold.steps.size(), hit.steps.size());
    for (size_t s = 0; s < cold.steps.size(); ++s) {
      for (size_t r = 0; r < cold.steps[s].rows.size(); ++r) {
        const RowResult &c = cold.steps[s].rows[r], &h = hit.steps[s].rows[r];
        EXPECT_EQ(c.argmax, h.argmax) << what << " step " << s << " row " << r;
        EXPECT_EQ(c.sampled, h.sampled) << what << " step " << s << " row " << r;
        EXPECT_EQ(std::memcmp(&c.entropy, &h.entropy, sizeof(float)), 0)
            << what << " step " << s << " row " << r << ": entropy " << c.entropy << " vs "
            << h.entropy;
        EXPECT_EQ(std::memcmp(&c.lse, &h.lse, sizeof(float)), 0)
            << what << " step " << s << " row " << r << ": lse " << c.lse << " vs " << h.lse;
      }
      EXPECT_EQ(std::memcmp(cold.steps[s].next_soft.data(), hit.steps[s].next_soft.data(),
                            cold.steps[s].next_soft.size() * sizeof(float)),
                0)
          << what << " step " << s << ": next_soft";
    }
  }

  KvLayout layout_;
  std::unique_ptr<BlockPool> pool_;
  std::vector<int32_t> canvas_, a_;
  std::unique_ptr<PagedKvCache> kv_a_;
};

TEST_P(CudaPrefixCacheTest, HitAtEveryBlockGivesTheColdResults) {
  ASSERT_NO_FATAL_FAILURE(EncodeA());
  std::vector<std::unique_ptr<PagedKvCache>> hits, colds;
  std::vector<std::vector<int32_t>> prompts, own;
  for (int b = 1; b <= kPromptA / kBlock; ++b) {
    const int shared = b * kBlock;
    prompts.push_back(SharingPrompt(shared));
    own.emplace_back(prompts.back().begin() + shared, prompts.back().end());
    PrefixMatch match = pool_->MatchPrefix(prompts.back());
    ASSERT_EQ(match.num_tokens, shared) << "boundary " << b;
    hits.push_back(PagedKvCache::FromPrefix(pool_.get(), std::move(match), kMaxTokens));
    ASSERT_EQ(hits.back()->num_tokens(), shared);
    colds.push_back(std::make_unique<PagedKvCache>(pool_.get(), kMaxTokens));
  }
  std::vector<KvCache*> hit_kvs, cold_kvs;
  for (size_t i = 0; i < hits.size(); ++i) {
    hit_kvs.push_back(hits[i].get());
    cold_kvs.push_back(colds[i].get());
  }
  ASSERT_NO_FATAL_FAILURE(EncodeBatch(hit_kvs, own));       // only B's own tokens
  ASSERT_NO_FATAL_FAILURE(EncodeBatch(cold_kvs, prompts));  // all of B, one pass
  for (size_t i = 0; i < hits.size(); ++i) {
    ExpectSameRows(*colds[i], *hits[i], "boundary " + std::to_string(i + 1));
  }
  const std::vector<Results> cold = Run({cold_kvs.begin(), cold_kvs.end()}, false),
                             hit = Run({hit_kvs.begin(), hit_kvs.end()}, false);
  for (size_t i = 0; i < hits.size(); ++i) {
    ExpectSameResults(cold[i], hit[i], "boundary " + std::to_string(i + 1));
  }
  // Denoising steps (the emulation's vocabulary pass is slow): the boundary whose shared rows
  // just fill the ring (b·4 = W) and the last one.
  const size_t first = size_t(config().sliding_window / kBlock - 1), last = hits.size() - 1;
  ASSERT_LT(first, last);
  const std::vector<Results> cold_steps = Run({colds[first].get(), colds[last].get()}, true),
                             hit_steps = Run({hits[first].get(), hits[last].get()}, true);
  ExpectSameResults(cold_steps[0], hit_steps[0], "steps, boundary " + std::to_string(first + 1));
  ExpectSameResults(cold_steps[1], hit_steps[1], "steps, boundary " + std::to_string(last + 1));
}

// A prompt encoded in one pass: its sliding layers' rows go to the host from
// PagedKvCache::SlidingRetainedFrom on only (the window and one spare block, not the whole
// prompt), and the prefix hits the index can still serve read exactly those rows: the spare
// block's too (a hit at 16 tokens reads positions 9 … 15, before the window of the 22 encoded).
TEST_P(CudaPrefixCacheTest, HitAfterAOnePassPromptGivesTheColdResults) {
  const int W = config().sliding_window;
  ASSERT_EQ(W, 8);
  kv_a_ = std::make_unique<PagedKvCache>(pool_.get(), kMaxTokens);
  const CudaKvCopyStats before = GetCudaKvCopyStats(*gpu_).value();
  Encode(*gpu_, *kv_a_, a_);
  ASSERT_FALSE(HasFatalFailure());
  // 22 tokens, W = 8, blocks of 4: the sliding layers keep blocks 2 … 5 (from position 8: the
  // window [15, 22) and the spare block before it); so 14 of the 22 rows go to the host there,
  // all 22 on the full layers: in the pass (float32), or at SyncKvToHost as the mirror stores
  // them (bf16 on the tensor-core layers: head_dim a multiple of 32).
  ASSERT_EQ(kv_a_->table().first_sliding_block, 2);
  int64_t want = 0, want_mirror = 0;
  for (int l = 0; l < config().num_layers; ++l) {
    const int rows = config().IsFull(l) ? kPromptA : kPromptA - 8;
    const int64_t elements = 2 * int64_t(rows) * config().KvHeads(l) * config().HeadDim(l);
    want += elements * 4;
    const bool bf16 = GetParam().tensor_core_attention && config().HeadDim(l) % 32 == 0;
    want_mirror += elements * (bf16 ? 2 : 4);
  }
  const int64_t in_pass =
      GetCudaKvCopyStats(*gpu_)->encode_to_host_bytes - before.encode_to_host_bytes;
  EXPECT_EQ(kv_a_->host_rows_stale(), GetParam().defer_kv_host_copy);
  ASSERT_TRUE(gpu_->SyncKvToHost(*kv_a_).ok());
  EXPECT_FALSE(kv_a_->host_rows_stale());
  const int64_t at_sync = GetCudaKvCopyStats(*gpu_)->sync_to_host_bytes - before.sync_to_host_bytes;
  if (GetParam().defer_kv_host_copy) {
    EXPECT_EQ(in_pass, 0);
    EXPECT_EQ(at_sync, want_mirror);
  } else {
    EXPECT_EQ(in_pass, want);
    EXPECT_EQ(at_sync, 0);
  }
  pool_->InsertPrefix(a_, kv_a_->table());
  // The boundaries whose sliding window [shared − (W − 1), shared) the kept blocks cover: 16
  // (blocks 2 and 3) and 20.
  std::vector<std::unique_ptr<PagedKvCache>> hits, colds;
  std::vector<std::vector<int32_t>> prompts, own;
  for (int shared : {16, 20}) {
    prompts.push_back(SharingPrompt(shared));
    own.emplace_back(prompts.back().begin() + shared, prompts.back().end());
    PrefixMatch match = pool_->MatchPrefix(prompts.back());
    ASSERT_EQ(match.num_tokens, shared);
    hits.push_back(PagedKvCache::FromPrefix(pool_.get(), std::move(match), kMaxTokens));
    colds.push_back(std::make_unique<PagedKvCache>(pool_.get(), kMaxTokens));
  }
  // A boundary before them is not served: its window needs block 1, released by the pass.
  EXPECT_EQ(pool_->MatchPrefix(SharingPrompt(12)).num_tokens, 0);
  std::vector<KvCache*> hit_kvs = {hits[0].get(), hits[1].get()},
                        cold_kvs = {colds[0].get(), colds[1].get()};
  ASSERT_NO_FATAL_FAILURE(EncodeBatch(hit_kvs, own));
  ASSERT_NO_FATAL_FAILURE(EncodeBatch(cold_kvs, prompts));
  ExpectSameRows(*colds[0], *hits[0], "one-pass prompt, 16 shared");
  ExpectSameRows(*colds[1], *hits[1], "one-pass prompt, 20 shared");
  const std::vector<Results> cold = Run({colds[0].get(), colds[1].get()}, false),
                             hit = Run({hits[0].get(), hits[1].get()}, false);
  ExpectSameResults(cold[0], hit[0], "one-pass prompt, 16 shared");
  ExpectSameResults(cold[1], hit[1], "one-pass prompt, 20 shared");
}

// A cache constructed in storage the test owns (placement new), destroyed with the holder.
class CacheSlot {
 public:
  CacheSlot() = default;
  CacheSlot(const CacheSlot&) = delete;
  CacheSlot& operator=(const CacheSlot&) = delete;
  ~CacheSlot() { Clear(); }
  PagedKvCache* Make(BlockPool* pool, int max_tokens) {
    Clear();
    kv_ = new (storage_) PagedKvCache(pool, max_tokens);
    return kv_;
  }
  void Clear() {
    if (kv_ != nullptr) kv_->~PagedKvCache();
    kv_ = nullptr;
  }

 private:
  alignas(PagedKvCache) unsigned char storage_[sizeof(PagedKvCache)];
  PagedKvCache* kv_ = nullptr;
};

// Every mode: the mirror is recognised by the cache's lifetime (KvCache::lifetime), not its
// address. With the tensor-core attention the full layers' mirror is
// bf16 (CudaBackendOptions::bf16_kv_mirror), re-uploaded through SyncMirror's host rounding.
TEST_P(CudaPrefixCacheTest, StaleMirrorAtTheSameAddressIsUploadedAgain) {
  ASSERT_NO_FATAL_FAILURE(EncodeA());
  const int b = 5, shared = b * kBlock;  // 20 > W: the ring has wrapped
  ASSERT_LT(shared, kPromptA);
  const std::vector<int32_t> prompt = SharingPrompt(shared);
  CacheSlot slot;
  {
    // A's first `shared` tokens, the last changed: rows 0 … shared−2 are A's, row shared−1 not.
    std::vector<int32_t> stale(a_.begin(), a_.begin() + shared);
    stale.back() = (stale.back() + 1) % config().vocab_size;
    PagedKvCache* kv = slot.Make(pool_.get(), kMaxTokens);
    Encode(*gpu_, *kv, stale);
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_TRUE(gpu_->SyncKvToHost(*kv).ok());
    const int full = [&] {
      for (int l = 0; l < config().num_layers; ++l) {
        if (config().IsFull(l)) return l;
      }
      return -1;
    }();
    ASSERT_GE(full, 0);
    const size_t bytes = sizeof(float) * config().KvHeads(full) * config().HeadDim(full);
    for (int p = 0; p < shared - 1; ++p) {
      ASSERT_EQ(std::memcmp(kv->KeyRow(full, p), kv_a_->KeyRow(full, p), bytes), 0) << p;
    }
    ASSERT_NE(std::memcmp(kv->KeyRow(full, shared - 1), kv_a_->KeyRow(full, shared - 1), bytes), 0);
  }
  // The prefix hit, its rows copied into a cache made at the freed cache's address.
  PrefixMatch match = pool_->MatchPrefix(prompt);
  ASSERT_EQ(match.num_tokens, shared);
  const auto hit = PagedKvCache::FromPrefix(pool_.get(), std::move(match), kMaxTokens);
  PagedKvCache* kv = slot.Make(pool_.get(), kMaxTokens);
  ASSERT_TRUE(kv->Reserve(shared).ok());
  for (int l = 0; l < config().num_layers; ++l) {
    const size_t bytes = sizeof(float) * config().KvHeads(l) * config().HeadDim(l);
    const int from = config().IsFull(l) ? 0 : layout_.SlidingKeepFrom(shared);
    for (int p = from; p < shared; ++p) {
      std::memcpy(kv->MutableKeyRow(l, p), hit->KeyRow(l, p), bytes);
      std::memcpy(kv->MutableValueRow(l, p), hit->ValueRow(l, p), bytes);
    }
  }
  kv->Commit(shared);
  // The backend holds a mirror under this address: the stale one.
  ASSERT_TRUE(CudaKvMirrorBytes(*gpu_, *kv).has_value());
  Encode(*gpu_, *kv, std::vector<int32_t>(prompt.begin() + shared, prompt.end()));
  PagedKvCache cold(pool_.get(), kMaxTokens);
  Encode(*gpu_, cold, prompt);
  ASSERT_FALSE(HasFatalFailure());
  ExpectSameRows(cold, *kv, "at the freed cache's address");
  const std::vector<Results> r = Run({&cold, kv}, false);
  ExpectSameResults(r[0], r[1], "at the freed cache's address");
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaPrefixCacheTest,
                         ::testing::Values(PrefixMode{"bf16", cuda::GemmInput::kBf16,
                                                      cpu::GemmInput::kBf16, true, false},
                                           PrefixMode{"bf16_tc", cuda::GemmInput::kBf16,
                                                      cpu::GemmInput::kBf16, true, true},
                                           PrefixMode{"bf16_tc_copy", cuda::GemmInput::kBf16,
                                                      cpu::GemmInput::kBf16, true, true, false}),
                         [](const ::testing::TestParamInfo<PrefixMode>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace dgserve::kv
