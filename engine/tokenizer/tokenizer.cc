#include "engine/tokenizer/tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/tokenizer/tokenizer_data.h"
#include "engine/tokenizer/utf8.h"

namespace dgserve {
namespace {

using tokenizer_internal::AddedToken;
using tokenizer_internal::AddedTokenMatcher;
using tokenizer_internal::ByteRunState;
using tokenizer_internal::DecodeUtf8;
using tokenizer_internal::IsUnicodeWhitespace;
using tokenizer_internal::IsWordChar;
using tokenizer_internal::TokenizerData;

// The last character of `s` (0 if none or invalid).
char32_t LastChar(std::string_view s) {
  size_t start = s.size();
  while (start > 0) {
    --start;
    if ((static_cast<uint8_t>(s[start]) & 0xC0) != 0x80) break;
  }
  char32_t cp = 0;
  return DecodeUtf8(s, start, &cp) == s.size() - start ? cp : 0;
}

// HF AddedVocabulary::find_matches + split: calls on_text(section) for text between added
// tokens and on_token(id) for each added token, in order. Honors single_word, lstrip, rstrip.
template <typename OnText, typename OnToken>
void SplitOnAddedTokens(const AddedTokenMatcher& matcher, const std::vector<AddedToken>& tokens,
                        std::string_view text, OnText on_text, OnToken on_token) {
  if (matcher.empty()) {
    on_text(text);
    return;
  }
  std::vector<AddedTokenMatcher::Match> matches;
  matcher.FindAll(text, &matches);
  size_t start_offset = 0;
  for (const AddedTokenMatcher::Match& m : matches) {
    const AddedToken& token = tokens[m.index];
    size_t start = m.begin;
    size_t stop = m.end;
    if (token.single_word) {
      const bool start_space = start == 0 || !IsWordChar(LastChar(text.substr(0, start)));
      char32_t next = 0;
      const bool stop_space =
          stop == text.size() || DecodeUtf8(text, stop, &next) == 0 || !IsWordChar(next);
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        const char32_t cp = LastChar(text.substr(0, new_start));
        if (!IsUnicodeWhitespace(cp)) break;
        size_t len = 1;
        while (len < new_start && (static_cast<uint8_t>(text[new_start - len]) & 0xC0) == 0x80) {
          ++len;
        }
        new_start -= len;
      }
      start = std::max(new_start, start_offset);
    }
    if (token.rstrip) {
      char32_t cp;
      while (stop < text.size()) {
        const size_t len = DecodeUtf8(text, stop, &cp);
        if (len == 0 || !IsUnicodeWhitespace(cp)) break;
        stop += len;
      }
    }
    if (start_offset < start) on_text(text.substr(start_offset, start - start_offset));
    on_token(token.id);
    start_offset = stop;
  }
  if (start_offset < text.size()) on_text(text.substr(start_offset));
}

}  // namespace

absl::StatusOr<Tokenizer> Tokenizer::Load(const std::string& tokenizer_json_path) {
  std::error_code ec;
  if (std::filesystem::exists(tokenizer_json_path, ec) &&
      !std::filesystem::is_regular_file(tokenizer_json_path, ec)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokenizer.json '%s' is not a regular file", tokenizer_json_path));
  }
  std::ifstream file(tokenizer_json_path, std::ios::binary);
  if (!file) {
    const int err = errno;
    return absl::NotFoundError(absl::StrFormat("tokenizer.json '%s' cannot be opened: %s",
                                               tokenizer_json_path, std::strerror(err)));
  }
  file.seekg(0, std::ios::end);
  const std::streamoff size = file.tellg();
  if (size < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokenizer.json '%s' cannot be read", tokenizer_json_path));
  }
  std::string text(static_cast<size_t>(size), '\0');
  file.seekg(0, std::ios::beg);
  if (!file.read(text.data(), size)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokenizer.json '%s' cannot be read", tokenizer_json_path));
  }
  return FromJson(text, tokenizer_json_path);
}

absl::StatusOr<Tokenizer> Tokenizer::FromJson(std::string_view json_text,
                                              std::string_view source_name) {
  DGSERVE_ASSIGN_OR_RETURN(auto data,
                           tokenizer_internal::ParseTokenizerJson(json_text, source_name));
  return Tokenizer(std::move(data));
}

