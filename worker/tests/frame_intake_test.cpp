// The frame intake on its own (worker/frame_intake.h): every refusal and verdict from a frame,
// the capability and a hand-made session or tombstone. No model, no scheduler, no stream
// traffic: the intake is pure, so each check is asked directly and must change nothing.
#include "worker/frame_intake.h"
#include "worker/scheduler.h"  // capability_of

#include <memory>
#include <string>
#include <vector>

#include "check.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

class NullSink final : public StreamSink {
public:
    void deliver(pb::SessionResponse, bool, grpc::Status, bool) override { delivered++; }
    void resume() override {}
    void finish(grpc::Status) override {}
    int delivered = 0;
};

BackendInfo info(bool head = true, bool tail = true) {
    BackendInfo in;
    in.architecture = "fake";
    in.artifact_id = "fake-artifact";
    in.fingerprint = "fingerprint-0123";
    in.n_layer = 8;
    in.layer_start = head ? 0 : 4;
    in.layer_end = tail ? 8 : 4;
    in.head = head;
    in.tail = tail;
    in.n_embd = 4;
    in.n_vocab = 32;
    in.kv_cells = 256;
    in.max_batch_tokens = 64;
    in.n_seq_max = 4;
    return in;
}

SchedulerOptions options() {
    SchedulerOptions o;
    o.max_sessions = 4;
    o.kv_cells = 256;
    o.max_session_positions = 16;
    o.max_prefill_chunk_tokens = 8;
    o.max_batch_tokens = 64;
    return o;
}

pb::SessionRequest frame(const BackendInfo & in, const std::string & sid, uint64_t epoch, uint64_t step,
                         pb::Phase phase, uint32_t p0, std::vector<int32_t> ids) {
    pb::SessionRequest req;
    auto * h = req.mutable_step()->mutable_header();
    h->set_schema_version(pb::SCHEMA_VERSION_V1);
    h->set_session_id(sid);
    h->set_route_epoch(epoch);
    h->set_compatibility_fingerprint(in.fingerprint);
    h->mutable_shard_range()->set_start(in.layer_start);
    h->mutable_shard_range()->set_end(in.layer_end);
    h->set_phase(phase);
    h->mutable_positions()->set_start(p0);
    h->mutable_positions()->set_end(p0 + (uint32_t) ids.size());
    h->set_step(step);
    h->mutable_cache_expectation()->set_kind(step == 0 ? pb::CACHE_EXPECTATION_KIND_EMPTY
                                                       : pb::CACHE_EXPECTATION_KIND_POSITION);
    h->mutable_cache_expectation()->set_position(p0);
    req.mutable_step()->set_sample(true);
    for (int32_t t : ids) req.mutable_step()->mutable_tokens()->add_token_ids(t);
    *h->mutable_payload_checksum() = dgr::bundle::crc_checksum(dgr::bundle::tokens_payload_crc(req.step().tokens()));
    return req;
}

std::string reason(const Check & c) { return c ? pb::ErrorReason_Name(c->error.reason()) : "ok"; }

std::string verdict(const SessionVerdict & v) {
    if (const auto * r = std::get_if<Refusal>(&v)) return pb::ErrorReason_Name(r->error.reason());
    if (std::holds_alternative<OpenSession>(v)) return "open";
    if (std::holds_alternative<ContinueSession>(v)) return "continue";
    if (std::holds_alternative<ReplayStep>(v)) return "replay";
    return "end_broken_chain";
}

// A frame and its intake (an Intake refers to its frame: the frame must outlive it).
struct Framed {
    explicit Framed(pb::SessionRequest r) : req(std::move(r)), in(req) {}
    Framed(const Framed &) = delete;
    pb::SessionRequest req;
    Intake in;
};

struct Fixture {
    BackendInfo in = info();
    pb::GetCapabilityResponse cap = capability_of(in, options());
    FrameIntake intake{cap, cap.capacity().max_session_positions()};
};

