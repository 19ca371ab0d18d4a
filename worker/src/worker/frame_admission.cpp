// The admission of one frame on the scheduler thread (frame_admission.h).
#include "worker/frame_admission.h"

#include "worker/errors.h"
#include "worker/grammar.h"

#include <algorithm>
#include <cstring>

namespace dgr::worker {

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Remember that a frame with `digest` was taken for `step` of the session (replays compare).
void note_digest(Session & s, uint64_t step, std::string digest) {
    if (s.digest_step != (int64_t) step) {
        s.digest_step = (int64_t) step;
        s.step_digests.clear();
    }
    if (s.step_digests.size() < 4096) s.step_digests.push_back(std::move(digest));
}

}  // namespace

void FrameAdmission::refuse_frame(FrameEvent & ev, const pb::ResponseHeader & hdr, const Refusal & r) {
    if (r.counted == Refusal::Counted::not_owned) st_.metrics.rejected_not_owned++;
    if (r.counted == Refusal::Counted::kv) st_.metrics.rejected_kv++;
    st_.answer_frame_error(ev, hdr, r.error, r.cache);
}

void FrameAdmission::on(FrameEvent & ev) {
    StreamSink & sink = *ev.sink;
    Intake in(*ev.req);
    auto refuse = [&](const Check & c) {
        if (!c) return false;
        refuse_frame(ev, in.hdr, *c);
        return true;
    };
    if (refuse(st_.intake.header(in)) || refuse(st_.intake.binding(in, sink.bound_session))) return;
    if (sink.bound_session.empty()) sink.bound_session = in.sid;

    Session * s = st_.table.find(in.sid);
    if (refuse(st_.intake.ownership(in, s, sink))) return;
    in.digest = frame_digest(*ev.req);
    const SessionVerdict verdict = st_.intake.session_state(in, s, s ? nullptr : st_.table.tombstone(in.sid), st_.draining);
    if (const auto * r = std::get_if<Refusal>(&verdict)) return refuse_frame(ev, in.hdr, *r);
    if (std::holds_alternative<EndBrokenChain>(verdict)) return end_broken_chain(ev, in, *s);
    if (std::holds_alternative<ReplayStep>(verdict)) {
        pb::SessionResponse r = s->stored;
        r.mutable_header()->set_replayed(true);
        st_.metrics.replayed_steps++;
        st_.metrics.step_latency.observe(seconds_since(ev.t0));
        ev.ticket.release();
        s->last_used = Clock::now();
        sink.deliver(std::move(r));
        return;
    }
    const bool opening = std::holds_alternative<OpenSession>(verdict);
    const uint32_t held = opening ? 0 : s->positions;
    if (refuse(st_.intake.positions(in, held, opening))) return;
    in.hdr.set_cache_result(pb::CACHE_RESULT_HIT);
    if (!in.rows_phase()) {
        if (refuse(st_.intake.truncate(in, held, (bool) s->chain.down))) return;
        return phase_without_input(ev, in, *s);
    }

    // ---- PREFILL / DECODE ----
    if (refuse(st_.intake.budget(in, held))) return;
    const pb::StepFrame * sf = in.sf;
    // the sampling contract applies on the tail, and on a Shard that passes it downstream
    const bool sampling_applies =
        !in.fast && sf->has_sampling() && (st_.info.tail || sf->downstream_size() > 0 || (s && s->chain.down));
    if (refuse(st_.intake.input(in, sampling_applies))) return;

    const uint32_t n = in.rows();
    auto w = std::make_unique<Work>();
    w->session_id = in.sid;
    w->decode = in.phase == pb::PHASE_DECODE;
    w->pos0 = in.p0;
    w->n = n;
    w->sample = in.fast ? true : sf->sample();
    w->t0 = ev.t0;
    ClientStep frame;
    frame.ticket = std::move(ev.ticket);  // the step answers the frame now
    if (w->decode) {
        const pb::UpstreamBatch & ub = in.fast ? in.req.fast_decode().batch() : sf->batch();
        if (ub.rows() > 1) {
            frame.up_batch = ub.id();
            frame.up_rows = ub.rows();
        }
    }
    w->origin = std::move(frame);
    if (!take_input(ev, in, s, opening, *w)) return;

    // ---- chained route and server-side generation ----
    const bool chain_req = !in.fast && opening && sf->downstream_size() > 0;
    if (chain_req) {
        if (auto e = st_.chain.check_hops(*sf)) return refuse_frame(ev, in.hdr, Refusal{make_error(*e)});
    }
    const bool gen_req = !in.fast && sf->has_generate();
    if (refuse(st_.intake.generate(in, chain_req || (s && !opening && s->chain.down)))) return;

    // ---- the tail's sampling contract: a new one (grammar compiled) before anything is admitted ----
    std::unique_ptr<TokenConstraint> constraint;
    std::string sampling_key;
    bool new_contract = false;
    if (sampling_applies && st_.info.tail) {
        sf->sampling().SerializeToString(&sampling_key);
        new_contract = opening || !s || s->sampler.key != sampling_key;
        if (new_contract) {
            std::string why, field;
            constraint = constraint_for(st_.backend.vocab(), sf->sampling().grammar(), sf->sampling().json_schema(),
                                        &why, &field);
            if (!why.empty()) {
                pb::ShardError e = make_error(pb::ERROR_REASON_BAD_REQUEST, field + ": " + why);
                e.set_field(field);
                return refuse_frame(ev, in.hdr, Refusal{e});
            }
        }
    }

    // ---- admission: session slot and KV cells ----
    if (!st_.make_room(n, opening, in.sid)) {
        const bool sessions_full = opening && st_.table.full();
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET,
                                      sessions_full ? "max sessions reached; retry later or elsewhere"
                                                    : "KV cells budget exhausted; retry later or elsewhere");
        e.set_limit(sessions_full ? st_.opts.max_sessions : st_.opts.kv_cells);
        (sessions_full ? st_.metrics.rejected_sessions : st_.metrics.rejected_kv)++;
        return st_.answer_frame_error(ev, in.hdr, e);
    }
    if (opening) s = &open_session(ev, in, s);
    s->sink = ev.sink;
    if (chain_req) st_.open_chain(*s, *sf);
    if (sampling_applies) {
        const SamplingConfig sampling = sampling_config(sf->sampling());
        if (st_.info.tail) {
            if (opening || sampling.seed != s->sampling.seed) s->rng.seed(sampling.seed);
            s->sampling = sampling;
            if (new_contract) {
                s->sampler.reset(sampling, std::move(constraint));
                s->sampler.key = std::move(sampling_key);
            }
        } else if (opening) {
            s->rng.seed(0);
        }
        if (s->chain.down) s->chain.fwd_sampling = std::make_unique<pb::SamplingParams>(sf->sampling());
    } else if (opening) {
        s->rng.seed(0);
    }
    if (gen_req) Generation::start(s->gen, sf->generate());
    note_digest(*s, in.step, in.digest);
    move_step(*s, StepState::queued);
    s->last_used = Clock::now();
    st_.table.reserve(*s, n);
    w->generation = s->generation;
    w->header = in.hdr;
    w->header.mutable_computed_range()->set_start(s->effective_start);
    w->header.mutable_computed_range()->set_end(st_.info.layer_end);
    w->t_ready = Clock::now();
    if (w->decode) {
        Pacer::note_decode_arrival(*s, Clock::now());
        st_.queue.push_decode(std::move(w));
    } else {
        st_.queue_prefill(*s, std::move(w));
    }
}

