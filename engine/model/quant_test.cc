// Quantized checkpoints end to end (issue 37) on the golden shapes (tiny-v512, tiny-g3; random
// weights from the generator): dgserve-quantize's writer (QuantizeCheckpoint) and the loader
// round-trip every module; the engine runs FP8, W4A16, NVFP4 and weight-only NVFP4 (NVFP4A16)
// checkpoints with batched = solo and the same bits on every GEMM path; their logits against the
// bf16 model's are measured and printed (max |Δlogit|, argmax agreement); bad checkpoints are
// refused naming the tensor or field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/match.h"
#include "common/bf16.h"
#include "common/fp8.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quant_config.h"
#include "engine/model/quant_test_fixture.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/safetensors.h"

namespace dgserve {
namespace {

using namespace ::dgserve::quant_testing;  // NOLINT: the shared fixture and helpers
using ::testing::HasSubstr;

struct Models {
  Checkpoint bf16, fp8, w4a16, nvfp4, nvfp4a16;  // nvfp4a16: weight-only, compressed-tensors
  std::string dir;
};

// "sudoku": the trained Sudoku model of the repository (models/sudoku); else a golden shape with
// the generator's random weights (seed 512).
std::unique_ptr<Models> LoadModels(const std::string& shape) {
  auto m = std::make_unique<Models>();
  m->dir = ::dgserve::testing::MakeTempDir("quant_" + shape);
  std::string bf16 = m->dir + "/bf16";
  if (shape == "sudoku") {
    const char* src = std::getenv("DGSERVE_SOURCE_DIR");
    bf16 = std::string(src != nullptr ? src : ".") + "/models/sudoku";
  } else {
    const fs::path golden = fs::path(::dgserve::testing::GoldenDir()) / shape;
    auto cfgs = LoadConfigsFromModelDir(golden.string());
    EXPECT_TRUE(cfgs.ok()) << cfgs.status();
    if (!cfgs.ok()) return nullptr;
    EXPECT_THAT(WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, bf16), IsOk());
  }
  QuantizeOptions o;
  o.progress = false;
  o.format = WeightFormat::kFp8;
  EXPECT_TRUE(QuantizeCheckpoint(bf16, m->dir + "/fp8", o).ok());
  o.format = WeightFormat::kW4A16;
  o.group_size = 32;
  EXPECT_TRUE(QuantizeCheckpoint(bf16, m->dir + "/w4a16", o).ok());
  o.format = WeightFormat::kNvfp4;
  o.group_size = 16;
  EXPECT_TRUE(QuantizeCheckpoint(bf16, m->dir + "/nvfp4", o).ok());
  o.nvfp4_layout = Nvfp4Layout::kCompressedTensors;
  o.nvfp4_activations = Nvfp4Activations::kNone;
  EXPECT_TRUE(QuantizeCheckpoint(bf16, m->dir + "/nvfp4a16", o).ok());
  for (auto [name, ck] : {std::pair{"bf16", &m->bf16},
                          {"fp8", &m->fp8},
                          {"w4a16", &m->w4a16},
                          {"nvfp4", &m->nvfp4},
                          {"nvfp4a16", &m->nvfp4a16}}) {
    auto c = LoadCheckpoint(std::string(name) == "bf16" ? bf16 : m->dir + "/" + name);
    EXPECT_TRUE(c.ok()) << name << ": " << c.status();
    if (!c.ok()) return nullptr;
    *ck = std::move(*c);
  }
  return m;
}

class QuantModelTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // Owned for the whole program, freed at exit (a raw pointer here was reported as a leak).
    static std::map<std::string, std::unique_ptr<Models>> cache;
    std::unique_ptr<Models>& m = cache[GetParam()];
    if (m == nullptr) m = LoadModels(GetParam());
    ASSERT_NE(m, nullptr);
    m_ = m.get();
  }
  Models* m_ = nullptr;
};

