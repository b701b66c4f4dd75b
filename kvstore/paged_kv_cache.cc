#include "kvstore/paged_kv_cache.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace dgserve::kv {
namespace {

constexpr int kFullIndex = 1;
constexpr int kSlidingIndex = 0;
static_assert(kFullIndex == static_cast<int>(LayerKind::kFull));
static_assert(kSlidingIndex == static_cast<int>(LayerKind::kSliding));

// The position before which DropOldSliding releases every sliding block: SlidingKeepFrom −
// block_size (≤ 0: none).
int64_t SlidingReleaseLimit(const KvLayout& layout, int num_tokens) {
  return int64_t(layout.SlidingKeepFrom(num_tokens)) - layout.block_size;
}

// Releases the sliding blocks wholly before SlidingReleaseLimit.
void DropOldSliding(BlockPool* pool, BlockTable* table, int num_tokens) {
  const KvLayout& layout = pool->layout();
  if (layout.layers[kSlidingIndex] == 0) return;
  const int64_t limit = SlidingReleaseLimit(layout, num_tokens);
  size_t drop = 0;
  while (drop < table->sliding.size() &&
         (int64_t(table->first_sliding_block) + int64_t(drop) + 1) * layout.block_size <= limit) {
    ++drop;
  }
  if (drop == 0) return;
  pool->Release(LayerKind::kSliding, std::span<const int32_t>(table->sliding.data(), drop));
  table->sliding.erase(table->sliding.begin(), table->sliding.begin() + drop);
  table->first_sliding_block += int(drop);
}

[[noreturn]] void FatalRow(int layer, int pos, const char* why, int num_tokens, int reserved) {
  DGSERVE_LOG_ERROR("PagedKvCache: row of layer %d position %d %s (%d committed, %d reserved)",
                    layer, pos, why, num_tokens, reserved);
  std::abort();
}

}  // namespace

int PagedKvCache::SlidingRetainedFrom(int num_tokens) const {
  const KvLayout& layout = pool_->layout();
  const int64_t limit = SlidingReleaseLimit(layout, num_tokens);
  if (limit <= 0) return 0;
  return int(limit / layout.block_size * layout.block_size);
}

int PagedKvCache::MaxSlidingRowsKept() const {
  // n − SlidingRetainedFrom(n) is largest when the release limit n − (W − 1) − B sits at the
  // last row of a block: W − 1 + B + (B − 1) rows (while the limit is ≤ 0 all n ≤ W − 1 + B
  // rows are kept).
  const KvLayout& layout = pool_->layout();
  return std::max(0, layout.sliding_window - 1) + 2 * layout.block_size - 1;
}

uint64_t PagedKvCache::SharedRowsId(bool full, int pos) const {
  if (pos < 0 || pos >= num_tokens_) return 0;
  const KvLayout& layout = pool_->layout();
  const LayerKind kind = full ? LayerKind::kFull : LayerKind::kSliding;
  if (layout.layers[KindIndex(kind)] == 0) return 0;
  const int b = pos / layout.block_size;
  if (full) return b < int(table_.full.size()) ? pool_->AllocationId(kind, table_.full[b]) : 0;
  const int i = b - table_.first_sliding_block;
  return i >= 0 && i < int(table_.sliding.size()) ? pool_->AllocationId(kind, table_.sliding[i])
                                                  : 0;
}

PagedKvCache::PagedKvCache(BlockPool* pool, int max_tokens)
    : pool_(pool), max_tokens_(max_tokens) {}

std::unique_ptr<PagedKvCache> PagedKvCache::FromPrefix(BlockPool* pool, PrefixMatch match,
                                                       int max_tokens) {
  auto kv = std::make_unique<PagedKvCache>(pool, max_tokens);
  kv->table_ = std::move(match.table);
  kv->num_tokens_ = match.num_tokens;
  DropOldSliding(pool, &kv->table_, kv->num_tokens_);
  return kv;
}

