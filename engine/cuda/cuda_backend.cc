// CUDA implementation of ModelBackend (see cuda_backend.h): spec §3 forward math and the §4.2
// vocabulary step, structured as engine/cpu/cpu_backend.cc.
#include "engine/cuda/cuda_backend.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_backend_kernels.h"
#include "engine/cuda/cuda_gemm.h"
#include "engine/cuda/cuda_memory.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/cuda_ops.h"
#include "engine/cuda/cuda_profile.h"
#include "engine/cuda/cuda_synthetic.h"
#include "engine/cuda/cuda_vocab.h"
#include "engine/model/model_math.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/synthetic_weights.h"

namespace dgserve {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

using cuda::CublasCheck;
using cuda::CudaCheck;
using cuda::DeviceArray;
using cuda::Download;
using cuda::UploadBf16;
using cuda::UploadFloat;

enum class PassKind { kEncoder, kDecoder };

// The phases of CudaPhaseTimes (cuda_backend.h).
enum class Phase { kNone, kAttention, kMoe, kDense, kVocab };

// CUDA-event brackets per phase for one DenoiseStep (CudaBackendOptions::phase_timing). As the
// launch observer of cuda_profile.h it opens a bracket lazily at the phase's first launch and
// closes it before a blocking call, so host time between launches of a phase that waits on the
// host (today's router round trip) is not counted in the phase.
class PhaseTimer final : public cuda::LaunchObserver {
 public:
  PhaseTimer() = default;
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
  ~PhaseTimer() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void Start() {
    active_ = true;
    used_ = 0;
    brackets_.clear();
    phase_ = Phase::kNone;
    open_ = false;
    error_ = absl::OkStatus();
    cuda::SetLaunchObserver(this);
  }
  void Enter(Phase p) {
    if (!active_) return;
    Close();
    phase_ = p;
  }
  void Leave() {
    if (!active_) return;
    Close();
    phase_ = Phase::kNone;
  }
  // Stops observing; the sums of the brackets once the last event has completed.
  absl::StatusOr<CudaPhaseTimes> Finish() {
    Close();
    cuda::SetLaunchObserver(nullptr);
    active_ = false;
    DGSERVE_RETURN_IF_ERROR(error_);
    CudaPhaseTimes t;
    if (used_ > 0) {
      DGSERVE_RETURN_IF_ERROR(
          CudaCheck(cudaEventSynchronize(events_[used_ - 1]), "cudaEventSynchronize (phases)"));
    }
    for (const Bracket& b : brackets_) {
      float ms = 0;
      DGSERVE_RETURN_IF_ERROR(CudaCheck(
          cudaEventElapsedTime(&ms, events_[b.start], events_[b.end]), "cudaEventElapsedTime"));
      double* sum = b.phase == Phase::kAttention ? &t.attention_ms
                    : b.phase == Phase::kMoe     ? &t.moe_ms
                    : b.phase == Phase::kDense   ? &t.dense_ms
                                                 : &t.vocab_ms;
      *sum += ms;
    }
    t.brackets = int(brackets_.size());
    return t;
  }
  // Stops observing without reading the events (a failed step).
  void Abort() {
    cuda::SetLaunchObserver(nullptr);
    active_ = false;
  }

  void BeforeLaunch() override {
    if (phase_ == Phase::kNone || open_) return;
    if (Record(&start_)) open_ = true;
  }
  void BeforeBlocking() override { Close(); }

 private:
  struct Bracket {
    Phase phase;
    int start, end;
  };
  void Close() {
    if (!open_) return;
    open_ = false;
    int end = 0;
    if (Record(&end)) brackets_.push_back({phase_, start_, end});
  }
  bool Record(int* index) {
    if (!error_.ok()) return false;
    if (used_ == int(events_.size())) {
      cudaEvent_t e = nullptr;
      error_ =
          CudaCheck(cudaEventCreateWithFlags(&e, cudaEventDefault), "cudaEventCreate (phases)");
      if (!error_.ok()) return false;
      events_.push_back(e);
    }
    error_ = CudaCheck(cudaEventRecord(events_[used_], nullptr), "cudaEventRecord (phases)");
    if (!error_.ok()) return false;
    *index = used_++;
    return true;
  }

  bool active_ = false, open_ = false;
  Phase phase_ = Phase::kNone;
  int start_ = 0, used_ = 0;
  std::vector<cudaEvent_t> events_;  // reused across steps
  std::vector<Bracket> brackets_;
  absl::Status error_;
};

// Enters a phase for the scope (no-op when the timer is not running).
class PhaseScope {
 public:
  PhaseScope(PhaseTimer& t, Phase p) : t_(t) { t_.Enter(p); }
  ~PhaseScope() { t_.Leave(); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseTimer& t_;
};

// One layer's weights on the device (see LayerWeights for shapes).
struct DeviceLayer {
  DeviceArray<float> input_layernorm, q_norm, k_norm, post_attention_layernorm,
      pre_feedforward_layernorm, post_feedforward_layernorm_1, router_scale,
      pre_feedforward_layernorm_2, post_feedforward_layernorm_2, post_feedforward_layernorm;
  DeviceArray<uint16_t> q_proj, k_proj, v_proj, o_proj, mlp_gate_proj, mlp_up_proj, mlp_down_proj,
      experts_gate_up_proj, experts_down_proj;
  DeviceArray<float> router_proj;       // [E, D] float32 (the top-k choice is sensitive)
  DeviceArray<uint16_t> router_proj_bf16;  // the same bf16 values, for DenseLinear
  DeviceArray<float> per_expert_scale;  // [E]
  float decoder_layer_scalar = 1, encoder_layer_scalar = 1;
};

// The device mirror of one host KvCache (see cuda_backend.h).
struct KvMirror {
  std::vector<DeviceArray<float>> k, v;    // per layer [capacity, kvw]
  int capacity = 0;                        // positions allocated
  int synced = 0;                          // positions [visible lo, synced) are on the device
  std::vector<float> first_row, last_row;  // fingerprint: K rows 0 and synced−1 of layer fp
  uint64_t last_use = 0;
};

// One sequence inside a batched pass: rows [row0, row0 + rows) of the stacked activations (no
// padding on the GPU), positions pos0 …, its device KV mirror.
struct Segment {
  int row0 = 0, rows = 0, pos0 = 0;
  const KvCache* kv = nullptr;
  KvCache* kv_write = nullptr;  // encoder only
  KvMirror* mirror = nullptr;
};

class CudaBackend final : public ModelBackend {
 public:
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options)
      : c_(config), options_(options), cublas_(options.gemm_input) {}
  ~CudaBackend() override {
    mirrors_.clear();
    if (handle_ != nullptr) cublasDestroy(handle_);
  }

