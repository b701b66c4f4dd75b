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
  bool b_bf16 = false;  // (portable FTZ kernels only: set by their run from its argument)
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
// The portable kernels of the bf16-input mode's emulation (gemm.h): A already bf16 values, and
// every fma step DAZ in (B and the running sum) and FTZ out, in software. (The AVX2 and AVX-512F
// kernels need no variant: gemm.cc sets MXCSR's FTZ and DAZ bits around them.)
KernelSet PortableFtzKernels();

// A tile of the native bf16-input kernels (VDPBF16PS), over one k block of `pairs` pairs of k.
struct TileBf16 {
  int pairs = 0;
  const uint16_t* a = nullptr;   // A's pairs (GemmABf16::pairs layout) at (first row, block start)
  int64_t lda = 0;               // bf16 elements between rows
  const uint16_t* b0 = nullptr;  // panel 0 in pair layout: pair p at b0 + p·b_pstride, 16 columns
  const uint16_t* b1 = nullptr;  //   × (k+1 low, k high) = 32 bf16; panel 1 or null
  int64_t b_pstride = 0;
  // Direct: b0/b1 point at B's panels as stored ([k][16] bf16, b_kstride apart) and the kernel
  // forms the pairs in registers (as pack_pairs does) over kc k steps; `pairs` is then unused.
  bool direct = false;
  int kc = 0;
  int64_t b_kstride = 0;
  float* c = nullptr;
  int64_t ldc = 0;
  bool load_c = false;
};

// The native bf16-input kernels.
struct Bf16KernelSet {
  int max_rows = 1;
  int max_panels = 1;
  // rows in [1, max_rows], panels in [1, max_panels].
  void (*run)(int rows, int panels, const TileBf16& tile) = nullptr;
  // kc k steps of 16 bf16 columns of B (src[kk·src_kstride + j]) into ⌈kc/2⌉ pairs at
  // dst + p·dst_pstride: element 2j = B(2p+1, j), 2j+1 = B(2p, j); an odd kc's last pair has +0
  // in its low half.
  void (*pack_pairs)(int kc, const uint16_t* src, int64_t src_kstride, uint16_t* dst,
                     int64_t dst_pstride) = nullptr;
  // The first n (a multiple of 32) values of a row of A rounded as RoundActivationToBf16 does
  // (VCVTNE2PS2BF16: DAZ, nearest even), in pair layout: dst[2p] = bf16(a[2p+1]), dst[2p+1] =
  // bf16(a[2p]).
  void (*round_pairs)(const float* a, int n, uint16_t* dst) = nullptr;
};
Bf16KernelSet Avx512Bf16Kernels();  // needs AVX-512F, AVX-512BW and AVX512_BF16

}  // namespace dgserve::cpu::gemm_internal
