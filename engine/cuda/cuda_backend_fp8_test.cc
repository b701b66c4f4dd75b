// The CUDA backend on an FP8 checkpoint (issue 37 item 4; label `gpu`, skipped without a GPU;
// `gpu-emu` under the emulation): the tiny random checkpoint (tiny-v512 golden shape) quantized
// by QuantizeCheckpoint (dgserve-quantize --format fp8) with the default ignore list, so the
// attention projections, the dense MLP and the experts are FP8 (router, norms, embedding, LM head
// and self-conditioning stay bf16). The backend keeps them in 8 bits (cuda::UploadFp8) and runs
// them on the FP8 tensor cores (DenseLinearFp8, MoeGateUpFp8 / MoeDownFp8); the CPU backend runs
// the same checkpoint through cpu::QuantLinear. Encode + Decode against it.
//
// Tolerance. Both backends compute the format's y = s_x·(s_w·acc) from the same codes; the FP8
// GEMMs differ only in the order of acc's float32 additions (under the emulation not even that:
// its mma adds the exact products in the CPU's order, cuda_fp8_test.cc). But an input that
// differs in its last bits (from an order difference anywhere upstream, e.g. the float32 mode's
// bf16-weight GEMMs and attention) can round to the neighbouring e4m3 value, a step of 2⁻⁴ to
// 2⁻³ of its size, and the MoE router then sees a changed row: a token's row can move by a few
// percent where the bf16 model moves by float32 rounding, and every later row attending to it
// follows. Such steps are rare (an input must lie within float32 rounding of an e4m3 tie), so:
//   bf16 mode: the bf16 rounding of every GEMM input absorbs the upstream differences: under the
//     emulation the FP8 layers see identical inputs (measured max |Δlogit| 4.3e-6); the bound is
//     cuda_backend_test's bf16 one (logits within 0.3, K/V within 2e-2 of the largest |value|).
//   float32 mode: logits within 0.1 of the largest |logit| and K/V within 0.25 of the row's
//     largest |value|, at most a quarter of the K/V rows off by more than 1e-3 and three quarters
//     of the argmaxes equal. Measured under the emulation: 0.033 and 0.092; the K/V rows off are
//     those of positions 15–22 of the last layer, i.e. one changed key/value at position 15 of
//     the sliding layer before it (window 8: rows 15–22 attend to it), 15 of 16 argmaxes equal;
//     the bf16 checkpoint in the same mode: 5.8e-5 and 2.2e-6.
// On a device the FP8 mma's addition order (and accumulator width) differs from the CPU's, so
// steps also occur in bf16 mode; the bounds above are meant to cover that, not yet measured.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/cpu/gemm_quant.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_quant_testing.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {

using quant_testing::Mode;

constexpr Mode kFloat32{
    "float32", cuda::GemmInput::kFloat32, cpu::GemmInput::kFloat32, 0.1f, true, 0.25f, true};
// As cuda_backend_test's kBf16Mode: the projections on cuBLAS (see its own_projections).
constexpr Mode kBf16{"bf16", cuda::GemmInput::kBf16, cpu::GemmInput::kBf16, 0.3f, false, 2e-2f,
                     false};

class CudaBackendFp8Test : public quant_testing::CudaBackendQuantTest<CudaBackendFp8Test> {
 public:
  static QuantizeOptions Options() {
    QuantizeOptions options;
    options.format = WeightFormat::kFp8;
    options.progress = false;
    return options;
  }
  static void Tweak(ModelConfig*) {}

 protected:
  // The attention on the float32 kernels (in the bf16 mode: their bf16 rounding, the CPU's): the
  // tensor cores' addition order differs from both, and FP8's per-token e4m3 activations can turn
  // such a difference into whole e4m3 steps. Measured under the emulation with the tensor cores
  // (issue 34): max |Δlogit| 3.62 against the CPU after this test's 29-token prompt, every canvas
  // row off; 3.8e-6 on the float32 kernels. A sweep of the prompt length with the tensor cores
  // (5, 13, 25, 28, 29, 30, 31, 33, 37, 45, 50, 63 tokens): K/V within 2.1e-7 of the largest value
  // at every length, logits within 4.8e-6 at 11 of the 12 and 3.62 at 29 alone, so one e4m3 step,
  // not a kernel fault (which would show at many lengths). The float32 GEMM mode has such steps
  // too (28 tokens: 2.82 against its 1.17). This test is about the FP8 GEMMs.
  CudaBackendOptions GpuOptions() const override {
    CudaBackendOptions options = CudaBackendQuantTest::GpuOptions();
    options.tensor_core_attention = false;
    return options;
  }
};

