// Integration tests of canvas templates (infilling) on the real three-process cluster serving
// the Sudoku model (models/sudoku: canvas 91 = 9 lines of 9 digits + "\n", then <eos>): the
// givens as a template stay fixed and every blank becomes a digit, over gRPC and the OpenAI
// HTTP API; a template without holes is the answer with no denoising step; parallel samples of
// a templated request equal their solo requests; bad templates get INVALID_ARGUMENT / 400
// naming the field (label `integration`).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <sys/wait.h>
#include <sstream>
#include <string>
#include <vector>


#include "absl/strings/str_cat.h"
#include "common/http_client.h"
#include "common/status_convert.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/test_cluster.h"
#include "tests/integration/test_helpers.h"

namespace dgserve::testing {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

// A test-split puzzle (34 givens) and its solution, as 9 lines of 9 characters + "\n".
constexpr char kPuzzle[] =
    "1.7..39.863...1....84.7.6..2.3.8...5.6.5.21....51..28..9862...15.6.......2.7...4.";
constexpr char kSolution[] =
    "157463928632891574984275613213987465869542137475136289798624351546318792321759846";
constexpr int32_t kDigitOne = 110;  // "1" in the Sudoku vocabulary; "9" is 118
constexpr int32_t kNewline = 107;

std::string Rows(const std::string& cells) {
  std::string out;
  for (int r = 0; r < 9; ++r) out += cells.substr(r * 9, 9) + "\n";
  return out;
}

v1::GenerateRequest SudokuRequest(uint64_t seed) {
  v1::GenerateRequest r;
  r.set_text(Rows(kPuzzle));
  r.set_max_tokens(91);
  r.set_seed(seed);
  v1::CanvasTemplate* t = r.mutable_canvas_template();
  t->set_text(Rows(kPuzzle) + "<eos>");
  t->set_hole(".");
  for (char d = '1'; d <= '9'; ++d) t->add_allowed(std::string(1, d));
  return r;
}

// The answer keeps every given and the layout, and every blank is a digit 1-9.
void ExpectTemplateKept(const std::string& text) {
  ASSERT_EQ(text.size(), 90u) << text;
  for (int r = 0; r < 9; ++r) {
    EXPECT_EQ(text[r * 10 + 9], '\n') << text;
    for (int c = 0; c < 9; ++c) {
      const char given = kPuzzle[r * 9 + c], got = text[r * 10 + c];
      if (given != '.') {
        EXPECT_EQ(got, given) << "cell " << r << "," << c << " of\n" << text;
      } else {
        EXPECT_TRUE(got >= '1' && got <= '9') << "cell " << r << "," << c << " of\n" << text;
      }
    }
  }
}

class InfillingTest : public SharedClusterTest<InfillingTest> {
 public:
  static absl::StatusOr<ClusterOptions> Options() {
    ClusterOptions o;
    o.model_dir = std::string(DGSERVE_SOURCE_DIR_PATH) + "/models/sudoku";
    return o;
  }

 protected:
  Result Generate(const v1::GenerateRequest& req) { return testing::Generate(c(), req); }
  HttpResponse Post(const std::string& path, const json& body) {
    HttpClient http("127.0.0.1", cluster_->gateway().http_port);
    http.set_idle_timeout(absl::Seconds(120));
    return http.Post(path, body.dump());
  }
};

TEST_F(InfillingTest, GivensStayFixedAndBlanksBecomeDigitsOverGrpc) {
  for (uint64_t seed : {1u, 2u, 3u}) {
    Result r = Generate(SudokuRequest(seed));
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    SCOPED_TRACE(absl::StrCat("seed ", seed));
    ExpectTemplateKept(r.response.text());
    EXPECT_EQ(r.response.finish_reason(), "stop");  // the fixed <eos>
    EXPECT_GT(r.response.usage().denoising_steps(), 0);
  }
  // Without the template the same request may write anything anywhere; with it the answer is
  // a pure function of the seed as always.
  EXPECT_EQ(Generate(SudokuRequest(7)).response.text(), Generate(SudokuRequest(7)).response.text());
}

TEST_F(InfillingTest, TheTokenFormWorksAsTheTextForm) {
  // The same template as explicit token ids: givens and "\n" fixed, -1 at blanks restricted to
  // 1-9 by `holes`, <eos> (id 1) last.
  v1::GenerateRequest req = SudokuRequest(5);
  const std::string text_form = Generate(req).response.text();
  v1::CanvasTemplate t;
  for (int r = 0; r < 9; ++r) {
    for (int c = 0; c < 9; ++c) {
      const char g = kPuzzle[r * 9 + c];
      t.add_token_ids(g == '.' ? -1 : kDigitOne + (g - '1'));
      if (g == '.') {
        v1::TemplateHole* h = t.add_holes();
        h->set_position(r * 10 + c);
        for (int d = 0; d < 9; ++d) h->add_allowed_token_ids(kDigitOne + d);
      }
    }
    t.add_token_ids(kNewline);
  }
  t.add_token_ids(1);
  *req.mutable_canvas_template() = t;
  Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.response.text(), text_form);
}

