// Host emulation of the CUDA subset our kernels use, so that their device code compiles with g++
// and runs on a machine without a GPU or a CUDA toolkit (label `gpu-emu`). It checks kernel
// LOGIC only: indexing, masking, reductions, barriers and warp collectives against the CPU
// code. It says nothing about speed, occupancy, memory coalescing, real data races or the
// device's floating-point details (g++ host math, no FMA contraction). See
// engine/cuda/README.md.
//
// Execution model. Launches run synchronously on the calling thread, one at a time (a global
// lock), blocks one after another (a launch into a stream capture runs when the graph is
// launched; see cudaStreamBeginCapture below). Each CUDA thread of a block is its own host
// execution context — a fiber with its own stack — so every CUDA thread has private registers and
// locals; fibers switch only at collectives, so a run is deterministic. `__shared__` variables are
// function statics (shared by the block's threads; blocks never overlap), the dynamic shared
// memory is a per-launch buffer filled with 0xFF before every block. Collectives:
//   __syncthreads / __syncthreads_or|and|count   wait for every live thread of the block
//   __shfl*_sync, __ballot_sync, __any/__all_sync, __syncwarp   wait for every lane in the mask;
//                                                 values are exchanged through per-warp slots
//   mma.sync, ldmatrix (engine/cuda/cuda_mma.cuh)   wait for the whole warp; WarpExchange
// A lane of the mask that exited, lanes of one warp at different collectives, or a block that
// can make no progress (a __syncthreads some threads never reach) fail the launch with
// cudaErrorLaunchFailure and a message on stderr. Atomics go through std::atomic_ref.
#pragma once

#include <limits.h>
#include <math.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "engine/cuda/cuda_profile.h"

// ---- Qualifiers and types --------------------------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct uint3 {
  unsigned int x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

// The builtin index variables of the running CUDA thread (set by the scheduler before it
// resumes each fiber; all fibers of a launch run on the launching OS thread).
inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
inline constexpr int warpSize = 32;

// ---- Runtime API subset ------------------------------------------------------------------------

enum cudaError {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevice = 101,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorIllegalState = 401,
  cudaErrorNotReady = 600,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureImplicit = 906,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

// Memory is host memory (256-byte aligned); every copy kind is a memcpy. Device allocations and
// pinned host memory (cudaMallocHost, cudaHostAlloc, cudaHostRegister) are remembered, so that
// stream capture can refuse a copy from or to pageable host memory, as CUDA does.
cudaError_t cudaMalloc(void** p, size_t bytes);
template <typename T>
cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
cudaError_t cudaFree(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream = nullptr);
enum {
  cudaHostAllocDefault = 0,
  cudaHostAllocPortable = 1,
  cudaHostAllocMapped = 2,
  cudaHostAllocWriteCombined = 4
};
enum { cudaHostRegisterDefault = 0, cudaHostRegisterPortable = 1 };
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void* p);
// Streams: every launch and copy is synchronous; the only work a stream can have outstanding is
// the emulated NCCL's (nccl_emu.cc: a send or receive not yet matched by its peer), which
// cudaStreamQuery reports as cudaErrorNotReady and cudaStreamSynchronize waits for. Both also
// report the sticky error of a failed kernel. (cuda_emu_async.cc)
cudaError_t cudaStreamCreate(cudaStream_t* stream);
enum { cudaStreamDefault = 0, cudaStreamNonBlocking = 1 };
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
// Events: a record completes when the stream's outstanding work (above) has; copies are
// synchronous, so after cudaMemcpyAsync + cudaEventRecord the event is complete.
struct CUevent_st;
typedef struct CUevent_st* cudaEvent_t;
enum {
  cudaEventDefault = 0,
  cudaEventBlockingSync = 1,
  cudaEventDisableTiming = 2,
  cudaEventInterprocess = 4
};
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0);
// Stream capture and graphs (cuda_emu_async.cc). Between cudaStreamBeginCapture and
// cudaStreamEndCapture the kernels, cuBLAS GEMMs, cudaMemcpyAsync and cudaMemsetAsync queued on
// the stream are recorded, not run (kernel arguments copied then, copies reading their source
// at replay); cudaGraphLaunch replays them in order, synchronously. As CUDA does, capture
// refuses with cudaErrorStreamCaptureUnsupported, and invalidates the capture (EndCapture then
// answers cudaErrorStreamCaptureInvalidated and no graph):
//   - the "potentially unsafe" calls, unless the capture's mode is relaxed: cudaMalloc,
//     cudaFree, cudaMallocHost, cudaHostAlloc, cudaFreeHost, cudaHostRegister / Unregister,
//     cudaMemcpy, cudaMemset, cudaDeviceSynchronize, cudaStreamSynchronize of the legacy stream
//     (from any thread for a global-mode capture, from the capturing thread for thread-local);
//   - cudaStreamSynchronize or cudaStreamQuery of the capturing stream (any mode);
//   - cudaMemcpyAsync between the device and pageable host memory onto the capturing stream;
// and work queued on the legacy stream (nullptr) while a stream created without
// cudaStreamNonBlocking captures is refused with cudaErrorStreamCaptureImplicit (for a kernel:
// the launch error), invalidating that capture. Not emulated: event fork/join across streams
// (an event record on a capturing stream is an empty node; a wait on it does nothing), graph
// nodes, updates and memory nodes, launch-configuration errors at capture time (they show at
// replay).
struct CUgraph_st;
typedef struct CUgraph_st* cudaGraph_t;
struct CUgraphExec_st;
typedef struct CUgraphExec_st* cudaGraphExec_t;
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph,
                                 unsigned long long flags = 0);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph,
                                          unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
