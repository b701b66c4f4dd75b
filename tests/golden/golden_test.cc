// Golden parity: every model and case listed in $DGSERVE_GOLDEN_DIR/index.json (default: the
// copy in tests/testdata/golden) is rebuilt with the dgserve-mkmodel generator, loaded with the
// checkpoint loader and run teacher-forced step by step through the CPU backend and the sampler
// (golden README §6). Tolerances come from index.json's `tolerances_f32_engine`.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/denoise/entropy_bound.h"
#include "engine/denoise/row_sampler.h"
#include "engine/denoise/sampler_params.h"
#include "engine/denoise/stopping.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"
#include "engine/model/random_checkpoint.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path GoldenDir() {
  if (const char* env = std::getenv("DGSERVE_GOLDEN_DIR"); env && *env) return env;
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  return fs::path(src ? src : ".") / "tests" / "testdata" / "golden";
}

json ReadJson(const fs::path& p) {
  std::ifstream in(p);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  return json::parse(in);
}

std::vector<float> ReadF32(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + p.string());
  in.seekg(0, std::ios::end);
  const size_t n = in.tellg();
  std::vector<float> v(n / 4);
  in.seekg(0);
  in.read(reinterpret_cast<char*>(v.data()), n);
  return v;
}

// A golden model rebuilt from its recipe, shared by that model's cases.
struct GoldenModel {
  Checkpoint checkpoint;
  std::unique_ptr<ModelBackend> backend;
};

// The CPU backend's GEMM input mode (main: --cpu_gemm_input=float32|bf16).
cpu::GemmInput& GemmInputMode() {
  static cpu::GemmInput mode = cpu::GemmInput::kFloat32;
  return mode;
}

GoldenModel& GetModel(const std::string& name, const json& entry) {
  static std::map<std::string, std::unique_ptr<GoldenModel>> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return *it->second;
  const fs::path root = GoldenDir();
  auto config = LoadModelConfig((root / entry["config"].get<std::string>()).string());
  if (!config.ok()) throw std::runtime_error(config.status().ToString());
  auto gen = LoadGenerationConfig((root / entry["generation_config"].get<std::string>()).string());
  if (!gen.ok()) throw std::runtime_error(gen.status().ToString());
  const json model_json = ReadJson(root / entry["model_json"].get<std::string>());
  const uint64_t seed = model_json["generator"]["seed"].get<uint64_t>();
  const fs::path dir =
      fs::temp_directory_path() / ("dgserve_golden_" + name + "_" + std::to_string(::getpid()));
  absl::Status st = WriteRandomCheckpoint(*config, *gen, seed, dir.string(), WriteOptions{});
  if (!st.ok()) throw std::runtime_error(st.ToString());
  auto ckpt = LoadCheckpoint(dir.string());
  fs::remove_all(dir);
  if (!ckpt.ok()) throw std::runtime_error(ckpt.status().ToString());
  auto m = std::make_unique<GoldenModel>();
  m->checkpoint = std::move(*ckpt);
  CpuBackendOptions options;
  options.gemm_input = GemmInputMode();
  m->backend = CreateCpuBackend(m->checkpoint.config, m->checkpoint.weights, options);
  return *(cache[name] = std::move(m));
}

struct Tolerances {
  double logits_max_abs, argmax_gap, argmax_min_agreement, entropy_max_abs, lse_max_abs;
};

