// The intake of one SessionRequest frame: its fields, and every check that decides whether it
// is taken, in the order the reasons are given. A unit of its own and pure: it reads the frame,
// the capability and a session (or its tombstone) and says what to do; it changes nothing, so
// worker/tests/frame_intake_test.cpp checks every refusal without a model, a stream or a
// scheduler. The frame admission (frame_admission.h) applies what it says.
//
// The order of the checks, and so the reason a frame with several faults gets:
//   header (kind, schema, fingerprint, range, compression, phase, session id, epoch) ->
//   stream binding -> ownership -> session state (epoch, tombstone, replay, step order, cache
//   expectation) -> positions held -> rows (position range, DECODE one row, chunk limit) ->
//   TRUNCATE/RELEASE -> positions budget -> input (sampling, role, token count, vocabulary,
//   payload checksum) -> bundle assembly -> downstream hops, generate -> admission (sessions,
//   KV cells).
#pragma once

#include "common/bundle.h"
#include "worker/sampling.h"
#include "worker/session_table.h"

#include <cstdint>
#include <optional>
#include <string>
#include <variant>

namespace dgr::worker {

// The fields of one frame (StepFrame or FastDecodeFrame) and the header its answer gets.
struct Intake {
    const pb::SessionRequest & req;  // the frame: it must outlive its Intake
    const bool fast;
    const pb::StepFrame * sf;  // null for a FastDecodeFrame (and a frame of neither kind)
    std::string sid;
    uint64_t epoch = 0, step = 0;
    pb::Phase phase = pb::PHASE_UNSPECIFIED;
    uint32_t p0 = 0, p1 = 0;
    pb::CacheExpectationKind expect = pb::CACHE_EXPECTATION_KIND_UNSPECIFIED;
    uint32_t expect_pos = 0;
    pb::ResponseHeader hdr;
    std::string digest;  // frame_digest(), set before the session-state check

    explicit Intake(const pb::SessionRequest & r);
    bool rows_phase() const { return phase == pb::PHASE_PREFILL || phase == pb::PHASE_DECODE; }
    uint32_t rows() const { return p1 - p0; }
};

// A frame refused: the error it is answered with, and the metric the refusal counts in.
struct Refusal {
    enum class Counted { none, not_owned, kv };
    pb::ShardError error;
    pb::CacheResult cache = pb::CACHE_RESULT_UNSPECIFIED;
    Counted counted = Counted::none;
};
using Check = std::optional<Refusal>;  // nullopt: the check passed

// What the session state makes of a frame (FrameIntake::session_state).
struct OpenSession {};        // the frame opens the session, or a newer epoch of it
struct ContinueSession {};    // the session's next step
struct ReplayStep {};         // the owner resent its last step unchanged: the stored answer again
struct EndBrokenChain {};     // the session's downstream link broke: the frame gets that error, the session ends
using SessionVerdict = std::variant<Refusal, OpenSession, ContinueSession, ReplayStep, EndBrokenChain>;

// SHA-256 of the frame as received, without its request_id (a work id, not content): two
// frames with the same digest ask for the same step with the same input.
std::string frame_digest(pb::SessionRequest & req);
// The sampling contract of a frame as the sampler takes it.
SamplingConfig sampling_config(const pb::SamplingParams & p);

class FrameIntake {
public:
    // `cap`: what this worker serves (the frame checks' limits and identity); it must outlive
    // the intake.
    FrameIntake(const pb::GetCapabilityResponse & cap, uint32_t max_session_positions)
        : cap_(cap), max_positions_(max_session_positions) {}

    // kind, schema, fingerprint, range, compression, phase, session id, epoch
    Check header(const Intake & in) const;
    // one stream serves one session id (`bound`: the stream's, empty before its first frame)
    Check binding(const Intake & in, const std::string & bound) const;
    // A live session answers only the stream that opened it. Another stream may supersede it
    // with a newer epoch only when the owner's stream is gone, or when both carry the same
    // authenticated client identity (mTLS).
    Check ownership(const Intake & in, const Session * s, const StreamSink & sink) const;
    // epoch, tombstone, replay, step order, cache expectation, draining (`s`: the live session
    // of the frame's id, `t`: its tombstone when none is live)
    SessionVerdict session_state(const Intake & in, const Session * s, const Tombstone * t, bool draining) const;
    // positions.start against the `held` positions, the rows' own checks, and RELEASE/TRUNCATE
    // in a new epoch
    Check positions(const Intake & in, uint32_t held, bool opening) const;
    // a TRUNCATE beyond the positions held, or on a chained session
    Check truncate(const Intake & in, uint32_t held, bool chained) const;
    // the session's positions after this step within max_session_positions
    Check budget(const Intake & in, uint32_t held) const;
    // sampling, role, token count, vocabulary, payload checksum (`sampling_applies`: the frame's
    // sampling contract is checked: on the tail, and on a Shard that passes it downstream)
    Check input(const Intake & in, bool sampling_applies) const;
    // StepFrame.generate: on a head, with sample = true, and with the route's tail reachable
    // (this worker is the tail, or the session is chained)
    Check generate(const Intake & in, bool chained) const;

private:
    const pb::GetCapabilityResponse & cap_;
    const uint32_t max_positions_;
};

}  // namespace dgr::worker
