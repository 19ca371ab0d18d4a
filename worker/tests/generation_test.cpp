// Server-side generation on its own (worker/generation.h): what follows each token -- the
// next row's header, a stop, a refusal -- and which answers are held, from a hand-made session.
#include "worker/generation.h"

#include <string>

#include "check.h"

namespace pb = dgr::shard::v1;
using namespace dgr::worker;

namespace {

pb::GenerateParams params(uint32_t max_tokens, bool cont = false, uint32_t per_answer = 1) {
    pb::GenerateParams p;
    p.set_max_tokens(max_tokens);
    p.set_continue_after_finish(cont);
    p.set_tokens_per_answer(per_answer);
    return p;
}

pb::ResponseHeader last_header(uint64_t step) {
    pb::ResponseHeader h;
    h.set_request_id("r1");
    h.set_step(step);
    h.mutable_computed_range()->set_start(0);
    h.mutable_computed_range()->set_end(8);
    return h;
}

const char * kind(const GenerationStep & g) {
    if (std::holds_alternative<StopGenerating>(g)) return "stop";
    if (std::holds_alternative<GenerationRefused>(g)) return "refused";
    return "row";
}

void test_rows_until_max_tokens() {
    SessionTable table(2, 2);
    Session & s = table.open("s", 3);
    table.reserve(s, 5);
    table.commit(s, 5, 5);
    Generation gen(32, 64);
    Generation::start(s.gen, params(3));
    CHECK(s.gen.active && s.gen.left == 3, "start: active %d left %u", s.gen.active, s.gen.left);
    GenerationStep g = gen.after_token(s, last_header(0), 7, false);
    CHECK(std::holds_alternative<NextRow>(g), "after the first token: %s", kind(g));
    if (const auto * row = std::get_if<NextRow>(&g)) {
        const pb::ResponseHeader & h = row->header;
        CHECK(row->token == 7 && h.step() == 1 && h.positions().start() == 5 && h.positions().end() == 6 &&
                  h.phase() == pb::PHASE_DECODE && h.session_id() == "s" && h.route_epoch() == 3 &&
                  h.request_id() == "r1" && h.computed_range().end() == 8,
              "next row: token %d step %llu positions [%u, %u)", row->token, (unsigned long long) h.step(),
              h.positions().start(), h.positions().end());
    }
    CHECK(std::holds_alternative<NextRow>(gen.after_token(s, last_header(1), 8, false)), "second token");
    const GenerationStep end = gen.after_token(s, last_header(2), 9, false);
    CHECK(std::holds_alternative<StopGenerating>(end) && !s.gen.active && s.gen.left == 0,
          "the third token ends it: %s, active %d, left %u", kind(end), s.gen.active, s.gen.left);
    CHECK(std::holds_alternative<StopGenerating>(gen.after_token(s, last_header(3), 9, false)), "after the end");
}

void test_finish_reason() {
    SessionTable table(2, 2);
    Session & s = table.open("s", 1);
    Generation gen(32, 64);
    Generation::start(s.gen, params(10));
    CHECK(std::holds_alternative<StopGenerating>(gen.after_token(s, last_header(0), 2, true)) && !s.gen.active,
          "a finished token stops generation");
    Generation::start(s.gen, params(10, /*cont=*/true));
    CHECK(std::holds_alternative<NextRow>(gen.after_token(s, last_header(0), 2, true)) && s.gen.active,
          "continue_after_finish goes on");
    Generation::start(s.gen, params(0));
    CHECK(s.gen.left == 1, "max_tokens 0 answers one token (left %u)", s.gen.left);
}

void test_refusals() {
    SessionTable table(2, 2);
    Session & s = table.open("s", 1);
    Generation gen(32, 6);
    Generation::start(s.gen, params(10));
    const GenerationStep oov = gen.after_token(s, last_header(0), 32, false);
    const auto * r = std::get_if<GenerationRefused>(&oov);
    CHECK(r && r->error.reason() == pb::ERROR_REASON_TOKEN_OUT_OF_VOCAB && !r->counted_kv && !s.gen.active,
          "token 32 of 32: %s", kind(oov));
    Generation::start(s.gen, params(10));
    CHECK(std::holds_alternative<GenerationRefused>(gen.after_token(s, last_header(0), -1, false)), "token -1");
    table.reserve(s, 6);
    table.commit(s, 6, 6);
    Generation::start(s.gen, params(10));
    const GenerationStep full = gen.after_token(s, last_header(0), 3, false);
    const auto * f = std::get_if<GenerationRefused>(&full);
    CHECK(f && f->error.reason() == pb::ERROR_REASON_OVER_BUDGET && f->error.limit() == 6 && f->counted_kv &&
              f->header.positions().start() == 6 && !s.gen.active,
          "at max_session_positions: %s", kind(full));
}

void test_held_answers() {
    GenerationState g;
    g.active = true;
    g.per_answer = 4;
    g.left = 3;
    CHECK(Generation::holds_answer(g, true, false), "a generated token with more to follow is held");
    CHECK(!Generation::holds_answer(g, false, false), "the frame's own token goes out");
    CHECK(!Generation::holds_answer(g, true, true), "a finished token goes out");
    g.left = 1;
    CHECK(!Generation::holds_answer(g, true, false), "the last token goes out");
    g.left = 3;
    g.per_answer = 1;
    CHECK(!Generation::holds_answer(g, true, false), "one token per answer: none held");
}

}  // namespace

int main() {
    test_rows_until_max_tokens();
    test_finish_reason();
    test_refusals();
    test_held_answers();
    if (g_failures) {
        std::fprintf(stderr, "generation_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("generation_test: ok\n");
    return 0;
}
