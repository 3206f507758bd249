// A JSON Schema validator for the subset of draft 2020-12 that ddpdiag's
// report schema uses: type (one or a list), const, enum, properties,
// required, additionalProperties, patternProperties, propertyNames, items,
// prefixItems, contains, minItems/maxItems, minLength/maxLength, pattern
// (unanchored, as the spec says; see SchemaPattern for the syntax), minimum/maximum,
// exclusiveMinimum/exclusiveMaximum, $ref to "#/..." in the same document,
// allOf/anyOf/oneOf/not and if/then/else. Annotations (title, description,
// $comment, $schema, $id, default, examples) are ignored.
//
// A schema that uses any other keyword is refused when the validator is
// built: a rule that is silently not enforced is worse than none.
#pragma once

#include <map>
#include <memory>
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

// A schema's `pattern` (or patternProperties key), matched with POSIX
// extended regular expressions (regcomp/regexec), whose matcher needs no
// stack in proportion to the text: std::regex recurses per character and
// overflows the stack on strings of some tens of kilobytes (a CPU list of
// a large machine, a hostile report). The syntax both ECMAScript and POSIX
// read alike is accepted: literals, ., [classes], ^ $, groups, |, and the
// quantifiers ? * + {m,n}. What ECMAScript alone gives (\d \w \s \b,
// back-references, (?...) groups, lazy quantifiers) is refused when the
// schema is loaded (SchemaError), never read with another meaning.
class SchemaPattern {
 public:
  explicit SchemaPattern(const std::string& source);  // throws SchemaError
  bool search(const std::string& text) const;         // matches anywhere in text

 private:
  std::shared_ptr<void> re_;  // a regex_t, freed with regfree
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
  std::map<std::string, SchemaPattern> patterns_;  // by source text
};

// RFC 6901: "~" -> "~0", "/" -> "~1".
std::string json_pointer_escape(const std::string& token);

}  // namespace ddpdiag::reports
