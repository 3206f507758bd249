#include "diag/scale_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

#include <fmt/core.h>

#include "comm/errors.h"
#include "ddp_core/bucket_assignment.h"

namespace ddpdiag::cli::scale {

namespace {

using nlohmann::json;

constexpr double kMiB = 1024.0 * 1024.0;
// Bounds of what a measured report can hold: past them a field is damaged,
// not measured (a world of a million ranks; one all_reduce of 1 PiB).
constexpr std::int64_t kMaxReportWorldSize = 1 << 20;
constexpr double kMaxReportBytes = 1125899906842624.0;
// The least share of a measured time the fitted byte term must make up at
// some point (fit_link): below it, time does not grow with size.
constexpr double kMinByteShare = 1e-6;

UsageError fit_error(const std::string& what, const std::string& hint) {
  return UsageError(what, ErrorContext{"model.fit", -1, -1, hint});
}

double link_cost(const Link& l, double bytes) { return l.alpha_s + bytes * l.beta_s_per_byte; }

// The binomial tree's rounds on contiguously placed ranks: in round r (d =
// 2^r) of the reduce, rank i with i mod 2d == d sends to i - d; the
// broadcast runs the same rounds backwards. Per round: whether a pair is
// inside a host, and the most sends leaving or entering one host.
struct TreeRound {
  bool intra = false;
  int inter_flows = 0;
};

std::vector<TreeRound> tree_rounds(int world_size, int ranks_per_host) {
  std::vector<TreeRound> rounds;
  const int hosts = world_size / ranks_per_host;
  std::vector<int> out(static_cast<std::size_t>(hosts)), in(static_cast<std::size_t>(hosts));
  for (long d = 1; d < world_size; d *= 2) {
    TreeRound tr;
    std::fill(out.begin(), out.end(), 0);
    std::fill(in.begin(), in.end(), 0);
    for (long i = d; i < world_size; i += 2 * d) {
      const long src_host = i / ranks_per_host, dst_host = (i - d) / ranks_per_host;
      if (src_host == dst_host) {
        tr.intra = true;
      } else {
        tr.inter_flows = std::max({tr.inter_flows, ++out[static_cast<std::size_t>(src_host)],
                                   ++in[static_cast<std::size_t>(dst_host)]});
      }
    }
    rounds.push_back(tr);
  }
  return rounds;
}

const json& member(const json& j, const char* key) {
  static const json kNull;
  if (!j.is_object()) return kNull;
  auto it = j.find(key);
  return it == j.end() ? kNull : *it;
}

}  // namespace

std::string_view algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::kRing: return "ring";
    case Algorithm::kTree: return "tree";
    case Algorithm::kGather: return "gather";
  }
  return "?";
}

std::optional<Algorithm> parse_algorithm(std::string_view s) {
  for (Algorithm a : kAllAlgorithms)
    if (s == algorithm_name(a)) return a;
  return std::nullopt;
}

double Link::bandwidth_gbps() const { return beta_s_per_byte > 0 ? 1e-9 / beta_s_per_byte : 0; }

int ceil_log2(int p) {
  int r = 0;
  for (long v = 1; v < p; v *= 2) ++r;
  return r;
}

CostTerms uniform_cost_terms(Algorithm a, int p, double n) {
  if (p <= 1) return {};
  switch (a) {
    case Algorithm::kRing:
      return {2.0 * (p - 1), 2.0 * (p - 1) / p * n};
    case Algorithm::kTree: {
      const double rounds = 2.0 * ceil_log2(p);
      return {rounds, rounds * n};
    }
    case Algorithm::kGather:
      return {2.0 * (p - 1), 2.0 * (p - 1) * n};
  }
  return {};
}

