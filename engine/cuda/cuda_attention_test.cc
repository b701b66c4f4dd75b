// The float32 attention kernels (PrefillAttention, CanvasAttention, CanvasAttentionTable) against a
// float64 reference of spec §3.1.5 / §3.4 / §3.5 (label `gpu`; skipped without a GPU).
#include "engine/cuda/cuda_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_attention_test_util.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda::attention_test {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

// Random small shapes: heads 4 with kv heads 2 and 1 (and the model's 16/8 and 16/2), every
// head_dim template (16, 32, 64, 256, 512; 48 and 80 leave lanes partly idle), context 0..70
// (inside and beyond the window), 16..48 query rows (partial last blocks), window 8 or none.
// Emulated (gpu-emu): every third case, the same spread of shapes.
TEST_F(CudaAttentionTest, MatchesDoubleReference) {
  uint32_t seed = 100;
  int cases = 0;
  for (const Kind kind : {Kind::kPrefill, Kind::kCanvas}) {
    for (const int hd : {16, 32, 48, 64, 80, 256, 512}) {
      for (const int kvh : {2, 1}) {
        for (const int ctx : {0, 5, 37, 70}) {
          for (const int window : {0, 8}) {
            if (kEmulated && seed % 3 != 0) {
              ++seed;
              continue;
            }
            const int rows = 16 + (seed * 7) % 33;  // 16..48
            // uniform(±a) q and k: q·k has standard deviation √hd·a²/3 = 2 for a² = 6/√hd.
            const float scale = std::sqrt(6.0f / std::sqrt(float(hd)));
            const Case c{kind, 4, kvh, hd, ctx, rows, window, scale};
            const Data d = MakeData(c, seed++);
            Expect(c, Run(c, d), Reference(c, d), 2e-5f);
            ++cases;
          }
        }
      }
    }
  }
  // The model's GQA ratios: group 2 (sliding, 256) and 8 (full, 512); group 16 makes a block
  // cover part of a group.
  for (const Case& c : {Case{Kind::kCanvas, 16, 8, 256, 70, 48, 8, 1.0f},
                        Case{Kind::kCanvas, 16, 2, 512, 70, 33, 0, 0.5f},
                        Case{Kind::kPrefill, 16, 2, 512, 23, 41, 0, 0.5f},
                        Case{Kind::kPrefill, 16, 1, 64, 9, 17, 8, 1.0f},
                        Case{Kind::kCanvas, 16, 1, 64, 9, 17, 8, 1.0f}}) {
    const Data d = MakeData(c, seed++);
    Expect(c, Run(c, d), Reference(c, d), 2e-5f);
    ++cases;
  }
  EXPECT_GT(cases, kEmulated ? 70 : 200);
}

// Large scores (standard deviation 30, a² = 90/√hd; maxima near 100): the running max must keep
// exp() in range across tiles, and most keys underflow to p = 0.
TEST_F(CudaAttentionTest, LargeScoresStayStable) {
  uint32_t seed = 500;
  for (const Kind kind : {Kind::kPrefill, Kind::kCanvas}) {
    for (const int hd : {64, 512}) {
      const Case c{kind, 4, 2, hd, 70, 40, 0, std::sqrt(90.0f / std::sqrt(float(hd)))};
      const Data d = MakeData(c, seed++);
      Expect(c, Run(c, d), Reference(c, d), 1e-4f);
    }
  }
}

// Window 1 leaves exactly one visible key per query row (itself): the output is that key's value
// row exactly. Canvas window 1 hides the whole context; with one canvas row only itself remains.
TEST_F(CudaAttentionTest, SingleVisibleKeyReturnsItsValue) {
  for (const int hd : {16, 256, 512}) {
    for (const Case& c : {Case{Kind::kPrefill, 4, 2, hd, 0, 37, 1, 3.0f},
                          Case{Kind::kPrefill, 4, 1, hd, 45, 20, 1, 3.0f},
                          Case{Kind::kCanvas, 4, 2, hd, 45, 1, 1, 3.0f}}) {
      const Data d = MakeData(c, 900 + hd);
      const std::vector<float> got = Run(c, d);
      const int group = c.heads / c.kv_heads;
      for (int r = 0; r < c.rows; ++r) {
        for (int h = 0; h < c.heads; ++h) {
          for (int i = 0; i < hd; ++i) {
            ASSERT_EQ(got[(size_t(r) * c.heads + h) * hd + i],
                      d.v_new[(size_t(r) * c.kv_heads + h / group) * hd + i])
                << c.Name() << " row " << r << " head " << h << " dim " << i;
          }
        }
      }
    }
  }
}

