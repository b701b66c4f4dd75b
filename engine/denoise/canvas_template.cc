#include "engine/denoise/canvas_template.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"

namespace dgserve {
namespace {

std::vector<uint64_t> MaskOf(std::span<const int32_t> ids, int32_t vocab) {
  std::vector<uint64_t> mask((size_t(vocab) + 63) / 64, 0);
  for (int32_t id : ids) mask[size_t(id) / 64] |= uint64_t{1} << (id % 64);
  return mask;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const CanvasTemplate>> CanvasTemplate::Create(
    std::span<const int32_t> token_ids, std::span<const TemplateHoleSpec> holes,
    int canvas_length, int32_t vocab) {
  if (canvas_length < 1 || vocab < 1) {
    return absl::InvalidArgumentError("canvas_template: canvas_length and vocab must be >= 1");
  }
  if (int64_t(token_ids.size()) > canvas_length) {
    return absl::InvalidArgumentError(
        absl::StrCat("canvas_template: ", token_ids.size(),
                     " positions are longer than the canvas (", canvas_length, " tokens)"));
  }
  std::shared_ptr<CanvasTemplate> t(new CanvasTemplate());
  t->vocab_ = vocab;
  t->fixed_.assign(canvas_length, -1);
  t->set_of_.assign(canvas_length, -1);
  for (size_t j = 0; j < token_ids.size(); ++j) {
    const int32_t id = token_ids[j];
    if (id < -1 || id >= vocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("canvas_template.token_ids[", j, "]: ", id,
                       " is neither -1 (a hole) nor a token id in [0, ", vocab, ")"));
    }
    t->fixed_[j] = id;
  }
  std::map<std::vector<int32_t>, int> set_index;
  for (size_t h = 0; h < holes.size(); ++h) {
    const TemplateHoleSpec& spec = holes[h];
    const std::string where = absl::StrCat("canvas_template.holes[", h, "]");
    if (spec.position < 0 || spec.position >= canvas_length) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".position: ", spec.position,
                                                     " is outside the canvas [0, ",
                                                     canvas_length, ")"));
    }
    if (t->fixed_[spec.position] >= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ".position: ", spec.position, " is fixed (token ", t->fixed_[spec.position],
          "), not a hole"));
    }
    if (t->set_of_[spec.position] >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ".position: ", spec.position, " is listed twice"));
    }
    if (spec.allowed_token_ids.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ".allowed_token_ids: is empty"));
    }
    std::vector<int32_t> ids = spec.allowed_token_ids;
    for (size_t j = 0; j < ids.size(); ++j) {
      if (ids[j] < 0 || ids[j] >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(where, ".allowed_token_ids[", j, "]: ",
                                                       ids[j], " is outside the vocabulary [0, ",
                                                       vocab, ")"));
      }
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    auto [it, inserted] = set_index.emplace(ids, int(t->sets_.size()));
    if (inserted) t->sets_.push_back(std::move(ids));
    t->set_of_[spec.position] = it->second;
  }
  for (int j = 0; j < canvas_length; ++j) {
    if (t->fixed_[j] < 0) t->holes_.push_back(j);
  }
  // Masks: one per allowed set, one per distinct fixed token.
  t->masks_.reserve(t->sets_.size() + size_t(canvas_length));
  for (const auto& ids : t->sets_) t->masks_.push_back(MaskOf(ids, vocab));
  std::map<int32_t, size_t> fixed_mask;
  t->row_masks_.assign(canvas_length, nullptr);
  for (int j = 0; j < canvas_length; ++j) {
    if (t->fixed_[j] >= 0) {
      auto [it, inserted] = fixed_mask.emplace(t->fixed_[j], t->masks_.size());
      if (inserted) {
        const int32_t id = t->fixed_[j];
        t->masks_.push_back(MaskOf({&id, 1}, vocab));
      }
      t->row_masks_[j] = t->masks_[it->second].data();
    } else if (t->set_of_[j] >= 0) {
      t->row_masks_[j] = t->masks_[size_t(t->set_of_[j])].data();
    }
  }
  return std::shared_ptr<const CanvasTemplate>(std::move(t));
}

std::span<const int32_t> CanvasTemplate::allowed(int pos) const {
  const int s = set_of_[pos];
  if (s < 0) return {};
  return sets_[size_t(s)];
}

bool CanvasTemplate::Allows(int pos, int32_t token) const {
  if (token < 0 || token >= vocab_) return false;
  const uint64_t* mask = row_masks_[pos];
  return mask == nullptr || ((mask[size_t(token) / 64] >> (token % 64)) & 1) != 0;
}

}  // namespace dgserve
