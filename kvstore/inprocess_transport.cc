// The in-process transport: a registry of named receivers, written directly on a worker thread.
#include <map>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvstore/transfer.h"
#include "kvstore/transfer_internal.h"

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

absl::StatusOr<TransferResult> RunTransfer(KvReceiver* receiver, const std::string& request_id,
                                           const PagedKvCache& kv, int64_t lease_ms) {
  const absl::Time start = absl::Now();
  const v1::KvTransferHeader header = internal::MakeHeader(request_id, kv, lease_ms);
  if (absl::Status s = receiver->Begin(header); !s.ok()) return s;
  TransferResult result;
  v1::KvBlockPayload payload;
  for (const internal::OutgoingBlock& b : internal::BlocksToSend(header.kv_descriptor(), kv)) {
    internal::FillPayload(kv, b, &payload);
    if (absl::Status s = receiver->WriteBlock(request_id, payload); !s.ok()) return s;
    ++result.blocks;
    result.bytes += int64_t(payload.data().size());
  }
  v1::KvTransferTrailer trailer;
  trailer.set_blocks(result.blocks);
  if (absl::Status s = receiver->Finish(request_id, trailer); !s.ok()) return s;
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

class InProcessTransport final : public KvTransport {
 public:
  std::string name() const override { return "inprocess"; }

  void Send(const std::string& target, const std::string& request_id,
            std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
            TransferCallback done) override {
    std::thread([target, request_id, kv = std::move(kv), lease_ms,
                 done = std::move(done)]() mutable {
      absl::StatusOr<TransferResult> result;
      if (kv == nullptr) {
        result = absl::InvalidArgumentError(
            absl::StrCat("KV transfer for ", request_id, ": no KV to send"));
      } else if (KvReceiver* receiver = Registry::Get().Acquire(target); receiver == nullptr) {
        result = absl::UnavailableError(absl::StrCat("KV transfer for ", request_id,
                                                     ": no in-process KV receiver named '",
                                                     target, "'"));
      } else {
        result = RunTransfer(receiver, request_id, *kv, lease_ms);
        Registry::Get().Done(target);
      }
      kv.reset();  // the sender's blocks are released before `done` runs
      TransferCallback callback = std::move(done);
      callback(std::move(result));
    }).detach();
  }
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