// ModelOpt's NVFP4 weight quantization restated (nvfp4_tensor.py): per module g = amax/(6·448);
// per 16-block s = e4m3(clamp(amax_b / (6·g), 2⁻⁹, 448)) (0 → 1); value = e2m1_rne(w / (s·g)),
// the e2m1 rounding done here by nearest-value search with ties to the even code.
void ExpectNvfp4Rows(const std::string& what, const cpu::PackedMatrix& a, const cpu::QuantMatrix& q,
                     int r0, int r1) {
  float amax = 0;
  for (int r = r0; r < r1; ++r) {
    for (int c = 0; c < a.cols(); ++c) amax = std::max(amax, std::fabs(a.At(r, c)));
  }
  const float g = amax > 0 ? amax / (6.0f * 448.0f) : 1.0f;
  for (int r = r0; r < r1; ++r) {
    ASSERT_EQ(q.WeightGlobal(r), g) << what << " row " << r;
    ASSERT_EQ(q.InputScale(), 1.0f / 6.0f) << what;
    ASSERT_EQ(q.RowScale(r), (1.0f / 6.0f) * g) << what;
    for (int c0 = 0; c0 < a.cols(); c0 += 16) {
      float bmax = 0;
      for (int c = c0; c < c0 + 16; ++c) bmax = std::max(bmax, std::fabs(a.At(r, c)));
      float s = bmax / (6.0f * g);
      if (s == 0) s = 1;
      s = RoundToE4m3(std::min(448.0f, std::max(0x1p-9f, s)));
      for (int c = c0; c < c0 + 16; ++c) {
        const float x = a.At(r, c) / (s * g);
        int best = 0;
        for (int code = 1; code < 8; ++code) {
          const float d = std::fabs(std::fabs(x) - E2m1Value(code));
          const float db = std::fabs(std::fabs(x) - E2m1Value(best));
          if (d < db || (d == db && code % 2 == 0)) best = code;
        }
        const float want = (x < 0 ? -1.0f : 1.0f) * E2m1Value(best) * s;
        ASSERT_EQ(q.Widened(r, c), want) << what << " " << r << " " << c << " x " << x;
      }
    }
  }
}

// The writer's rounding, restated: FP8 per row s = absmax/448, code = e4m3_rne(w/s); W4A16 per
// group s = bf16(absmax/7.5), q = clamp(rne(w/s), −8, 7); NVFP4 as ExpectNvfp4Rows. Unquantized
// modules are the bf16 ones.
TEST_P(QuantModelTest, QuantizeAndLoadRoundTripEveryModule) {
  const auto ref = Matrices(m_->bf16.weights);
  for (const Checkpoint* ck : {&m_->fp8, &m_->w4a16, &m_->nvfp4}) {
    const bool fp8 = ck == &m_->fp8, nvfp4 = ck == &m_->nvfp4;
    EXPECT_EQ(ck->weights.format, fp8     ? WeightFormat::kFp8
                                  : nvfp4 ? WeightFormat::kNvfp4
                                          : WeightFormat::kW4A16);
    const auto got = Matrices(ck->weights);
    ASSERT_EQ(got.size(), ref.size());
    int quantized = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const cpu::PackedMatrix& a = *ref[i].second;
      const cpu::PackedMatrix& b = *got[i].second;
      ASSERT_EQ(a.rows(), b.rows()) << got[i].first;
      ASSERT_EQ(a.cols(), b.cols()) << got[i].first;
      const bool keep = got[i].first == "lm_head" || absl::StrContains(got[i].first, "router") ||
                        absl::StartsWith(got[i].first, "sc_") ||
                        (nvfp4 && a.cols() % 16 != 0);  // NVFP4: kept, named in the exclude list
      if (keep || a.empty()) {
        EXPECT_EQ(b.quant(), nullptr) << got[i].first;
        EXPECT_TRUE(a.UnpackBf16() == b.UnpackBf16()) << got[i].first;
        continue;
      }
      ASSERT_NE(b.quant(), nullptr) << got[i].first;
      ++quantized;
      const cpu::QuantMatrix& q = *b.quant();
      if (nvfp4) {
        // An expert's gate_up holds two modules (gate rows, up rows), each with its own g.
        const bool two = absl::StrContains(got[i].first, "gate_up[");
        const int half = two ? a.rows() / 2 : a.rows();
        ExpectNvfp4Rows(got[i].first, a, q, 0, half);
        if (two) ExpectNvfp4Rows(got[i].first, a, q, half, a.rows());
        continue;
      }
      for (int r = 0; r < a.rows(); ++r) {
        if (fp8) {
          float absmax = 0;
          for (int c = 0; c < a.cols(); ++c) absmax = std::max(absmax, std::fabs(a.At(r, c)));
          const float s = absmax > 0 ? absmax / 448.0f : 1.0f;
          ASSERT_EQ(q.RowScale(r), s) << got[i].first << " row " << r;
          for (int c = 0; c < a.cols(); ++c) {
            ASSERT_EQ(q.Widened(r, c), RoundToE4m3(a.At(r, c) / s)) << got[i].first;
          }
        } else {
          for (int c0 = 0; c0 < a.cols(); c0 += 32) {
            const int c1 = std::min(a.cols(), c0 + 32);
            float absmax = 0;
            for (int c = c0; c < c1; ++c) absmax = std::max(absmax, std::fabs(a.At(r, c)));
            float s = RoundToBf16(absmax / 7.5f);
            if (s == 0) s = 1;
            for (int c = c0; c < c1; ++c) {
              const float qv = std::min(7.0f, std::max(-8.0f, std::nearbyint(a.At(r, c) / s)));
              ASSERT_EQ(q.Widened(r, c), qv * s) << got[i].first << " " << r << " " << c;
            }
          }
        }
      }
    }
    EXPECT_GT(quantized, 0);
    // Norms and scalars as in the bf16 checkpoint.
    EXPECT_EQ(::dgserve::testing::WeightScalars(ck->weights),
              ::dgserve::testing::WeightScalars(m_->bf16.weights));
    EXPECT_EQ(ck->weights.final_norm, m_->bf16.weights.final_norm);
    EXPECT_EQ(ck->weights.embed_tokens, m_->bf16.weights.embed_tokens);
    std::printf(
        "%s %s: weights %.3f MB resident (bf16 %.3f MB), WeightBytes %lld\n", GetParam().c_str(),
        WeightFormatName(ck->weights.format),
        [&] {
          size_t b = 0;
          for (auto& [n, p] : got) b += p->bytes();
          return b / 1e6;
        }(),
        [&] {
          size_t b = 0;
          for (auto& [n, p] : ref) b += p->bytes();
          return b / 1e6;
        }(),
        static_cast<long long>(WeightBytes(ck->config, ck->quant)));
  }
}