Fit fit_link(Algorithm formula, std::span<const Sample> samples, std::size_t min_points) {
  const std::string name(algorithm_name(formula));
  if (samples.size() < std::max<std::size_t>(min_points, 2))
    throw fit_error(fmt::format("{} fit: {} measured point(s), at least {} are needed", name,
                                samples.size(), std::max<std::size_t>(min_points, 2)),
                    "measure a sweep of sizes, e.g. allreduce-test -b 1K -e 16M");
  for (const auto& s : samples) {
    if (s.world_size < 2)
      throw fit_error(fmt::format("{} fit: a point at world size {} (all_reduce needs 2 ranks or more)",
                                  name, s.world_size),
                      "fit from runs with --nproc 2 or more");
    if (!(s.time_s > 0) || !std::isfinite(s.time_s) || !(s.bytes > 0))
      throw fit_error(fmt::format("{} fit: a point of {} B at world size {} has time {} s; times and "
                                  "sizes must be positive",
                                  name, s.bytes, s.world_size, s.time_s),
                      "check the input report");
    if (s.time_s > 1e6)
      throw fit_error(fmt::format("{} fit: a point of {} B at world size {} has time {} s, more than "
                                  "11 days for one all_reduce",
                                  name, s.bytes, s.world_size, s.time_s),
                      "check the input report: its times are in microseconds (time_us)");
  }
  // Weighted normal equations, weight 1 / T^2.
  double saa = 0, sab = 0, sbb = 0, sat = 0, sbt = 0;
  for (const auto& s : samples) {
    const auto c = uniform_cost_terms(formula, s.world_size, s.bytes);
    const double a = c.latency_terms / s.time_s, b = c.byte_terms / s.time_s;
    saa += a * a;
    sab += a * b;
    sbb += b * b;
    sat += a;
    sbt += b;
  }
  const double det = saa * sbb - sab * sab;
  // Collinear columns (one size at one world size): latency and bandwidth
  // cannot be told apart.
  if (!(det > 1e-12 * saa * sbb)) {
    std::set<double> sizes;
    std::set<int> worlds;
    for (const auto& s : samples) {
      sizes.insert(s.bytes);
      worlds.insert(s.world_size);
    }
    if (sizes.size() == 1)
      throw fit_error(fmt::format("{} fit: the points cannot separate latency from bandwidth: every point "
                                  "has the same message size ({} B){}",
                                  name, *sizes.begin(),
                                  worlds.size() == 1 ? std::string(" and world size")
                                  : formula == Algorithm::kRing
                                      ? std::string()
                                      : fmt::format(" (the {} formula scales latency and bandwidth alike "
                                                    "with the world size, so several world sizes do not help)",
                                                    name)),
                      "measure at least two message sizes, e.g. -b 1K -e 16M");
    throw fit_error(fmt::format("{} fit: the points cannot separate latency from bandwidth: their times "
                                "do not tell the two apart (times far below a microsecond, or "
                                "rounded alike)",
                                name),
                    "check the input report; measure a sweep of sizes, e.g. -b 1K -e 16M");
  }
  Fit f;
  f.formula = formula;
  f.points = samples.size();
  double alpha = (sbb * sat - sab * sbt) / det;
  double beta = (saa * sbt - sab * sat) / det;
  if (alpha < 0) {
    // Non-negative least squares in two unknowns: the optimum lies on the
    // boundary alpha = 0.
    alpha = 0;
    beta = sbt / sbb;
    f.alpha_clamped = true;
  }
  // The byte term's largest share of a measured time. Under kMinByteShare
  // the fitted beta is rounding left over from times that do not grow with
  // size (equal times give beta ~1e-20 s/B, not 0): no measured time holds a
  // byte term that small (report times carry 0.1 us at best; a clock or a
  // scheduler adds far more), so such a beta is zero within what was
  // measured, and its bandwidth (1e17 GB/s) nothing a link has.
  double byte_share = 0;
  if (beta > 0 && std::isfinite(beta))
    for (const auto& s : samples)
      byte_share = std::max(byte_share, uniform_cost_terms(formula, s.world_size, s.bytes).byte_terms * beta /
                                            s.time_s);
  if (!(byte_share >= kMinByteShare)) {
    const auto [lo, hi] = std::minmax_element(samples.begin(), samples.end(),
                                              [](const Sample& x, const Sample& y) { return x.bytes < y.bytes; });
    throw fit_error(fmt::format("{} fit: the inverse bandwidth comes out {} s/B{} (time does not grow "
                                "with message size: {:.1f} us at {} B, {:.1f} us at {} B); such a "
                                "fit predicts nothing",
                                name, beta,
                                beta > 0 && std::isfinite(beta)
                                    ? fmt::format(", at most {:.2g} of a measured time", byte_share)
                                    : std::string(),
                                lo->time_s * 1e6, lo->bytes, hi->time_s * 1e6, hi->bytes),
                    "measure larger messages (e.g. -e 16M), where bandwidth dominates");
  }
  f.link = {alpha, beta};
  double mean = 0;
  for (const auto& s : samples) mean += s.time_s;
  mean /= static_cast<double>(samples.size());
  double ss_res = 0, ss_tot = 0, sq_rel = 0;
  for (const auto& s : samples) {
    const auto c = uniform_cost_terms(formula, s.world_size, s.bytes);
    const double t = c.latency_terms * alpha + c.byte_terms * beta;
    f.fitted_s.push_back(t);
    ss_res += (t - s.time_s) * (t - s.time_s);
    ss_tot += (s.time_s - mean) * (s.time_s - mean);
    const double rel = (t - s.time_s) / s.time_s;
    sq_rel += rel * rel;
    f.max_rel_error = std::max(f.max_rel_error, std::fabs(rel));
  }
  f.r_squared = ss_tot > 0 ? 1 - ss_res / ss_tot : 1.0;
  f.rms_rel_error = std::sqrt(sq_rel / static_cast<double>(samples.size()));
  return f;
}

