// FusedSoftEmbedding (the self-conditioning soft embedding on the device, no [rows, V]
// probabilities) against (a) the float64 product of today's path's probabilities
// (FusedSoftmaxProbsBf16, the same bits by construction: a tight float32-rounding bound), (b) the
// CPU's soft embedding (cpu::FusedVocabStep, float32 exps: the bf16 rounding of p apart), and
// (c) itself, a row alone against the row in a batch (bit for bit). Label `gpu`; the same tests
// run under the emulation (label `gpu-emu`) on these small shapes.
#include "engine/cuda/cuda_soft_embed.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/bf16.h"
#include "common/testing/status_matchers.h"
#include "engine/cpu/cpu_vocab.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/cuda/cuda_test_util.h"
#include "engine/cuda/cuda_vocab.h"
#include "engine/denoise/row_sampler.h"
#include "gtest/gtest.h"

namespace dgserve::cuda {
namespace {

using ::dgserve::testing::IsOk;
using ::dgserve::testing::StatusIs;

constexpr float kCap = 30.0f;

struct Problem {
  int rows = 0, dim = 0, vocab = 0;
  std::vector<float> hidden;     // [rows, dim]
  std::vector<uint16_t> embed;   // [vocab, dim] bf16
  std::vector<float> temps, us;  // [rows]
  std::vector<uint64_t> mask_table;
  std::vector<int32_t> mask_index;  // empty: no masks
  std::vector<float> eps;           // [rows] sparse budgets; empty: every row dense
  float scale = 1.0f;               // embed_scale
};

// Random hidden states and table: raw logits ≈ N(0, sigma[r]²).
Problem RandomProblem(int vocab, int dim, const std::vector<float>& sigma, uint32_t seed) {
  Problem p;
  p.rows = int(sigma.size());
  p.dim = dim;
  p.vocab = vocab;
  p.scale = Bf16ToFloat(FloatToBf16(std::sqrt(float(dim))));
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  p.embed.resize(size_t(vocab) * dim);
  for (uint16_t& e : p.embed) e = FloatToBf16(normal(gen));
  p.hidden.resize(size_t(p.rows) * dim);
  for (int r = 0; r < p.rows; ++r) {
    for (int k = 0; k < dim; ++k) {
      p.hidden[size_t(r) * dim + k] = sigma[r] / std::sqrt(float(dim)) * normal(gen);
    }
  }
  for (int r = 0; r < p.rows; ++r) {
    p.temps.push_back(0.45f + 0.1f * float(r % 13));
    p.us.push_back(float((r * 37) % 100) / 100.0f);
  }
  return p;
}

// Makes row r peaked: its hidden state a table row (logit ≈ ‖E_target‖² against N(0, dim)).
void Peak(Problem& p, int r, int target) {
  for (int k = 0; k < p.dim; ++k) {
    p.hidden[size_t(r) * p.dim + k] = Bf16ToFloat(p.embed[size_t(target) * p.dim + k]);
  }
}

class CudaSoftEmbedTest : public CudaTest {
 protected:
  struct Run {
    std::vector<VocabRowResult> results;
    std::vector<float> soft;      // FusedSoftEmbedding, [rows, dim]
    std::vector<uint16_t> probs;  // FusedSoftmaxProbsBf16 (today's path), [rows, vocab]
  };

  // The arguments of a FusedVocabStep on rows [row0, row0 + rows) of p (device copies).
  FusedVocabArgs Args(const Problem& p, bool bf16, int row0, int rows) {
    auto slice = [&](const auto& v, size_t per) {
      using T = typename std::decay_t<decltype(v)>::value_type;
      return std::vector<T>(v.begin() + row0 * per, v.begin() + (row0 + rows) * per);
    };
    FusedVocabArgs a;
    a.hidden = Upload(slice(p.hidden, p.dim));
    a.rows = rows;
    a.dim = p.dim;
    a.embed = Upload(p.embed);
    a.vocab = p.vocab;
    a.bf16_input = bf16;
    a.softcap = kCap;
    a.temperature = Upload(slice(p.temps, 1));
    a.uniforms = Upload(slice(p.us, 1));
    if (!p.mask_index.empty()) {
      a.mask_table = Upload(p.mask_table);
      a.mask_index = Upload(slice(p.mask_index, 1));
    }
    a.out = Alloc<VocabRowResult>(rows, 0xFF);
    a.scratch = Alloc<char>(FusedVocabScratchBytes(rows, p.vocab), 0xFF);
    if (!p.eps.empty()) {
      const int tiles = (p.vocab + kFusedVocabTile - 1) / kFusedVocabTile;
      float* norms = Alloc<float>(tiles, 0xFF);
      EXPECT_THAT(FusedTileNormMax(a.embed, p.vocab, p.dim, norms), IsOk());
      a.sc_skip_mass = Upload(slice(p.eps, 1));
      a.tile_norm_max = norms;
      a.embed_scale = p.scale;
    }
    return a;
  }

