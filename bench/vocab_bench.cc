// The vocabulary-sized work of one denoising step (cpu::FusedVocabStep: LM head, softmax,
// entropy, sampling, self-conditioning soft embedding) on synthetic hidden states whose
// distributions range from diffuse to peaked, dense product against the sparse one (cpu_vocab.h),
// timed in alternation (best of --rounds). A random checkpoint's rows are nearly uniform over
// the vocabulary; a trained model's converging canvas rows are peaked, which is where the sparse
// product leaves tiles out. Row r's hidden state is α·Ê_t + (1 − α)·n̂ (unit vectors: the
// embedding of a target id t and noise), scaled to norm √D like a final-normed state.
//
//   build/bench/vocab_bench [--vocab 262144] [--dim 2816] [--rows 256] [--rounds 3]
//                           [--alphas 0,0.2,0.4,0.6]
// Prints, per α: mean row entropy (nats), share of (row, tile) pairs left out, rows kept
// dense, ms dense, ms sparse, and sparse / dense.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <new>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/bf16.h"
#include "common/cli.h"
#include "engine/cpu/cpu_vocab.h"
#include "engine/cpu/packed_matrix.h"
#include "engine/denoise/row_sampler.h"
#include "worker/backend_env.h"

ABSL_FLAG(int, vocab, 262144, "vocabulary size");
ABSL_FLAG(int, dim, 2816, "hidden size");
ABSL_FLAG(int, rows, 256, "canvas rows");
ABSL_FLAG(int, rounds, 3, "dense/sparse alternations (best of)");
ABSL_FLAG(std::string, alphas, "0,0.2,0.4,0.6", "weights α of the target embedding, comma-separated");
ABSL_FLAG(double, temperature, 0.8, "sampling temperature of every row");