void test_header_and_binding() {
    Fixture f;
    pb::SessionRequest ok = frame(f.in, "s", 1, 0, pb::PHASE_PREFILL, 0, {1, 2, 3});
    CHECK(reason(f.intake.header(Intake(ok))) == "ok", "a good frame: %s", reason(f.intake.header(Intake(ok))).c_str());
    pb::SessionRequest wrong_fp = ok;
    wrong_fp.mutable_step()->mutable_header()->set_compatibility_fingerprint("other");
    CHECK(reason(f.intake.header(Intake(wrong_fp))) == "ERROR_REASON_FINGERPRINT_MISMATCH", "fingerprint: %s",
          reason(f.intake.header(Intake(wrong_fp))).c_str());
    pb::SessionRequest empty;  // neither a StepFrame nor a FastDecodeFrame
    const Check none = f.intake.header(Intake(empty));
    CHECK(none && none->error.reason() != pb::ERROR_REASON_UNSPECIFIED, "an empty frame passed the header check");
    CHECK(reason(f.intake.binding(Intake(ok), "")) == "ok", "an unbound stream");
    CHECK(reason(f.intake.binding(Intake(ok), "s")) == "ok", "its own session");
    CHECK(reason(f.intake.binding(Intake(ok), "t")) == "ERROR_REASON_BAD_REQUEST", "another session on the stream: %s",
          reason(f.intake.binding(Intake(ok), "t")).c_str());
}

void test_ownership() {
    Fixture f;
    SessionTable table(4, 8);
    Session & s = table.open("s", 1);
    auto owner = std::make_shared<NullSink>();
    s.sink = owner;
    NullSink other;
    const pb::SessionRequest same_epoch = frame(f.in, "s", 1, 1, pb::PHASE_DECODE, 0, {1});
    CHECK(reason(f.intake.ownership(Intake(same_epoch), &s, *owner)) == "ok", "the owner's own stream");
    const Check stolen = f.intake.ownership(Intake(same_epoch), &s, other);
    CHECK(reason(stolen) == "ERROR_REASON_SESSION_NOT_OWNED" && stolen->counted == Refusal::Counted::not_owned,
          "another stream, same epoch: %s", reason(stolen).c_str());
    const pb::SessionRequest newer = frame(f.in, "s", 2, 0, pb::PHASE_PREFILL, 0, {1});
    CHECK(reason(f.intake.ownership(Intake(newer), &s, other)) == "ERROR_REASON_SESSION_NOT_OWNED",
          "a newer epoch while the owner's stream is live");
    owner->client_gone = true;
    CHECK(reason(f.intake.ownership(Intake(newer), &s, other)) == "ok", "a newer epoch once the owner is gone");
    owner->client_gone = false;
    owner->client_identity = "CN=alice";
    other.client_identity = "CN=alice";
    CHECK(reason(f.intake.ownership(Intake(newer), &s, other)) == "ok", "a newer epoch from the same client");
    other.client_identity = "CN=mallory";
    const Check m = f.intake.ownership(Intake(newer), &s, other);
    CHECK(m && m->error.message().find("or client") != std::string::npos, "another client: %s", reason(m).c_str());
    CHECK(owner->delivered == 0 && other.delivered == 0, "the intake answered a stream itself");
}

