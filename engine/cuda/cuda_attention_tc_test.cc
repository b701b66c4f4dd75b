// The tensor-core attention kernels (TensorCoreCanvasAttention with split-KV,
// TensorCorePrefillAttention) against a float64 reference of spec §3.1.5 / §3.4 / §3.5 (label
// `gpu`; skipped without a GPU).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_attention_test_util.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda::attention_test {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

// A null segment table of the float32-context overloads (a bare nullptr is ambiguous).
constexpr const CanvasSegment* kNoSegments = nullptr;

// ---- TensorCoreCanvasAttention: many canvases in one launch, bf16 operands ----

// Round to bf16 (nearest even) and back, as the kernel stages Q, K and V.
float RoundBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&f, &b, 4);
  return f;
}

Data RoundedData(const Data& d) {
  Data r = d;
  for (std::vector<float>* v : {&r.q, &r.k_ctx, &r.v_ctx, &r.k_new, &r.v_new}) {
    for (float& x : *v) x = RoundBf16(x);
  }
  return r;
}

// Tolerances (observed worst under the emulation, these shapes: 1.3e-3 and 8.1e-3): against
// the float64 reference on the bf16-rounded inputs (only P's bf16 rounding and float32 sums
// differ) and against the float64 reference on the float32 inputs (bf16 Q, K, V).
constexpr float kTcTolRounded = 3e-3f;
constexpr float kTcTolFloat = 2e-2f;

struct TcSegment {
  int ctx, rows, window;
  int ring = 0;  // > 0: the context as a ring of this many rows (ToRing), CanvasSegment::ring
  // block > 0: the context paged in blocks of `block` tokens from slot first_slot (ToPaged),
  // CanvasSegment::block_table.
  int block = 0, first_slot = 0;
};

// The tensor-core kernels' fixture: kind_ picks TensorCoreCanvasAttention or
// TensorCorePrefillAttention (the prefill takes one window for the whole launch: every segment of
// a batch must have the same window).
class TensorCoreAttentionTest : public CudaAttentionTest {
 protected:
  explicit TensorCoreAttentionTest(Kind kind) : kind_(kind) {}

