// The CUDA backend on a W4A16 checkpoint (issue 37 item 4; label `gpu`, skipped without a GPU;
// `gpu-emu` under the emulation): the tiny random checkpoint (tiny-v512 golden shape) quantized
// by QuantizeCheckpoint (dgserve-quantize --format w4a16 --group_size 16) with only the MoE
// experts quantized, so the experts stay in 4 bits on the device (cuda::UploadW4A16) and run in
// MoeGateUpW4A16 / MoeDownW4A16 while every other weight is the same bf16 on both backends.
// Encode + Decode against the CPU backend on the same checkpoint (whose W4A16 experts run
// cpu::QuantLinear: float32 activations times float32(q)·s):
//   float32: the GPU's exact three-term activation split times the exact two-term weights gives
//     the CPU's products: logits, keys and values to float32 accumulation order (1e-3 of the
//     largest |value|, cuda_backend_test's float32 tolerances).
//   bf16: the GPU rounds the expert inputs to bf16 (its bf16 mode) where the CPU's W4A16 GEMM
//     takes them in float32, plus the bf16 mode's other roundings: cuda_backend_test's bf16
//     tolerances (logits within 0.3, K/V within 2e-2 of the largest |value|).
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
    "float32", cuda::GemmInput::kFloat32, cpu::GemmInput::kFloat32, 1e-3f, true, 1e-3f, true};
// As cuda_backend_test's kBf16Mode: the projections on cuBLAS (see its own_projections).
constexpr Mode kBf16{"bf16", cuda::GemmInput::kBf16, cpu::GemmInput::kBf16, 0.3f, false, 2e-2f,
                     false};

class CudaBackendW4A16Test : public quant_testing::CudaBackendQuantTest<CudaBackendW4A16Test> {
 public:
  static QuantizeOptions Options() {
    QuantizeOptions options;
    options.format = WeightFormat::kW4A16;
    options.group_size = 16;
    options.progress = false;
    // The experts only: attention and the dense MLP stay bf16 (the CUDA backend widens other
    // quantized Linears to bf16, which this test is not about).
    options.ignore.push_back("re:.*self_attn.*");
    options.ignore.push_back("re:.*\\.mlp\\..*");
    return options;
  }
  static void Tweak(ModelConfig*) {}
};

// The checkpoint's experts are W4A16 (and nothing else is): what the backend must keep in 4 bits.
TEST_P(CudaBackendW4A16Test, ExpertsAreW4A16) {
  for (const LayerWeights& l : checkpoint_->weights.layers) {
    for (const cpu::PackedMatrix& m : l.experts_gate_up_proj) {
      ASSERT_NE(m.quant(), nullptr);
      EXPECT_EQ(m.quant()->format(), cpu::QuantFormat::kW4A16);
      EXPECT_EQ(m.quant()->group_size(), 16);
    }
    for (const cpu::PackedMatrix& m : l.experts_down_proj) ASSERT_NE(m.quant(), nullptr);
    EXPECT_EQ(l.q_proj.quant(), nullptr);
    EXPECT_EQ(l.mlp_gate_proj.quant(), nullptr);
  }
}

TEST_P(CudaBackendW4A16Test, EncodeThenDecodeMatchesCpu) {
  const Mode& m = GetParam();
  const std::vector<int32_t> prompt = Tokens(29, 0);
  ContiguousKvCache kc(config(), 256), kg(config(), 256);
  Encode(*cpu_, kc, prompt);
  Encode(*gpu_, kg, prompt);
  ASSERT_EQ(kg.num_tokens(), 29);
  float kv_worst = 0.0f;
  for (int l = 0; l < config().num_layers; ++l) {
    const int w = config().KvHeads(l) * config().HeadDim(l);
    for (int p : {0, 13, 28}) {
      if (!config().IsFull(l) && p < 29 - (config().sliding_window - 1)) continue;
      for (bool key : {true, false}) {
        const float* c = key ? kc.KeyRow(l, p) : kc.ValueRow(l, p);
        const float* g = key ? kg.KeyRow(l, p) : kg.ValueRow(l, p);
        float scale = 1e-3f;
        const float worst = Worst({c, c + w}, {g, g + w}, &scale);
        kv_worst = std::max(kv_worst, worst / scale);
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
  std::printf("w4a16 %s: max |Δlogit| %.3g (max |logit| %.3g, tolerance %.3g), K/V %.3g of max\n",
              m.name, worst, scale, tol, kv_worst);
  // Tokens: the argmax of every canvas row whose CPU top-2 gap exceeds twice the tolerance.
  const int V = config().vocab_size;
  int compared = 0;
  for (size_t r = 0; r < canvas.size(); ++r) {
    std::vector<float> x(lc.begin() + r * V, lc.begin() + (r + 1) * V);
    std::partial_sort(x.begin(), x.begin() + 2, x.end(), std::greater<float>());
    if (x[0] - x[1] <= std::max(0.05f, 2 * tol)) continue;
    ++compared;
    const float* c = lc.data() + r * V;
    const float* g = lg.data() + r * V;
    EXPECT_EQ(std::max_element(c, c + V) - c, std::max_element(g, g + V) - g) << "row " << r;
  }
  EXPECT_GT(compared, 0);
}

INSTANTIATE_TEST_SUITE_P(GemmInputs, CudaBackendW4A16Test, ::testing::Values(kFloat32, kBf16),
                         quant_testing::ModeName);

}  // namespace
}  // namespace dgserve
