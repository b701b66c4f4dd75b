// The quantized GEMM (gemm_quant.h): the e4m3 codec, per-token activation quantization, and
// QuantLinear against (1) the scalar definition — the fma chain over k ascending of the widened
// operands, then the FP8 epilogue — bit for bit, (2) a float64 reference of the same quantized
// weights and activations within the float32 chain's error bound, (3) itself: each row alone
// equals the row in a batch, and every ISA path gives the same bits. FP8, W4A16 and NVFP4 (W4A4:
// e2m1 codes, e4m3 block scales, activations quantized per 16-block; and weight-only NVFP4A16,
// activations unquantized).
#include "engine/cpu/gemm_quant.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/fp8.h"
#include "engine/cpu/packed_matrix.h"

namespace dgserve::cpu {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

TEST(E4m3Test, EveryCodeRoundTripsAndMidpointsRoundToEven) {
  for (int c = 0; c < 256; ++c) {
    const float v = E4m3ToFloat(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << c;
      continue;
    }
    EXPECT_EQ(FloatToE4m3(v), uint8_t(c)) << c << " " << v;
  }
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(E4m3ToFloat(0x08), 0x1p-6f);
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(FloatToE4m3(1000.0f), 0x7e);  // saturates (vLLM clamps to ±448)
  EXPECT_EQ(FloatToE4m3(-460.0f), 0xfe);
  // Midpoints between neighbouring positive codes round to the even code.
  for (int c = 0; c < 0x7e; ++c) {
    const double lo = E4m3ToFloat(uint8_t(c)), hi = E4m3ToFloat(uint8_t(c + 1));
    const float mid = float((lo + hi) / 2);
    ASSERT_EQ(double(mid), (lo + hi) / 2);
    EXPECT_EQ(FloatToE4m3(mid), uint8_t((c % 2 == 0) ? c : c + 1)) << c;
    EXPECT_EQ(FloatToE4m3(std::nextafter(mid, 0.0f)), uint8_t(c)) << c;
    EXPECT_EQ(FloatToE4m3(std::nextafter(mid, 1000.0f)), uint8_t(c + 1)) << c;
  }
}

TEST(E4m3Test, RoundToE4m3EqualsEncodeThenDecode) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t b = bits(rng);
    if (i % 2 == 0) b = (b & 0x807fffffu) | ((110u + b % 30u) << 23);  // near e4m3's range
    float x;
    std::memcpy(&x, &b, 4);
    if (std::isnan(x)) continue;
    ASSERT_EQ(Bits(RoundToE4m3(x)), Bits(E4m3ToFloat(FloatToE4m3(x)))) << x;
  }
  for (int c = 0; c < 0x7e; ++c) {  // the midpoints, both signs
    const float mid = float((double(E4m3ToFloat(uint8_t(c))) + E4m3ToFloat(uint8_t(c + 1))) / 2);
    for (float x : {mid, -mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e3f)}) {
      ASSERT_EQ(Bits(RoundToE4m3(x)), Bits(E4m3ToFloat(FloatToE4m3(x)))) << x;
    }
  }
}

TEST(QuantizeRowFp8Test, ScaleIsAbsmaxOver448AndValuesRoundToNearestEven) {
  const std::vector<float> x = {0.5f, -3.0f, 1e-3f, 2.9f, 0.0f};
  std::vector<float> q(x.size());
  const float s = QuantizeRowFp8(x.data(), int(x.size()), q.data());
  EXPECT_EQ(s, 3.0f / 448.0f);
  EXPECT_EQ(q[1], -448.0f);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(q[i], RoundToE4m3(x[i] / s)) << i;
  // An all-zero row takes vLLM's smallest scale, 1 / (448 · 512).
  std::vector<float> z(4, 0.0f), qz(4);
  EXPECT_EQ(QuantizeRowFp8(z.data(), 4, qz.data()), 1.0f / (448.0f * 512.0f));
}

