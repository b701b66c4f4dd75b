#include "engine/tokenizer/pipeline.h"

#include <utility>

#include "absl/strings/str_join.h"
#include "engine/tokenizer/utf8.h"

namespace dgserve::tokenizer_internal {
namespace {

// Replaces every non-overlapping occurrence of `pattern` (non-empty), left to right.
std::string ReplaceAll(std::string_view text, std::string_view pattern, std::string_view content) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (true) {
    const size_t hit = text.find(pattern, pos);
    if (hit == std::string_view::npos) break;
    out.append(text.substr(pos, hit - pos));
    out.append(content);
    pos = hit + pattern.size();
  }
  out.append(text.substr(pos));
  return out;
}

struct Segment {
  size_t begin;
  size_t end;
  bool is_match;
};

// HF NormalizedString::split for one literal pattern; appends the pieces to `out`.
void SplitOne(std::string_view text, const SplitStep& step, std::vector<std::string_view>* out) {
  std::vector<Segment> segments;
  size_t prev = 0;
  while (true) {
    const size_t hit = text.find(step.pattern, prev);
    if (hit == std::string_view::npos) break;
    if (hit != prev) segments.push_back({prev, hit, false});
    segments.push_back({hit, hit + step.pattern.size(), true});
    prev = hit + step.pattern.size();
  }
  if (prev != text.size()) segments.push_back({prev, text.size(), false});
  if (step.invert) {
    for (Segment& s : segments) s.is_match = !s.is_match;
  }

  // `keep[i]` false marks a removed segment (kRemoved only).
  std::vector<Segment> pieces;
  std::vector<bool> keep;
  switch (step.behavior) {
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments) {
        pieces.push_back(s);
        keep.push_back(!s.is_match);
      }
      break;
    case SplitBehavior::kIsolated:
      pieces = segments;
      keep.assign(pieces.size(), true);
      break;
    case SplitBehavior::kMergedWithPrevious: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      keep.assign(pieces.size(), true);
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      bool previous_match = false;
      for (size_t i = segments.size(); i-- > 0;) {
        const Segment& s = segments[i];
        if (s.is_match && !previous_match && !pieces.empty()) {
          pieces.back().begin = s.begin;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      std::vector<Segment> reversed(pieces.rbegin(), pieces.rend());
      pieces = std::move(reversed);
      keep.assign(pieces.size(), true);
      break;
    }
    case SplitBehavior::kContiguous: {
      bool previous_match = false;
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !pieces.empty()) {
          pieces.back().end = s.end;
        } else {
          pieces.push_back(s);
        }
        previous_match = s.is_match;
      }
      keep.assign(pieces.size(), true);
      break;
    }
  }
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (keep[i] && pieces[i].end > pieces[i].begin) {
      out->push_back(text.substr(pieces[i].begin, pieces[i].end - pieces[i].begin));
    }
  }
}

}  // namespace

std::string Normalizer::Normalize(std::string_view text) const {
  std::string current(text);
  for (const NormalizerStep& step : steps_) {
    switch (step.kind) {
      case NormalizerStep::Kind::kReplace:
        current = ReplaceAll(current, step.pattern, step.content);
        break;
      case NormalizerStep::Kind::kPrepend:
        if (!current.empty()) current.insert(0, step.content);
        break;
    }
  }
  return current;
}

void PreTokenizer::Split(std::string_view text, std::vector<std::string_view>* out) const {
  if (text.empty()) return;
  if (steps_.empty()) {
    out->push_back(text);
    return;
  }
  std::vector<std::string_view> current = {text};
  std::vector<std::string_view> next;
  for (const SplitStep& step : steps_) {
    next.clear();
    for (std::string_view piece : current) SplitOne(piece, step, &next);
    current.swap(next);
  }
  out->insert(out->end(), current.begin(), current.end());
}

AddedTokenMatcher::AddedTokenMatcher() {
  for (int32_t& c : root_children_) c = -1;
  terminal_.push_back(-1);  // the root
}

int32_t AddedTokenMatcher::Child(int32_t node, uint8_t byte) const {
  if (node == 0) return root_children_[byte];
  auto it = edges_.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == edges_.end() ? -1 : it->second;
}

void AddedTokenMatcher::Add(std::string_view pattern, int32_t index) {
  if (pattern.empty()) return;
  int32_t node = 0;
  for (char c : pattern) {
    const uint8_t byte = static_cast<uint8_t>(c);
    int32_t child = Child(node, byte);
    if (child < 0) {
      child = static_cast<int32_t>(terminal_.size());
      terminal_.push_back(-1);
      if (node == 0) {
        root_children_[byte] = child;
      } else {
        edges_.emplace((static_cast<uint64_t>(node) << 8) | byte, child);
      }
    }
    node = child;
  }
  if (terminal_[node] < 0) ++num_patterns_;
  terminal_[node] = index;
}

