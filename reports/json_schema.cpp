#include "reports/json_schema.h"

#include <regex.h>

#include <cctype>
#include <cmath>
#include <cstring>
#include <set>

#include <fmt/core.h>

namespace ddpdiag::reports {

using nlohmann::json;

namespace {

// The POSIX ERE of an ECMAScript pattern, for the syntax both read alike;
// throws SchemaError for the rest. ECMAScript's `.` does not match a line
// break and POSIX's does: outside brackets it becomes [^\n\r].
std::string posix_pattern(const std::string& source) {
  const auto refuse = [&](const std::string& what) {
    throw SchemaError(fmt::format("pattern '{}': {} is not supported by this validator", source, what));
  };
  std::string out;
  bool in_brackets = false;
  for (std::size_t i = 0; i < source.size(); ++i) {
    const char c = source[i];
    if (c == '\0') refuse("a NUL character");
    if (in_brackets) {
      // POSIX reads a backslash in brackets as itself, ECMAScript as an
      // escape; [:class:], [=x=] and [.x.] exist in POSIX only.
      if (c == '\\') refuse("a backslash inside [...]");
      if (c == '[' && i + 1 < source.size() && std::strchr(":=.", source[i + 1])) refuse("[: [= or [. inside [...]");
      if (c == ']') in_brackets = false;
      out += c;
      continue;
    }
    if (c == '\\') {
      if (i + 1 >= source.size()) refuse("a lone backslash at the end");
      const char e = source[++i];
      if (std::isalnum(static_cast<unsigned char>(e)))
        refuse(fmt::format("the escape \\{} (write a class such as [0-9] instead)", e));
      out += c;
      out += e;
    } else if (c == '[') {
      in_brackets = true;
      out += c;
      // A leading ] (after an optional ^) is a literal ] to POSIX and ends
      // an empty class in ECMAScript.
      if (i + 1 < source.size() && source[i + 1] == '^') out += source[++i];
      if (i + 1 < source.size() && source[i + 1] == ']') refuse("[] or [^]");
    } else if (c == '(' && i + 1 < source.size() && source[i + 1] == '?') {
      refuse("a (?...) group");
    } else if ((c == '*' || c == '+' || c == '?' || c == '}') && i + 1 < source.size() &&
               source[i + 1] == '?') {
      refuse("a lazy quantifier");
    } else if (c == '.') {
      out += "[^\n\r]";
    } else {
      out += c;
    }
  }
  if (in_brackets) refuse("an unclosed [");
  return out;
}

}  // namespace

SchemaPattern::SchemaPattern(const std::string& source) {
  const std::string posix = posix_pattern(source);
  auto* re = new regex_t;
  const int rc = ::regcomp(re, posix.c_str(), REG_EXTENDED | REG_NOSUB);
  if (rc != 0) {
    char why[256];
    ::regerror(rc, re, why, sizeof(why));
    delete re;
    throw SchemaError(fmt::format("bad regular expression '{}': {}", source, why));
  }
  re_ = std::shared_ptr<void>(re, [](void* p) {
    ::regfree(static_cast<regex_t*>(p));
    delete static_cast<regex_t*>(p);
  });
}

bool SchemaPattern::search(const std::string& text) const {
  // REG_STARTEND: the text's own length, so a NUL inside it is a character
  // like any other (as it is to ECMAScript), not its end.
  regmatch_t whole[1];
  whole[0].rm_so = 0;
  whole[0].rm_eo = static_cast<regoff_t>(text.size());
  return ::regexec(static_cast<const regex_t*>(re_.get()), text.c_str(), 1, whole, REG_STARTEND) == 0;
}

namespace {

// Keywords that carry no rule.
const std::set<std::string> kAnnotations = {"$schema", "$id",     "$comment", "$defs", "title",
                                            "description", "default", "examples"};
// Keywords that do.
const std::set<std::string> kRules = {
    "type",     "const",    "enum",         "properties",       "required",
    "additionalProperties", "patternProperties", "propertyNames", "items", "prefixItems",
    "contains", "minItems", "maxItems",     "minLength",        "maxLength",
    "pattern",  "minimum",  "maximum",      "exclusiveMinimum", "exclusiveMaximum",
    "$ref",     "allOf",    "anyOf",        "oneOf",            "not",
    "if",       "then",     "else"};
const std::set<std::string> kTypes = {"null", "boolean", "object", "array",
                                      "string", "number", "integer"};

// Recursion through $ref without consuming the instance would never end; a
// real schema nests far less than this.
constexpr int kMaxDepth = 200;

std::string short_dump(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string type_of(const json& v) {
  switch (v.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "boolean";
    case json::value_t::object: return "object";
    case json::value_t::array: return "array";
    case json::value_t::string: return "string";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "integer";
    case json::value_t::number_float: return "number";
    default: return "unknown";
  }
}

bool is_integer(const json& v) {
  if (v.is_number_integer()) return true;
  if (!v.is_number_float()) return false;
  double d = v.get<double>();
  return std::isfinite(d) && std::floor(d) == d;
}

bool has_type(const json& v, const std::string& t) {
  if (t == "integer") return is_integer(v);
  if (t == "number") return v.is_number();
  return type_of(v) == t;
}

// Equality as JSON Schema defines it: numbers compare by value (1 == 1.0).
bool json_equal(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_number_integer() && b.is_number_integer() && !a.is_number_float() &&
        !b.is_number_float())
      return a == b;
    return a.get<double>() == b.get<double>();
  }
  if (a.type() != b.type()) return false;
  if (a.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!json_equal(a[i], b[i])) return false;
    return true;
  }
  if (a.is_object()) {
    if (a.size() != b.size()) return false;
    for (auto it = a.begin(); it != a.end(); ++it) {
      auto o = b.find(it.key());
      if (o == b.end() || !json_equal(it.value(), *o)) return false;
    }
    return true;
  }
  return a == b;
}

