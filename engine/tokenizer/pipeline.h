// The non-model stages of a Hugging Face tokenizer.json pipeline that dgserve supports:
// normalizers (Replace with a string pattern, Prepend, Sequence), the Split pre-tokenizer with a
// string pattern (all five delimiter behaviours, `invert`), added-token matching, and decoders
// (Replace, ByteFallback, Fuse, Strip, Sequence). Unsupported component types are rejected when
// the tokenizer is loaded.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"

namespace dgserve::tokenizer_internal {

// One normalizer step.
struct NormalizerStep {
  enum class Kind { kReplace, kPrepend };
  Kind kind;
  std::string pattern;  // kReplace: the literal to replace (non-empty)
  std::string content;  // kReplace: replacement; kPrepend: the prefix
};

// A sequence of normalizer steps applied in order.
class Normalizer {
 public:
  // Adds a step at the end.
  void AddStep(NormalizerStep step) { steps_.push_back(std::move(step)); }
  // Whether there are no steps (normalization is the identity).
  bool empty() const { return steps_.empty(); }
  // Returns the normalized text.
  std::string Normalize(std::string_view text) const;

 private:
  std::vector<NormalizerStep> steps_;
};

// How a Split pre-tokenizer treats the delimiters it finds (HF SplitDelimiterBehavior).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

// A Split pre-tokenizer with a literal pattern.
struct SplitStep {
  std::string pattern;  // non-empty literal
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
};

// A sequence of Split steps; each splits every piece produced by the previous one.
class PreTokenizer {
 public:
  // Adds a step at the end.
  void AddStep(SplitStep step) { steps_.push_back(std::move(step)); }
  // Splits `text` into words (views into `text`), appended to `out`; empty words are dropped.
  void Split(std::string_view text, std::vector<std::string_view>* out) const;

 private:
  std::vector<SplitStep> steps_;
};

// Finds added tokens in text: leftmost-longest, non-overlapping matches (what HF's Aho-Corasick
// automaton with MatchKind::LeftmostLongest returns), via a byte trie.
class AddedTokenMatcher {
 public:
  // One match: bytes [begin, end) of the text are token `index` (the value given to Add).
  struct Match {
    size_t begin;
    size_t end;
    int32_t index;
  };

  AddedTokenMatcher();
  // Adds a non-empty pattern; a repeated pattern keeps the last index.
  void Add(std::string_view pattern, int32_t index);
  // Whether no pattern was added.
  bool empty() const { return num_patterns_ == 0; }
  // Appends all matches in `text` to `out`, left to right.
  void FindAll(std::string_view text, std::vector<Match>* out) const;

 private:
  int32_t Child(int32_t node, uint8_t byte) const;

  int32_t root_children_[256];                    // child of the root per first byte, or -1
  absl::flat_hash_map<uint64_t, int32_t> edges_;  // (node << 8 | byte) -> child, below root
  std::vector<int32_t> terminal_;                 // node -> pattern index or -1
  size_t num_patterns_ = 0;
};

// One decoder step.
struct DecoderStep {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip };
  Kind kind = Kind::kFuse;
  std::string pattern;  // kReplace: non-empty literal
  std::string content;  // kReplace: replacement; kStrip: the character to strip
  int start = 0;        // kStrip: at most this many leading `content` characters are removed
  int stop = 0;         // kStrip: at most this many trailing ones
};

// Carries a run of byte-fallback bytes across Decoder::Run calls (streaming).
struct ByteRunState {
  std::string pending;    // bytes of the current run not yet emitted
  bool poisoned = false;  // the current run already had an invalid byte sequence
};

// A decoder: a list of steps applied to the token strings in order. With no steps the tokens
// are joined with single spaces (HF's behaviour without a decoder).
class Decoder {
 public:
  // Adds a step at the end.
  void AddStep(DecoderStep step) { steps_.push_back(std::move(step)); }
  // Whether there are no steps.
  bool empty() const { return steps_.empty(); }
  // Decodes `tokens` (consumed). `final` ends the byte run at the end of `tokens`; when false,
  // complete characters are emitted and an incomplete trailing UTF-8 sequence stays in `state`
  // for the next call. With final=true and a fresh state this is exactly HF's decode chain:
  // a byte run that is not valid UTF-8 becomes one U+FFFD per byte.
  std::string Run(std::vector<std::string> tokens, ByteRunState* state, bool final) const;

 private:
  std::vector<DecoderStep> steps_;
};

// Whether `piece` looks like a byte-fallback token "<0xHH>" (HF's test); sets `*byte`.
bool ParseByteToken(std::string_view piece, uint8_t* byte);

}  // namespace dgserve::tokenizer_internal
