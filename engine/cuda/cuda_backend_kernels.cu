#include "engine/cuda/cuda_backend_kernels.h"

#include "engine/cuda/cuda_bf16.cuh"
#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"

namespace dgserve::cuda {
namespace {

int Blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 65535 * 16 ? (b < 1 ? 1 : b) : 65535 * 16);
}

__global__ void EmbedRowsKernel(const int32_t* ids, const uint16_t* table, int rows, int dim,
                                float scale, float* out) {
  const int64_t n = int64_t(rows) * dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, d = i % dim;
    out[i] = Bf16BitsToFloat(table[int64_t(ids[r]) * dim + d]) * scale;
  }
}

__global__ void AddInPlaceKernel(float* h, const float* x, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    h[i] += x[i];
  }
}

__global__ void AddScaleKernel(float* h, const float* x, float scalar, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    h[i] = (h[i] + x[i]) * scalar;
  }
}

__global__ void ScaleKernel(float* x, int64_t n, float s, int round_to_bf16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = x[i] * s;
    x[i] = round_to_bf16 ? Bf16BitsToFloat(ActivationBf16Bits(v)) : v;
  }
}

__global__ void GeluGateRowsKernel(const float* gu, int rows, int width, float* out) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  const int64_t n = int64_t(rows) * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, c = i % width;
    const float g = gu[r * 2 * width + c], u = gu[r * 2 * width + width + c];
    out[i] = 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * u;
  }
}

__global__ void GatherRowsKernel(const float* src, const int32_t* idx, int rows, int dim,
                                 float* dst) {
  const int64_t n = int64_t(rows) * dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, d = i % dim;
    const int32_t s = idx[r];
    dst[i] = s < 0 ? 0.0f : src[int64_t(s) * dim + d];
  }
}

__global__ void MoeCombineKernel(const float* y, const int32_t* slot, const float* weight, int rows,
                                 int k, int dim, float* out) {
  const int64_t n = int64_t(rows) * dim;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, d = i % dim;
    float acc = 0.0f;
    for (int j = 0; j < k; ++j) {
      const int32_t s = slot[r * k + j];
      if (s >= 0) acc += weight[r * k + j] * y[int64_t(s) * dim + d];
    }
    out[i] = acc;
  }
}

__global__ void SoftmaxProbsBf16Kernel(const float* raw, int rows, int vocab, float softcap,
                                       const float* temperature, const VocabRowResult* res,
                                       uint16_t* probs, const uint64_t* mask_table,
                                       const int32_t* mask_index) {
  const int r = blockIdx.x;
  if (r >= rows) return;
  const int mi = mask_index != nullptr ? mask_index[r] : -1;
  const uint64_t* mask =
      mi >= 0 ? mask_table + int64_t(mi) * ((int64_t(vocab) + 63) / 64) : nullptr;
  const float lse = res[r].lse;
  const float inv_t = 1.0f / temperature[r];
  const bool ok = isfinite(lse);
  const float* row = raw + int64_t(r) * vocab;
  uint16_t* out = probs + int64_t(r) * vocab;
  for (int v = blockIdx.y * blockDim.x + threadIdx.x; v < vocab; v += gridDim.y * blockDim.x) {
    float l = row[v];
    if (softcap > 0) l = softcap * tanhf(l / softcap);
    const bool allowed = mask == nullptr || ((mask[v >> 6] >> (v & 63)) & 1u) != 0;
    out[v] = ok && allowed ? ToBf16Bits(expf(l * inv_t - lse)) : uint16_t(0);
  }
}

// The pool row of slot s (KvBlockRows in cuda_backend_kernels.h).
__device__ __forceinline__ int64_t PoolRow(const int32_t* table, int block_size, int64_t s) {
  return int64_t(table[s / block_size]) * block_size + s % block_size;
}

__device__ __forceinline__ float ConvertElement(float x, float*) { return x; }
__device__ __forceinline__ uint16_t ConvertElement(float x, uint16_t*) { return ToBf16Bits(x); }
__device__ __forceinline__ uint16_t ConvertElement(uint16_t x, uint16_t*) { return x; }

