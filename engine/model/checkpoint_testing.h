// Test helpers for the checkpoint tests (not part of any library).
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/bf16.h"
#include "common/testing/temp_dir.h"
#include "engine/model/checkpoint.h"
#include "engine/model/config.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/weights.h"

namespace dgserve::testing {

// The golden data directory: $DGSERVE_GOLDEN_DIR, else $DGSERVE_SOURCE_DIR/tests/testdata/golden.
inline std::string GoldenDir() {
  if (const char* d = std::getenv("DGSERVE_GOLDEN_DIR"); d != nullptr && *d != '\0') return d;
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  return absl::StrCat(src != nullptr ? src : ".", "/tests/testdata/golden");
}

// The golden tiny-v512 shape with random weights (generator seed 512): written to a temporary
// directory named after `tag`, loaded back, and the directory removed.
inline absl::StatusOr<Checkpoint> LoadRandomTinyV512(const std::string& tag) {
  const std::filesystem::path golden = std::filesystem::path(GoldenDir()) / "tiny-v512";
  absl::StatusOr<ModelDirConfigs> cfgs = LoadConfigsFromModelDir(golden.string());
  if (!cfgs.ok()) return cfgs.status();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / absl::StrCat("dgserve_", tag, "_", ::getpid());
  absl::Status st = WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, dir.string());
  absl::StatusOr<Checkpoint> ckpt =
      st.ok() ? LoadCheckpoint(dir.string()) : absl::StatusOr<Checkpoint>(st);
  std::filesystem::remove_all(dir);
  return ckpt;
}

// A fresh empty directory under the test temp dir.
inline std::string MakeTempDir(const std::string& prefix) {
  std::string base = ::testing::TempDir();
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  const std::string dir = MakeTempDirRemovedAtExit(prefix, base);  // common/testing/temp_dir.h
  EXPECT_NE(dir, "") << "mkdtemp " << base << "/" << prefix << "_XXXXXX";
  return dir;
}

// A tiny valid shape: vocab 64, hidden 16, layers S F, heads 2 / kv 1 / global kv 1, head dims
// 8 / 16, dense 24, 4 experts top-2 of width 8, window 4, canvas 8.
inline ModelConfig TinyConfig() {
  ModelConfig c;
  c.vocab_size = 64;
  c.hidden_size = 16;
  c.num_layers = 2;
  c.num_heads = 2;
  c.num_kv_heads = 1;
  c.num_global_kv_heads = 1;
  c.head_dim = 8;
  c.global_head_dim = 16;
  c.intermediate_size = 24;
  c.num_experts = 4;
  c.top_k_experts = 2;
  c.moe_intermediate_size = 8;
  c.sliding_window = 4;
  c.canvas_length = 8;
  c.max_position_embeddings = 4096;
  c.layer_types = {LayerType::kSliding, LayerType::kFull};
  return c;
}

// HF tensor name → loaded values (flattened, float32), restated independently of checkpoint.cc's
// own table. Matrices are unpacked from their bf16 panels.
inline std::map<std::string, std::vector<float>> WeightVectors(const ModelWeights& w) {
  std::map<std::string, std::vector<float>> m;
  auto bits = [](const std::vector<uint16_t>& b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); ++i) f[i] = Bf16ToFloat(b[i]);
    return f;
  };
  auto mat = [&](const cpu::PackedMatrix& p) { return bits(p.UnpackBf16()); };
  auto experts = [&](const std::vector<cpu::PackedMatrix>& e) {
    std::vector<float> f;
    for (const cpu::PackedMatrix& p : e) {
      const std::vector<float> one = mat(p);
      f.insert(f.end(), one.begin(), one.end());
    }
    return f;
  };
  const std::string p = "model.decoder.";
  m[p + "embed_tokens.weight"] = bits(w.embed_tokens);
  m[p + "norm.weight"] = w.final_norm;
  m[p + "self_conditioning.pre_norm.weight"] = w.sc_pre_norm;
  m[p + "self_conditioning.gate_proj.weight"] = mat(w.sc_gate_proj);
  m[p + "self_conditioning.up_proj.weight"] = mat(w.sc_up_proj);
  m[p + "self_conditioning.down_proj.weight"] = mat(w.sc_down_proj);
  for (size_t i = 0; i < w.layers.size(); ++i) {
    const LayerWeights& l = w.layers[i];
    const std::string q = absl::StrCat(p, "layers.", i, ".");
    m[q + "input_layernorm.weight"] = l.input_layernorm;
    m[q + "self_attn.q_proj.weight"] = mat(l.q_proj);
    m[q + "self_attn.k_proj.weight"] = mat(l.k_proj);
    if (!l.v_proj.empty()) m[q + "self_attn.v_proj.weight"] = mat(l.v_proj);
    m[q + "self_attn.o_proj.weight"] = mat(l.o_proj);
    m[q + "self_attn.q_norm.weight"] = l.q_norm;
    m[q + "self_attn.k_norm.weight"] = l.k_norm;
    m[q + "post_attention_layernorm.weight"] = l.post_attention_layernorm;
    m[q + "pre_feedforward_layernorm.weight"] = l.pre_feedforward_layernorm;
    m[q + "mlp.gate_proj.weight"] = mat(l.mlp_gate_proj);
    m[q + "mlp.up_proj.weight"] = mat(l.mlp_up_proj);
    m[q + "mlp.down_proj.weight"] = mat(l.mlp_down_proj);
    m[q + "post_feedforward_layernorm_1.weight"] = l.post_feedforward_layernorm_1;
    m[q + "router.proj.weight"] = mat(l.router_proj);
    m[q + "router.scale"] = l.router_scale;
    m[q + "router.per_expert_scale"] = l.router_per_expert_scale;
    m[q + "pre_feedforward_layernorm_2.weight"] = l.pre_feedforward_layernorm_2;
    m[q + "experts.gate_up_proj"] = experts(l.experts_gate_up_proj);
    m[q + "experts.down_proj"] = experts(l.experts_down_proj);
    m[q + "post_feedforward_layernorm_2.weight"] = l.post_feedforward_layernorm_2;
    m[q + "post_feedforward_layernorm.weight"] = l.post_feedforward_layernorm;
  }
  return m;
}

// HF name → loaded scalar (decoder and encoder layer_scalar).
inline std::map<std::string, float> WeightScalars(const ModelWeights& w) {
  std::map<std::string, float> m;
  for (size_t i = 0; i < w.layers.size(); ++i) {
    m[absl::StrCat("model.decoder.layers.", i, ".layer_scalar")] = w.layers[i].decoder_layer_scalar;
    m[absl::StrCat("model.encoder.language_model.layers.", i, ".layer_scalar")] =
        w.layers[i].encoder_layer_scalar;
  }
  return m;
}

// The value of tensor `name` (flattened) as loaded, or empty if unknown.
inline std::vector<float> LoadedValues(const ModelWeights& w, const std::string& name) {
  auto vecs = WeightVectors(w);
  if (auto it = vecs.find(name); it != vecs.end()) return it->second;
  auto scalars = WeightScalars(w);
  if (auto it = scalars.find(name); it != scalars.end()) return {it->second};
  return {};
}

}  // namespace dgserve::testing
