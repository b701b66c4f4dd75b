#include "engine/tokenizer/chat_template.h"

#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "common/excerpt.h"
#include "engine/tokenizer/utf8.h"

namespace dgserve {
namespace {

void Append(std::vector<int32_t>* out, const std::vector<int32_t>& ids) {
  out->insert(out->end(), ids.begin(), ids.end());
}

// Appends `<|turn>ROLE\n`.
void OpenTurn(const Tokenizer& tokenizer, std::string_view role, std::vector<int32_t>* out) {
  out->push_back(kGemmaTurnStartId);
  Append(out, tokenizer.Encode(role, /*add_bos=*/false));
  out->push_back(kGemmaNewlineId);
}

// Appends the trimmed content and `<turn|>\n`; the content is encoded within what is left of
// `max_tokens` (`out` may end up longer than max_tokens: the caller checks).
void CloseTurn(const Tokenizer& tokenizer, std::string_view content, size_t max_tokens,
               std::vector<int32_t>* out) {
  if (out->size() > max_tokens) return;
  // Message content is text: control-token strings in it stay text (no forged turns).
  Append(out, tokenizer.EncodeText(tokenizer_internal::TrimPythonWhitespace(content),
                                   /*add_bos=*/false, max_tokens - out->size()));
  out->push_back(kGemmaTurnEndId);
  out->push_back(kGemmaNewlineId);
}

// The template role for a message role, or empty when unknown.
std::string_view TemplateRole(std::string_view role) {
  if (role == "user") return "user";
  if (role == "model" || role == "assistant") return "model";
  if (role == "system" || role == "developer") return "system";
  return {};
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> RenderChat(const Tokenizer& tokenizer,
                                                std::span<const ChatMessage> messages,
                                                const ChatTemplateOptions& options) {
  if (messages.empty()) {
    return absl::InvalidArgumentError("chat template: the message list is empty");
  }
  if (tokenizer.vocab_size() <= kGemmaNewlineId) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "chat template: the tokenizer has %d ids, too few for the Gemma control ids",
        tokenizer.vocab_size()));
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    if (TemplateRole(messages[i].role).empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "chat template: message %d has unknown role %s (expected system, developer, user, "
          "model or assistant)",
          i, QuotedExcerpt(messages[i].role)));
    }
  }

  std::vector<int32_t> ids = {kGemmaBosId};
  size_t first = 0;
  const bool leading_system = TemplateRole(messages[0].role) == "system";
  if (options.enable_thinking || leading_system) {
    OpenTurn(tokenizer, "system", &ids);
    if (options.enable_thinking) {
      ids.push_back(kGemmaThinkId);
      ids.push_back(kGemmaNewlineId);
    }
    CloseTurn(tokenizer, leading_system ? std::string_view(messages[0].content) : "",
              options.max_tokens, &ids);
    if (leading_system) first = 1;
  }
  for (size_t i = first; i < messages.size(); ++i) {
    if (ids.size() > options.max_tokens) return ids;  // over budget: the caller refuses it
    OpenTurn(tokenizer, TemplateRole(messages[i].role), &ids);
    CloseTurn(tokenizer, messages[i].content, options.max_tokens, &ids);
  }
  if (ids.size() > options.max_tokens) return ids;
  if (options.add_generation_prompt) {
    OpenTurn(tokenizer, "model", &ids);
    if (!options.enable_thinking) {
      ids.push_back(kGemmaChannelStartId);
      Append(&ids, tokenizer.Encode("thought", /*add_bos=*/false));
      ids.push_back(kGemmaNewlineId);
      ids.push_back(kGemmaChannelEndId);
    }
  }
  return ids;
}

}  // namespace dgserve
