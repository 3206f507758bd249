#include "diag/bisect_plan.h"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <fmt/core.h>

namespace ddpdiag::cli {

namespace {

std::string ranks_label(const std::vector<int>& ranks) {
  // "rank 3", "ranks 0-3", "ranks 0,2,5"
  if (ranks.empty()) return "no rank";
  if (ranks.size() == 1) return fmt::format("rank {}", ranks[0]);
  bool contiguous = true;
  for (std::size_t i = 1; i < ranks.size(); ++i) contiguous &= ranks[i] == ranks[i - 1] + 1;
  if (contiguous) return fmt::format("ranks {}-{}", ranks.front(), ranks.back());
  std::string s = "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

}  // namespace

std::vector<BisectGroup> plan_bisect(const std::vector<std::string>& host_of_rank,
                                     std::size_t max_groups) {
  const int n = static_cast<int>(host_of_rank.size());
  // Units: hosts in order of first appearance, or ranks when there is one host.
  std::vector<std::string> hosts;
  std::map<std::string, std::vector<int>> by_host;
  for (int r = 0; r < n; ++r) {
    if (!by_host.count(host_of_rank[r])) hosts.push_back(host_of_rank[r]);
    by_host[host_of_rank[r]].push_back(r);
  }
  struct Unit {
    std::string name;
    std::vector<int> ranks;
  };
  std::vector<Unit> units;
  const bool per_host = hosts.size() > 1;
  if (per_host)
    for (const auto& h : hosts) units.push_back({h, by_host[h]});
  else
    for (int r = 0; r < n; ++r) units.push_back({std::to_string(r), {r}});

  std::vector<BisectGroup> out;
  std::set<std::vector<int>> seen;
  auto add = [&](const std::string& kind, const std::string& label, std::vector<int> ranks) {
    std::sort(ranks.begin(), ranks.end());
    if (ranks.empty() || static_cast<int>(ranks.size()) >= n) return;
    if (!seen.insert(ranks).second) return;
    out.push_back({kind, label, std::move(ranks)});
  };
  for (const auto& u : units)
    add(per_host ? "host" : "rank", per_host ? "host " + u.name : "rank " + u.name, u.ranks);
  // Pairs: every pair while that stays small, else neighbours (and the wrap).
  const std::size_t k = units.size();
  auto pair = [&](std::size_t a, std::size_t b) {
    std::vector<int> r = units[a].ranks;
    r.insert(r.end(), units[b].ranks.begin(), units[b].ranks.end());
    add("pair", per_host ? "hosts " + units[a].name + "+" + units[b].name
                         : "ranks " + units[a].name + "+" + units[b].name,
        r);
  };
  if (k <= 6) {
    for (std::size_t a = 0; a < k; ++a)
      for (std::size_t b = a + 1; b < k; ++b) pair(a, b);
  } else {
    for (std::size_t a = 0; a < k; ++a) pair(a, (a + 1) % k);
  }
  // Halves of the unit list, then quarters when there are many units.
  for (std::size_t parts : {2u, 4u}) {
    if (k < 2 * parts && parts > 2) break;
    for (std::size_t p = 0; p < parts; ++p) {
      std::size_t lo = k * p / parts, hi = k * (p + 1) / parts;
      std::vector<int> r;
      for (std::size_t u = lo; u < hi; ++u)
        r.insert(r.end(), units[u].ranks.begin(), units[u].ranks.end());
      if (r.empty()) continue;
      std::vector<int> sorted = r;
      std::sort(sorted.begin(), sorted.end());
      add("half", (parts == 2 ? "half: " : "quarter: ") + ranks_label(sorted), r);
    }
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const auto& a, const auto& b) { return a.ranks.size() < b.ranks.size(); });
  if (out.size() > max_groups) out.resize(max_groups);
  return out;
}

BisectVerdict judge_bisect(std::vector<GroupOutcome>& outcomes,
                           const std::vector<std::string>& host_of_rank, double slow_factor,
                           double min_slow_us, bool world_passed) {
  // A group is judged against the groups of its own sort (on one host, or
  // across hosts: a loopback or shared-memory link is not a slow network)
  // of its size or larger: a larger group does at least as much work per
  // all_reduce, so being far slower than one is slow. Larger groups count
  // too because with unequal ranks per host a host's groups may have no
  // other group of their size to be judged against (hosts of 2, 2 and 1
  // ranks: the pairs with the third host hold 3 ranks, the other pair 4);
  // and smaller ones, scaled, for the host with more ranks (below).
  const auto spans_hosts = [&](const BisectGroup& g) {
    for (int r : g.ranks)
      if (r < 0 || static_cast<std::size_t>(r) >= host_of_rank.size() ||
          host_of_rank[static_cast<std::size_t>(r)] != host_of_rank[static_cast<std::size_t>(g.ranks.front())])
        return true;
    return false;
  };
  for (auto& o : outcomes) {
    o.slow = false;
    // A group of one rank moves nothing over any link: its time says only
    // how the scheduler treated that process (a healthy rank alone on a busy
    // machine once took 1.6 ms against the other's 0.1 ms). Its errors and
    // wrong results still count; its time is not judged.
    if (!o.ran || !o.error.empty() || o.group.ranks.size() < 2) continue;
    std::optional<double> reference;
    const std::size_t mine = o.group.ranks.size();
    for (const auto& other : outcomes) {
      const std::size_t theirs = other.group.ranks.size();
      if (!other.ran || !other.error.empty() || other.time_us <= 0 ||
          spans_hosts(other.group) != spans_hosts(o.group))
        continue;
      // A smaller group counts too, its time scaled by the ring steps the
      // larger one takes more ((p-1)/(q-1): an all_reduce's time grows at
      // most that fast with its ranks). Without it a host of more ranks
      // than the others hides: every group of its size holds it (hosts of
      // 1, 2 and 1 ranks, the middle one slow: both 3-rank pairs are slow
      // alike, and only the 2-rank pair of the others shows the speed).
      double scaled = other.time_us;
      if (theirs < mine) {
        if (theirs < 2) continue;  // one rank moves nothing
        scaled *= static_cast<double>(mine - 1) / static_cast<double>(theirs - 1);
      }
      reference = std::min(reference.value_or(scaled), scaled);
    }
    if (reference && o.time_us > slow_factor * *reference && o.time_us > *reference + min_slow_us) o.slow = true;
  }
  // Slowness shows in every group a slow rank or link is part of. A group
  // judged slow whose ranks all sit together in a larger group that ran
  // fine was caught by a busy moment, not by a fault: not slow.
  // Largest groups first, so that a larger group's own verdict is final
  // before the smaller ones inside it are judged against it.
  std::vector<GroupOutcome*> by_size;
  for (auto& o : outcomes) by_size.push_back(&o);
  std::stable_sort(by_size.begin(), by_size.end(), [](const auto* a, const auto* b) {
    return a->group.ranks.size() > b->group.ranks.size();
  });
  for (GroupOutcome* op : by_size) {
    GroupOutcome& o = *op;
    if (!o.slow) continue;
    std::set<int> mine(o.group.ranks.begin(), o.group.ranks.end());
    for (const auto& h : outcomes) {
      if (!h.ran || h.bad() || h.group.ranks.size() <= mine.size()) continue;
      std::set<int> theirs(h.group.ranks.begin(), h.group.ranks.end());
      if (std::includes(theirs.begin(), theirs.end(), mine.begin(), mine.end())) {
        o.slow = false;
        break;
      }
    }
  }
  // Wrong results and errors outrank slowness: when any group failed
  // outright, only those groups are judged, so a group that merely looked
  // slow (a noisy timing) cannot pull the suspects away from the broken one.
  bool any_hard = false;
  for (const auto& o : outcomes)
    if (o.ran && o.failed()) any_hard = true;
  auto counts_as_bad = [&](const GroupOutcome& o) {
    return any_hard ? o.failed() : o.bad();
  };
  BisectVerdict v;
  std::set<int> in_good;
  std::optional<std::set<int>> in_every_bad;
  for (const auto& o : outcomes) {
    if (!o.ran) continue;
    std::set<int> members(o.group.ranks.begin(), o.group.ranks.end());
    if (!counts_as_bad(o)) {
      in_good.insert(members.begin(), members.end());
      continue;
    }
    if (!v.smallest_failing || o.group.ranks.size() < v.smallest_failing->ranks.size())
      v.smallest_failing = o.group;
    if (!in_every_bad) {
      in_every_bad = members;
    } else {
      std::set<int> both;
      std::set_intersection(in_every_bad->begin(), in_every_bad->end(), members.begin(),
                            members.end(), std::inserter(both, both.begin()));
      in_every_bad = both;
    }
  }
  if (!in_every_bad) {
    v.summary = world_passed
                    ? "the full world passed and so did every sub-group: bisect found nothing to localise"
                    : "every sub-group passed: no single rank or host is at fault (the failure needs "
                      "the whole world, e.g. a limit that only the full size reaches)";
    return v;
  }
  std::vector<int> suspects;
  for (int r : *in_every_bad)
    if (!in_good.count(r)) suspects.push_back(r);
  if (suspects.empty()) suspects.assign(in_every_bad->begin(), in_every_bad->end());
  v.suspect_ranks = suspects;
  for (int r : suspects) {
    const std::string& h = r < static_cast<int>(host_of_rank.size()) ? host_of_rank[r] : "";
    if (!h.empty() && std::find(v.suspect_hosts.begin(), v.suspect_hosts.end(), h) ==
                          v.suspect_hosts.end())
      v.suspect_hosts.push_back(h);
  }
  std::string who;
  for (std::size_t i = 0; i < suspects.size(); ++i)
    who += (i ? ", " : "") + std::to_string(suspects[i]);
  std::string hosts;
  for (std::size_t i = 0; i < v.suspect_hosts.size(); ++i)
    hosts += (i ? ", " : "") + v.suspect_hosts[i];
  if (suspects.empty())
    v.summary = fmt::format("the smallest failing set is {}, but no single rank stands out",
                            v.smallest_failing->label);
  else
    v.summary = fmt::format("smallest failing set: {} ({}); it points to {} {} on host{} {}",
                            v.smallest_failing->label, ranks_label(v.smallest_failing->ranks),
                            suspects.size() == 1 ? "rank" : "ranks", who,
                            v.suspect_hosts.size() == 1 ? "" : "s", hosts);
  return v;
}

nlohmann::json BisectVerdict::to_json(const std::vector<GroupOutcome>& outcomes) const {
  nlohmann::json groups = nlohmann::json::array();
  for (const auto& o : outcomes)
    groups.push_back({{"kind", o.group.kind},
                      {"label", o.group.label},
                      {"ranks", o.group.ranks},
                      {"ran", o.ran},
                      {"error", o.error.empty() ? nlohmann::json() : nlohmann::json(o.error)},
                      {"wrong", o.wrong},
                      {"time_us", o.time_us},
                      {"slow", o.slow},
                      {"verdict", !o.ran ? "skip" : o.bad() ? "fail" : "pass"}});
  nlohmann::json smallest = nullptr;
  if (smallest_failing)
    smallest = {{"label", smallest_failing->label}, {"ranks", smallest_failing->ranks}};
  return {{"groups", groups},
          {"smallest_failing_set", smallest},
          {"suspect_ranks", suspect_ranks},
          {"suspect_hosts", suspect_hosts},
          {"summary", summary}};
}

}  // namespace ddpdiag::cli
