#include "engine/model/checkpoint.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "common/system_resources.h"
#include "engine/model/quant_loader.h"
#include "engine/model/tensor_names.h"
#include "engine/model/weight_destinations.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;

constexpr char kDecoderPrefix[] = "model.decoder.";
constexpr char kEncoderPrefix[] = "model.encoder.language_model.";
constexpr char kLmHead[] = "lm_head.weight";
constexpr size_t kMaxReportedProblems = 8;


// The encoder-tower alias of a `model.decoder.` name ("" when there is none).
std::string EncoderAlias(const std::string& name) {
  if (!absl::StartsWith(name, kDecoderPrefix)) return "";
  return absl::StrCat(kEncoderPrefix, name.substr(sizeof(kDecoderPrefix) - 1));
}

std::string ShapeProblem(const TensorView& v, const std::vector<int64_t>& expected) {
  return absl::StrCat(v.file, ": tensor '", v.name, "' has shape ", ShapeToString(v.shape),
                      " but the config expects ", ShapeToString(expected));
}

// NaN or infinite weights would only surface as garbage tokens: name the tensor now.
absl::Status NonFiniteError(const TensorView& v, int64_t element) {
  return absl::InvalidArgumentError(absl::StrCat(
      v.file, ": tensor '", v.name, "' holds a non-finite value (element ", element, ")"));
}

// A norm, scale or scalar: float32 (exact for all three dtypes).
absl::Status LoadFloat32(const TensorView& view, const Destination& d) {
  float* data = d.scalar;
  if (data == nullptr) {
    d.vec->resize(static_cast<size_t>(view.numel()));
    data = d.vec->data();
  }
  DGSERVE_RETURN_IF_ERROR(ToFloat32(view, data));
  const int64_t n = view.numel();
  int64_t bad = n;  // the first non-finite element, n if none
#pragma omp parallel for reduction(min : bad) if (n >= (1 << 20))
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(data[i])) bad = std::min(bad, i);
  }
  return bad < n ? NonFiniteError(view, bad) : absl::OkStatus();
}

// Drops the mapped file pages of `view` from this process's resident memory once they are
// copied (they stay in the page cache; a later read faults them in again). Without it a load
// holds the whole checkpoint file and the converted weights at once.
void DropMappedPages(const TensorView& view) {
  if (view.data == nullptr || view.nbytes == 0) return;
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(view.data) & ~(page - 1);
  const uintptr_t end = reinterpret_cast<uintptr_t>(view.data) + view.nbytes;
  madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
}

