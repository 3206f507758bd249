// ddpdiag dp-vs-ring: DataParallel-style gather-reduce-broadcast against the
// ring all_reduce, both built on the Communicator's send/recv
// (comm/algorithms), and the backend's own all_reduce, at the sizes and world
// sizes asked for. Per algorithm and size: time, algbw/busbw, the bytes each
// rank sent and received (counted by the algorithms' wrapper, checked against
// theory exactly), the peak extra memory on rank 0 against the others, and
// correctness on every rank. The root's traffic, 2(n-1)·S, grows with n while
// the ring's stays at 2(n-1)/n·S per direction: the table makes it visible.
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/algorithms/gather_reduce.h"
#include "comm/algorithms/ring_allreduce.h"
#include "comm/measure.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/tools_common.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
namespace alg = ddpdiag::algorithms;

struct DpVsRingOptions {
  CommonOptions common;
  std::string min_bytes = "1K";
  std::string max_bytes = "16M";
  double step_factor = 4;
  int iters = 10;
  int warmup = 2;
  std::string dtype = "float";
  std::string world_sizes;  // comma-separated; empty: the job's
  std::string algorithms = "gather,ring,backend";
};

enum class Algo { kGather, kRing, kBackend };

std::string_view algo_name(Algo a) {
  switch (a) {
    case Algo::kGather: return "gather";
    case Algo::kRing: return "ring";
    case Algo::kBackend: return "backend";
  }
  return "?";
}

// One rank's figures for one (algorithm, size), gathered as doubles (exact:
// every figure is an integer below 2^53).
struct RankFigures {
  double bytes_sent = 0, bytes_received = 0, extra_bytes = 0, wrong = 0;
  double theory_sent = 0, theory_received = 0, theory_extra = 0;
};

struct Row {
  Algo algo = Algo::kGather;
  int world_size = 0;
  std::size_t bytes = 0;
  std::size_t count = 0;
  TimingBlock timing;
  bool traffic_known = false;  // our algorithms only; the backend's own is opaque
  std::vector<RankFigures> ranks;
  bool traffic_exact = true;  // measured == theory on every rank
  bool extra_exact = true;
  double nominal_ring_bytes = 0;
};

Row measure(Communicator& comm, Algo algo, std::size_t bytes, DType dtype, const DpVsRingOptions& o,
            Millis timeout) {
  const int n = comm.size(), me = comm.rank();
  const std::size_t es = dtype_size(dtype);
  Row row;
  row.algo = algo;
  row.world_size = n;
  row.count = std::max<std::size_t>(1, bytes / es);
  row.bytes = row.count * es;
  CommBuffer buf(comm, row.bytes);
  std::vector<std::uint8_t> host(row.bytes);
  fill_exact_inputs(dtype, ReduceOp::kSum, n, me, host.data(), row.count);
  comm.copy_from_host(buf.get(), host.data(), row.bytes);

  alg::CountingLinks links(comm);
  alg::ScratchMemory scratch(comm);
  auto run_once = [&] {
    switch (algo) {
      case Algo::kGather:
        alg::gather_reduce_allreduce(links, scratch, buf.get(), row.count, dtype, ReduceOp::kSum,
                                     timeout);
        break;
      case Algo::kRing:
        alg::ring_allreduce(links, scratch, buf.get(), row.count, dtype, ReduceOp::kSum, timeout);
        break;
      case Algo::kBackend:
        comm.allreduce(buf.get(), buf.get(), row.count, dtype, ReduceOp::kSum)->wait(timeout);
        break;
    }
  };
  row.timing = tools::time_on_every_rank(comm, o.iters, o.warmup, row.bytes, timeout, run_once);

  // One more call on exact inputs: its traffic, scratch peak and result are
  // what the row reports.
  fill_exact_inputs(dtype, ReduceOp::kSum, n, me, host.data(), row.count);
  comm.copy_from_host(buf.get(), host.data(), row.bytes);
  comm.barrier()->wait(timeout);
  links.reset();
  scratch.reset_peak();
  run_once();
  comm.copy_to_host(host.data(), buf.get(), row.bytes);
  const std::int64_t wrong = count_wrong_allreduce(dtype, ReduceOp::kSum, n, host.data(), row.count);

  alg::TrafficTheory theory;
  if (algo == Algo::kGather) theory = alg::gather_reduce_theory(n, me, 0, row.bytes);
  if (algo == Algo::kRing) theory = alg::ring_allreduce_theory(row.count, es, n, me);
  row.traffic_known = algo != Algo::kBackend;
  std::vector<double> mine = {static_cast<double>(links.traffic().bytes_sent),
                              static_cast<double>(links.traffic().bytes_received),
                              static_cast<double>(scratch.peak_bytes()),
                              static_cast<double>(wrong),
                              static_cast<double>(theory.bytes_sent),
                              static_cast<double>(theory.bytes_received),
                              static_cast<double>(theory.extra_bytes)};
  const auto all = allgather_doubles(comm, mine, timeout);
  std::int64_t wrong_total = 0;
  for (int r = 0; r < n; ++r) {
    const double* f = all.data() + static_cast<std::size_t>(r) * mine.size();
    RankFigures rf{f[0], f[1], f[2], f[3], f[4], f[5], f[6]};
    wrong_total += static_cast<std::int64_t>(rf.wrong);
    if (row.traffic_known) {
      row.traffic_exact = row.traffic_exact && rf.bytes_sent == rf.theory_sent &&
                          rf.bytes_received == rf.theory_received;
      row.extra_exact = row.extra_exact && rf.extra_bytes == rf.theory_extra;
    }
    row.ranks.push_back(rf);
  }
  row.timing.wrong = wrong_total;
  row.nominal_ring_bytes = alg::ring_nominal_bytes(row.bytes, n);
  return row;
}

