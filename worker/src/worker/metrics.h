// Worker metrics (Prometheus naming: dgr_ prefix, base units, _total for counters, no session
// or request ids as labels). One list of families (name, type, help, series) feeds both
// GetMetrics (flattened samples) and the Prometheus exposition on --metrics-listen, which
// prometheus-cpp writes (# HELP / # TYPE, escaping, histogram series) and serves (its pull
// Exposer over civetweb).
#pragma once

#include <prometheus/metric_family.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace prometheus {
class Exposer;
}

namespace dgr::worker {

struct Sample {
    std::string name;
    std::map<std::string, std::string> labels;
    double value = 0.0;
};

class Histogram {
public:
    explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
    void observe(double v);
    prometheus::ClientMetric snapshot() const;  // cumulative buckets, +Inf last
private:
    mutable std::mutex mu_;
    std::vector<double> bounds_;
    std::vector<uint64_t> counts_;
    double sum_ = 0.0;
    uint64_t count_ = 0;
};

struct Gauges {
    uint32_t active_sessions = 0;
    uint32_t queued_steps = 0;
    uint64_t kv_cells_used = 0;
    uint64_t kv_cells_total = 0;
    uint32_t max_sessions = 0;
    uint64_t weight_bytes = 0, kv_bytes = 0, scratch_bytes = 0, memory_budget_bytes = 0;
    uint64_t predicted_weight_bytes = 0, predicted_kv_bytes = 0, predicted_compute_bytes = 0, predicted_runtime_bytes = 0;
    // the compute device (GetCapabilityResponse.device); free re-read when asked (device_memory.h)
    std::string device_class;
    uint64_t device_memory_total_bytes = 0, device_memory_free_bytes = 0, device_memory_predicted_bytes = 0;
};

class Metrics {
public:
    Metrics();
    std::atomic<uint64_t> prefill_tokens{0};
    std::atomic<uint64_t> decode_tokens{0};
    std::atomic<uint64_t> batches{0};
    std::atomic<uint64_t> batch_rows{0};
    std::atomic<uint64_t> steps{0};
    std::atomic<uint64_t> replayed_steps{0};
    std::atomic<uint64_t> sessions_opened{0};
    std::atomic<uint64_t> sessions_opened_pipelined{0};
    std::atomic<uint64_t> sessions_released{0};
    std::atomic<uint64_t> sessions_evicted{0};
    std::atomic<uint64_t> sessions_cancelled{0};
    std::atomic<uint64_t> rejected_sessions{0};  // admission refused (max sessions, kv)
    std::atomic<uint64_t> rejected_queue{0};     // queue limit
    std::atomic<uint64_t> rejected_kv{0};        // append refused for KV budget
    std::atomic<uint64_t> rejected_not_owned{0}; // a frame naming another stream's session
    std::atomic<uint64_t> step_errors{0};
    std::atomic<double> busy_seconds{0.0};       // time spent inside decode calls
    // the same for decode calls without prefill rows (per-token compute, for profiles)
    std::atomic<double> decode_only_busy_seconds{0.0};
    std::atomic<uint64_t> decode_only_batches{0};
    std::atomic<uint64_t> decode_only_rows{0};
    // chained routes: frames (and their serialized bytes) sent to the next Shard
    std::atomic<uint64_t> chain_frames_prefill{0};
    std::atomic<uint64_t> chain_frames_decode{0};
    std::atomic<uint64_t> chain_bytes_prefill{0};
    std::atomic<uint64_t> chain_bytes_decode{0};
    // chained routes: round trip of each forwarded frame (sent to the next Shard -> its answer
    // back here), i.e. the hop plus everything after it; the route report shows it per hop
    std::atomic<double> chain_hop_seconds_prefill{0.0};
    std::atomic<double> chain_hop_seconds_decode{0.0};
    std::atomic<uint64_t> chain_replies_prefill{0};
    std::atomic<uint64_t> chain_replies_decode{0};
    void observe_chain_hop(bool decode, double seconds) {
        auto & sum = decode ? chain_hop_seconds_decode : chain_hop_seconds_prefill;
        sum = sum.load() + seconds;  // only the scheduler thread writes
        (decode ? chain_replies_decode : chain_replies_prefill)++;
    }
    // pipelined routes: chained DECODE rows left for the next group's batch, and the time the
    // scheduler waited to gather rows into a batch (docs/worker.md, Pipelined routes)
    std::atomic<uint64_t> pipeline_held_rows{0};
    std::atomic<uint64_t> prefill_pieces{0};  // pieces of PREFILL steps split to overlap (pipeline.h)
    std::atomic<double> gather_wait_seconds{0.0};
    std::atomic<uint64_t> generated_tokens{0};   // tokens fed back by server-side generation
    Histogram step_latency;     // seconds from frame received to response handed to gRPC
    Histogram batch_occupancy;  // rows per decode call
    Histogram queue_wait;       // seconds a step waited before its batch

    std::vector<prometheus::MetricFamily> families(const Gauges & g) const;
    // GetMetrics: every series as one sample (histograms as _bucket{le}, _sum, _count).
    static std::vector<Sample> samples(const std::vector<prometheus::MetricFamily> & families);
    // The Prometheus text exposition format of `families`.
    static std::string prometheus_text(const std::vector<prometheus::MetricFamily> & families);
};

// GET /metrics on HOST:PORT (prometheus-cpp's Exposer), rendering `collect` per scrape.
class MetricsHttpServer {
public:
    MetricsHttpServer();
    ~MetricsHttpServer();
    // addr "host:port" (port 0: a free one); false with *error on failure.
    bool start(const std::string & addr, std::function<std::vector<prometheus::MetricFamily>()> collect,
               std::string * error);
    void stop();
    int port() const { return port_; }
private:
    class Source;
    std::shared_ptr<Source> source_;
    std::unique_ptr<prometheus::Exposer> exposer_;
    int port_ = 0;
};

}  // namespace dgr::worker
