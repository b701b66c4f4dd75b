// Admission by K/V memory, shared by both workers' engines (denoise_engine.cc,
// prefill_engine.cc): whether a backend's K/V memory holds a set of sequences at once.
#pragma once

#include <span>
#include <string>

#include "absl/status/status.h"
#include "common/logging.h"
#include "engine/model/backend.h"

namespace dgserve {

// ModelBackend::CheckKvFitsTogether(seqs) as an admission decision: false only for
// RESOURCE_EXHAUSTED (the sequences do not fit: the next one waits); any other error (a fault
// in the check) is logged and admits, so a broken check never holds a queue.
inline bool KvFitsTogether(const ModelBackend& backend, std::span<const KvSequencePlan> seqs) {
  const absl::Status fits = backend.CheckKvFitsTogether(seqs);
  if (!fits.ok() && !absl::IsResourceExhausted(fits)) {
    DGSERVE_LOG_WARNING("K/V memory admission check failed, admitting: %s",
                        std::string(fits.message()).c_str());
  }
  return !absl::IsResourceExhausted(fits);
}

}  // namespace dgserve
