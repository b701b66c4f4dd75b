// CUDA implementation of ModelBackend (see cuda_backend.h): spec §3 forward math and the §4.2
// vocabulary step, structured as engine/cpu/cpu_backend.cc.
#include "engine/cuda/cuda_backend.h"

#include "engine/cpu/gemm_quant.h"
#include "engine/cuda/cuda_backend_internal.h"

namespace dgserve {
namespace cuda_internal {
namespace {

// Issue 37: a quantized matrix the device cannot keep in its own format (UploadFp8, UploadW4A16
// or UploadNvfp4 declined it: W4A16 scales that are not bf16 values or a group that is not a
// multiple of 8, a layer's experts of mixed formats or of mixed NVFP4 flavours (W4A4 and
// weight-only NVFP4A16, which both run in 4 bits on their own: cuda_nvfp4.h), ...; an NVFP4
// self-conditioning MLP is refused earlier, by backend_select.cc) would be
// widened to bf16 — q·s rounded to bf16 and its activations taken as the GEMM input mode says,
// where the CPU's cpu::QuantLinear multiplies the exact q·s by float32 (or format-quantized)
// activations in both modes: another model. Refused instead of widened, so that a quantized weight
// never reaches a bf16 path (UploadBf16, cuBLAS, DenseLinear, MoeGateUp / MoeDown).
absl::Status RefuseWidening(const cpu::PackedMatrix& m, const std::string& what) {
  if (m.quant() == nullptr) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "the CUDA backend cannot run ", what, " (",
      m.quant()->nvfp4_weight_only() ? "nvfp4 weight-only"
                                     : cpu::QuantFormatName(m.quant()->format()),
      ", ", m.rows(), "×", m.cols(), ", group ", m.quant()->group_size(),
      ") in its format and does not widen quantized weights to bf16 (another model than the CPU "
      "backend's): use --device cpu"));
}
absl::Status RefuseWidening(const std::vector<cpu::PackedMatrix>& m, const std::string& what) {
  for (size_t e = 0; e < m.size(); ++e) {
    DGSERVE_RETURN_IF_ERROR(RefuseWidening(m[e], absl::StrCat(what, " of expert ", e)));
  }
  return absl::OkStatus();
}

}  // namespace

// Issue 37: one projection (a cpu::PackedMatrix) or E experts (a vector of them) named `what`
// into *out in the checkpoint's format where the device runs it (UploadNvfp4, UploadFp8 and
// UploadW4A16 say when: cuda_nvfp4_upload.h, cuda_fp8_memory.h, cuda_memory.h); bf16 weights
// upload as bf16 (UploadBf16), and quantized ones none of those keep are refused
// (RefuseWidening), never widened.
template <typename Matrices>
absl::Status UploadDeviceWeights(const Matrices& m, const std::string& what, DeviceWeights* out) {
  DGSERVE_ASSIGN_OR_RETURN(const bool nvfp4, cuda::UploadNvfp4(m, &out->nvfp4));
  if (nvfp4) {
    out->format = WeightFormat::kNvfp4;
    return absl::OkStatus();
  }
  DGSERVE_ASSIGN_OR_RETURN(const bool fp8, cuda::UploadFp8(m, &out->fp8));
  if (fp8) {
    out->format = WeightFormat::kFp8;
    return absl::OkStatus();
  }
  DGSERVE_ASSIGN_OR_RETURN(const bool w4a16, cuda::UploadW4A16(m, &out->w4a16));
  if (w4a16) {
    out->format = WeightFormat::kW4A16;
    return absl::OkStatus();
  }
  DGSERVE_RETURN_IF_ERROR(RefuseWidening(m, what));
  out->format = WeightFormat::kBf16;
  return UploadBf16(m, &out->bf16);
}

