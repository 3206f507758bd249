// CPU placement of Gloo ranks: the CPU-list format round-trips, bad lists are
// refused with the bad part named, and the warnings fire exactly when a host
// runs more ranks than the CPUs they may use, or when a rank may use one CPU.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "comm/net_info.h"
#include "diag/placement.h"

using namespace ddpdiag;
using Catch::Matchers::Contains;

namespace {

reports::RankInfo rank(int r, const std::string& host, const std::string& cpus) {
  reports::RankInfo info;
  info.rank = r;
  info.host = host;
  info.pid = 100 + r;
  info.device = "cpu";
  info.cpus = cpus;
  return info;
}

}  // namespace

TEST_CASE("format_cpu_list writes ranges and parse_cpu_list reads them back", "[placement]") {
  CHECK(format_cpu_list({}) == "");
  CHECK(format_cpu_list({3}) == "3");
  CHECK(format_cpu_list({0, 1, 2, 3}) == "0-3");
  CHECK(format_cpu_list({8, 0, 2, 1, 3, 10, 11, 2}) == "0-3,8,10-11");
  CHECK(format_cpu_list({0, 2, 4}) == "0,2,4");
  CHECK(parse_cpu_list("") == std::vector<int>{});
  CHECK(parse_cpu_list("0-3,8,10-11") == std::vector<int>{0, 1, 2, 3, 8, 10, 11});
  CHECK(parse_cpu_list("5") == std::vector<int>{5});
  for (const char* bad : {"a", "1,", ",1", "1,,2", "3-1", "1-", "-1", "1-2-3", "0x1"})
    CHECK_THROWS_WITH(parse_cpu_list(bad), Contains(bad));
}

TEST_CASE("allowed_cpus is this process's affinity", "[placement]") {
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  const auto cpus = allowed_cpus();
  CHECK(static_cast<int>(cpus.size()) == CPU_COUNT(&set));
  for (int c : cpus) CHECK(CPU_ISSET(c, &set));
  CHECK(std::is_sorted(cpus.begin(), cpus.end()));
}

