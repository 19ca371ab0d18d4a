#include "worker/serve_options.h"

#include "common/net_address.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace dgr::worker {

namespace {

void usage() {
    std::printf(
        "usage: dgr-worker serve (--fake-model | --model FILE) [options]\n"
        "  --fake-model              deterministic arithmetic model (tests; no GGUF)\n"
        "  --model FILE              GGUF file (whole model, or a slice with the range patches)\n"
        "  --layers A:B              layer range served (default: all; a slice: its own)\n"
        "  --n-layer N --n-embd E --n-vocab V   fake model shape (default 8, 8, 320)\n"
        "  --fake-delay-ms N         fake model: sleep N ms per decode call (tests)\n"
        "  --fake-row-delay-us N     fake model: and N us per row of the call (a batch-size cost)\n"
        "  --listen HOST:PORT        default 127.0.0.1:50151; port 0 picks a free port\n"
        "  --allow-remote            allow a non-loopback --listen without TLS\n"
        "  --tls-cert F --tls-key F  serve TLS; --tls-client-ca F: require client certs (mTLS) on\n"
        "                            every connection (health and reflection included)\n"
        "  --require-client-auth     with --tls-client-ca: every ShardRuntimeService RPC needs a verified\n"
        "                            client cert (UNAUTHENTICATED otherwise); health and reflection stay\n"
        "                            open to TLS clients without one\n"
        "  --threads N               compute threads (llama.cpp)\n"
        "  --n-gpu-layers N          layers offloaded to an accelerator (llama.cpp default: all)\n"
        "  --max-sessions N          concurrent sessions (llama sequences), default 16\n"
        "  --ctx-per-session N       most positions one session may hold, default 2048\n"
        "  --kv-cells N              KV cells shared by all sessions (default max-sessions*ctx-per-session, capped 65536)\n"
        "  --kv-budget-mb M          KV budget in MiB (converted to cells for the model)\n"
        "  --memory-budget-mb M      what the shard may hold: weights + KV + compute; checked before\n"
        "                            loading, with the cgroup's memory.max (the smaller wins): a range\n"
        "                            that does not fit is refused, saying what would (docs/memory.md)\n"
        "  --kv-unified              llama: one KV cell pool shared by all sessions (default: one\n"
        "                            stream per session, kv cells / max sessions each, exact batching)\n"
        "  --queue-limit K           frames received and not yet answered, default 64\n"
        "  --max-batch-tokens N      rows per decode call, default 512\n"
        "  --max-prefill-chunk N     rows per PREFILL step, default 256\n"
        "  --pipeline-groups N       chained head: split the decode rows of its sessions into N groups,\n"
        "                            so that each Shard of the route computes one group while the next\n"
        "                            Shard computes another (0: auto = one group per Shard when the route\n"
        "                            leaves this host, off when every hop is local; 1: off; at most 16)\n"
        "  --keep-warm-ms N          after each batch keep the worker's cores awake for N ms with\n"
        "                            lowest-priority (SCHED_IDLE) busy loops, one per compute thread,\n"
        "                            so that the next row does not wait for an idle core to wake (a\n"
        "                            route's Shard idles while the others compute); costs power;\n"
        "                            0: off (default), at most 10000\n"
        "  --max-message-bytes N     gRPC message limit, default 64 MiB\n"
        "  --session-ttl-s S         evict sessions idle this long, default 600\n"
        "  --evict-idle-s S          under pressure, LRU sessions idle this long may be evicted, default 30\n"
        "  --drain-timeout-s S       SIGTERM: wait this long for sessions to end, default 10\n"
        "  --metrics-listen HOST:PORT  Prometheus text on GET /metrics\n"
        "  --fingerprint HEX --artifact-id HEX --recipe-json JSON  identity to serve (dgr.recipe;\n"
        "                            default: computed from the file, common/identity.h)\n"
        "  --chain-peers H1,H2       hosts a chained session may forward to (StepFrame.downstream);\n"
        "                            '*' any; default 127.0.0.1,localhost,::1\n"
        "  --io-nice N               nice value (0-19) of the gRPC and other non-compute threads, so that\n"
        "                            they yield the cores to llama_decode; 0: off; default 10\n"
        "  --chain-tls-ca F          verify downstream workers with this CA (TLS; the worker's\n"
        "                            --tls-cert/--tls-key is presented as client identity)\n");
}

bool parse_u64(const char * s, uint64_t * out) {
    char * end = nullptr;
    errno = 0;
    const unsigned long long v = std::strtoull(s, &end, 10);
    if (errno || !end || *end || s[0] == '-') return false;
    *out = v;
    return true;
}

}  // namespace

