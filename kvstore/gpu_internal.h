// Pieces shared by the NCCL and CUDA IPC KV transports (not part of the public interface).
// Compiled against the CUDA toolkit and NCCL, or against engine/cuda/emu's emulation of both
// (label gpu-emu): the same code either way.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvstore/gpu_transport.h"
#include "kvstore/kv_stream_client.h"
#include "kvstore/transfer_protocol.h"
#include "kvstore/transfer_service.h"

namespace dgserve::kv::gpu {

// Staging layout: a round's blocks are packed in their order, each at an offset aligned to this.
inline constexpr int64_t kStagingAlign = 256;
inline int64_t AlignUp(int64_t n) { return (n + kStagingAlign - 1) / kStagingAlign * kStagingAlign; }

// OK, or INTERNAL "<what>: <CUDA error string>".
absl::Status CudaStatus(cudaError_t e, const std::string& what);

// This process's identity as a sender: "<host>:<pid>:<serial>", unique per transport instance.
std::string NewSenderIdentity();

// Calls `poll` every ~200 µs until it returns true or an error; DEADLINE_EXCEEDED naming `what`
// at `deadline`, CANCELLED once `cancelled` (may be empty) returns true.
absl::Status PollUntil(const std::function<absl::StatusOr<bool>()>& poll, absl::Time deadline,
                       const std::function<bool()>& cancelled, const std::string& what);

// The staging round each block belongs to: round_end[i] says block i ends its round. Rounds
// fill `staging_bytes` (block offsets aligned to kStagingAlign) greedily.
std::vector<bool> RoundEnds(const std::vector<int64_t>& block_bytes, int64_t staging_bytes);

// Device memory, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  absl::Status Allocate(int64_t bytes);
  char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  int64_t size_ = 0;
};

// The sending half common to both GPU transports: per block, the bytes go host → device into
// staging (StageBlock) and a control message (kind, index, size, checksum, group_end) goes on
// the PushBlocks stream; at the end of each round EndRound moves the staged bytes.
class GpuMover : public internal::BlockMover {
 public:
  GpuMover(std::shared_ptr<grpc::Channel> channel, const std::string& target,
           const std::string& request_id, v1::KvDataPath path, std::string session,
           int64_t staging_bytes);

  absl::Status Open(const v1::KvTransferHeader& header,
                    const std::vector<internal::OutgoingBlock>& blocks,
                    absl::Time deadline) override;
  absl::Status MoveBlock(const PagedKvCache& kv, size_t index) override;
  absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer) override;
  void Cancel(const absl::Status& why) override;

 protected:
  // Before the first block of round `round` of this transfer.
  virtual absl::Status BeginRound(int round) { return absl::OkStatus(); }
  // Copies `bytes` bytes at `host` into staging at `offset`.
  virtual absl::Status StageBlock(const void* host, int64_t bytes, int64_t offset) = 0;
  // The round's blocks are staged (`sizes`, at `offsets`); called before its last control
  // message is written (kBeforeLastMessage) or after (kAfterLastMessage), as the transport
  // needs: CUDA IPC publishes the data first, NCCL sends after the receiver can match it.
  enum class When { kBeforeLastMessage, kAfterLastMessage };
  virtual When end_round_when() const = 0;
  virtual absl::Status EndRound(const std::vector<int64_t>& offsets,
                                const std::vector<int64_t>& sizes) = 0;
  // The transfer failed: the session must not be reused.
  virtual void Broken(const absl::Status& why) = 0;
  // The receiver's own status for a transfer that failed on the device side (the stream is
  // half-closed and its status read, bounded by the lease); `fallback` when it says OK.
  absl::Status ReceiverStatus(const absl::Status& fallback);

  absl::Time deadline_;
  const std::string target_, request_id_;

 private:
  internal::KvStreamClient stream_;
  const v1::KvDataPath path_;
  const std::string session_;
  const int64_t staging_bytes_;
  const std::vector<internal::OutgoingBlock>* blocks_ = nullptr;
  std::vector<bool> round_end_;
  int round_ = 0;
  std::vector<int64_t> offsets_, sizes_;
  int64_t next_offset_ = 0;
  bool failed_ = false;
};

