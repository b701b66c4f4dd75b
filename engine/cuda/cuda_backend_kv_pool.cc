// The CUDA backend's device K/V block pools (issue 34 item 1; CudaBackendOptions::kv_block_size,
// kv_pool_max_bytes): growing a pool, a block for a mirror, compacting a pool, and the admission
// check against the bound. Each layer's K and V array of a pool sits at a fixed address and grows
// and shrinks in place (cuda_reserved_memory.h). The mirrors that hold the blocks are in
// cuda_backend_kv.cc.
#include <algorithm>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_backend_internal.h"

namespace dgserve {
namespace cuda_internal {

int64_t CudaBackend::KvPoolBlockBytes(int kind) const {
  int64_t bytes = 0;
  for (int l = 0; l < c_.num_layers; ++l) {
    if (KvKind(l) == kind) bytes += KvBlockBytes(l);
  }
  return bytes;
}

int64_t CudaBackend::KvArrayBytes(int l, int64_t blocks) const {
  if (blocks <= 0) return 0;
  const int64_t bytes = blocks * (KvBlockBytes(l) / 2);
  if (kv_granularity_ == 0) return bytes;  // (no pools: per-sequence mirrors)
  return int64_t(cuda::RoundUpToGranularity(size_t(bytes), kv_granularity_));
}

int64_t CudaBackend::KvPoolBytes(int kind, int64_t blocks) const {
  int64_t bytes = 0;
  for (int l = 0; l < c_.num_layers; ++l) {
    if (KvKind(l) == kind) bytes += 2 * KvArrayBytes(l, blocks);
  }
  return bytes;
}

int64_t CudaBackend::KvPoolsBytes() const {
  return KvPoolBytes(kKvFull, kv_pools_[kKvFull].blocks) +
         KvPoolBytes(kKvSliding, kv_pools_[kKvSliding].blocks);
}

int64_t CudaBackend::MaxKvPoolBlocks(int kind, int64_t bytes) const {
  const int64_t block = KvPoolBlockBytes(kind);
  if (block == 0 || bytes <= 0) return 0;
  // KvPoolBytes grows with the blocks and is at least blocks · block: a binary search below the
  // unrounded count (a step down by the bytes over can skip counts that fit, where a granule is
  // freed a whole array at a time).
  int64_t lo = 0, hi = bytes / block;  // KvPoolBytes(lo) ≤ bytes
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (KvPoolBytes(kind, mid) <= bytes) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

absl::Status CudaBackend::ResizeKvPool(int kind, int64_t blocks) {
  KvBlockPool& pool = kv_pools_[kind];
  if (pool.k.empty()) {
    // The addresses, once: for the most blocks the bound (else the device's memory) holds.
    size_t free_bytes = 0, total_bytes = 0;
    DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
    // (A bound beyond the device's memory cannot be reached: no more addresses than that.)
    const int64_t most = std::max<int64_t>(
        1, MaxKvPoolBlocks(kind, kv_pool_bound_ > 0
                                     ? std::min(int64_t(kv_pool_bound_), int64_t(total_bytes))
                                     : int64_t(total_bytes)));
    std::vector<cuda::ReservedDeviceMemory> k(c_.num_layers), v(c_.num_layers);
    for (int l = 0; l < c_.num_layers; ++l) {
      if (KvKind(l) != kind) continue;
      DGSERVE_RETURN_IF_ERROR(k[l].Reserve(size_t(KvArrayBytes(l, most))));
      DGSERVE_RETURN_IF_ERROR(v[l].Reserve(size_t(KvArrayBytes(l, most))));
    }
    pool.k = std::move(k);
    pool.v = std::move(v);
  }
  // Every array, else every one back as it was.
  absl::Status st;
  int done = 0;
  for (; done < c_.num_layers && st.ok(); ++done) {
    if (KvKind(done) != kind) continue;
    st = pool.k[done].Resize(size_t(KvArrayBytes(done, blocks)));
    if (st.ok()) st = pool.v[done].Resize(size_t(KvArrayBytes(done, blocks)));
  }
  if (st.ok()) return st;
  for (int l = 0; l < done; ++l) {
    if (KvKind(l) != kind) continue;
    // (Back to fewer granules: unmapping, which does not fail for want of memory.)
    pool.k[l].Resize(size_t(KvArrayBytes(l, pool.blocks))).IgnoreError();
    pool.v[l].Resize(size_t(KvArrayBytes(l, pool.blocks))).IgnoreError();
  }
  if (st.code() == absl::StatusCode::kResourceExhausted ||
      st.code() == absl::StatusCode::kOutOfRange) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the device refused the memory (", st.message(), ")"));
  }
  return st;
}

absl::Status CudaBackend::GrowKvPool(int kind, bool half_the_room) {
  KvBlockPool& pool = kv_pools_[kind];
  const int B = options_.kv_block_size;
  int64_t blocks = std::max<int64_t>(64, 2 * int64_t(pool.blocks));
  const int64_t mine = KvPoolBytes(kind, pool.blocks);
  // (Clamped so that `mine + step` cannot overflow: 2^60 bytes is no limit on any device.)
  if (const int64_t step =
          int64_t(std::min<size_t>(options_.kv_pool_max_growth_bytes, size_t(1) << 60));
      step > 0) {
    // One growth maps at most `step` bytes (cuda_backend.h: what a mapping costs), a block at
    // least (a step below a granule of each array still maps one).
    blocks =
        std::min(blocks, std::max<int64_t>(pool.blocks + 1, MaxKvPoolBlocks(kind, mine + step)));
  }
  if (kv_pool_bound_ > 0) {
    // Both pools' bytes stay within the bound: fewer new blocks, or none.
    const int64_t most = MaxKvPoolBlocks(kind, int64_t(kv_pool_bound_) - (KvPoolsBytes() - mine));
    const int64_t room = most - pool.blocks;
    const int64_t take = half_the_room ? (room + 1) / 2 : room;
    blocks = std::min(blocks, int64_t(pool.blocks) + std::max<int64_t>(0, take));
  }
  if (blocks <= pool.blocks) {
    return absl::ResourceExhaustedError(absl::StrCat("at the bound (", kv_pool_bound_, " bytes)"));
  }
  if (blocks * B > std::numeric_limits<int32_t>::max()) {
    return absl::ResourceExhaustedError("more than 2^31 rows");
  }
  // The device's free memory (only the new memory is needed: the arrays grow in place): fewer
  // new blocks, or none, so a refused cuMemCreate is the exception. Without a bound, the pass's
  // other buffers (its activations, a block table, a staging) have no headroom set aside: a
  // growth takes at most half of the free memory, and none once that half holds less than an
  // eighth of the pool, so that the memory left free stays above an eighth of the pool (growths
  // of half of what is left would otherwise take it all, one block at a time).
  size_t free_bytes = 0, total_bytes = 0;
  DGSERVE_RETURN_IF_ERROR(CudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
  if (kv_pool_bound_ > 0) {
    blocks = std::min(blocks, MaxKvPoolBlocks(kind, int64_t(free_bytes) + mine));
  } else {
    const int64_t most = MaxKvPoolBlocks(kind, int64_t(free_bytes / 2) + mine);
    const int64_t least = pool.blocks + std::max(1, pool.blocks / 8);
    blocks = most >= least ? std::min(blocks, most) : pool.blocks;
  }
  if (blocks <= pool.blocks) {
    return absl::ResourceExhaustedError(absl::StrCat("the device has ", free_bytes, " bytes free"));
  }
  // Queued work keeps reading and writing the blocks it names: their addresses do not move.
  DGSERVE_RETURN_IF_ERROR(ResizeKvPool(kind, blocks));
  ++kv_growths_;
  // Popped from the back: the lowest new id first.
  for (int64_t b = blocks - 1; b >= pool.blocks; --b) pool.free_ids.push_back(int32_t(b));
  pool.blocks = int(blocks);
  pool.Resize(pool.blocks);
  return absl::OkStatus();
}

absl::StatusOr<int32_t> CudaBackend::AllocateKvBlock(int kind) {
  KvBlockPool& pool = kv_pools_[kind];
  // A free block, else a cached one (KvBlockPool::Take).
  int32_t b = pool.Take();
  if (b >= 0) return b;
  absl::Status grown = GrowKvPool(kind);
  // Other errors (a failed wait, a device fault) are not for eviction to hide.
  if (!grown.ok() && grown.code() != absl::StatusCode::kResourceExhausted) return grown;
  if ((b = pool.Take()) >= 0) return b;
  // Where the bound refuses: the memory of the other kind's blocks no sequence holds (the two
  // pools share one bound, and whichever grew first may hold most of it: a long sequence after
  // many short ones), a copy on the device, before idle sequences' blocks are taken (their rows
  // would come back over the host link at their next pass).
  // This pool grows into half of it, so that the other grows into the rest without compacting
  // this one at its next block (the two would otherwise take turns at every block).
  const auto from_other_pool = [&]() -> absl::StatusOr<int32_t> {
    // Only under a bound (the pools stay within it, whichever refused the growth): without one,
    // memory a compaction gives back is the device's, which the pass's other buffers may need as
    // much (the pools' doubling would take it all).
    if (kv_pool_bound_ == 0) return -1;
    const int64_t room = int64_t(kv_pool_bound_) - KvPoolsBytes();
    const KvBlockPool& other = kv_pools_[1 - kind];
    const int64_t free_ids = int64_t(other.free_ids.size()), cached = int64_t(other.cached.size());
    if (free_ids + cached == 0) return -1;
    // Worth it only if a block of this kind then fits. In mapped bytes: giving back fewer blocks
    // than fill a granule of each array gives back nothing.
    const int64_t other_now = KvPoolBytes(1 - kind, other.blocks);
    // What the other pool gives back with its free blocks and its `drop` least recently
    // released cached ones.
    const auto give = [&](int64_t drop) {
      return other_now - KvPoolBytes(1 - kind, other.blocks - free_ids - drop);
    };
    const auto grow_by = [&](int64_t blocks) {
      return KvPoolBytes(kind, pool.blocks + blocks) - KvPoolBytes(kind, pool.blocks);
    };
    if (room + give(cached) < grow_by(1)) return -1;
    // The room for an eighth of this pool (a block at least; each compaction drains the stream,
    // so not one per block), or all there is: the other pool's free blocks, then as few of its
    // cached ones as that takes, least recently released first (a later prefix hit needs both
    // kinds' blocks, and dropped ones upload their rows again).
    const int64_t want = std::min(room + give(cached), grow_by(std::max(1, pool.blocks / 8)));
    int64_t drop = 0, most = cached;  // the fewest with room + give(drop) ≥ want
    while (drop < most) {
      const int64_t mid = drop + (most - drop) / 2;
      if (room + give(mid) >= want) {
        most = mid;
      } else {
        drop = mid + 1;
      }
    }
    const absl::StatusOr<int> given = CompactKvPool(1 - kind, int(drop));
    // The device refusing the moves' or a table's small allocation: on to the idle sequences'
    // blocks.
    if (!given.ok() && given.status().code() == absl::StatusCode::kResourceExhausted) return -1;
    if (!given.ok()) return given.status();
    if (*given == 0) return -1;
    grown = GrowKvPool(kind, /*half_the_room=*/true);
    if (!grown.ok() && grown.code() != absl::StatusCode::kResourceExhausted) return grown;
    return pool.Take();
  };
  DGSERVE_ASSIGN_OR_RETURN(b, from_other_pool());
  // Then the blocks of idle sequences' mirrors, least recently used first (their rows are on the
  // host: a later pass uploads them again), then those of idle sequences whose rows only the
  // device has, once copied to their caches; the other pool again (they held blocks of both).
  while (b < 0 && (b = pool.Take()) < 0) {
    if (EvictOneMirror()) continue;
    DGSERVE_ASSIGN_OR_RETURN(const bool swapped, SwapOutOneMirror(kind));
    if (!swapped) break;
  }
  if (b < 0) {
    DGSERVE_ASSIGN_OR_RETURN(b, from_other_pool());
  }
  if (b < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("device K/V block pool full (", kind == kKvFull ? "full" : "sliding",
                     " layers): ", pool.blocks, " blocks of ", options_.kv_block_size,
                     " positions, every one held by a sequence in this pass (",
                     kv_pool_bound_ > 0 ? absl::StrCat("bound ", kv_pool_bound_, " bytes")
                                        : std::string("no bound"),
                     "; ", grown.message(), ")"));
  }
  return b;
}

absl::StatusOr<int> CudaBackend::CompactKvPool(int kind, int drop_cached) {
  KvBlockPool& pool = kv_pools_[kind];
  // The least recently released first (their rows are on the host: uploaded again).
  for (; drop_cached > 0 && !pool.cached.empty(); --drop_cached) {
    const int32_t b = pool.cached.begin()->second;
    pool.cached.erase(pool.cached.begin());
    pool.Unregister(b);
    pool.free_ids.push_back(b);
  }
  // Kept: held blocks and (unless dropped) cached ones, which are registered with no reference.
  const auto kept = [&](int32_t b) { return pool.refs[b] > 0 || !pool.signature[b].empty(); };
  const int count = pool.blocks - int(pool.free_ids.size());
  if (count >= pool.blocks) return 0;
  // As many kept ids at or past `count` as free ids below it: each moves to one of those.
  std::vector<int32_t> below;
  for (const int32_t b : pool.free_ids) {
    if (b < count) below.push_back(b);
  }
  std::vector<std::pair<int32_t, int32_t>> moves;  // (from, to)
  for (int32_t b = count; b < pool.blocks; ++b) {
    if (!kept(b)) continue;
    if (below.empty()) return absl::InternalError("K/V block pool compaction: reference counts");
    moves.emplace_back(b, below.back());
    below.pop_back();
  }
  // The moved blocks' rows copied in place (the sources are past `count`, the destinations
  // below), then, the stream drained (queued work may still read or write any block past
  // `count`), the memory past `count` blocks unmapped.
  if (!moves.empty()) {
    std::vector<int32_t> pairs;
    for (const auto& [src, dst] : moves) {
      pairs.push_back(src);
      pairs.push_back(dst);
    }
    DGSERVE_RETURN_IF_ERROR(kv_moves_.UploadAsync(pairs.data(), pairs.size(), stream_));
    for (int l = 0; l < c_.num_layers; ++l) {
      if (KvKind(l) != kind) continue;
      const int64_t per_block = int64_t(options_.kv_block_size) * c_.KvHeads(l) * c_.HeadDim(l);
      for (const cuda::ReservedDeviceMemory* a : {&pool.k[l], &pool.v[l]}) {
        if (Bf16Mirror(l)) {
          auto* p = static_cast<uint16_t*>(a->get());
          DGSERVE_RETURN_IF_ERROR(
              cuda::CopyPoolBlocks(p, p, kv_moves_.get(), int(moves.size()), per_block, stream_));
        } else {
          auto* p = static_cast<float*>(a->get());
          DGSERVE_RETURN_IF_ERROR(
              cuda::CopyPoolBlocks(p, p, kv_moves_.get(), int(moves.size()), per_block, stream_));
        }
      }
    }
  }
  DGSERVE_RETURN_IF_ERROR(Wait("KV block pool compaction"));
  DGSERVE_RETURN_IF_ERROR(ResizeKvPool(kind, count));
  std::vector<int32_t> to(pool.blocks, -1);
  for (const auto& [src, dst] : moves) {
    to[src] = dst;
    pool.refs[dst] = pool.refs[src];
    pool.refs[src] = 0;
    if (pool.refs[dst] == 0) {  // cached: it keeps its place in the release order
      pool.cached.erase({pool.released_at[src], src});
      pool.cached.insert({pool.released_at[src], dst});
      pool.released_at[dst] = pool.released_at[src];
    }
    if (!pool.signature[src].empty()) {  // registered: the registry names the new id
      pool.registry[{pool.signature[src].back(), pool.index_of[src]}] = dst;
      pool.signature[dst] = std::move(pool.signature[src]);
      pool.signature[src].clear();
      pool.index_of[dst] = pool.index_of[src];
    }
  }
  // Every table naming a moved block, uploaded now: a mirror of the current pass may have had
  // its table uploaded already.
  for (auto& [kv, m] : mirrors_) {
    bool changed = false;
    for (int32_t& b : m->blocks[kind]) {
      if (b >= 0 && to[b] >= 0) {
        b = to[b];
        changed = true;
      }
    }
    if (!changed) continue;
    // Grown where it is shorter than the blocks (a mirror inside SyncKvBlocks, or one whose
    // SyncKvBlocks failed after growing its blocks): the whole table is written here. The stream
    // is drained (no queued copy reads the old table).
    if (m->tables[kind].size() < m->blocks[kind].size()) {
      DGSERVE_RETURN_IF_ERROR(m->tables[kind].Grow(m->blocks[kind].size(), 0));
    }
    DGSERVE_RETURN_IF_ERROR(
        m->tables[kind].UploadAsync(m->blocks[kind].data(), m->blocks[kind].size(), stream_));
  }
  const int given = pool.blocks - count;
  pool.free_ids.clear();
  pool.blocks = count;
  pool.Resize(count);
  ++kv_compactions_;
  kv_blocks_moved_ += int64_t(moves.size());
  return given;
}

CudaBackend::KvPassBlocks CudaBackend::LargestKvPass(const KvCache& like,
                                                     const KvPassPlan& plan) const {
  KvPassBlocks worst;
  if (!PagedKv() || plan.positions <= 0) return worst;
  const int64_t B = options_.kv_block_size;
  const bool has[2] = {KvPoolBlockBytes(kKvFull) > 0, KvPoolBlockBytes(kKvSliding) > 0};
  // As SyncMirror marks a mirror of `like` and SyncKvBlocks holds its blocks for a pass from n
  // to `need` positions: full layers every position's block; sliding layers those of
  // [SlidingKeepFrom, n) (the window, and the rows the host keeps and lacks) and of the new rows
  // they keep.
  const bool deferred = options_.defer_kv_host_copy && options_.sliding_kv_ring &&
                        like.MaxSlidingRowsKept() < std::numeric_limits<int>::max();
  const auto blocks_from = [&](int64_t from, int64_t to) {  // block indices [from / B, ⌈to / B⌉)
    return from < to ? (to + B - 1) / B - from / B : int64_t{0};
  };
  const auto pass = [&](int64_t n, int64_t need) {
    const int64_t full = has[kKvFull] ? (need + B - 1) / B : 0;
    int64_t sliding = 0;
    if (has[kKvSliding]) {
      const int lacks = deferred && plan.first < n ? int(plan.first) : int(n);
      const int64_t keep = SlidingKeepFrom(like, int(n), lacks);
      const int64_t write =
          need > n ? std::max<int64_t>(
                         n, SlidingKeepFrom(like, int(need), deferred ? int(n) : int(need)))
                   : need;
      // The two ranges' blocks, a block they share counted once.
      const int64_t shared = std::max<int64_t>(
          0, std::min((n + B - 1) / B, (need + B - 1) / B) - std::max(keep / B, write / B));
      sliding =
          blocks_from(keep, n) + blocks_from(write, need) - (keep < n && write < need ? shared : 0);
    }
    // As mapped: each array rounded up to the allocation granularity.
    const int64_t bytes = KvPoolBytes(kKvFull, full) + KvPoolBytes(kKvSliding, sliding);
    if (bytes > worst.bytes) worst = {bytes, full, sliding, n};
  };
  const int64_t first = std::clamp<int64_t>(plan.first, 0, plan.positions);
  for (int64_t n = first; n < plan.positions;) {
    const int64_t need =
        plan.pass_tokens > 0 ? std::min(plan.positions, n + plan.pass_tokens) : plan.positions;
    pass(n, need);
    n = need;
  }
  pass(plan.positions, plan.positions);  // the decoder passes over all of them
  return worst;
}

absl::Status CudaBackend::CheckKvFits(const KvCache& like, const KvPassPlan& plan) const {
  if (!PagedKv() || kv_pool_bound_ == 0 || plan.positions <= 0) {
    return absl::OkStatus();
  }
  const KvPassBlocks worst = LargestKvPass(like, plan);
  if (worst.bytes <= int64_t(kv_pool_bound_)) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat(
      "a sequence of ", plan.positions, " positions needs ", worst.bytes,
      " bytes of device K/V blocks in its pass from position ", worst.from, " (", worst.full,
      " full-attention and ", worst.sliding, " sliding-window blocks of ", options_.kv_block_size,
      " positions); the device K/V pool's bound is ", kv_pool_bound_,
      " bytes (--cuda_kv_pool_gb, else --cuda_memory_utilization's share of the device)"));
}

absl::Status CudaBackend::CheckKvFitsTogether(std::span<const KvSequencePlan> seqs) const {
  if (!PagedKv() || kv_pool_bound_ == 0) return absl::OkStatus();
  const int64_t B = options_.kv_block_size;
  int64_t full = 0, sliding = 0;
  for (const KvSequencePlan& s : seqs) {
    if (s.like == nullptr) return absl::InvalidArgumentError("CheckKvFitsTogether: no cache");
    const KvPassBlocks worst = LargestKvPass(*s.like, s.plan);
    // A fork's whole full-attention blocks of the rows it shares are the other sequence's
    // (TakeSharedKvBlocks); its sliding blocks are counted (the window is usually past them).
    const int64_t shared =
        options_.share_kv_blocks && worst.full > 0 ? std::max<int64_t>(0, s.shared_rows) / B : 0;
    full += std::max<int64_t>(0, worst.full - shared);
    sliding += worst.sliding;
  }
  const int64_t bytes = KvPoolBytes(kKvFull, full) + KvPoolBytes(kKvSliding, sliding);
  if (bytes <= int64_t(kv_pool_bound_)) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat(seqs.size(), " sequences at their largest passes need ", bytes,
                   " bytes of device K/V blocks at once (", full, " full-attention and ", sliding,
                   " sliding-window blocks of ", B, " positions); the device K/V pool's bound is ",
                   kv_pool_bound_, " bytes"));
}

}  // namespace cuda_internal
}  // namespace dgserve