// Per GEMM: y = x·Wᵀ of the quantized module against the bf16 one on random N(0, 1) rows:
// relative RMS error (printed, the worst and the mean over modules).
TEST_P(QuantModelTest, PerModuleGemmErrorIsMeasured) {
  const auto ref = Matrices(m_->bf16.weights);
  double nvfp4_mean = 0;
  for (const Checkpoint* ck : {&m_->fp8, &m_->w4a16, &m_->nvfp4, &m_->nvfp4a16}) {
    const auto got = Matrices(ck->weights);
    double worst = 0, sum = 0;
    int n = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i].second->quant() == nullptr) continue;
      const cpu::PackedMatrix& a = *ref[i].second;
      const int m = 8;
      std::vector<float> x(size_t(m) * a.cols()), y0(size_t(m) * a.rows()), y1(y0.size());
      for (size_t j = 0; j < x.size(); ++j) x[j] = std::sin(1.7f * float(j) + 0.3f * float(i));
      cpu::Linear(x.data(), m, a, y0.data());
      cpu::Linear(x.data(), m, *got[i].second, y1.data());
      double num = 0, den = 0;
      for (size_t j = 0; j < y0.size(); ++j) {
        num += double(y1[j] - y0[j]) * (y1[j] - y0[j]);
        den += double(y0[j]) * y0[j];
      }
      const double rel = std::sqrt(num / std::max(den, 1e-30));
      worst = std::max(worst, rel);
      sum += rel;
      ++n;
    }
    std::printf(
        "%s %s: per-GEMM relative RMS error vs bf16: mean %.4f, worst %.4f over %d modules\n",
        GetParam().c_str(), QuantizationName(ck->quant), sum / n, worst, n);
    // NVFP4 is W4A4: its error is the 4-bit weights' and the 4-bit activations' together.
    // Weight-only NVFP4 has the weights' alone: the W4A16 bound, and less than W4A4's (which
    // quantizing its activations anyway would not be).
    EXPECT_LT(worst, ck == &m_->fp8 ? 0.2 : ck == &m_->nvfp4 ? 0.6 : 0.4);
    if (ck == &m_->nvfp4) nvfp4_mean = sum / n;
    if (ck == &m_->nvfp4a16) EXPECT_LT(sum / n, 0.8 * nvfp4_mean);
  }
}

