// The session reaper on its own (worker/session_reaper.h) over the fake model: ending a session
// frees its queued steps (their tickets go back), its KV cells in the model and the table, and
// leaves the right tombstone; eviction makes room least recently used first and never takes
// the session asking or a busy one; the TTL sweep evicts idle sessions only.
#include "worker/session_reaper.h"
#include "worker/fake_backend.h"

#include <atomic>
#include <chrono>
#include <string>

#include "check.h"
#include "fake_reference.h"

using namespace dgr::worker;
using std::chrono::seconds;

namespace {

const Clock::time_point T0 = Clock::time_point{} + std::chrono::hours(1);
std::atomic<uint32_t> g_tickets{0};

FakeModelOptions model() {
    FakeModelOptions o;
    o.n_layer = 4;
    o.kv_cells = 64;
    o.n_seq_max = 4;
    return o;
}

// Prefills `n` positions of `s` in the model and the table, as a computed step would.
void hold(FakeBackend & b, SessionTable & t, Session & s, uint32_t n) {
    DecodeBatch batch;
    for (uint32_t i = 0; i < n; ++i) {
        batch.tokens.push_back((int32_t) (i + 1));
        batch.pos.push_back((int32_t) (s.positions + i));
        batch.seq.push_back(s.seq);
        batch.output.push_back(0);
    }
    std::string err;
    CHECK(b.decode(batch, &err) == BackendStatus::ok, "decode: %s", err.c_str());
    t.reserve(s, n);
    t.commit(s, n, n);
}

WorkPtr queued_step(const std::string & sid) {
    auto w = std::make_unique<Work>();
    w->session_id = sid;
    w->decode = true;
    w->n = 1;
    w->tokens = {3};
    ClientStep c;
    c.ticket = FrameTicket::take(g_tickets, 100);
    w->origin = std::move(c);
    return w;
}

struct Rig {
    FakeBackend backend{model()};
    SessionTable table{4, 16};
    WorkQueue queue;
    Metrics metrics;
    SessionReaper reaper{table, queue, backend, metrics, SessionReaper::Limits{20, 5.0, 60.0}};
};

void test_end_frees_everything_the_session_holds() {
    Rig r;
    Session & a = r.table.open("a", 2);
    hold(r.backend, r.table, a, 6);
    r.queue.push_decode(queued_step("a"));
    CHECK(g_tickets.load() == 1, "one ticket out");
    const int32_t seq_a = a.seq;  // (a is gone after end)
    CHECK(r.reaper.end("a", EndKind::cancelled) == 6, "the positions it held");
    CHECK(g_tickets.load() == 0 && r.queue.empty(), "its queued step left and its ticket went back");
    CHECK(r.table.size() == 0 && r.table.kv_used() == 0 && r.table.check().empty(), "the table's accounting");
    const Tombstone * t = r.table.tombstone("a");
    CHECK(t && t->epoch == 2 && t->kind == EndKind::cancelled, "tombstone of a cancelled session");
    CHECK(r.metrics.sessions_cancelled.load() == 1, "counted cancelled");
    CHECK(r.reaper.end("a", EndKind::released) == 0 && r.metrics.sessions_released.load() == 0,
          "a second end does nothing");
    // the model dropped the sequence: a new session on it computes like a fresh one
    Session & b = r.table.open("b", 1);
    CHECK(b.seq == seq_a, "the freed sequence id is reused (%d, was %d)", b.seq, seq_a);
    DecodeBatch batch;
    for (int32_t i = 0; i < 3; ++i) {
        batch.tokens.push_back(10 + i);
        batch.pos.push_back(i);
        batch.seq.push_back(b.seq);
        batch.output.push_back(i == 2);
    }
    std::string err;
    CHECK(r.backend.decode(batch, &err) == BackendStatus::ok, "decode at position 0 again: %s", err.c_str());
    const float * logits = r.backend.output_row(2);
    const int32_t tok = (int32_t) (std::max_element(logits, logits + r.backend.info().n_vocab) - logits);
    CHECK(tok == fake_greedy_reference(model(), {10, 11, 12}, 1)[0], "the freed sequence kept state");
}

void test_make_room_evicts_least_recently_used_idle() {
    Rig r;
    Session & a = r.table.open("a", 1);
    Session & b = r.table.open("b", 1);
    Session & c = r.table.open("c", 1);
    hold(r.backend, r.table, a, 6);
    hold(r.backend, r.table, b, 6);
    hold(r.backend, r.table, c, 6);
    a.last_used = T0;
    b.last_used = T0 - seconds(30);  // least recently used
    c.last_used = T0 - seconds(60);  // older still, but it asks for the room
    CHECK(r.reaper.make_room(2, false, "c", T0 + seconds(10)), "18 of 20 cells + 2 fit");
    CHECK(r.table.size() == 3, "nothing evicted while it fits");
    CHECK(r.reaper.make_room(6, false, "c", T0 + seconds(10)), "room for 6 more");
    CHECK(!r.table.find("b") && r.table.find("a") && r.table.find("c"), "b (LRU, not the requester) went");
    const Tombstone * t = r.table.tombstone("b");
    CHECK(t && t->kind == EndKind::evicted && r.metrics.sessions_evicted.load() == 1, "b evicted");
    move_step(a, StepState::queued);  // busy: never evicted
    CHECK(!r.reaper.make_room(20, false, "c", T0 + seconds(10)), "no idle session to evict but the requester");
    CHECK(r.table.find("a") && r.table.find("c"), "a busy session and the requester stay");
    move_step(a, StepState::idle);
    CHECK(!r.reaper.make_room(20, false, "c", T0 + seconds(2)), "a idle 2 s, under evict_idle_s 5: stays");
    CHECK(r.table.find("a"), "a stays");
}

void test_session_slots() {
    Rig r;
    for (const char * id : {"a", "b", "c", "d"}) r.table.open(id, 1).last_used = T0;
    CHECK(r.table.full(), "4 of 4 sessions");
    CHECK(r.reaper.make_room(0, false, "", T0 + seconds(10)), "no session slot asked");
    CHECK(r.reaper.make_room(0, true, "", T0 + seconds(10)) && r.table.size() == 3, "one evicted for a slot");
}

void test_sweep_evicts_idle_only() {
    Rig r;
    Session & a = r.table.open("a", 1);
    Session & b = r.table.open("b", 1);
    Session & c = r.table.open("c", 1);
    a.last_used = T0 - seconds(120);
    b.last_used = T0 - seconds(10);
    c.last_used = T0 - seconds(120);
    move_step(c, StepState::queued);
    CHECK(r.reaper.sweep(T0) == 1, "one session past the TTL and idle");
    CHECK(!r.table.find("a") && r.table.find("b") && r.table.find("c"), "a went; b is recent, c is busy");
    CHECK(r.table.tombstone("a") && r.table.tombstone("a")->kind == EndKind::evicted, "a evicted");
}

}  // namespace

int main() {
    test_end_frees_everything_the_session_holds();
    test_make_room_evicts_least_recently_used_idle();
    test_session_slots();
    test_sweep_evicts_idle_only();
    if (g_failures) {
        std::fprintf(stderr, "session_reaper_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("session_reaper_test: ok\n");
    return 0;
}
