// Hang and desync detection: fingerprints, the diagnosis from per-rank
// states, fault specs, bisect planning and judging (pure), then the monitored
// communicator and sub-groups on Gloo with ranks as threads.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <csignal>
#include <unistd.h>

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/group.h"
#include "comm/monitor.h"
#include "comm/monitored_communicator.h"
#include "diag/bisect_plan.h"
#include "tests/forwarding_communicator.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using ddpdiag::testing::gloo_rank_options;
using namespace std::chrono_literals;

namespace {

Fingerprint ar(std::uint64_t count = 1024) {
  return {"all_reduce", "float", count, -1, "sum"};
}
Fingerprint bc(std::uint64_t count = 1024, int root = 0) {
  return {"broadcast", "float", count, root, ""};
}

// A rank that ran `fps` as collectives 1..k, completed `completed` of them.
RankState state_of(int rank, const std::vector<Fingerprint>& fps, std::int64_t completed) {
  RankState s;
  s.rank = rank;
  s.host = "h" + std::to_string(rank);
  s.last_started = static_cast<std::int64_t>(fps.size());
  s.last_completed = completed;
  for (std::size_t i = 0; i < fps.size(); ++i)
    s.recent.push_back({static_cast<std::int64_t>(i + 1), fps[i], 0.0,
                        static_cast<std::int64_t>(i + 1) <= completed ? 1.0 : -1.0,
                        static_cast<std::int64_t>(i + 1) <= completed ? "completed" : "started"});
  return s;
}

std::set<std::string> hosts_of(const std::vector<std::string>& hosts, const cli::BisectGroup& g) {
  std::set<std::string> on;
  for (int r : g.ranks) on.insert(hosts[static_cast<std::size_t>(r)]);
  return on;
}

bool contains(const std::string& hay, const std::string& needle) {
  return hay.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("fingerprints describe themselves as users read them", "[monitor]") {
  CHECK(ar().describe() == "all_reduce(float, 1024, sum)");
  CHECK(bc(8, 2).describe() == "broadcast(float, 8, root=2)");
  Fingerprint b;
  b.op = "barrier";
  CHECK(b.describe() == "barrier()");
  Fingerprint s{"send", "int32", 4, 3, ""};
  CHECK(s.describe() == "send(int32, 4, peer=3)");
  CHECK_FALSE(s.is_collective());
  CHECK(ar() == ar());
  CHECK_FALSE(ar() == ar(512));
  CHECK_FALSE(ar() == bc());
}

TEST_CASE("rank states round-trip through JSON", "[monitor]") {
  RankState s = state_of(2, {ar(), ar(), bc()}, 2);
  s.reason = "timeout";
  RankState back = rank_state_from_json(nlohmann::json::parse(to_json(s).dump()));
  CHECK(back.rank == 2);
  CHECK(back.last_started == 3);
  CHECK(back.last_completed == 2);
  REQUIRE(back.recent.size() == 3);
  CHECK(back.recent[2].fp == bc());
  CHECK(back.recent[2].duration_ms < 0);
  REQUIRE(back.at(3) != nullptr);
  CHECK(*back.at(3) == bc());
  CHECK(back.at(4) == nullptr);
  CHECK(back.reset_by == -1);
  CHECK_FALSE(to_json(s).contains("connection_reset_by"));
  s.reset_by = 1;
  CHECK(to_json(s)["connection_reset_by"] == 1);
  CHECK(rank_state_from_json(to_json(s)).reset_by == 1);
  CHECK_THROWS_AS(rank_state_from_json(nlohmann::json::object()), std::invalid_argument);
  auto bad = to_json(s);
  bad["connection_reset_by"] = "one";
  CHECK_THROWS_AS(rank_state_from_json(bad), std::invalid_argument);
}

TEST_CASE("diagnosis: a rank that stopped issuing collectives is behind", "[monitor]") {
  std::vector<std::optional<RankState>> st = {
      state_of(0, {ar(), ar(), ar()}, 2),
      state_of(1, {ar(), ar()}, 2),
      state_of(2, {ar(), ar(), ar()}, 2),
  };
  Diagnosis d = diagnose(st);
  CHECK(d.behind == std::vector<int>{1});
  CHECK(d.gone.empty());
  CHECK_FALSE(d.desync());
  CHECK(d.stuck_seq == 3);
  CHECK(contains(d.summary(), "Rank 1 behind"));
  CHECK(contains(d.summary(), "ranks 0 and 2 are waiting in collective #3 all_reduce(float, 1024, sum)"));
}

TEST_CASE("diagnosis: ranks in different collectives at the same seq", "[monitor]") {
  std::vector<std::optional<RankState>> st = {
      state_of(0, {ar(), ar(), ar()}, 2),
      state_of(1, {ar(), ar(), bc()}, 2),
      state_of(2, {ar(), ar(), ar()}, 2),
  };
  Diagnosis d = diagnose(st);
  REQUIRE(d.mismatches.size() == 1);
  CHECK(d.mismatches[0].seq == 3);
  REQUIRE(d.mismatches[0].groups.size() == 2);
  CHECK(d.mismatches[0].groups[0].second == std::vector<int>{0, 2});
  CHECK(d.mismatches[0].groups[1].second == std::vector<int>{1});
  CHECK(contains(d.summary(), "Ranks 0 and 2 are running all_reduce(float, 1024, sum) but rank 1 "
                              "is running broadcast(float, 1024, root=0)"));
  CHECK(d.behind.empty());
}

TEST_CASE("diagnosis: a count mismatch is a desync too, p2p differences are not", "[monitor]") {
  std::vector<std::optional<RankState>> st = {state_of(0, {ar(1024)}, 0),
                                              state_of(1, {ar(512)}, 0)};
  Diagnosis d = diagnose(st);
  REQUIRE(d.desync());
  CHECK(contains(d.summary(), "all_reduce(float, 512, sum)"));

  Fingerprint send{"send", "float", 8, 1, ""}, recv{"recv", "float", 8, 0, ""};
  std::vector<std::optional<RankState>> p2p = {state_of(0, {send}, 0), state_of(1, {recv}, 0)};
  CHECK_FALSE(diagnose(p2p).desync());
}

TEST_CASE("diagnosis: ranks without a state are gone, with the caller's note", "[monitor]") {
  std::vector<std::optional<RankState>> st = {state_of(0, {ar(), ar()}, 1), std::nullopt,
                                              state_of(2, {ar(), ar()}, 1)};
  GoneNotes notes = {"", "is dead: its process 42 on this machine has exited or was killed", ""};
  Diagnosis d = diagnose(st, notes);
  CHECK(d.gone == std::vector<int>{1});
  CHECK(contains(d.summary(), "Rank 1 did not publish its state: it is dead"));
  Diagnosis plain = diagnose(st);
  CHECK(contains(plain.summary(), "dead, stopped or cannot reach the store"));
  auto j = d.to_json();
  CHECK(j["gone_ranks"] == nlohmann::json::array({1}));
}

TEST_CASE("diagnosis: a rank in a point-to-point op with a gone rank waits on it and is not behind",
          "[monitor]") {
  // link-health at 3 ranks: rank 0 went on to its next pair; rank 1 is in
  // its sendrecv with rank 2, which died. Rank 1 lags rank 0 by design.
  // Point-to-point ops have no sequence number: rank 1 issued no
  // collective yet, and lists its open sendrecv with rank 2.
  Fingerprint with2{"sendrecv", "uint8", 64, 2, ""};
  std::vector<std::optional<RankState>> st = {state_of(0, {ar()}, 0), state_of(1, {}, 0),
                                              std::nullopt};
  st[1]->open_p2p.push_back(with2);
  // Through JSON, as published.
  st[1] = rank_state_from_json(to_json(*st[1]));
  REQUIRE(st[1]->open_p2p.size() == 1);
  Diagnosis d = diagnose(st);
  CHECK(d.gone == std::vector<int>{2});
  CHECK(d.behind.empty());
  CHECK_FALSE(contains(d.summary(), "behind"));
  CHECK(contains(d.summary(), "Rank 2 did not publish its state"));
  CHECK(contains(d.summary(), "Rank 1 waits in sendrecv(uint8, 64, peer=2) with rank 2"));
  // A rank behind in a collective is still behind.
  std::vector<std::optional<RankState>> coll = {state_of(0, {ar(), ar(), ar()}, 2),
                                                state_of(1, {ar(), ar()}, 1), std::nullopt};
  CHECK(diagnose(coll).behind == std::vector<int>{1});
}

TEST_CASE("diagnosis: a rank cut off from the store tells other hosts from its own", "[monitor]") {
  const RankState self = state_of(2, {ar(), ar()}, 1);
  const std::string store = "10.0.0.1:29500";
  const std::string err = "the store at 10.0.0.1:29500 did not answer within 2.5 s";
  Diagnosis d = diagnose_store_unreachable(self, 4, store, err, {"h0", "h1", "h2", "h2"},
                                           {false, false, true, true});
  CHECK(d.gone == std::vector<int>{0, 1, 3});
  CHECK(d.unreachable == std::vector<int>{0, 1});
  CHECK(contains(d.summary(), "The store at 10.0.0.1:29500 is unreachable from rank 2 (it did "
                              "not answer within 2.5 s): no other rank's state can be read, so "
                              "ranks 0 and 1 (hosts h0, h1) are unreachable from here; rank 3, "
                              "on this host, is cut off with it."));
  CHECK(contains(d.summary(), "Rank 2 last started collective #2"));
  // Alone on its host: every other rank is unreachable, nothing is "on this host".
  Diagnosis alone = diagnose_store_unreachable(self, 3, store, err, {"h0", "h1", "h2"},
                                               {false, false, true});
  CHECK(alone.unreachable == std::vector<int>{0, 1});
  CHECK_FALSE(contains(alone.summary(), "on this host"));
  // Every peer on this host: none is unreachable, all are cut off with it.
  Diagnosis local = diagnose_store_unreachable(self, 3, store, "", {"h", "h", "h"},
                                               {true, true, true});
  CHECK(local.unreachable.empty());
  CHECK(contains(local.summary(), "no other rank's state can be read; ranks 0 and 1, on this "
                                  "host, are cut off with it."));
  // Rank 0 hosted the store and its process is gone: it is gone, and not
  // "cut off with" the rank that lost the store.
  Diagnosis ended = diagnose_store_unreachable(self, 3, store, "", {"h", "h", "h"},
                                               {true, true, true}, /*ended=*/0);
  CHECK(ended.gone == std::vector<int>{0, 1});
  CHECK(ended.unreachable.empty());
  CHECK(contains(ended.summary(), "no other rank's state can be read; rank 1, on this host, is "
                                  "cut off with it."));
  CHECK_FALSE(contains(ended.summary(), "rank 0, on this host"));
  // Rank 0 hosted the store on another host, whose kernel answered for it
  // (ended or frozen): the other hosts' ranks are unheard, not unreachable.
  Diagnosis remote = diagnose_store_unreachable(self, 4, store, err, {"h0", "h1", "h2", "h3"},
                                                {false, false, true, false}, /*ended=*/0);
  CHECK(remote.gone == std::vector<int>{0, 1, 3});
  CHECK(remote.unreachable.empty());
  CHECK(contains(remote.summary(), "no other rank's state can be read, so what ranks 1 and 3 "
                                   "(hosts h1, h3) are doing is unknown here."));
  CHECK_FALSE(contains(remote.summary(), "unreachable from here"));
}

TEST_CASE("diagnosis: everyone in the same collective points at the network", "[monitor]") {
  std::vector<std::optional<RankState>> st = {state_of(0, {ar(), ar()}, 1),
                                              state_of(1, {ar(), ar()}, 1)};
  Diagnosis d = diagnose(st);
  CHECK(d.behind.empty());
  CHECK(d.gone.empty());
  CHECK(d.stuck_seq == 2);
  CHECK(contains(d.summary(), "Every rank is in collective #2"));
}

TEST_CASE("diagnosis: a link the kernel retransmits on is named by its two ranks", "[monitor]") {
  // Ranks 2 and 3 lost their link (a route gone, a firewall dropping): both
  // ends hold data unacknowledged, as the kernel's socket table says; rank
  // 1's connection to a shared address is not told apart.
  std::vector<std::optional<RankState>> st;
  for (int r = 0; r < 4; ++r) st.push_back(state_of(r, {ar(), ar()}, 1));
  st[3]->stalled_links.push_back({2, "10.0.0.3:4711", 65536, 6});
  st[2]->stalled_links.push_back({3, "10.0.0.4:51000", 24, 5});
  st[1]->stalled_links.push_back({-1, "10.0.0.9:51002", 100, 1});
  // Through the store, as the ranks publish them.
  for (auto& s : st) s = rank_state_from_json(nlohmann::json::parse(to_json(*s).dump()));
  REQUIRE(st[3]->stalled_links.size() == 1);
  CHECK(st[3]->stalled_links[0].peer == 2);
  CHECK(st[3]->stalled_links[0].unacked_bytes == 65536);
  CHECK(st[1]->stalled_links[0].peer == -1);
  CHECK(to_json(*st[1])["stalled_links"][0]["peer"].is_null());
  CHECK_FALSE(to_json(*st[0]).contains("stalled_links"));
  Diagnosis d = diagnose(st);
  CHECK(d.stuck_seq == 2);
  CHECK(d.stalled_pairs == std::vector<std::pair<int, int>>{{1, -1}, {2, 3}});
  CHECK(contains(d.summary(), "Every rank is in collective #2"));
  CHECK(contains(d.summary(), "The link between rank 2 (host h2) and rank 3 (host h3) drops traffic: "
                              "rank 2's 24 byte(s) to rank 3 (10.0.0.4:51000) unacknowledged after 5 "
                              "retransmission(s); rank 3's 65536 byte(s) to rank 2 (10.0.0.3:4711)"));
  CHECK(contains(d.summary(), "A link of rank 1 (host h1) drops traffic: rank 1's 100 byte(s) to 10.0.0.9:51002"));
  CHECK(d.to_json()["stalled_links"] == nlohmann::json::parse("[[1, null], [2, 3]]"));
  // Rank 2 published nothing (its host lost the network): the links to it
  // are its story, not links of their own.
  st[2].reset();
  st[0]->stalled_links.push_back({2, "10.0.0.3:4711", 87672, 5});
  d = diagnose(st);
  CHECK(d.stalled_pairs == std::vector<std::pair<int, int>>{{1, -1}});
  CHECK_FALSE(contains(d.summary(), "and rank 2"));
  CHECK(contains(d.summary(), "Rank 2 did not publish its state"));
}

TEST_CASE("diagnosis: with collectives queued, the stuck one is the first not completed",
          "[monitor]") {
  // Both ranks queued 12 collectives; only 3 completed everywhere.
  std::vector<std::optional<RankState>> st = {state_of(0, std::vector<Fingerprint>(12, ar()), 3),
                                              state_of(1, std::vector<Fingerprint>(12, ar()), 5)};
  Diagnosis d = diagnose(st);
  CHECK(d.stuck_seq == 4);
  CHECK(contains(d.summary(), "Every rank is in collective #4 all_reduce(float, 1024, sum)"));
  CHECK(contains(d.summary(), "collectives up to #12 are queued after it"));
}

TEST_CASE("rank lists read as English", "[monitor]") {
  CHECK(rank_list({}) == "");
  CHECK(rank_list({3}) == "3");
  CHECK(rank_list({1, 2}) == "1 and 2");
  CHECK(rank_list({0, 2, 3}) == "0, 2 and 3");
}

TEST_CASE("fault specs parse and reject nonsense", "[monitor]") {
  auto f = parse_faults("hang@seq=5,rank=1;slow@rank=2,ms=20;corrupt@rank=0");
  REQUIRE(f.size() == 3);
  CHECK(f[0].kind == Fault::Kind::kHang);
  CHECK(f[0].seq == 5);
  CHECK(f[0].rank == 1);
  CHECK(f[1].kind == Fault::Kind::kSlow);
  CHECK(f[1].ms == 20);
  CHECK(f[2].kind == Fault::Kind::kCorrupt);
  CHECK(parse_faults("").empty());
  CHECK_THROWS_AS(parse_faults("explode@rank=1"), std::invalid_argument);
  CHECK_THROWS_AS(parse_faults("hang@rank=1"), std::invalid_argument);  // needs seq
  CHECK_THROWS_AS(parse_faults("hang@seq=x,rank=1"), std::invalid_argument);
  CHECK_THROWS_AS(parse_faults("slow@rank=1"), std::invalid_argument);  // needs ms
  CHECK_THROWS_AS(parse_faults("skip@seq=1"), std::invalid_argument);   // needs rank
  f = parse_faults("throw@seq=4,rank=1");
  REQUIRE(f.size() == 1);
  CHECK(f[0].kind == Fault::Kind::kThrow);
  CHECK(f[0].seq == 4);
  CHECK_THROWS_AS(parse_faults("throw@rank=1"), std::invalid_argument);  // needs seq
}

TEST_CASE("bisect plan: hosts alone, pairs of hosts, halves; never the world", "[bisect]") {
  using cli::plan_bisect;
  auto g = plan_bisect({"a", "a", "b", "b", "c", "c"});
  std::vector<std::vector<int>> sets;
  for (const auto& x : g) sets.push_back(x.ranks);
  auto has = [&](std::vector<int> s) {
    return std::find(sets.begin(), sets.end(), s) != sets.end();
  };
  CHECK(has({0, 1}));
  CHECK(has({2, 3}));
  CHECK(has({4, 5}));
  CHECK(has({0, 1, 2, 3}));
  CHECK(has({2, 3, 4, 5}));
  CHECK(has({0, 1, 4, 5}));
  CHECK_FALSE(has({0, 1, 2, 3, 4, 5}));
  for (std::size_t i = 1; i < g.size(); ++i) CHECK(g[i - 1].ranks.size() <= g[i].ranks.size());
  CHECK(g.front().kind == "host");
  CHECK(g.front().label == "host a");

  // One host: ranks play the part of hosts.
  auto one = plan_bisect({"x", "x", "x"});
  CHECK(one.front().kind == "rank");
  CHECK(one.size() == 6);  // 3 alone + 3 pairs (halves repeat them)
  // Many hosts: neighbour pairs only, capped.
  std::vector<std::string> many;
  for (int i = 0; i < 16; ++i) many.push_back("n" + std::to_string(i));
  CHECK(plan_bisect(many).size() <= 24);
  CHECK(plan_bisect({"a"}).empty());
}

TEST_CASE("bisect judge: a broken rank, a slow rank, nobody", "[bisect]") {
  using namespace cli;
  std::vector<std::string> hosts = {"a", "b", "c"};
  auto groups = plan_bisect(hosts);
  auto outcome = [&](int bad_rank, bool slow) {
    std::vector<GroupOutcome> out;
    for (const auto& g : groups) {
      GroupOutcome o;
      o.group = g;
      o.ran = true;
      bool has = std::find(g.ranks.begin(), g.ranks.end(), bad_rank) != g.ranks.end();
      o.time_us = 100.0 * g.ranks.size() + (has && slow ? 20000 : 0);
      o.wrong = has && !slow ? 5 : 0;
      out.push_back(o);
    }
    return out;
  };
  auto broken = outcome(2, false);
  auto v = judge_bisect(broken, hosts);
  CHECK(v.suspect_ranks == std::vector<int>{2});
  CHECK(v.suspect_hosts == std::vector<std::string>{"c"});
  REQUIRE(v.smallest_failing);
  CHECK(v.smallest_failing->ranks == std::vector<int>{2});
  CHECK(contains(v.summary, "points to rank 2 on host c"));

  auto slow = outcome(1, true);
  v = judge_bisect(slow, hosts);
  CHECK(v.suspect_ranks == std::vector<int>{1});
  CHECK(contains(v.summary, "host b"));
  auto j = v.to_json(slow);
  CHECK(j["suspect_ranks"] == nlohmann::json::array({1}));
  // A rank alone moves nothing: its time is never judged, only the groups
  // where it talks to others.
  for (const auto& o : slow)
    if (o.group.ranks.size() == 1) CHECK_FALSE(o.slow);
  // Two ranks on one machine, healthy, rank 1 alone timed far slower than
  // rank 0 alone (a busy machine's scheduler): nothing to localise.
  {
    const std::vector<std::string> two = {"x", "x"};
    std::vector<GroupOutcome> lonely;
    for (const auto& g : plan_bisect(two)) {
      GroupOutcome o;
      o.group = g;
      o.ran = true;
      o.time_us = g.ranks == std::vector<int>{1} ? 1637.9 : 113.1;
      lonely.push_back(o);
    }
    REQUIRE(lonely.size() == 2);
    v = judge_bisect(lonely, two, 3.0, 1000.0, /*world_passed=*/true);
    CHECK_FALSE(v.smallest_failing);
    CHECK(v.suspect_ranks.empty());
  }

  auto fine = outcome(-1, false);
  v = judge_bisect(fine, hosts);
  CHECK(v.suspect_ranks.empty());
  CHECK_FALSE(v.smallest_failing);
  CHECK(contains(v.summary, "the failure needs the whole world"));
  // The same sub-groups after a run whose full world passed: nothing failed,
  // so the summary must not speak of a failure.
  auto healthy = outcome(-1, false);
  v = judge_bisect(healthy, hosts, 3.0, 1000.0, /*world_passed=*/true);
  CHECK_FALSE(v.smallest_failing);
  CHECK(contains(v.summary, "the full world passed"));
  CHECK(contains(v.summary, "nothing to localise"));
  CHECK_FALSE(contains(v.summary, "failure"));
  // A sub-group failing after the full world passed is still named.
  auto hidden = outcome(2, false);
  v = judge_bisect(hidden, hosts, 3.0, 1000.0, /*world_passed=*/true);
  CHECK(v.suspect_ranks == std::vector<int>{2});

  // Wrong results on rank 2 and, by noise, rank 0 alone timed slow: the
  // wrong results decide, the slow timing does not dilute them.
  auto noisy = outcome(2, false);
  for (auto& o : noisy)
    if (o.group.ranks == std::vector<int>{0}) o.time_us += 50000;
  v = judge_bisect(noisy, hosts);
  CHECK(v.suspect_ranks == std::vector<int>{2});
  REQUIRE(v.smallest_failing);
  CHECK(v.smallest_failing->ranks == std::vector<int>{2});

  // Rank 1 slow everywhere, and rank 2 alone timed slow by a busy moment
  // while the pair of ranks 0 and 2 ran fine: rank 2's slowness is noise and
  // rank 1 alone is named.
  auto busy = outcome(1, true);
  for (auto& o : busy)
    if (o.group.ranks == std::vector<int>{2}) o.time_us += 5000;
  v = judge_bisect(busy, hosts);
  CHECK(v.suspect_ranks == std::vector<int>{1});
  for (const auto& o : busy) {
    const bool has1 = std::find(o.group.ranks.begin(), o.group.ranks.end(), 1) != o.group.ranks.end();
    CHECK(o.slow == (has1 && o.group.ranks.size() > 1));
  }

  // A slow rank stays slow when every larger group holding it is slow too.
  auto alone = outcome(-1, false);
  for (auto& o : alone)
    if (std::find(o.group.ranks.begin(), o.group.ranks.end(), 2) != o.group.ranks.end())
      o.time_us += 5000;
  v = judge_bisect(alone, hosts);
  CHECK(v.suspect_ranks == std::vector<int>{2});
}

namespace {

// Each planned group of `hosts` as run, its time by the hosts it spans:
// time_of(hosts in the group, group).
template <typename TimeOf>
std::vector<cli::GroupOutcome> outcomes_by_hosts(const std::vector<std::string>& hosts, TimeOf time_of) {
  std::vector<cli::GroupOutcome> out;
  for (const auto& g : cli::plan_bisect(hosts)) {
    cli::GroupOutcome o;
    o.group = g;
    o.ran = true;
    o.time_us = time_of(hosts_of(hosts, g), g);
    out.push_back(o);
  }
  return out;
}

}  // namespace

TEST_CASE("bisect judge: a slow host with fewer ranks than the others", "[bisect]") {
  using namespace cli;
  // Hosts of 2, 2 and 1 ranks; host c's link is slow. No other group has
  // the size of c's pairs (3 ranks), so they are judged against the pair of
  // a and b (4 ranks), which is fast.
  std::vector<std::string> hosts = {"a", "a", "b", "b", "c"};
  // Loopback inside a host: fast; across hosts: 2 ms, 20 ms with c.
  auto out = outcomes_by_hosts(hosts, [](const std::set<std::string>& on, const BisectGroup&) {
    return on.size() == 1 ? 150.0 : (on.count("c") ? 20000.0 : 2000.0);
  });
  auto v = judge_bisect(out, hosts);
  CHECK(v.suspect_hosts == std::vector<std::string>{"c"});
  CHECK(v.suspect_ranks == std::vector<int>{4});
  // Groups on one host are not judged against groups across hosts: a
  // healthy network, slower than loopback, flags nothing.
  for (auto& o : out)
    if (hosts_of(hosts, o.group).size() > 1) o.time_us = 2000.0 + 100.0 * static_cast<double>(o.group.ranks.size());
  v = judge_bisect(out, hosts);
  CHECK(v.suspect_ranks.empty());
  for (const auto& o : out) CHECK_FALSE(o.slow);
}

TEST_CASE("bisect judge: a slow host with more ranks than the others", "[bisect]") {
  using namespace cli;
  // Hosts of 1, 2 and 1 ranks; host b's link is slow (figures of a run in
  // namespaces with b's link at 50 Mbit/s). Both 3-rank pairs hold b and
  // are slow alike; only the 2-rank pair of a and c shows the healthy speed.
  for (const auto& hosts : {std::vector<std::string>{"a", "b", "b", "c"},
                            std::vector<std::string>{"b", "b", "a", "c"}}) {
    auto out = outcomes_by_hosts(hosts, [](const std::set<std::string>& on, const BisectGroup&) {
      return on.size() == 1 ? 479.0 : (on.count("b") ? 59000.0 : 2001.0);
    });
    auto v = judge_bisect(out, hosts, 3.0, 1000.0, /*world_passed=*/true);
    CHECK(v.suspect_hosts == std::vector<std::string>{"b"});
    for (const auto& o : out) {
      const auto on = hosts_of(hosts, o.group);
      CHECK(o.slow == (on.size() > 1 && on.count("b") == 1));
    }
    // A healthy network whose time grows with the ranks as a ring's does
    // (a 3-rank group twice a 2-rank one) flags nothing.
    for (auto& o : out)
      if (hosts_of(hosts, o.group).size() > 1) o.time_us = 2000.0 * static_cast<double>(o.group.ranks.size() - 1);
    v = judge_bisect(out, hosts, 3.0, 1000.0, /*world_passed=*/true);
    CHECK(v.suspect_ranks.empty());
    for (const auto& o : out) CHECK_FALSE(o.slow);
  }
}

// ---------------------------------------------------------------------------
// With real Gloo ranks as threads.

namespace {

struct ThreadRank {
  std::string error;
  int exit_code = 0;
  nlohmann::json report;
};

// n ranks, each a MonitoredCommunicator over Gloo, running `iters` all_reduces.
// With `queue`, every all_reduce is issued first and only the last is waited
// for, as allreduce-test times a batch.
std::vector<ThreadRank> run_monitored(int n, const std::string& faults, int iters,
                                      Millis timeout, bool queue = false) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<ThreadRank> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o = gloo_rank_options(r, n, std::make_shared<PrefixStore>("comm", store), timeout);
        auto inner = make_communicator(o);
        inner->set_default_timeout(timeout);
        MonitorOptions mo;
        mo.rank = r;
        mo.size = n;
        mo.store = std::make_shared<PrefixStore>("monitor", store);
        mo.timeout = timeout;
        mo.gather_wait = 1500ms;
        mo.poll_interval = 100ms;
        mo.faults = parse_faults(faults);
        MonitoredCommunicator comm(std::move(inner), mo);
        CommBuffer buf(comm, 64 * sizeof(float));
        try {
          std::shared_ptr<Work> last;
          for (int i = 0; i < iters; ++i) {
            last = comm.allreduce(buf.get(), buf.get(), 64, DType::kFloat32, ReduceOp::kSum);
            if (!queue) last->wait(timeout);
          }
          if (queue && last) last->wait(timeout);
        } catch (const Error& e) {
          out[r].error = e.what();
          out[r].exit_code = static_cast<int>(e.exit_code());
          out[r].report = comm.failure_report();
        }
      } catch (const std::exception& e) {
        out[r].error = std::string("setup: ") + e.what();
        out[r].exit_code = -1;
      }
    });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace

