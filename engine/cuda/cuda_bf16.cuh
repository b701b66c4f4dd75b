// bf16 conversions for the kernel files (*.cu), bit for bit those of the CPU code, so device and
// host round at the same points to the same values (spec §5.3; engine/cpu/gemm.h):
//   Bf16BitsToFloat     the exact widening (dgserve::Bf16ToFloat)
//   ToBf16Bits          round to nearest even, NaN kept NaN and quieted (dgserve::FloatToBf16):
//                       probabilities and other values the reference stores as bf16
//   ActivationBf16Bits  a GEMM input of the bf16-input mode (cpu::RoundActivationToBf16): a
//                       denormal is read as a zero of its sign (DAZ, as VCVTNE2PS2BF16), then
//                       ToBf16Bits
//   SplitTermBits       term 0, 1 or 2 (hi, mid, lo) of the exact split x = hi + mid + lo of
//                       GemmInput::kFloat32
#pragma once

#include <cstdint>

#include "engine/cuda/cuda_device.cuh"

namespace dgserve::cuda {

__device__ __forceinline__ float Bf16BitsToFloat(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}

__device__ __forceinline__ uint16_t ToBf16Bits(float f) {
  const uint32_t b = __float_as_uint(f);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((b >> 16) | 0x40u);
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ uint16_t ActivationBf16Bits(float f) {
  const uint32_t b = __float_as_uint(f);
  return ToBf16Bits((b & 0x7F800000u) == 0 ? __uint_as_float(b & 0x80000000u) : f);
}

// Term `term` of the exact split x = hi + mid + lo (GemmInput::kFloat32): each subtraction of a
// bf16 rounding of f from f is exact in float32, and what is left after two fits bf16. A
// non-finite x is its own hi term.
__device__ __forceinline__ uint16_t SplitTermBits(float f, int term) {
  uint16_t t = ToBf16Bits(f);
  if ((__float_as_uint(f) & 0x7F800000u) == 0x7F800000u) return term == 0 ? t : uint16_t(0);
  for (int j = 0; j < term; ++j) {
    f = __fsub_rn(f, Bf16BitsToFloat(t));
    t = ToBf16Bits(f);
  }
  return t;
}

}  // namespace dgserve::cuda
