#include "diag/tools_analysis.h"

#include <sys/wait.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <tuple>

#include <fmt/core.h>
#include <fmt/format.h>

#include "comm/net_info.h"

namespace ddpdiag::cli::tools {

std::optional<int> rank_that_failed_first(const std::vector<std::pair<int, int>>& failures) {
  for (const auto& [rank, status] : failures)
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 1)) return rank;
  return std::nullopt;
}

namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace

std::vector<std::vector<std::pair<int, int>>> round_robin_schedule(int n) {
  std::vector<std::vector<std::pair<int, int>>> rounds;
  if (n < 2) return rounds;
  // Circle method: m players (a dummy one when n is odd, whose partner sits
  // out); player m-1 stays put, the others rotate one place per round.
  const int m = n % 2 ? n + 1 : n;
  const int ring = m - 1;
  for (int r = 0; r < ring; ++r) {
    std::vector<std::pair<int, int>> round;
    auto add = [&](int a, int b) {
      if (a >= n || b >= n) return;  // the dummy: a bye
      round.emplace_back(std::min(a, b), std::max(a, b));
    };
    add(m - 1, r);
    for (int k = 1; k < m / 2; ++k) add((r + k) % ring, ((r - k) % ring + ring) % ring);
    std::sort(round.begin(), round.end());
    rounds.push_back(std::move(round));
  }
  return rounds;
}

std::vector<PairJudgement> judge_pairs(const std::vector<PairMeasurement>& pairs,
                                       const LinkThresholds& t) {
  std::map<bool, std::vector<double>> bw, lat;
  for (const auto& p : pairs) {
    bw[p.same_host].push_back(p.bandwidth_gbps);
    lat[p.same_host].push_back(p.latency_us);
  }
  std::map<bool, double> bw_med, lat_med;
  for (auto& [k, v] : bw) bw_med[k] = median_of(v);
  for (auto& [k, v] : lat) lat_med[k] = median_of(v);

  std::vector<PairJudgement> out;
  for (const auto& p : pairs) {
    PairJudgement j;
    j.kind_median_bandwidth_gbps = bw_med[p.same_host];
    j.kind_median_latency_us = lat_med[p.same_host];
    j.kind_pairs = bw[p.same_host].size();
    std::vector<std::string> why;
    const char* kind = p.same_host ? "same-host" : "cross-host";
    const double bw_limit = j.kind_median_bandwidth_gbps * (1 - t.bandwidth_below_median_pct / 100);
    if (j.kind_pairs > 1 && p.bandwidth_gbps < bw_limit) {
      j.slow_bandwidth = true;
      why.push_back(fmt::format("bandwidth {:.4g} GB/s is {:.0f}% below the median {:.4g} GB/s of "
                                "{} {} pairs",
                                p.bandwidth_gbps,
                                100 * (1 - p.bandwidth_gbps / j.kind_median_bandwidth_gbps),
                                j.kind_median_bandwidth_gbps, j.kind_pairs, kind));
    }
    if (t.min_bandwidth_gbps > 0 && p.bandwidth_gbps < t.min_bandwidth_gbps) {
      j.slow_bandwidth = true;
      why.push_back(fmt::format("bandwidth {:.4g} GB/s is under the minimum {:.4g} GB/s",
                                p.bandwidth_gbps, t.min_bandwidth_gbps));
    }
    if (t.min_link_pct > 0 && !p.same_host && p.link_speed_mbps > 0) {
      const double link_gbps = link_gbytes_per_s(p.link_speed_mbps);
      if (p.bandwidth_gbps < link_gbps * t.min_link_pct / 100) {
        j.slow_bandwidth = true;
        const double share = 100 * p.bandwidth_gbps / link_gbps;
        why.push_back(fmt::format("bandwidth {:.4g} GB/s is {:.{}f}% of its {} link ({:.4g} GB/s), under "
                                  "{:g}%",
                                  p.bandwidth_gbps, share, share < 10 ? 1 : 0,
                                  format_link_speed(p.link_speed_mbps), link_gbps, t.min_link_pct));
      }
    }
    const double lat_limit = j.kind_median_latency_us * (1 + t.latency_above_median_pct / 100);
    if (j.kind_pairs > 1 && p.latency_us > lat_limit &&
        p.latency_us - j.kind_median_latency_us > t.latency_floor_us) {
      j.slow_latency = true;
      why.push_back(fmt::format("latency {:.1f} us is {:.0f}% above the median {:.1f} us of {} {} "
                                "pairs",
                                p.latency_us, 100 * (p.latency_us / j.kind_median_latency_us - 1),
                                j.kind_median_latency_us, j.kind_pairs, kind));
    }
    if (t.max_latency_us > 0 && p.latency_us > t.max_latency_us) {
      j.slow_latency = true;
      why.push_back(fmt::format("latency {:.1f} us is over the maximum {:.1f} us", p.latency_us,
                                t.max_latency_us));
    }
    for (std::size_t i = 0; i < why.size(); ++i) j.reason += (i ? "; " : "") + why[i];
    out.push_back(std::move(j));
  }

  // A rank whose every link is slow makes most pairs slow when there are few
  // hosts (one slow host of three: two of the three pairs), and then the
  // median is the slow value. So also: a rank whose best pair of a kind is
  // below the threshold against the median of the pairs of that kind
  // without it has a slow link itself; all its pairs of that kind are slow.
  // The same for a host of two or more ranks: its ranks' cross-host pairs
  // with each other's peers keep one another in "the pairs without it", so
  // a slow host of two ranks among three hosts hides from the rank rule.
  // Judged by host, the pairs without it are those of the other hosts.
  auto mark_if_slow = [&](auto touches, bool kind, const std::string& who) {
    double best = -1;
    std::vector<double> without;
    for (const auto& p : pairs) {
      if (p.same_host != kind) continue;
      if (touches(p))
        best = std::max(best, p.bandwidth_gbps);
      else
        without.push_back(p.bandwidth_gbps);
    }
    if (best < 0 || without.empty()) return;
    const double others = median_of(without);
    if (best >= others * (1 - t.bandwidth_below_median_pct / 100)) return;
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto& p = pairs[i];
      if (p.same_host != kind || !touches(p)) continue;
      auto& j = out[i];
      j.slow_bandwidth = true;
      j.reason += fmt::format("{}every {} link of {} is slow: its best, {:.4g} GB/s, is {:.0f}% "
                              "below the median {:.4g} GB/s of the {} pair(s) without it",
                              j.reason.empty() ? "" : "; ", kind ? "same-host" : "cross-host", who,
                              best, 100 * (1 - best / others), others, without.size());
    }
  };
  std::map<int, bool> ranks;
  std::map<std::string, std::vector<int>> host_ranks;
  for (const auto& p : pairs) ranks[p.a] = ranks[p.b] = true;
  for (const auto& p : pairs)
    for (const auto& [r, h] : {std::pair{p.a, &p.host_a}, std::pair{p.b, &p.host_b}}) {
      if (h->empty()) continue;
      auto& v = host_ranks[*h];
      if (std::find(v.begin(), v.end(), r) == v.end()) v.push_back(r);
    }
  for (const auto& [r, _] : ranks)
    for (const bool kind : {true, false})
      mark_if_slow([r = r](const PairMeasurement& p) { return p.a == r || p.b == r; }, kind,
                   fmt::format("rank {}", r));
  for (auto& [h, rs] : host_ranks) {
    if (rs.size() < 2) continue;  // the rank rule has judged it
    std::sort(rs.begin(), rs.end());
    mark_if_slow([&h = h](const PairMeasurement& p) { return p.host_a == h || p.host_b == h; }, false,
                 fmt::format("host {} (ranks {})", h, fmt::join(rs, ", ")));
  }
  return out;
}