TEST(E2m1Test, CodesValuesAndRoundingToNearestEven) {
  const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(Bits(E2m1ToFloat(uint8_t(c))), Bits(want[c])) << c;
    if (c != 8) EXPECT_EQ(FloatToE2m1(want[c]), uint8_t(c)) << c;
  }
  // Ties go to the even code (ModelOpt's _cast_fp4, PTX cvt.rn): 0.25→0, 0.75→1, 1.25→1,
  // 1.75→2, 2.5→2, 3.5→4, 5→4; above 5 saturates at 6.
  const std::pair<float, float> ties[] = {{0.25f, 0}, {0.75f, 1},    {1.25f, 1}, {1.75f, 2},
                                          {2.5f, 2},  {3.5f, 4},     {5.0f, 4},  {5.01f, 6},
                                          {100.f, 6}, {0.26f, 0.5f}, {2.51f, 3}, {0.1f, 0}};
  for (auto [x, v] : ties) {
    EXPECT_EQ(E2m1ToFloat(FloatToE2m1(x)), v) << x;
    EXPECT_EQ(E2m1ToFloat(FloatToE2m1(-x)), -v) << -x;
  }
  EXPECT_EQ(FloatToE2m1(-0.1f), 8);  // negative: the sign bit, as _cast_fp4 (weight < 0)
  EXPECT_EQ(FloatToE2m1(-0.0f), 0);
}

// QuantizeRowNvfp4 on hand-computed blocks. input_scale 1/6: g = 6, so a block's scale is
// about e4m3(absmax) and x is multiplied by o = 1 / (sx / 6), mapping absmax to about 6.
TEST(QuantizeRowNvfp4Test, HandComputedBlocks) {
  std::vector<float> x(32, 0.0f);
  // Block 0: absmax 3. g·absmax/6 = 6·3/6 = 3 (e4m3 exact); o = 1 / (3 · (1/6)) = 2.
  x[0] = 3.0f;    // 6   → e2m1 6 → 6·3 = 18
  x[1] = -1.2f;   // −2.4 → −2 → −6
  x[2] = 0.3f;    // 0.6 → 0.5 → 1.5
  x[3] = 0.125f;  // 0.25 (tie) → 0 → 0
  x[4] = 1.25f;   // 2.5 (tie) → 2 → 6
  x[5] = -0.9f;   // −1.8 → −2 → −6
  // Block 1: absmax 100. The scale is computed in float32 in the definition's order:
  // 100 · fl(1/6) = 16.666668, · 6 = 100.0000076 — just above the e4m3 midpoint 100 between 96
  // and 104, so sx = 104 (the exact 100 would have tied to 96: the order matters and is fixed).
  // o = 1 / (104 · (1/6)) = 0.0576923; x = 100 → 5.769 → 6 → 624.
  x[16] = 100.0f;
  x[17] = 40.0f;  // 2.3077 → 2 → 208
  x[18] = -7.0f;  // −0.4038 → −0.5 → −52
  std::vector<float> q(32, -1.0f);
  const float input_scale = 1.0f / 6.0f;
  QuantizeRowNvfp4(x.data(), 32, input_scale, q.data());
  // g = 1 / (1/6) rounds to 6 exactly? 1/6 in float32 is 0.16666667163…, 1 / that = 5.9999998…
  // which rounds to 6.0f in float32 (checked here, the rest of the test relies on it).
  ASSERT_EQ(1.0f / input_scale, 6.0f);
  const float want0[16] = {18, -6, 1.5f, 0, 6, -6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(q[c], want0[c]) << c;
  EXPECT_EQ(q[16], 624.0f);
  EXPECT_EQ(q[17], 208.0f);
  EXPECT_EQ(q[18], -52.0f);
  for (int c = 19; c < 32; ++c) EXPECT_EQ(q[c], 0.0f) << c;
  // An all-zero block: scale 0, values 0 (no division by zero).
  std::vector<float> z(16, 0.0f), qz(16, 1.0f);
  QuantizeRowNvfp4(z.data(), 16, 0.01f, qz.data());
  for (float v : qz) EXPECT_EQ(v, 0.0f);
  // A block above the static range saturates: input_scale 1/6 → largest block scale 448, so
  // absmax 6·448·2 = 5376 gives sx = 448, o = 1 / (448/6) and 5376 → 72 → 6 → 6·448 = 2688.
  std::vector<float> big(16, 0.0f), qb(16);
  big[7] = 5376.0f;
  QuantizeRowNvfp4(big.data(), 16, input_scale, qb.data());
  EXPECT_EQ(qb[7], 2688.0f);
}

struct Case {
  QuantFormat format;
  int n, k, group;
  bool weight_only = false;  // NVFP4: FromNvfp4WeightOnly (activations unquantized)
};

QuantMatrix RandomMatrix(const Case& c, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-4, 4);
  if (c.format == QuantFormat::kFp8) {
    std::vector<uint8_t> codes(size_t(c.n) * c.k);
    std::uniform_int_distribution<int> code(0, 255);
    for (uint8_t& b : codes) {
      do b = uint8_t(code(rng));
      while ((b & 0x7f) == 0x7f);
    }
    std::vector<float> s(c.n);
    for (float& v : s) v = std::ldexp(std::fabs(d(rng)) + 0.1f, e(rng) - 8);
    return QuantMatrix::FromFp8(codes.data(), s.data(), c.n, c.k);
  }
  if (c.format == QuantFormat::kNvfp4) {
    std::vector<uint8_t> codes(size_t(c.n) * c.k), bs(size_t(c.n) * (c.k / 16));
    std::uniform_int_distribution<int> code(0, 15), sc(1, 0x7e);
    for (uint8_t& b : codes) b = uint8_t(code(rng));
    for (uint8_t& b : bs) b = uint8_t(sc(rng));  // positive e4m3 scales, subnormals included
    std::vector<float> g(c.n);
    for (int r = 0; r < c.n; ++r) g[r] = std::ldexp(std::fabs(d(rng)) + 0.1f, -10 + (r / 16) % 3);
    if (c.weight_only) {
      return QuantMatrix::FromNvfp4WeightOnly(codes.data(), bs.data(), g.data(), c.n, c.k);
    }
    return QuantMatrix::FromNvfp4(codes.data(), bs.data(), g.data(), 0.01f + 0.001f * c.n, c.n,
                                  c.k);
  }
  const int groups = (c.k + c.group - 1) / c.group;
  std::vector<int8_t> q(size_t(c.n) * c.k);
  std::uniform_int_distribution<int> qd(-8, 7);
  for (int8_t& v : q) v = int8_t(qd(rng));
  std::vector<float> s(size_t(c.n) * groups);
  for (float& v : s) v = std::ldexp(std::fabs(d(rng)) + 0.1f, e(rng) - 4);
  return QuantMatrix::FromInt4(q.data(), s.data(), c.n, c.k, c.group);
}

