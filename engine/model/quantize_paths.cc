// dgserve-quantize's default ignore list, its --in / --out checks and its ignore-list checks
// (quantize_checkpoint.h), apart from the checkpoint writer: they read no tensor.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "engine/model/config.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/tensor_names.h"

namespace dgserve {

namespace fs = std::filesystem;

namespace {

constexpr char kEncoderAlias[] = "model.encoder.language_model.";

// Whether `body` (a ModelOpt-bound regex without its ".*" ends) is a module name but for '.'s
// left unescaped: letters, digits, '_', "\\." and '.' only, at least one bare '.'.
bool OnlyUnescapedDots(const std::string& body) {
  bool bare = false;
  for (size_t i = 0; i < body.size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(body[i]);
    if (ch == '\\' && i + 1 < body.size() && body[i + 1] == '.') {
      ++i;
    } else if (ch == '.') {
      bare = true;
    } else if (!std::isalnum(ch) && ch != '_') {
      return false;
    }
  }
  return bare;
}

// A checkpoint directory's config and safetensors headers (no tensor data read).
struct CheckpointHeaders {
  ModelConfig config;
  SafetensorsReader reader;
};
absl::StatusOr<CheckpointHeaders> ReadCheckpointHeaders(const std::string& in) {
  const std::string config_path = (fs::path(in) / "config.json").string();
  DGSERVE_ASSIGN_OR_RETURN(const std::string text, ReadFileToString(config_path));
  DGSERVE_ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(text, config_path));
  DGSERVE_ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::OpenDir(in));
  return CheckpointHeaders{std::move(config), std::move(reader)};
}

// What a written ignore list keeps, matched as the loader will match the written config.json:
// `glob` (ModelOpt's exclude_modules) as fnmatch patterns or module prefixes, else
// (compressed-tensors) as names or regular expressions; every other Linear is quantized.
QuantizationConfig WrittenIgnoreMatcher(std::vector<std::string> written, bool glob) {
  QuantizationConfig q;
  q.format = WeightFormat::kW4A16;
  q.targets = {"Linear"};
  q.ignore = std::move(written);
  q.glob_ignore = glob;
  return q;
}

}  // namespace

std::string QuantizeDecoderModuleName(const std::string& module) {
  return absl::StartsWith(module, kEncoderAlias)
             ? absl::StrCat("model.decoder.", module.substr(sizeof(kEncoderAlias) - 1))
             : module;
}

