// The device mirror as the authority for the rows the CUDA backend's encoder passes write
// (CudaBackendOptions::defer_kv_host_copy, issue 34 item 1; label `gpu`, and `gpu-emu` under the
// emulation; built into cuda_backend_test / cuda_backend_emu_test beside
// cuda_prefix_cache_test.cc). On the tiny-v512 random checkpoint (W = 8), the backend with the
// deferred host copy (the default) against the same options with the copy in every pass:
//   - the passes copy nothing to the host, mark the cache (KvCache::host_rows_stale) and give
//     the same logits bit for bit; the CPU backend and the backend's own new mirrors refuse a
//     cache whose rows are on the device (also a copy of one);
//   - SyncKvToHost writes exactly the rows the cache keeps and lacks (byte counts by hand), equal
//     to the copying backend's rows (their bf16 values on the bf16-mirror layers), on a
//     contiguous and on a paged cache, whose sliding rings then hold W + 2·block − 2 rows; rows
//     the host already has are not held on the device again;
//   - a mirror holding a live cache's only rows is never evicted (max_kv_mirrors = 1); once
//     synced it is;
//   - a second CUDA backend refuses a cache whose newest rows the first holds, until the first
//     syncs it;
//   - the device K/V layouts (CudaBackendOptions::kv_block_size: the block pool in blocks of 64
//     and of 4, and per-sequence arrays, the modes below) give the same bits, also in a first
//     pass over an empty cache.
// The fixture is in cuda_kv_authority_test_util.h; the suite's block-pool tests (blocks given
// back, growth, the bound, the device out of memory) are in cuda_kv_pool_test.cc, instantiated
// by the INSTANTIATE_TEST_SUITE_P at the end of this file.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "kvstore/block_pool.h"
#include "kvstore/cuda_kv_authority_test_util.h"
#include "kvstore/kv_layout.h"
#include "kvstore/paged_kv_cache.h"