void validate_topology(const Topology& t) {
  if (t.world_size < 1)
    throw UsageError(fmt::format("world size {} is not positive", t.world_size),
                     ErrorContext{"model.predict", -1, -1, "e.g. --world-size 64"});
  if (t.ranks_per_host > t.world_size)
    throw UsageError(fmt::format("--ranks-per-host {} exceeds the world size {}: a host holds at most "
                                 "the whole world",
                                 t.ranks_per_host, t.world_size),
                     ErrorContext{"model.predict", -1, -1,
                                  "use a world size that is hosts x ranks per host"});
  if (t.ranks_per_host < 1 || t.world_size % t.ranks_per_host)
    throw UsageError(fmt::format("--ranks-per-host {} does not divide the world size {}",
                                 t.ranks_per_host, t.world_size),
                     ErrorContext{"model.predict", -1, -1,
                                  "use a world size that is hosts x ranks per host"});
}

double predict_allreduce_s(Algorithm a, const Topology& t, double n) {
  validate_topology(t);
  const int w = t.world_size, k = t.ranks_per_host;
  if (w == 1) return 0;
  const bool has_intra = k > 1, has_inter = t.hosts() > 1;
  switch (a) {
    case Algorithm::kRing: {
      const double chunk = n / w;
      double step = 0;
      if (has_intra) step = std::max(step, link_cost(t.intra, chunk));
      if (has_inter) step = std::max(step, link_cost(t.inter, chunk));
      return 2.0 * (w - 1) * step;
    }
    case Algorithm::kTree: {
      double total = 0;
      for (const auto& r : tree_rounds(w, k)) {
        double round = 0;
        if (r.intra) round = link_cost(t.intra, n);
        if (r.inter_flows > 0)
          round = std::max(round, t.inter.alpha_s + r.inter_flows * n * t.inter.beta_s_per_byte);
        total += round;
      }
      return 2 * total;
    }
    case Algorithm::kGather:
      return 2.0 * ((k - 1) * link_cost(t.intra, n) + (w - k) * link_cost(t.inter, n));
  }
  return 0;
}

