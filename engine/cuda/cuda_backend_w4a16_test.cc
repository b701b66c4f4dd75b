// The CUDA backend on a W4A16 checkpoint (issue 37 item 4; label `gpu`, skipped without a GPU;
// `gpu-emu` under the emulation): the tiny random checkpoint (tiny-v512 golden shape) quantized
// by QuantizeCheckpoint (dgserve-quantize --format w4a16 --group_size 16) with only the MoE
// experts quantized, so the experts stay in 4 bits on the device (cuda::UploadW4A16) and run in
// MoeGateUpW4A16 / MoeDownW4A16 while every other weight is the same bf16 on both backends;
// CudaBackendW4A16DenseTest quantizes the dense projections too (DenseLinearW4A16).
// Encode + Decode against the CPU backend on the same checkpoint (whose W4A16 Linears run
// cpu::QuantLinear: float32 activations times float32(q)·s, in both CPU GEMM modes):
//   float32: the GPU's exact three-term activation split times the exact two-term weights gives
//     the CPU's products: logits, keys and values to float32 accumulation order (1e-3 of the
//     largest |value|, cuda_backend_test's float32 tolerances).
//   bf16: the W4A16 Linears (experts and dense) take float32 activations on the GPU too (the
//     W4A16 functions of cuda_moe.h take no GemmInput), so the two backends share every rounding
//     point; what remains is the order of float32 sums (cuBLAS against the CPU's chain for the
//     bf16 projections), which the bf16 tolerances below bound with a margin of about 2×.
//     Before (issue 37): the GPU rounded the W4A16 experts' inputs to bf16 in this mode, where
//     the CPU takes them in float32; on the all-W4A16 checkpoint that flipped decoder row 3's
//     route in layer 1 (CPU top-2 gap 3e-4; router logits of experts 4 and 7 0.6151 / 0.6168
//     with float32 expert inputs, 0.6195 / 0.6118 with bf16 ones), four routes in all, and the
//     logits differed by 5.8; the experts-only checkpoint (no flipped route) by 0.238.
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
// The projections on cuBLAS as cuda_backend_test's kBf16Mode (see its own_projections), with
// tolerances for the experts-only checkpoint, its bf16 projections summed in cuBLAS's order:
// measured under the emulation max |Δlogit| 0.078, K/V 4.6e-3 of the max (before the fix: 0.238
// and 8.5e-3, the expert inputs rounded to bf16 on the GPU only).
constexpr Mode kBf16{"bf16", cuda::GemmInput::kBf16, cpu::GemmInput::kBf16, 0.15f, false, 1e-2f,
                     false};
// The all-W4A16 checkpoint in bf16 mode: every projection but the router, the LM head and the
// self-conditioning MLP is W4A16 (float32 activations on both backends), so the backends differ
// by float32 summation order, and where it moves a bf16-rounded value (the attention's q, K, V
// and probabilities, issue 34; the router, SC MLP and LM head inputs) across a rounding boundary:
// measured max |Δlogit| 0.051, K/V 2.2e-3 of the max (6.2e-3 and 5.2e-5 while the attention was
// float32; before the expert fix: 5.8 and 8e-3).
constexpr Mode kBf16Dense{"bf16", cuda::GemmInput::kBf16, cpu::GemmInput::kBf16, 0.1f, false, 4e-3f,
                          false};

