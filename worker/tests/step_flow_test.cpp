// The step flow on a chained head (worker/step_flow.h), driven directly on the fake model
// without the scheduler's thread: a computed step goes down the route (the frame counted, the
// client's ticket back, the session waiting downstream), the route's answer completes it with
// the client's header, a stale answer is dropped, and a link that ends while nothing is
// downstream breaks the session, whose next frame gets that error naming the hop. The link
// itself points at a closed loopback port: nothing listens, nothing leaves the host.
#include "worker/fake_backend.h"
#include "worker/frame_admission.h"
#include "worker/step_flow.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

class Sink final : public StreamSink {
public:
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status, bool) override {
        got.push_back(std::move(resp));
        ended = ended || terminal;
    }
    void resume() override {}
    void finish(grpc::Status) override { ended = true; }
    std::vector<pb::SessionResponse> got;
    bool ended = false;
};

FakeModelOptions head_model() {
    FakeModelOptions o;
    o.n_layer = 6;
    o.layer_start = 0;
    o.layer_end = 3;
    o.kv_cells = 64;
    o.n_seq_max = 2;
    return o;
}

const char * kHop = "127.0.0.1:1";

pb::SessionRequest opening(const FakeBackend & b, const std::vector<int32_t> & ids) {
    pb::SessionRequest req;
    auto * h = req.mutable_step()->mutable_header();
    h->set_schema_version(pb::SCHEMA_VERSION_V1);
    h->set_session_id("s");
    h->set_route_epoch(1);
    h->set_compatibility_fingerprint(b.info().fingerprint);
    h->mutable_shard_range()->set_start(0);
    h->mutable_shard_range()->set_end(3);
    h->set_phase(pb::PHASE_PREFILL);
    h->mutable_positions()->set_start(0);
    h->mutable_positions()->set_end((uint32_t) ids.size());
    h->set_request_id("req-7");
    h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_EMPTY);
    req.mutable_step()->set_sample(true);
    for (int32_t t : ids) req.mutable_step()->mutable_tokens()->add_token_ids(t);
    *h->mutable_payload_checksum() = dgr::bundle::crc_checksum(dgr::bundle::tokens_payload_crc(req.step().tokens()));
    auto * hop = req.mutable_step()->add_downstream();
    hop->set_endpoint(kHop);
    hop->mutable_range()->set_start(3);
    hop->mutable_range()->set_end(6);
    hop->set_compatibility_fingerprint(b.info().fingerprint);
    return req;
}

pb::SessionResponse tail_answer(int32_t token) {
    pb::SessionResponse r;
    auto * t = r.mutable_tail()->add_tokens();
    t->set_token_id(token);
    r.mutable_header()->mutable_payload_checksum()->set_value(99);
    return r;
}

void test_a_step_goes_down_and_its_answer_comes_back() {
    FakeBackend backend(head_model());
    Metrics metrics;
    SchedulerOptions o;
    o.max_sessions = 2;
    o.max_batch_tokens = 32;
    o.max_prefill_chunk_tokens = 16;
    SchedulerState st(backend, metrics, o,
                      LinkEvents{[](const std::string &, uint64_t, pb::SessionResponse) {},
                                 [](const std::string &, uint64_t, const grpc::Status &) {}});
    FrameAdmission admission(st);
    StepFlow flow(st);
    auto sink = std::make_shared<Sink>();
    FrameEvent ev{sink, std::make_unique<pb::SessionRequest>(opening(backend, {1, 2, 3})), Clock::now(),
                  FrameTicket::take(st.queued, 8)};
    admission.on(ev);
    Session * s = st.table.find("s");
    CHECK(s && s->chain.link == ChainLink::linked && s->chain.down, "the opening frame linked the session");
    if (!s) return;
    const uint64_t gen = s->generation;
    const std::weak_ptr<DownstreamLink> link = s->chain.down;
    flow.run_batch();
    CHECK(sink->got.empty(), "the head answered before the route did");
    CHECK(s->step == StepState::downstream && s->chain.link == ChainLink::forwarding && s->chain.step == 1,
          "the step is downstream (state %s, link %s)", step_state_name(s->step), chain_link_name(s->chain.link));
    CHECK(st.queued.load() == 0, "the client's ticket went back when the step left (%u out)", st.queued.load());
    CHECK(metrics.chain_frames_prefill.load() == 1 && metrics.chain_bytes_prefill.load() > 0, "one frame went down");
    CHECK(s->positions == 3 && st.table.kv_used() == 3, "the head holds its 3 positions");
    DownReplyEvent stale{"s", gen + 1, tail_answer(5)};
    flow.on(stale);
    CHECK(sink->got.empty() && s->step == StepState::downstream, "an older session's answer is dropped");
    DownReplyEvent reply{"s", gen, tail_answer(42)};
    flow.on(reply);
    CHECK(sink->got.size() == 1 && sink->got[0].tail().tokens(0).token_id() == 42 &&
              sink->got[0].header().request_id() == "req-7" && sink->got[0].header().session_id() == "s",
          "the route's token with the client's header");
    CHECK(s->step == StepState::idle && s->has_stored, "the step completed");
    // the link ends while nothing is downstream: the next frame gets that error, the session ends
    DownEndEvent end{"s", gen, grpc::Status(grpc::StatusCode::UNAVAILABLE, "keepalive watchdog timeout")};
    flow.on(end);
    CHECK(s->chain.link == ChainLink::broken && s->chain.failed_reason == pb::ERROR_REASON_PEER_SILENT,
          "the link is broken (%s)", chain_link_name(s->chain.link));
    pb::SessionRequest next;
    auto * f = next.mutable_fast_decode();
    f->set_session_id("s");
    f->set_route_epoch(1);
    f->set_step(1);
    f->set_position(3);
    f->set_token_id(42);
    FrameEvent ev2{sink, std::make_unique<pb::SessionRequest>(std::move(next)), Clock::now(), FrameTicket::take(st.queued, 8)};
    admission.on(ev2);
    CHECK(sink->got.size() == 2 && sink->got[1].has_error() &&
              sink->got[1].error().reason() == pb::ERROR_REASON_PEER_SILENT &&
              sink->got[1].error().failed_endpoint() == kHop && sink->got[1].error().failed_start() == 3 && sink->ended,
          "the next frame: the hop's error, blamed on it, and the stream ends");
    CHECK(st.table.size() == 0 && st.queued.load() == 0 && st.table.kv_used() == 0, "the session is gone");
    for (const auto & id : st.table.ids()) st.drop_session(id, EndKind::released);  // (closes any link)
    // the link's gRPC call ends on a gRPC thread, which lets the link go (OnDone); wait for that
    // (bounded) before the channel and the process go away: a call still ending during exit
    // aborted this program in about 1 run of 60 (gRPC's ref_counted.h: "prior > 0")
    for (int i = 0; i < 1000 && !link.expired(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    CHECK(link.expired(), "the downstream link's call ended");
}

}  // namespace

int main() {
    test_a_step_goes_down_and_its_answer_comes_back();
    finish_grpc_test("step_flow_test");
}
