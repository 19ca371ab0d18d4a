#include "worker/memory_plan.h"

#include "common/identity.h"
#include "common/shard_model.h"
#include "worker/cgroup_memory.h"
#include "worker/device_info.h"
#include "worker/kv_budget.h"
#include "worker/llama_backend.h"

#include "llama.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace dgr::worker {

namespace {

constexpr double kMiB = 1048576.0;
// What serving adds to the process measured after the metadata load: the gRPC server and its
// threads, the scheduler, allocator arenas. Measured on the CPU build (SmolLM2 and synthetic
// models, 1-16 sessions): 4-8 MiB; docs/memory.md.
constexpr uint64_t kServeAllowance = 8ull << 20;
// What an accelerator's backend allocates outside llama.cpp's buffers: ggml-cuda's memory pool
// (quantized or f16 copies of a matmul's operands), the cuBLAS workspace, CUDA graphs;
// ggml-vulkan's preallocated dequantization and split-k buffers and staging. A stated estimate
// (docs/backends.md, "VRAM admission"), not a measurement: the CUDA context itself is not in it,
// as a device's free memory is read after the context exists.
constexpr uint64_t kDeviceAllowance = 256ull << 20;
// The kernel's default fault_around_bytes: a fault on a mapped file maps up to this much of the
// page cache around it.
constexpr uint64_t kFaultAround = 64ull << 10;

std::string mib(uint64_t b) {
    char s[32];
    std::snprintf(s, sizeof s, "%.1f", (double) b / kMiB);
    return s;
}

bool held_by_range(const std::string & name, uint32_t start, uint32_t end, uint32_t n_layer, bool tied) {
    if (name.rfind("blk.", 0) == 0) {
        const uint32_t n = (uint32_t) std::strtoul(name.c_str() + 4, nullptr, 10);
        return n >= start && n < end;
    }
    const bool head = start == 0, tail = end == n_layer;
    if (name.rfind("token_embd.", 0) == 0) return head || (tail && tied);
    if (name.rfind("output_norm.", 0) == 0 || name.rfind("output.", 0) == 0) return tail;
    return true;  // shared tensors (llama: rope_freqs.weight) are created by every range
}

// the KV cells serve.cpp gives the context for these options (kv_budget.h)
void kv_shape(const MemoryPlanRequest & r, uint64_t * cells, uint32_t * ctx) {
    uint64_t kv = r.kv_cells ? r.kv_cells : default_kv_cells(r.max_sessions, r.ctx_per_session);
    uint32_t c = r.ctx_per_session;
    if (!r.kv_unified) {
        const StreamShare s = per_session_streams(kv, r.kv_cells != 0, r.max_sessions, r.ctx_per_session);
        kv = s.kv_cells;
        c = s.ctx_per_session;
    }
    *cells = kv;
    *ctx = c;
}

}  // namespace

uint64_t self_status_bytes(const char * field) {
    std::ifstream f("/proc/self/status");
    std::string line;
    const std::string want = std::string(field) + ":";
    while (std::getline(f, line)) {
        if (line.rfind(want, 0) == 0) return (uint64_t) std::strtoull(line.c_str() + want.size(), nullptr, 10) * 1024;
    }
    return 0;
}

uint64_t embedding_rows_bytes(const GgufTensor & t, uint64_t rows, uint64_t page) {
    const uint64_t n_rows = t.dims.size() >= 2 ? t.dims[1] : 1;
    const uint64_t whole = ((t.offset + t.n_bytes + page - 1) / page - t.offset / page) * page;
    if (n_rows == 0) return whole;
    const uint64_t row = (t.n_bytes + n_rows - 1) / n_rows;
    // a row faults in the pages it spans, and the kernel maps the cached pages around a fault
    // with it (fault-around: 64 KiB by default)
    const uint64_t per_row = std::max(kFaultAround, (row + page - 1) / page * page + page);
    return std::min(whole, std::min(rows, n_rows) * per_row);
}