json row_json(const Row& r, DType dtype) {
  json ranks = json::array();
  for (std::size_t i = 0; i < r.ranks.size(); ++i) {
    const auto& f = r.ranks[i];
    auto opt = [&](double v) { return r.traffic_known ? json(static_cast<std::uint64_t>(v)) : json(); };
    ranks.push_back({{"rank", i},
                     {"bytes_sent", opt(f.bytes_sent)},
                     {"bytes_received", opt(f.bytes_received)},
                     {"theory_bytes_sent", opt(f.theory_sent)},
                     {"theory_bytes_received", opt(f.theory_received)},
                     {"extra_bytes", opt(f.extra_bytes)},
                     {"theory_extra_bytes", opt(f.theory_extra)},
                     {"wrong", static_cast<std::int64_t>(f.wrong)}});
  }
  const auto& t = r.timing;
  json block = {{"time_us", t.time_us},
                {"algbw_gbps", t.algbw_gbps},
                {"busbw_gbps", t.busbw_gbps},
                {"wrong", t.wrong},
                {"min_rank_time_us", t.min_rank_time_us},
                {"max_rank_time_us", t.max_rank_time_us},
                {"fastest_rank", t.fastest_rank},
                {"slowest_rank", t.slowest_rank}};
  json j = {{"collective", "all_reduce"},
            {"algorithm", std::string(algo_name(r.algo))},
            {"world_size", r.world_size},
            {"bytes", r.bytes},
            {"count", r.count},
            {"dtype", std::string(dtype_name(dtype))},
            {"op", "sum"},
            {"in_place", block},
            {"out_of_place", nullptr},
            {"ranks", ranks},
            {"nominal_ring_bytes_per_rank", r.nominal_ring_bytes}};
  if (r.traffic_known) {
    double others_sent = 0, others_extra = 0;
    for (std::size_t i = 1; i < r.ranks.size(); ++i) {
      others_sent = std::max(others_sent, r.ranks[i].bytes_sent + r.ranks[i].bytes_received);
      others_extra = std::max(others_extra, r.ranks[i].extra_bytes);
    }
    j["rank0_bytes_moved"] = static_cast<std::uint64_t>(r.ranks[0].bytes_sent + r.ranks[0].bytes_received);
    j["max_other_bytes_moved"] = static_cast<std::uint64_t>(others_sent);
    j["rank0_extra_bytes"] = static_cast<std::uint64_t>(r.ranks[0].extra_bytes);
    j["max_other_extra_bytes"] = static_cast<std::uint64_t>(others_extra);
    j["traffic_matches_theory"] = r.traffic_exact;
    j["extra_memory_matches_theory"] = r.extra_exact;
  } else {
    for (const char* k : {"rank0_bytes_moved", "max_other_bytes_moved", "rank0_extra_bytes",
                          "max_other_extra_bytes", "traffic_matches_theory",
                          "extra_memory_matches_theory"})
      j[k] = nullptr;
  }
  return j;
}

