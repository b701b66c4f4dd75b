// The CUDA backend's encoder and decoder passes (spec §3.2–§3.5): the projections, attention,
// the MoE branch, one layer, the decoder body and the encoder pass. The class and its state are in
// cuda_backend_internal.h; weights, KV mirrors and the vocabulary step in cuda_backend.cc.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "engine/cuda/cuda_backend_internal.h"

namespace dgserve::cuda_internal {

absl::Status CudaBackend::Linear(const float* x, const DeviceProjection& w, int R, int in, int out,
                                 float* y) {
  switch (w.format) {
    case WeightFormat::kNvfp4:  // issue 37: NVFP4 in 4 bits
      return cuda::DenseLinearNvfp4(x, w.nvfp4.View(), R, in, out, y, stream_);
    case WeightFormat::kFp8:  // issue 37: FP8 in 8 bits
      return cuda::DenseLinearFp8(x, w.fp8.view(), R, in, out, y, stream_);
    case WeightFormat::kW4A16: {  // issue 37: W4A16 in 4 bits
      // Float32 activations in both GEMM modes, as the CPU's W4A16 GEMM takes them (the products
      // are then the CPU's; rounding x to bf16 here would be another model in bf16 mode).
      const cuda::DeviceW4A16& w4 = w.w4a16;
      return cuda::DenseLinearW4A16(x,
                                    cuda::W4A16Weights{w4.packed.get(), w4.scales.get(), w4.group},
                                    R, in, out, y, stream_);
    }
    case WeightFormat::kBf16: break;
  }
  if (options_.batch_invariant_projections) {
    return cuda::DenseLinear(x, w.bf16.get(), R, in, out, cublas_.input(), y, stream_);
  }
  return cublas_.Linear(x, w.bf16.get(), R, in, out, y, stream_);
}

absl::Status CudaBackend::GatedMlp(const float* x, int R, const DeviceProjection& gate,
                                   const DeviceProjection& up, const DeviceProjection& down,
                                   int width, float* out) {
  const int D = c_.hidden_size;
  DGSERVE_RETURN_IF_ERROR(g_.Ensure(size_t(R) * width));
  DGSERVE_RETURN_IF_ERROR(u_.Ensure(size_t(R) * width));
  DGSERVE_RETURN_IF_ERROR(Linear(x, gate, R, D, width, g_.get()));
  DGSERVE_RETURN_IF_ERROR(Linear(x, up, R, D, width, u_.get()));
  DGSERVE_RETURN_IF_ERROR(
      cuda::GeluGate(g_.get(), u_.get(), int64_t(R) * width, g_.get(), stream_));
  return Linear(g_.get(), down, R, width, D, out);
}

bool CudaBackend::TensorCoreCanvas(int l) const { return TensorCoreLayer(c_, options_, l); }

cuda::CanvasSegment CudaBackend::TableEntry(const Segment& s, int l) const {
  cuda::CanvasSegment t;
  // The mirror's rows from position 0 (or its ring, or the pool through its block table: token j
  // is position j); a bf16 layer's arrays as the CanvasSegmentBf16 its launch reads (the same
  // layout: the header's TableEntry).
  if (s.mirror->paged()) {
    t.ctx_k = PoolK(l);
    t.ctx_v = PoolV(l);
    t.block_table = s.mirror->tables[KvKind(l)].get();
    t.block_size = options_.kv_block_size;
    t.first_slot = 0;
  } else if (Bf16Mirror(l)) {
    t.ctx_k = reinterpret_cast<const float*>(s.mirror->k16[l].get());
    t.ctx_v = reinterpret_cast<const float*>(s.mirror->v16[l].get());
  } else {
    t.ctx_k = s.mirror->k[l].get();
    t.ctx_v = s.mirror->v[l].get();
  }
  t.ring = s.mirror->ring[l];
  t.row0 = s.row0;
  t.rows = s.rows;
  t.ctx_tokens = s.pos0;
  // The window start (for the prefill: row 0's).
  t.ctx_first = cuda::CanvasWindowStart(s.pos0, c_.IsFull(l) ? 0 : c_.sliding_window);
  return t;
}

absl::Status CudaBackend::UploadCanvasTable(std::span<const Segment> segs) {
  // Every layer reads its canvases' contexts from this table (TensorCoreCanvasAttention or
  // CanvasAttentionTable), so no launch of the decoder pass takes a context from the host.
  canvas_segments_ = 0;
  canvas_max_rows_ = 0;
  canvas_max_splits_.assign(c_.num_layers, 1);
  int total_rows = 0;
  for (const Segment& s : segs) {
    canvas_segments_ += s.rows > 0;
    canvas_max_rows_ = std::max(canvas_max_rows_, s.rows);
    total_rows = std::max(total_rows, s.row0 + s.rows);
  }
  if (canvas_segments_ == 0) return absl::OkStatus();
  const size_t n = size_t(c_.num_layers) * canvas_segments_;
  DGSERVE_RETURN_IF_ERROR(canvas_table_host_.Ensure(n));
  size_t i = 0, scratch_bytes = 0;
  for (int l = 0; l < c_.num_layers; ++l) {
    for (const Segment& s : segs) {
      if (s.rows == 0) continue;
      const cuda::CanvasSegment t = TableEntry(s, l);
      if (TensorCoreCanvas(l)) {
        // Split-KV (long contexts): splits of canvas_split_keys keys from context token 0.
        canvas_max_splits_[l] =
            std::max(canvas_max_splits_[l],
                     cuda::CanvasSplitCount(s.pos0, t.ctx_first, options_.canvas_split_keys));
      }
      canvas_table_host_[i++] = t;
    }
    scratch_bytes = std::max(
        scratch_bytes, cuda::TensorCoreCanvasScratchBytes(total_rows, c_.num_heads, c_.HeadDim(l),
                                                          canvas_max_splits_[l]));
  }
  // Sized here (the pass's host preparation), never inside the launches a graph captures.
  DGSERVE_RETURN_IF_ERROR(canvas_split_scratch_.Ensure(scratch_bytes / sizeof(float)));
  return canvas_table_.UploadAsync(canvas_table_host_.data(), n, stream_);
}

// The encoder pass's counterpart of UploadCanvasTable (TensorCorePrefillAttention): per layer
// taking the tensor cores (TensorCoreCanvas: the same head-dim rule), one entry per prompt.
absl::Status CudaBackend::UploadPrefillTable(std::span<const Segment> segs) {
  prefill_table_host_.clear();
  prefill_segments_ = 0;
  if (!options_.tensor_core_attention) return absl::OkStatus();
  for (const Segment& s : segs) prefill_segments_ += s.rows > 0;
  bool any = false;
  for (int l = 0; l < c_.num_layers; ++l) {
    if (!TensorCoreCanvas(l)) {
      prefill_table_host_.resize(prefill_table_host_.size() + prefill_segments_);
      continue;
    }
    any = true;
    for (const Segment& s : segs) {
      if (s.rows > 0) prefill_table_host_.push_back(TableEntry(s, l));
    }
  }
  if (!any || prefill_segments_ == 0) return absl::OkStatus();
  // Stream-ordered (from pageable memory CUDA stages the table before returning).
  return prefill_table_.UploadAsync(prefill_table_host_.data(), prefill_table_host_.size(),
                                    stream_);
}

absl::Status CudaBackend::Layer(int l, PassKind kind, std::span<const Segment> segs, int R) {
  const DeviceLayer& lw = layers_[l];
  const int D = c_.hidden_size, hd = c_.HeadDim(l), nh = c_.num_heads, nkv = c_.KvHeads(l);
  const int kvw = nkv * hd;
  const float eps = c_.rms_norm_eps;
  const bool full = c_.IsFull(l);
  float* h = h_.get();
  float *a = a_.get(), *q = q_.get(), *k = k_.get(), *v = v_.get();

  // 1–2. Attention block on a = input_layernorm(h) (spec §3.2 steps 1–2, §3.3).
  phases_.Enter(Phase::kDense);
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, lw.input_layernorm.get(), R, D, eps, a, stream_));
  DGSERVE_RETURN_IF_ERROR(Linear(a, lw.q_proj, R, D, nh * hd, q));
  DGSERVE_RETURN_IF_ERROR(Linear(a, lw.k_proj, R, D, kvw, k));
  if (full) {
    // V = rms_noscale(raw k projection) on full layers (spec §3.3).
    cuda::NoteDeviceCopy();
    DGSERVE_RETURN_IF_ERROR(CudaCheck(
        cudaMemcpyAsync(v, k, size_t(R) * kvw * sizeof(float), cudaMemcpyDeviceToDevice, stream_),
        "copy k→v"));
  } else {
    DGSERVE_RETURN_IF_ERROR(Linear(a, lw.v_proj, R, D, kvw, v));
  }
  phases_.Enter(Phase::kAttention);
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(q, lw.q_norm.get(), R * nh, hd, eps, q, stream_));
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(k, lw.k_norm.get(), R * nkv, hd, eps, k, stream_));
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(v, nullptr, R * nkv, hd, eps, v, stream_));
  const float* inv_freq = full ? rope_full_.get() : rope_sliding_.get();
  DGSERVE_RETURN_IF_ERROR(cuda::ApplyRope(q, R, nh, hd, positions_.get(), inv_freq, stream_));
  DGSERVE_RETURN_IF_ERROR(cuda::ApplyRope(k, R, nkv, hd, positions_.get(), inv_freq, stream_));

  if (kind == PassKind::kEncoder) {
    // New K/V rows: to the (authoritative) host cache through pinned staging, copied
    // asynchronously and written to the caches at the next flush (when the staging is full, and
    // at the end of the pass): no wait per layer. Into the device mirror: after the attention.
    // Only the rows each cache keeps (Segment::HostRows): all on full layers, the last W − 1
    // (or a few blocks more) of a long prompt on sliding layers. One copy per run of
    // consecutive rows: one for the pass when every row is kept.
    std::vector<std::pair<int, int>>& runs = host_runs_;
    runs.clear();
    int kept = 0;
    for (const Segment& s : segs) {
      const auto [first, count] = s.HostRows(full);
      if (count == 0) continue;
      const int row = s.row0 + first;
      if (!runs.empty() && runs.back().first + runs.back().second == row) {
        runs.back().second += count;
      } else {
        runs.emplace_back(row, count);
      }
      kept += count;
    }
    const size_t n = size_t(kept) * kvw, need = 2 * n;
    if (kv_stage_used_ + need > kv_stage_.size()) DGSERVE_RETURN_IF_ERROR(FlushStagedKv(segs));
    float* stage = kv_stage_.data() + kv_stage_used_;
    for (const auto& [dst, src] : {std::pair{stage, k}, std::pair{stage + n, v}}) {
      size_t at = 0;
      for (const auto& [row, count] : runs) {
        const size_t floats = size_t(count) * kvw;
        cuda::NoteDeviceCopy();
        DGSERVE_RETURN_IF_ERROR(
            CudaCheck(cudaMemcpyAsync(dst + at, src + size_t(row) * kvw, floats * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync (K/V to the staging)"));
        at += floats;
      }
    }
    kv_staged_.push_back({l, kv_stage_used_, kept});
    kv_stage_used_ += need;
    kv_copy_stats_.encode_to_host_bytes += int64_t(need * sizeof(float));
  }
  // Decoder on tensor cores: every canvas in one launch (the table of UploadCanvasTable).
  const bool tc = TensorCoreCanvas(l);
  // A bf16 mirror's layer reads its table entries as CanvasSegmentBf16 (TableEntry).
  const bool bf16 = Bf16Mirror(l);
  if (tc && kind == PassKind::kDecoder && canvas_segments_ > 0) {
    const cuda::CanvasSegment* table = canvas_table_.get() + size_t(l) * canvas_segments_;
    DGSERVE_RETURN_IF_ERROR(
        bf16 ? cuda::TensorCoreCanvasAttention(
                   q, k, v, reinterpret_cast<const cuda::CanvasSegmentBf16*>(table),
                   canvas_segments_, R, nh, nkv, hd, canvas_max_splits_[l],
                   options_.canvas_split_keys, canvas_split_scratch_.get(), attn_.get(), stream_)
             : cuda::TensorCoreCanvasAttention(q, k, v, table, canvas_segments_, R, nh, nkv, hd,
                                               canvas_max_splits_[l], options_.canvas_split_keys,
                                               canvas_split_scratch_.get(), attn_.get(), stream_));
  }
  // Encoder on tensor cores: every prompt in one causal launch (the table of UploadPrefillTable).
  if (tc && kind == PassKind::kEncoder && prefill_segments_ > 0) {
    const cuda::PrefillSegment* table = prefill_table_.get() + size_t(l) * prefill_segments_;
    const int window = full ? 0 : c_.sliding_window;
    DGSERVE_RETURN_IF_ERROR(
        bf16 ? cuda::TensorCorePrefillAttention(
                   q, k, v, reinterpret_cast<const cuda::PrefillSegmentBf16*>(table),
                   prefill_segments_, R, nh, nkv, hd, window, attn_.get(), stream_)
             : cuda::TensorCorePrefillAttention(q, k, v, table, prefill_segments_, R, nh, nkv, hd,
                                                window, attn_.get(), stream_));
  }
  // Decoder in float32: every canvas in one launch too, CanvasAttention's bits per canvas. In the
  // bf16 GEMM-input mode the float32 kernels round q, K, V and P as the tensor-core ones do (the
  // reference's rounding, spec §5.3; the CPU backend's bf16 mode); float32 mode: no rounding.
  const int W = c_.sliding_window;
  const bool round_attention = options_.gemm_input == cuda::GemmInput::kBf16;
  if (!tc && kind == PassKind::kDecoder && canvas_segments_ > 0) {
    DGSERVE_RETURN_IF_ERROR(cuda::CanvasAttentionTable(
        q, k, v, canvas_table_.get() + size_t(l) * canvas_segments_, canvas_segments_,
        canvas_max_rows_, nh, nkv, hd, full ? 0 : W, attn_.get(), stream_, round_attention));
  }
  // Encoder in float32: attention per prompt, context = the mirror's visible rows before pos0
  // (spec §3.4).
  for (const Segment& s : segs) {
    if (tc || kind == PassKind::kDecoder) break;
    if (s.rows == 0) continue;
    const int first = full ? 0 : std::max(0, s.pos0 - (W - 1));
    cuda::KvContext ctx;
    ctx.tokens = s.pos0 - first;
    ctx.position0 = first;
    const int ring = s.mirror->ring[l];
    if (ctx.tokens > 0 && s.mirror->paged()) {
      // The pool through the block table (context token j at position first + j).
      ctx.k = PoolK(l);
      ctx.v = PoolV(l);
      ctx.block_table = s.mirror->tables[KvKind(l)].get();
      ctx.block_size = options_.kv_block_size;
      ctx.first_slot = first;
    } else if (ctx.tokens > 0) {
      // A sliding layer's ring from row 0 (position p in row p % ring), else from `first`.
      const size_t row0 = ring > 0 ? 0 : size_t(first);
      ctx.k = s.mirror->k[l].get() + row0 * kvw;
      ctx.v = s.mirror->v[l].get() + row0 * kvw;
      ctx.first_slot = ring > 0 ? first : 0;
      ctx.ring = ring;
    }
    const size_t qo = size_t(s.row0) * nh * hd, ko = size_t(s.row0) * kvw;
    DGSERVE_RETURN_IF_ERROR(cuda::PrefillAttention(q + qo, k + ko, v + ko, s.rows, ctx, nh, nkv, hd,
                                                   full ? 0 : W, attn_.get() + qo, stream_,
                                                   round_attention));
  }
  // The encoder's new K/V rows into the device mirror, after the attention that read its context:
  // a sliding layer's ring may reuse the rows of positions the window has left (a chunk longer
  // than the ring keeps only its last `ring` rows; its attention read its own rows from k / v).
  // A bf16 layer's rows are rounded on the way (cuda::FloatToBf16: ToBf16Bits, the tensor-core
  // kernels' rounding); the host cache got the float32 rows above.
  for (const Segment& s : segs) {
    if (kind != PassKind::kEncoder || s.rows == 0) continue;
    if (s.mirror->paged()) {
      // Into the pool's blocks (SyncKvBlocks held them): every row on full layers, on sliding
      // ones those from sliding_device_from.
      const int from = full ? s.pos0 : std::max(s.pos0, s.sliding_device_from);
      const int count = s.pos0 + s.rows - from;
      if (count <= 0) continue;
      const size_t src = size_t(s.row0 + from - s.pos0) * kvw;
      const int32_t* table = s.mirror->tables[KvKind(l)].get();
      const int B = options_.kv_block_size;
      DGSERVE_RETURN_IF_ERROR(s.mirror->CheckHeld(KvKind(l), B, from, count, "KV append"));
      for (const auto& [dst, x] : {std::pair{PoolK(l), k}, std::pair{PoolV(l), v}}) {
        // A bf16 layer's rows rounded on the way (ToBf16Bits, as cuda::FloatToBf16).
        DGSERVE_RETURN_IF_ERROR(
            Bf16Mirror(l)
                ? cuda::CopyRowsToBlocks(x + src, count, kvw, table, B, from,
                                         reinterpret_cast<uint16_t*>(dst), stream_)
                : cuda::CopyRowsToBlocks(x + src, count, kvw, table, B, from, dst, stream_));
      }
      continue;
    }
    const int ring = s.mirror->ring[l];
    const int keep = ring > 0 ? std::min(s.rows, ring) : s.rows;
    const int skip = s.rows - keep;
    DGSERVE_RETURN_IF_ERROR(
        s.mirror->ForEachRun(l, s.pos0 + skip, keep, [&](int p0, int row, int count) {
          const size_t src_row = size_t(s.row0 + p0 - s.pos0),
                       bytes = size_t(count) * kvw * sizeof(float);
          if (Bf16Mirror(l)) {
            for (const auto& [dst, src] :
                 {std::pair{s.mirror->k16[l].get(), k}, std::pair{s.mirror->v16[l].get(), v}}) {
              DGSERVE_RETURN_IF_ERROR(cuda::FloatToBf16(src + src_row * kvw, int64_t(count) * kvw,
                                                        dst + size_t(row) * kvw, stream_));
            }
            return absl::OkStatus();
          }
          for (const auto& [dst, src] :
               {std::pair{s.mirror->k[l].get(), k}, std::pair{s.mirror->v[l].get(), v}}) {
            cuda::NoteDeviceCopy();
            DGSERVE_RETURN_IF_ERROR(
                CudaCheck(cudaMemcpyAsync(dst + size_t(row) * kvw, src + src_row * kvw, bytes,
                                          cudaMemcpyDeviceToDevice, stream_),
                          "cudaMemcpyAsync (KV append)"));
          }
          return absl::OkStatus();
        }));
  }
  phases_.Enter(Phase::kDense);
  float* o = o_.get();
  DGSERVE_RETURN_IF_ERROR(Linear(attn_.get(), lw.o_proj, R, nh * hd, D, o));
  // 3. h1 = h + post_attention_layernorm(o).
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(o, lw.post_attention_layernorm.get(), R, D, eps, o, stream_));
  DGSERVE_RETURN_IF_ERROR(cuda::AddInPlace(h, o, int64_t(R) * D, stream_));
  const float* h1 = h;
  // 4. Dense branch.
  float* dense = dense_.get();
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(h1, lw.pre_feedforward_layernorm.get(), R, D, eps, a, stream_));
  DGSERVE_RETURN_IF_ERROR(GatedMlp(a, R, lw.mlp_gate_proj, lw.mlp_up_proj, lw.mlp_down_proj,
                                   c_.intermediate_size, dense));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(dense, lw.post_feedforward_layernorm_1.get(), R, D, eps, dense, stream_));
  // 5. MoE branch.
  phases_.Enter(Phase::kMoe);
  float* moe = moe_.get();
  DGSERVE_RETURN_IF_ERROR(Moe(l, h1, R, moe));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(moe, lw.post_feedforward_layernorm_2.get(), R, D, eps, moe, stream_));
  // 6. h2 = h1 + post_feedforward_layernorm(d + m); 7. whole stream × layer_scalar.
  phases_.Enter(Phase::kDense);
  DGSERVE_RETURN_IF_ERROR(cuda::AddInPlace(dense, moe, int64_t(R) * D, stream_));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(dense, lw.post_feedforward_layernorm.get(), R, D, eps, dense, stream_));
  const float scalar =
      kind == PassKind::kEncoder ? lw.encoder_layer_scalar : lw.decoder_layer_scalar;
  return cuda::AddScale(h, dense, scalar, int64_t(R) * D, stream_);
}

