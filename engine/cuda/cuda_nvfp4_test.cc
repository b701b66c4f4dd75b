// The NVFP4 kernels (cuda_nvfp4.h) against the CPU's NVFP4 code (engine/cpu/gemm_quant.h; label
// `gpu`, skipped without a GPU, and `gpu-emu`): the activation quantization bit for bit against
// cpu::QuantizeRowNvfp4Global on crafted edge cases (zero blocks, huge and infinite values, every
// e2m1 rounding tie, tiny values down to float32 denormals, e4m3 block scales saturated and
// subnormal) and random rows; the grouped expert GEMMs and the dense layer against a float64
// reference of the same quantized values (the CPU's quantized activations and
// cpu::QuantMatrix::Widened weights) and against cpu::QuantLinear, within float32 summation
// error (the products are exact: see cuda_nvfp4.h); and a row alone against the same row in a
// batch, bit for bit. The GEMM tests run both NVFP4 flavours: W4A4 and weight-only (NVFP4A16,
// cpu::QuantMatrix::FromNvfp4WeightOnly: the float32 activations unquantized, alpha =
// weight_scale_2), whose float64 reference is Σ x · Widened · RowScale.
#include "engine/cuda/cuda_nvfp4.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/fp8.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cuda/cuda_moe_test_util.h"
#include "engine/cuda/cuda_test_util.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;
using moe_testing::Bits;
using moe_testing::RandomFloats;

using Nvfp4Test = CudaTest;

// ---- Activation quantization
// ---------------------------------------------------------------------

