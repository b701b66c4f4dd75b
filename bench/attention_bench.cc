// attention_bench: the attention kernels of engine/cuda/cuda_attention.h alone, on the model's
// shapes (issue 34 item 5): the decoder's canvas attention (TensorCoreCanvasAttention, and the
// float32 CanvasAttention for comparison) and the encoder's causal prefill attention
// (TensorCorePrefillAttention, and the float32 PrefillAttention), each timed with CUDA events
// and judged against the two ceilings measured in the same process (cuda_calibrate.h:
// MeasureCeilings, a device-to-device copy and a bf16 cuBLAS GEMM).
//
//   attention_bench --config bench/configs/diffusiongemma-26b-a4b.json
//       [--kernels tc_canvas,tc_prefill,f32_canvas,f32_prefill] [--layers sliding,full]
//       [--contexts 2048,32768,131072] [--batches 1,16] [--prompt 32768]
//       [--prefill_chunks 8192,0] [--reps 5] [--device_budget_s S]
//       [--calibrate_copy_mb MB] [--calibrate_gemm_n N]
//
// The shapes come from the config through the ModelConfig loader: heads = num_attention_heads;
// sliding layers: head_dim, num_key_value_heads, the sliding window W; full layers:
// global_head_dim, num_global_key_value_heads, no window. Canvas rows = canvas_length (--canvas).
//
// Cases (in --kernels order, then layer, then context / chunk, then batch):
//  - tc_canvas / f32_canvas: `batch` canvases of `rows` rows, each with its own context K/V of
//    `context` cached tokens (float32 [tokens, kv_heads, head_dim], as the backend's device
//    mirror). tc_canvas: one launch for the whole batch (a CanvasSegment per canvas, as the
//    backend's decoder pass); f32_canvas: one CanvasAttention launch per canvas (as the
//    backend's float32 path). Sliding layers see only the last W − 1 context tokens
//    (CanvasWindowStart), so only those are allocated and passed (context_tokens =
//    min(context, W − 1): the kernels do the same work and read the same bytes).
//  - tc_prefill / f32_prefill: one causal prompt of --prompt tokens (batch 1), in chunks of
//    `chunk` tokens as the backend runs its encoder pass (8192: a GPU backend's,
//    kGpuPrefillChunkTokens; chunk i attends to the prompt's tokens before it as its context, one
//    launch per chunk), or whole (chunk=0: one launch of all rows, no context). A repetition is the
//    whole prompt.
//
// Work counted per case (exactly, per row, from the visible keys):
//   FLOPs = Σ_rows 4 · heads · keys_seen(row) · head_dim
//     (QKᵀ and P·V, 2 FLOPs per multiply-add each; softmax not counted), with
//     canvas: keys_seen = rows + context_visible, context_visible = context − CanvasWindowStart
//       (all context on full layers, min(context, W − 1) on sliding ones), the same for every row;
//     causal prefill: the row at prompt position p sees min(p + 1, W) keys (p + 1 without a
//       window) — the same whatever the chunking.
//   bytes = 4 · (2 · context_visible · kv_heads · head_dim        (context K and V, read once
//                                                                  per KV head: GQA shares them)
//                + rows · (2 · heads + 2 · kv_heads) · head_dim)   (Q in, new K and V in, out)
//     per canvas, and per prefill chunk with context_visible = the chunk's context tokens at or
//     after its first row's window start (whole: none). float32 arrays (4 bytes an element), as
//     the kernels take them (the tensor-core kernels round to bf16 while staging tiles). This is
//     the compulsory traffic: a kernel that reads a K/V tile again for another block of rows
//     moves more, so gbs is a lower bound of the achieved bandwidth.
//   tflops = FLOPs / ms, pct_gemm = tflops / the measured bf16 GEMM rate; gbs = bytes / ms,
//   pct_copy = gbs / the measured copy bandwidth (read + write, as cuda_calibrate.h counts it).
//
// Timing: inputs filled once on the device (cuda_synthetic.h's FillSyntheticFloat: uniform in
// [−0.5, 0.5), scores finite), one warm-up repetition, then --reps repetitions, each between two
// CUDA events; ms is their mean, min_ms the best. --device_budget_s bounds the whole run (from
// the start, ceilings included): a case whose estimated time (its FLOPs at the rate the same
// kernel last reached) does not fit in what is left is skipped, and the timed repetitions are
// cut to what is left after the warm-up (reps=0: the warm-up's time alone). A case whose buffers
// would not fit in 90 % of free device memory (cudaMemGetInfo) is skipped; so is a tensor-core
// case whose head_dim the kernel does not take (a multiple of 32 up to 512).
//
// Output: a CEILINGS line, then one line per case:
//   ATTN kernel=tc_canvas layer=full head_dim=512 heads=16 kv_heads=2 window=0 batch=16
//     context=32768 rows=256 keys=33024 launches=1 reps=5 ms=… min_ms=… gflop=… tflops=…
//     pct_gemm=… gb=… gbs=… pct_copy=… status=ok
//   ATTN kernel=tc_prefill layer=full … batch=1 prompt=32768 chunk=8192 rows=32768 keys=16384.5
//     launches=64 … status=ok            (keys: the mean keys a row sees)
//   ATTN kernel=… status=skipped reason=device_memory|budget|head_dim need_gb=… free_gb=…
//   ATTN kernel=… status=failed error=…
// Exit status 1 when a case failed (skipped cases are not failures), 2 on bad flags.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/cli.h"
#include "common/status_macros.h"
#include "engine/cuda/cuda_attention.h"
#include "engine/cuda/cuda_calibrate.h"
#include "engine/cuda/cuda_memory.h"
#include "engine/cuda/cuda_synthetic.h"
#include "engine/model/config.h"

