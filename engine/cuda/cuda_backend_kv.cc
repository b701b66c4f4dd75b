// The CUDA backend's device K/V mirrors (cuda_backend.h, "KV cache"): SyncMirror finds or makes
// a cache's mirror and uploads the rows it lacks; SyncKvToHost copies the rows the encoder passes
// left on the device only (CudaBackendOptions::defer_kv_host_copy) into the host cache.
#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "engine/cuda/cuda_backend_internal.h"

namespace dgserve {
namespace cuda_internal {

namespace {
// Whether two weak_ptrs come from the same shared_ptr (also once it has expired).
bool SameLifetime(const std::weak_ptr<const void>& a, const std::weak_ptr<const void>& b) {
  return !a.owner_before(b) && !b.owner_before(a);
}
}  // namespace

template <typename Pred>
CudaBackend::MirrorMap::iterator CudaBackend::LeastRecentlyUsedIdleMirror(Pred pred) {
  auto lru = mirrors_.end();
  for (auto j = mirrors_.begin(); j != mirrors_.end(); ++j) {
    const KvMirror& c = *j->second;
    if (c.last_use >= pass_start_ || !pred(j->first, c)) continue;
    if (lru == mirrors_.end() || c.last_use < lru->second->last_use) lru = j;
  }
  return lru;
}

bool CudaBackend::EvictOneMirror() {
  // Never one holding rows its live cache lacks (the only copy). A mirror whose cache is gone
  // goes first.
  auto lru = LeastRecentlyUsedIdleMirror(
      [](const KvCache*, const KvMirror& c) { return c.owner.expired(); });
  if (lru == mirrors_.end()) {
    lru =
        LeastRecentlyUsedIdleMirror([](const KvCache*, const KvMirror& c) { return !c.pending(); });
  }
  if (lru == mirrors_.end()) return false;
  mirrors_.erase(lru);
  return true;
}

void CudaBackend::BeginPass(const std::vector<const KvCache*>& caches) {
  pass_start_ = use_clock_ + 1;
  if (PagedKv()) {
    for (auto j = mirrors_.begin(); j != mirrors_.end();) {
      j = j->second->owner.expired() ? mirrors_.erase(j) : std::next(j);
    }
  }
  for (const KvCache* kv : caches) {
    const auto it = mirrors_.find(kv);
    if (it != mirrors_.end() && SameLifetime(it->second->owner, kv->lifetime())) {
      it->second->last_use = ++use_clock_;
    }
  }
}

absl::StatusOr<KvMirror*> CudaBackend::SyncMirror(const KvCache& kv, int extra) {
  auto it = mirrors_.find(&kv);
  // A mirror under this address made for a cache destroyed since (another cache now lives at the
  // same address): its rows, and any its host arrays lacked, belonged to that cache.
  if (it != mirrors_.end() && !SameLifetime(it->second->owner, kv.lifetime())) {
    if (it->second->last_use >= pass_start_) {
      return absl::InternalError("two KV caches of one pass at the same address");
    }
    mirrors_.erase(it);
    it = mirrors_.end();
  }
  if (it == mirrors_.end()) {
    // A new mirror starts from the host rows: they must be current.
    DGSERVE_RETURN_IF_ERROR(CheckHostRowsCurrent(kv, "CUDA backend (a cache it did not write)"));
    // With none evictable the map grows past the limit.
    if (int(mirrors_.size()) >= std::max(1, options_.max_kv_mirrors)) EvictOneMirror();
    auto m = std::make_unique<KvMirror>();
    m->ring.assign(c_.num_layers, 0);
    if (PagedKv()) {
      m->pools = kv_pools_;
    } else {
      m->k.resize(c_.num_layers);
      m->v.resize(c_.num_layers);
      m->k16.resize(c_.num_layers);
      m->v16.resize(c_.num_layers);
    }
    m->owner = kv.lifetime();
    // Deferred only where the cache bounds what its sliding layers keep: the ring then holds all
    // of it, so SyncKvToHost finds every row the host keeps.
    const int kept = kv.MaxSlidingRowsKept();
    m->deferred = options_.defer_kv_host_copy && options_.sliding_kv_ring &&
                  kept < std::numeric_limits<int>::max();
    m->sliding_rows = m->deferred ? std::max(c_.sliding_window, kept) : c_.sliding_window;
    it = mirrors_.emplace(&kv, std::move(m)).first;
  }
  KvMirror* m = it->second.get();
  m->last_use = ++use_clock_;
  const int n = kv.num_tokens();
  if (m->synced > n) {
    // A cache never shrinks; a mirror ahead of its cache cannot be trusted.
    if (m->pending()) return absl::InternalError("KV cache shorter than its device rows");
    m->synced = m->host_synced = 0;
    m->ReleaseBlocks();
  }
  const int need = n + extra;
  if (m->paged()) {
    DGSERVE_RETURN_IF_ERROR(SyncKvBlocks(kv, m, n, extra));
  } else if (need > m->capacity) {
    const int cap = std::max(need, std::max(64, m->capacity * 2));
    for (int l = 0; l < c_.num_layers; ++l) {
      const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
      // A sliding ring shorter than its bound has not wrapped (capacity > every position): its
      // rows stay.
      const int rows = MirrorRows(l, cap, m->sliding_rows),
                old_rows = MirrorRows(l, m->capacity, m->sliding_rows);
      const size_t keep = size_t(std::min(m->synced, old_rows)) * w;
      if (Bf16Mirror(l)) {
        DGSERVE_RETURN_IF_ERROR(m->k16[l].Grow(size_t(rows) * w, keep));
        DGSERVE_RETURN_IF_ERROR(m->v16[l].Grow(size_t(rows) * w, keep));
      } else {
        DGSERVE_RETURN_IF_ERROR(m->k[l].Grow(size_t(rows) * w, keep));
        DGSERVE_RETURN_IF_ERROR(m->v[l].Grow(size_t(rows) * w, keep));
      }
      m->ring[l] = MirrorRing(l, cap, m->sliding_rows);
    }
    m->capacity = cap;
  }
  if (m->synced < n) {
    // Rows another writer added to the cache (its host rows: this backend's own are on the
    // device, and a cache with rows on the device is refused by every other writer).
    if (m->pending()) {
      return absl::InternalError(
          "KV cache grew elsewhere while its newest rows were on the device");
    }
    // The new rows come from the host arrays: refused while another backend holds them.
    DGSERVE_RETURN_IF_ERROR(
        CheckHostRowsCurrent(kv, "CUDA backend (rows another backend holds on its device)"));
    for (int l = 0; l < c_.num_layers; ++l) {
      // Sliding layers only guarantee (and only read) the last W−1 committed rows.
      const int lo = c_.IsFull(l) ? 0 : SlidingUploadFrom(n);
      const int from = std::max(m->synced, lo);
      if (from >= n) continue;
      const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
      if (m->paged()) {
        // Around registered blocks: those taken from other mirrors (TakeSharedKvBlocks, in this
        // sync or in a failed one before: the mirror keeps them), whose rows are the cache's
        // and which others may hold. The mirror's own registered blocks lie below `synced`.
        const int B = options_.kv_block_size;
        const std::vector<int32_t>& table = m->blocks[KvKind(l)];
        const KvBlockPool& pool = kv_pools_[KvKind(l)];
        const auto registered = [&](int p) {
          const int32_t b = p / B < int(table.size()) ? table[p / B] : -1;
          return b >= 0 && !pool.signature[b].empty();
        };
        for (int p = from; p < n;) {
          if (registered(p)) {
            p = (p / B + 1) * B;
            continue;
          }
          int q = std::min(n, (p / B + 1) * B);
          while (q < n && !registered(q)) q = std::min(n, q + B);
          DGSERVE_RETURN_IF_ERROR(UploadKvRows(kv, *m, l, p, q - p));
          p = q;
        }
        continue;
      }
      for (int which = 0; which < 2; ++which) {
        // Per run of consecutive mirror rows (a sliding layer's ring wraps once at most).
        DGSERVE_RETURN_IF_ERROR(m->ForEachRun(l, from, n - from, [&](int p0, int row, int count) {
          host_stage_.resize(size_t(count) * w);
          for (int p = p0; p < p0 + count; ++p) {
            const float* src = which == 0 ? kv.KeyRow(l, p) : kv.ValueRow(l, p);
            std::memcpy(&host_stage_[size_t(p - p0) * w], src, w * sizeof(float));
          }
          const void* data = host_stage_.data();
          size_t bytes = host_stage_.size() * sizeof(float);
          void* dst;
          if (Bf16Mirror(l)) {
            // Rounded here (FloatToBf16: the device's ToBf16Bits bit for bit): half the bytes.
            host_stage16_.resize(host_stage_.size());
            for (size_t i = 0; i < host_stage_.size(); ++i) {
              host_stage16_[i] = FloatToBf16(host_stage_[i]);
            }
            data = host_stage16_.data();
            bytes = host_stage16_.size() * sizeof(uint16_t);
            dst = (which == 0 ? m->k16[l] : m->v16[l]).get() + size_t(row) * w;
          } else {
            dst = (which == 0 ? m->k[l] : m->v[l]).get() + size_t(row) * w;
          }
          // On stream_ (ordered before the pass's kernels); from pageable memory CUDA stages the
          // rows before returning, so the host staging is free again at once.
          cuda::NoteUpload();
          kv_copy_stats_.upload_bytes += int64_t(bytes);
          return CudaCheck(cudaMemcpyAsync(dst, data, bytes, cudaMemcpyHostToDevice, stream_),
                           "cudaMemcpyAsync (KV upload)");
        }));
      }
    }
    // The sliding rows before the window were not uploaded (a gap when the mirror lacked them).
    if (SlidingUploadFrom(n) > m->synced) m->sliding_from = SlidingUploadFrom(n);
    m->synced = m->host_synced = n;
  }
  PublishKvBlocks(kv, m);
  return m;
}

absl::Status CudaBackend::SyncKvToHost(KvCache& kv) {
  const auto lock = Lock();
  const auto it = mirrors_.find(&kv);
  if (it == mirrors_.end() || !SameLifetime(it->second->owner, kv.lifetime())) {
    return CheckHostRowsCurrent(kv, "SyncKvToHost (a cache this CUDA backend does not hold)");
  }
  return SyncMirrorToHost(kv, it->second.get());
}

absl::Status CudaBackend::SyncMirrorToHost(KvCache& kv, KvMirror* m) {
  const int n = m->synced;
  if (!m->pending()) {
    // Nothing of this backend's is missing; newer rows (another backend's) are not ours to
    // vouch for.
    if (kv.num_tokens() != n) return CheckHostRowsCurrent(kv, "SyncKvToHost");
    kv.set_host_rows_stale(false);
    return absl::OkStatus();
  }
  if (kv.num_tokens() != n) return absl::InternalError("KV cache and its device rows disagree");
  // Each layer's K and V rows the host keeps and lacks, downloaded through the pinned staging
  // (bf16 bits or float32, as the mirror stores them) and written into the cache once the copies
  // are done: one wait per fill of the staging.
  struct Part {
    int layer, which, p0, count;
    size_t offset;  // bytes into the staging
  };
  std::vector<Part> parts;
  size_t used = 0;
  const auto scatter = [&]() -> absl::Status {
    if (parts.empty()) return absl::OkStatus();
    DGSERVE_RETURN_IF_ERROR(Wait("SyncKvToHost"));
    const auto* base = reinterpret_cast<const unsigned char*>(kv_stage_.data());
    for (const Part& part : parts) {
      const int l = part.layer;
      const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
      // Rows on the host's threads (a 32k prompt's 0.88 GB of bf16 widen to 1.76 GB): each row
      // is written once, and finding it (Mutable*Row) only reads the cache.
#pragma omp parallel for schedule(static) if (size_t(part.count) * w >= (size_t{1} << 16))
      for (int i = 0; i < part.count; ++i) {
        const int p = part.p0 + i;
        float* dst = part.which == 0 ? kv.MutableKeyRow(l, p) : kv.MutableValueRow(l, p);
        if (Bf16Mirror(l)) {
          const auto* src = reinterpret_cast<const uint16_t*>(base + part.offset) + size_t(i) * w;
          for (size_t e = 0; e < w; ++e) dst[e] = Bf16ToFloat(src[e]);
        } else {
          const auto* src = reinterpret_cast<const float*>(base + part.offset) + size_t(i) * w;
          std::memcpy(dst, src, w * sizeof(float));
        }
      }
    }
    parts.clear();
    used = 0;
    return absl::OkStatus();
  };
  // The staging: a layer's K and V rows at least, all of them if encode_staging_bytes allows.
  size_t all = 0, one = 0;
  const auto first_row = [&](int l) {
    return c_.IsFull(l) ? m->host_synced : std::max(m->host_synced, kv.SlidingRetainedFrom(n));
  };
  for (int l = 0; l < c_.num_layers; ++l) {
    const size_t elem = Bf16Mirror(l) ? sizeof(uint16_t) : sizeof(float);
    const size_t bytes =
        2 * size_t(std::max(0, n - first_row(l))) * c_.KvHeads(l) * c_.HeadDim(l) * elem + 64;
    all += bytes;
    one = std::max(one, bytes);
  }
  DGSERVE_RETURN_IF_ERROR(kv_stage_.Ensure(
      (std::max(one, std::min(all, options_.encode_staging_bytes)) + sizeof(float) - 1) /
      sizeof(float)));
  // No more than this sync needs (the pinned staging may be larger from an earlier one): a
  // swap-out runs when the device is short of memory, and the device staging is as large.
  const size_t capacity = std::min(kv_stage_.size() * sizeof(float), std::max(one, all));
  // A paged mirror's rows are gathered into a device staging as large (Grow: no CUDA graph
  // holds it).
  if (m->paged()) DGSERVE_RETURN_IF_ERROR(GrowKvRowsStaging(capacity));
  for (int l = 0; l < c_.num_layers; ++l) {
    const int lo = first_row(l);
    if (lo >= n) continue;
    const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
    const size_t elem = Bf16Mirror(l) ? sizeof(uint16_t) : sizeof(float);
    // Each part starts 16-byte aligned (at most four runs a layer: 64 bytes of padding).
    if (used + 2 * size_t(n - lo) * w * elem + 64 > capacity) DGSERVE_RETURN_IF_ERROR(scatter());
    for (int which = 0; which < 2; ++which) {
      if (m->paged()) {
        // Gathered from the blocks into the device staging (at the same offset as the host
        // staging's), then one copy.
        const size_t bytes = size_t(n - lo) * w * elem;
        unsigned char* dev = kv_rows_dev_.get() + used;
        const int32_t* table = m->tables[KvKind(l)].get();
        const int B = options_.kv_block_size;
        const float* pool = which == 0 ? PoolK(l) : PoolV(l);
        DGSERVE_RETURN_IF_ERROR(m->CheckHeld(KvKind(l), B, lo, n - lo, "SyncKvToHost"));
        DGSERVE_RETURN_IF_ERROR(
            Bf16Mirror(l)
                ? cuda::CopyRowsFromBlocks(reinterpret_cast<const uint16_t*>(pool), n - lo, int(w),
                                           table, B, lo, reinterpret_cast<uint16_t*>(dev), stream_)
                : cuda::CopyRowsFromBlocks(pool, n - lo, int(w), table, B, lo,
                                           reinterpret_cast<float*>(dev), stream_));
        parts.push_back({l, which, lo, n - lo, used});
        unsigned char* dst = reinterpret_cast<unsigned char*>(kv_stage_.data()) + used;
        used = (used + bytes + 15) / 16 * 16;
        kv_copy_stats_.sync_to_host_bytes += int64_t(bytes);
        cuda::NoteDeviceCopy();
        DGSERVE_RETURN_IF_ERROR(
            CudaCheck(cudaMemcpyAsync(dst, dev, bytes, cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync (K/V to the host)"));
        continue;
      }
      DGSERVE_RETURN_IF_ERROR(m->ForEachRun(l, lo, n - lo, [&](int p0, int row, int count) {
        const size_t bytes = size_t(count) * w * elem;
        const void* src =
            Bf16Mirror(l)
                ? static_cast<const void*>((which == 0 ? m->k16[l] : m->v16[l]).get() + row * w)
                : static_cast<const void*>((which == 0 ? m->k[l] : m->v[l]).get() + row * w);
        unsigned char* dst = reinterpret_cast<unsigned char*>(kv_stage_.data()) + used;
        parts.push_back({l, which, p0, count, used});
        used = (used + bytes + 15) / 16 * 16;
        kv_copy_stats_.sync_to_host_bytes += int64_t(bytes);
        cuda::NoteDeviceCopy();
        return CudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_),
                         "cudaMemcpyAsync (K/V to the host)");
      }));
    }
  }
  DGSERVE_RETURN_IF_ERROR(scatter());
  m->host_synced = n;
  kv.set_host_rows_stale(false);
  // The host has its rows now: a paged mirror keeps only the window.
  if (m->paged()) ReleaseSlidingKvBlocks(kv, m, n);
  return absl::OkStatus();
}

int CudaBackend::SlidingKeepFrom(const KvCache& kv, int n, int host_lacks_from) const {
  const int W = c_.sliding_window;
  if (W <= 0 || !options_.sliding_kv_ring) return 0;
  return std::min(SlidingUploadFrom(n), std::max(kv.SlidingRetainedFrom(n), host_lacks_from));
}

float* CudaBackend::PoolK(int l) const {
  const KvBlockPool& p = kv_pools_[KvKind(l)];
  if (p.blocks == 0) return nullptr;         // never grown: nothing to read (no context)
  return static_cast<float*>(p.k[l].get());  // (bf16 rows where Bf16Mirror(l))
}

float* CudaBackend::PoolV(int l) const {
  const KvBlockPool& p = kv_pools_[KvKind(l)];
  if (p.blocks == 0) return nullptr;
  return static_cast<float*>(p.v[l].get());
}

int CudaBackend::ReleaseSlidingKvBlocks(const KvCache& kv, KvMirror* m, int n) {
  const int keep = SlidingKeepFrom(kv, n, m->pending() ? m->host_synced : n);
  std::vector<int32_t>& table = m->blocks[kKvSliding];
  const int B = options_.kv_block_size;
  for (int i = 0; i < std::min(keep / B, int(table.size())); ++i) {
    if (table[i] < 0) continue;
    kv_pools_[kKvSliding].Unref(table[i]);
    table[i] = -1;
    m->tables_dirty = true;  // uploaded before the next pass (no kernel reads the entry)
  }
  return keep;
}

absl::StatusOr<bool> CudaBackend::SwapOutOneMirror(int kind) {
  // The least recently used mirror not used by the current pass whose live cache lacks rows only
  // it has (and whose cache has committed no rows beyond them), and which alone holds a block of
  // `kind` (else dropping it frees none: the copy would be for nothing).
  const auto frees = [&](const KvMirror& c) {
    return std::any_of(c.blocks[kind].begin(), c.blocks[kind].end(),
                       [&](int32_t b) { return b >= 0 && kv_pools_[kind].refs[b] == 1; });
  };
  const auto lru = LeastRecentlyUsedIdleMirror([&](const KvCache* kv, const KvMirror& c) {
    return c.pending() && !c.owner.expired() && c.paged() && kv->num_tokens() == c.synced &&
           frees(c);
  });
  if (lru == mirrors_.end()) return false;
  // The cache is not in this call, but its owner may not use it until it is synced (only this
  // backend may: KvCache::host_rows_stale), so writing its host rows here is this backend's.
  DGSERVE_RETURN_IF_ERROR(SyncMirrorToHost(const_cast<KvCache&>(*lru->first), lru->second.get()));
  mirrors_.erase(lru);
  ++kv_swap_outs_;
  return true;
}

bool CudaBackend::KvBlockSignature(const KvCache& kv, int kind, int i,
                                   std::vector<uint64_t>* sig) const {
  const int B = options_.kv_block_size;
  sig->resize(B);
  for (int r = 0; r < B; ++r) {
    (*sig)[r] = kv.SharedRowsId(kind == kKvFull, i * B + r);
    if ((*sig)[r] == 0) return false;
  }
  return true;
}

void CudaBackend::TakeSharedKvBlocks(const KvCache& kv, KvMirror* m, int kind, int from, int n) {
  KvBlockPool& pool = kv_pools_[kind];
  if (pool.registry.empty()) return;
  const int B = options_.kv_block_size;
  std::vector<uint64_t> sig;
  for (int i = from / B; (i + 1) * B <= n; ++i) {
    if (m->blocks[kind][i] >= 0) continue;
    // The last position's identity first: most blocks (a cache nobody shares) stop here.
    const uint64_t last = kv.SharedRowsId(kind == kKvFull, (i + 1) * B - 1);
    if (last == 0 || !pool.registry.contains({last, i})) continue;
    if (!KvBlockSignature(kv, kind, i, &sig)) continue;
    const int32_t b = pool.Find(i, sig);
    if (b < 0) continue;
    pool.Ref(b);
    m->blocks[kind][i] = b;
    m->tables_dirty = true;
    ++pool.shared_blocks_taken;
  }
}

void CudaBackend::PublishKvBlocks(const KvCache& kv, KvMirror* m) {
  if (!m->paged() || !options_.share_kv_blocks) return;
  const int B = options_.kv_block_size;
  std::vector<uint64_t> sig;
  for (int kind = 0; kind < 2; ++kind) {
    KvBlockPool& pool = kv_pools_[kind];
    const std::vector<int32_t>& table = m->blocks[kind];
    const int whole = std::min(m->synced / B, int(table.size()));
    for (int i = m->published[kind]; i < whole; ++i) {
      const int32_t b = table[i];
      // Held, not registered yet, every row written (a sliding layer's rows from sliding_from).
      if (b < 0 || !pool.signature[b].empty()) continue;
      if (kind == kKvSliding && i * B < m->sliding_from) continue;
      if (KvBlockSignature(kv, kind, i, &sig)) pool.Register(b, i, std::move(sig));
    }
    m->published[kind] = std::max(m->published[kind], whole);
  }
}

absl::Status CudaBackend::SyncKvBlocks(const KvCache& kv, KvMirror* m, int n, int extra) {
  const int B = options_.kv_block_size, need = n + extra;
  const int blocks = (need + B - 1) / B;
  const bool has[2] = {KvPoolBlockBytes(kKvFull) > 0, KvPoolBlockBytes(kKvSliding) > 0};
  // Block index ranges to hold, per kind.
  const auto hold = [&](int kind, int from, int to) -> absl::Status {
    std::vector<int32_t>& table = m->blocks[kind];
    for (int i = std::max(0, from / B); i < (to + B - 1) / B; ++i) {
      if (table[i] >= 0) continue;
      DGSERVE_ASSIGN_OR_RETURN(table[i], AllocateKvBlock(kind));
      m->tables_dirty = true;
    }
    return absl::OkStatus();
  };
  for (int kind = 0; kind < 2; ++kind) {
    if (!has[kind]) continue;
    if (int(m->blocks[kind].size()) < blocks) {
      m->blocks[kind].resize(blocks, -1);
      m->tables_dirty = true;
    }
  }
  // Whole blocks of rows SyncMirror would upload: taken from another mirror, or the cache, where
  // registered, both kinds before any block is allocated (an allocation may take a cached block,
  // and one at the bound may compact the other pool, dropping its least recently released cached
  // blocks). The sliding blocks taken lie in the window, at or past the blocks released below.
  const bool share = options_.share_kv_blocks && m->synced < n;
  if (share && has[kKvFull]) TakeSharedKvBlocks(kv, m, kKvFull, m->synced, n);
  if (share && has[kKvSliding]) {
    TakeSharedKvBlocks(kv, m, kKvSliding, std::max(m->synced, SlidingUploadFrom(n)), n);
  }
  if (has[kKvFull]) DGSERVE_RETURN_IF_ERROR(hold(kKvFull, 0, need));
  if (has[kKvSliding]) {
    // Behind the window this pass reads (and the rows the host still lacks): back to the pool.
    const int keep = ReleaseSlidingKvBlocks(kv, m, n);
    DGSERVE_RETURN_IF_ERROR(hold(kKvSliding, keep, n));
    // The new rows a later pass or the host reads (the encoder writes only those).
    DGSERVE_RETURN_IF_ERROR(hold(kKvSliding, SlidingWriteFrom(kv, *m, n, need), need));
  }
  if (!m->tables_dirty) return absl::OkStatus();
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<int32_t>& table = m->blocks[kind];
    if (table.empty()) continue;
    // Grow (not Ensure): no CUDA graph holds a table's address (it is read through the attention
    // table). The stream drained first: queued copies may read the old table. From pageable
    // memory the upload is staged before this returns.
    if (table.size() > m->tables[kind].size()) {
      if (m->tables[kind].size() > 0) DGSERVE_RETURN_IF_ERROR(Wait("KV block table growth"));
      DGSERVE_RETURN_IF_ERROR(
          m->tables[kind].Grow(std::max(table.size(), 2 * m->tables[kind].size()), 0));
    }
    DGSERVE_RETURN_IF_ERROR(m->tables[kind].UploadAsync(table.data(), table.size(), stream_));
  }
  m->tables_dirty = false;
  return absl::OkStatus();
}

absl::Status CudaBackend::GrowKvRowsStaging(size_t bytes) {
  if (bytes <= kv_rows_dev_.size()) return absl::OkStatus();
  // Queued copies may still read or write the old staging.
  if (kv_rows_dev_.size() > 0) DGSERVE_RETURN_IF_ERROR(Wait("KV row staging growth"));
  // Doubled, or just `bytes` where the device refuses the double.
  if (kv_rows_dev_.Grow(std::max(bytes, 2 * kv_rows_dev_.size()), 0).ok()) {
    return absl::OkStatus();
  }
  return kv_rows_dev_.Grow(bytes, 0);
}

absl::Status CudaBackend::UploadKvRows(const KvCache& kv, const KvMirror& m, int l, int p0,
                                       int count) {
  const size_t w = size_t(c_.KvHeads(l)) * c_.HeadDim(l);
  const bool bf16 = Bf16Mirror(l);
  const size_t bytes = size_t(count) * w * (bf16 ? sizeof(uint16_t) : sizeof(float));
  DGSERVE_RETURN_IF_ERROR(GrowKvRowsStaging(bytes));
  const int32_t* table = m.tables[KvKind(l)].get();
  const int B = options_.kv_block_size;
  DGSERVE_RETURN_IF_ERROR(m.CheckHeld(KvKind(l), B, p0, count, "KV upload"));
  // Gathered (and rounded) on the host's threads when there are many rows: an adopted 32k
  // prompt is 1.76 GB of float32.
  const bool threads = size_t(count) * w >= (size_t{1} << 16);
  for (int which = 0; which < 2; ++which) {
    if (bf16) {
      host_stage16_.resize(size_t(count) * w);
    } else {
      host_stage_.resize(size_t(count) * w);
    }
#pragma omp parallel for schedule(static) if (threads)
    for (int p = p0; p < p0 + count; ++p) {
      const float* src = which == 0 ? kv.KeyRow(l, p) : kv.ValueRow(l, p);
      const size_t at = size_t(p - p0) * w;
      if (bf16) {
        // Rounded here (FloatToBf16: the device's ToBf16Bits bit for bit): half the bytes.
        for (size_t e = 0; e < w; ++e) host_stage16_[at + e] = FloatToBf16(src[e]);
      } else {
        std::memcpy(&host_stage_[at], src, w * sizeof(float));
      }
    }
    const void* data = bf16 ? static_cast<const void*>(host_stage16_.data()) : host_stage_.data();
    // Into the device staging, then into the blocks, both on stream_ (a later layer's copy into
    // the staging waits for this one's scatter); from pageable memory CUDA stages the rows before
    // returning.
    cuda::NoteUpload();
    kv_copy_stats_.upload_bytes += int64_t(bytes);
    DGSERVE_RETURN_IF_ERROR(
        CudaCheck(cudaMemcpyAsync(kv_rows_dev_.get(), data, bytes, cudaMemcpyHostToDevice, stream_),
                  "cudaMemcpyAsync (KV upload)"));
    float* pool = which == 0 ? PoolK(l) : PoolV(l);
    DGSERVE_RETURN_IF_ERROR(
        bf16 ? cuda::CopyRowsToBlocks(reinterpret_cast<const uint16_t*>(kv_rows_dev_.get()), count,
                                      int(w), table, B, p0, reinterpret_cast<uint16_t*>(pool),
                                      stream_)
             : cuda::CopyRowsToBlocks(reinterpret_cast<const float*>(kv_rows_dev_.get()), count,
                                      int(w), table, B, p0, pool, stream_));
  }
  return absl::OkStatus();
}

}  // namespace cuda_internal
}  // namespace dgserve
