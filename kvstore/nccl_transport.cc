// The NCCL KV transport (kvstore/gpu_transport.h). Sending side: the shared protocol with a
// GpuMover whose rounds go out as grouped ncclSend from device staging on the session's own
// stream; receiving side: the NcclBootstrap answer and an OutOfBandSource whose rounds arrive
// as grouped ncclRecv into the receiver's staging and are copied into the KvBlockPayloads that
// KvReceiver checks. One two-rank communicator per (sender, target): the receiver makes the
// ncclUniqueId and joins as rank 1, the sender joins as rank 0; both non-blocking
// (config.blocking = 0), their progress and asynchronous errors polled against a deadline. On
// any error or timeout the communicator is aborted (ncclCommAbort), the transfer fails (the
// receiver frees its blocks: never a partial KV), and the next transfer makes a new one.
// Compiled against NCCL or, for the gpu-emu tests, against engine/cuda/emu's emulation.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstore/gpu_internal.h"

namespace dgserve::kv::gpu {
namespace {

absl::Status NcclStatus(ncclResult_t r, const std::string& what) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("NCCL ", what, ": ", ncclGetErrorString(r)));
}

// Polls until `comm` has no operation in progress and `stream` is idle (or an error).
absl::Status WaitComm(ncclComm_t comm, cudaStream_t stream, absl::Time deadline,
                      const std::function<bool()>& cancelled, const std::string& what) {
  return PollUntil(
      [&]() -> absl::StatusOr<bool> {
        ncclResult_t e = ncclSuccess;
        if (absl::Status s = NcclStatus(ncclCommGetAsyncError(comm, &e), "async error query");
            !s.ok()) {
          return s;
        }
        if (e == ncclInProgress) return false;
        if (absl::Status s = NcclStatus(e, what); !s.ok()) return s;
        if (stream == nullptr) return true;
        const cudaError_t q = cudaStreamQuery(stream);
        if (q == cudaErrorNotReady) return false;
        if (absl::Status s = CudaStatus(q, what); !s.ok()) return s;
        return true;
      },
      deadline, cancelled, absl::StrCat("NCCL ", what));
}

ncclConfig_t NonBlocking() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

// ---- Sending side ---------------------------------------------------------------------------

struct SendSession {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  DeviceBuffer staging;
  std::string id;  // KvTransferHeader.gpu_session
  ~SendSession() {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

using SendShared = gpu::SendShared<SendSession>;

// Bootstraps a communicator with `target` (its NcclBootstrap makes the id, joins as rank 1).
absl::StatusOr<std::unique_ptr<SendSession>> Connect(SendShared& shared,
                                                     const std::shared_ptr<grpc::Channel>& ch,
                                                     const std::string& target,
                                                     const std::string& request_id,
                                                     absl::Time deadline) {
  const absl::Time init_deadline =
      std::min(deadline, absl::Now() + shared.options.nccl_init_timeout);
  auto stub = v1::KvTransferService::NewStub(ch);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(init_deadline));
  v1::NcclBootstrapRequest request;
  request.set_request_id(request_id);
  request.set_sender(shared.identity);
  request.set_staging_bytes(shared.options.staging_bytes);
  v1::NcclBootstrapResponse response;
  if (grpc::Status s = stub->NcclBootstrap(&context, request, &response); !s.ok()) {
    return internal::FromGrpc(s, request_id, target);
  }
  ncclUniqueId id;
  if (response.unique_id().size() != sizeof(id.internal)) {
    return absl::InternalError(absl::StrCat("NcclBootstrap answered a unique id of ",
                                            response.unique_id().size(), " bytes"));
  }
  std::copy(response.unique_id().begin(), response.unique_id().end(), id.internal);
  auto session = std::make_unique<SendSession>();
  session->id = response.session();
  const int64_t staging = std::min(response.staging_bytes(), shared.options.staging_bytes);
  if (absl::Status s = session->staging.Allocate(staging); !s.ok()) return s;
  if (absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&session->stream,
                                                            cudaStreamNonBlocking),
                                  "cudaStreamCreateWithFlags");
      !s.ok()) {
    return s;
  }
  ncclConfig_t config = NonBlocking();
  if (absl::Status s = NcclStatus(ncclCommInitRankConfig(&session->comm, 2, id, 0, &config),
                                  "ncclCommInitRankConfig (rank 0)");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = WaitComm(session->comm, nullptr, init_deadline, nullptr,
                                "communicator set-up (both ranks joined)");
      !s.ok()) {
    return s;  // ~SendSession aborts the communicator
  }
  return session;
}

