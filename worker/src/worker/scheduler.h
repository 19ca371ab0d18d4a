// The scheduler: one thread owns the session table (Hot KV State bookkeeping), validates every
// frame against it, admits work under the session/KV/queue budgets and forms one decode batch
// at a time from the pending steps of all sessions (continuous batching). gRPC reactions only
// post events here; they never wait for the model.
//
// Batching policy (docs/worker.md): a batch holds at most max_batch_tokens rows. Every pending
// DECODE step (one row per session) goes first; PREFILL chunks follow oldest-first while they
// fit. Because max_sessions + max_prefill_chunk_tokens <= max_batch_tokens is enforced at
// startup, the oldest pending prefill chunk always fits next to all decode rows: decode is never
// delayed by prefill for more than the one batch in flight, and prefill never starves.
//
// The class is one unit of state with its methods split by concern over several files:
// scheduler.cpp (events, loop, release/cancel/stop), session_lifecycle.cpp (gauges, audit,
// dropping sessions, eviction, TTL), frame_intake.cpp (a
// frame: validation with common/bundle.h, session-state checks, admission), batch_runner.cpp
// (a batch's decode and answers), chain_link.cpp (forwarding to the downstream Shard) and
// generation.cpp (server-side generation). The session table (session_table.h) and the queue of
// steps with its batching policy (work_queue.h) are classes of their own.
#pragma once

#include "worker/backend.h"
#include "worker/downstream.h"
#include "worker/events.h"
#include "worker/keep_warm.h"
#include "worker/metrics.h"
#include "worker/option_table.h"
#include "worker/sampling.h"
#include "worker/session_table.h"
#include "worker/stream_sink.h"
#include "worker/work_queue.h"

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

struct SchedulerOptions {
    // the defaults of the options' values: the option table's (worker/option_table.h)
    uint32_t max_sessions = default_u32(Opt::kMaxSessions);
    uint32_t max_session_positions = default_u32(Opt::kCtxPerSession);
    uint64_t kv_cells = 0;  // budget; 0 = backend's cells
    uint32_t queue_limit = default_u32(Opt::kQueueLimit);  // frames received and not yet answered
    uint32_t max_batch_tokens = default_u32(Opt::kMaxBatchTokens);
    uint32_t max_prefill_chunk_tokens = default_u32(Opt::kMaxPrefillChunk);
    uint64_t max_message_bytes = default_u64(Opt::kMaxMessageBytes);
    uint32_t max_fragment_bytes = 1u << 20;  // not an option
    // a session idle this long is evicted (CACHE_MISS later)
    double session_ttl_s = default_real(Opt::kSessionTtlS);
    // under KV/session pressure, LRU sessions idle this long may be evicted
    double evict_idle_s = default_real(Opt::kEvictIdleS);
    uint32_t tombstones = 4096;     // remembered ended sessions (for precise errors)
    ChainOptions chain;             // chained routes: allowed peers, TLS towards them
    // --pipeline-groups: 0 auto (one per stage off-host), 1 off (pipeline.h)
    uint32_t pipeline_groups = default_u32(Opt::kPipelineGroups);
    uint64_t memory_budget_bytes = 0;  // --memory-budget-mb (0: none); weights + scratch + KV fit in it
    double keep_warm_s = 0.0;       // --keep-warm-ms: keep the cores awake this long after a batch (keep_warm.h)
    uint32_t keep_warm_threads = 1; // one spinner per compute thread
};

// What a worker serves (GetCapability): identity from the backend, limits from the scheduler's
// (adjusted) options. The scheduler checks frames against the same message.
pb::GetCapabilityResponse capability_of(const BackendInfo & in, const SchedulerOptions & o);

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
    uint32_t active_sessions() const { return active_.load(); }

    Gauges gauges() const;
    // The accounting invariants (KV totals equal the sessions' sums; once stopped, no ticket,
    // session or queued step is left): an empty string when they hold, else what drifted. Call it
    // only while the scheduler thread is not running (before start, after stop); debug builds
    // also check the KV part on the thread after every round of events.
    std::string audit() const;
    const SchedulerOptions & options() const { return opts_; }
    const pb::GetCapabilityResponse & capability() const { return cap_; }

