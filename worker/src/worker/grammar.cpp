#include "worker/grammar.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "json-schema-to-grammar.h"
#include "json.h"
#include "llama.h"

namespace dgr::worker {

Grammar::~Grammar() {
    if (smpl_) llama_sampler_free(smpl_);
}

std::unique_ptr<Grammar> Grammar::compile(const llama_vocab * vocab, const std::string & gbnf, std::string * error) {
    if (!vocab) {
        *error = "this Shard has no vocabulary to constrain tokens with";
        return nullptr;
    }
    // llama_sampler_init_grammar logs the parse error and answers nullptr on any failure
    llama_sampler * s = nullptr;
    try {
        s = llama_sampler_init_grammar(vocab, gbnf.c_str(), "root");
    } catch (const std::exception &) {
        s = nullptr;
    }
    if (!s) {
        *error = "the grammar does not compile (GBNF with a root rule named root; left recursion is refused)";
        return nullptr;
    }
    std::unique_ptr<Grammar> g(new Grammar());
    g->vocab_ = vocab;
    g->smpl_ = s;
    llama_token end = llama_vocab_eos(vocab);
    if (end < 0) end = llama_vocab_eot(vocab);
    g->end_ = end >= 0 ? end : 0;
    return g;
}

std::string Grammar::from_json_schema(const std::string & schema, std::string * error) {
    try {
        const common_json j = common_json::parse(schema);
        std::string gbnf = json_schema_to_grammar(j);
        if (gbnf.empty()) *error = "the JSON schema converts to no grammar";
        return gbnf;
    } catch (const std::exception & e) {
        *error = std::string("the JSON schema is not one llama.cpp converts: ") + e.what();
    }
    return {};
}

void Grammar::mask(float * logits, int32_t n_vocab) {
    if (broken_) {
        for (int32_t v = 0; v < n_vocab; ++v) logits[v] = -INFINITY;
        return;
    }
    cur_.resize((size_t) n_vocab);
    for (int32_t v = 0; v < n_vocab; ++v) cur_[(size_t) v] = llama_token_data{v, logits[v], 0.0f};
    llama_token_data_array arr{cur_.data(), cur_.size(), -1, false};
    llama_sampler_apply(smpl_, &arr);
    // the grammar sampler keeps the array's order and size; it only lowers logits to -inf
    for (size_t i = 0; i < arr.size; ++i) logits[arr.data[i].id] = arr.data[i].logit;
}

void Grammar::accept(int32_t token) {
    if (broken_) return;
    try {
        llama_sampler_accept(smpl_, token);
    } catch (const std::exception &) {
        broken_ = true;  // (only a token the mask allowed is accepted; kept safe here)
    }
}

namespace {

// How deep brackets nest in `text`, outside quoted strings (and, for GBNF, character classes).
// The converter and the grammar parser both recurse per level, so the depth is bounded before
// either runs: a deeply nested schema or grammar is refused, never a stack overflow.
size_t nesting(const std::string & text, bool gbnf) {
    size_t depth = 0, most = 0;
    char quote = 0;  // inside "..." (or [...] in GBNF) until this closes it
    for (size_t i = 0; i < text.size(); ++i) {
        const char c = text[i];
        if (quote) {
            if (c == '\\') ++i;
            else if (c == quote) quote = 0;
            continue;
        }
        if (c == '"') quote = '"';
        else if (gbnf && c == '[') quote = ']';
        else if (c == (gbnf ? '(' : '{') || (!gbnf && c == '[')) most = std::max(most, ++depth);
        else if ((c == (gbnf ? ')' : '}') || (!gbnf && c == ']')) && depth > 0) --depth;
    }
    return most;
}

}  // namespace

std::unique_ptr<TokenConstraint> constraint_for(const llama_vocab * vocab, const std::string & grammar,
                                                const std::string & json_schema, std::string * error,
                                                std::string * field) {
    if (grammar.empty() && json_schema.empty()) return nullptr;
    std::string gbnf = grammar;
    *field = grammar.empty() ? "sampling.json_schema" : "sampling.grammar";
    const size_t depth = nesting(grammar.empty() ? json_schema : grammar, !grammar.empty());
    if (depth > kMaxGrammarNesting) {
        *error = "nests " + std::to_string(depth) + " levels deep, at most " + std::to_string(kMaxGrammarNesting);
        return nullptr;
    }
    if (gbnf.empty()) {
        gbnf = Grammar::from_json_schema(json_schema, error);
        if (gbnf.empty()) return nullptr;
    }
    std::unique_ptr<Grammar> g = Grammar::compile(vocab, gbnf, error);
    if (!g) {
        if (vocab && !json_schema.empty()) *error = "the grammar converted from the JSON schema does not compile";
        return nullptr;
    }
    return g;
}

}  // namespace dgr::worker