ABSL_FLAG(std::string, config, "", "config.json of the model whose attention shapes to time");
ABSL_FLAG(std::string, kernels, "tc_canvas,tc_prefill,f32_canvas,f32_prefill",
          "comma-separated kernels, run in this order: tc_canvas (TensorCoreCanvasAttention), "
          "f32_canvas (CanvasAttention), tc_prefill (TensorCorePrefillAttention), f32_prefill "
          "(PrefillAttention)");
ABSL_FLAG(std::string, layers, "sliding,full", "layer types: sliding, full");
ABSL_FLAG(std::string, contexts, "2048,32768,131072", "canvas cases: cached context tokens");
ABSL_FLAG(std::string, batches, "1,16", "canvas cases: canvases per launch");
ABSL_FLAG(int, canvas, 0, "rows per canvas (0: the config's canvas_length)");
ABSL_FLAG(int, prompt, 32768, "prefill cases: prompt tokens");
ABSL_FLAG(
    std::string, prefill_chunks, "8192,0",
    "prefill cases: tokens per encoder pass (8192: a GPU backend's chunk; 0: the whole prompt "
    "in one launch)");
ABSL_FLAG(int, reps, 5, "timed repetitions per case (after one warm-up)");
ABSL_FLAG(double, device_budget_s, 0,
          "bound on the whole run in seconds (cases that would not fit are skipped; 0: none)");
ABSL_FLAG(int, calibrate_copy_mb, 1024,
          "MiB of the device-to-device copy that measures the bandwidth ceiling (0: skip)");
ABSL_FLAG(int, calibrate_gemm_n, 8192,
          "n of the n×n×n bf16 GEMM that measures the tensor-core ceiling (0: skip)");

namespace dgserve {
namespace {

using Clock = std::chrono::steady_clock;

struct LayerShape {
  std::string name;  // sliding | full
  int head_dim = 0, kv_heads = 0, window = 0;
};

// One case's work (see the header comment for the formulas).
struct Work {
  double flops = 0, bytes = 0, keys = 0;  // keys: per row (the mean for prefill)
  int launches = 0;
};

// Events for one timed interval.
struct Events {
  cudaEvent_t start = nullptr, stop = nullptr;
  ~Events() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
  absl::Status Create() {
    DGSERVE_RETURN_IF_ERROR(
        cuda::CudaCheck(cudaEventCreateWithFlags(&start, cudaEventDefault), "event"));
    return cuda::CudaCheck(cudaEventCreateWithFlags(&stop, cudaEventDefault), "event");
  }
};

absl::StatusOr<std::vector<int>> ParseInts(const std::string& text, const char* flag, int min) {
  std::vector<int> out;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(s, &v) || v < min) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", s, "' is not an integer ≥ ", min));
    }
    out.push_back(v);
  }
  return out;
}

