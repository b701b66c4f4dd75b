// Stop sequences applied to a stream of text that arrives in pieces (one piece per committed
// canvas block): a stop sequence may span any number of pieces.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dgserve {

// Streams text through a set of stop sequences. Text that can no longer be the beginning of a
// stop sequence is emitted at once; the longest tail that is still a prefix of some stop
// sequence is held back until later text decides it. On the first full match the text before
// the match is emitted, the match and everything after it are dropped, and the matcher stops
// (further Push calls emit nothing). Matching is byte-wise: with valid UTF-8 input and valid
// UTF-8 stop sequences the emitted pieces are valid UTF-8 (a held tail always starts at a
// character boundary, since it starts with the first byte of a stop sequence).
//
// Not thread-safe; one matcher per request.
class StopMatcher {
 public:
  struct Result {
    std::string emit;      // text that is final (never part of a stop sequence)
    bool stopped = false;  // a stop sequence matched (now or earlier)
  };

  // `stops`: the stop sequences; empty strings are ignored. With no (non-empty) stop sequence,
  // Push emits everything at once.
  explicit StopMatcher(std::vector<std::string> stops);

  // Feeds the next piece of text. Returns the text that became final and whether a stop
  // sequence matched. The earliest match (by start position) wins when several could.
  Result Push(std::string_view new_text);

  // At the end of generation (no stop sequence matched): returns the held-back tail and
  // clears it. Returns "" after a match.
  std::string Flush();

  bool stopped() const { return stopped_; }
  // Bytes currently held back (for tests and diagnostics).
  size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
};

}  // namespace dgserve
