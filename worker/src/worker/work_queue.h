// The steps waiting for compute, and how one batch is taken from them (docs/worker.md,
// Continuous batching). A unit of its own: it knows steps, rows and the batching policy, never
// sessions or the model, so worker/tests/work_queue_test.cpp checks the policy without either.
//
// Policy: every pending DECODE row first (one row per session), then PREFILL steps oldest first
// while they fit. While PREFILL waits, DECODE rows leave room for one prefill chunk, so prefill
// never starves. After a batch that carried PREFILL rows, a batch with DECODE rows waiting takes
// those rows only (decode's turn): a DECODE row waits for at most the one batch in flight and is
// then computed without prefill rows, or it rides in the batch after a decode turn; and PREFILL
// still gets every second batch at least. On a pipelined route (pipeline.h) the chained DECODE
// rows of one batch are one group: the block of sequence ids of the oldest queued chained row, at
// most `group` rows; the others stay queued, in order, and are computed while this group is
// downstream. Of a PREFILL step split into pieces only one piece goes per batch, so that the next
// piece is computed while this one is downstream.
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"
#include "worker/frame_ticket.h"

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <variant>
#include <vector>

namespace dgr::worker {

namespace pb = ::dgr::shard::v1;
using Clock = std::chrono::steady_clock;

// Where a queued step comes from. Each kind carries what only it has, so no field of a step
// means one thing for one kind and another for the next:
//   ClientStep     a client frame's step; its ticket goes back when the step is answered or
//                  leaves this Shard (frame_ticket.h). The last piece of a split PREFILL step is
//                  one too (last_piece): it carries the frame.
//   GeneratedStep  fed back by server-side generation: no client frame behind it
//   EarlyPiece     a piece of a split PREFILL step (pipeline.h prefill_piece_rows) that more
//                  pieces follow: no client frame behind it
struct ClientStep {
    FrameTicket ticket;
    bool last_piece = false;
    // StepFrame.batch of a forwarded DECODE row: the upstream batch it was computed in and how
    // many rows that batch forwarded here (rows <= 1: no hint)
    uint64_t up_batch = 0;
    uint32_t up_rows = 0;
};
struct GeneratedStep {};
struct EarlyPiece {};
using StepOrigin = std::variant<ClientStep, GeneratedStep, EarlyPiece>;

// One queued step of a session: its rows and where they go (common to every kind), and where it
// comes from.
struct Work {
    std::string session_id;
    uint64_t generation = 0;
    bool decode = false;
    std::vector<int32_t> tokens;  // head: the step's token ids
    std::vector<float> rows;      // not the head: its boundary rows, n * n_embd floats
    uint32_t pos0 = 0;
    uint32_t n = 0;
    bool sample = false;
    pb::ResponseHeader header;
    Clock::time_point t0;
    Clock::time_point t_ready;
    StepOrigin origin;

    const ClientStep * client() const { return std::get_if<ClientStep>(&origin); }
    // no client frame behind it (server-side generation, an early piece): its answer does not
    // let the stream read a next frame
    bool internal() const { return client() == nullptr; }
    // a piece of a split PREFILL step (an early one, or the last)
    bool piece() const { return std::holds_alternative<EarlyPiece>(origin) || (client() && client()->last_piece); }
    // more pieces of its step follow it
    bool more_pieces() const { return std::holds_alternative<EarlyPiece>(origin); }
    // the frame behind it is answered or left this Shard: its ticket goes back (none: nothing)
    void release_ticket() {
        if (auto * c = std::get_if<ClientStep>(&origin)) c->ticket.release();
    }
};

using WorkPtr = std::unique_ptr<Work>;

class WorkQueue {
public:
    // The pipeline block of a queued DECODE row's session, or -1 when the row is not chained
    // (pipeline.h pipeline_block); asked only while a group cap is in force.
    using BlockOf = std::function<int64_t(const Work &)>;

    struct Batch {
        std::vector<WorkPtr> items;  // in queue order: DECODE rows, then PREFILL steps
        uint32_t rows = 0;
        uint32_t held_rows = 0;      // chained DECODE rows left queued for a later group
        uint32_t prefill_steps = 0;  // PREFILL steps (or pieces) taken
    };

    void push_decode(WorkPtr w) { decode_.push_back(std::move(w)); }
    void push_prefill(WorkPtr w) { prefill_.push_back(std::move(w)); }
    // Queues a PREFILL step as pieces of at most `piece` rows (n_embd floats per row when it
    // carries boundary rows); the last piece carries the step's frame, sampling and ticket.
    // Returns the number of entries queued.
    uint32_t push_prefill_pieces(WorkPtr w, uint32_t piece, uint32_t n_embd);

    bool empty() const { return decode_.empty() && prefill_.empty(); }
    bool has_decode() const { return !decode_.empty(); }
    bool has_prefill() const { return !prefill_.empty(); }
    const std::deque<WorkPtr> & decode_rows() const { return decode_; }

    // Takes one batch of at most `max_rows` rows (`prefill_chunk`: the room DECODE leaves
    // while PREFILL waits; `group` > 0: the chained DECODE rows' cap, see above).
    Batch take(uint32_t max_rows, uint32_t prefill_chunk, uint32_t group, const BlockOf & block_of);
    // Chained DECODE rows queued in the block of the oldest one (what take() would send as a
    // group); *block is that block, -1 when none is queued.
    uint32_t first_block_rows(const BlockOf & block_of, int64_t * block) const;

    // Drops every step of a session (their frames' tickets go back); returns how many.
    size_t purge(const std::string & session_id);
    // `w`, a piece with more to follow, failed: the session's later pieces leave the queue, and
    // the client frame behind the last one moves to `w` (which then answers it).
    void absorb_pieces(Work & w);
    // The session's next queued piece may be computed from `t` on (its queue wait starts).
    void piece_ready(const std::string & session_id, Clock::time_point t);
    // A step of the session with a client frame behind it is queued.
    bool has_client_step(const std::string & session_id) const;
    // Rows that a pipelining Shard forwarded together (StepFrame.batch) are only partly here.
    bool upstream_batch_incomplete() const;

private:
    std::deque<WorkPtr> decode_;
    std::deque<WorkPtr> prefill_;
    bool last_had_prefill_ = false;  // the last batch taken carried PREFILL rows (decode's turn next)
};

}  // namespace dgr::worker
