// The device class (worker/device_class.h), the one function certification is keyed by: every
// branch of the rule, the slug's bounds and characters, the vendor read from a description, the
// architecture and driver version read from what ggml-cuda logs and the NVIDIA module says, and
// the device's memory (worker/device_memory.h: /proc/meminfo, re-read at most once per interval).
#include "worker/device_class.h"
#include "worker/device_memory.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "check.h"

using namespace dgr::worker;

namespace {

// the class of a device described as the backend would
std::string cls(const std::string & backend, const std::string & description, const std::string & arch = "",
                const std::string & name = "") {
    ComputeDevice d;
    d.backend = backend;
    d.description = description;
    d.name = name;
    d.architecture = arch;
    d.vendor = device_vendor(backend, description, name);
    return device_class_of(d);
}

void check_class(const std::string & got, const std::string & want) {
    CHECK(got == want, "class '%s', want '%s'", got.c_str(), want.c_str());
    CHECK(valid_device_class(got), "class '%s' is not a valid class", got.c_str());
}

}  // namespace

int main() {
    // the rule, branch by branch
    check_class(cls("cpu", "AMD EPYC 7B13 64-Core Processor"), "cpu");
    check_class(cls("cpu", ""), "cpu");
    check_class(cls("vulkan", "llvmpipe (LLVM 15.0.6, 256 bits)", "", "Vulkan0"), "vulkan:llvmpipe");
    check_class(cls("vulkan", "lavapipe"), "vulkan:llvmpipe");
    check_class(cls("vulkan", "NVIDIA GeForce RTX 4090"), "vulkan:nvidia");
    check_class(cls("vulkan", "NVIDIA H100 80GB HBM3"), "vulkan:nvidia");
    check_class(cls("vulkan", "AMD Radeon RX 7900 XTX (RADV NAVI31)"), "vulkan:amd");
    check_class(cls("vulkan", "Intel(R) Arc(tm) A770 Graphics (DG2)"), "vulkan:intel");
    check_class(cls("vulkan", "Intel(R) UHD Graphics 630 (CFL GT2)"), "vulkan:intel");
    check_class(cls("cuda", "NVIDIA H100 80GB HBM3", "sm_90"), "cuda:sm_90");
    check_class(cls("cuda", "NVIDIA GeForce RTX 5090", "sm_120"), "cuda:sm_120");
    check_class(cls("cuda", "NVIDIA H100 80GB HBM3"), "cuda:nvidia-h100-80gb-hbm3");
    check_class(cls("cuda", "Tesla V100-SXM2-16GB"), "cuda:tesla-v100-sxm2-16gb");
    check_class(cls("hip", "AMD Instinct MI300X", "gfx942"), "hip:gfx942");
    check_class(cls("vulkan", "Apple M2 Max"), "vulkan:apple-m2-max");  // unknown vendor: the slug
    check_class(cls("metal", "Apple M2 Max"), "metal:apple-m2-max");
    check_class(cls("sycl", "Intel(R) Data Center GPU Max 1550"), "sycl:intel");
    check_class(cls("vulkan", "", "", "Vulkan0"), "vulkan:vulkan0");      // no description: the name
    check_class(cls("vulkan", ""), "vulkan:unknown");
    check_class(cls("", "Some Device"), "unknown:some-device");
    check_class(cls("CUDA", "NVIDIA A100-SXM4-80GB", "SM_80"), "cuda:sm_80");  // case folded
    // a description made only of punctuation has no slug
    check_class(cls("vulkan", "(*) -- !!"), "vulkan:unknown");

    // the slug: letters, digits and single hyphens, bounded, no hyphen at the ends
    CHECK(device_slug("  NVIDIA   GeForce RTX 4090 (Ada)  ") == "nvidia-geforce-rtx-4090-ada", "slug: %s",
          device_slug("  NVIDIA   GeForce RTX 4090 (Ada)  ").c_str());
    const std::string long_text(200, 'x');
    CHECK(device_slug(long_text).size() == kSlugMax, "slug bound");
    const std::string spaced = "abcdefghi jklmnopqr stuvwxyz0 123456789 abcdefghi";
    const std::string s = device_slug(spaced);
    CHECK(s.size() <= kSlugMax && s.back() != '-' && s.front() != '-', "bounded slug '%s'", s.c_str());
    for (char c : s) CHECK((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-', "slug char '%c'", c);
    CHECK(s.find("--") == std::string::npos, "single hyphens: %s", s.c_str());
    const std::string long_class = cls("vulkan", std::string(300, 'q') + " GPU");
    CHECK(long_class.size() <= kClassMax && valid_device_class(long_class), "long class '%s'", long_class.c_str());

    // the vendor: words, not parts of words; the backend's only maker as the last resort
    CHECK(device_vendor("vulkan", "Diamond Samdung 3D") == "", "no vendor");
    CHECK(device_vendor("vulkan", "AMD Radeon Pro W7900") == "amd", "amd");
    CHECK(device_vendor("cuda", "Some Board") == "nvidia", "cuda fallback");
    CHECK(device_vendor("hip", "Some Board") == "amd", "hip fallback");
    CHECK(device_vendor("vulkan", "llvmpipe (LLVM 19.1.7, 256 bits)") == "mesa", "mesa");
    CHECK(device_vendor("cpu", "Intel(R) Xeon(R) Platinum 8480+") == "intel", "cpu vendor");

    // what --fake-device-class accepts
    CHECK(valid_device_class("cpu") && valid_device_class("cuda:sm_90") && valid_device_class("a.b-c_d:e9"), "valid");
    CHECK(!valid_device_class("") && !valid_device_class(std::string(65, 'a')) && valid_device_class(std::string(64, 'a')),
          "length bounds");
    CHECK(!valid_device_class("Cuda:sm_90") && !valid_device_class("cuda sm90") && !valid_device_class("cuda/sm90"),
          "characters");

    // the architecture from ggml-cuda's device log
    int idx = -1;
    std::string arch;
    CHECK(parse_device_arch_line("  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, VMM: yes, VRAM: 81079 MiB\n",
                                 &idx, &arch) && idx == 0 && arch == "sm_90", "cuda line: %d %s", idx, arch.c_str());
    CHECK(parse_device_arch_line("  Device 3: NVIDIA GeForce RTX 5090, compute capability 12.0, VMM: yes", &idx, &arch) &&
          idx == 3 && arch == "sm_120", "sm_120: %d %s", idx, arch.c_str());
    CHECK(parse_device_arch_line("  Device 1: AMD Instinct MI300X, gfx942:sramecc+:xnack- (0x942), VMM: no, Wave Size: 64",
                                 &idx, &arch) && idx == 1 && arch == "gfx942", "hip line: %d %s", idx, arch.c_str());
    CHECK(!parse_device_arch_line("ggml_cuda_init: found 1 CUDA devices (Total VRAM: 81079 MiB):", &idx, &arch), "header");
    CHECK(!parse_device_arch_line("  Device 0: Some GPU, VMM: yes", &idx, &arch), "no capability");
    CHECK(!parse_device_arch_line("  Device x: NVIDIA, compute capability 9.0", &idx, &arch), "no index");
    CHECK(!parse_device_arch_line("  Device 0: NVIDIA, compute capability 9", &idx, &arch), "no minor");

    // the NVIDIA kernel module's version
    CHECK(parse_nvidia_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 "
                                      "UTC 2024\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n") == "550.54.15",
          "proprietary module");
    CHECK(parse_nvidia_driver_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.15  Release Build"
                                      "  (dvs-builder@U16)  Thu Jan 23 2025\n") == "570.86.15", "open module");
    CHECK(parse_nvidia_driver_version("GCC version:  gcc version 12.2.0\n").empty(), "no NVRM line");
    CHECK(parse_nvidia_driver_version("").empty(), "empty");

    // the host's RAM and a throttled reader
    char path[] = "/tmp/dgr-meminfo-XXXXXX";
    const int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    std::ofstream(path) << "MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n";
    const HostMemory hm = read_host_memory(path);
    CHECK(hm.total == 16384000ull * 1024 && hm.available == 8192000ull * 1024, "meminfo %llu %llu",
          (unsigned long long) hm.total, (unsigned long long) hm.available);
    CHECK(read_host_memory("/nonexistent/meminfo").total == 0, "no meminfo");
    uint64_t free = 0, total = 0;
    DeviceMemoryReader host(host_memory_read(path));
    host.get(&free, &total);
    CHECK(free == 8192000ull * 1024 && total == 16384000ull * 1024, "host reader");
    std::remove(path);

    uint64_t value = 100;
    DeviceMemoryReader slow([&value](uint64_t * f, uint64_t * t) { *f = value; *t = 1000; return true; },
                            std::chrono::hours(1));
    slow.get(&free, &total);
    value = 200;
    for (int i = 0; i < 50; ++i) slow.get(&free, &total);
    CHECK(slow.reads() == 1 && free == 100 && total == 1000, "one read per interval: %llu reads, free %llu",
          (unsigned long long) slow.reads(), (unsigned long long) free);
    DeviceMemoryReader fast([&value](uint64_t * f, uint64_t * t) { *f = value; *t = 1000; return true; },
                            std::chrono::milliseconds(0));
    fast.get(&free, &total);
    value = 300;
    fast.get(&free, &total);
    CHECK(fast.reads() == 2 && free == 300, "re-read: free %llu", (unsigned long long) free);
    DeviceMemoryReader failing([](uint64_t *, uint64_t *) { return false; });
    failing.get(&free, &total);
    CHECK(free == 0 && total == 0, "no figures");

    if (g_failures) {
        std::fprintf(stderr, "device_class_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("device_class_test: ok\n");
    return 0;
}
