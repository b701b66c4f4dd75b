// bfloat16 and float16 conversions (bit-exact, IEEE-754 round-to-nearest-even).
#pragma once

#include <cstdint>
#include <cstring>

namespace dgserve {

// float32 -> bf16 bits, round-to-nearest-even on the bit pattern (NaN stays NaN).
inline uint16_t FloatToBf16(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if ((b & 0x7F800000u) == 0x7F800000u && (b & 0x007FFFFFu) != 0) return uint16_t((b >> 16) | 0x40);
  return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// bf16 bits -> float32 (exact).
inline float Bf16ToFloat(uint16_t h) {
  uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Rounds a float32 to the nearest bf16 value and returns it as float32.
inline float RoundToBf16(float f) { return Bf16ToFloat(FloatToBf16(f)); }

// IEEE half bits -> float32 (exact; handles subnormals, inf, NaN).
inline float HalfToFloat(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  uint32_t b;
  if (exp == 0) {
    if (man == 0) {
      b = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        man <<= 1;
        ++e;
      } while ((man & 0x400u) == 0);
      b = sign | (uint32_t(127 - 15 - e) << 23) | ((man & 0x3FFu) << 13);
    }
  } else if (exp == 31) {
    b = sign | 0x7F800000u | (man << 13);
  } else {
    b = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

}  // namespace dgserve
