#include "kvstore/transfer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/hash.h"
#include "kvstore/transfer_internal.h"

namespace dgserve::kv {
namespace {

// An incoming transfer's table entry whose block has not arrived yet (no storage taken).
constexpr int32_t kNoBlock = -1;


constexpr int kFull = 1;
constexpr int kSliding = 0;
// How many forgotten request ids are remembered (a later transfer for one is refused).
constexpr size_t kForgottenCapacity = 4096;
// How long a failed transfer's status waits for an Expect that has not come yet.
constexpr absl::Duration kFailureMemory = absl::Seconds(60);
// Reaper period.
constexpr absl::Duration kReapPeriod = absl::Milliseconds(50);

int ExpectedSlidingFirst(const KvLayout& layout, int num_tokens) {
  return layout.SlidingKeepFrom(num_tokens) / layout.block_size;
}

absl::Status Mismatch(const std::string& what) {
  return absl::FailedPreconditionError(absl::StrCat("KV descriptor mismatch: ", what));
}

absl::Status WithId(const std::string& id, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat("KV transfer for ", id, ": ", s.message()));
}

}  // namespace

v1::KvDescriptor DescribeLayout(const KvLayout& layout) {
  v1::KvDescriptor d;
  d.set_model_id(layout.model_id);
  for (LayerKind kind : layout.kind_of_layer) {
    const int k = KindIndex(kind);
    v1::KvLayerShape* shape = d.add_layers();
    shape->set_sliding(kind == LayerKind::kSliding);
    // A hand-built layout without head shapes describes a row as one head of row_width.
    shape->set_kv_heads(layout.head_dim[k] > 0 ? layout.kv_heads[k] : 1);
    shape->set_head_dim(layout.head_dim[k] > 0 ? layout.head_dim[k] : layout.row_width[k]);
  }
  d.set_dtype("f32");
  d.set_block_size(layout.block_size);
  d.set_sliding_window(layout.sliding_window);
  return d;
}

v1::KvDescriptor DescribeSequence(const KvLayout& layout, const PagedKvCache& kv) {
  v1::KvDescriptor d = DescribeLayout(layout);
  const int n = kv.num_tokens();
  d.set_token_count(n);
  const int blocks = layout.BlocksFor(n);
  d.set_full_block_count(layout.layers[kFull] > 0 ? blocks : 0);
  if (layout.layers[kSliding] > 0) {
    const int first = std::max(ExpectedSlidingFirst(layout, n), kv.table().first_sliding_block);
    d.set_first_sliding_block(first);
    d.set_sliding_block_count(std::max(0, blocks - first));
  }
  return d;
}

