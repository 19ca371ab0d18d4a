#include "worker/serve.h"


#include "common/identity.h"
#include "common/net_address.h"
#include "version.h"
#include "worker/capability_probe.h"
#include "worker/device_info.h"
#include "worker/device_plan.h"
#include "worker/fake_backend.h"
#include "worker/identity_check.h"
#include "worker/kv_budget.h"
#include "worker/llama_backend.h"
#include "worker/memory_plan.h"
#include "worker/metrics.h"
#include "worker/scheduler.h"
#include "worker/service.h"
#include "worker/serve_options.h"

#include "ggml-backend.h"
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
#include <vector>

namespace dgr::worker {

namespace {

// A dgr slice serves its own range (its dgr.slice.layer_start/layer_end pairs): without --layers
// that range is the one planned and loaded; --layers that name another range are refused (a
// slice holds only its own layers' tensors). A whole file is left as the flags say.
bool take_slice_range(ServeOptions * o, std::string * err) {
    GgufHeader g;
    if (!g.open(o->model, err)) return false;
    if (!g.is_slice()) return true;
    uint32_t start = 0, end = 0;
    if (!g.get_u32("dgr.slice.layer_start", &start) || !g.get_u32("dgr.slice.layer_end", &end) || start >= end) {
        *err = o->model + " is a dgr slice without a valid dgr.slice.layer_start/layer_end range";
        return false;
    }
    if (o->has_layers && (o->layer_start != start || o->layer_end != end)) {
        const std::string own = std::to_string(start) + ":" + std::to_string(end);
        *err = o->model + " is a slice of layers " + own +
               " (dgr.slice.layer_start/layer_end) and serves only those; --layers " + std::to_string(o->layer_start) +
               ":" + std::to_string(o->layer_end) + " names another range: drop --layers or give --layers " + own;
        return false;
    }
    o->has_layers = true;
    o->layer_start = start;
    o->layer_end = end;
    return true;
}

// The KV cells serve gives the context (--kv-cells / --kv-budget-mb / per-session streams; may
// shorten o->ctx_per_session) and the memory plan for them. llama_backend_init() first.
bool plan_for_options(ServeOptions * o, uint64_t * kv_cells, MemoryNeed * need, std::string * err) {
    *kv_cells = o->kv_cells ? o->kv_cells : default_kv_cells(o->max_sessions, o->ctx_per_session);
    if (o->kv_budget_mb > 0 && !o->kv_cells) {
        const uint64_t per_cell = llama_kv_bytes_per_cell(o->model, o->has_layers ? o->layer_start : 0,
                                                          o->has_layers ? o->layer_end : 0, err);
        if (!per_cell) return false;
        *kv_cells = cells_for_mib(o->kv_budget_mb, per_cell);
    }
    if (!o->kv_unified) {
        const StreamShare share = per_session_streams(*kv_cells, o->kv_cells || o->kv_budget_mb > 0, o->max_sessions,
                                                      o->ctx_per_session);
        o->ctx_per_session = share.ctx_per_session;
        *kv_cells = share.kv_cells;
    }
    // Memory-true admission (worker/memory_plan.h, docs/memory.md): what the range needs is
    // computed from the file(s) and llama.cpp's simulated allocations before anything is loaded.
    MemoryPlanRequest pr;
    pr.model = o->model;
    pr.layer_start = o->has_layers ? o->layer_start : 0;
    pr.layer_end = o->has_layers ? o->layer_end : 0;
    pr.max_sessions = o->max_sessions;
    pr.ctx_per_session = o->ctx_per_session;
    pr.kv_cells = *kv_cells;
    pr.kv_unified = o->kv_unified;
    pr.max_batch_tokens = o->max_batch_tokens;
    pr.n_gpu_layers = o->n_gpu_layers;
    pr.threads = o->threads;
    return plan_memory(pr, need, err);
}

}  // namespace

int plan_memory_main(int argc, char ** argv) {
    std::vector<char *> args;
    bool json = false;
    for (int i = 0; i < argc; ++i) {
        if (std::strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
            std::printf("usage: dgr-worker plan-memory --model FILE [--layers A:B] [--max-sessions N]\n"
                        "         [--ctx-per-session C] [--kv-cells N | --kv-budget-mb M] [--kv-unified]\n"
                        "         [--max-batch-tokens N] [--n-gpu-layers N] [--memory-budget-mb M] [--json]\n"
                        "  what `serve` with these options would need in host memory, computed without loading\n"
                        "  the weights (docs/memory.md), and whether its budget admits it; and what it would need\n"
                        "  on its compute device against that device's free memory (docs/backends.md);\n"
                        "  exit 0 fits, 3 does not\n");
            return 0;
        } else {
            args.push_back(argv[i]);
        }
    }
    ServeOptions o;
    const int rc = parse_serve_options((int) args.size(), args.data(), &o);
    if (rc >= 0) return rc;
    if (o.fake) {
        std::fprintf(stderr, "dgr-worker: error: plan-memory needs --model FILE\n");
        return 2;
    }
    uint64_t kv_cells = 0;
    MemoryNeed need;
    std::string err;
    if (!take_slice_range(&o, &err)) {
        std::fprintf(stderr, "dgr-worker: error: cannot plan the memory of %s: %s\n", o.model.c_str(), err.c_str());
        return 1;
    }
    take_device_census();
    llama_backend_init();
    if (!plan_for_options(&o, &kv_cells, &need, &err)) {
        std::fprintf(stderr, "dgr-worker: error: cannot plan the memory of %s: %s\n", o.model.c_str(), err.c_str());
        llama_backend_free();
        return 1;
    }
    const MemoryBudget budget = memory_budget(o.memory_budget_mb);
    const std::string refusal = admission_refusal(need, budget, o.kv_unified);
    const ComputeDevice dev = describe_device(compute_device(o.n_gpu_layers), build_info().backend);
    const std::string dev_refusal = dev.accelerator ? device_admission_refusal(need, dev) : std::string();
    if (json) {
        std::printf("%s\n", need_json(need, budget, refusal, device_need_json(need, dev, dev_refusal)).c_str());
    } else {
        std::printf("%s\n", describe_need(need).c_str());
        if (budget.bytes) std::printf("budget %.1f MiB (%s): %s\n", (double) budget.bytes / 1048576.0, budget.source.c_str(),
                                      refusal.empty() ? "fits" : refusal.c_str());
        std::printf("%s%s%s\n", describe_device_need(need, dev).c_str(), dev_refusal.empty() ? "" : ": ",
                    dev_refusal.c_str());
    }
    llama_backend_free();
    return refusal.empty() && dev_refusal.empty() ? 0 : 3;
}

// The backend `serve` (and `probe`) runs: the fake model, or the GGUF with its identity proven
// and its memory admitted. Returns -1 when loaded, else the exit code (the reason printed).
int load_backend(ServeOptions & o, uint64_t & kv_cells, MemoryBudget & budget,
                 std::unique_ptr<ModelBackend> & backend) {
    kv_cells = o.kv_cells ? o.kv_cells : default_kv_cells(o.max_sessions, o.ctx_per_session);  // fake model
    std::string err;
    if (o.fake) {
        FakeModelOptions f;
        f.n_layer = o.n_layer;
        f.layer_start = o.has_layers ? o.layer_start : 0;
        f.layer_end = o.has_layers ? o.layer_end : o.n_layer;
        if (f.layer_end > f.n_layer) {  // --n-embd and --n-vocab: bounded by the option table
            std::fprintf(stderr, "dgr-worker: error: fake model: --layers must fit --n-layer\n");
            return 2;
        }
        // the fake device (--fake-device-*), admitted like a real one before anything is made
        const ComputeDevice dev = fake_device(o.fake_device_class, o.fake_device_memory_mb, o.fake_device_need_mb,
                                              read_host_memory());
        const MemoryNeed dneed = fake_device_need(f.layer_start, f.layer_end, f.n_layer, o.max_sessions,
                                                  o.ctx_per_session, o.fake_device_need_mb);
        if (const std::string why = o.fake_device_memory_mb ? device_admission_refusal(dneed, dev) : std::string();
            !why.empty()) {
            std::fprintf(stderr, "dgr-worker: error: refusing to load: %s\n", why.c_str());
            return 2;
        }
        f.n_embd = o.n_embd;
        f.n_vocab = o.n_vocab;
        const uint64_t cell = fake_bytes_per_cell(f.n_embd, f.layer_start, f.layer_end);
        if (o.kv_budget_mb > 0 && !o.kv_cells) kv_cells = cells_for_mib(o.kv_budget_mb, cell);
        f.kv_cells = (uint32_t) kv_cells;
        f.n_seq_max = o.max_sessions;
        f.max_batch_tokens = o.max_batch_tokens;
        f.decode_delay_ms = o.fake_delay_ms;
        f.row_delay_us = o.fake_row_delay_us;
        backend = std::make_unique<FakeBackend>(f);
        const uint64_t fake_budget = (uint64_t) (o.memory_budget_mb * 1048576.0);
        if (fake_budget && backend->info().kv_bytes > fake_budget) {
            kv_cells = fake_budget / cell;
            f.kv_cells = (uint32_t) kv_cells;
            backend = std::make_unique<FakeBackend>(f);
        }
        backend->set_device(dev);
    } else {
        {
            // Identity proven by the file (worker/identity_check.h): computed from what is loaded
            // (a slice verified against its manifest first); the flags may only name it.
            const auto log = [](const std::string & line) { std::fprintf(stderr, "dgr-worker: %s\n", line.c_str()); };
            const auto t0 = std::chrono::steady_clock::now();
            ProvenIdentity proven;
            if (!prove_identity(o.model, IdentityClaim{o.fingerprint, o.artifact_id, o.recipe_json}, &proven, &err, log)) {
                std::fprintf(stderr, "dgr-worker: error: refusing to serve %s: %s\n", o.model.c_str(), err.c_str());
                return 2;
            }
            const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            const uint32_t parts = proven.recipe.identity.n_parts;
            std::fprintf(stderr, "dgr-worker: %s %s%s: artifact id %s, %.0f MiB hashed in %.2f s\n",
                         proven.recipe.identity.slice ? "verified slice of" : "identified", o.model.c_str(),
                         parts > 1 ? (" (a " + std::to_string(parts) + "-part split set)").c_str() : "",
                         proven.recipe.identity.artifact_id.c_str(),
                         (double) proven.recipe.identity.tensor_bytes / 1048576.0, secs);
            o.model = proven.recipe.identity.model_path;  // part 1 of a split set: llama.cpp finds the rest
            o.artifact_id = proven.recipe.identity.artifact_id;
            o.fingerprint = proven.fingerprint;
            o.recipe_json = proven.recipe_json;
            if (!take_slice_range(&o, &err)) {
                std::fprintf(stderr, "dgr-worker: error: refusing to serve %s: %s\n", o.model.c_str(), err.c_str());
                return 2;
            }
        }
        take_device_census();  // before ggml registers its backends: the CUDA architecture (device_info.h)
        llama_backend_init();
        if (const std::string why = missing_device(build_info().backend); !why.empty()) {
            std::fprintf(stderr, "dgr-worker: error: %s\n", why.c_str());
            return 1;
        }
        MemoryNeed need;
        if (!plan_for_options(&o, &kv_cells, &need, &err)) {
            std::fprintf(stderr, "dgr-worker: error: cannot plan the memory of %s: %s\n", o.model.c_str(), err.c_str());
            return 1;
        }
        budget = memory_budget(o.memory_budget_mb);
        std::fprintf(stderr, "dgr-worker: memory plan: %s; budget %s\n", describe_need(need).c_str(),
                     budget.bytes ? (std::to_string(budget.bytes >> 20) + " MiB (" + budget.source + ")").c_str() : "none");
        if (const std::string why = admission_refusal(need, budget, o.kv_unified); !why.empty()) {
            std::fprintf(stderr, "dgr-worker: error: refusing to load: %s\n", why.c_str());
            return 2;
        }
        // VRAM admission (device_plan.h): the range's need on its compute device against its free memory
        ggml_backend_dev_t dev_handle = compute_device(o.n_gpu_layers);
        ComputeDevice dev = describe_device(dev_handle, build_info().backend);
        std::fprintf(stderr, "dgr-worker: %s\n", describe_device_need(need, dev).c_str());
        if (const std::string why = dev.accelerator ? device_admission_refusal(need, dev) : ""; !why.empty()) {
            std::fprintf(stderr, "dgr-worker: error: refusing to load: %s\n", why.c_str());
            return 2;
        }
        if (dev.accelerator) dev.memory_predicted = need.device_total();
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
        backend->set_predicted_memory(need.weights, need.kv, need.compute, need.runtime);
        device_memory_read(dev_handle)(&dev.memory_free, &dev.memory_total);  // after loading
        backend->set_device(dev);
    }
    backend->set_identity(o.fingerprint, o.artifact_id, o.recipe_json);
    if (kv_cells == 0) {
        std::fprintf(stderr, "dgr-worker: error: the KV budget is zero cells\n");
        return 2;
    }

    return -1;
}

// --probe-budget-s: the range's measured costs for GetCapability, from the cache or measured now
// (before any session: the probe uses the sequences); a failed probe is reported and not served.
static void probe_at_start(const ServeOptions & o, ModelBackend & backend) {
    const std::string path = probe_cache_path(backend.info(), build_info().backend, (uint32_t) o.threads);
    ProbeResult r;
    const bool cached = load_cached_probe(path, backend.info(), &r);
    if (!cached) {
        ProbeOptions po;
        po.budget_s = o.probe_budget_s;
        po.sustained_window_s = std::min(po.sustained_window_s, 0.4 * o.probe_budget_s);
        r = probe_capability(backend, po);
        if (r.ok() && !path.empty() && !save_probe(path, r)) {
            std::fprintf(stderr, "dgr-worker: warning: cannot write the probe cache %s\n", path.c_str());
        }
    }
    if (!r.ok()) {
        std::fprintf(stderr, "dgr-worker: warning: the start-up probe stopped (%s); GetCapability reports no "
                             "measured cost\n", r.error.c_str());
        return;
    }
    backend.set_measured(measured_cost(r, (uint32_t) o.threads, cached));
    std::fprintf(stderr, "dgr-worker: measured cost %s: 1-row step %.3f ms, duty %.2f, %zu batch sizes%s\n",
                 cached ? ("from " + path).c_str() : "now", r.decode_s.empty() ? 0.0 : 1e3 * r.decode_s.begin()->second,
                 r.duty, r.decode_s.size(), cached ? "" : (" in " + std::to_string(r.seconds).substr(0, 4) + " s").c_str());
}

int serve_main(int argc, char ** argv) {
    ServeOptions o;
    const int rc = parse_serve_options(argc, argv, &o);
    if (rc >= 0) return rc;

    // Signals are taken by one watcher thread (sigwait); block them before any thread starts.
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

    uint64_t kv_cells = 0;
    std::unique_ptr<ModelBackend> backend;
    MemoryBudget budget;  // the llama backend's: --memory-budget-mb or the cgroup's memory.max
    std::string err;
    if (const int lrc = load_backend(o, kv_cells, budget, backend); lrc >= 0) return lrc;
    if (o.probe_budget_s > 0.0) probe_at_start(o, *backend);

    Metrics metrics;
    SchedulerOptions so;
    so.max_sessions = o.max_sessions;
    so.max_session_positions = o.ctx_per_session;
    so.kv_cells = kv_cells;
    so.queue_limit = o.queue_limit;
    so.max_batch_tokens = o.max_batch_tokens;
    so.max_prefill_chunk_tokens = o.max_prefill_chunk;
    so.pipeline_groups = o.pipeline_groups;
    so.keep_warm_s = o.keep_warm_ms / 1000.0;
    so.keep_warm_threads = o.threads > 0 ? (uint32_t) o.threads : 1;
    so.max_message_bytes = o.max_message_bytes;
    so.session_ttl_s = o.session_ttl_s;
    so.evict_idle_s = o.evict_idle_s;
    so.memory_budget_bytes = o.fake ? (uint64_t) (o.memory_budget_mb * 1048576.0) : budget.bytes;
    {
        so.chain.peers = split_peer_list(o.chain_peers);
        dgr::AddressAllowlist check;
        if (!check.build(so.chain.peers, &err)) {
            std::fprintf(stderr, "dgr-worker: error: --chain-peers: %s\n", err.c_str());
            return 2;
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
    ShardService service(*backend, scheduler, metrics,
                         ServiceInfo{b.dgr_version, b.pin_commit, b.patch_digest, b.backend, o.require_client_auth,
                                     std::make_shared<DeviceMemoryReader>(
                                         o.fake ? fake_device_memory_read(o.fake_device_memory_mb)
                                                : device_memory_read(compute_device(o.n_gpu_layers)))});
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    std::shared_ptr<grpc::ServerCredentials> creds;
    if (!o.tls_cert.empty()) {
        bool ok1 = false, ok2 = false, ok3 = true;
        // --tls-client-ca: the handshake requires a verified client cert (every RPC, health too);
        // with --require-client-auth it only verifies one when presented, and the service refuses
        // calls without one (ShardService), so health and reflection stay open.
        grpc::SslServerCredentialsOptions ssl(o.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                              : o.require_client_auth
                                                  ? GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY
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
    // the server's own pings find a silent client (driver or previous shard) within 2 s
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 1000);
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
        if (!http.start(o.metrics_listen, [&service] { return service.prometheus_families(); }, &err)) {
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
