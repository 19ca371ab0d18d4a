// The frame admission and the step flow (worker/frame_admission.h, worker/step_flow.h) driven
// directly on the fake model, without the scheduler's thread: each frame is handed to the
// admission, each batch run by the step flow, so every count can be checked between steps --
// sessions, KV cells reserved and used, frame tickets out -- and the tokens compared with the
// whole fake model's.
#include "worker/fake_backend.h"
#include "worker/frame_admission.h"
#include "worker/step_flow.h"

#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "fake_reference.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

class Sink final : public StreamSink {
public:
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status, bool) override {
        got.push_back(std::move(resp));
        ended = ended || terminal;
    }
    void resume() override { resumes++; }
    void finish(grpc::Status) override { ended = true; }
    std::vector<pb::SessionResponse> got;
    int resumes = 0;
    bool ended = false;
};

FakeModelOptions model() {
    FakeModelOptions o;
    o.n_layer = 6;
    o.kv_cells = 128;
    o.n_seq_max = 2;
    return o;
}

SchedulerOptions options() {
    SchedulerOptions o;
    o.max_sessions = 2;
    o.kv_cells = 128;
    o.max_session_positions = 32;
    o.max_prefill_chunk_tokens = 16;
    o.max_batch_tokens = 32;
    return o;
}

struct Rig {
    FakeBackend backend{model()};
    Metrics metrics;
    SchedulerState st{backend, metrics, options(), LinkEvents{[](const std::string &, uint64_t, pb::SessionResponse) {},
                                                               [](const std::string &, uint64_t, const grpc::Status &) {}}};
    FrameAdmission admission{st};
    StepFlow flow{st};

    void send(const std::shared_ptr<Sink> & sink, pb::SessionRequest req) {
        FrameEvent ev{sink, std::make_unique<pb::SessionRequest>(std::move(req)), Clock::now(),
                      FrameTicket::take(st.queued, 64)};
        admission.on(ev);
    }
    void expect_settled(const char * after) {
        CHECK(st.queued.load() == 0 && st.queue.empty(), "after %s: %u ticket(s) out", after, st.queued.load());
        CHECK(st.table.check().empty(), "after %s: %s", after, st.table.check().c_str());
    }
};

pb::SessionRequest step(const Rig & r, const std::string & sid, uint64_t epoch, uint64_t n, pb::Phase phase, uint32_t p0,
                        const std::vector<int32_t> & ids) {
    pb::SessionRequest req;
    auto * h = req.mutable_step()->mutable_header();
    h->set_schema_version(pb::SCHEMA_VERSION_V1);
    h->set_session_id(sid);
    h->set_route_epoch(epoch);
    h->set_compatibility_fingerprint(r.backend.info().fingerprint);
    h->mutable_shard_range()->set_start(0);
    h->mutable_shard_range()->set_end(r.backend.info().n_layer);
    h->set_phase(phase);
    h->mutable_positions()->set_start(p0);
    h->mutable_positions()->set_end(p0 + (uint32_t) ids.size());
    h->set_step(n);
    h->mutable_cache_expectation()->set_kind(n == 0 ? pb::CACHE_EXPECTATION_KIND_EMPTY : pb::CACHE_EXPECTATION_KIND_POSITION);
    h->mutable_cache_expectation()->set_position(p0);
    req.mutable_step()->set_sample(!ids.empty());
    for (int32_t t : ids) req.mutable_step()->mutable_tokens()->add_token_ids(t);
    *h->mutable_payload_checksum() = dgr::bundle::crc_checksum(dgr::bundle::tokens_payload_crc(req.step().tokens()));
    return req;
}

pb::SessionRequest fast(const std::string & sid, uint64_t epoch, uint64_t n, uint32_t pos, int32_t token) {
    pb::SessionRequest req;
    auto * f = req.mutable_fast_decode();
    f->set_session_id(sid);
    f->set_route_epoch(epoch);
    f->set_step(n);
    f->set_position(pos);
    f->set_token_id(token);
    return req;
}

int32_t token_of(const pb::SessionResponse & r) {
    return r.has_tail() && r.tail().tokens_size() == 1 ? r.tail().tokens(0).token_id() : -1;
}
std::string reason_of(const pb::SessionResponse & r) {
    return r.has_error() ? pb::ErrorReason_Name(r.error().reason()) : "ok";
}

