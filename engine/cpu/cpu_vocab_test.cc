#include "engine/cpu/cpu_vocab.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/denoise/row_sampler.h"

namespace dgserve::cpu {
namespace {

// The embedding as the backend holds it: bf16 bits row-major and packed for the LM head.
struct Embedding {
  std::vector<float> values;  // bf16 values as float32 [V, D]
  std::vector<uint16_t> bits;
  PackedMatrix packed;
  Embedding(std::vector<float> v, int V, int D) : values(std::move(v)), bits(values.size()) {
    for (size_t i = 0; i < values.size(); ++i) {
      bits[i] = FloatToBf16(values[i]);
      values[i] = Bf16ToFloat(bits[i]);
    }
    packed = PackedMatrix::FromBf16(bits.data(), V, D);
  }
};

// The arguments of rows [r0, r0 + rows) of `hidden` [·, D] against `emb` [V, D], with `out` and
// `soft` resized for them.
VocabStepArgs ArgsFor(const Embedding& emb, int V, int D, const std::vector<float>& hidden,
                      const std::vector<float>& temperature, const std::vector<float>& uniforms,
                      int r0, int rows, float embed_scale, std::vector<RowResult>* out,
                      std::vector<float>* soft) {
  out->assign(rows, {});
  soft->assign(size_t(rows) * D, 0.0f);
  VocabStepArgs a;
  a.hidden = hidden.data() + size_t(r0) * D;
  a.rows = rows;
  a.lm_head = &emb.packed;
  a.embed = emb.bits.data();
  a.vocab = V;
  a.dim = D;
  a.temperature = temperature.data() + r0;
  a.uniforms = uniforms.data() + r0;
  a.embed_scale = embed_scale;
  a.out = out->data();
  a.soft = soft->data();
  return a;
}

void MatMulTransB(const float* a, const float* b, int m, int n, int k, float* c) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      float x = 0;
      for (int kk = 0; kk < k; ++kk) x = std::fma(a[size_t(i) * k + kk], b[size_t(j) * k + kk], x);
      c[size_t(i) * n + j] = x;
    }
  }
}

void MatMul(const float* a, const float* b, int m, int n, int k, float* c) {
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double x = 0;
      for (int kk = 0; kk < k; ++kk) x += double(a[size_t(i) * k + kk]) * b[size_t(kk) * n + j];
      c[size_t(i) * n + j] = float(x);
    }
  }
}

// Several tiles (V = 5003: 10 tiles, the last partial), logits spread over the softcap
// range so that the running max moves between tiles: the fused kernel must match
// Softcap + SampleRows + the soft-embedding GEMM.
TEST(FusedVocabStepTest, MatchesTheUnfusedPipeline) {
  const int M = 7, V = 5003, D = 24;
  std::vector<float> hidden(size_t(M) * D), e(size_t(V) * D);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = std::sin(0.7f * float(i)) * 2.0f;
  for (size_t i = 0; i < e.size(); ++i) {
    e[i] = std::cos(0.013f * float(i) * float(i % 97)) * (1.0f + float(i / D) / V);
  }
  const Embedding emb(e, V, D);
  const std::vector<float>& embed = emb.values;
  std::vector<float> temperature = {0.8f, 0.4f, 1.3f, 0.55f, 0.8f, 2.0f, 0.41f};
  std::vector<float> uniforms = {0.0f, 0.999f, 0.5f, 0.25f, 0.75f, 0.1f, 0.9f};

  // Reference: full logits, softcap, per-row sampler with probabilities, soft = P·E·scale.
  std::vector<float> logits(size_t(M) * V);
  MatMulTransB(hidden.data(), embed.data(), M, V, D, logits.data());
  Softcap(logits.data(), int64_t(M) * V, 30.0f);
  const std::vector<float> capped = logits;
  std::vector<RowResult> want(M);
  std::vector<float> want_soft(size_t(M) * D);
  for (int r = 0; r < M; ++r) {
    want[r] = SampleRow(logits.data() + size_t(r) * V, V, temperature[r], uniforms[r], true);
  }
  MatMul(logits.data(), embed.data(), M, D, V, want_soft.data());
  for (float& x : want_soft) x *= 2.5f;

  std::vector<RowResult> got(M);
  std::vector<float> soft(size_t(M) * D), got_logits(size_t(M) * V);
  VocabStepArgs a;
  a.hidden = hidden.data();
  a.rows = M;
  a.lm_head = &emb.packed;
  a.embed = emb.bits.data();
  a.vocab = V;
  a.dim = D;
  a.softcap = 30.0f;
  a.temperature = temperature.data();
  a.uniforms = uniforms.data();
  a.embed_scale = 2.5f;
  a.out = got.data();
  a.soft = soft.data();
  a.logits = got_logits.data();
  ASSERT_TRUE(FusedVocabStep(a).ok());
  for (int r = 0; r < M; ++r) {
    EXPECT_EQ(got[r].argmax, want[r].argmax) << r;
    EXPECT_EQ(got[r].sampled, want[r].sampled) << r;
    EXPECT_NEAR(got[r].entropy, want[r].entropy, 2e-5 * (1 + want[r].entropy)) << r;
    EXPECT_NEAR(got[r].lse, want[r].lse, 2e-5 * (1 + std::fabs(want[r].lse))) << r;
  }
  for (size_t i = 0; i < soft.size(); ++i) EXPECT_NEAR(soft[i], want_soft[i], 1e-4) << i;
  for (size_t i = 0; i < capped.size(); ++i) ASSERT_NEAR(got_logits[i], capped[i], 1e-4) << i;
  // u = 0 picks the first id with p > 0; u → 1 picks one of the last ids with p > 0.
  EXPECT_EQ(got[0].sampled, want[0].sampled);
}