TEST_P(QuantModelTest, BatchedEqualsSoloAndEveryGemmPathGivesTheSameBits) {
  const cpu::GemmIsa saved = cpu::ActiveGemmIsa();
  for (const Checkpoint* ck : {&m_->fp8, &m_->w4a16, &m_->nvfp4, &m_->nvfp4a16}) {
    std::vector<Pass> runs;
    std::vector<std::string> names;
    for (cpu::GemmIsa isa : {cpu::GemmIsa::kAvx512, cpu::GemmIsa::kAvx2, cpu::GemmIsa::kPortable}) {
      if (!cpu::GemmIsaSupported(isa)) continue;
      ASSERT_TRUE(cpu::SetGemmIsa(isa).ok());
      const Pass batched = RunPasses(*ck, true), solo = RunPasses(*ck, false);
      EXPECT_TRUE(batched.keys == solo.keys) << cpu::GemmIsaName(isa);
      EXPECT_TRUE(batched.logits == solo.logits) << cpu::GemmIsaName(isa);
      runs.push_back(batched);
      names.push_back(cpu::GemmIsaName(isa));
    }
    ASSERT_TRUE(cpu::SetGemmIsa(saved).ok());
    for (size_t i = 1; i < runs.size(); ++i) {
      EXPECT_TRUE(runs[i].keys == runs[0].keys) << names[i] << " vs " << names[0];
      EXPECT_TRUE(runs[i].logits == runs[0].logits) << names[i] << " vs " << names[0];
    }
  }
}

// `q`'s decoder logits against `ref`'s, rows of `vocab`: the largest |Δlogit|, the rows whose
// argmax (the first maximum) agrees, and whether every logit of `q` is finite.
struct LogitDiff {
  double max_diff = 0;
  size_t agree = 0;
  bool finite = true;
};
LogitDiff CompareLogits(const Pass& ref, const Pass& q, int vocab) {
  LogitDiff d;
  const size_t rows = ref.logits.size() / vocab;
  for (size_t r = 0; r < rows; ++r) {
    const float* a = ref.logits.data() + r * vocab;
    const float* b = q.logits.data() + r * vocab;
    for (int v = 0; v < vocab; ++v) {
      d.finite = d.finite && std::isfinite(b[v]);
      d.max_diff = std::max(d.max_diff, double(std::fabs(a[v] - b[v])));
    }
    d.agree += std::max_element(a, a + vocab) - a == std::max_element(b, b + vocab) - b;
  }
  return d;
}

// What the formats cost against bf16, measured (printed): decoder logits of the two canvases.
TEST_P(QuantModelTest, LogitsAgainstBf16AreMeasured) {
  const Pass ref = RunPasses(m_->bf16, true);
  const int V = m_->bf16.config.vocab_size;
  const size_t rows = ref.logits.size() / V;
  double range = 0;
  for (float v : ref.logits) range = std::max(range, double(std::fabs(v)));
  for (const Checkpoint* ck : {&m_->fp8, &m_->w4a16, &m_->nvfp4, &m_->nvfp4a16}) {
    const LogitDiff d = CompareLogits(ref, RunPasses(*ck, true), V);
    ASSERT_TRUE(d.finite) << QuantizationName(ck->quant);
    std::printf("%s %s vs bf16: max |dlogit| %.4f (max |logit| %.2f), argmax agreement %zu/%zu\n",
                GetParam().c_str(), QuantizationName(ck->quant), d.max_diff, range, d.agree, rows);
    // The trained Sudoku model through weight-only NVFP4 stays close to bf16 (measured
    // 2026-12-06: max |Δlogit| 3.82 of 11.2, 122/182 argmaxes; W4A4's 7.49 and 89/182 would fail).
    if (GetParam() == "sudoku" && ck == &m_->nvfp4a16) {
      EXPECT_LT(d.max_diff, 0.5 * range);
      EXPECT_GE(double(d.agree), 0.6 * double(rows));
    }
    // Otherwise measured, not asserted beyond finiteness: the golden shapes' random weights make
    // chaotic networks in which the ~3 % (FP8) / ~7 % (W4A16) error of each GEMM
    // (PerModuleGemmError) decorrelates the logits; the trained Sudoku model is the meaningful
    // figure (README).
  }
}

