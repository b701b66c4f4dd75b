// The emulated runtime's streams, stream capture and graphs, events, CUDA IPC and device
// properties (see cuda_emu.h). An emulation: the real runtime needs a GPU; here streams count
// outstanding emulated NCCL work and record captured work, and IPC handles carry pointers within
// the one process.
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "engine/cuda/emu/cuda_emu.h"

struct CUstream_st {
  std::mutex mu;
  std::condition_variable idle;
  int pending = 0;
  bool non_blocking = false;
  // Stream capture (guarded by g_capture_mu below).
  bool capturing = false, invalidated = false;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeGlobal;
  std::thread::id capture_thread;
  std::vector<std::function<void()>> nodes;
};

struct CUevent_st {
  std::chrono::steady_clock::time_point at{};  // the host time of the last record
  bool recorded = false;
};

struct CUgraph_st {
  std::vector<std::function<void()>> nodes;
};

struct CUgraphExec_st {
  std::vector<std::function<void()>> nodes;
};

namespace dgserve::cuda::emu {
namespace {

CUstream_st& Resolve(cudaStream_t s) {
  static CUstream_st* const default_stream = new CUstream_st;
  return s == nullptr ? *default_stream : *s;
}

// The streams capturing now (never destroyed: cudaFree, which asks, may run in static
// destructors). Captured work runs later on the calling thread (cudaGraphLaunch), so recording
// takes this lock only, never a launch.
std::mutex g_capture_mu;
std::set<CUstream_st*>& Capturing() {
  static std::set<CUstream_st*>& capturing = *new std::set<CUstream_st*>;
  return capturing;
}

void Invalidate(CUstream_st* s, const char* what, cudaError_t e) {
  if (!s->invalidated) {
    std::fprintf(stderr, "cuda_emu: %s during stream capture: %s; the capture is invalidated\n",
                 what, cudaGetErrorString(e));
  }
  s->invalidated = true;
  s->nodes.clear();
}

}  // namespace

cudaError_t CaptureForbids(const char* call) {
  std::lock_guard<std::mutex> l(g_capture_mu);
  const std::thread::id self = std::this_thread::get_id();
  cudaError_t e = cudaSuccess;
  for (CUstream_st* s : Capturing()) {
    // The calling thread's mode is the default (global): its own non-relaxed captures and every
    // other thread's global-mode captures forbid potentially unsafe calls.
    const bool forbids = s->capture_thread == self ? s->mode != cudaStreamCaptureModeRelaxed
                                                   : s->mode == cudaStreamCaptureModeGlobal;
    if (!forbids) continue;
    e = cudaErrorStreamCaptureUnsupported;
    Invalidate(s, call, e);
  }
  return e;
}

cudaError_t RefuseInCapture(cudaStream_t stream, const char* what) {
  std::lock_guard<std::mutex> l(g_capture_mu);
  Invalidate(&Resolve(stream), what, cudaErrorStreamCaptureUnsupported);
  return cudaErrorStreamCaptureUnsupported;
}

cudaError_t Enqueue(cudaStream_t stream, std::function<void()> work) {
  {
    std::lock_guard<std::mutex> l(g_capture_mu);
    if (stream == nullptr) {
      // The legacy stream waits for, and is waited for by, every blocking stream: work on it
      // would depend on a capture.
      cudaError_t e = cudaSuccess;
      for (CUstream_st* s : Capturing()) {
        if (s->non_blocking) continue;
        e = cudaErrorStreamCaptureImplicit;
        Invalidate(s, "work on the legacy stream (nullptr)", e);
      }
      if (e != cudaSuccess) return e;
    } else if (stream->capturing) {
      if (stream->invalidated) return cudaErrorStreamCaptureInvalidated;
      stream->nodes.push_back(std::move(work));
      return cudaSuccess;
    }
  }
  work();
  return cudaSuccess;
}

void StreamWorkBegin(cudaStream_t stream) {
  CUstream_st& s = Resolve(stream);
  std::lock_guard<std::mutex> l(s.mu);
  ++s.pending;
}

void StreamWorkEnd(cudaStream_t stream) {
  CUstream_st& s = Resolve(stream);
  std::lock_guard<std::mutex> l(s.mu);
  if (--s.pending == 0) s.idle.notify_all();
}

}  // namespace dgserve::cuda::emu

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = new CUstream_st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  *stream = new CUstream_st;
  (*stream)->non_blocking = (flags & cudaStreamNonBlocking) != 0;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  {
    std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_capture_mu);
    dgserve::cuda::emu::Capturing().erase(stream);
  }
  delete stream;
  return cudaSuccess;
}

