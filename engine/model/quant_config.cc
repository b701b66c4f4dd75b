#include "engine/model/quant_config.h"

#include <nlohmann/json.hpp>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace dgserve {
namespace {

using nlohmann::json;

absl::Status Field(const std::string& source, const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat(source, ": field 'quantization_config.", field, "' ", what));
}

// The expected value of one QuantizationArgs field; absent fields take compressed-tensors'
// defaults (symmetric true, dynamic false, group_size/actorder null).
absl::Status Expect(const json& args, const std::string& source, const std::string& field,
                    const std::string& key, const json& want, const json& absent) {
  auto it = args.find(key);
  const json& got = it == args.end() ? absent : *it;
  if (got != want) {
    return Field(source, absl::StrCat(field, ".", key),
                 absl::StrCat("is ", got.dump(), "; this build supports ", want.dump(),
                              " here (FP8_DYNAMIC: float-quantized, W4A16: pack-quantized, NVFP4: "
                              "nvfp4-pack-quantized)"));
  }
  return absl::OkStatus();
}

bool MatchesEntry(const std::string& entry, const std::string& module) {
  if (entry == "Linear") return true;  // every module we ask about is an nn.Linear
  if (absl::StartsWith(entry, "re:")) {
    const std::regex re(entry.substr(3));
    return std::regex_search(module, re, std::regex_constants::match_continuous);
  }
  return entry == module;
}

// fnmatch(pattern, name) with '*' and '?' (no character classes: ModelOpt's exclude lists use
// none).
bool Glob(const char* p, const char* s) {
  const char* star = nullptr;
  const char* back = nullptr;
  while (*s != '\0') {
    if (*p == '*') {
      star = p++;
      back = s;
    } else if (*p == '?' || *p == *s) {
      ++p;
      ++s;
    } else if (star != nullptr) {
      p = star + 1;
      s = ++back;
    } else {
      return false;
    }
  }
  while (*p == '*') ++p;
  return *p == '\0';
}

bool MatchesGlob(const std::string& entry, const std::string& module) {
  return Glob(entry.c_str(), module.c_str()) || absl::StartsWith(module, entry + ".");
}

// ModelOpt's quantization fields: `qc` the quantization_config object (or hf_quant_config.json's
// root); `prefix` names the fields in errors.
absl::StatusOr<QuantizationConfig> ParseModelOpt(const json& root_qc, const std::string& source,
                                                 const std::string& prefix) {
  auto field = [&](const std::string& f, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field '", prefix, f, "' ", what));
  };
  const json* qc = &root_qc;
  std::string p;
  if (auto it = root_qc.find("quantization"); it != root_qc.end()) {
    if (!it->is_object()) return field("quantization", "must be an object");
    qc = &*it;
    p = "quantization.";
  }
  const json algo = qc->value("quant_algo", json());
  if (algo != "NVFP4") {
    return field(p + "quant_algo",
                 absl::StrCat("is ", algo.dump(),
                              "; this build loads ModelOpt checkpoints with quant_algo \"NVFP4\" "
                              "only"));
  }
  if (auto it = qc->find("group_size"); it != qc->end() && *it != 16) {
    return field(p + "group_size", absl::StrCat("is ", it->dump(), "; NVFP4 blocks are 16"));
  }
  if (auto it = qc->find("kv_cache_quant_algo"); it != qc->end() && !it->is_null()) {
    return field(p + "kv_cache_quant_algo",
                 absl::StrCat("is ", it->dump(), "; a quantized KV cache is not supported"));
  }
  QuantizationConfig q;
  q.format = WeightFormat::kNvfp4;
  q.group_size = 16;
  q.targets = {"Linear"};
  q.glob_ignore = true;
  for (const char* key : {"exclude_modules", "ignore"}) {
    auto it = qc->find(key);
    if (it == qc->end() || it->is_null()) continue;
    if (!it->is_array()) return field(p + key, "must be a list of strings");
    for (const json& e : *it) {
      if (!e.is_string()) return field(p + key, "must be a list of strings");
      q.ignore.push_back(e.get<std::string>());
    }
  }
  return q;
}

}  // namespace

const char* WeightFormatName(WeightFormat f) {
  switch (f) {
    case WeightFormat::kFp8:
      return "fp8";
    case WeightFormat::kW4A16:
      return "w4a16";
    case WeightFormat::kNvfp4: return "nvfp4";
    case WeightFormat::kBf16:
      break;
  }
  return "bf16";
}