TEST_CASE("placement warnings", "[placement]") {
  SECTION("one rank per CPU, each with two or more: no warning") {
    CHECK(placement_warnings({rank(0, "a", "0-1"), rank(1, "a", "0-1")}, {"a", "a"}).empty());
    CHECK(placement_warnings({rank(0, "a", "0-3"), rank(1, "a", "4-7")}, {"a", "a"}).empty());
  }
  SECTION("more ranks than the CPUs they share: oversubscribed, named per host") {
    auto w = placement_warnings({rank(0, "a", "0-1"), rank(1, "a", "0-1"), rank(2, "a", "0-1"),
                                 rank(3, "a", "0-1")},
                                {"a", "a", "a", "a"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "cpu_oversubscribed");
    CHECK_THAT(w[0].detail, Contains("a runs 4 ranks on 2 CPUs (0-1)"));
    CHECK_THAT(w[0].detail, Contains("--bind-to none"));
  }
  SECTION("two ranks bound to the same single CPU are oversubscribed, not 'single'") {
    auto w = placement_warnings({rank(0, "a", "0"), rank(1, "a", "0")}, {"a", "a"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "cpu_oversubscribed");
    CHECK_THAT(w[0].detail, Contains("a runs 2 ranks on 1 CPU (0)"));
  }
  SECTION("each rank bound to a core of its own (mpirun's default): single") {
    auto w = placement_warnings({rank(0, "a", "0"), rank(1, "a", "1")}, {"a", "a"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "cpu_single");
    CHECK_THAT(w[0].detail, Contains("ranks 0-1 may each use one CPU only (CPUs 0-1)"));
    CHECK_THAT(w[0].detail, Contains("mpirun"));
  }
  SECTION("hosts are judged apart; the same CPU numbers on two machines do not add up") {
    auto w = placement_warnings({rank(0, "a", "0-1"), rank(1, "a", "0-1"), rank(2, "b", "0"),
                                 rank(3, "c", "0-3"), rank(4, "c", "0-3"), rank(5, "c", "0-3")},
                                {"a", "a", "b", "c", "c", "c"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "cpu_single");
    CHECK_THAT(w[0].detail, Contains("rank 2 may use one CPU only (CPU 0)"));
  }
  SECTION("both kinds at once, each rank in one of them only") {
    auto w = placement_warnings({rank(0, "a", "0"), rank(1, "a", "0"), rank(2, "b", "3")},
                                {"a", "a", "b"});
    REQUIRE(w.size() == 2);
    CHECK(w[0].name == "cpu_oversubscribed");
    CHECK_THAT(w[0].detail, Contains("a runs 2 ranks on 1 CPU"));
    CHECK(w[1].name == "cpu_single");
    CHECK_THAT(w[1].detail, Contains("rank 2 may use"));
  }
  SECTION("the machine, not the reported host name, decides who shares CPUs") {
    // --test-hosts gives ranks on one machine different names.
    auto w = placement_warnings({rank(0, "x", "0"), rank(1, "y", "0")}, {"m", "m"});
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0].detail, Contains("m runs 2 ranks on 1 CPU"));
    // Clones share a host name but not a boot id: two machines, one CPU each.
    w = placement_warnings({rank(0, "n", "0"), rank(1, "n", "0")}, {"n#boot-a", "n#boot-b"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "cpu_single");
    // One machine shows its host name, not its key.
    w = placement_warnings({rank(0, "n", "0"), rank(1, "n", "0")}, {"n#boot-a", "n#boot-a"});
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0].detail, Contains("n runs 2 ranks on 1 CPU (0)"));
    CHECK_THAT(w[0].detail, !Contains("boot-a"));
  }
  SECTION("unknown or malformed CPU lists are left out, not fatal") {
    CHECK(placement_warnings({rank(0, "a", ""), rank(1, "a", "")}, {"a", "a"}).empty());
    CHECK(placement_warnings({rank(0, "a", "zz"), rank(1, "a", "0-1")}, {"a", "a"}).empty());
  }
}

TEST_CASE("ranks that run different builds or library versions", "[placement]") {
  CHECK(mismatch_warnings({"0.1.0 (a)", "0.1.0 (a)"}, {"gloo 0.5.0", "gloo 0.5.0"}, "gloo").empty());
  // Unknown values (a rank of an older build says nothing) are left out.
  CHECK(mismatch_warnings({"0.1.0 (a)", ""}, {"", "nccl 2.28.9"}, "nccl").empty());

  auto w = mismatch_warnings({"0.1.0 (a)", "0.1.0 (a)", "0.1.0 (a)", "0.1.0 (b)"},
                             {"nccl 2.28.9", "nccl 2.21.5", "nccl 2.28.9", "nccl 2.28.9"}, "nccl");
  REQUIRE(w.size() == 2);
  CHECK(w[0].name == "ddpdiag_version_mismatch");
  CHECK_THAT(w[0].detail, Contains("0.1.0 (a) on ranks 0-2; 0.1.0 (b) on rank 3"));
  CHECK(w[1].name == "library_version_mismatch");
  CHECK_THAT(w[1].detail,
             Contains("different nccl libraries: nccl 2.28.9 on ranks 0,2-3; nccl 2.21.5 on rank 1"));
  CHECK_THAT(w[1].detail, Contains("LD_LIBRARY_PATH"));
}

namespace {

// Rank r on `host`, sending over `iface` (10.0.0.r+1); its host also has
// 10.2.0.r+1 on the fast network 10.2.0.0/24, and, where `faster` is named,
// that is the faster interface (on `faster_net`, by default the shared one).
reports::RankInfo on_net(int r, const std::string& host, const std::string& iface, int mbps,
                         const std::string& faster = "", int faster_mbps = -1,
                         const std::string& faster_net = "10.2.0.0/24") {
  reports::RankInfo info = rank(r, host, "0-7");
  info.net_interface = iface;
  info.net_address = "10.0.0." + std::to_string(r + 1);
  info.net_speed_mbps = mbps;
  info.faster_interface = faster;
  info.faster_speed_mbps = faster_mbps;
  if (!faster.empty()) info.faster_networks = {faster_net};
  info.host_addresses = {info.net_address, "10.2.0." + std::to_string(r + 1)};
  return info;
}

}  // namespace

TEST_CASE("network warnings: a slower interface than the host has, and links of different speeds",
          "[placement]") {
  SECTION("one machine: the traffic never leaves it, nothing to say") {
    auto w = network_warnings({on_net(0, "a", "eno1", 1000, "ens5", 100000),
                               on_net(1, "a", "eno1", 1000, "ens5", 100000)},
                              {"a#1", "a#1"});
    CHECK(w.empty());
  }
  SECTION("Gloo on the management NIC of one host") {
    auto w = network_warnings({on_net(0, "a", "ens5", 100000), on_net(1, "a", "ens5", 100000),
                               on_net(2, "b", "eno1", 1000, "ens5", 100000),
                               on_net(3, "b", "eno1", 1000, "ens5", 100000)},
                              {"a#1", "a#1", "b#2", "b#2"});
    REQUIRE(w.size() == 2);
    CHECK(w[0].name == "slower_interface");
    CHECK_THAT(w[0].detail, Contains("ranks 2-3 on b send over eno1 (1 Gb/s), but ens5 on that host "
                                     "runs at 100 Gb/s"));
    CHECK_THAT(w[0].detail, Contains("GLOO_SOCKET_IFNAME=ens5 (or --gloo-interface ens5)"));
    CHECK(w[1].name == "mixed_link_speeds");
    CHECK_THAT(w[1].detail, Contains("different speeds: 1 Gb/s (b); 100 Gb/s (a)"));
  }
  SECTION("one host's port negotiated a lower speed") {
    auto w = network_warnings({on_net(0, "a", "eth0", 25000), on_net(1, "b", "eth0", 25000),
                               on_net(2, "c", "eth0", 10000)},
                              {"a#1", "b#2", "c#3"});
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "mixed_link_speeds");
    CHECK_THAT(w[0].detail, Contains("10 Gb/s (c); 25 Gb/s (a, b)"));
  }
  SECTION("unknown speeds (virtual NICs) and equal ones say nothing") {
    CHECK(network_warnings({on_net(0, "a", "eth0", -1), on_net(1, "b", "eth0", -1, "ib0", 100000)},
                           {"a#1", "b#2"})
              .empty());
    CHECK(network_warnings({on_net(0, "a", "eth0", 25000), on_net(1, "b", "eth0", 25000)}, {"a#1", "b#2"})
              .empty());
    CHECK(network_warnings({rank(0, "a", "0"), rank(1, "b", "1")}, {"a#1", "b#2"}).empty());
  }
  SECTION("a faster interface on a network no other host is on is no place for Gloo") {
    auto w = network_warnings({on_net(0, "a", "eth0", 1000), on_net(1, "b", "eth0", 1000, "stor0", 100000,
                                                                     "192.168.50.0/24")},
                              {"a#1", "b#2"});
    CHECK(w.empty());
  }
  SECTION("4096 ranks on 512 hosts, each with a storage network of its own") {
    std::vector<reports::RankInfo> ranks;
    std::vector<std::string> machines;
    for (int r = 0; r < 4096; ++r) {
      const int h = r / 8;
      auto info = on_net(r, "n" + std::to_string(h), "eth0", 25000, "stor0", 100000,
                         "172." + std::to_string(16 + h / 256) + "." + std::to_string(h % 256) + ".0/24");
      info.host_addresses = {"10.0." + std::to_string(h / 256) + "." + std::to_string(h % 256),
                             "172." + std::to_string(16 + h / 256) + "." + std::to_string(h % 256) + ".1"};
      ranks.push_back(info);
      machines.push_back("n" + std::to_string(h) + "#1");
    }
    CHECK(network_warnings(ranks, machines).empty());
    // One host's storage network reaches another host: then it is said.
    ranks[4095].host_addresses.push_back("172.16.0.9");  // host 511 is on host 0's network
    auto w = network_warnings(ranks, machines);
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0].detail, Contains("ranks 0-7 on n0 send over eth0 (25 Gb/s), but stor0"));
  }
  SECTION("a rank with a single-rank verb") {
    auto w = network_warnings({on_net(0, "a", "eno1", 2500, "ib0", 200000), on_net(1, "b", "eno1", 2500)},
                              {"a#1", "b#2"});
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0].detail, Contains("rank 0 on a sends over eno1 (2.5 Gb/s), but ib0 on that host runs "
                                     "at 200 Gb/s"));
  }
}

