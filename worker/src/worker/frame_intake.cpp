// One SessionRequest frame on the scheduler thread: the validator's stages (common/bundle.h)
// around the session-state checks, then admission and queueing. The order of the checks, and
// so the reason a frame with several faults gets, is:
//   header (kind, schema, fingerprint, range, compression, phase, session id, epoch) ->
//   stream binding -> session state (epoch, tombstone, replay, step order, cache expectation)
//   -> positions held -> rows (position range, DECODE one row, chunk limit) -> TRUNCATE/RELEASE
//   -> positions budget -> input (sampling, role, token count, vocabulary, payload checksum)
//   -> bundle assembly -> downstream hops, generate -> admission (sessions, KV cells).
#include "common/sha256.h"
#include "worker/errors.h"
#include "worker/scheduler.h"

#include <algorithm>
#include <cstring>

namespace dgr::worker {

namespace {

double seconds_since(Clock::time_point t0) {
    return std::chrono::duration<double>(Clock::now() - t0).count();
}

SamplingConfig to_config(const pb::SamplingParams & p) {
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
    return c;
}

// SHA-256 of the frame as received, without its request_id (a work id, not content): two
// frames with the same digest ask for the same step with the same input.
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

// Remember that a frame with `digest` was taken for `step` of the session (replays compare).
void note_digest(Session & s, uint64_t step, std::string digest) {
    if (s.digest_step != (int64_t) step) {
        s.digest_step = (int64_t) step;
        s.step_digests.clear();
    }
    if (s.step_digests.size() < 4096) s.step_digests.push_back(std::move(digest));
}

}  // namespace

// The fields of one frame (StepFrame or FastDecodeFrame) and the header its answer gets.
struct Scheduler::Intake {
    const pb::SessionRequest & req;
    const bool fast;
    const pb::StepFrame * sf;  // null for a FastDecodeFrame
    std::string sid;
    uint64_t epoch = 0, step = 0;
    pb::Phase phase = pb::PHASE_UNSPECIFIED;
    uint32_t p0 = 0, p1 = 0;
    pb::CacheExpectationKind expect = pb::CACHE_EXPECTATION_KIND_UNSPECIFIED;
    uint32_t expect_pos = 0;
    pb::ResponseHeader hdr;
    std::string digest;  // frame_digest(), set by on(FrameEvent)

    explicit Intake(const pb::SessionRequest & r)
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
    bool rows_phase() const { return phase == pb::PHASE_PREFILL || phase == pb::PHASE_DECODE; }
};

void Scheduler::on(FrameEvent & ev) {
    StreamSink & sink = *ev.sink;
    Intake in(*ev.req);
    auto refuse = [&](const bundle::ProtocolError & pe) { answer_frame_error(ev, in.hdr, make_error(pe)); };
    auto fail = [&](pb::ErrorReason r, const std::string & msg, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
        answer_frame_error(ev, in.hdr, make_error(r, msg), cache);
    };
    if (auto e = bundle::check_header(in.req, &cap_, /*whole_range=*/true)) return refuse(*e);
    if (sink.bound_session.empty()) {
        sink.bound_session = in.sid;
    } else if (sink.bound_session != in.sid) {
        return fail(pb::ERROR_REASON_BAD_REQUEST, "one stream serves one session id");
    }

    Session * s = table_.find(in.sid);
    if (s && s->sink != ev.sink) {
        // Ownership: a live session answers only the stream that opened it. Another stream may
        // supersede it with a newer epoch only when the owner's stream is gone, or when both
        // carry the same authenticated client identity (mTLS).
        const bool newer_open = in.epoch > s->epoch && in.expect == pb::CACHE_EXPECTATION_KIND_EMPTY && !in.fast;
        const bool owner_gone = !s->sink || s->sink->client_gone.load();
        const bool same_client = !sink.client_identity.empty() && s->sink &&
                                 s->sink->client_identity == sink.client_identity;
        if (!(newer_open && (owner_gone || same_client))) {
            metrics_.rejected_not_owned++;
            return fail(pb::ERROR_REASON_SESSION_NOT_OWNED,
                        "session id '" + in.sid + "' is in use by another stream" +
                            (sink.client_identity.empty() ? "" : " or client") +
                            "; choose another session id (nothing was read or changed)");
        }
    }
    in.digest = frame_digest(*ev.req);
    bool opening = false;
    if (!check_session_state(ev, in, s, &opening)) return;
    const uint32_t held = opening ? 0 : s->positions;
    if (in.rows_phase() && in.p0 != held && !(opening && in.p0 == 0)) {
        pb::ShardError e = make_error(pb::ERROR_REASON_POSITION_GAP, "positions.start must equal the positions held");
        e.set_cached_positions(held);
        return answer_frame_error(ev, in.hdr, e, pb::CACHE_RESULT_STALE);
    }
    in.hdr.set_cache_result(pb::CACHE_RESULT_HIT);
    if (auto e = bundle::check_rows(in.req, &cap_)) return refuse(*e);

    if (!in.rows_phase()) {
        if (opening) return fail(pb::ERROR_REASON_BAD_REQUEST, "nothing to release or truncate in a new epoch");
        return phase_without_input(ev, in, *s);
    }

    // ---- PREFILL / DECODE ----
    const uint32_t n = in.p1 - in.p0;
    if ((uint64_t) held + n > opts_.max_session_positions) {
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET, "the session would exceed max_session_positions");
        e.set_limit(opts_.max_session_positions);
        metrics_.rejected_kv++;
        return answer_frame_error(ev, in.hdr, e);
    }
    const pb::StepFrame * sf = in.sf;
    // the sampling contract applies on the tail, and on a Shard that passes it downstream
    const bool sampling_applies =
        !in.fast && sf->has_sampling() && (info_.tail || sf->downstream_size() > 0 || (s && s->chain.down));
    if (auto e = bundle::check_input(in.req, &cap_, sampling_applies)) return refuse(*e);

