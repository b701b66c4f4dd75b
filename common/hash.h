// Small integer hashes shared by the random-checkpoint generator (golden README §2.3) and the
// sampler's counter-based RNG.
#pragma once

#include <cstdint>
#include <string_view>

namespace dgserve {

// splitmix64 finaliser (Steele, Lea, Flood 2014): a bijective 64-bit mix of z + golden gamma.
inline uint64_t SplitMix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 64-bit FNV-1a over the bytes of `s`.
inline uint64_t Fnv1a64(std::string_view s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x00000100000001B3ull;
  }
  return h;
}

}  // namespace dgserve