// The paged context (blocks of 16 tokens in a shuffled pool, context starting mid-block) gives
// the contiguous result bit for bit.
TEST_F(CudaAttentionTest, PagedContextMatchesContiguous) {
  for (const Kind kind : {Kind::kPrefill, Kind::kCanvas}) {
    for (const int hd : {32, 256}) {
      const Case c{kind, 4, 2, hd, 70, 24, 8, 1.0f};
      const Data d = MakeData(c, 1234 + hd);
      const int block = 16, first_slot = 5, kvw = c.kv_heads * hd;
      const int blocks = (first_slot + c.ctx + block - 1) / block;
      std::vector<int32_t> table(blocks);
      std::iota(table.begin(), table.end(), 0);
      std::shuffle(table.begin(), table.end(), std::mt19937(7));
      for (int32_t& b : table) b = 2 * b + 1;  // spread over a pool with unused blocks
      const int pool_blocks = 2 * blocks + 1;
      std::vector<float> pk(size_t(pool_blocks) * block * kvw, NAN), pv = pk;
      for (int j = 0; j < c.ctx; ++j) {
        const int slot = first_slot + j;
        const size_t row = size_t(table[slot / block]) * block + slot % block;
        std::copy_n(&d.k_ctx[size_t(j) * kvw], kvw, &pk[row * kvw]);
        std::copy_n(&d.v_ctx[size_t(j) * kvw], kvw, &pv[row * kvw]);
      }
      KvContext paged;
      paged.k = Upload(pk);
      paged.v = Upload(pv);
      paged.tokens = c.ctx;
      paged.block_table = Upload(table);
      paged.block_size = block;
      paged.first_slot = first_slot;
      const std::vector<float> contiguous = Run(c, d);
      const std::vector<float> got = Run(c, d, &paged);
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], contiguous[i]) << c.Name() << i;
      Expect(c, got, Reference(c, d), 2e-5f);
    }
  }
}

// CanvasAttentionTable: several canvases of different rows and contexts (inside and beyond the
// window; one without context) in one launch from a device table, at head dims 32 and 256, give
// each canvas's CanvasAttention result alone bit for bit (its rows of `out` only: the rows
// between segments keep their fill), with the context pointers starting at token 0 of the
// mirror and ctx_first the window start.
TEST_F(CudaAttentionTest, CanvasTableEqualsEachCanvasAlone) {
  for (const int hd : {32, 256}) {
    for (const int window : {0, 8}) {
      const int heads = 4, kvh = 2, kvw = kvh * hd, qw = heads * hd;
      const int rows[] = {16, 9, 24}, ctxs[] = {37, 0, 5};
      std::vector<Case> cases;
      std::vector<Data> data;
      std::vector<float> q, kn, vn;
      std::vector<CanvasSegment> table;
      std::vector<int> row0;
      int R = 2;  // two rows before the first segment, never written
      for (int s = 0; s < 3; ++s) {
        cases.push_back(Case{Kind::kCanvas, heads, kvh, hd, ctxs[s], rows[s], window, 1.0f});
        data.push_back(MakeData(cases.back(), 4000 + 10 * hd + window + s));
        row0.push_back(R);
        R += rows[s] + 1;  // and one row after each
      }
      q.assign(size_t(R) * qw, 0.5f);
      kn.assign(size_t(R) * kvw, 0.25f);
      vn.assign(size_t(R) * kvw, 0.25f);
      for (int s = 0; s < 3; ++s) {
        const Data& d = data[s];
        std::copy(d.q.begin(), d.q.end(), q.begin() + size_t(row0[s]) * qw);
        std::copy(d.k_new.begin(), d.k_new.end(), kn.begin() + size_t(row0[s]) * kvw);
        std::copy(d.v_new.begin(), d.v_new.end(), vn.begin() + size_t(row0[s]) * kvw);
        CanvasSegment t;
        t.ctx_k = ctxs[s] > 0 ? Upload(d.k_ctx) : nullptr;
        t.ctx_v = ctxs[s] > 0 ? Upload(d.v_ctx) : nullptr;
        t.row0 = row0[s];
        t.rows = rows[s];
        t.ctx_tokens = ctxs[s];
        t.ctx_first = CanvasWindowStart(ctxs[s], window);
        table.push_back(t);
      }
      const CanvasSegment* d_table = Upload(table);
      float* out = Alloc<float>(size_t(R) * qw, 0xFF);
      ASSERT_THAT(CanvasAttentionTable(Upload(q), Upload(kn), Upload(vn), d_table, 3,
                                       /*max_rows=*/24, heads, kvh, hd, window, out),
                  IsOk());
      const std::vector<float> got = Download(out, size_t(R) * qw);
      std::vector<bool> written(R, false);
      for (int s = 0; s < 3; ++s) {
        // Alone: the context from the window start, as the backend's per-canvas launch.
        const Case& c = cases[s];
        const Data& d = data[s];
        const int first = CanvasWindowStart(c.ctx, window);
        KvContext ctx;
        ctx.tokens = c.ctx - first;
        if (ctx.tokens > 0) {
          ctx.k = Upload(d.k_ctx) + size_t(first) * kvw;
          ctx.v = Upload(d.v_ctx) + size_t(first) * kvw;
        }
        float* alone = Alloc<float>(size_t(c.rows) * qw, 0xFF);
        ASSERT_THAT(CanvasAttention(Upload(d.q), Upload(d.k_new), Upload(d.v_new), c.rows, ctx,
                                    heads, kvh, hd, window, alone),
                    IsOk());
        const std::vector<float> want = Download(alone, size_t(c.rows) * qw);
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_EQ(std::memcmp(&got[size_t(row0[s]) * qw + i], &want[i], 4), 0)
              << c.Name() << " segment " << s << " element " << i;
        }
        for (int r = 0; r < c.rows; ++r) written[row0[s] + r] = true;
        Expect(c, want, Reference(c, d), 2e-5f);
      }
      for (int r = 0; r < R; ++r) {
        if (written[r]) continue;
        for (int i = 0; i < qw; ++i) {
          uint32_t bits;
          std::memcpy(&bits, &got[size_t(r) * qw + i], 4);
          ASSERT_EQ(bits, 0xFFFFFFFFu) << "row " << r << " of no segment was written";
        }
      }
    }
  }
}