absl::Status CudaBackend::Moe(int l, const float* h1, int R, float* m) {
  const DeviceLayer& lw = layers_[l];
  const int D = c_.hidden_size, E = c_.num_experts, K = c_.top_k_experts;
  const int F = c_.moe_intermediate_size;
  const float eps = c_.rms_norm_eps;
  // Router on the un-normalised h1 (spec §3.2 step 5): rms_noscale(h1) ⊙ scale · D^−½, then a
  // float32 GEMM against the bf16-valued router weights. In the bf16 mode its input is rounded
  // to bf16 first (rounding point 4 of cpu_backend.cc), so its products are the CPU's.
  DGSERVE_RETURN_IF_ERROR(r_.Ensure(size_t(R) * D));
  DGSERVE_RETURN_IF_ERROR(scores_.Ensure(size_t(R) * E));
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h1, lw.router_scale.get(), R, D, eps, r_.get(), stream_));
  const float router_scale = 1.0f / std::sqrt(float(D));
  DGSERVE_RETURN_IF_ERROR(
      cublas_.input() == cuda::GemmInput::kBf16
          ? cuda::ScaleAndRoundToBf16(r_.get(), int64_t(R) * D, router_scale, stream_)
          : cuda::Scale(r_.get(), int64_t(R) * D, router_scale, stream_));
  if (options_.batch_invariant_projections) {
    // The weights are bf16 values and the bf16 mode's input too: exact products, float32 sums in
    // DenseLinear's fixed order (the float32 mode's input split exactly into three terms).
    DGSERVE_RETURN_IF_ERROR(cuda::DenseLinear(r_.get(), lw.router_proj_bf16.get(), R, D, E,
                                              cublas_.input(), scores_.get(), stream_));
  } else {
    const float one = 1.0f, zero = 0.0f;
    cuda::NoteCublas();
    DGSERVE_RETURN_IF_ERROR(
        CublasCheck(cublasSgemm(handle_, CUBLAS_OP_T, CUBLAS_OP_N, E, R, D, &one,
                                lw.router_proj.get(), D, r_.get(), D, &zero, scores_.get(), E),
                    "cublasSgemm (router)"));
  }
  // Routing and grouping on the device (cuda_moe.h): the experts of each row (RouteTopK's
  // choice and weights, bit for bit), then rows grouped by expert in ascending row order. Every
  // row picks K distinct experts, so N = R·K gathered rows: every size is known here and the
  // host never waits for the device.
  const size_t N = size_t(R) * K;
  DGSERVE_RETURN_IF_ERROR(expert_.Ensure(N));
  DGSERVE_RETURN_IF_ERROR(weight_.Ensure(N));
  DGSERVE_RETURN_IF_ERROR(offsets_.Ensure(size_t(E) + 1));
  DGSERVE_RETURN_IF_ERROR(gather_.Ensure(N));
  DGSERVE_RETURN_IF_ERROR(slot_.Ensure(N));
  DGSERVE_RETURN_IF_ERROR(slot_weight_.Ensure(N));
  DGSERVE_RETURN_IF_ERROR(xe_.Ensure(size_t(R) * D));
  DGSERVE_RETURN_IF_ERROR(act_.Ensure(N * F));
  DGSERVE_RETURN_IF_ERROR(y_.Ensure(N * D));
  DGSERVE_RETURN_IF_ERROR(cuda::MoeRoute(scores_.get(), R, E, K, lw.per_expert_scale.get(),
                                         expert_.get(), weight_.get(), stream_));
  DGSERVE_RETURN_IF_ERROR(cuda::MoeGroup(expert_.get(), weight_.get(), R, E, K, offsets_.get(),
                                         gather_.get(), slot_.get(), slot_weight_.get(), stream_));
  // Experts on pre_feedforward_layernorm_2(h1): one grouped GEMM per projection (gather in the
  // A load, gelu(g)·u and the routing weight in the epilogues), then the per-row sum in
  // ascending expert order (the CPU's order).
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(h1, lw.pre_feedforward_layernorm_2.get(), R, D, eps, xe_.get(), stream_));
  const cuda::GemmInput input = cublas_.input();
  if (lw.experts_gate_up.format == WeightFormat::kNvfp4) {  // issue 37: NVFP4
    DGSERVE_RETURN_IF_ERROR(cuda::MoeGateUpNvfp4(xe_.get(), gather_.get(), offsets_.get(),
                                                 lw.experts_gate_up.nvfp4.View(), R, K, E, D, F,
                                                 act_.get(), stream_));
  } else if (lw.experts_gate_up.format == WeightFormat::kFp8) {
    // Issue 37: FP8 (the format quantizes the inputs).
    DGSERVE_RETURN_IF_ERROR(cuda::MoeGateUpFp8(xe_.get(), gather_.get(), offsets_.get(),
                                               lw.experts_gate_up.fp8.view(), R, K, E, D, F,
                                               act_.get(), stream_));
  } else if (lw.experts_gate_up.format == WeightFormat::kW4A16) {
    const cuda::DeviceW4A16& w4 = lw.experts_gate_up.w4a16;
    // W4A16: float32 activations in both GEMM modes (the functions take no GemmInput), as
    // cpu::QuantLinear takes them; the bf16 mode's rounding applies to bf16 experts only.
    DGSERVE_RETURN_IF_ERROR(cuda::MoeGateUpW4A16(xe_.get(), gather_.get(), offsets_.get(),
                                                 {w4.packed.get(), w4.scales.get(), w4.group}, R, K,
                                                 E, D, F, act_.get(), stream_));
  } else {
    DGSERVE_RETURN_IF_ERROR(cuda::MoeGateUp(xe_.get(), gather_.get(), offsets_.get(),
                                            lw.experts_gate_up.bf16.get(), R, K, E, D, F, input,
                                            act_.get(), stream_));
  }
  if (lw.experts_down.format == WeightFormat::kNvfp4) {
    DGSERVE_RETURN_IF_ERROR(cuda::MoeDownNvfp4(act_.get(), offsets_.get(), slot_weight_.get(),
                                               lw.experts_down.nvfp4.View(), R, K, E, F, D,
                                               y_.get(), stream_));
  } else if (lw.experts_down.format == WeightFormat::kFp8) {
    DGSERVE_RETURN_IF_ERROR(cuda::MoeDownFp8(act_.get(), offsets_.get(), slot_weight_.get(),
                                             lw.experts_down.fp8.view(), R, K, E, F, D, y_.get(),
                                             stream_));
  } else if (lw.experts_down.format == WeightFormat::kW4A16) {
    const cuda::DeviceW4A16& w4 = lw.experts_down.w4a16;
    DGSERVE_RETURN_IF_ERROR(cuda::MoeDownW4A16(act_.get(), offsets_.get(), slot_weight_.get(),
                                               {w4.packed.get(), w4.scales.get(), w4.group}, R, K,
                                               E, F, D, y_.get(), stream_));
  } else {
    DGSERVE_RETURN_IF_ERROR(cuda::MoeDown(act_.get(), offsets_.get(), slot_weight_.get(),
                                          lw.experts_down.bf16.get(), R, K, E, F, D, input,
                                          y_.get(), stream_));
  }
  return cuda::MoeSum(y_.get(), slot_.get(), R, K, D, m, stream_);
}

