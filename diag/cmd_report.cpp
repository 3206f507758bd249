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
#include "reports/format.h"
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

// What was printed must have reached standard output: a full disk or a
// closed file behind a redirection is an error (exit 2), not a silent loss;
// a pipe whose reader has gone is not.
// `err`: an errno already seen by the caller's own write, or 0.
void flush_stdout(const std::string& what, int err = 0) {
  errno = 0;
  if (std::fflush(stdout) == 0 && !std::ferror(stdout) && err == 0) return;
  if (err == 0) err = errno;
  std::clearerr(stdout);
  // A reader that stopped early (`| head`, `| grep -q`) is no error: the
  // command keeps its own exit code (compare's 1 for a regression).
  if (err == EPIPE) return;
  throw UsageError(fmt::format("cannot write {} to standard output: {}", what,
                               err != 0 ? std::strerror(err) : "write error"),
                   {"report", -1, -1,
                    "check where standard output goes (a full disk? a file that cannot grow?), or "
                    "write to a file instead"});
}

void print_stdout(const std::string& text, const std::string& what) {
  errno = 0;
  const bool short_write = std::fwrite(text.data(), 1, text.size(), stdout) != text.size();
  flush_stdout(what, short_write ? (errno != 0 ? errno : EIO) : 0);
}

// An output file the user named: refused before any work when it cannot be
// written or is a read-only (kept) report, as the measuring commands' --json
// and --markdown are.
void check_output_path(const std::string& flag, const std::string& path) {
  if (path.empty() || path == "-") return;
  if (auto problem = reports::output_path_problem(path))
    throw UsageError(fmt::format("{} {}: cannot write there: {}", flag, path, *problem),
                     {"report", -1, -1,
                      "give a path that can be written: an existing, writable directory, and not a "
                      "read-only file (a kept report is never replaced; remove it or make it "
                      "writable to replace it on purpose)"});
}

void write_output(const std::string& flag, const std::string& path, const std::string& text) {
  if (path == "-") {
    print_stdout(text, flag == "--html" ? "the HTML page" : "the Markdown");
    return;
  }
  check_output_path(flag, path);
  try {
    reports::write_file_atomic(path, text);
  } catch (const reports::WriteError& e) {
    const int err = e.error_number();
    throw UsageError(e.what(), {"report", -1, -1,
                                err == ENOSPC || err == EFBIG ? "free some space (or raise the file size limit)"
                                                              : "check that the directory exists and is writable"});
  } catch (const std::exception& e) {
    throw UsageError(e.what(), {"report", -1, -1, "check that the directory exists and is writable"});
  }
}

// A report's string field, or `fallback` when it is absent or not a string.
std::string string_field(const nlohmann::json& doc, const char* key, const std::string& fallback = "") {
  if (!doc.is_object()) return fallback;
  auto it = doc.find(key);
  return it != doc.end() && it->is_string() ? it->get<std::string>() : fallback;
}

// Refuses (exit 2) a document that is not a report of this schema: another
// JSON file, or a report of another schema version, which `verb` would
// otherwise read as an empty report.
void require_report(const nlohmann::json& doc, const std::string& path, const std::string& verb) {
  if (doc.is_object() && string_field(doc, "schema") == reports::kSchema) return;
  const std::string schema = string_field(doc, "schema");
  throw UsageError(
      fmt::format("{} is not a {} report: {}", path, reports::kSchema,
                  !doc.is_object()            ? "it is not a JSON object"
                  : !doc.contains("schema")   ? "it has no \"schema\" field"
                  : !doc["schema"].is_string() ? fmt::format("its \"schema\" is {}, not a string", doc["schema"].type_name())
                                               : fmt::format("its \"schema\" is \"{}\"", schema)),
      {"report", -1, -1,
       schema.rfind("ddpdiag.report/", 0) == 0
           ? fmt::format("it was written by another version of ddpdiag (schema {}); {} it with that version, "
                         "or rerun the command with this one",
                         schema, verb)
           : verb + " reports written by ddpdiag --json"});
}

