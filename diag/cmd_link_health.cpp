// ddpdiag link-health: the per-pair view that finds the bad link. Every pair
// of ranks measures a ping-pong latency and a bidirectional send/recv
// bandwidth; pairs run in the rounds of a round-robin tournament, so each
// rank is in one pair at a time and all pairs of a round run together. The
// n x n matrices, each rank's all_reduce time, outliers against the median of
// pairs of the same kind (same host or cross host), on NCCL the transport
// each pair uses (from NCCL's own INFO log), and a PASS/FAIL verdict naming
// the slow pairs. The pairs found slow are measured again (--rechecks, 2 by
// default, in rounds of disjoint pairs) and each pair keeps its best figures
// before the verdict: a stall of a shared machine makes a healthy link look
// slow once, a slow link stays slow.
//
// Data. Every pair's payloads are checked, after the timed loops: each rank
// sends a pattern of its own (a hash of its rank, the pair's round and the
// byte's offset) and compares every byte of the last exchange and ping it
// received with the peer's pattern; then one all_reduce of inputs whose sum
// is exact is compared bit for bit. Wrong data fails the data_correct check
// on every rank, naming the rank that received it, the peer, the first
// wrong byte and the count.
//
// NCCL transports. NCCL reads NCCL_DEBUG once per process, at its first
// call, so the log cannot be switched on once the job's communicator exists.
// Before the job starts (before the built-in launcher forks the ranks, and
// again in each rank, which inherits it), when the backend may be NCCL and
// the user has not set NCCL_DEBUG, this command sets NCCL_DEBUG=INFO,
// NCCL_DEBUG_SUBSYS=INIT,P2P (where the "Channel .. : a[..] -> b[..] via X"
// lines are logged) and NCCL_DEBUG_FILE=$TMPDIR/ddpdiag-nccl-<pid>.%h.%p (one
// file per process, %h host, %p pid, expanded by NCCL). After the
// measurements each rank reads its own file (the pattern expanded the way
// NCCL does) and keeps the lines about its own pairs. The variables appear in
// the report's environment. --no-nccl-transport leaves NCCL_DEBUG alone. A
// user's own NCCL_DEBUG_FILE is read the same way; a user's NCCL_DEBUG
// without a file goes to stdout, and the transport is then reported unknown.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <fmt/format.h>

#include "comm/measure.h"
#include "comm/net_info.h"
#include "comm/splitmix64.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/tools_analysis.h"
#include "diag/tools_common.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

struct LinkHealthOptions {
  CommonOptions common;
  std::string bandwidth_bytes = "4M";
  int iters = 5;
  int warmup = 1;
  int latency_iters = 20;
  std::string allreduce_bytes = "1M";
  int allreduce_iters = 10;
  int rechecks = 2;
  tools::LinkThresholds thresholds;
  bool no_nccl_transport = false;
};

constexpr std::uint32_t kLatencyTag = 0x11e40000;
constexpr std::uint32_t kBandwidthTag = 0x11e50000;

// Bytes of a payload that differ from what the peer sent.
struct WrongBytes {
  std::int64_t count = 0;
  std::int64_t first = -1;  // offset of the first, -1 when none
};

// Byte i of what `sender` sends in tag round `round`: byte i mod 8 of a
// splitmix64 hash of (sender, round, i / 8), so no two senders, rounds or
// offsets share a pattern (a stale round, a swapped peer or a shifted block
// reads wrong). `check` compares `p` with it instead of writing it.
WrongBytes sender_pattern(std::uint8_t* p, std::size_t bytes, int sender, std::uint32_t round,
                          bool check) {
  const std::uint64_t seed = splitmix64_mix((static_cast<std::uint64_t>(round) << 32) |
                                            static_cast<std::uint32_t>(sender));
  WrongBytes w;
  for (std::size_t i = 0; i < bytes; i += 8) {
    const std::uint64_t v = splitmix64_mix(seed + (i / 8 + 1) * kSplitmix64Gamma);
    for (std::size_t k = 0; k < 8 && i + k < bytes; ++k) {
      const auto b = static_cast<std::uint8_t>(v >> (8 * k));
      if (!check) {
        p[i + k] = b;
      } else if (p[i + k] != b) {
        if (w.count++ == 0) w.first = static_cast<std::int64_t>(i + k);
      }
    }
  }
  return w;
}

// One rank's side of one pair.
struct SideResult {
  int peer = 0;
  double latency_us = 0;         // half the median ping-pong round trip
  double bandwidth_time_us = 0;  // median per exchange, both directions in flight
  WrongBytes exchange_wrong;     // in the last bandwidth exchange received
  WrongBytes ping_wrong;         // in the last ping received
};

