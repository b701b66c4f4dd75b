#include "engine/denoise/rng.h"

namespace dgserve {

uint64_t CounterBits(const DrawKey& key) {
  uint64_t h = SplitMix64(key.seed);
  h = SplitMix64(h ^ ((static_cast<uint64_t>(key.stream) << 32) | key.canvas));
  h = SplitMix64(h ^ ((static_cast<uint64_t>(key.step) << 32) | key.pos));
  return h;
}

double Uniform01Double(const DrawKey& key) {
  return static_cast<double>(CounterBits(key) >> 11) * 0x1p-53;
}

float Uniform01(const DrawKey& key) {
  return static_cast<float>(CounterBits(key) >> 40) * 0x1p-24f;
}

int32_t UniformIndex(uint64_t bits, int32_t n) {
  const unsigned __int128 product = static_cast<unsigned __int128>(bits) * static_cast<uint64_t>(n);
  return static_cast<int32_t>(product >> 64);
}

int32_t UniformToken(const DrawKey& key, int32_t vocab) {
  return UniformIndex(CounterBits(key), vocab);
}

int32_t CounterDrawSource::InitToken(int canvas, int pos) { return InitIndex(canvas, pos, vocab_); }

int32_t CounterDrawSource::InitIndex(int canvas, int pos, int32_t n) {
  return UniformToken({seed_, DrawStream::kInitToken, static_cast<uint32_t>(canvas), 0u,
                       static_cast<uint32_t>(pos)},
                      n);
}

float CounterDrawSource::SampleUniform(int canvas, int step, int pos) {
  return Uniform01({seed_, DrawStream::kSampleUniform, static_cast<uint32_t>(canvas),
                    static_cast<uint32_t>(step), static_cast<uint32_t>(pos)});
}

int32_t CounterDrawSource::RenoiseToken(int canvas, int step, int pos) {
  return RenoiseIndex(canvas, step, pos, vocab_);
}

int32_t CounterDrawSource::RenoiseIndex(int canvas, int step, int pos, int32_t n) {
  return UniformToken({seed_, DrawStream::kRenoiseToken, static_cast<uint32_t>(canvas),
                       static_cast<uint32_t>(step), static_cast<uint32_t>(pos)},
                      n);
}

}  // namespace dgserve