// Code points, not bytes, as the spec counts string length.
std::size_t utf8_length(const std::string& s) {
  std::size_t n = 0;
  for (unsigned char c : s)
    if ((c & 0xC0) != 0x80) ++n;
  return n;
}

}  // namespace

std::string json_pointer_escape(const std::string& token) {
  std::string out;
  for (char c : token) {
    if (c == '~')
      out += "~0";
    else if (c == '/')
      out += "~1";
    else
      out += c;
  }
  return out;
}

std::string SchemaViolation::to_string() const {
  return fmt::format("{}: {} [{}]", instance_path.empty() ? "(root)" : instance_path, message,
                     schema_path);
}

JsonSchema::JsonSchema(json schema) : schema_(std::move(schema)) { check_schema(schema_, "#"); }

void JsonSchema::check_schema(const json& s, const std::string& path) {
  if (s.is_boolean()) return;
  if (!s.is_object()) throw SchemaError(fmt::format("{}: a schema must be an object or a boolean", path));
  auto sub = [&](const std::string& key, const json& v) { check_schema(v, path + "/" + json_pointer_escape(key)); };
  auto sub_list = [&](const std::string& key, const json& v) {
    if (!v.is_array() || v.empty())
      throw SchemaError(fmt::format("{}/{}: must be a non-empty array of schemas", path, key));
    for (std::size_t i = 0; i < v.size(); ++i) check_schema(v[i], fmt::format("{}/{}/{}", path, key, i));
  };
  auto sub_map = [&](const std::string& key, const json& v) {
    if (!v.is_object()) throw SchemaError(fmt::format("{}/{}: must be an object of schemas", path, key));
    for (auto it = v.begin(); it != v.end(); ++it)
      check_schema(it.value(), path + "/" + key + "/" + json_pointer_escape(it.key()));
  };
  auto number = [&](const std::string& key, const json& v) {
    if (!v.is_number()) throw SchemaError(fmt::format("{}/{}: must be a number", path, key));
  };
  for (auto it = s.begin(); it != s.end(); ++it) {
    const std::string& k = it.key();
    const json& v = it.value();
    if (k == "$defs") {
      sub_map(k, v);
    } else if (kAnnotations.count(k)) {
      continue;
    } else if (!kRules.count(k)) {
      throw SchemaError(fmt::format("{}: keyword '{}' is not supported by this validator", path, k));
    } else if (k == "type") {
      std::vector<json> ts = v.is_array() ? v.get<std::vector<json>>() : std::vector<json>{v};
      for (const auto& t : ts)
        if (!t.is_string() || !kTypes.count(t.get<std::string>()))
          throw SchemaError(fmt::format("{}/type: unknown type {}", path, short_dump(t)));
    } else if (k == "enum") {
      if (!v.is_array()) throw SchemaError(fmt::format("{}/enum: must be an array", path));
    } else if (k == "properties" || k == "patternProperties") {
      sub_map(k, v);
      if (k == "patternProperties")
        for (auto p = v.begin(); p != v.end(); ++p) {
          try {
            patterns_.emplace(p.key(), SchemaPattern(p.key()));
          } catch (const SchemaError& e) {
            throw SchemaError(fmt::format("{}/patternProperties: {}", path, e.what()));
          }
        }
    } else if (k == "required") {
      if (!v.is_array()) throw SchemaError(fmt::format("{}/required: must be an array of names", path));
      for (const auto& n : v)
        if (!n.is_string()) throw SchemaError(fmt::format("{}/required: must be an array of names", path));
    } else if (k == "additionalProperties" || k == "propertyNames" || k == "items" ||
               k == "contains" || k == "not" || k == "if" || k == "then" || k == "else") {
      sub(k, v);
    } else if (k == "prefixItems" || k == "allOf" || k == "anyOf" || k == "oneOf") {
      sub_list(k, v);
    } else if (k == "minItems" || k == "maxItems" || k == "minLength" || k == "maxLength") {
      if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<long long>() >= 0))
        throw SchemaError(fmt::format("{}/{}: must be a non-negative integer", path, k));
    } else if (k == "minimum" || k == "maximum" || k == "exclusiveMinimum" || k == "exclusiveMaximum") {
      number(k, v);
    } else if (k == "pattern") {
      if (!v.is_string()) throw SchemaError(fmt::format("{}/pattern: must be a string", path));
      try {
        patterns_.emplace(v.get<std::string>(), SchemaPattern(v.get<std::string>()));
      } catch (const SchemaError& e) {
        throw SchemaError(fmt::format("{}/pattern: {}", path, e.what()));
      }
    } else if (k == "$ref") {
      if (!v.is_string() || v.get<std::string>().rfind("#", 0) != 0)
        throw SchemaError(fmt::format("{}/$ref: only references into this document (\"#/...\") are supported", path));
      // Resolved against the whole document; checked here so a typo fails at load.
      std::string ref = v.get<std::string>().substr(1);
      try {
        if (!schema_.contains(json::json_pointer(ref)))
          throw SchemaError(fmt::format("{}/$ref: {} does not exist", path, v.get<std::string>()));
      } catch (const json::exception& e) {
        throw SchemaError(fmt::format("{}/$ref: {}: {}", path, v.get<std::string>(), e.what()));
      }
    }
  }
}

