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

// Every loop below keeps the order of each element's operations of the straightforward
// column-by-column forms (each sum in the order of its index, from the same start), so the
// results are bit for bit theirs (gptq_test.cc keeps those forms and compares): only the order
// in which elements are computed changes, for cache reuse and threads.

// The lower Cholesky factor of the symmetric a [n, n] (row-major) in its lower triangle, in
// place; false when a pivot is not positive (a not positive definite). Blocked right-looking in
// panels of kPanel columns: element (i, j) starts from a[i][j] and subtracts a[i][k]·a[j][k] for
// k = 0, 1, …, j − 1 in that order, then is divided by the pivot, as in the column-by-column form.
bool CholeskyLower(std::vector<double>& a, int n) {
  constexpr int kPanel = 32;
  const bool par = n >= 256;
  double* const m = a.data();
  std::vector<double> panel;  // [kPanel, n]: panel[k − k0][j] = a[j][k] (the panel transposed)
  for (int k0 = 0; k0 < n; k0 += kPanel) {
    const int k1 = std::min(n, k0 + kPanel), b = k1 - k0;
    // The diagonal block, column by column (its elements hold the updates of the columns < k0).
    for (int j = k0; j < k1; ++j) {
      double* aj = m + size_t(j) * n;
      double d = aj[j];
      for (int k = k0; k < j; ++k) d -= aj[k] * aj[k];
      if (!(d > 0.0)) return false;
      d = std::sqrt(d);
      aj[j] = d;
      for (int i = j + 1; i < k1; ++i) {
        double* ai = m + size_t(i) * n;
        double s = ai[j];
        for (int k = k0; k < j; ++k) s -= ai[k] * aj[k];
        ai[j] = s / d;
      }
    }
    if (k1 == n) break;
      // The panel's rows below the block: each row on its own.
#pragma omp parallel for schedule(static) if (par)
    for (int i = k1; i < n; ++i) {
      double* ai = m + size_t(i) * n;
      for (int j = k0; j < k1; ++j) {
        const double* aj = m + size_t(j) * n;
        double s = ai[j];
        for (int k = k0; k < j; ++k) s -= ai[k] * aj[k];
        ai[j] = s / aj[j];
      }
    }
    // The trailing lower triangle takes the panel's columns, k in order for each element.
    panel.resize(size_t(b) * n);
#pragma omp parallel for schedule(static) if (par)
    for (int j = k1; j < n; ++j) {
      for (int k = 0; k < b; ++k) panel[size_t(k) * n + j] = m[size_t(j) * n + k0 + k];
    }
#pragma omp parallel for schedule(dynamic, 16) if (par)
    for (int i = k1; i < n; ++i) {
      double* ai = m + size_t(i) * n;
      const double* li = ai + k0;
      int j = k1;
      for (; j + 8 <= i + 1; j += 8) {
        double r[8];
        for (int t = 0; t < 8; ++t) r[t] = ai[j + t];
        for (int k = 0; k < b; ++k) {
          const double l = li[k];
          const double* p = panel.data() + size_t(k) * n + j;
          for (int t = 0; t < 8; ++t) r[t] -= l * p[t];
        }
        for (int t = 0; t < 8; ++t) ai[j + t] = r[t];
      }
      for (; j <= i; ++j) {
        double r = ai[j];
        for (int k = 0; k < b; ++k) r -= li[k] * panel[size_t(k) * n + j];
        ai[j] = r;
      }
    }
  }
  return true;
}

// Column c of L⁻¹ (L lower [n, n] row-major), written to col (zero below index c on entry):
// col[c] = 1 / L[c][c], col[i] = −(Σ_{k=c}^{i−1} L[i][k]·col[k]) / L[i][i], each sum from 0.0 in
// k's order, for rows [c, end).
void InverseColumnRows(const double* l, int n, int c, int end, double* col) {
  col[c] = 1.0 / l[size_t(c) * n + c];
  for (int i = c + 1; i < end; ++i) {
    const double* li = l + size_t(i) * n;
    double s = 0.0;
    for (int k = c; k < i; ++k) s += li[k] * col[k];
    col[i] = -s / li[i];
  }
}

