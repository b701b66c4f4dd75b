// Quantizing a bf16 checkpoint into a compressed-tensors one (issue 37): the body of
// dgserve-quantize (tools/quantize_main.cc). See quantize_checkpoint.h.
#include "engine/model/quantize_checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/bf16.h"
#include "common/fp8.h"
#include "common/status_macros.h"
#include "engine/model/config.h"
#include "engine/model/gptq.h"
#include "engine/model/safetensors.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Progress {
  int64_t total_bytes = 0, done_bytes = 0;
  int tensors = 0, done = 0;
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double last = -1.0;
  bool print = true;
  void Step(int64_t bytes) {
    done_bytes += bytes;
    ++done;
    const double t =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!print || (done < tensors && t - last < 2.0)) return;
    last = t;
    std::fprintf(stderr, "%squantize: %d/%d tensors, %.2f/%.2f GB read, %.1f s%s",
                 isatty(2) ? "\r" : "", done, tensors, done_bytes / 1e9, total_bytes / 1e9, t,
                 isatty(2) && done < tensors ? "" : "\n");
  }
};

// The source rows of one module: `view` rows [row0, row0 + rows) of an [.., cols] tensor, or an
// expert's slice of a fused 3-D tensor.
struct Rows {
  const TensorView* view = nullptr;
  int64_t row0 = 0;
  int rows = 0, cols = 0;
};

absl::Status ReadRows(const Rows& r, std::vector<float>* out) {
  // ToFloat32 on a sub-view of the mapping.
  TensorView sub = *r.view;
  const size_t es = DTypeSize(sub.dtype);
  sub.data = r.view->data + size_t(r.row0) * r.cols * es;
  sub.shape = {r.rows, r.cols};
  sub.nbytes = size_t(r.rows) * r.cols * es;
  out->resize(size_t(r.rows) * r.cols);
  DGSERVE_RETURN_IF_ERROR(ToFloat32(sub, out->data()));
  for (size_t i = 0; i < out->size(); ++i) {
    if (!std::isfinite((*out)[i])) {
      return absl::InvalidArgumentError(absl::StrCat(r.view->file, ": tensor '", r.view->name,
                                                     "' holds a non-finite value"));
    }
  }
  return absl::OkStatus();
}

void AddFp8(const std::string& module, const Rows& r, Progress* progress,
            std::vector<TensorSource>* out) {
  // Scales and codes are computed once, by whichever fill runs first (name order: weight
  // first), and kept until both are written.
  auto codes = std::make_shared<std::vector<uint8_t>>();
  auto scales = std::make_shared<std::vector<float>>();
  auto left = std::make_shared<int>(2);  // fills still to run; the buffers go with the last
  auto compute = [r, codes, scales, progress]() -> absl::Status {
    if (!codes->empty()) return absl::OkStatus();
    std::vector<float> w;
    DGSERVE_RETURN_IF_ERROR(ReadRows(r, &w));
    codes->resize(w.size());
    scales->resize(r.rows);
#pragma omp parallel for schedule(static) if (int64_t(r.rows) * r.cols >= (1 << 18))
    for (int i = 0; i < r.rows; ++i) {
      const float* row = w.data() + size_t(i) * r.cols;
      float absmax = 0.0f;
      for (int c = 0; c < r.cols; ++c) absmax = std::max(absmax, std::fabs(row[c]));
      const float s = absmax > 0.0f ? absmax / kE4m3Max : 1.0f;
      (*scales)[i] = s;
      for (int c = 0; c < r.cols; ++c) (*codes)[size_t(i) * r.cols + c] = FloatToE4m3(row[c] / s);
    }
    progress->Step(int64_t(w.size()) * int64_t(DTypeSize(r.view->dtype)));
    return absl::OkStatus();
  };
  out->push_back({module + ".weight", DType::kF8E4M3, {r.rows, r.cols},
                  [compute, codes, scales, left](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, codes->data(), codes->size());
                    if (--*left == 0) *codes = {}, *scales = {};
                    return absl::OkStatus();
                  }});
  out->push_back({module + ".weight_scale", DType::kF32, {r.rows, 1},
                  [compute, codes, scales, left](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, scales->data(), scales->size() * 4);
                    if (--*left == 0) *codes = {}, *scales = {};
                    return absl::OkStatus();
                  }});
}

