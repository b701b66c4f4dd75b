// First CUDA kernels of the GPU backend (issue #5): the elementwise and per-row operations of
// the forward pass, float32 on the device. Every function takes device pointers, runs on
// `stream` (0 = the default stream) and returns cudaGetLastError() as a Status (INTERNAL naming
// the kernel). The projections (cuda_gemm.h), attention (cuda_attention.h) and the fused
// vocabulary step (cuda_vocab.h) live next to these; the CUDA backend (cuda_backend.h) chains
// them. All are compile-checked everywhere and tested against the CPU code on a GPU
// (label `gpu`) and, for their logic only, under the host emulation of emu/ (label `gpu-emu`).
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// Number of CUDA devices usable by this process (0 when there is no GPU or no driver).
int DeviceCount();

// y[r, :] = x[r, :] / sqrt(mean(x[r, :]²) + eps) (· w when w != nullptr), spec §3.1.2; the sum
// of squares in double, as cpu::RmsNorm. x, y: [rows, dim]; w: [dim] or nullptr.
absl::Status RmsNorm(const float* x, const float* w, int rows, int dim, float eps, float* y,
                     void* stream = nullptr);

// x ← cap · tanh(x / cap) for n elements (spec §3.1.6).
absl::Status Softcap(float* x, int64_t n, float cap, void* stream = nullptr);

// out[i] = gelu_tanh(gate[i]) · up[i] for n elements (spec §3.1.3).
absl::Status GeluGate(const float* gate, const float* up, int64_t n, float* out,
                      void* stream = nullptr);

// Rotate-half RoPE (spec §3.1.4) in place: x is [rows, heads, head_dim]; row r sits at position
// positions[r]; inv_freq[head_dim/2] (0 = identity pair, the proportional variant's tail).
absl::Status ApplyRope(float* x, int rows, int heads, int head_dim, const int32_t* positions,
                       const float* inv_freq, void* stream = nullptr);

}  // namespace dgserve::cuda
