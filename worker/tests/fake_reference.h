// Greedy tokens of a fake model run directly (no scheduler): what a route or a worker over the
// same fake model must produce. Shared by the CTest programs that drive the scheduler.
#pragma once

#include "worker/fake_backend.h"

#include <algorithm>
#include <string>
#include <vector>

#include "check.h"

namespace dgr::worker {

// The prompt, then n - 1 fed-back tokens, on one sequence of a fake model built from `m`.
inline std::vector<int32_t> fake_greedy_reference(const FakeModelOptions & m, const std::vector<int32_t> & prompt,
                                                  int n) {
    FakeBackend b(m);
    std::vector<int32_t> out, feed = prompt;
    int32_t pos = 0;
    for (int i = 0; i < n; ++i) {
        DecodeBatch batch;
        for (size_t k = 0; k < feed.size(); ++k) {
            batch.tokens.push_back(feed[k]);
            batch.pos.push_back(pos++);
            batch.seq.push_back(0);
            batch.output.push_back(k + 1 == feed.size());
        }
        std::string err;
        CHECK(b.decode(batch, &err) == BackendStatus::ok, "reference decode: %s", err.c_str());
        const float * logits = b.output_row((int32_t) feed.size() - 1);
        out.push_back((int32_t) (std::max_element(logits, logits + b.info().n_vocab) - logits));
        feed = {out.back()};
    }
    return out;
}

}  // namespace dgr::worker
