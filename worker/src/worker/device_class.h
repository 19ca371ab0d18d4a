// The compute device a worker's range runs on (GetCapabilityResponse.device) and its device
// class, the key recipes are certified by (docs/backends.md, "Devices and device classes").
// Pure: strings in, strings out; what ggml says about a device is read in device_info.h.
//
// The class rule (device_class_of), on the device's backend, description (else name), vendor and
// architecture:
//   backend cpu                            -> "cpu"
//   cuda / hip with an architecture        -> backend ":" architecture      ("cuda:sm_90", "hip:gfx942")
//   vendor mesa (llvmpipe, lavapipe)       -> backend ":llvmpipe"           ("vulkan:llvmpipe")
//   other backends, vendor nvidia/amd/intel -> backend ":" vendor           ("vulkan:nvidia")
//   anything else                          -> backend ":" slug(description) ("cuda:nvidia-h100-80gb-hbm3")
// A slug is lower case letters, digits and single hyphens, at most kSlugMax characters; a class
// is at most kClassMax characters of [a-z0-9:_.-] (valid_device_class).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dgr::worker {

struct ComputeDevice {
    std::string backend;         // "cpu" for the CPU device, else the build's backend ("vulkan", "cuda")
    std::string name;            // ggml's: "CPU", "Vulkan0", "CUDA0"
    std::string description;     // ggml's: "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H100 80GB HBM3"
    std::string vendor;          // device_vendor(); empty: unknown
    std::string driver_version;  // empty: not known (device_info.h says where it comes from)
    std::string architecture;    // "sm_90"; empty: not known
    std::string device_class;    // device_class_of()
    uint64_t memory_total = 0, memory_free = 0;  // bytes (the host's RAM for the CPU); 0: not reported
    uint64_t memory_predicted = 0;  // what device admission predicted the range needs there (0: nothing offloaded)
    bool accelerator = false;       // not the CPU: layers are offloaded to it
};

constexpr size_t kSlugMax = 40;
constexpr size_t kClassMax = 64;

// Lower case letters and digits of `text`, every other run of characters one hyphen, no hyphen at
// either end, at most `max` characters; "" when nothing is left.
std::string device_slug(const std::string & text, size_t max = kSlugMax);

// The maker, from the description (else the name): "nvidia", "amd", "intel", "mesa" (llvmpipe,
// lavapipe: Mesa's CPU drivers); failing those, the backend's only maker (cuda -> nvidia, hip ->
// amd); "" when unknown.
std::string device_vendor(const std::string & backend, const std::string & description, const std::string & name = "");

// The device class of `d` (the rule above), from d.backend, d.description (d.name when empty),
// d.vendor and d.architecture.
std::string device_class_of(const ComputeDevice & d);

// 1..kClassMax characters, each of [a-z0-9:_.-] (what --fake-device-class accepts).
bool valid_device_class(const std::string & cls);

// A line of ggml-cuda's device log, "  Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0,
// VMM: yes, VRAM: 81079 MiB" (CUDA: -> "sm_90") or "  Device 0: AMD Instinct MI300X,
// gfx942:sramecc+:xnack- (0x942), ..." (HIP: -> "gfx942"): true with the device index and the
// architecture, false for any other line.
bool parse_device_arch_line(const std::string & line, int * index, std::string * arch);

// The version in the text of /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64
// Kernel Module  550.54.15  Tue Mar ..."): "550.54.15"; "" when there is none.
std::string parse_nvidia_driver_version(const std::string & text);

}  // namespace dgr::worker
