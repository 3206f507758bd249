// ddpdiag allreduce-test: the pre-flight check. Can every rank meet, is
// all_reduce correct on every rank, is bandwidth what it should be. Columns and
// conventions follow nccl-tests so figures can be compared with it.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/measure.h"
#include "comm/net_info.h"
#include "diag/bisect.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/tools_analysis.h"

namespace ddpdiag::cli {

namespace {

struct AllreduceTestOptions {
  CommonOptions common;
  std::string min_bytes = "16";
  std::string max_bytes = "64M";
  double step_factor = 4;
  std::string step_bytes = "0";
  int iters = 20;
  int warmup = 5;
  int check_iters = 1;
  std::string dtype = "float";
  std::string op = "sum";
  bool no_in_place = false;
  bool no_out_of_place = false;
  double min_busbw_gbps = 0;
  double min_link_pct = 0;
  bool bisect = false;
};

// The ranks whose result had wrong elements (null when not checked).
nlohmann::json wrong_ranks_json(const TimingBlock& b) {
  if (b.wrong < 0) return nullptr;
  nlohmann::json out = nlohmann::json::array();
  for (std::size_t r = 0; r < b.wrong_by_rank.size(); ++r)
    if (b.wrong_by_rank[r] > 0) out.push_back(static_cast<int>(r));
  return out;
}

// ", element 0 = 4 instead of 3" for an entry of results.wrong_ranks ("" when
// it names no element); a value JSON cannot hold (NaN, inf) is null there.
std::string first_element_text(const nlohmann::json& w) {
  if (!w.contains("first_element") || !w["first_element"].is_number()) return "";
  auto value = [](const nlohmann::json& v) {
    return v.is_number() ? fmt::format("{}", v.get<double>()) : std::string("nan or inf");
  };
  return fmt::format(", element {} = {} instead of {}", w["first_element"].get<std::int64_t>(),
                     value(w["got"]), value(w["expected"]));
}

nlohmann::json block_json(const std::optional<TimingBlock>& b) {
  if (!b) return nullptr;
  return {{"time_us", b->time_us},
          {"algbw_gbps", b->algbw_gbps},
          {"busbw_gbps", b->busbw_gbps},
          {"wrong", b->wrong >= 0 ? nlohmann::json(b->wrong) : nlohmann::json()},
          {"wrong_ranks", wrong_ranks_json(*b)},
          {"min_rank_time_us", b->min_rank_time_us},
          {"max_rank_time_us", b->max_rank_time_us},
          {"fastest_rank", b->fastest_rank},
          {"slowest_rank", b->slowest_rank}};
}

std::string block_cells(const std::optional<TimingBlock>& b) {
  if (!b) return fmt::format("{:>10} {:>8} {:>8} {:>7}", "-", "-", "-", "-");
  std::string wrong = b->wrong < 0 ? "N/A" : std::to_string(b->wrong);
  return fmt::format("{:>10.1f} {:>8.3f} {:>8.3f} {:>7}", b->time_us, b->algbw_gbps,
                     b->busbw_gbps, wrong);
}

// Bus bandwidth at the largest size against the slowest link of the ranks,
// for Gloo runs on several hosts whose every link speed is known: a ring
// all_reduce's busbw cannot pass the link its traffic crosses, so this
// says how much of the network the run got. Nothing otherwise (one host:
// the traffic never leaves it; a speed unknown: no reference).
struct LinkShare {
  int slowest_mbps = 0;
  std::size_t bytes = 0;  // the largest size
  double busbw_gbps = 0;  // at that size
  DType dtype = DType::kFloat32;  // of the dtype/op judged (-d all -o all: the lowest)
  ReduceOp op = ReduceOp::kSum;
  double fraction() const { return busbw_gbps / link_gbytes_per_s(slowest_mbps); }
  nlohmann::json to_json() const {
    return {{"slowest_link_speed_mbps", slowest_mbps},
            {"bytes", bytes},
            {"busbw_gbps", busbw_gbps},
            {"dtype", std::string(dtype_name(dtype))},
            {"op", std::string(reduce_op_name(op))},
            {"fraction", fraction()}};
  }
};

// The largest size measured of each dtype/op swept, in sweep order (-d all
// -o all sweeps several; each is judged at its own largest size).
std::vector<const SizeResult*> largest_of_each_sweep(const std::vector<SizeResult>& results) {
  std::vector<const SizeResult*> lasts;
  for (const auto& r : results) {
    if (!lasts.empty() && lasts.back()->dtype == r.dtype && lasts.back()->op == r.op)
      lasts.back() = &r;
    else
      lasts.push_back(&r);
  }
  return lasts;
}

std::optional<LinkShare> busbw_vs_link(const Job& job, const std::vector<SizeResult>& results) {
  if (results.empty() || job.ranks.empty()) return std::nullopt;
  std::set<std::string> machines(job.machines.begin(), job.machines.end());
  if (machines.size() < 2 || job.machines.size() != job.ranks.size()) return std::nullopt;
  int slowest = 0;
  // Each rank's listening interface's link and every other one its routes
  // to peers leave by (egress).
  for (const auto& r : job.ranks) {
    const int mbps = reports::slowest_link_of(r);
    if (mbps <= 0) return std::nullopt;
    slowest = slowest ? std::min(slowest, mbps) : mbps;
  }
  // Every dtype/op at its largest size: the one that got the least of the
  // link is what the share (and --min-link-pct) is about.
  std::optional<LinkShare> least;
  for (const SizeResult* last : largest_of_each_sweep(results)) {
    const auto& b = last->out_of_place ? last->out_of_place : last->in_place;
    if (!b) continue;
    if (!least || b->busbw_gbps < least->busbw_gbps)
      least = LinkShare{slowest, last->bytes, b->busbw_gbps, last->dtype, last->op};
  }
  return least;
}

void print_header(const Job& job, const SweepOptions& so, const AllreduceTestOptions& o) {
  std::printf("# ddpdiag allreduce-test: %d rank(s), backend %s, launcher %s\n", job.size(),
              std::string(backend_name(job.backend)).c_str(),
              std::string(launcher_name(job.world.launcher)).c_str());
  std::printf("# iters %d, warmup %d, check iters %d, dtype %s, op %s\n", so.iters, so.warmup,
              so.check_iters, o.dtype.c_str(), o.op.c_str());
  // What small sizes' times include, for a comparison with nccl-tests
  // (README, allreduce-test): at one rank NCCL launches directly either way.
  if (job.backend == Backend::kNccl && job.size() > 1) {
    const char* blocking = std::getenv("NCCL_COMM_BLOCKING");
    if (blocking && std::string_view(blocking) == "1")
      std::printf("# nccl: blocking communicator (NCCL_COMM_BLOCKING=1): ops launched as nccl-tests "
                  "does; init and teardown wait on NCCL without ddpdiag's deadline\n");
    else
      std::printf("# nccl: non-blocking communicator: NCCL launches each op from a thread of its "
                  "own, which small sizes' times include (NCCL_COMM_BLOCKING=1: as nccl-tests)\n");
  }
  for (const auto& r : job.ranks) {
    const std::string text = rank_network_text(r, false);
    const std::string net = text.empty() ? "" : " net " + text;
    std::printf("#  Rank %3d Pid %7d on %12s device %s%s%s\n", r.rank, r.pid, r.host.c_str(),
                r.device.c_str(), r.cpus.empty() ? "" : (" cpus " + r.cpus).c_str(), net.c_str());
  }
  std::printf("#\n");
  std::printf("# %10s %12s %8s %6s  %-36s  %-36s  %s\n", "", "", "", "",
              "           out-of-place", "            in-place",
              // The spread of the block that ran: out-of-place unless skipped.
              so.out_of_place ? "  rank spread (oop)" : "  rank spread (ip)");
  std::printf("# %10s %12s %8s %6s  %10s %8s %8s %7s  %10s %8s %8s %7s  %10s %10s %5s\n",
              "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong", "time",
              "algbw", "busbw", "#wrong", "fastest", "slowest", "rank");
  std::printf("# %10s %12s %8s %6s  %10s %8s %8s %7s  %10s %8s %8s %7s  %10s %10s %5s\n", "(B)",
              "(elements)", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)",
              "", "(us)", "(us)", "");
  std::fflush(stdout);
}

void print_row(const SizeResult& r) {
  const auto& spread = r.out_of_place ? r.out_of_place : r.in_place;
  std::printf("  %10zu %12zu %8s %6s  %s  %s  %10.1f %10.1f %5d\n", r.bytes, r.count,
              std::string(dtype_name(r.dtype)).c_str(), std::string(reduce_op_name(r.op)).c_str(),
              block_cells(r.out_of_place).c_str(), block_cells(r.in_place).c_str(),
              spread->min_rank_time_us, spread->max_rank_time_us, spread->slowest_rank);
  std::fflush(stdout);
}

// -d's dtypes: "all" is every dtype, as nccl-tests' -d all; empty when the
// name is unknown.
std::vector<DType> dtypes_of(const std::string& name) {
  if (name == "all") return {std::begin(kAllDTypes), std::end(kAllDTypes)};
  if (auto d = parse_dtype(name)) return {*d};
  return {};
}

void run(Job& job, reports::Report& report, const AllreduceTestOptions& o) {
  SweepOptions so;
  // "all" runs every dtype (or op), as nccl-tests' -d all / -o all.
  const std::vector<DType> dtypes = dtypes_of(o.dtype);
  if (dtypes.empty()) {
    throw UsageError(fmt::format("unknown dtype '{}'", o.dtype),
                     {"flags", job.rank(), -1,
                      "use one of float, double, half, bfloat16, int32, int64, int8, uint8, all"});
  }
  std::vector<ReduceOp> ops;
  if (o.op == "all") {
    ops.assign(std::begin(kAllReduceOps), std::end(kAllReduceOps));
  } else if (auto r = parse_reduce_op(o.op)) {
    ops.push_back(*r);
  } else {
    throw UsageError(fmt::format("unknown reduction '{}'", o.op),
                     {"flags", job.rank(), -1, "use one of sum, prod, min, max, avg, all"});
  }
  so.dtype = dtypes.front();
  so.op = ops.front();
  so.iters = o.iters;
  so.warmup = o.warmup;
  so.check_iters = o.check_iters;
  so.in_place = !o.no_in_place;
  so.out_of_place = !o.no_out_of_place;
  so.timeout = job.timeout;
  std::size_t minb = parse_size(o.min_bytes), maxb = parse_size(o.max_bytes);
  if (maxb < minb)
    throw UsageError(fmt::format("--maxbytes {} is below --minbytes {}", o.max_bytes, o.min_bytes),
                     {"flags", job.rank(), -1, "swap them"});
  const std::size_t stepb = parse_size(o.step_bytes);
  if (!so.in_place && !so.out_of_place)
    throw UsageError("--no-in-place and --no-out-of-place together leave nothing to run",
                     {"flags", job.rank(), -1, "drop one of them"});

  auto& res = report.results();
  {
    std::vector<std::string> op_names, dtype_names;
    for (auto r : ops) op_names.emplace_back(reduce_op_name(r));
    for (auto d : dtypes) dtype_names.emplace_back(dtype_name(d));
    const std::string idle = tools::in_place_no_work_warning(
        job.size(), backend_name(job.backend), so.in_place, op_names, dtype_names);
    if (!idle.empty()) {
      if (!res.contains("warnings")) res["warnings"] = nlohmann::json::array();
      res["warnings"].push_back({{"name", "in_place_no_work"}, {"detail", idle}});
      if (job.rank() == 0) std::fprintf(stderr, "ddpdiag: warning: %s\n", idle.c_str());
    }
  }
  res["collective"] = "all_reduce";
  res["dtypes"] = nlohmann::json::array();
  for (auto d : dtypes) res["dtypes"].push_back(std::string(dtype_name(d)));
  res["ops"] = nlohmann::json::array();
  for (auto r : ops) res["ops"].push_back(std::string(reduce_op_name(r)));
  res["iters"] = so.iters;
  res["warmup_iters"] = so.warmup;
  res["check_iters"] = so.check_iters;
  res["rotated_buffers"] = so.rotate_buffers.value_or(job.comm->memory_kind() == MemoryKind::kDevice);
  res["sizes"] = nlohmann::json::array();

  // Before the header: a line refused prints no table.
  for (auto d : dtypes)
    if (maxb < dtype_size(d))
      throw UsageError(fmt::format("-e {} B is less than one {} element ({} B): no size to measure",
                                   maxb, dtype_name(d), dtype_size(d)),
                       {"flags", job.rank(), -1,
                        fmt::format("give -e {} or more", dtype_size(d))});
  if (job.rank() == 0) print_header(job, so, o);
  std::vector<SizeResult> results;
  so.on_size_done = [&](std::size_t i, const SizeResult& r) {
    if (job.rank() == 0) {
      print_row(r);
      job.progress_line(fmt::format("[progress] {} of {} sizes done ({})", i + 1, so.sizes.size(),
                                    format_size(r.bytes)));
    }
    res["sizes"].push_back({{"bytes", r.bytes},
                            {"count", r.count},
                            {"dtype", std::string(dtype_name(r.dtype))},
                            {"op", std::string(reduce_op_name(r.op))},
                            {"out_of_place", block_json(r.out_of_place)},
                            {"in_place", block_json(r.in_place)}});
  };

  // Checks are judged from whatever was measured, also when the sweep stops
  // part-way (complete false), so a failed run still reports its findings;
  // but nothing passes, and no average is given, over sizes never measured.
  // Set by judge: busbw against the slowest link, where that is known.
  std::optional<LinkShare> link;
  auto judge = [&](bool complete) {
    std::int64_t wrong = 0;
    bool checked = so.check_iters > 0;
    for (const auto& r : results)
      for (const auto* b : {&r.out_of_place, &r.in_place})
        if (*b && (*b)->wrong > 0) wrong += (*b)->wrong;
    double avg_busbw = 0;
    int nb = 0;
    for (const auto& r : results)
      for (const auto* b : {&r.out_of_place, &r.in_place})
        if (*b) {
          avg_busbw += (*b)->busbw_gbps;
          ++nb;
        }
    if (nb || complete)
      res["avg_busbw_gbps"] = nb ? avg_busbw / nb : 0.0;
    else
      res.erase("avg_busbw_gbps");
    res["wrong_total"] = wrong;
    // Which ranks had wrong results, each with its count and the first
    // place it went wrong: the bad rank (GPU, host) to look at.
    struct RankWrong {
      std::int64_t wrong = 0;
      std::string first;     // the size, dtype, op and placement
      WrongElements element;  // the first wrong element there
    };
    std::map<int, RankWrong> by_rank;
    for (const auto& r : results)
      for (const auto& [b, placement] : {std::pair{&r.out_of_place, "out-of-place"},
                                         std::pair{&r.in_place, "in-place"}}) {
        if (!*b) continue;
        for (std::size_t k = 0; k < (*b)->wrong_by_rank.size(); ++k) {
          if ((*b)->wrong_by_rank[k] <= 0) continue;
          auto& w = by_rank[static_cast<int>(k)];
          if (w.first.empty()) {
            w.first = fmt::format("{} B {} {} {}", r.bytes, dtype_name(r.dtype),
                                  reduce_op_name(r.op), placement);
            if (k < (*b)->first_wrong_by_rank.size()) w.element = (*b)->first_wrong_by_rank[k];
          }
          w.wrong += (*b)->wrong_by_rank[k];
        }
      }
    std::string wrong_where;
    nlohmann::json wrong_ranks = nlohmann::json::array();
    for (auto& [rank, w] : by_rank) {
      std::string host;
      for (const auto& info : job.ranks)
        if (info.rank == rank) host = info.host;
      // A NaN or infinity has no JSON number: null there, "nan" in text.
      auto number = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
      const bool have_element = w.element.first >= 0;
      wrong_ranks.push_back({{"rank", rank},
                             {"host", host},
                             {"wrong", w.wrong},
                             {"first", w.first},
                             {"first_element", have_element ? nlohmann::json(w.element.first) : nlohmann::json()},
                             {"got", have_element ? number(w.element.got) : nlohmann::json()},
                             {"expected", have_element ? number(w.element.expected) : nlohmann::json()}});
      if (have_element)
        w.first += fmt::format(", element {} = {} instead of {}", w.element.first, w.element.got,
                               w.element.expected);
      if (by_rank.size() <= 8)
        wrong_where += fmt::format("{}rank {}{}: {} (first at {})", wrong_where.empty() ? "" : "; ",
                                   rank, host.empty() ? "" : " on " + host, w.wrong, w.first);
    }
    if (by_rank.size() > 8)
      wrong_where = fmt::format("{} of {} ranks (results.wrong_ranks lists them)", by_rank.size(),
                                job.size());
    res["wrong_ranks"] = wrong_ranks;
    const char* none_measured = "the run ended with an error before any size was measured";
    const std::string partial =
        complete ? "" : " before the run ended with an error";
    if (!checked)
      report.add_check({"correctness", reports::CheckStatus::kSkip, "-c 0: no check was run"});
    else if (results.empty() && !complete)
      report.add_check({"correctness", reports::CheckStatus::kSkip, none_measured});
    else
      report.add_check({"correctness", wrong == 0 ? reports::CheckStatus::kPass
                                                  : reports::CheckStatus::kFail,
                        fmt::format("{} wrong element(s) summed over {} rank(s) and {} size(s){}{}",
                                    wrong, job.size(), results.size(), partial,
                                    wrong_where.empty() ? "" : "; wrong on " + wrong_where)});
    if (o.min_busbw_gbps > 0) {
      if (results.empty() && !complete) {
        report.add_check({"min_busbw", reports::CheckStatus::kSkip, none_measured});
      } else if (results.empty()) {
        report.add_check({"min_busbw", reports::CheckStatus::kFail, "no size was measured"});
      } else {
        // The largest size of each dtype/op swept (-d all -o all sweeps
        // several): every one must meet the threshold.
        const auto lasts = largest_of_each_sweep(results);
        bool ok = true;
        std::string detail;
        for (const auto* last : lasts) {
          const auto& b = last->out_of_place ? last->out_of_place : last->in_place;
          const bool meets = b->busbw_gbps >= o.min_busbw_gbps;
          ok = ok && meets;
          detail += fmt::format("{}busbw {:.3f} GB/s at {} B{} {} the threshold", detail.empty() ? "" : "; ",
                                b->busbw_gbps, last->bytes,
                                lasts.size() > 1 ? fmt::format(" ({} {})", dtype_name(last->dtype),
                                                               reduce_op_name(last->op))
                                                 : std::string(),
                                meets ? "meets" : "is under");
        }
        report.add_check({"min_busbw", ok ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                          fmt::format("{} {:.4g} GB/s{}", detail, o.min_busbw_gbps,
                                      complete ? std::string()
                                               : fmt::format(" (the largest size measured before "
                                                             "the run ended with an error; the "
                                                             "sweep was to go up to -e {})",
                                                             o.max_bytes))});
      }
    }
    link = busbw_vs_link(job, results);
    if (link) res["busbw_vs_link"] = link->to_json();
    if (o.min_link_pct > 0) {
      if (results.empty()) {
        report.add_check({"min_link_pct", reports::CheckStatus::kSkip, none_measured});
      } else if (!link) {
        report.add_check({"min_link_pct", reports::CheckStatus::kSkip,
                          "no link to compare with: the ranks run on one host, or the kernel does not "
                          "know every rank's link speed (virtual NICs, NCCL); use --min-busbw"});
      } else {
        const double pct = 100 * link->fraction();
        const bool ok = pct >= o.min_link_pct;
        report.add_check({"min_link_pct", ok ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                          fmt::format("busbw {:.3f} GB/s at {} B ({} {}) is {:.{}f}% of the slowest link ({}, {:.4g} "
                                      "GB/s), {} the threshold {:g}%",
                                      link->busbw_gbps, link->bytes, dtype_name(link->dtype),
                                      reduce_op_name(link->op), pct, pct < 10 ? 1 : 0,
                                      format_link_speed(link->slowest_mbps),
                                      link_gbytes_per_s(link->slowest_mbps), ok ? "meeting" : "under",
                                      o.min_link_pct)});
      }
    }
    return std::pair{wrong, nb ? avg_busbw / nb : 0.0};
  };

  std::size_t combos_done = 0;
  const std::size_t combos = dtypes.size() * ops.size();
  try {
    for (auto d : dtypes)
      for (auto r : ops) {
        so.dtype = d;
        so.op = r;
        so.sizes = sweep_sizes(minb, maxb, o.step_factor, stepb, dtype_size(d));
        run_allreduce_sweep(*job.comm, so, results);
        ++combos_done;
        if (combos > 1)
          job.progress_line(fmt::format("[progress] {} of {} dtype/op combinations done",
                                        combos_done, combos));
      }
  } catch (...) {
    judge(false);
    // Sub-groups are tested after a run that completed (its checks failed or
    // not); a run that ended with an error (a rank dead, hung or stopped)
    // already has the watchdog's diagnosis naming the rank, and sub-groups
    // holding that rank would only wait out --timeout each.
    if (o.bisect && job.rank() == 0)
      report.add_check({"bisect", reports::CheckStatus::kSkip,
                        "not run: the run ended with an error, whose diagnosis names the rank; "
                        "--bisect tests sub-groups after a run that completes"});
    throw;
  }
  auto [wrong, avg] = judge(true);
  if (o.bisect) {
    BisectOptions bo;
    bo.world_passed = wrong == 0 && !report.has_failed_check();
    auto verdict = run_bisect(job, o.common, bo, report);
    if (job.rank() == 0) {
      res["bisect"] = verdict;
      print_bisect(verdict, job.size());
    }
  }
  if (job.rank() == 0) {
    if (so.check_iters > 0)
      std::printf("# Out of bounds values : %lld %s\n", static_cast<long long>(wrong),
                  wrong == 0 ? "OK" : "FAILED");
    else
      std::printf("# Out of bounds values : N/A (-c 0: not checked)\n");
    if (res.contains("wrong_ranks"))
      for (const auto& w : res["wrong_ranks"])
        std::printf("# Wrong on rank %d%s : %lld element(s), first at %s%s\n", w["rank"].get<int>(),
                    w["host"].get<std::string>().empty()
                        ? ""
                        : (" (" + w["host"].get<std::string>() + ")").c_str(),
                    static_cast<long long>(w["wrong"].get<std::int64_t>()),
                    w["first"].get<std::string>().c_str(), first_element_text(w).c_str());
    std::printf("# Avg bus bandwidth    : %.4f GB/s\n", avg);
    if (link)
      std::printf("# Slowest link         : %s (%.3f GB/s); busbw at %zu B (%s %s) is %.3f GB/s, %.*f%% of it\n",
                  format_link_speed(link->slowest_mbps).c_str(), link_gbytes_per_s(link->slowest_mbps),
                  link->bytes, std::string(dtype_name(link->dtype)).c_str(),
                  std::string(reduce_op_name(link->op)).c_str(), link->busbw_gbps,
                  100 * link->fraction() < 10 ? 1 : 0,
                  100 * link->fraction());
    print_checks_and_verdict(report);
  }
}

}  // namespace

