// The session table on its own: sequence ids, tombstones, LRU/TTL choice, and the KV cell
// accounting it owns (reserve -> commit -> truncate -> remove), with its invariant checked
// after every operation.
#include "worker/session_table.h"

#include <cstdio>
#include <string>

#include "check.h"

using namespace dgr::worker;

namespace {

void expect_consistent(const SessionTable & t, const char * after) {
    const std::string drift = t.check();
    CHECK(drift.empty(), "after %s: %s", after, drift.c_str());
}

void test_kv_accounting_follows_a_session_life() {
    SessionTable t(4, 8);
    Session & a = t.open("a", 1);
    Session & b = t.open("b", 1);
    CHECK(a.seq == 0 && b.seq == 1, "sequence ids %d %d", a.seq, b.seq);
    t.reserve(a, 10);
    t.reserve(b, 3);
    expect_consistent(t, "reserve");
    CHECK(t.kv_reserved() == 13 && t.kv_used() == 0, "reserved %llu used %llu", (unsigned long long) t.kv_reserved(),
          (unsigned long long) t.kv_used());
    t.commit(a, 4, 4);  // a first piece of a split step: its rows only
    CHECK(a.positions == 4 && a.reserved == 6, "piece: %u positions, %u reserved", a.positions, a.reserved);
    t.commit(a, 6, a.reserved);
    CHECK(a.positions == 10 && a.reserved == 0 && t.kv_used() == 10, "step: %u positions", a.positions);
    t.commit(b, 3, 99);  // frees at most what it reserved
    CHECK(b.reserved == 0 && t.kv_reserved() == 0, "over-free: %u reserved", b.reserved);
    expect_consistent(t, "commit");
    t.truncate(a, 7);
    CHECK(a.positions == 7 && t.kv_used() == 10, "truncate: %u positions, %llu used", a.positions,
          (unsigned long long) t.kv_used());
    t.truncate(a, 9);  // beyond what it holds: nothing changes
    CHECK(a.positions == 7, "truncate beyond: %u positions", a.positions);
    expect_consistent(t, "truncate");
    t.reserve(b, 2);
    t.unreserve(b);
    CHECK(b.reserved == 0 && t.kv_reserved() == 0, "unreserve");
    t.reserve(a, 5);  // removed with a reservation outstanding
    t.remove("a", EndKind::released);
    CHECK(t.kv_used() == 3 && t.kv_reserved() == 0, "remove: used %llu reserved %llu",
          (unsigned long long) t.kv_used(), (unsigned long long) t.kv_reserved());
    expect_consistent(t, "remove");
    t.remove("b", EndKind::cancelled);
    CHECK(t.kv_used() == 0 && t.size() == 0, "empty table holds %llu cells", (unsigned long long) t.kv_used());
}

void test_sequence_ids_and_tombstones() {
    SessionTable t(2, 2);
    t.open("a", 1);
    t.open("b", 1);
    CHECK(t.full(), "two of two sessions: not full");
    t.remove("a", EndKind::evicted);
    Session & c = t.open("c", 1);
    CHECK(c.seq == 0, "the lowest free id is reused: %d", c.seq);
    const Tombstone * ts = t.tombstone("a");
    CHECK(ts && ts->epoch == 1 && ts->kind == EndKind::evicted, "tombstone of a");
    t.remove("b", EndKind::released);
    t.remove("c", EndKind::released);
    CHECK(t.tombstone("a") == nullptr, "only the newest 2 tombstones are kept");
    CHECK(t.tombstone("b") && t.tombstone("c"), "the newest tombstones are kept");
    CHECK(t.remove("nobody", EndKind::released) == nullptr, "removing an unknown id");
}

void test_lru_and_ttl_skip_busy_sessions() {
    SessionTable t(4, 4);
    const auto now = Clock::now();
    Session & old_busy = t.open("old-busy", 1);
    Session & old_idle = t.open("old-idle", 1);
    Session & fresh = t.open("fresh", 1);
    old_busy.last_used = now - std::chrono::seconds(100);
    move_step(old_busy, StepState::queued);
    old_idle.last_used = now - std::chrono::seconds(50);
    fresh.last_used = now;
    Session * lru = t.lru_idle(now, 10.0, "");
    CHECK(lru == &old_idle, "LRU picked %s", lru ? lru->id.c_str() : "none");
    CHECK(t.lru_idle(now, 10.0, "old-idle") == nullptr, "the requester itself is never evicted");
    const auto gone = t.expired(now, 40.0);
    CHECK(gone.size() == 1 && gone[0] == "old-idle", "%zu expired", gone.size());
}

void test_step_moves() {
    using S = StepState;
    const S all[] = {S::idle, S::queued, S::downstream};
    int allowed = 0;
    for (S a : all) {
        for (S b : all) allowed += step_move_allowed(a, b);
    }
    CHECK(allowed == 5, "%d allowed moves (expected the 5 written down)", allowed);
    CHECK(step_move_allowed(S::idle, S::queued) && step_move_allowed(S::queued, S::downstream) &&
              step_move_allowed(S::downstream, S::idle) && step_move_allowed(S::queued, S::idle) &&
              step_move_allowed(S::queued, S::queued),
          "a written-down move is refused");
    CHECK(!step_move_allowed(S::idle, S::downstream) && !step_move_allowed(S::downstream, S::queued) &&
              !step_move_allowed(S::idle, S::idle),
          "a move that skips a state is allowed");
    SessionTable t(1, 1);
    Session & s = t.open("s", 1);
    CHECK(!s.busy() && s.step == S::idle, "a new session is busy");
    move_step(s, S::queued);
    move_step(s, S::downstream);
    CHECK(s.busy(), "a session awaiting its route is not busy");
    move_step(s, S::idle);
    CHECK(!s.busy(), "answered: still busy");
}

void test_link_moves() {
    using L = ChainLink;
    const L all[] = {L::none, L::linked, L::forwarding, L::broken};
    int allowed = 0;
    for (L a : all) {
        for (L b : all) allowed += link_move_allowed(a, b);
    }
    CHECK(allowed == 4, "%d allowed chain-link moves (expected the 4 written down)", allowed);
    CHECK(link_move_allowed(L::none, L::linked) && link_move_allowed(L::linked, L::forwarding) &&
              link_move_allowed(L::linked, L::broken) && link_move_allowed(L::forwarding, L::broken),
          "a written-down chain-link move is refused");
    CHECK(!link_move_allowed(L::broken, L::forwarding) && !link_move_allowed(L::forwarding, L::linked) &&
              !link_move_allowed(L::none, L::forwarding) && !link_move_allowed(L::broken, L::broken),
          "a chain-link move that is not written down is allowed");
    SessionTable t(1, 1);
    Session & s = t.open("s", 1);
    CHECK(s.chain.link == L::none, "a new session is %s", chain_link_name(s.chain.link));
    move_link(s, L::linked);
    move_link(s, L::forwarding);
    move_link(s, L::broken);
    CHECK(s.chain.link == L::broken, "ended %s", chain_link_name(s.chain.link));
}

}  // namespace

int main() {
    test_step_moves();
    test_link_moves();
    test_kv_accounting_follows_a_session_life();
    test_sequence_ids_and_tombstones();
    test_lru_and_ttl_skip_busy_sessions();
    if (g_failures) {
        std::fprintf(stderr, "session_table_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("session_table_test: ok\n");
    return 0;
}