  absl::Status Init(const ModelWeights& w);
  // Allocates every matrix of the model on the device and fills it with the synthetic weights
  // of `seed` (after Init with SyntheticModelWeights(c, seed, /*matrices=*/false)).
  absl::Status InitSyntheticMatrices(uint64_t seed);
  std::optional<CudaPhaseTimes> last_phase_times() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_phases_;
  }

  const ModelConfig& config() const override { return c_; }
  absl::Status Encode(std::span<const EncodeInput> batch) override;
  absl::Status Decode(std::span<const DecodeInput> batch) override;
  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override;
  absl::Status DenoiseStepLocked(std::span<const DenoiseStepInput> batch);
  absl::Status SoftEmbedding(const float* probs, int rows, float* soft) override;
  DecodeTimings last_decode_timings() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return timings_;
  }

 private:
  struct CanvasInput {
    std::span<const int32_t> canvas;
    const float* sc_soft;
    const KvCache* kv;
  };
  absl::Status CheckTokens(std::span<const int32_t> ids) const;
  // The mirror of `kv`, synced with its committed rows and with room for `extra` more positions.
  absl::StatusOr<KvMirror*> SyncMirror(const KvCache& kv, int extra);
  void Fingerprint(const KvCache& kv, KvMirror* m) const;
  // Decoder body (spec §3.5 steps 1–4, final norm) into h_ [R, D]; fills segs; returns R.
  absl::StatusOr<int> Body(std::span<const CanvasInput> batch, std::vector<Segment>* segs);
  absl::Status Layer(int l, PassKind kind, std::span<const Segment> segs, int R);
  // Whether layer l's decoder attention runs on TensorCoreCanvasAttention, and the device table of
  // every such layer's canvases (canvas_table_: num_layers × canvas_segments_ entries).
  bool TensorCoreCanvas(int l) const;
  absl::Status UploadCanvasTable(std::span<const Segment> segs);
  absl::Status Moe(int l, const float* h1, int R, float* m);
  // out[R, D] = down(gelu(x·gateᵀ) ⊙ x·upᵀ).
  // y[R, out] = x[R, in] · Wᵀ for a bf16 weight W [out, in]: cuda::DenseLinear or cuBLAS
  // (options_.batch_invariant_projections).
  absl::Status Linear(const float* x, const uint16_t* w, int R, int in, int out, float* y);
  absl::Status GatedMlp(const float* x, int R, const uint16_t* gate, const uint16_t* up,
                        const uint16_t* down, int width, float* out);
  // soft[rows, D] = probs_bf16[rows, V] · E · bf16(√D) (one GEMM, bf16 in, float32 out).
  absl::Status SoftGemm(const uint16_t* probs_bf16, int rows, float* soft);

  // Every public call holds mu_ (scratch buffers and mirrors are shared) and selects the device.
  std::unique_lock<std::mutex> Lock() {
    std::unique_lock<std::mutex> lock(mu_);
    cudaSetDevice(options_.device);
    return lock;
  }

  const ModelConfig c_;
  const CudaBackendOptions options_;
  mutable std::mutex mu_;
  cuda::CublasContext cublas_;
  cublasHandle_t handle_ = nullptr;  // float32 router GEMM and the soft-embedding GEMM
  DeviceArray<uint16_t> embed_;      // [V, D] bf16 (embedding and tied LM head)
  DeviceArray<float> final_norm_, sc_pre_norm_;
  DeviceArray<uint16_t> sc_gate_, sc_up_, sc_down_;
  std::vector<DeviceLayer> layers_;
  DeviceArray<float> rope_sliding_, rope_full_;
  int fingerprint_layer_ = 0;  // first full layer (rows 0 … n−1 all kept), else 0

  std::unordered_map<const KvCache*, std::unique_ptr<KvMirror>> mirrors_;
  uint64_t use_clock_ = 0;
  uint64_t pass_start_ = 0;  // use_clock_ value of the first mirror use of the current pass

  // Scratch activations (grown on demand).
  DeviceArray<float> h_, a_, q_, k_, v_, attn_, o_, dense_, moe_, g_, u_, r_, scores_, xe_, act_,
      y_, weight_, slot_weight_, sc_in_, logits_, temps_, uniforms_, soft_;
  DeviceArray<int32_t> ids_, positions_, expert_, offsets_, gather_, slot_, mask_index_;
  DeviceArray<uint64_t> mask_table_;  // the distinct canvas-template masks of a step
  DeviceArray<uint16_t> probs_bf16_;
  DeviceArray<unsigned char> vocab_scratch_;      // FusedVocabStep's tile partials
  DeviceArray<float> tile_norm_max_, skip_mass_;  // the sparse self-conditioning plan's inputs
  DeviceArray<cuda::VocabRowResult> results_;
  std::vector<cuda::CanvasSegment> canvas_table_host_;
  DeviceArray<cuda::CanvasSegment> canvas_table_;
  int canvas_segments_ = 0;
  std::vector<float> host_k_, host_v_, host_stage_;
  DecodeTimings timings_;
  PhaseTimer phases_;
  std::optional<CudaPhaseTimes> last_phases_;
};

