// The scheduler: one thread that owns the shard's sessions and routes every event to the unit
// that handles it. gRPC reactions and downstream links only post events here (events.h); they
// never wait for the model. Frames go to the admission (frame_admission.h), the route's answers
// to the step flow (step_flow.h), session ends (release, cancel, a closed stream, stop) are
// handled here; between rounds of events the pacer (pacer.h) says whether to gather more rows,
// and the step flow runs one batch. What the handlers share, and the units themselves, are in
// scheduler_state.h; docs/worker.md draws them and the event flow.
//
// Batching policy (docs/worker.md): a batch holds at most max_batch_tokens rows. Every pending
// DECODE step (one row per session) goes first; PREFILL chunks follow oldest-first while they
// fit; after a batch that carried prefill rows, pending DECODE steps go alone (decode's turn).
// Because max_sessions + max_prefill_chunk_tokens <= max_batch_tokens is enforced at startup,
// the oldest pending prefill chunk always fits next to all decode rows: decode is never delayed
// by prefill for more than the one batch in flight, and prefill never starves.
#pragma once

#include "worker/events.h"
#include "worker/frame_admission.h"
#include "worker/scheduler_state.h"
#include "worker/step_flow.h"
#include "worker/stream_sink.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dgr::worker {

class Scheduler {
public:
    Scheduler(ModelBackend & backend, Metrics & metrics, const SchedulerOptions & opts);
    ~Scheduler();

    void start();
    // Stops the thread; every session is released and every stream ended with `status`.
    void stop(grpc::Status status);

    // --- called from gRPC reactions (never block) ---
    // Returns false when the queue is full (the caller answers OVER_BUDGET itself).
    bool post_frame(std::shared_ptr<StreamSink> sink, std::unique_ptr<pb::SessionRequest> req, Clock::time_point t0);
    void post_stream_closed(std::shared_ptr<StreamSink> sink, bool cancelled);
    void post_release(const pb::ReleaseSessionRequest & req, std::function<void(pb::ReleaseSessionResponse)> done);
    void post_cancel(const pb::CancelSessionRequest & req, std::function<void(pb::CancelSessionResponse)> done);
    // --- called from downstream links (chained routes) ---
    void post_downstream(const std::string & session_id, uint64_t generation, pb::SessionResponse resp);
    void post_downstream_end(const std::string & session_id, uint64_t generation, const grpc::Status & status);

    // Draining: no new sessions (UNAVAILABLE); existing ones continue until released.
    void set_draining();
    uint32_t active_sessions() const { return st_.active.load(); }

    Gauges gauges() const;
    // The accounting invariants (KV totals equal the sessions' sums; once stopped, no ticket,
    // session or queued step is left): an empty string when they hold, else what drifted. Call it
    // only while the scheduler thread is not running (before start, after stop); debug builds
    // also check the KV part on the thread after every round of events.
    std::string audit() const;
    const SchedulerOptions & options() const { return st_.opts; }
    const pb::GetCapabilityResponse & capability() const { return st_.cap; }

private:
    bool post(Event ev);  // false: stopped (the event was not queued)
    void loop();
    // waits for more rows before a batch as the pacer says (pacer.h); false: stop
    bool gather();
    bool dispatch(std::deque<Event> & evs);  // false: stop
    void on(FrameEvent & ev) { admission_.on(ev); }
    void on(DownReplyEvent & ev) { flow_.on(ev); }
    void on(DownEndEvent & ev) { flow_.on(ev); }
    void on(ClosedEvent & ev);
    void on(ReleaseEvent & ev);
    void on(CancelEvent & ev);
    void stop_now(const StopEvent & ev, std::deque<Event> & evs, size_t next);

    // the units and what the handlers share; declared before the inbox, whose frames hold
    // tickets counted in st_.queued
    SchedulerState st_;
    FrameAdmission admission_{st_};
    StepFlow flow_{st_};

    // inbox (guarded)
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Event> inbox_;
    bool stopped_ = false;  // guarded by mu_: events are then answered inline

    Clock::time_point last_sweep_;
    std::thread thread_;
    bool started_ = false;
};

}  // namespace dgr::worker
