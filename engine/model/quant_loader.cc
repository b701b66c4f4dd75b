#include "engine/model/quant_loader.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

constexpr char kDecoderPrefix[] = "model.decoder.";
constexpr char kEncoderPrefix[] = "model.encoder.language_model.";

std::string EncoderAlias(const std::string& name) {
  if (!absl::StartsWith(name, kDecoderPrefix)) return "";
  return absl::StrCat(kEncoderPrefix, name.substr(sizeof(kDecoderPrefix) - 1));
}

bool IsFloat16Or32(DType d) { return d == DType::kBF16 || d == DType::kF16 || d == DType::kF32; }

// One Linear module's tensors, found and checked; `rows`, `cols` its [out, in].
struct Module {
  std::string name;  // as found in the checkpoint (decoder prefix or the encoder alias)
  bool quantized = false;
  const TensorView* weight = nullptr;  // bf16 / FP8 weight
  const TensorView* packed = nullptr;  // W4A16
  const TensorView* scale = nullptr;
  const TensorView* shape = nullptr;  // W4A16 weight_shape
  const TensorView* global =
      nullptr;  // NVFP4 weight_scale_2 (compressed-tensors: weight_global_scale)
  const TensorView* input = nullptr;  // NVFP4 input_scale (compressed-tensors: input_global_scale)
  bool reciprocal = false;   // compressed-tensors NVFP4: global and input are divisors (1/scale)
  bool weight_only = false;  // NVFP4A16: no input scale, activations unquantized
  int rows = 0, cols = 0;
};

class Planner {
 public:
  Planner(const QuantizationConfig& q, const SafetensorsReader& r, QuantizedLoadPlan* plan,
          std::vector<std::string>* problems)
      : q_(q), r_(r), plan_(plan), problems_(problems) {}

  const TensorView* Find(const std::string& name) {
    const TensorView* v = r_.Find(name);
    if (v != nullptr) plan_->used.insert(name);
    return v;
  }
  void Problem(const TensorView* v, const std::string& what) {
    problems_->push_back(absl::StrCat(v != nullptr ? v->file : r_.source(), ": ", what));
  }

  // True when the checkpoint holds module `m` (under the decoder prefix or the encoder alias) in
  // any form.
  std::string Locate(const std::string& m) {
    for (const std::string& name : {m, EncoderAlias(m)}) {
      if (name.empty()) continue;
      for (const char* suffix : {".weight", ".weight_packed"}) {
        if (r_.Find(name + suffix) != nullptr) return name;
      }
    }
    return "";
  }

