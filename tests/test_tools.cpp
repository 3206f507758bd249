// The diagnostic tools' pure parts (pair schedule, outlier rule, NCCL
// transport parse, bucket-cap recommendation, imbalance rule, /proc parse,
// traffic theory) and the send/recv algorithms on Gloo ranks as threads:
// exact results, bytes equal to theory, scratch peak equal to theory.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "comm/algorithms/gather_reduce.h"
#include "comm/algorithms/ring_allreduce.h"
#include "comm/communicator.h"
#include "comm/measure.h"
#include "comm/memory.h"
#include "comm/store/store.h"
#include "diag/tools_analysis.h"
#include "diag/tools_common.h"
#include "tests/forwarding_communicator.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using namespace ddpdiag::cli::tools;
using namespace std::chrono_literals;
namespace alg = ddpdiag::algorithms;

TEST_CASE("sweep_sizes: ends at max_bytes even next to 2^64", "[tools]") {
  using V = std::vector<std::size_t>;
  CHECK(sweep_sizes(16, 64, 2, 0, 4) == V{16, 32, 64});
  CHECK(sweep_sizes(8, 20, 1, 4, 1) == V{8, 12, 16, 20});
  CHECK(sweep_sizes(64, 16, 2, 0, 4).empty());
  // Near the top of 64 bits the next size would wrap around to a small one
  // and the sweep would never end.
  constexpr std::size_t top = ~std::size_t{0};
  const V by_factor = sweep_sizes(std::size_t{1} << 62, top, 4, 0, 1);
  CHECK(by_factor == V{std::size_t{1} << 62});
  const V by_step = sweep_sizes(top - 10, top, 1, 8, 1);
  CHECK(by_step == V{top - 10, top - 2});
  CHECK(sweep_sizes(top, top, 4, 0, 1) == V{top});
}

TEST_CASE("round_robin_schedule: every pair once, each rank once per round", "[tools]") {
  const int n = GENERATE(2, 3, 4, 5, 7, 8, 16);
  const auto rounds = round_robin_schedule(n);
  CHECK(rounds.size() == static_cast<std::size_t>(n % 2 ? n : n - 1));
  std::set<std::pair<int, int>> seen;
  for (const auto& round : rounds) {
    std::set<int> busy;
    CHECK(round.size() == static_cast<std::size_t>(n / 2));
    for (auto [a, b] : round) {
      CHECK(a < b);
      CHECK(a >= 0);
      CHECK(b < n);
      CHECK(busy.insert(a).second);
      CHECK(busy.insert(b).second);
      CHECK(seen.insert({a, b}).second);
    }
  }
  CHECK(seen.size() == static_cast<std::size_t>(n * (n - 1) / 2));
  CHECK(round_robin_schedule(1).empty());
  CHECK(round_robin_schedule(0).empty());
}