absl::Status CudaBackend::Init(const ModelWeights& w) {
  const int L = c_.num_layers;
  if (int(w.layers.size()) != L) return absl::InvalidArgumentError("weights: layer count mismatch");
  if (options_.kv_block_size < 0 || options_.kv_block_size > 4096) {
    return absl::InvalidArgumentError("kv_block_size: must be 0 (per-sequence mirrors) to 4096");
  }
  if (!(options_.memory_utilization >= 0 && options_.memory_utilization <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("memory_utilization ", options_.memory_utilization, ": must be in [0, 1]"));
  }
  if (options_.kv_block_size > 0) {
    // The K/V pools grow in place (cuda_reserved_memory.h): arrays in granules.
    DGSERVE_ASSIGN_OR_RETURN(kv_granularity_, cuda::ReservedMemoryGranularity());
  }
  if (options_.kv_block_size > 0 && options_.kv_pool_max_bytes > 0) {
    // A bound below one block of each kind would fail every pass.
    const int64_t one_each = KvPoolsMinBytes();
    if (int64_t(options_.kv_pool_max_bytes) < one_each) {
      return absl::InvalidArgumentError(absl::StrCat(
          "kv_pool_max_bytes ", options_.kv_pool_max_bytes,
          ": below one K/V block of each layer kind (", one_each,
          " bytes, each layer's K and V rounded up to the device's allocation granularity of ",
          kv_granularity_, " bytes)"));
    }
  }
  if (options_.canvas_split_keys <= 0 || options_.canvas_split_keys % 32 != 0) {
    return absl::InvalidArgumentError("canvas_split_keys: must be a positive multiple of 32");
  }
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                                    "cudaStreamCreateWithFlags"));
  DGSERVE_RETURN_IF_ERROR(CublasCheck(cublasCreate(&handle_), "cublasCreate"));
  DGSERVE_RETURN_IF_ERROR(CublasCheck(cublasSetStream(handle_, stream_), "cublasSetStream"));
  DGSERVE_RETURN_IF_ERROR(UploadBf16(w.embed_tokens, &embed_));
  DGSERVE_RETURN_IF_ERROR(final_norm_.Upload(w.final_norm));
  DGSERVE_RETURN_IF_ERROR(sc_pre_norm_.Upload(w.sc_pre_norm));
  DGSERVE_RETURN_IF_ERROR(
      UploadDeviceWeights(w.sc_gate_proj, "self_conditioning.gate_proj", &sc_gate_));
  DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(w.sc_up_proj, "self_conditioning.up_proj", &sc_up_));
  DGSERVE_RETURN_IF_ERROR(
      UploadDeviceWeights(w.sc_down_proj, "self_conditioning.down_proj", &sc_down_));
  layers_.resize(L);
  for (int l = 0; l < L; ++l) {
    const LayerWeights& s = w.layers[l];
    DeviceLayer& d = layers_[l];
    DGSERVE_RETURN_IF_ERROR(d.input_layernorm.Upload(s.input_layernorm));
    DGSERVE_RETURN_IF_ERROR(d.q_norm.Upload(s.q_norm));
    DGSERVE_RETURN_IF_ERROR(d.k_norm.Upload(s.k_norm));
    DGSERVE_RETURN_IF_ERROR(d.post_attention_layernorm.Upload(s.post_attention_layernorm));
    DGSERVE_RETURN_IF_ERROR(d.pre_feedforward_layernorm.Upload(s.pre_feedforward_layernorm));
    DGSERVE_RETURN_IF_ERROR(d.post_feedforward_layernorm_1.Upload(s.post_feedforward_layernorm_1));
    DGSERVE_RETURN_IF_ERROR(d.router_scale.Upload(s.router_scale));
    DGSERVE_RETURN_IF_ERROR(d.pre_feedforward_layernorm_2.Upload(s.pre_feedforward_layernorm_2));
    DGSERVE_RETURN_IF_ERROR(d.post_feedforward_layernorm_2.Upload(s.post_feedforward_layernorm_2));
    DGSERVE_RETURN_IF_ERROR(d.post_feedforward_layernorm.Upload(s.post_feedforward_layernorm));
    // Quantized projections and experts stay in their format (issue 37).
    const std::string layer = absl::StrCat("layer ", l, " ");
    DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(s.q_proj, layer + "q_proj", &d.q_proj));
    DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(s.k_proj, layer + "k_proj", &d.k_proj));
    DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(s.v_proj, layer + "v_proj", &d.v_proj));
    DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(s.o_proj, layer + "o_proj", &d.o_proj));
    DGSERVE_RETURN_IF_ERROR(
        UploadDeviceWeights(s.mlp_gate_proj, layer + "mlp.gate_proj", &d.mlp_gate_proj));
    DGSERVE_RETURN_IF_ERROR(
        UploadDeviceWeights(s.mlp_up_proj, layer + "mlp.up_proj", &d.mlp_up_proj));
    DGSERVE_RETURN_IF_ERROR(
        UploadDeviceWeights(s.mlp_down_proj, layer + "mlp.down_proj", &d.mlp_down_proj));
    DGSERVE_RETURN_IF_ERROR(UploadDeviceWeights(
        s.experts_gate_up_proj, layer + "experts.gate_up_proj", &d.experts_gate_up));
    DGSERVE_RETURN_IF_ERROR(
        UploadDeviceWeights(s.experts_down_proj, layer + "experts.down_proj", &d.experts_down));
    DGSERVE_RETURN_IF_ERROR(RefuseWidening(s.router_proj, layer + "router.proj"));
    DGSERVE_RETURN_IF_ERROR(UploadFloat(s.router_proj, &d.router_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.router_proj, &d.router_proj_bf16));
    DGSERVE_RETURN_IF_ERROR(d.per_expert_scale.Upload(s.router_per_expert_scale));
    d.decoder_layer_scalar = s.decoder_layer_scalar;
    d.encoder_layer_scalar = s.encoder_layer_scalar;
  }
  DGSERVE_RETURN_IF_ERROR(
      rope_sliding_.Upload(RopeInvFreq(c_.rope_theta_sliding, c_.head_dim, c_.head_dim / 2)));
  DGSERVE_RETURN_IF_ERROR(
      rope_full_.Upload(RopeInvFreq(c_.rope_theta_full, c_.global_head_dim, c_.FullRopeAngles())));
  cuda::NoteSync();
  return CudaCheck(cudaDeviceSynchronize(), "upload weights");
}

