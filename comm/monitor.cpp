#include "comm/monitor.h"

#include <algorithm>
#include <map>
#include <stdexcept>

#include <fmt/core.h>
#include <fmt/format.h>

namespace ddpdiag {

std::string Fingerprint::describe() const {
  std::string args;
  if (!dtype.empty()) args = fmt::format("{}, {}", dtype, count);
  if (!reduce_op.empty() && op != "barrier") args += ", " + reduce_op;
  if (root >= 0) {
    const bool p2p = op == "send" || op == "recv" || op == "sendrecv";
    args += fmt::format("{}{}={}", args.empty() ? "" : ", ", p2p ? "peer" : "root", root);
  }
  return fmt::format("{}({})", op, args);
}

bool Fingerprint::is_collective() const {
  return op != "send" && op != "recv" && op != "sendrecv";
}

const Fingerprint* RankState::at(std::int64_t seq) const {
  for (const auto& e : recent)
    if (e.seq == seq) return &e.fp;
  return nullptr;
}

nlohmann::json to_json(const Fingerprint& f) {
  return {{"op", f.op}, {"dtype", f.dtype}, {"count", f.count}, {"root", f.root},
          {"reduce_op", f.reduce_op}, {"text", f.describe()}};
}

Fingerprint fingerprint_from_json(const nlohmann::json& j) {
  Fingerprint f;
  f.op = j.at("op").get<std::string>();
  f.dtype = j.value("dtype", std::string());
  f.count = j.value("count", std::uint64_t{0});
  f.root = j.value("root", -1);
  f.reduce_op = j.value("reduce_op", std::string());
  return f;
}

nlohmann::json to_json(const RankState& s) {
  nlohmann::json recent = nlohmann::json::array();
  for (const auto& e : s.recent)
    recent.push_back({{"seq", e.seq},
                      {"collective", to_json(e.fp)},
                      {"started_s", e.started_s},
                      {"duration_ms", e.duration_ms < 0 ? nlohmann::json() : nlohmann::json(e.duration_ms)},
                      {"state", e.state}});
  nlohmann::json j = {{"rank", s.rank},
                      {"host", s.host},
                      {"pid", s.pid},
                      {"last_started_seq", s.last_started},
                      {"last_completed_seq", s.last_completed},
                      {"reason", s.reason},
                      {"flight_recorder", recent}};
  if (s.reset_by >= 0) j["connection_reset_by"] = s.reset_by;
  if (!s.open_p2p.empty()) {
    nlohmann::json open = nlohmann::json::array();
    for (const auto& f : s.open_p2p) open.push_back(to_json(f));
    j["open_point_to_point"] = open;
  }
  if (!s.stalled_links.empty()) {
    nlohmann::json links = nlohmann::json::array();
    for (const auto& l : s.stalled_links)
      links.push_back({{"peer", l.peer < 0 ? nlohmann::json() : nlohmann::json(l.peer)},
                       {"remote", l.remote},
                       {"unacked_bytes", l.unacked_bytes},
                       {"retransmits", l.retransmits}});
    j["stalled_links"] = links;
  }
  return j;
}

RankState rank_state_from_json(const nlohmann::json& j) {
  RankState s;
  try {
    s.rank = j.at("rank").get<int>();
    s.host = j.value("host", std::string());
    s.pid = j.value("pid", 0L);
    s.last_started = j.at("last_started_seq").get<std::int64_t>();
    s.last_completed = j.at("last_completed_seq").get<std::int64_t>();
    s.reason = j.value("reason", std::string());
    s.reset_by = j.value("connection_reset_by", -1);
    for (const auto& e : j.value("flight_recorder", nlohmann::json::array())) {
      FlightEntry f;
      f.seq = e.at("seq").get<std::int64_t>();
      f.fp = fingerprint_from_json(e.at("collective"));
      f.started_s = e.value("started_s", 0.0);
      f.duration_ms = e.contains("duration_ms") && e["duration_ms"].is_number()
                          ? e["duration_ms"].get<double>()
                          : -1.0;
      f.state = e.value("state", std::string());
      s.recent.push_back(std::move(f));
    }
    for (const auto& f : j.value("open_point_to_point", nlohmann::json::array()))
      s.open_p2p.push_back(fingerprint_from_json(f));
    for (const auto& l : j.value("stalled_links", nlohmann::json::array())) {
      const auto& peer = l.at("peer");
      s.stalled_links.push_back({peer.is_null() ? -1 : peer.get<int>(), l.value("remote", std::string()),
                                 l.value("unacked_bytes", std::uint64_t{0}), l.value("retransmits", 0)});
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(std::string("malformed rank state: ") + e.what());
  }
  return s;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += i + 1 == ranks.size() ? " and " : ", ";
    out += std::to_string(ranks[i]);
  }
  return out;
}

namespace {

std::string ranks_word(const std::vector<int>& ranks) {
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks);
}

}  // namespace

