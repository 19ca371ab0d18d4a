// Fuzzing the worker's frame intake with state: scripts of mutated frames on several streams
// go through the real Scheduler (sessions, epochs, steps, replay, partial bundles, admission,
// batching, generation) over the fake model, exactly as the gRPC reactor posts them. A
// libFuzzer-style entry point run by the deterministic driver in fuzz_driver.h (seeded; 20k
// scripts by default; DGR_FUZZ_INPUTS or --inputs to change).
//
// An input is a script: a sequence of (stream 0..3, SessionRequest bytes) records, each a
// stream byte, a little-endian u16 length and the frame. Three workers serve them (the first
// stream byte's top bits choose): the whole model, the tail range 4:8 (boundary bundles in)
// and the head range 0:4 (boundary bundles out), one Scheduler each for the whole run, so sessions, tombstones and KV use carry over from script to script like a
// long-lived worker's. Frames that could leave the process (downstream hops) are dropped and
// generation is capped at 8 tokens so the run stays bounded.
//
// Checked beside "no crash, no sanitizer finding": every frame is answered the way the stream
// reactor waits for (a response that lets it read on, a resume, or the end of the stream)
// within DGR_FUZZ_ANSWER_S seconds (default 10), else the run stops as a hang; an error
// response carries a known reason; a stream that ended gets a new one (as a client would
// reconnect). Seeds are valid scripts built here: open + decode + truncate + release, a second
// stream naming a live session, a replayed step, a bundle in two frames.
#include "worker/fake_backend.h"
#include "worker/metrics.h"
#include "worker/scheduler.h"

#include "common/bundle.h"

#include <google/protobuf/stubs/logging.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pb = dgr::shard::v1;
namespace B = dgr::bundle;
using namespace dgr::worker;

#include "fuzz_driver.h"

namespace {

bool g_decoded = false;
double g_answer_s = 10.0;
std::mutex g_seen_mu;
std::map<std::string, uint64_t> g_seen;  // responses by kind / error reason (printed at exit)
uint64_t g_frames = 0;
uint64_t g_script = 0;

void count_protobuf_log(google::protobuf::LogLevel, const char *, int, const std::string &) {}

class Sink final : public StreamSink {
public:
    void deliver(pb::SessionResponse resp, bool terminal, grpc::Status, bool read_next) override {
        std::lock_guard<std::mutex> lk(mu_);
        if (resp.has_error() && (resp.error().reason() == pb::ERROR_REASON_UNSPECIFIED ||
                                 !pb::ErrorReason_IsValid(resp.error().reason()))) {
            std::fprintf(stderr, "session_fuzz: an error response without a known reason: %s\n",
                         resp.error().ShortDebugString().c_str());
            std::abort();
        }
        ++responses_;
        {
            std::lock_guard<std::mutex> g(g_seen_mu);
            g_seen[resp.has_error() ? pb::ErrorReason_Name(resp.error().reason())
                                    : resp.has_tail() ? "tail output" : resp.has_boundary() ? "boundary" : "other"]++;
        }
        if (read_next) ++go_on_;
        if (terminal) ended_ = true;
        cv_.notify_all();
    }
    void resume() override {
        std::lock_guard<std::mutex> lk(mu_);
        ++go_on_;
        cv_.notify_all();
    }
    void finish(grpc::Status) override {
        std::lock_guard<std::mutex> lk(mu_);
        ended_ = true;
        cv_.notify_all();
    }
    // Wait until the reactor may read the next frame (or the stream ended); false on timeout.
    bool wait_go_on(uint64_t want) {
        std::unique_lock<std::mutex> lk(mu_);
        return cv_.wait_for(lk, std::chrono::duration<double>(g_answer_s), [&] { return go_on_ >= want || ended_; });
    }
    uint64_t go_on() {
        std::lock_guard<std::mutex> lk(mu_);
        return go_on_;
    }
    bool ended() {
        std::lock_guard<std::mutex> lk(mu_);
        return ended_;
    }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t responses_ = 0, go_on_ = 0;
    bool ended_ = false;
};

FakeModelOptions model(uint32_t start, uint32_t end) {
    FakeModelOptions o;
    o.layer_start = start;
    o.layer_end = end;
    o.kv_cells = 512;
    o.n_seq_max = 4;
    return o;
}

SchedulerOptions options() {
    SchedulerOptions o;
    o.max_sessions = 4;
    o.kv_cells = 512;
    o.max_session_positions = 96;
    o.max_prefill_chunk_tokens = 16;
    o.max_batch_tokens = 64;
    o.queue_limit = 8;
    o.evict_idle_s = 0;  // under pressure, any idle session may go (scripts come quickly)
    return o;
}

struct Worker {
    Worker(uint32_t start, uint32_t end) : backend(model(start, end)), sched(backend, metrics, options()) {
        sched.start();
    }
    ~Worker() { sched.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "fuzz over")); }
    FakeBackend backend;
    Metrics metrics;
    Scheduler sched;
};