// (With `factor`: GPTQ against it, engine/model/gptq.h; with `given`, its codes and scales
// (QuantizeOptions::w4a16_modules: shape and group checked by the caller); else
// round-to-nearest.)
void AddW4a16(const std::string& module, const Rows& r, int group_flag,
              std::shared_ptr<const GptqFactor> factor, std::shared_ptr<const W4a16Packed> given,
              Progress* progress, std::vector<TensorSource>* out) {
  const int group = group_flag > 0 ? group_flag : r.cols;
  const int groups = (r.cols + group - 1) / group, words = (r.cols + 7) / 8;
  auto q = std::make_shared<W4a16Packed>();
  auto left = std::make_shared<int>(2);
  auto compute = [module, r, group, q, factor, given, progress]() -> absl::Status {
    if (!q->packed.empty()) return absl::OkStatus();
    if (given != nullptr) {
      q->packed = given->packed;  // (each tensor's bytes copied from here, then freed)
      q->scales = given->scales;
      progress->Step(int64_t(r.rows) * r.cols * int64_t(DTypeSize(r.view->dtype)));
      return absl::OkStatus();
    }
    std::vector<float> w;
    DGSERVE_RETURN_IF_ERROR(ReadRows(r, &w));
    W4a16Weights codes;
    if (factor != nullptr) {
      absl::StatusOr<W4a16Weights> g = QuantizeW4a16Gptq(w, r.rows, r.cols, group, *factor);
      if (!g.ok()) {
        return absl::Status(g.status().code(), absl::StrCat(module, ": ", g.status().message()));
      }
      codes = std::move(*g);
    } else {
      codes = QuantizeW4a16Rtn(w, r.rows, r.cols, group);
    }
    *q = PackW4a16(codes, r.cols, group, 0, r.rows);
    progress->Step(int64_t(w.size()) * int64_t(DTypeSize(r.view->dtype)));
    return absl::OkStatus();
  };
  out->push_back({module + ".weight_packed",
                  DType::kI32,
                  {r.rows, words},
                  [compute, q, left](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, q->packed.data(), q->packed.size() * 4);
                    if (--*left == 0) *q = {};
                    return absl::OkStatus();
                  }});
  out->push_back({module + ".weight_scale",
                  DType::kBF16,
                  {r.rows, groups},
                  [compute, q, left](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, q->scales.data(), q->scales.size() * 2);
                    if (--*left == 0) *q = {};
                    return absl::OkStatus();
                  }});
  const int64_t shape[2] = {r.rows, r.cols};
  out->push_back({module + ".weight_shape", DType::kI64, {2}, [shape](uint8_t* dst) {
                    std::memcpy(dst, shape, sizeof shape);
                    return absl::OkStatus();
                  }});
}

// NVFP4's data-free static activation scale: ModelOpt calibrates input_scale = amax(x) / (6 · 448)
// on calibration data (QuantizeOptions::input_amax: Nvfp4InputScale); without calibration
// dgserve-quantize writes the value for amax = 448: block scales are normal e4m3 values for block
// absmax in [2⁻⁶, 448] (subnormal below, saturating above; quantize_checkpoint.h).
constexpr float kNvfp4InputScale = 1.0f / 6.0f;

// compressed-tensors' data-free input_global_scale: 448 · 6 / amax(x) for the same amax 448 (a
// divisor: the reciprocal of kNvfp4InputScale).
constexpr float kNvfp4InputGlobalScale = 6.0f;

// The compressed-tensors layout's shared weight amax: the modules of one fused set (q/k/v_proj
// of an attention, gate/up_proj of an MLP or expert), computed once by the first fill that
// needs it. ModelOpt's layout keeps one amax per module (no set).
struct FusedAmax {
  std::vector<Rows> members;
  bool done = false;
  float amax = 0.0f;
};

// The key of a module's fused set: its parent and "{qkv}" / "{gate_up}", else the module.
std::string FusedKey(const std::string& module) {
  const size_t dot = module.rfind('.');
  const std::string parent = module.substr(0, dot + 1), leaf = module.substr(dot + 1);
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj") return parent + "{qkv}";
  if (leaf == "gate_proj" || leaf == "up_proj") return parent + "{gate_up}";
  return module;
}

float AbsMax(const std::vector<float>& w) {
  float amax = 0.0f;
  for (float v : w) amax = std::max(amax, std::fabs(v));
  return amax;
}

// The static activation scale of a module whose inputs had amax(|x|) = `amax` on calibration
// data (< 0: no calibration): ModelOpt's input_scale amax / (6 · 448), compressed-tensors'
// input_global_scale 448 · 6 / amax (`ct`), float32; the data-free value without calibration or
// for amax 0 (an input that was always zero: any scale quantizes it exactly).
float Nvfp4InputScale(float amax, bool ct) {
  if (!(amax > 0.0f)) return ct ? kNvfp4InputGlobalScale : kNvfp4InputScale;
  return ct ? (kE4m3Max * 6.0f) / amax : amax / (6.0f * kE4m3Max);
}