// Sizes every per-pass scratch buffer for R stacked rows.
#define DGSERVE_ENSURE_PASS_SCRATCH(R)                          \
  do {                                                          \
    const size_t rr = size_t(std::max(R, 1));                   \
    int qw = 0, kw = 0;                                         \
    for (int l = 0; l < c_.num_layers; ++l) {                   \
      qw = std::max(qw, c_.num_heads * c_.HeadDim(l));          \
      kw = std::max(kw, c_.KvHeads(l) * c_.HeadDim(l));         \
    }                                                           \
    DGSERVE_RETURN_IF_ERROR(h_.Ensure(rr* c_.hidden_size));     \
    DGSERVE_RETURN_IF_ERROR(a_.Ensure(rr* c_.hidden_size));     \
    DGSERVE_RETURN_IF_ERROR(o_.Ensure(rr* c_.hidden_size));     \
    DGSERVE_RETURN_IF_ERROR(dense_.Ensure(rr* c_.hidden_size)); \
    DGSERVE_RETURN_IF_ERROR(moe_.Ensure(rr* c_.hidden_size));   \
    DGSERVE_RETURN_IF_ERROR(q_.Ensure(rr* qw));                 \
    DGSERVE_RETURN_IF_ERROR(attn_.Ensure(rr* qw));              \
    DGSERVE_RETURN_IF_ERROR(k_.Ensure(rr* kw));                 \
    DGSERVE_RETURN_IF_ERROR(v_.Ensure(rr* kw));                 \
  } while (0)

