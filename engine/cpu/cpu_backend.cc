// CPU implementation of ModelBackend: the DiffusionGemma forward pass (spec §3), float32
// activations, bf16 weights (widened exactly inside the GEMM).
//
// GEMM input modes (CpuBackendOptions::gemm_input, --cpu_gemm_input). float32: every GEMM takes
// the float32 activations as they are. bf16: the GEMMs' activations are rounded to bf16 (nearest
// even, denormals to zero) at these points, which are the reference's GEMM inputs (spec §5.3:
// HF runs bf16 activations, so every matmul input is a bf16 value):
//   1. q_proj, k_proj, v_proj input: input_layernorm(h)                      (§3.2 step 1, §3.3)
//   2. o_proj input: the attention output, heads concatenated                (§3.1.5)
//   3. dense MLP gate/up input: pre_feedforward_layernorm(h1); down input: gelu(g)·u  (§3.1.3)
//   4. router input: rms_noscale(h1)·scale·D^−½                               (§3.2 step 5)
//   5. expert gate_up input: pre_feedforward_layernorm_2(h1); down input: gelu(g)·u
//   6. self-conditioning MLP: pre_norm(soft) into gate/up, gelu(g)·u into down (§3.5 step 3)
//   7. LM head input: the final-normed hidden state                          (§3.1.6)
//   8. self-conditioning soft embedding: the probabilities (SoftEmbedding: bf16(q) as §3.5 step 2
//      says; the fused vocabulary step: bf16 of each exp(ℓ/T − running max), the unnormalised
//      probability its online softmax carries — the same relative rounding, but not the bits of
//      bf16(q), which needs the row's sum before the product)
// Each product is then the VDPBF16PS chain of cpu/gemm.h (exact bf16 products, float32 sums).
//   9. attention (cpu_attention.h, spec §5.3 items 4–6): q after q_norm and RoPE, k after k_norm
//      and RoPE, v after v_norm (full layers: V = rms_noscale(raw k projection), rounded after
//      its norm) are rounded to bf16 before Q·Kᵀ and P·V, and so are the probabilities, in the
//      CUDA tensor-core kernels' form: P = bf16(exp(s − m_t)) · exp(m_t − m) with m_t the running
//      max over tiles of 32 keys (the decoder's from its first visible key; the encoder's at
//      positions multiple of 32), l = Σ exp(s − m_t) · exp(m_t − m) over the unrounded terms,
//      out = (Σ P·v) · (1 / l). K and V are rounded as the attention gathers them: the KV cache
//      keeps the float32 rows (what the prefix cache, KV transfer and the CUDA mirrors receive, as
//      before; rounding there would change nothing here, since rounding is idempotent). Left
//      different from the kernels: the float32 addition order, the products of P with exp(m_t − m)
//      (rounded to float32 here; the kernels rescale O and l per tile), and contexts on the CUDA
//      split-KV path (splits at multiples of 4096 context tokens, each with its own running max,
//      merged by a combine): full layers past 4096 tokens, and sliding layers whose window
//      crosses a multiple of 4096. The scores Q·Kᵀ (products of bf16 values, exact) run in
//      float32 mode on the rounded values; this is the reference's fused-kernel form (§5.3
//      item 6), not its eager form, which rounds the scores and the normalised probabilities.
// Not applied (float32 in both modes): the GEMM outputs (the reference's are bf16, the LM
// head's included, §5.3 item 2), RMSNorm outputs other than as GEMM or attention inputs, residual
// adds and the layer scalar (bf16 in the reference), the embedding scale product, RoPE's bf16
// cos/sin, the router softmax and the MoE combine.
//
// Same seed, same tokens, by construction: every GEMM output is one fma chain over k in ascending
// order (engine/cpu/gemm.h), and every other reduction (RMSNorm, softmaxes, the MoE combine)
// runs in a fixed order over one row; the attention's roundings are per element and its tiles
// depend only on positions. A row's result therefore depends only on that row's inputs,
// never on what it is batched with, where it sits in the batch, the chunking of a prompt, the
// thread count or the instruction set.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "engine/cpu/cpu_attention.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/cpu/cpu_vocab.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/model/backend.h"
#include "engine/model/model_math.h"

