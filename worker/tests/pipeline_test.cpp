// Pipeline-aware scheduling (worker/pipeline.h, docs/worker.md "Pipelined routes"): the pure
// policy, then a chained route of two fake-model Shards in this process (the tail behind a real
// gRPC server on loopback, the head's scheduler fed like its Session reactor feeds it) with
// server-side generation for several sessions: the head never computes more chained DECODE
// rows in one batch than one group, and every session still gets the whole model's tokens.
// No wall-clock assertions: the cap is checked on every decode call the head makes.
#include "worker/fake_backend.h"
#include "worker/pipeline.h"
#include "worker/scheduler.h"
#include "worker/service.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

#include "check.h"
#include "fake_reference.h"

namespace {

using Clock = std::chrono::steady_clock;

void test_groups_follow_the_stages() {
    CHECK(pipeline_groups(0, 2, false) == 2, "auto: one group per stage off-host");
    CHECK(pipeline_groups(0, 3, false) == 3, "auto: 3 stages");
    CHECK(pipeline_groups(0, 2, true) == 1, "auto: co-located route is not split");
    CHECK(pipeline_groups(0, 1, false) == 1, "one stage: nothing to overlap");
    CHECK(pipeline_groups(1, 3, false) == 1, "1: off");
    CHECK(pipeline_groups(4, 2, true) == 4, "explicit N applies everywhere");
    CHECK(pipeline_groups(99, 2, false) == kMaxPipelineGroups, "bounded");
}

void test_group_rows_split_ready_sessions() {
    CHECK(pipeline_group_rows(8, 2) == 4, "8 sessions, 2 groups: 4 rows");
    CHECK(pipeline_group_rows(5, 2) == 3, "ceil");
    CHECK(pipeline_group_rows(4, 3) == 2, "4 sessions, 3 groups");
    CHECK(pipeline_group_rows(1, 2) == 0, "one session: no cap (its latency is untouched)");
    CHECK(pipeline_group_rows(8, 1) == 0, "one group: no cap");
}

void test_gather_waits_only_for_rows_due_before_the_deadline() {
    const auto t = Clock::now();
    const auto deadline = t + std::chrono::milliseconds(2);
    CHECK(worth_waiting(t, 0.0, deadline), "unknown gap: wait");
    CHECK(worth_waiting(t, 0.001, deadline), "due in 1 ms of 2: wait");
    CHECK(!worth_waiting(t, 0.010, deadline), "due in 10 ms: the other group, do not wait");
    CHECK(next_gap(0.0, 0.004) == 0.004, "first observation");
    CHECK(std::abs(next_gap(0.010, 0.0) - 0.007) < 1e-12, "EWMA");
    CHECK(next_gap(0.010, -1.0) == 0.010, "negative ignored");
}

// Records, per decode call, how many DECODE rows (positions >= the prompt length) and how many
// prompt rows it held.
class RecordingBackend final : public FakeBackend {
public:
    RecordingBackend(const FakeModelOptions & o, int32_t prompt_len) : FakeBackend(o), prompt_len_(prompt_len) {}
    BackendStatus decode(const DecodeBatch & batch, std::string * error) override {
        const int n = (int) std::count_if(batch.pos.begin(), batch.pos.end(), [&](int32_t p) { return p >= prompt_len_; });
        {
            std::lock_guard<std::mutex> lk(mu);
            if (n > 0) decode_rows.push_back(n);
            std::vector<int32_t> seqs;
            for (int i = 0; i < batch.n_rows(); ++i) {
                if (batch.pos[i] >= prompt_len_) seqs.push_back(batch.seq[i]);
            }
            if (!seqs.empty()) decode_seqs.push_back(seqs);
            if (batch.n_rows() > n) prompt_rows.push_back(batch.n_rows() - n);
        }
        return FakeBackend::decode(batch, error);
    }
    std::vector<int> rows() {
        std::lock_guard<std::mutex> lk(mu);
        return decode_rows;
    }
    std::vector<std::vector<int32_t>> seqs() {
        std::lock_guard<std::mutex> lk(mu);
        return decode_seqs;
    }
    std::vector<int> prompt_calls() {
        std::lock_guard<std::mutex> lk(mu);
        return prompt_rows;
    }
private:
    int32_t prompt_len_;
    std::mutex mu;
    std::vector<int> decode_rows, prompt_rows;
    std::vector<std::vector<int32_t>> decode_seqs;  // per call: the sequence ids of its DECODE rows
};

class Sink final : public StreamSink {
public:
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status, bool) override {
        std::lock_guard<std::mutex> lk(mu_);
        if (resp.has_error()) errors_++;
        if (resp.has_tail()) {
            for (const auto & t : resp.tail().tokens()) tokens_.push_back(t.token_id());
        }
        if (terminal) ended_ = true;
        cv_.notify_all();
    }
    void hold(pb::SessionResponse resp, uint32_t) override { deliver(std::move(resp), false, grpc::Status::OK, false); }
    void resume() override {}
    void finish(grpc::Status) override {
        std::lock_guard<std::mutex> lk(mu_);
        ended_ = true;
        cv_.notify_all();
    }
    // the tokens once n have come (or what came in 30 s, and a failure)
    std::vector<int32_t> tokens(size_t n) {
        std::unique_lock<std::mutex> lk(mu_);
        if (!cv_.wait_for(lk, std::chrono::seconds(30), [&] { return tokens_.size() >= n || errors_ > 0 || ended_; })) {
            CHECK(false, "%zu tokens did not come (got %zu)", n, tokens_.size());
        }
        CHECK(errors_ == 0, "an answer carried an error");
        return tokens_;
    }
private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<int32_t> tokens_;
    int errors_ = 0;
    bool ended_ = false;
};

