// The seam between the model math and the device: one interface, implementations chosen at
// run time (CPU now; CUDA behind the same calls). Model code above this line never branches on
// the device.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "absl/status/status.h"
#include "engine/cpu/gemm.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/weights.h"

namespace dgserve {

// One sequence's encoder pass: `tokens` at positions kv->num_tokens() …, appended to `kv`.
struct EncodeInput {
  std::span<const int32_t> tokens;
  KvCache* kv = nullptr;
};

// One canvas's decoder pass (spec §3.5). The canvas sits at positions P … P+C−1 with
// P = kv->num_tokens(); it attends to the context in `kv` (read only) and to itself.
struct DecodeInput {
  std::span<const int32_t> canvas;  // [C] token ids in [0, V)
  // Self-conditioning soft embedding [C, D] = (softmax(ℓ_prev / T_prev) · E) · bf16(√D), the
  // input of the SC pre_norm; nullptr at step 0 (no self-conditioning: the SC branch is skipped
  // and the canvas input is rms_noscale(E[c]·bf16(√D))).
  const float* sc_soft = nullptr;
  const KvCache* kv = nullptr;
  float* logits = nullptr;  // out: [C, V] float32, softcapped (spec §3.1.6)
};

// One canvas's denoising step, fused: the decoder pass of DecodeInput followed by the
// vocabulary-sized work (LM head, softcap, temperature, softmax, entropy, argmax, sampling and
// the next step's self-conditioning input) without materialising [C, V] logits.
struct DenoiseStepInput {
  std::span<const int32_t> canvas;  // [C]
  const float* sc_soft = nullptr;   // [C, D] or nullptr at step 0 (as DecodeInput)
  const KvCache* kv = nullptr;
  float temperature = 1.0f;         // T of this step (spec §4.2 step 1)
  std::span<const float> uniforms;  // [C] u_j for the inverse-CDF candidate samples
  RowResult* rows = nullptr;        // out [C]: argmax, sampled, entropy, lse (spec §4.2 step 4)
  float* next_soft = nullptr;  // out [C, D]: (softmax(ℓ/T)·E)·bf16(√D), or nullptr to skip
  // Canvas template (engine/denoise/canvas_template.h): empty, or [C] per-row vocabulary bit
  // masks (nullptr = every id allowed). Ids outside a row's mask get logit −inf before
  // temperature, softmax, entropy, argmax, sampling and the soft embedding. A backend that cannot
  // mask returns UNIMPLEMENTED.
  std::span<const uint64_t* const> row_masks;
  // The canvas may use the sparse self-conditioning product (CPU, engine/cpu/cpu_vocab.h): set from
  // the canvas's own previous step (UseSparseSelfConditioning), so a canvas's result never depends
  // on the others in the batch. Ignored by backends without it.
  bool sparse_sc = false;
};

// Whether step `step` of a canvas should use the sparse self-conditioning product, from the rows
// of its previous step (`previous_step_rows`, not read at step 0: never there): when at least half
// of them had entropy ≤ 0.5 nats. The
// sparse product pays on peaked rows (it leaves out most of the vocabulary) and costs about 13 %
// of the vocabulary work on diffuse ones (bench/vocab_bench), so diffuse canvases stay dense.
inline bool UseSparseSelfConditioning(int step, std::span<const RowResult> previous_step_rows) {
  if (step == 0 || previous_step_rows.empty()) return false;
  size_t peaked = 0;
  for (const RowResult& r : previous_step_rows) peaked += r.entropy <= 0.5f;
  return 2 * peaked >= previous_step_rows.size();
}

// Prompt tokens per encoder pass (ModelBackend::prefill_chunk_tokens): the CPU backend's, and a
// GPU backend's (activations of about 0.3 MB per row at the real width: 2.5 GB at 8192 rows).
inline constexpr int kCpuPrefillChunkTokens = 512;
inline constexpr int kGpuPrefillChunkTokens = 8192;

// Wall time of the parts of the last Decode() call (for benchmarks and stats).
struct DecodeTimings {
  double body_seconds = 0;     // canvas embedding, self-conditioning MLP, layers, final norm
  double lm_head_seconds = 0;  // LM head GEMM and softcap
  // The sparse self-conditioning product of the last DenoiseStep (CPU; cpu::VocabStepStats):
  // (canvas row, vocabulary tile) pairs, those left out, rows the bound kept dense.
  int64_t sc_tile_rows = 0;
  int64_t sc_tile_rows_skipped = 0;
  int64_t sc_rows_kept_dense = 0;
};

// One sequence's passes over its K/V, for ModelBackend::CheckKvFits: rows [0, first) reach the
// backend from the host cache (a KV transfer or a prefix hit: the host keeps them), then encoder
// passes write rows [first, positions), at most pass_tokens each (≤ 0: one pass), the rows they
// write left to the backend until synced (the deferred host copy), each pass followed by
// decoder passes over the rows so far.
struct KvPassPlan {
  int64_t first = 0;
  int64_t positions = 0;
  int64_t pass_tokens = 0;
};

// One sequence of ModelBackend::CheckKvFitsTogether: its cache (or one shaped like it), its
// passes, and `shared_rows`: rows [0, shared_rows) are rows of a sequence before it in the list
// (a fork of the same prompt: another sample of a request), whose whole blocks a backend that
// shares them between sequences counts once.
struct KvSequencePlan {
  const KvCache* like = nullptr;
  KvPassPlan plan;
  int64_t shared_rows = 0;
};

class ModelBackend {
 public:
  virtual ~ModelBackend() = default;
  virtual const ModelConfig& config() const = 0;

