// The pacer on its own (worker/pacer.h): when a gather starts, its deadlines from the decode
// time, and whom it waits for -- decoding sessions a client round trip away, chained sessions
// generating on this host, pipelined sessions only when predicted in time, rows of an upstream
// batch not all here -- with every time given explicitly (no clock is read, nothing sleeps).
#include "worker/pacer.h"

#include <chrono>
#include <string>

#include "check.h"

using namespace dgr::worker;
using std::chrono::milliseconds;

namespace {

const Clock::time_point T0 = Clock::time_point{} + std::chrono::hours(1);

double ms(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double, std::milli>(b - a).count(); }

WorkPtr decode_row(const std::string & sid) {
    auto w = std::make_unique<Work>();
    w->session_id = sid;
    w->decode = true;
    w->n = 1;
    w->tokens = {1};
    return w;
}

void test_deadlines_follow_the_decode_time() {
    SessionTable t(4, 4);
    Pacer p(t, 0);
    WorkQueue q;
    q.push_decode(decode_row("a"));
    CHECK(!p.gathers(q), "no decode time known yet: no gather");
    p.observe_batch(0.5, /*decode_only=*/false);
    CHECK(p.last_decode_s() == 0.0, "a batch with prefill set the decode estimate");
    p.observe_batch(0.010, true);
    CHECK(p.gathers(q), "decode rows queued, a decode time known: gather");
    Pacer::Gather g = p.gather_from(T0);
    CHECK(ms(T0, g.short_deadline) > 2.49 && ms(T0, g.short_deadline) < 2.51, "short: 25%% of 10 ms, got %.3f",
          ms(T0, g.short_deadline));
    CHECK(ms(T0, g.long_deadline) > 34.9 && ms(T0, g.long_deadline) < 35.1, "long: 3 calls + 5 ms, got %.3f",
          ms(T0, g.long_deadline));
    CHECK(ms(T0, g.fill_deadline) > 9.9 && ms(T0, g.fill_deadline) < 10.1, "fill: one call, got %.3f",
          ms(T0, g.fill_deadline));
    CHECK(g.group == 0, "no chained session: no group cap (%u)", g.group);
    p.observe_batch(1.0, true);  // EWMA: 0.8 * 10 ms + 0.2 * 1 s
    CHECK(p.last_decode_s() > 0.2079 && p.last_decode_s() < 0.2081, "EWMA %.4f", p.last_decode_s());
    g = p.gather_from(T0);
    CHECK(ms(T0, g.short_deadline) < 5.01 && ms(T0, g.long_deadline) < 250.01 && ms(T0, g.fill_deadline) < 50.01,
          "caps: %.2f %.2f %.2f ms", ms(T0, g.short_deadline), ms(T0, g.long_deadline), ms(T0, g.fill_deadline));
    q.push_prefill(std::make_unique<Work>());
    CHECK(!p.gathers(q), "a PREFILL step waits: no gather");
    CHECK(!p.wait_until(g, q, T0), "a PREFILL step waits: the batch runs now");
}

void test_waits_for_decoding_sessions() {
    SessionTable t(4, 4);
    Pacer p(t, 0);
    p.observe_batch(0.010, true);
    WorkQueue q;
    q.push_decode(decode_row("a"));
    Session & a = t.open("a", 1);
    move_step(a, StepState::queued);
    a.decoding = true;
    const Pacer::Gather g = p.gather_from(T0);
    CHECK(!p.wait_until(g, q, T0), "the only decoding session is queued: nothing to wait for");
    Session & b = t.open("b", 1);
    b.decoding = true;  // idle, its answer went out: its next row is a round trip away
    const auto until = p.wait_until(g, q, T0);
    CHECK(until && *until == g.short_deadline, "waits for b until the short deadline");
    CHECK(!p.wait_until(g, q, g.short_deadline), "past the deadline: run");
    b.decoding = false;
    CHECK(!p.wait_until(g, q, T0), "a session that is not decoding is not waited for");
}

void test_colocated_chain_waits_longer() {
    SessionTable t(4, 4);
    Pacer p(t, 0);
    p.observe_batch(0.010, true);
    WorkQueue q;
    q.push_decode(decode_row("a"));
    Session & c = t.open("c", 1);
    move_step(c, StepState::queued);
    move_step(c, StepState::downstream);
    c.gen.active = true;
    c.chain.colocated = true;
    const Pacer::Gather g = p.gather_from(T0);
    const auto until = p.wait_until(g, q, T0);
    CHECK(until && *until == g.long_deadline, "a chained generating session on this host: the long deadline");
    const Pacer::Expected e = p.expected_decoders(g.short_deadline);
    CHECK(e.colocated_chain == 1 && e.plain == 0, "expected %u plain, %u colocated", e.plain, e.colocated_chain);
}

void test_pipelined_sessions_only_when_due() {
    SessionTable t(4, 4);
    Pacer p(t, 0);
    p.observe_batch(0.010, true);
    WorkQueue q;
    q.push_decode(decode_row("a"));
    Session & s = t.open("s", 1);
    s.pipelined = true;
    s.decoding = true;
    CHECK(p.paced_by_pipeline(s) && p.prefill_groups(s) == 1, "opened pipelined (not chained here)");
    s.answered_at = T0;
    s.gap_s = 0.050;  // its next row usually comes 50 ms after its answer
    const Pacer::Gather g = p.gather_from(T0);
    CHECK(!p.wait_until(g, q, T0), "a pipelined session due in 50 ms is not waited for");
    s.gap_s = 0.001;
    CHECK(p.wait_until(g, q, T0).has_value(), "one due in 1 ms is");
    s.gap_s = 0.0;
    CHECK(p.wait_until(g, q, T0).has_value(), "one with no gap learned yet is");
}

void test_upstream_batch_rows() {
    SessionTable t(4, 4);
    Pacer p(t, 0);
    p.observe_batch(0.010, true);
    WorkQueue q;
    WorkPtr w = decode_row("a");
    std::get<ClientStep>(w->origin).up_batch = 9;
    std::get<ClientStep>(w->origin).up_rows = 2;  // the upstream Shard forwarded two rows together; one is here
    q.push_decode(std::move(w));
    const Pacer::Gather g = p.gather_from(T0);
    const auto until = p.wait_until(g, q, T0);
    CHECK(until && *until == g.short_deadline, "waits for the rest of the upstream batch");
    WorkPtr w2 = decode_row("b");
    std::get<ClientStep>(w2->origin).up_batch = 9;
    std::get<ClientStep>(w2->origin).up_rows = 2;
    q.push_decode(std::move(w2));
    CHECK(!p.wait_until(g, q, T0), "the whole upstream batch is here: run");
}

void test_arrival_gap() {
    SessionTable t(2, 2);
    Session & s = t.open("s", 1);
    s.answered_at = T0;
    Pacer::note_decode_arrival(s, T0 + milliseconds(20));
    CHECK(s.gap_s == 0.0, "after a prompt (not decoding) the gap is not learned: %.3f", s.gap_s);
    s.decoding = true;
    Pacer::note_decode_arrival(s, T0 + milliseconds(20));
    CHECK(s.gap_s > 0.0199 && s.gap_s < 0.0201, "first gap %.4f", s.gap_s);
    Pacer::note_decode_arrival(s, T0 + milliseconds(10));  // EWMA 0.7 * 20 + 0.3 * 10 ms
    CHECK(s.gap_s > 0.0169 && s.gap_s < 0.0171, "EWMA gap %.4f", s.gap_s);
}

}  // namespace

int main() {
    test_deadlines_follow_the_decode_time();
    test_waits_for_decoding_sessions();
    test_colocated_chain_waits_longer();
    test_pipelined_sessions_only_when_due();
    test_upstream_batch_rows();
    test_arrival_gap();
    if (g_failures) {
        std::fprintf(stderr, "pacer_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("pacer_test: ok\n");
    return 0;
}
