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
#pragma once

#include "worker/backend.h"
#include "worker/downstream.h"
#include "worker/metrics.h"
#include "worker/sampling.h"
#include "worker/stream_sink.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace dgr::worker {

struct SchedulerOptions {
    uint32_t max_sessions = 16;
    uint32_t max_session_positions = 2048;  // --ctx-per-session
    uint64_t kv_cells = 0;                  // budget; 0 = backend's cells
    uint32_t queue_limit = 64;              // frames received and not yet answered
    uint32_t max_batch_tokens = 512;
    uint32_t max_prefill_chunk_tokens = 256;
    uint64_t max_message_bytes = 64ull << 20;
    uint32_t max_fragment_bytes = 1u << 20;
    double session_ttl_s = 600.0;   // a session idle this long is evicted (CACHE_MISS later)
    double evict_idle_s = 30.0;     // under KV/session pressure, LRU sessions idle this long may be evicted
    uint32_t tombstones = 4096;     // remembered ended sessions (for precise errors)
    ChainOptions chain;             // chained routes: allowed peers, TLS towards them
    uint64_t memory_budget_bytes = 0;  // --memory-budget-mb (0: none); weights + scratch + KV fit in it
};

using Clock = std::chrono::steady_clock;

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
    const SchedulerOptions & options() const { return opts_; }

