// The intake of one frame (frame_intake.h): pure checks, in the order the reasons are given.
#include "worker/frame_intake.h"

#include "common/sha256.h"
#include "worker/errors.h"

#include <algorithm>

namespace dgr::worker {

namespace {

Refusal refuse(pb::ErrorReason r, const std::string & msg, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
    return Refusal{make_error(r, msg), cache, Refusal::Counted::none};
}

Check refuse_protocol(const bundle::Result & e) {
    if (!e) return std::nullopt;
    return Refusal{make_error(*e), pb::CACHE_RESULT_UNSPECIFIED, Refusal::Counted::none};
}

}  // namespace

Intake::Intake(const pb::SessionRequest & r)
    : req(r), fast(r.has_fast_decode()), sf(r.has_step() ? &r.step() : nullptr) {
    hdr.set_schema_version(pb::SCHEMA_VERSION_V1);
    if (fast) {
        const auto & f = req.fast_decode();
        sid = f.session_id();
        epoch = f.route_epoch();
        step = f.step();
        phase = pb::PHASE_DECODE;
        p0 = f.position();
        p1 = p0 + 1;
        expect = pb::CACHE_EXPECTATION_KIND_POSITION;
        expect_pos = p0;
        hdr.set_request_id(f.request_id());
    } else if (sf) {
        const auto & h = sf->header();
        sid = h.session_id();
        epoch = h.route_epoch();
        step = h.step();
        phase = h.phase();
        p0 = h.positions().start();
        p1 = h.positions().end();
        expect = h.cache_expectation().kind();
        expect_pos = h.cache_expectation().position();
        hdr.set_request_id(h.request_id());
    } else {
        return;  // refused by the header check
    }
    hdr.set_session_id(sid);
    hdr.set_route_epoch(epoch);
    hdr.set_step(step);
    hdr.set_phase(phase);
    hdr.mutable_positions()->set_start(p0);
    hdr.mutable_positions()->set_end(p1);
    hdr.set_compression(pb::COMPRESSION_NONE);
}

std::string frame_digest(pb::SessionRequest & req) {
    std::string * rid = nullptr;
    if (req.has_step() && req.step().has_header()) {
        rid = req.mutable_step()->mutable_header()->mutable_request_id();
    } else if (req.has_fast_decode()) {
        rid = req.mutable_fast_decode()->mutable_request_id();
    }
    std::string saved;
    if (rid) saved.swap(*rid);
    std::string bytes;
    req.SerializeToString(&bytes);
    if (rid) rid->swap(saved);
    return sha256_hex(bytes);
}

SamplingConfig sampling_config(const pb::SamplingParams & p) {
    SamplingConfig c;
    c.stochastic = p.mode() == pb::SAMPLING_MODE_STOCHASTIC;
    c.temperature = p.temperature();
    c.top_k = p.top_k();
    c.top_p = p.top_p();
    c.min_p = p.min_p();
    c.seed = p.seed();
    c.top_logprobs = p.top_logprobs();
    c.ignore_eog = p.ignore_eog();
    c.stop_token_ids.assign(p.stop_token_ids().begin(), p.stop_token_ids().end());
    for (const auto & b : p.logit_bias()) c.logit_bias.emplace_back(b.token_id(), b.bias());
    c.repeat_penalty = p.repeat_penalty() == 0.0f ? 1.0f : p.repeat_penalty();
    c.frequency_penalty = p.frequency_penalty();
    c.presence_penalty = p.presence_penalty();
    c.penalty_last_n = p.penalty_last_n();
    c.penalty_prompt.assign(p.penalty_prompt_tokens().begin(), p.penalty_prompt_tokens().end());
    return c;
}

Check FrameIntake::header(const Intake & in) const {
    return refuse_protocol(bundle::check_header(in.req, &cap_, /*whole_range=*/true));
}

Check FrameIntake::binding(const Intake & in, const std::string & bound) const {
    if (bound.empty() || bound == in.sid) return std::nullopt;
    return refuse(pb::ERROR_REASON_BAD_REQUEST, "one stream serves one session id");
}

Check FrameIntake::ownership(const Intake & in, const Session * s, const StreamSink & sink) const {
    if (!s || s->sink.get() == &sink) return std::nullopt;
    const bool newer_open = in.epoch > s->epoch && in.expect == pb::CACHE_EXPECTATION_KIND_EMPTY && !in.fast;
    const bool owner_gone = !s->sink || s->sink->client_gone.load();
    const bool same_client = !sink.client_identity.empty() && s->sink && s->sink->client_identity == sink.client_identity;
    if (newer_open && (owner_gone || same_client)) return std::nullopt;
    Refusal r = refuse(pb::ERROR_REASON_SESSION_NOT_OWNED,
                       "session id '" + in.sid + "' is in use by another stream" +
                           (sink.client_identity.empty() ? "" : " or client") +
                           "; choose another session id (nothing was read or changed)");
    r.counted = Refusal::Counted::not_owned;
    return r;
}

SessionVerdict FrameIntake::session_state(const Intake & in, const Session * s, const Tombstone * t,
                                          bool draining) const {
    auto with = [](pb::ShardError e, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
        return Refusal{std::move(e), cache, Refusal::Counted::none};
    };
    if (s && in.epoch < s->epoch) {
        pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session exists");
        e.set_current_epoch(s->epoch);
        return with(e, pb::CACHE_RESULT_STALE);
    }
    if (!s) {
        if (t && in.epoch < t->epoch) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session existed");
            e.set_current_epoch(t->epoch);
            return with(e, pb::CACHE_RESULT_STALE);
        }
        if (t && in.epoch == t->epoch) {
            if (t->kind == EndKind::evicted) {
                return refuse(pb::ERROR_REASON_CACHE_MISS,
                              "the session's state was evicted (TTL/LRU); restart with a new epoch", pb::CACHE_RESULT_MISS);
            }
            return refuse(pb::ERROR_REASON_SESSION_RELEASED, "this epoch of the session was released; open a new epoch");
        }
        if (in.expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            if (in.expect == pb::CACHE_EXPECTATION_KIND_POSITION && !in.fast) {
                return refuse(pb::ERROR_REASON_CACHE_MISS, "no state for this session and epoch", pb::CACHE_RESULT_MISS);
            }
            return refuse(pb::ERROR_REASON_UNKNOWN_SESSION,
                          "no state for this session id; open it with CACHE_EXPECTATION_KIND_EMPTY");
        }
    } else if (in.epoch > s->epoch) {
        if (in.expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            return refuse(pb::ERROR_REASON_CACHE_MISS, "a new epoch must open with CACHE_EXPECTATION_KIND_EMPTY",
                          pb::CACHE_RESULT_MISS);
        }
    } else {
        // the same (session, epoch); on a second stream only replays make sense
        if (s->chain.link == ChainLink::broken) return EndBrokenChain{};
        if (s->gen.active) {
            return refuse(pb::ERROR_REASON_BAD_REQUEST,
                          "the session is generating (StepFrame.generate): wait for its last token, or cancel it");
        }
        if (s->busy()) return refuse(pb::ERROR_REASON_BAD_REQUEST, "a step of this session is already queued");
        const bool partial_of_step = s->partial && s->partial->step == in.step;
        if ((int64_t) in.step == s->last_step && !partial_of_step) {
            const bool stored = s->has_stored && s->digest_step == s->last_step;
            const bool same = stored && std::find(s->step_digests.begin(), s->step_digests.end(), in.digest) !=
                                            s->step_digests.end();
            if (same) return ReplayStep{};
            pb::ShardError e = make_error(
                pb::ERROR_REASON_STEP_OUT_OF_ORDER,
                stored ? "step " + std::to_string(in.step) + " was used by a different frame; a replay must resend it unchanged"
                       : "step " + std::to_string(in.step) + " has no stored answer to replay");
            e.set_last_step((uint64_t) s->last_step);
            return with(e);
        }
        if ((int64_t) in.step != s->last_step + 1) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER,
                                          "step must be last_step + 1 (or a replay of last_step)");
            e.set_last_step(s->last_step < 0 ? 0 : (uint64_t) s->last_step);
            return with(e);
        }
        if (in.expect == pb::CACHE_EXPECTATION_KIND_EMPTY) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the session is already open for this epoch");
            e.set_cached_positions(s->positions);
            return with(e, pb::CACHE_RESULT_STALE);
        }
        if (in.expect == pb::CACHE_EXPECTATION_KIND_POSITION && in.expect_pos != s->positions) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the worker holds a different number of positions");
            e.set_cached_positions(s->positions);
            return with(e, pb::CACHE_RESULT_STALE);
        }
        return ContinueSession{};
    }
    // the frame opens the session (or a newer epoch of it)
    if (in.step != 0) return with(make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER, "the first step of an epoch is 0"));
    if (draining) return refuse(pb::ERROR_REASON_UNAVAILABLE, "the worker is draining; open the session elsewhere");
    if (in.fast) return refuse(pb::ERROR_REASON_BAD_REQUEST, "a session opens with a full StepFrame");
    return OpenSession{};
}