absl::Status CudaBackend::Init(const ModelWeights& w) {
  const int L = c_.num_layers;
  if (int(w.layers.size()) != L) return absl::InvalidArgumentError("weights: layer count mismatch");
  DGSERVE_RETURN_IF_ERROR(CublasCheck(cublasCreate(&handle_), "cublasCreate"));
  DGSERVE_RETURN_IF_ERROR(UploadBf16(w.embed_tokens, &embed_));
  DGSERVE_RETURN_IF_ERROR(final_norm_.Upload(w.final_norm));
  DGSERVE_RETURN_IF_ERROR(sc_pre_norm_.Upload(w.sc_pre_norm));
  DGSERVE_RETURN_IF_ERROR(UploadBf16(w.sc_gate_proj, &sc_gate_));
  DGSERVE_RETURN_IF_ERROR(UploadBf16(w.sc_up_proj, &sc_up_));
  DGSERVE_RETURN_IF_ERROR(UploadBf16(w.sc_down_proj, &sc_down_));
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
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.q_proj, &d.q_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.k_proj, &d.k_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.v_proj, &d.v_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.o_proj, &d.o_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.mlp_gate_proj, &d.mlp_gate_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.mlp_up_proj, &d.mlp_up_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.mlp_down_proj, &d.mlp_down_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.experts_gate_up_proj, &d.experts_gate_up_proj));
    DGSERVE_RETURN_IF_ERROR(UploadBf16(s.experts_down_proj, &d.experts_down_proj));
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
  for (int l = 0; l < L; ++l) {
    if (c_.IsFull(l)) {
      fingerprint_layer_ = l;
      break;
    }
  }
  cuda::NoteSync();
  return CudaCheck(cudaDeviceSynchronize(), "upload weights");
}

