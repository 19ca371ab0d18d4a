// The chain forwarder on its own (worker/chain_forwarder.h): an opening frame's hops checked
// against this worker and its allowed peers, the frames that carry steps down (the opening
// StepFrame, later ones, FastDecodeFrames, the upstream-batch hint), the blame a failed hop
// gets, and the reason a downstream stream's end becomes. No model, no network: no link opens.
#include "worker/chain_forwarder.h"

#include <string>

#include "check.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

BackendInfo head_info() {
    BackendInfo in;
    in.fingerprint = "fp";
    in.n_layer = 8;
    in.layer_start = 0;
    in.layer_end = 3;
    in.head = true;
    in.n_embd = 4;
    in.n_vocab = 32;
    return in;
}

pb::ChainHop hop(const std::string & ep, uint32_t a, uint32_t b, const std::string & fp = "fp") {
    pb::ChainHop h;
    h.set_endpoint(ep);
    h.mutable_range()->set_start(a);
    h.mutable_range()->set_end(b);
    h.set_compatibility_fingerprint(fp);
    return h;
}

std::string reason(const dgr::bundle::Result & r) { return r ? pb::ErrorReason_Name(r->reason) : "ok"; }

void test_hops() {
    const BackendInfo in = head_info();
    ChainForwarder fwd(in, ChainOptions{});
    pb::StepFrame sf;
    *sf.add_downstream() = hop("127.0.0.1:7001", 3, 6);
    *sf.add_downstream() = hop("127.0.0.1:7002", 6, 8);
    CHECK(reason(fwd.check_hops(sf)) == "ok", "a good route: %s", reason(fwd.check_hops(sf)).c_str());
    CHECK(fwd.colocated(sf), "loopback hops are on this host");
    pb::StepFrame gap = sf;
    gap.mutable_downstream(1)->mutable_range()->set_start(7);
    CHECK(reason(fwd.check_hops(gap)) == "ERROR_REASON_RANGE_MISMATCH", "a gap between hops");
    pb::StepFrame short_route;
    *short_route.add_downstream() = hop("127.0.0.1:7001", 3, 6);
    CHECK(reason(fwd.check_hops(short_route)) == "ERROR_REASON_RANGE_MISMATCH", "a route short of the last layer");
    pb::StepFrame fp = sf;
    fp.mutable_downstream(0)->set_compatibility_fingerprint("other");
    CHECK(reason(fwd.check_hops(fp)) == "ERROR_REASON_FINGERPRINT_MISMATCH", "another model's hop");
    pb::StepFrame remote = sf;
    remote.mutable_downstream(1)->set_endpoint("203.0.113.9:7002");
    const dgr::bundle::Result r = fwd.check_hops(remote);
    CHECK(reason(r) == "ERROR_REASON_BAD_REQUEST" && r->message.find("--chain-peers") != std::string::npos,
          "a peer outside the default allowlist: %s", reason(r).c_str());
    BackendInfo tail = head_info();
    tail.tail = true;
    ChainForwarder tf(tail, ChainOptions{});
    CHECK(reason(tf.check_hops(sf)) == "ERROR_REASON_BAD_REQUEST", "the tail has no downstream");
    ChainOptions any;
    any.peers = {"*"};
    ChainForwarder open_fwd(in, any);
    CHECK(reason(open_fwd.check_hops(remote)) == "ok", "'*' allows any peer");
}

