#include "reports/report_view.h"

#include <algorithm>
#include <ctime>
#include <optional>
#include <cmath>
#include <map>
#include <set>

#include <fmt/core.h>

#include "reports/compare.h"
#include "reports/format.h"

namespace ddpdiag::reports::view {

using nlohmann::json;

namespace {

const json& field(const json& j, const char* key) {
  static const json null;
  if (!j.is_object()) return null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}

bool is_block(const json& v) {
  return v.is_object() && (v.contains("busbw_gbps") || v.contains("time_us"));
}

bool any_row_has(const json& rows, const char* key, bool object = false) {
  for (const auto& r : rows) {
    const json& v = field(r, key);
    if (object ? v.is_object() : !v.is_null()) return true;
  }
  return false;
}

// nccl-tests style: one line per size, out-of-place and in-place side by side.
Table sizes_table(const json& sizes, const std::string& collective) {
  Table t;
  t.title = collective.empty() ? "Sizes" : "Sizes (" + collective + ")";
  t.header = {"size", "count", "type", "redop"};
  t.numeric = {true, true, false, false};
  for (const char* place : {"out-of-place", "in-place"})
    for (const char* col : {"time (us)", "algbw (GB/s)", "busbw (GB/s)", "#wrong"}) {
      t.header.push_back(fmt::format("{} {}", place, col));
      t.numeric.push_back(true);
    }
  for (const char* col : {"fastest (us)", "slowest (us)", "slowest rank"}) {
    t.header.push_back(col);
    t.numeric.push_back(true);
  }
  // dp-vs-ring: several algorithms (and world sizes) per size, with the
  // traffic and extra memory each one costs against theory.
  const bool has_algo = any_row_has(sizes, "algorithm");
  const bool has_world = any_row_has(sizes, "world_size");
  const bool has_traffic = any_row_has(sizes, "rank0_bytes_moved");
  if (has_algo) {
    t.header.insert(t.header.begin() + 1, "algorithm");
    t.numeric.insert(t.numeric.begin() + 1, false);
  }
  if (has_world) {
    t.header.insert(t.header.begin() + (has_algo ? 2 : 1), "n");
    t.numeric.insert(t.numeric.begin() + (has_algo ? 2 : 1), true);
  }
  // Without any out-of-place measurement those columns would all read "-".
  const bool has_out = any_row_has(sizes, "out_of_place", true);
  const std::size_t first_place = 4 + (has_algo ? 1 : 0) + (has_world ? 1 : 0);
  if (!has_out) {
    t.header.erase(t.header.begin() + static_cast<long>(first_place), t.header.begin() + static_cast<long>(first_place) + 4);
    t.numeric.erase(t.numeric.begin() + static_cast<long>(first_place), t.numeric.begin() + static_cast<long>(first_place) + 4);
  }
  if (has_traffic)
    for (const char* col : {"rank0 moved", "rank0 moved (theory)", "max other moved", "max other moved (theory)",
                            "rank0 extra mem", "rank0 extra mem (theory)", "max other extra mem",
                            "max other extra mem (theory)", "traffic = theory", "extra mem = theory"}) {
      t.header.push_back(col);
      t.numeric.push_back(std::string(col).find('=') == std::string::npos);
    }
  for (const auto& r : sizes) {
    if (t.rows.size() >= kMaxRows) break;
    std::vector<std::string> row;
    const json& bytes = field(r, "bytes");
    row.push_back(bytes.is_number() ? human_bytes(bytes.get<double>()) : "-");
    if (has_algo) row.insert(row.begin() + 1, format_cell(field(r, "algorithm")));
    if (has_world) row.push_back(format_cell(field(r, "world_size")));
    row.push_back(format_cell(field(r, "count")));
    row.push_back(format_cell(field(r, "dtype")));
    row.push_back(format_cell(field(r, "op")));
    const json* spread = nullptr;
    for (const char* place : {"out_of_place", "in_place"}) {
      const json& b = field(r, place);
      if (b.is_object() && !spread) spread = &b;
      if (!has_out && std::string(place) == "out_of_place") continue;
      for (const char* k : {"time_us", "algbw_gbps", "busbw_gbps", "wrong"})
        row.push_back(b.is_object() ? format_cell(field(b, k)) : "-");
    }
    for (const char* k : {"min_rank_time_us", "max_rank_time_us", "slowest_rank"})
      row.push_back(spread ? format_cell(field(*spread, k)) : "-");
    if (has_traffic) {
      // Theory per rank from the per-rank rows: rank 0, and the most of the others.
      std::optional<double> t0_moved, t_other_moved, t0_extra, t_other_extra;
      const json& ranks = field(r, "ranks");
      if (ranks.is_array())
        for (std::size_t i = 0; i < ranks.size(); ++i) {
          const json& s = field(ranks[i], "theory_bytes_sent");
          const json& v = field(ranks[i], "theory_bytes_received");
          const json& x = field(ranks[i], "theory_extra_bytes");
          std::optional<double> moved;
          if (s.is_number() && v.is_number()) moved = s.get<double>() + v.get<double>();
          std::optional<double> extra;
          if (x.is_number()) extra = x.get<double>();
          auto& m = i == 0 ? t0_moved : t_other_moved;
          auto& e = i == 0 ? t0_extra : t_other_extra;
          if (moved) m = std::max(m.value_or(0), *moved);
          if (extra) e = std::max(e.value_or(0), *extra);
        }
      auto bytes_cell = [](const json& v) { return v.is_number() ? human_bytes(v.get<double>()) : std::string("-"); };
      auto opt_cell = [](const std::optional<double>& v) { return v ? human_bytes(*v) : std::string("-"); };
      row.push_back(bytes_cell(field(r, "rank0_bytes_moved")));
      row.push_back(opt_cell(t0_moved));
      row.push_back(bytes_cell(field(r, "max_other_bytes_moved")));
      row.push_back(opt_cell(t_other_moved));
      row.push_back(bytes_cell(field(r, "rank0_extra_bytes")));
      row.push_back(opt_cell(t0_extra));
      row.push_back(bytes_cell(field(r, "max_other_extra_bytes")));
      row.push_back(opt_cell(t_other_extra));
      row.push_back(format_cell(field(r, "traffic_matches_theory")));
      row.push_back(format_cell(field(r, "extra_memory_matches_theory")));
    }
    t.rows.push_back(std::move(row));
  }
  if (sizes.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), sizes.size());
  return t;
}

// init-check phases, one row per rank and phase.
Table timeline_table(const std::string& title, const json& rows) {
  Table t;
  t.title = title;
  t.header = {"rank", "phase", "start (s)", "duration (ms)", "status", "detail"};
  t.numeric = {true, false, true, true, false, false};
  for (const auto& p : rows) {
    if (t.rows.size() >= kMaxRows) break;
    const json& start = field(p, "start_s");
    std::string dur = "-";
    if (field(p, "duration_ms").is_number())
      dur = fmt::format("{:.1f}", field(p, "duration_ms").get<double>());
    else if (field(p, "duration_s").is_number())
      dur = fmt::format("{:.1f}", field(p, "duration_s").get<double>() * 1000);
    else if (start.is_number() && field(p, "end_s").is_number())
      dur = fmt::format("{:.1f}", (field(p, "end_s").get<double>() - start.get<double>()) * 1000);
    std::string detail = str(p, "detail");
    const std::string hint = str(p, "hint");
    if (!hint.empty()) detail += (detail.empty() ? "" : " ") + std::string("(hint: ") + hint + ")";
    t.rows.push_back({str(p, "rank", "-"), str(p, "name", "?"),
                      start.is_number() ? fmt::format("{:.3f}", start.get<double>()) : "-", dur,
                      str(p, "status", "-"), detail.empty() ? "-" : detail});
  }
  if (rows.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), rows.size());
  return t;
}

