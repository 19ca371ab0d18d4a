// Minimal assertion helper shared by the CTest programs: CHECK(cond, fmt, ...) records a
// failure with its location and keeps going; main() returns non-zero when g_failures > 0.
#pragma once

#include <cstdio>
#include <cstdlib>

static int g_failures = 0;

#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond)) {                                                            \
            ++g_failures;                                                         \
            std::fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            std::fprintf(stderr, __VA_ARGS__);                                    \
            std::fprintf(stderr, "\n");                                           \
        }                                                                         \
    } while (0)

// Ends a CTest program that opened gRPC calls: prints its verdict and leaves without static
// destructors. gRPC's exit-time teardown can race a callback thread still finishing a call that
// has already ended, and abort a program whose checks all passed ("ref_counted.h: prior > 0";
// seen after "ok" in step_flow_test and pipeline_test, about 1 run in 60).
[[noreturn]] inline void finish_grpc_test(const char * name) {
    if (g_failures) {
        std::fprintf(stderr, "%s: %d failure(s)\n", name, g_failures);
    } else {
        std::printf("%s: ok\n", name);
    }
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(g_failures ? 1 : 0);
}
