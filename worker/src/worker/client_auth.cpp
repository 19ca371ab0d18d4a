// Client authentication for ShardRuntimeService: the mTLS client identity of a call (the owner
// of the sessions its streams open) and the --require-client-auth gate (health and reflection
// are other services and stay open).
#include "worker/service.h"

namespace dgr::worker {

std::string client_identity_of(const grpc::CallbackServerContext & ctx) {
    const std::shared_ptr<const grpc::AuthContext> auth = ctx.auth_context();
    if (!auth || !auth->IsPeerAuthenticated()) return "";
    std::string subject, san;
    for (const auto & v : auth->FindPropertyValues("x509_subject")) subject.append(v.data(), v.size());
    for (const auto & v : auth->GetPeerIdentity()) {
        if (!san.empty()) san += ",";
        san.append(v.data(), v.size());
    }
    return "subject=" + subject + ";san=" + san;
}

namespace {

// A Session call refused before any frame is read (--require-client-auth without a client cert).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
public:
    explicit RefusedStream(grpc::Status st) { Finish(std::move(st)); }
    void OnDone() override { delete this; }
};

grpc::Status unauthenticated_status() {
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "this worker requires a client certificate (mTLS) for ShardRuntimeService; "
                        "only health and reflection are open");
}

}  // namespace

bool ShardService::refuse_unauthenticated(grpc::CallbackServerContext * ctx, grpc::ServerUnaryReactor * reactor) const {
    if (!rt_.require_client_auth || !client_identity_of(*ctx).empty()) return false;
    reactor->Finish(unauthenticated_status());
    return true;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> * ShardService::refused_stream() const {
    return new RefusedStream(unauthenticated_status());
}

}  // namespace dgr::worker
