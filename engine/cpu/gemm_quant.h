// Quantized weight matrices and their GEMM (issue 37): the weights stay quantized in memory and
// are widened inside our GEMM; every output element is still ONE fma chain over k in ascending
// order (THE PROPERTY of gemm.h), so batched = solo on every instruction set.
//
// Formats (the layouts of the checkpoints are in engine/model/quant_config.h):
//  * kFp8 — compressed-tensors `float-quantized` W8A8 "FP8-dynamic": weights float8_e4m3fn with
//    one float32 scale per output channel (row); activations quantized to e4m3 per token (row) at
//    run time exactly as vLLM's dynamic_per_token_scaled_fp8_quant does it:
//        s_x = max(absmax(x_row) / 448, 1 / (448 · 512));  x_q = e4m3_rne(clamp(x / s_x, ±448))
//    and the output, as vLLM's scaled-mm epilogue (D = s_a · (s_b · acc)):
//        y[i, j] = s_x[i] · (s_w[j] · acc[i, j]),   acc[i, j] = fma chain over k of x_q · w_q
//    Products of two e4m3 values are exact in float32, so acc is the float32 fma chain of the
//    exact products, k ascending.
//  * kW4A16 — compressed-tensors `pack-quantized` int4 symmetric per group: w = q · s[row, k/G],
//    q ∈ [−8, 7]; activations unquantized (float32, as the bf16 path). The widened weight is the
//    float32 product q·s (exact when s is a bf16 value, as dgserve-quantize writes it), and
//    y[i, j] = fma chain over k of x · (q·s), k ascending.
//  * kNvfp4 — NVIDIA TensorRT Model Optimizer (ModelOpt) NVFP4, W4A4: weights float4 e2m1 with
//    one float8_e4m3 scale per 16 consecutive inputs of a row and a float32 per-tensor
//    `weight_scale_2`: W[r, c] = e2m1(q[r, c]) · e4m3(sw[r, c/16]) · weight_scale_2 (ModelOpt's
//    NVFP4QTensor.dequantize, modelopt/torch/quantization/qtensor/nvfp4_tensor.py).
//    Activations are quantized to NVFP4 at run time per 16-input block with a dynamic e4m3 block
//    scale under the static per-tensor `input_scale` (the W4A4 scheme of the checkpoint, as vLLM
//    runs it: ModelOptNvFp4LinearMethod in vllm/model_executor/layers/quantization/modelopt.py,
//    scaled_fp4_quant(x, 1 / input_scale) = csrc/quantization/fp4/nvfp4_quant_kernels.cu):
//        g = 1 / input_scale;  sx_b = e4m3_rne_sat(g · (absmax(x_b) · (1/6)))
//        o_b = sx_b ≠ 0 ? 1 / (sx_b · (1/g)) : 0;   x_q = e2m1_rne_sat(x · o_b)
//    (float32 IEEE operations: the CUDA kernel's reciprocals are rcp.approx.ftz, which the CPU
//    replaces by correctly rounded divisions — the one place where we define rather than copy),
//    and the output as vLLM's cutlass_scaled_fp4_mm with alpha = input_scale · weight_scale_2:
//        y[i, j] = alpha[j] · acc[i, j],  acc[i, j] = fma chain over k of
//                  (e2m1(x_q) · sx[i, k/16]) · (e2m1(q[j, k]) · sw[j, k/16])
//    Both factors are exact in float32 (2 × 4 significant bits) and so is their product, so acc
//    is the float32 fma chain of the exact products, k ascending: the block-scaled dot product
//    the format defines, summed in one fixed order. alpha is per row (weight_scale_2 of the
//    module a row came from: an expert's gate and up are two modules).
//  * kNvfp4, weight-only (NVFP4A16: compressed-tensors `nvfp4-pack-quantized` with
//    input_activations null, llm-compressor's NVFP4A16 preset; vLLM runs it as
//    CompressedTensorsW4A16Fp4, vllm/model_executor/layers/quantization/compressed_tensors/
//    schemes/compressed_tensors_w4a16_nvfp4.py, a Marlin kernel on bf16 activations with
//    weight_global_scale inverted): the same weights, activations unquantized (float32, as W4A16),
//    and the output scaled by alpha = weight_scale_2 alone (no input scale):
//        y[i, j] = weight_scale_2[j] · acc[i, j],  acc[i, j] = fma chain over k of
//                  x[i, k] · (e2m1(q[j, k]) · sw[j, k/16])
//    The widened weight is exact as above; the same widening kernels, no activation
//    quantization (QuantMatrix::nvfp4_weight_only()).
//
// How: per output tile and k block (256), the tile's weight panels are widened into a float32
// block that stays in L1/L2 (the widening is exact), and the float32 microkernels of Gemm() run
// on it, continuing the chains from C across k blocks (exact, as in gemm.h). The widening has
// AVX-512, AVX2 and portable versions; all give the same floats, and Gemm() gives the same bits
// on every ISA, so the quantized GEMM does too. For few rows (up to 32; NVFP4 on AVX2 up to 8:
// the crossovers measured in engine/model/QUANTIZED.md) the AVX-512 and AVX2 paths instead widen
// each k step's codes in registers, to the same floats, and fma them straight into the rows'
// accumulators over all of k (quant_internal::DirectKernels): the same chains, no widened block
// in memory, so the same bits again (tested against the widened-block path).
#pragma once

