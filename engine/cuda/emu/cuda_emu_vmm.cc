// The emulated driver API's virtual memory management (include/cuda.h): reservations are
// PROT_NONE host mappings, a handle is a count of device memory taken, a mapped range becomes
// read-write at cuMemSetAccess and inaccessible again at cuMemUnmap. Granules are 256 bytes (so
// that the tests' tiny K/V blocks are not rounded up); access is per host page: a page is
// read-write while any read-write mapping touches it.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <string_view>

#include "engine/cuda/emu/cuda_emu.h"
#include "engine/cuda/emu/include/cuda.h"

namespace {

std::mutex g_vmm_mu;
struct Handle {
  size_t bytes = 0;
  int mappings = 0;
  bool released = false;
};
struct Mapping {
  size_t bytes = 0;
  CUmemGenericAllocationHandle handle = 0;
  bool writable = false;  // cuMemSetAccess read-write
};
// Never destroyed (a backend may be destroyed in a static destructor).
std::map<CUmemGenericAllocationHandle, Handle>& Handles() {
  static auto& m = *new std::map<CUmemGenericAllocationHandle, Handle>;
  return m;
}
std::map<uintptr_t, size_t>& Reserved() {  // start → bytes
  static auto& m = *new std::map<uintptr_t, size_t>;
  return m;
}
std::map<uintptr_t, Mapping>& Mapped() {  // start → mapping
  static auto& m = *new std::map<uintptr_t, Mapping>;
  return m;
}
CUmemGenericAllocationHandle g_next_handle = 1;

constexpr size_t kGranule = 256;
size_t PageSize() { return size_t(sysconf(_SC_PAGESIZE)); }

bool DeviceZero(const CUmemLocation& l) {
  return l.type == CU_MEM_LOCATION_TYPE_DEVICE && l.id == 0;
}

// Whether [a, a + bytes) lies inside one reservation (g_vmm_mu held).
bool InOneReservation(uintptr_t a, size_t bytes) {
  auto it = Reserved().upper_bound(a);
  if (it == Reserved().begin()) return false;
  --it;
  return a + bytes <= it->first + it->second;
}

// The mappings exactly covering [a, a + bytes), back to back, as [first, last) iterators; first ==
// last when they do not (g_vmm_mu held).
std::pair<std::map<uintptr_t, Mapping>::iterator, std::map<uintptr_t, Mapping>::iterator> Covering(
    uintptr_t a, size_t bytes) {
  auto& m = Mapped();
  const auto first = m.find(a);
  if (first == m.end() || bytes == 0) return {m.end(), m.end()};
  uintptr_t at = a;
  auto it = first;
  while (it != m.end() && it->first == at && at < a + bytes) {
    at += it->second.bytes;
    ++it;
  }
  if (at != a + bytes) return {m.end(), m.end()};
  return {first, it};
}

// Every host page touching [a, a + bytes): read-write where a writable mapping touches it, else
// inaccessible, and its memory dropped where no mapping touches it (g_vmm_mu held).
void Reprotect(uintptr_t a, size_t bytes) {
  const size_t page = PageSize();
  for (uintptr_t p = a / page * page; p < a + bytes; p += page) {
    bool touched = false, writable = false;
    auto it = Mapped().upper_bound(p);
    if (it != Mapped().begin()) --it;
    for (; it != Mapped().end() && it->first < p + page; ++it) {
      if (it->first + it->second.bytes <= p) continue;
      touched = true;
      writable = writable || it->second.writable;
    }
    void* at = reinterpret_cast<void*>(p);
    if (!touched) madvise(at, page, MADV_DONTNEED);
    mprotect(at, page, writable ? PROT_READ | PROT_WRITE : PROT_NONE);
  }
}

CUresult Forbidden(const char* call) {
  return dgserve::cuda::emu::CaptureForbids(call) == cudaSuccess
             ? CUDA_SUCCESS
             : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

}  // namespace

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  if (granularity == nullptr || prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      !DeviceZero(prop->location)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  *granularity = kGranule;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  if (ptr == nullptr || size == 0 || size % kGranule != 0 || addr != 0 ||
      (alignment != 0 && PageSize() % alignment != 0)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Whole host pages (mmap's), page-aligned.
  const size_t pages = (size + PageSize() - 1) / PageSize() * PageSize();
  void* p = mmap(nullptr, pages, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  {
    std::lock_guard<std::mutex> l(g_vmm_mu);
    Reserved()[reinterpret_cast<uintptr_t>(p)] = size;
  }
  dgserve::cuda::emu::RememberReservation(p, size);
  *ptr = reinterpret_cast<CUdeviceptr>(p);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  {
    std::lock_guard<std::mutex> l(g_vmm_mu);
    const auto it = Reserved().find(uintptr_t(ptr));
    if (it == Reserved().end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
    // Still mapped inside: refused (the driver requires the range unmapped first).
    const auto m = Mapped().lower_bound(uintptr_t(ptr));
    if (m != Mapped().end() && m->first < uintptr_t(ptr) + size) return CUDA_ERROR_INVALID_VALUE;
    Reserved().erase(it);
  }
  dgserve::cuda::emu::ForgetReservation(reinterpret_cast<void*>(ptr));
  munmap(reinterpret_cast<void*>(ptr), (size + PageSize() - 1) / PageSize() * PageSize());
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  if (const CUresult e = Forbidden("cuMemCreate"); e != CUDA_SUCCESS) return e;
  if (handle == nullptr || prop == nullptr || prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      !DeviceZero(prop->location) || size == 0 || size % kGranule != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!dgserve::cuda::emu::TakeDeviceMemory(size)) return CUDA_ERROR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> l(g_vmm_mu);
  *handle = g_next_handle++;
  Handles()[*handle] = Handle{size, 0, false};
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  if (const CUresult e = Forbidden("cuMemRelease"); e != CUDA_SUCCESS) return e;
  std::lock_guard<std::mutex> l(g_vmm_mu);
  const auto it = Handles().find(handle);
  if (it == Handles().end() || it->second.released) return CUDA_ERROR_INVALID_VALUE;
  // As the driver: the memory is freed once no mapping of it is left.
  it->second.released = true;
  if (it->second.mappings == 0) {
    dgserve::cuda::emu::GiveBackDeviceMemory(it->second.bytes);
    Handles().erase(it);
  }
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  if (const CUresult e = Forbidden("cuMemMap"); e != CUDA_SUCCESS) return e;
  std::lock_guard<std::mutex> l(g_vmm_mu);
  const auto h = Handles().find(handle);
  if (h == Handles().end() || h->second.released || offset != 0 || size != h->second.bytes ||
      uintptr_t(ptr) % kGranule != 0 || !InOneReservation(uintptr_t(ptr), size)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  // Not over another mapping.
  auto& m = Mapped();
  const auto next = m.lower_bound(uintptr_t(ptr));
  if (next != m.end() && next->first < uintptr_t(ptr) + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != m.begin()) {
    const auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > uintptr_t(ptr)) return CUDA_ERROR_INVALID_VALUE;
  }
  // Unspecified contents (a device's may be anything): 0xFF bytes, NaN as float and as bf16.
  const size_t page = PageSize();
  const uintptr_t first_page = uintptr_t(ptr) / page * page;
  const size_t span = (uintptr_t(ptr) + size + page - 1) / page * page - first_page;
  if (mprotect(reinterpret_cast<void*>(first_page), span, PROT_READ | PROT_WRITE) != 0) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::memset(reinterpret_cast<void*>(ptr), 0xFF, size);
  m[uintptr_t(ptr)] = Mapping{size, handle, false};
  ++h->second.mappings;
  Reprotect(uintptr_t(ptr), size);
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  if (const CUresult e = Forbidden("cuMemSetAccess"); e != CUDA_SUCCESS) return e;
  if (desc == nullptr || count != 1 || !DeviceZero(desc->location)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  std::lock_guard<std::mutex> l(g_vmm_mu);
  const auto [first, last] = Covering(uintptr_t(ptr), size);
  if (first == last) return CUDA_ERROR_INVALID_VALUE;  // not all of it mapped
  // (Read-only is emulated as read-write: the backend grants read-write only.)
  for (auto it = first; it != last; ++it) {
    it->second.writable = desc->flags != CU_MEM_ACCESS_FLAGS_PROT_NONE;
  }
  Reprotect(uintptr_t(ptr), size);
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  if (const CUresult e = Forbidden("cuMemUnmap"); e != CUDA_SUCCESS) return e;
  std::lock_guard<std::mutex> l(g_vmm_mu);
  // Whole mappings only (the driver refuses to split one).
  const auto [first, last] = Covering(uintptr_t(ptr), size);
  if (first == last) return CUDA_ERROR_INVALID_VALUE;
  for (auto it = first; it != last;) {
    const auto h = Handles().find(it->second.handle);
    if (--h->second.mappings == 0 && h->second.released) {
      dgserve::cuda::emu::GiveBackDeviceMemory(h->second.bytes);
      Handles().erase(h);
    }
    it = Mapped().erase(it);
  }
  Reprotect(uintptr_t(ptr), size);
  return CUDA_SUCCESS;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** funcPtr,
                                             unsigned int cudaVersion, unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* driverStatus) {
  if (symbol == nullptr || funcPtr == nullptr) return cudaErrorInvalidValue;
  static const std::map<std::string_view, void*> kEntryPoints = {
      {"cuMemGetAllocationGranularity", reinterpret_cast<void*>(&cuMemGetAllocationGranularity)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&cuMemAddressReserve)},
      {"cuMemAddressFree", reinterpret_cast<void*>(&cuMemAddressFree)},
      {"cuMemCreate", reinterpret_cast<void*>(&cuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&cuMemRelease)},
      {"cuMemMap", reinterpret_cast<void*>(&cuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&cuMemUnmap)},
      {"cuMemSetAccess", reinterpret_cast<void*>(&cuMemSetAccess)},
  };
  const auto it = kEntryPoints.find(symbol);
  *funcPtr = it == kEntryPoints.end() ? nullptr : it->second;
  if (driverStatus != nullptr) {
    *driverStatus =
        it == kEntryPoints.end() ? cudaDriverEntryPointSymbolNotFound : cudaDriverEntryPointSuccess;
  }
  return cudaSuccess;
}
