// The CUDA backend's internals (see cuda_backend.h), shared by its two source files:
// cuda_backend.cc (weights, the KV mirrors, the step's orchestration and the vocabulary step) and
// cuda_backend_passes.cc (the encoder and decoder passes: projections, attention, MoE, layers).
// Not for use outside engine/cuda/.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/status_macros.h"
#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_backend_kernels.h"
#include "engine/cuda/cuda_fp8_memory.h"
#include "engine/cuda/cuda_gemm.h"
#include "engine/cuda/cuda_memory.h"
#include "engine/cuda/cuda_moe.h"
#include "engine/cuda/cuda_nvfp4_upload.h"
#include "engine/cuda/cuda_ops.h"
#include "engine/cuda/cuda_profile.h"
#include "engine/cuda/cuda_reserved_memory.h"
#include "engine/cuda/cuda_soft_embed.h"
#include "engine/cuda/cuda_synthetic.h"
#include "engine/cuda/cuda_vocab.h"
#include "engine/model/model_math.h"
#include "engine/model/quant_config.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/synthetic_weights.h"

namespace dgserve::cuda_internal {

inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
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
  void Start(cudaStream_t stream) {
    stream_ = stream;
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
      DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaEventElapsedTime(&ms, events_[b.start], events_[b.end]),
                                        "cudaEventElapsedTime"));
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
    error_ = CudaCheck(cudaEventRecord(events_[used_], stream_), "cudaEventRecord (phases)");
    if (!error_.ok()) return false;
    *index = used_++;
    return true;
  }

  cudaStream_t stream_ = nullptr;
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

// A weight tensor on the device in the format the checkpoint holds it (issue 37): one matrix
// [out, in] (a dense projection: E = 1) or E experts [E, out, in]. `format` (quant_config.h) names
// the one member that holds it; the others stay empty. Filled by UploadDeviceWeights
// (cuda_backend.cc) or, bf16 only, by InitSyntheticMatrices.
struct DeviceWeights {
  WeightFormat format = WeightFormat::kBf16;
  DeviceArray<uint16_t> bf16;  // kBf16: bf16 bits (the widened values of other formats)
  cuda::DeviceFp8 fp8;         // kFp8: 8 bits (DenseLinearFp8, MoeGateUpFp8 / MoeDownFp8)
  cuda::DeviceW4A16 w4a16;     // kW4A16: 4 bits (DenseLinearW4A16, MoeGateUpW4A16 / MoeDownW4A16)
  cuda::DeviceNvfp4 nvfp4;     // kNvfp4: 4 bits (DenseLinearNvfp4, MoeGateUpNvfp4 / MoeDownNvfp4)
};
using DeviceProjection = DeviceWeights;  // one [out, in] matrix, run by CudaBackend::Linear
using DeviceExperts = DeviceWeights;     // [E, out, in], run by CudaBackend::Moe

// One layer's weights on the device (see LayerWeights for shapes).
struct DeviceLayer {
  DeviceArray<float> input_layernorm, q_norm, k_norm, post_attention_layernorm,
      pre_feedforward_layernorm, post_feedforward_layernorm_1, router_scale,
      pre_feedforward_layernorm_2, post_feedforward_layernorm_2, post_feedforward_layernorm;
  DeviceProjection q_proj, k_proj, v_proj, o_proj, mlp_gate_proj, mlp_up_proj, mlp_down_proj;
  DeviceExperts experts_gate_up, experts_down;
  DeviceArray<float> router_proj;          // [E, D] float32 (the top-k choice is sensitive)
  DeviceArray<uint16_t> router_proj_bf16;  // the same bf16 values, for DenseLinear
  DeviceArray<float> per_expert_scale;     // [E]
  float decoder_layer_scalar = 1, encoder_layer_scalar = 1;
};

