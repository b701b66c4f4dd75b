// tokenizer.json parsing. The file is read with a SAX handler: model.vocab and model.merges
// (hundreds of thousands of entries for Gemma) go straight into compact tables, everything else
// into a small nlohmann::json DOM that is then interpreted.
#include <algorithm>
#include <limits>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/tokenizer/tokenizer_data.h"
#include "nlohmann/json.hpp"

namespace dgserve::tokenizer_internal {
namespace {

using Json = nlohmann::json;

// SAX handler building a DOM for everything except model.vocab (an object) and model.merges
// (an array), which are stored compactly.
class Handler final : public nlohmann::json_sax<Json> {
 public:
  Json root;
  PieceVocab vocab;
  bool saw_vocab = false;
  std::vector<char> merge_buffer;
  struct MergeRef {
    uint64_t a_offset;
    uint32_t a_length;
    uint64_t b_offset;
    uint32_t b_length;
  };
  std::vector<MergeRef> merges;
  std::string error;  // set when the handler stopped the parse
  // First malformed model.vocab entry; reported only if the model type is supported, so that an
  // unsupported model is named rather than its vocabulary format.
  std::string vocab_error;

  bool null() override { return Value(Json(nullptr)); }
  bool boolean(bool v) override { return Value(Json(v)); }
  bool number_integer(number_integer_t v) override {
    if (InVocab()) return AddVocab(v);
    return Value(Json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (InVocab()) {
      return AddVocab(v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())
                          ? std::numeric_limits<int64_t>::max()
                          : static_cast<int64_t>(v));
    }
    return Value(Json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return Value(Json(v)); }
  bool string(string_t& v) override {
    if (!stack_.empty()) {
      Frame& f = stack_.back();
      if (f.kind == Kind::kMerges) return AddMergeString(v);
      if (f.kind == Kind::kMergePair) {
        if (++f.parts > 2) {
          return Fail(absl::StrFormat("model.merges[%d] has more than 2 parts", merges.size()));
        }
        AddMergePart(v, f.parts == 1);
        return true;
      }
    }
    return Value(Json(std::move(v)));
  }
  bool binary(binary_t&) override { return Fail("unexpected binary value"); }
  bool key(string_t& k) override {
    Frame& f = stack_.back();
    if (f.kind == Kind::kVocab) {
      vocab_key_ = std::move(k);
    } else if (f.kind == Kind::kSkip) {
      return true;
    } else {
      f.key = std::move(k);
    }
    return true;
  }
  bool start_object(std::size_t) override {
    if (stack_.empty()) {
      root = Json::object();
      stack_.push_back({Kind::kDom, &root, false, "", 0});
      return true;
    }
    Frame& f = stack_.back();
    if (f.kind == Kind::kVocab || f.kind == Kind::kSkip) {
      if (f.kind == Kind::kVocab) NoteVocabError();
      stack_.push_back({Kind::kSkip, nullptr, false, "", 0});
      return true;
    }
    if (f.kind != Kind::kDom) return Fail(std::string("unexpected object in ") + Where(f));
    if (f.is_model && f.node->is_object() && f.key == "vocab") {
      saw_vocab = true;
      stack_.push_back({Kind::kVocab, nullptr, false, "", 0});
      return true;
    }
    const bool is_model = stack_.size() == 1 && f.key == "model";
    stack_.push_back({Kind::kDom, AddChild(f, Json::object()), is_model, "", 0});
    return true;
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (stack_.empty()) {
      root = Json::array();
      stack_.push_back({Kind::kDom, &root, false, "", 0});
      return true;
    }
    Frame& f = stack_.back();
    if (f.kind == Kind::kMerges) {
      stack_.push_back({Kind::kMergePair, nullptr, false, "", 0});
      return true;
    }
    if (f.kind == Kind::kVocab || f.kind == Kind::kSkip) {
      if (f.kind == Kind::kVocab) NoteVocabError();
      stack_.push_back({Kind::kSkip, nullptr, false, "", 0});
      return true;
    }
    if (f.kind != Kind::kDom) return Fail(std::string("unexpected array in ") + Where(f));
    if (f.is_model && f.node->is_object() && f.key == "merges") {
      stack_.push_back({Kind::kMerges, nullptr, false, "", 0});
      return true;
    }
    stack_.push_back({Kind::kDom, AddChild(f, Json::array()), false, "", 0});
    return true;
  }
  bool end_array() override {
    if (stack_.back().kind == Kind::kMergePair) {
      if (stack_.back().parts != 2) {
        return Fail(absl::StrFormat("model.merges[%d] must have 2 parts", merges.size()));
      }
      merges.push_back(pending_merge_);
    }
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    if (error.empty()) error = ex.what();
    return false;
  }

 private:
  enum class Kind { kDom, kVocab, kMerges, kMergePair, kSkip };
  struct Frame {
    Kind kind;
    Json* node;     // kDom: the container being filled
    bool is_model;  // kDom: this is the root's "model" object
    std::string key;
    int parts;  // kMergePair: strings seen
  };

  static const char* Where(const Frame&) { return "model.merges"; }
  bool InVocab() const { return !stack_.empty() && stack_.back().kind == Kind::kVocab; }
  void NoteVocabError() {
    if (vocab_error.empty()) {
      vocab_error = absl::StrFormat("model.vocab['%s'] is not an integer id", vocab_key_);
    }
  }
  bool Fail(std::string message) {
    error = std::move(message);
    return false;
  }
  bool AddVocab(int64_t id) {
    vocab.Add(vocab_key_, id);
    return true;
  }
  Json* AddChild(Frame& f, Json value) {
    if (f.node->is_object()) return &((*f.node)[f.key] = std::move(value));
    f.node->push_back(std::move(value));
    return &f.node->back();
  }
  bool Value(Json value) {
    if (stack_.empty()) {
      root = std::move(value);
      return true;
    }
    Frame& f = stack_.back();
    switch (f.kind) {
      case Kind::kDom:
        AddChild(f, std::move(value));
        return true;
      case Kind::kVocab:
        NoteVocabError();
        return true;
      case Kind::kSkip:
        return true;
      case Kind::kMerges:
      case Kind::kMergePair:
        return Fail(absl::StrFormat(
            "model.merges[%d] must be a [\"a\", \"b\"] pair or an \"a b\" string", merges.size()));
    }
    return true;
  }
  void AddMergePart(std::string_view part, bool first) {
    const uint64_t offset = merge_buffer.size();
    merge_buffer.insert(merge_buffer.end(), part.begin(), part.end());
    if (first) {
      pending_merge_.a_offset = offset;
      pending_merge_.a_length = static_cast<uint32_t>(part.size());
    } else {
      pending_merge_.b_offset = offset;
      pending_merge_.b_length = static_cast<uint32_t>(part.size());
    }
  }
  bool AddMergeString(std::string_view s) {
    const size_t space = s.find(' ');
    if (space == std::string_view::npos || s.find(' ', space + 1) != std::string_view::npos) {
      return Fail(
          absl::StrFormat("model.merges[%d] ('%s') is not of the form \"a b\"", merges.size(), s));
    }
    AddMergePart(s.substr(0, space), true);
    AddMergePart(s.substr(space + 1), false);
    merges.push_back(pending_merge_);
    return true;
  }

  std::vector<Frame> stack_;
  std::string vocab_key_;
  MergeRef pending_merge_{};
};

// Reads tokenizer.json fields with error messages that name the file.
class Interpreter {
 public:
  explicit Interpreter(std::string_view source) : source_(source) {}

