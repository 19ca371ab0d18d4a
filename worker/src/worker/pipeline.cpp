#include "worker/pipeline.h"

#include <algorithm>

namespace dgr::worker {

uint32_t pipeline_groups(uint32_t option, uint32_t stages, bool colocated) {
    if (option >= 1) return std::min(option, kMaxPipelineGroups);
    if (colocated || stages < 2) return 1;
    return std::min(stages, kMaxPipelineGroups);
}

uint32_t pipeline_group_rows(uint32_t active, uint32_t groups) {
    if (groups <= 1 || active <= 1) return 0;
    return (active + groups - 1) / groups;
}

int64_t pipeline_block(int32_t seq, uint32_t group_rows) {
    return group_rows == 0 || seq < 0 ? 0 : (int64_t) seq / group_rows;
}

bool worth_waiting(std::chrono::steady_clock::time_point answered, double gap_s,
                   std::chrono::steady_clock::time_point deadline) {
    if (gap_s <= 0.0) return true;
    const auto predicted = answered + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                          std::chrono::duration<double>(gap_s));
    return predicted <= deadline;
}

uint32_t prefill_piece_rows(uint32_t n, uint32_t groups) {
    if (groups <= 1 || n <= kMinPrefillPiece) return n;
    const uint32_t k = 2 * groups;
    return std::min(n, std::max(kMinPrefillPiece, (n + k - 1) / k));
}

double next_gap(double ewma_s, double observed_s) {
    if (observed_s < 0.0) return ewma_s;
    return ewma_s > 0.0 ? 0.7 * ewma_s + 0.3 * observed_s : observed_s;
}

}  // namespace dgr::worker
