// When the next batch runs, and how many chained rows it takes (docs/worker.md, Continuous
// batching and Pipelined routes). A unit of its own: it reads the open sessions (session
// table) and the queued steps (work queue), and says whether the gather waits for more rows and
// until when; it never waits itself and changes nothing but the decode-time estimate and a
// session's arrival gap, so worker/tests/pacer_test.cpp checks it without a model or a clock
// of its own. The policy itself (groups, blocks, the arrival prediction) is pipeline.h's.
//
// Gather: sessions that just got a decode answer usually send their next step within a client
// round trip; waiting a little (<= 25% of the last decode call, <= 5 ms) for them turns
// staggered arrivals into one batch instead of several small ones. A session is waited for
// only when its next row is predicted to arrive before the deadline (its usual answer-to-next-row
// gap, pipeline.h): on a pipelined route the other group's rows come a whole stage compute
// later, and waiting for them would idle this Shard. Only sessions of a pipelined route are
// judged so (paced_by_pipeline): a route driver stepping each Shard in turn answers every
// session a stage later too, and there the short wait is what gathers its sessions into one
// batch (measured: 4 sessions over SmolLM2 0:15|15:30 on 2 cores, 1.98 rows per batch with the
// wait, 1.41 and 45% fewer tokens/s without). A pipelined head stops gathering once a group's
// worth of chained rows is queued.
// Chained sessions generating over a route on this same host are waited for longer (up to 3
// decode calls, <= 250 ms): their next row comes back after the other shards have computed, and
// if this shard ran the ones already back in the meantime, two groups of sessions would
// alternate between the shards and both processes would compute at the same time on shared
// cores (measured: SmolLM2 0:15|15:30, 4 sessions, 2 cores, 2 rows per batch and ~3x slower).
// Routes across hosts form pipeline groups instead: there the shards computing different groups
// at once is the pipeline working. A group's members that are downstream and due within one
// decode call join it, so that a group split by uneven prompts merges once and then travels
// together.
#pragma once

#include "worker/session_table.h"
#include "worker/work_queue.h"

#include <optional>

namespace dgr::worker {

class Pacer {
public:
    // `pipeline_groups`: --pipeline-groups (pipeline.h)
    Pacer(const SessionTable & table, uint32_t pipeline_groups) : table_(table), groups_option_(pipeline_groups) {}

    // rows of `s` come in pipeline groups: opened by a pipelining Shard (StepFrame.pipelined),
    // or chained downstream by this one with more than one group
    bool paced_by_pipeline(const Session & s) const;
    // the cap on chained DECODE rows per batch (0: none)
    uint32_t group_rows() const;
    // the pipeline block of a queued DECODE row's chained session under `group` (-1: not chained)
    WorkQueue::BlockOf block_of(uint32_t group) const;
    // the groups a chained session's PREFILL is split for (1: no split)
    uint32_t prefill_groups(const Session & s) const;

    // A gather that starts at `t` (a DECODE row is queued and no PREFILL step).
    struct Gather {
        Clock::time_point start, short_deadline, long_deadline, fill_deadline;
        uint32_t group = 0;
    };
    Gather gather_from(Clock::time_point t) const;
    // Whether to wait for more rows before the batch, and until when (nullopt: run it now).
    std::optional<Clock::time_point> wait_until(const Gather & g, const WorkQueue & queue, Clock::time_point now) const;
    // a gather is worth starting at all: DECODE rows queued, no PREFILL, a decode time known
    bool gathers(const WorkQueue & queue) const {
        return queue.has_decode() && !queue.has_prefill() && last_decode_s_ > 0.0;
    }

    // a batch's decode call took `seconds` (decode-only batches set the estimate)
    void observe_batch(double seconds, bool decode_only);
    double last_decode_s() const { return last_decode_s_; }
    // a DECODE row of `s` is queued: learn its answer-to-next-row gap
    static void note_decode_arrival(Session & s, Clock::time_point now);

    // sessions whose next DECODE row is likely to arrive soon: plain ones (a client round trip
    // away) and chained generating ones whose route runs on this host (a downstream compute away)
    struct Expected { uint32_t plain = 0, colocated_chain = 0; };
    // sessions paced by a pipeline count only when predicted to send by `deadline`
    // (pipeline.h worth_waiting); others count while they decode
    Expected expected_decoders(Clock::time_point deadline) const;
    // generating chained sessions of `block` downstream now, next row predicted by `deadline`
    uint32_t block_due_by(int64_t block, uint32_t group, Clock::time_point deadline) const;

private:
    const SessionTable & table_;
    const uint32_t groups_option_;
    double last_decode_s_ = 0.0;  // EWMA of decode-only batch calls
};

}  // namespace dgr::worker
