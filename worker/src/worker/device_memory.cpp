#include "worker/device_memory.h"

#include <cstdlib>
#include <fstream>

namespace dgr::worker {

HostMemory read_host_memory(const std::string & meminfo) {
    HostMemory m;
    std::ifstream f(meminfo);
    std::string line;
    for (int n = 0; n < 64 && std::getline(f, line); ++n) {
        const auto kib = [&line](size_t skip) { return (uint64_t) std::strtoull(line.c_str() + skip, nullptr, 10) * 1024; };
        if (line.rfind("MemTotal:", 0) == 0) m.total = kib(9);
        if (line.rfind("MemAvailable:", 0) == 0) m.available = kib(13);
    }
    return m;
}

DeviceMemoryReader::Read host_memory_read(const std::string & meminfo) {
    return [meminfo](uint64_t * free, uint64_t * total) {
        const HostMemory m = read_host_memory(meminfo);
        if (m.total == 0) return false;
        *free = m.available;
        *total = m.total;
        return true;
    };
}

void DeviceMemoryReader::get(uint64_t * free, uint64_t * total) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto now = std::chrono::steady_clock::now();
    if (read_ && (!have_ || now - last_ >= min_interval_)) {
        uint64_t f = 0, t = 0;
        ++reads_;
        if (read_(&f, &t)) {
            free_ = f;
            total_ = t;
        }
        have_ = true;
        last_ = now;
    }
    *free = free_;
    *total = total_;
}

uint64_t DeviceMemoryReader::reads() const {
    std::lock_guard<std::mutex> lk(mu_);
    return reads_;
}

}  // namespace dgr::worker