class Bench {
 public:
  Bench(const ModelConfig& c, double copy_gbs, double gemm_tflops, std::string gpu,
        Clock::time_point start)
      : c_(c),
        copy_gbs_(copy_gbs),
        gemm_tflops_(gemm_tflops),
        gpu_(std::move(gpu)),
        start_(start) {}

  // Seconds left of --device_budget_s (a large number without a budget).
  double Left() const {
    const double budget = absl::GetFlag(FLAGS_device_budget_s);
    if (budget <= 0) return 1e30;
    return budget - std::chrono::duration<double>(Clock::now() - start_).count();
  }

  void Canvas(const std::string& kernel, const LayerShape& L, int context, int batch) {
    const int rows = Rows(), nh = c_.num_heads, hd = L.head_dim, kv = L.kv_heads;
    // Context tokens the rows see; only those are allocated and passed (see the header).
    const int visible = context - cuda::CanvasWindowStart(context, L.window);
    Work w;
    w.keys = double(rows) + visible;
    w.flops = 4.0 * batch * rows * nh * w.keys * hd;
    w.bytes = 4.0 * batch * (2.0 * visible * kv * hd + double(rows) * (2.0 * nh + 2.0 * kv) * hd);
    w.launches = kernel == "tc_canvas" ? 1 : batch;
    const std::string head =
        absl::StrCat(Head(kernel, L), " batch=", batch, " context=", context, " rows=", rows);
    if (kernel == "tc_canvas" && !TensorCoreHeadDim(hd)) {
      Skip(head, "head_dim", 0, 0);
      return;
    }
    const size_t q_n = size_t(batch) * rows * nh * hd, kv_n = size_t(batch) * rows * kv * hd;
    const size_t ctx_n = size_t(visible) * kv * hd;  // per canvas, K and V each
    const double need = 4.0 * (2.0 * q_n + 2.0 * kv_n + 2.0 * batch * double(ctx_n)) +
                        double(batch) * sizeof(cuda::CanvasSegment);
    if (!Fits(head, need) || !InBudget(head, kernel, w.flops)) return;

    auto run = [&]() -> absl::Status {
      cuda::DeviceArray<float> q, kn, vn, out;
      std::vector<cuda::DeviceArray<float>> ck(batch), cv(batch);
      DGSERVE_RETURN_IF_ERROR(Filled(&q, q_n));
      DGSERVE_RETURN_IF_ERROR(Filled(&kn, kv_n));
      DGSERVE_RETURN_IF_ERROR(Filled(&vn, kv_n));
      DGSERVE_RETURN_IF_ERROR(out.Ensure(q_n));
      std::vector<cuda::CanvasSegment> segs(batch);
      for (int b = 0; b < batch; ++b) {
        DGSERVE_RETURN_IF_ERROR(Filled(&ck[b], ctx_n));
        DGSERVE_RETURN_IF_ERROR(Filled(&cv[b], ctx_n));
        segs[b].ctx_k = ck[b].get();
        segs[b].ctx_v = cv[b].get();
        segs[b].row0 = b * rows;
        segs[b].rows = rows;
        segs[b].ctx_tokens = visible;
        segs[b].ctx_first = cuda::CanvasWindowStart(visible, L.window);  // 0: all are visible
      }
      cuda::DeviceArray<cuda::CanvasSegment> table;
      DGSERVE_RETURN_IF_ERROR(table.Upload(segs));
      auto once = [&]() -> absl::Status {
        if (kernel == "tc_canvas") {
          return cuda::TensorCoreCanvasAttention(q.get(), kn.get(), vn.get(), table.get(), batch,
                                                 batch * rows, nh, kv, hd, out.get());
        }
        for (int b = 0; b < batch; ++b) {
          cuda::KvContext ctx;
          ctx.tokens = visible;
          if (visible > 0) {
            ctx.k = ck[b].get();
            ctx.v = cv[b].get();
          }
          const size_t qo = size_t(b) * rows * nh * hd, ko = size_t(b) * rows * kv * hd;
          DGSERVE_RETURN_IF_ERROR(cuda::CanvasAttention(q.get() + qo, kn.get() + ko, vn.get() + ko,
                                                        rows, ctx, nh, kv, hd, L.window,
                                                        out.get() + qo));
        }
        return absl::OkStatus();
      };
      return Time(head, kernel, w, once);
    };
    if (absl::Status s = run(); !s.ok()) Fail(head, s);
  }

