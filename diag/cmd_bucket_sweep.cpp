// ddpdiag bucket-sweep: all_reduce bandwidth and exposed communication time
// per bucket_cap_mb for a model's gradient layout. For each cap DDP's buckets
// are built (ddp_buckets(), the reducer's own), then the reducer runs:
//   1. communication alone: every gradient marked ready at once, so the
//      buckets' all_reduces go back to back; its time gives the total
//      communication time per iteration and the achieved bus bandwidth;
//   2. overlapped with a simulated backward that produces gradients at
//      --compute-gbps: the communication left after the last gradient is the
//      exposed (non-overlapped) time a training step pays.
// The recommendation is the cap with the least exposed time, with its saving
// against DDP's default 25. A plain sweep of single all_reduce calls at
// bucket-like sizes shows where bandwidth saturates.
//
// Figures per cap are each rank's median over the timed iterations; the
// reported one is the slowest rank's (a step waits for the slowest), and
// spread_us is the slowest minus the fastest rank.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/measure.h"
#include "ddp_core/backward_sim.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"
#include "ddp_core/reducer.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/tools_analysis.h"
#include "diag/tools_common.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
using namespace ddpdiag::ddp_core;


struct BucketSweepOptions {
  CommonOptions common;
  std::string model = "resnet50";
  std::string caps = "1,5,10,25,50,100,200";
  // torch 2.x's bucket_cap_mb_list candidates, one a flag: "1,4,25".
  std::vector<std::string> cap_lists;
  double first_bucket_mb = 1;
  int iters = 3;
  int warmup = 1;
  double compute_gbps = 1.0;
  bool no_size_sweep = false;
  std::string sweep_min = "256K";
  std::string sweep_max = "64M";
  int sweep_iters = 5;
  bool find_unused = false;
  bool static_graph = false;
  bool skip_unused = false;  // torch 2.x's skip_all_reduce_unused_params
  bool set_last_bucket_cap = false;  // DDP_SET_LAST_BUCKET_CAP=1 (also read from the environment)
};

struct CapRow {
  double cap_mb = 0;  // a list's largest, as DDP sets bucket_cap_mb from it
  std::uint64_t cap_bytes = 0;
  BucketCapList cap_list;  // torch 2.x's bucket_cap_mb_list; empty for a plain cap
  std::vector<std::uint64_t> bucket_bytes;
  std::size_t expected_buckets = 0;  // ddp_buckets() for the same layout and cap
  double comm_time_us = 0;          // communication alone, slowest rank
  double comm_spread_us = 0;
  double busbw_gbps = 0;
  double algbw_gbps = 0;
  double exposed_us = 0;            // overlapped, slowest rank
  double exposed_spread_us = 0;
  double step_us = 0;
  double backward_us = 0;
  std::int64_t wrong = 0;
};

// Slowest rank's value of a per-rank figure and the spread over ranks.
std::pair<double, double> slowest_and_spread(Communicator& comm, double mine, Millis timeout) {
  const auto all = allgather_doubles(comm, {mine}, timeout);
  const auto [lo, hi] = std::minmax_element(all.begin(), all.end());
  return {*hi, *hi - *lo};
}

