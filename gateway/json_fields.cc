#include "gateway/json_fields.h"

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/utf8.h"

// CheckedDocumentBuilder hands events to nlohmann::detail::json_sax_dom_parser<json>, an
// internal class whose template parameters changed in nlohmann 3.12; this is the 3.11 form
// (Debian 12 ships 3.11.2).
#if NLOHMANN_JSON_VERSION_MAJOR != 3 || NLOHMANN_JSON_VERSION_MINOR != 11
#error "gateway/json_fields.cc is written against nlohmann::json 3.11 (json_sax_dom_parser<json>)"
#endif

namespace dgserve::json_fields {
namespace {

using json = nlohmann::json;

// The value types a SAX handler of json::sax_parse names.
struct JsonSaxTypes {
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;
};

// A SAX pass that finds the first key repeated within one JSON object (RFC 8259 §4: names SHOULD
// be unique). nlohmann::json keeps the last of them, so {"max_tokens": 2, "max_tokens": -5} and the
// reverse order were different requests, and a proxy or client library that reads the first value
// saw another request than the one served. One key set per open object: linear in the body
// (a parser callback would do it too, but nlohmann's callback parser rescans the parent container
// at every object's end, which is quadratic in the number of objects).
class DuplicateKeyFinder : public JsonSaxTypes {
 public:
  // The repeated key's path, e.g. "messages[0].role", once found.
  const std::optional<std::string>& duplicate() const { return duplicate_; }
  // The path of the value that opened one level too many, once found.
  const std::optional<std::string>& too_deep() const { return too_deep_; }

  bool null() { return Value(); }
  bool boolean(bool) { return Value(); }
  bool number_integer(number_integer_t) { return Value(); }
  bool number_unsigned(number_unsigned_t) { return Value(); }
  bool number_float(number_float_t, const string_t&) { return Value(); }
  bool string(string_t&) { return Value(); }
  bool binary(binary_t&) { return Value(); }
  bool start_object(std::size_t) {
    Value();
    if (TooDeep()) return false;
    frames_.emplace_back().object = true;
    return true;
  }
  bool key(string_t& k) {
    Frame& f = frames_.back();
    if (!f.keys.insert(k).second) {
      const std::string path = Path();
      duplicate_ = absl::StrCat(path, path.empty() ? "" : ".", k);
      return false;  // stop: the request is refused
    }
    f.key = k;
    return true;
  }
  bool end_object() {
    frames_.pop_back();
    return true;
  }
  bool start_array(std::size_t) {
    Value();
    if (TooDeep()) return false;
    frames_.emplace_back().object = false;
    return true;
  }
  bool end_array() {
    frames_.pop_back();
    return true;
  }
  // The path of the value being read, e.g. "messages[0].content" or "prompt[3]" (for an error
  // in a value: the innermost open container's current key, or its next element).
  std::string ValuePath() const {
    std::string path;
    for (size_t i = 0; i < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      if (f.object) {
        absl::StrAppend(&path, path.empty() ? "" : ".", f.key);
      } else {
        absl::StrAppend(&path, "[", f.index + (i + 1 == frames_.size() ? 1 : 0), "]");
      }
    }
    return path;
  }

 private:
  struct Frame {
    bool object = false;
    absl::flat_hash_set<std::string> keys;  // an object's keys so far
    std::string key;                        // an object's current key
    int64_t index = -1;                     // an array's current element
  };

  // A new array or object would be nesting level kMaxJsonDepth + 1: stop (the path includes the
  // innermost open container's current key or index).
  bool TooDeep() {
    if (frames_.size() < size_t(kMaxJsonDepth)) return false;
    frames_.emplace_back();  // so that Path() covers the innermost open container
    too_deep_ = Path();
    return true;
  }

  // A value starts: in an array, the next element.
  bool Value() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
    return true;
  }

  // The path of the innermost open object, e.g. "messages[0]" ("" at the top level).
  std::string Path() const {
    std::string path;
    for (size_t i = 0; i + 1 < frames_.size(); ++i) {
      const Frame& f = frames_[i];
      if (f.object) {
        absl::StrAppend(&path, path.empty() ? "" : ".", f.key);
      } else {
        absl::StrAppend(&path, "[", f.index, "]");
      }
    }
    return path;
  }