// Runs one case teacher-forced and checks every step.
void RunCase(const std::string& model_name, const json& model_entry, const std::string& case_name,
             const json& case_entry, const Tolerances& tol) {
  const fs::path root = GoldenDir();
  GoldenModel& model = GetModel(model_name, model_entry);
  const ModelConfig& cfg = model.checkpoint.config;
  const int V = cfg.vocab_size, D = cfg.hidden_size;
  const json cs = ReadJson(root / case_entry["json"].get<std::string>());
  const std::vector<float> rec_logits = ReadF32(root / case_entry["logits"].get<std::string>());
  const std::vector<float> rec_soft = ReadF32(root / case_entry["sc_soft"].get<std::string>());
  const bool full_vocab = case_entry["full_vocab_logits"].get<bool>();
  const int C = cs["canvas_length"].get<int>();
  ASSERT_EQ(C, cfg.canvas_length);
  ASSERT_EQ(cs["vocab_size"].get<int>(), V);
  const int slice = full_vocab ? V : case_entry["logits_shape"][2].get<int>();
  ASSERT_EQ(rec_soft.size() % (size_t(C) * D), 0u);

  SamplerParams params;
  const json& g = cs["generation"];
  params.max_denoising_steps = g["max_denoising_steps"].get<int>();
  params.t_min = g["t_min"].get<float>();
  params.t_max = g["t_max"].get<float>();
  params.entropy_bound = g["entropy_bound"].get<float>();
  params.stability_threshold = g["stability_threshold"].get<int>();
  params.confidence_threshold = g["confidence_threshold"].get<float>();
  ASSERT_TRUE(ValidateSamplerParams(params).ok());

  ContiguousKvCache kv(cfg, 1 << 16);
  std::vector<int32_t> encoded;  // the token ids in kv
  std::vector<float> logits(size_t(C) * V), work(size_t(C) * V), soft(size_t(C) * D);
  std::vector<RowResult> rows(C);
  std::vector<float> uniforms(C, 0.5f);
  double worst_logit = 0, worst_entropy = 0, worst_lse = 0;
  int64_t argmax_total = 0, argmax_agree = 0;

  for (const json& block : cs["blocks"]) {
    const int b = block["block"].get<int>();
    SCOPED_TRACE("block " + std::to_string(b));
    // Encode whatever of the block's context is not in the cache yet: the prompt for the first
    // block, the previous block's committed canvas (the commit pass) for later ones.
    const auto context = block["context_ids"].get<std::vector<int32_t>>();
    ASSERT_GE(context.size(), encoded.size());
    ASSERT_TRUE(std::equal(encoded.begin(), encoded.end(), context.begin()))
        << "context of block " << b << " does not extend the previous one";
    std::vector<int32_t> fresh(context.begin() + encoded.size(), context.end());
    EncodeInput enc{fresh, &kv};
    ASSERT_TRUE(model.backend->Encode({&enc, 1}).ok());
    encoded = context;
    ASSERT_EQ(kv.num_tokens(), block["n_context"].get<int>());
    ASSERT_EQ(block["canvas_positions"][0].get<int>(), kv.num_tokens());

    StableAndConfidentStop stop(params.stability_threshold, params.confidence_threshold);
    std::vector<int32_t> last_argmax;
    int executed = 0;
    const json* prev = nullptr;
    const json& steps = block["steps"];
    for (size_t si = 0; si < steps.size(); ++si) {
      const json& step = steps[si];
      const int s = step["step"].get<int>();
      SCOPED_TRACE("step " + std::to_string(s));
      EXPECT_EQ(StepTemperature(params, s), step["t"].get<float>());
      const auto fed = step["fed"].get<std::vector<int32_t>>();
      if (prev == nullptr) {
        EXPECT_EQ(fed, block["init_canvas"].get<std::vector<int32_t>>());
      } else {
        EXPECT_EQ(fed, (*prev)["next"].get<std::vector<int32_t>>());
      }
      const int li = step["logits_index"].get<int>();
      // Self-conditioning input, teacher forced (golden README §6).
      const float* sc = nullptr;
      if (step["sc_use"].get<int>() != 0) {
        const float* recorded = rec_soft.data() + size_t(li) * C * D;
        if (full_vocab) {
          // Recompute it from the previous step's recorded logits: exercises our softmax and
          // soft-embedding GEMM; it must agree with the recorded soft embedding.
          const int pli = (*prev)["logits_index"].get<int>();
          std::copy_n(rec_logits.data() + size_t(pli) * C * V, size_t(C) * V, work.data());
          SampleRows(work.data(), C, V, step["sc_temperature"].get<float>(), uniforms,
                     /*write_probs=*/true, rows);
          ASSERT_TRUE(model.backend->SoftEmbedding(work.data(), C, soft.data()).ok());
          double worst_soft = 0;
          for (size_t i = 0; i < soft.size(); ++i) {
            worst_soft = std::max(worst_soft, double(std::fabs(soft[i] - recorded[i])));
          }
          EXPECT_LE(worst_soft, 1e-3) << "soft embedding from recorded logits";
          sc = soft.data();
        } else {
          sc = recorded;
        }
      }
      DecodeInput in{fed, sc, &kv, logits.data()};
      ASSERT_TRUE(model.backend->Decode({&in, 1}).ok());

      // Rows that a near-tied router decision may legitimately change (golden README §3).
      std::vector<bool> tied(C, false);
      for (const json& t : step["router_near_ties"]) {
        tied[t["canvas_position"].get<int>()] = true;
      }
      // Logits at the recorded ids.
      const float* rec = rec_logits.data() + size_t(li) * C * slice;
      std::vector<int32_t> ids(slice);
      if (full_vocab) {
        for (int i = 0; i < V; ++i) ids[i] = i;
      } else {
        ids = step["slice_ids"].get<std::vector<int32_t>>();
      }
      // The step's worst logit (checked after the whole step, so that the report below has the
      // worst over every step even when one is off).
      double step_worst = -1;
      int worst_p = 0, worst_id = 0;
      for (int p = 0; p < C; ++p) {
        if (tied[p]) continue;
        for (int i = 0; i < slice; ++i) {
          const double d = std::fabs(logits[size_t(p) * V + ids[i]] - rec[size_t(p) * slice + i]);
          if (d > step_worst) {
            step_worst = d;
            worst_p = p;
            worst_id = ids[i];
          }
        }
      }
      worst_logit = std::max(worst_logit, step_worst);
      EXPECT_LE(step_worst, tol.logits_max_abs)
          << "logit at position " << worst_p << " id " << worst_id;
      // Per-position sampler quantities from our logits.
      std::copy(logits.begin(), logits.end(), work.begin());
      SampleRows(work.data(), C, V, step["t"].get<float>(), uniforms, false, rows);
      const auto rec_argmax = step["argmax"].get<std::vector<int32_t>>();
      const auto rec_entropy = step["entropy"].get<std::vector<float>>();
      const auto rec_lse = step["lse"].get<std::vector<double>>();
      const auto gap = step["top2_gap"].get<std::vector<double>>();
      std::vector<float> entropy(C);
      std::vector<int32_t> argmax(C);
      for (int p = 0; p < C; ++p) {
        entropy[p] = rows[p].entropy;
        argmax[p] = rows[p].argmax;
        if (tied[p]) continue;
        worst_entropy = std::max(worst_entropy, double(std::fabs(entropy[p] - rec_entropy[p])));
        worst_lse = std::max(worst_lse, std::fabs(rows[p].lse - rec_lse[p]));
        EXPECT_LE(std::fabs(entropy[p] - rec_entropy[p]), tol.entropy_max_abs) << "pos " << p;
        EXPECT_LE(std::fabs(rows[p].lse - rec_lse[p]), tol.lse_max_abs) << "pos " << p;
        ++argmax_total;
        argmax_agree += argmax[p] == rec_argmax[p];
        if (gap[p] >= tol.argmax_gap) EXPECT_EQ(argmax[p], rec_argmax[p]) << "pos " << p;
      }
      const float mean_entropy = MeanEntropy(entropy);

      // The fused step (what generation runs: no [C, V] logits) gives the same per-position
      // quantities, and its self-conditioning output is the next step's recorded input.
      std::vector<RowResult> fused(C);
      std::vector<float> next_soft(size_t(C) * D);
      DenoiseStepInput fin;
      fin.canvas = fed;
      fin.sc_soft = sc;
      fin.kv = &kv;
      fin.temperature = step["t"].get<float>();
      fin.uniforms = uniforms;
      fin.rows = fused.data();
      fin.next_soft = next_soft.data();
      ASSERT_TRUE(model.backend->DenoiseStep({&fin, 1}).ok());
      for (int p = 0; p < C; ++p) {
        if (tied[p]) continue;
        EXPECT_LE(std::fabs(fused[p].entropy - rec_entropy[p]), tol.entropy_max_abs) << p;
        EXPECT_LE(std::fabs(fused[p].lse - rec_lse[p]), tol.lse_max_abs) << p;
        if (gap[p] >= tol.argmax_gap) EXPECT_EQ(fused[p].argmax, rec_argmax[p]) << "pos " << p;
      }
      if (si + 1 < steps.size() && steps[si + 1]["sc_use"].get<int>() != 0) {
        const float* want =
            rec_soft.data() + size_t(steps[si + 1]["logits_index"].get<int>()) * C * D;
        double worst_soft = 0;
        for (int i = 0; i < C * D; ++i) {
          if (tied[i / D]) continue;
          worst_soft = std::max(worst_soft, double(std::fabs(next_soft[i] - want[i])));
        }
        // Relative to the soft embedding's scale (|soft| ≲ embed_scale · max|E|).
        EXPECT_LE(worst_soft, 2e-3 * cfg.EmbedScale()) << "fused self-conditioning output";
      }

      // Sampler decisions, replaying the recorded draws (sampled and renoise tokens).
      const auto accepted = AcceptPositions(entropy, params.entropy_bound);
      EXPECT_EQ(accepted, step["accepted"].get<std::vector<int>>());
      const auto sampled = step["sampled"].get<std::vector<int32_t>>();
      std::vector<int32_t> next = step["next"].get<std::vector<int32_t>>();
      for (int p : accepted) next[p] = sampled[p];
      EXPECT_EQ(next, step["next"].get<std::vector<int32_t>>());
      const bool done = stop.Update(argmax, mean_entropy);
      // The recorded `stable` is the raw "argmax unchanged since the previous step"; the stop
      // rule's stability part equals it for S = 1 and is always true for S = 0.
      const bool unchanged = !last_argmax.empty() && argmax == last_argmax;
      EXPECT_EQ(unchanged, step["stable"].get<bool>());
      EXPECT_EQ(stop.stable(), params.stability_threshold == 0 ? true : unchanged);
      EXPECT_EQ(stop.confident(), step["confident"].get<bool>());
      EXPECT_EQ(done, step["stop"].get<bool>());
      last_argmax = argmax;
      ++executed;
      prev = &step;
      if (done) break;
    }
    EXPECT_EQ(executed, block["n_steps"].get<int>());
    EXPECT_EQ(last_argmax, block["committed"].get<std::vector<int32_t>>());
  }
  EXPECT_GE(double(argmax_agree) / std::max<int64_t>(argmax_total, 1), tol.argmax_min_agreement);
  std::printf("[golden %s] %s/%s: max|dlogit| %.3g, max|dH| %.3g, max|dlse| %.3g, argmax %lld/%lld\n",
              cpu::GemmInputName(GemmInputMode()), model_name.c_str(), case_name.c_str(),
              worst_logit, worst_entropy, worst_lse,
              (long long)argmax_agree, (long long)argmax_total);
}