  // Runs `segs` (heads/kv_heads/hd shared) in one launch, rows packed in order with `gap` unused
  // rows before each segment; returns each segment's output rows. Prefill segments see context
  // from ctx_first = row 0's window start (or 0 with ctx_first_zero: the row rule alone).
  // Canvas with split_keys > 0: split-KV with splits of split_keys keys and max_splits the
  // largest CanvasSplitCount of `segs` (or `max_splits` when > 0); the scratch starts as NaN.
  // With bf16_ctx_ the contexts are uploaded as bf16 bits (dgserve::FloatToBf16 of each element,
  // NaN kept) and run through the CanvasSegmentBf16 overloads.
  std::vector<std::vector<float>> RunBatch(const std::vector<TcSegment>& segs,
                                           const std::vector<Data>& data, int heads, int kvh,
                                           int hd, int gap = 1, bool ctx_first_zero = false,
                                           int split_keys = 0, int max_splits = 0) {
    const size_t qw = size_t(heads) * hd, kw = size_t(kvh) * hd;
    std::vector<CanvasSegment> table;
    std::vector<CanvasSegmentBf16> table16;  // bf16_ctx_: the same segments, bf16 contexts
    std::vector<float> q, k, v;
    int row = 0;
    for (size_t i = 0; i < segs.size(); ++i) {
      row += gap;
      q.resize(row * qw, 0.0f);
      k.resize(row * kw, 0.0f);
      v.resize(row * kw, 0.0f);
      CanvasSegment t;
      t.row0 = row;
      t.rows = segs[i].rows;
      t.ctx_tokens = segs[i].ctx;
      t.ctx_first = CanvasWindowStart(segs[i].ctx, segs[i].window);
      std::vector<float> kc, vc;
      if (segs[i].ctx > 0 && segs[i].block > 0) {
        // A paged pool: the visible rows' blocks out of order, NaN in every other row.
        PagedContext pc = ToPaged(data[i].k_ctx, data[i].v_ctx, t.ctx_first, t.ctx_tokens, int(kw),
                                  segs[i].block, segs[i].first_slot, uint32_t(100 + i));
        t.block_table = Upload(pc.table);
        t.block_size = segs[i].block;
        t.first_slot = segs[i].first_slot;
        kc = std::move(pc.k);
        vc = std::move(pc.v);
      } else if (segs[i].ctx > 0 && segs[i].ring > 0) {
        // A sliding layer's ring: the window's rows only, NaN elsewhere.
        t.ring = segs[i].ring;
        kc = ToRing(data[i].k_ctx, t.ctx_first, t.ctx_tokens, int(kw), t.ring);
        vc = ToRing(data[i].v_ctx, t.ctx_first, t.ctx_tokens, int(kw), t.ring);
      } else if (segs[i].ctx > 0) {
        // Context before ctx_first is never read: NaN there would show in the output.
        kc = data[i].k_ctx;
        vc = data[i].v_ctx;
        std::fill_n(kc.begin(), size_t(t.ctx_first) * kw, NAN);
        std::fill_n(vc.begin(), size_t(t.ctx_first) * kw, NAN);
      }
      CanvasSegmentBf16 t16;
      if (!kc.empty() && bf16_ctx_) {
        t16.ctx_k = Upload(ToBf16(kc));
        t16.ctx_v = Upload(ToBf16(vc));
      } else if (!kc.empty()) {
        t.ctx_k = Upload(kc);
        t.ctx_v = Upload(vc);
      }
      t16.row0 = t.row0;
      t16.rows = t.rows;
      t16.ctx_tokens = t.ctx_tokens;
      t16.ctx_first = t.ctx_first;
      t16.ring = t.ring;
      t16.block_table = t.block_table;
      t16.block_size = t.block_size;
      t16.first_slot = t.first_slot;
      table.push_back(t);
      table16.push_back(t16);
      q.insert(q.end(), data[i].q.begin(), data[i].q.end());
      k.insert(k.end(), data[i].k_new.begin(), data[i].k_new.end());
      v.insert(v.end(), data[i].v_new.begin(), data[i].v_new.end());
      row += segs[i].rows;
    }
    const int total = row;
    float* out = Alloc<float>(total * qw, 0xFF);
    if (kind_ == Kind::kCanvas && split_keys > 0) {
      int splits = 1;
      for (const CanvasSegment& t : table) {
        splits = std::max(splits, CanvasSplitCount(t.ctx_tokens, t.ctx_first, split_keys));
      }
      if (max_splits > 0) splits = max_splits;
      last_max_splits_ = splits;
      const size_t bytes = TensorCoreCanvasScratchBytes(total, heads, hd, splits);
      float* scratch = bytes == 0 ? nullptr : Alloc<float>(bytes / sizeof(float), 0xFF);
      EXPECT_THAT(bf16_ctx_
                      ? TensorCoreCanvasAttention(Upload(q), Upload(k), Upload(v), Upload(table16),
                                                  int(table.size()), total, heads, kvh, hd, splits,
                                                  split_keys, scratch, out)
                      : TensorCoreCanvasAttention(Upload(q), Upload(k), Upload(v), Upload(table),
                                                  int(table.size()), total, heads, kvh, hd, splits,
                                                  split_keys, scratch, out),
                  IsOk());
    } else if (kind_ == Kind::kCanvas) {
      EXPECT_THAT(bf16_ctx_
                      ? TensorCoreCanvasAttention(Upload(q), Upload(k), Upload(v), Upload(table16),
                                                  int(table.size()), total, heads, kvh, hd, out)
                      : TensorCoreCanvasAttention(Upload(q), Upload(k), Upload(v), Upload(table),
                                                  int(table.size()), total, heads, kvh, hd, out),
                  IsOk());
    } else {
      // PrefillSegment(Bf16) = CanvasSegment(Bf16): the table with each ctx_first chosen.
      for (size_t i = 0; i < table.size(); ++i) {
        EXPECT_EQ(segs[i].window, segs[0].window) << "one window per prefill launch";
        if (ctx_first_zero) table[i].ctx_first = table16[i].ctx_first = 0;
      }
      const int window = segs.empty() ? 0 : segs[0].window;
      EXPECT_THAT(
          bf16_ctx_
              ? TensorCorePrefillAttention(Upload(q), Upload(k), Upload(v), Upload(table16),
                                           int(table.size()), total, heads, kvh, hd, window, out)
              : TensorCorePrefillAttention(Upload(q), Upload(k), Upload(v), Upload(table),
                                           int(table.size()), total, heads, kvh, hd, window, out),
          IsOk());
    }
    const std::vector<float> all = Download(out, total * qw);
    std::vector<std::vector<float>> res;
    for (const CanvasSegment& t : table) {
      res.emplace_back(all.begin() + t.row0 * qw, all.begin() + (t.row0 + t.rows) * qw);
    }
    // Rows of no segment are left untouched (0xFF bytes: NaN).
    for (const CanvasSegment& t : table) {
      for (size_t i = 0; i < qw; ++i) EXPECT_TRUE(std::isnan(all[(t.row0 - 1) * qw + i]));
    }
    return res;
  }

  void CheckBatch(int heads, int kvh, int hd, const std::vector<TcSegment>& segs, uint32_t seed,
                  bool ctx_first_zero = false, int split_keys = 0) {
    std::vector<Data> data;
    std::vector<Case> cases;
    for (const TcSegment& s : segs) {
      const float scale = std::sqrt(6.0f / std::sqrt(float(hd)));
      cases.push_back(Case{kind_, heads, kvh, hd, s.ctx, s.rows, s.window, scale});
      data.push_back(MakeData(cases.back(), seed++));
    }
    const std::vector<std::vector<float>> got =
        RunBatch(segs, data, heads, kvh, hd, 1, ctx_first_zero, split_keys);
    for (size_t i = 0; i < segs.size(); ++i) {
      const float rounded = Worst(got[i], Reference(cases[i], RoundedData(data[i])));
      const float plain = Worst(got[i], Reference(cases[i], data[i]));
      worst_rounded_ = std::max(worst_rounded_, rounded);
      worst_float_ = std::max(worst_float_, plain);
      Expect(cases[i], got[i], Reference(cases[i], RoundedData(data[i])), kTcTolRounded);
      Expect(cases[i], got[i], Reference(cases[i], data[i]), kTcTolFloat);
    }
  }