// CanvasAttentionTable on paged contexts (CanvasSegment::block_table; ToPaged: blocks out of
// order in a pool with NaN in unused blocks and rows): blocks of 16, 32 and 64 tokens, first_slot
// 0, mid-block and a whole block in, contexts not multiples of the block size and none, windows
// starting mid-block, beside a contiguous segment in one launch: the contiguous table's bits, and
// the float64 reference.
TEST_F(CudaAttentionTest, CanvasTablePagedMatchesContiguous) {
  for (const int hd : {32, 256}) {
    for (const int window : {0, 8}) {
      const int heads = 4, kvh = 2, kvw = kvh * hd, qw = heads * hd;
      const int rows[] = {16, 9, 24, 3, 5}, ctxs[] = {37, 0, 70, 45, 100};
      const int blocks[] = {16, 32, 64, 0, 32}, slots[] = {5, 3, 40, 0, 32};
      const int n = 5;
      std::vector<Case> cases;
      std::vector<Data> data;
      std::vector<float> q, kn, vn;
      std::vector<CanvasSegment> linear, paged;
      int R = 0;
      for (int s = 0; s < n; ++s) {
        cases.push_back(Case{Kind::kCanvas, heads, kvh, hd, ctxs[s], rows[s], window, 1.0f});
        data.push_back(MakeData(cases.back(), 9000 + 10 * hd + window + s));
        const Data& d = data.back();
        q.insert(q.end(), d.q.begin(), d.q.end());
        kn.insert(kn.end(), d.k_new.begin(), d.k_new.end());
        vn.insert(vn.end(), d.v_new.begin(), d.v_new.end());
        CanvasSegment t;
        t.row0 = R;
        t.rows = rows[s];
        t.ctx_tokens = ctxs[s];
        t.ctx_first = CanvasWindowStart(ctxs[s], window);
        if (ctxs[s] > 0) {
          t.ctx_k = Upload(d.k_ctx);
          t.ctx_v = Upload(d.v_ctx);
        }
        linear.push_back(t);
        if (blocks[s] > 0) {
          const PagedContext pc = ToPaged(d.k_ctx, d.v_ctx, t.ctx_first, t.ctx_tokens, kvw,
                                          blocks[s], slots[s], uint32_t(50 + s));
          t.ctx_k = Upload(pc.k);
          t.ctx_v = Upload(pc.v);
          t.block_table = Upload(pc.table);
          t.block_size = blocks[s];
          t.first_slot = slots[s];
          EXPECT_THAT(CheckCanvasSegment(t), IsOk());
        }
        paged.push_back(t);
        R += rows[s];
      }
      std::vector<float> got[2];
      for (const int use_paged : {0, 1}) {
        float* out = Alloc<float>(size_t(R) * qw, 0xFF);
        ASSERT_THAT(CanvasAttentionTable(Upload(q), Upload(kn), Upload(vn),
                                         Upload(use_paged ? paged : linear), n, /*max_rows=*/24,
                                         heads, kvh, hd, window, out),
                    IsOk());
        got[use_paged] = Download(out, size_t(R) * qw);
      }
      for (size_t i = 0; i < got[0].size(); ++i) {
        ASSERT_EQ(std::memcmp(&got[1][i], &got[0][i], 4), 0)
            << "head_dim " << hd << " window " << window << " element " << i;
      }
      for (int s = 0; s < n; ++s) {
        const size_t at = size_t(paged[s].row0) * qw;
        const std::vector<float> seg(got[1].begin() + at, got[1].begin() + at + rows[s] * qw);
        Expect(cases[s], seg, Reference(cases[s], data[s]), 2e-5f);
      }
    }
  }
}

