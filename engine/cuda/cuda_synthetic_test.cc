// Synthetic device weights (cuda_synthetic.h, CreateCudaBackendSynthetic), the launch counters
// (cuda_profile.h), the phase timer and the ceilings (cuda_calibrate.h). Label `gpu` (skips
// without a GPU) and `gpu-emu` (the emulation also counts the cuBLAS calls and copies it sees,
// independently of cuda_profile.h, and the counters are checked against those).
#include "engine/cuda/cuda_synthetic.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_calibrate.h"
#include "engine/cuda/cuda_gemm.h"
#include "engine/cuda/cuda_ops.h"
#include "engine/cuda/cuda_profile.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/model/checkpoint_testing.h"
#include "engine/model/config.h"
#include "engine/model/kv_cache.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/synthetic_weights.h"
#include "engine/model/tensor_names.h"

namespace dgserve {
namespace {

using cuda::CudaTest;

// Every element of a device-filled tensor equals the host generator's (RandomBf16), for the
// families with and without an offset, and the float32 fill is its exact widening.
TEST_F(CudaTest, FillMatchesHostGenerator) {
  const ModelConfig c = testing::TinyConfig();
  const uint64_t seed = 42;
  int checked_families = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    const bool want = spec.name == "model.decoder.embed_tokens.weight" ||
                      spec.name == "model.decoder.layers.0.self_attn.q_proj.weight" ||
                      spec.name == "model.decoder.layers.1.router.proj.weight" ||
                      spec.name == "model.decoder.layers.0.input_layernorm.weight" ||
                      spec.name == "model.decoder.layers.1.experts.gate_up_proj";
    if (!want) continue;
    ++checked_families;
    const InitConstants k = FamilyConstants(spec);
    const cuda::SyntheticTensor t{TensorKey(spec.name, seed), k.a, k.c, k.has_offset};
    const int64_t n = spec.numel();
    uint16_t* d = Alloc<uint16_t>(size_t(n), 0xFF);
    float* f = Alloc<float>(size_t(n), 0xFF);
    ASSERT_TRUE(cuda::FillSyntheticBf16(t, n, d).ok());
    ASSERT_TRUE(cuda::FillSyntheticFloat(t, n, f).ok());
    const std::vector<uint16_t> got = Download(d, size_t(n));
    const std::vector<float> gotf = Download(f, size_t(n));
    uint64_t sum_device = 0, sum_host = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint16_t want_bits = RandomBf16(spec, seed, i);
      ASSERT_EQ(got[i], want_bits) << spec.name << " element " << i;
      uint32_t fb;
      std::memcpy(&fb, &gotf[i], 4);
      ASSERT_EQ(fb, uint32_t(want_bits) << 16) << spec.name << " element " << i;
      sum_device += got[i];
      sum_host += want_bits;
    }
    EXPECT_EQ(sum_device, sum_host) << spec.name;
    EXPECT_GT(sum_host, 0u) << spec.name;  // not all zeros
  }
  EXPECT_EQ(checked_families, 5);
}

// The whole embedding for seed 3 (dgserve-mkmodel's default) equals RandomTensorBf16, the
// generator whose output model_mkmodel_golden_test pins bit for bit to the golden checkpoints.
TEST_F(CudaTest, FillIsTheGoldenGenerator) {
  const ModelConfig c = testing::TinyConfig();
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (spec.name != "model.decoder.embed_tokens.weight") continue;
    const InitConstants k = FamilyConstants(spec);
    const cuda::SyntheticTensor t{TensorKey(spec.name, 3), k.a, k.c, k.has_offset};
    const int64_t n = spec.numel();
    uint16_t* d = Alloc<uint16_t>(size_t(n));
    ASSERT_TRUE(cuda::FillSyntheticBf16(t, n, d).ok());
    const std::vector<uint16_t> got = Download(d, size_t(n));
    const std::vector<uint16_t> host = RandomTensorBf16(spec, 3);
    ASSERT_EQ(got, host);
  }
}

