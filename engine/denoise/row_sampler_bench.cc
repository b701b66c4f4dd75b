// Micro-benchmark of the fused row sampler: 256 rows × 262144 ids (one DiffusionGemma canvas
// step). Prints, per configuration, the best and mean wall time per batch and the best process
// CPU time (all threads), each also as ns per element.
// Usage: row_sampler_bench [rows] [vocab] [iterations]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "common/cli.h"
#include "engine/denoise/rng.h"
#include "engine/denoise/row_sampler.h"

namespace {

double NowSeconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Process CPU time (all threads): robust against other jobs sharing the cores.
double CpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// Logits shaped like softcapped model output: ±30 cap, most mass in a few ids.
void FillLogits(std::vector<float>& logits, int vocab) {
  for (size_t i = 0; i < logits.size(); ++i) {
    const float u = dgserve::Uniform01({7, dgserve::DrawStream::kSampleUniform, 0,
                                        static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(i)});
    logits[i] = 30.0f * std::tanh((u * 2.0f - 1.0f) * 0.6f) - 5.0f;
    if (i % vocab % 4099 == 17) logits[i] += 12.0f;
  }
}

}  // namespace

int main(int argc, char** argv) {
  dgserve::InitCommandLine("row_sampler_bench [rows] [vocab] [iterations] (default 256 262144 10)",
                           "engine/denoise/row_sampler_bench.cc");
  // --help exits 0 (common/cli.h); an unknown flag is refused rather than read as a count.
  const std::vector<char*> args = dgserve::ParseCommandLine(argc, argv);
  if (args.size() > 4) {
    std::fprintf(stderr, "row_sampler_bench: unexpected argument '%s' (see --help)\n", args[4]);
    return 2;
  }
  int counts[3] = {256, 262144, 10};
  const char* names[3] = {"rows", "vocab", "iterations"};
  for (size_t i = 1; i < args.size(); ++i) {
    if (!absl::SimpleAtoi(args[i], &counts[i - 1]) || counts[i - 1] < 1) {
      std::fprintf(stderr, "row_sampler_bench: %s '%s': must be an integer >= 1 (see --help)\n",
                   names[i - 1], args[i]);
      return 2;
    }
  }
  const int rows = counts[0], vocab = counts[1], iters = counts[2];
  const double elems = static_cast<double>(rows) * vocab;
  std::printf("row_sampler_bench: rows=%d vocab=%d iterations=%d isa=%s omp_threads=%d\n", rows,
              vocab, iters, dgserve::RowSamplerIsa(), omp_get_max_threads());

  std::vector<float> pristine(static_cast<size_t>(rows) * vocab);
  FillLogits(pristine, vocab);
  std::vector<float> logits = pristine;
  std::vector<float> uniforms(rows);
  for (int r = 0; r < rows; ++r) uniforms[r] = (r + 0.5f) / rows;
  std::vector<dgserve::RowResult> out(rows);

  double checksum = 0.0;
  auto report = [&](const char* name, auto&& fn, bool restore) {
    fn();  // warm-up
    double best = 1e30, sum = 0.0, cpu_best = 1e30;
    for (int it = 0; it < iters; ++it) {
      if (restore) logits = pristine;  // not timed
      const double t0 = NowSeconds(), c0 = CpuSeconds();
      fn();
      const double dt = NowSeconds() - t0, dc = CpuSeconds() - c0;
      best = std::min(best, dt);
      cpu_best = std::min(cpu_best, dc);
      sum += dt;
    }
    for (const auto& r : out) checksum += r.entropy + r.sampled;
    std::printf(
        "  %-36s wall best %7.2f ms mean %7.2f ms = %5.3f ns/elem | cpu best %7.2f ms = %5.3f "
        "ns/elem\n",
        name, best * 1e3, sum / iters * 1e3, best * 1e9 / elems, cpu_best * 1e3,
        cpu_best * 1e9 / elems);
  };

  report(
      "SampleRows 1 thread, no probs",
      [&] {
        omp_set_num_threads(1);
        dgserve::SampleRows(logits.data(), rows, vocab, 0.8f, uniforms, false, out);
      },
      false);
  const int all_threads = omp_get_num_procs();
  omp_set_num_threads(all_threads);
  std::printf("  (all threads = %d)\n", all_threads);
  report(
      "SampleRows all threads, no probs",
      [&] { dgserve::SampleRows(logits.data(), rows, vocab, 0.8f, uniforms, false, out); }, false);
  report(
      "SampleRows all threads, write probs",
      [&] { dgserve::SampleRows(logits.data(), rows, vocab, 0.8f, uniforms, true, out); }, true);
  report(
      "baseline SSE2 kernel, 1 thread",
      [&] {
        for (int r = 0; r < rows; ++r) {
          out[r] = dgserve::SampleRowWithKernel(dgserve::RowKernel::kBaseline,
                                                logits.data() + static_cast<size_t>(r) * vocab,
                                                vocab, 0.8f, uniforms[r], false);
        }
      },
      true);
  std::printf("checksum %.6g (entropy[0]=%.6f lse[0]=%.6f sampled[0]=%d argmax[0]=%d)\n", checksum,
              out[0].entropy, out[0].lse, out[0].sampled, out[0].argmax);
  return 0;
}
