// Named-tensor bundle validation and frame checks in C++ (mirrors tests/test_bundle.py).
#include "common/bundle.h"
#include "common/checksum.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace pb = dgr::shard::v1;
namespace B  = dgr::bundle;

#include "check.h"

static std::vector<float> rows(uint32_t n_tokens, uint32_t n_embd) {
    std::vector<float> v(size_t(n_tokens) * n_embd);
    for (size_t i = 0; i < v.size(); ++i) {
        v[i] = float(i) * 0.5f - 3.0f;
    }
    return v;
}

// 2 x 4 f32 residual in 8-byte fragments (4 fragments).
static pb::TensorBundle small() {
    const auto r = rows(2, 4);
    return B::boundary_bundle(r.data(), 2, 4, 8);
}

static std::string reason_of(const pb::TensorBundle & b, B::Limits limits = {},
                             int compression = pb::COMPRESSION_UNSPECIFIED) {
    std::vector<B::Tensor> out;
    const B::Result        r = B::read_bundle(b, &out, limits, compression);
    return r ? r->reason_name() : "ok";
}

static std::string message_of(const pb::TensorBundle & b) {
    std::vector<B::Tensor> out;
    const B::Result        r = B::read_bundle(b, &out);
    return r ? r->to_string() : "ok";
}

static bool contains(const std::string & s, const char * needle) {
    return s.find(needle) != std::string::npos;
}

static void test_crc32() {
    const char * s = "123456789";
    CHECK(dgr::crc32(s, 9) == 0xCBF43926u, "check value %08x", dgr::crc32(s, 9));
    CHECK(dgr::crc32(s + 4, 5, dgr::crc32(s, 4)) == 0xCBF43926u, "chained");
    CHECK(dgr::crc32(nullptr, 0) == 0, "empty");
}

static void test_round_trip_and_fragments() {
    const auto       r = rows(5, 16);
    pb::TensorBundle b = B::boundary_bundle(r.data(), 5, 16, 48);
    const auto &     t = b.tensors(0);
    CHECK(t.fragment_count() == (5 * 16 * 4 + 47) / 48, "fragment_count %u", t.fragment_count());
    CHECK(t.byte_order() == pb::BYTE_ORDER_LITTLE_ENDIAN && t.dtype() == pb::TENSOR_DTYPE_F32, "meta");
    for (const auto & f : t.fragments()) {
        CHECK(f.data().size() <= 48, "fragment %u is %zu bytes", f.index(), f.data().size());
    }
    // Wire round trip.
    std::string wire;
    b.SerializeToString(&wire);
    pb::TensorBundle back;
    CHECK(back.ParseFromString(wire), "parse");
    std::vector<float> out;
    B::Result          res = B::read_boundary(back, 5, 16, &out);
    CHECK(!res && out == r, "boundary round trip: %s", res ? res->to_string().c_str() : "values differ");

    // Spread over frames, reversed order: complete only at the end.
    B::Assembler asm_(B::Limits{ 0, 48 });
    const int    n = t.fragments_size();
    for (int i = n - 1; i >= 0; --i) {
        CHECK(!asm_.complete(), "complete too early at %d", i);
        pb::TensorBundle part;
        pb::NamedTensor * pt = part.add_tensors();
        *pt                  = t;
        pt->clear_fragments();
        *pt->add_fragments() = t.fragments(i);
        const B::Result ar    = asm_.add(part);
        CHECK(!ar, "add: %s", ar ? ar->to_string().c_str() : "");
    }
    CHECK(asm_.complete() && asm_.missing().empty(), "complete after all parts");
    std::vector<B::Tensor> tensors;
    res = asm_.finish(&tensors);
    CHECK(!res && tensors.size() == 1 && tensors[0].data.size() == r.size() * 4 &&
              std::memcmp(tensors[0].data.data(), r.data(), tensors[0].data.size()) == 0,
          "reassembly");
}