class SyntheticBackendTest : public CudaTest {
 protected:
  struct StepOut {
    std::vector<RowResult> rows;
    std::vector<float> next_soft;
  };
  // Encode a 6-token prompt, then two denoise steps (the second with self-conditioning).
  static std::vector<StepOut> Run(ModelBackend& b,
                                  std::vector<cuda::LaunchCounts>* per_step = nullptr) {
    const ModelConfig& c = b.config();
    ContiguousKvCache kv(c, 16);
    std::vector<int32_t> prompt = {1, 5, 9, 13, 17, 21};
    EncodeInput enc{prompt, &kv};
    EXPECT_TRUE(b.Encode({&enc, 1}).ok());
    const int C = c.canvas_length;
    std::vector<int32_t> canvas(C);
    for (int i = 0; i < C; ++i) canvas[i] = (i * 7 + 3) % c.vocab_size;
    std::vector<float> soft(size_t(C) * c.hidden_size, 0.0f);
    std::vector<StepOut> out;
    for (int s = 0; s < 2; ++s) {
      StepOut o;
      o.rows.resize(C);
      o.next_soft.resize(size_t(C) * c.hidden_size);
      std::vector<float> uniforms(C);
      for (int i = 0; i < C; ++i) uniforms[i] = float((i * 37 + s * 11) % 100) / 100.0f;
      DenoiseStepInput in;
      in.canvas = canvas;
      in.sc_soft = s > 0 ? soft.data() : nullptr;
      in.kv = &kv;
      in.temperature = 0.8f;
      in.uniforms = uniforms;
      in.rows = o.rows.data();
      in.next_soft = o.next_soft.data();
      const cuda::LaunchCounts before = cuda::ReadLaunchCounts();
      const absl::Status st = b.DenoiseStep({&in, 1});
      EXPECT_TRUE(st.ok()) << st;
      if (per_step != nullptr) per_step->push_back(cuda::ReadLaunchCounts() - before);
      soft = o.next_soft;
      out.push_back(std::move(o));
    }
    return out;
  }
  static void ExpectSame(const std::vector<StepOut>& a, const std::vector<StepOut>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t s = 0; s < a.size(); ++s) {
      ASSERT_EQ(a[s].rows.size(), b[s].rows.size());
      for (size_t r = 0; r < a[s].rows.size(); ++r) {
        EXPECT_EQ(a[s].rows[r].argmax, b[s].rows[r].argmax) << "step " << s << " row " << r;
        EXPECT_EQ(a[s].rows[r].sampled, b[s].rows[r].sampled) << "step " << s << " row " << r;
        EXPECT_EQ(a[s].rows[r].entropy, b[s].rows[r].entropy) << "step " << s << " row " << r;
        EXPECT_EQ(a[s].rows[r].lse, b[s].rows[r].lse) << "step " << s << " row " << r;
      }
      EXPECT_EQ(a[s].next_soft, b[s].next_soft) << "step " << s;
    }
  }
};

// The weights filled on the device are the uploaded SyntheticModelWeights bit for bit: every
// output of two steps is identical; the same seed gives the same outputs, another seed others.
TEST_F(SyntheticBackendTest, EqualsUploadedWeightsAndIsSeeded) {
  const ModelConfig c = testing::TinyConfig();
  auto synth = CreateCudaBackendSynthetic(c, 7);
  ASSERT_TRUE(synth.ok()) << synth.status();
  const ModelWeights host = SyntheticModelWeights(c, 7);
  auto uploaded = CreateCudaBackend(c, host);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  const auto a = Run(**synth), b = Run(**uploaded);
  ExpectSame(a, b);
  auto again = CreateCudaBackendSynthetic(c, 7);
  ASSERT_TRUE(again.ok());
  ExpectSame(a, Run(**again));
  auto other = CreateCudaBackendSynthetic(c, 8);
  ASSERT_TRUE(other.ok());
  const auto o = Run(**other);
  EXPECT_NE(a[0].next_soft, o[0].next_soft);
}

// Phase timing changes no result, fills every phase, and its sum fits in the step.
TEST_F(SyntheticBackendTest, PhaseTimingChangesNothing) {
  const ModelConfig c = testing::TinyConfig();
  CudaBackendOptions timed;
  timed.phase_timing = true;
  auto plain = CreateCudaBackendSynthetic(c, 7);
  auto with = CreateCudaBackendSynthetic(c, 7, timed);
  ASSERT_TRUE(plain.ok() && with.ok());
  EXPECT_FALSE(LastCudaPhaseTimes(**with).has_value());  // before the first step
  ExpectSame(Run(**plain), Run(**with));
  EXPECT_FALSE(LastCudaPhaseTimes(**plain).has_value());
  const auto t = LastCudaPhaseTimes(**with);
  ASSERT_TRUE(t.has_value());
  EXPECT_GT(t->brackets, 4 * c.num_layers);  // dense, attention, dense, moe, dense per layer
  EXPECT_GT(t->attention_ms, 0);
  EXPECT_GT(t->moe_ms, 0);
  EXPECT_GT(t->dense_ms, 0);
  EXPECT_GT(t->vocab_ms, 0);
}