// A plain cap (cap_mb), or a bucket_cap_mb_list (list, not empty).
CapRow measure_cap(Job& job, const ModelLayout& layout, double cap_mb, const BucketCapList& list,
                   const BucketSweepOptions& o) {
  Communicator& comm = *job.comm;
  CapRow row;
  row.cap_mb = list.empty() ? cap_mb : list.max_mb();
  row.cap_bytes = list.empty() ? static_cast<std::uint64_t>(cap_mb * kMiB)  // as DDP: int(cap * 1024 * 1024)
                               : list.max_bytes();
  row.cap_list = list;
  const auto first_bytes = static_cast<std::uint64_t>(o.first_bucket_mb * kMiB);
  const std::vector<std::uint64_t> limits = list.empty() ? ddp_bucket_limits(row.cap_bytes, first_bytes) : list.bytes;
  const bool set_last = set_last_bucket_cap(o.set_last_bucket_cap);
  row.expected_buckets = ddp_buckets_as_run(layout, limits, o.find_unused, o.static_graph, set_last).size();
  ReducerOptions ro;
  ro.bucket_cap_bytes = row.cap_bytes;
  ro.first_bucket_bytes = first_bytes;
  ro.bucket_size_limits = list.bytes;
  ro.find_unused_parameters = o.find_unused;
  ro.static_graph = o.static_graph;
  ro.skip_all_reduce_unused_params = o.skip_unused;
  ro.set_last_bucket_small = set_last;
  ro.timeout = job.timeout;
  Reducer red(comm, layout, ro);
  std::vector<DdpBucket> specs;
  for (const auto& b : red.buckets()) {
    row.bucket_bytes.push_back(b.spec.bytes);
    specs.push_back(b.spec);
  }
  // The bytes all-reduced a step: every bucket's, but those of unused
  // parameters that skip_all_reduce_unused_params leaves out.
  const std::vector<bool> skipped =
      o.skip_unused ? buckets_all_unused(layout, specs) : std::vector<bool>(specs.size(), false);
  std::uint64_t reduced_bytes = 0;
  for (std::size_t b = 0; b < specs.size(); ++b)
    if (!skipped[b]) reduced_bytes += specs[b].bytes;
  // Parameters unused in forward (checked in run(): only with
  // find_unused_parameters or static_graph): no rank gives them a gradient.
  const std::vector<std::size_t> unused = layout.unused_in_backward();
  const UsedBy used_by = used_by_all_but(unused, layout.tensors.size());

  std::uint64_t iteration = 0;
  auto run_phase = [&](double compute_gbps, std::vector<double>& comm_us, std::vector<double>& exposed_us,
                       std::vector<double>& step_us, std::vector<double>& backward_us) {
    BackwardSimOptions so;
    so.compute_gbps = compute_gbps;
    so.unused = unused;
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      comm.barrier()->wait(job.timeout);
      const auto bw = simulate_backward(red, comm, iteration, so);
      red.finalize();
      const auto& tm = red.last_timing();
      if (it + 1 == o.warmup + o.iters)
        row.wrong += check_gradients(red, comm, iteration, 1.0, 0, used_by).wrong;
      ++iteration;
      if (it < o.warmup) continue;
      // Communication alone: from the first launch to the end of finalize.
      comm_us.push_back(tm.comm_span_us());
      exposed_us.push_back(tm.exposed_comm_us());
      step_us.push_back(tm.iteration_us());
      backward_us.push_back(bw.backward_us());
    }
  };
  std::vector<double> c0, e0, s0, b0, c1, e1, s1, b1;
  run_phase(0, c0, e0, s0, b0);
  run_phase(o.compute_gbps, c1, e1, s1, b1);
  std::tie(row.comm_time_us, row.comm_spread_us) =
      slowest_and_spread(comm, median(c0), job.timeout);
  std::tie(row.exposed_us, row.exposed_spread_us) =
      slowest_and_spread(comm, median(e1), job.timeout);
  row.step_us = slowest_and_spread(comm, median(s1), job.timeout).first;
  row.backward_us = slowest_and_spread(comm, median(b1), job.timeout).first;
  const auto wrong = allgather_doubles(comm, {static_cast<double>(row.wrong)}, job.timeout);
  row.wrong = 0;
  for (double w : wrong) row.wrong += static_cast<std::int64_t>(w);
  const double total = static_cast<double>(reduced_bytes);
  row.algbw_gbps = row.comm_time_us > 0 ? total / row.comm_time_us / 1e3 : 0;
  row.busbw_gbps = row.algbw_gbps * busbw_factor(Collective::kAllReduce, comm.size());
  return row;
}

// The median bucket size: the mean of the middle two for an even count, in
// the table as in the report.
double median_bucket_bytes(const CapRow& r) {
  return median(std::vector<double>(r.bucket_bytes.begin(), r.bucket_bytes.end()));
}

json cap_json(const CapRow& r) {
  auto sorted = r.bucket_bytes;
  std::sort(sorted.begin(), sorted.end());
  const double med = median_bucket_bytes(r);
  json row = {{"bucket_cap_mb", r.cap_mb},
          {"bucket_cap_bytes", r.cap_bytes},
          {"bucket_count", r.bucket_bytes.size()},
          {"expected_bucket_count", r.expected_buckets},
          {"bucket_bytes", r.bucket_bytes},
          {"min_bucket_bytes", sorted.empty() ? 0 : sorted.front()},
          {"median_bucket_bytes", med},
          {"max_bucket_bytes", sorted.empty() ? 0 : sorted.back()},
          {"comm_time_us", r.comm_time_us},
          {"comm_time_us_spread", r.comm_spread_us},
          {"algbw_gbps", r.algbw_gbps},
          {"busbw_gbps", r.busbw_gbps},
          {"exposed_comm_time_us", r.exposed_us},
          {"exposed_comm_time_us_spread", r.exposed_spread_us},
          {"spread_us", r.exposed_spread_us},  // the same, by its older name
          {"step_time_us", r.step_us},
          {"backward_time_us", r.backward_us},
          {"wrong", r.wrong}};
  if (!r.cap_list.empty()) row["bucket_cap_mb_list"] = r.cap_list.mb;
  return row;
}