namespace dgserve {
namespace {

using cpu::Gemm;
using cpu::GemmArgs;
using cpu::GemmB;
using cpu::GemmThreads;
using cpu::kGemmPanel;
using cpu::Linear;
using cpu::PackedMatrix;
using cpu::RmsNorm;

// Which keys a block of query rows may see, per layer (spec §3.4 / §3.5).
enum class PassKind { kEncoder, kDecoder };

// One sequence inside a batched pass: its rows in the stacked activations and its positions.
// Segments are stacked back to back (no padding: a row computes the same bits wherever it is).
struct Segment {
  int row0 = 0;  // first row in the stacked [R, D] activations
  int rows = 0;  // new tokens (encoder) or canvas length (decoder)
  int pos0 = 0;  // position of the first row
  const KvCache* kv = nullptr;
  KvCache* kv_write = nullptr;  // encoder only
};

class CpuBackend final : public ModelBackend {
 public:
  CpuBackend(const ModelConfig& config, const ModelWeights& weights,
             const CpuBackendOptions& options)
      : c_(config), w_(weights), in_(options.gemm_input), observer_(options.linear_observer) {
    rope_sliding_ = RopeInvFreq(c_.rope_theta_sliding, c_.head_dim, c_.head_dim / 2);
    rope_full_ = RopeInvFreq(c_.rope_theta_full, c_.global_head_dim, c_.FullRopeAngles());
    sc_skip_mass_ = options.dense_self_conditioning ? 0.0 : cpu::kDefaultScSkipMass;
    if (sc_skip_mass_ > 0) {
      embed_tile_norm_max_ =
          cpu::EmbeddingTileNormMax(w_.embed_tokens.data(), c_.vocab_size, c_.hidden_size);
    }
  }

  const ModelConfig& config() const override { return c_; }

  absl::Status Encode(std::span<const EncodeInput> batch) override;
  absl::Status Decode(std::span<const DecodeInput> batch) override;
  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override;
  absl::Status SoftEmbedding(const float* probs, int rows, float* soft) override;
  DecodeTimings last_decode_timings() const override { return timings_; }

 private:
  // The canvas part of a decoder input.
  struct CanvasInput {
    std::span<const int32_t> canvas;
    const float* sc_soft;
    const KvCache* kv;
  };
  // Decoder body (spec §3.5 steps 1–4 and the final norm) for a batch of canvases: fills the
  // segments and the final-normed hidden states [R, D]; records timings_.body_seconds.
  absl::Status Body(std::span<const CanvasInput> batch, std::vector<Segment>* segs,
                    std::vector<float>* hidden);
  absl::Status CheckTokens(std::span<const int32_t> ids) const;
  // e[r] = E[ids[r]] · bf16(√D).
  void Embed(std::span<const int32_t> ids, float* out) const;
  // Runs layer `l` on h [R, D] in place.
  void Layer(int l, PassKind kind, std::span<const Segment> segs, int R, float* h) const;
  void Attention(int l, PassKind kind, std::span<const Segment> segs, const float* q,
                 const float* k_new, const float* v_new, float* out) const;
  void Moe(int l, bool encoder, std::span<const Segment> segs, const float* h1, int R,
           float* m) const;
  // `site`: kMlpGateUp or kScGateUp (the observer's site of gate/up; down is the next one).
  void GatedMlp(const float* x, int R, const PackedMatrix& gate, const PackedMatrix& up,
                const PackedMatrix& down, float* out, LinearSite site, int layer,
                bool encoder) const;
  // Tells the observer (if any) about a Linear's input x [rows, cols].
  void Observe(LinearSite site, int layer, int expert, bool encoder, const float* x, int rows,
               int cols) const {
    if (observer_ != nullptr) observer_->Observe(site, layer, expert, encoder, x, rows, cols);
  }

