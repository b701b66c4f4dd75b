#include "kvstore/block_pool.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <list>
#include <new>
#include <unordered_map>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/hash.h"
#include "common/logging.h"

namespace dgserve::kv {
namespace {

constexpr int32_t kNone = -1;
// Seed of the prefix hash chain (the "hash" before block 0).
constexpr uint64_t kChainRoot = 0x6B76706F6F6C3031ull;  // "kvpool01"

const char* KindName(int k) { return k == KindIndex(LayerKind::kFull) ? "full" : "sliding"; }

// Hash of block i of a prefix: a SplitMix64 chain over the previous block's hash and the block's
// token ids.
uint64_t ChainHash(uint64_t prev, std::span<const int32_t> ids) {
  uint64_t h = SplitMix64(prev);
  for (int32_t id : ids) h = SplitMix64(h ^ static_cast<uint32_t>(id));
  return h;
}

// One prefix-index entry: whole block i of some prefix. `parent_serial` is the serial of the
// entry of block i−1 (0 for block 0); an entry is only followed from the very entry it was
// inserted under, and its tokens are compared, so a hash collision can never splice two
// different prefixes together.
struct PrefixEntry {
  uint64_t serial = 0;
  uint64_t parent_serial = 0;
  std::vector<int32_t> tokens;
  int32_t block[kNumKinds] = {kNone, kNone};
};

// The blocks of one layer kind. A block is in exactly one state: free (in free_list),
// referenced (refs > 0), or cached (refs == 0, indexed, in lru).
struct KindState {
  std::unique_ptr<float[]> data;
  size_t block_floats = 0;
  int32_t total = 0;
  std::vector<int32_t> refs;
  std::vector<uint64_t> allocation;  // AllocationId per block (0: never allocated)
  std::vector<uint8_t> indexed;
  std::vector<uint64_t> index_key;  // key of the entry holding the block (when indexed)
  std::vector<int32_t> free_list;
  std::list<int32_t> lru;  // cached blocks, least recently used first
  std::vector<std::list<int32_t>::iterator> lru_pos;
  std::vector<uint8_t> in_lru;
  int64_t used = 0;
  int64_t shared = 0;  // blocks with refs > 1
};

// AllocationIds, unique in the process (every pool draws from one count: a backend may hold
// caches of several pools).
uint64_t NextAllocationId() {
  static std::atomic<uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

class BlockPoolImpl final : public BlockPool {
 public:
  explicit BlockPoolImpl(const KvLayout& layout) : layout_(layout) {}

  absl::Status Init(int64_t sliding_blocks, int64_t full_blocks) {
    const int64_t want[kNumKinds] = {sliding_blocks, full_blocks};
    for (int k = 0; k < kNumKinds; ++k) {
      KindState& s = kinds_[k];
      if (layout_.layers[k] == 0) continue;  // a kind with no layers gets no blocks
      if (want[k] > std::numeric_limits<int32_t>::max()) {
        return absl::InvalidArgumentError(
            absl::StrCat("KV pool: ", want[k], " ", KindName(k), " blocks exceed the int32 ids"));
      }
      s.block_floats = layout_.BlockFloats(static_cast<LayerKind>(k));
      s.total = static_cast<int32_t>(want[k]);
      const size_t n = size_t(s.total);
      if (n > 0 && s.block_floats > std::numeric_limits<size_t>::max() / sizeof(float) / n) {
        return absl::ResourceExhaustedError(
            absl::StrCat("KV pool: ", n, " ", KindName(k), " blocks overflow the address space"));
      }
      try {
        // Uninitialised on purpose: pages are only touched when blocks are written.
        s.data.reset(new float[n * s.block_floats]);
        s.refs.assign(n, 0);
        s.allocation.assign(n, 0);
        s.indexed.assign(n, 0);
        s.index_key.assign(n, 0);
        s.lru_pos.assign(n, s.lru.end());
        s.in_lru.assign(n, 0);
        s.free_list.resize(n);
      } catch (const std::bad_alloc&) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "KV pool: cannot allocate ", n, " ", KindName(k), " blocks of ",
            s.block_floats * sizeof(float), " bytes"));
      }
      // Pop order 0, 1, 2, …: the free list is a stack.
      for (size_t i = 0; i < n; ++i) s.free_list[i] = static_cast<int32_t>(n - 1 - i);
    }
    return absl::OkStatus();
  }