// Non-finite hidden states (e.g. from corrupt weights) cannot be sampled from: INTERNAL, never
// a silently empty answer.
TEST(FusedVocabStepTest, NonFiniteLogitsAreAnError) {
  const int M = 2, V = 1000, D = 16;
  std::vector<float> hidden(size_t(M) * D, 0.5f), embed(size_t(V) * D, 0.25f);
  hidden[D + 3] = std::nanf("");
  std::vector<float> temperature(M, 0.8f), uniforms(M, 0.5f);
  std::vector<RowResult> out(M);
  Embedding emb(embed, V, D);
  VocabStepArgs a;
  a.hidden = hidden.data();
  a.rows = M;
  a.lm_head = &emb.packed;
  a.embed = emb.bits.data();
  a.vocab = V;
  a.dim = D;
  a.temperature = temperature.data();
  a.uniforms = uniforms.data();
  a.out = out.data();
  absl::Status st = FusedVocabStep(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_NE(st.message().find("row 1"), std::string::npos) << st;
  // A single NaN logit among finite ones (one corrupt embedding row) is caught too.
  hidden[D + 3] = 0.5f;
  embed[size_t(700) * D + 5] = std::nanf("");
  Embedding poisoned(embed, V, D);
  a.lm_head = &poisoned.packed;
  a.embed = poisoned.bits.data();
  st = FusedVocabStep(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
}

// A row's results are the same bits alone and inside any batch, at any position, on every GEMM
// path the CPU has: nothing in the fused step mixes rows.
TEST(FusedVocabStepTest, RowsDoNotDependOnTheBatchOrTheGemmPath) {
  const int M = 9, V = 3001, D = 40;
  std::vector<float> hidden(size_t(M) * D), e(size_t(V) * D);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = std::sin(0.37f * float(i)) * 3.0f;
  for (size_t i = 0; i < e.size(); ++i) e[i] = std::cos(0.011f * float(i) * float(i % 89));
  const Embedding emb(e, V, D);
  std::vector<float> temperature(M), uniforms(M);
  for (int r = 0; r < M; ++r) {
    temperature[r] = 0.4f + 0.1f * r;
    uniforms[r] = 0.1f * r;
  }
  auto run = [&](int r0, int rows, std::vector<RowResult>* out, std::vector<float>* soft) {
    const VocabStepArgs a =
        ArgsFor(emb, V, D, hidden, temperature, uniforms, r0, rows, 1.5f, out, soft);
    ASSERT_TRUE(FusedVocabStep(a).ok());
  };
  const GemmIsa saved = ActiveGemmIsa();
  std::vector<RowResult> all;
  std::vector<float> all_soft;
  run(0, M, &all, &all_soft);
  for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}) {
    if (!GemmIsaSupported(isa)) {
      std::printf("GEMM path %s: not on this CPU, skipped\n", GemmIsaName(isa));
      continue;
    }
    ASSERT_TRUE(SetGemmIsa(isa).ok());
    for (int r = 0; r < M; ++r) {
      std::vector<RowResult> one;
      std::vector<float> one_soft;
      run(r, 1, &one, &one_soft);
      EXPECT_EQ(one[0].argmax, all[r].argmax) << GemmIsaName(isa) << " row " << r;
      EXPECT_EQ(one[0].sampled, all[r].sampled) << GemmIsaName(isa) << " row " << r;
      EXPECT_EQ(one[0].entropy, all[r].entropy) << GemmIsaName(isa) << " row " << r;
      EXPECT_EQ(one[0].lse, all[r].lse) << GemmIsaName(isa) << " row " << r;
      EXPECT_EQ(0, std::memcmp(one_soft.data(), all_soft.data() + size_t(r) * D, sizeof(float) * D))
          << GemmIsaName(isa) << " row " << r;
    }
  }
  ASSERT_TRUE(SetGemmIsa(saved).ok());
}

