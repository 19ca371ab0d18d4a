// The scheduler of dgr-worker driven through the fake model (worker/fake_backend.h), without
// gRPC: frames go in through post_frame like the Session reactor posts them, answers come out
// of a recording StreamSink. Expected tokens come from the same fake model run directly.
// Over 500 lines on purpose: one CTest program, one scenario per function, sharing its harness.
#include "worker/errors.h"
#include "worker/fake_backend.h"
#include "worker/scheduler.h"

#include "google/rpc/status.pb.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <string>
#include <vector>

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

#include "check.h"
#include "fake_reference.h"

namespace {

// Records what the scheduler hands to a stream; waits (bounded) for the n-th answer.
class Sink final : public StreamSink {
public:
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status status, bool) override {
        std::lock_guard<std::mutex> lk(mu_);
        got_.push_back(std::move(resp));
        if (terminal) {
            ended_ = true;
            final_ = status;
        }
        cv_.notify_all();
    }
    void resume() override {
        std::lock_guard<std::mutex> lk(mu_);
        resumes_++;
        cv_.notify_all();
    }
    void finish(grpc::Status status) override {
        std::lock_guard<std::mutex> lk(mu_);
        ended_ = true;
        final_ = status;
        cv_.notify_all();
    }
    // The n-th answer (1-based); an empty response (and a failure) if it does not come in 20 s.
    pb::SessionResponse answer(size_t n) {
        std::unique_lock<std::mutex> lk(mu_);
        if (!cv_.wait_for(lk, std::chrono::seconds(20), [&] { return got_.size() >= n; })) {
            CHECK(false, "answer %zu did not come (got %zu)", n, got_.size());
            return {};
        }
        return got_[n - 1];
    }
    int resumes_wait(int n) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait_for(lk, std::chrono::seconds(20), [&] { return resumes_ >= n; });
        return resumes_;
    }
    size_t count() {
        std::lock_guard<std::mutex> lk(mu_);
        return got_.size();
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<pb::SessionResponse> got_;
    int resumes_ = 0;
    bool ended_ = false;
    grpc::Status final_;
};

FakeModelOptions model(uint32_t start = 0, uint32_t end = 0) {
    FakeModelOptions o;
    o.n_layer = 8;
    o.layer_start = start;
    o.layer_end = end;
    o.kv_cells = 256;
    o.n_seq_max = 4;
    return o;
}

SchedulerOptions options() {
    SchedulerOptions o;
    o.max_sessions = 4;
    o.kv_cells = 256;
    o.max_session_positions = 64;
    o.max_prefill_chunk_tokens = 16;
    o.max_batch_tokens = 64;
    return o;
}

// Greedy tokens of the whole fake model for `prompt` then `n - 1` fed-back tokens.
std::vector<int32_t> reference(const std::vector<int32_t> & prompt, int n) {
    return fake_greedy_reference(model(), prompt, n);
}

// Builds the frames of one session.
struct Frames {
    std::string sid;
    uint64_t epoch = 1;
    std::string fingerprint;
    uint32_t start = 0, end = 8;
    uint64_t step = 0;
    uint32_t pos = 0;

    pb::SessionRequest step_frame(pb::Phase phase, uint32_t p0, uint32_t p1) const {
        pb::SessionRequest req;
        auto * h = req.mutable_step()->mutable_header();
        h->set_schema_version(pb::SCHEMA_VERSION_V1);
        h->set_session_id(sid);
        h->set_route_epoch(epoch);
        h->set_compatibility_fingerprint(fingerprint);
        h->mutable_shard_range()->set_start(start);
        h->mutable_shard_range()->set_end(end);
        h->set_phase(phase);
        h->mutable_positions()->set_start(p0);
        h->mutable_positions()->set_end(p1);
        h->set_step(step);
        h->mutable_cache_expectation()->set_kind(step == 0 ? pb::CACHE_EXPECTATION_KIND_EMPTY
                                                           : pb::CACHE_EXPECTATION_KIND_POSITION);
        h->mutable_cache_expectation()->set_position(p0);
        req.mutable_step()->set_sample(true);
        return req;
    }
    pb::SessionRequest tokens(const std::vector<int32_t> & ids, pb::Phase phase = pb::PHASE_PREFILL) const {
        pb::SessionRequest req = step_frame(phase, pos, pos + (uint32_t) ids.size());
        for (int32_t t : ids) req.mutable_step()->mutable_tokens()->add_token_ids(t);
        *req.mutable_step()->mutable_header()->mutable_payload_checksum() =
            dgr::bundle::crc_checksum(dgr::bundle::tokens_payload_crc(req.step().tokens()));
        return req;
    }
    pb::SessionRequest fast(int32_t token) const {
        pb::SessionRequest req;
        auto * f = req.mutable_fast_decode();
        f->set_session_id(sid);
        f->set_route_epoch(epoch);
        f->set_step(step);
        f->set_position(pos);
        f->set_token_id(token);
        return req;
    }
};