namespace dgserve::kv {
namespace {

using authority_test::AuthorityMode;
using authority_test::CudaKvAuthorityTest;

TEST_P(CudaKvAuthorityTest, EncodedRowsStayOnTheDeviceUntilSynced) {
  const std::vector<int32_t> prompt = Tokens(29, 3), canvas = Tokens(config().canvas_length, 4);
  ContiguousKvCache kd(config(), 128), kc(config(), 128);
  const CudaKvCopyStats before = GetCudaKvCopyStats(*gpu_).value();
  int at = 0;
  for (int n : {5, 1, 13, 10}) {
    const std::vector<int32_t> chunk(prompt.begin() + at, prompt.begin() + at + n);
    Encode(*gpu_, kd, chunk);
    Encode(*copy_, kc, chunk);
    at += n;
  }
  EXPECT_TRUE(kd.host_rows_stale());
  EXPECT_FALSE(kc.host_rows_stale());
  EXPECT_EQ(GetCudaKvCopyStats(*gpu_)->encode_to_host_bytes, before.encode_to_host_bytes);
  EXPECT_GT(GetCudaKvCopyStats(*copy_)->encode_to_host_bytes, 0);
  // The backend that holds the rows serves them: the same logits as the copying backend.
  ExpectSameBits(Logits(*gpu_, kd, canvas), Logits(*copy_, kc, canvas), "logits before sync");
  // Nobody else may read them yet: the CPU backend, and a copy of the cache on this backend.
  std::vector<float> logits(canvas.size() * config().vocab_size);
  DecodeInput on_cpu{canvas, nullptr, &kd, logits.data()};
  EXPECT_EQ(cpu_->Decode({&on_cpu, 1}).code(), absl::StatusCode::kFailedPrecondition);
  EncodeInput more_on_cpu{canvas, &kd};
  EXPECT_EQ(cpu_->Encode({&more_on_cpu, 1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kd.num_tokens(), 29);
  ContiguousKvCache copied = kd;
  EXPECT_TRUE(copied.host_rows_stale());
  DecodeInput on_copy{canvas, nullptr, &copied, logits.data()};
  EXPECT_EQ(gpu_->Decode({&on_copy, 1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gpu_->SyncKvToHost(copied).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(cpu_->SyncKvToHost(kd).code(), absl::StatusCode::kFailedPrecondition);

  // The sync: all 29 rows of the full layers, the last W − 1 = 7 of the sliding ones.
  ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());
  EXPECT_FALSE(kd.host_rows_stale());
  EXPECT_EQ(GetCudaKvCopyStats(*gpu_)->sync_to_host_bytes - before.sync_to_host_bytes,
            MirrorBytes(0, 22, 29));
  ExpectRowsOf(kc, kd, 0, 22, "after the prompt");
  ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());  // nothing left: no bytes
  EXPECT_EQ(GetCudaKvCopyStats(*gpu_)->sync_to_host_bytes - before.sync_to_host_bytes,
            MirrorBytes(0, 22, 29));
  // Now the CPU backend may read it (its own float32 rows would differ by bf16 rounding only).
  EXPECT_TRUE(cpu_->Decode({&on_cpu, 1}).ok());

  // A commit of one canvas (16 rows): the next sync moves those rows alone (sliding: the last 7).
  const CudaKvCopyStats mid = GetCudaKvCopyStats(*gpu_).value();
  Encode(*gpu_, kd, canvas);
  Encode(*copy_, kc, canvas);
  EXPECT_TRUE(kd.host_rows_stale());
  ExpectSameBits(Logits(*gpu_, kd, canvas), Logits(*copy_, kc, canvas), "logits after commit");
  ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());
  const int n = 29 + config().canvas_length;
  EXPECT_EQ(GetCudaKvCopyStats(*gpu_)->sync_to_host_bytes - mid.sync_to_host_bytes,
            MirrorBytes(29, n - 7, n));
  ExpectRowsOf(kc, kd, 0, n - 7, "after the commit");
}

// A paged cache keeps up to W + 2·block − 2 sliding rows (the window, the spare block, partial
// blocks at both ends): its mirror's sliding rings hold that many, so one long pass still finds
// the spare block's rows on the device at the sync.
TEST_P(CudaKvAuthorityTest, PagedCacheSyncsTheRowsItKeeps) {
  const KvLayout layout = KvLayout::FromConfig(config(), 4, "tiny-v512");
  auto pool = BlockPool::Create(layout, 64, 64);
  ASSERT_TRUE(pool.ok()) << pool.status();
  const std::vector<int32_t> prompt = Tokens(22, 5);
  {
    PagedKvCache kd(pool->get(), 64), kc(pool->get(), 64);
    EXPECT_EQ(kd.MaxSlidingRowsKept(), 8 + 2 * 4 - 2);
    Encode(*gpu_, kd, prompt);
    Encode(*copy_, kc, prompt);
    EXPECT_EQ(kd.Fork().status().code(), absl::StatusCode::kFailedPrecondition);
    // The mirror: a sliding row is 4 layers × K, V × 32 elements (2 heads of 16: float32, not on
    // the tensor cores) × 4 B = 1,024 B; a full row 2 layers × K, V × 32 elements (one head of
    // 32) × e, e = 4 B or 2 B in bf16 mirrors: 128·e.
    //   per sequence: sliding rings of 14 rows, full 64 rows (the first capacity);
    //   blocks of 64: block 0 of each kind;
    //   blocks of 4: sliding blocks 2 … 5 (positions 8 … 23: the host still lacks rows from
    //   SlidingRetainedFrom(22) = 8), full blocks 0 … 5 (24 rows).
    const int64_t e = GetParam().tensor_core_attention ? 2 : 4;
    const int B = GetParam().kv_block_size;
    const int64_t mirror = B == 0    ? 14 * 1024 + 64 * 128 * e
                           : B == 64 ? 64 * 1024 + 64 * 128 * e
                                     : 16 * 1024 + 24 * 128 * e;
    EXPECT_EQ(CudaKvMirrorBytes(*gpu_, kd).value_or(-1), mirror);
    const CudaKvCopyStats before = GetCudaKvCopyStats(*gpu_).value();
    ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());
    // Synced: blocks of 4 keep the window only (from 22 − 7 = 15: blocks 3 … 5); the block pool
    // holds as many blocks as the mirrors.
    if (B == 4) {
      EXPECT_EQ(CudaKvMirrorBytes(*gpu_, kd).value_or(-1), 12 * 1024 + 24 * 128 * e);
      const CudaKvPoolStats pool_stats = GetCudaKvPoolStats(*gpu_).value();
      EXPECT_EQ(pool_stats.block_size, 4);
      EXPECT_EQ(pool_stats.sliding_blocks_in_use, 3);
      EXPECT_EQ(pool_stats.full_blocks_in_use, 6);
    }
    // Sliding rows from SlidingRetainedFrom(22) = 8 (blocks 2 … 5).
    ASSERT_EQ(kd.SlidingRetainedFrom(22), 8);
    EXPECT_EQ(GetCudaKvCopyStats(*gpu_)->sync_to_host_bytes - before.sync_to_host_bytes,
              MirrorBytes(0, 8, 22));
    ExpectRowsOf(kc, kd, 0, 8, "paged");
    EXPECT_TRUE(kd.Fork().ok());
  }
  EXPECT_EQ(pool->get()->stats().used[0] + pool->get()->stats().used[1], 0);
}

// The device K/V layouts give the same bits: the block pool (CudaBackendOptions::kv_block_size,
// the default 64, and blocks of 4: sliding blocks go back to the pool behind the
// window), the per-sequence mirror with sliding rings (kv_block_size 0, W = 8 rows here) and the
// every-position mirror (sliding_kv_ring off, in blocks of 64 and per sequence: the reference).
// 29 prompt tokens (more than three rings) are encoded in chunks that cross ring and block
// edges, one of 13 rows (longer than the ring: only its last 8 rows are kept), then the decoder
// runs on the encoded caches and on caches each backend uploads (rows that wrap in a ring).
// The mirrors' bytes, counted by hand: element size e = 4 B (float32), or 2 B on the full layers
// in the tensor-core mode (head_dim 32: bf16 mirror); 4 sliding layers and 2 full layers, K and V,
// 32 elements a row (sliding 4 · 2 · 32 · 4 B = 1,024 B a row, full 4 · 32 · e = 128·e):
//   ring       sliding 8 rows: 8,192;                   full 64 rows (first capacity): 128·64·e
//   every pos. sliding 64 rows (first capacity): 65,536; full 128·64·e
//   blocks 64  sliding block 0 (positions 22 … 28 kept): 65,536; full block 0: 128·64·e
//   blocks 4   sliding blocks 5 … 7 (positions 20 … 31): 12,288; full 8 blocks: 128·32·e
// (bf16 against float32 mirrors is SyntheticBackendTest.Bf16KvMirrorEqualsFloat32MirrorBitForBit,
// every layer on the tensor cores.)
TEST_P(CudaKvAuthorityTest, KvLayoutsGiveTheSameBits) {
  // The layouts are made here: once per attention kind.
  if (GetParam().kv_block_size != 64) GTEST_SKIP() << "blocks of 64 only";
  ASSERT_EQ(config().sliding_window, 8);
  const auto options = [&](int block_size, bool ring) {
    CudaBackendOptions o;
    o.gemm_input = GetParam().gpu;
    o.batch_invariant_projections = GetParam().own_projections;
    o.tensor_core_attention = GetParam().tensor_core_attention;
    o.kv_block_size = block_size;
    o.sliding_kv_ring = ring;
    return o;
  };
  const int e = GetParam().tensor_core_attention ? 2 : 4;
  struct Layout {
    const char* name;
    CudaBackendOptions options;
    int64_t bytes;
    bool deferred;  // the linear layout copies its rows in the pass (no bound to its rows)
  };
  const std::vector<Layout> layouts = {
      {"every position", options(0, false), 65536 + 128 * 64 * e, false},
      {"ring", options(0, true), 8192 + 128 * 64 * e, true},
      {"blocks of 64, every position", options(64, false), 65536 + 128 * 64 * e, false},
      {"blocks of 4", options(4, true), 12288 + 128 * 32 * e, true},
      {"blocks of 64", options(64, true), 65536 + 128 * 64 * e, true},
  };
  const std::vector<int32_t> prompt = Tokens(29, 7);
  std::vector<std::unique_ptr<ModelBackend>> gpus;
  std::vector<std::unique_ptr<ContiguousKvCache>> caches;
  for (const Layout& layout : layouts) {
    auto gpu = CreateCudaBackend(config(), checkpoint_->weights, layout.options);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpus.push_back(std::move(*gpu));
    caches.push_back(std::make_unique<ContiguousKvCache>(config(), 256));
    int at = 0;
    for (int n : {5, 1, 13, 10}) {
      const std::vector<int32_t> chunk(prompt.begin() + at, prompt.begin() + at + n);
      Encode(*gpus.back(), *caches.back(), chunk);
      at += n;
    }
    // Deferred: the new rows are on the device only until the sync; the every-position layouts
    // (no bound on what they keep) copied theirs in the passes.
    EXPECT_EQ(caches.back()->host_rows_stale(), layout.deferred) << layout.name;
    ASSERT_TRUE(gpus.back()->SyncKvToHost(*caches.back()).ok()) << layout.name;
    EXPECT_FALSE(caches.back()->host_rows_stale()) << layout.name;
    EXPECT_EQ(CudaKvMirrorBytes(*gpus.back(), *caches.back()).value_or(-1), layout.bytes)
        << layout.name;
  }
  const ContiguousKvCache& ref = *caches[0];
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 8);
  const std::vector<float> want = Logits(*gpus[0], *caches[0], canvas);
  const auto expect_same = [](const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0) << i;
  };
  for (size_t i = 1; i < layouts.size(); ++i) {
    SCOPED_TRACE(layouts[i].name);
    // The host keeps the sliding layers' last W − 1 rows; a deferred bf16 mirror's rows come
    // back as their bf16 values (the rows its attention reads).
    const ContiguousKvCache& kv = *caches[i];
    for (int l = 0; l < config().num_layers; ++l) {
      const size_t w = size_t(config().KvHeads(l)) * config().HeadDim(l);
      const bool bf16 =
          layouts[i].deferred && GetParam().tensor_core_attention && config().HeadDim(l) % 32 == 0;
      const int from = config().IsFull(l) ? 0 : 29 - (config().sliding_window - 1);
      for (int p = from; p < 29; ++p) {
        for (const auto& [got, x] : {std::pair{kv.KeyRow(l, p), ref.KeyRow(l, p)},
                                     std::pair{kv.ValueRow(l, p), ref.ValueRow(l, p)}}) {
          for (size_t j = 0; j < w; ++j) {
            const float y = bf16 ? RoundToBf16(x[j]) : x[j];
            ASSERT_EQ(std::memcmp(&got[j], &y, sizeof(float)), 0) << l << " " << p << " " << j;
          }
        }
      }
    }
    expect_same(Logits(*gpus[i], kv, canvas), want);
    // A cache the backend has not seen (uploaded: 29 positions into a ring of 8 wrap).
    expect_same(Logits(*gpus[i], *caches[0], canvas), want);
  }
}

// max_kv_mirrors = 1: two caches with rows only on the device keep both mirrors (evicting one
// would lose its rows); once one is synced, a third cache evicts it.
TEST_P(CudaKvAuthorityTest, MirrorWithTheOnlyRowsIsNotEvicted) {
  CudaBackendOptions one = GpuOptions();
  one.max_kv_mirrors = 1;
  auto backend = CreateCudaBackend(config(), checkpoint_->weights, one);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ModelBackend& gpu = **backend;
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 9);
  ContiguousKvCache a(config(), 64), b(config(), 64), ra(config(), 64), rb(config(), 64);
  Encode(gpu, a, Tokens(11, 1));
  Encode(gpu, b, Tokens(12, 2));
  Encode(*copy_, ra, Tokens(11, 1));
  Encode(*copy_, rb, Tokens(12, 2));
  EXPECT_TRUE(CudaKvMirrorBytes(gpu, a).has_value());
  EXPECT_TRUE(CudaKvMirrorBytes(gpu, b).has_value());
  ExpectSameBits(Logits(gpu, a, canvas), Logits(*copy_, ra, canvas), "a");
  ExpectSameBits(Logits(gpu, b, canvas), Logits(*copy_, rb, canvas), "b");
  ASSERT_TRUE(gpu.SyncKvToHost(a).ok());
  ContiguousKvCache c(config(), 64);
  Encode(gpu, c, Tokens(5, 3));
  EXPECT_FALSE(CudaKvMirrorBytes(gpu, a).has_value());  // synced: evicted
  EXPECT_TRUE(CudaKvMirrorBytes(gpu, b).has_value());   // the only copy of b's rows: kept
  ExpectSameBits(Logits(gpu, b, canvas), Logits(*copy_, rb, canvas), "b after c");
  // a comes back from its host rows: the same logits.
  ExpectSameBits(Logits(gpu, a, canvas), Logits(*copy_, ra, canvas), "a uploaded again");
}