  absl::Status Error(std::string_view message) const {
    return absl::InvalidArgumentError(absl::StrFormat("tokenizer.json '%s': %s", source_, message));
  }
  absl::Status Unsupported(std::string_view what, std::string_view type,
                           std::string_view supported) const {
    return Error(
        absl::StrFormat("unsupported %s type '%s' (supported: %s)", what, type, supported));
  }

  // `j[key]` as a string; INVALID_ARGUMENT when missing or not a string.
  absl::StatusOr<std::string> String(const Json& j, std::string_view key,
                                     std::string_view where) const {
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) {
      return Error(absl::StrFormat("%s: '%s' must be a string", where, key));
    }
    return it->get<std::string>();
  }
  // `j[key]` as a bool, `fallback` when missing or null.
  absl::StatusOr<bool> Bool(const Json& j, std::string_view key, bool fallback,
                            std::string_view where) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) return Error(absl::StrFormat("%s: '%s' must be a boolean", where, key));
    return it->get<bool>();
  }
  // `j[key]` as an int, `fallback` when missing or null.
  absl::StatusOr<int64_t> Int(const Json& j, std::string_view key, std::optional<int64_t> fallback,
                              std::string_view where) const {
    auto it = j.find(key);
    if ((it == j.end() || it->is_null()) && fallback.has_value()) return *fallback;
    if (it == j.end() || !it->is_number_integer()) {
      return Error(absl::StrFormat("%s: '%s' must be an integer", where, key));
    }
    return it->get<int64_t>();
  }
  // The "type" of a component object.
  absl::StatusOr<std::string> Type(const Json& j, std::string_view where) const {
    if (!j.is_object()) return Error(absl::StrFormat("%s must be an object or null", where));
    return String(j, "type", where);
  }
  // A {"String": "..."} pattern; Regex patterns are rejected.
  absl::StatusOr<std::string> LiteralPattern(const Json& j, std::string_view where) const {
    auto it = j.find("pattern");
    if (it == j.end() || !it->is_object()) {
      return Error(absl::StrFormat("%s: 'pattern' must be an object", where));
    }
    if (it->contains("Regex")) {
      return Error(absl::StrFormat("%s: Regex patterns are not supported (only String)", where));
    }
    DGSERVE_ASSIGN_OR_RETURN(std::string pattern, String(*it, "String", where));
    if (pattern.empty()) return Error(absl::StrFormat("%s: empty String pattern", where));
    return pattern;
  }

