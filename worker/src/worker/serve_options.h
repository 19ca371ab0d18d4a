// `dgr-worker serve` options: the flags, their help text and their parsing.
#pragma once

#include <cstdint>
#include <string>

namespace dgr::worker {

struct ServeOptions {
    bool fake = false;
    std::string model;
    bool has_layers = false;
    uint32_t layer_start = 0, layer_end = 0;
    uint32_t n_layer = 8, n_embd = 8, n_vocab = 320;  // fake model shape
    uint32_t fake_delay_ms = 0;
    uint32_t fake_row_delay_us = 0;
    std::string listen = "127.0.0.1:50151";
    bool allow_remote = false;
    bool kv_unified = false;
    std::string tls_cert, tls_key, tls_client_ca;
    bool require_client_auth = false;  // mTLS for ShardRuntimeService only; health/reflection open
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
    uint32_t pipeline_groups = 0;  // 0: auto (worker/pipeline.h)
    uint32_t keep_warm_ms = 0;     // 0: off (worker/keep_warm.h)
    uint64_t max_message_bytes = 64ull << 20;
    double session_ttl_s = 600, evict_idle_s = 30, drain_timeout_s = 10;
    std::string metrics_listen;
    std::string fingerprint, artifact_id, recipe_json;
    std::string chain_peers = "127.0.0.1,localhost,::1";
    std::string chain_tls_ca;
    uint32_t io_nice = 10;
};

// Parses argv after "serve" into *o; returns -1 to go on, else the exit code (0: --help printed,
// 2: a usage error, printed as one line).
int parse_serve_options(int argc, char ** argv, ServeOptions * o);
bool is_loopback(const std::string & listen);
std::string read_file(const std::string & path, bool * ok);

}  // namespace dgr::worker