std::vector<float> RandomActivations(int m, int k, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::uniform_int_distribution<int> e(-5, 5);
  std::vector<float> x(size_t(m) * k);
  for (int i = 0; i < m; ++i) {
    const int row_exp = e(rng);  // rows of different magnitudes: per-token scales differ
    for (int c = 0; c < k; ++c) x[size_t(i) * k + c] = std::ldexp(d(rng), row_exp);
  }
  return x;
}

// The definition, scalar: the activations as the format takes them, one fma chain per output
// element over k ascending, then the FP8 epilogue. Also a float64 sum of the same products and
// the chain's error bound.
void Reference(const Case& c, const QuantMatrix& w, const std::vector<float>& x, int m,
               std::vector<float>* chain, std::vector<double>* exact, std::vector<double>* bound) {
  chain->assign(size_t(m) * c.n, 0.0f);
  exact->assign(size_t(m) * c.n, 0.0);
  bound->assign(size_t(m) * c.n, 0.0);
  std::vector<float> a(size_t(c.k));
  for (int i = 0; i < m; ++i) {
    float sx = 1.0f;
    if (c.format == QuantFormat::kFp8) {
      sx = QuantizeRowFp8(x.data() + size_t(i) * c.k, c.k, a.data());
    } else if (c.format == QuantFormat::kNvfp4 && !c.weight_only) {
      QuantizeRowNvfp4(x.data() + size_t(i) * c.k, c.k, w.InputScale(), a.data());
    } else {  // W4A16 and weight-only NVFP4: the float32 activations as they are
      std::copy(x.begin() + size_t(i) * c.k, x.begin() + size_t(i + 1) * c.k, a.begin());
    }
    for (int j = 0; j < c.n; ++j) {
      float acc = 0.0f;
      double sum = 0.0, mag = 0.0;
      for (int kk = 0; kk < c.k; ++kk) {
        const float wv = w.Widened(j, kk);
        acc = std::fma(a[kk], wv, acc);
        sum += double(a[kk]) * double(wv);
        mag += std::fabs(double(a[kk]) * double(wv));
      }
      const double scale = double(sx) * double(w.RowScale(j));
      (*chain)[size_t(i) * c.n + j] = c.format == QuantFormat::kFp8     ? sx * (w.RowScale(j) * acc)
                                      : c.format == QuantFormat::kNvfp4 ? w.RowScale(j) * acc
                                                                        : acc;
      (*exact)[size_t(i) * c.n + j] = sum * scale;
      // k roundings of at most 2⁻²⁴ of the running magnitude, plus two in the epilogue.
      (*bound)[size_t(i) * c.n + j] =
          (double(c.k) * 0x1p-24 * mag + 0x1p-22 * std::fabs(sum)) * scale;
    }
  }
}

