// Flash-attention-style attention cores of the forward pass (spec §3.1.5, §3.4, §3.5), float32 on
// the device: scores = Q·Kᵀ with scale 1.0 (QK-norm replaces 1/√d), softmax over keys in float32
// with an online (running max / running sum) rescaling over key tiles, out = P·V. The [q, k]
// score matrix never exists in global memory. GQA: query head h reads KV head
// h / (num_heads / kv_heads). head_dim ≤ 512 (the model: 256 sliding, 512 full).
//
// Keys and values of one call are the concatenation [context ++ new]: `context.tokens` cached
// tokens immediately preceding the new tokens (positions P − context.tokens … P − 1, P = first new
// position) followed by the `rows` new tokens (positions P … P + rows − 1). Attention needs only
// relative positions, so P itself is not an argument.
//
// Every function takes device pointers, runs on `stream` (0 = the default stream) and returns
// INTERNAL naming the kernel on a CUDA error (INVALID_ARGUMENT for bad shapes).
//
// round_bf16 (the float32 kernels: PrefillAttention, CanvasAttention, CanvasAttentionTable): the
// reference's rounding (spec §5.3 items 4–6), that of the tensor-core kernels below and of the
// CPU backend's bf16 mode (engine/cpu/cpu_attention.h): q, K and V are rounded to bf16 (nearest
// even, NaN kept: ToBf16Bits) as they are loaded, and P·V multiplies bf16(exp(s − m)) while the
// running sum l adds the unrounded exp(s − m) (m: the running max over 32-key tiles, as the
// tensor-core kernels': a canvas's from its first visible key, a prefill's at positions multiple
// of 32, KvContext::position0); out = (Σ P·v) · (1 / l). The products of bf16 values are exact,
// so only the float32 addition order is left. false (the default): float32 throughout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// The cached context K/V of one layer, in one of three layouts:
//   contiguous  [tokens, kv_heads, head_dim] arrays (block_table == nullptr, ring == 0): context
//               token j is row j;
//   ring        [ring, kv_heads, head_dim] arrays (block_table == nullptr, ring ≥ tokens > 0): a
//               sliding layer's window kept modulo `ring` rows, context token j in row
//               (first_slot + j) % ring (first_slot: the position of token 0);
//   paged       a pool [num_blocks, block_size, kv_heads, head_dim] where context token j lives
//               in slot s = first_slot + j: block block_table[s / block_size], row
//               s % block_size of that block.
// tokens = 0 (no context) needs no pointers. A ring shorter than `tokens`, or a ring with a block
// table, is INVALID_ARGUMENT.
struct KvContext {
  const float* k = nullptr;
  const float* v = nullptr;
  int tokens = 0;
  const int32_t* block_table = nullptr;  // device int32, or nullptr for contiguous K/V
  int block_size = 0;                    // tokens per block (paged only)
  int first_slot = 0;                    // slot of context token 0 (paged and ring only)
  int ring = 0;                          // rows of a ring (0: not a ring)
  // The position of context token 0 (of the first new row without context), ≥ 0: PrefillAttention
  // runs its online softmax in key tiles starting at positions multiple of 32, as
  // TensorCorePrefillAttention does, so a row's result does not depend on the rows it is launched
  // with (its rounding in round_bf16 mode: the CPU's, engine/cpu/cpu_attention.h). 0 is fine
  // where the position is unknown (any origin gives a valid softmax); CanvasAttention ignores it.
  int position0 = 0;
};

// Largest head_dim the kernels support.
inline constexpr int kMaxAttentionHeadDim = 512;

// Encoder / prefill (spec §3.4): causal over [context ++ new]. New row r (position P + r) sees
// context and new keys with key_pos ≤ P + r and, when window > 0, P + r − key_pos < window (the
// sliding layers' W keys including itself); window ≤ 0 means no window (full layers).
// q: [rows, num_heads, head_dim]; k_new, v_new: [rows, kv_heads, head_dim];
// out: [rows, num_heads, head_dim] (must not overlap the inputs).
absl::Status PrefillAttention(const float* q, const float* k_new, const float* v_new, int rows,
                              const KvContext& context, int num_heads, int kv_heads, int head_dim,
                              int window, float* out, void* stream = nullptr,
                              bool round_bf16 = false);