    auto w = std::make_unique<Work>();
    w->session_id = in.sid;
    w->decode = in.phase == pb::PHASE_DECODE;
    w->pos0 = in.p0;
    w->n = n;
    w->sample = in.fast ? true : sf->sample();
    w->t0 = ev.t0;
    w->ticket = std::move(ev.ticket);  // the step answers the frame now
    if (w->decode) {
        const pb::UpstreamBatch & ub = in.fast ? in.req.fast_decode().batch() : sf->batch();
        if (ub.rows() > 1) {
            w->up_batch = ub.id();
            w->up_rows = ub.rows();
        }
    }
    if (!take_input(ev, in, s, opening, *w)) return;

    // ---- chained route and server-side generation ----
    const bool chain_req = !in.fast && opening && sf->downstream_size() > 0;
    if (chain_req) {
        if (auto e = check_hops(*sf)) return refuse(*e);
    }
    const bool gen_req = !in.fast && sf->has_generate();
    if (gen_req) {
        if (!info_.head) return fail(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate is for head Shards");
        if (!w->sample) return fail(pb::ERROR_REASON_BAD_REQUEST, "StepFrame.generate needs sample = true");
        const bool chained = chain_req || (s && !opening && s->chain.down);
        if (!info_.tail && !chained) {
            return fail(pb::ERROR_REASON_BAD_REQUEST,
                        "StepFrame.generate needs the route's tail: this worker is not the tail and the session has no downstream");
        }
    }

    // ---- admission: session slot and KV cells ----
    if (!make_room(n, opening, in.sid)) {
        const bool sessions_full = opening && table_.full();
        pb::ShardError e = make_error(pb::ERROR_REASON_OVER_BUDGET,
                                      sessions_full ? "max sessions reached; retry later or elsewhere"
                                                    : "KV cells budget exhausted; retry later or elsewhere");
        e.set_limit(sessions_full ? opts_.max_sessions : opts_.kv_cells);
        (sessions_full ? metrics_.rejected_sessions : metrics_.rejected_kv)++;
        return answer_frame_error(ev, in.hdr, e);
    }
    if (opening) {
        if (s) {
            // a newer epoch supersedes the older one: its stream (if another) ends
            auto old_sink = s->sink;
            pb::ResponseHeader oh;
            oh.set_schema_version(pb::SCHEMA_VERSION_V1);
            oh.set_session_id(in.sid);
            oh.set_route_epoch(s->epoch);
            drop_session(in.sid, EndKind::released);
            if (old_sink && old_sink != ev.sink) {
                pb::SessionResponse r;
                *r.mutable_header() = oh;
                pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "superseded by a newer epoch", true);
                e.set_current_epoch(in.epoch);
                *r.mutable_error() = e;
                old_sink->deliver(std::move(r), true,
                                  status_with(grpc::StatusCode::ABORTED, "superseded by a newer epoch", e));
            }
        }
        s = &table_.open(in.sid, in.epoch);
        s->effective_start = info_.layer_start;
        s->sink = ev.sink;
        s->pipelined = !in.fast && sf->pipelined();
        metrics_.sessions_opened++;
        if (s->pipelined) metrics_.sessions_opened_pipelined++;
        publish_gauges();
    }
    s->sink = ev.sink;
    if (chain_req) open_chain(*s, *sf);
    if (sampling_applies) {
        const SamplingConfig sampling = to_config(sf->sampling());
        if (info_.tail) {
            if (opening || sampling.seed != s->sampling.seed) s->rng.seed(sampling.seed);
            s->sampling = sampling;
        } else if (opening) {
            s->rng.seed(0);
        }
        if (s->chain.down) s->chain.fwd_sampling = std::make_unique<pb::SamplingParams>(sf->sampling());
    } else if (opening) {
        s->rng.seed(0);
    }
    if (gen_req) {
        s->gen.active = true;
        s->gen.left = std::max<uint32_t>(1, sf->generate().max_tokens());
        s->gen.continue_after_finish = sf->generate().continue_after_finish();
        s->gen.per_answer = std::max<uint32_t>(1, sf->generate().tokens_per_answer());
    }
    note_digest(*s, in.step, in.digest);
    move_step(*s, StepState::queued);
    s->last_used = Clock::now();
    table_.reserve(*s, n);
    w->generation = s->generation;
    w->header = in.hdr;
    w->header.mutable_computed_range()->set_start(s->effective_start);
    w->header.mutable_computed_range()->set_end(info_.layer_end);
    w->t_ready = Clock::now();
    if (w->decode) {
        note_decode_arrival(*s);
        queue_.push_decode(std::move(w));
    } else {
        queue_prefill(*s, std::move(w));
    }
}

