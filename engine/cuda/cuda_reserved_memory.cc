#include "engine/cuda/cuda_reserved_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <string>
#include <type_traits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_profile.h"

namespace dgserve::cuda {
namespace {

// The driver's virtual memory management entry points, looked up once (the lookup by version
// needs a CUDA 12.5 runtime; the functions, a CUDA 12 driver).
struct DriverVmm {
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
};

absl::StatusOr<const DriverVmm*> Vmm() {
  static const absl::StatusOr<DriverVmm> vmm = []() -> absl::StatusOr<DriverVmm> {
    DriverVmm d;
    const auto get = [](const char* name, auto* fn) -> absl::Status {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t e =
          cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &found);
      if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || p == nullptr) {
        cudaGetLastError();
        return absl::UnimplementedError(absl::StrCat(
            "the CUDA driver has no ", name,
            " (virtual memory management: a CUDA 12 driver is needed)",
            e != cudaSuccess ? absl::StrCat(": ", cudaGetErrorString(e)) : std::string()));
      }
      *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      return absl::OkStatus();
    };
    for (const absl::Status& s :
         {get("cuMemGetAllocationGranularity", &d.granularity),
          get("cuMemAddressReserve", &d.reserve), get("cuMemAddressFree", &d.address_free),
          get("cuMemCreate", &d.create), get("cuMemRelease", &d.release), get("cuMemMap", &d.map),
          get("cuMemUnmap", &d.unmap), get("cuMemSetAccess", &d.set_access)}) {
      if (!s.ok()) return s;
    }
    return d;
  }();
  if (!vmm.ok()) return vmm.status();
  return &*vmm;
}

absl::Status DriverCheck(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const std::string message = absl::StrCat(what, ": CUDA driver error ", int(r));
  return r == CUDA_ERROR_OUT_OF_MEMORY ? absl::ResourceExhaustedError(message)
                                       : absl::InternalError(message);
}

CUmemAllocationProp DeviceProp(int device) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

absl::StatusOr<int> CurrentDevice() {
  int device = 0;
  const cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaGetDevice: ", cudaGetErrorString(e)));
  }
  return device;
}

}  // namespace

absl::StatusOr<size_t> ReservedMemoryGranularity() {
  absl::StatusOr<const DriverVmm*> vmm = Vmm();
  if (!vmm.ok()) return vmm.status();
  absl::StatusOr<int> device = CurrentDevice();
  if (!device.ok()) return device.status();
  const CUmemAllocationProp prop = DeviceProp(*device);
  size_t granularity = 0;
  absl::Status s =
      DriverCheck((*vmm)->granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                  "cuMemGetAllocationGranularity");
  if (!s.ok()) return s;
  if (granularity == 0) return absl::InternalError("cuMemGetAllocationGranularity: 0");
  return granularity;
}

ReservedDeviceMemory::~ReservedDeviceMemory() { Clear(); }

ReservedDeviceMemory::ReservedDeviceMemory(ReservedDeviceMemory&& o) noexcept
    : base_(std::exchange(o.base_, 0)),
      reserved_(std::exchange(o.reserved_, 0)),
      granularity_(std::exchange(o.granularity_, 0)),
      device_(o.device_),
      pieces_(std::exchange(o.pieces_, {})) {}

ReservedDeviceMemory& ReservedDeviceMemory::operator=(ReservedDeviceMemory&& o) noexcept {
  if (this != &o) {
    Clear();
    base_ = std::exchange(o.base_, 0);
    reserved_ = std::exchange(o.reserved_, 0);
    granularity_ = std::exchange(o.granularity_, 0);
    device_ = o.device_;
    pieces_ = std::exchange(o.pieces_, {});
  }
  return *this;
}

void ReservedDeviceMemory::Clear() {
  if (base_ == 0) return;
  UnmapFrom(0);
  if (absl::StatusOr<const DriverVmm*> vmm = Vmm(); vmm.ok()) {
    (*vmm)->address_free(CUdeviceptr(base_), reserved_);
  }
  base_ = 0;
  reserved_ = 0;
}

void ReservedDeviceMemory::UnmapFrom(size_t keep) {
  if (keep >= pieces_.size()) return;
  absl::StatusOr<const DriverVmm*> vmm = Vmm();
  if (!vmm.ok()) return;  // (nothing can have been mapped)
  NoteAlloc();
  // One unmap per granule (each is its own mapping), from the end.
  for (size_t i = pieces_.size(); i-- > keep;) {
    (*vmm)->unmap(CUdeviceptr(base_ + i * granularity_), granularity_);
    (*vmm)->release(CUmemGenericAllocationHandle(pieces_[i]));
  }
  pieces_.resize(keep);
}

absl::Status ReservedDeviceMemory::Reserve(size_t max_bytes) {
  if (base_ != 0) return absl::FailedPreconditionError("device memory already reserved");
  if (max_bytes == 0) return absl::InvalidArgumentError("reserving 0 bytes");
  absl::StatusOr<const DriverVmm*> vmm = Vmm();
  if (!vmm.ok()) return vmm.status();
  absl::StatusOr<int> device = CurrentDevice();
  if (!device.ok()) return device.status();
  absl::StatusOr<size_t> granularity = ReservedMemoryGranularity();
  if (!granularity.ok()) return granularity.status();
  const size_t bytes = RoundUpToGranularity(max_bytes, *granularity);
  CUdeviceptr base = 0;
  const CUresult r = (*vmm)->reserve(&base, bytes, 0, 0, 0);
  if (r != CUDA_SUCCESS) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cuMemAddressReserve of ", bytes, " bytes: CUDA driver error ", int(r)));
  }
  base_ = uint64_t(base);
  reserved_ = bytes;
  granularity_ = *granularity;
  device_ = *device;
  return absl::OkStatus();
}

absl::Status ReservedDeviceMemory::Resize(size_t bytes) {
  if (base_ == 0) {
    if (bytes == 0) return absl::OkStatus();
    return absl::FailedPreconditionError("device memory not reserved");
  }
  const size_t want = RoundUpToGranularity(bytes, granularity_) / granularity_;
  if (want * granularity_ > reserved_) {
    return absl::OutOfRangeError(
        absl::StrCat(bytes, " bytes asked of a reservation of ", reserved_, " bytes"));
  }
  if (want <= pieces_.size()) {
    UnmapFrom(want);
    return absl::OkStatus();
  }
  absl::StatusOr<const DriverVmm*> vmm = Vmm();
  if (!vmm.ok()) return vmm.status();
  NoteAlloc();
  const CUmemAllocationProp prop = DeviceProp(device_);
  const size_t had = pieces_.size();
  absl::Status s;
  while (s.ok() && pieces_.size() < want) {
    CUmemGenericAllocationHandle h = 0;
    s = DriverCheck((*vmm)->create(&h, granularity_, &prop, 0), "cuMemCreate");
    if (!s.ok()) break;
    s = DriverCheck(
        (*vmm)->map(CUdeviceptr(base_ + pieces_.size() * granularity_), granularity_, 0, h, 0),
        "cuMemMap");
    if (!s.ok()) {
      (*vmm)->release(h);
      break;
    }
    pieces_.push_back(uint64_t(h));
  }
  if (s.ok()) {
    // One access grant for the new granules together (as PyTorch's expandable segments).
    CUmemAccessDesc access = {};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device_;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    s = DriverCheck((*vmm)->set_access(CUdeviceptr(base_ + had * granularity_),
                                       (want - had) * granularity_, &access, 1),
                    "cuMemSetAccess");
  }
  if (!s.ok()) UnmapFrom(had);  // nothing changed
  return s;
}

}  // namespace dgserve::cuda