// The device mirror of one host KvCache (see cuda_backend.h). A full layer holds every position
// (position p in row p); a sliding layer only its window: a ring of min(capacity, W) rows,
// position p in row p % ring (the attention kernels read the last W − 1 positions before a pass's
// first; the encoder writes its rows after its attention, so W − 1 rows would do: W keeps one
// spare). While the ring is shorter than W it is also shorter than capacity, so no row has
// wrapped and growing it keeps its rows in place.
// A layer whose attention runs on the tensor cores (CudaBackend::Bf16Mirror) stores its rows as
// bf16 bits (k16 / v16: each element rounded by FloatToBf16 / ToBf16Bits, the rounding the
// tensor-core kernels apply to a float32 context, so they read the same bits); the others as
// float32 (k / v), which the float32 kernels need. Each layer uses one pair; the other is empty.
// The device K/V block pool (CudaBackendOptions::kv_block_size > 0) of one layer kind (kKvFull,
// kKvSliding): block ids [0, blocks); block b holds block_size consecutive positions' rows of
// every layer of that kind, rows [b·block_size, (b + 1)·block_size) of the layer's arrays
// [blocks, block_size, kvw] (bf16 bits on the layers whose mirror stores bf16, else float32;
// empty for the other kind's layers). Sequences own blocks through their mirrors' block tables.
inline constexpr int kKvFull = 0, kKvSliding = 1;
// Blocks shared between mirrors (CudaBackendOptions::share_kv_blocks): a block holding whole
// rows of block index i (every position committed in its cache, every layer of the kind written)
// is registered under its rows' host identities (KvCache::SharedRowsId of each of its
// positions: `signature`), found by the last one's and i; a mirror about to upload those rows
// from a cache giving the same identities takes the block instead (one more reference). A
// registered block no mirror holds stays cached, its rows kept, until a block is wanted and none
// is free (the least recently released first).
struct KvBlockPool {
  int blocks = 0;                 // ids allocated on the device
  std::vector<int32_t> free_ids;  // ids neither held nor cached (popped from the back)
  std::vector<int32_t> refs;      // per id: mirrors holding it
  std::vector<std::vector<uint64_t>> signature;  // per id: registered identities (empty: none)
  std::map<std::pair<uint64_t, int>, int32_t> registry;  // (last identity, block index) → id
  std::set<std::pair<uint64_t, int32_t>> cached;         // (release order, id), held by none
  std::vector<uint64_t> released_at;                     // per cached id: its release order
  uint64_t release_clock = 0;
  int64_t shared_blocks_taken = 0;  // blocks a mirror took instead of uploading their rows
  // Per model layer of the pool's kind: K and V of `blocks` blocks (bf16 or float32 rows as the
  // layer's mirror stores them), at a fixed address (CudaBackend::ResizeKvPool).
  std::vector<cuda::ReservedDeviceMemory> k, v;
  int in_use() const { return blocks - int(free_ids.size()) - int(cached.size()); }
  // One reference more on id b (a cached block leaves the cache).
  void Ref(int32_t b) {
    if (refs[b]++ == 0 && !signature[b].empty()) cached.erase({released_at[b], b});
  }
  // One reference less on id b: at none, cached (registered) or free.
  void Unref(int32_t b) {
    if (--refs[b] > 0) return;
    if (signature[b].empty()) {
      free_ids.push_back(b);
    } else {
      released_at[b] = ++release_clock;
      cached.insert({released_at[b], b});
    }
  }
  // A free id with one reference: a free one, else the least recently released cached one
  // (unregistered); −1 when there is neither.
  int32_t Take() {
    if (free_ids.empty() && !cached.empty()) {
      const int32_t b = cached.begin()->second;
      cached.erase(cached.begin());
      Unregister(b);
      free_ids.push_back(b);
    }
    if (free_ids.empty()) return -1;
    const int32_t b = free_ids.back();
    free_ids.pop_back();
    refs[b] = 1;
    return b;
  }
  // Registers held id b as the rows of block index i with identities `sig` (one per position,
  // none 0); false (nothing changed) when another block has them.
  bool Register(int32_t b, int i, std::vector<uint64_t> sig) {
    if (!registry.emplace(std::make_pair(sig.back(), i), b).second) return false;
    signature[b] = std::move(sig);
    index_of[b] = i;
    return true;
  }
  // The registered id holding block index i with identities `sig`, −1 when none.
  int32_t Find(int i, const std::vector<uint64_t>& sig) const {
    const auto it = registry.find({sig.back(), i});
    return it != registry.end() && signature[it->second] == sig ? it->second : -1;
  }
  void Unregister(int32_t b) {
    if (signature[b].empty()) return;
    registry.erase({signature[b].back(), index_of[b]});
    signature[b].clear();
  }
  // The per-id arrays for `count` ids (GrowKvPool).
  void Resize(int count) {
    refs.resize(count, 0);
    signature.resize(count);
    released_at.resize(count, 0);
    index_of.resize(count, 0);
  }
  std::vector<int> index_of;  // per registered id: its block index
};

