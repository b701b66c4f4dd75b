// engine_bench: time per denoise step and canvas positions per second of the engine at fixed
// work (a fixed number of steps, no early stop), split into the transformer body and the
// vocabulary-sized work (LM head, self-conditioning product, softmax/entropy/sampling), and the
// time of the prompt's encoder pass (prefill).
//
//   engine_bench --model DIR [--device cpu|cuda] [--canvas N] [--steps N] [--context P]
//                [--batch B] [--mem_bandwidth_gbs GB/s]
//   engine_bench --config_json '{...config.json...}' [--layers N] [--canvas N] ...
//   engine_bench ... --cpu_gemm_inputs float32,bf16 [--repeats R]   (both CPU GEMM modes, one run)
//
// With --config_json (or --config FILE) the checkpoint is generated with the dgserve-mkmodel
// generator into a temporary directory first; --layers keeps only the first N layers (a slice).
// --batch B denoises B canvases per step, each with its own copy of the encoded prompt's KV
// cache (one prefill, in --prefill_chunk token passes, is timed). The last line, "RESULT
// key=value ...", is for scripts (tools/gpu_check.sh). It includes the share of the bf16 bound:
// the bf16 weight bytes one step reads (every matrix once, the embedding twice: LM head and
// self-conditioning product; all experts, which holds once canvas · top-k ≥ experts) ÷ the
// step's wall time ÷ the memory bandwidth given by --mem_bandwidth_gbs (0: not computed). With
// --device cuda the device memory in use (cudaMemGetInfo: total − free, the most seen after
// prefill and after each step) is reported as well.
//
// The real shape on a device (issue 33): --synthetic with --config makes the weights of the
// random checkpoint in memory instead of writing one (dgserve-mkmodel's values for --seed, bit
// for bit): on the CPU in host memory, with --device cuda generated on the device by a kernel
// (no host copy of the matrices), so all 30 layers of the 26B shape run on one GPU without a
// 52 GB checkpoint. --device cuda also measures the two ceilings first (a device-to-device copy
// and a bf16 cuBLAS GEMM, --calibrate_copy_mb / --calibrate_gemm_n; 0 skips) and adds per step:
// launches (our kernels + cuBLAS calls + device copies), blocking host round trips (host↔device
// copies and syncs), allocations, and with --phase_timing the CUDA-event time of the attention,
// MoE, dense and vocabulary phases and the host gap (step wall time − their sum); without it the
// step is timed as one unit and the RESULT line's body_ms and vocab_ms read "na". Steps run as
// CUDA graphs (--cuda_graphs, the default; graphs_per_step) except with --phase_timing, whose
// event brackets need the launches one by one.
// --batches 1,2,4 runs a batch sweep in one process instead of --batch N (one weight init, one
// prefill, a RESULT line per batch; a batch whose KV copies and scratch would not fit in free
// device or host memory is reported as skipped); --step_budget_s bounds the timed steps per
// batch; --synthetic_kv fills the prompt's KV cache with deterministic values instead of running
// the encoder (a 32k-token prefill of 30 layers takes minutes of device time; prefill_ms=na).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/bench_batches.h"
#include "bench/bench_checkpoint.h"
#include "bench/step_cost.h"
#include "common/cli.h"
#include "common/hash.h"
#include "common/system_resources.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/backend.h"
#include "engine/model/backend_select.h"
#include "engine/model/checkpoint.h"
#include "engine/model/kv_cache.h"
#include "engine/model/tensor_names.h"
#include "worker/backend_flags.h"
#ifdef DGSERVE_HAVE_CUDA
#include <cuda_runtime.h>

#include "engine/cuda/cuda_backend.h"
#include "engine/cuda/cuda_calibrate.h"
#include "engine/cuda/cuda_ops.h"
#include "engine/cuda/cuda_profile.h"
#endif

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
ABSL_FLAG(int, repeats, 1, "with --cpu_gemm_inputs: time the modes this many times in alternation");
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

