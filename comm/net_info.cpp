#include "comm/net_info.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <map>

#include <fmt/core.h>

#include "comm/ip_text.h"

namespace ddpdiag {

namespace {

std::string sys_class_net() {
  const char* dir = std::getenv("DDPDIAG_SYS_CLASS_NET");
  return dir && *dir ? dir : "/sys/class/net";
}

}  // namespace

std::optional<int> link_speed_mbps(const std::string& name) {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
    return std::nullopt;
  std::ifstream f(sys_class_net() + "/" + name + "/speed");
  std::string text;
  // Reading fails (EINVAL) for a link that is down or has no speed.
  if (!f || !std::getline(f, text)) return std::nullopt;
  int mbps = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), mbps);
  if (ec != std::errc() || (end != text.data() + text.size() && *end != ' ') || mbps <= 0)
    return std::nullopt;
  return mbps;
}

std::vector<NetInterface> host_interfaces() {
  std::map<std::string, NetInterface> by_name;
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  for (const ifaddrs* a = list; a; a = a->ifa_next) {
    if (!a->ifa_addr || !a->ifa_name || !(a->ifa_flags & IFF_UP)) continue;
    if (a->ifa_addr->sa_family != AF_INET && a->ifa_addr->sa_family != AF_INET6) continue;
    NetInterface& i = by_name[a->ifa_name];
    i.name = a->ifa_name;
    i.loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
    std::string ip = ip_text(a->ifa_addr);
    if (ip.empty()) continue;
    i.addresses.push_back(ip);
    // The prefix length: the set bits of the netmask.
    int prefix = 0;
    if (a->ifa_netmask && a->ifa_netmask->sa_family == a->ifa_addr->sa_family) {
      const auto* m = a->ifa_netmask->sa_family == AF_INET
                          ? reinterpret_cast<const unsigned char*>(
                                &reinterpret_cast<const sockaddr_in*>(a->ifa_netmask)->sin_addr)
                          : reinterpret_cast<const unsigned char*>(
                                &reinterpret_cast<const sockaddr_in6*>(a->ifa_netmask)->sin6_addr);
      const int bytes = a->ifa_netmask->sa_family == AF_INET ? 4 : 16;
      for (int b = 0; b < bytes; ++b) prefix += __builtin_popcount(m[b]);
    }
    if (!is_link_local(ip)) i.networks.push_back(ip + "/" + std::to_string(prefix));
  }
  ::freeifaddrs(list);
  std::vector<NetInterface> out;
  for (auto& [name, i] : by_name) {
    if (!i.loopback) i.speed_mbps = link_speed_mbps(name);
    out.push_back(std::move(i));
  }
  return out;
}

std::string interface_with_address(const std::vector<NetInterface>& interfaces,
                                   const std::string& ip) {
  for (const auto& i : interfaces)
    if (std::find(i.addresses.begin(), i.addresses.end(), ip) != i.addresses.end()) return i.name;
  return "";
}

bool in_network(const std::string& ip, const std::string& network) {
  const auto slash = network.find('/');
  if (slash == std::string::npos) return false;
  const std::string base = network.substr(0, slash);
  int prefix = -1;
  const std::string p = network.substr(slash + 1);
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), prefix);
  if (ec != std::errc() || end != p.data() + p.size()) return false;
  unsigned char a[16] = {}, b[16] = {};
  int bytes = 0;
  if (::inet_pton(AF_INET, ip.c_str(), a) == 1 && ::inet_pton(AF_INET, base.c_str(), b) == 1)
    bytes = 4;
  else if (::inet_pton(AF_INET6, ip.c_str(), a) == 1 && ::inet_pton(AF_INET6, base.c_str(), b) == 1)
    bytes = 16;
  if (bytes == 0 || prefix < 0 || prefix > 8 * bytes) return false;
  for (int bit = 0; bit < prefix; ++bit) {
    const int mask = 0x80 >> (bit % 8);
    if ((a[bit / 8] & mask) != (b[bit / 8] & mask)) return false;
  }
  return true;
}

bool is_link_local(const std::string& ip) { return in_network(ip, "fe80::/10"); }

