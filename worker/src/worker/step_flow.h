// Steps after admission, on the scheduler thread: a batch taken by the queue's policy and
// computed by the batch runner completes here -- KV committed, the answer forwarded down a
// chained route (chain_forwarder.h writes the frame) or given to the client -- the route's
// answers and a link's end come back here, and server-side generation's next row is queued
// (generation.h decides it). Step completion is one function (complete_step), for steps
// computed here and steps answered downstream. worker/tests/step_flow_test.cpp drives it on the
// fake model without the scheduler's thread.
#pragma once

#include "worker/scheduler_state.h"

namespace dgr::worker {

class StepFlow {
public:
    explicit StepFlow(SchedulerState & st) : st_(st) {}

    // one batch by the queue's policy, computed and completed (nothing queued: nothing)
    void run_batch();
    // the downstream Shard answered a forwarded step, or the session's link ended
    void on(DownReplyEvent & ev);
    void on(DownEndEvent & ev);

private:
    void fail_batch(std::vector<BatchRunner::Step> & steps, BackendStatus st, const std::string & err);
    // sends a completed step's boundary rows to the session's downstream Shard
    // hint_rows > 1: a pipelined DECODE row, one of hint_rows forwarded to the same next Shard
    // from this batch (StepFrame.batch, id fwd_batch_seq)
    void forward(Session & s, Work & w, pb::SessionResponse & r, uint32_t hint_rows = 0);
    // the one place a step completes, computed here or answered by the downstream Shard: `r`
    // becomes the stored answer (replays), goes out (or is held, tokens_per_answer), and
    // server-side generation queues its next row after `sampled` (-1: no token: it stops)
    void complete_step(Session & s, pb::SessionResponse r, const pb::ResponseHeader & hdr, Clock::time_point t0,
                       bool internal, int32_t sampled, bool finished);
    // after answering `token`, queue the next DECODE row (or stop)
    void continue_generation(Session & s, const pb::ResponseHeader & last, int32_t token, bool finished);

    SchedulerState & st_;
};

}  // namespace dgr::worker