static void test_big_endian_and_dtypes() {
    const int32_t    ids[3] = { -1, 2, 70000 };
    pb::TensorBundle b;
    B::write_tensor(b.add_tensors(), "ids", { 3 }, pb::TENSOR_DTYPE_I32, ids, sizeof ids, 5);
    // A big-endian writer: same values, swapped bytes.
    pb::NamedTensor * be = b.add_tensors();
    B::write_tensor(be, "be", { 3 }, pb::TENSOR_DTYPE_I32, ids, sizeof ids);
    std::string data = be->fragments(0).data();
    for (size_t i = 0; i < data.size(); i += 4) {
        std::swap(data[i], data[i + 3]);
        std::swap(data[i + 1], data[i + 2]);
    }
    be->mutable_fragments(0)->set_data(data);
    be->set_byte_order(pb::BYTE_ORDER_BIG_ENDIAN);
    *be->mutable_checksum() = B::crc_checksum(dgr::crc32(data.data(), data.size()));
    std::vector<B::Tensor> out;
    const B::Result        r = B::read_bundle(b, &out);
    CHECK(!r && out.size() == 2, "read: %s", r ? r->to_string().c_str() : "");
    if (!r && out.size() == 2) {
        CHECK(std::memcmp(out[0].data.data(), ids, sizeof ids) == 0, "i32 values");
        CHECK(std::memcmp(out[1].data.data(), ids, sizeof ids) == 0, "big-endian converted to native");
    }
    // Zero values: unspecified byte order = little, no checksum = not verified.
    pb::TensorBundle m = small();
    m.mutable_tensors(0)->set_byte_order(pb::BYTE_ORDER_UNSPECIFIED);
    m.mutable_tensors(0)->clear_checksum();
    CHECK(reason_of(m) == "ok", "older/minimal writer accepted");
}

static void test_bad_metadata() {
    struct Case {
        const char * what;
        void (*mutate)(pb::NamedTensor *);
        const char * needle;
    };
    const Case cases[] = {
        { "shape vs bytes", [](pb::NamedTensor * t) { t->set_shape(1, 5); }, "byte_size says" },
        { "zero dim", [](pb::NamedTensor * t) { t->set_shape(1, 0); }, "zero dimension" },
        { "too many dims",
          [](pb::NamedTensor * t) {
              t->clear_shape();
              for (int i = 0; i < 9; ++i) {
                  t->add_shape(1);
              }
          },
          "dimensions" },
        { "dtype size", [](pb::NamedTensor * t) { t->set_dtype(pb::TENSOR_DTYPE_F16); }, "byte_size says" },
        { "dtype unset", [](pb::NamedTensor * t) { t->set_dtype(pb::TENSOR_DTYPE_UNSPECIFIED); }, "unknown dtype" },
        { "dtype unknown", [](pb::NamedTensor * t) { t->set_dtype(static_cast<pb::TensorDtype>(42)); },
          "unknown dtype" },
        { "byte order", [](pb::NamedTensor * t) { t->set_byte_order(static_cast<pb::ByteOrder>(7)); },
          "unknown byte order" },
        { "empty name", [](pb::NamedTensor * t) { t->set_name(""); }, "empty name" },
        { "byte_size", [](pb::NamedTensor * t) { t->set_byte_size(33); }, "byte_size says" },
        { "fragment_count 0", [](pb::NamedTensor * t) { t->set_fragment_count(0); }, "fragment_count" },
        { "overflowing shape",
          [](pb::NamedTensor * t) {
              t->set_shape(0, uint64_t(1) << 62);
              t->set_shape(1, 1 << 4);
          },
          "too many" },
    };
    for (const Case & c : cases) {
        pb::TensorBundle b = small();
        c.mutate(b.mutable_tensors(0));
        const std::string msg = message_of(b);
        CHECK(reason_of(b) == "ERROR_REASON_BAD_BUNDLE" && contains(msg, c.needle), "%s: %s", c.what, msg.c_str());
    }
}

