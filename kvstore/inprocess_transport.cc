// The in-process transport: the shared protocol (transfer_protocol.h) writing a named receiver
// of a process-wide registry directly, on the transfer's thread.
#include <map>
#include <vector>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"
#include "kvstore/transfer_protocol.h"

namespace dgserve::kv {
namespace {

// name → receiver, with the number of transfers using it (Unregister waits for them).
class Registry {
 public:
  static Registry& Get() {
    static Registry* const registry = new Registry;  // never destroyed: detached senders use it
    return *registry;
  }

  void Register(const std::string& name, KvReceiver* receiver) {
    absl::MutexLock lock(&mu_);
    WaitIdleLocked(name);
    entries_[name] = {receiver, 0};
  }
  void Unregister(const std::string& name) {
    absl::MutexLock lock(&mu_);
    WaitIdleLocked(name);
    entries_.erase(name);
  }
  // The receiver registered as `name` (nullptr if none); pair with Done(name).
  KvReceiver* Acquire(const std::string& name) {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(name);
    if (it == entries_.end()) return nullptr;
    ++it->second.active;
    return it->second.receiver;
  }
  void Done(const std::string& name) {
    absl::MutexLock lock(&mu_);
    if (auto it = entries_.find(name); it != entries_.end()) --it->second.active;
    idle_.SignalAll();
  }

 private:
  struct Entry {
    KvReceiver* receiver = nullptr;
    int active = 0;
  };
  void WaitIdleLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = entries_.find(name); it != entries_.end() && it->second.active > 0;
         it = entries_.find(name)) {
      idle_.Wait(&mu_);
    }
  }

  absl::Mutex mu_;
  absl::CondVar idle_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
};

// Writes the receiver directly; holds the registry entry for as long as it lives.
class InProcessMover final : public internal::BlockMover {
 public:
  InProcessMover(std::string target, KvReceiver* receiver)
      : target_(std::move(target)), receiver_(receiver) {}
  ~InProcessMover() override { Registry::Get().Done(target_); }

  absl::Status Open(const v1::KvTransferHeader& header,
                    const std::vector<internal::OutgoingBlock>& blocks, absl::Time) override {
    request_id_ = header.request_id();
    blocks_ = &blocks;
    return receiver_->Begin(header);
  }
  absl::Status MoveBlock(const PagedKvCache& kv, size_t index) override {
    internal::FillPayload(kv, (*blocks_)[index], &payload_);
    if (absl::Status s = receiver_->WriteBlock(request_id_, payload_); !s.ok()) return s;
    ack_.set_blocks(ack_.blocks() + 1);
    ack_.set_bytes(ack_.bytes() + int64_t(payload_.data().size()));
    return absl::OkStatus();
  }
  absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer) override {
    if (absl::Status s = receiver_->Finish(request_id_, trailer); !s.ok()) return s;
    return ack_;
  }
  // A no-op when the receiver already failed the transfer itself.
  void Cancel(const absl::Status& why) override { receiver_->Abort(request_id_, why); }

 private:
  const std::string target_;
  KvReceiver* const receiver_;
  std::string request_id_;
  const std::vector<internal::OutgoingBlock>* blocks_ = nullptr;
  v1::KvBlockPayload payload_;
  v1::KvAck ack_;
};

class InProcessTransport final : public KvTransport {
 public:
  std::string name() const override { return "inprocess"; }

  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override {
    sender_.Send(target, request_id, std::move(kv), lease_ms, std::move(done),
                 [](const std::string& target, const std::string& request_id,
                    absl::Time) -> absl::StatusOr<std::unique_ptr<internal::BlockMover>> {
                   KvReceiver* receiver = Registry::Get().Acquire(target);
                   if (receiver == nullptr) {
                     return absl::UnavailableError(
                         absl::StrCat("KV transfer for ", request_id,
                                      ": no in-process KV receiver named '", target, "'"));
                   }
                   return std::make_unique<InProcessMover>(target, receiver);
                 });
  }

 private:
  internal::ProtocolSender sender_{"inprocess", 0};
};

}  // namespace

void RegisterInProcessReceiver(const std::string& name, KvReceiver* receiver) {
  Registry::Get().Register(name, receiver);
}

void UnregisterInProcessReceiver(const std::string& name) { Registry::Get().Unregister(name); }

std::unique_ptr<KvTransport> CreateInProcessTransport() {
  return std::make_unique<InProcessTransport>();
}

}  // namespace dgserve::kv