// Host time between the two records (every launch is synchronous, so a record is taken when the
// work before it has finished). cudaMemGetInfo: free = total (allocations are not tracked).
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes);
// CUDA IPC within one process (both ends of an emulated "interprocess" exchange are in the
// test's process): a handle carries the pointer itself. Opening an event handle gives a new
// event object (the opener destroys it); opening a memory handle returns its pointer
// (cudaIpcCloseMemHandle is then a no-op). A handle of memory that was not allocated by cudaMalloc
// is refused.
typedef struct cudaIpcMemHandle_st {
  char reserved[64];
} cudaIpcMemHandle_t;
typedef struct cudaIpcEventHandle_st {
  char reserved[64];
} cudaIpcEventHandle_t;
enum { cudaIpcMemLazyEnablePeerAccess = 1 };
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* device_ptr);
cudaError_t cudaIpcOpenMemHandle(void** device_ptr, cudaIpcMemHandle_t handle, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void* device_ptr);
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event);
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle);
// Device properties: name and a fixed UUID of the one emulated device.
typedef struct CUuuid_st {
  char bytes[16];
} cudaUUID_t;
struct cudaDeviceProp {
  char name[256];
  cudaUUID_t uuid;
  size_t totalGlobalMem;
  int major, minor;
};
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
// Clears the sticky error of a failed kernel (memory is kept, unlike on a device).
cudaError_t cudaDeviceReset();
// One emulated device (an H200's limits: 227 KiB opt-in shared memory per block).
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
// Driver entry points: the emulated driver API of include/cuda.h (its virtual memory management
// subset, cuda_emu_vmm.cc) by name; any other symbol is cudaDriverEntryPointSymbolNotFound, with
// *funcPtr null.
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
enum { cudaEnableDefault = 0x0 };
cudaError_t cudaGetDriverEntryPointByVersion(
    const char* symbol, void** funcPtr, unsigned int cudaVersion, unsigned long long flags,
    cudaDriverEntryPointQueryResult* driverStatus = nullptr);
// The last launch error (cleared by the call), as the CUDA runtime.
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t e);

namespace dgserve::cuda::emu {

// Work outstanding on a stream (the emulated NCCL's unmatched sends and receives): Begin before
// it is queued, End once it completed or was aborted. nullptr is the default stream.
void StreamWorkBegin(cudaStream_t stream);
void StreamWorkEnd(cudaStream_t stream);

// Queues `work` on `stream`: runs it now, or records it into the stream's capture (see
// cudaStreamBeginCapture above). Returns what capture refuses (the work is then dropped).
cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work);

