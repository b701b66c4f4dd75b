// CheckQuantizePaths: --out inside --in is refused by any path (relative, "..", symlinks);
// --in inside --out is allowed and the quantization leaves --in as it was.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "common/testing/status_matchers.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/quantize_checkpoint.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using ::testing::AllOf;
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
              StatusIs(absl::StatusCode::kInvalidArgument, "--out must differ from --in"));
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

}  // namespace
}  // namespace dgserve
