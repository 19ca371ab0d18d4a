// What ggml says about the device a range computes on (GetCapabilityResponse.device): which
// device that is, its name, description, memory, and what can be learnt of its driver and
// architecture. device_class.h turns these into the device class.
//
//   device        the first accelerator llama.cpp offloads layers to when --n-gpu-layers is not
//                 0: the first GPU in ggml's order (RPC devices aside), else the first integrated
//                 GPU, as llama.cpp's own device list orders them; otherwise the CPU
//   memory        ggml_backend_dev_get_props (the backend's total and free); the CPU: the host's
//                 MemTotal / MemAvailable
//   architecture  CUDA/HIP only: ggml-cuda logs each device's compute capability (gfx name on
//                 HIP) once, when its backend registers; take_device_census() reads that log line
//                 (ggml has no API for it, and the worker does not link the CUDA runtime itself).
//                 Empty when the census did not see the registration.
//   driver        NVIDIA devices: the kernel module's version (/proc/driver/nvidia/version);
//                 empty for every other device (ggml does not report a driver version)
#pragma once

#include "worker/device_class.h"
#include "worker/device_memory.h"

#include "ggml-backend.h"

#include <string>

namespace dgr::worker {

// Registers ggml's backends (the first ggml_backend_dev_count()) with a tap on ggml's log that
// keeps the devices' architecture lines (the log still reaches the previous callback). Call it
// before anything else asks ggml for its devices (before llama_backend_init()); later calls do
// nothing.
void take_device_census();

// The architecture the census saw for the device named `name` ("CUDA0" -> its index 0); "" if none.
std::string census_architecture(const std::string & name);

// A GPU-class build that finds no device of its kind would still run: llama.cpp falls back to
// the CPU, while the worker's recipe (and every route's admission) names the built backend; serve
// refuses instead. The reason, empty when a device is present (or on a CPU build).
std::string missing_device(const char * backend);

// The device a range with `n_gpu_layers` computes on (see above); nullptr only when ggml has no
// device at all.
ggml_backend_dev_t compute_device(int32_t n_gpu_layers);

// Everything known about `dev` (nullptr: the CPU as the host sees it), with its class;
// `build_backend` names the backend of an accelerator ("vulkan"), the CPU's is "cpu".
ComputeDevice describe_device(ggml_backend_dev_t dev, const std::string & build_backend);

// A reader of dev's free and total memory (the host's RAM for the CPU or nullptr).
DeviceMemoryReader::Read device_memory_read(ggml_backend_dev_t dev);

}  // namespace dgr::worker
