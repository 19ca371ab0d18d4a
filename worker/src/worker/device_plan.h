// Device (VRAM) admission: before the weights are loaded, what the range needs on its compute
// device (MemoryNeed::device_*: llama.cpp's simulated buffers there plus an allowance, see
// memory_plan.cpp) against what the device has free; refused in one line with the figures by
// part (docs/backends.md, "VRAM admission"). The fake model's device (--fake-device-*) is admitted
// by the same rule, its need given by --fake-device-need-mb.
#pragma once

#include "worker/device_class.h"
#include "worker/device_memory.h"
#include "worker/memory_plan.h"

#include <cstdint>
#include <string>

namespace dgr::worker {

// Empty when need.device_total() fits dev.memory_free (or the device reports no memory), else one
// line: the need by part (weights, KV for S sessions x C positions, compute, allowance), the free
// and total memory, and what would fit.
std::string device_admission_refusal(const MemoryNeed & need, const ComputeDevice & dev);

// One line for the log: the device, its class and memory, and the need by part.
std::string describe_device_need(const MemoryNeed & need, const ComputeDevice & dev);

// The `device` object of `plan-memory --json`.
std::string device_need_json(const MemoryNeed & need, const ComputeDevice & dev, const std::string & refusal);

// --fake-device-class / --fake-device-memory-mb / --fake-device-need-mb: the fake model's device.
// memory_mb 0: the host's RAM figures (host: read_host_memory()).
ComputeDevice fake_device(const std::string & device_class, uint64_t memory_mb, uint64_t need_mb, const HostMemory & host);
// What the fake device's free memory reads as when asked again (fixed, or the host's RAM).
DeviceMemoryReader::Read fake_device_memory_read(uint64_t memory_mb);
// The fake range's device need in the shape admission reads (all of it counted as weights).
MemoryNeed fake_device_need(uint32_t layer_start, uint32_t layer_end, uint32_t n_layer, uint32_t max_sessions,
                            uint32_t ctx_per_session, uint64_t need_mb);

}  // namespace dgr::worker