absl::Status CudaBackend::Encode(std::span<const EncodeInput> batch) {
  const auto lock = Lock();
  const int D = c_.hidden_size;
  for (const EncodeInput& in : batch) {
    if (in.kv == nullptr) return absl::InvalidArgumentError("encoder input without a KV cache");
    DGSERVE_RETURN_IF_ERROR(CheckTokens(in.tokens));
  }
  std::vector<Segment> segs;
  int R = 0;
  std::vector<const KvCache*> caches;
  for (const EncodeInput& in : batch) caches.push_back(in.kv);
  BeginPass(caches);
  for (const EncodeInput& in : batch) {
    DGSERVE_RETURN_IF_ERROR(in.kv->Reserve(in.tokens.size()));
    Segment s;
    s.row0 = R;
    s.rows = in.tokens.size();
    s.pos0 = in.kv->num_tokens();
    s.kv = in.kv;
    s.kv_write = in.kv;
    s.sliding_host_from = std::max(s.pos0, in.kv->SlidingRetainedFrom(s.pos0 + s.rows));
    DGSERVE_ASSIGN_OR_RETURN(s.mirror, SyncMirror(*in.kv, s.rows));
    s.to_host = !s.mirror->deferred;
    s.sliding_device_from = SlidingWriteFrom(*in.kv, *s.mirror, s.pos0, s.pos0 + s.rows);
    segs.push_back(s);
    R += s.rows;
  }
  if (R == 0) return absl::OkStatus();
  DGSERVE_ENSURE_PASS_SCRATCH(R);
  // The K/V staging: every layer's host rows if they fit in options_.encode_staging_bytes, else
  // at least one layer's (then flushed when full).
  size_t all_layers = 0, one_layer = 0;
  for (int l = 0; l < c_.num_layers; ++l) {
    size_t rows = 0;
    for (const Segment& s : segs) rows += size_t(s.HostRows(c_.IsFull(l)).second);
    const size_t need = 2 * rows * c_.KvHeads(l) * c_.HeadDim(l);
    all_layers += need;
    one_layer = std::max(one_layer, need);
  }
  DGSERVE_RETURN_IF_ERROR(kv_stage_.Ensure(
      std::max(one_layer, std::min(all_layers, options_.encode_staging_bytes / sizeof(float)))));
  kv_stage_used_ = 0;
  kv_staged_.clear();
  DGSERVE_RETURN_IF_ERROR(ids_host_.Ensure(R));
  DGSERVE_RETURN_IF_ERROR(positions_host_.Ensure(R));
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = segs[i];
    for (int r = 0; r < s.rows; ++r) {
      ids_host_[s.row0 + r] = batch[i].tokens[r];
      positions_host_[s.row0 + r] = s.pos0 + r;
    }
  }
  DGSERVE_RETURN_IF_ERROR(ids_.UploadAsync(ids_host_.data(), R, stream_));
  DGSERVE_RETURN_IF_ERROR(positions_.UploadAsync(positions_host_.data(), R, stream_));
  DGSERVE_RETURN_IF_ERROR(
      cuda::EmbedRows(ids_.get(), embed_.get(), R, D, c_.EmbedScale(), h_.get(), stream_));
  DGSERVE_RETURN_IF_ERROR(UploadPrefillTable(segs));
  for (int l = 0; l < c_.num_layers; ++l) {
    DGSERVE_RETURN_IF_ERROR(Layer(l, PassKind::kEncoder, segs, R));
  }
  // The pass's one wait (with a large staging). With the deferred host copy nothing is staged,
  // but the wait stays: the pinned inputs (ids_host_, positions_host_, the prefill table) are
  // rewritten by the next call while this pass's uploads may still be queued.
  DGSERVE_RETURN_IF_ERROR(FlushStagedKv(segs));
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].kv->Commit(segs[i].rows);
    KvMirror* m = segs[i].mirror;
    // Sliding rows the pass did not write (before the window it keeps): a gap.
    if (segs[i].sliding_device_from > segs[i].pos0) m->sliding_from = segs[i].sliding_device_from;
    m->synced = segs[i].pos0 + segs[i].rows;
    if (m->deferred) {
      batch[i].kv->set_host_rows_stale(true);  // the new rows are on the device only
    } else {
      m->host_synced = m->synced;
    }
    // Sliding blocks the window has left go back to the pool now.
    // Its whole blocks registered (before any goes back: a released one stays cached).
    PublishKvBlocks(*batch[i].kv, m);
    if (m->paged()) ReleaseSlidingKvBlocks(*batch[i].kv, m, m->synced);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::FlushStagedKv(std::span<const Segment> segs) {
  DGSERVE_RETURN_IF_ERROR(Wait("Encode (K/V to the host)"));
  for (const StagedKv& st : kv_staged_) {
    const int l = st.layer;
    const size_t kvw = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
    // The staged rows: each segment's HostRows in segment order (as Layer copied them).
    const float* k = kv_stage_.data() + st.offset;
    const float* v = k + size_t(st.rows) * kvw;
    size_t src = 0;
    for (const Segment& s : segs) {
      const auto [first, count] = s.HostRows(c_.IsFull(l));
      for (int r = first; r < first + count; ++r, src += kvw) {
        std::memcpy(s.kv_write->MutableKeyRow(l, s.pos0 + r), k + src, sizeof(float) * kvw);
        std::memcpy(s.kv_write->MutableValueRow(l, s.pos0 + r), v + src, sizeof(float) * kvw);
      }
    }
  }
  kv_staged_.clear();
  kv_stage_used_ = 0;
  return absl::OkStatus();
}

