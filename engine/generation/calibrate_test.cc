// NVFP4 activation calibration (issue 37; calibrate.h): the observer's amax against activations
// computed independently on random tiny-v512 weights, the per-module bookkeeping on handcrafted
// inputs, the input scales dgserve-quantize writes from it, the uncalibrated checkpoint's bytes
// as before calibration existed, and the refusals.
#include "engine/generation/calibrate.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/cpu_ops.h"
#include "engine/model/checkpoint.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/kv_cache.h"
#include "engine/model/quantize_checkpoint.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/safetensors.h"

namespace dgserve {
namespace {

namespace fs = std::filesystem;
using ::dgserve::testing::IsOk;
using ::testing::HasSubstr;

// The bf16 tiny-v512 checkpoint with the generator's random weights (seed 512), in `dir`.
std::string WriteTinyV512(const std::string& dir) {
  const fs::path golden = fs::path(::dgserve::testing::GoldenDir()) / "tiny-v512";
  auto cfgs = LoadConfigsFromModelDir(golden.string());
  EXPECT_TRUE(cfgs.ok()) << cfgs.status();
  const std::string bf16 = dir + "/bf16";
  EXPECT_THAT(WriteRandomCheckpoint(cfgs->config, cfgs->generation, 512, bf16), IsOk());
  return bf16;
}

// Two calibration prompts of tiny-v512 (11 and 4 tokens), and 3 denoising steps each, quietly.
std::vector<CalibrationPrompt> TwoPrompts() {
  std::vector<CalibrationPrompt> prompts(2);
  prompts[0].prompt = {2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49};
  prompts[1].prompt = {2, 300, 12, 7};
  return prompts;
}
CalibrationOptions ThreeSteps() {
  CalibrationOptions co;
  co.max_denoising_steps = 3;
  co.progress = false;
  return co;
}

// W4A4 NVFP4 in groups of 16, ModelOpt's layout or (ct) compressed-tensors', no progress line.
QuantizeOptions Nvfp4Options(bool ct) {
  QuantizeOptions q;
  q.progress = false;
  q.format = WeightFormat::kNvfp4;
  q.group_size = 16;
  q.nvfp4_layout = ct ? Nvfp4Layout::kCompressedTensors : Nvfp4Layout::kModelOpt;
  return q;
}

// W4A16 in groups of `group` (0: per channel), no progress line.
QuantizeOptions W4a16Options(int group) {
  QuantizeOptions q;
  q.progress = false;
  q.format = WeightFormat::kW4A16;
  q.group_size = group;
  return q;
}

std::string ReadBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

uint64_t Fnv1a(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// The layer-0 q/k/v input of an encoder pass is input_layernorm(E[id] · embed scale): computed
// here from the weights with a direct RmsNorm call; the observer's amax must be its max |x|.
TEST(CalibrateTest, ObserverAmaxIsTheLayerInputsMaximum) {
  auto ck = ::dgserve::testing::LoadRandomTinyV512("calibrate_observer");
  ASSERT_TRUE(ck.ok()) << ck.status();
  const ModelConfig& c = ck->config;
  ActivationAmaxObserver observer(c);
  CpuBackendOptions options;
  options.linear_observer = &observer;
  auto backend = CreateCpuBackend(c, ck->weights, options);
  const std::vector<int32_t> prompt = {2, 17, 301, 44, 5, 499, 123};
  ContiguousKvCache kv(c, 64);
  EncodeInput e{prompt, &kv};
  ASSERT_THAT(backend->Encode({&e, 1}), IsOk());
  const int D = c.hidden_size;
  std::vector<float> x(prompt.size() * D), a(x.size());
  for (size_t r = 0; r < prompt.size(); ++r) {
    for (int i = 0; i < D; ++i) {
      x[r * D + i] =
          Bf16ToFloat(ck->weights.embed_tokens[size_t(prompt[r]) * D + i]) * c.EmbedScale();
    }
  }
  cpu::RmsNorm(x.data(), ck->weights.layers[0].input_layernorm.data(), prompt.size(), D,
               c.rms_norm_eps, a.data());
  float want = 0;
  for (float v : a) want = std::max(want, std::fabs(v));
  ASSERT_GT(want, 0.0f);
  std::map<std::string, float> got = observer.ModuleAmax();
  for (const char* m : {"q_proj", "k_proj", "v_proj"}) {
    EXPECT_EQ(got[std::string("model.decoder.layers.0.self_attn.") + m], want) << m;
  }
  EXPECT_EQ(observer.encoder_rows(), int64_t(prompt.size()) * c.num_layers);
  EXPECT_EQ(observer.decoder_rows(), 0);
  // No decoder pass yet: the self-conditioning MLP was never observed.
  EXPECT_EQ(got.count("model.decoder.self_conditioning.gate_proj"), 0u);
  // A decoder pass over a canvas is observed too (rows of every layer).
  std::vector<int32_t> canvas(c.canvas_length, 7);
  std::vector<float> logits(size_t(c.canvas_length) * c.vocab_size);
  DecodeInput d{canvas, nullptr, &kv, logits.data()};
  ASSERT_THAT(backend->Decode({&d, 1}), IsOk());
  EXPECT_EQ(observer.decoder_rows(), int64_t(c.canvas_length) * c.num_layers);
  EXPECT_GE(observer.ModuleAmax()["model.decoder.layers.0.self_attn.q_proj"], want);
}

// Handcrafted observations: one amax per site and module, experts from their own rows, an expert
// without rows from its layer's largest, q/k/v and gate/up sharing their input's amax.
TEST(CalibrateTest, ModuleAmaxBookkeeping) {
  ModelConfig c = ::dgserve::testing::TinyConfig();  // 2 layers, 4 experts
  ActivationAmaxObserver o(c);
  const float x1[4] = {0.5f, -3.25f, 1.0f, 2.0f};
  const float x2[2] = {-7.5f, 0.25f};
  const float x3[2] = {1.5f, -0.5f};
  o.Observe(LinearSite::kQkv, 1, -1, true, x1, 2, 2);
  o.Observe(LinearSite::kQkv, 1, -1, false, x3, 1, 2);
  o.Observe(LinearSite::kOProj, 0, -1, false, x2, 1, 2);
  o.Observe(LinearSite::kExpertGateUp, 1, 2, false, x1, 1, 4);
  o.Observe(LinearSite::kExpertGateUp, 1, 3, false, x3, 1, 2);
  o.Observe(LinearSite::kExpertDown, 1, 3, false, x2, 1, 2);
  o.Observe(LinearSite::kScDown, -1, -1, false, x2 + 1, 1, 1);
  std::map<std::string, float> m = o.ModuleAmax();
  const std::string l0 = "model.decoder.layers.0.", l1 = "model.decoder.layers.1.";
  EXPECT_EQ(m[l1 + "self_attn.q_proj"], 3.25f);
  EXPECT_EQ(m[l1 + "self_attn.v_proj"], 3.25f);
  EXPECT_EQ(m[l0 + "self_attn.o_proj"], 7.5f);
  EXPECT_EQ(m.count(l0 + "self_attn.q_proj"), 0u);
  EXPECT_EQ(m[l1 + "experts.2.gate_proj"], 3.25f);
  EXPECT_EQ(m[l1 + "experts.2.up_proj"], 3.25f);
  EXPECT_EQ(m[l1 + "experts.3.up_proj"], 1.5f);
  EXPECT_EQ(m[l1 + "experts.3.down_proj"], 7.5f);
  EXPECT_EQ(m[l1 + "experts.2.down_proj"], 7.5f);   // no down rows: the layer's largest
  EXPECT_EQ(m[l1 + "experts.0.gate_proj"], 3.25f);  // no rows at all
  EXPECT_EQ(m[l1 + "experts.0.down_proj"], 7.5f);
  EXPECT_EQ(m.count(l0 + "experts.0.gate_proj"), 0u);  // no expert of layer 0 saw a row
  EXPECT_EQ(m["model.decoder.self_conditioning.down_proj"], 0.25f);
  EXPECT_EQ(m.count("model.decoder.self_conditioning.up_proj"), 0u);
  EXPECT_EQ(o.experts_without_rows(), 2 * 4 - 2);
  EXPECT_EQ(o.encoder_rows(), 2);
  EXPECT_EQ(o.decoder_rows(), 1);
}

// The input Hessians for GPTQ: Σ x·xᵀ per module by hand, encoder and decoder rows together;
// q/k/v share one (the same object), gate/up too; an expert's over its own rows; the router and
// the self-conditioning MLP are not recorded.
TEST(CalibrateTest, InputHessianBookkeeping) {
  ModelConfig c = ::dgserve::testing::TinyConfig();  // 2 layers, 4 experts
  InputHessianObserver o(c);
  const float x[4] = {1.0f, 2.0f, -1.0f, 0.5f};  // rows (1, 2) and (−1, 0.5)
  o.Observe(LinearSite::kQkv, 1, -1, true, x, 2, 2);
  o.Observe(LinearSite::kQkv, 1, -1, false, x + 2, 1, 2);
  o.Observe(LinearSite::kExpertDown, 0, 3, false, x, 1, 2);
  o.Observe(LinearSite::kMlpGateUp, 0, -1, false, x + 2, 1, 2);
  o.Observe(LinearSite::kRouter, 0, -1, false, x, 2, 2);
  o.Observe(LinearSite::kScGateUp, -1, -1, false, x, 2, 2);
  EXPECT_EQ(o.encoder_rows(), 2);
  EXPECT_EQ(o.decoder_rows(), 1);
  EXPECT_EQ(o.experts_without_rows(), 2 * 4);  // no expert's gate/up saw a row
  const auto m = std::move(o).ModuleHessians();
  const std::string l0 = "model.decoder.layers.0.", l1 = "model.decoder.layers.1.";
  // q/k/v of layer 1, the down_proj of expert 3 of layer 0, gate/up of layer 0's MLP.
  ASSERT_EQ(m.size(), 6u);
  const auto& q = m.at(l1 + "self_attn.q_proj");
  EXPECT_EQ(q->rows, 3);
  EXPECT_EQ(q->h, (std::vector<double>{3.0, 1.0, 1.0, 4.5}));
  EXPECT_EQ(m.at(l1 + "self_attn.k_proj").get(), q.get());
  EXPECT_EQ(m.at(l1 + "self_attn.v_proj").get(), q.get());
  const auto& down = m.at(l0 + "experts.3.down_proj");
  EXPECT_EQ(down->rows, 1);
  EXPECT_EQ(down->h, (std::vector<double>{1.0, 2.0, 2.0, 4.0}));
  EXPECT_EQ(m.count(l0 + "experts.3.gate_proj"), 0u);
  EXPECT_EQ(m.count(l0 + "router.proj"), 0u);
  const auto& gate = m.at(l0 + "mlp.gate_proj");
  EXPECT_EQ(gate->h, (std::vector<double>{1.0, -0.5, -0.5, 0.25}));
  EXPECT_EQ(m.at(l0 + "mlp.up_proj").get(), gate.get());
  // One layer only (layer-by-layer GPTQ): the other layer's rows are counted, not recorded.
  InputHessianObserver one(c, 1);
  one.Observe(LinearSite::kQkv, 0, -1, true, x, 2, 2);
  one.Observe(LinearSite::kQkv, 1, -1, false, x + 2, 1, 2);
  one.Observe(LinearSite::kExpertDown, 0, 3, false, x, 1, 2);
  EXPECT_EQ(one.encoder_rows(), 2);
  EXPECT_EQ(one.decoder_rows(), 1);
  const auto m1 = std::move(one).ModuleHessians();
  ASSERT_EQ(m1.size(), 3u);  // layer 1's q/k/v
  EXPECT_EQ(m1.at(l1 + "self_attn.q_proj")->h, (std::vector<double>{1.0, -0.5, -0.5, 0.25}));
  EXPECT_EQ(InputHessianBytes(c, 0) + InputHessianBytes(c, 1), InputHessianBytes(c));
}

// GPTQ through QuantizeCheckpoint on tiny-v512 calibrated on two prompts: a module with a
// Hessian is quantized by GPTQ (some codes differ from round-to-nearest's), one without (an expert
// no row was routed to) is round-to-nearest bit for bit, and only experts lack one; the
// checkpoint loads. GPTQ with another format, Hessians beyond the memory limit and a null
// Hessian are refused, the last before anything is written.
TEST(CalibrateTest, GptqCheckpoint) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_gptq");
  const std::string bf16 = WriteTinyV512(dir);
  auto ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::vector<CalibrationPrompt> prompts = TwoPrompts();
  const CalibrationOptions co = ThreeSteps();
  EXPECT_EQ(CalibrateInputHessians(*ck, prompts, co, 1).status().code(),
            absl::StatusCode::kResourceExhausted);
  auto hessians = CalibrateInputHessians(*ck, prompts, co, 0);
  ASSERT_TRUE(hessians.ok()) << hessians.status();
  QuantizeOptions q = W4a16Options(32);
  ASSERT_THAT(QuantizeCheckpoint(bf16, dir + "/rtn", q).status(), IsOk());
  q.gptq_hessians = *hessians;
  auto summary = QuantizeCheckpoint(bf16, dir + "/gptq", q);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_GT(summary->gptq, 0);
  auto a = SafetensorsReader::OpenDir(dir + "/rtn");
  auto b = SafetensorsReader::OpenDir(dir + "/gptq");
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  int differ = 0, same_without = 0;
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    const TensorView& ta = a->tensors()[i];
    const TensorView& tb = b->tensors()[i];
    ASSERT_EQ(ta.name, tb.name);
    if (!ta.name.ends_with(".weight_packed")) continue;
    std::string module = ta.name.substr(0, ta.name.size() - std::string(".weight_packed").size());
    if (module.starts_with("model.encoder.language_model.")) {
      module = "model.decoder." + module.substr(29);
    }
    const bool equal = std::memcmp(ta.data, tb.data, ta.nbytes) == 0;
    if (hessians->count(module) != 0) {
      differ += !equal;
    } else {
      // Only experts no calibration row reached lack one (every dense module is observed).
      EXPECT_NE(module.find(".experts."), std::string::npos) << module;
      EXPECT_TRUE(equal) << module << " has no Hessian: round-to-nearest";
      ++same_without;
    }
  }
  EXPECT_GT(differ, 0);
  EXPECT_GT(summary->rtn_without_hessian, 0);      // (here: one expert, 3 modules)
  EXPECT_EQ(summary->rtn_without_hessian % 3, 0);  // an expert's three projections
  EXPECT_EQ(same_without, summary->rtn_without_hessian);
  EXPECT_TRUE(LoadCheckpoint(dir + "/gptq").ok());
  auto null_hessian = q;
  null_hessian.gptq_hessians["model.decoder.layers.0.self_attn.q_proj"] = nullptr;
  const absl::Status refused = QuantizeCheckpoint(bf16, dir + "/null", null_hessian).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.message(),
              HasSubstr("no Hessian for model.decoder.layers.0.self_attn.q_proj"));
  EXPECT_FALSE(fs::exists(dir + "/null"));
  q.format = WeightFormat::kFp8;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/fp8", q).status().message(),
              HasSubstr("for --format w4a16, not fp8"));
}

