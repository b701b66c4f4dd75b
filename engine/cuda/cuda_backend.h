// The CUDA implementation of ModelBackend (issue #5): the DiffusionGemma forward pass of spec §3
// and the fused vocabulary step of §4.2 on one GPU, mirroring engine/cpu/cpu_backend.cc pass by
// pass. Weights are uploaded once as bf16 (the projections, the tied embedding / LM head and the
// expert stacks, W4A16 experts kept 4-bit; norms and scalars stay float32); activations are
// float32 and are rounded to bf16 (or split exactly into three bf16 terms: gemm_input) in front of
// every projection, which runs on our tensor-core kernels (cuda_moe.h's DenseLinear and grouped
// expert GEMMs, cuda_vocab.h's fused vocabulary pass), so results agree with the CPU backend at
// the same rounding points up to float32 addition order, not bit for bit. A DenoiseStep's device
// work runs on the backend's stream, replayed as a CUDA graph per step shape (cuda_graphs).
//
// KV cache: the ModelBackend interface hands the backend host-side KvCache objects (contiguous or
// the paged pool of kvstore/). The backend keeps a device mirror per KvCache — K and V per layer
// (float32; bf16 on the layers whose attention runs on the tensor cores: bf16_kv_mirror). By
// default (kv_block_size > 0) the rows live in a device block pool per layer kind shared by all
// sequences: a mirror is a block table per kind, full layers hold every position's block,
// sliding layers the blocks of their window (and of rows the host cache still lacks), the others
// go back to the pool as the sequence advances, and a finished sequence's blocks at the next
// pass; the attention kernels read K/V through the tables (cuda_attention.h's paged layout).
// Whole blocks are shared between sequences whose host caches share the rows (share_kv_blocks:
// a prefix hit, a fork), and kept after their sequences finish while the pool has room.
// With kv_block_size 0 each mirror has its own arrays: [capacity, kv_heads·head_dim] indexed by
// position on full layers, a ring on sliding layers (position p in row p % ring; min(capacity, W)
// rows, or the cache's MaxSlidingRowsKept when larger, with the deferred host copy)
// (CudaKvBytesPerSequence; cuda_backend_kv.cc). The mirror
// is the authority for the rows the encoder passes write (defer_kv_host_copy, the default): the
// new rows go device to device into the mirror, the cache is marked (KvCache::host_rows_stale)
// and ModelBackend::SyncKvToHost copies the rows the cache keeps into its host arrays when asked
// (the prefill worker before it indexes and ships a prompt); until then only this backend may use
// the cache. Without it the pass copies its new rows to the host cache too (asynchronous copies
// into pinned staging, written to the cache when the pass ends or the staging fills:
// encode_staging_bytes; on sliding layers only the rows the cache keeps,
// KvCache::SlidingRetainedFrom). A pass uploads only the rows the mirror lacks (all visible ones
// for a cache it has not seen; none in the steady state of encode → denoise steps). A mirror is
// recognised by the cache's address and its identity (KvCache::lifetime: a cache freed and
// another made at the same address gets a new mirror); at most `max_kv_mirrors` mirrors are kept,
// least recently used dropped first, never one holding rows its live cache lacks.
//
// Only this header is seen by code outside engine/cuda; it needs no CUDA headers.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/cuda/cuda_gemm.h"
#include "engine/model/backend.h"
#include "engine/model/config.h"
#include "engine/model/weights.h"

