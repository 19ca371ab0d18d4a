#include "worker/session_table.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>

namespace dgr::worker {

namespace {
double idle_s(Clock::time_point now, const Session & s) {
    return std::chrono::duration<double>(now - s.last_used).count();
}
}  // namespace

bool step_move_allowed(StepState from, StepState to) {
    switch (from) {
        case StepState::idle: return to == StepState::queued;
        case StepState::queued: return true;
        case StepState::downstream: return to == StepState::idle;
    }
    return false;
}

const char * step_state_name(StepState s) {
    switch (s) {
        case StepState::idle: return "idle";
        case StepState::queued: return "queued";
        case StepState::downstream: return "downstream";
    }
    return "?";
}

void move_step(Session & s, StepState to) {
#ifndef NDEBUG
    if (!step_move_allowed(s.step, to)) {
        std::fprintf(stderr, "dgr-worker: internal error: session %s: step %s -> %s\n", s.id.c_str(),
                     step_state_name(s.step), step_state_name(to));
        std::abort();
    }
#endif
    s.step = to;
}

bool link_move_allowed(ChainLink from, ChainLink to) {
    switch (from) {
        case ChainLink::none: return to == ChainLink::linked;
        case ChainLink::linked: return to == ChainLink::forwarding || to == ChainLink::broken;
        case ChainLink::forwarding: return to == ChainLink::broken;
        case ChainLink::broken: return false;
    }
    return false;
}

const char * chain_link_name(ChainLink s) {
    switch (s) {
        case ChainLink::none: return "none";
        case ChainLink::linked: return "linked";
        case ChainLink::forwarding: return "forwarding";
        case ChainLink::broken: return "broken";
    }
    return "?";
}

void move_link(Session & s, ChainLink to) {
#ifndef NDEBUG
    if (!link_move_allowed(s.chain.link, to)) {
        std::fprintf(stderr, "dgr-worker: internal error: session %s: chain link %s -> %s\n", s.id.c_str(),
                     chain_link_name(s.chain.link), chain_link_name(to));
        std::abort();
    }
#endif
    s.chain.link = to;
}

SessionTable::SessionTable(uint32_t max_sessions, uint32_t max_tombstones)
    : max_sessions_(max_sessions), max_tombstones_(max_tombstones) {
    for (int32_t s = (int32_t) max_sessions - 1; s >= 0; --s) free_seqs_.push_back(s);
}

Session * SessionTable::find(const std::string & id) {
    auto it = sessions_.find(id);
    return it == sessions_.end() ? nullptr : it->second.get();
}

const Session * SessionTable::find(const std::string & id) const {
    auto it = sessions_.find(id);
    return it == sessions_.end() ? nullptr : it->second.get();
}

const Tombstone * SessionTable::tombstone(const std::string & id) const {
    auto it = tombstones_.find(id);
    return it == tombstones_.end() ? nullptr : &it->second;
}

Session & SessionTable::open(const std::string & id, uint64_t epoch) {
    auto s = std::make_unique<Session>();
    s->id = id;
    s->epoch = epoch;
    s->seq = free_seqs_.back();
    free_seqs_.pop_back();
    s->generation = next_generation_++;
    Session & ref = *s;
    sessions_[id] = std::move(s);
    return ref;
}

std::unique_ptr<Session> SessionTable::remove(const std::string & id, EndKind kind) {
    auto it = sessions_.find(id);
    if (it == sessions_.end()) return nullptr;
    std::unique_ptr<Session> s = std::move(it->second);
    sessions_.erase(it);
    kv_used_ -= s->positions;
    kv_reserved_ -= s->reserved;
    free_seqs_.push_back(s->seq);
    // lowest id first (back of a descending list): active sessions stay on consecutive ids
    std::sort(free_seqs_.begin(), free_seqs_.end(), std::greater<int32_t>());
    remember(id, s->epoch, kind);
    return s;
}

void SessionTable::remember(const std::string & id, uint64_t epoch, EndKind kind) {
    if (tombstones_.find(id) == tombstones_.end()) tomb_order_.push_back(id);
    tombstones_[id] = Tombstone{epoch, kind};
    while (tomb_order_.size() > max_tombstones_) {
        tombstones_.erase(tomb_order_.front());
        tomb_order_.pop_front();
    }
}

Session * SessionTable::lru_idle(Clock::time_point now, double min_idle_s, const std::string & except) {
    Session * lru = nullptr;
    for (auto & kv : sessions_) {
        Session & s = *kv.second;
        if (s.busy() || s.id == except || idle_s(now, s) < min_idle_s) continue;
        if (!lru || s.last_used < lru->last_used) lru = &s;
    }
    return lru;
}

std::vector<std::string> SessionTable::expired(Clock::time_point now, double ttl_s) const {
    std::vector<std::string> out;
    for (const auto & kv : sessions_) {
        if (!kv.second->busy() && idle_s(now, *kv.second) >= ttl_s) out.push_back(kv.first);
    }
    return out;
}

void SessionTable::reserve(Session & s, uint32_t cells) {
    s.reserved += cells;
    kv_reserved_ += cells;
}

void SessionTable::commit(Session & s, uint32_t rows, uint32_t freed) {
    freed = std::min(freed, s.reserved);
    s.positions += rows;
    kv_used_ += rows;
    s.reserved -= freed;
    kv_reserved_ -= freed;
}

void SessionTable::unreserve(Session & s) {
    kv_reserved_ -= s.reserved;
    s.reserved = 0;
}

void SessionTable::truncate(Session & s, uint32_t positions) {
    if (positions >= s.positions) return;
    kv_used_ -= s.positions - positions;
    s.positions = positions;
}

std::string SessionTable::check() const {
    uint64_t used = 0, reserved = 0;
    for (const auto & kv : sessions_) {
        used += kv.second->positions;
        reserved += kv.second->reserved;
    }
    if (used == kv_used_ && reserved == kv_reserved_) return {};
    return "KV accounting drifted: " + std::to_string(kv_used_) + " cells used (sessions hold " +
           std::to_string(used) + "), " + std::to_string(kv_reserved_) + " reserved (sessions reserve " +
           std::to_string(reserved) + ")";
}

std::vector<std::string> SessionTable::ids() const {
    std::vector<std::string> out;
    out.reserve(sessions_.size());
    for (const auto & kv : sessions_) out.push_back(kv.first);
    return out;
}

}  // namespace dgr::worker