TEST_CASE("judge_pairs: outliers against the median of the same kind", "[tools]") {
  LinkThresholds t;  // 50% below the median bandwidth; latency 300% above and 100 us
  std::vector<PairMeasurement> p = {
      {0, 1, true, 10.0, 5}, {0, 2, false, 1.0, 50}, {1, 2, false, 1.1, 55},
      {0, 3, false, 0.2, 52}, {1, 3, false, 1.05, 500}, {2, 3, true, 9.0, 6}};
  const auto j = judge_pairs(p, t);
  REQUIRE(j.size() == p.size());
  // Same-host pairs are only compared with each other: 9 vs 10 is fine.
  CHECK_FALSE(j[0].slow());
  CHECK_FALSE(j[5].slow());
  CHECK(j[0].kind_pairs == 2);
  // Cross host: median bandwidth of {1.0, 1.1, 0.2, 1.05} = 1.025.
  CHECK(j[1].kind_median_bandwidth_gbps == Approx(1.025));
  CHECK_FALSE(j[1].slow());
  CHECK(j[3].slow_bandwidth);
  CHECK(j[3].reason.find("below the median") != std::string::npos);
  // Latency 500 us against a median of 53.5 us: slow.
  CHECK(j[4].slow_latency);
  CHECK_FALSE(j[4].slow_bandwidth);

  SECTION("one pair of a kind has nothing to compare with") {
    const auto one = judge_pairs({{0, 1, true, 0.001, 1e6}}, t);
    CHECK_FALSE(one[0].slow());
  }
  SECTION("one slow host of three: its two pairs are the median, its own best names it") {
    // Host 1's link is ~100x slower: pairs 0-1 and 1-2 are slow, 0-2 is
    // fast, so the median of the three is a slow pair's.
    const auto j3 = judge_pairs({{0, 1, false, 0.006, 99}, {0, 2, false, 0.666, 97},
                                 {1, 2, false, 0.005, 57}}, t);
    CHECK(j3[0].slow_bandwidth);
    CHECK(j3[2].slow_bandwidth);
    CHECK_FALSE(j3[1].slow());
    CHECK(j3[0].reason.find("every cross-host link of rank 1 is slow") != std::string::npos);
  }
  SECTION("a slow host of two ranks among three hosts is named by host") {
    // Ranks 1 and 2 share host b, whose link is slow; a and c have one rank
    // each. The cross-host pairs: 0-1, 0-2, 1-3, 2-3 slow, 0-3 fast; the
    // median of all five is slow and each of ranks 1, 2 keeps the other's
    // slow pairs in "the pairs without it", so only the host rule sees it.
    auto m = [](int a, int b, const char* ha, const char* hb, double bw) {
      PairMeasurement p{a, b, std::string(ha) == hb, bw, 50};
      p.host_a = ha;
      p.host_b = hb;
      return p;
    };
    const std::vector<PairMeasurement> p = {m(0, 1, "a", "b", 0.003), m(0, 2, "a", "b", 0.006),
                                            m(0, 3, "a", "c", 1.138), m(1, 2, "b", "b", 1.306),
                                            m(1, 3, "b", "c", 0.003), m(2, 3, "b", "c", 0.003)};
    const auto j = judge_pairs(p, t);
    for (const int i : {0, 1, 4, 5}) {
      CHECK(j[i].slow_bandwidth);
      CHECK(j[i].reason.find("every cross-host link of host b (ranks 1, 2) is slow") != std::string::npos);
    }
    CHECK_FALSE(j[2].slow());  // a-c, the healthy link
    CHECK_FALSE(j[3].slow());  // 1-2 within host b
    // Without the host names the ranks alone cannot tell (what it did before).
    std::vector<PairMeasurement> anon = p;
    for (auto& q : anon) q.host_a = q.host_b = "";
    for (const auto& jj : judge_pairs(anon, t)) CHECK_FALSE(jj.slow());
  }
  SECTION("one slow pair of three hosts flags that pair alone") {
    // Only 0-2 is slow: ranks 0 and 2 each have a fast pair, so neither is
    // taken for a slow host.
    const auto j3 = judge_pairs({{0, 1, false, 1.0, 50}, {0, 2, false, 0.1, 50},
                                 {1, 2, false, 0.95, 50}}, t);
    CHECK_FALSE(j3[0].slow());
    CHECK(j3[1].slow_bandwidth);
    CHECK_FALSE(j3[2].slow());
  }
  SECTION("absolute limits") {
    LinkThresholds abs;
    abs.min_bandwidth_gbps = 5;
    abs.max_latency_us = 10;
    const auto one = judge_pairs({{0, 1, true, 1, 20}}, abs);
    CHECK(one[0].slow_bandwidth);
    CHECK(one[0].slow_latency);
  }
  SECTION("latency jitter under the floor does not count") {
    const auto j2 = judge_pairs({{0, 1, true, 1, 10}, {0, 2, true, 1, 10}, {1, 2, true, 1, 90}}, t);
    CHECK_FALSE(j2[2].slow());
  }
  SECTION("links all slow alike: only the share of the link finds them") {
    // Three cross-host pairs at 0.5 GB/s over 25 Gb/s links (3.125 GB/s):
    // 16% each, so no median flags them.
    std::vector<PairMeasurement> alike = {{0, 1, false, 0.5, 20, 25000},
                                          {0, 2, false, 0.5, 20, 25000},
                                          {1, 2, false, 0.5, 20, 0},      // a speed unknown
                                          {2, 3, true, 0.1, 20, 25000}};  // same host: not a link
    for (const auto& j2 : judge_pairs(alike, t)) CHECK_FALSE(j2.slow());
    LinkThresholds share = t;
    share.min_link_pct = 50;
    const auto j2 = judge_pairs(alike, share);
    CHECK(j2[0].slow_bandwidth);
    CHECK(j2[1].slow_bandwidth);
    CHECK_FALSE(j2[2].slow());
    CHECK_FALSE(j2[3].slow());
    CHECK_THAT(j2[0].reason, Catch::Contains("bandwidth 0.5 GB/s is 16% of its 25 Gb/s link (3.125 GB/s), "
                                             "under 50%"));
    share.min_link_pct = 10;
    for (const auto& j3 : judge_pairs(alike, share)) CHECK_FALSE(j3.slow());
  }
}

TEST_CASE("parse_nccl_transports: NCCL INFO channel lines", "[tools]") {
  const std::string log =
      "node1:123:456 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>\n"
      "node1:123:456 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
      "node1:123:456 [0] NCCL INFO Channel 01/0 : 0[0] -> 2[0] [send] via NET/IB/0/GDRDMA\n"
      "node1:123:456 [0] NCCL INFO Channel 00/0 : 3[3] -> 0[0] [receive] via NET/Socket/1\n"
      "node1:123:456 [0] NCCL INFO Channel 02/1 : 0[0] -> 4[4] via SHM/direct/direct\n"
      "node1:123:456 [0] NCCL INFO Connected all rings\n";
  const auto t = parse_nccl_transports(log);
  REQUIRE(t.size() == 4);
  CHECK(t[0].src == 0);
  CHECK(t[0].dst == 1);
  CHECK(t[0].transport == "P2P");
  CHECK(t[0].via == "P2P/CUMEM/read");
  CHECK(t[1].dst == 2);
  CHECK(t[1].transport == "NET/IB");
  CHECK(t[2].src == 3);
  CHECK(t[2].transport == "NET/Socket");
  CHECK(t[3].transport == "SHM");
  CHECK(classify_transport("NVLS") == "NVLS");
  CHECK(parse_nccl_transports("garbage -> via\n").empty());
}

