// The CUDA IPC KV transport (kvstore/gpu_transport.h), for two processes on one node and one
// device. The receiver exports a device staging buffer (cudaIpcGetMemHandle) and an
// interprocess event (cudaIpcGetEventHandle) per sender (CudaIpcOpen); the sender opens both
// (cached per target, closed after any error), copies each round's blocks host → device into
// the buffer and records the event on its stream before the round's last control message; the
// receiver waits for the event, copies the round out into the KvBlockPayloads that KvReceiver
// checks, and bumps the round counter in the buffer's first 8 bytes, which the sender waits
// for before it reuses the buffer. After a failure the receiver writes kBroken there, so that
// a waiting sender stops at once. Compiled against the CUDA runtime or, for the gpu-emu tests,
// against engine/cuda/emu's emulation (where the "processes" are one and a handle carries the
// pointer).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstore/gpu_internal.h"

namespace dgserve::kv::gpu {
namespace {

// The counter word (first kStagingAlign bytes of the buffer hold it; the data follows).
constexpr uint64_t kBroken = ~uint64_t{0};

absl::StatusOr<std::string> DeviceUuid(int device) {
  cudaDeviceProp prop;
  if (absl::Status s = CudaStatus(cudaGetDeviceProperties(&prop, device),
                                  "cudaGetDeviceProperties");
      !s.ok()) {
    return s;
  }
  return std::string(reinterpret_cast<const char*>(&prop.uuid), sizeof(prop.uuid));
}

// ---- Sending side ---------------------------------------------------------------------------

struct SendSession {
  char* base = nullptr;  // the receiver's buffer, opened
  cudaEvent_t event = nullptr;
  cudaStream_t stream = nullptr;
  int64_t staging_bytes = 0;
  uint64_t rounds = 0;  // rounds published; the receiver's counter reaches it once drained
  std::string id;
  ~SendSession() {
    if (base != nullptr) (void)cudaIpcCloseMemHandle(base);
    if (event != nullptr) (void)cudaEventDestroy(event);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

using SendShared = gpu::SendShared<SendSession>;

absl::StatusOr<std::unique_ptr<SendSession>> Connect(SendShared& shared,
                                                     const std::shared_ptr<grpc::Channel>& ch,
                                                     const std::string& target,
                                                     const std::string& request_id,
                                                     absl::Time deadline) {
  absl::StatusOr<std::string> uuid = DeviceUuid(shared.options.cuda_device);
  if (!uuid.ok()) return uuid.status();
  auto stub = v1::KvTransferService::NewStub(ch);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadline));
  v1::CudaIpcOpenRequest request;
  request.set_sender(shared.identity);
  request.set_staging_bytes(shared.options.staging_bytes);
  request.set_gpu_uuid(*uuid);
  v1::CudaIpcOpenResponse response;
  if (grpc::Status s = stub->CudaIpcOpen(&context, request, &response); !s.ok()) {
    return internal::FromGrpc(s, request_id, target);
  }
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t event;
  if (response.memory_handle().size() != sizeof(mem) ||
      response.event_handle().size() != sizeof(event)) {
    return absl::InternalError("CudaIpcOpen answered handles of the wrong size");
  }
  std::memcpy(&mem, response.memory_handle().data(), sizeof(mem));
  std::memcpy(&event, response.event_handle().data(), sizeof(event));
  auto session = std::make_unique<SendSession>();
  session->id = response.session();
  session->staging_bytes = response.staging_bytes();
  void* base = nullptr;
  if (absl::Status s = CudaStatus(cudaIpcOpenMemHandle(&base, mem,
                                                       cudaIpcMemLazyEnablePeerAccess),
                                  "cudaIpcOpenMemHandle");
      !s.ok()) {
    return s;
  }
  session->base = static_cast<char*>(base);
  if (absl::Status s = CudaStatus(cudaIpcOpenEventHandle(&session->event, event),
                                  "cudaIpcOpenEventHandle");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(
          cudaStreamCreateWithFlags(&session->stream, cudaStreamNonBlocking),
          "cudaStreamCreateWithFlags");
      !s.ok()) {
    return s;
  }
  return session;
}

class IpcMover final : public GpuMover {
 public:
  IpcMover(std::shared_ptr<grpc::Channel> channel, const std::string& target,
           const std::string& request_id, std::shared_ptr<SessionSlot<SendSession>> slot)
      : GpuMover(std::move(channel), target, request_id, v1::KV_DATA_CUDA_IPC,
                 slot->session->id, slot->session->staging_bytes),
        slot_(std::move(slot)),
        session_(slot_->session.get()) {}
  ~IpcMover() override { slot_->Release(); }

