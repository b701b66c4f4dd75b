#include "engine/denoise/canvas_template.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "common/testing/status_matchers.h"
#include "engine/denoise/canvas_state.h"

namespace dgserve {
namespace {

using ::dgserve::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr int kC = 8;
constexpr int32_t kV = 130;  // masks span three 64-bit words

TEST(CanvasTemplateTest, FixedHolesSetsAndMasks) {
  const std::vector<int32_t> ids = {5, -1, 129, -1};
  const std::vector<TemplateHoleSpec> holes = {{1, {70, 3, 70, 64}}, {6, {128}}};
  auto t = CanvasTemplate::Create(ids, holes, kC, kV);
  ASSERT_TRUE(t.ok()) << t.status();
  const CanvasTemplate& x = **t;
  EXPECT_EQ(x.canvas_length(), kC);
  EXPECT_EQ(x.fixed(0), 5);
  EXPECT_EQ(x.fixed(2), 129);
  EXPECT_TRUE(x.is_hole(1));
  EXPECT_TRUE(x.is_hole(7));  // past the end of token_ids
  EXPECT_THAT(x.holes(), ElementsAre(1, 3, 4, 5, 6, 7));
  EXPECT_THAT(x.allowed(1), ElementsAre(3, 64, 70));  // sorted, unique
  EXPECT_TRUE(x.allowed(3).empty());
  for (int32_t v = 0; v < kV; ++v) {
    EXPECT_EQ(x.Allows(0, v), v == 5) << v;
    EXPECT_EQ(x.Allows(1, v), v == 3 || v == 64 || v == 70) << v;
    EXPECT_EQ(x.Allows(2, v), v == 129) << v;
    EXPECT_TRUE(x.Allows(3, v)) << v;
    EXPECT_EQ(x.Allows(6, v), v == 128) << v;
  }
  EXPECT_FALSE(x.Allows(3, kV));
  EXPECT_FALSE(x.Allows(3, -1));
  ASSERT_EQ(x.row_masks().size(), size_t(kC));
  EXPECT_EQ(x.row_masks()[3], nullptr);
  ASSERT_NE(x.row_masks()[2], nullptr);
  EXPECT_EQ(x.row_masks()[2][2], uint64_t{1} << 1);  // id 129 = word 2, bit 1
  EXPECT_EQ(x.row_masks()[2][0], 0u);
}

TEST(CanvasTemplateTest, BadTemplatesAreRejectedNamingTheEntry) {
  auto err = [](std::vector<int32_t> ids, std::vector<TemplateHoleSpec> holes) {
    return CanvasTemplate::Create(ids, holes, kC, kV).status();
  };
  EXPECT_THAT(err(std::vector<int32_t>(kC + 1, 1), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("longer than the canvas")));
  EXPECT_THAT(err({1, kV}, {}), StatusIs(absl::StatusCode::kInvalidArgument,
                                         HasSubstr("token_ids[1]: 130")));
  EXPECT_THAT(err({-2}, {}), StatusIs(absl::StatusCode::kInvalidArgument,
                                      HasSubstr("token_ids[0]: -2")));
  EXPECT_THAT(err({1, 2}, {{1, {3}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("holes[0].position: 1 is fixed")));
  EXPECT_THAT(err({}, {{kC, {3}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the canvas")));
  EXPECT_THAT(err({}, {{-1, {3}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside the canvas")));
  EXPECT_THAT(err({}, {{2, {}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("allowed_token_ids: is empty")));
  EXPECT_THAT(err({}, {{2, {3, kV}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("holes[0].allowed_token_ids[1]: 130 is outside the vocabulary")));
  EXPECT_THAT(err({}, {{2, {1}}, {2, {1}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("listed twice")));
}

// Draws: init index = pos % n, renoise index = (step + pos) % n, init token 100 + pos, renoise
// token 120 + pos (vocab 130), uniforms 0.5.
class Draws : public DrawSource {
 public:
  int32_t InitToken(int, int pos) override { return 100 + pos; }
  float SampleUniform(int, int, int) override { return 0.5f; }
  int32_t RenoiseToken(int, int, int pos) override { return 120 + pos; }
  int32_t InitIndex(int, int pos, int32_t n) override { return pos % n; }
  int32_t RenoiseIndex(int, int step, int pos, int32_t n) override { return (step + pos) % n; }
};

// Positions 0, 2 fixed (5, 129); 1 restricted to {3, 64, 70}; 6 to {128}; 3, 4, 5, 7 free.
std::shared_ptr<const CanvasTemplate> Tmpl() {
  return *CanvasTemplate::Create(std::vector<int32_t>{5, -1, 129},
                                 std::vector<TemplateHoleSpec>{{1, {3, 64, 70}}, {6, {128}}}, kC,
                                 kV);
}

TEST(CanvasDenoiserTemplateTest, InitWritesTheTemplateAndDrawsHolesFromTheirSets) {
  Draws draws;
  auto d = CanvasDenoiser::CreateWithTemplate(SamplerParams{}, Tmpl(), 0, &draws);
  ASSERT_TRUE(d.ok()) << d.status();
  // 1: allowed[1 % 3] = 64; 6: allowed[0] = 128; free holes: InitToken.
  EXPECT_THAT(d->canvas(), ElementsAre(5, 64, 129, 103, 104, 105, 128, 107));
  EXPECT_EQ(d->row_masks().size(), size_t(kC));
  EXPECT_FALSE(d->done());
}

TEST(CanvasDenoiserTemplateTest, StepsKeepFixedPositionsAndAcceptAmongHolesOnly) {
  Draws draws;
  SamplerParams p;
  p.entropy_bound = 0.25f;
  p.confidence_threshold = 0.5f;
  auto d = CanvasDenoiser::CreateWithTemplate(p, Tmpl(), 0, &draws);
  ASSERT_TRUE(d.ok());
  // Rows as a masked backend gives them; hole entropies 0.3 0.2 0.1 0.4 0.05 0.5 at 1,3,4,5,6,7.
  std::vector<RowResult> rows(kC);
  const int32_t argmax[kC] = {5, 70, 129, 10, 11, 12, 128, 13};
  const float entropy[kC] = {0, 0.3f, 0, 0.2f, 0.1f, 0.4f, 0.05f, 0.5f};
  for (int j = 0; j < kC; ++j) rows[j] = {argmax[j], argmax[j], entropy[j], 0};
  auto out = d->ApplyStep(rows);
  ASSERT_TRUE(out.ok()) << out.status();
  // Sorted hole entropies 0.05 (6), 0.1 (4), 0.2 (3), 0.3 (1): prefix sums before each ≤ 0.25
  // accept 6, 4, 3 (0.15 ≤ 0.25) but not 1 (0.35).
  EXPECT_THAT(out->accepted, ElementsAre(3, 4, 6));
  // Mean over the six holes: 1.55 / 6.
  EXPECT_NEAR(out->mean_entropy, 1.55f / 6, 1e-6f);
  // Fixed stay; accepted take the sample; 1 renoises from its set (allowed[(0 + 1) % 3] = 64);
  // free non-accepted positions take RenoiseToken.
  EXPECT_THAT(d->canvas(), ElementsAre(5, 64, 129, 10, 11, 125, 128, 127));
  EXPECT_THAT(d->committed(), ElementsAre(5, 70, 129, 10, 11, 12, 128, 13));
}

TEST(CanvasDenoiserTemplateTest, RowsOutsideTheTemplateAreAnError) {
  Draws draws;
  auto d = CanvasDenoiser::CreateWithTemplate(SamplerParams{}, Tmpl(), 0, &draws);
  ASSERT_TRUE(d.ok());
  std::vector<RowResult> rows(kC);
  const int32_t ok_ids[kC] = {5, 3, 129, 0, 0, 0, 128, 0};
  for (int j = 0; j < kC; ++j) rows[j] = {ok_ids[j], ok_ids[j], 0.1f, 0};
  rows[1].sampled = 4;  // not in {3, 64, 70}
  EXPECT_THAT(d->ApplyStep(rows).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows[1]")));
  rows[1].sampled = 3;
  rows[0].argmax = 6;  // the fixed token is 5
  EXPECT_THAT(d->ApplyStep(rows).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rows[0]")));
  EXPECT_EQ(d->step(), 0);  // state unchanged
}

TEST(CanvasDenoiserTemplateTest, NoHolesIsDoneAtInitWithTheTemplateCommitted) {
  Draws draws;
  const std::vector<int32_t> ids = {1, 2, 3, 4, 5, 6, 7, 8};
  auto d = CanvasDenoiser::CreateWithTemplate(SamplerParams{},
                                              *CanvasTemplate::Create(ids, {}, kC, kV), 0, &draws);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->done());
  EXPECT_TRUE(d->stopped_early());
  EXPECT_EQ(d->step(), 0);
  EXPECT_TRUE(d->uniforms().empty());
  EXPECT_THAT(d->committed(), ElementsAre(1, 2, 3, 4, 5, 6, 7, 8));
}

}  // namespace
}  // namespace dgserve