BucketPlan plan_buckets(const ddp_core::ModelLayout& layout, double bucket_cap_mb,
                        std::uint64_t first_bucket_bytes, double compute_bytes_per_s,
                        const std::function<double(double bytes)>& allreduce_s, bool find_unused_parameters,
                        bool static_graph) {
  const auto cap_bytes = static_cast<std::uint64_t>(bucket_cap_mb * kMiB);  // as DDP
  return plan_buckets(layout, bucket_cap_mb, ddp_core::ddp_bucket_limits(cap_bytes, first_bucket_bytes),
                      compute_bytes_per_s, allreduce_s, find_unused_parameters, static_graph, false);
}

BucketPlan plan_buckets(const ddp_core::ModelLayout& layout, double bucket_cap_mb,
                        std::span<const std::uint64_t> limits, double compute_bytes_per_s,
                        const std::function<double(double bytes)>& allreduce_s, bool find_unused_parameters,
                        bool static_graph, bool skip_all_reduce_unused_params, bool set_last_bucket_small) {
  BucketPlan plan;
  plan.bucket_cap_mb = bucket_cap_mb;
  plan.bucket_cap_bytes = static_cast<std::uint64_t>(bucket_cap_mb * kMiB);  // as DDP
  const auto& tensors = layout.tensors;
  // ready_s[p]: when parameter p's gradient is ready, once the gradients
  // before it in backward's order (the layout's ready order) are produced.
  std::vector<double> ready_s(tensors.size(), 0);
  double produced = 0;
  for (std::size_t i : layout.gradient_ready_order()) {
    produced += static_cast<double>(tensors[i].bytes());
    ready_s[i] = compute_bytes_per_s > 0 ? produced / compute_bytes_per_s : 0;
  }
  plan.backward_s = compute_bytes_per_s > 0 ? produced / compute_bytes_per_s : 0;
  double channel_free = 0;
  const auto buckets =
      ddp_core::ddp_buckets_as_run(layout, limits, find_unused_parameters, static_graph, set_last_bucket_small);
  const auto all_unused = ddp_core::buckets_all_unused(layout, buckets);
  for (std::size_t k = 0; k < buckets.size(); ++k) {
    const auto& b = buckets[k];
    plan.bucket_bytes.push_back(b.bytes);
    if (skip_all_reduce_unused_params && all_unused[k]) continue;  // no all_reduce
    double ready = 0;
    for (std::size_t p : b.param_indices) ready = std::max(ready, ready_s[p]);
    const double t = allreduce_s(static_cast<double>(b.bytes));
    const double start = std::max(ready, channel_free);
    channel_free = start + t;
    plan.comm_s += t;
  }
  if (find_unused_parameters && !static_graph) {
    std::size_t trainable = 0;
    for (const auto& t : tensors) trainable += t.requires_grad;
    const double t = allreduce_s(4.0 * static_cast<double>(trainable));
    channel_free = std::max(channel_free, plan.backward_s) + t;
    plan.comm_s += t;
  }
  plan.end_s = channel_free;
  plan.exposed_s = std::max(0.0, plan.end_s - plan.backward_s);
  return plan;
}

std::string ReportRows::left_out_text() const {
  std::vector<std::string> parts;
  if (unsized_rows) parts.push_back(fmt::format("{} without a positive bytes", unsized_rows));
  if (untimed_rows) parts.push_back(fmt::format("{} without a positive time_us", untimed_rows));
  if (wrong_rows) parts.push_back(fmt::format("{} with wrong results only", wrong_rows));
  std::string text;
  for (std::size_t i = 0; i < parts.size(); ++i) text += (i ? ", " : "") + parts[i];
  return text;
}

