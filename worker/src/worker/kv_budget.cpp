#include "worker/kv_budget.h"

#include <algorithm>

namespace dgr::worker {

uint64_t default_kv_cells(uint32_t max_sessions, uint32_t ctx_per_session) {
    return std::min<uint64_t>((uint64_t) max_sessions * ctx_per_session, 65536);
}

uint64_t cells_for_mib(double mb, uint64_t bytes_per_cell) {
    return bytes_per_cell ? (uint64_t) (mb * 1048576.0 / (double) bytes_per_cell) : 0;
}

StreamShare per_session_streams(uint64_t kv_cells, bool sized, uint32_t max_sessions, uint32_t ctx_per_session) {
    uint64_t per = sized ? kv_cells / max_sessions : ctx_per_session;
    per = (per + kKvStreamPad - 1) / kKvStreamPad * kKvStreamPad;
    StreamShare s;
    s.ctx_per_session = (uint32_t) std::min<uint64_t>(ctx_per_session, per);
    s.kv_cells = per * max_sessions;
    return s;
}

MemoryFit fit_memory_budget(uint64_t budget, const BackendInfo & in, bool kv_unified, uint32_t max_sessions,
                            uint32_t ctx_per_session) {
    MemoryFit f;
    f.ctx_per_session = ctx_per_session;
    f.kv_cells = in.kv_cells;
    const uint64_t fixed = in.weight_bytes + in.scratch_bytes;
    if (fixed >= budget) {
        f.outcome = MemoryFit::no_room;
        return f;
    }
    f.left_bytes = budget - fixed;
    if (fixed + in.kv_bytes <= budget) return f;
    const uint64_t per_cell = std::max<uint64_t>(1, in.kv_bytes / std::max<uint64_t>(1, in.kv_cells));
    uint64_t cells = f.left_bytes / per_cell;
    if (!kv_unified) {
        const uint64_t per = cells / max_sessions / kKvStreamPad * kKvStreamPad;
        if (per == 0) {
            f.outcome = MemoryFit::under_a_stream;
            return f;
        }
        f.ctx_per_session = (uint32_t) std::min<uint64_t>(ctx_per_session, per);
        cells = per * max_sessions;
    }
    f.outcome = MemoryFit::cut;
    f.kv_cells = cells;
    return f;
}

uint64_t fake_bytes_per_cell(uint32_t n_embd, uint32_t layer_start, uint32_t layer_end) {
    return 4ull * n_embd * (layer_end - layer_start);
}

}  // namespace dgr::worker