// A matrix: its bf16 bits (a BF16 tensor's own; F16/F32 rounded to nearest even), checked for
// non-finite values, then packed for the GEMM (per expert for [E, rows, cols] tensors).
absl::Status LoadMatrix(const TensorView& view, const Destination& d) {
  const int64_t n = view.numel();
  std::vector<uint16_t> bits(static_cast<size_t>(n));
  if (view.dtype == DType::kBF16) {
    if (view.nbytes != size_t(n) * 2 || (n > 0 && view.data == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(view.file, ": tensor '", view.name, "' has inconsistent data size"));
    }
    if (n > 0) std::memcpy(bits.data(), view.data, size_t(n) * 2);
  } else {
    DGSERVE_ASSIGN_OR_RETURN(std::vector<float> f, ToFloat32(view));
    for (int64_t i = 0; i < n; ++i) bits[i] = FloatToBf16(f[i]);
  }
  DropMappedPages(view);
  int64_t bad = n;
#pragma omp parallel for reduction(min : bad) if (n >= (1 << 20))
  for (int64_t i = 0; i < n; ++i) {
    if ((bits[i] & 0x7f80u) == 0x7f80u) bad = std::min(bad, i);
  }
  if (bad < n) return NonFiniteError(view, bad);
  const std::vector<int64_t>& shape = view.shape;
  if (d.experts != nullptr) {
    const int experts = int(shape[0]), rows = int(shape[1]), cols = int(shape[2]);
    d.experts->clear();
    for (int e = 0; e < experts; ++e) {
      d.experts->push_back(
          cpu::PackedMatrix::FromBf16(bits.data() + size_t(e) * rows * cols, rows, cols));
    }
    return absl::OkStatus();
  }
  const int rows = int(shape[0]), cols = int(shape[1]);
  if (d.embedding != nullptr) {
    d.embedding->lm_head = cpu::PackedMatrix::FromBf16(bits.data(), rows, cols);
    d.embedding->embed_tokens = std::move(bits);
    return absl::OkStatus();
  }
  *d.matrix = cpu::PackedMatrix::FromBf16(bits.data(), rows, cols);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> LoadModelWeights(const ModelConfig& config,
                                              const SafetensorsReader& reader) {
  return LoadModelWeights(config, QuantizationConfig(), reader);
}

absl::StatusOr<ModelWeights> LoadModelWeights(const ModelConfig& config,
                                              const QuantizationConfig& quant,
                                              const SafetensorsReader& reader) {
  ModelWeights w;
  w.format = quant.format;
  std::unordered_map<std::string, Destination> dest = Destinations(config, &w);
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::vector<std::pair<const TensorView*, Destination>> jobs;
  // Issue 37: the quantized modules (quant_loader.h) are planned first and skipped below.
  QuantizedLoadPlan qplan;
  if (quant.quantized()) {
    qplan = PlanQuantizedLoad(
        config, quant, reader,
        [&](const std::string& name) {
          const Destination& d = dest[name];
          return MatrixSeat{d.matrix, d.experts};
        },
        &problems);
    used.insert(qplan.used.begin(), qplan.used.end());
  }
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    if (qplan.handled_specs.count(spec.name) != 0) continue;
    const std::string alias = EncoderAlias(spec.name);
    const TensorView* primary = reader.Find(spec.name);
    const TensorView* secondary = alias.empty() ? nullptr : reader.Find(alias);
    if (primary != nullptr) used.insert(spec.name);
    if (secondary != nullptr) used.insert(alias);
    const TensorView* v = primary != nullptr ? primary : secondary;
    if (v == nullptr) {
      problems.push_back(absl::StrCat(reader.source(), ": tensor '", spec.name, "'",
                                      alias.empty() ? "" : absl::StrCat(" (or '", alias, "')"),
                                      " is missing (expected shape ", ShapeToString(spec.shape),
                                      ")"));
      continue;
    }
    if (v->shape != spec.shape) {
      problems.push_back(ShapeProblem(*v, spec.shape));
      continue;
    }
    if (v->dtype != DType::kBF16 && v->dtype != DType::kF16 && v->dtype != DType::kF32) {
      problems.push_back(absl::StrCat(
          v->file, ": tensor '", v->name, "' has dtype ", DTypeName(v->dtype),
          quant.quantized() ? " but config.json's quantization_config does not quantize it"
                            : " but config.json has no quantization_config (BF16/F16/F32 expected)"));
      continue;
    }
    // A tied encoder copy next to the decoder tensor is accepted but must have the same shape.
    if (primary != nullptr && secondary != nullptr && secondary->shape != spec.shape) {
      problems.push_back(ShapeProblem(*secondary, spec.shape));
    }
    auto it = dest.find(spec.name);
    if (it == dest.end()) {
      return absl::InternalError(absl::StrCat("no destination for tensor '", spec.name, "'"));
    }
    jobs.emplace_back(v, it->second);
  }
  for (const TensorView& v : reader.tensors()) {
    if (used.count(v.name) != 0 || IsVisionTensor(v.name)) continue;
    if (v.name == kLmHead) {
      const std::vector<int64_t> tied = {config.vocab_size, config.hidden_size};
      if (v.shape != tied) {
        problems.push_back(
            absl::StrCat(ShapeProblem(v, tied), " (lm_head must be tied to embed_tokens)"));
      }
      continue;
    }
    problems.push_back(absl::StrCat(v.file, ": unexpected tensor '", v.name, "' with shape ",
                                    ShapeToString(v.shape),
                                    " (not a DiffusionGemma text tensor for this config)"));
  }
  if (!problems.empty()) {
    const size_t n = problems.size();
    if (n > kMaxReportedProblems) {
      problems.resize(kMaxReportedProblems);
      problems.push_back(absl::StrCat("... and ", n - kMaxReportedProblems, " more"));
    }
    return absl::InvalidArgumentError(absl::StrJoin(problems, "; "));
  }
  for (auto& [view, d] : jobs) {
    if (d.vec != nullptr || d.scalar != nullptr) {
      DGSERVE_RETURN_IF_ERROR(LoadFloat32(*view, d));
    } else {
      DGSERVE_RETURN_IF_ERROR(LoadMatrix(*view, d));
    }
  }
  for (auto& job : qplan.jobs) DGSERVE_RETURN_IF_ERROR(job());
  return w;
}

