// Socket addresses as text, for messages.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <string>

namespace ddpdiag {

// "[::1]", the URL form of an IPv6 address, as the address itself ("::1");
// any other text as it is.
inline std::string without_ipv6_brackets(const std::string& host) {
  return host.size() > 2 && host.front() == '[' && host.back() == ']' ? host.substr(1, host.size() - 2) : host;
}

// The IP address of an IPv4 or IPv6 socket address ("10.0.0.2", "fe80::1");
// "" for another family.
inline std::string ip_text(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (sa->sa_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, buf, sizeof buf);
  else if (sa->sa_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, buf, sizeof buf);
  return buf;
}

// Address and port of an IPv4 or IPv6 socket address: "10.0.0.2:4711",
// "[fe80::1]:4711"; for another family, a phrase naming it.
inline std::string endpoint_text(const sockaddr* sa) {
  if (sa->sa_family == AF_INET)
    return ip_text(sa) + ":" + std::to_string(ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port));
  if (sa->sa_family == AF_INET6)
    return "[" + ip_text(sa) + "]:" +
           std::to_string(ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port));
  return "(an address of family " + std::to_string(sa->sa_family) + ")";
}

}  // namespace ddpdiag
