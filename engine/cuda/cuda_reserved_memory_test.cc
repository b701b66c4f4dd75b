// ReservedDeviceMemory (cuda_reserved_memory.h): growth in place keeps the address and the
// contents; shrinking unmaps from the end; a refusal changes nothing (label gpu, and gpu-emu under
// the emulation, whose device memory limit and PROT_NONE reservations make the accounting and a
// read past the mapped memory observable). Built into cuda_backend_test / cuda_backend_emu_test.
#include "engine/cuda/cuda_reserved_memory.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>  // sysconf

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "engine/cuda/cuda_test_util.h"

namespace dgserve::cuda {
namespace {

class ReservedDeviceMemoryTest : public CudaTest {
 protected:
  void SetUp() override {
    CudaTest::SetUp();
    if (IsSkipped()) return;
    auto g = ReservedMemoryGranularity();
    ASSERT_TRUE(g.ok()) << g.status();
    gran_ = *g;
    ASSERT_GT(gran_, 0u);
  }
  // Writes `bytes` bytes of value `v` at `p` (device) and reads them back.
  static void Fill(void* p, size_t bytes, uint8_t v) {
    std::vector<uint8_t> host(bytes, v);
    ASSERT_EQ(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  }
  static std::vector<uint8_t> Read(const void* p, size_t bytes) {
    std::vector<uint8_t> host(bytes);
    EXPECT_EQ(cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  size_t gran_ = 0;
};

TEST_F(ReservedDeviceMemoryTest, GrowsAndShrinksInPlaceKeepingTheContents) {
  ReservedDeviceMemory m;
  EXPECT_EQ(m.Resize(1).code(), absl::StatusCode::kFailedPrecondition);  // nothing reserved
  ASSERT_TRUE(m.Reserve(2 * gran_ + 1).ok());
  EXPECT_EQ(m.reserved_bytes(), 3 * gran_);
  EXPECT_EQ(m.Reserve(gran_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.mapped_bytes(), 0u);
  ASSERT_TRUE(m.Resize(1).ok());
  EXPECT_EQ(m.mapped_bytes(), gran_);
  void* const at = m.get();
  ASSERT_NE(at, nullptr);
  Fill(at, gran_, 0x5A);
  ASSERT_TRUE(m.Resize(2 * gran_ + 7).ok());
  EXPECT_EQ(m.mapped_bytes(), 3 * gran_);
  EXPECT_EQ(m.get(), at);
  EXPECT_EQ(Read(at, gran_), std::vector<uint8_t>(gran_, 0x5A));
  auto* const third = static_cast<uint8_t*>(at) + 2 * gran_;
  Fill(third, gran_, 0x33);  // the new granules are writable
  EXPECT_EQ(Read(third, gran_), std::vector<uint8_t>(gran_, 0x33));
  // Beyond the reservation: refused, nothing changed.
  EXPECT_EQ(m.Resize(3 * gran_ + 1).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.mapped_bytes(), 3 * gran_);
  ASSERT_TRUE(m.Resize(gran_).ok());
  EXPECT_EQ(m.mapped_bytes(), gran_);
  EXPECT_EQ(m.get(), at);
  EXPECT_EQ(Read(at, gran_), std::vector<uint8_t>(gran_, 0x5A));
  ASSERT_TRUE(m.Resize(0).ok());
  EXPECT_EQ(m.mapped_bytes(), 0u);
  // A moved-from reservation owns nothing; the new owner keeps the address.
  ASSERT_TRUE(m.Resize(gran_).ok());
  ReservedDeviceMemory n = std::move(m);
  EXPECT_EQ(n.get(), at);
  EXPECT_EQ(n.mapped_bytes(), gran_);
  EXPECT_EQ(m.get(), nullptr);  // NOLINT(bugprone-use-after-move): checked on purpose
}

// What a growth costs per granule (cuMemCreate + cuMemMap, one cuMemSetAccess) and a shrink
// (cuMemUnmap + cuMemRelease): printed, not asserted (a GPU run reads it in its log; 512
// granules, 1 GiB on Hopper), grown by doubling as a pool grows.
TEST_F(ReservedDeviceMemoryTest, GrowthCostPerGranuleIsPrinted) {
  const size_t n = kEmulated ? 64 : 512;
  size_t free_bytes = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total), cudaSuccess);
  if (free_bytes < 2 * n * gran_) GTEST_SKIP() << "less than " << 2 * n * gran_ << " bytes free";
  ReservedDeviceMemory m;
  ASSERT_TRUE(m.Reserve(n * gran_).ok());
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 1; i <= n; i *= 2) ASSERT_TRUE(m.Resize(i * gran_).ok());  // doubling
  const auto t1 = std::chrono::steady_clock::now();
  ASSERT_EQ(cudaMemset(m.get(), 0, n * gran_), cudaSuccess);  // all of it writable
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto t2 = std::chrono::steady_clock::now();
  ASSERT_TRUE(m.Resize(0).ok());
  const auto t3 = std::chrono::steady_clock::now();
  const auto us = [](auto d) { return std::chrono::duration<double, std::micro>(d).count(); };
  std::printf(
      "reserved memory: %zu granules of %zu bytes: grow %.1f us/granule, shrink %.1f "
      "us/granule\n",
      n, gran_, us(t1 - t0) / double(n), us(t3 - t2) / double(n));
  EXPECT_EQ(m.mapped_bytes(), 0u);
}

#if defined(DGSERVE_CUDA_EMULATION)
// The device's memory: each mapped granule counts, growth beyond the free memory is refused with
// nothing changed, and shrinking or destroying gives the memory back.
TEST_F(ReservedDeviceMemoryTest, MappedGranulesAreTheDevicesMemory) {
  struct Unlimited {  // the limit lifted however the test ends (it is process-wide)
    ~Unlimited() { emu::SetDeviceMemoryLimit(0); }
  } unlimited;
  emu::SetDeviceMemoryLimit(size_t(1) << 40);
  size_t free_bytes = 0, total = 0;
  emu::DeviceMemoryInfo(&free_bytes, &total);
  const size_t used = total - free_bytes;
  emu::SetDeviceMemoryLimit(used + 2 * gran_);
  const auto in_use = [&] {
    emu::DeviceMemoryInfo(&free_bytes, &total);
    return total - free_bytes - used;
  };
  {
    ReservedDeviceMemory m;
    ASSERT_TRUE(m.Reserve(8 * gran_).ok());
    EXPECT_EQ(in_use(), 0u);  // addresses only
    ASSERT_TRUE(m.Resize(gran_).ok());
    EXPECT_EQ(in_use(), gran_);
    Fill(m.get(), gran_, 0x11);
    const absl::Status refused = m.Resize(3 * gran_);
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_EQ(m.mapped_bytes(), gran_);
    EXPECT_EQ(in_use(), gran_);
    EXPECT_EQ(Read(m.get(), gran_), std::vector<uint8_t>(gran_, 0x11));
    ASSERT_TRUE(m.Resize(2 * gran_).ok());
    EXPECT_EQ(in_use(), 2 * gran_);
    ASSERT_TRUE(m.Resize(gran_).ok());
    EXPECT_EQ(in_use(), gran_);
  }
  EXPECT_EQ(in_use(), 0u);
}

// A read a host page past the mapped granules faults, as on a device: the emulation's
// reservations are inaccessible host pages until mapped (what catches a block index past the
// pool's blocks; the emulation's granules are smaller than a page, and a page is accessible while
// any of its granules is mapped).
TEST_F(ReservedDeviceMemoryTest, ReadingPastTheMappedMemoryFaults) {
  const size_t page = size_t(sysconf(_SC_PAGESIZE));
  ASSERT_EQ(page % gran_, 0u);
  ReservedDeviceMemory m;
  ASSERT_TRUE(m.Reserve(2 * page).ok());
  ASSERT_TRUE(m.Resize(page).ok());
  const auto* p = static_cast<const volatile uint8_t*>(m.get());
  EXPECT_EQ(p[page - 1], 0xFF);  // mapped: the emulation's unspecified contents
  EXPECT_DEATH({ [[maybe_unused]] const uint8_t x = p[page]; }, "");
  ASSERT_TRUE(m.Resize(page + gran_).ok());
  EXPECT_EQ(p[page], 0xFF);
  ASSERT_TRUE(m.Resize(page).ok());
  EXPECT_DEATH({ [[maybe_unused]] const uint8_t x = p[page]; }, "");
}
#endif

}  // namespace
}  // namespace dgserve::cuda