FakeModelOptions shard(uint32_t a, uint32_t b, uint32_t delay_ms) {
    FakeModelOptions o;
    o.n_layer = 8;
    o.layer_start = a;
    o.layer_end = b;
    o.kv_cells = 1024;
    o.n_seq_max = 8;
    o.decode_delay_ms = delay_ms;
    return o;
}

SchedulerOptions sched_options(uint32_t groups) {
    SchedulerOptions o;
    o.max_sessions = 8;
    o.kv_cells = 1024;
    o.max_session_positions = 128;
    o.max_prefill_chunk_tokens = 64;
    o.max_batch_tokens = 128;
    o.pipeline_groups = groups;
    return o;
}

// Greedy tokens of the whole fake model: the prompt, then n - 1 fed-back tokens.
std::vector<int32_t> reference(const std::vector<int32_t> & prompt, int n) {
    return fake_greedy_reference(shard(0, 8, 0), prompt, n);
}

// The opening PREFILL frame of a chained, generating session.
pb::SessionRequest opening(const std::string & sid, const std::vector<int32_t> & prompt, const std::string & fp,
                           const std::string & tail_endpoint, uint32_t max_tokens) {
    pb::SessionRequest req;
    auto * f = req.mutable_step();
    auto * h = f->mutable_header();
    h->set_schema_version(pb::SCHEMA_VERSION_V1);
    h->set_session_id(sid);
    h->set_route_epoch(1);
    h->set_compatibility_fingerprint(fp);
    h->mutable_shard_range()->set_start(0);
    h->mutable_shard_range()->set_end(4);
    h->set_effective_start(0);
    h->set_phase(pb::PHASE_PREFILL);
    h->mutable_positions()->set_start(0);
    h->mutable_positions()->set_end((uint32_t) prompt.size());
    h->set_step(0);
    h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_EMPTY);
    for (int32_t t : prompt) f->mutable_tokens()->add_token_ids(t);
    *h->mutable_payload_checksum() = dgr::bundle::crc_checksum(dgr::bundle::tokens_payload_crc(f->tokens()));
    f->set_sample(true);
    auto * hop = f->add_downstream();
    hop->set_endpoint(tail_endpoint);
    hop->mutable_range()->set_start(4);
    hop->mutable_range()->set_end(8);
    hop->set_compatibility_fingerprint(fp);
    f->mutable_generate()->set_max_tokens(max_tokens);
    f->mutable_generate()->set_tokens_per_answer(1);
    return req;
}

struct RouteRun {
    std::vector<int> head_decode_rows;  // per head decode call: its DECODE rows
    std::vector<std::vector<int32_t>> head_decode_seqs;  // and their sequence ids
    std::vector<int> tail_prompt_rows;  // per tail decode call: its prompt rows
    uint64_t head_pieces = 0;
};

// A two-Shard chained route in this process; `groups` is the head's --pipeline-groups. Every
// session's tokens are checked against the whole model.
RouteRun run_route(uint32_t groups, int sessions, int n_tokens, int prompt_len = 4) {
    // the tail: its own scheduler behind a gRPC server on loopback
    RecordingBackend tail_backend(shard(4, 8, 2), prompt_len);
    Metrics tail_metrics;
    Scheduler tail(tail_backend, tail_metrics, sched_options(1));
    tail.start();
    ShardService service(tail_backend, tail, tail_metrics, ServiceInfo{"test", "test", "test", "fake"});
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    CHECK(server && port > 0, "tail server did not start");
    RouteRun run;
    {
        RecordingBackend head_backend(shard(0, 4, 2), prompt_len);
        Metrics head_metrics;
        Scheduler head(head_backend, head_metrics, sched_options(groups));
        head.start();
        const std::string fp = head_backend.info().fingerprint;
        const std::string ep = "127.0.0.1:" + std::to_string(port);
        std::vector<std::shared_ptr<Sink>> sinks;
        std::vector<std::vector<int32_t>> prompts;
        for (int i = 0; i < sessions; ++i) {
            std::vector<int32_t> p;
            for (int k = 0; k < prompt_len; ++k) p.push_back((int32_t) ((10 + i * 7 + k * 13) % 250));
            prompts.push_back(p);
            sinks.push_back(std::make_shared<Sink>());
            CHECK(head.post_frame(sinks.back(),
                                  std::make_unique<pb::SessionRequest>(opening("s" + std::to_string(i), prompts.back(), fp,
                                                                               ep, (uint32_t) n_tokens)),
                                  Clock::now()),
                  "queue full");
        }
        for (int i = 0; i < sessions; ++i) {
            const std::vector<int32_t> got = sinks[i]->tokens((size_t) n_tokens);
            CHECK(got == reference(prompts[i], n_tokens), "session %d: tokens differ from the whole model", i);
        }
        head.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "test over"));
        run.head_decode_rows = head_backend.rows();
        run.head_decode_seqs = head_backend.seqs();
        run.head_pieces = head_metrics.prefill_pieces.load();
    }
    server->Shutdown();
    tail.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "test over"));
    run.tail_prompt_rows = tail_backend.prompt_calls();
    return run;
}

