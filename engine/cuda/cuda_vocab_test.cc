// The fused vocabulary step against the CPU path it mirrors (cpu::Softcap + SampleRow), label
// `gpu`; skipped without a GPU.
#include "engine/cuda/cuda_vocab.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/denoise/row_sampler.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

static_assert(sizeof(VocabRowResult) == sizeof(RowResult));
static_assert(offsetof(VocabRowResult, argmax) == offsetof(RowResult, argmax));
static_assert(offsetof(VocabRowResult, sampled) == offsetof(RowResult, sampled));
static_assert(offsetof(VocabRowResult, entropy) == offsetof(RowResult, entropy));
static_assert(offsetof(VocabRowResult, lse) == offsetof(RowResult, lse));

constexpr float kCap = 30.0f;

class CudaVocabTest : public CudaTest {
 protected:
  struct Output {
    std::vector<VocabRowResult> rows;
    std::vector<uint16_t> z;
  };
  // Runs the kernel twice (with and without the bf16 output; the results must not differ).
  // mask_table / mask_index: the canvas-template masks as VocabStep takes them (empty: none).
  Output Run(const std::vector<float>& raw, int rows, int vocab, const std::vector<float>& t,
             const std::vector<float>& u, const std::vector<uint64_t>& mask_table = {},
             const std::vector<int32_t>& mask_index = {}) {
    const float* dl = Upload(raw);
    const float* dt = Upload(t);
    const float* du = Upload(u);
    const uint64_t* dm = mask_table.empty() ? nullptr : Upload(mask_table);
    const int32_t* di = mask_index.empty() ? nullptr : Upload(mask_index);
    VocabRowResult* out = Alloc<VocabRowResult>(rows, 0xFF);
    VocabRowResult* out2 = Alloc<VocabRowResult>(rows, 0xFF);
    uint16_t* z = Alloc<uint16_t>(size_t(rows) * vocab, 0xFF);
    EXPECT_THAT(VocabStep(dl, rows, vocab, kCap, dt, du, out, z, dm, di), IsOk());
    EXPECT_THAT(VocabStep(dl, rows, vocab, kCap, dt, du, out2, nullptr, dm, di), IsOk());
    Output o;
    o.rows = Download(out, rows);
    o.z = Download(z, size_t(rows) * vocab);
    const std::vector<VocabRowResult> again = Download(out2, rows);
    for (int r = 0; r < rows; ++r) {
      EXPECT_EQ(again[r].argmax, o.rows[r].argmax) << r;
      EXPECT_EQ(again[r].sampled, o.rows[r].sampled) << r;
    }
    return o;
  }

  // Compares row r with the CPU path on the CPU-softcapped logits `capped`.
  // argmax: equal, or (tanh rounding) a logit within 2e-5 of the CPU's maximum. sampled: equal,
  // or the CPU's cumulative distribution (float64) puts u within 1e-6 of the boundary between
  // the two choices. entropy / lse: 2e-5 relative. z: bf16(ℓ/T) within one bf16 ulp (bit-equal
  // when the CPU softcap ran its AVX2 path, which the kernel mirrors).
  void Compare(const std::vector<float>& capped, int r, int vocab, float t, float u,
               const Output& got) {
    const float* l = capped.data() + size_t(r) * vocab;
    const RowResult want = SampleRow(l, vocab, t, u);
    const VocabRowResult& g = got.rows[r];
    SCOPED_TRACE(::testing::Message() << "vocab " << vocab << " row " << r << " T " << t << " u "
                                      << u);
    if (g.argmax != want.argmax) {
      ASSERT_GE(g.argmax, 0);
      ASSERT_LT(g.argmax, vocab);
      EXPECT_GE(l[g.argmax], l[want.argmax] - 2e-5f) << "argmax " << g.argmax << " vs "
                                                     << want.argmax;
      ++near_ties_;
    }
    if (g.sampled != want.sampled) {
      ASSERT_GE(g.sampled, 0);
      ASSERT_LT(g.sampled, vocab);
      double m = -INFINITY;
      for (int i = 0; i < vocab; ++i) m = std::max(m, double(l[i]));
      std::vector<double> cum(vocab + 1, 0.0);
      for (int i = 0; i < vocab; ++i) cum[i + 1] = cum[i] + std::exp((double(l[i]) - m) / t);
      const double uu = std::min(std::max(double(u), 0.0), 1.0) * cum[vocab];
      const double slack = 1e-6 * cum[vocab];
      const int a = std::min(g.sampled, want.sampled), b = std::max(g.sampled, want.sampled);
      // Every id between the two choices must carry (almost) no mass and u·S must sit at the
      // boundary they share.
      EXPECT_LE(cum[b] - cum[a + 1], slack) << "sampled " << g.sampled << " vs " << want.sampled;
      EXPECT_NEAR(uu, cum[a + 1], slack) << "sampled " << g.sampled << " vs " << want.sampled;
      ++boundary_samples_;
    }
    EXPECT_NEAR(g.entropy, want.entropy, 2e-5 * (1 + want.entropy));
    EXPECT_NEAR(g.lse, want.lse, 2e-5 * (1 + std::fabs(want.lse)));
    int z_bad = 0;
    for (int i = 0; i < vocab && !got.z.empty(); ++i) {
      const uint16_t want_z = FloatToBf16(l[i] / t), got_z = got.z[size_t(r) * vocab + i];
      if (std::abs(int(want_z) - int(got_z)) > 1 && ++z_bad <= 3) {
        ADD_FAILURE() << "z[" << i << "] = " << got_z << ", want " << want_z;
      }
    }
    EXPECT_EQ(z_bad, 0);
  }

