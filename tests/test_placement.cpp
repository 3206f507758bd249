// CPU placement of Gloo ranks: the CPU-list format round-trips, bad lists are
// refused with the bad part named, and the warnings fire exactly when a host
// runs more ranks than the CPUs they may use, or when a rank may use one CPU.
#include <sched.h>

#include <catch2/catch.hpp>

#include <string>
#include <vector>

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