  absl::Status Normalizer(const Json& j, tokenizer_internal::Normalizer* out) const {
    if (j.is_null()) return absl::OkStatus();
    DGSERVE_ASSIGN_OR_RETURN(std::string type, Type(j, "normalizer"));
    if (type == "Sequence") {
      auto it = j.find("normalizers");
      if (it == j.end() || !it->is_array()) return Error("normalizer Sequence: no 'normalizers'");
      for (const Json& child : *it) DGSERVE_RETURN_IF_ERROR(Normalizer(child, out));
    } else if (type == "Replace") {
      NormalizerStep step{NormalizerStep::Kind::kReplace, "", ""};
      DGSERVE_ASSIGN_OR_RETURN(step.pattern, LiteralPattern(j, "Replace normalizer"));
      DGSERVE_ASSIGN_OR_RETURN(step.content, String(j, "content", "Replace normalizer"));
      out->AddStep(std::move(step));
    } else if (type == "Prepend") {
      NormalizerStep step{NormalizerStep::Kind::kPrepend, "", ""};
      DGSERVE_ASSIGN_OR_RETURN(step.content, String(j, "prepend", "Prepend normalizer"));
      out->AddStep(std::move(step));
    } else {
      return Unsupported("normalizer", type, "Replace, Prepend, Sequence");
    }
    return absl::OkStatus();
  }

  absl::Status PreTokenizer(const Json& j, tokenizer_internal::PreTokenizer* out) const {
    if (j.is_null()) return absl::OkStatus();
    DGSERVE_ASSIGN_OR_RETURN(std::string type, Type(j, "pre_tokenizer"));
    if (type == "Sequence") {
      auto it = j.find("pretokenizers");
      if (it == j.end() || !it->is_array()) {
        return Error("pre_tokenizer Sequence: no 'pretokenizers'");
      }
      for (const Json& child : *it) DGSERVE_RETURN_IF_ERROR(PreTokenizer(child, out));
    } else if (type == "Split") {
      SplitStep step;
      DGSERVE_ASSIGN_OR_RETURN(step.pattern, LiteralPattern(j, "Split pre_tokenizer"));
      DGSERVE_ASSIGN_OR_RETURN(std::string behavior, String(j, "behavior", "Split pre_tokenizer"));
      static constexpr std::pair<std::string_view, SplitBehavior> kBehaviors[] = {
          {"Removed", SplitBehavior::kRemoved},
          {"Isolated", SplitBehavior::kIsolated},
          {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
          {"MergedWithNext", SplitBehavior::kMergedWithNext},
          {"Contiguous", SplitBehavior::kContiguous}};
      auto found = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                [&](const auto& b) { return b.first == behavior; });
      if (found == std::end(kBehaviors)) {
        return Error(absl::StrFormat("Split pre_tokenizer: unknown behavior '%s'", behavior));
      }
      step.behavior = found->second;
      DGSERVE_ASSIGN_OR_RETURN(step.invert, Bool(j, "invert", false, "Split pre_tokenizer"));
      out->AddStep(std::move(step));
    } else {
      return Unsupported("pre_tokenizer", type, "Split with a String pattern, Sequence");
    }
    return absl::OkStatus();
  }