TEST_F(InfillingTest, ATemplateWithoutHolesIsTheAnswerWithNoStep) {
  v1::GenerateRequest req = SudokuRequest(1);
  req.mutable_canvas_template()->set_text(Rows(kSolution) + "<eos>");
  Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  EXPECT_EQ(r.response.text(), Rows(kSolution));
  EXPECT_EQ(r.response.usage().denoising_steps(), 0);
  EXPECT_EQ(r.response.finish_reason(), "stop");
}

TEST_F(InfillingTest, SamplesOfATemplatedRequestEqualTheirSoloRequests) {
  v1::GenerateRequest req = SudokuRequest(20);
  req.set_n(3);
  Result r = Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status.error_message();
  ASSERT_EQ(r.response.choices_size(), 3);
  for (int i = 0; i < 3; ++i) {
    Result solo = Generate(SudokuRequest(20 + i));
    ASSERT_TRUE(solo.status.ok());
    EXPECT_EQ(r.response.choices(i).text(), solo.response.text()) << "sample " << i;
    ExpectTemplateKept(r.response.choices(i).text());
  }
}

TEST_F(InfillingTest, OpenAiCompletionsTakeTheTemplate) {
  const json body = {{"prompt", Rows(kPuzzle)},
                     {"max_tokens", 91},
                     {"seed", 1},
                     {"canvas_template",
                      {{"text", Rows(kPuzzle) + "<eos>"},
                       {"hole", "."},
                       {"allowed", {"1", "2", "3", "4", "5", "6", "7", "8", "9"}}}}};
  auto res = Post("/v1/completions", body);
  ASSERT_TRUE(res) << res.error;
  ASSERT_EQ(res.status, 200) << res.body;
  const json j = json::parse(res.body);
  const std::string text = j["choices"][0]["text"].get<std::string>();
  ExpectTemplateKept(text);
  // The same request over gRPC gives the same answer.
  EXPECT_EQ(text, Generate(SudokuRequest(1)).response.text());
}

TEST_F(InfillingTest, BadTemplatesAreRejectedNamingTheField) {
  struct Case {
    const char* what;
    json tmpl;
    const char* message;
  };
  const std::string long_text(92, '1');
  const Case cases[] = {
      {"longer than the canvas", {{"text", long_text}}, "longer than the canvas"},
      {"unknown token id", {{"token_ids", {1, 128}}}, "token_ids[1]: 128"},
      {"empty allowed set",
       {{"token_ids", {-1}}, {"holes", {{{"position", 0}, {"allowed_token_ids", json::array()}}}}},
       "allowed_token_ids"},
      {"hole on a fixed position",
       {{"token_ids", {110, 111}}, {"holes", {{{"position", 1}, {"allowed_token_ids", {110}}}}}},
       "is fixed"},
      {"allowed entry of two tokens", {{"text", "1.2"}, {"hole", "."}, {"allowed", {"12"}}},
       "exactly one token"},
      {"both forms", {{"text", "1.2"}, {"token_ids", {110}}}, "either text"},
      {"unknown key", {{"text", "1"}, {"fill", true}}, "canvas_template.fill"},
      {"not an object", "1.2", "must be an object"},
      {"allowed entry outside the vocabulary", {{"text", "1_"}, {"allowed", {"\u00e9"}}},
       "not in the model's vocabulary"},
      {"text outside the vocabulary", {{"text", "a_b"}}, "outside the model's vocabulary"},
      // null is absent inside a hole too (it was "must be an integer").
      {"null position", {{"token_ids", {-1}}, {"holes", {{{"position", nullptr},
                                                           {"allowed_token_ids", {110}}}}}},
       "canvas_template.holes[0].position: required"},
      {"allowed id outside the vocabulary",
       {{"token_ids", {-1}}, {"holes", {{{"position", 0}, {"allowed_token_ids", {110, 1000000}}}}}},
       "holes[0].allowed_token_ids[1]: 1000000 is outside the vocabulary"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto res = Post("/v1/completions", {{"prompt", Rows(kPuzzle)}, {"canvas_template", c.tmpl}});
    ASSERT_TRUE(res);
    EXPECT_EQ(res.status, 400) << res.body;
    EXPECT_THAT(res.body, HasSubstr(c.message));
  }
  // gRPC: INVALID_ARGUMENT with the same message.
  v1::GenerateRequest req = SudokuRequest(1);
  req.mutable_canvas_template()->set_text(long_text);
  Result r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("longer than the canvas"));
  // A template that sets only every_canvas is not silently an empty one.
  req.mutable_canvas_template()->Clear();
  req.mutable_canvas_template()->set_every_canvas(true);
  r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("give text"));
}

