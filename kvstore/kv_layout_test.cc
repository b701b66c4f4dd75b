#include "kvstore/kv_layout.h"

#include <gtest/gtest.h>

#include "kvstore/test_util.h"

namespace dgserve::kv {
namespace {

TEST(KvLayoutTest, FromMixedConfig) {
  const ModelConfig c = testing::MixedConfig();  // S S F S F
  const KvLayout l = KvLayout::FromConfig(c, 4, "tiny-mixed");
  EXPECT_EQ(l.block_size, 4);
  EXPECT_EQ(l.sliding_window, 6);
  EXPECT_EQ(l.model_id, "tiny-mixed");
  ASSERT_EQ(l.kind_of_layer.size(), 5u);
  EXPECT_EQ(l.kind_of_layer, (std::vector<LayerKind>{LayerKind::kSliding, LayerKind::kSliding,
                                                      LayerKind::kFull, LayerKind::kSliding,
                                                      LayerKind::kFull}));
  EXPECT_EQ(l.index_in_kind, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(l.layers[KindIndex(LayerKind::kSliding)], 3);
  EXPECT_EQ(l.layers[KindIndex(LayerKind::kFull)], 2);
  // Row widths as ContiguousKvCache computes them: kv_heads · head_dim of the layer type.
  EXPECT_EQ(l.row_width[KindIndex(LayerKind::kSliding)], 2 * 8);
  EXPECT_EQ(l.row_width[KindIndex(LayerKind::kFull)], 1 * 16);
  for (int layer = 0; layer < c.num_layers; ++layer) {
    EXPECT_EQ(l.row_width[KindIndex(l.kind_of_layer[layer])], c.KvHeads(layer) * c.HeadDim(layer));
  }
  EXPECT_EQ(l.kv_heads[KindIndex(LayerKind::kSliding)], 2);
  EXPECT_EQ(l.head_dim[KindIndex(LayerKind::kSliding)], 8);
  EXPECT_EQ(l.kv_heads[KindIndex(LayerKind::kFull)], 1);
  EXPECT_EQ(l.head_dim[KindIndex(LayerKind::kFull)], 16);
  // Block sizes: [layers][K, V][block_size][row].
  EXPECT_EQ(l.BlockFloats(LayerKind::kSliding), 3u * 2 * 4 * 16);
  EXPECT_EQ(l.BlockFloats(LayerKind::kFull), 2u * 2 * 4 * 16);
  EXPECT_EQ(l.BlockBytes(LayerKind::kFull), 2u * 2 * 4 * 16 * sizeof(float));
  // Row offsets: layer 1 of the sliding kind, V, position 3 of the block.
  EXPECT_EQ(l.RowOffset(LayerKind::kSliding, 1, true, 3), ((1u * 2 + 1) * 4 + 3) * 16);
  EXPECT_EQ(l.RowOffset(LayerKind::kFull, 0, false, 0), 0u);
}

TEST(KvLayoutTest, WindowAndBlockArithmetic) {
  const KvLayout l = KvLayout::FromConfig(testing::MixedConfig(), 4, "m");  // W = 6
  EXPECT_EQ(l.SlidingKeepFrom(0), 0);
  EXPECT_EQ(l.SlidingKeepFrom(5), 0);
  EXPECT_EQ(l.SlidingKeepFrom(6), 1);
  EXPECT_EQ(l.SlidingKeepFrom(20), 15);
  EXPECT_EQ(l.BlocksFor(0), 0);
  EXPECT_EQ(l.BlocksFor(1), 1);
  EXPECT_EQ(l.BlocksFor(4), 1);
  EXPECT_EQ(l.BlocksFor(5), 2);
}

// Issue #15 item 8: (num_tokens + block_size - 1) overflowed int for a peer's token_count of
// 2147483647 (UBSan: signed overflow; in practice a negative block count).
TEST(KvLayoutTest, BlocksForDoesNotOverflowNearIntMax) {
  const KvLayout l4 = KvLayout::FromConfig(testing::MixedConfig(), 4, "m");
  EXPECT_EQ(l4.BlocksFor(2147483647), 536870912);
  EXPECT_EQ(l4.BlocksFor(2147483644), 536870911);
  const KvLayout l16 = KvLayout::FromConfig(testing::MixedConfig(), 16, "m");
  EXPECT_EQ(l16.BlocksFor(2147483647), 134217728);
}

TEST(KvLayoutTest, AllFullModelHasNoSlidingLayers) {
  ModelConfig c = testing::MixedConfig();
  c.layer_types.assign(c.num_layers, LayerType::kFull);
  const KvLayout l = KvLayout::FromConfig(c, 16, "f");
  EXPECT_EQ(l.layers[KindIndex(LayerKind::kSliding)], 0);
  EXPECT_EQ(l.layers[KindIndex(LayerKind::kFull)], 5);
  EXPECT_EQ(l.BlockFloats(LayerKind::kSliding), 0u);
  EXPECT_EQ(l.index_in_kind, (std::vector<int>{0, 1, 2, 3, 4}));
}

}  // namespace
}  // namespace dgserve::kv
