// The capability probe (worker/capability_probe.h) over the fake model: which figures it takes,
// what it leaves out, that it leaves no sequence behind. Timing values are not asserted (only
// that each is a positive number), except the fake's per-row delay making 16 rows cost more
// than 1.
#include "worker/capability_probe.h"
#include "worker/fake_backend.h"

#include <cstdio>
#include <string>

using namespace dgr::worker;

#include "check.h"

static FakeModelOptions fake(uint32_t start, uint32_t end, uint32_t seqs, uint32_t row_us) {
    FakeModelOptions f;
    f.n_layer = 8;
    f.layer_start = start;
    f.layer_end = end;
    f.n_embd = 16;
    f.n_seq_max = seqs;
    f.kv_cells = 512;
    f.max_batch_tokens = 64;
    f.row_delay_us = row_us;
    return f;
}

int main() {
    {  // a tail: every size, the logits apart, a prompt figure
        FakeBackend be(fake(4, 8, 16, 100));
        const ProbeResult r = probe_capability(be, ProbeOptions{});
        CHECK(r.ok(), "error: %s", r.error.c_str());
        CHECK(r.layers == 4 && r.tail && !r.head, "range");
        CHECK(r.decode_s.size() == 4 && r.decode_no_output_s.size() == 4 && r.skipped.empty(), "sizes %zu %zu",
              r.decode_s.size(), r.decode_no_output_s.size());
        for (const auto & [rows, s] : r.decode_s) CHECK(s > 0.0, "%u rows: %g", rows, s);
        CHECK(r.decode_s.at(16) > r.decode_s.at(1), "16 rows (1.6 ms of row delay) cost more than 1");
        CHECK(r.prompt_s_per_token > 0.0 && r.prompt_no_output_s_per_token > 0.0, "prompt figures");
        CHECK(r.sustained_s > 0.0 && r.duty > 0.0 && r.duty <= 1.0, "sustained %g, duty %g", r.sustained_s, r.duty);
        // the probe's sequences are gone: a new session's first row goes in at position 0
        DecodeBatch b;
        for (int32_t s = 0; s < 16; ++s) {
            b.embd.insert(b.embd.end(), 16, 0.1f);
            b.pos.push_back(0);
            b.seq.push_back(s);
            b.output.push_back(1);
        }
        std::string err;
        CHECK(be.decode(b, &err) == BackendStatus::ok, "decode after the probe: %s", err.c_str());
        const std::string j = probe_json(r);
        for (const char * key : {"\"decode_s\": {\"1\": ", "\"decode_no_output_s\": {\"1\": ", "\"tail\": true",
                                 "\"skipped\": []", "\"error\": \"\""}) {
            CHECK(j.find(key) != std::string::npos, "json lacks %s: %s", key, j.c_str());
        }
    }
    {  // a head, not a tail: no logits figures; sizes above the sequence limit left out
        FakeBackend be(fake(0, 4, 4, 0));
        const ProbeResult r = probe_capability(be, ProbeOptions{});
        CHECK(r.ok() && r.head && !r.tail, "head");
        CHECK(r.decode_s.size() == 2 && r.decode_s.count(1) && r.decode_s.count(4), "1 and 4 rows");
        CHECK(r.decode_no_output_s.empty() && r.prompt_no_output_s_per_token == 0.0, "no logits figures");
        CHECK(r.skipped.size() == 2 && r.skipped[0] == 8 && r.skipped[1] == 16, "8 and 16 left out");
    }
    {  // a budget spent by the first size: the larger ones are left out, the prompt still measured
        FakeBackend be(fake(0, 8, 16, 20000));  // 20 ms a row
        ProbeOptions o;
        o.budget_s = 0.5;
        const ProbeResult r = probe_capability(be, o);
        CHECK(r.ok(), "error: %s", r.error.c_str());
        CHECK(r.decode_s.count(1) && r.decode_s.size() < 4 && !r.skipped.empty(), "budget: %zu sizes", r.decode_s.size());
        CHECK(r.prompt_s_per_token > 0.0, "prompt measured with a smaller piece");
        CHECK(r.seconds < 5.0, "bounded: %.2f s", r.seconds);
    }
    if (g_failures) {
        std::fprintf(stderr, "capability_probe_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("capability_probe_test: ok\n");
    return 0;
}
