#include "worker/errors.h"

#include "google/rpc/status.pb.h"

namespace dgr::worker {

grpc::Status status_with(grpc::StatusCode code, const std::string & message, const ::dgr::shard::v1::ShardError & e) {
    google::rpc::Status st;
    st.set_code(static_cast<int>(code));
    st.set_message(message);
    st.add_details()->PackFrom(e);
    return grpc::Status(code, message, st.SerializeAsString());
}

grpc::Status status_for(const ::dgr::shard::v1::ShardError & e) {
    return status_with(code_for(e.reason()), ::dgr::shard::v1::ErrorReason_Name(e.reason()) + ": " + e.message(), e);
}

}  // namespace dgr::worker
