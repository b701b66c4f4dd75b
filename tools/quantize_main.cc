// dgserve-quantize: writes a quantized checkpoint (compressed-tensors FP8 or W4A16, NVFP4 in
// ModelOpt's or compressed-tensors' layout) from a bf16 DiffusionGemma checkpoint; what it
// writes: engine/model/quantize_checkpoint.h.
//
//   dgserve-quantize --in DIR --out DIR --format fp8
//   dgserve-quantize --in DIR --out DIR --format w4a16 --group_size 128
//   dgserve-quantize --in DIR --out DIR --format nvfp4 [--nvfp4_layout modelopt]
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors
//   dgserve-quantize --in DIR --out DIR --format nvfp4 --nvfp4_layout compressed-tensors \
//                    --nvfp4_activations none
#include <cstdio>
#include <optional>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/status_macros.h"
#include "engine/model/quantize_checkpoint.h"

ABSL_FLAG(std::string, in, "", "bf16 checkpoint directory to read (required)");
ABSL_FLAG(std::string, out, "", "checkpoint directory to write (required; created if needed)");
ABSL_FLAG(std::string, format, "", "fp8, w4a16 or nvfp4 (required)");
ABSL_FLAG(std::optional<int32_t>, group_size, std::nullopt,
          "w4a16: inputs per scale group (0: one group per row; default 128); nvfp4: fixed at 16 "
          "(another value is refused)");
ABSL_FLAG(std::string, nvfp4_layout, "",
          "--format nvfp4 only: the checkpoint layout, named as vLLM's quantization methods: "
          "modelopt (default; quant_method \"modelopt\", M.weight / weight_scale_2 / "
          "input_scale, as TensorRT Model Optimizer exports) or compressed-tensors (format "
          "\"nvfp4-pack-quantized\", M.weight_packed / weight_global_scale / "
          "input_global_scale, as llm-compressor's NVFP4 scheme writes)");
ABSL_FLAG(std::string, nvfp4_activations, "",
          "--format nvfp4 only: nvfp4 (default; W4A4, the activations quantized to NVFP4 at run "
          "time) or none (weight-only NVFP4A16, as llm-compressor's NVFP4A16 preset writes: no "
          "input_global_scale, activations unquantized; needs --nvfp4_layout compressed-tensors)");
ABSL_FLAG(std::string, ignore, absl::StrJoin(dgserve::DefaultQuantizeIgnore(), ","),
          "comma-separated compressed-tensors ignore list (module names or re:REGEX): modules "
          "kept in bf16. Default: the LM head and embedding, the MoE router, the norms, and the "
          "self-conditioning MLP");
ABSL_FLAG(int64_t, max_shard_bytes, dgserve::kDefaultMaxShardBytes,
          "bytes of tensors per safetensors shard");

namespace dgserve {
namespace {

absl::Status Run() {
  QuantizeOptions options;
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "fp8") {
    options.format = WeightFormat::kFp8;
  } else if (format == "w4a16") {
    options.format = WeightFormat::kW4A16;
  } else if (format == "nvfp4") {
    options.format = WeightFormat::kNvfp4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--format '", format, "': must be fp8, w4a16 or nvfp4"));
  }
  const std::optional<int32_t> group_size = absl::GetFlag(FLAGS_group_size);
  if (options.format == WeightFormat::kNvfp4) {
    if (group_size && *group_size != 16) {
      return absl::InvalidArgumentError(
          absl::StrCat("--group_size ", *group_size,
                       ": --format nvfp4 has 16-input blocks, fixed by the format (omit "
                       "--group_size or give 16)"));
    }
    options.group_size = 16;
  } else if (group_size) {
    options.group_size = *group_size;  // QuantizeCheckpoint refuses a negative one
  }
  const std::string layout = absl::GetFlag(FLAGS_nvfp4_layout);
  if (!layout.empty() && options.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_layout applies to --format nvfp4 only (--format is ", format, ")"));
  }
  if (layout == "compressed-tensors") {
    options.nvfp4_layout = Nvfp4Layout::kCompressedTensors;
  } else if (layout.empty() || layout == "modelopt") {
    options.nvfp4_layout = Nvfp4Layout::kModelOpt;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_layout '", layout, "': must be modelopt or compressed-tensors"));
  }
  const std::string activations = absl::GetFlag(FLAGS_nvfp4_activations);
  if (!activations.empty() && options.format != WeightFormat::kNvfp4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--nvfp4_activations applies to --format nvfp4 only (--format is ", format, ")"));
  }
  if (activations == "none") {
    if (options.nvfp4_layout != Nvfp4Layout::kCompressedTensors) {
      return absl::InvalidArgumentError(
          "--nvfp4_activations none (weight-only NVFP4A16) needs --nvfp4_layout "
          "compressed-tensors: ModelOpt's weight-only NVFP4 export is not supported");
    }
    options.nvfp4_activations = Nvfp4Activations::kNone;
  } else if (activations.empty() || activations == "nvfp4") {
    options.nvfp4_activations = Nvfp4Activations::kNvfp4;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--nvfp4_activations '", activations, "': must be nvfp4 or none"));
  }
  options.ignore.clear();
  for (absl::string_view e : absl::StrSplit(absl::GetFlag(FLAGS_ignore), ',', absl::SkipEmpty())) {
    options.ignore.emplace_back(e);
  }
  options.max_shard_bytes = absl::GetFlag(FLAGS_max_shard_bytes);
  const std::string out = absl::GetFlag(FLAGS_out);
  DGSERVE_ASSIGN_OR_RETURN(QuantizeSummary s,
                           QuantizeCheckpoint(absl::GetFlag(FLAGS_in), out, options));
  const char* nvfp4_layout = s.quant.format != WeightFormat::kNvfp4 ? ""
                             : s.quant.nvfp4_compressed_tensors     ? " (compressed-tensors)"
                                                                    : " (modelopt)";
  std::printf("wrote %s: format %s%s%s, %d modules quantized, %d kept in their dtype, in %.1f s\n",
              out.c_str(), QuantizationName(s.quant),
              s.quant.format != WeightFormat::kW4A16 ? ""
              : s.quant.channel_groups               ? " (per channel)"
                                       : absl::StrCat(" (group ", s.quant.group_size, ")").c_str(),
              nvfp4_layout, s.quantized, s.kept, s.seconds);
  return absl::OkStatus();
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  return dgserve::RunFlagsOnlyTool(
      argc, argv, "dgserve-quantize",
      "Writes a quantized checkpoint (compressed-tensors FP8/W4A16, NVFP4 in ModelOpt's or\n"
      "compressed-tensors' layout) from a bf16 DiffusionGemma checkpoint.\n"
      "  dgserve-quantize --in DIR --out DIR --format fp8|w4a16|nvfp4 [--group_size N] [--ignore "
      "LIST]\n"
      "                   [--nvfp4_layout modelopt|compressed-tensors] [--nvfp4_activations "
      "nvfp4|none]",
      "tools/quantize_main.cc", dgserve::Run);
}
