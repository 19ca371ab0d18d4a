// Ending sessions (session_reaper.h).
#include "worker/session_reaper.h"

#include <cstdio>

namespace dgr::worker {

uint64_t SessionReaper::end(const std::string & id, EndKind kind) {
    if (!table_.find(id)) return 0;
    queue_.purge(id);  // (their frames' tickets go back)
    std::unique_ptr<Session> s = table_.remove(id, kind);
    // the downstream Shard drops its part of the session, ended the same way (cancelled or released)
    if (s->chain.down) s->chain.down->close(kind == EndKind::cancelled);
    backend_.seq_rm(s->seq, -1, -1);
    if (kind == EndKind::released) metrics_.sessions_released++;
    if (kind == EndKind::evicted) metrics_.sessions_evicted++;
    if (kind == EndKind::cancelled) metrics_.sessions_cancelled++;
    return s->positions;
}

bool SessionReaper::make_room(uint64_t cells, bool need_session, const std::string & requester, Clock::time_point now) {
    for (;;) {
        const bool sessions_full = need_session && table_.full();
        const bool kv_full = table_.kv_used() + table_.kv_reserved() + cells > limits_.kv_cells;
        if (!sessions_full && !kv_full) return true;
        Session * lru = table_.lru_idle(now, limits_.evict_idle_s, requester);
        if (!lru) return false;
        std::fprintf(stderr, "dgr-worker: evicting idle session (LRU) to admit new work\n");
        end(lru->id, EndKind::evicted);
    }
}

size_t SessionReaper::sweep(Clock::time_point now) {
    const std::vector<std::string> ids = table_.expired(now, limits_.session_ttl_s);
    for (const auto & id : ids) end(id, EndKind::evicted);
    return ids.size();
}

}  // namespace dgr::worker