Check FrameIntake::positions(const Intake & in, uint32_t held, bool opening) const {
    if (in.rows_phase() && in.p0 != held && !(opening && in.p0 == 0)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_POSITION_GAP, "positions.start must equal the positions held");
        e.set_cached_positions(held);
        return Refusal{e, pb::CACHE_RESULT_STALE, Refusal::Counted::none};
    }
    if (auto e = refuse_protocol(bundle::check_rows(in.req, &cap_))) return e;
    if (!in.rows_phase() && opening) {
        return refuse(pb::ERROR_REASON_BAD_REQUEST, "nothing to release or truncate in a new epoch");
    }
    return std::nullopt;
}

Check FrameIntake::truncate(const Intake & in, uint32_t held, bool chained) const {
    if (in.phase != pb::PHASE_TRUNCATE) return std::nullopt;
    if (chained) {
        return refuse(pb::ERROR_REASON_BAD_REQUEST, "TRUNCATE is not supported on a chained session; open a new epoch");
    }
    if (in.p0 > held) return refuse(pb::ERROR_REASON_BAD_REQUEST, "truncation point beyond the positions held");
    return std::nullopt;
}

Check FrameIntake::budget(const Intake & in, uint32_t held) const {
    if ((uint64_t) held + in.rows() <= max_positions_) return std::nullopt;
    pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "the session would exceed max_session_positions");
    e.set_limit(max_positions_);
    return Refusal{e, pb::CACHE_RESULT_UNSPECIFIED, Refusal::Counted::kv};
}

Check FrameIntake::input(const Intake & in, bool sampling_applies) const {
    return refuse_protocol(bundle::check_input(in.req, &cap_, sampling_applies));
}

Check FrameIntake::generate(const Intake & in, bool chained) const {
    if (in.fast || !in.sf->has_generate()) return std::nullopt;
    const auto & id = cap_.identity();
    if (!id.head()) return refuse(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate is for head Shards");
    if (!in.sf->sample()) return refuse(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate needs sample = true");
    if (!id.tail() && !chained) {
        return refuse(pb::ERROR_REASON_BAD_REQUEST,
                      "StepFrame.generate needs the route's tail: this worker is not the tail and the session has no downstream");
    }
    return std::nullopt;
}

}  // namespace dgr::worker
