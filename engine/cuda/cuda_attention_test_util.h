// The attention kernel tests' shared parts (cuda_attention_test.cc, cuda_attention_tc_test.cc):
// random cases, a float64 reference of spec §3.1.5 / §3.4 / §3.5, and the fixture running the
// float32 kernels (label `gpu`; skipped without a GPU).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda::attention_test {

enum class Kind { kPrefill, kCanvas };

struct Case {
  Kind kind;
  int heads, kv_heads, head_dim, ctx, rows, window;
  float scale;  // uniform(−scale, scale) for q and k; v is uniform(−1, 1)

  std::string Name() const {
    std::ostringstream s;
    s << (kind == Kind::kPrefill ? "prefill" : "canvas") << " heads " << heads << "/" << kv_heads
      << " head_dim " << head_dim << " ctx " << ctx << " rows " << rows << " window " << window
      << " scale " << scale;
    return s.str();
  }
};

struct Data {
  std::vector<float> q, k_ctx, v_ctx, k_new, v_new;
};

inline std::vector<float> Random(size_t n, float scale, std::mt19937& gen) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline Data MakeData(const Case& c, uint32_t seed) {
  std::mt19937 gen(seed);
  Data d;
  const size_t kvw = size_t(c.kv_heads) * c.head_dim;
  d.q = Random(size_t(c.rows) * c.heads * c.head_dim, c.scale, gen);
  d.k_ctx = Random(size_t(c.ctx) * kvw, c.scale, gen);
  d.v_ctx = Random(size_t(c.ctx) * kvw, 1.0f, gen);
  d.k_new = Random(size_t(c.rows) * kvw, c.scale, gen);
  d.v_new = Random(size_t(c.rows) * kvw, 1.0f, gen);
  return d;
}

// Straightforward float64 attention: for each (row, head) the visible keys of the spec's rule,
// scores q·k (scale 1), softmax, Σ p·v.
inline std::vector<float> Reference(const Case& c, const Data& d) {
  const int hd = c.head_dim, group = c.heads / c.kv_heads, nkeys = c.ctx + c.rows;
  std::vector<float> out(size_t(c.rows) * c.heads * hd);
  std::vector<double> scores(nkeys);
  for (int r = 0; r < c.rows; ++r) {
    for (int h = 0; h < c.heads; ++h) {
      const int g = h / group;
      const float* q = &d.q[(size_t(r) * c.heads + h) * hd];
      auto key = [&](int j, bool value) -> const float* {
        const std::vector<float>& src =
            j < c.ctx ? (value ? d.v_ctx : d.k_ctx) : (value ? d.v_new : d.k_new);
        const int row = j < c.ctx ? j : j - c.ctx;
        return &src[(size_t(row) * c.kv_heads + g) * hd];
      };
      auto visible = [&](int j) {
        if (c.kind == Kind::kPrefill) {
          const int qpos = c.ctx + r;  // positions relative to the first context token
          return j <= qpos && (c.window <= 0 || qpos - j < c.window);
        }
        if (j >= c.ctx) return true;  // every canvas key
        return c.window <= 0 || j >= c.ctx - std::min(c.ctx, c.window - 1);
      };
      double mx = -INFINITY;
      for (int j = 0; j < nkeys; ++j) {
        if (!visible(j)) continue;
        const float* k = key(j, false);
        double s = 0;
        for (int i = 0; i < hd; ++i) s += double(q[i]) * k[i];
        scores[j] = s;
        mx = std::max(mx, s);
      }
      double sum = 0;
      std::vector<double> acc(hd, 0.0);
      for (int j = 0; j < nkeys; ++j) {
        if (!visible(j)) continue;
        const double p = std::exp(scores[j] - mx);
        sum += p;
        const float* v = key(j, true);
        for (int i = 0; i < hd; ++i) acc[i] += p * v[i];
      }
      for (int i = 0; i < hd; ++i) out[(size_t(r) * c.heads + h) * hd + i] = float(acc[i] / sum);
    }
  }
  return out;
}