Session & FrameAdmission::open_session(FrameEvent & ev, const Intake & in, Session * old) {
    if (old) {
        // a newer epoch supersedes the older one: its stream (if another) ends
        auto old_sink = old->sink;
        pb::ResponseHeader oh;
        oh.set_schema_version(pb::SCHEMA_VERSION_V1);
        oh.set_session_id(in.sid);
        oh.set_route_epoch(old->epoch);
        st_.drop_session(in.sid, EndKind::released);
        if (old_sink && old_sink != ev.sink) {
            pb::SessionResponse r;
            *r.mutable_header() = oh;
            pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "superseded by a newer epoch", true);
            e.set_current_epoch(in.epoch);
            *r.mutable_error() = e;
            old_sink->deliver(std::move(r), true, status_with(grpc::StatusCode::ABORTED, "superseded by a newer epoch", e));
        }
    }
    Session & s = st_.table.open(in.sid, in.epoch);
    s.effective_start = st_.info.layer_start;
    s.sink = ev.sink;
    s.pipelined = !in.fast && in.sf->pipelined();
    st_.metrics.sessions_opened++;
    if (s.pipelined) st_.metrics.sessions_opened_pipelined++;
    st_.publish_gauges();
    return s;
}

void FrameAdmission::end_broken_chain(FrameEvent & ev, const Intake & in, Session & s) {
    pb::ShardError e = make_error(s.chain.failed_reason, s.chain.failed, true);
    ChainForwarder::blame(s, e);
    const std::string why = e.message();
    st_.drop_session(in.sid, EndKind::released);
    pb::SessionResponse r;
    *r.mutable_header() = in.hdr;
    *r.mutable_error() = e;
    st_.metrics.step_errors++;
    ev.ticket.release();
    ev.sink->deliver(std::move(r), true, status_with(grpc::StatusCode::UNAVAILABLE, why, e));
}

