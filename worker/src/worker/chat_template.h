// The model's own chat template: chat messages -> prompt text (ApplyChatTemplate RPC).
// llama.cpp's template engine (llama_chat_apply_template) formats the messages with the
// template the GGUF carries (tokenizer.chat_template, via llama_model_chat_template).
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace dgr::worker {

struct ChatTurn {
    std::string role;
    std::string content;
};

// Formats `turns` with `tmpl` (a Jinja template source llama.cpp recognises, or a built-in
// template name such as "chatml"). Returns false and sets *error when `tmpl` is empty or
// not recognised.
bool apply_chat_template(const std::string & tmpl, const std::vector<ChatTurn> & turns, bool add_assistant,
                         std::string * out, std::string * error);

}  // namespace dgr::worker
