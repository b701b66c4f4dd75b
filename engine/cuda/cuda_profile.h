// Counters of what the CUDA backend asks of the device, for engine_bench's launches_per_step and
// syncs_per_step (issue 33: "zero blocking host round trips inside a step; launches counted"),
// and a hook through which the backend's optional phase timer (CUDA events) sees every launch and
// every blocking call. Header-only (C++17 inline variables), so the kernel files compiled by nvcc,
// the host code compiled by g++ and the emulation (engine/cuda/emu/) share one set of counters.
//
// Where they are counted:
//   kernels   LaunchKernel (cuda_device.cuh, and emu/cuda_emu.h under the emulation): every kernel
//             of ours, whatever file launches it
//   cublas    each cuBLAS call that runs a GEMM (cuda_gemm.cu's CublasContext, the backend's
//             router and soft-embedding GEMMs; NoteCublas at the call); one call may run more
//             than one kernel inside cuBLAS
//   d2d       device-to-device copies and memsets, and asynchronous copies to or from pinned host
//             memory (stream work, not a host round trip)
//   graphs    CUDA graph launches (the backend's step, CudaBackendOptions::cuda_graphs); the
//             kernels, cuBLAS calls and copies a replay runs are added to their counters as they
//             were counted at capture, so `kernels` means the same with and without graphs
//   h2d, d2h  host↔device copies from pageable memory: each blocks the host (DeviceArray::Upload,
//             cuda::Download, the backend's KV uploads)
//   syncs     explicit cudaDeviceSynchronize / cudaStreamSynchronize / cudaEventSynchronize
//   allocs    cudaMalloc and cudaFree (cudaFree waits for the device)
// launches = kernels + cublas + d2d; blocking = h2d + d2h + syncs (+ allocs, reported apart).
#pragma once

#include <atomic>
#include <cstdint>

namespace dgserve::cuda {

struct LaunchCounts {
  uint64_t kernels = 0, cublas = 0, d2d = 0, h2d = 0, d2h = 0, syncs = 0, allocs = 0, graphs = 0;

  uint64_t launches() const { return kernels + cublas + d2d; }
  // Host round trips: every copy to or from pageable host memory and every explicit sync.
  uint64_t blocking() const { return h2d + d2h + syncs; }
  LaunchCounts operator-(const LaunchCounts& o) const {
    return {kernels - o.kernels, cublas - o.cublas, d2d - o.d2d,       h2d - o.h2d,
            d2h - o.d2h,         syncs - o.syncs,   allocs - o.allocs, graphs - o.graphs};
  }
};

// What the phase timer (cuda_backend_internal.h) implements: called before a launch is queued and
// before a blocking call starts (so a timed phase can close before the host waits and reopen at
// the next launch: the host's time between is then not in any phase).
class LaunchObserver {
 public:
  virtual ~LaunchObserver() = default;
  virtual void BeforeLaunch() = 0;
  virtual void BeforeBlocking() = 0;
};

namespace profile_detail {
inline std::atomic<uint64_t> kernels{0}, cublas{0}, d2d{0}, h2d{0}, d2h{0}, syncs{0}, allocs{0},
    graphs{0};
// Set by the backend for the duration of a timed step (under its lock); nullptr otherwise.
inline std::atomic<LaunchObserver*> observer{nullptr};
inline void Launch(std::atomic<uint64_t>& c) {
  c.fetch_add(1, std::memory_order_relaxed);
  if (LaunchObserver* o = observer.load(std::memory_order_relaxed)) o->BeforeLaunch();
}
inline void Blocking(std::atomic<uint64_t>& c) {
  c.fetch_add(1, std::memory_order_relaxed);
  if (LaunchObserver* o = observer.load(std::memory_order_relaxed)) o->BeforeBlocking();
}
}  // namespace profile_detail

inline void NoteKernelLaunch() { profile_detail::Launch(profile_detail::kernels); }
inline void NoteCublas() { profile_detail::Launch(profile_detail::cublas); }
inline void NoteDeviceCopy() { profile_detail::Launch(profile_detail::d2d); }
inline void NoteUpload() { profile_detail::Blocking(profile_detail::h2d); }
inline void NoteDownload() { profile_detail::Blocking(profile_detail::d2h); }
inline void NoteSync() { profile_detail::Blocking(profile_detail::syncs); }
inline void NoteAlloc() { profile_detail::Blocking(profile_detail::allocs); }
// Takes back what a stream capture counted (`inside`): captured work has not run.
inline void UnnoteCaptured(const LaunchCounts& inside) {
  using namespace profile_detail;
  constexpr auto r = std::memory_order_relaxed;
  kernels.fetch_sub(inside.kernels, r);
  cublas.fetch_sub(inside.cublas, r);
  d2d.fetch_sub(inside.d2d, r);
}
// A graph launch whose capture counted `inside` (a difference of two ReadLaunchCounts).
inline void NoteGraphLaunch(const LaunchCounts& inside) {
  using namespace profile_detail;
  constexpr auto r = std::memory_order_relaxed;
  kernels.fetch_add(inside.kernels, r);
  cublas.fetch_add(inside.cublas, r);
  d2d.fetch_add(inside.d2d, r);
  graphs.fetch_add(1, r);
}

// The counts since the process started (take two and subtract).
inline LaunchCounts ReadLaunchCounts() {
  using namespace profile_detail;
  constexpr auto r = std::memory_order_relaxed;
  return {kernels.load(r), cublas.load(r), d2d.load(r),    h2d.load(r),
          d2h.load(r),     syncs.load(r),  allocs.load(r), graphs.load(r)};
}

// Scratch buffers that moved (DeviceArray::Ensure and CublasContext's scratch reallocating): a
// CUDA graph keeps the device addresses it was captured with, so a graph captured when
// ScratchGeneration() read g is stale once it reads more than g.
namespace profile_detail {
inline std::atomic<uint64_t> scratch_moves{0};
}
inline void NoteScratchMoved() {
  profile_detail::scratch_moves.fetch_add(1, std::memory_order_acq_rel);
}
inline uint64_t ScratchGeneration() {
  return profile_detail::scratch_moves.load(std::memory_order_acquire);
}

inline void SetLaunchObserver(LaunchObserver* o) { profile_detail::observer.store(o); }

}  // namespace dgserve::cuda
