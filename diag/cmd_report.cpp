// ddpdiag report: work with the JSON reports other subcommands write.
//   report validate FILE...   check files against the report schema
//   report compare BASE [BASE...] NEW   the baseline gate for CI
//   report render FILE        Markdown and a self-contained HTML page
//   report schema             print the schema compiled into this binary
// The logic lives in reports/; this file only parses flags and maps outcomes
// to exit codes (0 ok, 1 invalid or regressed, 2 unreadable input or usage).
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/errors.h"
#include "diag/commands.h"
#include "reports/compare.h"
#include "reports/render.h"
#include "reports/report.h"
#include "reports/report_schema.h"

namespace ddpdiag::cli {

namespace {

struct ReportOptions {
  std::vector<std::string> validate_files;
  std::vector<std::string> compare_files;  // BASE... NEW
  std::string max_regression = "10%";
  bool fail_on_missing = false;
  std::string compare_markdown;
  std::string render_file;
  std::string html_out;
  std::string markdown_out;
};

// Unreadable or unparseable input is the user's to fix: exit 2.
nlohmann::json load(const std::string& path) {
  try {
    return reports::read_json(path);
  } catch (const std::exception& e) {
    throw UsageError(e.what(), {"report", -1, -1, "pass a report written with --json FILE"});
  }
}

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return;
  }
  try {
    reports::write_file_atomic(path, text);
  } catch (const std::exception& e) {
    throw UsageError(e.what(), {"report", -1, -1, "check that the directory exists and is writable"});
  }
}

int run_validate(const ReportOptions& o) {
  int rc = 0;
  for (const auto& path : o.validate_files) {
    nlohmann::json doc;
    try {
      doc = reports::read_json(path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s: unreadable: %s\n", path.c_str(), e.what());
      rc = static_cast<int>(ExitCode::kUsage);
      continue;
    }
    auto errors = reports::validate_report(doc);
    if (errors.empty()) {
      std::printf("%s: valid (%s)\n", path.c_str(), reports::kSchema);
      continue;
    }
    std::printf("%s: %zu error(s) against %s\n", path.c_str(), errors.size(), reports::kSchema);
    for (const auto& e : errors) std::printf("  %s\n", e.to_string().c_str());
    if (rc == 0) rc = static_cast<int>(ExitCode::kCheckFailed);
  }
  std::fflush(stdout);
  return rc;
}

int run_compare(const ReportOptions& o) {
  reports::CompareOptions co;
  try {
    co.max_regression = reports::parse_percentage(o.max_regression);
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("--max-regression: {}", e.what()), {"report", -1, -1, "e.g. --max-regression 10%"});
  }
  co.fail_on_missing = o.fail_on_missing;
  if (o.compare_files.size() < 2)
    throw UsageError("report compare needs a baseline report and a new one",
                     {"report", -1, -1, "ddpdiag report compare BASE.json [MORE_BASE.json...] NEW.json"});
  const std::vector<std::string> base_paths(o.compare_files.begin(), o.compare_files.end() - 1);
  const std::string& new_path = o.compare_files.back();
  if (!o.compare_markdown.empty() && o.compare_markdown != "-")
    for (const auto& in : o.compare_files)
      if (reports::same_file(in, o.compare_markdown))
        throw UsageError(fmt::format("--markdown {} is one of the reports being compared: writing "
                                     "there would destroy it",
                                     o.compare_markdown),
                         {"report", -1, -1, "write the comparison to a file of its own, e.g. compare.md"});
  std::vector<nlohmann::json> bases;
  for (const auto& p : base_paths) bases.push_back(load(p));
  const auto now = load(new_path);
  std::vector<std::pair<const nlohmann::json*, const std::string*>> inputs;
  for (std::size_t i = 0; i < bases.size(); ++i) inputs.push_back({&bases[i], &base_paths[i]});
  inputs.push_back({&now, &new_path});
  for (const auto& [doc, path] : inputs) {
    if (!doc->is_object() || doc->value("schema", std::string()) != reports::kSchema)
      throw UsageError(fmt::format("{} is not a {} report", *path, reports::kSchema),
                       {"report", -1, -1, "compare reports written by ddpdiag --json"});
    // A gate must never pass on a report it cannot trust (a verdict it does
    // not know, a deleted world): the same schema check as report validate.
    const auto errors = reports::validate_report(*doc);
    if (errors.empty()) continue;
    constexpr std::size_t kShown = 3;
    std::string listed;
    for (std::size_t i = 0; i < errors.size() && i < kShown; ++i) listed += "\n  " + errors[i].to_string();
    if (errors.size() > kShown) listed += fmt::format("\n  ... and {} more", errors.size() - kShown);
    throw UsageError(fmt::format("{} is not a valid {} report ({} schema error(s)); it cannot be compared:{}",
                                 *path, reports::kSchema, errors.size(), listed),
                     {"report", -1, -1,
                      fmt::format("run 'ddpdiag report validate {}' for every error, and compare reports "
                                  "written by ddpdiag --json, unedited",
                                  *path)});
  }
  if (const auto why = reports::baselines_disagree(bases, base_paths); !why.empty())
    throw UsageError(why + ": several baseline runs are merged figure by figure, so they must be runs "
                           "of one command with the same settings",
                     {"report", -1, -1, "give as baselines only runs of the same command line on the same kind of machine"});
  const auto& base = bases.front();
  const std::string& base_path = base_paths.front();
  const std::string base_cmd = base.value("command", std::string("?")),
                    new_cmd = now.value("command", std::string("?"));
  if (base_cmd != new_cmd)
    throw UsageError(fmt::format("{} is a report of '{}' and {} one of '{}': nothing in them "
                                 "can be compared",
                                 base_path, base_cmd, new_path, new_cmd),
                     {"report", -1, -1, "compare two reports of the same command"});
  auto c = reports::compare_reports(bases, now, co);
  std::fputs(reports::render_comparison_text(c).c_str(), stdout);
  std::fflush(stdout);
  if (!o.compare_markdown.empty()) {
    const std::string md = reports::render_comparison_markdown(c);
    const char* summary = std::getenv("GITHUB_STEP_SUMMARY");
    if (summary && *summary && o.compare_markdown != "-" && reports::same_file(o.compare_markdown, summary)) {
      // GitHub's step summary is appended to, as other steps' output
      // already there should stay.
      std::FILE* f = std::fopen(o.compare_markdown.c_str(), "a");
      if (!f || std::fwrite(md.data(), 1, md.size(), f) != md.size() || std::fclose(f) != 0)
        throw UsageError(fmt::format("cannot append to {}: {}", o.compare_markdown, std::strerror(errno)),
                         {"report", -1, -1, "check that the file is writable"});
    } else {
      write_output(o.compare_markdown, md);
    }
  }
  return static_cast<int>(c.regressed() ? ExitCode::kCheckFailed : ExitCode::kOk);
}