void AddedTokenMatcher::FindAll(std::string_view text, std::vector<Match>* out) const {
  if (num_patterns_ == 0) return;
  size_t i = 0;
  while (i < text.size()) {
    int32_t node = root_children_[static_cast<uint8_t>(text[i])];
    if (node < 0) {
      ++i;
      continue;
    }
    size_t best_end = 0;
    int32_t best_index = -1;
    size_t j = i + 1;
    if (terminal_[node] >= 0) {
      best_end = j;
      best_index = terminal_[node];
    }
    while (j < text.size()) {
      node = Child(node, static_cast<uint8_t>(text[j]));
      if (node < 0) break;
      ++j;
      if (terminal_[node] >= 0) {
        best_end = j;
        best_index = terminal_[node];
      }
    }
    if (best_index >= 0) {
      out->push_back({i, best_end, best_index});
      i = best_end;
    } else {
      ++i;
    }
  }
}

bool ParseByteToken(std::string_view piece, uint8_t* byte) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return false;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    int digit;
    if (c >= '0' && c <= '9') {
      digit = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      digit = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      digit = c - 'A' + 10;
    } else {
      return false;
    }
    value = value * 16 + digit;
  }
  *byte = static_cast<uint8_t>(value);
  return true;
}

namespace {

std::string Replacements(size_t count) {
  std::string out;
  out.reserve(count * kReplacementChar.size());
  for (size_t i = 0; i < count; ++i) out.append(kReplacementChar);
  return out;
}

// HF's ByteFallback decoder, extended to keep an unfinished byte run in `state`.
std::vector<std::string> RunByteFallback(std::vector<std::string> tokens, ByteRunState* state,
                                         bool final) {
  std::vector<std::string> out;
  out.reserve(tokens.size() + 1);
  std::string& pending = state->pending;
  auto end_run = [&]() {
    if (!pending.empty()) {
      out.push_back(IsValidUtf8(pending) ? pending : Replacements(pending.size()));
      pending.clear();
    }
    state->poisoned = false;
  };
  for (std::string& token : tokens) {
    uint8_t byte;
    if (ParseByteToken(token, &byte)) {
      if (state->poisoned) {
        out.emplace_back(kReplacementChar);
      } else {
        pending.push_back(static_cast<char>(byte));
      }
    } else {
      end_run();
      out.push_back(std::move(token));
    }
  }
  if (final) {
    end_run();
  } else if (!pending.empty()) {
    // The run may continue in the next call: emit what is already certain.
    const size_t valid = ValidUtf8PrefixLength(pending);
    if (valid == pending.size()) {
      out.push_back(std::move(pending));
      pending.clear();
    } else if (IsIncompleteUtf8Char(std::string_view(pending).substr(valid))) {
      if (valid > 0) {
        out.push_back(pending.substr(0, valid));
        pending.erase(0, valid);
      }
    } else {
      // Invalid already: HF turns the whole run into U+FFFD per byte, so do that now.
      out.push_back(Replacements(pending.size()));
      pending.clear();
      state->poisoned = true;
    }
  }
  return out;
}

// HF's Strip decoder on one token.
std::string StripToken(const std::string& token, const DecoderStep& step) {
  std::vector<size_t> starts;  // byte offset of each character
  for (size_t pos = 0; pos < token.size(); pos += Utf8CharLength(token, pos)) {
    starts.push_back(pos);
  }
  starts.push_back(token.size());
  const size_t n = starts.size() - 1;
  auto char_at = [&](size_t i) {
    return std::string_view(token).substr(starts[i], starts[i + 1] - starts[i]);
  };
  size_t start_cut = 0;
  for (size_t i = 0; i < n && i < static_cast<size_t>(step.start); ++i) {
    if (char_at(i) != step.content) break;
    start_cut = i + 1;
  }
  size_t stop_cut = n;
  for (size_t i = 0; i < static_cast<size_t>(step.stop) && i < n; ++i) {
    const size_t index = n - i - 1;
    if (char_at(index) != step.content) break;
    stop_cut = index;
  }
  if (stop_cut <= start_cut) return "";
  return token.substr(starts[start_cut], starts[stop_cut] - starts[start_cut]);
}

}  // namespace

std::string Decoder::Run(std::vector<std::string> tokens, ByteRunState* state, bool final) const {
  if (steps_.empty()) return absl::StrJoin(tokens, " ");
  for (const DecoderStep& step : steps_) {
    switch (step.kind) {
      case DecoderStep::Kind::kReplace:
        for (std::string& token : tokens) {
          if (token.find(step.pattern) != std::string::npos) {
            token = ReplaceAll(token, step.pattern, step.content);
          }
        }
        break;
      case DecoderStep::Kind::kByteFallback:
        tokens = RunByteFallback(std::move(tokens), state, final);
        break;
      case DecoderStep::Kind::kFuse: {
        std::string fused = absl::StrJoin(tokens, "");
        tokens.clear();
        tokens.push_back(std::move(fused));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (std::string& token : tokens) token = StripToken(token, step);
        break;
    }
  }
  return absl::StrJoin(tokens, "");
}

}  // namespace dgserve::tokenizer_internal