// A sliding layer's ring (the context's window kept modulo `ring` rows: W − 1, the least the
// window needs, W, and an odd size; contexts shorter than the window, at its edge and several
// rings longer, so rows wrap; every row outside the window NaN) gives the contiguous result bit
// for bit: PrefillAttention through KvContext::ring (20 new rows: a chunk longer than the window,
// its own keys read from k_new) and CanvasAttentionTable through CanvasSegment::ring.
TEST_F(CudaAttentionTest, RingContextMatchesContiguous) {
  const int window = 8;
  uint32_t seed = 7000;
  int compared = 0;
  for (const int hd : {32, 256}) {
    for (const int ring : {window - 1, window, 13}) {
      for (const int ctx : {0, 5, 7, 8, 29, 70}) {
        for (const Kind kind : {Kind::kPrefill, Kind::kCanvas}) {
          const Case c{kind, 4, 2, hd, ctx, kind == Kind::kPrefill ? 20 : 9, window, 1.0f};
          const Data d = MakeData(c, seed++);
          const int kvw = c.kv_heads * hd, qw = c.heads * hd;
          const int first = CanvasWindowStart(ctx, window);  // row 0's window start for both
          const float *lk = nullptr, *lv = nullptr, *rk = nullptr, *rv = nullptr;
          if (ctx > 0) {
            lk = Upload(d.k_ctx);
            lv = Upload(d.v_ctx);
            rk = Upload(ToRing(d.k_ctx, first, ctx, kvw, ring));
            rv = Upload(ToRing(d.v_ctx, first, ctx, kvw, ring));
          }
          std::vector<float> linear, ringed;
          if (kind == Kind::kPrefill) {
            KvContext lin, rng;
            lin.tokens = rng.tokens = ctx - first;
            if (lin.tokens > 0) {
              lin.k = lk + size_t(first) * kvw;
              lin.v = lv + size_t(first) * kvw;
              rng.k = rk;
              rng.v = rv;
            }
            rng.first_slot = first;
            rng.ring = ring;
            linear = Run(c, d, &lin);
            ringed = Run(c, d, &rng);
          } else {
            for (const bool use_ring : {false, true}) {
              CanvasSegment t;
              t.ctx_k = use_ring ? rk : lk;
              t.ctx_v = use_ring ? rv : lv;
              t.rows = c.rows;
              t.ctx_tokens = ctx;
              t.ctx_first = first;
              t.ring = use_ring ? ring : 0;
              float* out = Alloc<float>(size_t(c.rows) * qw, 0xFF);
              ASSERT_THAT(CanvasAttentionTable(Upload(d.q), Upload(d.k_new), Upload(d.v_new),
                                               Upload(std::vector<CanvasSegment>{t}), 1, c.rows,
                                               c.heads, c.kv_heads, hd, window, out),
                          IsOk());
              (use_ring ? ringed : linear) = Download(out, size_t(c.rows) * qw);
            }
          }
          ASSERT_EQ(ringed.size(), linear.size());
          for (size_t i = 0; i < linear.size(); ++i) {
            ASSERT_EQ(std::memcmp(&ringed[i], &linear[i], 4), 0)
                << c.Name() << " ring " << ring << " element " << i;
          }
          Expect(c, ringed, Reference(c, d), 2e-5f);
          ++compared;
        }
      }
    }
  }
  EXPECT_EQ(compared, 72);
}

