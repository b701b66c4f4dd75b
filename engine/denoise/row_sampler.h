// The fused per-row sampling kernel of the denoising loop (spec §4.2 steps 3–4, golden README §4):
// one vocabulary-sized row of logits in, argmax / entropy / log-sum-exp / inverse-CDF sample out,
// optionally the softmax probabilities written back in place (for self-conditioning, spec §3.5).
#pragma once

#include <cstdint>
#include <span>

namespace dgserve {

// Per-row results. Units: nats.
struct RowResult {
  int32_t argmax = 0;   // argmax of the raw logits ℓ (first index on ties).
  int32_t sampled = 0;  // inverse-CDF sample from p = softmax(ℓ/T), always an index with p > 0.
  float entropy = 0.f;  // H = −Σ p log p (0·log 0 := 0), ≥ 0.
  float lse = 0.f;      // log Σ exp(ℓ/T).
};

// Samples one row (spec §4.2 step 4; golden README §4). `row` holds `vocab` ≥ 1 float32 logits
// (already softcapped; finite, or −inf for masked ids, at least one finite); `temperature` T > 0
// and finite; `u` in [0, 1) (values outside are clamped into it, NaN → 0). When `write_probs` is
// true the row is overwritten with p_i = e_i · fl(1/S); otherwise it is not modified.
//
// Numerics: e_i = 2^{w_i} with w_i = fl(fl(ℓ_i − max ℓ) · k), k = fl(log2(e) / T) (so
// e_i ≈ exp((ℓ_i − max ℓ)/T), e = 1 at the max), evaluated with the Cephes exp2f polynomial
// (relative error ≤ 1.7e-7 beyond the float32 argument rounding) and flushed to 0 below 2^−126
// ((ℓ_i − max ℓ)/T < −87.68). S = Σ e_i and Σ e_i·w_i are accumulated in 8 float lanes per block of
// 1024 ids and in double across blocks; then H = log S − ln2·(Σ e_i w_i)/S and
// lse = max ℓ / T + log S in double, rounded to float (H clamped at 0). sampled = the first id
// whose running sum of e exceeds u·S, so u = 0 gives the first id with p > 0; if rounding leaves
// no such id, the last id with p > 0. Passes over the row: max/argmax; exp and sums (plus the
// in-place write of e); the 1/S scale when `write_probs`. Sampling rescans only one 1024-id block.
// Results are a pure function of the inputs for a given CPU dispatch path (AVX2+FMA or baseline
// SSE2); the two paths differ only by rounding (FMA contraction).
RowResult SampleRow(float* row, int vocab, float temperature, float u, bool write_probs);

// Read-only variant of SampleRow (write_probs = false).
RowResult SampleRow(const float* row, int vocab, float temperature, float u);

// Samples `rows` consecutive rows of `logits` ([rows, vocab] row-major) with one temperature,
// parallelised over rows with OpenMP. Requires uniforms.size() ≥ rows and out.size() ≥ rows;
// out[r] = SampleRow(logits + r·vocab, vocab, temperature, uniforms[r], write_probs). Results do
// not depend on the thread count or schedule.
void SampleRows(float* logits, int rows, int vocab, float temperature,
                std::span<const float> uniforms, bool write_probs, std::span<RowResult> out);

// As above with a temperature per row (temperatures.size() ≥ rows), for batches that mix canvases
// at different steps.
void SampleRows(float* logits, int rows, int vocab, std::span<const float> temperatures,
                std::span<const float> uniforms, bool write_probs, std::span<RowResult> out);

// Kernel variants. kAuto picks kAvx2Fma when the CPU supports AVX2 and FMA, else kBaseline
// (SSE2, any x86-64). The variants agree to rounding (FMA contraction), not bit for bit.
enum class RowKernel { kAuto, kBaseline, kAvx2Fma };

// SampleRow with an explicit kernel variant (tests, benchmarks). kAvx2Fma on a CPU without
// AVX2+FMA runs kBaseline.
RowResult SampleRowWithKernel(RowKernel kernel, float* row, int vocab, float temperature, float u,
                              bool write_probs);

// The variant kAuto selects on this CPU: "avx2+fma" or "baseline".
const char* RowSamplerIsa();

}  // namespace dgserve