INSTANTIATE_TEST_SUITE_P(Golden, QuantModelTest, ::testing::Values("tiny-v512", "tiny-g3", "sudoku"),
                         [](const auto& info) {
                           std::string s = info.param;
                           std::replace(s.begin(), s.end(), '-', '_');
                           return s;
                         });

// Other Sudoku checkpoints measured as LogitsAgainstBf16AreMeasured measures its rows (the same
// passes, the bf16 models/sudoku as reference): DGSERVE_QUANT_MEASURE names them, comma-separated
// (QUANTIZED.md's calibrated NVFP4 rows); skipped without it.
TEST(QuantMeasureTest, SudokuCheckpointsFromTheEnvironment) {
  const char* dirs = std::getenv("DGSERVE_QUANT_MEASURE");
  if (dirs == nullptr || *dirs == 0) GTEST_SKIP() << "DGSERVE_QUANT_MEASURE is not set";
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  auto bf16 = LoadCheckpoint(std::string(src != nullptr ? src : ".") + "/models/sudoku");
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  const Pass ref = RunPasses(*bf16, true);
  const int V = bf16->config.vocab_size;
  const size_t rows = ref.logits.size() / V;
  double range = 0;
  for (float v : ref.logits) range = std::max(range, double(std::fabs(v)));
  std::string list = dirs;
  for (size_t start = 0; start < list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    const std::string dir = list.substr(start, end - start);
    start = end + 1;
    auto ck = LoadCheckpoint(dir);
    ASSERT_TRUE(ck.ok()) << ck.status();
    const LogitDiff d = CompareLogits(ref, RunPasses(*ck, true), V);
    std::printf(
        "sudoku %s (%s) vs bf16: max |dlogit| %.4f (max |logit| %.2f), argmax agreement "
        "%zu/%zu\n",
        dir.c_str(), QuantizationName(ck->quant), d.max_diff, range, d.agree, rows);
  }
}

// The full 30-layer real-width shape's resident weights per format, by arithmetic (WeightBytes:
// bytes per tensor as the loader holds them, quantized rows padded to 16; the embedding twice),
// against the targets: ≤ 30 GB at FP8, ≤ 18 GB at 4 bits.
TEST(QuantWeightBytesTest, FullShapeFitsTheTargets) {
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  auto config = LoadModelConfig(std::string(src != nullptr ? src : ".") +
                                "/bench/configs/diffusiongemma-26b-a4b.json");
  ASSERT_TRUE(config.ok()) << config.status();
  QuantizationConfig q;
  q.targets = {"Linear"};
  q.ignore = DefaultQuantizeIgnore();
  const double bf16 = WeightBytes(*config, q) / 1e9;
  q.format = WeightFormat::kFp8;
  const double fp8 = WeightBytes(*config, q) / 1e9;
  q.format = WeightFormat::kW4A16;
  q.group_size = 128;
  const double w4 = WeightBytes(*config, q) / 1e9;
  QuantizationConfig nv;
  nv.format = WeightFormat::kNvfp4;
  nv.targets = {"Linear"};
  nv.glob_ignore = true;
  nv.ignore = {"lm_head", "*embed_tokens*", "*router*", "*norm*", "*self_conditioning*"};
  const double nvfp4 = WeightBytes(*config, nv) / 1e9;
  std::printf(
      "full shape resident weights: bf16 %.2f GB, fp8 %.2f GB, w4a16 (g128) %.2f GB, nvfp4 %.2f "
      "GB\n",
      bf16, fp8, w4, nvfp4);
  EXPECT_LE(fp8, 30.0);
  EXPECT_LE(w4, 18.0);
  EXPECT_LE(nvfp4, 18.0);
}

// ---- Refusals: a bad quantized checkpoint is an error naming the tensor or field. ----

