// Addresses parsed, never compared as strings: the loopback check of --listen/--metrics-listen
// and the chain-peer allowlist (--chain-peers) work on IP addresses. An IP literal (IPv4 dotted
// quad, IPv6, IPv4-mapped IPv6, with or without [brackets]) is parsed; any other host name is
// resolved once (getaddrinfo) and EVERY address it resolves to is checked. So
// "127.0.0.1.evil.example" or "localhost.attacker" are whatever DNS says they are (refused when
// they do not resolve), never loopback because of how they start.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace dgr {

// An IP address as 16 bytes; IPv4 is held as IPv4-mapped IPv6 (::ffff:a.b.c.d), so "10.0.0.1"
// and "::ffff:10.0.0.1" are the same address.
struct IpAddress {
    std::array<uint8_t, 16> bytes{};
    bool v4() const;  // IPv4 or IPv4-mapped
    bool loopback() const;  // 127.0.0.0/8 (also mapped), ::1
    std::string to_string() const;  // "a.b.c.d" or the IPv6 text
    bool operator==(const IpAddress & o) const { return bytes == o.bytes; }
};

// Strip one pair of [brackets]; lower-case.
std::string normalize_host(const std::string & host);
// An IP literal -> true + *out; anything else (a name, "127.1", trailing dots) -> false.
bool parse_ip_literal(const std::string & host, IpAddress * out);
// The addresses `host` stands for: a literal is itself; a name is resolved (getaddrinfo, both
// families). false + *error when it does not resolve.
bool resolve_host(const std::string & host, std::vector<IpAddress> * out, std::string * error);
// "host:port" / "[v6]:port" -> host (lower-case, no brackets) and port; false when malformed.
bool split_host_port(const std::string & endpoint, std::string * host, std::string * port);
// Every address `host` resolves to is loopback (and there is at least one).
bool host_is_loopback(const std::string & host);

// The chain-peer allowlist: "*" (any), IP literals, and names resolved once when the list is
// built. A loopback entry (127.0.0.1, ::1, localhost) admits every loopback address.
class AddressAllowlist {
public:
    AddressAllowlist() = default;
    // false + *error when a name in `entries` does not resolve.
    bool build(const std::vector<std::string> & entries, std::string * error);
    bool any() const { return any_; }
    // Every address in `addrs` is allowed (and there is at least one).
    bool allows(const std::vector<IpAddress> & addrs) const;
    // The addresses a host name of the list resolved to when it was built (nullptr: not listed).
    const std::vector<IpAddress> * listed_name(const std::string & host) const;

private:
    bool any_ = false;
    bool loopback_ = false;
    std::vector<IpAddress> addrs_;
    std::vector<std::pair<std::string, std::vector<IpAddress>>> names_;
};

}  // namespace dgr
