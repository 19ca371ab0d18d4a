// `dgr-worker probe` (serve.h): load the range as serve would and measure it (capability_probe.h).
#include "worker/capability_probe.h"
#include "worker/serve.h"
#include "worker/serve_options.h"
#include "version.h"

#include "llama.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace dgr::worker {

int probe_main(int argc, char ** argv) {
    std::vector<char *> args;
    bool json = false;
    ProbeOptions po;
    for (int i = 0; i < argc; ++i) {
        if (std::strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (std::strcmp(argv[i], "--probe-budget-s") == 0 || std::strcmp(argv[i], "--probe-window-s") == 0) {
            const bool budget = std::strcmp(argv[i], "--probe-budget-s") == 0;
            const double lo = budget ? 0.5 : 0.0, hi = budget ? 600.0 : 60.0;
            char * end = nullptr;
            const double v = i + 1 < argc ? std::strtod(argv[i + 1], &end) : 0.0;
            if (i + 1 >= argc || !end || *end || !(v >= lo && v <= hi)) {
                std::fprintf(stderr, "dgr-worker: error: %s must be a number of seconds in %g..%g\n", argv[i], lo, hi);
                return 2;
            }
            (budget ? po.budget_s : po.sustained_window_s) = v;
            ++i;
        } else if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
            std::printf("usage: dgr-worker probe (--fake-model | --model FILE) [--layers A:B] [--threads N]\n"
                        "         [--probe-budget-s S] [--probe-window-s W] [serve's model options] [--json]\n"
                        "  loads the range as `serve` would and measures what it costs here: a decode step at\n"
                        "  1/4/8/16 rows, a prompt row, and on a tail the output matrix apart (docs/worker.md,\n"
                        "  Measured capability); within S seconds (default 5), larger batches left out first;\n"
                        "  1-row steps kept up for W seconds (default 2) give the host's duty under a CPU quota\n");
            return 0;
        } else {
            args.push_back(argv[i]);
        }
    }
    ServeOptions o;
    const int rc = parse_serve_options((int) args.size(), args.data(), &o);
    if (rc >= 0) return rc;
    uint64_t kv_cells = 0;
    std::unique_ptr<ModelBackend> backend;
    MemoryBudget budget;
    if (const int lrc = load_backend(o, kv_cells, budget, backend); lrc >= 0) return lrc;
    const ProbeResult r = probe_capability(*backend, po);
    const BackendInfo & in = backend->info();
    const BuildInfo & b = build_info();
    if (json) {
        std::string out = probe_json(r);
        out.pop_back();  // '}'
        out += ", \"layer_start\": " + std::to_string(in.layer_start) + ", \"layer_end\": " + std::to_string(in.layer_end) +
               ", \"n_layer\": " + std::to_string(in.n_layer) + ", \"threads\": " + std::to_string(o.threads) +
               ", \"backend\": \"" + std::string(b.backend) + "\", \"fake\": " + (o.fake ? "true" : "false") +
               ", \"memory_budget_bytes\": " + std::to_string(budget.bytes) + "}";
        std::printf("%s\n", out.c_str());
    } else {
        std::printf("range %u:%u of %u layers (%s), %s, %.2f s\n", in.layer_start, in.layer_end, in.n_layer,
                    in.head && in.tail ? "head+tail" : in.head ? "head" : in.tail ? "tail" : "middle", b.backend,
                    r.seconds);
        for (const auto & [rows, s] : r.decode_s) {
            const auto it = r.decode_no_output_s.find(rows);
            std::printf("  decode %2u rows: %8.3f ms", rows, 1e3 * s);
            if (it != r.decode_no_output_s.end()) std::printf("  (%.3f ms without logits)", 1e3 * it->second);
            std::printf("\n");
        }
        std::printf("  prompt: %.4f ms per token\n", 1e3 * r.prompt_s_per_token);
        for (uint32_t k : r.skipped) std::printf("  %u rows: left out (batch limit or time budget)\n", k);
        if (!r.ok()) std::printf("  stopped: %s\n", r.error.c_str());
    }
    if (!o.fake) llama_backend_free();
    return r.ok() ? 0 : 1;
}

}  // namespace dgr::worker