void test_session_state_without_a_session() {
    Fixture f;
    Framed open_frame(frame(f.in, "s", 3, 0, pb::PHASE_PREFILL, 0, {1}));
    Intake & open = open_frame.in;
    CHECK(verdict(f.intake.session_state(open, nullptr, nullptr, false)) == "open", "a new session");
    CHECK(verdict(f.intake.session_state(open, nullptr, nullptr, true)) == "ERROR_REASON_UNAVAILABLE", "draining");
    const Tombstone released{3, EndKind::released}, evicted{3, EndKind::evicted}, newer{4, EndKind::released};
    CHECK(verdict(f.intake.session_state(open, nullptr, &released, false)) == "ERROR_REASON_SESSION_RELEASED",
          "a released epoch reopened");
    const SessionVerdict ev = f.intake.session_state(open, nullptr, &evicted, false);
    CHECK(verdict(ev) == "ERROR_REASON_CACHE_MISS" && std::get<Refusal>(ev).cache == pb::CACHE_RESULT_MISS,
          "an evicted epoch: %s", verdict(ev).c_str());
    const SessionVerdict st = f.intake.session_state(open, nullptr, &newer, false);
    CHECK(verdict(st) == "ERROR_REASON_STALE_EPOCH" && std::get<Refusal>(st).error.current_epoch() == 4,
          "an epoch older than the tombstone's: %s", verdict(st).c_str());
    Framed later_frame(frame(f.in, "s", 3, 2, pb::PHASE_DECODE, 5, {1}));
    Intake & later = later_frame.in;
    CHECK(verdict(f.intake.session_state(later, nullptr, nullptr, false)) == "ERROR_REASON_CACHE_MISS",
          "a later step of an unknown session");
    Framed step1_frame(frame(f.in, "s", 3, 1, pb::PHASE_PREFILL, 0, {1}));
    Intake & step1 = step1_frame.in;
    step1.expect = pb::CACHE_EXPECTATION_KIND_EMPTY;
    CHECK(verdict(f.intake.session_state(step1, nullptr, nullptr, false)) == "ERROR_REASON_STEP_OUT_OF_ORDER",
          "an epoch that opens at step 1");
    pb::SessionRequest fast;
    fast.mutable_fast_decode()->set_session_id("s");
    fast.mutable_fast_decode()->set_route_epoch(3);
    CHECK(verdict(f.intake.session_state(Intake(fast), nullptr, nullptr, false)) == "ERROR_REASON_UNKNOWN_SESSION",
          "a fast frame for no session: %s", verdict(f.intake.session_state(Intake(fast), nullptr, nullptr, false)).c_str());
}

