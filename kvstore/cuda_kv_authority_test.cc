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
//     contiguous and on a paged cache, whose sliding rings then hold W + 2·block − 2 rows;
//   - a mirror holding a live cache's only rows is never evicted (max_kv_mirrors = 1); once
//     synced it is;
//   - a second CUDA backend refuses a cache whose newest rows the first holds, until the first
//     syncs it;
//   - the device K/V layouts (CudaBackendOptions::kv_block_size: the block pool in blocks of 64
//     and of 4, and per-sequence arrays, the modes below) give the same bits; the pool's blocks go
//     back as sequences advance and finish, it grows keeping its rows, and at its bound (or with
//     the device out of memory) it takes idle sequences' blocks; the two kinds' pools share the
//     bound (the other compacted: held blocks moved, rows and tables kept), so one sequence may
//     take all of it, and CheckKvFits refuses one that needs more (bytes by hand).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "kvstore/block_pool.h"
#include "kvstore/kv_layout.h"
#include "kvstore/paged_kv_cache.h"
#if defined(DGSERVE_CUDA_EMULATION)
#include <cuda_runtime.h>  // the emulation's device memory limit (cuda_emu.h)
#endif

namespace dgserve::kv {
namespace {

struct AuthorityMode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  bool own_projections;
  bool tensor_core_attention;  // bf16 mirrors on the full layers of this shape (head_dim 32)
  int kv_block_size;           // CudaBackendOptions::kv_block_size (0: per-sequence mirrors)
};
void PrintTo(const AuthorityMode& m, std::ostream* os) { *os << m.name; }

class CudaKvAuthorityTest : public backend_testing::CpuGpuTest<CudaKvAuthorityTest, AuthorityMode> {
 public:
  static std::unique_ptr<Checkpoint> MakeCheckpoint() {
    return backend_testing::TinyV512Checkpoint("cuda_kv_authority_test");
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
    ASSERT_TRUE(GpuOptions().defer_kv_host_copy);  // gpu_: the default
    ASSERT_EQ(config().sliding_window, 8);
    CudaBackendOptions copy_options = GpuOptions();
    copy_options.defer_kv_host_copy = false;
    auto copy = CreateCudaBackend(config(), checkpoint_->weights, copy_options);
    ASSERT_TRUE(copy.ok()) << copy.status();
    copy_ = std::move(*copy);
  }
  void TearDown() override {
    copy_.reset();
    CpuGpuTest::TearDown();
  }

  // Whether layer l's mirror stores bf16 (CudaBackendOptions::bf16_kv_mirror on the tensor-core
  // layers: head_dim a multiple of 32).
  bool Bf16Layer(int l) const {
    return GetParam().tensor_core_attention && config().HeadDim(l) % 32 == 0;
  }
  // Device bytes SyncKvToHost moves for rows [from_full, n) of the full layers and
  // [from_sliding, n) of the sliding ones, as the mirror stores them.
  int64_t MirrorBytes(int from_full, int from_sliding, int n) const {
    int64_t bytes = 0;
    for (int l = 0; l < config().num_layers; ++l) {
      const int rows = n - (config().IsFull(l) ? from_full : from_sliding);
      bytes +=
          2 * int64_t(rows) * config().KvHeads(l) * config().HeadDim(l) * (Bf16Layer(l) ? 2 : 4);
    }
    return bytes;
  }
  // `got`'s rows [from_full | from_sliding, n) equal `want`'s (rounded to bf16 on the bf16
  // layers) bit for bit.
  void ExpectRowsOf(const KvCache& want, const KvCache& got, int from_full, int from_sliding,
                    const std::string& what) const {
    const int n = got.num_tokens();
    ASSERT_EQ(want.num_tokens(), n) << what;
    for (int l = 0; l < config().num_layers; ++l) {
      const size_t w = size_t(config().KvHeads(l)) * config().HeadDim(l);
      for (int p = config().IsFull(l) ? from_full : from_sliding; p < n; ++p) {
        for (const auto& [g, x] : {std::pair{got.KeyRow(l, p), want.KeyRow(l, p)},
                                   std::pair{got.ValueRow(l, p), want.ValueRow(l, p)}}) {
          for (size_t i = 0; i < w; ++i) {
            const float y = Bf16Layer(l) ? RoundToBf16(x[i]) : x[i];
            ASSERT_EQ(std::memcmp(&g[i], &y, sizeof(float)), 0)
                << what << ": layer " << l << " position " << p << " element " << i;
          }
        }
      }
    }
  }
  static void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b,
                             const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) differ += std::memcmp(&a[i], &b[i], 4) != 0;
    EXPECT_EQ(differ, 0u) << what;
  }

