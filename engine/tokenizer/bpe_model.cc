#include "engine/tokenizer/bpe_model.h"

#include <algorithm>
#include <limits>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/tokenizer/pipeline.h"
#include "engine/tokenizer/utf8.h"

namespace dgserve::tokenizer_internal {
namespace {

// The SentencePiece word marker U+2581.
constexpr std::string_view kMarker = "\xE2\x96\x81";

// Decodes the character that ends right before byte `pos`; false if it is not valid UTF-8.
bool PreviousChar(std::string_view s, size_t pos, char32_t* cp) {
  size_t start = pos;
  do {
    --start;
  } while (start > 0 && pos - start < 4 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80);
  return DecodeUtf8(s, start, cp) == pos - start;
}

}  // namespace

void PieceVocab::Add(std::string_view piece, int64_t id) {
  entries_.push_back({buffer_.size(), static_cast<uint32_t>(piece.size()), id});
  buffer_.insert(buffer_.end(), piece.begin(), piece.end());
}

absl::Status PieceVocab::Finalize(std::string_view what) {
  int64_t max_id = -1;
  for (const Entry& e : entries_) {
    if (e.id < 0 || e.id >= std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: token id %d out of range", what, e.id));
    }
    max_id = std::max(max_id, e.id);
  }
  pieces_.assign(static_cast<size_t>(max_id + 1), std::string_view());
  has_.assign(static_cast<size_t>(max_id + 1), false);
  index_.clear();
  index_.reserve(entries_.size());
  for (const Entry& e : entries_) {
    const std::string_view piece(buffer_.data() + e.offset, e.length);
    if (has_[e.id]) {
      return absl::InvalidArgumentError(absl::StrFormat("%s: id %d is given to both '%s' and '%s'",
                                                        what, e.id, pieces_[e.id], piece));
    }
    if (!index_.emplace(piece, static_cast<int32_t>(e.id)).second) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s: piece '%s' appears more than once", what, piece));
    }
    pieces_[e.id] = piece;
    has_[e.id] = true;
  }
  return absl::OkStatus();
}

absl::StatusOr<BpeModel> BpeModel::Create(
    PieceVocab vocab, const std::vector<std::pair<std::string_view, std::string_view>>& merges,
    BpeOptions options) {
  BpeModel model;
  model.vocab_ = std::move(vocab);
  model.options_ = std::move(options);
  const PieceVocab& v = model.vocab_;
  if (model.options_.unk_token.has_value()) {
    model.unk_id_ = v.Find(*model.options_.unk_token);
    if (!model.unk_id_.has_value()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "unk_token '%s' is not in the model vocabulary", *model.options_.unk_token));
    }
  }
  for (int b = 0; b < 256; ++b) {
    const std::string piece = absl::StrFormat("<0x%02X>", b);
    model.byte_ids_[b] = v.Find(piece).value_or(-1);
  }
  model.merges_.reserve(merges.size());
  bool merges_use_byte_tokens = false;
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const std::optional<int32_t> a_id = v.Find(a);
    const std::optional<int32_t> b_id = v.Find(b);
    joined.assign(a);
    joined.append(b);
    const std::optional<int32_t> new_id = v.Find(joined);
    if (!a_id || !b_id || !new_id) {
      const std::string_view missing = !a_id ? a : !b_id ? b : std::string_view(joined);
      return absl::InvalidArgumentError(absl::StrFormat(
          "merge #%d ('%s', '%s'): '%s' is not in the vocabulary", rank, a, b, missing));
    }
    uint8_t unused;
    merges_use_byte_tokens =
        merges_use_byte_tokens || ParseByteToken(a, &unused) || ParseByteToken(b, &unused) ||
        (model.unk_id_ && (*a_id == *model.unk_id_ || *b_id == *model.unk_id_));
    // Like HF (a HashMap collected from the list), a repeated pair keeps its last rank.
    model.merges_[PairKey(*a_id, *b_id)] = {static_cast<int32_t>(rank), *new_id};
  }
  bool all_bytes = model.options_.byte_fallback;
  for (int32_t id : model.byte_ids_) all_bytes = all_bytes && id >= 0;
  model.split_at_marker_ = all_bytes && !merges_use_byte_tokens && !model.options_.ignore_merges;
  if (model.split_at_marker_) {
    for (int32_t id = 0; id < v.id_limit(); ++id) {
      const std::string_view piece = v.Piece(id);
      for (size_t pos = piece.find(kMarker, 1); pos != std::string_view::npos;
           pos = piece.find(kMarker, pos + 1)) {
        char32_t cp;
        if (PreviousChar(piece, pos, &cp)) {
          model.joins_marker_.insert(cp);
        } else {
          model.split_at_marker_ = false;  // a piece that is not valid UTF-8: stay exact
        }
      }
    }
  }
  // An id of a merged word is a character's piece or <unk> (one character, at most 4 bytes), a
  // byte token (1 byte), or a merge's result; with ignore_merges a whole word may be any piece.
  // (A fused <unk> covers a run of unknown characters: those are not counted, see
  // TokenizeWithin.)
  size_t longest = 4;
  if (model.options_.ignore_merges) {
    for (int32_t id = 0; id < v.id_limit(); ++id) longest = std::max(longest, v.Piece(id).size());
  }
  for (const auto& [pair, merge] : model.merges_) {
    longest = std::max(longest, v.Piece(merge.new_id).size());
  }
  model.max_bytes_per_id_ = longest;
  return model;
}