TEST_CASE("recommend_cap: least exposed time, ties to the default then the smaller", "[tools]") {
  auto r = recommend_cap({{1, 300}, {5, 200}, {25, 250}, {100, 400}});
  REQUIRE(r);
  CHECK(r->bucket_cap_mb == 5);
  CHECK(r->exposed_comm_time_us == 200);
  REQUIRE(r->saving_us);
  CHECK(*r->saving_us == 50);
  CHECK(*r->saving_pct == Approx(20));
  auto tie = recommend_cap({{50, 100}, {25, 100}, {10, 100}});
  CHECK(tie->bucket_cap_mb == 25);
  CHECK(*tie->saving_us == 0);
  auto tie2 = recommend_cap({{50, 100}, {10, 100}});
  CHECK(tie2->bucket_cap_mb == 10);
  CHECK_FALSE(tie2->saving_us);
  CHECK_FALSE(recommend_cap({}));
}

TEST_CASE("recommend_cap: torch 2.x's bucket_cap_mb_list candidates", "[tools]") {
  // A list whose largest is 25 is no default: the plain 25 is.
  auto r = recommend_cap({{5, 200}, {25, 250}, {25, 150, {1, 4, 25}}});
  REQUIRE(r);
  CHECK(r->cap_list == std::vector<double>{1, 4, 25});
  CHECK(r->bucket_cap_mb == 25);
  REQUIRE(r->saving_us);
  CHECK(*r->saving_us == 100);  // against the plain 25
  CHECK(recommended_setting(*r) == "bucket_cap_mb_list=[1, 4, 25]");
  CHECK(recommendation_json(*r, 25)["bucket_cap_mb_list"] == nlohmann::json({1, 4, 25}));
  // Ties: the default, then a plain cap before a list.
  auto tie = recommend_cap({{25, 100, {1, 25}}, {25, 100}});
  CHECK(tie->cap_list.empty());
  CHECK(recommended_setting(*tie) == "bucket_cap_mb=25");
  auto tie2 = recommend_cap({{10, 100, {1, 10}}, {50, 100}});
  CHECK(tie2->cap_list.empty());
  CHECK(tie2->bucket_cap_mb == 50);
  CHECK_FALSE(tie2->saving_us);
  CHECK_FALSE(recommendation_json(*tie2, 25).contains("bucket_cap_mb_list"));
}

TEST_CASE("ranks_above_median: the classic rank 0 uses more", "[tools]") {
  CHECK(ranks_above_median({130, 100, 101, 99}, 10) == std::vector<int>{0});
  CHECK(ranks_above_median({100, 105, 109}, 10).empty());
  CHECK(ranks_above_median({}, 10).empty());
  // Judged against the others, not a median that holds the rank itself: at
  // two ranks that median is the mean, and a rank 18% above the other was
  // only 8% above it.
  CHECK(ranks_above_median({26.33, 22.33}, 10) == std::vector<int>{0});
  CHECK(ranks_above_median({22.33, 26.33}, 10) == std::vector<int>{1});
  CHECK(ranks_above_median({105, 100}, 10).empty());
  CHECK(ranks_above_median({500}, 10).empty());
  CHECK(median_of_others({130, 100, 101, 99}, 0) == 100);
  CHECK(median_of_others({130, 100, 101, 99}, 1) == 101);
}

TEST_CASE("parse_proc_status: VmRSS and VmHWM in bytes", "[tools]") {
  auto m = parse_proc_status("Name:\tx\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n");
  REQUIRE(m);
  CHECK(m->rss_bytes == 1024 * 1024);
  CHECK(m->peak_rss_bytes == 2048 * 1024);
  CHECK_FALSE(parse_proc_status("VmRSS:\t1 kB\n"));
  auto self = read_process_memory();
  REQUIRE(self);
  CHECK(self->rss_bytes > 0);
  CHECK(self->peak_rss_bytes >= self->rss_bytes);
}

namespace {
void write_file(const std::filesystem::path& p, const std::string& text) {
  std::filesystem::create_directories(p.parent_path());
  std::ofstream(p) << text;
}
}  // namespace