  absl::Status Decoder(const Json& j, tokenizer_internal::Decoder* out) const {
    if (j.is_null()) return absl::OkStatus();
    DGSERVE_ASSIGN_OR_RETURN(std::string type, Type(j, "decoder"));
    if (type == "Sequence") {
      auto it = j.find("decoders");
      if (it == j.end() || !it->is_array()) return Error("decoder Sequence: no 'decoders'");
      for (const Json& child : *it) DGSERVE_RETURN_IF_ERROR(Decoder(child, out));
    } else if (type == "Replace") {
      DecoderStep step;
      step.kind = DecoderStep::Kind::kReplace;
      DGSERVE_ASSIGN_OR_RETURN(step.pattern, LiteralPattern(j, "Replace decoder"));
      DGSERVE_ASSIGN_OR_RETURN(step.content, String(j, "content", "Replace decoder"));
      out->AddStep(std::move(step));
    } else if (type == "ByteFallback") {
      DecoderStep step;
      step.kind = DecoderStep::Kind::kByteFallback;
      out->AddStep(std::move(step));
    } else if (type == "Fuse") {
      DecoderStep step;
      step.kind = DecoderStep::Kind::kFuse;
      out->AddStep(std::move(step));
    } else if (type == "Strip") {
      DecoderStep step;
      step.kind = DecoderStep::Kind::kStrip;
      DGSERVE_ASSIGN_OR_RETURN(step.content, String(j, "content", "Strip decoder"));
      DGSERVE_ASSIGN_OR_RETURN(int64_t start, Int(j, "start", 0, "Strip decoder"));
      DGSERVE_ASSIGN_OR_RETURN(int64_t stop, Int(j, "stop", 0, "Strip decoder"));
      step.start = static_cast<int>(std::clamp<int64_t>(start, 0, 1 << 20));
      step.stop = static_cast<int>(std::clamp<int64_t>(stop, 0, 1 << 20));
      out->AddStep(std::move(step));
    } else {
      return Unsupported("decoder", type, "Replace, ByteFallback, Fuse, Strip, Sequence");
    }
    return absl::OkStatus();
  }

