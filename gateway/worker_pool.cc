#include "gateway/worker_pool.h"

#include <algorithm>

#include "absl/random/distributions.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/hash.h"
#include "common/logging.h"
#include "service/address_list.h"

namespace dgserve {
namespace {

double Load(const WorkerEndpoint& e) {
  const int slots = std::max(1, e.stats.max_batch_canvases());
  return double(e.stats.active_canvases() + e.stats.queued_requests() + e.inflight) / slots;
}

}  // namespace

WorkerPool::WorkerPool(std::string role, std::vector<std::string> targets, std::string model_id,
                       ChannelFactory make_channel)
    : role_(std::move(role)),
      targets_(std::move(targets)),
      model_id_(std::move(model_id)),
      make_channel_(make_channel ? std::move(make_channel)
                                 : [](const std::string& target, const grpc::ChannelArguments& a) {
                                     return grpc::CreateCustomChannel(
                                         target, grpc::InsecureChannelCredentials(), a);
                                   }) {}

WorkerPool::~WorkerPool() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void WorkerPool::Start(absl::Duration poll_interval) {
  interval_ = poll_interval;
  Resolve();
  Poll();
  thread_ = std::thread([this] {
    while (!stop_) {
      absl::SleepFor(interval_);
      if (stop_) break;
      Resolve();
      Poll();
    }
  });
}

void WorkerPool::Resolve() {
  {
    absl::MutexLock lock(&mu_);
    if (absl::Now() - last_resolve_ < absl::Seconds(5)) return;
    last_resolve_ = absl::Now();
  }
  std::vector<std::string> addrs;
  std::vector<std::pair<std::string, absl::Status>> failed;  // targets that did not resolve
  for (const std::string& t : targets_) {
    absl::StatusOr<std::vector<std::string>> resolved = ResolveTarget(t);
    if (!resolved.ok()) {
      failed.emplace_back(t, resolved.status());
      continue;
    }
    for (std::string& a : *resolved) addrs.push_back(std::move(a));
  }
  absl::MutexLock lock(&mu_);
  // A name that does not resolve has no endpoint to poll: said once when it stops resolving
  // (from the first try on), and once when it resolves again.
  std::set<std::string> unresolved;
  for (const auto& [target, status] : failed) {
    if (!unresolved_.contains(target)) {
      DGSERVE_LOG_WARNING(
          "%s worker address %s; no %s worker there until it resolves (retried "
          "every 5 s)",
          role_, status.message(), role_);
    }
    unresolved.insert(target);
  }
  for (const std::string& target : unresolved_) {
    if (!unresolved.contains(target)) {
      DGSERVE_LOG_INFO("%s worker address %s resolves again", role_, target);
    }
  }
  unresolved_ = std::move(unresolved);
  std::vector<WorkerEndpoint> next;
  for (const std::string& a : addrs) {
    auto it = std::find_if(endpoints_.begin(), endpoints_.end(),
                           [&](const WorkerEndpoint& e) { return e.address == a; });
    if (it != endpoints_.end()) {
      next.push_back(std::move(*it));
      continue;
    }
    WorkerEndpoint e;
    e.address = a;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    e.channel = make_channel_(a, args);
    next.push_back(std::move(e));
  }
  endpoints_ = std::move(next);
}

void WorkerPool::Poll() {
  std::vector<std::pair<std::string, std::shared_ptr<grpc::Channel>>> todo;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& e : endpoints_) todo.emplace_back(e.address, e.channel);
  }
  for (auto& [address, channel] : todo) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    v1::StatsRequest req;
    v1::StatsResponse resp;
    grpc::Status s;
    if (role_ == "prefill") {
      s = v1::PrefillService::NewStub(channel)->Stats(&ctx, req, &resp);
    } else {
      s = v1::DenoiseService::NewStub(channel)->Stats(&ctx, req, &resp);
    }
    // A worker that answered is judged by its answer; one that refused the connection (or is
    // otherwise unreachable) is out at once; one whose answer was late is out only after
    // kMaxMissedPolls late answers in a row (a busy worker answers slowly).
    const bool answered_well = s.ok() && resp.role() == role_ && !resp.draining() &&
                               (model_id_.empty() || resp.model_id() == model_id_);
    const bool late = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    absl::MutexLock lock(&mu_);
    for (auto& e : endpoints_) {
      if (e.address != address) continue;
      e.missed_polls = late ? e.missed_polls + 1 : 0;
      const bool ok = answered_well || (late && e.healthy && e.missed_polls < kMaxMissedPolls);
      const std::string detail =
          s.ok() ? (resp.model_id() != model_id_ ? absl::StrCat(" (serves '", resp.model_id(), "')")
                                                 : std::string())
                 : absl::StrCat(
                       " (", s.error_message(),
                       late ? absl::StrCat(", ", e.missed_polls, " polls in a row") : std::string(),
                       ")");
      if (!e.polled && !ok) {
        // An endpoint starts unhealthy, so a change alone never named one that fails from its
        // first poll on (a worker not started, or not reachable at that address).
        DGSERVE_LOG_WARNING(
            "%s worker %s fails its first Stats poll%s; no requests go to it "
            "until a poll passes",
            role_, address, detail);
      } else if (e.healthy != ok) {
        DGSERVE_LOG_INFO("%s worker %s is %s%s", role_, address, ok ? "healthy" : "unhealthy",
                         detail);
      }
      e.healthy = ok;
      e.polled = true;
      if (s.ok()) e.stats = resp;
    }
  }
}