  // Encoder passes (spec §3.4): causal over each sequence's cached + new tokens (sliding layers:
  // keys q−W < k ≤ q), encoder layer_scalar; writes K/V of the new tokens into each kv and
  // commits them. INVALID_ARGUMENT for a token id outside [0, V); RESOURCE_EXHAUSTED when a
  // cache cannot grow (that cache is left unchanged).
  virtual absl::Status Encode(std::span<const EncodeInput> batch) = 0;

  // Decoder passes (spec §3.5) for a batch of canvases (each with its own context), decoder
  // layer_scalar, bidirectional over the canvas; sliding layers see the last W−1 context
  // tokens, full layers all of them. INVALID_ARGUMENT for a token id outside [0, V).
  virtual absl::Status Decode(std::span<const DecodeInput> batch) = 0;

  // Self-conditioning soft embedding: soft[rows, D] = (probs[rows, V] · E) · bf16(√D), with
  // probs the softmax of the previous step's tempered logits (spec §3.5 step 2). INTERNAL on a
  // device fault (soft is then unspecified); rows ≤ 0 is a no-op.
  virtual absl::Status SoftEmbedding(const float* probs, int rows, float* soft) = 0;

  // Fused decoder pass + vocabulary work for a batch of canvases (see DenoiseStepInput). Same
  // errors as Decode, plus INVALID_ARGUMENT for a non-positive temperature or missing uniforms.
  virtual absl::Status DenoiseStep(std::span<const DenoiseStepInput> batch) = 0;

  // Timings of the last Decode or DenoiseStep call (lm_head_seconds covers all vocabulary work
  // in DenoiseStep). The CUDA backend runs a call as one unit on the device and waits once: its
  // body_seconds is the whole call and lm_head_seconds 0, except with phase_timing, where it
  // waits between the two and reports both.
  virtual DecodeTimings last_decode_timings() const = 0;

  // Prompt tokens per encoder pass this backend prefers (the prefill worker's --chunk_tokens
  // default and the in-process generator's chunk). An encoder pass reads every weight once, so a
  // GPU takes large chunks (kGpuPrefillChunkTokens: a 32k prompt in 4 passes, not 64; issue 34
  // item 3); the CPU's small chunks bound its activations. Any chunking gives the same KV bits on
  // the CPU backend.
  virtual int prefill_chunk_tokens() const { return kCpuPrefillChunkTokens; }

  // Makes `kv`'s host rows current. A device backend may keep the K/V rows its encoder passes
  // write in device memory only (the CUDA backend's CudaBackendOptions::defer_kv_host_copy:
  // KvCache::host_rows_stale() is then set); this copies every row the cache keeps that its host
  // arrays lack and clears the flag. Call it before anything else reads the cache's rows: a KV
  // transfer, PagedKvCache::Fork, BlockPool::InsertPrefix of its blocks, another backend. The
  // CPU backend writes the host rows directly: OK, or FAILED_PRECONDITION for a cache whose rows
  // another backend holds. INTERNAL on a device fault.
  virtual absl::Status SyncKvToHost(KvCache& kv) {
    return CheckHostRowsCurrent(kv, "SyncKvToHost");
  }

  // Whether one sequence's passes (`plan`, on a cache shaped like `like`: its
  // KvCache::SlidingRetainedFrom) can ever be run by the K/V memory this backend bounds itself,
  // whatever else runs: OUT_OF_RANGE, naming the bytes and the bound, when some pass needs more
  // than the bound with the sequence alone (the CUDA backend's device block pool at
  // its bound, kv_pool_max_bytes or memory_utilization's: the blocks its SyncKvBlocks holds for
  // that pass). OK otherwise, and always for a backend that keeps K/V only in the caller's caches
  // (the CPU backend), so a caller refuses a request early (HTTP 400) that would otherwise fail in
  // a pass as RESOURCE_EXHAUSTED (HTTP 429, which clients retry). OK does not promise that a pass
  // fits: with other sequences resident, or the device's memory short, it may still be refused.
  virtual absl::Status CheckKvFits(const KvCache& like, const KvPassPlan& plan) const {
    (void)like;
    (void)plan;
    return absl::OkStatus();
  }