// Seconds since the epoch as UTC ISO 8601 with milliseconds.
std::string iso_time(double unix_s) {
  if (!std::isfinite(unix_s) || unix_s < 0 || unix_s > 4e10) return format_figure(unix_s, 13);
  auto whole = static_cast<std::time_t>(unix_s);
  int ms = static_cast<int>(std::lround((unix_s - static_cast<double>(whole)) * 1000));
  if (ms >= 1000) {
    ++whole;
    ms -= 1000;
  }
  std::tm tm{};
  gmtime_r(&whole, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

bool all_scalars(const json& v) {
  for (const auto& x : v)
    if (x.is_structured()) return false;
  return true;
}

std::string nested_cell(const std::string& key, const json& v);

// An array of scalars as a list; of small arrays as (a, b) tuples.
std::string list_cell(const json& v) {
  std::string s;
  for (const auto& x : v) {
    std::string c;
    if (x.is_array() && all_scalars(x)) {
      for (const auto& y : x) c += (c.empty() ? "" : ", ") + format_cell(y);
      c = "(" + c + ")";
    } else {
      c = nested_cell("", x);
    }
    s += (s.empty() ? "" : ", ") + c;
  }
  return s;
}

// An error object: its message, then the hint.
bool is_error_object(const json& v) { return v.is_object() && field(v, "message").is_string(); }
std::string error_cell(const json& e) {
  std::string out;
  const json& kind = field(e, "kind");
  if (kind.is_string() && !kind.get<std::string>().empty()) out = kind.get<std::string>() + ": ";
  out += field(e, "message").get<std::string>();
  const json& hint = field(e, "hint");
  if (hint.is_string() && !hint.get<std::string>().empty()) out += " (hint: " + hint.get<std::string>() + ")";
  return out;
}

// A value by its key: times since the epoch readable, byte counts human, a
// nested object as "key: value" pairs, never a cut JSON string.
std::string nested_cell(const std::string& key, const json& v) {
  if (v.is_number() && ends_with(key, "_unix_s")) return iso_time(v.get<double>());
  if (v.is_number() && ends_with(key, "_bytes")) return human_bytes(v.get<double>());
  if (v.is_object()) {
    if (v.empty()) return "-";
    if (is_error_object(v)) return error_cell(v);
    std::string s;
    for (auto it = v.begin(); it != v.end(); ++it)
      if (!(it->is_string() && it->get<std::string>().empty()))
        s += (s.empty() ? "" : "; ") + it.key() + ": " +
           (it->is_number() && (ends_with(key, "_bytes") || key == "categories") ? human_bytes(it->get<double>())
                                                                                : nested_cell(it.key(), *it));
    return s;
  }
  if (v.is_array()) {
    if (v.empty()) return "-";
    if (v.size() > 8) return fmt::format("{} values", v.size());
    return list_cell(v);
  }
  return format_cell(v);
}

// Any array of objects: columns are the keys in first-seen order. A nested
// object of scalars becomes a column per field ("parent.field"), an error
// object its message and hint, and a nested array of objects (the phases of
// a rank) a table of its own, returned in children.
Table objects_table(const std::string& name, const json& arr, std::vector<Table>* children = nullptr,
                    const std::string& lead = "rank") {
  Table t;
  t.title = name;
  std::vector<std::string> keys;
  std::set<std::string> seen, child_keys;
  // For each nested object column: its fields in first-seen order.
  std::map<std::string, std::vector<std::string>> sub;
  for (const auto& r : arr) {
    if (!r.is_object()) continue;
    for (auto it = r.begin(); it != r.end(); ++it) {
      const json& v = it.value();
      if (children && v.is_array() && !v.empty() && v[0].is_object()) {
        child_keys.insert(it.key());
        continue;
      }
      if (!seen.count(it.key())) {
        seen.insert(it.key());
        keys.push_back(it.key());
      }
      if (v.is_object() && !is_error_object(v) && all_scalars(v)) {
        auto& fields = sub[it.key()];
        for (auto f = v.begin(); f != v.end(); ++f)
          if (std::find(fields.begin(), fields.end(), f.key()) == fields.end()) fields.push_back(f.key());
      }
    }
  }
  // A column that is sometimes a nested object with many fields stays one cell.
  for (auto it = sub.begin(); it != sub.end();)
    it = it->second.size() > 12 ? sub.erase(it) : std::next(it);
  // The rank (or what else names the row) first.
  if (auto it = std::find(keys.begin(), keys.end(), lead); it != keys.end()) std::rotate(keys.begin(), it, it + 1);
  // Memory per rank: every byte count human-readable.
  const bool memory_layout = sub.count("categories") > 0;
  for (const auto& k : child_keys) seen.erase(k);
  keys.erase(std::remove_if(keys.begin(), keys.end(), [&](const std::string& k) { return child_keys.count(k) > 0; }),
             keys.end());
  struct Col {
    std::string key, field;  // field empty: the value itself
  };
  std::vector<Col> cols;
  for (const auto& k : keys) {
    if (sub.count(k)) {
      for (const auto& f : sub[k]) {
        cols.push_back({k, f});
        // Categories are the columns themselves; other objects prefix theirs.
        t.header.push_back(k == "categories" ? f : k == "category_peak_bytes" ? "peak " + f : k + "." + f);
      }
    } else {
      cols.push_back({k, ""});
      t.header.push_back(k);
    }
  }
  t.numeric.assign(cols.size(), true);
  for (const auto& r : arr) {
    if (t.rows.size() >= kMaxRows) break;
    std::vector<std::string> row;
    for (std::size_t c = 0; c < cols.size(); ++c) {
      const json& parent = field(r, cols[c].key.c_str());
      if (cols[c].field.empty()) {
        if (parent.is_string() || parent.is_boolean() || parent.is_structured()) t.numeric[c] = false;
        if (parent.is_array() && parent.size() > 8)
          row.push_back(fmt::format("{} values", parent.size()));
        else if (parent.is_structured() || (parent.is_number() && ends_with(cols[c].key, "_unix_s")) ||
                 (memory_layout && parent.is_number() && ends_with(cols[c].key, "_bytes")))
          row.push_back(nested_cell(cols[c].key, parent));
        else
          row.push_back(format_cell(parent));
      } else {
        const json& v = field(parent, cols[c].field.c_str());
        if (v.is_string() || v.is_boolean()) t.numeric[c] = false;
        const bool bytes = v.is_number() && (cols[c].key == "categories" || ends_with(cols[c].key, "_bytes") ||
                                             ends_with(cols[c].field, "_bytes"));
        row.push_back(bytes ? human_bytes(v.get<double>()) : nested_cell(cols[c].field, v));
      }
    }
    t.rows.push_back(std::move(row));
  }
  if (arr.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), arr.size());
  if (!children) return t;
  // Each nested array of objects: one table, its rows led by what names
  // their parent row: its rank (rows per rank), else its first column (a
  // chunk size, a cap), else its place. An item's own "rank" (the rank a
  // mismatch was found on) is kept as it is.
  const bool per_rank = std::any_of(arr.begin(), arr.end(), [](const json& r) { return !field(r, "rank").is_null(); });
  std::string child_lead = "rank";
  if (!per_rank) {
    // The first identity field that tells the rows apart (its values differ
    // from row to row): broadcast-test's chunk size, bucket-sweep's cap.
    child_lead = "row";
    for (const char* k : kRowIdentity) {
      std::set<std::string> values;
      bool scalar = true;
      for (const auto& r : arr) {
        const json& v = field(r, k);
        scalar = scalar && !v.is_null() && !v.is_structured();
        values.insert(v.dump());
      }
      if (!arr.empty() && scalar && (values.size() == arr.size())) {
        child_lead = k;
        break;
      }
    }
  }
  for (const auto& ck : child_keys) {
    json rows = json::array();
    for (std::size_t i = 0; i < arr.size(); ++i) {
      const json& items = field(arr[i], ck.c_str());
      if (!items.is_array()) continue;
      const json& named = child_lead == "row" ? json(i) : field(arr[i], child_lead.c_str());
      for (const auto& item : items) {
        if (!item.is_object()) continue;
        json row = json::object();
        for (auto it = item.begin(); it != item.end(); ++it)
          if (!(per_rank && it.key() == "rank")) row[it.key()] = it.value();
        row[child_lead] = named.is_null() && per_rank ? json(i) : named;
        rows.push_back(std::move(row));
      }
    }
    if (rows.empty()) continue;
    if (ck == "phases" || ck == "timeline")
      children->push_back(timeline_table(name + ": timeline", rows));
    else
      children->push_back(objects_table(name + ": " + ck, rows, nullptr, child_lead));
  }
  return t;
}

std::string summarise_array(const json& v) {
  if (v.size() <= 12) return all_scalars(v) ? format_cell(v) : list_cell(v);
  std::string s;
  for (std::size_t i = 0; i < 8; ++i) s += (i ? ", " : "") + nested_cell("", v[i]);
  return fmt::format("{} values: [{}, ...]", v.size(), s);
}

// A square array of arrays of numbers (or null on the diagonal).
bool is_matrix(const json& v) {
  if (!v.is_array() || v.empty()) return false;
  for (const auto& row : v) {
    if (!row.is_array() || row.size() != v.size()) return false;
    for (const auto& x : row)
      if (!x.is_number() && !x.is_null()) return false;
  }
  return true;
}

std::string unit_of(const std::string& key) {
  if (ends_with(key, "_gbps")) return "GB/s";
  if (ends_with(key, "_us")) return "µs";
  if (ends_with(key, "_ms")) return "ms";
  if (ends_with(key, "_s")) return "s";
  if (ends_with(key, "_bytes")) return "bytes";
  return "";
}

// Rows are the source rank, columns the destination; marked cells get "(slow)".
Table matrix_table(const std::string& key, const json& m, const std::set<std::pair<int, int>>& marked) {
  Table t;
  const std::string unit = unit_of(key);
  t.title = key + " matrix" + (unit.empty() ? "" : " (" + unit + ")");
  t.header.push_back(unit.empty() ? "src \\ dst" : "src \\ dst (" + unit + ")");
  t.numeric.push_back(false);
  for (std::size_t c = 0; c < m.size(); ++c) {
    t.header.push_back(std::to_string(c));
    t.numeric.push_back(true);
  }
  for (std::size_t r = 0; r < m.size() && t.rows.size() < kMaxRows; ++r) {
    std::vector<std::string> row{std::to_string(r)};
    for (std::size_t c = 0; c < m[r].size(); ++c) {
      if (r == c) {
        row.push_back("—");
        continue;
      }
      std::string cell = format_cell(m[r][c]);
      if (marked.count({static_cast<int>(r), static_cast<int>(c)})) cell += " (slow)";
      row.push_back(cell);
    }
    t.rows.push_back(std::move(row));
  }
  if (m.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), m.size());
  return t;
}