std::optional<std::string> WorkerPool::Pick(uint64_t affinity_key,
                                            const std::set<std::string>& exclude) {
  absl::MutexLock lock(&mu_);
  auto free_full = [](const WorkerEndpoint& e) {
    return e.stats.kv().full_blocks_total() - e.stats.kv().full_blocks_used();
  };
  WorkerEndpoint* best = nullptr;
  double best_load = 0;
  int ties = 0;  // endpoints equal to `best` so far: each replaces it with probability 1/ties
  for (auto& e : endpoints_) {
    if (!e.healthy || exclude.count(e.address)) continue;
    const double load = Load(e);
    if (!best || load < best_load || (load == best_load && free_full(e) > free_full(*best))) {
      best = &e;
      best_load = load;
      ties = 1;
    } else if (load == best_load && free_full(e) == free_full(*best)) {
      ++ties;
      if (absl::Uniform(tie_breaker_, 0, ties) == 0) best = &e;
    }
  }
  if (!best) return std::nullopt;
  WorkerEndpoint* pick = best;
  if (affinity_key != 0) {
    // Rendezvous hashing: the same prompt prefix goes to the same worker (its prefix cache),
    // unless that worker is far busier than the least loaded one.
    WorkerEndpoint* chosen = nullptr;
    uint64_t top = 0;
    for (auto& e : endpoints_) {
      if (!e.healthy || exclude.count(e.address)) continue;
      const uint64_t h = SplitMix64(affinity_key ^ Fnv1a64(e.address));
      if (!chosen || h > top) {
        chosen = &e;
        top = h;
      }
    }
    if (chosen && Load(*chosen) <= best_load + 4.0) pick = chosen;
  }
  ++pick->inflight;  // counted from the pick, not from the call (a burst sees it)
  return pick->address;
}

std::shared_ptr<grpc::Channel> WorkerPool::Channel(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (const auto& e : endpoints_) {
    if (e.address == address) return e.channel;
  }
  return make_channel_(address, grpc::ChannelArguments());
}

void WorkerPool::Release(const std::string& address) {
  absl::MutexLock lock(&mu_);
  for (auto& e : endpoints_) {
    if (e.address == address && e.inflight > 0) --e.inflight;
  }
}

void WorkerPool::MarkUnhealthy(const std::string& address, const std::string& cause) {
  absl::MutexLock lock(&mu_);
  for (auto& e : endpoints_) {
    if (e.address != address || !e.healthy) continue;
    e.healthy = false;
    DGSERVE_LOG_WARNING("%s worker %s is unhealthy (a call failed: %s)", role_, address, cause);
  }
}

