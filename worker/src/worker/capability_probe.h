// What this worker's range costs on this host, measured (`dgr-worker probe`; docs/worker.md,
// "Measured capability"): decode steps at a few batch sizes, prompt rows, and on a tail the
// output matrix apart from the layers. Route planning (`dgr plan`) turns the figures into a
// mean layer's cost and the output matrix's, per host.
//
// The probe runs synthetic rows through the backend that serves: token 1 on a head, small
// deterministic boundary rows elsewhere, one row per sequence at position 0 (decode) or one
// sequence of consecutive positions (prompt), every sequence cleared before and after. Each
// figure is the median of its repeats after one warm-up call. The time budget bounds the whole
// probe: a batch size that would not fit in what is left is skipped and the result says so, so
// an 8B range on one core reports its 1-row figure instead of stalling start-up.
//
// Those figures are bursts: a few calls in a row. A host whose CPU time is capped (a cgroup
// quota, a burstable VM) runs a burst at full speed and throttles a host kept busy. So the
// probe also keeps 1-row steps going for a window (default 2 s, twenty CFS periods) and reports the
// ratio of the burst figure to that sustained one as `duty`: the share of the wall time the host
// can compute. The window comes out of the same budget, first.
#pragma once

#include "worker/backend.h"

#include <map>
#include <string>
#include <vector>

namespace dgr::worker {

struct ProbeOptions {
    std::vector<uint32_t> batch_rows = {1, 4, 8, 16};
    uint32_t prompt_rows = 64;     // one prompt piece, per-token cost
    uint32_t repeats = 3;
    double budget_s = 5.0;
    // 1-row steps back to back for this long: the sustained rate, against the burst figures
    // above (a CPU quota lets short calls run at full speed and throttles a busy host)
    double sustained_window_s = 2.0;
};

struct ProbeResult {
    uint32_t layers = 0;               // layers of the range measured
    bool head = false, tail = false;
    std::map<uint32_t, double> decode_s;            // batch rows -> one step of the range (tail: a logits row each)
    std::map<uint32_t, double> decode_no_output_s;  // tail only: the same step asking for no logits
    double prompt_s_per_token = 0.0;                // the range, per prompt row (tail: logits of the last)
    double prompt_no_output_s_per_token = 0.0;      // tail only: no logits
    double sustained_s = 0.0;                       // the first size's step kept up for the window: mean
    double duty = 1.0;                              // its burst figure / sustained_s, at most 1: the share of
                                                    // the time this host can compute when kept busy
    std::vector<uint32_t> skipped;                  // batch sizes left out (budget, batch or sequence limits)
    double seconds = 0.0;
    std::string error;                              // a decode failed: the probe stopped there
    bool ok() const { return error.empty(); }
};

// Runs the probe. Uses sequences [0, max rows) of `backend`: call it before any session exists.
ProbeResult probe_capability(ModelBackend & backend, const ProbeOptions & opts);

// The figures as GetCapability reports them.
MeasuredCost measured_cost(const ProbeResult & r, uint32_t threads, bool from_cache);

// The probe cache (serve --probe-budget-s): one JSON file per artifact, range, backend and
// thread count, under $DGR_PROBE_CACHE_DIR, else $XDG_CACHE_HOME/dgr/probe, else
// ~/.cache/dgr/probe. "" when the worker has no artifact id (the fake model) or no such place.
std::string probe_cache_path(const BackendInfo & in, const std::string & backend, uint32_t threads);
// A cached probe of this range; false when absent, unreadable or of another range.
bool load_cached_probe(const std::string & path, const BackendInfo & in, ProbeResult * out);
// Writes it (a temporary file renamed into place); false when it cannot (the probe still counts).
bool save_probe(const std::string & path, const ProbeResult & r);

// {"layers", "head", "tail", "decode_s": {"1": s, ...}, "decode_no_output_s": {...},
//  "prompt_s_per_token", "prompt_no_output_s_per_token", "sustained_s", "duty", "skipped": [...],
//  "seconds", "error"}
std::string probe_json(const ProbeResult & r);

}  // namespace dgr::worker