// Rows of 64 inputs (4 blocks) exercising the edge cases, for g = 1 (then sx = 1 for a block of
// absmax 6, o = 1 and x_q = x: the e2m1 ties are hit exactly).
std::vector<float> EdgeRows() {
  const float inf = std::numeric_limits<float>::infinity();
  const float den = std::numeric_limits<float>::denorm_min();
  std::vector<std::vector<float>> blocks = {
      // Every e2m1 rounding boundary (ties to the even code), signs, ±0, saturation at 6.
      {6.0f, 0.25f, -0.25f, 0.75f, -0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, -5.0f, 5.5f, 0.1f, -0.1f,
       -0.0f, 1e-8f},
      // Just off the boundaries.
      {-6.0f, 0.2500001f, 0.7499999f, 1.2500001f, 1.7499999f, 2.5000002f, 3.4999998f, 5.0000005f,
       0.24999999f, -0.7500001f, -1.75f, -2.5f, -3.5f, 4.0f, 3.0f, 1.5f},
      {},  // zeros
      // Huge values: absmax · g / 6 above 448 (sx saturates), an infinity, float max.
      {1e30f, -2e30f, 3.0f, 1e29f, 5e29f, -7e29f, 0.0f, 1.0f, 2e30f, 1e30f, -1e30f, 6e29f, 9e29f,
       4e29f, 2.5e29f, 1.5e29f},
      {inf, -inf, 1.0f, -1.0f, 1e38f, 3.4e38f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 1e37f, 0, 0, 0, 0, 0,
       0, 0, 0, 0, 0, 0, 0, 0},
      // Tiny values: sx in e4m3's subnormals (2⁻⁹ …), rounded to 0, and float32 denormals.
      {0.01f, -0.005f, 0.0025f, 0.001f, 0.0f, 0.0075f, -0.01f, 0.003f, 0.004f, 0.006f, 0.002f,
       -0.0011f, 0.0001f, 0.009f, 0.008f, 0.007f},
      {1e-3f, -5e-4f, 2e-4f, 1e-4f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3e-4f},
      {den, -den, 8 * den, 1e-40f, -3e-39f, 1e-45f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
      {0.0117f, 0.0118f, 0.0351f, -0.0352f, 0.0586f, 0.0585f, 0.001f, 0.002f, 0, 0, 0, 0, 0, 0, 0,
       0},
      // sx on an e4m3 rounding tie: absmax / 6 = 1.0625 (between 1 and 1.125; ties to 1).
      {6.375f, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 0.5f, -0.5f, 1.5f, 0, 0, 0, 0, 0, 0},
      {6.375f * 3, 1.0f, 2.0f, 3.0f, 4.0f, 5.0f, 6.0f, 0.5f, -0.5f, 1.5f, 18.0f, 0, 0, 0, 0, 0},
  };
  std::vector<float> rows;
  for (auto& b : blocks) {
    b.resize(16, 0.0f);
    rows.insert(rows.end(), b.begin(), b.end());
  }
  while (rows.size() % 64 != 0) rows.push_back(0.0f);
  return rows;
}

// Blocks on which the order of the reciprocal's operations matters: for a random g, the CPU's
// o = 1 / (sx · (1/g)) and the naive g / sx differ by an ulp, and values x near an e2m1 rounding
// boundary b / o are picked where x · o and x · (g / sx) round to different e2m1 values. Returns
// (g, a 16-input block [6, x…, 0…]) pairs; the expected values still come from the CPU function.
std::vector<std::pair<float, std::vector<float>>> DivisionSensitiveBlocks() {
  std::vector<std::pair<float, std::vector<float>>> out;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> dist(0.1f, 100.0f);
  auto e2m1 = [](float v) { return E2m1ToFloat(FloatToE2m1(v)); };
  for (int tries = 0; tries < 1000 && out.size() < 6; ++tries) {
    const float g = dist(gen);
    const float sx = RoundToE4m3(g * (6.0f * (1.0f / 6.0f)));
    const float o = 1.0f / (sx * (1.0f / g)), naive = g / sx;
    if (o == naive) continue;
    std::vector<float> block = {6.0f};
    for (float b : {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f}) {
      float x = std::nextafter(b / o, 0.0f);
      for (int i = 0; i < 8; ++i) x = std::nextafter(x, 0.0f);
      for (int i = 0; i < 16 && block.size() < 16; ++i, x = std::nextafter(x, 100.0f)) {
        if (e2m1(x * o) != e2m1(x * naive)) {
          block.push_back(x);
          break;
        }
      }
    }
    if (block.size() == 1) continue;
    block.resize(16, 0.0f);
    out.push_back({g, block});
  }
  return out;
}

TEST_F(Nvfp4Test, ActivationQuantizationIsTheCpuBits) {
  struct Case {
    std::vector<float> x;
    int in;
    float g;
  };
  std::vector<Case> cases;
  const std::vector<float> edge = EdgeRows();
  for (float g : {1.0f, 6.0f, 0.01f, 1.0f / 6.0f, 448.0f * 6.0f / 3.7f, 1e-30f, 1e30f}) {
    cases.push_back({edge, 64, g});
  }
  const auto sensitive = DivisionSensitiveBlocks();
  EXPECT_GE(sensitive.size(), 3u);
  for (const auto& [g, block] : sensitive) cases.push_back({block, 16, g});
  uint32_t seed = 11;
  for (float g : {1.0f, 6.0f, 37.5f}) {
    for (float scale : {1e-3f, 1.0f, 40.0f, 1e4f}) {
      cases.push_back({RandomFloats(9 * 48, -scale, scale, seed++), 48, g});
    }
  }
  int64_t compared = 0, nonzero = 0, negzero = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "g " << c.g << " in " << c.in);
    const int rows = int(c.x.size()) / c.in;
    uint16_t* q = Alloc<uint16_t>(c.x.size(), 0xFF);
    ASSERT_THAT(QuantizeNvfp4Activations(Upload(c.x), rows, c.in, c.g, q), IsOk());
    const std::vector<uint16_t> got = Download(q, c.x.size());
    std::vector<float> want(c.x.size());
    for (int r = 0; r < rows; ++r) {
      cpu::QuantizeRowNvfp4Global(&c.x[size_t(r) * c.in], c.in, c.g, &want[size_t(r) * c.in]);
    }
    int bad = 0;
    for (size_t i = 0; i < c.x.size(); ++i) {
      // The CPU's value is a bf16 value (exact): its top 16 bits are the device's.
      ASSERT_EQ(Bits(want[i]) & 0xffffu, 0u) << "CPU value " << want[i] << " is not a bf16 value";
      ++compared;
      nonzero += want[i] != 0.0f;
      negzero += Bits(want[i]) == 0x80000000u;
      if (Bits(Bf16ToFloat(got[i])) != Bits(want[i]) && ++bad <= 5) {
        ADD_FAILURE() << "x[" << i << "] = " << c.x[i] << ": device " << Bf16ToFloat(got[i])
                      << ", CPU " << want[i];
      }
    }
    EXPECT_EQ(bad, 0);
  }
  std::printf("activation quantization: %lld values bit-identical (%lld nonzero, %lld −0)\n",
              (long long)compared, (long long)nonzero, (long long)negzero);
  EXPECT_GT(nonzero, compared / 2);
  EXPECT_GT(negzero, 0);
  EXPECT_THAT(QuantizeNvfp4Activations(nullptr, 1, 24, 1.0f, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(QuantizeNvfp4Activations(nullptr, 1, 16, 0.0f, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

// The CPU's value table itself (the device code has its own bit formulas for both).
TEST(Nvfp4ValuesTest, CodesDecodeAsTheFormatsSay) {
  const float e2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(E2m1ToFloat(uint8_t(c)), c < 8 ? e2m1[c] : -e2m1[c - 8]);
  EXPECT_EQ(E4m3ToFloat(0x01), 0x1p-9f);
  EXPECT_EQ(E4m3ToFloat(0x7e), 448.0f);
}

// ---- NVFP4 weights
// -------------------------------------------------------------------------------

// E experts of [rows, in] NVFP4 weights, random codes and block scales (e4m3 codes 0x00 … 0x4f:
// subnormals, zero and normal values up to 30), weight_scale_2 per module (split: the first
// `split` rows one module, the rest another, as gate and up), input_scale per expert; the CPU's
// QuantMatrix of each and the device layout of Nvfp4Weights. weight_only: FromNvfp4WeightOnly
// (the same codes, block scales and weight_scale_2; no input_scale).
struct Nvfp4Experts {
  int E, rows, in;
  bool weight_only;
  std::vector<cpu::QuantMatrix> q;
  std::vector<uint32_t> words;
  std::vector<uint8_t> scales;
  std::vector<float> alpha, g;

  Nvfp4Experts(int E_, int rows_, int in_, int split, uint32_t seed, bool weight_only_ = false)
      : E(E_), rows(rows_), in(in_), weight_only(weight_only_) {
    std::mt19937 gen(seed);
    std::uniform_int_distribution<int> code(0, 15), sc(0, 0x4f);
    std::uniform_real_distribution<float> ws2(0.001f, 0.01f), is(0.05f, 0.5f);
    for (int e = 0; e < E; ++e) {
      std::vector<uint8_t> codes(size_t(rows) * in), bs(size_t(rows) * (in / 16));
      for (uint8_t& c : codes) c = uint8_t(code(gen));
      for (uint8_t& s : bs) s = uint8_t(sc(gen));
      const float w_gate = ws2(gen), w_up = ws2(gen);
      std::vector<float> global(rows);
      for (int r = 0; r < rows; ++r) global[r] = r < split ? w_gate : w_up;
      const float input_scale = is(gen);
      q.push_back(weight_only ? cpu::QuantMatrix::FromNvfp4WeightOnly(codes.data(), bs.data(),
                                                                      global.data(), rows, in)
                              : cpu::QuantMatrix::FromNvfp4(codes.data(), bs.data(), global.data(),
                                                            input_scale, rows, in));
      for (int r = 0; r < rows; ++r) {
        for (int c = 0; c < in; c += 8) {
          uint32_t w = 0;
          for (int i = 0; i < 8; ++i) w |= uint32_t(codes[size_t(r) * in + c + i]) << (4 * i);
          words.push_back(w);
        }
        scales.insert(scales.end(), bs.begin() + size_t(r) * (in / 16),
                      bs.begin() + size_t(r + 1) * (in / 16));
        alpha.push_back(q.back().RowScale(r));
      }
      g.push_back(q.back().InputGlobal());
    }
  }
};

class Nvfp4GemmTest : public CudaTest {
 protected:
  // Weight-only: no g on the device (the kernel must not need it).
  Nvfp4Weights Device(const Nvfp4Experts& w) {
    return {Upload(w.words), Upload(w.scales), Upload(w.alpha),
            w.weight_only ? nullptr : Upload(w.g), w.weight_only};
  }
};

// The activations the CPU multiplies by the widened weights (cpu::QuantLinear): NVFP4-quantized
// with q's g (QuantizeRowNvfp4Global), or for a weight-only q the float32 row itself.
void CpuActivations(const float* x, int k, const cpu::QuantMatrix& q, float* a) {
  if (q.nvfp4_weight_only()) {
    std::copy_n(x, k, a);
  } else {
    cpu::QuantizeRowNvfp4Global(x, k, q.InputGlobal(), a);
  }
}

const char* Flavour(bool weight_only) { return weight_only ? "weight-only" : "W4A4"; }

// Σ a·W over the CPU's quantized activations a and widened weights, in float64, with Σ |a·W|.
void Dot(const float* a, const cpu::QuantMatrix& q, int r, double* sum, double* abs_sum) {
  double s = 0, t = 0;
  for (int c = 0; c < q.cols(); ++c) {
    const double p = double(a[c]) * q.Widened(r, c);
    s += p, t += std::fabs(p);
  }
  *sum = s, *abs_sum = t;
}

double Gelu(double g) {
  return 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

// Relative float32 summation error allowed per Σ|products| (the products themselves are exact):
// the tensor cores' float32 accumulation over at most a few hundred terms, with a margin.
constexpr double kSumTol = 1e-5;

TEST_F(Nvfp4GemmTest, GroupedGemmsMatchFloat64AndCpu) {
  struct Shape {
    int R, E, K, D, F;
  };
  const std::vector<Shape> shapes = {
      {50, 4, 1, 144, 80}, {37, 8, 2, 80, 48}, {5, 16, 4, 32, 112}, {70, 3, 2, 64, 32}};
  for (bool weight_only : {false, true}) {
    uint32_t seed = 900;
    double worst_f64 = 0, worst_cpu = 0;
    for (const Shape& s : shapes) {
      const int R = s.R, E = s.E, K = s.K, D = s.D, F = s.F;
      SCOPED_TRACE(::testing::Message() << Flavour(weight_only) << " R " << R << " E " << E << " K "
                                        << K << " D " << D << " F " << F);
      const size_t n = size_t(R) * K;
      const std::vector<float> x = RandomFloats(size_t(R) * D, -3.0f, 3.0f, seed++);
      // Routing: each row picks K distinct experts; rows grouped by expert in row order.
      std::mt19937 gen(seed++);
      std::vector<std::vector<int>> by_expert(E);
      std::vector<int> ids(E);
      for (int r = 0; r < R; ++r) {
        for (int e = 0; e < E; ++e) ids[e] = e;
        std::shuffle(ids.begin(), ids.end(), gen);
        for (int j = 0; j < K; ++j) by_expert[ids[j]].push_back(r);
      }
      std::vector<int32_t> offsets = {0}, gather;
      for (int e = 0; e < E; ++e) {
        for (int r : by_expert[e]) gather.push_back(r);
        offsets.push_back(int32_t(gather.size()));
      }
      const std::vector<float> slot_weight = RandomFloats(n, 0.1f, 1.0f, seed++);
      const Nvfp4Experts wgu(E, 2 * F, D, F, seed++, weight_only),
          wd(E, D, F, D, seed++, weight_only);
      const int32_t* d_offsets = Upload(offsets);
      float* act = Alloc<float>(n * F, 0xFF);
      ASSERT_THAT(
          MoeGateUpNvfp4(Upload(x), Upload(gather), d_offsets, Device(wgu), R, K, E, D, F, act),
          IsOk());
      const std::vector<float> got_act = Download(act, n * F);
      float* y = Alloc<float>(n * D, 0xFF);
      ASSERT_THAT(MoeDownNvfp4(act, d_offsets, Upload(slot_weight), Device(wd), R, K, E, F, D, y),
                  IsOk());
      const std::vector<float> got_y = Download(y, n * D);
      int bad = 0;
      for (int e = 0; e < E; ++e) {
        const int g0 = offsets[e], m = offsets[e + 1] - g0;
        if (m == 0) continue;
        // gate_up: the gathered rows, quantized as the CPU does, and the CPU's QuantLinear.
        std::vector<float> xe(size_t(m) * D), aq(size_t(m) * D), gu(size_t(m) * 2 * F);
        for (int i = 0; i < m; ++i) {
          std::copy_n(&x[size_t(gather[g0 + i]) * D], D, &xe[size_t(i) * D]);
          CpuActivations(&xe[size_t(i) * D], D, wgu.q[e], &aq[size_t(i) * D]);
        }
        cpu::QuantLinear(xe.data(), m, wgu.q[e], gu.data());
        for (int i = 0; i < m; ++i) {
          for (int f = 0; f < F; ++f) {
            double gs, ga, us, ua;
            Dot(&aq[size_t(i) * D], wgu.q[e], f, &gs, &ga);
            Dot(&aq[size_t(i) * D], wgu.q[e], F + f, &us, &ua);
            const double al_g = wgu.q[e].RowScale(f), al_u = wgu.q[e].RowScale(F + f);
            gs *= al_g, ga *= al_g, us *= al_u, ua *= al_u;
            const double want = Gelu(gs) * us;
            const double tol = kSumTol * (1.2 * ga * std::fabs(us) + std::fabs(Gelu(gs)) * ua) +
                               1e-6 * std::fabs(want) + 1e-30;
            const double got = got_act[size_t(g0 + i) * F + f];
            worst_f64 = std::max(worst_f64, std::fabs(got - want) / tol);
            const float cg = gu[size_t(i) * 2 * F + f], cu = gu[size_t(i) * 2 * F + F + f];
            const double cpu = Gelu(cg) * cu;
            worst_cpu = std::max(worst_cpu, std::fabs(got - cpu) / (2 * tol));
            if (!(std::fabs(got - want) <= tol && std::fabs(got - cpu) <= 2 * tol) && ++bad <= 5) {
              ADD_FAILURE() << "gate_up expert " << e << " act[" << g0 + i << ", " << f
                            << "] = " << got << ", float64 " << want << ", CPU " << cpu;
            }
          }
        }
        // down, on the device's act (its inputs, exactly).
        std::vector<float> ae(got_act.begin() + size_t(g0) * F,
                              got_act.begin() + size_t(g0 + m) * F);
        std::vector<float> dq(ae.size()), cy(size_t(m) * D);
        for (int i = 0; i < m; ++i) {
          CpuActivations(&ae[size_t(i) * F], F, wd.q[e], &dq[size_t(i) * F]);
        }
        cpu::QuantLinear(ae.data(), m, wd.q[e], cy.data());
        for (int i = 0; i < m; ++i) {
          const double sw = slot_weight[g0 + i];
          for (int d = 0; d < D; ++d) {
            double ds, da;
            Dot(&dq[size_t(i) * F], wd.q[e], d, &ds, &da);
            const double al = wd.q[e].RowScale(d);
            const double want = sw * al * ds;
            const double tol = kSumTol * sw * al * da + 1e-6 * std::fabs(want) + 1e-30;
            const double got = got_y[size_t(g0 + i) * D + d];
            const double cpu = sw * cy[size_t(i) * D + d];
            worst_f64 = std::max(worst_f64, std::fabs(got - want) / tol);
            worst_cpu = std::max(worst_cpu, std::fabs(got - cpu) / (2 * tol));
            if (!(std::fabs(got - want) <= tol && std::fabs(got - cpu) <= 2 * tol) && ++bad <= 5) {
              ADD_FAILURE() << "down expert " << e << " y[" << g0 + i << ", " << d << "] = " << got
                            << ", float64 " << want << ", CPU " << cpu;
            }
          }
        }
      }
      EXPECT_EQ(bad, 0);
    }
    std::printf("NVFP4 %s grouped GEMMs: worst |error| / tolerance: %.3g vs float64, %.3g vs CPU\n",
                Flavour(weight_only), worst_f64, worst_cpu);
  }
}

// A gathered row computed alone (its expert's only row, in a batch of one) gives the bits it gets
// inside the full batch, for both projections.
TEST_F(Nvfp4GemmTest, RowAloneEqualsRowInBatch) {
  for (bool weight_only : {false, true}) {
    SCOPED_TRACE(Flavour(weight_only));
    const int R = 45, E = 4, K = 2, D = 96, F = 64;
    const size_t n = size_t(R) * K;
    const std::vector<float> x = RandomFloats(size_t(R) * D, -2.0f, 2.0f, 71);
    std::vector<int32_t> offsets = {0}, gather;
    for (int e = 0; e < E; ++e) {  // rows r with r % E ∈ {e, e + 1 mod E}: each row in 2 experts
      for (int r = 0; r < R; ++r) {
        if (r % E == e || (r + 1) % E == e) gather.push_back(r);
      }
      offsets.push_back(int32_t(gather.size()));
    }
    ASSERT_EQ(gather.size(), n);
    const std::vector<float> slot_weight = RandomFloats(n, 0.1f, 1.0f, 72);
    const Nvfp4Experts wgu(E, 2 * F, D, F, 73, weight_only), wd(E, D, F, D, 74, weight_only);
    const Nvfp4Weights d_wgu = Device(wgu), d_wd = Device(wd);
    float* act = Alloc<float>(n * F, 0xFF);
    float* y = Alloc<float>(n * D, 0xFF);
    const int32_t* d_offsets = Upload(offsets);
    ASSERT_THAT(MoeGateUpNvfp4(Upload(x), Upload(gather), d_offsets, d_wgu, R, K, E, D, F, act),
                IsOk());
    ASSERT_THAT(MoeDownNvfp4(act, d_offsets, Upload(slot_weight), d_wd, R, K, E, F, D, y), IsOk());
    const std::vector<float> batch_act = Download(act, n * F), batch_y = Download(y, n * D);
    for (int g : {0, 17, int(n) - 1}) {
      const int e = int(std::upper_bound(offsets.begin(), offsets.end(), g) - offsets.begin()) - 1;
      std::vector<int32_t> one(E + 1, 0);
      for (int j = e + 1; j <= E; ++j) one[j] = 1;
      const std::vector<int32_t> gather1 = {gather[g]};
      float* act1 = Alloc<float>(F, 0xFF);
      float* y1 = Alloc<float>(D, 0xFF);
      const int32_t* d_one = Upload(one);
      // R = 1, K = 1: a batch of one token row routed to expert e alone.
      ASSERT_THAT(MoeGateUpNvfp4(Upload(x), Upload(gather1), d_one, d_wgu, 1, 1, E, D, F, act1),
                  IsOk());
      ASSERT_THAT(MoeDownNvfp4(act1, d_one, Upload(std::vector<float>{slot_weight[g]}), d_wd, 1, 1,
                               E, F, D, y1),
                  IsOk());
      const std::vector<float> a1 = Download(act1, F), y1h = Download(y1, D);
      for (int f = 0; f < F; ++f) {
        ASSERT_EQ(Bits(a1[f]), Bits(batch_act[size_t(g) * F + f])) << "row " << g << " f " << f;
      }
      for (int d = 0; d < D; ++d) {
        ASSERT_EQ(Bits(y1h[d]), Bits(batch_y[size_t(g) * D + d])) << "row " << g << " d " << d;
      }
    }
  }
}

// The dense layer: one group of all rows, against float64 and QuantLinear; each row alone gives
// its bits in the batch.
TEST_F(Nvfp4GemmTest, DenseLinearMatchesFloat64AndCpuAndIsRowInvariant) {
  for (bool weight_only : {false, true}) {
    for (const auto& [rows, in, out] : {std::tuple{67, 160, 72}, std::tuple{3, 32, 200}}) {
      SCOPED_TRACE(::testing::Message()
                   << Flavour(weight_only) << " rows " << rows << " in " << in << " out " << out);
      const Nvfp4Experts w(1, out, in, out, 500 + rows, weight_only);
      const Nvfp4Weights dw = Device(w);
      const std::vector<float> x = RandomFloats(size_t(rows) * in, -4.0f, 4.0f, 600 + rows);
      const float* d_x = Upload(x);
      float* y = Alloc<float>(size_t(rows) * out, 0xFF);
      ASSERT_THAT(DenseLinearNvfp4(d_x, dw, rows, in, out, y), IsOk());
      const std::vector<float> got = Download(y, size_t(rows) * out);
      std::vector<float> aq(x.size()), cy(size_t(rows) * out);
      for (int r = 0; r < rows; ++r)
        CpuActivations(&x[size_t(r) * in], in, w.q[0], &aq[size_t(r) * in]);
      cpu::QuantLinear(x.data(), rows, w.q[0], cy.data());
      int bad = 0;
      for (int r = 0; r < rows; ++r) {
        for (int o = 0; o < out; ++o) {
          double s, a;
          Dot(&aq[size_t(r) * in], w.q[0], o, &s, &a);
          const double al = w.q[0].RowScale(o);
          const double want = al * s, tol = kSumTol * al * a + 1e-6 * std::fabs(want) + 1e-30;
          const double v = got[size_t(r) * out + o], cpu = cy[size_t(r) * out + o];
          if (!(std::fabs(v - want) <= tol && std::fabs(v - cpu) <= 2 * tol) && ++bad <= 5) {
            ADD_FAILURE() << "y[" << r << ", " << o << "] = " << v << ", float64 " << want
                          << ", CPU " << cpu;
          }
        }
      }
      EXPECT_EQ(bad, 0);
      for (int r : {0, rows - 1}) {
        float* y1 = Alloc<float>(out, 0xFF);
        ASSERT_THAT(DenseLinearNvfp4(d_x + size_t(r) * in, dw, 1, in, out, y1), IsOk());
        const std::vector<float> one = Download(y1, out);
        for (int o = 0; o < out; ++o) {
          ASSERT_EQ(Bits(one[o]), Bits(got[size_t(r) * out + o])) << "row " << r << " o " << o;
        }
      }
    }
  }
  EXPECT_THAT(DenseLinearNvfp4(nullptr, Nvfp4Weights{}, 1, 16, 8, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  const Nvfp4Experts w(1, 8, 16, 8, 1);
  EXPECT_THAT(DenseLinearNvfp4(nullptr, Device(w), 1, 24, 8, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda
