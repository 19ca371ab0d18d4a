// KV budget sizing of `dgr-worker serve` (worker/kv_budget.h).
#include "worker/kv_budget.h"

#include <cstdio>

using namespace dgr::worker;

#include "check.h"

int main() {
    CHECK(default_kv_cells(16, 2048) == 32768, "16 x 2048");
    CHECK(default_kv_cells(64, 2048) == 65536, "capped at 65536");
    CHECK(cells_for_mib(1.0, 1024) == 1024, "1 MiB at 1 KiB per cell");
    CHECK(cells_for_mib(1.0, 0) == 0, "unknown cell size");

    // one stream per session, padded to 256 cells; positions shrink to the share
    StreamShare s = per_session_streams(1000, true, 4, 2048);
    CHECK(s.ctx_per_session == 256 && s.kv_cells == 1024, "sized: %u %llu", s.ctx_per_session,
          (unsigned long long) s.kv_cells);
    s = per_session_streams(0, false, 4, 300);
    CHECK(s.ctx_per_session == 300 && s.kv_cells == 4 * 512, "unsized: %u %llu", s.ctx_per_session,
          (unsigned long long) s.kv_cells);

    CHECK(fake_bytes_per_cell(8, 2, 6) == 4 * 8 * 4, "fake cell");
    if (g_failures) {
        std::fprintf(stderr, "kv_budget_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("kv_budget_test: ok\n");
    return 0;
}