  void Prefill(const std::string& kernel, const LayerShape& L, int prompt, int chunk) {
    const int nh = c_.num_heads, hd = L.head_dim, kv = L.kv_heads;
    const int step = chunk > 0 ? std::min(chunk, prompt) : prompt;
    Work w;
    double keys_total = 0;
    for (int p = 0; p < prompt; ++p) {
      keys_total += L.window > 0 ? std::min(p + 1, L.window) : p + 1;
    }
    w.keys = prompt > 0 ? keys_total / prompt : 0;
    w.flops = 4.0 * nh * hd * keys_total;
    for (int start = 0; start < prompt; start += step) {
      const int n = std::min(step, prompt - start);
      const int ctx_visible = start - cuda::CanvasWindowStart(start, L.window);
      w.bytes += 4.0 * (2.0 * ctx_visible * kv * hd + double(n) * (2.0 * nh + 2.0 * kv) * hd);
      ++w.launches;
    }
    const std::string head = absl::StrCat(Head(kernel, L), " batch=1 prompt=", prompt,
                                          " chunk=", chunk, " rows=", prompt);
    if (kernel == "tc_prefill" && !TensorCoreHeadDim(hd)) {
      Skip(head, "head_dim", 0, 0);
      return;
    }
    const size_t q_n = size_t(prompt) * nh * hd, kv_n = size_t(prompt) * kv * hd;
    const double need = 4.0 * (2.0 * q_n + 2.0 * kv_n) + w.launches * sizeof(cuda::PrefillSegment);
    if (!Fits(head, need) || !InBudget(head, kernel, w.flops)) return;

    auto run = [&]() -> absl::Status {
      // The prompt's Q, K, V and out; chunk i's new rows are rows [i·step, …) of them and its
      // context the K/V rows before it (as the backend's mirror holds them).
      cuda::DeviceArray<float> q, k, v, out;
      DGSERVE_RETURN_IF_ERROR(Filled(&q, q_n));
      DGSERVE_RETURN_IF_ERROR(Filled(&k, kv_n));
      DGSERVE_RETURN_IF_ERROR(Filled(&v, kv_n));
      DGSERVE_RETURN_IF_ERROR(out.Ensure(q_n));
      std::vector<cuda::PrefillSegment> segs;
      for (int start = 0; start < prompt; start += step) {
        cuda::PrefillSegment s;
        s.ctx_k = k.get();
        s.ctx_v = v.get();
        s.row0 = 0;  // each launch gets pointers offset to its chunk
        s.rows = std::min(step, prompt - start);
        s.ctx_tokens = start;
        s.ctx_first = cuda::CanvasWindowStart(start, L.window);  // row 0's window start
        segs.push_back(s);
      }
      cuda::DeviceArray<cuda::PrefillSegment> table;
      DGSERVE_RETURN_IF_ERROR(table.Upload(segs));
      auto once = [&]() -> absl::Status {
        for (size_t i = 0; i < segs.size(); ++i) {
          const int start = segs[i].ctx_tokens, n = segs[i].rows;
          const size_t qo = size_t(start) * nh * hd, ko = size_t(start) * kv * hd;
          if (kernel == "tc_prefill") {
            DGSERVE_RETURN_IF_ERROR(cuda::TensorCorePrefillAttention(
                q.get() + qo, k.get() + ko, v.get() + ko, table.get() + i, 1, n, nh, kv, hd,
                L.window, out.get() + qo));
          } else {
            // As the backend's float32 path: the context is the visible rows before the chunk.
            const int first = segs[i].ctx_first;
            cuda::KvContext ctx;
            ctx.tokens = start - first;
            if (ctx.tokens > 0) {
              ctx.k = k.get() + size_t(first) * kv * hd;
              ctx.v = v.get() + size_t(first) * kv * hd;
            }
            DGSERVE_RETURN_IF_ERROR(cuda::PrefillAttention(q.get() + qo, k.get() + ko, v.get() + ko,
                                                           n, ctx, nh, kv, hd, L.window,
                                                           out.get() + qo));
          }
        }
        return absl::OkStatus();
      };
      return Time(head, kernel, w, once);
    };
    if (absl::Status s = run(); !s.ok()) Fail(head, s);
  }