absl::Status CheckDescriptor(const KvLayout& layout, const v1::KvDescriptor& got) {
  if (got.model_id() != layout.model_id) {
    return Mismatch(absl::StrCat("model_id is '", got.model_id(), "', this worker serves '",
                                 layout.model_id, "'"));
  }
  if (got.layers_size() != int(layout.kind_of_layer.size())) {
    return Mismatch(absl::StrCat("layers: ", got.layers_size(), " layers, expected ",
                                 layout.kind_of_layer.size()));
  }
  for (int l = 0; l < got.layers_size(); ++l) {
    const v1::KvLayerShape& s = got.layers(l);
    const LayerKind kind = layout.kind_of_layer[l];
    const int k = KindIndex(kind);
    if (s.sliding() != (kind == LayerKind::kSliding)) {
      return Mismatch(absl::StrCat("layers[", l, "] is ", s.sliding() ? "sliding" : "full",
                                   ", expected ", s.sliding() ? "full" : "sliding"));
    }
    const bool shaped = layout.head_dim[k] > 0;
    if (shaped ? s.kv_heads() != layout.kv_heads[k] : s.kv_heads() <= 0) {
      return Mismatch(absl::StrCat("layers[", l, "].kv_heads is ", s.kv_heads(), ", expected ",
                                   layout.kv_heads[k]));
    }
    if (shaped ? s.head_dim() != layout.head_dim[k]
               : int64_t(s.kv_heads()) * s.head_dim() != layout.row_width[k]) {
      return Mismatch(absl::StrCat("layers[", l, "].head_dim is ", s.head_dim(), ", expected ",
                                   shaped ? layout.head_dim[k] : layout.row_width[k]));
    }
  }
  if (got.dtype() != "f32") {
    return Mismatch(absl::StrCat("dtype is '", got.dtype(), "', expected 'f32'"));
  }
  if (got.block_size() != layout.block_size) {
    return Mismatch(absl::StrCat("block_size is ", got.block_size(), ", expected ",
                                 layout.block_size));
  }
  if (got.sliding_window() != layout.sliding_window) {
    return Mismatch(absl::StrCat("sliding_window is ", got.sliding_window(), ", expected ",
                                 layout.sliding_window));
  }
  const int n = got.token_count();
  if (n < 0) return Mismatch(absl::StrCat("token_count is ", n));
  const int blocks = layout.BlocksFor(n);
  const int want_full = layout.layers[kFull] > 0 ? blocks : 0;
  if (got.full_block_count() != want_full) {
    return Mismatch(absl::StrCat("full_block_count is ", got.full_block_count(), ", expected ",
                                 want_full, " for ", n, " tokens"));
  }
  const int first = got.first_sliding_block(), count = got.sliding_block_count();
  if (layout.layers[kSliding] == 0) {
    if (first != 0 || count != 0) {
      return Mismatch(absl::StrCat("sliding blocks ", first, "+", count,
                                   " announced for a model without sliding layers"));
    }
    return absl::OkStatus();
  }
  const int max_first = ExpectedSlidingFirst(layout, n);
  if (first < 0 || first > max_first) {
    return Mismatch(absl::StrCat("first_sliding_block is ", first, ", must be in [0, ",
                                 max_first, "] for ", n, " tokens"));
  }
  if (count != blocks - first) {
    return Mismatch(absl::StrCat("sliding_block_count is ", count, ", expected ", blocks - first,
                                 " (blocks ", first, " .. ", blocks - 1, ")"));
  }
  return absl::OkStatus();
}

bool IsKvPoolFull(const absl::Status& s) {
  return absl::IsResourceExhausted(s) && absl::StrContains(s.message(), kKvPoolFull);
}

absl::Status KvPushLimitError(const std::string& request_id, const std::string& target,
                              int max_outstanding) {
  return absl::ResourceExhaustedError(absl::StrCat("KV transfer for ", request_id, " to ", target,
                                                   ": ", kKvPushLimit, max_outstanding,
                                                   " transfers to that target are already "
                                                   "outstanding"));
}

bool IsKvPushLimit(const absl::Status& s) {
  return absl::IsResourceExhausted(s) && absl::StrContains(s.message(), kKvPushLimit);
}

std::string TransferFailureCause(absl::string_view message) {
  constexpr absl::string_view kPrefix = "KV transfer for ";
  for (;;) {
    if (!absl::StartsWith(message, kPrefix)) break;
    const size_t colon = message.find(": ");
    if (colon == absl::string_view::npos) break;
    // What lies between: "ID", "ID failed", "ID to TARGET" or "ID to TARGET failed" (an id and
    // a target have no spaces); anything else is a message of its own, kept.
    const std::vector<absl::string_view> words =
        absl::StrSplit(message.substr(kPrefix.size(), colon - kPrefix.size()), ' ');
    const size_t n = words.size();
    const bool failed = n > 0 && words[n - 1] == "failed" && (n == 2 || n == 4);
    const size_t core = failed ? n - 1 : n;
    if (words[0].empty() || !(core == 1 || (core == 3 && words[1] == "to"))) break;
    message.remove_prefix(colon + 2);
  }
  return std::string(message);
}