SideResult measure_pair(Communicator& comm, int peer, std::size_t bw_bytes, const LinkHealthOptions& o,
                        std::uint32_t round, Millis timeout, CommBuffer& out, CommBuffer& in,
                        CommBuffer& small_out, CommBuffer& small_in, std::vector<std::uint8_t>& host) {
  const int me = comm.rank();
  SideResult s;
  s.peer = peer;
  // This rank's pattern for this round, in both payloads.
  std::uint8_t ping_data[8];
  sender_pattern(host.data(), bw_bytes, me, round, false);
  sender_pattern(ping_data, 8, me, round, false);
  comm.copy_from_host(out.get(), host.data(), bw_bytes);
  comm.copy_from_host(small_out.get(), ping_data, 8);
  // Latency: ping-pong of 8 bytes; the lower rank serves first.
  const bool first = me < peer;
  auto ping = [&] {
    if (first) {
      comm.send(small_out.get(), 8, DType::kUInt8, peer, kLatencyTag + round)->wait(timeout);
      comm.recv(small_in.get(), 8, DType::kUInt8, peer, kLatencyTag + round)->wait(timeout);
    } else {
      comm.recv(small_in.get(), 8, DType::kUInt8, peer, kLatencyTag + round)->wait(timeout);
      comm.send(small_out.get(), 8, DType::kUInt8, peer, kLatencyTag + round)->wait(timeout);
    }
  };
  // Medians of per-iteration times: one scheduler stall on a shared machine
  // must not make a healthy link look slow.
  auto median_us = [](int iters, const std::function<void()>& f) {
    std::vector<double> t;
    for (int i = 0; i < iters; ++i) {
      const auto t0 = Clock::now();
      f();
      t.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    return median(t);
  };
  for (int i = 0; i < 2; ++i) ping();
  s.latency_us = median_us(std::max(1, o.latency_iters), ping) / 2;
  // Bandwidth: both directions at once, bw_bytes each way per iteration.
  auto exchange = [&] {
    comm.sendrecv(out.get(), bw_bytes, peer, in.get(), bw_bytes, peer, DType::kUInt8,
                  kBandwidthTag + round)
        ->wait(timeout);
  };
  for (int i = 0; i < o.warmup; ++i) exchange();
  s.bandwidth_time_us = median_us(std::max(1, o.iters), exchange);
  // The data check, outside the timed loops: every byte received last, from
  // the peer's pattern for this round.
  comm.copy_to_host(host.data(), in.get(), bw_bytes);
  s.exchange_wrong = sender_pattern(host.data(), bw_bytes, peer, round, true);
  comm.copy_to_host(ping_data, small_in.get(), 8);
  s.ping_wrong = sender_pattern(ping_data, 8, peer, round, true);
  return s;
}

// The pairs in rounds where no rank is in two pairs at once (greedy: a
// round takes every pair whose ranks are still free).
std::vector<std::vector<std::pair<int, int>>> disjoint_rounds(std::vector<std::pair<int, int>> pairs,
                                                              int n) {
  std::vector<std::vector<std::pair<int, int>>> rounds;
  while (!pairs.empty()) {
    std::vector<bool> busy(static_cast<std::size_t>(n), false);
    std::vector<std::pair<int, int>> round, rest;
    for (auto [a, b] : pairs) {
      if (busy[a] || busy[b]) {
        rest.emplace_back(a, b);
        continue;
      }
      busy[a] = busy[b] = true;
      round.emplace_back(a, b);
    }
    rounds.push_back(std::move(round));
    pairs = std::move(rest);
  }
  return rounds;
}

// Rank 0's list of int32s, on every rank (its length first, then the list).
std::vector<std::int32_t> broadcast_ints(Communicator& comm, std::vector<std::int32_t> v,
                                         Millis timeout) {
  std::int32_t count = static_cast<std::int32_t>(v.size());
  CommBuffer head(comm, sizeof count);
  comm.copy_from_host(head.get(), &count, sizeof count);
  comm.broadcast(head.get(), 1, DType::kInt32, 0)->wait(timeout);
  comm.copy_to_host(&count, head.get(), sizeof count);
  v.resize(static_cast<std::size_t>(count));
  if (count == 0) return v;
  CommBuffer body(comm, v.size() * sizeof(std::int32_t));
  comm.copy_from_host(body.get(), v.data(), v.size() * sizeof(std::int32_t));
  comm.broadcast(body.get(), v.size(), DType::kInt32, 0)->wait(timeout);
  comm.copy_to_host(v.data(), body.get(), v.size() * sizeof(std::int32_t));
  return v;
}

std::string short_hostname() {

  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  std::string h(buf);
  return h.substr(0, h.find('.'));
}

// NCCL_DEBUG_FILE expanded as NCCL does: %h the host name up to its first
// dot, %p the pid, %% a percent sign.
std::string expand_nccl_debug_file(const std::string& pattern) {
  std::string out;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '%' && i + 1 < pattern.size()) {
      const char c = pattern[++i];
      if (c == 'h') out += short_hostname();
      else if (c == 'p') out += std::to_string(::getpid());
      else if (c == '%') out += '%';
      else out += std::string("%") + c;
    } else {
      out += pattern[i];
    }
  }
  return out;
}

// Before any NCCL call in this process: switch NCCL's transport log on
// unless the user configured NCCL_DEBUG. Returns what was done, for the
// report.
std::string prepare_nccl_log(const LinkHealthOptions& o) {
  if (o.no_nccl_transport) return "off (--no-nccl-transport)";
  if (o.common.backend == "gloo" || !nccl_supported()) return "not applicable (no NCCL)";
  // auto picks NCCL only where there is a GPU.
  if (o.common.backend == "auto" && cuda_device_count() == 0)
    return "not applicable (no GPU: the backend is Gloo)";
  // A rank started by the built-in launcher inherits what its parent set.
  if (std::getenv("DDPDIAG_NCCL_LOG_BY_LINK_HEALTH")) return "set by ddpdiag link-health";
  if (std::getenv("NCCL_DEBUG")) {
    return std::getenv("NCCL_DEBUG_FILE") ? "the user's NCCL_DEBUG and NCCL_DEBUG_FILE"
                                          : "the user's NCCL_DEBUG without NCCL_DEBUG_FILE";
  }
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = tmp && *tmp ? tmp : "/tmp";
  ::setenv("NCCL_DEBUG", "INFO", 0);
  // The transport ("Channel ... via ...") lines are logged under INIT: a
  // subsystem list of the user's without it gets INIT added (a list that
  // starts with ^ excludes what it names, and is left as it is).
  const char* subsys = std::getenv("NCCL_DEBUG_SUBSYS");
  if (!subsys || !*subsys) {
    ::setenv("NCCL_DEBUG_SUBSYS", "INIT,P2P", 1);
  } else if (subsys[0] != '^') {
    std::istringstream words(subsys);
    bool logs_init = false;
    for (std::string w; std::getline(words, w, ',');) {
      for (char& c : w) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      logs_init = logs_init || w == "INIT" || w == "ALL";
    }
    if (!logs_init) ::setenv("NCCL_DEBUG_SUBSYS", (std::string(subsys) + ",INIT").c_str(), 1);
  }
  ::setenv("NCCL_DEBUG_FILE",
           fmt::format("{}/ddpdiag-nccl-{}.%h.%p", dir, ::getpid()).c_str(), 0);
  ::setenv("DDPDIAG_NCCL_LOG_BY_LINK_HEALTH", "1", 1);
  return "set by ddpdiag link-health";
}