TEST_CASE("host_memory_available: MemAvailable, lowered by the tightest cgroup limit on the path",
          "[tools]") {
  const auto root = std::filesystem::temp_directory_path() /
                    ("ddpdiag-mem-" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  const auto proc = root / "proc", cg = root / "cg";
  const std::uint64_t gib = 1ULL << 30;
  write_file(proc / "meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20971520 kB\n");
  SECTION("no cgroup limit: MemAvailable") {
    write_file(proc / "self/cgroup", "0::/job\n");
    write_file(cg / "job/memory.max", "max\n");
    write_file(cg / "job/memory.current", "1000\n");
    auto m = host_memory_available(proc.string(), cg.string());
    REQUIRE(m);
    CHECK(m->bytes == 20 * gib);
    CHECK(m->source == "MemAvailable");
  }
  SECTION("cgroup v2: a parent's limit binds") {
    write_file(proc / "self/cgroup", "0::/a/b\n");
    write_file(cg / "a/b/memory.max", "max\n");
    write_file(cg / "a/b/memory.current", "0\n");
    write_file(cg / "a/memory.max", std::to_string(3 * gib) + "\n");
    // 1.5 GiB used, of which 0.5 GiB inactive page cache: 1 GiB counts.
    write_file(cg / "a/memory.current", std::to_string(gib + gib / 2) + "\n");
    write_file(cg / "a/memory.stat", "anon 1\nfile 2\ninactive_file " + std::to_string(gib / 2) + "\n");
    auto m = host_memory_available(proc.string(), cg.string());
    REQUIRE(m);
    CHECK(m->bytes == 2 * gib);
    CHECK(m->source == "the limit of cgroup /a");
  }
  SECTION("cgroup v1: the memory controller's limit; no limit is a huge number") {
    write_file(proc / "self/cgroup", "5:cpu,cpuacct:/x\n4:memory:/job\n");
    write_file(cg / "memory/job/memory.limit_in_bytes", std::to_string(3 * gib) + "\n");
    write_file(cg / "memory/job/memory.usage_in_bytes", std::to_string(gib) + "\n");
    write_file(cg / "memory/job/memory.stat",
               "cache 5\ninactive_file 7\ntotal_inactive_file " + std::to_string(gib / 2) + "\n");
    write_file(cg / "memory/memory.limit_in_bytes", "9223372036854771712\n");
    write_file(cg / "memory/memory.usage_in_bytes", "123\n");
    auto m = host_memory_available(proc.string(), cg.string());
    REQUIRE(m);
    CHECK(m->bytes == 3 * gib - gib / 2);
    CHECK(m->source == "the limit of cgroup /job");
  }
  SECTION("nothing readable") {
    CHECK_FALSE(host_memory_available((root / "none").string(), (root / "none").string()));
  }
  std::filesystem::remove_all(root);
}

TEST_CASE("traffic theory: gather root 2(n-1)S, ring exactly 2(n-1)/n S", "[tools]") {
  auto g = alg::gather_reduce_theory(4, 0, 0, 1000);
  CHECK(g.bytes_sent + g.bytes_received == 2 * 3 * 1000);
  CHECK(g.extra_bytes == 3000);
  auto g1 = alg::gather_reduce_theory(4, 2, 0, 1000);
  CHECK(g1.bytes_sent == 1000);
  CHECK(g1.extra_bytes == 0);
  for (int n : {2, 3, 4, 8}) {
    const std::size_t count = 1024 * static_cast<std::size_t>(n);
    std::uint64_t sum = 0;
    for (int r = 0; r < n; ++r) {
      auto t = alg::ring_allreduce_theory(count, 4, n, r);
      CHECK(static_cast<double>(t.bytes_sent) == alg::ring_nominal_bytes(count * 4, n));
      CHECK(t.extra_bytes == count * 4 / n);
    }
    // Not divisible: every rank within two elements, the sum exact.
    for (int r = 0; r < n; ++r) sum += alg::ring_allreduce_theory(count + 1, 4, n, r).bytes_sent;
    CHECK(sum == 2ull * (n - 1) * (count + 1) * 4);
  }
  // Chunks tile the buffer.
  std::size_t next = 0;
  for (int c = 0; c < 5; ++c) {
    auto ch = alg::ring_chunk(13, 5, c);
    CHECK(ch.offset == next);
    next += ch.count;
  }
  CHECK(next == 13);
}

namespace {

// Runs body on n Gloo ranks (threads); returns the failures.
std::vector<std::string> on_ranks(int n, const std::function<void(Communicator&, std::vector<std::string>&)>& body) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<std::vector<std::string>> fails(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o = ddpdiag::testing::gloo_rank_options(r, n, store, 20s);
        auto comm = make_communicator(o);
        body(*comm, fails[static_cast<std::size_t>(r)]);
      } catch (const std::exception& e) {
        fails[static_cast<std::size_t>(r)].push_back("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  for (auto& t : threads) t.join();
  std::vector<std::string> all;
  for (auto& f : fails) all.insert(all.end(), f.begin(), f.end());
  return all;
}

}  // namespace

namespace {

// Every rank's exact inputs, as doubles (float64) for n ranks.
std::vector<std::vector<double>> inputs_of(ReduceOp op, int n, std::size_t count) {
  std::vector<std::vector<double>> in(n, std::vector<double>(count));
  for (int r = 0; r < n; ++r) fill_exact_inputs(DType::kFloat64, op, n, r, in[r].data(), count);
  return in;
}

// What op computes over the ranks' inputs, elementwise.
std::vector<double> reduce_as(ReduceOp op, const std::vector<std::vector<double>>& in) {
  const int n = static_cast<int>(in.size());
  std::vector<double> out = in[0];
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (int r = 1; r < n; ++r) {
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: out[i] += in[r][i]; break;
        case ReduceOp::kProd: out[i] *= in[r][i]; break;
        case ReduceOp::kMin: out[i] = std::min(out[i], in[r][i]); break;
        case ReduceOp::kMax: out[i] = std::max(out[i], in[r][i]); break;
      }
    }
    if (op == ReduceOp::kAvg) out[i] /= n;
  }
  return out;
}

}  // namespace