// ---- round_bf16: the reference's rounding (cuda_attention.h) ----

// Values on a grid of eighths (|x| ≤ 1/2), each moved by up to 0.4 of a bf16 half-ulp: bf16(x) is
// the grid value, so with rounded q and k every score is a multiple of 1/64 that float32 holds
// exactly (the reference's exp(s − m) are the kernel's float32 ones), while an element left
// unrounded moves the scores or the output by about 1e-3 relative.
std::vector<float> GridValues(size_t n, uint32_t& state) {
  std::vector<float> v(n);
  for (float& x : v) {
    state = state * 1664525u + 1013904223u;
    const int a = int(state >> 24) % 9 - 4;
    state = state * 1664525u + 1013904223u;
    const float r = float(state >> 8) / float(1 << 24) * 2.0f - 1.0f;
    x = float(a) / 8.0f * (1.0f + 0.4f * r / 256.0f);
  }
  return v;
}

Data GridData(const Case& c, uint32_t seed) {
  const size_t kvw = size_t(c.kv_heads) * c.head_dim;
  Data d;
  d.q = GridValues(size_t(c.rows) * c.heads * c.head_dim, seed);
  d.k_ctx = GridValues(size_t(c.ctx) * kvw, seed);
  d.v_ctx = GridValues(size_t(c.ctx) * kvw, seed);
  d.k_new = GridValues(size_t(c.rows) * kvw, seed);
  d.v_new = GridValues(size_t(c.rows) * kvw, seed);
  return d;
}

float Bf16(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;  // nearest even (no NaN here)
  std::memcpy(&x, &b, 4);
  return x;
}

// float64 attention of bf16(q), bf16(K), bf16(V) with P = bf16(exp(s − m_t)) · e^(m_t − m), m_t
// the running max over tiles of 32 keys (prefill: tiles at positions multiple of 32, key j at
// position position0 + j; canvas: from the first visible key), l = Σ exp(s − m_t) · e^(m_t − m).
std::vector<float> RoundedReference(const Case& c, const Data& d, int position0) {
  const int hd = c.head_dim, group = c.heads / c.kv_heads, nkeys = c.ctx + c.rows;
  std::vector<float> out(size_t(c.rows) * c.heads * hd);
  for (int r = 0; r < c.rows; ++r) {
    int lo, hi;
    if (c.kind == Kind::kPrefill) {
      hi = c.ctx + r + 1;
      lo = c.window > 0 ? std::max(0, hi - c.window) : 0;
    } else {
      hi = nkeys;
      lo = c.window > 0 ? c.ctx - std::min(c.ctx, c.window - 1) : 0;
    }
    auto tile = [&](int j) {
      return c.kind == Kind::kPrefill ? (position0 + j) / 32 : (j - lo) / 32;
    };
    for (int h = 0; h < c.heads; ++h) {
      const int g = h / group;
      auto row = [&](int j, bool value) {
        const std::vector<float>& src =
            j < c.ctx ? (value ? d.v_ctx : d.k_ctx) : (value ? d.v_new : d.k_new);
        return &src[(size_t(j < c.ctx ? j : j - c.ctx) * c.kv_heads + g) * hd];
      };
      const float* q = &d.q[(size_t(r) * c.heads + h) * hd];
      std::vector<double> s(nkeys, -INFINITY);
      double mx = -INFINITY;
      for (int j = lo; j < hi; ++j) {
        double dot = 0;
        for (int i = 0; i < hd; ++i) dot += double(Bf16(q[i])) * Bf16(row(j, false)[i]);
        s[j] = dot;
        mx = std::max(mx, dot);
      }
      double l = 0, mt = -INFINITY;
      std::vector<double> acc(hd, 0.0);
      for (int j = lo; j < hi; ++j) {
        if (j == lo || tile(j) != tile(j - 1)) {
          for (int x = j; x < hi && tile(x) == tile(j); ++x) mt = std::max(mt, s[x]);
        }
        const float e = std::exp(float(s[j]) - float(mt));
        const double rescale = std::exp(mt - mx);
        l += e * rescale;
        for (int i = 0; i < hd; ++i) acc[i] += Bf16(e) * rescale * Bf16(row(j, true)[i]);
      }
      for (int i = 0; i < hd; ++i) out[(size_t(r) * c.heads + h) * hd + i] = float(acc[i] / l);
    }
  }
  return out;
}

