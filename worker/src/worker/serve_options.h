// `dgr-worker serve` options: the parsed values and their parsing, driven by the option table
// (worker/option_table.h: flags, defaults, bounds, help).
#pragma once

#include "worker/option_table.h"

#include <cstdint>
#include <string>

namespace dgr::worker {

// Every default comes from the option table (worker/option_table.h).
struct ServeOptions {
    bool fake = false;
    std::string model = default_text(Opt::kModel);
    bool has_layers = false;
    uint32_t layer_start = 0, layer_end = 0;
    // fake model shape and costs
    uint32_t n_layer = default_u32(Opt::kNLayer), n_embd = default_u32(Opt::kNEmbd),
             n_vocab = default_u32(Opt::kNVocab);
    uint32_t fake_delay_ms = default_u32(Opt::kFakeDelayMs);
    uint32_t fake_row_delay_us = default_u32(Opt::kFakeRowDelayUs);
    // the fake model's device (device_plan.h); fake_device_given: one of the three was named
    std::string fake_device_class = default_text(Opt::kFakeDeviceClass);
    uint64_t fake_device_memory_mb = default_u64(Opt::kFakeDeviceMemoryMb);
    uint64_t fake_device_need_mb = default_u64(Opt::kFakeDeviceNeedMb);
    bool fake_device_given = false;
    std::string listen = default_text(Opt::kListen);
    bool allow_remote = false;
    bool kv_unified = false;
    std::string tls_cert = default_text(Opt::kTlsCert), tls_key = default_text(Opt::kTlsKey),
                tls_client_ca = default_text(Opt::kTlsClientCa);
    bool require_client_auth = false;  // mTLS for ShardRuntimeService only; health/reflection open
    int32_t threads = default_i32(Opt::kThreads);
    int32_t n_gpu_layers = default_i32(Opt::kNGpuLayers);
    uint32_t max_sessions = default_u32(Opt::kMaxSessions);
    uint32_t ctx_per_session = default_u32(Opt::kCtxPerSession);
    uint64_t kv_cells = default_u64(Opt::kKvCells);
    double kv_budget_mb = default_real(Opt::kKvBudgetMb);
    double memory_budget_mb = default_real(Opt::kMemoryBudgetMb);
    uint32_t queue_limit = default_u32(Opt::kQueueLimit);
    uint32_t max_batch_tokens = default_u32(Opt::kMaxBatchTokens);
    uint32_t max_prefill_chunk = default_u32(Opt::kMaxPrefillChunk);
    uint32_t pipeline_groups = default_u32(Opt::kPipelineGroups);  // 0: auto (worker/pipeline.h)
    uint32_t keep_warm_ms = default_u32(Opt::kKeepWarmMs);        // 0: off (worker/keep_warm.h)
    uint64_t max_message_bytes = default_u64(Opt::kMaxMessageBytes);
    double session_ttl_s = default_real(Opt::kSessionTtlS), evict_idle_s = default_real(Opt::kEvictIdleS),
           drain_timeout_s = default_real(Opt::kDrainTimeoutS);
    double probe_budget_s = default_real(Opt::kProbeBudgetS);  // 0: no probe at start-up
    std::string metrics_listen = default_text(Opt::kMetricsListen);
    std::string fingerprint = default_text(Opt::kFingerprint), artifact_id = default_text(Opt::kArtifactId),
                recipe_json = default_text(Opt::kRecipeJson);
    std::string chain_peers = default_text(Opt::kChainPeers);
    std::string chain_tls_ca = default_text(Opt::kChainTlsCa);
    uint32_t io_nice = default_u32(Opt::kIoNice);
};

// Parses argv after "serve" into *o; returns -1 to go on, else the exit code (0: --help printed,
// 2: a usage error, printed as one line).
int parse_serve_options(int argc, char ** argv, ServeOptions * o);
// Stores one parsed value of the option `id` in *o.
void store_option(Opt id, const OptionValue & v, ServeOptions * o);
bool is_loopback(const std::string & listen);
std::string read_file(const std::string & path, bool * ok);

}  // namespace dgr::worker
