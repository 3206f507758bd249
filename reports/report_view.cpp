#include "reports/report_view.h"

#include <set>

#include <fmt/core.h>

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
  for (const auto& r : sizes) {
    if (t.rows.size() >= kMaxRows) break;
    std::vector<std::string> row;
    const json& bytes = field(r, "bytes");
    row.push_back(bytes.is_number() ? human_bytes(bytes.get<double>()) : "-");
    row.push_back(format_cell(field(r, "count")));
    row.push_back(format_cell(field(r, "dtype")));
    row.push_back(format_cell(field(r, "op")));
    const json* spread = nullptr;
    for (const char* place : {"out_of_place", "in_place"}) {
      const json& b = field(r, place);
      if (b.is_object() && !spread) spread = &b;
      for (const char* k : {"time_us", "algbw_gbps", "busbw_gbps", "wrong"})
        row.push_back(b.is_object() ? format_cell(field(b, k)) : "-");
    }
    for (const char* k : {"min_rank_time_us", "max_rank_time_us", "slowest_rank"})
      row.push_back(spread ? format_cell(field(*spread, k)) : "-");
    t.rows.push_back(std::move(row));
  }
  if (sizes.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), sizes.size());
  return t;
}

// Any array of objects: columns are the scalar keys in first-seen order.
Table objects_table(const std::string& name, const json& arr) {
  Table t;
  t.title = name;
  std::vector<std::string> keys;
  std::set<std::string> seen;
  for (const auto& r : arr) {
    if (!r.is_object()) continue;
    for (auto it = r.begin(); it != r.end(); ++it)
      if (!seen.count(it.key())) {
        seen.insert(it.key());
        keys.push_back(it.key());
      }
  }
  t.header = keys;
  t.numeric.assign(keys.size(), true);
  for (const auto& r : arr) {
    if (t.rows.size() >= kMaxRows) break;
    std::vector<std::string> row;
    for (std::size_t c = 0; c < keys.size(); ++c) {
      const json& v = field(r, keys[c].c_str());
      if (v.is_string() || v.is_boolean()) t.numeric[c] = false;
      if (v.is_array() && v.size() > 8)
        row.push_back(fmt::format("{} values", v.size()));
      else
        row.push_back(format_cell(v));
    }
    t.rows.push_back(std::move(row));
  }
  if (arr.size() > t.rows.size()) t.note = fmt::format("showing {} of {} rows", t.rows.size(), arr.size());
  return t;
}

std::string summarise_array(const json& v) {
  if (v.size() <= 12) return format_cell(v);
  std::string s;
  for (std::size_t i = 0; i < 8; ++i) s += (i ? ", " : "") + format_cell(v[i]);
  return fmt::format("{} values: [{}, ...]", v.size(), s);
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
    out.push_back({"world", fmt::format("{} rank(s) on {} host(s)", str(w, "size", "?"),
                                        field(w, "hosts").is_array() ? field(w, "hosts").size() : 0)});
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
    // No world: a single-process command, or a run that ended before rendezvous.
    out.push_back({"world", field(r, "error").is_object() ? "unknown (the run ended before rendezvous)"
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
  for (auto it = res.begin(); it != res.end(); ++it) {
    const json& v = it.value();
    if (v.is_array() && !v.empty() && v[0].is_object()) {
      bool blocks = v[0].contains("out_of_place") || v[0].contains("in_place");
      if (it.key() == "sizes" && blocks)
        out.push_back(sizes_table(v, str(res, "collective")));
      else
        out.push_back(objects_table(it.key(), v));
    } else if (v.is_array()) {
      scalars.rows.push_back({it.key(), summarise_array(v)});
    } else if (v.is_object()) {
      if (is_block(v) || v.size() <= 12) scalars.rows.push_back({it.key(), format_cell(v)});
      else scalars.rows.push_back({it.key(), fmt::format("{} fields", v.size())});
    } else {
      scalars.rows.push_back({it.key(), format_cell(v)});
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
