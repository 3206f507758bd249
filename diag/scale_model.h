// The alpha-beta scale model behind `ddpdiag model`: fits a per-message
// latency alpha (s) and an inverse bandwidth beta (s/byte) to measured
// all_reduce times, then predicts all_reduce time and the best DDP bucket cap
// at a world size nobody has measured. Pure functions, no communication.
//
// Cost formulas for an all_reduce of n bytes on p ranks over one kind of
// link (alpha, beta):
//   ring   (reduce-scatter + all-gather, 2(p-1) steps of n/p bytes):
//          T = 2(p-1) alpha + 2(p-1)/p n beta
//   tree   (binomial tree: reduce to rank 0, then broadcast from it; whole
//          messages, not pipelined; ceil(log2 p) rounds each way):
//          T = 2 ceil(log2 p) (alpha + n beta)
//   gather (DataParallel-style: every rank sends n to the root, which
//          reduces and sends n back to each; the root's link carries it all):
//          T = 2 (p-1) (alpha + n beta)
//
// With hosts (ranks placed host by host, k per host, intra- and inter-host
// links of their own):
//   ring:   each of the 2(W-1) steps moves n/W bytes on every link of the
//           ring at once; the ring crosses each inter-host link once per
//           step, so a step costs the slowest kind of link on it:
//           max(alpha_intra + n/W beta_intra, alpha_inter + n/W beta_inter)
//           (only the kinds present: intra when k > 1, inter when W > k);
//   tree:   each round costs its slowest pair; c sends leaving (or entering)
//           one host in the same round share its inter-host link:
//           alpha_inter + c n beta_inter;
//   gather: the root exchanges with k-1 ranks on its host and W-k elsewhere,
//           one after another: 2[(k-1)(alpha_intra + n beta_intra) +
//           (W-k)(alpha_inter + n beta_inter)].
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ddp_core/model_layout.h"