  int near_ties_ = 0;
  int boundary_samples_ = 0;
};

// The fused vocabulary pass (FusedVocabStep: LM head in tiles, no [rows, V] logits) against the
// CPU sampler on logits computed here in float64 from the same hidden states and bf16 table.
class CudaFusedVocabTest : public CudaVocabTest {
 protected:
  struct Problem {
    int rows = 0, dim = 0, vocab = 0;
    std::vector<float> hidden;     // [rows, dim]
    std::vector<uint16_t> embed;   // [vocab, dim] bf16
    std::vector<float> temps, us;  // [rows]
    std::vector<uint64_t> mask_table;
    std::vector<int32_t> mask_index;  // empty: no masks
  };

  // Raw logits h·Eᵀ in float64 (hidden rounded to bf16 first in the bf16-input mode), rounded to
  // float, then cpu::Softcap and −∞ for masked ids: what the CPU step samples from.
  static std::vector<float> Reference(const Problem& p, bool bf16_input, bool capped = true) {
    std::vector<float> l(size_t(p.rows) * p.vocab);
    for (int r = 0; r < p.rows; ++r) {
      for (int v = 0; v < p.vocab; ++v) {
        double acc = 0;
        for (int k = 0; k < p.dim; ++k) {
          float h = p.hidden[size_t(r) * p.dim + k];
          if (bf16_input) h = RoundToBf16(h);
          acc += double(h) * double(Bf16ToFloat(p.embed[size_t(v) * p.dim + k]));
        }
        l[size_t(r) * p.vocab + v] = float(acc);
      }
    }
    if (!capped) return l;
    cpu::Softcap(l.data(), int64_t(l.size()), kCap);
    const int words = (p.vocab + 63) / 64;
    for (int r = 0; r < p.rows && !p.mask_index.empty(); ++r) {
      if (p.mask_index[r] < 0) continue;
      const uint64_t* m = p.mask_table.data() + size_t(p.mask_index[r]) * words;
      for (int id = 0; id < p.vocab; ++id) {
        if (((m[id / 64] >> (id % 64)) & 1) == 0) l[size_t(r) * p.vocab + id] = -INFINITY;
      }
    }
    return l;
  }

  // Runs FusedVocabStep on rows [row0, row0 + rows) of p.
  std::vector<VocabRowResult> RunFused(const Problem& p, bool bf16_input, int row0 = 0,
                                       int rows = -1) {
    if (rows < 0) rows = p.rows;
    FusedVocabArgs a;
    a.hidden = Upload(std::vector<float>(p.hidden.begin() + size_t(row0) * p.dim,
                                         p.hidden.begin() + size_t(row0 + rows) * p.dim));
    a.rows = rows;
    a.dim = p.dim;
    a.embed = Upload(p.embed);
    a.vocab = p.vocab;
    a.bf16_input = bf16_input;
    a.softcap = kCap;
    a.temperature =
        Upload(std::vector<float>(p.temps.begin() + row0, p.temps.begin() + row0 + rows));
    a.uniforms = Upload(std::vector<float>(p.us.begin() + row0, p.us.begin() + row0 + rows));
    if (!p.mask_index.empty()) {
      a.mask_table = Upload(p.mask_table);
      a.mask_index = Upload(
          std::vector<int32_t>(p.mask_index.begin() + row0, p.mask_index.begin() + row0 + rows));
    }
    a.out = Alloc<VocabRowResult>(rows, 0xFF);
    a.scratch = Alloc<char>(FusedVocabScratchBytes(rows, p.vocab), 0xFF);
    EXPECT_THAT(FusedVocabStep(a), IsOk());
    return Download(a.out, rows);
  }

