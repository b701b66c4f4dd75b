#include "engine/cpu/packed_matrix.h"

#include <cstdlib>
#include <utility>

#include "common/bf16.h"
#include "engine/cpu/gemm_quant.h"

namespace dgserve::cpu {

PackedMatrix::PackedMatrix(int n, int k)
    : n_(n), k_(k), data_(size_t((n + kGemmPanel - 1) / kGemmPanel) * kGemmPanel * k, 0) {}

PackedMatrix PackedMatrix::FromBf16(const uint16_t* w, int n, int k) {
  PackedMatrix p(n, k);
#pragma omp parallel for schedule(static) if (int64_t(n) * k >= (1 << 20))
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < k; ++c) p.Set(r, c, w[size_t(r) * k + c]);
  }
  return p;
}

PackedMatrix PackedMatrix::FromFloat(const float* w, int n, int k) {
  PackedMatrix p(n, k);
#pragma omp parallel for schedule(static) if (int64_t(n) * k >= (1 << 20))
  for (int r = 0; r < n; ++r) {
    for (int c = 0; c < k; ++c) p.Set(r, c, FloatToBf16(w[size_t(r) * k + c]));
  }
  return p;
}

PackedMatrix PackedMatrix::Quantized(QuantMatrix q) {
  PackedMatrix p;
  p.n_ = q.rows();
  p.k_ = q.cols();
  p.quant_ = std::make_shared<const QuantMatrix>(std::move(q));
  return p;
}

size_t PackedMatrix::bytes() const {
  return data_.size() * sizeof(uint16_t) + (quant_ ? quant_->bytes() : 0);
}

float PackedMatrix::At(int r, int c) const {
  if (quant_) return quant_->Dequantized(r, c);
  return Bf16ToFloat(data_[(size_t(r / kGemmPanel) * k_ + c) * kGemmPanel + r % kGemmPanel]);
}

std::vector<uint16_t> PackedMatrix::UnpackBf16() const {
  std::vector<uint16_t> out(size_t(n_) * k_);
  if (quant_) {
    for (int r = 0; r < n_; ++r) {
      for (int c = 0; c < k_; ++c) out[size_t(r) * k_ + c] = FloatToBf16(quant_->Dequantized(r, c));
    }
    return out;
  }
  for (int r = 0; r < n_; ++r) {
    for (int c = 0; c < k_; ++c) {
      out[size_t(r) * k_ + c] =
          data_[(size_t(r / kGemmPanel) * k_ + c) * kGemmPanel + r % kGemmPanel];
    }
  }
  return out;
}

void Linear(const float* x, int m, const PackedMatrix& w, float* y, bool accumulate,
            GemmThreads threads, GemmInput input) {
  if (w.quant() != nullptr) {
    // Quantized weights: the format fixes how activations are taken (FP8 quantizes them per
    // token, W4A16 keeps them float32); the GEMM input mode does not apply.
    if (accumulate) std::abort();  // no caller accumulates into a quantized projection
    QuantLinear(x, m, *w.quant(), y, threads);
    return;
  }
  GemmArgs g =
      GemmArgs::Of(m, w.rows(), w.cols(), x, w.cols(), w.AsGemmB(), y, w.rows(), accumulate);
  g.input = input;
  Gemm(g, threads);
}

}  // namespace dgserve::cpu
