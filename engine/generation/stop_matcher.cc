#include "engine/generation/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace dgserve {

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

StopMatcher::Result StopMatcher::Push(std::string_view new_text) {
  Result result;
  if (stopped_) {
    result.stopped = true;
    return result;
  }
  if (stops_.empty()) {
    result.emit = std::string(new_text);
    return result;
  }
  std::string buffer = std::move(held_);
  held_.clear();
  buffer.append(new_text);

  // A full match anywhere in the buffer: the earliest start wins. Everything before the held
  // tail was already checked, and any match starting there would have kept it held.
  size_t match = std::string::npos;
  for (const std::string& s : stops_) {
    const size_t pos = buffer.find(s);
    if (pos < match) match = pos;
  }
  if (match != std::string::npos) {
    stopped_ = true;
    result.stopped = true;
    buffer.resize(match);
    result.emit = std::move(buffer);
    return result;
  }

  // Hold the longest suffix that is a proper prefix of some stop sequence.
  size_t hold = 0;
  for (const std::string& s : stops_) {
    const size_t max_k = std::min(s.size() - 1, buffer.size());
    for (size_t k = max_k; k > hold; --k) {
      if (std::string_view(buffer).substr(buffer.size() - k) == std::string_view(s).substr(0, k)) {
        hold = k;
        break;
      }
    }
  }
  held_ = buffer.substr(buffer.size() - hold);
  buffer.resize(buffer.size() - hold);
  result.emit = std::move(buffer);
  return result;
}

std::string StopMatcher::Flush() {
  std::string out = std::move(held_);
  held_.clear();
  if (stopped_) return "";
  return out;
}

}  // namespace dgserve