void FrameAdmission::phase_without_input(FrameEvent & ev, Intake & in, Session & s) {
    pb::SessionResponse r;
    if (in.phase == pb::PHASE_RELEASE) {
        st_.drop_session(in.sid, EndKind::released);
        in.hdr.set_cached_positions(0);
    } else {
        st_.backend.seq_rm(s.seq, (int32_t) in.p0, -1);
        st_.table.truncate(s, in.p0);
        s.last_step = (int64_t) in.step;
        in.hdr.set_cached_positions(in.p0);
    }
    in.hdr.mutable_payload_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
    in.hdr.mutable_payload_checksum()->set_value(0);
    *r.mutable_header() = in.hdr;
    if (in.phase == pb::PHASE_TRUNCATE) {
        note_digest(s, in.step, in.digest);
        s.stored = r;
        s.has_stored = true;
        s.last_used = Clock::now();
    }
    st_.metrics.steps++;
    st_.metrics.step_latency.observe(seconds_since(ev.t0));
    ev.ticket.release();
    ev.sink->deliver(std::move(r));
}

bool FrameAdmission::take_input(FrameEvent & ev, Intake & in, Session * s, bool opening, Work & w) {
    StreamSink & sink = *ev.sink;
    if (st_.info.head) {
        if (in.fast) {
            w.tokens.push_back(in.req.fast_decode().token_id());
        } else {
            w.tokens.assign(in.sf->tokens().token_ids().begin(), in.sf->tokens().token_ids().end());
        }
        return true;
    }
    const pb::TensorBundle & b = in.fast ? in.req.fast_decode().bundle() : in.sf->bundle();
    std::unique_ptr<PartialStep> local;
    PartialStep * part = nullptr;
    if (s && !opening && s->partial && s->partial->step == in.step) {
        part = s->partial.get();
    } else {
        local = std::make_unique<PartialStep>();
        local->step = in.step;
        local->assembler = bundle::Assembler(bundle::Limits{st_.opts.max_message_bytes, st_.opts.max_fragment_bytes});
        local->assembler.expect_only(bundle::kResidual, pb::TENSOR_DTYPE_F32, {w.n, st_.info.n_embd});
        part = local.get();
    }
    if (auto e = part->assembler.add(b)) {
        if (s && !local) s->partial.reset();
        st_.answer_frame_error(ev, in.hdr, make_error(*e));
        return false;
    }
    if (!part->assembler.complete()) {
        if (opening) {
            st_.answer_frame_error(ev, in.hdr,
                               make_error(pb::ERROR_REASON_BAD_REQUEST, "the opening step's bundle must arrive in one frame"));
            return false;
        }
        if (local) s->partial = std::move(local);
        note_digest(*s, in.step, in.digest);
        ev.ticket.release();  // a fragment is answered by the step's last one
        sink.resume();
        return false;
    }
    std::vector<bundle::Tensor> tensors;
    auto e = part->assembler.finish(&tensors);
    if (s && !local) s->partial.reset();
    if (e) {
        st_.answer_frame_error(ev, in.hdr, make_error(*e));
        return false;
    }
    const std::vector<uint8_t> & bytes = tensors[0].data;
    w.rows.resize(bytes.size() / sizeof(float));
    std::memcpy(w.rows.data(), bytes.data(), bytes.size());
    return true;
}

}  // namespace dgr::worker