// Per-target session cache of a GPU transport: one session per target at a time, used by one
// transfer at a time (a transfer waits for the session until its deadline).
template <typename Session>
class SessionSlot {
 public:
  // Waits until no transfer uses the slot (DEADLINE_EXCEEDED at `deadline`), then owns it.
  absl::Status Acquire(absl::Time deadline);
  void Release();
  std::unique_ptr<Session> session;  // null: none, or dropped after an error

 private:
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
};

template <typename Session>
absl::Status SessionSlot<Session>::Acquire(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (!mu_.AwaitWithDeadline(absl::Condition(+[](bool* busy) { return !*busy; }, &busy_),
                             deadline)) {
    return absl::DeadlineExceededError(
        "the lease ran out while another transfer to the target used its GPU session");
  }
  busy_ = true;
  return absl::OkStatus();
}

template <typename Session>
void SessionSlot<Session>::Release() {
  absl::MutexLock lock(&mu_);
  busy_ = false;
}

// ---- Receiving side, shared by both halves ----------------------------------------------------

// The offset of each of a round's blocks in staging of `staging_bytes` (packed in order, aligned
// to kStagingAlign); INVALID_ARGUMENT naming the block when the round does not fit.
absl::StatusOr<std::vector<int64_t>> RoundOffsets(const std::vector<v1::KvBlockPayload>& blocks,
                                                  int64_t staging_bytes);

// Copies each block's data_bytes() out of device staging (`staging` + its offset) into its data
// field; INTERNAL "<what>: ..." on a CUDA error.
absl::Status CopyRoundOut(std::vector<v1::KvBlockPayload>& blocks, const char* staging,
                          const std::vector<int64_t>& offsets, const std::string& what);

// The staging bytes a receiver grants: what the sender asked for (if > 0) up to the receiver's own.
inline int64_t GrantedStaging(int64_t requested, int64_t own) {
  return requested > 0 ? std::min(requested, own) : own;
}

// A receive half's sessions by name, at most one per sender (a sender's new session replaces
// its old one). `Session` needs an `std::atomic<bool> busy`.
template <typename Session>
class ReceiveSessions {
 public:
  // `label` names the transport in errors and session names ("nccl", "cuda_ipc").
  explicit ReceiveSessions(std::string label) : label_(std::move(label)) {}

  // Registers `session` for `sender` under a new name "<label>/<sender>/<serial>"; returns the
  // name and the sender's session it replaced (null if none), which the caller may stop.
  std::pair<std::string, std::shared_ptr<Session>> Add(const std::string& sender,
                                                       std::shared_ptr<Session> session) {
    absl::MutexLock lock(&mu_);
    std::string name = absl::StrCat(label_, "/", sender, "/", ++serial_);
    std::shared_ptr<Session> replaced;
    if (auto old = by_sender_.find(sender); old != by_sender_.end()) {
      if (auto it = sessions_.find(old->second); it != sessions_.end()) {
        replaced = std::move(it->second);  // a transfer still on it keeps it alive
        sessions_.erase(it);
      }
    }
    by_sender_[sender] = name;
    sessions_[name] = std::move(session);
    return {std::move(name), std::move(replaced)};
  }

  // The session named `name`: NOT_FOUND when unknown (replaced, or this worker restarted).
  absl::StatusOr<std::shared_ptr<Session>> Find(const std::string& name) {
    absl::MutexLock lock(&mu_);
    auto it = sessions_.find(name);
    if (it == sessions_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown ", Describe(), " session '", name,
                                              "' (replaced, or this worker restarted)"));
    }
    return it->second;
  }

  // Marks `session` busy for one transfer: UNAVAILABLE when another transfer uses it.
  absl::Status Claim(Session& session) const {
    if (session.busy.exchange(true)) {
      return absl::UnavailableError(
          absl::StrCat("another transfer is using this ", Describe(), " session"));
    }
    return absl::OkStatus();
  }

 private:
  std::string Describe() const { return label_ == "nccl" ? "NCCL" : "CUDA IPC"; }

  const std::string label_;
  absl::Mutex mu_;
  int64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::string> by_sender_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
};