class QuantGemmTest : public ::testing::TestWithParam<Case> {};

TEST_P(QuantGemmTest, EqualsTheChainBitForBitOnEveryIsaBatchedAndSolo) {
  const Case c = GetParam();
  std::mt19937 rng(1234 + c.n * 7 + c.k);
  const QuantMatrix w = RandomMatrix(c, rng);
  for (int m : {1, 5, 33, 300}) {
    const std::vector<float> x = RandomActivations(m, c.k, rng);
    std::vector<float> chain;
    std::vector<double> exact, bound;
    Reference(c, w, x, m, &chain, &exact, &bound);
    for (size_t e = 0; e < chain.size(); ++e) {
      ASSERT_LE(std::fabs(double(chain[e]) - exact[e]), bound[e]) << "float64 reference, m " << m;
    }
    for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}) {
      if (!GemmIsaSupported(isa)) continue;
      for (GemmThreads th : {GemmThreads::kOpenMp, GemmThreads::kCallerOnly}) {
        std::vector<float> y(size_t(m) * c.n, -1.0f);
        QuantLinear(x.data(), m, w, y.data(), isa, th);
        for (size_t e = 0; e < y.size(); ++e) {
          ASSERT_EQ(Bits(y[e]), Bits(chain[e])) << GemmIsaName(isa) << " m " << m << " element "
                                                << e << ": " << y[e] << " vs " << chain[e];
        }
      }
      // Solo: each row alone gives the batch's bits.
      for (int i = 0; i < m; i += std::max(1, m / 4)) {
        std::vector<float> y1(c.n);
        QuantLinear(x.data() + size_t(i) * c.k, 1, w, y1.data(), isa, GemmThreads::kOpenMp);
        for (int j = 0; j < c.n; ++j) ASSERT_EQ(Bits(y1[j]), Bits(chain[size_t(i) * c.n + j]));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantGemmTest,
    ::testing::Values(
        Case{QuantFormat::kFp8, 16, 64, 0}, Case{QuantFormat::kFp8, 37, 300, 0},
        Case{QuantFormat::kFp8, 96, 513, 0}, Case{QuantFormat::kFp8, 5, 7, 0},
        Case{QuantFormat::kW4A16, 16, 64, 32}, Case{QuantFormat::kW4A16, 37, 300, 100},
        Case{QuantFormat::kW4A16, 96, 512, 128}, Case{QuantFormat::kW4A16, 40, 96, 96},
        Case{QuantFormat::kNvfp4, 16, 64, 16}, Case{QuantFormat::kNvfp4, 37, 304, 16},
        Case{QuantFormat::kNvfp4, 96, 528, 16}, Case{QuantFormat::kNvfp4, 5, 16, 16},
        Case{QuantFormat::kNvfp4, 16, 64, 16, true}, Case{QuantFormat::kNvfp4, 37, 304, 16, true},
        Case{QuantFormat::kNvfp4, 96, 528, 16, true}, Case{QuantFormat::kNvfp4, 5, 16, 16, true}));

// The in-register path (quant_internal::QuantPath::kInRegister, what QuantLinear runs for few
// rows) against the widened-block path and the scalar chain, bit for bit: every format, m from 1
// to past the crossover (several row groups), n not a
// multiple of 16 or 32, k not a multiple of the k block (256) nor of the W4A16 group, on every
// ISA with those kernels. Plus an FP8 matrix holding every e4m3 code in every panel lane.
TEST(QuantGemmTest, InRegisterPathEqualsWidenedBlocksBitForBit) {
  using quant_internal::QuantPath;
  // 1–17 (0–2 full row groups and every remainder), then around and past the crossovers.
  std::vector<int> ms;
  for (int m = 1; m <= 17; ++m) ms.push_back(m);
  for (int m : {23, 31, 32, 33, 40}) ms.push_back(m);
  for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2}) {
    for (QuantFormat f : {QuantFormat::kFp8, QuantFormat::kW4A16, QuantFormat::kNvfp4}) {
      if (GemmIsaSupported(isa)) ASSERT_LT(quant_internal::QuantDirectMaxRows(isa, f), 40);
    }
  }
  const int max_m = ms.back();
  std::vector<std::pair<Case, QuantMatrix>> cases;
  std::mt19937 rng(91);
  for (const Case& c :
       {Case{QuantFormat::kFp8, 53, 300, 0}, Case{QuantFormat::kFp8, 16, 7, 0},
        Case{QuantFormat::kW4A16, 53, 600, 128}, Case{QuantFormat::kW4A16, 37, 300, 32},
        Case{QuantFormat::kW4A16, 21, 70, 32}, Case{QuantFormat::kNvfp4, 53, 528, 16},
        Case{QuantFormat::kNvfp4, 37, 304, 16, true}, Case{QuantFormat::kNvfp4, 5, 16, 16}}) {
    cases.emplace_back(c, RandomMatrix(c, rng));
  }
  {
    const Case c{QuantFormat::kFp8, 35, 256, 0};
    std::vector<uint8_t> codes(size_t(c.n) * c.k);
    for (int r = 0; r < c.n; ++r) {
      for (int kk = 0; kk < c.k; ++kk) {
        const uint8_t b = uint8_t(kk + 7 * r);
        codes[size_t(r) * c.k + kk] = (b & 0x7f) == 0x7f ? uint8_t(b - 1) : b;  // no NaN
      }
    }
    std::vector<float> s(c.n);
    for (int r = 0; r < c.n; ++r) s[r] = std::ldexp(1.0f + r / 64.0f, -6);
    cases.emplace_back(c, QuantMatrix::FromFp8(codes.data(), s.data(), c.n, c.k));
  }
  int checked = 0;
  for (const auto& [c, w] : cases) {
    const std::vector<float> xs = RandomActivations(max_m, c.k, rng);
    std::vector<float> chain;
    std::vector<double> exact, bound;
    Reference(c, w, xs, max_m, &chain, &exact, &bound);
    for (size_t e = 0; e < chain.size(); ++e) {
      ASSERT_LE(std::fabs(double(chain[e]) - exact[e]), bound[e]) << "float64 reference";
    }
    for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2}) {
      if (!GemmIsaSupported(isa)) continue;
      for (int m : ms) {
        const std::vector<float> x(xs.begin(), xs.begin() + size_t(m) * c.k);
        std::vector<float> reg(size_t(m) * c.n, -1.0f), block(size_t(m) * c.n, -2.0f),
            autop(size_t(m) * c.n, -3.0f);
        quant_internal::QuantLinearPath(x.data(), m, w, reg.data(), isa, GemmThreads::kOpenMp,
                                        QuantPath::kInRegister);
        quant_internal::QuantLinearPath(x.data(), m, w, block.data(), isa, GemmThreads::kCallerOnly,
                                        QuantPath::kWidenBlock);
        QuantLinear(x.data(), m, w, autop.data(), isa, GemmThreads::kOpenMp);
        for (size_t e = 0; e < reg.size(); ++e) {
          ASSERT_EQ(Bits(reg[e]), Bits(block[e]))
              << QuantFormatName(c.format) << " n " << c.n << " k " << c.k << " "
              << GemmIsaName(isa) << " m " << m << " element " << e << ": " << reg[e] << " vs "
              << block[e];
          ASSERT_EQ(Bits(reg[e]), Bits(chain[e])) << GemmIsaName(isa) << " m " << m << " " << e;
          ASSERT_EQ(Bits(autop[e]), Bits(chain[e])) << GemmIsaName(isa) << " m " << m << " " << e;
        }
        ++checked;
      }
    }
  }
  if (GemmIsaSupported(GemmIsa::kAvx2)) EXPECT_GT(checked, 0);
}

