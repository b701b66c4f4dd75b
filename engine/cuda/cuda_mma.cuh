// The matrix-core instructions our tensor-core kernels use, one function each (sm_80 and later;
// built for sm_90): inline PTX under nvcc, and under the host emulation (DGSERVE_CUDA_EMULATION,
// engine/cuda/emu/cuda_emu_mma.cc) warp collectives that reproduce the PTX fragment layouts, so
// that a kernel's fragment indexing is tested in CI without a GPU (label gpu-emu; see
// engine/cuda/README.md).
//
// Fragment layouts: NVIDIA PTX ISA (docs.nvidia.com/cuda/parallel-thread-execution), sections
// "Matrix Fragments for mma.m16n8k16 with floating point type" and "Warp-level matrix load
// instruction: ldmatrix". groupID g = lane >> 2, t = lane % 4; element i of a fragment is in
// register i / 2, half i % 2 (the lower index in the low 16 bits of the register):
//   A 16×16 bf16, row-major (.row):   a[0] = A[g][2t..2t+1]      a[1] = A[g+8][2t..2t+1]
//                                     a[2] = A[g][2t+8..2t+9]    a[3] = A[g+8][2t+8..2t+9]
//   B 16×8 bf16 (k × n), .col:        b[0] = B[2t..2t+1][g]      b[1] = B[2t+8..2t+9][g]
//   C, D 16×8 float:                  d[0], d[1] = D[g][2t], D[g][2t+1]
//                                     d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
//   ldmatrix .m8n8 .b16 (x2: matrices 0–1, x4: 0–3): lane 8j + r passes the address of row r of
//   matrix j (16 bytes, 16-byte aligned, in shared memory; for x2 the addresses of lanes 16–31
//   are not used); lane l receives in r[j] elements (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of matrix
//   j, or with .trans elements (2(l%4), l/4) and (2(l%4)+1, l/4).
//   mma.m16n8k32 .e4m3 (section "Matrix Fragments for mma.m16n8k32", 8-bit types; four e4m3
//   codes a register, the lower index in the lower byte):
//   A 16×32 e4m3, .row:               a[0] = A[g][4t..4t+3]      a[1] = A[g+8][4t..4t+3]
//                                     a[2] = A[g][4t+16..4t+19]  a[3] = A[g+8][4t+16..4t+19]
//   B 32×8 e4m3 (k × n), .col:        b[0] = B[4t..4t+3][g]      b[1] = B[4t+16..4t+19][g]
//   C, D 16×8 float as for m16n8k16. So with A and W stored row-major ([m][k], [n][k]: k
//   contiguous) every register is one aligned 32-bit word of a row.
//   So for A at (row0, col0) of a row-major tile: LdMatrixX4 with lane l passing
//   &tile[row0 + l % 16][col0 + (l / 16) * 8] gives a[0..3]; for B stored n-major ([n][k], k
//   contiguous) LdMatrixX2 with &Bs[n0 + l % 8][k0 + ((l / 8) % 2) * 8] gives b[0..1]; for B
//   stored k-major ([k][n]) LdMatrixX2Trans with &Bs[k0 + l % 16][n0] gives b[0..1].
//
// Every lane of the warp must execute each of these together (.sync.aligned): under the
// emulation a warp in which a lane has exited, or waits at another collective, fails the launch;
// so does an ldmatrix row address or a cp.async address that is not 16-byte aligned.
//
// Accumulation: each product of two bf16 values (or of two e4m3 values) is exact in float32.
// The order in which the hardware adds the products of one mma to C is not specified by the ISA;
// the emulation adds them to C one at a time in ascending k, rounding each addition to float32.
// (FP8 mma on Hopper is reported to keep fewer accumulator bits within one instruction; the
// FP8 tests' exact cases use sums that fit 14 bits.) Tests compare
// with a float64 reference and a tolerance (or use values whose sums are exact), never bit for
// bit between the device and the emulation.
//
// cp.async.cg.shared.global (16 bytes, L2 only): the copy is in flight until a wait covers its
// group. The emulation does the copy at that wait, so a read of the destination before it (by
// the issuing thread, or by another thread without the wait and a __syncthreads in between)
// sees the old contents: 0xFF bytes in fresh dynamic shared memory.
#pragma once

#include <cstdint>

#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda::mma {

#if defined(__CUDACC__)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "engine/cuda/cuda_mma.cuh needs sm_80 or later (mma.sync bf16, ldmatrix, cp.async)"
#endif

// d += A·B: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with C = D = d.
__device__ __forceinline__ void MmaBf16M16N8K16(float d[4], const uint32_t a[4],
                                                const uint32_t b[2]) {
#if defined(__CUDA_ARCH__)
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += A·B: mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 with C = D = d (sm_89 and later;
// the FP8 tensor cores of the FP8 checkpoints, engine/cuda/cuda_fp8.h).
__device__ __forceinline__ void MmaE4m3M16N8K32(float d[4], const uint32_t a[4],
                                                const uint32_t b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  __trap();  // FP8 mma needs sm_89
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (smem_row: this lane's row, see above).
__device__ __forceinline__ void LdMatrixX4(uint32_t r[4], const void* smem_row) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// ldmatrix.sync.aligned.m8n8.x2.shared.b16.
__device__ __forceinline__ void LdMatrixX2(uint32_t r[2], const void* smem_row) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
#endif
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t r[4], const void* smem_row) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
#endif
}

// ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16.
__device__ __forceinline__ void LdMatrixX2Trans(uint32_t r[2], const void* smem_row) {
#if defined(__CUDA_ARCH__)
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(addr)
               : "memory");
#endif
}

// cp.async.cg.shared.global [smem], [gmem], 16: both addresses 16-byte aligned.
__device__ __forceinline__ void CpAsync16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__)
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr),
               "l"(__cvta_generic_to_global(gmem))
               : "memory");
#endif
}

// cp.async.commit_group: the copies issued since the last commit form a group.
__device__ __forceinline__ void CpAsyncCommit() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// cp.async.wait_all: every copy of this thread has landed (committed or not).
__device__ __forceinline__ void CpAsyncWaitAll() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// cp.async.wait_group N: all but the N most recently committed groups of this thread have landed.
template <int N>
__device__ __forceinline__ void CpAsyncWaitGroup() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

#elif defined(DGSERVE_CUDA_EMULATION)

inline void MmaBf16M16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::MmaBf16M16N8K16(d, a, b);
}
inline void MmaE4m3M16N8K32(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  emu::MmaE4m3M16N8K32(d, a, b);
}
inline void LdMatrixX4(uint32_t r[4], const void* smem_row) {
  emu::LdMatrix(4, false, r, smem_row);
}
inline void LdMatrixX2(uint32_t r[2], const void* smem_row) {
  emu::LdMatrix(2, false, r, smem_row);
}
inline void LdMatrixX4Trans(uint32_t r[4], const void* smem_row) {
  emu::LdMatrix(4, true, r, smem_row);
}
inline void LdMatrixX2Trans(uint32_t r[2], const void* smem_row) {
  emu::LdMatrix(2, true, r, smem_row);
}
inline void CpAsync16(void* smem, const void* gmem) { emu::CpAsync(smem, gmem, 16); }
inline void CpAsyncCommit() { emu::CpAsyncCommit(); }
inline void CpAsyncWaitAll() { emu::CpAsyncWait(-1); }
template <int N>
void CpAsyncWaitGroup() {
  static_assert(N >= 0, "cp.async.wait_group N: N >= 0");
  emu::CpAsyncWait(N);
}

#endif

}  // namespace dgserve::cuda::mma