// A sliding layer's device ring (cuda_attention.h, KvContext / CanvasSegment::ring): the rows
// [first, ctx) of a contiguous [ctx, kvw] context array kept modulo `ring` rows (position p in
// row p % ring; ring ≥ ctx − first), every other element NaN (never read: a read shows in the
// output).
inline std::vector<float> ToRing(const std::vector<float>& rows, int first, int ctx, int kvw,
                                 int ring) {
  std::vector<float> r(size_t(ring) * kvw, NAN);
  for (int p = first; p < ctx; ++p) {
    std::copy_n(&rows[size_t(p) * kvw], kvw, &r[size_t(p % ring) * kvw]);
  }
  return r;
}

// A paged context (cuda_attention.h: KvContext, CanvasSegmentOf::block_table): the rows
// [first, ctx) of contiguous [ctx, kvw] K/V arrays in a pool of blocks of `block` rows, context
// token j in slot first_slot + j of the block table. The table's blocks are a random permutation
// spread over a pool twice as large plus one (out of order, unused blocks between them); every
// pool element not holding a visible row is NaN (unused blocks, rows before first_slot + first,
// after the last token), and the table entries of blocks holding no visible row point to an
// all-NaN block, so reading a wrong block or row shows in the output.
struct PagedContext {
  std::vector<float> k, v;
  std::vector<int32_t> table;
};

inline PagedContext ToPaged(const std::vector<float>& k, const std::vector<float>& v, int first,
                            int ctx, int kvw, int block, int first_slot, uint32_t seed) {
  PagedContext p;
  const int n = (first_slot + ctx + block - 1) / block;  // table entries
  std::vector<int32_t> perm(n);
  for (int i = 0; i < n; ++i) perm[i] = 2 * i + 1;  // odd blocks; even ones stay NaN
  std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
  const int pool_blocks = 2 * n + 1;
  p.table.assign(n, 2 * n);  // block 2n: all NaN
  p.k.assign(size_t(pool_blocks) * block * kvw, NAN);
  p.v = p.k;
  for (int j = first; j < ctx; ++j) {
    const int slot = first_slot + j;
    p.table[slot / block] = perm[slot / block];
    const size_t row = size_t(perm[slot / block]) * block + slot % block;
    std::copy_n(&k[size_t(j) * kvw], kvw, &p.k[row * kvw]);
    std::copy_n(&v[size_t(j) * kvw], kvw, &p.v[row * kvw]);
  }
  return p;
}

class CudaAttentionTest : public CudaTest {
 protected:
  // Runs the case on the device with contiguous context K/V (or the given paged context).
  std::vector<float> Run(const Case& c, const Data& d, const KvContext* paged = nullptr) {
    KvContext ctx;
    if (paged != nullptr) {
      ctx = *paged;
    } else {
      ctx.k = Upload(d.k_ctx);
      ctx.v = Upload(d.v_ctx);
      ctx.tokens = c.ctx;
    }
    const size_t n = size_t(c.rows) * c.heads * c.head_dim;
    float* out = Alloc<float>(n, 0xFF);
    const float* q = Upload(d.q);
    const float* k = Upload(d.k_new);
    const float* v = Upload(d.v_new);
    const absl::Status st =
        c.kind == Kind::kPrefill
            ? PrefillAttention(q, k, v, c.rows, ctx, c.heads, c.kv_heads, c.head_dim, c.window, out)
            : CanvasAttention(q, k, v, c.rows, ctx, c.heads, c.kv_heads, c.head_dim, c.window, out);
    EXPECT_THAT(st, ::dgserve::testing::IsOk()) << c.Name();
    return Download(out, n);
  }

  void Expect(const Case& c, const std::vector<float>& got, const std::vector<float>& want,
              float tol) {
    ASSERT_EQ(got.size(), want.size());
    float worst = 0;
    size_t worst_i = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const float diff = std::isnan(got[i]) ? INFINITY : std::fabs(got[i] - want[i]);
      if (diff > worst) {
        worst = diff;
        worst_i = i;
      }
    }
    const size_t per_row = size_t(c.heads) * c.head_dim;
    EXPECT_LE(worst, tol) << c.Name() << ": worst at row " << worst_i / per_row << " head "
                          << worst_i % per_row / c.head_dim << " dim " << worst_i % c.head_dim
                          << ": got " << got[worst_i] << ", want " << want[worst_i];
  }
};

}  // namespace dgserve::cuda::attention_test