std::string cell_bytes(const Row& r, double v) {
  return r.traffic_known ? fmt::format("{}", static_cast<std::uint64_t>(v)) : std::string("-");
}

void print_header(const Job& job, const DpVsRingOptions& o) {
  std::printf("# ddpdiag dp-vs-ring: %d rank(s), backend %s; all_reduce %s sum, in place; "
              "iters %d, warmup %d\n",
              job.size(), std::string(backend_name(job.backend)).c_str(), o.dtype.c_str(), o.iters,
              o.warmup);
  std::printf("# gather: every rank -> rank 0, reduce, rank 0 -> every rank; ring: reduce-scatter + "
              "all-gather; backend: the backend's own all_reduce\n");
  std::printf("# bytes moved = sent + received by one rank over one call (theory: gather root "
              "2(n-1)S, others 2S; ring 2 x 2(n-1)/n S)\n");
  if (job.backend == Backend::kNccl)
    std::printf("# nccl: gather and ring reduce on the host (each piece copied off the GPU and "
                "back, in their times): compare their bytes, not their times, with the backend's\n");
  std::printf("# %3s %-8s %10s %10s %9s %9s %12s %12s %7s %11s %11s %6s\n", "n", "algo",
              "size", "time", "algbw", "busbw", "moved rank0", "moved other", "theory", "extra r0",
              "extra other", "#wrong");
  std::printf("# %3s %-8s %10s %10s %9s %9s %12s %12s %7s %11s %11s %6s\n", "", "", "(B)", "(us)",
              "(GB/s)", "(GB/s)", "(B)", "(B, max)", "", "(B)", "(B, max)", "");
  std::fflush(stdout);
}

void print_row(const Row& r) {
  double moved_other = 0, extra_other = 0;
  for (std::size_t i = 1; i < r.ranks.size(); ++i) {
    moved_other = std::max(moved_other, r.ranks[i].bytes_sent + r.ranks[i].bytes_received);
    extra_other = std::max(extra_other, r.ranks[i].extra_bytes);
  }
  const double moved0 = r.ranks.empty() ? 0 : r.ranks[0].bytes_sent + r.ranks[0].bytes_received;
  const double extra0 = r.ranks.empty() ? 0 : r.ranks[0].extra_bytes;
  std::printf("  %3d %-8s %10zu %10.1f %9.3f %9.3f %12s %12s %7s %11s %11s %6lld\n", r.world_size,
              std::string(algo_name(r.algo)).c_str(), r.bytes, r.timing.time_us,
              r.timing.algbw_gbps, r.timing.busbw_gbps, cell_bytes(r, moved0).c_str(),
              r.ranks.size() > 1 ? cell_bytes(r, moved_other).c_str() : "-",
              !r.traffic_known ? "-" : (r.traffic_exact && r.extra_exact ? "exact" : "WRONG"),
              cell_bytes(r, extra0).c_str(),
              r.ranks.size() > 1 ? cell_bytes(r, extra_other).c_str() : "-",
              static_cast<long long>(r.timing.wrong));
  std::fflush(stdout);
}

// The world sizes to run at (--world-sizes; default the job's). Throws
// UsageError naming an entry outside 1..the job's size.
// One entry of --world-sizes as a number, or -1 where the whole entry is not
// one ('2abc' and '2.9' are not 2).
int world_size_entry(const std::string& w) {
  int k = -1;
  if (const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), k);
      ec != std::errc() || end != w.data() + w.size())
    return -1;
  return k;
}

std::set<int> world_sizes_of(const DpVsRingOptions& o, const Job& job) {
  std::set<int> ks;
  for (const auto& w : split_list(o.world_sizes, "--world-sizes", "2,4", job.rank())) {
    const int k = world_size_entry(w);
    if (k < 1 || k > job.size())
      throw UsageError(fmt::format("--world-sizes: '{}' is not in 1..{}", w, job.size()),
                       {"flags", job.rank(), -1, "list world sizes up to the job's rank count"});
    ks.insert(k);
  }
  if (ks.empty()) ks.insert(job.size());
  return ks;
}

