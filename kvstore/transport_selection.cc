#include "kvstore/transport_selection.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dgserve::kv {
namespace {

constexpr char kTransportPayload[] = "type.dgserve.dev/kv_transport";

bool Reports(const KvPeerInfo& info, const std::string& transport) {
  if (info.transports.empty()) return transport == "tcp";
  return std::find(info.transports.begin(), info.transports.end(), transport) !=
         info.transports.end();
}

bool SameGpu(const KvPeerInfo& a, const KvPeerInfo& b) {
  return !a.node.empty() && a.node == b.node && !a.gpu_uuid.empty() && a.gpu_uuid == b.gpu_uuid;
}

bool CudaIpcPossible(const KvPeerInfo& local, const KvPeerInfo& peer) {
  return Reports(local, "cuda_ipc") && Reports(peer, "cuda_ipc") && SameGpu(local, peer);
}

}  // namespace

absl::StatusOr<KvTransportMode> ParseKvTransportMode(std::string_view name) {
  if (name == "auto") return KvTransportMode::kAuto;
  if (name == "tcp") return KvTransportMode::kTcp;
  if (name == "cuda_ipc") return KvTransportMode::kCudaIpc;
  if (name == "nccl") return KvTransportMode::kNccl;
  return absl::InvalidArgumentError(absl::StrCat(
      "KV transport '", std::string(name), "': must be auto, tcp, cuda_ipc or nccl"));
}

std::string KvTransportModeName(KvTransportMode mode) {
  switch (mode) {
    case KvTransportMode::kAuto: return "auto";
    case KvTransportMode::kTcp: return "tcp";
    case KvTransportMode::kCudaIpc: return "cuda_ipc";
    case KvTransportMode::kNccl: return "nccl";
  }
  return "?";
}

std::string DescribeKvPeer(const KvPeerInfo& info) {
  return absl::StrCat("node ", info.node.empty() ? "(none)" : info.node, ", ",
                      info.gpu_uuid.empty() ? "no GPU" : "GPU " + info.gpu_uuid,
                      ", transports ",
                      info.transports.empty() ? "(none reported: tcp)"
                                              : absl::StrJoin(info.transports, ","));
}

absl::StatusOr<std::string> ChooseKvTransport(KvTransportMode mode, const KvPeerInfo& local,
                                              const KvPeerInfo& peer, const std::string& target) {
  auto refuse = [&](const std::string& why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "kv_transport ", KvTransportModeName(mode), " to ", target, ": ", why, " (", target,
        " reports ", DescribeKvPeer(peer), "; this end reports ", DescribeKvPeer(local), ")"));
  };
  switch (mode) {
    case KvTransportMode::kTcp:
      return std::string("tcp");
    case KvTransportMode::kAuto:
      if (CudaIpcPossible(local, peer)) return std::string("cuda_ipc");
      if (Reports(local, "nccl") && Reports(peer, "nccl")) return std::string("nccl");
      return std::string("tcp");
    case KvTransportMode::kCudaIpc:
      if (!Reports(local, "cuda_ipc")) return refuse("this end cannot use CUDA IPC");
      if (!Reports(peer, "cuda_ipc")) return refuse("the peer cannot use CUDA IPC");
      if (!SameGpu(local, peer)) return refuse("CUDA IPC needs the same node and GPU");
      return std::string("cuda_ipc");
    case KvTransportMode::kNccl:
      if (!Reports(local, "nccl")) return refuse("this end cannot use NCCL");
      if (!Reports(peer, "nccl")) return refuse("the peer cannot use NCCL");
      return std::string("nccl");
  }
  return absl::InternalError("unknown KV transport mode");
}

KvPeerInfo KvPeerInfoFromStats(const v1::StatsResponse& stats) {
  KvPeerInfo info;
  info.node = stats.node();
  info.gpu_uuid = stats.gpu_uuid();
  info.transports.assign(stats.kv_transports().begin(), stats.kv_transports().end());
  return info;
}

void FillKvPeerInfo(const KvPeerInfo& info, v1::StatsResponse* stats) {
  stats->set_node(info.node);
  stats->set_gpu_uuid(info.gpu_uuid);
  stats->clear_kv_transports();
  for (const std::string& t : info.transports) stats->add_kv_transports(t);
}

KvPeerLookup StatsKvPeerLookup(
    std::function<std::shared_ptr<grpc::Channel>(const std::string& target,
                                                 const grpc::ChannelArguments& args)>
        make_channel,
    absl::Duration timeout) {
  return [make_channel = std::move(make_channel),
          timeout](const std::string& target) -> absl::StatusOr<KvPeerInfo> {
    const grpc::ChannelArguments args;
    std::shared_ptr<grpc::Channel> channel =
        make_channel ? make_channel(target, args)
                     : grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
    auto stub = v1::DenoiseService::NewStub(channel);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(timeout));
    v1::StatsResponse stats;
    const grpc::Status s = stub->Stats(&context, v1::StatsRequest(), &stats);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("Stats of ", target, ": ", s.error_message()));
    }
    return KvPeerInfoFromStats(stats);
  };
}

