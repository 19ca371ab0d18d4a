// Chained routes (StepFrame.downstream): this worker opens its own Session stream to the next
// Shard (downstream.h), forwards every completed step's boundary rows, and answers its caller
// with what the route's tail answered. The scheduler never waits on the network: replies and
// the link's end come back as events.
#include "worker/errors.h"
#include "worker/pipeline.h"
#include "worker/scheduler.h"

#include <algorithm>

namespace dgr::worker {

namespace {

std::string code_name(grpc::StatusCode c) {
    switch (c) {
        case grpc::StatusCode::OK: return "OK";
        case grpc::StatusCode::CANCELLED: return "CANCELLED";
        case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
        case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
        case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
        case grpc::StatusCode::ABORTED: return "ABORTED";
        case grpc::StatusCode::INTERNAL: return "INTERNAL";
        case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
        case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
        default: return "status " + std::to_string((int) c);
    }
}

// Whether a downstream stream ended because its peer went silent rather than because it failed
// or closed. gRPC reports an expired keepalive only as UNAVAILABLE with gRPC core's own text, so
// that text is read here, once; the reason then travels typed (ERROR_REASON_PEER_SILENT).
bool went_silent(const grpc::Status & st) {
    if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return true;
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) return false;
    const std::string & m = st.error_message();
    return m.find("keepalive") != std::string::npos || m.find("ping timeout") != std::string::npos;
}

bundle::ProtocolError refusal(pb::ErrorReason r, std::string msg) { return bundle::protocol_error(r, std::move(msg)); }

}  // namespace

std::string Scheduler::down_label(const Session & s) {
    return "downstream " + s.chain.hop.endpoint() + " [" + std::to_string(s.chain.hop.range().start()) + ", " +
           std::to_string(s.chain.hop.range().end()) + ")";
}

void Scheduler::blame_downstream(const Session & s, pb::ShardError & e) {
    e.set_message(down_label(s) + ": " + e.message());  // for people; clients read the fields
    if (!e.failed_endpoint().empty()) return;            // a Shard farther down failed: keep it
    e.set_failed_endpoint(s.chain.hop.endpoint());
    e.set_failed_start(s.chain.hop.range().start());
    e.set_failed_end(s.chain.hop.range().end());
}

bundle::Result Scheduler::check_hops(const pb::StepFrame & sf) const {
    if (info_.tail) return refusal(pb::ERROR_REASON_BAD_REQUEST, "this shard is the route's tail: it has no downstream");
    uint32_t at = info_.layer_end;
    for (int i = 0; i < sf.downstream_size(); ++i) {
        const pb::ChainHop & h = sf.downstream(i);
        const std::string where = "downstream[" + std::to_string(i) + "] (" + h.endpoint() + ")";
        if (h.range().start() != at || h.range().end() <= h.range().start()) {
            return refusal(pb::ERROR_REASON_RANGE_MISMATCH,
                           where + " covers [" + std::to_string(h.range().start()) + ", " +
                               std::to_string(h.range().end()) + "); expected a range starting at layer " +
                               std::to_string(at));
        }
        if (h.compatibility_fingerprint() != info_.fingerprint) {
            return refusal(pb::ERROR_REASON_FINGERPRINT_MISMATCH,
                           where + " has another compatibility fingerprint than this worker");
        }
        const PeerCheck peer = peers_.check(h.endpoint());
        if (!peer.allowed) {
            return refusal(pb::ERROR_REASON_BAD_REQUEST,
                           where + " is not an allowed peer of this worker: " + peer.why +
                               " (dgr-worker --chain-peers; default: loopback)");
        }
        at = h.range().end();
    }
    if (at != info_.n_layer) {
        return refusal(pb::ERROR_REASON_RANGE_MISMATCH, "the downstream hops end at layer " + std::to_string(at) +
                                                            "; the model has " + std::to_string(info_.n_layer));
    }
    return std::nullopt;
}