bool Scheduler::check_session_state(FrameEvent & ev, Intake & in, Session * s, bool * opening) {
    StreamSink & sink = *ev.sink;
    auto fail = [&](pb::ErrorReason r, const std::string & msg, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
        answer_frame_error(ev, in.hdr, make_error(r, msg), cache);
        return false;
    };
    auto fail_with = [&](const pb::ShardError & e, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED) {
        answer_frame_error(ev, in.hdr, e, cache);
        return false;
    };
    if (s && in.epoch < s->epoch) {
        pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session exists");
        e.set_current_epoch(s->epoch);
        return fail_with(e, pb::CACHE_RESULT_STALE);
    }
    if (!s) {
        const Tombstone * t = table_.tombstone(in.sid);
        if (t && in.epoch < t->epoch) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch of this session existed");
            e.set_current_epoch(t->epoch);
            return fail_with(e, pb::CACHE_RESULT_STALE);
        }
        if (t && in.epoch == t->epoch) {
            if (t->kind == EndKind::evicted) {
                return fail(pb::ERROR_REASON_CACHE_MISS,
                            "the session's state was evicted (TTL/LRU); restart with a new epoch", pb::CACHE_RESULT_MISS);
            }
            return fail(pb::ERROR_REASON_SESSION_RELEASED, "this epoch of the session was released; open a new epoch");
        }
        if (in.expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            if (in.expect == pb::CACHE_EXPECTATION_KIND_POSITION && !in.fast) {
                return fail(pb::ERROR_REASON_CACHE_MISS, "no state for this session and epoch", pb::CACHE_RESULT_MISS);
            }
            return fail(pb::ERROR_REASON_UNKNOWN_SESSION,
                        "no state for this session id; open it with CACHE_EXPECTATION_KIND_EMPTY");
        }
        *opening = true;
    } else if (in.epoch > s->epoch) {
        if (in.expect != pb::CACHE_EXPECTATION_KIND_EMPTY) {
            return fail(pb::ERROR_REASON_CACHE_MISS, "a new epoch must open with CACHE_EXPECTATION_KIND_EMPTY",
                        pb::CACHE_RESULT_MISS);
        }
        *opening = true;
    } else {
        // the same (session, epoch); on a second stream only replays make sense
        if (s->chain.link == ChainLink::broken) {
            pb::ShardError e = make_error(s->chain.failed_reason, s->chain.failed, true);
            blame_downstream(*s, e);
            const std::string why = e.message();
            drop_session(in.sid, EndKind::released);
            pb::SessionResponse r;
            *r.mutable_header() = in.hdr;
            *r.mutable_error() = e;
            metrics_.step_errors++;
            ev.ticket.release();
            sink.deliver(std::move(r), true, status_with(grpc::StatusCode::UNAVAILABLE, why, e));
            return false;
        }
        if (s->gen.active) {
            return fail(pb::ERROR_REASON_BAD_REQUEST,
                        "the session is generating (StepFrame.generate): wait for its last token, or cancel it");
        }
        if (s->busy()) return fail(pb::ERROR_REASON_BAD_REQUEST, "a step of this session is already queued");
        const bool partial_of_step = s->partial && s->partial->step == in.step;
        if ((int64_t) in.step == s->last_step && !partial_of_step) {
            const bool same = s->has_stored && s->digest_step == s->last_step &&
                              std::find(s->step_digests.begin(), s->step_digests.end(), in.digest) !=
                                  s->step_digests.end();
            if (!same) {
                pb::ShardError e = make_error(
                    pb::ERROR_REASON_STEP_OUT_OF_ORDER,
                    s->has_stored && s->digest_step == s->last_step
                        ? "step " + std::to_string(in.step) + " was used by a different frame; a replay must resend it unchanged"
                        : "step " + std::to_string(in.step) + " has no stored answer to replay");
                e.set_last_step((uint64_t) s->last_step);
                return fail_with(e);
            }
            pb::SessionResponse r = s->stored;
            r.mutable_header()->set_replayed(true);
            metrics_.replayed_steps++;
            metrics_.step_latency.observe(seconds_since(ev.t0));
            ev.ticket.release();
            s->last_used = Clock::now();
            sink.deliver(std::move(r));
            return false;
        }
        if ((int64_t) in.step != s->last_step + 1) {
            pb::ShardError e = make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER,
                                          "step must be last_step + 1 (or a replay of last_step)");
            e.set_last_step(s->last_step < 0 ? 0 : (uint64_t) s->last_step);
            return fail_with(e);
        }
        if (in.expect == pb::CACHE_EXPECTATION_KIND_EMPTY) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the session is already open for this epoch");
            e.set_cached_positions(s->positions);
            return fail_with(e, pb::CACHE_RESULT_STALE);
        }
        if (in.expect == pb::CACHE_EXPECTATION_KIND_POSITION && in.expect_pos != s->positions) {
            pb::ShardError e = make_error(pb::ERROR_REASON_CACHE_MISS, "the worker holds a different number of positions");
            e.set_cached_positions(s->positions);
            return fail_with(e, pb::CACHE_RESULT_STALE);
        }
    }
    if (*opening) {
        if (in.step != 0) return fail_with(make_error(pb::ERROR_REASON_STEP_OUT_OF_ORDER, "the first step of an epoch is 0"));
        if (draining_) return fail(pb::ERROR_REASON_UNAVAILABLE, "the worker is draining; open the session elsewhere");
        if (in.fast) return fail(pb::ERROR_REASON_BAD_REQUEST, "a session opens with a full StepFrame");
    }
    return true;
}