namespace internal {

v1::KvTransferHeader MakeHeader(const std::string& request_id, const PagedKvCache& kv,
                                int64_t lease_ms) {
  v1::KvTransferHeader h;
  h.set_request_id(request_id);
  *h.mutable_kv_descriptor() = DescribeSequence(kv.pool()->layout(), kv);
  h.set_lease_ms(lease_ms);
  return h;
}

std::vector<OutgoingBlock> BlocksToSend(const v1::KvDescriptor& d, const PagedKvCache& kv) {
  std::vector<OutgoingBlock> out;
  const BlockTable& t = kv.table();
  for (int i = 0; i < d.full_block_count(); ++i) {
    out.push_back({LayerKind::kFull, i, t.full[i]});
  }
  for (int i = 0; i < d.sliding_block_count(); ++i) {
    const int logical = d.first_sliding_block() + i;
    out.push_back({LayerKind::kSliding, logical, t.sliding[logical - t.first_sliding_block]});
  }
  return out;
}

void FillPayload(const PagedKvCache& kv, const OutgoingBlock& b, v1::KvBlockPayload* out) {
  const BlockPool* pool = kv.pool();
  const size_t bytes = pool->layout().BlockBytes(b.kind);
  out->set_sliding(b.kind == LayerKind::kSliding);
  out->set_logical_block(b.logical);
  out->mutable_data()->assign(reinterpret_cast<const char*>(pool->BlockData(b.kind, b.physical)),
                              bytes);
  out->set_checksum(Fnv1a64(out->data()));
}

std::string KvNodeName() {
  if (const char* node = std::getenv("NODE_NAME"); node != nullptr && node[0] != '\0') {
    return node;
  }
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) return "";
  return host;
}

}  // namespace internal

// ---------------------------------------------------------------------------------------------
// KvReceiver

struct KvReceiver::State {
  struct Incoming {
    v1::KvDescriptor descriptor;
    BlockTable table;  // full[i] = logical i; sliding[i] = logical first_sliding_block + i
    std::vector<uint8_t> written[kNumKinds];
    int written_count = 0;
    int expected = 0;
    int64_t lease_ms = 0;
    absl::Time lease_deadline;
    v1::KvDataPath data_path = v1::KV_DATA_INLINE;  // how its block bytes travel
  };
  struct Completed {
    std::unique_ptr<PagedKvCache> kv;
    absl::Time lease_deadline;
  };
  struct Expectation {
    absl::Time deadline;
    KvCallback done;
  };
  struct Failure {
    absl::Status status;
    absl::Time until;
  };
  // Callbacks collected under the mutex, run after it is released.
  struct Delivery {
    KvCallback done;
    absl::StatusOr<std::unique_ptr<PagedKvCache>> value;
  };
  using Outbox = std::vector<Delivery>;

  State(BlockPool* p, int m, int64_t l) : pool(p), max_tokens(m), max_lease_ms(l) {}

  static void Deliver(Outbox& out) {
    for (Delivery& d : out) d.done(std::move(d.value));
    out.clear();
  }

  // Fails the request: its Expect callback now, or the next Expect within kFailureMemory.
  void FailLocked(const std::string& id, const absl::Status& status, absl::Time now, Outbox& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (auto it = expectations.find(id); it != expectations.end()) {
      out.push_back({std::move(it->second.done), status});
      expectations.erase(it);
    } else {
      failures[id] = {status, now + kFailureMemory};
    }
  }

  void AbortLocked(std::map<std::string, Incoming>::iterator it, const absl::Status& status,
                   absl::Time now, Outbox& out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ReleaseTaken(it->second.table);
    const std::string id = it->first;
    incoming.erase(it);
    ++failed;
    FailLocked(id, status, now, out);
  }