#if defined(DGSERVE_CUDA_EMULATION)
  // The device itself short of memory (the emulation's limit, `spare` bytes beyond what is in use
  // once two sequences of 100 positions hold 50 of the first 64 full blocks of 1 KiB), with no
  // bound (memory_utilization 0; under one, the other pool's compaction comes first), while a
  // third sequence of 96 positions (the encoder's buffers already that large) needs 24 full blocks
  // more. The pool grows in place into at most half the spare memory, by at least an eighth of its
  // blocks (only the new blocks' memory is needed; without a bound the rest is left to the pass's
  // other buffers); what that leaves short, it takes from the least recently used idle sequence as
  // at its bound, that sequence's rows only on the device copied to its cache first (swapped out).
  // Every sequence's logits stay the copying backend's bits. Returns the pool's stats after the
  // third sequence's pass, whether the first sequence kept its device rows, and whether its host
  // cache lacked rows then.
  CudaKvPoolStats RunThirdSequenceShortOfMemory(size_t spare, bool* first_kept, bool* first_stale) {
    const std::vector<int32_t> canvas = Tokens(config().canvas_length, 5);
    std::vector<std::unique_ptr<ContiguousKvCache>> kv, ref;
    const std::vector<int32_t> head = Tokens(96, 40), tail = Tokens(4, 44), third = Tokens(96, 42);
    for (int i = 0; i < 3; ++i) {
      kv.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
      ref.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
      if (i < 2) {
        Encode(*copy_, *ref[i], head);
        Encode(*copy_, *ref[i], tail);
      } else {
        Encode(*copy_, *ref[i], third);
      }
    }
    CudaBackendOptions unbounded = GpuOptions();
    unbounded.memory_utilization = 0;
    auto backend = CreateCudaBackend(config(), checkpoint_->weights, unbounded);
    EXPECT_TRUE(backend.ok()) << backend.status();
    if (!backend.ok()) return {};
    ModelBackend& gpu = **backend;
    // Every other buffer sized before the limit (the emulation's limit is process-wide: copy_
    // too): the reference logits, gpu's decoder pass, and its sync staging (each sequence's 96
    // rows synced, then 4 more rows on the device only).
    std::vector<std::vector<float>> want;
    for (int i = 0; i < 3; ++i) want.push_back(Logits(*copy_, *ref[i], canvas));
    for (int i = 0; i < 2; ++i) {
      Encode(gpu, *kv[i], head);
      EXPECT_TRUE(gpu.SyncKvToHost(*kv[i]).ok());
    }
    for (int i = 0; i < 2; ++i) Encode(gpu, *kv[i], tail);
    ExpectSameBits(Logits(gpu, *kv[1], canvas), want[1], "before the limit");
    EXPECT_EQ(GetCudaKvPoolStats(gpu)->full_blocks, 64);
    EXPECT_EQ(GetCudaKvPoolStats(gpu)->full_blocks_in_use, 50);
    size_t free_bytes = 0, total = 0;
    cuda::emu::SetDeviceMemoryLimit(size_t(1) << 40);
    cuda::emu::DeviceMemoryInfo(&free_bytes, &total);
    struct Unlimited {  // the limit lifted however the test ends (it is process-wide)
      ~Unlimited() { cuda::emu::SetDeviceMemoryLimit(0); }
    } unlimited;
    cuda::emu::SetDeviceMemoryLimit(total - free_bytes + spare);
    Encode(gpu, *kv[2], third);
    const CudaKvPoolStats after = GetCudaKvPoolStats(gpu).value();
    *first_kept = CudaKvMirrorBytes(gpu, *kv[0]).has_value();
    *first_stale = kv[0]->host_rows_stale();
    // The syncs of 100 rows need a larger staging than the limit leaves.
    cuda::emu::SetDeviceMemoryLimit(0);
    EXPECT_TRUE(gpu.SyncKvToHost(*kv[1]).ok());
    EXPECT_TRUE(gpu.SyncKvToHost(*kv[2]).ok());
    for (int i : {2, 1, 0}) {
      ExpectSameBits(Logits(gpu, *kv[i], canvas), want[i], "sequence " + std::to_string(i));
    }
    return after;
  }