// Huge inputs on this model, whose tokenizer keeps a whole text as one BPE piece: a prompt of
// 1,000,000 digits is tokenized only until it passes the context budget (all 1,000,001 ids were
// made), a template text of 4,000,000 characters until it passes the canvas, an allowed entry
// of 200,000 characters until its second id; and what the errors quote of them is bounded
// (a 4 MB model name was echoed whole in the gRPC trailer, which stalled a grpc-js channel).
TEST_F(InfillingTest, HugeInputsCostTheirBudgetAndAreQuotedBounded) {
  auto tokenized = [&] {
    absl::StatusOr<std::string> m = TestCluster::ScrapeMetrics(c().gateway());
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? TestCluster::MetricValue(*m, "dgserve_gateway_tokenized_tokens_total") : -1;
  };
  const size_t bound = kMaxErrorMessageBytes + 64;
  const double before = tokenized();
  v1::GenerateRequest req = SudokuRequest(1);
  req.set_text(std::string(1000000, '5'));
  Result r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("exceed the context limit"));
  EXPECT_LE(tokenized() - before, 4 * 4096 + 8);  // (budget + 1) ids of at most 4 bytes

  req = SudokuRequest(1);
  req.mutable_canvas_template()->set_text(std::string(4000000, '5'));
  r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("canvas_template.text: its tokens and holes are longer than the canvas"));

  req = SudokuRequest(1);
  req.mutable_canvas_template()->set_allowed(0, std::string(200000, '5'));
  r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(r.status.error_message(), HasSubstr("is more than one token"));
  EXPECT_LE(r.status.error_message().size(), bound);

  req = SudokuRequest(1);
  req.set_model(std::string(4000000, 'm'));
  r = Generate(req);
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_LE(r.status.error_message().size(), bound);
  EXPECT_THAT(r.status.error_message(), HasSubstr("…\" (4000000 bytes) does not exist"));
  // The HTTP error body is bounded too (message and param).
  auto res = Post("/v1/completions", {{"prompt", "1"}, {std::string(3000000, 'k'), 1}});
  ASSERT_TRUE(res);
  EXPECT_EQ(res.status, 400);
  EXPECT_LE(res.body.size(), 3 * bound);
  // The channel still serves a request.
  EXPECT_TRUE(Generate(SudokuRequest(1)).status.ok());
}

// `dgserve sudoku` checks the served model's shape against its --model before sending (issue
// 12 defect 13): a local model of another shape is a clear error (exit 1), not "not solved".
TEST_F(InfillingTest, DgserveSudokuRefusesAGatewayOfAnotherModelShape) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / absl::StrCat("infilling_test_", getpid());
  fs::create_directories(dir);
  const std::string src = DGSERVE_SOURCE_DIR_PATH;
  fs::copy_file(src + "/tests/testdata/golden/tiny-v512/config.json", dir / "config.json",
                fs::copy_options::overwrite_existing);
  fs::copy_file(src + "/models/sudoku/tokenizer.json", dir / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  const std::string cmd = absl::StrCat(BinaryPath("tools/dgserve"), " sudoku --gateway 127.0.0.1:",
                                       cluster_->gateway().grpc_port, " --model ", dir.string(),
                                       " ", kPuzzle, " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = pclose(p);
  fs::remove_all(dir);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  EXPECT_EQ(WEXITSTATUS(status), 1) << out;
  EXPECT_THAT(out, HasSubstr("serves model 'sudoku' (canvas 91, vocabulary 128)"));
  EXPECT_THAT(out, ::testing::Not(HasSubstr("not solved")));
}

// `dgserve sudoku --samples N` shows the steps of the sample whose answer it shows (reviewer
// finding: the step lines were sample 0's whatever sample won): every step line names the
// chosen sample, and there is one per denoising step of its canvas.
TEST_F(InfillingTest, DgserveSudokuWithSamplesShowsTheChosenSamplesSteps) {
  const std::string src = DGSERVE_SOURCE_DIR_PATH;
  const std::string cmd = absl::StrCat(BinaryPath("tools/dgserve"), " sudoku --gateway 127.0.0.1:",
                                       cluster_->gateway().grpc_port, " --model ", src,
                                       "/models/sudoku --samples 3 --seed 11 ", kPuzzle, " 2>&1");
  FILE* p = popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  const int status = pclose(p);
  ASSERT_TRUE(WIFEXITED(status)) << out;
  ASSERT_NE(WEXITSTATUS(status), 1) << out;  // 0 solved, 2 not solved; 1 is an error
  const size_t at = out.find("answer of sample ");
  ASSERT_NE(at, std::string::npos) << out;
  const int chosen = std::atoi(out.c_str() + at + 17);
  std::vector<std::string> step_lines;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("step ") != std::string::npos && line.find("givens kept") != std::string::npos) {
      step_lines.push_back(line);
    }
  }
  ASSERT_FALSE(step_lines.empty()) << out;
  for (const std::string& line : step_lines) {
    EXPECT_EQ(line.rfind(absl::StrCat("sample ", chosen, ": step "), 0), 0u) << line;
  }
}

}  // namespace
}  // namespace dgserve::testing