// Exact counts for the GEMM wrappers: one conversion kernel and one cuBLAS call per bf16 term.
TEST_F(CudaTest, CountsGemmWrapperLaunches) {
  const int rows = 5, in = 8, out = 4;
  float* x = Alloc<float>(size_t(rows) * in);
  uint16_t* w = Alloc<uint16_t>(size_t(3) * out * in);
  float* y = Alloc<float>(size_t(rows) * out);
  for (const auto& [input, terms] :
       {std::pair{cuda::GemmInput::kBf16, 1}, std::pair{cuda::GemmInput::kFloat32, 3}}) {
    cuda::CublasContext ctx(input);
    ASSERT_TRUE(ctx.Linear(x, w, rows, in, out, y).ok());  // the first call allocates scratch
    cuda::LaunchCounts before = cuda::ReadLaunchCounts();
    ASSERT_TRUE(ctx.Linear(x, w, rows, in, out, y).ok());
    cuda::LaunchCounts d = cuda::ReadLaunchCounts() - before;
    EXPECT_EQ(d.kernels, uint64_t(terms));
    EXPECT_EQ(d.cublas, uint64_t(terms));
    EXPECT_EQ(d.blocking(), 0u);
    EXPECT_EQ(d.allocs, 0u);
    // Three groups, the middle one empty (skipped): two GEMMs per term.
    const int32_t offsets[] = {0, 2, 2, 5};
    before = cuda::ReadLaunchCounts();
    ASSERT_TRUE(ctx.GroupedLinear(x, w, 3, offsets, nullptr, in, out, y).ok());
    d = cuda::ReadLaunchCounts() - before;
    EXPECT_EQ(d.kernels, uint64_t(terms));
    EXPECT_EQ(d.cublas, uint64_t(2 * terms));
    EXPECT_EQ(d.launches(), uint64_t(3 * terms));
  }
  // One kernel per elementwise op.
  const cuda::LaunchCounts before = cuda::ReadLaunchCounts();
  ASSERT_TRUE(cuda::RmsNorm(x, nullptr, rows, in, 1e-6f, x).ok());
  ASSERT_TRUE(cuda::Softcap(x, rows * in, 30.0f).ok());
  EXPECT_EQ((cuda::ReadLaunchCounts() - before).kernels, 2u);
}

// A step's counts: the same step twice gives the same counts, and (under the emulation, run
// eagerly so that every call is seen once) the cuBLAS calls and host↔device copies counted by
// cuda_profile.h are exactly those the emulated runtime saw, so no call site is missed. With CUDA
// graphs (the default) the third run of a shape is a replay: one graph launch, the same kernels
// counted, no upload or download that blocks, and one wait.
TEST_F(SyntheticBackendTest, StepCountsAreCompleteAndStable) {
  const ModelConfig c = testing::TinyConfig();
  CudaBackendOptions eager_options;
  eager_options.cuda_graphs = false;
  auto b = CreateCudaBackendSynthetic(c, 7, eager_options);
  ASSERT_TRUE(b.ok());
  Run(**b);  // warm: scratch buffers allocated
  std::vector<cuda::LaunchCounts> first, second;
#if defined(DGSERVE_CUDA_EMULATION)
  const cuda::emu::CallCounts emu0 = cuda::emu::ReadCallCounts();
  const cuda::LaunchCounts ours0 = cuda::ReadLaunchCounts();
#endif
  Run(**b, &first);
#if defined(DGSERVE_CUDA_EMULATION)
  const cuda::emu::CallCounts emu1 = cuda::emu::ReadCallCounts();
  const cuda::LaunchCounts ours = cuda::ReadLaunchCounts() - ours0;
  EXPECT_EQ(ours.cublas, emu1.gemms - emu0.gemms);
  // Pageable copies block (h2d, d2h); the step's copies are from and to pinned memory (d2d).
  EXPECT_EQ(ours.h2d + ours.d2h + ours.d2d,
            (emu1.h2d - emu0.h2d) + (emu1.d2h - emu0.d2h) + (emu1.d2d - emu0.d2d));
#endif
  Run(**b, &second);
  ASSERT_EQ(first.size(), 2u);
  ASSERT_EQ(second.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(first[s].kernels, second[s].kernels) << s;
    EXPECT_EQ(first[s].cublas, second[s].cublas) << s;
    EXPECT_EQ(first[s].d2d, second[s].d2d) << s;
    EXPECT_GT(first[s].kernels, uint64_t(10 * c.num_layers)) << s;
    EXPECT_EQ(first[s].cublas, 0u) << s;  // every kernel of the step is ours
    // No host in the step (issue 33 item 6): inputs and results through pinned memory, one
    // wait for the results at the end.
    EXPECT_EQ(first[s].h2d, 0u) << s;
    EXPECT_EQ(first[s].d2h, 0u) << s;
    EXPECT_EQ(first[s].syncs, 1u) << s;
    EXPECT_EQ(first[s].allocs, 0u) << s;  // scratch is warm
    EXPECT_EQ(first[s].graphs, 0u) << s;
  }
  // The same steps with graphs: eager, captured, then replayed, with the eager counts.
  auto g = CreateCudaBackendSynthetic(c, 7);
  ASSERT_TRUE(g.ok());
  const auto eager_out = Run(**b);
  Run(**g);
  Run(**g);
  std::vector<cuda::LaunchCounts> replayed;
  ExpectSame(eager_out, Run(**g, &replayed));
  ASSERT_EQ(replayed.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(replayed[s].graphs, 1u) << s;
    EXPECT_EQ(replayed[s].kernels, first[s].kernels) << s;
    EXPECT_EQ(replayed[s].cublas, first[s].cublas) << s;
    EXPECT_EQ(replayed[s].d2d, first[s].d2d) << s;
    EXPECT_EQ(replayed[s].blocking(), 1u) << s;  // the wait for the results
    EXPECT_EQ(replayed[s].allocs, 0u) << s;
  }
  const auto stats = GetCudaGraphStats(**g);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->captures, 2);
  EXPECT_EQ(stats->replays, 4);  // the second run's captured steps, the third run's
  EXPECT_EQ(stats->capture_failures, 0) << stats->last_failure;
}