// The sparse self-conditioning product (cpu_vocab.h). V = 8192 (16 tiles), D = 32; ids 0–2 carry
// the signal in dimension 0, every other id is 0 there, so a hidden state along dimension 0 puts
// all the probability in tile 0 (others are 0 in dimensions 0–2):
// - row 0: peaked on id 2 (E_2 = (0.02, 0, 1, …)): the 15 other tiles are left out, within the
//   bound; row 3 the same at temperature 0.4;
// - row 1: ids 0 and 1 share the mass and their embeddings (0.01, ±1, …) cancel, so ‖s‖ may be
//   small against max ‖E_v‖ and the bound cannot hold: the row is kept dense (the dense bits);
// - row 2: a tiny hidden state, nearly uniform: no tile is left out (the same bits as dense).
struct SparseCase {
  static constexpr int M = 4, V = 8192, D = 32;
  std::vector<float> hidden = std::vector<float>(size_t(M) * D, 0.0f);
  std::vector<float> temperature = {1.0f, 1.0f, 1.0f, 0.4f};
  std::vector<float> uniforms = {0.3f, 0.6f, 0.5f, 0.9f};
  Embedding emb;
  static std::vector<float> Table() {
    std::vector<float> e(size_t(V) * D, 0.0f);
    for (int v = 3; v < V; ++v) {
      for (int i = 3; i < D; ++i) e[size_t(v) * D + i] = 0.2f * std::sin(0.37f * float(v * D + i));
    }
    e[0 * D + 0] = 0.01f, e[0 * D + 1] = 1.0f;
    e[1 * D + 0] = 0.01f, e[1 * D + 1] = -1.0f;
    e[2 * D + 0] = 0.02f, e[2 * D + 2] = 1.0f;
    return e;
  }
  std::vector<float> tile_norms;
  SparseCase() : emb(Table(), V, D), tile_norms(EmbeddingTileNormMax(emb.bits.data(), V, D)) {
    hidden[0 * D + 0] = 1000.0f;  // logits: id 2 20 → 17.5 after softcap; ids 0, 1 10; others 0
    hidden[1 * D + 0] = 2000.0f;  // ids 0, 1: 20; id 2: 40 − 1000 (capped to −30); others 0
    hidden[1 * D + 2] = -1000.0f;
    for (int i = 0; i < D; ++i) hidden[2 * D + i] = 0.001f;
    hidden[3 * D + 0] = 1000.0f;
  }
  // Runs rows [r0, r0 + rows) with the given budget.
  void Run(int r0, int rows, double skip_mass, std::vector<RowResult>* out,
           std::vector<float>* soft, VocabStepStats* stats) const {
    VocabStepArgs a = ArgsFor(emb, V, D, hidden, temperature, uniforms, r0, rows, 5.5f, out, soft);
    a.sc_skip_mass = skip_mass;
    a.embed_tile_norm_max = tile_norms.data();
    a.stats = stats;
    ASSERT_TRUE(FusedVocabStep(a).ok());
  }
};