static void test_bad_fragments_and_checksum() {
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_checksum()->set_value(b.tensors(0).checksum().value() ^ 1);
        CHECK(contains(message_of(b), "checksum"), "checksum mismatch: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        std::string      d = b.tensors(0).fragments(1).data();
        d[0] ^= 0x40;
        b.mutable_tensors(0)->mutable_fragments(1)->set_data(d);
        CHECK(contains(message_of(b), "checksum"), "corrupt data: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_fragments()->DeleteSubrange(2, 1);
        B::Assembler asm_;
        CHECK(!asm_.add(b), "add");
        const auto miss = asm_.missing();
        CHECK(!asm_.complete() && miss.size() == 1 && miss.at("residual") == std::vector<uint32_t>{ 2 }, "missing");
        std::vector<B::Tensor> out;
        const B::Result        r = asm_.finish(&out);
        CHECK(r && contains(r->to_string(), "missing fragment(s) 2 of 4"), "missing: %s",
              r ? r->to_string().c_str() : "ok");
    }
    {
        pb::TensorBundle b   = small();
        auto *           dup = b.mutable_tensors(0)->add_fragments();
        *dup                 = b.tensors(0).fragments(1);
        CHECK(contains(message_of(b), "received twice"), "duplicate: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_fragments(0)->set_index(9);
        CHECK(contains(message_of(b), "fragment index 9"), "index: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_fragments(0)->set_data("");
        CHECK(contains(message_of(b), "is empty"), "empty: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_fragments(3)->mutable_data()->push_back('\0');
        CHECK(contains(message_of(b), "exceed byte_size"), "exceed: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        b.mutable_tensors(0)->mutable_fragments(3)->mutable_data()->resize(4);
        CHECK(contains(message_of(b), "reassembled 28 bytes"), "short: %s", message_of(b).c_str());
    }
    {
        pb::TensorBundle b = small();
        *b.add_tensors()   = b.tensors(0);
        CHECK(contains(message_of(b), "named twice"), "dup name: %s", message_of(b).c_str());
    }
    {
        // Metadata must agree across frames of one step.
        pb::TensorBundle a = small(), c = small();
        a.mutable_tensors(0)->mutable_fragments()->DeleteSubrange(2, 2);
        c.mutable_tensors(0)->mutable_fragments()->DeleteSubrange(0, 2);
        c.mutable_tensors(0)->set_shape(0, 1);
        c.mutable_tensors(0)->add_shape(2);
        B::Assembler asm_;
        CHECK(!asm_.add(a), "first part");
        const B::Result r = asm_.add(c);
        CHECK(r && contains(r->to_string(), "differs between frames"), "meta differs");
    }
    CHECK(contains(message_of(pb::TensorBundle()), "no tensor"), "empty bundle");
}

static void test_limits_and_compression() {
    pb::TensorBundle b = small();
    std::vector<B::Tensor> out;
    B::Result r = B::read_bundle(b, &out, B::Limits{ 16, 0 });
    CHECK(r && r->reason == pb::ERROR_REASON_MESSAGE_TOO_LARGE && r->grpc_code() == 8 && r->limit == 16,
          "tensor limit");
    r = B::read_bundle(b, &out, B::Limits{ 0, 4 });
    CHECK(r && r->reason == pb::ERROR_REASON_MESSAGE_TOO_LARGE, "fragment limit");
    for (int c : { int(pb::COMPRESSION_F16), int(pb::COMPRESSION_Q8_0), 99 }) {
        CHECK(reason_of(b, {}, c) == "ERROR_REASON_UNSUPPORTED_COMPRESSION", "compression %d", c);
    }
    CHECK(reason_of(b, {}, pb::COMPRESSION_NONE) == "ok", "none");
    std::vector<float> v;
    r = B::read_boundary(b, 3, 4, &v);
    CHECK(r && contains(r->to_string(), "expected f32 [3, 4]"), "boundary shape: %s",
          r ? r->to_string().c_str() : "ok");
    const pb::ShardError e = r->to_message();
    CHECK(e.reason() == pb::ERROR_REASON_BAD_BUNDLE && e.grpc_code() == 3 && !e.session_terminated(), "ShardError");
}

static pb::SessionRequest token_frame() {
    pb::SessionRequest req;
    auto *             s = req.mutable_step();
    auto *             h = s->mutable_header();
    h->set_schema_version(pb::SCHEMA_VERSION_V1);
    h->set_session_id("s");
    h->set_route_epoch(1);
    h->set_compatibility_fingerprint("fp");
    h->mutable_shard_range()->set_end(15);
    h->set_phase(pb::PHASE_PREFILL);
    h->mutable_positions()->set_end(3);
    for (int t : { 1, 2, 3 }) {
        s->mutable_tokens()->add_token_ids(t);
    }
    *h->mutable_payload_checksum() = B::crc_checksum(B::tokens_payload_crc(s->tokens()));
    return req;
}

static std::string req_reason(const pb::SessionRequest & req, const pb::GetCapabilityResponse * cap = nullptr) {
    const B::Result r = B::check_request(req, cap);
    return r ? r->reason_name() : "ok";
}

static void test_check_request() {
    pb::GetCapabilityResponse cap;
    cap.set_schema_version(pb::SCHEMA_VERSION_V1);
    cap.set_min_schema_version(pb::SCHEMA_VERSION_V1);
    auto * id = cap.mutable_identity();
    id->set_compatibility_fingerprint("fp");
    id->mutable_range()->set_end(15);
    id->set_head(true);
    id->set_n_vocab(100);
    cap.mutable_capacity()->set_max_prefill_chunk_tokens(8);

    pb::SessionRequest ok = token_frame();
    CHECK(req_reason(ok) == "ok" && req_reason(ok, &cap) == "ok", "%s", req_reason(ok, &cap).c_str());

    auto with = [](void (*f)(pb::SessionRequest *)) {
        pb::SessionRequest r = token_frame();
        f(&r);
        return r;
    };
    CHECK(req_reason(with([](pb::SessionRequest * r) { r->mutable_step()->mutable_header()->clear_schema_version(); })) ==
              "ERROR_REASON_SCHEMA_UNSUPPORTED", "schema unset");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_schema_version(static_cast<pb::SchemaVersion>(2));
          })) == "ERROR_REASON_SCHEMA_UNSUPPORTED", "schema newer");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_phase(static_cast<pb::Phase>(5));
          })) == "ERROR_REASON_BAD_REQUEST", "unknown phase");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->mutable_payload_checksum()->set_value(1);
          })) == "ERROR_REASON_BAD_BUNDLE", "payload crc");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->mutable_positions()->set_end(4);
          })) == "ERROR_REASON_BAD_REQUEST", "rows vs tokens");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_phase(pb::PHASE_DECODE);
          })) == "ERROR_REASON_CHUNK_TOO_LARGE", "decode rows");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_compression(pb::COMPRESSION_F16);
          })) == "ERROR_REASON_UNSUPPORTED_COMPRESSION", "compression");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_phase(pb::PHASE_TRUNCATE);
          })) == "ERROR_REASON_BAD_REQUEST", "truncate with input");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_sampling()->set_mode(pb::SAMPLING_MODE_STOCHASTIC);
          })) == "ERROR_REASON_BAD_REQUEST", "stochastic without temperature");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_compatibility_fingerprint("other");
          }), &cap) == "ERROR_REASON_FINGERPRINT_MISMATCH", "fingerprint");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->mutable_shard_range()->set_start(1);
          }), &cap) == "ERROR_REASON_RANGE_MISMATCH", "range");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_tokens()->set_token_ids(2, 100);
              auto * h = r->mutable_step()->mutable_header();
              *h->mutable_payload_checksum() = B::crc_checksum(B::tokens_payload_crc(r->step().tokens()));
          }), &cap) == "ERROR_REASON_TOKEN_OUT_OF_VOCAB", "vocab");
    pb::GetCapabilityResponse tail = cap;
    tail.mutable_identity()->set_head(false);
    CHECK(req_reason(ok, &tail) == "ERROR_REASON_ROLE_MISMATCH", "role");
    pb::GetCapabilityResponse small_chunk = cap;
    small_chunk.mutable_capacity()->set_max_prefill_chunk_tokens(2);
    CHECK(req_reason(ok, &small_chunk) == "ERROR_REASON_CHUNK_TOO_LARGE", "chunk limit");

    CHECK(req_reason(with([](pb::SessionRequest * r) { r->mutable_step()->mutable_header()->set_route_epoch(0); })) ==
              "ERROR_REASON_BAD_REQUEST", "epoch 0");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_session_id(std::string(129, 'x'));
          })) == "ERROR_REASON_BAD_REQUEST", "session id above 128 bytes");
    CHECK(req_reason(with([](pb::SessionRequest * r) { r->mutable_step()->mutable_sampling()->set_top_logprobs(65); })) ==
              "ERROR_REASON_BAD_REQUEST", "top_logprobs above 64");
    CHECK(req_reason(with([](pb::SessionRequest * r) { r->mutable_step()->mutable_sampling()->set_top_logprobs(64); })) ==
              "ok", "top_logprobs 64");
    CHECK(req_reason(with([](pb::SessionRequest * r) {
              r->mutable_step()->mutable_header()->set_effective_start(3);
          }), &cap) == "ok", "effective_start inside the range");
    {
        pb::SessionRequest r = token_frame();
        r.mutable_step()->mutable_header()->set_effective_start(3);
        const B::Result e = B::check_header(r, &cap, /*whole_range=*/true);
        CHECK(e && e->reason_name() == "ERROR_REASON_RANGE_MISMATCH", "whole range");
    }

    pb::SessionRequest fast;
    fast.mutable_fast_decode()->set_session_id("s");
    fast.mutable_fast_decode()->set_route_epoch(1);
    CHECK(req_reason(fast) == "ERROR_REASON_BAD_REQUEST", "fast without input");
    fast.mutable_fast_decode()->set_token_id(150);
    CHECK(req_reason(fast) == "ok" && req_reason(fast, &cap) == "ERROR_REASON_TOKEN_OUT_OF_VOCAB", "fast vocab");
    CHECK(req_reason(pb::SessionRequest()) == "ERROR_REASON_BAD_REQUEST", "no frame");
}