std::vector<std::string> QuantizableModules(const ModelConfig& config,
                                            std::span<const TensorView> tensors) {
  std::set<std::string> linear;
  for (const TensorSpec& s : ExpectedTensors(config)) {
    if (s.shape.size() == 2 && absl::EndsWith(s.name, ".weight") &&
        (s.family == InitFamily::kLinear || s.family == InitFamily::kRouter)) {
      linear.insert(s.name);
    }
  }
  std::vector<std::string> out;
  for (const TensorView& v : tensors) {
    const bool gate_up = absl::EndsWith(v.name, ".experts.gate_up_proj");
    const bool down = absl::EndsWith(v.name, ".experts.down_proj");
    if ((gate_up || down) && v.shape.size() == 3) {
      const std::string base = v.name.substr(0, v.name.rfind('.'));
      for (int64_t e = 0; e < v.shape[0]; ++e) {
        const std::string prefix = absl::StrCat(base, ".", e, ".");
        if (gate_up) {
          out.push_back(prefix + "gate_proj");
          out.push_back(prefix + "up_proj");
        } else {
          out.push_back(prefix + "down_proj");
        }
      }
    } else if (v.shape.size() == 2 && linear.count(QuantizeDecoderModuleName(v.name)) != 0) {
      out.push_back(v.name.substr(0, v.name.size() - 7));  // without ".weight"
    }
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> WrittenIgnoreList(const QuantizeOptions& options) {
  if (!WritesModelOptIgnore(options)) return options.ignore;
  std::vector<std::string> globs;
  for (const std::string& e : options.ignore) {
    DGSERVE_ASSIGN_OR_RETURN(std::string g, ModelOptIgnoreGlob(e));
    globs.push_back(std::move(g));
  }
  return globs;
}

bool WritesModelOptIgnore(const QuantizeOptions& options) {
  return options.format == WeightFormat::kNvfp4 && options.nvfp4_layout == Nvfp4Layout::kModelOpt;
}

absl::Status CheckIgnoreList(const ModelConfig& config, std::span<const TensorView> tensors,
                             const QuantizeOptions& options, bool layer_by_layer,
                             int amax_calibration_steps) {
  const std::vector<std::string>& ignore = options.ignore;
  DGSERVE_RETURN_IF_ERROR(CheckModulePatterns(ignore, "the ignore list's"));
  DGSERVE_ASSIGN_OR_RETURN(std::vector<std::string> written, WrittenIgnoreList(options));
  const QuantizationConfig q =
      WrittenIgnoreMatcher(std::move(written), WritesModelOptIgnore(options));
  const std::vector<std::string> modules = QuantizableModules(config, tensors);
  int quantized = 0;
  std::string unobserved;  // the first quantized module a one-step calibration never observes
  for (const std::string& module : modules) {
    const bool quantizes = q.Quantizes(module);
    quantized += quantizes;
    if (quantizes && unobserved.empty() &&
        absl::StrContains(QuantizeDecoderModuleName(module), "self_conditioning.")) {
      unobserved = module;
    }
    if (absl::EndsWith(module, ".gate_proj") && absl::StrContains(module, ".experts.")) {
      // The loader (and vLLM's fused MoE) runs an expert's gate and up as one matrix.
      const std::string prefix = module.substr(0, module.size() - 9);  // "….experts.E."
      if (quantizes != q.Quantizes(prefix + "up_proj")) {
        return absl::InvalidArgumentError(
            absl::StrCat("the ignore list quantizes one of ", prefix, "gate_proj and ", prefix,
                         "up_proj only: an expert's gate and up are one matrix, both quantized "
                         "or both kept"));
      }
    }
    const std::string decoder = QuantizeDecoderModuleName(module);
    if (layer_by_layer && decoder != module && quantizes != q.Quantizes(decoder)) {
      // Layer-by-layer GPTQ decides by the decoder name what the later layers are calibrated on.
      return absl::InvalidArgumentError(
          absl::StrCat("the ignore list treats ", module, " and its decoder module ", decoder,
                       " differently: layer-by-layer GPTQ needs both quantized or both kept"));
    }
  }
  if (!modules.empty() && quantized == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ignore list '", absl::StrJoin(ignore, ","), "' leaves no module to quantize: it ",
        "matches every one of the checkpoint's ", modules.size(),
        " Linear modules (leave out --ignore for the default list, or name fewer modules)"));
  }
  // The self-conditioning MLP's input is the previous denoising step's probabilities: step 0 of a
  // canvas runs without it (engine/generation/sample_run.cc), so a one-step calibration never
  // observes it, and W4A4's static input scale needs its amax.
  if (amax_calibration_steps == 1 && options.format == WeightFormat::kNvfp4 &&
      options.nvfp4_activations == Nvfp4Activations::kNvfp4 && !unobserved.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ignore list quantizes ", unobserved,
        ", whose input a calibration of 1 denoising step per canvas never observes (the "
        "self-conditioning MLP runs from a canvas's second step on), and --format nvfp4 needs "
        "its amax for the static activation scale: add re:.*self_conditioning.* to --ignore (as "
        "the default list does), or calibrate with --calibration_steps 2 or more"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> UnmatchedIgnoreEntries(const ModelConfig& config,
                                                                std::span<const TensorView> tensors,
                                                                const QuantizeOptions& options) {
  std::set<std::string> modules;  // every module name an ignore entry may mean
  for (const TensorView& t : tensors) {
    const size_t dot = t.name.rfind('.');
    modules.insert(dot == std::string::npos ? t.name : t.name.substr(0, dot));
  }
  for (std::string& m : QuantizableModules(config, tensors)) modules.insert(std::move(m));
  // Each entry as written (ModelOpt: its fnmatch pattern, matched as the loader matches it).
  DGSERVE_ASSIGN_OR_RETURN(const std::vector<std::string> written, WrittenIgnoreList(options));
  std::vector<std::string> unmatched;
  for (size_t i = 0; i < options.ignore.size(); ++i) {
    // Keeps what written[i] alone matches.
    const QuantizationConfig one =
        WrittenIgnoreMatcher({written[i]}, WritesModelOptIgnore(options));
    auto matches = [&](const std::string& m) {
      return one.glob_ignore ? !one.Quantizes(m) : IgnoreEntryMatches(options.ignore[i], m);
    };
    if (std::none_of(modules.begin(), modules.end(), matches)) {
      unmatched.push_back(options.ignore[i]);
    }
  }
  return unmatched;
}

absl::StatusOr<std::vector<std::string>> UnmatchedIgnoreEntries(const std::string& in,
                                                                const QuantizeOptions& options) {
  DGSERVE_ASSIGN_OR_RETURN(const CheckpointHeaders h, ReadCheckpointHeaders(in));
  return UnmatchedIgnoreEntries(h.config, h.reader.tensors(), options);
}

absl::StatusOr<std::string> ModelOptIgnoreGlob(const std::string& e) {
  if (!absl::StartsWith(e, "re:")) {
    // fnmatch would read [...] as a character class, which the loader's Glob (and so the
    // writer's choice of modules) does not: the written list would name other modules than
    // those kept.
    if (e.find_first_of("[]") != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--format nvfp4 writes ModelOpt exclude_modules (fnmatch patterns): the ignore entry '",
          e,
          "' has a character class ([...]), which this build's pattern matching does not "
          "support; list the modules one by one or use * and ?"));
    }
    return e;
  }
  std::string body = e.substr(3);
  const bool lead = absl::StartsWith(body, ".*");
  if (lead) body = body.substr(2);
  if (absl::EndsWith(body, ".*")) body.resize(body.size() - 2);
  std::string name;
  for (size_t i = 0; i < body.size(); ++i) {
    const char ch = body[i];
    if (ch == '\\' && i + 1 < body.size() && body[i + 1] == '.') {
      name += '.';
      ++i;
      continue;
    }
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_') {
      if (ch == '.' && OnlyUnescapedDots(body)) {
        // A regex '.' is any character, a glob's a dot: the user meant the dots literally.
        std::string escaped, glob;
        for (size_t j = 0; j < body.size(); ++j) {
          if (body[j] == '\\') {
            escaped += body.substr(j, 2);
            glob += body[++j];
          } else {
            escaped += body[j] == '.' ? "\\." : std::string(1, body[j]);
            glob += body[j];
          }
        }
        return absl::InvalidArgumentError(absl::StrCat(
            "--format nvfp4 writes ModelOpt exclude_modules (fnmatch patterns): the ignore entry '",
            e, "' has an unescaped '.' (in a regular expression, any character): escape the dots (",
            lead ? "re:.*" : "re:", escaped, ".*) or give a glob (", lead ? "*" : "", glob, "*)"));
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "--format nvfp4 writes ModelOpt exclude_modules (fnmatch patterns): the ignore entry '",
          e,
          "' is not of the form re:.*NAME.*, re:NAME or a module name; give a pattern such "
          "as *NAME* (or write --nvfp4_layout compressed-tensors, whose ignore list takes "
          "regular expressions)"));
    }
    name += ch;
  }
  return absl::StrCat(lead ? "*" : "", name, "*");
}

