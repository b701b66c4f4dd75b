// GPTQ's cost at real width (engine/model/gptq.h): FactorGptqHessian and QuantizeW4a16Gptq on an
// expert's gate/up shape ([1408, 2816] by default: 2816 inputs), random weights and the Hessian
// XᵀX of a random X of --xrows rows (OpenBLAS dsyrk), against the straightforward column-by-column
// and row-by-row forms they replaced (engine/model/gptq_reference_testing.h, gptq_test.cc's
// reference), timed in alternation --reps times each: min and median seconds and the ratio old /
// new. Checks that both give the same bits (the factor U and the codes and scales).
//
//   OMP_WAIT_POLICY=passive build/bench/gptq_bench [--rows 1408] [--cols 2816] [--reps 3]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "absl/flags/flag.h"
#include "common/bf16.h"
#include "common/cli.h"
#include "engine/model/gptq.h"
#include "engine/model/gptq_reference_testing.h"

ABSL_FLAG(int, rows, 1408, "output rows of the quantized matrix");
ABSL_FLAG(int, cols, 2816, "inputs (the Hessian's size)");
ABSL_FLAG(int, xrows, 4096, "rows of the random X whose XᵀX is the Hessian");
ABSL_FLAG(int, group, 128, "W4A16 group size");
ABSL_FLAG(int, reps, 3, "timed runs of each form (alternated)");
ABSL_FLAG(bool, skip_old, false, "time the library's forms only");

namespace dgserve {
namespace {

double Seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Times {
  std::vector<double> s;
  double Min() const { return *std::min_element(s.begin(), s.end()); }
  double Median() {
    std::sort(s.begin(), s.end());
    return s.size() % 2 ? s[s.size() / 2] : 0.5 * (s[s.size() / 2 - 1] + s[s.size() / 2]);
  }
};

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "gptq_bench [--rows 1408] [--cols 2816] [--xrows 4096] [--group 128] [--reps 3] "
      "[--skip_old]",
      "bench/gptq_bench.cc");
  dgserve::ParseCommandLine(argc, argv);
  using namespace dgserve;
  const int rows = absl::GetFlag(FLAGS_rows), n = absl::GetFlag(FLAGS_cols);
  const int xrows = absl::GetFlag(FLAGS_xrows), group = absl::GetFlag(FLAGS_group);
  const int reps = absl::GetFlag(FLAGS_reps);
  const bool old = !absl::GetFlag(FLAGS_skip_old);
  if (rows < 1 || n < 1 || xrows < 1 || group < 1 || reps < 1) {
    std::fprintf(stderr, "gptq_bench: --rows, --cols, --xrows, --group and --reps must be >= 1\n");
    return 2;
  }
  std::mt19937 rng(1);
  std::normal_distribution<double> normal(0.0, 1.0);
  // X: a shared component (correlated inputs) plus noise; H = XᵀX (dsyrk's upper, mirrored).
  std::vector<double> x(size_t(xrows) * n), common(n);
  for (double& v : common) v = normal(rng);
  for (int t = 0; t < xrows; ++t) {
    const double z = normal(rng);
    for (int c = 0; c < n; ++c) x[size_t(t) * n + c] = z * common[c] + normal(rng);
  }
  InputHessian h;
  h.cols = n;
  h.rows = xrows;
  h.h.assign(size_t(n) * n, 0.0);
  const double th = Seconds([&] {
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, n, xrows, 1.0, x.data(), n, 0.0, h.h.data(),
                n);
  });
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < i; ++j) h.h[size_t(i) * n + j] = h.h[size_t(j) * n + i];
  }
  std::vector<double>().swap(x);
  std::vector<float> w(size_t(rows) * n);
  for (float& v : w) v = float(0.02 * normal(rng));
  std::printf("gptq_bench: W [%d, %d], group %d, H = XᵀX of X [%d, %d] (dsyrk %.2f s), %d reps\n",
              rows, n, group, xrows, n, th, reps);
  Times f_new, f_old, q_new, q_old;
  GptqFactor factor, ref_factor;
  W4a16Weights codes, ref_codes;
  bool ok = true;
  for (int r = 0; r < reps; ++r) {
    f_new.s.push_back(Seconds([&] {
      absl::StatusOr<GptqFactor> f = FactorGptqHessian(h);
      ok = ok && f.ok();
      if (f.ok()) factor = *std::move(f);
    }));
    if (old) f_old.s.push_back(Seconds([&] { ok = RefFactor(h, 0.01, ref_factor) && ok; }));
  }
  if (!ok) {
    std::fprintf(stderr, "gptq_bench: the Hessian is not positive definite\n");
    return 1;
  }
  for (int r = 0; r < reps; ++r) {
    q_new.s.push_back(Seconds([&] { codes = *QuantizeW4a16Gptq(w, rows, n, group, factor); }));
    if (old)
      q_old.s.push_back(Seconds([&] { ref_codes = RefQuantize(w, rows, n, group, factor); }));
  }
  std::printf("FactorGptqHessian  new: min %.3f s, median %.3f s\n", f_new.Min(), f_new.Median());
  std::printf("QuantizeW4a16Gptq  new: min %.3f s, median %.3f s\n", q_new.Min(), q_new.Median());
  if (old) {
    const bool same_u =
        factor.dead == ref_factor.dead &&
        std::memcmp(factor.u.data(), ref_factor.u.data(), factor.u.size() * sizeof(double)) == 0;
    const bool same_q = codes.codes == ref_codes.codes && codes.scales == ref_codes.scales;
    std::printf(
        "FactorGptqHessian  old: min %.3f s, median %.3f s  old/new: min %.2fx, median %.2fx\n",
        f_old.Min(), f_old.Median(), f_old.Min() / f_new.Min(), f_old.Median() / f_new.Median());
    std::printf(
        "QuantizeW4a16Gptq  old: min %.3f s, median %.3f s  old/new: min %.2fx, median %.2fx\n",
        q_old.Min(), q_old.Median(), q_old.Min() / q_new.Min(), q_old.Median() / q_new.Median());
    std::printf("bit for bit: factor %s, codes and scales %s\n", same_u ? "same" : "DIFFER",
                same_q ? "same" : "DIFFER");
    if (!same_u || !same_q) return 1;
  }
  return 0;
}
