// CheckQuantizePaths: --out inside --in is refused by any path (relative, "..", symlinks);
// --in inside --out is allowed and the quantization leaves --in as it was.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

class QuantizePathsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::path(::dgserve::testing::MakeTempDir("quantize_paths"));
    in_ = base_ / "m";
    fs::create_directories(in_ / "sub");
  }
  // `p` relative to the working directory (a path with ".." components when it is elsewhere).
  static std::string Relative(const fs::path& p) { return fs::relative(p).string(); }

  fs::path base_, in_;
};

TEST_F(QuantizePathsTest, OutInsideInIsRefusedByAnyPath) {
  fs::create_symlink(in_, base_ / "link");
  fs::create_directories(base_ / "other");
  const std::string in = in_.string();
  const std::map<std::string, std::string> outs = {
      {"absolute", (in_ / "q").string()},
      {"deep, missing", (in_ / "a" / "b" / "c").string()},
      {"existing", (in_ / "sub").string()},
      {"trailing slash", (in_ / "q").string() + "/"},
      {"relative", Relative(in_ / "q")},
      {"through ..", (base_ / "other" / ".." / "m" / "q").string()},
      {"through a missing ..", (in_ / "x" / ".." / "q").string()},
      {"through a symlink", (base_ / "link" / "q").string()},
  };
  for (const auto& [what, out] : outs) {
    EXPECT_THAT(CheckQuantizePaths(in, out),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("--out " + out + " is inside --in " + in),
                               HasSubstr("would be written into its source"))))
        << what;
  }
  // --in named through the symlink, relatively or with a trailing slash: the same.
  EXPECT_THAT(CheckQuantizePaths((base_ / "link").string(), (in_ / "q").string()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is inside --in")));
  EXPECT_THAT(CheckQuantizePaths(Relative(in_), (in_ / "q").string()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is inside --in")));
  EXPECT_THAT(CheckQuantizePaths(in + "/", (in_ / "q").string()),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("is inside --in")));
  // Nothing was created.
  EXPECT_FALSE(fs::exists(in_ / "q"));
  EXPECT_FALSE(fs::exists(in_ / "a"));
}

// An --out whose path cannot be resolved (a symlink loop) is refused naming it: the inside-in
// check was skipped and the run failed only when --out was created, after any calibration.
TEST_F(QuantizePathsTest, AnOutThatCannotBeResolvedIsRefused) {
  fs::create_symlink(base_ / "loop2", base_ / "loop1");
  fs::create_symlink(base_ / "loop1", base_ / "loop2");
  const std::string out = (base_ / "loop1" / "x").string();
  EXPECT_THAT(CheckQuantizePaths(in_.string(), out),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--out " + out + ": cannot resolve the path")));
}

// An --out through a dangling symlink (the link itself, or a directory below it) is refused
// naming the link and its target: the walk to the nearest existing parent followed the link,
// found nothing, went on to the writable directory above, and the run failed as INTERNAL
// ("cannot create ...: File exists") only when writing, after any calibration.
TEST_F(QuantizePathsTest, AnOutThroughADanglingSymlinkIsRefused) {
  fs::create_symlink(base_ / "nowhere", base_ / "dangling");
  for (const fs::path& out : {base_ / "dangling", base_ / "dangling" / "q"}) {
    EXPECT_THAT(CheckQuantizePaths(in_.string(), out.string()),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("--out " + out.string() + ": "),
                               HasSubstr("is a symbolic link to " + (base_ / "nowhere").string() +
                                         ", which does not exist"))))
        << out;
  }
  // A link to an existing directory is a directory.
  fs::create_directories(base_ / "there");
  fs::create_symlink(base_ / "there", base_ / "alive");
  EXPECT_THAT(CheckQuantizePaths(in_.string(), (base_ / "alive" / "q").string()), IsOk());
}

TEST_F(QuantizePathsTest, OutBesideOrAboveInIsAllowed) {
  const std::string in = in_.string();
  // A sibling whose name starts with --in's (not inside it: compared by directory, not text).
  EXPECT_THAT(CheckQuantizePaths(in, (base_ / "m2").string()), IsOk());
  EXPECT_THAT(CheckQuantizePaths(in, (base_ / "m_q").string()), IsOk());
  // ".." out of --in.
  EXPECT_THAT(CheckQuantizePaths(in, (in_ / ".." / "q").string()), IsOk());
  // --in's parent.
  EXPECT_THAT(CheckQuantizePaths(in, base_.string()), IsOk());
  // --out equal to --in keeps its own message.
  EXPECT_THAT(CheckQuantizePaths(in, in + "/"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--out must differ from --in: " + in + "/"),
                             HasSubstr("give a new directory for the quantized checkpoint"))));
}