// Random NVFP4 weights [n, k]: every e2m1 code, e4m3 block scales 8..0x60 and the per-row
// weight_scale_2 of two modules stacked (rows < 20 and the rest).
struct RandomNvfp4 {
  RandomNvfp4(std::mt19937& rng, int n, int k)
      : codes(size_t(n) * k), block_scales(size_t(n) * (k / 16)), weight_global(n) {
    std::uniform_int_distribution<int> code(0, 15), sc(8, 0x60);
    for (uint8_t& b : codes) b = uint8_t(code(rng));
    for (uint8_t& b : block_scales) b = uint8_t(sc(rng));
    for (int r = 0; r < n; ++r) weight_global[r] = r < 20 ? 0.003f : 0.0021f;
  }
  std::vector<uint8_t> codes, block_scales;
  std::vector<float> weight_global;
};

// Weight-only NVFP4 (NVFP4A16) against its definition in float64, from the codes and scales given
// (not the matrix's accessors): y = weight_scale_2 · Σ_b sw_b · Σ_{k ∈ b} x · e2m1(w_q), the
// activations unquantized. The bound is the float32 chain's; quantizing the activations anyway
// (the W4A4 matrix of the same weights, input_scale 1 so that alpha is the same) is checked to
// break it, so the test would catch that mistake.
TEST(QuantGemmTest, Nvfp4WeightOnlyMatchesTheDefinitionInFloat64) {
  std::mt19937 rng(78);
  const int n = 40, k = 320, m = 7, nb = k / 16;
  const RandomNvfp4 r4(rng, n, k);
  const std::vector<uint8_t>&codes = r4.codes, &bs = r4.block_scales;
  const std::vector<float>& g = r4.weight_global;
  const QuantMatrix w = QuantMatrix::FromNvfp4WeightOnly(codes.data(), bs.data(), g.data(), n, k);
  EXPECT_TRUE(w.nvfp4_weight_only());
  EXPECT_EQ(w.RowScale(0), 0.003f);  // alpha = weight_scale_2, no input scale
  EXPECT_EQ(w.RowScale(25), 0.0021f);
  const QuantMatrix w4a4 = QuantMatrix::FromNvfp4(codes.data(), bs.data(), g.data(), 1.0f, n, k);
  EXPECT_FALSE(w4a4.nvfp4_weight_only());
  const std::vector<float> x = RandomActivations(m, k, rng);
  // The e2m1 values of the codes, from the format's table (sign bit 3).
  static const double kE2m1[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  auto e2m1 = [](uint8_t c) { return (c & 8 ? -1.0 : 1.0) * kE2m1[c & 7]; };
  std::vector<double> want(size_t(m) * n), bound(size_t(m) * n);
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double sum = 0, mag = 0;
      for (int b = 0; b < nb; ++b) {
        double inner = 0, inner_mag = 0;
        for (int c = 16 * b; c < 16 * b + 16; ++c) {
          const double p = double(x[size_t(i) * k + c]) * e2m1(codes[size_t(j) * k + c]);
          inner += p;
          inner_mag += std::fabs(p);
        }
        const double s = double(E4m3ToFloat(bs[size_t(j) * nb + b]));
        sum += s * inner;
        mag += s * inner_mag;
      }
      want[size_t(i) * n + j] = double(g[j]) * sum;
      bound[size_t(i) * n + j] =
          double(g[j]) * (k * 0x1p-24 * mag) + 0x1p-23 * std::fabs(want[size_t(i) * n + j]);
      ASSERT_GT(mag, 0.0);
    }
  }
  for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}) {
    if (!GemmIsaSupported(isa)) continue;
    std::vector<float> y(size_t(m) * n);
    QuantLinear(x.data(), m, w, y.data(), isa, GemmThreads::kOpenMp);
    for (size_t e = 0; e < y.size(); ++e) {
      ASSERT_LE(std::fabs(double(y[e]) - want[e]), bound[e])
          << GemmIsaName(isa) << " element " << e;
    }
    // Each row alone gives the batch's bits.
    for (int i = 0; i < m; ++i) {
      std::vector<float> y1(n);
      QuantLinear(x.data() + size_t(i) * k, 1, w, y1.data(), isa, GemmThreads::kCallerOnly);
      for (int j = 0; j < n; ++j) ASSERT_EQ(Bits(y1[j]), Bits(y[size_t(i) * n + j]));
    }
    // The broken variant (activations quantized to NVFP4 anyway) is outside the bound.
    std::vector<float> yq(size_t(m) * n);
    QuantLinear(x.data(), m, w4a4, yq.data(), isa, GemmThreads::kOpenMp);
    int outside = 0;
    for (size_t e = 0; e < yq.size(); ++e) outside += std::fabs(double(yq[e]) - want[e]) > bound[e];
    EXPECT_GT(outside, int(yq.size()) / 2) << GemmIsaName(isa);
  }
}