// Decoder / canvas (spec §3.5 step 5): bidirectional, every canvas row sees all `rows` canvas
// keys plus a context prefix that is the same for every row: all context tokens when window ≤ 0
// (full layers), else the last min(context.tokens, window − 1) of them (sliding layers).
// Shapes as PrefillAttention.
absl::Status CanvasAttention(const float* q, const float* k_new, const float* v_new, int rows,
                             const KvContext& context, int num_heads, int kv_heads, int head_dim,
                             int window, float* out, void* stream = nullptr,
                             bool round_bf16 = false);

}  // namespace dgserve::cuda

namespace dgserve::cuda {

// ---- Tensor-core canvas attention (issue 34 item 2), one launch for a whole batch ----
//
// The decoder pass's bidirectional canvas attention of CanvasAttention for several segments
// (canvases) at once: bf16 Q, K and V into mma.sync m16n8k16 with float32 accumulation, the
// online softmax (running max and sum) in float32, GQA packing (the query heads of one KV head
// share each K/V tile). head_dim a multiple of 32 up to 512 (the model: 256 sliding, 512 full).
// Q and the new K/V are read as float32 and rounded to bf16 (nearest even) while a tile is
// staged in shared memory; so is a float32 context (CanvasSegment), while a bf16 context
// (CanvasSegmentBf16: the backend's bf16 mirror) is read as it is. Numbers: bf16 inputs,
// so about 1e-2 relative on outputs against a float64 reference (cuda_attention_test).
//
// One segment of the table (device memory): query rows [row0, row0 + rows) of q / k_new / v_new
// / out; every row sees context tokens [ctx_first, ctx_tokens) (the window start: 0 for full
// layers, CanvasWindowStart for sliding ones) and all `rows` canvas keys. Its context K/V
// ctx_k / ctx_v in one of three layouts (as KvContext's):
//   contiguous  [ctx_tokens, kv_heads, head_dim] (block_table == nullptr, ring == 0): token j is
//               row j;
//   ring        [ring, kv_heads, head_dim] (block_table == nullptr, ring > 0): token j is row
//               j % ring (a sliding layer's device mirror keeps only its window; needs
//               ring ≥ ctx_tokens − ctx_first, so the visible tokens have distinct rows);
//   paged       a pool [num_blocks, block_size, kv_heads, head_dim] (block_table != nullptr,
//               ring == 0): token j lives in slot s = first_slot + j, pool block
//               block_table[s / block_size], row s % block_size of it (first_slot: the slot of
//               context token 0, ≥ 0, e.g. a sliding layer's window starting mid-block). Only the
//               table entries of the visible tokens' slots are read (those of tokens before
//               ctx_first may hold anything), and only their rows.
// A segment with zero-initialised new fields (block_table, block_size, first_slot) is a
// contiguous or ring one, as before paging existed. The kernels trust the table: the segments
// are device memory the launch does not read on the host, so a bad segment (a ring with a block
// table, block_size ≤ 0, a block index outside the pool) is undefined behaviour; a caller that
// builds its table on the host checks each entry with CheckCanvasSegment first. block_size: any
// positive size is read correctly; ≥ 32 (the key tile) is the fast path — a tile of 32 keys then
// spans at most two blocks, so the tensor-core kernels read two table entries per tile and
// compute each key's pool row with one add (smaller blocks: one table read per key). Paged
// results are the same bits as the contiguous layout holding the same rows (the key tiles and
// their order do not depend on the layout).
// The context's element type T: float (CanvasSegment: the float32 mirror, which every kernel
// reads) or uint16_t (CanvasSegmentBf16: bf16 bits, the backend's bf16 mirror, which only the
// tensor-core kernels read: they round every K/V element to bf16 anyway, so a context stored
// rounded — ToBf16Bits / FloatToBf16, nearest even, NaN kept — gives the same bits as its
// float32 original). Both have the same layout. A bf16 context is read in 32-bit pairs: ctx_k and
// ctx_v must be 4-byte aligned (a cudaMalloc'd array, or an even element offset into one).
template <typename T>
struct CanvasSegmentOf {
  const T* ctx_k = nullptr;
  const T* ctx_v = nullptr;
  int row0 = 0;
  int rows = 0;
  int ctx_tokens = 0;
  int ctx_first = 0;
  int ring = 0;                          // rows of the context ring (0: contiguous or paged)
  const int32_t* block_table = nullptr;  // device int32 (paged), or nullptr
  int block_size = 0;                    // tokens per block (paged only; > 0)
  int first_slot = 0;                    // slot of context token 0 (paged only; ≥ 0)
};
using CanvasSegment = CanvasSegmentOf<float>;
using CanvasSegmentBf16 = CanvasSegmentOf<uint16_t>;
static_assert(sizeof(CanvasSegment) == sizeof(CanvasSegmentBf16));

// Host-side check of one segment as a caller builds it (before uploading the table): rows ≥ 0,
// 0 ≤ ctx_first ≤ ctx_tokens, context pointers set when a token is visible, and one layout —
// a ring (ring ≥ ctx_tokens − ctx_first) or a block table (block_size > 0, first_slot ≥ 0,
// first_slot + ctx_tokens + block_size < 2^31), never both. Does not read the device table's
// entries. Errors: INVALID_ARGUMENT naming the rule broken.
absl::Status CheckCanvasSegment(const CanvasSegment& segment);
absl::Status CheckCanvasSegment(const CanvasSegmentBf16& segment);

// First context token a canvas row sees (spec §3.5): 0 when window ≤ 0, else the last
// min(ctx_tokens, window − 1) tokens.
int CanvasWindowStart(int ctx_tokens, int window);

// CanvasAttention's float32 kernel for every segment of `segments` (a DEVICE table as
// TensorCoreCanvasAttention's) in one launch: segment s is computed exactly as CanvasAttention
// would compute it alone (the same bits) with q, k_new, v_new and out offset to its rows, the
// context ctx_k / ctx_v from token ctx_first (ctx_tokens − ctx_first tokens; sliding layers:
// ctx_first = CanvasWindowStart(ctx_tokens, window); contiguous, ring or paged as
// CanvasSegment's: a paged segment is read as a KvContext whose first_slot is
// first_slot + ctx_first) and `window` as CanvasAttention's. The grid
// depends only on max_rows (≥ every segment's rows), the heads and num_segments, so the launch's
// host arguments do not change with the contexts: the decoder step's CUDA graph reads each
// canvas's context from the table (issue 33 item 6). Errors: INVALID_ARGUMENT for bad shapes.
absl::Status CanvasAttentionTable(const float* q, const float* k_new, const float* v_new,
                                  const CanvasSegment* segments, int num_segments, int max_rows,
                                  int num_heads, int kv_heads, int head_dim, int window, float* out,
                                  void* stream = nullptr, bool round_bf16 = false);

// Runs every segment of `segments` (a DEVICE array of num_segments entries; total_rows ≥ the end
// of every segment's rows, the rows of q / k_new / v_new / out) in one launch whose grid depends
// only on total_rows and num_segments. A row's result does not depend on the other segments.
// q: [total_rows, num_heads, head_dim]; k_new, v_new: [total_rows, kv_heads, head_dim];
// out: [total_rows, num_heads, head_dim] (rows of no segment are left untouched).
absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegment* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       float* out, void* stream = nullptr);
// The same on a bf16 context (CanvasSegmentBf16): the float32 context's bits when the context
// holds its bf16 roundings.
absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegmentBf16* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       float* out, void* stream = nullptr);