std::map<std::string, std::string> DirContents(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream f(e.path(), std::ios::binary);
    std::stringstream bytes;
    bytes << f.rdbuf();
    files[fs::relative(e.path(), dir).string()] = bytes.str();
  }
  return files;
}

// --in inside --out: the checkpoint is written into --out, --in's files are left as they were.
TEST_F(QuantizePathsTest, InInsideOutIsQuantizedLeavingInUnchanged) {
  const fs::path in = base_ / "parent" / "bf16";
  ASSERT_THAT(
      WriteRandomCheckpoint(::dgserve::testing::TinyConfig(), GenerationConfig{}, 7, in.string()),
      IsOk());
  const std::map<std::string, std::string> before = DirContents(in);
  ASSERT_TRUE(before.count("model.safetensors") && before.count("config.json"));
  QuantizeOptions options;
  options.progress = false;
  const absl::StatusOr<QuantizeSummary> summary =
      QuantizeCheckpoint(in.string(), (base_ / "parent").string(), options);
  ASSERT_THAT(summary.status(), IsOk());
  EXPECT_GT(summary->quantized, 0);
  EXPECT_EQ(DirContents(in), before);
  std::ifstream config(base_ / "parent" / "config.json");
  std::stringstream text;
  text << config.rdbuf();
  EXPECT_THAT(text.str(), HasSubstr("\"quantization_config\""));
  EXPECT_TRUE(fs::exists(base_ / "parent" / "model.safetensors"));
}

// TinyConfig's tensors as headers only (names and shapes, no data), and with an encoder alias:
// the decoder tensors of layer 0's attention also under model.encoder.language_model.
std::vector<TensorView> TinyHeaders(bool encoder_alias) {
  std::vector<TensorView> out;
  for (const TensorSpec& s : ExpectedTensors(::dgserve::testing::TinyConfig())) {
    TensorView v;
    v.name = s.name;
    v.shape = s.shape;
    out.push_back(v);
    if (encoder_alias && s.name.starts_with("model.decoder.layers.0.self_attn.")) {
      v.name = "model.encoder.language_model." + s.name.substr(14);
      out.push_back(v);
    }
  }
  return out;
}

// `ignore` for --format `format` (nvfp4: in `layout`).
QuantizeOptions Ignoring(std::vector<std::string> ignore, WeightFormat format = WeightFormat::kFp8,
                         Nvfp4Layout layout = Nvfp4Layout::kModelOpt) {
  QuantizeOptions o;
  o.format = format;
  o.nvfp4_layout = layout;
  o.ignore = std::move(ignore);
  o.progress = false;
  return o;
}