absl::Status CudaBackend::InitSyntheticMatrices(uint64_t seed) {
  std::unordered_map<std::string, DeviceArray<uint16_t>*> bf16;
  std::unordered_map<std::string, DeviceArray<float>*> f32;
  const std::string p = "model.decoder.";
  bf16[p + "embed_tokens.weight"] = &embed_;
  bf16[p + "self_conditioning.gate_proj.weight"] = &sc_gate_;
  bf16[p + "self_conditioning.up_proj.weight"] = &sc_up_;
  bf16[p + "self_conditioning.down_proj.weight"] = &sc_down_;
  for (int l = 0; l < c_.num_layers; ++l) {
    DeviceLayer& d = layers_[l];
    const std::string q = absl::StrCat(p, "layers.", l, ".");
    bf16[q + "self_attn.q_proj.weight"] = &d.q_proj;
    bf16[q + "self_attn.k_proj.weight"] = &d.k_proj;
    bf16[q + "self_attn.v_proj.weight"] = &d.v_proj;
    bf16[q + "self_attn.o_proj.weight"] = &d.o_proj;
    bf16[q + "mlp.gate_proj.weight"] = &d.mlp_gate_proj;
    bf16[q + "mlp.up_proj.weight"] = &d.mlp_up_proj;
    bf16[q + "mlp.down_proj.weight"] = &d.mlp_down_proj;
    bf16[q + "experts.gate_up_proj"] = &d.experts_gate_up_proj;
    bf16[q + "experts.down_proj"] = &d.experts_down_proj;
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

void CudaBackend::Fingerprint(const KvCache& kv, KvMirror* m) const {
  const int l = fingerprint_layer_, w = c_.KvHeads(l) * c_.HeadDim(l);
  m->first_row.clear();
  m->last_row.clear();
  if (m->synced == 0) return;
  if (c_.IsFull(l)) m->first_row.assign(kv.KeyRow(l, 0), kv.KeyRow(l, 0) + w);
  const float* last = kv.KeyRow(l, m->synced - 1);
  m->last_row.assign(last, last + w);
}

absl::StatusOr<KvMirror*> CudaBackend::SyncMirror(const KvCache& kv, int extra) {
  auto it = mirrors_.find(&kv);
  if (it == mirrors_.end()) {
    if (int(mirrors_.size()) >= std::max(1, options_.max_kv_mirrors)) {
      // Least recently used, never one already used by the current pass (its segments hold
      // pointers to it); with none evictable the map grows past the limit for this pass.
      auto lru = mirrors_.end();
      for (auto j = mirrors_.begin(); j != mirrors_.end(); ++j) {
        if (j->second->last_use >= pass_start_) continue;
        if (lru == mirrors_.end() || j->second->last_use < lru->second->last_use) lru = j;
      }
      if (lru != mirrors_.end()) mirrors_.erase(lru);
    }
    auto m = std::make_unique<KvMirror>();
    m->k.resize(c_.num_layers);
    m->v.resize(c_.num_layers);
    it = mirrors_.emplace(&kv, std::move(m)).first;
  }
  KvMirror* m = it->second.get();
  m->last_use = ++use_clock_;
  const int n = kv.num_tokens();
  // Still the same sequence? Otherwise everything visible is uploaded again.
  if (m->synced > n) m->synced = 0;
  if (m->synced > 0) {
    const int l = fingerprint_layer_, w = c_.KvHeads(l) * c_.HeadDim(l);
    const bool same =
        (m->first_row.empty() ||
         std::memcmp(m->first_row.data(), kv.KeyRow(l, 0), w * sizeof(float)) == 0) &&
        std::memcmp(m->last_row.data(), kv.KeyRow(l, m->synced - 1), w * sizeof(float)) == 0;
    if (!same) m->synced = 0;
  }
  const int need = n + extra;
  if (need > m->capacity) {
    const int cap = std::max(need, std::max(64, m->capacity * 2));
    for (int l = 0; l < c_.num_layers; ++l) {
      const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
      DGSERVE_RETURN_IF_ERROR(m->k[l].Grow(size_t(cap) * w, size_t(m->synced) * w));
      DGSERVE_RETURN_IF_ERROR(m->v[l].Grow(size_t(cap) * w, size_t(m->synced) * w));
    }
    m->capacity = cap;
  }
  if (m->synced < n) {
    const int W = c_.sliding_window;
    for (int l = 0; l < c_.num_layers; ++l) {
      // Sliding layers only guarantee (and only read) the last W−1 committed rows.
      const int lo = c_.IsFull(l) ? 0 : std::max(0, n - (W - 1));
      const int from = std::max(m->synced, lo);
      if (from >= n) continue;
      const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
      for (int which = 0; which < 2; ++which) {
        host_stage_.resize(size_t(n - from) * w);
        for (int p = from; p < n; ++p) {
          const float* row = which == 0 ? kv.KeyRow(l, p) : kv.ValueRow(l, p);
          std::memcpy(&host_stage_[size_t(p - from) * w], row, w * sizeof(float));
        }
        float* dst = (which == 0 ? m->k[l] : m->v[l]).get() + size_t(from) * w;
        cuda::NoteUpload();
        DGSERVE_RETURN_IF_ERROR(
            CudaCheck(cudaMemcpy(dst, host_stage_.data(), host_stage_.size() * sizeof(float),
                                 cudaMemcpyHostToDevice),
                      "cudaMemcpy (KV upload)"));
      }
    }
    m->synced = n;
    Fingerprint(kv, m);
  }
  return m;
}

absl::Status CudaBackend::Linear(const float* x, const uint16_t* w, int R, int in, int out,
                                 float* y) {
  if (options_.batch_invariant_projections) {
    return cuda::DenseLinear(x, w, R, in, out, cublas_.input(), y);
  }
  return cublas_.Linear(x, w, R, in, out, y);
}

absl::Status CudaBackend::GatedMlp(const float* x, int R, const uint16_t* gate, const uint16_t* up,
                                   const uint16_t* down, int width, float* out) {
  const int D = c_.hidden_size;
  DGSERVE_RETURN_IF_ERROR(g_.Ensure(size_t(R) * width));
  DGSERVE_RETURN_IF_ERROR(u_.Ensure(size_t(R) * width));
  DGSERVE_RETURN_IF_ERROR(Linear(x, gate, R, D, width, g_.get()));
  DGSERVE_RETURN_IF_ERROR(Linear(x, up, R, D, width, u_.get()));
  DGSERVE_RETURN_IF_ERROR(cuda::GeluGate(g_.get(), u_.get(), int64_t(R) * width, g_.get()));
  return Linear(g_.get(), down, R, width, D, out);
}

bool CudaBackend::TensorCoreCanvas(int l) const {
  const int hd = c_.HeadDim(l);
  return options_.tensor_core_attention && hd % 32 == 0 && hd <= cuda::kMaxAttentionHeadDim;
}

absl::Status CudaBackend::UploadCanvasTable(std::span<const Segment> segs) {
  canvas_table_host_.clear();
  canvas_segments_ = 0;
  if (!options_.tensor_core_attention) return absl::OkStatus();
  for (const Segment& s : segs) canvas_segments_ += s.rows > 0;
  bool any = false;
  for (int l = 0; l < c_.num_layers; ++l) {
    if (!TensorCoreCanvas(l)) {
      canvas_table_host_.resize(canvas_table_host_.size() + canvas_segments_);
      continue;
    }
    any = true;
    const int window = c_.IsFull(l) ? 0 : c_.sliding_window;
    for (const Segment& s : segs) {
      if (s.rows == 0) continue;
      cuda::CanvasSegment t;
      t.ctx_k = s.mirror->k[l].get();  // the mirror's rows from position 0
      t.ctx_v = s.mirror->v[l].get();
      t.row0 = s.row0;
      t.rows = s.rows;
      t.ctx_tokens = s.pos0;
      t.ctx_first = cuda::CanvasWindowStart(s.pos0, window);
      canvas_table_host_.push_back(t);
    }
  }
  if (!any || canvas_segments_ == 0) return absl::OkStatus();
  return canvas_table_.Upload(canvas_table_host_);
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
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, lw.input_layernorm.get(), R, D, eps, a));
  DGSERVE_RETURN_IF_ERROR(Linear(a, lw.q_proj.get(), R, D, nh * hd, q));
  DGSERVE_RETURN_IF_ERROR(Linear(a, lw.k_proj.get(), R, D, kvw, k));
  if (full) {
    // V = rms_noscale(raw k projection) on full layers (spec §3.3).
    cuda::NoteDeviceCopy();
    DGSERVE_RETURN_IF_ERROR(CudaCheck(
        cudaMemcpy(v, k, size_t(R) * kvw * sizeof(float), cudaMemcpyDeviceToDevice), "copy k→v"));
  } else {
    DGSERVE_RETURN_IF_ERROR(Linear(a, lw.v_proj.get(), R, D, kvw, v));
  }
  phases_.Enter(Phase::kAttention);
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(q, lw.q_norm.get(), R * nh, hd, eps, q));
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(k, lw.k_norm.get(), R * nkv, hd, eps, k));
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(v, nullptr, R * nkv, hd, eps, v));
  const float* inv_freq = full ? rope_full_.get() : rope_sliding_.get();
  DGSERVE_RETURN_IF_ERROR(cuda::ApplyRope(q, R, nh, hd, positions_.get(), inv_freq));
  DGSERVE_RETURN_IF_ERROR(cuda::ApplyRope(k, R, nkv, hd, positions_.get(), inv_freq));

  if (kind == PassKind::kEncoder) {
    // New K/V rows: into the device mirror and (authoritative) the host cache.
    host_k_.resize(size_t(R) * kvw);
    host_v_.resize(size_t(R) * kvw);
    DGSERVE_RETURN_IF_ERROR(Download(host_k_.data(), k, host_k_.size() * sizeof(float)));
    DGSERVE_RETURN_IF_ERROR(Download(host_v_.data(), v, host_v_.size() * sizeof(float)));
    for (const Segment& s : segs) {
      const size_t bytes = size_t(s.rows) * kvw * sizeof(float);
      cuda::NoteDeviceCopy();
      DGSERVE_RETURN_IF_ERROR(
          CudaCheck(cudaMemcpy(s.mirror->k[l].get() + size_t(s.pos0) * kvw,
                               k + size_t(s.row0) * kvw, bytes, cudaMemcpyDeviceToDevice),
                    "cudaMemcpy (KV append)"));
      cuda::NoteDeviceCopy();
      DGSERVE_RETURN_IF_ERROR(
          CudaCheck(cudaMemcpy(s.mirror->v[l].get() + size_t(s.pos0) * kvw,
                               v + size_t(s.row0) * kvw, bytes, cudaMemcpyDeviceToDevice),
                    "cudaMemcpy (KV append)"));
      for (int r = 0; r < s.rows; ++r) {
        const size_t src = size_t(s.row0 + r) * kvw;
        std::memcpy(s.kv_write->MutableKeyRow(l, s.pos0 + r), &host_k_[src], sizeof(float) * kvw);
        std::memcpy(s.kv_write->MutableValueRow(l, s.pos0 + r), &host_v_[src], sizeof(float) * kvw);
      }
    }
  }
  // Decoder on tensor cores: every canvas in one launch (the table of UploadCanvasTable).
  const bool tc = kind == PassKind::kDecoder && TensorCoreCanvas(l);
  if (tc && canvas_segments_ > 0) {
    DGSERVE_RETURN_IF_ERROR(
        cuda::TensorCoreCanvasAttention(q, k, v, canvas_table_.get() + size_t(l) * canvas_segments_,
                                        canvas_segments_, R, nh, nkv, hd, attn_.get()));
  }
  // Attention per segment: context = the mirror's visible rows before pos0 (spec §3.4 / §3.5).
  const int W = c_.sliding_window;
  for (const Segment& s : segs) {
    if (tc) break;
    if (s.rows == 0) continue;
    const int first = full ? 0 : std::max(0, s.pos0 - (W - 1));
    cuda::KvContext ctx;
    ctx.tokens = s.pos0 - first;
    if (ctx.tokens > 0) {
      ctx.k = s.mirror->k[l].get() + size_t(first) * kvw;
      ctx.v = s.mirror->v[l].get() + size_t(first) * kvw;
    }
    const size_t qo = size_t(s.row0) * nh * hd, ko = size_t(s.row0) * kvw;
    const int window = full ? 0 : W;
    if (kind == PassKind::kEncoder) {
      DGSERVE_RETURN_IF_ERROR(cuda::PrefillAttention(q + qo, k + ko, v + ko, s.rows, ctx, nh, nkv,
                                                     hd, window, attn_.get() + qo));
    } else {
      DGSERVE_RETURN_IF_ERROR(cuda::CanvasAttention(q + qo, k + ko, v + ko, s.rows, ctx, nh, nkv,
                                                    hd, window, attn_.get() + qo));
    }
  }
  phases_.Enter(Phase::kDense);
  float* o = o_.get();
  DGSERVE_RETURN_IF_ERROR(Linear(attn_.get(), lw.o_proj.get(), R, nh * hd, D, o));
  // 3. h1 = h + post_attention_layernorm(o).
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(o, lw.post_attention_layernorm.get(), R, D, eps, o));
  DGSERVE_RETURN_IF_ERROR(cuda::AddInPlace(h, o, int64_t(R) * D));
  const float* h1 = h;
  // 4. Dense branch.
  float* dense = dense_.get();
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h1, lw.pre_feedforward_layernorm.get(), R, D, eps, a));
  DGSERVE_RETURN_IF_ERROR(GatedMlp(a, R, lw.mlp_gate_proj.get(), lw.mlp_up_proj.get(),
                                   lw.mlp_down_proj.get(), c_.intermediate_size, dense));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(dense, lw.post_feedforward_layernorm_1.get(), R, D, eps, dense));
  // 5. MoE branch.
  phases_.Enter(Phase::kMoe);
  float* moe = moe_.get();
  DGSERVE_RETURN_IF_ERROR(Moe(l, h1, R, moe));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(moe, lw.post_feedforward_layernorm_2.get(), R, D, eps, moe));
  // 6. h2 = h1 + post_feedforward_layernorm(d + m); 7. whole stream × layer_scalar.
  phases_.Enter(Phase::kDense);
  DGSERVE_RETURN_IF_ERROR(cuda::AddInPlace(dense, moe, int64_t(R) * D));
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(dense, lw.post_feedforward_layernorm.get(), R, D, eps, dense));
  const float scalar =
      kind == PassKind::kEncoder ? lw.encoder_layer_scalar : lw.decoder_layer_scalar;
  return cuda::AddScale(h, dense, scalar, int64_t(R) * D);
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
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h1, lw.router_scale.get(), R, D, eps, r_.get()));
  const float router_scale = 1.0f / std::sqrt(float(D));
  DGSERVE_RETURN_IF_ERROR(cublas_.input() == cuda::GemmInput::kBf16
                              ? cuda::ScaleAndRoundToBf16(r_.get(), int64_t(R) * D, router_scale)
                              : cuda::Scale(r_.get(), int64_t(R) * D, router_scale));
  if (options_.batch_invariant_projections) {
    // The weights are bf16 values and the bf16 mode's input too: exact products, float32 sums in
    // DenseLinear's fixed order (the float32 mode's input split exactly into three terms).
    DGSERVE_RETURN_IF_ERROR(cuda::DenseLinear(r_.get(), lw.router_proj_bf16.get(), R, D, E,
                                              cublas_.input(), scores_.get()));
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
                                         expert_.get(), weight_.get()));
  DGSERVE_RETURN_IF_ERROR(cuda::MoeGroup(expert_.get(), weight_.get(), R, E, K, offsets_.get(),
                                         gather_.get(), slot_.get(), slot_weight_.get()));
  // Experts on pre_feedforward_layernorm_2(h1): one grouped GEMM per projection (gather in the
  // A load, gelu(g)·u and the routing weight in the epilogues), then the per-row sum in
  // ascending expert order (the CPU's order).
  DGSERVE_RETURN_IF_ERROR(
      cuda::RmsNorm(h1, lw.pre_feedforward_layernorm_2.get(), R, D, eps, xe_.get()));
  const cuda::GemmInput input = cublas_.input();
  DGSERVE_RETURN_IF_ERROR(cuda::MoeGateUp(xe_.get(), gather_.get(), offsets_.get(),
                                          lw.experts_gate_up_proj.get(), R, K, E, D, F, input,
                                          act_.get()));
  DGSERVE_RETURN_IF_ERROR(cuda::MoeDown(act_.get(), offsets_.get(), slot_weight_.get(),
                                        lw.experts_down_proj.get(), R, K, E, F, D, input,
                                        y_.get()));
  return cuda::MoeSum(y_.get(), slot_.get(), R, K, D, m);
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
  std::vector<int32_t> ids, positions;
  int R = 0;
  pass_start_ = use_clock_ + 1;
  for (const EncodeInput& in : batch) {
    DGSERVE_RETURN_IF_ERROR(in.kv->Reserve(in.tokens.size()));
    Segment s;
    s.row0 = R;
    s.rows = in.tokens.size();
    s.pos0 = in.kv->num_tokens();
    s.kv = in.kv;
    s.kv_write = in.kv;
    DGSERVE_ASSIGN_OR_RETURN(s.mirror, SyncMirror(*in.kv, s.rows));
    segs.push_back(s);
    R += s.rows;
    ids.insert(ids.end(), in.tokens.begin(), in.tokens.end());
    for (int r = 0; r < s.rows; ++r) positions.push_back(s.pos0 + r);
  }
  if (R == 0) return absl::OkStatus();
  DGSERVE_ENSURE_PASS_SCRATCH(R);
  DGSERVE_RETURN_IF_ERROR(ids_.Upload(ids));
  DGSERVE_RETURN_IF_ERROR(positions_.Upload(positions));
  DGSERVE_RETURN_IF_ERROR(
      cuda::EmbedRows(ids_.get(), embed_.get(), R, D, c_.EmbedScale(), h_.get()));
  for (int l = 0; l < c_.num_layers; ++l) {
    DGSERVE_RETURN_IF_ERROR(Layer(l, PassKind::kEncoder, segs, R));
  }
  cuda::NoteSync();
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaDeviceSynchronize(), "Encode"));
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].kv->Commit(segs[i].rows);
    segs[i].mirror->synced = segs[i].pos0 + segs[i].rows;
    Fingerprint(*batch[i].kv, segs[i].mirror);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> CudaBackend::Body(std::span<const CanvasInput> batch,
                                      std::vector<Segment>* segs) {
  const int D = c_.hidden_size, I = c_.intermediate_size;
  const float eps = c_.rms_norm_eps;
  segs->clear();
  for (const CanvasInput& in : batch) {
    if (in.kv == nullptr) return absl::InvalidArgumentError("decoder input without a KV cache");
    DGSERVE_RETURN_IF_ERROR(CheckTokens(in.canvas));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> ids, positions;
  int R = 0;
  pass_start_ = use_clock_ + 1;
  for (const CanvasInput& in : batch) {
    Segment s;
    s.row0 = R;
    s.rows = in.canvas.size();
    s.pos0 = in.kv->num_tokens();
    s.kv = in.kv;
    DGSERVE_ASSIGN_OR_RETURN(s.mirror, SyncMirror(*in.kv, 0));
    segs->push_back(s);
    R += s.rows;
    ids.insert(ids.end(), in.canvas.begin(), in.canvas.end());
    for (int r = 0; r < s.rows; ++r) positions.push_back(s.pos0 + r);
  }
  if (R == 0) return 0;
  DGSERVE_ENSURE_PASS_SCRATCH(R);
  DGSERVE_RETURN_IF_ERROR(ids_.Upload(ids));
  DGSERVE_RETURN_IF_ERROR(positions_.Upload(positions));
  float* h = h_.get();
  // Canvas input (spec §3.5 steps 1–3): x0 = rms_noscale(E[c]·s + SC(soft)).
  phases_.Enter(Phase::kDense);
  DGSERVE_RETURN_IF_ERROR(cuda::EmbedRows(ids_.get(), embed_.get(), R, D, c_.EmbedScale(), h));
  for (size_t i = 0; i < batch.size(); ++i) {
    const Segment& s = (*segs)[i];
    if (batch[i].sc_soft == nullptr || s.rows == 0) continue;
    DGSERVE_RETURN_IF_ERROR(sc_in_.Upload(batch[i].sc_soft, size_t(s.rows) * D));
    float* u = a_.get();  // free until the layers run
    float* sig = o_.get();
    DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(sc_in_.get(), sc_pre_norm_.get(), s.rows, D, eps, u));
    DGSERVE_RETURN_IF_ERROR(
        GatedMlp(u, s.rows, sc_gate_.get(), sc_up_.get(), sc_down_.get(), I, sig));
    DGSERVE_RETURN_IF_ERROR(cuda::AddInPlace(h + size_t(s.row0) * D, sig, int64_t(s.rows) * D));
  }
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, nullptr, R, D, eps, h));
  DGSERVE_RETURN_IF_ERROR(UploadCanvasTable(*segs));
  for (int l = 0; l < c_.num_layers; ++l) {
    DGSERVE_RETURN_IF_ERROR(Layer(l, PassKind::kDecoder, *segs, R));
  }
  DGSERVE_RETURN_IF_ERROR(cuda::RmsNorm(h, final_norm_.get(), R, D, eps, h));
  cuda::NoteSync();
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaDeviceSynchronize(), "decoder body"));
  phases_.Leave();
  timings_.body_seconds = SecondsSince(t0);
  return R;
}

