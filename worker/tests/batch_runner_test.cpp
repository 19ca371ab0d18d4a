// The batch runner on its own (worker/batch_runner.h) over the fake model: steps of several
// sessions in one decode call, in sequence-id order whatever order they were taken in; the
// tail's tokens equal the whole fake model's greedy tokens; a head range answers boundary rows
// that the next range turns into the same tokens; a failed decode is reported, not answered.
#include "worker/batch_runner.h"
#include "worker/fake_backend.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "check.h"
#include "fake_reference.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

FakeModelOptions model(uint32_t start = 0, uint32_t end = 0) {
    FakeModelOptions o;
    o.n_layer = 8;
    o.layer_start = start;
    o.layer_end = end;
    o.kv_cells = 256;
    o.n_seq_max = 4;
    return o;
}

WorkPtr tokens_step(const std::string & sid, std::vector<int32_t> ids, uint32_t pos0, bool decode) {
    auto w = std::make_unique<Work>();
    w->session_id = sid;
    w->tokens = std::move(ids);
    w->pos0 = pos0;
    w->n = (uint32_t) w->tokens.size();
    w->decode = decode;
    w->sample = true;
    w->header.set_session_id(sid);
    return w;
}

BatchRunner::FindSession finder(SessionTable & t) {
    return [&t](const std::string & id) { return t.find(id); };
}

void test_two_sessions_match_the_whole_model() {
    FakeBackend backend(model());
    BatchRunner runner(backend, 1u << 20);
    SessionTable table(4, 8);
    table.open("a", 1);  // seq 0
    table.open("b", 1);  // seq 1
    const std::vector<int32_t> pa = {10, 20, 30}, pb_ = {40, 50};
    const std::vector<int32_t> ref_a = fake_greedy_reference(model(), pa, 3);
    const std::vector<int32_t> ref_b = fake_greedy_reference(model(), pb_, 3);
    // taken in the order b, a: the runner computes them in sequence-id order
    std::vector<WorkPtr> items;
    items.push_back(tokens_step("b", pb_, 0, false));
    items.push_back(tokens_step("a", pa, 0, false));
    BatchRunner::Ran ran = runner.run(std::move(items), finder(table));
    CHECK(ran.status == BackendStatus::ok && ran.rows == 5 && ran.prefill_rows == 5 && ran.decode_rows == 0,
          "prefill batch: status %d, %d rows", (int) ran.status, ran.rows);
    CHECK(ran.steps.size() == 2 && ran.steps[0].session->id == "a" && ran.steps[1].session->id == "b",
          "steps not in sequence-id order");
    CHECK(ran.steps[0].first_row == 0 && ran.steps[0].last_row == 2 && ran.steps[1].first_row == 3 &&
              ran.steps[1].last_row == 4,
          "rows a [%d, %d] b [%d, %d]", ran.steps[0].first_row, ran.steps[0].last_row, ran.steps[1].first_row,
          ran.steps[1].last_row);
    std::vector<int32_t> got_a, got_b;
    for (const auto & st : ran.steps) {
        int32_t tok = -1;
        bool fin = true;
        const pb::SessionResponse r = runner.answer(st, &tok, &fin);
        CHECK(r.has_tail() && r.tail().tokens_size() == 1 && r.tail().tokens(0).token_id() == tok && !fin,
              "answer of %s", st.session->id.c_str());
        CHECK(r.tail().tokens(0).position() == st.work->pos0 + st.work->n, "token position %u",
              r.tail().tokens(0).position());
        (st.session->id == "a" ? got_a : got_b).push_back(tok);
    }
    // two decode rounds, both sessions in one batch each time
    for (int round = 0; round < 2; ++round) {
        std::vector<WorkPtr> rows;
        rows.push_back(tokens_step("a", {got_a.back()}, (uint32_t) (pa.size() + round), true));
        rows.push_back(tokens_step("b", {got_b.back()}, (uint32_t) (pb_.size() + round), true));
        BatchRunner::Ran d = runner.run(std::move(rows), finder(table));
        CHECK(d.status == BackendStatus::ok && d.decode_rows == 2 && d.prefill_rows == 0, "decode round %d", round);
        for (const auto & st : d.steps) {
            int32_t tok = -1;
            bool fin = false;
            runner.answer(st, &tok, &fin);
            (st.session->id == "a" ? got_a : got_b).push_back(tok);
        }
    }
    CHECK(got_a == ref_a, "session a differs from the whole model");
    CHECK(got_b == ref_b, "session b differs from the whole model");
}

void test_no_sample_and_stop_tokens() {
    FakeBackend backend(model());
    BatchRunner runner(backend, 1u << 20);
    SessionTable table(4, 8);
    Session & s = table.open("a", 1);
    std::vector<WorkPtr> items;
    items.push_back(tokens_step("a", {1, 2}, 0, false));
    items.back()->sample = false;
    BatchRunner::Ran ran = runner.run(std::move(items), finder(table));
    int32_t tok = 5;
    bool fin = true;
    const pb::SessionResponse r = runner.answer(ran.steps[0], &tok, &fin);
    CHECK(r.has_tail() && r.tail().tokens_size() == 0 && tok == -1 && !fin, "a step that samples nothing");
    // the greedy token made a stop token finishes the step
    const int32_t next = fake_greedy_reference(model(), {1, 2, 3}, 1)[0];
    s.sampling.stop_token_ids = {next};
    std::vector<WorkPtr> again;
    again.push_back(tokens_step("a", {3}, 2, true));
    BatchRunner::Ran d = runner.run(std::move(again), finder(table));
    const pb::SessionResponse r2 = runner.answer(d.steps[0], &tok, &fin);
    CHECK(tok == next && fin && r2.tail().tokens(0).finish_reason() == pb::FINISH_REASON_STOP_TOKEN,
          "stop token %d: got %d finished %d", next, tok, fin);
}

void test_split_range_boundary_rows() {
    FakeBackend head(model(0, 3)), tail(model(3, 8));
    BatchRunner hr(head, 64), tr(tail, 1u << 20);  // 64-byte fragments: the rows span several
    SessionTable ht(4, 8), tt(4, 8);
    ht.open("a", 1);
    tt.open("a", 1);
    const std::vector<int32_t> prompt = {7, 8, 9};
    std::vector<WorkPtr> items;
    items.push_back(tokens_step("a", prompt, 0, false));
    BatchRunner::Ran ran = hr.run(std::move(items), finder(ht));
    int32_t tok = 0;
    bool fin = true;
    const pb::SessionResponse r = hr.answer(ran.steps[0], &tok, &fin);
    CHECK(r.has_boundary() && tok == -1 && !fin, "a head range answers boundary rows");
    CHECK(r.boundary().tensors_size() == 1 && r.boundary().tensors(0).fragments_size() > 1, "the rows in %d fragments",
          r.boundary().tensors_size() ? r.boundary().tensors(0).fragments_size() : 0);
    std::vector<uint8_t> bytes;
    for (const auto & t : r.boundary().tensors()) {
        for (const auto & f : t.fragments()) bytes.insert(bytes.end(), f.data().begin(), f.data().end());
    }
    const uint32_t E = head.info().n_embd;
    CHECK(bytes.size() == prompt.size() * E * sizeof(float), "%zu bytes of boundary rows", bytes.size());
    auto w = std::make_unique<Work>();
    w->session_id = "a";
    w->n = (uint32_t) prompt.size();
    w->sample = true;
    w->rows.resize(bytes.size() / sizeof(float));
    std::memcpy(w->rows.data(), bytes.data(), bytes.size());
    std::vector<WorkPtr> down;
    down.push_back(std::move(w));
    BatchRunner::Ran t = tr.run(std::move(down), finder(tt));
    tr.answer(t.steps[0], &tok, &fin);
    CHECK(tok == fake_greedy_reference(model(), prompt, 1)[0], "the split gives token %d", tok);
}

void test_failed_decode_is_reported() {
    FakeModelOptions m = model();
    m.kv_cells = 4;  // a batch of more rows than cells fails
    FakeBackend backend(m);
    BatchRunner runner(backend, 1u << 20);
    SessionTable table(4, 8);
    table.open("a", 1);
    std::vector<WorkPtr> items;
    items.push_back(tokens_step("a", {1, 2, 3, 4, 5, 6}, 0, false));
    BatchRunner::Ran ran = runner.run(std::move(items), finder(table));
    CHECK(ran.status != BackendStatus::ok && !ran.error.empty() && ran.steps.size() == 1 && ran.steps[0].work,
          "a decode over the cells: status %d (%s)", (int) ran.status, ran.error.c_str());
}

}  // namespace

int main() {
    test_two_sessions_match_the_whole_model();
    test_no_sample_and_stop_tokens();
    test_split_range_boundary_rows();
    test_failed_decode_is_reported();
    if (g_failures) {
        std::fprintf(stderr, "batch_runner_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("batch_runner_test: ok\n");
    return 0;
}