TEST(CheckIgnoreListTest, ModulesAreTheLinearOnesWithExpertsUnfused) {
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  const std::vector<std::string> modules = QuantizableModules(c, TinyHeaders(true));
  auto has = [&](const std::string& m) {
    return std::find(modules.begin(), modules.end(), m) != modules.end();
  };
  EXPECT_TRUE(has("model.decoder.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(has("model.encoder.language_model.layers.0.self_attn.q_proj"));
  EXPECT_TRUE(has("model.decoder.layers.1.experts.3.gate_proj"));
  EXPECT_TRUE(has("model.decoder.layers.1.experts.3.up_proj"));
  EXPECT_TRUE(has("model.decoder.layers.1.experts.3.down_proj"));
  EXPECT_FALSE(has("model.decoder.layers.1.experts.4.gate_proj"));  // 4 experts
  EXPECT_FALSE(has("model.decoder.embed_tokens"));
  EXPECT_FALSE(has("model.decoder.layers.0.input_layernorm"));
  EXPECT_EQ(QuantizeDecoderModuleName("model.encoder.language_model.layers.2.mlp.up_proj"),
            "model.decoder.layers.2.mlp.up_proj");
  EXPECT_EQ(QuantizeDecoderModuleName("model.decoder.layers.2.mlp.up_proj"),
            "model.decoder.layers.2.mlp.up_proj");
}

// The ignore lists the writer refuses, found from the headers alone.
TEST(CheckIgnoreListTest, RefusesWhatTheWriterWouldRefuse) {
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  const std::vector<TensorView> plain = TinyHeaders(false), alias = TinyHeaders(true);
  std::vector<std::string> ignore = DefaultQuantizeIgnore();
  EXPECT_THAT(CheckIgnoreList(c, alias, Ignoring(ignore), true), IsOk());
  // One of an expert's gate and up only, in either order and by any entry.
  for (const std::string proj : {"gate_proj", "up_proj"}) {
    ignore = DefaultQuantizeIgnore();
    ignore.push_back("model.decoder.layers.1.experts.2." + proj);
    EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring(ignore), false),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the ignore list quantizes one of "
                                   "model.decoder.layers.1.experts.2.gate_proj and "
                                   "model.decoder.layers.1.experts.2.up_proj only: an expert's "
                                   "gate and up are one matrix, both quantized or both kept")));
  }
  ignore = DefaultQuantizeIgnore();
  ignore.push_back("re:.*experts[.]2[.](gate|up)_proj$");  // both: allowed
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring(ignore), false), IsOk());
  // An encoder alias kept and its decoder module quantized: refused layer by layer only.
  ignore = DefaultQuantizeIgnore();
  ignore.push_back("re:model[.]encoder[.].*k_proj$");
  EXPECT_THAT(CheckIgnoreList(c, alias, Ignoring(ignore), false), IsOk());
  EXPECT_THAT(CheckIgnoreList(c, alias, Ignoring(ignore), true),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the ignore list treats "
                                 "model.encoder.language_model.layers.0.self_attn.k_proj and its "
                                 "decoder module model.decoder.layers.0.self_attn.k_proj "
                                 "differently: layer-by-layer GPTQ needs both quantized")));
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring(ignore), true),
              IsOk());  // no alias in the checkpoint
  // Nothing left to quantize, for any caller.
  for (const std::vector<std::string>& all :
       {std::vector<std::string>{"re:.*"}, {"re:.*proj.*", "lm_head", "re:.*router.*"}}) {
    for (bool layer_by_layer : {false, true}) {
      EXPECT_THAT(CheckIgnoreList(c, alias, Ignoring(all), layer_by_layer),
                  StatusIs(absl::StatusCode::kInvalidArgument,
                           AllOf(HasSubstr("the ignore list '" + all[0]),
                                 HasSubstr("' leaves no module to quantize"))));
    }
  }
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring({"re:(["}), false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'re:([' is not a valid regular expression (ECMAScript): ")));
}