// cudaSuccess, or cudaErrorStreamCaptureUnsupported (invalidating the captures concerned) when
// an ongoing capture forbids the potentially unsafe call `call` (message on stderr).
cudaError_t CaptureForbids(const char* call);

// Refuses `what` on the capturing `stream`: invalidates its capture and returns
// cudaErrorStreamCaptureUnsupported (message on stderr).
cudaError_t RefuseInCapture(cudaStream_t stream, const char* what);

// A device memory bound for tests (0, the default: none): a cudaMalloc beyond it fails with
// cudaErrorMemoryAllocation, also left as the last error (as CUDA's), and cudaMemGetInfo reports
// the bound as the total and what is left of it as free.
void SetDeviceMemoryLimit(size_t bytes);
void DeviceMemoryInfo(size_t* free_bytes, size_t* total_bytes);

// Whether [p, p + bytes) lies in pinned host memory, or in a device allocation (cudaMalloc's,
// or an address range cuMemAddressReserve reserved).
bool IsPinnedHost(const void* p, size_t bytes);
bool IsDeviceMemory(const void* p, size_t bytes);

// For the emulated driver API (cuda_emu_vmm.cc): `bytes` of device memory taken (false, nothing
// taken, beyond the limit) and given back; an address range reserved and freed (IsDeviceMemory).
bool TakeDeviceMemory(size_t bytes);
void GiveBackDeviceMemory(size_t bytes);
void RememberReservation(const void* p, size_t bytes);
void ForgetReservation(const void* p);

// The error of a failed kernel, reported by every later synchronisation (cleared by
// cudaDeviceReset).
cudaError_t StickyError();

// Records a kernel's opt-in dynamic shared memory size (checked at launch, as on a device:
// more than 48 KiB needs it).
void SetMaxDynamicShared(const void* kernel, int bytes);

// Runs `thread_body` once per CUDA thread of every block of the grid (see the file comment).
// `kernel` identifies the kernel for its shared memory attribute.
void Launch(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
            const std::function<void()>& thread_body);
// Launch queued on `stream` (Enqueue): now, or at the replay of the captured graph. A launch
// that capture refuses sets the last error.
void LaunchOn(cudaStream_t stream, const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
              std::function<void()> thread_body);

// The running block's dynamic shared memory.
void* DynamicSharedBase();

// Warp collective: every lane in `mask` calls it with the same `op`; returns the lane's result:
// for the shuffles the value of lane `src_lane` (which must be in the mask), for the votes the
// ballot of value != 0 over the mask.
enum class WarpOp { kShflIdx, kShflXor, kShflUp, kShflDown, kBallot, kAny, kAll, kSync, kExchange };
uint64_t WarpCollective(WarpOp op, unsigned mask, uint64_t value, int src_lane);

// Warp-wide exchange, the collective behind the matrix-core instructions (engine/cuda/cuda_mma.cuh,
// cuda_emu_mma.cc): every lane of `mask` calls it with the same `fn`; once all have, `fn` runs
// once, on the last lane to arrive, with each lane's `in` and `out` pointers indexed by lane
// (nullptr for lanes outside the mask; they point into the callers' stacks, which stay put while
// the lanes wait), then every lane goes on. As for the shuffles, a lane of the mask that exited
// or that waits at another collective fails the launch. `name` names the instruction in messages.
using WarpExchangeFn = void (*)(const void* const in[32], void* const out[32]);
void WarpExchange(const char* name, unsigned mask, WarpExchangeFn fn, const void* in, void* out);

// Fails the running launch with `what` (cudaErrorLaunchFailure, message on stderr); never
// returns. For the instruction emulations' own checks (misaligned addresses and the like).
[[noreturn]] void KernelFailure(const std::string& what);