  // Releases the blocks of an incoming transfer's table that were taken (kNoBlock: not yet).
  void ReleaseTaken(const BlockTable& table) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    for (const auto& [kind, blocks] : {std::pair{LayerKind::kFull, &table.full},
                                       std::pair{LayerKind::kSliding, &table.sliding}}) {
      std::vector<int32_t> taken;
      for (int32_t b : *blocks) {
        if (b != kNoBlock) taken.push_back(b);
      }
      pool->Release(kind, taken);
    }
  }

  // Status for a WriteBlock/Finish on an id with no transfer in flight.
  absl::Status NotInFlightLocked(const std::string& id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (auto f = failures.find(id); f != failures.end()) return f->second.status;
    if (auto f = forgotten.find(id); f != forgotten.end()) {
      return ForgottenStatus(id, f->second, "KV transfer for ", ": request ");
    }
    return absl::NotFoundError(absl::StrCat("no KV transfer in flight for ", id));
  }

  // CANCELLED "<prefix>ID<infix>forgotten", or DEADLINE_EXCEEDED "<prefix>ID<infix>forgotten
  // (its deadline passed)", as the request was forgotten.
  static absl::Status ForgottenStatus(const std::string& id, absl::StatusCode why,
                                      absl::string_view prefix, absl::string_view infix) {
    const bool expired = why == absl::StatusCode::kDeadlineExceeded;
    return absl::Status(expired ? why : absl::StatusCode::kCancelled,
                        absl::StrCat(prefix, id, infix, "forgotten",
                                     expired ? " (its deadline passed)" : ""));
  }

  void RememberForgotten(const std::string& id, absl::StatusCode why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!forgotten.emplace(id, why).second) return;
    forgotten_order.push_back(id);
    while (forgotten_order.size() > kForgottenCapacity) {
      forgotten.erase(forgotten_order.front());
      forgotten_order.pop_front();
    }
  }

  BlockPool* const pool;
  const int max_tokens;
  const int64_t max_lease_ms;
  int64_t clamped_leases ABSL_GUARDED_BY(mu) = 0;
  mutable absl::Mutex mu;
  std::map<std::string, Incoming> incoming ABSL_GUARDED_BY(mu);
  std::map<std::string, Completed> completed ABSL_GUARDED_BY(mu);
  std::map<std::string, Expectation> expectations ABSL_GUARDED_BY(mu);
  std::map<std::string, Failure> failures ABSL_GUARDED_BY(mu);
  // Forgotten request ids, with why (CANCELLED or DEADLINE_EXCEEDED).
  std::unordered_map<std::string, absl::StatusCode> forgotten ABSL_GUARDED_BY(mu);
  std::deque<std::string> forgotten_order ABSL_GUARDED_BY(mu);
  int64_t failed ABSL_GUARDED_BY(mu) = 0;
  int64_t received_bytes ABSL_GUARDED_BY(mu) = 0;
  std::map<v1::KvDataPath, int64_t> received_by_path ABSL_GUARDED_BY(mu);
  absl::Notification stop;
  std::thread reaper;
};

KvReceiver::KvReceiver(BlockPool* pool, int max_tokens, int64_t max_lease_ms)
    : state_(std::make_unique<State>(pool, max_tokens, std::max<int64_t>(1, max_lease_ms))) {
  State* s = state_.get();
  s->reaper = std::thread([this, s] {
    while (!s->stop.WaitForNotificationWithTimeout(kReapPeriod)) ReapExpired(absl::Now());
  });
}

KvReceiver::~KvReceiver() {
  state_->stop.Notify();
  state_->reaper.join();
  State::Outbox out;
  std::vector<std::unique_ptr<PagedKvCache>> graveyard;
  {
    absl::MutexLock lock(&state_->mu);
    for (auto& [id, in] : state_->incoming) state_->ReleaseTaken(in.table);
    state_->incoming.clear();
    for (auto& [id, c] : state_->completed) graveyard.push_back(std::move(c.kv));
    state_->completed.clear();
    for (auto& [id, e] : state_->expectations) {
      out.push_back({std::move(e.done),
                     absl::CancelledError(absl::StrCat("KV receiver shut down before the KV for ",
                                                       id, " arrived"))});
    }
    state_->expectations.clear();
  }
  graveyard.clear();
  State::Deliver(out);
}

