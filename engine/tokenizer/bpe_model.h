// The BPE model of a Hugging Face tokenizer.json: a piece vocabulary, merge ranks, byte
// fallback and unknown-token handling, with the same merge order as HF `tokenizers`
// (lowest merge rank first, ties to the leftmost pair).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace dgserve::tokenizer_internal {

// Pieces stored back to back in one buffer, addressed by id, with a hash index. Building it
// does one allocation per container, not one per piece.
class PieceVocab {
 public:
  PieceVocab() = default;
  PieceVocab(PieceVocab&&) = default;
  PieceVocab& operator=(PieceVocab&&) = default;
  PieceVocab(const PieceVocab&) = delete;
  PieceVocab& operator=(const PieceVocab&) = delete;

  // Appends a piece with its id (call before Finalize()).
  void Add(std::string_view piece, int64_t id);
  // Builds the id table and hash index. INVALID_ARGUMENT on a negative, too large or
  // repeated id, or a repeated piece; `what` names the source in messages.
  absl::Status Finalize(std::string_view what);

  // The id of `piece`, if present.
  std::optional<int32_t> Find(std::string_view piece) const {
    auto it = index_.find(piece);
    if (it == index_.end()) return std::nullopt;
    return it->second;
  }
  // The piece of `id`; empty when the id has no piece.
  std::string_view Piece(int32_t id) const {
    if (id < 0 || static_cast<size_t>(id) >= pieces_.size()) return {};
    return pieces_[id];
  }
  // Whether `id` has a piece.
  bool Has(int32_t id) const {
    return id >= 0 && static_cast<size_t>(id) < has_.size() && has_[id];
  }
  // One past the largest id (0 when empty).
  int32_t id_limit() const { return static_cast<int32_t>(pieces_.size()); }
  // Number of pieces.
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    uint64_t offset;
    uint32_t length;
    int64_t id;
  };
  std::vector<char> buffer_;  // a vector: moving it never moves the bytes the views point to
  std::vector<Entry> entries_;
  std::vector<std::string_view> pieces_;  // by id
  std::vector<bool> has_;                 // by id
  absl::flat_hash_map<std::string_view, int32_t> index_;
};

// Settings of a BPE model (tokenizer.json `model`).
struct BpeOptions {
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

// A BPE model. Tokenize() is const and thread-safe.
class BpeModel {
 public:
  BpeModel() = default;
  BpeModel(BpeModel&&) = default;
  BpeModel& operator=(BpeModel&&) = default;

  // Builds the model from a finalized vocabulary and merges given as piece pairs (rank = index).
  // INVALID_ARGUMENT when a merge part or its concatenation is missing from the vocabulary, or
  // the unknown token is not in it.
  static absl::StatusOr<BpeModel> Create(
      PieceVocab vocab, const std::vector<std::pair<std::string_view, std::string_view>>& merges,
      BpeOptions options);

  // Appends the ids of one pre-tokenized word to `out`. Long words (Gemma's pre-tokenizer leaves
  // the whole text as one word) are cut before "▁" wherever no vocabulary piece can span the
  // cut, which gives the same ids as merging the whole word, with small merge heaps. Stops
  // after the piece where `out` first holds more than `max_tokens` ids (the caller's budget).
  // A piece so long that its ids must pass the budget (each id covers at most
  // max_bytes_per_id() bytes of characters that have a piece or byte tokens) is merged only as
  // far as a prefix that passes it: past the budget, `out` holds more than `max_tokens` ids that
  // need not be the word's first ones.
  void Tokenize(std::string_view word, std::vector<int32_t>* out,
                size_t max_tokens = SIZE_MAX) const;

  // The model's vocabulary.
  const PieceVocab& vocab() const { return vocab_; }
  // Number of merge rules.
  size_t num_merges() const { return merges_.size(); }
  // The most bytes of characters with a piece (or byte tokens) one id can cover: the longest
  // merge result, or 4 (one character); with ignore_merges the longest piece. (An <unk> covers
  // unknown characters, a fused one any run of them; without an unk token they make no id.)
  size_t max_bytes_per_id() const { return max_bytes_per_id_; }

 private:
  struct MergeInfo {
    int32_t rank;
    int32_t new_id;
  };
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  const MergeInfo* FindMerge(int32_t a, int32_t b) const {
    auto it = merges_.find(PairKey(a, b));
    return it == merges_.end() ? nullptr : &it->second;
  }

  void TokenizeSegment(std::string_view word, std::vector<int32_t>* out) const;
  // TokenizeSegment of `word`, or of a prefix of it just long enough to make more ids than
  // `max_tokens` allows when the whole word certainly would.
  void TokenizeWithin(std::string_view word, std::vector<int32_t>* out, size_t max_tokens) const;

  PieceVocab vocab_;
  absl::flat_hash_map<uint64_t, MergeInfo> merges_;
  // Cutting words before "▁" is exact when unknown tokens cannot occur (full byte fallback), no
  // merge involves a byte-fallback token, and merges are not bypassed (ignore_merges). The cut is
  // then skipped only after the characters that some piece has right before a "▁".
  bool split_at_marker_ = false;
  size_t max_bytes_per_id_ = 4;
  absl::flat_hash_set<char32_t> joins_marker_;
  BpeOptions options_;
  std::optional<int32_t> unk_id_;
  int32_t byte_ids_[256] = {};  // id of "<0xXX>" or -1
};

}  // namespace dgserve::tokenizer_internal
