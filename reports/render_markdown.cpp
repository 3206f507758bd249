// Markdown view of a report, for $GITHUB_STEP_SUMMARY and pull requests.
#include <fmt/core.h>

#include "reports/format.h"
#include "reports/render.h"
#include "reports/report.h"
#include "reports/report_view.h"

namespace ddpdiag::reports {

using nlohmann::json;

namespace {

std::string verdict_badge(const std::string& v) {
  if (v == "PASS") return "✅ PASS";
  if (v == "FAIL") return "❌ FAIL";
  if (v == "ERROR") return "💥 ERROR";
  return v.empty() ? "(no verdict)" : markdown_text(v);
}

std::string table_md(const view::Table& t) {
  if (t.header.empty()) return "";
  std::string out = "|";
  for (const auto& h : t.header) out += " " + markdown_cell(h) + " |";
  out += "\n|";
  for (std::size_t c = 0; c < t.header.size(); ++c)
    out += c < t.numeric.size() && t.numeric[c] ? "---:|" : "---|";
  out += "\n";
  for (const auto& row : t.rows) {
    out += "|";
    for (const auto& cell : row) out += " " + markdown_cell(cell) + " |";
    out += "\n";
  }
  if (!t.note.empty()) out += "\n_" + markdown_text(t.note) + "_\n";
  return out;
}

}  // namespace

std::string render_markdown(const json& report) {
  std::string out;
  const std::string command = view::str(report, "command", "?");
  out += fmt::format("## ddpdiag {}: {}\n\n", markdown_text(command), verdict_badge(view::str(report, "verdict")));

  out += "| | |\n|---|---|\n";
  for (const auto& [k, v] : view::context(report))
    out += fmt::format("| {} | {} |\n", markdown_cell(k), k == "command line" ? markdown_code_cell(v) : markdown_cell(v));
  out += "\n";

  auto errs = view::error_fields(report);
  if (!errs.empty()) {
    out += "### Error\n\n";
    for (const auto& [k, v] : errs) out += fmt::format("- **{}**: {}\n", markdown_text(k), markdown_text(v));
    out += "\n";
  }

  auto checks = view::checks_table(report);
  out += "### Checks\n\n";
  if (checks.rows.empty()) {
    out += "_no checks_\n\n";
  } else {
    for (auto& row : checks.rows)
      row[1] = row[1] == "pass" ? "✅ pass" : row[1] == "fail" ? "❌ fail" : row[1] == "skip" ? "⏭ skip" : row[1];
    out += table_md(checks) + "\n";
  }
  auto warnings = view::warnings_table(report);
  if (!warnings.rows.empty()) {
    for (auto& row : warnings.rows) row[0] = "⚠️ " + row[0];
    out += "### Warnings\n\n" + table_md(warnings) + "\n";
  }

  auto tables = view::result_tables(report);
  if (!tables.empty()) {
    out += "### Results\n\n";
    for (const auto& t : tables) out += fmt::format("#### {}\n\n{}\n", markdown_text(t.title), table_md(t));
  }

  auto ranks = view::ranks_table(report);
  if (!ranks.rows.empty())
    out += fmt::format("<details><summary>Ranks ({})</summary>\n\n{}\n</details>\n\n", ranks.rows.size(),
                       table_md(ranks));
  auto env = view::environment_table(report);
  if (!env.rows.empty())
    out += fmt::format("<details><summary>Environment ({} variables)</summary>\n\n{}\n</details>\n\n", env.rows.size(),
                       table_md(env));
  return out;
}


void write_report_outputs(const nlohmann::json& report, const std::string& json_path,
                          const std::string& markdown_path) {
  if (!json_path.empty()) write_json_atomic(json_path, report);
  if (!markdown_path.empty()) write_file_atomic(markdown_path, render_markdown(report));
}

}  // namespace ddpdiag::reports