// NVFP4 against the format's definition in float64, independent of the GEMM's factoring:
// y = input_scale · weight_scale_2 · Σ_b sx_b · sw_b · Σ_{k ∈ b} e2m1(x_q) · e2m1(w_q), with the
// activations' codes and block scales recomputed here from the definition (gemm_quant.h).
TEST(QuantGemmTest, Nvfp4MatchesTheBlockScaledDefinitionInFloat64) {
  std::mt19937 rng(77);
  const int n = 40, k = 320, m = 7, nb = k / 16;
  const RandomNvfp4 r4(rng, n, k);
  const std::vector<uint8_t>&codes = r4.codes, &bs = r4.block_scales;
  const std::vector<float>& g = r4.weight_global;
  const float input_scale = 0.05f;
  const QuantMatrix w =
      QuantMatrix::FromNvfp4(codes.data(), bs.data(), g.data(), input_scale, n, k);
  const std::vector<float> x = RandomActivations(m, k, rng);
  for (GemmIsa isa : {GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}) {
    if (!GemmIsaSupported(isa)) continue;
    std::vector<float> y(size_t(m) * n);
    QuantLinear(x.data(), m, w, y.data(), isa, GemmThreads::kOpenMp);
    for (int i = 0; i < m; ++i) {
      // The activation's codes, from the definition with float32 steps.
      const float gi = 1.0f / input_scale, inv = 1.0f / gi;
      std::vector<double> xs(nb);
      std::vector<double> xv(k);
      double mag_total = 0;
      for (int b = 0; b < nb; ++b) {
        float amax = 0;
        for (int c = 16 * b; c < 16 * b + 16; ++c)
          amax = std::max(amax, std::fabs(x[size_t(i) * k + c]));
        const float s = E4m3ToFloat(FloatToE4m3(gi * (amax * (1.0f / 6.0f))));
        xs[b] = s;
        const float o = s != 0 ? 1.0f / (s * inv) : 0.0f;
        for (int c = 16 * b; c < 16 * b + 16; ++c) {
          xv[c] = E2m1ToFloat(FloatToE2m1(x[size_t(i) * k + c] * o));
        }
      }
      for (int j = 0; j < n; ++j) {
        double sum = 0, mag = 0;
        for (int b = 0; b < nb; ++b) {
          double inner = 0, inner_mag = 0;
          for (int c = 16 * b; c < 16 * b + 16; ++c) {
            const double p = xv[c] * double(E2m1ToFloat(codes[size_t(j) * k + c]));
            inner += p;
            inner_mag += std::fabs(p);
          }
          const double s = xs[b] * double(E4m3ToFloat(bs[size_t(j) * nb + b]));
          sum += s * inner;
          mag += s * inner_mag;
        }
        const double alpha = double(float(input_scale * g[j]));
        const double want = alpha * sum;
        const double bound = alpha * (k * 0x1p-24 * mag) + 0x1p-23 * std::fabs(want);
        mag_total += mag;
        ASSERT_LE(std::fabs(double(y[size_t(i) * n + j]) - want), bound)
            << GemmIsaName(isa) << " row " << i << " col " << j;
      }
      ASSERT_GT(mag_total, 0.0);
    }
  }
}

TEST(QuantGemmTest, PackedMatrixHookRunsTheQuantizedGemm) {
  std::mt19937 rng(5);
  const Case c{QuantFormat::kFp8, 24, 40, 0};
  QuantMatrix w = RandomMatrix(c, rng);
  const std::vector<float> x = RandomActivations(3, c.k, rng);
  std::vector<float> direct(3 * c.n), via(3 * c.n);
  QuantLinear(x.data(), 3, w, direct.data());
  const float w00 = w.Dequantized(0, 0);
  const PackedMatrix p = PackedMatrix::Quantized(std::move(w));
  EXPECT_EQ(p.rows(), c.n);
  EXPECT_EQ(p.cols(), c.k);
  EXPECT_EQ(p.At(0, 0), w00);
  EXPECT_EQ(p.bytes(), size_t(32 * 40 + 32 * 4));
  Linear(x.data(), 3, p, via.data());
  for (size_t e = 0; e < via.size(); ++e) EXPECT_EQ(Bits(via[e]), Bits(direct[e]));
}

}  // namespace
}  // namespace dgserve::cpu
