// Constrained sampling at the tail (SamplingParams.grammar / json_schema): llama.cpp's grammar
// sampler at the pin, masking the tokens a GBNF grammar does not allow next. A JSON schema is
// converted to GBNF by llama.cpp's own converter (common/json-schema-to-grammar), the one
// llama-server uses for response_format, so a schema constrains the same way in both.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "llama.h"
#include "worker/sampling.h"

namespace dgr::worker {

class Grammar final : public TokenConstraint {
public:
    ~Grammar() override;
    // The constraint for `gbnf` (root rule "root") over `vocab`; nullptr with `*error` set when
    // the grammar does not compile.
    static std::unique_ptr<Grammar> compile(const llama_vocab * vocab, const std::string & gbnf, std::string * error);
    // GBNF for a JSON schema (JSON text); empty with `*error` set when it is not JSON or the
    // converter refuses it.
    static std::string from_json_schema(const std::string & schema, std::string * error);

    void mask(float * logits, int32_t n_vocab) override;
    void accept(int32_t token) override;
    int32_t end_token() const override { return end_; }

private:
    Grammar() = default;
    const llama_vocab * vocab_ = nullptr;
    llama_sampler * smpl_ = nullptr;
    int32_t end_ = 0;
    bool broken_ = false;  // an accept failed: nothing is allowed from here on
    std::vector<llama_token_data> cur_;
};

// Deepest nesting of brackets a grammar or a JSON schema may have (both are parsed recursively).
constexpr size_t kMaxGrammarNesting = 64;

// The tail's constraint for a SamplingParams: nullptr when it asks for none, or with `*error`
// (naming the field) when its grammar or schema does not compile; `*field` names that field.
std::unique_ptr<TokenConstraint> constraint_for(const llama_vocab * vocab, const std::string & grammar,
                                                const std::string & json_schema, std::string * error,
                                                std::string * field);

}  // namespace dgr::worker
