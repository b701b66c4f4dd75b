// W4A16 round-to-nearest and GPTQ (gptq.h): the format's rule and GPTQ's update by hand on small
// cases, the output error GPTQ minimises against round-to-nearest's on correlated inputs, inputs
// no row reached, the refusals, and the factor and codes bit for bit those of the straightforward
// column-by-column forms (kept below as the reference) on shapes that reach every path.
#include "engine/model/gptq.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "engine/model/gptq_reference_testing.h"

namespace dgserve {
namespace {

InputHessian HessianOf(const std::vector<float>& x, int rows, int cols) {
  InputHessian h;
  h.cols = cols;
  h.rows = rows;
  h.h.assign(size_t(cols) * cols, 0.0);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < cols; ++i) {
      for (int j = 0; j < cols; ++j) {
        h.h[size_t(i) * cols + j] += double(x[size_t(r) * cols + i]) * x[size_t(r) * cols + j];
      }
    }
  }
  return h;
}

// Σ over calibration rows and output rows of (x·(w − q))², q = code · scale.
double OutputError(const std::vector<float>& x, int n, const std::vector<float>& w,
                   const W4a16Weights& q, int rows, int cols, int group) {
  const int groups = (cols + group - 1) / group;
  double e = 0.0;
  for (int r = 0; r < rows; ++r) {
    for (int t = 0; t < n; ++t) {
      double d = 0.0;
      for (int c = 0; c < cols; ++c) {
        const double s = Bf16ToFloat(q.scales[size_t(r) * groups + c / group]);
        d += double(x[size_t(t) * cols + c]) *
             (double(w[size_t(r) * cols + c]) - q.codes[size_t(r) * cols + c] * s);
      }
      e += d * d;
    }
  }
  return e;
}

// absmax 7.5 → scale 1 (exact in bf16): 7.5 rounds to 8 and is clamped to 7, −7.5 to −8, 2.5 to
// 2 (ties to even), 0.49 to 0; the second group's absmax 0.375 → scale 0.05 rounded to bf16.
TEST(W4a16Test, RoundToNearestIsTheFormatsRule) {
  const std::vector<float> w = {7.5f, -7.5f, 2.5f, 0.49f, 0.375f, -0.1f};
  const W4a16Weights q = QuantizeW4a16Rtn(w, 1, 6, 4);
  ASSERT_EQ(q.scales.size(), 2u);
  EXPECT_EQ(Bf16ToFloat(q.scales[0]), 1.0f);
  EXPECT_EQ(Bf16ToFloat(q.scales[1]), 0.05004882812f);  // bf16(0.05): 0x3D4D
  EXPECT_EQ(q.codes, (std::vector<int8_t>{7, -8, 2, 0, 7, -2}));
  // An all-zero group takes scale 1.
  const W4a16Weights z = QuantizeW4a16Rtn(std::vector<float>(4, 0.0f), 1, 4, 4);
  EXPECT_EQ(Bf16ToFloat(z.scales[0]), 1.0f);
}

// Two inputs, H = [[4, 2], [2, 2]], no dampening: rounding w0 = 1.875 to 1.75 (scale 0.25, code
// 7) leaves e = 0.125, and GPTQ moves w1 by e · H01 / H11 = 0.125 (the least-squares correction
// of the output for the second input given the first's error): 0.1 → 0.225, code 1, where
// round-to-nearest gives 0 (0.4).
TEST(W4a16Test, GptqUpdateByHand) {
  InputHessian h;
  h.cols = 2;
  h.rows = 1;
  h.h = {4.0, 2.0, 2.0, 2.0};
  const std::vector<float> w = {1.875f, 0.1f};
  auto q = QuantizeW4a16Gptq(w, 1, 2, 2, h, 0.0);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(Bf16ToFloat(q->scales[0]), 0.25f);
  EXPECT_EQ(q->codes, (std::vector<int8_t>{7, 1}));
  EXPECT_EQ(QuantizeW4a16Rtn(w, 1, 2, 2).codes, (std::vector<int8_t>{7, 0}));
  // Uncorrelated inputs (H diagonal): nothing to correct, round-to-nearest's codes.
  h.h = {4.0, 0.0, 0.0, 2.0};
  q = QuantizeW4a16Gptq(w, 1, 2, 2, h, 0.0);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->codes, (std::vector<int8_t>{7, 0}));
}