// `fused`: the compressed-tensors layout (its set's amax); null: ModelOpt's. `weight_only`
// (compressed-tensors NVFP4A16): no input_global_scale. `input`: the input scale written
// (Nvfp4InputScale).
void AddNvfp4(const std::string& module, const Rows& r, std::shared_ptr<FusedAmax> fused,
              bool weight_only, float input, Progress* progress, std::vector<TensorSource>* out) {
  const int blocks = r.cols / 16;
  const bool ct = fused != nullptr;
  struct Result {
    std::vector<uint8_t> packed, scales;
    float global = 0.0f;  // ModelOpt: weight_scale_2; compressed-tensors: weight_global_scale
    int left = 3;         // fills still to run; the buffers go with the last
  };
  auto res = std::make_shared<Result>();
  auto compute = [r, blocks, res, fused, ct, progress]() -> absl::Status {
    if (!res->packed.empty()) return absl::OkStatus();
    std::vector<float> w;
    if (fused != nullptr && !fused->done) {
      for (const Rows& m : fused->members) {
        DGSERVE_RETURN_IF_ERROR(ReadRows(m, &w));
        fused->amax = std::max(fused->amax, AbsMax(w));
      }
      fused->done = true;
    }
    DGSERVE_RETURN_IF_ERROR(ReadRows(r, &w));
    if (fused == nullptr) {
      // ModelOpt's NVFP4QTensor (nvfp4_tensor.py): weights_scaling_factor_2 = amax / (6 · 448);
      // an all-zero module (amax 0) takes 1 (its codes are all 0).
      const float amax = AbsMax(w);
      res->global = amax > 0.0f ? amax / (6.0f * kE4m3Max) : 1.0f;
    } else {
      // compressed-tensors' generate_gparam: global_scale = 448 · 6 / amax (a divisor); an
      // all-zero set takes 1 (theirs would be inf).
      res->global = fused->amax > 0.0f ? (kE4m3Max * 6.0f) / fused->amax : 1.0f;
    }
    const float g = res->global;
    const uint8_t eighth = FloatToE4m3(0.125f);
    res->packed.assign(w.size() / 2, 0);
    res->scales.resize(size_t(r.rows) * blocks);
#pragma omp parallel for schedule(static) if (int64_t(r.rows) * r.cols >= (1 << 18))
    for (int i = 0; i < r.rows; ++i) {
      const float* row = w.data() + size_t(i) * r.cols;
      for (int b = 0; b < blocks; ++b) {
        float bmax = 0.0f;
        for (int c = 16 * b; c < 16 * b + 16; ++c) bmax = std::max(bmax, std::fabs(row[c]));
        uint8_t code;
        float d;  // the block's step: w / d is cast to e2m1
        if (ct) {
          // calculate_qparams (tensor_group, FP4): scales = global_scale · (amax_b / 6),
          // clamped to ≤ 448, cast to e4m3 (RNE); a zero e4m3 scale becomes 0.125.
          // _quantize: scale.to(float32) / global_scale divides w.
          code = FloatToE4m3(std::min(kE4m3Max, g * (bmax / 6.0f)));
          if (E4m3ToFloat(code) == 0.0f) code = eighth;
          d = E4m3ToFloat(code) / g;
        } else {
          // per_block_scale = amax_b / (6 · g); 0 → 1; clamped to [2⁻⁹, 448]; e4m3 (RNE).
          float s = bmax / (6.0f * g);
          if (s == 0.0f) s = 1.0f;
          s = std::min(kE4m3Max, std::max(0x1p-9f, s));
          code = FloatToE4m3(s);
          d = E4m3ToFloat(code) * g;
        }
        res->scales[size_t(i) * blocks + b] = code;
        // scaled = w / d, cast to e2m1 (RNE, saturating at 6: ModelOpt's _cast_fp4,
        // compressed-tensors' clamp to ±6 then cast_to_fp4).
        for (int c = 16 * b; c < 16 * b + 16; ++c) {
          const uint8_t e = FloatToE2m1(row[c] / d);
          uint8_t& byte = res->packed[(size_t(i) * r.cols + c) / 2];
          byte |= (c % 2 == 0) ? e : uint8_t(e << 4);  // element 2i low nibble, 2i + 1 high
        }
      }
    }
    progress->Step(int64_t(w.size()) * int64_t(DTypeSize(r.view->dtype)));
    return absl::OkStatus();
  };
  auto done = [res]() {
    if (--res->left == 0) res->packed = {}, res->scales = {};
  };
  out->push_back({module + (ct ? ".weight_packed" : ".weight"),
                  DType::kU8,
                  {r.rows, r.cols / 2},
                  [compute, res, done](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, res->packed.data(), res->packed.size());
                    done();
                    return absl::OkStatus();
                  }});
  out->push_back({module + ".weight_scale",
                  DType::kF8E4M3,
                  {r.rows, blocks},
                  [compute, res, done](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, res->scales.data(), res->scales.size());
                    done();
                    return absl::OkStatus();
                  }});
  // compressed-tensors writes its scalars as [1], ModelOpt's as [].
  const std::vector<int64_t> scalar = ct ? std::vector<int64_t>{1} : std::vector<int64_t>{};
  out->push_back({module + (ct ? ".weight_global_scale" : ".weight_scale_2"), DType::kF32, scalar,
                  [compute, res, done](uint8_t* dst) -> absl::Status {
                    DGSERVE_RETURN_IF_ERROR(compute());
                    std::memcpy(dst, &res->global, 4);
                    done();
                    return absl::OkStatus();
                  }});
  if (weight_only) return;  // NVFP4A16: activations unquantized, no activation scale
  out->push_back({module + (ct ? ".input_global_scale" : ".input_scale"), DType::kF32, scalar,
                  [input](uint8_t* dst) {
                    std::memcpy(dst, &input, 4);
                    return absl::OkStatus();
                  }});
}

