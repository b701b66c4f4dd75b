// Portable widening of quantized weight panels (gemm_quant.h): a 256-entry e4m3 table; int4
// nibbles minus 8 times the group scale; e2m1 nibbles times the e4m3 block scale (exact). The same
// floats as the AVX2 and AVX-512 versions.
#include <array>
#include <cstdint>

#include "common/fp8.h"
#include "engine/cpu/gemm_quant.h"

namespace dgserve::cpu::quant_internal {
namespace {

const std::array<float, 256>& E4m3Table() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> v{};
    for (int c = 0; c < 256; ++c) v[c] = E4m3ToFloat(uint8_t(c));
    return v;
  }();
  return t;
}

void Fp8(int kc, const uint8_t* codes, float* dst) {
  const std::array<float, 256>& t = E4m3Table();
  for (int i = 0; i < kc * kGemmPanel; ++i) dst[i] = t[codes[i]];
}

void Int4(int kc, int k0, const uint8_t* bytes, const float* scales, int group, float* dst) {
  int g = k0 / group, left = (g + 1) * group - k0;  // k steps left in group g
  for (int kk = 0; kk < kc; ++kk, --left) {
    if (left == 0) ++g, left = group;
    const float* s = scales + size_t(g) * kGemmPanel;
    const uint8_t* b = bytes + size_t(kk) * 8;
    float* d = dst + size_t(kk) * kGemmPanel;
    for (int j = 0; j < 8; ++j) {
      d[j] = float(int(b[j] & 0x0f) - 8) * s[j];
      d[j + 8] = float(int(b[j] >> 4) - 8) * s[j + 8];
    }
  }
}

void Nvfp4(int kc, int k0, const uint8_t* bytes, const uint8_t* block_scales, float* dst) {
  const std::array<float, 256>& t = E4m3Table();
  float s[kGemmPanel];
  for (int kk = 0; kk < kc; ++kk) {
    if (kk == 0 || (k0 + kk) % kNvfp4Block == 0) {
      const uint8_t* sc = block_scales + size_t((k0 + kk) / kNvfp4Block) * kGemmPanel;
      for (int j = 0; j < kGemmPanel; ++j) s[j] = t[sc[j]];
    }
    const uint8_t* b = bytes + size_t(kk) * 8;
    float* d = dst + size_t(kk) * kGemmPanel;
    for (int j = 0; j < 8; ++j) {
      d[j] = E2m1ToFloat(b[j] & 0x0f) * s[j];
      d[j + 8] = E2m1ToFloat(b[j] >> 4) * s[j + 8];
    }
  }
}

}  // namespace

WidenKernels PortableWiden() { return {&Fp8, &Int4, &QuantizeRowFp8, &Nvfp4}; }

}  // namespace dgserve::cpu::quant_internal