bool is_loopback(const std::string & listen) {
    const size_t colon = listen.rfind(':');
    const std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
    return host_is_loopback(host);  // parsed, or resolved with every address checked
}

std::string read_file(const std::string & path, bool * ok) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    *ok = (bool) f;
    return ss.str();
}

int parse_serve_options(int argc, char ** argv, ServeOptions * o) {
    for (int i = 0; i < argc; ++i) {
        const std::string a = argv[i];
        auto val = [&]() -> const char * {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "dgr-worker: error: %s needs a value\n", a.c_str());
                return nullptr;
            }
            return argv[++i];
        };
        auto num = [&](uint64_t * out) -> bool {
            const char * v = val();
            if (!v) return false;
            if (!parse_u64(v, out)) {
                std::fprintf(stderr, "dgr-worker: error: %s wants a non-negative integer, got '%s'\n", a.c_str(), v);
                return false;
            }
            return true;
        };
        auto num32 = [&](uint32_t * out) -> bool {
            uint64_t v;
            if (!num(&v)) return false;
            *out = (uint32_t) v;
            return true;
        };
        auto dbl = [&](double * out) -> bool {
            const char * v = val();
            if (!v) return false;
            char * end = nullptr;
            *out = std::strtod(v, &end);
            if (!end || *end || *out < 0) {
                std::fprintf(stderr, "dgr-worker: error: %s wants a non-negative number\n", a.c_str());
                return false;
            }
            return true;
        };
        auto str = [&](std::string * out) -> bool {
            const char * v = val();
            if (!v) return false;
            *out = v;
            return true;
        };
        bool ok = true;
        uint64_t u = 0;
        if (a == "--fake-model") o->fake = true;
        else if (a == "--model") ok = str(&o->model);
        else if (a == "--layers") {
            std::string v;
            ok = str(&v);
            unsigned s = 0, e = 0;
            if (ok && std::sscanf(v.c_str(), "%u:%u", &s, &e) == 2 && s < e) {
                o->has_layers = true;
                o->layer_start = s;
                o->layer_end = e;
            } else if (ok) {
                std::fprintf(stderr, "dgr-worker: error: --layers wants A:B with A < B, got '%s'\n", v.c_str());
                ok = false;
            }
        }
        else if (a == "--n-layer") ok = num32(&o->n_layer);
        else if (a == "--n-embd") ok = num32(&o->n_embd);
        else if (a == "--n-vocab") ok = num32(&o->n_vocab);
        else if (a == "--fake-delay-ms") ok = num32(&o->fake_delay_ms);
        else if (a == "--fake-row-delay-us") ok = num32(&o->fake_row_delay_us);
        else if (a == "--listen") ok = str(&o->listen);
        else if (a == "--allow-remote") o->allow_remote = true;
        else if (a == "--kv-unified") o->kv_unified = true;
        else if (a == "--tls-cert") ok = str(&o->tls_cert);
        else if (a == "--tls-key") ok = str(&o->tls_key);
        else if (a == "--tls-client-ca") ok = str(&o->tls_client_ca);
        else if (a == "--require-client-auth") o->require_client_auth = true;
        else if (a == "--threads") { ok = num(&u); o->threads = (int32_t) u; }
        else if (a == "--n-gpu-layers") { ok = num(&u); o->n_gpu_layers = (int32_t) u; }
        else if (a == "--max-sessions") ok = num32(&o->max_sessions);
        else if (a == "--ctx-per-session") ok = num32(&o->ctx_per_session);
        else if (a == "--kv-cells") ok = num(&o->kv_cells);
        else if (a == "--kv-budget-mb") ok = dbl(&o->kv_budget_mb);
        else if (a == "--memory-budget-mb") ok = dbl(&o->memory_budget_mb);
        else if (a == "--queue-limit") ok = num32(&o->queue_limit);
        else if (a == "--max-batch-tokens") ok = num32(&o->max_batch_tokens);
        else if (a == "--max-prefill-chunk") ok = num32(&o->max_prefill_chunk);
        else if (a == "--pipeline-groups") {
            ok = num32(&o->pipeline_groups);
            if (ok && o->pipeline_groups > 16) {
                std::fprintf(stderr, "dgr-worker: error: --pipeline-groups wants 0 (auto) .. 16\n");
                return 2;
            }
        }
        else if (a == "--keep-warm-ms") {
            ok = num32(&o->keep_warm_ms);
            if (ok && o->keep_warm_ms > 10000) {
                std::fprintf(stderr, "dgr-worker: error: --keep-warm-ms wants 0 (off) .. 10000\n");
                return 2;
            }
        }
        else if (a == "--max-message-bytes") ok = num(&o->max_message_bytes);
        else if (a == "--session-ttl-s") ok = dbl(&o->session_ttl_s);
        else if (a == "--evict-idle-s") ok = dbl(&o->evict_idle_s);
        else if (a == "--drain-timeout-s") ok = dbl(&o->drain_timeout_s);
        else if (a == "--metrics-listen") ok = str(&o->metrics_listen);
        else if (a == "--fingerprint") ok = str(&o->fingerprint);
        else if (a == "--artifact-id") ok = str(&o->artifact_id);
        else if (a == "--recipe-json") ok = str(&o->recipe_json);
        else if (a == "--chain-peers") ok = str(&o->chain_peers);
        else if (a == "--chain-tls-ca") ok = str(&o->chain_tls_ca);
        else if (a == "--io-nice") { ok = num32(&o->io_nice); if (ok && o->io_nice > 19) { std::fprintf(stderr, "dgr-worker: error: --io-nice wants 0..19\n"); return 2; } }
        else if (a == "--help" || a == "-h") { usage(); return 0; }
        else {
            std::fprintf(stderr, "dgr-worker: error: unknown serve option '%s'\n", a.c_str());
            usage();
            return 2;
        }
        if (!ok) return 2;
    }
    if (o->fake == !o->model.empty()) {
        std::fprintf(stderr, "dgr-worker: error: give exactly one of --fake-model or --model FILE\n");
        return 2;
    }
    if (o->max_sessions == 0 || o->max_sessions > 256 || o->queue_limit == 0 || o->max_batch_tokens == 0 ||
        o->max_prefill_chunk == 0 || o->ctx_per_session == 0) {
        std::fprintf(stderr, "dgr-worker: error: --max-sessions (1..256), --queue-limit, --max-batch-tokens, "
                             "--max-prefill-chunk and --ctx-per-session must be positive\n");
        return 2;
    }
    const bool tls = !o->tls_cert.empty() || !o->tls_key.empty();
    if (tls && (o->tls_cert.empty() || o->tls_key.empty())) {
        std::fprintf(stderr, "dgr-worker: error: TLS needs both --tls-cert and --tls-key\n");
        return 2;
    }
    if (o->require_client_auth && o->tls_client_ca.empty()) {
        std::fprintf(stderr, "dgr-worker: error: --require-client-auth needs --tls-client-ca (and --tls-cert/--tls-key)\n");
        return 2;
    }
    if (!o->tls_client_ca.empty() && !tls) {
        std::fprintf(stderr, "dgr-worker: error: --tls-client-ca (mTLS) needs --tls-cert and --tls-key\n");
        return 2;
    }
    if (!is_loopback(o->listen) && !tls && !o->allow_remote) {
        std::fprintf(stderr, "dgr-worker: error: refusing to listen on non-loopback '%s' without TLS; "
                             "give --tls-cert/--tls-key or --allow-remote\n", o->listen.c_str());
        return 2;
    }
    return -1;
}

}  // namespace dgr::worker