  // Random hidden states and table: raw logits ≈ N(0, sigma[r]²).
  static Problem RandomProblem(int vocab, int dim, const std::vector<float>& sigma, uint32_t seed) {
    Problem p;
    p.rows = int(sigma.size());
    p.dim = dim;
    p.vocab = vocab;
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    p.embed.resize(size_t(vocab) * dim);
    for (uint16_t& e : p.embed) e = FloatToBf16(normal(gen));
    p.hidden.resize(size_t(p.rows) * dim);
    for (int r = 0; r < p.rows; ++r) {
      for (int k = 0; k < dim; ++k) {
        p.hidden[size_t(r) * dim + k] = sigma[r] / std::sqrt(float(dim)) * normal(gen);
      }
    }
    return p;
  }
};

std::vector<float> Capped(std::vector<float> raw) {
  cpu::Softcap(raw.data(), int64_t(raw.size()), kCap);
  return raw;
}

// Random Gaussian logits of several spreads (inside and far beyond the softcap), temperatures
// from 0.4 to 2 and uniforms over [0, 1), on a small, an odd-sized and the real vocabulary (not
// emulated: gpu-emu keeps to the small ones).
TEST_F(CudaVocabTest, MatchesCpuSamplerOnRandomLogits) {
  const std::vector<float> sigma = {0.5f, 3.0f, 10.0f, 30.0f, 100.0f, 3.0f, 10.0f, 1.0f};
  const std::vector<float> temps = {0.8f, 0.4f, 1.3f, 0.41f, 2.0f, 0.5f, 0.8f, 1.0f};
  const std::vector<float> us = {0.0f, 0.999999f, 0.5f, 0.25f, 0.75f, 0.1f, 0.9f, 0.33f};
  const int rows = int(sigma.size());
  for (const int vocab : {512, 5003, 262144}) {
    if (kEmulated && vocab > 5003) continue;
    std::mt19937 gen(vocab);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> raw(size_t(rows) * vocab);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < vocab; ++i) raw[size_t(r) * vocab + i] = sigma[r] * normal(gen);
    }
    raw[size_t(5) * vocab + vocab / 3] = -INFINITY;  // a masked id: softcapped to −30
    const std::vector<float> capped = Capped(raw);
    const Output got = Run(raw, rows, vocab, temps, us);
    for (int r = 0; r < rows; ++r) Compare(capped, r, vocab, temps[r], us[r], got);
  }
  // Near ties and boundary samples are possible, but rare: more would point to a bug.
  EXPECT_LE(near_ties_, 1);
  EXPECT_LE(boundary_samples_, 1);
}

// Hand-made rows with known answers, on V = 512 and the real vocabulary (emulated: V = 512 and
// 3001).
TEST_F(CudaVocabTest, EdgeRowsHaveKnownAnswers) {
  for (const int vocab : {512, kEmulated ? 3001 : 262144}) {
    const int rows = 8;
    std::vector<float> raw(size_t(rows) * vocab, 0.0f);
    std::vector<float> temps(rows, 0.8f), us(rows, 0.5f);
    auto row = [&](int r) { return raw.data() + size_t(r) * vocab; };
    // Row 0: all equal (uniform p), u = 0.5: the running sum first exceeds V/2 at id V/2.
    // Row 1: one spike (capped to 22.8), the rest capped to −30, T = 0.4: every other
    // w = (−30 − 22.8)·log2(e)/0.4 < −127, so e is exactly 0 and the entropy exactly 0.
    for (int i = 0; i < vocab; ++i) row(1)[i] = -1e4f;
    row(1)[777 % vocab] = 30.0f;
    temps[1] = 0.4f;
    us[1] = 0.9f;
    // Row 2: the maximum reached twice: the first index wins; u = 0.25 falls in its mass.
    for (int i = 0; i < vocab; ++i) row(2)[i] = float(i % 13) - 6.0f;
    row(2)[3] = row(2)[100] = 50.0f;
    us[2] = 0.25f;
    // Row 3: a NaN logit. Row 4: temperature 0. Both are reported as bad rows.
    row(3)[vocab - 1] = NAN;
    temps[4] = 0.0f;
    // Row 5: u ≥ 1 is clamped below 1 (the last id); row 6: NaN u is 0 (the first id).
    us[5] = 1.5f;
    us[6] = NAN;
    // Row 7: uniform with u = 0 — the first id.
    us[7] = 0.0f;
    const Output got = Run(raw, rows, vocab, temps, us);
    const std::vector<VocabRowResult>& g = got.rows;
    SCOPED_TRACE(::testing::Message() << "vocab " << vocab);
    EXPECT_EQ(g[0].argmax, 0);
    EXPECT_EQ(g[0].sampled, vocab / 2);
    EXPECT_NEAR(g[0].entropy, std::log(double(vocab)), 1e-5 * std::log(double(vocab)));
    EXPECT_NEAR(g[0].lse, std::log(double(vocab)), 1e-5 * std::log(double(vocab)));
    EXPECT_EQ(g[1].argmax, 777 % vocab);
    EXPECT_EQ(g[1].sampled, 777 % vocab);
    EXPECT_EQ(g[1].entropy, 0.0f);
    EXPECT_EQ(g[2].argmax, 3);
    EXPECT_EQ(g[2].sampled, 3);
    for (int r : {3, 4}) {
      EXPECT_EQ(g[r].argmax, -1) << r;
      EXPECT_EQ(g[r].sampled, -1) << r;
      EXPECT_TRUE(std::isnan(g[r].entropy)) << r;
    }
    EXPECT_EQ(g[5].sampled, vocab - 1);
    EXPECT_EQ(g[6].sampled, 0);
    EXPECT_EQ(g[7].sampled, 0);
    const std::vector<float> capped = Capped(raw);
    for (int r : {0, 1, 2, 5, 6, 7}) Compare(capped, r, vocab, temps[r], us[r], got);
  }
}

