// The quantized GEMM's driver (see gemm_quant.h): activation quantization, output tiles shared
// among threads, per-k-block widening of the weight panels, Gemm()'s float32 microkernels on the
// widened block, the FP8 epilogue.
#include "engine/cpu/gemm_quant.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/fp8.h"

namespace dgserve::cpu {
namespace {

using quant_internal::QuantPath;
using quant_internal::WidenKernels;

constexpr int kQKc = 256;  // k per widened block
constexpr int kQNc = 32;   // columns (weight rows) per output tile: two panels
constexpr int kQMc = 256;  // activation rows per output tile
// Up to this many rows QuantLinear widens the weights in registers (QuantPath::kInRegister)
// where the ISA has those kernels: the crossovers measured on the expert shapes with
// `quant_gemm_bench --paths` (engine/model/QUANTIZED.md): every format on AVX-512 (8 rows × 2
// panels per call) and FP8 and W4A16 on AVX2 (6 rows × 1 panel) up to 32 rows; NVFP4 on AVX2,
// whose e2m1 lookup costs more there, up to 8.
constexpr int kDirectMaxRows = 32;
constexpr int kDirectMaxRowsAvx2Nvfp4 = 8;
// vLLM's min_scaling_factor<float8_e4m3fn>: 1 / (448 · 512).
constexpr float kMinFp8Scale = 1.0f / (kE4m3Max * 512.0f);

WidenKernels Widen(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512:
    case GemmIsa::kAvx512Bf16: return quant_internal::Avx512Widen();  // AVX-512 BF16 ⊃ AVX-512
    case GemmIsa::kAvx2: return quant_internal::Avx2Widen();
    case GemmIsa::kPortable: break;
  }
  return quant_internal::PortableWiden();
}

float* Aligned64(std::vector<float>& v, size_t n) {
  if (v.size() < n + 16) v.resize(n + 16);
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  return v.data() + ((64 - p % 64) % 64) / sizeof(float);
}

std::vector<float>& ThreadBlock() {
  static thread_local std::vector<float> b;
  return b;
}

quant_internal::DirectKernels Direct(GemmIsa isa) {
  switch (isa) {
    case GemmIsa::kAvx512:
    case GemmIsa::kAvx512Bf16: return quant_internal::Avx512Direct();
    case GemmIsa::kAvx2: return quant_internal::Avx2Direct();
    case GemmIsa::kPortable: break;
  }
  return {};  // the portable path widens blocks
}

auto DirectKernel(const quant_internal::DirectKernels& dk, QuantFormat f) {
  return f == QuantFormat::kFp8 ? dk.fp8 : f == QuantFormat::kNvfp4 ? dk.nvfp4 : dk.int4;
}

// The in-register path (QuantPath::kInRegister): tiles of 16·max_panels columns, all m rows, all
// of k per kernel call; the epilogue as the widened-block path's, applied while copying out.
void RunDirect(const float* a, int m, const QuantMatrix& w, float* y, const std::vector<float>& sx,
               const quant_internal::DirectKernels& dk, bool parallel) {
  const int n = w.rows(), k = w.cols();
  const int unit = dk.max_panels * kGemmPanel;
  const int tiles = (n + unit - 1) / unit;
  const QuantFormat f = w.format();
  const auto kernel = DirectKernel(dk, f);
  auto run = [&](int t) {
    const int j0 = t * unit, j1 = std::min(n, j0 + unit);
    const int panels = (j1 - j0 + kGemmPanel - 1) / kGemmPanel;
    alignas(64) float c[8 * 2 * kGemmPanel];  // max_rows ≤ 8, max_panels ≤ 2
    quant_internal::DirectTile tile;
    tile.k = k;
    tile.lda = k;
    tile.group = w.group_size();
    tile.c = c;
    tile.ldc = unit;
    for (int p = 0; p < panels; ++p) {
      const int panel = j0 / kGemmPanel + p;
      tile.data[p] = w.panel(panel);
      if (f == QuantFormat::kW4A16) tile.scales[p] = w.panel_scales(panel);
      if (f == QuantFormat::kNvfp4) tile.block_scales[p] = w.panel_block_scales(panel);
    }
    for (int i0 = 0; i0 < m; i0 += dk.max_rows) {
      const int rows = std::min(dk.max_rows, m - i0);
      tile.a = a + size_t(i0) * k;
      kernel(rows, panels, tile);
      for (int r = 0; r < rows; ++r) {
        float* row = y + size_t(i0 + r) * n;
        const float* acc = c + r * unit;
        if (f == QuantFormat::kFp8) {
          for (int j = j0; j < j1; ++j) row[j] = sx[i0 + r] * (w.RowScale(j) * acc[j - j0]);
        } else if (f == QuantFormat::kNvfp4) {
          for (int j = j0; j < j1; ++j) row[j] = w.RowScale(j) * acc[j - j0];
        } else {
          for (int j = j0; j < j1; ++j) row[j] = acc[j - j0];
        }
      }
    }
  };
  if (parallel && tiles > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tiles; ++t) run(t);
    return;
  }
  for (int t = 0; t < tiles; ++t) run(t);
}

}  // namespace