private:
    struct Intake;  // frame_intake.cpp: one frame's fields and response header

    // ---- scheduler.cpp: events, loop; session_lifecycle.cpp: dropping sessions, room, TTL ----
    bool post(Event ev);  // false: stopped (the event was not queued)
    void loop();
    bool dispatch(std::deque<Event> & evs);  // false: stop
    void on(ClosedEvent & ev);
    void on(ReleaseEvent & ev);
    void on(CancelEvent & ev);
    void stop_now(const StopEvent & ev, std::deque<Event> & evs, size_t next);
    // sessions whose next DECODE row is likely to arrive soon: plain ones (a client round trip
    // away) and chained generating ones whose route runs on this host (a downstream compute away)
    struct Expected { uint32_t plain = 0, colocated_chain = 0; };
    // sessions paced by a pipeline count only when predicted to send by `deadline` (pipeline.h
    // worth_waiting); others count while they decode
    Expected expected_decoders(Clock::time_point deadline) const;
    // rows of `s` come in pipeline groups: opened by a pipelining Shard (StepFrame.pipelined),
    // or chained downstream by this one with more than one group
    bool paced_by_pipeline(const Session & s) const;
    // ---- pipelined routes (pipeline.h): the cap on chained DECODE rows per batch (0: none)
    uint32_t chain_group_rows() const;
    // the pipeline block of a queued DECODE row's chained session under `group` (-1: not chained)
    WorkQueue::BlockOf block_of(uint32_t group) const;
    // generating chained sessions of `block` downstream now, next row predicted by `deadline`
    uint32_t block_due_by(int64_t block, uint32_t group, Clock::time_point deadline) const;
    // a DECODE row of `s` is queued: learn its answer-to-next-row gap
    static void note_decode_arrival(Session & s);
    // queues a PREFILL step, split into pieces on a pipelined chained session
    void queue_prefill(Session & s, std::unique_ptr<Work> w);
    // `internal`: the error answers server-side generation, not a queued frame (the stream
    // is not asked for its next frame and the queue count is untouched)
    void answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err,
                      Clock::time_point t0, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED,
                      bool internal = false);
    // answers a frame at intake with an error (its ticket goes back)
    void answer_frame_error(FrameEvent & ev, const pb::ResponseHeader & hdr, pb::ShardError err,
                            pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED);
    // a client frame of the session is received and not answered yet
    bool has_unanswered_frame(const Session & s) const;
    // drops the session's state (queued work, KV, downstream link); returns freed KV cells
    uint64_t drop_session(const std::string & id, EndKind kind);
    bool make_room(uint64_t cells, bool need_session, const std::string & requester);
    void sweep_ttl(Clock::time_point now);
    void publish_gauges();

    // ---- frame_intake.cpp: one frame ----
    void on(FrameEvent & ev);
    // session-state checks (epoch, tombstones, replays, step order, cache expectation);
    // false: answered. *opening: the frame opens a (new epoch of the) session.
    bool check_session_state(FrameEvent & ev, Intake & in, Session * s, bool * opening);
    // PREFILL/DECODE input: token ids (head) or the boundary rows (assembled over frames);
    // false: answered (or a partial step waits for its next fragment).
    bool take_input(FrameEvent & ev, Intake & in, Session * s, bool opening, Work & w);
    void phase_without_input(FrameEvent & ev, Intake & in, Session & s);

    // ---- batch_runner.cpp: batches ----
    void run_batch();
    void fail_batch(std::vector<std::unique_ptr<Work>> & items, std::vector<Session *> & sess, BackendStatus st,
                    const std::string & err);
    // the answer of a completed step (tail: the sampled token; else the boundary rows)
    pb::SessionResponse answer_of(Work & w, Session & s, int32_t first_row, int32_t last_row, int32_t * sampled,
                                  bool * finished);

    // ---- chain_link.cpp: chained routes ----
    // checks StepFrame.downstream of an opening frame; an error when it is not a valid route
    bundle::Result check_hops(const pb::StepFrame & sf) const;
    void open_chain(Session & s, const pb::StepFrame & sf);
    // sends a completed step's boundary rows to the session's downstream Shard
    // hint_rows > 1: a pipelined DECODE row, one of hint_rows forwarded to the same next Shard
    // from this batch (StepFrame.batch, id fwd_batch_seq_)
    void forward(Session & s, Work & w, pb::SessionResponse & r, uint32_t hint_rows = 0);
    void on(DownReplyEvent & ev);
    void on(DownEndEvent & ev);
    // "downstream HOST:PORT [A, B)": how errors of a chained session name the next Shard
    static std::string down_label(const Session & s);
    // a failure from the session's downstream stream: names the hop in the message and, unless
    // a Shard farther down is named already, in ShardError.failed_endpoint/start/end
    static void blame_downstream(const Session & s, pb::ShardError & e);

    // ---- generation.cpp: step completion and server-side generation ----
    // the one place a step completes, computed here or answered by the downstream Shard: `r`
    // becomes the stored answer (replays), goes out (or is held, tokens_per_answer), and
    // server-side generation queues its next row after `sampled` (-1: no token: it stops)
    void complete_step(Session & s, pb::SessionResponse r, const pb::ResponseHeader & hdr, Clock::time_point t0,
                       bool internal, int32_t sampled, bool finished);
    // whether this answer is held to go out with the next ones (GenerateParams.tokens_per_answer)
    static bool holds_answer(const Session & s, bool internal, bool finished);
    // after answering `token`, queue the next DECODE row (or stop)
    void continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished);

    ModelBackend & backend_;
    Metrics & metrics_;
    SchedulerOptions opts_;
    const BackendInfo info_;
    pb::GetCapabilityResponse cap_;  // after opts_ is final
    ChainPeers peers_;

    // inbox (guarded)
    mutable std::mutex mu_;
    std::condition_variable cv_;
    // FrameTickets out (frame_ticket.h): changed only by tickets; declared before everything that
    // holds one (inbox_, the queues), so that it outlives them
    std::atomic<uint32_t> queued_{0};
    std::deque<Event> inbox_;
    std::atomic<bool> draining_{false};
    bool stopped_ = false;  // guarded by mu_: events are then answered inline

    // scheduler-thread state
    SessionTable table_;
    WorkQueue queue_;  // steps waiting for compute, and the batching policy (work_queue.h)
    double last_decode_s_ = 0.0;  // EWMA of decode-only batch calls
    uint64_t fwd_batch_seq_ = 0;  // id of the last batch whose rows were forwarded (StepFrame.batch)
    Clock::time_point last_sweep_;

    std::atomic<uint32_t> active_{0};
    std::atomic<uint64_t> kv_used_pub_{0};
    std::thread thread_;
    std::unique_ptr<KeepWarm> warm_;  // --keep-warm-ms (null: off)
    bool started_ = false;
};

}  // namespace dgr::worker
