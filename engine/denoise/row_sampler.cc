#include "engine/denoise/row_sampler.h"

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>

// GCC vector extensions keep the hot loops' code generation independent of the auto-vectoriser:
// the kernel is a template on the lane count N, instantiated with N = 8 (one AVX2 register) inside
// SampleRowAvx2 and N = 4 (one SSE2 register; wider generic vectors are split element-wise on
// SSE2) inside SampleRowBaseline. Every helper is always_inline, so no vector crosses a call
// boundary (hence no ABI concern; -Wpsabi silenced).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace dgserve {
namespace {

template <int N>
struct Vec {
  typedef float F __attribute__((vector_size(4 * N)));
  typedef int32_t I __attribute__((vector_size(4 * N)));
  typedef uint32_t U __attribute__((vector_size(4 * N)));
};

constexpr int kBlock = 1024;       // ids per block: lane sums are flushed to double per block.
constexpr int kStackBlocks = 512;  // block sums kept on the stack up to vocab = 524288.

// e = 2^w with w = (ℓ − max ℓ)·(log2 e / T) ≤ 0, so e = exp(z'), z' = w·ln 2. w is clamped at
// −127; the scale 2^round(w) is built from the bits of w + (1.5·2^23 + 127), whose low mantissa
// bits hold round(w) + 127 ∈ [0, 127]; shifted into the exponent field this gives 2^round(w), and
// exactly 0.0f when round(w) = −127. So e is flushed to 0 for w ≤ −126.5 (z' < −87.68,
// e < 2^−126), −inf logits included; 2^f for the remainder f = w − round(w) ∈ [−0.5, 0.5] (exact)
// is the Cephes exp2f polynomial (peak relative error 1.7e-7).
constexpr float kWMin = -127.0f;
constexpr float kMagic127 = 12583039.0f;  // 1.5·2^23 + 127
constexpr float kQ0 = 1.535336188319500e-4f;
constexpr float kQ1 = 1.339887440266574e-3f;
constexpr float kQ2 = 9.618437357674640e-3f;
constexpr float kQ3 = 5.550332471162809e-2f;
constexpr float kQ4 = 2.402264791363012e-1f;
constexpr float kQ5 = 6.931472028550421e-1f;
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kLog2e = 1.44269504088896340736;

template <int N>
[[gnu::always_inline]] inline typename Vec<N>::F Load(const float* p) {
  typename Vec<N>::F v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int N>
[[gnu::always_inline]] inline void Store(float* p, typename Vec<N>::F v) {
  std::memcpy(p, &v, sizeof(v));
}

template <int N>
[[gnu::always_inline]] inline typename Vec<N>::F Splat(float x) {
  return typename Vec<N>::F{} + x;
}

// 2^w for N lanes of logits; also returns the clamped w used in Σ e·w.
template <int N>
[[gnu::always_inline]] inline typename Vec<N>::F Exp2Lanes(typename Vec<N>::F logits,
                                                           typename Vec<N>::F max_logit,
                                                           typename Vec<N>::F k,
                                                           typename Vec<N>::F* w_out) {
  using F = typename Vec<N>::F;
  using U = typename Vec<N>::U;
  F w = (logits - max_logit) * k;
  w = w < kWMin ? Splat<N>(kWMin) : w;
  const F t = w + kMagic127;
  const F f = w - (t - kMagic127);  // exact
  F y = f * kQ0 + kQ1;
  y = y * f + kQ2;
  y = y * f + kQ3;
  y = y * f + kQ4;
  y = y * f + kQ5;
  y = y * f + 1.0f;
  const F scale = std::bit_cast<F>(std::bit_cast<U>(t) << 23);
  *w_out = w;
  return y * scale;
}

// Pass 1: max and first argmax. Lane l of two N-lane accumulators tracks ids ≡ l (mod 2N) with
// a strict >, so it keeps its first maximum; the reduction then takes the smallest id among lanes
// holding the maximum. Tail ids are larger than every lane id: strict > keeps the first.
template <int N>
[[gnu::always_inline]] inline void MaxArgmax(const float* row, int vocab, float* max_out,
                                             int32_t* arg_out) {
  using F = typename Vec<N>::F;
  using I = typename Vec<N>::I;
  float best = row[0];
  int32_t best_i = 0;
  int i = 1;
  if (vocab >= 4 * N) {
    F mx0 = Load<N>(row), mx1 = Load<N>(row + N);
    I ix0;
    for (int l = 0; l < N; ++l) ix0[l] = l;
    I ix1 = ix0 + N;
    I id0 = ix0 + 2 * N, id1 = ix1 + 2 * N;
    for (i = 2 * N; i + 2 * N <= vocab; i += 2 * N) {
      const F v0 = Load<N>(row + i), v1 = Load<N>(row + i + N);
      const I gt0 = v0 > mx0, gt1 = v1 > mx1;
      mx0 = gt0 ? v0 : mx0;
      mx1 = gt1 ? v1 : mx1;
      ix0 = gt0 ? id0 : ix0;
      ix1 = gt1 ? id1 : ix1;
      id0 += 2 * N;
      id1 += 2 * N;
    }
    best = mx0[0];
    best_i = ix0[0];
    for (int l = 0; l < 2 * N; ++l) {
      const float m = l < N ? mx0[l] : mx1[l - N];
      const int32_t x = l < N ? ix0[l] : ix1[l - N];
      if (m > best || (m == best && x < best_i)) {
        best = m;
        best_i = x;
      }
    }
  }
  for (; i < vocab; ++i) {
    if (row[i] > best) {
      best = row[i];
      best_i = i;
    }
  }
  *max_out = best;
  *arg_out = best_i;
}

// Pass 2 over the n ≤ kBlock ids at `row`: returns Σ e and Σ e·w (N float lanes, reduced in
// double) and writes e to out[0..n) when kWrite (out may alias row). A partial last vector is
// padded with −inf (e = 0), so every id goes through the same vector code. One accumulator pair:
// a second pair measured no faster and makes GCC spill accumulators.
template <int N, bool kWrite>
[[gnu::always_inline]] inline void ExpBlock(const float* row, float* out, int n, float max_logit,
                                            float k, double* sum_e, double* sum_ew) {
  using F = typename Vec<N>::F;
  const F vmax = Splat<N>(max_logit), vk = Splat<N>(k);
  F s = {}, t = {};
  int i = 0;
  for (; i + N <= n; i += N) {
    F w;
    const F e = Exp2Lanes<N>(Load<N>(row + i), vmax, vk, &w);
    s += e;
    t += e * w;
    if constexpr (kWrite) Store<N>(out + i, e);
  }
  if (i < n) {
    float pad[N];
    for (int l = 0; l < N; ++l) {
      pad[l] = i + l < n ? row[i + l] : -std::numeric_limits<float>::infinity();
    }
    F w;
    const F e = Exp2Lanes<N>(Load<N>(pad), vmax, vk, &w);
    s += e;
    t += e * w;
    if constexpr (kWrite) {
      for (int l = 0; i + l < n; ++l) out[i + l] = e[l];
    }
  }
  double se = 0.0, sew = 0.0;
  for (int l = 0; l < N; ++l) {
    se += s[l];
    sew += t[l];
  }
  *sum_e = se;
  *sum_ew = sew;
}

template <int N>
[[gnu::always_inline]] inline RowResult SampleRowImpl(float* row, int vocab, float temperature,
                                                      float u, bool write_probs) {
  RowResult result;
  float max_logit;
  MaxArgmax<N>(row, vocab, &max_logit, &result.argmax);
  const float k = static_cast<float>(kLog2e / static_cast<double>(temperature));

  const int n_blocks = (vocab + kBlock - 1) / kBlock;
  double stack_sums[kStackBlocks];
  std::unique_ptr<double[]> heap_sums;
  double* block_sums = stack_sums;
  if (n_blocks > kStackBlocks) {
    heap_sums = std::make_unique<double[]>(n_blocks);
    block_sums = heap_sums.get();
  }

  // Pass 2: e = 2^w, Σ e, Σ e·w (and e written in place).
  double total = 0.0, total_ew = 0.0;
  for (int b = 0; b < n_blocks; ++b) {
    const int begin = b * kBlock;
    const int end = std::min(begin + kBlock, vocab);
    double se, sew;
    if (write_probs) {
      ExpBlock<N, true>(row + begin, row + begin, end - begin, max_logit, k, &se, &sew);
    } else {
      ExpBlock<N, false>(row + begin, nullptr, end - begin, max_logit, k, &se, &sew);
    }
    block_sums[b] = se;
    total += se;
    total_ew += sew;
  }
  const double log_total = std::log(total);
  result.entropy = static_cast<float>(std::max(0.0, log_total - kLn2 * total_ew / total));
  result.lse = static_cast<float>(static_cast<double>(max_logit) / temperature + log_total);

  // Sampling: locate the block holding u·S from the block sums, then scan only that block.
  if (!(u >= 0.0f)) u = 0.0f;  // also maps NaN to 0
  if (u >= 1.0f) u = std::nextafter(1.0f, 0.0f);
  const double target = static_cast<double>(u) * total;
  double cum = 0.0;
  int block = -1;
  for (int b = 0; b < n_blocks; ++b) {
    if (cum + block_sums[b] > target) {
      block = b;
      break;
    }
    cum += block_sums[b];
  }
  bool past_end = false;
  if (block < 0) {  // rounding put u·S at or beyond the total: take the last id with p > 0.
    past_end = true;
    for (block = n_blocks - 1; block > 0 && !(block_sums[block] > 0.0); --block) {
    }
  }
  const int begin = block * kBlock;
  const int end = std::min(begin + kBlock, vocab);
  float recomputed[kBlock];
  const float* e = row + begin;
  if (!write_probs) {
    double unused_e, unused_ez;
    ExpBlock<N, true>(row + begin, recomputed, end - begin, max_logit, k, &unused_e, &unused_ez);
    e = recomputed;
  }
  int32_t picked = -1, last_positive = -1;
  for (int i = 0; i < end - begin; ++i) {
    if (e[i] > 0.0f) {
      last_positive = begin + i;
      cum += e[i];
      if (!past_end && cum > target) {
        picked = begin + i;
        break;
      }
    }
  }
  result.sampled = picked >= 0 ? picked : last_positive;
  if (result.sampled < 0) result.sampled = result.argmax;  // unreachable: e[argmax] = 1.

  // Pass 3: scale e to probabilities.
  if (write_probs) {
    const float inv_total = static_cast<float>(1.0 / total);
    for (int i = 0; i < vocab; ++i) row[i] *= inv_total;
  }
  return result;
}

[[gnu::target("avx2,fma")]] RowResult SampleRowAvx2(float* row, int vocab, float temperature,
                                                    float u, bool write_probs) {
  return SampleRowImpl<8>(row, vocab, temperature, u, write_probs);
}

RowResult SampleRowBaseline(float* row, int vocab, float temperature, float u, bool write_probs) {
  return SampleRowImpl<4>(row, vocab, temperature, u, write_probs);
}

using RowFn = RowResult (*)(float*, int, float, float, bool);

bool CpuHasAvx2Fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

RowFn SelectKernel() {
  static const RowFn fn = CpuHasAvx2Fma() ? &SampleRowAvx2 : &SampleRowBaseline;
  return fn;
}

}  // namespace

RowResult SampleRow(float* row, int vocab, float temperature, float u, bool write_probs) {
  assert(row != nullptr && vocab >= 1 && temperature > 0.0f);
  return SelectKernel()(row, vocab, temperature, u, write_probs);
}

RowResult SampleRow(const float* row, int vocab, float temperature, float u) {
  // Not written when write_probs is false.
  return SampleRow(const_cast<float*>(row), vocab, temperature, u, /*write_probs=*/false);
}

void SampleRows(float* logits, int rows, int vocab, std::span<const float> temperatures,
                std::span<const float> uniforms, bool write_probs, std::span<RowResult> out) {
  assert(static_cast<int>(temperatures.size()) >= rows);
  assert(static_cast<int>(uniforms.size()) >= rows);
  assert(static_cast<int>(out.size()) >= rows);
  const RowFn fn = SelectKernel();
#pragma omp parallel for schedule(dynamic, 1)
  for (int r = 0; r < rows; ++r) {
    out[r] = fn(logits + static_cast<std::ptrdiff_t>(r) * vocab, vocab, temperatures[r],
                uniforms[r], write_probs);
  }
}

void SampleRows(float* logits, int rows, int vocab, float temperature,
                std::span<const float> uniforms, bool write_probs, std::span<RowResult> out) {
  assert(static_cast<int>(uniforms.size()) >= rows);
  assert(static_cast<int>(out.size()) >= rows);
  const RowFn fn = SelectKernel();
#pragma omp parallel for schedule(dynamic, 1)
  for (int r = 0; r < rows; ++r) {
    out[r] = fn(logits + static_cast<std::ptrdiff_t>(r) * vocab, vocab, temperature, uniforms[r],
                write_probs);
  }
}

RowResult SampleRowWithKernel(RowKernel kernel, float* row, int vocab, float temperature, float u,
                              bool write_probs) {
  const RowFn fn = kernel == RowKernel::kAuto       ? SelectKernel()
                   : kernel == RowKernel::kBaseline ? &SampleRowBaseline
                   : CpuHasAvx2Fma()                ? &SampleRowAvx2
                                                    : &SampleRowBaseline;
  return fn(row, vocab, temperature, u, write_probs);
}

const char* RowSamplerIsa() { return CpuHasAvx2Fma() ? "avx2+fma" : "baseline"; }

}  // namespace dgserve