// A collective whose Work completed with an error (Gloo fails the queued
// ops when a peer's connection resets) is not complete: the watchdog once
// moved last_completed past such ops, and a rank then named a later
// collective than the stuck one.
TEST_CASE("monitored Gloo: collectives that failed are not counted complete", "[monitor][gloo]") {
  struct FailedWork final : Work {
    bool is_completed() override { return true; }
    bool failed() override { return true; }
    void wait(Millis) override { throw BackendError("Connection reset by peer", {"all_reduce", 0, 1, ""}); }
    void abort() override {}
  };
  struct Failing final : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    bool fail = false;
    std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                    ReduceOp op) override {
      if (fail) return std::make_shared<FailedWork>();
      return ForwardingCommunicator::allreduce(send, recv, count, dtype, op);
    }
  };
  auto store = std::make_shared<MemoryStore>();
  auto real = make_communicator(gloo_rank_options(0, 1, std::make_shared<PrefixStore>("comm", store), 5000ms));
  auto failing = std::make_unique<Failing>(*real);
  Failing* inner = failing.get();
  MonitorOptions mo;
  mo.rank = 0;
  mo.size = 1;
  mo.store = std::make_shared<PrefixStore>("monitor", store);
  mo.timeout = 5000ms;
  mo.poll_interval = 20ms;
  MonitoredCommunicator comm(std::move(failing), mo);
  CommBuffer buf(comm, 64 * sizeof(float));
  // Two that succeed, then three whose Work fails at once.
  for (int i = 0; i < 2; ++i) comm.allreduce(buf.get(), buf.get(), 64, DType::kFloat32, ReduceOp::kSum)->wait(5000ms);
  inner->fail = true;
  std::vector<std::shared_ptr<Work>> queued;
  for (int i = 0; i < 3; ++i)
    queued.push_back(comm.allreduce(buf.get(), buf.get(), 64, DType::kFloat32, ReduceOp::kSum));
  std::this_thread::sleep_for(200ms);  // ten watchdog polls
  CHECK(comm.state("test").last_completed == 2);
  // Waiting for the last names the first that failed.
  try {
    queued.back()->wait(5000ms);
    FAIL("the wait did not throw");
  } catch (const Error& e) {
    INFO(e.what());
    CHECK(contains(e.what(), "collective #3 all_reduce(float, 64, sum)"));
    CHECK(contains(e.what(), "waiting for collective #5, which runs after it"));
  }
}