  // FusedVocabStep, then FusedSoftEmbedding (and, with want_probs, FusedSoftmaxProbsBf16) on rows
  // [row0, row0 + rows) of p.
  Run RunRows(const Problem& p, bool bf16, int row0 = 0, int rows = -1, bool want_probs = true) {
    if (rows < 0) rows = p.rows;
    const FusedVocabArgs a = Args(p, bf16, row0, rows);
    EXPECT_THAT(FusedVocabStep(a), IsOk());
    float* soft = Alloc<float>(size_t(rows) * p.dim, 0xFF);
    void* scratch = Alloc<char>(FusedSoftEmbeddingScratchBytes(rows, p.vocab, p.dim), 0xFF);
    EXPECT_THAT(FusedSoftEmbedding(a, a.out, p.scale, scratch, soft), IsOk());
    Run run;
    run.results = Download(a.out, rows);
    run.soft = Download(soft, size_t(rows) * p.dim);
    if (want_probs) {
      uint16_t* probs = Alloc<uint16_t>(size_t(rows) * p.vocab, 0xFF);
      EXPECT_THAT(FusedSoftmaxProbsBf16(a, a.out, probs), IsOk());
      run.probs = Download(probs, size_t(rows) * p.vocab);
    }
    return run;
  }

  // Row r of run.soft against scale · Σ_v p_v E_v in float64 over the probabilities of today's
  // path: per element within 3e-5 · scale · Σ_v |p_v E_v[k]| (float32 sums of ≤ 256 products per
  // tile, then ≤ 32 tiles and ≤ 32 chunks: (n − 1)·2⁻²⁴ ≤ 2e-5) plus the final scaling's rounding.
  // Returns the largest error relative to the row's norm.
  static double CheckAgainstProbs(const Problem& p, const Run& run, int r) {
    std::vector<double> ref(p.dim, 0.0), mag(p.dim, 0.0);
    for (int v = 0; v < p.vocab; ++v) {
      const double q = Bf16ToFloat(run.probs[size_t(r) * p.vocab + v]);
      if (q == 0) continue;
      for (int k = 0; k < p.dim; ++k) {
        const double x = q * Bf16ToFloat(p.embed[size_t(v) * p.dim + k]);
        ref[k] += x;
        mag[k] += std::fabs(x);
      }
    }
    double norm = 0, worst = 0;
    for (int k = 0; k < p.dim; ++k) norm += ref[k] * ref[k] * p.scale * p.scale;
    norm = std::sqrt(norm);
    int bad = 0;
    for (int k = 0; k < p.dim; ++k) {
      const double want = p.scale * ref[k], got = run.soft[size_t(r) * p.dim + k];
      const double tol = 3e-5 * p.scale * mag[k] + 6e-8 * std::fabs(want) + 1e-37;
      if (!(std::fabs(got - want) <= tol) && ++bad <= 3) {
        ADD_FAILURE() << "row " << r << " column " << k << ": " << got << " want " << want;
      }
      if (norm > 0) worst = std::max(worst, std::fabs(got - want) / norm);
    }
    EXPECT_EQ(bad, 0) << "row " << r;
    return worst;
  }

