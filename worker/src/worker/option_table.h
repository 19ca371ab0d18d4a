// The one table of the worker's options (`dgr-worker serve` / `plan-memory`): for each its flag,
// value kind, default, bounds and help line. Parsing (worker/serve_options.cpp), the usage text,
// `dgr-worker options --json` and the defaults of every options struct that holds one of these
// values (ServeOptions, SchedulerOptions, FakeModelOptions, LlamaBackendOptions,
// MemoryPlanRequest, ChainOptions) read it; no default is written anywhere else. The table is
// constexpr, so every one of those headers can use it in member initializers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dgr::worker {

enum class OptionKind : uint8_t {
    kFlag,   // no value; present: true
    kU32,    // non-negative integer, at most 2^32-1
    kU64,    // non-negative integer
    kI32,    // integer (may be negative where min allows it)
    kReal,   // non-negative number
    kText,   // any text
    kRange,  // A:B with A < B (a layer range)
};

// One id per row of kOptionTable, in table order.
enum class Opt : uint8_t {
    kFakeModel, kModel, kLayers, kNLayer, kNEmbd, kNVocab, kFakeDelayMs, kFakeRowDelayUs,
    kFakeDeviceClass, kFakeDeviceMemoryMb, kFakeDeviceNeedMb,
    kListen, kAllowRemote, kTlsCert, kTlsKey, kTlsClientCa, kRequireClientAuth,
    kThreads, kNGpuLayers, kMaxSessions, kCtxPerSession, kKvCells, kKvBudgetMb, kMemoryBudgetMb, kKvUnified,
    kQueueLimit, kMaxBatchTokens, kMaxPrefillChunk, kPipelineGroups, kKeepWarmMs, kMaxMessageBytes,
    kSessionTtlS, kEvictIdleS, kDrainTimeoutS, kMetricsListen, kFingerprint, kArtifactId, kRecipeJson,
    kChainPeers, kIoNice, kChainTlsCa, kProbeBudgetS,
    kCount
};

struct OptionSpec {
    Opt id = Opt::kCount;
    const char * name = "";        // the flag without its leading "--"
    OptionKind kind = OptionKind::kFlag;
    const char * metavar = "";     // what the usage calls the value ("N", "FILE"); "" for a flag
    double value = 0;              // the default of a number kind (exact for every integer default)
    const char * text = "";        // the default of kText
    const char * shown = nullptr;  // how the usage says a default that is not the plain value ("all")
    // bounds of a number kind beyond its type's (an unsigned kind is >= 0 and fits its width),
    // checked when parsed
    bool has_min = false, has_max = false;
    double min = 0, max = 0;
    const char * min_note = "";    // what the smallest value means, said in the bounds error ("auto")
    const char * help = "";        // one line (the usage wraps it)

    constexpr OptionSpec at_least(double lo) const { OptionSpec s = *this; s.has_min = true; s.min = lo; return s; }
    constexpr OptionSpec at_most(double hi) const { OptionSpec s = *this; s.has_max = true; s.max = hi; return s; }
    constexpr OptionSpec within(double lo, double hi, const char * note = "") const {
        OptionSpec s = at_least(lo).at_most(hi);
        s.min_note = note;
        return s;
    }
    constexpr OptionSpec showing(const char * how) const { OptionSpec s = *this; s.shown = how; return s; }
};