  std::vector<Frame> frames_;
  std::optional<std::string> duplicate_;
  std::optional<std::string> too_deep_;
};

// One pass over the body: each event is checked (DuplicateKeyFinder) and, unless it stops the
// parse, handed to nlohmann's own document builder. (Two passes, a check then json::parse,
// cost twice the parsing.) Errors are kept, not thrown.
class CheckedDocumentBuilder : public JsonSaxTypes {
 public:
  explicit CheckedDocumentBuilder(json* out) : dom_(*out, /*allow_exceptions=*/false) {}

  const DuplicateKeyFinder& checks() const { return checks_; }
  // The syntax error or number overflow that stopped the parse, once found.
  const std::optional<absl::Status>& error() const { return error_; }

  bool null() { return checks_.null() && dom_.null(); }
  bool boolean(bool v) { return checks_.boolean(v) && dom_.boolean(v); }
  bool number_integer(number_integer_t v) {
    return checks_.number_integer(v) && dom_.number_integer(v);
  }
  bool number_unsigned(number_unsigned_t v) {
    return checks_.number_unsigned(v) && dom_.number_unsigned(v);
  }
  bool number_float(number_float_t v, const string_t& s) {
    return checks_.number_float(v, s) && dom_.number_float(v, s);
  }
  bool string(string_t& v) { return checks_.string(v) && dom_.string(v); }
  bool binary(binary_t& v) { return checks_.binary(v) && dom_.binary(v); }
  bool start_object(std::size_t n) { return checks_.start_object(n) && dom_.start_object(n); }
  bool key(string_t& k) { return checks_.key(k) && dom_.key(k); }
  bool end_object() { return checks_.end_object() && dom_.end_object(); }
  bool start_array(std::size_t n) { return checks_.start_array(n) && dom_.start_array(n); }
  bool end_array() { return checks_.end_array() && dom_.end_array(); }
  template <class Exception>
  bool parse_error(std::size_t, const std::string& token, const Exception& e) {
    if (e.id == 406) {
      // A number beyond a double (1e400): named by its field, as other bad values are.
      const std::string path = checks_.ValuePath();
      error_ = Invalid(path.empty() ? "request body" : path,
                       absl::StrCat("number ", token.substr(0, 64),
                                    token.size() > 64 ? "…" : "", " is beyond a double"));
    } else {
      error_ = absl::InvalidArgumentError(absl::StrCat("malformed JSON: ", e.what()));
    }
    return false;
  }

 private:
  DuplicateKeyFinder checks_;
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::optional<absl::Status> error_;
};

}  // namespace

absl::Status ParseJsonObject(std::string_view body, json* out) {
  if (!tokenizer_internal::IsValidUtf8(body)) {
    // nlohmann::json accepts other bytes inside strings and only fails when the value is
    // serialized again, deep inside the request.
    return absl::InvalidArgumentError(
        absl::StrCat("request body is not valid UTF-8 (first bad byte at offset ",
                     tokenizer_internal::ValidUtf8PrefixLength(body), ")"));
  }
  *out = json();
  CheckedDocumentBuilder builder(out);
  // Stops at the first duplicate, level too deep, or error.
  const bool whole = json::sax_parse(body.begin(), body.end(), &builder);
  const DuplicateKeyFinder& finder = builder.checks();
  if (finder.duplicate()) {
    return Invalid(*finder.duplicate(),
                   "appears more than once in its JSON object (keys must be unique)");
  }
  if (finder.too_deep()) {
    absl::Status s = absl::InvalidArgumentError(
        absl::StrCat("request body: arrays and objects nested deeper than ", kMaxJsonDepth,
                     " levels (at ", *finder.too_deep(), ")"));
    // Named as the field where the level too many opened (its param), as other errors are.
    s.SetPayload(std::string(kFieldPayload), absl::Cord(*finder.too_deep()));
    return s;
  }
  if (builder.error()) return *builder.error();
  if (!whole) return absl::InternalError("request body: the JSON parse stopped for no reason given");
  if (!out->is_object()) return absl::InvalidArgumentError("request body must be a JSON object");
  return absl::OkStatus();
}

namespace {
absl::Status WithField(absl::Status status, std::string_view field) {
  status.SetPayload(std::string(kFieldPayload), absl::Cord(std::string(field)));
  return status;
}
}  // namespace

