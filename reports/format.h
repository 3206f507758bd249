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