class GoldenCaseTest : public ::testing::Test {
 public:
  GoldenCaseTest(std::string model, json model_entry, std::string name, json entry, Tolerances tol)
      : model_(std::move(model)),
        model_entry_(std::move(model_entry)),
        name_(std::move(name)),
        entry_(std::move(entry)),
        tol_(tol) {}
  void TestBody() override { RunCase(model_, model_entry_, name_, entry_, tol_); }

 private:
  std::string model_;
  json model_entry_;
  std::string name_;
  json entry_;
  Tolerances tol_;
};

// Registers one test per (model, case) in index.json.
int RegisterGoldenTests() {
  const fs::path root = GoldenDir();
  const json index = ReadJson(root / "index.json");
  const json& t = index["tolerances_f32_engine"];
  const Tolerances tol{t["logits_max_abs"].get<double>(),
                       t["argmax_exact_where_top2_gap_at_least"].get<double>(),
                       t["argmax_min_agreement"].get<double>(), t["entropy_max_abs"].get<double>(),
                       t["lse_max_abs"].get<double>()};
  int n = 0;
  // Named copies, not structured bindings: clang 14 (the sanitizer tree's compiler) cannot
  // capture those in a lambda.
  for (const auto& m : index["models"].items()) {
    const std::string& model = m.key();
    const auto& entry = m.value();
    for (const auto& kc : entry["cases"].items()) {
      const std::string& name = kc.key();
      const auto& c = kc.value();
      ::testing::RegisterTest(
          ("Golden/" + model).c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
          [=]() -> ::testing::Test* { return new GoldenCaseTest(model, entry, name, c, tol); });
      ++n;
    }
  }
  return n;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // Our one flag: --cpu_gemm_input=float32|bf16 (the CPU backend's GEMM input mode; default
  // float32, the mode the tolerances were set for).
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const std::string prefix = "--cpu_gemm_input=";
    if (arg.rfind(prefix, 0) != 0) {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
    absl::StatusOr<dgserve::cpu::GemmInput> in = dgserve::cpu::ParseGemmInput(arg.substr(prefix.size()));
    if (!in.ok()) {
      std::fprintf(stderr, "%s\n", in.status().ToString().c_str());
      return 2;
    }
    dgserve::GemmInputMode() = *in;
  }
  int n = 0;
  try {
    n = dgserve::RegisterGoldenTests();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "golden data: %s\n", e.what());
    return 1;
  }
  if (n == 0) {
    std::fprintf(stderr, "golden index lists no cases\n");
    return 1;
  }
  return RUN_ALL_TESTS();
}