struct Worker {
    explicit Worker(FakeModelOptions m = model(), SchedulerOptions o = options())
        : backend(m), sched(backend, metrics, o) {
        sched.start();
    }
    // Invariant after every scenario: every frame's ticket went back once its answer came (each
    // scenario waits for its answers), and stopping leaves no session, KV cell or ticket.
    ~Worker() {
        const auto until = Clock::now() + std::chrono::seconds(5);
        while (sched.gauges().queued_steps != 0 && Clock::now() < until) {
            std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        CHECK(sched.gauges().queued_steps == 0, "%u frame(s) still counted as queued after the scenario",
              sched.gauges().queued_steps);
        sched.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "test over"));
        const Gauges g = sched.gauges();
        CHECK(g.queued_steps == 0 && g.active_sessions == 0 && g.kv_cells_used == 0,
              "after stop: %u queued, %u sessions, %llu KV cells", g.queued_steps, g.active_sessions,
              (unsigned long long) g.kv_cells_used);
        const std::string drift = sched.audit();
        CHECK(drift.empty(), "after stop: %s", drift.c_str());
    }
    Frames frames(const std::string & sid) const {
        Frames f;
        f.sid = sid;
        f.fingerprint = backend.info().fingerprint;
        f.start = backend.info().layer_start;
        f.end = backend.info().layer_end;
        return f;
    }
    void post(const std::shared_ptr<Sink> & sink, pb::SessionRequest req) {
        CHECK(sched.post_frame(sink, std::make_unique<pb::SessionRequest>(std::move(req)), Clock::now()), "queue full");
    }
    FakeBackend backend;
    Metrics metrics;
    Scheduler sched;
};

int32_t token_of(const pb::SessionResponse & r) {
    return r.has_tail() && r.tail().tokens_size() == 1 ? r.tail().tokens(0).token_id() : -1;
}

std::string reason_of(const pb::SessionResponse & r) {
    return r.has_error() ? pb::ErrorReason_Name(r.error().reason()) : "ok";
}

// prompt, then n-1 decode steps (FastDecodeFrames); the tokens answered.
std::vector<int32_t> generate(Worker & w, const std::shared_ptr<Sink> & sink, Frames & f,
                              const std::vector<int32_t> & prompt, int n, size_t * answers) {
    std::vector<int32_t> out;
    w.post(sink, f.tokens(prompt));
    pb::SessionResponse r = sink->answer(++*answers);
    CHECK(!r.has_error(), "prefill: %s", r.error().message().c_str());
    out.push_back(token_of(r));
    f.pos += (uint32_t) prompt.size();
    for (int i = 1; i < n; ++i) {
        f.step++;
        w.post(sink, f.fast(out.back()));
        r = sink->answer(++*answers);
        CHECK(!r.has_error(), "decode %d: %s", i, r.error().message().c_str());
        out.push_back(token_of(r));
        f.pos++;
    }
    return out;
}

void test_prefill_and_decode_give_the_model_tokens() {
    Worker w;
    auto sink = std::make_shared<Sink>();
    Frames f = w.frames("a");
    size_t n = 0;
    const std::vector<int32_t> got = generate(w, sink, f, {1, 2, 3, 4, 5}, 6, &n);
    const std::vector<int32_t> want = reference({1, 2, 3, 4, 5}, 6);
    CHECK(got == want, "scheduler tokens differ from the model run directly");
    const pb::SessionResponse last = sink->answer(n);
    CHECK(last.header().cached_positions() == 10, "cached positions %u", last.header().cached_positions());
    CHECK(w.metrics.prefill_tokens == 5 && w.metrics.decode_tokens == 5, "rows %llu/%llu",
          (unsigned long long) w.metrics.prefill_tokens.load(), (unsigned long long) w.metrics.decode_tokens.load());
}