// Three inputs, H = [[4, 2, 1], [2, 3, 1], [1, 1, 2]] (det 13; H⁻¹'s first row (5, −3, −1)/13),
// no dampening, one group (absmax 1.875: scale 0.25). Column 0: 1.875 → code 7 (1.75), error
// e0 = 0.125; w1 and w2 move by −e0·H⁻¹₀ⱼ/H⁻¹₀₀ = 0.6·e0 and 0.2·e0: 0.1 → 0.175 (code 1,
// e1 = −0.075) and 0.3825 → 0.4075. Column 1, against H without input 0 ([[3, 1], [1, 2]], whose
// inverse's first row is (2, −1)/5): w2 moves by 0.5·e1 to 0.37, code 1 (1.48). Without the
// downdate (H⁻¹ itself in place of its Cholesky factor: 2/7·e1) it would be 0.386, code 2;
// round-to-nearest gives (7, 0, 2).
TEST(W4a16Test, GptqUpdateOfThreeColumnsByHand) {
  InputHessian h;
  h.cols = 3;
  h.rows = 1;
  h.h = {4.0, 2.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 2.0};
  const std::vector<float> w = {1.875f, 0.1f, 0.3825f};
  auto q = QuantizeW4a16Gptq(w, 1, 3, 3, h, 0.0);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(Bf16ToFloat(q->scales[0]), 0.25f);
  EXPECT_EQ(q->codes, (std::vector<int8_t>{7, 1, 1}));
  EXPECT_EQ(QuantizeW4a16Rtn(w, 1, 3, 3).codes, (std::vector<int8_t>{7, 0, 2}));
}

// Correlated inputs (rank-8 mixtures of 64 columns plus a little noise), 16 output rows in groups
// of 32: GPTQ's output error is well below round-to-nearest's (measured 0.06×; without the error
// feedback it would be the same codes as round-to-nearest). Every code is in the int4 range.
TEST(W4a16Test, GptqLowersTheOutputErrorOnCorrelatedInputs) {
  const int rows = 16, cols = 64, n = 512, rank = 8, group = 32;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> a(size_t(rank) * cols), x(size_t(n) * cols), w(size_t(rows) * cols);
  for (float& v : a) v = normal(rng);
  for (int t = 0; t < n; ++t) {
    float z[rank];
    for (float& v : z) v = normal(rng);
    for (int c = 0; c < cols; ++c) {
      float s = 0.05f * normal(rng);
      for (int k = 0; k < rank; ++k) s += z[k] * a[size_t(k) * cols + c];
      x[size_t(t) * cols + c] = s;
    }
  }
  for (float& v : w) v = normal(rng);
  const InputHessian h = HessianOf(x, n, cols);
  auto g = QuantizeW4a16Gptq(w, rows, cols, group, h);
  ASSERT_TRUE(g.ok()) << g.status();
  const W4a16Weights r = QuantizeW4a16Rtn(w, rows, cols, group);
  for (int8_t c : g->codes) {
    ASSERT_GE(c, -8);
    ASSERT_LE(c, 7);
  }
  const double eg = OutputError(x, n, w, *g, rows, cols, group);
  const double er = OutputError(x, n, w, r, rows, cols, group);
  std::printf("output error: GPTQ %.4g, round-to-nearest %.4g (ratio %.3f)\n", eg, er, eg / er);
  EXPECT_LT(eg, 0.15 * er);
}

// An input no calibration row reached (its column of H is 0) gets weight 0: it never reaches the
// output, and its error budget goes nowhere.
TEST(W4a16Test, InputsNoRowReachedGetZeroWeight) {
  InputHessian h;
  h.cols = 3;
  h.rows = 2;
  h.h = {2.0, 1.0, 0.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0};
  const std::vector<float> w = {0.5f, -0.75f, 3.0f, 1.0f, 0.25f, -2.0f};
  auto q = QuantizeW4a16Gptq(w, 2, 3, 3, h);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->codes[2], 0);
  EXPECT_EQ(q->codes[5], 0);
  EXPECT_NE(q->codes[0], 0);
}

