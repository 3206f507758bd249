#include "reports/report_schema.h"

#include "ddpdiag/report_schema_text.h"

namespace ddpdiag::reports {

std::string_view report_schema_text() { return generated::kReportSchemaText; }

const JsonSchema& report_schema() {
  static const JsonSchema schema(nlohmann::json::parse(report_schema_text()));
  return schema;
}

std::vector<SchemaViolation> validate_report(const nlohmann::json& report) {
  return report_schema().validate(report);
}

}  // namespace ddpdiag::reports