// Layer-by-layer GPTQ on tiny-v512 (6 layers) against the one-shot GPTQ of the same calibration:
// layer 0 sees the bf16 model either way, so its modules are bit for bit the one-shot ones;
// layer 1's are GPTQ against the Hessians of a run whose layer 0 is the quantized checkpoint's,
// as the loader reads it (rebuilt here from the written one-shot checkpoint), and some differ
// from the one-shot's. The checkpoint written from them loads to the matrices the driver ran.
TEST(CalibrateTest, GptqByLayer) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_gptq_layer");
  const std::string bf16 = WriteTinyV512(dir);
  const std::vector<CalibrationPrompt> prompts = TwoPrompts();
  const CalibrationOptions co = ThreeSteps();
  auto ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(ck.ok()) << ck.status();
  LayerGptqOptions lo;
  lo.group_size = 32;
  auto by_layer = QuantizeW4a16GptqByLayer(*ck, prompts, co, lo);
  ASSERT_TRUE(by_layer.ok()) << by_layer.status();

  // The one-shot GPTQ checkpoint, and the Hessians of layer 1 with its layer 0 quantized.
  auto bf16_ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(bf16_ck.ok());
  auto hessians = CalibrateInputHessians(*bf16_ck, prompts, co, 0);
  ASSERT_TRUE(hessians.ok()) << hessians.status();
  QuantizeOptions q = W4a16Options(32);
  q.gptq_hessians = *hessians;
  ASSERT_THAT(QuantizeCheckpoint(bf16, dir + "/oneshot", q).status(), IsOk());
  auto oneshot = LoadCheckpoint(dir + "/oneshot");
  ASSERT_TRUE(oneshot.ok()) << oneshot.status();
  LayerWeights& l0 = bf16_ck->weights.layers[0];
  const LayerWeights& q0 = oneshot->weights.layers[0];
  for (auto [to, from] : {std::pair(&l0.q_proj, &q0.q_proj),
                          {&l0.k_proj, &q0.k_proj},
                          {&l0.v_proj, &q0.v_proj},
                          {&l0.o_proj, &q0.o_proj},
                          {&l0.mlp_gate_proj, &q0.mlp_gate_proj},
                          {&l0.mlp_up_proj, &q0.mlp_up_proj},
                          {&l0.mlp_down_proj, &q0.mlp_down_proj}}) {
    ASSERT_NE(from->quant(), nullptr);
    *to = *from;
  }
  l0.experts_gate_up_proj = q0.experts_gate_up_proj;
  l0.experts_down_proj = q0.experts_down_proj;
  auto fed = CalibrateInputHessians(*bf16_ck, prompts, co, 0);
  ASSERT_TRUE(fed.ok()) << fed.status();

  auto weights_of = [&](const std::string& module) {
    // The bf16 weights of `module` from the file (experts: rows of the fused tensors).
    auto reader = SafetensorsReader::OpenDir(bf16);
    EXPECT_TRUE(reader.ok());
    std::string name = module + ".weight";
    int64_t row0 = 0, rows = 0;
    const size_t ex = module.find(".experts.");
    if (ex != std::string::npos) {
      const size_t dot = module.find('.', ex + 9);
      const int e = std::stoi(module.substr(ex + 9, dot - ex - 9));
      const std::string proj = module.substr(dot + 1);
      name =
          module.substr(0, ex) + ".experts." + (proj == "down_proj" ? "down_proj" : "gate_up_proj");
      const TensorView* v = reader->Find(name);
      rows = proj == "down_proj" ? v->shape[1] : v->shape[1] / 2;
      row0 = e * v->shape[1] + (proj == "up_proj" ? rows : 0);
    }
    const TensorView* v = reader->Find(name);
    EXPECT_NE(v, nullptr) << name;
    EXPECT_EQ(v->dtype, DType::kBF16);
    const int64_t cols = v->shape.back();
    if (rows == 0) rows = v->shape[0];
    std::vector<float> w(size_t(rows * cols));
    const auto* bits = reinterpret_cast<const uint16_t*>(v->data) + row0 * cols;
    for (size_t i = 0; i < w.size(); ++i) w[i] = Bf16ToFloat(bits[i]);
    return std::make_tuple(w, int(rows), int(cols));
  };
  int layer0 = 0, layer1 = 0, differ = 0, gptq = 0;
  for (const auto& [module, got] : *by_layer) {
    gptq += got->gptq;
    const bool first = module.starts_with("model.decoder.layers.0.");
    if (!first && !module.starts_with("model.decoder.layers.1.")) continue;
    const auto& h = first ? *hessians : *fed;
    const auto it = h.find(module);
    if (it == h.end()) {  // an expert no row reached: round-to-nearest, either way
      EXPECT_FALSE(got->gptq) << module;
      continue;
    }
    EXPECT_TRUE(got->gptq) << module;
    auto [w, rows, cols] = weights_of(module);
    auto want = QuantizeW4a16Gptq(w, rows, cols, 32, *it->second);
    ASSERT_TRUE(want.ok()) << module << ": " << want.status();
    const W4a16Packed p = PackW4a16(*want, cols, 32, 0, rows);
    EXPECT_TRUE(got->packed == p.packed) << module;
    EXPECT_TRUE(got->scales == p.scales) << module;
    ++(first ? layer0 : layer1);
    if (!first) {
      // Against the one-shot Hessian of the bf16 model.
      auto plain = QuantizeW4a16Gptq(w, rows, cols, 32, *hessians->at(module));
      ASSERT_TRUE(plain.ok());
      differ += PackW4a16(*plain, cols, 32, 0, rows).packed != got->packed;
    }
  }
  EXPECT_GT(layer0, 7);
  EXPECT_GT(layer1, 7);
  EXPECT_GT(differ, 0);

  // Written, loaded: the matrices the driver left in `ck` (every layer, every seat kind).
  q.gptq_hessians.clear();
  q.w4a16_modules = *by_layer;
  auto summary = QuantizeCheckpoint(bf16, dir + "/bylayer", q);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->gptq, gptq);
  EXPECT_EQ(summary->gptq + summary->rtn_without_hessian, int(by_layer->size()));
  auto loaded = LoadCheckpoint(dir + "/bylayer");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int l = 0; l < ck->config.num_layers; ++l) {
    const LayerWeights& a = ck->weights.layers[l];
    const LayerWeights& b = loaded->weights.layers[l];
    std::vector<std::pair<const cpu::PackedMatrix*, const cpu::PackedMatrix*>> seats = {
        {&a.q_proj, &b.q_proj},
        {&a.k_proj, &b.k_proj},
        {&a.v_proj, &b.v_proj},
        {&a.o_proj, &b.o_proj},
        {&a.mlp_gate_proj, &b.mlp_gate_proj},
        {&a.mlp_up_proj, &b.mlp_up_proj},
        {&a.mlp_down_proj, &b.mlp_down_proj}};
    for (size_t e = 0; e < a.experts_gate_up_proj.size(); ++e) {
      seats.push_back({&a.experts_gate_up_proj[e], &b.experts_gate_up_proj[e]});
      seats.push_back({&a.experts_down_proj[e], &b.experts_down_proj[e]});
    }
    for (const auto& [x, y] : seats) {
      if (x->empty()) continue;  // v_proj of a full layer
      ASSERT_NE(x->quant(), nullptr);
      ASSERT_EQ(x->rows(), y->rows());
      ASSERT_EQ(x->cols(), y->cols());
      EXPECT_TRUE(x->UnpackBf16() == y->UnpackBf16()) << "layer " << l;
    }
  }

  // Refusals: a given module of another group, shape or length, one the checkpoint does not
  // quantize, another format, both kinds of GPTQ input (nothing written); a memory limit below
  // one layer's Hessians, a negative group, an expert's gate quantized without its up.
  const std::string o1 = "model.decoder.layers.1.self_attn.o_proj";
  for (int kind = 0; kind < 4; ++kind) {
    auto wrong_q = q;
    auto wrong = std::make_shared<W4a16Packed>(*by_layer->at(o1));
    if (kind == 0) wrong->group = 16;
    if (kind == 1) wrong->rows -= 1;
    if (kind == 2) wrong->packed.pop_back();
    if (kind == 3) wrong->scales.push_back(0);
    wrong_q.w4a16_modules[o1] = wrong;
    EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/bad", wrong_q).status().message(),
                HasSubstr(o1 + ": given W4A16 weights"))
        << kind;
    EXPECT_FALSE(fs::exists(dir + "/bad"));
  }
  auto bad = q;
  bad.ignore.push_back(o1);
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/bad", bad).status().message(),
              HasSubstr("given W4A16 weights for " + o1 +
                        ", which this checkpoint does not have or does not quantize"));
  EXPECT_FALSE(fs::exists(dir + "/bad"));
  bad = q;
  bad.gptq_hessians = *hessians;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/both", bad).status().message(),
              HasSubstr("not both"));
  bad = q;
  bad.format = WeightFormat::kFp8;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/fp8", bad).status().message(),
              HasSubstr("for --format w4a16, not fp8"));
  EXPECT_FALSE(fs::exists(dir + "/both"));
  EXPECT_FALSE(fs::exists(dir + "/fp8"));
  lo.max_bytes = LayerGptqBytes(ck->config) - 1;
  EXPECT_EQ(QuantizeW4a16GptqByLayer(*bf16_ck, prompts, co, lo).status().code(),
            absl::StatusCode::kResourceExhausted);
  lo.max_bytes = 0;
  lo.group_size = -1;
  EXPECT_EQ(QuantizeW4a16GptqByLayer(*bf16_ck, prompts, co, lo).status().code(),
            absl::StatusCode::kInvalidArgument);
  lo.group_size = kMaxW4a16GroupSize + 1;
  EXPECT_THAT(QuantizeW4a16GptqByLayer(*bf16_ck, prompts, co, lo).status().message(),
              HasSubstr("--group_size must be in [0, 1048576]"));
  lo.group_size = 32;
  lo.ignore.push_back("re:([");
  EXPECT_THAT(QuantizeW4a16GptqByLayer(*bf16_ck, prompts, co, lo).status().message(),
              HasSubstr("entry 're:([' is not a valid regular expression (ECMAScript): "));
  lo.ignore.back() = "re:.*layers[.]3[.]experts[.]5[.]up_proj$";
  // Refused by the names, before the L calibration runs (a library caller that skips
  // CheckIgnoreList), and from the headers (dgserve-quantize runs CheckIgnoreList first).
  EXPECT_THAT(QuantizeW4a16GptqByLayer(*bf16_ck, prompts, co, lo).status().message(),
              HasSubstr("quantizes one of model.decoder.layers.3.experts.5.gate_proj and "
                        "model.decoder.layers.3.experts.5.up_proj only"));
  QuantizeOptions split_options = W4a16Options(128);
  split_options.ignore = lo.ignore;
  EXPECT_THAT(CheckIgnoreList(bf16, split_options, /*layer_by_layer=*/true).message(),
              HasSubstr("quantizes one of model.decoder.layers.3.experts.5.gate_proj and "
                        "model.decoder.layers.3.experts.5.up_proj only"));
  // Without GPTQ too: a checkpoint the loader would refuse is not written.
  QuantizeOptions split = W4a16Options(128);
  split.ignore.push_back(lo.ignore.back());
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/split", split).status().message(),
              HasSubstr("quantizes one of model.decoder.layers.3.experts.5.gate_proj and "
                        "model.decoder.layers.3.experts.5.up_proj only"));
  EXPECT_FALSE(fs::exists(dir + "/split"));
}