absl::Status CudaBackend::SetKvPoolBound(size_t free_before) {
  if (options_.kv_block_size == 0) return absl::OkStatus();  // per-sequence mirrors: no pool
  if (options_.kv_pool_max_bytes > 0) {  // checked against one block of each kind by Init
    kv_pool_bound_ = options_.kv_pool_max_bytes;
    return absl::OkStatus();
  }
  if (options_.memory_utilization == 0) return absl::OkStatus();
  size_t free_bytes = 0, total_bytes = 0;
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  // This backend's own memory (the weights and its buffers), not what other processes or backends
  // on the device hold: each takes its fraction, as vLLM's instances do.
  const double own = double(free_before - std::min(free_bytes, free_before));
  // At most the memory free now (the pools grow in place: only the new memory is needed), so that
  // CheckKvFits refuses only what cannot run.
  const double bound =
      std::min(options_.memory_utilization * double(total_bytes) - own, double(free_bytes));
  const int64_t one_each = KvPoolsMinBytes();
  if (bound < double(one_each)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "memory_utilization ", options_.memory_utilization, " of the device's ", total_bytes,
        " bytes leaves no room for the K/V block pools: the weights and buffers take ",
        int64_t(own), " bytes, ", free_bytes,
        " bytes are free, and one K/V block of each layer kind takes ", one_each,
        " bytes (raise the fraction, or give the pools' bound in bytes)"));
  }
  kv_pool_bound_ = size_t(bound);
  return absl::OkStatus();
}

absl::Status CudaBackend::InitSyntheticMatrices(uint64_t seed) {
  std::unordered_map<std::string, DeviceArray<uint16_t>*> bf16;
  std::unordered_map<std::string, DeviceArray<float>*> f32;
  const std::string p = "model.decoder.";
  bf16[p + "embed_tokens.weight"] = &embed_;
  // The matrices are made in bf16 (the random checkpoint's format).
  auto bf16_weights = [](DeviceWeights* w) {
    w->format = WeightFormat::kBf16;
    return &w->bf16;
  };
  bf16[p + "self_conditioning.gate_proj.weight"] = bf16_weights(&sc_gate_);
  bf16[p + "self_conditioning.up_proj.weight"] = bf16_weights(&sc_up_);
  bf16[p + "self_conditioning.down_proj.weight"] = bf16_weights(&sc_down_);
  for (int l = 0; l < c_.num_layers; ++l) {
    DeviceLayer& d = layers_[l];
    const std::string q = absl::StrCat(p, "layers.", l, ".");
    bf16[q + "self_attn.q_proj.weight"] = bf16_weights(&d.q_proj);
    bf16[q + "self_attn.k_proj.weight"] = bf16_weights(&d.k_proj);
    bf16[q + "self_attn.v_proj.weight"] = bf16_weights(&d.v_proj);
    bf16[q + "self_attn.o_proj.weight"] = bf16_weights(&d.o_proj);
    bf16[q + "mlp.gate_proj.weight"] = bf16_weights(&d.mlp_gate_proj);
    bf16[q + "mlp.up_proj.weight"] = bf16_weights(&d.mlp_up_proj);
    bf16[q + "mlp.down_proj.weight"] = bf16_weights(&d.mlp_down_proj);
    bf16[q + "experts.gate_up_proj"] = bf16_weights(&d.experts_gate_up);
    bf16[q + "experts.down_proj"] = bf16_weights(&d.experts_down);
    f32[q + "router.proj.weight"] = &d.router_proj;  // float32 on the device (exact widening)
  }
  for (const TensorSpec& spec : SyntheticMatrixSpecs(c_)) {
    const InitConstants k = FamilyConstants(spec);
    const cuda::SyntheticTensor t{TensorKey(spec.name, seed), k.a, k.c, k.has_offset};
    const int64_t n = spec.numel();
    if (auto it = bf16.find(spec.name); it != bf16.end()) {
      DGSERVE_RETURN_IF_ERROR(it->second->Ensure(size_t(n)));
      DGSERVE_RETURN_IF_ERROR(cuda::FillSyntheticBf16(t, n, it->second->get()));
    } else if (auto jt = f32.find(spec.name); jt != f32.end()) {
      DGSERVE_RETURN_IF_ERROR(jt->second->Ensure(size_t(n)));
      DGSERVE_RETURN_IF_ERROR(cuda::FillSyntheticFloat(t, n, jt->second->get()));
    } else {
      return absl::InternalError(
          absl::StrCat("synthetic weights: no device tensor for ", spec.name));
    }
  }
  // The router's bf16 copy (its float32 values are bf16 values: the conversion is exact).
  for (DeviceLayer& d : layers_) {
    const size_t n = size_t(c_.num_experts) * c_.hidden_size;
    DGSERVE_RETURN_IF_ERROR(d.router_proj_bf16.Ensure(n));
    DGSERVE_RETURN_IF_ERROR(
        cuda::FloatToBf16(d.router_proj.get(), int64_t(n), d.router_proj_bf16.get()));
  }
  cuda::NoteSync();
  return CudaCheck(cudaDeviceSynchronize(), "synthetic weights");
}