  static float Worst(const std::vector<float>& got, const std::vector<float>& want) {
    float worst = 0;
    for (size_t i = 0; i < got.size() && i < want.size(); ++i) {
      worst = std::max(worst, std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - want[i]));
    }
    return worst;
  }

  // A case and its data per segment (seeds seed, seed + 1, …), with CheckBatch's scale.
  void MakeCases(int heads, int kvh, int hd, const std::vector<TcSegment>& segs, uint32_t seed,
                 std::vector<Case>* cases, std::vector<Data>* data) const {
    const float scale = std::sqrt(6.0f / std::sqrt(float(hd)));  // as CheckBatch's
    for (const TcSegment& s : segs) {
      cases->push_back(Case{kind_, heads, kvh, hd, s.ctx, s.rows, s.window, scale});
      data->push_back(MakeData(cases->back(), seed++));
    }
  }

  // The segments with their context as a ring (`rings`, one per segment) give the contiguous
  // context's bits, and the float64 reference within kTcTolFloat.
  void CheckRing(int heads, int kvh, int hd, std::vector<TcSegment> segs,
                 const std::vector<int>& rings, uint32_t seed) {
    std::vector<Data> data;
    std::vector<Case> cases;
    MakeCases(heads, kvh, hd, segs, seed, &cases, &data);
    const std::vector<std::vector<float>> linear = RunBatch(segs, data, heads, kvh, hd);
    for (size_t i = 0; i < segs.size(); ++i) segs[i].ring = rings[i];
    const std::vector<std::vector<float>> ringed = RunBatch(segs, data, heads, kvh, hd);
    for (size_t s = 0; s < segs.size(); ++s) {
      ASSERT_EQ(ringed[s].size(), linear[s].size());
      for (size_t i = 0; i < linear[s].size(); ++i) {
        ASSERT_EQ(std::memcmp(&ringed[s][i], &linear[s][i], 4), 0)
            << cases[s].Name() << " ring " << rings[s] << " element " << i;
      }
      Expect(cases[s], ringed[s], Reference(cases[s], data[s]), kTcTolFloat);
    }
  }

  static std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
    std::vector<uint16_t> b(x.size());
    for (size_t i = 0; i < x.size(); ++i) b[i] = FloatToBf16(x[i]);
    return b;
  }

  static int PagedSegments(const std::vector<TcSegment>& segs) {
    return int(
        std::count_if(segs.begin(), segs.end(), [](const TcSegment& s) { return s.block > 0; }));
  }

  // `segs` as given (contiguous, ring or paged contexts: TcSegment::block > 0) on a float32 and
  // on a bf16 context (CanvasSegmentBf16: the float32 context rounded by FloatToBf16; the kernel
  // rounds each element it loads the same way) give the bits of the same segments with
  // contiguous float32 contexts, and the float64 reference within kTcTolFloat. Without a paged
  // segment the float32 run is the contiguous one and runs once. split_keys > 0: the canvas's
  // split-KV.
  void CheckContextLayouts(int heads, int kvh, int hd, const std::vector<TcSegment>& segs,
                           uint32_t seed, int split_keys = 0) {
    std::vector<Data> data;
    std::vector<Case> cases;
    MakeCases(heads, kvh, hd, segs, seed, &cases, &data);
    std::vector<TcSegment> contiguous = segs;
    for (TcSegment& s : contiguous) s.block = s.first_slot = 0;
    const bool paged = PagedSegments(segs) > 0;
    bf16_ctx_ = false;
    const std::vector<std::vector<float>> linear =
        RunBatch(contiguous, data, heads, kvh, hd, 1, false, split_keys);
    const std::vector<std::vector<float>> f32 =
        paged ? RunBatch(segs, data, heads, kvh, hd, 1, false, split_keys) : linear;
    bf16_ctx_ = true;
    const std::vector<std::vector<float>> b16 =
        RunBatch(segs, data, heads, kvh, hd, 1, false, split_keys);
    bf16_ctx_ = false;
    for (size_t s = 0; s < segs.size(); ++s) {
      ASSERT_EQ(f32[s].size(), linear[s].size());
      ASSERT_EQ(b16[s].size(), linear[s].size());
      for (size_t i = 0; i < linear[s].size(); ++i) {
        ASSERT_EQ(std::memcmp(&f32[s][i], &linear[s][i], 4), 0)
            << cases[s].Name() << " float32, ring " << segs[s].ring << " block " << segs[s].block
            << " first_slot " << segs[s].first_slot << " element " << i;
        ASSERT_EQ(std::memcmp(&b16[s][i], &linear[s][i], 4), 0)
            << cases[s].Name() << " bf16, ring " << segs[s].ring << " block " << segs[s].block
            << " first_slot " << segs[s].first_slot << " element " << i;
      }
      // Not vacuous: the float64 reference on the float32 inputs.
      Expect(cases[s], linear[s], Reference(cases[s], data[s]), kTcTolFloat);
    }
  }

  const Kind kind_;
  bool bf16_ctx_ = false;  // RunBatch: bf16 contexts (CanvasSegmentBf16)
  int last_max_splits_ = 0;
  float worst_rounded_ = 0, worst_float_ = 0;  // the largest errors CheckBatch saw
};