// ---- Split-KV for long contexts ----
//
// Without splitting, a block of 16 (row, query head) pairs streams its segment's whole visible
// context: at batch 1 and 32k–128k context the grid has only total_rows·group/16 · kv_heads
// blocks, each walking every key. With max_splits > 1 the context is cut into splits of a fixed
// split_keys keys, split i holding context tokens [i·split_keys, (i + 1)·split_keys) — boundaries
// counted from context token 0, so they do not depend on ctx_first, the batch or the other
// segments. A segment uses the CanvasSplitCount(ctx_tokens, ctx_first, split_keys) consecutive
// splits holding its visible context [ctx_first, ctx_tokens); its canvas keys (the new rows) join
// the last of them (the one holding context token ctx_tokens − 1). One launch computes every
// (block, split slot) — grid (blocks, kv_heads, max_splits); a slot past a segment's count does
// nothing — writing each split's unnormalised O, running max m and running sum l (float32) to
// `scratch`; a second launch (the combine) merges each row's splits in ascending split order
// (M = max m, L = Σ l·e^(m − M), O = Σ O·e^(m − M), out = O · (1 / L)) into `out`. Only the
// combine writes `out`; rows of no segment are left untouched.
//
// A segment with one split gives exactly the bits of the unsplit path (the same key tiles in the
// same order; the combine of one split is O · (1 / l)), and a segment's splits depend only on its
// own ctx_tokens and ctx_first: so a row's result is the same bits alone or batched with longer
// or shorter segments, whatever max_splits the batch needs.
//
// Rule (the caller's): max_splits = the largest CanvasSplitCount of the launch's segments (≥ 1);
// max_splits = 1 runs the unsplit kernel alone (no scratch, no combine). A segment needing more
// splits than max_splits gets NaN outputs (the bound must cover every segment). scratch: a device
// buffer of at least TensorCoreCanvasScratchBytes(total_rows, num_heads, head_dim, max_splits)
// bytes (may be null when that is 0), owned by the caller; nothing is allocated and both
// launches run on `stream` (CUDA-graph capturable; the grid depends on max_splits, so a captured
// graph is only valid for the max_splits it was captured with). split_keys: a positive multiple
// of 32 (the key tile); the backend uses kCanvasSplitKeys.
inline constexpr int kCanvasSplitKeys = 4096;

