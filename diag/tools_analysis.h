// The pure logic of the diagnostic tools, apart from any communication so it
// can be unit-tested: the schedule of rank pairs for link-health, its outlier
// rule, the parse of NCCL's transport lines, the bucket-cap recommendation of
// bucket-sweep and the imbalance rule of memory.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::cli::tools {

// ---- the launcher ----------------------------------------------------------

// The rank to name as the one that failed first, from the ranks that failed
// as (rank, wait status) in the order they were reaped: the first that
// failed of its own. A rank that exited 1 followed a verdict (FAIL) reached
// with the others, and is passed over even when it was reaped first.
// nullopt when every failure is exit 1 (a failed check, no rank to blame).
std::optional<int> rank_that_failed_first(const std::vector<std::pair<int, int>>& failures);

// ---- link-health -----------------------------------------------------------

// A round-robin tournament (the circle method): rounds of disjoint pairs
// (a < b), every pair of the n ranks exactly once, so each rank is in at most
// one pair at a time. n even: n-1 rounds of n/2 pairs; n odd: n rounds of
// (n-1)/2 pairs, one rank sitting out each round. n < 2: no rounds.
std::vector<std::vector<std::pair<int, int>>> round_robin_schedule(int n);

struct PairMeasurement {
  int a = 0, b = 0;
  bool same_host = true;
  double bandwidth_gbps = 0;  // per direction, both directions in flight
  double latency_us = 0;      // one way: half the ping-pong round trip
  // Cross-host pairs whose two ends' link speeds are known: the slower
  // end's speed (Mb/s); 0 when unknown or same host.
  int link_speed_mbps = 0;
  // The hosts of a and b (empty when unknown): a host of several ranks whose
  // every cross-host link is slow is found by host, not by rank.
  std::string host_a{}, host_b{};
};

struct LinkThresholds {
  // A pair is slow when its bandwidth is more than this percentage below the
  // median of pairs of its kind (same host or cross host)...
  double bandwidth_below_median_pct = 50;
  // ...or its latency is more than this percentage above that median, and
  // more than latency_floor_us above it (so microsecond jitter of a shared
  // machine does not count).
  double latency_above_median_pct = 300;
  double latency_floor_us = 100;
  // Absolute limits, 0 = off.
  double min_bandwidth_gbps = 0;
  double max_latency_us = 0;
  // A cross-host pair with a known link speed is slow under this percentage
  // of that link (one direction, bytes/s = Mb/s x 125000); 0 = off. It finds
  // links that are all slow alike, which the medians cannot.
  double min_link_pct = 0;
};

struct PairJudgement {
  double kind_median_bandwidth_gbps = 0;
  double kind_median_latency_us = 0;
  std::size_t kind_pairs = 0;  // pairs of the same kind (the median's sample)
  bool slow_bandwidth = false;
  bool slow_latency = false;
  std::string reason;  // empty when the pair is fine
  bool slow() const { return slow_bandwidth || slow_latency; }
};

// One judgement per measurement, in the same order.
std::vector<PairJudgement> judge_pairs(const std::vector<PairMeasurement>& pairs,
                                       const LinkThresholds& t);

// One transport line of NCCL's INFO log: "Channel 00/0 : 0[0] -> 1[1] via
// P2P/CUMEM/read", "... [send] via NET/IB/0", "... via SHM/direct/direct".
struct TransportLine {
  int src = 0, dst = 0;
  std::string via;        // the raw word after "via"
  std::string transport;  // P2P, SHM, NET/IB, NET/Socket, ... (classify_transport)
};
std::vector<TransportLine> parse_nccl_transports(std::string_view log);
// init-check --nccl-debug: the lines of NCCL's log (written with
// NCCL_DEBUG_SUBSYS=INIT,BOOTSTRAP,NET,ENV, so every line is of those or a
// warning) worth a report: the key lines wherever they are (the version,
// "Bootstrap: Using <if>", the network and NET/Socket or NET/IB interfaces,
// NCCL_SOCKET_IFNAME as NCCL read it, Init START/COMPLETE, every WARN), then
// the last `tail` lines of the rest, in the log's order. NCCL writes no
// subsystem name into a line, so lines are not picked by subsystem words.
std::vector<std::string> select_nccl_log_lines(std::string_view log, std::size_t tail = 80);
// "P2P/CUMEM/read" -> "P2P", "SHM/direct/direct" -> "SHM", "NET/IB/0/GDRDMA"
// -> "NET/IB", "NET/Socket/1" -> "NET/Socket"; anything else as it is.
std::string classify_transport(std::string_view via);

// ---- bucket-sweep ----------------------------------------------------------

struct CapFigure {
  double bucket_cap_mb = 0;
  double exposed_comm_time_us = 0;
  // torch 2.x's bucket_cap_mb_list (MiB) when the candidate is one, with
  // bucket_cap_mb its largest (as DDP sets it); empty for a plain cap.
  std::vector<double> cap_list = {};
};

struct CapRecommendation {
  double bucket_cap_mb = 0;
  std::vector<double> cap_list;  // as CapFigure's
  double exposed_comm_time_us = 0;
  // Against the default cap when it was measured.
  std::optional<double> default_exposed_comm_time_us;
  std::optional<double> saving_us;   // default - recommended (>= 0)
  std::optional<double> saving_pct;  // of the default's exposed time
};

// The cap with the least exposed communication time; on a tie the default
// cap if it is among the tied, else a plain cap before a list, else the
// smaller cap. The default is a plain cap, never a list. Nullopt when empty.
std::optional<CapRecommendation> recommend_cap(const std::vector<CapFigure>& caps,
                                               double default_cap_mb = 25);

// A cap recommendation as bucket-sweep and model write it in their reports
// ("recommendation": the cap, its exposed time, the default's and the
// saving, null where the default cap was not among those compared).
// A list recommended adds bucket_cap_mb_list.
nlohmann::json recommendation_json(const CapRecommendation& rec, double default_cap_mb);
// The recommended DDP argument as a user writes it: "bucket_cap_mb=50", or
// "bucket_cap_mb_list=[1, 4, 25]".
std::string recommended_setting(const CapRecommendation& rec);

// ---- allreduce-test --------------------------------------------------------

// What a sweep's in-place figures mean where they time no work: NCCL at world
// size 1 enqueues nothing for an in-place all_reduce, except for avg of a
// floating type (a pre-multiplied sum, which runs a kernel), so those
// in-place times are launch overhead and their algbw absurd. The warning's
// text (first sentence: what is wrong; then what to do) when `backend` is
// "nccl", world_size is 1, in_place is set and some op of `ops` with some
// dtype of `dtypes` (names as allreduce-test's -o and -d take them) is such a
// no-op; "" otherwise.
std::string in_place_no_work_warning(int world_size, std::string_view backend, bool in_place,
                                     const std::vector<std::string>& ops,
                                     const std::vector<std::string>& dtypes);

// ---- memory ----------------------------------------------------------------

// The median of every rank's value but `rank`'s (0 with no other rank).
double median_of_others(const std::vector<double>& per_rank, std::size_t rank);

// Ranks whose value is more than pct percent above the median of the other
// ranks: a rank's own value is no part of what it is judged against (at two
// ranks the median of all would be the mean, and a rank 20% above the other
// only 10% above it).
std::vector<int> ranks_above_median(const std::vector<double>& per_rank, double pct);

}  // namespace ddpdiag::cli::tools
