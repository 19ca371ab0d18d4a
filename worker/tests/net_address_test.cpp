// Addresses are parsed, never prefix-matched (common/net_address.h): names that only look like
// loopback are not loopback; v4, v6 and v4-mapped v6 literals are; the chain-peer allowlist
// checks every address and never resolves a name it does not list.
#include "check.h"
#include "common/net_address.h"
#include "worker/downstream.h"

#include <string>
#include <vector>

using namespace dgr;

int main() {
    IpAddress ip;
    CHECK(parse_ip_literal("127.0.0.1", &ip) && ip.loopback() && ip.v4(), "v4 loopback");
    CHECK(parse_ip_literal("127.255.0.9", &ip) && ip.loopback(), "127/8");
    CHECK(parse_ip_literal("::1", &ip) && ip.loopback() && !ip.v4(), "v6 loopback");
    CHECK(parse_ip_literal("[::1]", &ip) && ip.loopback(), "bracketed v6");
    CHECK(parse_ip_literal("[::ffff:127.0.0.1]", &ip) && ip.loopback() && ip.v4(), "v4-mapped loopback");
    CHECK(parse_ip_literal("::ffff:10.0.0.1", &ip) && !ip.loopback() && ip.to_string() == "10.0.0.1",
          "v4-mapped is the v4 address: %s", ip.to_string().c_str());
    CHECK(parse_ip_literal("::2", &ip) && !ip.loopback(), "::2");
    CHECK(parse_ip_literal("128.0.0.1", &ip) && !ip.loopback(), "128.0.0.1");
    for (const char * name : {"127.0.0.1.evil.example", "localhost.attacker", "127.evil", "127.0.0.1:80", "",
                              "::1.evil", "127.1", "0x7f000001"}) {
        CHECK(!parse_ip_literal(name, &ip), "%s is not an IP literal", name);
    }
    // loopback by resolution: every result checked; invalid names do not resolve here
    CHECK(host_is_loopback("127.0.0.1") && host_is_loopback("::1") && host_is_loopback("[::ffff:127.0.0.1]"),
          "loopback literals");
    CHECK(host_is_loopback("localhost"), "localhost resolves to loopback addresses only");
    for (const char * name : {"127.0.0.1.evil.example", "localhost.attacker", "10.0.0.1", "::ffff:10.0.0.1",
                              "0.0.0.0", "::"}) {
        CHECK(!host_is_loopback(name), "%s must not count as loopback", name);
    }

    std::string host, port;
    CHECK(split_host_port("[::1]:50051", &host, &port) && host == "::1" && port == "50051", "[v6]:port");
    CHECK(split_host_port("Example.ORG:1", &host, &port) && host == "example.org", "lower-cased");
    CHECK(!split_host_port("::1:50051", &host, &port), "bare v6 with a port is ambiguous");
    CHECK(!split_host_port("host:99999", &host, &port) && !split_host_port("host:", &host, &port) &&
              !split_host_port("host:1x", &host, &port),
          "bad ports");

    // the chain-peer allowlist (default: loopback)
    worker::ChainOptions o;
    worker::ChainPeers loop(o);
    for (const char * ep : {"127.0.0.1:5", "127.0.0.2:5", "[::1]:5", "[::ffff:127.0.0.1]:5", "localhost:5"}) {
        const worker::PeerCheck c = loop.check(ep);
        CHECK(c.allowed && c.loopback, "%s allowed by the loopback default: %s", ep, c.why.c_str());
    }
    CHECK(loop.check("[::ffff:127.0.0.1]:5").target == "ipv4:127.0.0.1:5", "dialled by the checked address: %s",
          loop.check("[::ffff:127.0.0.1]:5").target.c_str());
    CHECK(loop.check("localhost:7").target.rfind("ipv", 0) == 0, "a listed name is dialled by its address");
    for (const char * ep : {"127.0.0.1.evil.example:5", "localhost.attacker:5", "10.1.2.3:5", "[::ffff:10.1.2.3]:5",
                            "127.0.0.1", "evil:5"}) {
        const worker::PeerCheck c = loop.check(ep);
        CHECK(!c.allowed, "%s must be refused", ep);
    }
    worker::ChainOptions lab;
    lab.peers = {"198.18.0.2", "::ffff:198.18.0.3"};
    worker::ChainPeers labp(lab);
    CHECK(labp.check("198.18.0.2:1").allowed && labp.check("[::ffff:198.18.0.2]:1").allowed &&
              labp.check("198.18.0.3:1").allowed,
          "v4 and v4-mapped entries match both spellings");
    CHECK(!labp.check("198.18.0.4:1").allowed && !labp.check("127.0.0.1:1").allowed, "exact addresses only");
    worker::ChainOptions any;
    any.peers = {"*"};
    CHECK(worker::ChainPeers(any).check("anything.example:1").allowed, "'*' admits names unresolved");
    AddressAllowlist bad;
    std::string err;
    CHECK(!bad.build({"no-such-host.invalid"}, &err) && !err.empty(), "an unresolvable entry fails the list");

    if (g_failures) std::fprintf(stderr, "%d failure(s)\n", g_failures);
    else std::printf("net_address_test: ok\n");
    return g_failures ? 1 : 0;
}