  bool failed() const { return failed_; }

 private:
  int Rows() const {
    const int r = absl::GetFlag(FLAGS_canvas);
    return r > 0 ? r : c_.canvas_length;
  }
  static bool TensorCoreHeadDim(int hd) { return hd % 32 == 0 && hd <= cuda::kMaxAttentionHeadDim; }
  std::string Head(const std::string& kernel, const LayerShape& L) const {
    return absl::StrCat("ATTN gpu=", gpu_, " kernel=", kernel, " layer=", L.name,
                        " head_dim=", L.head_dim, " heads=", c_.num_heads, " kv_heads=", L.kv_heads,
                        " window=", L.window);
  }
  void Print(const std::string& line) {
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  }
  void Skip(const std::string& head, const char* reason, double need_gb, double free_gb) {
    std::string extra;
    if (need_gb > 0) {
      char b[96];
      std::snprintf(b, sizeof(b), " need_gb=%.2f free_gb=%.2f", need_gb, free_gb);
      extra = b;
    }
    Print(absl::StrCat(head, " status=skipped reason=", reason, extra));
  }
  void Fail(const std::string& head, const absl::Status& s) {
    failed_ = true;
    std::string msg(s.message());
    for (char& ch : msg) {
      if (ch == ' ' || ch == '=' || ch == '\n') ch = '_';
    }
    Print(absl::StrCat(head, " status=failed error=", msg.substr(0, 200)));
  }
  // Whether `need` bytes fit in 90 % of the free device memory; else a skipped line.
  bool Fits(const std::string& head, double need) {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return true;  // the allocation decides
    if (need <= 0.9 * double(free_b)) return true;
    Skip(head, "device_memory", need / 1e9, double(free_b) / 1e9);
    return false;
  }
  // Whether the case's warm-up is expected to fit in the budget left (from the rate the same
  // kernel last reached; the first case of a kernel always runs while any budget is left).
  bool InBudget(const std::string& head, const std::string& kernel, double flops) {
    const double left = Left();
    double est = 0;
    if (auto it = rate_.find(kernel); it != rate_.end() && it->second > 0) {
      est = flops / it->second;
    }
    if (left > 0 && est <= left) return true;
    char b[96];
    std::snprintf(b, sizeof(b), " est_s=%.2f left_s=%.1f", est, std::max(0.0, left));
    Print(absl::StrCat(head, " status=skipped reason=budget", b));
    return false;
  }
  // Fills n floats uniformly in [−0.5, 0.5) on the device (a different stream of values each).
  absl::Status Filled(cuda::DeviceArray<float>* a, size_t n) {
    DGSERVE_RETURN_IF_ERROR(a->Ensure(n));
    if (n == 0) return absl::OkStatus();
    return cuda::FillSyntheticFloat({0xa77e2000ULL + 7919ULL * fills_++, 0.5f, 0.0f, false},
                                    int64_t(n), a->get());
  }
  // One warm-up, then the timed repetitions; prints the case's ok line.
  template <typename F>
  absl::Status Time(const std::string& head, const std::string& kernel, const Work& w, F once) {
    Events ev;
    DGSERVE_RETURN_IF_ERROR(ev.Create());
    auto timed = [&]() -> absl::StatusOr<double> {
      DGSERVE_RETURN_IF_ERROR(cuda::CudaCheck(cudaEventRecord(ev.start), "cudaEventRecord"));
      DGSERVE_RETURN_IF_ERROR(once());
      DGSERVE_RETURN_IF_ERROR(cuda::CudaCheck(cudaEventRecord(ev.stop), "cudaEventRecord"));
      DGSERVE_RETURN_IF_ERROR(cuda::CudaCheck(cudaEventSynchronize(ev.stop), "event sync"));
      float ms = 0;
      DGSERVE_RETURN_IF_ERROR(
          cuda::CudaCheck(cudaEventElapsedTime(&ms, ev.start, ev.stop), "elapsed"));
      return double(ms);
    };
    DGSERVE_RETURN_IF_ERROR(cuda::CudaCheck(cudaDeviceSynchronize(), "fill"));
    DGSERVE_ASSIGN_OR_RETURN(const double warm_ms, timed());
    // The timed repetitions the budget leaves room for (0: report the warm-up's time).
    int reps = std::max(1, absl::GetFlag(FLAGS_reps));
    const double left = Left();
    if (warm_ms > 0 && left < 1e29) {
      reps = int(std::min<double>(reps, std::floor(left / (warm_ms * 1e-3))));
      reps = std::max(0, reps);
    }
    double sum = 0, best = 0;
    for (int r = 0; r < reps; ++r) {
      DGSERVE_ASSIGN_OR_RETURN(const double ms, timed());
      sum += ms;
      if (r == 0 || ms < best) best = ms;
    }
    const double ms = reps > 0 ? sum / reps : warm_ms;
    if (reps == 0) best = warm_ms;
    const double s = ms * 1e-3;
    const double tflops = s > 0 ? w.flops / s / 1e12 : 0, gbs = s > 0 ? w.bytes / s / 1e9 : 0;
    if (s > 0) rate_[kernel] = w.flops / s;
    char b[512];
    std::snprintf(b, sizeof(b),
                  " keys=%.1f launches=%d reps=%d ms=%.4f min_ms=%.4f gflop=%.3f tflops=%.3f "
                  "pct_gemm=%.2f gb=%.4f gbs=%.1f pct_copy=%.2f status=ok",
                  w.keys, w.launches, reps, ms, best, w.flops / 1e9, tflops,
                  gemm_tflops_ > 0 ? 100.0 * tflops / gemm_tflops_ : 0.0, w.bytes / 1e9, gbs,
                  copy_gbs_ > 0 ? 100.0 * gbs / copy_gbs_ : 0.0);
    Print(head + b);
    return absl::OkStatus();
  }

