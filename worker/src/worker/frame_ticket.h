// A client frame received and not yet answered (or handed to compute): what the queue depth
// counts (--queue-limit, dgr_queue_depth).
//
// A gRPC reaction takes the ticket when it posts the frame; the frame event carries it, then
// the step it becomes (Work, work_queue.h), then the last piece of a split PREFILL step. It goes
// back exactly once: release() where the frame is answered or leaves the queue for compute, or
// the destructor when whatever holds it is dropped (a purged step, a late event at shutdown).
// Move-only, so no count is kept by hand and none can drift.
#pragma once

#include <atomic>
#include <cstdint>
#include <utility>

namespace dgr::worker {

class FrameTicket {
public:
    FrameTicket() = default;
    // a ticket of `counter`, or an empty one when `limit` tickets are out already
    static FrameTicket take(std::atomic<uint32_t> & counter, uint32_t limit) {
        uint32_t v = counter.load();
        do {
            if (v >= limit) return {};
        } while (!counter.compare_exchange_weak(v, v + 1));
        return FrameTicket(&counter);
    }
    FrameTicket(FrameTicket && o) noexcept : counter_(std::exchange(o.counter_, nullptr)) {}
    FrameTicket & operator=(FrameTicket && o) noexcept {
        if (this != &o) {
            release();
            counter_ = std::exchange(o.counter_, nullptr);
        }
        return *this;
    }
    FrameTicket(const FrameTicket &) = delete;
    FrameTicket & operator=(const FrameTicket &) = delete;
    ~FrameTicket() { release(); }

    void release() {
        if (counter_) counter_->fetch_sub(1);
        counter_ = nullptr;
    }
    bool held() const { return counter_ != nullptr; }

private:
    explicit FrameTicket(std::atomic<uint32_t> * c) : counter_(c) {}
    std::atomic<uint32_t> * counter_ = nullptr;
};

}  // namespace dgr::worker
