// The report schema (reports/schema/report.schema.json, compiled into the
// binary) and validation of a report against it.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "reports/json_schema.h"

namespace ddpdiag::reports {

// The schema file's text, as it was at build time.
std::string_view report_schema_text();
// The parsed schema, built once.
const JsonSchema& report_schema();
// Every violation of the report schema (empty: valid).
std::vector<SchemaViolation> validate_report(const nlohmann::json& report);
// The first `shown` violations, a line each ("\n  /pointer: what"), and how
// many more there are: for an error that refuses a report.
std::string list_violations(const std::vector<SchemaViolation>& errors, std::size_t shown = 3);

}  // namespace ddpdiag::reports
