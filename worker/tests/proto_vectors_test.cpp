// Cross-language golden vectors of the shard protocol (tests/vectors/proto/, written by
// `dgr proto vectors --write`; format in cli/dgr/protovectors.py).
//
// For every vector: decode with the C++ generated code, flatten every set field exactly as the
// Python side does and compare with the index; re-serialize and byte-compare (unknown fields
// of newer-schema frames preserved); apply the documented handling (check_request). Also
// builds two frames from scratch in C++ and byte-compares them with the Python-written ones,
// and checks the ErrorReason -> gRPC code table.
#include "common/bundle.h"
#include "common/checksum.h"

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#ifndef DGR_REPO_ROOT
#define DGR_REPO_ROOT "."
#endif

namespace pb = dgr::shard::v1;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using Lines = std::vector<std::pair<std::string, std::string>>;

#include "check.h"

static std::string read_file(const std::string & path, bool * ok) {
    std::ifstream in(path, std::ios::binary);
    *ok = bool(in);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// ---- flattening: the same algorithm as cli/dgr/protovectors.py flatten() ----------------------

static std::string pct(const std::string & raw) {
    static const std::string safe =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~/:-";
    std::string out;
    for (unsigned char c : raw) {
        if (safe.find(char(c)) != std::string::npos) {
            out += char(c);
        } else {
            char buf[4];
            std::snprintf(buf, sizeof buf, "%%%02X", c);
            out += buf;
        }
    }
    return out;
}

static std::string hex(const std::string & raw) {
    std::string out;
    char        buf[3];
    for (unsigned char c : raw) {
        std::snprintf(buf, sizeof buf, "%02x", c);
        out += buf;
    }
    return out;
}

static std::string enum_text(const FieldDescriptor * fd, int v) {
    const auto * ev = fd->enum_type()->FindValueByNumber(v);
    return ev ? ev->name() : std::to_string(v);
}

// index < 0: singular field.
static std::string scalar(const Message & m, const FieldDescriptor * fd, int index) {
    const Reflection * r   = m.GetReflection();
    const bool         rep = index >= 0;
    char               buf[32];
    switch (fd->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32:
            return std::to_string(rep ? r->GetRepeatedInt32(m, fd, index) : r->GetInt32(m, fd));
        case FieldDescriptor::CPPTYPE_INT64:
            return std::to_string(rep ? r->GetRepeatedInt64(m, fd, index) : r->GetInt64(m, fd));
        case FieldDescriptor::CPPTYPE_UINT32:
            return std::to_string(rep ? r->GetRepeatedUInt32(m, fd, index) : r->GetUInt32(m, fd));
        case FieldDescriptor::CPPTYPE_UINT64:
            return std::to_string(rep ? r->GetRepeatedUInt64(m, fd, index) : r->GetUInt64(m, fd));
        case FieldDescriptor::CPPTYPE_BOOL:
            return (rep ? r->GetRepeatedBool(m, fd, index) : r->GetBool(m, fd)) ? "true" : "false";
        case FieldDescriptor::CPPTYPE_ENUM:
            return enum_text(fd, rep ? r->GetRepeatedEnumValue(m, fd, index) : r->GetEnumValue(m, fd));
        case FieldDescriptor::CPPTYPE_FLOAT: {
            const float v = rep ? r->GetRepeatedFloat(m, fd, index) : r->GetFloat(m, fd);
            uint32_t    bits;
            std::memcpy(&bits, &v, 4);
            std::snprintf(buf, sizeof buf, "f:%08x", bits);
            return buf;
        }
        case FieldDescriptor::CPPTYPE_DOUBLE: {
            const double v = rep ? r->GetRepeatedDouble(m, fd, index) : r->GetDouble(m, fd);
            uint64_t     bits;
            std::memcpy(&bits, &v, 8);
            std::snprintf(buf, sizeof buf, "d:%016llx", static_cast<unsigned long long>(bits));
            return buf;
        }
        case FieldDescriptor::CPPTYPE_STRING: {
            const std::string v = rep ? r->GetRepeatedString(m, fd, index) : r->GetString(m, fd);
            return fd->type() == FieldDescriptor::TYPE_BYTES ? "x:" + hex(v) : "s:" + pct(v);
        }
        default:
            return "?";
    }
}

static void flatten(const Message & m, const std::string & prefix, Lines * out) {
    const Reflection *                   r = m.GetReflection();
    std::vector<const FieldDescriptor *> fields;
    r->ListFields(m, &fields);
    for (const FieldDescriptor * fd : fields) {
        const std::string path = prefix + fd->name();
        if (fd->is_map()) {
            const FieldDescriptor * kfd = fd->message_type()->FindFieldByName("key");
            const FieldDescriptor * vfd = fd->message_type()->FindFieldByName("value");
            std::vector<std::pair<std::string, const Message *>> entries;
            for (int i = 0; i < r->FieldSize(m, fd); ++i) {
                const Message & e = r->GetRepeatedMessage(m, fd, i);
                entries.emplace_back(scalar(e, kfd, -1), &e);
            }
            std::sort(entries.begin(), entries.end(),
                      [](const auto & a, const auto & b) { return a.first < b.first; });
            for (const auto & [key, e] : entries) {
                const std::string kpath = path + "{" + key + "}";
                if (vfd->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
                    flatten(e->GetReflection()->GetMessage(*e, vfd), kpath + ".", out);
                } else {
                    out->emplace_back(kpath, scalar(*e, vfd, -1));
                }
            }
        } else if (fd->is_repeated()) {
            for (int i = 0; i < r->FieldSize(m, fd); ++i) {
                const std::string ipath = path + "[" + std::to_string(i) + "]";
                if (fd->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
                    const Message & item   = r->GetRepeatedMessage(m, fd, i);
                    const size_t    before = out->size();
                    flatten(item, ipath + ".", out);
                    if (out->size() == before) {
                        out->emplace_back(ipath, "{}");
                    }
                } else {
                    out->emplace_back(ipath, scalar(m, fd, i));
                }
            }
        } else if (fd->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
            const size_t before = out->size();
            flatten(r->GetMessage(m, fd), path + ".", out);
            if (out->size() == before) {
                out->emplace_back(path, "{}");
            }
        } else {
            out->emplace_back(path, scalar(m, fd, -1));
        }
    }
}

// ---- index ------------------------------------------------------------------------------------

struct Block {
    std::string                        name, type, file, kind, handling, reencode, capability;
    Lines                              fields;
};

static bool parse_index(const std::string & text, std::vector<Block> * blocks,
                        std::vector<std::pair<std::string, int>> * reasons) {
    std::istringstream in(text);
    std::string        line;
    Block *            cur = nullptr;
    Block              tmp;
    while (std::getline(in, line)) {
        if (line.empty() || line[0] == '#') {
            continue;
        }
        const size_t      sp   = line.find(' ');
        const std::string key  = line.substr(0, sp);
        const std::string rest = sp == std::string::npos ? "" : line.substr(sp + 1);
        if (key == "vector") {
            tmp      = Block{};
            tmp.name = rest;
            cur      = &tmp;
        } else if (key == "end") {
            if (!cur) {
                return false;
            }
            blocks->push_back(tmp);
            cur = nullptr;
        } else if (key == "reason") {
            const size_t s2 = rest.find(' ');
            reasons->emplace_back(rest.substr(0, s2), std::stoi(rest.substr(s2 + 1)));
        } else if (!cur) {
            return false;
        } else if (key == "field") {
            const size_t s2 = rest.find(' ');
            cur->fields.emplace_back(rest.substr(0, s2), rest.substr(s2 + 1));
        } else if (key == "type") {
            cur->type = rest;
        } else if (key == "file") {
            cur->file = rest;
        } else if (key == "kind") {
            cur->kind = rest;
        } else if (key == "handling") {
            cur->handling = rest;
        } else if (key == "reencode") {
            cur->reencode = rest;
        } else if (key == "capability") {
            cur->capability = rest;
        } // sha256: checked by the Python side
    }
    return cur == nullptr;
}

static std::string serialize(const Message & m) {
    std::string out;
    m.SerializeToString(&out);
    return out;
}

// ---- checks -----------------------------------------------------------------------------------

static void check_vector(const std::string & dir, const Block & b, const std::vector<Block> & all) {
    bool              ok   = false;
    const std::string data = read_file(dir + "/" + b.file, &ok);
    CHECK(ok, "%s: cannot read %s", b.name.c_str(), b.file.c_str());
    const auto * desc = google::protobuf::DescriptorPool::generated_pool()->FindMessageTypeByName(b.type);
    CHECK(desc != nullptr, "%s: unknown type %s", b.name.c_str(), b.type.c_str());
    if (!ok || !desc) {
        return;
    }
    std::unique_ptr<Message> msg(
        google::protobuf::MessageFactory::generated_factory()->GetPrototype(desc)->New());
    CHECK(msg->ParseFromString(data), "%s: parse failed", b.name.c_str());

    Lines got;
    flatten(*msg, "", &got);
    CHECK(got.size() == b.fields.size(), "%s: %zu fields decoded, index has %zu", b.name.c_str(), got.size(),
          b.fields.size());
    for (size_t i = 0; i < std::min(got.size(), b.fields.size()); ++i) {
        CHECK(got[i] == b.fields[i], "%s: field %zu: decoded '%s %s', index '%s %s'", b.name.c_str(), i,
              got[i].first.c_str(), got[i].second.c_str(), b.fields[i].first.c_str(), b.fields[i].second.c_str());
    }
    CHECK(b.reencode == "identical", "%s: reencode '%s'", b.name.c_str(), b.reencode.c_str());
    CHECK(serialize(*msg) == data, "%s: re-encoded bytes differ from the vector", b.name.c_str());

    if (b.kind == "newer_schema") {
        // Unknown fields are kept somewhere in the message (top level or nested) and re-encoded.
        std::unique_ptr<Message> copy(msg->New());
        copy->CopyFrom(*msg);
        CHECK(serialize(*copy) == data, "%s: unknown fields lost in a copy", b.name.c_str());
        CHECK(copy->ByteSizeLong() == data.size(), "%s: byte size", b.name.c_str());
    }
    if (b.handling != "decode") {
        CHECK(b.type == "dgr.shard.v1.SessionRequest", "%s: handling on %s", b.name.c_str(), b.type.c_str());
        pb::SessionRequest req;
        req.ParseFromString(data);
        // checked alone, or against the Shard of another vector (`capability NAME`)
        pb::GetCapabilityResponse cap;
        bool                      with_cap = false;
        if (!b.capability.empty()) {
            for (const Block & c : all) {
                if (c.name == b.capability) {
                    bool cok = false;
                    with_cap = cap.ParseFromString(read_file(dir + "/" + c.file, &cok)) && cok;
                }
            }
            CHECK(with_cap, "%s: capability vector %s missing", b.name.c_str(), b.capability.c_str());
        }
        // the frame's rules and, for a bundle, the bundle's (one complete step)
        const dgr::bundle::Result r = dgr::bundle::check_frame(req, with_cap ? &cap : nullptr);
        if (b.handling == "accept") {
            CHECK(!r, "%s: expected accept, got %s", b.name.c_str(), r ? r->to_string().c_str() : "");
        } else {
            const std::string want = b.handling.substr(b.handling.find(':') + 1);
            CHECK(r && r->reason_name() == want, "%s: expected %s, got %s", b.name.c_str(), want.c_str(),
                  r ? r->reason_name().c_str() : "accept");
        }
    }
}

static std::vector<float> residual(uint32_t n_tokens, uint32_t n_embd, float offset) {
    // Same values as cli/dgr/protovectors.py _residual().
    std::vector<float> v(size_t(n_tokens) * n_embd);
    for (size_t i = 0; i < v.size(); ++i) {
        v[i] = (float(i) - 13.0f) / 8.0f + offset;
    }
    return v;
}

static void check_cpp_writes_the_same_bytes(const std::string & dir) {
    bool ok = false;
    {
        pb::SessionRequest req;
        auto *             f = req.mutable_fast_decode();
        f->set_session_id("sess-a1");
        f->set_route_epoch(3);
        f->set_step(7);
        f->set_position(12);
        f->set_token_id(1917);
        f->set_request_id("req-0009");
        const std::string want = read_file(dir + "/session_fast_decode_token.bin", &ok);
        CHECK(ok && serialize(req) == want, "C++-written fast decode frame differs from the golden bytes");
    }
    {
        const std::vector<float> rows = residual(4, 8, 0.0f);
        pb::SessionRequest       req;
        pb::StepFrame *          s = req.mutable_step();
        pb::FrameHeader *        h = s->mutable_header();
        *s->mutable_bundle()       = dgr::bundle::boundary_bundle(rows.data(), 4, 8, 40);
        h->set_schema_version(pb::SCHEMA_VERSION_V1);
        h->set_request_id("req-0001");
        h->set_session_id("sess-a1");
        h->set_route_epoch(3);
        h->set_compatibility_fingerprint("9f2c1e7a5b3d4c6e8f0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c2d3e4f5a6");
        h->mutable_shard_range()->set_start(15);
        h->mutable_shard_range()->set_end(30);
        h->set_effective_start(15);
        h->set_phase(pb::PHASE_PREFILL);
        h->mutable_positions()->set_start(6);
        h->mutable_positions()->set_end(10);
        h->set_step(1);
        h->mutable_cache_expectation()->set_kind(pb::CACHE_EXPECTATION_KIND_POSITION);
        h->mutable_cache_expectation()->set_position(6);
        h->set_compression(pb::COMPRESSION_NONE);
        *h->mutable_payload_checksum() = dgr::bundle::crc_checksum(dgr::bundle::bundle_payload_crc(s->bundle()));
        s->set_sample(true);
        const std::string want = read_file(dir + "/session_prefill_bundle_fragmented.bin", &ok);
        CHECK(ok && serialize(req) == want, "C++-written fragmented prefill frame differs from the golden bytes");

        std::vector<float>        back;
        const dgr::bundle::Result r = dgr::bundle::read_boundary(s->bundle(), 4, 8, &back);
        CHECK(!r && back == rows, "boundary round trip");
    }
}

int main() {
    const std::string dir = std::string(DGR_REPO_ROOT) + "/tests/vectors/proto";
    bool              ok  = false;
    const std::string idx = read_file(dir + "/index.txt", &ok);
    if (!ok) {
        std::fprintf(stderr, "FAIL: cannot read %s/index.txt (run `dgr proto vectors --write`)\n", dir.c_str());
        return 1;
    }
    std::vector<Block>                       blocks;
    std::vector<std::pair<std::string, int>> reasons;
    CHECK(parse_index(idx, &blocks, &reasons), "index.txt is malformed");
    CHECK(blocks.size() >= 15, "only %zu vectors", blocks.size());
    for (const Block & b : blocks) {
        check_vector(dir, b, blocks);
    }
    bool seen_older = false, seen_newer = false;
    for (const Block & b : blocks) {
        seen_older = seen_older || b.kind == "older_schema";
        seen_newer = seen_newer || b.kind == "newer_schema";
    }
    CHECK(seen_older && seen_newer, "older- and newer-schema vectors present");

    const auto * reason_enum = pb::ErrorReason_descriptor();
    CHECK(int(reasons.size()) == reason_enum->value_count(), "reason table has %zu rows, enum %d values",
          reasons.size(), reason_enum->value_count());
    for (const auto & [name, code] : reasons) {
        const auto * v = reason_enum->FindValueByName(name);
        CHECK(v != nullptr, "unknown reason %s", name.c_str());
        if (v) {
            const int got = dgr::bundle::grpc_code_for(static_cast<pb::ErrorReason>(v->number()));
            CHECK(got == code, "%s maps to %d in C++, %d in Python", name.c_str(), got, code);
        }
    }
    check_cpp_writes_the_same_bytes(dir);

    if (g_failures) {
        std::fprintf(stderr, "proto_vectors_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("proto_vectors_test: %zu vectors ok\n", blocks.size());
    return 0;
}