// One validation pass: the schema, where the errors go, and the $ref depth.
struct JsonSchema::Walk {
  const JsonSchema& self;
  int depth = 0;

  void add(std::vector<SchemaViolation>& out, const std::string& ip, const std::string& sp,
           std::string msg) {
    out.push_back({ip, sp, std::move(msg)});
  }

  // True when inst is valid against s; violations are appended to out.
  bool run(const json& inst, const json& s, const std::string& ip, const std::string& sp,
           std::vector<SchemaViolation>& out) {
    const std::size_t before = out.size();
    if (s.is_boolean()) {
      if (!s.get<bool>()) add(out, ip, sp, "no value is allowed here");
      return out.size() == before;
    }
    if (++depth > kMaxDepth) {
      --depth;
      add(out, ip, sp, "schema nests too deeply (a $ref loop?)");
      return false;
    }
    for (auto it = s.begin(); it != s.end(); ++it) keyword(inst, s, it.key(), it.value(), ip, sp, out);
    --depth;
    return out.size() == before;
  }

  bool matches(const json& inst, const json& s, const std::string& ip, const std::string& sp,
               std::vector<SchemaViolation>* errs = nullptr) {
    std::vector<SchemaViolation> tmp;
    bool ok = run(inst, s, ip, sp, tmp);
    if (errs) *errs = std::move(tmp);
    return ok;
  }

