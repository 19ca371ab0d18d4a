// dgr.shard.v1.ShardRuntimeService over the gRPC callback API. Reactions only validate what
// needs no state and post to the Scheduler; a Session stream keeps at most one read and one
// write in flight, and reads its next frame only once the previous one is answered, so a
// stream never holds more than one unanswered frame (bounded memory per stream).
#pragma once

#include "dgr/shard/v1/shard_runtime.grpc.pb.h"
#include "worker/backend.h"
#include "worker/device_memory.h"
#include "worker/metrics.h"
#include "worker/scheduler.h"

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace dgr::worker {

class Deliverer;  // service.cpp: hands Session stream writes to gRPC off the scheduler thread

struct ServiceInfo {
    std::string dgr_version, llama_commit, patch_digest, backend;
    // --require-client-auth: every ShardRuntimeService RPC needs an authenticated client
    // certificate (UNAUTHENTICATED otherwise); health and reflection do not (serve.cpp).
    bool require_client_auth = false;
    // re-reads the compute device's free memory for GetCapability and the metrics (nullptr: the
    // figures read at start-up)
    std::shared_ptr<DeviceMemoryReader> device_memory;
};

// The authenticated client identity of a call: "subject=<x509 subject>;san=<peer identities>"
// from the mTLS peer certificate, empty when the connection carries none.
std::string client_identity_of(const grpc::CallbackServerContext & ctx);

// The callback service with every method taking raw bytes: the service decodes each request
// itself, so bytes that are not the method's request are answered INVALID_ARGUMENT with a
// BAD_REQUEST ShardError. gRPC's own decoding would end a Session stream OK and answer a unary
// call UNIMPLEMENTED, as if the method did not exist.
using Svc = pb::ShardRuntimeService;
using ServiceBase = Svc::WithRawCallbackMethod_GetCapability<Svc::WithRawCallbackMethod_Session<
    Svc::WithRawCallbackMethod_ReleaseSession<Svc::WithRawCallbackMethod_CancelSession<
        Svc::WithRawCallbackMethod_GetMetrics<Svc::WithRawCallbackMethod_Tokenize<
            Svc::WithRawCallbackMethod_Detokenize<Svc::WithRawCallbackMethod_ApplyChatTemplate<Svc::Service>>>>>>>>;

// How a unary handler answers: with OK its response is sent, otherwise the status alone.
using UnaryDone = std::function<void(grpc::Status)>;

class ShardService final : public ServiceBase {
public:
    // Starts the delivery thread (it inherits the calling thread's priority: see serve.cpp).
    ShardService(ModelBackend & backend, Scheduler & scheduler, Metrics & metrics, ServiceInfo rt);
    ~ShardService() override;

    // The gRPC methods: each decodes its request (see ServiceBase) and calls its handler below.
    grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> * Session(grpc::CallbackServerContext * ctx) override;
    grpc::ServerUnaryReactor * GetCapability(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                             grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * ReleaseSession(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                              grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * CancelSession(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                             grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * GetMetrics(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                          grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * Tokenize(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                        grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * Detokenize(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                          grpc::ByteBuffer * resp) override;
    grpc::ServerUnaryReactor * ApplyChatTemplate(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * req,
                                                 grpc::ByteBuffer * resp) override;

    // Draining: unary RPCs that would add work answer UNAVAILABLE (sessions: see Scheduler).
    void set_draining() { draining_ = true; }

    // Every metric family; with dgr_worker_info{version,backend,llama_commit} for Prometheus.
    std::vector<prometheus::MetricFamily> metric_families() const;
    std::vector<prometheus::MetricFamily> prometheus_families() const;

private:
    template <class Req, class Resp>
    using UnaryHandler = void (ShardService::*)(grpc::CallbackServerContext *, const Req &, Resp *, UnaryDone);
    // Checks the client (require_client_auth), decodes `in` as a Req (INVALID_ARGUMENT with a
    // BAD_REQUEST ShardError when it is not one), runs the handler and encodes its response.
    template <class Req, class Resp>
    grpc::ServerUnaryReactor * unary(grpc::CallbackServerContext * ctx, const grpc::ByteBuffer * in,
                                     grpc::ByteBuffer * out, UnaryHandler<Req, Resp> handler);

    // The unary handlers, on decoded requests; each calls `done` exactly once.
    void on_get_capability(grpc::CallbackServerContext * ctx, const pb::GetCapabilityRequest & req,
                           pb::GetCapabilityResponse * resp, UnaryDone done);
    void on_release_session(grpc::CallbackServerContext * ctx, const pb::ReleaseSessionRequest & req,
                            pb::ReleaseSessionResponse * resp, UnaryDone done);
    void on_cancel_session(grpc::CallbackServerContext * ctx, const pb::CancelSessionRequest & req,
                           pb::CancelSessionResponse * resp, UnaryDone done);
    void on_get_metrics(grpc::CallbackServerContext * ctx, const pb::GetMetricsRequest & req,
                        pb::GetMetricsResponse * resp, UnaryDone done);
    void on_tokenize(grpc::CallbackServerContext * ctx, const pb::TokenizeRequest & req, pb::TokenizeResponse * resp,
                     UnaryDone done);
    void on_detokenize(grpc::CallbackServerContext * ctx, const pb::DetokenizeRequest & req,
                       pb::DetokenizeResponse * resp, UnaryDone done);
    void on_apply_chat_template(grpc::CallbackServerContext * ctx,  // chat_template.cpp
                                const pb::ApplyChatTemplateRequest & req, pb::ApplyChatTemplateResponse * resp,
                                UnaryDone done);

    // With require_client_auth and no authenticated client: finish `reactor` UNAUTHENTICATED
    // and return true.
    bool refuse_unauthenticated(grpc::CallbackServerContext * ctx, grpc::ServerUnaryReactor * reactor) const;
    // A Session call that ends UNAUTHENTICATED before reading a frame (client_auth.cpp).
    grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> * refused_stream() const;

    ModelBackend & backend_;
    Scheduler & scheduler_;
    Metrics & metrics_;
    ServiceInfo rt_;
    std::atomic<bool> draining_{false};
    std::shared_ptr<Deliverer> deliverer_;
};

}  // namespace dgr::worker