void test_session_state_of_a_live_session() {
    Fixture f;
    SessionTable table(4, 8);
    Session & s = table.open("s", 2);
    table.reserve(s, 3);
    table.commit(s, 3, 3);
    s.last_step = 0;
    Framed next_frame(frame(f.in, "s", 2, 1, pb::PHASE_DECODE, 3, {7}));
    Intake & next = next_frame.in;
    CHECK(verdict(f.intake.session_state(next, &s, nullptr, false)) == "continue", "the next step");
    CHECK(verdict(f.intake.session_state(next, &s, nullptr, true)) == "continue", "draining keeps live sessions");
    Framed older_frame(frame(f.in, "s", 1, 1, pb::PHASE_DECODE, 3, {7}));
    Intake & older = older_frame.in;
    CHECK(verdict(f.intake.session_state(older, &s, nullptr, false)) == "ERROR_REASON_STALE_EPOCH", "an older epoch");
    Framed newer_frame(frame(f.in, "s", 3, 0, pb::PHASE_PREFILL, 0, {7}));
    Intake & newer = newer_frame.in;
    CHECK(verdict(f.intake.session_state(newer, &s, nullptr, false)) == "open", "a newer epoch opens");
    Framed newer_pos_frame(frame(f.in, "s", 3, 1, pb::PHASE_DECODE, 3, {7}));
    Intake & newer_pos = newer_pos_frame.in;
    CHECK(verdict(f.intake.session_state(newer_pos, &s, nullptr, false)) == "ERROR_REASON_CACHE_MISS",
          "a newer epoch without EMPTY");
    Framed skip_frame(frame(f.in, "s", 2, 3, pb::PHASE_DECODE, 3, {7}));
    Intake & skip = skip_frame.in;
    const SessionVerdict sk = f.intake.session_state(skip, &s, nullptr, false);
    CHECK(verdict(sk) == "ERROR_REASON_STEP_OUT_OF_ORDER" && std::get<Refusal>(sk).error.last_step() == 0,
          "a skipped step: %s", verdict(sk).c_str());
    Framed wrong_pos_frame(frame(f.in, "s", 2, 1, pb::PHASE_DECODE, 3, {7}));
    Intake & wrong_pos = wrong_pos_frame.in;
    wrong_pos.expect_pos = 9;
    const SessionVerdict wp = f.intake.session_state(wrong_pos, &s, nullptr, false);
    CHECK(verdict(wp) == "ERROR_REASON_CACHE_MISS" && std::get<Refusal>(wp).error.cached_positions() == 3,
          "another position expected: %s", verdict(wp).c_str());
    // a replay: the same digest as the stored step's frame, else refused
    Framed replay_frame(frame(f.in, "s", 2, 0, pb::PHASE_PREFILL, 0, {1, 2, 3}));
    Intake & replay = replay_frame.in;
    replay.digest = "d0";
    CHECK(verdict(f.intake.session_state(replay, &s, nullptr, false)) == "ERROR_REASON_STEP_OUT_OF_ORDER",
          "a replay with no stored answer");
    s.has_stored = true;
    s.digest_step = 0;
    s.step_digests = {"d0"};
    CHECK(verdict(f.intake.session_state(replay, &s, nullptr, false)) == "replay", "an unchanged replay");
    replay.digest = "d1";
    CHECK(verdict(f.intake.session_state(replay, &s, nullptr, false)) == "ERROR_REASON_STEP_OUT_OF_ORDER",
          "a changed replay");
    move_step(s, StepState::queued);
    CHECK(verdict(f.intake.session_state(next, &s, nullptr, false)) == "ERROR_REASON_BAD_REQUEST", "a step while busy");
    move_step(s, StepState::idle);
    s.gen.active = true;
    CHECK(verdict(f.intake.session_state(next, &s, nullptr, false)) == "ERROR_REASON_BAD_REQUEST",
          "a step while generating");
    s.gen.active = false;
    move_link(s, ChainLink::linked);
    move_link(s, ChainLink::broken);
    CHECK(verdict(f.intake.session_state(next, &s, nullptr, false)) == "end_broken_chain", "a broken link");
    CHECK(s.positions == 3 && s.last_step == 0 && table.check().empty(), "the intake changed the session");
}

