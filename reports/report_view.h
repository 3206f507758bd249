// A report seen as tables: what the Markdown and HTML renderers both show,
// computed once so the two never disagree. Internal to reports/.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports::view {

struct Table {
  std::string title;
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;
  std::vector<bool> numeric;  // per column: right-align
  std::string note;           // e.g. "showing 200 of 5000 rows"
};

// Rows shown at most per results table; the rest is summarised in the note.
inline constexpr std::size_t kMaxRows = 200;

std::string str(const nlohmann::json& j, const char* key, const std::string& dflt = "");

// (label, value) pairs of the context: tool, command line, start, duration,
// world, backend, launcher, hosts, libraries.
std::vector<std::pair<std::string, std::string>> context(const nlohmann::json& report);
// One row per rank: rank, local rank, host, pid, device.
Table ranks_table(const nlohmann::json& report);
Table checks_table(const nlohmann::json& report);
// results.warnings (name, detail), shown beside the checks rather than among
// the results; no rows when there are none.
Table warnings_table(const nlohmann::json& report);
// Error fields as (label, value); empty when there is no error.
std::vector<std::pair<std::string, std::string>> error_fields(const nlohmann::json& report);
// Results: the nccl-tests style size table where rows have out_of_place /
// in_place blocks, a table per array of objects, and a table of the scalars.
std::vector<Table> result_tables(const nlohmann::json& report);
Table environment_table(const nlohmann::json& report);

}  // namespace ddpdiag::reports::view
