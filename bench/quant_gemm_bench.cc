// The quantized GEMM (engine/cpu/gemm_quant.h) against the bf16 GEMM on the model's
// real-width shapes: MoE expert groups (gate_up [1408, 2816], down [2816, 704]) of 4–64 rows and
// the dense projections at canvas 256. Each shape: bf16, FP8 and W4A16 (group 128) timed in
// alternation, best of --rounds; prints ms per call and the ratio to bf16. --paths instead times
// QuantLinear's two ways on the expert shapes for --path_rows rows: the weights widened per k
// block into float32 then Gemm() ("block"), and widened in registers ("reg"), alternated, with
// the ratio reg / block (where the in-register path should take over: gemm_quant.cc).
//
//   OMP_WAIT_POLICY=passive build/bench/quant_gemm_bench [--rounds 5] [--min_seconds 0.3]
//   OMP_WAIT_POLICY=passive build/bench/quant_gemm_bench --paths [--path_rows 1,4,8,16,24,32]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "common/bf16.h"
#include "common/cli.h"
#include "common/fp8.h"
#include "engine/cpu/gemm_quant.h"
#include "engine/cpu/packed_matrix.h"
#include "worker/backend_env.h"

ABSL_FLAG(double, min_seconds, 0.3, "time each measurement for at least this long");
ABSL_FLAG(int, rounds, 3, "alternate the formats this many times per shape (best of all)");
ABSL_FLAG(bool, paths, false, "time QuantLinear's in-register path against the widened blocks");
ABSL_FLAG(std::vector<std::string>, path_rows,
          std::vector<std::string>({"1", "4", "8", "12", "16", "24", "32"}),
          "--paths: the row counts");

