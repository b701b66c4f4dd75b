// The CUDA backend against the CPU backend (label `gpu`; skipped without a GPU): the same tiny
// random checkpoint (tiny-v512 golden shape), the same inputs, Encode + Decode + several
// DenoiseSteps. Weights are bf16 on both sides; the GPU's GEMMs take float32 activations as an
// exact sum of three bf16 terms (cuda::GemmInput::kFloat32, the default), so logits, keys and
// values agree to float32 accumulation order (within 1e-3 of the largest |value|). What is
// rounded to bf16 on purpose (the self-conditioning probabilities, spec §5.3) is compared to
// bf16 accuracy (2e-2); argmax only where the CPU's top-2 gap exceeds 0.05.
#include "engine/cuda/cuda_backend.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/cuda/cuda_test_util.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {


class CudaBackendTest : public cuda::CudaTest {
 protected:
  static void SetUpTestSuite() {
    if (cuda::DeviceCount() == 0) return;  // every test skips
    auto ckpt = ::dgserve::testing::LoadRandomTinyV512("cuda_backend_test");
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    checkpoint_ = new Checkpoint(std::move(*ckpt));
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    checkpoint_ = nullptr;
  }
  void SetUp() override {
    cuda::CudaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_NE(checkpoint_, nullptr);
    cpu_ = CreateCpuBackend(config(), checkpoint_->weights);
    auto gpu = CreateCudaBackend(config(), checkpoint_->weights);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = std::move(*gpu);
  }

  const ModelConfig& config() const { return checkpoint_->config; }
  std::vector<int32_t> Tokens(int n, int salt) const {
    std::vector<int32_t> p(n);
    for (int i = 0; i < n; ++i) p[i] = (i * 37 + 11 + salt * 101) % config().vocab_size;
    return p;
  }
  static void Encode(ModelBackend& b, KvCache& kv, const std::vector<int32_t>& tokens) {
    EncodeInput in{tokens, &kv};
    const absl::Status st = b.Encode({&in, 1});
    ASSERT_TRUE(st.ok()) << st;
  }
  std::vector<float> Logits(ModelBackend& b, const KvCache& kv, const std::vector<int32_t>& canvas,
                            const float* sc) const {
    std::vector<float> logits(canvas.size() * config().vocab_size);
    DecodeInput in{canvas, sc, &kv, logits.data()};
    const absl::Status st = b.Decode({&in, 1});
    EXPECT_TRUE(st.ok()) << st;
    return logits;
  }
  // GPU logits within 1e-3 of the largest |CPU logit| (at least 1e-3), argmax equal on rows
  // whose CPU top-2 gap exceeds 0.05. The backend's default GEMM input (GemmInput::kFloat32)
  // differs from the CPU's float32 GEMMs only in the order of additions: about 4e-6 of the
  // scale under the emulation. With bf16 activations (kBf16) near-tied expert choices on this
  // random checkpoint moved logits by up to 0.4 of the scale on an H200.
  void ExpectLogitsClose(const std::vector<float>& cpu, const std::vector<float>& gpu) const {
    ASSERT_EQ(cpu.size(), gpu.size());
    const int V = config().vocab_size, rows = int(cpu.size()) / V;
    float scale = 1.0f, worst = 0.0f;
    for (float x : cpu) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < cpu.size(); ++i) {
      ASSERT_TRUE(std::isfinite(gpu[i])) << "logit " << i;
      worst = std::max(worst, std::fabs(cpu[i] - gpu[i]));
    }
    EXPECT_LE(worst, 1e-3f * scale) << "max |Δlogit| " << worst << " (max |logit| " << scale << ")";
    for (int r = 0; r < rows; ++r) {
      if (Top2Gap(cpu, r) <= 0.05f) continue;
      EXPECT_EQ(Argmax(cpu, r), Argmax(gpu, r)) << "row " << r;
    }
  }
  int Argmax(const std::vector<float>& logits, int row) const {
    const int V = config().vocab_size;
    const float* x = logits.data() + size_t(row) * V;
    return int(std::max_element(x, x + V) - x);
  }
  float Top2Gap(const std::vector<float>& logits, int row) const {
    const int V = config().vocab_size;
    std::vector<float> x(logits.begin() + size_t(row) * V, logits.begin() + size_t(row + 1) * V);
    std::partial_sort(x.begin(), x.begin() + 2, x.end(), std::greater<float>());
    return x[0] - x[1];
  }
  static void ExpectVectorsClose(const std::vector<float>& cpu, const std::vector<float>& gpu,
                                 float rel, const char* what) {
    ASSERT_EQ(cpu.size(), gpu.size());
    float scale = 1e-3f, worst = 0.0f;
    for (float x : cpu) scale = std::max(scale, std::fabs(x));
    for (size_t i = 0; i < cpu.size(); ++i) {
      ASSERT_TRUE(std::isfinite(gpu[i])) << what << " " << i;
      worst = std::max(worst, std::fabs(cpu[i] - gpu[i]));
    }
    EXPECT_LE(worst, rel * scale) << what << ": max |Δ| " << worst << " (max |x| " << scale << ")";
  }

  static Checkpoint* checkpoint_;
  std::unique_ptr<ModelBackend> cpu_, gpu_;
};
Checkpoint* CudaBackendTest::checkpoint_ = nullptr;