#include <cstdint>
#include <vector>

#include "engine/cpu/gemm.h"

namespace dgserve::cpu {

enum class QuantFormat { kFp8, kW4A16, kNvfp4 };

const char* QuantFormatName(QuantFormat f);  // "fp8", "w4a16", "nvfp4"

// NVFP4's block: inputs per e4m3 scale.
inline constexpr int kNvfp4Block = 16;

class QuantMatrix {
 public:
  QuantMatrix() = default;
  // W [n, k] as row-major e4m3 codes and one scale per row (scales[r]).
  static QuantMatrix FromFp8(const uint8_t* codes, const float* scales, int n, int k);
  // W [n, k] as row-major int4 values q[r·k + c] ∈ [−8, 7] and scales [n, ceil(k / group)].
  static QuantMatrix FromInt4(const int8_t* q, const float* scales, int n, int k, int group);
  // NVFP4 W [n, k] (k a multiple of 16): row-major e2m1 codes codes[r·k + c] (one code per byte,
  // 0..15), row-major e4m3 block scale codes block_scales[r·(k/16) + c/16], the per-row
  // weight_scale_2 weight_global[r] (> 0, finite) and the module's input_scale (> 0, finite).
  // `input_global`: the activation quantization's g (> 0, finite); 0 means 1 / input_scale
  // (ModelOpt). compressed-tensors checkpoints store g itself (input_global_scale) and
  // input_scale = 1 / g, as vLLM's CompressedTensorsW4A4Fp4 keeps both.
  static QuantMatrix FromNvfp4(const uint8_t* codes, const uint8_t* block_scales,
                               const float* weight_global, float input_scale, int n, int k,
                               float input_global = 0.0f);
  // Weight-only NVFP4 (NVFP4A16, see above): the same codes, block scales and per-row
  // weight_scale_2 as FromNvfp4; activations stay float32 and alpha = weight_scale_2[r]
  // (InputScale() and InputGlobal() are 1).
  static QuantMatrix FromNvfp4WeightOnly(const uint8_t* codes, const uint8_t* block_scales,
                                         const float* weight_global, int n, int k);

  QuantFormat format() const { return format_; }
  // NVFP4 only: true for the weight-only flavour (FromNvfp4WeightOnly: activations not
  // quantized, alpha = weight_scale_2).
  bool nvfp4_weight_only() const { return nvfp4_weight_only_; }
  int rows() const { return n_; }
  int cols() const { return k_; }
  int group_size() const { return group_; }
  // Bytes held (codes + scales).
  size_t bytes() const {
    return data_.size() + block_scales_.size() + (scales_.size() + global_.size()) * sizeof(float);
  }
  // The weight's value W[r, c] as the GEMM widens it: FP8 the e4m3 value (unscaled: the row
  // scale is applied in the epilogue), W4A16 float32(q · s), NVFP4 e2m1(q) · e4m3(block scale)
  // (exact; the global scales are applied in the epilogue).
  float Widened(int r, int c) const;
  // The epilogue's factor for output column r: FP8 the row scale, NVFP4 alpha = float32(
  // input_scale · weight_scale_2[r]) (weight-only: weight_scale_2[r]); 1 for W4A16.
  float RowScale(int r) const { return format_ == QuantFormat::kW4A16 ? 1.0f : scales_[r]; }
  // NVFP4: weight_scale_2 of row r and the input_scale (1 for the other formats).
  float WeightGlobal(int r) const { return format_ == QuantFormat::kNvfp4 ? global_[r] : 1.0f; }
  float InputScale() const { return input_scale_; }
  // NVFP4: the activation quantization's g (1 / input_scale unless given, see FromNvfp4).
  float InputGlobal() const { return input_global_; }
  // The dequantized weight W[r, c] (FP8: e4m3 value · row scale; NVFP4: e2m1 · e4m3 ·
  // weight_scale_2; rounded to float32).
  float Dequantized(int r, int c) const {
    return format_ == QuantFormat::kNvfp4 ? Widened(r, c) * global_[r]
                                          : Widened(r, c) * RowScale(r);
  }

  // Internal layout (the widening kernels): panels of 16 rows, k-major.
  //  FP8:   data [ceil(n/16)][k][16] codes; scales [n] (padded to a multiple of 16 with zeros).
  //  W4A16: data [ceil(n/16)][k][8] bytes, byte j of a k step: low nibble row j, high nibble row
  //         j + 8, each q + 8; scales [ceil(n/16)][groups][16].
  //  NVFP4: data [ceil(n/16)][k][8] bytes, byte j of a k step: low nibble row j's e2m1 code,
  //         high nibble row j + 8's; block scales [ceil(n/16)][k/16][16] e4m3 codes; scales
  //         (alpha) and the weight globals [n] padded with zeros.
  const uint8_t* panel(int p) const;
  const float* panel_scales(int p) const;
  const uint8_t* panel_block_scales(int p) const {
    return block_scales_.data() + size_t(p) * (k_ / kNvfp4Block) * kGemmPanel;
  }
  int groups() const { return groups_; }