  // Checks module `name` of shape [rows, cols]; false (with problems recorded) when unusable.
  bool Check(const std::string& name, int rows, int cols, Module* m) {
    m->name = name;
    m->rows = rows;
    m->cols = cols;
    m->quantized = q_.Quantizes(name);
    const std::string expect = absl::StrCat("[", rows, ", ", cols, "]");
    if (!m->quantized) {
      m->weight = Find(name + ".weight");
      if (m->weight == nullptr) {
        Problem(nullptr, absl::StrCat("tensor '", name, ".weight' is missing (expected shape ",
                                      expect, "; the quantization_config does not quantize '",
                                      name, "')"));
        return false;
      }
      if (!IsFloat16Or32(m->weight->dtype) ||
          m->weight->shape != std::vector<int64_t>{rows, cols}) {
        Problem(m->weight, absl::StrCat("tensor '", m->weight->name, "' has dtype ",
                                        DTypeName(m->weight->dtype), " and shape ",
                                        ShapeToString(m->weight->shape), " but module '", name,
                                        "' is not quantized by the quantization_config: expected "
                                        "BF16/F16/F32 ", expect));
        return false;
      }
      return true;
    }
    bool ok = true;
    auto need = [&](const std::string& suffix, std::vector<DType> dtypes,
                    std::vector<std::vector<int64_t>> shapes, const char* what) {
      const TensorView* v = Find(name + suffix);
      if (v == nullptr) {
        Problem(nullptr, absl::StrCat("tensor '", name, suffix, "' is missing (", what,
                                      " of the ", WeightFormatName(q_.format), " module '", name,
                                      "', expected shape ", ShapeToString(shapes[0]), ")"));
        ok = false;
        return v;
      }
      bool dtype_ok = false, shape_ok = false;
      std::string names;
      for (DType d : dtypes) {
        dtype_ok |= v->dtype == d;
        names += absl::StrCat(names.empty() ? "" : "/", DTypeName(d));
      }
      for (const auto& s : shapes) shape_ok |= v->shape == s;
      if (!dtype_ok || !shape_ok) {
        Problem(v, absl::StrCat("tensor '", v->name, "' has dtype ", DTypeName(v->dtype),
                                " and shape ", ShapeToString(v->shape), " but the ",
                                WeightFormatName(q_.format), " quantization_config expects ",
                                names, " ", ShapeToString(shapes[0]), " (", what, ")"));
        ok = false;
      }
      return v;
    };
    const std::vector<DType> floats = {DType::kBF16, DType::kF16, DType::kF32};
    if (q_.format == WeightFormat::kNvfp4) {
      if (cols % cpu::kNvfp4Block != 0) {
        Problem(nullptr, absl::StrCat("module '", name, "' has ", cols,
                                      " input features, not a multiple of 16: NVFP4 (16-input "
                                      "blocks) cannot quantize it (list it in exclude_modules)"));
        return false;
      }
      // ModelOpt's names, or compressed-tensors' (quant_config.h: the same codes and block
      // scales, reciprocal global scales).
      const bool ct = q_.nvfp4_compressed_tensors;
      m->reciprocal = ct;
      m->weight = need(ct ? ".weight_packed" : ".weight", {DType::kU8}, {{rows, cols / 2}},
                       "e2m1 codes packed two per byte");
      m->scale = need(".weight_scale", {DType::kF8E4M3}, {{rows, cols / 16}},
                      "float8_e4m3fn scale per 16 inputs");
      m->global =
          need(ct ? ".weight_global_scale" : ".weight_scale_2", {DType::kF32}, {{1}, {}},
               ct ? "per-tensor weight global scale, a divisor" : "per-tensor weight scale");
      // Weight-only NVFP4A16 has no activation scale (vLLM's CompressedTensorsW4A16Fp4
      // registers none); one present is refused as an unexpected tensor.
      m->weight_only = q_.nvfp4_weight_only;
      if (!m->weight_only) {
        m->input =
            need(ct ? ".input_global_scale" : ".input_scale", {DType::kF32}, {{1}, {}},
                 ct ? "static activation global scale, a divisor" : "static activation scale");
      }
      return ok;
    }
    if (q_.format == WeightFormat::kFp8) {
      m->weight = need(".weight", {DType::kF8E4M3}, {{rows, cols}}, "float8_e4m3fn weight");
      m->scale = need(".weight_scale", floats, {{rows, 1}, {rows}}, "per-channel scale");
    } else {
      const int group = q_.GroupFor(cols);
      const int64_t groups = (cols + group - 1) / group;
      m->packed = need(".weight_packed", {DType::kI32}, {{rows, (cols + 7) / 8}},
                       "int4 values packed eight per int32");
      m->scale = need(".weight_scale", floats, {{rows, groups}}, "per-group scale");
      m->shape = need(".weight_shape", {DType::kI32, DType::kI64}, {{2}}, "[out, in]");
      if (m->shape != nullptr && ok) {
        int64_t dims[2];
        for (int i = 0; i < 2; ++i) {
          if (m->shape->dtype == DType::kI32) {
            int32_t d;
            std::memcpy(&d, m->shape->data + 4 * i, 4);
            dims[i] = d;
          } else {
            std::memcpy(&dims[i], m->shape->data + 8 * i, 8);
          }
        }
        if (dims[0] != rows || dims[1] != cols) {
          Problem(m->shape, absl::StrCat("tensor '", m->shape->name, "' says [", dims[0], ", ",
                                         dims[1], "] but the config expects ", expect));
          ok = false;
        }
      }
    }
    return ok;
  }

 private:
  const QuantizationConfig& q_;
  const SafetensorsReader& r_;
  QuantizedLoadPlan* plan_;
  std::vector<std::string>* problems_;
};

absl::Status NonFinite(const TensorView& v, int64_t i) {
  return absl::InvalidArgumentError(
      absl::StrCat(v.file, ": tensor '", v.name, "' holds a non-finite value (element ", i, ")"));
}