namespace option_rows {
constexpr OptionSpec row(Opt id, const char * name, OptionKind kind, const char * metavar, double value,
                         const char * help) {
    OptionSpec s;
    s.id = id;
    s.name = name;
    s.kind = kind;
    s.metavar = metavar;
    s.value = value;
    s.help = help;
    if (kind == OptionKind::kI32) s = s.at_least(0);  // an integer option is non-negative unless it says
    return s;
}
constexpr OptionSpec flag(Opt id, const char * name, const char * help) {
    return row(id, name, OptionKind::kFlag, "", 0, help);
}
constexpr OptionSpec u32(Opt id, const char * name, const char * metavar, double def, const char * help) {
    return row(id, name, OptionKind::kU32, metavar, def, help);
}
constexpr OptionSpec u64(Opt id, const char * name, const char * metavar, double def, const char * help) {
    return row(id, name, OptionKind::kU64, metavar, def, help);
}
constexpr OptionSpec i32(Opt id, const char * name, const char * metavar, double def, const char * help) {
    return row(id, name, OptionKind::kI32, metavar, def, help);
}
constexpr OptionSpec real(Opt id, const char * name, const char * metavar, double def, const char * help) {
    return row(id, name, OptionKind::kReal, metavar, def, help);
}
constexpr OptionSpec text(Opt id, const char * name, const char * metavar, const char * def, const char * help) {
    OptionSpec s = row(id, name, OptionKind::kText, metavar, 0, help);
    s.text = def;
    return s;
}
constexpr OptionSpec range(Opt id, const char * name, const char * metavar, const char * help) {
    return row(id, name, OptionKind::kRange, metavar, 0, help);
}
}  // namespace option_rows