bool range_weight_bytes(const std::string & model, uint32_t layer_start, uint32_t layer_end, uint64_t embd_rows,
                        uint64_t * bytes, uint32_t * n_layer, uint32_t * n_parts, std::string * model_path,
                        std::string * error) {
    GgufSet set;
    if (!set.open(model, error)) return false;
    if (model_path) *model_path = set.path();
    const GgufHeader & g = set.first();
    std::string arch;
    uint32_t nl = 0;
    if (!g.get_string("general.architecture", &arch) || !g.get_u32(arch + ".block_count", &nl) || nl == 0) {
        if (error) *error = model + ": general.architecture or its block_count is missing; not a model GGUF";
        return false;
    }
    uint32_t start = layer_start, end = layer_end ? layer_end : nl;
    uint32_t s_start = 0, s_end = 0;  // a dgr slice loaded without --layers serves its own range
    if (!layer_end && g.get_u32("dgr.slice.layer_start", &s_start) && g.get_u32("dgr.slice.layer_end", &s_end)) {
        start = s_start;
        end = s_end;
    }
    if (start >= end || end > nl) {
        if (error) *error = "layers [" + std::to_string(start) + ", " + std::to_string(end) + ") are not a range of " +
                            model + "'s " + std::to_string(nl) + " layers";
        return false;
    }
    bool tied = true;
    for (const TensorRef & t : set.tensors()) {
        if (t.tensor->name == "output.weight") tied = false;
    }
    // the token embedding is read row by row (get_rows) unless this range also multiplies by it
    // (a tied output on the tail): its resident part is the rows a batch touches, not the tensor
    const bool embd_by_rows = start == 0 && !(end == nl && tied) && embd_rows > 0;
    // the pages the held tensors occupy, per part (a page shared by two held tensors counts once)
    const uint64_t page = (uint64_t) ::sysconf(_SC_PAGESIZE);
    uint64_t total = 0;
    for (size_t p = 0; p < set.n_parts(); ++p) {
        std::vector<std::pair<uint64_t, uint64_t>> spans;
        for (const TensorRef & t : set.tensors()) {
            if (t.part_index != p || !held_by_range(t.tensor->name, start, end, nl, tied)) continue;
            if (embd_by_rows && t.tensor->name.rfind("token_embd.", 0) == 0) {
                total += embedding_rows_bytes(*t.tensor, embd_rows, page);
                continue;
            }
            spans.emplace_back(t.tensor->offset / page, (t.tensor->offset + t.tensor->n_bytes + page - 1) / page);
        }
        std::sort(spans.begin(), spans.end());
        uint64_t lo = 0, hi = 0;
        for (const auto & [a, b] : spans) {
            if (hi > lo && a <= hi) {
                hi = std::max(hi, b);
                continue;
            }
            total += (hi - lo) * page;
            lo = a;
            hi = b;
        }
        total += (hi - lo) * page;
    }
    *bytes = total;
    if (n_layer) *n_layer = nl;
    if (n_parts) *n_parts = (uint32_t) set.n_parts();
    return true;
}

