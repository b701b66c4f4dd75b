#include "kvstore/kv_layout.h"

#include <utility>

namespace dgserve::kv {

KvLayout KvLayout::FromConfig(const ModelConfig& config, int block_size, std::string model_id) {
  KvLayout layout;
  layout.block_size = block_size;
  layout.sliding_window = config.sliding_window;
  layout.model_id = std::move(model_id);
  layout.kind_of_layer.reserve(config.num_layers);
  layout.index_in_kind.reserve(config.num_layers);
  for (int l = 0; l < config.num_layers; ++l) {
    const LayerKind kind = config.IsFull(l) ? LayerKind::kFull : LayerKind::kSliding;
    const int k = KindIndex(kind);
    layout.kind_of_layer.push_back(kind);
    layout.index_in_kind.push_back(layout.layers[k]++);
    // Same per-layer width as ContiguousKvCache: kv_heads · head_dim of the layer's type.
    layout.kv_heads[k] = config.KvHeads(l);
    layout.head_dim[k] = config.HeadDim(l);
    layout.row_width[k] = config.KvHeads(l) * config.HeadDim(l);
  }
  return layout;
}

}  // namespace dgserve::kv
