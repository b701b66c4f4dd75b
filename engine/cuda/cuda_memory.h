// Device memory for the CUDA backend (cuda_backend.cc): an owned device array, CUDA and cuBLAS
// error checks as absl::Status, and the uploads of the model's weights (bf16 bits, or widened to
// float32). Host code; every error is INTERNAL with the CUDA error string or cuBLAS status.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/status_macros.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/cuda/cuda_profile.h"

namespace dgserve::cuda {

// OK for cudaSuccess, else INTERNAL "what: <CUDA error string>".
absl::Status CudaCheck(cudaError_t e, const char* what);
// OK for CUBLAS_STATUS_SUCCESS, else INTERNAL "what: cuBLAS status N".
absl::Status CublasCheck(cublasStatus_t s, const char* what);

// CudaCheck of an allocation's result; a refused one also left its error as the last error
// (cudaGetLastError), which the next kernel's launch check would report as its own: cleared.
// Out of memory (cudaErrorMemoryAllocation) is RESOURCE_EXHAUSTED, not INTERNAL: a caller may
// run less at once (the denoise worker runs a refused step in halves).
inline absl::Status Refused(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const absl::Status s = CudaCheck(e, what);
  return e == cudaErrorMemoryAllocation ? absl::ResourceExhaustedError(s.message()) : s;
}

// An owned device array of T (cudaMalloc / cudaFree). Ensure() drops the old contents when it has
// to grow (and counts NoteScratchMoved: a CUDA graph may hold the old address); Grow() keeps a
// prefix and counts nothing (the KV mirrors, which a captured step reaches through its
// attention table or names in its shape key, use it). Errors: INTERNAL with the CUDA error string
// (RESOURCE_EXHAUSTED for a refused allocation: Refused).
template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  ~DeviceArray() {
    if (p_ != nullptr) {
      NoteAlloc();
      cudaFree(p_);
    }
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  DeviceArray(DeviceArray&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  void swap(DeviceArray& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
  }

  T* get() const { return p_; }
  size_t size() const { return n_; }

  // At least n elements; the old contents are dropped when it has to grow.
  absl::Status Ensure(size_t n) {
    if (n <= n_) return absl::OkStatus();
    if (p_ != nullptr) {
      NoteAlloc();
      cudaFree(p_);
    }
    p_ = nullptr;
    n_ = 0;
    NoteAlloc();
    NoteScratchMoved();
    DGSERVE_RETURN_IF_ERROR(
        Refused(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T)), "cudaMalloc"));
    n_ = n;
    return absl::OkStatus();
  }
  // At least n elements, keeping the first `keep` elements.
  absl::Status Grow(size_t n, size_t keep) {
    if (n <= n_) return absl::OkStatus();
    DeviceArray q;
    NoteAlloc();
    DGSERVE_RETURN_IF_ERROR(Refused(cudaMalloc(&q.p_, n * sizeof(T)), "cudaMalloc"));
    q.n_ = n;
    DGSERVE_RETURN_IF_ERROR(q.CopyPrefixFrom(*this, std::min(keep, n_)));
    swap(q);  // q frees the old array
    return absl::OkStatus();
  }
  // This array's first n elements (≤ both sizes) = `from`'s, copied device to device and waited
  // for: a device-to-device cudaMemcpy may return before the copy is done, and the callers'
  // streams do not wait for the legacy stream, so the copy is done before `from` is freed or this
  // array written.
  absl::Status CopyPrefixFrom(const DeviceArray& from, size_t n) {
    if (n == 0 || from.p_ == nullptr) return absl::OkStatus();
    NoteDeviceCopy();
    DGSERVE_RETURN_IF_ERROR(CudaCheck(
        cudaMemcpy(p_, from.p_, n * sizeof(T), cudaMemcpyDeviceToDevice), "cudaMemcpy (grow)"));
    return CudaCheck(cudaDeviceSynchronize(), "cudaDeviceSynchronize (grow)");
  }
  absl::Status Upload(const T* host, size_t n) {
    DGSERVE_RETURN_IF_ERROR(Ensure(n));
    if (n == 0) return absl::OkStatus();
    NoteUpload();
    return CudaCheck(cudaMemcpy(p_, host, n * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  absl::Status Upload(const std::vector<T>& host) { return Upload(host.data(), host.size()); }
  // Ensure(n), then a copy of n elements queued on `stream` (ordered with its kernels). From
  // pinned host memory (PinnedArray) it is asynchronous: the host must keep `host` unchanged
  // until the stream has run it; from pageable memory CUDA stages it before returning.
  absl::Status UploadAsync(const T* host, size_t n, cudaStream_t stream) {
    DGSERVE_RETURN_IF_ERROR(Ensure(n));
    if (n == 0) return absl::OkStatus();
    NoteDeviceCopy();
    return CudaCheck(cudaMemcpyAsync(p_, host, n * sizeof(T), cudaMemcpyHostToDevice, stream),
                     "cudaMemcpyAsync H2D");
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// A growable array of T in pinned (page-locked) host memory (cudaMallocHost / cudaFreeHost): the
// staging of a step's inputs and outputs, so their copies are asynchronous and can be queued
// ahead of (or captured beside) the step's kernels. Ensure() drops the old contents when it has to
// grow. Errors: INTERNAL with the CUDA error string.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  ~PinnedArray() {
    if (p_ != nullptr) cudaFreeHost(p_);
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  T* data() const { return p_; }
  size_t size() const { return n_; }
  T& operator[](size_t i) const { return p_[i]; }

  absl::Status Ensure(size_t n) {
    if (n <= n_) return absl::OkStatus();
    if (p_ != nullptr) cudaFreeHost(p_);
    p_ = nullptr;
    n_ = 0;
    const size_t cap = std::max<size_t>(n, 64);
    NoteAlloc();
    DGSERVE_RETURN_IF_ERROR(
        Refused(cudaMallocHost(reinterpret_cast<void**>(&p_), cap * sizeof(T)), "cudaMallocHost"));
    n_ = cap;
    return absl::OkStatus();
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

// Copies `bytes` from the device to the host (synchronous).
absl::Status Download(void* host, const void* device, size_t bytes);

// Host bf16 weights (row-major bits, or unpacked from the CPU GEMM's panels) → bf16 device.
absl::Status UploadBf16(const std::vector<uint16_t>& bits, DeviceArray<uint16_t>* out);
absl::Status UploadBf16(const cpu::PackedMatrix& w, DeviceArray<uint16_t>* out);
// E × [rows, cols] packed experts → one [E, rows, cols] device tensor.
absl::Status UploadBf16(const std::vector<cpu::PackedMatrix>& experts, DeviceArray<uint16_t>* out);
// W4A16 expert weights on the device in the layout of cuda_moe.h's W4A16Weights: packed
// [E, rows, ceil(cols/8)] int4 words (value 8j+i in bits 4i..4i+3 of word j, as q + 8), bf16
// scales [E, rows, ceil(cols/group)]; group 0 while nothing is uploaded.
struct DeviceW4A16 {
  DeviceArray<uint32_t> packed;
  DeviceArray<uint16_t> scales;
  int group = 0;
};
// Uploads E × [rows, cols] experts held as W4A16 QuantMatrix (cpu::PackedMatrix::quant()) into
// `out` when every expert is W4A16 with one shape and group size, the group a multiple of 8 (or
// one group per row), and every scale a bf16 value (as dgserve-quantize and bf16 checkpoints
// write them; then float32(q)·s is what the CPU computes and the device reproduces exactly).
// Returns false, uploading nothing, when they are not: the caller widens them (UploadBf16).
absl::StatusOr<bool> UploadW4A16(const std::vector<cpu::PackedMatrix>& experts, DeviceW4A16* out);
// The same for one matrix (a dense projection: E = 1).
absl::StatusOr<bool> UploadW4A16(const cpu::PackedMatrix& w, DeviceW4A16* out);
// A packed matrix [rows, cols] → float32 device (exact widening).
absl::Status UploadFloat(const cpu::PackedMatrix& w, DeviceArray<float>* out);

}  // namespace dgserve::cuda