// The matrix-core instructions of cuda_mma.cuh (cuda_emu_mma.cc; see there and cuda_mma.cuh).
void MmaBf16M16N8K16(float d[4], const uint32_t a[4], const uint32_t b[2]);
void MmaE4m3M16N8K32(float d[4], const uint32_t a[4], const uint32_t b[2]);
void LdMatrix(int matrices, bool trans, uint32_t* r, const void* smem_row);
// cp.async of the running CUDA thread: the copy is recorded and done when a wait completes its
// group (so a read of the destination before the wait sees the old contents, as a device may).
void CpAsync(void* dst, const void* src, size_t bytes);
void CpAsyncCommit();
void CpAsyncWait(int pending_groups);  // < 0: every copy, committed or not (cp.async.wait_all)

// Block collective over the live (not yet exited) threads.
struct BlockVote {
  int count;         // threads with pred != 0
  int participants;  // threads that took part
};
BlockVote BlockCollective(int pred);

// The running thread's lane (its linear index in the block, mod 32).
inline int LaneId() {
  return int((threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32);
}

// The lane a shuffle of `width` (a power of two ≤ 32) reads, as CUDA defines it: within the
// caller's group of `width` lanes; up/down past the group's edge and xor into a later group
// read the caller's own value.
inline int ShflSource(WarpOp op, int lane, int arg, int width) {
  const int base = lane & ~(width - 1);
  switch (op) {
    case WarpOp::kShflIdx:
      return base + (arg & (width - 1));
    case WarpOp::kShflXor:
      return (lane ^ arg) < base + width ? lane ^ arg : lane;
    case WarpOp::kShflUp:
      return lane - base >= arg ? lane - arg : lane;
    case WarpOp::kShflDown:
      return lane - base + arg < width ? lane + arg : lane;
    default:
      return lane;
  }
}

template <typename T>
uint64_t ToBits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <typename T>
T FromBits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

}  // namespace dgserve::cuda::emu

template <typename F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    dgserve::cuda::emu::SetMaxDynamicShared(reinterpret_cast<const void*>(kernel), value);
  }
  return cudaSuccess;
}

// ---- Synchronisation and warp intrinsics -------------------------------------------------------

inline void __syncthreads() { dgserve::cuda::emu::BlockCollective(0); }
inline int __syncthreads_or(int pred) {
  return dgserve::cuda::emu::BlockCollective(pred).count > 0;
}
inline int __syncthreads_and(int pred) {
  const dgserve::cuda::emu::BlockVote v = dgserve::cuda::emu::BlockCollective(pred);
  return v.count == v.participants;
}
inline int __syncthreads_count(int pred) { return dgserve::cuda::emu::BlockCollective(pred).count; }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  dgserve::cuda::emu::WarpCollective(dgserve::cuda::emu::WarpOp::kSync, mask, 0, 0);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  using namespace dgserve::cuda::emu;
  const int src = ShflSource(WarpOp::kShflIdx, LaneId(), src_lane, width);
  return FromBits<T>(WarpCollective(WarpOp::kShflIdx, mask, ToBits(v), src));
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  using namespace dgserve::cuda::emu;
  const int src = ShflSource(WarpOp::kShflXor, LaneId(), lane_mask, width);
  return FromBits<T>(WarpCollective(WarpOp::kShflXor, mask, ToBits(v), src));
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace dgserve::cuda::emu;
  const int src = ShflSource(WarpOp::kShflUp, LaneId(), int(delta), width);
  return FromBits<T>(WarpCollective(WarpOp::kShflUp, mask, ToBits(v), src));
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  using namespace dgserve::cuda::emu;
  const int src = ShflSource(WarpOp::kShflDown, LaneId(), int(delta), width);
  return FromBits<T>(WarpCollective(WarpOp::kShflDown, mask, ToBits(v), src));
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  using namespace dgserve::cuda::emu;
  return unsigned(WarpCollective(WarpOp::kBallot, mask, pred != 0, 0));
}
inline int __any_sync(unsigned mask, int pred) {
  using namespace dgserve::cuda::emu;
  return int(WarpCollective(WarpOp::kAny, mask, pred != 0, 0));
}
inline int __all_sync(unsigned mask, int pred) {
  using namespace dgserve::cuda::emu;
  return int(WarpCollective(WarpOp::kAll, mask, pred != 0, 0));
}

