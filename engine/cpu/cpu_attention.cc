#include "engine/cpu/cpu_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/bf16.h"

namespace dgserve::cpu {

void SequenceAttention(const AttentionShape& shape, const float* q,
                       absl::FunctionRef<void(int, const float**, const float**)> key_rows,
                       GemmInput input, float* out) {
  const int hd = shape.head_dim, nh = shape.heads, nkv = shape.kv_heads;
  const int group = nh / nkv, nkeys = shape.keys;
  const bool bf16 = input == GemmInput::kBf16;
  constexpr int kQueryBlock = 128;  // query rows per score GEMM: scores stay [128, keys]
  constexpr int kTileKeys = 32;     // the kernels' key tile (bf16 mode's running max)
  if (shape.rows <= 0 || nkeys <= 0) return;
  // bf16: the rounded queries (float32 mode reads q as it is).
  std::vector<float> q_bf16;
  if (bf16) {
    q_bf16.resize(size_t(shape.rows) * nh * hd);
    for (size_t i = 0; i < q_bf16.size(); ++i) q_bf16[i] = RoundToBf16(q[i]);
    q = q_bf16.data();
  }
  // K per KV head in the GEMM's panel layout (16 keys × hd, key-minor; keys past nkeys zero):
  // key j, dim d at kpanel[g·kpstride + ((j / 16)·hd + d)·16 + j % 16]. V per KV head row-major
  // [nkeys, hd]. bf16: both rounded on the way (the caller's rows stay as they are).
  const int64_t kpstride = int64_t((nkeys + kGemmPanel - 1) / kGemmPanel) * kGemmPanel * hd;
  std::vector<float> kpanel(size_t(nkv) * kpstride, 0.0f), vpanel(size_t(nkv) * nkeys * hd);
#pragma omp parallel for schedule(static) if (nkeys >= 64)
  for (int j = 0; j < nkeys; ++j) {
    const float *kr, *vr;
    key_rows(j, &kr, &vr);
    for (int g = 0; g < nkv; ++g) {
      float* kp =
          &kpanel[size_t(g) * kpstride + size_t(j / kGemmPanel) * kGemmPanel * hd + j % kGemmPanel];
      float* vp = &vpanel[(size_t(g) * nkeys + j) * hd];
      const float* kg = kr + size_t(g) * hd;
      const float* vg = vr + size_t(g) * hd;
      if (bf16) {
        for (int d = 0; d < hd; ++d) kp[size_t(d) * kGemmPanel] = RoundToBf16(kg[d]);
        for (int d = 0; d < hd; ++d) vp[d] = RoundToBf16(vg[d]);
      } else {
        for (int d = 0; d < hd; ++d) kp[size_t(d) * kGemmPanel] = kg[d];
        std::memcpy(vp, vg, sizeof(float) * hd);
      }
    }
  }
  // Query row r sees keys [KeyLo(r), KeyHi(r)): causal (+ window) or everything.
  auto key_hi = [&](int r) { return shape.causal >= 0 ? shape.causal + r + 1 : nkeys; };
  auto key_lo = [&](int r) {
    return shape.causal >= 0 && shape.window > 0 ? std::max(0, key_hi(r) - shape.window) : 0;
  };
  const int blocks = (shape.rows + kQueryBlock - 1) / kQueryBlock;
  // One single-threaded GEMM pair per (query block, head). A block computes the scores of keys
  // [klo, khi) for all its rows and masks each row to its own keys with exact zeros, so every
  // row's softmax sum and P·V chain run over its keys in ascending position order with zero
  // terms that change nothing: a row's output does not depend on the block or the chunk of the
  // prompt it falls in.
#pragma omp parallel
  {
    std::vector<float> scores, inv_sum;
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int b = 0; b < blocks; ++b) {
      for (int hq = 0; hq < nh; ++hq) {
        const int r0 = b * kQueryBlock, rows = std::min(kQueryBlock, shape.rows - r0);
        const int klo = key_lo(r0) / kGemmPanel * kGemmPanel;  // a panel boundary
        const int khi = key_hi(r0 + rows - 1), nk = khi - klo;
        const int g = hq / group;
        const float* qb = q + size_t(r0) * nh * hd + size_t(hq) * hd;
        scores.resize(size_t(rows) * nk);
        inv_sum.resize(rows);
        // Scores = Q·Kᵀ with scale 1.0 (spec §3.1.5).
        const GemmArgs sg = GemmArgs::Of(
            rows, nk, hd, qb, nh * hd,
            GemmB::Panels(&kpanel[size_t(g) * kpstride + size_t(klo) * hd], hd), scores.data(), nk);
        Gemm(sg, GemmThreads::kCallerOnly);
        for (int i = 0; i < rows; ++i) {
          float* sr = scores.data() + size_t(i) * nk;
          const int lo = key_lo(r0 + i) - klo, hi = key_hi(r0 + i) - klo;
          float mx = -INFINITY;
          for (int j = lo; j < hi; ++j) mx = std::max(mx, sr[j]);
          float sum = 0;
          if (bf16) {
            // The kernels' running max: m_t = the max of the row's scores in key tiles 0 … t
            // (tile of key j: (klo + j + tile_offset) / 32). P = bf16(exp(s − m_t)) · exp(m_t − m),
            // l = Σ_t exp(m_t − m) · Σ_{j in t} exp(s − m_t) (unrounded).
            for (int j = 0; j < lo; ++j) sr[j] = 0.0f;
            for (int j = hi; j < nk; ++j) sr[j] = 0.0f;
            int j = lo;
            float mt = -INFINITY;
            while (j < hi) {
              const int tile = (klo + j + shape.tile_offset) / kTileKeys;
              const int tend = std::min(hi, (tile + 1) * kTileKeys - shape.tile_offset - klo);
              for (int x = j; x < tend; ++x) mt = std::max(mt, sr[x]);
              const float scale = std::exp(mt - mx);
              float tsum = 0;
              for (int x = j; x < tend; ++x) {
                const float e = std::exp(sr[x] - mt);
                tsum += e;
                sr[x] = RoundToBf16(e) * scale;
              }
              sum += tsum * scale;
              j = tend;
            }
            inv_sum[i] = 1.0f / sum;
            continue;
          }
          for (int j = 0; j < nk; ++j) {
            sr[j] = (j >= lo && j < hi) ? std::exp(sr[j] - mx) : 0.0f;
            sum += sr[j];
          }
          const float inv = 1.0f / sum;
          for (int j = lo; j < hi; ++j) sr[j] *= inv;
        }
        float* ob = out + size_t(r0) * nh * hd + size_t(hq) * hd;
        const GemmArgs og =
            GemmArgs::Of(rows, hd, nk, scores.data(), nk,
                         GemmB::RowMajor(&vpanel[(size_t(g) * nkeys + klo) * hd], hd), ob, nh * hd);
        Gemm(og, GemmThreads::kCallerOnly);
        if (bf16) {
          for (int i = 0; i < rows; ++i) {
            for (int d = 0; d < hd; ++d) ob[size_t(i) * nh * hd + d] *= inv_sum[i];
          }
        }
      }
    }
  }
}

}  // namespace dgserve::cpu