#endif

  std::unique_ptr<ModelBackend> copy_;
};

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

// The block pool (kv_block_size > 0): a finished sequence's blocks go back to the pool at the
// next pass, and the next sequences reuse them (the pool does not grow); the per-sequence
// layout has no pool.
TEST_P(CudaKvAuthorityTest, FinishedSequencesGiveTheirBlocksBack) {
  const int B = GetParam().kv_block_size;
  if (B == 0) {
    EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->block_size, 0);
    EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->device_bytes, 0);
    return;
  }
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 9);
  ContiguousKvCache ref(config(), 128);
  Encode(*copy_, ref, Tokens(40, 1));
  CudaKvPoolStats first;
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    {
      ContiguousKvCache kv(config(), 128);
      Encode(*gpu_, kv, Tokens(40, 1));
      ExpectSameBits(Logits(*gpu_, kv, canvas), Logits(*copy_, ref, canvas), "logits");
      const CudaKvPoolStats st = GetCudaKvPoolStats(*gpu_).value();
      // Full: ⌈40 / B⌉ blocks; sliding: those of positions [40 − 7, 40) (the host lacks no row
      // it keeps: ContiguousKvCache keeps the same W − 1).
      EXPECT_EQ(st.full_blocks_in_use, (40 + B - 1) / B);
      EXPECT_EQ(st.sliding_blocks_in_use, (40 + B - 1) / B - 33 / B);
      if (round == 0) first = st;
      // The blocks of the previous rounds' sequences were reused.
      EXPECT_EQ(st.full_blocks, first.full_blocks);
      EXPECT_EQ(st.sliding_blocks, first.sliding_blocks);
      EXPECT_EQ(st.device_bytes, first.device_bytes);
    }
    // The cache is gone; its blocks are back at the next pass (of another sequence).
    ContiguousKvCache other(config(), 128);
    Encode(*gpu_, other, Tokens(3, 2));
    const CudaKvPoolStats after = GetCudaKvPoolStats(*gpu_).value();
    EXPECT_EQ(after.full_blocks_in_use, 1);
    EXPECT_EQ(after.sliding_blocks_in_use, 1);
  }
}

// Blocks of 4: three live sequences of 100 positions need 3 × 25 full blocks, so the pool grows
// from 64 to 128 blocks while the first two hold rows (in a pass that uploaded and wrote rows
// before the growth); every sequence's logits stay the copying backend's bits.
TEST_P(CudaKvAuthorityTest, PoolGrowthKeepsTheRows) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 5);
  std::vector<std::unique_ptr<ContiguousKvCache>> kv, ref;
  for (int i = 0; i < 3; ++i) {
    kv.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
    ref.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
  }
  // a and b first; then one pass over a's commit and c's prompt: a's blocks (from its window)
  // and c's 25 full blocks, more than the 14 left.
  for (int i = 0; i < 2; ++i) {
    Encode(*gpu_, *kv[i], Tokens(100, 10 + i));
    Encode(*copy_, *ref[i], Tokens(100, 10 + i));
  }
  EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->full_blocks, 64);
  EXPECT_EQ(GetCudaKvPoolStats(*gpu_)->full_blocks_in_use, 50);
  const std::vector<int32_t> commit = Tokens(8, 20), prompt = Tokens(100, 12);
  EncodeInput in[2] = {{commit, kv[0].get()}, {prompt, kv[2].get()}};
  ASSERT_TRUE(gpu_->Encode(in).ok());
  Encode(*copy_, *ref[0], commit);
  Encode(*copy_, *ref[2], prompt);
  const CudaKvPoolStats st = GetCudaKvPoolStats(*gpu_).value();
  EXPECT_EQ(st.full_blocks, 128);
  EXPECT_EQ(st.full_blocks_in_use, 27 + 25 + 25);  // a at 108 positions: 27 blocks
  for (int i = 0; i < 3; ++i) {
    ExpectSameBits(Logits(*gpu_, *kv[i], canvas), Logits(*copy_, *ref[i], canvas),
                   "sequence " + std::to_string(i));
  }
}

