// Device memory at a fixed address that grows and shrinks in place (the CUDA backend's K/V block
// pools, issue 34): CUDA's virtual memory management. An address range is reserved once
// (cuMemAddressReserve); physical memory is created and mapped at its end one granule at a time
// (cuMemCreate, cuMemMap, cuMemSetAccess) and unmapped from its end (cuMemUnmap, cuMemRelease).
// Growth needs only the new memory (no second array beside the old one, no copy) and leaves the
// address, the contents and the queued work alone. The same design as PyTorch's expandable
// segments (c10/cuda/CUDACachingAllocator.cpp, ExpandableSegment): one handle per granule, so
// that any granule can be unmapped again. The driver functions are reached through
// cudaGetDriverEntryPointByVersion, so that nothing links libcuda (the programs start, and say
// there is no GPU, on a machine without a driver). Host code.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve::cuda {

// The allocation granularity of the current device (cuMemGetAllocationGranularity, minimum; 2 MiB
// on Hopper): mapped sizes are multiples of it. Errors: UNIMPLEMENTED when the driver lacks the
// virtual memory management entry points, INTERNAL for a driver error.
absl::StatusOr<size_t> ReservedMemoryGranularity();

// `bytes` rounded up to a multiple of `granularity` (> 0).
inline size_t RoundUpToGranularity(size_t bytes, size_t granularity) {
  return (bytes + granularity - 1) / granularity * granularity;
}

// One reserved address range on the current device, with its first mapped_bytes() mapped
// read-write. Not copyable; destroying it unmaps and frees everything (the caller has made sure
// no queued work still reads it).
class ReservedDeviceMemory {
 public:
  ReservedDeviceMemory() = default;
  ~ReservedDeviceMemory();
  ReservedDeviceMemory(const ReservedDeviceMemory&) = delete;
  ReservedDeviceMemory& operator=(const ReservedDeviceMemory&) = delete;
  ReservedDeviceMemory(ReservedDeviceMemory&& o) noexcept;
  ReservedDeviceMemory& operator=(ReservedDeviceMemory&& o) noexcept;

  // Reserves `max_bytes` (> 0, rounded up to the granularity) of addresses; nothing is mapped.
  // Once: FAILED_PRECONDITION when already reserved. UNIMPLEMENTED without the driver's virtual
  // memory management; RESOURCE_EXHAUSTED when the addresses are refused.
  absl::Status Reserve(size_t max_bytes);
  // Maps or unmaps granules at the end so that exactly RoundUpToGranularity(bytes) are mapped.
  // Growing keeps the address and the contents (new bytes are unspecified) and needs no
  // synchronisation; shrinking drops the contents past the new end, and the caller has made sure
  // no queued work touches them. Errors (nothing changed): OUT_OF_RANGE beyond the reservation,
  // RESOURCE_EXHAUSTED when the device refuses the memory, INTERNAL for other driver errors.
  absl::Status Resize(size_t bytes);

  void* get() const { return reinterpret_cast<void*>(base_); }
  size_t mapped_bytes() const { return pieces_.size() * granularity_; }
  size_t reserved_bytes() const { return reserved_; }
  size_t granularity() const { return granularity_; }

 private:
  void Clear();
  // Unmaps and releases the granules from index `keep` on.
  void UnmapFrom(size_t keep);

  uint64_t base_ = 0;  // CUdeviceptr; 0 while nothing is reserved
  size_t reserved_ = 0;
  size_t granularity_ = 0;
  int device_ = 0;
  std::vector<uint64_t> pieces_;  // CUmemGenericAllocationHandle of each mapped granule, in order
};

}  // namespace dgserve::cuda