absl::StatusOr<int> CudaBackend::PrepareBody(std::span<const CanvasInput> batch,
                                             std::vector<Segment>* segs) {
  const int D = c_.hidden_size;
  segs->clear();
  for (const CanvasInput& in : batch) {
    if (in.kv == nullptr) return absl::InvalidArgumentError("decoder input without a KV cache");
    DGSERVE_RETURN_IF_ERROR(CheckTokens(in.canvas));
  }
  int R = 0;
  std::vector<const KvCache*> caches;
  for (const CanvasInput& in : batch) caches.push_back(in.kv);
  BeginPass(caches);
  for (const CanvasInput& in : batch) {
    Segment s;
    s.row0 = R;
    s.rows = in.canvas.size();
    s.pos0 = in.kv->num_tokens();
    s.kv = in.kv;
    s.has_sc = in.sc_soft != nullptr && s.rows > 0;
    DGSERVE_ASSIGN_OR_RETURN(s.mirror, SyncMirror(*in.kv, 0));
    segs->push_back(s);
    R += s.rows;
  }
  if (R == 0) return 0;
  DGSERVE_ENSURE_PASS_SCRATCH(R);
  // The pass's inputs staged in pinned memory and queued for upload on stream_ (the previous call
  // ended with the stream idle, so the staging is free to rewrite).
  DGSERVE_RETURN_IF_ERROR(ids_host_.Ensure(R));
  DGSERVE_RETURN_IF_ERROR(positions_host_.Ensure(R));
  bool any_sc = false;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = (*segs)[i];
    for (int r = 0; r < s.rows; ++r) {
      ids_host_[s.row0 + r] = batch[i].canvas[r];
      positions_host_[s.row0 + r] = s.pos0 + r;
    }
    any_sc |= s.has_sc;
  }
  DGSERVE_RETURN_IF_ERROR(ids_.UploadAsync(ids_host_.data(), R, stream_));
  DGSERVE_RETURN_IF_ERROR(positions_.UploadAsync(positions_host_.data(), R, stream_));
  if (any_sc) {
    // The soft embeddings, at their segments' rows of sc_in_ [R, D].
    DGSERVE_RETURN_IF_ERROR(sc_host_.Ensure(size_t(R) * D));
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = (*segs)[i];
      if (!s.has_sc) continue;
      std::memcpy(sc_host_.data() + size_t(s.row0) * D, batch[i].sc_soft,
                  size_t(s.rows) * D * sizeof(float));
    }
    DGSERVE_RETURN_IF_ERROR(sc_in_.UploadAsync(sc_host_.data(), size_t(R) * D, stream_));
  }
  DGSERVE_RETURN_IF_ERROR(UploadCanvasTable(*segs));
  return R;
}

