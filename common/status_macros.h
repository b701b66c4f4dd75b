// Status propagation helpers. Debian's Abseil (20220623) has no ABSL_RETURN_IF_ERROR, so the
// project defines exactly two macros and uses them everywhere.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define DGSERVE_CONCAT_INNER_(a, b) a##b
#define DGSERVE_CONCAT_(a, b) DGSERVE_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status); returns it from the enclosing function if it is not OK.
#define DGSERVE_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status dgserve_status_ = (expr);           \
    if (!dgserve_status_.ok()) return dgserve_status_; \
  } while (0)

// Evaluates `rexpr` (an absl::StatusOr<T>); on error returns its status, else moves the value
// into `lhs` (which may be a declaration, e.g. `auto x`).
#define DGSERVE_ASSIGN_OR_RETURN(lhs, rexpr) \
  DGSERVE_ASSIGN_OR_RETURN_IMPL_(DGSERVE_CONCAT_(dgserve_statusor_, __LINE__), lhs, rexpr)

#define DGSERVE_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = std::move(statusor).value()