TEST_CASE("monitored Gloo: no fault, no error; sequence numbers advance", "[monitor][gloo]") {
  auto res = run_monitored(2, "", 5, 5000ms);
  for (const auto& r : res) CHECK(r.error.empty());
}

TEST_CASE("monitored Gloo: a stalled rank is named as behind by every rank", "[monitor][gloo]") {
  const auto t0 = std::chrono::steady_clock::now();
  auto res = run_monitored(3, "hang@seq=3,rank=1", 6, 1500ms);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(took < 1.5 + 6);
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << res[r].error);
    CHECK(res[r].exit_code == static_cast<int>(ExitCode::kTimeout));
    CHECK(contains(res[r].error, "Rank 1 behind"));
    REQUIRE(res[r].report.is_object());
    CHECK(res[r].report["diagnosis"]["behind_ranks"] == nlohmann::json::array({1}));
  }
}

// More collectives queued than the flight recorder holds (32): the stuck one
// has left the recorder, yet it is still the one named, and what completed
// before it still counts as completed.
TEST_CASE("monitored Gloo: a stall behind a long queue names the stuck collective",
          "[monitor][gloo]") {
  auto res = run_monitored(2, "hang@seq=10,rank=1", 60, 1500ms, /*queue=*/true);
  INFO("rank 0: " << res[0].error);
  CHECK(res[0].exit_code == static_cast<int>(ExitCode::kTimeout));
  CHECK(contains(res[0].error, "collective #10 all_reduce(float, 64, sum) did not complete"));
  CHECK(contains(res[0].error, "waiting for collective #60, which runs after it"));
  REQUIRE(res[0].report.is_object());
  CHECK(res[0].report["diagnosis"]["stuck_seq"] == 10);
  bool seen = false;
  for (const auto& s : res[0].report["ranks"])
    if (s["rank"] == 0) {
      seen = true;
      CHECK(s["last_started_seq"] == 60);
      CHECK(s["last_completed_seq"] == 9);
      // After the abort, no queued collective reads as completed.
      for (const auto& e : s["flight_recorder"]) CHECK(e["state"] != "completed");
    }
  CHECK(seen);
}