// This rank's NCCL transport per peer, from its own NCCL log.
json nccl_transports(const Job& job, std::string& why_unknown) {
  json per_peer = json::object();
  if (job.backend != Backend::kNccl) {
    why_unknown = "Gloo: every pair uses TCP";
    return per_peer;
  }
  const char* pattern = std::getenv("NCCL_DEBUG_FILE");
  if (!pattern) {
    why_unknown = "NCCL_DEBUG_FILE is not set, so NCCL's log went to stdout";
    return per_peer;
  }
  const std::string path = expand_nccl_debug_file(pattern);
  std::ifstream f(path);
  if (!f) {
    why_unknown = "could not read NCCL's log " + path;
    return per_peer;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  std::map<int, std::set<std::string>> seen;
  for (const auto& t : tools::parse_nccl_transports(ss.str())) {
    if (t.src == job.rank()) seen[t.dst].insert(t.transport);
    if (t.dst == job.rank()) seen[t.src].insert(t.transport);
  }
  for (const auto& [peer, ts] : seen) per_peer[std::to_string(peer)] = std::vector<std::string>(ts.begin(), ts.end());
  if (seen.empty()) {
    const char* level = std::getenv("NCCL_DEBUG");
    const char* subsys = std::getenv("NCCL_DEBUG_SUBSYS");
    why_unknown = fmt::format(
        "no transport line in {} (NCCL logs them at NCCL_DEBUG=INFO with the INIT subsystem; here "
        "NCCL_DEBUG={}, NCCL_DEBUG_SUBSYS={}; a NCCL_DEBUG_FILE without %p is rewritten by each "
        "rank of a host)",
        path, level ? level : "(unset)", subsys ? subsys : "(unset)");
  }
  return per_peer;
}

void run(Job& job, reports::Report& report, const LinkHealthOptions& o, const std::string& nccl_log) {
  const int n = job.size(), me = job.rank();
  if (n < 2)
    throw UsageError(fmt::format("link-health measures the links between pairs of ranks, and this "
                                 "job has {} rank",
                                 n),
                     {"flags", me, -1, "run at least 2 ranks, e.g. --nproc 2"});
  const std::size_t bw_bytes = parse_size(o.bandwidth_bytes);
  const std::size_t ar_bytes = std::max<std::size_t>(4, parse_size(o.allreduce_bytes) / 4 * 4);
  if (bw_bytes == 0)
    throw UsageError("--bytes must be positive", {"flags", me, -1, "e.g. --bytes 4M"});
  Communicator& comm = *job.comm;
  const auto schedule = tools::round_robin_schedule(n);

  auto& res = report.results();
  res["ranks"] = n;
  res["bandwidth_bytes"] = bw_bytes;
  res["iters"] = o.iters;
  res["latency_iters"] = o.latency_iters;
  res["rounds"] = json::array();
  for (const auto& round : schedule) {
    json r = json::array();
    for (auto [a, b] : round) r.push_back({a, b});
    res["rounds"].push_back(r);
  }
  res["thresholds"] = {{"bandwidth_below_median_pct", o.thresholds.bandwidth_below_median_pct},
                       {"latency_above_median_pct", o.thresholds.latency_above_median_pct},
                       {"latency_floor_us", o.thresholds.latency_floor_us},
                       {"min_bandwidth_gbps", o.thresholds.min_bandwidth_gbps},
                       {"max_latency_us", o.thresholds.max_latency_us},
                       {"min_link_pct", o.thresholds.min_link_pct}};
  res["nccl_log"] = nccl_log;

  // Pairs, round by round; a barrier keeps the rounds apart. `host` holds
  // the pattern sent, then the payload received.
  CommBuffer out(comm, bw_bytes), in(comm, bw_bytes), small_out(comm, 8), small_in(comm, 8);
  std::vector<std::uint8_t> host(bw_bytes);
  // This rank's wrong payloads, over every pass: {peer, round, payload,
  // bytes, wrong_bytes, first_wrong_byte}.
  json data_errors = json::array();
  std::int64_t payloads_checked = 0;
  // Rounds of disjoint pairs, each rank measuring its own; a barrier keeps
  // the rounds apart. Each round has tags of its own.
  std::uint32_t next_round = 0;
  auto measure_rounds = [&](const std::vector<std::vector<std::pair<int, int>>>& rounds,
                            const std::string& what) {
    json mine = json::array();
    for (std::size_t r = 0; r < rounds.size(); ++r) {
      const std::uint32_t tag_round = next_round++;
      for (auto [a, b] : rounds[r]) {
        if (a != me && b != me) continue;
        const int peer = a == me ? b : a;
        auto s = measure_pair(comm, peer, bw_bytes, o, tag_round, job.timeout, out, in, small_out,
                              small_in, host);
        mine.push_back({{"peer", s.peer}, {"latency_us", s.latency_us},
                        {"bandwidth_time_us", s.bandwidth_time_us}});
        auto note_wrong = [&](const char* payload, std::size_t bytes, const WrongBytes& w) {
          ++payloads_checked;
          if (w.count > 0)
            data_errors.push_back({{"peer", peer}, {"round", tag_round}, {"payload", payload},
                                   {"bytes", bytes}, {"wrong_bytes", w.count},
                                   {"first_wrong_byte", w.first}});
        };
        note_wrong("exchange", bw_bytes, s.exchange_wrong);
        note_wrong("ping", 8, s.ping_wrong);
      }
      comm.barrier()->wait(job.timeout);
      job.progress_line(fmt::format("[progress] {}round {} of {} done", what, r + 1, rounds.size()));
    }
    return mine;
  };

  // Rank 0 keeps each pair's best figures over the passes: a pair's time per
  // exchange is its slower side's (both directions in flight), its latency
  // the larger of the two sides' estimates; of several passes, the lowest.
  std::vector<std::vector<double>> best_time(n, std::vector<double>(n, -1)),
      best_lat(n, std::vector<double>(n, -1));
  std::vector<std::vector<int>> measured(n, std::vector<int>(n, 0));
  auto absorb = [&](const std::vector<json>& gathered) {
    std::vector<std::vector<double>> t(n, std::vector<double>(n, -1)), l(n, std::vector<double>(n, -1));
    for (int r = 0; r < n; ++r)
      for (const auto& p : gathered[r]) {
        const int peer = p["peer"].get<int>();
        t[r][peer] = p["bandwidth_time_us"].get<double>();
        l[r][peer] = p["latency_us"].get<double>();
      }
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b) {
        if (t[a][b] < 0 || t[b][a] < 0) continue;
        const double pt = std::max(t[a][b], t[b][a]), pl = std::max(l[a][b], l[b][a]);
        if (best_time[a][b] < 0 || pt < best_time[a][b]) best_time[a][b] = pt;
        if (best_lat[a][b] < 0 || pl < best_lat[a][b]) best_lat[a][b] = pl;
        ++measured[a][b];
      }
  };
  auto pair_measurements = [&] {
    std::vector<tools::PairMeasurement> pairs;
    for (int a = 0; a < n; ++a)
      for (int b = a + 1; b < n; ++b) {
        tools::PairMeasurement m;
        m.a = a;
        m.b = b;
        m.same_host = job.ranks.size() == static_cast<std::size_t>(n) ? job.ranks[a].host == job.ranks[b].host : true;
        if (job.ranks.size() == static_cast<std::size_t>(n)) {
          m.host_a = job.ranks[a].host;
          m.host_b = job.ranks[b].host;
        }
        // The links each end's traffic to the other leaves by.
        if (const int to_b = reports::link_speed_to(job.ranks[a], b), to_a = reports::link_speed_to(job.ranks[b], a);
            !m.same_host && to_b > 0 && to_a > 0)
          m.link_speed_mbps = std::min(to_b, to_a);
        const double t = best_time[a][b];
        m.bandwidth_gbps = t > 0 ? static_cast<double>(bw_bytes) / t / 1e3 : 0;
        m.latency_us = best_lat[a][b];
        pairs.push_back(m);
      }
    return pairs;
  };

  // A run that fails part-way: rank 0's checks say so. Its own payloads are
  // all it knows of the data: wrong ones fail the check.
  std::optional<reports::Check> data_known;  // once every rank's data is in
  tools::OnFailure partial([&] {
    if (me != 0) return;
    report.add_check({"links", reports::CheckStatus::kSkip,
                      "the run ended with an error before every pair's figures were gathered"});
    if (data_known) {
      report.add_check(*data_known);
      return;
    }
    report.add_check({"data_correct",
                      data_errors.empty() ? reports::CheckStatus::kSkip : reports::CheckStatus::kFail,
                      fmt::format("the run ended with an error before every rank's data was "
                                  "gathered; rank 0 alone: {} wrong of {} payload(s) it received",
                                  data_errors.size(), payloads_checked)});
  });
  // Every pair once; then, up to --rechecks times, the pairs rank 0 finds
  // slow so far, which every rank learns by a broadcast.
  json mine = measure_rounds(schedule, "");
  int recheck_passes = 0;
  std::set<std::pair<int, int>> rechecked;
  for (int pass = 0;; ++pass) {
    const auto gathered = job.gather_to_root(fmt::format("link-health/pass{}", pass), mine);
    std::vector<std::int32_t> suspects;  // a, b, a, b, ...
    if (me == 0) {
      absorb(gathered);
      if (pass < o.rechecks) {
        const auto pairs = pair_measurements();
        const auto judged = tools::judge_pairs(pairs, o.thresholds);
        for (std::size_t i = 0; i < pairs.size(); ++i)
          if (judged[i].slow()) {
            suspects.push_back(pairs[i].a);
            suspects.push_back(pairs[i].b);
          }
      }
    }
    if (pass >= o.rechecks) break;  // every rank has the same --rechecks
    suspects = broadcast_ints(comm, std::move(suspects), job.timeout);
    if (suspects.empty()) break;
    std::vector<std::pair<int, int>> again;
    for (std::size_t i = 0; i + 1 < suspects.size(); i += 2) {
      again.emplace_back(suspects[i], suspects[i + 1]);
      rechecked.emplace(suspects[i], suspects[i + 1]);
    }
    ++recheck_passes;
    mine = measure_rounds(disjoint_rounds(again, n), fmt::format("recheck {}: ", recheck_passes));
  }

  // Every rank's all_reduce time, as each rank sees it.
  CommBuffer ar(comm, ar_bytes);
  {
    std::vector<std::uint8_t> zeros(ar_bytes, 0);
    comm.copy_from_host(ar.get(), zeros.data(), ar_bytes);
  }
  const std::size_t ar_count = ar_bytes / 4;
  comm.allreduce(ar.get(), ar.get(), ar_count, DType::kFloat32, ReduceOp::kSum)->wait(job.timeout);
  comm.barrier()->wait(job.timeout);
  auto t0 = Clock::now();
  for (int i = 0; i < o.allreduce_iters; ++i)
    comm.allreduce(ar.get(), ar.get(), ar_count, DType::kFloat32, ReduceOp::kSum)->wait(job.timeout);
  const double my_ar_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() /
                          std::max(1, o.allreduce_iters);
  const auto ar_times = allgather_doubles(comm, {my_ar_us}, job.timeout);

  // The all_reduce's data check, after the timed loop: one more, of inputs
  // whose sum is exact in any order, compared bit for bit.
  std::int64_t ar_wrong = 0, ar_first_wrong = -1;
  {
    std::vector<std::uint8_t> got(ar_bytes);
    fill_exact_inputs(DType::kFloat32, ReduceOp::kSum, n, me, got.data(), ar_count);
    comm.copy_from_host(ar.get(), got.data(), ar_bytes);
    comm.allreduce(ar.get(), ar.get(), ar_count, DType::kFloat32, ReduceOp::kSum)->wait(job.timeout);
    comm.copy_to_host(got.data(), ar.get(), ar_bytes);
    ar_wrong = count_wrong_allreduce(DType::kFloat32, ReduceOp::kSum, n, got.data(), ar_count);
    if (ar_wrong > 0) {
      std::vector<std::uint8_t> expected(ar_bytes);
      fill_expected_allreduce(DType::kFloat32, ReduceOp::kSum, n, expected.data(), ar_count);
      for (std::size_t i = 0; i < ar_count && ar_first_wrong < 0; ++i)
        if (std::memcmp(&got[4 * i], &expected[4 * i], 4) != 0) ar_first_wrong = static_cast<std::int64_t>(i);
    }
  }

  // What every rank received wrong, on every rank: each fails the check (and
  // exits 1) with the same detail. Per rank: payloads checked, payloads
  // wrong, bytes wrong, the first wrong payload's peer, whether it was a
  // ping, its first wrong byte; all_reduce elements wrong, the first.
  constexpr std::size_t kData = 8;
  std::vector<double> my_data(kData, -1);
  my_data[0] = static_cast<double>(payloads_checked);
  my_data[1] = static_cast<double>(data_errors.size());
  my_data[2] = 0;
  for (const auto& e : data_errors) my_data[2] += e["wrong_bytes"].get<double>();
  if (!data_errors.empty()) {
    my_data[3] = data_errors[0]["peer"].get<double>();
    my_data[4] = data_errors[0]["payload"] == "ping" ? 1 : 0;
    my_data[5] = data_errors[0]["first_wrong_byte"].get<double>();
  }
  my_data[6] = static_cast<double>(ar_wrong);
  my_data[7] = static_cast<double>(ar_first_wrong);
  const auto data = allgather_doubles(comm, my_data, job.timeout);
  auto data_of = [&](int r, std::size_t k) {
    return static_cast<std::int64_t>(data[static_cast<std::size_t>(r) * kData + k]);
  };
  std::int64_t checked = 0;
  std::vector<std::string> wrong_data;
  for (int r = 0; r < n; ++r) {
    checked += data_of(r, 0);
    if (data_of(r, 1) > 0) {
      const int peer = static_cast<int>(data_of(r, 3));
      const bool ping = data_of(r, 4) > 0;
      wrong_data.push_back(fmt::format(
          "rank {} received {} wrong byte(s) in {} payload(s), the first from rank {} (pair {}-{}) "
          "at byte {} of its {}-byte {}",
          r, data_of(r, 2), data_of(r, 1), peer, std::min(r, peer), std::max(r, peer), data_of(r, 5),
          ping ? std::size_t{8} : bw_bytes, ping ? "ping" : "exchange"));
    }
    if (data_of(r, 6) > 0)
      wrong_data.push_back(fmt::format("rank {}'s all_reduce result had {} of {} element(s) wrong, "
                                       "the first at element {}",
                                       r, data_of(r, 6), ar_count, data_of(r, 7)));
  }
  std::string data_detail;
  if (wrong_data.empty()) {
    data_detail = fmt::format("every byte of {} pair payload(s) as its sender sent it, and every "
                              "rank's all_reduce of {} exact",
                              checked, format_size(ar_bytes));
  } else {
    data_detail = "wrong data: ";
    for (std::size_t i = 0; i < wrong_data.size(); ++i) data_detail += (i ? "; " : "") + wrong_data[i];
  }
  const reports::Check data_check{"data_correct", tools::pass_if(wrong_data.empty()), data_detail};
  data_known = data_check;

  std::string why_unknown;
  json transports = nccl_transports(job, why_unknown);
  auto gathered = job.gather_to_root("link-health/transports",
                                     {{"transports", transports}, {"transport_note", why_unknown},
                                      {"data_errors", data_errors}});
  partial.disarm();
  if (me != 0) {
    report.add_check(data_check);
    return;
  }

  const auto pairs = pair_measurements();
  const auto judged = tools::judge_pairs(pairs, o.thresholds);

  json bw_matrix = json::array(), lat_matrix = json::array();
  for (int a = 0; a < n; ++a) {
    json brow = json::array(), lrow = json::array();
    for (int b = 0; b < n; ++b) {
      if (a == b) {
        brow.push_back(nullptr);
        lrow.push_back(nullptr);
        continue;
      }
      const auto& m = pairs[std::find_if(pairs.begin(), pairs.end(), [&](const auto& p) {
                              return p.a == std::min(a, b) && p.b == std::max(a, b);
                            }) - pairs.begin()];
      brow.push_back(m.bandwidth_gbps);
      lrow.push_back(m.latency_us);
    }
    bw_matrix.push_back(brow);
    lat_matrix.push_back(lrow);
  }
  auto transport_of = [&](int a, int b) -> json {
    const auto& t = gathered[a]["transports"];
    const std::string key = std::to_string(b);
    if (t.contains(key)) return t[key];
    if (job.backend == Backend::kGloo) return json::array({"TCP"});
    return nullptr;
  };
  json pair_rows = json::array(), slow_pairs = json::array();
  std::vector<std::string> slow_names;
  std::map<int, int> slow_count, pair_count;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const auto& m = pairs[i];
    const auto& j = judged[i];
    pair_rows.push_back({{"src", m.a},
                         {"dst", m.b},
                         {"same_host", m.same_host},
                         {"host_src", job.ranks.size() > static_cast<std::size_t>(m.a) ? job.ranks[m.a].host : ""},
                         {"host_dst", job.ranks.size() > static_cast<std::size_t>(m.b) ? job.ranks[m.b].host : ""},
                         {"busbw_gbps", m.bandwidth_gbps},
                         {"latency_us", m.latency_us},
                         {"kind_median_busbw_gbps", j.kind_median_bandwidth_gbps},
                         {"kind_median_latency_us", j.kind_median_latency_us},
                         {"measurements", measured[m.a][m.b]},
                         {"slow", j.slow()},
                         {"slow_bandwidth", j.slow_bandwidth},
                         {"slow_latency", j.slow_latency},
                         {"reason", j.reason},
                         {"transport", transport_of(m.a, m.b)},
                         {"link_speed_mbps", m.link_speed_mbps > 0 ? json(m.link_speed_mbps) : json()},
                         {"link_fraction", m.link_speed_mbps > 0
                                               ? json(m.bandwidth_gbps / link_gbytes_per_s(m.link_speed_mbps))
                                               : json()}});
    ++pair_count[m.a];
    ++pair_count[m.b];
    if (j.slow()) {
      slow_pairs.push_back({m.a, m.b});
      slow_names.push_back(fmt::format("{}-{} ({})", m.a, m.b, j.reason));
      ++slow_count[m.a];
      ++slow_count[m.b];
    }
  }
  // A rank all of whose (two or more) links are slow is the likely culprit.
  std::vector<int> slow_ranks;
  for (int r = 0; r < n; ++r)
    if (pair_count[r] >= 2 && slow_count[r] == pair_count[r]) slow_ranks.push_back(r);
  // Likewise a host of two or more ranks all of whose cross-host links are
  // slow, when there are other hosts' links to tell it from (three hosts or
  // more): its ranks' own same-host pair is fast, so no rank of it is in
  // slow_ranks. A host of one rank is there already.
  std::map<std::string, std::pair<int, int>> host_cross;  // host -> (cross pairs, slow ones)
  std::map<std::string, std::vector<int>> ranks_of_host;
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    const auto& m = pairs[i];
    if (m.same_host || m.host_a.empty() || m.host_b.empty()) continue;
    for (const auto* h : {&m.host_a, &m.host_b}) {
      ++host_cross[*h].first;
      if (judged[i].slow()) ++host_cross[*h].second;
    }
  }
  if (job.ranks.size() == static_cast<std::size_t>(n))
    for (int r = 0; r < n; ++r) ranks_of_host[job.ranks[r].host].push_back(r);
  json slow_hosts = json::array();
  std::vector<std::string> slow_host_names;
  if (host_cross.size() >= 3)
    for (const auto& [h, counts] : host_cross)
      if (ranks_of_host[h].size() >= 2 && counts.first > 0 && counts.second == counts.first) {
        slow_hosts.push_back({{"host", h}, {"ranks", ranks_of_host[h]}});
        slow_host_names.push_back(fmt::format("{} (ranks {})", h, fmt::join(ranks_of_host[h], ", ")));
      }
  json ar_rows = json::array(), all_data_errors = json::array();
  for (int r = 0; r < n; ++r) {
    ar_rows.push_back({{"rank", r},
                       {"allreduce_time_us", ar_times[r]},
                       {"wrong_elements", data_of(r, 6)},
                       {"first_wrong_element", data_of(r, 7) >= 0 ? json(data_of(r, 7)) : json()}});
    for (auto e : gathered[r]["data_errors"]) {
      e["rank"] = r;
      all_data_errors.push_back(e);
    }
  }
  json notes = json::object();
  for (int r = 0; r < n; ++r) {
    const auto& note = gathered[r]["transport_note"];
    if (note.is_string() && !note.get<std::string>().empty()) notes[std::to_string(r)] = note;
  }

  res["busbw_gbps"] = bw_matrix;
  res["latency_us"] = lat_matrix;
  res["pairs"] = pair_rows;
  res["slow_pairs"] = slow_pairs;
  res["slow_ranks"] = slow_ranks;
  res["slow_hosts"] = slow_hosts;
  res["rechecks"] = o.rechecks;
  res["recheck_passes"] = recheck_passes;
  res["rechecked_pairs"] = json::array();
  for (auto [a, b] : rechecked) res["rechecked_pairs"].push_back({a, b});
  res["allreduce_bytes"] = ar_bytes;
  res["allreduce"] = ar_rows;
  res["transport_notes"] = notes;
  res["data_checked_payloads"] = checked;
  res["data_errors"] = all_data_errors;
  res["median_busbw_gbps"] = median([&] {
    std::vector<double> v;
    for (const auto& p : pairs) v.push_back(p.bandwidth_gbps);
    return v;
  }());

  std::string detail;
  if (slow_names.empty()) {
    detail = fmt::format("all {} pair(s) within the thresholds", pairs.size());
    // A kind with a single pair has nothing to be compared with.
    for (const bool kind : {false, true}) {
      const auto k = std::count_if(pairs.begin(), pairs.end(),
                                   [&](const auto& p) { return p.same_host == kind; });
      if (k == 1 && o.thresholds.min_bandwidth_gbps <= 0 && o.thresholds.min_link_pct <= 0)
        detail += fmt::format("; the one {} pair had no other to be compared with: "
                              "--min-link-pct or --min-bw-gbps judge it against a figure",
                              kind ? "same-host" : "cross-host");
    }
    // Two hosts: every cross-host pair crosses the same link, so a slow link
    // makes them slow alike and the medians cannot see it.
    std::set<std::pair<std::string, std::string>> host_pairs;
    std::size_t cross = 0;
    for (const auto& p : pairs)
      if (!p.same_host && !p.host_a.empty() && !p.host_b.empty()) {
        ++cross;
        host_pairs.insert(std::minmax(p.host_a, p.host_b));
      }
    if (cross >= 2 && host_pairs.size() == 1 && o.thresholds.min_bandwidth_gbps <= 0 &&
        o.thresholds.min_link_pct <= 0)
      detail += fmt::format("; the {} cross-host pairs all join the same two hosts ({} and {}), so "
                            "a slow link between them makes every one slow alike and the medians "
                            "cannot tell: --min-link-pct or --min-bw-gbps judge them against a figure",
                            cross, host_pairs.begin()->first, host_pairs.begin()->second);
  } else {
    detail = fmt::format("{} slow pair(s): ", slow_names.size());
    for (std::size_t i = 0; i < slow_names.size(); ++i) detail += (i ? "; " : "") + slow_names[i];
    // Spinning ranks that share CPUs slow whichever pair the scheduler
    // starves: then the figures say more about the machine than the links.
    const bool oversubscribed =
        std::any_of(job.warnings.begin(), job.warnings.end(),
                    [](const reports::Warning& w) { return w.name == "cpu_oversubscribed"; });
    if (oversubscribed)
      detail += "; but these ranks share too few CPUs (warning cpu_oversubscribed), which alone "
                "can make any pair slow: rerun with at most one rank per CPU before blaming a link";
  }
  report.add_check({"links", tools::pass_if(slow_names.empty()), detail});
  if (!slow_ranks.empty()) {
    std::string names;
    for (std::size_t i = 0; i < slow_ranks.size(); ++i) {
      const int r = slow_ranks[i];
      names += (i ? ", " : "") + std::to_string(r);
      if (job.ranks.size() > static_cast<std::size_t>(r) && !job.ranks[r].host.empty())
        names += " (host " + job.ranks[r].host + ")";
    }
    report.add_check({"slow_ranks", reports::CheckStatus::kFail,
                      fmt::format("every link of rank(s) {} is slow", names)});
  }
  if (!slow_host_names.empty())
    report.add_check({"slow_hosts", reports::CheckStatus::kFail,
                      fmt::format("every cross-host link of host(s) {} is slow",
                                  fmt::join(slow_host_names, "; "))});
  report.add_check(data_check);

  // The tables.
  std::printf("# ddpdiag link-health: %d rank(s), backend %s; %zu round(s) of disjoint pairs; "
              "bandwidth: %s each way per exchange, %d iters; latency: 8 B ping-pong, %d iters\n",
              n, std::string(backend_name(job.backend)).c_str(), schedule.size(),
              format_size(bw_bytes).c_str(), o.iters, o.latency_iters);
  if (recheck_passes > 0)
    std::printf("# %zu pair(s) found slow were measured again (%d pass(es)); each pair keeps its "
                "best figures\n",
                rechecked.size(), recheck_passes);
  std::printf("# Bandwidth per direction, both directions at once (GB/s)\n#  %6s", "");
  for (int b = 0; b < n; ++b) std::printf(" %9d", b);
  std::printf("\n");
  for (int a = 0; a < n; ++a) {
    std::printf("   %6d", a);
    for (int b = 0; b < n; ++b)
      a == b ? std::printf(" %9s", "-") : std::printf(" %9.3f", bw_matrix[a][b].get<double>());
    std::printf("\n");
  }
  std::printf("# One-way latency (us)\n#  %6s", "");
  for (int b = 0; b < n; ++b) std::printf(" %9d", b);
  std::printf("\n");
  for (int a = 0; a < n; ++a) {
    std::printf("   %6d", a);
    for (int b = 0; b < n; ++b)
      a == b ? std::printf(" %9s", "-") : std::printf(" %9.1f", lat_matrix[a][b].get<double>());
    std::printf("\n");
  }
  std::printf("# %5s %5s %-10s %10s %10s %12s %7s %-16s %s\n", "src", "dst", "kind", "busbw", "latency",
              "kind median", "of link", "transport", "verdict");
  for (const auto& p : pair_rows) {
    std::string tr = "-";
    if (p["transport"].is_array()) {
      tr.clear();
      for (const auto& t : p["transport"]) tr += (tr.empty() ? "" : ",") + t.get<std::string>();
    }
    const std::string of_link = p["link_fraction"].is_number()
                                    ? fmt::format("{:.{}f}%", 100 * p["link_fraction"].get<double>(),
                                                  p["link_fraction"].get<double>() < 0.1 ? 1 : 0)
                                    : "-";
    std::printf("  %5d %5d %-10s %10.3f %10.1f %12.3f %7s %-16s %s\n", p["src"].get<int>(),
                p["dst"].get<int>(), p["same_host"].get<bool>() ? "same-host" : "cross-host",
                p["busbw_gbps"].get<double>(), p["latency_us"].get<double>(),
                p["kind_median_busbw_gbps"].get<double>(), of_link.c_str(), tr.c_str(),
                p["slow"].get<bool>() ? ("SLOW: " + p["reason"].get<std::string>()).c_str() : "ok");
  }
  std::printf("# all_reduce of %s per rank (us):", format_size(ar_bytes).c_str());
  for (int r = 0; r < n; ++r) std::printf(" %d:%.1f", r, ar_times[r]);
  std::printf("\n");
  print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_link_health_command(CLI::App& parent) {
  auto opts = std::make_shared<LinkHealthOptions>();
  auto* app = parent.add_subcommand(
      "link-health",
      "Per-pair bandwidth and latency matrix (pairs in round-robin rounds), per-rank all_reduce "
      "time, outliers against pairs of the same kind, NCCL transports; PASS/FAIL naming slow pairs");
  add_common_options(app, opts->common);
  app->add_option("--bytes", opts->bandwidth_bytes, "Bytes each way per bandwidth exchange")
      ->check(cli::positive_size_value("e.g. --bytes 4M"));
  app->add_option("-n,--iters", opts->iters, "Timed bandwidth exchanges per pair")
      ->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up exchanges per pair")
      ->check(cli::non_negative_number());
  app->add_option("--latency-iters", opts->latency_iters, "Ping-pongs per pair")
      ->check(cli::positive_number());
  app->add_option("--allreduce-bytes", opts->allreduce_bytes, "Size of the per-rank all_reduce")
      ->check(CLI::Validator(
          [sized = cli::size_value()](std::string& s) -> std::string {
            if (auto problem = sized(s); !problem.empty()) return problem;
            // A float all_reduce: below one element there is nothing to time
            // (it was rounded up to 4 B without a word).
            return parse_size(s) >= 4 ? ""
                                      : s + " B is less than one float element (4 B): give 4 or more "
                                            "(e.g. --allreduce-bytes 1M)";
          },
          "SIZE >= 4", "ALLREDUCE_SIZE"));
  app->add_option("--allreduce-iters", opts->allreduce_iters, "all_reduce iterations")
      ->check(cli::positive_number());
  app->add_option("--rechecks", opts->rechecks,
                  "Measure the pairs found slow again, up to this many times, and keep each "
                  "pair's best figures before judging (0: judge the first measurement; at most 10)")
      ->check(cli::number_in_range(0, 10));
  app->add_option("--bw-threshold-pct", opts->thresholds.bandwidth_below_median_pct,
                  "A pair is slow when its bandwidth is this % below the median of its kind")
      ->capture_default_str()
      ->check(cli::number_in_range(0.0, 100.0));
  app->add_option("--latency-threshold-pct", opts->thresholds.latency_above_median_pct,
                  "A pair is slow when its latency is this % above the median of its kind")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  app->add_option("--latency-floor-us", opts->thresholds.latency_floor_us,
                  "...and more than this many us above it")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  app->add_option("--min-bw-gbps", opts->thresholds.min_bandwidth_gbps,
                  "Slow below this absolute bandwidth (0: off)")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  app->add_option("--max-latency-us", opts->thresholds.max_latency_us,
                  "Slow above this absolute latency (0: off)")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  app->add_option("--min-link-pct", opts->thresholds.min_link_pct,
                  "A cross-host pair is slow under this % of its link's speed, where the kernel "
                  "knows both ends' speeds (Gloo; 0: off)")
      ->check(cli::number_in_range(0, 100));
  app->add_flag("--no-nccl-transport", opts->no_nccl_transport,
                "Do not switch NCCL's INFO log on to learn each pair's transport");
  return {app, [opts] {
            const std::string nccl_log = prepare_nccl_log(*opts);
            return run_distributed(
                opts->common, "link-health",
                [opts, nccl_log](Job& job, reports::Report& report) {
                  run(job, report, *opts, nccl_log);
                },
                [opts](const Job& job) {
                  // The exchange's two buffers and the host fill, then the
                  // all_reduce's buffer and its host copy (Gloo: all in host
                  // memory; NCCL: the host copies).
                  const std::uint64_t bw = parse_size(opts->bandwidth_bytes);
                  const std::uint64_t ar = parse_size(opts->allreduce_bytes);
                  const bool host = job.backend == Backend::kGloo;
                  check_host_memory(job,
                                    (host ? 3 : 1) * static_cast<long double>(bw) +
                                        (host ? 2 : 1) * static_cast<long double>(ar),
                                    fmt::format("buffers of {} (--bytes) and {} (--allreduce-bytes)",
                                                format_size(bw), format_size(ar)),
                                    "use a smaller --bytes, or fewer ranks on this host");
                });
          }};
}

}  // namespace ddpdiag::cli
