// The admission of one SessionRequest frame on the scheduler thread: the intake's checks
// (frame_intake.h, in the order the reasons are given there) and what they decide -- a refusal
// answered, a replay, a RELEASE/TRUNCATE done, or a step admitted (a session slot and KV cells,
// evicting idle sessions when it must), its session opened or continued, and the step queued.
// worker/tests/frame_admission_test.cpp drives it on the fake model without the scheduler's
// thread.
#pragma once

#include "worker/scheduler_state.h"

namespace dgr::worker {

class FrameAdmission {
public:
    explicit FrameAdmission(SchedulerState & st) : st_(st) {}

    void on(FrameEvent & ev);

private:
    void refuse_frame(FrameEvent & ev, const pb::ResponseHeader & hdr, const Refusal & r);
    // opens the frame's session (a newer epoch supersedes `old`, whose other stream ends)
    Session & open_session(FrameEvent & ev, const Intake & in, Session * old);
    // the session's downstream link broke: the frame gets that error and the session ends
    void end_broken_chain(FrameEvent & ev, const Intake & in, Session & s);
    // PREFILL/DECODE input: token ids (head) or the boundary rows (assembled over frames);
    // false: answered (or a partial step waits for its next fragment).
    bool take_input(FrameEvent & ev, Intake & in, Session * s, bool opening, Work & w);
    void phase_without_input(FrameEvent & ev, Intake & in, Session & s);

    SchedulerState & st_;
};

}  // namespace dgr::worker
