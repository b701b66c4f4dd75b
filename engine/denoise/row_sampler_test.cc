#include "engine/denoise/row_sampler.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

#include "engine/denoise/rng.h"

namespace dgserve {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Double-precision reference of p = softmax(ℓ/T).
struct Reference {
  int32_t argmax = 0;
  double entropy = 0.0;
  double lse = 0.0;
  std::vector<double> p;
};

Reference ComputeReference(const std::vector<float>& row, float t) {
  Reference r;
  for (size_t i = 1; i < row.size(); ++i) {
    if (row[i] > row[r.argmax]) r.argmax = static_cast<int32_t>(i);
  }
  const double m = static_cast<double>(row[r.argmax]) / t;
  double s = 0.0;
  r.p.resize(row.size());
  for (size_t i = 0; i < row.size(); ++i) {
    r.p[i] = std::exp(static_cast<double>(row[i]) / t - m);
    s += r.p[i];
  }
  r.lse = m + std::log(s);
  for (size_t i = 0; i < row.size(); ++i) {
    r.p[i] /= s;
    if (r.p[i] > 0.0) r.entropy -= r.p[i] * std::log(r.p[i]);
  }
  return r;
}

std::vector<float> RandomRow(int vocab, float magnitude, uint64_t seed) {
  std::vector<float> row(vocab);
  for (int i = 0; i < vocab; ++i) {
    const float u = Uniform01({seed, DrawStream::kSampleUniform, 0, 0, static_cast<uint32_t>(i)});
    row[i] = magnitude * (2.0f * u - 1.0f);
  }
  return row;
}

const RowKernel kKernels[] = {RowKernel::kAuto, RowKernel::kBaseline, RowKernel::kAvx2Fma};

TEST(RowSamplerTest, FullVocabularyMatchesDoubleReference) {
  // V = 262144 random logits of magnitude ≤ 30 at the first and last temperatures.
  std::vector<float> row = RandomRow(262144, 30.0f, 1);
  for (float t : {0.8f, 0.408333331f}) {
    const Reference ref = ComputeReference(row, t);
    for (RowKernel kernel : kKernels) {
      std::vector<float> copy = row;
      const RowResult r = SampleRowWithKernel(kernel, copy.data(), 262144, t, 0.5f, false);
      EXPECT_EQ(r.argmax, ref.argmax);
      EXPECT_NEAR(r.entropy, ref.entropy, 1e-3);
      EXPECT_NEAR(r.entropy, ref.entropy, 2e-5) << "expected accuracy";
      EXPECT_NEAR(r.lse, ref.lse, 1e-4);
      EXPECT_GT(ref.p[r.sampled], 0.0);
      std::printf("V=262144 T=%.6f kernel %d: |dH| = %.2e, |dlse| = %.2e\n", t,
                  static_cast<int>(kernel), std::abs(r.entropy - ref.entropy),
                  std::abs(r.lse - ref.lse));
    }
  }
}

TEST(RowSamplerTest, PeakedAndFlatRows) {
  // Peaked: near-zero entropy must stay accurate in absolute terms (confidence threshold 0.005).
  std::vector<float> row(262144, -30.0f);
  row[123457] = 30.0f;
  row[77] = 20.0f;
  for (float t : {0.8f, 0.4f}) {
    const Reference ref = ComputeReference(row, t);
    const RowResult r = SampleRow(row.data(), 262144, t, 0.999f);
    EXPECT_EQ(r.argmax, 123457);
    EXPECT_NEAR(r.entropy, ref.entropy, 1e-7 + 1e-4 * ref.entropy) << t;
    EXPECT_NEAR(r.lse, ref.lse, 1e-4);
    EXPECT_EQ(r.sampled, 123457);
  }
  // Flat: entropy log V.
  std::vector<float> flat(262144, 1.5f);
  const RowResult f = SampleRow(flat.data(), 262144, 0.8f, 0.0f);
  EXPECT_NEAR(f.entropy, std::log(262144.0), 1e-4);
  EXPECT_NEAR(f.lse, 1.5 / 0.8 + std::log(262144.0), 1e-4);
  EXPECT_EQ(f.argmax, 0);
  EXPECT_EQ(f.sampled, 0);
}

TEST(RowSamplerTest, OddSizesAndArgmaxTiesTakeFirstIndex) {
  for (int vocab : {1, 2, 7, 15, 16, 17, 31, 32, 33, 1000, 1023, 1024, 1025, 4099}) {
    std::vector<float> row = RandomRow(vocab, 5.0f, vocab);
    // Ties between the last id and some earlier ids (different lanes, blocks and the tail).
    const int last = vocab - 1;
    int first = last;
    for (int i : {last, last / 2, last / 3 + 1, 1}) {
      if (i < vocab) {
        row[i] = 9.0f;
        first = std::min(first, i);
      }
    }
    for (RowKernel kernel : kKernels) {
      const Reference ref = ComputeReference(row, 0.7f);
      const RowResult r = SampleRowWithKernel(kernel, row.data(), vocab, 0.7f, 0.3f, false);
      EXPECT_EQ(r.argmax, first) << vocab;
      EXPECT_EQ(ref.argmax, first) << vocab;
      EXPECT_NEAR(r.entropy, ref.entropy, 1e-5) << vocab;
      EXPECT_NEAR(r.lse, ref.lse, 1e-5) << vocab;
    }
  }
  // Ties in a long row: 100000 and 100048 share a lane, 100001 and 200003 sit in other lanes.
  std::vector<float> row = RandomRow(262144, 5.0f, 3);
  row[200003] = 8.0f;
  row[100001] = 8.0f;
  row[100048] = 8.0f;
  row[100000] = 8.0f;
  EXPECT_EQ(SampleRow(row.data(), 262144, 0.8f, 0.5f).argmax, 100000);
}

TEST(RowSamplerTest, SamplingEdgesFirstAndLastNonzero) {
  std::vector<float> row(5000, 1.0f);
  for (int i = 0; i < 10; ++i) row[i] = kNegInf;       // masked head
  for (int i = 4990; i < 5000; ++i) row[i] = kNegInf;  // masked tail
  row[3000] = -200.0f;                                 // underflows to p = 0 at T = 0.5
  for (RowKernel kernel : kKernels) {
    EXPECT_EQ(SampleRowWithKernel(kernel, row.data(), 5000, 0.5f, 0.0f, false).sampled, 10);
    const float almost_one = std::nextafter(1.0f, 0.0f);
    EXPECT_EQ(SampleRowWithKernel(kernel, row.data(), 5000, 0.5f, almost_one, false).sampled, 4989);
    // Out-of-range u are clamped.
    EXPECT_EQ(SampleRowWithKernel(kernel, row.data(), 5000, 0.5f, 1.0f, false).sampled, 4989);
    EXPECT_EQ(SampleRowWithKernel(kernel, row.data(), 5000, 0.5f, -3.0f, false).sampled, 10);
    EXPECT_EQ(SampleRowWithKernel(kernel, row.data(), 5000, 0.5f, std::nanf(""), false).sampled,
              10);
  }
  // Every u gives an id with p > 0.
  for (int k = 0; k < 2000; ++k) {
    const float u = Uniform01({9, DrawStream::kSampleUniform, 0, 0, static_cast<uint32_t>(k)});
    const int32_t s = SampleRow(row.data(), 5000, 0.5f, u).sampled;
    EXPECT_TRUE(s >= 10 && s < 4990 && s != 3000) << s;
  }
}

TEST(RowSamplerTest, InverseCdfIsExact) {
  // Two ids with equal mass across different blocks: u < 0.5 → the first, u ≥ 0.5 → the second.
  std::vector<float> row(3000, kNegInf);
  row[3] = 2.0f;
  row[2500] = 2.0f;
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.0f).sampled, 3);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.49999f).sampled, 3);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.5f).sampled, 2500);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.99f).sampled, 2500);
  // Masses 1:2:1 (log 2 apart): thresholds 0.25 and 0.75.
  row[1200] = 2.0f + std::log(2.0f);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.2499f).sampled, 3);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.2501f).sampled, 1200);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.7499f).sampled, 1200);
  EXPECT_EQ(SampleRow(row.data(), 3000, 1.0f, 0.7501f).sampled, 2500);
}

