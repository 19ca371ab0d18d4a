// Chained routes (chain_forwarder.h): hops, links, forwarded frames, blame.
#include "worker/chain_forwarder.h"

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

bundle::ProtocolError refusal(pb::ErrorReason r, std::string msg) { return bundle::protocol_error(r, std::move(msg)); }

}  // namespace

bundle::Result ChainForwarder::check_hops(const pb::StepFrame & sf) const {
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

bool ChainForwarder::colocated(const pb::StepFrame & sf) const {
    return std::all_of(sf.downstream().begin(), sf.downstream().end(),
                       [this](const pb::ChainHop & h) { return peers_.check(h.endpoint()).loopback; });
}

void ChainForwarder::open(Session & s, const pb::StepFrame & sf, DownstreamLink::OnReply on_reply,
                          DownstreamLink::OnEnd on_end) {
    const pb::ChainHop & hop = sf.downstream(0);
    s.chain.hop = hop;
    s.chain.rest.assign(sf.downstream().begin() + 1, sf.downstream().end());
    s.chain.stages = 2 + (uint32_t) s.chain.rest.size();
    s.chain.colocated = colocated(sf);
    s.chain.down = peers_.open(peers_.check(hop.endpoint()), hop.endpoint(), std::move(on_reply), std::move(on_end));
    move_link(s, ChainLink::linked);
}

pb::SessionRequest ChainForwarder::frame_for(ChainState & c, const Session & s, const Work & w,
                                             pb::SessionResponse & r, bool pipelined, uint32_t hint_rows,
                                             uint64_t batch_id) {
    pb::SessionRequest fr;
    const uint32_t crc = r.header().payload_checksum().value();
    const bool opening = c.link == ChainLink::linked;  // the first frame down opens the session there
    const bool full = opening || !w.decode || !w.sample || c.fwd_sampling;
    pb::UpstreamBatch * batch = nullptr;
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
            f->set_pipelined(pipelined);
        }
        if (hint_rows > 1) batch = f->mutable_batch();
    } else {
        auto * f = fr.mutable_fast_decode();
        f->set_session_id(s.id);
        f->set_route_epoch(s.epoch);
        f->set_step(c.step);
        f->set_position(w.pos0);
        *f->mutable_bundle() = std::move(*r.mutable_boundary());
        f->set_request_id(w.header.request_id());
        if (hint_rows > 1) batch = f->mutable_batch();
    }
    if (batch) {
        batch->set_id(batch_id);
        batch->set_rows(hint_rows);
    }
    return fr;
}

std::string ChainForwarder::label(const Session & s) {
    return "downstream " + s.chain.hop.endpoint() + " [" + std::to_string(s.chain.hop.range().start()) + ", " +
           std::to_string(s.chain.hop.range().end()) + ")";
}

void ChainForwarder::blame(const Session & s, pb::ShardError & e) {
    e.set_message(label(s) + ": " + e.message());  // for people; clients read the fields
    if (!e.failed_endpoint().empty()) return;       // a Shard farther down failed: keep it
    e.set_failed_endpoint(s.chain.hop.endpoint());
    e.set_failed_start(s.chain.hop.range().start());
    e.set_failed_end(s.chain.hop.range().end());
}

// gRPC reports an expired keepalive only as UNAVAILABLE with gRPC core's own text, so that text
// is read here, once; the reason then travels typed (ERROR_REASON_PEER_SILENT).
pb::ErrorReason ChainForwarder::end_reason(const grpc::Status & st) {
    if (st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) return pb::ERROR_REASON_PEER_SILENT;
    if (st.error_code() != grpc::StatusCode::UNAVAILABLE) return pb::ERROR_REASON_UNAVAILABLE;
    const std::string & m = st.error_message();
    const bool silent = m.find("keepalive") != std::string::npos || m.find("ping timeout") != std::string::npos;
    return silent ? pb::ERROR_REASON_PEER_SILENT : pb::ERROR_REASON_UNAVAILABLE;
}

std::string ChainForwarder::end_message(const grpc::Status & st) {
    std::string why = "ended the session stream: " + code_name(st.error_code());
    if (!st.error_message().empty()) why += ": " + st.error_message();
    return why;
}

}  // namespace dgr::worker