class CudaBackendW4A16Test : public quant_testing::CudaBackendQuantTest<CudaBackendW4A16Test> {
 public:
  static QuantizeOptions Options() {
    QuantizeOptions options;
    options.format = WeightFormat::kW4A16;
    options.group_size = 16;
    options.progress = false;
    // The experts only: attention and the dense MLP stay bf16 (CudaBackendW4A16DenseTest
    // quantizes them too).
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
  ExpectEncodeThenDecodeMatchesCpu("w4a16");
}

INSTANTIATE_TEST_SUITE_P(GemmInputs, CudaBackendW4A16Test, ::testing::Values(kFloat32, kBf16),
                         quant_testing::ModeName);

// Every Linear dgserve-quantize quantizes by default (attention, dense MLP, experts and whatever
// else its default ignore list leaves) in W4A16: the dense projections stay 4-bit on the device
// too (CudaBackend's UploadDeviceWeights) and run DenseLinearW4A16, whose products are the CPU's
// (cpu::QuantLinear's widened q·s), so the float32 tolerances hold.
class CudaBackendW4A16DenseTest
    : public quant_testing::CudaBackendQuantTest<CudaBackendW4A16DenseTest> {
 public:
  static QuantizeOptions Options() {
    QuantizeOptions options;
    options.format = WeightFormat::kW4A16;
    options.group_size = 16;
    options.progress = false;
    return options;
  }
  static void Tweak(ModelConfig*) {}
};

TEST_P(CudaBackendW4A16DenseTest, DenseLayersAreW4A16) {
  for (const LayerWeights& l : checkpoint_->weights.layers) {
    for (const cpu::PackedMatrix* m : {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.mlp_gate_proj,
                                       &l.mlp_up_proj, &l.mlp_down_proj}) {
      if (m->rows() == 0) continue;  // absent (a full layer's v_proj when K = V)
      ASSERT_NE(m->quant(), nullptr);
      EXPECT_EQ(m->quant()->format(), cpu::QuantFormat::kW4A16);
    }
  }
}

TEST_P(CudaBackendW4A16DenseTest, EncodeThenDecodeMatchesCpu) {
  ExpectEncodeThenDecodeMatchesCpu("w4a16 (dense too)");
}

// A W4A16 matrix the device cannot keep in 4 bits (here: scales that are not bf16 values, as a
// float16-scaled checkpoint has) is refused, not widened to bf16 (which would round q·s and take
// the bf16 mode's activations: another model than cpu::QuantLinear's), as a projection and as one
// expert among W4A16 ones and one bf16.
TEST_P(CudaBackendW4A16DenseTest, WeightsThatCannotStayQuantizedAreRefused) {
  const LayerWeights& l0 = checkpoint_->weights.layers[0];
  auto not_bf16_scales = [](const cpu::PackedMatrix& like) {
    const int n = like.rows(), k = like.cols(), group = 16;
    std::vector<int8_t> q(size_t(n) * k);
    for (size_t i = 0; i < q.size(); ++i) q[i] = int8_t(int(i % 16) - 8);
    // 0.1 is not a bf16 value: cuda::UploadW4A16 declines the matrix.
    const std::vector<float> scales(size_t(n) * ((k + group - 1) / group), 0.1f);
    return cpu::PackedMatrix::Quantized(
        cpu::QuantMatrix::FromInt4(q.data(), scales.data(), n, k, group));
  };
  CudaBackendOptions options;
  options.gemm_input = GetParam().gpu;
  {
    ModelWeights w = checkpoint_->weights;
    w.layers[0].q_proj = not_bf16_scales(l0.q_proj);
    auto gpu = CreateCudaBackend(config(), w, options);
    ASSERT_FALSE(gpu.ok());
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
    EXPECT_NE(gpu.status().message().find("does not widen"), std::string::npos) << gpu.status();
    EXPECT_NE(gpu.status().message().find("layer 0 q_proj (w4a16"), std::string::npos)
        << gpu.status();
  }
  {
    ModelWeights w = checkpoint_->weights;
    const cpu::PackedMatrix& e1 = l0.experts_down_proj[1];
    const std::vector<uint16_t> bits = e1.UnpackBf16();  // expert 1 as bf16, the others W4A16
    w.layers[0].experts_down_proj[1] =
        cpu::PackedMatrix::FromBf16(bits.data(), e1.rows(), e1.cols());
    auto gpu = CreateCudaBackend(config(), w, options);
    ASSERT_FALSE(gpu.ok());
    EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
    EXPECT_NE(gpu.status().message().find("layer 0 experts.down_proj of expert 0 (w4a16"),
              std::string::npos)
        << gpu.status();
  }
}

INSTANTIATE_TEST_SUITE_P(GemmInputs, CudaBackendW4A16DenseTest,
                         ::testing::Values(kFloat32, kBf16Dense), quant_testing::ModeName);

}  // namespace
}  // namespace dgserve
