// Fuzzes the body parser of POST /v1/completions: any bytes give either a request or
// INVALID_ARGUMENT naming a field, never an exception, a crash or another status code.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/tokenizer/utf8.h"
#include "gateway/openai_api.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<dgserve::OpenAiRequest> r = dgserve::ParseCompletionsRequest(body);
  if (!r.ok()) {
    dgserve::fuzz::CheckInvalidArgument(r.status());
    (void)dgserve::ErrorParam(r.status());
    return 0;
  }
  const dgserve::v1::GenerateRequest& req = r->request;
  dgserve::fuzz::Check(r->chat == false, "chat flag");
  dgserve::fuzz::Check(req.max_tokens() >= 0, "negative max_tokens");
  dgserve::fuzz::Check(req.stop_size() <= 4, "more than 4 stop sequences");
  for (const std::string& s : req.stop()) dgserve::fuzz::Check(!s.empty(), "empty stop");
  // Every string that goes on to a proto3 string field and to the JSON of the response must be
  // valid UTF-8.
  dgserve::fuzz::Check(dgserve::tokenizer_internal::IsValidUtf8(r->model), "model not UTF-8");
  dgserve::fuzz::Check(dgserve::tokenizer_internal::IsValidUtf8(req.text()), "text not UTF-8");
  for (const auto& m : req.chat().messages()) {
    dgserve::fuzz::Check(dgserve::tokenizer_internal::IsValidUtf8(m.content()),
                         "message content not UTF-8");
  }
  dgserve::fuzz::Check(!req.text().empty() || req.token_ids().ids_size() > 0,
                       "a request without input");
  std::string wire;
  dgserve::fuzz::Check(req.SerializeToString(&wire), "request does not serialize");
  return 0;
}
