// The session table (Hot KV State bookkeeping): the open sessions, keyed by session id, with
// their llama sequence ids (a pool, lowest id first), the tombstones of ended sessions (for
// precise errors: released vs evicted vs stale), KV cell accounting, and the TTL / LRU choice of
// sessions to evict. Owned and used by the scheduler thread only; nothing here touches the
// model or a stream (the scheduler frees a session's KV and answers its stream).
#pragma once

#include "common/bundle.h"
#include "worker/downstream.h"
#include "worker/sampling.h"
#include "worker/stream_sink.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace dgr::worker {

using Clock = std::chrono::steady_clock;

// How a session ended (its tombstone): the next frame of that epoch gets SESSION_RELEASED,
// CACHE_MISS (evicted) or SESSION_RELEASED (cancelled).
enum class EndKind { released, evicted, cancelled };

// Where a session's current step is.
//   idle:       none; the session's next frame may come
//   queued:     a step is queued or computing here (on a chained session, also while the early
//               pieces of a split PREFILL are downstream and later ones still wait here)
//   downstream: the step (its last piece) left for the next Shard; the route's answer is awaited
// The allowed moves (step_move_allowed, checked by move_step in debug builds and the tests):
//   idle -> queued        a client frame or server-side generation queues a step
//   queued -> idle        the step is computed (or refused: no KV cell for the batch)
//   queued -> queued      an early piece left for the next Shard; later pieces wait here
//   queued -> downstream  the step's last piece left for the next Shard
//   downstream -> idle    the route answered
enum class StepState { idle, queued, downstream };
bool step_move_allowed(StepState from, StepState to);
const char * step_state_name(StepState s);

struct Tombstone {
    uint64_t epoch = 0;
    EndKind  kind  = EndKind::released;
};

// A step whose boundary bundle arrives over several frames.
struct PartialStep {
    uint64_t          step = 0;
    bundle::Assembler assembler;
};

// Chained route: this worker sends its boundary output to the next Shard itself.
// A chained session's link to the next Shard (chain_forwarder.h, step_flow.h):
//   none: not chained (the tail, or a route driven step by step)
//   linked: the stream to the next Shard is open; no frame went down yet (the first one opens
//           the session there: CACHE_EXPECTATION_KIND_EMPTY and the rest of the hops)
//   forwarding: the session is open downstream; later steps go as they complete
//   broken: the stream ended while no step was downstream; the session's next frame is answered
//           with that error and the session ends
// The allowed moves (link_move_allowed, checked by move_link in debug builds and the tests):
//   none -> linked           an opening frame names downstream hops
//   linked -> forwarding     the first step went down
//   linked/forwarding -> broken   the stream ended with no step downstream
enum class ChainLink { none, linked, forwarding, broken };
bool link_move_allowed(ChainLink from, ChainLink to);
const char * chain_link_name(ChainLink s);

struct ChainState {
    std::shared_ptr<DownstreamLink> down;
    ChainLink                       link = ChainLink::none;  // move_link() only
    pb::ChainHop                    hop;
    std::vector<pb::ChainHop>       rest;        // carried by the opening forwarded frame
    uint64_t                        step = 0;    // next step number downstream
    bool                            colocated = false;  // every hop is on this host (shares our cores)
    uint32_t                        stages = 0;  // Shards of the route from this one on (this one included)
    uint32_t                        pieces_in_flight = 0;  // forwarded PREFILL pieces before the step's last
    pb::ResponseHeader              piece_header;          // their step's header (for errors)
    std::string                     failed;      // broken: the error the next frame gets
    pb::ErrorReason                 failed_reason = pb::ERROR_REASON_UNAVAILABLE;  // ... with this reason
    std::unique_ptr<pb::SamplingParams> fwd_sampling;  // goes with the next forwarded StepFrame
    // a forwarded step (StepState::downstream) is answered with this header
    pb::ResponseHeader   pending_header;
    bool                 pending_internal = false;
    Clock::time_point    pending_t0;
    Clock::time_point    sent_t0;                 // the forwarded frame left for the next Shard (hop latency)
    bool                 sent_decode = false;
};

// Server-side generation (StepFrame.generate).
struct GenerationState {
    bool     active = false;
    uint32_t left = 0;           // responses still to give, the one in flight included
    bool     continue_after_finish = false;
    uint32_t per_answer = 1;     // GenerateParams.tokens_per_answer (>= 1)
};