absl::Status CudaBackend::EnqueueBody(std::span<const Segment> segs, int R) {
  const int D = c_.hidden_size, I = c_.intermediate_size;
  const float eps = c_.rms_norm_eps;
  float* h = h_.get();
  // Canvas input (spec §3.5 steps 1–3): x0 = rms_noscale(E[c]·s + SC(soft)).
  phases_.Enter(Phase::kDense);
  DGSERVE_RETURN_IF_ERROR(
      cuda::EmbedRows(ids_.get(), embed_.get(), R, D, c_.EmbedScale(), h, stream_));
  for (const Segment& s : segs) {
    if (!s.has_sc) continue;
    float* u = a_.get();  // free until the layers run
    float* sig = o_.get();
    DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(sc_in_.get() + size_t(s.row0) * D, sc_pre_norm_.get(),
                                          s.rows, D, eps, u, stream_));
    DGSERVE_RETURN_IF_ERROR(GatedMlp(u, s.rows, sc_gate_, sc_up_, sc_down_, I, sig));
    DGSERVE_RETURN_IF_ERROR(
        cuda::AddInPlace(h + size_t(s.row0) * D, sig, int64_t(s.rows) * D, stream_));
  }
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, nullptr, R, D, eps, h, stream_));
  for (int l = 0; l < c_.num_layers; ++l) {
    DGSERVE_RETURN_IF_ERROR(Layer(l, PassKind::kDecoder, segs, R));
  }
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, final_norm_.get(), R, D, eps, h, stream_));
  phases_.Leave();
  return absl::OkStatus();
}

}  // namespace dgserve::cuda_internal