void test_two_sessions_are_isolated() {
    Worker w;
    auto sa = std::make_shared<Sink>(), sb = std::make_shared<Sink>();
    Frames a = w.frames("a"), b = w.frames("b");
    // interleaved: both prompts queued before either is answered, then decode steps alternate
    w.post(sa, a.tokens({7, 8, 9}));
    w.post(sb, b.tokens({40, 41}));
    std::vector<int32_t> ta{token_of(sa->answer(1))}, tb{token_of(sb->answer(1))};
    a.pos = 3;
    b.pos = 2;
    for (int i = 1; i < 5; ++i) {
        a.step++;
        b.step++;
        w.post(sa, a.fast(ta.back()));
        w.post(sb, b.fast(tb.back()));
        ta.push_back(token_of(sa->answer(i + 1)));
        tb.push_back(token_of(sb->answer(i + 1)));
        a.pos++;
        b.pos++;
    }
    CHECK(ta == reference({7, 8, 9}, 5), "session a differs from its run alone");
    CHECK(tb == reference({40, 41}, 5), "session b differs from its run alone");
}

void test_release_frees_kv_cells() {
    Worker w;
    auto sink = std::make_shared<Sink>();
    Frames f = w.frames("r");
    size_t n = 0;
    generate(w, sink, f, {1, 2, 3, 4}, 3, &n);  // 4 + 2 positions
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    pb::ReleaseSessionResponse rel;
    pb::ReleaseSessionRequest req;
    req.set_session_id("r");
    w.sched.post_release(req, [&](pb::ReleaseSessionResponse r) {
        std::lock_guard<std::mutex> lk(mu);
        rel = r;
        done = true;
        cv.notify_all();
    });
    {
        std::unique_lock<std::mutex> lk(mu);
        cv.wait_for(lk, std::chrono::seconds(20), [&] { return done; });
    }
    CHECK(done && rel.released() && rel.freed_kv_cells() == 6, "released %d freed %llu", rel.released(),
          (unsigned long long) rel.freed_kv_cells());
    // the released epoch is refused; a new epoch opens on the freed cells
    f.step++;
    w.post(sink, f.fast(1));
    CHECK(reason_of(sink->answer(++n)) == "ERROR_REASON_SESSION_RELEASED", "after release");
    Frames g = w.frames("r");
    g.epoch = 2;
    w.post(sink, g.tokens({1, 2, 3, 4}));
    const pb::SessionResponse r = sink->answer(++n);
    CHECK(!r.has_error() && token_of(r) == reference({1, 2, 3, 4}, 1)[0], "new epoch: %s", reason_of(r).c_str());
}

