#include "worker/serve_options.h"

#include "common/net_address.h"
#include "worker/device_class.h"

#include <sched.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

namespace dgr::worker {

namespace {

// The CPUs this process may run on (its affinity mask: taskset, a cgroup cpuset), at least 1.
// llama.cpp's own default is a fixed 4 threads: on a 2-core host that oversubscribes (measured:
// the probe's decode step 3.7x slower than at 2 threads, SmolLM2), on a 16-core one it idles 12.
int32_t available_cpus() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
        return (int32_t) CPU_COUNT(&set);
    }
    const unsigned h = std::thread::hardware_concurrency();
    return h > 0 ? (int32_t) h : 1;
}

void usage() {
    std::fputs(options_usage("usage: dgr-worker serve (--fake-model | --model FILE) [options]").c_str(), stdout);
}

}  // namespace

void store_option(Opt id, const OptionValue & v, ServeOptions * o) {
    const uint32_t u32 = (uint32_t) v.u64;
    switch (id) {
        case Opt::kFakeModel: o->fake = true; break;
        case Opt::kModel: o->model = v.text; break;
        case Opt::kLayers:
            o->has_layers = true;
            o->layer_start = v.start;
            o->layer_end = v.end;
            break;
        case Opt::kNLayer: o->n_layer = u32; break;
        case Opt::kNEmbd: o->n_embd = u32; break;
        case Opt::kNVocab: o->n_vocab = u32; break;
        case Opt::kFakeDelayMs: o->fake_delay_ms = u32; break;
        case Opt::kFakeRowDelayUs: o->fake_row_delay_us = u32; break;
        case Opt::kFakeDeviceClass:
            o->fake_device_class = v.text;
            o->fake_device_given = true;
            break;
        case Opt::kFakeDeviceMemoryMb:
            o->fake_device_memory_mb = v.u64;
            o->fake_device_given = true;
            break;
        case Opt::kFakeDeviceNeedMb:
            o->fake_device_need_mb = v.u64;
            o->fake_device_given = true;
            break;
        case Opt::kListen: o->listen = v.text; break;
        case Opt::kAllowRemote: o->allow_remote = true; break;
        case Opt::kTlsCert: o->tls_cert = v.text; break;
        case Opt::kTlsKey: o->tls_key = v.text; break;
        case Opt::kTlsClientCa: o->tls_client_ca = v.text; break;
        case Opt::kRequireClientAuth: o->require_client_auth = true; break;
        case Opt::kThreads: o->threads = (int32_t) v.i64; break;
        case Opt::kNGpuLayers: o->n_gpu_layers = (int32_t) v.i64; break;
        case Opt::kMaxSessions: o->max_sessions = u32; break;
        case Opt::kCtxPerSession: o->ctx_per_session = u32; break;
        case Opt::kKvCells: o->kv_cells = v.u64; break;
        case Opt::kKvBudgetMb: o->kv_budget_mb = v.number; break;
        case Opt::kMemoryBudgetMb: o->memory_budget_mb = v.number; break;
        case Opt::kKvUnified: o->kv_unified = true; break;
        case Opt::kQueueLimit: o->queue_limit = u32; break;
        case Opt::kMaxBatchTokens: o->max_batch_tokens = u32; break;
        case Opt::kMaxPrefillChunk: o->max_prefill_chunk = u32; break;
        case Opt::kPipelineGroups: o->pipeline_groups = u32; break;
        case Opt::kKeepWarmMs: o->keep_warm_ms = u32; break;
        case Opt::kMaxMessageBytes: o->max_message_bytes = v.u64; break;
        case Opt::kSessionTtlS: o->session_ttl_s = v.number; break;
        case Opt::kEvictIdleS: o->evict_idle_s = v.number; break;
        case Opt::kDrainTimeoutS: o->drain_timeout_s = v.number; break;
        case Opt::kProbeBudgetS: o->probe_budget_s = v.number; break;
        case Opt::kMetricsListen: o->metrics_listen = v.text; break;
        case Opt::kFingerprint: o->fingerprint = v.text; break;
        case Opt::kArtifactId: o->artifact_id = v.text; break;
        case Opt::kRecipeJson: o->recipe_json = v.text; break;
        case Opt::kChainPeers: o->chain_peers = v.text; break;
        case Opt::kIoNice: o->io_nice = u32; break;
        case Opt::kChainTlsCa: o->chain_tls_ca = v.text; break;
        case Opt::kCount: break;
    }
}


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
        if (a == "--help" || a == "-h") {
            usage();
            return 0;
        }
        const OptionSpec * spec = find_option(a);
        if (!spec) {
            std::fprintf(stderr, "dgr-worker: error: unknown serve option '%s'\n", a.c_str());
            usage();
            return 2;
        }
        OptionValue v;
        if (spec->kind != OptionKind::kFlag) {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "dgr-worker: error: %s needs a value\n", a.c_str());
                return 2;
            }
            std::string err;
            if (!parse_option_value(*spec, argv[++i], &v, &err)) {
                std::fprintf(stderr, "dgr-worker: error: %s\n", err.c_str());
                return 2;
            }
        }
        store_option(spec->id, v, o);
    }
    if (o->fake == !o->model.empty()) {
        std::fprintf(stderr, "dgr-worker: error: give exactly one of --fake-model or --model FILE\n");
        return 2;
    }
    if (o->fake_device_given && !o->fake) {
        std::fprintf(stderr, "dgr-worker: error: --fake-device-class, --fake-device-memory-mb and "
                             "--fake-device-need-mb describe the fake model's device; they need --fake-model\n");
        return 2;
    }
    if (!valid_device_class(o->fake_device_class)) {
        std::fprintf(stderr, "dgr-worker: error: --fake-device-class wants 1..%zu characters of a-z 0-9 : _ . -, "
                             "got '%s'\n", kClassMax, o->fake_device_class.c_str());
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
    if (o->threads == 0) {
        o->threads = available_cpus();
    }
    return -1;
}

}  // namespace dgr::worker