namespace dgserve {

struct CudaBackendOptions {
  int device = 0;           // CUDA device ordinal
  // Device KV mirrors kept (each holds its sequence's K/V for every layer; one per live
  // sequence is ideal, more cost device memory, fewer cost re-uploads from the host cache). A
  // mirror holding rows its live cache lacks (defer_kv_host_copy) is kept beyond this bound: the
  // denoise worker's running canvases (--max_batch_canvases, 16) each hold one.
  int max_kv_mirrors = 16;
  // How the projections, the router, the experts and the LM head take float32 activations
  // (engine/cuda/cuda_gemm.h). kBf16, the default: rounded to bf16 at the reference's points
  // (spec §5.3), the CPU backend's --cpu_gemm_input=bf16 up to float32 addition order. kFloat32
  // (--cuda_gemm_input=float32, a check mode): an exact split into three bf16 terms, the CPU
  // backend's float32 results up to addition order, three times the GEMM work.
  cuda::GemmInput gemm_input = cuda::GemmInput::kBf16;
  // Time the phases of every DenoiseStep with CUDA events (LastCudaPhaseTimes). Off by default:
  // each bracket costs two event records. For one backend at a time (engine_bench): the timer
  // sees launches through the process-wide observer of cuda_profile.h while its step runs.
  bool phase_timing = false;
  // The denoising step's vocabulary work as the fused pass (cuda::FusedVocabStep: LM head in
  // vocabulary tiles, no [rows, V] float32 logits), the default; false: the former path (cuBLAS
  // float32 logits, then cuda::VocabStep and SoftmaxProbsBf16), kept for comparison.
  bool fused_vocab = true;
  // The projections (q, k, v, o, the dense and self-conditioning MLPs) on our own tensor-core
  // kernel (cuda::DenseLinear: a fixed addition order per output, so a row's bits do not depend
  // on the batch), the default; false: cuBLAS (cublasGemmEx), whose algorithm, and so addition
  // order, may change with the row count. The router's GEMM follows this too. The soft embedding
  // is ours either way (cuda::FusedSoftEmbedding, fixed order) with fused_vocab; the unfused
  // comparison mode's LM head and soft-embedding GEMM stay on cuBLAS.
  bool batch_invariant_projections = true;
  // The decoder (canvas) pass's attention as cuda::TensorCoreCanvasAttention and the encoder
  // (prompt / commit) pass's as cuda::TensorCorePrefillAttention (causal): bf16 Q/K/V on tensor
  // cores, every canvas (prompt) of the pass in one launch per layer from a device table
  // (uploaded once per pass); false: cuda::CanvasAttention / cuda::PrefillAttention (float32, one
  // launch per canvas or prompt). On by default, in the bf16 GEMM-input mode only: the float32
  // mode (the exactness check against the CPU's float32 mode) runs the float32 kernels without
  // rounding whatever this says. Layers whose head_dim is not a multiple of 32 use the float32
  // kernels either way. In the bf16 mode every attention rounds as the reference does (spec
  // §5.3): the tensor cores on bf16 q, K, V and P, the float32 kernels in their round_bf16 mode
  // (cuda_attention.h), both as the CPU backend's bf16 mode (engine/cpu/cpu_attention.h), so
  // cuda_backend_test compares either with the CPU at its 0.3 tolerance (the tiny model's max
  // |Δlogit| 0.13 under the emulation, where it was 4.5 while the CPU left attention unrounded).
  bool tensor_core_attention = true;
  // TensorCoreCanvasAttention's split-KV: a canvas's context keys in splits of this many keys
  // (counted from context token 0; a positive multiple of 32), each computed by its own blocks and
  // merged by a combine, once some canvas of the pass needs more than one split (a layer whose
  // canvases all fit in one split runs unsplit). cuda::kCanvasSplitKeys (4096); tests set 32 to
  // reach the split path with small contexts. The per-layer split bound is part of the CUDA
  // graph's shape key.
  int canvas_split_keys = 4096;
  // Each DenoiseStep's device work (decoder body and vocabulary pass) replayed as a CUDA graph,
  // the default (issue 33 item 6): one graph per step shape (rows, canvases and their sizes,
  // self-conditioning, masks, the sparse product; each canvas's context is read from a device
  // table, so a graph serves any contexts of that shape), captured the second time a
  // shape is seen (the first, eager, sizes every buffer) and dropped when the backend has had to
  // grow a device buffer since. The step's inputs are staged in pinned memory and copied
  // asynchronously on the backend's stream; its only blocking call is the wait for its results.
  // A shape whose capture CUDA refuses runs eagerly (CudaGraphStats::capture_failures). Off with
  // phase_timing (its events are eager).
  bool cuda_graphs = true;
  // Pinned host memory through which the encoder pass copies its new K/V rows to the host caches
  // asynchronously (at least one layer's rows, whatever this says): with every layer's rows
  // inside it the pass waits once, at its end; else once each time it fills.
  size_t encode_staging_bytes = size_t(256) << 20;
  // Sliding layers' device mirrors keep only the window: a ring of min(capacity, W) rows
  // (KvMirror, CudaKvBytesPerSequence), the default; false: every position, as full layers (the
  // former layout, kept so tests can show the ring gives the same bits).
  bool sliding_kv_ring = true;
  // With tensor_core_attention, the device mirror of a layer whose attention takes the tensor
  // cores stores K and V as bf16 (each element rounded to nearest even, NaN kept: the rounding
  // those kernels apply to every K/V element they load, so the results are the same bits) at
  // half the bytes and half the attention's K/V traffic, the default; false: float32 (kept so
  // tests can show both give the same bits). No effect on the float32 kernels' layers
  // (CanvasAttention, PrefillAttention, CanvasAttentionTable: tensor_core_attention off, the
  // float32 GEMM-input mode, or a head_dim the tensor cores do not take): their mirrors stay
  // float32. The host KvCache stays float32 either way.
  bool bf16_kv_mirror = true;
  // The device mirror is the authority for the rows the encoder passes write (issue 34 item 1):
  // they stay in device memory only, with no copy to the host in the pass, until
  // ModelBackend::SyncKvToHost copies the rows the cache keeps (KvCache::host_rows_stale() is set
  // meanwhile, so the CPU backend, PagedKvCache::Fork and the KV transports refuse the cache
  // rather than read stale rows). The default. It applies to caches whose sliding layers keep a
  // bounded number of rows (KvCache::MaxSlidingRowsKept: ContiguousKvCache W − 1, PagedKvCache
  // W + 2·block_size − 2), whose sliding rings then hold max(W, that bound) rows, so every row the
  // host keeps is still on the device when it is asked for; other caches get the copy in the
  // pass. A mirror holding rows its live cache lacks is never evicted for max_kv_mirrors (which
  // then bounds only the others; one whose cache is gone is dropped first), and is dropped for
  // the block pool only once its rows are copied to the cache (swap-out: kv_pool_max_bytes). In the
  // bf16 mirror (the default in the bf16 mode) SyncKvToHost writes the bf16 values widened: the
  // rows every attention of that mode reads (spec §5.3), not the float32 values before rounding.
  // false: the pass copies its new rows to the host cache (encode_staging_bytes), as before.
  bool defer_kv_host_copy = true;
  // K/V on the device in one block pool per layer kind (full, sliding) shared by every
  // sequence (issue 34 item 1), the default: a block holds this many consecutive positions of
  // every layer of its kind; each sequence's mirror holds a block table per kind, and the
  // attention kernels read K/V through it (the paged layout of cuda_attention.h). Full layers
  // hold a block for every position; sliding layers only the blocks of the window the next pass
  // reads (and of the rows the host cache still needs, defer_kv_host_copy), the others going back
  // to the pool as the sequence advances. Pools grow by doubling, at most
  // kv_pool_max_growth_bytes at a time, and shrink only when compacted at kv_pool_max_bytes
  // (below); blocks of
  // an evicted or finished sequence's mirror are reused. 0: one mirror per sequence with its own
  // arrays grown by doubling (sliding rings: sliding_kv_ring), the former layout, kept so tests
  // can show both give the same bits.
  int kv_block_size = 64;
  // The device K/V block pools' bound in bytes (both kinds; 0: none but the device's memory).
  // A pool at the bound (or refused memory by the device) takes a free or cached block, else the
  // blocks of idle sequences' mirrors, least recently used first (their rows are on the host: a
  // later pass uploads them again), else those of idle sequences whose rows only the device has,
  // once copied to their caches (swap-out, as SyncKvToHost: CudaKvPoolStats::swap_outs); at the
  // bound (not where only the device refuses), first and last, the memory of the other kind's
  // blocks no sequence holds (that pool compacted and shrunk: CudaKvPoolStats::compactions); a pass
  // that still lacks a block (its own sequences need more than the bound holds) fails with
  // RESOURCE_EXHAUSTED, changing no cache: a caller may run its inputs in smaller batches (both
  // workers do). ModelBackend::CheckKvFits refuses a sequence that alone needs more than the bound.
  // 0: the bound memory_utilization gives (below), if any.
  size_t kv_pool_max_bytes = 0;
  // The most device memory one growth of a K/V block pool maps (the pool's arrays of every
  // layer of its kind, as mapped), however large the pool: a growth doubles the pool up to this
  // (at least one block). Mapping costs per granule and synchronizes with the device (PyTorch's
  // expandable segments, pytorch/pytorch#96995), and a growth happens inside a pass: the last
  // doubling of a 75 GB pool would map 19,000 granules of 2 MiB in one pass. Steps of 1 GiB
  // (512 granules) bound that stall, and a pool maps memory only as it needs it, leaving the
  // rest of the bound to the other kind's pool (fewer compactions) and to the passes' buffers.
  // CudaKvPoolStats::growths counts them. 0: no limit (doubling).
  size_t kv_pool_max_growth_bytes = size_t(1) << 30;
  // Where kv_pool_max_bytes is 0 (and kv_block_size > 0): the fraction of the device's memory
  // this backend may use, as vLLM's --gpu-memory-utilization. The K/V pools' bound is
  // memory_utilization · total − this backend's own device memory once its weights are on the
  // device (the free memory before CreateCudaBackend / CreateCudaBackendSynthetic less after),
  // and at most the memory free then (the pools grow in place, cuda_reserved_memory.h, so they
  // can reach all of it). The rest of the fraction is left to the passes' buffers, which grow
  // with the batch (not measured; at 1.0 nothing is left to them). Backends sharing a device (two
  // processes, or dgserve-server's roles) each take their fraction, as vLLM's instances do: give
  // them fractions that sum to at most 1. In [0, 1]; 0: no bound but the device's memory (and no
  // compaction; a growth then takes at most half the free memory, so the passes' buffers keep
  // some). FAILED_PRECONDITION at creation where that leaves less than one block of each kind.
  double memory_utilization = 0.9;
  // Device K/V blocks shared between sequences (with kv_block_size > 0), the default: a block
  // whose positions its cache has all committed is registered under the host identity of its
  // rows (KvCache::SharedRowsId: kvstore's paged blocks, shared by a prefix hit or a fork), and
  // another sequence about to upload the same rows takes the block instead (no upload, no second
  // copy). A registered block no sequence holds any more (a finished prompt's) is kept with its
  // rows until the pool needs a block and has no free one: a later prefix hit on the host finds
  // its rows still on the device. false: every sequence uploads its own copy.
  bool share_kv_blocks = true;
};

// What the CUDA-graph path of a backend (CudaBackendOptions::cuda_graphs) has done so far.
struct CudaGraphStats {
  int64_t eager_steps = 0;       // steps run launch by launch (first sight of a shape, graphs off)
  int64_t captures = 0;          // graphs captured and instantiated
  int64_t replays = 0;           // steps run as a graph launch
  int64_t invalidated = 0;       // graphs dropped because a device buffer moved
  int64_t capture_failures = 0;  // shapes CUDA refused to capture (run eagerly since)
  std::string last_failure;      // the status of the last refused capture
};
// The graph counters of a backend made by CreateCudaBackend or CreateCudaBackendSynthetic;
// nullopt for any other backend.
std::optional<CudaGraphStats> GetCudaGraphStats(const ModelBackend& backend);

// The K/V bytes a backend has moved between the host caches and its device mirrors so far.
struct CudaKvCopyStats {
  // Encoder passes' new K/V rows copied to the host caches (float32): every row of the full
  // layers, and of the sliding layers only those the cache keeps (KvCache::SlidingRetainedFrom
  // of the pass's final token count): a 32k prompt's sliding layers copy their last W − 1 rows
  // (or a few blocks more), not 32k.
  int64_t encode_to_host_bytes = 0;
  // Rows uploaded from host caches into device mirrors (a cache the backend has not seen, or
  // rows another writer added), as stored on the device (2 bytes an element in a bf16 mirror).
  int64_t upload_bytes = 0;
  // Rows SyncKvToHost copied to the host caches (the deferred host copy), as stored on the
  // device.
  int64_t sync_to_host_bytes = 0;
};
// The copy counters of a backend made by CreateCudaBackend or CreateCudaBackendSynthetic;
// nullopt for any other backend.
std::optional<CudaKvCopyStats> GetCudaKvCopyStats(const ModelBackend& backend);

// The device K/V block pools of a backend (CudaBackendOptions::kv_block_size > 0): blocks
// allocated on the device and held by mirrors, per layer kind, and their device bytes.
struct CudaKvPoolStats {
  int block_size = 0;  // 0: per-sequence mirrors (no pool)
  int full_blocks = 0, full_blocks_in_use = 0;
  int sliding_blocks = 0, sliding_blocks_in_use = 0;
  // Blocks held by no sequence but kept for their rows (share_kv_blocks), per kind.
  int full_blocks_cached = 0, sliding_blocks_cached = 0;
  // Blocks a sequence took (shared or cached) instead of uploading their rows, both kinds.
  int64_t shared_blocks_taken = 0;
  // Idle sequences whose device-only rows were copied to their host caches to free their blocks
  // for a pass (the pool at its bound, or the device out of memory).
  int64_t swap_outs = 0;
  // A pool that could neither take nor grow a block while the other kind's pool held blocks no
  // sequence did: the other pool compacted and shrunk (its held blocks moved below the number
  // held, their rows copied on the device) so that both stay within the bound (one bound
  // shared by the two kinds, whatever the mix of long and short sequences). Compactions and the
  // blocks they moved.
  int64_t compactions = 0, blocks_moved = 0;
  // Growths of either pool (each maps at most CudaBackendOptions::kv_pool_max_growth_bytes).
  int64_t growths = 0;
  // K and V of every block allocated, every layer, as mapped: each layer's array is a multiple of
  // the device's allocation granularity (2 MiB on Hopper; the pools grow in place, see
  // cuda_reserved_memory.h).
  int64_t device_bytes = 0;
  // The pools' bound in bytes (kv_pool_max_bytes, else memory_utilization's; 0: none), and the
  // smallest bound that holds one block of each kind (the arrays rounded up as above).
  int64_t max_bytes = 0, min_bytes = 0;
};
// nullopt for a backend not made by CreateCudaBackend or CreateCudaBackendSynthetic.
std::optional<CudaKvPoolStats> GetCudaKvPoolStats(const ModelBackend& backend);

// Device bytes of K/V one sequence's mirror holds for `context_tokens` positions in a backend
// made with `options` (the KV mirror of cuda_backend_internal.h): K and V of every position on
// the full layers, of the window's ring (min(context_tokens, W) rows) on the sliding layers
// (every position without options.sliding_kv_ring); 2 bytes an element on the layers that store
// bf16 (options.tensor_core_attention in the bf16 GEMM-input mode and bf16_kv_mirror, head_dim a
// multiple of 32 up to 512), else 4 (float32). A mirror allocates capacity for its positions
// growing by doubling from 64, so its full layers may hold up to twice this many rows; with
// defer_kv_host_copy a paged cache's sliding rings hold W + 2·block_size − 2 rows, not W
// (KvCache::MaxSlidingRowsKept; 3 % more sliding bytes at blocks of 16). The real
// 30-layer shape (25 sliding layers of 8 × 256, 5 full of 2 × 512, W = 1024), float32
// (tensor_core_attention off, or the float32 GEMM-input mode): 503,316,480 bytes at 2k,
// 1,761,607,680 at 32k, 5,788,139,520 at 128k; bf16 (the default options): half
// (engine/cuda/DEVICE_CHECK.md). With the block pool (options.kv_block_size > 0, the default)
// whole blocks: ⌈context_tokens / B⌉ on full layers, on sliding layers those holding positions
// [context_tokens − (W − 1), context_tokens) (a deferred copy to a paged host cache may hold a
// block or two more until SyncKvToHost), with no doubling: the real shape's figures above at
// B = 64. context_tokens ≤ 0: 0.
int64_t CudaKvBytesPerSequence(const ModelConfig& config, int context_tokens,
                               const CudaBackendOptions& options = {});

// Device bytes the K/V mirror of `kv` allocates now in a backend made by CreateCudaBackend or
// CreateCudaBackendSynthetic (every layer's K and V arrays); nullopt for any other backend or
// when it holds no mirror of `kv`.
std::optional<int64_t> CudaKvMirrorBytes(const ModelBackend& backend, const KvCache& kv);

// Device time of the last DenoiseStep's phases (options.phase_timing), in milliseconds: the sum
// over the CUDA-event brackets of each phase. A bracket opens at the phase's first launch and
// closes at the phase's end or before any blocking call (a host↔device copy or a sync), and the
// next launch reopens it, so the host's own time between is in no phase: the step's wall time
// minus the sum of the phases is the host gap.
//   attention  q/k/v norms, RoPE, the KV appends and the attention kernels
//   moe        router, expert grouping, the expert GEMMs, the combine and its norm
//   dense      the embedding and SC input, the q/k/v/o projections, the dense MLP and the SC MLP
//              with the norms and residual adds between them, the final norm
//   vocab      the LM head, the vocabulary step, the self-conditioning soft embedding
struct CudaPhaseTimes {
  double attention_ms = 0, moe_ms = 0, dense_ms = 0, vocab_ms = 0;
  int brackets = 0;  // event pairs read
  double sum_ms() const { return attention_ms + moe_ms + dense_ms + vocab_ms; }
};
// The last DenoiseStep's phase times of a backend made by CreateCudaBackend or
// CreateCudaBackendSynthetic with phase_timing; nullopt for any other backend, without
// phase_timing or before the first step.
std::optional<CudaPhaseTimes> LastCudaPhaseTimes(const ModelBackend& backend);

// Uploads `weights` to the device and returns the backend. FAILED_PRECONDITION "no CUDA device
// found" without a usable GPU; INTERNAL on a CUDA or cuBLAS error (e.g. out of device memory).
// `weights` need not outlive the backend (everything the passes need is on the device), but the
// KvCaches passed to Encode/Decode/DenoiseStep must be alive during each call.
absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackend(
    const ModelConfig& config, const ModelWeights& weights, const CudaBackendOptions& options = {});

// The backend with the weights of dgserve-mkmodel's random checkpoint for `seed`
// (engine/model/synthetic_weights.h) generated on the device by a kernel (cuda_synthetic.h):
// the norms and scalars are made on the host (a few MB), every matrix is allocated on the
// device and filled there, so no checkpoint and no host copy of the matrices exists (the real
// 26B shape: about 52 GB of device memory, none on the host). Bit for bit the backend that
// CreateCudaBackend makes from SyntheticModelWeights(config, seed). Errors as CreateCudaBackend.
absl::StatusOr<std::unique_ptr<ModelBackend>> CreateCudaBackendSynthetic(
    const ModelConfig& config, uint64_t seed, const CudaBackendOptions& options = {});

}  // namespace dgserve
