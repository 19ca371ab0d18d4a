// A device's memory figures: the host's RAM (/proc/meminfo: the CPU device's, and the fake
// device's by default), and free memory re-read when asked (GetCapability, GetMetrics, a
// Prometheus scrape) at most once per interval, so that a burst of scrapes costs one read.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

namespace dgr::worker {

struct HostMemory {
    uint64_t total = 0;      // MemTotal
    uint64_t available = 0;  // MemAvailable (what can be allocated without swapping)
};

// MemTotal and MemAvailable of `meminfo` in bytes; zeros when it is unreadable.
HostMemory read_host_memory(const std::string & meminfo = "/proc/meminfo");

class DeviceMemoryReader {
public:
    // read(&free, &total): false when the figures are not available (the last ones hold)
    using Read = std::function<bool(uint64_t * free, uint64_t * total)>;
    explicit DeviceMemoryReader(Read read, std::chrono::milliseconds min_interval = std::chrono::milliseconds(1000))
        : read_(std::move(read)), min_interval_(min_interval) {}
    // The free and total bytes, read now unless the last read is younger than the interval.
    void get(uint64_t * free, uint64_t * total);
    uint64_t reads() const;  // reads done (tests)

private:
    Read read_;
    std::chrono::milliseconds min_interval_;
    mutable std::mutex mu_;
    bool have_ = false;
    std::chrono::steady_clock::time_point last_{};
    uint64_t free_ = 0, total_ = 0, reads_ = 0;
};

// A reader of the host's RAM (MemAvailable as free).
DeviceMemoryReader::Read host_memory_read(const std::string & meminfo = "/proc/meminfo");

}  // namespace dgr::worker