int run_validate(const ReportOptions& o) {
  int rc = 0;
  for (const auto& path : o.validate_files) {
    nlohmann::json doc;
    try {
      doc = reports::read_json(path);
    } catch (const reports::DuplicateKeyError& e) {
      // Readable JSON, but not one report: invalid, as a schema error is.
      std::printf("%s: 1 error(s) against %s\n  %s: the key appears twice in one object\n", path.c_str(),
                  reports::kSchema, reports::escape_controls(e.pointer()).c_str());
      if (rc == 0) rc = static_cast<int>(ExitCode::kCheckFailed);
      continue;
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
    for (const auto& e : errors) std::printf("  %s\n", reports::escape_controls(e.to_string()).c_str());
    if (rc == 0) rc = static_cast<int>(ExitCode::kCheckFailed);
  }
  flush_stdout("the validation results");
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
  const char* summary = std::getenv("GITHUB_STEP_SUMMARY");
  const bool append_summary = summary && *summary && !o.compare_markdown.empty() && o.compare_markdown != "-" &&
                              reports::same_file(o.compare_markdown, summary);
  if (!o.compare_markdown.empty() && o.compare_markdown != "-")
    for (const auto& in : o.compare_files)
      if (reports::same_file(in, o.compare_markdown))
        throw UsageError(fmt::format("--markdown {} is one of the reports being compared: writing "
                                     "there would destroy it",
                                     o.compare_markdown),
                         {"report", -1, -1, "write the comparison to a file of its own, e.g. compare.md"});
  // GitHub's step summary is appended to (other steps' output stays);
  // any other file is replaced, and checked before the reports are read.
  // A read-only summary is refused as a read-only report is, even by root.
  // A summary that cannot be appended to (its directory missing, a
  // directory, not writable) is refused here too, before the comparison is
  // printed: a result line followed by an error would read as a pass.
  if (!append_summary) {
    check_output_path("--markdown", o.compare_markdown);
  } else if (reports::is_read_only_file(o.compare_markdown)) {
    throw UsageError(fmt::format("--markdown {}: cannot append there: it is read-only", o.compare_markdown),
                     {"report", -1, -1, "make the step summary file writable, or write the comparison to a "
                                        "file of its own"});
  } else if (auto problem = reports::append_path_problem(o.compare_markdown)) {
    throw UsageError(fmt::format("--markdown {}: cannot append there: {}", o.compare_markdown, *problem),
                     {"report", -1, -1, "check GITHUB_STEP_SUMMARY (a file in an existing, writable directory), "
                                        "or write the comparison to a file of its own"});
  }
  std::vector<nlohmann::json> bases;
  for (const auto& p : base_paths) bases.push_back(load(p));
  const auto now = load(new_path);
  std::vector<std::pair<const nlohmann::json*, const std::string*>> inputs;
  for (std::size_t i = 0; i < bases.size(); ++i) inputs.push_back({&bases[i], &base_paths[i]});
  inputs.push_back({&now, &new_path});
  for (const auto& [doc, path] : inputs) {
    require_report(*doc, *path, "compare");
    // A gate must never pass on a report it cannot trust (a verdict it does
    // not know, a deleted world): the same schema check as report validate.
    const auto errors = reports::validate_report(*doc);
    if (errors.empty()) continue;
    throw UsageError(fmt::format("{} is not a valid {} report ({} schema error(s)); it cannot be compared:{}",
                                 *path, reports::kSchema, errors.size(), reports::list_violations(errors)),
                     {"report", -1, -1,
                      fmt::format("run 'ddpdiag report validate {}' for every error, and compare reports "
                                  "written by ddpdiag --json, unedited",
                                  *path)});
  }
  // A baseline that ended with an error before measuring anything (a run
  // interrupted at once, a line refused for its flags) has no row for NEW to
  // be worse than: every row of NEW would be new and the gate would pass.
  for (std::size_t i = 0; i < bases.size(); ++i)
    if (const std::string why = reports::measured_nothing(bases[i]); !why.empty())
      throw UsageError(
          fmt::format("baseline {} measured nothing to compare against: {}; a gate never passes on such "
                      "a baseline",
                      base_paths[i], why),
          {"report", -1, -1,
           bases.size() > 1
               ? fmt::format("record the baseline again from a run that passed, or leave {} out of the "
                             "baselines",
                             base_paths[i])
               : "record the baseline again from a run that passed (verdict PASS)"});
  // A report the schema accepts that the comparison still cannot read is
  // the input's fault, named with the files (exit 2), not an internal error.
  auto unreadable = [&](const nlohmann::json::exception& e) {
    std::string all;
    for (const auto& p : o.compare_files) all += (all.empty() ? "" : ", ") + p;
    return UsageError(fmt::format("cannot compare {}: a field has a value of an unexpected type or range ({})",
                                  all, e.what()),
                      {"report", -1, -1,
                       "compare reports written by ddpdiag --json, unedited; 'ddpdiag report validate' "
                       "checks each file"});
  };
  std::string why;
  try {
    why = reports::baselines_disagree(bases, base_paths);
  } catch (const nlohmann::json::exception& e) {
    throw unreadable(e);
  }
  if (!why.empty())
    throw UsageError(why + ": several baseline runs are merged figure by figure, so they must be runs "
                           "of one command with the same settings",
                     {"report", -1, -1, "give as baselines only runs of the same command line on the same kind of machine"});
  const auto& base = bases.front();
  const std::string& base_path = base_paths.front();
  const std::string base_cmd = string_field(base, "command", "?"), new_cmd = string_field(now, "command", "?");
  if (base_cmd != new_cmd)
    throw UsageError(fmt::format("{} is a report of '{}' and {} one of '{}': nothing in them "
                                 "can be compared",
                                 base_path, base_cmd, new_path, new_cmd),
                     {"report", -1, -1, "compare two reports of the same command"});
  reports::Comparison c;
  std::string text, md;
  try {
    c = reports::compare_reports(bases, now, co);
    text = reports::render_comparison_text(c);
    if (!o.compare_markdown.empty()) md = reports::render_comparison_markdown(c);
  } catch (const nlohmann::json::exception& e) {
    throw unreadable(e);
  }
  // With the Markdown on standard output (`--markdown - >> "$GITHUB_STEP_SUMMARY"`),
  // the plain-text table goes to standard error, so that what is redirected
  // is Markdown alone.
  if (o.compare_markdown == "-") {
    std::fputs(text.c_str(), stderr);
    std::fflush(stderr);
  } else {
    print_stdout(text, "the comparison");
  }
  if (!o.compare_markdown.empty()) {
    if (append_summary) {
      // GitHub's step summary is appended to, as other steps' output
      // already there should stay.
      // A write that fails part-way is taken back: the summary keeps what
      // it had, not half a table.
      try {
        reports::append_file(o.compare_markdown, md);
      } catch (const reports::WriteError& e) {
        const int err = e.error_number();
        throw UsageError(e.what(), {"report", -1, -1,
                                    err == ENOSPC || err == EFBIG ? "free some space (or raise the file size limit)"
                                                                  : "check that the file is writable"});
      }
    } else {
      write_output("--markdown", o.compare_markdown, md);
    }
  }
  return static_cast<int>(c.regressed() ? ExitCode::kCheckFailed : ExitCode::kOk);
}

int run_render(const ReportOptions& o) {
  // The same file under two spellings (./r.md, a link) counts too.
  if (o.html_out == "-" && o.markdown_out == "-")
    throw UsageError("--html - and --markdown - both name standard output: the page and the Markdown would "
                     "run into each other",
                     {"report", -1, -1, "send one of them to a file, e.g. --html report.html --markdown -"});
  // (A device, such as /dev/null, may take both.)
  if (!o.html_out.empty() && !o.markdown_out.empty() && o.html_out != "-" && o.markdown_out != "-" &&
      reports::same_file(o.html_out, o.markdown_out))
    throw UsageError(fmt::format("--html and --markdown both name {}: the second would replace "
                                 "the first",
                                 o.html_out == o.markdown_out
                                     ? o.html_out
                                     : fmt::format("{} (as {})", o.html_out, o.markdown_out)),
                     {"report", -1, -1, "give each its own file, e.g. --html r.html --markdown r.md"});
  for (const auto* out : {&o.html_out, &o.markdown_out})
    if (!out->empty() && *out != "-" && reports::same_file(*out, o.render_file))
      throw UsageError(fmt::format("{} is the report to render: writing the page there would "
                                   "destroy the report",
                                   *out),
                       {"report", -1, -1, "write the page to a file of its own, e.g. --html "
                                          "report.html"});
  check_output_path("--html", o.html_out);
  check_output_path("--markdown", o.markdown_out);
  const auto doc = load(o.render_file);
  require_report(doc, o.render_file, "render");
  for (const auto& e : reports::validate_report(doc))
    std::fprintf(stderr, "ddpdiag report render: warning: %s: %s\n", o.render_file.c_str(),
                 reports::escape_controls(e.to_string()).c_str());
  if (!o.html_out.empty()) write_output("--html", o.html_out, reports::render_html(doc));
  if (!o.markdown_out.empty()) write_output("--markdown", o.markdown_out, reports::render_markdown(doc));
  if (o.html_out.empty() && o.markdown_out.empty()) write_output("--markdown", "-", reports::render_markdown(doc));
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
  c->add_option("--markdown", o->compare_markdown, "also write the comparison as Markdown (e.g. $GITHUB_STEP_SUMMARY; '-': stdout, the "
                "table then goes to stderr)")
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
              print_stdout(std::string(reports::report_schema_text()), "the schema");
              return 0;
            }
            return static_cast<int>(ExitCode::kUsage);
          }};
}

}  // namespace ddpdiag::cli