absl::Status KvReceiver::Begin(const v1::KvTransferHeader& header) {
  const std::string& id = header.request_id();
  if (id.empty()) return absl::InvalidArgumentError("KV transfer without a request id");
  State& s = *state_;
  State::Outbox out;
  absl::Status result;
  {
    absl::MutexLock lock(&s.mu);
    if (auto f = s.forgotten.find(id); f != s.forgotten.end()) {
      return State::ForgottenStatus(id, f->second, "KV transfer for ",
                                    " refused: the request was ");
    }
    if (s.incoming.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("KV transfer for ", id, " already in flight"));
    }
    if (s.completed.contains(id)) {
      return absl::AlreadyExistsError(absl::StrCat("KV for ", id, " already received"));
    }
    s.failures.erase(id);  // a new attempt
    const v1::KvDescriptor& d = header.kv_descriptor();
    const KvLayout& layout = s.pool->layout();
    // Range checks first: the descriptor's block arithmetic runs only on a token count this
    // worker could hold.
    if (header.lease_ms() <= 0) {
      result = absl::InvalidArgumentError(absl::StrCat("lease_ms must be positive, got ",
                                                       header.lease_ms()));
    } else if (d.token_count() > s.max_tokens) {
      result = absl::ResourceExhaustedError(absl::StrCat(
          "token_count ", d.token_count(), " exceeds this worker's limit of ", s.max_tokens,
          " tokens"));
    } else {
      result = CheckDescriptor(layout, d);
    }
    State::Incoming in;
    in.data_path = header.data_path();
    if (result.ok()) {
      // Blocks are taken as their data arrives (WriteBlock), not for the header: a header that
      // announces a whole pool and sends nothing holds nothing. A transfer that could never fit
      // is refused now, as OUT_OF_RANGE (HTTP 400 at the gateway): retrying cannot help, where
      // RESOURCE_EXHAUSTED (429) tells a client to come back later.
      const PoolStats pool = s.pool->stats();
      for (const auto& [kind, count] :
           {std::pair{LayerKind::kFull, int64_t(d.full_block_count())},
            std::pair{LayerKind::kSliding, int64_t(d.sliding_block_count())}}) {
        if (result.ok() && count > pool.total[KindIndex(kind)]) {
          result = absl::OutOfRangeError(
              absl::StrCat(count, " ", kind == LayerKind::kFull ? "full" : "sliding",
                           " KV blocks announced; this worker's pool has ",
                           pool.total[KindIndex(kind)], " in all (--kv_cache_mib)"));
        }
      }
      in.table.full.assign(size_t(d.full_block_count()), kNoBlock);
      in.table.first_sliding_block = d.first_sliding_block();
      in.table.sliding.assign(size_t(d.sliding_block_count()), kNoBlock);
    }
    const absl::Time now = absl::Now();
    if (!result.ok()) {
      result = WithId(id, result);
      ++s.failed;
      s.FailLocked(id, result, now, out);
    } else {
      in.descriptor = d;
      in.written[KindIndex(LayerKind::kFull)].assign(in.table.full.size(), 0);
      in.written[KindIndex(LayerKind::kSliding)].assign(in.table.sliding.size(), 0);
      in.expected = int(in.table.full.size() + in.table.sliding.size());
      // A sender's lease is a request, not trusted: at most max_lease_ms.
      in.lease_ms = std::min(header.lease_ms(), s.max_lease_ms);
      if (in.lease_ms < header.lease_ms()) ++s.clamped_leases;
      in.lease_deadline = now + absl::Milliseconds(in.lease_ms);
      s.incoming.emplace(id, std::move(in));
    }
  }
  State::Deliver(out);
  return result;
}

absl::Status KvReceiver::WriteBlock(const std::string& request_id,
                                    const v1::KvBlockPayload& block) {
  const uint64_t checksum = Fnv1a64(block.data());  // outside the lock: the slow part
  State& s = *state_;
  State::Outbox out;
  absl::Status result;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.incoming.find(request_id);
    if (it == s.incoming.end()) return s.NotInFlightLocked(request_id);
    State::Incoming& in = it->second;
    const LayerKind kind = block.sliding() ? LayerKind::kSliding : LayerKind::kFull;
    const int k = KindIndex(kind);
    const char* kind_name = block.sliding() ? "sliding" : "full";
    const int first = block.sliding() ? in.table.first_sliding_block : 0;
    std::vector<int32_t>& blocks = block.sliding() ? in.table.sliding : in.table.full;
    const int64_t slot = int64_t(block.logical_block()) - first;
    const size_t want = s.pool->layout().BlockBytes(kind);
    if (slot < 0 || slot >= int64_t(blocks.size())) {
      result = absl::InvalidArgumentError(
          absl::StrCat(kind_name, " block ", block.logical_block(), " was not announced (",
                       kind_name, " blocks ", first, " .. ", first + int(blocks.size()) - 1,
                       ")"));
    } else if (in.written[k][slot]) {
      result = absl::InvalidArgumentError(
          absl::StrCat("duplicate ", kind_name, " block ", block.logical_block()));
    } else if (block.data().size() != want) {
      result = absl::InvalidArgumentError(absl::StrCat(kind_name, " block ",
                                                       block.logical_block(), " has ",
                                                       block.data().size(), " bytes, expected ",
                                                       want));
    } else if (checksum != block.checksum()) {
      result = absl::DataLossError(
          absl::StrCat("checksum mismatch in ", kind_name, " block ", block.logical_block()));
    } else if (blocks[slot] == kNoBlock) {
      // The block's storage, taken now that its data is here.
      absl::StatusOr<std::vector<int32_t>> got = s.pool->Allocate(kind, 1);
      if (got.ok()) {
        blocks[slot] = got->front();
      } else {
        result = absl::ResourceExhaustedError(
            absl::StrCat(kKvPoolFull, "no free ", kind_name, " block for block ",
                         block.logical_block(), ": ", got.status().message()));
      }
    }
    if (!result.ok()) {
      result = WithId(request_id, result);
      s.AbortLocked(it, result, absl::Now(), out);
    } else {
      std::memcpy(s.pool->BlockData(kind, blocks[slot]), block.data().data(), want);
      in.written[k][slot] = 1;
      ++in.written_count;
      s.received_bytes += int64_t(want);
      s.received_by_path[in.data_path] += int64_t(want);
    }
  }
  State::Deliver(out);
  return result;
}