class TensorCoreCanvasAttentionTest : public TensorCoreAttentionTest {
 protected:
  TensorCoreCanvasAttentionTest() : TensorCoreAttentionTest(Kind::kCanvas) {}
};

class TensorCorePrefillAttentionTest : public TensorCoreAttentionTest {
 protected:
  TensorCorePrefillAttentionTest() : TensorCoreAttentionTest(Kind::kPrefill) {}
};

// Both model head dims with the model's GQA groups (2 sliding, 8 full) and group 1; in each
// launch several canvases of different lengths: odd row counts (not multiples of 16), context 0,
// windows whose edge falls inside the context (ctx = W − 1: all visible; ctx = W: one hidden;
// ctx ≫ W), full attention over several key tiles, and one segment per window mode.
TEST_F(TensorCoreCanvasAttentionTest, MatchesDoubleReference) {
  const std::vector<TcSegment> segs = {{0, 7, 0},   {0, 5, 8},  {7, 3, 8},  {8, 13, 8},  {45, 9, 8},
                                       {45, 19, 0}, {70, 1, 0}, {3, 16, 0}, {33, 17, 16}};
  CheckBatch(4, 2, 256, segs, 3000);
  CheckBatch(8, 1, 512, segs, 3100);
  CheckBatch(4, 4, 64, segs, 3200);
}

// A sliding layer's ring (CanvasSegment::ring: W − 1 rows, the least the window needs, W, and
// odd sizes; contexts up to several rings long, so rows wrap; NaN outside the window) gives the
// contiguous context's result bit for bit, beside contiguous segments in the same launch.
TEST_F(TensorCoreCanvasAttentionTest, RingContextMatchesContiguous) {
  const std::vector<TcSegment> segs = {{0, 7, 8},  {7, 3, 8},   {8, 13, 8},
                                       {45, 9, 8}, {70, 1, 16}, {33, 17, 16}};
  CheckRing(4, 2, 256, segs, {7, 7, 8, 13, 15, 0}, 3400);
  CheckRing(8, 1, 512, segs, {8, 9, 7, 7, 16, 21}, 3500);
}

// A paged context (CanvasSegmentOf::block_table; ToPaged: blocks out of order in a pool with NaN
// in unused blocks and rows) gives the contiguous context's bits, float32 and bf16 pools: blocks
// of 16 (one table read per key), 32 and 64 tokens; first_slot 0, mid-block and a whole block
// in; contexts not multiples of the block size, one of exactly two blocks, none; sliding windows
// starting mid-block (ctx 300, W 100: slots 301 … 399 over blocks of 64); beside contiguous and
// ring segments in the same launch. Unsplit and split-KV (splits of 32 and 64 keys, boundaries
// counted from context token 0, so not at the block boundaries when first_slot is not a
// multiple of the block size).
TEST_F(TensorCoreCanvasAttentionTest, PagedContextMatchesContiguous) {
  const std::vector<TcSegment> segs = {
      {45, 9, 8, 0, 32, 5}, {70, 5, 0, 0, 32, 0},      {150, 17, 0, 0, 64, 40},
      {0, 7, 0, 0, 32, 3},  {100, 3, 16, 0, 16, 7},    {33, 13, 16},
      {45, 3, 8, 7},        {300, 6, 100, 0, 64, 100}, {64, 11, 0, 0, 32, 32}};
  ASSERT_GT(PagedSegments(segs), 0);
  CheckContextLayouts(4, 2, 256, segs, 8000);
  CheckContextLayouts(8, 1, 512, segs, 8100);
  CheckContextLayouts(4, 2, 256, segs, 8200, /*split_keys=*/32);
  EXPECT_EQ(last_max_splits_, 5);  // ctx 150 without a window: keys 0 … 149
  CheckContextLayouts(4, 4, 64, segs, 8300, /*split_keys=*/64);
}

// A bf16 context (CanvasSegmentBf16, the backend's bf16 KV mirror) gives the float32 context's
// bits: contiguous (full and windowed, NaN before the window) and ring contexts (rows wrap) in
// one launch, both head dims, unsplit and split-KV (splits of 32 keys: up to three splits).
TEST_F(TensorCoreCanvasAttentionTest, Bf16ContextEqualsFloat32ContextBitForBit) {
  const std::vector<TcSegment> segs = {{0, 7, 0},        {45, 9, 8},    {70, 5, 0},
                                       {33, 17, 16, 21}, {45, 3, 8, 7}, {8, 13, 8, 8}};
  CheckContextLayouts(4, 2, 256, segs, 3600);
  CheckContextLayouts(8, 1, 512, segs, 3700);
  CheckContextLayouts(4, 2, 256, segs, 3800, /*split_keys=*/32);
}

// Large scores (standard deviation about 30): the running max keeps exp() in range across tiles.
TEST_F(TensorCoreCanvasAttentionTest, LargeScoresStayStable) {
  const int hd = 256;
  const Case c{Kind::kCanvas, 4, 2, hd, 70, 11, 0, std::sqrt(90.0f / std::sqrt(float(hd)))};
  const Data d = MakeData(c, 3300);
  const std::vector<std::vector<float>> got = RunBatch({{c.ctx, c.rows, 0}}, {d}, 4, 2, hd);
  Expect(c, got[0], Reference(c, RoundedData(d)), 2e-2f);
}

