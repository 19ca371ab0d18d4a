#include "worker/metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/exposer.h>
#include <prometheus/text_serializer.h>

#include <cstdio>
#include <exception>
#include <limits>
#include <sstream>

namespace dgr::worker {

namespace pm = prometheus;

void Histogram::observe(double v) {
    std::lock_guard<std::mutex> lk(mu_);
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    counts_[i]++;
    sum_ += v;
    count_++;
}

pm::ClientMetric Histogram::snapshot() const {
    std::lock_guard<std::mutex> lk(mu_);
    pm::ClientMetric m;
    uint64_t cum = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
        cum += counts_[i];
        m.histogram.bucket.push_back({cum, bounds_[i]});
    }
    cum += counts_.back();
    m.histogram.bucket.push_back({cum, std::numeric_limits<double>::infinity()});
    m.histogram.sample_sum = sum_;
    m.histogram.sample_count = count_;
    return m;
}

Metrics::Metrics()
    : step_latency({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      batch_occupancy({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}),
      queue_wait({0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5}) {}

namespace {

using Labels = std::vector<pm::ClientMetric::Label>;

pm::ClientMetric value_metric(pm::MetricType type, double v, Labels labels = {}) {
    pm::ClientMetric m;
    m.label = std::move(labels);
    if (type == pm::MetricType::Counter) {
        m.counter.value = v;
    } else {
        m.gauge.value = v;
    }
    return m;
}

// One family; `series` = (labels, value) pairs.
pm::MetricFamily family(const char * name, pm::MetricType type, const char * help,
                        std::vector<std::pair<Labels, double>> series) {
    pm::MetricFamily f;
    f.name = name;
    f.type = type;
    f.help = help;
    for (auto & [labels, v] : series) f.metric.push_back(value_metric(type, v, std::move(labels)));
    return f;
}

pm::MetricFamily gauge(const char * name, const char * help, double v) {
    return family(name, pm::MetricType::Gauge, help, {{{}, v}});
}

pm::MetricFamily counter(const char * name, const char * help, double v) {
    return family(name, pm::MetricType::Counter, help, {{{}, v}});
}

pm::MetricFamily histogram(const char * name, const char * help, const Histogram & h) {
    pm::MetricFamily f;
    f.name = name;
    f.type = pm::MetricType::Histogram;
    f.help = help;
    f.metric.push_back(h.snapshot());
    return f;
}

std::string fmt_le(double b) {
    if (b == std::numeric_limits<double>::infinity()) return "+Inf";
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", b);
    return buf;
}

}  // namespace

std::vector<pm::MetricFamily> Metrics::families(const Gauges & g) const {
    using T = pm::MetricType;
    auto d = [](const std::atomic<uint64_t> & a) { return (double) a.load(); };
    std::vector<pm::MetricFamily> f;
    f.push_back(gauge("dgr_active_sessions", "Open Sessions (Hot KV State) on this worker.", g.active_sessions));
    f.push_back(gauge("dgr_max_sessions", "Most concurrent Sessions allowed.", g.max_sessions));
    f.push_back(gauge("dgr_queue_depth", "Frames received and not yet answered.", g.queued_steps));
    f.push_back(gauge("dgr_kv_cells_used", "KV cells held by open Sessions.", (double) g.kv_cells_used));
    f.push_back(gauge("dgr_kv_cells_total", "KV cells of the budget.", (double) g.kv_cells_total));
    f.push_back(family("dgr_memory_bytes", T::Gauge, "Memory held, by part (llama.cpp breakdown).",
                       {{{{"part", "weights"}}, (double) g.weight_bytes},
                        {{{"part", "kv"}}, (double) g.kv_bytes},
                        {{{"part", "scratch"}}, (double) g.scratch_bytes}}));
    f.push_back(gauge("dgr_memory_budget_bytes",
                      "The budget admitted against: --memory-budget-mb or the cgroup memory.max, the smaller (0: none).",
                      (double) g.memory_budget_bytes));
    f.push_back(family("dgr_memory_predicted_bytes", T::Gauge,
                       "Host memory predicted before loading, by part (docs/memory.md).",
                       {{{{"part", "weights"}}, (double) g.predicted_weight_bytes},
                        {{{"part", "kv"}}, (double) g.predicted_kv_bytes},
                        {{{"part", "compute"}}, (double) g.predicted_compute_bytes},
                        {{{"part", "runtime"}}, (double) g.predicted_runtime_bytes}}));
    const Labels device = {{"device_class", g.device_class}};
    f.push_back(family("dgr_device_memory_total_bytes", T::Gauge,
                       "Memory of the compute device (the host's RAM for the CPU), by device class.",
                       {{device, (double) g.device_memory_total_bytes}}));
    f.push_back(family("dgr_device_memory_free_bytes", T::Gauge,
                       "Free memory of the compute device when asked (read at most once a second).",
                       {{device, (double) g.device_memory_free_bytes}}));
    f.push_back(family("dgr_device_memory_predicted_bytes", T::Gauge,
                       "Device memory admission predicted the range needs on its device (0: nothing offloaded).",
                       {{device, (double) g.device_memory_predicted_bytes}}));
    f.push_back(counter("dgr_prefill_tokens_total", "Prompt rows computed.", d(prefill_tokens)));
    f.push_back(counter("dgr_decode_tokens_total", "Decode rows computed.", d(decode_tokens)));
    f.push_back(counter("dgr_decode_busy_seconds_total", "Seconds inside decode calls.", busy_seconds.load()));
    f.push_back(counter("dgr_decode_only_busy_seconds_total", "Seconds inside decode calls without prompt rows.",
                        decode_only_busy_seconds.load()));
    f.push_back(counter("dgr_decode_only_batches_total", "Decode calls without prompt rows.", d(decode_only_batches)));
    f.push_back(counter("dgr_decode_only_rows_total", "Rows of decode calls without prompt rows.", d(decode_only_rows)));
    f.push_back(counter("dgr_pipeline_held_rows_total",
                        "Chained decode rows left for the next pipeline group's batch.", d(pipeline_held_rows)));
    f.push_back(counter("dgr_prefill_pieces_total", "Pieces of PREFILL steps split to overlap along a chained route.",
                        d(prefill_pieces)));
    f.push_back(counter("dgr_gather_wait_seconds_total", "Seconds spent waiting to gather rows into a batch.",
                        gather_wait_seconds.load()));
    f.push_back(counter("dgr_batches_total", "Decode calls.", d(batches)));
    f.push_back(counter("dgr_batch_rows_total", "Rows over all decode calls.", d(batch_rows)));
    f.push_back(counter("dgr_steps_total", "Steps answered.", d(steps)));
    f.push_back(counter("dgr_replayed_steps_total", "Resent steps answered from the stored response.", d(replayed_steps)));
    f.push_back(counter("dgr_step_errors_total", "Steps answered with a ShardError.", d(step_errors)));
    f.push_back(counter("dgr_sessions_not_owned_total",
                        "Frames refused: they named a Session another stream owns.", d(rejected_not_owned)));
    f.push_back(counter("dgr_sessions_opened_total", "Sessions opened.", d(sessions_opened)));
    f.push_back(counter("dgr_sessions_opened_pipelined_total",
                        "Sessions opened by an upstream Shard that forwards in pipeline groups (StepFrame.pipelined).",
                        d(sessions_opened_pipelined)));
    f.push_back(counter("dgr_sessions_released_total", "Sessions released.", d(sessions_released)));
    f.push_back(counter("dgr_sessions_evicted_total", "Sessions evicted (TTL or LRU).", d(sessions_evicted)));
    f.push_back(counter("dgr_sessions_cancelled_total", "Sessions cancelled.", d(sessions_cancelled)));
    f.push_back(family("dgr_rejected_admissions_total", T::Counter, "Work refused, by budget.",
                       {{{{"reason", "sessions"}}, d(rejected_sessions)},
                        {{{"reason", "queue"}}, d(rejected_queue)},
                        {{{"reason", "kv"}}, d(rejected_kv)}}));
    f.push_back(family("dgr_chain_frames_sent_total", T::Counter, "Frames sent to the downstream Shard, by phase.",
                       {{{{"phase", "prefill"}}, d(chain_frames_prefill)}, {{{"phase", "decode"}}, d(chain_frames_decode)}}));
    f.push_back(family("dgr_chain_frame_bytes_sent_total", T::Counter,
                       "Serialized bytes of the frames sent to the downstream Shard, by phase.",
                       {{{{"phase", "prefill"}}, d(chain_bytes_prefill)}, {{{"phase", "decode"}}, d(chain_bytes_decode)}}));
    f.push_back(family("dgr_chain_hop_seconds_total", T::Counter,
                       "Seconds from a frame sent to the downstream Shard to its answer back here, by phase.",
                       {{{{"phase", "prefill"}}, chain_hop_seconds_prefill.load()},
                        {{{"phase", "decode"}}, chain_hop_seconds_decode.load()}}));
    f.push_back(family("dgr_chain_replies_total", T::Counter, "Answers from the downstream Shard, by phase.",
                       {{{{"phase", "prefill"}}, d(chain_replies_prefill)}, {{{"phase", "decode"}}, d(chain_replies_decode)}}));
    f.push_back(counter("dgr_generated_tokens_total", "Tokens fed back by server-side generation.", d(generated_tokens)));
    f.push_back(histogram("dgr_step_latency_seconds", "Frame received to answer handed to gRPC.", step_latency));
    f.push_back(histogram("dgr_batch_occupancy_sessions", "Steps per decode call.", batch_occupancy));
    f.push_back(histogram("dgr_queue_wait_seconds", "Admitted to batched.", queue_wait));
    return f;
}

std::vector<Sample> Metrics::samples(const std::vector<pm::MetricFamily> & families) {
    std::vector<Sample> out;
    for (const pm::MetricFamily & f : families) {
        for (const pm::ClientMetric & m : f.metric) {
            std::map<std::string, std::string> labels;
            for (const auto & l : m.label) labels[l.name] = l.value;
            switch (f.type) {
                case pm::MetricType::Counter: out.push_back({f.name, labels, m.counter.value}); break;
                case pm::MetricType::Gauge: out.push_back({f.name, labels, m.gauge.value}); break;
                case pm::MetricType::Histogram:
                    for (const auto & b : m.histogram.bucket) {
                        auto bl = labels;
                        bl["le"] = fmt_le(b.upper_bound);
                        out.push_back({f.name + "_bucket", bl, (double) b.cumulative_count});
                    }
                    out.push_back({f.name + "_sum", labels, m.histogram.sample_sum});
                    out.push_back({f.name + "_count", labels, (double) m.histogram.sample_count});
                    break;
                default: out.push_back({f.name, labels, m.untyped.value}); break;
            }
        }
    }
    return out;
}

std::string Metrics::prometheus_text(const std::vector<pm::MetricFamily> & families) {
    std::ostringstream o;
    pm::TextSerializer().Serialize(o, families);
    return o.str();
}

class MetricsHttpServer::Source final : public pm::Collectable {
public:
    explicit Source(std::function<std::vector<pm::MetricFamily>()> f) : collect_(std::move(f)) {}
    std::vector<pm::MetricFamily> Collect() const override { return collect_(); }
private:
    std::function<std::vector<pm::MetricFamily>()> collect_;
};

MetricsHttpServer::MetricsHttpServer() = default;
MetricsHttpServer::~MetricsHttpServer() { stop(); }

bool MetricsHttpServer::start(const std::string & addr, std::function<std::vector<pm::MetricFamily>()> collect,
                              std::string * error) {
    if (addr.rfind(':') == std::string::npos) {
        *error = "--metrics-listen wants HOST:PORT";
        return false;
    }
    source_ = std::make_shared<Source>(std::move(collect));
    try {
        exposer_ = std::make_unique<pm::Exposer>(addr, 1);
    } catch (const std::exception & e) {
        *error = "cannot listen on " + addr + ": " + e.what();
        return false;
    }
    exposer_->RegisterCollectable(source_);
    const std::vector<int> ports = exposer_->GetListeningPorts();
    port_ = ports.empty() ? 0 : ports.front();
    return true;
}

void MetricsHttpServer::stop() {
    exposer_.reset();
    source_.reset();
}

}  // namespace dgr::worker