std::string classify_transport(std::string_view via) {
  auto starts = [&](std::string_view p) { return via.substr(0, p.size()) == p; };
  if (starts("P2P")) return "P2P";
  if (starts("SHM")) return "SHM";
  if (starts("NET/")) {
    const auto second = via.find('/', 4);
    return std::string(via.substr(0, second));
  }
  if (starts("NVLS")) return "NVLS";
  if (starts("CollNet")) return "CollNet";
  return std::string(via);
}

namespace {
// Calls f(line) for each line of text, without its '\n'.
template <typename F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    f(text.substr(pos, eol - pos));
    pos = eol + 1;
  }
}
}  // namespace

std::vector<std::string> select_nccl_log_lines(std::string_view log, std::size_t tail) {
  static constexpr std::string_view kKey[] = {
      " NCCL WARN ",     "NCCL version ",   "Bootstrap: Using", "Bootstrap : Using",
      "NET/Socket : Using", "NET/IB : Using", "Using network ",   "NCCL_SOCKET_IFNAME",
      "Init START",      "Init COMPLETE",   "set by environment to"};
  std::vector<std::string_view> lines;
  for_each_line(log, [&](std::string_view line) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.remove_suffix(1);
    if (!line.empty()) lines.push_back(line);  // a WARN starts with an empty line
  });
  const std::size_t from = lines.size() > tail ? lines.size() - tail : 0;
  std::vector<std::string> out;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    bool keep = i >= from;
    for (std::string_view k : kKey) keep = keep || lines[i].find(k) != std::string_view::npos;
    if (keep) out.emplace_back(lines[i]);
  }
  return out;
}

std::vector<TransportLine> parse_nccl_transports(std::string_view log) {
  std::vector<TransportLine> out;
  for_each_line(log, [&](std::string_view line) {
    const auto arrow = line.find(" -> ");
    const auto via = line.find(" via ");
    if (arrow == std::string_view::npos || via == std::string_view::npos || via < arrow) return;
    if (line.find("Channel") == std::string_view::npos) return;
    // "<src>[<dev>] -> <dst>[<dev>]": the number just before the bracket on
    // the left, the first number on the right.
    std::size_t lb = line.rfind('[', arrow);
    std::size_t colon = line.rfind(':', arrow);
    if (lb == std::string_view::npos || colon == std::string_view::npos || lb < colon) return;
    std::string_view left = line.substr(colon + 1, lb - colon - 1);
    while (!left.empty() && left.front() == ' ') left.remove_prefix(1);
    std::string_view right = line.substr(arrow + 4);
    auto number = [](std::string_view s, int& v) {
      std::size_t i = 0;
      v = 0;
      while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) v = v * 10 + (s[i++] - '0');
      return i > 0;
    };
    TransportLine t;
    if (!number(left, t.src) || !number(right, t.dst)) return;
    std::string_view word = line.substr(via + 5);
    const auto end = word.find_first_of(" \t\r");
    t.via = std::string(word.substr(0, end));
    if (t.via.empty()) return;
    t.transport = classify_transport(t.via);
    out.push_back(std::move(t));
  });
  return out;
}