void test_frames() {
    SessionTable table(2, 2);
    Session & s = table.open("s", 4);
    s.chain.hop = hop("127.0.0.1:7001", 3, 6);
    s.chain.rest = {hop("127.0.0.1:7002", 6, 8)};
    move_link(s, ChainLink::linked);
    Work w;
    w.decode = false;
    w.sample = true;
    w.pos0 = 0;
    w.n = 3;
    w.header.set_request_id("req-1");
    pb::SessionResponse r;
    r.mutable_header()->mutable_payload_checksum()->set_value(1234);
    r.mutable_boundary()->add_tensors()->set_name("residual");
    s.chain.fwd_sampling = std::make_unique<pb::SamplingParams>();
    s.chain.fwd_sampling->set_seed(9);
    pb::SessionRequest open = ChainForwarder::frame_for(s.chain, s, w, r, /*pipelined=*/true, 0, 0);
    CHECK(open.has_step(), "the opening frame is a StepFrame");
    const auto & h = open.step().header();
    CHECK(h.cache_expectation().kind() == pb::CACHE_EXPECTATION_KIND_EMPTY && h.step() == 0 && h.route_epoch() == 4 &&
              h.session_id() == "s" && h.shard_range().start() == 3 && h.shard_range().end() == 6 &&
              h.payload_checksum().value() == 1234 && h.request_id() == "req-1" && h.phase() == pb::PHASE_PREFILL &&
              h.positions().end() == 3,
          "opening header");
    CHECK(open.step().downstream_size() == 1 && open.step().downstream(0).endpoint() == "127.0.0.1:7002" &&
              open.step().pipelined(),
          "the rest of the route goes with the opening frame");
    CHECK(open.step().sampling().seed() == 9 && !s.chain.fwd_sampling, "the sampling contract goes down once");
    CHECK(open.step().bundle().tensors_size() == 1, "the boundary rows go down");
    // the scheduler then moves the link on; a later DECODE row with nothing new is a fast frame
    s.chain.step = 1;
    move_link(s, ChainLink::forwarding);
    Work d;
    d.decode = true;
    d.sample = true;
    d.pos0 = 3;
    d.n = 1;
    pb::SessionResponse rd;
    rd.mutable_boundary()->add_tensors()->set_name("residual");
    pb::SessionRequest fast = ChainForwarder::frame_for(s.chain, s, d, rd, true, 4, 17);
    CHECK(fast.has_fast_decode() && fast.fast_decode().step() == 1 && fast.fast_decode().position() == 3 &&
              fast.fast_decode().batch().id() == 17 && fast.fast_decode().batch().rows() == 4,
          "a later DECODE row: a FastDecodeFrame with the batch hint");
    pb::SessionResponse rp;
    rp.mutable_boundary()->add_tensors()->set_name("residual");
    Work p = std::move(d);
    p.decode = false;
    pb::SessionRequest later = ChainForwarder::frame_for(s.chain, s, p, rp, true, 1, 18);
    CHECK(later.has_step() && later.step().header().cache_expectation().kind() == pb::CACHE_EXPECTATION_KIND_POSITION &&
              later.step().header().cache_expectation().position() == 3 && later.step().downstream_size() == 0 &&
              !later.step().has_batch(),
          "a later PREFILL step: a StepFrame expecting the positions, no hops, no hint for one row");
}

void test_blame_and_end_reasons() {
    SessionTable table(2, 2);
    Session & s = table.open("s", 1);
    s.chain.hop = hop("127.0.0.1:7001", 3, 6);
    pb::ShardError e;
    e.set_message("boom");
    ChainForwarder::blame(s, e);
    CHECK(e.failed_endpoint() == "127.0.0.1:7001" && e.failed_start() == 3 && e.failed_end() == 6 &&
              e.message() == "downstream 127.0.0.1:7001 [3, 6): boom",
          "the next hop blamed: %s", e.message().c_str());
    pb::ShardError far;
    far.set_failed_endpoint("127.0.0.1:7002");
    far.set_failed_start(6);
    ChainForwarder::blame(s, far);
    CHECK(far.failed_endpoint() == "127.0.0.1:7002" && far.failed_start() == 6, "a Shard farther down stays blamed");
    using grpc::StatusCode;
    CHECK(ChainForwarder::end_reason(grpc::Status(StatusCode::UNAVAILABLE, "keepalive watchdog timeout")) ==
              pb::ERROR_REASON_PEER_SILENT,
          "keepalive");
    CHECK(ChainForwarder::end_reason(grpc::Status(StatusCode::DEADLINE_EXCEEDED, "")) == pb::ERROR_REASON_PEER_SILENT,
          "deadline");
    CHECK(ChainForwarder::end_reason(grpc::Status(StatusCode::UNAVAILABLE, "Connection reset by peer")) ==
              pb::ERROR_REASON_UNAVAILABLE,
          "a reset");
    CHECK(ChainForwarder::end_reason(grpc::Status(StatusCode::INTERNAL, "ping timeout")) == pb::ERROR_REASON_UNAVAILABLE,
          "only UNAVAILABLE's text is read");
    CHECK(ChainForwarder::end_message(grpc::Status(StatusCode::CANCELLED, "gone")) ==
              "ended the session stream: CANCELLED: gone",
          "message: %s", ChainForwarder::end_message(grpc::Status(StatusCode::CANCELLED, "gone")).c_str());
}

}  // namespace

int main() {
    test_hops();
    test_frames();
    test_blame_and_end_reasons();
    finish_grpc_test("chain_forwarder_test");
}