// The scales of a quantized module, float32, finite and ≥ 0.
absl::StatusOr<std::vector<float>> Scales(const TensorView& v) {
  DGSERVE_ASSIGN_OR_RETURN(std::vector<float> s, ToFloat32(v));
  for (size_t i = 0; i < s.size(); ++i) {
    if (!std::isfinite(s[i])) return NonFinite(v, int64_t(i));
    if (s[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(v.file, ": tensor '", v.name,
                                                     "' holds a negative scale (element ", i, ")"));
    }
  }
  return s;
}

// An NVFP4 per-tensor scale (weight_scale_2, input_scale): finite and > 0.
absl::StatusOr<float> PositiveScalar(const TensorView& v) {
  float f;
  std::memcpy(&f, v.data, 4);
  if (!std::isfinite(f) || f <= 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(v.file, ": tensor '", v.name, "' is ", f,
                                                   "; a finite positive scale is expected"));
  }
  return f;
}

// The rows of an NVFP4 module (engine/cpu/gemm_quant.h's QuantMatrix::FromNvfp4 inputs).
struct Nvfp4Rows {
  std::vector<uint8_t> codes, block_scales;
  std::vector<float> global;
  float input_scale = 0.0f;
  float input_global = 0.0f;  // compressed-tensors: input_global_scale (the activations' g)
  float input_stored = 0.0f;  // the stored input_scale / input_global_scale
};

// The codes, block scales and per-row weight_scale_2 `g` of module m appended to *out.
absl::Status AppendNvfp4Weights(const Module& m, float g, Nvfp4Rows* out) {
  const size_t n = size_t(m.rows) * m.cols;
  if (m.weight->nbytes != n / 2 || m.scale->nbytes != n / 16) {
    return absl::InvalidArgumentError(
        absl::StrCat(m.weight->file, ": tensor '", m.weight->name, "' has inconsistent size"));
  }
  const uint8_t* s = m.scale->data;
  for (size_t i = 0; i < n / 16; ++i) {
    if ((s[i] & 0x7f) == 0x7f) return NonFinite(*m.scale, int64_t(i));
    if (s[i] & 0x80) {
      return absl::InvalidArgumentError(absl::StrCat(m.scale->file, ": tensor '", m.scale->name,
                                                     "' holds a negative scale (element ", i, ")"));
    }
  }
  out->block_scales.insert(out->block_scales.end(), s, s + n / 16);
  // ModelOpt's packing, and compressed-tensors' pack_fp4_to_uint8 alike: element 2i in the low
  // nibble, 2i + 1 in the high nibble.
  const uint8_t* p = m.weight->data;
  const size_t base = out->codes.size();
  out->codes.resize(base + n);
  for (size_t i = 0; i < n / 2; ++i) {
    out->codes[base + 2 * i] = p[i] & 0x0f;
    out->codes[base + 2 * i + 1] = p[i] >> 4;
  }
  out->global.insert(out->global.end(), size_t(m.rows), g);
  return absl::OkStatus();
}

absl::Status AppendNvfp4(const Module& m, Nvfp4Rows* out) {
  DGSERVE_ASSIGN_OR_RETURN(const float stored_g, PositiveScalar(*m.global));
  // compressed-tensors stores divisors: weight_scale_2 = 1 / weight_global_scale, input_scale =
  // 1 / input_global_scale (float32, as vLLM's CompressedTensorsW4A4Fp4 and W4A16Fp4 compute them).
  const float g = m.reciprocal ? 1.0f / stored_g : stored_g;
  if (m.weight_only) {  // NVFP4A16 (compressed-tensors only): no activation scale
    if (!std::isfinite(g)) {
      return absl::InvalidArgumentError(
          absl::StrCat(m.global->file, ": tensor '", m.global->name,
                       "' is too small: its reciprocal is not a finite float32"));
    }
    return AppendNvfp4Weights(m, g, out);
  }
  DGSERVE_ASSIGN_OR_RETURN(const float in, PositiveScalar(*m.input));
  const float input_scale = m.reciprocal ? 1.0f / in : in;
  if (!std::isfinite(g) || !std::isfinite(input_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat(m.global->file, ": tensor '", m.global->name, "' or '", m.input->name,
                     "' is too small: its reciprocal is not a finite float32"));
  }
  if (m.reciprocal) out->input_global = in;
  if (out->input_stored != 0.0f && out->input_stored != in) {
    return absl::InvalidArgumentError(absl::StrCat(
        m.input->file, ": tensor '", m.input->name, "' is ", in,
        " but the module stacked with it "
        "(an expert's gate and up, one [2F, D] matrix with one activation quantization) has ",
        out->input_stored, ": they must be equal"));
  }
  out->input_stored = in;
  out->input_scale = input_scale;
  return AppendNvfp4Weights(m, g, out);
}