// Per channel (group size 0) layer by layer: every given module is a single group per row, the
// checkpoint loads with them, and a module the ignore list keeps stays bf16 in the run.
TEST(CalibrateTest, GptqByLayerPerChannel) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_gptq_layer_channel");
  const std::string bf16 = WriteTinyV512(dir);
  auto ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(ck.ok()) << ck.status();
  LayerGptqOptions lo;
  lo.group_size = 0;
  lo.ignore.push_back("re:.*self_attn[.]o_proj$");
  auto by_layer = QuantizeW4a16GptqByLayer(*ck, TwoPrompts(), ThreeSteps(), lo);
  ASSERT_TRUE(by_layer.ok()) << by_layer.status();
  for (const auto& [module, p] : *by_layer) {
    EXPECT_EQ(p->group, p->cols) << module;
    EXPECT_EQ(p->scales.size(), size_t(p->rows)) << module;
    EXPECT_EQ(module.find("o_proj"), std::string::npos) << module;
  }
  for (const LayerWeights& l : ck->weights.layers) {
    EXPECT_EQ(l.o_proj.quant(), nullptr);
    EXPECT_NE(l.q_proj.quant(), nullptr);
  }
  QuantizeOptions q = W4a16Options(0);
  q.ignore = lo.ignore;
  q.w4a16_modules = *by_layer;
  auto summary = QuantizeCheckpoint(bf16, dir + "/bylayer", q);
  ASSERT_TRUE(summary.ok()) << summary.status();
  auto loaded = LoadCheckpoint(dir + "/bylayer");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  for (int l = 0; l < ck->config.num_layers; ++l) {
    EXPECT_TRUE(ck->weights.layers[l].q_proj.UnpackBf16() ==
                loaded->weights.layers[l].q_proj.UnpackBf16());
    EXPECT_EQ(loaded->weights.layers[l].o_proj.quant(), nullptr);
  }
}

