#include "service/canvas_template_proto.h"

#include <vector>

namespace dgserve {

bool HasCanvasTemplate(const v1::CanvasTemplate& t) {
  return t.token_ids_size() > 0 || t.holes_size() > 0 || t.every_canvas() || !t.text().empty() ||
         !t.hole().empty() || t.allowed_size() > 0;
}

absl::StatusOr<std::shared_ptr<const CanvasTemplate>> CanvasTemplateFromProto(
    const v1::CanvasTemplate& t, int canvas_length, int32_t vocab) {
  if (!t.text().empty() || !t.hole().empty() || t.allowed_size() > 0) {
    return absl::InvalidArgumentError(
        "canvas_template: the text form (text, hole, allowed) must be resolved to token_ids");
  }
  std::vector<TemplateHoleSpec> holes;
  holes.reserve(t.holes_size());
  for (const v1::TemplateHole& h : t.holes()) {
    holes.push_back({h.position(), {h.allowed_token_ids().begin(), h.allowed_token_ids().end()}});
  }
  return CanvasTemplate::Create({t.token_ids().data(), size_t(t.token_ids_size())}, holes,
                                canvas_length, vocab);
}

}  // namespace dgserve