TEST_CASE("monitored Gloo: a rank in another collective is named with both fingerprints",
          "[monitor][gloo]") {
  auto res = run_monitored(2, "desync@seq=2,rank=1", 4, 1500ms);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << res[r].error);
    CHECK(contains(res[r].error, "all_reduce(float, 64, sum)"));
    CHECK(contains(res[r].error, "broadcast(float, 64, root=0)"));
  }
}

// Gloo runs collectives on distinct buffers side by side, so a later one may
// complete first: waiting for it must not mark the earlier one completed in
// the flight recorder, nor move last_completed past it.
TEST_CASE("monitored Gloo: a later collective that completes first leaves the earlier one started",
          "[monitor][gloo]") {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::string> errors(2);
  std::atomic<int> exercised{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o = gloo_rank_options(r, 2, std::make_shared<PrefixStore>("comm", store), 20000ms);
        o.gloo_threads = 2;
        MonitorOptions mo;
        mo.rank = r;
        mo.size = 2;
        mo.store = std::make_shared<PrefixStore>("monitor", store);
        mo.timeout = 20000ms;
        mo.poll_interval = 1000ms;
        MonitoredCommunicator comm(make_communicator(o), mo);
        const std::size_t big_count = std::size_t{16} << 20;  // 64 MiB
        CommBuffer big(comm, big_count * sizeof(float));
        CommBuffer small(comm, sizeof(float));
        for (int attempt = 0; attempt < 3; ++attempt) {
          comm.barrier()->wait(20000ms);
          const std::int64_t before = comm.last_completed();
          auto large = comm.allreduce(big.get(), big.get(), big_count, DType::kFloat32, ReduceOp::kSum);
          const std::int64_t large_seq = comm.last_started();
          comm.allreduce(small.get(), small.get(), 1, DType::kFloat32, ReduceOp::kSum)->wait(20000ms);
          if (!large->is_completed()) {
            const auto st = comm.state("test");
            for (const auto& e : st.recent)
              if (e.seq == large_seq && e.state != "started")
                errors[r] += "the large collective is '" + e.state + "' while it runs; ";
            if (comm.last_completed() != before)
              errors[r] += "last_completed moved to " + std::to_string(comm.last_completed()) +
                           " past a running collective (" + std::to_string(before) + "); ";
            if (r == 0) exercised.fetch_add(1);
          }
          large->wait(20000ms);
          if (comm.last_completed() != large_seq + 1)
            errors[r] += "after both waits last_completed is " +
                         std::to_string(comm.last_completed()) + ", expected " +
                         std::to_string(large_seq + 1) + "; ";
        }
      } catch (const std::exception& e) {
        errors[r] += e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].empty());
  }
  CHECK(exercised.load() >= 1);  // the small one overtook at least once
}