// kv_pool_max_bytes 128 KiB (blocks of 4: a full block is 2 layers × K, V × 4 rows × 32
// elements × 2 B (bf16) = 1,024 B, a sliding one 4 × 2 × 4 × 32 × 4 B = 4,096 B): the full pool's
// first growth takes 64 blocks (64 KiB), the sliding pool's is clipped to the 16 blocks left
// (64 KiB). Two sequences of 100 positions hold 50 full blocks, their rows on the device only
// (not synced). A third needs 25 more: the least recently used one's rows are copied to its cache
// (swapped out: as SyncKvToHost would, the copying backend's rows) and its blocks taken; a later
// pass over it uploads it again. Then, with both synced, the least recently used one's blocks
// are taken without a copy. A sequence needing more blocks than the bound holds fails with
// RESOURCE_EXHAUSTED. Every sequence's logits stay the copying backend's bits.
TEST_P(CudaKvAuthorityTest, PoolAtItsBoundTakesIdleSequencesBlocks) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  if (!backend_testing::SmallKvGranules())
    GTEST_SKIP() << "K/V pools of a few KiB: the emulation's granules only";
  CudaBackendOptions bounded = GpuOptions();
  // Below one block of each kind (5,120 B) the bound would fail every pass: refused at start.
  bounded.kv_pool_max_bytes = 5119;
  const auto tiny = CreateCudaBackend(config(), checkpoint_->weights, bounded);
  EXPECT_EQ(tiny.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(tiny.status().message().find("(5120 bytes, "), std::string::npos) << tiny.status();
  // 64 full-layer blocks (1 KiB) and 4 sliding ones (4 KiB): the two sequences below hold every
  // sliding block, so the other pool has nothing to give back (CompactKvPool) and the third
  // sequence's blocks come from a swap-out.
  bounded.kv_pool_max_bytes = 64 * 1024 + 4 * 4096;
  auto backend = CreateCudaBackend(config(), checkpoint_->weights, bounded);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ModelBackend& gpu = **backend;
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 5);
  std::vector<std::unique_ptr<ContiguousKvCache>> kv, ref;
  for (int i = 0; i < 3; ++i) {
    kv.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
    ref.push_back(std::make_unique<ContiguousKvCache>(config(), 128));
    Encode(*copy_, *ref[i], Tokens(100, 30 + i));
  }
  Encode(gpu, *kv[0], Tokens(100, 30));
  Encode(gpu, *kv[1], Tokens(100, 31));
  EXPECT_EQ(GetCudaKvPoolStats(gpu)->device_bytes, 80 * 1024);
  EXPECT_EQ(GetCudaKvPoolStats(gpu)->full_blocks, 64);
  EXPECT_EQ(GetCudaKvPoolStats(gpu)->sliding_blocks, 4);
  const std::vector<int32_t> third = Tokens(100, 32);
  ASSERT_TRUE(kv[0]->host_rows_stale());
  Encode(gpu, *kv[2], third);  // a: the least recently used, swapped out
  ASSERT_FALSE(HasFatalFailure());
  EXPECT_EQ(GetCudaKvPoolStats(gpu)->swap_outs, 1);
  EXPECT_FALSE(CudaKvMirrorBytes(gpu, *kv[0]).has_value());
  EXPECT_TRUE(CudaKvMirrorBytes(gpu, *kv[1]).has_value());
  EXPECT_FALSE(kv[0]->host_rows_stale());
  EXPECT_TRUE(kv[1]->host_rows_stale());
  ExpectRowsOf(*ref[0], *kv[0], 0, 100 - 7, "swapped out");
  EXPECT_EQ(GetCudaKvPoolStats(gpu)->full_blocks, 64);
  ASSERT_TRUE(gpu.SyncKvToHost(*kv[1]).ok());
  ASSERT_TRUE(gpu.SyncKvToHost(*kv[2]).ok());
  // b, then c: a comes back (uploaded) in the blocks of b, the least recently used, not copied.
  ExpectSameBits(Logits(gpu, *kv[1], canvas), Logits(*copy_, *ref[1], canvas), "b");
  ExpectSameBits(Logits(gpu, *kv[2], canvas), Logits(*copy_, *ref[2], canvas), "c");
  ExpectSameBits(Logits(gpu, *kv[0], canvas), Logits(*copy_, *ref[0], canvas), "a");
  EXPECT_FALSE(CudaKvMirrorBytes(gpu, *kv[1]).has_value());
  const CudaKvPoolStats st = GetCudaKvPoolStats(gpu).value();
  EXPECT_EQ(st.swap_outs, 1);
  EXPECT_EQ(st.full_blocks, 64);
  EXPECT_EQ(st.device_bytes, 80 * 1024);
  EXPECT_EQ(st.compactions, 0);
  // One sequence alone may take the whole bound: 288 positions hold 72 full blocks and the 2
  // sliding ones of [281, 288), 80 KiB. Its full blocks: the 14 free, then c's (evicted: its
  // rows are on the host), then the memory of c's 2 sliding blocks, no longer held (the sliding
  // pool compacted to a's 2, ids 2 and 3, moved to 0 and 1; the full pool grows into half the
  // 8 KiB: 4 blocks), then a's (evicted), then the 4 blocks of room left; its sliding blocks are
  // a's. 289 positions need 73 full and 3 sliding blocks: 87,040 bytes.
  const ContiguousKvCache like(config(), 300);  // keeps W − 1 sliding rows
  KvPassPlan plan;                              // one pass from position 0
  plan.positions = 288;
  EXPECT_TRUE(gpu.CheckKvFits(like, plan).ok());
  plan.positions = 289;
  const absl::Status too_long = gpu.CheckKvFits(like, plan);
  EXPECT_EQ(too_long.code(), absl::StatusCode::kOutOfRange) << too_long;
  EXPECT_NE(too_long.message().find("289 positions needs 87040 bytes"), std::string::npos)
      << too_long;
  EXPECT_NE(too_long.message().find("bound is 81920 bytes"), std::string::npos) << too_long;
  ContiguousKvCache large(config(), 300), large_ref(config(), 300);
  const std::vector<int32_t> many = Tokens(288, 33);
  Encode(gpu, large, many);
  Encode(*copy_, large_ref, many);
  ASSERT_FALSE(HasFatalFailure());
  const CudaKvPoolStats whole = GetCudaKvPoolStats(gpu).value();
  EXPECT_EQ(whole.full_blocks, 72);
  EXPECT_EQ(whole.sliding_blocks, 2);
  EXPECT_EQ(whole.device_bytes, 80 * 1024);
  EXPECT_EQ(whole.compactions, 1);
  EXPECT_EQ(whole.blocks_moved, 2);
  ExpectSameBits(Logits(gpu, large, canvas), Logits(*copy_, large_ref, canvas), "288 positions");
  // 289 positions: more than the bound holds, whatever is taken.
  ContiguousKvCache larger(config(), 300);
  const std::vector<int32_t> more = Tokens(289, 34);
  EncodeInput in{more, &larger};
  const absl::Status full = gpu.Encode({&in, 1});
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_NE(full.message().find("bound 81920 bytes"), std::string::npos) << full;
  EXPECT_EQ(larger.num_tokens(), 0);
  EXPECT_LE(GetCudaKvPoolStats(gpu)->device_bytes, 80 * 1024);
  for (int i : {2, 1, 0}) {
    ExpectSameBits(Logits(gpu, *kv[i], canvas), Logits(*copy_, *ref[i], canvas),
                   "sequence " + std::to_string(i) + " after the refusal");
  }
  ExpectSameBits(Logits(gpu, large, canvas), Logits(*copy_, large_ref, canvas),
                 "288 positions after the refusal");
}