TEST_CASE("network warnings: routes that leave by another interface than Gloo's", "[placement]") {
  using Egress = reports::RankInfo::Egress;
  auto ranks = std::vector<reports::RankInfo>{on_net(0, "a", "ens5", 100000), on_net(1, "a", "ens5", 100000),
                                              on_net(2, "b", "ens5", 100000), on_net(3, "c", "ens5", 100000)};
  const std::vector<std::string> machines = {"a#1", "a#1", "b#2", "c#3"};
  SECTION("no egress: nothing to say, and the links are the listeners'") {
    CHECK(network_warnings(ranks, machines).empty());
    CHECK(reports::slowest_link_of(ranks[0]) == 100000);
    CHECK(reports::link_speed_to(ranks[0], 3) == 100000);
  }
  SECTION("two ranks of one host route to two peers out by a slower NIC, one more by an unknown one") {
    ranks[0].egress = {Egress{"eno1", 1000, "10.0.0.254", {2, 3}}};
    ranks[1].egress = {Egress{"eno1", 1000, "10.0.0.254", {3}}};
    ranks[2].egress = {Egress{"tun0", -1, "", {0}}};
    auto w = network_warnings(ranks, machines);
    REQUIRE(w.size() == 1);
    CHECK(w[0].name == "egress_interface");
    CHECK_THAT(w[0].detail, Contains("ranks 0-1 on a listen on ens5 (100 Gb/s), but this host routes their "
                                     "traffic to ranks 2-3 out by eno1 (1 Gb/s) via gateway 10.0.0.254; "
                                     "rank 2 on b listens on ens5 (100 Gb/s), but this host routes its "
                                     "traffic to rank 0 out by tun0."));
    CHECK_THAT(w[0].detail, Contains("ip route get <peer's address>"));
    CHECK(reports::slowest_link_of(ranks[0]) == 1000);
    CHECK(reports::slowest_link_of(ranks[2]) == -1);  // a link of unknown speed
    CHECK(reports::slowest_link_of(ranks[3]) == 100000);
    CHECK(reports::link_speed_to(ranks[0], 1) == 100000);
    CHECK(reports::link_speed_to(ranks[0], 2) == 1000);
    CHECK(reports::link_speed_to(ranks[2], 0) == -1);
    CHECK(reports::link_speed_to(ranks[2], 3) == 100000);
  }
  SECTION("on one machine the traffic never leaves it") {
    ranks[0].egress = {Egress{"eno1", 1000, "", {1}}};
    CHECK(network_warnings({ranks[0], ranks[1]}, {"a#1", "a#1"}).empty());
  }
}