void test_a_session_step_by_step() {
    Rig r;
    auto sink = std::make_shared<Sink>();
    const std::vector<int32_t> prompt = {5, 6, 7, 8};
    const std::vector<int32_t> ref = fake_greedy_reference(model(), prompt, 3);
    r.send(sink, step(r, "a", 1, 0, pb::PHASE_PREFILL, 0, prompt));
    CHECK(sink->got.empty() && r.st.queued.load() == 1 && r.st.table.size() == 1 && r.st.table.kv_reserved() == 4,
          "admitted: %zu answers, %u tickets, %llu reserved", sink->got.size(), r.st.queued.load(),
          (unsigned long long) r.st.table.kv_reserved());
    r.flow.run_batch();
    CHECK(sink->got.size() == 1 && token_of(sink->got[0]) == ref[0], "prompt token %d, want %d",
          sink->got.empty() ? -1 : token_of(sink->got[0]), ref[0]);
    r.expect_settled("the prompt");
    CHECK(r.st.table.kv_used() == 4 && r.st.table.kv_reserved() == 0, "KV used %llu", (unsigned long long) r.st.table.kv_used());
    r.send(sink, fast("a", 1, 1, 4, ref[0]));
    r.flow.run_batch();
    r.send(sink, fast("a", 1, 2, 5, ref[1]));
    r.flow.run_batch();
    CHECK(sink->got.size() == 3 && token_of(sink->got[1]) == ref[1] && token_of(sink->got[2]) == ref[2],
          "decode tokens match the whole model");
    r.expect_settled("decoding");
    // a replay of the last step: the stored answer again, nothing computed
    const uint64_t batches = r.metrics.batches.load();
    r.send(sink, fast("a", 1, 2, 5, ref[1]));
    CHECK(sink->got.size() == 4 && sink->got[3].header().replayed() && token_of(sink->got[3]) == ref[2] &&
              r.st.queue.empty() && r.metrics.batches.load() == batches,
          "replay answered from the store");
    // a refused frame: answered at once, its ticket back, nothing changed
    r.send(sink, fast("a", 1, 7, 6, ref[2]));
    CHECK(sink->got.size() == 5 && reason_of(sink->got[4]) == "ERROR_REASON_STEP_OUT_OF_ORDER", "skipped step: %s",
          reason_of(sink->got.back()).c_str());
    r.expect_settled("a refusal");
    CHECK(r.st.table.find("a")->positions == 6, "positions %u", r.st.table.find("a")->positions);
    // RELEASE ends the session: its cells are free and its tombstone answers later frames
    r.send(sink, step(r, "a", 1, 3, pb::PHASE_RELEASE, 6, {}));
    CHECK(sink->got.size() == 6 && reason_of(sink->got[5]) == "ok" && r.st.table.size() == 0 &&
              r.st.table.kv_used() == 0 && r.st.active.load() == 0,
          "release: %s", reason_of(sink->got.back()).c_str());
    r.send(sink, fast("a", 1, 4, 6, 1));
    CHECK(reason_of(sink->got.back()) == "ERROR_REASON_SESSION_RELEASED", "after release: %s",
          reason_of(sink->got.back()).c_str());
    r.expect_settled("the release");
}

void test_admission_limits() {
    Rig r;
    auto a = std::make_shared<Sink>(), b = std::make_shared<Sink>(), c = std::make_shared<Sink>();
    r.send(a, step(r, "a", 1, 0, pb::PHASE_PREFILL, 0, {1, 2}));
    r.send(b, step(r, "b", 1, 0, pb::PHASE_PREFILL, 0, {3, 4}));
    // both sessions have a step queued: neither can be evicted for a third
    r.send(c, step(r, "c", 1, 0, pb::PHASE_PREFILL, 0, {5}));
    CHECK(c->got.size() == 1 && reason_of(c->got[0]) == "ERROR_REASON_OVER_BUDGET" && c->got[0].error().limit() == 2 &&
              r.metrics.rejected_sessions.load() == 1,
          "a third session: %s", c->got.empty() ? "no answer" : reason_of(c->got[0]).c_str());
    CHECK(r.st.queued.load() == 2, "the two admitted frames' tickets are out (%u)", r.st.queued.load());
    r.flow.run_batch();
    CHECK(a->got.size() == 1 && b->got.size() == 1 && r.metrics.batch_rows.load() == 4, "one batch for both prompts");
    r.expect_settled("two prompts");
    // a step beyond max_session_positions
    std::vector<int32_t> many(31, 9);
    r.send(a, step(r, "a", 1, 1, pb::PHASE_PREFILL, 2, std::vector<int32_t>(many.begin(), many.begin() + 16)));
    r.flow.run_batch();
    r.send(a, step(r, "a", 1, 2, pb::PHASE_PREFILL, 18, std::vector<int32_t>(many.begin(), many.begin() + 15)));
    CHECK(reason_of(a->got.back()) == "ERROR_REASON_OVER_BUDGET" && a->got.back().error().limit() == 32,
          "33 positions of 32: %s", reason_of(a->got.back()).c_str());
    r.expect_settled("the limits");
}