// Canvas-template masks against the CPU step's rule (engine/cpu/cpu_vocab.cc): a masked-out id
// gets ℓ = −∞ after the softcap, then the same sampler. Rows: no mask; a random ~10 % allowed
// set; one allowed id (a fixed position); a mask without the unmasked row's argmax; the ~10 %
// set again through the same table entry; every id masked out (a bad row).
TEST_F(CudaVocabTest, MasksMatchTheCpuMaskedStep) {
  for (const int vocab : {512, 5003, kEmulated ? 3001 : 262144}) {
    const int rows = 6, words = (vocab + 63) / 64;
    std::mt19937 gen(vocab + 1);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::bernoulli_distribution keep(0.1);
    std::vector<float> raw(size_t(rows) * vocab);
    for (float& x : raw) x = 8.0f * normal(gen);
    const std::vector<float> temps = {0.8f, 0.5f, 1.0f, 1.3f, 0.9f, 0.8f};
    const std::vector<float> us = {0.3f, 0.7f, 0.5f, 0.999f, 0.05f, 0.5f};
    std::vector<uint64_t> table(size_t(4) * words, 0);
    auto allow = [&](int m, int id) {
      table[size_t(m) * words + id / 64] |= uint64_t(1) << (id % 64);
    };
    for (int id = 0; id < vocab; ++id) {
      if (keep(gen)) allow(0, id);  // mask 0: ~10 % of the ids
    }
    allow(1, vocab - 7);  // mask 1: one id
    const std::vector<float> capped_all = Capped(raw);
    int argmax3 = 0;  // mask 2: everything but row 3's unmasked argmax
    for (int id = 1; id < vocab; ++id) {
      if (capped_all[size_t(3) * vocab + id] > capped_all[size_t(3) * vocab + argmax3]) {
        argmax3 = id;
      }
    }
    for (int id = 0; id < vocab; ++id) {
      if (id != argmax3) allow(2, id);
    }
    // mask 3: empty.
    const std::vector<int32_t> index = {-1, 0, 1, 2, 0, 3};
    const Output got = Run(raw, rows, vocab, temps, us, table, index);
    std::vector<float> capped = capped_all;
    for (int r = 0; r < rows; ++r) {
      if (index[r] < 0) continue;
      const uint64_t* m = table.data() + size_t(index[r]) * words;
      for (int id = 0; id < vocab; ++id) {
        if (((m[id / 64] >> (id % 64)) & 1) == 0) capped[size_t(r) * vocab + id] = -INFINITY;
      }
    }
    SCOPED_TRACE(::testing::Message() << "vocab " << vocab);
    for (int r = 0; r < 5; ++r) Compare(capped, r, vocab, temps[r], us[r], got);
    for (int r : {1, 4}) {  // only allowed ids come out
      const uint64_t* m = table.data();
      EXPECT_TRUE((m[got.rows[r].argmax / 64] >> (got.rows[r].argmax % 64)) & 1) << r;
      EXPECT_TRUE((m[got.rows[r].sampled / 64] >> (got.rows[r].sampled % 64)) & 1) << r;
    }
    EXPECT_EQ(got.rows[2].argmax, vocab - 7);
    EXPECT_EQ(got.rows[2].sampled, vocab - 7);
    EXPECT_EQ(got.rows[2].entropy, 0.0f);
    EXPECT_NE(got.rows[3].argmax, argmax3);
    EXPECT_NE(got.rows[3].sampled, argmax3);
    EXPECT_EQ(got.rows[5].argmax, -1);
    EXPECT_EQ(got.rows[5].sampled, -1);
    EXPECT_TRUE(std::isnan(got.rows[5].entropy));
  }
}