struct KvMirror {
  KvMirror() = default;
  KvMirror(const KvMirror&) = delete;
  KvMirror& operator=(const KvMirror&) = delete;
  // A paged mirror's blocks go back to their pools.
  ~KvMirror() { ReleaseBlocks(); }
  // Gives every block back to its pool (the table entries become −1; tables_dirty).
  void ReleaseBlocks() {
    if (pools == nullptr) return;
    for (int kind = 0; kind < 2; ++kind) {
      for (int32_t& b : blocks[kind]) {
        if (b >= 0) pools[kind].Unref(b);
        b = -1;
      }
      published[kind] = 0;
    }
    sliding_from = 0;
    tables_dirty = true;
  }
  // Paged (pools != nullptr): per kind, the pool block of each block index of positions
  // (position p in block blocks[kind][p / B], row p % B of it), −1 where no block is held (a
  // sliding layer's positions behind its window, or rows no pass wrote); the same table on the
  // device (uploaded by CudaBackend::SyncKvBlocks while tables_dirty).
  KvBlockPool* pools = nullptr;  // the backend's two pools
  std::vector<int32_t> blocks[2];
  DeviceArray<int32_t> tables[2];
  bool tables_dirty = false;
  // Shared blocks (KvBlockPool): block indices below published[kind] were offered for
  // registration; every sliding layer holds the rows [sliding_from, synced) it was given (an
  // upload or a pass may start past the last: the rows between are no one's).
  int published[2] = {0, 0};
  int sliding_from = 0;
  // Per sequence (pools == nullptr):
  std::vector<DeviceArray<float>> k, v;         // per layer [MirrorRows(l, capacity), kvw]
  std::vector<DeviceArray<uint16_t>> k16, v16;  // the same, bf16 bits (Bf16Mirror layers)
  std::vector<int> ring;                        // per layer: ring rows (sliding), 0 (full: linear)
  int capacity = 0;                             // positions the full layers hold
  int synced = 0;                               // positions [visible lo, synced) are on the device
  // The cache's rows [retained lo, host_synced) are current in its host arrays; rows from there
  // to `synced` only here (the deferred host copy: CudaBackendOptions::defer_kv_host_copy).
  int host_synced = 0;
  std::weak_ptr<const void> owner;  // the cache's KvCache::lifetime()
  bool deferred = false;            // encoder passes leave new rows here only (SyncKvToHost)
  int sliding_rows = 0;             // rows a sliding layer's ring holds at most
  uint64_t last_use = 0;

  // Rows the cache's host arrays lack (only while deferred).
  bool pending() const { return host_synced < synced; }
  bool paged() const { return pools != nullptr; }
  // OK when the blocks of positions [p0, p0 + count) of `kind` are held (every row a kernel is
  // about to read or write through the table), else INTERNAL naming `what`.
  absl::Status CheckHeld(int kind, int block_size, int p0, int count, const char* what) const {
    for (int i = p0 / block_size; count > 0 && i <= (p0 + count - 1) / block_size; ++i) {
      if (i >= int(blocks[kind].size()) || blocks[kind][i] < 0) {
        return absl::InternalError(
            absl::StrCat(what, ": position ", std::max(p0, i * block_size), " has no KV block"));
      }
    }
    return absl::OkStatus();
  }
  // Pool blocks this mirror holds of `kind`.
  int held(int kind) const {
    return int(
        std::count_if(blocks[kind].begin(), blocks[kind].end(), [](int32_t b) { return b >= 0; }));
  }

  // The row of position p in layer l.
  int Row(int l, int p) const { return ring[l] > 0 ? p % ring[l] : p; }
  // Calls f(p, row, n) for the runs of consecutive rows holding positions [p0, p0 + count) of
  // layer l (a ring wraps: at most two runs when count ≤ ring).
  template <typename F>
  absl::Status ForEachRun(int l, int p0, int count, F f) const {
    for (int p = p0; p < p0 + count;) {
      const int row = Row(l, p);
      const int n = ring[l] > 0 ? std::min(p0 + count - p, ring[l] - row) : p0 + count - p;
      DGSERVE_RETURN_IF_ERROR(f(p, row, n));
      p += n;
    }
    return absl::OkStatus();
  }
};

// Rows layer l's mirror allocates for `capacity` positions: all of them on full layers, at most
// `sliding_rows` (the window W, or more for a deferred host copy: KvMirror) on sliding ones.
inline int KvMirrorRows(const ModelConfig& c, int l, int capacity, int sliding_rows) {
  return c.IsFull(l) || c.sliding_window <= 0 ? capacity : std::min(capacity, sliding_rows);
}

// Whether layer l's attention runs on the tensor cores (options.tensor_core_attention in the bf16
// GEMM-input mode, and a head_dim they take), and whether its mirror then stores bf16
// (options.bf16_kv_mirror).
inline bool TensorCoreLayer(const ModelConfig& c, const CudaBackendOptions& o, int l) {
  const int hd = c.HeadDim(l);
  return o.tensor_core_attention && o.gemm_input == cuda::GemmInput::kBf16 && hd % 32 == 0 &&
         hd <= cuda::kMaxAttentionHeadDim;
}
inline bool KvMirrorBf16(const ModelConfig& c, const CudaBackendOptions& o, int l) {
  return TensorCoreLayer(c, o, l) && o.bf16_kv_mirror;
}