TEST(RowSamplerTest, SampleFrequenciesFollowTheDistribution) {
  constexpr int kVocab = 4500, kDraws = 200000;
  std::vector<float> row = RandomRow(kVocab, 4.0f, 17);
  const float t = 0.6f;
  const Reference ref = ComputeReference(row, t);
  std::vector<double> counts(kVocab, 0.0);
  for (int k = 0; k < kDraws; ++k) {
    const float u = (k + 0.5f) / kDraws;  // stratified: the empirical CDF tracks the true CDF
    ++counts[SampleRow(row.data(), kVocab, t, u).sampled];
  }
  double cdf = 0.0, emp = 0.0, max_gap = 0.0;
  for (int i = 0; i < kVocab; ++i) {
    cdf += ref.p[i];
    emp += counts[i] / kDraws;
    max_gap = std::max(max_gap, std::abs(cdf - emp));
  }
  EXPECT_LT(max_gap, 2e-5);
}

TEST(RowSamplerTest, ExpAccuracyAndFlush) {
  // With V = 2 and ℓ = {0, −d·T}, the written probabilities are {1, e}·fl(1/S): their ratio is
  // the kernel's e to within two float roundings. The kernel evaluates e = 2^w at the float32
  // argument w = fl(ℓ·fl(log2(e)/T)); against 2^w the polynomial error shows, against exp(ℓ/T)
  // in double the float32 argument rounding is added (≈ |z|·6e-8).
  for (RowKernel kernel : kKernels) {
    double worst_poly = 0.0, worst_total = 0.0;
    for (double d = 0.0; d < 87.0; d += 0.0371) {
      const float t = 0.8f;
      float row[2] = {0.0f, static_cast<float>(-d * t)};
      const float k = static_cast<float>(1.44269504088896340736 / t);
      const float w = row[1] * k;
      const double z = static_cast<double>(row[1]) / t;
      SampleRowWithKernel(kernel, row, 2, t, 0.5f, true);
      const double e = static_cast<double>(row[1]) / row[0];
      worst_poly = std::max(worst_poly, std::abs(e / std::exp2(static_cast<double>(w)) - 1.0));
      worst_total = std::max(worst_total, std::abs(e / std::exp(z) - 1.0));
    }
    EXPECT_LT(worst_poly, 5e-7);
    EXPECT_LT(worst_total, 1e-5);
    float row[2] = {0.0f, -90.0f};
    SampleRowWithKernel(kernel, row, 2, 1.0f, 0.5f, true);
    EXPECT_EQ(row[1], 0.0f);  // flushed: z' < −87.68
    EXPECT_EQ(row[0], 1.0f);
  }
}