TEST_CASE("interfaces, their addresses and link speeds", "[placement]") {
  const std::string dir = "/tmp/ddpdiag-sysfs-" + std::to_string(::getpid());
  std::filesystem::create_directories(dir + "/eth9");
  std::filesystem::create_directories(dir + "/veth0");
  std::filesystem::create_directories(dir + "/odd");
  std::ofstream(dir + "/eth9/speed") << "25000\n";
  std::ofstream(dir + "/veth0/speed") << "-1\n";
  std::ofstream(dir + "/odd/speed") << "fast\n";
  ::setenv("DDPDIAG_SYS_CLASS_NET", dir.c_str(), 1);
  CHECK(link_speed_mbps("eth9") == 25000);
  CHECK_FALSE(link_speed_mbps("veth0"));   // the driver does not know
  CHECK_FALSE(link_speed_mbps("odd"));
  CHECK_FALSE(link_speed_mbps("absent"));
  CHECK_FALSE(link_speed_mbps("../eth9"));
  CHECK_FALSE(link_speed_mbps(""));
  ::unsetenv("DDPDIAG_SYS_CLASS_NET");
  std::filesystem::remove_all(dir);

  auto ifs = host_interfaces();
  CHECK(interface_with_address(ifs, "127.0.0.1") == "lo");
  CHECK(interface_with_address(ifs, "203.0.113.77") == "");
  for (const auto& i : ifs)
    if (i.name == "lo") {
      CHECK(i.loopback);
      CHECK_FALSE(i.speed_mbps);
    }
  CHECK(std::is_sorted(ifs.begin(), ifs.end(), [](const auto& a, const auto& b) { return a.name < b.name; }));

  CHECK(in_network("10.2.0.77", "10.2.0.3/24"));
  CHECK_FALSE(in_network("10.2.1.77", "10.2.0.3/24"));
  CHECK(in_network("10.2.1.77", "10.2.0.3/16"));
  CHECK(in_network("192.168.1.1", "0.0.0.0/0"));
  CHECK(in_network("fd00::5", "fd00::1/64"));
  CHECK_FALSE(in_network("fd01::5", "fd00::1/64"));
  CHECK_FALSE(in_network("10.2.0.77", "fd00::1/64"));  // families apart
  CHECK_FALSE(in_network("10.2.0.77", "10.2.0.3/33"));
  CHECK_FALSE(in_network("10.2.0.77", "10.2.0.3"));
  CHECK_FALSE(in_network("not-an-ip", "10.2.0.3/24"));
  CHECK(is_link_local("fe80::4ca4:1ff:fe2b:3c01"));
  CHECK_FALSE(is_link_local("fd00::1"));
  CHECK_FALSE(is_link_local("10.0.0.1"));
  for (const auto& i : ifs)
    for (const auto& n : i.networks) CHECK_FALSE(is_link_local(n.substr(0, n.find('/'))));
  bool lo_network = false;
  for (const auto& i : ifs)
    if (i.name == "lo")
      for (const auto& n : i.networks) lo_network = lo_network || n == "127.0.0.1/8";
  CHECK(lo_network);

  CHECK(format_link_speed(100) == "100 Mb/s");
  CHECK(format_link_speed(1000) == "1 Gb/s");
  CHECK(format_link_speed(2500) == "2.5 Gb/s");
  CHECK(format_link_speed(400000) == "400 Gb/s");
}