  absl::Status PostProcessor(const Json& j, TokenizerData* data) const {
    if (j.is_null()) return absl::OkStatus();
    DGSERVE_ASSIGN_OR_RETURN(std::string type, Type(j, "post_processor"));
    if (type != "TemplateProcessing") {
      return Unsupported("post_processor", type, "TemplateProcessing");
    }
    auto single = j.find("single");
    auto specials = j.find("special_tokens");
    if (single == j.end() || !single->is_array()) {
      return Error("TemplateProcessing: 'single' must be an array");
    }
    if (specials != j.end() && !specials->is_null() && !specials->is_object()) {
      return Error("post_processor.special_tokens must be an object");
    }
    bool seen_sequence = false;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& item = (*single)[i];
      const std::string where = absl::StrFormat("post_processor.single[%d]", i);
      if (!item.is_object()) return Error(where + " must be an object");
      if (item.contains("Sequence")) {
        if (seen_sequence) return Error("TemplateProcessing: 'single' has two sequences");
        seen_sequence = true;
        continue;
      }
      auto special = item.find("SpecialToken");
      if (special == item.end() || !special->is_object()) {
        return Error(where + ": items must be SpecialToken or Sequence objects");
      }
      DGSERVE_ASSIGN_OR_RETURN(std::string name, String(*special, "id", where + ".SpecialToken"));
      const auto token = specials == j.end() || !specials->is_object() ? Json::const_iterator()
                                                                        : specials->find(name);
      if (specials == j.end() || !specials->is_object() || token == specials->end()) {
        return Error(absl::StrFormat("TemplateProcessing: special token '%s' not defined", name));
      }
      const std::string field = absl::StrFormat("post_processor.special_tokens['%s']", name);
      if (!token->is_object()) return Error(field + " must be an object");
      auto ids = token->find("ids");
      if (ids == token->end() || !ids->is_array()) {
        return Error(absl::StrFormat("%s: 'ids' must be an array (TemplateProcessing '%s')",
                                     field, name));
      }
      for (const Json& id : *ids) {
        // Non-negative integers are stored unsigned; anything else is not an id.
        if (!id.is_number_unsigned() ||
            id.get<uint64_t>() >= uint64_t(std::numeric_limits<int32_t>::max())) {
          return Error(absl::StrFormat("%s.ids: bad id %s (an integer in [0, 2^31-1))", field,
                                       id.dump(-1, ' ', false, Json::error_handler_t::replace)));
        }
        (seen_sequence ? data->template_suffix : data->template_prefix)
            .push_back(static_cast<int32_t>(id.get<uint64_t>()));
      }
    }
    if (!seen_sequence) return Error("TemplateProcessing: 'single' has no Sequence");
    return absl::OkStatus();
  }

  absl::Status AddedTokens(const Json& j, TokenizerData* data) const {
    if (j.is_null()) return absl::OkStatus();
    if (!j.is_array()) return Error("'added_tokens' must be an array");
    for (size_t i = 0; i < j.size(); ++i) {
      const Json& t = j[i];
      const std::string where = absl::StrFormat("added_tokens[%d]", i);
      if (!t.is_object()) return Error(where + " must be an object");
      AddedToken token;
      DGSERVE_ASSIGN_OR_RETURN(int64_t id, Int(t, "id", std::nullopt, where));
      if (id < 0 || id >= std::numeric_limits<int32_t>::max()) {
        return Error(absl::StrFormat("%s: id %d out of range", where, id));
      }
      token.id = static_cast<int32_t>(id);
      DGSERVE_ASSIGN_OR_RETURN(token.content, String(t, "content", where));
      if (token.content.empty()) return Error(where + ": empty content");
      DGSERVE_ASSIGN_OR_RETURN(token.special, Bool(t, "special", false, where));
      DGSERVE_ASSIGN_OR_RETURN(token.normalized, Bool(t, "normalized", !token.special, where));
      DGSERVE_ASSIGN_OR_RETURN(token.lstrip, Bool(t, "lstrip", false, where));
      DGSERVE_ASSIGN_OR_RETURN(token.rstrip, Bool(t, "rstrip", false, where));
      DGSERVE_ASSIGN_OR_RETURN(token.single_word, Bool(t, "single_word", false, where));
      data->added_tokens.push_back(std::move(token));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<BpeOptions> ModelOptions(const Json& model) const {
    auto type_it = model.find("type");
    const std::string type =
        type_it != model.end() && type_it->is_string() ? type_it->get<std::string>() : "";
    if (type != "BPE") {
      return Unsupported("model", type.empty() ? "(none)" : type, "BPE");
    }
    auto dropout = model.find("dropout");
    if (dropout != model.end() && !dropout->is_null() &&
        !(dropout->is_number() && dropout->get<double>() == 0.0)) {
      return Error("BPE dropout is not supported");
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto it = model.find(key);
      if (it != model.end() && !it->is_null() &&
          !(it->is_string() && it->get<std::string>().empty())) {
        return Error(absl::StrFormat("BPE '%s' is not supported", key));
      }
    }
    BpeOptions options;
    auto unk = model.find("unk_token");
    if (unk != model.end() && !unk->is_null()) {
      if (!unk->is_string()) return Error("model: 'unk_token' must be a string or null");
      options.unk_token = unk->get<std::string>();
    }
    DGSERVE_ASSIGN_OR_RETURN(options.fuse_unk, Bool(model, "fuse_unk", false, "model"));
    DGSERVE_ASSIGN_OR_RETURN(options.byte_fallback, Bool(model, "byte_fallback", false, "model"));
    DGSERVE_ASSIGN_OR_RETURN(options.ignore_merges, Bool(model, "ignore_merges", false, "model"));
    return options;
  }

 private:
  std::string source_;
};

const Json& Member(const Json& j, std::string_view key) {
  static const Json kNull;
  auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

}  // namespace

static absl::StatusOr<std::shared_ptr<const TokenizerData>> ParseTokenizerJsonUnguarded(
    std::string_view json_text, std::string_view source) {
  const Interpreter in(source);
  Handler handler;
  const bool ok = Json::sax_parse(json_text.begin(), json_text.end(), &handler);
  if (!ok || !handler.error.empty()) {
    return in.Error(handler.error.empty() ? "malformed JSON" : handler.error);
  }
  const Json& root = handler.root;
  if (!root.is_object()) return in.Error("the top level is not a JSON object");
  const Json& model = Member(root, "model");
  if (!model.is_object()) return in.Error("no 'model' object");
  DGSERVE_ASSIGN_OR_RETURN(BpeOptions options, in.ModelOptions(model));
  if (!handler.saw_vocab) return in.Error("model.vocab is missing or not an object");
  if (!handler.vocab_error.empty()) return in.Error(handler.vocab_error);
  if (model.contains("merges") && !model["merges"].is_null()) {
    return in.Error("model.merges must be an array");
  }

  auto data = std::make_shared<TokenizerData>();
  data->source = std::string(source);
  DGSERVE_RETURN_IF_ERROR(in.Normalizer(Member(root, "normalizer"), &data->normalizer));
  DGSERVE_RETURN_IF_ERROR(in.PreTokenizer(Member(root, "pre_tokenizer"), &data->pre_tokenizer));
  DGSERVE_RETURN_IF_ERROR(in.Decoder(Member(root, "decoder"), &data->decoder));
  DGSERVE_RETURN_IF_ERROR(in.PostProcessor(Member(root, "post_processor"), data.get()));
  DGSERVE_RETURN_IF_ERROR(in.AddedTokens(Member(root, "added_tokens"), data.get()));

  // The model.
  absl::Status status = handler.vocab.Finalize("model.vocab");
  if (!status.ok()) return in.Error(std::string(status.message()));
  std::vector<std::pair<std::string_view, std::string_view>> merges;
  merges.reserve(handler.merges.size());
  const char* mb = handler.merge_buffer.data();
  for (const Handler::MergeRef& m : handler.merges) {
    merges.emplace_back(std::string_view(mb + m.a_offset, m.a_length),
                        std::string_view(mb + m.b_offset, m.b_length));
  }
  absl::StatusOr<BpeModel> bpe =
      BpeModel::Create(std::move(handler.vocab), merges, std::move(options));
  if (!bpe.ok()) return in.Error(std::string(bpe.status().message()));
  data->model = *std::move(bpe);

  // Id tables: added tokens override model pieces.
  const PieceVocab& vocab = data->model.vocab();
  int32_t size = vocab.id_limit();
  for (const AddedToken& t : data->added_tokens) size = std::max(size, t.id + 1);
  data->vocab_size = size;
  data->pieces.assign(size, std::string_view());
  data->flags.assign(size, 0);
  for (int32_t id = 0; id < vocab.id_limit(); ++id) {
    if (vocab.Has(id)) {
      data->pieces[id] = vocab.Piece(id);
      data->flags[id] = TokenizerData::kHasPiece;
    }
  }
  for (size_t i = 0; i < data->added_tokens.size(); ++i) {
    const AddedToken& t = data->added_tokens[i];
    data->pieces[t.id] = t.content;
    data->flags[t.id] = TokenizerData::kHasPiece | (t.special ? TokenizerData::kSpecial : 0);
    data->added_by_content[t.content] = t.id;
    if (t.normalized) {
      data->normalized_matcher.Add(data->normalizer.Normalize(t.content), static_cast<int32_t>(i));
      if (!t.special) {
        data->text_normalized_matcher.Add(data->normalizer.Normalize(t.content),
                                          static_cast<int32_t>(i));
      }
    } else {
      data->raw_matcher.Add(t.content, static_cast<int32_t>(i));
      if (!t.special) data->text_raw_matcher.Add(t.content, static_cast<int32_t>(i));
    }
  }
  for (int32_t id : data->template_prefix) {
    if (id >= size) return in.Error(absl::StrFormat("post_processor id %d is out of range", id));
  }
  for (int32_t id : data->template_suffix) {
    if (id >= size) return in.Error(absl::StrFormat("post_processor id %d is out of range", id));
  }
  return std::shared_ptr<const TokenizerData>(std::move(data));
}

// A JSON exception (a value of a type the interpreter did not check) is a malformed file, named
// as every other error is, never an abort.
absl::StatusOr<std::shared_ptr<const TokenizerData>> ParseTokenizerJson(std::string_view json_text,
                                                                        std::string_view source) {
  try {
    return ParseTokenizerJsonUnguarded(json_text, source);
  } catch (const Json::exception& e) {
    return Interpreter(source).Error(absl::StrFormat("malformed: %s", e.what()));
  }
}

}  // namespace dgserve::tokenizer_internal