struct Session {
    std::string id;
    uint64_t    epoch = 0;
    uint64_t    generation = 0;  // unique per opened session: late downstream events are matched by it
    int32_t     seq = -1;
    uint32_t    positions = 0;  // changed by SessionTable only (commit, truncate)
    uint32_t    effective_start = 0;
    int64_t     last_step = -1;
    // the last completed step's answer (replayed when the step is resent by the owner with the
    // same content: one digest per frame of that step, frame_digest() in frame_intake.h)
    bool                has_stored = false;
    pb::SessionResponse stored;
    int64_t             digest_step = -1;
    std::vector<std::string> step_digests;
    SamplingConfig      sampling;
    SamplingRng         rng;
    SamplerState        sampler;  // penalties' window, grammar (tail)
    std::shared_ptr<StreamSink> sink;
    Clock::time_point   last_used;
    StepState step = StepState::idle;  // move_step() only
    bool busy() const { return step != StepState::idle; }
    bool     decoding = false;  // its last completed step was a DECODE (a next one is likely)
    uint32_t reserved = 0;      // KV cells reserved by the queued step (SessionTable only)
    Clock::time_point answered_at{};  // its last step was answered (or forwarded downstream)
    double   gap_s = 0.0;       // EWMA: answered -> its next DECODE row queued here (pipeline.h)
    bool     pipelined = false; // opened by a Shard forwarding in pipeline groups (StepFrame.pipelined)
    std::unique_ptr<PartialStep> partial;
    ChainState      chain;
    GenerationState gen;
};

// Moves the session's step to `to` (debug builds abort on a move step_move_allowed refuses).
void move_step(Session & s, StepState to);
// Moves the session's chain link to `to` (debug builds abort on a move link_move_allowed refuses).
void move_link(Session & s, ChainLink to);

class SessionTable {
public:
    SessionTable(uint32_t max_sessions, uint32_t max_tombstones);

    Session * find(const std::string & id);
    const Session * find(const std::string & id) const;
    const Tombstone * tombstone(const std::string & id) const;
    size_t size() const { return sessions_.size(); }
    bool full() const { return sessions_.size() >= max_sessions_; }

    // Opens a session on the lowest free sequence id (the caller checked !full()).
    Session & open(const std::string & id, uint64_t epoch);
    // Removes a session and leaves its tombstone; the caller frees its KV and answers its stream.
    std::unique_ptr<Session> remove(const std::string & id, EndKind kind);

    // The least recently used session idle for at least `min_idle_s`, neither busy nor `except`.
    Session * lru_idle(Clock::time_point now, double min_idle_s, const std::string & except);
    // Sessions idle (and not busy) for at least `ttl_s`.
    std::vector<std::string> expired(Clock::time_point now, double ttl_s) const;

    template <class F> void for_each(F && f) {
        for (auto & kv : sessions_) f(*kv.second);
    }
    template <class F> void for_each(F && f) const {
        for (const auto & kv : sessions_) f(static_cast<const Session &>(*kv.second));
    }
    std::vector<std::string> ids() const;

    // ---- KV cell accounting: the only code that changes positions, reservations and the totals.
    // A queued step reserves its rows; computing them commits them (they become positions and
    // leave the reservation); a refused or failed step gives its reservation back; TRUNCATE
    // drops positions; remove() frees both.
    void reserve(Session & s, uint32_t cells);
    // `rows` computed: positions grow by `rows`; `freed` cells (at most the reservation) leave it
    void commit(Session & s, uint32_t rows, uint32_t freed);
    void unreserve(Session & s);
    void truncate(Session & s, uint32_t positions);
    // cells held by all sessions' positions, and reserved by queued steps
    uint64_t kv_used() const { return kv_used_; }
    uint64_t kv_reserved() const { return kv_reserved_; }
    // the totals equal the sums over the sessions; an empty message when they do
    std::string check() const;

private:
    void remember(const std::string & id, uint64_t epoch, EndKind kind);

    uint32_t max_sessions_;
    uint32_t max_tombstones_;
    std::unordered_map<std::string, std::unique_ptr<Session>> sessions_;
    std::unordered_map<std::string, Tombstone> tombstones_;
    std::deque<std::string> tomb_order_;
    std::vector<int32_t> free_seqs_;  // descending: the lowest id at the back
    uint64_t next_generation_ = 1;
    uint64_t kv_used_ = 0;
    uint64_t kv_reserved_ = 0;
};

}  // namespace dgr::worker