std::unique_ptr<PagedKvCache> PagedKvCache::Adopt(BlockPool* pool, BlockTable table,
                                                  int num_tokens, int max_tokens) {
  auto kv = std::make_unique<PagedKvCache>(pool, max_tokens);
  kv->table_ = std::move(table);
  kv->num_tokens_ = num_tokens;
  DropOldSliding(pool, &kv->table_, kv->num_tokens_);
  return kv;
}

absl::StatusOr<std::unique_ptr<PagedKvCache>> PagedKvCache::Fork() const {
  DGSERVE_RETURN_IF_ERROR(CheckHostRowsCurrent(*this, "Fork"));
  const KvLayout& layout = pool_->layout();
  const int whole = num_tokens_ / layout.block_size;  // blocks no commit writes to again
  const int blocks = layout.BlocksFor(num_tokens_);   // whole + the partial one, if any
  BlockTable t;
  t.first_sliding_block = table_.first_sliding_block;
  // Per kind: the shared prefix of the table and the partial block to copy (-1: none).
  const std::vector<int32_t>* lists[kNumKinds];
  lists[kSlidingIndex] = &table_.sliding;
  lists[kFullIndex] = &table_.full;
  std::vector<int32_t>* out[kNumKinds];
  out[kSlidingIndex] = &t.sliding;
  out[kFullIndex] = &t.full;
  const int first[kNumKinds] = {table_.first_sliding_block, 0};
  int32_t partial[kNumKinds] = {-1, -1};
  for (int k = 0; k < kNumKinds; ++k) {
    if (layout.layers[k] == 0) continue;
    const std::vector<int32_t>& list = *lists[k];
    const size_t shared = size_t(std::clamp(whole - first[k], 0, int(list.size())));
    out[k]->assign(list.begin(), list.begin() + shared);
    const int last = blocks - 1 - first[k];  // the partial block's index in the list
    if (blocks > whole && last >= 0 && size_t(last) < list.size()) partial[k] = list[last];
  }
  int32_t copy[kNumKinds] = {-1, -1};
  for (int k = 0; k < kNumKinds; ++k) {
    if (partial[k] < 0) continue;
    const LayerKind kind = static_cast<LayerKind>(k);
    absl::StatusOr<std::vector<int32_t>> got = pool_->Allocate(kind, 1);
    if (!got.ok()) {
      for (int j = 0; j < k; ++j) {
        if (copy[j] >= 0) {
          pool_->Release(static_cast<LayerKind>(j), std::span<const int32_t>(&copy[j], 1));
        }
      }
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV cache cannot fork a sequence of ", num_tokens_, " tokens: ", got.status().message()));
    }
    copy[k] = (*got)[0];
    std::memcpy(pool_->BlockData(kind, copy[k]), pool_->BlockData(kind, partial[k]),
                layout.BlockBytes(kind));
  }
  for (int k = 0; k < kNumKinds; ++k) {
    pool_->Ref(static_cast<LayerKind>(k), *out[k]);
    if (copy[k] >= 0) out[k]->push_back(copy[k]);
  }
  auto kv = std::make_unique<PagedKvCache>(pool_, max_tokens_);
  kv->table_ = std::move(t);
  kv->num_tokens_ = num_tokens_;
  return kv;
}

PagedKvCache::~PagedKvCache() {
  // Tail first: released later means more recently used, so the LRU evicts a cached prefix's
  // last blocks before its first ones.
  std::vector<int32_t> full(table_.full.rbegin(), table_.full.rend());
  std::vector<int32_t> sliding(table_.sliding.rbegin(), table_.sliding.rend());
  pool_->Release(LayerKind::kFull, full);
  pool_->Release(LayerKind::kSliding, sliding);
}