  // The CPU's soft embeddings (cpu::FusedVocabStep, dense: float32 exps) of p's rows, all good.
  static std::vector<float> CpuSoft(const Problem& p, bool bf16) {
    const cpu::PackedMatrix packed = cpu::PackedMatrix::FromBf16(p.embed.data(), p.vocab, p.dim);
    std::vector<const uint64_t*> masks(p.rows, nullptr);
    const int words = (p.vocab + 63) / 64;
    for (int r = 0; r < p.rows && !p.mask_index.empty(); ++r) {
      if (p.mask_index[r] >= 0) masks[r] = p.mask_table.data() + size_t(p.mask_index[r]) * words;
    }
    std::vector<RowResult> out(p.rows);
    std::vector<float> soft(size_t(p.rows) * p.dim);
    cpu::VocabStepArgs a;
    a.hidden = p.hidden.data();
    a.rows = p.rows;
    a.lm_head = &packed;
    a.embed = p.embed.data();
    a.vocab = p.vocab;
    a.dim = p.dim;
    a.softcap = kCap;
    a.temperature = p.temps.data();
    a.uniforms = p.us.data();
    a.embed_scale = p.scale;
    a.out = out.data();
    a.soft = soft.data();
    a.masks = masks.data();
    a.gemm_input = bf16 ? cpu::GemmInput::kBf16 : cpu::GemmInput::kFloat32;
    EXPECT_THAT(cpu::FusedVocabStep(a), IsOk());
    return soft;
  }

  // ‖gpu_r − cpu_r‖₂ / ‖cpu_r‖₂.
  static double RelativeToCpu(const Problem& p, const std::vector<float>& gpu,
                              const std::vector<float>& cpu_soft, int r) {
    double diff = 0, norm = 0;
    for (int k = 0; k < p.dim; ++k) {
      const double c = cpu_soft[size_t(r) * p.dim + k], g = gpu[size_t(r) * p.dim + k];
      diff += (g - c) * (g - c);
      norm += c * c;
    }
    return std::sqrt(diff / norm);
  }
};

// Dense rows of several spreads, masks, both GEMM input modes, an odd vocabulary (a partial last
// tile) and a dimension with a partial column slice: against today's probabilities (tight) and the
// CPU (the bf16 rounding of p: 2⁻⁸ of the norm allowed, ~2⁻¹¹ seen).
TEST_F(CudaSoftEmbedTest, DenseRowsMatchProbsProductAndCpu) {
  const int vocab = 1029, dim = 40;
  Problem p = RandomProblem(vocab, dim, {0.5f, 2.0f, 10.0f, 40.0f, 1.0f, 6.0f, 3.0f}, 5);
  const int words = (vocab + 63) / 64;
  p.mask_table.assign(size_t(2) * words, 0);
  for (int id = 0; id < vocab; id += 3) p.mask_table[id / 64] |= uint64_t(1) << (id % 64);
  for (int id = 300; id < 700; ++id) p.mask_table[words + id / 64] |= uint64_t(1) << (id % 64);
  p.mask_index = {-1, 0, -1, 1, -1, -1, 0};
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const Run run = RunRows(p, bf16);
    const std::vector<float> cpu_soft = CpuSoft(p, bf16);
    double worst_probs = 0, worst_cpu = 0;
    for (int r = 0; r < p.rows; ++r) {
      worst_probs = std::max(worst_probs, CheckAgainstProbs(p, run, r));
      const double rel = RelativeToCpu(p, run.soft, cpu_soft, r);
      EXPECT_LE(rel, 0x1p-8) << "row " << r;
      worst_cpu = std::max(worst_cpu, rel);
    }
    std::printf(
        "dense, bf16 input %d: max |soft − f64(probs)·E| / ‖s‖ = %.3g, max ‖soft − cpu‖ / "
        "‖cpu‖ = %.3g\n",
        int(bf16), worst_probs, worst_cpu);
  }
}

// Sparse rows (peaked, ε = 2⁻¹² or a budget the greedy sum decides) mixed with dense ones
// (ε = 0, flat): the product equals today's zeroed probabilities' (tight), peaked rows really
// leave tiles out, and the result stays within the sparse bound of the CPU's dense product.
TEST_F(CudaSoftEmbedTest, SparseRowsMatchZeroedProbsProduct) {
  const int vocab = 2053, dim = 40, tiles = (vocab + 255) / 256;
  Problem p = RandomProblem(vocab, dim, {1.0f, 1.0f, 1.0f, 1.0f, 0.3f, 1.0f, 3.0f}, 17);
  p.temps = {0.3f, 0.5f, 0.8f, 0.4f, 1.0f, 0.3f, 0.7f};
  const int target[] = {7, 1000, 2052, 300, -1, 555, -1};
  for (int r = 0; r < p.rows; ++r) {
    if (target[r] >= 0) Peak(p, r, target[r]);
  }
  p.eps = {0x1p-12f, 0x1p-12f, 0x1p-6f, 0x1p-12f, 0x1p-12f, 0.0f, 0x1p-12f};
  const int words = (vocab + 63) / 64;
  p.mask_table.assign(words, ~uint64_t(0));
  for (int w = 1; w < words; w += 2) p.mask_table[w] = 0;  // every other 64 ids
  p.mask_table[1000 / 64] = ~uint64_t(0);                  // row 1's target allowed
  p.mask_index = {-1, 0, -1, -1, -1, -1, 0};
  Problem dense = p;
  dense.eps.assign(p.rows, 0.0f);
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const Run run = RunRows(p, bf16);
    const Run full = RunRows(dense, bf16);
    const std::vector<float> cpu_soft = CpuSoft(dense, bf16);
    int rows_sparse = 0;
    double worst_probs = 0, worst_cpu = 0;
    for (int r = 0; r < p.rows; ++r) {
      worst_probs = std::max(worst_probs, CheckAgainstProbs(p, run, r));
      int left_out = 0;
      for (int t = 0; t < tiles; ++t) {
        bool zero = true, dense_mass = false;
        for (int v = t * 256; v < std::min(vocab, t * 256 + 256); ++v) {
          zero &= run.probs[size_t(r) * vocab + v] == 0;
          dense_mass |= full.probs[size_t(r) * vocab + v] != 0;
        }
        left_out += zero && dense_mass;
      }
      rows_sparse += left_out > 0;
      if (r == 5) {
        EXPECT_EQ(left_out, 0);  // ε = 0: dense
      }
      // Dropped mass ≤ 2⁻¹⁰‖s‖ (the plan's bound) plus the bf16 rounding of p.
      const double rel = RelativeToCpu(p, run.soft, cpu_soft, r);
      EXPECT_LE(rel, 0x1p-8 + 0x1p-10) << "row " << r;
      worst_cpu = std::max(worst_cpu, rel);
    }
    EXPECT_GE(rows_sparse, 3);  // the test means something
    std::printf(
        "sparse, bf16 input %d: %d rows leave tiles out; max |soft − f64(probs)·E| / ‖s‖ "
        "= %.3g, max ‖soft − cpu dense‖ / ‖cpu‖ = %.3g\n",
        int(bf16), rows_sparse, worst_probs, worst_cpu);
  }
}