const char* QuantFormatName(QuantFormat f) {
  switch (f) {
    case QuantFormat::kFp8: return "fp8";
    case QuantFormat::kNvfp4: return "nvfp4";
    case QuantFormat::kW4A16: break;
  }
  return "w4a16";
}

QuantMatrix QuantMatrix::FromFp8(const uint8_t* codes, const float* scales, int n, int k) {
  QuantMatrix m;
  m.format_ = QuantFormat::kFp8;
  m.n_ = n;
  m.k_ = k;
  const int panels = (n + kGemmPanel - 1) / kGemmPanel;
  m.data_.assign(size_t(panels) * kGemmPanel * k, 0);
  m.scales_.assign(size_t(panels) * kGemmPanel, 0.0f);
  std::copy(scales, scales + n, m.scales_.begin());
#pragma omp parallel for schedule(static) if (int64_t(n) * k >= (1 << 20))
  for (int r = 0; r < n; ++r) {
    uint8_t* dst = m.data_.data() + size_t(r / kGemmPanel) * kGemmPanel * k + r % kGemmPanel;
    const uint8_t* src = codes + size_t(r) * k;
    for (int c = 0; c < k; ++c) dst[size_t(c) * kGemmPanel] = src[c];
  }
  return m;
}

QuantMatrix QuantMatrix::FromInt4(const int8_t* q, const float* scales, int n, int k, int group) {
  QuantMatrix m;
  m.format_ = QuantFormat::kW4A16;
  m.n_ = n;
  m.k_ = k;
  m.group_ = group;
  m.groups_ = (k + group - 1) / group;
  const int panels = (n + kGemmPanel - 1) / kGemmPanel;
  // Rows past n: q = 0 (code 8), scale 0.
  m.data_.assign(size_t(panels) * (kGemmPanel / 2) * k, 0x88);
  m.scales_.assign(size_t(panels) * m.groups_ * kGemmPanel, 0.0f);
#pragma omp parallel for schedule(static) if (int64_t(n) * k >= (1 << 20))
  for (int p = 0; p < panels; ++p) {
    uint8_t* dst = m.data_.data() + size_t(p) * (kGemmPanel / 2) * k;
    float* sdst = m.scales_.data() + size_t(p) * m.groups_ * kGemmPanel;
    for (int j = 0; j < kGemmPanel; ++j) {
      const int r = p * kGemmPanel + j;
      if (r >= n) break;
      for (int g = 0; g < m.groups_; ++g)
        sdst[g * kGemmPanel + j] = scales[size_t(r) * m.groups_ + g];
      const int shift = j < 8 ? 0 : 4;
      const uint8_t keep = j < 8 ? 0xf0 : 0x0f;
      for (int c = 0; c < k; ++c) {
        uint8_t& byte = dst[size_t(c) * 8 + (j % 8)];
        byte = uint8_t((byte & keep) | ((uint8_t(q[size_t(r) * k + c] + 8) & 0x0f) << shift));
      }
    }
  }
  return m;
}