// A segment's result is the same bit for bit alone or in a batch (another row offset, other
// segments before and after it).
TEST_F(TensorCoreCanvasAttentionTest, BatchedEqualsSolo) {
  for (const int hd : {256, 512}) {
    const int heads = 4, kvh = hd == 512 ? 1 : 2;
    const std::vector<TcSegment> segs = {{20, 9, 8}, {37, 11, hd == 512 ? 0 : 8}, {0, 21, 0}};
    std::vector<Data> data;
    for (size_t i = 0; i < segs.size(); ++i) {
      data.push_back(MakeData(
          Case{Kind::kCanvas, heads, kvh, hd, segs[i].ctx, segs[i].rows, segs[i].window, 1.0f},
          uint32_t(3400 + hd + i)));
    }
    const std::vector<std::vector<float>> batched = RunBatch(segs, data, heads, kvh, hd, 3);
    const std::vector<std::vector<float>> solo = RunBatch({segs[1]}, {data[1]}, heads, kvh, hd);
    ASSERT_EQ(batched[1].size(), solo[0].size());
    for (size_t i = 0; i < solo[0].size(); ++i) {
      ASSERT_EQ(batched[1][i], solo[0][i]) << "head_dim " << hd << " element " << i;
    }
  }
}

// ---- Split-KV (TensorCoreCanvasAttention with max_splits > 1) ----

// Splits of 64 keys (two key tiles) and of 32 (one tile): contexts in one split (0, 40, exactly
// 64), two (65: one key past the boundary), three and five; sliding windows starting mid-split
// (ctx 300, W 100: from 201 inside split 3; ctx 128, W 8: 121, all in split 1), exactly at a
// boundary (ctx 200, W 73: from 128) and hiding the whole context (W 1: canvas keys alone); full
// layers (window 0) across several splits; GQA groups 2, 8 and 1; every segment in one call
// whose max_splits is the longest segment's count.
TEST_F(TensorCoreCanvasAttentionTest, SplitKvMatchesDoubleReference) {
  const std::vector<TcSegment> segs = {{0, 7, 0},    {40, 5, 0},   {64, 9, 0},    {65, 3, 0},
                                       {150, 17, 0}, {300, 11, 0}, {300, 6, 100}, {128, 13, 8},
                                       {200, 4, 73}, {128, 5, 1}};
  CheckBatch(4, 2, 256, segs, 7000, false, /*split_keys=*/64);
  EXPECT_EQ(last_max_splits_, 5);
  CheckBatch(8, 1, 512, segs, 7100, false, 64);
  CheckBatch(4, 4, 64, segs, 7200, false, 32);
  EXPECT_EQ(last_max_splits_, 10);
  // The model's sliding shape (group 2, head_dim 256) with a window wider than a split.
  CheckBatch(16, 8, 256, {{190, 9, 70}, {33, 16, 70}}, 7300, false, 32);
  std::printf("split-KV worst |error|: %.3g (bf16-rounded inputs), %.3g (float32 inputs)\n",
              worst_rounded_, worst_float_);
}

// Large scores (standard deviation about 30) over five splits whose maxima differ widely: the
// combine's rescale keeps exp() in range.
TEST_F(TensorCoreCanvasAttentionTest, SplitKvLargeScoresStayStable) {
  const int hd = 256;
  const Case c{Kind::kCanvas, 4, 2, hd, 150, 11, 0, std::sqrt(90.0f / std::sqrt(float(hd)))};
  const Data d = MakeData(c, 7400);
  const std::vector<std::vector<float>> got =
      RunBatch({{c.ctx, c.rows, 0}}, {d}, 4, 2, hd, 1, false, /*split_keys=*/32);
  EXPECT_EQ(last_max_splits_, 5);
  Expect(c, got[0], Reference(c, RoundedData(d)), 2e-2f);
}

// A row's result is the same bits alone or batched: a long segment (four splits) alone and
// between others (max_splits 4 or 6); a short segment (one split) alone — the unsplit launch,
// max_splits 1 — and batched with longer ones (the split launch and the combine); a segment
// with a sliding window alone and batched.
TEST_F(TensorCoreCanvasAttentionTest, SplitKvBatchedEqualsSolo) {
  for (const int hd : {256, 512}) {
    const int heads = 4, kvh = hd == 512 ? 1 : 2, split = 64;
    const std::vector<TcSegment> segs = {
        {20, 9, 0}, {250, 11, 0}, {60, 5, 0}, {380, 7, 0}, {230, 13, 90}};
    std::vector<Data> data;
    for (size_t i = 0; i < segs.size(); ++i) {
      data.push_back(MakeData(
          Case{Kind::kCanvas, heads, kvh, hd, segs[i].ctx, segs[i].rows, segs[i].window, 1.0f},
          uint32_t(7500 + hd + i)));
    }
    const std::vector<std::vector<float>> batched =
        RunBatch(segs, data, heads, kvh, hd, 3, false, split);
    EXPECT_EQ(last_max_splits_, 6);
    for (const size_t i : {size_t(0), size_t(1), size_t(2), size_t(4)}) {
      const std::vector<std::vector<float>> solo =
          RunBatch({segs[i]}, {data[i]}, heads, kvh, hd, 1, false, split);
      EXPECT_EQ(last_max_splits_, i == 1 ? 4 : i == 4 ? 2 : 1);
      ASSERT_EQ(batched[i].size(), solo[0].size());
      for (size_t j = 0; j < solo[0].size(); ++j) {
        ASSERT_EQ(batched[i][j], solo[0][j])
            << "head_dim " << hd << " segment " << i << " element " << j;
      }
    }
    // One split through the split launch equals the unsplit launch bit for bit.
    const std::vector<std::vector<float>> unsplit = RunBatch({segs[0]}, {data[0]}, heads, kvh, hd);
    const std::vector<std::vector<float>> forced =
        RunBatch({segs[0]}, {data[0]}, heads, kvh, hd, 1, false, split, /*max_splits=*/3);
    for (size_t j = 0; j < unsplit[0].size(); ++j) {
      ASSERT_EQ(forced[0][j], unsplit[0][j]) << "head_dim " << hd << " element " << j;
    }
  }
}