// The receiving halves (nccl_transport.cc, cuda_ipc_transport.cc), combined by
// CreateGpuReceiveEndpoint.
std::shared_ptr<GpuReceiveEndpoint> MakeNcclReceiveHalf(const GpuTransportOptions& options);
std::shared_ptr<GpuReceiveEndpoint> MakeCudaIpcReceiveHalf(const GpuTransportOptions& options);

// OK when `options` can make a GPU transport named `what` ("NCCL KV transport"): a usable CUDA
// device (else UNAVAILABLE) and staging of at least kStagingAlign bytes (else INVALID_ARGUMENT).
absl::Status CheckGpuTransportOptions(const std::string& what, const GpuTransportOptions& options);

// Dials `target` as GpuTransportOptions::make_channel says.
std::shared_ptr<grpc::Channel> Dial(const GpuTransportOptions& options, const std::string& target);

// What the transfers of one GPU transport share: its options, this sender's identity, and per
// target one session slot and one channel.
template <typename Session>
struct SendShared {
  GpuTransportOptions options;
  std::string identity = NewSenderIdentity();
  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<SessionSlot<Session>>> slots ABSL_GUARDED_BY(mu);
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels ABSL_GUARDED_BY(mu);
};

// A GPU transport: the shared sending protocol (internal::ProtocolSender) over a `Mover` per
// transfer, which uses the target's one session, made by `Connect` (the NCCL bootstrap, the
// CUDA IPC open) on the first transfer and after an error dropped it, and taken in turn.
template <typename Session, typename Mover,
          absl::StatusOr<std::unique_ptr<Session>> (*Connect)(
              SendShared<Session>&, const std::shared_ptr<grpc::Channel>&, const std::string&,
              const std::string&, absl::Time)>
class SessionTransport final : public KvTransport {
 public:
  SessionTransport(std::string name, const GpuTransportOptions& options)
      : name_(std::move(name)),
        shared_(std::make_shared<SendShared<Session>>()),
        sender_(name_, options.max_outstanding_per_target) {
    shared_->options = options;
  }
  std::string name() const override { return name_; }

  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override {
    sender_.Send(target, request_id, std::move(kv), lease_ms, std::move(done),
                 [shared = shared_](const std::string& target, const std::string& request_id,
                                    absl::Time deadline) {
                   return OpenMover(*shared, target, request_id, deadline);
                 });
  }

 private:
  static absl::StatusOr<std::unique_ptr<internal::BlockMover>> OpenMover(
      SendShared<Session>& shared, const std::string& target, const std::string& request_id,
      absl::Time deadline) {
    if (absl::Status s = CudaStatus(cudaSetDevice(shared.options.cuda_device), "cudaSetDevice");
        !s.ok()) {
      return s;
    }
    std::shared_ptr<SessionSlot<Session>> slot;
    std::shared_ptr<grpc::Channel> channel;
    {
      absl::MutexLock lock(&shared.mu);
      auto& sl = shared.slots[target];
      if (sl == nullptr) sl = std::make_shared<SessionSlot<Session>>();
      slot = sl;
      auto& ch = shared.channels[target];
      if (ch == nullptr) ch = Dial(shared.options, target);
      channel = ch;
    }
    if (absl::Status s = slot->Acquire(deadline); !s.ok()) return s;
    if (slot->session == nullptr) {
      absl::StatusOr<std::unique_ptr<Session>> session =
          Connect(shared, channel, target, request_id, deadline);
      if (!session.ok()) {
        slot->Release();
        return session.status();
      }
      slot->session = *std::move(session);
    }
    return std::make_unique<Mover>(channel, target, request_id, slot);
  }

  const std::string name_;
  const std::shared_ptr<SendShared<Session>> shared_;
  internal::ProtocolSender sender_;
};

}  // namespace dgserve::kv::gpu
