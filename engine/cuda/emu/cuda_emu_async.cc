// The emulated runtime's streams, events, CUDA IPC and device properties (see cuda_emu.h). An
// emulation: the real runtime needs a GPU; here streams only count outstanding emulated NCCL
// work and IPC handles carry pointers within the one process.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "engine/cuda/emu/cuda_emu.h"

struct CUstream_st {
  std::mutex mu;
  std::condition_variable idle;
  int pending = 0;
};

struct CUevent_st {
  std::chrono::steady_clock::time_point at{};  // the host time of the last record
  bool recorded = false;
};

namespace dgserve::cuda::emu {
namespace {

CUstream_st& Resolve(cudaStream_t s) {
  static CUstream_st* const default_stream = new CUstream_st;
  return s == nullptr ? *default_stream : *s;
}


}  // namespace

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
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned) {
  return cudaStreamCreate(stream);
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  CUstream_st& s = dgserve::cuda::emu::Resolve(stream);
  {
    std::unique_lock<std::mutex> l(s.mu);
    s.idle.wait(l, [&] { return s.pending == 0; });
  }
  return cudaDeviceSynchronize();
}
cudaError_t cudaStreamQuery(cudaStream_t stream) {
  CUstream_st& s = dgserve::cuda::emu::Resolve(stream);
  {
    std::lock_guard<std::mutex> l(s.mu);
    if (s.pending > 0) return cudaErrorNotReady;
  }
  return cudaDeviceSynchronize();
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
  *total_bytes = size_t(141) << 30;  // as cudaGetDeviceProperties; allocations are not tracked
  *free_bytes = *total_bytes;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return event == nullptr ? cudaErrorInvalidResourceHandle : cudaDeviceSynchronize();
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
