// Fuzzing the frame decoder and the one validator/assembler (common/bundle.cpp,
// common/frame_checks.cpp): a libFuzzer-style entry point run by the deterministic driver in
// fuzz_driver.h (seeded; 150k inputs by default, DGR_FUZZ_INPUTS or --inputs to change).
//
// Seeds: every SessionRequest golden vector (tests/vectors/proto, from its index.txt) plus frames
// built here (fragmented boundary bundles, a multi-tensor bundle, decode frames, fast decodes,
// sampling). Mutations: byte-level (fuzz_driver.h) and structure-aware: a random field anywhere
// in the decoded frame (found through protobuf reflection, set or not) gets an interesting
// value, repeated fields grow or shrink, fragments are cut or swapped.
//
// Each input is decoded as a SessionRequest the way the gRPC server does (ParseFromArray) and
// run through every validator stage in the worker's order, with and without a capability (head
// and non-head Shard), then its bundle through the Assembler with the worker's limits and the
// boundary expectation, twice (a second frame of the same step), and through read_boundary.
// Properties checked beside "no crash, no hang, no sanitizer finding": every refusal carries a
// known reason that maps to a non-OK gRPC code, check_request agrees with its three stages, a
// finished bundle has exactly byte_size bytes per tensor, and a bundle that passes also passes
// its CRC when it carries one.
#include "common/bundle.h"
#include "common/checksum.h"

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/stubs/logging.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#ifndef DGR_REPO_ROOT
#define DGR_REPO_ROOT "."
#endif

namespace pb = dgr::shard::v1;
namespace B = dgr::bundle;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

#include "fuzz_driver.h"