// ---- Atomics ------------------------------------------------------------------------------------

template <typename T>
T atomicAdd(T* p, T v) {
  return std::atomic_ref<T>(*p).fetch_add(v);
}
template <typename T>
T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <typename T>
T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
template <typename T>
T atomicCAS(T* p, T expected, T desired) {
  std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);
  return expected;
}

// ---- Math and bit intrinsics --------------------------------------------------------------------
// The _rn arithmetic is plain IEEE float arithmetic (the emulation builds with
// -ffp-contract=off, so nothing is fused behind the code's back); fmaf is the C library's.

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __int_as_float(int i) { return dgserve::cuda::emu::FromBits<float>(uint32_t(i)); }
inline float __uint_as_float(unsigned u) { return dgserve::cuda::emu::FromBits<float>(u); }
inline int __float_as_int(float f) { return int(uint32_t(dgserve::cuda::emu::ToBits(f))); }
inline unsigned __float_as_uint(float f) { return unsigned(dgserve::cuda::emu::ToBits(f)); }
inline double __longlong_as_double(long long i) {
  return dgserve::cuda::emu::FromBits<double>(uint64_t(i));
}
inline long long __double_as_longlong(double d) {
  return (long long)(dgserve::cuda::emu::ToBits(d));
}
inline int __float2int_rn(float f) { return int(std::nearbyint(f)); }  // default mode: even
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(unsigned(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }

// CUDA's integer min/max overloads (device code calls them unqualified).
#define DGSERVE_EMU_MINMAX(T)                      \
  inline T min(T a, T b) { return b < a ? b : a; } \
  inline T max(T a, T b) { return a < b ? b : a; }
DGSERVE_EMU_MINMAX(int)
DGSERVE_EMU_MINMAX(unsigned int)
DGSERVE_EMU_MINMAX(long)
DGSERVE_EMU_MINMAX(unsigned long)
DGSERVE_EMU_MINMAX(long long)
DGSERVE_EMU_MINMAX(unsigned long long)
#undef DGSERVE_EMU_MINMAX
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }

// ---- Calls the emulated runtime saw (independent of engine/cuda/cuda_profile.h's counters) -----

namespace dgserve::cuda::emu {
struct CallCounts {
  uint64_t gemms = 0;                    // cublasSgemm + cublasGemmEx
  uint64_t h2d = 0, d2h = 0, d2d = 0;    // cudaMemcpy / cudaMemcpyAsync by kind
};
CallCounts ReadCallCounts();
void CountGemmCall();
}  // namespace dgserve::cuda::emu

// ---- What engine/cuda/cuda_device.cuh provides under nvcc ---------------------------------------

namespace dgserve::cuda {

// The emulated kernel<<<grid, block, shared_bytes, stream>>>(args...): runs the whole grid
// before returning (or, on a capturing stream, records it with a copy of the arguments);
// errors show in cudaGetLastError(). Each CUDA thread gets its own copy of the arguments,
// converted to the kernel's parameter types.
template <typename... Params, typename... Args>
void LaunchKernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                  cudaStream_t stream, Args&&... args) {
  NoteKernelLaunch();  // engine/cuda/cuda_profile.h, as cuda_device.cuh counts under nvcc
  auto params =
      std::make_shared<const std::tuple<std::decay_t<Params>...>>(std::forward<Args>(args)...);
  emu::LaunchOn(stream, reinterpret_cast<const void*>(kernel), grid, block, shared_bytes,
                [kernel, params] { std::apply(kernel, *params); });
}

// The running block's dynamic shared memory (16-byte aligned).
template <typename T>
T* DynamicShared() {
  return static_cast<T*>(emu::DynamicSharedBase());
}

}  // namespace dgserve::cuda
