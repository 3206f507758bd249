// Renderers of one report: they only format the JSON they are given (any
// command, also a partial report of a failed run) and never throw on odd
// content; a field that is missing or of another type is left out.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports {

// GitHub-flavoured Markdown: title with the verdict, context, checks, error,
// results tables, environment in a collapsed block. Suitable for
// $GITHUB_STEP_SUMMARY.
std::string render_markdown(const nlohmann::json& report);

// Writes the finished report as JSON and/or Markdown (each atomically); an
// empty path skips that form. Every subcommand's --json / --markdown ends here.
void write_report_outputs(const nlohmann::json& report, const std::string& json_path,
                          const std::string& markdown_path);

// One self-contained HTML page: inline CSS and SVG charts, no script, no
// external resource, readable on a narrow screen.
std::string render_html(const nlohmann::json& report);

}  // namespace ddpdiag::reports
