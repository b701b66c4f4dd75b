#include "engine/cpu/cpu_vocab.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/cpu/avx2_exp2.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/cpu/gemm.h"

namespace dgserve::cpu {
namespace {

constexpr int kTile = kVocabTile;  // vocabulary ids per tile: the E tile stays in L2
constexpr int kChunks = 16;        // vocabulary chunks (≥ the thread count of most CPU hosts)

// Per-row running state of one thread over its tiles.
struct RowState {
  float max_logit = -std::numeric_limits<float>::infinity();  // running max of ℓ (raw softcapped)
  int32_t argmax = -1;
  double sum = 0;         // S = Σ exp((ℓ − max)/T)
  double sum_d = 0;       // Q = Σ exp(d)·d, d = (ℓ − max)/T ≤ 0
  bool poisoned = false;  // a NaN logit was seen
};

// The first tile of vocabulary chunk `chunk` of `chunks` (chunk = chunks: the end). The pass and
// the sparse product's replay both cut the tiles here.
int ChunkTileBegin(int num_tiles, int chunks, int chunk) {
  return int(int64_t(num_tiles) * chunk / chunks);
}

// Copies rows `rows` of src [·, ld] (n floats each) to the rows of dst [rows.size(), ld_dst].
void GatherRows(std::span<const int> rows, const float* src, int64_t ld, int n, float* dst,
                int64_t ld_dst) {
  for (size_t j = 0; j < rows.size(); ++j) {
    std::memcpy(dst + j * ld_dst, src + size_t(rows[j]) * ld, sizeof(float) * n);
  }
}

// The inverse: the rows of src [rows.size(), ld_src] back to rows `rows` of dst [·, ld].
void ScatterRows(std::span<const int> rows, const float* src, int64_t ld_src, int n, float* dst,
                 int64_t ld) {
  for (size_t j = 0; j < rows.size(); ++j) {
    std::memcpy(dst + size_t(rows[j]) * ld, src + j * ld_src, sizeof(float) * n);
  }
}

// Sums of one tile of one row: exps written to `e`, returns S_t and Q_t (relative to `m`).
[[gnu::target("avx2,fma")]] void TileExpAvx2(const float* l, int n, float m, float inv_t, float* e,
                                             double* s_out, double* q_out) {
  const __m256 vm = _mm256_set1_ps(m), vk = _mm256_set1_ps(inv_t * 1.44269504088896341f);
  const __m256 lo = _mm256_set1_ps(-126.0f), ln2 = _mm256_set1_ps(0.693147180559945f);
  __m256 s = _mm256_setzero_ps(), q = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 w0 = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(l + i), vm), vk);  // log2 e^d
    const __m256 w = _mm256_max_ps(w0, lo);
    // Below 2^−126 the value is flushed to 0 (as the row sampler does).
    const __m256 keep = _mm256_cmp_ps(w0, lo, _CMP_GE_OQ);
    const __m256 ev = _mm256_and_ps(Exp2Avx2(w), keep);
    _mm256_storeu_ps(e + i, ev);
    s = _mm256_add_ps(s, ev);
    q = _mm256_fmadd_ps(ev, _mm256_mul_ps(w, ln2), q);
  }
  alignas(32) float sl[8], ql[8];
  _mm256_store_ps(sl, s);
  _mm256_store_ps(ql, q);
  double ss = 0, qq = 0;
  for (int j = 0; j < 8; ++j) {
    ss += sl[j];
    qq += ql[j];
  }
  for (; i < n; ++i) {
    const float d = (l[i] - m) * inv_t;
    const float ev = d < -87.33f ? 0.0f : std::exp(d);
    e[i] = ev;
    ss += ev;
    qq += double(ev) * d;
  }
  *s_out = ss;
  *q_out = qq;
}