// Split-KV's grid depends on the split bound (TensorCoreCanvasAttention with max_splits > 1):
// with every layer on the tensor cores the step's shape key holds no context length, so canvases
// A (context 20: one split of 32 keys) and B (40: two) have the same key but for the bound.
// B's step first (it sizes the split scratch), A's captured and replayed, then B again: B must
// not replay A's unsplit graph — the graph backend's results equal an eager backend's bit for bit
// (with the bound left out of the key, B's third step replays A's graph and differs).
TEST_F(SyntheticBackendTest, SplitBoundIsPartOfTheGraphKey) {
  ModelConfig c = testing::TinyConfig();
  c.head_dim = 32;  // every layer on the tensor cores (head dims multiples of 32)
  c.global_head_dim = 64;
  CudaBackendOptions options;
  options.tensor_core_attention = true;
  options.canvas_split_keys = 32;
  options.cuda_graphs = false;
  auto eager = CreateCudaBackendSynthetic(c, 7, options);
  options.cuda_graphs = true;
  auto graphs = CreateCudaBackendSynthetic(c, 7, options);
  ASSERT_TRUE(eager.ok() && graphs.ok());
  ModelBackend* backends[2] = {eager->get(), graphs->get()};
  const int C = c.canvas_length, D = c.hidden_size;
  std::vector<std::unique_ptr<ContiguousKvCache>> kv[2];
  for (int b = 0; b < 2; ++b) {
    for (const int len : {20, 40}) {  // A, B
      kv[b].push_back(std::make_unique<ContiguousKvCache>(c, 64));
      std::vector<int32_t> prompt(len);
      for (int i = 0; i < len; ++i) prompt[i] = (i * 5 + len) % c.vocab_size;
      EncodeInput enc{prompt, kv[b].back().get()};
      ASSERT_TRUE(backends[b]->Encode({&enc, 1}).ok());
    }
  }
  std::vector<int32_t> canvas(C);
  for (int i = 0; i < C; ++i) canvas[i] = (i * 7 + 3) % c.vocab_size;
  std::vector<float> uniforms(C);
  for (int i = 0; i < C; ++i) uniforms[i] = float((i * 37 + 5) % 100) / 100.0f;
  for (const int which : {1, 0, 0, 0, 1, 1}) {
    StepOut out[2];
    for (int b = 0; b < 2; ++b) {
      out[b].rows.resize(C);
      out[b].next_soft.resize(size_t(C) * D);
      DenoiseStepInput in;
      in.canvas = canvas;
      in.kv = kv[b][which].get();
      in.temperature = 0.8f;
      in.uniforms = uniforms;
      in.rows = out[b].rows.data();
      in.next_soft = out[b].next_soft.data();
      const absl::Status st = backends[b]->DenoiseStep({&in, 1});
      ASSERT_TRUE(st.ok()) << st;
    }
    ExpectSame({out[0]}, {out[1]});
  }
  const auto stats = GetCudaGraphStats(**graphs);
  ASSERT_TRUE(stats.has_value());
  EXPECT_EQ(stats->capture_failures, 0) << stats->last_failure;
  EXPECT_GE(stats->replays, 3);
}