int run_render(const ReportOptions& o) {
  if (!o.html_out.empty() && o.html_out == o.markdown_out && o.html_out != "-")
    throw UsageError(fmt::format("--html and --markdown both name {}: the second would replace "
                                 "the first",
                                 o.html_out),
                     {"report", -1, -1, "give each its own file, e.g. --html r.html --markdown r.md"});
  for (const auto* out : {&o.html_out, &o.markdown_out})
    if (!out->empty() && *out != "-" && reports::same_file(*out, o.render_file))
      throw UsageError(fmt::format("{} is the report to render: writing the page there would "
                                   "destroy the report",
                                   *out),
                       {"report", -1, -1, "write the page to a file of its own, e.g. --html "
                                          "report.html"});
  const auto doc = load(o.render_file);
  if (!doc.is_object()) throw UsageError(o.render_file + " is not a report object", {"report", -1, -1, ""});
  for (const auto& e : reports::validate_report(doc))
    std::fprintf(stderr, "ddpdiag report render: warning: %s: %s\n", o.render_file.c_str(), e.to_string().c_str());
  if (!o.html_out.empty()) write_output(o.html_out, reports::render_html(doc));
  if (!o.markdown_out.empty()) write_output(o.markdown_out, reports::render_markdown(doc));
  if (o.html_out.empty() && o.markdown_out.empty()) write_output("-", reports::render_markdown(doc));
  return 0;
}

}  // namespace

Subcommand add_report_command(CLI::App& parent) {
  auto o = std::make_shared<ReportOptions>();
  CLI::App* app = parent.add_subcommand("report", "Validate, compare and render JSON reports");
  app->require_subcommand(1);

  CLI::App* v = app->add_subcommand("validate", "Check reports against the schema (exit 1 when invalid, 2 unreadable)");
  v->add_option("files", o->validate_files, "report files")->required();

  CLI::App* c = app->add_subcommand(
      "compare", "Compare NEW against BASE; exit 1 on a regression beyond the tolerance and the measured spread");
  c->add_option("reports", o->compare_files,
                "BASE [BASE...] NEW: the baseline report (or several runs of it: their median is the "
                "baseline, twice their median distance from it joins the spread) and the new one")
      ->required();
  c->add_option("--max-regression", o->max_regression,
                "tolerance for busbw, time and exposed time, e.g. 10%")->capture_default_str();
  c->add_flag("--fail-on-missing", o->fail_on_missing, "rows of BASE missing from NEW count as regressions");
  c->add_option("--markdown", o->compare_markdown, "also write the comparison as Markdown (e.g. $GITHUB_STEP_SUMMARY)")
      ->check(CLI::Validator(
          [](std::string& s) { return s.empty() ? std::string("an empty path: give a file path") : std::string(); },
          "PATH", "NONEMPTY_PATH"));

  CLI::App* r = app->add_subcommand("render", "Render a report as one self-contained HTML page and/or Markdown");
  r->add_option("file", o->render_file, "report file")->required();
  r->add_option("--html", o->html_out, "write the HTML page here")
      ->check(CLI::Validator(
          [](std::string& s) { return s.empty() ? std::string("an empty path: give a file path") : std::string(); },
          "PATH", "NONEMPTY_PATH"));
  r->add_option("--markdown", o->markdown_out, "write Markdown here ('-': stdout; the default without --html)")
      ->check(CLI::Validator(
          [](std::string& s) { return s.empty() ? std::string("an empty path: give a file path") : std::string(); },
          "PATH", "NONEMPTY_PATH"));

  CLI::App* s = app->add_subcommand("schema", "Print the report schema (JSON Schema 2020-12) built into ddpdiag");

  return {app, [=]() -> int {
            if (v->parsed()) return run_validate(*o);
            if (c->parsed()) return run_compare(*o);
            if (r->parsed()) return run_render(*o);
            if (s->parsed()) {
              std::fputs(std::string(reports::report_schema_text()).c_str(), stdout);
              return 0;
            }
            return static_cast<int>(ExitCode::kUsage);
          }};
}

}  // namespace ddpdiag::cli