absl::Status CudaBackend::Decode(std::span<const DecodeInput> batch) {
  const auto lock = Lock();
  const int D = c_.hidden_size, V = c_.vocab_size;
  std::vector<CanvasInput> canvases;
  for (const DecodeInput& in : batch) {
    if (in.logits == nullptr) return absl::InvalidArgumentError("decoder input without logits");
    canvases.push_back({in.canvas, in.sc_soft, in.kv});
  }
  std::vector<Segment> segs;
  DGSERVE_ASSIGN_OR_RETURN(const int R, Body(canvases, &segs));
  const auto t1 = std::chrono::steady_clock::now();
  if (R > 0) {
    // LM head (tied embedding) and softcap (spec §3.1.6).
    DGSERVE_RETURN_IF_ERROR(logits_.Ensure(size_t(R) * V));
    DGSERVE_RETURN_IF_ERROR(cublas_.Linear(h_.get(), embed_.get(), R, D, V, logits_.get()));
    DGSERVE_RETURN_IF_ERROR(
        cuda::Softcap(logits_.get(), int64_t(R) * V, c_.final_logit_softcapping));
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = segs[i];
      DGSERVE_RETURN_IF_ERROR(Download(batch[i].logits, logits_.get() + size_t(s.row0) * V,
                                       size_t(s.rows) * V * sizeof(float)));
    }
  }
  timings_.lm_head_seconds = SecondsSince(t1);
  return absl::OkStatus();
}