// Random rows of several spreads on odd vocabularies (not a multiple of the tile; dim not a
// multiple of the staged k columns), both GEMM-input modes, against the CPU sampler.
TEST_F(CudaFusedVocabTest, MatchesCpuSamplerOnRandomRows) {
  const std::vector<float> sigma = {0.5f, 3.0f, 10.0f, 30.0f, 100.0f, 3.0f, 10.0f, 1.0f, 5.0f};
  const std::vector<float> temps = {0.8f, 0.4f, 1.3f, 0.41f, 2.0f, 0.5f, 0.8f, 1.0f, 0.7f};
  const std::vector<float> us = {0.0f, 0.999999f, 0.5f, 0.25f, 0.75f, 0.1f, 0.9f, 0.33f, 0.6f};
  for (const int vocab : {300, 2053, kEmulated ? 5003 : 262144}) {
    for (const bool bf16 : {false, true}) {
      Problem p = RandomProblem(vocab, 40, sigma, uint32_t(vocab));
      p.temps = temps;
      p.us = us;
      const std::vector<float> capped = Reference(p, bf16);
      Output got;
      got.rows = RunFused(p, bf16);
      SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
      for (int r = 0; r < p.rows; ++r) Compare(capped, r, vocab, temps[r], us[r], got);
    }
  }
  EXPECT_LE(near_ties_, 1);
  EXPECT_LE(boundary_samples_, 1);
}

// Exact ties (two identical table rows: the same chains give the same bits), within a tile,
// across a tile boundary and far apart: the first index wins, and the sample lands on it when u
// falls in its mass. Masks: ~10 % allowed, a single id, an empty mask (bad row). A NaN hidden
// state and a zero temperature are bad rows.
TEST_F(CudaFusedVocabTest, TiesMasksAndBadRowsHaveKnownAnswers) {
  const int vocab = 1337, dim = 40, words = (vocab + 63) / 64;
  Problem p = RandomProblem(vocab, dim, std::vector<float>(9, 4.0f), 5);
  p.temps = std::vector<float>(9, 0.8f);
  p.us = {0.2f, 0.2f, 0.2f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  auto copy_row = [&](int from, int to) {
    std::copy_n(p.embed.begin() + size_t(from) * dim, dim, p.embed.begin() + size_t(to) * dim);
  };
  // (first, second) identical rows; row r's hidden state points at them (logit ≈ 40 ± 10, well
  // above every other id's, which are ≈ N(0, 40)).
  const int pairs[3][2] = {{1000, 1001}, {511, 512}, {5, 1300}};
  for (int r = 0; r < 3; ++r) {
    copy_row(pairs[r][0], pairs[r][1]);
    for (int k = 0; k < dim; ++k) {
      p.hidden[size_t(r) * dim + k] = Bf16ToFloat(p.embed[size_t(pairs[r][0]) * dim + k]);
    }
  }
  p.mask_table.assign(size_t(3) * words, 0);
  std::mt19937 gen(9);
  std::bernoulli_distribution keep(0.1);
  for (int id = 0; id < vocab; ++id) {
    if (keep(gen)) p.mask_table[id / 64] |= uint64_t(1) << (id % 64);
  }
  p.mask_table[size_t(1) * words + 777 / 64] |= uint64_t(1) << (777 % 64);
  // Rows 3–5: masks 0, 1, 2 (empty). Row 6: NaN hidden state; row 7: T = 0; row 8: no mask.
  p.mask_index = {-1, -1, -1, 0, 1, 2, -1, -1, -1};
  p.hidden[size_t(6) * dim + 3] = NAN;
  p.temps[7] = 0.0f;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const std::vector<float> capped = Reference(p, bf16);
    const std::vector<VocabRowResult> g = RunFused(p, bf16);
    for (int r = 0; r < 3; ++r) {
      const float* l = capped.data() + size_t(r) * vocab;
      ASSERT_EQ(l[pairs[r][0]], l[pairs[r][1]]);
      for (int v = 0; v < vocab; ++v) {
        if (v != pairs[r][0] && v != pairs[r][1]) {
          ASSERT_LT(l[v], l[pairs[r][0]] - 3.0f);
        }
      }
      EXPECT_EQ(g[r].argmax, pairs[r][0]) << r;
      // u = 0.2: inside the first of the two (each carries ≈ half the mass).
      EXPECT_EQ(g[r].sampled, pairs[r][0]) << r;
    }
    for (int r : {3, 8}) {
      Output o;
      o.rows = g;
      Compare(capped, r, vocab, p.temps[r], p.us[r], o);
      if (r == 3) {
        EXPECT_TRUE((p.mask_table[g[r].argmax / 64] >> (g[r].argmax % 64)) & 1);
        EXPECT_TRUE((p.mask_table[g[r].sampled / 64] >> (g[r].sampled % 64)) & 1);
      }
    }
    EXPECT_EQ(g[4].argmax, 777);
    EXPECT_EQ(g[4].sampled, 777);
    EXPECT_EQ(g[4].entropy, 0.0f);
    for (int r : {5, 6, 7}) {
      EXPECT_EQ(g[r].argmax, -1) << r;
      EXPECT_EQ(g[r].sampled, -1) << r;
      EXPECT_TRUE(std::isnan(g[r].entropy)) << r;
      EXPECT_TRUE(std::isnan(g[r].lse)) << r;
    }
  }
}

