#include "worker/keep_warm.h"

#include <chrono>
#include <cstdio>

#include <pthread.h>
#include <sched.h>

namespace dgr::worker {

namespace {
int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}
}  // namespace

KeepWarm::KeepWarm(uint32_t threads, double linger_s) : linger_ns_((int64_t) (linger_s * 1e9)) {
    if (threads == 0 || linger_ns_ <= 0) return;
    for (uint32_t i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

KeepWarm::~KeepWarm() {
    {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    for (auto & t : threads_) t.join();
}

void KeepWarm::touch() {
    if (threads_.empty()) return;
    const int64_t now = now_ns();
    const int64_t prev = until_ns_.exchange(now + linger_ns_);
    if (prev <= now) {  // the spinners may be asleep
        std::lock_guard<std::mutex> lk(mu_);
        cv_.notify_all();
    }
}

void KeepWarm::run() {
    sched_param sp{};
    sp.sched_priority = 0;
    if (pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp) != 0) {
        static std::atomic<bool> warned{false};
        if (!warned.exchange(true)) {
            std::fprintf(stderr, "dgr-worker: warning: --keep-warm-ms: SCHED_IDLE refused; not spinning\n");
        }
        return;
    }
    spinners_++;
    bool spinning = false;
    while (!stop_.load(std::memory_order_relaxed)) {
        if (now_ns() < until_ns_.load(std::memory_order_relaxed)) {
            if (!spinning) spinning_++;
            spinning = true;
            for (int i = 0; i < 256; ++i) relax();
            rounds_.fetch_add(1, std::memory_order_relaxed);
            continue;
        }
        if (spinning) spinning_--;
        spinning = false;
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [this] { return stop_.load() || now_ns() < until_ns_.load(); });
    }
    if (spinning) spinning_--;
}

}  // namespace dgr::worker
