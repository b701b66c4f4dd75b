// CPU primitives of the DiffusionGemma forward pass (spec §3.1), float32, row-major.
// Rows are tokens; every function works on `rows` independent rows of width `dim`. The math the
// CUDA backend shares (RopeInvFreq, RouteTopK) is in engine/model/model_math.h.
#pragma once

#include <cstdint>
#include <span>

namespace dgserve::cpu {

// y[r] = x[r] · (mean(x[r]²) + eps)^(−1/2) · w, per row (spec §3.1.1, Gemma 4: no +1 on w).
// `w` may be null for the weightless flavour (v_norm, router norm, SC post_norm).
// x, y: [rows, dim]; may alias. rms(0) = 0.
void RmsNorm(const float* x, const float* w, int rows, int dim, float eps, float* y);

// tanh-approximate GELU (PyTorch gelu_pytorch_tanh), spec §3.1.2.
float GeluTanh(float x);

// out[i] = gelu(gate[i]) · up[i] for n elements (the gated MLP's inner product, spec §3.1.3).
void GeluGate(const float* gate, const float* up, int64_t n, float* out);

// Rotates `heads` head vectors of width head_dim in place at position `pos` (NeoX / rotate-half
// layout: pairs (j, j + head_dim/2)), angles fp32(pos)·inv_freq[j] in float32 (inv_freq:
// RopeInvFreq, engine/model/model_math.h).
void ApplyRope(float* x, int heads, int head_dim, int pos, std::span<const float> inv_freq);

// x ← cap · tanh(x / cap) for n elements (final logit softcap, spec §3.1.6), computed as
// cap·(1 − 2/(1 + 2^(2x·log2e/cap))) with a degree-6 exp2 polynomial: absolute error ≤ 1e-5 at
// cap = 30. Every element gets the same bits whatever its position and the path (AVX2 lanes or
// SoftcapOne).
void Softcap(float* x, int64_t n, float cap);
float SoftcapOne(float x, float cap);
// True when element-wise vocabulary math (softcap, the vocabulary step's exp) runs on AVX2 lanes:
// the CPU has AVX2+FMA and the GEMM path is not forced to portable. Both give the same bits; the
// switch only lets one machine test both.
bool UseAvx2Elementwise();

}  // namespace dgserve::cpu
