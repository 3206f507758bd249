// Bisecting a failing or slow world, the way a person does it by hand ("drop
// to 2 ranks, add ranks until it breaks"): the pure part. plan_bisect picks
// the sub-groups to test (each host alone, pairs of hosts, halves; with every
// rank on one host, each rank plays the part of a host); judge_bisect turns
// the outcome of each group into the smallest failing set and the ranks and
// hosts it points to. No communication here: diag/bisect.cpp runs the groups.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::cli {

struct BisectGroup {
  std::string kind;        // "host", "rank", "pair", "half"
  std::string label;       // "host b", "hosts a+b", "ranks 0-1", ...
  std::vector<int> ranks;  // world ranks, ascending
};

// host_of_rank[r] is rank r's host. At most max_groups groups, world excluded,
// no group twice, smallest first.
std::vector<BisectGroup> plan_bisect(const std::vector<std::string>& host_of_rank,
                                     std::size_t max_groups = 24);

struct GroupOutcome {
  BisectGroup group;
  bool ran = false;          // false when the group could not be formed or was skipped
  std::string error;         // non-empty: init or a collective failed
  std::int64_t wrong = 0;    // wrong elements summed over the members
  double time_us = 0;        // per all_reduce, the slowest member
  bool slow = false;         // set by judge_bisect
  bool failed() const { return !error.empty() || wrong > 0; }  // outright, not just slow
  bool bad() const { return failed() || slow; }
};

struct BisectVerdict {
  std::vector<int> suspect_ranks;
  std::vector<std::string> suspect_hosts;
  std::optional<BisectGroup> smallest_failing;
  std::string summary;
  nlohmann::json to_json(const std::vector<GroupOutcome>& outcomes) const;
};

// Marks slow groups (time over slow_factor x the fastest group of the same
// sort, on one host or across hosts, and of the same size or larger, or
// smaller (of 2 ranks or more) with its time scaled by (p-1)/(q-1), and at
// least min_slow_us more, unless a larger group holding all its
// ranks was not slow: then it was noise) and names the suspects: the ranks in
// every bad group that are in no good group (or, when that is empty, in every
// bad group). world_passed: the full world ran the command without a failure,
// so a bisect where every sub-group passed too has nothing to localise (and
// the summary says so rather than speak of a failure).
BisectVerdict judge_bisect(std::vector<GroupOutcome>& outcomes,
                           const std::vector<std::string>& host_of_rank,
                           double slow_factor = 3.0, double min_slow_us = 1000.0,
                           bool world_passed = false);

}  // namespace ddpdiag::cli