const char* QuantizationName(const QuantizationConfig& q) {
  if (q.format == WeightFormat::kNvfp4 && q.nvfp4_weight_only) return "nvfp4a16";
  return WeightFormatName(q.format);
}

bool QuantizationConfig::Quantizes(const std::string& module) const {
  if (!quantized()) return false;
  for (const std::string& e : ignore) {
    if (glob_ignore ? MatchesGlob(e, module) : MatchesEntry(e, module)) return false;
  }
  for (const std::string& t : targets) {
    if (MatchesEntry(t, module)) return true;
  }
  return false;
}

absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const std::string& config_json,
                                                           const std::string& source) {
  QuantizationConfig q;
  const json root = json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON"));
  }
  auto qc_it = root.find("quantization_config");
  if (qc_it == root.end() || qc_it->is_null()) return q;
  const json& qc = *qc_it;
  if (!qc.is_object()) return Field(source, "", "must be an object");
  const json method = qc.value("quant_method", json());
  if (method == "modelopt") return ParseModelOpt(qc, source, "quantization_config.");
  if (method != "compressed-tensors") {
    return Field(source, "quant_method",
                 absl::StrCat("is ", method.dump(),
                              "; this build loads compressed-tensors checkpoints (FP8_DYNAMIC "
                              "float-quantized, W4A16 pack-quantized) and ModelOpt NVFP4 "
                              "(\"modelopt\")"));
  }
  const json format = qc.value("format", json());
  if (format == "float-quantized") {
    q.format = WeightFormat::kFp8;
  } else if (format == "pack-quantized") {
    q.format = WeightFormat::kW4A16;
  } else if (format == "nvfp4-pack-quantized") {
    q.format = WeightFormat::kNvfp4;
    q.nvfp4_compressed_tensors = true;
    q.group_size = 16;
  } else {
    return Field(source, "format",
                 absl::StrCat("is ", format.dump(),
                              "; supported: \"float-quantized\" (FP8), \"pack-quantized\" "
                              "(W4A16), \"nvfp4-pack-quantized\" (NVFP4 W4A4 or NVFP4A16)"));
  }
  if (auto it = qc.find("quantization_status"); it != qc.end() && *it != "compressed") {
    return Field(source, "quantization_status",
                 absl::StrCat("is ", it->dump(), "; only \"compressed\" checkpoints are loaded"));
  }
  if (auto it = qc.find("kv_cache_scheme"); it != qc.end() && !it->is_null()) {
    return Field(source, "kv_cache_scheme", "is set; a quantized KV cache is not supported");
  }
  auto strings = [&](const char* key, std::vector<std::string>* out) -> absl::Status {
    auto it = qc.find(key);
    if (it == qc.end() || it->is_null()) return absl::OkStatus();
    if (!it->is_array()) return Field(source, key, "must be a list of strings");
    for (const json& e : *it) {
      if (!e.is_string()) return Field(source, key, "must be a list of strings");
      out->push_back(e.get<std::string>());
    }
    return absl::OkStatus();
  };
  if (absl::Status st = strings("ignore", &q.ignore); !st.ok()) return st;
  const json groups = qc.value("config_groups", json());
  if (!groups.is_object() || groups.empty()) {
    return Field(source, "config_groups", "must be a non-empty object");
  }
  bool first_group = true;
  for (const auto& [name, g] : groups.items()) {
    const std::string f = absl::StrCat("config_groups.", name);
    if (!g.is_object()) return Field(source, f, "must be an object");
    const json targets = g.value("targets", json());
    if (!targets.is_array() || targets.empty()) {
      return Field(source, f + ".targets", "must be a non-empty list of strings");
    }
    for (const json& t : targets) {
      if (!t.is_string()) return Field(source, f + ".targets", "must be a list of strings");
      q.targets.push_back(t.get<std::string>());
    }
    const json w = g.value("weights", json());
    if (!w.is_object()) return Field(source, f + ".weights", "must be an object");
    const json a = g.value("input_activations", json());
    if (auto it = g.find("output_activations"); it != g.end() && !it->is_null()) {
      return Field(source, f + ".output_activations", "is set; not supported");
    }
    const std::string wf = f + ".weights", af = f + ".input_activations";
    const json null;
#define DG_EXPECT(args, field, key, want, absent) \
  if (absl::Status st = Expect(args, source, field, key, want, absent); !st.ok()) return st
    DG_EXPECT(w, wf, "symmetric", true, true);
    DG_EXPECT(w, wf, "dynamic", false, false);
    if (q.format == WeightFormat::kFp8) {
      DG_EXPECT(w, wf, "num_bits", 8, null);
      DG_EXPECT(w, wf, "type", "float", null);
      DG_EXPECT(w, wf, "strategy", "channel", null);
      if (!a.is_object()) {
        return Field(source, af, "must be the dynamic per-token FP8 scheme (FP8_DYNAMIC)");
      }
      DG_EXPECT(a, af, "num_bits", 8, null);
      DG_EXPECT(a, af, "type", "float", null);
      DG_EXPECT(a, af, "strategy", "token", null);
      DG_EXPECT(a, af, "dynamic", true, false);
      DG_EXPECT(a, af, "symmetric", true, true);
    } else if (q.format == WeightFormat::kNvfp4) {
      // compressed-tensors' NVFP4 preset (W4A4), as vLLM's _is_fp4a4_nvfp4 accepts it, or the
      // NVFP4A16 preset (input_activations null), as _is_fp4a16_nvfp4 does.
      DG_EXPECT(w, wf, "num_bits", 4, null);
      DG_EXPECT(w, wf, "type", "float", null);
      DG_EXPECT(w, wf, "strategy", "tensor_group", null);
      DG_EXPECT(w, wf, "group_size", 16, null);
      const bool weight_only = a.is_null();
      if (!first_group && weight_only != q.nvfp4_weight_only) {
        return Field(source, af,
                     "differs from an earlier group's (NVFP4 W4A4 and weight-only NVFP4A16 "
                     "groups mixed in one checkpoint are not supported)");
      }
      q.nvfp4_weight_only = weight_only;
      first_group = false;
      if (weight_only) continue;
      if (!a.is_object()) {
        return Field(source, af,
                     "must be the NVFP4 activation scheme (W4A4: num_bits 4, type float, strategy "
                     "tensor_group, group_size 16, dynamic \"local\") or null (weight-only "
                     "NVFP4A16)");
      }
      DG_EXPECT(a, af, "num_bits", 4, null);
      DG_EXPECT(a, af, "type", "float", null);
      DG_EXPECT(a, af, "strategy", "tensor_group", null);
      DG_EXPECT(a, af, "group_size", 16, null);
      DG_EXPECT(a, af, "symmetric", true, true);
      DG_EXPECT(a, af, "dynamic", "local", false);
    } else {
      DG_EXPECT(w, wf, "num_bits", 4, null);
      DG_EXPECT(w, wf, "type", "int", null);
      DG_EXPECT(w, wf, "actorder", null, null);
      if (!a.is_null()) return Field(source, af, "must be null for W4A16 (weight-only)");
      const json strategy = w.value("strategy", json());
      int gs = 0;
      bool channel = false;
      if (strategy == "group") {
        const json g_size = w.value("group_size", json());
        if (!g_size.is_number_integer() || g_size.get<int64_t>() < 1 ||
            g_size.get<int64_t>() > kMaxW4a16GroupSize) {
          return Field(source, wf + ".group_size",
                       absl::StrCat("must be a positive integer (at most ", kMaxW4a16GroupSize,
                                    ") for strategy group"));
        }
        gs = int(g_size.get<int64_t>());
      } else if (strategy == "channel") {
        channel = true;
      } else {
        return Field(source, wf + ".strategy",
                     absl::StrCat("is ", strategy.dump(), "; W4A16 supports group and channel"));
      }
      if (q.group_size != 0 || q.channel_groups) {
        if (gs != q.group_size || channel != q.channel_groups) {
          return Field(source, f, "uses another group size than an earlier group (not supported)");
        }
      }
      q.group_size = gs;
      q.channel_groups = channel;
    }
#undef DG_EXPECT
  }
  for (const std::vector<std::string>* list : {&q.targets, &q.ignore}) {
    for (const std::string& e : *list) {
      if (!absl::StartsWith(e, "re:")) continue;
      try {
        std::regex re(e.substr(3));
      } catch (const std::regex_error&) {
        return Field(source, list == &q.targets ? "targets" : "ignore",
                     absl::StrCat("holds an invalid regular expression: ", e));
      }
    }
  }
  return q;
}