TEST_F(QuantErrorTest, UnchangedCopiesLoad) {
  EXPECT_EQ(LoadEdited("fp8", nullptr), "");
  EXPECT_EQ(LoadEdited("w4a16", nullptr), "");
  EXPECT_EQ(LoadEdited("nvfp4", nullptr), "");
}

TEST_F(QuantErrorTest, UnsupportedSchemesNameTheField) {
  auto qc = [](const char* path, json v) {
    return [path, v](json& c) { c["quantization_config"][json::json_pointer(path)] = v; };
  };
  EXPECT_THAT(LoadEdited("fp8", nullptr, qc("/quant_method", "gptq")),
              HasSubstr("quantization_config.quant_method"));
  EXPECT_THAT(LoadEdited("fp8", nullptr, qc("/format", "mxfp4-pack-quantized")),
              HasSubstr("quantization_config.format"));
  // nvfp4-pack-quantized is loaded; an FP8 scheme under it is refused naming the field.
  EXPECT_THAT(LoadEdited("fp8", nullptr, qc("/format", "nvfp4-pack-quantized")),
              HasSubstr("quantization_config.config_groups.group_0.weights.num_bits' is 8"));
  EXPECT_THAT(LoadEdited("fp8", nullptr, qc("/config_groups/group_0/weights/strategy", "tensor")),
              HasSubstr("quantization_config.config_groups.group_0.weights.strategy"));
  EXPECT_THAT(
      LoadEdited("fp8", nullptr, qc("/config_groups/group_0/input_activations/dynamic", false)),
      HasSubstr("input_activations.dynamic"));
  EXPECT_THAT(LoadEdited("w4a16", nullptr, qc("/config_groups/group_0/weights/num_bits", 8)),
              HasSubstr("weights.num_bits"));
  EXPECT_THAT(LoadEdited("w4a16", nullptr, qc("/config_groups/group_0/weights/actorder", "group")),
              HasSubstr("weights.actorder"));
}

TEST_F(QuantErrorTest, MissingOrMistypedTensorsAreNamed) {
  EXPECT_THAT(LoadEdited("fp8", [](auto& t) { Erase(t, kQ + ".weight_scale"); }),
              HasSubstr("'" + kQ + ".weight_scale' is missing"));
  EXPECT_THAT(LoadEdited("fp8",
                         [](auto& t) {
                           for (auto& s : t) {
                             if (s.name == kQ + ".weight_scale") s.shape = {32, 2};
                           }
                         }),
              HasSubstr("tensor '" + kQ + ".weight_scale' has dtype F32 and shape [32, 2]"));
  static std::vector<uint16_t> zeros(64 * 64);
  EXPECT_THAT(LoadEdited("fp8",
                         [](auto& t) {
                           Erase(t, kQ + ".weight");
                           t.push_back(TensorFromBuffer(kQ + ".weight", DType::kBF16, {64, 64},
                                                        zeros.data()));
                         }),
              HasSubstr("tensor '" + kQ + ".weight' has dtype BF16"));
  const std::string e = "model.decoder.layers.1.experts.3.up_proj";
  EXPECT_THAT(LoadEdited("w4a16", [&](auto& t) { Erase(t, e + ".weight_packed"); }),
              HasSubstr("'" + e + ".weight_packed' is missing"));
  static const int64_t wrong[2] = {7, 7};
  EXPECT_THAT(LoadEdited("w4a16",
                         [&](auto& t) {
                           Erase(t, kQ + ".weight_shape");
                           t.push_back(TensorFromBuffer(kQ + ".weight_shape", DType::kI64, {2}, wrong));
                         }),
              HasSubstr("tensor '" + kQ + ".weight_shape' says [7, 7]"));
  // A quantized tensor the config does not quantize.
  EXPECT_THAT(LoadEdited("fp8", nullptr,
                         [](json& c) {
                           c["quantization_config"]["ignore"].push_back("re:.*q_proj");
                         }),
              HasSubstr("tensor '" + kQ + ".weight' has dtype F8_E4M3"));
  // No quantization_config at all.
  EXPECT_THAT(LoadEdited("fp8", nullptr, [](json& c) { c.erase("quantization_config"); }),
              HasSubstr("has dtype F8_E4M3 but config.json has no quantization_config"));
}

}  // namespace
}  // namespace dgserve
