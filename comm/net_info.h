// This host's network interfaces, their addresses and link speeds, and which
// interface an address belongs to: what a rank's backend traffic goes over.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace ddpdiag {

struct NetInterface {
  std::string name;                    // "eth0"
  std::vector<std::string> addresses;  // IPv4 and IPv6 addresses, as text
  // The routable ones with their prefix, "10.0.0.2/24" (IPv6 link-local
  // fe80::/10 left out: every link has one, so they say nothing of which
  // hosts share a network).
  std::vector<std::string> networks;
  std::optional<int> speed_mbps;       // the link's speed where the driver says (Mb/s)
  bool loopback = false;
};

// The interfaces that are up and have an IP address, sorted by name.
// Speeds come from <sysfs>/NAME/speed, where <sysfs> is /sys/class/net or
// the directory DDPDIAG_SYS_CLASS_NET names (tests). Virtual links (veth,
// virtio, loopback) often have no speed: nullopt.
std::vector<NetInterface> host_interfaces();

// The link speed of interface `name` in Mb/s, or nullopt when unknown
// (no such file, -1, 0, not a number).
std::optional<int> link_speed_mbps(const std::string& name);

// The interface among `interfaces` that holds address `ip` ("" if none).
std::string interface_with_address(const std::vector<NetInterface>& interfaces,
                                   const std::string& ip);

// Whether address `ip` lies in `network` ("10.0.0.2/24": 10.0.0.0 to
// 10.0.0.255; IPv4 or IPv6, each only against its own family). False for
// text that is not an address or a network.
bool in_network(const std::string& ip, const std::string& network);

// Whether `ip` is an IPv6 link-local address (fe80::/10).
bool is_link_local(const std::string& ip);

// The route this host's kernel gives to an address, as `ip route get IP`
// shows it: the interface the traffic leaves by, the gateway it is sent to
// ("" when the address is on a network of that interface) and the source
// address the kernel would pick ("" when it names none). local: the address
// is one of this host's own (the traffic stays on the host).
struct Route {
  std::string interface;
  std::string gateway;
  std::string source;
  bool local = false;
};

// The routes to each of `ips` (IPv4 or IPv6 address text), asked of the
// kernel over one rtnetlink socket, in order; an entry is nullopt where the
// address is not one, or the kernel has no route (its reason in *why, when
// given, for the first such entry). Each answer within 1 s.
std::vector<std::optional<Route>> routes_to(const std::vector<std::string>& ips,
                                            std::string* why = nullptr);

// "this host sends to 10.0.2.3 out by eth0 via gateway 10.0.0.254" (no
// gateway: on eth0's network; one of its own: "10.0.2.3 is this host's own
// address"): the kernel's route to ip, for an error message; "" when the
// kernel gives none.
std::string route_text(const std::string& ip);

// A link's speed in Mb/s as the GB/s (1e9 bytes/s) that busbw is given in:
// 25000 Mb/s is 3.125 GB/s each way.
constexpr double link_gbytes_per_s(int mbps) { return mbps / 8000.0; }

// "1 Gb/s", "100 Gb/s", "2.5 Gb/s", "100 Mb/s".
std::string format_link_speed(int mbps);

// Whether a host answers a TCP connection to addr within timeout (a
// non-blocking connect, then poll): accepted or refused, the host and the
// path to it are up (kAnswers); no answer in time, or no route, they are
// not (kSilent); anything else kUnknown.
enum class TcpReach { kUnknown, kAnswers, kSilent };
TcpReach tcp_probe(const sockaddr_storage& addr, std::chrono::milliseconds timeout);
// The same, telling an accepted connection from a refused one: a host
// whose port is refused is up with nothing listening there (the process
// that listened has ended); one that accepts has a listener (which may yet
// never answer: its process is frozen). Reset after the handshake (a
// listener whose queue overflowed): the host is up, nothing more is known.
enum class PortReach { kUnknown, kAccepts, kRefused, kReset, kSilent };
PortReach tcp_port_probe(const sockaddr_storage& addr, std::chrono::milliseconds timeout);
PortReach tcp_port_probe(const std::string& host_port, std::chrono::milliseconds timeout);
// The same for "host:port" with a numeric host ("10.0.0.2:29500",
// "[::1]:29500"); kUnknown for a host name (no resolver call that could
// block).
TcpReach tcp_probe(const std::string& host_port, std::chrono::milliseconds timeout);

}  // namespace ddpdiag