namespace dgserve {
namespace {

using bench::Bf16BytesPerStep;
using bench::BodyFlops;
using bench::DeviceBytesPerRow;
using bench::KvBytesPerSequence;
using bench::PhaseWork;
using bench::StepWork;

// The backend of --device with --cpu_gemm_input / --cuda_gemm_input (main() fills it; with
// --cpu_gemm_inputs, main() sets each mode in turn).
BackendSelection g_backend;

using Clock = std::chrono::steady_clock;
// CPU time of the process (all threads), in seconds: on a machine shared with other work it
// varies less than the wall time (threads wait passively with OMP_WAIT_POLICY=passive).
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Mean wall and CPU time per timed step of the last batch Run() measured (--cpu_gemm_inputs).
double g_last_step_wall = 0, g_last_step_cpu = 0;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Device memory in use (total − free) in bytes; 0 on the CPU or when it cannot be read.
double DeviceMemoryUsedBytes() {
#ifdef DGSERVE_HAVE_CUDA
  if (absl::GetFlag(FLAGS_device) == "cuda") {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) return double(total_b - free_b);
  }
#endif
  return 0;
}

std::string Fmt(double v, const char* f = "%.3f") {
  char b[64];
  std::snprintf(b, sizeof(b), f, v);
  return b;
}

#ifdef DGSERVE_HAVE_CUDA
// The two ceilings on the current device (--calibrate_copy_mb, --calibrate_gemm_n), printed as
// the CEILINGS line; the card's name with spaces as '_' (a key=value token) into *gpu_name.
absl::Status Calibrate(std::string* gpu_name, double* copy_gbs, double* gemm_tflops) {
  *gpu_name = cuda::CurrentDeviceName();
  for (char& ch : *gpu_name) {
    if (ch == ' ' || ch == '=') ch = '_';
  }
  auto ceil = cuda::MeasureCeilings(size_t(absl::GetFlag(FLAGS_calibrate_copy_mb)) << 20,
                                    absl::GetFlag(FLAGS_calibrate_gemm_n));
  if (!ceil.ok()) return ceil.status();
  *copy_gbs = ceil->copy_gbs;
  *gemm_tflops = ceil->gemm_tflops;
  std::printf(
      "CEILINGS gpu=%s copy_mb=%.0f copy_gbs=%.1f gemm_n=%d gemm_tflops=%.1f (bf16 in, fp32 "
      "accumulate and out)\n",
      gpu_name->c_str(), ceil->copy_bytes / 1048576.0, *copy_gbs, ceil->gemm_n, *gemm_tflops);
  std::fflush(stdout);
  return absl::OkStatus();
}
#endif

int Run() {
  if (absl::GetFlag(FLAGS_calibrate_only)) {
#ifdef DGSERVE_HAVE_CUDA
    if (absl::GetFlag(FLAGS_device) == "cuda") {
      if (cuda::DeviceCount() == 0) {
        std::fprintf(stderr, "--calibrate_only: no CUDA device found\n");
        return 1;
      }
      std::string name;
      double copy = 0, gemm = 0;
      if (absl::Status st = Calibrate(&name, &copy, &gemm); !st.ok()) {
        std::fprintf(stderr, "calibration: %s\n", st.ToString().c_str());
        return 1;
      }
      return 0;
    }
#endif
    std::fprintf(stderr, "--calibrate_only needs --device cuda in a build with the CUDA backend\n");
    return 2;
  }
  const double logit_scale = absl::GetFlag(FLAGS_logit_scale);
  if (!(logit_scale > 0 && logit_scale <= 1e6)) {
    std::fprintf(stderr, "--logit_scale must be in (0, 1e6], got %g\n", logit_scale);
    return 2;
  }
  if (absl::GetFlag(FLAGS_canvas) < 0 || absl::GetFlag(FLAGS_steps) < 1 ||
      absl::GetFlag(FLAGS_context) < 1) {
    std::fprintf(stderr, "--canvas must be ≥ 0 (0: the checkpoint's), --steps and --context ≥ 1\n");
    return 2;
  }
  if (const int bs = absl::GetFlag(FLAGS_cuda_kv_block_size); bs < 0 || bs > 4096) {
    std::fprintf(stderr, "--cuda_kv_block_size %d: must be 0 (per-sequence arrays) to 4096\n", bs);
    return 2;
  }
  const absl::StatusOr<std::vector<int>> batch_sizes =
      bench::BatchSizes(absl::GetFlag(FLAGS_batches), absl::GetFlag(FLAGS_batch));
  if (!batch_sizes.ok()) {
    std::fprintf(stderr, "%s\n", std::string(batch_sizes.status().message()).c_str());
    return 2;
  }
  const std::vector<int>& batches = *batch_sizes;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const std::string device = absl::GetFlag(FLAGS_device);
  const bool cuda = device == "cuda";
  const bool synthetic = absl::GetFlag(FLAGS_synthetic);
  bench::BenchModelSpec spec;
  spec.model_dir = absl::GetFlag(FLAGS_model);
  spec.config_json = absl::GetFlag(FLAGS_config_json);
  spec.config_path = absl::GetFlag(FLAGS_config);
  spec.layers = absl::GetFlag(FLAGS_layers);
  spec.synthetic = synthetic;
  spec.on_device = cuda;
  spec.seed = absl::GetFlag(FLAGS_seed);
  absl::StatusOr<Checkpoint> loaded = bench::BenchCheckpoint(spec);
  if (!loaded.ok()) {
    std::fprintf(stderr, "%s\n", std::string(loaded.status().message()).c_str());
    return absl::IsInvalidArgument(loaded.status()) ? 2 : 1;
  }
  std::optional<Checkpoint> ckpt(*std::move(loaded));
  const ModelConfig c = ckpt->config;
  if (auto rss = ResidentBytes(), peak = PeakResidentBytes(); rss && peak) {
    std::printf("resident memory after load %.2f GB (peak so far %.2f GB)\n", *rss / 1e9,
                *peak / 1e9);
  }
  const int C = absl::GetFlag(FLAGS_canvas) != 0 ? absl::GetFlag(FLAGS_canvas) : c.canvas_length;
  const int steps = absl::GetFlag(FLAGS_steps);
  const int P = absl::GetFlag(FLAGS_context);
  if (C < 1 || C > 4096) {
    std::fprintf(stderr, "--canvas must be in [1, 4096], got %d\n", C);
    return 2;
  }
  if (steps < 1 || steps > 10000) {
    std::fprintf(stderr, "--steps must be in [1, 10000], got %d\n", steps);
    return 2;
  }
  if (P < 1 || int64_t(P) + C > c.max_position_embeddings) {
    std::fprintf(stderr,
                 "--context must be in [1, %d] (max_position_embeddings − canvas), got %d\n",
                 c.max_position_embeddings - C, P);
    return 2;
  }
  const int V = c.vocab_size, D = c.hidden_size;
  for (float& w : ckpt->weights.final_norm) w = float(w * logit_scale);
  std::string gemm_input = cuda ? "na" : cpu::GemmInputName(g_backend.cpu_gemm_input);
  std::unique_ptr<ModelBackend> backend;
  std::string gpu_name = "cpu";
  double copy_gbs = 0, gemm_tflops = 0;
  const auto t0 = Clock::now();
#ifdef DGSERVE_HAVE_CUDA
  // One sequence's device K/V at the context, in the element size the backend's options store.
  int64_t kv_bytes_per_seq = 0;
  const char* attention = "float32";  // the CUDA backend's attention kernels
#endif
  if (!cuda) {
    auto created = CreateBackend(g_backend, c, ckpt->weights);
    if (!created.ok()) {
      std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
      return 1;
    }
    backend = *std::move(created);
  } else {
#ifdef DGSERVE_HAVE_CUDA
    const bool bf16 = g_backend.cuda_gemm_input == CudaGemmInput::kBf16;
    gemm_input = bf16 ? "bf16" : "float32";
    CudaBackendOptions options;
    options.gemm_input = bf16 ? cuda::GemmInput::kBf16 : cuda::GemmInput::kFloat32;
    options.phase_timing = absl::GetFlag(FLAGS_phase_timing);
    options.cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs);
    options.tensor_core_attention = absl::GetFlag(FLAGS_cuda_tensor_core_attention);
    options.defer_kv_host_copy = absl::GetFlag(FLAGS_cuda_defer_kv_host_copy);
    options.kv_block_size = absl::GetFlag(FLAGS_cuda_kv_block_size);
    options.kv_pool_max_bytes = g_backend.cuda_kv_pool_bytes;
    if (options.tensor_core_attention && bf16) attention = "tensor_core";
    options.max_kv_mirrors = std::max(options.max_kv_mirrors, max_batch);  // no re-uploads
    kv_bytes_per_seq = CudaKvBytesPerSequence(c, P, options);
    // Every format runs in its own format (FP8 on the FP8 tensor cores, W4A16 and NVFP4
    // dequantized inside the GEMMs; W4A16 with float32 activations in both GEMM modes).
    // The ceilings first, while the device is empty.
    if (cuda::DeviceCount() > 0) {
      if (absl::Status st = Calibrate(&gpu_name, &copy_gbs, &gemm_tflops); !st.ok()) {
        std::fprintf(stderr, "calibration: %s\n", st.ToString().c_str());
        return 1;
      }
    }
    auto created = synthetic
                       ? CreateCudaBackendSynthetic(c, absl::GetFlag(FLAGS_seed), options)
                       : CreateCudaBackend(c, ckpt->weights, options);
    if (!created.ok()) {
      std::fprintf(stderr, "--device cuda: %s\n", created.status().ToString().c_str());
      return 1;
    }
    backend = *std::move(created);
#else
    std::fprintf(stderr, "%s\n", CudaBackendMissingMessage().c_str());
    return 1;  // main() refuses it first; kept so that Run() never goes on without a backend
#endif
  }
  std::printf("backend ready in %.1f s%s\n", Since(t0),
              synthetic && cuda ? " (weights generated on the device)" : "");
  if (cuda) ckpt->weights = ModelWeights{};  // on the device now (the CPU backend uses them)
  double device_peak = DeviceMemoryUsedBytes();

