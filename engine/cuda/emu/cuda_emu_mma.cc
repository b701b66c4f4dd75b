// The matrix-core instructions of engine/cuda/cuda_mma.cuh on the emulated warp (cuda_emu.h):
// mma.sync.m16n8k16 (bf16 → f32), mma.sync.m16n8k32 (e4m3 → f32) and ldmatrix as warp
// exchanges that place every lane's registers exactly as the PTX ISA says, and cp.async as a copy
// deferred to its wait.
//
// The fragment layouts are those of NVIDIA's PTX ISA
// (docs.nvidia.com/cuda/parallel-thread-execution), sections "Matrix Fragments for mma.m16n8k16
// with floating point type" (.bf16 A and B, .f32 C and D; Figures "MMA .m16n8k16 fragment layout
// for matrix A with .f16/.bf16 type" and those for B and C/D that follow it) and "Warp-level matrix
// load instruction: ldmatrix". With groupID = laneid >> 2 and threadID_in_group (t) = laneid % 4,
// and element i of a fragment held in register i / 2, half i % 2 (the lower index in the low 16
// bits):
//   A (16×16, .row), a0..a7: row = groupID for i ∈ {0, 1, 4, 5}, groupID + 8 otherwise;
//                            col = 2t + (i & 1) for i < 4, 2t + (i & 1) + 8 for i ≥ 4
//   B (16×8, .col),  b0..b3: row = 2t + (i & 1) for i < 2, 2t + (i & 1) + 8 for i ≥ 2;
//                            col = groupID
//   C, D (16×8),     c0..c3: row = groupID for i < 2, groupID + 8 otherwise; col = 2t + (i & 1)
//   mma.m16n8k32 .e4m3 (section "Matrix Fragments for mma.m16n8k32", .e4m3 A and B; element i
//   of a fragment in register i / 4, byte i % 4, the lower index in the lower byte):
//   A (16×32, .row), a0..a15: row = groupID for i ∈ {0..3, 8..11}, groupID + 8 otherwise;
//                             col = 4t + (i & 3) for i < 8, 4t + (i & 3) + 16 for i ≥ 8
//   B (32×8, .col),  b0..b7:  row = 4t + (i & 3) for i < 4, 4t + (i & 3) + 16 for i ≥ 4;
//                             col = groupID
//   C, D as for m16n8k16.
//   ldmatrix .m8n8 .b16: lanes 8j..8j+7 give the addresses of rows 0..7 of matrix j (the other
//     lanes' addresses are not used: lanes 0–15 for .x2, 0–7 for .x1); lane l receives in r[j]
//     row l / 4, columns 2(l % 4) and 2(l % 4) + 1 of matrix j, or with .trans of its transpose
//     (rows 2(l % 4) and 2(l % 4) + 1, column l / 4). Every row address is 16-byte aligned.
#include <cstdio>
#include <cstring>
#include <string>

#include "common/fp8.h"
#include "engine/cuda/emu/cuda_emu.h"

