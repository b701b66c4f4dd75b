#include "engine/model/cpu_vocab.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common/bf16.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/cpu/gemm.h"
#include "engine/model/cpu/packed_matrix.h"
#include "engine/model/cpu_ops.h"

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

// Many tiles per thread (V = 5003: 20 tiles, the last partial), logits spread over the softcap
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
    a.embed_scale = 1.5f;
    a.out = out->data();
    a.soft = soft->data();
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

}  // namespace
}  // namespace dgserve::cpu