Subcommand add_allreduce_test_command(CLI::App& parent) {
  auto opts = std::make_shared<AllreduceTestOptions>();
  auto* app = parent.add_subcommand(
      "allreduce-test",
      "Pre-flight: every rank meets, all_reduce is correct on every rank, bandwidth per size");
  add_common_options(app, opts->common);
  app->add_option("-b,--minbytes", opts->min_bytes, "Smallest size (8, 1K, 64M, ...)")
      ->check(cli::size_value());
  app->add_option("-e,--maxbytes", opts->max_bytes, "Largest size")
      ->check(cli::size_value());
  app->add_option("-f,--stepfactor", opts->step_factor,
                  "Multiply the size by this each step (> 1; unused with -i)");
  // Given, -i must step: 0 would never reach -e. Left out, the sweep
  // multiplies by -f.
  app->add_option("-i,--stepbytes", opts->step_bytes,
                  "Add this many bytes (> 0) each step instead of multiplying by -f")
      ->check(cli::positive_size_value("leave -i out to multiply by -f"));
  app->add_option("-n,--iters", opts->iters, "Timed iterations per size")->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up iterations per size")
      ->check(cli::non_negative_number());
  app->add_option("-c,--check", opts->check_iters,
                  "Correctness iterations per size (0: no check)")
      ->check(cli::non_negative_number());
  // Checked at parse time, in the launcher and in every rank before the
  // rendezvous, so a typo is exit 2 everywhere instead of one rank leaving
  // the others to fail their connection.
  auto parsed_or_all = [](auto parse, std::string what, std::string choices, std::string name) {
    return CLI::Validator(
        [=](std::string& s) -> std::string {
          return s == "all" || parse(s)
                     ? std::string()
                     : "unknown " + what + " '" + s + "'; use one of " + choices + ", all";
        },
        name);
  };
  app->add_option("-d,--datatype,--dtype", opts->dtype,
                  "float, double, half, bfloat16, int32, int64, int8, uint8, or all")
      ->check(parsed_or_all([](const std::string& s) { return parse_dtype(s).has_value(); },
                            "dtype", "float, double, half, bfloat16, int32, int64, int8, uint8",
                            "DTYPE"));
  app->add_option("-o,--op", opts->op, "sum, prod, min, max, avg, or all")
      ->check(parsed_or_all([](const std::string& s) { return parse_reduce_op(s).has_value(); },
                            "reduction", "sum, prod, min, max, avg", "OP"));
  app->add_flag("--no-in-place", opts->no_in_place, "Skip the in-place block");
  app->add_flag("--no-out-of-place", opts->no_out_of_place, "Skip the out-of-place block");
  app->add_option("--min-busbw", opts->min_busbw_gbps,
                  "FAIL when bus bandwidth at the largest size is under this many GB/s")
      ->check(cli::non_negative_number());
  app->add_option("--min-link-pct", opts->min_link_pct,
                  "FAIL when bus bandwidth at the largest size is under this % of the slowest rank's "
                  "link speed (Gloo across hosts, where the kernel knows every link's speed)")
      ->check(cli::number_in_range(0, 100));
  app->add_flag("--bisect", opts->bisect,
                "After the sweep, test sub-groups (each host alone, pairs of hosts, halves) and "
                "name the smallest failing or slow set and the rank/host it points to");
  // Checks of several flags together, once the line is parsed, so that the
  // launcher refuses a mistake once, before any rank starts (each rank
  // checks again: it may have been started by another launcher).
  app->parse_complete_callback([opts, app] {
    cli::refuse_empty_values(*app);  // before reading a value it made 0
    const auto size_or = [](const std::string& s, std::size_t fallback) {
      try {
        return parse_size(s);
      } catch (const UsageError&) {  // the flag's own check names it
        return fallback;
      }
    };
    // A factor of 1 or less never reaches -e; it is fine only when -i steps
    // instead (nccl-tests' linear sweep: -f is then unused).
    if (!std::isfinite(opts->step_factor))
      throw CLI::ValidationError("--stepfactor",
                                 fmt::format("must be a finite number > 1, not {}", opts->step_factor));
    if (opts->step_factor <= 1 && size_or(opts->step_bytes, 0) == 0)
      throw CLI::ValidationError(
          "--stepfactor", fmt::format("must be a number > 1, not {} (or step by bytes with -i)",
                                      opts->step_factor));
    if (const auto p = size_order_problem("--minbytes", opts->min_bytes, opts->max_bytes))
      throw CLI::ValidationError("--maxbytes", *p);
    if (opts->no_in_place && opts->no_out_of_place)
      throw CLI::ValidationError("--no-in-place",
                                 "with --no-out-of-place leaves nothing to run (drop one of them)");
  });
  return {app, [opts] {
            return run_distributed(
                opts->common, "allreduce-test",
                [opts](Job& job, reports::Report& report) { run(job, report, *opts); },
                [opts](const Job& job) {
                  // Gloo: send and receive buffers and a host copy, all in
                  // host memory; NCCL: the host copy (the buffers are the
                  // device's).
                  // The sweep's largest size, which may be below -e (-f 4
                  // from 16 B reaches powers of 4 only).
                  const std::vector<DType> dtypes = dtypes_of(opts->dtype);
                  const std::size_t minb = parse_size(opts->min_bytes), maxb = parse_size(opts->max_bytes);
                  std::size_t largest = 0;
                  for (auto d : dtypes)
                    if (maxb >= minb && maxb >= dtype_size(d))
                      for (std::size_t b : sweep_sizes(minb, maxb, opts->step_factor,
                                                       parse_size(opts->step_bytes), dtype_size(d)))
                        largest = std::max(largest, b);
                  check_host_memory(
                      job, static_cast<long double>(largest) * (job.backend == Backend::kGloo ? 3 : 1),
                      fmt::format("buffers of {} (the sweep's largest size)", format_size(largest)),
                      "use a smaller -e, or fewer ranks on this host");
                });
          }};
}

}  // namespace ddpdiag::cli
