// Identifiers and random seeds the gateway hands out, drawn from the kernel's CSPRNG
// (getrandom(2)). A public request id (returned to the client, e.g. "cmpl-<id>") says nothing
// about the ids of other requests, and the ids of the calls to the workers are separate draws,
// so knowing a response's id does not let anyone address that request inside the cluster.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace dgserve {

// Fills buf[0, n) from the kernel's CSPRNG (blocking only until it is seeded at boot).
// INTERNAL when the kernel refuses (no getrandom and no /dev/urandom).
absl::Status SecureRandomBytes(void* buf, size_t n);

// A public request id: 128 random bits as 32 lowercase hex digits.
absl::StatusOr<std::string> NewRequestId();
// The id of one attempt's calls to the workers: 128 random bits as "att-" + 32 hex digits, a
// draw independent of the public id.
absl::StatusOr<std::string> NewInternalId();
// A random sampler seed in [0, 2^63) for requests that give none.
absl::StatusOr<uint64_t> NewRandomSeed();

}  // namespace dgserve
