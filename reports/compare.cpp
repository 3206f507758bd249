#include "reports/compare.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <stdexcept>

#include <fmt/core.h>

#include "reports/format.h"

namespace ddpdiag::reports {

using nlohmann::json;

namespace {

// Figures the gate knows, with their direction. algbw is busbw times a
// constant, so it is compared only where a row has no busbw.
struct KnownFigure {
  const char* name;
  bool higher_is_better;
};
constexpr KnownFigure kFigures[] = {
    {"busbw_gbps", true},          {"algbw_gbps", true},         {"bandwidth_gbps", true},
    {"indices_per_second", true},  {"time_us", false},           {"exposed_comm_time_us", false},
    {"comm_time_us", false},       {"step_time_us", false},      {"total_time_us", false},
    {"latency_us", false},         {"rtt_us_median", false},     {"peak_bytes", false},
    {"init_time_s", false},        {"exposed_comm_us", false},   {"time_per_iter_us", false},
    {"comm_us", false},            {"allreduce_time_us", false}, {"duration_ms", false},
};

bool is_rate(const std::string& f) { return f.size() > 5 && ends_with(f, "_gbps"); }

// A string field, or dflt when o is not an object or the field is not a string.
std::string str_or(const json& o, const char* key, const std::string& dflt) {
  if (!o.is_object()) return dflt;
  auto it = o.find(key);
  return it != o.end() && it->is_string() ? it->get<std::string>() : dflt;
}

double number_or(const json& o, const char* key, double dflt) {
  if (!o.is_object()) return dflt;
  auto it = o.find(key);
  return it != o.end() && it->is_number() ? it->get<double>() : dflt;
}

// The time figures a rate can derive from, in the order they are looked for:
// a rate is bytes over the first of them a row has (bucket-sweep's busbw over
// its comm_time_us).
constexpr const char* kRateTimes[] = {"time_us", "comm_time_us", "comm_us", "allreduce_time_us",
                                      "time_per_iter_us"};

double time_noise_abs(const json& o, const std::string& fig, double value);

// The spread of one figure in one report, in the figure's unit (see compare.h).
// A rate gets the same relative spread as the time it derives from: a 25%
// slower time within its noise cannot make the bandwidth regress.
double noise_abs(const json& o, const std::string& fig, double value) {
  if (!is_rate(fig)) return time_noise_abs(o, fig, value);
  const double lo = number_or(o, "min_rank_time_us", NAN), hi = number_or(o, "max_rank_time_us", NAN);
  const double t = number_or(o, "time_us", NAN);
  if (std::isfinite(lo) && std::isfinite(hi) && hi >= lo && t > 0) return (hi - lo) / t * std::fabs(value);
  if (double s = number_or(o, (fig + "_spread").c_str(), NAN); std::isfinite(s)) return std::fabs(s);
  if (double s = number_or(o, (fig + "_stddev").c_str(), NAN); std::isfinite(s)) return 2 * std::fabs(s);
  for (const char* time : kRateTimes)
    if (const double tv = number_or(o, time, NAN); tv > 0)
      return time_noise_abs(o, time, tv) / tv * std::fabs(value);
  return time_noise_abs(o, fig, value);
}

// init-check's phases last microseconds to seconds and jitter by more than
// their own length from run to run (a store round trip, a rank starting a
// few ms later); what the gate is for is an init that got slower by a
// noticeable time (a resolver timeout, a slow store, NCCL's init). A
// phase's change under this is noise.
constexpr double kPhaseNoiseFloorMs = 100;

double measured_noise_abs(const json& o, const std::string& fig, double value);

double time_noise_abs(const json& o, const std::string& fig, double value) {
  const double measured = measured_noise_abs(o, fig, value);
  return fig == "duration_ms" ? std::max(measured, kPhaseNoiseFloorMs) : measured;
}

double measured_noise_abs(const json& o, const std::string& fig, double value) {
  const double lo = number_or(o, "min_rank_time_us", NAN), hi = number_or(o, "max_rank_time_us", NAN);
  if (fig == "time_us" && std::isfinite(lo) && std::isfinite(hi) && hi >= lo) return hi - lo;
  if (double s = number_or(o, (fig + "_spread").c_str(), NAN); std::isfinite(s)) return std::fabs(s);
  if (double s = number_or(o, (fig + "_stddev").c_str(), NAN); std::isfinite(s)) return 2 * std::fabs(s);
  // An unnamed spread_us (bucket-sweep's rows before they named it
  // exposed_comm_time_us_spread) is the exposed time's spread alone: the
  // row's other times (step_time_us) were not measured with it.
  if (fig == "exposed_comm_time_us") {
    if (double s = number_or(o, "spread_us", NAN); std::isfinite(s)) return std::fabs(s);
    if (double s = number_or(o, "stddev_us", NAN); std::isfinite(s)) return 2 * std::fabs(s);
  }
  if (double s = number_or(o, "spread", NAN); std::isfinite(s)) return std::fabs(s * value);
  if (double s = number_or(o, "stddev", NAN); std::isfinite(s)) return 2 * std::fabs(s * value);
  return 0;
}

struct Figure {
  std::string name;
  double value = 0;
  double noise = 0;  // absolute
  bool higher_is_better = true;
};

struct Row {
  std::string key;
  std::string label;
  std::vector<Figure> figures;
};

std::vector<Figure> figures_of(const json& o) {
  std::vector<Figure> out;
  const bool has_busbw = o.contains("busbw_gbps") && o["busbw_gbps"].is_number();
  for (const auto& f : kFigures) {
    auto it = o.find(f.name);
    if (it == o.end() || !it->is_number()) continue;
    if (std::string(f.name) == "algbw_gbps" && has_busbw) continue;
    double v = it->get<double>();
    out.push_back({f.name, v, noise_abs(o, f.name, v), f.higher_is_better});
  }
  return out;
}

struct RowContext {
  std::string command, table, collective, world;
  std::string settings_key, settings_label;  // the settings that differ between the reports
};

// Run settings that change what a row measures without appearing in the row:
// a link-health pair's bandwidth depends on the transfer size, a memory row's
// peak on the model. Each is a field at the top of results. World size and
// backend are settings too; every row's key already carries them.
struct CommandSettings {
  const char* command;
  std::vector<const char*> fields;
};
const std::vector<CommandSettings>& command_settings() {
  static const std::vector<CommandSettings> table = {
      {"allreduce-test", {"collective"}},
      {"link-health", {"bandwidth_bytes", "allreduce_bytes"}},
      {"memory",
       {"model", "bucket_cap_mb", "first_bucket_bytes", "bucket_cap_mb_list", "gradient_as_bucket_view",
        "find_unused_parameters", "static_graph", "set_last_bucket_cap", "memory_kind", "workspace_mb"}},
      {"ddp-step",
       {"model", "bucket_cap_bytes", "first_bucket_bytes", "bucket_cap_mb_list", "hook", "averaging", "gradient_as_bucket_view",
        "find_unused_parameters", "static_graph", "skip_all_reduce_unused_params", "first_iteration",
        "set_last_bucket_cap", "compute_gbps", "sparse_rows"}},
      {"bucket-sweep",
       {"model", "first_bucket_bytes", "compute_gbps", "find_unused_parameters", "static_graph",
        "skip_all_reduce_unused_params", "set_last_bucket_cap"}},
      {"broadcast-test", {"model", "bytes"}},
      {"dp-vs-ring", {"collective", "dtype", "op"}},
      // The link flags and the fit's range are null where not given (the
      // links then come from the fit, the fit from every size): a run that
      // gave one differs from a run that did not.
      {"model",
       {"model", "first_bucket_bytes", "compute_gbps", "bucket_algorithm", "find_unused_parameters", "static_graph",
        "skip_all_reduce_unused_params", "set_last_bucket_cap", "backend_as", "predicted_world_size",
        "predicted_ranks_per_host", "intra_gbps", "intra_latency_us", "inter_gbps", "inter_latency_us",
        "fit_min_bytes", "fit_max_bytes"}},
  };
  return table;
}

std::string setting_text(const std::string& name, const json& v) {
  const bool bytes = name.size() > 6 && name.compare(name.size() - 6, 6, "_bytes") == 0;
  if (bytes && v.is_number()) return human_bytes(v.get<double>());
  if (v.is_null()) return "not given";
  if (v.is_array()) return v.dump();  // a list of caps: [1,4,25]
  return v.is_string() ? v.get<std::string>() : format_cell(v);
}

// name -> value of every setting a report records, world size and backend
// first. A setting a report lacks (a run that failed before measuring) is
// absent, and is never called different.
std::vector<std::pair<std::string, json>> settings_of(const json& report) {
  std::vector<std::pair<std::string, json>> out;
  if (!report.is_object()) return out;
  if (auto w = report.find("world"); w != report.end() && w->is_object()) {
    if (auto s = w->find("size"); s != w->end() && s->is_number()) out.push_back({"world size", *s});
    if (auto b = w->find("backend"); b != w->end() && b->is_string()) out.push_back({"backend", *b});
    // Gloo's worker threads (--gloo-threads) change how collectives overlap,
    // and --desync-check adds an all-gather before every collective.
    if (auto t = w->find("gloo_threads"); t != w->end() && t->is_number()) out.push_back({"gloo threads", *t});
    if (auto d = w->find("desync_check"); d != w->end() && d->is_boolean()) out.push_back({"desync check", *d});
  }
  auto res = report.find("results");
  if (res == report.end() || !res->is_object()) return out;
  const std::string command = str_or(report, "command", "");
  for (const auto& cs : command_settings()) {
    if (command != cs.command) continue;
    // A null is recorded as such (a flag not given), unlike a field the
    // report lacks (a run that failed first, or an older ddpdiag).
    for (const char* f : cs.fields)
      if (auto it = res->find(f);
          it != res->end() &&
          (it->is_string() || it->is_number() || it->is_boolean() || it->is_null() || it->is_array()))
        out.push_back({f, *it});
  }
  return out;
}

using Settings = std::vector<std::pair<std::string, json>>;

// The settings both lists record with different values, in b's order.
std::vector<SettingChange> differing_settings(const Settings& b, const Settings& n) {
  std::vector<SettingChange> out;
  for (const auto& [name, bv] : b)
    for (const auto& [nname, nv] : n)
      if (name == nname && bv != nv) {
        std::string bt = setting_text(name, bv), nt = setting_text(name, nv);
        if (bt == nt) {  // rounded alike ("4 MiB"): the exact values
          bt = bv.dump();
          nt = nv.dump();
        }
        out.push_back({name, bt, nt});
      }
  return out;
}

std::vector<SettingChange> differing_settings(const json& base, const json& now) {
  return differing_settings(settings_of(base), settings_of(now));
}

// BASE's settings when there are several runs: the reference run's, then any
// another run records that it lacks (a run that failed early records none).
Settings base_settings(const std::vector<json>& bases, const json& ref) {
  Settings out = settings_of(ref);
  for (const auto& b : bases)
    for (auto& [name, v] : settings_of(b))
      if (std::none_of(out.begin(), out.end(), [&](const auto& s) { return s.first == name; }))
        out.push_back({name, v});
  return out;
}

const json* find_setting(const Settings& s, const std::string& name) {
  for (const auto& [n, v] : s)
    if (n == name) return &v;
  return nullptr;
}

// How many rows of one report have had each key so far: a report can repeat
// a measurement (broadcast-test --chunk-mb 1,1,4 has two 1 MiB rows), and the
// k-th row with a key is matched with the other report's k-th.
using KeyCounts = std::map<std::string, int>;

void add_row(std::vector<Row>& rows, KeyCounts& seen, const RowContext& ctx, const json& row,
             const json& figs_obj, const std::string& placement, const std::string& position) {
  auto figs = figures_of(figs_obj);
  if (figs.empty()) return;
  std::string key = ctx.command + "|" + ctx.table;
  std::vector<std::string> label;
  bool have_collective = false, identified = false;
  for (const char* id : kRowIdentity) {
    auto it = row.find(id);
    // A list of caps is one identity: "[1,4,25]".
    const bool cap_list = std::string_view(id) == "bucket_cap_mb_list" && it != row.end() && it->is_array();
    if (it == row.end() || !(it->is_string() || it->is_number() || cap_list)) continue;
    identified = true;
    std::string v = it->is_string() ? it->get<std::string>() : cap_list ? std::string() : format_cell(*it);
    if (cap_list) {
      for (const auto& c : *it) v += (v.empty() ? "[" : ",") + format_cell(c);
      v += "]";
    }
    key += fmt::format("|{}={}", id, v);
    if (std::string(id) == "collective") have_collective = true;
    if (std::string(id) == "bytes" || std::string(id) == "size")
      label.push_back(it->is_number() ? human_bytes(it->get<double>()) : v);
    else if (std::string(id) == "collective" || std::string(id) == "dtype" || std::string(id) == "op" ||
             std::string(id) == "model" || std::string(id) == "algorithm")
      label.push_back(v);
    else
      label.push_back(fmt::format("{}={}", id, v));
  }
  if (!have_collective && !ctx.collective.empty()) {
    key += "|collective=" + ctx.collective;
    label.insert(label.begin(), ctx.collective);
  }
  if (!identified && !position.empty()) {
    // Rows without identity fields are matched by position ("caps[3]").
    key += "|#" + position;
    label.push_back(position);
  }
  if (!placement.empty()) {
    key += "|" + placement;
    label.push_back(placement);
  }
  key += "|" + ctx.world + ctx.settings_key;
  std::string text;
  for (const auto& l : label) text += (text.empty() ? "" : " ") + l;
  if (text.empty()) text = ctx.table.empty() ? ctx.command : ctx.table;
  if (const int k = ++seen[key]; k > 1) {
    // A repeat of an earlier row's identity: its own row, "#k" in key and label.
    key += fmt::format("|#{}", k);
    text += fmt::format(" #{}", k);
  }
  rows.push_back({key, fmt::format("{} [{}{}]", text, ctx.world, ctx.settings_label), std::move(figs)});
}

// Rows of a report. The settings named in `keyed`, those that differ between
// any two of the runs compared (world size and backend aside, which ctx.world
// holds), join every row's key and label with this report's own value, so
// rows measured under different settings never match. A setting the report
// lacks (a run that failed before recording it) is never called different:
// it takes the value in `fallback`.
std::vector<Row> extract_rows(const json& report, const std::vector<std::string>& keyed, const Settings& fallback) {
  std::vector<Row> rows;
  KeyCounts seen;
  RowContext ctx;
  ctx.command = str_or(report, "command", "?");
  const auto own = settings_of(report);
  for (const auto& name : keyed) {
    if (name == "world size" || name == "backend") continue;
    const json* v = find_setting(own, name);
    if (!v) v = find_setting(fallback, name);
    const std::string text = v ? setting_text(name, *v) : "?";
    ctx.settings_key += fmt::format("|{}={}", name, v ? v->dump() : "?");
    ctx.settings_label += fmt::format(" {}={}", name, text);
  }
  const json w = report.is_object() && report.contains("world") ? report["world"] : json();
  if (w.is_object())
    ctx.world = fmt::format("{} {}", format_cell(w.contains("size") ? w["size"] : json()), str_or(w, "backend", "?"));
  else
    ctx.world = "1 local";
  const json res = report.is_object() && report.contains("results") ? report["results"] : json();
  if (!res.is_object()) return rows;
  if (res.contains("collective") && res["collective"].is_string())
    ctx.collective = res["collective"].get<std::string>();
  // Figures at the top of results (e.g. store ping's rtt_us_median).
  {
    RowContext top = ctx;
    top.collective.clear();
    add_row(rows, seen, top, json::object(), res, "", "");
  }
  for (auto it = res.begin(); it != res.end(); ++it) {
    if (!it->is_array()) continue;
    RowContext t = ctx;
    t.table = it.key();
    for (std::size_t i = 0; i < it->size(); ++i) {
      const json& row = (*it)[i];
      if (!row.is_object()) continue;
      const std::string pos = fmt::format("{}[{}]", t.table, i);
      add_row(rows, seen, t, row, row, "", pos);
      for (auto b = row.begin(); b != row.end(); ++b) {
        // Nested blocks, as allreduce-test's out_of_place / in_place.
        if (b->is_object()) add_row(rows, seen, t, row, *b, b.key(), pos);
        if (!b->is_array()) continue;
        // Nested tables, as init-check's ranks[].phases[]: each entry is a
        // row identified by its own fields and its parent's (rank and phase
        // name).
        RowContext nt = t;
        nt.table = t.table + "." + b.key();
        for (std::size_t j = 0; j < b->size(); ++j) {
          const json& sub = (*b)[j];
          if (!sub.is_object()) continue;
          json id = json::object();
          for (const char* f : kRowIdentity)
            if (auto p = row.find(f); p != row.end()) id[f] = *p;
          for (const char* f : kRowIdentity)
            if (auto p = sub.find(f); p != sub.end()) id[f] = *p;
          add_row(rows, seen, nt, id, sub, "", fmt::format("{}.{}[{}]", pos, b.key(), j));
        }
      }
    }
  }
  return rows;
}

std::string check_status(const json& c) { return str_or(c, "status", ""); }

int verdict_rank(const std::string& v) {
  if (v == "PASS") return 0;
  if (v == "FAIL") return 1;
  if (v == "ERROR") return 2;
  return -1;
}

std::string report_label(const json& r) {
  std::string world = "no world";
  if (r.is_object() && r.contains("world") && r["world"].is_object())
    world = fmt::format("{} rank(s), {}", format_cell(r["world"].contains("size") ? r["world"]["size"] : json()),
                        str_or(r["world"], "backend", "?"));
  return fmt::format("{}, {}, {}", str_or(r, "command", "?"), world, str_or(r, "started_at", "no start time"));
}

std::string verdict_of(const json& r) { return str_or(r, "verdict", ""); }

// A change a microsecond time must exceed to count at all.
constexpr double kTimeResolutionUs = 0.25;

std::string percent(double f) {
  // From a baseline of 0 there is no percentage (the change is judged in
  // the figure's own units).
  if (!std::isfinite(f)) return "n/a (from 0)";
  if (std::fabs(f) >= 1e4) return fmt::format("{:+.3g}%", f * 100);
  // A change below 0.05% (judged against a tolerance that small) keeps two
  // significant digits rather than showing as +0.0%.
  if (f != 0 && std::fabs(f) < 5e-4) return fmt::format("{:+.2g}%", f * 100);
  return fmt::format("{:+.1f}%", f * 100);
}

ChangeKind row_kind(const std::vector<const FigureChange*>& figs) {
  auto any = [&](ChangeKind k) {
    return std::any_of(figs.begin(), figs.end(), [k](const FigureChange* f) { return f->kind == k; });
  };
  // A regressed figure makes the row regressed even when another figure of it
  // is missing: the summary must agree with the result line.
  for (auto k : {ChangeKind::kRegressed, ChangeKind::kMissing, ChangeKind::kNew, ChangeKind::kImproved,
                 ChangeKind::kNoise})
    if (any(k)) return k;
  return ChangeKind::kUnchanged;
}

// Figures grouped by row label, in order.
std::vector<std::pair<std::string, std::vector<const FigureChange*>>> by_row(const Comparison& c) {
  std::vector<std::pair<std::string, std::vector<const FigureChange*>>> out;
  std::map<std::string, std::size_t> where;
  for (const auto& f : c.figures) {
    auto [it, fresh] = where.emplace(f.row, out.size());
    if (fresh) out.push_back({f.row, {}});
    out[it->second].second.push_back(&f);
  }
  return out;
}

std::string value_cell(const std::optional<double>& v) { return v ? format_figure(*v) : "-"; }

}  // namespace

std::string_view change_kind_name(ChangeKind k) {
  switch (k) {
    case ChangeKind::kImproved: return "improved";
    case ChangeKind::kRegressed: return "regressed";
    case ChangeKind::kUnchanged: return "unchanged";
    case ChangeKind::kNoise: return "noise";
    case ChangeKind::kMissing: return "missing";
    case ChangeKind::kNew: return "new";
  }
  return "?";
}

int Comparison::rows(ChangeKind k) const {
  int n = 0;
  for (const auto& [label, figs] : by_row(*this))
    if (row_kind(figs) == k) ++n;
  return n;
}

bool nothing_matched(const Comparison& c) {
  bool rows = false;
  for (const auto& f : c.figures) {
    if (f.base && f.now) return false;
    rows = true;
  }
  return rows;
}

std::string regression_reasons(const Comparison& c) {
  std::vector<std::string> why;
  if (verdict_rank(c.new_verdict) > 0) why.push_back("the new run's verdict is " + c.new_verdict);
  else if (c.verdict_regressed) why.push_back("a worse verdict");
  int checks = 0, figs = 0, missing = 0;
  for (const auto& ch : c.checks) {
    checks += ch.regressed;
    missing += c.fail_on_missing && ch.missing;
  }
  for (const auto& f : c.figures) {
    figs += f.kind == ChangeKind::kRegressed;
    missing += c.fail_on_missing && f.kind == ChangeKind::kMissing;
  }
  if (checks) why.push_back(fmt::format("{} failing check(s)", checks));
  if (figs) why.push_back(fmt::format("{} regressed figure(s)", figs));
  if (missing) why.push_back(fmt::format("{} missing with --fail-on-missing", missing));
  std::string out;
  for (const auto& w : why) out += (out.empty() ? "" : "; ") + w;
  return out;
}

bool Comparison::regressed() const {
  if (verdict_regressed) return true;
  for (const auto& ch : checks)
    if (ch.regressed || (fail_on_missing && ch.missing)) return true;
  for (const auto& f : figures)
    if (f.kind == ChangeKind::kRegressed || (fail_on_missing && f.kind == ChangeKind::kMissing))
      return true;
  return false;
}

namespace {

// Several baseline runs as one: each figure of a row is the median of the
// runs that have the row, and its noise is the larger of the runs' median
// own spread and twice the median distance of the runs from their median,
// which is what the same machine's run-to-run noise measured.
std::vector<Row> merge_baselines(const std::vector<std::vector<Row>>& runs) {
  std::vector<Row> out;
  std::map<std::string, std::size_t> where;
  std::vector<std::map<std::string, std::vector<Figure>>> seen;  // per row: figure -> each run's
  for (const auto& rows : runs)
    for (const auto& r : rows) {
      auto [it, fresh] = where.emplace(r.key, out.size());
      if (fresh) {
        out.push_back({r.key, r.label, {}});
        seen.emplace_back();
      }
      auto& figs = seen[it->second];
      for (const auto& f : r.figures) {
        auto& list = figs[f.name];
        if (list.empty()) out[it->second].figures.push_back(f);  // keeps the figure order
        list.push_back(f);
      }
    }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
  };
  for (std::size_t i = 0; i < out.size(); ++i)
    for (auto& f : out[i].figures) {
      const auto& list = seen[i][f.name];
      if (list.size() < 2) continue;
      std::vector<double> v, own;
      for (const auto& g : list) {
        v.push_back(g.value);
        own.push_back(g.noise);
      }
      f.value = median(v);
      // Run-to-run noise as twice the median distance from the median: with
      // two runs that is their range, and one outlier among three or more
      // runs does not widen it (the full range would let it hide any
      // regression).
      std::vector<double> dev;
      for (double x : v) dev.push_back(std::fabs(x - f.value));
      f.noise = std::max(median(own), 2 * median(dev));
    }
  return out;
}

}  // namespace

