#include "worker/work_queue.h"

#include <algorithm>
#include <utility>

namespace dgr::worker {

uint32_t WorkQueue::push_prefill_pieces(WorkPtr w, uint32_t piece, uint32_t n_embd) {
    if (piece == 0 || piece >= w->n) {
        prefill_.push_back(std::move(w));
        return 1;
    }
    const bool rows = !w->rows.empty();
    uint32_t count = 0;
    for (uint32_t a = 0; a < w->n; a += piece) {
        const uint32_t m = std::min(piece, w->n - a);
        const bool last = a + m == w->n;
        auto p = std::make_unique<Work>();
        p->session_id = w->session_id;
        p->generation = w->generation;
        p->pos0 = w->pos0 + a;
        p->n = m;
        if (rows) {
            p->rows.assign(w->rows.begin() + (size_t) a * n_embd, w->rows.begin() + (size_t) (a + m) * n_embd);
        } else {
            p->tokens.assign(w->tokens.begin() + a, w->tokens.begin() + a + m);
        }
        p->sample = last && w->sample;
        p->header = w->header;
        p->t0 = w->t0;
        p->t_ready = w->t_ready;
        if (!last) {
            p->origin = EarlyPiece{};
        } else if (auto * c = std::get_if<ClientStep>(&w->origin)) {
            ClientStep frame = std::move(*c);
            frame.last_piece = true;
            p->origin = std::move(frame);
        } else {
            p->origin = std::move(w->origin);
        }
        prefill_.push_back(std::move(p));
        count++;
    }
    return count;
}

WorkQueue::Batch WorkQueue::take(uint32_t max_rows, uint32_t prefill_chunk, uint32_t group, const BlockOf & block_of) {
    Batch b;
    // decode's turn: the last batch carried PREFILL rows and DECODE rows wait, so this batch
    // takes DECODE rows only (a decode row then waits for at most the one batch in flight and
    // is not computed inside a batch of prefill rows as well); the next batch is PREFILL's again
    const bool decode_turn = last_had_prefill_ && !decode_.empty();
    const uint32_t decode_cap =
        prefill_.empty() || decode_turn ? max_rows : max_rows - std::min(max_rows, prefill_chunk);
    int64_t block = -1;
    uint32_t chained = 0;
    std::deque<WorkPtr> later;
    while (!decode_.empty() && b.rows + 1 <= decode_cap) {
        WorkPtr w = std::move(decode_.front());
        decode_.pop_front();
        if (group > 0) {
            if (const int64_t k = block_of(*w); k >= 0) {
                if (block < 0) block = k;
                if (chained >= group || k != block) {
                    later.push_back(std::move(w));
                    continue;
                }
                chained++;
            }
        }
        b.items.push_back(std::move(w));
        b.rows += 1;
    }
    b.held_rows = (uint32_t) later.size();
    while (!later.empty()) {  // back to the front, in their order
        decode_.push_front(std::move(later.back()));
        later.pop_back();
    }
    for (auto it = prefill_.begin(); !decode_turn && it != prefill_.end();) {
        Work & w = **it;
        if (w.piece() && std::any_of(b.items.begin(), b.items.end(),
                                     [&](const WorkPtr & x) { return x->piece() && x->session_id == w.session_id; })) {
            ++it;
            continue;
        }
        if (b.rows + w.n > max_rows) break;
        b.rows += w.n;
        b.items.push_back(std::move(*it));
        it = prefill_.erase(it);
        b.prefill_steps++;
    }
    if (!b.items.empty()) last_had_prefill_ = b.prefill_steps > 0;
    return b;
}

uint32_t WorkQueue::first_block_rows(const BlockOf & block_of, int64_t * block) const {
    uint32_t n = 0;
    *block = -1;
    for (const auto & w : decode_) {
        const int64_t k = block_of(*w);
        if (k < 0) continue;
        if (*block < 0) *block = k;
        if (k == *block) n++;
    }
    return n;
}

size_t WorkQueue::purge(const std::string & session_id) {
    size_t n = 0;
    for (auto * q : {&decode_, &prefill_}) {
        for (auto w = q->begin(); w != q->end();) {
            if ((*w)->session_id == session_id) {
                w = q->erase(w);  // (its frame's ticket goes back)
                n++;
            } else {
                ++w;
            }
        }
    }
    return n;
}

void WorkQueue::absorb_pieces(Work & w) {
    if (!w.more_pieces()) return;
    for (auto it = prefill_.begin(); it != prefill_.end();) {
        if ((*it)->session_id == w.session_id && (*it)->piece()) {
            if (!(*it)->internal()) w.origin = std::move((*it)->origin);  // this failure answers the client's frame
            it = prefill_.erase(it);
        } else {
            ++it;
        }
    }
}

void WorkQueue::piece_ready(const std::string & session_id, Clock::time_point t) {
    for (auto & q : prefill_) {
        if (q->session_id == session_id && q->piece()) {
            q->t_ready = t;
            return;
        }
    }
}

bool WorkQueue::has_client_step(const std::string & session_id) const {
    for (const auto * q : {&decode_, &prefill_}) {
        for (const auto & w : *q) {
            if (w->session_id == session_id && !w->internal()) return true;
        }
    }
    return false;
}

bool WorkQueue::upstream_batch_incomplete() const {
    // (id, rows hinted, rows queued); a handful of batches at most
    std::vector<std::pair<uint64_t, std::pair<uint32_t, uint32_t>>> seen;
    for (const auto & w : decode_) {
        const ClientStep * c = w->client();
        if (!c || c->up_rows <= 1) continue;
        auto it = std::find_if(seen.begin(), seen.end(), [&](const auto & x) { return x.first == c->up_batch; });
        if (it == seen.end()) {
            seen.push_back({c->up_batch, {c->up_rows, 1}});
        } else {
            it->second.second++;
        }
    }
    return std::any_of(seen.begin(), seen.end(), [](const auto & x) { return x.second.second < x.second.first; });
}

}  // namespace dgr::worker