std::string format_link_speed(int mbps) {
  if (mbps < 1000) return fmt::format("{} Mb/s", mbps);
  if (mbps % 1000 == 0) return fmt::format("{} Gb/s", mbps / 1000);
  return fmt::format("{:g} Gb/s", mbps / 1000.0);
}

namespace {

// One RTM_GETROUTE request to the kernel for `ip` on netlink socket fd:
// the route, or nullopt with the reason in why.
std::optional<Route> ask_route(int fd, const std::string& ip, std::uint32_t seq, std::string& why) {
  struct {
    nlmsghdr header;
    rtmsg route;
    char attributes[64];
  } request{};
  in6_addr a6{};
  in_addr a4{};
  int family = AF_UNSPEC;
  const void* bytes = nullptr;
  std::size_t size = 0;
  if (::inet_pton(AF_INET, ip.c_str(), &a4) == 1) {
    family = AF_INET, bytes = &a4, size = sizeof a4;
  } else if (::inet_pton(AF_INET6, ip.c_str(), &a6) == 1) {
    family = AF_INET6, bytes = &a6, size = sizeof a6;
  } else {
    why = "'" + ip + "' is not an IP address";
    return std::nullopt;
  }
  request.header.nlmsg_len = NLMSG_LENGTH(sizeof(rtmsg));
  request.header.nlmsg_type = RTM_GETROUTE;
  request.header.nlmsg_flags = NLM_F_REQUEST;
  request.header.nlmsg_seq = seq;
  request.route.rtm_family = static_cast<unsigned char>(family);
  request.route.rtm_dst_len = static_cast<unsigned char>(size * 8);
  auto* attr = reinterpret_cast<rtattr*>(reinterpret_cast<char*>(&request) +
                                         NLMSG_ALIGN(request.header.nlmsg_len));
  attr->rta_type = RTA_DST;
  attr->rta_len = static_cast<unsigned short>(RTA_LENGTH(size));
  std::memcpy(RTA_DATA(attr), bytes, size);
  request.header.nlmsg_len = NLMSG_ALIGN(request.header.nlmsg_len) + RTA_ALIGN(attr->rta_len);
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd, &request, request.header.nlmsg_len, 0, reinterpret_cast<sockaddr*>(&kernel),
               sizeof kernel) < 0) {
    why = std::string("cannot ask the kernel for a route: ") + std::strerror(errno);
    return std::nullopt;
  }
  alignas(nlmsghdr) char reply[8192];
  for (;;) {
    const ssize_t n = ::recv(fd, reply, sizeof reply, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      why = std::string("no route answer from the kernel: ") + std::strerror(errno);
      return std::nullopt;
    }
    int left = static_cast<int>(n);
    for (auto* h = reinterpret_cast<nlmsghdr*>(reply); NLMSG_OK(h, left); h = NLMSG_NEXT(h, left)) {
      if (h->nlmsg_seq != seq) continue;  // an answer to an earlier request that timed out
      if (h->nlmsg_type == NLMSG_ERROR) {
        const auto* e = static_cast<const nlmsgerr*>(NLMSG_DATA(h));
        why = std::string("no route to ") + ip + ": " + std::strerror(-e->error);
        return std::nullopt;
      }
      if (h->nlmsg_type != RTM_NEWROUTE) continue;
      const auto* rt = static_cast<const rtmsg*>(NLMSG_DATA(h));
      Route route;
      route.local = rt->rtm_type == RTN_LOCAL;
      int attr_left = static_cast<int>(RTM_PAYLOAD(h));
      const auto address = [&](const rtattr* x) {
        char text[INET6_ADDRSTRLEN] = {0};
        if (RTA_PAYLOAD(x) == size) ::inet_ntop(family, RTA_DATA(x), text, sizeof text);
        return std::string(text);
      };
      for (const rtattr* x = RTM_RTA(rt); RTA_OK(x, attr_left); x = RTA_NEXT(x, attr_left)) {
        if (x->rta_type == RTA_OIF && RTA_PAYLOAD(x) >= sizeof(int)) {
          int index = 0;
          std::memcpy(&index, RTA_DATA(x), sizeof index);
          char name[IF_NAMESIZE] = {0};
          if (::if_indextoname(static_cast<unsigned>(index), name)) route.interface = name;
        } else if (x->rta_type == RTA_GATEWAY) {
          route.gateway = address(x);
        } else if (x->rta_type == RTA_PREFSRC) {
          route.source = address(x);
        }
      }
      return route;
    }
  }
}

}  // namespace

