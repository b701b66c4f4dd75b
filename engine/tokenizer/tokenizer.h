// dgserve's tokenizer: loads a Hugging Face `tokenizer.json` (the Gemma 3/4 format: Replace
// normalizer, Split pre-tokenizer, BPE with byte fallback, TemplateProcessing adding <bos>,
// Replace/ByteFallback/Fuse decoder) and encodes/decodes with HF `tokenizers` semantics.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace dgserve {
namespace tokenizer_internal {
struct TokenizerData;
struct ByteRunState;
}  // namespace tokenizer_internal

// An immutable tokenizer. Copies are cheap and share the loaded tables; all methods are const
// and safe to call from several threads.
class Tokenizer {
 public:
  // Loads a tokenizer.json. NOT_FOUND when the file cannot be opened; INVALID_ARGUMENT (naming
  // the file) for malformed JSON, missing fields, or unsupported model / normalizer /
  // pre-tokenizer / post-processor / decoder types (naming the type).
  static absl::StatusOr<Tokenizer> Load(const std::string& tokenizer_json_path);
  // Same as Load() for tokenizer.json text already in memory; `source_name` is used in errors.
  static absl::StatusOr<Tokenizer> FromJson(std::string_view json_text,
                                            std::string_view source_name);

  // Encodes `text` like HF `tokenizer.encode(text, add_special_tokens=add_bos)`: added tokens are
  // split off the raw text first (leftmost-longest), the rest is normalized, pre-tokenized and
  // BPE-encoded (characters missing from the vocabulary fall back to <0xXX> byte tokens).
  // `add_bos` applies the post-processor template (for Gemma: a leading <bos>).
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const;
  // Encode with a budget, as EncodeText with a budget below.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos, size_t max_tokens) const;

  // Encodes user text: like Encode, but special (control) tokens are not split off, so a string
  // such as "<eos>" or "<start_of_turn>" in the text is encoded as the characters it is, never
  // as the control token (HF `split_special_tokens=True`). Non-special added tokens still match.
  // Only templates (RenderChat, `add_bos`) emit control tokens.
  std::vector<int32_t> EncodeText(std::string_view text, bool add_bos) const;
  // EncodeText with a budget: stops encoding as soon as more than `max_tokens` ids have been
  // produced (checked after every pre-tokenized word, every piece of a long word the BPE model
  // merges on its own, and every added token), so that a huge text costs about `max_tokens`
  // tokens of work. The result is the full encoding when it has at most `max_tokens` ids;
  // otherwise more than `max_tokens` ids, usually a prefix of it (at most one piece's ids past
  // the budget, the post-processor's suffix left out; a piece whose ids must pass the budget is
  // merged only in part, see BpeModel::Tokenize): callers test `size() > max_tokens`.
  std::vector<int32_t> EncodeText(std::string_view text, bool add_bos, size_t max_tokens) const;

  // Decodes ids like HF `tokenizer.decode(ids, skip_special_tokens=skip_special)`: byte-fallback
  // runs are joined into UTF-8 (a run that is not valid UTF-8 becomes one U+FFFD per byte, as in
  // HF), "▁" becomes a space. Ids without a piece are skipped.
  std::string Decode(std::span<const int32_t> ids, bool skip_special) const;

  // The piece (vocabulary string) of `id`; empty for an id without one.
  std::string_view IdToPiece(int32_t id) const;
  // The id of a piece (added tokens first, then the model vocabulary).
  std::optional<int32_t> PieceToId(std::string_view piece) const;
  // One past the largest id known to the tokenizer (model vocabulary and added tokens).
  int32_t vocab_size() const;
  // Whether `id` is an added token marked special (what skip_special removes).
  bool IsSpecial(int32_t id) const;

 private:
  friend class StreamDecoder;
  explicit Tokenizer(std::shared_ptr<const tokenizer_internal::TokenizerData> data)
      : data_(std::move(data)) {}

  // Decodes one chunk; `state` carries an unfinished byte-fallback run between chunks.
  std::string DecodeChunk(std::span<const int32_t> ids, bool skip_special,
                          tokenizer_internal::ByteRunState* state, bool final) const;
  // Normalizes, pre-tokenizes and BPE-encodes one raw-text section without added tokens.
  // `text_only`: special added tokens are not matched (EncodeText).
  // Stops once `out` holds more than `max_tokens` ids.
  void EncodeSection(std::string_view raw, bool text_only, size_t max_tokens,
                     std::vector<int32_t>* out) const;
  std::vector<int32_t> EncodeImpl(std::string_view text, bool add_bos, bool text_only,
                                  size_t max_tokens) const;

  std::shared_ptr<const tokenizer_internal::TokenizerData> data_;
};

// Incremental detokenizer for streaming: fed token ids in chunks (e.g. one committed canvas at
// a time), returns the text each chunk completes. A multi-byte UTF-8 character whose
// byte-fallback tokens straddle chunks is held back until it is complete, so no chunk ever ends
// inside a character. For valid UTF-8 output the concatenation of all returned strings equals
// Tokenizer::Decode of all ids. (Only for invalid byte sequences can the U+FFFD count differ:
// bytes already emitted as a valid prefix are not turned into U+FFFD afterwards.)
class StreamDecoder {
 public:
  // Decodes with `tokenizer` (shared, kept alive by this object).
  explicit StreamDecoder(Tokenizer tokenizer, bool skip_special = true);
  ~StreamDecoder();
  StreamDecoder(StreamDecoder&&) noexcept;
  StreamDecoder& operator=(StreamDecoder&&) noexcept;

  // Decodes the next chunk; returns the newly completed text (possibly empty).
  std::string Push(std::span<const int32_t> ids);
  // Ends the stream: returns held bytes, each as U+FFFD (they never completed a character), and
  // resets the decoder for a new stream.
  std::string Finish();
  // Number of bytes currently held back (an incomplete trailing character).
  size_t held_bytes() const;

 private:
  Tokenizer tokenizer_;
  bool skip_special_;
  std::unique_ptr<tokenizer_internal::ByteRunState> state_;
};

}  // namespace dgserve