absl::Status CheckModulePatterns(const std::vector<std::string>& patterns,
                                 const std::string& what) {
  for (const std::string& e : patterns) {
    if (!absl::StartsWith(e, "re:")) continue;
    try {
      std::regex re(e.substr(3));
    } catch (const std::regex_error& error) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " entry '", e, "' is not a valid regular expression (ECMAScript): ", error.what()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<QuantizationConfig> ParseHfQuantConfig(const std::string& text,
                                                      const std::string& source) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": malformed JSON"));
  }
  if (!root.contains("quantization")) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": field 'quantization' is missing"));
  }
  return ParseModelOpt(root, source, "");
}

std::string HfQuantConfigJson(const QuantizationConfig& q) {
  json root = {{"producer", {{"name", "dgserve-quantize"}, {"version", "1"}}},
               {"quantization",
                {{"quant_algo", "NVFP4"},
                 {"kv_cache_quant_algo", nullptr},
                 {"group_size", 16},
                 {"exclude_modules", q.ignore}}}};
  return root.dump(2);
}

std::string QuantizationConfigJson(const QuantizationConfig& q) {
  if (q.format == WeightFormat::kNvfp4 && q.nvfp4_compressed_tensors) {
    // compressed-tensors' NVFP4 preset (quant_config.h); `ignore` entries are its syntax.
    json fp4 = {{"num_bits", 4},
                {"type", "float"},
                {"symmetric", true},
                {"strategy", "tensor_group"},
                {"group_size", 16},
                {"block_structure", nullptr},
                {"actorder", nullptr},
                {"observer", "minmax"},
                {"observer_kwargs", json::object()}};
    json weights = fp4, acts = fp4;
    weights["dynamic"] = false;
    acts["dynamic"] = "local";
    if (q.nvfp4_weight_only) acts = nullptr;  // the NVFP4A16 preset: no activation scheme
    json group = {{"targets", q.targets},
                  {"weights", weights},
                  {"input_activations", acts},
                  {"output_activations", nullptr}};
    json qc = {{"quant_method", "compressed-tensors"}, {"format", "nvfp4-pack-quantized"},
               {"quantization_status", "compressed"},  {"global_compression_ratio", nullptr},
               {"kv_cache_scheme", nullptr},           {"ignore", q.ignore},
               {"config_groups", {{"group_0", group}}}};
    return qc.dump(2);
  }
  if (q.format == WeightFormat::kNvfp4) {
    json qc = {{"quant_method", "modelopt"},
               {"quant_algo", "NVFP4"},
               {"kv_cache_quant_algo", nullptr},
               {"group_size", 16},
               {"exclude_modules", q.ignore},
               {"producer", {{"name", "dgserve-quantize"}, {"version", "1"}}}};
    return qc.dump(2);
  }
  json weights, acts;
  if (q.format == WeightFormat::kFp8) {
    weights = {{"num_bits", 8},          {"type", "float"},  {"symmetric", true},
               {"strategy", "channel"},  {"dynamic", false}, {"group_size", nullptr},
               {"block_structure", nullptr}, {"actorder", nullptr}, {"observer", "minmax"},
               {"observer_kwargs", json::object()}};
    acts = {{"num_bits", 8},       {"type", "float"}, {"symmetric", true},
            {"strategy", "token"}, {"dynamic", true}, {"group_size", nullptr},
            {"block_structure", nullptr}, {"actorder", nullptr}, {"observer", nullptr},
            {"observer_kwargs", json::object()}};
  } else {
    weights = {{"num_bits", 4},
               {"type", "int"},
               {"symmetric", true},
               {"strategy", q.channel_groups ? "channel" : "group"},
               {"dynamic", false},
               {"block_structure", nullptr},
               {"actorder", nullptr},
               {"observer", "minmax"},
               {"observer_kwargs", json::object()}};
    weights["group_size"] = q.channel_groups ? json() : json(q.group_size);
    acts = nullptr;
  }
  json group = {{"targets", q.targets},
                {"weights", weights},
                {"input_activations", acts},
                {"output_activations", nullptr}};
  json qc = {{"quant_method", "compressed-tensors"},
             {"format", q.format == WeightFormat::kFp8 ? "float-quantized" : "pack-quantized"},
             {"quantization_status", "compressed"},
             {"global_compression_ratio", nullptr},
             {"kv_cache_scheme", nullptr},
             {"ignore", q.ignore},
             {"config_groups", {{"group_0", group}}}};
  return qc.dump(2);
}

bool IgnoreEntryMatches(const std::string& entry, const std::string& module) {
  return entry != "Linear" && MatchesEntry(entry, module);
}

}  // namespace dgserve