QuantMatrix QuantMatrix::FromNvfp4(const uint8_t* codes, const uint8_t* block_scales,
                                   const float* weight_global, float input_scale, int n, int k,
                                   float input_global) {
  QuantMatrix m;
  m.format_ = QuantFormat::kNvfp4;
  m.n_ = n;
  m.k_ = k;
  m.group_ = kNvfp4Block;
  m.groups_ = k / kNvfp4Block;
  m.input_scale_ = input_scale;
  m.input_global_ = input_global > 0.0f ? input_global : 1.0f / input_scale;
  const int panels = (n + kGemmPanel - 1) / kGemmPanel;
  // Rows past n: code 0 (+0), block scale 0, alpha 0.
  m.data_.assign(size_t(panels) * (kGemmPanel / 2) * k, 0);
  m.block_scales_.assign(size_t(panels) * m.groups_ * kGemmPanel, 0);
  m.scales_.assign(size_t(panels) * kGemmPanel, 0.0f);
  m.global_.assign(size_t(panels) * kGemmPanel, 0.0f);
  for (int r = 0; r < n; ++r) {
    m.global_[r] = weight_global[r];
    m.scales_[r] = input_scale * weight_global[r];  // vLLM's layer.alpha (float32)
  }
#pragma omp parallel for schedule(static) if (int64_t(n) * k >= (1 << 20))
  for (int p = 0; p < panels; ++p) {
    uint8_t* dst = m.data_.data() + size_t(p) * (kGemmPanel / 2) * k;
    uint8_t* sdst = m.block_scales_.data() + size_t(p) * m.groups_ * kGemmPanel;
    for (int j = 0; j < kGemmPanel; ++j) {
      const int r = p * kGemmPanel + j;
      if (r >= n) break;
      for (int g = 0; g < m.groups_; ++g) {
        sdst[g * kGemmPanel + j] = block_scales[size_t(r) * m.groups_ + g];
      }
      const int shift = j < 8 ? 0 : 4;
      const uint8_t keep = j < 8 ? 0xf0 : 0x0f;
      for (int c = 0; c < k; ++c) {
        uint8_t& byte = dst[size_t(c) * 8 + (j % 8)];
        byte = uint8_t((byte & keep) | ((codes[size_t(r) * k + c] & 0x0f) << shift));
      }
    }
  }
  return m;
}

QuantMatrix QuantMatrix::FromNvfp4WeightOnly(const uint8_t* codes, const uint8_t* block_scales,
                                             const float* weight_global, int n, int k) {
  // input_scale 1: alpha = 1 · weight_scale_2 = weight_scale_2 exactly (vLLM's
  // CompressedTensorsW4A16Fp4 applies 1 / weight_global_scale alone).
  QuantMatrix m = FromNvfp4(codes, block_scales, weight_global, 1.0f, n, k, 1.0f);
  m.nvfp4_weight_only_ = true;
  return m;
}

const uint8_t* QuantMatrix::panel(int p) const {
  const size_t per = format_ == QuantFormat::kFp8 ? kGemmPanel : kGemmPanel / 2;
  return data_.data() + size_t(p) * per * k_;
}

const float* QuantMatrix::panel_scales(int p) const {
  return format_ != QuantFormat::kW4A16 ? scales_.data() + size_t(p) * kGemmPanel
                                        : scales_.data() + size_t(p) * groups_ * kGemmPanel;
}