// Calibrated checkpoints: every input_scale is amax / (6 · 448) of its module (ModelOpt) and
// every input_global_scale 448 · 6 / amax (compressed-tensors), all else as uncalibrated.
TEST(CalibrateTest, WrittenInputScalesAreTheCalibratedAmax) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_write");
  const std::string bf16 = WriteTinyV512(dir);
  auto ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const std::vector<CalibrationPrompt> prompts = TwoPrompts();
  const CalibrationOptions co = ThreeSteps();
  auto amax = CalibrateActivationAmax(*ck, prompts, co);
  ASSERT_TRUE(amax.ok()) << amax.status();
  for (bool ct : {false, true}) {
    QuantizeOptions q = Nvfp4Options(ct);
    const std::string plain = dir + (ct ? "/ct" : "/mo"), cal = plain + "_cal";
    ASSERT_THAT(QuantizeCheckpoint(bf16, plain, q).status(), IsOk());
    q.input_amax = *amax;
    ASSERT_THAT(QuantizeCheckpoint(bf16, cal, q).status(), IsOk());
    auto a = SafetensorsReader::OpenDir(plain);
    auto b = SafetensorsReader::OpenDir(cal);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->tensors().size(), b->tensors().size());
    const std::string suffix = ct ? ".input_global_scale" : ".input_scale";
    int scales = 0;
    for (size_t i = 0; i < a->tensors().size(); ++i) {
      const TensorView& ta = a->tensors()[i];
      const TensorView& tb = b->tensors()[i];
      ASSERT_EQ(ta.name, tb.name);
      ASSERT_EQ(ta.nbytes, tb.nbytes);
      if (!ta.name.ends_with(suffix)) {
        EXPECT_EQ(std::memcmp(ta.data, tb.data, ta.nbytes), 0) << ta.name;
        continue;
      }
      const std::string module = ta.name.substr(0, ta.name.size() - suffix.size());
      ASSERT_EQ(amax->count(module), 1u) << module;
      const float x = amax->at(module);
      ASSERT_GT(x, 0.0f) << module;
      float got;
      std::memcpy(&got, tb.data, 4);
      EXPECT_EQ(got, ct ? 2688.0f / x : x / 2688.0f) << module;
      ++scales;
    }
    EXPECT_EQ(scales, 136);  // every quantized module of tiny-v512 (ModelOpt's count)
  }
}