// A row's results are the same bits whether it runs alone or in a batch (any position, any
// neighbours: other masks, bad rows).
TEST_F(CudaFusedVocabTest, BatchedRowsMatchSoloRowsBitForBit) {
  // 70 rows: two row blocks of the tile kernel (64 rows), every 16-row fragment of the first.
  const int vocab = 777, rows = 70, dim = 36;
  std::vector<float> sigma(rows);
  for (int r = 0; r < rows; ++r) sigma[r] = 0.5f + float((r * 7) % 23);
  Problem p = RandomProblem(vocab, dim, sigma, 21);
  for (int r = 0; r < rows; ++r) {
    p.temps.push_back(0.45f + 0.1f * float(r % 13));
    p.us.push_back(float((r * 37) % 100) / 100.0f);
  }
  const int words = (vocab + 63) / 64;
  p.mask_table.assign(size_t(2) * words, ~uint64_t(0));
  for (int w = 0; w < words; w += 2) p.mask_table[w] = 0;  // mask 0: every other 64 ids
  for (int r = 0; r < rows; ++r) p.mask_index.push_back(r % 5 == 1 ? 0 : (r % 7 == 3 ? 1 : -1));
  p.hidden[size_t(5) * dim] = NAN;  // bad rows among them
  p.hidden[size_t(66) * dim] = NAN;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const std::vector<VocabRowResult> all = RunFused(p, bf16);
    for (int r = 0; r < rows; ++r) {
      const std::vector<VocabRowResult> solo = RunFused(p, bf16, r, 1);
      EXPECT_EQ(std::memcmp(&solo[0], &all[r], sizeof(VocabRowResult)), 0) << "row " << r;
    }
    // And a window of rows starting mid-fragment, across the row-block boundary.
    const std::vector<VocabRowResult> part = RunFused(p, bf16, 13, 55);
    for (int r = 0; r < 55; ++r) {
      EXPECT_EQ(std::memcmp(&part[r], &all[13 + r], sizeof(VocabRowResult)), 0) << 13 + r;
    }
    EXPECT_EQ(all[5].argmax, -1);
    EXPECT_EQ(all[66].argmax, -1);
    // Every good row of the batch against the CPU sampler (all fragments and both row blocks).
    const std::vector<float> capped = Reference(p, bf16);
    Output o;
    o.rows = all;
    for (int r = 0; r < rows; ++r) {
      if (r != 5 && r != 66) Compare(capped, r, vocab, p.temps[r], p.us[r], o);
    }
  }
  EXPECT_LE(near_ties_, 2);
  EXPECT_LE(boundary_samples_, 2);
}

// The self-conditioning probabilities recomputed per tile against the formula on float64 logits.
TEST_F(CudaFusedVocabTest, SoftmaxProbsMatchReference) {
  const int vocab = 1029, dim = 40;
  Problem p = RandomProblem(vocab, dim, {2.0f, 10.0f, 40.0f, 1.0f}, 3);
  p.temps = {0.8f, 1.0f, 0.5f, 1.3f};
  p.us = {0.5f, 0.5f, 0.5f, 0.5f};
  const int words = (vocab + 63) / 64;
  p.mask_table.assign(words, 0);
  for (int id = 0; id < vocab; id += 3) p.mask_table[id / 64] |= uint64_t(1) << (id % 64);
  p.mask_index = {-1, 0, -1, -1};
  for (const bool bf16 : {false, true}) {
    const std::vector<float> raw = Reference(p, bf16, /*capped=*/false);
    FusedVocabArgs a;
    a.hidden = Upload(p.hidden);
    a.rows = p.rows;
    a.dim = dim;
    a.embed = Upload(p.embed);
    a.vocab = vocab;
    a.bf16_input = bf16;
    a.softcap = kCap;
    a.temperature = Upload(p.temps);
    a.uniforms = Upload(p.us);
    a.mask_table = Upload(p.mask_table);
    a.mask_index = Upload(p.mask_index);
    a.out = Alloc<VocabRowResult>(p.rows, 0xFF);
    a.scratch = Alloc<char>(FusedVocabScratchBytes(p.rows, vocab));
    ASSERT_THAT(FusedVocabStep(a), IsOk());
    uint16_t* probs = Alloc<uint16_t>(size_t(p.rows) * vocab, 0xFF);
    ASSERT_THAT(FusedSoftmaxProbsBf16(a, a.out, probs), IsOk());
    const std::vector<uint16_t> got = Download(probs, size_t(p.rows) * vocab);
    for (int r = 0; r < p.rows; ++r) {
      std::vector<double> l(vocab);
      double m = -INFINITY;
      for (int v = 0; v < vocab; ++v) {
        const bool allowed = r != 1 || v % 3 == 0;
        l[v] = allowed ? 30.0 * std::tanh(double(raw[size_t(r) * vocab + v]) / 30.0) / p.temps[r]
                       : -INFINITY;
        m = std::max(m, l[v]);
      }
      double s = 0;
      for (int v = 0; v < vocab; ++v) s += std::exp(l[v] - m);
      int bad = 0;
      for (int v = 0; v < vocab; ++v) {
        const uint16_t want = FloatToBf16(float(std::exp(l[v] - m) / s));
        const uint16_t g = got[size_t(r) * vocab + v];
        if (std::abs(int(want) - int(g)) > 1 && ++bad <= 3) {
          ADD_FAILURE() << "row " << r << " id " << v << ": " << g << " want " << want;
        }
      }
      EXPECT_EQ(bad, 0) << "row " << r << " bf16 " << bf16;
    }
  }
}

