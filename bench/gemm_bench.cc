// GFLOP/s of our GEMM (bf16 packed weights, engine/cpu/gemm.h) against OpenBLAS sgemm on
// float32 copies of the same weights, on the model's real-width shapes: attention projections,
// the dense MLP, MoE expert groups of 1–64 rows, and the LM head at canvas 32 and 256 (over a
// vocabulary slice: the GFLOP/s of the full 262,144 ids are the same). Prints a table of ratios.
//
// Ours in both input modes (gemm.h: float32, and bf16 — A rounded to bf16, the VDPBF16PS chain)
// and OpenBLAS are timed in alternation, best of --rounds rounds each; "bf16/f32" is our bf16
// mode's speed over our float32 mode's. --isa takes a comma-separated list of paths (one table
// each; "all": every path this CPU has).
//
//   OMP_WAIT_POLICY=passive build/bench/gemm_bench [--min_seconds 0.5] [--rounds 5]
//       [--isa all|avx512bf16,avx512,avx2,portable]
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_split.h"
#include "common/bf16.h"
#include "common/cli.h"
#include "engine/cpu/gemm.h"
#include "engine/cpu/packed_matrix.h"
#include "worker/backend_env.h"

ABSL_FLAG(double, min_seconds, 0.5, "time each measurement for at least this long");
ABSL_FLAG(std::string, isa, "",
          "GEMM paths, comma-separated (avx512bf16, avx512, avx2, portable; 'all': every path "
          "this CPU has; default: the best it has)");
ABSL_FLAG(int, vocab_slice, 16384, "vocabulary ids of the LM head shapes");
ABSL_FLAG(bool, cpu_time, false,
          "time by the process's CPU time (all threads) instead of the wall clock: less "
          "sensitive to other processes on a shared machine, blind to idle threads");
ABSL_FLAG(std::string, only, "", "run only the shapes whose name contains this");
ABSL_FLAG(int, rounds, 5, "alternate ours and OpenBLAS this many times per shape (best of all)");

