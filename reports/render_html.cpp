// HTML view of a report: one self-contained page (inline CSS, inline SVG, no
// script, nothing fetched at view time). Charts appear for the results a
// report has: bandwidth per size for any "sizes" rows, the bucket layout, the
// bucket-sweep curve, the link-health heat map, per-rank memory and the init
// timeline; the layouts read are those described in the schema's
// $defs/planned_results.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <set>

#include <fmt/core.h>

#include "reports/format.h"
#include "reports/render.h"
#include "reports/report_view.h"
#include "reports/svg_chart.h"

namespace ddpdiag::reports {

using nlohmann::json;

namespace {

const json& at(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}

// The first of several accepted names that is present.
const json& first_of(const json& j, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (!at(j, k).is_null()) return at(j, k);
  return at(j, "");
}

std::optional<double> number(const json& v) {
  if (v.is_number()) return v.get<double>();
  return std::nullopt;
}

constexpr const char* kCss = R"css(
*{box-sizing:border-box}
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;padding:16px;color:#1d1d1f;background:#f4f5f7;line-height:1.4}
main{max-width:980px;margin:0 auto}
h1{font-size:1.5em;margin:0 0 8px}
h2{font-size:1.15em;margin:0 0 8px}
.card{background:#fff;border:1px solid #dcdfe4;border-radius:8px;padding:12px 16px;margin:12px 0}
svg.chart{width:100%;height:auto;display:block;max-width:100%}
.scroll{overflow-x:auto;-webkit-overflow-scrolling:touch}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
th,td{padding:4px 8px;border-bottom:1px solid #eceef1;text-align:left;vertical-align:top}
th{background:#f7f8fa;font-weight:600;min-width:4em}
td.n{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.w{overflow-wrap:anywhere;min-width:16em}
.verdict{display:inline-block;padding:2px 12px;border-radius:14px;color:#fff;font-weight:700;letter-spacing:.03em}
.v-PASS{background:#1b7f3b}.v-FAIL{background:#c62828}.v-ERROR{background:#6a1b9a}.v-none{background:#777}
.s-pass{color:#1b7f3b;font-weight:600}.s-fail{color:#c62828;font-weight:700}.s-skip{color:#777}
dl.ctx{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0 0}
dl.ctx dt{color:#555}dl.ctx dd{margin:0;overflow-wrap:anywhere}
.error{border-color:#c62828;background:#fff5f5}
.note{color:#666;font-size:.9em}
code{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:.92em;overflow-wrap:anywhere}
summary{cursor:pointer;font-weight:600}
footer{color:#888;font-size:.85em;text-align:center;margin:16px 0}
@media (max-width:640px){body{padding:6px}svg.chart text:not(.cell){font-size:17px}svg.chart text.title{font-size:17px}.card{padding:10px}dl.ctx{grid-template-columns:1fr}dl.ctx dt{font-weight:600;color:#333}h1{font-size:1.25em}}
)css";

constexpr std::size_t kLongCell = 40;  // characters

std::string table_html(const view::Table& t) {
  std::string out = "<div class=\"scroll\"><table><thead><tr>";
  for (const auto& h : t.header) out += "<th>" + html_escape(h) + "</th>";
  out += "</tr></thead><tbody>";
  for (const auto& row : t.rows) {
    out += "<tr>";
    for (std::size_t c = 0; c < row.size(); ++c) {
      // A numeric column's long text (a summary's recommendation, a
      // flattened object) wraps: kept on one line, one cell would push the
      // column's short values out of sight.
      const bool n = c < t.numeric.size() && t.numeric[c];
      const bool long_text = row[c].size() > kLongCell;
      out += std::string(n && !long_text ? "<td class=\"n\">" : long_text ? "<td class=\"w\">" : "<td>") +
             html_escape(row[c]) + "</td>";
    }
    out += "</tr>";
  }
  out += "</tbody></table></div>";
  if (!t.note.empty()) out += "<p class=\"note\">" + html_escape(t.note) + "</p>";
  return out;
}

std::string card(const std::string& title, const std::string& body, const std::string& cls = "") {
  return fmt::format("<section class=\"card{}\"><h2>{}</h2>{}</section>\n", cls.empty() ? "" : " " + cls,
                     html_escape(title), body);
}

// Bus bandwidth against message size, one chart per collective, one line per
// dtype/op and placement.
std::vector<std::string> bandwidth_charts(const json& res) {
  std::vector<std::string> out;
  const json& sizes = at(res, "sizes");
  if (!sizes.is_array() || sizes.empty()) return out;
  const std::string default_collective = at(res, "collective").is_string() ? at(res, "collective").get<std::string>() : "";
  // collective -> series in first-seen order (out-of-place before in-place)
  std::map<std::string, std::vector<svg::Series>> by_collective;
  std::vector<std::string> order;
  for (const auto& r : sizes) {
    auto bytes = number(at(r, "bytes"));
    if (!bytes || *bytes <= 0) continue;
    std::string coll = at(r, "collective").is_string() ? at(r, "collective").get<std::string>() : default_collective;
    std::string base;
    for (const char* k : {"algorithm", "dtype", "op"})
      if (at(r, k).is_string()) base += (base.empty() ? "" : " ") + at(r, k).get<std::string>();
    // dp-vs-ring measures several world sizes in one report.
    if (at(r, "world_size").is_number_integer())
      base += fmt::format("{}n={}", base.empty() ? "" : " ", at(r, "world_size").get<int>());
    if (!by_collective.count(coll)) order.push_back(coll);
    auto& series = by_collective[coll];
    auto add = [&](const std::string& name, bool dashed, const json& b) {
      auto bw = number(at(b, "busbw_gbps"));
      if (!bw) return;
      auto it = std::find_if(series.begin(), series.end(), [&](const svg::Series& s) { return s.name == name; });
      if (it == series.end()) it = series.insert(series.end(), svg::Series{name, {}, dashed});
      it->points.push_back({*bytes, *bw});
    };
    add(base + (base.empty() ? "" : " ") + "out-of-place", false, at(r, "out_of_place"));
    add(base + (base.empty() ? "" : " ") + "in-place", true, at(r, "in_place"));
    if (at(r, "busbw_gbps").is_number()) add(base.empty() ? "busbw" : base, false, r);
  }
  for (const auto& coll : order) {
    svg::LineChart c;
    c.title = fmt::format("Bus bandwidth vs message size{}", coll.empty() ? "" : " — " + coll);
    c.x_label = "message size (bytes, log scale)";
    c.y_label = "bus bandwidth (GB/s)";
    c.log_x = true;
    c.x_format = svg::AxisFormat::kBytes;
    for (auto& s : by_collective[coll]) {
      std::sort(s.points.begin(), s.points.end());
      c.series.push_back(s);
    }
    if (!c.series.empty()) out.push_back(svg::line_chart(c));
  }
  return out;
}

// bucket-sweep: exposed communication time against the bucket cap, with the
// recommended cap marked.
std::string bucket_sweep_chart(const json& res) {
  const json& rows = first_of(res, {"caps", "sweep", "points"});
  if (!rows.is_array() || rows.empty()) return "";
  svg::Series exposed{"exposed comm time", {}, false}, step{"step time", {}, true};
  double ymax = 0;
  for (const auto& r : rows) {
    // A bucket_cap_mb_list candidate has no place on the cap axis (its
    // bucket_cap_mb is the list's largest): it is in the table only.
    if (r.is_object() && r.contains("bucket_cap_mb_list")) continue;
    auto cap = number(first_of(r, {"bucket_cap_mb", "cap_mb"}));
    auto e = number(first_of(r, {"exposed_comm_time_us", "exposed_time_us"}));
    if (!cap || !e) continue;
    exposed.points.push_back({*cap, *e});
    ymax = std::max(ymax, *e);
    if (auto s = number(at(r, "step_time_us"))) {
      step.points.push_back({*cap, *s});
      ymax = std::max(ymax, *s);
    }
  }
  if (exposed.points.empty()) return "";
  // Microseconds read badly past five digits.
  const bool ms = ymax >= 1e4;
  for (auto* s : {&exposed, &step}) {
    std::sort(s->points.begin(), s->points.end());
    if (ms)
      for (auto& p : s->points) p.second /= 1000;
  }
  svg::LineChart c;
  c.title = "Bucket sweep: exposed comm time vs bucket cap";
  c.x_label = "bucket_cap_mb (MiB)";
  c.y_label = ms ? "time per step (ms)" : "time per step (µs)";
  double lo = exposed.points.front().first, hi = exposed.points.back().first;
  c.log_x = lo > 0 && hi / lo > 20;
  c.series.push_back(exposed);
  if (!step.points.empty()) c.series.push_back(step);
  auto rec = number(first_of(res, {"recommended_cap_mb", "recommended_bucket_cap_mb"}));
  // A recommended list has no place on the cap axis either.
  if (!rec && !at(at(res, "recommendation"), "bucket_cap_mb_list").is_array())
    rec = number(at(at(res, "recommendation"), "bucket_cap_mb"));
  if (rec) c.markers.push_back({*rec, fmt::format("recommended: {} MiB", format_figure(*rec, 3))});
  return svg::line_chart(c);
}

// The most ranks a link-health heat map is drawn for: past this the grid is
// unreadable, and a rank number from a hand-edited report must not size it.
constexpr std::int64_t kMaxHeatMapRanks = 4096;

// v as a rank below `limit`, or nullopt (not an integer, negative, too large).
std::optional<int> rank_below(const json& v, std::int64_t limit) {
  if (!v.is_number_integer()) return std::nullopt;
  if (v.is_number_unsigned() && v.get<std::uint64_t>() >= static_cast<std::uint64_t>(limit)) return std::nullopt;
  const auto r = v.get<std::int64_t>();
  if (r < 0 || r >= limit) return std::nullopt;
  return static_cast<int>(r);
}

// link-health: pairwise bandwidth as a heat map, slow pairs outlined.
std::string link_health_chart(const json& res) {
  // Ranks are 0 .. results.ranks - 1 (an integer, or an array of ranks);
  // pairs naming any other rank are not drawn.
  std::int64_t limit = kMaxHeatMapRanks;
  if (at(res, "ranks").is_number_integer()) {
    if (auto n = rank_below(at(res, "ranks"), kMaxHeatMapRanks + 1)) limit = *n;
  } else if (at(res, "ranks").is_array() && !at(res, "ranks").empty()) {
    limit = std::min<std::int64_t>(limit, static_cast<std::int64_t>(at(res, "ranks").size()));
  }
  svg::HeatMap h;
  h.title = "Link health: bandwidth between ranks";
  const json& matrix = first_of(res, {"busbw_gbps", "bandwidth_gbps", "matrix"});
  const json& pairs = at(res, "pairs");
  // A pair is one link, measured once and shown in both of its cells
  // (src->dst and dst->src): outline both.
  std::set<std::pair<int, int>> slow;
  auto mark = [&](int a, int b) {
    slow.insert({a, b});
    slow.insert({b, a});
  };
  const json& slow_pairs = at(res, "slow_pairs");
  if (slow_pairs.is_array())
    for (const auto& p : slow_pairs) {
      const json& a = p.is_array() && p.size() >= 2 ? p[0] : at(p, "src");
      const json& b = p.is_array() && p.size() >= 2 ? p[1] : at(p, "dst");
      auto ra = rank_below(a, limit), rb = rank_below(b, limit);
      if (ra && rb) mark(*ra, *rb);
    }
  if (pairs.is_array())
    for (const auto& p : pairs) {
      auto s = rank_below(at(p, "src"), limit), d = rank_below(at(p, "dst"), limit);
      if (at(p, "slow").is_boolean() && at(p, "slow").get<bool>() && s && d) mark(*s, *d);
    }
  std::string unit = "GB/s";
  if (matrix.is_array() && !matrix.empty() && matrix[0].is_array()) {
    for (const auto& row : matrix) {
      if (static_cast<std::int64_t>(h.cells.size()) >= kMaxHeatMapRanks) break;
      std::vector<std::optional<double>> cells;
      for (const auto& v : row) {
        if (static_cast<std::int64_t>(cells.size()) >= kMaxHeatMapRanks) break;
        cells.push_back(number(v));
      }
      h.cells.push_back(cells);
    }
  } else if (pairs.is_array() && !pairs.empty()) {
    int n = 0;
    for (const auto& p : pairs) {
      auto s = rank_below(at(p, "src"), limit), d = rank_below(at(p, "dst"), limit);
      if (s && d) n = std::max({n, *s + 1, *d + 1});
    }
    if (n == 0) return "";
    h.cells.assign(static_cast<std::size_t>(n), std::vector<std::optional<double>>(static_cast<std::size_t>(n)));
    for (const auto& p : pairs) {
      auto src = rank_below(at(p, "src"), n), dst = rank_below(at(p, "dst"), n);
      if (!src || !dst) continue;  // a rank outside 0 .. ranks-1: not a link of this run
      const int s = *src, d = *dst;
      auto v = number(first_of(p, {"busbw_gbps", "bandwidth_gbps"}));
      if (!v) {
        v = number(at(p, "time_us"));
        unit = "µs";
      }
      h.cells[static_cast<std::size_t>(s)][static_cast<std::size_t>(d)] = v;
      auto& back = h.cells[static_cast<std::size_t>(d)][static_cast<std::size_t>(s)];
      if (!back && s != d) back = v;  // one measurement per link
    }
  } else {
    return "";
  }
  h.value_label = fmt::format("bandwidth ({})", unit);
  h.highlighted.assign(slow.begin(), slow.end());
  return svg::heat_map(h);
}

// memory: per-rank bytes, stacked by category.
std::string memory_chart(const json& res) {
  const json& ranks = at(res, "ranks");
  if (!ranks.is_array() || ranks.empty() || !ranks[0].is_object()) return "";
  svg::StackedBars b;
  b.title = "Memory per rank";
  b.x_label = "rank";
  b.y_label = "memory (MiB)";
  b.value_scale = 1024.0 * 1024.0;
  std::map<std::string, std::size_t> part_index;
  for (const auto& r : ranks) {
    const json& cats = first_of(r, {"categories", "by_category"});
    if (!cats.is_object()) continue;
    for (auto it = cats.begin(); it != cats.end(); ++it)
      if (it->is_number() && part_index.emplace(it.key(), b.parts.size()).second) b.parts.push_back(it.key());
  }
  const bool totals_only = b.parts.empty();
  if (totals_only) b.parts.push_back("total");
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const json& r = ranks[i];
    std::vector<double> values(b.parts.size(), 0);
    if (totals_only) {
      auto v = number(first_of(r, {"total_bytes", "peak_bytes", "bytes"}));
      if (!v) continue;
      values[0] = *v;
    } else {
      const json& cats = first_of(r, {"categories", "by_category"});
      if (!cats.is_object()) continue;
      for (auto it = cats.begin(); it != cats.end(); ++it)
        if (it->is_number()) values[part_index[it.key()]] = it->get<double>();
    }
    b.bars.push_back(at(r, "rank").is_number_integer() ? std::to_string(at(r, "rank").get<int>()) : std::to_string(i));
    b.values.push_back(values);
  }
  if (b.bars.empty()) return "";
  return svg::stacked_bars(b);
}

// init-check: the phases of initialisation per rank on one time axis.
std::string init_timeline_chart(const json& res) {
  const json& ranks = at(res, "ranks");
  if (!ranks.is_array() || ranks.empty()) return "";
  svg::Timeline t;
  t.title = "Initialisation timeline per rank";
  t.x_label = "time since start (s)";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const json& phases = first_of(ranks[i], {"phases", "timeline"});
    if (!phases.is_array() || phases.empty()) continue;
    std::size_t lane = t.lanes.size();
    t.lanes.push_back(at(ranks[i], "rank").is_number_integer()
                          ? fmt::format("rank {}", at(ranks[i], "rank").get<int>())
                          : fmt::format("rank {}", i));
    double cursor = 0;
    for (const auto& p : phases) {
      std::string name = at(p, "name").is_string() ? at(p, "name").get<std::string>() : "phase";
      auto s = number(first_of(p, {"start_s", "begin_s"}));
      auto e = number(first_of(p, {"end_s", "finish_s"}));
      auto d = number(at(p, "duration_s"));
      double start = s ? *s : cursor;
      double end = e ? *e : (d ? start + *d : start);
      t.spans.push_back({lane, name, start, end});
      cursor = end;
    }
  }
  if (t.spans.empty()) return "";
  return svg::timeline(t);
}

// buckets: bucket sizes in reduction order.
std::string bucket_layout_chart(const json& res) {
  const json& buckets = at(res, "buckets");
  if (!buckets.is_array() || buckets.empty() || !buckets[0].is_object()) return "";
  svg::StackedBars b;
  b.title = "DDP buckets in reduction order";
  b.x_label = "bucket (0 is reduced first)";
  b.y_label = "bucket size (MiB)";
  b.value_scale = 1024.0 * 1024.0;
  b.parts = {"gradients"};
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    auto v = number(at(buckets[i], "bytes"));
    if (!v) continue;
    b.bars.push_back(std::to_string(i));
    b.values.push_back({*v});
  }
  if (b.bars.empty()) return "";
  return svg::stacked_bars(b);
}

}  // namespace

std::string render_html(const json& report) {
  const std::string command = view::str(report, "command", "?");
  const std::string verdict = view::str(report, "verdict", "");
  const json& res = at(report, "results");
  std::string out;
  out += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">";
  // Nothing may load at view time: no script, no remote resource at all.
  out += "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
         "img-src data:\">";
  out += fmt::format("<title>ddpdiag {}: {}</title><style>{}</style></head><body><main>\n", html_escape(command),
                     html_escape(verdict.empty() ? "no verdict" : verdict), kCss);

  // Summary header.
  std::string head = fmt::format("<h1>ddpdiag {} <span class=\"verdict v-{}\">{}</span></h1>", html_escape(command),
                                 verdict == "PASS" || verdict == "FAIL" || verdict == "ERROR" ? verdict : "none",
                                 html_escape(verdict.empty() ? "no verdict" : verdict));
  head += "<dl class=\"ctx\">";
  for (const auto& [k, v] : view::context(report))
    head += fmt::format("<dt>{}</dt><dd>{}</dd>", html_escape(k),
                        k == "command line" ? "<code>" + html_escape(v) + "</code>" : html_escape(v));
  head += "</dl>";
  out += "<section class=\"card\">" + head + "</section>\n";

  auto errs = view::error_fields(report);
  if (!errs.empty()) {
    std::string body = "<dl class=\"ctx\">";
    for (const auto& [k, v] : errs) body += fmt::format("<dt>{}</dt><dd>{}</dd>", html_escape(k), html_escape(v));
    out += card("Error", body + "</dl>", "error");
  }

  auto checks = view::checks_table(report);
  if (checks.rows.empty()) {
    out += card("Checks", "<p class=\"note\">This command records no checks.</p>");
  } else {
    std::string body = "<div class=\"scroll\"><table><thead><tr><th>check</th><th>status</th><th>detail</th></tr></thead><tbody>";
    for (const auto& row : checks.rows)
      body += fmt::format("<tr><td>{}</td><td class=\"s-{}\">{}</td><td>{}</td></tr>", html_escape(row[0]),
                          html_escape(row[1]), html_escape(row[1]), html_escape(row[2]));
    out += card("Checks", body + "</tbody></table></div>");
  }
  if (auto warnings = view::warnings_table(report); !warnings.rows.empty())
    out += card("Warnings", table_html(warnings));

  // Charts.
  std::vector<std::string> charts = bandwidth_charts(res);
  for (auto* f : {&bucket_sweep_chart, &link_health_chart, &memory_chart, &init_timeline_chart, &bucket_layout_chart})
    if (std::string svg = f(res); !svg.empty()) charts.push_back(svg);
  // memory and init-check both read results.ranks: per-rank categories make
  // bars, per-rank phases a timeline, so each draws only for its own layout.
  if (!charts.empty()) {
    std::string body;
    for (const auto& c : charts) body += "<figure style=\"margin:0 0 12px\">" + c + "</figure>";
    out += card("Charts", body);
  }

  for (const auto& t : view::result_tables(report)) out += card("Results: " + t.title, table_html(t));

  auto ranks = view::ranks_table(report);
  if (!ranks.rows.empty())
    out += card("Ranks", fmt::format("<details><summary>{} rank(s)</summary>{}</details>", ranks.rows.size(),
                                     table_html(ranks)));
  auto env = view::environment_table(report);
  if (!env.rows.empty())
    out += card("Environment", fmt::format("<details><summary>{} variable(s) recorded</summary>{}</details>",
                                           env.rows.size(), table_html(env)));
  out += fmt::format("<footer>{} — schema {}</footer>\n", html_escape(view::str(at(report, "tool"), "name", "ddpdiag")),
                     html_escape(view::str(report, "schema", "?")));
  out += "</main></body></html>\n";
  return out;
}

}  // namespace ddpdiag::reports