// The watchdog's account of a hang or failure: the diagnosis as field/value
// lines, the local flight recorder and every rank's state.
void watchdog_tables(const json& w, std::vector<Table>& out) {
  Table s;
  s.title = "Watchdog";
  s.header = {"field", "value"};
  s.numeric = {false, false};
  const json& d = field(w, "diagnosis");
  if (field(d, "summary").is_string()) s.rows.push_back({"summary", field(d, "summary").get<std::string>()});
  for (const char* k : {"cause", "detected_by"})
    if (!field(w, k).is_null()) s.rows.push_back({k, nested_cell(k, field(w, k))});
  if (d.is_object())
    for (auto it = d.begin(); it != d.end(); ++it) {
      if (it.key() == "summary" || it.key() == "findings" || it.key() == "mismatches") continue;
      if (it->is_array() && it->empty()) continue;
      s.rows.push_back({it.key(), nested_cell(it.key(), *it)});
    }
  const json& mm = field(d, "mismatches");
  if (mm.is_array())
    for (const auto& m : mm) {
      std::string groups;
      for (const auto& g : field(m, "groups"))
        groups += (groups.empty() ? "" : "; ") + str(field(g, "collective"), "text", "?") + " on ranks " +
                  list_cell(field(g, "ranks").is_array() ? field(g, "ranks") : json::array());
      s.rows.push_back({fmt::format("mismatch at seq {}", str(m, "seq", "?")), groups});
    }
  if (!field(w, "store").is_null()) s.rows.push_back({"store", nested_cell("store", field(w, "store"))});
  out.push_back(std::move(s));

  auto recorder = [](const std::string& title, const json& entries, const json& rank) {
    Table t;
    t.title = title;
    t.header = {"seq", "collective", "state", "started (s)", "duration (ms)"};
    t.numeric = {true, false, false, true, true};
    if (!rank.is_null()) {
      t.header.insert(t.header.begin(), "rank");
      t.numeric.insert(t.numeric.begin(), true);
    }
    for (const auto& e : entries) {
      if (t.rows.size() >= kMaxRows) break;
      const json& c = field(e, "collective");
      std::vector<std::string> row{str(e, "seq", "-"), c.is_object() ? str(c, "text", str(c, "op", "?")) : format_cell(c),
                                   str(e, "state", "-"), str(e, "started_s", "-"), str(e, "duration_ms", "-")};
      if (!rank.is_null()) row.insert(row.begin(), format_cell(rank));
      t.rows.push_back(std::move(row));
    }
    if (entries.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), entries.size());
    return t;
  };
  const json& fr = field(w, "flight_recorder");
  if (fr.is_array() && !fr.empty()) out.push_back(recorder("Watchdog: flight recorder", fr, json()));

  const json& ranks = field(w, "ranks");
  if (ranks.is_array() && !ranks.empty()) {
    Table t;
    t.title = "Watchdog: rank states";
    t.header = {"rank", "host", "pid", "last started", "last completed", "reason"};
    t.numeric = {true, false, true, true, true, false};
    for (std::size_t i = 0; i < ranks.size() && t.rows.size() < kMaxRows; ++i) {
      const json& k = ranks[i];
      if (!k.is_object()) {
        t.rows.push_back({std::to_string(i), "-", "-", "-", "-", "no state (rank gone or unreachable)"});
        continue;
      }
      t.rows.push_back({str(k, "rank", std::to_string(i)), str(k, "host", "-"), str(k, "pid", "-"),
                        str(k, "last_started_seq", "-"), str(k, "last_completed_seq", "-"), str(k, "reason", "-")});
    }
    out.push_back(std::move(t));
    // Without a local recorder, the ranks' own recorders are the account.
    if (!(fr.is_array() && !fr.empty())) {
      Table merged;
      for (const auto& k : ranks)
        if (field(k, "flight_recorder").is_array() && !field(k, "flight_recorder").empty()) {
          Table one = recorder("", field(k, "flight_recorder"), field(k, "rank"));
          if (merged.header.empty()) merged = one;
          else merged.rows.insert(merged.rows.end(), one.rows.begin(), one.rows.end());
        }
      if (!merged.rows.empty()) {
        merged.title = "Watchdog: flight recorder";
        out.push_back(std::move(merged));
      }
    }
  }
}

}  // namespace