// TileExpAvx2's arithmetic lane by lane (8 float accumulators, the same exp2, fma and order),
// then the same scalar tail: the same bits on any CPU.
void TileExpScalar(const float* l, int n, float m, float inv_t, float* e, double* s_out,
                   double* q_out) {
  const float k = inv_t * 1.44269504088896341f, ln2 = 0.693147180559945f;
  float s[8] = {}, q[8] = {};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float w0 = (l[i + j] - m) * k;
      const float w = std::isnan(w0) ? -126.0f : std::max(w0, -126.0f);  // _mm256_max_ps(w0, lo)
      const float ev = w0 >= -126.0f ? Exp2Scalar(w) : 0.0f;
      e[i + j] = ev;
      s[j] = s[j] + ev;
      q[j] = std::fma(ev, w * ln2, q[j]);
    }
  }
  double ss = 0, qq = 0;
  for (int j = 0; j < 8; ++j) {
    ss += s[j];
    qq += q[j];
  }
  for (; i < n; ++i) {
    const float d = (l[i] - m) * inv_t;
    const float ev = d < -87.33f ? 0.0f : std::exp(d);
    e[i] = ev;
    ss += ev;
    qq += double(ev) * d;
  }
  *s_out = ss;
  *q_out = qq;
}

// Rescales a row's state from reference max `from` to `to` ≥ from: S·α, Q → α(Q + δS), acc·α.
void Rescale(RowState& st, float to, float inv_t, float* acc, int dim) {
  if (st.sum == 0) {
    st.max_logit = to;
    return;
  }
  const double delta = double(st.max_logit - to) * inv_t;
  const double alpha = std::exp(delta);
  st.sum_d = alpha * (st.sum_d + delta * st.sum);
  st.sum *= alpha;
  if (acc) {
    const float a = float(alpha);
    for (int i = 0; i < dim; ++i) acc[i] *= a;
  }
  st.max_logit = to;
}

// Sets the logits of the ids of [v0, v0 + n) outside `mask` to −inf.
void ApplyMask(const uint64_t* mask, int v0, int n, float* l) {
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    const int v = v0 + i;
    if (((mask[v >> 6] >> (v & 63)) & 1) == 0) l[i] = kMasked;
  }
}

// The sparse product's guarantee: its error B ≤ 2⁻¹⁰ · (L − B) with L ≤ ‖s‖, so B < 2⁻¹⁰ ‖s‖ in
// Euclidean norm: a quarter of the worst change the reference's bf16 rounding of the product
// (unit roundoff 2⁻⁸ per element) makes.
constexpr double kBoundShare = 0x1.0p-10;

// What the vocabulary pass leaves for the soft-embedding product: every row's exps per id (as
// the pass computed them, relative to the running max of the row in its chunk at that tile), the
// per-tile sums and reference maxima, the chunks' final states, and each row's merged max and sum.
struct ProductInputs {
  const VocabStepArgs* a = nullptr;
  int chunks = 0, num_tiles = 0;
  const float* exps = nullptr;  // [M, V]
  const std::vector<RowState>* states = nullptr;
  const std::vector<float>* tile_sum = nullptr;
  const std::vector<float>* tile_ref = nullptr;
  const std::vector<float>* inv_t = nullptr;
  const std::vector<float>* row_max = nullptr;
  const std::vector<double>* row_sum = nullptr;

  int TileBegin(int chunk) const { return ChunkTileBegin(num_tiles, chunks, chunk); }
};

