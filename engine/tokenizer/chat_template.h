// The Gemma 4 chat template (spec §1.4), rendered natively to token ids rather than through a
// Jinja engine. Gemma 4 control tokens are emitted as ids directly: the Gemma 3 tokenizer.json
// dgserve loads names those ids differently (<unused92>, <start_of_turn>, ...).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace dgserve {

// Gemma 4 control token ids (spec §1.4).
inline constexpr int32_t kGemmaBosId = 2;
inline constexpr int32_t kGemmaThinkId = 98;          // <|think|>
inline constexpr int32_t kGemmaChannelStartId = 100;  // <|channel>
inline constexpr int32_t kGemmaChannelEndId = 101;    // <channel|>
inline constexpr int32_t kGemmaTurnStartId = 105;     // <|turn>
inline constexpr int32_t kGemmaTurnEndId = 106;       // <turn|>
inline constexpr int32_t kGemmaNewlineId = 107;       // "\n"

// One chat message. `role` is "system", "developer" (rendered as system), "user", "model" or
// "assistant" (rendered as model).
struct ChatMessage {
  std::string role;
  std::string content;
};

// Options of the chat template.
struct ChatTemplateOptions {
  // Prepend a system turn starting with <|think|> and leave the thought channel to the model;
  // when false the generation prompt ends with an empty thought channel.
  bool enable_thinking = false;
  // End with the `<|turn>model\n` generation prompt.
  bool add_generation_prompt = true;
  // Token budget: rendering stops as soon as more than this many ids have been produced (see
  // RenderChat).
  size_t max_tokens = SIZE_MAX;
};

// Renders `messages` with the Gemma 4 template:
//   <bos>
//   [<|turn>system\n [<|think|>\n] SYSTEM <turn|>\n]   when thinking or messages[0] is system
//   (<|turn>ROLE\n CONTENT <turn|>\n)*
//   [<|turn>model\n [<|channel>thought\n<channel|>]]   generation prompt; channel if not thinking
// Contents are trimmed of surrounding whitespace (as the template's `| trim`) and encoded with
// tokenizer.Encode(content, /*add_bos=*/false). INVALID_ARGUMENT for an empty message list or an
// unknown role (naming it and its index); FAILED_PRECONDITION when the tokenizer's vocabulary
// is too small to hold the control ids.
// With `options.max_tokens` set, rendering stops as soon as more than that many ids have been
// produced (contents are encoded within the budget left): the result is then a prefix of the
// full rendering with more than max_tokens ids, and callers test `size() > max_tokens`. A huge
// message list thus costs about max_tokens tokens of work, not its whole length.
// Not rendered: tool calls/responses, multimodal parts, and the template's stripping of thought
// channels from earlier model turns (contents are used verbatim).
absl::StatusOr<std::vector<int32_t>> RenderChat(const Tokenizer& tokenizer,
                                                std::span<const ChatMessage> messages,
                                                const ChatTemplateOptions& options = {});

}  // namespace dgserve