std::string FailedKvTransport(const absl::Status& status, const std::string& fallback) {
  auto p = status.GetPayload(kTransportPayload);
  return p ? std::string(*p) : fallback;
}

struct RoutingKvTransport::State {
  struct CachedPeer {
    KvPeerInfo info;
    absl::Time fetched;
  };
  // A Send waiting for the lookup of its target that another Send started.
  struct Waiting {
    std::string request_id;
    std::shared_ptr<const PagedKvCache> kv;
    int64_t lease_ms;
    TransferCallback done;
  };
  absl::Mutex mu;
  std::map<std::string, CachedPeer> peers ABSL_GUARDED_BY(mu);
  // Targets being looked up, with the Sends that wait for that answer.
  std::map<std::string, std::vector<Waiting>> looking_up ABSL_GUARDED_BY(mu);
  int64_t lookups ABSL_GUARDED_BY(mu) = 0;
  int running_lookups ABSL_GUARDED_BY(mu) = 0;
  // Auto mode: (target, GPU transport) that failed a transfer → until when TCP replaces it.
  std::map<std::pair<std::string, std::string>, absl::Time> gpu_backoff ABSL_GUARDED_BY(mu);
  std::map<std::string, std::string> last_chosen ABSL_GUARDED_BY(mu);  // per target, for the log
};

RoutingKvTransport::RoutingKvTransport(RoutingKvTransportOptions options,
                                       std::unique_ptr<KvTransport> tcp,
                                       std::unique_ptr<KvTransport> cuda_ipc,
                                       std::unique_ptr<KvTransport> nccl)
    : options_(std::move(options)),
      tcp_(std::move(tcp)),
      cuda_ipc_(std::move(cuda_ipc)),
      nccl_(std::move(nccl)),
      state_(std::make_shared<State>()) {}

RoutingKvTransport::~RoutingKvTransport() {
  absl::MutexLock lock(&state_->mu);
  state_->mu.Await(absl::Condition(
      +[](int* count) { return *count == 0; }, &state_->running_lookups));
}

std::string RoutingKvTransport::name() const { return KvTransportModeName(options_.mode); }

KvTransport* RoutingKvTransport::ByName(const std::string& name) const {
  if (name == "tcp") return tcp_.get();
  if (name == "cuda_ipc") return cuda_ipc_.get();
  if (name == "nccl") return nccl_.get();
  return nullptr;
}

KvPeerInfo RoutingKvTransport::EffectiveLocal() const {
  KvPeerInfo local = options_.local;
  if (local.transports.empty()) local.transports = {"tcp"};
  std::erase_if(local.transports, [this](const std::string& t) { return ByName(t) == nullptr; });
  return local;
}

std::vector<std::string> RoutingKvTransport::available() const {
  const KvPeerInfo local = EffectiveLocal();
  std::vector<std::string> out;
  for (const char* t : {"tcp", "cuda_ipc", "nccl"}) {
    if (Reports(local, t)) out.push_back(t);
  }
  return out;
}

int64_t RoutingKvTransport::lookups() const {
  absl::MutexLock lock(&state_->mu);
  return state_->lookups;
}

void RoutingKvTransport::Send(const std::string& target, const std::string& request_id,
                              std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
                              TransferCallback done) {
  // Refused here, before a transport is chosen: a caller's error, not a transport's failure (no
  // fallback, no failure counted).
  if (kv != nullptr) {
    if (absl::Status st = CheckHostRowsCurrent(*kv, absl::StrCat("KV transfer for ", request_id));
        !st.ok()) {
      done(st);
      return;
    }
  }
  if (options_.mode == KvTransportMode::kTcp || !options_.lookup) {
    Route(target, KvPeerInfo{}, request_id, std::move(kv), lease_ms, std::move(done));
    return;
  }
  std::optional<KvPeerInfo> cached;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->peers.find(target);
    if (it != state_->peers.end() &&
        absl::Now() - it->second.fetched < options_.peer_info_ttl) {
      cached = it->second.info;
    } else if (auto w = state_->looking_up.find(target); w != state_->looking_up.end()) {
      // One lookup per target at a time: this Send goes with its answer.
      w->second.push_back(State::Waiting{request_id, std::move(kv), lease_ms, std::move(done)});
      return;
    } else {
      state_->looking_up[target];
      ++state_->lookups;
      ++state_->running_lookups;
    }
  }
  if (cached) {
    Route(target, *cached, request_id, std::move(kv), lease_ms, std::move(done));
    return;
  }
  std::thread([this, state = state_, target, request_id, kv = std::move(kv), lease_ms,
               done = std::move(done)]() mutable {
    absl::StatusOr<KvPeerInfo> peer = options_.lookup(target);
    bool changed = false;
    std::vector<State::Waiting> waiting;
    {
      absl::MutexLock lock(&state->mu);
      if (peer.ok()) {
        auto [it, added] = state->peers.try_emplace(target);
        changed = added || DescribeKvPeer(it->second.info) != DescribeKvPeer(*peer);
        it->second = State::CachedPeer{*peer, absl::Now()};
      }
      waiting = std::move(state->looking_up[target]);
      state->looking_up.erase(target);
    }
    if (changed) {  // the first answer of a target, or a different one
      DGSERVE_LOG_INFO("kv_transport %s: KV target %s reports %s",
                       KvTransportModeName(options_.mode), target, DescribeKvPeer(*peer));
    }
    Route(target, peer, request_id, std::move(kv), lease_ms, std::move(done));
    for (State::Waiting& w : waiting) {
      Route(target, peer, w.request_id, std::move(w.kv), w.lease_ms, std::move(w.done));
    }
    absl::MutexLock lock(&state->mu);
    --state->running_lookups;  // `this` may be destroyed from here on
  }).detach();
}

