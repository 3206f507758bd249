#include "diag/placement.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>

#include <fmt/core.h>

#include "comm/net_info.h"

namespace ddpdiag {

std::vector<int> allowed_cpus() {
  // Machines with more CPUs than a default cpu_set_t holds (1,024) exist:
  // grow the set until the kernel accepts its size.
  for (int n = CPU_SETSIZE; n <= (1 << 16); n *= 2) {
    cpu_set_t* set = CPU_ALLOC(n);
    if (!set) return {};
    const std::size_t bytes = CPU_ALLOC_SIZE(n);
    CPU_ZERO_S(bytes, set);
    if (sched_getaffinity(0, bytes, set) == 0) {
      std::vector<int> cpus;
      for (int c = 0; c < n; ++c)
        if (CPU_ISSET_S(c, bytes, set)) cpus.push_back(c);
      CPU_FREE(set);
      return cpus;
    }
    const int err = errno;
    CPU_FREE(set);
    if (err != EINVAL) return {};
  }
  return {};
}

std::string format_cpu_list(std::vector<int> cpus) {
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? fmt::format("{}", cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> parse_cpu_list(std::string_view s) {
  std::vector<int> out;
  auto number = [&](std::string_view t) {
    if (t.empty() || t.size() > 9 || t.find_first_not_of("0123456789") != std::string_view::npos)
      throw std::invalid_argument(fmt::format("'{}' in CPU list '{}' is not a CPU number", t, s));
    return std::atoi(std::string(t).c_str());
  };
  std::size_t pos = 0;
  while (pos < s.size()) {
    std::size_t comma = s.find(',', pos);
    if (comma == std::string_view::npos) comma = s.size();
    std::string_view part = s.substr(pos, comma - pos);
    const std::size_t dash = part.find('-');
    if (dash == std::string_view::npos) {
      out.push_back(number(part));
    } else {
      const int lo = number(part.substr(0, dash)), hi = number(part.substr(dash + 1));
      if (hi < lo || hi - lo > (1 << 16))
        throw std::invalid_argument(fmt::format("range '{}' in CPU list '{}' is not ascending", part, s));
      for (int c = lo; c <= hi; ++c) out.push_back(c);
    }
    pos = comma + 1;
    if (comma + 1 == s.size())
      throw std::invalid_argument(fmt::format("CPU list '{}' ends with a comma", s));
  }
  return out;
}

namespace {

// A machine key's host name: "node1#<boot id>" -> "node1".
std::string host_of(const std::string& machine) { return machine.substr(0, machine.find('#')); }

// "rank 3" or "ranks 0-2,5".
std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", format_cpu_list(ranks));
}

}  // namespace

std::vector<reports::Warning> placement_warnings(const std::vector<reports::RankInfo>& ranks,
                                                 const std::vector<std::string>& machines) {
  struct Machine {
    std::vector<int> ranks;
    std::set<int> cpus;
  };
  std::map<std::string, Machine> by_machine;
  std::vector<std::pair<int, std::vector<int>>> known;  // (rank, its CPUs), parsed once
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    if (r.cpus.empty()) continue;
    std::vector<int> cpus;
    try {
      cpus = parse_cpu_list(r.cpus);
    } catch (const std::invalid_argument&) {
      continue;  // a peer's odd value is no reason to fail the job
    }
    const std::string& m = i < machines.size() && !machines[i].empty() ? machines[i] : r.host;
    auto& mach = by_machine[m];
    mach.ranks.push_back(r.rank);
    mach.cpus.insert(cpus.begin(), cpus.end());
    known.emplace_back(r.rank, std::move(cpus));
  }

  std::vector<reports::Warning> out;
  std::vector<std::string> crowded;
  std::set<int> crowded_ranks;
  for (const auto& [key, m] : by_machine) {
    if (m.ranks.size() <= m.cpus.size()) continue;
    const std::string name = host_of(key);
    crowded.push_back(fmt::format("{} runs {} ranks on {} CPU{} ({})", name, m.ranks.size(),
                                  m.cpus.size(), m.cpus.size() == 1 ? "" : "s",
                                  format_cpu_list({m.cpus.begin(), m.cpus.end()})));
    crowded_ranks.insert(m.ranks.begin(), m.ranks.end());
  }
  if (!crowded.empty()) {
    std::string where;
    for (std::size_t i = 0; i < crowded.size() && i < 4; ++i) where += (i ? "; " : "") + crowded[i];
    if (crowded.size() > 4) where += fmt::format("; and {} more host(s)", crowded.size() - 4);
    out.push_back({"cpu_oversubscribed",
                   fmt::format("more Gloo ranks than CPUs: {}. Gloo's threads spin while they "
                               "wait, so with more ranks than CPUs a small all_reduce takes "
                               "milliseconds (a scheduler tick) instead of microseconds. Start "
                               "at most one rank per CPU, or let the ranks use more CPUs "
                               "(mpirun --bind-to none, srun --cpu-bind=none)",
                               where)});
  }

  std::vector<int> single, single_cpus;
  for (const auto& [rank, cpus] : known) {
    if (crowded_ranks.count(rank)) continue;
    if (cpus.size() == 1) {
      single.push_back(rank);
      single_cpus.push_back(cpus.front());
    }
  }
  if (!single.empty()) {
    std::set<int> distinct(single_cpus.begin(), single_cpus.end());
    out.push_back({"cpu_single",
                   fmt::format("{} may {}use one CPU only (CPU{} {}): the rank's own thread and "
                               "Gloo's network thread share it, which can slow small all_reduces. "
                               "A launcher's binding does this (mpirun binds each rank to a core "
                               "by default; srun --cpu-bind=cores); start the ranks with mpirun "
                               "--bind-to none or srun --cpu-bind=none, or give each rank two or "
                               "more CPUs",
                               rank_list(single), single.size() == 1 ? "" : "each ",
                               distinct.size() == 1 ? "" : "s", format_cpu_list(single_cpus))});
  }
  return out;
}

std::vector<reports::Warning> network_warnings(const std::vector<reports::RankInfo>& ranks,
                                               const std::vector<std::string>& machines) {
  std::vector<reports::Warning> out;
  auto machine_of = [&](std::size_t i) -> const std::string& {
    return i < machines.size() && !machines[i].empty() ? machines[i] : ranks[i].host;
  };
  std::set<std::string> distinct;
  for (std::size_t i = 0; i < ranks.size(); ++i) distinct.insert(machine_of(i));
  if (distinct.size() < 2) return out;  // the traffic stays on the one machine

  // slower_interface: per (machine, used interface, faster one), the ranks.
  struct Slow {
    std::string machine, used, faster;
    int used_mbps = -1, faster_mbps = -1;
    std::vector<int> ranks;
  };
  std::vector<Slow> slow;
  // The faster interface matters only if the other hosts are on its network:
  // one of their addresses lies in one of its networks (a storage network
  // of this host alone is no place for Gloo's traffic).
  // Addresses per machine, once (ranks of a machine share them), and the
  // answer per machine and network list: thousands of ranks stay cheap.
  std::map<std::string, std::set<std::string>> addresses_of;
  for (std::size_t k = 0; k < ranks.size(); ++k)
    addresses_of[machine_of(k)].insert(ranks[k].host_addresses.begin(), ranks[k].host_addresses.end());
  std::map<std::pair<std::string, std::vector<std::string>>, bool> known;
  const auto peers_on = [&](std::size_t i, const std::vector<std::string>& networks) {
    const auto key = std::make_pair(machine_of(i), networks);
    if (auto it = known.find(key); it != known.end()) return it->second;
    bool on = false;
    for (const auto& [machine, addresses] : addresses_of) {
      if (machine == machine_of(i)) continue;
      for (const auto& a : addresses)
        for (const auto& n : networks) on = on || in_network(a, n);
      if (on) break;
    }
    known.emplace(key, on);
    return on;
  };
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    if (r.net_interface.empty() || r.faster_interface.empty() || r.net_speed_mbps <= 0 ||
        r.faster_speed_mbps <= r.net_speed_mbps || !peers_on(i, r.faster_networks))
      continue;
    auto it = std::find_if(slow.begin(), slow.end(), [&](const Slow& s) {
      return s.machine == machine_of(i) && s.used == r.net_interface && s.faster == r.faster_interface;
    });
    if (it == slow.end())
      it = slow.insert(slow.end(), {machine_of(i), r.net_interface, r.faster_interface,
                                    r.net_speed_mbps, r.faster_speed_mbps, {}});
    it->ranks.push_back(r.rank);
  }
  if (!slow.empty()) {
    std::string where;
    for (std::size_t k = 0; k < slow.size() && k < 4; ++k)
      where += fmt::format("{}{} on {} send{} over {} ({}), but {} on that host runs at {}", k ? "; " : "",
                           rank_list(slow[k].ranks), host_of(slow[k].machine),
                           slow[k].ranks.size() == 1 ? "s" : "", slow[k].used,
                           format_link_speed(slow[k].used_mbps), slow[k].faster,
                           format_link_speed(slow[k].faster_mbps));
    if (slow.size() > 4) where += fmt::format("; and {} more host(s)", slow.size() - 4);
    out.push_back({"slower_interface",
                   fmt::format("Gloo traffic goes over a slower interface than the host has, on "
                               "a network the other hosts are on too: {}. Gloo uses the interface "
                               "GLOO_SOCKET_IFNAME (or --gloo-interface) names, else the one "
                               "holding the address of the host's name; set GLOO_SOCKET_IFNAME={} "
                               "(or --gloo-interface {}) on those ranks, as for torch's Gloo backend",
                               where, slow.front().faster, slow.front().faster)});
  }