TEST_CASE("sub-groups over the same store: two groups of a world of 3", "[monitor][gloo]") {
  auto store = std::make_shared<MemoryStore>();
  const int n = 3;
  std::vector<std::string> errors(n);
  std::vector<float> results(n, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o = gloo_rank_options(r, n, store, 5000ms);
        // Group A = {0, 2}, group B = {1} alone.
        std::vector<int> ranks = r == 1 ? std::vector<int>{1} : std::vector<int>{0, 2};
        auto comm = make_group_communicator(o, ranks, r == 1 ? "b" : "a");
        float v = static_cast<float>(r + 1);
        CommBuffer buf(*comm, sizeof v);
        comm->copy_from_host(buf.get(), &v, sizeof v);
        comm->allreduce(buf.get(), buf.get(), 1, DType::kFloat32, ReduceOp::kSum)->wait(5000ms);
        comm->copy_to_host(&v, buf.get(), sizeof v);
        results[r] = v;
        if (comm->size() != static_cast<int>(ranks.size())) errors[r] = "wrong size";
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) CHECK(errors[r].empty());
  CHECK(results[0] == 4.0f);
  CHECK(results[2] == 4.0f);
  CHECK(results[1] == 2.0f);

  CommOptions o;
  o.backend = Backend::kGloo;
  o.rank = 1;
  o.world_size = 3;
  o.store = store;
  CHECK_THROWS_AS(make_group_communicator(o, {0, 2}, "c"), UsageError);
}

