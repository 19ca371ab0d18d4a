// Minimal assertion helper shared by the CTest programs: CHECK(cond, fmt, ...) records a
// failure with its location and keeps going; main() returns non-zero when g_failures > 0.
#pragma once

#include <cstdio>

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