// 0: the whole model (head and tail), 1: the tail range 4:8, 2: the head range 0:4
Worker & worker(int which) {
    static Worker whole(0, 8), tail(4, 8), head(0, 4);
    return which == 1 ? tail : which == 2 ? head : whole;
}

struct Record {
    uint8_t stream;
    std::string frame;
};

// script bytes <-> records: [stream u8][len u16 LE][frame]...
std::vector<Record> parse_script(const uint8_t * data, size_t size) {
    std::vector<Record> out;
    size_t i = 0;
    while (i + 3 <= size && out.size() < 64) {
        const uint8_t stream = data[i];
        const size_t n = size_t(data[i + 1]) | size_t(data[i + 2]) << 8;
        i += 3;
        if (n > size - i) break;
        out.push_back({stream, std::string(reinterpret_cast<const char *>(data + i), n)});
        i += n;
    }
    return out;
}

std::string script(const std::vector<Record> & rs) {
    std::string s;
    for (const Record & r : rs) {
        s += char(r.stream);
        s += char(uint8_t(r.frame.size()));
        s += char(uint8_t(r.frame.size() >> 8));
        s += r.frame;
    }
    return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    g_decoded = false;
    ++g_script;
    const std::vector<Record> records = parse_script(data, size);
    if (records.empty()) return 0;
    // the top bits of the first record's stream byte choose the worker
    Worker & w = worker((records[0].stream >> 6) % 3);
    std::shared_ptr<Sink> sinks[4];
    for (const Record & r : records) {
        auto req = std::make_unique<pb::SessionRequest>();
        if (!req->ParseFromString(r.frame)) continue;  // the gRPC layer refuses it before the scheduler
        g_decoded = true;
        ++g_frames;
        // session ids are per script (ids of earlier scripts are tombstones or stale by now)
        const std::string suffix = "." + std::to_string(g_script);
        if (req->has_step()) {
            auto * h = req->mutable_step()->mutable_header();
            if (!h->session_id().empty()) h->set_session_id(h->session_id() + suffix);
        } else if (req->has_fast_decode() && !req->fast_decode().session_id().empty()) {
            req->mutable_fast_decode()->set_session_id(req->fast_decode().session_id() + suffix);
        }
        if (req->has_step()) {
            req->mutable_step()->clear_downstream();  // never leave the process
            if (req->step().generate().max_tokens() > 8) req->mutable_step()->mutable_generate()->set_max_tokens(8);
        }
        std::shared_ptr<Sink> & sink = sinks[r.stream & 3];
        if (!sink || sink->ended()) sink = std::make_shared<Sink>();  // a new stream, as a client reconnects
        const uint64_t want = sink->go_on() + 1;
        if (!w.sched.post_frame(sink, std::move(req), Clock::now())) {
            std::fprintf(stderr, "session_fuzz: the scheduler stopped taking frames\n");
            std::abort();
        }
        if (!sink->wait_go_on(want)) {
            std::fprintf(stderr, "session_fuzz: HANG: a frame got no answer, resume or end in %.0f s\n", g_answer_s);
            std::abort();
        }
    }
    // end every stream as its client would (half-close), so the next script starts clean
    for (auto & s : sinks) {
        if (s) w.sched.post_stream_closed(s, false);
    }
    return 0;
}

// ---- driver hooks -----------------------------------------------------------------------------

