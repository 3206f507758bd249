// ddpdiag model: an alpha-beta scale model fitted from measured sweeps.
// Reads allreduce-test / dp-vs-ring / bucket-sweep reports, fits latency and
// bandwidth per measured series (scale_model.h has the formulas), predicts
// all_reduce time per size for ring, tree and gather at a world size nobody
// has measured (ranks per host and intra-/inter-host links given), the best
// DDP bucket cap for a model there, and, against reports of other measured
// runs, how far its predictions are from them. One process, no communication.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/core.h>

#include "comm/errors.h"
#include "comm/measure.h"
#include "comm/types.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/launcher.h"
#include "diag/scale_model.h"
#include "diag/tools_analysis.h"
#include "diag/tools_common.h"
#include "reports/format.h"
#include "reports/render.h"
#include "reports/report.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
using scale::Algorithm;

constexpr int kMaxWorldSize = 4096;
// Series of the input reports, in the order a prediction prefers them: the
// backend's own all_reduce is what DDP runs.
const char* const kSeriesOrder[] = {"backend", "ring", "gather"};
// Predictions are for float all_reduces: sizes are whole 4-byte elements.
constexpr std::size_t kPredictedElementBytes = 4;

struct ModelOptions {
  std::vector<std::string> inputs;
  std::string backend_as = "ring";
  std::string fit_min_bytes = "0";
  std::string fit_max_bytes;
  double max_fit_error_pct = 50;
  int world_size = 0;  // 0: not given (world_size_opt says whether it was)
  CLI::Option* world_size_opt = nullptr;
  int ranks_per_host = 1;
  CLI::Option* ranks_per_host_opt = nullptr;
  std::vector<CLI::Option*> sizes_opts;  // -b, -e, -f: the predicted sizes
  double intra_gbps = 0, intra_latency_us = 0, inter_gbps = 0, inter_latency_us = 0;
  CLI::Option* intra_gbps_opt = nullptr;
  CLI::Option* intra_latency_opt = nullptr;
  CLI::Option* inter_gbps_opt = nullptr;
  CLI::Option* inter_latency_opt = nullptr;
  std::string min_bytes = "1K";
  std::string max_bytes = "1G";
  double step_factor = 4;
  std::string model;
  std::string caps = "1,2,5,10,25,50,100";
  CLI::Option* caps_opt = nullptr;
  double first_bucket_mb = 1;
  CLI::Option* first_bucket_opt = nullptr;
  bool find_unused = false;
  CLI::Option* find_unused_opt = nullptr;
  bool static_graph = false;
  CLI::Option* static_graph_opt = nullptr;
  // torch 2.x's bucket_cap_mb_list candidates, one a flag; and its
  // skip_all_reduce_unused_params.
  std::vector<std::string> cap_lists;
  CLI::Option* cap_lists_opt = nullptr;
  bool skip_unused = false;
  CLI::Option* skip_unused_opt = nullptr;
  bool set_last_bucket_cap = false;  // DDP_SET_LAST_BUCKET_CAP=1 (also read from the environment)
  CLI::Option* set_last_bucket_cap_opt = nullptr;
  double compute_gbps = 1.0;
  CLI::Option* compute_gbps_opt = nullptr;
  double backward_ms = 0;
  CLI::Option* backward_ms_opt = nullptr;
  std::string bucket_algorithm = "ring";
  CLI::Option* bucket_algorithm_opt = nullptr;
  std::vector<std::string> check_against;
  std::string check_min_bytes = "1M";
  double max_error_factor = 2.0;
  std::vector<CLI::Option*> check_opts;  // --check-min-bytes, --max-error-factor
  std::string json_path;
  std::string markdown_path;
};

UsageError flag_error(const std::string& what, const std::string& hint) {
  return UsageError(what, ErrorContext{"flags", -1, -1, hint});
}

struct SeriesFit {
  std::string series;
  std::vector<scale::Sample> samples;
  scale::Fit fit;
};

// The fit each algorithm is predicted with: a series measured with that
// algorithm's formula when there is one, else the first series of
// kSeriesOrder (its link carried over to the algorithm's formula).
struct Choice {
  const SeriesFit* fit = nullptr;
  bool measured = false;
};

class Model {
 public:
  Model(const ModelOptions& o, Algorithm backend_as) : o_(o), backend_as_(backend_as) {}

  Algorithm formula_of(const std::string& series) const {
    if (series == "backend") return backend_as_;
    return *scale::parse_algorithm(series);
  }

  std::vector<SeriesFit> fits;

  const SeriesFit* fit_of_series(const std::string& s) const {
    for (const auto& f : fits)
      if (f.series == s) return &f;
    return nullptr;
  }

  Choice choose(Algorithm a) const {
    for (const char* s : kSeriesOrder)
      if (const auto* f = fit_of_series(s); f && f->fit.formula == a) return {f, true};
    for (const char* s : kSeriesOrder)
      if (const auto* f = fit_of_series(s)) return {f, false};
    return {};
  }

  // The links of a measured run: the fitted link, whatever --intra-*/--inter-*
  // say (they describe the cluster predicted at --world-size, not the hosts
  // the fit was measured on).
  static scale::Topology measured_topology(int world_size, int ranks_per_host, const scale::Link& fitted) {
    return {world_size, ranks_per_host, fitted, fitted};
  }

  // The links of a topology: the flags where given, else the fitted link.
  scale::Topology topology(int world_size, int ranks_per_host, const scale::Link& fitted) const {
    scale::Topology t;
    t.world_size = world_size;
    t.ranks_per_host = ranks_per_host;
    t.intra = t.inter = fitted;
    if (o_.intra_gbps_opt->count()) t.intra.beta_s_per_byte = 1e-9 / o_.intra_gbps;
    if (o_.intra_latency_opt->count()) t.intra.alpha_s = o_.intra_latency_us * 1e-6;
    if (o_.inter_gbps_opt->count()) t.inter.beta_s_per_byte = 1e-9 / o_.inter_gbps;
    if (o_.inter_latency_opt->count()) t.inter.alpha_s = o_.inter_latency_us * 1e-6;
    return t;
  }

