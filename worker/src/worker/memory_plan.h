// What a Shard needs in host memory, computed before anything is loaded (docs/memory.md):
//   weights  the pages of the tensors its range holds, read from the GGUF header(s) of the file
//            or of every part of a split set (mapped: resident once touched; a decode touches
//            every layer's). The head's token embedding is read row by row as tokens are seen:
//            it counts one batch's rows, since rows touched before are clean file pages the
//            kernel reclaims under a limit rather than a need (unless the tail multiplies by it)
//   copied   of the weights, those llama.cpp repacks (CPU_REPACK) into a buffer of its own:
//            the copy is anonymous memory of the same size, and the loader releases the file
//            pages it read them from (patch 0009), so they count once
//   kv       the KV cache for the cells the context is created with
//   compute  llama.cpp's compute buffers plus the output buffer (logits / boundary rows)
//   runtime  the process itself: code, libraries, vocabulary, gRPC (measured + an allowance)
// kv, compute and copied are llama.cpp's own figures: the model is loaded with no_alloc ("only
// load metadata and simulate memory allocations") and a context created from it, exactly as
// LlamaBackend::create would, and its memory breakdown read.
#pragma once

#include <cstdint>
#include <string>

#include "common/identity.h"
#include "worker/option_table.h"

namespace dgr::worker {

struct MemoryPlanRequest {
    std::string model;
    uint32_t layer_start = 0, layer_end = 0;  // end 0: n_layer
    uint32_t max_sessions = default_u32(Opt::kMaxSessions);
    uint32_t ctx_per_session = default_u32(Opt::kCtxPerSession);
    uint64_t kv_cells = default_u64(Opt::kKvCells);  // 0: from max_sessions x ctx_per_session (kv_budget.h)
    bool kv_unified = false;
    uint32_t max_batch_tokens = default_u32(Opt::kMaxBatchTokens);
    int32_t n_gpu_layers = default_i32(Opt::kNGpuLayers);
    int32_t threads = default_i32(Opt::kThreads);
};

struct MemoryNeed {
    uint32_t n_layer = 0, layer_start = 0, layer_end = 0;
    bool head = false, tail = false;
    uint32_t max_sessions = 0, ctx_per_session = 0;
    uint64_t kv_cells = 0;
    uint64_t weights = 0, copied = 0, kv = 0, compute = 0, runtime = 0;  // copied: part of weights
    uint64_t device = 0;         // on an accelerator (not host memory; not in total())
    // on the compute device alone (device_info.h: the first accelerator the layers go to; all 0
    // when that is the CPU), for device admission (device_plan.h): llama.cpp's buffers there, and
    // an allowance for what its backend allocates outside them
    uint64_t device_weights = 0, device_kv = 0, device_compute = 0, device_allowance = 0;
    uint64_t device_total() const { return device_weights + device_kv + device_compute + device_allowance; }
    uint64_t kv_per_cell = 0;    // kv / kv_cells
    uint32_t n_parts = 1;        // files of the model (split set)
    uint64_t total() const { return weights + kv + compute + runtime; }
};

// Fills *need for the request; false + *error (one line) when the model cannot be read.
bool plan_memory(const MemoryPlanRequest & req, MemoryNeed * need, std::string * error);

// Bytes of the pages that the tensors of [layer_start, layer_end) of `model` occupy (every part
// of a split set); the same rule as the patched loader (docs/identity.md "Slices"). A token
// embedding that the range only reads row by row (the head, unless it is also the tied output)
// counts embd_rows rows' pages (embedding_rows_bytes); embd_rows 0 counts it whole.
// *model_path: what llama.cpp is given (the file, or part 1 of a set when `model` names another part).
bool range_weight_bytes(const std::string & model, uint32_t layer_start, uint32_t layer_end, uint64_t embd_rows,
                        uint64_t * bytes, uint32_t * n_layer, uint32_t * n_parts, std::string * model_path,
                        std::string * error);

// The resident pages of `rows` rows of an embedding read row by row through the mapping: each
// row's pages plus the kernel's fault-around, at most the whole tensor.
uint64_t embedding_rows_bytes(const GgufTensor & t, uint64_t rows, uint64_t page);

// Where the budget comes from: --memory-budget-mb, the cgroup's memory.max, or both (smaller wins).
struct MemoryBudget {
    uint64_t bytes = 0;    // 0: no budget
    std::string source;    // "--memory-budget-mb 4096" / "cgroup memory.max (/sys/fs/cgroup/x/memory.max)"
};
MemoryBudget memory_budget(double memory_budget_mb, const std::string & proc_self_cgroup = "/proc/self/cgroup",
                           const std::string & cgroup_root = "/sys/fs/cgroup");

// The admission verdict: empty when `need` fits `budget`, else one line saying what is needed
// (weights / KV / compute), the budget and where it came from, and what would fit.
std::string admission_refusal(const MemoryNeed & need, const MemoryBudget & budget, bool kv_unified);

// One line for the log and a JSON object (the `plan-memory --json` output, read by dgr's Python side).
std::string describe_need(const MemoryNeed & need);
// device_json: the `device` member (device_plan.h: device_need_json), left out when empty.
std::string need_json(const MemoryNeed & need, const MemoryBudget & budget, const std::string & refusal,
                      const std::string & device_json = "");

// VmRSS / VmHWM of this process in bytes (0 when /proc is not there).
uint64_t self_status_bytes(const char * field);

}  // namespace dgr::worker
