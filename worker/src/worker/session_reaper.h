// Ending sessions: everything a session holds outside the session table goes with it -- its
// queued steps (their frames' tickets go back), its KV cells in the model, its downstream link
// (closed, or cancelled when the session was) -- and the table keeps its tombstone. Eviction
// under pressure (least recently used idle session first, never the one asking) and the idle
// TTL end sessions the same way. A unit of its own: it answers no stream (whoever ends a
// session tells its client), so worker/tests/session_reaper_test.cpp checks it on the fake
// model without a scheduler.
#pragma once

#include "worker/backend.h"
#include "worker/metrics.h"
#include "worker/session_table.h"
#include "worker/work_queue.h"

#include <string>

namespace dgr::worker {

class SessionReaper {
public:
    struct Limits {
        uint64_t kv_cells = 0;      // the KV budget
        double evict_idle_s = 0.0;  // a session idle this long may be evicted under pressure
        double session_ttl_s = 0.0; // a session idle this long is evicted
    };
    SessionReaper(SessionTable & table, WorkQueue & queue, ModelBackend & backend, Metrics & metrics, Limits limits)
        : table_(table), queue_(queue), backend_(backend), metrics_(metrics), limits_(limits) {}

    // Ends the session `id` the `kind` way; returns the positions it held (0: no such session).
    uint64_t end(const std::string & id, EndKind kind);
    // Room for `cells` more KV cells (and a session slot when `need_session`), evicting idle
    // sessions least recently used first, never `requester`; false when there is none.
    bool make_room(uint64_t cells, bool need_session, const std::string & requester, Clock::time_point now);
    // Evicts the sessions idle for the TTL; returns how many.
    size_t sweep(Clock::time_point now);

private:
    SessionTable & table_;
    WorkQueue & queue_;
    ModelBackend & backend_;
    Metrics & metrics_;
    const Limits limits_;
};

}  // namespace dgr::worker