TEST(RowSamplerTest, WriteProbsMatchesReadOnlyResults) {
  std::vector<float> row = RandomRow(262144 + 5, 25.0f, 5);
  const int vocab = static_cast<int>(row.size());
  const Reference ref = ComputeReference(row, 0.45f);
  const RowResult ro = SampleRow(static_cast<const float*>(row.data()), vocab, 0.45f, 0.77f);
  std::vector<float> probs = row;
  const RowResult rw = SampleRow(probs.data(), vocab, 0.45f, 0.77f, true);
  EXPECT_EQ(ro.argmax, rw.argmax);
  EXPECT_EQ(ro.sampled, rw.sampled);
  EXPECT_EQ(ro.entropy, rw.entropy);
  EXPECT_EQ(ro.lse, rw.lse);
  double sum = 0.0, worst = 0.0;
  for (int i = 0; i < vocab; ++i) {
    sum += probs[i];
    if (ref.p[i] > 1e-30) worst = std::max(worst, std::abs(probs[i] / ref.p[i] - 1.0));
  }
  EXPECT_NEAR(sum, 1.0, 1e-5);
  EXPECT_LT(worst, 2e-5);  // dominated by the float rounding of ℓ/T-scale arguments
}

TEST(RowSamplerTest, BatchEqualsPerRowAndIsThreadIndependent) {
  constexpr int kRows = 9, kVocab = 7000;
  std::vector<float> logits(kRows * kVocab);
  std::vector<float> uniforms(kRows), temps(kRows);
  for (int r = 0; r < kRows; ++r) {
    std::vector<float> row = RandomRow(kVocab, 10.0f, 100 + r);
    std::copy(row.begin(), row.end(), logits.begin() + r * kVocab);
    uniforms[r] = (r + 0.3f) / kRows;
    temps[r] = 0.4f + 0.05f * r;
  }
  std::vector<RowResult> expected(kRows);
  for (int r = 0; r < kRows; ++r) {
    expected[r] =
        SampleRow(static_cast<const float*>(logits.data() + r * kVocab), kVocab, 0.8f, uniforms[r]);
  }
  for (int threads : {1, 2, 3}) {
    omp_set_num_threads(threads);
    std::vector<float> copy = logits;
    std::vector<RowResult> out(kRows);
    SampleRows(copy.data(), kRows, kVocab, 0.8f, uniforms, false, out);
    for (int r = 0; r < kRows; ++r) {
      EXPECT_EQ(out[r].argmax, expected[r].argmax);
      EXPECT_EQ(out[r].sampled, expected[r].sampled);
      EXPECT_EQ(out[r].entropy, expected[r].entropy);
      EXPECT_EQ(out[r].lse, expected[r].lse);
    }
    EXPECT_EQ(copy, logits);  // read-only
    // Per-row temperatures, writing probabilities.
    SampleRows(copy.data(), kRows, kVocab, temps, uniforms, true, out);
    for (int r = 0; r < kRows; ++r) {
      std::vector<float> row(logits.begin() + r * kVocab, logits.begin() + (r + 1) * kVocab);
      const RowResult one = SampleRow(row.data(), kVocab, temps[r], uniforms[r], true);
      EXPECT_EQ(out[r].sampled, one.sampled);
      EXPECT_EQ(out[r].entropy, one.entropy);
      EXPECT_TRUE(std::equal(row.begin(), row.end(), copy.begin() + r * kVocab));
    }
  }
}

TEST(RowSamplerTest, KernelVariantsAgree) {
  std::vector<float> row = RandomRow(50000, 20.0f, 8);
  int same_sample = 0;
  for (int k = 0; k < 50; ++k) {
    const float u = (k + 0.5f) / 50;
    const RowResult a =
        SampleRowWithKernel(RowKernel::kBaseline, row.data(), 50000, 0.5f, u, false);
    const RowResult b = SampleRowWithKernel(RowKernel::kAvx2Fma, row.data(), 50000, 0.5f, u, false);
    EXPECT_EQ(a.argmax, b.argmax);
    EXPECT_NEAR(a.entropy, b.entropy, 1e-5);
    EXPECT_NEAR(a.lse, b.lse, 1e-5);
    same_sample += a.sampled == b.sampled;
  }
  EXPECT_GE(same_sample, 49);
  std::printf("row sampler kernel on this CPU: %s\n", RowSamplerIsa());
}

}  // namespace
}  // namespace dgserve
