// Test fixture of the CUDA kernel tests (label `gpu`): skips every test when no CUDA device is
// present, and owns the device buffers a test uploads or allocates. The same tests also build
// against the host emulation of engine/cuda/emu/ (label `gpu-emu`), where kEmulated is true and
// the largest shapes are left out.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "engine/cuda/cuda_ops.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {

// True in the gpu-emu build (device code run on the host: keep shapes small there).
#if defined(DGSERVE_CUDA_EMULATION)
inline constexpr bool kEmulated = true;
#else
inline constexpr bool kEmulated = false;
#endif

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
  void TearDown() override {
    for (void* p : buffers_) cudaFree(p);
  }
  // A device copy of `host` (nullptr when empty).
  template <typename T>
  T* Upload(const std::vector<T>& host) {
    if (host.empty()) return nullptr;
    T* p = Alloc<T>(host.size());
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
    return p;
  }
  // n device elements, every byte set to `fill_byte` (0xFF: NaN floats / −1 ints, to catch
  // elements a kernel fails to write).
  template <typename T>
  T* Alloc(size_t n, int fill_byte = 0) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, n * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, fill_byte, n * sizeof(T)), cudaSuccess);
    buffers_.push_back(p);
    return static_cast<T*>(p);
  }
  // Waits for the device and copies n elements back; kernel faults show up here.
  template <typename T>
  std::vector<T> Download(const T* device, size_t n) {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<T> host(n);
    if (n > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return host;
  }

 private:
  std::vector<void*> buffers_;
};

}  // namespace dgserve::cuda