absl::Status CheckIgnoreList(const std::string& in, const QuantizeOptions& options,
                             bool layer_by_layer, int amax_calibration_steps) {
  DGSERVE_ASSIGN_OR_RETURN(const CheckpointHeaders h, ReadCheckpointHeaders(in));
  return CheckIgnoreList(h.config, h.reader.tensors(), options, layer_by_layer,
                         amax_calibration_steps);
}

std::vector<std::string> DefaultQuantizeIgnore() {
  return {"lm_head", "re:.*embed_tokens.*", "re:.*router.*", "re:.*norm.*",
          "re:.*self_conditioning.*"};
}

absl::Status CheckQuantizePaths(const std::string& in, const std::string& out) {
  if (in.empty() || out.empty())
    return absl::InvalidArgumentError("--in DIR and --out DIR are required");
  std::error_code ec;
  if (fs::exists(out, ec) && fs::equivalent(in, out, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--out must differ from --in: ", out,
                     " is the source checkpoint's directory; give a new directory for the "
                     "quantized checkpoint"));
  }
  // --out inside --in, by any path: out's symlinks and ".." resolved (weakly_canonical: its
  // missing tail lexically), then each existing directory above it compared with --in as a file
  // (fs::equivalent: the same device and inode, whatever path or mount reaches it).
  const fs::path resolved = fs::weakly_canonical(fs::absolute(out, ec), ec);
  if (ec) {  // e.g. a symlink loop (ELOOP) or an unreadable directory on the way
    return absl::InvalidArgumentError(
        absl::StrCat("--out ", out, ": cannot resolve the path: ", ec.message()));
  }
  for (fs::path p = resolved; !p.empty(); p = p.parent_path()) {
    if (fs::exists(p, ec) && fs::equivalent(p, in, ec)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--out ", out, " is inside --in ", in, " (", resolved.string(),
                       "): the quantized checkpoint would be written into its source"));
    }
    if (p == p.parent_path()) break;
  }
  // What fs::create_directories(out) and the writes into it would find only at the end: the
  // nearest existing path of out and its parents must be a directory we can write to (the
  // missing ones below it are created).
  // (A symlink counts as present even when its target is missing: fs::exists follows it, and
  // the walk would go past a dangling link to a writable parent.)
  const auto present = [&](const fs::path& q) { return fs::exists(fs::symlink_status(q, ec)); };
  fs::path p(out);
  while (!present(p) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  if (!present(p)) p = ".";  // a relative path none of whose components exist
  if (fs::is_symlink(fs::symlink_status(p, ec)) && !fs::exists(p, ec)) {
    const fs::path target = fs::read_symlink(p, ec);
    return absl::InvalidArgumentError(absl::StrCat(
        "--out ", out, ": ", p == fs::path(out) ? "it" : p.string(), " is a symbolic link to ",
        target.string(), ", which does not exist (create it, or give another --out)"));
  }
  if (!fs::is_directory(p, ec)) {
    return absl::InvalidArgumentError(
        p == fs::path(out)
            ? absl::StrCat("--out ", out, " exists and is not a directory")
            : absl::StrCat("--out ", out, ": ", p.string(), " exists and is not a directory"));
  }
  if (access(p.c_str(), W_OK | X_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("--out ", out, ": ",
                                                   p == fs::path(out) ? "" : p.string() + " ",
                                                   "is not writable: ", std::strerror(errno)));
  }
  // access(2) passes for root whatever the mode, and on file systems that make no directory
  // (/proc): a directory made there (and removed) shows it now, not after a calibration.
  std::string probe = (p / ".dgserve-quantize-probe-XXXXXX").string();
  if (mkdtemp(probe.data()) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--out ", out, ": cannot create a directory in ",
                                                   p.string(), ": ", std::strerror(errno),
                                                   " (give an --out in a writable directory)"));
  }
  rmdir(probe.c_str());
  return absl::OkStatus();
}

absl::Status CheckQuantizeInput(const std::string& in) {
  if (in.empty()) return absl::InvalidArgumentError("--in DIR and --out DIR are required");
  std::error_code ec;
  if (fs::is_regular_file(in, ec)) {
    const fs::path dir = fs::path(in).parent_path();
    return absl::InvalidArgumentError(
        absl::StrCat("--in ", in,
                     ": a file, not a checkpoint directory; give the directory that holds "
                     "config.json and the safetensors (",
                     dir.empty() ? "." : dir.string(), "?)"));
  }
  if (!fs::is_directory(in, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--in ", in, ": not a checkpoint directory (",
        fs::exists(in, ec) ? "not a directory" : "no such directory",
        "; give the bf16 checkpoint's directory, which holds config.json and the safetensors)"));
  }
  if (!fs::exists(fs::path(in) / "config.json", ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--in ", in, ": not a checkpoint directory (no config.json)"));
  }
  return absl::OkStatus();
}

}  // namespace dgserve