double Norm(const float* x, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(x[i]) * x[i];
  return std::sqrt(s);
}

TEST(FusedVocabStepTest, SparseProductLeavesOutLowMassTilesWithinItsBound) {
  const SparseCase c;
  const int M = SparseCase::M, D = SparseCase::D;
  std::vector<RowResult> dense, sparse;
  std::vector<float> dense_soft, sparse_soft;
  VocabStepStats dense_stats, stats;
  c.Run(0, M, 0.0, &dense, &dense_soft, &dense_stats);
  c.Run(0, M, kDefaultScSkipMass, &sparse, &sparse_soft, &stats);
  EXPECT_EQ(dense_stats.tile_rows_skipped, 0);
  EXPECT_EQ(stats.tile_rows, M * 16);
  EXPECT_EQ(stats.tile_rows_skipped, 2 * 15);  // rows 0 and 3 leave out their 15 other tiles
  EXPECT_EQ(stats.rows_kept_dense, 1);         // row 1
  for (int r = 0; r < M; ++r) {
    EXPECT_EQ(sparse[r].argmax, dense[r].argmax) << "row " << r;
    EXPECT_EQ(sparse[r].sampled, dense[r].sampled) << "row " << r;
    EXPECT_EQ(sparse[r].entropy, dense[r].entropy) << "row " << r;
    EXPECT_EQ(sparse[r].lse, dense[r].lse) << "row " << r;
    const float* want = dense_soft.data() + size_t(r) * D;
    const float* got = sparse_soft.data() + size_t(r) * D;
    if (r == 1 || r == 2) {
      EXPECT_EQ(0, std::memcmp(got, want, sizeof(float) * D)) << "row " << r;
      continue;
    }
    std::vector<float> diff(D);
    for (int i = 0; i < D; ++i) diff[i] = got[i] - want[i];
    EXPECT_GT(Norm(want, D), 1.0);
    EXPECT_LE(Norm(diff.data(), D), std::ldexp(Norm(want, D), -10)) << "row " << r;
  }
  EXPECT_EQ(dense[0].argmax, 2);
  EXPECT_LT(dense[1].argmax, 2);

  // Each row alone gives the batch's bits (the decisions are the row's own).
  for (int r = 0; r < M; ++r) {
    std::vector<RowResult> one;
    std::vector<float> one_soft;
    VocabStepStats one_stats;
    c.Run(r, 1, kDefaultScSkipMass, &one, &one_soft, &one_stats);
    EXPECT_EQ(one[0].sampled, sparse[r].sampled) << "row " << r;
    EXPECT_EQ(0,
              std::memcmp(one_soft.data(), sparse_soft.data() + size_t(r) * D, sizeof(float) * D))
        << "row " << r;
    EXPECT_EQ(one_stats.rows_kept_dense, r == 1 ? 1 : 0) << "row " << r;
    EXPECT_EQ(one_stats.tile_rows_skipped, r == 0 || r == 3 ? 15 : 0) << "row " << r;
  }
}

TEST(FusedVocabStepTest, EmbeddingTileNormMaxIsAnUpperBoundPerTile) {
  const SparseCase c;
  ASSERT_EQ(c.tile_norms.size(), size_t(SparseCase::V / kVocabTile));
  for (int t = 0; t < SparseCase::V / kVocabTile; ++t) {
    double want = 0;
    for (int v = t * kVocabTile; v < (t + 1) * kVocabTile; ++v) {
      want = std::max(want, Norm(c.emb.values.data() + size_t(v) * SparseCase::D, SparseCase::D));
    }
    EXPECT_GE(double(c.tile_norms[t]), want) << "tile " << t;
    EXPECT_LE(double(c.tile_norms[t]), want * (1 + 1e-5)) << "tile " << t;
  }
  EXPECT_GT(c.tile_norms[0], 0.99f);  // ids 0–2: norm ≈ 1
  EXPECT_LT(c.tile_norms[1], 0.99f);  // the others: 0.2 · (≤ 29 dims)^½ ≈ 0.77
}

