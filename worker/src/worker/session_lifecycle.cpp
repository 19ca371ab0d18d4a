// The scheduler's accounting of sessions: the published gauges, the invariant audit, and how a
// session's state is dropped (release, cancel, eviction under pressure, TTL).
#include "worker/scheduler.h"

#include <cstdio>
#include <mutex>
#include <string>

namespace dgr::worker {

Gauges Scheduler::gauges() const {
    Gauges g;
    g.active_sessions = active_.load();
    g.queued_steps = queued_.load();
    g.kv_cells_used = kv_used_pub_.load();
    g.kv_cells_total = opts_.kv_cells;
    g.max_sessions = opts_.max_sessions;
    g.weight_bytes = info_.weight_bytes;
    g.kv_bytes = info_.kv_bytes;
    g.scratch_bytes = info_.scratch_bytes;
    g.memory_budget_bytes = opts_.memory_budget_bytes;
    g.predicted_weight_bytes = info_.predicted_weight_bytes;
    g.predicted_kv_bytes = info_.predicted_kv_bytes;
    g.predicted_compute_bytes = info_.predicted_compute_bytes;
    g.predicted_runtime_bytes = info_.predicted_runtime_bytes;
    return g;
}

std::string Scheduler::audit() const {
    std::string out = table_.check();
    if (thread_.joinable()) return out;
    auto add = [&out](const std::string & what) { out += (out.empty() ? "" : "; ") + what; };
    bool stopped;
    {
        std::lock_guard<std::mutex> lk(mu_);
        stopped = stopped_;
    }
    if (stopped) {
        if (queued_.load() != 0) add(std::to_string(queued_.load()) + " frame ticket(s) still out");
        if (table_.size() != 0) add(std::to_string(table_.size()) + " session(s) left");
        if (!queue_.empty()) add("steps left in the queues");
    }
    return out;
}

void Scheduler::publish_gauges() {
    active_ = (uint32_t) table_.size();
    kv_used_pub_ = table_.kv_used();
}

uint64_t Scheduler::drop_session(const std::string & id, EndKind kind) {
    if (!table_.find(id)) return 0;
    queue_.purge(id);  // (their frames' tickets go back)
    std::unique_ptr<Session> s = table_.remove(id, kind);
    // the downstream Shard drops its part of the session, ended the same way (cancelled or released)
    if (s->chain.down) s->chain.down->close(kind == EndKind::cancelled);
    backend_.seq_rm(s->seq, -1, -1);
    if (kind == EndKind::released) metrics_.sessions_released++;
    if (kind == EndKind::evicted) metrics_.sessions_evicted++;
    if (kind == EndKind::cancelled) metrics_.sessions_cancelled++;
    publish_gauges();
    return s->positions;
}

bool Scheduler::make_room(uint64_t cells, bool need_session, const std::string & requester) {
    const auto now = Clock::now();
    for (;;) {
        const bool sessions_full = need_session && table_.full();
        const bool kv_full = table_.kv_used() + table_.kv_reserved() + cells > opts_.kv_cells;
        if (!sessions_full && !kv_full) return true;
        Session * lru = table_.lru_idle(now, opts_.evict_idle_s, requester);
        if (!lru) return false;
        std::fprintf(stderr, "dgr-worker: evicting idle session (LRU) to admit new work\n");
        drop_session(lru->id, EndKind::evicted);
    }
}

void Scheduler::sweep_ttl(Clock::time_point now) {
    for (const auto & id : table_.expired(now, opts_.session_ttl_s)) drop_session(id, EndKind::evicted);
}

}  // namespace dgr::worker