// A known number of launches and host round trips for a tiny step, counted from today's step
// (bf16 GEMM input: one DenseLinear kernel per projection; every expert takes
// every row, so no expert group is skipped), run eagerly. Issue 33 items 3–6 change these
// numbers on purpose (device routing, grouped GEMMs, no host in the step): update the table
// below with the step, item by item.
TEST_F(SyntheticBackendTest, TinyStepLaunchCounts) {
  ModelConfig c = testing::TinyConfig();  // layers S F
  c.top_k_experts = c.num_experts;        // 4 of 4: all groups non-empty
  CudaBackendOptions options;
  options.gemm_input = cuda::GemmInput::kBf16;
  options.cuda_graphs = false;
  auto b = CreateCudaBackendSynthetic(c, 7, options);
  ASSERT_TRUE(b.ok()) << b.status();
  Run(**b);  // warm: scratch allocated for both step kinds
  std::vector<cuda::LaunchCounts> steps;
  Run(**b, &steps);
  ASSERT_EQ(steps.size(), 2u);
  // Per layer: input norm; q, k (and v on sliding layers) projections (DenseLinear); q/k/v norms;
  // 2 RoPE; attention; o projection; post-attention norm and add; pre-FF norm, gated MLP (3
  // projections + gelu), post-FF norm; MoE (router norm and scale, routing, grouping, expert norm,
  // grouped gate_up and down, per-row sum: cuda_moe; the router's GEMM, DenseLinear; the router
  // input's bf16 rounding is done by its scale kernel), its norm; the final add, norm and scaled
  // add.
  const uint64_t layer_kernels_sliding = 1 + 3 + 3 + 2 + 1 + 1 + 2 + 1 + 4 + 1 + 9 + 1 + 3;
  const uint64_t layer_kernels_full = layer_kernels_sliding - 1;  // V = rms(K): a device copy
  // No cuBLAS in a layer: the projections and the router are DenseLinear since issue 33 item 7
  // (they were 8 cuBLAS calls and 7 conversion kernels on a sliding layer, 7 and 6 on a full).
  const uint64_t layer_cublas_sliding = 0, layer_cublas_full = 0;
  // Embedding, input norm, the layers, final norm; vocabulary (the fused pass, issue 33 item 5):
  // LM-head tiles, per-row combine, the sampled tile's scan; the soft embedding on the device
  // (cuda_soft_embed: its tile kernel and its chunk sum; it was the bf16 probabilities kernel and
  // a cuBLAS GEMM). No cuBLAS in the step.
  const uint64_t kernels = 1 + 1 + layer_kernels_sliding + layer_kernels_full + 1 + 3 + 2;
  const uint64_t cublas = layer_cublas_sliding + layer_cublas_full;
  // The self-conditioning MLP of the second step: norm, 3 projections + gelu, add.
  const uint64_t sc_kernels = 1 + 4 + 1, sc_cublas = 0;
  // Copies queued on the stream (issue 33 item 6: from and to pinned memory, none blocks): k → v
  // on the full layer; uploads of ids, positions, the attention table (every layer's canvases:
  // CanvasAttentionTable), temperatures, uniforms (+ the soft embedding with self-conditioning);
  // downloads of the row results and the next soft embedding. One wait.
  const uint64_t copies = 1 + 5 + 2;
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE(s == 0 ? "step without self-conditioning" : "step with self-conditioning");
    EXPECT_EQ(steps[s].kernels, kernels + (s == 1 ? sc_kernels : 0));
    EXPECT_EQ(steps[s].cublas, cublas + (s == 1 ? sc_cublas : 0));
    EXPECT_EQ(steps[s].d2d, copies + (s == 1 ? 1 : 0));
    EXPECT_EQ(steps[s].h2d, 0u);
    EXPECT_EQ(steps[s].d2h, 0u);
    EXPECT_EQ(steps[s].syncs, 1u);
    EXPECT_EQ(steps[s].allocs, 0u);
  }
  EXPECT_EQ(steps[0].launches(), 71u + 0u + 8u);  // the table above, summed by hand
}