int64_t WeightBytes(const ModelConfig& config) { return WeightBytes(config, QuantizationConfig()); }

int64_t WeightBytes(const ModelConfig& config, const QuantizationConfig& quant) {
  int64_t bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    // Matrices (rank ≥ 2) in bf16; the embedding is held twice (row-major and packed).
    const int64_t each = spec.shape.size() >= 2 ? 2 : 4;
    if (quant.quantized() && spec.shape.size() >= 2 && spec.family != InitFamily::kEmbed) {
      // Issue 37: a quantized matrix (checkpoint module names; experts unfused per expert).
      std::string module = spec.name;
      if (absl::EndsWith(module, ".weight")) module.resize(module.size() - 7);
      const bool fused = spec.shape.size() == 3;
      if (fused) module = absl::StrCat(module.substr(0, module.rfind('.')), ".0.down_proj");
      if (quant.Quantizes(module)) {
        const int64_t rows = spec.numel() / spec.shape.back(), cols = spec.shape.back();
        const int64_t padded = (rows + 15) / 16 * 16;
        if (quant.format == WeightFormat::kFp8) {
          bytes += padded * cols + padded * 4;
        } else if (quant.format == WeightFormat::kNvfp4) {
          // Codes 4 bits, one e4m3 scale per 16, alpha and weight_scale_2 per row (float32).
          bytes += padded * cols / 2 + padded * (cols / 16) + padded * 8;
        } else {
          const int64_t g = quant.GroupFor(int(cols));
          bytes += padded * cols / 2 + padded * ((cols + g - 1) / g) * 4;
        }
        continue;
      }
    }
    bytes += spec.numel() * each;
  }
  return bytes + int64_t(config.vocab_size) * config.hidden_size * 2;
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint directory ", dir, " does not exist"));
  }
  Checkpoint ckpt;
  ckpt.dir = dir;
  const std::string config_path = (fs::path(dir) / "config.json").string();
  DGSERVE_ASSIGN_OR_RETURN(ckpt.config, LoadModelConfig(config_path));
  const fs::path gen = fs::path(dir) / "generation_config.json";
  if (fs::exists(gen, ec)) {
    DGSERVE_ASSIGN_OR_RETURN(ckpt.generation, LoadGenerationConfig(gen.string()));
  }
  // Issue 37: a compressed-tensors or ModelOpt quantization_config (quant_config.h), refused before
  // any tensor is read when this build does not run it.
  {
    DGSERVE_ASSIGN_OR_RETURN(std::string text, ReadFileToString(config_path));
    DGSERVE_ASSIGN_OR_RETURN(ckpt.quant, ParseQuantizationConfig(text, config_path));
    // ModelOpt's exports carry their quantization in hf_quant_config.json as well (older ones
    // only there).
    const fs::path hf = fs::path(dir) / "hf_quant_config.json";
    if (!ckpt.quant.quantized() && fs::exists(hf, ec)) {
      DGSERVE_ASSIGN_OR_RETURN(std::string hf_text, ReadFileToString(hf.string()));
      DGSERVE_ASSIGN_OR_RETURN(ckpt.quant, ParseHfQuantConfig(hf_text, hf.string()));
    }
  }
  // Refuse what memory cannot hold: bf16 (or quantized) matrices, the embedding twice, float32
  // vectors.
  const int64_t bytes = WeightBytes(ckpt.config, ckpt.quant);
  if (auto available = AvailableMemoryBytes(); available && uint64_t(bytes) > *available) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "loading %s needs %.2f GB of memory (%s weights) but only %.2f GB are available", dir,
        bytes / 1e9, QuantizationName(ckpt.quant), double(*available) / 1e9));
  }
  DGSERVE_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::OpenDir(dir));
  auto weights = LoadModelWeights(ckpt.config, ckpt.quant, reader);
  if (!weights.ok()) {
    return absl::Status(weights.status().code(), absl::StrCat(weights.status().message(),
                                                              " [shapes from ", config_path, "]"));
  }
  ckpt.weights = *std::move(weights);
  return ckpt;
}

}  // namespace dgserve