// The checkpoint's attention, dense MLP and experts are FP8, its router bf16: what the backend
// must keep in 8 bits.
TEST_P(CudaBackendFp8Test, ProjectionsAndExpertsAreFp8) {
  auto fp8 = [](const cpu::PackedMatrix& m) {
    return m.quant() != nullptr && m.quant()->format() == cpu::QuantFormat::kFp8;
  };
  EXPECT_EQ(checkpoint_->weights.format, WeightFormat::kFp8);
  for (const LayerWeights& l : checkpoint_->weights.layers) {
    for (const cpu::PackedMatrix& m : l.experts_gate_up_proj) EXPECT_TRUE(fp8(m));
    for (const cpu::PackedMatrix& m : l.experts_down_proj) EXPECT_TRUE(fp8(m));
    EXPECT_TRUE(fp8(l.q_proj));
    EXPECT_TRUE(fp8(l.o_proj));
    EXPECT_TRUE(fp8(l.mlp_gate_proj));
    EXPECT_TRUE(fp8(l.mlp_down_proj));
    EXPECT_EQ(l.router_proj.quant(), nullptr);
  }
}

TEST_P(CudaBackendFp8Test, EncodeThenDecodeMatchesCpu) {
  const Mode& m = GetParam();
  const std::vector<int32_t> prompt = Tokens(29, 0);
  ContiguousKvCache kc(config(), 256), kg(config(), 256);
  Encode(*cpu_, kc, prompt);
  Encode(*gpu_, kg, prompt);
  ASSERT_EQ(kg.num_tokens(), 29);
  ASSERT_TRUE(gpu_->SyncKvToHost(kg).ok());  // the rows are on the device until then
  float kv_worst = 0.0f;
  int kv_off = 0, kv_rows = 0;  // K/V rows off by more than 1e-3 of their largest |value|
  for (int l = 0; l < config().num_layers; ++l) {
    const int w = config().KvHeads(l) * config().HeadDim(l);
    for (int p = 0; p < 29; ++p) {
      if (!config().IsFull(l) && p < 29 - (config().sliding_window - 1)) continue;
      for (bool key : {true, false}) {
        const float* c = key ? kc.KeyRow(l, p) : kc.ValueRow(l, p);
        const float* g = key ? kg.KeyRow(l, p) : kg.ValueRow(l, p);
        float scale = 1e-3f;
        const float worst = Worst({c, c + w}, {g, g + w}, &scale);
        kv_worst = std::max(kv_worst, worst / scale);
        kv_off += worst > 1e-3f * scale;
        ++kv_rows;
        EXPECT_LE(worst, m.kv_rel * scale)
            << "layer " << l << " position " << p << (key ? " key" : " value");
      }
    }
  }
  const std::vector<int32_t> canvas = Tokens(config().canvas_length, 3);
  const std::vector<float> lc = Logits(*cpu_, kc, canvas), lg = Logits(*gpu_, kg, canvas);
  float scale = 1.0f;
  const float worst = Worst(lc, lg, &scale);
  const float tol = m.relative ? m.logit * scale : m.logit;
  EXPECT_LE(worst, tol) << "max |Δlogit| " << worst << " (max |logit| " << scale << ")";
  // Rows that differ at all: the e4m3 steps are rare events, most rows agree to float32 rounding.
  const int V0 = config().vocab_size;
  int rows_off = 0;
  double mean = 0;
  for (size_t r = 0; r < canvas.size(); ++r) {
    float row_worst = 0;
    for (int v = 0; v < V0; ++v) {
      const float d = std::fabs(lc[r * V0 + v] - lg[r * V0 + v]);
      row_worst = std::max(row_worst, d);
      mean += d;
    }
    rows_off += row_worst > 1e-3f * scale;
  }
  mean /= double(lc.size());
  std::printf(
      "fp8 %s: max |Δlogit| %.3g (max |logit| %.3g, tolerance %.3g), mean |Δlogit| %.3g, rows "
      "off by > 1e-3 of max: %d of %zu, K/V %.3g of max (rows off by > 1e-3 of max: %d of %d)\n",
      m.name, worst, scale, tol, mean, rows_off, canvas.size(), kv_worst, kv_off, kv_rows);
  // The e4m3 steps are rare: most K/V rows agree to float32 rounding.
  EXPECT_LE(4 * kv_off, kv_rows);
  // Tokens: the argmax of every canvas row; at least three quarters agree (every row whose CPU
  // top-2 gap exceeds twice the largest |Δlogit| must, by construction).
  const int V = config().vocab_size;
  int agree = 0;
  for (size_t r = 0; r < canvas.size(); ++r) {
    const float* c = lc.data() + r * V;
    const float* g = lg.data() + r * V;
    agree += std::max_element(c, c + V) - c == std::max_element(g, g + V) - g;
  }
  std::printf("fp8 %s: argmax agrees on %d of %zu canvas rows\n", m.name, agree, canvas.size());
  EXPECT_GE(4 * agree, 3 * int(canvas.size()));
}

INSTANTIATE_TEST_SUITE_P(GemmInputs, CudaBackendFp8Test, ::testing::Values(kFloat32, kBf16),
                         quant_testing::ModeName);

}  // namespace
}  // namespace dgserve