std::string baselines_disagree(const std::vector<json>& bases, const std::vector<std::string>& names) {
  for (std::size_t i = 1; i < bases.size(); ++i) {
    const std::string name_i = i < names.size() ? names[i] : fmt::format("baseline {}", i + 1);
    const std::string name_0 = names.empty() ? "baseline 1" : names[0];
    const std::string cmd0 = str_or(bases[0], "command", "?"), cmd = str_or(bases[i], "command", "?");
    if (cmd != cmd0)
      return fmt::format("{} is a report of '{}' and {} one of '{}'", name_i, cmd, name_0, cmd0);
  }
  // Every pair: a run that recorded no settings (it failed first) agrees with
  // every other, so comparing with the first alone would miss the others'
  // difference.
  for (std::size_t i = 1; i < bases.size(); ++i)
    for (std::size_t j = 0; j < i; ++j) {
      const auto d = differing_settings(bases[j], bases[i]);
      if (d.empty()) continue;
      const std::string name_i = i < names.size() ? names[i] : fmt::format("baseline {}", i + 1);
      const std::string name_j = j < names.size() ? names[j] : fmt::format("baseline {}", j + 1);
      std::string list;
      for (const auto& s : d)
        list += fmt::format("{}{} {} ({}) vs {} ({})", list.empty() ? "" : ", ", s.name, s.now, name_i,
                            s.base, name_j);
      return fmt::format("the baseline runs were made with different settings: {}", list);
    }
  return "";
}