class NcclMover final : public GpuMover {
 public:
  NcclMover(std::shared_ptr<grpc::Channel> channel, const std::string& target,
            const std::string& request_id, std::shared_ptr<SessionSlot<SendSession>> slot)
      : GpuMover(std::move(channel), target, request_id, v1::KV_DATA_NCCL, slot->session->id,
                 slot->session->staging.size()),
        slot_(std::move(slot)),
        session_(slot_->session.get()) {}
  ~NcclMover() override { slot_->Release(); }

 protected:
  absl::Status StageBlock(const void* host, int64_t bytes, int64_t offset) override {
    return CudaStatus(cudaMemcpyAsync(session_->staging.data() + offset, host, size_t(bytes),
                                      cudaMemcpyHostToDevice, session_->stream),
                      "cudaMemcpyAsync into NCCL staging");
  }
  When end_round_when() const override { return When::kAfterLastMessage; }
  absl::Status EndRound(const std::vector<int64_t>& offsets,
                        const std::vector<int64_t>& sizes) override {
    absl::Status s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    for (size_t i = 0; s.ok() && i < offsets.size(); ++i) {
      s = NcclStatus(ncclSend(session_->staging.data() + offsets[i], size_t(sizes[i]), ncclInt8,
                              1, session_->comm, session_->stream),
                     "ncclSend");
    }
    if (absl::Status e = NcclStatus(ncclGroupEnd(), "ncclGroupEnd"); s.ok()) s = e;
    if (s.ok()) {
      s = WaitComm(session_->comm, session_->stream, deadline_, nullptr,
                   absl::StrCat("send of ", offsets.size(), " blocks"));
    }
    if (!s.ok()) Broken(s);  // aborts now, so that the receiver's side ends too
    return s;
  }
  void Broken(const absl::Status&) override { slot_->session.reset(); }

 private:
  const std::shared_ptr<SessionSlot<SendSession>> slot_;
  SendSession* const session_;
};

using NcclTransport = SessionTransport<SendSession, NcclMover, &Connect>;

// ---- Receiving side -------------------------------------------------------------------------

