// Counter-based randomness for the sampler (spec §4.2 "RNG"): every draw is a pure function of
// (seed, canvas index, step, position, stream), so a request's output depends only on the request
// and its seed, never on batching, thread count or call order.
#pragma once

#include <cstdint>

#include "common/hash.h"

namespace dgserve {

// The independent streams of draws the sampler needs.
enum class DrawStream : uint32_t {
  kInitToken = 0,      // initial canvas tokens (spec §4.2 Init); step is always 0.
  kSampleUniform = 1,  // the uniform u_j of the inverse-CDF candidate sample (spec §4.2 step 4).
  kRenoiseToken = 2,   // renoise tokens of non-accepted positions (spec §4.2 step 6).
};

// Identifies one draw. `canvas` is the canvas (block) index within the request, `step` the
// 0-based denoising step, `pos` the canvas position.
struct DrawKey {
  uint64_t seed = 0;
  DrawStream stream = DrawStream::kInitToken;
  uint32_t canvas = 0;
  uint32_t step = 0;
  uint32_t pos = 0;
};

// The 64 random bits of one draw (SplitMix64 is the splitmix64 finaliser of common/hash.h, the
// same function the golden checkpoint generator uses, README §2.3). Exact construction (all
// arithmetic mod 2^64):
//   h = SplitMix64(seed)
//   h = SplitMix64(h ^ ((uint64_t)stream << 32 | canvas))
//   h = SplitMix64(h ^ ((uint64_t)step << 32 | pos))
// For a fixed seed the first two rounds are injective in (stream, canvas); distinct keys collide
// only with probability ~2^-64.
uint64_t CounterBits(const DrawKey& key);

// Uniform double in [0, 1): (CounterBits(key) >> 11) · 2^-53.
double Uniform01Double(const DrawKey& key);

// Uniform float in [0, 1): (CounterBits(key) >> 40) · 2^-24 (exact in float32, at most 1 − 2^-24).
float Uniform01(const DrawKey& key);

// Uniform integer in [0, n) for n ≥ 1 by the multiply-high method: (bits · n) >> 64 over the full
// 64-bit word. Exactly unbiased when n is a power of two (e.g. 262144); otherwise every value's
// probability is within n / 2^64 (< 1.5e-14 for n ≤ 262144) of 1/n.
int32_t UniformIndex(uint64_t bits, int32_t n);

// Uniform token id in [0, vocab): UniformIndex(CounterBits(key), vocab). Requires vocab ≥ 1.
int32_t UniformToken(const DrawKey& key, int32_t vocab);

// The sampler's source of randomness. Implementations must be deterministic functions of their
// arguments (the denoiser may call them in any order, from any thread, any number of times).
// Tests implement it to replay recorded draws.
class DrawSource {
 public:
  virtual ~DrawSource() = default;
  // Initial canvas token at `pos` of canvas `canvas` (spec §4.2 Init), in [0, vocab).
  virtual int32_t InitToken(int canvas, int pos) = 0;
  // Uniform in [0, 1) for the candidate sample of (canvas, step, pos) (spec §4.2 step 4).
  virtual float SampleUniform(int canvas, int step, int pos) = 0;
  // Fresh uniform token in [0, vocab) for a non-accepted position (spec §4.2 step 6).
  virtual int32_t RenoiseToken(int canvas, int step, int pos) = 0;
  // The same two draws for a hole restricted to n ≥ 1 allowed ids (canvas templates): an index
  // in [0, n) into the allowed set. With n = vocab they equal InitToken / RenoiseToken.
  virtual int32_t InitIndex(int canvas, int pos, int32_t n) = 0;
  virtual int32_t RenoiseIndex(int canvas, int step, int pos, int32_t n) = 0;
};

// The production DrawSource: CounterBits() with streams kInitToken / kSampleUniform /
// kRenoiseToken. Stateless apart from (seed, vocab); thread-safe. Requires vocab ≥ 1.
class CounterDrawSource final : public DrawSource {
 public:
  CounterDrawSource(uint64_t seed, int32_t vocab) : seed_(seed), vocab_(vocab) {}

  int32_t InitToken(int canvas, int pos) override;
  float SampleUniform(int canvas, int step, int pos) override;
  int32_t RenoiseToken(int canvas, int step, int pos) override;
  int32_t InitIndex(int canvas, int pos, int32_t n) override;
  int32_t RenoiseIndex(int canvas, int step, int pos, int32_t n) override;

  uint64_t seed() const { return seed_; }
  int32_t vocab() const { return vocab_; }

 private:
  uint64_t seed_;
  int32_t vocab_;
};

}  // namespace dgserve
