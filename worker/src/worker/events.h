// What the gRPC reactions and the downstream links post to the scheduler thread: one type per
// kind of event (a std::variant visited by type; no field means two things).
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"
#include "worker/frame_ticket.h"
#include "worker/stream_sink.h"

#include <grpcpp/support/status.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <variant>

namespace dgr::worker {

// A SessionRequest read from a stream.
struct FrameEvent {
    std::shared_ptr<StreamSink> sink;
    std::unique_ptr<pb::SessionRequest> req;
    std::chrono::steady_clock::time_point t0;  // when it was read
    FrameTicket ticket;                         // counted until it is answered
};

// The client half-closed (cancelled = false) or cancelled its stream.
struct ClosedEvent {
    std::shared_ptr<StreamSink> sink;
    bool cancelled = false;
};

// Unary ReleaseSession / CancelSession (route_epoch 0: any epoch).
struct ReleaseEvent {
    std::string session_id;
    uint64_t route_epoch = 0;
    std::function<void(pb::ReleaseSessionResponse)> done;
};
struct CancelEvent {
    std::string session_id;
    uint64_t route_epoch = 0;
    std::function<void(pb::CancelSessionResponse)> done;
};

// Stop the scheduler: every session ends, its stream with `status`.
struct StopEvent {
    grpc::Status status;
};

// Chained routes: the downstream Shard answered a forwarded step, or its stream ended. A
// `generation` other than the session's current one is an older session's: dropped.
struct DownReplyEvent {
    std::string session_id;
    uint64_t generation = 0;
    pb::SessionResponse resp;
};
struct DownEndEvent {
    std::string session_id;
    uint64_t generation = 0;
    grpc::Status status;
};

using Event = std::variant<FrameEvent, ClosedEvent, ReleaseEvent, CancelEvent, StopEvent, DownReplyEvent, DownEndEvent>;

}  // namespace dgr::worker