// The self-conditioning MLP runs from a canvas's second denoising step on: a one-step amax
// calibration never observes it, so NVFP4 W4A4 (whose static input scale needs its amax) refuses
// a list that quantizes it before calibrating (it failed after the calibration).
TEST(CheckIgnoreListTest, RefusesSelfConditioningAOneStepCalibrationNeverObserves) {
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  const std::vector<TensorView> plain = TinyHeaders(false);
  const std::vector<std::string> no_sc = {"lm_head", "re:.*embed_tokens.*", "re:.*router.*",
                                          "re:.*norm.*"};
  for (Nvfp4Layout layout : {Nvfp4Layout::kModelOpt, Nvfp4Layout::kCompressedTensors}) {
    const QuantizeOptions o = Ignoring(no_sc, WeightFormat::kNvfp4, layout);
    EXPECT_THAT(CheckIgnoreList(c, plain, o, false, /*amax_calibration_steps=*/1),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("the ignore list quantizes "
                                         "model.decoder.self_conditioning."),
                               HasSubstr(", whose input a calibration of 1 denoising step per "
                                         "canvas never observes"),
                               HasSubstr("add re:.*self_conditioning.* to --ignore"))));
    // Two steps observe it; no calibration (0) needs no amax; the default list keeps it.
    EXPECT_THAT(CheckIgnoreList(c, plain, o, false, 2), IsOk());
    EXPECT_THAT(CheckIgnoreList(c, plain, o, false, 0), IsOk());
    EXPECT_THAT(
        CheckIgnoreList(c, plain, Ignoring(DefaultQuantizeIgnore(), WeightFormat::kNvfp4, layout),
                        false, 1),
        IsOk());
  }
  // Formats without a static activation scale need no amax.
  QuantizeOptions weight_only =
      Ignoring(no_sc, WeightFormat::kNvfp4, Nvfp4Layout::kCompressedTensors);
  weight_only.nvfp4_activations = Nvfp4Activations::kNone;
  EXPECT_THAT(CheckIgnoreList(c, plain, weight_only, false, 1), IsOk());
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring(no_sc, WeightFormat::kW4A16), false, 1), IsOk());
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring(no_sc, WeightFormat::kFp8), false, 1), IsOk());
}