// A row's soft embedding is the same bits alone, in a batch (two row blocks of 64) or in a window
// starting mid-block, with masked, sparse, dense and bad (NaN) neighbours; a bad row (lse NaN)
// gets +0 everywhere, as today's all-zero probabilities row through the GEMM.
TEST_F(CudaSoftEmbedTest, BatchedRowsMatchSoloRowsBitForBit) {
  const int vocab = 777, rows = 70, dim = 36;
  std::vector<float> sigma(rows);
  for (int r = 0; r < rows; ++r) sigma[r] = 0.5f + float((r * 7) % 23);
  Problem p = RandomProblem(vocab, dim, sigma, 21);
  for (int r = 0; r < rows; r += 4) Peak(p, r, (r * 97) % vocab);
  const int words = (vocab + 63) / 64;
  p.mask_table.assign(size_t(2) * words, ~uint64_t(0));
  for (int w = 0; w < words; w += 2) p.mask_table[w] = 0;  // mask 0: every other 64 ids
  for (int r = 0; r < rows; ++r) p.mask_index.push_back(r % 5 == 1 ? 0 : (r % 7 == 3 ? 1 : -1));
  for (int r = 0; r < rows; ++r) p.eps.push_back(r % 3 == 2 ? 0.0f : 0x1p-12f);
  p.hidden[size_t(5) * dim] = NAN;  // bad rows among them
  p.hidden[size_t(66) * dim] = NAN;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "bf16 input " << bf16);
    const Run all = RunRows(p, bf16);
    for (const int bad : {5, 66}) {
      EXPECT_EQ(all.results[bad].argmax, -1);
      for (int k = 0; k < dim; ++k) {
        EXPECT_EQ(std::memcmp(&all.soft[size_t(bad) * dim + k], "\0\0\0\0", 4), 0) << bad;
      }
    }
    for (int r = 0; r < rows; ++r) {
      const Run solo = RunRows(p, bf16, r, 1, /*want_probs=*/false);
      EXPECT_EQ(std::memcmp(solo.soft.data(), &all.soft[size_t(r) * dim], sizeof(float) * dim), 0)
          << "row " << r;
      CheckAgainstProbs(p, all, r);
    }
    // Rows that leave a whole tile out (the batch then computes tiles that a row alone skips).
    int rows_sparse = 0;
    for (int r = 0; r < rows; ++r) {
      bool any = false;
      for (int t = 0; t * 256 < vocab && r != 5 && r != 66; ++t) {
        bool zero = true;
        for (int v = t * 256; v < std::min(vocab, t * 256 + 256); ++v) {
          zero &= all.probs[size_t(r) * vocab + v] == 0;
        }
        any |= zero;
      }
      rows_sparse += any;
    }
    EXPECT_GE(rows_sparse, 5);
    const Run part = RunRows(p, bf16, 13, 55, /*want_probs=*/false);
    EXPECT_EQ(std::memcmp(part.soft.data(), &all.soft[size_t(13) * dim], sizeof(float) * 55 * dim),
              0);
  }
}