std::string measured_nothing(const json& report) {
  if (verdict_of(report) != "ERROR" || !extract_rows(report, {}, {}).empty()) return "";
  const json err = report.is_object() && report.contains("error") ? report["error"] : json();
  const std::string kind = str_or(err, "kind", ""), message = str_or(err, "message", "");
  std::string error;
  if (!kind.empty() || !message.empty())
    error = fmt::format(" (error{}{}{})", kind.empty() ? "" : " " + kind, message.empty() ? "" : ": ",
                        escape_controls(message));
  return fmt::format("its verdict is ERROR{} and it measured no result row", error);
}

Comparison compare_reports(const json& base, const json& now, const CompareOptions& o) {
  return compare_reports(std::vector<json>{base}, now, o);
}

Comparison compare_reports(const std::vector<json>& bases, const json& now, const CompareOptions& o) {
  if (bases.empty()) throw std::invalid_argument("compare_reports: no baseline report");
  // The baseline that speaks for the settings: the first that measured
  // something (a run that ended with an error before it recorded its
  // settings would switch the settings check off).
  const json* ref = &bases.front();
  for (const auto& b : bases)
    if (verdict_of(b) != "ERROR") {
      ref = &b;
      break;
    }
  const json& base = *ref;
  Comparison c;
  c.max_regression = o.max_regression;
  c.fail_on_missing = o.fail_on_missing;
  c.base_runs = static_cast<int>(bases.size());
  c.base_command = str_or(base, "command", "?");
  c.new_command = str_or(now, "command", "?");
  c.base_label = report_label(base);
  if (bases.size() > 1)
    c.base_label += fmt::format(" and {} more run(s): each figure is their median, and twice "
                                "the runs' median distance from it joins the spread",
                                bases.size() - 1);
  c.new_label = report_label(now);

  const Settings bset = base_settings(bases, base), nset = settings_of(now);
  c.settings_changed = differing_settings(bset, nset);
  // Rows are keyed by each run's own value of every setting that differs
  // between BASE and NEW or between two baseline runs (which the command line
  // refuses to merge; here their rows simply never meet).
  std::vector<std::string> keyed;
  auto key_by = [&](const std::vector<SettingChange>& d) {
    for (const auto& s : d)
      if (std::find(keyed.begin(), keyed.end(), s.name) == keyed.end()) keyed.push_back(s.name);
  };
  key_by(c.settings_changed);
  for (std::size_t i = 1; i < bases.size(); ++i)
    for (std::size_t j = 0; j < i; ++j) key_by(differing_settings(bases[j], bases[i]));
  Settings fallback = bset;  // for a run that lacks a setting: BASE's, else NEW's
  for (const auto& [name, v] : nset)
    if (!find_setting(fallback, name)) fallback.push_back({name, v});
  std::vector<std::vector<Row>> base_runs;
  for (const auto& b : bases) base_runs.push_back(extract_rows(b, keyed, fallback));
  const auto base_rows = merge_baselines(base_runs);
  const auto new_rows = extract_rows(now, keyed, fallback);
  std::map<std::string, const Row*> new_by_key;
  for (const auto& r : new_rows) new_by_key.emplace(r.key, &r);
  std::map<std::string, const Row*> base_by_key;
  for (const auto& r : base_rows) base_by_key.emplace(r.key, &r);

  for (const auto& b : base_rows) {
    auto it = new_by_key.find(b.key);
    if (it == new_by_key.end()) {
      c.figures.push_back({b.label, "", true, std::nullopt, std::nullopt, 0, 0, ChangeKind::kMissing});
      continue;
    }
    const Row& n = *it->second;
    for (const auto& bf : b.figures) {
      auto nf = std::find_if(n.figures.begin(), n.figures.end(),
                             [&](const Figure& f) { return f.name == bf.name; });
      if (nf == n.figures.end()) {
        // The row is there but this figure is not a number in NEW (absent,
        // null, text): missing, not silently unchanged.
        c.figures.push_back({b.label, bf.name, bf.higher_is_better, bf.value, std::nullopt, 0, 0,
                             ChangeKind::kMissing});
        continue;
      }
      FigureChange fc;
      fc.row = b.label;
      fc.figure = bf.name;
      fc.higher_is_better = bf.higher_is_better;
      fc.base = bf.value;
      fc.now = nf->value;
      const double d = nf->value - bf.value;
      const double scale = std::fabs(bf.value);
      fc.change = scale > 0 ? d / scale : (d == 0 ? 0.0 : (d > 0 ? INFINITY : -INFINITY));
      // The baseline's spread only: a wide spread in NEW (one rank slower
      // than the others) is part of what is judged, not an excuse.
      double band = bf.noise;
      // From a baseline time of 0 (communication hidden entirely) every
      // change is infinitely many percent and no tolerance applies: a time
      // grows out of 0 only by more than one of its units (1 us; 1 ms for
      // a phase's duration).
      if (scale == 0 && (ends_with(bf.name, "_us") || ends_with(bf.name, "_ms"))) band = std::max(band, 1.0);
      // A time in microseconds that moved by less than a quarter of one
      // moved by less than a timed call resolves (dp-vs-ring's world-size-1
      // rows time a no-op of 0.03 us): noise, however many percent.
      if (ends_with(bf.name, "_us")) band = std::max(band, kTimeResolutionUs);
      fc.noise = scale > 0 ? band / scale : 0;
      const double worse = bf.higher_is_better ? -fc.change : fc.change;
      // A change of exactly the tolerance is within it: 0.7 -> 0.77 is
      // +10%, though the quotient in doubles comes out a hair above 0.1.
      if (std::fabs(worse) <= o.max_regression * (1 + 1e-9) + 1e-12)
        fc.kind = ChangeKind::kUnchanged;
      else if (std::fabs(d) <= band)
        fc.kind = ChangeKind::kNoise;
      else
        fc.kind = worse > 0 ? ChangeKind::kRegressed : ChangeKind::kImproved;
      c.figures.push_back(fc);
    }
  }
  for (const auto& n : new_rows)
    if (!base_by_key.count(n.key))
      c.figures.push_back({n.label, "", true, std::nullopt, std::nullopt, 0, 0, ChangeKind::kNew});

  // Checks by name, in BASE's order then NEW's new ones.
  // A check that failed in any baseline run counts as failing there: only a
  // check that passed in every one regresses by failing now.
  std::vector<std::pair<std::string, std::string>> bchecks, nchecks;
  for (const auto& b : bases)
    if (b.is_object() && b.contains("checks") && b["checks"].is_array())
      for (const auto& ch : b["checks"]) {
        const std::string name = str_or(ch, "name", "?"), st = check_status(ch);
        auto it = std::find_if(bchecks.begin(), bchecks.end(), [&](const auto& x) { return x.first == name; });
        if (it == bchecks.end())
          bchecks.push_back({name, st});
        else if (st == "fail")
          it->second = st;
      }
  // Two checks of one name in NEW (a command that judges several rows by
  // one rule): one entry, failing when either fails.
  if (now.is_object() && now.contains("checks") && now["checks"].is_array())
    for (const auto& ch : now["checks"]) {
      const std::string name = str_or(ch, "name", "?"), st = check_status(ch);
      auto it = std::find_if(nchecks.begin(), nchecks.end(), [&](const auto& x) { return x.first == name; });
      if (it == nchecks.end())
        nchecks.push_back({name, st});
      else if (st == "fail" || (st == "pass" && it->second == "skip"))
        it->second = st;
    }
  auto find = [](const auto& v, const std::string& name) -> std::string {
    for (const auto& [n, s] : v)
      if (n == name) return s;
    return "";
  };
  for (const auto& [name, st] : bchecks) {
    std::string ns = find(nchecks, name);
    // A check failing in NEW never passes the gate, even where a baseline
    // run failed it too (one bad baseline would switch it off for good).
    CheckChange ch{name, st, ns, ns == "fail"};
    ch.missing = st == "pass" && (ns.empty() || ns == "skip");
    c.checks.push_back(ch);
  }
  for (const auto& [name, st] : nchecks)
    if (find(bchecks, name).empty() &&
        std::none_of(bchecks.begin(), bchecks.end(), [&](const auto& b) { return b.first == name; }))
      c.checks.push_back({name, "", st, st == "fail"});

  // The worst verdict among the baseline runs.
  c.base_verdict = verdict_of(base);
  for (const auto& b : bases)
    if (verdict_rank(verdict_of(b)) > verdict_rank(c.base_verdict)) c.base_verdict = verdict_of(b);
  c.new_verdict = verdict_of(now);
  // A NEW run that failed or ended with an error does not pass the gate,
  // whatever the baselines did.
  c.verdict_regressed = verdict_rank(c.new_verdict) > 0 ||
                        (verdict_rank(c.new_verdict) > verdict_rank(c.base_verdict) &&
                         verdict_rank(c.base_verdict) >= 0);
  return c;
}