absl::Status Invalid(std::string_view field, std::string_view what) {
  return WithField(
      absl::InvalidArgumentError(absl::StrCat(std::string(field), ": ", std::string(what))),
      field);
}

absl::Status Unsupported(std::string_view field, std::string_view hint) {
  std::string msg = absl::StrCat("unsupported field: ", std::string(field));
  if (!hint.empty()) absl::StrAppend(&msg, " (", std::string(hint), ")");
  return WithField(absl::InvalidArgumentError(msg), field);
}

std::string FieldOf(const absl::Status& status) {
  const auto field = status.GetPayload(std::string(kFieldPayload));
  return field ? std::string(*field) : std::string();
}

absl::Status OutOfRange(const json& v, std::string_view field, std::string_view range) {
  return Invalid(field, absl::StrCat("must be ", std::string(range), " (got ", v.dump(), ")"));
}

WholeNumber ReadWhole(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    if (u > uint64_t(std::numeric_limits<int64_t>::max())) return {WholeNumber::kAboveInt64};
    return {WholeNumber::kValue, int64_t(u)};
  }
  if (v.is_number_integer()) return {WholeNumber::kValue, v.get<int64_t>()};
  if (!v.is_number_float()) return {};
  const double d = v.get<double>();  // finite: the parser refuses 1e400
  if (!std::isfinite(d) || d != std::trunc(d)) return {};
  if (d >= 0x1p63) return {WholeNumber::kAboveInt64};
  if (d < -0x1p63) return {WholeNumber::kBelowInt64};
  return {WholeNumber::kValue, int64_t(d)};
}

absl::StatusOr<int64_t> GetIntIn(const json& v, std::string_view field, int64_t lo, int64_t hi,
                                 std::string_view range) {
  const WholeNumber w = ReadWhole(v);
  if (w.kind == WholeNumber::kNotWhole) return Invalid(field, "must be an integer");
  if (w.kind != WholeNumber::kValue || w.value < lo || w.value > hi) {
    return OutOfRange(v, field, range);
  }
  return w.value;
}

absl::StatusOr<int32_t> GetInt32(const json& v, std::string_view field) {
  absl::StatusOr<int64_t> i =
      GetIntIn(v, field, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max(),
               "an integer in [-2^31, 2^31)");
  if (!i.ok()) return i.status();
  return int32_t(*i);
}

absl::StatusOr<uint64_t> GetUint64(const json& v, std::string_view field) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  const WholeNumber w = ReadWhole(v);
  if (w.kind == WholeNumber::kNotWhole) return Invalid(field, "must be an integer");
  if (w.kind == WholeNumber::kValue && w.value >= 0) return uint64_t(w.value);  // -0, 5.0
  if (w.kind == WholeNumber::kAboveInt64 && v.is_number_float() && v.get<double>() < 0x1p64) {
    return uint64_t(v.get<double>());
  }
  return OutOfRange(v, field, "an integer in [0, 2^64)");
}

absl::StatusOr<float> GetFloat(const json& v, std::string_view field) {
  if (!v.is_number()) return Invalid(field, "must be a number");
  const double d = v.get<double>();
  // 2^128 - 2^103, half an ulp above FLT_MAX: from there float32 rounds to infinity.
  constexpr double kFloatOverflow = 0x1.ffffffp127;
  if (!std::isfinite(d) || std::fabs(d) >= kFloatOverflow) {
    return OutOfRange(v, field, "a finite float32 (magnitude at most FLT_MAX, 3.4028235e38)");
  }
  if (d != 0.0 && static_cast<float>(d) == 0.0f) {  // it would reach the sampler as 0
    return Invalid(field, absl::StrCat(v.dump(), " rounds to 0 in float32; give 0 or a magnitude "
                                                 "of about 1e-45 or more"));
  }
  return static_cast<float>(d);
}

absl::StatusOr<bool> GetBool(const json& v, std::string_view field) {
  if (!v.is_boolean()) return Invalid(field, "must be a boolean");
  return v.get<bool>();
}

absl::StatusOr<std::string> GetString(const json& v, std::string_view field) {
  if (!v.is_string()) return Invalid(field, "must be a string");
  return v.get<std::string>();
}

}  // namespace dgserve::json_fields