  std::vector<ContiguousKvCache> kvs;
  kvs.reserve(max_batch);
  kvs.emplace_back(c, P);
  std::vector<int32_t> prompt(P);
  for (int i = 0; i < P; ++i) prompt[i] = (i * 7919 + 13) % V;
  if (absl::GetFlag(FLAGS_prefill_chunk) < 0) {
    std::fprintf(stderr, "--prefill_chunk %d: must be ≥ 0 (0: the backend's)\n",
                 absl::GetFlag(FLAGS_prefill_chunk));
    return 2;
  }
  const int chunk = absl::GetFlag(FLAGS_prefill_chunk) > 0 ? absl::GetFlag(FLAGS_prefill_chunk)
                                                           : backend->prefill_chunk_tokens();
  std::printf("prefill chunk: %d tokens per encoder pass%s\n", chunk,
              absl::GetFlag(FLAGS_prefill_chunk) > 0 ? "" : " (the backend's)");
  const bool synthetic_kv = absl::GetFlag(FLAGS_synthetic_kv);
  double prefill_s = 0;
  auto t_enc = Clock::now();
  if (synthetic_kv) {
    // Values of a normalised key or value's size, deterministic in (layer, position, index).
    if (absl::Status st = kvs[0].Reserve(P); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    for (int l = 0; l < c.num_layers; ++l) {
      const int w = c.KvHeads(l) * c.HeadDim(l);
#pragma omp parallel for
      for (int p = 0; p < P; ++p) {
        float* k = kvs[0].MutableKeyRow(l, p);
        float* v = kvs[0].MutableValueRow(l, p);
        for (int i = 0; i < w; ++i) {
          const uint64_t x = SplitMix64((uint64_t(l) << 48) ^ (uint64_t(p) << 20) ^ uint64_t(i));
          k[i] = float(int32_t(x >> 40) - 8388608) * 0x1p-23f;
          v[i] = float(int32_t(x & 0xFFFFFF) - 8388608) * 0x1p-23f;
        }
      }
    }
    kvs[0].Commit(P);
    std::printf("synthetic KV cache of %d positions in %.1f s (no prefill timed)\n", P,
                Since(t_enc));
  } else {
    for (int at = 0; at < P; at += chunk) {  // in chunks, as the prefill worker encodes
      EncodeInput enc{std::span<const int32_t>(prompt).subspan(at, std::min(chunk, P - at)),
                      &kvs[0]};
      if (absl::Status st = backend->Encode({&enc, 1}); !st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        return 1;
      }
    }
    prefill_s = Since(t_enc);
    // The batch's other canvases get copies of this cache: its host rows must be current (a
    // device backend may hold the newest only in device memory: ModelBackend::SyncKvToHost, as
    // a prefill worker calls before it ships a prompt's KV).
    const auto t_sync = Clock::now();
    if (absl::Status st = backend->SyncKvToHost(kvs[0]); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    const double sync_s = Since(t_sync);
#ifdef DGSERVE_HAVE_CUDA
    // The prompt's K/V rows to the host: in the encoder passes (sliding layers: only the rows
    // the cache keeps, KvCache::SlidingRetainedFrom), or at the sync (the deferred host copy).
    if (const auto copies = GetCudaKvCopyStats(*backend)) {
      std::printf("prefill K/V to the host: %.3f MB in the passes, %.3f MB at the sync (%.2f ms)\n",
                  copies->encode_to_host_bytes / 1e6, copies->sync_to_host_bytes / 1e6,
                  1e3 * sync_s);
    }
#endif
    (void)sync_s;
  }
  device_peak = std::max(device_peak, DeviceMemoryUsedBytes());
  const double bf16_bytes = Bf16BytesPerStep(c);
  const double bw = absl::GetFlag(FLAGS_mem_bandwidth_gbs) * 1e9;
  const double budget = absl::GetFlag(FLAGS_step_budget_s);
  const double kv_seq = KvBytesPerSequence(c, P);
  int status = 0;
  int mirrors = 1;  // device KV mirrors made so far (one per canvas of the largest batch run)

  for (const int B : batches) {
    // Room for this batch's KV copies and scratch (device and host), else reported as skipped.
    const double host_need = (B - int(kvs.size())) * kv_seq;
    double device_need = 0, device_free = 0;
#ifdef DGSERVE_HAVE_CUDA
    if (cuda) {
      size_t free_b = 0, total_b = 0;
      if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess && free_b < total_b) {
        device_free = double(free_b);
        // Mirrors already made are reused; every sequence beyond needs one (its full layers'
        // capacity up to twice the context), and the rows' scratch.
        device_need = std::max(0, B - mirrors) * 2.0 * double(kv_bytes_per_seq) +
                      double(B) * C * DeviceBytesPerRow(c);
      }
    }
#endif
    const auto host_avail = AvailableMemoryBytes();
    const bool no_device_room = device_free > 0 && device_need > 0.95 * device_free;
    const bool no_host_room = host_avail && host_need > 0.9 * double(*host_avail);
    if (no_device_room || no_host_room) {
      std::printf(
          "RESULT device=%s gpu=%s layers=%d canvas=%d batch=%d context=%d gemm_input=%s "
          "status=skipped reason=%s need_gb=%.1f free_gb=%.1f\n",
          device.c_str(), gpu_name.c_str(), c.num_layers, C, B, P, gemm_input.c_str(),
          no_device_room ? "device_memory" : "host_memory",
          (no_device_room ? device_need : host_need) / 1e9,
          (no_device_room ? device_free : double(*host_avail)) / 1e9);
      std::fflush(stdout);
      continue;
    }
    while (int(kvs.size()) < B) kvs.push_back(kvs[0]);  // the same prompt, a cache per canvas
    mirrors = std::max(mirrors, B);

    std::vector<std::vector<int32_t>> canvas(B, std::vector<int32_t>(C));
    for (int b = 0; b < B; ++b) {
      for (int i = 0; i < C; ++i) canvas[b][i] = (i * 104729 + 5 + b * 31) % V;
    }
    std::vector<std::vector<float>> soft(B, std::vector<float>(size_t(C) * D));
    std::vector<std::vector<float>> next_soft(B, std::vector<float>(size_t(C) * D));
    std::vector<std::vector<float>> uniforms(B, std::vector<float>(C));
    std::vector<std::vector<RowResult>> rows(B, std::vector<RowResult>(C));
    double body = 0, vocab = 0, wall = 0, cpu_total = 0, entropy_sum = 0;
    // Body and vocabulary timed apart: on the CPU, on the device with --phase_timing only (na).
    const bool split_timed = !cuda || absl::GetFlag(FLAGS_phase_timing);
    double ph_attn = 0, ph_moe = 0, ph_dense = 0, ph_vocab = 0;
    bool have_phases = false;
#ifdef DGSERVE_HAVE_CUDA
    cuda::LaunchCounts counts;
#endif
    int64_t sc_pairs = 0, sc_skipped = 0, sc_kept_dense = 0;
    int timed = 0;
    bool failed = false;
    for (int s = 0; s <= steps; ++s) {  // step 0 is a warm-up, not timed
      std::vector<DenoiseStepInput> in(B);
      for (int b = 0; b < B; ++b) {
        for (int i = 0; i < C; ++i) {
          uniforms[b][i] = float((i * 37 + s * 11 + b * 7) % 1000) / 1000.0f;
        }
        in[b].canvas = canvas[b];
        in[b].sc_soft = s > 0 ? soft[b].data() : nullptr;
        in[b].kv = &kvs[b];
        in[b].temperature = 0.8f - 0.4f * float(s) / float(steps + 1);
        in[b].uniforms = uniforms[b];
        in[b].rows = rows[b].data();
        in[b].next_soft = next_soft[b].data();
        in[b].sparse_sc = UseSparseSelfConditioning(s, rows[b]);  // as the engine decides
      }
#ifdef DGSERVE_HAVE_CUDA
      const cuda::LaunchCounts before = cuda::ReadLaunchCounts();
#endif
      auto t_step = Clock::now();
      const double cpu0 = ProcessCpuSeconds();
      if (absl::Status st = backend->DenoiseStep(in); !st.ok()) {
        std::fprintf(stderr, "batch %d: %s\n", B, st.ToString().c_str());
        failed = true;
        break;
      }
      const double step_wall = Since(t_step);  // rows are on the host: the step has finished
      const double step_cpu = ProcessCpuSeconds() - cpu0;
#ifdef DGSERVE_HAVE_CUDA
      const cuda::LaunchCounts step_counts = cuda::ReadLaunchCounts() - before;
#endif
      device_peak = std::max(device_peak, DeviceMemoryUsedBytes());
      for (int b = 0; b < B; ++b) {
        std::swap(soft[b], next_soft[b]);
        for (int i = 0; i < C; ++i) canvas[b][i] = rows[b][i].sampled;  // keep the canvas moving
      }
      if (s == 0) continue;
      ++timed;
      wall += step_wall;
      cpu_total += step_cpu;
      body += backend->last_decode_timings().body_seconds;
      vocab += backend->last_decode_timings().lm_head_seconds;
      sc_pairs += backend->last_decode_timings().sc_tile_rows;
      sc_skipped += backend->last_decode_timings().sc_tile_rows_skipped;
      sc_kept_dense += backend->last_decode_timings().sc_rows_kept_dense;
#ifdef DGSERVE_HAVE_CUDA
      counts.kernels += step_counts.kernels;
      counts.cublas += step_counts.cublas;
      counts.d2d += step_counts.d2d;
      counts.h2d += step_counts.h2d;
      counts.d2h += step_counts.d2h;
      counts.syncs += step_counts.syncs;
      counts.allocs += step_counts.allocs;
      counts.graphs += step_counts.graphs;
      if (cuda) {
        if (auto t = LastCudaPhaseTimes(*backend)) {
          have_phases = true;
          ph_attn += t->attention_ms;
          ph_moe += t->moe_ms;
          ph_dense += t->dense_ms;
          ph_vocab += t->vocab_ms;
        }
      }
#endif
      for (int b = 0; b < B; ++b) {
        for (int i = 0; i < C; ++i) entropy_sum += rows[b][i].entropy;
      }
      if (budget > 0 && wall >= budget) break;
    }
    if (failed) {
      std::printf(
          "RESULT device=%s gpu=%s layers=%d canvas=%d batch=%d context=%d gemm_input=%s "
          "status=failed\n",
          device.c_str(), gpu_name.c_str(), c.num_layers, C, B, P, gemm_input.c_str());
      std::fflush(stdout);
      status = 1;
      continue;
    }
    const double per_step = wall / timed;
    const double body_flops = BodyFlops(c, C, P) * timed * B;
    const double vocab_flops = 2 * 2.0 * C * double(V) * D * timed * B;  // LM head + SC product
    const double bound_share = bw > 0 ? bf16_bytes / per_step / bw : 0;
    const double copy_share = copy_gbs > 0 ? bf16_bytes / per_step / (copy_gbs * 1e9) : 0;
    std::printf(
        "shape: vocab %d hidden %d layers %d experts %d top-k %d | canvas %d × batch %d | "
        "context %d | %d steps | device %s | %d threads\n",
        V, D, c.num_layers, c.num_experts, c.top_k_experts, C, B, P, timed, device.c_str(),
        omp_get_max_threads());
    if (synthetic_kv) {
      std::printf("prefill (encoder pass)     not run (--synthetic_kv)\n");
    } else {
      std::printf("prefill (encoder pass)     %10.2f ms  %10.0f tokens/s\n", 1e3 * prefill_s,
                  P / prefill_s);
    }
    std::printf("time per denoise step      %10.2f ms (wall, all %d canvases)\n", 1e3 * per_step,
                B);
    std::printf("CPU time per denoise step  %10.2f ms (all threads)\n", 1e3 * cpu_total / timed);
    g_last_step_wall = per_step;
    g_last_step_cpu = cpu_total / timed;
    std::printf("time per canvas of %3d st. %10.2f ms\n", steps, 1e3 * per_step * steps);
    std::printf("canvas positions per s     %10.0f (%.0f tokens/s at 16 steps per canvas)\n",
                double(C) * B / per_step, double(C) * B / (16 * per_step));
    if (split_timed) {
      std::printf("  body (layers, SC MLP)    %10.2f ms/step  %8.1f GFLOP/s\n", 1e3 * body / timed,
                  body > 0 ? body_flops / body / 1e9 : 0.0);
      std::printf(
          "  vocabulary-sized work    %10.2f ms/step  %8.1f GFLOP/s (LM head + SC GEMMs,\n"
          "                           fused with softcap/softmax/entropy/sampling)\n",
          1e3 * vocab / timed, vocab > 0 ? vocab_flops / vocab / 1e9 : 0.0);
    } else {
      std::printf(
          "  body (layers, SC MLP)    not measured (one unit on the device;\n"
          "  vocabulary-sized work    not measured  --phase_timing splits it)\n");
    }
    if (have_phases) {
      const double sum = (ph_attn + ph_moe + ph_dense + ph_vocab) / timed;
      std::printf(
          "  phases (CUDA events)     attention %.2f  moe %.2f  dense %.2f  vocabulary %.2f  "
          "host gaps %.2f ms/step\n",
          ph_attn / timed, ph_moe / timed, ph_dense / timed, ph_vocab / timed,
          1e3 * per_step - sum);
    }
    std::printf("mean row entropy           %10.3f nats (uniform over the vocabulary: %.3f)\n",
                entropy_sum / (double(timed) * B * C), std::log(double(V)));
    if (sc_pairs > 0) {
      std::printf("sparse SC product: %.1f %% of (row, vocabulary tile) pairs left out, %lld rows "
                  "kept dense by the bound (DGSERVE_DENSE_SC=1: dense)\n",
                  100.0 * double(sc_skipped) / double(sc_pairs), (long long)sc_kept_dense);
    }
    std::printf("bf16 weights read per step %10.3f GB", bf16_bytes / 1e9);
    if (bw > 0) {
      std::printf(" → %.1f %% of the bf16 bound at %.0f GB/s", 100 * bound_share, bw / 1e9);
    }
    if (copy_gbs > 0) {
      std::printf(" → %.1f %% of the measured copy bandwidth (%.0f GB/s)", 100 * copy_share,
                  copy_gbs);
    }
    std::printf("\n");
    std::string extra;
#ifdef DGSERVE_HAVE_CUDA
    if (cuda) {
      const double n = timed;
      absl::StrAppend(&extra, " launches_per_step=", Fmt(counts.launches() / n, "%.1f"),
                      " kernels_per_step=", Fmt(counts.kernels / n, "%.1f"),
                      " cublas_per_step=", Fmt(counts.cublas / n, "%.1f"),
                      " syncs_per_step=", Fmt(counts.blocking() / n, "%.1f"),
                      " h2d_per_step=", Fmt(counts.h2d / n, "%.1f"),
                      " d2h_per_step=", Fmt(counts.d2h / n, "%.1f"),
                      " allocs_per_step=", Fmt(counts.allocs / n, "%.1f"),
                      " graphs_per_step=", Fmt(counts.graphs / n, "%.2f"));
      std::printf(
          "per step: %.1f launches (%.1f kernels, %.1f cuBLAS calls, %.1f device copies), "
          "%.1f blocking host round trips (%.1f uploads, %.1f downloads, %.1f syncs), "
          "%.1f allocations, %.2f graph launches\n",
          counts.launches() / n, counts.kernels / n, counts.cublas / n, counts.d2d / n,
          counts.blocking() / n, counts.h2d / n, counts.d2h / n, counts.syncs / n,
          counts.allocs / n, counts.graphs / n);
    }
#endif
    if (have_phases) {
      // The table of % of ceiling: each phase's bytes and FLOPs over its CUDA-event time,
      // against the measured copy bandwidth and GEMM throughput.
      const PhaseWork w = StepWork(c, C, B, P);
      const struct {
        const char* name;
        double ms, bytes, flops;
      } table[] = {{"attention", ph_attn / timed, w.attn_bytes, w.attn_flops},
                   {"moe", ph_moe / timed, w.moe_bytes, w.moe_flops},
                   {"dense", ph_dense / timed, w.dense_bytes, w.dense_flops},
                   {"vocab", ph_vocab / timed, w.vocab_bytes, w.vocab_flops}};
      for (const auto& t : table) {
        const double s = t.ms * 1e-3;
        const double gbs = s > 0 ? t.bytes / s / 1e9 : 0, tflops = s > 0 ? t.flops / s / 1e12 : 0;
        std::printf(
            "PHASE batch=%d context=%d phase=%s ms=%.3f gb=%.3f gbs=%.1f pct_copy=%.1f "
            "tflops=%.2f pct_gemm=%.1f\n",
            B, P, t.name, t.ms, t.bytes / 1e9, gbs, copy_gbs > 0 ? 100 * gbs / copy_gbs : 0.0,
            tflops, gemm_tflops > 0 ? 100 * tflops / gemm_tflops : 0.0);
      }
      const double sum = (ph_attn + ph_moe + ph_dense + ph_vocab) / timed;
      absl::StrAppend(&extra, " phase_attn_ms=", Fmt(ph_attn / timed),
                      " phase_moe_ms=", Fmt(ph_moe / timed),
                      " phase_dense_ms=", Fmt(ph_dense / timed),
                      " phase_vocab_ms=", Fmt(ph_vocab / timed),
                      " host_gap_ms=", Fmt(1e3 * per_step - sum));
    }
    if (cuda) {
      absl::StrAppend(&extra, " copy_gbs=", Fmt(copy_gbs, "%.1f"),
                      " gemm_tflops=", Fmt(gemm_tflops, "%.1f"),
                      " weight_bw_share=", Fmt(copy_share, "%.4f"));
#ifdef DGSERVE_HAVE_CUDA
      absl::StrAppend(&extra, " kv_device_bytes_per_seq=", kv_bytes_per_seq,
                      " kv_block_size=", absl::GetFlag(FLAGS_cuda_kv_block_size),
                      " attention=", attention);
#endif
    }
    const auto peak_rss = PeakResidentBytes();
    // The checkpoint's weight format (issue 37) and its weights' bytes as held in memory.
    absl::StrAppend(
        &extra, " format=", ckpt ? QuantizationName(ckpt->quant) : std::string("bf16"),
        " weights_gb=", Fmt((ckpt ? WeightBytes(c, ckpt->quant) : WeightBytes(c)) / 1e9, "%.3f"));
    std::printf(
        "RESULT device=%s gpu=%s layers=%d canvas=%d batch=%d context=%d steps=%d gemm_input=%s "
        "weights=%s status=ok prefill_ms=%s step_ms=%.3f body_ms=%s vocab_ms=%s "
        "canvas_ms=%.2f positions_per_s=%.0f tokens_per_s_16=%.1f bf16_gb_per_step=%.3f "
        "bf16_bound_share=%.4f device_mem_gb=%.2f peak_rss_gb=%.2f sc_skipped_share=%.4f%s\n",
        device.c_str(), gpu_name.c_str(), c.num_layers, C, B, P, timed, gemm_input.c_str(),
        synthetic ? (cuda ? "synthetic_device" : "synthetic_host") : "checkpoint",
        synthetic_kv ? "na" : Fmt(1e3 * prefill_s, "%.2f").c_str(), 1e3 * per_step,
        split_timed ? Fmt(1e3 * body / timed).c_str() : "na",
        split_timed ? Fmt(1e3 * vocab / timed).c_str() : "na", 1e3 * per_step * steps,
        double(C) * B / per_step, double(C) * B / (16 * per_step), bf16_bytes / 1e9, bound_share,
        device_peak / 1e9, peak_rss ? double(*peak_rss) / 1e9 : 0.0,
        sc_pairs > 0 ? double(sc_skipped) / double(sc_pairs) : 0.0, extra.c_str());
    std::fflush(stdout);
  }
  return status;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "engine_bench (--model DIR | --config FILE | --config_json TEXT) [--layers N] "
      "[--device cpu|cuda] [--canvas N] [--steps N] [--context N] [--batch N] [--seed N] "
      "[--mem_bandwidth_gbs GB/s] [--logit_scale X] [--synthetic] [--synthetic_kv] "
      "[--batches 1,2,4] [--step_budget_s S] [--phase_timing] [--cuda_graphs=false] "
      "[--cuda_tensor_core_attention=false] [--cuda_defer_kv_host_copy=false] "
      "[--cuda_kv_block_size N] [--calibrate_copy_mb MB] [--calibrate_gemm_n N] "
      "[--cpu_gemm_input float32|bf16] [--cpu_gemm_inputs float32,bf16 [--repeats R]]",
      "bench/engine_bench.cc");
  std::vector<char*> rest = dgserve::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
#ifndef DGSERVE_HAVE_CUDA
  if (absl::GetFlag(FLAGS_device) == "cuda") {  // before any model is generated or loaded
    std::fprintf(stderr,
                 "%s; or engine_bench_emu (built with the tests, -DDGSERVE_BUILD_GPU_EMU=ON) "
                 "runs it on the host emulation of the device, without a GPU (no real times)\n",
                 dgserve::CudaBackendMissingMessage().c_str());
    return 1;
  }
#endif
  // Numeric flags that a loop or a ratio would otherwise take silently as something else.
  if (const int r = absl::GetFlag(FLAGS_repeats); r < 1) {
    std::fprintf(stderr, "--repeats %d: must be ≥ 1\n", r);
    return 2;
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
  // Before a checkpoint is generated or loaded.
  if (absl::StatusOr<dgserve::BackendSelection> backend =
          dgserve::BackendSelectionFromFlags(absl::GetFlag(FLAGS_device));
      backend.ok()) {
    dgserve::g_backend = *std::move(backend);
  } else {
    std::fprintf(stderr, "%s\n", std::string(backend.status().message()).c_str());
    return 2;
  }
  try {
    const std::string modes_flag = absl::GetFlag(FLAGS_cpu_gemm_inputs);
    if (modes_flag.empty()) return dgserve::Run();
    // Both CPU GEMM input modes in one process, in alternation, best of --repeats each.
    if (absl::GetFlag(FLAGS_device) != "cpu") {
      std::fprintf(stderr, "--cpu_gemm_inputs needs --device cpu\n");
      return 2;
    }
    const std::vector<std::string> modes = absl::StrSplit(modes_flag, ',', absl::SkipEmpty());
    for (const std::string& m : modes) {
      if (m != "float32" && m != "bf16") {
        std::fprintf(stderr, "--cpu_gemm_inputs: '%s' is not float32 or bf16\n", m.c_str());
        return 2;
      }
    }
    const int repeats = absl::GetFlag(FLAGS_repeats);
    std::vector<double> best(modes.size(), 1e30), best_cpu(modes.size(), 1e30);
    for (int r = 0; r < repeats; ++r) {
      for (size_t i = 0; i < modes.size(); ++i) {
        std::printf("== cpu_gemm_input=%s (repeat %d)\n", modes[i].c_str(), r + 1);
        dgserve::g_backend.cpu_gemm_input = *dgserve::cpu::ParseGemmInput(modes[i]);
        if (int rc = dgserve::Run(); rc != 0) return rc;
        best[i] = std::min(best[i], dgserve::g_last_step_wall);
        best_cpu[i] = std::min(best_cpu[i], dgserve::g_last_step_cpu);
      }
    }
    std::printf("best step per mode (wall / CPU time):");
    for (size_t i = 0; i < modes.size(); ++i) {
      std::printf(" %s %.2f / %.2f ms", modes[i].c_str(), 1e3 * best[i], 1e3 * best_cpu[i]);
    }
    std::printf("\n");
    for (size_t i = 1; i < modes.size(); ++i) {
      std::printf("step %s / step %s = %.3f wall, %.3f CPU time\n", modes[i].c_str(),
                  modes[0].c_str(), best[i] / best[0], best_cpu[i] / best_cpu[0]);
    }
    return 0;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "out of memory\n");
    return 1;
  }
}
