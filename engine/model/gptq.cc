// W4A16 round-to-nearest and GPTQ (issue 37): see gptq.h.
#include "engine/model/gptq.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"

namespace dgserve {
namespace {

// Every loop below keeps the order of each element's operations of the straightforward
// column-by-column forms (each sum in the order of its index, from the same start), so the
// results are bit for bit theirs (gptq_test.cc keeps those forms and compares): only the order
// in which elements are computed changes, for cache reuse and threads. The kernels below are
// cloned for AVX-512F, AVX2 and the baseline (an ifunc picks one at load): each element's
// multiplies and subtractions are the same IEEE operations at any vector width, and gptq.cc is
// built with -ffp-contract=off (no fused multiply-adds), so every clone gives the same bits.
#if defined(__clang__)
#define DGSERVE_GPTQ_CLONES
#else
#define DGSERVE_GPTQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

// Eight doubles as one value (GCC/Clang vector extensions: element-wise IEEE operations, as wide
// as the clone's ISA allows), loaded and stored unaligned. (gptq.cc is built with -Wno-psabi: a
// V8 passed by value would differ between the clones' ABIs, but these helpers have internal
// linkage and are inlined into each clone.)
typedef double V8 __attribute__((vector_size(64)));
inline V8 Load8(const double* p) {
  V8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void Store8(double* p, V8 v) { std::memcpy(p, &v, sizeof v); }

// a[c] += x·v[c] for c in [0, w), eight at a time.
inline void AddScaledInline(double* a, double x, const double* v, int w) {
  int c = 0;
  for (; c + 8 <= w; c += 8) Store8(a + c, Load8(a + c) + x * Load8(v + c));
  for (; c < w; ++c) a[c] += x * v[c];
}

// Row i of the Cholesky's trailing update: a[i][j] −= l[k]·panel[k][j] for k = 0 … b − 1 in
// order, j in [j0, j1) (l: row i's panel columns; panel rows ld doubles apart).
DGSERVE_GPTQ_CLONES
void TrailingRow(double* ai, const double* l, const double* panel, int b, size_t ld, int j0,
                 int j1) {
  int j = j0;
  for (; j + 8 <= j1; j += 8) {
    V8 r = Load8(ai + j);
    for (int k = 0; k < b; ++k) r -= l[k] * Load8(panel + k * ld + j);
    Store8(ai + j, r);
  }
  for (; j < j1; ++j) {
    double r = ai[j];
    for (int k = 0; k < b; ++k) r -= l[k] * panel[k * ld + j];
    ai[j] = r;
  }
}

// acc[c] += x·v[c] for c in [0, w) (the products and sums of LowerInverse and InverseProduct).
DGSERVE_GPTQ_CLONES
void AddScaled(double* acc, double x, const double* v, int w) { AddScaledInline(acc, x, v, w); }

// The lower Cholesky factor of the symmetric m [n, n] (row-major; only its lower triangle is
// read) in its lower triangle, in place; false when a pivot is not positive (a not positive
// definite). Blocked right-looking in panels of kPanel columns: element (i, j) starts from m[i][j]
// and subtracts m[i][k]·m[j][k] for k = 0, 1, …, j − 1 in that order, then is divided by the pivot,
// as in the column-by-column form.
bool CholeskyLower(double* m, int n) {
  constexpr int kPanel = 32;
  const bool par = n >= 256;
  std::vector<double> panel;  // [kPanel, n]: panel[k − k0][j] = m[j][k] (the panel transposed)
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
#pragma omp parallel for schedule(static) if (par)
    for (int i = k1; i < n; ++i) {  // the panel's rows below the block, each on its own
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
      TrailingRow(ai, ai + k0, panel.data(), b, size_t(n), k1, i + 1);
    }
  }
  return true;
}

// The row blocks and column chunks of LowerInverse and InverseProduct (acc: [kRows, kCols]
// doubles, 16 KB, in the L1 cache).
constexpr int kRows = 32, kCols = 64;
// QuantizeW4a16Gptq's rows per tile and most columns per block.
constexpr int kTile = 16, kBlock = 32;

// LowerInverse's terms k in [c0, i0) of rows i0 … i0 + nr − 1, columns [c0, c0 + w), into acc
// (from 0): acc[r][c] += l[i0 + r][k]·y[k][c0 + c], k in order, c ≤ k only.
DGSERVE_GPTQ_CLONES
void InverseChunk(const double* l, int n, const double* y, int i0, int nr, int c0, int w,
                  double (*acc)[kCols]) {
  for (int k = c0; k < i0; ++k) {  // (the sum of column c starts at k = c)
    const double* yk = y + size_t(k) * n + c0;
    const int cw = std::min(w, k - c0 + 1);
    for (int r = 0; r < nr; ++r) {
      const double lk = l[size_t(i0 + r) * n + k];
      double* a = acc[r];
      AddScaledInline(a, lk, yk, cw);
    }
  }
}

// InverseProduct's block of rows i0 … i0 + nr − 1 and columns [j0, j1) into acc (from 0):
// acc[r][c] += y[k][i]·y[k][j0 + c] for k = i … n − 1 in order, j ≤ i only (i = i0 + r).
DGSERVE_GPTQ_CLONES
void ProductBlock(const double* y, int n, int i0, int nr, int j0, int j1, double (*acc)[kCols]) {
  for (int k = i0; k < n; ++k) {
    const double* yk = y + size_t(k) * n;
    const int rows = std::min(nr, k - i0 + 1);  // rows i ≤ k
    for (int r = 0; r < rows; ++r) {
      const int i = i0 + r, cw = std::min(j1, i + 1) - j0;  // columns j ≤ i
      const double yi = yk[i];
      double* a = acc[r];
      AddScaledInline(a, yi, yk + j0, cw);
    }
  }
}

// L⁻¹ (lower, row-major, into y [n, n], whose upper triangle is left as it was) of the lower
// factor l: y[i][i] = 1 / l[i][i], y[i][c] = −(Σ_{k=c}^{i−1} l[i][k]·y[k][c]) / l[i][i], each
// sum from 0.0 in k's order, as each column's forward substitution computes it. Rows in blocks
// of kRows: the terms of the rows above the block (k < i0) in parallel over column chunks, then
// the block's own rows in order.
void LowerInverse(const double* l, int n, double* y) {
  for (int i0 = 0; i0 < n; i0 += kRows) {
    const int i1 = std::min(n, i0 + kRows), nr = i1 - i0;
    const int chunks = (i0 + kCols - 1) / kCols;
#pragma omp parallel for schedule(dynamic, 1) if (n >= 256 && chunks > 1)
    for (int ch = 0; ch < chunks; ++ch) {
      const int c0 = ch * kCols, w = std::min(i0, c0 + kCols) - c0;
      double acc[kRows][kCols] = {};
      InverseChunk(l, n, y, i0, nr, c0, w, acc);
      for (int r = 0; r < nr; ++r) std::copy(acc[r], acc[r] + w, y + size_t(i0 + r) * n + c0);
    }
    for (int i = i0; i < i1; ++i) {  // the sums so far in y[i][c < i0]; the others start at 0
      double* yi = y + size_t(i) * n;
      const double* li = l + size_t(i) * n;
      for (int c = i0; c < i; ++c) yi[c] = 0.0;
      for (int k = i0; k < i; ++k) {
        AddScaled(yi, li[k], y + size_t(k) * n, k + 1);
      }
      const double d = li[i];
      for (int c = 0; c < i; ++c) yi[c] = -yi[c] / d;
      yi[i] = 1.0 / d;
    }
  }
}

// The lower triangle of (L⁻¹)ᵀ·L⁻¹ into p [n, n] from y = L⁻¹ (LowerInverse's): p[i][j] =
// Σ_{k=i}^{n−1} y[k][i]·y[k][j] for j ≤ i, from 0.0 in k's order (column i of L⁻¹ · column j).
// Each block of kRows rows by kCols columns on its own, in parallel.
void InverseProduct(const double* y, int n, double* p) {
  std::vector<std::pair<int, int>> tasks;  // (row block start, column chunk start), j0 < i1
  for (int i0 = 0; i0 < n; i0 += kRows) {
    for (int j0 = 0; j0 < std::min(n, i0 + kRows); j0 += kCols) tasks.emplace_back(i0, j0);
  }
#pragma omp parallel for schedule(dynamic, 1) if (n >= 256)
  for (size_t t = 0; t < tasks.size(); ++t) {
    const auto [i0, j0] = tasks[t];
    const int nr = std::min(n, i0 + kRows) - i0, j1 = std::min(n, j0 + kCols);
    double acc[kRows][kCols] = {};
    ProductBlock(y, n, i0, nr, j0, j1, acc);
    for (int r = 0; r < nr; ++r) {
      const int i = i0 + r, cw = std::min(j1, i + 1) - j0;
      if (cw > 0) std::copy(acc[r], acc[r] + cw, p + size_t(i) * n + j0);
    }
  }
}

// QuantizeW4a16Gptq's deferred updates: rows t < nt of buf ([·, n]) take the errors errs[t][k]
// (kBlock apart) of the block's columns b + k < e: row[j] −= errs[t][k]·u[b + k][j] for every
// j ≥ e, k in order; eight columns at a time per row, the block's U rows for those columns
// staying in the cache across the tile's rows.
DGSERVE_GPTQ_CLONES
void BlockUpdate(double* buf, int nt, int n, const double* errs, const double* u, int b, int e) {
  const int nb = e - b;
  int j = e;
  for (; j + 8 <= n; j += 8) {
    for (int t = 0; t < nt; ++t) {
      double* row = buf + size_t(t) * n + j;
      const double* et = errs + size_t(t) * kBlock;
      V8 x = Load8(row);
      for (int k = 0; k < nb; ++k) x -= et[k] * Load8(u + size_t(b + k) * n + j);
      Store8(row, x);
    }
  }
  for (; j < n; ++j) {
    for (int t = 0; t < nt; ++t) {
      double x = buf[size_t(t) * n + j];
      for (int k = 0; k < nb; ++k) x -= errs[size_t(t) * kBlock + k] * u[size_t(b + k) * n + j];
      buf[size_t(t) * n + j] = x;
    }
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
  if (!CholeskyLower(h.data(), n)) return not_definite();
  // L⁻¹ (lower), then (L⁻¹)ᵀ·L⁻¹ (its lower triangle: all the Cholesky below reads).
  // (Not zeroed: the upper triangles are never read. The working copies are freed as they are
  // done with.)
  std::unique_ptr<double[]> linv(new double[size_t(n) * n]);
  LowerInverse(h.data(), n, linv.get());
  std::vector<double>().swap(h);
  std::unique_ptr<double[]> hinv(new double[size_t(n) * n]);
  InverseProduct(linv.get(), n, hinv.get());
  linv.reset();
  if (!CholeskyLower(hinv.get(), n)) return not_definite();
  // U[i][j] = M[j][i] for j ≥ i, M the lower factor now in hinv.
  f.u.assign(size_t(n) * n, 0.0);
#pragma omp parallel for schedule(dynamic, 1) if (n >= 256)
  for (int i0 = 0; i0 < n; i0 += 32) {  // in 32 × 32 tiles (both reads and writes stay cached)
    const int i1 = std::min(n, i0 + 32);
    for (int j0 = i0; j0 < n; j0 += 32) {
      const int j1 = std::min(n, j0 + 32);
      for (int i = i0; i < i1; ++i) {
        for (int j = std::max(i, j0); j < j1; ++j) f.u[size_t(i) * n + j] = hinv[size_t(j) * n + i];
      }
    }
  }
  return f;
}

absl::StatusOr<W4a16Weights> QuantizeW4a16Gptq(std::span<const float> w, int rows, int cols,
                                               int group, const GptqFactor& factor) {
  return QuantizeW4a16GptqTraced(w, rows, cols, group, factor, nullptr);
}

absl::StatusOr<W4a16Weights> QuantizeW4a16GptqTraced(std::span<const float> w, int rows, int cols,
                                                     int group, const GptqFactor& factor,
                                                     std::vector<double>* rounded) {
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
  if (rounded) rounded->resize(size_t(rows) * cols);
  // Each row on its own (the updates stay within a row), as the row-by-row form: column i
  // rounded, then row[j] −= err_i · U[i][j] for every j > i. Here kTile rows at a time, so that
  // each row of U (the factor is n² doubles, far beyond the caches at real width) is read once
  // per tile instead of once per row, and in blocks of at most kBlock columns that end at group
  // starts: within a block the updates reach the block's own columns at once, the columns after
  // it take the block's kBlock updates together, in i's order, when the block is done. Each
  // element so takes every update in the order of the row-by-row form, and a group's scale, read
  // at a block start, sees all of the updates before it: the same bits.
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
            if (rounded) (*rounded)[r * n + i] = row[i];
            // The rounding error, spread over the block's columns not yet rounded.
            const double err = (row[i] - double(code) * double(s)) / ui[i];
            errs[t][i - b] = err;
            for (int j = i + 1; j < e; ++j) row[j] -= err * ui[j];
          }
        }
        // The block's errors, spread over the columns after it.
        BlockUpdate(buf.data(), nt, n, &errs[0][0], u, b, e);
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