 private:
  QuantFormat format_ = QuantFormat::kFp8;
  int n_ = 0, k_ = 0, group_ = 0, groups_ = 0;
  float input_scale_ = 1.0f;
  float input_global_ = 1.0f;
  bool nvfp4_weight_only_ = false;
  std::vector<uint8_t> data_;
  std::vector<float> scales_;
  std::vector<uint8_t> block_scales_;  // NVFP4
  std::vector<float> global_;          // NVFP4 weight_scale_2 per row
};

// Quantizes one activation row (k values) to e4m3 per token as above: q[c] (as float32 values)
// and the returned scale s_x.
float QuantizeRowFp8(const float* x, int k, float* q);

// Quantizes one activation row (k values, k a multiple of 16) to NVFP4 as above with
// g = 1 / input_scale: q[c] = e2m1(x_q[c]) · sx[c/16] as float32 (exact), the factor the GEMM
// multiplies by the widened weight.
void QuantizeRowNvfp4(const float* x, int k, float input_scale, float* q);
// The same with g given (the quantization QuantLinear runs: g = w.InputGlobal()).
void QuantizeRowNvfp4Global(const float* x, int k, float g, float* q);
// y[m, n] = x[m, k] · Wᵀ for a quantized W, as the format says (see above). Rows of x and y
// with leading dimensions k and n. `threads` as Gemm; `isa` the active GEMM path unless given.
void QuantLinear(const float* x, int m, const QuantMatrix& w, float* y,
                 GemmThreads threads = GemmThreads::kOpenMp);
void QuantLinear(const float* x, int m, const QuantMatrix& w, float* y, GemmIsa isa,
                 GemmThreads threads);

namespace quant_internal {
// The widening of one 16-row panel over kc k steps starting at k0, into dst [kc][16] float32.
struct WidenKernels {
  void (*fp8)(int kc, const uint8_t* codes, float* dst) = nullptr;  // codes at k0
  // bytes at k0; scales = the panel's [groups][16]; group size G.
  void (*int4)(int kc, int k0, const uint8_t* bytes, const float* scales, int group,
               float* dst) = nullptr;
  // QuantizeRowFp8 (the same bits; vectorised where the ISA allows).
  float (*quantize_fp8)(const float* x, int k, float* q) = nullptr;
  // NVFP4: bytes at k0 (a multiple of 16); block_scales = the panel's [k/16][16] e4m3 codes.
  void (*nvfp4)(int kc, int k0, const uint8_t* bytes, const uint8_t* block_scales,
                float* dst) = nullptr;
};
WidenKernels PortableWiden();
WidenKernels Avx2Widen();
WidenKernels Avx512Widen();

// The in-register path (few rows): a tile of `rows` × 16·`panels` outputs over all of k, each
// output ONE fma chain from +0 over k ascending of a · (the weight widened in registers to the
// same float the Widen kernels write), stored to c[i·ldc + j] for j < 16·panels (no epilogue).
struct DirectTile {
  int k = 0;
  const float* a = nullptr;  // row 0 at k = 0; rows lda apart
  int64_t lda = 0;
  const uint8_t* data[2] = {nullptr, nullptr};          // the panels' codes at k = 0
  const float* scales[2] = {nullptr, nullptr};          // W4A16: the panels' [groups][16]
  const uint8_t* block_scales[2] = {nullptr, nullptr};  // NVFP4: the panels' [k/16][16]
  int group = 0;                                        // W4A16 group size
  float* c = nullptr;
  int64_t ldc = 0;
};
struct DirectKernels {
  int max_rows = 0;    // rows per call at most (0: this ISA has no in-register path)
  int max_panels = 0;  // 16-column panels per call at most
  // rows in [1, max_rows], panels in [1, max_panels]; null where the CPU lacks what one needs.
  void (*fp8)(int rows, int panels, const DirectTile& t) = nullptr;
  void (*int4)(int rows, int panels, const DirectTile& t) = nullptr;
  void (*nvfp4)(int rows, int panels, const DirectTile& t) = nullptr;
};
DirectKernels Avx2Direct();    // needs AVX2 + FMA
DirectKernels Avx512Direct();  // needs AVX-512F

// Which way QuantLinear runs (tests and benchmarks; kAuto is QuantLinear's choice).
enum class QuantPath {
  kAuto,        // in registers for few rows where the ISA has the kernels, else widened blocks
  kWidenBlock,  // widen panels per k block into float32, then Gemm()'s microkernels
  kInRegister,  // the DirectKernels at any m (falls back to kWidenBlock where the ISA has none)
};
void QuantLinearPath(const float* x, int m, const QuantMatrix& w, float* y, GemmIsa isa,
                     GemmThreads threads, QuantPath path);
// Rows up to which kAuto takes the in-register path for format f on isa (0: never).
int QuantDirectMaxRows(GemmIsa isa, QuantFormat f);
}  // namespace quant_internal

}  // namespace dgserve::cpu