void test_state_errors_name_the_reason() {
    Worker w;
    auto sink = std::make_shared<Sink>();
    Frames f = w.frames("s");
    f.epoch = 2;
    size_t n = 0;
    generate(w, sink, f, {5, 6, 7}, 1, &n);
    // an older epoch
    Frames old = f;
    old.epoch = 1;
    old.step = 1;
    w.post(sink, old.tokens({1}));
    pb::SessionResponse r = sink->answer(++n);
    CHECK(reason_of(r) == "ERROR_REASON_STALE_EPOCH" && r.error().current_epoch() == 2 &&
              r.error().grpc_code() == (int) grpc::StatusCode::ABORTED && !r.error().session_terminated(),
          "stale epoch: %s", reason_of(r).c_str());
    // a gap in the positions
    f.step = 1;
    Frames gap = f;
    gap.pos = 5;
    w.post(sink, gap.tokens({1}));
    r = sink->answer(++n);
    CHECK(reason_of(r) == "ERROR_REASON_CACHE_MISS" || reason_of(r) == "ERROR_REASON_POSITION_GAP",
          "gap: %s", reason_of(r).c_str());
    pb::SessionRequest g2 = f.tokens({1});
    g2.mutable_step()->mutable_header()->mutable_positions()->set_start(4);
    g2.mutable_step()->mutable_header()->mutable_positions()->set_end(5);
    g2.mutable_step()->mutable_header()->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_UNSPECIFIED);
    w.post(sink, g2);
    r = sink->answer(++n);
    CHECK(reason_of(r) == "ERROR_REASON_POSITION_GAP" && r.error().cached_positions() == 3, "position gap: %s %u",
          reason_of(r).c_str(), r.error().cached_positions());
    // a step out of order, and a replay of the last one
    Frames skip = f;
    skip.step = 3;
    skip.pos = 3;
    w.post(sink, skip.tokens({1}));
    r = sink->answer(++n);
    CHECK(reason_of(r) == "ERROR_REASON_STEP_OUT_OF_ORDER" && r.error().last_step() == 0, "step order: %s",
          reason_of(r).c_str());
    Frames again = f;
    again.step = 0;
    again.pos = 0;
    w.post(sink, again.tokens({5, 6, 7}));
    r = sink->answer(++n);
    CHECK(!r.has_error() && r.header().replayed() && token_of(r) == reference({5, 6, 7}, 1)[0], "replay");
    // stateless checks of the validator run in the scheduler
    pb::SessionRequest bad = f.tokens({1});
    bad.mutable_step()->mutable_header()->set_compatibility_fingerprint("other");
    w.post(sink, bad);
    CHECK(reason_of(sink->answer(++n)) == "ERROR_REASON_FINGERPRINT_MISMATCH", "fingerprint");
    bad = f.tokens({1000});
    f.pos = 3;
    bad = f.tokens({1000});
    w.post(sink, bad);
    CHECK(reason_of(sink->answer(++n)) == "ERROR_REASON_TOKEN_OUT_OF_VOCAB", "vocab");
    bad = f.tokens({1});
    bad.mutable_step()->mutable_sampling()->set_top_logprobs(65);
    w.post(sink, bad);
    CHECK(reason_of(sink->answer(++n)) == "ERROR_REASON_BAD_REQUEST", "top_logprobs cap");
    bad = f.tokens({1});
    bad.mutable_step()->mutable_header()->mutable_payload_checksum()->set_value(12345);
    w.post(sink, bad);
    CHECK(reason_of(sink->answer(++n)) == "ERROR_REASON_BAD_BUNDLE", "payload checksum");
    // after all refusals the session still decodes from where it was
    w.post(sink, f.tokens({1}));
    r = sink->answer(++n);
    CHECK(!r.has_error() && r.header().cached_positions() == 4, "session intact: %s", reason_of(r).c_str());
}