 private:
  const ModelOptions& o_;
  Algorithm backend_as_;
};

json link_json(const scale::Link& l) {
  return {{"alpha_us", l.alpha_s * 1e6},
          {"beta_s_per_byte", l.beta_s_per_byte},
          {"bandwidth_gbps", l.bandwidth_gbps()}};
}

std::string link_text(const scale::Link& l) {
  return fmt::format("alpha {:.2f} us, {:.3f} GB/s", l.alpha_s * 1e6, l.bandwidth_gbps());
}

double busbw_of(double bytes, double time_s, int world_size) {
  if (!(time_s > 0)) return 0;
  return bytes / time_s / 1e9 * busbw_factor(Collective::kAllReduce, world_size);
}

// A report the model reads (an input, or a run to check against); one that
// cannot be read is a usage error of that phase.
json read_measured_report(const std::string& path, const char* phase) {
  try {
    return reports::read_json(path);
  } catch (const std::exception& e) {
    throw UsageError(e.what(), ErrorContext{phase, -1, -1, "pass a report written with --json FILE"});
  }
}

// A report already read, that `path` (read as `doc`) repeats: the same file
// under another name, or a copy of its content.
struct SameReport {
  std::string path;
  bool same_file;
};
std::optional<SameReport> same_report(const std::vector<std::pair<std::string, json>>& seen,
                                      const std::string& path, const json& doc) {
  for (const auto& [seen_path, seen_doc] : seen) {
    std::error_code ec;
    const bool same_file = std::filesystem::equivalent(seen_path, path, ec) && !ec;
    if (same_file || seen_doc == doc) return SameReport{seen_path, same_file};
  }
  return std::nullopt;
}