namespace dgr_fuzz {

const char * name() { return "session"; }
uint64_t default_inputs() { return 20000; }
bool decoded() { return g_decoded; }

std::vector<std::string> seeds() {
    google::protobuf::SetLogHandler(count_protobuf_log);
    std::atexit([] {
        std::lock_guard<std::mutex> g(g_seen_mu);
        std::printf("session_fuzz: %llu frames posted; responses:", (unsigned long long) g_frames);
        for (const auto & [k, n] : g_seen) std::printf(" [%s: %llu]", k.c_str(), (unsigned long long) n);
        std::printf("\n");
    });
    if (const char * e = std::getenv("DGR_FUZZ_ANSWER_S")) g_answer_s = std::strtod(e, nullptr);
    std::vector<std::string> out;
    for (int which = 0; which < 3; ++which) {
        Worker & w = worker(which);
        const BackendInfo & info = w.backend.info();
        const uint8_t sel = uint8_t(which << 6);
        auto step = [&](const std::string & sid, uint64_t epoch, uint64_t step_no, pb::Phase phase, uint32_t p0,
                        uint32_t p1) {
            pb::SessionRequest r;
            pb::FrameHeader * h = r.mutable_step()->mutable_header();
            h->set_schema_version(pb::SCHEMA_VERSION_V1);
            h->set_session_id(sid);
            h->set_route_epoch(epoch);
            h->set_step(step_no);
            h->set_phase(phase);
            h->set_compatibility_fingerprint(info.fingerprint);
            h->mutable_shard_range()->set_start(info.layer_start);
            h->mutable_shard_range()->set_end(info.layer_end);
            h->mutable_positions()->set_start(p0);
            h->mutable_positions()->set_end(p1);
            h->set_compression(pb::COMPRESSION_NONE);
            h->mutable_cache_expectation()->set_kind(step_no == 0 ? pb::CACHE_EXPECTATION_KIND_EMPTY
                                                                  : pb::CACHE_EXPECTATION_KIND_POSITION);
            h->mutable_cache_expectation()->set_position(p0);
            if (phase == pb::PHASE_PREFILL || phase == pb::PHASE_DECODE) {
                if (info.head) {
                    for (uint32_t p = p0; p < p1; ++p) r.mutable_step()->mutable_tokens()->add_token_ids(int32_t(3 + p % 200));
                    *h->mutable_payload_checksum() = B::crc_checksum(B::tokens_payload_crc(r.step().tokens()));
                } else {
                    std::vector<float> rows(size_t(p1 - p0) * info.n_embd, 0.125f);
                    *r.mutable_step()->mutable_bundle() = B::boundary_bundle(rows.data(), p1 - p0, info.n_embd, 24);
                    *h->mutable_payload_checksum() = B::crc_checksum(B::bundle_payload_crc(r.step().bundle()));
                }
            }
            if (info.tail && phase != pb::PHASE_TRUNCATE && phase != pb::PHASE_RELEASE) r.mutable_step()->set_sample(true);
            return r;
        };
        auto bytes = [](const pb::SessionRequest & r) {
            std::string s;
            r.SerializeToString(&s);
            return s;
        };
        auto fast = [&](const std::string & sid, uint64_t epoch, uint64_t step_no, uint32_t pos) {
            pb::SessionRequest r;
            pb::FastDecodeFrame * f = r.mutable_fast_decode();
            f->set_session_id(sid);
            f->set_route_epoch(epoch);
            f->set_step(step_no);
            f->set_position(pos);
            if (info.head) {
                f->set_token_id(42);
            } else {
                std::vector<float> row(info.n_embd, 0.5f);
                *f->mutable_bundle() = B::boundary_bundle(row.data(), 1, info.n_embd);
            }
            return bytes(r);
        };
        // open, decode (full and fast), truncate, release
        out.push_back(script({{uint8_t(sel | 0), bytes(step("s-a", 1, 0, pb::PHASE_PREFILL, 0, 5))},
                              {0, bytes(step("s-a", 1, 1, pb::PHASE_DECODE, 5, 6))},
                              {0, fast("s-a", 1, 2, 6)},
                              {0, bytes(step("s-a", 1, 3, pb::PHASE_TRUNCATE, 3, 3))},
                              {0, bytes(step("s-a", 1, 4, pb::PHASE_RELEASE, 3, 3))}}));
        // a second stream naming the live session, a replayed step, a stale epoch
        out.push_back(script({{uint8_t(sel | 0), bytes(step("s-b", 2, 0, pb::PHASE_PREFILL, 0, 4))},
                              {1, bytes(step("s-b", 2, 1, pb::PHASE_DECODE, 4, 5))},
                              {0, bytes(step("s-b", 2, 0, pb::PHASE_PREFILL, 0, 4))},
                              {0, bytes(step("s-b", 1, 1, pb::PHASE_DECODE, 4, 5))},
                              {2, bytes(step("s-c", 1, 0, pb::PHASE_PREFILL, 0, 16))}}));
        // generation on the whole model; a chunked prefill
        pb::SessionRequest g = step("s-g", 1, 0, pb::PHASE_PREFILL, 0, 3);
        g.mutable_step()->mutable_generate()->set_max_tokens(4);
        g.mutable_step()->set_sample(true);
        out.push_back(script({{uint8_t(sel | 0), bytes(g)},
                              {1, bytes(step("s-h", 1, 0, pb::PHASE_PREFILL, 0, 16))},
                              {1, bytes(step("s-h", 1, 1, pb::PHASE_PREFILL, 16, 30))}}));
        if (!info.head) {
            // one step's bundle in two frames (fragments split)
            pb::SessionRequest a = step("s-f", 1, 0, pb::PHASE_PREFILL, 0, 2);
            pb::SessionRequest b = a;
            auto * ta = a.mutable_step()->mutable_bundle()->mutable_tensors(0);
            auto * tb = b.mutable_step()->mutable_bundle()->mutable_tensors(0);
            const int n = ta->fragments_size();
            ta->mutable_fragments()->DeleteSubrange(n / 2, n - n / 2);
            tb->mutable_fragments()->DeleteSubrange(0, n / 2);
            out.push_back(script({{uint8_t(sel | 0), bytes(step("s-e", 1, 0, pb::PHASE_PREFILL, 0, 1))},
                                  {1, bytes(a)},
                                  {1, bytes(b)},
                                  {1, bytes(step("s-f", 1, 1, pb::PHASE_DECODE, 2, 3))}}));
        }
    }
    return out;
}

bool mutate_structured(std::string & input, Rng & rng) {
    std::vector<Record> rs = parse_script(reinterpret_cast<const uint8_t *>(input.data()), input.size());
    if (rs.empty()) return false;
    Record & r = rs[below(rng, rs.size())];
    switch (below(rng, 6)) {
        case 0: r.stream = uint8_t((r.stream & 0xC0) | below(rng, 4)); break;  // another stream
        case 1: rs.push_back(rs[below(rng, rs.size())]); break;                 // a frame again (replay)
        case 2: if (rs.size() > 1) rs.erase(rs.begin() + long(below(rng, rs.size()))); break;
        case 3: std::swap(rs[below(rng, rs.size())], rs[below(rng, rs.size())]); break;
        default: {  // mutate one frame's fields: header numbers, the session id, the phase
            pb::SessionRequest req;
            if (!req.ParseFromString(r.frame) || !req.has_step()) return false;
            pb::FrameHeader * h = req.mutable_step()->mutable_header();
            switch (below(rng, 7)) {
                case 0: h->set_step(below(rng, 2) ? h->step() + 1 : interesting_u64(rng)); break;
                case 1: h->set_route_epoch(below(rng, 2) ? h->route_epoch() + 1 : interesting_u64(rng)); break;
                case 2: h->mutable_positions()->set_start(uint32_t(below(rng, 40))); break;
                case 3: h->mutable_positions()->set_end(uint32_t(below(rng, 100))); break;
                case 4: h->set_session_id(below(rng, 2) ? "s-a" : "s-" + std::to_string(below(rng, 9))); break;
                case 5: h->set_phase(pb::Phase(below(rng, 6))); break;
                default:
                    h->mutable_cache_expectation()->set_kind(pb::CacheExpectationKind(below(rng, 4)));
                    h->mutable_cache_expectation()->set_position(uint32_t(below(rng, 40)));
                    break;
            }
            r.frame.clear();
            req.SerializeToString(&r.frame);
        }
    }
    input = script(rs);
    return true;
}

}  // namespace dgr_fuzz
