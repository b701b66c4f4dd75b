// How a model's K/V is laid out in paged blocks (design §1.4). Sliding-window and full-attention
// layers have different row widths and retention, so each layer type has its own block pool; a
// block of a type holds block_size token positions of every layer of that type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/model/config.h"

namespace dgserve::kv {

enum class LayerKind : uint8_t { kSliding = 0, kFull = 1 };
inline constexpr int kNumKinds = 2;
inline int KindIndex(LayerKind k) { return static_cast<int>(k); }

struct KvLayout {
  int block_size = 16;      // token positions per block
  int sliding_window = 0;   // W of the model (sliding layers read the last W−1 positions)
  std::vector<LayerKind> kind_of_layer;  // [num_layers]
  std::vector<int> index_in_kind;        // [num_layers] index among the layers of its kind
  int layers[kNumKinds] = {0, 0};        // number of layers of each kind
  int row_width[kNumKinds] = {0, 0};     // floats per K (or V) row: kv_heads · head_dim
  std::string model_id;                  // checked on every transfer
  // Shape of the rows of each kind (row_width = kv_heads · head_dim), for the transfer
  // descriptor. 0 when the layout was built by hand without them.
  int kv_heads[kNumKinds] = {0, 0};
  int head_dim[kNumKinds] = {0, 0};

  // From a validated ModelConfig; block_size > 0.
  static KvLayout FromConfig(const ModelConfig& config, int block_size, std::string model_id);

  // Floats of one block of `kind`: [layers][2 (K, V)][block_size][row_width].
  size_t BlockFloats(LayerKind kind) const {
    const int k = KindIndex(kind);
    return size_t(2) * layers[k] * block_size * row_width[k];
  }
  size_t BlockBytes(LayerKind kind) const { return BlockFloats(kind) * sizeof(float); }
  // Offset (in floats) of one row inside a block.
  size_t RowOffset(LayerKind kind, int layer_in_kind, bool value, int offset_in_block) const {
    const int k = KindIndex(kind);
    return ((size_t(layer_in_kind) * 2 + (value ? 1 : 0)) * block_size + offset_in_block) *
           row_width[k];
  }
  // First position a sliding layer still needs once `num_tokens` positions are committed:
  // max(0, num_tokens − (W − 1)).
  int SlidingKeepFrom(int num_tokens) const {
    const int from = num_tokens - (sliding_window - 1);
    return from > 0 ? from : 0;
  }
  // Blocks covering `num_tokens` positions (≥ 0; block_size > 0), for any int: computed in 64
  // bits, so num_tokens near INT_MAX (a peer's descriptor) does not overflow.
  int BlocksFor(int num_tokens) const {
    return static_cast<int>((int64_t(num_tokens) + block_size - 1) / block_size);
  }
};

}  // namespace dgserve::kv
