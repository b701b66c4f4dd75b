// Internal: the loaded tables behind a Tokenizer, and the tokenizer.json parser that builds them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/tokenizer/bpe_model.h"
#include "engine/tokenizer/pipeline.h"

namespace dgserve::tokenizer_internal {

// An entry of tokenizer.json `added_tokens`.
struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool normalized = false;  // matched on normalized text (true) or on the raw text (false)
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
};

// Everything a Tokenizer needs, immutable once built.
struct TokenizerData {
  std::string source;  // file name, for messages
  BpeModel model;
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  Decoder decoder;
  std::vector<AddedToken> added_tokens;
  AddedTokenMatcher raw_matcher;  // added tokens with normalized=false (index into added_tokens)
  AddedTokenMatcher normalized_matcher;  // added tokens with normalized=true, patterns normalized
  // The same two without the special (control) tokens: what EncodeText matches.
  AddedTokenMatcher text_raw_matcher;
  AddedTokenMatcher text_normalized_matcher;
  absl::flat_hash_map<std::string_view, int32_t> added_by_content;  // views into added_tokens
  std::vector<int32_t> template_prefix;  // post-processor ids before the sequence (<bos>)
  std::vector<int32_t> template_suffix;  // and after it
  std::vector<std::string_view> pieces;  // by id: added-token content, else the model piece
  std::vector<uint8_t> flags;            // by id: kHasPiece | kSpecial
  int32_t vocab_size = 0;

  static constexpr uint8_t kHasPiece = 1;
  static constexpr uint8_t kSpecial = 2;
};

// Parses tokenizer.json text into tables; `source` names the file in error messages.
absl::StatusOr<std::shared_ptr<const TokenizerData>> ParseTokenizerJson(std::string_view json_text,
                                                                        std::string_view source);

}  // namespace dgserve::tokenizer_internal