// An unquantized copy of rows r (an ignored expert module): the source dtype, bytes as they are.
void AddCopy(const std::string& name, const Rows& r, std::vector<TensorSource>* out) {
  const size_t es = DTypeSize(r.view->dtype);
  const uint8_t* src = r.view->data + size_t(r.row0) * r.cols * es;
  const size_t n = size_t(r.rows) * r.cols * es;
  out->push_back({name, r.view->dtype, {r.rows, r.cols}, [src, n](uint8_t* dst) {
                    std::memcpy(dst, src, n);
                    return absl::OkStatus();
                  }});
}

// Writes `text` to `path` (replacing it). INTERNAL naming the path when it cannot.
absl::Status WriteTextFile(const std::string& path, const std::string& text) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", path));
  const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (std::fclose(f) != 0 || !ok) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// The model card (README.md, the Hugging Face card) of the checkpoint quantized from `in` as
// `q` with `options`: --in's `card` with a note naming the format (and GPTQ or calibrated
// activation scales, which config.json does not say) and the source placed first (after the
// card's YAML front matter, "---" lines, which must stay first), so the copy does not pass for
// the source's card.
std::string QuantizedModelCard(const std::string& card, const std::string& in,
                               const QuantizationConfig& q, const QuantizeOptions& options) {
  std::string format = QuantizationName(q);
  if (q.format == WeightFormat::kW4A16) {
    format += q.channel_groups ? " (per channel)" : absl::StrCat(" (group ", q.group_size, ")");
  } else if (q.format == WeightFormat::kNvfp4) {
    format += q.nvfp4_compressed_tensors ? " (compressed-tensors layout)" : " (ModelOpt layout)";
  }
  const bool by_layer = std::any_of(options.w4a16_modules.begin(), options.w4a16_modules.end(),
                                    [](const auto& m) { return m.second->gptq; });
  if (!options.gptq_hessians.empty()) {
    format += ", rounded by GPTQ against calibrated input Hessians";
  } else if (by_layer) {
    format += ", rounded by GPTQ layer by layer against calibrated input Hessians";
  } else if (!options.input_amax.empty()) {
    format += ", activation scales calibrated";
  }
  const fs::path dir = fs::path(in).lexically_normal();
  const std::string source = (dir.has_filename() ? dir : dir.parent_path()).filename().string();
  const std::string note = absl::StrCat(
      "> **Quantized checkpoint: ", format, "**, written by dgserve-quantize from the checkpoint `",
      source,
      "` (config.json's quantization_config lists what is quantized). The card below is that "
      "checkpoint's, copied unchanged: its sizes, dtypes and measured results describe the "
      "source weights, not these.\n\n");
  size_t body = 0;  // where the note goes: after the front matter, if any
  if (absl::StartsWith(card, "---\n")) {
    const size_t end = card.find("\n---\n", 3);
    if (end != std::string::npos) body = end + 5;
  }
  return absl::StrCat(card.substr(0, body), body > 0 ? "\n" : "", note, card.substr(body));
}

}  // namespace