bool plan_memory(const MemoryPlanRequest & req, MemoryNeed * need, std::string * error) {
    *need = MemoryNeed{};
    MemoryNeed & n = *need;
    std::string path;
    // the embedding rows resident at once: one batch's tokens plus every session's next token
    const uint64_t embd_rows = (uint64_t) req.max_batch_tokens + req.max_sessions;
    if (!range_weight_bytes(req.model, req.layer_start, req.layer_end, embd_rows, &n.weights, &n.n_layer, &n.n_parts,
                            &path, error)) {
        return false;
    }
    kv_shape(req, &n.kv_cells, &n.ctx_per_session);
    n.max_sessions = req.max_sessions;
    // llama.cpp's own figures: the model and a context as LlamaBackend::create makes them, with
    // no_alloc (nothing is read from the weights or allocated)
    ShardModelOptions mo;
    mo.path = path;
    mo.layer_start = (int32_t) req.layer_start;
    mo.layer_end = (int32_t) req.layer_end;
    mo.n_gpu_layers = req.n_gpu_layers;
    mo.no_alloc = true;
    auto model = ShardModel::load(mo, error);
    if (!model) return false;
    n.layer_start = (uint32_t) model->layer_start();
    n.layer_end = (uint32_t) model->layer_end();
    n.head = model->is_head();
    n.tail = model->is_tail();
    ShardContextOptions co;
    co.n_ctx = (uint32_t) n.kv_cells;
    co.n_batch = co.n_ubatch = req.max_batch_tokens;
    co.n_seq_max = req.max_sessions;
    co.kv_unified = req.kv_unified;
    co.n_threads = req.threads;
    co.n_outputs_max = llama_outputs_max(req.max_sessions);
    auto ctx = ShardContext::create(*model, co, error);
    if (!ctx) return false;
    const MemoryUse mu = ctx->memory_use();
    // host memory only: what an accelerator holds is reported apart (device)
    n.kv = mu.kv - mu.device_kv;
    n.kv_per_cell = n.kv_cells ? (mu.kv + n.kv_cells - 1) / n.kv_cells : 0;
    n.copied = mu.weights_copied;
    n.device = mu.device;
    // the output buffer (llama_context::output_reserve, not in the breakdown): logits for one
    // row per sequence, and for a non-tail the boundary rows of a whole batch
    const uint64_t out = (uint64_t) model->n_vocab() * 4 * req.max_sessions +
                         (n.tail ? 0 : (uint64_t) model->n_embd() * 4 * req.max_batch_tokens);
    n.compute = mu.scratch - mu.device_compute + out;
    // offloaded layers' weights are read through the mapping once, then live on the accelerator
    n.weights -= std::min(n.weights, mu.device_weights);
    // the compute device's share (device admission, device_plan.h)
    ggml_backend_dev_t dev = compute_device(req.n_gpu_layers);
    if (dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        const DeviceMemoryUse du = ctx->memory_on(dev);
        n.device_weights = du.weights;
        n.device_kv = du.kv;
        n.device_compute = du.compute;
        n.device_allowance = kDeviceAllowance;
    }
    ctx.reset();
    model.reset();
    n.runtime = self_status_bytes("VmRSS") + kServeAllowance;
    return true;
}

MemoryBudget memory_budget(double memory_budget_mb, const std::string & proc_self_cgroup, const std::string & cgroup_root) {
    MemoryBudget b;
    if (memory_budget_mb > 0) {
        b.bytes = (uint64_t) (memory_budget_mb * kMiB);
        char s[64];
        std::snprintf(s, sizeof s, "--memory-budget-mb %g", memory_budget_mb);
        b.source = s;
    }
    const CgroupLimit lim = cgroup_memory_limit(proc_self_cgroup, cgroup_root);
    if (lim.limited && (b.bytes == 0 || lim.bytes < b.bytes)) {
        b.bytes = lim.bytes;
        b.source = "cgroup memory.max (" + lim.file + ")";
    }
    return b;
}