namespace {
// A synchronisation with `stream` (or the device, for nullptr) refused by an ongoing capture.
cudaError_t SyncForbidden(cudaStream_t stream, const char* call) {
  if (stream == nullptr) return dgserve::cuda::emu::CaptureForbids(call);
  bool capturing;
  {
    std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_capture_mu);
    capturing = stream->capturing;
  }
  return capturing ? dgserve::cuda::emu::RefuseInCapture(stream, call) : cudaSuccess;
}
}  // namespace

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (const cudaError_t e = SyncForbidden(stream, "cudaStreamSynchronize"); e != cudaSuccess) {
    return e;
  }
  CUstream_st& s = dgserve::cuda::emu::Resolve(stream);
  {
    std::unique_lock<std::mutex> l(s.mu);
    s.idle.wait(l, [&] { return s.pending == 0; });
  }
  return dgserve::cuda::emu::StickyError();
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (const cudaError_t e = SyncForbidden(stream, "cudaStreamQuery"); e != cudaSuccess) return e;
  CUstream_st& s = dgserve::cuda::emu::Resolve(stream);
  {
    std::lock_guard<std::mutex> l(s.mu);
    if (s.pending > 0) return cudaErrorNotReady;
  }
  return dgserve::cuda::emu::StickyError();
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  if (stream == nullptr) return cudaErrorStreamCaptureUnsupported;  // the legacy stream
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_capture_mu);
  if (stream->capturing) return cudaErrorIllegalState;
  stream->capturing = true;
  stream->invalidated = false;
  stream->mode = mode;
  stream->capture_thread = std::this_thread::get_id();
  stream->nodes.clear();
  dgserve::cuda::emu::Capturing().insert(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) {
  if (stream == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_capture_mu);
  if (!stream->capturing) return cudaErrorIllegalState;
  stream->capturing = false;
  dgserve::cuda::emu::Capturing().erase(stream);
  *graph = nullptr;
  if (stream->invalidated) {
    stream->invalidated = false;
    return cudaErrorStreamCaptureInvalidated;
  }
  *graph = new CUgraph_st{std::move(stream->nodes)};
  stream->nodes.clear();
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  if (status == nullptr) return cudaErrorInvalidValue;
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_capture_mu);
  const CUstream_st& s = dgserve::cuda::emu::Resolve(stream);
  *status = !s.capturing    ? cudaStreamCaptureStatusNone
            : s.invalidated ? cudaStreamCaptureStatusInvalidated
                            : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  if (exec == nullptr || graph == nullptr) return cudaErrorInvalidValue;
  *exec = new CUgraphExec_st{graph->nodes};
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t* exec, cudaGraph_t graph,
                                          unsigned long long flags) {
  return cudaGraphInstantiate(exec, graph, flags);
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  if (exec == nullptr) return cudaErrorInvalidValue;
  // A graph launched into a capture becomes one node of it (a child graph, on a device).
  return dgserve::cuda::emu::Enqueue(stream, [nodes = exec->nodes] {
    for (const std::function<void()>& node : nodes) node();
  });
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete graph;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) {
  *event = new CUevent_st;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (stream != nullptr && cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    return dgserve::cuda::emu::Enqueue(stream, [] {});  // an empty node (see cuda_emu.h)
  }
  // The copies before it are synchronous; outstanding NCCL work completes it later on a GPU,
  // here the record waits for it (nothing in this project records after NCCL work).
  const cudaError_t e = cudaStreamSynchronize(stream);
  event->at = std::chrono::steady_clock::now();  // every launch before it has finished
  event->recorded = true;
  return e;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (start == nullptr || end == nullptr) return cudaErrorInvalidResourceHandle;
  if (!start->recorded || !end->recorded) return cudaErrorInvalidResourceHandle;
  *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  dgserve::cuda::emu::DeviceMemoryInfo(free_bytes, total_bytes);
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? cudaErrorInvalidResourceHandle : dgserve::cuda::emu::StickyError();
}
cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t event, unsigned) {
  return cudaEventSynchronize(event);
}

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* device_ptr) {
  if (device_ptr == nullptr) return cudaErrorInvalidValue;
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle->reserved, &device_ptr, sizeof(device_ptr));
  return cudaSuccess;
}
cudaError_t cudaIpcOpenMemHandle(void** device_ptr, cudaIpcMemHandle_t handle, unsigned) {
  std::memcpy(device_ptr, handle.reserved, sizeof(*device_ptr));
  return *device_ptr == nullptr ? cudaErrorInvalidResourceHandle : cudaSuccess;
}
cudaError_t cudaIpcCloseMemHandle(void* device_ptr) {
  return device_ptr == nullptr ? cudaErrorInvalidValue : cudaSuccess;
}
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event) {
  if (event == nullptr) return cudaErrorInvalidResourceHandle;
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle->reserved, &event, sizeof(event));
  return cudaSuccess;
}
cudaError_t cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle) {
  cudaEvent_t exported = nullptr;
  std::memcpy(&exported, handle.reserved, sizeof(exported));
  if (exported == nullptr) return cudaErrorInvalidResourceHandle;
  // Its own handle object, destroyed by the opener as on a device (records complete at once).
  *event = new CUevent_st;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "dgserve emulated device", sizeof(prop->name) - 1);
  for (int i = 0; i < 16; ++i) prop->uuid.bytes[i] = char(0xe0 + i);
  prop->totalGlobalMem = size_t(141) << 30;
  prop->major = 9;
  return cudaSuccess;
}