  void keyword(const json& inst, const json& s, const std::string& k, const json& v,
               const std::string& ip, const std::string& sp, std::vector<SchemaViolation>& out) {
    const std::string kp = sp + "/" + json_pointer_escape(k);
    if (k == "type") {
      std::vector<std::string> ts;
      if (v.is_array())
        for (const auto& t : v) ts.push_back(t.get<std::string>());
      else
        ts.push_back(v.get<std::string>());
      for (const auto& t : ts)
        if (has_type(inst, t)) return;
      std::string want;
      for (const auto& t : ts) want += (want.empty() ? "" : " or ") + t;
      add(out, ip, kp, fmt::format("{} is {}, expected {}", short_dump(inst), type_of(inst), want));
    } else if (k == "const") {
      if (!json_equal(inst, v)) add(out, ip, kp, fmt::format("{} is not {}", short_dump(inst), short_dump(v)));
    } else if (k == "enum") {
      for (const auto& e : v)
        if (json_equal(inst, e)) return;
      add(out, ip, kp, fmt::format("{} is not one of {}", short_dump(inst), short_dump(v)));
    } else if (k == "properties") {
      if (!inst.is_object()) return;
      for (auto it = v.begin(); it != v.end(); ++it) {
        auto f = inst.find(it.key());
        if (f != inst.end())
          run(*f, it.value(), ip + "/" + json_pointer_escape(it.key()),
              kp + "/" + json_pointer_escape(it.key()), out);
      }
    } else if (k == "patternProperties") {
      if (!inst.is_object()) return;
      for (auto p = v.begin(); p != v.end(); ++p) {
        const SchemaPattern& re = self.patterns_.at(p.key());
        for (auto it = inst.begin(); it != inst.end(); ++it)
          if (re.search(it.key()))
            run(it.value(), p.value(), ip + "/" + json_pointer_escape(it.key()),
                kp + "/" + json_pointer_escape(p.key()), out);
      }
    } else if (k == "additionalProperties") {
      if (!inst.is_object()) return;
      for (auto it = inst.begin(); it != inst.end(); ++it) {
        if (s.contains("properties") && s["properties"].contains(it.key())) continue;
        bool by_pattern = false;
        if (s.contains("patternProperties"))
          for (auto p = s["patternProperties"].begin(); p != s["patternProperties"].end(); ++p)
            if (self.patterns_.at(p.key()).search(it.key())) by_pattern = true;
        if (by_pattern) continue;
        const std::string child = ip + "/" + json_pointer_escape(it.key());
        if (v.is_boolean() && !v.get<bool>())
          add(out, child, kp, fmt::format("property '{}' is not allowed here", it.key()));
        else
          run(it.value(), v, child, kp, out);
      }
    } else if (k == "propertyNames") {
      if (!inst.is_object()) return;
      for (auto it = inst.begin(); it != inst.end(); ++it) {
        std::vector<SchemaViolation> errs;
        if (!matches(json(it.key()), v, ip, kp, &errs))
          add(out, ip + "/" + json_pointer_escape(it.key()), kp,
              fmt::format("property name '{}' is not allowed: {}", it.key(), errs.front().message));
      }
    } else if (k == "required") {
      if (!inst.is_object()) return;
      for (const auto& n : v)
        if (!inst.contains(n.get<std::string>()))
          add(out, ip, kp, fmt::format("required property '{}' is missing", n.get<std::string>()));
    } else if (k == "prefixItems") {
      if (!inst.is_array()) return;
      for (std::size_t i = 0; i < v.size() && i < inst.size(); ++i)
        run(inst[i], v[i], fmt::format("{}/{}", ip, i), fmt::format("{}/{}", kp, i), out);
    } else if (k == "items") {
      if (!inst.is_array()) return;
      std::size_t first = s.contains("prefixItems") ? s["prefixItems"].size() : 0;
      for (std::size_t i = first; i < inst.size(); ++i) run(inst[i], v, fmt::format("{}/{}", ip, i), kp, out);
    } else if (k == "contains") {
      if (!inst.is_array()) return;
      for (std::size_t i = 0; i < inst.size(); ++i)
        if (matches(inst[i], v, fmt::format("{}/{}", ip, i), kp)) return;
      add(out, ip, kp, "no item matches the 'contains' rule");
    } else if (k == "minItems" || k == "maxItems") {
      if (!inst.is_array()) return;
      auto n = v.get<std::size_t>();
      if (k == "minItems" && inst.size() < n)
        add(out, ip, kp, fmt::format("has {} item(s), fewer than {}", inst.size(), n));
      if (k == "maxItems" && inst.size() > n)
        add(out, ip, kp, fmt::format("has {} item(s), more than {}", inst.size(), n));
    } else if (k == "minLength" || k == "maxLength") {
      if (!inst.is_string()) return;
      auto n = v.get<std::size_t>();
      auto len = utf8_length(inst.get<std::string>());
      if (k == "minLength" && len < n)
        add(out, ip, kp, fmt::format("{} is shorter than {} character(s)", short_dump(inst), n));
      if (k == "maxLength" && len > n)
        add(out, ip, kp, fmt::format("{} is longer than {} character(s)", short_dump(inst), n));
    } else if (k == "pattern") {
      if (!inst.is_string()) return;
      if (!self.patterns_.at(v.get<std::string>()).search(inst.get<std::string>()))
        add(out, ip, kp, fmt::format("{} does not match the pattern {}", short_dump(inst), v.get<std::string>()));
    } else if (k == "minimum" || k == "maximum" || k == "exclusiveMinimum" || k == "exclusiveMaximum") {
      if (!inst.is_number()) return;
      double x = inst.get<double>(), lim = v.get<double>();
      bool bad = (k == "minimum" && x < lim) || (k == "maximum" && x > lim) ||
                 (k == "exclusiveMinimum" && x <= lim) || (k == "exclusiveMaximum" && x >= lim);
      if (bad) {
        const char* what = k == "minimum" ? "less than the minimum"
                           : k == "maximum" ? "greater than the maximum"
                           : k == "exclusiveMinimum" ? "not greater than"
                                                     : "not less than";
        add(out, ip, kp, fmt::format("{} is {} {}", short_dump(inst), what, short_dump(v)));
      }
    } else if (k == "$ref") {
      const std::string ref = v.get<std::string>();
      run(inst, self.schema_.at(json::json_pointer(ref.substr(1))), ip, ref, out);
    } else if (k == "allOf") {
      for (std::size_t i = 0; i < v.size(); ++i) run(inst, v[i], ip, fmt::format("{}/{}", kp, i), out);
    } else if (k == "anyOf" || k == "oneOf") {
      std::vector<std::vector<SchemaViolation>> branch_errs(v.size());
      std::vector<std::size_t> passed;
      for (std::size_t i = 0; i < v.size(); ++i)
        if (matches(inst, v[i], ip, fmt::format("{}/{}", kp, i), &branch_errs[i])) passed.push_back(i);
      if (k == "oneOf" && passed.size() > 1) {
        add(out, ip, kp, fmt::format("matches {} alternatives of 'oneOf', expected exactly one", passed.size()));
        return;
      }
      if (!passed.empty()) return;
      explain_no_branch(branch_errs, ip, kp, k, out);
    } else if (k == "not") {
      if (matches(inst, v, ip, kp)) add(out, ip, kp, fmt::format("{} matches a 'not' rule", short_dump(inst)));
    } else if (k == "if") {
      const json* branch = nullptr;
      std::string bp;
      if (matches(inst, v, ip, kp)) {
        if (s.contains("then")) branch = &s["then"], bp = sp + "/then";
      } else if (s.contains("else")) {
        branch = &s["else"], bp = sp + "/else";
      }
      if (branch) run(inst, *branch, ip, bp, out);
    }
    // then/else are applied through "if"; annotations have no rule.
  }