void test_positions_budget_and_generate() {
    Fixture f;
    Framed gap_frame(frame(f.in, "s", 1, 1, pb::PHASE_DECODE, 5, {7}));
    Intake & gap = gap_frame.in;
    const Check g = f.intake.positions(gap, 3, false);
    CHECK(reason(g) == "ERROR_REASON_POSITION_GAP" && g->error.cached_positions() == 3 &&
              g->cache == pb::CACHE_RESULT_STALE,
          "a position gap: %s", reason(g).c_str());
    Framed at_frame(frame(f.in, "s", 1, 1, pb::PHASE_DECODE, 3, {7}));
    Intake & at = at_frame.in;
    CHECK(reason(f.intake.positions(at, 3, false)) == "ok", "at the positions held");
    Framed two_rows_frame(frame(f.in, "s", 1, 1, pb::PHASE_DECODE, 3, {7, 8}));
    Intake & two_rows = two_rows_frame.in;
    CHECK(reason(f.intake.positions(two_rows, 3, false)) != "ok", "a DECODE step of two rows passed");
    Framed long_prefill_frame(frame(f.in, "s", 1, 0, pb::PHASE_PREFILL, 0, std::vector<int32_t>(9, 1)));
    Intake & long_prefill = long_prefill_frame.in;
    CHECK(reason(f.intake.positions(long_prefill, 0, true)) != "ok", "a chunk over the limit passed");
    pb::SessionRequest rel = frame(f.in, "s", 1, 0, pb::PHASE_RELEASE, 0, {});
    CHECK(reason(f.intake.positions(Intake(rel), 0, true)) == "ERROR_REASON_BAD_REQUEST", "RELEASE opening an epoch");
    pb::SessionRequest tr = frame(f.in, "s", 1, 2, pb::PHASE_TRUNCATE, 5, {});
    CHECK(reason(f.intake.truncate(Intake(tr), 3, false)) == "ERROR_REASON_BAD_REQUEST", "TRUNCATE beyond");
    CHECK(reason(f.intake.truncate(Intake(tr), 6, false)) == "ok", "TRUNCATE within");
    CHECK(reason(f.intake.truncate(Intake(tr), 6, true)) == "ERROR_REASON_BAD_REQUEST", "TRUNCATE chained");
    CHECK(reason(f.intake.truncate(Intake(rel), 0, true)) == "ok", "RELEASE is not a TRUNCATE");
    const Check b = f.intake.budget(at, 16);
    CHECK(reason(b) == "ERROR_REASON_OVER_BUDGET" && b->error.limit() == 16 && b->counted == Refusal::Counted::kv,
          "over max_session_positions: %s", reason(b).c_str());
    CHECK(reason(f.intake.budget(at, 15)) == "ok", "the last position");
    pb::SessionRequest oov = frame(f.in, "s", 1, 0, pb::PHASE_PREFILL, 0, {40});
    CHECK(reason(f.intake.input(Intake(oov), false)) == "ERROR_REASON_TOKEN_OUT_OF_VOCAB", "token 40 of 32: %s",
          reason(f.intake.input(Intake(oov), false)).c_str());
    pb::SessionRequest gen = frame(f.in, "s", 1, 0, pb::PHASE_PREFILL, 0, {1});
    gen.mutable_step()->mutable_generate()->set_max_tokens(4);
    CHECK(reason(f.intake.generate(Intake(gen), false)) == "ok", "generate on a whole-model worker");
    gen.mutable_step()->set_sample(false);
    CHECK(reason(f.intake.generate(Intake(gen), false)) == "ERROR_REASON_BAD_REQUEST", "generate without sample");
    // a head that is not the tail generates only on a chained session
    BackendInfo head = info(true, false);
    const pb::GetCapabilityResponse hcap = capability_of(head, options());
    FrameIntake hi(hcap, 16);
    pb::SessionRequest hgen = frame(head, "s", 1, 0, pb::PHASE_PREFILL, 0, {1});
    hgen.mutable_step()->mutable_generate()->set_max_tokens(4);
    CHECK(reason(hi.generate(Intake(hgen), false)) == "ERROR_REASON_BAD_REQUEST", "generate with no tail");
    CHECK(reason(hi.generate(Intake(hgen), true)) == "ok", "generate on a chained head");
    BackendInfo mid = info(false, false);
    const pb::GetCapabilityResponse mcap = capability_of(mid, options());
    FrameIntake mi(mcap, 16);
    CHECK(reason(mi.generate(Intake(hgen), true)) == "ERROR_REASON_BAD_REQUEST", "generate on a middle Shard");
}

void test_digest_ignores_the_request_id() {
    BackendInfo in = info();
    pb::SessionRequest a = frame(in, "s", 1, 0, pb::PHASE_PREFILL, 0, {1, 2});
    pb::SessionRequest b = a;
    b.mutable_step()->mutable_header()->set_request_id("another request");
    pb::SessionRequest c = frame(in, "s", 1, 0, pb::PHASE_PREFILL, 0, {1, 3});
    const std::string da = frame_digest(a);
    CHECK(da == frame_digest(b), "the request id changed the digest");
    CHECK(da != frame_digest(c), "other tokens, same digest");
    CHECK(b.step().header().request_id() == "another request", "the digest lost the request id");
}

}  // namespace

int main() {
    test_header_and_binding();
    test_ownership();
    test_session_state_without_a_session();
    test_session_state_of_a_live_session();
    test_positions_budget_and_generate();
    test_digest_ignores_the_request_id();
    if (g_failures) {
        std::fprintf(stderr, "frame_intake_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("frame_intake_test: ok\n");
    return 0;
}