namespace {

// A store whose set() of one key fails (a store call past its deadline)
// until a given time, as a stalled store looks to one rank's watchdog; or,
// `silent`, is dropped without a word, as a frozen process writes nothing.
class StallingStore : public Store {
 public:
  StallingStore(std::shared_ptr<Store> base, std::string stalled_key,
                std::chrono::steady_clock::time_point until, bool silent = false)
      : base_(std::move(base)), key_(std::move(stalled_key)), until_(until), silent_(silent) {}
  void set(const std::string& key, const Bytes& value) override {
    if (key == key_ && std::chrono::steady_clock::now() < until_) {
      ++refused;
      if (silent_) return;
      throw TimeoutError("the store at test did not answer SET within 1000 ms", {});
    }
    base_->set(key, value);
  }
  Bytes get(const std::string& key, Millis timeout) override { return base_->get(key, timeout); }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return base_->add(key, delta); }
  bool check(const std::vector<std::string>& keys) override { return base_->check(keys); }
  void wait(const std::vector<std::string>& keys, Millis timeout) override { base_->wait(keys, timeout); }
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return base_->compare_set(key, expected, desired);
  }
  bool delete_key(const std::string& key) override { return base_->delete_key(key); }
  std::int64_t num_keys() override { return base_->num_keys(); }
  std::atomic<int> refused{0};

 private:
  std::shared_ptr<Store> base_;
  std::string key_;
  std::chrono::steady_clock::time_point until_;
  bool silent_;
};

