// One batch's compute (docs/worker.md, Continuous batching): the rows of the steps the queue's
// policy took (work_queue.h), in sequence-id order, one decode call, and each step's answer
// from the backend's output -- the sampled token on the tail, else the boundary rows. A unit of
// its own: it knows the model and the steps' sessions' sampling, never the queue, the table's
// accounting or a stream, so worker/tests/batch_runner_test.cpp checks it on the fake model.
#pragma once

#include "worker/backend.h"
#include "worker/session_table.h"
#include "worker/work_queue.h"

#include <functional>
#include <string>
#include <vector>

namespace dgr::worker {

class BatchRunner {
public:
    BatchRunner(ModelBackend & backend, uint32_t max_fragment_bytes)
        : backend_(backend), info_(backend.info()), max_fragment_bytes_(max_fragment_bytes) {}

    // A step of the batch and where its rows are.
    struct Step {
        WorkPtr work;
        Session * session = nullptr;
        int32_t first_row = 0, last_row = 0;
    };
    struct Ran {
        std::vector<Step> steps;  // ordered by the sessions' sequence ids
        BackendStatus status = BackendStatus::ok;
        std::string error;        // why decode failed
        double seconds = 0.0;     // the decode call
        int32_t rows = 0;
        uint64_t prefill_rows = 0, decode_rows = 0;
    };
    using FindSession = std::function<Session *(const std::string &)>;

    // Orders the steps by sequence id (with one KV stream per sequence llama.cpp puts only
    // consecutive increasing sequence ids into one ubatch: split_equal, sequential) and
    // computes them in one decode call. Every step's session must be open.
    Ran run(std::vector<WorkPtr> items, const FindSession & find);
    // The answer of a computed step (after a successful run, before the next one): the tail's
    // sampled token (*sampled, *finished; -1 when the step samples nothing) or the boundary
    // rows. Sampling draws from the session's generator.
    pb::SessionResponse answer(const Step & st, int32_t * sampled, bool * finished);

private:
    ModelBackend & backend_;
    const BackendInfo & info_;
    const uint32_t max_fragment_bytes_;
};

}  // namespace dgr::worker