// Columns c0 … c0 + 3 of L⁻¹ together (as InverseColumnRows each): rows up to c0 + 3 one column
// at a time, then each row of L read once for the four (four independent sums).
void InverseFourColumns(const double* l, int n, int c0, double* x0) {
  double* x[4] = {x0, x0 + n, x0 + 2 * size_t(n), x0 + 3 * size_t(n)};
  const int end = std::min(n, c0 + 4);
  for (int t = 0; t < 4; ++t) InverseColumnRows(l, n, c0 + t, end, x[t]);
  for (int i = c0 + 4; i < n; ++i) {
    const double* li = l + size_t(i) * n;
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    for (int t = 0; t < 3; ++t) {
      for (int k = c0 + t; k < c0 + 3; ++k) s[t] += li[k] * x[t][k];
    }
    for (int k = c0 + 3; k < i; ++k) {
      for (int t = 0; t < 4; ++t) s[t] += li[k] * x[t][k];
    }
    for (int t = 0; t < 4; ++t) x[t][i] = -s[t] / li[i];
  }
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
  const int quads = n / 4;
#pragma omp parallel for schedule(dynamic, 2) if (n >= 256)
  for (int q = 0; q <= quads; ++q) {
    if (q < quads) {
      InverseFourColumns(h.data(), n, 4 * q, linv_t.data() + size_t(4 * q) * n);
    } else {
      for (int c = 4 * quads; c < n; ++c) {
        InverseColumnRows(h.data(), n, c, n, linv_t.data() + size_t(c) * n);
      }
    }
  }
  std::vector<double>().swap(h);            // (the working copies freed as they are done with)
  std::vector<double> hinv(size_t(n) * n);  // (L⁻¹)ᵀ·L⁻¹: entry (i, j) = column i · column j
#pragma omp parallel for schedule(dynamic, 8) if (n >= 256)
  for (int i = 0; i < n; ++i) {
    const double* ci = linv_t.data() + size_t(i) * n;
    int j = 0;
    for (; j + 4 <= i + 1; j += 4) {  // four entries of the row at once: column i read once
      const double* cj = linv_t.data() + size_t(j) * n;
      double s[4] = {0.0, 0.0, 0.0, 0.0};
      for (int k = i; k < n; ++k) {
        for (int t = 0; t < 4; ++t) s[t] += ci[k] * cj[size_t(t) * n + k];
      }
      for (int t = 0; t < 4; ++t) hinv[size_t(i) * n + j + t] = hinv[size_t(j + t) * n + i] = s[t];
    }
    for (; j <= i; ++j) {
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
#pragma omp parallel for schedule(static) if (n >= 256)
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
  // Each row on its own (the updates stay within a row), as the row-by-row form: column i
  // rounded, then row[j] −= err_i · U[i][j] for every j > i. Here kTile rows at a time, so that
  // each row of U (the factor is n² doubles, far beyond the caches at real width) is read once
  // per tile instead of once per row, and in blocks of at most kBlock columns that end at group
  // starts: within a block the updates reach the block's own columns at once, the columns after
  // it take the block's kBlock updates together, in i's order, when the block is done. Each
  // element so takes every update in the order of the row-by-row form, and a group's scale, read
  // at a block start, sees all of the updates before it: the same bits.
  constexpr int kTile = 16, kBlock = 32;
  const int tiles = (rows + kTile - 1) / kTile;
  const double* const u = factor.u.data();
#pragma omp parallel if (int64_t(rows) * cols * cols >= (1 << 22) && tiles > 1)
  {
    std::vector<double> buf(size_t(kTile) * n);  // the tile's rows as updated so far
    double errs[kTile][kBlock];                  // each row's errors of the current block
    float scale[kTile];                          // each row's current group's scale
#pragma omp for schedule(dynamic, 1)
    for (int tile = 0; tile < tiles; ++tile) {
      const int r0 = tile * kTile, nt = std::min(kTile, rows - r0);
      for (int t = 0; t < nt; ++t) {
        double* row = buf.data() + size_t(t) * n;
        const float* src = w.data() + size_t(r0 + t) * n;
        for (int i = 0; i < n; ++i) row[i] = factor.dead[i] ? 0.0 : double(src[i]);
        scale[t] = 1.0f;
      }
      for (int b = 0; b < n;) {
        const int e = int(
            std::min<int64_t>({int64_t(n), int64_t(b) + kBlock, (int64_t(b) / group + 1) * group}));
        for (int i = b; i < e; ++i) {
          const double* ui = u + size_t(i) * n;
          for (int t = 0; t < nt; ++t) {
            double* row = buf.data() + size_t(t) * n;
            const size_t r = size_t(r0 + t);
            if (i % group == 0) {  // the group's scale from its weights as updated so far
              float absmax = 0.0f;
              const int c1 = int(std::min<int64_t>(n, int64_t(i) + group));
              for (int c = i; c < c1; ++c) absmax = std::max(absmax, float(std::fabs(row[c])));
              const uint16_t sb = W4a16GroupScale(absmax);
              out.scales[r * groups + i / group] = sb;
              scale[t] = Bf16ToFloat(sb);
            }
            const float s = scale[t];
            const int code = W4a16Code(float(row[i]), s);
            out.codes[r * n + i] = int8_t(code);
            // The rounding error, spread over the block's columns not yet rounded.
            const double err = (row[i] - double(code) * double(s)) / ui[i];
            errs[t][i - b] = err;
            for (int j = i + 1; j < e; ++j) row[j] -= err * ui[j];
          }
        }
        // The block's errors, spread over the columns after it (eight at a time per row, the
        // block's U rows for those columns staying in the cache across the tile's rows).
        const int nb = e - b;
        int j = e;
        for (; j + 8 <= n; j += 8) {
          for (int t = 0; t < nt; ++t) {
            double* row = buf.data() + size_t(t) * n + j;
            double x[8];
            for (int c = 0; c < 8; ++c) x[c] = row[c];
            for (int k = 0; k < nb; ++k) {
              const double ek = errs[t][k];
              const double* uk = u + size_t(b + k) * n + j;
              for (int c = 0; c < 8; ++c) x[c] -= ek * uk[c];
            }
            for (int c = 0; c < 8; ++c) row[c] = x[c];
          }
        }
        for (; j < n; ++j) {
          for (int t = 0; t < nt; ++t) {
            double x = buf[size_t(t) * n + j];
            for (int k = 0; k < nb; ++k) x -= errs[t][k] * u[size_t(b + k) * n + j];
            buf[size_t(t) * n + j] = x;
          }
        }
        b = e;
      }
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