// Rank r of n over Gloo (its connections under "comm" in `store`), watched
// by a monitor whose watchdog talks to `monitor_store` (prefixed "monitor";
// null: no watchdog, so no heartbeat and no state, as a frozen rank). Every
// rank counts as on a machine of its own (host<i>, pid i + 1), so the
// heartbeat stall applies.
std::unique_ptr<MonitoredCommunicator> remote_rank(int r, int n, const std::shared_ptr<Store>& store,
                                                   const std::shared_ptr<Store>& monitor_store,
                                                   Millis timeout, Millis stall,
                                                   Millis gather_wait = 1500ms,
                                                   const std::string& store_address = "") {
  CommOptions o = gloo_rank_options(r, n, std::make_shared<PrefixStore>("comm", store), timeout);
  auto inner = make_communicator(o);
  inner->set_default_timeout(timeout);
  MonitorOptions mo;
  mo.rank = r;
  mo.size = n;
  if (monitor_store) mo.store = std::make_shared<PrefixStore>("monitor", monitor_store);
  mo.timeout = timeout;
  mo.gather_wait = gather_wait;
  mo.poll_interval = 100ms;
  mo.heartbeat_stall = stall;
  for (int i = 0; i < n; ++i) mo.peers.push_back({"host" + std::to_string(i), i + 1, i == r});
  mo.store_address = store_address;
  return std::make_unique<MonitoredCommunicator>(std::move(inner), mo);
}

}  // namespace

TEST_CASE("monitored Gloo: a rank whose store stalled once keeps its heartbeat, and no stall is "
          "raised against it",
          "[monitor][gloo]") {
  // Rank 1 "on another machine" loses its store for its first second
  // (heartbeat writes fail), then arrives 4 s late at an all_reduce. Rank 0
  // watches rank 1's heartbeat with a 3 s stall: the heartbeat must be back
  // (the watchdog retries where the store's host answers) before rank 0
  // would call rank 1 dead, so the all_reduce completes on both ranks.
  const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(listener >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 8) == 0);
  socklen_t len = sizeof a;
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  const std::string store_address = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));

  const Millis timeout = 20s;
  auto store = std::make_shared<MemoryStore>();
  auto stalling = std::make_shared<StallingStore>(store, "monitor/heartbeat/1",
                                                  std::chrono::steady_clock::now() + 1s);
  std::vector<std::string> errors(2);
  std::vector<bool> lost_at_end(2, true);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = remote_rank(r, 2, store, r == 1 ? std::shared_ptr<Store>(stalling) : store, timeout,
                             3s, 1500ms, store_address);
        auto& comm = *c;
        CommBuffer buf(comm, 64 * sizeof(float));
        if (r == 1) std::this_thread::sleep_for(4s);
        comm.allreduce(buf.get(), buf.get(), 64, DType::kFloat32, ReduceOp::kSum)->wait(timeout);
        lost_at_end[r] = comm.store_lost();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  ::close(listener);
  CHECK(stalling->refused.load() > 0);
  CHECK(errors[0] == "");
  CHECK(errors[1] == "");
  CHECK_FALSE(lost_at_end[1]);
}

TEST_CASE("monitored Gloo: a point-to-point op on a silent peer ends at the heartbeat stall, one "
          "on a late peer completes",
          "[monitor][gloo]") {
  // Rank 0 receives from rank 1 "on another machine", with a 2 s stall and a
  // 20 s deadline. Frozen: rank 1 writes no heartbeat and never sends; rank
  // 0's recv must end after about 2 s of silence, naming rank 1 and the op.
  // Late: rank 1's heartbeat moves and it sends after 3.5 s; the recv
  // completes (a slow partner is not a silent one).
  const bool frozen = GENERATE(true, false);
  CAPTURE(frozen);
  const Millis timeout = 20s;
  auto store = std::make_shared<MemoryStore>();
  auto muted = std::make_shared<StallingStore>(
      store, "monitor/heartbeat/1",
      frozen ? std::chrono::steady_clock::now() + 1h : std::chrono::steady_clock::now(),
      /*silent=*/true);
  std::vector<std::string> errors(2);
  double took = 0;
  std::atomic<bool> done{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = remote_rank(r, 2, store, r == 1 ? std::shared_ptr<Store>(muted) : store, timeout, 2s);
        auto& comm = *c;
        CommBuffer buf(comm, 64 * sizeof(float));
        if (r == 0) {
          const auto t0 = std::chrono::steady_clock::now();
          try {
            comm.recv(buf.get(), 64, DType::kFloat32, 1, 7)->wait(timeout);
          } catch (const std::exception& e) {
            errors[0] = e.what();
          }
          took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          done = true;
        } else if (frozen) {
          while (!done) std::this_thread::sleep_for(50ms);
        } else {
          std::this_thread::sleep_for(3500ms);
          comm.send(buf.get(), 64, DType::kFloat32, 0, 7)->wait(timeout);
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
        done = true;
      }
    });
  for (auto& t : threads) t.join();
  CHECK(errors[1] == "");
  if (frozen) {
    // 2 s of silence, read at polls that a loaded machine may delay.
    CHECK(std::regex_search(errors[0], std::regex("point-to-point op recv\\(float, 64, peer=1\\) cannot "
                                                  "complete: rank 1 \\(pid 2 on host host1\\) wrote no "
                                                  "heartbeat for [234] s")));
    CHECK(took < 8);
  } else {
    CHECK(errors[0] == "");
    CHECK(took > 3);
  }
}