  // No alternative matched. A branch that failed only because the value has
  // another type at this very place (e.g. {"type": "null"} for an object) says
  // little; when exactly one branch got past that, its errors are the ones
  // that tell the user what to fix.
  void explain_no_branch(const std::vector<std::vector<SchemaViolation>>& branch_errs,
                         const std::string& ip, const std::string& kp, const std::string& k,
                         std::vector<SchemaViolation>& out) {
    std::vector<std::size_t> relevant;
    for (std::size_t i = 0; i < branch_errs.size(); ++i) {
      bool only_type_here = !branch_errs[i].empty();
      for (const auto& e : branch_errs[i])
        if (e.instance_path != ip || e.schema_path.size() < 5 ||
            e.schema_path.compare(e.schema_path.size() - 5, 5, "/type") != 0)
          only_type_here = false;
      if (!only_type_here) relevant.push_back(i);
    }
    if (relevant.size() == 1) {
      for (const auto& e : branch_errs[relevant.front()]) out.push_back(e);
      return;
    }
    std::string why;
    for (std::size_t i = 0; i < branch_errs.size(); ++i)
      if (!branch_errs[i].empty())
        why += fmt::format("{}({}) {}", why.empty() ? "" : "; ", i + 1, branch_errs[i].front().message);
    add(out, ip, kp, fmt::format("matches none of the {} alternatives of '{}': {}", branch_errs.size(), k, why));
  }
};

std::vector<SchemaViolation> JsonSchema::validate(const json& instance) const {
  std::vector<SchemaViolation> out;
  Walk w{*this};
  w.run(instance, schema_, "", "#", out);
  return out;
}

}  // namespace ddpdiag::reports
