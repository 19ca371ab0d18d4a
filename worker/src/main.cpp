// dgr-worker: one process per Shard. `serve` runs the gRPC Shard service (worker/serve.h);
// --version and --smoke (load the llama.cpp backends and print system info) check a build.
#include "version.h"
#include "worker/option_table.h"
#include "worker/serve.h"

#include "llama.h"

#include <cstdio>
#include <cstring>

static void print_version() {
    const auto & b = dgr::build_info();
    std::printf("dgr-worker %s\n", b.dgr_version);
    std::printf("llama.cpp %s\n", b.pin_commit);
    std::printf("patch series %s\n", b.patch_digest);
    std::printf("backend %s\n", b.backend);
}

static void print_usage(const char * argv0) {
    std::printf("usage: %s [--version] [--smoke] | serve (--fake-model | --model FILE) [options] | plan-memory --model FILE [options] | probe --model FILE [options] | options [--json]\n", argv0);
    std::printf("  serve      run the gRPC Shard service (serve --help lists the options)\n");
    std::printf("  plan-memory  the host memory `serve` with the same options would need, without loading\n");
    std::printf("  probe      measure what the range costs on this host (decode at 1/4/8/16 rows, prompt, output)\n");
    std::printf("  options    the options of serve and plan-memory: defaults, bounds, help (--json: as JSON)\n");
    std::printf("  --version  print dgr version, pinned llama.cpp commit, patch digest, backend\n");
    std::printf("  --smoke    initialise llama.cpp backends and print system info\n");
}

int main(int argc, char ** argv) {
    if (argc < 2) {
        print_usage(argv[0]);
        return 2;
    }
    if (std::strcmp(argv[1], "serve") == 0) {
        return dgr::worker::serve_main(argc - 2, argv + 2);
    }
    if (std::strcmp(argv[1], "options") == 0) {
        return dgr::worker::options_main(argc - 2, argv + 2);
    }
    if (std::strcmp(argv[1], "probe") == 0) {
        return dgr::worker::probe_main(argc - 2, argv + 2);
    }
    if (std::strcmp(argv[1], "plan-memory") == 0) {
        return dgr::worker::plan_memory_main(argc - 2, argv + 2);
    }
    if (std::strcmp(argv[1], "--version") == 0) {
        print_version();
        return 0;
    }
    if (std::strcmp(argv[1], "--smoke") == 0) {
        print_version();
        llama_backend_init();
        std::printf("system_info: %s\n", llama_print_system_info());
        const size_t n_dev = ggml_backend_dev_count();
        std::printf("devices: %zu\n", n_dev);
        for (size_t i = 0; i < n_dev; ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            std::printf("  %s: %s\n", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
        }
        llama_backend_free();
        std::printf("smoke: ok\n");
        return 0;
    }
    if (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
        print_usage(argv[0]);
        return 0;
    }
    std::fprintf(stderr, "%s: error: unknown argument '%s'\n", __func__, argv[1]);
    print_usage(argv[0]);
    return 2;
}
