// A weight matrix W [n, k] (PyTorch [out, in]: y = x·Wᵀ) kept in bfloat16, as in the checkpoint,
// packed once into the GEMM's panel layout: panel p holds rows (output features) 16p … 16p+15,
// stored k-major — element (r, kk) at data[(r / 16)·16k + kk·16 + r % 16]; rows past n are zero.
// As the B operand of Gemm (B = Wᵀ, [k, n]) each k step of a panel is 32 contiguous bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "engine/cpu/gemm.h"

namespace dgserve::cpu {

class QuantMatrix;  // gemm_quant.h

class PackedMatrix {
 public:
  PackedMatrix() = default;
  // Packs the row-major bf16 matrix w [n, k].
  static PackedMatrix FromBf16(const uint16_t* w, int n, int k);
  // Packs the row-major float32 matrix w [n, k], rounding each value to bf16 (nearest even;
  // exact for values that came from bf16).
  static PackedMatrix FromFloat(const float* w, int n, int k);

  // Issue 37: a quantized weight matrix (FP8, W4A16; gemm_quant.h) in the same seat, so that the
  // backend's Linear() calls run the quantized GEMM unchanged. It has no bf16 panels: AsGemmB()
  // must not be called on it (the LM head and the router are never quantized).
  static PackedMatrix Quantized(QuantMatrix q);
  const QuantMatrix* quant() const { return quant_.get(); }

  int rows() const { return n_; }  // n: output features
  int cols() const { return k_; }  // k: input features
  bool empty() const { return n_ == 0; }
  size_t bytes() const;

  // Gemm's B operand for output features [row0, n) (row0 a multiple of 16).
  GemmB AsGemmB(int row0 = 0) const {
    return GemmB::Panels(data_.data() + size_t(row0 / kGemmPanel) * kGemmPanel * k_, k_);
  }
  // W[r, c] as float32 (a quantized matrix: its dequantized value).
  float At(int r, int c) const;
  // The bf16 bits of W, row-major [n, k] (for uploads to other devices; a quantized matrix: its
  // dequantized values rounded to bf16).
  std::vector<uint16_t> UnpackBf16() const;

 private:
  // An all-zero matrix of the given shape; `Set` fills it.
  PackedMatrix(int n, int k);
  void Set(int r, int c, uint16_t bits) {
    data_[(size_t(r / kGemmPanel) * k_ + c) * kGemmPanel + r % kGemmPanel] = bits;
  }

  int n_ = 0, k_ = 0;
  std::vector<uint16_t> data_;                // [ceil(n/16)][k][16]
  std::shared_ptr<const QuantMatrix> quant_;  // issue 37; data_ empty when set
};

// y[m, n] = x[m, k] · Wᵀ (+ y with accumulate), x and y row-major with leading dimensions k and n.
// THE PROPERTY of gemm.h holds. `threads` as Gemm; `input` the GEMM's mode (gemm.h: kBf16 rounds x
// to bf16 and gives the VDPBF16PS chain). A quantized w: QuantLinear (no accumulate; `input` does
// not apply: the format says how activations are taken).
void Linear(const float* x, int m, const PackedMatrix& w, float* y, bool accumulate = false,
            GemmThreads threads = GemmThreads::kOpenMp, GemmInput input = GemmInput::kFloat32);

}  // namespace dgserve::cpu
