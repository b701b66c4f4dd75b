// The cost model of engine_bench: what one denoising step of a ModelConfig computes and reads
// (FLOPs and bytes per phase) and what it holds in memory, counted from the spec's forward pass
// (spec §3.2–§3.5) and the checkpoint's tensor list, for the "% of ceiling" figures.
#pragma once

#include "engine/model/config.h"

namespace dgserve::bench {

// Multiply-adds ×2 of one decoder pass over `rows` canvas rows with `ctx` context tokens,
// excluding the LM head (the body), per spec §3.2–§3.5.
double BodyFlops(const ModelConfig& c, int rows, int ctx);

// Bytes of bf16 weights one denoising step reads: every matrix (rank ≥ 2) once, plus the
// embedding a second time (LM head and self-conditioning product both read it).
double Bf16BytesPerStep(const ModelConfig& c);

// Bytes of one sequence's KV cache (float32 K and V of every layer for `positions` positions):
// the host ContiguousKvCache and the CUDA backend's device mirror each hold this much.
double KvBytesPerSequence(const ModelConfig& c, int positions);

// Device scratch per stacked canvas row (the CUDA backend's activations, MoE buffers, bf16 GEMM
// input, fp32 logits and bf16 probabilities), an upper estimate.
double DeviceBytesPerRow(const ModelConfig& c);

// What one step's phases read and compute, for the table of % of ceiling (PHASE lines).
struct PhaseWork {
  double dense_bytes = 0, moe_bytes = 0, vocab_bytes = 0, attn_bytes = 0;
  double dense_flops = 0, moe_flops = 0, vocab_flops = 0, attn_flops = 0;
};
// The phases of one step of `batch` canvases of `rows_per_canvas` rows over `ctx` context tokens.
PhaseWork StepWork(const ModelConfig& c, int rows_per_canvas, int batch, int ctx);

}  // namespace dgserve::bench