// The factor (U and the dead inputs), the codes and scales, and every weight as it was rounded
// (after its updates: the quantization's arithmetic) equal the reference's bit for bit:
// widths below and above the threads' threshold (256) and not a multiple of the Cholesky panel
// (32) or of four, output rows fewer than a tile (16) and not a multiple of it, groups of 7 (the
// column blocks cut at every group start), 32, 128 and one per row, and inputs no row reached.
// Correlated inputs (a rank-16 mixture plus noise, scaled per input) so that the updates matter.
TEST(W4a16Test, GptqIsBitForBitTheColumnByColumnForm) {
  struct Shape {
    int cols, rows;
    std::vector<int> groups;
    std::vector<int> dead;
  };
  const std::vector<Shape> shapes = {
      {61, 5, {7, 32, 61}, {}},
      {300, 37, {32, 128, 300}, {0, 33, 150, 299}},
      {517, 16, {7, 128}, {5}},
      {384, 70, {32}, {}},
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Shape& sh : shapes) {
    const int cols = sh.cols, xrows = cols + 64, rank = 16;
    std::vector<float> a(size_t(rank) * cols), scale(cols), x(size_t(xrows) * cols);
    for (float& v : a) v = normal(rng);
    for (float& v : scale) v = std::exp(normal(rng));
    for (int t = 0; t < xrows; ++t) {
      float z[rank];
      for (float& v : z) v = normal(rng);
      for (int c = 0; c < cols; ++c) {
        float s = 0.3f * normal(rng);
        for (int k = 0; k < rank; ++k) s += z[k] * a[size_t(k) * cols + c];
        x[size_t(t) * cols + c] = s * scale[c];
      }
    }
    for (int c : sh.dead) {
      for (int t = 0; t < xrows; ++t) x[size_t(t) * cols + c] = 0.0f;
    }
    InputHessian h;
    h.cols = cols;
    h.rows = xrows;
    h.h.assign(size_t(cols) * cols, 0.0);
    for (int t = 0; t < xrows; ++t) {
      const float* xt = x.data() + size_t(t) * cols;
      for (int i = 0; i < cols; ++i) {
        for (int j = 0; j < cols; ++j) h.h[size_t(i) * cols + j] += double(xt[i]) * xt[j];
      }
    }
    std::vector<float> w(size_t(sh.rows) * cols);
    for (float& v : w) v = 0.05f * normal(rng);
    for (double damp : {0.01, 0.1}) {
      GptqFactor want;
      ASSERT_TRUE(RefFactor(h, damp, want)) << cols;
      absl::StatusOr<GptqFactor> got = FactorGptqHessian(h, damp);
      ASSERT_TRUE(got.ok()) << got.status();
      ASSERT_EQ(got->cols, cols);
      EXPECT_EQ(got->dead, want.dead) << cols;
      ASSERT_EQ(got->u.size(), want.u.size());
      size_t differ = 0;
      for (size_t e = 0; e < want.u.size(); ++e) {
        differ += std::memcmp(&got->u[e], &want.u[e], sizeof(double)) != 0;
      }
      EXPECT_EQ(differ, 0u) << "U entries that differ, cols " << cols << " dampening " << damp;
      for (int group : sh.groups) {
        std::vector<double> ref_rounded, rounded;
        const W4a16Weights ref = RefQuantize(w, sh.rows, cols, group, want, &ref_rounded);
        absl::StatusOr<W4a16Weights> q =
            QuantizeW4a16GptqTraced(w, sh.rows, cols, group, want, &rounded);
        ASSERT_TRUE(q.ok()) << q.status();
        ASSERT_EQ(rounded.size(), ref_rounded.size());
        EXPECT_EQ(std::memcmp(rounded.data(), ref_rounded.data(), rounded.size() * sizeof(double)),
                  0)
            << "the weights as rounded differ: cols " << cols << " rows " << sh.rows << " group "
            << group;
        EXPECT_EQ(q->codes, ref.codes)
            << "cols " << cols << " rows " << sh.rows << " group " << group;
        EXPECT_EQ(q->scales, ref.scales)
            << "cols " << cols << " rows " << sh.rows << " group " << group;
      }
    }
  }
}

TEST(W4a16Test, GptqRefusals) {
  InputHessian h;
  h.cols = 2;
  h.rows = 1;
  h.h = {1.0, 0.0, 0.0, 1.0};
  const std::vector<float> w = {1.0f, 2.0f};
  EXPECT_EQ(QuantizeW4a16Gptq(w, 1, 2, 0, h).status().code(), absl::StatusCode::kInvalidArgument);
  for (double d : {-0.5, 2e6, double(INFINITY), double(NAN)}) {
    EXPECT_EQ(QuantizeW4a16Gptq(w, 1, 2, 2, h, d).status().code(),
              absl::StatusCode::kInvalidArgument)
        << d;
  }
  EXPECT_EQ(QuantizeW4a16Gptq(w, 2, 2, 2, h).status().code(), absl::StatusCode::kInvalidArgument);
  InputHessian wide = h;
  wide.cols = 3;
  EXPECT_EQ(QuantizeW4a16Gptq(w, 1, 2, 2, wide).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Indefinite ([[1, 2], [2, 1]]: eigenvalues 3 and −1), no dampening.
  h.h = {1.0, 2.0, 2.0, 1.0};
  const absl::Status st = QuantizeW4a16Gptq(w, 1, 2, 2, h, 0.0).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("larger dampening"), std::string::npos) << st;
}

}  // namespace
}  // namespace dgserve