absl::Status CudaBackend::CheckTokens(std::span<const int32_t> ids) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= c_.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("token id ", id, " outside the vocabulary [0, ", c_.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Wait(const char* what) {
  cuda::NoteSync();
  return CudaCheck(cudaStreamSynchronize(stream_), what);
}

absl::Status CudaBackend::DownloadNow(void* host, const void* device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  cuda::NoteDownload();
  return CudaCheck(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_),
                   "cudaMemcpyAsync D2H");
}

absl::Status CudaBackend::Decode(std::span<const DecodeInput> batch) {
  const auto lock = Lock();
  const int D = c_.hidden_size, V = c_.vocab_size;
  std::vector<CanvasInput> canvases;
  for (const DecodeInput& in : batch) {
    if (in.logits == nullptr) return absl::InvalidArgumentError("decoder input without logits");
    canvases.push_back({in.canvas, in.sc_soft, in.kv});
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Segment> segs;
  DGSERVE_ASSIGN_OR_RETURN(const int R, PrepareBody(canvases, &segs));
  if (R > 0) {
    DGSERVE_RETURN_IF_ERROR(EnqueueBody(segs, R));
    // LM head (tied embedding) and softcap (spec §3.1.6).
    DGSERVE_RETURN_IF_ERROR(logits_.Ensure(size_t(R) * V));
    DGSERVE_RETURN_IF_ERROR(
        cublas_.Linear(h_.get(), embed_.get(), R, D, V, logits_.get(), stream_));
    DGSERVE_RETURN_IF_ERROR(
        cuda::Softcap(logits_.get(), int64_t(R) * V, c_.final_logit_softcapping, stream_));
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = segs[i];
      DGSERVE_RETURN_IF_ERROR(DownloadNow(batch[i].logits, logits_.get() + size_t(s.row0) * V,
                                          size_t(s.rows) * V * sizeof(float)));
    }
  }
  // One unit on the device: the whole call is body_seconds.
  timings_.body_seconds = SecondsSince(t0);
  timings_.lm_head_seconds = 0;
  return absl::OkStatus();
}

absl::Status CudaBackend::SoftGemm(const uint16_t* probs_bf16, int rows, float* soft) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  const float alpha = c_.EmbedScale(), beta = 0.0f;
  // Row-major soft[rows, D] = P[rows, V] · E[V, D] is column-major softᵀ = Eᵀ · Pᵀ (on stream_,
  // the handle's stream).
  cuda::NoteCublas();
  return CublasCheck(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, D, rows, V, &alpha,
                                  embed_.get(), CUDA_R_16BF, D, probs_bf16, CUDA_R_16BF, V, &beta,
                                  soft, CUDA_R_32F, D, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx (soft embedding)");
}

absl::Status CudaBackend::DenoiseStep(std::span<const DenoiseStepInput> batch) {
  const auto lock = Lock();
  if (!options_.phase_timing) return DenoiseStepLocked(batch);
  phases_.Start(stream_);
  const absl::Status st = DenoiseStepLocked(batch);
  if (!st.ok()) {
    phases_.Abort();
    return st;
  }
  DGSERVE_ASSIGN_OR_RETURN(last_phases_, phases_.Finish());
  return absl::OkStatus();
}

