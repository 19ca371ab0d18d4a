// --keep-warm-ms (worker/keep_warm.h): the spinners run at SCHED_IDLE, spin only after a touch
// and for no longer than the linger, and stop promptly. A host that refuses SCHED_IDLE gets no
// spinning at all: the test then checks that and exits kSkipped, which CTest counts as skipped
// (SKIP_RETURN_CODE in worker/CMakeLists.txt), never as passed.
#include "worker/keep_warm.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include <pthread.h>
#include <sched.h>

#include "check.h"

using dgr::worker::KeepWarm;

namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

void test_off_does_nothing() {
    KeepWarm off(0, 0.05), no_linger(2, 0.0);
    off.touch();
    no_linger.touch();
    sleep_ms(20);
    CHECK(off.spinners() == 0 && no_linger.spinners() == 0, "threads started while off");
}

// Whether this host lets a thread run at SCHED_IDLE (it needs no privilege on Linux >= 2.6.39,
// but a sandbox may refuse it), tried on a thread of its own as KeepWarm's spinners do.
bool sched_idle_allowed() {
    bool ok = false;
    std::thread t([&ok] {
        sched_param sp{};
        ok = pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) == 0;
    });
    t.join();
    return ok;
}

void test_refused_sched_idle_never_spins() {
    KeepWarm warm(2, 0.05);
    for (int i = 0; i < 5; ++i) warm.touch();
    sleep_ms(20);
    CHECK(warm.spinners() == 0, "%u spinner(s) although SCHED_IDLE is refused", warm.spinners());
}

// Waits (bounded, generously: a SCHED_IDLE thread runs only on a core nothing else wants) until
// `cond` holds; whether it did.
template <class F> bool eventually(F && cond, int limit_ms = 20000) {
    for (int waited = 0; waited < limit_ms; waited += 2) {
        if (cond()) return true;
        sleep_ms(2);
    }
    return cond();
}

// State, not time: the spinner is asleep until touched, enters its busy loop after a touch and
// makes progress there, and is back asleep (no progress at all) once the linger has passed.
// No assert depends on how much CPU the spinner got.
void test_spins_after_a_touch_and_sleeps_after_the_linger() {
    KeepWarm warm(1, 0.03);
    CHECK(eventually([&] { return warm.spinners() == 1; }), "%u spinner(s) of 1 at SCHED_IDLE", warm.spinners());
    sleep_ms(20);
    CHECK(warm.spinning() == 0 && warm.rounds() == 0, "spinning before any touch (%llu rounds)",
          (unsigned long long) warm.rounds());
    // touched again and again: it spins and makes progress
    std::atomic<bool> busy{true};
    std::thread toucher([&] {
        while (busy.load()) {
            warm.touch();
            sleep_ms(5);
        }
    });
    const bool spun = eventually([&] { return warm.rounds() > 100; });
    busy = false;
    toucher.join();
    CHECK(spun, "no progress in the busy loop while touched (%llu rounds)", (unsigned long long) warm.rounds());
    // past the linger: asleep, and asleep means no rounds at all
    CHECK(eventually([&] { return warm.spinning() == 0; }), "still spinning after the linger");
    const uint64_t r0 = warm.rounds();
    sleep_ms(100);
    CHECK(warm.rounds() == r0 && warm.spinning() == 0, "%llu rounds while asleep",
          (unsigned long long) (warm.rounds() - r0));
    warm.touch();  // spinning when destroyed: the destructor stops it (the test would hang otherwise)
}

}  // namespace

int main() {
    constexpr int kSkipped = 77;  // SKIP_RETURN_CODE of every CTest program (worker/CMakeLists.txt)
    const bool idle_allowed = sched_idle_allowed();
    test_off_does_nothing();
    if (idle_allowed) {
        test_spins_after_a_touch_and_sleeps_after_the_linger();
    } else {
        test_refused_sched_idle_never_spins();
    }
    if (g_failures) {
        std::fprintf(stderr, "keep_warm_test: %d failure(s)\n", g_failures);
        return 1;
    }
    if (!idle_allowed) {
        std::printf("keep_warm_test: skipped: this host refuses SCHED_IDLE, so the spinning is not checked "
                    "(only that nothing spins)\n");
        return kSkipped;
    }
    std::printf("keep_warm_test: ok\n");
    return 0;
}