std::string Diagnosis::summary() const {
  std::string out;
  for (const auto& l : lines) out += (out.empty() ? "" : " ") + l;
  return out;
}

nlohmann::json Diagnosis::to_json() const {
  nlohmann::json mm = nlohmann::json::array();
  for (const auto& m : mismatches) {
    nlohmann::json groups = nlohmann::json::array();
    for (const auto& [fp, ranks] : m.groups)
      groups.push_back({{"collective", ddpdiag::to_json(fp)}, {"ranks", ranks}});
    mm.push_back({{"seq", m.seq}, {"groups", groups}});
  }
  return {{"gone_ranks", gone},
          {"unreachable_ranks", unreachable},
          {"behind_ranks", behind},
          {"mismatches", mm},
          {"stalled_links", [&] {
             nlohmann::json a = nlohmann::json::array();
             for (const auto& [x, y] : stalled_pairs)
               a.push_back({x, y < 0 ? nlohmann::json() : nlohmann::json(y)});
             return a;
           }()},
          {"stuck_seq", stuck_seq},
          {"findings", lines},
          {"summary", summary()}};
}

Diagnosis diagnose(const std::vector<std::optional<RankState>>& states,
                   const GoneNotes& gone_notes) {
  Diagnosis d;
  const int n = static_cast<int>(states.size());
  std::int64_t max_started = 0;
  std::int64_t min_completed = -1;
  std::vector<int> present;
  for (int r = 0; r < n; ++r) {
    if (!states[r]) {
      d.gone.push_back(r);
      continue;
    }
    present.push_back(r);
    max_started = std::max(max_started, states[r]->last_started);
    min_completed = min_completed < 0 ? states[r]->last_completed
                                      : std::min(min_completed, states[r]->last_completed);
  }
  if (!present.empty()) d.stuck_seq = min_completed + 1;

  // The fingerprint most ranks ran at `seq`, for "the others are in ...".
  auto majority_at = [&](std::int64_t seq) -> const Fingerprint* {
    std::map<std::string, std::pair<const Fingerprint*, int>> votes;
    for (int r : present)
      if (const Fingerprint* f = states[r]->at(seq)) {
        auto& v = votes[f->describe()];
        v.first = f;
        ++v.second;
      }
    const Fingerprint* best = nullptr;
    int most = 0;
    for (auto& [_, v] : votes)
      if (v.second > most) {
        best = v.first;
        most = v.second;
      }
    return best;
  };

  // Mismatch: the first sequence number where the ranks that ran it disagree
  // on what it was. Later seqs are then shifted and say nothing new.
  std::int64_t lo = -1, hi = 0;
  for (int r : present)
    for (const auto& e : states[r]->recent) {
      lo = lo < 0 ? e.seq : std::min(lo, e.seq);
      hi = std::max(hi, e.seq);
    }
  for (std::int64_t seq = std::max<std::int64_t>(lo, 1); lo >= 0 && seq <= hi; ++seq) {
    std::vector<std::pair<Fingerprint, std::vector<int>>> groups;
    for (int r : present) {
      const Fingerprint* f = states[r]->at(seq);
      if (!f) continue;
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const auto& g) { return g.first == *f; });
      if (it == groups.end()) groups.push_back({*f, {r}});
      else it->second.push_back(r);
    }
    if (groups.size() < 2) continue;
    bool all_collective = std::all_of(groups.begin(), groups.end(),
                                      [](const auto& g) { return g.first.is_collective(); });
    if (!all_collective) continue;
    std::stable_sort(groups.begin(), groups.end(),
                     [](const auto& a, const auto& b) { return a.second.size() > b.second.size(); });
    d.mismatches.push_back({seq, groups});
    break;
  }
  for (const auto& m : d.mismatches) {
    const auto& [fp0, ranks0] = m.groups.front();
    std::string line = fmt::format("Desync at collective #{}: {} {} {} running {}", m.seq,
                                   ranks0.size() == 1 ? "Rank" : "Ranks", rank_list(ranks0),
                                   ranks0.size() == 1 ? "is" : "are", fp0.describe());
    for (std::size_t g = 1; g < m.groups.size(); ++g) {
      const auto& [fp, ranks] = m.groups[g];
      line += fmt::format(" but {} {} running {}", ranks_word(ranks),
                          ranks.size() == 1 ? "is" : "are", fp.describe());
    }
    line += ".";
    d.lines.push_back(line);
  }

  // Behind: issued fewer collectives than the most advanced rank. The others
  // wait in the first collective the laggards have not issued.
  // A rank still in a point-to-point op with a rank that is gone waits on
  // that rank: it is not behind (link-health's pairs issue different numbers
  // of ops, so a rank whose partner died lags the others by design).
  std::vector<std::pair<int, const Fingerprint*>> waiting_on_gone;
  for (int r : present) {
    const RankState& st = *states[r];
    const auto f = std::find_if(st.open_p2p.begin(), st.open_p2p.end(), [&](const Fingerprint& p) {
      return p.root >= 0 && std::find(d.gone.begin(), d.gone.end(), p.root) != d.gone.end();
    });
    if (f != st.open_p2p.end()) {
      waiting_on_gone.emplace_back(r, &*f);
      continue;
    }
    if (st.last_started < max_started) d.behind.push_back(r);
  }
  if (!d.behind.empty()) {
    std::int64_t waiting_in = max_started;
    for (int r : d.behind) waiting_in = std::min(waiting_in, states[r]->last_started + 1);
    const Fingerprint* f = majority_at(waiting_in);
    std::vector<int> ahead;
    for (int r : present)
      if (states[r]->last_started >= waiting_in) ahead.push_back(r);
    std::string line = fmt::format("{} {} behind:", d.behind.size() == 1 ? "Rank" : "Ranks",
                                   rank_list(d.behind));
    for (std::size_t i = 0; i < d.behind.size(); ++i) {
      const auto& s = *states[d.behind[i]];
      line += fmt::format("{} rank {} last started #{} and completed #{}", i ? ";" : "", s.rank,
                          s.last_started, s.last_completed);
    }
    line += fmt::format(", while {} {} waiting in collective #{}{}{}.", ranks_word(ahead),
                        ahead.size() == 1 ? "is" : "are", waiting_in, f ? " " : "",
                        f ? f->describe() : std::string());
    d.lines.push_back(line);
    d.stuck_seq = waiting_in;
  }

  for (int r : d.gone) {
    const std::string note =
        r < static_cast<int>(gone_notes.size()) && !gone_notes[r].empty()
            ? gone_notes[r]
            : std::string("is dead, stopped or cannot reach the store");
    d.lines.push_back(fmt::format("Rank {} did not publish its state: it {}.", r, note));
  }
  for (const auto& [r, f] : waiting_on_gone)
    d.lines.push_back(fmt::format("Rank {} waits in {} with rank {}, which did not publish its state.", r,
                                  f->describe(), f->root));

  if (d.lines.empty() && !present.empty()) {
    if (min_completed >= max_started) {
      d.lines.push_back(fmt::format(
          "Every rank completed collective #{}: nothing is outstanding (a slow step outside the "
          "collectives?).",
          max_started));
      d.stuck_seq = max_started;
    } else {
      // The first collective not complete everywhere; where ranks queued
      // more, those run after it.
      const std::int64_t seq = min_completed + 1;
      const Fingerprint* f = majority_at(seq);
      d.lines.push_back(fmt::format(
          "Every rank is in collective #{}{} and agrees on it, yet it does not complete{}: the "
          "network or the backend stalls (a link that is down, a firewall, a wrong interface).",
          seq, f ? " " + f->describe() : std::string(),
          max_started > seq ? fmt::format(" (collectives up to #{} are queued after it)", max_started)
                            : std::string()));
      d.stuck_seq = seq;
    }
  }
  // Which links the kernel says drop the traffic: a rank's connection with
  // data unacknowledged while it retransmits. Both ends of a link that
  // drops one way show it (the data one way, the acknowledgements the other).
  // A link to a rank that published nothing is that rank's story (gone,
  // unreachable: its host lost the network), told above: not a link of its
  // own that drops.
  std::map<std::pair<int, int>, std::vector<std::string>> by_pair;
  for (int r : present)
    for (const auto& l : states[r]->stalled_links) {
      if (l.peer >= 0 && l.peer < n && !states[l.peer]) continue;
      const std::pair<int, int> key = l.peer >= 0 ? std::pair<int, int>{std::min(r, l.peer), std::max(r, l.peer)}
                                                   : std::pair<int, int>{r, -1};
      by_pair[key].push_back(fmt::format("rank {}'s {} byte(s) to {} unacknowledged after {} "
                                         "retransmission(s)",
                                         r, l.unacked_bytes,
                                         l.peer >= 0 ? fmt::format("rank {} ({})", l.peer, l.remote) : l.remote,
                                         l.retransmits));
    }
  const auto host_of = [&](int r) {
    return r >= 0 && r < n && states[r] && !states[r]->host.empty() ? " (host " + states[r]->host + ")"
                                                                   : std::string();
  };
  // Most telling first: the rest (a rank whose queued collectives cannot
  // complete looks behind) follows from a link that drops.
  std::vector<std::string> stalled_lines;
  for (const auto& [key, details] : by_pair) {
    d.stalled_pairs.push_back(key);
    stalled_lines.push_back(fmt::format(
        "{} drops traffic: {}.",
        key.second >= 0 ? fmt::format("The link between rank {}{} and rank {}{}", key.first,
                                      host_of(key.first), key.second, host_of(key.second))
                        : fmt::format("A link of rank {}{}", key.first, host_of(key.first)),
        fmt::join(details, "; ")));
  }
  d.lines.insert(d.lines.begin(), stalled_lines.begin(), stalled_lines.end());
  return d;
}