namespace dgserve {
namespace {

// xorshift64*: a fast deterministic normal-ish value (sum of 4 uniforms, centred, unit variance).
struct Rng {
  uint64_t s;
  double Uniform() {
    s ^= s >> 12, s ^= s << 25, s ^= s >> 27;
    return double((s * 2685821657736338717ull) >> 11) * 0x1.0p-53;
  }
  float Normal() {
    return float((Uniform() + Uniform() + Uniform() + Uniform() - 2.0) * std::sqrt(3.0));
  }
};

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int Run() {
  const int V = absl::GetFlag(FLAGS_vocab), D = absl::GetFlag(FLAGS_dim);
  const int M = absl::GetFlag(FLAGS_rows), rounds = absl::GetFlag(FLAGS_rounds);
  // The table (vocab × dim bf16, twice) and the sparse product's exps (rows × vocab floats).
  if (V < 1 || D < 1 || M < 1 || rounds < 1 || int64_t(V) * D > (int64_t(1) << 32) ||
      int64_t(M) * V > (int64_t(1) << 29)) {
    std::fprintf(stderr,
                 "--vocab, --dim, --rows, --rounds must be >= 1, with vocab × dim <= 2^32 and "
                 "rows × vocab <= 2^29\n");
    return 2;
  }
  const double temperature_flag = absl::GetFlag(FLAGS_temperature);
  if (!(temperature_flag > 0) || !std::isfinite(temperature_flag)) {
    std::fprintf(stderr, "--temperature must be finite and > 0, got %g\n", temperature_flag);
    return 2;
  }
  std::vector<double> alphas;
  for (absl::string_view a : absl::StrSplit(absl::GetFlag(FLAGS_alphas), ',')) {
    double x;
    if (!absl::SimpleAtod(a, &x) || !(x >= 0 && x <= 1)) {
      std::fprintf(stderr, "--alphas: each must be a number in [0, 1], got '%s'\n",
                   std::string(a).c_str());
      return 2;
    }
    alphas.push_back(x);
  }
  // The embedding: N(0, 0.02²)-like bf16 values, as a random checkpoint holds them.
  std::vector<uint16_t> embed(size_t(V) * D);
#pragma omp parallel for schedule(static)
  for (int v = 0; v < V; ++v) {
    Rng rng{0x9e3779b97f4a7c15ull ^ (uint64_t(v) * 0xbf58476d1ce4e5b9ull) ^ 1};
    for (int i = 0; i < D; ++i) embed[size_t(v) * D + i] = FloatToBf16(0.02f * rng.Normal());
  }
  const cpu::PackedMatrix lm_head = cpu::PackedMatrix::FromBf16(embed.data(), V, D);
  const std::vector<float> tile_norms = cpu::EmbeddingTileNormMax(embed.data(), V, D);
  std::printf("vocab %d, dim %d, %d rows, temperature %.2f, %d threads, best of %d\n", V, D, M,
              absl::GetFlag(FLAGS_temperature), omp_get_max_threads(), rounds);
  std::printf("%6s %12s %10s %10s %11s %11s %8s\n", "alpha", "entropy", "left out", "kept dense",
              "dense ms", "sparse ms", "ratio");
  std::vector<float> hidden(size_t(M) * D), soft(size_t(M) * D), temperature(M), uniforms(M);
  std::vector<RowResult> out(M);
  cpu::VocabScratch scratch;
  for (double alpha : alphas) {
    Rng rng{12345};
    for (int r = 0; r < M; ++r) {
      const int target = int(rng.Uniform() * V) % V;
      std::vector<double> t(D), n(D);
      double tn = 0, nn = 0;
      for (int i = 0; i < D; ++i) {
        t[i] = Bf16ToFloat(embed[size_t(target) * D + i]);
        n[i] = rng.Normal();
        tn += t[i] * t[i];
        nn += n[i] * n[i];
      }
      double hn = 0;
      std::vector<double> h(D);
      for (int i = 0; i < D; ++i) {
        h[i] = alpha * t[i] / std::sqrt(tn) + (1 - alpha) * n[i] / std::sqrt(nn);
        hn += h[i] * h[i];
      }
      for (int i = 0; i < D; ++i) hidden[size_t(r) * D + i] = float(h[i] * std::sqrt(D / hn));
      temperature[r] = float(absl::GetFlag(FLAGS_temperature));
      uniforms[r] = float(rng.Uniform());
    }
    cpu::VocabStepArgs a;
    a.hidden = hidden.data();
    a.rows = M;
    a.lm_head = &lm_head;
    a.embed = embed.data();
    a.vocab = V;
    a.dim = D;
    a.temperature = temperature.data();
    a.uniforms = uniforms.data();
    a.embed_scale = std::round(std::sqrt(float(D)));
    a.out = out.data();
    a.soft = soft.data();
    a.embed_tile_norm_max = tile_norms.data();
    a.scratch = &scratch;  // the exps kept between rounds, as the backend keeps them
    double best_dense = 1e30, best_sparse = 1e30, entropy = 0;
    cpu::VocabStepStats stats;
    for (int k = 0; k < rounds; ++k) {
      for (bool sparse : {false, true}) {
        a.sc_skip_mass = sparse ? std::ldexp(1.0, -12) : 0.0;
        cpu::VocabStepStats s;
        a.stats = &s;
        const auto t0 = std::chrono::steady_clock::now();
        if (absl::Status st = cpu::FusedVocabStep(a); !st.ok()) {
          std::fprintf(stderr, "%s\n", st.ToString().c_str());
          return 1;
        }
        const double dt = Seconds(t0);
        (sparse ? best_sparse : best_dense) = std::min(sparse ? best_sparse : best_dense, dt);
        if (sparse) stats = s;
      }
    }
    for (const RowResult& r : out) entropy += r.entropy;
    std::printf("%6.2f %7.3f nats %9.1f%% %10lld %11.1f %11.1f %7.2fx\n", alpha, entropy / M,
                100.0 * double(stats.tile_rows_skipped) / double(stats.tile_rows),
                (long long)stats.rows_kept_dense, 1e3 * best_dense, 1e3 * best_sparse,
                best_sparse / best_dense);
  }
  return 0;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "vocab_bench [--vocab N] [--dim N] [--rows N] [--rounds N] [--alphas A,B,...] "
      "[--temperature T]",
      "bench/vocab_bench.cc");
  std::vector<char*> rest = dgserve::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
  dgserve::ApplyGemmIsaFromEnvironment();  // DGSERVE_GEMM_ISA forces a path
  try {
    return dgserve::Run();
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "out of memory\n");
    return 1;
  }
}