std::string str(const json& j, const char* key, const std::string& dflt) {
  const json& v = field(j, key);
  if (v.is_null()) return dflt;
  return format_cell(v);
}

std::vector<std::pair<std::string, std::string>> context(const json& r) {
  std::vector<std::pair<std::string, std::string>> out;
  const json& tool = field(r, "tool");
  if (tool.is_object())
    out.push_back({"tool", fmt::format("{} {} ({})", str(tool, "name", "ddpdiag"), str(tool, "version", "?"),
                                       str(tool, "git_revision", "?"))});
  const json& argv = field(r, "argv");
  if (argv.is_array()) {
    std::string cmd;
    for (const auto& a : argv) cmd += (cmd.empty() ? "" : " ") + (a.is_string() ? a.get<std::string>() : a.dump());
    out.push_back({"command line", cmd});
  }
  if (!field(r, "started_at").is_null()) out.push_back({"started", str(r, "started_at")});
  const json& d = field(r, "duration_s");
  if (d.is_number()) out.push_back({"duration", format_figure(d.get<double>(), 3) + " s"});
  const json& w = field(r, "world");
  if (w.is_object()) {
    const std::size_t host_count = field(w, "hosts").is_array() ? field(w, "hosts").size() : 0;
    const json& listed = field(w, "ranks");
    const json& size = field(w, "size");
    // A run that failed before the rendezvous completed lists only the ranks
    // it knew of, so its hosts are theirs, not the world's.
    if (listed.is_array() && size.is_number_integer() &&
        listed.size() < static_cast<std::size_t>(std::max<std::int64_t>(0, size.get<std::int64_t>())))
      out.push_back({"world", fmt::format("{} rank(s), {} of them known (the run ended before the "
                                          "rendezvous completed), on {} host(s)",
                                          str(w, "size", "?"), listed.size(), host_count)});
    else
      out.push_back({"world", fmt::format("{} rank(s) on {} host(s)", str(w, "size", "?"), host_count)});
    const json& threads = field(w, "gloo_threads");
    out.push_back({"backend", threads.is_number_integer()
                                  ? fmt::format("{} ({} worker threads)", str(w, "backend", "?"),
                                                threads.get<int>())
                                  : str(w, "backend", "?")});
    out.push_back({"launcher", str(w, "launcher", "?")});
    const json& hosts = field(w, "hosts");
    if (hosts.is_array()) {
      std::string h;
      for (const auto& x : hosts) h += (h.empty() ? "" : ", ") + format_cell(x);
      out.push_back({"hosts", h});
    }
    const json& libs = field(w, "library_versions");
    if (libs.is_object() && !libs.empty()) {
      std::string l;
      for (auto it = libs.begin(); it != libs.end(); ++it) {
        // Versions often name their library already ("gloo 0.5.0").
        std::string v = format_cell(it.value());
        l += (l.empty() ? "" : ", ") + (v.rfind(it.key(), 0) == 0 ? v : it.key() + " " + v);
      }
      out.push_back({"libraries", l});
    }
  } else {
    // No world: a single-process command, or a run that ended before it knew
    // its world (the environment or the flags were rejected).
    out.push_back({"world", field(r, "error").is_object()
                                ? "unknown (the run ended before it knew its world)"
                                : "single process"});
  }
  return out;
}

