#include "worker/serve.h"

#include "common/identity.h"
#include "version.h"
#include "worker/fake_backend.h"
#include "worker/llama_backend.h"
#include "worker/metrics.h"
#include "worker/scheduler.h"
#include "worker/service.h"

#include "llama.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

namespace dgr::worker {

namespace {

struct ServeOptions {
    bool fake = false;
    std::string model;
    bool has_layers = false;
    uint32_t layer_start = 0, layer_end = 0;
    uint32_t n_layer = 8, n_embd = 8, n_vocab = 320;  // fake model shape
    uint32_t fake_delay_ms = 0;
    std::string listen = "127.0.0.1:50151";
    bool allow_remote = false;
    bool kv_unified = false;
    std::string tls_cert, tls_key, tls_client_ca;
    int32_t threads = 0;
    int32_t n_gpu_layers = -1;
    uint32_t max_sessions = 16;
    uint32_t ctx_per_session = 2048;
    uint64_t kv_cells = 0;
    double kv_budget_mb = 0;
    double memory_budget_mb = 0;
    uint32_t queue_limit = 64;
    uint32_t max_batch_tokens = 512;
    uint32_t max_prefill_chunk = 256;
    uint64_t max_message_bytes = 64ull << 20;
    double session_ttl_s = 600, evict_idle_s = 30, drain_timeout_s = 10;
    std::string metrics_listen;
    std::string fingerprint, artifact_id, recipe_json;
    std::string chain_peers = "127.0.0.1,localhost,::1";
    std::string chain_tls_ca;
    uint32_t io_nice = 10;
};

void usage() {
    std::printf(
        "usage: dgr-worker serve (--fake-model | --model FILE) [options]\n"
        "  --fake-model              deterministic arithmetic model (tests; no GGUF)\n"
        "  --model FILE              GGUF file (whole model, or a slice with the range patches)\n"
        "  --layers A:B              layer range served (default: all)\n"
        "  --n-layer N --n-embd E --n-vocab V   fake model shape (default 8, 8, 320)\n"
        "  --fake-delay-ms N         fake model: sleep N ms per decode call (tests)\n"
        "  --listen HOST:PORT        default 127.0.0.1:50151; port 0 picks a free port\n"
        "  --allow-remote            allow a non-loopback --listen without TLS\n"
        "  --tls-cert F --tls-key F  serve TLS; --tls-client-ca F: require client certs (mTLS)\n"
        "  --threads N               compute threads (llama.cpp)\n"
        "  --n-gpu-layers N          layers offloaded to an accelerator (llama.cpp default: all)\n"
        "  --max-sessions N          concurrent sessions (llama sequences), default 16\n"
        "  --ctx-per-session N       most positions one session may hold, default 2048\n"
        "  --kv-cells N              KV cells shared by all sessions (default max-sessions*ctx-per-session, capped 65536)\n"
        "  --kv-budget-mb M          KV budget in MiB (converted to cells for the model)\n"
        "  --memory-budget-mb M      everything the shard holds: weights + compute scratch + KV;\n"
        "                            the KV cells are cut to what remains (refuses to start if nothing)\n"
        "  --kv-unified              llama: one KV cell pool shared by all sessions (default: one\n"
        "                            stream per session, kv cells / max sessions each, exact batching)\n"
        "  --queue-limit K           frames received and not yet answered, default 64\n"
        "  --max-batch-tokens N      rows per decode call, default 512\n"
        "  --max-prefill-chunk N     rows per PREFILL step, default 256\n"
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

bool is_loopback(const std::string & listen) {
    const size_t colon = listen.rfind(':');
    std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
    if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
    return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

std::string read_file(const std::string & path, bool * ok) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    *ok = (bool) f;
    return ss.str();
}

int parse(int argc, char ** argv, ServeOptions * o) {
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
        else if (a == "--listen") ok = str(&o->listen);
        else if (a == "--allow-remote") o->allow_remote = true;
        else if (a == "--kv-unified") o->kv_unified = true;
        else if (a == "--tls-cert") ok = str(&o->tls_cert);
        else if (a == "--tls-key") ok = str(&o->tls_key);
        else if (a == "--tls-client-ca") ok = str(&o->tls_client_ca);
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

}  // namespace

int serve_main(int argc, char ** argv) {
    ServeOptions o;
    const int rc = parse(argc, argv, &o);
    if (rc >= 0) return rc;

    // Signals are taken by one watcher thread (sigwait); block them before any thread starts.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

    uint64_t kv_cells = o.kv_cells ? o.kv_cells : std::min<uint64_t>((uint64_t) o.max_sessions * o.ctx_per_session, 65536);
    std::unique_ptr<ModelBackend> backend;
    std::string err;
    if (o.fake) {
        FakeModelOptions f;
        f.n_layer = o.n_layer;
        f.layer_start = o.has_layers ? o.layer_start : 0;
        f.layer_end = o.has_layers ? o.layer_end : o.n_layer;
        if (f.layer_end > f.n_layer || f.n_embd == 0 || o.n_vocab < 258) {
            std::fprintf(stderr, "dgr-worker: error: fake model: --layers must fit --n-layer; --n-vocab >= 258\n");
            return 2;
        }
        f.n_embd = o.n_embd;
        f.n_vocab = o.n_vocab;
        if (o.kv_budget_mb > 0 && !o.kv_cells) {
            // fake KV: n_embd floats per owned layer per cell
            const double cell = 4.0 * f.n_embd * (f.layer_end - f.layer_start);
            kv_cells = (uint64_t) (o.kv_budget_mb * 1048576.0 / cell);
        }
        f.kv_cells = (uint32_t) kv_cells;
        f.n_seq_max = o.max_sessions;
        f.max_batch_tokens = o.max_batch_tokens;
        f.decode_delay_ms = o.fake_delay_ms;
        backend = std::make_unique<FakeBackend>(f);
        const uint64_t budget = (uint64_t) (o.memory_budget_mb * 1048576.0);
        if (budget && backend->info().kv_bytes > budget) {
            const double cell = 4.0 * f.n_embd * (f.layer_end - f.layer_start);
            kv_cells = (uint64_t) ((double) budget / cell);
            f.kv_cells = (uint32_t) kv_cells;
            backend = std::make_unique<FakeBackend>(f);
        }
    } else {
        if (o.fingerprint.empty() || o.artifact_id.empty()) {
            // No identity given (`dgr worker serve` passes one): compute the real one, equal to
            // dgr.identity.identify + dgr.recipe.recipe_for (common/identity.h). Unreadable file,
            // architecture without an adapter, ...: refuse to start.
            dgr::LocalRecipe r;
            const auto log = [](const std::string & line) { std::fprintf(stderr, "dgr-worker: %s\n", line.c_str()); };
            const auto t0 = std::chrono::steady_clock::now();
            if (!dgr::local_recipe_for(o.model, &r, &err, log)) {
                std::fprintf(stderr, "dgr-worker: error: cannot compute the artifact identity: %s\n", err.c_str());
                return 2;
            }
            if (!r.identity.slice) {
                std::fprintf(stderr, "dgr-worker: artifact id %s (%.2f s)\n", r.identity.artifact_id.c_str(),
                             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
            }
            if (o.artifact_id.empty()) o.artifact_id = r.identity.artifact_id;
            if (o.fingerprint.empty()) o.fingerprint = r.fingerprint;
            if (o.recipe_json.empty()) o.recipe_json = r.recipe_json;
        }
        llama_backend_init();
        if (o.kv_budget_mb > 0 && !o.kv_cells) {
            const uint64_t per_cell = llama_kv_bytes_per_cell(o.model, o.has_layers ? o.layer_start : 0,
                                                              o.has_layers ? o.layer_end : 0, &err);
            if (!per_cell) {
                std::fprintf(stderr, "dgr-worker: error: %s\n", err.c_str());
                return 1;
            }
            kv_cells = (uint64_t) (o.kv_budget_mb * 1048576.0 / (double) per_cell);
        }
        if (!o.kv_unified) {
            // one stream per session: every session gets the same share
            uint64_t per = o.kv_cells || o.kv_budget_mb > 0 ? kv_cells / o.max_sessions : o.ctx_per_session;
            per = (per + 255) / 256 * 256;  // llama.cpp pads each stream to 256 cells
            o.ctx_per_session = (uint32_t) std::min<uint64_t>(o.ctx_per_session, per);
            kv_cells = per * o.max_sessions;
        }
        LlamaBackendOptions l;
        l.kv_unified = o.kv_unified;
        l.path = o.model;
        l.layer_start = o.has_layers ? o.layer_start : 0;
        l.layer_end = o.has_layers ? o.layer_end : 0;
        l.threads = o.threads;
        l.kv_cells = (uint32_t) kv_cells;
        l.n_seq_max = o.max_sessions;
        l.max_batch_tokens = o.max_batch_tokens;
        l.n_gpu_layers = o.n_gpu_layers;
        l.fingerprint = o.fingerprint;
        l.artifact_id = o.artifact_id;
        backend = LlamaBackend::create(l, &err);
        if (!backend) {
            std::fprintf(stderr, "dgr-worker: error: %s\n", err.c_str());
            return 1;
        }
        // --memory-budget-mb: weights and scratch are what they are; the KV cache gets the rest
        const uint64_t budget = (uint64_t) (o.memory_budget_mb * 1048576.0);
        for (int round = 0; budget && round < 3; ++round) {
            const BackendInfo & in = backend->info();
            const uint64_t fixed = in.weight_bytes + in.scratch_bytes;
            const double mib = 1.0 / 1048576.0;
            if (fixed >= budget) {
                std::fprintf(stderr,
                             "dgr-worker: error: the weights (%.1f MiB) and compute scratch (%.1f MiB) of layers [%u, %u) "
                             "leave nothing of --memory-budget-mb %.1f for the KV cache\n",
                             in.weight_bytes * mib, in.scratch_bytes * mib, in.layer_start, in.layer_end, o.memory_budget_mb);
                return 2;
            }
            if (fixed + in.kv_bytes <= budget) break;
            const uint64_t per_cell = std::max<uint64_t>(1, in.kv_bytes / std::max<uint64_t>(1, in.kv_cells));
            uint64_t cells = (budget - fixed) / per_cell;
            if (!o.kv_unified) {
                const uint64_t per = cells / o.max_sessions / 256 * 256;  // llama.cpp: 256-cell streams
                if (per == 0) {
                    std::fprintf(stderr,
                                 "dgr-worker: error: --memory-budget-mb %.1f leaves %.1f MiB for the KV cache: fewer than 256 "
                                 "cells per session for %u sessions; lower --max-sessions or raise the budget\n",
                                 o.memory_budget_mb, (budget - fixed) * mib, o.max_sessions);
                    return 2;
                }
                o.ctx_per_session = (uint32_t) std::min<uint64_t>(o.ctx_per_session, per);
                cells = per * o.max_sessions;
            }
            std::fprintf(stderr, "dgr-worker: memory budget %.1f MiB: weights %.1f + scratch %.1f MiB; KV cut to %llu cells\n",
                         o.memory_budget_mb, in.weight_bytes * mib, in.scratch_bytes * mib, (unsigned long long) cells);
            kv_cells = cells;
            l.kv_cells = (uint32_t) cells;
            backend.reset();
            backend = LlamaBackend::create(l, &err);
            if (!backend) {
                std::fprintf(stderr, "dgr-worker: error: %s\n", err.c_str());
                return 1;
            }
        }
    }
    backend->set_identity(o.fingerprint, o.artifact_id, o.recipe_json);
    if (kv_cells == 0) {
        std::fprintf(stderr, "dgr-worker: error: the KV budget is zero cells\n");
        return 2;
    }

    Metrics metrics;
    SchedulerOptions so;
    so.max_sessions = o.max_sessions;
    so.max_session_positions = o.ctx_per_session;
    so.kv_cells = kv_cells;
    so.queue_limit = o.queue_limit;
    so.max_batch_tokens = o.max_batch_tokens;
    so.max_prefill_chunk_tokens = o.max_prefill_chunk;
    so.max_message_bytes = o.max_message_bytes;
    so.session_ttl_s = o.session_ttl_s;
    so.evict_idle_s = o.evict_idle_s;
    so.memory_budget_bytes = (uint64_t) (o.memory_budget_mb * 1048576.0);
    so.chain.peers.clear();
    {
        std::stringstream ss(o.chain_peers);
        std::string item;
        while (std::getline(ss, item, ',')) {
            if (item.size() > 1 && item.front() == '[' && item.back() == ']') item = item.substr(1, item.size() - 2);
            for (auto & c : item) c = (char) std::tolower((unsigned char) c);
            if (!item.empty()) so.chain.peers.push_back(item);
        }
    }
    so.chain.max_message_bytes = o.max_message_bytes;
    if (!o.chain_tls_ca.empty()) {
        bool ok1 = true, ok2 = true, ok3 = true;
        so.chain.tls_ca_pem = read_file(o.chain_tls_ca, &ok1);
        if (!o.tls_cert.empty()) {
            so.chain.tls_cert_pem = read_file(o.tls_cert, &ok2);
            so.chain.tls_key_pem = read_file(o.tls_key, &ok3);
        }
        if (!ok1 || !ok2 || !ok3) {
            std::fprintf(stderr, "dgr-worker: error: cannot read --chain-tls-ca/--tls-cert/--tls-key\n");
            return 2;
        }
    }
    Scheduler scheduler(*backend, metrics, so);
    const auto & b = dgr::build_info();

    // The scheduler thread computes (llama_decode and the OpenMP team it starts): start it at this
    // thread's priority, then lower this thread's (Linux nice is per thread and inherited), so
    // that every thread gRPC creates from here on, and the signal and metrics threads, yield the
    // cores to the compute threads. Measured on 2 cores with two co-located shards, SmolLM2
    // 0:15|15:30, one session: decode +7 % at nice 10 (+11 % at 19); without it, gRPC's threads
    // wake on the cores a half-model graph is running on and stall its per-op barriers.
    scheduler.start();
    if (o.io_nice > 0) {
        errno = 0;
        if (setpriority(PRIO_PROCESS, (id_t) syscall(SYS_gettid), (int) o.io_nice) != 0) {
            std::fprintf(stderr, "dgr-worker: warning: cannot lower the gRPC threads' priority: %s\n", std::strerror(errno));
        }
    }
    // its delivery thread starts here, at --io-nice too
    ShardService service(*backend, scheduler, metrics, ServiceInfo{b.dgr_version, b.pin_commit, b.patch_digest, b.backend});
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    std::shared_ptr<grpc::ServerCredentials> creds;
    if (!o.tls_cert.empty()) {
        bool ok1 = false, ok2 = false, ok3 = true;
        grpc::SslServerCredentialsOptions ssl(o.tls_client_ca.empty()
                                                  ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
        grpc::SslServerCredentialsOptions::PemKeyCertPair pair{read_file(o.tls_key, &ok1), read_file(o.tls_cert, &ok2)};
        ssl.pem_key_cert_pairs.push_back(pair);
        if (!o.tls_client_ca.empty()) ssl.pem_root_certs = read_file(o.tls_client_ca, &ok3);
        if (!ok1 || !ok2 || !ok3) {
            std::fprintf(stderr, "dgr-worker: error: cannot read the TLS key/cert/CA files\n");
            return 2;
        }
        creds = grpc::SslServerCredentials(ssl);
    } else {
        creds = grpc::InsecureServerCredentials();
    }
    int port = 0;
    builder.AddListeningPort(o.listen, creds, &port);
    builder.RegisterService(&service);
    builder.SetMaxReceiveMessageSize((int) std::min<uint64_t>(o.max_message_bytes, INT32_MAX));
    builder.SetMaxSendMessageSize((int) std::min<uint64_t>(o.max_message_bytes, INT32_MAX));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, (int) std::max<uint32_t>(64, o.max_sessions * 4));
    grpc::ResourceQuota quota("dgr-worker");
    quota.Resize((size_t) 512 << 20);  // bounds gRPC's own buffers under a flood
    builder.SetResourceQuota(quota);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server || port == 0) {
        std::fprintf(stderr, "dgr-worker: error: cannot listen on %s\n", o.listen.c_str());
        return 1;
    }
    auto * health = server->GetHealthCheckService();
    health->SetServingStatus(true);
    health->SetServingStatus("dgr.shard.v1.ShardRuntimeService", true);

    MetricsHttpServer http;
    if (!o.metrics_listen.empty()) {
        if (!is_loopback(o.metrics_listen) && !o.allow_remote) {
            std::fprintf(stderr, "dgr-worker: error: refusing non-loopback --metrics-listen without --allow-remote\n");
            scheduler.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "startup failed"));
            server->Shutdown();
            return 2;
        }
        if (!http.start(o.metrics_listen, [&service] { return service.prometheus_text(); }, &err)) {
            std::fprintf(stderr, "dgr-worker: error: %s\n", err.c_str());
            scheduler.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "startup failed"));
            server->Shutdown();
            return 1;
        }
    }
    const BackendInfo & in = backend->info();
    const std::string host = o.listen.substr(0, o.listen.rfind(':'));
    std::printf("dgr-worker: listening on %s:%d\n", host.c_str(), port);
    if (http.port()) std::printf("dgr-worker: metrics on %s:%d/metrics\n",
                                 o.metrics_listen.substr(0, o.metrics_listen.rfind(':')).c_str(), http.port());
    std::printf("dgr-worker: serving %s layers [%u, %u) of %u%s%s, fingerprint %s, max sessions %u, kv cells %llu\n",
                in.architecture.c_str(), in.layer_start, in.layer_end, in.n_layer, in.head ? " head" : "",
                in.tail ? " tail" : "", in.fingerprint.c_str(), scheduler.options().max_sessions,
                (unsigned long long) scheduler.options().kv_cells);
    std::fflush(stdout);

    std::thread watcher([&] {
        int sig = 0;
        sigwait(&sigs, &sig);
        std::fprintf(stderr, "dgr-worker: signal %d: NOT_SERVING, draining (deadline %.1fs)\n", sig, o.drain_timeout_s);
        health->SetServingStatus(false);
        health->SetServingStatus("dgr.shard.v1.ShardRuntimeService", false);
        scheduler.set_draining();
        service.set_draining();
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(o.drain_timeout_s);
        while (scheduler.active_sessions() > 0 && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
        const uint32_t left = scheduler.active_sessions();
        scheduler.stop(grpc::Status(grpc::StatusCode::UNAVAILABLE, "worker shut down"));
        std::fprintf(stderr, "dgr-worker: drained (%u sessions ended by the deadline); shutting down\n", left);
        server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    });
    server->Wait();
    watcher.join();
    http.stop();
    backend.reset();
    if (!o.fake) llama_backend_free();
    std::fprintf(stderr, "dgr-worker: exit 0\n");
    return 0;
}

}  // namespace dgr::worker