// The number of splits of split_keys context keys a canvas segment's keys use (≥ 1).
int CanvasSplitCount(int ctx_tokens, int ctx_first, int split_keys = kCanvasSplitKeys);

// Bytes of split-KV scratch: max_splits · total_rows · num_heads · (head_dim + 2) floats (0 when
// max_splits ≤ 1).
size_t TensorCoreCanvasScratchBytes(int total_rows, int num_heads, int head_dim, int max_splits);

// TensorCoreCanvasAttention with split-KV (max_splits > 1) as above; max_splits = 1 is the
// unsplit launch.
absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegment* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       int max_splits, int split_keys, void* scratch, float* out,
                                       void* stream = nullptr);
// The same on a bf16 context (CanvasSegmentBf16): the float32 context's bits when the context
// holds its bf16 roundings.
absl::Status TensorCoreCanvasAttention(const float* q, const float* k_new, const float* v_new,
                                       const CanvasSegmentBf16* segments, int num_segments,
                                       int total_rows, int num_heads, int kv_heads, int head_dim,
                                       int max_splits, int split_keys, void* scratch, float* out,
                                       void* stream = nullptr);

// ---- Tensor-core causal prefill attention (issue 34 items 2–3), one launch for a whole batch ----
//
// The encoder pass's causal attention of PrefillAttention for several segments (prompts, or the
// commit of several canvases) at once, on the kernel of TensorCoreCanvasAttention (bf16 Q/K/V
// rounded from the float32 arrays, mma.sync m16n8k16, float32 online softmax, GQA packing; head_dim
// a multiple of 32 up to 512; about 1e-2 relative against float64). New row r of a segment
// (position P + r, P = ctx_tokens) sees key_pos ≤ P + r and, when window > 0,
// P + r − key_pos < window, and no context token before ctx_first. A block of rows loads only the
// key tiles some of its rows see (none above the diagonal or before the window).
//
// One segment of the table (device memory), CanvasSegment's fields: new rows [row0, row0 + rows)
// of q / k_new / v_new / out (positions ctx_tokens … ctx_tokens + rows − 1); its context K/V
// ctx_k / ctx_v, contiguous [ctx_tokens, kv_heads, head_dim] (token j is row j), a ring of
// `ring` rows (token j is row j % ring) or a paged pool through block_table (token j in slot
// first_slot + j), as CanvasSegment's; only tokens ≥ ctx_first are read: 0
// for full layers, CanvasWindowStart(ctx_tokens, window) — row 0's window start — for sliding
// ones. The segment's own rows are read from k_new / v_new, so a ring needs only
// ring ≥ ctx_tokens − ctx_first (the context part of the window), whatever `rows` is.
using PrefillSegment = CanvasSegment;
using PrefillSegmentBf16 = CanvasSegmentBf16;  // a bf16 context (CanvasSegmentBf16)

// Runs every segment of `segments` (a DEVICE array of num_segments entries) in one launch whose
// grid depends only on total_rows, num_segments and kv_heads (not on context lengths); a row's
// result does not depend on the other segments. window ≤ 0: no window (full layers). Shapes as
// TensorCoreCanvasAttention; rows of no segment are left untouched.
absl::Status TensorCorePrefillAttention(const float* q, const float* k_new, const float* v_new,
                                        const PrefillSegment* segments, int num_segments,
                                        int total_rows, int num_heads, int kv_heads, int head_dim,
                                        int window, float* out, void* stream = nullptr);
// The same on a bf16 context (PrefillSegmentBf16): the float32 context's bits when the context
// holds its bf16 roundings.
absl::Status TensorCorePrefillAttention(const float* q, const float* k_new, const float* v_new,
                                        const PrefillSegmentBf16* segments, int num_segments,
                                        int total_rows, int num_heads, int kv_heads, int head_dim,
                                        int window, float* out, void* stream = nullptr);

}  // namespace dgserve::cuda