ReportRows extract_rows(const json& report, const std::string& source) {
  auto bad = [&](const std::string& what) {
    return UsageError(fmt::format("{}: {}", source, what),
                      ErrorContext{"model.input", -1, -1,
                                   "pass reports written by allreduce-test, dp-vs-ring or "
                                   "bucket-sweep with --json FILE"});
  };
  ReportRows out;
  const json& command = member(report, "command");
  if (!command.is_string()) throw bad("not a ddpdiag report (no command)");
  out.command = command.get<std::string>();
  if (out.command != "allreduce-test" && out.command != "dp-vs-ring" && out.command != "bucket-sweep")
    throw bad(fmt::format("a '{}' report has no all_reduce timings", out.command));
  const json& world = member(report, "world");
  const json& size = member(world, "size");
  if (!size.is_number_integer()) throw bad("the report has no world size (did the run rendezvous?)");
  // Read as a 64-bit number first: get<int>() would wrap 10^10 to another size.
  if (size.is_number_unsigned() ? size.get<std::uint64_t>() > kMaxReportWorldSize
                                : (size.get<std::int64_t>() < 1 || size.get<std::int64_t>() > kMaxReportWorldSize))
    throw bad(fmt::format("world.size {} is not a world size (1..{})", size.dump(), kMaxReportWorldSize));
  out.world_size = size.get<int>();
  const json& hosts = member(world, "hosts");
  if (hosts.is_array()) {
    std::set<std::string> names;
    for (const auto& h : hosts)
      if (h.is_string()) names.insert(h.get<std::string>());
    out.hosts = static_cast<int>(names.size());
  }
  const json& ranks = member(world, "ranks");
  if (ranks.is_array() && ranks.size() == static_cast<std::size_t>(std::max(0, out.world_size))) {
    std::vector<std::string> by_rank(ranks.size());
    bool all = true;
    for (const auto& r : ranks) {
      const json& rank = member(r, "rank");
      const json& host = member(r, "host");
      if (!rank.is_number_integer() || !host.is_string() || rank.get<long long>() < 0 ||
          rank.get<long long>() >= static_cast<long long>(by_rank.size()) ||
          !by_rank[rank.get<std::size_t>()].empty()) {
        all = false;
        break;
      }
      by_rank[rank.get<std::size_t>()] = host.get<std::string>();
    }
    for (const auto& h : by_rank) all = all && !h.empty();
    if (all) out.rank_hosts = std::move(by_rank);
  }
  const json& results = member(report, "results");
  const json& sizes = member(results, "sizes");
  const json& default_collective = member(results, "collective");
  // The fit is of float sum all_reduces: rows of other dtypes (-d all) move
  // other element sizes at other reduce speeds, and would blur it.
  const auto text_or = [](const json& j, const std::string& fallback) {
    return j.is_string() ? j.get<std::string>() : fallback;
  };
  const std::string default_dtype = text_or(member(results, "dtype"), "float");
  const std::string default_op = text_or(member(results, "op"), "sum");
  std::size_t other_dtype_rows = 0;
  std::size_t& wrong_rows = out.wrong_rows;
  std::size_t& untimed_rows = out.untimed_rows;
  if (sizes.is_array()) {
    for (const auto& row : sizes) {
      const json& coll = member(row, "collective").is_string() ? member(row, "collective") : default_collective;
      if (coll.is_string() && coll.get<std::string>() != "all_reduce") continue;
      if (text_or(member(row, "dtype"), default_dtype) != "float" ||
          text_or(member(row, "op"), default_op) != "sum") {
        ++other_dtype_rows;
        continue;
      }
      const json& bytes = member(row, "bytes");
      if (!bytes.is_number() || !(bytes.get<double>() > 0)) {
        ++out.unsized_rows;
        continue;
      }
      if (!(bytes.get<double>() <= kMaxReportBytes))
        throw bad(fmt::format("a row of {} bytes: no all_reduce moves more than {} bytes (1 PiB) in one "
                              "call",
                              bytes.dump(), kMaxReportBytes));
      std::string series = "backend";
      if (member(row, "algorithm").is_string()) series = member(row, "algorithm").get<std::string>();
      if (series != "backend" && series != "ring" && series != "gather") continue;
      int world_size = out.world_size;
      if (const json& ws = member(row, "world_size"); ws.is_number_integer()) {
        if (ws.is_number_unsigned() ? ws.get<std::uint64_t>() > static_cast<std::uint64_t>(out.world_size)
                                    : (ws.get<std::int64_t>() < 1 || ws.get<std::int64_t>() > out.world_size))
          throw bad(fmt::format("a row at world size {}, outside the run's world of 1..{} ranks", ws.dump(),
                                out.world_size));
        world_size = ws.get<int>();
      }
      double fastest = INFINITY;
      bool wrong = false;
      for (const char* block : {"out_of_place", "in_place"}) {
        const json& b = member(row, block);
        const json& t = member(b, "time_us");
        if (!t.is_number() || !(t.get<double>() > 0)) continue;
        // A block with wrong results timed something else than an all_reduce.
        if (member(b, "wrong").is_number() && member(b, "wrong").get<double>() > 0) {
          wrong = true;
          continue;
        }
        fastest = std::min(fastest, t.get<double>());
      }
      if (std::isfinite(fastest))
        out.rows.push_back({series, {world_size, bytes.get<double>(), fastest * 1e-6}});
      else if (wrong)
        ++wrong_rows;
      else
        ++untimed_rows;
    }
  }
  if (out.rows.empty() && wrong_rows > 0)
    throw bad(fmt::format("every all_reduce row ({}) had wrong results, and timings of wrong "
                          "results are left out",
                          wrong_rows));
  if (out.rows.empty() && other_dtype_rows > 0)
    throw bad(fmt::format("no float sum all_reduce rows (its {} row(s) are of other dtypes or "
                          "ops): the model fits float sums; rerun allreduce-test with -d float -o sum",
                          other_dtype_rows));
  if (out.rows.empty() && untimed_rows > 0)
    throw bad(fmt::format("no all_reduce row has a time: its {} row(s) have no positive, finite "
                          "time_us in either block",
                          untimed_rows));
  if (out.rows.empty() && out.command == "bucket-sweep")
    throw UsageError(fmt::format("{}: this bucket-sweep report has no all_reduce size sweep "
                                 "(results.sizes is empty or missing: written with --no-size-sweep?)",
                                 source),
                     ErrorContext{"model.input", -1, -1,
                                  "rerun bucket-sweep without --no-size-sweep, or fit from an "
                                  "allreduce-test report"});
  if (out.rows.empty()) throw bad("no all_reduce timing rows (results.sizes is empty or missing)");
  return out;
}

