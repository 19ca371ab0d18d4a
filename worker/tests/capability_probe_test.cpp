// The capability probe (worker/capability_probe.h) over the fake model: which figures it takes,
// what it leaves out, that it leaves no sequence behind, and its cache. Timing values are not
// asserted, only that each is a positive number (the budget case leaves sizes out whatever the
// machine's speed: 20 ms a row against a 0.5 s budget).
#include "worker/capability_probe.h"
#include "worker/fake_backend.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

using namespace dgr::worker;

#include "check.h"

#include <unistd.h>

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
    }
    {  // the start-up cache: keyed by artifact, range, backend and threads; a damaged or foreign file is not used
        const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("dgr-probe-test-" + std::to_string(::getpid()));
        setenv("DGR_PROBE_CACHE_DIR", dir.c_str(), 1);
        FakeBackend be(fake(4, 8, 16, 0));
        BackendInfo in = be.info();
        CHECK(probe_cache_path(in, "cpu", 2).empty(), "no artifact id, no cache");
        in.artifact_id = "00ff";
        const std::string path = probe_cache_path(in, "cpu", 2);
        CHECK(path == (dir / "00ff-4_8-cpu-t2.json").string(), "path %s", path.c_str());
        in.artifact_id = "../x";
        CHECK(probe_cache_path(in, "cpu", 2).empty(), "an artifact id that is not hex names no file");
        in.artifact_id = "00ff";
        ProbeOptions o;
        o.sustained_window_s = 0.05;
        const ProbeResult r = probe_capability(be, o);
        ProbeResult back;
        CHECK(!load_cached_probe(path, in, &back), "nothing cached yet");
        CHECK(save_probe(path, r), "saved");
        CHECK(load_cached_probe(path, in, &back), "loaded");
        CHECK(back.decode_s == r.decode_s && back.decode_no_output_s.size() == r.decode_no_output_s.size() &&
                  back.duty == r.duty && back.tail,
              "round trip");
        BackendInfo other = in;
        other.layer_start = 0;
        CHECK(!load_cached_probe(path, other, &back), "a probe of another range is not used");
        std::ofstream(path) << "{\"layers\": 4, \"head\": fa";
        CHECK(!load_cached_probe(path, in, &back), "a damaged file is not used");
        std::ofstream(path) << "{\"layers\": 4, \"head\": false, \"tail\": true, \"decode_s\": {\"1\": -1}, "
                               "\"decode_no_output_s\": {}, \"prompt_s_per_token\": 0, \"prompt_no_output_s_per_token\": 0, "
                               "\"sustained_s\": 0, \"duty\": 1, \"seconds\": 0, \"error\": \"\"}";
        CHECK(!load_cached_probe(path, in, &back), "a negative time is not used");
        const MeasuredCost m = measured_cost(r, 2, true);
        CHECK(m.present && m.from_cache && m.threads == 2 && m.decode.size() == r.decode_s.size() &&
                  m.decode[0].rows == 1 && m.decode[0].step_no_output_s > 0.0,
              "measured cost");
        std::filesystem::remove_all(dir);
    }
    if (g_failures) {
        std::fprintf(stderr, "capability_probe_test: %d failure(s)\n", g_failures);
        return 1;
    }
    std::printf("capability_probe_test: ok\n");
    return 0;
}