// One sequence inside a batched pass: rows [row0, row0 + rows) of the stacked activations (no
// padding on the GPU), positions pos0 …, its device KV mirror.
struct Segment {
  int row0 = 0, rows = 0, pos0 = 0;
  bool has_sc = false;  // decoder: a self-conditioning input (rows of sc_in_ from row0)
  const KvCache* kv = nullptr;
  KvCache* kv_write = nullptr;  // encoder only
  KvMirror* mirror = nullptr;
  // Encoder: the first position of the sliding layers' new rows copied to the host cache
  // (pos0, or later when the cache keeps fewer: KvCache::SlidingRetainedFrom of pos0 + rows).
  int sliding_host_from = 0;
  bool to_host = true;  // encoder: copied to the host in the pass (false: deferred mirror)
  // Encoder, paged mirror: the first position of the sliding layers' new rows written into the
  // device pool (CudaBackend::SlidingWriteFrom).
  int sliding_device_from = 0;
  // Encoder: the segment's new rows of layer kind `full` that go to the host, as offsets from
  // row0: [first, first + count).
  std::pair<int, int> HostRows(bool full) const {
    if (!to_host) return {0, 0};
    if (full || sliding_host_from <= pos0) return {0, rows};
    const int first = std::min(rows, sliding_host_from - pos0);
    return {first, rows - first};
  }
};

// The vocabulary part of a step as PrepareVocab staged it.
struct StepVocab {
  bool masked = false;     // canvas-template masks (mask_table_, mask_index_)
  bool sparse = false;     // the sparse self-conditioning plan (skip_mass_)
  bool want_soft = false;  // a next soft embedding is asked for
};

// One captured decoder step (CudaBackendOptions::cuda_graphs), by step shape.
struct StepGraph {
  cudaGraphExec_t exec = nullptr;
  uint64_t generation = 0;    // cuda::ScratchGeneration() at capture
  cuda::LaunchCounts inside;  // what a replay runs, as counted at capture
  int eager_runs = 0;         // runs before the capture (the first sizes the buffers)
  bool failed = false;        // CUDA refused the capture: eager from then on
};