namespace {

bool g_decoded = false;
FILE * g_verdicts = nullptr;  // DGR_FUZZ_VERDICTS: one line per input (compared with Python's checks)
uint64_t g_protobuf_logs = 0;  // protobuf's parse complaints (invalid UTF-8 ...), counted, not printed

void count_protobuf_log(google::protobuf::LogLevel level, const char *, int, const std::string & msg) {
    if (level >= google::protobuf::LOGLEVEL_FATAL) std::fprintf(stderr, "protobuf: %s\n", msg.c_str());
    ++g_protobuf_logs;
}

std::string slurp(const std::string & path, bool * ok) {
    std::ifstream in(path, std::ios::binary);
    *ok = bool(in);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// Golden vectors of one message type, from tests/vectors/proto/index.txt.
std::vector<std::string> vectors_of(const std::string & type) {
    const std::string dir = std::string(DGR_REPO_ROOT) + "/tests/vectors/proto/";
    bool ok = false;
    std::istringstream index(slurp(dir + "index.txt", &ok));
    std::vector<std::string> out;
    std::string line, cur_type;
    while (std::getline(index, line)) {
        if (line.rfind("type ", 0) == 0) cur_type = line.substr(5);
        if (line.rfind("file ", 0) == 0 && cur_type == type) {
            bool file_ok = false;
            std::string data = slurp(dir + line.substr(5), &file_ok);
            if (file_ok) out.push_back(std::move(data));
        }
    }
    return out;
}

pb::GetCapabilityResponse & capability() {
    static pb::GetCapabilityResponse cap = [] {
        pb::GetCapabilityResponse c;
        const auto v = vectors_of("dgr.shard.v1.GetCapabilityResponse");
        if (v.empty() || !c.ParseFromString(v[0])) {
            std::fprintf(stderr, "frame_fuzz: no capability_response golden vector\n");
            std::exit(2);
        }
        return c;
    }();
    return cap;
}

std::map<std::string, uint64_t> g_outcomes;  // stage: ok / refusal reason -> count (printed at exit)

void check_error(const B::Result & r, const char * stage) {
    g_outcomes[std::string(stage) + (r ? " " + r->reason_name() : std::string(" ok"))]++;
    if (!r) return;
    const int code = r->grpc_code();
    if (r->reason == pb::ERROR_REASON_UNSPECIFIED || !pb::ErrorReason_IsValid(r->reason) || code == 0 ||
        code == 2 /* UNKNOWN: a reason without a mapping */ || r->message.empty()) {
        std::fprintf(stderr, "frame_fuzz: %s refused with reason %d (gRPC %d): '%s'\n", stage, int(r->reason), code,
                     r->message.c_str());
        std::abort();
    }
    // every rendering a worker sends back
    (void) r->to_string();
    (void) r->to_message(true).ByteSizeLong();
}

void require(bool cond, const char * what) {
    if (!cond) {
        std::fprintf(stderr, "frame_fuzz: property violated: %s\n", what);
        std::abort();
    }
}

void run_bundle(const pb::TensorBundle & b, uint32_t rows, const pb::GetCapabilityResponse & cap) {
    const B::Limits limits{cap.capacity().max_message_bytes(), cap.capacity().max_fragment_bytes()};
    const uint32_t n_embd = cap.identity().n_embd();
    // 1. the worker's way: the boundary expectation, one or two frames of one step
    for (int frames = 1; frames <= 2; ++frames) {
        B::Assembler a(limits, pb::COMPRESSION_NONE);
        a.expect_only(B::kResidual, pb::TENSOR_DTYPE_F32, {rows, n_embd});
        B::Result r;
        for (int f = 0; f < frames && !r; ++f) r = a.add(b);
        check_error(r, "Assembler::add (boundary)");
        if (r) continue;
        (void) a.missing();
        if (!a.complete()) continue;
        std::vector<B::Tensor> out;
        const B::Result fin = a.finish(&out);
        check_error(fin, "Assembler::finish (boundary)");
        if (!fin) {
            require(out.size() == 1 && out[0].data.size() == size_t(rows) * n_embd * 4,
                    "a finished boundary bundle holds rows x n_embd f32");
        }
    }
    // 2. any bundle, without limits and with
    for (const B::Limits & l : {B::Limits{}, limits}) {
        std::vector<B::Tensor> out;
        const B::Result r = B::read_bundle(b, &out, l);
        check_error(r, "read_bundle");
        if (!r) {
            require(int(out.size()) == b.tensors_size(), "one tensor out per tensor in");
            for (size_t i = 0; i < out.size(); ++i) {
                require(out[i].data.size() == b.tensors(int(i)).byte_size(), "a tensor holds byte_size bytes");
                if (b.tensors(int(i)).checksum().algorithm() == pb::CHECKSUM_ALGORITHM_CRC32 &&
                    b.tensors(int(i)).byte_order() != pb::BYTE_ORDER_BIG_ENDIAN) {
                    require(dgr::crc32(out[i].data.data(), out[i].data.size()) == b.tensors(int(i)).checksum().value(),
                            "an accepted tensor matches its CRC");
                }
            }
        }
    }
    std::vector<float> residual;
    check_error(B::read_boundary(b, rows, n_embd, &residual, limits), "read_boundary");
    (void) B::bundle_payload_crc(b);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    g_decoded = false;
    pb::SessionRequest req;
    const bool parsed = req.ParseFromArray(data, int(size));
    if (g_verdicts) {  // check_request with the capability: the reason, "ok" or "undecodable"
        const B::Result v = parsed ? B::check_request(req, &capability()) : B::Result{};
        std::fprintf(g_verdicts, "%s\n", !parsed ? "undecodable" : v ? v->reason_name().c_str() : "ok");
    }
    if (!parsed) {
        // not a frame: the worker answers INVALID_ARGUMENT; still try the bytes as a bare bundle
        pb::TensorBundle b;
        if (b.ParseFromArray(data, int(size))) run_bundle(b, 1, capability());
        return 0;
    }
    g_decoded = true;
    const pb::GetCapabilityResponse & cap = capability();
    pb::GetCapabilityResponse head_cap = cap;
    head_cap.mutable_identity()->set_head(!cap.identity().head());
    for (const pb::GetCapabilityResponse * c : {static_cast<const pb::GetCapabilityResponse *>(nullptr), &cap,
                                                 static_cast<const pb::GetCapabilityResponse *>(&head_cap)}) {
        for (bool whole : {false, true}) {
            // the worker's order: header, (session state), rows, input
            B::Result h = B::check_header(req, c, whole);
            check_error(h, "check_header");
            if (h) continue;
            B::Result r = B::check_rows(req, c);
            check_error(r, "check_rows");
            if (r) continue;
            for (bool sampling : {false, true}) check_error(B::check_input(req, c, sampling), "check_input");
        }
        const B::Result all = B::check_request(req, c);
        check_error(all, "check_request");
        if (!all) {
            require(!B::check_header(req, c) && !B::check_rows(req, c) && !B::check_input(req, c),
                    "check_request passes only when its three stages do");
        }
    }
    if (req.has_step()) {
        const pb::StepFrame & s = req.step();
        const auto & pos = s.header().positions();
        const uint32_t rows = pos.end() > pos.start() ? pos.end() - pos.start() : 1;
        if (s.has_bundle()) run_bundle(s.bundle(), rows, cap);
        if (s.has_tokens()) (void) B::tokens_payload_crc(s.tokens());
        if (s.has_sampling()) check_error(B::check_sampling(s.sampling()), "check_sampling");
        check_error(B::verify_checksum(s.header().payload_checksum(), 0, "payload"), "verify_checksum");
    } else if (req.has_fast_decode() && req.fast_decode().has_bundle()) {
        run_bundle(req.fast_decode().bundle(), 1, cap);
    }
    // what the worker echoes back: re-encoding a decoded frame never fails
    std::string again;
    require(req.SerializeToString(&again), "a decoded frame re-encodes");
    return 0;
}

// ---- driver hooks -----------------------------------------------------------------------------

namespace dgr_fuzz {

const char * name() { return "frame"; }
uint64_t default_inputs() { return 150000; }
bool decoded() { return g_decoded; }

std::vector<std::string> seeds() {
    google::protobuf::SetLogHandler(count_protobuf_log);
    if (const char * v = std::getenv("DGR_FUZZ_VERDICTS")) {
        g_verdicts = std::fopen(v, "w");
        if (!g_verdicts) {
            std::perror("frame_fuzz: DGR_FUZZ_VERDICTS");
            std::exit(2);
        }
    }
    std::atexit([] {
        if (g_verdicts) std::fclose(g_verdicts);
        std::printf("frame_fuzz: outcomes per stage:");
        for (const auto & [k, n] : g_outcomes) std::printf(" [%s: %llu]", k.c_str(), (unsigned long long) n);
        std::printf("\nframe_fuzz: %llu protobuf parse complaints silenced\n", (unsigned long long) g_protobuf_logs);
    });
    std::vector<std::string> out = vectors_of("dgr.shard.v1.SessionRequest");
    const pb::GetCapabilityResponse & cap = capability();
    const uint32_t n_embd = cap.identity().n_embd();
    auto header = [&](pb::FrameHeader * h, pb::Phase phase, uint32_t p0, uint32_t p1) {
        h->set_schema_version(pb::SCHEMA_VERSION_V1);
        h->set_session_id("fuzz-session");
        h->set_request_id("req-1");
        h->set_route_epoch(1);
        h->set_compatibility_fingerprint(cap.identity().compatibility_fingerprint());
        *h->mutable_shard_range() = cap.identity().range();
        h->set_phase(phase);
        h->mutable_positions()->set_start(p0);
        h->mutable_positions()->set_end(p1);
        h->set_step(1);
        h->set_compression(pb::COMPRESSION_NONE);
    };
    auto add = [&](const pb::SessionRequest & r) {
        std::string s;
        r.SerializeToString(&s);
        out.push_back(std::move(s));
    };
    // boundary bundles: 1 and 3 rows, in big and small fragments, with the payload checksum
    for (uint32_t rows : {1u, 3u}) {
        for (size_t frag : {size_t(1) << 20, size_t(512), size_t(64)}) {
            std::vector<float> v(size_t(rows) * n_embd);
            for (size_t i = 0; i < v.size(); ++i) v[i] = float(i % 97) * 0.25f - 3.0f;
            pb::SessionRequest r;
            pb::StepFrame * s = r.mutable_step();
            header(s->mutable_header(), rows == 1 ? pb::PHASE_DECODE : pb::PHASE_PREFILL, 4, 4 + rows);
            *s->mutable_bundle() = B::boundary_bundle(v.data(), rows, n_embd, frag);
            *s->mutable_header()->mutable_payload_checksum() = B::crc_checksum(B::bundle_payload_crc(s->bundle()));
            if (rows == 1) {
                s->mutable_sampling()->set_mode(pb::SAMPLING_MODE_STOCHASTIC);
                s->mutable_sampling()->set_temperature(0.7f);
                s->mutable_sampling()->set_top_p(0.9f);
                s->set_sample(true);
            }
            add(r);
        }
    }
    // a bundle of several small tensors of different dtypes and ranks
    {
        pb::SessionRequest r;
        pb::StepFrame * s = r.mutable_step();
        header(s->mutable_header(), pb::PHASE_PREFILL, 0, 2);
        const uint8_t raw[24] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24};
        B::write_tensor(s->mutable_bundle()->add_tensors(), "a", {2, 3}, pb::TENSOR_DTYPE_F32, raw, 24, 8);
        B::write_tensor(s->mutable_bundle()->add_tensors(), "b", {2, 2, 3}, pb::TENSOR_DTYPE_F16, raw, 24, 5);
        B::write_tensor(s->mutable_bundle()->add_tensors(), "c", {6}, pb::TENSOR_DTYPE_I32, raw, 24, 24);
        B::write_tensor(s->mutable_bundle()->add_tensors(), "d", {3, 4}, pb::TENSOR_DTYPE_BF16, raw, 24, 7);
        add(r);
    }
    // token prefill, truncate, release, fast decodes
    {
        pb::SessionRequest r;
        pb::StepFrame * s = r.mutable_step();
        header(s->mutable_header(), pb::PHASE_PREFILL, 0, 4);
        for (int32_t t : {1, 17, 4000, 2}) s->mutable_tokens()->add_token_ids(t);
        *s->mutable_header()->mutable_payload_checksum() = B::crc_checksum(B::tokens_payload_crc(s->tokens()));
        s->mutable_generate()->set_max_tokens(8);
        pb::ChainHop * hop = s->add_downstream();
        hop->set_endpoint("127.0.0.1:7001");
        hop->mutable_range()->set_start(15);
        hop->mutable_range()->set_end(30);
        add(r);
        header(s->mutable_header(), pb::PHASE_TRUNCATE, 2, 2);
        s->clear_tokens();
        s->clear_generate();
        s->clear_downstream();
        s->mutable_header()->clear_payload_checksum();
        add(r);
        s->mutable_header()->set_phase(pb::PHASE_RELEASE);
        add(r);
    }
    {
        pb::SessionRequest r;
        pb::FastDecodeFrame * f = r.mutable_fast_decode();
        f->set_session_id("fuzz-session");
        f->set_route_epoch(1);
        f->set_step(9);
        f->set_position(12);
        f->set_token_id(42);
        add(r);
        std::vector<float> v(n_embd, 0.5f);
        *f->mutable_bundle() = B::boundary_bundle(v.data(), 1, n_embd, 256);
        add(r);
    }
    return out;
}

namespace {

// A (message, field) slot anywhere in the frame, set or not (sub-messages only when set).
struct Slot {
    Message * msg;
    const FieldDescriptor * fd;
};

void collect(Message * m, std::vector<Slot> * out, int depth) {
    const auto * d = m->GetDescriptor();
    const Reflection * r = m->GetReflection();
    for (int i = 0; i < d->field_count(); ++i) {
        const FieldDescriptor * fd = d->field(i);
        out->push_back({m, fd});
        if (fd->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE || depth > 6) continue;
        if (fd->is_repeated()) {
            for (int k = 0; k < r->FieldSize(*m, fd); ++k) collect(r->MutableRepeatedMessage(m, fd, k), out, depth + 1);
        } else if (r->HasField(*m, fd)) {
            collect(r->MutableMessage(m, fd), out, depth + 1);
        }
    }
}

std::string some_bytes(Rng & rng, bool text) {
    static const size_t lens[] = {0, 1, 2, 3, 4, 7, 8, 63, 64, 65, 127, 128, 129, 255, 1024};
    std::string s(lens[below(rng, sizeof lens / sizeof lens[0])], 'a');
    for (char & c : s) c = text ? char('a' + below(rng, 26)) : char(rng());
    return s;
}

void set_scalar(Message * m, const FieldDescriptor * fd, Rng & rng, int index) {
    const Reflection * r = m->GetReflection();
    const bool rep = index >= 0;
    const uint64_t v = below(rng, 3) ? interesting_u64(rng) : below(rng, 64);
    switch (fd->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
            rep ? r->SetRepeatedInt32(m, fd, index, int32_t(v)) : r->SetInt32(m, fd, int32_t(v));
            break;
        case FieldDescriptor::CPPTYPE_INT64:
            rep ? r->SetRepeatedInt64(m, fd, index, int64_t(v)) : r->SetInt64(m, fd, int64_t(v));
            break;
        case FieldDescriptor::CPPTYPE_UINT32:
            rep ? r->SetRepeatedUInt32(m, fd, index, uint32_t(v)) : r->SetUInt32(m, fd, uint32_t(v));
            break;
        case FieldDescriptor::CPPTYPE_UINT64:
            rep ? r->SetRepeatedUInt64(m, fd, index, v) : r->SetUInt64(m, fd, v);
            break;
        case FieldDescriptor::CPPTYPE_BOOL:
            rep ? r->SetRepeatedBool(m, fd, index, v & 1) : r->SetBool(m, fd, v & 1);
            break;
        case FieldDescriptor::CPPTYPE_ENUM: {
            const int e = int(below(rng, 12)) - 1;  // known values and a few beyond
            rep ? r->SetRepeatedEnumValue(m, fd, index, e) : r->SetEnumValue(m, fd, e);
            break;
        }
        case FieldDescriptor::CPPTYPE_FLOAT:
        case FieldDescriptor::CPPTYPE_DOUBLE: {
            static const double k[] = {0.0, -0.0, 1.0, -1.0, 0.5, 1.0000001, 2.0, 1e30, -1e30, 1e-40,
                                       std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()};
            const double f = k[below(rng, sizeof k / sizeof k[0])];
            if (fd->cpp_type() == FieldDescriptor::CPPTYPE_FLOAT) {
                rep ? r->SetRepeatedFloat(m, fd, index, float(f)) : r->SetFloat(m, fd, float(f));
            } else {
                rep ? r->SetRepeatedDouble(m, fd, index, f) : r->SetDouble(m, fd, f);
            }
            break;
        }
        case FieldDescriptor::CPPTYPE_STRING: {
            const std::string s = some_bytes(rng, fd->type() == FieldDescriptor::TYPE_STRING);
            rep ? r->SetRepeatedString(m, fd, index, s) : r->SetString(m, fd, s);
            break;
        }
        default:
            break;
    }
}

void mutate_slot(const Slot & s, Rng & rng) {
    const Reflection * r = s.msg->GetReflection();
    const FieldDescriptor * fd = s.fd;
    if (fd->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
        if (fd->is_repeated()) {
            const int n = r->FieldSize(*s.msg, fd);
            switch (below(rng, 4)) {
                case 0: r->AddMessage(s.msg, fd); break;  // an empty element
                case 1: if (n) r->RemoveLast(s.msg, fd); break;
                case 2: if (n > 1) r->SwapElements(s.msg, fd, int(below(rng, n)), int(below(rng, n))); break;
                default:  // duplicate an element (a fragment or tensor sent twice)
                    if (n) r->AddMessage(s.msg, fd)->CopyFrom(r->GetRepeatedMessage(*s.msg, fd, int(below(rng, n))));
            }
        } else if (r->HasField(*s.msg, fd) && below(rng, 2)) {
            r->ClearField(s.msg, fd);
        } else {
            (void) r->MutableMessage(s.msg, fd);  // present but empty
        }
        return;
    }
    if (!fd->is_repeated()) {
        if (below(rng, 8) == 0) {
            r->ClearField(s.msg, fd);
        } else {
            set_scalar(s.msg, fd, rng, -1);
        }
        return;
    }
    const int n = r->FieldSize(*s.msg, fd);
    switch (below(rng, 4)) {
        case 0: if (n) r->RemoveLast(s.msg, fd); break;
        case 1: if (n) set_scalar(s.msg, fd, rng, int(below(rng, n))); break;
        default: {  // append 1..300 elements (token ids, shape dims, enum lists)
            const uint64_t k = below(rng, 4) ? 1 : 1 + below(rng, 300);
            for (uint64_t i = 0; i < k; ++i) {
                switch (fd->cpp_type()) {
                    case FieldDescriptor::CPPTYPE_INT32: r->AddInt32(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_INT64: r->AddInt64(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_UINT32: r->AddUInt32(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_UINT64: r->AddUInt64(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_BOOL: r->AddBool(s.msg, fd, false); break;
                    case FieldDescriptor::CPPTYPE_ENUM: r->AddEnumValue(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_FLOAT: r->AddFloat(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_DOUBLE: r->AddDouble(s.msg, fd, 0); break;
                    case FieldDescriptor::CPPTYPE_STRING: r->AddString(s.msg, fd, ""); break;
                    default: break;
                }
                set_scalar(s.msg, fd, rng, r->FieldSize(*s.msg, fd) - 1);
            }
        }
    }
}

}  // namespace

bool mutate_structured(std::string & input, Rng & rng) {
    pb::SessionRequest req;
    if (!req.ParseFromString(input)) return false;
    const uint64_t n = 1 + below(rng, 3);
    for (uint64_t i = 0; i < n; ++i) {
        std::vector<Slot> slots;
        collect(&req, &slots, 0);
        if (slots.empty()) return false;
        mutate_slot(slots[below(rng, slots.size())], rng);
    }
    std::string out;
    if (!req.SerializeToString(&out)) return false;
    input = std::move(out);
    return true;
}

}  // namespace dgr_fuzz
