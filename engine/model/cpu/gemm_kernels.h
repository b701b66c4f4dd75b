// Internal to the GEMM (gemm.cc and the per-ISA microkernel files): the microkernel interface.
// A microkernel computes a tile of `rows` × (16 · panels) outputs over one k block, each output one
// fma chain over the block's k in ascending order, continuing from C when load_c.
#pragma once

#include <cstdint>

namespace dgserve::cpu::gemm_internal {

struct Tile {
  int kc = 0;                // k steps of this block
  const float* a = nullptr;  // A at (first row, first k of the block)
  int64_t lda = 0;
  const void* b0 = nullptr;  // panel 0 at the block's first k (float or bf16 elements)
  const void* b1 = nullptr;  // panel 1 (two-panel tiles) or null
  int64_t b_kstride = 0;     // elements between k and k+1 in a panel
  float* c = nullptr;        // C at (first row, first column)
  int64_t ldc = 0;
  bool load_c = false;  // continue the chains from C (else start from 0)
};

// One instruction set's microkernels.
struct KernelSet {
  int max_rows = 1;    // rows per call at most
  int max_panels = 1;  // 16-column panels per call at most
  // rows in [1, max_rows], panels in [1, max_panels]; full panels only.
  void (*run)(int rows, int panels, bool bf16, const Tile& tile) = nullptr;
  // Copies kc k steps of 16 columns of B as float32 (bf16 widened exactly):
  // dst[kk·dst_kstride + j] = B(src[kk·src_kstride + j]) for kk < kc, j < 16.
  void (*pack)(int kc, const void* src, int64_t src_kstride, bool bf16, float* dst,
               int64_t dst_kstride) = nullptr;
};

KernelSet PortableKernels();
KernelSet Avx2Kernels();    // needs AVX2 + FMA
KernelSet Avx512Kernels();  // needs AVX-512F

}  // namespace dgserve::cpu::gemm_internal
