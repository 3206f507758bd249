#include "reports/report_schema.h"

#include <fmt/core.h>

#include "ddpdiag/report_schema_text.h"
#include "reports/format.h"

namespace ddpdiag::reports {

std::string_view report_schema_text() { return generated::kReportSchemaText; }

const JsonSchema& report_schema() {
  static const JsonSchema schema(nlohmann::json::parse(report_schema_text()));
  return schema;
}

std::vector<SchemaViolation> validate_report(const nlohmann::json& report) {
  return report_schema().validate(report);
}

std::string list_violations(const std::vector<SchemaViolation>& errors, std::size_t shown) {
  std::string listed;
  for (std::size_t i = 0; i < errors.size() && i < shown; ++i)
    listed += "\n  " + escape_controls(errors[i].to_string());
  if (errors.size() > shown) listed += fmt::format("\n  ... and {} more", errors.size() - shown);
  return listed;
}

}  // namespace ddpdiag::reports