  // Whether several sequences' passes can run with all of them resident in the K/V memory this
  // backend bounds itself, each at the largest pass of its plan at once (CheckKvFits's count per
  // sequence, summed; blocks of shared_rows counted once where the backend shares them):
  // RESOURCE_EXHAUSTED, naming the bytes and the bound, when the sum is over the bound; OK
  // otherwise, and always for a backend without such memory (the CPU backend). A scheduler
  // admits a sequence only where it fits beside those running (the denoise worker's admission),
  // rather than have passes refused and run in parts. An upper bound: blocks cached on the
  // device count as free, sliding-window blocks shared by forks count for each.
  virtual absl::Status CheckKvFitsTogether(std::span<const KvSequencePlan> seqs) const {
    (void)seqs;
    return absl::OkStatus();
  }
};

// Which Linear of the model a GEMM input feeds (LinearInputObserver). q/k/v_proj share one input
// (kQkv), so do an MLP's or expert's gate and up projections (k*GateUp).
enum class LinearSite {
  kQkv,           // self_attn.{q,k,v}_proj: input_layernorm(h)
  kOProj,         // self_attn.o_proj: the attention output, heads concatenated
  kMlpGateUp,     // mlp.{gate,up}_proj: pre_feedforward_layernorm(h1)
  kMlpDown,       // mlp.down_proj: gelu(g)·u
  kRouter,        // router.proj: rms_noscale(h1)·scale·D^−½
  kExpertGateUp,  // experts.{e}.{gate,up}_proj: pre_feedforward_layernorm_2(h1), routed rows only
  kExpertDown,    // experts.{e}.down_proj: gelu(g)·u of the routed rows
  kScGateUp,      // self_conditioning.{gate,up}_proj: pre_norm(soft)
  kScDown,        // self_conditioning.down_proj
};

// Sees the float32 input of every Linear (not the LM head, not the attention products) of the
// CPU backend's passes before its GEMM, as the GEMM receives it in the float32 input mode (the
// bf16 mode rounds it inside the GEMM afterwards). Used by dgserve-quantize's activation
// calibration (engine/generation/calibrate.h). Called on the thread that called the backend,
// one call at a time; `x` [rows, cols] row-major is valid during the call only.
class LinearInputObserver {
 public:
  virtual ~LinearInputObserver() = default;
  // `layer`: the decoder layer (−1 for the self-conditioning MLP); `expert`: the expert id for
  // kExpert*, else −1; `encoder`: an encoder (prompt / commit) pass rather than a decoder one.
  virtual void Observe(LinearSite site, int layer, int expert, bool encoder, const float* x,
                       int rows, int cols) = 0;
};

// Options of the CPU backend.
struct CpuBackendOptions {
  // The GEMMs' input mode (engine/cpu/gemm.h). kBf16 rounds the activations of every projection,
  // MLP, router, expert, LM head and self-conditioning product to bf16 (the reference's rounding
  // points, spec §5.3; listed in engine/cpu/cpu_backend.cc and engine/README.md) and runs the
  // VDPBF16PS chain; in the attention it rounds q, k, v and the probabilities to bf16 as the
  // tensor-core attention kernels do (engine/cpu/cpu_attention.h).
  cpu::GemmInput gemm_input = cpu::GemmInput::kFloat32;
  // True: the self-conditioning soft embedding is always the dense product
  // (engine/cpu/cpu_vocab.h); false (default): the sparse product for canvases whose
  // DenoiseStepInput::sparse_sc is set. The programs with --device set it from DGSERVE_DENSE_SC=1
  // (worker/backend_flags.h).
  bool dense_self_conditioning = false;
  // Non-null: told every Linear's input (LinearInputObserver); must outlive the backend. Null
  // (default): nothing is observed and nothing is computed for it.
  LinearInputObserver* linear_observer = nullptr;
};

// The CPU backend: float32 activations, bf16 weights, our GEMM (engine/cpu/gemm.h),
// OpenMP over output tiles, rows and heads. A row's result depends only on its own inputs (not
// the batch, the chunking, the thread count or the ISA), in either GEMM input mode. `weights`
// must outlive the backend.
std::unique_ptr<ModelBackend> CreateCpuBackend(const ModelConfig& config,
                                               const ModelWeights& weights,
                                               const CpuBackendOptions& options = {});

}  // namespace dgserve