std::string settings_note(const Comparison& c) {
  std::string list;
  for (const auto& d : c.settings_changed)
    list += fmt::format("{}{} {} (base) vs {} (new)", list.empty() ? "" : ", ", d.name, d.base, d.now);
  return fmt::format("the runs' settings differ: {}. Rows measured under different settings are not "
                     "compared; they are listed as missing and new ({}). Compare runs made with the same "
                     "settings, or record a new baseline",
                     list, c.fail_on_missing ? "--fail-on-missing fails the gate on them"
                                             : "--fail-on-missing makes them fail the gate");
}

std::string render_comparison_text(const Comparison& c) {
  // What the reports supply (host, model and phase names, check names) is
  // shown with its control characters escaped: a report cannot drive the
  // terminal or start a line of its own.
  const auto t = [](const std::string& s) { return escape_controls(s); };
  std::string out;
  out += fmt::format("base: {}\nnew:  {}\n", t(c.base_label), t(c.new_label));
  if (c.base_command != c.new_command)
    out += fmt::format("note: the reports are of different commands ({} vs {}); only rows with the "
                       "same identity are compared\n",
                       t(c.base_command), t(c.new_command));
  if (!c.settings_changed.empty())
    out += fmt::format("note: {}\n", t(settings_note(c)));
  if (nothing_matched(c))
    out += "note: no row of NEW matched a row of BASE, so no figure was compared (other sizes, dtypes "
           "or settings?); only the checks and verdicts were\n";
  out += fmt::format(
      "a figure regresses when it is worse by more than {:g}% and by more than the measured "
      "spread\n\n",
      c.max_regression * 100);
  std::size_t w = 3;
  for (const auto& f : c.figures) w = std::max(w, t(f.row).size());
  w = std::min<std::size_t>(w, 60);
  out += fmt::format("{:<10} {:<{}} {:<22} {:>12} {:>12} {:>9} {:>8}\n", "status", "row", w, "figure",
                     "base", "new", "change", "spread");
  for (const auto& f : c.figures) {
    std::string fig = f.figure.empty() ? "-" : f.figure + (f.higher_is_better ? " (+)" : " (-)");
    std::string change = f.base && f.now ? percent(f.change) : "-";
    std::string spread = f.base && f.now && f.noise > 0 ? fmt::format("±{:.1f}%", f.noise * 100) : "-";
    out += fmt::format("{:<10} {:<{}} {:<22} {:>12} {:>12} {:>9} {:>8}\n", change_kind_name(f.kind), t(f.row),
                       w, fig, value_cell(f.base), value_cell(f.now), change, spread);
  }
  if (!c.checks.empty()) {
    out += "\nchecks:\n";
    for (const auto& ch : c.checks)
      out += fmt::format("  {:<20} {:>6} -> {:<6}{}\n", t(ch.name), ch.base.empty() ? "(none)" : t(ch.base),
                         ch.now.empty() ? "(none)" : t(ch.now),
                         ch.regressed                          ? "  REGRESSED"
                         : ch.missing && c.fail_on_missing     ? "  NO LONGER CHECKED (--fail-on-missing)"
                         : ch.missing                          ? "  no longer checked"
                                                               : "");
  }
  out += fmt::format("verdict: {} -> {}{}\n", c.base_verdict.empty() ? "?" : t(c.base_verdict),
                     c.new_verdict.empty() ? "?" : t(c.new_verdict), c.verdict_regressed ? "  REGRESSED" : "");
  out += fmt::format("rows: {} improved, {} regressed, {} unchanged, {} within noise, {} missing, {} new\n",
                     c.rows(ChangeKind::kImproved), c.rows(ChangeKind::kRegressed),
                     c.rows(ChangeKind::kUnchanged), c.rows(ChangeKind::kNoise),
                     c.rows(ChangeKind::kMissing), c.rows(ChangeKind::kNew));
  out += fmt::format("result: {}{}\n", c.regressed() ? "REGRESSION" : "no regression",
                     c.regressed() ? " (" + t(regression_reasons(c)) + ")" : std::string());
  return out;
}