// The soft embeddings s_r = scale · Σ_v q_v E_v of every row, written to a.soft, from the exps
// the pass stored. The accumulation replays the fused dense product's order exactly: per chunk,
// tiles in order, each accumulator rescaled where the pass moved the row's reference max, chunks
// merged in order — so a row that leaves nothing out gets the fused product's bits. Row r leaves
// tile t out where skip[t·M + r].
void SoftProduct(const ProductInputs& in, const char* skip) {
  const VocabStepArgs& a = *in.a;
  const int M = a.rows, V = a.vocab, D = a.dim, chunks = in.chunks;
  std::vector<float> accs(size_t(chunks) * M * D, 0.0f);
#pragma omp parallel
  {
    std::vector<int> active;              // rows that take this tile
    std::vector<float> e_rows, acc_rows;  // their exps and accumulators, gathered
    std::vector<float> ref(M);
    std::vector<char> any_positive(M);
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < chunks; ++t) {
      float* acc = accs.data() + size_t(t) * M * D;
      std::fill(ref.begin(), ref.end(), -std::numeric_limits<float>::infinity());
      std::fill(any_positive.begin(), any_positive.end(), 0);
      for (int tile = in.TileBegin(t); tile < in.TileBegin(t + 1); ++tile) {
        const int v0 = tile * kTile, cols = std::min(kTile, V - v0);
        active.clear();
        for (int r = 0; r < M; ++r) {
          const float tref = (*in.tile_ref)[size_t(tile) * M + r];
          if (tref != ref[r]) {          // the pass rescaled this row's state here (Rescale)
            if (any_positive[r] != 0) {  // Rescale returns early while the sum is 0
              const float alpha = float(std::exp(double(ref[r] - tref) * (*in.inv_t)[r]));
              float* acc_r = acc + size_t(r) * D;
              for (int i = 0; i < D; ++i) acc_r[i] *= alpha;
            }
            ref[r] = tref;
          }
          if ((*in.tile_sum)[size_t(tile) * M + r] > 0) any_positive[r] = 1;
          if (!skip[size_t(tile) * M + r]) active.push_back(r);
        }
        if (active.empty()) continue;
        // acc[rows] += e[rows, cols] · E_tile[cols, D]. Rows are gathered (exact copies) when
        // some are left out; each row's chains are its own either way (cpu/gemm.h).
        const GemmB et = GemmB::RowMajor(a.embed + size_t(v0) * D, D);
        const int na = int(active.size());
        if (na == M) {
          GemmArgs g = GemmArgs::Of(M, D, cols, in.exps + v0, V, et, acc, D, true);
          g.input = a.gemm_input;
          Gemm(g, GemmThreads::kCallerOnly);
          continue;
        }
        e_rows.resize(size_t(na) * kTile);
        acc_rows.resize(size_t(na) * D);
        GatherRows(active, in.exps + v0, V, cols, e_rows.data(), kTile);
        GatherRows(active, acc, D, D, acc_rows.data(), D);
        GemmArgs g = GemmArgs::Of(na, D, cols, e_rows.data(), kTile, et, acc_rows.data(), D, true);
        g.input = a.gemm_input;
        Gemm(g, GemmThreads::kCallerOnly);
        ScatterRows(active, acc_rows.data(), D, D, acc, D);
      }
    }
  }
  // Merge the chunks per row (chunk order = vocabulary order), then normalise.
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int r = 0; r < M; ++r) {
    float* soft = a.soft + size_t(r) * D;
    std::fill(soft, soft + D, 0.0f);
    for (int t = 0; t < chunks; ++t) {
      RowState s = (*in.states)[size_t(t) * M + r];
      if (s.argmax < 0) continue;
      float* acc_r = accs.data() + (size_t(t) * M + r) * D;
      Rescale(s, (*in.row_max)[r], (*in.inv_t)[r], acc_r, D);
      for (int i = 0; i < D; ++i) soft[i] += acc_r[i];
    }
    const float scale = float(a.embed_scale / (*in.row_sum)[r]);
    for (int i = 0; i < D; ++i) soft[i] *= scale;
  }
}

// The sparse product's plan for row r (marks skip[t·M + r]; returns the count of tiles left out):
// greedily in vocabulary order, each tile whose exact mass q_t still fits the row's budget
// skip_mass. With N_t the tile's max ‖E_v‖₂, the omission is at most B = scale · Σ_left-out q_t N_t
// in norm, and L = scale · (q_max ‖E_argmax‖ − Σ_t q'_t N_t) ≤ ‖s‖ (triangle inequality; q'_t = q_t
// except q_max less in the argmax's tile). The plan stands only if B ≤ 2⁻¹⁰ · (L − B); otherwise
// — or when it would leave out no mass — nothing is left out (*kept_dense = 1 in the first case).
int64_t PlanRow(const ProductInputs& in, int r, double skip_mass, char* skip, char* kept_dense) {
  const VocabStepArgs& a = *in.a;
  const int M = a.rows, D = a.dim;
  const double m = (*in.row_max)[r], sum = (*in.row_sum)[r], inv_t = (*in.inv_t)[r];
  const int32_t am = a.out[r].argmax;
  const double q_max = 1.0 / sum;          // the argmax's exp is exp(0) = 1
  double left = 0, bound = 0, spread = 0;  // Σ q_t, Σ q_t N_t (left out), Σ q'_t N_t (all)
  int64_t count = 0;
  for (int tile = 0; tile < in.num_tiles; ++tile) {
    const float ts = (*in.tile_sum)[size_t(tile) * M + r];
    double q = 0;
    if (ts > 0) {
      q = double(ts) * std::exp(double((*in.tile_ref)[size_t(tile) * M + r] - m) * inv_t) / sum;
    }
    const double n_t = a.embed_tile_norm_max[tile];
    spread += (tile == am / kTile ? std::max(0.0, q - q_max) : q) * n_t;
    if (left + q > skip_mass) continue;
    left += q;
    bound += q * n_t;
    skip[size_t(tile) * M + r] = 1;
    ++count;
  }
  bool keep = left > 0;
  if (keep) {
    double am_norm2 = 0;
    for (int i = 0; i < D; ++i) {
      const double x = Bf16ToFloat(a.embed[size_t(am) * D + i]);
      am_norm2 += x * x;
    }
    const double scale = std::fabs(double(a.embed_scale));
    const double b = scale * bound, lower = scale * (q_max * std::sqrt(am_norm2) - spread);
    keep = b <= kBoundShare * (lower - b);
    if (!keep) *kept_dense = 1;
  }
  if (!keep) {
    for (int tile = 0; tile < in.num_tiles; ++tile) skip[size_t(tile) * M + r] = 0;
    return 0;
  }
  return count;
}

}  // namespace

