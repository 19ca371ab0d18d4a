#include "common/net_address.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <cctype>
#include <cstring>

namespace dgr {

namespace {

IpAddress from_v4(const in_addr & a) {
    IpAddress ip;
    ip.bytes[10] = 0xff;
    ip.bytes[11] = 0xff;
    std::memcpy(ip.bytes.data() + 12, &a, 4);
    return ip;
}

IpAddress from_v6(const in6_addr & a) {
    IpAddress ip;
    std::memcpy(ip.bytes.data(), &a, 16);
    return ip;
}

}  // namespace

bool IpAddress::v4() const {
    static const uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return std::memcmp(bytes.data(), prefix, 12) == 0;
}

bool IpAddress::loopback() const {
    if (v4()) return bytes[12] == 127;
    static const uint8_t one[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    return std::memcmp(bytes.data(), one, 16) == 0;
}

std::string IpAddress::to_string() const {
    char buf[INET6_ADDRSTRLEN] = {0};
    if (v4()) {
        inet_ntop(AF_INET, bytes.data() + 12, buf, sizeof buf);
    } else {
        inet_ntop(AF_INET6, bytes.data(), buf, sizeof buf);
    }
    return buf;
}

std::string normalize_host(const std::string & host) {
    std::string h = host;
    if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
    std::transform(h.begin(), h.end(), h.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    return h;
}

bool parse_ip_literal(const std::string & host, IpAddress * out) {
    const std::string h = normalize_host(host);
    in_addr a4{};
    in6_addr a6{};
    if (inet_pton(AF_INET, h.c_str(), &a4) == 1) {  // strict dotted quad
        *out = from_v4(a4);
        return true;
    }
    if (inet_pton(AF_INET6, h.c_str(), &a6) == 1) {
        *out = from_v6(a6);
        return true;
    }
    return false;
}

bool resolve_host(const std::string & host, std::vector<IpAddress> * out, std::string * error) {
    out->clear();
    const std::string h = normalize_host(host);
    IpAddress lit;
    if (parse_ip_literal(h, &lit)) {
        out->push_back(lit);
        return true;
    }
    if (h.empty()) {
        if (error) *error = "empty host";
        return false;
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo * res = nullptr;
    const int rc = getaddrinfo(h.c_str(), nullptr, &hints, &res);
    if (rc != 0) {
        if (error) *error = "host '" + h + "' does not resolve: " + gai_strerror(rc);
        return false;
    }
    for (addrinfo * p = res; p; p = p->ai_next) {
        IpAddress ip;
        if (p->ai_family == AF_INET) {
            ip = from_v4(reinterpret_cast<const sockaddr_in *>(p->ai_addr)->sin_addr);
        } else if (p->ai_family == AF_INET6) {
            ip = from_v6(reinterpret_cast<const sockaddr_in6 *>(p->ai_addr)->sin6_addr);
        } else {
            continue;
        }
        if (std::find(out->begin(), out->end(), ip) == out->end()) out->push_back(ip);
    }
    freeaddrinfo(res);
    if (out->empty()) {
        if (error) *error = "host '" + h + "' resolves to no IP address";
        return false;
    }
    return true;
}

bool split_host_port(const std::string & ep, std::string * host, std::string * port) {
    std::string h, p;
    if (!ep.empty() && ep.front() == '[') {
        const size_t close = ep.find(']');
        if (close == std::string::npos || close + 1 >= ep.size() || ep[close + 1] != ':') return false;
        h = ep.substr(1, close - 1);
        p = ep.substr(close + 2);
    } else {
        const size_t colon = ep.rfind(':');
        if (colon == std::string::npos || colon == 0 || ep.find(':') != colon) return false;
        h = ep.substr(0, colon);
        p = ep.substr(colon + 1);
    }
    if (h.empty() || p.empty() || p.size() > 5 ||
        !std::all_of(p.begin(), p.end(), [](unsigned char c) { return std::isdigit(c); }) || std::stoul(p) > 65535) {
        return false;
    }
    *host = normalize_host(h);
    *port = p;
    return true;
}

bool host_is_loopback(const std::string & host) {
    std::vector<IpAddress> addrs;
    if (!resolve_host(host, &addrs, nullptr)) return false;
    return std::all_of(addrs.begin(), addrs.end(), [](const IpAddress & a) { return a.loopback(); });
}

bool AddressAllowlist::build(const std::vector<std::string> & entries, std::string * error) {
    any_ = loopback_ = false;
    addrs_.clear();
    names_.clear();
    for (const auto & e : entries) {
        if (e == "*") {
            any_ = true;
            continue;
        }
        std::vector<IpAddress> got;
        if (!resolve_host(e, &got, error)) return false;
        IpAddress lit;
        if (!parse_ip_literal(e, &lit)) names_.emplace_back(normalize_host(e), got);
        const bool all_loop = std::all_of(got.begin(), got.end(), [](const IpAddress & a) { return a.loopback(); });
        if (all_loop) {
            loopback_ = true;
        } else {
            addrs_.insert(addrs_.end(), got.begin(), got.end());
        }
    }
    return true;
}

const std::vector<IpAddress> * AddressAllowlist::listed_name(const std::string & host) const {
    const std::string h = normalize_host(host);
    for (const auto & n : names_) {
        if (n.first == h) return &n.second;
    }
    return nullptr;
}

bool AddressAllowlist::allows(const std::vector<IpAddress> & addrs) const {
    if (addrs.empty()) return false;
    if (any_) return true;
    return std::all_of(addrs.begin(), addrs.end(), [&](const IpAddress & a) {
        if (a.loopback()) return loopback_;
        return std::find(addrs_.begin(), addrs_.end(), a) != addrs_.end();
    });
}

}  // namespace dgr
