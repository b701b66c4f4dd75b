// Helpers shared by the kvstore tests (not part of the library).
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#include "engine/model/config.h"
#include "kvstore/paged_kv_cache.h"

namespace dgserve::kv::testing {

// A small mixed model shape: layers S S F S F (3 sliding of 2 KV heads × 8, 2 full of 1 KV
// head × 16), window 6.
inline ModelConfig MixedConfig() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.num_layers = 5;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.num_global_kv_heads = 1;
  c.head_dim = 8;
  c.global_head_dim = 16;
  c.intermediate_size = 24;
  c.num_experts = 4;
  c.top_k_experts = 2;
  c.moe_intermediate_size = 8;
  c.sliding_window = 6;
  c.canvas_length = 8;
  c.max_position_embeddings = 4096;
  c.layer_types = {LayerType::kSliding, LayerType::kSliding, LayerType::kFull,
                   LayerType::kSliding, LayerType::kFull};
  return c;
}

// The value every row element of a synthetic sequence gets: distinct per (seed, layer, K/V,
// position, element).
inline float PatternValue(int seed, int layer, bool value, int pos, int i) {
  return float(seed * 1000003 + layer * 10007 + (value ? 5003 : 0) + pos * 97 + i) * 0.25f;
}

// Polls `done` every 5 ms until it holds (true) or `wait` has passed (false).
inline bool Eventually(const std::function<bool()>& done, absl::Duration wait) {
  const absl::Time give_up = absl::Now() + wait;
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

// Appends `count` positions with PatternValue rows to `kv` (Reserve, write, Commit).
inline void AppendPattern(KvCache& kv, const KvLayout& layout, int count, int seed) {
  ASSERT_TRUE(kv.Reserve(count).ok());
  const int p0 = kv.num_tokens();
  for (int l = 0; l < int(layout.kind_of_layer.size()); ++l) {
    const int w = layout.row_width[KindIndex(layout.kind_of_layer[l])];
    for (int p = p0; p < p0 + count; ++p) {
      float* k = kv.MutableKeyRow(l, p);
      float* v = kv.MutableValueRow(l, p);
      for (int i = 0; i < w; ++i) {
        k[i] = PatternValue(seed, l, false, p, i);
        v[i] = PatternValue(seed, l, true, p, i);
      }
    }
  }
  kv.Commit(count);
}

// Expects every row a sliding layer still needs (and every full row) of `got` to hold the
// pattern of `seed` for positions [0, num_tokens).
inline void ExpectPattern(const KvCache& got, const KvLayout& layout, int seed) {
  const int n = got.num_tokens();
  for (int l = 0; l < int(layout.kind_of_layer.size()); ++l) {
    const LayerKind kind = layout.kind_of_layer[l];
    const int w = layout.row_width[KindIndex(kind)];
    const int from = kind == LayerKind::kFull ? 0 : layout.SlidingKeepFrom(n);
    for (int p = from; p < n; ++p) {
      const float* k = got.KeyRow(l, p);
      const float* v = got.ValueRow(l, p);
      for (int i = 0; i < w; ++i) {
        ASSERT_EQ(k[i], PatternValue(seed, l, false, p, i)) << "layer " << l << " pos " << p;
        ASSERT_EQ(v[i], PatternValue(seed, l, true, p, i)) << "layer " << l << " pos " << p;
      }
    }
  }
}

// Collects one callback result. Shared with the callback, so a callback that runs after a failed
// test body (e.g. during TearDown) still writes into live memory. A second call fails the test.
template <typename T>
class Waiter : public std::enable_shared_from_this<Waiter<T>> {
 public:
  static std::shared_ptr<Waiter> Make() { return std::shared_ptr<Waiter>(new Waiter); }
  std::function<void(absl::StatusOr<T>)> Callback() {
    return [self = this->shared_from_this()](absl::StatusOr<T> r) {
      if (self->calls.fetch_add(1) > 0) {
        ADD_FAILURE() << "callback called twice";
        return;
      }
      self->result = std::move(r);
      self->done.Notify();
    };
  }
  // Waits (at most `timeout`) for the callback.
  bool Wait(absl::Duration timeout = absl::Seconds(10)) {
    return done.WaitForNotificationWithTimeout(timeout);
  }

  absl::Notification done;
  std::atomic<int> calls{0};
  absl::StatusOr<T> result = absl::UnknownError("callback not called");

 private:
  Waiter() = default;
};
using KvWaiter = Waiter<std::unique_ptr<PagedKvCache>>;

}  // namespace dgserve::kv::testing