// Appends the rows of module m to the row-major outputs (one of the three, by m's kind).
absl::Status AppendRows(const Module& m, const QuantizationConfig& q, std::vector<uint16_t>* bf16,
                        std::vector<uint8_t>* codes, std::vector<int8_t>* int4,
                        std::vector<float>* scales) {
  const size_t n = size_t(m.rows) * m.cols;
  if (!m.quantized) {
    DGSERVE_ASSIGN_OR_RETURN(std::vector<float> f, ToFloat32(*m.weight));
    for (size_t i = 0; i < n; ++i) {
      if (!std::isfinite(f[i])) return NonFinite(*m.weight, int64_t(i));
      bf16->push_back(FloatToBf16(f[i]));
    }
    return absl::OkStatus();
  }
  DGSERVE_ASSIGN_OR_RETURN(std::vector<float> s, Scales(*m.scale));
  scales->insert(scales->end(), s.begin(), s.end());
  if (q.format == WeightFormat::kFp8) {
    if (m.weight->nbytes != n) {
      return absl::InvalidArgumentError(
          absl::StrCat(m.weight->file, ": tensor '", m.weight->name, "' has inconsistent size"));
    }
    const uint8_t* p = m.weight->data;
    for (size_t i = 0; i < n; ++i) {
      if ((p[i] & 0x7f) == 0x7f) return NonFinite(*m.weight, int64_t(i));
    }
    codes->insert(codes->end(), p, p + n);
    return absl::OkStatus();
  }
  const int64_t words = (m.cols + 7) / 8;
  const uint8_t* p = m.packed->data;
  for (int r = 0; r < m.rows; ++r) {
    for (int c = 0; c < m.cols; ++c) {
      uint32_t w;
      std::memcpy(&w, p + 4 * (size_t(r) * words + c / 8), 4);
      int4->push_back(int8_t(int((w >> (4 * (c % 8))) & 0xf) - 8));
    }
  }
  return absl::OkStatus();
}

// One matrix from one or more modules stacked by rows (an expert's gate and up).
absl::StatusOr<cpu::PackedMatrix> Build(const std::vector<Module>& parts,
                                        const QuantizationConfig& q) {
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> codes;
  std::vector<int8_t> int4;
  std::vector<float> scales;
  int rows = 0;
  const int cols = parts[0].cols;
  if (parts[0].quantized && q.format == WeightFormat::kNvfp4) {
    Nvfp4Rows r;
    for (const Module& m : parts) {
      DGSERVE_RETURN_IF_ERROR(AppendNvfp4(m, &r));
      rows += m.rows;
    }
    if (q.nvfp4_weight_only) {
      return cpu::PackedMatrix::Quantized(cpu::QuantMatrix::FromNvfp4WeightOnly(
          r.codes.data(), r.block_scales.data(), r.global.data(), rows, cols));
    }
    return cpu::PackedMatrix::Quantized(
        cpu::QuantMatrix::FromNvfp4(r.codes.data(), r.block_scales.data(), r.global.data(),
                                    r.input_scale, rows, cols, r.input_global));
  }
  for (const Module& m : parts) {
    DGSERVE_RETURN_IF_ERROR(AppendRows(m, q, &bf16, &codes, &int4, &scales));
    rows += m.rows;
  }
  if (!parts[0].quantized) return cpu::PackedMatrix::FromBf16(bf16.data(), rows, cols);
  if (q.format == WeightFormat::kFp8) {
    return cpu::PackedMatrix::Quantized(
        cpu::QuantMatrix::FromFp8(codes.data(), scales.data(), rows, cols));
  }
  return cpu::PackedMatrix::Quantized(
      cpu::QuantMatrix::FromInt4(int4.data(), scales.data(), rows, cols, q.GroupFor(cols)));
}

}  // namespace