 protected:
  // The buffer is free once the receiver drained every round published so far.
  absl::Status BeginRound(int) override {
    return PollUntil(
        [this]() -> absl::StatusOr<bool> {
          uint64_t drained = 0;
          if (absl::Status s = CudaStatus(cudaMemcpy(&drained, session_->base, sizeof(drained),
                                                     cudaMemcpyDeviceToHost),
                                          "cudaMemcpy of the CUDA IPC round counter");
              !s.ok()) {
            return s;
          }
          if (drained == kBroken) {
            return absl::AbortedError("the receiver failed the CUDA IPC session");
          }
          return drained >= session_->rounds;
        },
        deadline_, nullptr, "CUDA IPC staging buffer drained by the receiver");
  }
  absl::Status StageBlock(const void* host, int64_t bytes, int64_t offset) override {
    return CudaStatus(cudaMemcpyAsync(session_->base + kStagingAlign + offset, host,
                                      size_t(bytes), cudaMemcpyHostToDevice, session_->stream),
                      "cudaMemcpyAsync into CUDA IPC staging");
  }
  When end_round_when() const override { return When::kBeforeLastMessage; }
  absl::Status EndRound(const std::vector<int64_t>&, const std::vector<int64_t>&) override {
    if (absl::Status s = CudaStatus(cudaEventRecord(session_->event, session_->stream),
                                    "cudaEventRecord of the CUDA IPC event");
        !s.ok()) {
      return s;
    }
    ++session_->rounds;
    return absl::OkStatus();
  }
  void Broken(const absl::Status&) override { slot_->session.reset(); }

 private:
  const std::shared_ptr<SessionSlot<SendSession>> slot_;
  SendSession* const session_;
};

using CudaIpcTransport = SessionTransport<SendSession, IpcMover, &Connect>;

// ---- Receiving side -------------------------------------------------------------------------

struct RecvSession {
  DeviceBuffer buffer;  // counter word, then staging_bytes of data
  cudaEvent_t event = nullptr;
  int64_t staging_bytes = 0;
  uint64_t rounds = 0;
  std::atomic<bool> failed{false};
  std::atomic<bool> busy{false};
  ~RecvSession() {
    if (event != nullptr) (void)cudaEventDestroy(event);
  }
};

class IpcSource final : public OutOfBandSource {
 public:
  IpcSource(std::shared_ptr<RecvSession> session, int device)
      : session_(std::move(session)), device_(device) {}
  ~IpcSource() override { session_->busy = false; }

  absl::Status Fetch(std::vector<v1::KvBlockPayload>& blocks) override {
    RecvSession& s = *session_;
    if (absl::Status e = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !e.ok()) return e;
    absl::StatusOr<std::vector<int64_t>> offsets = RoundOffsets(blocks, s.staging_bytes);
    if (!offsets.ok()) return offsets.status();
    // The sender recorded the event after its copies, before the round's last message.
    if (absl::Status e = CudaStatus(cudaEventSynchronize(s.event),
                                    "cudaEventSynchronize on the CUDA IPC event");
        !e.ok()) {
      return e;
    }
    if (absl::Status e = CopyRoundOut(blocks, s.buffer.data() + kStagingAlign, *offsets,
                                      "cudaMemcpy out of CUDA IPC staging");
        !e.ok()) {
      return e;
    }
    ++s.rounds;
    return CudaStatus(cudaMemcpy(s.buffer.data(), &s.rounds, sizeof(s.rounds),
                                 cudaMemcpyHostToDevice),
                      "cudaMemcpy of the CUDA IPC round counter");
  }

  void Fail(const absl::Status&) override {
    session_->failed = true;
    (void)cudaMemcpy(session_->buffer.data(), &kBroken, sizeof(kBroken),
                     cudaMemcpyHostToDevice);
  }