TEST_F(CudaBackendTest, EncodeThenDecodeMatchesCpu) {
  // 29 context tokens > 3 sliding windows (W = 8), encoded in chunks that cross window edges.
  const std::vector<int32_t> prompt = Tokens(29, 0);
  ContiguousKvCache kc(config(), 256), kg(config(), 256);
  int at = 0;
  for (int n : {5, 1, 13, 10}) {
    const std::vector<int32_t> chunk(prompt.begin() + at, prompt.begin() + at + n);
    Encode(*cpu_, kc, chunk);
    Encode(*gpu_, kg, chunk);
    at += n;
  }
  ASSERT_EQ(kg.num_tokens(), 29);
  // The K/V rows the GPU wrote into the host cache match the CPU's.
  for (int l = 0; l < config().num_layers; ++l) {
    const int w = config().KvHeads(l) * config().HeadDim(l);
    for (int p : {0, 13, 28}) {
      if (!config().IsFull(l) && p < 29 - (config().sliding_window - 1)) continue;
      std::vector<float> c(kc.KeyRow(l, p), kc.KeyRow(l, p) + w),
          g(kg.KeyRow(l, p), kg.KeyRow(l, p) + w);
      ExpectVectorsClose(c, g, 1e-3f, "key row");
      std::vector<float> cv(kc.ValueRow(l, p), kc.ValueRow(l, p) + w),
          gv(kg.ValueRow(l, p), kg.ValueRow(l, p) + w);
      ExpectVectorsClose(cv, gv, 1e-3f, "value row");
    }
  }
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 3);
  ExpectLogitsClose(Logits(*cpu_, kc, canvas, nullptr), Logits(*gpu_, kg, canvas, nullptr));
}

TEST_F(CudaBackendTest, DenoiseStepsMatchCpu) {
  const int C = config().canvas_length, D = config().hidden_size;
  ContiguousKvCache kc(config(), 256), kg(config(), 256);
  const std::vector<int32_t> prompt = Tokens(21, 1);
  Encode(*cpu_, kc, prompt);
  Encode(*gpu_, kg, prompt);
  std::vector<int32_t> canvas = Tokens(C, 7);
  std::vector<float> sc;  // the CPU's soft embedding feeds both backends (same inputs)
  std::vector<float> uniforms(C);
  for (int j = 0; j < C; ++j) uniforms[j] = float((j * 7919) % 1000) / 1000.0f;
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE(step);
    const float T = 0.8f - 0.1f * step;
    const float* sc_in = sc.empty() ? nullptr : sc.data();
    std::vector<RowResult> rc(C), rg(C);
    std::vector<float> soft_c(size_t(C) * D), soft_g(size_t(C) * D);
    DenoiseStepInput ic{canvas, sc_in, &kc, T, uniforms, rc.data(), soft_c.data(), {}};
    DenoiseStepInput ig{canvas, sc_in, &kg, T, uniforms, rg.data(), soft_g.data(), {}};
    ASSERT_TRUE(cpu_->DenoiseStep({&ic, 1}).ok());
    const absl::Status st = gpu_->DenoiseStep({&ig, 1});
    ASSERT_TRUE(st.ok()) << st;
    // Decoder logits with the same input, for the argmax gaps and a direct comparison.
    const std::vector<float> lc = Logits(*cpu_, kc, canvas, sc_in);
    ExpectLogitsClose(lc, Logits(*gpu_, kg, canvas, sc_in));
    for (int j = 0; j < C; ++j) {
      EXPECT_NEAR(rg[j].entropy, rc[j].entropy, 2e-2f * std::max(1.0f, rc[j].entropy)) << j;
      EXPECT_NEAR(rg[j].lse, rc[j].lse, 2e-2f * std::max(1.0f, std::fabs(rc[j].lse))) << j;
      if (Top2Gap(lc, j) > 0.05f) {
        EXPECT_EQ(rg[j].argmax, rc[j].argmax) << j;
      }
      EXPECT_GE(rg[j].sampled, 0);
      EXPECT_LT(rg[j].sampled, config().vocab_size);
    }
    ExpectVectorsClose(soft_c, soft_g, 2e-2f, "next_soft");
    sc = soft_c;
    for (int j = 0; j < C; ++j) canvas[j] = rc[j].sampled;
  }
}