TEST_CASE("exact inputs: the check tells every op from the others and from doing nothing",
          "[tools][measure]") {
  // An all_reduce that leaves a rank's buffer as it was, or computes another
  // op (a backend that maps prod to max, an avg that does not divide), must
  // give wrong elements on every rank: the inputs differ from rank to rank.
  const int n = GENERATE(2, 3, 4, 5, 8, 16);
  const std::size_t count = 60;
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMin,
                          ReduceOp::kMax};
  for (ReduceOp op : ops) {
    INFO("n=" << n << " op=" << reduce_op_name(op));
    const auto in = inputs_of(op, n, count);
    const auto right = reduce_as(op, in);
    CHECK(count_wrong_allreduce(DType::kFloat64, op, n, right.data(), count) == 0);
    for (int r = 0; r < n; ++r)
      CHECK(count_wrong_allreduce(DType::kFloat64, op, n, in[r].data(), count) > 0);
    for (ReduceOp other : ops) {
      if (other == op) continue;
      INFO("computed as " << reduce_op_name(other));
      const auto wrong = reduce_as(other, in);
      CHECK(count_wrong_allreduce(DType::kFloat64, op, n, wrong.data(), count) > 0);
    }
  }
}

TEST_CASE("exact inputs: the first wrong element is named with its value and the expected one",
          "[tools][measure]") {
  const int n = 3;
  const std::size_t count = 200000;  // more than one chunk of the comparison
  const auto in = inputs_of(ReduceOp::kSum, n, count);
  auto got = reduce_as(ReduceOp::kSum, in);
  auto w = find_wrong_allreduce(DType::kFloat64, ReduceOp::kSum, n, got.data(), count);
  CHECK(w.count == 0);
  CHECK(w.first == -1);
  const double right_70000 = got[70000];
  got[70000] += 1;
  got[150000] = std::nan("");
  got[199999] -= 2;
  w = find_wrong_allreduce(DType::kFloat64, ReduceOp::kSum, n, got.data(), count);
  CHECK(w.count == 3);
  CHECK(w.first == 70000);
  CHECK(w.got == right_70000 + 1);
  CHECK(w.expected == right_70000);
  CHECK(count_wrong_allreduce(DType::kFloat64, ReduceOp::kSum, n, got.data(), count) == 3);
  // NCCL's pre-multiplied average (tolerant path) names its first one too.
  auto avg = reduce_as(ReduceOp::kAvg, inputs_of(ReduceOp::kAvg, n, 100));
  avg[42] *= 2;
  w = find_wrong_allreduce(DType::kFloat64, ReduceOp::kAvg, n, avg.data(), 100,
                           AvgRounding::kPreMultiplied);
  CHECK(w.count == 1);
  CHECK(w.first == 42);
  CHECK(w.got == 2 * w.expected);
}

TEST_CASE("exact inputs: a reduction that takes one rank's data in place of another's is caught",
          "[tools][measure]") {
  // A backend (or a ring of ours) that reads the wrong peer's chunk counts
  // one rank twice and another never. No two ranks' inputs may be alike, at
  // any world size, or that passes (with (i + r) % 3 it did for ranks r and
  // r + 3).
  const int n = GENERATE(2, 3, 4, 7, 8, 18, 64);
  const ReduceOp op = GENERATE(ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kProd, ReduceOp::kMin,
                               ReduceOp::kMax);
  const std::size_t count = 2048;
  const auto in = inputs_of(op, n, count);
  for (int lost = 0; lost < n; ++lost)
    for (int step : {1, 3, 17}) {  // periods a simple pattern could have
      const int twice = (lost + step) % n;
      if (twice == lost) continue;
      INFO("n=" << n << " op=" << reduce_op_name(op) << " rank " << lost << "'s data replaced by rank "
                << twice << "'s");
      auto swapped = in;
      swapped[lost] = in[twice];
      const auto wrong = reduce_as(op, swapped);
      CHECK(count_wrong_allreduce(DType::kFloat64, op, n, wrong.data(), count) > 0);
    }
}