void run(Job& job, reports::Report& report, const BucketSweepOptions& o) {
  const auto caps = cli::parse_caps(o.caps, job.rank());
  // The candidates: each plain cap, then each bucket_cap_mb_list.
  std::vector<BucketCapList> lists;
  for (const auto& l : o.cap_lists) lists.push_back(parse_cap_list(l, job.rank(), false));
  const std::size_t candidates = caps.size() + lists.size();
  if (!(o.first_bucket_mb > 0))
    throw UsageError("--first-bucket-mb must be positive", {"flags", job.rank(), -1, "DDP's is 1"});
  if (o.compute_gbps < 0)
    throw UsageError("--compute-gbps must be >= 0", {"flags", job.rank(), -1, "e.g. 1"});
  if (!o.no_size_sweep && parse_size(o.sweep_max) < parse_size(o.sweep_min))
    throw UsageError(fmt::format("--sweep-maxbytes {} is below --sweep-minbytes {}", o.sweep_max,
                                 o.sweep_min),
                     {"flags", job.rank(), -1, "swap them"});
  // Frozen parameters have no gradient: DDP reduces the others only.
  const ModelLayout layout = trainable_parameters(load_model(o.model));
  const bool set_last = set_last_bucket_cap(o.set_last_bucket_cap);  // the flag, or the variable
  check_unused_parameters(layout, o.find_unused || o.static_graph, "bucket-sweep", true);
  check_backward_rate(layout.gradient_bytes(), o.compute_gbps, job.rank());
  auto& res = report.results();
  res["model"] = layout.name;
  res["tensor_count"] = layout.tensors.size();
  res["total_bytes"] = layout.total_bytes();
  res["first_bucket_bytes"] = static_cast<std::uint64_t>(o.first_bucket_mb * kMiB);
  res["compute_gbps"] = o.compute_gbps;
  res["find_unused_parameters"] = o.find_unused;
  res["static_graph"] = o.static_graph;
  res["skip_all_reduce_unused_params"] = o.skip_unused;
  res["set_last_bucket_cap"] = set_last;
  res["iters"] = o.iters;
  res["warmup_iters"] = o.warmup;
  res["default_bucket_cap_mb"] = kDefaultCapMb;
  res["caps"] = json::array();
  if (job.rank() == 0) {
    std::printf("# ddpdiag bucket-sweep: %d rank(s), backend %s, model %s (%zu tensors, %.1f MiB), "
                "first bucket %.3g MiB%s\n",
                job.size(), std::string(backend_name(job.backend)).c_str(), layout.name.c_str(),
                layout.tensors.size(), static_cast<double>(layout.total_bytes()) / kMiB,
                o.first_bucket_mb,
                set_last_bucket_cap_note(set_last, o.find_unused, o.static_graph)
                    .c_str());
    if (o.compute_gbps > 0)
      std::printf("# per cap: communication alone (all gradients ready at once) and overlapped with a "
                  "backward producing gradients at %.3g GB/s; medians of %d iters, slowest rank\n",
                  o.compute_gbps, o.iters);
    else
      std::printf("# per cap: communication with every gradient ready at once (--compute-gbps 0: no "
                  "backward to overlap); medians of %d iters, slowest rank\n",
                  o.iters);
    std::printf("# %8s %8s %10s %10s %10s %10s %9s %12s %12s %12s %6s\n", "cap", "buckets",
                "min", "median", "max", "comm", "busbw", "exposed", "step", "backward", "#wrong");
    std::printf("# %8s %8s %10s %10s %10s %10s %9s %12s %12s %12s %6s\n", "(MiB)", "", "(MiB)",
                "(MiB)", "(MiB)", "(ms)", "(GB/s)", "(ms)", "(ms)", "(ms)", "");
    std::fflush(stdout);
  }

  std::vector<CapRow> rows;
  std::vector<SizeResult> sweep;
  // complete: every cap was measured. A sweep that stopped part-way
  // recommends nothing (the best of the caps it reached is not the best of
  // --caps) and passes no check it did not get to.
  auto judge = [&](bool complete) {
    std::vector<tools::CapFigure> figs;
    std::int64_t wrong = 0;
    bool counts_ok = true;
    // Caps that build the same buckets are one DDP configuration: whatever
    // their times differ by is noise. Each such group is one candidate, the
    // default cap if it is in the group, else the smallest, at the group's
    // least exposed time.
    json equivalent = json::array();
    std::vector<bool> taken(rows.size(), false);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      wrong += rows[i].wrong;
      counts_ok = counts_ok && rows[i].bucket_bytes.size() == rows[i].expected_buckets;
      if (!rows[i].cap_list.empty()) {
        // A list is a candidate of its own.
        figs.push_back({rows[i].cap_mb, rows[i].exposed_us, rows[i].cap_list.mb});
        continue;
      }
      if (taken[i]) continue;
      tools::CapFigure f{rows[i].cap_mb, rows[i].exposed_us};
      std::vector<double> group{rows[i].cap_mb};
      for (std::size_t j = i + 1; j < rows.size(); ++j) {
        if (taken[j] || !rows[j].cap_list.empty() || rows[j].bucket_bytes != rows[i].bucket_bytes) continue;
        taken[j] = true;
        group.push_back(rows[j].cap_mb);
        f.exposed_comm_time_us = std::min(f.exposed_comm_time_us, rows[j].exposed_us);
        if (f.bucket_cap_mb != kDefaultCapMb &&
            (rows[j].cap_mb == kDefaultCapMb || rows[j].cap_mb < f.bucket_cap_mb))
          f.bucket_cap_mb = rows[j].cap_mb;
      }
      if (group.size() > 1) equivalent.push_back(group);
      figs.push_back(f);
    }
    res["equivalent_caps"] = equivalent;
    const auto rec = complete ? tools::recommend_cap(figs, kDefaultCapMb) : std::nullopt;
    // A list recommended: recommended_cap_mb_list, and no plain cap.
    res["recommended_cap_mb"] = rec && rec->cap_list.empty() ? json(rec->bucket_cap_mb) : json();
    res["recommended_cap_mb_list"] = rec && !rec->cap_list.empty() ? json(rec->cap_list) : json();
    if (rec) {
      res["recommendation"] = tools::recommendation_json(*rec, kDefaultCapMb);
    } else {
      res["recommendation"] = nullptr;
    }
    res["wrong_total"] = wrong;
    if (!complete && rows.empty()) {
      const char* why = "the run ended with an error before any cap was measured";
      report.add_check({"correctness", reports::CheckStatus::kSkip, why});
      report.add_check({"bucket_counts", reports::CheckStatus::kSkip, why});
      return rec;
    }
    const std::string partial =
        complete ? "" : fmt::format(" (the run ended with an error after {} of {} cap(s))", rows.size(), candidates);
    report.add_check({"correctness", tools::pass_if(wrong == 0 && !rows.empty()),
                      fmt::format("{} wrong gradient element(s) over {} cap(s), every rank checked{}",
                                  wrong, rows.size(), partial)});
    report.add_check({"bucket_counts", tools::pass_if(counts_ok),
                      (counts_ok ? std::string("the reducer's buckets equal ddp_buckets() for every cap")
                                 : std::string("the reducer's bucket count differs from ddp_buckets()")) +
                          (counts_ok ? partial : "")});
    return rec;
  };

  std::optional<tools::CapRecommendation> rec;
  bool judged = false;
  try {
    for (std::size_t i = 0; i < candidates; ++i) {
      static const BucketCapList kNoList;
      const bool is_list = i >= caps.size();
      CapRow row = measure_cap(job, layout, is_list ? 0 : caps[i], is_list ? lists[i - caps.size()] : kNoList, o);
      if (job.rank() == 0) {
        auto mib = [](double b) { return b / kMiB; };
        auto sorted = row.bucket_bytes;
        std::sort(sorted.begin(), sorted.end());
        // A list: "list" in the cap column, the list at the end of the line.
        std::printf("  %8s %8zu %10.3f %10.3f %10.3f %10.2f %9.3f %12.2f %12.2f %12.2f %6lld%s\n",
                    is_list ? "list" : fmt::format("{:.4g}", row.cap_mb).c_str(), row.bucket_bytes.size(),
                    mib(static_cast<double>(sorted.front())), mib(median_bucket_bytes(row)),
                    mib(static_cast<double>(sorted.back())), row.comm_time_us / 1e3,
                    row.busbw_gbps, row.exposed_us / 1e3, row.step_us / 1e3, row.backward_us / 1e3,
                    static_cast<long long>(row.wrong),
                    is_list ? ("  bucket_cap_mb_list " + row.cap_list.text()).c_str() : "");
        std::fflush(stdout);
      }
      res["caps"].push_back(cap_json(row));
      rows.push_back(std::move(row));
      job.progress_line(fmt::format("[progress] cap {} of {} done", i + 1, candidates));
    }
    rec = judge(true);
    judged = true;
    if (job.rank() == 0 && rec) {
      if (rec->saving_us)
        std::printf("# Recommendation: %s (exposed %.2f ms; default 25: %.2f ms, saves "
                    "%.2f ms = %.1f%%)\n",
                    tools::recommended_setting(*rec).c_str(), rec->exposed_comm_time_us / 1e3,
                    *rec->default_exposed_comm_time_us / 1e3, *rec->saving_us / 1e3, *rec->saving_pct);
      else
        std::printf("# Recommendation: %s (exposed %.2f ms; the default 25 was not in "
                    "--caps)\n",
                    tools::recommended_setting(*rec).c_str(), rec->exposed_comm_time_us / 1e3);
      for (const auto& g : res["equivalent_caps"]) {
        std::string caps_text;
        for (const auto& c : g) caps_text += (caps_text.empty() ? "" : ", ") + fmt::format("{:g}", c.get<double>());
        std::printf("# caps %s build the same buckets: one configuration, whose times differ by "
                    "noise only\n",
                    caps_text.c_str());
      }
      std::fflush(stdout);
    }

    // Single all_reduce calls at bucket-like sizes.
    res["sizes"] = json::array();
    if (!o.no_size_sweep) {
      SweepOptions so;
      so.sizes = sweep_sizes(parse_size(o.sweep_min), parse_size(o.sweep_max), 4, 0, 4);
      so.iters = o.sweep_iters;
      so.warmup = 1;
      so.in_place = false;
      so.timeout = job.timeout;
      res["sizes_rotated_buffers"] = so.rotate_buffers.value_or(job.comm->memory_kind() == MemoryKind::kDevice);
      if (job.rank() == 0) {
        std::printf("# Plain all_reduce at bucket-like sizes (float sum, out of place, %d iters)\n",
                    so.iters);
        std::printf("# %12s %10s %9s %9s %6s\n", "size (B)", "time (us)", "algbw", "busbw", "#wrong");
      }
      so.on_size_done = [&](std::size_t, const SizeResult& r) {
        const auto& b = *r.out_of_place;
        if (job.rank() == 0) {
          std::printf("  %12zu %10.1f %9.3f %9.3f %6lld\n", r.bytes, b.time_us, b.algbw_gbps,
                      b.busbw_gbps, static_cast<long long>(b.wrong));
          std::fflush(stdout);
        }
        res["sizes"].push_back({{"collective", "all_reduce"},
                                {"bytes", r.bytes},
                                {"count", r.count},
                                {"dtype", "float"},
                                {"op", "sum"},
                                {"out_of_place",
                                 {{"time_us", b.time_us},
                                  {"algbw_gbps", b.algbw_gbps},
                                  {"busbw_gbps", b.busbw_gbps},
                                  {"wrong", b.wrong},
                                  {"min_rank_time_us", b.min_rank_time_us},
                                  {"max_rank_time_us", b.max_rank_time_us},
                                  {"fastest_rank", b.fastest_rank},
                                  {"slowest_rank", b.slowest_rank}}},
                                {"in_place", nullptr}});
      };
      run_allreduce_sweep(*job.comm, so, sweep);
      std::int64_t wrong = 0;
      for (const auto& s : sweep) wrong += std::max<std::int64_t>(0, s.out_of_place->wrong);
      report.add_check({"size_sweep_correctness", tools::pass_if(wrong == 0),
                        fmt::format("{} wrong element(s) over {} size(s)", wrong, sweep.size())});
    }
  } catch (...) {
    // A failure in the size sweep comes after the caps were judged.
    if (!judged) judge(false);
    throw;
  }
  if (job.rank() == 0) print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_bucket_sweep_command(CLI::App& parent) {
  auto opts = std::make_shared<BucketSweepOptions>();
  auto* app = parent.add_subcommand(
      "bucket-sweep",
      "Tune DDP's bucket_cap_mb: per cap the buckets, communication time, bus bandwidth and "
      "exposed (non-overlapped) time with a simulated backward; the recommended cap");
  add_common_options(app, opts->common);
  app->add_option("--model", opts->model, "Preset (resnet50, bert-large, gpt2, mlp) or JSON layout file")
      ->capture_default_str();
  app->add_option("--caps", opts->caps, "Comma-separated bucket_cap_mb values")
      ->check(cli::caps_value());
  app->add_option("--bucket-cap-mb-list", opts->cap_lists,
                  "torch 2.x's DDP(bucket_cap_mb_list=[...]) as one more candidate: a limit a bucket in "
                  "order, the last repeating (MiB, e.g. 1,4,25); give the flag again for another")
      ->check(cap_list_value(false));
  app->add_option("--first-bucket-mb", opts->first_bucket_mb, "DDP's first bucket size (MiB)")
      ->check(cli::bucket_mb_value(false));
  app->add_option("-n,--iters", opts->iters, "Timed iterations per cap and phase")
      ->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up iterations per cap and phase")
      ->check(cli::non_negative_number());
  app->add_option("--compute-gbps", opts->compute_gbps,
                  "Gradient bytes the simulated backward produces per second (GB/s); 0: no compute")
      ->check(cli::non_negative_number());
  app->add_flag("--no-size-sweep", opts->no_size_sweep, "Skip the plain all_reduce size sweep");
  app->add_flag("--find-unused-parameters", opts->find_unused,
                "DDP's find_unused_parameters=True: the buckets DDP keeps unrebuilt, and the "
                "used-parameter all_reduce each iteration");
  app->add_flag("--static-graph", opts->static_graph,
                "DDP's static_graph=True: the buckets DDP rebuilds from the gradients' order, "
                "then the parameters unused in backward (see buckets --static-graph)");
  add_skip_unused_flag(app, opts->skip_unused, "no all_reduce for a bucket whose parameters are all unused");
  add_set_last_bucket_cap_flag(app, opts->set_last_bucket_cap);
  app->add_option("--sweep-minbytes", opts->sweep_min, "Smallest size of the plain sweep")
      ->check(cli::size_value());
  app->add_option("--sweep-maxbytes", opts->sweep_max, "Largest size of the plain sweep")
      ->check(cli::size_value());
  app->add_option("--sweep-iters", opts->sweep_iters, "Iterations per size of the plain sweep")
      ->check(cli::positive_number());
  // Checked once the line is parsed, so the launcher refuses it before any
  // rank starts (each rank checks again in run()).
  app->parse_complete_callback([opts, app] {
    cli::refuse_empty_values(*app);  // before reading a value it made 0
    if (opts->no_size_sweep) return;
    if (const auto p = size_order_problem("--sweep-minbytes", opts->sweep_min, opts->sweep_max))
      throw CLI::ValidationError("--sweep-maxbytes", *p);
    // The plain sweep is of float all_reduces: below 4 bytes there is none.
    if (parse_size(opts->sweep_max) < 4)
      throw CLI::ValidationError("--sweep-maxbytes",
                                 fmt::format("{} B is less than one float element (4 B): no size to measure "
                                             "(give 4 or more)",
                                             opts->sweep_max));
  });
  return {app, [opts] {
            return run_distributed(
                opts->common, "bucket-sweep",
                [opts](Job& job, reports::Report& report) { run(job, report, *opts); },
                // The gradients and the buckets of a cap; then, on their
                // own, the plain sweep's buffers (as allreduce-test's).
                [opts](const Job& job) {
                  refuse_sparse_on_device(job, opts->model);
                  check_layout_memory(job, opts->model, 2, 0);
                  if (opts->no_size_sweep) return;
                  // Send, receive and host copy on Gloo; the host copy on NCCL.
                  const std::size_t largest = parse_size(opts->sweep_max) / 4 * 4;
                  check_host_memory(job, static_cast<long double>(largest) * (job.backend == Backend::kGloo ? 3 : 1),
                                    fmt::format("the plain sweep's buffers of {} (--sweep-maxbytes)",
                                                format_size(largest)),
                                    "use a smaller --sweep-maxbytes (or --no-size-sweep), or fewer "
                                    "ranks on this host");
                });
          }};
}

}  // namespace ddpdiag::cli
