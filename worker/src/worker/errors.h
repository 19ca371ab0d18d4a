// ErrorReason -> gRPC status code (the table in shard_runtime.proto), and ShardError building.
#pragma once

#include "dgr/shard/v1/shard_runtime.pb.h"

#include <grpcpp/support/status.h>

#include <string>

namespace dgr::worker {

inline grpc::StatusCode code_for(::dgr::shard::v1::ErrorReason r) {
    using namespace ::dgr::shard::v1;
    switch (r) {
        case ERROR_REASON_STALE_EPOCH:
        case ERROR_REASON_CACHE_MISS:
        case ERROR_REASON_UNKNOWN_SESSION:
        case ERROR_REASON_POSITION_GAP:
        case ERROR_REASON_STEP_OUT_OF_ORDER: return grpc::StatusCode::ABORTED;
        case ERROR_REASON_FINGERPRINT_MISMATCH:
        case ERROR_REASON_ARTIFACT_MISMATCH:
        case ERROR_REASON_RANGE_MISMATCH:
        case ERROR_REASON_SESSION_RELEASED:
        case ERROR_REASON_SCHEMA_UNSUPPORTED:
        case ERROR_REASON_ROLE_MISMATCH: return grpc::StatusCode::FAILED_PRECONDITION;
        case ERROR_REASON_BAD_BUNDLE:
        case ERROR_REASON_TOKEN_OUT_OF_VOCAB:
        case ERROR_REASON_CHUNK_TOO_LARGE:
        case ERROR_REASON_UNSUPPORTED_COMPRESSION:
        case ERROR_REASON_BAD_REQUEST: return grpc::StatusCode::INVALID_ARGUMENT;
        case ERROR_REASON_OVER_BUDGET:
        case ERROR_REASON_MESSAGE_TOO_LARGE: return grpc::StatusCode::RESOURCE_EXHAUSTED;
        case ERROR_REASON_CANCELLED: return grpc::StatusCode::CANCELLED;
        case ERROR_REASON_INTERNAL: return grpc::StatusCode::INTERNAL;
        case ERROR_REASON_UNAVAILABLE: return grpc::StatusCode::UNAVAILABLE;
        default: return grpc::StatusCode::UNKNOWN;
    }
}

inline ::dgr::shard::v1::ShardError make_error(::dgr::shard::v1::ErrorReason r, const std::string & msg,
                                               bool terminated = false) {
    ::dgr::shard::v1::ShardError e;
    e.set_reason(r);
    e.set_grpc_code((int) code_for(r));
    e.set_message(msg);
    e.set_session_terminated(terminated);
    return e;
}

// A unary RPC failure: the message starts with the reason name (the caller adds the
// "dgr-error-bin" trailer with the serialized ShardError).
inline grpc::Status status_for(const ::dgr::shard::v1::ShardError & e) {
    return grpc::Status(code_for(e.reason()),
                        ::dgr::shard::v1::ErrorReason_Name(e.reason()) + ": " + e.message());
}

}  // namespace dgr::worker