void Scheduler::phase_without_input(FrameEvent & ev, Intake & in, Session & s) {
    StreamSink & sink = *ev.sink;
    if (in.phase == pb::PHASE_TRUNCATE && s.chain.down) {
        return answer_frame_error(ev, in.hdr,
                                  make_error(pb::ERROR_REASON_BAD_REQUEST,
                                             "TRUNCATE is not supported on a chained session; open a new epoch"));
    }
    pb::SessionResponse r;
    if (in.phase == pb::PHASE_RELEASE) {
        drop_session(in.sid, EndKind::released);
        in.hdr.set_cached_positions(0);
    } else {
        if (in.p0 > s.positions) {
            return answer_frame_error(ev, in.hdr,
                                      make_error(pb::ERROR_REASON_BAD_REQUEST, "truncation point beyond the positions held"));
        }
        backend_.seq_rm(s.seq, (int32_t) in.p0, -1);
        table_.truncate(s, in.p0);
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
    metrics_.steps++;
    metrics_.step_latency.observe(seconds_since(ev.t0));
    ev.ticket.release();
    sink.deliver(std::move(r));
}

bool Scheduler::take_input(FrameEvent & ev, Intake & in, Session * s, bool opening, Work & w) {
    StreamSink & sink = *ev.sink;
    if (info_.head) {
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
        local->assembler = bundle::Assembler(bundle::Limits{opts_.max_message_bytes, opts_.max_fragment_bytes});
        local->assembler.expect_only(bundle::kResidual, pb::TENSOR_DTYPE_F32, {w.n, info_.n_embd});
        part = local.get();
    }
    if (auto e = part->assembler.add(b)) {
        if (s && !local) s->partial.reset();
        answer_frame_error(ev, in.hdr, make_error(*e));
        return false;
    }
    if (!part->assembler.complete()) {
        if (opening) {
            answer_frame_error(ev, in.hdr,
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
        answer_frame_error(ev, in.hdr, make_error(*e));
        return false;
    }
    const std::vector<uint8_t> & bytes = tensors[0].data;
    w.rows.resize(bytes.size() / sizeof(float));
    std::memcpy(w.rows.data(), bytes.data(), bytes.size());
    return true;
}

}  // namespace dgr::worker