// The sparse product's replay of the fused dense accumulation, where it matters: 48 tiles, so 3
// per chunk, logits rising through the vocabulary so that every tile moves the running max (the
// replay's in-chunk rescale), a row whose first 5 tiles are masked (running max −inf, then
// finite), and a mask with a sparse allowed set. Every row is too diffuse to leave a tile out, so
// the sparse mode must give the fused dense product's bits exactly.
TEST(FusedVocabStepTest, SparseModeReplaysTheFusedDenseAccumulationBitForBit) {
  const int M = 5, V = 48 * kVocabTile, D = 16;
  std::vector<float> e(size_t(V) * D);
  for (int v = 0; v < V; ++v) {
    e[size_t(v) * D] = float(v) / V;  // logit of id v ∝ v / V: rising
    for (int i = 1; i < D; ++i) e[size_t(v) * D + i] = 0.05f * std::sin(0.61f * float(v * D + i));
  }
  const Embedding emb(e, V, D);
  const std::vector<float> tile_norms = EmbeddingTileNormMax(emb.bits.data(), V, D);
  std::vector<float> hidden(size_t(M) * D, 0.0f);
  const float slope[M] = {2.0f, 3.0f, 1.0f, 2.5f, 1.5f};
  for (int r = 0; r < M; ++r) {
    hidden[size_t(r) * D] = slope[r];
    for (int i = 1; i < D; ++i) hidden[size_t(r) * D + i] = 0.3f * std::cos(float(r * D + i));
  }
  std::vector<float> temperature = {1.0f, 0.9f, 1.3f, 1.1f, 0.8f};
  std::vector<float> uniforms = {0.1f, 0.5f, 0.9f, 0.3f, 0.7f};
  const int words = (V + 63) / 64;
  std::vector<uint64_t> late(words, ~uint64_t(0)), sparse_set(words, 0);
  for (int v = 0; v < 5 * kVocabTile; ++v) late[v >> 6] &= ~(uint64_t(1) << (v & 63));
  for (int v = 0; v < V; v += 7) sparse_set[v >> 6] |= uint64_t(1) << (v & 63);
  const std::vector<const uint64_t*> masks = {nullptr, late.data(), nullptr, sparse_set.data(),
                                              nullptr};
  auto run = [&](double skip_mass, std::vector<RowResult>* out, std::vector<float>* soft,
                 VocabStepStats* stats) {
    VocabStepArgs a = ArgsFor(emb, V, D, hidden, temperature, uniforms, 0, M, 4.0f, out, soft);
    a.masks = masks.data();
    a.sc_skip_mass = skip_mass;
    a.embed_tile_norm_max = tile_norms.data();
    a.stats = stats;
    ASSERT_TRUE(FusedVocabStep(a).ok());
  };
  std::vector<RowResult> dense, sparse;
  std::vector<float> dense_soft, sparse_soft;
  VocabStepStats dense_stats, stats;
  run(0.0, &dense, &dense_soft, &dense_stats);
  run(kDefaultScSkipMass, &sparse, &sparse_soft, &stats);
  EXPECT_EQ(stats.tile_rows, int64_t(M) * 48);
  EXPECT_EQ(stats.tile_rows_skipped, 0);
  EXPECT_EQ(stats.rows_kept_dense, 0);
  for (int r = 0; r < M; ++r) {
    EXPECT_EQ(sparse[r].sampled, dense[r].sampled) << "row " << r;
    EXPECT_EQ(sparse[r].entropy, dense[r].entropy) << "row " << r;
    EXPECT_EQ(0, std::memcmp(sparse_soft.data() + size_t(r) * D, dense_soft.data() + size_t(r) * D,
                             sizeof(float) * D))
        << "row " << r;
  }
  EXPECT_GE(dense[1].argmax, 5 * kVocabTile);  // the masked row's ids start at tile 5
  EXPECT_EQ(dense[3].argmax % 7, 0);           // the sparse set's ids are multiples of 7
}

}  // namespace
}  // namespace dgserve::cpu
