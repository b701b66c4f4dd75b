// The fixture of the CUDA backend's quantized-checkpoint tests (cuda_backend_w4a16_test.cc,
// cuda_backend_nvfp4_test.cc, cuda_backend_fp8_test.cc; issue 37): the tiny-v512 golden shape
// with random weights, quantized by QuantizeCheckpoint (dgserve-quantize) as the test asks, and the
// CPU and CUDA backends on that one checkpoint in one GEMM input mode (the test's parameter), with
// the helpers that compare them.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_testing.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve::quant_testing {

// One GEMM input mode of both backends and what a test allows in it.
struct Mode {
  const char* name;
  cuda::GemmInput gpu;
  cpu::GemmInput cpu;
  float logit;  // max |Δlogit|: relative (times max |CPU logit|) or absolute
  bool relative;
  float kv_rel;  // max |ΔK|, |ΔV| ÷ the checked rows' max |value|
  bool own_projections;
};

inline std::string ModeName(const ::testing::TestParamInfo<Mode>& info) { return info.param.name; }

// The tiny-v512 shape (its config changed by `tweak` where not null) with random weights (seed
// 512), written as bf16 and quantized with `options` into a temporary directory, loaded back.
// Null, with a test failure added, when a step fails.
inline std::unique_ptr<Checkpoint> QuantizedTinyCheckpoint(const QuantizeOptions& options,
                                                           void (*tweak)(ModelConfig*)) {
  namespace fs = std::filesystem;
  const fs::path golden = fs::path(::dgserve::testing::GoldenDir()) / "tiny-v512";
  auto cfgs = LoadConfigsFromModelDir(golden.string());
  if (!cfgs.ok()) {
    ADD_FAILURE() << cfgs.status();
    return nullptr;
  }
  if (tweak != nullptr) tweak(&cfgs->config);
  const fs::path root = fs::temp_directory_path() /
                        ("dgserve_cuda_quant_" + std::string(WeightFormatName(options.format)) +
                         "_" + std::to_string(::getpid()));
  const std::string bf16_dir = (root / "bf16").string(), q_dir = (root / "quantized").string();
  absl::StatusOr<Checkpoint> ckpt = absl::InternalError("not made");
  if (absl::Status st = WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, bf16_dir);
      !st.ok()) {
    ckpt = st;
  } else if (auto summary = QuantizeCheckpoint(bf16_dir, q_dir, options); !summary.ok()) {
    ckpt = summary.status();
  } else {
    ckpt = LoadCheckpoint(q_dir);
  }
  fs::remove_all(root);
  if (!ckpt.ok()) {
    ADD_FAILURE() << ckpt.status();
    return nullptr;
  }
  return std::make_unique<Checkpoint>(*std::move(ckpt));
}

// CRTP: `Derived` gives `static QuantizeOptions Options()` and `static void Tweak(ModelConfig*)`
// (the config change, or nothing). The checkpoint is made once per test suite
// (backend_testing::CpuGpuTest).
template <class Derived>
class CudaBackendQuantTest : public backend_testing::CpuGpuTest<Derived, Mode> {
  using Base = backend_testing::CpuGpuTest<Derived, Mode>;

 public:
  static std::unique_ptr<Checkpoint> MakeCheckpoint() {
    return QuantizedTinyCheckpoint(Derived::Options(), &Derived::Tweak);
  }

 protected:
  using Base::checkpoint_;
  using Base::config;
  using Base::cpu_;
  using Base::Encode;
  using Base::gpu_;
  using Base::Logits;
  using Base::Tokens;

  // max |cpu − gpu| (infinite where gpu is not finite); raises *scale to max |cpu|.
  static float Worst(const std::vector<float>& cpu, const std::vector<float>& gpu, float* scale) {
    float worst = 0.0f;
    for (float x : cpu) *scale = std::max(*scale, std::fabs(x));
    for (size_t i = 0; i < cpu.size(); ++i) {
      worst = std::isfinite(gpu[i]) ? std::max(worst, std::fabs(cpu[i] - gpu[i]))
                                    : std::numeric_limits<float>::infinity();
    }
    return worst;
  }

  // Encodes a 29-token prompt on both backends and decodes a canvas against it: K/V rows (the
  // window's, at positions 0, 13 and 28) within the mode's kv_rel of their largest |value| (plus
  // 2^-9 on layers whose bf16 mirror gives the host its bf16 values), the
  // logits within its logit tolerance, and the argmax of every canvas row whose CPU top-2 gap
  // exceeds twice that tolerance equal. Prints the measured errors, prefixed by `format`.
  void ExpectEncodeThenDecodeMatchesCpu(const char* format) {
    const Mode& m = this->GetParam();
    const std::vector<int32_t> prompt = Tokens(29, 0);
    ContiguousKvCache kc(config(), 256), kg(config(), 256);
    Encode(*cpu_, kc, prompt);
    Encode(*gpu_, kg, prompt);
    ASSERT_EQ(kg.num_tokens(), 29);
    ASSERT_TRUE(gpu_->SyncKvToHost(kg).ok());  // the rows are on the device until then
    float kv_worst = 0.0f;
    const CudaBackendOptions o = this->GpuOptions();
    for (int l = 0; l < config().num_layers; ++l) {
      const int w = config().KvHeads(l) * config().HeadDim(l);
      // A bf16 mirror's rows reach the host as their bf16 values (defer_kv_host_copy): up to
      // half a bf16 step, 2^-9 of the value, beyond the float32 rows' difference.
      const bool bf16_rows = o.defer_kv_host_copy && o.bf16_kv_mirror && o.tensor_core_attention &&
                             o.gemm_input == cuda::GemmInput::kBf16 &&
                             config().HeadDim(l) % 32 == 0;
      const float kv_rel = m.kv_rel + (bf16_rows ? 0x1p-9f : 0.0f);
      for (int p : {0, 13, 28}) {
        if (!config().IsFull(l) && p < 29 - (config().sliding_window - 1)) continue;
        for (bool key : {true, false}) {
          const float* c = key ? kc.KeyRow(l, p) : kc.ValueRow(l, p);
          const float* g = key ? kg.KeyRow(l, p) : kg.ValueRow(l, p);
          float scale = 1e-3f;
          const float worst = Worst({c, c + w}, {g, g + w}, &scale);
          kv_worst = std::max(kv_worst, worst / scale);
          EXPECT_LE(worst, kv_rel * scale)
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
    std::printf("%s %s: max |Δlogit| %.3g (max |logit| %.3g, tolerance %.3g), K/V %.3g of max\n",
                format, m.name, worst, scale, tol, kv_worst);
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
};

}  // namespace dgserve::quant_testing