std::string admission_refusal(const MemoryNeed & n, const MemoryBudget & b, bool kv_unified) {
    if (b.bytes == 0) return {};
    // --memory-budget-mb is what the shard holds (weights, KV, compute), as it always was;
    // a cgroup limit is the whole process, so the process itself (runtime) counts too
    const bool whole_process = b.source.rfind("cgroup", 0) == 0;
    const uint64_t runtime = whole_process ? n.runtime : 0;
    const uint64_t fixed = n.weights + n.compute + runtime;
    const uint64_t need = fixed + n.kv;
    if (need <= b.bytes) return {};
    std::string s = "layers [" + std::to_string(n.layer_start) + ", " + std::to_string(n.layer_end) + ") need " +
                    mib(need) + " MiB (weights " + mib(n.weights) + " + KV " + mib(n.kv) + " for " +
                    std::to_string(n.max_sessions) + " sessions x " + std::to_string(n.ctx_per_session) +
                    " positions + compute " + mib(n.compute) + (whole_process ? " + runtime " + mib(runtime) : "") +
                    "), more than the budget of " + mib(b.bytes) + " MiB (" + b.source + "): ";
    if (fixed >= b.bytes || n.kv_per_cell == 0) {
        const uint32_t layers = n.layer_end - n.layer_start;
        const uint64_t per_layer = layers ? n.weights / layers : 0;
        const uint64_t room = b.bytes > n.compute + runtime ? b.bytes - n.compute - runtime : 0;
        const uint64_t fit = per_layer ? room / per_layer : 0;
        return s + "the range itself is too large (its weights and compute alone need " + mib(fixed) +
               " MiB); about " + std::to_string(std::min<uint64_t>(fit, layers)) + " of its " +
               std::to_string(layers) + " layers would fit with no KV: split the model over more hosts";
    }
    const uint64_t left = b.bytes - fixed;
    const uint64_t cells_left = left / n.kv_per_cell;
    const uint64_t pad = kv_unified ? 1 : kKvStreamPad;
    const uint64_t per_session_cells = (n.ctx_per_session + pad - 1) / pad * pad;
    const uint64_t sessions_fit = per_session_cells ? cells_left / per_session_cells : 0;
    const uint64_t ctx_fit = n.max_sessions ? cells_left / n.max_sessions / pad * pad : 0;
    if (sessions_fit == 0 && ctx_fit == 0) {
        return s + "the KV left (" + mib(left) + " MiB) holds no session of " + std::to_string(pad) +
               " positions; use a smaller range or a larger budget";
    }
    s += "would fit: --max-sessions " + std::to_string(sessions_fit) + " at --ctx-per-session " +
         std::to_string(n.ctx_per_session);
    if (ctx_fit > 0) {
        s += ", or --ctx-per-session " + std::to_string(ctx_fit) + " at --max-sessions " + std::to_string(n.max_sessions);
    }
    return s + ", or a smaller range";
}

std::string describe_need(const MemoryNeed & n) {
    return "layers [" + std::to_string(n.layer_start) + ", " + std::to_string(n.layer_end) + ") of " +
           std::to_string(n.n_layer) + " need " + mib(n.total()) + " MiB: weights " + mib(n.weights) +
           (n.copied ? " (" + mib(n.copied) + " of them repacked)" : std::string()) + ", KV " + mib(n.kv) + " (" +
           std::to_string(n.kv_cells) + " cells: " + std::to_string(n.max_sessions) + " sessions x " +
           std::to_string(n.ctx_per_session) + "), compute " + mib(n.compute) + ", runtime " + mib(n.runtime) +
           (n.device ? "; on the accelerator " + mib(n.device) : std::string());
}

std::string need_json(const MemoryNeed & n, const MemoryBudget & b, const std::string & refusal,
                      const std::string & device_json) {
    std::ostringstream j;
    std::string r;
    for (char c : refusal) {
        if (c == '"' || c == '\\') r += '\\';
        r += c;
    }
    std::string src;
    for (char c : b.source) {
        if (c == '"' || c == '\\') src += '\\';
        src += c;
    }
    j << "{\"layer_start\":" << n.layer_start << ",\"layer_end\":" << n.layer_end << ",\"n_layer\":" << n.n_layer
      << ",\"head\":" << (n.head ? "true" : "false") << ",\"tail\":" << (n.tail ? "true" : "false")
      << ",\"n_parts\":" << n.n_parts << ",\"max_sessions\":" << n.max_sessions
      << ",\"ctx_per_session\":" << n.ctx_per_session << ",\"kv_cells\":" << n.kv_cells
      << ",\"kv_bytes_per_cell\":" << n.kv_per_cell << ",\"weights_bytes\":" << n.weights
      << ",\"copied_bytes\":" << n.copied << ",\"kv_bytes\":" << n.kv << ",\"compute_bytes\":" << n.compute
      << ",\"runtime_bytes\":" << n.runtime << ",\"device_bytes\":" << n.device << ",\"total_bytes\":" << n.total()
      << ",\"budget_bytes\":" << b.bytes << ",\"budget_source\":\"" << src << "\",\"fits\":"
      << (refusal.empty() ? "true" : "false") << ",\"refusal\":\"" << r << "\"";
    if (!device_json.empty()) j << ",\"device\":" << device_json;
    j << "}";
    return j.str();
}

}  // namespace dgr::worker
