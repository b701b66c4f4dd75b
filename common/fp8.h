// float8_e4m3fn (OCP FP8 E4M3 as PyTorch's torch.float8_e4m3fn and safetensors' F8_E4M3): sign,
// 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7f / 0xff are NaN; largest finite
// value 448 (0x7e); subnormals m·2⁻⁹. Bit-exact conversions for the quantized checkpoints
// (issue 37).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dgserve {

inline constexpr float kE4m3Max = 448.0f;

// E4M3 bits -> float32 (exact; NaN codes give a quiet NaN). Normal codes: exponent and mantissa
// moved into a float32 and rebiased (127 − 7 = 120); subnormal codes: m · 2⁻⁹.
inline float E4m3ToFloat(uint8_t c) {
  if ((c & 0x7f) == 0x7f) return std::nanf("");
  float mag;
  if ((c & 0x78) == 0) {
    mag = float(c & 7) * 0x1p-9f;
  } else {
    const uint32_t b = ((uint32_t(c) & 0x7fu) << 20) + (120u << 23);
    std::memcpy(&mag, &b, 4);
  }
  return (c & 0x80) ? -mag : mag;
}

// float32 -> E4M3 bits, round to nearest even, saturating: |x| ≥ 448 gives ±448 (0x7e), as
// vLLM's scaled_fp8_conversion clamps to ±448 before its cast. NaN gives 0x7f.
inline uint8_t FloatToE4m3(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint8_t sign = uint8_t((b >> 24) & 0x80u);
  if (std::isnan(x)) return 0x7f;
  const float a = std::fabs(x);
  if (a >= kE4m3Max) return sign | 0x7e;
  if (a < 0x1p-6f) {
    // Subnormal range: quantum 2⁻⁹; a·512 is exact. q = 8 is 0x08, the smallest normal (2⁻⁶).
    return sign | uint8_t(std::nearbyint(a * 512.0f));
  }
  const uint32_t ab = b & 0x7fffffffu;
  // Round the float32 mantissa to 3 bits (nearest even); a carry moves into the exponent.
  const uint32_t r = (ab + 0x7ffffu + ((ab >> 20) & 1u)) >> 20;
  uint32_t code = r - (120u << 3);  // rebias 127 -> 7
  if (code > 0x7eu) code = 0x7eu;
  return sign | uint8_t(code);
}

// Rounds x to the nearest E4M3 value (saturating at ±448; x not NaN) and returns it as float32:
// the same value as E4m3ToFloat(FloatToE4m3(x)), without the code in between (the per-token
// activation quantization runs this on every activation).
inline float RoundToE4m3(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t sign = b & 0x80000000u, ab = b & 0x7fffffffu;
  uint32_t r;
  if (ab >= 0x43e00000u) {  // |x| ≥ 448
    r = 0x43e00000u;
  } else if (ab < 0x3c800000u) {  // |x| < 2⁻⁶: multiples of 2⁻⁹, nearest even by the FPU
    float a;
    std::memcpy(&a, &ab, 4);
    const float m = 24576.0f;  // 1.5 · 2¹⁴: its ulp is 2⁻⁹
    const float t = (a + m) - m;
    std::memcpy(&r, &t, 4);
  } else {  // 3 mantissa bits, nearest even (a carry moves into the exponent)
    r = (ab + 0x7ffffu + ((ab >> 20) & 1u)) & ~0xfffffu;
  }
  r |= sign;
  float out;
  std::memcpy(&out, &r, 4);
  return out;
}

// float4_e2m1 (OCP MX FP4 E2M1, NVFP4's element type; issue 37): sign, 2 exponent bits (bias 1),
// 1 mantissa bit; no infinities or NaN. Codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the
// sign (codes 8..15 the negatives; 8 is −0).
inline float E2m1ToFloat(uint8_t c) {
  static constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMag[c & 7];
  return (c & 8) ? -m : m;
}

// float32 -> E2M1 code, round to nearest even, saturating at ±6 (|x| > 5 gives 6). The same
// codes as TensorRT Model Optimizer's NVFP4QTensor._cast_fp4 (modelopt/torch/quantization/
// qtensor/nvfp4_tensor.py: searchsorted on the bounds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 with
// the ties at 0.75, 1.75, 3.5 moved up, i.e. ties to the even code) and as PTX's
// cvt.rn.satfinite.e2m1x2.f32; values < 0 get the sign bit (as _cast_fp4: −0.0 gives code 0,
// −0.1 code 8). x not NaN.
inline uint8_t FloatToE2m1(float x) {
  const float a = std::fabs(x);
  uint8_t m;
  if (a <= 0.25f) {
    m = 0;
  } else if (a < 0.75f) {
    m = 1;
  } else if (a <= 1.25f) {
    m = 2;
  } else if (a < 1.75f) {
    m = 3;
  } else if (a <= 2.5f) {
    m = 4;
  } else if (a < 3.5f) {
    m = 5;
  } else if (a <= 5.0f) {
    m = 6;
  } else {
    m = 7;
  }
  return x < 0.0f ? uint8_t(m | 8) : m;
}

}  // namespace dgserve