TEST_CASE("exact inputs: NCCL's pre-multiplied average passes, anything else is still caught",
          "[tools][measure]") {
  // ncclAvg on a floating dtype: each input times 1/n rounded to the dtype,
  // each product rounded, then summed in the ring's order (here: every
  // rotation of the ranks, as a ring's chunks take them), each sum rounded.
  const int n = GENERATE(3, 5, 6, 7, 12, 24);
  const DType dtype = GENERATE(DType::kFloat32, DType::kBFloat16, DType::kFloat16);
  const std::size_t count = 96;
  const std::size_t es = dtype_size(dtype);
  INFO("n=" << n << " dtype=" << dtype_name(dtype));
  auto round_to = [&](double v) {
    std::uint64_t b = 0;
    store_from_double(dtype, &b, 0, v);
    return load_as_double(dtype, &b, 0);
  };
  std::vector<std::vector<std::uint8_t>> in(n, std::vector<std::uint8_t>(count * es));
  for (int r = 0; r < n; ++r) fill_exact_inputs(dtype, ReduceOp::kAvg, n, r, in[r].data(), count);
  const double scale = round_to(1.0 / n);
  std::vector<std::uint8_t> got(count * es);
  for (std::size_t i = 0; i < count; ++i) {
    const int first = static_cast<int>(i % static_cast<std::size_t>(n));
    double acc = 0;
    for (int k = 0; k < n; ++k) {
      const int r = (first + k) % n;
      acc = round_to(acc + round_to(load_as_double(dtype, in[r].data(), i) * scale));
    }
    store_from_double(dtype, got.data(), i, acc);
  }
  // The emulation is inexact somewhere (else the case proves nothing; for
  // half at 5 and 6 ranks these orders happen to round back exactly)...
  if (!(dtype == DType::kFloat16 && (n == 5 || n == 6)))
    CHECK(count_wrong_allreduce(dtype, ReduceOp::kAvg, n, got.data(), count) > 0);
  // ...and within the bound everywhere.
  CHECK(count_wrong_allreduce(dtype, ReduceOp::kAvg, n, got.data(), count, AvgRounding::kPreMultiplied) == 0);
  // A rank's buffer left as it was, or a sum not divided, is still wrong.
  for (int r = 0; r < n; ++r)
    CHECK(count_wrong_allreduce(dtype, ReduceOp::kAvg, n, in[r].data(), count, AvgRounding::kPreMultiplied) > 0);
  std::vector<std::uint8_t> sum(count * es);
  for (std::size_t i = 0; i < count; ++i) {
    double acc = 0;
    for (int r = 0; r < n; ++r) acc += load_as_double(dtype, in[r].data(), i);
    store_from_double(dtype, sum.data(), i, acc);
  }
  CHECK(count_wrong_allreduce(dtype, ReduceOp::kAvg, n, sum.data(), count, AvgRounding::kPreMultiplied) > 0);
  // One element off by one: caught.
  std::vector<std::uint8_t> one_off = got;
  store_from_double(dtype, one_off.data(), 7, load_as_double(dtype, got.data(), 7) + 1);
  CHECK(count_wrong_allreduce(dtype, ReduceOp::kAvg, n, one_off.data(), count, AvgRounding::kPreMultiplied) == 1);
}

TEST_CASE("exact inputs: NCCL's pre-multiplied average is exact at powers of two", "[tools][measure]") {
  // 1/n is exact there: the check stays bit for bit.
  // Element 0's average is 1: one unit in the last place above it.
  std::vector<float> off(1, std::nextafter(1.0f, 2.0f));
  CHECK(count_wrong_allreduce(DType::kFloat32, ReduceOp::kAvg, 4, off.data(), 1, AvgRounding::kPreMultiplied) ==
        count_wrong_allreduce(DType::kFloat32, ReduceOp::kAvg, 4, off.data(), 1));
  CHECK(count_wrong_allreduce(DType::kFloat32, ReduceOp::kAvg, 4, off.data(), 1, AvgRounding::kPreMultiplied) == 1);
}

TEST_CASE("exact inputs: integer sums wrap, and a saturating sum is caught", "[tools][measure]") {
  const int n = GENERATE(2, 3, 7);
  const std::size_t count = 20;
  std::vector<std::vector<std::int8_t>> in(n, std::vector<std::int8_t>(count));
  for (int r = 0; r < n; ++r) fill_exact_inputs(DType::kInt8, ReduceOp::kSum, n, r, in[r].data(), count);
  std::vector<std::int8_t> wrapped(count), saturated(count);
  bool any_wrap = false;
  for (std::size_t i = 0; i < count; ++i) {
    int sum = 0;
    for (int r = 0; r < n; ++r) sum += in[r][i];
    wrapped[i] = static_cast<std::int8_t>(static_cast<std::uint8_t>(sum & 0xff));
    saturated[i] = static_cast<std::int8_t>(std::clamp(sum, -128, 127));
    any_wrap = any_wrap || sum > 127;
  }
  INFO("n=" << n);
  CHECK(any_wrap);
  CHECK(count_wrong_allreduce(DType::kInt8, ReduceOp::kSum, n, wrapped.data(), count) == 0);
  CHECK(count_wrong_allreduce(DType::kInt8, ReduceOp::kSum, n, saturated.data(), count) > 0);
}

namespace {

// A Gloo communicator that says its memory is the device's (so the sweep
// takes its NCCL defaults) and records where each all_reduce reads from.
class RecordingCommunicator final : public test::ForwardingCommunicator {
 public:
  using ForwardingCommunicator::ForwardingCommunicator;
  std::vector<std::pair<const void*, std::size_t>> reads;  // (send, count) of each all_reduce

  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    reads.emplace_back(send, count);
    return ForwardingCommunicator::allreduce(send, recv, count, dtype, op);
  }
};

}  // namespace

