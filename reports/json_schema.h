// A JSON Schema validator for the subset of draft 2020-12 that ddpdiag's
// report schema uses: type (one or a list), const, enum, properties,
// required, additionalProperties, patternProperties, propertyNames, items,
// prefixItems, contains, minItems/maxItems, minLength/maxLength, pattern
// (ECMAScript, std::regex, unanchored as the spec says), minimum/maximum,
// exclusiveMinimum/exclusiveMaximum, $ref to "#/..." in the same document,
// allOf/anyOf/oneOf/not and if/then/else. Annotations (title, description,
// $comment, $schema, $id, default, examples) are ignored.
//
// A schema that uses any other keyword is refused when the validator is
// built: a rule that is silently not enforced is worse than none.
#pragma once

#include <map>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports {

// One way the instance breaks the schema.
struct SchemaViolation {
  std::string instance_path;  // JSON pointer of the offending value, "" for the root
  std::string schema_path;    // the rule, as a pointer into the schema, e.g. "#/$defs/x/minimum"
  std::string message;        // what is wrong, in words

  // "/results/sizes/0/bytes: -1 is less than the minimum 0 [#/$defs/.../minimum]"
  std::string to_string() const;
};

// The schema itself is malformed or uses a keyword this validator lacks.
class SchemaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class JsonSchema {
 public:
  // Checks every keyword and $ref and compiles every pattern; throws SchemaError.
  explicit JsonSchema(nlohmann::json schema);

  // Every violation found (empty: valid). Never throws for any instance.
  std::vector<SchemaViolation> validate(const nlohmann::json& instance) const;

  const nlohmann::json& schema() const { return schema_; }

 private:
  struct Walk;
  void check_schema(const nlohmann::json& s, const std::string& path);

  nlohmann::json schema_;
  std::map<std::string, std::regex> patterns_;  // by source text
};

// RFC 6901: "~" -> "~0", "/" -> "~1".
std::string json_pointer_escape(const std::string& token);

}  // namespace ddpdiag::reports