  const KvLayout& layout() const override { return layout_; }

  absl::StatusOr<std::vector<int32_t>> Allocate(LayerKind kind, int count) override {
    const int k = KindIndex(kind);
    absl::MutexLock lock(&mu_);
    KindState& s = kinds_[k];
    if (count < 0) {
      return absl::InvalidArgumentError(absl::StrCat("KV pool: negative block count ", count));
    }
    const size_t available = s.free_list.size() + s.lru.size();
    if (size_t(count) > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV pool: ", count, " ", KindName(k), " blocks requested, ", available,
          " available (", s.total, " total, ", s.used, " in use)"));
    }
    std::vector<int32_t> out;
    out.reserve(count);
    for (int i = 0; i < count; ++i) {
      int32_t b;
      if (!s.free_list.empty()) {
        b = s.free_list.back();
        s.free_list.pop_back();
      } else {
        b = s.lru.front();
        s.lru.pop_front();
        s.in_lru[b] = 0;
        s.lru_pos[b] = s.lru.end();
        DropEntryLocked(s.index_key[b]);  // un-indexes b (and its partner block of the entry)
        ++evictions_;
      }
      s.refs[b] = 1;
      s.allocation[b] = NextAllocationId();
      ++s.used;
      out.push_back(b);
    }
    return out;
  }

  void Ref(LayerKind kind, std::span<const int32_t> blocks) override {
    absl::MutexLock lock(&mu_);
    for (int32_t b : blocks) RefLocked(KindIndex(kind), b);
  }

  void Release(LayerKind kind, std::span<const int32_t> blocks) override {
    const int k = KindIndex(kind);
    absl::MutexLock lock(&mu_);
    KindState& s = kinds_[k];
    for (int32_t b : blocks) {
      if (b < 0 || b >= s.total || s.refs[b] <= 0) {
        DGSERVE_LOG_ERROR("KV pool: release of unreferenced %s block %d (ignored)", KindName(k),
                          b);
        continue;
      }
      if (s.refs[b] == 2) --s.shared;
      if (--s.refs[b] > 0) continue;
      --s.used;
      if (s.indexed[b]) {
        s.lru_pos[b] = s.lru.insert(s.lru.end(), b);
        s.in_lru[b] = 1;
      } else {
        s.free_list.push_back(b);
      }
    }
  }

  float* BlockData(LayerKind kind, int32_t block) override {
    const KindState& s = kinds_[KindIndex(kind)];
    return s.data.get() + size_t(block) * s.block_floats;
  }
  const float* BlockData(LayerKind kind, int32_t block) const override {
    const KindState& s = kinds_[KindIndex(kind)];
    return s.data.get() + size_t(block) * s.block_floats;
  }

  uint64_t AllocationId(LayerKind kind, int32_t block) const override {
    absl::MutexLock lock(&mu_);
    const KindState& s = kinds_[KindIndex(kind)];
    return block >= 0 && block < s.total ? s.allocation[block] : 0;
  }

  PrefixMatch MatchPrefix(std::span<const int32_t> tokens) override {
    const int B = layout_.block_size;
    const int kf = KindIndex(LayerKind::kFull), ks = KindIndex(LayerKind::kSliding);
    const bool has_full = layout_.layers[kf] > 0, has_sliding = layout_.layers[ks] > 0;
    absl::MutexLock lock(&mu_);
    ++prefix_queries_;
    // The verified chain of entries for blocks 0, 1, … of `tokens`.
    std::vector<const PrefixEntry*> chain;
    uint64_t h = kChainRoot, parent = 0;
    const size_t whole = tokens.size() / B;
    for (size_t i = 0; i < whole; ++i) {
      const auto ids = tokens.subspan(i * B, B);
      h = ChainHash(h, ids);
      auto it = index_.find(h);
      if (it == index_.end()) break;
      const PrefixEntry& e = it->second;
      if (e.parent_serial != parent || !std::equal(ids.begin(), ids.end(), e.tokens.begin(),
                                                   e.tokens.end())) {
        break;
      }
      if (has_full && e.block[kf] == kNone) break;
      chain.push_back(&e);
      parent = e.serial;
    }
    // The longest k whose sliding blocks cover [SlidingKeepFrom(k·B), k·B).
    PrefixMatch match;
    for (size_t k = chain.size(); k > 0; --k) {
      const size_t from = has_sliding ? size_t(layout_.SlidingKeepFrom(int(k) * B) / B) : k;
      bool ok = true;
      for (size_t j = from; j < k && ok; ++j) ok = chain[j]->block[ks] != kNone;
      if (!ok) continue;
      match.num_tokens = int(k) * B;
      match.table.first_sliding_block = has_sliding ? int(from) : 0;
      for (size_t j = 0; j < k && has_full; ++j) {
        match.table.full.push_back(chain[j]->block[kf]);
        RefLocked(kf, chain[j]->block[kf]);
      }
      for (size_t j = from; j < k; ++j) {
        match.table.sliding.push_back(chain[j]->block[ks]);
        RefLocked(ks, chain[j]->block[ks]);
      }
      break;
    }
    if (match.num_tokens > 0) {
      ++prefix_hits_;
      prefix_hit_tokens_ += match.num_tokens;
    }
    return match;
  }

  void InsertPrefix(std::span<const int32_t> tokens, const BlockTable& table) override {
    const int B = layout_.block_size;
    const int kf = KindIndex(LayerKind::kFull), ks = KindIndex(LayerKind::kSliding);
    const bool has_full = layout_.layers[kf] > 0, has_sliding = layout_.layers[ks] > 0;
    absl::MutexLock lock(&mu_);
    uint64_t h = kChainRoot, parent = 0;
    const size_t whole = tokens.size() / B;
    for (size_t i = 0; i < whole; ++i) {
      const auto ids = tokens.subspan(i * B, B);
      h = ChainHash(h, ids);
      int32_t mine[kNumKinds] = {kNone, kNone};
      if (has_full && i < table.full.size()) mine[kf] = table.full[i];
      const int64_t si = int64_t(i) - table.first_sliding_block;
      if (has_sliding && si >= 0 && si < int64_t(table.sliding.size())) {
        mine[ks] = table.sliding[si];
      }
      // Only blocks the caller holds can be indexed (a free block must stay free).
      for (int k = 0; k < kNumKinds; ++k) {
        if (mine[k] != kNone && (mine[k] < 0 || mine[k] >= kinds_[k].total ||
                                 kinds_[k].refs[mine[k]] <= 0)) {
          mine[k] = kNone;
        }
      }
      auto it = index_.find(h);
      if (it != index_.end()) {
        PrefixEntry& e = it->second;
        if (e.parent_serial == parent &&
            std::equal(ids.begin(), ids.end(), e.tokens.begin(), e.tokens.end())) {
          // Already indexed: keep the entry, fill in a kind it lacks.
          for (int k = 0; k < kNumKinds; ++k) {
            if (e.block[k] == kNone && mine[k] != kNone && !kinds_[k].indexed[mine[k]]) {
              AttachLocked(k, mine[k], h);
              e.block[k] = mine[k];
            }
          }
          if (has_full && e.block[kf] == kNone) return;
          parent = e.serial;
          continue;
        }
        DropEntryLocked(h);  // stale (its parent was evicted and re-created) or a collision
      }
      for (int k = 0; k < kNumKinds; ++k) {
        if (mine[k] != kNone && kinds_[k].indexed[mine[k]]) mine[k] = kNone;
      }
      // The chain needs the full block of every entry (or, without full layers, a sliding one).
      if (has_full ? mine[kf] == kNone : mine[ks] == kNone) return;
      PrefixEntry e;
      e.serial = next_serial_++;
      e.parent_serial = parent;
      e.tokens.assign(ids.begin(), ids.end());
      for (int k = 0; k < kNumKinds; ++k) {
        if (mine[k] == kNone) continue;
        AttachLocked(k, mine[k], h);
        e.block[k] = mine[k];
      }
      parent = e.serial;
      index_.emplace(h, std::move(e));
    }
  }

  PoolStats stats() const override {
    absl::MutexLock lock(&mu_);
    PoolStats st;
    for (int k = 0; k < kNumKinds; ++k) {
      const KindState& s = kinds_[k];
      st.total[k] = s.total;
      st.used[k] = s.used;
      st.cached[k] = int64_t(s.lru.size());
      st.shared[k] = s.shared;
      st.free_blocks[k] = s.total - s.used;
    }
    st.prefix_queries = prefix_queries_;
    st.prefix_hit_tokens = prefix_hit_tokens_;
    st.prefix_hits = prefix_hits_;
    st.evictions = evictions_;
    return st;
  }

 private:
  void RefLocked(int k, int32_t b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    KindState& s = kinds_[k];
    if (b < 0 || b >= s.total || (s.refs[b] == 0 && !s.in_lru[b])) {
      DGSERVE_LOG_ERROR("KV pool: reference to free %s block %d (ignored)", KindName(k), b);
      return;
    }
    if (s.refs[b] == 1) ++s.shared;
    if (s.refs[b]++ == 0) {
      ++s.used;
      s.lru.erase(s.lru_pos[b]);
      s.lru_pos[b] = s.lru.end();
      s.in_lru[b] = 0;
    }
  }

  void AttachLocked(int k, int32_t b, uint64_t key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    kinds_[k].indexed[b] = 1;
    kinds_[k].index_key[b] = key;
  }

  // Removes the entry under `key`; its blocks leave the index (cached ones become free).
  void DropEntryLocked(uint64_t key) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = index_.find(key);
    if (it == index_.end()) return;
    for (int k = 0; k < kNumKinds; ++k) {
      const int32_t b = it->second.block[k];
      if (b == kNone) continue;
      KindState& s = kinds_[k];
      s.indexed[b] = 0;
      if (s.refs[b] == 0 && s.in_lru[b]) {
        s.lru.erase(s.lru_pos[b]);
        s.lru_pos[b] = s.lru.end();
        s.in_lru[b] = 0;
        s.free_list.push_back(b);
      }
    }
    index_.erase(it);
  }

  const KvLayout layout_;
  mutable absl::Mutex mu_;
  KindState kinds_[kNumKinds] ABSL_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, PrefixEntry> index_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t prefix_queries_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefix_hit_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t prefix_hits_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t evictions_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BlockPool>> BlockPool::Create(const KvLayout& layout,
                                                             int64_t sliding_blocks,
                                                             int64_t full_blocks) {
  if (layout.block_size <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV pool: block_size must be positive, got ", layout.block_size));
  }
  if (sliding_blocks < 0 || full_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat("KV pool: negative block counts (sliding ",
                                                   sliding_blocks, ", full ", full_blocks, ")"));
  }
  if (layout.layers[0] < 0 || layout.layers[1] < 0 || layout.layers[0] + layout.layers[1] == 0) {
    return absl::InvalidArgumentError("KV pool: the layout has no layers");
  }
  if (layout.kind_of_layer.size() != layout.index_in_kind.size() ||
      int(layout.kind_of_layer.size()) != layout.layers[0] + layout.layers[1]) {
    return absl::InvalidArgumentError("KV pool: inconsistent layer counts in the layout");
  }
  for (int k = 0; k < kNumKinds; ++k) {
    if (layout.layers[k] > 0 && layout.row_width[k] <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV pool: ", KindName(k), " row width must be positive"));
    }
  }
  auto pool = std::make_unique<BlockPoolImpl>(layout);
  if (absl::Status s = pool->Init(sliding_blocks, full_blocks); !s.ok()) return s;
  return std::unique_ptr<BlockPool>(std::move(pool));
}

}  // namespace dgserve::kv