std::vector<float> EmbeddingTileNormMax(const uint16_t* table, int64_t rows, int dim) {
  const int64_t tiles = (rows + kTile - 1) / kTile;
  std::vector<float> out(tiles);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tiles; ++t) {
    double best = 0;
    for (int64_t v = t * kTile; v < std::min(rows, (t + 1) * kTile); ++v) {
      double ss = 0;
      for (int i = 0; i < dim; ++i) {
        const double x = Bf16ToFloat(table[v * dim + i]);
        ss += x * x;
      }
      best = std::max(best, ss);
    }
    // Rounded up: float(√best) may be below √best by half an ulp; the factor covers it.
    out[t] = float(std::sqrt(best) * (1.0 + 1e-6));
  }
  return out;
}

absl::Status FusedVocabStep(const VocabStepArgs& a) {
  const bool avx2 = UseAvx2Elementwise();
  const int M = a.rows, V = a.vocab, D = a.dim;
  if (M == 0) return absl::OkStatus();
  const int num_tiles = (V + kTile - 1) / kTile;
  // The vocabulary is cut into a fixed number of chunks, whatever the thread count, and the
  // chunks' partial sums are merged in chunk order: the result does not depend on the thread count.
  const int chunks = std::max(1, std::min(kChunks, num_tiles));
  // The soft embedding is multiplied tile by tile during the pass (fused, dense), or — sparse —
  // after it from the stored exps, when every tile's final mass is known.
  const bool sparse = a.soft != nullptr && a.sc_skip_mass > 0 && a.embed_tile_norm_max != nullptr;
  // Per chunk: row states and (fused) soft accumulators; per tile and row: the tile's exp sum and
  // the max it was taken against (for the sampling scan and the sparse product).
  std::vector<RowState> states(size_t(chunks) * M);
  std::vector<float> accs(a.soft && !sparse ? size_t(chunks) * M * D : 0, 0.0f);
  std::vector<float> tile_sum(size_t(num_tiles) * M), tile_ref(size_t(num_tiles) * M);
  std::vector<float> inv_t(M);
  for (int r = 0; r < M; ++r) inv_t[r] = 1.0f / a.temperature[r];
  // The caller's scratch keeps the [M, V] exps across calls (VocabScratch); without one, this
  // call's.
  VocabScratch local_scratch;
  std::vector<float>& exps_buffer = (a.scratch != nullptr ? a.scratch : &local_scratch)->exps;
  // The bf16-input mode rounds the hidden states once for every LM-head product of the step.
  Bf16Activations hidden_rounded;
  GemmABf16 hidden_bf16;
  if (a.gemm_input == GemmInput::kBf16) {
    hidden_rounded = Bf16Activations::Round(a.hidden, M, D, D);
    hidden_bf16 = hidden_rounded.View();
  }
  float* exps = nullptr;
  if (sparse) {
    if (exps_buffer.size() < size_t(M) * V) exps_buffer.resize(size_t(M) * V);
    exps = exps_buffer.data();
  }

#pragma omp parallel
  {
    std::vector<float> lbuf(size_t(M) * kTile), ebuf(exps ? 0 : size_t(M) * kTile);
#pragma omp for schedule(dynamic, 1)
    for (int t = 0; t < chunks; ++t) {
      const int tile_begin = ChunkTileBegin(num_tiles, chunks, t);
      const int tile_end = ChunkTileBegin(num_tiles, chunks, t + 1);
      RowState* st = states.data() + size_t(t) * M;
      float* acc = accs.empty() ? nullptr : accs.data() + size_t(t) * M * D;
      for (int tile = tile_begin; tile < tile_end; ++tile) {
        const int v0 = tile * kTile, n = std::min(kTile, V - v0);
        const uint16_t* et = a.embed + size_t(v0) * D;
        // Logits of the tile: [M, n] = hidden · E_tileᵀ, softcapped.
        float* l = lbuf.data();
        int ldl = n;
        if (a.logits) {
          l = a.logits + v0;
          ldl = V;
        }
        GemmArgs lg = GemmArgs::Of(M, n, D, a.hidden, D, a.lm_head->AsGemmB(v0), l,
                                   ldl);  // l[M, n] = hidden[M, D] · E[v0 : v0 + n]ᵀ
        lg.input = a.gemm_input;
        lg.a_bf16 = hidden_bf16;
        Gemm(lg, GemmThreads::kCallerOnly);
        for (int r = 0; r < M; ++r) {
          float* lr = l + size_t(r) * ldl;
          Softcap(lr, n, a.softcap);
          const uint64_t* mask = a.masks ? a.masks[r] : nullptr;
          if (mask) ApplyMask(mask, v0, n, lr);
          // Tile max; the argmax (first index on ties) is only searched for when it beats the
          // running max, which after the first tiles is rare.
          float tile_max = lr[0];
          int nan_count = 0;
#pragma omp simd reduction(max : tile_max) reduction(+ : nan_count)
          for (int i = 0; i < n; ++i) {
            tile_max = std::max(tile_max, lr[i]);
            nan_count += lr[i] != lr[i];
          }
          RowState& s = st[r];
          if (nan_count > 0) s.poisoned = true;  // reported after the merge
          float* acc_r = acc ? acc + size_t(r) * D : nullptr;
          if (tile_max > s.max_logit) {
            // The reduction's result need not be an element: where no element beats the
            // private copies' initial value (a tile of −inf, masked, or of NaN), OpenMP leaves
            // that value, which clang makes −FLT_MAX (g++: −inf). Such a tile raises no max.
            int best = 0;
            while (best < n && lr[best] != tile_max) ++best;
            if (best < n) {
              s.argmax = v0 + best;
              Rescale(s, tile_max, inv_t[r], acc_r, D);
            }
          }
          double ts, tq;
          float* e = exps ? exps + size_t(r) * V + v0 : ebuf.data() + size_t(r) * kTile;
          if (s.max_logit == -std::numeric_limits<float>::infinity()) {
            // Every id so far is masked: nothing to add (and ℓ − max would be NaN).
            std::fill(e, e + n, 0.0f);
            ts = tq = 0;
          } else if (avx2) {
            TileExpAvx2(lr, n, s.max_logit, inv_t[r], e, &ts, &tq);
          } else {
            TileExpScalar(lr, n, s.max_logit, inv_t[r], e, &ts, &tq);
          }
          s.sum += ts;
          s.sum_d += tq;
          tile_sum[size_t(tile) * M + r] = float(ts);
          tile_ref[size_t(tile) * M + r] = s.max_logit;
        }
        if (acc) {  // acc[M, D] += e[M, n] · E_tile[n, D]
          GemmArgs sg =
              GemmArgs::Of(M, D, n, ebuf.data(), kTile, GemmB::RowMajor(et, D), acc, D, true);
          sg.input = a.gemm_input;
          Gemm(sg, GemmThreads::kCallerOnly);
        }
      }
    }
  }

  // Merge the chunks' states per row (chunk order = vocabulary order), then sample.
  int bad_row = -1;
  std::vector<float> row_max(M);
  std::vector<double> row_sum(M);
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int r = 0; r < M; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    int32_t argmax = 0;
    bool poisoned = false;
    for (int t = 0; t < chunks; ++t) {
      const RowState& s = states[size_t(t) * M + r];
      poisoned |= s.poisoned;
      if (s.argmax >= 0 && s.max_logit > m) {
        m = s.max_logit;
        argmax = s.argmax;
      }
    }
    double sum = 0, sum_d = 0;
    float* soft = a.soft && !sparse ? a.soft + size_t(r) * D : nullptr;
    if (soft) std::fill(soft, soft + D, 0.0f);
    for (int t = 0; t < chunks; ++t) {
      RowState s = states[size_t(t) * M + r];
      if (s.argmax < 0) continue;
      float* acc_r = soft ? accs.data() + (size_t(t) * M + r) * D : nullptr;
      Rescale(s, m, inv_t[r], acc_r, D);
      sum += s.sum;
      sum_d += s.sum_d;
      if (soft) {
        for (int i = 0; i < D; ++i) soft[i] += acc_r[i];
      }
    }
    row_max[r] = m;
    row_sum[r] = sum;
    if (poisoned || !(std::isfinite(m) && std::isfinite(sum) && sum > 0)) {
#pragma omp critical(dgserve_vocab_bad_row)
      bad_row = bad_row < 0 ? r : std::min(bad_row, r);
      continue;
    }
    RowResult& out = a.out[r];
    out.argmax = argmax;
    out.entropy = float(std::max(0.0, std::log(sum) - sum_d / sum));
    out.lse = float(double(m) * inv_t[r] + std::log(sum));
    if (soft) {
      const float scale = float(a.embed_scale / sum);
      for (int i = 0; i < D; ++i) soft[i] *= scale;
    }
    // Inverse-CDF sample: the first id whose running exp sum exceeds u·S.
    const double u = std::clamp(double(a.uniforms[r]), 0.0, std::nextafter(1.0, 0.0));
    const double target = u * sum;
    double cum = 0;
    int chosen_tile = -1;
    int last_nonzero_tile = 0;
    for (int tile = 0; tile < num_tiles; ++tile) {
      const double ts = double(tile_sum[size_t(tile) * M + r]) *
                        std::exp(double(tile_ref[size_t(tile) * M + r] - m) * inv_t[r]);
      if (ts <= 0) continue;
      last_nonzero_tile = tile;
      if (cum + ts > target) {
        chosen_tile = tile;
        break;
      }
      cum += ts;
    }
    if (chosen_tile < 0) chosen_tile = last_nonzero_tile;
    // Recompute the chosen tile's logits for this row (the same GEMM and softcap as the tile
    // pass, so the same bits) and scan it.
    const int v0 = chosen_tile * kTile, n = std::min(kTile, V - v0);
    float lrow[kTile];
    GemmArgs rg =
        GemmArgs::Of(1, n, D, a.hidden + size_t(r) * D, D, a.lm_head->AsGemmB(v0), lrow, n);
    rg.input = a.gemm_input;
    if (!hidden_bf16.empty()) rg.a_bf16 = hidden_rounded.View(r);
    Gemm(rg, GemmThreads::kCallerOnly);
    Softcap(lrow, n, a.softcap);
    if (a.masks && a.masks[r]) ApplyMask(a.masks[r], v0, n, lrow);
    int32_t sampled = -1, last_positive = v0;
    for (int i = 0; i < n; ++i) {
      const float l = lrow[i];
      const double e = std::exp(double(l - m) * inv_t[r]);
      if (e <= 0) continue;
      last_positive = v0 + i;
      cum += e;
      if (cum > target) {
        sampled = v0 + i;
        break;
      }
    }
    out.sampled = sampled >= 0 ? sampled : last_positive;
  }
  if (bad_row >= 0) {
    return absl::InternalError(
        absl::StrCat("non-finite logits in canvas row ", bad_row,
                     " (corrupt weights or numerical overflow); no token can be sampled"));
  }
  if (a.soft && a.stats) a.stats->tile_rows += int64_t(M) * num_tiles;
  if (!sparse) return absl::OkStatus();

  // The sparse soft embeddings: each row's plan, then the product.
  ProductInputs in;
  in.a = &a;
  in.chunks = chunks;
  in.num_tiles = num_tiles;
  in.exps = exps;
  in.states = &states;
  in.tile_sum = &tile_sum;
  in.tile_ref = &tile_ref;
  in.inv_t = &inv_t;
  in.row_max = &row_max;
  in.row_sum = &row_sum;
  std::vector<char> skip(size_t(num_tiles) * M, 0), kept(M, 0);
  std::vector<int64_t> pairs(M, 0);
#pragma omp parallel for schedule(static) if (M >= 8)
  for (int r = 0; r < M; ++r) pairs[r] = PlanRow(in, r, a.sc_skip_mass, skip.data(), &kept[r]);
  SoftProduct(in, skip.data());
  if (a.stats != nullptr) {
    for (int r = 0; r < M; ++r) {
      a.stats->tile_rows_skipped += pairs[r];
      a.stats->rows_kept_dense += kept[r];
    }
  }
  return absl::OkStatus();
}

}  // namespace dgserve::cpu