// The encoder pass copies its new K/V rows to the host cache through pinned staging: with every
// layer's rows inside it (the default) the pass waits once, at its end, and downloads nothing
// from pageable memory; with a staging of one layer it waits once per layer. The host caches get
// the same bits either way.
TEST_F(SyntheticBackendTest, EncodeStagesKvAndWaitsOnce) {
  const ModelConfig c = testing::TinyConfig();
  CudaBackendOptions one_layer;
  one_layer.encode_staging_bytes = 1;  // at least one layer's rows, whatever this says
  // The copy in the pass (not deferred to SyncKvToHost) is what this test is about.
  one_layer.defer_kv_host_copy = false;
  CudaBackendOptions whole;
  whole.defer_kv_host_copy = false;
  auto a = CreateCudaBackendSynthetic(c, 7, whole);
  auto b = CreateCudaBackendSynthetic(c, 7, one_layer);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<int32_t> prompt(40);
  for (int i = 0; i < 40; ++i) prompt[i] = (i * 13 + 5) % c.vocab_size;
  ContiguousKvCache ka(c, 64), kb(c, 64);
  for (int chunk = 0; chunk < 2; ++chunk) {
    const std::span<const int32_t> part = std::span<const int32_t>(prompt).subspan(20 * chunk, 20);
    EncodeInput ia{part, &ka}, ib{part, &kb};
    const cuda::LaunchCounts a0 = cuda::ReadLaunchCounts();
    ASSERT_TRUE((*a)->Encode({&ia, 1}).ok());
    const cuda::LaunchCounts da = cuda::ReadLaunchCounts() - a0;
    const cuda::LaunchCounts b0 = cuda::ReadLaunchCounts();
    ASSERT_TRUE((*b)->Encode({&ib, 1}).ok());
    const cuda::LaunchCounts db = cuda::ReadLaunchCounts() - b0;
    SCOPED_TRACE(chunk);
    EXPECT_EQ(da.syncs, 1u);
    EXPECT_EQ(da.d2h, 0u);
    EXPECT_EQ(da.h2d, 0u);  // the mirror has every row it needs (this backend encoded them)
    EXPECT_EQ(db.syncs, uint64_t(c.num_layers));
  }
  ASSERT_EQ(ka.num_tokens(), 40);
  ASSERT_EQ(kb.num_tokens(), 40);
  for (int l = 0; l < c.num_layers; ++l) {
    const size_t w = size_t(c.KvHeads(l)) * c.HeadDim(l) * sizeof(float);
    for (int p = 0; p < 40; ++p) {
      ASSERT_EQ(std::memcmp(ka.KeyRow(l, p), kb.KeyRow(l, p), w), 0) << "layer " << l << " " << p;
      ASSERT_EQ(std::memcmp(ka.ValueRow(l, p), kb.ValueRow(l, p), w), 0)
          << "layer " << l << " " << p;
    }
  }
  // And the rows are the encoder's (not zeros): a later position's key differs from the first.
  EXPECT_NE(std::memcmp(ka.KeyRow(0, 0), ka.KeyRow(0, 39), size_t(c.KvHeads(0)) * c.HeadDim(0) * 4),
            0);
}