// The two pools share the bound whichever grew first: with the full-layer pool holding most of
// it (64 blocks of 1 KiB beside 4 sliding ones of 4 KiB, 80 KiB) and every sliding block held,
// the last of two short sequences encoded in one pass gets its sliding blocks from the full
// pool's 58 blocks no sequence holds. The full pool is compacted to the 6 blocks the three live
// sequences hold, ids 21 … 26 (the first sequence of 100 positions, gone, held 0 … 24; the free
// list hands out the last id released first), which move to ids 0 … 5 (their rows copied on the
// device, the tables uploaded at once: the pass's first sequence had uploaded its own); the
// sliding pool grows into half of the 58 KiB given back (7 blocks). Every live sequence's
// logits, read through the moved blocks, and its synced rows stay the copying backend's bits.
// (Checked by hand: without the tables' upload at once, or with the moved blocks' rows not
// copied, the logits differ.)
TEST_P(CudaKvAuthorityTest, ThePoolsShareTheBoundCompactingTheOther) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  if (!backend_testing::SmallKvGranules())
    GTEST_SKIP() << "K/V pools of a few KiB: the emulation's granules only";
  CudaBackendOptions bounded = GpuOptions();
  bounded.kv_pool_max_bytes = 64 * 1024 + 4 * 4096;
  auto backend = CreateCudaBackend(config(), checkpoint_->weights, bounded);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ModelBackend& gpu = **backend;
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 5);
  auto first = std::make_unique<ContiguousKvCache>(config(), 128);
  Encode(gpu, *first, Tokens(100, 50));  // full ids 0 … 24, sliding 0 and 1
  std::vector<std::unique_ptr<ContiguousKvCache>> kv, ref;
  for (int i = 0; i < 3; ++i) {
    kv.push_back(std::make_unique<ContiguousKvCache>(config(), 32));
    ref.push_back(std::make_unique<ContiguousKvCache>(config(), 32));
    Encode(*copy_, *ref[i], Tokens(8, 51 + i));
  }
  Encode(gpu, *kv[0], Tokens(8, 51));  // full 25, 26; sliding 2, 3: every sliding block held
  CudaKvPoolStats st = GetCudaKvPoolStats(gpu).value();
  EXPECT_EQ(st.full_blocks, 64);
  EXPECT_EQ(st.sliding_blocks, 4);
  EXPECT_EQ(st.sliding_blocks_in_use, 4);
  first.reset();  // its blocks go back at the next pass
  // One pass over two sequences: the second's compaction moves the first's blocks after its
  // table was uploaded for this pass (uploaded again at once, else its rows go to the old ids).
  // kv[1]: full 24, 23; sliding 1, 0. kv[2]: full 22, 21; then no sliding block.
  const std::vector<int32_t> t1 = Tokens(8, 52), t2 = Tokens(8, 53);
  const EncodeInput both[] = {{t1, kv[1].get()}, {t2, kv[2].get()}};
  ASSERT_TRUE(gpu.Encode(both).ok());
  st = GetCudaKvPoolStats(gpu).value();
  EXPECT_EQ(st.compactions, 1);
  EXPECT_EQ(st.blocks_moved, 6);
  EXPECT_EQ(st.full_blocks, 6);
  EXPECT_EQ(st.full_blocks_in_use, 6);
  EXPECT_EQ(st.sliding_blocks, 11);
  EXPECT_EQ(st.sliding_blocks_in_use, 6);
  EXPECT_EQ(st.swap_outs, 0);
  EXPECT_EQ(st.device_bytes, 6 * 1024 + 11 * 4096);
  for (int i = 0; i < 3; ++i) {
    ExpectSameBits(Logits(gpu, *kv[i], canvas), Logits(*copy_, *ref[i], canvas),
                   "sequence " + std::to_string(i));
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(gpu.SyncKvToHost(*kv[i]).ok());
    ExpectRowsOf(*ref[i], *kv[i], 0, 1, "sequence " + std::to_string(i) + " synced");
  }
}