Diagnosis diagnose_store_unreachable(const RankState& self, int size,
                                     const std::string& store_address,
                                     const std::string& store_error,
                                     const std::vector<std::string>& hosts,
                                     const std::vector<bool>& same_machine, int ended) {
  Diagnosis d;
  std::vector<std::string> others_hosts;
  std::vector<int> here;     // on this host: cut off with this rank
  std::vector<int> unheard;  // on other hosts, where the store's own host is to blame
  for (int r = 0; r < size; ++r) {
    if (r == self.rank) continue;
    d.gone.push_back(r);
    if (r == ended) continue;
    if (r < static_cast<int>(same_machine.size()) && same_machine[r]) {
      here.push_back(r);
      continue;
    }
    // With the store's host known to be the cause, the other hosts are
    // not known to be cut off: only unheard.
    (ended >= 0 ? unheard : d.unreachable).push_back(r);
    if (r < static_cast<int>(hosts.size()) && !hosts[r].empty() &&
        std::find(others_hosts.begin(), others_hosts.end(), hosts[r]) == others_hosts.end())
      others_hosts.push_back(hosts[r]);
  }
  d.stuck_seq = self.last_completed + 1;
  std::string on_hosts;
  for (std::size_t i = 0; i < others_hosts.size(); ++i)
    on_hosts += (i ? ", " : "") + others_hosts[i];
  if (!on_hosts.empty())
    on_hosts = fmt::format(" (host{} {})", others_hosts.size() == 1 ? "" : "s", on_hosts);
  // The client's messages name the store themselves: "the store at H:P did
  // not answer ..." reads "it did not answer ..." after our own "The store at".
  std::string why = store_error;
  const std::string named = "the store at " + store_address + " ";
  if (why.rfind(named, 0) == 0) why = "it " + why.substr(named.size());
  std::string line =
      fmt::format("The store at {} is unreachable from rank {}{}: no other rank's state can be read",
                  store_address, self.rank, why.empty() ? "" : " (" + why + ")");
  if (!d.unreachable.empty())
    line += fmt::format(", so {}{} {} unreachable from here", ranks_word(d.unreachable), on_hosts,
                        d.unreachable.size() == 1 ? "is" : "are");
  if (!unheard.empty())
    line += fmt::format(", so what {}{} {} doing is unknown here", ranks_word(unheard), on_hosts,
                        unheard.size() == 1 ? "is" : "are");
  if (!here.empty())
    line += fmt::format("; {}, on this host, {} cut off with it",
                        ranks_word(here), here.size() == 1 ? "is" : "are");
  d.lines.push_back(line + ".");
  std::string last;
  if (const Fingerprint* f = self.at(self.last_started)) last = fmt::format(" {}", f->describe());
  d.lines.push_back(fmt::format("Rank {} last started collective #{}{} and completed #{}.",
                                self.rank, self.last_started, last, self.last_completed));
  return d;
}