std::optional<CapRecommendation> recommend_cap(const std::vector<CapFigure>& caps,
                                               double default_cap_mb) {
  if (caps.empty()) return std::nullopt;
  const CapFigure* best = &caps.front();
  const CapFigure* dflt = nullptr;
  auto is_default = [&](const CapFigure& c) { return c.cap_list.empty() && c.bucket_cap_mb == default_cap_mb; };
  // Least exposed time, then the default, then plain caps, then the smaller.
  auto order = [&](const CapFigure& c) {
    return std::make_tuple(c.exposed_comm_time_us, !is_default(c), !c.cap_list.empty(), c.bucket_cap_mb);
  };
  for (const auto& c : caps) {
    if (is_default(c)) dflt = &c;
    if (order(c) < order(*best)) best = &c;
  }
  CapRecommendation r;
  r.bucket_cap_mb = best->bucket_cap_mb;
  r.cap_list = best->cap_list;
  r.exposed_comm_time_us = best->exposed_comm_time_us;
  if (dflt) {
    r.default_exposed_comm_time_us = dflt->exposed_comm_time_us;
    r.saving_us = dflt->exposed_comm_time_us - best->exposed_comm_time_us;
    r.saving_pct = dflt->exposed_comm_time_us > 0
                       ? 100 * *r.saving_us / dflt->exposed_comm_time_us
                       : 0.0;
  }
  return r;
}

nlohmann::json recommendation_json(const CapRecommendation& rec, double default_cap_mb) {
  auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(); };
  nlohmann::json out = {{"bucket_cap_mb", rec.bucket_cap_mb},
          {"exposed_comm_time_us", rec.exposed_comm_time_us},
          {"default_bucket_cap_mb", default_cap_mb},
          {"default_exposed_comm_time_us", opt(rec.default_exposed_comm_time_us)},
          {"saving_us", opt(rec.saving_us)},
          {"saving_pct", opt(rec.saving_pct)}};
  // A list: bucket_cap_mb is its largest, as DDP sets it.
  if (!rec.cap_list.empty()) out["bucket_cap_mb_list"] = rec.cap_list;
  return out;
}

std::string recommended_setting(const CapRecommendation& rec) {
  if (rec.cap_list.empty()) return fmt::format("bucket_cap_mb={:g}", rec.bucket_cap_mb);
  std::string s;
  for (double c : rec.cap_list) s += fmt::format("{}{:g}", s.empty() ? "" : ", ", c);
  return "bucket_cap_mb_list=[" + s + "]";
}

std::string in_place_no_work_warning(int world_size, std::string_view backend, bool in_place,
                                     const std::vector<std::string>& ops,
                                     const std::vector<std::string>& dtypes) {
  if (world_size != 1 || backend != "nccl" || !in_place) return "";
  const bool integer = std::any_of(dtypes.begin(), dtypes.end(), [](const std::string& d) {
    return d.rfind("int", 0) == 0 || d.rfind("uint", 0) == 0;
  });
  std::string idle;
  for (const auto& op : ops)
    if (op != "avg")
      idle += (idle.empty() ? "" : ", ") + op;
    else if (integer)
      idle += (idle.empty() ? "" : ", ") + std::string("avg of integer types");
  if (idle.empty()) return "";
  return fmt::format(
      "at world size 1 NCCL does no work for an in-place all_reduce ({}): its in-place times "
      "are launch overhead only and its in-place algbw is no bandwidth. Out of place NCCL copies "
      "the buffer (a device-to-device copy), and busbw is 0 at one rank (2(n-1)/n); to measure "
      "all_reduce bandwidth run 2 or more ranks, or pass --no-in-place to leave that block out",
      idle);
}

double median_of_others(const std::vector<double>& per_rank, std::size_t rank) {
  std::vector<double> others;
  for (std::size_t r = 0; r < per_rank.size(); ++r)
    if (r != rank) others.push_back(per_rank[r]);
  return median_of(std::move(others));
}

std::vector<int> ranks_above_median(const std::vector<double>& per_rank, double pct) {
  std::vector<int> out;
  if (per_rank.size() < 2) return out;
  for (std::size_t r = 0; r < per_rank.size(); ++r)
    if (per_rank[r] > median_of_others(per_rank, r) * (1 + pct / 100)) out.push_back(static_cast<int>(r));
  return out;
}

}  // namespace ddpdiag::cli::tools
