// The CUDA backend's device K/V block pool (CudaBackendOptions::kv_block_size; issue 34; label
// `gpu`, and `gpu-emu` under the emulation; built into cuda_backend_test / cuda_backend_emu_test
// beside cuda_kv_authority_test.cc, whose test suite and modes these tests share: fixture in
// cuda_kv_authority_test_util.h, instantiated there). On the tiny-v512 random checkpoint
// (W = 8), against the same options with the copy to the host in every pass, the logits bit for
// bit throughout:
//   - the pool's blocks go back as sequences advance and finish, and the next sequences reuse
//     them; it grows keeping its rows;
//   - at its bound (kv_pool_max_bytes) it takes idle sequences' blocks (swapping out rows only on
//     the device); the two kinds' pools share the bound (the other compacted: held blocks moved,
//     rows and tables kept), so one sequence may take all of it, and CheckKvFits refuses one that
//     needs more (bytes by hand);
//   - under the emulation, with the device itself short of memory, it grows in place or takes
//     idle sequences' blocks, and a growth maps at most kv_pool_max_growth_bytes.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/model/backend.h"
#include "engine/model/kv_cache.h"
#include "kvstore/cuda_kv_authority_test_util.h"
#if defined(DGSERVE_CUDA_EMULATION)
#include <cuda_runtime.h>  // the emulation's device memory limit (cuda_emu.h)
#endif

namespace dgserve::kv {

#if defined(DGSERVE_CUDA_EMULATION)
namespace authority_test {

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
CudaKvPoolStats CudaKvAuthorityTest::RunThirdSequenceShortOfMemory(size_t spare, bool* first_kept,
                                                                   bool* first_stale) {
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

}  // namespace authority_test
#endif

namespace {

using authority_test::CudaKvAuthorityTest;

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

// CheckKvFitsTogether (the denoise worker's admission) at a bound of 80 KiB (full blocks of
// 1 KiB, sliding ones of 4 KiB, as above). A sequence of P positions in one pass from position 0,
// on a cache keeping W − 1 = 7 sliding rows (its rows deferred: the host lacks them), holds
// ⌈P / 4⌉ full blocks and the sliding blocks of [P − 7, P): 128 positions 32 full and 2 sliding
// (40 KiB), 129 positions 33 and 3 (45 KiB), 100 positions 25 and 2 (33 KiB). Two of 128:
// exactly the bound; 128 and 129: 87,040 bytes, refused naming the blocks; three of 100:
// 101,376 bytes; the same three as forks sharing the first 96 rows (24 whole full blocks each
// for the second and third): 27 full and 6 sliding, 52,224 bytes, fit, unless share_kv_blocks is
// off.
TEST_P(CudaKvAuthorityTest, SequencesFitTogetherByTheirLargestPasses) {
  if (GetParam().kv_block_size != 4) GTEST_SKIP() << "blocks of 4 only";
  if (!backend_testing::SmallKvGranules())
    GTEST_SKIP() << "K/V pools of a few KiB: the emulation's granules only";
  for (const bool share : {true, false}) {
    CudaBackendOptions bounded = GpuOptions();
    bounded.kv_pool_max_bytes = 64 * 1024 + 4 * 4096;
    bounded.share_kv_blocks = share;
    auto backend = CreateCudaBackend(config(), checkpoint_->weights, bounded);
    ASSERT_TRUE(backend.ok()) << backend.status();
    const ModelBackend& gpu = **backend;
    const ContiguousKvCache like(config(), 300);
    const auto seq = [&](int64_t positions, int64_t shared_rows = 0) {
      KvSequencePlan p;
      p.like = &like;
      p.plan.positions = positions;
      p.shared_rows = shared_rows;
      return p;
    };
    EXPECT_TRUE(gpu.CheckKvFitsTogether({}).ok());
    const std::vector<KvSequencePlan> at_bound = {seq(128), seq(128)};
    EXPECT_TRUE(gpu.CheckKvFitsTogether(at_bound).ok());
    const std::vector<KvSequencePlan> over = {seq(128), seq(129)};
    const absl::Status refused = gpu.CheckKvFitsTogether(over);
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_NE(refused.message().find("2 sequences at their largest passes need 87040 bytes of "
                                     "device K/V blocks at once (65 full-attention and 5 "
                                     "sliding-window blocks of 4 positions)"),
              std::string::npos)
        << refused;
    EXPECT_NE(refused.message().find("bound is 81920 bytes"), std::string::npos) << refused;
    // Each alone fits (CheckKvFits agrees).
    EXPECT_TRUE(gpu.CheckKvFits(like, over[1].plan).ok());
    const std::vector<KvSequencePlan> three = {seq(100), seq(100), seq(100)};
    const absl::Status three_refused = gpu.CheckKvFitsTogether(three);
    EXPECT_EQ(three_refused.code(), absl::StatusCode::kResourceExhausted) << three_refused;
    EXPECT_NE(three_refused.message().find("need 101376 bytes"), std::string::npos)
        << three_refused;
    const std::vector<KvSequencePlan> forks = {seq(100), seq(100, 96), seq(100, 96)};
    const absl::Status forks_fit = gpu.CheckKvFitsTogether(forks);
    if (share) {
      EXPECT_TRUE(forks_fit.ok()) << forks_fit;
    } else {
      EXPECT_NE(forks_fit.message().find("need 101376 bytes"), std::string::npos) << forks_fit;
    }
    const std::vector<KvSequencePlan> no_cache = {KvSequencePlan{}};
    EXPECT_EQ(gpu.CheckKvFitsTogether(no_cache).code(), absl::StatusCode::kInvalidArgument);
  }
}
#endif

}  // namespace
}  // namespace dgserve::kv