void run(Job& job, reports::Report& report, const DpVsRingOptions& o) {
  auto dtype = parse_dtype(o.dtype);
  if (!dtype)
    throw UsageError(fmt::format("unknown dtype '{}'", o.dtype),
                     {"flags", job.rank(), -1, "use float, double, half, bfloat16, int32, ..."});
  std::vector<Algo> algos;
  for (const auto& a : split_list(o.algorithms, "--algorithms", "gather,ring,backend", job.rank())) {
    Algo algo;
    if (a == "gather") algo = Algo::kGather;
    else if (a == "ring") algo = Algo::kRing;
    else if (a == "backend") algo = Algo::kBackend;
    else
      throw UsageError(fmt::format("unknown algorithm '{}'", a),
                       {"flags", job.rank(), -1, "use a list of gather, ring, backend"});
    // Named twice, measured once (as --world-sizes and bucket-sweep's --caps).
    if (std::find(algos.begin(), algos.end(), algo) == algos.end()) algos.push_back(algo);
  }
  if (algos.empty())
    throw UsageError("--algorithms is empty", {"flags", job.rank(), -1, "e.g. gather,ring,backend"});
  const std::set<int> ks = world_sizes_of(o, job);
  const std::size_t minb = parse_size(o.min_bytes), maxb = parse_size(o.max_bytes);
  if (maxb < minb)
    throw UsageError(fmt::format("--maxbytes {} is below --minbytes {}", o.max_bytes, o.min_bytes),
                     {"flags", job.rank(), -1, "swap them"});
  if (maxb < dtype_size(*dtype))
    throw UsageError(fmt::format("-e {} B is less than one {} element ({} B): no size to measure", maxb,
                                 dtype_name(*dtype), dtype_size(*dtype)),
                     {"flags", job.rank(), -1, fmt::format("give -e {} or more", dtype_size(*dtype))});
  const auto sizes = sweep_sizes(minb, maxb, o.step_factor, 0, dtype_size(*dtype));

  auto& res = report.results();
  res["collective"] = "all_reduce";
  res["dtype"] = std::string(dtype_name(*dtype));
  res["op"] = "sum";
  res["iters"] = o.iters;
  res["warmup_iters"] = o.warmup;
  res["world_sizes"] = std::vector<int>(ks.begin(), ks.end());
  res["algorithms"] = json::array();
  for (auto a : algos) res["algorithms"].push_back(std::string(algo_name(a)));
  res["chunking_rule"] =
      "ring chunk c has floor(count/n) elements plus one for c < count mod n; rank r sends 2S - "
      "bytes(chunk (r+1) mod n) - bytes(chunk (r+2) mod n), exactly 2(n-1)/n*S when count is a "
      "multiple of n";
  res["sizes"] = json::array();
  if (job.rank() == 0) print_header(job, o);

  std::vector<Row> rows;
  // complete: every world size, size and algorithm was measured. A run that
  // ended with an error judges only the rows it has, and passes nothing
  // when it has none.
  auto judge = [&](bool complete) {
    std::int64_t wrong = 0;
    bool traffic_ok = true, extra_ok = true;
    std::size_t traffic_rows = 0;
    for (const auto& r : rows) {
      wrong += std::max<std::int64_t>(0, r.timing.wrong);
      if (r.traffic_known) {
        ++traffic_rows;
        traffic_ok = traffic_ok && r.traffic_exact;
        extra_ok = extra_ok && r.extra_exact;
      }
    }
    res["wrong_total"] = wrong;
    // Where: the first few (rank, algorithm, size, world size) with wrong
    // elements.
    std::string where;
    int named = 0, unnamed = 0;
    for (const auto& r : rows)
      for (std::size_t k = 0; k < r.ranks.size(); ++k) {
        if (r.ranks[k].wrong <= 0) continue;
        if (named == 4) {
          ++unnamed;
          continue;
        }
        where += fmt::format("{}rank {} ({} {} B at world size {}: {})", named ? ", " : "; wrong on ",
                             k, algo_name(r.algo), r.bytes, r.world_size,
                             static_cast<std::int64_t>(r.ranks[k].wrong));
        ++named;
      }
    if (unnamed) where += fmt::format(" and {} more", unnamed);
    if (!complete && rows.empty())
      report.add_check({"correctness", reports::CheckStatus::kSkip,
                        "the run ended with an error before any size was measured"});
    else if (rows.empty() && job.rank() >= *ks.rbegin())
      // A rank beyond the largest of --world-sizes measures nothing itself.
      report.add_check({"correctness", reports::CheckStatus::kSkip,
                        fmt::format("rank {} takes part in none of the world sizes measured",
                                    job.rank())});
    else
      report.add_check({"correctness", tools::pass_if(wrong == 0 && !rows.empty()),
                        fmt::format("{} wrong element(s) over {} row(s), every rank checked{}{}",
                                    wrong, rows.size(),
                                    complete ? "" : " before the run ended with an error", where)});
    if (traffic_rows)
      report.add_check({"traffic_matches_theory", tools::pass_if(traffic_ok),
                        fmt::format("bytes sent and received by every rank {} theory in {} "
                                    "gather/ring row(s)",
                                    traffic_ok ? "equal" : "DIFFER FROM", traffic_rows)});
    if (traffic_rows)
      report.add_check({"extra_memory_matches_theory", tools::pass_if(extra_ok),
                        fmt::format("peak scratch memory of every rank {} theory",
                                    extra_ok ? "equals" : "DIFFERS FROM")});
    // The ring against the backend at the largest size (a figure, not a gate:
    // a shared machine's noise would make it flaky); none from a run that
    // stopped short of it.
    const Row* ring = nullptr;
    const Row* backend = nullptr;
    if (complete)
      for (const auto& r : rows)
        if (r.world_size == *ks.rbegin() && r.bytes == rows.back().bytes) {
          if (r.algo == Algo::kRing) ring = &r;
          if (r.algo == Algo::kBackend) backend = &r;
        }
    res["ring_vs_backend_busbw_ratio"] =
        ring && backend && backend->timing.busbw_gbps > 0
            ? json(ring->timing.busbw_gbps / backend->timing.busbw_gbps)
            : json();
  };

  try {
    std::size_t done = 0;
    for (int k : ks) {
      std::unique_ptr<Communicator> sub;
      Communicator* comm = job.comm.get();
      if (k != job.size()) {
        sub = tools::make_extra_communicator(job, o.common, fmt::format("dp-vs-ring/n{}", k), k);
        comm = sub.get();
      }
      if (comm) {
        for (std::size_t bytes : sizes)
          for (Algo a : algos) {
            Row row = measure(*comm, a, bytes, *dtype, o, job.timeout);
            if (job.rank() == 0) print_row(row);
            res["sizes"].push_back(row_json(row, *dtype));
            rows.push_back(std::move(row));
            job.progress_line(fmt::format("[progress] n={} {} {} done", k, algo_name(a),
                                          format_size(bytes)));
          }
      }
      ++done;
      sub.reset();
      // The ranks outside a smaller world wait here for it to finish.
      job.comm->barrier()->wait(job.timeout * static_cast<int>(std::max<std::size_t>(1, sizes.size() * algos.size())));
    }
  } catch (...) {
    judge(false);
    throw;
  }
  judge(true);
  if (job.rank() == 0) {
    if (res["ring_vs_backend_busbw_ratio"].is_number())
      std::printf("# ring busbw / backend busbw at %s, n=%d: %.3f\n",
                  format_size(rows.back().bytes).c_str(), *ks.rbegin(),
                  res["ring_vs_backend_busbw_ratio"].get<double>());
    print_checks_and_verdict(report);
  }
}

}  // namespace