  // egress_interface: per (machine, listening interface, egress interface),
  // the ranks and the peers their traffic leaves for by it.
  struct Out {
    std::string machine, used, egress, gateway;
    int used_mbps = -1, egress_mbps = -1;
    std::vector<int> ranks;
    std::set<int> peers;
  };
  std::vector<Out> outs;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    for (const auto& e : ranks[i].egress) {
      auto it = std::find_if(outs.begin(), outs.end(), [&](const Out& o) {
        return o.machine == machine_of(i) && o.used == ranks[i].net_interface && o.egress == e.interface;
      });
      if (it == outs.end())
        it = outs.insert(outs.end(), {machine_of(i), ranks[i].net_interface, e.interface, e.gateway,
                                      ranks[i].net_speed_mbps, e.speed_mbps, {}, {}});
      it->ranks.push_back(ranks[i].rank);
      it->peers.insert(e.peers.begin(), e.peers.end());
    }
  if (!outs.empty()) {
    const auto speed = [](int mbps) { return mbps > 0 ? " (" + format_link_speed(mbps) + ")" : std::string(); };
    std::string where;
    for (std::size_t k = 0; k < outs.size() && k < 4; ++k) {
      const auto& o = outs[k];
      where += fmt::format("{}{} on {} listen{} on {}{}, but this host routes {} traffic to {} out by {}{}{}",
                           k ? "; " : "", rank_list(o.ranks), host_of(o.machine),
                           o.ranks.size() == 1 ? "s" : "", o.used, speed(o.used_mbps),
                           o.ranks.size() == 1 ? "its" : "their",
                           rank_list(std::vector<int>(o.peers.begin(), o.peers.end())), o.egress,
                           speed(o.egress_mbps), o.gateway.empty() ? "" : " via gateway " + o.gateway);
    }
    if (outs.size() > 4) where += fmt::format("; and {} more", outs.size() - 4);
    out.push_back({"egress_interface",
                   fmt::format("Gloo traffic leaves by another interface than the one Gloo listens "
                               "on: {}. Gloo chooses only the address it listens at; the host's "
                               "routes choose the way out to each peer's address. See them with "
                               "`ip route get <peer's address>` on that host; give the hosts "
                               "addresses on one network and name its interface in "
                               "GLOO_SOCKET_IFNAME (or --gloo-interface), or fix the routes",
                               where)});
  }

