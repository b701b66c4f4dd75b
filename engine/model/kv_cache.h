// The KV interface the model reads and writes (spec §3.4–§3.5). The encoder pass appends the
// K/V rows of new tokens for every layer; the decoder pass only reads. A row is the layer's
// [kv_heads · head_dim] K (after k_norm + RoPE) or V (after v_norm) of one token position.
// The paged block pool of kvstore/ implements the same interface.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "engine/model/config.h"

namespace dgserve {

class KvCache {
 public:
  KvCache() = default;
  // A copy is another cache: a new lifetime(); host_rows_stale() is copied (the copy's host rows
  // lack the same rows, and no backend can supply them to it).
  KvCache(const KvCache& other) : host_rows_stale_(other.host_rows_stale_) {}
  KvCache& operator=(const KvCache& other) {
    if (this == &other) return *this;
    lifetime_ = std::make_shared<const char>(0);
    host_rows_stale_ = other.host_rows_stale_;
    return *this;
  }
  virtual ~KvCache() = default;

  // Tokens encoded and committed so far: positions 0 .. num_tokens()−1.
  virtual int num_tokens() const = 0;
  // Makes room for `count` more token positions in every layer. RESOURCE_EXHAUSTED when the
  // cache cannot grow; nothing is changed then. A reservation that is never committed is
  // replaced by the next Reserve.
  virtual absl::Status Reserve(int count) = 0;
  // Write access to the rows of reserved positions num_tokens() .. num_tokens()+count−1.
  virtual float* MutableKeyRow(int layer, int pos) = 0;
  virtual float* MutableValueRow(int layer, int pos) = 0;
  // Read access to a committed or reserved position. Sliding layers only guarantee the last
  // sliding_window−1 committed positions (plus reserved ones); asking for an older one is a bug.
  virtual const float* KeyRow(int layer, int pos) const = 0;
  virtual const float* ValueRow(int layer, int pos) const = 0;
  // Commits `count` reserved positions: num_tokens() += count. Sliding layers may then drop
  // rows older than num_tokens() − (sliding_window − 1).
  virtual void Commit(int count) = 0;
  // The first sliding-layer position whose rows this cache keeps (for readers: other backends,
  // KV transfers, the prefix index) once `num_tokens` positions are committed; ≤ max(0,
  // num_tokens − (sliding_window − 1)), the rows the model reads. A writer may leave the rows of
  // a sliding layer before it unwritten: the CUDA backend's encoder pass copies a long prompt's
  // sliding-layer rows to the host from SlidingRetainedFrom(its final count) on only (issue 34).
  // 0 (the default): every row is kept. Non-decreasing in num_tokens (a row once released is not
  // kept again).
  virtual int SlidingRetainedFrom(int num_tokens) const { return 0; }
  // The most sliding-layer rows the cache keeps at any token count: the largest num_tokens −
  // SlidingRetainedFrom(num_tokens). INT_MAX (the default): every row, no bound.
  virtual int MaxSlidingRowsKept() const { return std::numeric_limits<int>::max(); }
  // An identity of the stored K/V rows of committed position `pos` of every full layer (full)
  // or every sliding layer, for a backend that keeps its own copies of rows (the CUDA backend's
  // device K/V blocks, shared between sequences: issue 34): two caches give the same nonzero
  // value for a position only when they hold the same stored rows there (a paged block shared
  // by reference: a prefix hit, a fork), and a value once given never names other rows. 0 (the
  // default): none (not shared, or a position the cache does not hold).
  virtual uint64_t SharedRowsId(bool full, int pos) const { return 0; }

  // This cache's identity while it lives: a backend that keeps device state per cache holds the
  // weak_ptr to tell this cache from a later one made at the same address, and a live cache from
  // a destroyed one.
  std::weak_ptr<const void> lifetime() const { return lifetime_; }
  // True while a device backend holds rows of this cache that its host arrays lack (the CUDA
  // backend's deferred host copy, CudaBackendOptions::defer_kv_host_copy: its encoder passes
  // leave the new rows in device memory). Until that backend's ModelBackend::SyncKvToHost, only
  // it may read or extend the cache: the CPU backend, PagedKvCache::Fork and the KV transports
  // refuse such a cache (FAILED_PRECONDITION), and its blocks must not be indexed as a prefix.
  // Set and cleared by the backend, which may also copy the rows into the host arrays (and clear
  // it) during a later call for other caches, to free its device memory (the CUDA backend's
  // swap-out): the cache's owner calls it from the one thread that uses the cache.
  bool host_rows_stale() const { return host_rows_stale_; }
  void set_host_rows_stale(bool stale) { host_rows_stale_ = stale; }

 private:
  std::shared_ptr<const char> lifetime_ = std::make_shared<const char>(0);
  bool host_rows_stale_ = false;
};

// FAILED_PRECONDITION naming `who` when kv.host_rows_stale(), else OK.
absl::Status CheckHostRowsCurrent(const KvCache& kv, std::string_view who);

// A KvCache in plain per-layer arrays, growing on demand (single request, no paging).
// Sliding layers have storage for every row, but only the last sliding_window − 1 committed rows
// are kept (SlidingRetainedFrom): a writer may leave older ones unwritten, as the model never
// reads outside the window.
class ContiguousKvCache final : public KvCache {
 public:
  // max_tokens bounds the growth (RESOURCE_EXHAUSTED beyond it).
  ContiguousKvCache(const ModelConfig& config, int max_tokens);

  int num_tokens() const override { return num_tokens_; }
  absl::Status Reserve(int count) override;
  float* MutableKeyRow(int layer, int pos) override;
  float* MutableValueRow(int layer, int pos) override;
  const float* KeyRow(int layer, int pos) const override;
  const float* ValueRow(int layer, int pos) const override;
  void Commit(int count) override;
  // max(0, num_tokens − (sliding_window − 1)).
  int SlidingRetainedFrom(int num_tokens) const override;
  // sliding_window − 1.
  int MaxSlidingRowsKept() const override { return std::max(0, sliding_window_ - 1); }

 private:
  std::vector<int> row_width_;  // per layer: kv_heads · head_dim
  std::vector<std::vector<float>> keys_, values_;
  int sliding_window_;
  int max_tokens_;
  int num_tokens_ = 0;
  int reserved_ = 0;
};

}  // namespace dgserve
