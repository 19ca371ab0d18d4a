// Server-side generation (StepFrame.generate): each sampled token is fed back as the session's
// next DECODE row (an internal step, batched with everything else) until max_tokens answers or
// a finish reason. A unit of its own and pure: it owns a session's GenerationState and says
// what follows a token -- stop, a refusal, or the next row's header -- and whether that token's
// answer is held; the step flow (step_flow.h) admits and queues the row. Checked
// without a model by worker/tests/generation_test.cpp.
#pragma once

#include "worker/session_table.h"

#include <cstdint>
#include <variant>

namespace dgr::worker {

struct StopGenerating {};             // max_tokens answered, or a finish reason (not continued past)
struct GenerationRefused {            // the next row cannot be: the session's stream gets this error
    pb::ResponseHeader header;        // the row's that could not be
    pb::ShardError error;
    bool counted_kv = false;          // counts in rejected_kv
};
struct NextRow {                      // the next DECODE row: `token` at the session's next position
    pb::ResponseHeader header;
    int32_t token = -1;
};
using GenerationStep = std::variant<StopGenerating, GenerationRefused, NextRow>;

class Generation {
public:
    Generation(uint32_t n_vocab, uint32_t max_session_positions)
        : n_vocab_(n_vocab), max_positions_(max_session_positions) {}

    // The frame asks for generation (StepFrame.generate).
    static void start(GenerationState & g, const pb::GenerateParams & p);
    // Whether a token's answer is held to go out with the next ones (tokens_per_answer): a
    // generated token (not the frame's own first one) that more tokens will follow.
    static bool holds_answer(const GenerationState & g, bool internal, bool finished);
    // `token` was answered for the step `last` of `s`: what follows. A stop or a refusal ends
    // the generation (s.gen.active = false).
    GenerationStep after_token(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished) const;

private:
    const uint32_t n_vocab_;
    const uint32_t max_positions_;
};

}  // namespace dgr::worker