// The assembler as the worker uses it for a boundary bundle: one expected tensor, checked at
// its first frame.
static void test_expect_only() {
    pb::TensorBundle b = small();
    B::Assembler ok;
    ok.expect_only(B::kResidual, pb::TENSOR_DTYPE_F32, { 2, 4 });
    CHECK(!ok.add(b), "expected shape");
    B::Assembler wrong;
    wrong.expect_only(B::kResidual, pb::TENSOR_DTYPE_F32, { 3, 4 });
    pb::TensorBundle first = small();
    first.mutable_tensors(0)->mutable_fragments()->DeleteSubrange(1, 3);
    const B::Result r = wrong.add(first);
    CHECK(r && r->reason_name() == "ERROR_REASON_BAD_BUNDLE" && contains(r->to_string(), "expected"),
          "refused at the first frame: %s", r ? r->to_string().c_str() : "ok");
    pb::TensorBundle two = small();
    *two.add_tensors() = two.tensors(0);
    two.mutable_tensors(1)->set_name("other");
    B::Assembler extra;
    extra.expect_only(B::kResidual, pb::TENSOR_DTYPE_F32, { 2, 4 });
    CHECK(extra.add(two), "a second tensor");
}

static void test_reason_mapping() {
    const auto * e = pb::ErrorReason_descriptor();
    for (int i = 0; i < e->value_count(); ++i) {
        const int code = B::grpc_code_for(static_cast<pb::ErrorReason>(e->value(i)->number()));
        CHECK(code > 0 && code <= 16, "%s -> %d", e->value(i)->name().c_str(), code);
    }
    CHECK(B::grpc_code_for(pb::ERROR_REASON_STALE_EPOCH) == 10, "ABORTED");
    CHECK(B::grpc_code_for(pb::ERROR_REASON_UNAVAILABLE) == 14, "UNAVAILABLE");
    CHECK(B::grpc_code_for(static_cast<pb::ErrorReason>(999)) == 2, "UNKNOWN");
}

// logit_bias: at most kMaxLogitBias entries (the rule vectors cover ids, bounds and repeats)
void test_logit_bias_count() {
    pb::SamplingParams s;
    for (int i = 0; i < B::kMaxLogitBias; ++i) {
        auto * b = s.add_logit_bias();
        b->set_token_id(i);
        b->set_bias(-100.0f);
    }
    CHECK(!B::check_sampling(s, 49152), "%d entries refused", B::kMaxLogitBias);
    s.add_logit_bias()->set_token_id(B::kMaxLogitBias);
    auto r = B::check_sampling(s, 49152);
    CHECK(r && r->reason == pb::ERROR_REASON_BAD_REQUEST, "%d entries accepted", B::kMaxLogitBias + 1);
}

int main() {
    test_logit_bias_count();
    test_crc32();
    test_round_trip_and_fragments();
    test_big_endian_and_dtypes();
    test_bad_metadata();
    test_bad_fragments_and_checksum();
    test_limits_and_compression();
    test_check_request();
    test_expect_only();
    test_reason_mapping();
    if (g_failures) {
        std::fprintf(stderr, "bundle_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("bundle_test: ok\n");
    return 0;
}