Placement placement_of(const ReportRows& rows, int w) {
  if (rows.rank_hosts.size() < static_cast<std::size_t>(std::max(0, w))) {
    // Where ranks ran is not in the report: one host is one host for any
    // world; the whole world over its hosts where they divide it evenly.
    if (rows.hosts <= 1) return {1, {}};
    if (w == rows.world_size && w % rows.hosts == 0) return {rows.hosts, {}};
    return {0, fmt::format("the report does not say which of its {} hosts ranks 0..{} ran on",
                           rows.hosts, w - 1)};
  }
  // Runs of ranks on one host, in rank order (dp-vs-ring's sub-worlds are
  // ranks 0..w-1 of the job).
  std::vector<std::pair<std::string, int>> runs;
  for (int r = 0; r < w; ++r) {
    const std::string& h = rows.rank_hosts[static_cast<std::size_t>(r)];
    if (runs.empty() || runs.back().first != h)
      runs.emplace_back(h, 1);
    else
      ++runs.back().second;
  }
  std::set<std::string> distinct;
  bool even = true;
  for (const auto& [h, k] : runs) {
    distinct.insert(h);
    even = even && k == runs.front().second;
  }
  if (distinct.size() == runs.size() && even) return {static_cast<int>(runs.size()), {}};
  std::string how;
  for (const auto& [h, k] : runs) how += fmt::format("{}{} on {}", how.empty() ? "" : ", ", k, h);
  return {0, fmt::format("ranks 0..{} sit {} ({}), not host by host in equal numbers", w - 1,
                         distinct.size() == runs.size() ? "unevenly" : "interleaved", how)};
}

}  // namespace ddpdiag::cli::scale