  const ModelConfig c_;  // a copy: small, and callers need not keep theirs alive
  const ModelWeights& w_;
  const cpu::GemmInput in_;  // every projection's GEMM input mode (see the top of this file)
  LinearInputObserver* const observer_;  // null: no observation
  std::vector<float> rope_sliding_, rope_full_;
  double sc_skip_mass_ = 0;  // sparse self-conditioning budget (cpu_vocab.h); 0 = dense
  std::vector<float> embed_tile_norm_max_;  // per 512-id tile, max ‖E_v‖₂, for its bound
  cpu::VocabScratch vocab_scratch_;         // the sparse product's exps, kept between steps
  DecodeTimings timings_;
};

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

absl::Status CpuBackend::CheckTokens(std::span<const int32_t> ids) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= c_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " is outside the vocabulary [0, ", c_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

void CpuBackend::Embed(std::span<const int32_t> ids, float* out) const {
  const int D = c_.hidden_size;
  const float scale = c_.EmbedScale();
  for (size_t r = 0; r < ids.size(); ++r) {
    const uint16_t* e = w_.embed_tokens.data() + int64_t(ids[r]) * D;
    for (int i = 0; i < D; ++i) out[r * D + i] = Bf16ToFloat(e[i]) * scale;
  }
}

void CpuBackend::GatedMlp(const float* x, int R, const PackedMatrix& gate, const PackedMatrix& up,
                          const PackedMatrix& down, float* out, LinearSite site, int layer,
                          bool encoder) const {
  const int width = gate.rows();
  std::vector<float> g(size_t(R) * width), u(size_t(R) * width);
  Observe(site, layer, -1, encoder, x, R, gate.cols());
  Linear(x, R, gate, g.data(), false, GemmThreads::kOpenMp, in_);
  Linear(x, R, up, u.data(), false, GemmThreads::kOpenMp, in_);
  cpu::GeluGate(g.data(), u.data(), int64_t(R) * width, g.data());
  Observe(site == LinearSite::kScGateUp ? LinearSite::kScDown : LinearSite::kMlpDown, layer, -1,
          encoder, g.data(), R, width);
  Linear(g.data(), R, down, out, false, GemmThreads::kOpenMp, in_);
}

void CpuBackend::Layer(int l, PassKind kind, std::span<const Segment> segs, int R, float* h) const {
  const LayerWeights& lw = w_.layers[l];
  const int D = c_.hidden_size, hd = c_.HeadDim(l), nh = c_.num_heads, nkv = c_.KvHeads(l);
  const float eps = c_.rms_norm_eps;
  const bool full = c_.IsFull(l);
  const std::vector<float>& inv_freq = full ? rope_full_ : rope_sliding_;

  // 1–2. Attention block on a = input_layernorm(h).
  std::vector<float> a(size_t(R) * D);
  RmsNorm(h, lw.input_layernorm.data(), R, D, eps, a.data());
  std::vector<float> q(size_t(R) * nh * hd), k(size_t(R) * nkv * hd), v(size_t(R) * nkv * hd);
  const bool encoder = kind == PassKind::kEncoder;
  Observe(LinearSite::kQkv, l, -1, encoder, a.data(), R, D);
  Linear(a.data(), R, lw.q_proj, q.data(), false, GemmThreads::kOpenMp, in_);
  Linear(a.data(), R, lw.k_proj, k.data(), false, GemmThreads::kOpenMp, in_);
  if (full) {
    v = k;  // V = rms_noscale(raw k projection) on full layers (spec §3.3)
  } else {
    Linear(a.data(), R, lw.v_proj, v.data(), false, GemmThreads::kOpenMp, in_);
  }
  RmsNorm(q.data(), lw.q_norm.data(), R * nh, hd, eps, q.data());
  RmsNorm(k.data(), lw.k_norm.data(), R * nkv, hd, eps, k.data());
  RmsNorm(v.data(), nullptr, R * nkv, hd, eps, v.data());
  for (const Segment& s : segs) {
#pragma omp parallel for schedule(static) if (s.rows >= 16)
    for (int r = 0; r < s.rows; ++r) {
      const int row = s.row0 + r, pos = s.pos0 + r;
      cpu::ApplyRope(q.data() + size_t(row) * nh * hd, nh, hd, pos, inv_freq);
      cpu::ApplyRope(k.data() + size_t(row) * nkv * hd, nkv, hd, pos, inv_freq);
    }
  }
  if (kind == PassKind::kEncoder) {
    // The encoder writes the new K/V rows into the cache; attention then reads them from there.
    for (const Segment& seg : segs) {
      for (int r = 0; r < seg.rows; ++r) {
        const size_t src = size_t(seg.row0 + r) * nkv * hd;
        std::memcpy(seg.kv_write->MutableKeyRow(l, seg.pos0 + r), &k[src],
                    sizeof(float) * nkv * hd);
        std::memcpy(seg.kv_write->MutableValueRow(l, seg.pos0 + r), &v[src],
                    sizeof(float) * nkv * hd);
      }
    }
  }
  std::vector<float> attn(size_t(R) * nh * hd);
  Attention(l, kind, segs, q.data(), k.data(), v.data(), attn.data());
  std::vector<float> o(size_t(R) * D);
  Observe(LinearSite::kOProj, l, -1, encoder, attn.data(), R, nh * hd);
  Linear(attn.data(), R, lw.o_proj, o.data(), false, GemmThreads::kOpenMp, in_);
  // 3. h1 = h + post_attention_layernorm(o).
  RmsNorm(o.data(), lw.post_attention_layernorm.data(), R, D, eps, o.data());
  for (size_t i = 0; i < size_t(R) * D; ++i) h[i] += o[i];
  const float* h1 = h;

  // 4. Dense branch.
  RmsNorm(h1, lw.pre_feedforward_layernorm.data(), R, D, eps, a.data());
  std::vector<float> dense(size_t(R) * D);
  GatedMlp(a.data(), R, lw.mlp_gate_proj, lw.mlp_up_proj, lw.mlp_down_proj, dense.data(),
           LinearSite::kMlpGateUp, l, encoder);
  RmsNorm(dense.data(), lw.post_feedforward_layernorm_1.data(), R, D, eps, dense.data());
  // 5. MoE branch.
  std::vector<float> moe(size_t(R) * D);
  Moe(l, encoder, segs, h1, R, moe.data());
  RmsNorm(moe.data(), lw.post_feedforward_layernorm_2.data(), R, D, eps, moe.data());
  // 6. h2 = h1 + post_feedforward_layernorm(d + m); 7. whole stream × layer_scalar.
  for (size_t i = 0; i < size_t(R) * D; ++i) dense[i] += moe[i];
  RmsNorm(dense.data(), lw.post_feedforward_layernorm.data(), R, D, eps, dense.data());
  const float scalar =
      kind == PassKind::kEncoder ? lw.encoder_layer_scalar : lw.decoder_layer_scalar;
  for (size_t i = 0; i < size_t(R) * D; ++i) h[i] = (h[i] + dense[i]) * scalar;
}

void CpuBackend::Moe(int l, bool encoder, std::span<const Segment> segs, const float* h1, int R,
                     float* m) const {
  const LayerWeights& lw = w_.layers[l];
  const int D = c_.hidden_size, E = c_.num_experts, K = c_.top_k_experts;
  const int F = c_.moe_intermediate_size;
  const float eps = c_.rms_norm_eps;
  // Router on the un-normalised h1 (spec §3.2 step 5): rms_noscale(h1) ⊙ scale · D^−½.
  std::vector<float> r(size_t(R) * D);
  RmsNorm(h1, lw.router_scale.data(), R, D, eps, r.data());
  const float root = 1.0f / std::sqrt(float(D));
  for (float& x : r) x *= root;
  std::vector<float> scores(size_t(R) * E);
  Observe(LinearSite::kRouter, l, -1, encoder, r.data(), R, D);
  Linear(r.data(), R, lw.router_proj, scores.data(), false, GemmThreads::kOpenMp, in_);
  // Rows routed to each expert (row, weight). An expert's GEMM computes each of its rows as that
  // row alone would be, so groups need no padding and the batch does not change any row.
  std::vector<std::vector<std::pair<int, float>>> by_expert(E);
  std::vector<std::pair<int, float>> chosen(K);
  for (const Segment& s : segs) {
    for (int row = s.row0; row < s.row0 + s.rows; ++row) {
      RouteTopK(scores.data() + size_t(row) * E, E, K, lw.router_per_expert_scale.data(),
                chosen.data());
      for (const auto& [e, weight] : chosen) by_expert[e].push_back({row, weight});
    }
  }
  // Experts on pre_feedforward_layernorm_2(h1), grouped by expert; each row accumulates its
  // experts' outputs in ascending expert id (a fixed order per row).
  std::vector<float> xe(size_t(R) * D);
  RmsNorm(h1, lw.pre_feedforward_layernorm_2.data(), R, D, eps, xe.data());
  std::fill(m, m + size_t(R) * D, 0.0f);
  std::vector<float> xin, gu, act, y;
  for (int e = 0; e < E; ++e) {
    const auto& rows = by_expert[e];
    const int n = rows.size();
    if (n == 0) continue;
    xin.resize(size_t(n) * D);
    for (int i = 0; i < n; ++i) {
      std::memcpy(&xin[size_t(i) * D], &xe[size_t(rows[i].first) * D], sizeof(float) * D);
    }
    gu.resize(size_t(n) * 2 * F);
    Observe(LinearSite::kExpertGateUp, l, e, encoder, xin.data(), n, D);
    Linear(xin.data(), n, lw.experts_gate_up_proj[e], gu.data(), false, GemmThreads::kOpenMp, in_);
    act.resize(size_t(n) * F);
    for (int i = 0; i < n; ++i) {
      cpu::GeluGate(&gu[size_t(i) * 2 * F], &gu[size_t(i) * 2 * F + F], F, &act[size_t(i) * F]);
    }
    y.resize(size_t(n) * D);
    Observe(LinearSite::kExpertDown, l, e, encoder, act.data(), n, F);
    Linear(act.data(), n, lw.experts_down_proj[e], y.data(), false, GemmThreads::kOpenMp, in_);
    for (int i = 0; i < n; ++i) {
      float* dst = m + size_t(rows[i].first) * D;
      const float wgt = rows[i].second;
      for (int d = 0; d < D; ++d) dst[d] += wgt * y[size_t(i) * D + d];
    }
  }
}

void CpuBackend::Attention(int l, PassKind kind, std::span<const Segment> segs, const float* q,
                           const float* k_new, const float* v_new, float* out) const {
  const int hd = c_.HeadDim(l), nh = c_.num_heads, nkv = c_.KvHeads(l), kvw = nkv * hd;
  const bool full = c_.IsFull(l);
  const int W = c_.sliding_window;
  for (const Segment& s : segs) {
    // The keys this segment may see, in position order from first_pos: the encoder's are cache
    // rows [first_pos, pos0 + rows) (its new rows are already there), causal (+ window); the
    // decoder's the context prefix (fixed window for sliding layers) then the canvas itself, all
    // seen by every row.
    const int first_pos = full ? 0 : std::max(0, s.pos0 - (W - 1));
    cpu::AttentionShape shape;
    shape.heads = nh;
    shape.kv_heads = nkv;
    shape.head_dim = hd;
    shape.rows = s.rows;
    shape.keys = s.pos0 + s.rows - first_pos;
    if (kind == PassKind::kEncoder) {
      shape.causal = s.pos0 - first_pos;
      shape.window = full ? 0 : W;
      shape.tile_offset = first_pos % 32;  // the tensor-core prefill's tiles: positions 32t …
    }
    auto key_rows = [&](int j, const float** kr, const float** vr) {
      const int p = first_pos + j;
      if (kind == PassKind::kDecoder && p >= s.pos0) {
        *kr = k_new + size_t(s.row0 + p - s.pos0) * kvw;
        *vr = v_new + size_t(s.row0 + p - s.pos0) * kvw;
      } else {
        *kr = s.kv->KeyRow(l, p);
        *vr = s.kv->ValueRow(l, p);
      }
    };
    cpu::SequenceAttention(shape, q + size_t(s.row0) * nh * hd, key_rows, in_,
                           out + size_t(s.row0) * nh * hd);
  }
}

absl::Status CpuBackend::Encode(std::span<const EncodeInput> batch) {
  const int D = c_.hidden_size;
  std::vector<Segment> segs;
  int R = 0;
  for (const EncodeInput& in : batch) {
    if (in.kv == nullptr) return absl::InvalidArgumentError("encoder input without a KV cache");
    DGSERVE_RETURN_IF_ERROR(CheckHostRowsCurrent(*in.kv, "CPU encoder pass"));
    DGSERVE_RETURN_IF_ERROR(CheckTokens(in.tokens));
  }
  // Reserve every cache first (a failed Reserve leaves its cache unchanged).
  for (size_t i = 0; i < batch.size(); ++i) {
    DGSERVE_RETURN_IF_ERROR(batch[i].kv->Reserve(batch[i].tokens.size()));
    Segment s;
    s.row0 = R;
    s.rows = batch[i].tokens.size();
    s.pos0 = batch[i].kv->num_tokens();
    s.kv = batch[i].kv;
    s.kv_write = batch[i].kv;
    segs.push_back(s);
    R += s.rows;
  }
  if (R == 0) return absl::OkStatus();
  std::vector<float> h(size_t(R) * D);
  for (size_t i = 0; i < batch.size(); ++i)
    Embed(batch[i].tokens, h.data() + size_t(segs[i].row0) * D);
  for (int l = 0; l < c_.num_layers; ++l) Layer(l, PassKind::kEncoder, segs, R, h.data());
  for (size_t i = 0; i < batch.size(); ++i) batch[i].kv->Commit(segs[i].rows);
  return absl::OkStatus();
}

absl::Status CpuBackend::Body(std::span<const CanvasInput> batch, std::vector<Segment>* segs,
                              std::vector<float>* hidden) {
  const int D = c_.hidden_size;
  const float eps = c_.rms_norm_eps;
  int R = 0;
  segs->clear();
  for (const CanvasInput& in : batch) {
    if (in.kv == nullptr) return absl::InvalidArgumentError("decoder input without a KV cache");
    DGSERVE_RETURN_IF_ERROR(CheckHostRowsCurrent(*in.kv, "CPU decoder pass"));
    DGSERVE_RETURN_IF_ERROR(CheckTokens(in.canvas));
    Segment s;
    s.row0 = R;
    s.rows = in.canvas.size();
    s.pos0 = in.kv->num_tokens();
    s.kv = in.kv;
    segs->push_back(s);
    R += s.rows;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<float>& h = *hidden;
  h.assign(size_t(R) * D, 0.0f);
  if (R == 0) return absl::OkStatus();
  // Canvas input (spec §3.5 steps 1–3): x0 = rms_noscale(E[c]·s + SC(soft)).
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = (*segs)[i];
    float* hs = h.data() + size_t(s.row0) * D;
    Embed(batch[i].canvas, hs);
    if (batch[i].sc_soft != nullptr) {
      std::vector<float> u(size_t(s.rows) * D), sig(size_t(s.rows) * D);
      RmsNorm(batch[i].sc_soft, w_.sc_pre_norm.data(), s.rows, D, eps, u.data());
      GatedMlp(u.data(), s.rows, w_.sc_gate_proj, w_.sc_up_proj, w_.sc_down_proj, sig.data(),
               LinearSite::kScGateUp, -1, false);
      for (size_t j = 0; j < sig.size(); ++j) hs[j] += sig[j];
    }
  }
  RmsNorm(h.data(), nullptr, R, D, eps, h.data());
  for (int l = 0; l < c_.num_layers; ++l) Layer(l, PassKind::kDecoder, *segs, R, h.data());
  RmsNorm(h.data(), w_.final_norm.data(), R, D, eps, h.data());
  timings_.body_seconds = SecondsSince(t0);
  return absl::OkStatus();
}

absl::Status CpuBackend::Decode(std::span<const DecodeInput> batch) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  std::vector<CanvasInput> canvases;
  for (const DecodeInput& in : batch) {
    if (in.logits == nullptr) return absl::InvalidArgumentError("decoder input without logits");
    canvases.push_back({in.canvas, in.sc_soft, in.kv});
  }
  std::vector<Segment> segs;
  std::vector<float> h;
  DGSERVE_RETURN_IF_ERROR(Body(canvases, &segs, &h));
  const auto t1 = std::chrono::steady_clock::now();
  // LM head (tied embedding) and softcap, per canvas into its own logits buffer.
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = segs[i];
    Linear(h.data() + size_t(s.row0) * D, s.rows, w_.lm_head, batch[i].logits, false,
           GemmThreads::kOpenMp, in_);
    cpu::Softcap(batch[i].logits, int64_t(s.rows) * V, c_.final_logit_softcapping);
  }
  timings_.lm_head_seconds = SecondsSince(t1);
  return absl::OkStatus();
}