TEST_CASE("sweep: on device memory timed iterations move through the buffers, as nccl-tests does",
          "[tools][measure][gloo]") {
  // 1 KiB in a sweep up to 4 KiB: four slots, visited in turn; the largest
  // size has one. Host memory (Gloo) stays at the start unless asked.
  const std::optional<bool> ask = GENERATE(std::optional<bool>{}, std::optional<bool>{false});
  auto fails = on_ranks(2, [&](Communicator& gloo, std::vector<std::string>& f) {
    RecordingCommunicator comm(gloo);
    SweepOptions o;
    o.sizes = {1024, 4096};
    o.iters = 6;
    o.warmup = 1;
    o.in_place = false;
    o.rotate_buffers = ask;
    std::vector<SizeResult> out;
    run_allreduce_sweep(comm, o, out);
    for (const auto& r : out)
      if (r.out_of_place->wrong != 0) f.push_back("wrong elements at " + std::to_string(r.bytes));
    std::map<std::size_t, std::set<const void*>> seen;  // count -> where it read
    const void* lowest = comm.reads.front().first;
    for (const auto& [p, count] : comm.reads) {
      seen[count].insert(p);
      lowest = std::min(lowest, p);
    }
    const std::size_t want_small = ask.value_or(true) ? 4 : 1;
    if (seen[256].size() != want_small)
      f.push_back("1 KiB read from " + std::to_string(seen[256].size()) + " places, not " +
                  std::to_string(want_small));
    for (const void* p : seen[256])
      if ((static_cast<const std::uint8_t*>(p) - static_cast<const std::uint8_t*>(lowest)) % 1024 != 0)
        f.push_back("a 1 KiB read off the slot grid");
    if (seen[1024].size() != 1) f.push_back("4 KiB read from more than one place");
  });
  for (const auto& f : fails) FAIL_CHECK(f);
}

TEST_CASE("gather and ring all_reduce on send/recv: exact, bytes and scratch equal theory", "[tools][gloo]") {
  const int n = GENERATE(2, 3, 4);
  const std::size_t count = GENERATE(std::size_t{1}, std::size_t{12}, std::size_t{13}, std::size_t{4099});
  const bool ring = GENERATE(false, true);
  const ReduceOp op = GENERATE(ReduceOp::kSum, ReduceOp::kMax);
  auto fails = on_ranks(n, [&](Communicator& comm, std::vector<std::string>& f) {
    const int me = comm.rank();
    CommBuffer buf(comm, count * 4);
    fill_exact_inputs(DType::kFloat32, op, n, me, buf.get(), count);
    alg::CountingLinks links(comm);
    alg::ScratchMemory scratch(comm);
    alg::TrafficTheory t;
    if (ring) {
      alg::ring_allreduce(links, scratch, buf.get(), count, DType::kFloat32, op, 20s);
      t = alg::ring_allreduce_theory(count, 4, n, me);
    } else {
      alg::gather_reduce_allreduce(links, scratch, buf.get(), count, DType::kFloat32, op, 20s);
      t = alg::gather_reduce_theory(n, me, 0, count * 4);
    }
    auto wrong = count_wrong_allreduce(DType::kFloat32, op, n, buf.get(), count);
    if (wrong) f.push_back("rank " + std::to_string(me) + ": " + std::to_string(wrong) + " wrong");
    if (links.traffic().bytes_sent != t.bytes_sent || links.traffic().bytes_received != t.bytes_received)
      f.push_back("rank " + std::to_string(me) + ": traffic " + std::to_string(links.traffic().bytes_sent) +
                  "/" + std::to_string(links.traffic().bytes_received) + " != theory " +
                  std::to_string(t.bytes_sent));
    if (scratch.peak_bytes() != t.extra_bytes)
      f.push_back("rank " + std::to_string(me) + ": scratch peak " + std::to_string(scratch.peak_bytes()) +
                  " != theory " + std::to_string(t.extra_bytes));
    if (scratch.current_bytes() != 0) f.push_back("scratch not released");
  });
  INFO("n=" << n << " count=" << count << " ring=" << ring);
  CHECK(fails.empty());
  for (const auto& s : fails) UNSCOPED_INFO(s);
}

TEST_CASE("MemoryAccount and AccountingCommunicator: categories, totals, peaks", "[tools][gloo]") {
  auto fails = on_ranks(1, [&](Communicator& comm, std::vector<std::string>& f) {
    MemoryAccount acc(comm);
    AccountingCommunicator ac(comm, acc, MemoryCategory::kParameters);
    {
      CommBuffer p(ac, 1000);
      ac.set_category(MemoryCategory::kBuckets);
      CommBuffer b(ac, 300);
      AccountedBuffer w(acc, MemoryCategory::kWorkspace, 50);
      if (acc.current_bytes(MemoryCategory::kParameters) != 1000) f.push_back("parameters");
      if (acc.current_bytes(MemoryCategory::kBuckets) != 300) f.push_back("buckets");
      if (acc.total_current_bytes() != 1350) f.push_back("total");
    }
    if (acc.total_current_bytes() != 0) f.push_back("released");
    if (acc.total_peak_bytes() != 1350) f.push_back("peak");
    if (acc.peak_bytes(MemoryCategory::kWorkspace) != 50) f.push_back("workspace peak");
    if (memory_category_name(MemoryCategory::kCommBuffers) != "communication_buffers") f.push_back("name");
  });
  CHECK(fails.empty());
}

TEST_CASE("rank_that_failed_first: a rank that failed of its own and not one that followed the verdict", "[tools]") {
  using ddpdiag::cli::tools::rank_that_failed_first;
  const auto exited = [](int code) { return code << 8; };  // a wait status of exit(code)
  const int killed = SIGKILL;                               // a wait status of death by SIGKILL
  // Rank 1 followed rank 0's verdict (exit 1) and was reaped before rank 0,
  // whose report could not be written (exit 2): rank 0 is named.
  CHECK(rank_that_failed_first({{1, exited(1)}, {0, exited(2)}}) == 0);
  CHECK(rank_that_failed_first({{0, exited(2)}, {1, exited(1)}}) == 0);
  // Among failures of their own, the first reaped.
  CHECK(rank_that_failed_first({{2, exited(1)}, {3, killed}, {0, exited(5)}}) == 3);
  CHECK(rank_that_failed_first({{1, exited(4)}, {0, exited(5)}}) == 1);
  // Exit 1 everywhere: a failed check, no rank to blame.
  CHECK_FALSE(rank_that_failed_first({{1, exited(1)}, {0, exited(1)}}).has_value());
  CHECK_FALSE(rank_that_failed_first({}).has_value());
}