absl::Status CudaBackend::PrepareVocab(std::span<const DenoiseStepInput> batch,
                                       std::span<const Segment> segs, int R, StepVocab* v) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  *v = StepVocab{};
  DGSERVE_RETURN_IF_ERROR(temps_host_.Ensure(R));
  DGSERVE_RETURN_IF_ERROR(uniforms_host_.Ensure(R));
  DGSERVE_RETURN_IF_ERROR(skip_host_.Ensure(R));
  DGSERVE_RETURN_IF_ERROR(mask_index_host_.Ensure(R));
  // Canvas templates: each distinct mask uploaded once, rows naming it by index (−1: none).
  const size_t words = (size_t(V) + 63) / 64;
  std::vector<const uint64_t*> masks;
  std::unordered_map<const uint64_t*, int32_t> mask_ids;
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = segs[i];
    const bool sparse = batch[i].sparse_sc && batch[i].next_soft != nullptr;
    for (int r = 0; r < s.rows; ++r) {
      temps_host_[s.row0 + r] = batch[i].temperature;
      uniforms_host_[s.row0 + r] = batch[i].uniforms[r];
      // The sparse self-conditioning product (cpu_vocab.h's bound) for the rows of canvases
      // whose DenoiseStepInput::sparse_sc is set (ε = 2⁻¹², cpu::kDefaultScSkipMass).
      skip_host_[s.row0 + r] = sparse ? 0x1p-12f : 0.0f;
      int32_t index = -1;
      if (!batch[i].row_masks.empty() && batch[i].row_masks[r] != nullptr) {
        const uint64_t* m = batch[i].row_masks[r];
        auto [it, added] = mask_ids.try_emplace(m, int32_t(masks.size()));
        if (added) masks.push_back(m);
        index = it->second;
      }
      mask_index_host_[s.row0 + r] = index;
    }
    v->want_soft |= batch[i].next_soft != nullptr && s.rows > 0;
    v->sparse |= sparse && s.rows > 0;
  }
  v->sparse &= options_.fused_vocab;
  v->masked = !masks.empty();
  DGSERVE_RETURN_IF_ERROR(temps_.UploadAsync(temps_host_.data(), R, stream_));
  DGSERVE_RETURN_IF_ERROR(uniforms_.UploadAsync(uniforms_host_.data(), R, stream_));
  if (v->masked) {
    DGSERVE_RETURN_IF_ERROR(mask_table_host_.Ensure(masks.size() * words));
    for (size_t m = 0; m < masks.size(); ++m) {
      std::memcpy(mask_table_host_.data() + m * words, masks[m], words * sizeof(uint64_t));
    }
    DGSERVE_RETURN_IF_ERROR(
        mask_table_.UploadAsync(mask_table_host_.data(), masks.size() * words, stream_));
    DGSERVE_RETURN_IF_ERROR(mask_index_.UploadAsync(mask_index_host_.data(), R, stream_));
  }
  if (v->sparse) {
    if (tile_norm_max_.get() == nullptr) {
      DGSERVE_RETURN_IF_ERROR(
          tile_norm_max_.Ensure(size_t(V + cuda::kFusedVocabTile - 1) / cuda::kFusedVocabTile));
      DGSERVE_RETURN_IF_ERROR(
          cuda::FusedTileNormMax(embed_.get(), V, D, tile_norm_max_.get(), stream_));
    }
    DGSERVE_RETURN_IF_ERROR(skip_mass_.UploadAsync(skip_host_.data(), R, stream_));
  }
  DGSERVE_RETURN_IF_ERROR(results_.Ensure(R));
  if (options_.fused_vocab) {
    DGSERVE_RETURN_IF_ERROR(vocab_scratch_.Ensure(cuda::FusedVocabScratchBytes(R, V)));
  } else {
    DGSERVE_RETURN_IF_ERROR(logits_.Ensure(size_t(R) * V));
  }
  if (v->want_soft) {
    if (options_.fused_vocab) {
      DGSERVE_RETURN_IF_ERROR(soft_scratch_.Ensure(cuda::FusedSoftEmbeddingScratchBytes(R, V, D)));
    } else {
      DGSERVE_RETURN_IF_ERROR(probs_bf16_.Ensure(size_t(R) * V));
    }
    DGSERVE_RETURN_IF_ERROR(soft_.Ensure(size_t(R) * D));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::EnqueueVocab(int R, const StepVocab& v) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  phases_.Enter(Phase::kVocab);
  const uint64_t* d_mask_table = v.masked ? mask_table_.get() : nullptr;
  const int32_t* d_mask_index = v.masked ? mask_index_.get() : nullptr;
  // The LM head, softcap, masks, argmax, entropy, lse and sample (spec §3.1.6, §4.2 steps
  // 3–4): fused, in vocabulary tiles, no [R, V] logits (cuda_vocab.h); or, as a comparison
  // mode, cuBLAS float32 logits then VocabStep.
  cuda::FusedVocabArgs fused;
  fused.hidden = h_.get();
  fused.rows = R;
  fused.dim = D;
  fused.embed = embed_.get();
  fused.vocab = V;
  fused.bf16_input = cublas_.input() == cuda::GemmInput::kBf16;
  fused.softcap = c_.final_logit_softcapping;
  fused.temperature = temps_.get();
  fused.uniforms = uniforms_.get();
  fused.out = results_.get();
  fused.mask_table = d_mask_table;
  fused.mask_index = d_mask_index;
  fused.stream = stream_;
  if (options_.fused_vocab) {
    fused.scratch = vocab_scratch_.get();
    if (v.sparse) {
      fused.sc_skip_mass = skip_mass_.get();
      fused.tile_norm_max = tile_norm_max_.get();
      fused.embed_scale = c_.EmbedScale();
    }
    DGSERVE_RETURN_IF_ERROR(cuda::FusedVocabStep(fused));
  } else {
    DGSERVE_RETURN_IF_ERROR(
        cublas_.Linear(h_.get(), embed_.get(), R, D, V, logits_.get(), stream_));
    DGSERVE_RETURN_IF_ERROR(cuda::VocabStep(logits_.get(), R, V, c_.final_logit_softcapping,
                                            temps_.get(), uniforms_.get(), results_.get(),
                                            /*z_bf16=*/nullptr, d_mask_table, d_mask_index,
                                            stream_));
  }
  if (!v.want_soft) return absl::OkStatus();
  // Next step's self-conditioning input (spec §3.5 step 2): softmax(ℓ/T) · E · bf16(√D) for
  // every row (the host copies out the canvases that asked). Fused: each tile's bf16
  // probabilities recomputed and multiplied by the table on the tensor cores in a fixed order
  // (cuda_soft_embed.h; no [R, V] buffer, the sparse plan's tiles left out). The comparison
  // mode: bf16 probabilities from the logits, then one cuBLAS GEMM.
  if (options_.fused_vocab) {
    return cuda::FusedSoftEmbedding(fused, results_.get(), c_.EmbedScale(), soft_scratch_.get(),
                                    soft_.get());
  }
  DGSERVE_RETURN_IF_ERROR(cuda::SoftmaxProbsBf16(logits_.get(), R, V, c_.final_logit_softcapping,
                                                 temps_.get(), results_.get(), probs_bf16_.get(),
                                                 d_mask_table, d_mask_index, stream_));
  return SoftGemm(probs_bf16_.get(), R, soft_.get());
}

