// What the scheduler needs from a Session stream: hand it a response (optionally the last one,
// after which the stream ends with a status), or let it read the next frame without answering.
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <grpcpp/support/status.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace dgr::worker {

namespace pb = ::dgr::shard::v1;

class StreamSink {
public:
    virtual ~StreamSink() = default;
    // Queue one response; the stream reads its next frame once it is written (unless
    // `read_next` is false: a further response of an already answered frame, server-side
    // generation). `terminal`: end the stream with `status` after writing it.
    virtual void deliver(pb::SessionResponse resp, bool terminal = false, grpc::Status status = grpc::Status::OK,
                         bool read_next = true) = 0;
    // Server-side generation: hold a generated token's response and send it together with the
    // next ones (their tokens appended to its TailOutput) once `flush_at` tokens are held; any
    // deliver() or finish() first sends what is held. The default sends it at once.
    virtual void hold(pb::SessionResponse resp, uint32_t flush_at) {
        (void) flush_at;
        deliver(std::move(resp), false, grpc::Status::OK, false);
    }
    // The frame needs no response (a partial fragmented step): read the next one.
    virtual void resume() = 0;
    // End the stream (after any queued responses).
    virtual void finish(grpc::Status status) = 0;
    // Session this stream is bound to (its first frame's session id); set by the scheduler.
    std::string bound_session;
    // The authenticated client identity (mTLS peer certificate: subject and SAN), empty when the
    // connection carries none. Set once, before the first frame is posted.
    std::string client_identity;
    // The client side of the stream ended (half-close or cancel); set by the gRPC reaction
    // before it posts the close, so a newer epoch on another stream may supersede the session.
    std::atomic<bool> client_gone{false};
};

}  // namespace dgr::worker