// A backend whose first pass is a decoder pass over an empty cache: no pool has grown, and the
// attention reads no context (it used to index the pools' empty per-layer arrays).
TEST_P(CudaKvAuthorityTest, FirstPassOverAnEmptyCache) {
  auto fresh = CreateCudaBackend(config(), checkpoint_->weights, GpuOptions());
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 3);
  ContiguousKvCache empty(config(), 64), ref(config(), 64);
  ExpectSameBits(Logits(**fresh, empty, canvas), Logits(*copy_, ref, canvas), "no context");
  EXPECT_EQ(GetCudaKvPoolStats(**fresh)->device_bytes, 0);
}

// Blocks of 4 on a paged host cache (blocks of 4, W = 8): after a sync at 23 positions the
// device keeps the window (positions 16 … 22: blocks 4, 5); one more position (deferred) makes
// the host keep rows from SlidingRetainedFrom(24) = 12, but it already has every row before 23,
// so the device must not take block 3 (positions 12 … 15) back, empty: still blocks 4, 5.
TEST_P(CudaKvAuthorityTest, RowsTheHostHasAreNotHeldAgain) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  const KvLayout layout = KvLayout::FromConfig(config(), 4, "tiny-v512");
  auto pool = BlockPool::Create(layout, 64, 64);
  ASSERT_TRUE(pool.ok()) << pool.status();
  {
    PagedKvCache kd(pool->get(), 64), kc(pool->get(), 64);
    Encode(*gpu_, kd, Tokens(23, 6));
    Encode(*copy_, kc, Tokens(23, 6));
    ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());
    EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->sliding_blocks_in_use, 2);
    const std::vector<int32_t> one = Tokens(1, 7);
    Encode(*gpu_, kd, one);
    Encode(*copy_, kc, one);
    ASSERT_EQ(kd.SlidingRetainedFrom(24), 12);
    // A decoder pass over the 24 positions (while the host lacks position 23) holds its blocks.
    const std::vector<int32_t> canvas = Tokens(config().canvas_length, 8);
    ExpectSameBits(Logits(*gpu_, kd, canvas), Logits(*copy_, kc, canvas), "logits");
    EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->sliding_blocks_in_use, 2);
    ASSERT_TRUE(gpu_->SyncKvToHost(kd).ok());
    ExpectRowsOf(kc, kd, 0, 12, "after the second sync");
  }
}

