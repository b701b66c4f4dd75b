// Fuzzes the Gemma 4 chat template renderer (RenderChat) with the real tokenizer. Input: one
// flags byte (bit 0 enable_thinking, bit 1 no generation prompt), then messages separated by
// NUL bytes, each a role byte (system, developer, user, assistant, model, or an unknown role)
// followed by its content. Errors must be INVALID_ARGUMENT; ids must lie inside the vocabulary.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/tokenizer/chat_template.h"
#include "tests/fuzz/tokenizer_fixture.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  (void)dgserve::fuzz::SharedTokenizer();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dgserve::fuzz::Check;
  if (size == 0 || size > 8192) return 0;
  const dgserve::Tokenizer& t = dgserve::fuzz::SharedTokenizer();
  static const char* const kRoles[] = {"system", "developer", "user", "assistant", "model",
                                       "tool", ""};
  dgserve::ChatTemplateOptions options;
  options.enable_thinking = data[0] & 1;
  options.add_generation_prompt = !(data[0] & 2);
  std::vector<dgserve::ChatMessage> messages;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  size_t pos = 0;
  while (pos < rest.size()) {
    size_t end = rest.find('\0', pos);
    if (end == std::string_view::npos) end = rest.size();
    const std::string_view part = rest.substr(pos, end - pos);
    if (!part.empty()) {
      const auto role = static_cast<uint8_t>(part[0]) % (sizeof(kRoles) / sizeof(kRoles[0]));
      messages.push_back({kRoles[role], std::string(part.substr(1))});
    }
    pos = end + 1;
  }
  absl::StatusOr<std::vector<int32_t>> ids = dgserve::RenderChat(t, messages, options);
  if (!ids.ok()) {
    dgserve::fuzz::CheckInvalidArgument(ids.status());
    return 0;
  }
  Check(!ids->empty() && (*ids)[0] == dgserve::kGemmaBosId, "rendering does not start with <bos>");
  for (int32_t id : *ids) Check(id >= 0 && id < t.vocab_size(), "id outside the vocabulary");
  return 0;
}