void run_model(const ModelOptions& o, reports::Report& report) {
  auto& res = report.results();
  // ---- flags -------------------------------------------------------------
  const auto backend_as = scale::parse_algorithm(o.backend_as);
  if (!backend_as || *backend_as == Algorithm::kGather)
    throw flag_error(fmt::format("--backend-as '{}' is not ring or tree", o.backend_as),
                     "Gloo's all_reduce is a ring; NCCL's is a ring or a tree");
  const auto bucket_algorithm = scale::parse_algorithm(o.bucket_algorithm);
  if (!bucket_algorithm)
    throw flag_error(fmt::format("--bucket-algorithm '{}' is not ring, tree or gather", o.bucket_algorithm),
                     "DDP's all_reduce is the backend's: ring for Gloo");
  if (o.world_size_opt->count() && (o.world_size < 2 || o.world_size > kMaxWorldSize))
    throw flag_error(fmt::format("--world-size {} is not in 2..{}", o.world_size, kMaxWorldSize),
                     "e.g. --world-size 64 --ranks-per-host 8");
  // The best cap is predicted at --world-size; without it, the model and its
  // flags would be read and then ignored.
  if (!o.model.empty() && !o.world_size_opt->count())
    throw flag_error("--model needs --world-size: the best bucket cap is predicted for the world "
                     "size you name",
                     fmt::format("e.g. --model {} --world-size 64 --ranks-per-host 8", o.model));
  if (!o.world_size_opt->count() && o.check_against.empty())
    throw flag_error("nothing to predict: give --world-size W and/or --check-against FILE",
                     "e.g. ddpdiag model sweep.json --world-size 64 --ranks-per-host 8");
  // The predicted sizes are whole float elements, rounded down as
  // allreduce-test rounds its sweep; below one element nothing is left.
  const std::size_t min_bytes = parse_size(o.min_bytes), max_bytes = parse_size(o.max_bytes);
  for (auto [flag, text, bytes] : {std::tuple{"--minbytes", &o.min_bytes, min_bytes},
                                   std::tuple{"--maxbytes", &o.max_bytes, max_bytes}})
    if (bytes < kPredictedElementBytes)
      throw flag_error(fmt::format("{} {} is below one float element ({} bytes): there is no such all_reduce "
                                   "to predict",
                                   flag, *text, kPredictedElementBytes),
                       "e.g. -b 1K -e 1G");
  if (max_bytes < min_bytes)
    throw flag_error(fmt::format("--maxbytes {} is below --minbytes {} (swap them)", o.max_bytes, o.min_bytes),
                     "swap them: -b is the smallest size, -e the largest");
  for (auto [opt, v] : {std::pair{o.intra_gbps_opt, o.intra_gbps}, std::pair{o.inter_gbps_opt, o.inter_gbps}})
    if (opt->count() && !(v > 0))
      throw flag_error(fmt::format("{} must be positive (GB/s)", opt->get_name()), "e.g. 12.5 for 100 Gbit/s");
    // A link outside 1 kB/s .. 1 PB/s is a typo (a unit, an exponent), and
    // its predictions would be figures of hundreds of digits.
    else if (opt->count() && (v < 1e-6 || v > 1e6))
      throw flag_error(fmt::format("{} {}: no link is {} than {} GB/s", opt->get_name(), v,
                                   v < 1e-6 ? "slower" : "faster", v < 1e-6 ? "1e-06" : "1e+06"),
                       "give the link's bandwidth in GB/s (1e9 bytes/s): 12.5 for 100 Gbit/s, "
                       "between 1e-06 and 1e+06");
  for (auto [opt, v] :
       {std::pair{o.intra_latency_opt, o.intra_latency_us}, std::pair{o.inter_latency_opt, o.inter_latency_us}})
    if (opt->count() && !(v >= 0))
      throw flag_error(fmt::format("{} must be >= 0 (us)", opt->get_name()), "e.g. 5");
    else if (opt->count() && v > 1e7)
      throw flag_error(fmt::format("{} {}: a per-message latency of over 10 s", opt->get_name(), v),
                       "give the latency in microseconds (at most 10,000,000), e.g. 5");
  if (!(o.max_error_factor >= 1) || !std::isfinite(o.max_error_factor))
    throw flag_error(fmt::format("--max-error-factor must be a finite number >= 1, not {}", o.max_error_factor),
                     "e.g. 2: within a factor of two");
  // Flags whose only use is a part of the run that was not asked for would
  // be read and then ignored.
  if (!o.world_size_opt->count()) {
    std::vector<CLI::Option*> prediction_only = {o.ranks_per_host_opt, o.intra_gbps_opt, o.intra_latency_opt,
                                                 o.inter_gbps_opt, o.inter_latency_opt};
    prediction_only.insert(prediction_only.end(), o.sizes_opts.begin(), o.sizes_opts.end());
    for (const auto* opt : prediction_only)
      if (opt->count())
        throw flag_error(fmt::format("{} needs --world-size: it describes the cluster predicted at "
                                     "--world-size (a --check-against run is predicted on the hosts "
                                     "its report names, with the fitted link)",
                                     opt->get_name()),
                         opt == o.ranks_per_host_opt
                             ? std::string("e.g. --world-size 64 --ranks-per-host 8")
                             : "e.g. --world-size 64 --ranks-per-host 8 " + opt->get_name() + " ...");
  } else {
    // The prediction's hosts, before anything of the fit is printed.
    scale::validate_topology({o.world_size, o.ranks_per_host, {}, {}});
  }
  if (o.check_against.empty())
    for (const auto* opt : o.check_opts)
      if (opt->count())
        throw flag_error(fmt::format("{} needs --check-against: it sets how predictions are compared "
                                     "with a measured run",
                                     opt->get_name()),
                         "e.g. --check-against sweep4.json " + opt->get_name() + " ...");
  if (o.model.empty())
    for (const auto* opt : {o.first_bucket_opt, o.compute_gbps_opt, o.backward_ms_opt, o.bucket_algorithm_opt,
                            o.find_unused_opt, o.static_graph_opt, o.cap_lists_opt, o.skip_unused_opt,
                            o.set_last_bucket_cap_opt})
      if (opt->count())
        throw flag_error(fmt::format("{} needs --model: it shapes the bucket-cap prediction of a model",
                                     opt->get_name()),
                         "e.g. --model resnet50 --world-size 64 " + opt->get_name() + " ...");
  // The bucket-cap part's flags and model, before anything is printed.
  std::vector<double> caps;
  std::vector<BucketCapList> cap_lists;
  std::optional<ddp_core::ModelLayout> model_layout;
  if (!o.model.empty()) {
    caps = cli::parse_caps(o.caps);
    for (const auto& l : o.cap_lists) cap_lists.push_back(parse_cap_list(l, -1, false));
    if (!(o.first_bucket_mb > 0))
      throw flag_error("--first-bucket-mb must be positive", "DDP's is 1");
    if (o.compute_gbps < 0 || o.backward_ms < 0)
      throw flag_error("--compute-gbps and --backward-ms must be >= 0", "e.g. --compute-gbps 1");
    // --compute-gbps 0 ("no compute rate") leaves the pace to --backward-ms.
    if (o.compute_gbps_opt->count() > 0 && o.compute_gbps > 0 && o.backward_ms_opt->count() > 0)
      throw flag_error("--compute-gbps and --backward-ms both set the backward's pace",
                       "give one of them");
    if (o.backward_ms > 3600e3)
      throw flag_error(fmt::format("--backward-ms {}: a backward of over an hour a step",
                                   o.backward_ms),
                       "give the backward's duration in milliseconds (at most 3,600,000)");
    // Frozen parameters have no gradient: DDP reduces the others only.
    model_layout = ddp_core::trainable_parameters(ddp_core::load_model(o.model));
    ddp_core::check_unused_parameters(*model_layout, o.find_unused || o.static_graph, "model", true);
    if (o.backward_ms_opt->count() == 0) cli::check_backward_rate(model_layout->gradient_bytes(), o.compute_gbps, -1);
  } else if (o.caps_opt && o.caps_opt->count()) {
    throw flag_error("--caps needs --model: the best cap is found for a model's buckets",
                     "e.g. --model resnet50 --caps 1,5,25");
  }
  if (!o.fit_max_bytes.empty() && parse_size(o.fit_max_bytes) < parse_size(o.fit_min_bytes))
    throw flag_error(fmt::format("--fit-max-bytes {} is below --fit-min-bytes {}", o.fit_max_bytes,
                                 o.fit_min_bytes),
                     "swap them");
  const double fit_min = static_cast<double>(parse_size(o.fit_min_bytes));
  const double fit_max = o.fit_max_bytes.empty() ? INFINITY : static_cast<double>(parse_size(o.fit_max_bytes));
  const double check_min = static_cast<double>(parse_size(o.check_min_bytes));

  // ---- inputs and fits -----------------------------------------------------
  Model model(o, *backend_as);
  std::map<std::string, std::vector<scale::Sample>> by_series;
  res["inputs"] = json::array();
  // A report given twice would count its points twice and pass the fit's
  // "at least 3 points" rule on one measurement: refused, by path and content.
  std::vector<std::pair<std::string, json>> read_inputs;
  std::size_t single_points = 0;  // at world size 1, left out
  for (const auto& path : o.inputs) {
    json doc = read_measured_report(path, "model.input");
    if (const auto same = same_report(read_inputs, path, doc))
      throw UsageError(
          same->same_file
              ? fmt::format("{} is given twice (also as {}): its points would count twice in the fit",
                            path, same->path)
              : fmt::format("{} has the same content as {}: its points would count twice in the fit",
                            path, same->path),
          ErrorContext{"model.input", -1, -1, "give each measured report once"});
    read_inputs.emplace_back(path, doc);
    const auto rows = scale::extract_rows(doc, path);
    std::size_t used = 0, single = 0;
    for (const auto& r : rows.rows) {
      // A world of one does no all_reduce (dp-vs-ring --world-sizes 1,...):
      // its time says nothing of a link.
      if (r.sample.world_size < 2) {
        ++single;
        continue;
      }
      if (r.sample.bytes >= fit_min && r.sample.bytes <= fit_max) {
        by_series[r.series].push_back(r.sample);
        ++used;
      }
    }
    single_points += single;
    if (single > 0)
      std::printf("# %s: %zu point(s) at world size 1 left out of the fit: a world of one does no all_reduce\n",
                  path.c_str(), single);
    // Rows the model cannot read (an edited or damaged report) are named,
    // not dropped without a word.
    if (rows.left_out() > 0)
      std::printf("# %s: %zu row(s) left out of the fit: %s (report validate names them)\n", path.c_str(),
                  rows.left_out(), rows.left_out_text().c_str());
    res["inputs"].push_back({{"file", path},
                             {"command", rows.command},
                             {"world_size", rows.world_size},
                             {"hosts", rows.hosts},
                             {"points", rows.rows.size()},
                             {"points_world_size_1", single},
                             {"rows_left_out", rows.left_out()},
                             {"points_used", used}});
  }
  // The runs to check against, read and refused (the fit's own input, one
  // run twice) before anything of the fit is printed.
  std::vector<std::pair<std::string, json>> checked;
  for (const auto& path : o.check_against) {
    json doc = read_measured_report(path, "model.check");
    // Checking the fit against its own points can only pass.
    if (const auto same = same_report(read_inputs, path, doc))
      throw UsageError(fmt::format("--check-against {} is {} the model was fitted from ({}): "
                                   "a prediction checked against its own points can only pass",
                                   path, same->same_file ? "the report" : "a copy of the report",
                                   same->path),
                       ErrorContext{"model.check", -1, -1,
                                    "check against a run the fit did not use (another world "
                                    "size, or another run)"});
    // One run given twice would count its points twice in the verdict.
    if (const auto same = same_report(checked, path, doc))
      throw UsageError(fmt::format("--check-against {} is given twice ({} {}): its points would count "
                                   "twice",
                                   path, same->same_file ? "also as" : "the same content as",
                                   same->path),
                       ErrorContext{"model.check", -1, -1, "give each measured run once"});
    // Its rows are read now, so that a report without any (another
    // command's, a run that failed before measuring) is refused before
    // anything of the fit is printed.
    try {
      (void)scale::extract_rows(doc, path);
    } catch (const UsageError& e) {
      const json* error = doc.is_object() && doc.contains("error") ? &doc["error"] : nullptr;
      throw UsageError(
          fmt::format("--check-against {}{}", e.what(),
                      error && error->is_object() && error->contains("message")
                          ? fmt::format(" (that run ended with an error: {})",
                                        reports::escape_controls(error->value("message", std::string())))
                          : std::string()),
          ErrorContext{"model.check", -1, -1,
                       "check against a report of allreduce-test, dp-vs-ring or bucket-sweep that "
                       "measured all_reduce times"});
    }
    checked.emplace_back(path, std::move(doc));
  }
  if (by_series.empty() && single_points > 0 && fit_min <= 0 && !std::isfinite(fit_max))
    throw UsageError("every measured point is at world size 1: a world of one does no all_reduce, "
                     "and its times say nothing of a link",
                     ErrorContext{"model.fit", -1, -1,
                                  "fit from runs of 2 ranks or more (e.g. dp-vs-ring --world-sizes 2,4, "
                                  "allreduce-test --nproc 2)"});
  if (by_series.empty())
    throw UsageError(single_points > 0
                         ? "no measured point at a world size of 2 or more is inside "
                           "--fit-min-bytes..--fit-max-bytes"
                         : "no measured point is inside --fit-min-bytes..--fit-max-bytes",
                     ErrorContext{"model.fit", -1, -1, "widen the range or measure other sizes"});
  for (const char* s : kSeriesOrder) {
    auto it = by_series.find(s);
    if (it == by_series.end()) continue;
    SeriesFit sf{s, it->second, {}};
    try {
      sf.fit = scale::fit_link(model.formula_of(s), sf.samples);
    } catch (UsageError& e) {
      // Name the series: a report may hold several.
      throw UsageError(fmt::format("series '{}': {}", s, e.what()), e.context());
    }
    model.fits.push_back(std::move(sf));
  }
  res["backend_as"] = o.backend_as;
  // What shapes every prediction besides the inputs, as given (null: not
  // given, the links then come from the fit and the fit takes every size),
  // so that report compare tells runs made with other links or another fit
  // range from a regression.
  const auto given = [](const CLI::Option* opt, double v) { return opt->count() ? json(v) : json(); };
  res["intra_gbps"] = given(o.intra_gbps_opt, o.intra_gbps);
  res["intra_latency_us"] = given(o.intra_latency_opt, o.intra_latency_us);
  res["inter_gbps"] = given(o.inter_gbps_opt, o.inter_gbps);
  res["inter_latency_us"] = given(o.inter_latency_opt, o.inter_latency_us);
  res["fit_min_bytes"] = parse_size(o.fit_min_bytes);
  res["fit_max_bytes"] = o.fit_max_bytes.empty() ? json() : json(parse_size(o.fit_max_bytes));
  res["formulas"] = {{"ring", "2(p-1) alpha + 2(p-1)/p n beta"},
                     {"tree", "2 ceil(log2 p) (alpha + n beta), binomial reduce then broadcast, not pipelined"},
                     {"gather", "2(p-1) (alpha + n beta), at the root's link"}};
  res["fits"] = json::array();
  res["fit_points"] = json::array();
  std::printf("# ddpdiag model: alpha-beta fit from %zu report(s)\n", o.inputs.size());
  std::printf("# %-8s %-7s %6s %-12s %11s %11s %9s %8s %8s\n", "series", "formula", "points",
              "world sizes", "alpha (us)", "bw (GB/s)", "R^2", "rms err", "max err");
  for (const auto& sf : model.fits) {
    std::set<int> ws;
    double lo = INFINITY, hi = 0;
    for (const auto& s : sf.samples) {
      ws.insert(s.world_size);
      lo = std::min(lo, s.bytes);
      hi = std::max(hi, s.bytes);
    }
    std::string wtext;
    for (int w : ws) wtext += (wtext.empty() ? "" : ",") + std::to_string(w);
    const auto& f = sf.fit;
    json j = {{"series", sf.series},
              {"formula", std::string(scale::algorithm_name(f.formula))},
              {"points", f.points},
              {"world_sizes", std::vector<int>(ws.begin(), ws.end())},
              {"min_bytes", lo},
              {"max_bytes", hi},
              {"alpha_clamped", f.alpha_clamped},
              {"r_squared", f.r_squared},
              {"rms_rel_error_pct", 100 * f.rms_rel_error},
              {"max_rel_error_pct", 100 * f.max_rel_error}};
    j.update(link_json(f.link));
    res["fits"].push_back(j);
    std::printf("  %-8s %-7s %6zu %-12s %11.2f %11.4f %9.5f %7.1f%% %7.1f%%%s\n", sf.series.c_str(),
                std::string(scale::algorithm_name(f.formula)).c_str(), f.points, wtext.c_str(),
                f.link.alpha_s * 1e6, f.link.bandwidth_gbps(), f.r_squared, 100 * f.rms_rel_error,
                100 * f.max_rel_error, f.alpha_clamped ? "  (alpha clamped at 0)" : "");
    for (std::size_t i = 0; i < sf.samples.size(); ++i) {
      const auto& s = sf.samples[i];
      res["fit_points"].push_back({{"series", sf.series},
                                   {"world_size", s.world_size},
                                   {"bytes", static_cast<std::uint64_t>(s.bytes)},
                                   {"measured_us", s.time_s * 1e6},
                                   {"fitted_us", f.fitted_s[i] * 1e6},
                                   {"error_pct", 100 * (f.fitted_s[i] / s.time_s - 1)}});
    }
    const bool ok = 100 * f.rms_rel_error <= o.max_fit_error_pct;
    report.add_check({"fit_quality_" + sf.series, ok ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                      fmt::format("rms relative error {:.1f}% over {} point(s) {} {:.0f}%; R^2 {:.5f}",
                                  100 * f.rms_rel_error, f.points, ok ? "within" : "OVER",
                                  o.max_fit_error_pct, f.r_squared)});
  }
  std::fflush(stdout);

  // ---- prediction at --world-size ------------------------------------------
  if (o.world_size_opt->count()) {
    const int w = o.world_size, k = o.ranks_per_host;
    std::map<Algorithm, scale::Topology> topo;
    json links = json::array();
    std::printf("# prediction: world size %d = %d host(s) x %d rank(s) per host\n", w, w / k, k);
    for (Algorithm a : scale::kAllAlgorithms) {
      const Choice c = model.choose(a);
      topo[a] = model.topology(w, k, c.fit->fit.link);
      const auto& t = topo[a];
      json l = {{"algorithm", std::string(scale::algorithm_name(a))},
                {"fit_series", c.fit->series},
                {"measured", c.measured},
                {"intra", link_json(t.intra)},
                {"inter", link_json(t.inter)}};
      // Where each half of a link came from: a flag, or the fit.
      for (auto [kind, gbps_opt, latency_opt] : {std::tuple{"intra", o.intra_gbps_opt, o.intra_latency_opt},
                                                  std::tuple{"inter", o.inter_gbps_opt, o.inter_latency_opt}}) {
        const char* bw = gbps_opt->count() ? "flags" : "fit";
        const char* lat = latency_opt->count() ? "flags" : "fit";
        l[kind]["bandwidth_source"] = bw;
        l[kind]["latency_source"] = lat;
        l[kind]["source"] = std::string_view(bw) == lat ? bw : "flags+fit";
      }
      links.push_back(l);
      std::printf("#  %-6s from the %s fit%s; intra-host %s; inter-host %s\n",
                  std::string(scale::algorithm_name(a)).c_str(), c.fit->series.c_str(),
                  c.measured ? "" : " (link carried over: this algorithm was not measured)",
                  link_text(t.intra).c_str(), link_text(t.inter).c_str());
    }
    res["prediction"] = {{"world_size", w}, {"ranks_per_host", k}, {"hosts", w / k}, {"links", links}};
    // As settings report compare reads (scalars at the top of results):
    // predictions for other worlds are not compared with each other.
    res["predicted_world_size"] = w;
    res["predicted_ranks_per_host"] = k;
    const auto sizes = sweep_sizes(min_bytes, max_bytes, o.step_factor, 0, kPredictedElementBytes);
    res["sizes"] = json::array();
    std::printf("# %12s %12s %9s %12s %9s %12s %9s\n", "size (B)", "ring (us)", "busbw", "tree (us)",
                "busbw", "gather (us)", "busbw");
    for (std::size_t bytes : sizes) {
      std::string line = fmt::format("  {:>12}", bytes);
      for (Algorithm a : scale::kAllAlgorithms) {
        const double n = static_cast<double>(bytes);
        const double t = scale::predict_allreduce_s(a, topo[a], n);
        const double busbw = busbw_of(n, t, w);
        line += fmt::format(" {:>12.1f} {:>9.3f}", t * 1e6, busbw);
        res["sizes"].push_back({{"collective", "all_reduce"},
                                {"algorithm", std::string(scale::algorithm_name(a))},
                                {"world_size", w},
                                {"bytes", bytes},
                                {"time_us", t * 1e6},
                                {"algbw_gbps", t > 0 ? n / t / 1e9 : 0.0},
                                {"busbw_gbps", busbw}});
      }
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);

    // ---- DDP bucket cap ------------------------------------------------------
    if (model_layout) {
      const auto& layout = *model_layout;
      const double total = static_cast<double>(layout.total_bytes());
      // --backward-ms 0, as --compute-gbps 0: every gradient at once.
      const double rate = o.backward_ms_opt->count() == 0 ? o.compute_gbps * 1e9
                          : o.backward_ms > 0             ? total / (o.backward_ms * 1e-3)
                                                          : 0.0;
      const auto first = static_cast<std::uint64_t>(o.first_bucket_mb * kMiB);
      const auto& t = topo[*bucket_algorithm];
      auto allreduce_s = [&](double n) { return scale::predict_allreduce_s(*bucket_algorithm, t, n); };
      res["model"] = layout.name;
      res["tensor_count"] = layout.tensors.size();
      res["total_bytes"] = layout.total_bytes();
      res["first_bucket_bytes"] = first;
      res["compute_gbps"] = rate / 1e9;
      res["bucket_algorithm"] = o.bucket_algorithm;
      res["find_unused_parameters"] = o.find_unused;
      res["static_graph"] = o.static_graph;
      res["skip_all_reduce_unused_params"] = o.skip_unused;
      const bool set_last = cli::set_last_bucket_cap(o.set_last_bucket_cap);
      res["set_last_bucket_cap"] = set_last;
      res["default_bucket_cap_mb"] = kDefaultCapMb;
      res["caps"] = json::array();
      // A rate of 0: every gradient at once (no backward to overlap).
      const std::string pace = rate > 0 ? fmt::format("backward producing gradients at {:.3g} GB/s ({:.2f} ms)",
                                                      rate / 1e9, total / rate * 1e3)
                                        : std::string("every gradient ready at once (no backward to overlap)");
      std::printf("# buckets: model %s (%zu tensors, %.1f MiB), %s, all_reduce %s at world size %d%s\n",
                  layout.name.c_str(), layout.tensors.size(), total / kMiB, pace.c_str(),
                  o.bucket_algorithm.c_str(), w,
                  cli::set_last_bucket_cap_note(set_last, o.find_unused, o.static_graph).c_str());
      std::printf("# %8s %8s %12s %12s %12s %12s\n", "cap", "buckets", "comm", "exposed", "step", "backward");
      std::printf("# %8s %8s %12s %12s %12s %12s\n", "(MiB)", "", "(ms)", "(ms)", "(ms)", "(ms)");
      std::vector<tools::CapFigure> figs;
      // Each plain cap, then each bucket_cap_mb_list (its largest standing
      // for it as bucket_cap_mb, as DDP sets it).
      for (std::size_t i = 0; i < caps.size() + cap_lists.size(); ++i) {
        const BucketCapList* list = i < caps.size() ? nullptr : &cap_lists[i - caps.size()];
        const double cap = list ? list->max_mb() : caps[i];
        const std::vector<std::uint64_t> limits =
            list ? list->bytes : ddp_core::ddp_bucket_limits(static_cast<std::uint64_t>(cap * kMiB), first);
        const auto plan = scale::plan_buckets(layout, cap, limits, rate, allreduce_s, o.find_unused,
                                              o.static_graph, o.skip_unused, set_last);
        figs.push_back({cap, plan.exposed_s * 1e6, list ? list->mb : std::vector<double>{}});
        json row = {{"bucket_cap_mb", cap},
                    {"bucket_cap_bytes", plan.bucket_cap_bytes},
                    {"bucket_count", plan.bucket_bytes.size()},
                    {"bucket_bytes", plan.bucket_bytes},
                    {"comm_time_us", plan.comm_s * 1e6},
                    {"exposed_comm_time_us", plan.exposed_s * 1e6},
                    {"step_time_us", plan.step_s() * 1e6},
                    {"backward_time_us", plan.backward_s * 1e6}};
        if (list) row["bucket_cap_mb_list"] = list->mb;
        res["caps"].push_back(std::move(row));
        std::printf("  %8s %8zu %12.3f %12.3f %12.3f %12.3f%s\n",
                    list ? "list" : fmt::format("{:.4g}", cap).c_str(), plan.bucket_bytes.size(),
                    plan.comm_s * 1e3, plan.exposed_s * 1e3, plan.step_s() * 1e3, plan.backward_s * 1e3,
                    list ? ("  bucket_cap_mb_list " + list->text()).c_str() : "");
      }
      const auto rec = tools::recommend_cap(figs, kDefaultCapMb);
      res["recommended_cap_mb"] = rec->cap_list.empty() ? json(rec->bucket_cap_mb) : json();
      res["recommended_cap_mb_list"] = rec->cap_list.empty() ? json() : json(rec->cap_list);
      res["recommendation"] = tools::recommendation_json(*rec, kDefaultCapMb);
      if (rec->saving_us)
        std::printf("# Recommendation: %s (predicted exposed %.3f ms; default 25: %.3f ms, "
                    "saves %.3f ms = %.1f%%)\n",
                    tools::recommended_setting(*rec).c_str(), rec->exposed_comm_time_us / 1e3,
                    *rec->default_exposed_comm_time_us / 1e3, *rec->saving_us / 1e3, *rec->saving_pct);
      else
        std::printf("# Recommendation: %s (predicted exposed %.3f ms; 25 was not in --caps)\n",
                    tools::recommended_setting(*rec).c_str(), rec->exposed_comm_time_us / 1e3);
      std::fflush(stdout);
    }
  }

  // ---- predictions against measured runs -----------------------------------
  if (!o.check_against.empty()) {
    res["validation"] = json::array();
    std::printf("# predictions against measured runs (sizes >= %s; pass within a factor of %g)\n",
                format_size(static_cast<std::size_t>(check_min)).c_str(), o.max_error_factor);
    std::printf("# %-8s %-6s %4s %5s %12s %13s %13s %9s\n", "series", "algo", "n", "hosts", "size (B)",
                "measured (us)", "predicted (us)", "error");
    std::size_t compared = 0, outside = 0, single = 0;
    std::map<std::string, std::size_t> misplaced;  // why -> points
    double worst = 1;
    for (const auto& [path, doc] : checked) {
      const auto rows = scale::extract_rows(doc, path);
      for (const auto& r : rows.rows) {
        if (r.sample.bytes < check_min) continue;
        const auto* own = model.fit_of_series(r.series);
        const Algorithm a = model.formula_of(r.series);
        const SeriesFit* sf = own ? own : model.choose(a).fit;
        const int w = r.sample.world_size;
        // A world of one does no all_reduce: nothing to predict.
        if (w < 2) {
          ++single;
          continue;
        }
        // Where ranks 0..w-1 of that run sat (dp-vs-ring's smaller worlds
        // are the job's first ranks); the model places ranks host by host in
        // equal numbers, so a run placed otherwise is not one it predicts.
        const auto where = scale::placement_of(rows, w);
        if (where.hosts == 0) {
          ++misplaced[fmt::format("{}: {}", path, where.why)];
          continue;
        }
        const int hosts = where.hosts;
        const auto t = Model::measured_topology(w, w / hosts, sf->fit.link);
        const double pred = scale::predict_allreduce_s(a, t, r.sample.bytes);
        const double meas = r.sample.time_s;
        const double factor = std::max(pred / meas, meas / pred);
        const bool within = factor <= o.max_error_factor;
        ++compared;
        if (!within) ++outside;
        worst = std::max(worst, factor);
        res["validation"].push_back({{"file", path},
                                     {"series", r.series},
                                     {"algorithm", std::string(scale::algorithm_name(a))},
                                     {"fit_series", sf->series},
                                     {"world_size", w},
                                     {"hosts", hosts},
                                     {"bytes", static_cast<std::uint64_t>(r.sample.bytes)},
                                     {"measured_us", meas * 1e6},
                                     {"predicted_us", pred * 1e6},
                                     {"error_pct", 100 * (pred / meas - 1)},
                                     {"error_factor", factor},
                                     {"within_tolerance", within}});
        std::printf("  %-8s %-6s %4d %5d %12.0f %13.1f %13.1f %+8.1f%%%s\n", r.series.c_str(),
                    std::string(scale::algorithm_name(a)).c_str(), w, hosts, r.sample.bytes, meas * 1e6,
                    pred * 1e6, 100 * (pred / meas - 1), within ? "" : "  OUTSIDE");
      }
    }
    if (single > 0)
      std::printf("# %zu point(s) at world size 1 left out: a world of one does no all_reduce\n", single);
    res["validation_skipped"] = json::array();
    if (single > 0)
      res["validation_skipped"].push_back({{"points", single}, {"reason", "world size 1"}});
    for (const auto& [why, n] : misplaced) {
      std::printf("# %zu point(s) left out: %s\n", n, why.c_str());
      res["validation_skipped"].push_back({{"points", n}, {"reason", why}});
    }
    std::fflush(stdout);
    res["validation_worst_error_factor"] = worst;
    if (compared == 0)
      report.add_check({"prediction_error", reports::CheckStatus::kSkip,
                        single + misplaced.size() > 0
                            ? fmt::format("no measured point to check: sizes >= {} B at a world size "
                                          "of 2 or more, with ranks placed host by host",
                                          check_min)
                            : fmt::format("no measured size >= {} B in --check-against", check_min)});
    else
      report.add_check({"prediction_error", outside ? reports::CheckStatus::kFail : reports::CheckStatus::kPass,
                        fmt::format("{} of {} measured point(s) within a factor of {:g} of the prediction; "
                                    "worst factor {:.2f}",
                                    compared - outside, compared, o.max_error_factor, worst)});
  }
  print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_model_command(CLI::App& parent) {
  auto opts = std::make_shared<ModelOptions>();
  auto* app = parent.add_subcommand(
      "model",
      "Alpha-beta scale model: fit latency and bandwidth of ring, tree and gather all_reduce from "
      "measured sweep reports; predict all_reduce time and the best bucket cap at a world size "
      "you name (2 to 4096 ranks, hosts with intra-/inter-host links)");
  app->add_option("reports", opts->inputs,
                  "allreduce-test, dp-vs-ring or bucket-sweep reports (--json FILE) to fit")
      ->required();
  app->add_option("--backend-as", opts->backend_as,
                  "Formula for the backend's own all_reduce: ring (Gloo; NCCL's ring) or tree")
      ->capture_default_str();
  app->add_option("--fit-min-bytes", opts->fit_min_bytes, "Fit only sizes >= this (8, 1K, 64M ...)")
      ->check(cli::size_value());
  app->add_option("--fit-max-bytes", opts->fit_max_bytes, "Fit only sizes <= this")
      ->check(cli::size_value());
  app->add_option("--max-fit-error", opts->max_fit_error_pct,
                  "FAIL a fit whose rms relative error exceeds this many percent")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  opts->world_size_opt = app->add_option("--world-size", opts->world_size, "World size to predict (2..4096)");
  opts->ranks_per_host_opt = app->add_option("--ranks-per-host", opts->ranks_per_host,
                  "Ranks per host; world size must be a multiple")
      ->capture_default_str()
      ->check(cli::positive_number());
  opts->intra_gbps_opt = app->add_option("--intra-gbps", opts->intra_gbps,
                                         "Intra-host link bandwidth, GB/s (1e9 B/s); default: the fit")
                             ->check(cli::positive_number());
  opts->intra_latency_opt = app->add_option("--intra-latency-us", opts->intra_latency_us,
                                            "Intra-host per-message latency, us; default: the fit")
                                ->check(cli::non_negative_number());
  opts->inter_gbps_opt = app->add_option("--inter-gbps", opts->inter_gbps,
                                         "Inter-host link bandwidth per host, GB/s (100 Gbit/s = 12.5); "
                                         "default: the fit")
                             ->check(cli::positive_number());
  opts->inter_latency_opt = app->add_option("--inter-latency-us", opts->inter_latency_us,
                                            "Inter-host per-message latency, us; default: the fit")
                                ->check(cli::non_negative_number());
  opts->sizes_opts.push_back(app->add_option("-b,--minbytes", opts->min_bytes, "Smallest predicted size")->capture_default_str()
      ->check(cli::size_value()));
  opts->sizes_opts.push_back(app->add_option("-e,--maxbytes", opts->max_bytes, "Largest predicted size")->capture_default_str()
      ->check(cli::size_value()));
  opts->sizes_opts.push_back(app->add_option("-f,--stepfactor", opts->step_factor, "Multiply the size by this each step")
      ->capture_default_str()
      ->check(cli::number_in_range(1.0001, 1e6)));
  app->add_option("--model", opts->model,
                  "Predict the bucket cap for: resnet50, bert-large, gpt2, mlp or a JSON layout file");
  opts->caps_opt = app->add_option("--caps", opts->caps, "Candidate bucket_cap_mb values (with --model)")
                       ->capture_default_str();
  opts->first_bucket_opt = app->add_option("--first-bucket-mb", opts->first_bucket_mb, "DDP's first bucket (MiB)")
      ->capture_default_str()
      ->check(cli::bucket_mb_value(false));
  opts->cap_lists_opt = app->add_option("--bucket-cap-mb-list", opts->cap_lists,
                                        "torch 2.x's DDP(bucket_cap_mb_list=[...]) as one more candidate "
                                        "(MiB, e.g. 1,4,25; give the flag again for another; with --model)")
                            ->check(cli::cap_list_value(false));
  opts->skip_unused_opt = cli::add_skip_unused_flag(app, opts->skip_unused,
                                                    "no all_reduce for a bucket of unused parameters (with --model)");
  opts->set_last_bucket_cap_opt = cli::add_set_last_bucket_cap_flag(app, opts->set_last_bucket_cap);
  opts->find_unused_opt = app->add_flag("--find-unused-parameters", opts->find_unused,
                "DDP's find_unused_parameters=True: the buckets it keeps unrebuilt, and its used-parameter "
                "all_reduce each iteration (with --model)");
  opts->static_graph_opt = app->add_flag(
      "--static-graph", opts->static_graph,
      "DDP's static_graph=True: the buckets it rebuilds (see buckets --static-graph; with --model)");
  opts->compute_gbps_opt =
      app->add_option("--compute-gbps", opts->compute_gbps,
                      "Gradient bytes backward produces per second (GB/s), as bucket-sweep; 0: all "
                      "at once")
          ->capture_default_str()
      ->check(cli::non_negative_number());
  opts->backward_ms_opt =
      app->add_option("--backward-ms", opts->backward_ms,
                      "Or: the backward pass's duration (ms); sets the rate to model bytes / "
                      "duration (0: all at once); default: the rate of --compute-gbps")
      ->check(cli::non_negative_number());
  opts->bucket_algorithm_opt = app->add_option("--bucket-algorithm", opts->bucket_algorithm,
                  "The all_reduce the buckets use: ring, tree or gather")
      ->capture_default_str();
  app->add_option("--check-against", opts->check_against,
                  "Reports of measured runs (any world size) to compare predictions with; repeatable")
      ->expected(1)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  opts->check_opts.push_back(app->add_option("--check-min-bytes", opts->check_min_bytes,
                                             "Compare only sizes >= this (bandwidth-bound; with --check-against)")
                                 ->capture_default_str()
                                 ->check(cli::size_value()));
  opts->check_opts.push_back(app->add_option("--max-error-factor", opts->max_error_factor,
                                             "FAIL when a prediction is off by more than this factor either "
                                             "way (with --check-against)")
                                 ->capture_default_str());
  app->add_option("--json", opts->json_path, "Write the report to this file")
      ->check(report_path_value());
  app->add_option("--markdown", opts->markdown_path, "Write the report as Markdown to this file")
      ->check(report_path_value());
  app->footer(
      "Formulas (n bytes, p ranks, one link of latency alpha and inverse bandwidth beta):\n"
      "  ring    T = 2(p-1) alpha + 2(p-1)/p n beta      (reduce-scatter + all-gather)\n"
      "  tree    T = 2 ceil(log2 p) (alpha + n beta)     (binomial reduce + broadcast, not pipelined)\n"
      "  gather  T = 2(p-1) (alpha + n beta)             (DataParallel-style, at the root's link)\n"
      "Fit: least squares of relative residuals, alpha, beta >= 0, per series of the inputs\n"
      "(backend, ring, gather), one point per size (the faster of out-of-place and in-place);\n"
      "refused with fewer than 3 points, one size only, or times that do not grow with size\n"
      "(beta <= 0, or a byte term under a millionth of every measured time).\n"
      "Hosts: ranks host by host; a ring step costs its slowest link (each inter-host link is\n"
      "crossed once per step); a tree round its slowest pair; gather sums the root's exchanges.\n"
      "Buckets: DDP's per cap (as buckets shows them, --find-unused-parameters and\n"
      "--static-graph too), gradients ready in the layout's ready order at\n"
      "--compute-gbps, each bucket's all_reduce after its last gradient and the previous\n"
      "bucket's; exposed = comm left after backward. Exit 1 when a fit or a --check-against\n"
      "comparison is out of tolerance.");
  return {app, [opts] {
            // A report written over one of the reports read would destroy
            // it (the failure's report too): refused before anything runs.
            std::vector<std::string> read = opts->inputs;
            read.insert(read.end(), opts->check_against.begin(), opts->check_against.end());
            for (const auto* out : {&opts->json_path, &opts->markdown_path})
              for (const auto& in : read)
                if (reports::same_file(*out, in))
                  throw UsageError(fmt::format("{} {} is also a report model reads ({}): writing "
                                               "the model's report would replace it",
                                               out == &opts->json_path ? "--json" : "--markdown", *out, in),
                                   ErrorContext{"flags", -1, -1, "write the report to another file"});
            // The same checks as every command's: one file for both, a
            // read-only (kept) report, a directory that does not exist.
            check_report_outputs(opts->json_path, opts->markdown_path);
            reports::Report report("model", own_command_line());
            int rc = 0;
            try {
              run_model(*opts, report);
              rc = report.has_failed_check() ? static_cast<int>(ExitCode::kCheckFailed) : 0;
            } catch (const Error& e) {
              report.set_error(to_error_info(e));
              if (!opts->json_path.empty() || !opts->markdown_path.empty())
                reports::write_report_outputs(report.finish(), opts->json_path, opts->markdown_path);
              throw;
            }
            if (!opts->json_path.empty() || !opts->markdown_path.empty())
              reports::write_report_outputs(report.finish(), opts->json_path, opts->markdown_path);
            return rc;
          }};
}

}  // namespace ddpdiag::cli
