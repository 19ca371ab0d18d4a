#include "worker/metrics.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

namespace dgr::worker {

void Histogram::observe(double v) {
    std::lock_guard<std::mutex> lk(mu_);
    size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    counts_[i]++;
    sum_ += v;
    count_++;
}

static std::string fmt_le(double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", b);
    return buf;
}

void Histogram::append(const std::string & name, std::vector<Sample> * out) const {
    std::lock_guard<std::mutex> lk(mu_);
    uint64_t cum = 0;
    for (size_t i = 0; i < bounds_.size(); ++i) {
        cum += counts_[i];
        out->push_back({name + "_bucket", {{"le", fmt_le(bounds_[i])}}, (double) cum});
    }
    cum += counts_.back();
    out->push_back({name + "_bucket", {{"le", "+Inf"}}, (double) cum});
    out->push_back({name + "_sum", {}, sum_});
    out->push_back({name + "_count", {}, (double) count_});
}

Metrics::Metrics()
    : step_latency({0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}),
      batch_occupancy({1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048}),
      queue_wait({0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5}) {}

std::vector<Sample> Metrics::samples(const Gauges & g) const {
    std::vector<Sample> s;
    s.push_back({"dgr_active_sessions", {}, (double) g.active_sessions});
    s.push_back({"dgr_max_sessions", {}, (double) g.max_sessions});
    s.push_back({"dgr_queue_depth", {}, (double) g.queued_steps});
    s.push_back({"dgr_kv_cells_used", {}, (double) g.kv_cells_used});
    s.push_back({"dgr_kv_cells_total", {}, (double) g.kv_cells_total});
    s.push_back({"dgr_memory_bytes", {{"part", "weights"}}, (double) g.weight_bytes});
    s.push_back({"dgr_memory_bytes", {{"part", "kv"}}, (double) g.kv_bytes});
    s.push_back({"dgr_memory_bytes", {{"part", "scratch"}}, (double) g.scratch_bytes});
    s.push_back({"dgr_memory_budget_bytes", {}, (double) g.memory_budget_bytes});
    s.push_back({"dgr_prefill_tokens_total", {}, (double) prefill_tokens.load()});
    s.push_back({"dgr_decode_tokens_total", {}, (double) decode_tokens.load()});
    s.push_back({"dgr_decode_busy_seconds_total", {}, busy_seconds.load()});
    s.push_back({"dgr_decode_only_busy_seconds_total", {}, decode_only_busy_seconds.load()});
    s.push_back({"dgr_decode_only_batches_total", {}, (double) decode_only_batches.load()});
    s.push_back({"dgr_decode_only_rows_total", {}, (double) decode_only_rows.load()});
    s.push_back({"dgr_batches_total", {}, (double) batches.load()});
    s.push_back({"dgr_batch_rows_total", {}, (double) batch_rows.load()});
    s.push_back({"dgr_steps_total", {}, (double) steps.load()});
    s.push_back({"dgr_replayed_steps_total", {}, (double) replayed_steps.load()});
    s.push_back({"dgr_step_errors_total", {}, (double) step_errors.load()});
    s.push_back({"dgr_sessions_opened_total", {}, (double) sessions_opened.load()});
    s.push_back({"dgr_sessions_released_total", {}, (double) sessions_released.load()});
    s.push_back({"dgr_sessions_evicted_total", {}, (double) sessions_evicted.load()});
    s.push_back({"dgr_sessions_cancelled_total", {}, (double) sessions_cancelled.load()});
    s.push_back({"dgr_rejected_admissions_total", {{"reason", "sessions"}}, (double) rejected_sessions.load()});
    s.push_back({"dgr_rejected_admissions_total", {{"reason", "queue"}}, (double) rejected_queue.load()});
    s.push_back({"dgr_rejected_admissions_total", {{"reason", "kv"}}, (double) rejected_kv.load()});
    s.push_back({"dgr_chain_frames_sent_total", {{"phase", "prefill"}}, (double) chain_frames_prefill.load()});
    s.push_back({"dgr_chain_frames_sent_total", {{"phase", "decode"}}, (double) chain_frames_decode.load()});
    s.push_back({"dgr_chain_frame_bytes_sent_total", {{"phase", "prefill"}}, (double) chain_bytes_prefill.load()});
    s.push_back({"dgr_chain_frame_bytes_sent_total", {{"phase", "decode"}}, (double) chain_bytes_decode.load()});
    s.push_back({"dgr_chain_hop_seconds_total", {{"phase", "prefill"}}, chain_hop_seconds_prefill.load()});
    s.push_back({"dgr_chain_hop_seconds_total", {{"phase", "decode"}}, chain_hop_seconds_decode.load()});
    s.push_back({"dgr_chain_replies_total", {{"phase", "prefill"}}, (double) chain_replies_prefill.load()});
    s.push_back({"dgr_chain_replies_total", {{"phase", "decode"}}, (double) chain_replies_decode.load()});
    s.push_back({"dgr_generated_tokens_total", {}, (double) generated_tokens.load()});
    step_latency.append("dgr_step_latency_seconds", &s);
    batch_occupancy.append("dgr_batch_occupancy_sessions", &s);
    queue_wait.append("dgr_queue_wait_seconds", &s);
    return s;
}

std::string Metrics::prometheus_text(const std::vector<Sample> & samples) {
    std::ostringstream o;
    std::string last_family;
    for (const auto & s : samples) {
        std::string family = s.name;
        for (const char * suf : {"_bucket", "_sum", "_count"}) {
            const size_t n = std::strlen(suf);
            if (family.size() > n && family.compare(family.size() - n, n, suf) == 0 &&
                (s.name.find("latency") != std::string::npos || s.name.find("occupancy") != std::string::npos ||
                 s.name.find("queue_wait") != std::string::npos)) {
                family = family.substr(0, family.size() - n);
                break;
            }
        }
        if (family != last_family) {
            const bool hist = family != s.name;
            const bool counter = family.size() > 6 && family.compare(family.size() - 6, 6, "_total") == 0;
            o << "# TYPE " << family << ' ' << (hist ? "histogram" : counter ? "counter" : "gauge") << '\n';
            last_family = family;
        }
        o << s.name;
        if (!s.labels.empty()) {
            o << '{';
            bool first = true;
            for (const auto & kv : s.labels) {
                if (!first) o << ',';
                first = false;
                o << kv.first << "=\"" << kv.second << '"';
            }
            o << '}';
        }
        char buf[64];
        std::snprintf(buf, sizeof buf, " %.17g\n", s.value);
        o << buf;
    }
    return o.str();
}

MetricsHttpServer::~MetricsHttpServer() { stop(); }

bool MetricsHttpServer::start(const std::string & addr, std::function<std::string()> render, std::string * error) {
    render_ = std::move(render);
    const size_t colon = addr.rfind(':');
    if (colon == std::string::npos) { *error = "--metrics-listen wants HOST:PORT"; return false; }
    std::string host = addr.substr(0, colon);
    const std::string port = addr.substr(colon + 1);
    if (host.size() > 1 && host.front() == '[') host = host.substr(1, host.size() - 2);
    addrinfo hints{}, * res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || !res) { *error = "cannot resolve " + addr; return false; }
    fd_ = socket(res->ai_family, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (fd_ < 0 || bind(fd_, res->ai_addr, res->ai_addrlen) != 0 || listen(fd_, 16) != 0) {
        *error = std::string("cannot listen on ") + addr + ": " + std::strerror(errno);
        freeaddrinfo(res);
        if (fd_ >= 0) close(fd_);
        fd_ = -1;
        return false;
    }
    freeaddrinfo(res);
    sockaddr_storage ss{};
    socklen_t sl = sizeof ss;
    getsockname(fd_, (sockaddr *) &ss, &sl);
    port_ = ntohs(ss.ss_family == AF_INET6 ? ((sockaddr_in6 *) &ss)->sin6_port : ((sockaddr_in *) &ss)->sin_port);
    thread_ = std::thread([this] { loop(); });
    return true;
}

void MetricsHttpServer::stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
}

void MetricsHttpServer::loop() {
    while (!stop_) {
        pollfd p{fd_, POLLIN, 0};
        if (poll(&p, 1, 200) <= 0) continue;
        int c = accept(fd_, nullptr, nullptr);
        if (c < 0) continue;
        timeval tv{2, 0};
        setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char buf[2048];
        ssize_t n = recv(c, buf, sizeof buf - 1, 0);
        std::string req = n > 0 ? std::string(buf, (size_t) n) : "";
        std::string resp;
        if (req.rfind("GET /metrics", 0) == 0) {
            const std::string body = render_();
            resp = "HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: " +
                   std::to_string(body.size()) + "\r\n\r\n" + body;
        } else {
            resp = "HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n";
        }
        size_t off = 0;
        while (off < resp.size()) {
            ssize_t w = send(c, resp.data() + off, resp.size() - off, MSG_NOSIGNAL);
            if (w <= 0) break;
            off += (size_t) w;
        }
        close(c);
    }
}

}  // namespace dgr::worker