// Two CUDA backends on one cache: the second already mirrors it when the first encodes new rows
// into it (device only). The second must not take the unwritten host rows for those rows, nor
// vouch for them in SyncKvToHost; the first's sync makes the cache usable by both again.
TEST_P(CudaKvAuthorityTest, AnotherBackendsRowsAreRefusedUntilSynced) {
  auto other = CreateCudaBackend(config(), checkpoint_->weights, GpuOptions());
  ASSERT_TRUE(other.ok()) << other.status();
  ModelBackend& b = **other;
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 6);
  ContiguousKvCache kv(config(), 64), ref(config(), 64);
  Encode(b, kv, Tokens(10, 7));  // b mirrors kv
  ASSERT_TRUE(b.SyncKvToHost(kv).ok());
  Encode(*gpu_, kv, Tokens(6, 8));  // gpu_ uploads the 10 rows, keeps its 6 on the device
  ASSERT_TRUE(kv.host_rows_stale());
  std::vector<float> logits(canvas.size() * config().vocab_size);
  DecodeInput in{canvas, nullptr, &kv, logits.data()};
  EXPECT_EQ(b.Decode({&in, 1}).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(b.SyncKvToHost(kv).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(kv.host_rows_stale());
  ASSERT_TRUE(gpu_->SyncKvToHost(kv).ok());
  Encode(*copy_, ref, Tokens(10, 7));
  Encode(*copy_, ref, Tokens(6, 8));
  ExpectSameBits(Logits(b, kv, canvas), Logits(*copy_, ref, canvas), "the other backend");
}

INSTANTIATE_TEST_SUITE_P(Modes, CudaKvAuthorityTest,
                         ::testing::Values(AuthorityMode{"bf16", cuda::GemmInput::kBf16,
                                                         cpu::GemmInput::kBf16, true, false, 64},
                                           AuthorityMode{"bf16_tc", cuda::GemmInput::kBf16,
                                                         cpu::GemmInput::kBf16, true, true, 64},
                                           AuthorityMode{"bf16_tc_blocks4", cuda::GemmInput::kBf16,
                                                         cpu::GemmInput::kBf16, true, true, 4},
                                           AuthorityMode{"bf16_tc_per_sequence",
                                                         cuda::GemmInput::kBf16,
                                                         cpu::GemmInput::kBf16, true, true, 0}),
                         [](const ::testing::TestParamInfo<AuthorityMode>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace dgserve::kv