 private:
  const std::shared_ptr<RecvSession> session_;
  const int device_;
};

class IpcReceiveHalf final : public GpuReceiveEndpoint {
 public:
  explicit IpcReceiveHalf(const GpuTransportOptions& options) : options_(options) {}

  absl::StatusOr<v1::NcclBootstrapResponse> NcclBootstrap(
      const v1::NcclBootstrapRequest&) override {
    return absl::UnimplementedError("not the NCCL half");
  }

  absl::StatusOr<v1::CudaIpcOpenResponse> CudaIpcOpen(
      const v1::CudaIpcOpenRequest& request) override {
    if (request.sender().empty()) {
      return absl::InvalidArgumentError("CudaIpcOpen without the sender's identity");
    }
    if (absl::Status s = CudaStatus(cudaSetDevice(options_.cuda_device), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    absl::StatusOr<std::string> uuid = DeviceUuid(options_.cuda_device);
    if (!uuid.ok()) return uuid.status();
    if (request.gpu_uuid() != *uuid) {
      return absl::FailedPreconditionError(absl::StrCat(
          "CUDA IPC needs both ends on one device: the sender's GPU ",
          absl::BytesToHexString(request.gpu_uuid()), " is not this worker's ",
          absl::BytesToHexString(*uuid)));
    }
    auto session = std::make_shared<RecvSession>();
    session->staging_bytes = GrantedStaging(request.staging_bytes(), options_.staging_bytes);
    if (absl::Status s = session->buffer.Allocate(kStagingAlign + session->staging_bytes);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaMemset(session->buffer.data(), 0, kStagingAlign),
                                    "cudaMemset of the CUDA IPC round counter");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(
            cudaEventCreateWithFlags(&session->event,
                                     cudaEventDisableTiming | cudaEventInterprocess),
            "cudaEventCreateWithFlags");
        !s.ok()) {
      return s;
    }
    cudaIpcMemHandle_t mem;
    cudaIpcEventHandle_t event;
    if (absl::Status s = CudaStatus(cudaIpcGetMemHandle(&mem, session->buffer.data()),
                                    "cudaIpcGetMemHandle");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = CudaStatus(cudaIpcGetEventHandle(&event, session->event),
                                    "cudaIpcGetEventHandle");
        !s.ok()) {
      return s;
    }
    v1::CudaIpcOpenResponse response;
    response.set_memory_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
    response.set_event_handle(
        std::string(reinterpret_cast<const char*>(&event), sizeof(event)));
    response.set_staging_bytes(session->staging_bytes);
    // A transfer still on a replaced session keeps it alive until it ends.
    const std::string name = sessions_.Add(request.sender(), std::move(session)).first;
    response.set_session(name);
    return response;
  }

  absl::StatusOr<std::unique_ptr<OutOfBandSource>> OpenSource(
      const v1::KvTransferHeader& header, absl::Time, std::function<bool()>) override {
    absl::StatusOr<std::shared_ptr<RecvSession>> session = sessions_.Find(header.gpu_session());
    if (!session.ok()) return session.status();
    if ((*session)->failed) {
      return absl::UnavailableError("the CUDA IPC session failed earlier; open a new one");
    }
    if (absl::Status s = sessions_.Claim(**session); !s.ok()) return s;
    return std::make_unique<IpcSource>(*std::move(session), options_.cuda_device);
  }

 private:
  const GpuTransportOptions options_;
  ReceiveSessions<RecvSession> sessions_{"cuda_ipc"};
};

}  // namespace

std::shared_ptr<GpuReceiveEndpoint> MakeCudaIpcReceiveHalf(const GpuTransportOptions& options) {
  return std::make_shared<IpcReceiveHalf>(options);
}

}  // namespace dgserve::kv::gpu

namespace dgserve::kv {

absl::StatusOr<std::unique_ptr<KvTransport>> CreateCudaIpcTransport(
    const GpuTransportOptions& options) {
  if (absl::Status s = gpu::CheckGpuTransportOptions("CUDA IPC KV transport", options); !s.ok()) {
    return s;
  }
  return std::make_unique<gpu::CudaIpcTransport>("cuda_ipc", options);
}

}  // namespace dgserve::kv