#if defined(DGSERVE_CUDA_EMULATION)
// 48 KiB spare: the pool grows in place from 64 to 88 blocks (24 KiB) and every sequence keeps
// its blocks. (When a pool grew by new arrays beside the old ones, doubling needed 128 KiB: the
// first sequence was swapped out.)
TEST_P(CudaKvAuthorityTest, DeviceShortOfMemoryGrowsThePoolInPlace) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  bool first_kept = false, first_stale = false;
  const CudaKvPoolStats st = RunThirdSequenceShortOfMemory(48 * 1024, &first_kept, &first_stale);
  EXPECT_EQ(st.full_blocks, 88);
  EXPECT_EQ(st.full_blocks_in_use, 74);
  EXPECT_EQ(st.swap_outs, 0);
  EXPECT_TRUE(first_kept);
  EXPECT_TRUE(first_stale);  // its last 4 rows still on the device only
}

// 15 KiB spare: half of it holds 7 blocks, fewer than an eighth of the pool (8): no growth; the
// least recently used sequence is swapped out and its blocks taken.
TEST_P(CudaKvAuthorityTest, DeviceOutOfMemoryTakesIdleSequencesBlocks) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  bool first_kept = true, first_stale = true;
  const CudaKvPoolStats st = RunThirdSequenceShortOfMemory(15 * 1024, &first_kept, &first_stale);
  EXPECT_EQ(st.full_blocks, 64);
  EXPECT_EQ(st.swap_outs, 1);
  EXPECT_FALSE(first_kept);   // the least recently used: taken,
  EXPECT_FALSE(first_stale);  // its rows copied to its cache first
}

