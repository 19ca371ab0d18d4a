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

uint64_t fake_bytes_per_cell(uint32_t n_embd, uint32_t layer_start, uint32_t layer_end) {
    return 4ull * n_embd * (layer_end - layer_start);
}

}  // namespace dgr::worker
