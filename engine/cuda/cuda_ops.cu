#include "engine/cuda/cuda_ops.h"

#include "engine/cuda/cuda_device.cuh"
#include "engine/cuda/cuda_launch.cuh"

namespace dgserve::cuda {
namespace {

// One block per row; a double sum of squares reduced in shared memory.
__global__ void RmsNormKernel(const float* x, const float* w, int dim, float eps, float* y) {
  double* partial = DynamicShared<double>();
  const int64_t row = blockIdx.x;
  const float* xr = x + row * dim;
  float* yr = y + row * dim;
  double ss = 0;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += double(xr[i]) * xr[i];
  partial[threadIdx.x] = ss;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = 1.0f / sqrtf(float(partial[0] / dim) + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    yr[i] = w ? xr[i] * scale * w[i] : xr[i] * scale;
  }
}

__global__ void SoftcapKernel(float* x, int64_t n, float cap) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    x[i] = cap * tanhf(x[i] / cap);
  }
}

__global__ void GeluGateKernel(const float* gate, const float* up, int64_t n, float* out) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    out[i] = 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g))) * up[i];
  }
}

// One block per (row, head); threads over the head_dim/2 pairs.
__global__ void RopeKernel(float* x, int heads, int head_dim, const int32_t* positions,
                           const float* inv_freq) {
  const int row = blockIdx.x / heads, head = blockIdx.x % heads;
  const int half = head_dim / 2;
  float* v = x + (int64_t(row) * heads + head) * head_dim;
  const float pos = float(positions[row]);
  for (int j = threadIdx.x; j < half; j += blockDim.x) {
    if (inv_freq[j] == 0.0f) continue;
    const float angle = pos * inv_freq[j];
    float s, c;
    sincosf(angle, &s, &c);
    const float a = v[j], b = v[j + half];
    v[j] = a * c - b * s;
    v[j + half] = b * c + a * s;
  }
}

int Blocks(int64_t n, int threads) {
  const int64_t b = (n + threads - 1) / threads;
  return int(b < 65535 ? (b > 0 ? b : 1) : 65535);
}

}  // namespace

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

absl::Status RmsNorm(const float* x, const float* w, int rows, int dim, float eps, float* y,
                     void* stream) {
  if (rows == 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  LaunchKernel(RmsNormKernel, rows, kThreads, kThreads * sizeof(double), S(stream), x, w, dim, eps,
               y);
  return Check("RmsNorm");
}

absl::Status Softcap(float* x, int64_t n, float cap, void* stream) {
  if (n == 0) return absl::OkStatus();
  LaunchKernel(SoftcapKernel, Blocks(n, 256), 256, 0, S(stream), x, n, cap);
  return Check("Softcap");
}

absl::Status GeluGate(const float* gate, const float* up, int64_t n, float* out, void* stream) {
  if (n == 0) return absl::OkStatus();
  LaunchKernel(GeluGateKernel, Blocks(n, 256), 256, 0, S(stream), gate, up, n, out);
  return Check("GeluGate");
}

absl::Status ApplyRope(float* x, int rows, int heads, int head_dim, const int32_t* positions,
                       const float* inv_freq, void* stream) {
  if (rows == 0 || heads == 0) return absl::OkStatus();
  LaunchKernel(RopeKernel, rows * heads, 128, 0, S(stream), x, heads, head_dim, positions,
               inv_freq);
  return Check("ApplyRope");
}

}  // namespace dgserve::cuda
