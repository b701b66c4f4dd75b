// Limits that several components enforce and must agree on. Kept in one dependency-free header
// so that a client tool, the gateway and the denoise worker cannot drift apart.
#pragma once

#include <cstdint>

namespace dgserve {

// The most parallel samples (OpenAI `n`, GenerateRequest.n, DenoiseRequest.num_samples) one
// request may ask for: the denoise worker refuses more, the gateway's --max_n may not exceed
// it, and client tools refuse more before they connect.
inline constexpr int kMaxSamplesPerRequest = 64;

// The largest `max_tokens` (OpenAI API) the gateway parses: more is INVALID_ARGUMENT whatever the
// model's context, and client tools refuse more before they connect.
inline constexpr int64_t kMaxTokensPerRequest = 1'000'000;

}  // namespace dgserve
