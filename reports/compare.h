// report compare: a baseline gate. Result rows of two reports are matched by
// (command, table, collective, size, dtype, op, placement, world size,
// backend, and other identity fields a row carries); known figures are
// compared with a direction (busbw higher is better, times lower is better).
// Rows are the objects in the arrays under results, their object blocks
// (allreduce-test's out_of_place / in_place), and the objects of arrays one
// level down, identified with their parent's identity (init-check's
// ranks[].phases[]: rank and phase name).
//
// Noise rule. A figure's spread in one report is, in the figure's unit:
//  - max_rank_time_us - min_rank_time_us of the same row, for time_us, and
//    as the same fraction of the value for rates (busbw_gbps, algbw_gbps),
//    since a rate is bytes over time;
//  - otherwise <figure>_spread, or 2 x <figure>_stddev, when the row has them;
//  - otherwise, for a rate (*_gbps), the same fraction as the spread of the
//    time it derives from: the row's first of time_us, comm_time_us, comm_us,
//    allreduce_time_us, time_per_iter_us, by the rules here (bucket-sweep's
//    busbw_gbps gets comm_time_us_spread's fraction of comm_time_us);
//  - otherwise spread_us / 2 x stddev_us for the row's *_us figures;
//  - otherwise "spread" / 2 x "stddev" as a fraction of the value (0.05 = 5%).
// The noise band of a comparison is the baseline's spread (NEW's own spread
// is part of what is judged); with several baseline runs, also twice the
// median distance of the runs from their median (robust to one outlier).
// A change is a regression only when it is worse than the tolerance AND its
// size is outside the noise band; a change beyond the tolerance but inside
// the band is reported as "noise", not as a regression. Without any spread
// the band is zero and the tolerance alone decides.
//
// Checks are matched by name: a check that fails in NEW is always a
// regression, and so is a NEW verdict of FAIL or ERROR and any worse verdict
// (PASS < FAIL < ERROR): a run that did not pass never passes the gate.
// A figure of a matched row that NEW lacks (absent, null, text) is missing. Rows only in BASE are
// "missing" and rows only in NEW are "new"; neither is a regression unless
// fail_on_missing is set.
//
// Settings. Where the runs differ in a setting that changes what a row
// measures (see SettingChange), rows are matched only under equal settings:
// every row of each report becomes missing or new, and the renderings say
// which settings differ.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports {

// Fields that say which measurement a result row is, in label order: compare
// matches rows by them, and render names a parent row by the first of them
// that tells its rows apart.
inline constexpr const char* kRowIdentity[] = {"collective", "algorithm",  "model",         "bytes",
                                               "size",       "chunk_bytes", "dtype",        "op",
                                               "world_size", "bucket_cap_mb", "bucket_cap_bytes",
                                               // torch 2.x's caps as a list (bucket-sweep's, model's)
                                               "bucket_cap_mb_list", "src",
                                               "dst",        "rank",        "peer",          "phase",
                                               "name"};

struct CompareOptions {
  double max_regression = 0.10;  // fraction: 0.10 = 10%
  bool fail_on_missing = false;  // rows missing from NEW count as regressions
};

enum class ChangeKind { kImproved, kRegressed, kUnchanged, kNoise, kMissing, kNew };
std::string_view change_kind_name(ChangeKind k);  // "improved", "regressed", ...

// One figure of one matched row, or a whole row that is missing or new.
struct FigureChange {
  std::string row;     // human label, e.g. "all_reduce 1M float sum out_of_place [2 gloo]"
  std::string figure;  // "busbw_gbps"; empty for a missing/new row
  bool higher_is_better = true;
  std::optional<double> base, now;
  double change = 0;   // (now - base) / |base|
  double noise = 0;    // noise band as a fraction of |base|
  ChangeKind kind = ChangeKind::kUnchanged;
};

struct CheckChange {
  std::string name;
  std::string base;  // "pass", "fail", "skip", or "" when absent
  std::string now;
  bool regressed = false;
  // Passed in BASE, skipped or absent in NEW: no longer checked (a
  // regression with --fail-on-missing).
  bool missing = false;
};

// A run setting that changes what rows measure (world size, backend, and per
// command e.g. link-health's transfer size or memory's model), recorded by
// both reports with different values. Rows of the two reports then never
// match: each report's value joins its rows' identity.
struct SettingChange {
  std::string name;       // "world size", "backend", or the results field: "bandwidth_bytes"
  std::string base, now;  // the values as text ("256 KiB", "mlp")
};

struct Comparison {
  std::string base_command, new_command;
  std::string base_label, new_label;  // command, world and start time, for headers
  double max_regression = 0.10;
  int base_runs = 1;  // baseline reports merged into BASE
  std::vector<FigureChange> figures;
  std::vector<CheckChange> checks;
  std::string base_verdict, new_verdict;
  bool verdict_regressed = false;
  bool fail_on_missing = false;
  std::vector<SettingChange> settings_changed;

  // Rows (not figures) of each kind: a row is regressed if any figure is
  // (even when another is missing), else missing if any figure is, else new,
  // else improved if any figure is, else noise if any is, else unchanged.
  int rows(ChangeKind k) const;
  bool regressed() const;
};

Comparison compare_reports(const nlohmann::json& base, const nlohmann::json& now,
                           const CompareOptions& options = {});

// Several baseline runs of the same command and settings (the same machine,
// run a few times): each figure of BASE is the median of the runs that have
// its row, and twice the median distance from it joins the noise band, so the
// gate allows what the machine's own run-to-run noise measured. A check
// counts as failing in BASE when it failed in any run, and BASE's verdict is
// the worst of theirs (shown; NEW is judged on its own). Settings are taken
// from the first baseline that did not end with an error.
Comparison compare_reports(const std::vector<nlohmann::json>& bases, const nlohmann::json& now,
                           const CompareOptions& options = {});

// Empty when the baseline runs are of one command with the same settings;
// otherwise what differs, naming the runs by `names` (their paths).
std::string baselines_disagree(const std::vector<nlohmann::json>& bases,
                               const std::vector<std::string>& names);

// Why `report` has nothing to compare against: it ended with an error
// (verdict ERROR) before it measured any result row, as a run interrupted at
// once or refused for its flags; "" when it measured something or did not end
// with an error (a run that failed part-way compares on what it measured).
// "its verdict is ERROR (error interrupted: ...) and it measured no result row".
std::string measured_nothing(const nlohmann::json& report);

// One line naming the settings that differ and what compare did about it;
// the text and Markdown renderings print it when settings_changed is not empty.
std::string settings_note(const Comparison& c);

// Why c regressed, in a few words ("the new run's verdict is FAIL; 2
// regressed figure(s)"); "" when it did not.
std::string regression_reasons(const Comparison& c);

// Rows were there to compare, but none of NEW matched one of BASE.
bool nothing_matched(const Comparison& c);

// Plain-text table for a terminal.
std::string render_comparison_text(const Comparison& c);
// Markdown for a CI summary ($GITHUB_STEP_SUMMARY).
std::string render_comparison_markdown(const Comparison& c);

// "10%", "10" (percent) or "0.5%" -> a fraction; throws std::invalid_argument
// for anything but a plain decimal number with an optional % (no sign, hex,
// exponent, inf or nan: "0x10" is not 16%), and for a bare number between 0
// and 1 ("0.1": 10% or 0.1%?).
double parse_percentage(const std::string& s);

}  // namespace ddpdiag::reports