absl::Status KvReceiver::Finish(const std::string& request_id,
                                const v1::KvTransferTrailer& trailer) {
  State& s = *state_;
  State::Outbox out;
  absl::Status result;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.incoming.find(request_id);
    if (it == s.incoming.end()) return s.NotInFlightLocked(request_id);
    State::Incoming& in = it->second;
    const absl::Time now = absl::Now();
    if (in.written_count != in.expected) {
      result = absl::DataLossError(absl::StrCat("finished with ", in.written_count, " of ",
                                                in.expected, " blocks written"));
    } else if (trailer.blocks() != in.expected) {
      result = absl::DataLossError(absl::StrCat("trailer counts ", trailer.blocks(),
                                                " blocks, ", in.expected, " were announced"));
    }
    if (!result.ok()) {
      result = WithId(request_id, result);
      s.AbortLocked(it, result, now, out);
    } else {
      auto kv = PagedKvCache::Adopt(s.pool, std::move(in.table), in.descriptor.token_count(),
                                    s.max_tokens);
      const absl::Time lease_deadline = now + absl::Milliseconds(in.lease_ms);
      s.incoming.erase(it);
      if (auto e = s.expectations.find(request_id); e != s.expectations.end()) {
        out.push_back({std::move(e->second.done), std::move(kv)});
        s.expectations.erase(e);
      } else {
        s.completed[request_id] = {std::move(kv), lease_deadline};
      }
    }
  }
  State::Deliver(out);
  return result;
}

void KvReceiver::Abort(const std::string& request_id, const absl::Status& why) {
  State& s = *state_;
  State::Outbox out;
  {
    absl::MutexLock lock(&s.mu);
    auto it = s.incoming.find(request_id);
    if (it == s.incoming.end()) return;
    const absl::Status status =
        why.ok() ? absl::UnknownError(absl::StrCat("KV transfer for ", request_id, " aborted"))
                 : why;
    s.AbortLocked(it, status, absl::Now(), out);
  }
  State::Deliver(out);
}

void KvReceiver::Expect(const std::string& request_id, absl::Time deadline, KvCallback done) {
  State& s = *state_;
  State::Outbox out;
  {
    absl::MutexLock lock(&s.mu);
    if (auto c = s.completed.find(request_id); c != s.completed.end()) {
      out.push_back({std::move(done), std::move(c->second.kv)});
      s.completed.erase(c);
    } else if (auto f = s.failures.find(request_id); f != s.failures.end()) {
      out.push_back({std::move(done), f->second.status});
      s.failures.erase(f);
    } else if (auto f = s.forgotten.find(request_id); f != s.forgotten.end()) {
      out.push_back({std::move(done),
                     State::ForgottenStatus(request_id, f->second, "KV for ", ": request ")});
    } else if (s.expectations.contains(request_id)) {
      out.push_back({std::move(done), absl::AlreadyExistsError(absl::StrCat(
                                          "KV for ", request_id, " is already expected"))});
    } else if (deadline <= absl::Now()) {
      out.push_back({std::move(done), absl::DeadlineExceededError(absl::StrCat(
                                          "no KV for ", request_id, " before its deadline"))});
    } else {
      s.expectations[request_id] = {deadline, std::move(done)};
    }
  }
  State::Deliver(out);
}

