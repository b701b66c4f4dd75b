#include "bench/bench_checkpoint.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/system_resources.h"
#include "engine/model/config.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/synthetic_weights.h"

namespace dgserve::bench {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

absl::StatusOr<Checkpoint> BenchCheckpoint(const BenchModelSpec& spec) {
  std::string dir = spec.model_dir;
  if (!dir.empty() && spec.layers != 0) {
    return absl::InvalidArgumentError("--layers applies to --config/--config_json, not to --model");
  }
  if (!dir.empty() && (!spec.config_json.empty() || !spec.config_path.empty())) {
    return absl::InvalidArgumentError(
        "--model and --config/--config_json both name a model: give one of them");
  }
  if (!spec.config_json.empty() && !spec.config_path.empty()) {
    return absl::InvalidArgumentError("--config and --config_json: give one of them");
  }
  if (!dir.empty() && spec.synthetic) {
    return absl::InvalidArgumentError(
        "--synthetic applies to --config/--config_json, not to --model");
  }
  std::filesystem::path tmp;
  auto t0 = Clock::now();
  if (dir.empty()) {
    std::string text = spec.config_json;
    if (text.empty() && !spec.config_path.empty()) {
      absl::StatusOr<std::string> t = ReadFileToString(spec.config_path);
      if (!t.ok()) return t.status();
      text = *std::move(t);
    }
    if (text.empty()) {
      return absl::InvalidArgumentError("give --model DIR, --config FILE or --config_json TEXT");
    }
    absl::StatusOr<ModelConfig> cfg =
        ParseModelConfig(text, spec.config_json.empty() ? "--config" : "--config_json");
    if (!cfg.ok()) return cfg.status();
    if (const int n = spec.layers; n != 0) {
      if (n < 0 || n > cfg->num_layers) {
        return absl::InvalidArgumentError(
            absl::StrCat("--layers must be in [0, ", cfg->num_layers, "] (0: all), got ", n));
      }
      cfg->num_layers = n;
      cfg->layer_types.resize(n);
      cfg->layer_types.back() = LayerType::kFull;  // as the loader does (HF forces it)
    }
    // Refuse a shape whose weights (bf16, see WeightBytes) cannot fit before writing it (host
    // memory; with synthetic weights on the device the host holds only the norms and scalars).
    const bool device_weights = spec.synthetic && spec.on_device;
    const int64_t bytes = WeightBytes(*cfg);
    std::printf("weights in memory: %.2f GB (bf16 matrices, embedding twice)%s\n", bytes / 1e9,
                device_weights ? " (on the device, generated there)" : "");
    if (!device_weights) {
      if (auto avail = AvailableMemoryBytes(); avail && uint64_t(bytes) > *avail) {
        return absl::ResourceExhaustedError(absl::StrFormat(
            "this shape needs %.1f GB of weights but only %.1f GB of memory are available; use "
            "--layers N for a slice%s",
            bytes / 1e9, double(*avail) / 1e9,
            spec.on_device ? " or --synthetic (weights made on the device)" : ""));
      }
    }
    if (spec.synthetic) {
      Checkpoint ckpt;
      ckpt.config = *cfg;
      if (!spec.on_device) {
        ckpt.weights = SyntheticModelWeights(ckpt.config, spec.seed);
        std::printf("generated synthetic weights in host memory in %.1f s\n", Since(t0));
      }
      return ckpt;
    }
    tmp = std::filesystem::temp_directory_path() / absl::StrCat("dgserve_bench_", ::getpid());
    if (absl::Status st = WriteRandomCheckpoint(*cfg, GenerationConfig{}, spec.seed, tmp.string());
        !st.ok()) {
      std::filesystem::remove_all(tmp);
      return st;
    }
    std::printf("generated checkpoint in %.1f s\n", Since(t0));
    dir = tmp.string();
  }
  t0 = Clock::now();
  absl::StatusOr<Checkpoint> loaded = LoadCheckpoint(dir);
  if (!tmp.empty()) std::filesystem::remove_all(tmp);
  if (!loaded.ok()) return loaded.status();
  std::printf("loaded checkpoint in %.1f s\n", Since(t0));
  return loaded;
}

}  // namespace dgserve::bench
