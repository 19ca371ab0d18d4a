// What the scheduler thread's handlers share: the units (each owned once, here) and the few
// answers and accounting steps more than one handler takes. The scheduler (scheduler.h) owns
// one and routes each event to the handler of its kind: frames to the admission
// (frame_admission.h), computed and forwarded steps to the step flow (step_flow.h), the
// session ends (release, cancel, close, stop) to itself. Everything here is used on the
// scheduler thread only, except the atomics (read by the gauges, and tickets taken by gRPC
// reactions).
//
// The units: the frame intake (frame_intake.h: pure checks), the session table
// (session_table.h: sessions and their KV accounting), the work queue (work_queue.h: queued
// steps and the batching policy), the pacer (pacer.h: when a batch runs, pipeline groups), the
// batch runner (batch_runner.h: a batch's compute and answers), the chain forwarder
// (chain_forwarder.h: hops, links, forwarded frames), generation (generation.h) and the
// session reaper (session_reaper.h: ending sessions, eviction, TTL).
#pragma once

#include "worker/backend.h"
#include "worker/batch_runner.h"
#include "worker/chain_forwarder.h"
#include "worker/events.h"
#include "worker/frame_intake.h"
#include "worker/generation.h"
#include "worker/keep_warm.h"
#include "worker/metrics.h"
#include "worker/option_table.h"
#include "worker/pacer.h"
#include "worker/session_reaper.h"
#include "worker/session_table.h"
#include "worker/work_queue.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>

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

// The options as the backend allows them (capability.cpp): the KV budget and session count
// within what the context was created for, and the chunk limit such that the oldest prefill
// chunk always fits next to one decode row per session.
SchedulerOptions fit_options(SchedulerOptions o, const BackendInfo & in);
// What a worker serves (GetCapability; capability.cpp): identity from the backend, limits from
// the scheduler's (adjusted) options. The scheduler checks frames against the same message.
pb::GetCapabilityResponse capability_of(const BackendInfo & in, const SchedulerOptions & o);

// How a session's downstream link reaches the scheduler thread: its replies and its end are
// posted as events (DownReplyEvent, DownEndEvent) for the session's `generation`.
struct LinkEvents {
    std::function<void(const std::string & session_id, uint64_t generation, pb::SessionResponse)> reply;
    std::function<void(const std::string & session_id, uint64_t generation, const grpc::Status &)> end;
};

struct SchedulerState {
    SchedulerState(ModelBackend & backend, Metrics & metrics, const SchedulerOptions & opts, LinkEvents link_events);

    ModelBackend & backend;
    Metrics & metrics;
    const SchedulerOptions opts;  // as the backend allows them (fit_options)
    const BackendInfo info;
    const pb::GetCapabilityResponse cap;
    // FrameTickets out (frame_ticket.h): changed only by tickets; declared before everything that
    // holds one (the queue here, the scheduler's inbox), so that it outlives them
    std::atomic<uint32_t> queued{0};
    std::atomic<bool> draining{false};   // no new sessions (UNAVAILABLE)
    std::atomic<uint32_t> active{0};     // published after every change (gauges)
    std::atomic<uint64_t> kv_used_pub{0};

    FrameIntake intake;
    Generation generation;
    BatchRunner runner;
    ChainForwarder chain;
    SessionTable table;
    WorkQueue queue;
    Pacer pacer;
    SessionReaper reaper;
    std::unique_ptr<KeepWarm> warm;      // --keep-warm-ms (null: off)
    uint64_t fwd_batch_seq = 0;          // id of the last batch whose rows were forwarded (StepFrame.batch)
    const LinkEvents link_events;

    // `internal`: the error answers server-side generation, not a queued frame (the stream is
    // not asked for its next frame)
    void answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err, Clock::time_point t0,
                      pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED, bool internal = false);
    // answers a frame with an error (its ticket goes back)
    void answer_frame_error(FrameEvent & ev, const pb::ResponseHeader & hdr, pb::ShardError err,
                            pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED);
    // a client frame of the session is received and not answered yet
    bool has_unanswered_frame(const Session & s) const;
    // ends the session (reaper) and publishes the gauges; returns the positions it held
    uint64_t drop_session(const std::string & id, EndKind kind);
    // room for `cells` more KV cells (and a session slot), evicting idle sessions (reaper)
    bool make_room(uint64_t cells, bool need_session, const std::string & requester);
    void sweep_ttl(Clock::time_point now);
    void publish_gauges();
    // queues a PREFILL step, split into pieces on a pipelined chained session
    void queue_prefill(Session & s, WorkPtr w);
    // opens the session's link to its first hop; its replies and end come back as events
    void open_chain(Session & s, const pb::StepFrame & sf);
};

}  // namespace dgr::worker
