// The report schema (reports/schema/report.schema.json, compiled into the
// binary) and validation of a report against it.
#pragma once

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

}  // namespace ddpdiag::reports