std::vector<std::optional<Route>> routes_to(const std::vector<std::string>& ips, std::string* why) {
  std::vector<std::optional<Route>> out(ips.size());
  if (ips.empty()) return out;
  std::string first_why;
  const int fd = ::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE);
  if (fd < 0) {
    if (why) *why = std::string("cannot open a netlink socket to ask for routes: ") + std::strerror(errno);
    return out;
  }
  timeval limit{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  for (std::size_t i = 0; i < ips.size(); ++i) {
    std::string reason;
    out[i] = ask_route(fd, ips[i], static_cast<std::uint32_t>(i + 1), reason);
    if (!out[i] && first_why.empty()) first_why = reason;
  }
  ::close(fd);
  if (why) *why = first_why;
  return out;
}

std::string route_text(const std::string& ip) {
  const auto routes = routes_to({ip});
  const auto& r = routes.front();
  if (!r || r->interface.empty()) return "";
  if (r->local) return ip + " is this host's own address";
  return "this host sends to " + ip + " out by " + r->interface +
         (r->gateway.empty() ? " (on that interface's network)" : " via gateway " + r->gateway);
}

PortReach tcp_port_probe(const sockaddr_storage& addr, std::chrono::milliseconds timeout) {
  if (addr.ss_family != AF_INET && addr.ss_family != AF_INET6) return PortReach::kUnknown;
  const socklen_t len = addr.ss_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  const int fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return PortReach::kUnknown;
  const auto answer = [](int err) {
    if (err == 0) return PortReach::kAccepts;
    if (err == ECONNREFUSED) return PortReach::kRefused;
    if (err == ECONNRESET) return PortReach::kReset;
    if (err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN ||
        err == ENETDOWN)
      return PortReach::kSilent;
    return PortReach::kUnknown;
  };
  PortReach result = PortReach::kUnknown;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
    result = PortReach::kAccepts;
  } else if (errno != EINPROGRESS) {
    result = answer(errno);
  } else {
    pollfd pfd{fd, POLLOUT, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(std::max<long long>(0, timeout.count())));
    if (ready == 0) {
      result = PortReach::kSilent;
    } else if (ready > 0) {
      int err = 0;
      socklen_t err_len = sizeof err;
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_len) == 0) result = answer(err);
    }
  }
  ::close(fd);
  return result;
}

namespace {
// Accepted or refused, the host and the path to it are up.
TcpReach host_reach(PortReach r) {
  switch (r) {
    case PortReach::kAccepts:
    case PortReach::kRefused:
    case PortReach::kReset:
      return TcpReach::kAnswers;
    case PortReach::kSilent:
      return TcpReach::kSilent;
    case PortReach::kUnknown:
      break;
  }
  return TcpReach::kUnknown;
}
}  // namespace

TcpReach tcp_probe(const sockaddr_storage& addr, std::chrono::milliseconds timeout) {
  return host_reach(tcp_port_probe(addr, timeout));
}

PortReach tcp_port_probe(const std::string& host_port, std::chrono::milliseconds timeout) {
  const auto colon = host_port.rfind(':');
  if (colon == std::string::npos) return PortReach::kUnknown;
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  int port = 0;
  const char* p = host_port.data() + colon + 1;
  const char* end = host_port.data() + host_port.size();
  if (std::from_chars(p, end, port).ptr != end || port <= 0 || port > 65535) return PortReach::kUnknown;
  sockaddr_storage addr{};
  if (auto* a4 = reinterpret_cast<sockaddr_in*>(&addr); ::inet_pton(AF_INET, host.c_str(), &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons(static_cast<std::uint16_t>(port));
  } else if (auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
             ::inet_pton(AF_INET6, host.c_str(), &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons(static_cast<std::uint16_t>(port));
  } else {
    return PortReach::kUnknown;
  }
  return tcp_port_probe(addr, timeout);
}

TcpReach tcp_probe(const std::string& host_port, std::chrono::milliseconds timeout) {
  return host_reach(tcp_port_probe(host_port, timeout));
}

}  // namespace ddpdiag