// pool[PoolRow(first_slot + r), e] = src[r, e], converted to the pool's element type.
template <typename Src, typename Dst>
__global__ void CopyRowsToBlocksKernel(const Src* src, int64_t rows, int width,
                                       const int32_t* table, int block_size, int64_t first_slot,
                                       Dst* pool) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, e = i % width;
    pool[PoolRow(table, block_size, first_slot + r) * width + e] =
        ConvertElement(src[i], static_cast<Dst*>(nullptr));
  }
}

// dst[r, e] = pool[PoolRow(first_slot + r), e].
template <typename T>
__global__ void CopyRowsFromBlocksKernel(const T* pool, int64_t rows, int width,
                                         const int32_t* table, int block_size, int64_t first_slot,
                                         T* dst) {
  const int64_t n = rows * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / width, e = i % width;
    dst[i] = pool[PoolRow(table, block_size, first_slot + r) * width + e];
  }
}

// to[moves[2m+1] · per + e] = from[moves[2m] · per + e].
template <typename T>
__global__ void CopyPoolBlocksKernel(const T* from, T* to, const int32_t* moves, int count,
                                     int64_t per) {
  const int64_t n = int64_t(count) * per;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t m = i / per, e = i % per;
    to[int64_t(moves[2 * m + 1]) * per + e] = from[int64_t(moves[2 * m]) * per + e];
  }
}

}  // namespace

absl::Status EmbedRows(const int32_t* ids, const uint16_t* table, int rows, int dim, float scale,
                       float* out, void* stream) {
  if (rows <= 0) return absl::OkStatus();
  LaunchKernel(EmbedRowsKernel, Blocks(int64_t(rows) * dim, 256), 256, 0, S(stream), ids, table,
               rows, dim, scale, out);
  return Check("EmbedRows");
}

absl::Status AddInPlace(float* h, const float* x, int64_t n, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(AddInPlaceKernel, Blocks(n, 256), 256, 0, S(stream), h, x, n);
  return Check("AddInPlace");
}

absl::Status AddScale(float* h, const float* x, float scalar, int64_t n, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(AddScaleKernel, Blocks(n, 256), 256, 0, S(stream), h, x, scalar, n);
  return Check("AddScale");
}

absl::Status Scale(float* x, int64_t n, float s, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(ScaleKernel, Blocks(n, 256), 256, 0, S(stream), x, n, s, 0);
  return Check("Scale");
}

absl::Status ScaleAndRoundToBf16(float* x, int64_t n, float s, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(ScaleKernel, Blocks(n, 256), 256, 0, S(stream), x, n, s, 1);
  return Check("ScaleAndRoundToBf16");
}

absl::Status GeluGateRows(const float* gu, int rows, int width, float* out, void* stream) {
  if (rows <= 0) return absl::OkStatus();
  LaunchKernel(GeluGateRowsKernel, Blocks(int64_t(rows) * width, 256), 256, 0, S(stream), gu, rows,
               width, out);
  return Check("GeluGateRows");
}

absl::Status GatherRows(const float* src, const int32_t* idx, int rows, int dim, float* dst,
                        void* stream) {
  if (rows <= 0) return absl::OkStatus();
  LaunchKernel(GatherRowsKernel, Blocks(int64_t(rows) * dim, 256), 256, 0, S(stream), src, idx,
               rows, dim, dst);
  return Check("GatherRows");
}

absl::Status MoeCombine(const float* y, const int32_t* slot, const float* weight, int rows, int k,
                        int dim, float* out, void* stream) {
  if (rows <= 0) return absl::OkStatus();
  LaunchKernel(MoeCombineKernel, Blocks(int64_t(rows) * dim, 256), 256, 0, S(stream), y, slot,
               weight, rows, k, dim, out);
  return Check("MoeCombine");
}

absl::Status SoftmaxProbsBf16(const float* raw, int rows, int vocab, float softcap,
                              const float* temperature, const VocabRowResult* res, uint16_t* probs,
                              const uint64_t* mask_table, const int32_t* mask_index,
                              void* stream) {
  if (rows <= 0) return absl::OkStatus();
  int chunks = (vocab + 255) / 256;  // grid: rows × vocabulary chunks (≤ 1024)
  if (chunks > 1024) chunks = 1024;
  LaunchKernel(SoftmaxProbsBf16Kernel, dim3(rows, chunks), 256, 0, S(stream), raw, rows, vocab,
               softcap, temperature, res, probs, mask_table, mask_index);
  return Check("SoftmaxProbsBf16");
}

