// KV budget sizing at startup (`dgr-worker serve`): how many KV cells the context gets from
// --kv-cells / --kv-budget-mb, and how they split into per-session streams (--memory-budget-mb
// is checked against the whole need before loading: worker/memory_plan.h). Pure arithmetic (no
// model), so CTest checks it.
#pragma once

#include "worker/backend.h"

#include <cstdint>

namespace dgr::worker {

// llama.cpp pads each per-sequence KV stream to this many cells.
constexpr uint64_t kKvStreamPad = 256;

// Cells when neither --kv-cells nor a budget is given: every session its full context, at most 65536.
uint64_t default_kv_cells(uint32_t max_sessions, uint32_t ctx_per_session);

// Cells a KV budget of `mb` MiB buys at `bytes_per_cell`.
uint64_t cells_for_mib(double mb, uint64_t bytes_per_cell);

// One KV stream per session (llama, not --kv-unified): every session gets the same share,
// padded to whole 256-cell streams; the positions a session may hold shrink to its share.
struct StreamShare {
    uint64_t kv_cells = 0;          // all streams together
    uint32_t ctx_per_session = 0;
};
// `sized`: the cells came from --kv-cells or --kv-budget-mb (else each session gets ctx_per_session).
StreamShare per_session_streams(uint64_t kv_cells, bool sized, uint32_t max_sessions, uint32_t ctx_per_session);

// Fake model: n_embd floats per owned layer per cell.
uint64_t fake_bytes_per_cell(uint32_t n_embd, uint32_t layer_start, uint32_t layer_end);

}  // namespace dgr::worker
