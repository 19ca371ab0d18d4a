// The worker's option table (worker/option_table.h): every option parses its default, bounds
// are refused with errors that name the option, the value and the bounds (exit 2), the usage
// lists every option with its default, `options --json` is JSON that matches the table, and the
// options structs start from the table's defaults.
#include "worker/fake_backend.h"
#include "worker/memory_plan.h"
#include "worker/option_table.h"
#include "worker/pipeline.h"
#include "worker/scheduler.h"
#include "worker/serve_options.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

using namespace dgr::worker;

#include "check.h"

namespace {

// parse_serve_options over a fake-model command line plus `extra`; its return code
int parse(std::vector<std::string> extra, ServeOptions * o) {
    std::vector<std::string> args = {"--fake-model"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char *> argv;
    for (auto & a : args) argv.push_back(a.data());
    return parse_serve_options((int) argv.size(), argv.data(), o);
}

std::string flag_of(const OptionSpec & s) { return std::string("--") + s.name; }

bool is_number_kind(OptionKind k) {
    return k == OptionKind::kU32 || k == OptionKind::kU64 || k == OptionKind::kI32 || k == OptionKind::kReal;
}

// the error parse_option_value gives for `value` ("" when it takes it)
std::string refusal(const OptionSpec & s, const std::string & value) {
    OptionValue v;
    std::string err;
    return parse_option_value(s, value.c_str(), &v, &err) ? "" : err;
}

std::string number(double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
}

void check_defaults_parse() {
    const ServeOptions plain;
    for (const OptionSpec & s : kOptionTable) {
        if (s.kind == OptionKind::kFlag || s.kind == OptionKind::kRange) continue;
        const std::string value = option_value_text(s);
        OptionValue v;
        std::string err;
        CHECK(parse_option_value(s, value.c_str(), &v, &err), "%s refuses its default '%s': %s", s.name,
              value.c_str(), err.c_str());
        if (is_number_kind(s.kind)) CHECK(v.number == s.value, "%s: default %s parses to %g", s.name, value.c_str(),
                                          v.number);
        // giving the default on the command line leaves ServeOptions as it starts
        ServeOptions o;
        const int rc = parse({flag_of(s), value}, &o);
        CHECK(rc == -1, "%s %s: rc %d", s.name, value.c_str(), rc);
        ServeOptions d;
        store_option(s.id, v, &d);
        CHECK(d.max_sessions == plain.max_sessions && d.ctx_per_session == plain.ctx_per_session &&
                  d.queue_limit == plain.queue_limit && d.max_batch_tokens == plain.max_batch_tokens &&
                  d.max_prefill_chunk == plain.max_prefill_chunk && d.io_nice == plain.io_nice &&
                  d.threads == plain.threads && d.n_gpu_layers == plain.n_gpu_layers &&
                  d.max_message_bytes == plain.max_message_bytes && d.session_ttl_s == plain.session_ttl_s &&
                  d.listen == plain.listen && d.chain_peers == plain.chain_peers,
              "%s: storing its default changed ServeOptions", s.name);
    }
    // the defaults themselves are within their bounds
    for (const OptionSpec & s : kOptionTable) {
        double lo = 0, hi = 0;
        if (!option_bounds(s, &lo, &hi)) continue;
        CHECK(s.value >= lo && s.value <= hi, "%s: default %g outside [%g, %g]", s.name, s.value, lo, hi);
    }
}

void check_bounds() {
    for (const OptionSpec & s : kOptionTable) {
        if (!is_number_kind(s.kind)) continue;
        double lo = 0, hi = 0;
        option_bounds(s, &lo, &hi);
        const std::string flag = flag_of(s);
        CHECK(refusal(s, number(lo)).empty(), "%s refuses its lowest value %g", s.name, lo);
        if (std::isfinite(hi) && s.kind != OptionKind::kReal) {
            CHECK(refusal(s, number(hi)).empty(), "%s refuses its highest value %g", s.name, hi);
            const std::string above = number(hi + 1);
            const std::string err = refusal(s, above);
            CHECK(err.find(flag + " wants ") == 0 && err.find("got '" + above + "'") != std::string::npos,
                  "%s above its bounds: '%s'", s.name, err.c_str());
            if (s.has_max) {
                CHECK(err.find(".. " + number(s.max)) != std::string::npos ||
                          err.find("at most " + number(s.max)) != std::string::npos,
                      "%s: the error does not say the bound: '%s'", s.name, err.c_str());
            }
            ServeOptions o;
            CHECK(parse({flag, above}, &o) == 2, "%s %s: not a usage error", s.name, above.c_str());
        }
        if (lo > 0 || (lo < 0 && lo > -2147483648.0)) {  // a bound the table names (not the type's)
            const std::string below = number(lo - 1);
            const std::string err = refusal(s, below);
            CHECK(!err.empty() && err.find(flag + " wants ") == 0, "%s below its bounds: '%s'", s.name, err.c_str());
            ServeOptions o;
            CHECK(parse({flag, below}, &o) == 2, "%s %s: not a usage error", s.name, below.c_str());
        }
        const std::string err = refusal(s, "x1");
        CHECK(err.find(flag + " wants a") == 0 && err.find("got 'x1'") != std::string::npos, "%s x1: '%s'", s.name,
              err.c_str());
    }
    // the wordings scripts and tests rely on
    CHECK(refusal(option_spec(Opt::kPipelineGroups), "17") == "--pipeline-groups wants 0 (auto) .. 16, got '17'", "%s",
          refusal(option_spec(Opt::kPipelineGroups), "17").c_str());
    CHECK(refusal(option_spec(Opt::kKeepWarmMs), "10001") == "--keep-warm-ms wants 0 (off) .. 10000, got '10001'",
          "keep-warm");
    CHECK(refusal(option_spec(Opt::kIoNice), "20") == "--io-nice wants 0 .. 19, got '20'", "io-nice");
    CHECK(refusal(option_spec(Opt::kMaxSessions), "0") == "--max-sessions wants 1 .. 256, got '0'", "max-sessions 0");
    CHECK(refusal(option_spec(Opt::kMaxSessions), "257") == "--max-sessions wants 1 .. 256, got '257'", "max-sessions");
    CHECK(refusal(option_spec(Opt::kQueueLimit), "0") == "--queue-limit wants at least 1, got '0'", "queue-limit");
    CHECK(refusal(option_spec(Opt::kThreads), "-1") == "--threads wants a non-negative integer, got '-1'", "threads");
    CHECK(refusal(option_spec(Opt::kNGpuLayers), "-1").empty(), "--n-gpu-layers -1 (all) is its default");
    CHECK(refusal(option_spec(Opt::kSessionTtlS), "nan") == "--session-ttl-s wants a non-negative number, got 'nan'",
          "nan");
    CHECK(refusal(option_spec(Opt::kLayers), "4:2") == "--layers wants A:B with A < B, got '4:2'", "layers");
    for (const char * bad : {"2:4x", "2:-1", "-1:4", " 2:4", "2:", ":4", "2:3:4", "+2:4"}) {
        CHECK(refusal(option_spec(Opt::kLayers), bad) != "", "--layers %s taken", bad);
    }
    ServeOptions o;
    CHECK(parse({"--layers", "2:4"}, &o) == -1 && o.has_layers && o.layer_start == 2 && o.layer_end == 4, "layers");
    CHECK(parse({"--max-sessions"}, &o) == 2, "a missing value");
    CHECK(parse({"--no-such-option"}, &o) == 2, "an unknown option");
    CHECK(parse({"--kv-unified", "--allow-remote"}, &o) == -1 && o.kv_unified && o.allow_remote, "flags");
}

void check_usage() {
    const std::string usage = options_usage("usage: test");
    CHECK(usage.rfind("usage: test\n", 0) == 0, "first line");
    for (const OptionSpec & s : kOptionTable) {
        const size_t at = usage.find("\n  " + flag_of(s) + (*s.metavar ? " " : ""));
        CHECK(at != std::string::npos, "usage lacks %s", s.name);
        if (at == std::string::npos) continue;
        const size_t next = usage.find("\n  --", at + 1);
        const std::string entry = usage.substr(at, next == std::string::npos ? std::string::npos : next - at);
        const std::string def = option_default_text(s);
        if (!def.empty()) {
            CHECK(entry.find("default " + def) != std::string::npos, "usage of %s lacks 'default %s'", s.name,
                  def.c_str());
        }
    }
    for (size_t i = 0; i < usage.size(); ++i) {
        if (usage[i] == '\n' && i > 0) CHECK(usage[i - 1] != ' ', "a usage line ends in a space at %zu", i);
    }
}

void check_json() {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(options_json());
    } catch (const std::exception & e) {
        CHECK(false, "options --json is not JSON: %s", e.what());
        return;
    }
    CHECK(j.contains("options") && j["options"].is_array() && j["options"].size() == kOptionCount, "options array");
    if (!j["options"].is_array()) return;
    for (size_t i = 0; i < j["options"].size() && i < kOptionCount; ++i) {
        const auto & e = j["options"][i];
        const OptionSpec & s = kOptionTable[i];
        CHECK(e.value("name", "") == s.name, "entry %zu named %s", i, e.value("name", "").c_str());
        CHECK(e.value("flag", "") == flag_of(s), "%s flag", s.name);
        CHECK(e.value("help", "") == s.help, "%s help", s.name);
        CHECK(e.value("default_text", "") == option_default_text(s), "%s default_text", s.name);
        if (is_number_kind(s.kind)) {
            CHECK(e["default"].is_number() && e["default"].get<double>() == s.value, "%s default", s.name);
            if (s.kind != OptionKind::kReal) CHECK(e["default"].is_number_integer(), "%s default is an integer", s.name);
            double lo = 0, hi = 0;
            option_bounds(s, &lo, &hi);
            CHECK(e["min"].is_number() && e["min"].get<double>() == lo, "%s min", s.name);
            if (std::isfinite(hi)) CHECK(e["max"].is_number() && e["max"].get<double>() == hi, "%s max", s.name);
            else CHECK(e["max"].is_null(), "%s max null", s.name);
        } else if (s.kind == OptionKind::kText) {
            CHECK(e["default"].is_string() && e["default"].get<std::string>() == s.text, "%s default", s.name);
            CHECK(e["min"].is_null() && e["max"].is_null(), "%s bounds", s.name);
        } else if (s.kind == OptionKind::kFlag) {
            CHECK(e["default"].is_boolean() && !e["default"].get<bool>(), "%s default", s.name);
        } else {
            CHECK(e["default"].is_null(), "%s default", s.name);
        }
    }
}

// every options struct that holds one of these values starts from the table's default
void check_structs() {
    const SchedulerOptions so;
    CHECK(so.max_sessions == default_u32(Opt::kMaxSessions) && so.max_session_positions == 2048 &&
              so.queue_limit == 64 && so.max_batch_tokens == 512 && so.max_prefill_chunk_tokens == 256 &&
              so.max_message_bytes == (64ull << 20) && so.session_ttl_s == 600 && so.evict_idle_s == 30 &&
              so.pipeline_groups == 0 && so.max_sessions == 16,
          "SchedulerOptions");
    CHECK(so.chain.peers == (std::vector<std::string>{"127.0.0.1", "localhost", "::1"}) &&
              so.chain.max_message_bytes == so.max_message_bytes,
          "ChainOptions");
    const ServeOptions o;
    CHECK(o.max_sessions == so.max_sessions && o.ctx_per_session == so.max_session_positions &&
              o.max_prefill_chunk == so.max_prefill_chunk_tokens && o.io_nice == 10 && o.n_gpu_layers == -1 &&
              o.listen == "127.0.0.1:50151" && o.drain_timeout_s == 10,
          "ServeOptions");
    const FakeModelOptions f;
    CHECK(f.n_layer == 8 && f.n_embd == 8 && f.n_vocab == 320 && f.n_seq_max == so.max_sessions &&
              f.max_batch_tokens == so.max_batch_tokens,
          "FakeModelOptions");
    const MemoryPlanRequest m;
    CHECK(m.max_sessions == so.max_sessions && m.ctx_per_session == so.max_session_positions &&
              m.max_batch_tokens == so.max_batch_tokens && m.n_gpu_layers == -1,
          "MemoryPlanRequest");
    CHECK(kMaxPipelineGroups == 16, "kMaxPipelineGroups");
    CHECK(split_peer_list("[::1],LocalHost,,*") == (std::vector<std::string>{"::1", "localhost", "*"}),
          "split_peer_list");
}

}  // namespace

int main() {
    check_defaults_parse();
    check_bounds();
    check_usage();
    check_json();
    check_structs();
    if (g_failures) {
        std::fprintf(stderr, "option_table_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("option_table_test: %zu options ok\n", kOptionCount);
    return 0;
}