absl::StatusOr<QuantizeSummary> QuantizeCheckpoint(const std::string& in, const std::string& out,
                                                   const QuantizeOptions& options) {
  DGSERVE_RETURN_IF_ERROR(CheckQuantizePaths(in, out));
  // Every option checked before anything is written to `out`.
  if (options.max_shard_bytes <= 0) {
    return absl::InvalidArgumentError("--max_shard_bytes must be positive");
  }
  std::error_code ec;
  QuantizationConfig q;
  q.format = options.format;
  const bool ct_nvfp4 = options.nvfp4_layout == Nvfp4Layout::kCompressedTensors;
  if (ct_nvfp4 && q.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("the NVFP4 layout compressed-tensors applies to --format nvfp4 only, not ",
                     WeightFormatName(q.format)));
  }
  q.nvfp4_compressed_tensors = ct_nvfp4;
  const bool weight_only = options.nvfp4_activations == Nvfp4Activations::kNone;
  if (weight_only && q.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("weight-only NVFP4 (activations none) applies to --format nvfp4 only, not ",
                     WeightFormatName(q.format)));
  }
  if (weight_only && !ct_nvfp4) {
    return absl::InvalidArgumentError(
        "weight-only NVFP4 (activations none) is written in the compressed-tensors layout only "
        "(llm-compressor's NVFP4A16 preset): use --nvfp4_layout compressed-tensors (ModelOpt's "
        "weight-only NVFP4 export is not supported)");
  }
  q.nvfp4_weight_only = weight_only;
  const bool calibrated = !options.input_amax.empty();
  if (calibrated && (q.format != WeightFormat::kNvfp4 || weight_only)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "activation calibration sets NVFP4's static activation scale (W4A4); ",
        q.format != WeightFormat::kNvfp4 ? WeightFormatName(q.format) : "nvfp4a16 (weight-only)",
        " has none (fp8 quantizes activations per token at run time, w4a16 and nvfp4a16 keep them "
        "unquantized)"));
  }
  for (const auto& [module, amax] : options.input_amax) {
    if (!(amax >= 0.0f) || !std::isfinite(amax)) {
      return absl::InvalidArgumentError(
          absl::StrCat("calibration amax of ", module, " is ", amax, ": must be finite and ≥ 0"));
    }
  }
  if (!options.gptq_hessians.empty() && q.format != WeightFormat::kW4A16) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPTQ (a calibrated Hessian per module) is for --format w4a16, not ",
                     WeightFormatName(q.format)));
  }
  if (!options.gptq_hessians.empty() &&
      !(options.gptq_dampening >= 0.0 && options.gptq_dampening <= 1e6)) {
    return absl::InvalidArgumentError(absl::StrCat("the GPTQ dampening ", options.gptq_dampening,
                                                   " must be a number in [0, 1e6]"));
  }
  if (!options.w4a16_modules.empty() && q.format != WeightFormat::kW4A16) {
    return absl::InvalidArgumentError(
        absl::StrCat("given W4A16 modules (layer-by-layer GPTQ) are for --format w4a16, not ",
                     WeightFormatName(q.format)));
  }
  if (!options.w4a16_modules.empty() && !options.gptq_hessians.empty()) {
    return absl::InvalidArgumentError(
        "GPTQ takes either the calibrated Hessians or the modules quantized layer by layer, not "
        "both");
  }
  for (const auto& [module, given] : options.w4a16_modules) {
    if (given == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("no W4A16 weights given for ", module));
    }
  }
  for (const auto& [module, hessian] : options.gptq_hessians) {
    if (hessian == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("GPTQ: no Hessian for ", module));
    }
  }
  if (q.format == WeightFormat::kW4A16) {
    if (options.group_size < 0 || options.group_size > kMaxW4a16GroupSize) {
      return absl::InvalidArgumentError(absl::StrCat("--group_size must be in [0, ",
                                                     kMaxW4a16GroupSize, "] (0: per channel); got ",
                                                     options.group_size));
    }
    q.group_size = options.group_size;
    q.channel_groups = options.group_size == 0;
  } else if (q.format == WeightFormat::kNvfp4) {
    if (options.group_size != 16 && options.group_size != QuantizeOptions().group_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("--group_size ", options.group_size,
                       ": NVFP4 blocks are 16 inputs (fixed by the format)"));
    }
  } else if (q.format != WeightFormat::kFp8) {
    return absl::InvalidArgumentError("the format must be fp8, w4a16 or nvfp4");
  }
  q.targets = {"Linear"};
  // (ModelOpt: fnmatch patterns; the round trip below reads them back as such, as
  // CheckIgnoreList matches them.)
  DGSERVE_ASSIGN_OR_RETURN(q.ignore, WrittenIgnoreList(options));
  {  // Each entry once, in the order first given (two ModelOpt entries may write one pattern).
    std::set<std::string> seen;
    std::vector<std::string> once;
    for (std::string& e : q.ignore) {
      if (seen.insert(e).second) once.push_back(std::move(e));
    }
    q.ignore = std::move(once);
  }
  // Round-trip the config through the parser: the loader reads exactly what is written.
  const std::string config_path = (fs::path(in) / "config.json").string();
  DGSERVE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
  DGSERVE_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path));
  json root = json::parse(text, nullptr, false);
  if (root.contains("quantization_config")) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, " already has a quantization_config: quantize a bf16 checkpoint"));
  }
  root["quantization_config"] = json::parse(QuantizationConfigJson(q));
  DGSERVE_ASSIGN_OR_RETURN(QuantizationConfig check,
                           ParseQuantizationConfig(root.dump(), "the written config.json"));
  q = check;
  if (q.format == WeightFormat::kW4A16 && !q.channel_groups && q.group_size == 0) {
    return absl::InternalError("group size lost");
  }
  // NVFP4 needs in % 16 == 0: other modules stay in their dtype and are named in
  // exclude_modules (experts by one pattern per tensor).
  std::vector<std::string> not_divisible;

  DGSERVE_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::OpenDir(in));
  // (As dgserve-quantize does before calibrating: from the headers, before anything is read.)
  DGSERVE_RETURN_IF_ERROR(CheckIgnoreList(config, reader.tensors(), options,
                                          /*layer_by_layer=*/!options.w4a16_modules.empty()));
  // Linear modules: the 2-D linear weights of the tensor list (not the embedding).
  std::set<std::string> linear;
  for (const TensorSpec& s : ExpectedTensors(config)) {
    if (s.shape.size() == 2 && absl::EndsWith(s.name, ".weight") &&
        (s.family == InitFamily::kLinear || s.family == InitFamily::kRouter)) {
      linear.insert(s.name);
    }
  }
  auto progress = std::make_shared<Progress>();
  progress->print = options.progress;
  std::vector<TensorSource> tensors;
  int quantized = 0, kept = 0;
  int gptq = 0, rtn_without_hessian = 0;                    // w4a16 with Hessians: modules each way
  std::map<std::string, std::shared_ptr<FusedAmax>> fused;  // compressed-tensors NVFP4's sets
  absl::Status missing_amax;  // a quantized module the calibration did not see
  // GPTQ: each Hessian a quantized module reads factored once, when its first module is listed
  // (the modules that share it share the factor: q/k/v, gate/up, an encoder alias and its
  // decoder module), and the first refusal returned before anything is written.
  std::map<const InputHessian*, std::shared_ptr<const GptqFactor>> factors;
  absl::Status gptq_refused;
  std::set<std::string> used_given;  // QuantizeOptions::w4a16_modules written
  auto module_rows = [&](const std::string& module, const Rows& r) {
    if (q.format == WeightFormat::kNvfp4 && r.cols % 16 != 0 && q.Quantizes(module)) {
      q.ignore.push_back(module);
      not_divisible.push_back(module);
    }
    if (q.Quantizes(module)) {
      ++quantized;
      ++progress->tensors;
      progress->total_bytes += int64_t(r.rows) * r.cols * int64_t(DTypeSize(r.view->dtype));
      if (q.format == WeightFormat::kFp8) {
        AddFp8(module, r, progress.get(), &tensors);
      } else if (q.format == WeightFormat::kNvfp4) {
        std::shared_ptr<FusedAmax> set;
        if (ct_nvfp4) {
          std::shared_ptr<FusedAmax>& f = fused[FusedKey(module)];
          if (f == nullptr) f = std::make_shared<FusedAmax>();
          f->members.push_back(r);
          set = f;
        }
        float amax = -1.0f;  // no calibration
        if (calibrated) {
          const auto it = options.input_amax.find(QuantizeDecoderModuleName(module));
          if (it != options.input_amax.end()) {
            amax = it->second;
          } else if (missing_amax.ok()) {
            missing_amax = absl::InvalidArgumentError(
                absl::StrCat("activation calibration: no amax for the quantized module ", module,
                             " (its input was never observed",
                             absl::StrContains(module, "self_conditioning.")
                                 ? ": the self-conditioning MLP runs from a canvas's second "
                                   "denoising step on, and no calibration canvas took a second "
                                   "step (one that is done at once, a puzzle without holes, "
                                   "takes none). Keep it in bf16 (re:.*self_conditioning.* in "
                                   "the ignore list), or calibrate on prompts whose canvases "
                                   "take more steps)"
                                 : ")"));
          }
        }
        AddNvfp4(module, r, set, weight_only, Nvfp4InputScale(amax, ct_nvfp4), progress.get(),
                 &tensors);
      } else {
        std::shared_ptr<const GptqFactor> factor;  // none: round-to-nearest
        std::shared_ptr<const W4a16Packed> given;
        const int group = q.channel_groups ? r.cols : q.group_size;
        if (!options.w4a16_modules.empty()) {
          const std::string decoder = QuantizeDecoderModuleName(module);
          const auto it = options.w4a16_modules.find(decoder);
          if (it != options.w4a16_modules.end()) {
            given = it->second;
            used_given.insert(decoder);
            const int64_t words = (int64_t(r.cols) + 7) / 8;
            const int64_t groups = (int64_t(r.cols) + group - 1) / group;
            if ((given->rows != r.rows || given->cols != r.cols || given->group != group ||
                 int64_t(given->packed.size()) != r.rows * words ||
                 int64_t(given->scales.size()) != r.rows * groups) &&
                gptq_refused.ok()) {
              gptq_refused = absl::InvalidArgumentError(
                  absl::StrCat(module, ": given W4A16 weights of ", given->rows, "×", given->cols,
                               " in groups of ", given->group, " (", given->packed.size(),
                               " words, ", given->scales.size(), " scales) for a ", r.rows, "×",
                               r.cols, " module in groups of ", group));
            }
          }
          ++(given != nullptr && given->gptq ? gptq : rtn_without_hessian);
        }
        if (!options.gptq_hessians.empty()) {
          const auto it = options.gptq_hessians.find(QuantizeDecoderModuleName(module));
          if (it != options.gptq_hessians.end() && gptq_refused.ok()) {
            const InputHessian& h = *it->second;
            std::shared_ptr<const GptqFactor>& f = factors[&h];
            absl::Status st;
            if (h.cols != r.cols) {
              st = absl::InvalidArgumentError(
                  absl::StrCat("GPTQ: a Hessian of ", h.cols, " inputs for ", r.cols, " inputs"));
            } else if (f == nullptr) {
              absl::StatusOr<GptqFactor> factored = FactorGptqHessian(h, options.gptq_dampening);
              if (factored.ok()) {
                f = std::make_shared<const GptqFactor>(*std::move(factored));
              } else {
                st = factored.status();
              }
            }
            if (!st.ok()) {
              gptq_refused = absl::Status(st.code(), absl::StrCat(module, ": ", st.message()));
            }
            factor = f;
          }
          ++(factor != nullptr ? gptq : rtn_without_hessian);
        }
        AddW4a16(module, r, group, std::move(factor), std::move(given), progress.get(), &tensors);
      }
    } else {
      ++kept;
      AddCopy(module + ".weight", r, &tensors);
    }
  };
  for (const TensorView& v : reader.tensors()) {
    if (!IsFloatDType(v.dtype) || v.dtype == DType::kF8E4M3) {
      return absl::InvalidArgumentError(absl::StrCat(v.file, ": tensor '", v.name, "' has dtype ",
                                                     DTypeName(v.dtype), ": not a bf16 checkpoint"));
    }
    std::string name = v.name;
    // The encoder alias of a backbone tensor is matched as its decoder name.
    std::string canonical = name;
    if (absl::StartsWith(name, "model.encoder.language_model.")) {
      canonical = absl::StrCat("model.decoder.", name.substr(29));
    }
    const bool gate_up = absl::EndsWith(name, ".experts.gate_up_proj");
    const bool down = absl::EndsWith(name, ".experts.down_proj");
    if ((gate_up || down) && v.shape.size() == 3) {
      const std::string base = name.substr(0, name.rfind('.'));
      const int experts = int(v.shape[0]), rows = int(v.shape[1]), cols = int(v.shape[2]);
      if (q.format == WeightFormat::kNvfp4 && cols % 16 != 0) {
        for (const char* proj : gate_up ? std::vector<const char*>{"gate_proj", "up_proj"}
                                        : std::vector<const char*>{"down_proj"}) {
          // ModelOpt: an fnmatch pattern; compressed-tensors: a regular expression.
          const std::string pattern =
              ct_nvfp4 ? absl::StrCat("re:", absl::StrReplaceAll(base, {{".", "\\."}}),
                                      "\\.[0-9]+\\.", proj, "$")
                       : absl::StrCat(base, ".*.", proj);
          q.ignore.push_back(pattern);
          not_divisible.push_back(pattern);
        }
      }
      for (int e = 0; e < experts; ++e) {
        const std::string prefix = absl::StrCat(base, ".", e, ".");
        // (An expert's gate and up are both quantized or both kept: CheckIgnoreList.)
        if (gate_up) {
          module_rows(prefix + "gate_proj", {&v, int64_t(e) * rows, rows / 2, cols});
          module_rows(prefix + "up_proj", {&v, int64_t(e) * rows + rows / 2, rows / 2, cols});
        } else {
          module_rows(prefix + "down_proj", {&v, int64_t(e) * rows, rows, cols});
        }
      }
      continue;
    }
    if (linear.count(canonical) != 0 && v.shape.size() == 2) {
      module_rows(name.substr(0, name.size() - 7), {&v, 0, int(v.shape[0]), int(v.shape[1])});
      continue;
    }
    tensors.push_back(TensorFromBuffer(v.name, v.dtype, v.shape, v.data));
  }
  DGSERVE_RETURN_IF_ERROR(missing_amax);
  DGSERVE_RETURN_IF_ERROR(gptq_refused);
  for (const auto& [module, given] : options.w4a16_modules) {
    if (used_given.count(module) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("given W4A16 weights for ", module,
                       ", which this checkpoint does not have or does not quantize"));
    }
  }
  if (q.format == WeightFormat::kNvfp4) {
    root["quantization_config"] = json::parse(QuantizationConfigJson(q));
    if (!not_divisible.empty() && options.progress) {
      std::fprintf(stderr,
                   "quantize: nvfp4: %zu modules/patterns kept in their dtype (input features not "
                   "a multiple of 16), listed in exclude_modules\n",
                   not_divisible.size());
    }
  }
  fs::create_directories(out, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", out, ": ", ec.message()));
  // Other files (generation config, tokenizer, chat template): copied.
  for (const fs::directory_entry& e : fs::directory_iterator(in, ec)) {
    const std::string f = e.path().filename().string();
    if (!e.is_regular_file() || f == "config.json" || absl::EndsWith(f, ".safetensors") ||
        f == "model.safetensors.index.json" || f == "hf_quant_config.json") {
      continue;
    }
    if (f == "README.md") {  // the model card: a note on what this checkpoint is first
      DGSERVE_ASSIGN_OR_RETURN(const std::string card, ReadFileToString(e.path().string()));
      DGSERVE_RETURN_IF_ERROR(
          WriteTextFile((fs::path(out) / f).string(), QuantizedModelCard(card, in, q, options)));
      continue;
    }
    fs::copy_file(e.path(), fs::path(out) / f, fs::copy_options::overwrite_existing, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot copy ", e.path().string(), ": ", ec.message()));
  }
  SafetensorsWriteOptions write;
  write.max_shard_bytes = options.max_shard_bytes;
  DGSERVE_RETURN_IF_ERROR(WriteSafetensors(out, std::move(tensors), write));
  DGSERVE_RETURN_IF_ERROR(
      WriteTextFile((fs::path(out) / "config.json").string(), root.dump(2) + "\n"));
  if (q.format != WeightFormat::kNvfp4 || ct_nvfp4) {
    // A ModelOpt file left in a reused --out would contradict config.json (vLLM reads it first).
    fs::remove(fs::path(out) / "hf_quant_config.json", ec);
    if (ec)
      return absl::InternalError(
          absl::StrCat("cannot remove a stale hf_quant_config.json in ", out, ": ", ec.message()));
  } else {  // ModelOpt's export writes both
    DGSERVE_RETURN_IF_ERROR(WriteTextFile((fs::path(out) / "hf_quant_config.json").string(),
                                          HfQuantConfigJson(q) + "\n"));
  }
  QuantizeSummary summary;
  summary.quant = q;
  summary.quantized = quantized;
  summary.kept = kept;
  summary.gptq = gptq;
  summary.rtn_without_hessian = rtn_without_hessian;
  // (The module names as the tensors and the Linear modules visited name them, as
  // dgserve-quantize warns before calibrating.)
  DGSERVE_ASSIGN_OR_RETURN(summary.unmatched_ignore,
                           UnmatchedIgnoreEntries(config, reader.tensors(), options));
  summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                  progress->start).count();
  return summary;
}

}  // namespace dgserve