Table ranks_table(const json& r) {
  Table t;
  t.title = "Ranks";
  t.header = {"rank", "local rank", "host", "pid", "device"};
  t.numeric = {true, true, false, true, false};
  const json& ranks = field(field(r, "world"), "ranks");
  if (ranks.is_array())
    for (const auto& k : ranks)
      t.rows.push_back({str(k, "rank", "-"), str(k, "local_rank", "-"), str(k, "host", "-"),
                        str(k, "pid", "-"), str(k, "device", "-")});
  return t;
}

Table checks_table(const json& r) {
  Table t;
  t.title = "Checks";
  t.header = {"check", "status", "detail"};
  t.numeric = {false, false, false};
  const json& checks = field(r, "checks");
  if (checks.is_array())
    for (const auto& c : checks) t.rows.push_back({str(c, "name", "?"), str(c, "status", "?"), str(c, "detail")});
  return t;
}

Table warnings_table(const json& r) {
  Table t;
  t.title = "Warnings";
  t.header = {"warning", "detail"};
  t.numeric = {false, false};
  const json& w = field(field(r, "results"), "warnings");
  if (w.is_array())
    for (const auto& x : w) t.rows.push_back({str(x, "name", "?"), str(x, "detail")});
  return t;
}

std::vector<std::pair<std::string, std::string>> error_fields(const json& r) {
  std::vector<std::pair<std::string, std::string>> out;
  const json& e = field(r, "error");
  if (!e.is_object()) return out;
  for (const char* k : {"kind", "message", "phase", "rank", "peer", "hint", "exit_code"}) {
    const json& v = field(e, k);
    if (v.is_null() || (v.is_string() && v.get<std::string>().empty())) continue;
    out.push_back({k, format_cell(v)});
  }
  return out;
}