void Scheduler::open_chain(Session & s, const pb::StepFrame & sf) {
    const pb::ChainHop & hop = sf.downstream(0);
    s.chain.hop = hop;
    s.chain.rest.assign(sf.downstream().begin() + 1, sf.downstream().end());
    s.chain.stages = 2 + (uint32_t) s.chain.rest.size();
    s.chain.colocated = std::all_of(sf.downstream().begin(), sf.downstream().end(), [this](const pb::ChainHop & h) {
        return peers_.check(h.endpoint()).loopback;
    });
    const std::string sid = s.id;
    const uint64_t gen = s.generation;
    s.chain.down = DownstreamLink::open(
        peers_.stub(peers_.check(hop.endpoint())), hop.endpoint(),
        [this, sid, gen](pb::SessionResponse r) { post_downstream(sid, gen, std::move(r)); },
        [this, sid, gen](const grpc::Status & st) { post_downstream_end(sid, gen, st); });
    move_link(s, ChainLink::linked);
}

void Scheduler::queue_prefill(Session & s, std::unique_ptr<Work> w) {
    const uint32_t groups = s.chain.down ? pipeline_groups(opts_.pipeline_groups, s.chain.stages, s.chain.colocated) : 1;
    const uint32_t piece = prefill_piece_rows(w->n, groups);
    if (piece < w->n) metrics_.prefill_pieces += (w->n + piece - 1) / piece;
    queue_.push_prefill_pieces(std::move(w), piece, info_.n_embd);
}

void Scheduler::forward(Session & s, Work & w, pb::SessionResponse & r, uint32_t hint_rows) {
    ChainState & c = s.chain;
    if (w.piece_more) {
        move_step(s, StepState::queued);  // later pieces wait here
        // an early piece of a split PREFILL step: its answer is only checked (pieces_in_flight)
        c.pieces_in_flight++;
        c.piece_header = r.header();
    } else {
        move_step(s, StepState::downstream);
        c.pending_header = r.header();
        c.pending_internal = w.internal;
        c.pending_t0 = w.t0;
        w.ticket.release();  // in flight downstream, no longer queued here
    }
    if (c.link == ChainLink::broken) {  // the answer is the link's error; the session ends with it
        DownReplyEvent ev{s.id, s.generation, {}};
        *ev.resp.mutable_error() = make_error(c.failed_reason, c.failed, true);
        return on(ev);
    }
    pb::SessionRequest fr;
    const uint32_t crc = r.header().payload_checksum().value();
    const bool opening = c.link == ChainLink::linked;  // the first frame down opens the session there
    const bool full = opening || !w.decode || !w.sample || c.fwd_sampling;
    if (full) {
        auto * f = fr.mutable_step();
        auto * h = f->mutable_header();
        h->set_schema_version(pb::SCHEMA_VERSION_V1);
        h->set_request_id(w.header.request_id());
        h->set_session_id(s.id);
        h->set_route_epoch(s.epoch);
        h->set_compatibility_fingerprint(c.hop.compatibility_fingerprint());
        *h->mutable_shard_range() = c.hop.range();
        h->set_effective_start(c.hop.range().start());
        h->set_phase(w.decode ? pb::PHASE_DECODE : pb::PHASE_PREFILL);
        h->mutable_positions()->set_start(w.pos0);
        h->mutable_positions()->set_end(w.pos0 + w.n);
        h->set_step(c.step);
        if (opening) {
            h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_EMPTY);
        } else {
            h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_POSITION);
            h->mutable_cache_expectation()->set_position(w.pos0);
        }
        h->set_compression(pb::COMPRESSION_NONE);
        h->mutable_payload_checksum()->set_algorithm(pb::CHECKSUM_ALGORITHM_CRC32);
        h->mutable_payload_checksum()->set_value(crc);
        *f->mutable_bundle() = std::move(*r.mutable_boundary());
        if (c.fwd_sampling) {
            *f->mutable_sampling() = *c.fwd_sampling;
            c.fwd_sampling.reset();
        }
        f->set_sample(w.sample);
        if (opening) {
            for (const auto & hop : c.rest) *f->add_downstream() = hop;
            f->set_pipelined(paced_by_pipeline(s));
        }
        if (hint_rows > 1) {
            f->mutable_batch()->set_id(fwd_batch_seq_);
            f->mutable_batch()->set_rows(hint_rows);
        }
    } else {
        auto * f = fr.mutable_fast_decode();
        f->set_session_id(s.id);
        f->set_route_epoch(s.epoch);
        f->set_step(c.step);
        f->set_position(w.pos0);
        *f->mutable_bundle() = std::move(*r.mutable_boundary());
        f->set_request_id(w.header.request_id());
        if (hint_rows > 1) {
            f->mutable_batch()->set_id(fwd_batch_seq_);
            f->mutable_batch()->set_rows(hint_rows);
        }
    }
    c.step++;
    if (opening) move_link(s, ChainLink::forwarding);
    c.sent_t0 = Clock::now();
    c.sent_decode = w.decode;
    const size_t bytes = c.down->send(std::move(fr));
    (w.decode ? metrics_.chain_frames_decode : metrics_.chain_frames_prefill)++;
    (w.decode ? metrics_.chain_bytes_decode : metrics_.chain_bytes_prefill) += bytes;
}