// The table. Its order is the usage's order; every Opt names its own row (checked below).
inline constexpr OptionSpec kOptionTable[] = {
    option_rows::flag(Opt::kFakeModel, "fake-model", "deterministic arithmetic model (tests; no GGUF)"),
    option_rows::text(Opt::kModel, "model", "FILE", "", "GGUF file (whole model, or a slice with the range patches)"),
    option_rows::range(Opt::kLayers, "layers", "A:B", "layer range served (a slice: its own)").showing("all"),
    option_rows::u32(Opt::kNLayer, "n-layer", "N", 8, "fake model: number of layers").at_least(1),
    option_rows::u32(Opt::kNEmbd, "n-embd", "E", 8, "fake model: embedding width").at_least(1),
    option_rows::u32(Opt::kNVocab, "n-vocab", "V", 320, "fake model: vocabulary size").at_least(258),
    option_rows::u32(Opt::kFakeDelayMs, "fake-delay-ms", "N", 0, "fake model: sleep N ms per decode call (tests)"),
    option_rows::u32(Opt::kFakeRowDelayUs, "fake-row-delay-us", "N", 0,
                     "fake model: and N us per row of the call (a batch-size cost)"),
    option_rows::text(Opt::kFakeDeviceClass, "fake-device-class", "CLASS", "cpu",
                      "fake model: the device class GetCapability reports (1..64 characters of a-z 0-9 : _ . -; "
                      "docs/backends.md)"),
    option_rows::u64(Opt::kFakeDeviceMemoryMb, "fake-device-memory-mb", "N", 0,
                     "fake model: the fake device's total and free memory in MiB; 0: the host's RAM figures")
        .within(0, 16777216, "the host's RAM"),
    option_rows::u64(Opt::kFakeDeviceNeedMb, "fake-device-need-mb", "N", 0,
                     "fake model: what device admission predicts the range needs on its device, in MiB; "
                     "refused at start when above a non-zero --fake-device-memory-mb")
        .within(0, 16777216),
    option_rows::text(Opt::kListen, "listen", "HOST:PORT", "127.0.0.1:50151", "gRPC address; port 0 picks a free port"),
    option_rows::flag(Opt::kAllowRemote, "allow-remote", "allow a non-loopback --listen without TLS"),
    option_rows::text(Opt::kTlsCert, "tls-cert", "F", "", "serve TLS with this PEM certificate (and --tls-key)"),
    option_rows::text(Opt::kTlsKey, "tls-key", "F", "", "the PEM key of --tls-cert"),
    option_rows::text(Opt::kTlsClientCa, "tls-client-ca", "F", "",
                      "require client certs signed by this CA (mTLS) on every connection (health and reflection "
                      "included)"),
    option_rows::flag(Opt::kRequireClientAuth, "require-client-auth",
                      "with --tls-client-ca: every ShardRuntimeService RPC needs a verified client cert "
                      "(UNAUTHENTICATED otherwise); health and reflection stay open to TLS clients without one"),
    option_rows::i32(Opt::kThreads, "threads", "N", 0, "compute threads; 0: the CPUs this process may run on (its affinity mask)"),
    option_rows::i32(Opt::kNGpuLayers, "n-gpu-layers", "N", -1, "layers offloaded to an accelerator; -1: all")
        .at_least(-1),
    option_rows::u32(Opt::kMaxSessions, "max-sessions", "N", 16, "concurrent sessions (llama sequences)")
        .within(1, 256),
    option_rows::u32(Opt::kCtxPerSession, "ctx-per-session", "N", 2048, "most positions one session may hold")
        .at_least(1),
    option_rows::u64(Opt::kKvCells, "kv-cells", "N", 0,
                     "KV cells shared by all sessions (0: max-sessions*ctx-per-session, capped 65536)"),
    option_rows::real(Opt::kKvBudgetMb, "kv-budget-mb", "M", 0,
                      "KV budget in MiB (converted to cells for the model); 0: none"),
    option_rows::real(Opt::kMemoryBudgetMb, "memory-budget-mb", "M", 0,
                      "what the shard may hold: weights + KV + compute; checked before loading, with the "
                      "cgroup's memory.max (the smaller wins): a range that does not fit is refused, saying what "
                      "would (docs/memory.md); 0: the cgroup's only"),
    option_rows::flag(Opt::kKvUnified, "kv-unified",
                      "llama: one KV cell pool shared by all sessions (default: one stream per session, kv cells "
                      "/ max sessions each, exact batching)"),
    option_rows::u32(Opt::kQueueLimit, "queue-limit", "K", 64, "frames received and not yet answered").at_least(1),
    option_rows::u32(Opt::kMaxBatchTokens, "max-batch-tokens", "N", 512, "rows per decode call").at_least(1),
    option_rows::u32(Opt::kMaxPrefillChunk, "max-prefill-chunk", "N", 256, "rows per PREFILL step").at_least(1),
    option_rows::u32(Opt::kPipelineGroups, "pipeline-groups", "N", 0,
                     "chained head: split the decode rows of its sessions into N groups, so that each Shard of "
                     "the route computes one group while the next Shard computes another (0: auto = one group "
                     "per Shard when the route leaves this host, off when every hop is local; 1: off)")
        .within(0, 16, "auto"),
    option_rows::u32(Opt::kKeepWarmMs, "keep-warm-ms", "N", 0,
                     "after each batch keep the worker's cores awake for N ms with lowest-priority (SCHED_IDLE) "
                     "busy loops, one per compute thread, so that the next row does not wait for an idle core to "
                     "wake (a route's Shard idles while the others compute); costs power; 0: off")
        .within(0, 10000, "off"),
    option_rows::u64(Opt::kMaxMessageBytes, "max-message-bytes", "N", 64.0 * 1024 * 1024, "gRPC message limit")
        .at_least(1).showing("64 MiB"),
    option_rows::real(Opt::kSessionTtlS, "session-ttl-s", "S", 600, "evict sessions idle this long"),
    option_rows::real(Opt::kEvictIdleS, "evict-idle-s", "S", 30,
                      "under pressure, LRU sessions idle this long may be evicted"),
    option_rows::real(Opt::kDrainTimeoutS, "drain-timeout-s", "S", 10,
                      "SIGTERM: wait this long for sessions to end"),
    option_rows::text(Opt::kMetricsListen, "metrics-listen", "HOST:PORT", "", "Prometheus text on GET /metrics")
        .showing("off"),
    option_rows::text(Opt::kFingerprint, "fingerprint", "HEX", "",
                      "recipe fingerprint to serve (dgr.recipe; the worker proves it from the file)")
        .showing("computed from the file"),
    option_rows::text(Opt::kArtifactId, "artifact-id", "HEX", "", "artifact id to serve (proved from the file)")
        .showing("computed from the file"),
    option_rows::text(Opt::kRecipeJson, "recipe-json", "JSON", "", "recipe to serve (common/identity.h)")
        .showing("computed from the file"),
    option_rows::text(Opt::kChainPeers, "chain-peers", "H1,H2", "127.0.0.1,localhost,::1",
                      "hosts a chained session may forward to (StepFrame.downstream); '*' any"),
    option_rows::u32(Opt::kIoNice, "io-nice", "N", 10,
                     "nice value of the gRPC and other non-compute threads, so that they yield the cores to "
                     "llama_decode; 0: off")
        .within(0, 19),
    option_rows::text(Opt::kChainTlsCa, "chain-tls-ca", "F", "",
                      "verify downstream workers with this CA (TLS; the worker's --tls-cert/--tls-key is presented "
                      "as client identity)"),
    option_rows::real(Opt::kProbeBudgetS, "probe-budget-s", "S", 0,
                      "at start-up, measure what the range costs here within S seconds and report it in "
                      "GetCapability (route planning; docs/worker.md, Measured capability), reusing a cached "
                      "probe of the same artifact, range, backend and threads; 0: off")
        .within(0, 600, "off"),
};