void test_generation_and_a_failed_batch() {
    Rig r;
    auto sink = std::make_shared<Sink>();
    const std::vector<int32_t> prompt = {11, 12, 13};
    const std::vector<int32_t> ref = fake_greedy_reference(model(), prompt, 4);
    pb::SessionRequest req = step(r, "g", 1, 0, pb::PHASE_PREFILL, 0, prompt);
    req.mutable_step()->mutable_generate()->set_max_tokens(4);
    req.mutable_step()->mutable_sampling()->set_mode(pb::SAMPLING_MODE_GREEDY);
    r.send(sink, std::move(req));
    for (int i = 0; i < 4; ++i) r.flow.run_batch();
    std::vector<int32_t> got;
    for (const auto & a : sink->got) got.push_back(token_of(a));
    CHECK(got == ref, "generated %zu tokens: %s", got.size(), got == ref ? "equal" : "differ");
    CHECK(!r.st.table.find("g")->gen.active && r.metrics.generated_tokens.load() == 3, "generation ended");
    r.expect_settled("generation");
    // the model refuses a batch (no KV slot): the step is answered OVER_BUDGET, the session stays
    FakeModelOptions tight = model();
    tight.kv_cells = 4;
    FakeBackend small(tight);
    Metrics m;
    SchedulerOptions o = options();
    o.kv_cells = 32;  // the budget admits more than the model then holds
    SchedulerState st(small, m, o, LinkEvents{[](const std::string &, uint64_t, pb::SessionResponse) {},
                                              [](const std::string &, uint64_t, const grpc::Status &) {}});
    FrameAdmission adm(st);
    StepFlow flow(st);
    auto s2 = std::make_shared<Sink>();
    FrameEvent ev{s2, std::make_unique<pb::SessionRequest>(step(r, "x", 1, 0, pb::PHASE_PREFILL, 0, {1, 2, 3})),
                  Clock::now(), FrameTicket::take(st.queued, 64)};
    ev.req->mutable_step()->mutable_header()->set_compatibility_fingerprint(small.info().fingerprint);
    adm.on(ev);
    flow.run_batch();  // 3 of 4 cells
    FrameEvent ev2{s2, std::make_unique<pb::SessionRequest>(step(r, "x", 1, 1, pb::PHASE_PREFILL, 3, {4, 5})),
                   Clock::now(), FrameTicket::take(st.queued, 64)};
    ev2.req->mutable_step()->mutable_header()->set_compatibility_fingerprint(small.info().fingerprint);
    adm.on(ev2);
    flow.run_batch();  // 5 of 4 cells: refused by the model
    CHECK(s2->got.size() == 2 && reason_of(s2->got[1]) == "ERROR_REASON_OVER_BUDGET" && !s2->ended,
          "no KV slot: %s", s2->got.size() < 2 ? "no answer" : reason_of(s2->got[1]).c_str());
    const Session * x = st.table.find("x");
    CHECK(x && x->positions == 3 && !x->busy() && st.table.kv_reserved() == 0 && st.queued.load() == 0,
          "the session stays as it was");
}

}  // namespace

int main() {
    test_a_session_step_by_step();
    test_admission_limits();
    test_generation_and_a_failed_batch();
    if (g_failures) {
        std::fprintf(stderr, "frame_admission_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("frame_admission_test: ok\n");
    return 0;
}