absl::Status PagedKvCache::Reserve(int count) {
  if (count < 0 || int64_t(num_tokens_) + count > max_tokens_) {
    return absl::ResourceExhaustedError(absl::StrCat("KV cache holds at most ", max_tokens_,
                                                     " tokens; ", num_tokens_, " used, ", count,
                                                     " more requested"));
  }
  const KvLayout& layout = pool_->layout();
  const int blocks = layout.BlocksFor(num_tokens_ + count);  // logical blocks needed
  // Blocks to add (> 0) or surplus of an earlier, larger reservation (< 0), per kind.
  int64_t delta[kNumKinds] = {0, 0};
  if (layout.layers[kFullIndex] > 0) delta[kFullIndex] = blocks - int64_t(table_.full.size());
  if (layout.layers[kSlidingIndex] > 0) {
    delta[kSlidingIndex] =
        blocks - (int64_t(table_.first_sliding_block) + int64_t(table_.sliding.size()));
  }
  std::vector<int32_t> added[kNumKinds];
  for (int k = 0; k < kNumKinds; ++k) {
    if (delta[k] <= 0) continue;
    auto got = pool_->Allocate(static_cast<LayerKind>(k), int(delta[k]));
    if (!got.ok()) {
      for (int j = 0; j < k; ++j) pool_->Release(static_cast<LayerKind>(j), added[j]);
      return absl::ResourceExhaustedError(absl::StrCat(
          "KV cache cannot reserve ", count, " more tokens (", num_tokens_,
          " used): ", got.status().message()));
    }
    added[k] = std::move(*got);
  }
  std::vector<int32_t>* lists[kNumKinds];
  lists[kSlidingIndex] = &table_.sliding;
  lists[kFullIndex] = &table_.full;
  for (int k = 0; k < kNumKinds; ++k) {
    std::vector<int32_t>& list = *lists[k];
    if (delta[k] > 0) {
      list.insert(list.end(), added[k].begin(), added[k].end());
    } else if (delta[k] < 0) {
      // Never below the blocks of committed positions: blocks ≥ BlocksFor(num_tokens_).
      const size_t keep = list.size() - std::min(list.size(), size_t(-delta[k]));
      pool_->Release(static_cast<LayerKind>(k),
                     std::span<const int32_t>(list.data() + keep, list.size() - keep));
      list.resize(keep);
    }
  }
  reserved_ = count;
  return absl::OkStatus();
}

float* PagedKvCache::Row(int layer, int pos, bool value) const {
  const KvLayout& layout = pool_->layout();
  if (layer < 0 || layer >= int(layout.kind_of_layer.size())) {
    FatalRow(layer, pos, "of an unknown layer", num_tokens_, reserved_);
  }
  if (pos < 0 || pos >= num_tokens_ + reserved_) {
    FatalRow(layer, pos, "is neither committed nor reserved", num_tokens_, reserved_);
  }
  const LayerKind kind = layout.kind_of_layer[layer];
  const int b = pos / layout.block_size;
  const int offset = pos % layout.block_size;
  int32_t block;
  if (kind == LayerKind::kFull) {
    if (b >= int(table_.full.size())) FatalRow(layer, pos, "has no block", num_tokens_, reserved_);
    block = table_.full[b];
  } else {
    const int i = b - table_.first_sliding_block;
    if (i < 0) {
      FatalRow(layer, pos, "is outside the retained sliding window", num_tokens_, reserved_);
    }
    if (i >= int(table_.sliding.size())) {
      FatalRow(layer, pos, "has no block", num_tokens_, reserved_);
    }
    block = table_.sliding[i];
  }
  return pool_->BlockData(kind, block) +
         layout.RowOffset(kind, layout.index_in_kind[layer], value, offset);
}

float* PagedKvCache::MutableKeyRow(int layer, int pos) { return Row(layer, pos, false); }
float* PagedKvCache::MutableValueRow(int layer, int pos) { return Row(layer, pos, true); }
const float* PagedKvCache::KeyRow(int layer, int pos) const { return Row(layer, pos, false); }
const float* PagedKvCache::ValueRow(int layer, int pos) const { return Row(layer, pos, true); }

void PagedKvCache::Commit(int count) {
  num_tokens_ += std::clamp(count, 0, reserved_);
  reserved_ = 0;
  DropOldSliding(pool_, &table_, num_tokens_);
}

}  // namespace dgserve::kv