std::string render_comparison_markdown(const Comparison& c) {
  std::string out;
  out += fmt::format("## ddpdiag report compare: {}\n\n",
                     c.regressed() ? "❌ regression (" + markdown_text(regression_reasons(c)) + ")" : "✅ no regression");
  out += fmt::format("- base: {}\n- new: {}\n- tolerance: {:g}% (and outside the measured spread)\n\n",
                     markdown_cell(c.base_label), markdown_cell(c.new_label), c.max_regression * 100);
  if (!c.settings_changed.empty()) out += fmt::format("> **Note:** {}\n\n", markdown_cell(settings_note(c)));
  if (nothing_matched(c))
    out += "> **Note:** no row of NEW matched a row of BASE, so no figure was compared (other sizes, "
           "dtypes or settings?); only the checks and verdicts were.\n\n";
  out += "| improved | regressed | unchanged | within noise | missing | new |\n|---:|---:|---:|---:|---:|---:|\n";
  out += fmt::format("| {} | {} | {} | {} | {} | {} |\n\n", c.rows(ChangeKind::kImproved),
                     c.rows(ChangeKind::kRegressed), c.rows(ChangeKind::kUnchanged),
                     c.rows(ChangeKind::kNoise), c.rows(ChangeKind::kMissing), c.rows(ChangeKind::kNew));
  out += fmt::format("Verdict: **{}** → **{}**{}\n\n", c.base_verdict.empty() ? "?" : markdown_text(c.base_verdict),
                     c.new_verdict.empty() ? "?" : markdown_text(c.new_verdict), c.verdict_regressed ? " (regressed)" : "");
  if (!c.checks.empty()) {
    out += "| check | base | new | |\n|---|---|---|---|\n";
    for (const auto& ch : c.checks)
      out += fmt::format("| {} | {} | {} | {} |\n", markdown_cell(ch.name),
                         ch.base.empty() ? "–" : markdown_cell(ch.base), ch.now.empty() ? "–" : markdown_cell(ch.now),
                         ch.regressed ? "❌ regressed"
                         : ch.missing ? (c.fail_on_missing ? "❌ no longer checked" : "no longer checked")
                                      : "");
    out += "\n";
  }
  auto table = [&](bool notable) {
    std::string t = "| status | row | figure | base | new | change | spread |\n|---|---|---|---:|---:|---:|---:|\n";
    int n = 0;
    for (const auto& f : c.figures) {
      bool is_notable = f.kind != ChangeKind::kUnchanged;
      if (is_notable != notable) continue;
      ++n;
      std::string change = f.base && f.now ? percent(f.change) : "–";
      std::string spread = f.base && f.now && f.noise > 0 ? fmt::format("±{:.1f}%", f.noise * 100) : "–";
      t += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", change_kind_name(f.kind), markdown_cell(f.row),
                       f.figure.empty() ? "–" : f.figure, value_cell(f.base), value_cell(f.now), change, spread);
    }
    return std::pair{t, n};
  };
  auto [changed, nchanged] = table(true);
  if (nchanged) out += "### Changes\n\n" + changed + "\n";
  auto [same, nsame] = table(false);
  if (nsame)
    out += fmt::format("<details><summary>{} unchanged figure(s)</summary>\n\n{}\n</details>\n\n", nsame, same);
  return out;
}

