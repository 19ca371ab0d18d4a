#include "worker/device_info.h"

#include "ggml.h"

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace dgr::worker {

namespace {

std::mutex g_mu;
bool g_census = false;
std::vector<std::string> g_lines;           // the log lines that name a device (bounded)
std::map<int, std::string> g_arch;          // device index -> architecture
ggml_log_callback g_prev = nullptr;
void * g_prev_data = nullptr;

void census_tap(enum ggml_log_level level, const char * text, void * /*data*/) {
    if (text && std::strstr(text, "Device ")) {
        std::lock_guard<std::mutex> lk(g_mu);
        if (g_lines.size() < 256) g_lines.emplace_back(text);
    }
    if (g_prev) g_prev(level, text, g_prev_data);
}

bool is_cpu(ggml_backend_dev_t dev) { return !dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU; }

// the trailing number of a device name ("CUDA1" -> 1); -1 when there is none
int name_index(const std::string & name) {
    size_t p = name.size();
    while (p > 0 && std::isdigit((unsigned char) name[p - 1])) --p;
    if (p == name.size() || name.size() - p > 6) return -1;
    return std::atoi(name.c_str() + p);
}

std::string read_small_file(const char * path) {
    std::ifstream f(path);
    std::string text(4096, '\0');
    f.read(text.data(), (std::streamsize) text.size());
    text.resize((size_t) f.gcount());
    return text;
}

}  // namespace

void take_device_census() {
    {
        std::lock_guard<std::mutex> lk(g_mu);
        if (g_census) return;
        g_census = true;
    }
    ggml_log_get(&g_prev, &g_prev_data);
    ggml_log_set(census_tap, nullptr);
    (void) ggml_backend_dev_count();  // registers the backends: ggml-cuda logs its devices now
    ggml_log_set(g_prev, g_prev_data);
    std::lock_guard<std::mutex> lk(g_mu);
    for (const std::string & line : g_lines) {
        int index = -1;
        std::string arch;
        if (parse_device_arch_line(line, &index, &arch) && !g_arch.count(index)) g_arch[index] = arch;
    }
}

std::string census_architecture(const std::string & name) {
    std::lock_guard<std::mutex> lk(g_mu);
    const auto it = g_arch.find(name_index(name));
    return it == g_arch.end() ? std::string() : it->second;
}

std::string missing_device(const char * backend) {
    if (std::strcmp(backend, "cpu") == 0) return {};
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        const auto t = ggml_backend_dev_type(ggml_backend_dev_get(i));
        if (t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) return {};
    }
    std::string why = std::string("this dgr-worker is built for backend ") + backend + " but sees no " + backend +
                      " device, and would compute on the CPU under a " + backend + " recipe";
    if (std::strcmp(backend, "vulkan") == 0) {
        why += "; a CPU Vulkan driver (Mesa llvmpipe) is used only when named: GGML_VK_VISIBLE_DEVICES=0";
    } else if (std::strcmp(backend, "cuda") == 0) {
        why += "; it needs an NVIDIA GPU and driver (nvidia-smi)";
    }
    return why + " (`dgr doctor --backend " + backend + "`; the CPU build: build/cpu/bin/dgr-worker)";
}

ggml_backend_dev_t compute_device(int32_t n_gpu_layers) {
    if (n_gpu_layers != 0) {
        ggml_backend_dev_t igpu = nullptr;
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const auto type = ggml_backend_dev_type(dev);
            if (type == GGML_BACKEND_DEVICE_TYPE_GPU) {
                if (std::strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0) continue;
                return dev;
            }
            if (type == GGML_BACKEND_DEVICE_TYPE_IGPU && !igpu) igpu = dev;
        }
        if (igpu) return igpu;
    }
    return ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
}

DeviceMemoryReader::Read device_memory_read(ggml_backend_dev_t dev) {
    if (is_cpu(dev)) return host_memory_read();
    return [dev](uint64_t * free, uint64_t * total) {
        size_t f = 0, t = 0;
        ggml_backend_dev_memory(dev, &f, &t);
        *free = f;
        *total = t;
        return t > 0;
    };
}

ComputeDevice describe_device(ggml_backend_dev_t dev, const std::string & build_backend) {
    ComputeDevice d;
    d.accelerator = !is_cpu(dev);
    d.backend = d.accelerator ? build_backend : "cpu";
    if (dev) {
        ggml_backend_dev_props p{};
        ggml_backend_dev_get_props(dev, &p);
        d.name = p.name ? p.name : "";
        d.description = p.description ? p.description : "";
    } else {
        d.name = "CPU";
    }
    device_memory_read(dev)(&d.memory_free, &d.memory_total);
    d.vendor = device_vendor(d.backend, d.description, d.name);
    if (d.accelerator) {
        // ggml-cuda's registries: CUDA, and the HIP and MUSA builds of the same code
        const char * reg = ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev));
        if (!std::strcmp(reg, "CUDA") || !std::strcmp(reg, "ROCm") || !std::strcmp(reg, "MUSA")) {
            d.architecture = census_architecture(d.name);
        }
        if (d.vendor == "nvidia") d.driver_version = parse_nvidia_driver_version(read_small_file("/proc/driver/nvidia/version"));
    }
    d.device_class = device_class_of(d);
    return d;
}

}  // namespace dgr::worker