namespace {
template <typename Src, typename Dst>
absl::Status ToBlocks(const Src* src, int64_t rows, int width, const int32_t* block_table,
                      int block_size, int64_t first_slot, Dst* pool, void* stream) {
  if (rows <= 0 || width <= 0) return absl::OkStatus();
  if (block_size <= 0 || first_slot < 0) {
    return absl::InvalidArgumentError("CopyRowsToBlocks: block_size > 0 and first_slot >= 0");
  }
  LaunchKernel(CopyRowsToBlocksKernel<Src, Dst>, Blocks(rows * width, 256), 256, 0, S(stream), src,
               rows, width, block_table, block_size, first_slot, pool);
  return Check("CopyRowsToBlocks");
}

template <typename T>
absl::Status FromBlocks(const T* pool, int64_t rows, int width, const int32_t* block_table,
                        int block_size, int64_t first_slot, T* dst, void* stream) {
  if (rows <= 0 || width <= 0) return absl::OkStatus();
  if (block_size <= 0 || first_slot < 0) {
    return absl::InvalidArgumentError("CopyRowsFromBlocks: block_size > 0 and first_slot >= 0");
  }
  LaunchKernel(CopyRowsFromBlocksKernel<T>, Blocks(rows * width, 256), 256, 0, S(stream), pool,
               rows, width, block_table, block_size, first_slot, dst);
  return Check("CopyRowsFromBlocks");
}
}  // namespace

absl::Status CopyRowsToBlocks(const float* src, int64_t rows, int width, const int32_t* block_table,
                              int block_size, int64_t first_slot, float* pool, void* stream) {
  return ToBlocks(src, rows, width, block_table, block_size, first_slot, pool, stream);
}
absl::Status CopyRowsToBlocks(const float* src, int64_t rows, int width, const int32_t* block_table,
                              int block_size, int64_t first_slot, uint16_t* pool, void* stream) {
  return ToBlocks(src, rows, width, block_table, block_size, first_slot, pool, stream);
}
absl::Status CopyRowsToBlocks(const uint16_t* src, int64_t rows, int width,
                              const int32_t* block_table, int block_size, int64_t first_slot,
                              uint16_t* pool, void* stream) {
  return ToBlocks(src, rows, width, block_table, block_size, first_slot, pool, stream);
}
absl::Status CopyRowsFromBlocks(const float* pool, int64_t rows, int width,
                                const int32_t* block_table, int block_size, int64_t first_slot,
                                float* dst, void* stream) {
  return FromBlocks(pool, rows, width, block_table, block_size, first_slot, dst, stream);
}
absl::Status CopyRowsFromBlocks(const uint16_t* pool, int64_t rows, int width,
                                const int32_t* block_table, int block_size, int64_t first_slot,
                                uint16_t* dst, void* stream) {
  return FromBlocks(pool, rows, width, block_table, block_size, first_slot, dst, stream);
}

namespace {
template <typename T>
absl::Status PoolBlocks(const T* from, T* to, const int32_t* moves, int count, int64_t per,
                        void* stream) {
  if (count <= 0 || per <= 0) return absl::OkStatus();
  LaunchKernel(CopyPoolBlocksKernel<T>, Blocks(int64_t(count) * per, 256), 256, 0, S(stream), from,
               to, moves, count, per);
  return Check("CopyPoolBlocks");
}
}  // namespace

absl::Status CopyPoolBlocks(const float* from, float* to, const int32_t* moves, int count,
                            int64_t block_elements, void* stream) {
  return PoolBlocks(from, to, moves, count, block_elements, stream);
}
absl::Status CopyPoolBlocks(const uint16_t* from, uint16_t* to, const int32_t* moves, int count,
                            int64_t block_elements, void* stream) {
  return PoolBlocks(from, to, moves, count, block_elements, stream);
}

}  // namespace dgserve::cuda
