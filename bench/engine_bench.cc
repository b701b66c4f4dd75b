// engine_bench: time per denoise step and canvas positions per second of the engine at fixed
// work (a fixed number of steps, no early stop), split into the transformer body and the
// vocabulary-sized work (LM head, self-conditioning product, softmax/entropy/sampling), and the
// time of the prompt's encoder pass (prefill).
//
//   engine_bench --model DIR [--device cpu|cuda] [--canvas N] [--steps N] [--context P]
//                [--batch B] [--mem_bandwidth_gbs GB/s]
//   engine_bench --config_json '{...config.json...}' [--layers N] [--canvas N] ...
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
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/system_resources.h"
#include "engine/denoise/row_sampler.h"
#include "engine/model/backend.h"
#include "engine/model/checkpoint.h"
#include "engine/model/backend_select.h"
#include "engine/model/kv_cache.h"
#include "engine/model/random_checkpoint.h"
#include "engine/model/tensor_names.h"
#ifdef DGSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
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
ABSL_FLAG(int, prefill_chunk, 512,
          "prompt tokens per encoder pass (the workers' kPrefillChunkTokens is 512)");
ABSL_FLAG(double, logit_scale, 1.0,
          "multiply the final norm's weight (so every logit before the softcap) by this factor, "
          "in (0, 1e6]; the softcap bounds the logits, so large factors flatten the rows rather "
          "than peak them (bench/vocab_bench measures peaked rows)");
ABSL_FLAG(int, batch, 1, "canvases denoised together per step, each with its own KV cache copy");
ABSL_FLAG(double, mem_bandwidth_gbs, 0,
          "device memory bandwidth in GB/s for the share of the bf16 bound (0: not reported)");