namespace dgserve::cuda::emu {
namespace {

float Bf16(uint32_t reg, int half) {
  const uint32_t bits = (half == 0 ? reg & 0xffffu : reg >> 16) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct MmaIn {
  const uint32_t* a;
  const uint32_t* b;
};

// d += A·B for the whole warp. Each lane's `out` is its d[4], which holds C on the way in.
void MmaExchange(const void* const in[32], void* const out[32]) {
  float A[16][16], B[16][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& x = *static_cast<const MmaIn*>(in[lane]);
    const float* c = static_cast<const float*>(out[lane]);
    const int group = lane >> 2, t = lane % 4;
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
      const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
      A[row][col] = Bf16(x.a[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) {
      const int row = 2 * t + (i & 1) + (i >= 2 ? 8 : 0);
      B[row][group] = Bf16(x.b[i / 2], i % 2);
    }
    for (int i = 0; i < 4; ++i) C[i < 2 ? group : group + 8][2 * t + (i & 1)] = c[i];
  }
  // The hardware's order of the additions within one mma is not specified by the ISA (and
  // differs from this one). Here: each product is exact in float32 (two bf16 significands of 8
  // bits), added to C one at a time in ascending k, each addition rounded to float32.
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(out[lane]);
    const int group = lane >> 2, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? group : group + 8, col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
      d[i] = acc;
    }
  }
}

// The e4m3 mma: d += A·B with A 16×32 and B 32×8 of e4m3 codes (MmaIn's a[4], b[2]).
void MmaE4m3Exchange(const void* const in[32], void* const out[32]) {
  float A[16][32], B[32][8], C[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    const auto& x = *static_cast<const MmaIn*>(in[lane]);
    const float* c = static_cast<const float*>(out[lane]);
    const int group = lane >> 2, t = lane % 4;
    for (int i = 0; i < 16; ++i) {
      const int row = (i < 4 || (i >= 8 && i < 12)) ? group : group + 8;
      const int col = 4 * t + (i & 3) + (i >= 8 ? 16 : 0);
      A[row][col] = E4m3ToFloat(uint8_t(x.a[i / 4] >> (8 * (i % 4))));
    }
    for (int i = 0; i < 8; ++i) {
      const int row = 4 * t + (i & 3) + (i >= 4 ? 16 : 0);
      B[row][group] = E4m3ToFloat(uint8_t(x.b[i / 4] >> (8 * (i % 4))));
    }
    for (int i = 0; i < 4; ++i) C[i < 2 ? group : group + 8][2 * t + (i & 1)] = c[i];
  }
  // Each product of two e4m3 values is exact in float32 (4 significant bits each); added to C one
  // at a time in ascending k, each addition rounded to float32 (the hardware's order and
  // accumulator width within one mma are not specified by the ISA).
  for (int lane = 0; lane < 32; ++lane) {
    float* d = static_cast<float*>(out[lane]);
    const int group = lane >> 2, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = i < 2 ? group : group + 8, col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < 32; ++k) acc += A[row][k] * B[k][col];
      d[i] = acc;
    }
  }
}

void CheckRowAddress(const char* name, const void* row, int lane) {
  if (row == nullptr || reinterpret_cast<uintptr_t>(row) % 16 != 0) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%s: lane %d's row address %p is not 16-byte aligned", name,
                  lane, row);
    KernelFailure(buf);
  }
}

template <int kMatrices, bool kTrans>
void LdMatrixExchange(const void* const in[32], void* const out[32]) {
  const char* name = kTrans ? (kMatrices == 4 ? "ldmatrix.x4.trans" : "ldmatrix.x2.trans")
                            : (kMatrices == 4 ? "ldmatrix.x4" : "ldmatrix.x2");
  const unsigned char* rows[32];
  for (int lane = 0; lane < 8 * kMatrices; ++lane) {
    rows[lane] = *static_cast<const unsigned char* const*>(in[lane]);
    CheckRowAddress(name, rows[lane], lane);
  }
  // Element (r, c) of matrix j.
  auto at = [&](int j, int r, int c) {
    uint16_t v;
    std::memcpy(&v, rows[8 * j + r] + 2 * c, 2);
    return uint32_t(v);
  };
  uint32_t result[32][4];
  for (int lane = 0; lane < 32; ++lane) {
    const int r = lane / 4, c = 2 * (lane % 4);
    for (int j = 0; j < kMatrices; ++j) {
      result[lane][j] =
          kTrans ? at(j, c, r) | at(j, c + 1, r) << 16 : at(j, r, c) | at(j, r, c + 1) << 16;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    std::memcpy(out[lane], result[lane], sizeof(uint32_t) * kMatrices);
  }
}

}  // namespace

void MmaBf16M16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  const MmaIn in{a, b};
  WarpExchange("mma.sync.m16n8k16", 0xffffffffu, &MmaExchange, &in, d);
}

void MmaE4m3M16N8K32(float d[4], const uint32_t a[4], const uint32_t b[2]) {
  const MmaIn in{a, b};
  WarpExchange("mma.sync.m16n8k32.e4m3", 0xffffffffu, &MmaE4m3Exchange, &in, d);
}

void LdMatrix(int matrices, bool trans, uint32_t* r, const void* smem_row) {
  WarpExchangeFn fn = matrices == 4
                          ? (trans ? &LdMatrixExchange<4, true> : &LdMatrixExchange<4, false>)
                          : (trans ? &LdMatrixExchange<2, true> : &LdMatrixExchange<2, false>);
  WarpExchange(trans ? "ldmatrix.trans" : "ldmatrix", 0xffffffffu, fn, &smem_row, r);
}

}  // namespace dgserve::cuda::emu
