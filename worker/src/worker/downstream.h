// Chained routes: a worker's own client stream to the next Shard of a route (one per session).
// The scheduler sends the session's boundary frames through it and gets the route's answer
// back as an event; it never waits on the network.
#pragma once

#include "common/net_address.h"
#include "worker/option_table.h"
#include "dgr/shard/v1/shard_runtime.grpc.pb.h"

#include <grpcpp/grpcpp.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dgr::worker {

namespace pb = ::dgr::shard::v1;

struct ChainOptions {
    // Hosts a session may chain to ("*": any): IP literals, or names resolved once when the
    // scheduler starts (common/net_address.h). Default: --chain-peers' (loopback only).
    std::vector<std::string> peers = split_peer_list(default_text(Opt::kChainPeers));
    // TLS towards downstream workers: CA to verify them (empty: plaintext), and the client
    // identity presented to them (mTLS), usually the worker's own --tls-cert/--tls-key.
    std::string tls_ca_pem, tls_cert_pem, tls_key_pem;
    uint64_t max_message_bytes = default_u64(Opt::kMaxMessageBytes);
};

// A downstream endpoint checked against the allowlist: its addresses (parsed literal, or the
// addresses its listed name resolved to at startup) and the gRPC target dialled (the checked
// address itself, never the name again).
struct PeerCheck {
    bool allowed = false;
    bool loopback = false;       // every address is loopback (the hop shares this host)
    std::string why;             // when refused
    std::string target;          // gRPC target: "ipv4:A:P" / "ipv6:[A]:P", or the endpoint ("*" and a name)
    std::string tls_name;        // host name for TLS verification when dialling an address
};

// The links of one ChainPeers still alive (see ~ChainPeers). A link holds one count from
// before its call starts until after its ClientContext, and with it the context's reference to
// the channel, is gone.
class LinkCount {
public:
    class Hold {
    public:
        explicit Hold(std::shared_ptr<LinkCount> c) : c_(std::move(c)) { c_->add(1); }
        ~Hold() { c_->add(-1); }
        Hold(const Hold &) = delete;
        Hold & operator=(const Hold &) = delete;
    private:
        std::shared_ptr<LinkCount> c_;
    };
    // Waits up to `ms` for every link to be gone; false on time-out.
    bool wait_zero(int ms);
private:
    void add(int d);
    std::mutex mu_;
    std::condition_variable cv_;
    int n_ = 0;
};

class DownstreamLink : public grpc::ClientBidiReactor<pb::SessionRequest, pb::SessionResponse>,
                       public std::enable_shared_from_this<DownstreamLink> {
public:
    using OnReply = std::function<void(pb::SessionResponse)>;
    using OnEnd = std::function<void(const grpc::Status &)>;

    // Starts the stream (connects lazily); callbacks run on gRPC threads.
    static std::shared_ptr<DownstreamLink> open(pb::ShardRuntimeService::Stub * stub,
                                                std::shared_ptr<LinkCount> count, std::string endpoint,
                                                OnReply on_reply, OnEnd on_end);
    // Queues one frame; returns its serialized size.
    size_t send(pb::SessionRequest req);
    // Ends the stream, and with it the downstream's part of the session; no callback after this
    // returns. `cancel`: the session was cancelled, the stream is cancelled (the downstream counts
    // it cancelled); otherwise the stream is half-closed after the frame being written, if any
    // (frames still queued are dropped) and the downstream releases its part.
    void close(bool cancel);
    const std::string & endpoint() const { return endpoint_; }

    void OnReadDone(bool ok) override;
    void OnWriteDone(bool ok) override;
    void OnDone(const grpc::Status & s) override;

private:
    DownstreamLink(std::shared_ptr<LinkCount> count, std::string endpoint, OnReply r, OnEnd e)
        : hold_(std::move(count)), endpoint_(std::move(endpoint)), on_reply_(std::move(r)), on_end_(std::move(e)) {}
    LinkCount::Hold hold_;  // first member: released last, after ctx_
    std::string endpoint_;
    OnReply on_reply_;
    OnEnd on_end_;
    grpc::ClientContext ctx_;
    pb::SessionResponse resp_;
    std::mutex mu_;
    std::deque<pb::SessionRequest> out_;
    bool writing_ = false;
    bool closed_ = false;
    bool done_ = false;
    bool half_close_after_write_ = false;
    std::shared_ptr<DownstreamLink> self_;  // alive until OnDone
};

// Channels and stubs per downstream endpoint, shared by sessions.
//
// The channels must not be released last on a gRPC callback thread. With gRPC's callback API on
// a poller without background threads (epoll1), every server and channel shares one
// process-wide completion queue with its own "nexting" threads. When the last of them goes
// away there, the queue is shut down and deleted from one of its own threads, which then reads
// it again (abort in grpc_cq_internal_unref; seen in pipeline_test, which starts and stops
// workers in one process). A link's ClientContext holds a reference to its channel and is
// destroyed on such a thread, in OnDone. So the destructor waits for every link opened here to
// be gone before the stubs, and with them the channels, go; a link still alive after the wait
// (a downstream that never ends its stream) keeps its channel alive for the rest of the process.
class ChainPeers {
public:
    // Builds the allowlist (names resolved once, here; a name that does not resolve admits nothing).
    explicit ChainPeers(ChainOptions o);
    ~ChainPeers();
    const ChainOptions & options() const { return opts_; }
    // Parses `endpoint` and checks every address it stands for; never resolves a name that is
    // not in the list (no DNS on the scheduler thread), except with "*".
    PeerCheck check(const std::string & endpoint) const;
    // Opens a session's stream to an allowed peer (DownstreamLink::open on its channel).
    std::shared_ptr<DownstreamLink> open(const PeerCheck & peer, std::string endpoint,
                                         DownstreamLink::OnReply on_reply, DownstreamLink::OnEnd on_end);
private:
    pb::ShardRuntimeService::Stub * stub(const PeerCheck & peer);
    std::shared_ptr<LinkCount> links_ = std::make_shared<LinkCount>();
    ChainOptions opts_;
    AddressAllowlist allow_;
    std::mutex mu_;
    std::map<std::string, std::unique_ptr<pb::ShardRuntimeService::Stub>> stubs_;
};

}  // namespace dgr::worker
