#include "engine/model/cpu_vocab.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "engine/denoise/row_sampler.h"
#include "engine/model/cpu_ops.h"

namespace dgserve::cpu {
namespace {

// Many tiles per thread (V = 5003: 20 tiles, the last partial), logits spread over the softcap
// range so that the running max moves between tiles: the fused kernel must match
// Softcap + SampleRows + the soft-embedding GEMM.
TEST(FusedVocabStepTest, MatchesTheUnfusedPipeline) {
  const int M = 7, V = 5003, D = 24;
  std::vector<float> hidden(size_t(M) * D), embed(size_t(V) * D);
  for (size_t i = 0; i < hidden.size(); ++i) hidden[i] = std::sin(0.7f * float(i)) * 2.0f;
  for (size_t i = 0; i < embed.size(); ++i) {
    embed[i] = std::cos(0.013f * float(i) * float(i % 97)) * (1.0f + float(i / D) / V);
  }
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
  a.embed = embed.data();
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
  VocabStepArgs a;
  a.hidden = hidden.data();
  a.rows = M;
  a.embed = embed.data();
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
  st = FusedVocabStep(a);
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
}

}  // namespace
}  // namespace dgserve::cpu
