// The wire form of a canvas template (dgserve.v1.CanvasTemplate, token-id form) → the engine's
// validated CanvasTemplate (engine/denoise/canvas_template.h). Shared by the gateway (which
// validates before routing) and the denoise worker (which validates again and runs it).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "dgserve/v1/generation.pb.h"
#include "engine/denoise/canvas_template.h"

namespace dgserve {

// Whether the message sets anything (an unset or default CanvasTemplate means "no template").
bool HasCanvasTemplate(const v1::CanvasTemplate& t);

// INVALID_ARGUMENT as CanvasTemplate::Create, for the token-id fields (token_ids, holes); the
// text form (text, hole, allowed) must have been resolved to token ids by the gateway.
absl::StatusOr<std::shared_ptr<const CanvasTemplate>> CanvasTemplateFromProto(
    const v1::CanvasTemplate& t, int canvas_length, int32_t vocab);

}  // namespace dgserve