namespace {

// Seconds on the clock --cpu_time selects.
double Now() {
  if (absl::GetFlag(FLAGS_cpu_time)) {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best seconds per call of `f` over repeated runs lasting at least `min_s`, lowered into `best`.
template <typename F>
void TimePerCall(F f, double min_s, double& best) {
  double total = 0;
  while (total < min_s) {
    const double t0 = Now();
    f();
    const double s = Now() - t0;
    best = std::min(best, s);
    total += s;
  }
}

// Best seconds per call of each of `fs`, timed in alternation (--rounds rounds of min_seconds /
// rounds each) so that load from other processes on the machine falls on all of them.
std::vector<double> TimeAll(const std::vector<std::function<void()>>& fs) {
  for (const auto& f : fs) f();  // warm up (page faults)
  const int rounds = std::max(1, absl::GetFlag(FLAGS_rounds));
  const double min_s = absl::GetFlag(FLAGS_min_seconds) / rounds;
  std::vector<double> best(fs.size(), 1e30);
  for (int r = 0; r < rounds; ++r) {
    for (size_t i = 0; i < fs.size(); ++i) TimePerCall(fs[i], min_s, best[i]);
  }
  return best;
}

struct Shape {
  const char* name;
  int m, n, k;  // C[m, n] = A[m, k] · W[n, k]ᵀ
};

// One table row: GFLOP/s of ours (float32 and bf16 modes) and of OpenBLAS, and the ratios
// (OpenBLAS time / ours float32; ours float32 time / ours bf16).
void PrintRow(const Shape& s, const std::vector<double>& t) {
  const double flop = 2.0 * s.m * s.n * s.k;
  std::printf("%-26s %5d %6d %5d %9.1f %9.1f %9.1f %7.2fx %7.2fx\n", s.name, s.m, s.n, s.k,
              flop / t[0] / 1e9, flop / t[1] / 1e9, flop / t[2] / 1e9, t[2] / t[0], t[0] / t[1]);
}

}  // namespace

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "gemm_bench [--min_seconds S] [--rounds N] [--isa all|avx512bf16,avx512,avx2,portable] "
      "[--only NAME] [--vocab_slice N] [--cpu_time]",
      "bench/gemm_bench.cc");
  dgserve::ParseCommandLine(argc, argv);   // --help exits 0 (common/cli.h)
  dgserve::ApplyGemmIsaFromEnvironment();  // the path --isa leaves: DGSERVE_GEMM_ISA's, or the best
  using namespace dgserve::cpu;
  std::vector<GemmIsa> isas;
  const std::string isa_flag = absl::GetFlag(FLAGS_isa);
  for (const absl::string_view name : absl::StrSplit(isa_flag, ',', absl::SkipEmpty())) {
    bool found = false;
    for (GemmIsa i : {GemmIsa::kAvx512Bf16, GemmIsa::kAvx512, GemmIsa::kAvx2, GemmIsa::kPortable}) {
      if (name == "all" ? !GemmIsaSupported(i) : name != GemmIsaName(i)) continue;
      found = true;
      if (!GemmIsaSupported(i)) {
        std::fprintf(stderr, "--isa %s: this CPU lacks it\n", GemmIsaName(i));
        return 1;
      }
      isas.push_back(i);
    }
    if (!found) {
      std::fprintf(stderr, "--isa must list avx512bf16, avx512, avx2, portable or all\n");
      return 2;
    }
  }
  if (isas.empty()) isas.push_back(ActiveGemmIsa());
  const int V = absl::GetFlag(FLAGS_vocab_slice);
  // Real width (bench/configs/real-width-2-layers.json): D 2816, 16 heads of 256 (full: 512),
  // 8 KV heads sliding, dense 2112, experts 704.
  const std::vector<Shape> shapes = {
      {"q_proj, canvas 256", 256, 4096, 2816},     {"k_proj, canvas 256", 256, 2048, 2816},
      {"o_proj, canvas 256", 256, 2816, 4096},     {"mlp gate, canvas 256", 256, 2112, 2816},
      {"mlp down, canvas 256", 256, 2816, 2112},   {"q_proj, prefill 512", 512, 4096, 2816},
      {"expert gate_up, 1 row", 1, 1408, 2816},    {"expert gate_up, 4 rows", 4, 1408, 2816},
      {"expert gate_up, 8 rows", 8, 1408, 2816},   {"expert gate_up, 16 rows", 16, 1408, 2816},
      {"expert down, 16 rows", 16, 2816, 704},     {"expert gate_up, 32 rows", 32, 1408, 2816},
      {"expert gate_up, 64 rows", 64, 1408, 2816}, {"LM head, canvas 32", 32, V, 2816},
      {"LM head, canvas 256", 256, V, 2816},
  };
  // The soft embedding's product p[m, 512] · E[512, D] with E row-major (a vocabulary tile).
  const std::vector<Shape> row_major_shapes = {{"soft emb. tile, 8 rows", 8, 2816, 512},
                                               {"soft emb. tile, 16 rows", 16, 2816, 512},
                                               {"soft emb. tile, canvas 32", 32, 2816, 512},
                                               {"soft emb. tile, canvas 256", 256, 2816, 512}};
  for (GemmIsa isa : isas) {
  if (auto st = SetGemmIsa(isa); !st.ok()) return 1;
  std::printf("GEMM path %s, %d threads; OpenBLAS sgemm on float32 copies of the weights\n",
              GemmIsaName(ActiveGemmIsa()), omp_get_max_threads());
  std::printf("%-26s %5s %6s %5s %9s %9s %9s %8s %8s\n", "shape", "m", "n", "k", "f32 GF/s",
              "bf16 GF/s", "BLAS GF/s", "f32/BLAS", "bf16/f32");
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 0.05f);
  const std::string only = absl::GetFlag(FLAGS_only);
  auto skip = [&](const Shape& s) { return std::string(s.name).find(only) == std::string::npos; };
  for (const Shape& s : shapes) {
    if (skip(s)) continue;
    std::vector<float> a(size_t(s.m) * s.k), w(size_t(s.n) * s.k), c(size_t(s.m) * s.n);
    for (float& x : a) x = dist(rng);
    for (float& x : w) x = dgserve::RoundToBf16(dist(rng));
    const PackedMatrix packed = PackedMatrix::FromFloat(w.data(), s.n, s.k);
    PrintRow(s, TimeAll({[&] { Linear(a.data(), s.m, packed, c.data()); },
                         [&] {
                           Linear(a.data(), s.m, packed, c.data(), false, GemmThreads::kOpenMp,
                                  GemmInput::kBf16);
                         },
                         [&] {
                           cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s.m, s.n, s.k, 1.0f,
                                       a.data(), s.k, w.data(), s.k, 0.0f, c.data(), s.n);
                         }}));
  }
  for (const Shape& s : row_major_shapes) {  // C = A · B, B [k, n] row-major in bf16
    if (skip(s)) continue;
    std::vector<float> a(size_t(s.m) * s.k), b(size_t(s.k) * s.n), c(size_t(s.m) * s.n);
    for (float& x : a) x = dist(rng);
    for (float& x : b) x = dgserve::RoundToBf16(dist(rng));
    std::vector<uint16_t> b16(b.size());
    for (size_t i = 0; i < b.size(); ++i) b16[i] = dgserve::FloatToBf16(b[i]);
    const GemmArgs g =
        GemmArgs::Of(s.m, s.n, s.k, a.data(), s.k, GemmB::RowMajor(b16.data(), s.n), c.data(), s.n);
    GemmArgs gb = g;
    gb.input = GemmInput::kBf16;
    PrintRow(s, TimeAll({[&] { Gemm(g); }, [&] { Gemm(gb); },
                         [&] {
                           cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s.m, s.n, s.k,
                                       1.0f, a.data(), s.k, b.data(), s.n, 0.0f, c.data(), s.n);
                         }}));
  }
  }
  return 0;
}