void RoutingKvTransport::Route(const std::string& target, const absl::StatusOr<KvPeerInfo>& peer,
                               const std::string& request_id,
                               std::shared_ptr<const PagedKvCache> kv, int64_t lease_ms,
                               TransferCallback done) {
  const std::string mode = KvTransportModeName(options_.mode);
  auto fail = [&](const absl::Status& why, const std::string& transport) {
    absl::Status s = why;
    s.SetPayload(kTransportPayload, absl::Cord(transport));
    done(s);
  };
  std::string chosen = "tcp";
  if (options_.mode != KvTransportMode::kTcp) {
    if (!peer.ok()) {
      if (options_.mode != KvTransportMode::kAuto) {
        fail(absl::Status(peer.status().code(),
                          absl::StrCat("kv_transport ", mode, ": cannot learn what ", target,
                                       " supports: ", peer.status().message())),
             mode);
        return;
      }
      DGSERVE_LOG_WARNING("kv_transport auto: %s (sending over tcp)", peer.status().message());
    } else {
      absl::StatusOr<std::string> c =
          ChooseKvTransport(options_.mode, EffectiveLocal(), *peer, target);
      if (!c.ok()) {
        fail(c.status(), mode);
        return;
      }
      chosen = *c;
    }
  }
  bool log_choice = false;
  {
    absl::MutexLock lock(&state_->mu);
    if (options_.mode == KvTransportMode::kAuto && chosen != "tcp") {
      auto it = state_->gpu_backoff.find({target, chosen});
      if (it != state_->gpu_backoff.end()) {
        if (absl::Now() < it->second) {
          chosen = "tcp";
        } else {
          state_->gpu_backoff.erase(it);  // try the GPU transport again
        }
      }
    }
    std::string& last = state_->last_chosen[target];
    log_choice = last != chosen;
    last = chosen;
  }
  if (log_choice) {
    DGSERVE_LOG_INFO("kv_transport %s: KV to %s over %s", mode, target, chosen);
  }
  KvTransport* transport = ByName(chosen);
  if (transport == nullptr) {  // ChooseKvTransport saw EffectiveLocal: only tcp_ can be missing
    fail(absl::InternalError("no TCP KV transport"), chosen);
    return;
  }
  transport->Send(
      target, request_id, std::move(kv), lease_ms,
      [state = state_, target, chosen, auto_mode = options_.mode == KvTransportMode::kAuto,
       backoff = options_.gpu_failure_backoff,
       done = std::move(done)](absl::StatusOr<TransferResult> r) {
        if (r.ok()) {
          r->transport = chosen;
          done(std::move(r));
          return;
        }
        const bool back_off = auto_mode && chosen != "tcp" && !absl::IsCancelled(r.status());
        {  // look the target up again before the next transfer: it may have been replaced
          absl::MutexLock lock(&state->mu);
          auto it = state->peers.find(target);
          if (it != state->peers.end()) it->second.fetched = absl::InfinitePast();
          if (back_off) state->gpu_backoff[{target, chosen}] = absl::Now() + backoff;
        }
        if (back_off) {
          DGSERVE_LOG_WARNING(
              "kv_transport auto: a transfer to %s over %s failed (%s); its transfers go over "
              "tcp for the next %s",
              target, chosen, r.status().message(), absl::FormatDuration(backoff));
        }
        absl::Status s = r.status();
        s.SetPayload(kTransportPayload, absl::Cord(chosen));
        done(s);
      });
}

}  // namespace dgserve::kv