// A head [0, 4) and a tail [4, 8) scheduler: the head's boundary bundle, split into fragments
// over two frames, is assembled by the tail; the token equals the whole model's.
void test_boundary_fragments_assemble_into_the_tail() {
    SchedulerOptions ho = options();
    ho.max_fragment_bytes = 24;  // 3 rows x 8 floats = 96 bytes: 4 fragments
    Worker head(model(0, 4), ho), tail(model(4, 8));
    auto hs = std::make_shared<Sink>(), ts = std::make_shared<Sink>();
    Frames hf = head.frames("c");
    head.post(hs, hf.tokens({9, 10, 11}));
    const pb::SessionResponse hr = hs->answer(1);
    CHECK(hr.has_boundary() && hr.boundary().tensors(0).fragment_count() == 4, "head boundary");
    Frames tf = tail.frames("c");
    // first frame: fragments 0..1 of the opening step would be refused (one frame to open),
    // so open with the whole bundle and send the next step in two parts
    pb::SessionRequest open = tf.step_frame(pb::PHASE_PREFILL, 0, 3);
    *open.mutable_step()->mutable_bundle() = hr.boundary();
    tail.post(ts, open);
    pb::SessionResponse tr = ts->answer(1);
    CHECK(!tr.has_error() && token_of(tr) == reference({9, 10, 11}, 1)[0], "tail token: %s", reason_of(tr).c_str());

    hf.step = 1;
    hf.pos = 3;
    const int32_t next = token_of(tr);
    head.post(hs, hf.tokens({next}, pb::PHASE_DECODE));
    const pb::SessionResponse h2 = hs->answer(2);
    CHECK(h2.has_boundary() && h2.boundary().tensors(0).fragment_count() == 2, "decode boundary");
    tf.step = 1;
    tf.pos = 3;
    for (int part = 0; part < 2; ++part) {
        pb::SessionRequest fr = tf.step_frame(pb::PHASE_DECODE, 3, 4);
        pb::NamedTensor * t = fr.mutable_step()->mutable_bundle()->add_tensors();
        *t = h2.boundary().tensors(0);
        t->clear_fragments();
        *t->add_fragments() = h2.boundary().tensors(0).fragments(part);
        tail.post(ts, fr);
    }
    CHECK(ts->resumes_wait(1) == 1, "the first part is not answered, its stream reads on");
    tr = ts->answer(2);
    CHECK(!tr.has_error() && token_of(tr) == reference({9, 10, 11}, 2)[1], "fragmented step: %s", reason_of(tr).c_str());
    // a corrupted bundle is refused with BAD_BUNDLE, nothing applied
    tf.step = 2;
    tf.pos = 4;
    pb::SessionRequest bad = tf.step_frame(pb::PHASE_DECODE, 4, 5);
    *bad.mutable_step()->mutable_bundle() = h2.boundary();
    std::string d = bad.step().bundle().tensors(0).fragments(0).data();
    d[0] ^= 1;
    bad.mutable_step()->mutable_bundle()->mutable_tensors(0)->mutable_fragments(0)->set_data(d);
    tail.post(ts, bad);
    CHECK(reason_of(ts->answer(3)) == "ERROR_REASON_BAD_BUNDLE", "corrupt bundle");
}

// A pipelining Shard forwards the rows of one batch one per session stream, marked with the
// batch and its row count (StepFrame.batch). The next Shard waits for all of them (within its
// gather deadline) and computes them as one batch, even when it predicts no row soon: here
// every session's rows came far apart before, and the three rows of the hinted batch are posted
// back to back (no sleep between them: a sleep of 1 ms overran the 5 ms gather deadline on a
// loaded machine). The decision itself, with the times given, is pacer_test's
// test_upstream_batch_rows; this checks the wiring from StepFrame.batch to one decode call.
void test_rows_of_an_upstream_batch_are_computed_together() {
    FakeModelOptions m = model(4, 8);
    m.decode_delay_ms = 40;  // gather deadline: min(5 ms, a quarter of a decode call)
    Worker tail(m);
    const uint32_t E = tail.backend.info().n_embd;
    const std::vector<float> rows(2 * E, 0.25f);
    const std::vector<std::string> ids = {"a", "b", "c"};
    std::vector<Frames> fs;
    std::vector<std::shared_ptr<Sink>> sinks;
    for (const std::string & id : ids) {
        fs.push_back(tail.frames(id));
        sinks.push_back(std::make_shared<Sink>());
        pb::SessionRequest open = fs.back().step_frame(pb::PHASE_PREFILL, 0, 2);
        *open.mutable_step()->mutable_bundle() = dgr::bundle::boundary_bundle(rows.data(), 2, E, 1 << 20);
        open.mutable_step()->set_pipelined(true);
        tail.post(sinks.back(), open);
        CHECK(!sinks.back()->answer(1).has_error(), "opening %s", id.c_str());
        fs.back().pos = 2;
    }
    auto decode = [&](size_t k, bool hinted) {
        Frames & f = fs[k];
        f.step++;
        pb::SessionRequest fr = f.step_frame(pb::PHASE_DECODE, f.pos, f.pos + 1);
        *fr.mutable_step()->mutable_bundle() = dgr::bundle::boundary_bundle(rows.data(), 1, E, 1 << 20);
        if (hinted) {
            fr.mutable_step()->mutable_batch()->set_id(7);
            fr.mutable_step()->mutable_batch()->set_rows(3);
        }
        f.pos++;
        tail.post(sinks[k], fr);
    };
    // two rows each, far apart: each session's next row is predicted a long way off (the gap
    // is learnt from decode to decode)
    for (size_t round = 0; round < 2; ++round) {
        for (size_t k = 0; k < ids.size(); ++k) {
            std::this_thread::sleep_for(std::chrono::milliseconds(60));
            decode(k, false);
            CHECK(!sinks[k]->answer(2 + round).has_error(), "decode %s", ids[k].c_str());
        }
    }
    const uint64_t batches0 = tail.metrics.batches.load();
    for (size_t k = 0; k < ids.size(); ++k) decode(k, true);
    for (size_t k = 0; k < ids.size(); ++k) CHECK(!sinks[k]->answer(4).has_error(), "hinted decode %s", ids[k].c_str());
    CHECK(tail.metrics.batches.load() - batches0 == 1, "the 3 rows of one upstream batch took %llu decode calls",
          (unsigned long long) (tail.metrics.batches.load() - batches0));
}