TEST_CASE("routes_to: the kernel's route to an address, as ip route get shows it", "[placement]") {
  std::string why;
  auto r = routes_to({"127.0.0.1", "not-an-ip", "::1"}, &why);
  REQUIRE(r.size() == 3);
  REQUIRE(r[0]);
  CHECK(r[0]->local);
  CHECK(r[0]->interface == "lo");
  CHECK(r[0]->gateway.empty());
  CHECK_FALSE(r[1]);
  CHECK(why == "'not-an-ip' is not an IP address");
  if (r[2]) CHECK(r[2]->local);  // where IPv6 is on
  CHECK(routes_to({}).empty());
  // An address of a network of each up IPv4 interface (the next one after
  // the interface's own): the route leaves by that interface, with no
  // gateway, from the interface's own address.
  for (const auto& i : host_interfaces()) {
    if (i.loopback) continue;
    for (const auto& n : i.networks) {
      const std::string own = n.substr(0, n.find('/'));
      in_addr a{};
      if (::inet_pton(AF_INET, own.c_str(), &a) != 1 || std::stoi(n.substr(n.find('/') + 1)) > 30 ||
          std::stoi(n.substr(n.find('/') + 1)) < 1)
        continue;
      const int prefix = std::stoi(n.substr(n.find('/') + 1));
      const std::uint32_t host = ntohl(a.s_addr), hostmask = (1u << (32 - prefix)) - 1;
      // A neighbour: neither the network's address nor its broadcast one.
      const std::uint32_t next = (host & hostmask) + 1 < hostmask ? host + 1 : host - 1;
      if ((next & hostmask) == 0) continue;
      in_addr b{};
      b.s_addr = htonl(next);
      char text[INET_ADDRSTRLEN];
      ::inet_ntop(AF_INET, &b, text, sizeof text);
      if (!in_network(text, n) || interface_with_address(host_interfaces(), text) != "") continue;
      auto on_link = routes_to({text, own});
      INFO(i.name << " " << n << " -> " << text);
      REQUIRE(on_link[0]);
      CHECK(on_link[0]->interface == i.name);
      CHECK(on_link[0]->gateway.empty());
      CHECK(on_link[0]->source == own);
      CHECK_FALSE(on_link[0]->local);
      REQUIRE(on_link[1]);
      CHECK(on_link[1]->local);  // the host's own address
    }
  }
}

TEST_CASE("tcp_probe: a host that accepts or refuses answers; a name or bad text is unknown",
          "[placement]") {
  using std::chrono::milliseconds;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const int port = ntohs(a.sin_port);
  // Bound, not listening: the kernel refuses, and the host has answered.
  CHECK(ddpdiag::tcp_probe("127.0.0.1:" + std::to_string(port), milliseconds(500)) ==
        ddpdiag::TcpReach::kAnswers);
  REQUIRE(::listen(fd, 4) == 0);
  CHECK(ddpdiag::tcp_probe("127.0.0.1:" + std::to_string(port), milliseconds(500)) ==
        ddpdiag::TcpReach::kAnswers);
  sockaddr_storage ss{};
  std::memcpy(&ss, &a, sizeof a);
  CHECK(ddpdiag::tcp_probe(ss, milliseconds(500)) == ddpdiag::TcpReach::kAnswers);
  ::close(fd);
  // No resolver call for a name; text that is no address is unknown.
  CHECK(ddpdiag::tcp_probe("localhost:" + std::to_string(port), milliseconds(500)) ==
        ddpdiag::TcpReach::kUnknown);
  for (const char* bad : {"127.0.0.1", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:70000",
                          "127.0.0.1:80x", ""})
    CHECK(ddpdiag::tcp_probe(bad, milliseconds(500)) == ddpdiag::TcpReach::kUnknown);
}