double parse_percentage(const std::string& s) {
  auto trim = [](std::string t) {
    while (!t.empty() && std::isspace(static_cast<unsigned char>(t.back()))) t.pop_back();
    std::size_t b = 0;
    while (b < t.size() && std::isspace(static_cast<unsigned char>(t[b]))) ++b;
    return t.substr(b);
  };
  std::string t = trim(s);
  if (!t.empty() && t.back() == '%') t = trim(t.substr(0, t.size() - 1));
  // Only a plain decimal number: digits with at most one point. std::stod
  // alone would also read hex ("0x10" as 16), exponents, "inf" and "nan".
  std::size_t digits = 0, points = 0, others = 0;
  for (char ch : t) {
    if (ch >= '0' && ch <= '9')
      ++digits;
    else if (ch == '.')
      ++points;
    else
      ++others;
  }
  const auto refuse = [&]() {
    return std::invalid_argument(fmt::format("'{}' is not a percentage: write a plain decimal number, "
                                             "optionally followed by %, e.g. 10% or 2.5",
                                             s));
  };
  if (digits == 0 || points > 1 || others > 0) throw refuse();
  // A number of hundreds of digits is a plain decimal number all the same:
  // beyond a double (too large, or too small to tell from 0), so out of
  // range rather than malformed.
  const auto beyond_double = [&]() {
    return std::invalid_argument(fmt::format("'{}' is out of range: it has more digits than a number can "
                                             "hold; write a percentage such as 10% or 2.5",
                                             s.size() > 40 ? s.substr(0, 20) + "..." : s));
  };
  double v = 0;
  try {
    v = std::stod(t);
  } catch (const std::out_of_range&) {
    throw beyond_double();
  } catch (const std::exception&) {
    throw refuse();
  }
  if (!std::isfinite(v)) throw beyond_double();
  // A bare fraction is most likely meant as one (0.1 for 10%), which as a
  // percentage would be 0.1%: make the writer say which.
  if (v > 0 && v < 1 && s.find('%') == std::string::npos)
    throw std::invalid_argument(fmt::format("'{}' is ambiguous: write {}% for a fraction of {}, or {}% "
                                            "for {} percent",
                                            s, v * 100, s, s, s));
  return v / 100.0;
}

}  // namespace ddpdiag::reports