void BpeModel::TokenizeWithin(std::string_view word, std::vector<int32_t>* out,
                              size_t max_tokens) const {
  const size_t room = max_tokens > out->size() ? max_tokens - out->size() : 0;
  // Bytes of characters with a piece (or byte tokens) that ids of at most max_bytes_per_id_
  // bytes each can only cover with more than `room` ids, however they merge. Other characters
  // are not counted: they become an <unk> (fused over a run when fuse_unk) or, without an unk
  // token, nothing; a merge that takes an <unk> counts "<unk>"'s piece, not what it covers.
  const size_t enough = max_tokens == SIZE_MAX || room >= SIZE_MAX / max_bytes_per_id_ - 1
                            ? SIZE_MAX
                            : (room + 1) * max_bytes_per_id_;
  if (word.size() <= enough) {
    TokenizeSegment(word, out);
    return;
  }
  size_t cut = 0, known = 0;
  while (cut < word.size() && known <= enough) {
    const size_t len = Utf8CharLength(word, cut);
    const std::string_view ch = word.substr(cut, len);
    bool has_ids = vocab_.Find(ch).has_value();
    if (!has_ids && options_.byte_fallback) {
      has_ids = true;
      for (char c : ch) has_ids = has_ids && byte_ids_[static_cast<uint8_t>(c)] >= 0;
    }
    if (has_ids) known += len;
    cut += len;
  }
  TokenizeSegment(word.substr(0, cut), out);
}

void BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out,
                        size_t max_tokens) const {
  if (!split_at_marker_) {
    TokenizeWithin(word, out, max_tokens);
    return;
  }
  size_t start = 0;
  for (size_t pos = word.find(kMarker, 1); pos != std::string_view::npos;
       pos = word.find(kMarker, pos + kMarker.size())) {
    char32_t cp;
    if (pos > start && PreviousChar(word, pos, &cp) && !joins_marker_.contains(cp)) {
      TokenizeWithin(word.substr(start, pos - start), out, max_tokens);
      start = pos;
      if (out->size() > max_tokens) return;
    }
  }
  TokenizeWithin(word.substr(start), out, max_tokens);
}

void BpeModel::TokenizeSegment(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return;
  if (options_.ignore_merges) {
    if (std::optional<int32_t> id = vocab_.Find(word)) {
      out->push_back(*id);
      return;
    }
  }

  // Initial symbols: one per character, or its bytes (byte fallback), or <unk>.
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  auto add = [&symbols](int32_t id) {
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  };
  bool pending_unk = false;  // an <unk> (possibly fused over several characters) not yet added
  for (size_t pos = 0; pos < word.size();) {
    const size_t len = Utf8CharLength(word, pos);
    const std::string_view ch = word.substr(pos, len);
    pos += len;
    if (std::optional<int32_t> id = vocab_.Find(ch)) {
      if (pending_unk) {
        add(*unk_id_);
        pending_unk = false;
      }
      add(*id);
      continue;
    }
    if (options_.byte_fallback) {
      bool all_bytes = true;
      for (char c : ch) all_bytes = all_bytes && byte_ids_[static_cast<uint8_t>(c)] >= 0;
      if (all_bytes) {
        // As in HF, a pending <unk> is not flushed before the byte tokens.
        for (char c : ch) add(byte_ids_[static_cast<uint8_t>(c)]);
        continue;
      }
    }
    if (unk_id_.has_value()) {
      if (pending_unk && !options_.fuse_unk) add(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) add(*unk_id_);
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Merge by rank with a min-heap of candidate pairs; stale entries are skipped on pop.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  auto worse = [](const Candidate& x, const Candidate& y) {
    return x.rank != y.rank ? x.rank > y.rank : x.pos > y.pos;
  };
  std::vector<Candidate> storage;
  storage.reserve(symbols.size());
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(worse)> queue(worse,
                                                                                std::move(storage));
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const MergeInfo* m = FindMerge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({m->rank, static_cast<int32_t>(i), m->new_id});
    }
  }
  std::vector<bool> removed(symbols.size(), false);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = symbols[top.pos];
    if (removed[top.pos] || left.next < 0) continue;
    const int32_t right_pos = left.next;
    const Symbol right = symbols[right_pos];
    const MergeInfo* current = FindMerge(left.id, right.id);
    if (current == nullptr || current->new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    left.next = right.next;
    removed[right_pos] = true;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (left.prev >= 0) {
      if (const MergeInfo* m = FindMerge(symbols[left.prev].id, left.id)) {
        queue.push({m->rank, left.prev, m->new_id});
      }
    }
    if (left.next >= 0) {
      if (const MergeInfo* m = FindMerge(left.id, symbols[left.next].id)) {
        queue.push({m->rank, top.pos, m->new_id});
      }
    }
  }
  // Symbol 0 is never removed (merges always remove the right-hand symbol).
  for (int32_t i = 0; i >= 0; i = symbols[i].next) out->push_back(symbols[i].id);
}

}  // namespace dgserve::tokenizer_internal