struct RecvSession {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  DeviceBuffer staging;
  absl::Time init_deadline;
  std::atomic<bool> replaced{false};
  std::atomic<bool> busy{false};
  ~RecvSession() {
    if (comm != nullptr) (void)ncclCommAbort(comm);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

class NcclSource final : public OutOfBandSource {
 public:
  NcclSource(std::shared_ptr<RecvSession> session, int device, absl::Time deadline,
             std::function<bool()> cancelled)
      : session_(std::move(session)), device_(device), deadline_(deadline),
        cancelled_(std::move(cancelled)) {}
  ~NcclSource() override { session_->busy = false; }

  absl::Status Fetch(std::vector<v1::KvBlockPayload>& blocks) override {
    RecvSession& s = *session_;
    if (s.comm == nullptr) return absl::UnavailableError("NCCL session already failed");
    if (absl::Status e = CudaStatus(cudaSetDevice(device_), "cudaSetDevice"); !e.ok()) return e;
    absl::StatusOr<std::vector<int64_t>> offsets = RoundOffsets(blocks, s.staging.size());
    if (!offsets.ok()) return offsets.status();
    auto stop = [this] { return session_->replaced.load() || (cancelled_ && cancelled_()); };
    // The communicator's set-up (started by NcclBootstrap) must have finished.
    if (absl::Status e = WaitComm(s.comm, nullptr, std::min(deadline_, s.init_deadline), stop,
                                  "communicator set-up (both ranks joined)");
        !e.ok()) {
      return e;
    }
    absl::Status st = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    for (size_t i = 0; st.ok() && i < blocks.size(); ++i) {
      st = NcclStatus(ncclRecv(s.staging.data() + (*offsets)[i], size_t(blocks[i].data_bytes()),
                               ncclInt8, 0, s.comm, s.stream),
                      "ncclRecv");
    }
    if (absl::Status e = NcclStatus(ncclGroupEnd(), "ncclGroupEnd"); st.ok()) st = e;
    if (st.ok()) {
      st = WaitComm(s.comm, s.stream, deadline_, stop,
                    absl::StrCat("receive of ", blocks.size(), " blocks"));
    }
    if (!st.ok()) return st;
    return CopyRoundOut(blocks, s.staging.data(), *offsets, "cudaMemcpy out of NCCL staging");
  }

  // Aborts the communicator now (the sender's pending sends then fail instead of waiting).
  void Fail(const absl::Status&) override {
    if (session_->comm != nullptr) {
      (void)ncclCommAbort(session_->comm);
      session_->comm = nullptr;
    }
  }

 private:
  const std::shared_ptr<RecvSession> session_;
  const int device_;
  const absl::Time deadline_;
  const std::function<bool()> cancelled_;
};

class NcclReceiveHalf final : public GpuReceiveEndpoint {
 public:
  explicit NcclReceiveHalf(const GpuTransportOptions& options) : options_(options) {}

  absl::StatusOr<v1::NcclBootstrapResponse> NcclBootstrap(
      const v1::NcclBootstrapRequest& request) override {
    if (request.sender().empty()) {
      return absl::InvalidArgumentError("NcclBootstrap without the sender's identity");
    }
    if (absl::Status s = CudaStatus(cudaSetDevice(options_.cuda_device), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    auto session = std::make_shared<RecvSession>();
    const int64_t staging = GrantedStaging(request.staging_bytes(), options_.staging_bytes);
    if (absl::Status s = session->staging.Allocate(staging); !s.ok()) return s;
    if (absl::Status s = CudaStatus(
            cudaStreamCreateWithFlags(&session->stream, cudaStreamNonBlocking),
            "cudaStreamCreateWithFlags");
        !s.ok()) {
      return s;
    }
    ncclUniqueId id;
    if (absl::Status s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    ncclConfig_t config = NonBlocking();
    session->init_deadline = absl::Now() + options_.nccl_init_timeout;
    if (absl::Status s = NcclStatus(ncclCommInitRankConfig(&session->comm, 2, id, 1, &config),
                                    "ncclCommInitRankConfig (rank 1)");
        !s.ok()) {
      return s;
    }
    v1::NcclBootstrapResponse response;
    response.set_unique_id(std::string(id.internal, sizeof(id.internal)));
    response.set_staging_bytes(staging);
    auto [name, replaced] = sessions_.Add(request.sender(), std::move(session));
    if (replaced != nullptr) replaced->replaced = true;  // a transfer still on it stops waiting
    response.set_session(name);
    return response;
  }

  absl::StatusOr<v1::CudaIpcOpenResponse> CudaIpcOpen(const v1::CudaIpcOpenRequest&) override {
    return absl::UnimplementedError("not the CUDA IPC half");
  }

  absl::StatusOr<std::unique_ptr<OutOfBandSource>> OpenSource(
      const v1::KvTransferHeader& header, absl::Time deadline,
      std::function<bool()> cancelled) override {
    absl::StatusOr<std::shared_ptr<RecvSession>> session = sessions_.Find(header.gpu_session());
    if (!session.ok()) return session.status();
    if ((*session)->comm == nullptr) {
      return absl::UnavailableError("the NCCL session failed earlier; bootstrap a new one");
    }
    if (absl::Status s = sessions_.Claim(**session); !s.ok()) return s;
    return std::make_unique<NcclSource>(*std::move(session), options_.cuda_device, deadline,
                                        std::move(cancelled));
  }

 private:
  const GpuTransportOptions options_;
  ReceiveSessions<RecvSession> sessions_{"nccl"};
};

}  // namespace

std::shared_ptr<GpuReceiveEndpoint> MakeNcclReceiveHalf(const GpuTransportOptions& options) {
  return std::make_shared<NcclReceiveHalf>(options);
}

}  // namespace dgserve::kv::gpu

namespace dgserve::kv {

absl::StatusOr<std::unique_ptr<KvTransport>> CreateNcclTransport(
    const GpuTransportOptions& options) {
  if (absl::Status s = gpu::CheckGpuTransportOptions("NCCL KV transport", options); !s.ok()) {
    return s;
  }
  return std::make_unique<gpu::NcclTransport>("nccl", options);
}

}  // namespace dgserve::kv