// --format nvfp4 in the ModelOpt layout writes fnmatch patterns (exclude_modules), which the
// loader matches by fnmatch or as a module prefix: the list is checked as so matched.
TEST(CheckIgnoreListTest, ModelOptLayoutMatchesAsTheWrittenPatterns) {
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  const std::vector<TensorView> plain = TinyHeaders(false);
  auto modelopt = [](std::vector<std::string> ignore) {
    return Ignoring(std::move(ignore), WeightFormat::kNvfp4, Nvfp4Layout::kModelOpt);
  };
  auto ct = [](std::vector<std::string> ignore) {
    return Ignoring(std::move(ignore), WeightFormat::kNvfp4, Nvfp4Layout::kCompressedTensors);
  };
  EXPECT_THAT(CheckIgnoreList(c, plain, modelopt(DefaultQuantizeIgnore()), false), IsOk());
  // A pattern that keeps one of an expert's gate and up (a plain name elsewhere: no module).
  for (const std::string& e :
       {std::string("*experts.2.gate_proj"), std::string("re:.*experts\\.2\\.up_proj")}) {
    EXPECT_THAT(CheckIgnoreList(c, plain, modelopt({e}), false),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         AllOf(HasSubstr("the ignore list quantizes one of model.decoder."),
                               HasSubstr("experts.2.up_proj only: an expert's gate and up"))))
        << e;
  }
  EXPECT_THAT(CheckIgnoreList(c, plain, ct({"*experts.2.gate_proj"}), false), IsOk());
  EXPECT_THAT(CheckIgnoreList(c, plain, modelopt({"*experts.2.*_proj"}), false), IsOk());
  // Every module, by a pattern or by a prefix.
  for (const std::string& e : {"*", "model", "model.decoder", "re:.*"}) {
    EXPECT_THAT(CheckIgnoreList(c, plain, modelopt({e}), true),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the ignore list '" + e + "' leaves no module to quantize")))
        << e;
  }
  EXPECT_THAT(CheckIgnoreList(c, plain, ct({"model"}), false), IsOk());  // an exact name there
  // "Linear" is every module in compressed-tensors' list, no module as a ModelOpt pattern.
  EXPECT_THAT(CheckIgnoreList(c, plain, modelopt({"Linear"}), false), IsOk());
  EXPECT_THAT(CheckIgnoreList(c, plain, ct({"Linear"}), false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leaves no module")));
  EXPECT_THAT(CheckIgnoreList(c, plain, Ignoring({"Linear"}), false),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("leaves no module")));
  // An entry with no pattern: ModelOptIgnoreGlob's refusal.
  EXPECT_THAT(CheckIgnoreList(c, plain, modelopt({"re:.*experts[.][0-9]+[.]down_proj$"}), false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("is not of the form re:.*NAME.*, re:NAME or a module name")));
  const absl::StatusOr<std::vector<std::string>> globs =
      WrittenIgnoreList(modelopt({"lm_head", "re:.*norm.*", "re:model\\.x"}));
  ASSERT_THAT(globs, IsOk());
  EXPECT_THAT(*globs, ElementsAre("lm_head", "*norm*", "model.x*"));
  const absl::StatusOr<std::vector<std::string>> entries =
      WrittenIgnoreList(ct({"lm_head", "re:.*norm.*"}));
  ASSERT_THAT(entries, IsOk());
  EXPECT_THAT(*entries, ElementsAre("lm_head", "re:.*norm.*"));
}

// The entries that name no module, found from the headers (dgserve-quantize warns of them
// before calibrating), matched as written: a plain name is a ModelOpt glob, and a norm (no
// Linear module) is a module too.
TEST(CheckIgnoreListTest, UnmatchedEntriesAreFoundFromTheHeaders) {
  const ModelConfig c = ::dgserve::testing::TinyConfig();
  const std::vector<TensorView> plain = TinyHeaders(false);
  const std::vector<std::string> ignore = {"re:.*norm.*", "*experts.1.*", "nosuch", "re:.*typo.*",
                                           "model.decoder.layers.0.input_layernorm"};
  const absl::StatusOr<std::vector<std::string>> ct = UnmatchedIgnoreEntries(
      c, plain, Ignoring(ignore, WeightFormat::kNvfp4, Nvfp4Layout::kCompressedTensors));
  ASSERT_THAT(ct, IsOk());
  EXPECT_THAT(*ct, ElementsAre("*experts.1.*", "nosuch", "re:.*typo.*"));
  const absl::StatusOr<std::vector<std::string>> modelopt = UnmatchedIgnoreEntries(
      c, plain, Ignoring(ignore, WeightFormat::kNvfp4, Nvfp4Layout::kModelOpt));
  ASSERT_THAT(modelopt, IsOk());
  EXPECT_THAT(*modelopt, ElementsAre("nosuch", "re:.*typo.*"));
  // A character class: fnmatch (ModelOpt, vLLM) reads it, the loader's Glob does not.
  EXPECT_THAT(ModelOptIgnoreGlob("*experts.[0-3].*").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("'*experts.[0-3].*' has a character class")));
  EXPECT_EQ(ModelOptIgnoreGlob("*experts.1?.*").value_or(""), "*experts.1?.*");
  // A name whose dots a regex would read as any character: told to escape them or give a glob.
  EXPECT_THAT(ModelOptIgnoreGlob("re:.*experts.0.down_proj.*").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("escape the dots (re:.*experts\\.0\\.down_proj.*) or give a "
                                 "glob (*experts.0.down_proj*)")));
}