void CudaBackend::DropGraphs() {
  for (auto& [key, g] : graphs_) {
    if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);
  }
  graphs_.clear();
}

absl::Status CudaBackend::RunStep(std::span<const Segment> segs, int R, const StepVocab& v) {
  const auto enqueue = [&]() -> absl::Status {
    DGSERVE_RETURN_IF_ERROR(EnqueueBody(segs, R));
    return EnqueueVocab(R, v);
  };
  if (!options_.cuda_graphs || options_.phase_timing) {
    ++graph_stats_.eager_steps;
    return enqueue();
  }
  // The step's shape: everything a launch takes from the host. Pointers and sizes of the scratch
  // follow from R (and the allocation generation); the per-step values (ids, positions, soft
  // embeddings, temperatures, uniforms, masks, and the attention table with each canvas's
  // context) are read from device buffers the inputs were copied into.
  std::vector<int64_t> key = {R, v.masked, v.sparse, v.want_soft};
  // TensorCoreCanvasAttention's grid depends on each layer's split bound (UploadCanvasTable).
  key.insert(key.end(), canvas_max_splits_.begin(), canvas_max_splits_.end());
  for (const Segment& s : segs) {
    key.push_back(s.rows);
    key.push_back(s.has_sc);
  }
  constexpr size_t kMaxGraphs = 64;
  if (graphs_.size() >= kMaxGraphs && graphs_.find(key) == graphs_.end()) DropGraphs();
  StepGraph& g = graphs_[key];
  const uint64_t generation = cuda::ScratchGeneration();
  if (g.exec != nullptr && g.generation != generation) {
    cudaGraphExecDestroy(g.exec);
    g.exec = nullptr;
    ++graph_stats_.invalidated;
  }
  if (g.exec == nullptr) {
    if (g.failed || g.eager_runs++ == 0) {
      ++graph_stats_.eager_steps;
      return enqueue();
    }
    DGSERVE_RETURN_IF_ERROR(
        CudaCheck(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
                  "cudaStreamBeginCapture"));
    const cuda::LaunchCounts before = cuda::ReadLaunchCounts();
    absl::Status st = enqueue();
    const cuda::LaunchCounts inside = cuda::ReadLaunchCounts() - before;
    cuda::UnnoteCaptured(inside);  // nothing ran yet: the launch below counts them
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    if (st.ok()) st = CudaCheck(ended, "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    if (st.ok()) st = CudaCheck(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (st.ok() && cuda::ScratchGeneration() != generation) {
      st = absl::InternalError("a device buffer was allocated during the capture");
    }
    if (!st.ok()) {
      // Refused (a blocking call or an allocation inside the step): this shape runs eagerly.
      cudaGetLastError();
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      g.failed = true;
      ++graph_stats_.capture_failures;
      graph_stats_.last_failure = st.ToString();
      ++graph_stats_.eager_steps;
      return enqueue();
    }
    g.exec = exec;
    g.generation = generation;
    g.inside = inside;
    ++graph_stats_.captures;
  }
  cuda::NoteGraphLaunch(g.inside);
  ++graph_stats_.replays;
  return CudaCheck(cudaGraphLaunch(g.exec, stream_), "cudaGraphLaunch");
}