// The bf16 KV mirror (CudaBackendOptions::bf16_kv_mirror, every layer on the tensor cores) gives
// the float32 mirror's bits: the tensor-core kernels round every context K/V element to bf16 as
// they load it, and the bf16 mirror holds exactly those roundings. 45 prompt tokens encoded in
// chunks that cross the sliding layer's ring edges (W = 4: a ring of 4 rows, wrapping about ten
// times; one chunk of 13 rows, longer than the ring), so the encoder writes its rows into the
// ring (bf16 rounded on the device) and reads its context from it; the host K/V rows are the
// same bits (the host cache stays float32). Then the decoder's logits on each encoded cache, and
// on the other backend's cache (SyncMirror uploads the rows, rounded on the host), with split-KV
// (splits of 32 keys: the full layer's 45 context keys take two). The mirror's bytes halve: the
// hand count, in the device block pool with blocks of 4, is sliding K, V × 8 rows (blocks 10 and
// 11: positions 40 … 47 hold the window 42 … 44) × 1 KV head × 32 × 2 B (1,024) + full K, V ×
// 48 rows (12 blocks) × 1 × 64 × 2 B (12,288); float32 twice that.
TEST_F(SyntheticBackendTest, Bf16KvMirrorEqualsFloat32MirrorBitForBit) {
  ModelConfig c = testing::TinyConfig();
  c.head_dim = 32;  // every layer on the tensor cores (head dims multiples of 32)
  c.global_head_dim = 64;
  ASSERT_EQ(c.sliding_window, 4);
  ASSERT_EQ(c.num_layers, 2);
  ASSERT_FALSE(c.IsFull(0));
  ASSERT_TRUE(c.IsFull(1));
  ASSERT_EQ(c.KvHeads(0), 1);
  ASSERT_EQ(c.KvHeads(1), 1);
  CudaBackendOptions options;
  options.tensor_core_attention = true;
  options.canvas_split_keys = 32;
  options.kv_block_size = 4;  // the device block pool in blocks of 4 (W = 4)
  // The host rows compared below are the encoder's float32 rows, copied in the pass (deferred,
  // SyncKvToHost would write the bf16 mirror's values: CudaKvAuthorityTest).
  options.defer_kv_host_copy = false;
  ASSERT_TRUE(options.bf16_kv_mirror);  // the default
  auto bf16 = CreateCudaBackendSynthetic(c, 7, options);
  options.bf16_kv_mirror = false;
  auto f32 = CreateCudaBackendSynthetic(c, 7, options);
  ASSERT_TRUE(bf16.ok() && f32.ok());
  std::vector<int32_t> prompt(45);
  for (int i = 0; i < 45; ++i) prompt[i] = (i * 13 + 5) % c.vocab_size;
  ContiguousKvCache kb(c, 64), kf(c, 64);
  int at = 0;
  for (const int n : {5, 1, 13, 10, 16}) {
    const std::span<const int32_t> part = std::span<const int32_t>(prompt).subspan(at, n);
    EncodeInput ib{part, &kb}, iff{part, &kf};
    ASSERT_TRUE((*bf16)->Encode({&ib, 1}).ok());
    ASSERT_TRUE((*f32)->Encode({&iff, 1}).ok());
    at += n;
  }
  ASSERT_EQ(kb.num_tokens(), 45);
  for (int l = 0; l < c.num_layers; ++l) {
    const size_t w = size_t(c.KvHeads(l)) * c.HeadDim(l) * sizeof(float);
    for (int p = 0; p < 45; ++p) {
      ASSERT_EQ(std::memcmp(kb.KeyRow(l, p), kf.KeyRow(l, p), w), 0) << "layer " << l << " " << p;
      ASSERT_EQ(std::memcmp(kb.ValueRow(l, p), kf.ValueRow(l, p), w), 0)
          << "layer " << l << " " << p;
    }
  }
  // The host rows stay float32: some element is not a bf16 value (its low 16 bits are not 0).
  bool unrounded = false;
  for (int i = 0; i < c.KvHeads(1) * c.HeadDim(1); ++i) {
    uint32_t bits;
    std::memcpy(&bits, kb.KeyRow(1, 44) + i, 4);
    unrounded = unrounded || (bits & 0xFFFFu) != 0;
  }
  EXPECT_TRUE(unrounded);
  EXPECT_EQ(CudaKvMirrorBytes(**bf16, kb).value_or(-1), 1024 + 12288);
  EXPECT_EQ(CudaKvMirrorBytes(**f32, kf).value_or(-1), 2 * (1024 + 12288));
  // One sequence at 45 positions: sliding 2 × 8 × 32, full 2 × 48 × 64 elements.
  EXPECT_EQ(CudaKvBytesPerSequence(c, 45, options), (2 * 8 * 32 + 2 * 48 * 64) * 4);
  options.bf16_kv_mirror = true;
  EXPECT_EQ(CudaKvBytesPerSequence(c, 45, options), (2 * 8 * 32 + 2 * 48 * 64) * 2);
  const int C = c.canvas_length, V = c.vocab_size;
  std::vector<int32_t> canvas(C);
  for (int i = 0; i < C; ++i) canvas[i] = (i * 7 + 3) % V;
  auto logits = [&](ModelBackend& b, const KvCache& kv) {
    std::vector<float> out(size_t(C) * V, NAN);
    DecodeInput in;
    in.canvas = canvas;
    in.kv = &kv;
    in.logits = out.data();
    EXPECT_TRUE(b.Decode({&in, 1}).ok());
    return out;
  };
  auto expect_same = [](const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(std::isfinite(a[i])) << i;
      ASSERT_EQ(std::memcmp(&a[i], &b[i], 4), 0) << i;
    }
  };
  expect_same(logits(**bf16, kb), logits(**f32, kf));
  // Caches each backend has not seen: every visible row uploaded (45 positions into a ring of 4).
  expect_same(logits(**bf16, kf), logits(**f32, kb));
}

// The ceilings measure something on small sizes (the real sizes are engine_bench's defaults).
TEST_F(CudaTest, MeasuresCeilings) {
  auto c = cuda::MeasureCeilings(size_t(1) << 16, 16, 2);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->copy_bytes, size_t(1) << 16);
  EXPECT_GT(c->copy_gbs, 0);
  EXPECT_EQ(c->gemm_n, 16);
  EXPECT_GT(c->gemm_tflops, 0);
  EXPECT_FALSE(cuda::CurrentDeviceName().empty());
}