void Scheduler::on(DownReplyEvent & ev) {
    Session * sp = table_.find(ev.session_id);
    if (!sp || sp->generation != ev.generation ||
        !(sp->step == StepState::downstream || sp->chain.pieces_in_flight > 0)) {
        return;
    }
    Session & s = *sp;
    const pb::SessionResponse & d = ev.resp;
    s.last_used = Clock::now();
    // answers come in order: an early piece's before the step's last one
    const bool early_piece = s.chain.pieces_in_flight > 0;
    if (early_piece) {
        s.chain.pieces_in_flight--;
        if (d.result_case() == pb::SessionResponse::kTail) return;  // computed downstream; the step goes on
    } else {
        move_step(s, StepState::idle);
    }
    // an early piece that failed answers the client's frame (still queued or in flight here)
    const bool internal = early_piece ? !has_unanswered_frame(s) : s.chain.pending_internal;
    const pb::ResponseHeader hdr = early_piece ? s.chain.piece_header : s.chain.pending_header;
    const Clock::time_point t0 = early_piece ? Clock::now() : s.chain.pending_t0;
    auto sink = s.sink;
    if (d.result_case() != pb::SessionResponse::kTail) {
        pb::ShardError e = d.has_error() ? d.error()
                                         : make_error(pb::ERROR_REASON_INTERNAL, "answered without a TailOutput");
        blame_downstream(s, e);
        e.set_session_terminated(true);
        s.gen.active = false;
        drop_session(ev.session_id, EndKind::released);  // also ends the downstream stream
        if (sink) {  // the session is gone: the stream ends with the error's status
            pb::SessionResponse r;
            *r.mutable_header() = hdr;
            metrics_.step_errors++;
            metrics_.step_latency.observe(std::chrono::duration<double>(Clock::now() - t0).count());
            const grpc::Status st = status_with((grpc::StatusCode) e.grpc_code(), e.message(), e);
            *r.mutable_error() = std::move(e);
            sink->deliver(std::move(r), true, st);
        }
        return;
    }
    metrics_.observe_chain_hop(s.chain.sent_decode,
                               std::chrono::duration<double>(Clock::now() - s.chain.sent_t0).count());
    pb::SessionResponse r;
    *r.mutable_header() = hdr;
    *r.mutable_header()->mutable_payload_checksum() = d.header().payload_checksum();
    *r.mutable_tail() = d.tail();
    const bool has_token = d.tail().tokens_size() > 0;
    const int32_t sampled = has_token ? d.tail().tokens(0).token_id() : -1;
    const bool finished = has_token && d.tail().tokens(0).finish_reason() != pb::FINISH_REASON_UNSPECIFIED;
    complete_step(s, std::move(r), hdr, t0, internal, sampled, finished);
}

void Scheduler::on(DownEndEvent & ev) {
    Session * s = table_.find(ev.session_id);
    if (!s || s->generation != ev.generation || !s->chain.down) return;
    std::string why = "ended the session stream: " + code_name(ev.status.error_code());
    if (!ev.status.error_message().empty()) why += ": " + ev.status.error_message();
    const pb::ErrorReason reason = went_silent(ev.status) ? pb::ERROR_REASON_PEER_SILENT : pb::ERROR_REASON_UNAVAILABLE;
    if (s->step == StepState::downstream || s->chain.pieces_in_flight > 0) {
        DownReplyEvent rep{ev.session_id, ev.generation, {}};
        *rep.resp.mutable_error() = make_error(reason, why, true);  // blamed on the hop there
        return on(rep);
    }
    if (s->chain.link == ChainLink::broken) return;  // (reported once)
    move_link(*s, ChainLink::broken);
    s->chain.failed = why;
    s->chain.failed_reason = reason;
}

}  // namespace dgr::worker
