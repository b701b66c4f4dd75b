#include "engine/cuda/cuda_synthetic.h"

#include <cstring>
#include <string>

#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda {
namespace {

__host__ __device__ inline uint64_t SplitMix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ inline uint16_t Element(uint64_t key, int64_t i, float a, float c, bool has_offset) {
  const uint64_t x = SplitMix(key + static_cast<uint64_t>(i));
  const int32_t q = static_cast<int32_t>(x >> 40) - 8388608;
  const float v = __fmul_rn(static_cast<float>(q), 0x1p-23f);
  const float va = __fmul_rn(v, a);
  const float w = has_offset ? __fadd_rn(c, va) : va;
  uint32_t b;
  memcpy(&b, &w, 4);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

__global__ void FillBf16Kernel(uint64_t key, float a, float c, bool has_offset, int64_t n,
                               uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = Element(key, i, a, c, has_offset);
  }
}

__global__ void FillFloatKernel(uint64_t key, float a, float c, bool has_offset, int64_t n,
                                float* out) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t bits = uint32_t(Element(key, i, a, c, has_offset)) << 16;
    float f;
    memcpy(&f, &bits, 4);
    out[i] = f;
  }
}

// Enough blocks to fill the device (a grid-stride loop covers the rest).
int Blocks(int64_t n) {
  const int64_t b = (n + 255) / 256;
  return int(b < 32768 ? (b > 0 ? b : 1) : 32768);
}

absl::Status Check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

absl::Status FillSyntheticBf16(const SyntheticTensor& t, int64_t n, uint16_t* out, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(FillBf16Kernel, Blocks(n), 256, 0, static_cast<cudaStream_t>(stream), t.key, t.a,
               t.c, t.has_offset, n, out);
  return Check("FillSyntheticBf16");
}

absl::Status FillSyntheticFloat(const SyntheticTensor& t, int64_t n, float* out, void* stream) {
  if (n <= 0) return absl::OkStatus();
  LaunchKernel(FillFloatKernel, Blocks(n), 256, 0, static_cast<cudaStream_t>(stream), t.key, t.a,
               t.c, t.has_offset, n, out);
  return Check("FillSyntheticFloat");
}

}  // namespace dgserve::cuda