  // mixed_link_speeds: the known speed of each machine's interface(s) in use.
  std::map<int, std::set<std::string>> hosts_by_speed;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    if (ranks[i].net_speed_mbps > 0) hosts_by_speed[ranks[i].net_speed_mbps].insert(host_of(machine_of(i)));
  if (hosts_by_speed.size() > 1) {
    std::string speeds;
    for (const auto& [mbps, hosts] : hosts_by_speed) {
      std::string names;
      std::size_t k = 0;
      for (const auto& h : hosts) {
        if (k == 3) {
          names += fmt::format(" and {} more", hosts.size() - 3);
          break;
        }
        names += (k++ ? ", " : "") + h;
      }
      speeds += fmt::format("{}{} ({})", speeds.empty() ? "" : "; ", format_link_speed(mbps), names);
    }
    out.push_back({"mixed_link_speeds",
                   fmt::format("the ranks' network links run at different speeds: {}. A ring "
                               "all_reduce runs at the pace of its slowest link; check the slower "
                               "hosts' link (a port that negotiated a lower speed, another NIC)",
                               speeds)});
  }
  return out;
}

namespace {

// "a on ranks 0-2; b on rank 3", values in order of their first rank.
std::string by_value(const std::vector<std::string>& values) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (std::size_t r = 0; r < values.size(); ++r) {
    if (values[r].empty()) continue;
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == values[r]; });
    if (it == groups.end()) it = groups.insert(groups.end(), {values[r], {}});
    it->second.push_back(static_cast<int>(r));
  }
  if (groups.size() < 2) return {};
  std::string out;
  for (std::size_t i = 0; i < groups.size() && i < 6; ++i)
    out += fmt::format("{}{} on {}", i ? "; " : "", groups[i].first, rank_list(groups[i].second));
  if (groups.size() > 6) out += fmt::format("; and {} more", groups.size() - 6);
  return out;
}

}  // namespace

std::vector<reports::Warning> mismatch_warnings(const std::vector<std::string>& builds,
                                                const std::vector<std::string>& libraries,
                                                const std::string& backend) {
  std::vector<reports::Warning> out;
  if (auto which = by_value(builds); !which.empty())
    out.push_back({"ddpdiag_version_mismatch",
                   fmt::format("the ranks run different ddpdiag builds: {}. Start every rank "
                               "from one build (the same install on every host, or the same "
                               "path on a shared file system)",
                               which)});
  if (auto which = by_value(libraries); !which.empty())
    out.push_back({"library_version_mismatch",
                   fmt::format("the ranks run different {} libraries: {}. Ranks of one job need "
                               "the same version: mismatched ones fail or hang in init or in a "
                               "collective. Install one version on every host (check "
                               "LD_LIBRARY_PATH and the environment each host's ranks start in)",
                               backend, which)});
  return out;
}

}  // namespace ddpdiag
