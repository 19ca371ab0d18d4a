// Keeps a worker's cores awake between batches (--keep-warm-ms; docs/worker.md, "Keeping the
// cores awake").
//
// Why: a Shard of a route idles while the other Shards compute (one session: every other stage
// time), and the next row then lands on an idle core. Waking it costs time that the whole model
// on one host never pays: measured on a 2-vCPU VM, SmolLM2 0:19|19:30, one session, each worker
// pinned to its own core: 62.2 tok/s median of 6, against 69.5 with a lowest-priority busy loop
// on each core in between (6 of 6 pairs faster; the whole model on one core: 75.4 and 75.1).
// This option in the workers instead: 55.7 -> 59.5 there (4 of 6 pairs), 55.3 -> 56.5 across
// two lab hosts (6 of 8 pairs); docs/worker.md.
//
// How: `threads` threads at SCHED_IDLE spin for `linger` after each touch() (the scheduler
// touches after every batch), then sleep until the next touch. A SCHED_IDLE thread runs only
// when nothing else on its core wants to: any other thread that wakes there preempts it at
// once, so the spinning never delays a decode call or a gRPC thread; it only keeps the core from
// going idle. Where SCHED_IDLE cannot be set the threads do not spin at all (one warning).
// Costs power: the cores stay busy while sessions decode and for `linger` after.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace dgr::worker {

class KeepWarm {
public:
    // threads == 0 or linger_s <= 0: off (touch() does nothing)
    KeepWarm(uint32_t threads, double linger_s);
    ~KeepWarm();
    KeepWarm(const KeepWarm &) = delete;
    KeepWarm & operator=(const KeepWarm &) = delete;

    // activity: spin for the next linger
    void touch();
    // threads that spin when touched (0: off, or SCHED_IDLE refused)
    uint32_t spinners() const { return spinners_.load(); }
    // spinners inside their busy loop now (the others sleep until the next touch)
    uint32_t spinning() const { return spinning_.load(); }
    // rounds of the busy loops so far (observable progress, for tests)
    uint64_t rounds() const { return rounds_.load(std::memory_order_relaxed); }

private:
    void run();

    const int64_t linger_ns_;
    std::atomic<int64_t> until_ns_{0};
    std::atomic<bool> stop_{false};
    std::atomic<uint32_t> spinners_{0};
    std::atomic<uint32_t> spinning_{0};
    std::atomic<uint64_t> rounds_{0};
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::thread> threads_;
};

}  // namespace dgr::worker