void Tokenizer::EncodeSection(std::string_view raw, bool text_only, size_t max_tokens,
                              std::vector<int32_t>* out) const {
  const TokenizerData& d = *data_;
  std::string normalized_storage;
  std::string_view normalized = raw;
  if (!d.normalizer.empty()) {
    normalized_storage = d.normalizer.Normalize(raw);
    normalized = normalized_storage;
  }
  std::vector<std::string_view> words;
  SplitOnAddedTokens(
      text_only ? d.text_normalized_matcher : d.normalized_matcher, d.added_tokens, normalized,
      [&](std::string_view section) {
        if (out->size() > max_tokens) return;
        words.clear();
        d.pre_tokenizer.Split(section, &words);
        for (std::string_view word : words) {
          if (out->size() > max_tokens) return;
          d.model.Tokenize(word, out, max_tokens);
        }
      },
      [&](int32_t id) {
        if (out->size() <= max_tokens) out->push_back(id);
      });
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos) const {
  return EncodeImpl(text, add_bos, /*text_only=*/false, SIZE_MAX);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos,
                                       size_t max_tokens) const {
  return EncodeImpl(text, add_bos, /*text_only=*/false, max_tokens);
}

std::vector<int32_t> Tokenizer::EncodeText(std::string_view text, bool add_bos) const {
  return EncodeImpl(text, add_bos, /*text_only=*/true, SIZE_MAX);
}

std::vector<int32_t> Tokenizer::EncodeText(std::string_view text, bool add_bos,
                                           size_t max_tokens) const {
  return EncodeImpl(text, add_bos, /*text_only=*/true, max_tokens);
}

std::vector<int32_t> Tokenizer::EncodeImpl(std::string_view text, bool add_bos, bool text_only,
                                           size_t max_tokens) const {
  const TokenizerData& d = *data_;
  std::vector<int32_t> ids;
  ids.reserve(std::min(text.size(), max_tokens) / 3 + 4);
  if (add_bos) ids.insert(ids.end(), d.template_prefix.begin(), d.template_prefix.end());
  SplitOnAddedTokens(
      text_only ? d.text_raw_matcher : d.raw_matcher, d.added_tokens, text,
      [&](std::string_view section) {
        if (ids.size() <= max_tokens) EncodeSection(section, text_only, max_tokens, &ids);
      },
      [&](int32_t id) {
        if (ids.size() <= max_tokens) ids.push_back(id);
      });
  if (ids.size() > max_tokens) return ids;  // over budget: the caller refuses it
  if (add_bos) ids.insert(ids.end(), d.template_suffix.begin(), d.template_suffix.end());
  return ids;
}

std::string Tokenizer::DecodeChunk(std::span<const int32_t> ids, bool skip_special,
                                   ByteRunState* state, bool final) const {
  const TokenizerData& d = *data_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= d.vocab_size) continue;
    const uint8_t flags = d.flags[id];
    if (!(flags & TokenizerData::kHasPiece)) continue;
    if (skip_special && (flags & TokenizerData::kSpecial)) continue;
    tokens.emplace_back(d.pieces[id]);
  }
  return d.decoder.Run(std::move(tokens), state, final);
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special) const {
  ByteRunState state;
  return DecodeChunk(ids, skip_special, &state, /*final=*/true);
}

std::string_view Tokenizer::IdToPiece(int32_t id) const {
  if (id < 0 || id >= data_->vocab_size) return {};
  return data_->pieces[id];
}

std::optional<int32_t> Tokenizer::PieceToId(std::string_view piece) const {
  auto it = data_->added_by_content.find(piece);
  if (it != data_->added_by_content.end()) return it->second;
  return data_->model.vocab().Find(piece);
}

int32_t Tokenizer::vocab_size() const { return data_->vocab_size; }

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < data_->vocab_size && (data_->flags[id] & TokenizerData::kSpecial);
}

StreamDecoder::StreamDecoder(Tokenizer tokenizer, bool skip_special)
    : tokenizer_(std::move(tokenizer)),
      skip_special_(skip_special),
      state_(std::make_unique<ByteRunState>()) {}

StreamDecoder::~StreamDecoder() = default;
StreamDecoder::StreamDecoder(StreamDecoder&&) noexcept = default;
StreamDecoder& StreamDecoder::operator=(StreamDecoder&&) noexcept = default;

std::string StreamDecoder::Push(std::span<const int32_t> ids) {
  return tokenizer_.DecodeChunk(ids, skip_special_, state_.get(), /*final=*/false);
}

std::string StreamDecoder::Finish() {
  std::string out = tokenizer_.DecodeChunk({}, skip_special_, state_.get(), /*final=*/true);
  *state_ = ByteRunState();
  return out;
}

size_t StreamDecoder::held_bytes() const { return state_->pending.size(); }

}  // namespace dgserve