TEST_CASE("in_place_no_work_warning: only NCCL at one rank, in place, an op that does nothing", "[tools]") {
  const std::vector<std::string> sum{"sum"}, avg{"avg"}, all{"sum", "prod", "min", "max", "avg"};
  const std::vector<std::string> f32{"float"}, every{"float", "double", "half", "bfloat16",
                                                     "int32", "int64", "int8", "uint8"};
  const std::string w = in_place_no_work_warning(1, "nccl", true, sum, f32);
  CHECK(w.find("NCCL does no work for an in-place all_reduce (sum)") != std::string::npos);
  CHECK(w.find("--no-in-place") != std::string::npos);
  // The summary beside the verdict shows the first sentence: it must say
  // what is wrong on its own.
  CHECK(w.substr(0, w.find(". ")).find("launch overhead") != std::string::npos);
  CHECK(in_place_no_work_warning(1, "nccl", true, all, f32).find("(sum, prod, min, max)") !=
        std::string::npos);
  // avg of a floating type is a pre-multiplied sum: a kernel runs. Of an
  // integer type it is a sum divided afterwards: nothing runs at one rank.
  CHECK(in_place_no_work_warning(1, "nccl", true, avg, f32).empty());
  CHECK(in_place_no_work_warning(1, "nccl", true, avg, every).find("(avg of integer types)") !=
        std::string::npos);
  CHECK(in_place_no_work_warning(1, "nccl", false, sum, f32).empty());  // --no-in-place
  CHECK(in_place_no_work_warning(2, "nccl", true, sum, f32).empty());   // a real all_reduce
  CHECK(in_place_no_work_warning(1, "gloo", true, sum, f32).empty());
}

// Lines rendered from NCCL 2.28.9's own format strings (debug.cc: "host:pid:tid
// [dev] NCCL INFO ", a WARN after an empty line with a timestamp): NCCL writes
// no subsystem name into a line, so the key lines are found by their text.
TEST_CASE("select_nccl_log_lines: NCCL 2.28.9's key lines, then the tail", "[tools]") {
  std::string log =
      "node1:123:456 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0\n"
      "node1:123:456 [0] NCCL INFO Bootstrap: Using eth0:10.0.0.1<0>\n"
      "node1:123:456 [0] NCCL INFO cudaDriverVersion 13000\n"
      "node1:123:456 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
      "node1:123:456 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n"
      "node1:123:456 [0] NCCL INFO Using network Socket\n"
      "node1:123:456 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0 rank 0 nranks 2 cudaDev 0 "
      "nvmlDev 0 busId 1b000 commId 0x1234 - Init START\n";
  for (int i = 0; i < 100; ++i)
    log += "node1:123:456 [0] NCCL INFO filler line " + std::to_string(i) + "\n";
  log += "node1:123:456 [0] NCCL INFO ncclCommInitRankConfig comm 0x55d0 rank 0 nranks 2 cudaDev 0 "
         "nvmlDev 0 busId 1b000 commId 0x1234 - Init COMPLETE\n"
         "\n[2026-12-07 11:00:00] node1:123:789 [0] misc/socket.cc:71 NCCL WARN socketProgress: "
         "Connection closed by remote peer node2<41234>\n"
         "node1:123:789 [0] NCCL INFO misc/socket.cc:830 -> 6\n";
  const auto got = select_nccl_log_lines(log, 5);
  REQUIRE(got.size() >= 8);
  auto has = [&](std::string_view text) {
    return std::any_of(got.begin(), got.end(),
                       [&](const std::string& l) { return l.find(text) != std::string::npos; });
  };
  CHECK(has("Bootstrap: Using eth0:10.0.0.1<0>"));
  CHECK(has("NCCL version 2.28.9"));
  CHECK(has("NET/Socket : Using [0]eth0"));
  CHECK(has("Using network Socket"));
  CHECK(has("NCCL_SOCKET_IFNAME set by environment to eth0"));
  CHECK(has("Init START"));
  CHECK(has("Init COMPLETE"));
  CHECK(has("NCCL WARN socketProgress: Connection closed by remote peer"));
  CHECK(has("misc/socket.cc:830 -> 6"));  // in the tail
  CHECK_FALSE(has("cudaDriverVersion"));  // neither key nor in the last 5
  CHECK_FALSE(has("filler line 0"));
  CHECK(has("filler line 99"));
  for (const auto& l : got) CHECK_FALSE(l.empty());
  // In the log's order.
  CHECK(got.front().find("NCCL_SOCKET_IFNAME") != std::string::npos);
  CHECK(got.back().find("-> 6") != std::string::npos);
  // A short log is kept whole.
  CHECK(select_nccl_log_lines("a\nb\n\nc", 80) == std::vector<std::string>{"a", "b", "c"});
}
