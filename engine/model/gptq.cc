// W4A16 round-to-nearest and GPTQ (issue 37): see gptq.h.
#include "engine/model/gptq.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"

namespace dgserve {
namespace {

// The lower Cholesky factor of the symmetric a [n, n] (row-major) in its lower triangle, in
// place; false when a pivot is not positive (a not positive definite).
bool CholeskyLower(std::vector<double>& a, int n) {
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

}  // namespace

uint16_t W4a16GroupScale(float absmax) {
  uint16_t sb = FloatToBf16(absmax / 7.5f);
  if (Bf16ToFloat(sb) == 0.0f) sb = FloatToBf16(1.0f);
  return sb;
}

int W4a16Code(float w, float s) {
  return int(std::min(7.0f, std::max(-8.0f, std::nearbyint(w / s))));
}

W4a16Weights QuantizeW4a16Rtn(std::span<const float> w, int rows, int cols, int group) {
  const int groups = (cols + group - 1) / group;
  W4a16Weights out;
  out.codes.resize(size_t(rows) * cols);
  out.scales.resize(size_t(rows) * groups);
#pragma omp parallel for schedule(static) if (int64_t(rows) * cols >= (1 << 18))
  for (int i = 0; i < rows; ++i) {
    const float* row = w.data() + size_t(i) * cols;
    for (int g = 0; g < groups; ++g) {
      const int c0 = g * group, c1 = std::min(cols, c0 + group);
      float absmax = 0.0f;
      for (int c = c0; c < c1; ++c) absmax = std::max(absmax, std::fabs(row[c]));
      const uint16_t sb = W4a16GroupScale(absmax);
      out.scales[size_t(i) * groups + g] = sb;
      const float s = Bf16ToFloat(sb);
      for (int c = c0; c < c1; ++c) out.codes[size_t(i) * cols + c] = int8_t(W4a16Code(row[c], s));
    }
  }
  return out;
}

W4a16Packed PackW4a16(const W4a16Weights& w, int cols, int group, int row0, int rows) {
  const int groups = (cols + group - 1) / group, words = (cols + 7) / 8;
  W4a16Packed out;
  out.rows = rows;
  out.cols = cols;
  out.group = group;
  out.packed.assign(size_t(rows) * words, 0);
  for (int i = 0; i < rows; ++i) {
    const int8_t* q = w.codes.data() + size_t(row0 + i) * cols;
    for (int c = 0; c < cols; ++c) {
      out.packed[size_t(i) * words + c / 8] |= (uint32_t(q[c] + 8) & 0xfu) << (4 * (c % 8));
    }
  }
  out.scales.assign(w.scales.begin() + ptrdiff_t(row0) * groups,
                    w.scales.begin() + ptrdiff_t(row0 + rows) * groups);
  return out;
}

absl::StatusOr<GptqFactor> FactorGptqHessian(const InputHessian& hessian, double dampening) {
  const int n = hessian.cols;
  if (n <= 0 || hessian.h.size() != size_t(n) * n) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPTQ: a Hessian of ", hessian.h.size(), " values for ", n, " inputs"));
  }
  if (!(dampening >= 0.0 && dampening <= 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPTQ: the dampening ", dampening, " must be a number in [0, 1e6]"));
  }
  GptqFactor f;
  f.cols = n;
  f.dead.assign(n, 0);
  std::vector<double> h = hessian.h;
  // Inputs no calibration row reached: their weights do not matter to the output (set to 0).
  for (int i = 0; i < n; ++i) {
    if (h[size_t(i) * n + i] != 0.0) continue;
    h[size_t(i) * n + i] = 1.0;
    f.dead[i] = 1;
  }
  double mean = 0.0;
  for (int i = 0; i < n; ++i) mean += h[size_t(i) * n + i];
  mean /= n;
  for (int i = 0; i < n; ++i) h[size_t(i) * n + i] += dampening * mean;
  // U: the upper Cholesky factor of H⁻¹ (H = L·Lᵀ, H⁻¹ = L⁻ᵀ·L⁻¹ = Uᵀ·U).
  const auto not_definite = [&] {
    return absl::FailedPreconditionError(
        absl::StrCat("GPTQ: the dampened Hessian of ", n, " inputs (", hessian.rows,
                     " calibration rows) is not positive definite; a larger dampening may help"));
  };
  if (!CholeskyLower(h, n)) return not_definite();
  // L⁻¹, lower, stored transposed (column c of L⁻¹ is row c here: the columns are independent).
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
  std::vector<double>().swap(h);            // (the working copies freed as they are done with)
  std::vector<double> hinv(size_t(n) * n);  // (L⁻¹)ᵀ·L⁻¹: entry (i, j) = column i · column j
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
  std::vector<double>().swap(linv_t);
  if (!CholeskyLower(hinv, n)) return not_definite();
  // U[i][j] = M[j][i] for j ≥ i, M the lower factor now in hinv: row-major, read along rows.
  f.u.assign(size_t(n) * n, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = i; j < n; ++j) f.u[size_t(i) * n + j] = hinv[size_t(j) * n + i];
  }
  return f;
}

absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const GptqFactor& factor) {
  if (rows < 0 || cols <= 0 || w.size() != size_t(rows) * cols) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPTQ: ", w.size(), " weights for a [", rows, ", ", cols, "] matrix"));
  }
  if (factor.cols != cols || factor.u.size() != size_t(cols) * cols ||
      factor.dead.size() != size_t(cols)) {
    return absl::InvalidArgumentError(absl::StrCat("GPTQ: a factor of ", factor.cols, " inputs (",
                                                   factor.u.size(), " values) for a matrix of ",
                                                   cols, " inputs"));
  }
  if (group < 1) return absl::InvalidArgumentError("GPTQ: the group size must be ≥ 1");
  const int n = cols, groups = (cols + group - 1) / group;
  W4a16Weights out;
  out.codes.resize(size_t(rows) * cols);
  out.scales.resize(size_t(rows) * groups);
  // Each row on its own (the updates stay within a row).
#pragma omp parallel for schedule(static) if (int64_t(rows) * cols * cols >= (1 << 22))
  for (int r = 0; r < rows; ++r) {
    std::vector<double> row(w.begin() + size_t(r) * n, w.begin() + size_t(r + 1) * n);
    for (int i = 0; i < n; ++i) {
      if (factor.dead[i]) row[i] = 0.0;
    }
    float s = 1.0f;
    for (int i = 0; i < n; ++i) {
      if (i % group == 0) {  // the group's scale from its weights as updated so far
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
      // The rounding error, spread over the columns not yet rounded.
      const double* ui = factor.u.data() + size_t(i) * n;
      const double err = (row[i] - double(code) * double(s)) / ui[i];
      for (int j = i + 1; j < n; ++j) row[j] -= err * ui[j];
    }
  }
  return out;
}

absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const InputHessian& hessian,
                                               double dampening) {
  if (hessian.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat("GPTQ: a Hessian of ", hessian.cols,
                                                   " inputs for a matrix of ", cols, " inputs"));
  }
  DGSERVE_ASSIGN_OR_RETURN(const GptqFactor factor, FactorGptqHessian(hessian, dampening));
  return QuantizeW4a16Gptq(w, rows, cols, group, factor);
}

}  // namespace dgserve