private:
    struct Tombstone { uint64_t epoch; int kind; };  // kind: 0 released, 1 evicted, 2 cancelled
    struct Partial;  // a fragmented step being assembled
    struct Session {
        std::string id;
        uint64_t epoch = 0;
        int32_t seq = -1;
        uint32_t positions = 0;
        int64_t last_step = -1;
        bool has_stored = false;
        pb::SessionResponse stored;
        uint32_t effective_start = 0;
        SamplingConfig sampling;
        SamplingRng rng;
        std::shared_ptr<StreamSink> sink;
        Clock::time_point last_used;
        bool busy = false;  // a step is queued or in the batch
        bool decoding = false;  // its last completed step was a DECODE (a next one is likely)
        uint32_t reserved = 0;  // KV cells reserved by the queued step
        std::unique_ptr<Partial> partial;
        uint64_t generation = 0;
        // chained route: this worker sends its boundary output to the next Shard itself
        std::shared_ptr<DownstreamLink> down;
        pb::ChainHop down_hop;
        std::vector<pb::ChainHop> down_rest;  // carried by the opening forwarded frame
        uint64_t down_step = 0;
        bool down_opened = false;
        bool down_colocated = false;          // every hop is on this host (loopback): shares our cores
        std::string down_failed;              // the link ended: the next frame gets this error
        std::unique_ptr<pb::SamplingParams> fwd_sampling;  // goes with the next forwarded StepFrame
        bool awaiting = false;                // a forwarded step waits for the route's answer
        pb::ResponseHeader pending_header;    // ... answered with this header
        bool pending_internal = false;
        Clock::time_point pending_t0;
        Clock::time_point down_sent_t0;       // the forwarded frame left for the next Shard (hop latency)
        bool down_sent_decode = false;
        // server-side generation (StepFrame.generate)
        bool generating = false;
        uint32_t gen_left = 0;                // responses still to give, the one in flight included
        bool gen_continue = false;
        uint32_t gen_per_answer = 1;          // GenerateParams.tokens_per_answer (>= 1)
    };
    struct Work {
        std::string session_id;
        uint64_t generation;
        bool decode;
        std::vector<int32_t> tokens;
        std::vector<float> rows;
        uint32_t pos0 = 0;
        uint32_t n = 0;
        bool sample = false;
        pb::ResponseHeader header;
        Clock::time_point t0;
        Clock::time_point t_ready;
        bool internal = false;  // fed back by server-side generation (no client frame behind it)
    };
    struct Event {
        enum Kind { frame, closed, release, cancel, stop, down_reply, down_end } kind;
        std::shared_ptr<StreamSink> sink;
        std::unique_ptr<pb::SessionRequest> req;
        Clock::time_point t0;
        bool cancelled = false;
        std::string session_id;
        uint64_t epoch = 0;
        std::function<void(pb::ReleaseSessionResponse)> release_done;
        std::function<void(pb::CancelSessionResponse)> cancel_done;
        std::unique_ptr<pb::SessionResponse> resp;  // down_reply
        grpc::Status status;                        // down_end
    };

    void post_unless_stopped(Event ev);  // downstream events after stop() are dropped
    void loop();
    bool dispatch(std::deque<Event> & evs);  // false: stop
    // sessions whose next DECODE row is likely to arrive soon: plain ones (a client round trip
    // away) and chained generating ones whose route runs on this host (a downstream compute away)
    struct Expected { uint32_t plain = 0, colocated_chain = 0; };
    Expected expected_decoders() const;
    void handle_frame(Event & ev);
    void handle_closed(Event & ev);
    // `internal`: the error answers server-side generation, not a queued frame (the stream
    // is not asked for its next frame and the queue count is untouched)
    void answer_error(StreamSink & sink, const pb::ResponseHeader & hdr, pb::ShardError err,
                      Clock::time_point t0, pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED,
                      bool internal = false);
    void handle_down_reply(Event & ev);
    void handle_down_end(Event & ev);
    // sends a completed step's boundary rows to the session's downstream Shard
    void forward(Session & s, const Work & w, pb::SessionResponse & r);
    // server-side generation: whether this answer is held to go out with the next ones
    // (GenerateParams.tokens_per_answer) rather than at once
    static bool holds_answer(const Session & s, bool internal, bool finished);
    // server-side generation: after answering `token`, queue the next DECODE row (or stop)
    void continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished);
    // "downstream HOST:PORT [A, B)": how errors of a chained session name the next Shard
    static std::string down_label(const Session & s);
    // a client frame of the session is received and not answered yet
    bool has_unanswered_frame(const Session & s) const;
    void run_batch();
    void finish_work(Work & w, Session & s, int32_t row);
    // drops the session's state; returns freed KV cells
    uint64_t drop_session(const std::string & id, int tomb_kind);
    bool make_room(uint64_t cells, bool need_session, const std::string & requester);
    void sweep_ttl(Clock::time_point now);
    void remember(const std::string & id, uint64_t epoch, int kind);
    void publish_gauges();

    ModelBackend & backend_;
    Metrics & metrics_;
    SchedulerOptions opts_;
    const BackendInfo info_;
    ChainPeers peers_;

    // inbox (guarded)
    mutable std::mutex mu_;
    std::condition_variable cv_;
    std::deque<Event> inbox_;
    std::atomic<uint32_t> queued_{0};  // frames posted and not yet answered/queued for compute
    std::atomic<bool> draining_{false};
    bool stopped_ = false;  // guarded by mu_: events are then answered inline

    // scheduler-thread state
    std::unordered_map<std::string, std::unique_ptr<Session>> sessions_;
    std::unordered_map<std::string, Tombstone> tombstones_;
    std::deque<std::string> tomb_order_;
    std::vector<int32_t> free_seqs_;
    std::deque<std::unique_ptr<Work>> decode_q_;
    std::deque<std::unique_ptr<Work>> prefill_q_;
    uint64_t kv_used_ = 0;      // positions held by all sessions
    uint64_t kv_reserved_ = 0;  // cells reserved by queued steps
    uint64_t next_generation_ = 1;
    double last_decode_s_ = 0.0;  // EWMA of decode-only batch calls
    Clock::time_point last_sweep_;

    std::atomic<uint32_t> active_{0};
    std::atomic<uint64_t> kv_used_pub_{0};
    std::atomic<uint32_t> pending_pub_{0};
    std::thread thread_;
    bool started_ = false;
};

}  // namespace dgr::worker