  const ModelConfig& c_;
  double copy_gbs_, gemm_tflops_;
  std::string gpu_;
  Clock::time_point start_;  // the program's start: --device_budget_s counts the ceilings too
  std::map<std::string, double> rate_;  // FLOP/s the kernel last reached
  uint64_t fills_ = 0;
  bool failed_ = false;
};

int Run() {
  const auto start = Clock::now();
  const std::string path = absl::GetFlag(FLAGS_config);
  if (path.empty()) {
    std::fprintf(stderr, "give --config FILE (e.g. bench/configs/diffusiongemma-26b-a4b.json)\n");
    return 2;
  }
  auto cfg = LoadModelConfig(path);
  if (!cfg.ok()) {
    std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str());
    return 1;
  }
  auto contexts = ParseInts(absl::GetFlag(FLAGS_contexts), "contexts", 0);
  auto batches = ParseInts(absl::GetFlag(FLAGS_batches), "batches", 1);
  auto chunks = ParseInts(absl::GetFlag(FLAGS_prefill_chunks), "prefill_chunks", 0);
  for (const auto* v : {&contexts, &batches, &chunks}) {
    if (!v->ok()) {
      std::fprintf(stderr, "%s\n", std::string(v->status().message()).c_str());
      return 2;
    }
  }
  const std::vector<std::string> kernels =
      absl::StrSplit(absl::GetFlag(FLAGS_kernels), ',', absl::SkipEmpty());
  for (const std::string& k : kernels) {
    if (k != "tc_canvas" && k != "f32_canvas" && k != "tc_prefill" && k != "f32_prefill") {
      std::fprintf(stderr, "--kernels: unknown kernel '%s'\n", k.c_str());
      return 2;
    }
  }
  std::vector<LayerShape> layers;
  for (absl::string_view l : absl::StrSplit(absl::GetFlag(FLAGS_layers), ',', absl::SkipEmpty())) {
    if (l == "sliding") {
      layers.push_back({"sliding", cfg->head_dim, cfg->num_kv_heads, cfg->sliding_window});
    } else if (l == "full") {
      layers.push_back({"full", cfg->global_head_dim, cfg->num_global_kv_heads, 0});
    } else {
      std::fprintf(stderr, "--layers: '%s' is not sliding or full\n", std::string(l).c_str());
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_prompt) < 1) {
    std::fprintf(stderr, "--prompt must be ≥ 1\n");
    return 2;
  }
  if (kernels.empty() || layers.empty()) {
    std::fprintf(stderr, "--kernels and --layers must name at least one\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_reps) < 1 || absl::GetFlag(FLAGS_canvas) < 0 ||
      absl::GetFlag(FLAGS_calibrate_copy_mb) < 0 || absl::GetFlag(FLAGS_calibrate_gemm_n) < 0) {
    std::fprintf(stderr,
                 "--reps must be ≥ 1; --canvas (0: the config's), --calibrate_copy_mb and "
                 "--calibrate_gemm_n (0: skip) ≥ 0\n");
    return 2;
  }

  // The two ceilings, as engine_bench --calibrate_only prints them.
  std::string gpu = cuda::CurrentDeviceName();
  for (char& ch : gpu) {
    if (ch == ' ' || ch == '=') ch = '_';
  }
  if (gpu.empty()) gpu = "unknown";
  auto ceil = cuda::MeasureCeilings(size_t(absl::GetFlag(FLAGS_calibrate_copy_mb)) << 20,
                                    absl::GetFlag(FLAGS_calibrate_gemm_n));
  if (!ceil.ok()) {
    std::fprintf(stderr, "ceilings: %s\n", ceil.status().ToString().c_str());
    return 1;
  }
  std::printf(
      "CEILINGS gpu=%s copy_mb=%.0f copy_gbs=%.1f gemm_n=%d gemm_tflops=%.1f (bf16 in, fp32 "
      "accumulate and out)\n",
      gpu.c_str(), ceil->copy_bytes / 1048576.0, ceil->copy_gbs, ceil->gemm_n, ceil->gemm_tflops);
  std::fflush(stdout);

  Bench bench(*cfg, ceil->copy_gbs, ceil->gemm_tflops, gpu, start);
  for (const std::string& k : kernels) {
    for (const LayerShape& L : layers) {
      if (k == "tc_canvas" || k == "f32_canvas") {
        for (int ctx : *contexts) {
          for (int b : *batches) bench.Canvas(k, L, ctx, b);
        }
      } else {
        for (int chunk : *chunks) bench.Prefill(k, L, absl::GetFlag(FLAGS_prompt), chunk);
      }
    }
  }
  std::printf("attention_bench: done in %.1f s%s\n",
              std::chrono::duration<double>(Clock::now() - start).count(),
              bench.failed() ? " (some cases failed)" : "");
  return bench.failed() ? 1 : 0;
}

}  // namespace
}  // namespace dgserve

int main(int argc, char** argv) {
  dgserve::InitCommandLine(
      "attention_bench --config FILE [--kernels tc_canvas,tc_prefill,f32_canvas,f32_prefill] "
      "[--layers sliding,full] [--contexts 2048,32768,131072] [--batches 1,16] [--canvas N] "
      "[--prompt N] [--prefill_chunks 8192,0] [--reps N] [--device_budget_s S] "
      "[--calibrate_copy_mb MB] [--calibrate_gemm_n N]",
      "bench/attention_bench.cc");
  std::vector<char*> rest = dgserve::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "unexpected argument: %s\n", rest[1]);
    return 2;
  }
  try {
    return dgserve::Run();
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "out of memory\n");
    return 1;
  }
}