void KvReceiver::Forget(const std::string& request_id, absl::StatusCode why) {
  State& s = *state_;
  std::unique_ptr<PagedKvCache> drop;
  KvCallback dropped_callback;  // destroyed outside the lock, never called
  {
    absl::MutexLock lock(&s.mu);
    if (auto e = s.expectations.find(request_id); e != s.expectations.end()) {
      dropped_callback = std::move(e->second.done);
      s.expectations.erase(e);
    }
    if (auto it = s.incoming.find(request_id); it != s.incoming.end()) {
      s.ReleaseTaken(it->second.table);
      s.incoming.erase(it);
    }
    if (auto c = s.completed.find(request_id); c != s.completed.end()) {
      drop = std::move(c->second.kv);
      s.completed.erase(c);
    }
    s.failures.erase(request_id);
    s.RememberForgotten(request_id, why);
  }
}

bool KvReceiver::Drop(const std::string& request_id) {
  State& s = *state_;
  std::unique_ptr<PagedKvCache> drop;  // destroyed outside the lock
  absl::MutexLock lock(&s.mu);
  if (s.expectations.contains(request_id)) return false;
  bool dropped = false;
  if (auto it = s.incoming.find(request_id); it != s.incoming.end()) {
    s.ReleaseTaken(it->second.table);
    s.incoming.erase(it);
    dropped = true;
  }
  if (auto c = s.completed.find(request_id); c != s.completed.end()) {
    drop = std::move(c->second.kv);
    s.completed.erase(c);
    dropped = true;
  }
  return dropped;
}

void KvReceiver::ReapExpired(absl::Time now) {
  State& s = *state_;
  State::Outbox out;
  std::vector<std::unique_ptr<PagedKvCache>> graveyard;
  {
    absl::MutexLock lock(&s.mu);
    for (auto it = s.failures.begin(); it != s.failures.end();) {
      it = it->second.until <= now ? s.failures.erase(it) : std::next(it);
    }
    for (auto it = s.incoming.begin(); it != s.incoming.end();) {
      auto next = std::next(it);
      if (it->second.lease_deadline <= now) {
        const State::Incoming& in = it->second;
        absl::Status why = absl::DeadlineExceededError(
            absl::StrCat("KV transfer for ", it->first, ": lease of ", in.lease_ms,
                         " ms expired after ", in.written_count, " of ", in.expected,
                         " blocks"));
        s.AbortLocked(it, why, now, out);
      }
      it = next;
    }
    for (auto it = s.completed.begin(); it != s.completed.end();) {
      if (it->second.lease_deadline <= now) {
        graveyard.push_back(std::move(it->second.kv));
        it = s.completed.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = s.expectations.begin(); it != s.expectations.end();) {
      if (it->second.deadline <= now) {
        out.push_back({std::move(it->second.done),
                       absl::DeadlineExceededError(absl::StrCat(
                           "no KV for ", it->first, " arrived before the deadline"))});
        it = s.expectations.erase(it);
      } else {
        ++it;
      }
    }
  }
  graveyard.clear();
  State::Deliver(out);
}

int KvReceiver::pending_transfers() const {
  absl::MutexLock lock(&state_->mu);
  return int(state_->incoming.size());
}

int64_t KvReceiver::clamped_leases() const {
  absl::MutexLock lock(&state_->mu);
  return state_->clamped_leases;
}

int64_t KvReceiver::received_bytes() const {
  absl::MutexLock lock(&state_->mu);
  return state_->received_bytes;
}

std::map<v1::KvDataPath, int64_t> KvReceiver::received_bytes_by_path() const {
  absl::MutexLock lock(&state_->mu);
  return state_->received_by_path;
}

int64_t KvReceiver::failed_transfers() const {
  absl::MutexLock lock(&state_->mu);
  return state_->failed;
}

}  // namespace dgserve::kv