absl::Status CpuBackend::DenoiseStep(std::span<const DenoiseStepInput> batch) {
  const int D = c_.hidden_size;
  std::vector<CanvasInput> canvases;
  for (const DenoiseStepInput& in : batch) {
    if (in.rows == nullptr || in.uniforms.size() < in.canvas.size()) {
      return absl::InvalidArgumentError("denoise step without row outputs or uniforms");
    }
    if (!(in.temperature > 0) || !std::isfinite(in.temperature)) {
      return absl::InvalidArgumentError("temperature: must be finite and > 0");
    }
    canvases.push_back({in.canvas, in.sc_soft, in.kv});
  }
  std::vector<Segment> segs;
  std::vector<float> h;
  DGSERVE_RETURN_IF_ERROR(Body(canvases, &segs, &h));
  const auto t1 = std::chrono::steady_clock::now();
  cpu::VocabStepStats stats;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = segs[i];
    std::vector<float> temperature(s.rows, batch[i].temperature);
    cpu::VocabStepArgs args;
    args.hidden = h.data() + size_t(s.row0) * D;
    args.rows = s.rows;
    args.lm_head = &w_.lm_head;
    args.embed = w_.embed_tokens.data();
    args.vocab = c_.vocab_size;
    args.dim = D;
    args.softcap = c_.final_logit_softcapping;
    args.temperature = temperature.data();
    args.uniforms = batch[i].uniforms.data();
    args.embed_scale = c_.EmbedScale();
    args.out = batch[i].rows;
    args.soft = batch[i].next_soft;
    args.sc_skip_mass = batch[i].sparse_sc ? sc_skip_mass_ : 0.0;
    if (!embed_tile_norm_max_.empty()) args.embed_tile_norm_max = embed_tile_norm_max_.data();
    args.stats = &stats;
    args.scratch = &vocab_scratch_;
    args.gemm_input = in_;
    if (!batch[i].row_masks.empty()) {
      if (int(batch[i].row_masks.size()) != s.rows) {
        return absl::InvalidArgumentError("row_masks: must have one entry per canvas position");
      }
      args.masks = batch[i].row_masks.data();
    }
    DGSERVE_RETURN_IF_ERROR(cpu::FusedVocabStep(args));
  }
  timings_.lm_head_seconds = SecondsSince(t1);
  timings_.sc_tile_rows = stats.tile_rows;
  timings_.sc_tile_rows_skipped = stats.tile_rows_skipped;
  timings_.sc_rows_kept_dense = stats.rows_kept_dense;
  return absl::OkStatus();
}

absl::Status CpuBackend::SoftEmbedding(const float* probs, int rows, float* soft) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  if (rows <= 0) return absl::OkStatus();
  GemmArgs g = GemmArgs::Of(rows, D, V, probs, V, GemmB::RowMajor(w_.embed_tokens.data(), D), soft,
                            D);  // soft[rows, D] = probs[rows, V] · E[V, D]
  g.input = in_;                 // bf16: bf16(q) · E, spec §3.5 step 2
  Gemm(g);
  const float scale = c_.EmbedScale();
  for (int64_t i = 0; i < int64_t(rows) * D; ++i) soft[i] *= scale;
  return absl::OkStatus();
}

}  // namespace

std::unique_ptr<ModelBackend> CreateCpuBackend(const ModelConfig& config,
                                               const ModelWeights& weights,
                                               const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(config, weights, options);
}

}  // namespace dgserve