absl::Status CudaBackend::SoftGemm(const uint16_t* probs_bf16, int rows, float* soft) {
  const int D = c_.hidden_size, V = c_.vocab_size;
  const float alpha = c_.EmbedScale(), beta = 0.0f;
  // Row-major soft[rows, D] = P[rows, V] · E[V, D] is column-major softᵀ = Eᵀ · Pᵀ.
  cuda::NoteCublas();
  return CublasCheck(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, D, rows, V, &alpha,
                                  embed_.get(), CUDA_R_16BF, D, probs_bf16, CUDA_R_16BF, V, &beta,
                                  soft, CUDA_R_32F, D, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                     "cublasGemmEx (soft embedding)");
}

absl::Status CudaBackend::DenoiseStep(std::span<const DenoiseStepInput> batch) {
  const auto lock = Lock();
  if (!options_.phase_timing) return DenoiseStepLocked(batch);
  phases_.Start();
  const absl::Status st = DenoiseStepLocked(batch);
  if (!st.ok()) {
    phases_.Abort();
    return st;
  }
  DGSERVE_ASSIGN_OR_RETURN(last_phases_, phases_.Finish());
  return absl::OkStatus();
}

absl::Status CudaBackend::DenoiseStepLocked(std::span<const DenoiseStepInput> batch) {
  const int D = c_.hidden_size, V = c_.vocab_size;
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
  std::vector<Segment> segs;
  DGSERVE_ASSIGN_OR_RETURN(const int R, Body(canvases, &segs));
  const auto t1 = std::chrono::steady_clock::now();
  if (R > 0) {
    phases_.Enter(Phase::kVocab);
    std::vector<float> temps(R), uniforms(R);
    bool want_soft = false;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = segs[i];
      for (int r = 0; r < s.rows; ++r) {
        temps[s.row0 + r] = batch[i].temperature;
        uniforms[s.row0 + r] = batch[i].uniforms[r];
      }
      want_soft |= batch[i].next_soft != nullptr && s.rows > 0;
    }
    DGSERVE_RETURN_IF_ERROR(temps_.Upload(temps));
    DGSERVE_RETURN_IF_ERROR(uniforms_.Upload(uniforms));
    // Canvas templates: each distinct mask uploaded once, rows naming it by index (−1: none).
    const size_t words = (size_t(V) + 63) / 64;
    std::vector<int32_t> mask_index(R, -1);
    std::vector<uint64_t> mask_table;
    std::unordered_map<const uint64_t*, int32_t> mask_ids;
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = segs[i];
      if (batch[i].row_masks.empty()) continue;
      for (int r = 0; r < s.rows; ++r) {
        const uint64_t* m = batch[i].row_masks[r];
        if (m == nullptr) continue;
        auto [it, added] = mask_ids.try_emplace(m, int32_t(mask_ids.size()));
        if (added) mask_table.insert(mask_table.end(), m, m + words);
        mask_index[s.row0 + r] = it->second;
      }
    }
    const bool masked = !mask_ids.empty();
    if (masked) {
      DGSERVE_RETURN_IF_ERROR(mask_table_.Upload(mask_table.data(), mask_table.size()));
      DGSERVE_RETURN_IF_ERROR(mask_index_.Upload(mask_index.data(), mask_index.size()));
    }
    const uint64_t* d_mask_table = masked ? mask_table_.get() : nullptr;
    const int32_t* d_mask_index = masked ? mask_index_.get() : nullptr;
    DGSERVE_RETURN_IF_ERROR(results_.Ensure(R));
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
    if (options_.fused_vocab) {
      DGSERVE_RETURN_IF_ERROR(vocab_scratch_.Ensure(cuda::FusedVocabScratchBytes(R, V)));
      fused.scratch = vocab_scratch_.get();
      // The sparse self-conditioning product (cpu_vocab.h's bound) for the rows of canvases
      // whose DenoiseStepInput::sparse_sc is set (ε = 2⁻¹², cpu::kDefaultScSkipMass).
      bool sparse = false;
      std::vector<float> skip_mass(R, 0.0f);
      for (size_t i = 0; i < batch.size(); ++i) {
        if (!batch[i].sparse_sc || batch[i].next_soft == nullptr) continue;
        const Segment& s = segs[i];
        for (int r = 0; r < s.rows; ++r) skip_mass[s.row0 + r] = 0x1p-12f;
        sparse |= s.rows > 0;
      }
      if (sparse) {
        if (tile_norm_max_.get() == nullptr) {
          DGSERVE_RETURN_IF_ERROR(
              tile_norm_max_.Ensure(size_t(V + cuda::kFusedVocabTile - 1) / cuda::kFusedVocabTile));
          DGSERVE_RETURN_IF_ERROR(cuda::FusedTileNormMax(embed_.get(), V, D, tile_norm_max_.get()));
        }
        DGSERVE_RETURN_IF_ERROR(skip_mass_.Upload(skip_mass));
        fused.sc_skip_mass = skip_mass_.get();
        fused.tile_norm_max = tile_norm_max_.get();
        fused.embed_scale = c_.EmbedScale();
      }
      DGSERVE_RETURN_IF_ERROR(cuda::FusedVocabStep(fused));
    } else {
      DGSERVE_RETURN_IF_ERROR(logits_.Ensure(size_t(R) * V));
      DGSERVE_RETURN_IF_ERROR(cublas_.Linear(h_.get(), embed_.get(), R, D, V, logits_.get()));
      DGSERVE_RETURN_IF_ERROR(cuda::VocabStep(logits_.get(), R, V, c_.final_logit_softcapping,
                                              temps_.get(), uniforms_.get(), results_.get(),
                                              /*z_bf16=*/nullptr, d_mask_table, d_mask_index));
    }
    std::vector<cuda::VocabRowResult> results(R);
    DGSERVE_RETURN_IF_ERROR(
        Download(results.data(), results_.get(), size_t(R) * sizeof(cuda::VocabRowResult)));
    for (int r = 0; r < R; ++r) {
      if (results[r].argmax < 0) {
        return absl::InternalError(absl::StrCat("denoise step: row ", r, " has non-finite logits"));
      }
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      const Segment& s = segs[i];
      for (int r = 0; r < s.rows; ++r) {
        const cuda::VocabRowResult& x = results[s.row0 + r];
        RowResult& out = batch[i].rows[r];
        out.argmax = x.argmax;
        out.sampled = x.sampled;
        out.entropy = x.entropy;
        out.lse = x.lse;
      }
    }
    if (want_soft) {
      // Next step's self-conditioning input (spec §3.5 step 2): softmax(ℓ/T) · E · bf16(√D).
      DGSERVE_RETURN_IF_ERROR(probs_bf16_.Ensure(size_t(R) * V));
      DGSERVE_RETURN_IF_ERROR(soft_.Ensure(size_t(R) * D));
      // The bf16 probabilities from the logits recomputed per tile (fused) or from the logits.
      if (options_.fused_vocab) {
        DGSERVE_RETURN_IF_ERROR(
            cuda::FusedSoftmaxProbsBf16(fused, results_.get(), probs_bf16_.get()));
      } else {
        DGSERVE_RETURN_IF_ERROR(
            cuda::SoftmaxProbsBf16(logits_.get(), R, V, c_.final_logit_softcapping, temps_.get(),
                                   results_.get(), probs_bf16_.get(), d_mask_table, d_mask_index));
      }
      DGSERVE_RETURN_IF_ERROR(SoftGemm(probs_bf16_.get(), R, soft_.get()));
      for (size_t i = 0; i < batch.size(); ++i) {
        const Segment& s = segs[i];
        if (batch[i].next_soft == nullptr) continue;
        DGSERVE_RETURN_IF_ERROR(Download(batch[i].next_soft, soft_.get() + size_t(s.row0) * D,
                                         size_t(s.rows) * D * sizeof(float)));
      }
    }
  }
  timings_.lm_head_seconds = SecondsSince(t1);
  return absl::OkStatus();
}