std::vector<Table> result_tables(const json& r) {
  std::vector<Table> out;
  const json& res = field(r, "results");
  if (!res.is_object()) return out;
  Table scalars;
  scalars.title = "Summary";
  scalars.header = {"field", "value"};
  scalars.numeric = {false, true};
  // Slow links, by both directions: a pair is one link measured once. Each
  // matrix marks the pairs slow by its own figure (a pair slow by bandwidth
  // alone keeps its latency unmarked) where the pairs say which; else, in
  // reports without the per-figure flags, every slow pair in every matrix.
  std::set<std::pair<int, int>> slow, slow_bandwidth, slow_latency;
  bool per_figure = false;
  auto mark = [](std::set<std::pair<int, int>>& in, const json& a, const json& b) {
    if (!a.is_number_integer() || !b.is_number_integer()) return;
    in.insert({a.get<int>(), b.get<int>()});
    in.insert({b.get<int>(), a.get<int>()});
  };
  if (field(res, "slow_pairs").is_array())
    for (const auto& p : field(res, "slow_pairs"))
      if (p.is_array() && p.size() >= 2) mark(slow, p[0], p[1]);
  if (field(res, "pairs").is_array())
    for (const auto& p : field(res, "pairs")) {
      const json& bw = field(p, "slow_bandwidth");
      const json& lat = field(p, "slow_latency");
      if (!bw.is_boolean() || !lat.is_boolean()) continue;
      per_figure = true;
      if (bw.get<bool>()) mark(slow_bandwidth, field(p, "src"), field(p, "dst"));
      if (lat.get<bool>()) mark(slow_latency, field(p, "src"), field(p, "dst"));
    }
  for (auto it = res.begin(); it != res.end(); ++it) {
    const json& v = it.value();
    if (it.key() == "warnings" && v.is_array()) {
      continue;  // warnings_table, beside the checks
    } else if (it.key() == "watchdog" && v.is_object()) {
      watchdog_tables(v, out);
    } else if (is_matrix(v)) {
      const bool latency = ends_with(it.key(), "_us") || ends_with(it.key(), "_ms");
      out.push_back(matrix_table(it.key(), v, !per_figure ? slow : latency ? slow_latency : slow_bandwidth));
    } else if (v.is_array() && !v.empty() && v[0].is_object()) {
      bool blocks = v[0].contains("out_of_place") || v[0].contains("in_place");
      if (it.key() == "sizes" && blocks) {
        out.push_back(sizes_table(v, str(res, "collective")));
      } else {
        std::vector<Table> children;
        out.push_back(objects_table(it.key(), v, &children));
        for (auto& c : children) out.push_back(std::move(c));
      }
    } else if (v.is_array()) {
      scalars.rows.push_back({it.key(), summarise_array(v)});
    } else if (v.is_object()) {
      if (is_block(v)) scalars.rows.push_back({it.key(), format_cell(v)});
      else if (v.size() <= 12) scalars.rows.push_back({it.key(), nested_cell(it.key(), v)});
      else scalars.rows.push_back({it.key(), fmt::format("{} fields", v.size())});
    } else {
      scalars.rows.push_back({it.key(), ends_with(it.key(), "_unix_s") ? nested_cell(it.key(), v) : format_cell(v)});
    }
  }
  if (!scalars.rows.empty()) out.insert(out.begin(), std::move(scalars));
  return out;
}

Table environment_table(const json& r) {
  Table t;
  t.title = "Environment";
  t.header = {"variable", "value"};
  t.numeric = {false, false};
  const json& env = field(r, "environment");
  if (env.is_object())
    for (auto it = env.begin(); it != env.end(); ++it) t.rows.push_back({it.key(), format_cell(it.value())});
  return t;
}

}  // namespace ddpdiag::reports::view