TEST_F(CudaBackendTest, SoftEmbeddingMatchesCpu) {
  const int V = config().vocab_size, D = config().hidden_size, rows = 5;
  std::vector<float> probs(size_t(rows) * V);
  for (int r = 0; r < rows; ++r) {
    double sum = 0;
    for (int v = 0; v < V; ++v)
      sum += probs[size_t(r) * V + v] = std::exp(-0.02f * ((v * (r + 3)) % 97));
    for (int v = 0; v < V; ++v) probs[size_t(r) * V + v] /= float(sum);
  }
  std::vector<float> c(size_t(rows) * D), g(size_t(rows) * D);
  ASSERT_TRUE(cpu_->SoftEmbedding(probs.data(), rows, c.data()).ok());
  const absl::Status st = gpu_->SoftEmbedding(probs.data(), rows, g.data());
  ASSERT_TRUE(st.ok()) << st;
  ExpectVectorsClose(c, g, 2e-2f, "soft embedding");
}

TEST_F(CudaBackendTest, BatchedCanvasesAndForeignCacheMatchCpu) {
  // Two sequences encoded in one GPU batch; a third cache filled by the CPU backend only (the
  // GPU uploads it on first use). All decoded in one batch.
  const int C = config().canvas_length, V = config().vocab_size;
  ContiguousKvCache c1(config(), 256), c2(config(), 256), g1(config(), 256), g2(config(), 256),
      shared(config(), 256);
  const std::vector<int32_t> p1 = Tokens(11, 2), p2 = Tokens(30, 4), p3 = Tokens(17, 5);
  Encode(*cpu_, c1, p1);
  Encode(*cpu_, c2, p2);
  Encode(*cpu_, shared, p3);
  EncodeInput enc[2] = {{p1, &g1}, {p2, &g2}};
  ASSERT_TRUE(gpu_->Encode(enc).ok());
  const std::vector<int32_t> a = Tokens(C, 8), b = Tokens(C, 9), c = Tokens(C, 10);
  std::vector<float> l1(size_t(C) * V), l2(size_t(C) * V), l3(size_t(C) * V);
  DecodeInput dec[3] = {
      {a, nullptr, &g1, l1.data()}, {b, nullptr, &g2, l2.data()}, {c, nullptr, &shared, l3.data()}};
  const absl::Status st = gpu_->Decode(dec);
  ASSERT_TRUE(st.ok()) << st;
  ExpectLogitsClose(Logits(*cpu_, c1, a, nullptr), l1);
  ExpectLogitsClose(Logits(*cpu_, c2, b, nullptr), l2);
  ExpectLogitsClose(Logits(*cpu_, shared, c, nullptr), l3);
  // The foreign cache grows on the CPU side; the GPU picks up only the new rows.
  Encode(*cpu_, shared, Tokens(9, 6));
  ExpectLogitsClose(Logits(*cpu_, shared, c, nullptr), Logits(*gpu_, shared, c, nullptr));
}