int WorkerPool::healthy_count() const {
  absl::MutexLock lock(&mu_);
  return int(std::count_if(endpoints_.begin(), endpoints_.end(),
                           [](const WorkerEndpoint& e) { return e.healthy; }));
}

int WorkerPool::inflight(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  for (const auto& e : endpoints_) {
    if (e.address == address) return e.inflight;
  }
  return 0;
}

v1::KvDescriptor WorkerPool::KvLayoutOf(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  for (const auto& e : endpoints_) {
    if (e.address == address) return e.stats.kv_layout();
  }
  return v1::KvDescriptor();
}

std::vector<std::pair<std::string, v1::KvDescriptor>> WorkerPool::HealthyKvLayouts() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, v1::KvDescriptor>> out;
  for (const auto& e : endpoints_) {
    if (e.healthy) out.emplace_back(e.address, e.stats.kv_layout());
  }
  return out;
}

std::string KvLayoutMismatch(const std::string& prefill_address, const v1::KvDescriptor& prefill,
                             const std::string& denoise_address, const v1::KvDescriptor& denoise) {
  if (prefill.block_size() == 0 || denoise.block_size() == 0) return "";
  auto differ = [&](const std::string& field, const auto& p, const auto& d) {
    return absl::StrCat("KV layout mismatch: prefill worker ", prefill_address, " has ", field, " ",
                        p, ", denoise worker ", denoise_address, " has ", field, " ", d);
  };
  if (prefill.model_id() != denoise.model_id()) {
    return differ("model_id", absl::StrCat("'", prefill.model_id(), "'"),
                  absl::StrCat("'", denoise.model_id(), "'"));
  }
  if (prefill.layers_size() != denoise.layers_size()) {
    return differ("layers", prefill.layers_size(), denoise.layers_size());
  }
  for (int l = 0; l < prefill.layers_size(); ++l) {
    const v1::KvLayerShape& p = prefill.layers(l);
    const v1::KvLayerShape& d = denoise.layers(l);
    auto kind = [](const v1::KvLayerShape& s) { return s.sliding() ? "sliding" : "full"; };
    const std::string at = absl::StrCat("layers[", l, "]");
    if (p.sliding() != d.sliding()) return differ(at, kind(p), kind(d));
    if (p.kv_heads() != d.kv_heads()) {
      return differ(absl::StrCat(at, ".kv_heads"), p.kv_heads(), d.kv_heads());
    }
    if (p.head_dim() != d.head_dim()) {
      return differ(absl::StrCat(at, ".head_dim"), p.head_dim(), d.head_dim());
    }
  }
  if (prefill.dtype() != denoise.dtype()) {
    return differ("dtype", absl::StrCat("'", prefill.dtype(), "'"),
                  absl::StrCat("'", denoise.dtype(), "'"));
  }
  if (prefill.block_size() != denoise.block_size()) {
    return differ("block_size", prefill.block_size(), denoise.block_size());
  }
  if (prefill.sliding_window() != denoise.sliding_window()) {
    return differ("sliding_window", prefill.sliding_window(), denoise.sliding_window());
  }
  return "";
}

std::string KvLayoutMismatch(const WorkerPool& prefill, const WorkerPool& denoise) {
  const auto denoise_layouts = denoise.HealthyKvLayouts();
  for (const auto& [p_address, p_layout] : prefill.HealthyKvLayouts()) {
    for (const auto& [d_address, d_layout] : denoise_layouts) {
      std::string m = KvLayoutMismatch(p_address, p_layout, d_address, d_layout);
      if (!m.empty()) return m;
    }
  }
  return "";
}

void WorkerHold::Release() {
  if (pool_ != nullptr) std::exchange(pool_, nullptr)->Release(address_);
}

int WorkerPool::total_count() const {
  absl::MutexLock lock(&mu_);
  return int(endpoints_.size());
}

}  // namespace dgserve