float QuantMatrix::Widened(int r, int c) const {
  const int p = r / kGemmPanel, j = r % kGemmPanel;
  if (format_ == QuantFormat::kFp8) return E4m3ToFloat(panel(p)[size_t(c) * kGemmPanel + j]);
  const uint8_t byte = panel(p)[size_t(c) * 8 + j % 8];
  if (format_ == QuantFormat::kNvfp4) {
    const uint8_t code = j < 8 ? byte & 0x0f : byte >> 4;
    return E2m1ToFloat(code) *
           E4m3ToFloat(panel_block_scales(p)[(c / kNvfp4Block) * kGemmPanel + j]);
  }
  const int q = int(j < 8 ? byte & 0x0f : byte >> 4) - 8;
  return float(q) * panel_scales(p)[(c / group_) * kGemmPanel + j];
}

float QuantizeRowFp8(const float* x, int k, float* q) {
  float absmax = 0.0f;
  for (int c = 0; c < k; ++c) absmax = std::max(absmax, std::fabs(x[c]));
  const float s = std::max(absmax / kE4m3Max, kMinFp8Scale);
  // x / s (a division, as vLLM's kernel does), clamped to ±448 and rounded to nearest even
  // (RoundToE4m3 saturates: the clamp).
  for (int c = 0; c < k; ++c) q[c] = x[c] / s;
  for (int c = 0; c < k; ++c) q[c] = RoundToE4m3(q[c]);
  return s;
}

void QuantizeRowNvfp4(const float* x, int k, float input_scale, float* q) {
  QuantizeRowNvfp4Global(x, k, 1.0f / input_scale, q);  // vLLM: layer.input_scale_inv
}

void QuantizeRowNvfp4Global(const float* x, int k, float g, float* q) {
  const float inv_g = 1.0f / g;
  const float rcp6 = 1.0f / 6.0f;
  for (int c0 = 0; c0 < k; c0 += kNvfp4Block) {
    float absmax = 0.0f;
    for (int c = c0; c < c0 + kNvfp4Block; ++c) absmax = std::max(absmax, std::fabs(x[c]));
    const float sx = RoundToE4m3(g * (absmax * rcp6));  // saturates at 448, as the cvt does
    const float o = sx != 0.0f ? 1.0f / (sx * inv_g) : 0.0f;
    for (int c = c0; c < c0 + kNvfp4Block; ++c) q[c] = E2m1ToFloat(FloatToE2m1(x[c] * o)) * sx;
  }
}

void QuantLinear(const float* x, int m, const QuantMatrix& w, float* y, GemmThreads threads) {
  QuantLinear(x, m, w, y, ActiveGemmIsa(), threads);
}

void QuantLinear(const float* x, int m, const QuantMatrix& w, float* y, GemmIsa isa,
                 GemmThreads threads) {
  quant_internal::QuantLinearPath(x, m, w, y, isa, threads, quant_internal::QuantPath::kAuto);
}

int quant_internal::QuantDirectMaxRows(GemmIsa isa, QuantFormat f) {
  if (DirectKernel(Direct(isa), f) == nullptr) return 0;
  if (isa == GemmIsa::kAvx2 && f == QuantFormat::kNvfp4) return kDirectMaxRowsAvx2Nvfp4;
  return kDirectMaxRows;
}