absl::Status CudaBackend::SoftEmbedding(const float* probs, int rows, float* soft) {
  const auto lock = Lock();
  const int D = c_.hidden_size, V = c_.vocab_size;
  if (rows <= 0) return absl::OkStatus();
  DGSERVE_RETURN_IF_ERROR(logits_.Upload(probs, size_t(rows) * V));
  DGSERVE_RETURN_IF_ERROR(probs_bf16_.Ensure(size_t(rows) * V));
  DGSERVE_RETURN_IF_ERROR(soft_.Ensure(size_t(rows) * D));
  DGSERVE_RETURN_IF_ERROR(cuda::FloatToBf16(logits_.get(), int64_t(rows) * V, probs_bf16_.get()));
  DGSERVE_RETURN_IF_ERROR(SoftGemm(probs_bf16_.get(), rows, soft_.get()));
  return Download(soft, soft_.get(), size_t(rows) * D * sizeof(float));
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(const ModelConfig& config,
                                                                const ModelWeights& weights,
                                                                const CudaBackendOptions& options) {
  const int devices = cuda::DeviceCount();
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device found");
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (", devices, " found)"));
  }
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(options.device), "cudaSetDevice"));
  auto backend = std::make_unique<CudaBackend>(config, options);
  DGSERVE_RETURN_IF_ERROR(backend->Init(weights));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackendSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaBackendOptions& options) {
  const int devices = cuda::DeviceCount();
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device found");
  if (options.device < 0 || options.device >= devices) {
    return absl::InvalidArgumentError(
        absl::StrCat("CUDA device ", options.device, " does not exist (", devices, " found)"));
  }
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaSetDevice(options.device), "cudaSetDevice"));
  auto backend = std::make_unique<CudaBackend>(config, options);
  // Norms, scales and scalars from the host (small); the matrices are made on the device.
  DGSERVE_RETURN_IF_ERROR(backend->Init(SyntheticModelWeights(config, seed, /*matrices=*/false)));
  DGSERVE_RETURN_IF_ERROR(backend->InitSyntheticMatrices(seed));
  return std::unique_ptr<ModelBackend>(std::move(backend));
}

std::optional<CudaPhaseTimes> LastCudaPhaseTimes(const ModelBackend& backend) {
  const auto* b = dynamic_cast<const CudaBackend*>(&backend);
  if (b == nullptr) return std::nullopt;
  return b->last_phase_times();
}

}  // namespace dgserve
