// The queue of steps on its own (worker/work_queue.h): the batching policy (DECODE first, room
// for a prefill chunk, PREFILL oldest first while it fits, decode's turn after a prefill batch),
// pipeline groups of chained rows, split PREFILL steps (one piece per batch, the last piece
// carries the frame), and the frame tickets going back exactly once whichever way a step leaves.
#include "worker/work_queue.h"

#include <atomic>
#include <cstdio>
#include <string>

#include "check.h"

using namespace dgr::worker;

namespace {

std::atomic<uint32_t> g_tickets{0};

WorkPtr step(const std::string & sid, bool decode, uint32_t n, bool with_ticket = true) {
    auto w = std::make_unique<Work>();
    w->session_id = sid;
    w->decode = decode;
    w->n = n;
    w->tokens.assign(n, 7);
    w->sample = true;
    if (with_ticket) {
        ClientStep c;
        c.ticket = FrameTicket::take(g_tickets, 1000);
        w->origin = std::move(c);
    } else {
        w->origin = GeneratedStep{};
    }
    return w;
}

const WorkQueue::BlockOf kNotChained = [](const Work &) -> int64_t { return -1; };

std::string ids(const WorkQueue::Batch & b) {
    std::string out;
    for (const auto & w : b.items) out += (out.empty() ? "" : ",") + w->session_id;
    return out;
}

void test_decode_first_then_prefill_while_it_fits() {
    WorkQueue q;
    q.push_prefill(step("p1", false, 6));
    q.push_prefill(step("p2", false, 6));
    q.push_decode(step("d1", true, 1));
    q.push_decode(step("d2", true, 1));
    WorkQueue::Batch b = q.take(10, 6, 0, kNotChained);
    CHECK(ids(b) == "d1,d2,p1", "batch %s", ids(b).c_str());
    CHECK(b.rows == 8 && b.held_rows == 0, "rows %u held %u", b.rows, b.held_rows);
    b = q.take(10, 6, 0, kNotChained);
    CHECK(ids(b) == "p2" && q.empty(), "next batch %s", ids(b).c_str());
}

void test_decode_leaves_room_for_a_prefill_chunk() {
    WorkQueue q;
    for (int i = 0; i < 8; ++i) q.push_decode(step("d" + std::to_string(i), true, 1));
    q.push_prefill(step("p", false, 4));
    WorkQueue::Batch b = q.take(8, 4, 0, kNotChained);  // 4 decode rows + the 4-row chunk
    CHECK(b.rows == 8 && b.items.size() == 5 && b.items.back()->session_id == "p", "batch %s", ids(b).c_str());
    CHECK(q.decode_rows().size() == 4 && q.decode_rows().front()->session_id == "d4", "left %zu",
          q.decode_rows().size());
    b = q.take(8, 4, 0, kNotChained);  // no prefill waits: every decode row
    CHECK(b.rows == 4 && q.empty(), "rows %u", b.rows);
}

void test_a_pipeline_group_is_one_block_of_chained_rows() {
    WorkQueue q;
    // blocks by session: a0,a1 -> 0, b0,b1 -> 1; "x" is not chained
    auto block_of = [](const Work & w) -> int64_t { return w.session_id[0] == 'x' ? -1 : w.session_id[0] - 'a'; };
    for (const char * s : {"b0", "a0", "x", "a1", "b1"}) q.push_decode(step(s, true, 1));
    WorkQueue::Batch b = q.take(16, 4, 2, block_of);
    CHECK(ids(b) == "b0,x,b1", "first group: %s", ids(b).c_str());
    CHECK(b.held_rows == 2, "held %u", b.held_rows);
    CHECK(q.decode_rows().size() == 2 && q.decode_rows()[0]->session_id == "a0" && q.decode_rows()[1]->session_id == "a1",
          "held rows keep their order");
    int64_t block = -9;
    CHECK(q.first_block_rows(block_of, &block) == 2 && block == 0, "first block %lld", (long long) block);
    b = q.take(16, 4, 1, block_of);  // a cap of one row per group
    CHECK(ids(b) == "a0" && b.held_rows == 1, "capped group: %s", ids(b).c_str());
    b = q.take(16, 4, 0, block_of);  // no cap: everything
    CHECK(ids(b) == "a1" && q.empty(), "uncapped: %s", ids(b).c_str());
    CHECK(q.first_block_rows(block_of, &block) == 0 && block == -1, "empty queue: block %lld", (long long) block);
}

void test_split_prefill_goes_one_piece_per_batch() {
    WorkQueue q;
    WorkPtr w = step("s", false, 10);
    w->pos0 = 5;
    for (uint32_t i = 0; i < 10; ++i) w->tokens[i] = (int32_t) i;
    CHECK(q.push_prefill_pieces(std::move(w), 4, 0) == 3, "three pieces");
    q.push_prefill(step("t", false, 2));
    WorkQueue::Batch b = q.take(64, 16, 0, kNotChained);
    CHECK(ids(b) == "s,t", "one piece of s, then t: %s", ids(b).c_str());
    const Work & p0 = *b.items[0];
    CHECK(p0.piece() && p0.more_pieces() && p0.internal() && !p0.sample && std::holds_alternative<EarlyPiece>(p0.origin),
          "an early piece carries no frame");
    CHECK(p0.pos0 == 5 && p0.n == 4 && p0.tokens.front() == 0 && p0.tokens.back() == 3, "piece 0 rows");
    q.piece_ready("s", Clock::time_point{} + std::chrono::seconds(3));
    CHECK(q.has_client_step("s"), "the last piece still carries the client's frame");
    b = q.take(64, 16, 0, kNotChained);
    CHECK(b.items.size() == 1 && b.items[0]->pos0 == 9 && b.items[0]->tokens.front() == 4, "piece 1");
    CHECK(b.items[0]->t_ready == Clock::time_point{} + std::chrono::seconds(3), "piece_ready sets the next piece's wait");
    b = q.take(64, 16, 0, kNotChained);
    const Work & last = *b.items[0];
    CHECK(last.piece() && !last.more_pieces() && !last.internal() && last.sample && last.client() &&
              last.client()->ticket.held() && last.client()->last_piece && last.n == 2,
          "the last piece carries the frame");
    CHECK(!q.has_client_step("s"), "nothing of s is queued");
}

void test_boundary_rows_split_by_n_embd() {
    WorkQueue q;
    auto w = std::make_unique<Work>();
    w->session_id = "r";
    w->n = 3;
    for (int i = 0; i < 3 * 2; ++i) w->rows.push_back((float) i);  // n_embd 2
    CHECK(q.push_prefill_pieces(std::move(w), 2, 2) == 2, "two pieces");
    WorkQueue::Batch b = q.take(64, 16, 0, kNotChained);
    CHECK(b.items[0]->rows.size() == 4 && b.items[0]->rows[3] == 3.0f && b.items[0]->tokens.empty(), "piece 0 rows");
    b = q.take(64, 16, 0, kNotChained);
    CHECK(b.items[0]->rows.size() == 2 && b.items[0]->rows[0] == 4.0f, "piece 1 rows");
}

void test_tickets_go_back_once_whichever_way_a_step_leaves() {
    const uint32_t before = g_tickets.load();
    {
        WorkQueue q;
        q.push_decode(step("a", true, 1));
        q.push_prefill(step("a", false, 3));
        q.push_decode(step("b", true, 1));
        q.push_decode(step("g", true, 1, false));  // server-side generation: no frame
        CHECK(g_tickets.load() == before + 3, "3 tickets out");
        CHECK(q.purge("a") == 2 && g_tickets.load() == before + 1, "purge returns a's tickets");
        CHECK(q.has_client_step("b") && !q.has_client_step("g"), "client steps");
        // a failed early piece takes over the last piece's frame, and the rest leave the queue
        WorkPtr w = step("s", false, 9);
        q.push_prefill_pieces(std::move(w), 3, 0);
        WorkQueue::Batch b = q.take(64, 16, 0, kNotChained);  // b, g, piece 0 of s
        Work & p0 = *b.items.back();
        CHECK(p0.session_id == "s" && p0.more_pieces() && !p0.client(), "piece 0 of s");
        q.absorb_pieces(p0);
        CHECK(!p0.more_pieces() && !p0.internal() && p0.client() && p0.client()->ticket.held(),
              "the failed piece answers the frame");
        CHECK(q.empty(), "the later pieces left");
        p0.release_ticket();
        p0.release_ticket();  // a second release gives nothing back
        CHECK(g_tickets.load() == before + 1, "b's ticket is still out (in the batch)");
    }
    CHECK(g_tickets.load() == before, "every ticket back: %u out", g_tickets.load() - before);
}

void test_upstream_batch_hint() {
    WorkQueue q;
    auto row = [](const char * s, uint64_t batch, uint32_t rows) {
        WorkPtr w = step(s, true, 1);
        ClientStep & c = std::get<ClientStep>(w->origin);
        c.up_batch = batch;
        c.up_rows = rows;
        return w;
    };
    q.push_decode(row("a", 7, 2));
    CHECK(q.upstream_batch_incomplete(), "one of two rows of batch 7 is here");
    q.push_decode(row("b", 7, 2));
    CHECK(!q.upstream_batch_incomplete(), "both rows of batch 7 are here");
    q.push_decode(row("c", 8, 1));
    CHECK(!q.upstream_batch_incomplete(), "a single-row hint waits for nothing");
}

void test_decode_turn_after_a_batch_with_prefill() {
    // a decode row waits for at most the one batch in flight, and is then not computed inside a
    // batch of prefill rows again: after a batch that carried PREFILL, waiting DECODE rows go alone
    WorkQueue q;
    q.push_prefill(step("p1", false, 6));
    q.push_prefill(step("p2", false, 6));
    q.push_prefill(step("p3", false, 6));
    WorkQueue::Batch b = q.take(12, 6, 0, kNotChained);
    CHECK(ids(b) == "p1,p2" && b.prefill_steps == 2, "prefill batch %s", ids(b).c_str());
    q.push_decode(step("d1", true, 1));  // arrived while that batch was in flight
    b = q.take(12, 6, 0, kNotChained);
    CHECK(ids(b) == "d1" && b.prefill_steps == 0, "decode's turn: %s", ids(b).c_str());
    q.push_decode(step("d1", true, 1));
    b = q.take(12, 6, 0, kNotChained);   // prefill's turn again: decode rows first, then the chunk
    CHECK(ids(b) == "d1,p3", "prefill is not starved: %s", ids(b).c_str());
    b = q.take(12, 6, 0, kNotChained);   // nothing waits: an empty batch changes no turn
    CHECK(b.items.empty(), "empty %s", ids(b).c_str());
    q.push_prefill(step("p4", false, 6));
    b = q.take(12, 6, 0, kNotChained);   // no decode row waits: prefill goes on
    CHECK(ids(b) == "p4", "prefill without decode: %s", ids(b).c_str());
}

}  // namespace

int main() {
    test_decode_first_then_prefill_while_it_fits();
    test_decode_leaves_room_for_a_prefill_chunk();
    test_a_pipeline_group_is_one_block_of_chained_rows();
    test_split_prefill_goes_one_piece_per_batch();
    test_boundary_rows_split_by_n_embd();
    test_tickets_go_back_once_whichever_way_a_step_leaves();
    test_upstream_batch_hint();
    test_decode_turn_after_a_batch_with_prefill();
    if (g_failures) {
        std::fprintf(stderr, "work_queue_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("work_queue_test: ok\n");
    return 0;
}
