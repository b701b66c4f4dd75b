// GPTQ's reference forms for tests and benchmarks (engine/model/gptq_test.cc,
// bench/gptq_bench.cc): FactorGptqHessian and QuantizeW4a16Gptq as first written, column by
// column and row by row, which the library's blocked and tiled forms must match bit for bit.
// Compile includers with -ffp-contract=off, as gptq.cc (no fused multiply-adds on any target).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/bf16.h"
#include "engine/model/gptq.h"

namespace dgserve {

// The reference: FactorGptqHessian and QuantizeW4a16Gptq as they were written first (2026-12-07),
// column by column and row by row (serial Cholesky, every row reading all of U). The library's
// blocked and tiled forms must give the same bits.
inline bool RefCholeskyLower(std::vector<double>& a, int n) {
  for (int j = 0; j < n; ++j) {
    double d = a[size_t(j) * n + j];
    for (int k = 0; k < j; ++k) d -= a[size_t(j) * n + k] * a[size_t(j) * n + k];
    if (!(d > 0.0)) return false;
    d = std::sqrt(d);
    a[size_t(j) * n + j] = d;
    for (int i = j + 1; i < n; ++i) {
      double s = a[size_t(i) * n + j];
      for (int k = 0; k < j; ++k) s -= a[size_t(i) * n + k] * a[size_t(j) * n + k];
      a[size_t(i) * n + j] = s / d;
    }
  }
  return true;
}

// false where the reference finds the Hessian not positive definite.
inline bool RefFactor(const InputHessian& hessian, double dampening, GptqFactor& f) {
  const int n = hessian.cols;
  f.cols = n;
  f.dead.assign(n, 0);
  std::vector<double> h = hessian.h;
  for (int i = 0; i < n; ++i) {
    if (h[size_t(i) * n + i] != 0.0) continue;
    h[size_t(i) * n + i] = 1.0;
    f.dead[i] = 1;
  }
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += h[size_t(i) * n + i];
  mean /= n;
  for (int i = 0; i < n; ++i) h[size_t(i) * n + i] += dampening * mean;
  if (!RefCholeskyLower(h, n)) return false;
  std::vector<double> linv_t(size_t(n) * n, 0.0);
#pragma omp parallel for schedule(dynamic, 8) if (n >= 256)
  for (int c = 0; c < n; ++c) {
    double* col = linv_t.data() + size_t(c) * n;
    col[c] = 1.0 / h[size_t(c) * n + c];
    for (int i = c + 1; i < n; ++i) {
      const double* li = h.data() + size_t(i) * n;
      double s = 0.0;
      for (int k = c; k < i; ++k) s += li[k] * col[k];
      col[i] = -s / li[i];
    }
  }
  std::vector<double> hinv(size_t(n) * n);
#pragma omp parallel for schedule(dynamic, 8) if (n >= 256)
  for (int i = 0; i < n; ++i) {
    const double* ci = linv_t.data() + size_t(i) * n;
    for (int j = 0; j <= i; ++j) {
      const double* cj = linv_t.data() + size_t(j) * n;
      double s = 0.0;
      for (int k = i; k < n; ++k) s += ci[k] * cj[k];
      hinv[size_t(i) * n + j] = hinv[size_t(j) * n + i] = s;
    }
  }
  if (!RefCholeskyLower(hinv, n)) return false;
  f.u.assign(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = i; j < n; ++j) f.u[size_t(i) * n + j] = hinv[size_t(j) * n + i];
  }
  return true;
}

// `rounded`: each weight as it was rounded (QuantizeW4a16GptqTraced's).
inline W4a16Weights RefQuantize(const std::vector<float>& w, int rows, int n, int group,
                                const GptqFactor& factor, std::vector<double>* rounded = nullptr) {
  const int groups = (n + group - 1) / group;
  W4a16Weights out;
  out.codes.resize(size_t(rows) * n);
  out.scales.resize(size_t(rows) * groups);
  if (rounded) rounded->resize(size_t(rows) * n);
#pragma omp parallel for schedule(static) if (int64_t(rows) * n * n >= (1 << 22))
  for (int r = 0; r < rows; ++r) {
    std::vector<double> row(w.begin() + size_t(r) * n, w.begin() + size_t(r + 1) * n);
    for (int i = 0; i < n; ++i) {
      if (factor.dead[i]) row[i] = 0.0;
    }
    float s = 1.0f;
    for (int i = 0; i < n; ++i) {
      if (i % group == 0) {
        float absmax = 0.0f;
        for (int c = i; c < std::min(n, i + group); ++c) {
          absmax = std::max(absmax, float(std::fabs(row[c])));
        }
        const uint16_t sb = W4a16GroupScale(absmax);
        out.scales[size_t(r) * groups + i / group] = sb;
        s = Bf16ToFloat(sb);
      }
      const int code = W4a16Code(float(row[i]), s);
      out.codes[size_t(r) * n + i] = int8_t(code);
      if (rounded) (*rounded)[size_t(r) * n + i] = row[i];
      const double* ui = factor.u.data() + size_t(i) * n;
      const double err = (row[i] - double(code) * double(s)) / ui[i];
      for (int j = i + 1; j < n; ++j) row[j] -= err * ui[j];
    }
  }
  return out;
}

}  // namespace dgserve
