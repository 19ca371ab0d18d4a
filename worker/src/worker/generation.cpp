// Server-side generation (generation.h): what follows a sampled token.
#include "worker/generation.h"

#include "worker/errors.h"

#include <algorithm>
#include <string>

namespace dgr::worker {

void Generation::start(GenerationState & g, const pb::GenerateParams & p) {
    g.active = true;
    g.left = std::max<uint32_t>(1, p.max_tokens());
    g.continue_after_finish = p.continue_after_finish();
    g.per_answer = std::max<uint32_t>(1, p.tokens_per_answer());
}

bool Generation::holds_answer(const GenerationState & g, bool internal, bool finished) {
    return internal && g.active && g.per_answer > 1 && g.left > 1 && !finished;
}

GenerationStep Generation::after_token(Session & s, const pb::ResponseHeader & last, int32_t token,
                                       bool finished) const {
    GenerationState & g = s.gen;
    if (!g.active) return StopGenerating{};
    if (g.left > 0) g.left--;
    if (g.left == 0 || (finished && !g.continue_after_finish)) {
        g.active = false;
        return StopGenerating{};
    }
    NextRow row;
    row.token = token;
    pb::ResponseHeader & hdr = row.header;
    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
    hdr.set_request_id(last.request_id());
    hdr.set_session_id(s.id);
    hdr.set_route_epoch(s.epoch);
    hdr.set_step(last.step() + 1);
    hdr.set_phase(pb::PHASE_DECODE);
    hdr.mutable_positions()->set_start(s.positions);
    hdr.mutable_positions()->set_end(s.positions + 1);
    hdr.set_compression(pb::COMPRESSION_NONE);
    hdr.set_cache_result(pb::CACHE_RESULT_HIT);
    *hdr.mutable_computed_range() = last.computed_range();
    if (token < 0 || (uint32_t) token >= n_vocab_) {
        g.active = false;
        return GenerationRefused{
            hdr, make_error(pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB, "generation got token id " + std::to_string(token)), false};
    }
    if ((uint64_t) s.positions + 1 > max_positions_) {
        g.active = false;
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "generation reached max_session_positions");
        e.set_limit(max_positions_);
        return GenerationRefused{hdr, e, true};
    }
    return row;
}

}  // namespace dgr::worker