// Canvas templates (DenoiseStepInput::row_masks) in a batch of two canvases, the second without
// masks. Checked independently of the bf16 activation rounding (see the top of this file):
// fixed positions (a one-id mask) give that id with entropy 0 and the next_soft row of that id's
// embedding, as the CPU's masked step; restricted positions give only ids of their set, entropy
// ≤ ln |set|; unrestricted rows, in both canvases, equal those of the same GPU batch without
// masks (no mask leaks to another row).
TEST_F(CudaBackendTest, CanvasTemplateMasksMatchCpu) {
  const int C = config().canvas_length, D = config().hidden_size, V = config().vocab_size;
  const int words = (V + 63) / 64, set_size = 40;
  ContiguousKvCache kc(config(), 256), kg(config(), 256), kg2(config(), 256);
  Encode(*cpu_, kc, Tokens(19, 3));
  Encode(*gpu_, kg, Tokens(19, 3));
  Encode(*gpu_, kg2, Tokens(12, 4));
  // Masks: one id per fixed position, and a set of 40 ids shared by the restricted positions.
  std::vector<std::vector<uint64_t>> masks;
  const int fixed = C / 4;
  for (int j = 0; j < fixed; ++j) {
    masks.emplace_back(words, 0);
    const int id = (j * 131 + 17) % V;
    masks.back()[id / 64] |= uint64_t(1) << (id % 64);
  }
  masks.emplace_back(words, 0);
  for (int k = 0; k < set_size; ++k) {
    const int id = (k * 61 + 5) % V;
    masks.back()[id / 64] |= uint64_t(1) << (id % 64);
  }
  const std::vector<uint64_t>& set = masks.back();
  std::vector<const uint64_t*> row_masks(C, nullptr);
  for (int j = fixed; j < C; j += 2) row_masks[j] = set.data();  // odd j: unrestricted holes
  for (int j = 0; j < fixed; ++j) row_masks[j] = masks[j].data();
  auto allowed = [](const uint64_t* m, int id) { return ((m[id / 64] >> (id % 64)) & 1) != 0; };
  const std::vector<int32_t> canvas = Tokens(C, 12), canvas2 = Tokens(C, 13);
  std::vector<float> u(C);
  for (int j = 0; j < C; ++j) u[j] = float((j * 613) % 1000) / 1000.0f;
  const float T = 0.7f;
  struct Out {
    std::vector<RowResult> rows, rows2;
    std::vector<float> soft, soft2;
  };
  auto run = [&](ModelBackend& b, KvCache& k1, bool with_masks, bool two) {
    Out o{std::vector<RowResult>(C), std::vector<RowResult>(C), std::vector<float>(size_t(C) * D),
          std::vector<float>(size_t(C) * D)};
    std::vector<DenoiseStepInput> in;
    in.push_back({canvas, nullptr, &k1, T, u, o.rows.data(), o.soft.data(), {}});
    if (with_masks) in.back().row_masks = row_masks;
    if (two) in.push_back({canvas2, nullptr, &kg2, T, u, o.rows2.data(), o.soft2.data(), {}});
    const absl::Status st = b.DenoiseStep(in);
    EXPECT_TRUE(st.ok()) << st;
    return o;
  };
  const Out cpu = run(*cpu_, kc, true, false);
  const Out masked = run(*gpu_, kg, true, true);
  const Out plain = run(*gpu_, kg, false, true);
  auto same = [](const RowResult& a, const RowResult& b) {
    return a.argmax == b.argmax && a.sampled == b.sampled && a.entropy == b.entropy &&
           a.lse == b.lse;
  };
  for (int j = 0; j < C; ++j) {
    SCOPED_TRACE(j);
    const RowResult& g = masked.rows[j];
    EXPECT_TRUE(same(masked.rows2[j], plain.rows2[j])) << "unmasked canvas changed";
    if (row_masks[j] == nullptr) {
      EXPECT_TRUE(same(g, plain.rows[j])) << "unrestricted row changed";
      continue;
    }
    EXPECT_TRUE(allowed(row_masks[j], g.argmax)) << g.argmax;
    EXPECT_TRUE(allowed(row_masks[j], g.sampled)) << g.sampled;
    if (j < fixed) {
      EXPECT_EQ(g.argmax, cpu.rows[j].argmax);
      EXPECT_EQ(g.sampled, cpu.rows[j].sampled);
      EXPECT_EQ(g.entropy, 0.0f);
      std::vector<float> want(cpu.soft.begin() + size_t(j) * D,
                              cpu.soft.begin() + size_t(j + 1) * D);
      std::vector<float> got(masked.soft.begin() + size_t(j) * D,
                             masked.soft.begin() + size_t(j + 1) * D);
      ExpectVectorsClose(want, got, 1e-3f, "next_soft of a fixed position");
    } else {
      EXPECT_LE(g.entropy, std::log(float(set_size)) + 1e-4f);
    }
  }
  for (size_t i = 0; i < masked.soft2.size(); ++i) {
    ASSERT_EQ(masked.soft2[i], plain.soft2[i]) << "next_soft of the unmasked canvas, " << i;
  }
  for (int j = fixed + 1; j < C; j += 2) {
    for (int d = 0; d < D; ++d) {
      ASSERT_EQ(masked.soft[size_t(j) * D + d], plain.soft[size_t(j) * D + d]) << j << " " << d;
    }
  }
}

TEST_F(CudaBackendTest, RejectsBadInput) {
  ContiguousKvCache kv(config(), 64);
  const std::vector<int32_t> bad = {1, config().vocab_size};
  EncodeInput in{bad, &kv};
  EXPECT_EQ(gpu_->Encode({&in, 1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kv.num_tokens(), 0);
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 1);
  std::vector<RowResult> rows(canvas.size());
  std::vector<float> u(canvas.size(), 0.5f);
  DenoiseStepInput d{canvas, nullptr, &kv, 0.0f, u, rows.data(), nullptr, {}};
  EXPECT_EQ(gpu_->DenoiseStep({&d, 1}).code(), absl::StatusCode::kInvalidArgument);
  // row_masks given, but not one per canvas position.
  const std::vector<const uint64_t*> short_masks(2, nullptr);
  DenoiseStepInput m{canvas, nullptr, &kv, 0.8f, u, rows.data(), nullptr, short_masks};
  EXPECT_EQ(gpu_->DenoiseStep({&m, 1}).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dgserve