// ---------------------------------------------------------------------------

std::vector<Fault> parse_faults(const std::string& spec) {
  std::vector<Fault> out;
  std::size_t start = 0;
  while (start <= spec.size()) {
    std::size_t end = spec.find(';', start);
    if (end == std::string::npos) end = spec.size();
    std::string part = spec.substr(start, end - start);
    start = end + 1;
    if (part.empty()) {
      if (end == spec.size()) break;
      continue;
    }
    auto at = part.find('@');
    std::string kind = part.substr(0, at);
    Fault f;
    if (kind == "hang") f.kind = Fault::Kind::kHang;
    else if (kind == "skip") f.kind = Fault::Kind::kSkip;
    else if (kind == "desync") f.kind = Fault::Kind::kDesync;
    else if (kind == "exit") f.kind = Fault::Kind::kExit;
    else if (kind == "throw") f.kind = Fault::Kind::kThrow;
    else if (kind == "slow") f.kind = Fault::Kind::kSlow;
    else if (kind == "corrupt") f.kind = Fault::Kind::kCorrupt;
    else if (kind == "gather") f.kind = Fault::Kind::kGather;
    else if (kind == "gather-exit") f.kind = Fault::Kind::kGatherExit;
    else if (kind == "gather-hang") f.kind = Fault::Kind::kGatherHang;
    else
      throw std::invalid_argument("unknown fault '" + kind +
                                  "' (hang, skip, desync, exit, throw, slow, corrupt, gather, "
                                  "gather-exit, gather-hang)");
    std::string args = at == std::string::npos ? std::string() : part.substr(at + 1);
    std::size_t p = 0;
    while (p < args.size()) {
      std::size_t comma = args.find(',', p);
      if (comma == std::string::npos) comma = args.size();
      std::string kv = args.substr(p, comma - p);
      p = comma + 1;
      auto eq = kv.find('=');
      if (eq == std::string::npos) throw std::invalid_argument("fault argument '" + kv + "' lacks '='");
      std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
      long long num = 0;
      try {
        std::size_t used = 0;
        num = std::stoll(v, &used);
        if (used != v.size()) throw std::invalid_argument(v);
      } catch (const std::exception&) {
        throw std::invalid_argument("fault argument '" + kv + "' is not a number");
      }
      if (k == "seq") f.seq = num;
      else if (k == "rank") f.rank = static_cast<int>(num);
      else if (k == "ms") f.ms = static_cast<int>(num);
      else throw std::invalid_argument("unknown fault argument '" + k + "' (seq, rank, ms)");
    }
    if (f.rank < 0) throw std::invalid_argument("fault '" + part + "' needs rank=R");
    const bool needs_seq = f.kind == Fault::Kind::kHang || f.kind == Fault::Kind::kSkip ||
                           f.kind == Fault::Kind::kDesync || f.kind == Fault::Kind::kExit ||
                           f.kind == Fault::Kind::kThrow;
    if (needs_seq && f.seq < 1) throw std::invalid_argument("fault '" + part + "' needs seq=N (N >= 1)");
    if (f.kind == Fault::Kind::kSlow && f.ms <= 0)
      throw std::invalid_argument("fault '" + part + "' needs ms=M (M > 0)");
    out.push_back(f);
  }
  return out;
}

}  // namespace ddpdiag