namespace ddpdiag::cli::scale {

enum class Algorithm { kRing, kTree, kGather };
inline constexpr Algorithm kAllAlgorithms[] = {Algorithm::kRing, Algorithm::kTree,
                                               Algorithm::kGather};
std::string_view algorithm_name(Algorithm a);  // "ring", "tree", "gather"
std::optional<Algorithm> parse_algorithm(std::string_view s);

// One kind of link: a message of b bytes takes alpha_s + b * beta_s_per_byte.
struct Link {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
  double bandwidth_gbps() const;  // 1 / beta in GB/s (1e9 B/s); 0 when beta is 0
};

// T = latency_terms * alpha + byte_terms * beta on one uniform link.
struct CostTerms {
  double latency_terms = 0;
  double byte_terms = 0;
};
CostTerms uniform_cost_terms(Algorithm a, int world_size, double bytes);
// ceil(log2 p) for p >= 1 (0 for p = 1).
int ceil_log2(int p);

// One measured all_reduce: time per call at a world size and message size.
struct Sample {
  int world_size = 0;
  double bytes = 0;
  double time_s = 0;
};

struct Fit {
  Algorithm formula = Algorithm::kRing;
  Link link;
  std::size_t points = 0;
  // alpha came out negative unconstrained; refitted with alpha = 0.
  bool alpha_clamped = false;
  double r_squared = 0;      // of the times, 1 - SS_res / SS_tot (1 when SS_tot is 0)
  double rms_rel_error = 0;  // sqrt(mean((fit - measured) / measured)^2)
  double max_rel_error = 0;  // max |fit - measured| / measured
  std::vector<double> fitted_s;  // per sample, in input order
};

inline constexpr std::size_t kMinFitPoints = 3;

// Least squares of the formula's T = a alpha + b beta on the samples,
// weighted by 1 / measured^2 (relative residuals, so a 16 B time counts as
// much as a 64 MiB one), with alpha, beta >= 0. Throws UsageError when there
// are fewer than min_points samples, a time is not positive, the samples
// cannot separate alpha from beta (one message size at one world size), or
// beta comes out <= 0 (time does not grow with message size: the fit would
// predict infinite bandwidth).
Fit fit_link(Algorithm formula, std::span<const Sample> samples,
             std::size_t min_points = kMinFitPoints);

// Where the ranks are and what joins them. world_size must be a multiple of
// ranks_per_host.
struct Topology {
  int world_size = 2;
  int ranks_per_host = 1;
  Link intra;
  Link inter;
  int hosts() const { return ranks_per_host > 0 ? world_size / ranks_per_host : 0; }
};
// Throws UsageError for world_size < 1, ranks_per_host < 1, world_size not a
// multiple of ranks_per_host.
void validate_topology(const Topology& t);
// Predicted time of one all_reduce of `bytes` (s), by the formulas above.
double predict_allreduce_s(Algorithm a, const Topology& t, double bytes);

// ---- DDP buckets -----------------------------------------------------------

struct BucketPlan {
  double bucket_cap_mb = 0;
  std::uint64_t bucket_cap_bytes = 0;
  std::vector<std::uint64_t> bucket_bytes;  // in reduction order
  double comm_s = 0;      // sum of the buckets' all_reduce times
  double backward_s = 0;  // total gradient bytes / compute rate
  double end_s = 0;       // when the last bucket's all_reduce ends
  double exposed_s = 0;   // max(0, end - backward): communication after backward
  double step_s() const { return end_s > backward_s ? end_s : backward_s; }
};

// The reducer's schedule with a simulated backward: gradients become ready
// in the layout's ready order (ModelLayout::gradient_ready_order), tensor by tensor, at compute_bytes_per_s
// (0: all at once), as ddp_core's backward simulator produces them; a
// bucket's all_reduce starts when its last gradient is ready and the
// previous bucket's has ended (buckets are launched in order and share one
// communication channel), and lasts allreduce_s(bucket bytes). Buckets are
// ddp_buckets_as_run(layout, cap, first_bucket_bytes, find_unused_parameters,
// static_graph); parameters forward never uses (left out of the ready
// order) are ready at the start, as DDP marks them. With
// find_unused_parameters (and no static_graph) DDP also all-reduces its map
// of used parameters (an int32 each) every iteration, after the buckets.
BucketPlan plan_buckets(const ddp_core::ModelLayout& layout, double bucket_cap_mb,
                        std::uint64_t first_bucket_bytes, double compute_bytes_per_s,
                        const std::function<double(double bytes)>& allreduce_s,
                        bool find_unused_parameters = false, bool static_graph = false);
// The same for any bucket size limits (ddp_core::ddp_bucket_limits, or torch
// 2.x's bucket_cap_mb_list in bytes), bucket_cap_mb standing for them in the
// plan. With skip_all_reduce_unused_params (torch 2.x) a bucket whose
// parameters are all unused in backward takes no all_reduce;
// set_last_bucket_small is DDP_SET_LAST_BUCKET_CAP=1's buckets
// (ddp_core::ddp_buckets).
BucketPlan plan_buckets(const ddp_core::ModelLayout& layout, double bucket_cap_mb,
                        std::span<const std::uint64_t> limits, double compute_bytes_per_s,
                        const std::function<double(double bytes)>& allreduce_s, bool find_unused_parameters,
                        bool static_graph, bool skip_all_reduce_unused_params,
                        bool set_last_bucket_small = false);

// ---- input reports ---------------------------------------------------------

// A measured row of an input report, with the series it belongs to:
// "backend" (the backend's own all_reduce: allreduce-test, bucket-sweep's
// plain sweep, dp-vs-ring's backend rows), "ring" or "gather" (dp-vs-ring's
// send/recv algorithms).
struct MeasuredRow {
  std::string series;
  Sample sample;
};

struct ReportRows {
  std::string command;
  int world_size = 0;
  int hosts = 0;  // distinct hosts in world.hosts (0 when unknown)
  // Each rank's host, by rank (world.ranks[].host); empty when the report
  // does not name every rank's host.
  std::vector<std::string> rank_hosts;
  std::vector<MeasuredRow> rows;
  // Float sum all_reduce rows left out, by why: no positive byte count, no
  // positive time in either block, only wrong results. (Rows of other
  // dtypes, ops or collectives are not the model's: not counted.)
  std::size_t unsized_rows = 0, untimed_rows = 0, wrong_rows = 0;
  std::size_t left_out() const { return unsized_rows + untimed_rows + wrong_rows; }
  // "2 without a positive bytes, 1 without a positive time_us" ("" if none).
  std::string left_out_text() const;
};

// How ranks 0..w-1 of a run sit on hosts, as the model places them: host by
// host, the same number on each. `hosts` is 0 (`why` says why) when they sit
// otherwise, or when the report does not name each rank's host and the run
// had several hosts, unless w is the whole world and its hosts divide it.
struct Placement {
  int hosts = 0;
  std::string why;
};
Placement placement_of(const ReportRows& rows, int w);

// The all_reduce rows of an allreduce-test, dp-vs-ring or bucket-sweep
// report, one sample per size row: the faster of its out-of-place and
// in-place times. Both time the same all_reduce, and other processes on the
// machine only ever add time, so the faster is the better measure of what
// the links cost. Blocks with wrong results are left out. Throws UsageError
// naming `source` for another command, a report without a world size, or
// one without any usable row.
ReportRows extract_rows(const nlohmann::json& report, const std::string& source);

}  // namespace ddpdiag::cli::scale