QuantizedLoadPlan PlanQuantizedLoad(const ModelConfig& config, const QuantizationConfig& quant,
                                    const SafetensorsReader& reader,
                                    const std::function<MatrixSeat(const std::string&)>& seat,
                                    std::vector<std::string>* problems) {
  QuantizedLoadPlan plan;
  Planner p(quant, reader, &plan, problems);
  auto shared = std::make_shared<QuantizationConfig>(quant);
  for (const TensorSpec& spec : ExpectedTensors(config)) {
    const bool linear = spec.shape.size() == 2 && absl::EndsWith(spec.name, ".weight") &&
                        (spec.family == InitFamily::kLinear || spec.family == InitFamily::kRouter);
    if (linear) {
      const std::string module = spec.name.substr(0, spec.name.size() - 7);
      const std::string found = p.Locate(module);
      // A module the config quantizes, or one stored in a quantized form: ours. Otherwise the
      // bf16 path loads it (and reports what is wrong with it).
      if (found.empty() || !quant.Quantizes(found)) continue;
      plan.handled_specs.insert(spec.name);
      Module m;
      if (!p.Check(found, int(spec.shape[0]), int(spec.shape[1]), &m)) continue;
      cpu::PackedMatrix* dst = seat(spec.name).matrix;
      plan.jobs.push_back([m, dst, shared]() -> absl::Status {
        DGSERVE_ASSIGN_OR_RETURN(*dst, Build({m}, *shared));
        return absl::OkStatus();
      });
      continue;
    }
    // Fused experts [E, 2F, D] / [E, D, F]: in the checkpoint fused (bf16 path) or one Linear
    // per expert and projection (here).
    const bool gate_up = absl::EndsWith(spec.name, ".experts.gate_up_proj");
    const bool down = absl::EndsWith(spec.name, ".experts.down_proj");
    if (!gate_up && !down) continue;
    if (reader.Find(spec.name) != nullptr || reader.Find(EncoderAlias(spec.name)) != nullptr) {
      continue;
    }
    const std::string base = spec.name.substr(0, spec.name.rfind('.'));  // ...experts
    if (p.Locate(base + ".0." + (gate_up ? "gate_proj" : "down_proj")).empty()) continue;
    plan.handled_specs.insert(spec.name);
    const int experts = int(spec.shape[0]), rows = int(spec.shape[1]), cols = int(spec.shape[2]);
    std::vector<std::vector<Module>> per_expert(experts);
    bool ok = true;
    for (int e = 0; e < experts; ++e) {
      const std::string prefix = absl::StrCat(base, ".", e, ".");
      const std::vector<std::string> parts =
          gate_up ? std::vector<std::string>{"gate_proj", "up_proj"}
                  : std::vector<std::string>{"down_proj"};
      for (const std::string& part : parts) {
        std::string found = p.Locate(prefix + part);
        if (found.empty()) found = prefix + part;  // reported missing by Check
        Module m;
        ok &= p.Check(found, gate_up ? rows / 2 : rows, cols, &m);
        per_expert[e].push_back(m);
      }
      if (gate_up && per_expert[e][0].quantized != per_expert[e][1].quantized) {
        problems->push_back(absl::StrCat(
            reader.source(), ": expert modules '", per_expert[e][0].name, "' and '",
            per_expert[e][1].name,
            "' must both be quantized or both not (the backend runs them as one [2F, D] matrix)"));
        ok = false;
      }
    }
    if (!ok) continue;
    std::vector<cpu::PackedMatrix>* dst = seat(spec.name).experts;
    plan.jobs.push_back([per_expert, dst, shared]() -> absl::Status {
      dst->clear();
      for (const std::vector<Module>& parts : per_expert) {
        DGSERVE_ASSIGN_OR_RETURN(cpu::PackedMatrix m, Build(parts, *shared));
        dst->push_back(std::move(m));
      }
      return absl::OkStatus();
    });
  }
  return plan;
}

}  // namespace dgserve