void quant_internal::QuantLinearPath(const float* x, int m, const QuantMatrix& w, float* y,
                                     GemmIsa isa, GemmThreads threads, QuantPath path) {
  const int n = w.rows(), k = w.cols();
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {
    std::fill(y, y + size_t(m) * n, 0.0f);
    return;
  }
  const bool parallel =
      threads == GemmThreads::kOpenMp && !omp_in_parallel() && omp_get_max_threads() > 1;
  const bool fp8 = w.format() == QuantFormat::kFp8;
  const float* a = x;
  std::vector<float> aq, sx;
  if (fp8) {
    aq.resize(size_t(m) * k);
    sx.resize(m);
    const auto quantize = Widen(isa).quantize_fp8;
#pragma omp parallel for schedule(static) if (parallel && int64_t(m) * k >= (1 << 16))
    for (int i = 0; i < m; ++i) sx[i] = quantize(x + size_t(i) * k, k, aq.data() + size_t(i) * k);
    a = aq.data();
  }
  const bool nvfp4 = w.format() == QuantFormat::kNvfp4;
  if (nvfp4 && !w.nvfp4_weight_only()) {  // weight-only NVFP4: float32 activations, as W4A16
    // One definition on every ISA (scalar): the same bits everywhere by construction.
    aq.resize(size_t(m) * k);
    const float g = w.InputGlobal();
#pragma omp parallel for schedule(static) if (parallel && int64_t(m) * k >= (1 << 16))
    for (int i = 0; i < m; ++i) {
      QuantizeRowNvfp4Global(x + size_t(i) * k, k, g, aq.data() + size_t(i) * k);
    }
    a = aq.data();
  }
  const quant_internal::DirectKernels dk = Direct(isa);
  if (DirectKernel(dk, w.format()) != nullptr &&
      (path == QuantPath::kInRegister ||
       (path == QuantPath::kAuto && m <= QuantDirectMaxRows(isa, w.format())))) {
    RunDirect(a, m, w, y, sx, dk, parallel);
    return;
  }
  const WidenKernels wk = Widen(isa);
  const int row_tiles = (m + kQMc - 1) / kQMc;
  const int mc = (m + row_tiles - 1) / row_tiles;
  const int col_tiles = (n + kQNc - 1) / kQNc;
  const int tiles = row_tiles * col_tiles;
  auto run = [&](int t) {
    // Row-tile major: consecutive tiles share their activation rows.
    const int ti = t / col_tiles, tj = t % col_tiles;
    const int i0 = ti * mc, i1 = std::min(m, i0 + mc);
    const int j0 = tj * kQNc, j1 = std::min(n, j0 + kQNc);
    const int panels = (j1 - j0 + kGemmPanel - 1) / kGemmPanel;
    float* block = Aligned64(ThreadBlock(), size_t(kQKc) * kQNc);
    for (int k0 = 0; k0 < k; k0 += kQKc) {
      const int kc = std::min(kQKc, k - k0);
      for (int p = 0; p < panels; ++p) {
        const int panel = j0 / kGemmPanel + p;
        float* dst = block + size_t(p) * kc * kGemmPanel;
        if (fp8) {
          wk.fp8(kc, w.panel(panel) + size_t(k0) * kGemmPanel, dst);
        } else if (nvfp4) {
          wk.nvfp4(kc, k0, w.panel(panel) + size_t(k0) * (kGemmPanel / 2),
                   w.panel_block_scales(panel), dst);
        } else {
          wk.int4(kc, k0, w.panel(panel) + size_t(k0) * (kGemmPanel / 2), w.panel_scales(panel),
                  w.group_size(), dst);
        }
      }
      const GemmArgs g = GemmArgs::Of(i1 - i0, j1 - j0, kc, a + size_t(i0) * k + k0, k,
                                      GemmB::Panels(block, kc), y + size_t(i0) * n + j0, n,
                                      /*accumulate=*/k0 > 0);
      Gemm(g, isa, GemmThreads::kCallerOnly);
    }
    if (fp8) {
      for (int i = i0; i < i1; ++i) {
        float* row = y + size_t(i) * n;
        for (int j = j0; j < j1; ++j) row[j] = sx[i] * (w.RowScale(j) * row[j]);
      }
    } else if (nvfp4) {
      for (int i = i0; i < i1; ++i) {
        float* row = y + size_t(i) * n;
        for (int j = j0; j < j1; ++j) row[j] = w.RowScale(j) * row[j];
      }
    }
  };
  if (parallel && tiles > 1) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < tiles; ++t) run(t);
    return;
  }
  for (int t = 0; t < tiles; ++t) run(t);
}

}  // namespace dgserve::cpu
