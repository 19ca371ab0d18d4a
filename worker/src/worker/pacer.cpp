// When the next batch runs (pacer.h).
#include "worker/pacer.h"

#include "worker/pipeline.h"

#include <algorithm>

namespace dgr::worker {

bool Pacer::paced_by_pipeline(const Session & s) const {
    return s.pipelined || (s.chain.down && pipeline_groups(groups_option_, s.chain.stages, s.chain.colocated) > 1);
}

uint32_t Pacer::prefill_groups(const Session & s) const {
    return s.chain.down ? pipeline_groups(groups_option_, s.chain.stages, s.chain.colocated) : 1;
}

uint32_t Pacer::group_rows() const {
    uint32_t active = 0, groups = 1;
    table_.for_each([&](const Session & s) {
        if (!s.chain.down || !(s.gen.active || s.decoding)) return;
        active++;
        groups = std::max(groups, pipeline_groups(groups_option_, s.chain.stages, s.chain.colocated));
    });
    return pipeline_group_rows(active, groups);
}

WorkQueue::BlockOf Pacer::block_of(uint32_t group) const {
    return [this, group](const Work & w) -> int64_t {
        const Session * s = table_.find(w.session_id);
        return s && s->chain.down ? pipeline_block(s->seq, group) : -1;
    };
}

Pacer::Gather Pacer::gather_from(Clock::time_point t) const {
    auto after = [&](double s) { return t + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s)); };
    Gather g;
    g.start = t;
    g.short_deadline = after(std::min(0.005, 0.25 * last_decode_s_));
    g.long_deadline = after(std::min(0.25, 3.0 * last_decode_s_ + 0.005));
    g.fill_deadline = after(std::min(0.05, last_decode_s_));
    g.group = group_rows();
    return g;
}

std::optional<Clock::time_point> Pacer::wait_until(const Gather & g, const WorkQueue & queue,
                                                   Clock::time_point now) const {
    if (queue.has_prefill()) return std::nullopt;
    if (g.group > 0) {  // a full group (block of sequence ids) is queued: it goes
        int64_t block = -1;
        const uint32_t chained = queue.first_block_rows(block_of(g.group), &block);
        if (chained >= g.group) return std::nullopt;
        if (chained > 0 && now < g.fill_deadline && block_due_by(block, g.group, g.fill_deadline) > 0) {
            return g.fill_deadline;
        }
    }
    const Expected e = expected_decoders(g.short_deadline);
    // rows forwarded together by a pipelining Shard (StepFrame.batch) are waited for until all
    // are here, within the same short deadline
    if (e.plain == 0 && e.colocated_chain == 0 && !queue.upstream_batch_incomplete()) return std::nullopt;
    const Clock::time_point deadline = e.colocated_chain > 0 ? g.long_deadline : g.short_deadline;
    if (now >= deadline) return std::nullopt;
    return deadline;
}

void Pacer::observe_batch(double seconds, bool decode_only) {
    if (!decode_only) return;
    last_decode_s_ = last_decode_s_ > 0.0 ? 0.8 * last_decode_s_ + 0.2 * seconds : seconds;
}

void Pacer::note_decode_arrival(Session & s, Clock::time_point now) {
    // decode -> decode only: the gap after a prompt includes the rest of the route's prefill
    if (s.decoding && s.answered_at != Clock::time_point{}) {
        s.gap_s = next_gap(s.gap_s, std::chrono::duration<double>(now - s.answered_at).count());
    }
}

Pacer::Expected Pacer::expected_decoders(Clock::time_point deadline) const {
    Expected n;
    table_.for_each([&](const Session & s) {
        if (s.step == StepState::downstream && s.gen.active) {
            // chained heads that generate get their next row when the route answers
            if (s.chain.colocated) {
                n.colocated_chain++;
            } else if (!paced_by_pipeline(s) || worth_waiting(s.answered_at, s.gap_s, deadline)) {
                n.plain++;
            }
        } else if (s.decoding && !s.busy() &&
                   (!paced_by_pipeline(s) || worth_waiting(s.answered_at, s.gap_s, deadline))) {
            n.plain++;
        }
    });
    return n;
}

uint32_t Pacer::block_due_by(int64_t block, uint32_t group, Clock::time_point deadline) const {
    uint32_t n = 0;
    table_.for_each([&](const Session & s) {
        if (s.chain.down && s.step == StepState::downstream && s.gen.active && pipeline_block(s.seq, group) == block &&
            worth_waiting(s.answered_at, s.gap_s, deadline)) {
            n++;
        }
    });
    return n;
}

}  // namespace dgr::worker