inline constexpr size_t kOptionCount = sizeof(kOptionTable) / sizeof(kOptionTable[0]);

constexpr bool option_table_in_order() {
    if (kOptionCount != (size_t) Opt::kCount) return false;
    for (size_t i = 0; i < kOptionCount; ++i) {
        if ((size_t) kOptionTable[i].id != i) return false;
    }
    return true;
}
static_assert(option_table_in_order(), "kOptionTable: one row per Opt, in Opt order");

constexpr const OptionSpec & option_spec(Opt id) { return kOptionTable[(size_t) id]; }

// Typed defaults, for member initializers (constexpr, so a wrong kind fails to compile).
constexpr uint32_t default_u32(Opt id) {
    return option_spec(id).kind == OptionKind::kU32 ? (uint32_t) option_spec(id).value
                                                    : throw "default_u32: not a kU32 option";
}
constexpr uint64_t default_u64(Opt id) {
    return option_spec(id).kind == OptionKind::kU64 ? (uint64_t) option_spec(id).value
                                                    : throw "default_u64: not a kU64 option";
}
constexpr int32_t default_i32(Opt id) {
    return option_spec(id).kind == OptionKind::kI32 ? (int32_t) option_spec(id).value
                                                    : throw "default_i32: not a kI32 option";
}
constexpr double default_real(Opt id) {
    return option_spec(id).kind == OptionKind::kReal ? option_spec(id).value : throw "default_real: not a kReal option";
}
constexpr const char * default_text(Opt id) {
    return option_spec(id).kind == OptionKind::kText ? option_spec(id).text : throw "default_text: not a kText option";
}

// ---- option_table.cpp ----

// One parsed value (the field that holds it depends on the kind).
struct OptionValue {
    std::string text;    // as given
    double number = 0;   // kReal, and every integer kind
    uint64_t u64 = 0;    // kU32, kU64 (and a non-negative kI32)
    int64_t i64 = 0;     // kI32
    uint32_t start = 0, end = 0;  // kRange
};

// The row of "--name" (nullptr: not an option).
const OptionSpec * find_option(const std::string & flag);
// Parses one value of s; false: *err says why, naming the flag and the value ("--io-nice wants
// 0 .. 19, got '20'").
bool parse_option_value(const OptionSpec & s, const char * value, OptionValue * out, std::string * err);
// The bounds a number kind is checked against (its type's where the table names none; hi may be
// HUGE_VAL); false for the other kinds.
bool option_bounds(const OptionSpec & s, double * lo, double * hi);
// The default as the usage says it ("16", "all", "64 MiB"; "" where there is none to say).
std::string option_default_text(const OptionSpec & s);
// The default as a value the parser takes ("" for a flag or a range: they have none).
std::string option_value_text(const OptionSpec & s);
// Every option, one per entry with its help, bounds and default, under first_line.
std::string options_usage(const char * first_line);
// The table as one JSON object: {"options": [{name, flag, kind, metavar, default, min, max,
// default_text, help}, ...]} (min/max: null where none).
std::string options_json();
// The hosts of a --chain-peers list: split at commas, [v6] brackets dropped, lower-cased.
std::vector<std::string> split_peer_list(const std::string & list);
// `dgr-worker options [--json]`.
int options_main(int argc, char ** argv);

}  // namespace dgr::worker
