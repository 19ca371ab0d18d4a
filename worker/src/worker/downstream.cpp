#include "worker/downstream.h"

#include <algorithm>
#include <chrono>
#include <cctype>

namespace dgr::worker {

void LinkCount::add(int d) {
    std::lock_guard<std::mutex> lk(mu_);
    n_ += d;
    if (n_ == 0) cv_.notify_all();
}

bool LinkCount::wait_zero(int ms) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::milliseconds(ms), [this] { return n_ == 0; });
}

ChainPeers::ChainPeers(ChainOptions o) : opts_(std::move(o)) {
    std::string err;
    if (!allow_.build(opts_.peers, &err)) allow_ = AddressAllowlist();  // fail closed (serve.cpp checked it)
}

ChainPeers::~ChainPeers() {
    // links end within the keepalive bound once closed (a closed link's downstream answers the
    // half-close or is cut as silent); 5 s covers that on a loaded host
    if (links_->wait_zero(5000)) return;
    for (auto & [key, stub] : stubs_) (void) stub.release();  // see the class comment
}

std::shared_ptr<DownstreamLink> ChainPeers::open(const PeerCheck & peer, std::string endpoint,
                                                 DownstreamLink::OnReply on_reply, DownstreamLink::OnEnd on_end) {
    return DownstreamLink::open(stub(peer), links_, std::move(endpoint), std::move(on_reply), std::move(on_end));
}

PeerCheck ChainPeers::check(const std::string & endpoint) const {
    PeerCheck c;
    std::string host, port;
    if (!split_host_port(endpoint, &host, &port)) {
        c.why = "not HOST:PORT";
        return c;
    }
    IpAddress lit;
    std::vector<IpAddress> addrs;
    if (parse_ip_literal(host, &lit)) {
        addrs.push_back(lit);
    } else if (const auto * listed = allow_.listed_name(host)) {
        addrs = *listed;
        c.tls_name = host;
    } else if (allow_.any()) {
        c.allowed = true;
        c.target = endpoint;  // "*": gRPC resolves the name
        c.loopback = host == "localhost";
        return c;
    } else {
        c.why = "host name '" + host + "' is not in --chain-peers (names are resolved once, at startup)";
        return c;
    }
    c.loopback = std::all_of(addrs.begin(), addrs.end(), [](const IpAddress & a) { return a.loopback(); });
    if (!allow_.allows(addrs)) {
        c.why = "address not allowed";
        return c;
    }
    c.allowed = true;
    const IpAddress & a = addrs.front();
    c.target = a.v4() ? "ipv4:" + a.to_string() + ":" + port : "ipv6:[" + a.to_string() + "]:" + port;
    return c;
}

std::shared_ptr<DownstreamLink> DownstreamLink::open(pb::ShardRuntimeService::Stub * stub,
                                                     std::shared_ptr<LinkCount> count, std::string endpoint,
                                                     OnReply on_reply, OnEnd on_end) {
    std::shared_ptr<DownstreamLink> l(
        new DownstreamLink(std::move(count), std::move(endpoint), std::move(on_reply), std::move(on_end)));
    l->self_ = l;
    stub->async()->Session(&l->ctx_, l.get());
    l->StartRead(&l->resp_);
    l->StartCall();
    return l;
}

size_t DownstreamLink::send(pb::SessionRequest req) {
    const size_t n = req.ByteSizeLong();
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_ || done_) return n;
    out_.push_back(std::move(req));
    if (!writing_) {
        writing_ = true;
        StartWrite(&out_.front());
    }
    return n;
}

void DownstreamLink::close(bool cancel) {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    if (done_) return;
    if (cancel) {
        ctx_.TryCancel();
    } else if (writing_) {
        out_.resize(1);  // the frame being written goes out whole, then the half-close
        half_close_after_write_ = true;
    } else {
        StartWritesDone();  // a downstream that never answers is cut by the channel's keepalive
    }
}

void DownstreamLink::OnReadDone(bool ok) {
    if (!ok) return;  // OnDone follows
    pb::SessionResponse r = std::move(resp_);
    resp_.Clear();
    {
        std::lock_guard<std::mutex> lk(mu_);
        if (closed_) return;
        // callback under the lock: close() cannot return while a callback is running
        on_reply_(std::move(r));
    }
    StartRead(&resp_);
}

void DownstreamLink::OnWriteDone(bool ok) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!ok) {
        out_.clear();
        writing_ = false;
        return;
    }
    out_.pop_front();
    if (!out_.empty() && !closed_) {
        StartWrite(&out_.front());
    } else {
        writing_ = false;
        if (half_close_after_write_) {
            half_close_after_write_ = false;
            StartWritesDone();
        }
    }
}

void DownstreamLink::OnDone(const grpc::Status & s) {
    std::shared_ptr<DownstreamLink> keep;
    {
        std::lock_guard<std::mutex> lk(mu_);
        done_ = true;
        if (!closed_) on_end_(s);
        keep = std::move(self_);
    }
}

pb::ShardRuntimeService::Stub * ChainPeers::stub(const PeerCheck & peer) {
    const std::string key = peer.target + "|" + peer.tls_name;
    std::lock_guard<std::mutex> lk(mu_);
    auto it = stubs_.find(key);
    if (it != stubs_.end()) return it->second.get();
    std::shared_ptr<grpc::ChannelCredentials> creds;
    if (opts_.tls_ca_pem.empty()) {
        creds = grpc::InsecureChannelCredentials();
    } else {
        grpc::SslCredentialsOptions ssl;
        ssl.pem_root_certs = opts_.tls_ca_pem;
        ssl.pem_cert_chain = opts_.tls_cert_pem;
        ssl.pem_private_key = opts_.tls_key_pem;
        creds = grpc::SslCredentials(ssl);
    }
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize((int) std::min<uint64_t>(opts_.max_message_bytes, INT32_MAX));
    args.SetMaxReceiveMessageSize((int) std::min<uint64_t>(opts_.max_message_bytes, INT32_MAX));
    // failure detection on the chained hop (docs/failover.md, "Detection"): a silent next
    // shard (stopped process, dead link) fails the hop within time + timeout = 1.5 s (measured
    // ~2.3 s with 1000 + 1000 on a busy host, under the 3 s bound with little margin)
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 500);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 1000);
    args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    // dialled by its checked address: the certificate is still verified for the listed name
    if (!peer.tls_name.empty() && !opts_.tls_ca_pem.empty()) args.SetSslTargetNameOverride(peer.tls_name);
    auto ch = grpc::CreateCustomChannel(peer.target, creds, args);
    auto stub = pb::ShardRuntimeService::NewStub(ch);
    auto * p = stub.get();
    stubs_[key] = std::move(stub);
    return p;
}

}  // namespace dgr::worker