// A growth maps at most kv_pool_max_growth_bytes. Full blocks of 4 here are 1 KiB (two layers' K
// and V, 4 rows of one bf16 head of 32), one emulated granule of each array, so a step of 8 KiB
// is 8 blocks: a sequence of 96 positions (24 full blocks, its rows on the device only) grows the
// full pool 0 → 8 → 16 → 24 blocks and maps nothing more, where doubling from 64 blocks maps 64.
// A step below one block's bytes still grows by one block. The logits are the copying backend's
// bits either way.
TEST_P(CudaKvAuthorityTest, AGrowthMapsAtMostTheStep) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  const std::vector<int32_t> prompt = Tokens(96, 12), canvas = Tokens(config().canvas_length, 13);
  ContiguousKvCache ref(config(), 128);
  Encode(*copy_, ref, prompt);
  const std::vector<float> want = Logits(*copy_, ref, canvas);
  const auto run = [&](size_t step) {
    CudaBackendOptions options = GpuOptions();
    options.kv_pool_max_growth_bytes = step;
    auto gpu = CreateCudaBackend(config(), checkpoint_->weights, options);
    EXPECT_TRUE(gpu.ok()) << gpu.status();
    if (!gpu.ok()) return CudaKvPoolStats{};
    ContiguousKvCache kv(config(), 128);
    Encode(**gpu, kv, prompt);
    const CudaKvPoolStats st = GetCudaKvPoolStats(**gpu).value();
    ExpectSameBits(Logits(**gpu, kv, canvas), want, absl::StrCat("step ", step));
    return st;
  };
  const CudaKvPoolStats doubled = run(0);
  EXPECT_EQ(doubled.full_blocks, 64);
  EXPECT_EQ(doubled.full_blocks_in_use, 24);
  const CudaKvPoolStats stepped = run(8 * 1024);
  EXPECT_EQ(stepped.full_blocks, 24);
  EXPECT_EQ(stepped.full_blocks_in_use, 24);
  // The sliding pool holds the window's 2 blocks (4 KiB each: four float32 layers): one growth
  // of 8 KiB, where doubling maps 64 blocks. 24 KiB + 8 KiB against 64 KiB + 256 KiB.
  EXPECT_EQ(stepped.sliding_blocks, 2);
  EXPECT_EQ(doubled.sliding_blocks, 64);
  EXPECT_EQ(stepped.growths, 4);
  EXPECT_EQ(doubled.growths, 2);
  EXPECT_EQ(stepped.device_bytes, 32 * 1024);
  EXPECT_EQ(doubled.device_bytes, 320 * 1024);
  const CudaKvPoolStats one_by_one = run(1);
  EXPECT_EQ(one_by_one.full_blocks, 24);
  EXPECT_EQ(one_by_one.sliding_blocks, 2);
  EXPECT_EQ(one_by_one.growths, 24 + 2);
}
#endif

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