// The sparse self-conditioning plan (cpu_vocab.cc's PlanRow at 256-id tiles) against the same
// plan computed here from float64 logits: the tiles a row leaves out get probability 0, the others
// the dense probabilities; peaked rows leave tiles out, flat rows and rows with ε = 0 none; and
// the soft embedding from the GPU's probabilities moves by less than 2⁻¹⁰ of its norm.
TEST_F(CudaFusedVocabTest, SparsePlanMatchesReferenceAndBound) {
  const int vocab = 2053, dim = 40, tiles = (vocab + 255) / 256;
  // Rows 0–3 peaked (the hidden state one table row: its logit ≈ 40, the others ≈ N(0, 40)),
  // 4 flat, 5 peaked with ε = 0 (dense).
  Problem p = RandomProblem(vocab, dim, {1.0f, 1.0f, 1.0f, 1.0f, 0.3f, 1.0f}, 17);
  p.temps = {0.3f, 0.5f, 0.8f, 0.4f, 1.0f, 0.3f};
  const int target[] = {7, 1000, 2052, 300, 0, 555};
  for (int r : {0, 1, 2, 3, 5}) {
    for (int k = 0; k < dim; ++k) {
      p.hidden[size_t(r) * dim + k] = Bf16ToFloat(p.embed[size_t(target[r]) * dim + k]);
    }
  }
  p.us = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
  std::vector<float> eps = {0x1p-12f, 0x1p-12f, 0.0f, 0x1p-12f, 0x1p-12f, 0.0f};
  {
    // Row 2's budget: 1.5 times its largest tile mass outside the argmax's tile, so that every
    // such tile fits alone but not all together (the greedy sum decides).
    const std::vector<float> raw = Reference(p, false, /*capped=*/false);
    std::vector<double> e(vocab);
    double m = -INFINITY, sum = 0;
    for (int v = 0; v < vocab; ++v) {
      e[v] = 30.0 * std::tanh(double(raw[size_t(2) * vocab + v]) / 30.0) / p.temps[2];
      m = std::max(m, e[v]);
    }
    for (double& x : e) sum += (x = std::exp(x - m));
    double largest = 0, others = 0;
    for (int t = 0; t < tiles; ++t) {
      if (t == target[2] / 256) continue;
      double qt = 0;
      for (int v = t * 256; v < std::min(vocab, t * 256 + 256); ++v) qt += e[v] / sum;
      largest = std::max(largest, qt);
      others += qt;
    }
    eps[2] = float(1.5 * largest);
    ASSERT_GT(others, 2.0 * eps[2]);
  }
  const float scale = 6.3125f;  // bf16(√40)
  // N_t in float64.
  std::vector<float> norm_max(tiles, 0.0f);
  std::vector<double> norm(vocab);
  for (int v = 0; v < vocab; ++v) {
    double ss = 0;
    for (int k = 0; k < dim; ++k) {
      const double x = Bf16ToFloat(p.embed[size_t(v) * dim + k]);
      ss += x * x;
    }
    norm[v] = std::sqrt(ss);
    norm_max[v / 256] = std::max(norm_max[v / 256], float(norm[v] * (1 + 1e-6)));
  }
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const std::vector<float> raw = Reference(p, bf16, /*capped=*/false);
    FusedVocabArgs a;
    a.hidden = Upload(p.hidden);
    a.rows = p.rows;
    a.dim = dim;
    a.embed = Upload(p.embed);
    a.vocab = vocab;
    a.bf16_input = bf16;
    a.softcap = kCap;
    a.temperature = Upload(p.temps);
    a.uniforms = Upload(p.us);
    a.out = Alloc<VocabRowResult>(p.rows, 0xFF);
    a.scratch = Alloc<char>(FusedVocabScratchBytes(p.rows, vocab), 0xFF);
    a.sc_skip_mass = Upload(eps);
    float* dnorm = Alloc<float>(tiles, 0xFF);
    ASSERT_THAT(FusedTileNormMax(a.embed, vocab, dim, dnorm), IsOk());
    const std::vector<float> got_norm = Download(dnorm, tiles);
    for (int t = 0; t < tiles; ++t) EXPECT_NEAR(got_norm[t], norm_max[t], 1e-5 * norm_max[t]) << t;
    a.tile_norm_max = dnorm;
    a.embed_scale = scale;
    ASSERT_THAT(FusedVocabStep(a), IsOk());
    uint16_t* probs = Alloc<uint16_t>(size_t(p.rows) * vocab, 0xFF);
    ASSERT_THAT(FusedSoftmaxProbsBf16(a, a.out, probs), IsOk());
    const std::vector<uint16_t> got = Download(probs, size_t(p.rows) * vocab);
    for (int r = 0; r < p.rows; ++r) {
      SCOPED_TRACE(::testing::Message() << "row " << r);
      std::vector<double> q(vocab);
      double m = -INFINITY, s = 0;
      int am = 0;
      for (int v = 0; v < vocab; ++v) {
        q[v] = 30.0 * std::tanh(double(raw[size_t(r) * vocab + v]) / 30.0) / p.temps[r];
        if (q[v] > m) {
          m = q[v];
          am = v;
        }
      }
      for (int v = 0; v < vocab; ++v) s += std::exp(q[v] - m);
      for (int v = 0; v < vocab; ++v) q[v] = std::exp(q[v] - m) / s;
      // The reference plan.
      std::vector<char> out(tiles, 0);
      double left = 0, bound = 0, spread = 0;
      for (int t = 0; t < tiles; ++t) {
        double qt = 0;
        for (int v = t * 256; v < std::min(vocab, t * 256 + 256); ++v) qt += q[v];
        spread += (t == am / 256 ? std::max(0.0, qt - q[am]) : qt) * norm_max[t];
        if (left + qt > eps[r]) continue;
        left += qt;
        bound += qt * norm_max[t];
        out[t] = 1;
      }
      const double b = scale * bound, lower = scale * (q[am] * norm[am] - spread);
      const bool keep = left > 0 && b <= 0x1p-10 * (lower - b);
      if (!keep) std::fill(out.begin(), out.end(), 0);
      const int left_out = int(std::count(out.begin(), out.end(), 1));
      if (r <= 3) {
        EXPECT_GT(left_out, 0);  // the test means something
      } else {
        EXPECT_EQ(left_out, 0);
      }
      int bad = 0;
      std::vector<double> dense(dim, 0.0), sparse(dim, 0.0);
      for (int v = 0; v < vocab; ++v) {
        const uint16_t want = out[v / 256] ? uint16_t(0) : FloatToBf16(float(q[v]));
        const uint16_t g = got[size_t(r) * vocab + v];
        if (std::abs(int(want) - int(g)) > 1 && ++bad <= 3) {
          ADD_FAILURE() << "id " << v << ": " << g << " want " << want;
        }
        for (int k = 0; k < dim; ++k) {
          const double e = Bf16ToFloat(p.embed[size_t(v) * dim + k]);
          dense[k] += q[v] * e * scale;
          sparse[k] += double(Bf16ToFloat(g)) * e * scale;
        }
      }
      EXPECT_EQ(bad, 0);
      // The bound, on the GPU's own (bf16) probabilities: dropped mass ≤ 2⁻¹⁰‖s‖, plus the
      // bf16 rounding of the kept probabilities (2⁻⁸ relative).
      double diff = 0, ns = 0;
      for (int k = 0; k < dim; ++k) {
        diff += (dense[k] - sparse[k]) * (dense[k] - sparse[k]);
        ns += dense[k] * dense[k];
      }
      EXPECT_LE(std::sqrt(diff), (0x1p-10 + 0x1p-8) * std::sqrt(ns));
    }
  }
}

// Argument checks return before touching the device: these run without a GPU too.
TEST(CudaVocabArgsTest, BadShapesAreInvalidArgument) {
  EXPECT_THAT(VocabStep(nullptr, 0, 512, kCap, nullptr, nullptr, nullptr), IsOk());
  EXPECT_THAT(VocabStep(nullptr, 2, 0, kCap, nullptr, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(VocabStep(nullptr, 2, 512, kCap, nullptr, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  // A mask index without its table.
  float f = 0;
  VocabRowResult r;
  int32_t index = 0;
  EXPECT_THAT(VocabStep(&f, 1, 512, kCap, &f, &f, &r, nullptr, nullptr, &index),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda
