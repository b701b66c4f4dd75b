#include "engine/cuda/cuda_mma_test_kernels.h"

#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"
#include "engine/cuda/cuda_mma.cuh"

namespace dgserve::cuda {
namespace {

// Two bf16 values as one register: `lo` in bits 0–15 (the lower-indexed element), `hi` above.
__device__ __forceinline__ uint32_t Pack(uint16_t lo, uint16_t hi) {
  return uint32_t(lo) | uint32_t(hi) << 16;
}

// The fragments written out from the PTX ISA's formulas (cuda_mma.cuh), g = lane / 4,
// t = lane % 4: a[i/2] holds a_i and a_{i+1} at (row, col) of A; b[i/2] holds b_i, b_{i+1}.
__global__ void MmaTileKernel(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  uint32_t af[4], bf[2];
  af[0] = Pack(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);                  // a0, a1
  af[1] = Pack(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);      // a2, a3
  af[2] = Pack(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);              // a4, a5
  af[3] = Pack(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);  // a6, a7
  bf[0] = Pack(b[(2 * t) * 8 + g], b[(2 * t + 1) * 8 + g]);                // b0, b1
  bf[1] = Pack(b[(2 * t + 8) * 8 + g], b[(2 * t + 9) * 8 + g]);            // b2, b3
  float df[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                 c[(g + 8) * 8 + 2 * t + 1]};
  mma::MmaBf16M16N8K16(df, af, bf);
  d[g * 8 + 2 * t] = df[0];
  d[g * 8 + 2 * t + 1] = df[1];
  d[(g + 8) * 8 + 2 * t] = df[2];
  d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

// Four e4m3 codes as one register: element 4j + q of a fragment in byte q of register j.
__device__ __forceinline__ uint32_t Pack4(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}

// mma.m16n8k32 .e4m3 with the fragments built from the ISA's formulas (cuda_mma.cuh): a row-major
// [16, 32], b row-major [32, 8] (k × n), so B's column g, k 4t..4t+3, is gathered by hand.
__global__ void MmaE4m3TileKernel(const uint8_t* a, const uint8_t* b, const float* c, float* d) {
  const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
  uint32_t af[4], bf[2];
  af[0] = Pack4(a + g * 32 + 4 * t);             // a0..a3
  af[1] = Pack4(a + (g + 8) * 32 + 4 * t);       // a4..a7
  af[2] = Pack4(a + g * 32 + 4 * t + 16);        // a8..a11
  af[3] = Pack4(a + (g + 8) * 32 + 4 * t + 16);  // a12..a15
  for (int j = 0; j < 2; ++j) {
    const uint8_t col[4] = {b[(4 * t + 16 * j) * 8 + g], b[(4 * t + 16 * j + 1) * 8 + g],
                            b[(4 * t + 16 * j + 2) * 8 + g], b[(4 * t + 16 * j + 3) * 8 + g]};
    bf[j] = Pack4(col);  // b0..b3, b4..b7
  }
  float df[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t],
                 c[(g + 8) * 8 + 2 * t + 1]};
  mma::MmaE4m3M16N8K32(df, af, bf);
  d[g * 8 + 2 * t] = df[0];
  d[g * 8 + 2 * t + 1] = df[1];
  d[(g + 8) * 8 + 2 * t] = df[2];
  d[(g + 8) * 8 + 2 * t + 1] = df[3];
}

constexpr int kMaxLdRows = 64;

__global__ void LdMatrixKernel(const uint16_t* rows, int num_rows, const int32_t* row_of_lane,
                               int matrices, bool trans, uint32_t* out) {
  __align__(16) __shared__ uint16_t tile[kMaxLdRows * 8];
  const int lane = threadIdx.x;
  for (int i = lane; i < num_rows * 8; i += 32) tile[i] = rows[i];
  __syncwarp();
  const uint16_t* row = tile + row_of_lane[lane] * 8;
  uint32_t r[4];
  if (matrices == 4) {
    if (trans) {
      mma::LdMatrixX4Trans(r, row);
    } else {
      mma::LdMatrixX4(r, row);
    }
  } else if (trans) {
    mma::LdMatrixX2Trans(r, row);
  } else {
    mma::LdMatrixX2(r, row);
  }
  for (int j = 0; j < matrices; ++j) out[lane * 4 + j] = r[j];
}

// The GEMM: a block of 4 warps computes a 64×64 tile of c, each warp a 32×32 quarter
// (2 × 4 mma tiles of 16×8). Shared tiles are padded to rows of 80 (A, n-major B) or 144
// (k-major B) bytes: still 16-byte aligned, as ldmatrix and cp.async need.
constexpr int kTile = 64, kStepK = 32;
constexpr int kPadK = kStepK + 8;  // halves per row of the A and n-major B tiles
constexpr int kPadN = kTile + 8;   // halves per row of the k-major B tile
constexpr int kStageA = kTile * kPadK;
constexpr int kStageBN = kTile * kPadK, kStageBK = kStepK * kPadN;  // B n-major, k-major
constexpr int kStageB = kStageBN > kStageBK ? kStageBN : kStageBK;
constexpr size_t kGemmShared = size_t(2) * (kStageA + kStageB) * sizeof(uint16_t);

// Issues the copies of k-step `ks` into stage `s` (each thread two 16-byte chunks of A, two of B).
template <bool kBKMajor>
__device__ __forceinline__ void LoadStage(const uint16_t* a, const uint16_t* b, int n, int k,
                                          int m0, int n0, int ks, uint16_t* as, uint16_t* bs) {
  const int k0 = ks * kStepK;
  for (int i = 0; i < 2; ++i) {
    const int chunk = threadIdx.x + i * 128;
    const int row = chunk / 4, col = (chunk % 4) * 8;  // 64 rows of 4 chunks
    mma::CpAsync16(as + row * kPadK + col, a + size_t(m0 + row) * k + k0 + col);
    if (kBKMajor) {
      const int kr = chunk / 8, nc = (chunk % 8) * 8;  // 32 k-rows of 8 chunks
      mma::CpAsync16(bs + kr * kPadN + nc, b + size_t(k0 + kr) * n + n0 + nc);
    } else {
      mma::CpAsync16(bs + row * kPadK + col, b + size_t(n0 + row) * k + k0 + col);
    }
  }
}

template <bool kBKMajor>
__global__ void __launch_bounds__(128)
    MmaGemmKernel(const uint16_t* a, const uint16_t* b, int n, int k, float* c) {
  uint16_t* shared = DynamicShared<uint16_t>();
  uint16_t* as[2] = {shared, shared + kStageA};
  uint16_t* bs[2] = {shared + 2 * kStageA, shared + 2 * kStageA + kStageB};
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;  // the warp's quarter of the tile
  float acc[2][4][4] = {};
  const int steps = k / kStepK;

  LoadStage<kBKMajor>(a, b, n, k, m0, n0, 0, as[0], bs[0]);
  mma::CpAsyncCommit();
  for (int ks = 0; ks < steps; ++ks) {
    const int s = ks % 2;
    if (ks + 1 < steps) {
      LoadStage<kBKMajor>(a, b, n, k, m0, n0, ks + 1, as[1 - s], bs[1 - s]);
      mma::CpAsyncCommit();
      mma::CpAsyncWaitGroup<1>();  // stage s landed; stage 1 − s may still be in flight
    } else {
      mma::CpAsyncWaitGroup<0>();
    }
    __syncthreads();
    for (int kk = 0; kk < kStepK; kk += 16) {
      uint32_t af[2][4], bf[4][2];
      for (int mi = 0; mi < 2; ++mi) {
        // Matrices 0–3 = rows 0–7 / 8–15 × columns 0–7 / 8–15: a[0..3] of the ISA's A layout.
        mma::LdMatrixX4(af[mi], as[s] + (wm + mi * 16 + lane % 16) * kPadK + kk + (lane / 16) * 8);
      }
      if (kBKMajor) {
        // k rows of B: .trans gives the .col fragment; lanes 16–31 address the next 8 columns.
        for (int p = 0; p < 2; ++p) {
          uint32_t r[4];
          mma::LdMatrixX4Trans(r, bs[s] + (kk + lane % 16) * kPadN + wn + p * 16 + (lane / 16) * 8);
          bf[2 * p][0] = r[0];
          bf[2 * p][1] = r[1];
          bf[2 * p + 1][0] = r[2];
          bf[2 * p + 1][1] = r[3];
        }
      } else {
        // n rows of B (k contiguous): matrix 0 = k 0–7, matrix 1 = k 8–15 of 8 columns.
        for (int ni = 0; ni < 4; ++ni) {
          mma::LdMatrixX2(bf[ni],
                          bs[s] + (wn + ni * 8 + lane % 8) * kPadK + kk + ((lane / 8) % 2) * 8);
        }
      }
      for (int mi = 0; mi < 2; ++mi) {
        for (int ni = 0; ni < 4; ++ni) mma::MmaBf16M16N8K16(acc[mi][ni], af[mi], bf[ni]);
      }
    }
    __syncthreads();  // the stage is overwritten by the next step's copies
  }
  const int g = lane / 4, t = lane % 4;
  for (int mi = 0; mi < 2; ++mi) {
    for (int ni = 0; ni < 4; ++ni) {
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + wm + mi * 16 + g + (i >= 2 ? 8 : 0);
        const int col = n0 + wn + ni * 8 + 2 * t + (i & 1);
        c[size_t(row) * n + col] = acc[mi][ni][i];
      }
    }
  }
}

}  // namespace

absl::Status MmaTileForTest(const uint16_t* a, const uint16_t* b, const float* c, float* d) {
  LaunchKernel(MmaTileKernel, 1, 32, 0, nullptr, a, b, c, d);
  return Check("MmaTileKernel");
}

absl::Status MmaE4m3TileForTest(const uint8_t* a, const uint8_t* b, const float* c, float* d) {
  LaunchKernel(MmaE4m3TileKernel, 1, 32, 0, nullptr, a, b, c, d);
  return Check("MmaE4m3TileKernel");
}

absl::Status LdMatrixForTest(const uint16_t* rows, int num_rows, const int32_t* row_of_lane,
                             int matrices, bool trans, uint32_t* out) {
  if (num_rows <= 0 || num_rows > kMaxLdRows || (matrices != 2 && matrices != 4)) {
    return absl::InvalidArgumentError("LdMatrixForTest: 1..64 rows, 2 or 4 matrices");
  }
  LaunchKernel(LdMatrixKernel, 1, 32, 0, nullptr, rows, num_rows, row_of_lane, matrices, trans,
               out);
  return Check("LdMatrixKernel");
}

absl::Status MmaGemmForTest(const uint16_t* a, const uint16_t* b, bool b_k_major, int m, int n,
                            int k, float* c) {
  if (m <= 0 || n <= 0 || k <= 0 || m % kTile != 0 || n % kTile != 0 || k % kStepK != 0) {
    return absl::InvalidArgumentError("MmaGemmForTest: m, n multiples of 64, k of 32");
  }
  const dim3 grid(n / kTile, m / kTile);
  if (b_k_major) {
    LaunchKernel(MmaGemmKernel<true>, grid, 128, kGemmShared, nullptr, a, b, n, k, c);
  } else {
    LaunchKernel(MmaGemmKernel<false>, grid, 128, kGemmShared, nullptr, a, b, n, k, c);
  }
  return Check("MmaGemmKernel");
}

}  // namespace dgserve::cuda