// A bound below a segment's split count is the caller's bug: that segment's rows are NaN (loud),
// the others exact.
TEST_F(TensorCoreCanvasAttentionTest, SplitKvBoundTooSmallGivesNaN) {
  const int hd = 64, heads = 4, kvh = 2;
  const std::vector<TcSegment> segs = {{200, 3, 0}, {30, 4, 0}};
  std::vector<Data> data;
  for (size_t i = 0; i < segs.size(); ++i) {
    data.push_back(MakeData(Case{Kind::kCanvas, heads, kvh, hd, segs[i].ctx, segs[i].rows, 0, 1.0f},
                            uint32_t(7700 + i)));
  }
  const std::vector<std::vector<float>> got =
      RunBatch(segs, data, heads, kvh, hd, 1, false, /*split_keys=*/32, /*max_splits=*/3);
  for (const float x : got[0]) ASSERT_TRUE(std::isnan(x));
  for (const float x : got[1]) ASSERT_FALSE(std::isnan(x));
}

TEST(TensorCoreCanvasAttentionArgsTest, SplitKvArguments) {
  // Split counts: boundaries at multiples of split_keys from context token 0.
  EXPECT_EQ(CanvasSplitCount(0, 0, 64), 1);
  EXPECT_EQ(CanvasSplitCount(64, 0, 64), 1);
  EXPECT_EQ(CanvasSplitCount(65, 0, 64), 2);
  EXPECT_EQ(CanvasSplitCount(300, 201, 64), 2);  // splits 3 and 4
  EXPECT_EQ(CanvasSplitCount(128, 128, 64), 1);  // no visible context: the canvas keys alone
  EXPECT_EQ(CanvasSplitCount(32768, 0), 8);      // kCanvasSplitKeys = 4096
  EXPECT_EQ(CanvasSplitCount(32768, 32768 - 1023), 1);
  EXPECT_EQ(TensorCoreCanvasScratchBytes(10, 4, 64, 1), 0u);
  EXPECT_EQ(TensorCoreCanvasScratchBytes(10, 4, 64, 3), sizeof(float) * 3 * 10 * 4 * 66);
  // split_keys not a multiple of 32, max_splits < 1, no scratch for max_splits > 1.
  EXPECT_THAT(TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 0, 0, 4, 2, 256, 2,
                                        48, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 0, 0, 4, 2, 256, 0,
                                        64, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  float dummy = 0;
  const CanvasSegment* seg = reinterpret_cast<const CanvasSegment*>(&dummy);
  EXPECT_THAT(TensorCoreCanvasAttention(&dummy, &dummy, &dummy, seg, 1, 4, 4, 2, 256, 2, 64,
                                        nullptr, &dummy),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// CheckCanvasSegment: the host-side rules of a segment (the launches trust the device table).
TEST(TensorCoreCanvasAttentionArgsTest, CheckCanvasSegment) {
  float dummy = 0;
  const int32_t table[2] = {0, 1};
  CanvasSegment ok;
  ok.ctx_k = ok.ctx_v = &dummy;
  ok.rows = 4;
  ok.ctx_tokens = 40;
  ok.ctx_first = 33;
  EXPECT_THAT(CheckCanvasSegment(ok), IsOk());  // contiguous
  CanvasSegment s = ok;
  s.ring = 7;
  EXPECT_THAT(CheckCanvasSegment(s), IsOk());  // a ring of the 7 visible tokens
  s.ring = 6;
  EXPECT_THAT(CheckCanvasSegment(s), StatusIs(absl::StatusCode::kInvalidArgument));
  s = ok;
  s.block_table = table;
  s.block_size = 32;
  s.first_slot = 5;
  EXPECT_THAT(CheckCanvasSegment(s), IsOk());  // paged
  s.block_size = 16;
  EXPECT_THAT(CheckCanvasSegment(s), IsOk());  // smaller blocks: read one table entry per key
  CanvasSegmentBf16 b;
  b.ctx_k = b.ctx_v = reinterpret_cast<const uint16_t*>(&dummy);
  b.ctx_tokens = 40;
  b.block_table = table;
  b.block_size = 32;
  EXPECT_THAT(CheckCanvasSegment(b), IsOk());
  b.ring = 40;  // a ring and a block table
  EXPECT_THAT(CheckCanvasSegment(b), StatusIs(absl::StatusCode::kInvalidArgument));
  for (const auto& bad : std::vector<std::pair<const char*, void (*)(CanvasSegment&)>>{
           {"ring and table", [](CanvasSegment& x) { x.ring = 40; }},
           {"block_size 0", [](CanvasSegment& x) { x.block_size = 0; }},
           {"negative first_slot", [](CanvasSegment& x) { x.first_slot = -1; }},
           {"slots past 2^31", [](CanvasSegment& x) { x.first_slot = INT32_MAX - 40; }},
           {"ctx_first past ctx_tokens", [](CanvasSegment& x) { x.ctx_first = 41; }},
           {"negative rows", [](CanvasSegment& x) { x.rows = -1; }},
           {"no context K", [](CanvasSegment& x) { x.ctx_k = nullptr; }}}) {
    s = ok;
    s.block_table = table;
    s.block_size = 32;
    bad.second(s);
    EXPECT_THAT(CheckCanvasSegment(s), StatusIs(absl::StatusCode::kInvalidArgument)) << bad.first;
  }
  s = ok;
  s.ctx_first = s.ctx_tokens;  // no visible context: no pointers needed
  s.ctx_k = s.ctx_v = nullptr;
  EXPECT_THAT(CheckCanvasSegment(s), IsOk());
}

TEST(TensorCoreCanvasAttentionArgsTest, BadShapesAreInvalidArgument) {
  EXPECT_THAT(
      TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 0, 0, 4, 2, 256, nullptr),
      IsOk());
  EXPECT_THAT(
      TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 2, 80, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 3, 256, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(
      TensorCoreCanvasAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 2, 256, nullptr),
      StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(CanvasWindowStart(20, 0), 0);
  EXPECT_EQ(CanvasWindowStart(20, 8), 13);
  EXPECT_EQ(CanvasWindowStart(7, 8), 0);
}

// ---- TensorCorePrefillAttention: causal, many prompts in one launch, bf16 operands ----

// Both model head dims with the model's GQA groups (2 sliding, 8 full) and group 1; in each
// launch several prompts of different lengths (odd row counts, one row, context 0 and > 0).
// Without a window: the causal diagonal inside and at the end of key tiles (ctx + rows crossing
// multiples of 32). With window 32 (one key tile): every row whose window start ctx + r + 1 − 32
// is a multiple of 32 has its window edge exactly at a tile boundary (rows 31, 63 … of a prompt
// without context; rows 0, 32 … with ctx 31), the others inside a tile; context shorter than,
// equal to and longer than the window.
TEST_F(TensorCorePrefillAttentionTest, MatchesDoubleReference) {
  const std::vector<TcSegment> full = {{0, 7, 0},   {0, 70, 0}, {5, 40, 0},
                                       {45, 19, 0}, {70, 1, 0}, {32, 33, 0}};
  const std::vector<TcSegment> sliding = {{0, 70, 32},  {31, 40, 32}, {32, 9, 32},
                                          {45, 19, 32}, {0, 1, 32},   {3, 16, 32}};
  CheckBatch(4, 2, 256, full, 5000);
  CheckBatch(4, 2, 256, sliding, 5100);
  CheckBatch(8, 1, 512, full, 5200);
  CheckBatch(8, 1, 512, sliding, 5300);
  CheckBatch(4, 4, 64, sliding, 5400);
  // Window 8 (smaller than a block's 16 rows at group 1) and 64 (two tiles).
  CheckBatch(4, 4, 64, {{0, 37, 8}, {20, 25, 8}}, 5500);
  CheckBatch(4, 2, 128, {{0, 90, 64}, {64, 40, 64}, {100, 33, 64}}, 5600);
  // ctx_first 0 for a sliding layer: the per-row window alone hides the older context.
  CheckBatch(4, 2, 256, {{70, 20, 32}, {33, 5, 32}}, 5700, /*ctx_first_zero=*/true);
}

// Large scores (standard deviation about 30): the running max keeps exp() in range across tiles
// whose rows start seeing keys at different tiles.
TEST_F(TensorCorePrefillAttentionTest, LargeScoresStayStable) {
  const int hd = 256;
  for (const int window : {0, 32}) {
    const Case c{Kind::kPrefill, 4, 2, hd, 70, 45, window, std::sqrt(90.0f / std::sqrt(float(hd)))};
    const Data d = MakeData(c, 5800 + window);
    const std::vector<std::vector<float>> got = RunBatch({{c.ctx, c.rows, window}}, {d}, 4, 2, hd);
    Expect(c, got[0], Reference(c, RoundedData(d)), 2e-2f);
  }
}

// Window 1: every row sees only its own key, so the output is its bf16-rounded value row exactly.
TEST_F(TensorCorePrefillAttentionTest, SingleVisibleKeyReturnsItsValue) {
  const int hd = 64, heads = 4, kvh = 2, group = heads / kvh;
  const Case c{Kind::kPrefill, heads, kvh, hd, 40, 37, 1, 3.0f};
  const Data d = MakeData(c, 5900);
  const std::vector<float> got = RunBatch({{c.ctx, c.rows, 1}}, {d}, heads, kvh, hd)[0];
  for (int r = 0; r < c.rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < hd; ++i) {
        ASSERT_EQ(got[(size_t(r) * heads + h) * hd + i],
                  RoundBf16(d.v_new[(size_t(r) * kvh + h / group) * hd + i]))
            << "row " << r << " head " << h << " dim " << i;
      }
    }
  }
}

// A prompt's result is the same bit for bit alone or in a batch (another row offset, other
// prompts of other lengths and contexts before and after it).
TEST_F(TensorCorePrefillAttentionTest, BatchedEqualsSolo) {
  for (const int hd : {256, 512}) {
    const int heads = 4, kvh = hd == 512 ? 1 : 2, window = hd == 512 ? 0 : 32;
    const std::vector<TcSegment> segs = {{20, 9, window}, {37, 50, window}, {0, 21, window}};
    std::vector<Data> data;
    for (size_t i = 0; i < segs.size(); ++i) {
      data.push_back(MakeData(
          Case{Kind::kPrefill, heads, kvh, hd, segs[i].ctx, segs[i].rows, segs[i].window, 1.0f},
          uint32_t(6000 + hd + i)));
    }
    const std::vector<std::vector<float>> batched = RunBatch(segs, data, heads, kvh, hd, 3);
    const std::vector<std::vector<float>> solo = RunBatch({segs[1]}, {data[1]}, heads, kvh, hd);
    ASSERT_EQ(batched[1].size(), solo[0].size());
    for (size_t i = 0; i < solo[0].size(); ++i) {
      ASSERT_EQ(batched[1][i], solo[0][i]) << "head_dim " << hd << " element " << i;
    }
  }
}

// A sliding layer's ring (CanvasSegment::ring: W − 1 rows, the least the window needs, W, and
// odd sizes; contexts up to several rings long, so rows wrap; NaN outside the window) gives the
// contiguous context's result bit for bit, with a chunk of 40 new rows (longer than the window:
// its own keys come from k_new).
TEST_F(TensorCorePrefillAttentionTest, RingContextMatchesContiguous) {
  const std::vector<TcSegment> segs = {{0, 5, 8}, {7, 3, 8}, {8, 13, 8}, {29, 40, 8}, {70, 17, 8}};
  CheckRing(4, 2, 256, segs, {7, 7, 8, 13, 7}, 6100);
  CheckRing(4, 4, 64, segs, {8, 9, 7, 7, 11}, 6200);
}

// A bf16 context (CanvasSegmentBf16) gives the float32 context's bits: contiguous contexts with
// and without a window and ring contexts (rows wrap), a chunk longer than the window.
TEST_F(TensorCorePrefillAttentionTest, Bf16ContextEqualsFloat32ContextBitForBit) {
  CheckContextLayouts(4, 2, 256, {{0, 5, 0}, {45, 9, 0}, {70, 33, 0}}, 6300);
  CheckContextLayouts(4, 2, 256, {{7, 3, 8}, {29, 40, 8, 13}, {70, 17, 8, 7}, {45, 9, 8}}, 6400);
}

// A paged context gives the contiguous context's bits (CheckContextLayouts: float32 and bf16
// pools), beside contiguous and ring segments: full attention over blocks of 16, 32 and 64 with
// first_slot 0, mid-block and past a block, contexts not multiples of the block size, a chunk of
// 33 rows; a sliding window of 8 starting mid-block (first_slot 30 with blocks of 32: the window
// of ctx 7 spans slots 30 … 36, two blocks) and a chunk longer than the window.
TEST_F(TensorCorePrefillAttentionTest, PagedContextMatchesContiguous) {
  const std::vector<TcSegment> full = {{0, 5, 0, 0, 32, 0},
                                       {45, 9, 0, 0, 32, 5},
                                       {70, 33, 0, 0, 64, 40},
                                       {100, 20, 0, 0, 16, 3},
                                       {37, 12, 0}};
  const std::vector<TcSegment> sliding = {{7, 3, 8, 0, 32, 30},
                                          {29, 40, 8, 0, 32, 17},
                                          {70, 17, 8, 0, 64, 100},
                                          {45, 9, 8, 13},
                                          {45, 9, 8}};
  const std::vector<TcSegment> wide = {{70, 33, 0, 0, 64, 40}, {45, 9, 0}};
  for (const std::vector<TcSegment>* segs : {&full, &sliding, &wide}) {
    ASSERT_GT(PagedSegments(*segs), 0);
  }
  CheckContextLayouts(4, 2, 256, full, 8400);
  CheckContextLayouts(4, 2, 256, sliding, 8500);
  CheckContextLayouts(8, 1, 512, wide, 8600);
}

TEST(TensorCorePrefillAttentionArgsTest, BadShapesAreInvalidArgument) {
  EXPECT_THAT(TensorCorePrefillAttention(nullptr, nullptr, nullptr, kNoSegments, 0, 0, 4, 2, 256, 0,
                                         nullptr),
              IsOk());
  EXPECT_THAT(TensorCorePrefillAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 2, 80, 0,
                                         nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TensorCorePrefillAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 3, 256, 8,
                                         nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(TensorCorePrefillAttention(nullptr, nullptr, nullptr, kNoSegments, 1, 4, 4, 2, 256, 8,
                                         nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda::attention_test