namespace {

// Three remote ranks on one store; rank 2 has no watchdog (no heartbeat, no
// state: as if frozen or killed) and does nothing. act(r, comm) runs on
// ranks 0 and 1, which wait for each other before they close; returns what
// each rank threw ("" for none).
std::vector<std::string> with_rank2_silent(const std::shared_ptr<MemoryStore>& store,
                                           const std::function<void(int, MonitoredCommunicator&)>& act) {
  const Millis timeout = 20s;
  std::vector<std::string> errors(3);
  std::atomic<int> finished{0};
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = remote_rank(r, 3, store, r != 2 ? store : nullptr, timeout, 0ms, 1000ms);
        try {
          if (r != 2) act(r, *c);
        } catch (const Error& e) {
          errors[r] = e.what();
        }
        ++finished;
        while (finished < 2) std::this_thread::sleep_for(20ms);
      } catch (const std::exception& e) {
        errors[r] = std::string("setup: ") + e.what();
        ++finished;
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("monitored Gloo: a connection closed by a rank that published its state does not make "
          "a silent rank dead",
          "[monitor][gloo]") {
  // Rank 0 fails first (its watchdog found rank 2 silent) and stops, closing
  // its connections; rank 1 then fails on "rank 0 ... reset by peer". Rank 0
  // published its state, so that reset was its own stop: rank 2, silent on
  // another host whose address answers, is frozen, not dead.
  auto store = std::make_shared<MemoryStore>();
  const auto errors = with_rank2_silent(store, [&](int r, MonitoredCommunicator& comm) {
    if (r == 0) {
      comm.fail(1, TimeoutError("rank 2 wrote no new heartbeat (test)", ErrorContext{"all_reduce", 0, 2}));
    } else {
      while (!store->check({"monitor/state/0"})) std::this_thread::sleep_for(20ms);
      comm.fail(1, PeerError("all_reduce on rank 1 failed: rank 0 closed its connection or "
                             "failed (gloo: Read error: Connection reset by peer)",
                             ErrorContext{"all_reduce", 1, 0}));
    }
  });
  CHECK(errors[2] == "");
  CHECK(contains(errors[1], "Rank 2 did not publish its state: it is silent"));
  CHECK_FALSE(contains(errors[1], "it is dead"));
}

TEST_CASE("monitored Gloo: a rank stopped by the alarm learns of a reset another rank met",
          "[monitor][gloo]") {
  // Rank 2 is killed on its host, whose kernel resets the connections. Rank
  // 1 meets the reset ("rank 2 ... reset by peer"), publishes its state and
  // raises the alarm; rank 0, stopped by that alarm before it met the reset
  // itself, must still call rank 2 dead (its host answered for it), not
  // silent, frozen or unreachable: it reads the reset from rank 1's state.
  auto store = std::make_shared<MemoryStore>();
  const auto errors = with_rank2_silent(store, [&](int r, MonitoredCommunicator& comm) {
    if (r == 1) {
      comm.fail(1, PeerError("all_reduce on rank 1 failed: rank 2 closed its connection or "
                             "failed (gloo: Read error: Connection reset by peer)",
                             ErrorContext{"all_reduce", 1, 2}));
    } else {
      while (!store->check({"monitor/state/1"})) std::this_thread::sleep_for(20ms);
      comm.fail(1, PeerError("all_reduce on rank 0 failed: the communicator was aborted",
                             ErrorContext{"all_reduce", 0, -1}));
    }
  });
  CHECK(errors[2] == "");
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r, errors[r]);
    CHECK(contains(errors[r], "Rank 2 did not publish its state: it is dead"));
    CHECK(contains(errors[r], "closed or reset the connection to it"));
    CHECK_FALSE(contains(errors[r], "it is silent"));
    CHECK_FALSE(contains(errors[r], "unreachable"));
  }
  auto state1 = nlohmann::json::parse(to_string(store->get("monitor/state/1", 1000ms)));
  CHECK(state1["connection_reset_by"] == 2);
  auto state0 = nlohmann::json::parse(to_string(store->get("monitor/state/0", 1000ms)));
  CHECK_FALSE(state0.contains("connection_reset_by"));
}

TEST_CASE("monitored Gloo: a stop of a rank on this machine counts from when it is seen, not from "
          "an earlier pause",
          "[monitor][gloo]") {
  // Rank 1's process, as rank 0 sees it, is a child stopped with SIGSTOP
  // (rank 1 itself is a thread here). Op A: the child is stopped while rank
  // 1 comes 0.6 s late, and stays stopped after A completes; it runs again
  // for 4 s, and is stopped again when op B starts, rank 1 again 0.6 s late.
  // With a 3 s stall neither op may end: B's stop is 0.6 s old, not as old
  // as A's (5 s). Then op C: stopped while rank 1 is 5 s late; C ends at the
  // stall. (The margins allow for a busy machine's late threads.)
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::pause();
    ::_exit(0);
  }
  const Millis timeout = 20s;
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::string> errors(2);
  std::vector<int> completed(2, 0);
  std::vector<std::thread> threads;
  const auto stop = [&] { ::kill(child, SIGSTOP); };
  const auto cont = [&] { ::kill(child, SIGCONT); };
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o = gloo_rank_options(r, 2, std::make_shared<PrefixStore>("comm", store), timeout);
        auto inner = make_communicator(o);
        inner->set_default_timeout(timeout);
        MonitorOptions mo;
        mo.rank = r;
        mo.size = 2;
        mo.store = std::make_shared<PrefixStore>("monitor", store);
        mo.timeout = timeout;
        mo.gather_wait = 1000ms;
        mo.poll_interval = 100ms;
        mo.heartbeat_stall = 3000ms;
        mo.peers = {{"host", static_cast<long>(::getpid()), true},
                    {"host", r == 0 ? static_cast<long>(child) : static_cast<long>(::getpid()), true}};
        MonitoredCommunicator comm(std::move(inner), mo);
        CommBuffer buf(comm, 64 * sizeof(float));
        const auto op = [&] {
          comm.allreduce(buf.get(), buf.get(), 64, DType::kFloat32, ReduceOp::kSum)->wait(timeout);
          ++completed[r];
        };
        if (r == 1) {
          stop();
          std::this_thread::sleep_for(600ms);
          op();  // A
          std::this_thread::sleep_for(400ms);
          cont();
          std::this_thread::sleep_for(4000ms);
          stop();
          std::this_thread::sleep_for(600ms);
          op();  // B
          cont();
          std::this_thread::sleep_for(500ms);
          stop();
          std::this_thread::sleep_for(5000ms);
          op();  // C
        } else {
          op();  // A
          std::this_thread::sleep_for(4400ms);  // no op open while rank 1 runs again
          op();  // B
          op();  // C
        }
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  CHECK(completed[0] == 2);
  CHECK(contains(errors[0], "collective #3 all_reduce(float, 64, sum) cannot complete: rank 1 (pid " +
                                std::to_string(child) + " on this machine) has been stopped for "));
}

TEST_CASE("a peer whose /proc stat ends while it is read reads as gone and not as an error", "[monitor]") {
  // This process: its stat names its own pid and a live state.
  const std::string self = read_proc_stat(static_cast<long>(getpid()));
  REQUIRE(self.rfind(std::to_string(getpid()) + " (", 0) == 0);
  REQUIRE_FALSE(process_gone(static_cast<long>(getpid())));

  // Children reaped by another thread while this one reads their stat (as a
  // launcher reaps a killed rank while a peer checks on it): a read after
  // the open then fails with ESRCH. Each read gives the text or "", never
  // an exception; the race is hit in a good share of these rounds.
  for (int i = 0; i < 300; ++i) {
    const pid_t child = fork();
    REQUIRE(child >= 0);
    if (child == 0) {
      usleep(100);
      _exit(0);
    }
    std::thread reaper([child] { waitpid(child, nullptr, 0); });
    bool threw = false;
    for (int spin = 0; spin < 1000000; ++spin) {
      std::string text;
      try {
        text = read_proc_stat(static_cast<long>(child));
      } catch (...) {
        threw = true;
      }
      if (threw || text.empty()) break;
    }
    reaper.join();
    REQUIRE_FALSE(threw);
    CHECK(read_proc_stat(static_cast<long>(child)).empty());
    CHECK(process_state(static_cast<long>(child)) == 0);
    CHECK(process_gone(static_cast<long>(child)));
  }
}
