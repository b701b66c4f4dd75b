// NVFP4 activation calibration (issue 37): see calibrate.h.
#include "engine/generation/calibrate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/jsonl.h"
#include "common/status_macros.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/generation/generator.h"
#include "engine/model/quant_config.h"

namespace dgserve {
namespace {

constexpr int kDenseSites = 5;  // kQkv, kOProj, kMlpGateUp, kMlpDown, kRouter

float RowsAmax(const float* x, int rows, int cols) {
  float amax = 0.0f;
  for (int64_t i = 0; i < int64_t(rows) * cols; ++i) amax = std::max(amax, std::fabs(x[i]));
  return amax;
}

}  // namespace

ActivationAmaxObserver::ActivationAmaxObserver(const ModelConfig& config)
    : layers_(config.num_layers),
      experts_(config.num_experts),
      dense_(size_t(layers_) * kDenseSites, -1.0f),
      expert_(size_t(layers_) * experts_ * 2, -1.0f) {}

void ActivationAmaxObserver::Observe(LinearSite site, int layer, int expert, bool encoder,
                                     const float* x, int rows, int cols) {
  if (rows <= 0) return;
  const float amax = RowsAmax(x, rows, cols);
  float* slot = nullptr;
  switch (site) {
    case LinearSite::kScGateUp: slot = &sc_[0]; break;
    case LinearSite::kScDown: slot = &sc_[1]; break;
    case LinearSite::kExpertGateUp:
    case LinearSite::kExpertDown:
      if (layer < 0 || layer >= layers_ || expert < 0 || expert >= experts_) return;
      slot = &expert_[(size_t(layer) * experts_ + expert) * 2 +
                      (site == LinearSite::kExpertDown ? 1 : 0)];
      break;
    default:
      if (layer < 0 || layer >= layers_) return;
      slot = &dense_[size_t(layer) * kDenseSites + int(site)];
      if (site == LinearSite::kQkv) (encoder ? encoder_rows_ : decoder_rows_) += rows;
      break;
  }
  *slot = std::max(*slot, amax);
}

int ActivationAmaxObserver::experts_without_rows() const {
  int n = 0;
  for (size_t i = 0; i < expert_.size(); i += 2) n += expert_[i] < 0.0f;
  return n;
}

std::map<std::string, float> ActivationAmaxObserver::ModuleAmax() const {
  std::map<std::string, float> out;
  auto put = [&out](const std::string& name, float amax) {
    if (amax >= 0.0f) out[name] = amax;
  };
  for (int l = 0; l < layers_; ++l) {
    const std::string p = absl::StrCat("model.decoder.layers.", l, ".");
    const float* d = &dense_[size_t(l) * kDenseSites];
    for (const char* m : {"q_proj", "k_proj", "v_proj"}) put(p + "self_attn." + m, d[0]);
    put(p + "self_attn.o_proj", d[1]);
    put(p + "mlp.gate_proj", d[2]);
    put(p + "mlp.up_proj", d[2]);
    put(p + "mlp.down_proj", d[3]);
    put(p + "router.proj", d[4]);
    // An expert without rows: its layer's largest expert amax, per projection.
    float layer_max[2] = {-1.0f, -1.0f};
    for (int e = 0; e < experts_; ++e) {
      for (int j = 0; j < 2; ++j) {
        layer_max[j] = std::max(layer_max[j], expert_[(size_t(l) * experts_ + e) * 2 + j]);
      }
    }
    for (int e = 0; e < experts_; ++e) {
      const float* x = &expert_[(size_t(l) * experts_ + e) * 2];
      const float gu = x[0] >= 0.0f ? x[0] : layer_max[0];
      const float down = x[1] >= 0.0f ? x[1] : layer_max[1];
      const std::string ep = absl::StrCat(p, "experts.", e, ".");
      put(ep + "gate_proj", gu);
      put(ep + "up_proj", gu);
      put(ep + "down_proj", down);
    }
  }
  put("model.decoder.self_conditioning.gate_proj", sc_[0]);
  put("model.decoder.self_conditioning.up_proj", sc_[0]);
  put("model.decoder.self_conditioning.down_proj", sc_[1]);
  return out;
}

namespace {

// Runs the bf16 `checkpoint` on the CPU backend over `prompts` with `observer` told every
// Linear's input (CalibrateActivationAmax's loop, shared with CalibrateInputHessians; the
// progress line reads the observer's encoder_rows() and decoder_rows()).
template <typename Observer>
absl::Status RunCalibration(const Checkpoint& checkpoint,
                            std::span<const CalibrationPrompt> prompts,
                            const CalibrationOptions& options, Observer& observer,
                            const std::string& label = "calibrate") {
  if (checkpoint.quant.format != WeightFormat::kBf16) {
    return absl::InvalidArgumentError(
        absl::StrCat("calibration runs the bf16 model: ", checkpoint.dir, " is already quantized"));
  }
  if (prompts.empty()) return absl::InvalidArgumentError("calibration: no prompts");
  CpuBackendOptions backend_options;
  backend_options.gemm_input = cpu::GemmInput::kFloat32;
  backend_options.linear_observer = &observer;
  std::unique_ptr<ModelBackend> backend =
      CreateCpuBackend(checkpoint.config, checkpoint.weights, backend_options);
  Generator generator(*backend);
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenerationRequest r = DefaultRequest(checkpoint.generation);
    r.prompt = prompts[i].prompt;
    r.seed = i + 1;
    r.canvas_template = prompts[i].canvas_template;
    r.max_new_tokens =
        options.max_new_tokens > 0 ? options.max_new_tokens : checkpoint.config.canvas_length;
    if (options.max_denoising_steps > 0)
      r.sampler.max_denoising_steps = options.max_denoising_steps;
    if (absl::Status s = generator.Validate(r); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration prompt ", i + 1, ": ", s.message()));
    }
    DGSERVE_ASSIGN_OR_RETURN(GenerationResult res, generator.Generate(r));
    if (options.progress) {
      int steps = 0;
      for (int s : res.steps_per_canvas) steps += s;
      std::fprintf(stderr,
                   "%s: prompt %zu/%zu: %d prompt tokens, %d denoising steps; rows seen "
                   "%lld encoder, %lld decoder (per layer); %.1f s\n",
                   label.c_str(), i + 1, prompts.size(), res.prompt_tokens, steps,
                   static_cast<long long>(observer.encoder_rows() / checkpoint.config.num_layers),
                   static_cast<long long>(observer.decoder_rows() / checkpoint.config.num_layers),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::map<std::string, float>> CalibrateActivationAmax(
    const Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options) {
  ActivationAmaxObserver observer(checkpoint.config);
  DGSERVE_RETURN_IF_ERROR(RunCalibration(checkpoint, prompts, options, observer));
  if (options.progress && observer.experts_without_rows() > 0) {
    std::fprintf(stderr,
                 "calibrate: %d experts saw no row; they take their layer's largest expert amax\n",
                 observer.experts_without_rows());
  }
  return observer.ModuleAmax();
}

// ---------------------------------------------------------------------------------------------
// Input Hessians (GPTQ)

int64_t InputHessianBytes(const ModelConfig& c, int layer) {
  const auto sq = [](int64_t n) { return n * n * int64_t(sizeof(double)); };
  int64_t bytes = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (layer >= 0 && l != layer) continue;
    bytes += sq(c.hidden_size);                        // q/k/v
    bytes += sq(int64_t(c.num_heads) * c.HeadDim(l));  // o_proj
    if (c.intermediate_size > 0) bytes += sq(c.hidden_size) + sq(c.intermediate_size);
    bytes += int64_t(c.num_experts) * (sq(c.hidden_size) + sq(c.moe_intermediate_size));
  }
  return bytes;
}

int64_t LayerGptqBytes(const ModelConfig& c) {
  int64_t most = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    const int64_t widest = std::max<int64_t>({c.hidden_size, int64_t(c.num_heads) * c.HeadDim(l),
                                              c.intermediate_size, c.moe_intermediate_size});
    most = std::max(most, InputHessianBytes(c, l) + 3 * widest * widest * int64_t(sizeof(double)));
  }
  return most;
}

InputHessianObserver::InputHessianObserver(const ModelConfig& config, int layer)
    : config_(config),
      dense_(size_t(config.num_layers) * 4),
      expert_(size_t(config.num_layers) * config.num_experts * 2),
      layer_(layer) {}

void InputHessianObserver::Observe(LinearSite site, int layer, int expert, bool encoder,
                                   const float* x, int rows, int cols) {
  if (rows <= 0 || cols <= 0 || layer < 0 || layer >= config_.num_layers) return;
  if (site == LinearSite::kQkv) (encoder ? encoder_rows_ : decoder_rows_) += rows;
  if (layer_ >= 0 && layer != layer_) return;
  InputHessian* h = nullptr;
  switch (site) {
    case LinearSite::kQkv:
    case LinearSite::kOProj:
    case LinearSite::kMlpGateUp:
    case LinearSite::kMlpDown: h = &dense_[size_t(layer) * 4 + int(site)]; break;
    case LinearSite::kExpertGateUp:
    case LinearSite::kExpertDown:
      if (expert < 0 || expert >= config_.num_experts) return;
      h = &expert_[(size_t(layer) * config_.num_experts + expert) * 2 +
                   (site == LinearSite::kExpertDown ? 1 : 0)];
      break;
    default:  // the router and the self-conditioning MLP: kept in bf16 by default
      return;
  }
  if (h->cols == 0) {
    h->cols = cols;
    h->h.assign(size_t(cols) * cols, 0.0);
  }
  if (h->cols != cols) return;  // (one module, one width)
  h->rows += rows;
  const int n = cols;
  // Σ x·xᵀ, the lower triangle (mirrored in ModuleHessians), one output row per thread.
#pragma omp parallel for schedule(dynamic, 16) if (int64_t(rows) * n * n >= (1 << 22))
  for (int i = 0; i < n; ++i) {
    double* hi = h->h.data() + size_t(i) * n;
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + size_t(r) * n;
      const double xi = xr[i];
      if (xi == 0.0) continue;
      for (int j = 0; j <= i; ++j) hi[j] += xi * double(xr[j]);
    }
  }
}

int InputHessianObserver::experts_without_rows() const {
  int n = 0;
  for (size_t i = 0; i < expert_.size(); i += 2) {
    const int layer = int(i / 2) / std::max(1, config_.num_experts);
    if (layer_ < 0 || layer == layer_) n += expert_[i].rows == 0;
  }
  return n;
}

std::map<std::string, std::shared_ptr<const InputHessian>>
InputHessianObserver::ModuleHessians() && {
  std::map<std::string, std::shared_ptr<const InputHessian>> out;
  auto full = [](InputHessian& lower) {
    auto h = std::make_shared<InputHessian>(std::move(lower));
    const int n = h->cols;
    for (int i = 0; i < n; ++i) {
      for (int j = i + 1; j < n; ++j) h->h[size_t(i) * n + j] = h->h[size_t(j) * n + i];
    }
    return std::shared_ptr<const InputHessian>(std::move(h));
  };
  auto put = [&](std::initializer_list<std::string> names, InputHessian& h) {
    if (h.rows == 0) return;
    std::shared_ptr<const InputHessian> shared = full(h);
    for (const std::string& name : names) out[name] = shared;
  };
  for (int l = 0; l < config_.num_layers; ++l) {
    const std::string p = absl::StrCat("model.decoder.layers.", l, ".");
    InputHessian* d = &dense_[size_t(l) * 4];
    put({p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"}, d[0]);
    put({p + "self_attn.o_proj"}, d[1]);
    put({p + "mlp.gate_proj", p + "mlp.up_proj"}, d[2]);
    put({p + "mlp.down_proj"}, d[3]);
    for (int e = 0; e < config_.num_experts; ++e) {
      InputHessian* x = &expert_[(size_t(l) * config_.num_experts + e) * 2];
      const std::string ep = absl::StrCat(p, "experts.", e, ".");
      put({ep + "gate_proj", ep + "up_proj"}, x[0]);
      put({ep + "down_proj"}, x[1]);
    }
  }
  return out;
}

absl::StatusOr<std::map<std::string, std::shared_ptr<const InputHessian>>> CalibrateInputHessians(
    const Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options, int64_t max_bytes) {
  const int64_t bytes = InputHessianBytes(checkpoint.config);
  if (max_bytes > 0 && bytes > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "GPTQ: the input Hessians of every quantized module of ", checkpoint.dir, " take ", bytes,
        " bytes (float64, one per module input), more than the limit of ", max_bytes,
        " bytes (GPTQ layer by layer holds one layer's at a time)"));
  }
  InputHessianObserver observer(checkpoint.config);
  DGSERVE_RETURN_IF_ERROR(RunCalibration(checkpoint, prompts, options, observer));
  if (options.progress && observer.experts_without_rows() > 0) {
    std::fprintf(stderr,
                 "calibrate: %d experts saw no row; they are rounded to nearest (no Hessian)\n",
                 observer.experts_without_rows());
  }
  return std::move(observer).ModuleHessians();
}

namespace {

// The modules of one layer that share one input Hessian: each weight matrix of the backend
// (`seat`) with the checkpoint modules its rows hold, in order (an expert's fused gate_up: gate,
// then up).
struct HessianModules {
  std::string hessian;  // the module name ModuleHessians files the Hessian under
  struct Seat {
    cpu::PackedMatrix* matrix;
    std::vector<std::string> modules;  // equal row counts, concatenated
  };
  std::vector<Seat> seats;
};

std::vector<HessianModules> LayerModules(const ModelConfig& c, int layer, LayerWeights& w) {
  const std::string p = absl::StrCat("model.decoder.layers.", layer, ".");
  std::vector<HessianModules> out = {
      {p + "self_attn.q_proj",
       {{&w.q_proj, {p + "self_attn.q_proj"}},
        {&w.k_proj, {p + "self_attn.k_proj"}},
        {&w.v_proj, {p + "self_attn.v_proj"}}}},
      {p + "self_attn.o_proj", {{&w.o_proj, {p + "self_attn.o_proj"}}}},
      {p + "mlp.gate_proj",
       {{&w.mlp_gate_proj, {p + "mlp.gate_proj"}}, {&w.mlp_up_proj, {p + "mlp.up_proj"}}}},
      {p + "mlp.down_proj", {{&w.mlp_down_proj, {p + "mlp.down_proj"}}}},
  };
  for (int e = 0; e < c.num_experts && e < int(w.experts_gate_up_proj.size()); ++e) {
    const std::string ep = absl::StrCat(p, "experts.", e, ".");
    out.push_back(
        {ep + "gate_proj", {{&w.experts_gate_up_proj[e], {ep + "gate_proj", ep + "up_proj"}}}});
    out.push_back({ep + "down_proj", {{&w.experts_down_proj[e], {ep + "down_proj"}}}});
  }
  return out;
}

}  // namespace

absl::StatusOr<std::map<std::string, std::shared_ptr<const W4a16Packed>>> QuantizeW4a16GptqByLayer(
    Checkpoint& checkpoint, std::span<const CalibrationPrompt> prompts,
    const CalibrationOptions& options, const LayerGptqOptions& gptq) {
  const ModelConfig& c = checkpoint.config;
  if (gptq.group_size < 0 || gptq.group_size > kMaxW4a16GroupSize) {
    return absl::InvalidArgumentError(absl::StrCat("--group_size must be in [0, ",
                                                   kMaxW4a16GroupSize, "] (0: per channel); got ",
                                                   gptq.group_size));
  }
  DGSERVE_RETURN_IF_ERROR(CheckModulePatterns(gptq.ignore, "the ignore list's"));
  if (!(gptq.dampening >= 0.0 && gptq.dampening <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the GPTQ dampening ", gptq.dampening, " must be a number in [0, 1e6]"));
  }
  const int64_t bytes = LayerGptqBytes(c);
  if (gptq.max_bytes > 0 && bytes > gptq.max_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("GPTQ layer by layer: one layer's input Hessians of ", checkpoint.dir,
                     " and a factor take ", bytes, " bytes (float64), more than the limit of ",
                     gptq.max_bytes, " bytes"));
  }
  QuantizationConfig q;
  q.format = WeightFormat::kW4A16;
  q.targets = {"Linear"};
  q.ignore = gptq.ignore;
  // A split gate/up from the module names alone, before L calibration runs (QuantizeCheckpoint
  // would refuse the result only after them).
  for (int l = 0; l < c.num_layers; ++l) {
    for (HessianModules& set : LayerModules(c, l, checkpoint.weights.layers[l])) {
      for (const HessianModules::Seat& seat : set.seats) {
        if (seat.modules.size() == 2 &&
            q.Quantizes(seat.modules[0]) != q.Quantizes(seat.modules[1])) {
          return absl::InvalidArgumentError(absl::StrCat(
              "the ignore list quantizes one of ", seat.modules[0], " and ", seat.modules[1],
              " only: an expert's gate and up are one matrix, both quantized or both kept"));
        }
      }
    }
  }
  std::map<std::string, std::shared_ptr<const W4a16Packed>> out;
  const auto start = std::chrono::steady_clock::now();
  for (int l = 0; l < c.num_layers; ++l) {
    InputHessianObserver observer(c, l);
    if (absl::Status s = RunCalibration(checkpoint, prompts, options, observer,
                                        absl::StrCat("gptq: layer ", l + 1, "/", c.num_layers));
        !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("GPTQ layer ", l + 1, "/", c.num_layers,
                                                 ": calibration: ", s.message()));
    }
    std::map<std::string, std::shared_ptr<const InputHessian>> hessians =
        std::move(observer).ModuleHessians();
    int by_gptq = 0, by_rtn = 0;
    for (HessianModules& set : LayerModules(c, l, checkpoint.weights.layers[l])) {
      std::shared_ptr<const InputHessian> hessian;
      if (const auto it = hessians.find(set.hessian); it != hessians.end()) hessian = it->second;
      std::optional<GptqFactor> factor;  // made at the first quantized seat
      for (HessianModules::Seat& seat : set.seats) {
        cpu::PackedMatrix& m = *seat.matrix;
        // (A seat's modules are all quantized or none: a split gate/up was refused above.)
        if (m.empty() || !q.Quantizes(seat.modules[0])) continue;
        const int rows = m.rows(), cols = m.cols();
        const int group = gptq.group_size > 0 ? gptq.group_size : cols;
        if (hessian != nullptr && !factor) {
          if (hessian->cols != cols) {
            return absl::InternalError(absl::StrCat(seat.modules[0], ": a Hessian of ",
                                                    hessian->cols, " inputs for ", cols));
          }
          absl::StatusOr<GptqFactor> f = FactorGptqHessian(*hessian, gptq.dampening);
          if (!f.ok()) {
            return absl::Status(f.status().code(),
                                absl::StrCat(seat.modules[0], ": ", f.status().message()));
          }
          factor = *std::move(f);
        }
        const std::vector<uint16_t> bits = m.UnpackBf16();
        std::vector<float> w(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) w[i] = Bf16ToFloat(bits[i]);
        W4a16Weights codes;
        if (factor) {
          absl::StatusOr<W4a16Weights> g = QuantizeW4a16Gptq(w, rows, cols, group, *factor);
          if (!g.ok()) {
            return absl::Status(g.status().code(),
                                absl::StrCat(seat.modules[0], ": ", g.status().message()));
          }
          codes = *std::move(g);
        } else {
          codes = QuantizeW4a16Rtn(w, rows, cols, group);
        }
        const int each = rows / int(seat.modules.size());
        for (size_t i = 0; i < seat.modules.size(); ++i) {
          auto packed =
              std::make_shared<W4a16Packed>(PackW4a16(codes, cols, group, int(i) * each, each));
          packed->gptq = factor.has_value();
          out[seat.modules[i]] = std::move(packed);
          ++(factor ? by_gptq : by_rtn);
        }
        std::vector<float> scales(codes.scales.size());
        for (size_t i = 0; i < scales.size(); ++i) scales[i] = Bf16ToFloat(codes.scales[i]);
        m = cpu::PackedMatrix::Quantized(
            cpu::QuantMatrix::FromInt4(codes.codes.data(), scales.data(), rows, cols, group));
      }
    }
    hessians.clear();  // this layer's Hessians: freed before the next layer's are recorded
    if (options.progress) {
      std::fprintf(stderr,
                   "gptq: layer %d/%d quantized: %d modules by GPTQ, %d rounded to "
                   "nearest (no Hessian); %.1f s\n",
                   l + 1, c.num_layers, by_gptq, by_rtn,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  return out;
}

absl::StatusOr<std::vector<CalibrationPrompt>> ReadCalibrationPrompts(const std::string& path,
                                                                      const Tokenizer& tokenizer,
                                                                      int max_prompt_tokens,
                                                                      int limit) {
  std::vector<CalibrationPrompt> out;
  auto add_prompt = [&](const nlohmann::json& j, int) -> absl::Status {
    if (j.is_discarded() || !j.is_object() || !j.contains("prompt") || !j["prompt"].is_string()) {
      return absl::InvalidArgumentError(
          "expected a JSON object with a string \"prompt\" (JSONL, one per line)");
    }
    const std::string& prompt = j["prompt"].get_ref<const std::string&>();
    if (prompt.empty()) return absl::InvalidArgumentError("empty \"prompt\"");
    std::vector<int32_t> ids = tokenizer.EncodeText(prompt, /*add_bos=*/true);
    if (max_prompt_tokens > 0 && int64_t(ids.size()) > max_prompt_tokens) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt of ", ids.size(), " tokens: the model's context leaves ",
                       max_prompt_tokens, " for a prompt beside the canvas it denoises"));
    }
    out.push_back({std::move(ids), nullptr});
    return absl::OkStatus();
  };
  DGSERVE_RETURN_IF_ERROR(ForEachJsonLine(path, std::max(0, limit), add_prompt));
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no calibration prompt"));
  }
  return out;
}

}  // namespace dgserve