// The device KV bytes per sequence of the real 30-layer shape (bench/configs/
// diffusiongemma-26b-a4b.json: 25 sliding layers of 8 KV heads × 256, 5 full of 2 × 512,
// W = 1024), counted by hand: sliding 25 × K, V × 1024 rows × 2048 floats × 4 B = 419,430,400
// at any context ≥ 1024; full 5 × K, V × n × 1024 floats × 4 B = 40,960·n.
TEST(CudaKvBytesTest, RealShapeMatchesHandCount) {
  // The source tree: ctest's DGSERVE_SOURCE_DIR, or the working directory (tools/gpu_check.sh
  // runs the test binaries from the repository root, without ctest).
  const char* src = std::getenv("DGSERVE_SOURCE_DIR");
  auto c = LoadModelConfig(std::string(src != nullptr ? src : ".") +
                           "/bench/configs/diffusiongemma-26b-a4b.json");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->num_layers, 30);
  ASSERT_EQ(c->sliding_window, 1024);
  // The float32 mirror (tensor_core_attention off: the float32 kernels).
  CudaBackendOptions f32;
  f32.tensor_core_attention = false;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2048, f32), int64_t{419430400} + int64_t{83886080});
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 32768, f32), int64_t{419430400} + int64_t{1342177280});
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 131072, f32), int64_t{419430400} + int64_t{5368709120});
  // Below the window every layer holds every position: 30 layers' 450,560 B / 4 per position,
  // in whole blocks of 64 positions with the block pool (the default: 128 rows), exactly 100
  // in per-sequence arrays (kv_block_size 0).
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 100, f32),
            int64_t{128} * (25 * 2 * 2048 + 5 * 2 * 1024) * 4);
  CudaBackendOptions f32_arrays = f32;
  f32_arrays.kv_block_size = 0;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 100, f32_arrays),
            int64_t{100} * (25 * 2 * 2048 + 5 * 2 * 1024) * 4);
  // Blocks of 64 at 2,000 positions: full 32 blocks (2,048 rows), sliding the blocks of
  // positions [977, 2000): 15 … 31, 17 blocks (1,088 rows), against the arrays' 2,000 and 1,024.
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2000, f32),
            int64_t{1088} * 25 * 2 * 2048 * 4 + int64_t{2048} * 5 * 2 * 1024 * 4);
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2000, f32_arrays),
            int64_t{1024} * 25 * 2 * 2048 * 4 + int64_t{2000} * 5 * 2 * 1024 * 4);
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 0, f32), 0);
  // The float32 GEMM-input mode keeps the float32 kernels, so its mirror too.
  CudaBackendOptions exact;
  exact.gemm_input = cuda::GemmInput::kFloat32;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 32768, exact), int64_t{419430400} + int64_t{1342177280});
  // The bf16 mirror (the default options: tensor_core_attention with bf16_kv_mirror; head dims
  // 256 and 512 both take the tensor cores, so every layer stores 2 B an element): sliding 25 ×
  // K, V × 1024 rows × 2048 × 2 B = 209,715,200; full 5 × K, V × n × 1024 × 2 B = 20,480·n.
  CudaBackendOptions tc;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2048), int64_t{209715200} + int64_t{41943040});
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2048, tc), int64_t{209715200} + int64_t{41943040});
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 32768, tc), int64_t{209715200} + int64_t{671088640});
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 131072, tc), int64_t{209715200} + int64_t{2684354560});
  // Issue 34's target: at most 1 GB of K/V per 32k sequence.
  EXPECT_LE(CudaKvBytesPerSequence(*c, 32768, tc), int64_t{1000000000});
  // bf16_kv_mirror off: float32 again, as without the tensor cores.
  tc.bf16_kv_mirror = false;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 32768, tc), int64_t{419430400} + int64_t{1342177280});
  // Every position on every layer (sliding_kv_ring off): 2048 × (25 × 2 × 2048 + 5 × 2 × 1024)
  // × 4 B = 922,746,880 float32, half that bf16 (DEVICE_CHECK.md's table).
  tc.sliding_kv_ring = false;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2048, tc), int64_t{922746880});
  tc.bf16_kv_mirror = true;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 2048, tc), int64_t{461373440});
  // A layer mix: sliding head_dim 80 (not a multiple of 32: float32 kernels, float32 mirror)
  // beside the full layers' 512 (bf16): 25 × K, V × 1024 rows × 8 × 80 × 4 B = 131,072,000 plus
  // 20,480 B a position.
  tc.sliding_kv_ring = true;
  c->head_dim = 80;
  EXPECT_EQ(CudaKvBytesPerSequence(*c, 32768, tc), int64_t{131072000} + int64_t{671088640});
}

}  // namespace
}  // namespace dgserve