void test_admission_over_budget() {
    SchedulerOptions o = options();
    o.max_sessions = 1;
    o.evict_idle_s = 1e9;  // nothing is idle long enough to be evicted
    Worker w(model(), o);
    auto s1 = std::make_shared<Sink>(), s2 = std::make_shared<Sink>();
    Frames a = w.frames("one"), b = w.frames("two");
    w.post(s1, a.tokens({1}));
    CHECK(!s1->answer(1).has_error(), "first session");
    w.post(s2, b.tokens({1}));
    const pb::SessionResponse r = s2->answer(1);
    CHECK(reason_of(r) == "ERROR_REASON_OVER_BUDGET" && r.error().limit() == 1, "second session: %s",
          reason_of(r).c_str());
}

// The status of a failure carries the ShardError in google.rpc.Status details (what gRPC sends
// as the grpc-status-details-bin trailer).
void test_status_details() {
    pb::ShardError e = make_error(pb::ERROR_REASON_STALE_EPOCH, "a newer epoch exists", true);
    e.set_current_epoch(7);
    const grpc::Status st = status_for(e);
    CHECK(st.error_code() == grpc::StatusCode::ABORTED, "code %d", (int) st.error_code());
    CHECK(st.error_message() == "ERROR_REASON_STALE_EPOCH: a newer epoch exists", "message %s",
          st.error_message().c_str());
    google::rpc::Status rs;
    CHECK(rs.ParseFromString(st.error_details()), "details parse");
    pb::ShardError back;
    CHECK(rs.code() == 10 && rs.details_size() == 1 && rs.details(0).UnpackTo(&back), "details carry a ShardError");
    CHECK(back.reason() == pb::ERROR_REASON_STALE_EPOCH && back.current_epoch() == 7 && back.session_terminated(),
          "ShardError round trip");
}

