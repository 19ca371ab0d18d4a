#include "worker/device_plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace dgr::worker {

namespace {

constexpr uint64_t kMiB = 1ull << 20;

std::string mib(uint64_t b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.1f", (double) b / (double) kMiB);
    return s;
}

std::string json_text(const std::string & s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if ((unsigned char) c < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", (unsigned) (unsigned char) c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out + "\"";
}

std::string range_text(const MemoryNeed & n) {
    return "layers [" + std::to_string(n.layer_start) + ", " + std::to_string(n.layer_end) + ")";
}

std::string device_text(const ComputeDevice & d) { return d.name + " (" + d.device_class + ")"; }

std::string parts_text(const MemoryNeed & n) {
    return "weights " + mib(n.device_weights) + " + KV " + mib(n.device_kv) + " for " + std::to_string(n.max_sessions) +
           " sessions x " + std::to_string(n.ctx_per_session) + " positions + compute " + mib(n.device_compute) +
           " + allowance " + mib(n.device_allowance);
}

}  // namespace

std::string device_admission_refusal(const MemoryNeed & n, const ComputeDevice & d) {
    const uint64_t need = n.device_total();
    if (d.memory_total == 0 || need <= d.memory_free) return {};
    std::string s = range_text(n) + " need " + mib(need) + " MiB on the device " + device_text(d) + " (" +
                    parts_text(n) + "), more than its free memory of " + mib(d.memory_free) + " MiB (total " +
                    mib(d.memory_total) + " MiB): ";
    const uint64_t fixed = n.device_weights + n.device_compute + n.device_allowance;
    const uint64_t per_session = n.max_sessions ? n.device_kv / n.max_sessions : 0;
    if (fixed >= d.memory_free || per_session == 0) {
        return s + "the offloaded range itself does not fit (weights, compute and allowance " + mib(fixed) +
               " MiB); offload fewer layers (--n-gpu-layers) or split the model over more devices";
    }
    const uint64_t fit = (d.memory_free - fixed) / per_session;
    if (fit == 0) {
        return s + "no session of " + std::to_string(n.ctx_per_session) +
               " positions fits beside the weights; offload fewer layers (--n-gpu-layers), a shorter "
               "--ctx-per-session or a smaller range";
    }
    return s + "about --max-sessions " + std::to_string(std::min<uint64_t>(fit, n.max_sessions)) +
           " at --ctx-per-session " + std::to_string(n.ctx_per_session) +
           " would fit, or offload fewer layers (--n-gpu-layers), or a smaller range";
}

std::string describe_device_need(const MemoryNeed & n, const ComputeDevice & d) {
    std::string s = "device " + device_text(d) + ": " + (d.description.empty() ? std::string() : d.description + ", ") +
                    "free " + mib(d.memory_free) + " of " + mib(d.memory_total) + " MiB";
    if (!d.accelerator && n.device_total() == 0) return s + "; nothing offloaded";
    return s + "; " + range_text(n) + " need " + mib(n.device_total()) + " MiB there: " + parts_text(n);
}

std::string device_need_json(const MemoryNeed & n, const ComputeDevice & d, const std::string & refusal) {
    std::ostringstream j;
    j << "{\"backend\":" << json_text(d.backend) << ",\"name\":" << json_text(d.name)
      << ",\"description\":" << json_text(d.description) << ",\"device_class\":" << json_text(d.device_class)
      << ",\"accelerator\":" << (d.accelerator ? "true" : "false") << ",\"weights_bytes\":" << n.device_weights
      << ",\"kv_bytes\":" << n.device_kv << ",\"compute_bytes\":" << n.device_compute
      << ",\"allowance_bytes\":" << n.device_allowance << ",\"need_bytes\":" << n.device_total()
      << ",\"memory_total_bytes\":" << d.memory_total << ",\"memory_free_bytes\":" << d.memory_free
      << ",\"fits\":" << (refusal.empty() ? "true" : "false") << ",\"refusal\":" << json_text(refusal) << "}";
    return j.str();
}

ComputeDevice fake_device(const std::string & device_class, uint64_t memory_mb, uint64_t need_mb, const HostMemory & host) {
    ComputeDevice d;
    d.device_class = device_class;
    d.backend = device_class.substr(0, device_class.find(':'));
    d.name = "fake";
    d.description = "fake device (--fake-device-class " + device_class + ")";
    d.accelerator = device_class != "cpu";
    d.memory_total = memory_mb ? memory_mb * kMiB : host.total;
    d.memory_free = memory_mb ? memory_mb * kMiB : host.available;
    d.memory_predicted = need_mb * kMiB;
    return d;
}

DeviceMemoryReader::Read fake_device_memory_read(uint64_t memory_mb) {
    if (memory_mb == 0) return host_memory_read();
    return [bytes = memory_mb * kMiB](uint64_t * free, uint64_t * total) {
        *free = *total = bytes;
        return true;
    };
}

MemoryNeed fake_device_need(uint32_t layer_start, uint32_t layer_end, uint32_t n_layer, uint32_t max_sessions,
                            uint32_t ctx_per_session, uint64_t need_mb) {
    MemoryNeed n;
    n.n_layer = n_layer;
    n.layer_start = layer_start;
    n.layer_end = layer_end;
    n.head = layer_start == 0;
    n.tail = layer_end == n_layer;
    n.max_sessions = max_sessions;
    n.ctx_per_session = ctx_per_session;
    n.device_weights = need_mb * kMiB;
    return n;
}

}  // namespace dgr::worker