Subcommand add_dp_vs_ring_command(CLI::App& parent) {
  auto opts = std::make_shared<DpVsRingOptions>();
  auto* app = parent.add_subcommand(
      "dp-vs-ring",
      "DataParallel-style gather vs ring all_reduce (both on send/recv) vs the backend's own: "
      "time, bandwidth, bytes per rank against theory, extra memory, correctness");
  add_common_options(app, opts->common);
  app->add_option("-b,--minbytes", opts->min_bytes, "Smallest size (8, 1K, 64M, ...)")
      ->check(cli::size_value());
  app->add_option("-e,--maxbytes", opts->max_bytes, "Largest size")
      ->check(cli::size_value());
  app->add_option("-f,--stepfactor", opts->step_factor, "Multiply the size by this each step (> 1)")
      ->check(cli::number_above(1));
  app->add_option("-n,--iters", opts->iters, "Timed iterations per size")->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up iterations per size")
      ->check(cli::non_negative_number());
  app->add_option("-d,--datatype,--dtype", opts->dtype, "Element type (float, double, ...)");
  app->add_option("--world-sizes", opts->world_sizes,
                  "Comma-separated world sizes to run at (ranks 0..k-1 of the job); default: the "
                  "job's");
  app->add_option("--algorithms", opts->algorithms, "Comma-separated: gather, ring, backend");
  // Checked once the line is parsed, so the launcher refuses it before any
  // rank starts (each rank checks again in run()).
  app->parse_complete_callback([opts, app] {
    cli::refuse_empty_values(*app);  // before reading a value it made 0
    if (const auto p = size_order_problem("--minbytes", opts->min_bytes, opts->max_bytes))
      throw CLI::ValidationError("--maxbytes", *p);
    try {
      for (const auto& w : split_list(opts->world_sizes, "--world-sizes", "2,4"))
        if (world_size_entry(w) < 1)
          throw CLI::ValidationError(fmt::format(
              "--world-sizes: '{}' is not a whole number of ranks of 1 or more (e.g. --world-sizes 2,4)", w));
      for (const auto& a : split_list(opts->algorithms, "--algorithms", "gather,ring,backend"))
        if (a != "gather" && a != "ring" && a != "backend")
          throw CLI::ValidationError(
              fmt::format("--algorithms: unknown algorithm '{}' (use a list of gather, ring, backend)", a));
      if (!parse_dtype(opts->dtype))
        throw CLI::ValidationError(fmt::format(
            "-d: unknown dtype '{}' (float, double, half, bfloat16, int32, int64, int8, uint8)", opts->dtype));
    } catch (const UsageError& e) {
      throw CLI::ValidationError(fmt::format("{} ({})", e.what(), e.context().hint));
    }
  });
  return {app, [opts] {
            return run_distributed(
                opts->common, "dp-vs-ring",
                [opts](Job& job, reports::Report& report) { run(job, report, *opts); },
                [opts](const Job& job) {
                  // Each rank's buffer and its host copy at the largest size
                  // (Gloo). On Gloo the gather root (rank 0) also holds every
                  // other rank's buffer at once. NCCL's buffers are on the GPU;
                  // on the host each rank has the copy and the staging through
                  // which the algorithms reduce (comm/algorithms/traffic.cpp:
                  // two ring chunks, at most the size), and the gather root
                  // stages two whole buffers.
                  const auto dtype = parse_dtype(opts->dtype);
                  const std::size_t minb = parse_size(opts->min_bytes), maxb = parse_size(opts->max_bytes);
                  if (!dtype || maxb < minb || maxb < dtype_size(*dtype)) return;  // run() says why
                  std::size_t largest = 0;
                  for (std::size_t b : sweep_sizes(minb, maxb, opts->step_factor, 0, dtype_size(*dtype)))
                    largest = std::max(largest, b);
                  const bool gloo = job.backend == Backend::kGloo;
                  bool gather = false;
                  for (const auto& a : split_list(opts->algorithms, "--algorithms", "gather,ring,backend"))
                    gather = gather || a == "gather";
                  // The largest world the gather runs at (a size out of range:
                  // run() says why).
                  int widest = 0;
                  try {
                    widest = *world_sizes_of(*opts, job).rbegin();
                  } catch (const UsageError&) {
                    return;
                  }
                  const bool root = gather && job.rank() == 0;
                  const long double root_extra =
                      !root ? 0.0L
                            : static_cast<long double>(largest) * (gloo ? widest - 1 : 1);
                  check_host_memory(job, static_cast<long double>(largest) * 2,
                                    fmt::format("buffers of {} (the sweep's largest size)", format_size(largest)),
                                    "use a smaller -e, or fewer ranks on this host",
                                    root_extra,
                                    !gloo ? std::string("the gather root reduces through two host buffers")
                                    : widest == 2 ? std::string("the gather root holds the other rank's buffer")
                                                  : fmt::format("the gather root holds the {} other ranks' buffers",
                                                                widest - 1));
                });
          }};
}

}  // namespace ddpdiag::cli