// A second stream naming a live session id: refused for every frame kind, nothing stored read,
// nothing applied; the same identity (mTLS) may supersede with a newer epoch, another may not.
void test_sessions_are_owned_by_their_stream() {
    Worker w;
    auto owner = std::make_shared<Sink>(), thief = std::make_shared<Sink>();
    Frames f = w.frames("owned");
    size_t n = 0;
    const std::vector<int32_t> got = generate(w, owner, f, {3, 1, 4}, 3, &n);
    Frames t = f;  // the thief knows everything, the exact last frame included
    t.step = f.step;
    t.pos = f.pos - 1;
    const uint64_t replays = w.metrics.replayed_steps, steps = w.metrics.steps;
    w.post(thief, t.fast(got[got.size() - 2]));          // the owner's last frame, byte for byte
    pb::SessionResponse r = thief->answer(1);
    CHECK(reason_of(r) == "ERROR_REASON_SESSION_NOT_OWNED" && !r.header().replayed() && !r.has_tail(),
          "replay on another stream: %s", reason_of(r).c_str());
    CHECK(r.error().grpc_code() == 7 && !r.error().session_terminated(), "PERMISSION_DENIED, non-terminal");
    Frames next = f;
    next.step = f.step + 1;
    next.pos = f.pos;
    w.post(thief, next.fast(got.back()));               // the next step
    CHECK(reason_of(thief->answer(2)) == "ERROR_REASON_SESSION_NOT_OWNED", "next step on another stream");
    Frames newer = f;
    newer.epoch = 2, newer.step = 0, newer.pos = 0;
    w.post(thief, newer.tokens({9}));                    // a newer epoch while the owner is connected
    CHECK(reason_of(thief->answer(3)) == "ERROR_REASON_SESSION_NOT_OWNED", "newer epoch on another stream");
    CHECK(w.metrics.replayed_steps == replays && w.metrics.steps == steps, "nothing replayed or applied");
    // the owner: an identical replay is answered from the store; a different frame under the step is not
    Frames same = f;
    same.pos = f.pos - 1;
    w.post(owner, same.fast(got[got.size() - 2]));
    r = owner->answer(++n);
    CHECK(r.header().replayed() && token_of(r) == got.back(), "owner replay: %s", reason_of(r).c_str());
    w.post(owner, same.fast(got[got.size() - 2] + 1));
    r = owner->answer(++n);
    CHECK(reason_of(r) == "ERROR_REASON_STEP_OUT_OF_ORDER" && r.error().last_step() == f.step,
          "a different frame under a used step: %s", reason_of(r).c_str());
    // and it continues exactly as alone
    f.step++;
    w.post(owner, f.fast(got.back()));
    r = owner->answer(++n);
    CHECK(token_of(r) == reference({3, 1, 4}, 4).back(), "owner continues undisturbed");
    // mTLS: the same client identity on a new stream supersedes; another identity does not
    owner->client_identity = "subject=CN=a;san=a";
    auto other = std::make_shared<Sink>(), same_client = std::make_shared<Sink>();
    other->client_identity = "subject=CN=b;san=b";
    same_client->client_identity = owner->client_identity;
    w.post(other, newer.tokens({9}));
    CHECK(reason_of(other->answer(1)) == "ERROR_REASON_SESSION_NOT_OWNED", "another client identity");
    w.post(same_client, newer.tokens({9}));
    CHECK(reason_of(same_client->answer(1)) == "ok", "the same client identity supersedes");
    CHECK(reason_of(owner->answer(++n)) == "ERROR_REASON_STALE_EPOCH", "the old stream is told");
}

}  // namespace

// A session released while its step waits behind a slow batch: the step is answered
// SESSION_RELEASED, and its frame's ticket goes back exactly once (the queue depth returns to 0,
// never below: an unsigned count that went below would read huge).
void test_release_of_a_queued_step_returns_its_ticket_once() {
    FakeModelOptions m = model();
    m.decode_delay_ms = 150;
    Worker w(m);
    auto busy = std::make_shared<Sink>(), victim = std::make_shared<Sink>();
    Frames a = w.frames("busy"), b = w.frames("victim");
    w.post(busy, a.tokens({1, 2, 3}));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // the busy prefill is computing
    w.post(victim, b.tokens({4, 5}));
    CHECK(w.sched.gauges().queued_steps >= 1, "the victim's step is not counted as queued");
    std::promise<pb::ReleaseSessionResponse> done;
    pb::ReleaseSessionRequest rel;
    rel.set_session_id("victim");
    w.sched.post_release(rel, [&done](pb::ReleaseSessionResponse r) { done.set_value(std::move(r)); });
    auto fut = done.get_future();
    CHECK(fut.wait_for(std::chrono::seconds(20)) == std::future_status::ready, "release not answered");
    CHECK(fut.get().released(), "the queued session was not released");
    const pb::SessionResponse r = victim->answer(1);
    CHECK(r.has_error() && r.error().reason() == pb::ERROR_REASON_SESSION_RELEASED, "queued step: %s",
          r.error().message().c_str());
    CHECK(!busy->answer(1).has_error(), "the busy session's prefill failed");
    // ~Worker checks that the depth is back to 0
}

int main() {
    test_status_details();
    test_prefill_and_decode_give_the_model_tokens();
    test_two_sessions_are_isolated();
    test_release_frees_kv_cells();
    test_state_errors_name_the_reason();
    test_boundary_fragments_assemble_into_the_tail();
    test_rows_of_an_upstream_batch_are_computed_together();
    test_admission_over_budget();
    test_sessions_are_owned_by_their_stream();
    test_release_of_a_queued_step_returns_its_ticket_once();
    finish_grpc_test("scheduler_test");
}