class CudaBackend final : public ModelBackend {
 public:
  CudaBackend(const ModelConfig& config, const CudaBackendOptions& options)
      : c_(config), options_(options), cublas_(options.gemm_input) {}
  ~CudaBackend() override {
    // The K/V pools' memory is unmapped next (cuMemUnmap does not wait for queued work).
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    DropGraphs();
    mirrors_.clear();
    if (handle_ != nullptr) cublasDestroy(handle_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const ModelWeights& w);
  // Allocates every matrix of the model on the device and fills it with the synthetic weights
  // of `seed` (after Init with SyntheticModelWeights(c, seed, /*matrices=*/false)).
  absl::Status InitSyntheticMatrices(uint64_t seed);
  // The device K/V pools' bound (kv_pool_bound_): options_.kv_pool_max_bytes, else
  // min(options_.memory_utilization · total − this backend's own device memory, the memory free
  // now), called after Init and InitSyntheticMatrices (the weights on the device) with the
  // device's free bytes before Init (`free_before`: the difference is this backend's own).
  // FAILED_PRECONDITION where that leaves less than one block of each kind. (Init refuses a
  // fraction outside [0, 1] and an explicit bound below one block of each kind.)
  absl::Status SetKvPoolBound(size_t free_before);
  std::optional<CudaPhaseTimes> last_phase_times() const {
    std::lock_guard<std::mutex> lock(mu_);
    return last_phases_;
  }
  CudaGraphStats graph_stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return graph_stats_;
  }
  CudaKvCopyStats kv_copy_stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_copy_stats_;
  }
  // Bytes of every layer's K and V arrays of kv's mirror (nullopt: none).
  std::optional<int64_t> mirror_bytes(const KvCache& kv) const {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = mirrors_.find(&kv);
    if (it == mirrors_.end()) return std::nullopt;
    int64_t n = 0;
    const KvMirror& m = *it->second;
    if (m.paged()) {
      for (int l = 0; l < c_.num_layers; ++l) {
        n += int64_t(m.held(KvKind(l))) * KvBlockBytes(l);
      }
      return n;
    }
    for (int l = 0; l < c_.num_layers; ++l) {
      n += int64_t(m.k[l].size() + m.v[l].size()) * int64_t(sizeof(float)) +
           int64_t(m.k16[l].size() + m.v16[l].size()) * int64_t(sizeof(uint16_t));
    }
    return n;
  }

  CudaKvPoolStats kv_pool_stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    CudaKvPoolStats st;
    st.block_size = options_.kv_block_size;
    for (int kind = 0; kind < 2; ++kind) {
      const KvBlockPool& pool = kv_pools_[kind];
      (kind == kKvFull ? st.full_blocks : st.sliding_blocks) = pool.blocks;
      (kind == kKvFull ? st.full_blocks_in_use : st.sliding_blocks_in_use) = pool.in_use();
      (kind == kKvFull ? st.full_blocks_cached : st.sliding_blocks_cached) =
          int(pool.cached.size());
      st.shared_blocks_taken += pool.shared_blocks_taken;
    }
    st.device_bytes = KvPoolsBytes();
    if (PagedKv()) st.min_bytes = KvPoolsMinBytes();
    st.swap_outs = kv_swap_outs_;
    st.compactions = kv_compactions_;
    st.growths = kv_growths_;
    st.blocks_moved = kv_blocks_moved_;
    st.max_bytes = int64_t(kv_pool_bound_);
    return st;
  }

  const ModelConfig& config() const override { return c_; }
  absl::Status Encode(std::span<const EncodeInput> batch) override;
  absl::Status Decode(std::span<const DecodeInput> batch) override;
  absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) override;
  absl::Status DenoiseStepLocked(std::span<const DenoiseStepInput> batch);
  absl::Status SoftEmbedding(const float* probs, int rows, float* soft) override;
  int prefill_chunk_tokens() const override { return kGpuPrefillChunkTokens; }
  absl::Status SyncKvToHost(KvCache& kv) override;
  absl::Status CheckKvFits(const KvCache& like, const KvPassPlan& plan) const override;
  absl::Status CheckKvFitsTogether(std::span<const KvSequencePlan> seqs) const override;
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
  // Starts a pass over `caches` (before their SyncMirror): drops the paged mirrors of caches
  // destroyed since (finished sequences give their blocks back now, not when max_kv_mirrors
  // evicts them), then marks the existing mirrors of the pass's caches as used by it, so that
  // making room for one of them never evicts another.
  void BeginPass(const std::vector<const KvCache*>& caches);
  // The paged device pool (options_.kv_block_size > 0; cuda_backend_kv.cc). KvKind: the pool
  // of layer l. KvBlockBytes: the device bytes of one block of layer l (K and V).
  bool PagedKv() const { return options_.kv_block_size > 0; }
  int KvKind(int l) const { return c_.IsFull(l) ? kKvFull : kKvSliding; }
  int64_t KvBlockBytes(int l) const {
    return 2 * int64_t(options_.kv_block_size) * c_.KvHeads(l) * c_.HeadDim(l) *
           int64_t(Bf16Mirror(l) ? sizeof(uint16_t) : sizeof(float));
  }
  // The first position of a sliding layer a paged mirror of `kv` keeps once n positions are
  // committed: the window the next pass reads (n − (W − 1)), or earlier for rows the host cache
  // keeps (KvCache::SlidingRetainedFrom(n)) and lacks (from host_lacks_from: the deferred copy;
  // n or more: it lacks none); 0 without a window or with sliding_kv_ring off.
  int SlidingKeepFrom(const KvCache& kv, int n, int host_lacks_from) const;
  // The largest of `plan`'s passes on a cache like `like` (CheckKvFits): its device K/V bytes as
  // mapped, full and sliding blocks, first position; zeros without paged K/V or positions.
  struct KvPassBlocks {
    int64_t bytes = 0, full = 0, sliding = 0, from = 0;
  };
  KvPassBlocks LargestKvPass(const KvCache& like, const KvPassPlan& plan) const;
  // The first position of a sliding layer's new rows an encoder pass from n to `need` positions
  // writes into a paged mirror (and SyncKvBlocks holds): those a later pass or, with the deferred
  // copy, the host reads.
  int SlidingWriteFrom(const KvCache& kv, const KvMirror& m, int n, int need) const {
    return std::max(n, SlidingKeepFrom(kv, need, m.deferred ? n : need));
  }
  // A paged mirror's blocks for a pass over its n committed positions writing `extra` more:
  // full layers every position's block, sliding layers the blocks of [SlidingKeepFrom, n) and of
  // the new rows they keep (Segment::sliding_device_from); sliding blocks behind the window go
  // back to the pool. Then its tables on the device.
  absl::Status SyncKvBlocks(const KvCache& kv, KvMirror* m, int n, int extra);
  // Returns to the pool a paged mirror's sliding blocks wholly behind SlidingKeepFrom(kv, n, the
  // first position the host lacks) (after a pass, a sync, or before a pass over n positions);
  // returns that position.
  int ReleaseSlidingKvBlocks(const KvCache& kv, KvMirror* m, int n);
  // The first sliding-layer position SyncMirror uploads into a mirror lacking the rows before
  // n positions: the window the next pass reads.
  int SlidingUploadFrom(int n) const { return std::max(0, n - (c_.sliding_window - 1)); }
  // Shared blocks (KvBlockPool, options_.share_kv_blocks). KvBlockSignature: the identities of
  // block index i's positions in kv (KvCache::SharedRowsId); false when one has none.
  // TakeSharedKvBlocks: for each whole block of [from, n) of `kind` the mirror lacks, the
  // registered block with its identities, if any (SyncMirror uploads around registered blocks).
  // PublishKvBlocks: registers
  // the mirror's whole blocks of rows written so far that are not yet registered.
  bool KvBlockSignature(const KvCache& kv, int kind, int i, std::vector<uint64_t>* sig) const;
  void TakeSharedKvBlocks(const KvCache& kv, KvMirror* m, int kind, int from, int n);
  void PublishKvBlocks(const KvCache& kv, KvMirror* m);
  // A free block id of pool `kind`: a free or cached one (KvBlockPool::Take), else the pool
  // grown (GrowKvPool), else (under the bound, kv_pool_bound_) the other pool compacted to the
  // blocks sequences hold and those it keeps cached (CompactKvPool: its free blocks given back,
  // and then as few of its cached ones as give the room for an eighth of this pool, a block at
  // least, least recently released first) and this one grown into half of the room then left
  // under the bound,
  // else the blocks of idle mirrors evicted (EvictOneMirror), else those of idle mirrors holding
  // rows only the device has, copied to their caches first (SwapOutOneMirror), else the other pool
  // compacted again; RESOURCE_EXHAUSTED when none frees one.
  absl::StatusOr<int32_t> AllocateKvBlock(int kind);
  // Gives back the device memory of pool `kind`'s free blocks and of its `drop_cached` least
  // recently released cached ones (their rows are on the host): every kept block (held, or
  // cached and kept) at or
  // past the number kept moves to a free id below it (its rows copied on the device; every
  // mirror's table entry, the table then uploaded whole, and the block's registration and place
  // in the release order follow, copied in place), the stream drained, and the memory past the
  // blocks kept unmapped. Returns the blocks given back.
  absl::StatusOr<int> CompactKvPool(int kind, int drop_cached);
  // Grows pool `kind` in place (doubled, from 64 blocks, by at most
  // options_.kv_pool_max_growth_bytes of mapped memory but at least one block; fewer within
  // kv_pool_bound_, both pools counted, and within the device's free memory). RESOURCE_EXHAUSTED at
  // the bound or when the device refuses the memory (nothing changed). half_the_room: at most half
  // (rounded up) of the blocks the bound still has room for.
  absl::Status GrowKvPool(int kind, bool half_the_room = false);
  // Maps or unmaps every array of pool `kind` (reserving their addresses first: for the blocks
  // the bound or, without one, the device's memory could hold) so that it holds `blocks` blocks;
  // nothing changed on an error. Shrinking: the stream is drained and no mirror names the blocks
  // dropped.
  absl::Status ResizeKvPool(int kind, int64_t blocks);
  // Device bytes of one block of pool `kind` (K and V of every layer of the kind), unrounded; 0
  // where the model has no layer of the kind.
  int64_t KvPoolBlockBytes(int kind) const;
  // Device bytes of layer l's K (or V) array at `blocks` blocks, as mapped (a multiple of the
  // allocation granularity); KvPoolBytes: every array of pool `kind`'s; KvPoolsBytes: both pools'
  // now; KvPoolsMinBytes: both pools' at one block each (the smallest bound that holds a pass).
  // MaxKvPoolBlocks: the most blocks of pool `kind` whose arrays fit in `bytes`.
  int64_t KvArrayBytes(int l, int64_t blocks) const;
  int64_t KvPoolBytes(int kind, int64_t blocks) const;
  int64_t KvPoolsBytes() const;
  int64_t KvPoolsMinBytes() const { return KvPoolBytes(kKvFull, 1) + KvPoolBytes(kKvSliding, 1); }
  int64_t MaxKvPoolBlocks(int kind, int64_t bytes) const;
  // Both pools' bound in bytes (SetKvPoolBound; 0: none but the device's memory).
  size_t kv_pool_bound_ = 0;
  // The device's allocation granularity (Init, paged K/V only).
  size_t kv_granularity_ = 0;
  using MirrorMap = std::unordered_map<const KvCache*, std::unique_ptr<KvMirror>>;
  // The least recently used mirror not used by the current pass (its segments hold pointers to
  // those) for which pred(cache, mirror) holds; mirrors_.end() when none.
  template <typename Pred>
  MirrorMap::iterator LeastRecentlyUsedIdleMirror(Pred pred);
  // Drops the least recently used mirror not used by the current pass and not holding rows its
  // live cache lacks (one whose cache is gone first); false when there is none.
  bool EvictOneMirror();
  // Copies the least recently used mirror not used by the current pass that holds rows its live
  // cache lacks, and alone holds a block of pool `kind`, into that cache (SyncMirrorToHost), then
  // drops it (its blocks go back); false when there is none. For a pool that must free blocks:
  // the cache's rows come back by upload.
  absl::StatusOr<bool> SwapOutOneMirror(int kind);
  // SyncKvToHost of kv's mirror m.
  absl::Status SyncMirrorToHost(KvCache& kv, KvMirror* m);
  // Uploads layer l's K and V rows of positions [p0, p0 + count) from kv's host arrays into a
  // paged mirror's blocks (through kv_rows_dev_), rounded to bf16 on a Bf16Mirror layer.
  absl::Status UploadKvRows(const KvCache& kv, const KvMirror& m, int l, int p0, int count);
  // kv_rows_dev_ of at least `bytes` (the stream drained first when it has to grow).
  absl::Status GrowKvRowsStaging(size_t bytes);
  // Layer l's pool arrays (K, V) as the attention tables take them (bf16 bits cast on a
  // Bf16Mirror layer).
  float* PoolK(int l) const;
  float* PoolV(int l) const;
  // Rows and ring of layer l's mirror for `capacity` positions (options_.sliding_kv_ring).
  int MirrorRows(int l, int capacity, int sliding_rows) const {
    return options_.sliding_kv_ring ? KvMirrorRows(c_, l, capacity, sliding_rows) : capacity;
  }
  int MirrorRing(int l, int capacity, int sliding_rows) const {
    const bool ring = options_.sliding_kv_ring && !c_.IsFull(l) && c_.sliding_window > 0;
    return ring ? MirrorRows(l, capacity, sliding_rows) : 0;
  }
  // The decoder body (spec §3.5 steps 1–4, final norm) in two halves. PrepareBody: the host's
  // part (segments with their mirrors synced, scratch sized for R rows, the token ids, positions,
  // soft embeddings and attention table staged in pinned memory and queued for upload on
  // stream_); fills segs, returns R. EnqueueBody: the device's part, h_ [R, D], launches on
  // stream_ only (no host wait, no allocation once the buffers are sized): capturable.
  absl::StatusOr<int> PrepareBody(std::span<const CanvasInput> batch, std::vector<Segment>* segs);
  absl::Status EnqueueBody(std::span<const Segment> segs, int R);
  // The vocabulary step's inputs (temperatures, uniforms, masks, the sparse plan's ε) staged and
  // queued for upload, its buffers sized; then its launches (capturable).
  absl::Status PrepareVocab(std::span<const DenoiseStepInput> batch, std::span<const Segment> segs,
                            int R, StepVocab* v);
  absl::Status EnqueueVocab(int R, const StepVocab& v);
  // EnqueueBody + EnqueueVocab, eagerly or as the step shape's CUDA graph.
  absl::Status RunStep(std::span<const Segment> segs, int R, const StepVocab& v);
  void DropGraphs();
  // Waits for stream_ (one blocking call); INTERNAL naming `what` on a CUDA error.
  absl::Status Wait(const char* what);
  // Waits for the stream, then writes the staged K/V rows of the encoder pass into the segments'
  // host caches (KvCache::Mutable*Row) and empties the staging.
  absl::Status FlushStagedKv(std::span<const Segment> segs);
  // Copies device → pageable host memory in stream order (returns once the copy is done).
  absl::Status DownloadNow(void* host, const void* device, size_t bytes);
  absl::Status Layer(int l, PassKind kind, std::span<const Segment> segs, int R);
  // Whether layer l's decoder attention runs on TensorCoreCanvasAttention, and the device table of
  // every such layer's canvases (canvas_table_: num_layers × canvas_segments_ entries).
  bool TensorCoreCanvas(int l) const;
  // Whether layer l's mirror stores bf16 (KvMirror::k16 / v16): TensorCoreCanvas(l) and
  // options_.bf16_kv_mirror.
  bool Bf16Mirror(int l) const { return KvMirrorBf16(c_, options_, l); }
  absl::Status UploadCanvasTable(std::span<const Segment> segs);
  // Segment s's entry in layer l's attention table (canvas or prefill): its rows, its mirror's
  // K/V from position 0, its context length and window start. A bf16 layer's (Bf16Mirror)
  // ctx_k / ctx_v hold the mirror's bf16 arrays (cast), and the layer's launch reads its part of
  // the table as CanvasSegmentBf16 (the same layout).
  cuda::CanvasSegment TableEntry(const Segment& s, int l) const;
  // The encoder's: TensorCorePrefillAttention's table (prefill_table_: num_layers ×
  // prefill_segments_ entries), for the layers TensorCoreCanvas(l) names.
  absl::Status UploadPrefillTable(std::span<const Segment> segs);
  absl::Status Moe(int l, const float* h1, int R, float* m);
  // y[R, out] = x[R, in] · Wᵀ for the projection W [out, in] in its format: bf16 on
  // cuda::DenseLinear or cuBLAS (options_.batch_invariant_projections); FP8 on
  // cuda::DenseLinearFp8, W4A16 on cuda::DenseLinearW4A16 (float32 activations), NVFP4 on
  // cuda::DenseLinearNvfp4.
  absl::Status Linear(const float* x, const DeviceProjection& w, int R, int in, int out, float* y);
  // out[R, D] = down(gelu(x·gateᵀ) ⊙ x·upᵀ), every projection through Linear (gate and up
  // [width, D], down [D, width]).
  absl::Status GatedMlp(const float* x, int R, const DeviceProjection& gate,
                        const DeviceProjection& up, const DeviceProjection& down, int width,
                        float* out);
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
  DeviceProjection sc_gate_, sc_up_, sc_down_;  // the self-conditioning MLP
  std::vector<DeviceLayer> layers_;
  DeviceArray<float> rope_sliding_, rope_full_;

  // The device K/V block pools (paged mirrors, options_.kv_block_size > 0), before mirrors_: a
  // mirror's destructor returns its blocks to them.
  KvBlockPool kv_pools_[2];
  DeviceArray<unsigned char> kv_rows_dev_;  // rows on their way between the host and the pools
  DeviceArray<int32_t> kv_moves_;           // CompactKvPool's (source, destination) block pairs
  MirrorMap mirrors_;
  uint64_t use_clock_ = 0;
  int64_t kv_swap_outs_ = 0;                          // SwapOutOneMirror's
  int64_t kv_compactions_ = 0, kv_blocks_moved_ = 0;  // CompactKvPool's
  int64_t kv_growths_ = 0;                            // GrowKvPool's
  uint64_t pass_start_ = 0;  // use_clock_ value of the first mirror use of the current pass

  // Scratch activations (grown on demand).
  DeviceArray<float> h_, a_, q_, k_, v_, attn_, o_, dense_, moe_, g_, u_, r_, scores_, xe_, act_,
      y_, weight_, slot_weight_, sc_in_, logits_, temps_, uniforms_, soft_;
  DeviceArray<int32_t> ids_, positions_, expert_, offsets_, gather_, slot_, mask_index_;
  DeviceArray<uint64_t> mask_table_;  // the distinct canvas-template masks of a step
  DeviceArray<uint16_t> probs_bf16_;
  DeviceArray<unsigned char> vocab_scratch_;      // FusedVocabStep's tile partials
  DeviceArray<unsigned char> soft_scratch_;       // FusedSoftEmbedding's chunk accumulators
  DeviceArray<float> tile_norm_max_, skip_mass_;  // the sparse self-conditioning plan's inputs
  DeviceArray<cuda::VocabRowResult> results_;
  cuda::PinnedArray<cuda::CanvasSegment> canvas_table_host_;
  DeviceArray<cuda::CanvasSegment> canvas_table_;
  int canvas_segments_ = 0;
  int canvas_max_rows_ = 0;  // the most rows of one canvas in the pass (CanvasAttentionTable)
  // Per layer: TensorCoreCanvasAttention's split bound for this pass (the largest
  // CanvasSplitCount of its canvases; 1: unsplit), and the split-KV scratch sized for the largest.
  std::vector<int> canvas_max_splits_;
  DeviceArray<float> canvas_split_scratch_;
  std::vector<cuda::PrefillSegment> prefill_table_host_;
  DeviceArray<cuda::PrefillSegment> prefill_table_;
  int prefill_segments_ = 0;
  std::vector<float> host_stage_;
  std::vector<uint16_t> host_stage16_;  // SyncMirror's rows of a bf16 layer
  // The encoder pass's new K/V rows on their way to the host caches (FlushStagedKv).
  struct StagedKv {
    int layer;
    size_t offset;  // floats into kv_stage_: K [rows, kvw] then V [rows, kvw]
    int rows;       // the segments' host rows (Segment::HostRows) in segment order
  };
  cuda::PinnedArray<float> kv_stage_;
  size_t kv_stage_used_ = 0;
  std::vector<StagedKv> kv_staged_;
  std::vector<std::pair<int, int>> host_runs_;  // Layer's (row, count) runs to the staging
  // The step's pinned staging: inputs uploaded and results downloaded asynchronously on stream_.
  cuda::PinnedArray<int32_t> ids_host_, positions_host_, mask_index_host_;
  cuda::PinnedArray<float> sc_host_, temps_host_, uniforms_host_, skip_host_, soft_host_;
  cuda::PinnedArray<uint64_t> mask_table_host_;
  cuda::PinnedArray<cuda::VocabRowResult> results_host_;
  cudaStream_t stream_ = nullptr;  // every launch and copy of the passes (non-blocking)
  std::map<std::vector<int64_t>, StepGraph> graphs_;
  CudaGraphStats graph_stats_;
  CudaKvCopyStats kv_copy_stats_;
  DecodeTimings timings_;
  PhaseTimer phases_;
  std::optional<CudaPhaseTimes> last_phases_;
};

}  // namespace dgserve::cuda_internal