namespace dgserve::cpu {
namespace {

double Time(const std::function<void()>& f) {
  using Clock = std::chrono::steady_clock;
  int reps = 0;
  const auto t0 = Clock::now();
  double s = 0;
  do {
    f();
    ++reps;
    s = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (s < absl::GetFlag(FLAGS_min_seconds));
  return s / reps;
}

void Shape(const char* name, int m, int n, int k) {
  std::mt19937 rng(1);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(size_t(n) * k), x(size_t(m) * k), y(size_t(m) * n);
  for (float& v : w) v = d(rng) * 0.02f;
  for (float& v : x) v = d(rng);
  const PackedMatrix bf16 = PackedMatrix::FromFloat(w.data(), n, k);
  std::vector<uint8_t> codes(w.size());
  std::vector<float> rs(n);
  for (int r = 0; r < n; ++r) {
    float a = 0;
    for (int c = 0; c < k; ++c) a = std::max(a, std::fabs(w[size_t(r) * k + c]));
    rs[r] = a / 448;
    for (int c = 0; c < k; ++c) codes[size_t(r) * k + c] = FloatToE4m3(w[size_t(r) * k + c] / rs[r]);
  }
  const PackedMatrix fp8 = PackedMatrix::Quantized(QuantMatrix::FromFp8(codes.data(), rs.data(), n, k));
  const int g = 128, groups = (k + g - 1) / g;
  std::vector<int8_t> q(w.size());
  std::vector<float> gs(size_t(n) * groups, 0.02f / 7.5f * 4);
  for (size_t i = 0; i < q.size(); ++i) q[i] = int8_t(std::min(7, std::max(-8, int(std::lrint(w[i] / gs[0])))));
  const PackedMatrix w4 = PackedMatrix::Quantized(QuantMatrix::FromInt4(q.data(), gs.data(), n, k, g));
  double best[3] = {1e9, 1e9, 1e9};
  const PackedMatrix* mats[3] = {&bf16, &fp8, &w4};
  for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
    for (int f = 0; f < 3; ++f) {
      best[f] = std::min(best[f], Time([&] { Linear(x.data(), m, *mats[f], y.data()); }));
    }
  }
  std::printf("%-22s m %4d n %5d k %5d | bf16 %8.3f ms | fp8 %8.3f ms (%.2fx) | w4a16 %8.3f ms (%.2fx)\n",
              name, m, n, k, 1e3 * best[0], 1e3 * best[1], best[1] / best[0], 1e3 * best[2],
              best[2] / best[0]);
}

// QuantLinear's two paths on one shape, for FP8, W4A16 (group 128) and NVFP4 (W4A4).
void Paths(const char* name, int m, int n, int k) {
  std::mt19937 rng(2);
  std::uniform_int_distribution<int> code(0, 0x7e), nib(0, 15), bsc(0x30, 0x40);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<uint8_t> codes(size_t(n) * k), e2m1(size_t(n) * k), bs(size_t(n) * (k / 16));
  for (uint8_t& c : codes) c = uint8_t(code(rng));
  for (uint8_t& c : e2m1) c = uint8_t(nib(rng));
  for (uint8_t& c : bs) c = uint8_t(bsc(rng));
  std::vector<int8_t> q(size_t(n) * k);
  for (int8_t& v : q) v = int8_t(nib(rng) - 8);
  const int g = 128;
  std::vector<float> rs(n, 1e-3f), gs(size_t(n) * ((k + g - 1) / g), 1e-3f), x(size_t(m) * k),
      y(size_t(m) * n);
  for (float& v : x) v = d(rng);
  const QuantMatrix mats[3] = {
      QuantMatrix::FromFp8(codes.data(), rs.data(), n, k),
      QuantMatrix::FromInt4(q.data(), gs.data(), n, k, g),
      QuantMatrix::FromNvfp4(e2m1.data(), bs.data(), rs.data(), 0.05f, n, k)};
  const GemmIsa isa = ActiveGemmIsa();
  std::printf("%-16s m %3d n %5d k %5d", name, m, n, k);
  for (const QuantMatrix& w : mats) {
    double best[2] = {1e9, 1e9};
    const quant_internal::QuantPath paths[2] = {quant_internal::QuantPath::kWidenBlock,
                                                quant_internal::QuantPath::kInRegister};
    for (int round = 0; round < absl::GetFlag(FLAGS_rounds); ++round) {
      for (int p = 0; p < 2; ++p) {
        best[p] = std::min(best[p], Time([&] {
                             quant_internal::QuantLinearPath(x.data(), m, w, y.data(), isa,
                                                             GemmThreads::kOpenMp, paths[p]);
                           }));
      }
    }
    std::printf(" | %s block %7.3f reg %7.3f ms (%.2fx)", QuantFormatName(w.format()),
                1e3 * best[0], 1e3 * best[1], best[1] / best[0]);
  }
  std::printf("\n");
}

}  // namespace
}  // namespace dgserve::cpu

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "quant_gemm_bench [--rounds N] [--min_seconds S] | --paths [--path_rows 1,4,8,...]",
      "bench/quant_gemm_bench.cc");
  dgserve::ParseCommandLine(argc, argv);   // --help exits 0 (common/cli.h)
  dgserve::ApplyGemmIsaFromEnvironment();  // DGSERVE_GEMM_ISA forces a path
  std::printf("GEMM path %s, %d threads; ratios are time / bf16 time\n",
              dgserve::cpu::GemmIsaName(dgserve::cpu::ActiveGemmIsa()), omp_get_max_threads());
  if (absl::GetFlag(FLAGS_paths)) {
    std::vector<int> rows;
    for (const std::string& r : absl::GetFlag(FLAGS_path_rows)) {
      int v = 0;
      if (absl::SimpleAtoi(r, &v) && v > 0) rows.push_back(v);
    }
    for (int m : rows) dgserve::cpu::Paths("expert gate_up", m, 1408, 2816);
    for (int m : rows) dgserve::cpu::Paths("expert down", m, 2816, 704);
    return 0;
  }
  for (int m : {4, 8, 16, 64}) dgserve::cpu::Shape("expert gate_up", m, 1408, 2816);
  for (int m : {4, 8, 16, 64}) dgserve::cpu::Shape("expert down", m, 2816, 704);
  dgserve::cpu::Shape("q_proj (sliding)", 256, 4096, 2816);
  dgserve::cpu::Shape("mlp gate (dense)", 256, 2112, 2816);
  return 0;
}