// More rows than one slab (512): the second slab's rows are placed and summed as the first's.
TEST_F(CudaSoftEmbedTest, RowsBeyondOneSlab) {
  const int vocab = 300, dim = 16, rows = 530;
  std::vector<float> sigma(rows);
  for (int r = 0; r < rows; ++r) sigma[r] = 1.0f + float(r % 11);
  const Problem p = RandomProblem(vocab, dim, sigma, 9);
  const Run all = RunRows(p, /*bf16=*/true);
  for (int r = 0; r < rows; ++r) CheckAgainstProbs(p, all, r);
  for (const int r : {0, 511, 512, 529}) {
    const Run solo = RunRows(p, true, r, 1, /*want_probs=*/false);
    EXPECT_EQ(std::memcmp(solo.soft.data(), &all.soft[size_t(r) * dim], sizeof(float) * dim), 0)
        << "row " << r;
  }
}

// Captured in a CUDA graph (no allocation, no synchronisation, everything on args.stream) and
// replayed twice: the same bits as the direct call.
TEST_F(CudaSoftEmbedTest, CapturesInAGraph) {
  const int vocab = 600, dim = 24;
  Problem p = RandomProblem(vocab, dim, {1.0f, 5.0f, 20.0f}, 11);
  Peak(p, 0, 42);
  p.eps = {0x1p-12f, 0.0f, 0x1p-12f};
  const Run direct = RunRows(p, /*bf16=*/true, 0, -1, /*want_probs=*/false);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  FusedVocabArgs a = Args(p, true, 0, p.rows);
  a.stream = stream;
  ASSERT_THAT(FusedVocabStep(a), IsOk());
  float* soft = Alloc<float>(size_t(p.rows) * dim, 0xFF);
  void* scratch = Alloc<char>(FusedSoftEmbeddingScratchBytes(p.rows, vocab, dim), 0xFF);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const absl::Status st = FusedSoftEmbedding(a, a.out, p.scale, scratch, soft);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_THAT(st, IsOk());
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int i = 0; i < 2; ++i) {
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<float> got = Download(soft, size_t(p.rows) * dim);
    EXPECT_EQ(std::memcmp(got.data(), direct.soft.data(), sizeof(float) * got.size()), 0) << i;
  }
  EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Argument checks return before touching the device: these run without a GPU too.
TEST(CudaSoftEmbedArgsTest, ScratchAndBadArguments) {
  EXPECT_EQ(FusedSoftChunks(262144), 32);
  EXPECT_EQ(FusedSoftChunks(777), 4);
  EXPECT_EQ(FusedSoftEmbeddingScratchBytes(0, 777, 36), 0u);
  EXPECT_EQ(FusedSoftEmbeddingScratchBytes(70, 777, 36), size_t(70) * 4 * 36 * 4);
  EXPECT_EQ(FusedSoftEmbeddingScratchBytes(4096, 262144, 2560), size_t(512) * 32 * 2560 * 4);
  FusedVocabArgs a;
  a.vocab = 512;
  a.dim = 8;
  EXPECT_THAT(FusedSoftEmbedding(a, nullptr, 1.0f, nullptr, nullptr), IsOk());  // rows = 0
  a.rows = 2;
  EXPECT_THAT(FusedSoftEmbedding(a, nullptr, 1.0f, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
  a.vocab = 0;
  EXPECT_THAT(FusedSoftEmbedding(a, nullptr, 1.0f, nullptr, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

}  // namespace
}  // namespace dgserve::cuda