absl::Status CudaBackend::DenoiseStepLocked(std::span<const DenoiseStepInput> batch) {
  const int D = c_.hidden_size;
  std::vector<CanvasInput> canvases;
  for (const DenoiseStepInput& in : batch) {
    if (in.rows == nullptr || in.uniforms.size() < in.canvas.size()) {
      return absl::InvalidArgumentError("denoise step without row outputs or uniforms");
    }
    if (!(in.temperature > 0) || !std::isfinite(in.temperature)) {
      return absl::InvalidArgumentError("temperature: must be finite and > 0");
    }
    if (!in.row_masks.empty() && in.row_masks.size() != in.canvas.size()) {
      return absl::InvalidArgumentError("row_masks: must have one entry per canvas position");
    }
    canvases.push_back({in.canvas, in.sc_soft, in.kv});
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Segment> segs;
  DGSERVE_ASSIGN_OR_RETURN(const int R, PrepareBody(canvases, &segs));
  timings_.lm_head_seconds = 0;
  if (R == 0) {
    timings_.body_seconds = SecondsSince(t0);
    return absl::OkStatus();
  }
  StepVocab v;
  DGSERVE_RETURN_IF_ERROR(PrepareVocab(batch, segs, R, &v));
  if (options_.phase_timing) {
    // Eager, with a wait between the body and the vocabulary pass so that both are timed.
    DGSERVE_RETURN_IF_ERROR(EnqueueBody(segs, R));
    DGSERVE_RETURN_IF_ERROR(Wait("decoder body"));
    timings_.body_seconds = SecondsSince(t0);
    ++graph_stats_.eager_steps;
    DGSERVE_RETURN_IF_ERROR(EnqueueVocab(R, v));
  } else {
    DGSERVE_RETURN_IF_ERROR(RunStep(segs, R, v));
  }
  // The results (and the next soft embeddings) into pinned memory, then the step's one wait.
  DGSERVE_RETURN_IF_ERROR(results_host_.Ensure(R));
  cuda::NoteDeviceCopy();
  DGSERVE_RETURN_IF_ERROR(CudaCheck(
      cudaMemcpyAsync(results_host_.data(), results_.get(),
                      size_t(R) * sizeof(cuda::VocabRowResult), cudaMemcpyDeviceToHost, stream_),
      "cudaMemcpyAsync (row results)"));
  if (v.want_soft) {
    DGSERVE_RETURN_IF_ERROR(soft_host_.Ensure(size_t(R) * D));
    cuda::NoteDeviceCopy();
    DGSERVE_RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(soft_host_.data(), soft_.get(), size_t(R) * D * sizeof(float),
                                  cudaMemcpyDeviceToHost, stream_),
                  "cudaMemcpyAsync (soft embedding)"));
  }
  DGSERVE_RETURN_IF_ERROR(Wait("denoise step"));
  if (options_.phase_timing) {
    timings_.lm_head_seconds = SecondsSince(t0) - timings_.body_seconds;
  } else {
    timings_.body_seconds = SecondsSince(t0);  // one unit on the device
  }
  for (int r = 0; r < R; ++r) {
    if (results_host_[r].argmax < 0) {
      return absl::InternalError(absl::StrCat("denoise step: row ", r, " has non-finite logits"));
    }
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = segs[i];
    for (int r = 0; r < s.rows; ++r) {
      const cuda::VocabRowResult& x = results_host_[s.row0 + r];
      RowResult& out = batch[i].rows[r];
      out.argmax = x.argmax;
      out.sampled = x.sampled;
      out.entropy = x.entropy;
      out.lse = x.lse;
    }
    if (batch[i].next_soft != nullptr && s.rows > 0) {
      std::memcpy(batch[i].next_soft, soft_host_.data() + size_t(s.row0) * D,
                  size_t(s.rows) * D * sizeof(float));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SoftEmbedding(const float* probs, int rows, float* soft) {
  const auto lock = Lock();
  const int D = c_.hidden_size, V = c_.vocab_size;
  if (rows <= 0) return absl::OkStatus();
  DGSERVE_RETURN_IF_ERROR(logits_.UploadAsync(probs, size_t(rows) * V, stream_));
  DGSERVE_RETURN_IF_ERROR(probs_bf16_.Ensure(size_t(rows) * V));
  DGSERVE_RETURN_IF_ERROR(soft_.Ensure(size_t(rows) * D));
  DGSERVE_RETURN_IF_ERROR(
      cuda::FloatToBf16(logits_.get(), int64_t(rows) * V, probs_bf16_.get(), stream_));
  DGSERVE_RETURN_IF_ERROR(SoftGemm(probs_bf16_.get(), rows, soft_.get()));
  return DownloadNow(soft, soft_.get(), size_t(rows) * D * sizeof(float));
}

}  // namespace cuda_internal

using cuda::CudaCheck;
using cuda_internal::CudaBackend;

namespace {
// Makes options.device current; its free memory in bytes before a backend allocates on it (the
// difference after is the backend's own: CudaBackend::SetKvPoolBound).
absl::StatusOr<size_t> SelectDevice(const CudaBackendOptions& options) {
  const int devices = cuda::DeviceCount();
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device found");
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (", devices, " found)"));
  }
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(options.device), "cudaSetDevice"));
  size_t free_bytes = 0, total = 0;
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaMemGetInfo(&free_bytes, &total), "cudaMemGetInfo"));
  return free_bytes;
}
}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(const ModelConfig& config,
                                                                const ModelWeights& weights,
                                                                const CudaBackendOptions& options) {
  DGSERVE_ASSIGN_OR_RETURN(const size_t free_before, SelectDevice(options));
  auto backend = std::make_unique<CudaBackend>(config, options);
  DGSERVE_RETURN_IF_ERROR(backend->Init(weights));
  DGSERVE_RETURN_IF_ERROR(backend->SetKvPoolBound(free_before));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackendSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaBackendOptions& options) {
  DGSERVE_ASSIGN_OR_RETURN(const size_t free_before, SelectDevice(options));
  auto backend = std::make_unique<CudaBackend>(config, options);
  // Norms, scales and scalars from the host (small); the matrices are made on the device.
  DGSERVE_RETURN_IF_ERROR(backend->Init(SyntheticModelWeights(config, seed, /*matrices=*/false)));
  DGSERVE_RETURN_IF_ERROR(backend->InitSyntheticMatrices(seed));
  DGSERVE_RETURN_IF_ERROR(backend->SetKvPoolBound(free_before));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

int64_t CudaKvBytesPerSequence(const ModelConfig& config, int context_tokens,
                               const CudaBackendOptions& options) {
  if (context_tokens <= 0) return 0;
  int64_t bytes = 0;
  for (int l = 0; l < config.num_layers; ++l) {
    const int64_t kvw = int64_t(config.KvHeads(l)) * config.HeadDim(l);
    int rows = options.sliding_kv_ring
                   ? cuda_internal::KvMirrorRows(config, l, context_tokens, config.sliding_window)
                   : context_tokens;
    if (options.kv_block_size > 0) {
      // Whole blocks: every position's on full layers, the window's on sliding ones.
      const int B = options.kv_block_size, W = config.sliding_window;
      const int keep = !config.IsFull(l) && W > 0 && options.sliding_kv_ring
                           ? std::max(0, context_tokens - (W - 1))
                           : 0;
      rows = int((int64_t(context_tokens) + B - 1) / B - keep / B) * B;
    }
    const int64_t element = cuda_internal::KvMirrorBf16(config, options, l)
                                ? int64_t(sizeof(uint16_t))
                                : int64_t(sizeof(float));
    bytes += 2 * int64_t(rows) * kvw * element;
  }
  return bytes;
}

std::optional<int64_t> CudaKvMirrorBytes(const ModelBackend& backend, const KvCache& kv) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->mirror_bytes(kv);
}

std::optional<CudaKvPoolStats> GetCudaKvPoolStats(const ModelBackend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->kv_pool_stats();
}

std::optional<CudaGraphStats> GetCudaGraphStats(const ModelBackend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->graph_stats();
}

std::optional<CudaKvCopyStats> GetCudaKvCopyStats(const ModelBackend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->kv_copy_stats();
}

std::optional<CudaPhaseTimes> LastCudaPhaseTimes(const ModelBackend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->last_phase_times();
}

}  // namespace dgserve