int most(const std::vector<int> & v) { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }

void test_head_splits_chained_decode_rows_into_groups() {
    // 6 sessions over 2 Shards, 2 groups: at most 3 decode rows per head batch
    const RouteRun r2 = run_route(2, 6, 10);
    CHECK(!r2.head_decode_rows.empty(), "the head made no decode calls");
    CHECK(most(r2.head_decode_rows) <= 3, "a head batch took %d chained decode rows; the group is 3",
          most(r2.head_decode_rows));
    // each group is a block of consecutive sequence ids (one llama.cpp ubatch)
    for (const auto & seqs : r2.head_decode_seqs) {
        for (int32_t q : seqs) {
            CHECK(pipeline_block(q, 3) == pipeline_block(seqs[0], 3), "a head batch mixed sequences %d and %d", seqs[0], q);
        }
    }
    // 3 groups: at most 2
    const RouteRun r3 = run_route(3, 6, 6);
    CHECK(most(r3.head_decode_rows) <= 2, "a head batch took %d chained decode rows; the group is 2",
          most(r3.head_decode_rows));
}

void test_one_group_keeps_the_tokens() {
    // --pipeline-groups 1 (off) on the same route: the same tokens (checked inside), no pieces
    run_route(1, 3, 6);
    const RouteRun r = run_route(1, 1, 6, 64);
    CHECK(r.head_pieces == 0, "groups 1 split a prompt into %llu pieces", (unsigned long long) r.head_pieces);
    CHECK(most(r.tail_prompt_rows) == 64, "the tail computed the 64-token prompt in calls of %d rows",
          most(r.tail_prompt_rows));
}

void test_long_prompt_goes_down_the_route_in_pieces() {
    // one 64-token prompt, 2 groups: two pieces of 32 rows, forwarded one by one; the tokens
    // after it are the whole model's
    const RouteRun r = run_route(2, 1, 4, 64);
    CHECK(r.head_pieces == 2, "the head split the prompt into %llu pieces, want 2", (unsigned long long) r.head_pieces);
    CHECK(most(r.tail_prompt_rows) == 32 && r.tail_prompt_rows.size() == 2,
          "the tail computed the prompt in %zu calls, the largest %d rows (want 2 x 32)", r.tail_prompt_rows.size(),
          most(r.tail_prompt_rows));
    CHECK(pipeline_group_rows(1, 2) == 0, "one session's decode is never capped");
}

void test_blocks_of_sequence_ids() {
    CHECK(pipeline_block(0, 4) == 0 && pipeline_block(3, 4) == 0, "0..3 one block");
    CHECK(pipeline_block(4, 4) == 1 && pipeline_block(7, 4) == 1, "4..7 the next");
    CHECK(pipeline_block(5, 0) == 0, "no cap: one block");
}

void test_piece_rows() {
    CHECK(prefill_piece_rows(256, 2) == 64, "256 rows, 2 stages: 4 pieces of 64");
    CHECK(prefill_piece_rows(128, 2) == 32, "128 rows: 4 pieces of 32");
    CHECK(prefill_piece_rows(64, 3) == 32, "never below kMinPrefillPiece");
    CHECK(prefill_piece_rows(16, 2) == 16, "a short prompt is not split");
    CHECK(prefill_piece_rows(256, 1) == 256, "one group: not split");
}

}  // namespace

int main() {
    test_groups_follow_the_stages();
    test_group_rows_split_ready_sessions();
    test_gather_waits_only_for_rows_due_before_the_deadline();
    test_piece_rows();
    test_blocks_of_sequence_ids();
    test_head_splits_chained_decode_rows_into_groups();
    test_one_group_keeps_the_tokens();
    test_long_prompt_goes_down_the_route_in_pieces();
    finish_grpc_test("pipeline_test");
}