// Without calibration the NVFP4 files are the bytes dgserve-quantize wrote before calibration
// existed: FNV-1a 64 of the same checkpoint written by that version (c6520d9,
// `dgserve-mkmodel --seed 512 --config tests/testdata/golden/tiny-v512/config.json`, then
// `dgserve-quantize --format nvfp4 [--nvfp4_layout compressed-tensors]`).
TEST(CalibrateTest, UncalibratedCheckpointBytesAreUnchanged) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_bytes");
  const std::string bf16 = WriteTinyV512(dir);
  for (bool ct : {false, true}) {
    QuantizeOptions q = Nvfp4Options(ct);
    const std::string out = dir + (ct ? "/ct" : "/mo");
    ASSERT_THAT(QuantizeCheckpoint(bf16, out, q).status(), IsOk());
    EXPECT_EQ(Fnv1a(ReadBytes(out + "/model.safetensors")),
              ct ? 0xa8baf99fdde6e81full : 0xda7b54e7a7a03be1ull);
    EXPECT_EQ(Fnv1a(ReadBytes(out + "/config.json")),
              ct ? 0xea83fcac207a582cull : 0x5107e43c1758a7e7ull);
  }
}

TEST(CalibrateTest, Refusals) {
  const std::string dir = ::dgserve::testing::MakeTempDir("calibrate_refuse");
  const std::string bf16 = WriteTinyV512(dir);
  QuantizeOptions q;
  q.progress = false;
  q.input_amax = {{"model.decoder.layers.0.self_attn.q_proj", 3.0f}};
  q.format = WeightFormat::kFp8;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/a", q).status().message(),
              HasSubstr("fp8 has none"));
  q.format = WeightFormat::kW4A16;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/b", q).status().message(),
              HasSubstr("w4a16 has none"));
  q.format = WeightFormat::kNvfp4;
  q.group_size = 16;
  q.nvfp4_layout = Nvfp4Layout::kCompressedTensors;
  q.nvfp4_activations = Nvfp4Activations::kNone;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/c", q).status().message(),
              HasSubstr("nvfp4a16 (weight-only) has none"));
  q.nvfp4_activations = Nvfp4Activations::kNvfp4;
  // Only q_proj calibrated: the first other quantized module is named.
  auto st = QuantizeCheckpoint(bf16, dir + "/d", q).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("no amax for the quantized module"));
  EXPECT_FALSE(fs::exists(dir + "/d"));
  q.input_amax["model.decoder.layers.0.self_attn.q_proj"] = NAN;
  EXPECT_THAT(QuantizeCheckpoint(bf16, dir + "/e", q).status().message(),
              HasSubstr("must be finite"));
  // Calibration files.
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  auto tok =
      Tokenizer::Load(std::string(src != nullptr ? src : ".") + "/models/sudoku/tokenizer.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  auto good = ReadCalibrationPrompts(write("good.jsonl", "{\"prompt\": \"12.\\n\"}\n\n"), *tok);
  ASSERT_TRUE(good.ok()) << good.status();
  ASSERT_EQ(good->size(), 1u);
  EXPECT_EQ(good->at(0).prompt.size(), 5u);  // <bos> 1 2 . \n
  EXPECT_EQ(good->at(0).prompt[0], 2);
  auto bad = ReadCalibrationPrompts(write("bad.jsonl", "{\"prompt\": \"1\"}\nhello\n"), *tok);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("bad.jsonl:2: expected a JSON object"));
  EXPECT_THAT(
      ReadCalibrationPrompts(write("num.jsonl", "{\"prompt\": 3}\n"), *tok).status().message(),
      HasSubstr("num.jsonl:1: expected a JSON object with a string \"prompt\""));
  EXPECT_THAT(ReadCalibrationPrompts(write("empty.jsonl", "\n\n"), *tok).status().message(),
              HasSubstr("no calibration prompt"));
  EXPECT_THAT(
      ReadCalibrationPrompts(write("e2.jsonl", "{\"prompt\": \"\"}"), *tok).status().message(),
      HasSubstr("e2.jsonl:1: empty \"prompt\""));
  EXPECT_EQ(ReadCalibrationPrompts(dir + "/missing.jsonl", *tok).status().code(),
            absl::StatusCode::kNotFound);
  // A prompt longer than the context leaves is refused as it is read, naming its line (5 tokens
  // allowed: "<bos> 1 2 . \n" passes, "<bos> 1 2 3 4 5" does not).
  const std::string long_file =
      write("long.jsonl", "{\"prompt\": \"12.\\n\"}\n{\"prompt\": \"12345\"}\n");
  EXPECT_TRUE(ReadCalibrationPrompts(long_file, *tok, 6).ok());
  const absl::Status too_long = ReadCalibrationPrompts(long_file, *tok, 5).status();
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.message(), HasSubstr("long.jsonl:2: prompt of 6 tokens"));
  // With a limit the file is read no further: its second line (not JSON) is never parsed.
  auto first =
      ReadCalibrationPrompts(write("limit.jsonl", "{\"prompt\": \"1\"}\nnot json\n"), *tok, 0, 1);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->size(), 1u);
  // A quantized checkpoint is not calibrated.
  QuantizeOptions f;
  f.progress = false;
  f.format = WeightFormat::kFp8;
  ASSERT_THAT(QuantizeCheckpoint(bf16, dir + "/fp8", f).status(), IsOk());
  auto fp8 = LoadCheckpoint(dir + "/fp8");
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  std::vector<CalibrationPrompt> p(1);
  p[0].prompt = {2, 3};
  EXPECT_THAT(CalibrateActivationAmax(*fp8, p).status().message(), HasSubstr("already quantized"));
  auto ck = LoadCheckpoint(bf16);
  ASSERT_TRUE(ck.ok());
  EXPECT_THAT(CalibrateActivationAmax(*ck, {}).status().message(), HasSubstr("no prompts"));
  p[0].prompt = {2, 100000};
  EXPECT_THAT(CalibrateActivationAmax(*ck, p).status().message(),
              HasSubstr("calibration prompt 1"));
}

}  // namespace
}  // namespace dgserve
