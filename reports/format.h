// Small formatting helpers shared by the report renderers.
#pragma once

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports {

// 8 -> "8 B", 1024 -> "1 KiB", 1572864 -> "1.5 MiB".
// Whether s ends with suffix (a field's unit: "_us", "_gbps", "_bytes").
bool ends_with(const std::string& s, const std::string& suffix);

std::string human_bytes(double bytes);
// Compact axis label for a byte count: 8, 1K, 64M, 2G (nccl-tests' style).
std::string short_bytes(double bytes);
// A figure with about `digits` significant digits, no exponent for everyday values.
std::string format_figure(double v, int digits = 4);
// A JSON scalar as a table cell: strings bare, numbers via format_figure,
// null as "-", arrays/objects compact.
std::string format_cell(const nlohmann::json& v);
// Control characters (C0 but tab and newline where `keep_lines`, DEL, and
// C1 as UTF-8) written as text (ESC as \x1b, U+0085 as \u0085): a report's
// strings (host, model and phase names, details, argv) printed or put in
// Markdown can then move no cursor, ring no bell, set no terminal title.
// Without `keep_lines`, a newline or tab is escaped too (\x0a): one field
// stays on one line and cannot forge one of the lines around it.
std::string escape_controls(const std::string& s, bool keep_lines = false);
// &, <, >, ", ' escaped for HTML text and attribute values.
std::string html_escape(const std::string& s);
// Text from a report made inert in Markdown: &, <, > as entities (no HTML
// gets through), backticks escaped (no code span opens), newlines as spaces.
std::string markdown_text(const std::string& s);
// markdown_text, and | escaped too: safe inside a Markdown table cell.
std::string markdown_cell(const std::string& s);
// s as a code span inside a Markdown table cell, shown verbatim.
std::string markdown_code_cell(const std::string& s);

}  // namespace ddpdiag::reports
