// ShardError building and the gRPC status that carries one. The ErrorReason -> gRPC code map
// is bundle::grpc_code_for (the table in shard_runtime.proto; certified by the golden vectors).
#pragma once

#include "common/bundle.h"
#include "dgr/shard/v1/shard_runtime.pb.h"

#include <grpcpp/support/status.h>

#include <string>

namespace dgr::worker {

inline grpc::StatusCode code_for(::dgr::shard::v1::ErrorReason r) {
    return static_cast<grpc::StatusCode>(bundle::grpc_code_for(r));
}

inline ::dgr::shard::v1::ShardError make_error(::dgr::shard::v1::ErrorReason r, const std::string & msg,
                                               bool terminated = false) {
    ::dgr::shard::v1::ShardError e;
    e.set_reason(r);
    e.set_grpc_code(bundle::grpc_code_for(r));
    e.set_message(msg);
    e.set_session_terminated(terminated);
    return e;
}

// A failed check of the validator as a (non-terminal) ShardError.
inline ::dgr::shard::v1::ShardError make_error(const bundle::ProtocolError & pe) { return pe.to_message(false); }

// The gRPC status of a failure: the mapped code, a message starting with the reason name, and
// the standard `grpc-status-details-bin` trailer: a google.rpc.Status whose details carry the
// ShardError (any gRPC client or grpcurl can read it). Unary RPCs also send the ShardError in
// the `dgr-error-bin` trailer (kept for existing clients).
grpc::Status status_for(const ::dgr::shard::v1::ShardError & e);
// The same for a stream that ends with `code`/`message` because of `e`.
grpc::Status status_with(grpc::StatusCode code, const std::string & message, const ::dgr::shard::v1::ShardError & e);

}  // namespace dgr::worker
