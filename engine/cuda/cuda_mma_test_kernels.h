// Test kernels of the matrix-core wrapper (cuda_mma.cuh), for cuda_mma_test.cc (labels `gpu` and
// `gpu-emu`): one mma with the fragments loaded by hand as the PTX ISA lays them out, ldmatrix's
// lane mapping, and a small tiled GEMM through shared memory (cp.async, ldmatrix, mma). Device
// pointers; bf16 as uint16 bits. Each returns INTERNAL naming the kernel on a launch error.
#pragma once

#include <cstdint>

#include "absl/status/status.h"

namespace dgserve::cuda {

// d = c + a·b on one warp: a [16, 16] row-major, b [16, 8] row-major (k × n), c and d [16, 8]
// row-major float. The kernel builds each lane's a[4], b[2], d[4] from the ISA's formulas.
absl::Status MmaTileForTest(const uint16_t* a, const uint16_t* b, const float* c, float* d);

// d = c + a·b through mma.m16n8k32 .e4m3 on one warp: a [16, 32] and b [32, 8] (k × n) row-major
// e4m3 codes, c and d [16, 8] row-major float. Needs sm_89 or later on a device.
absl::Status MmaE4m3TileForTest(const uint8_t* a, const uint8_t* b, const float* c, float* d);

// One ldmatrix on one warp: `rows` [num_rows, 8] bf16 (16 bytes a row) is copied to shared
// memory, lane l passes the address of shared row row_of_lane[l], and out[l·4 + j] = its r[j]
// (entries j ≥ matrices left alone). matrices: 2 or 4; trans: the .trans form.
absl::Status LdMatrixForTest(const uint16_t* rows, int num_rows, const int32_t* row_of_lane,
                             int matrices, bool trans, uint32_t* out);

// c = a·bᵀ-or-b through the tensor cores: a [m, k] row-major; b [n, k] row-major when
// !b_k_major (the weights' layout: ldmatrix without .trans), [k, n] row-major when b_k_major
// (ldmatrix .trans); c [m, n] row-major float. 64×64 tiles, k in steps of 32 through a
// two-stage cp.async pipeline. m and n multiples of 64, k a multiple of 32 (checked).
absl::Status MmaGemmForTest(const uint16_t* a, const uint16_t* b, bool b_k_major, int m, int n,
                            int k, float* c);

}  // namespace dgserve::cuda