// --in must be a checkpoint directory: a missing path, a file in one, a directory without
// config.json are refused naming --in.
TEST_F(QuantizePathsTest, InMustBeACheckpointDirectory) {
  EXPECT_THAT(CheckQuantizeInput((base_ / "nosuch").string()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("--in " + (base_ / "nosuch").string() +
                                 ": not a checkpoint directory (no such directory")));
  EXPECT_THAT(CheckQuantizeInput(in_.string()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "--in " + in_.string() + ": not a checkpoint directory (no config.json)"));
  std::ofstream(in_ / "model.safetensors") << "x";
  EXPECT_THAT(CheckQuantizeInput((in_ / "model.safetensors").string()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("a file, not a checkpoint directory; give the directory that "
                                 "holds config.json and the safetensors (" +
                                 in_.string())));
  std::ofstream(in_ / "config.json") << "{}";
  EXPECT_THAT(CheckQuantizeInput(in_.string()), IsOk());
}

// QuantizeCheckpoint refuses the same before writing anything; the directory form reads the
// headers of a checkpoint on disk.
TEST_F(QuantizePathsTest, QuantizeCheckpointRefusesAnIgnoreListThatLeavesNothing) {
  ASSERT_THAT(
      WriteRandomCheckpoint(::dgserve::testing::TinyConfig(), GenerationConfig{}, 7, in_.string()),
      IsOk());
  QuantizeOptions options;
  options.progress = false;
  options.ignore = {"re:.*"};
  EXPECT_THAT(CheckIgnoreList(in_.string(), options, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("the ignore list 're:.*' leaves no module to quantize")));
  for (WeightFormat f : {WeightFormat::kFp8, WeightFormat::kW4A16, WeightFormat::kNvfp4}) {
    options.format = f;
    EXPECT_THAT(QuantizeCheckpoint(in_.string(), (base_ / "out").string(), options).status(),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("the ignore list 're:.*' leaves no module to quantize")));
    EXPECT_FALSE(fs::exists(base_ / "out"));
  }
  options.format = WeightFormat::kFp8;
  options.ignore = {"model.decoder.layers.0.experts.1.up_proj"};
  EXPECT_THAT(QuantizeCheckpoint(in_.string(), (base_ / "out").string(), options).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("quantizes one of model.decoder.layers.0.experts.1.gate_proj")));
  EXPECT_FALSE(fs::exists(base_ / "out"));
  EXPECT_THAT(CheckIgnoreList((base_ / "missing").string(), options, false),
              StatusIs(absl::StatusCode::kNotFound));
}

// The ModelOpt layout's writer and check agree: a pattern that splits an expert's gate and up or
// keeps every module is refused with nothing written; "Linear" (no module as a pattern) writes
// what an empty list writes and is reported as naming no module; a pattern that matches is not.
TEST_F(QuantizePathsTest, QuantizeCheckpointModelOptPatterns) {
  ASSERT_THAT(
      WriteRandomCheckpoint(::dgserve::testing::TinyConfig(), GenerationConfig{}, 7, in_.string()),
      IsOk());
  QuantizeOptions options;
  options.progress = false;
  options.format = WeightFormat::kNvfp4;
  for (const std::string& e : {"*experts.1.gate_proj", "*", "model"}) {
    options.ignore = {e};
    EXPECT_THAT(QuantizeCheckpoint(in_.string(), (base_ / "out").string(), options).status(),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("the ignore list ")))
        << e;
    EXPECT_FALSE(fs::exists(base_ / "out")) << e;
  }
  options.ignore = {};
  const absl::StatusOr<QuantizeSummary> none =
      QuantizeCheckpoint(in_.string(), (base_ / "none").string(), options);
  ASSERT_THAT(none, IsOk());
  options.ignore = {"Linear", "*experts.1.*"};
  const absl::StatusOr<QuantizeSummary> linear =
      QuantizeCheckpoint(in_.string(), (base_ / "linear").string(), options);
  ASSERT_THAT(linear, IsOk());
  EXPECT_GT(none->quantized, 0);
  EXPECT_EQ(linear->quantized + linear->kept, none->quantized + none->kept);
  EXPECT_LT(linear->quantized, none->quantized);  // expert 1's modules kept
  EXPECT_THAT(linear->unmatched_ignore, ElementsAre("Linear"));
}

}  // namespace
}  // namespace dgserve