// PrefillAttention and CanvasAttention with round_bf16 against that reference: within float32
// addition error (emulated; on a GPU its expf may move an exp by an ulp, and so a bf16 rounding
// of p), while without round_bf16 the same data is far from it. Each of the rounding points was
// checked by hand: leaving q, K, V or p unrounded in the kernel, or starting a prefill's tiles at
// its block's first key instead of a multiple of 32, fails this.
TEST_F(CudaAttentionTest, Bf16RoundingMatchesRoundedReference) {
  uint32_t seed = 2000;
  for (const Kind kind : {Kind::kPrefill, Kind::kCanvas}) {
    for (const int hd : {16, 48, 256}) {
      for (const int window : {0, 8}) {
        for (const int position0 : {0, 13}) {
          const Case c{kind, 4, 2, hd, 37, 40, window, 0.5f};
          const Data d = GridData(c, seed++);
          KvContext ctx;
          ctx.k = Upload(d.k_ctx);
          ctx.v = Upload(d.v_ctx);
          ctx.tokens = c.ctx;
          ctx.position0 = position0;
          const size_t n = size_t(c.rows) * c.heads * hd;
          float* out = Alloc<float>(n, 0xFF);
          const float* q = Upload(d.q);
          const float* k = Upload(d.k_new);
          const float* v = Upload(d.v_new);
          const std::vector<float> want = RoundedReference(c, d, position0);
          for (const bool round : {true, false}) {
            const absl::Status st =
                kind == Kind::kPrefill
                    ? PrefillAttention(q, k, v, c.rows, ctx, 4, 2, hd, window, out, nullptr, round)
                    : CanvasAttention(q, k, v, c.rows, ctx, 4, 2, hd, window, out, nullptr, round);
            ASSERT_THAT(st, IsOk());
            const std::vector<float> got = Download(out, n);
            if (round) {
              Expect(c, got, want, kEmulated ? 3e-6f : 2e-4f);
            } else {
              float worst = 0;
              for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
              EXPECT_GT(worst, 3e-5f) << c.Name();
            }
          }
        }
      }
    }
  }
}

// Argument checks return before touching the device: these run without a GPU too.
TEST(CudaAttentionArgsTest, BadShapesAreInvalidArgument) {
  const KvContext none;
  // A ring shorter than the context it holds, and a ring with a block table.
  float dummy = 0;
  KvContext short_ring;
  short_ring.k = short_ring.v = &dummy;
  short_ring.tokens = 8;
  short_ring.ring = 7;
  EXPECT_THAT(PrefillAttention(&dummy, &dummy, &dummy, 1, short_ring, 4, 2, 64, 8, &dummy),
              StatusIs(absl::StatusCode::kInvalidArgument));
  KvContext paged_ring = short_ring;
  paged_ring.ring = 8;
  paged_ring.block_table = reinterpret_cast<const int32_t*>(&dummy);
  paged_ring.block_size = 16;
  EXPECT_THAT(CanvasAttention(&dummy, &dummy, &dummy, 1, paged_ring, 4, 2, 64, 8, &dummy),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(PrefillAttention(nullptr, nullptr, nullptr, 0, none, 4, 2, 64, 0, nullptr), IsOk());
  EXPECT_THAT(PrefillAttention(nullptr, nullptr, nullptr, 4, none, 4, 3, 64, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CanvasAttention(nullptr, nullptr, nullptr, 4, none, 4, 2, 1024, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  KvContext missing;
  missing.tokens = 3;
  EXPECT_THAT(CanvasAttention(nullptr, nullptr, nullptr, 4, missing, 4, 2, 64, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CanvasAttentionTable(nullptr, nullptr, nullptr, nullptr, 0, 4, 4, 2, 64, 0, nullptr),
              IsOk());
  EXPECT_THAT(CanvasAttentionTable(nullptr, nullptr, nullptr, nullptr, 2, 4, 4, 3, 64, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(CanvasAttentionTable(nullptr, nullptr, nullptr, nullptr, 2, 4, 4, 2, 64, 0, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda::attention_test