namespace dgserve {
namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Multiply-adds ×2 of one decoder pass over `rows` canvas rows with `ctx` context tokens,
// excluding the LM head (the body), per spec §3.2–§3.5.
double BodyFlops(const ModelConfig& c, int rows, int ctx) {
  const double D = c.hidden_size, I = c.intermediate_size, F = c.moe_intermediate_size;
  double f = 2.0 * rows * 3 * D * I;  // self-conditioning MLP
  for (int l = 0; l < c.num_layers; ++l) {
    const double hd = c.HeadDim(l), nh = c.num_heads, nkv = c.KvHeads(l);
    const double kv_proj = c.IsFull(l) ? nkv * hd : 2 * nkv * hd;
    const int keys = (c.IsFull(l) ? ctx : std::min(ctx, c.sliding_window - 1)) + rows;
    f += 2.0 * rows * D * (nh * hd + kv_proj);      // q, k, v projections
    f += 2.0 * rows * nh * hd * D;                  // o projection
    f += 2.0 * 2 * rows * nh * hd * keys;           // scores and weighted values
    f += 2.0 * rows * 3 * D * I;                    // dense MLP
    f += 2.0 * rows * D * c.num_experts;            // router
    f += 2.0 * rows * c.top_k_experts * 3 * D * F;  // experts
  }
  return f;
}

// Bytes of bf16 weights one denoising step reads: every matrix (rank ≥ 2) once, plus the
// embedding a second time (LM head and self-conditioning product both read it).
double Bf16BytesPerStep(const ModelConfig& c) {
  double bytes = 0;
  for (const TensorSpec& spec : ExpectedTensors(c)) {
    if (spec.shape.size() >= 2) bytes += 2.0 * double(spec.numel());
  }
  return bytes + 2.0 * double(c.vocab_size) * c.hidden_size;
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

int Run() {
  const double logit_scale = absl::GetFlag(FLAGS_logit_scale);
  if (!(logit_scale > 0 && logit_scale <= 1e6)) {
    std::fprintf(stderr, "--logit_scale must be in (0, 1e6], got %g\n", logit_scale);
    return 2;
  }
  std::string dir = absl::GetFlag(FLAGS_model);
  if (!dir.empty() && absl::GetFlag(FLAGS_layers) != 0) {
    std::fprintf(stderr, "--layers applies to --config/--config_json, not to --model\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_canvas) < 0 || absl::GetFlag(FLAGS_steps) < 1 ||
      absl::GetFlag(FLAGS_context) < 1) {
    std::fprintf(stderr, "--canvas must be ≥ 0 (0: the checkpoint's), --steps and --context ≥ 1\n");
    return 2;
  }
  const int B = absl::GetFlag(FLAGS_batch);
  if (B < 1 || B > 256) {
    std::fprintf(stderr, "--batch must be in [1, 256], got %d\n", B);
    return 2;
  }
  std::filesystem::path tmp;
  if (dir.empty()) {
    std::string text = absl::GetFlag(FLAGS_config_json);
    if (text.empty() && !absl::GetFlag(FLAGS_config).empty()) {
      auto t = ReadFileToString(absl::GetFlag(FLAGS_config));
      if (!t.ok()) {
        std::fprintf(stderr, "%s\n", t.status().ToString().c_str());
        return 1;
      }
      text = *t;
    }
    if (text.empty()) {
      std::fprintf(stderr, "give --model DIR, --config FILE or --config_json TEXT\n");
      return 2;
    }
    auto cfg = ParseModelConfig(text, "--config");
    if (!cfg.ok()) {
      std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
      return 1;
    }
    if (int n = absl::GetFlag(FLAGS_layers); n != 0) {
      if (n < 0 || n > cfg->num_layers) {
        std::fprintf(stderr, "--layers must be in [1, %d], got %d\n", cfg->num_layers, n);
        return 2;
      }
      cfg->num_layers = n;
      cfg->layer_types.resize(n);
      cfg->layer_types.back() = LayerType::kFull;  // as the loader does (HF forces it)
    }
    // Refuse a shape whose weights (bf16, see WeightBytes) cannot fit before writing it.
    const int64_t bytes = WeightBytes(*cfg);
    std::printf("weights in memory: %.2f GB (bf16 matrices, embedding twice)\n", bytes / 1e9);
    if (auto avail = AvailableMemoryBytes(); avail && uint64_t(bytes) > *avail) {
      std::fprintf(stderr,
                   "this shape needs %.1f GB of weights but only %.1f GB of memory are "
                   "available; use --layers N for a slice\n",
                   bytes / 1e9, double(*avail) / 1e9);
      return 1;
    }
    tmp = std::filesystem::temp_directory_path() / absl::StrCat("dgserve_bench_", ::getpid());
    auto t0 = Clock::now();
    absl::Status st =
        WriteRandomCheckpoint(*cfg, GenerationConfig{}, absl::GetFlag(FLAGS_seed), tmp.string());
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    std::printf("generated checkpoint in %.1f s\n", Since(t0));
    dir = tmp.string();
  }
  auto t0 = Clock::now();
  auto ckpt = LoadCheckpoint(dir);
  if (!tmp.empty()) std::filesystem::remove_all(tmp);
  if (!ckpt.ok()) {
    std::fprintf(stderr, "%s\n", ckpt.status().ToString().c_str());
    return 1;
  }
  std::printf("loaded checkpoint in %.1f s\n", Since(t0));
  if (auto rss = ResidentBytes(), peak = PeakResidentBytes(); rss && peak) {
    std::printf("resident memory after load %.2f GB (peak so far %.2f GB)\n", *rss / 1e9,
                *peak / 1e9);
  }
  const ModelConfig& c = ckpt->config;
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
  const std::string device = absl::GetFlag(FLAGS_device);
  auto created = CreateBackendForDevice(device, c, ckpt->weights);
  if (!created.ok()) {
    std::fprintf(stderr, "%s\n", created.status().ToString().c_str());
    return 1;
  }
  std::unique_ptr<ModelBackend> backend = *std::move(created);
  double device_peak = DeviceMemoryUsedBytes();

  std::vector<ContiguousKvCache> kvs;
  kvs.reserve(B);
  kvs.emplace_back(c, P);
  std::vector<int32_t> prompt(P);
  for (int i = 0; i < P; ++i) prompt[i] = (i * 7919 + 13) % V;
  const int chunk = std::max(1, absl::GetFlag(FLAGS_prefill_chunk));
  auto t_enc = Clock::now();
  for (int at = 0; at < P; at += chunk) {  // in chunks, as the prefill worker encodes
    EncodeInput enc{std::span<const int32_t>(prompt).subspan(at, std::min(chunk, P - at)),
                    &kvs[0]};
    if (absl::Status st = backend->Encode({&enc, 1}); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  const double prefill_s = Since(t_enc);
  for (int b = 1; b < B; ++b) kvs.push_back(kvs[0]);  // the same prompt, a cache per canvas
  device_peak = std::max(device_peak, DeviceMemoryUsedBytes());

  std::vector<std::vector<int32_t>> canvas(B, std::vector<int32_t>(C));
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < C; ++i) canvas[b][i] = (i * 104729 + 5 + b * 31) % V;
  }
  std::vector<std::vector<float>> soft(B, std::vector<float>(size_t(C) * D));
  std::vector<std::vector<float>> next_soft(B, std::vector<float>(size_t(C) * D));
  std::vector<std::vector<float>> uniforms(B, std::vector<float>(C));
  std::vector<std::vector<RowResult>> rows(B, std::vector<RowResult>(C));
  double body = 0, vocab = 0, wall = 0, entropy_sum = 0;
  int64_t sc_pairs = 0, sc_skipped = 0, sc_kept_dense = 0;
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
    auto t_step = Clock::now();
    if (absl::Status st = backend->DenoiseStep(in); !st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
    const double step_wall = Since(t_step);  // rows are on the host: the step has finished
    device_peak = std::max(device_peak, DeviceMemoryUsedBytes());
    for (int b = 0; b < B; ++b) {
      std::swap(soft[b], next_soft[b]);
      for (int i = 0; i < C; ++i) canvas[b][i] = rows[b][i].sampled;  // keep the canvas moving
    }
    if (s == 0) continue;
    wall += step_wall;
    body += backend->last_decode_timings().body_seconds;
    vocab += backend->last_decode_timings().lm_head_seconds;
    sc_pairs += backend->last_decode_timings().sc_tile_rows;
    sc_skipped += backend->last_decode_timings().sc_tile_rows_skipped;
    sc_kept_dense += backend->last_decode_timings().sc_rows_kept_dense;
    for (int b = 0; b < B; ++b) {
      for (int i = 0; i < C; ++i) entropy_sum += rows[b][i].entropy;
    }
  }
  const double per_step = wall / steps;
  const double body_flops = BodyFlops(c, C, P) * steps * B;
  const double vocab_flops = 2 * 2.0 * C * double(V) * D * steps * B;  // LM head + SC product
  const double bf16_bytes = Bf16BytesPerStep(c);
  const double bw = absl::GetFlag(FLAGS_mem_bandwidth_gbs) * 1e9;
  const double bound_share = bw > 0 ? bf16_bytes / per_step / bw : 0;
  std::printf(
      "shape: vocab %d hidden %d layers %d experts %d top-k %d | canvas %d × batch %d | context "
      "%d | %d steps | device %s | %d threads\n",
      V, D, c.num_layers, c.num_experts, c.top_k_experts, C, B, P, steps, device.c_str(),
      omp_get_max_threads());
  std::printf("prefill (encoder pass)     %10.2f ms  %10.0f tokens/s\n", 1e3 * prefill_s,
              P / prefill_s);
  std::printf("time per denoise step      %10.2f ms (wall, all %d canvases)\n", 1e3 * per_step, B);
  std::printf("time per canvas of %3d st. %10.2f ms\n", steps, 1e3 * per_step * steps);
  std::printf("canvas positions per s     %10.0f\n", double(C) * B / per_step);
  std::printf("  body (layers, SC MLP)    %10.2f ms/step  %8.1f GFLOP/s\n", 1e3 * body / steps,
              body > 0 ? body_flops / body / 1e9 : 0.0);
  std::printf(
      "  vocabulary-sized work    %10.2f ms/step  %8.1f GFLOP/s (LM head + SC GEMMs,\n"
      "                           fused with softcap/softmax/entropy/sampling)\n",
      1e3 * vocab / steps, vocab > 0 ? vocab_flops / vocab / 1e9 : 0.0);
  std::printf("mean row entropy           %10.3f nats (uniform over the vocabulary: %.3f)\n",
              entropy_sum / (double(steps) * B * C), std::log(double(V)));
  if (sc_pairs > 0) {
    std::printf("sparse SC product: %.1f %% of (row, vocabulary tile) pairs left out, %lld rows "
                "kept dense by the bound (DGSERVE_DENSE_SC=1: dense)\n",
                100.0 * double(sc_skipped) / double(sc_pairs), (long long)sc_kept_dense);
  }
  std::printf("bf16 weights read per step %10.3f GB", bf16_bytes / 1e9);
  if (bw > 0) {
    std::printf(" → %.1f %% of the bf16 bound at %.0f GB/s", 100 * bound_share, bw / 1e9);
  }
  std::printf("\n");
  const auto peak_rss = PeakResidentBytes();
  std::printf(
      "RESULT device=%s format=%s weights_gb=%.3f layers=%d canvas=%d batch=%d context=%d "
      "steps=%d prefill_ms=%.2f "
      "step_ms=%.3f canvas_ms=%.2f positions_per_s=%.0f bf16_gb_per_step=%.3f "
      "bf16_bound_share=%.4f device_mem_gb=%.2f peak_rss_gb=%.2f sc_skipped_share=%.4f\n",
      device.c_str(), WeightFormatName(ckpt->quant.format),
      WeightBytes(c, ckpt->quant) / 1e9, c.num_layers, C, B, P, steps, 1e3 * prefill_s, 1e3 * per_step,
      1e3 * per_step * steps, double(C) * B / per_step, bf16_bytes / 1e9, bound_share,
      device_peak / 1e9, peak_rss ? double(*peak_rss) / 1e9 : 0.0,
      sc_pairs > 0 ? double(sc_skipped) / double(sc_pairs) : 0.0);
  return 0;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "engine_bench (--model DIR | --config FILE | --config_json TEXT) [--layers N] "
      "[--device cpu|cuda] [--canvas N] [--steps N] [--context N] [--batch N] [--seed N] "
      "[--mem_bandwidth_gbs GB/s] [--logit_scale X]",
      "bench/engine_bench.cc");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
  // Before a checkpoint is generated or loaded.
  if (absl::Status st = dgserve::CheckDeviceFlags(absl::GetFlag(FLAGS_device)); !st.ok()) {
    std::fprintf(stderr, "%s\n", std::string(st.message()).c_str());
    return 2;
  }
  try {
    return dgserve::Run();
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "out of memory\n");
    return 1;
  }
}
