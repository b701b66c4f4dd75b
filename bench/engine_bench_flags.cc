// engine_bench's flags (declared in engine_bench_flags.h, read by engine_bench.cc) and their
// checks.
#include "bench/engine_bench_flags.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, model, "", "checkpoint directory");
ABSL_FLAG(std::string, config, "", "config.json to generate a random checkpoint from");
ABSL_FLAG(std::string, config_json, "", "config.json text to generate a random checkpoint from");
ABSL_FLAG(int, layers, 0, "with --config/--config_json: keep only the first N layers");
ABSL_FLAG(uint64_t, seed, 3, "generator seed");
ABSL_FLAG(int, canvas, 0, "canvas length (default: the checkpoint's canvas_length)");
ABSL_FLAG(int, steps, 8, "denoising steps to time (after one warm-up step)");
ABSL_FLAG(int, context, 64, "prompt tokens encoded before the canvas");
ABSL_FLAG(std::string, device, "cpu",
          "backend: cpu or cuda (cuda: built with the CUDA backend; see --cuda_gemm_input)");
ABSL_FLAG(int, prefill_chunk, 0,
          "prompt tokens per encoder pass (0: the backend's, as the prefill worker: 512 on the "
          "CPU, 8192 on a GPU)");
ABSL_FLAG(double, logit_scale, 1.0,
          "multiply the final norm's weight (so every logit before the softcap) by this factor, "
          "in (0, 1e6]; the softcap bounds the logits, so large factors flatten the rows rather "
          "than peak them (bench/vocab_bench measures peaked rows)");
ABSL_FLAG(std::optional<int>, batch, std::nullopt,
          "canvases denoised together per step, each with its own KV cache copy (default 1; "
          "beside --batches: refused unless --batches is this one batch)");
ABSL_FLAG(std::string, cpu_gemm_inputs, "",
          "--device cpu: comma-separated GEMM input modes to time one after the other on the same "
          "shape (float32, bf16; e.g. 'float32,bf16'), each a whole run with its own prefill and "
          "steps, then the ratio of the steps; empty: the one --cpu_gemm_input names");
ABSL_FLAG(int, repeats, 1,
          "with --cpu_gemm_inputs: time the modes this many times in alternation (other than 1 "
          "without --cpu_gemm_inputs: refused)");
ABSL_FLAG(double, mem_bandwidth_gbs, 0,
          "device memory bandwidth in GB/s for the share of the bf16 bound (0: not reported)");
ABSL_FLAG(bool, synthetic, false,
          "with --config/--config_json: make the random checkpoint's weights in memory (on the "
          "device with --device cuda) instead of writing and loading a checkpoint");
ABSL_FLAG(bool, synthetic_kv, false,
          "fill the prompt's KV cache with deterministic values instead of encoding the prompt "
          "(no prefill timed)");
ABSL_FLAG(std::string, batches, "",
          "comma-separated batch sizes to run in turn in this process, instead of --batch (both "
          "given: refused unless --batches is the one batch --batch names)");
ABSL_FLAG(double, step_budget_s, 0,
          "per batch: stop timing steps once this many seconds of steps have run (at least one "
          "timed step; 0: run all --steps)");
ABSL_FLAG(bool, phase_timing, false,
          "--device cuda: time the attention, MoE, dense and vocabulary phases of every step "
          "with CUDA events (costs a little)");
ABSL_FLAG(bool, cuda_graphs, true,
          "--device cuda: replay each step shape as a CUDA graph (CudaBackendOptions::"
          "cuda_graphs); --phase_timing runs eagerly whatever this says");
ABSL_FLAG(int, calibrate_copy_mb, 1024,
          "--device cuda: MiB of the device-to-device copy that measures the bandwidth ceiling "
          "(0: skip)");
ABSL_FLAG(int, calibrate_gemm_n, 8192,
          "--device cuda: n of the n×n×n bf16 GEMM that measures the tensor-core ceiling (0: "
          "skip)");
ABSL_FLAG(bool, cuda_tensor_core_attention, true,
          "--device cuda: attention on the tensor cores (CudaBackendOptions::"
          "tensor_core_attention, the default: bf16 Q/K/V, the bf16 device KV mirror; with "
          "--cuda_gemm_input bf16 only, float32 keeps the float32 kernels); false: the float32 "
          "kernels (rounding as the tensor cores in bf16); the result line says "
          "attention=tensor_core or attention=float32");
ABSL_FLAG(bool, cuda_defer_kv_host_copy, true,
          "--device cuda: the encoder passes leave the prompt's K/V rows on the device "
          "(CudaBackendOptions::defer_kv_host_copy, the default; copied at the sync after the "
          "prefill, outside prefill_ms); false: each pass copies them to the host (inside "
          "prefill_ms), as before");
ABSL_FLAG(int32_t, cuda_kv_block_size, 64,
          "--device cuda: positions per block of the device K/V block pool "
          "(CudaBackendOptions::kv_block_size, the default 64; 1 to 4096); 0: one device K/V "
          "mirror per sequence with its own arrays (the former layout); the result line says "
          "kv_block_size=");
ABSL_FLAG(bool, calibrate_only, false,
          "--device cuda: measure the two ceilings, print the CEILINGS line and exit");

namespace dgserve::bench {

int CheckEngineBenchNumericFlags() {
  if (const int r = absl::GetFlag(FLAGS_repeats); r < 1) {
    std::fprintf(stderr, "--repeats %d: must be ≥ 1\n", r);
    return 2;
  } else if (r != 1 && absl::GetFlag(FLAGS_cpu_gemm_inputs).empty()) {
    // Only the --cpu_gemm_inputs loop repeats; a single run would ignore it.
    std::fprintf(stderr,
                 "--repeats %d: repeats the --cpu_gemm_inputs modes only; give --cpu_gemm_inputs "
                 "(e.g. float32,bf16) or leave out --repeats\n",
                 r);
    return 2;
  }
  // Each named with its value (the model's bounds are checked once it is known).
  for (const auto& [name, value, min, what] :
       {std::tuple<const char*, int, int, const char*>{"--canvas", absl::GetFlag(FLAGS_canvas), 0,
                                                       " (0: the checkpoint's canvas_length)"},
        {"--steps", absl::GetFlag(FLAGS_steps), 1, ""},
        {"--context", absl::GetFlag(FLAGS_context), 1, ""},
        {"--prefill_chunk", absl::GetFlag(FLAGS_prefill_chunk), 0, " (0: the backend's)"}}) {
    if (value < min) {
      std::fprintf(stderr, "%s %d: must be ≥ %d%s\n", name, value, min, what);
      return 2;
    }
  }
  for (const auto& [name, value] :
       {std::pair<const char*, double>{"--mem_bandwidth_gbs",
                                       absl::GetFlag(FLAGS_mem_bandwidth_gbs)},
        {"--step_budget_s", absl::GetFlag(FLAGS_step_budget_s)},
        {"--calibrate_copy_mb", double(absl::GetFlag(FLAGS_calibrate_copy_mb))},
        {"--calibrate_gemm_n", double(absl::GetFlag(FLAGS_calibrate_gemm_n))}}) {
    if (!(value >= 0) || !std::isfinite(value)) {
      std::fprintf(stderr, "%s %g: must be a finite number ≥ 0\n", name, value);
      return 2;
    }
  }
  return 0;
}

}  // namespace dgserve::bench
