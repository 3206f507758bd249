// The reports layer: JSON Schema validator, the report schema against what
// the report writer produces, the compare gate, the Markdown and HTML renderers.
#include <algorithm>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "reports/compare.h"
#include "reports/json_schema.h"
#include "reports/render.h"
#include "reports/report.h"
#include "reports/report_schema.h"

using namespace ddpdiag::reports;
using nlohmann::json;

namespace {

std::vector<SchemaViolation> check(const json& schema, const json& instance) {
  return JsonSchema(schema).validate(instance);
}

bool has_error_at(const std::vector<SchemaViolation>& errs, const std::string& pointer,
                  const std::string& rule_suffix = "") {
  for (const auto& e : errs)
    if (e.instance_path == pointer &&
        (rule_suffix.empty() || (e.schema_path.size() >= rule_suffix.size() &&
                                 e.schema_path.compare(e.schema_path.size() - rule_suffix.size(),
                                                       rule_suffix.size(), rule_suffix) == 0)))
      return true;
  return false;
}

std::string dump(const std::vector<SchemaViolation>& errs) {
  std::string s;
  for (const auto& e : errs) s += e.to_string() + "\n";
  return s;
}

// One measured size: busbw and time, and the ranks' time spread.
struct Point {
  std::size_t bytes;
  double busbw_gbps;
  double min_rank_time_us;
  double max_rank_time_us;
};

json block(const Point& p) {
  const double time_us = (p.min_rank_time_us + p.max_rank_time_us) / 2;
  return {{"time_us", time_us},       {"algbw_gbps", p.busbw_gbps},
          {"busbw_gbps", p.busbw_gbps}, {"wrong", 0},
          {"min_rank_time_us", p.min_rank_time_us}, {"max_rank_time_us", p.max_rank_time_us},
          {"fastest_rank", 0},        {"slowest_rank", 1}};
}

// A report as the allreduce-test command writes it, through the real writer.
json allreduce_report(const std::vector<Point>& points, CheckStatus correctness = CheckStatus::kPass,
                      int world_size = 2, const std::string& backend = "gloo") {
  Report r("allreduce-test", {"ddpdiag", "allreduce-test", "--json", "r.json"});
  std::vector<RankInfo> ranks;
  for (int i = 0; i < world_size; ++i) ranks.push_back({i, i, "node0", 100 + i, "cpu (node0)", "0-7"});
  r.set_world(world_size, backend, "ddpdiag", ranks, {{"gloo", "0.5.0"}});
  r.set_environment({{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  auto& res = r.results();
  res["collective"] = "all_reduce";
  res["dtypes"] = {"float"};
  res["ops"] = {"sum"};
  res["iters"] = 20;
  res["warmup_iters"] = 5;
  res["check_iters"] = 1;
  res["sizes"] = json::array();
  double sum = 0;
  for (const auto& p : points) {
    res["sizes"].push_back({{"bytes", p.bytes}, {"count", p.bytes / 4}, {"dtype", "float"}, {"op", "sum"},
                            {"out_of_place", block(p)}, {"in_place", block(p)}});
    sum += p.busbw_gbps;
  }
  res["avg_busbw_gbps"] = points.empty() ? 0.0 : sum / static_cast<double>(points.size());
  res["wrong_total"] = 0;
  r.add_check({"correctness", correctness, "0 wrong element(s)"});
  return r.finish();
}

std::vector<Point> baseline_points() {
  return {{1024, 1.0, 99, 101}, {65536, 5.0, 99, 101}, {1 << 20, 10.0, 99, 101}};
}

}  // namespace

// ---------------------------------------------------------------- validator

TEST_CASE("validator: type, including lists of types and integers written as 1.0", "[reports][schema]") {
  CHECK(check({{"type", "integer"}}, 3).empty());
  CHECK(check({{"type", "integer"}}, 3.0).empty());
  CHECK_FALSE(check({{"type", "integer"}}, 3.5).empty());
  CHECK(check({{"type", "number"}}, 3).empty());
  CHECK(check({{"type", json::array({"string", "null"})}}, nullptr).empty());
  auto errs = check({{"type", json::array({"string", "null"})}}, 1);
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].instance_path.empty());
  CHECK(errs[0].schema_path == "#/type");
  CHECK(errs[0].message.find("string or null") != std::string::npos);
}

TEST_CASE("validator: properties, required and additionalProperties name the pointer", "[reports][schema]") {
  json schema = {{"type", "object"},
                 {"required", {"a"}},
                 {"properties", {{"a", {{"type", "object"}, {"properties", {{"b/c", {{"minimum", 0}}}}}}}}},
                 {"additionalProperties", false}};
  CHECK(check(schema, {{"a", {{"b/c", 1}}}}).empty());
  auto errs = check(schema, {{"a", {{"b/c", -1}}}, {"x~y", 1}});
  CHECK(has_error_at(errs, "/a/b~1c", "/minimum"));
  CHECK(has_error_at(errs, "/x~0y", "/additionalProperties"));
  auto missing = check(schema, json::object());
  REQUIRE(missing.size() == 1);
  CHECK(missing[0].schema_path == "#/required");
  CHECK(missing[0].message.find("'a'") != std::string::npos);
  CHECK(check({{"additionalProperties", {{"type", "string"}}}}, {{"k", 1}})[0].instance_path == "/k");
}

TEST_CASE("validator: enum, const, numbers, strings and patterns", "[reports][schema]") {
  CHECK(check({{"enum", {"pass", "fail"}}}, "pass").empty());
  CHECK_FALSE(check({{"enum", {"pass", "fail"}}}, "PASS").empty());
  CHECK(check({{"const", 1}}, 1.0).empty());
  CHECK_FALSE(check({{"const", "a"}}, "b").empty());
  CHECK_FALSE(check({{"maximum", 10}}, 11).empty());
  CHECK(check({{"maximum", 10}}, 10).empty());
  CHECK_FALSE(check({{"exclusiveMinimum", 0}}, 0).empty());
  CHECK(check({{"minimum", 0}}, "not a number").empty());  // numeric rules ignore other types
  CHECK_FALSE(check({{"minLength", 2}}, "é").empty());     // one code point, two bytes
  // Patterns are unanchored, as the spec says.
  CHECK(check({{"pattern", "[0-9]+"}}, "abc123").empty());
  CHECK_FALSE(check({{"pattern", "^[a-z_]+$"}}, "camelCase").empty());
}

TEST_CASE("validator: arrays with items, prefixItems, minItems and contains", "[reports][schema]") {
  json schema = {{"type", "array"},
                 {"prefixItems", {{{"type", "string"}}}},
                 {"items", {{"type", "integer"}}},
                 {"minItems", 2}};
  CHECK(check(schema, {"a", 1, 2}).empty());
  CHECK(has_error_at(check(schema, {"a", 1, "b"}), "/2", "/items/type"));
  CHECK(has_error_at(check(schema, {1, 1}), "/0", "/prefixItems/0/type"));
  CHECK(has_error_at(check(schema, {"a"}), "", "/minItems"));
  json contains = {{"contains", {{"const", 3}}}};
  CHECK(check(contains, {1, 3}).empty());
  CHECK_FALSE(check(contains, {1, 2}).empty());
  CHECK(check({{"not", {{"contains", {{"const", 3}}}}}}, {1, 2}).empty());
  CHECK_FALSE(check({{"not", {{"contains", {{"const", 3}}}}}}, {3}).empty());
}

TEST_CASE("validator: $ref, allOf, anyOf, oneOf and if/then/else", "[reports][schema]") {
  json schema = {
      {"$defs", {{"pos", {{"type", "integer"}, {"minimum", 1}}}, {"a/b", {{"type", "string"}}}}},
      {"properties",
       {{"n", {{"$ref", "#/$defs/pos"}}},
        {"s", {{"$ref", "#/$defs/a~1b"}}},
        {"both", {{"allOf", {{{"type", "integer"}}, {{"minimum", 5}}}}}},
        {"one", {{"oneOf", {{{"type", "integer"}}, {{"type", "number"}}}}}},
        {"maybe", {{"anyOf", {{{"type", "null"}}, {{"$ref", "#/$defs/pos"}}}}}}}},
      {"if", {{"properties", {{"kind", {{"const", "a"}}}}}, {"required", {"kind"}}}},
      {"then", {{"required", {"n"}}}},
      {"else", {{"required", {"s"}}}}};
  CHECK(check(schema, {{"kind", "a"}, {"n", 2}}).empty());
  CHECK(has_error_at(check(schema, {{"kind", "a"}}), "", "#/then/required"));
  CHECK(has_error_at(check(schema, {{"kind", "b"}}), "", "#/else/required"));
  CHECK(has_error_at(check(schema, {{"s", "x"}, {"n", 0}}), "/n", "#/$defs/pos/minimum"));
  CHECK(has_error_at(check(schema, {{"s", 1}}), "/s", "#/$defs/a~1b/type"));
  CHECK(has_error_at(check(schema, {{"s", "x"}, {"both", 3}}), "/both", "/allOf/1/minimum"));
  // 2 is an integer and a number: oneOf wants exactly one.
  CHECK(has_error_at(check(schema, {{"s", "x"}, {"one", 2}}), "/one", "/oneOf"));
  CHECK(check(schema, {{"s", "x"}, {"one", 2.5}}).empty());
  // anyOf of null or a positive integer: for 0 the error that matters is the
  // minimum of the branch whose type fits, not "0 is not null".
  auto errs = check(schema, {{"s", "x"}, {"maybe", 0}});
  REQUIRE(errs.size() == 1);
  CHECK(errs[0].schema_path == "#/$defs/pos/minimum");
  CHECK(check(schema, {{"s", "x"}, {"maybe", nullptr}}).empty());
  // Neither branch fits by type: one error listing both reasons.
  auto both = check(schema, {{"s", "x"}, {"maybe", "str"}});
  REQUIRE(both.size() == 1);
  CHECK(both[0].message.find("none of the 2 alternatives") != std::string::npos);
}

TEST_CASE("validator: patterns over long strings, line breaks and NULs", "[reports][schema]") {
  // A CPU list of a large machine: std::regex recursed per character and
  // overflowed the stack at some tens of kilobytes.
  const json cpus = {{"pattern", "^([0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)?$"}};
  std::string list = "0";
  for (int c = 2; c < 200000; c += 2) list += "," + std::to_string(c);
  REQUIRE(list.size() > 500000);
  CHECK(check(cpus, list).empty());
  CHECK_FALSE(check(cpus, list + ",x").empty());
  const json name = {{"propertyNames", {{"pattern", "^[a-z][a-z0-9_]*$"}}}};
  CHECK(check(name, {{std::string(100000, 'a'), 1}}).empty());
  CHECK_FALSE(check(name, {{std::string(100000, 'a') + "B", 1}}).empty());
  // ECMAScript's . stops at a line break, and $ is the end of the text.
  CHECK(check({{"pattern", "^a.c$"}}, "abc").empty());
  CHECK_FALSE(check({{"pattern", "^a.c$"}}, "a\nc").empty());
  CHECK_FALSE(check({{"pattern", "^[a-z]+$"}}, "abc\nXYZ").empty());
  CHECK(check({{"pattern", "^[0-9]+\\.[0-9]+"}}, "1.2").empty());
  CHECK_FALSE(check({{"pattern", "^[0-9]+\\.[0-9]+"}}, "1x2").empty());
  // A NUL is a character of the text, not its end.
  CHECK_FALSE(check({{"pattern", "^[a-z]+$"}}, std::string("ab\0CD", 5)).empty());
  CHECK(check({{"pattern", "CD"}}, std::string("ab\0CD", 5)).empty());
}

TEST_CASE("validator: propertyNames and boolean schemas", "[reports][schema]") {
  json schema = {{"propertyNames", {{"pattern", "^[a-z][a-z0-9_]*$"}}}};
  CHECK(check(schema, {{"busbw_gbps", 1}}).empty());
  CHECK(has_error_at(check(schema, {{"busBW", 1}}), "/busBW", "/propertyNames"));
  CHECK(check(true, 1).empty());
  CHECK_FALSE(check(false, 1).empty());
}

TEST_CASE("validator: a schema with an unsupported keyword or a dangling $ref is refused", "[reports][schema]") {
  CHECK_THROWS_AS(JsonSchema(json{{"unevaluatedProperties", false}}), SchemaError);
  CHECK_THROWS_AS(JsonSchema(json{{"minimun", 0}}), SchemaError);
  CHECK_THROWS_AS(JsonSchema(json{{"$ref", "#/$defs/nowhere"}}), SchemaError);
  CHECK_THROWS_AS(JsonSchema(json{{"$ref", "other.json#/x"}}), SchemaError);
  CHECK_THROWS_AS(JsonSchema(json{{"pattern", "("}}), SchemaError);
  // What ECMAScript reads otherwise than POSIX's matcher is refused, not
  // read with another meaning.
  for (const char* p : {"^\\d+$", "\\w", "(?:a)", "a+?", "[\\-]", "[[:alpha:]]", "[]a]", "a\\"})
    CHECK_THROWS_AS(JsonSchema(json{{"pattern", p}}), SchemaError);
  CHECK_THROWS_AS(JsonSchema(json{{"patternProperties", {{"^\\s", true}}}}), SchemaError);
  CHECK_NOTHROW(JsonSchema(json{{"title", "t"}, {"description", "d"}, {"$comment", "c"}}));
}

// ---------------------------------------------------------- report schema

TEST_CASE("report schema: the built-in schema is draft 2020-12 and loads", "[reports][schema]") {
  auto s = json::parse(report_schema_text());
  CHECK(s["$schema"] == "https://json-schema.org/draft/2020-12/schema");
  CHECK(s["properties"]["schema"]["const"] == kSchema);
  CHECK_NOTHROW(report_schema());
}

TEST_CASE("report schema: what the report writer produces is valid", "[reports][schema]") {
  auto pass = allreduce_report(baseline_points());
  INFO(dump(validate_report(pass)));
  CHECK(validate_report(pass).empty());
  auto fail = allreduce_report(baseline_points(), CheckStatus::kFail);
  CHECK(fail["verdict"] == "FAIL");
  INFO(dump(validate_report(fail)));
  CHECK(validate_report(fail).empty());

  // A run whose environment was rejected: no world, results empty, error recorded.
  Report died("allreduce-test", {"ddpdiag", "allreduce-test"});
  died.set_error({"usage", "RANK=4 is out of range", "environment", -1, -1, "check RANK", 2});
  INFO(dump(validate_report(died.finish())));
  CHECK(validate_report(died.finish()).empty());

  // A run that died at rendezvous: the world as far as rank 0 knew it (its
  // size, backend, launcher, and itself only), results empty, error recorded.
  Report alone("allreduce-test", {"ddpdiag", "allreduce-test"});
  alone.set_world(4, "nccl", "flags", {{0, 0, "node0", 42, "cuda:0", ""}}, {{"nccl", "nccl 2.28.9"}});
  alone.set_error({"rendezvous", "rank(s) 1, 2, 3 never arrived", "rendezvous", 0, 1, "check the network", 3});
  INFO(dump(validate_report(alone.finish())));
  CHECK(validate_report(alone.finish()).empty());

  // Single-process commands have no world.
  Report buckets("buckets", {"ddpdiag", "buckets", "--model", "mlp"});
  buckets.results() = {{"model", "mlp"}, {"bucket_cap_bytes", 26214400}, {"bucket_count", 1},
                       {"buckets", {{{"index", 0}, {"bytes", 100}, {"tensor_count", 2}, {"param_indices", {1, 0}}}}}};
  INFO(dump(validate_report(buckets.finish())));
  CHECK(validate_report(buckets.finish()).empty());
}

TEST_CASE("report schema: violations are found where they are", "[reports][schema]") {
  auto r = allreduce_report(baseline_points());
  SECTION("a size row with an unknown dtype") {
    r["results"]["sizes"][1]["dtype"] = "float33";
    CHECK(has_error_at(validate_report(r), "/results/sizes/1/dtype", "#/$defs/dtype/enum"));
  }
  SECTION("a negative bandwidth") {
    r["results"]["sizes"][0]["in_place"]["busbw_gbps"] = -1;
    CHECK(has_error_at(validate_report(r), "/results/sizes/0/in_place/busbw_gbps", "/minimum"));
  }
  SECTION("PASS with a failed check") {
    r["checks"][0]["status"] = "fail";
    CHECK(has_error_at(validate_report(r), "/checks", "/not"));
  }
  SECTION("ERROR without an error") {
    r["verdict"] = "ERROR";
    CHECK(has_error_at(validate_report(r), "/error", "/type"));
  }
  SECTION("camelCase keys in results") {
    r["results"]["avgBusBw"] = 1.0;
    CHECK(has_error_at(validate_report(r), "/results/avgBusBw", "/propertyNames"));
  }
  SECTION("missing context") {
    r.erase("started_at");
    CHECK(has_error_at(validate_report(r), "", "#/required"));
  }
  SECTION("an unknown top-level field and an unknown command") {
    r["tool_version"] = "0.1.0";
    r["command"] = "allreduce-tset";
    auto errs = validate_report(r);
    CHECK(has_error_at(errs, "/tool_version", "#/additionalProperties"));
    CHECK(has_error_at(errs, "/command", "#/properties/command/enum"));
  }
  SECTION("a completed allreduce-test needs its summary figures") {
    r["results"].erase("wrong_total");
    CHECK(has_error_at(validate_report(r), "/results", "/required"));
  }
}

// ------------------------------------------------------------------ compare

TEST_CASE("compare: identical reports have no change", "[reports][compare]") {
  auto a = allreduce_report(baseline_points());
  auto c = compare_reports(a, a);
  CHECK_FALSE(c.regressed());
  CHECK(c.rows(ChangeKind::kUnchanged) == 6);  // 3 sizes x 2 placements
  CHECK(c.rows(ChangeKind::kRegressed) == 0);
}

TEST_CASE("compare: improvement, regression beyond and within tolerance", "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  auto pts = baseline_points();
  SECTION("faster is an improvement") {
    pts[2].busbw_gbps = 13;  // +30%
    auto c = compare_reports(base, allreduce_report(pts));
    CHECK_FALSE(c.regressed());
    CHECK(c.rows(ChangeKind::kImproved) == 2);
  }
  SECTION("30% less bandwidth is a regression") {
    pts[2].busbw_gbps = 7;
    auto c = compare_reports(base, allreduce_report(pts));
    CHECK(c.regressed());
    CHECK(c.rows(ChangeKind::kRegressed) == 2);
    bool found = false;
    for (const auto& f : c.figures)
      if (f.kind == ChangeKind::kRegressed) {
        found = true;
        CHECK(f.figure == "busbw_gbps");
        CHECK(f.change == Approx(-0.3));
        CHECK(f.row.find("all_reduce 1 MiB float sum") != std::string::npos);
      }
    CHECK(found);
    CHECK(render_comparison_text(c).find("REGRESSION") != std::string::npos);
  }
  SECTION("5% less is within a 10% tolerance, but not within 2%") {
    pts[2].busbw_gbps = 9.5;
    CHECK_FALSE(compare_reports(base, allreduce_report(pts)).regressed());
    CHECK(compare_reports(base, allreduce_report(pts), {0.02, false}).regressed());
  }
  SECTION("a change of exactly the tolerance is within it, one a hair over is not") {
    // (7.7 - 7) / 7 is 0.10000000000000009 in doubles.
    CHECK((7.7 - 7.0) / 7.0 > 0.1);
    const auto exact = compare_reports(allreduce_report({{1024, 1.0, 7.0, 7.0}}),
                                       allreduce_report({{1024, 1.0, 7.7, 7.7}}));
    CHECK_FALSE(exact.regressed());
    CHECK(exact.rows(ChangeKind::kUnchanged) == 2);
    CHECK(compare_reports(allreduce_report({{1024, 1.0, 7.0, 7.0}}),
                          allreduce_report({{1024, 1.0, 7.701, 7.701}}))
              .regressed());
  }
  SECTION("a time that moved by less than 0.25 us is noise, whatever its percentage") {
    // dp-vs-ring's world-size-1 rows time a no-op: 0.03 -> 0.17 us is +274%.
    const auto tiny = compare_reports(allreduce_report({{1024, 1.0, 0.03, 0.03}}),
                                      allreduce_report({{1024, 1.0, 0.17, 0.17}}));
    CHECK_FALSE(tiny.regressed());
    CHECK(compare_reports(allreduce_report({{1024, 1.0, 0.03, 0.03}}),
                          allreduce_report({{1024, 1.0, 0.30, 0.30}}))
              .regressed());
  }
  SECTION("a slower time is a regression (lower is better)") {
    pts[0].min_rank_time_us = 139;
    pts[0].max_rank_time_us = 141;
    auto c = compare_reports(base, allreduce_report(pts));
    CHECK(c.regressed());
    bool time_regressed = false;
    for (const auto& f : c.figures)
      if (f.figure == "time_us" && f.kind == ChangeKind::kRegressed) time_regressed = !f.higher_is_better;
    CHECK(time_regressed);
  }
}

TEST_CASE("compare: a change inside the measured spread is noise, not a regression", "[reports][compare]") {
  // Ranks disagree by 60 us around 100 us: a 20% drop is inside that spread.
  std::vector<Point> noisy = {{1 << 20, 10.0, 70, 130}};
  auto base = allreduce_report(noisy);
  noisy[0].busbw_gbps = 8;  // -20%
  auto c = compare_reports(base, allreduce_report(noisy));
  CHECK_FALSE(c.regressed());
  CHECK(c.rows(ChangeKind::kNoise) == 2);
  // The same drop with a tight spread is a regression.
  std::vector<Point> tight = {{1 << 20, 10.0, 99, 101}};
  auto tbase = allreduce_report(tight);
  tight[0].busbw_gbps = 8;
  CHECK(compare_reports(tbase, allreduce_report(tight)).regressed());
}

TEST_CASE("compare: a figure NEW lacks is missing, and --fail-on-missing fails on it", "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  auto now = base;
  for (auto& row : now["results"]["sizes"]) row["out_of_place"]["busbw_gbps"] = nullptr;
  auto c = compare_reports(base, now);
  bool missing = false;
  for (const auto& f : c.figures)
    missing = missing || (f.figure == "busbw_gbps" && f.kind == ChangeKind::kMissing && f.base && !f.now);
  CHECK(missing);
  CHECK_FALSE(c.regressed());
  CompareOptions strict;
  strict.fail_on_missing = true;
  auto cs = compare_reports(base, now, strict);
  CHECK(cs.regressed());
  CHECK(regression_reasons(cs).find("missing with --fail-on-missing") != std::string::npos);
}

TEST_CASE("compare: a check that passed and is skipped or gone in NEW is no longer checked",
          "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  base["checks"] = nlohmann::json::array({{{"name", "correctness"}, {"status", "pass"}, {"detail", "0 wrong"}},
                                          {{"name", "min_busbw"}, {"status", "pass"}, {"detail", "ok"}}});
  auto now = base;
  now["checks"] = nlohmann::json::array({{{"name", "correctness"}, {"status", "skip"}, {"detail", "-c 0"}}});
  auto c = compare_reports(base, now);
  REQUIRE(c.checks.size() == 2);
  CHECK(c.checks[0].missing);
  CHECK(c.checks[1].missing);
  CHECK_FALSE(c.regressed());
  CHECK(render_comparison_text(c).find("no longer checked") != std::string::npos);
  CompareOptions strict;
  strict.fail_on_missing = true;
  auto cs = compare_reports(base, now, strict);
  CHECK(cs.regressed());
  CHECK(regression_reasons(cs).find("2 missing with --fail-on-missing") != std::string::npos);
}

TEST_CASE("compare: two checks of one name in NEW: failing when either fails", "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  base["checks"] = nlohmann::json::array({{{"name", "links"}, {"status", "pass"}, {"detail", "ok"}}});
  auto now = base;
  now["checks"] = nlohmann::json::array({{{"name", "links"}, {"status", "pass"}, {"detail", "ok"}},
                                         {{"name", "links"}, {"status", "fail"}, {"detail", "slow"}}});
  now["verdict"] = "FAIL";
  auto c = compare_reports(base, now);
  REQUIRE(c.checks.size() == 1);
  CHECK(c.checks[0].now == "fail");
  CHECK(c.checks[0].regressed);
}

TEST_CASE("compare: several baseline runs: their median is the base, twice their median distance joins the spread",
          "[reports][compare]") {
  // Three runs of the same command on a noisy machine: 1 MiB at 10, 8 and 12
  // GB/s, each with tight rank spreads (run-to-run noise no single run shows).
  auto run = [](double gbps) {
    auto pts = baseline_points();
    pts[2].busbw_gbps = gbps;
    return allreduce_report(pts);
  };
  const std::vector<json> bases = {run(10), run(8), run(12)};
  const auto row_of = [](const Comparison& c, const char* fig) {
    for (const auto& f : c.figures)
      if (f.figure == fig && f.row.find("1 MiB") != std::string::npos &&
          f.row.find("out_of_place") != std::string::npos)
        return f;
    FAIL("no 1 MiB " << fig << " row");
    return FigureChange{};
  };
  SECTION("a drop inside the runs' range is noise; with one run it regresses") {
    auto c = compare_reports(bases, run(7.5));  // -25% from the median, 2.5 GB/s < the 4 GB/s range
    CHECK_FALSE(c.regressed());
    CHECK(c.base_runs == 3);
    auto f = row_of(c, "busbw_gbps");
    CHECK(*f.base == Approx(10));  // the median
    CHECK(f.noise == Approx(0.4));  // (12 - 8) / 10
    CHECK(f.kind == ChangeKind::kNoise);
    CHECK(compare_reports(bases[0], run(7.5)).regressed());
    CHECK(render_comparison_text(c).find("and 2 more run(s)") != std::string::npos);
  }
  SECTION("a drop beyond the range regresses") {
    auto c = compare_reports(bases, run(5));
    CHECK(c.regressed());
    CHECK(row_of(c, "busbw_gbps").kind == ChangeKind::kRegressed);
  }
  SECTION("an even number of runs: the mean of the middle two") {
    auto c = compare_reports(std::vector<json>{run(8), run(12)}, run(10));
    CHECK(*row_of(c, "busbw_gbps").base == Approx(10));
  }
  SECTION("a NEW run that fails never passes, even where a baseline run failed too") {
    // One failing baseline once switched the check and verdict gates off.
    const auto failing = allreduce_report(baseline_points(), CheckStatus::kFail);
    auto c = compare_reports(std::vector<json>{allreduce_report(baseline_points()), failing}, failing);
    CHECK(c.regressed());
    CHECK(c.base_verdict == "FAIL");
    CHECK(c.verdict_regressed);
    CHECK(regression_reasons(c).find("the new run's verdict is FAIL") != std::string::npos);
    CHECK(compare_reports(failing, failing).regressed());
    CHECK_FALSE(compare_reports(failing, allreduce_report(baseline_points())).regressed());
  }
  SECTION("one outlier among the runs does not widen the band") {
    // Runs at 10, 10.2 and 1 GB/s: the range (9.2) would call a drop to 5
    // noise; twice the median distance from the median (0.4) does not.
    const std::vector<json> with_outlier = {run(10), run(10.2), run(1)};
    auto c = compare_reports(with_outlier, run(5));
    CHECK(c.regressed());
    CHECK(row_of(c, "busbw_gbps").noise == Approx(0.04));
  }
  SECTION("baseline runs of other settings are named") {
    const std::vector<json> mixed = {run(10), allreduce_report(baseline_points(), CheckStatus::kPass, 4)};
    const auto why = baselines_disagree(mixed, {"a.json", "b.json"});
    CHECK(why.find("world size 4 (b.json) vs 2 (a.json)") != std::string::npos);
    CHECK(baselines_disagree(bases, {"a.json", "b.json", "c.json"}).empty());
  }
}

TEST_CASE("compare: missing and new rows", "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  auto pts = baseline_points();
  pts.erase(pts.begin());                // 1K gone
  pts.push_back({4 << 20, 12.0, 99, 101});  // 4M new
  auto now = allreduce_report(pts);
  auto c = compare_reports(base, now);
  CHECK(c.rows(ChangeKind::kMissing) == 2);
  CHECK(c.rows(ChangeKind::kNew) == 2);
  CHECK_FALSE(c.regressed());
  CHECK(compare_reports(base, now, {0.10, true}).regressed());
  // Another world size or backend is another row.
  auto other = compare_reports(base, allreduce_report(baseline_points(), CheckStatus::kPass, 4));
  CHECK(other.rows(ChangeKind::kMissing) == 6);
  CHECK(other.rows(ChangeKind::kNew) == 6);
}

namespace {

// A link-health report: one pair, measured with bandwidth_bytes per exchange.
json link_health_report(double bandwidth_bytes, double busbw_gbps, double latency_us) {
  Report r("link-health", {"ddpdiag", "link-health"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  r.results()["bandwidth_bytes"] = bandwidth_bytes;
  r.results()["allreduce_bytes"] = 1 << 20;
  r.results()["pairs"] = json::array({{{"src", 0}, {"dst", 1}, {"busbw_gbps", busbw_gbps},
                                       {"latency_us", latency_us}}});
  r.add_check({"links", CheckStatus::kPass, "no slow pair"});
  return r.finish();
}

// A memory report: per-rank peak bytes for a model.
json memory_report(const std::string& model, double peak_bytes) {
  Report r("memory", {"ddpdiag", "memory"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  r.results()["model"] = model;
  r.results()["bucket_cap_mb"] = 25.0;
  r.results()["ranks"] = json::array({{{"rank", 0}, {"peak_bytes", peak_bytes}},
                                      {{"rank", 1}, {"peak_bytes", peak_bytes}}});
  return r.finish();
}

}  // namespace

TEST_CASE("compare: a bucket_cap_mb_list candidate is a row of its own", "[reports][compare]") {
  // bucket-sweep's list candidate has bucket_cap_mb 25 (its largest) as the
  // plain 25 has: the list tells them apart.
  auto sweep = [](double plain_us, double list_us) {
    Report r("bucket-sweep", {"ddpdiag", "bucket-sweep"});
    r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
    r.results()["model"] = "resnet50";
    r.results()["caps"] = json::array({{{"bucket_cap_mb", 25.0}, {"exposed_comm_time_us", plain_us}},
                                       {{"bucket_cap_mb", 25.0},
                                        {"bucket_cap_mb_list", {1.0, 4.0, 25.0}},
                                        {"exposed_comm_time_us", list_us}}});
    return r.finish();
  };
  auto c = compare_reports(sweep(1000, 800), sweep(1000, 1200));
  CHECK(c.regressed());
  CHECK(c.rows(ChangeKind::kRegressed) == 1);
  CHECK(c.rows(ChangeKind::kUnchanged) == 1);
  const auto text = render_comparison_text(c);
  CHECK(text.find("bucket_cap_mb_list=[1,4,25]") != std::string::npos);
  CHECK(text.find("#2") == std::string::npos);  // not a repeat of the plain 25's row
}

TEST_CASE("compare: rows measured under different settings never match", "[reports][compare]") {
  SECTION("link-health pairs at another transfer size") {
    auto c = compare_reports(link_health_report(256 << 10, 1.5, 41), link_health_report(64 << 10, 20.9, 24));
    CHECK_FALSE(c.regressed());
    CHECK(c.rows(ChangeKind::kImproved) == 0);
    CHECK(c.rows(ChangeKind::kMissing) == 1);
    CHECK(c.rows(ChangeKind::kNew) == 1);
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "bandwidth_bytes");
    CHECK(c.settings_changed[0].base == "256 KiB");
    CHECK(c.settings_changed[0].now == "64 KiB");
    const auto text = render_comparison_text(c);
    CHECK(text.find("note: the runs' settings differ: bandwidth_bytes 256 KiB (base) vs 64 KiB (new)") !=
          std::string::npos);
    CHECK(text.find("bandwidth_bytes=256 KiB") != std::string::npos);  // in the missing row's label
    CHECK(render_comparison_markdown(c).find("bandwidth_bytes 256 KiB (base) vs 64 KiB (new)") !=
          std::string::npos);
    // Missing rows fail the gate when the user asks for that.
    CHECK(compare_reports(link_health_report(256 << 10, 1.5, 41), link_health_report(64 << 10, 20.9, 24),
                          {0.10, true})
              .regressed());
  }
  SECTION("memory of another model") {
    auto c = compare_reports(memory_report("mlp", 1.6e7), memory_report("gpt2", 9.97e8));
    CHECK_FALSE(c.regressed());
    CHECK(c.rows(ChangeKind::kRegressed) == 0);
    CHECK(c.rows(ChangeKind::kMissing) == 2);
    CHECK(c.rows(ChangeKind::kNew) == 2);
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "model");
    CHECK(settings_note(c).find("model mlp (base) vs gpt2 (new)") != std::string::npos);
  }
  SECTION("memory with another bucket_cap_mb_list, or none") {
    auto with_list = [](const json& list) {
      json r = memory_report("mlp", 1.6e7);
      r["results"]["bucket_cap_mb_list"] = list;
      return r;
    };
    auto c = compare_reports(with_list(nullptr), with_list(json::array({1, 4, 25})));
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "bucket_cap_mb_list");
    CHECK(settings_note(c).find("bucket_cap_mb_list not given (base) vs [1,4,25] (new)") != std::string::npos);
    CHECK(c.rows(ChangeKind::kMissing) == 2);
    auto same = compare_reports(with_list(json::array({1, 4})), with_list(json::array({1, 4})));
    CHECK(same.settings_changed.empty());
    CHECK(same.rows(ChangeKind::kUnchanged) == 2);
  }
  SECTION("memory with DDP_SET_LAST_BUCKET_CAP=1 against without, and against a report without the field") {
    auto with_set_last = [](bool on) {
      json r = memory_report("mlp", 1.6e7);
      r["results"]["set_last_bucket_cap"] = on;
      return r;
    };
    auto c = compare_reports(with_set_last(false), with_set_last(true));
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "set_last_bucket_cap");
    CHECK(c.rows(ChangeKind::kMissing) == 2);
    // A report of an older ddpdiag has no such field: its rows still match.
    auto older = compare_reports(memory_report("mlp", 1.6e7), with_set_last(false));
    CHECK(older.settings_changed.empty());
    CHECK(older.rows(ChangeKind::kUnchanged) == 2);
  }
  SECTION("world size is named as a differing setting too") {
    auto c = compare_reports(allreduce_report(baseline_points()),
                             allreduce_report(baseline_points(), CheckStatus::kPass, 4));
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "world size");
    CHECK(c.rows(ChangeKind::kMissing) == 6);
  }
  SECTION("the same settings compare exactly as before") {
    auto c = compare_reports(memory_report("mlp", 1.6e7), memory_report("mlp", 3.2e7));
    CHECK(c.settings_changed.empty());
    CHECK(c.regressed());
    CHECK(c.rows(ChangeKind::kRegressed) == 2);
    CHECK(render_comparison_text(c).find("settings differ") == std::string::npos);
    auto l = compare_reports(link_health_report(256 << 10, 1.5, 41), link_health_report(256 << 10, 1.5, 41));
    CHECK(l.settings_changed.empty());
    CHECK(l.rows(ChangeKind::kUnchanged) == 1);
  }
}

namespace {

// A broadcast-test report with one row per chunk size, as --chunk-mb lists
// them (a size may repeat), each with its time.
json broadcast_report(const std::vector<std::pair<double, double>>& chunk_mib_and_time_us) {
  Report r("broadcast-test", {"ddpdiag", "broadcast-test"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  r.results()["model"] = "mlp";
  r.results()["bytes"] = 4 << 20;
  r.results()["rows"] = json::array();
  for (const auto& [mib, t] : chunk_mib_and_time_us)
    r.results()["rows"].push_back({{"chunk_bytes", mib * (1 << 20)},
                                   {"time_us", t},
                                   {"busbw_gbps", (4 << 20) / (t * 1e3)}});
  r.add_check({"parameters_identical", CheckStatus::kPass, "agree"});
  return r.finish();
}

}  // namespace

TEST_CASE("compare: rows that repeat an identity are matched in order", "[reports][compare]") {
  // --chunk-mb 1,1,4: the first 1 MiB row is slower (a cold first run).
  const auto three = broadcast_report({{1, 1000}, {1, 600}, {4, 500}});
  SECTION("a report compared with itself is unchanged") {
    auto c = compare_reports(three, three);
    CHECK_FALSE(c.regressed());
    CHECK(c.rows(ChangeKind::kUnchanged) == 3);
    CHECK(c.rows(ChangeKind::kImproved) == 0);
    CHECK(c.rows(ChangeKind::kRegressed) == 0);
    CHECK(render_comparison_text(c).find("chunk_bytes=1048576 #2 [2 gloo]") != std::string::npos);
  }
  SECTION("an extra repeated row is new, the others pair with their first occurrence") {
    auto c = compare_reports(broadcast_report({{1, 1000}, {4, 500}}), three);
    CHECK_FALSE(c.regressed());
    CHECK(c.rows(ChangeKind::kUnchanged) == 2);
    CHECK(c.rows(ChangeKind::kNew) == 1);
    CHECK(c.rows(ChangeKind::kImproved) == 0);
    // And the other way round it is missing.
    auto back = compare_reports(three, broadcast_report({{1, 1000}, {4, 500}}));
    CHECK(back.rows(ChangeKind::kMissing) == 1);
    CHECK(back.rows(ChangeKind::kUnchanged) == 2);
  }
}

TEST_CASE("compare: a check going from pass to fail is always a regression", "[reports][compare]") {
  auto base = allreduce_report(baseline_points());
  auto now = allreduce_report(baseline_points(), CheckStatus::kFail);
  auto c = compare_reports(base, now, {1000.0, false});  // any figure tolerance
  CHECK(c.regressed());
  REQUIRE(c.checks.size() == 1);
  CHECK(c.checks[0].regressed);
  CHECK(c.verdict_regressed);
  // Fail to pass is not.
  CHECK_FALSE(compare_reports(now, base).regressed());
}

TEST_CASE("compare: generic rows of other commands, with their own spread", "[reports][compare]") {
  auto sweep = [](double exposed_us, double stddev_us) {
    Report r("bucket-sweep", {"ddpdiag", "bucket-sweep"});
    r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
    r.results()["caps"] = json::array();
    for (double cap : {1.0, 25.0})
      r.results()["caps"].push_back({{"bucket_cap_mb", cap}, {"exposed_comm_time_us", exposed_us},
                                     {"exposed_comm_time_us_stddev", stddev_us}});
    r.results()["recommended_cap_mb"] = 25;
    return r.finish();
  };
  CHECK(validate_report(sweep(100, 1)).empty());
  auto c = compare_reports(sweep(100, 1), sweep(150, 1));
  CHECK(c.regressed());
  CHECK(c.rows(ChangeKind::kRegressed) == 2);
  CHECK_FALSE(compare_reports(sweep(100, 30), sweep(150, 30)).regressed());  // 2 x 30 us band
}

TEST_CASE("compare: tolerance parsing and the Markdown summary", "[reports][compare]") {
  CHECK(parse_percentage("10%") == Approx(0.10));
  CHECK(parse_percentage("2.5") == Approx(0.025));
  CHECK_THROWS_AS(parse_percentage("ten"), std::invalid_argument);
  CHECK_THROWS_AS(parse_percentage("-5%"), std::invalid_argument);
  // A bare fraction: 10% or 0.1%? The writer says which.
  CHECK_THROWS_AS(parse_percentage("0.1"), std::invalid_argument);
  CHECK(parse_percentage("0.1%") == Approx(0.001));
  CHECK(parse_percentage("0") == 0);
  auto pts = baseline_points();
  pts[1].busbw_gbps = 2;
  auto md = render_comparison_markdown(compare_reports(allreduce_report(baseline_points()), allreduce_report(pts)));
  CHECK(md.find("## ddpdiag report compare: ❌ regression") != std::string::npos);
  CHECK(md.find("### Changes") != std::string::npos);
  CHECK(md.find("| regressed |") != std::string::npos);
  CHECK(md.find("<details>") != std::string::npos);
}

namespace {

// A bucket-sweep report as the command writes its cap rows: comm_time_us with
// its spread, busbw_gbps derived from it, exposed time with spread_us.
json bucket_sweep_report(double comm_time_us, double comm_spread_us, double busbw_gbps, double step_time_us) {
  Report r("bucket-sweep", {"ddpdiag", "bucket-sweep"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  r.results()["model"] = "mlp";
  r.results()["first_bucket_bytes"] = 1 << 20;
  r.results()["compute_gbps"] = 0.0;
  r.results()["caps"] = json::array();
  for (double cap : {1.0, 5.0, 25.0})
    r.results()["caps"].push_back({{"bucket_cap_mb", cap},
                                   {"bucket_cap_bytes", cap * (1 << 20)},
                                   {"comm_time_us", comm_time_us},
                                   {"comm_time_us_spread", comm_spread_us},
                                   {"algbw_gbps", busbw_gbps},
                                   {"busbw_gbps", busbw_gbps},
                                   {"exposed_comm_time_us", 3000.0},
                                   {"spread_us", 30.0},
                                   {"step_time_us", step_time_us},
                                   {"wrong", 0}});
  return r.finish();
}

const FigureChange* find_figure(const Comparison& c, const std::string& row_part, const std::string& figure) {
  for (const auto& f : c.figures)
    if (f.figure == figure && f.row.find(row_part) != std::string::npos) return &f;
  return nullptr;
}

}  // namespace

TEST_CASE("compare: bucket-sweep's exposed-time spread excuses the exposed time only", "[reports][compare]") {
  // spread_us 30 us is the exposed time's rank spread; the step time has
  // none measured. A 28% slower step (5000 -> 6400 us) regresses.
  const auto base = bucket_sweep_report(1000, 10, 10.0, 5000);
  auto now = bucket_sweep_report(1000, 10, 10.0, 6400);
  for (auto& row : now["results"]["caps"]) row["exposed_comm_time_us"] = 3025.0;  // inside its spread
  auto c = compare_reports(base, now);
  const auto* step = find_figure(c, "bucket_cap_mb=5", "step_time_us");
  const auto* exposed = find_figure(c, "bucket_cap_mb=5", "exposed_comm_time_us");
  REQUIRE(step);
  REQUIRE(exposed);
  CHECK(step->kind == ChangeKind::kRegressed);
  // No spread of its own: only the 0.25 us a timed call resolves.
  CHECK(step->noise == Approx(0.25 / 5000));
  CHECK(exposed->noise == Approx(30.0 / 3000.0));
  CHECK(c.regressed());
  // The tolerance is printed as given, not rounded to a tenth.
  CompareOptions tight;
  tight.max_regression = 0.0004;
  const auto t = compare_reports(base, base, tight);
  CHECK(render_comparison_text(t).find("worse by more than 0.04%") != std::string::npos);
  CHECK(render_comparison_markdown(t).find("tolerance: 0.04%") != std::string::npos);
  // Markdown that ends in an HTML block ends with a blank line, so that
  // whatever is appended after it (another comparison in the same step
  // summary) is read as Markdown again.
  const std::string md = render_comparison_markdown(t);
  CHECK(md.find("</details>") != std::string::npos);
  CHECK(md.size() >= 2);
  CHECK(md.substr(md.size() - 2) == "\n\n");
  const std::string page = render_markdown(base);
  CHECK(page.substr(page.size() - 2) == "\n\n");
}

TEST_CASE("compare: a time that grows out of a baseline of 0", "[reports][compare]") {
  auto base = bucket_sweep_report(1000, 10, 10.0, 5000);
  for (auto& row : base["results"]["caps"]) {
    row["exposed_comm_time_us"] = 0.0;  // communication hidden entirely
    row.erase("spread_us");
  }
  auto now = base;
  for (auto& row : now["results"]["caps"]) row["exposed_comm_time_us"] = 0.4;
  auto c = compare_reports(base, now, CompareOptions{});
  REQUIRE(find_figure(c, "bucket_cap_mb=5", "exposed_comm_time_us"));
  CHECK(find_figure(c, "bucket_cap_mb=5", "exposed_comm_time_us")->kind == ChangeKind::kNoise);
  CHECK_FALSE(c.regressed());
  for (auto& row : now["results"]["caps"]) row["exposed_comm_time_us"] = 50.0;
  c = compare_reports(base, now, CompareOptions{});
  CHECK(find_figure(c, "bucket_cap_mb=5", "exposed_comm_time_us")->kind == ChangeKind::kRegressed);
  CHECK(c.regressed());
}

TEST_CASE("compare: a rate gets the relative spread of the time it derives from", "[reports][compare]") {
  // comm_time_us 1000 +- 300 us in BASE; NEW is 25% slower and its bus
  // bandwidth 20% lower: both are inside the 30% band.
  const auto base = bucket_sweep_report(1000, 300, 10.0, 5000);
  const auto now = bucket_sweep_report(1250, 300, 8.0, 5000);
  CHECK(validate_report(base).empty());
  auto c = compare_reports(base, now);
  const auto* t = find_figure(c, "bucket_cap_mb=1", "comm_time_us");
  const auto* bw = find_figure(c, "bucket_cap_mb=1", "busbw_gbps");
  REQUIRE(t);
  REQUIRE(bw);
  CHECK(t->kind == ChangeKind::kNoise);
  CHECK(bw->kind == ChangeKind::kNoise);
  CHECK(bw->noise == Approx(t->noise));  // the same fraction: 30%
  CHECK(bw->noise == Approx(0.3));
  CHECK_FALSE(c.regressed());
  CHECK(render_comparison_text(c).find("±30.0%") != std::string::npos);
  // With a tight time spread the same drop regresses, time and rate alike.
  auto tight = compare_reports(bucket_sweep_report(1000, 10, 10.0, 5000), bucket_sweep_report(1250, 10, 8.0, 5000));
  CHECK(tight.regressed());
  CHECK(find_figure(tight, "bucket_cap_mb=1", "busbw_gbps")->kind == ChangeKind::kRegressed);
  CHECK(find_figure(tight, "bucket_cap_mb=1", "busbw_gbps")->noise == Approx(0.01));
  // Rows with the ranks' time spread keep it.
  std::vector<Point> noisy = {{1 << 20, 10.0, 70, 130}};
  auto a = allreduce_report(noisy);
  noisy[0].busbw_gbps = 8;
  CHECK(find_figure(compare_reports(a, allreduce_report(noisy)), "out_of_place", "busbw_gbps")->noise ==
        Approx(0.6));
}


namespace {

// A link-health report as the command writes it, with its all_reduce timing
// per rank; or, with error set, one that ended before measuring anything.
json link_health_full(double bandwidth_bytes, double allreduce_time_us, bool error = false) {
  Report r("link-health", {"ddpdiag", "link-health"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  if (error) {
    ErrorInfo e;
    e.kind = "rendezvous";
    e.message = "timed out waiting for rank 1";
    r.set_error(e);
    return r.finish();
  }
  r.results()["bandwidth_bytes"] = bandwidth_bytes;
  r.results()["allreduce_bytes"] = 1 << 20;
  r.results()["pairs"] = json::array({{{"src", 0}, {"dst", 1}, {"busbw_gbps", 1.5}, {"latency_us", 40.0}}});
  r.results()["allreduce"] = json::array({{{"rank", 0}, {"allreduce_time_us", allreduce_time_us}},
                                          {{"rank", 1}, {"allreduce_time_us", allreduce_time_us}}});
  r.add_check({"links", CheckStatus::kPass, "no slow pair"});
  return r.finish();
}

}  // namespace

TEST_CASE("compare: baseline runs of different settings are refused, whichever run comes first",
          "[reports][compare]") {
  const auto err = link_health_full(0, 0, true);
  REQUIRE(err["verdict"] == "ERROR");
  const auto k64 = link_health_full(64 << 10, 100), m1 = link_health_full(1 << 20, 500);
  CHECK(validate_report(err).empty());
  SECTION("a failed run first does not hide the others' difference") {
    const auto why = baselines_disagree({err, k64, m1, m1}, {"lh_err.json", "lh_64k.json", "lh.json", "lh2.json"});
    CHECK(why.find("bandwidth_bytes") != std::string::npos);
    CHECK(why.find("1 MiB (lh.json)") != std::string::npos);
    CHECK(why.find("64 KiB (lh_64k.json)") != std::string::npos);
    CHECK_FALSE(baselines_disagree({k64, err, m1}, {"a", "b", "c"}).empty());
    CHECK_FALSE(baselines_disagree({m1, k64}, {"a", "b"}).empty());
    CHECK(baselines_disagree({err, m1, m1}, {"a", "b", "c"}).empty());
  }
  SECTION("each run's rows carry its own settings") {
    // Merged anyway (the library has no refusal): the 1 MiB runs' rows are
    // keyed and labelled 1 MiB, and match NEW's; the 64 KiB run's are missing.
    auto c = compare_reports(std::vector<json>{err, k64, m1, m1}, m1);
    CHECK_FALSE(c.regressed());
    for (const auto& f : c.figures) {
      if (f.row.find("bandwidth_bytes=64 KiB") != std::string::npos) CHECK(f.kind == ChangeKind::kMissing);
      if (f.kind == ChangeKind::kUnchanged) CHECK(f.row.find("64 KiB") == std::string::npos);
    }
    const auto* pair = find_figure(c, "src=0 dst=1", "busbw_gbps");
    REQUIRE(pair);
    CHECK(pair->kind == ChangeKind::kUnchanged);
    CHECK(pair->row.find("bandwidth_bytes=1 MiB") != std::string::npos);
  }
}


namespace {

// An init-check report: per rank, the phases of its start with their durations.
json init_check_report(double backend_init_ms) {
  Report r("init-check", {"ddpdiag", "init-check"});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  r.results()["ranks"] = json::array();
  for (int rank : {0, 1})
    r.results()["ranks"].push_back(
        {{"rank", rank},
         {"host", "h"},
         {"error", nullptr},
         {"phases", json::array({{{"name", "store_connect"}, {"duration_ms", 0.25}, {"status", "ok"}},
                                 {{"name", "backend_init"}, {"duration_ms", backend_init_ms}, {"status", "ok"}}})}});
  r.add_check({"init", CheckStatus::kPass, "every rank started"});
  return r.finish();
}

}  // namespace

TEST_CASE("compare: link-health's all_reduce time and init-check's phase durations are gated",
          "[reports][compare]") {
  SECTION("link-health allreduce_time_us") {
    auto c = compare_reports(link_health_full(1 << 20, 500), link_health_full(1 << 20, 1500));
    CHECK(c.regressed());
    const auto* f = find_figure(c, "rank=0", "allreduce_time_us");
    REQUIRE(f);
    CHECK(f->kind == ChangeKind::kRegressed);
    CHECK_FALSE(f->higher_is_better);
    CHECK(c.rows(ChangeKind::kRegressed) == 2);
    CHECK_FALSE(compare_reports(link_health_full(1 << 20, 500), link_health_full(1 << 20, 400)).regressed());
  }
  SECTION("init-check duration_ms per rank and phase") {
    const auto base = init_check_report(140);
    CHECK(validate_report(base).empty());
    auto same = compare_reports(base, base);
    CHECK(same.rows(ChangeKind::kUnchanged) == 4);  // 2 ranks x 2 phases
    // A phase's jitter under 100 ms is noise, even many times its length
    // (two runs back to back: a 0.01 ms handshake took 0.08 ms).
    auto jitter = compare_reports(init_check_report(0.01), init_check_report(80));
    CHECK_FALSE(jitter.regressed());
    CHECK(jitter.rows(ChangeKind::kNoise) == 2);
    CHECK(compare_reports(init_check_report(0), init_check_report(150)).regressed());
    auto c = compare_reports(base, init_check_report(420));
    CHECK(c.regressed());
    CHECK(c.rows(ChangeKind::kRegressed) == 2);
    CHECK(c.rows(ChangeKind::kUnchanged) == 2);
    const auto* f = find_figure(c, "rank=1 name=backend_init", "duration_ms");
    REQUIRE(f);
    CHECK(f->kind == ChangeKind::kRegressed);
    CHECK(f->change == Approx(2.0));
    // A phase missing from NEW is a missing row, not a silent pass.
    auto now = base;
    now["results"]["ranks"][1]["phases"].erase(1);
    auto m = compare_reports(base, now);
    CHECK(m.rows(ChangeKind::kMissing) == 1);
    CHECK(compare_reports(base, now, {0.10, true}).regressed());
  }
  SECTION("odd phase entries are skipped, never thrown on") {
    auto odd = init_check_report(14);
    odd["results"]["ranks"][0]["phases"] = "none";
    odd["results"]["ranks"][1]["phases"][0] = 5;
    odd["results"]["ranks"][1]["phases"][1]["duration_ms"] = "slow";
    odd["results"]["ranks"][1]["phases"][1]["name"] = json::array({1});
    CHECK_NOTHROW(compare_reports(init_check_report(14), odd));
    CHECK_NOTHROW(compare_reports(odd, init_check_report(14)));
    CHECK_NOTHROW(render_comparison_text(compare_reports(odd, odd)));
  }
}


TEST_CASE("compare: a row with a regressed figure counts as regressed, even with one missing",
          "[reports][compare]") {
  const auto base = bucket_sweep_report(1000, 10, 10.0, 5000);
  auto now = bucket_sweep_report(1000, 10, 10.0, 15000);
  for (auto& row : now["results"]["caps"]) row.erase("comm_time_us");
  auto c = compare_reports(base, now);
  CHECK(c.regressed());
  CHECK(c.rows(ChangeKind::kRegressed) == 3);
  CHECK(c.rows(ChangeKind::kMissing) == 0);
  const auto text = render_comparison_text(c);
  CHECK(text.find("rows: 0 improved, 3 regressed, 0 unchanged, 0 within noise, 0 missing, 0 new") !=
        std::string::npos);
  CHECK(text.find("result: REGRESSION (3 regressed figure(s))") != std::string::npos);
  CHECK(render_comparison_markdown(c).find("| 0 | 3 | 0 | 0 | 0 | 0 |") != std::string::npos);
  // A missing figure beside unchanged ones still makes the row missing.
  auto gone = base;
  for (auto& row : gone["results"]["caps"]) row.erase("comm_time_us");
  CHECK(compare_reports(base, gone).rows(ChangeKind::kMissing) == 3);
}


TEST_CASE("compare: --max-regression takes only a plain decimal number", "[reports][compare]") {
  for (const char* bad : {"0x10", "0x10%", "1e1", "1e1%", "inf", "nan", "+10", "10.5.1", ".", "%", "", "10%%",
                          "0X1A", "1_0", "10 percent"}) {
    INFO(bad);
    CHECK_THROWS_AS(parse_percentage(bad), std::invalid_argument);
  }
  CHECK_THROWS_WITH(parse_percentage("0x10"), Catch::Contains("plain decimal number") && Catch::Contains("10%"));
  CHECK(parse_percentage("10") == Approx(0.10));
  CHECK(parse_percentage("10%") == Approx(0.10));
  CHECK(parse_percentage(" 10% ") == Approx(0.10));
  CHECK(parse_percentage("12.5%") == Approx(0.125));
  CHECK(parse_percentage("5.") == Approx(0.05));
  CHECK(parse_percentage(".5%") == Approx(0.005));
  CHECK(parse_percentage("016") == Approx(0.16));
}

TEST_CASE("compare: fields of the wrong JSON type are skipped, never thrown on", "[reports][compare]") {
  const auto base = allreduce_report(baseline_points());
  auto odd = base;
  odd["schema"] = 1;
  odd["command"] = json::array({"allreduce-test"});
  odd["world"]["size"] = "two";
  odd["world"]["backend"] = 5;
  odd["checks"][0]["name"] = 7;
  odd["checks"][0]["status"] = json::object();
  odd["results"]["collective"] = 3;
  odd["results"]["sizes"][0]["bytes"] = json::array({1024});
  odd["results"]["sizes"][1]["out_of_place"]["busbw_gbps"] = "fast";
  odd["results"]["sizes"][2] = "row";
  for (const auto& [a, b] : {std::pair{base, odd}, std::pair{odd, base}, std::pair{odd, odd}}) {
    CHECK_NOTHROW(render_comparison_text(compare_reports(a, b)));
    CHECK_NOTHROW(render_comparison_markdown(compare_reports(std::vector<json>{a, b, a}, b)));
    CHECK_NOTHROW(baselines_disagree({a, b}, {"a.json", "b.json"}));
  }
  // A figure that is not a number in NEW is missing, not an error.
  auto now = base;
  now["results"]["sizes"][1]["out_of_place"]["busbw_gbps"] = "fast";
  auto c = compare_reports(base, now);
  bool missing = false;
  for (const auto& f : c.figures)
    missing = missing || (f.figure == "busbw_gbps" && f.kind == ChangeKind::kMissing && f.base && !f.now);
  CHECK(missing);
}

// ---------------------------------------------------------------- renderers

TEST_CASE("markdown: title with verdict, context, checks and results", "[reports][render]") {
  auto md = render_markdown(allreduce_report(baseline_points()));
  CHECK(md.find("## ddpdiag allreduce-test: ✅ PASS") != std::string::npos);
  CHECK(md.find("| backend | gloo |") != std::string::npos);
  CHECK(md.find("### Checks") != std::string::npos);
  CHECK(md.find("| correctness | ✅ pass |") != std::string::npos);
  CHECK(md.find("#### Sizes (all_reduce)") != std::string::npos);
  CHECK(md.find("| 1 MiB |") != std::string::npos);
  CHECK(md.find("<summary>Environment (2 variables)</summary>") != std::string::npos);
  CHECK(md.find("### Error") == std::string::npos);

  Report died("allreduce-test", {"ddpdiag", "allreduce-test"});
  died.set_error({"timeout", "all_reduce | stuck", "allreduce", 1, -1, "check rank 1", 4});
  auto emd = render_markdown(died.finish());
  CHECK(emd.find("💥 ERROR") != std::string::npos);
  CHECK(emd.find("### Error") != std::string::npos);
  CHECK(emd.find("all_reduce | stuck") != std::string::npos);  // lists are not tables: no escaping needed
  CHECK(emd.find("unknown (the run ended before it knew its world)") != std::string::npos);

  // A run that failed in the rendezvous knew only some of its ranks: the
  // context says so rather than put the whole world on their hosts.
  Report early("allreduce-test", {"ddpdiag", "allreduce-test"});
  early.set_world(4, "gloo", "flags", {{0, 0, "node0", 42, "cpu", ""}, {1, 1, "node0", 43, "cpu", ""}},
                  {{"gloo", "gloo 0.5.0"}});
  early.set_error({"rendezvous", "rank(s) 2, 3 never arrived", "rendezvous", 0, 2, "check the network", 3});
  auto pmd = render_markdown(early.finish());
  INFO(pmd);
  CHECK(pmd.find("| world | 4 rank(s), 2 of them known (the run ended before the rendezvous completed), "
                 "on 1 host(s) |") != std::string::npos);
  CHECK(render_markdown(allreduce_report(baseline_points())).find("rank(s) on 1 host(s)") != std::string::npos);
}

TEST_CASE("render: warnings stand beside the checks, not among the results", "[reports][render]") {
  auto j = allreduce_report(baseline_points());
  CHECK(render_markdown(j).find("### Warnings") == std::string::npos);  // none, no section
  j["results"]["warnings"] = nlohmann::json::array(
      {{{"name", "slower_interface"}, {"detail", "rank 2 on b sends over eno1 (1 Gb/s), but ens5 ..."}}});
  const auto md = render_markdown(j);
  INFO(md);
  const auto at = md.find("### Warnings");
  REQUIRE(at != std::string::npos);
  CHECK(at > md.find("### Checks"));
  CHECK(at < md.find("### Results"));
  CHECK(md.find("| ⚠️ slower_interface | rank 2 on b sends over eno1 (1 Gb/s), but ens5 ... |") != std::string::npos);
  CHECK(md.find("#### warnings") == std::string::npos);
  const auto html = render_html(j);
  CHECK(html.find("<h2>Warnings</h2>") != std::string::npos);
  CHECK(html.find("slower_interface") != std::string::npos);
}

TEST_CASE("html: self-contained page with a bandwidth chart", "[reports][render]") {
  auto r = allreduce_report(baseline_points());
  r["argv"].push_back("<script>alert(1)</script>");
  auto html = render_html(r);
  CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
  CHECK(html.find("name=\"viewport\"") != std::string::npos);
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("&lt;script&gt;") != std::string::npos);
  CHECK(html.find(" src=") == std::string::npos);
  CHECK(html.find(" href=") == std::string::npos);
  CHECK(html.find("<svg class=\"chart\" viewBox=") != std::string::npos);
  CHECK(html.find("Bus bandwidth vs message size — all_reduce") != std::string::npos);
  CHECK(html.find("message size (bytes, log scale)") != std::string::npos);
  CHECK(html.find("bus bandwidth (GB/s)") != std::string::npos);
  CHECK(html.find("float sum out-of-place") != std::string::npos);
  CHECK(html.find("verdict v-PASS") != std::string::npos);
  CHECK(html.find("<h2>Checks</h2>") != std::string::npos);
}

TEST_CASE("html: charts for bucket-sweep, link-health, memory and init-check results", "[reports][render]") {
  auto report = [](const std::string& command, json results) {
    Report r(command, {"ddpdiag", command});
    r.set_world(2, "nccl", "torchrun", {{0, 0, "a", 1, "cuda:0", ""}, {1, 1, "a", 2, "cuda:1", ""}}, {{"nccl", "2.28.3"}});
    r.results() = std::move(results);
    auto j = r.finish();
    INFO(command << "\n" << dump(validate_report(j)));
    CHECK(validate_report(j).empty());
    return render_html(j);
  };
  auto sweep = report("bucket-sweep", {{"caps", {{{"bucket_cap_mb", 1}, {"exposed_comm_time_us", 900}},
                                                 {{"bucket_cap_mb", 25}, {"exposed_comm_time_us", 300}},
                                                 {{"bucket_cap_mb", 100}, {"exposed_comm_time_us", 500}}}},
                                        {"recommended_cap_mb", 25}});
  CHECK(sweep.find("Bucket sweep: exposed comm time vs bucket cap") != std::string::npos);
  CHECK(sweep.find("recommended: 25 MiB") != std::string::npos);
  CHECK(sweep.find("bucket_cap_mb (MiB)") != std::string::npos);

  auto links = report("link-health", {{"ranks", 2}, {"busbw_gbps", {{nullptr, 10.0}, {2.0, nullptr}}}, {"slow_pairs", {{1, 0}}}});
  CHECK(links.find("Link health: bandwidth between ranks") != std::string::npos);
  CHECK(links.find("slow pair") != std::string::npos);
  CHECK(links.find("stroke=\"#d00000\"") != std::string::npos);
  CHECK(links.find("every pair") == std::string::npos);
  // Every pair the same (two ranks): the legend names that one value, not a
  // range that was never measured.
  auto even = report("link-health", {{"ranks", 2}, {"busbw_gbps", {{nullptr, 1.02}, {1.02, nullptr}}}, {"slow_pairs", json::array()}});
  CHECK(even.find("every pair 1.02") != std::string::npos);
  CHECK(even.find(">2.02<") == std::string::npos);

  auto mem = report("memory", {{"ranks", {{{"rank", 0}, {"categories", {{"buffers", 1 << 20}, {"workspace", 1 << 21}}}},
                                          {{"rank", 1}, {"categories", {{"buffers", 1 << 20}}}}}}});
  CHECK(mem.find("Memory per rank") != std::string::npos);
  CHECK(mem.find("memory (MiB)") != std::string::npos);

  auto init = report("init-check", {{"ranks", {{{"rank", 0}, {"phases", {{{"name", "store"}, {"start_s", 0}, {"end_s", 0.2}},
                                                                           {{"name", "backend"}, {"start_s", 0.2}, {"end_s", 1.5}}}}},
                                               {{"rank", 1}, {"phases", {{{"name", "store"}, {"duration_s", 0.4}}}}}}}});
  CHECK(init.find("Initialisation timeline per rank") != std::string::npos);
  CHECK(init.find("time since start (s)") != std::string::npos);
}

namespace {

json rendered_report(const std::string& command, json results) {
  Report r(command, {"ddpdiag", command});
  r.set_world(2, "gloo", "ddpdiag", {{0, 0, "a", 1, "cpu", ""}, {1, 1, "a", 2, "cpu", ""}}, {{"gloo", "0.5.0"}});
  r.results() = std::move(results);
  return r.finish();
}

// The text of one "#### title" block of the Markdown, up to the next heading.
std::string md_block(const std::string& md, const std::string& title) {
  auto at = md.find("#### " + title + "\n");
  if (at == std::string::npos) return "";
  auto end = md.find("\n#", at + 5);
  return md.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

}  // namespace

TEST_CASE("render: dp-vs-ring rows name the algorithm and show traffic against theory", "[reports][render]") {
  json sizes = json::array();
  for (const char* algo : {"gather", "ring", "backend"}) {
    json row = {{"collective", "all_reduce"}, {"algorithm", algo}, {"world_size", 2}, {"bytes", 65536},
                {"count", 16384}, {"dtype", "float"}, {"op", "sum"}, {"out_of_place", nullptr},
                {"in_place", block({65536, 1.0, 99, 101})}};
    if (std::string(algo) == "gather") {
      row["rank0_bytes_moved"] = 131072;
      row["max_other_bytes_moved"] = 131072;
      row["rank0_extra_bytes"] = 65536;
      row["max_other_extra_bytes"] = 0;
      row["traffic_matches_theory"] = true;
      row["extra_memory_matches_theory"] = true;
      row["ranks"] = {{{"rank", 0}, {"theory_bytes_sent", 65536}, {"theory_bytes_received", 65536}, {"theory_extra_bytes", 65536}},
                      {{"rank", 1}, {"theory_bytes_sent", 65536}, {"theory_bytes_received", 65536}, {"theory_extra_bytes", 0}}};
    }
    sizes.push_back(row);
  }
  auto j = rendered_report("dp-vs-ring", {{"collective", "all_reduce"}, {"sizes", sizes}});
  auto md = render_markdown(j);
  auto t = md_block(md, "Sizes (all_reduce)");
  INFO(t);
  for (const char* h : {"| algorithm |", "| n |", "| rank0 moved |", "| max other moved |", "| rank0 moved (theory) |",
                        "| rank0 extra mem |", "| max other extra mem (theory) |", "| traffic = theory |"})
    CHECK(has(t, h));
  CHECK(has(t, "| 64 KiB | gather | 2 |"));
  CHECK(has(t, "| 64 KiB | ring | 2 |"));
  CHECK(has(t, "| 64 KiB | backend | 2 |"));
  CHECK(has(t, "| 128 KiB | 128 KiB | 128 KiB | 128 KiB | 64 KiB | 64 KiB | 0 B | 0 B | yes | yes |"));
  CHECK_FALSE(has(t, "out-of-place"));  // none measured: no empty columns
  auto html = render_html(j);
  CHECK(has(html, "<th>algorithm</th>"));
  CHECK(has(html, "<th>rank0 moved</th>"));
  CHECK(has(html, "<td>ring</td>"));
}

TEST_CASE("render: link-health matrices are tables and every slow cell is outlined", "[reports][render]") {
  auto j = rendered_report("link-health", {{"ranks", 3},
                                           {"busbw_gbps", {{nullptr, 2.46, 9.0}, {2.46, nullptr, 9.0}, {9.0, 9.0, nullptr}}},
                                           {"latency_us", {{nullptr, 30.5, 10.0}, {30.5, nullptr, 10.0}, {10.0, 10.0, nullptr}}},
                                           {"slow_pairs", {{0, 1}}}});
  auto md = render_markdown(j);
  auto bw = md_block(md, "busbw_gbps matrix (GB/s)");
  INFO(md);
  CHECK(has(bw, "| src \\ dst (GB/s) | 0 | 1 | 2 |"));
  CHECK(has(bw, "| 0 | — | 2.46 (slow) | 9 |"));
  CHECK(has(bw, "| 1 | 2.46 (slow) | — | 9 |"));
  CHECK(has(md_block(md, "latency_us matrix (µs)"), "| 0 | — | 30.5 (slow) | 10 |"));
  CHECK_FALSE(has(md, "[["));
  CHECK_FALSE(has(md, "[null"));
  auto html = render_html(j);
  CHECK_FALSE(has(html, "[["));
  CHECK(has(html, "<th>src \\ dst (GB/s)</th>"));
  CHECK(has(html, "<td class=\"n\">—</td>"));
  // Both cells of the slow link 0-1 (0->1 and 1->0) carry the red outline.
  std::size_t outlines = 0;
  for (auto at = html.find("fill=\"none\" stroke=\"#d00000\" stroke-width=\"3\""); at != std::string::npos;
       at = html.find("fill=\"none\" stroke=\"#d00000\" stroke-width=\"3\"", at + 1))
    ++outlines;
  CHECK(outlines == 3);  // two cells and the legend swatch
}

TEST_CASE("render: a pair slow by one figure is marked in that figure's matrix only", "[reports][render]") {
  auto j = rendered_report(
      "link-health",
      {{"ranks", 3},
       {"busbw_gbps", {{nullptr, 0.7, 9.0}, {0.7, nullptr, 9.0}, {9.0, 9.0, nullptr}}},
       {"latency_us", {{nullptr, 56.4, 10.0}, {56.4, nullptr, 900.0}, {10.0, 900.0, nullptr}}},
       {"slow_pairs", {{0, 1}, {1, 2}}},
       {"pairs", {{{"src", 0}, {"dst", 1}, {"slow", true}, {"slow_bandwidth", true}, {"slow_latency", false}},
                  {{"src", 1}, {"dst", 2}, {"slow", true}, {"slow_bandwidth", false}, {"slow_latency", true}},
                  {{"src", 0}, {"dst", 2}, {"slow", false}, {"slow_bandwidth", false}, {"slow_latency", false}}}}});
  auto md = render_markdown(j);
  INFO(md);
  auto bw = md_block(md, "busbw_gbps matrix (GB/s)");
  CHECK(has(bw, "| 0 | — | 0.7 (slow) | 9 |"));
  CHECK(has(bw, "| 1 | 0.7 (slow) | — | 9 |"));
  auto lat = md_block(md, "latency_us matrix (µs)");
  CHECK(has(lat, "| 0 | — | 56.4 | 10 |"));
  CHECK(has(lat, "| 1 | 56.4 | — | 900 (slow) |"));
}

TEST_CASE("render: a nested table keeps its items' own rank and names the parent row", "[reports][render]") {
  // broadcast-test: rows per chunk size, each listing the ranks whose
  // parameters differed. The rank column is the mismatch's rank, and the
  // chunk size says which row it came from.
  json rows = json::array();
  rows.push_back({{"chunk_bytes", 1048576}, {"bytes", 7454760}, {"identical", false},
                  {"mismatches", {{{"rank", 3}, {"tensor", 2}, {"name", "2.weight"}, {"wrong_iterations", 2}}}}});
  rows.push_back({{"chunk_bytes", 4194304}, {"bytes", 7454760}, {"identical", false},
                  {"mismatches", {{{"rank", 1}, {"tensor", 0}, {"name", "0.weight"}, {"wrong_iterations", 1}}}}});
  auto j = rendered_report("broadcast-test", {{"rows", rows}});
  auto md = render_markdown(j);
  INFO(md);
  auto t = md_block(md, "rows: mismatches");
  CHECK(has(t, "| chunk_bytes | name | rank | tensor | wrong_iterations |"));
  CHECK(has(t, "| 1048576 | 2.weight | 3 | 2 | 2 |"));
  CHECK(has(t, "| 4194304 | 0.weight | 1 | 0 | 1 |"));
}

TEST_CASE("render: memory per rank shows each category as a column in bytes", "[reports][render]") {
  json ranks = json::array();
  for (int r = 0; r < 2; ++r)
    ranks.push_back({{"rank", r}, {"host", "a"},
                     {"categories", {{"parameters", 7454760}, {"gradients", 7454760}, {"buckets", 7454760}, {"workspace", 1 << 20}}},
                     {"category_peak_bytes", {{"parameters", 7454760}, {"buckets", 7454760}}},
                     {"total_bytes", 23412424}, {"peak_bytes", 23412424}, {"device", {{"free_bytes", 1 << 30}}}});
  auto j = rendered_report("memory", {{"model", "mlp"}, {"ranks", ranks}});
  auto md = render_markdown(j);
  auto t = md_block(md, "ranks");
  INFO(t);
  CHECK(has(t, "| rank | buckets | gradients | parameters | workspace | peak buckets | peak parameters |"));
  CHECK(has(t, "| 0 | 7.11 MiB | 7.11 MiB | 7.11 MiB | 1 MiB | 7.11 MiB | 7.11 MiB |"));
  CHECK(has(t, "22.3 MiB"));  // total_bytes
  CHECK(has(t, "| device.free_bytes |"));
  CHECK(has(t, "| 1 GiB |"));
  CHECK_FALSE(has(t, "{\""));
  auto html = render_html(j);
  CHECK_FALSE(has(html, "{&quot;"));
  CHECK(has(html, "<th>peak buckets</th>"));
}

TEST_CASE("render: init-check timeline, rank errors and start times", "[reports][render]") {
  json phases = {{{"name", "store_connect"}, {"start_s", 0.0}, {"end_s", 0.25}, {"duration_ms", 250.0}, {"status", "ok"},
                  {"detail", "connected"}, {"hint", ""}},
                 {{"name", "wait_for_ranks"}, {"start_s", 0.25}, {"end_s", 5.25}, {"duration_ms", 5000.0},
                  {"status", "fail"}, {"detail", "1 of 2 arrived"}, {"hint", "check rank 1"}}};
  json ranks = {{{"rank", 0}, {"host", "a"}, {"phases", phases}, {"started_unix_s", 1796000000.25},
                 {"error", {{"kind", "timeout"}, {"message", "rank 1 never arrived"}, {"phase", "wait_for_ranks"},
                            {"hint", "is rank 1 started?"}, {"peer", 1}, {"exit_code", 4}}}},
                {{"rank", 1}, {"host", nullptr}, {"phases", json::array()}, {"error", nullptr}}};
  auto j = rendered_report("init-check", {{"ranks", ranks}, {"timeout_s", 5}});
  auto md = render_markdown(j);
  INFO(md);
  auto tl = md_block(md, "ranks: timeline");
  CHECK(has(tl, "| rank | phase | start (s) | duration (ms) | status | detail |"));
  CHECK(has(tl, "| 0 | store_connect | 0.000 | 250.0 | ok | connected |"));
  CHECK(has(tl, "| 0 | wait_for_ranks | 0.250 | 5000.0 | fail | 1 of 2 arrived (hint: check rank 1) |"));
  auto rk = md_block(md, "ranks");
  CHECK(has(rk, "timeout: rank 1 never arrived (hint: is rank 1 started?)"));
  CHECK(has(rk, "2026-11-30T"));
  CHECK(has(rk, ".250Z"));
  CHECK_FALSE(has(rk, "values"));
  CHECK_FALSE(has(rk, "e+09"));
  CHECK_FALSE(has(md, "{\""));
  auto html = render_html(j);
  CHECK(has(html, "<th>phase</th>"));
  CHECK(has(html, "timeout: rank 1 never arrived (hint: is rank 1 started?)"));
}

TEST_CASE("render: the watchdog's diagnosis, flight recorder and rank states", "[reports][render]") {
  json coll = {{"op", "all_reduce"}, {"dtype", "float"}, {"count", 256}, {"reduce_op", "sum"}, {"root", -1},
               {"text", "all_reduce(float, 256, sum)"}};
  json recorder = {{{"seq", 2}, {"collective", coll}, {"started_s", 0.5}, {"duration_ms", 1.5}, {"state", "completed"}},
                   {{"seq", 3}, {"collective", coll}, {"started_s", 0.6}, {"duration_ms", 4012.0}, {"state", "started"}}};
  json watchdog = {{"diagnosis", {{"gone_ranks", json::array()}, {"behind_ranks", {1}}, {"mismatches", json::array()},
                                  {"stuck_seq", 3}, {"findings", {"Rank 1 behind."}}, {"summary", "Rank 1 behind."}}},
                   {"cause", "collective #3: no result within 4000 ms"},
                   {"detected_by", "watchdog"},
                   {"flight_recorder", recorder},
                   {"ranks", {{{"rank", 0}, {"host", "a"}, {"pid", 10}, {"last_started_seq", 3}, {"last_completed_seq", 2},
                               {"reason", "timeout"}, {"flight_recorder", recorder}},
                              {{"rank", 1}, {"host", "a"}, {"pid", 11}, {"last_started_seq", 2}, {"last_completed_seq", 2},
                               {"reason", "alarm raised by rank 0"}, {"flight_recorder", json::array()}}}}};
  auto j = rendered_report("allreduce-test", {{"collective", "all_reduce"}, {"watchdog", watchdog}});
  auto md = render_markdown(j);
  INFO(md);
  CHECK(has(md_block(md, "Watchdog"), "| summary | Rank 1 behind. |"));
  CHECK(has(md_block(md, "Watchdog"), "| stuck_seq | 3 |"));
  auto fr = md_block(md, "Watchdog: flight recorder");
  CHECK(has(fr, "| seq | collective | state | started (s) | duration (ms) |"));
  CHECK(has(fr, "| 3 | all_reduce(float, 256, sum) | started | 0.6 | 4012 |"));
  auto rs = md_block(md, "Watchdog: rank states");
  CHECK(has(rs, "| rank | host | pid | last started | last completed | reason |"));
  CHECK(has(rs, "| 1 | a | 11 | 2 | 2 | alarm raised by rank 0 |"));
  CHECK_FALSE(has(md, "{\""));
  auto html = render_html(j);
  CHECK(has(html, "<h2>Results: Watchdog: flight recorder</h2>"));
  CHECK_FALSE(has(html, "{&quot;"));
}

TEST_CASE("render: Markdown escapes what the report supplies", "[reports][render]") {
  auto j = rendered_report("buckets", {{"model", "<img src=http://evil.example/x.png>"},
                                       {"buckets", {{{"index", 0}, {"tensors", "a|b"}, {"first", "`code"}}}}});
  j["error"] = {{"kind", "usage"}, {"message", "bad <b>name</b> & | `x`"}};
  j["argv"] = {"ddpdiag", "buckets", "--model", "a|b`c"};
  auto md = render_markdown(j);
  INFO(md);
  CHECK_FALSE(has(md, "<img"));
  CHECK_FALSE(has(md, "<b>"));
  CHECK(has(md, "&lt;img src=http://evil.example/x.png&gt;"));
  CHECK(has(md, "| a\\|b |"));
  CHECK(has(md, "| \\`code |"));
  CHECK(has(md, "bad &lt;b&gt;name&lt;/b&gt; &amp; | \\`x\\`"));
  CHECK(has(md, "| command line | ``ddpdiag buckets --model a\\|b`c`` |"));
  auto html = render_html(j);
  CHECK_FALSE(has(html, "<img"));
  CHECK(has(html, "&lt;img src=http://evil.example/x.png&gt;"));
}

TEST_CASE("renderers never throw on odd input", "[reports][render]") {
  for (const json& j : {json::array(), json(nullptr), json{{"results", 5}}, json{{"results", {{"sizes", {1, "x"}}}}},
                        json{{"world", {{"ranks", "no"}}}, {"checks", {1}}, {"error", "x"}}}) {
    CHECK_NOTHROW(render_markdown(j));
    CHECK_NOTHROW(render_html(j));
    CHECK_NOTHROW(compare_reports(j, j));
  }
}

TEST_CASE("report schema: every command ddpdiag has or plans is accepted, others are not", "[reports][schema]") {
  for (const char* command : {"allreduce-test", "buckets", "sampler", "bucket-sweep", "dp-vs-ring", "memory",
                              "link-health", "init-check", "broadcast-test", "ddp-step"}) {
    Report r(command, {"ddpdiag", command});
    if (std::string(command) == "buckets")
      r.results() = {{"model", "m"}, {"bucket_cap_bytes", 1}, {"bucket_count", 0}, {"buckets", json::array()}};
    if (std::string(command) == "sampler")
      r.results() = {{"dataset_size", 10}, {"world_size", 2}, {"rank", 0}, {"epoch", 0}, {"count", 5}};
    if (std::string(command) == "allreduce-test")
      r.set_error({"usage", "bad flag", "flags", 0, -1, "", 2});  // partial results are fine on ERROR
    auto j = r.finish();
    INFO(command << "\n" << dump(validate_report(j)));
    CHECK(validate_report(j).empty());
  }
  Report unknown("no-such-command", {"ddpdiag"});
  CHECK(has_error_at(validate_report(unknown.finish()), "/command", "/enum"));
}

// Rendering that must end: run in a child process with a deadline (and,
// outside the sanitizers, a memory limit), so a renderer that loops or
// crashes fails this test instead of hanging or killing the test binary.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <functional>

#include "comm/json_bounded.h"
#include "reports/format.h"

namespace {

// No coordinate of a drawing is NaN or infinite.
bool finite_drawing(const std::string& html) {
  return !has(html, "=\"nan\"") && !has(html, "=\"inf\"") && !has(html, "=\"-inf\"") && !has(html, "=\"-nan\"");
}

// "exit 0" when fn returned within the deadline; otherwise what happened.
std::string outcome_in_child(const std::function<void()>& fn, unsigned seconds = 30) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    // The test framework's handlers would report the crash as the child's
    // own test run; the parent reports it instead.
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) std::signal(sig, SIG_DFL);
    ::alarm(seconds);
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
    const rlimit as{rlim_t{2} << 30, rlim_t{2} << 30};  // 2 GiB
    ::setrlimit(RLIMIT_AS, &as);
#endif
    try {
      fn();
    } catch (...) {
      ::_exit(3);
    }
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFEXITED(status)) return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "signal " + std::to_string(WTERMSIG(status));
  return "?";
}

}  // namespace

TEST_CASE("render: charts end when a tick step is below a bound's precision or overflows", "[reports][render]") {
  // Caps a ulp apart (25 and 25.000000000000004; 999999.9999999999 and 1e6):
  // the tick step is too small to advance the bound it is added to.
  for (const auto& [a, b] : {std::pair{25.0, 25.000000000000004}, std::pair{999999.9999999999, 1e6}}) {
    INFO(a << " " << b);
    json caps = {{{"bucket_cap_mb", a}, {"exposed_comm_time_us", 10.0}, {"step_time_us", 20.0}},
                 {{"bucket_cap_mb", b}, {"exposed_comm_time_us", 11.0}, {"step_time_us", 21.0}}};
    auto j = rendered_report("bucket-sweep", {{"caps", caps}, {"recommended_cap_mb", a}});
    REQUIRE(outcome_in_child([&] { render_html(j); }) == "exit 0");
    CHECK(finite_drawing(render_html(j)));
  }
  // A phase ending at 1.79e308 s: the step past the last tick overflows.
  json phases = {{{"name", "rendezvous"}, {"start_s", 0.0}, {"end_s", 1.79e308}}};
  auto init = rendered_report("init-check", {{"ranks", {{{"rank", 0}, {"phases", phases}}}}});
  REQUIRE(outcome_in_child([&] { render_html(init); }) == "exit 0");
  auto html = render_html(init);
  CHECK(has(html, "Initialisation timeline per rank"));
  CHECK(finite_drawing(html));
  // Memory bars whose sum is past DBL_MAX, bandwidths near it.
  auto mem = rendered_report("memory", {{"ranks", {{{"rank", 0}, {"categories", {{"a", 1.7e308}, {"b", 1.7e308}}}}}}});
  CHECK(outcome_in_child([&] { render_html(mem); }) == "exit 0");
  json sizes = {{{"bytes", 1024}, {"busbw_gbps", 1.7e308}}, {{"bytes", 1024}, {"busbw_gbps", 1.0}}};
  auto bw = rendered_report("dp-vs-ring", {{"sizes", sizes}});
  CHECK(outcome_in_child([&] { render_html(bw); }) == "exit 0");
  // An ordinary range still gets its ticks.
  json ok_caps = {{{"bucket_cap_mb", 10}, {"exposed_comm_time_us", 10.0}},
                  {{"bucket_cap_mb", 15}, {"exposed_comm_time_us", 8.0}},
                  {{"bucket_cap_mb", 25}, {"exposed_comm_time_us", 9.0}}};
  auto ok = render_html(rendered_report("bucket-sweep", {{"caps", ok_caps}}));
  CHECK(has(ok, ">25</text>"));
  CHECK(has(ok, ">10</text>"));
}

TEST_CASE("render: link-health pairs naming ranks outside the run are not drawn", "[reports][render]") {
  auto pair = [](json src, json dst) {
    return json{{"src", src}, {"dst", dst}, {"busbw_gbps", 2.0}, {"slow", true}};
  };
  for (const auto& [src, dst] : {std::pair<json, json>{-1, 1}, {0, 2147483647}, {0, 200000},
                                 {0, 4294967296LL}, {0, 18446744073709551615ULL}}) {
    INFO(src.dump() << " -> " << dst.dump());
    json pairs = {pair(src, dst), pair(0, 1)};
    auto j = rendered_report("link-health", {{"ranks", 2}, {"pairs", pairs}, {"slow_pairs", {{src, dst}}}});
    REQUIRE(outcome_in_child([&] { render_html(j); }) == "exit 0");
    REQUIRE(outcome_in_child([&] { render_markdown(j); }) == "exit 0");
    auto html = render_html(j);
    CHECK(has(html, "Link health: bandwidth between ranks"));
    CHECK(has(html, "from rank 0 -> 1: 2</title>"));  // the valid pair, in a 2 x 2 grid
    CHECK(has(html, "from rank 1 -> 0: 2</title>"));
    CHECK_FALSE(has(html, "-> 2:"));
    // The schema refuses the rank where it is negative.
    if (src == -1) CHECK(has_error_at(validate_report(j), "/results/pairs/0/src", "/minimum"));
  }
  // Without results.ranks, pairs past 4096 ranks are not drawn either.
  auto far = rendered_report("link-health", {{"pairs", {pair(0, 1), pair(1, 100000)}}});
  REQUIRE(outcome_in_child([&] { render_html(far); }) == "exit 0");
  CHECK(has(render_html(far), "from rank 0 -> 1: 2</title>"));
  CHECK_FALSE(has(render_html(far), "-> 2:"));
  // A report link-health writes still validates.
  auto good = rendered_report("link-health", {{"ranks", 2}, {"pairs", {pair(0, 1)}}});
  INFO(dump(validate_report(good)));
  CHECK(validate_report(good).empty());
  auto bad = good;
  bad["results"]["pairs"][0]["dst"] = -3;
  CHECK(has_error_at(validate_report(bad), "/results/pairs/0/dst", "/minimum"));
}

TEST_CASE("render: Markdown link and image and emphasis syntax from a report stays text", "[reports][render]") {
  auto j = rendered_report("buckets", {{"model", "evil ![i](https://example.invalid/t.png)"},
                                       {"buckets", {{{"index", 0}, {"tensors", "*a* _b_ \\[c](d)"}}}}});
  j["world"]["hosts"] = {"[l](javascript:alert(1))"};
  j["world"]["ranks"][0]["host"] = "[l](javascript:alert(1))";
  auto md = render_markdown(j);
  INFO(md);
  CHECK_FALSE(has(md, "![i]("));
  CHECK_FALSE(has(md, "[l]("));
  CHECK(has(md, "evil \\!\\[i\\](https://example.invalid/t.png)"));
  CHECK(has(md, "\\[l\\](javascript:alert(1))"));
  CHECK(has(md, "\\*a\\* \\_b\\_ \\\\\\[c\\](d)"));
  // Every table row still has as many cells as its header.
  std::size_t header_pipes = 0;
  for (std::size_t at = 0, end; (end = md.find('\n', at)) != std::string::npos; at = end + 1) {
    std::string line = md.substr(at, end - at);
    if (line.empty() || line[0] != '|') {
      header_pipes = 0;
      continue;
    }
    std::size_t pipes = 0;
    for (std::size_t i = 0; i < line.size(); ++i)
      if (line[i] == '|' && (i == 0 || line[i - 1] != '\\')) ++pipes;
    if (header_pipes == 0) header_pipes = pipes;
    INFO(line);
    CHECK(pipes == header_pipes);
  }
  // Names inside words, and a lone backslash, read as before.
  CHECK(markdown_text("busbw_gbps src \\ dst") == "busbw_gbps src \\ dst");
  CHECK(markdown_text("_x_ a*b") == "\\_x\\_ a\\*b");
  CHECK(markdown_text("end\\") == "end\\\\");
  CHECK(markdown_text("~~s~~") == "\\~\\~s\\~\\~");
  // The compare summary too.
  auto c = compare_reports(j, j);
  c.base_label = "![i](https://example.invalid/t.png)";
  c.new_label = "[l](javascript:alert(1))";
  auto cmd = render_comparison_markdown(c);
  INFO(cmd);
  CHECK_FALSE(has(cmd, "![i]("));
  CHECK_FALSE(has(cmd, "[l]("));
}

TEST_CASE("format: large figures are written whole, not in exponent form", "[reports][render]") {
  CHECK(format_figure(12359680.0) == "12359680");
  CHECK(format_figure(56970000.7) == "56970001");
  CHECK(format_figure(2.5e15) == "2.5e+15");
  CHECK(format_figure(1234.5678) == "1235");
  CHECK(format_figure(0.00001234) == "1.234e-05");
  CHECK(format_cell(nlohmann::json(90520000.0)) == "90520000");
}

TEST_CASE("compare: a baseline that ended with an error before measuring anything has nothing to compare",
          "[reports][compare]") {
  // Interrupted before the first size: command line, world, no rows.
  Report interrupted("allreduce-test", {"ddpdiag", "allreduce-test"});
  interrupted.set_world(2, "gloo", "ddpdiag", {{0, 0, "h", 1, "cpu", ""}, {1, 1, "h", 2, "cpu", ""}}, {});
  interrupted.set_error({"interrupted", "stopped by SIGTERM", "allreduce", 0, -1, "", 143});
  const json k = interrupted.finish();
  const std::string why = measured_nothing(k);
  CHECK(why.find("its verdict is ERROR") != std::string::npos);
  CHECK(why.find("interrupted: stopped by SIGTERM") != std::string::npos);
  CHECK(why.find("measured no result row") != std::string::npos);
  // A line refused for its flags: no world either.
  Report usage("allreduce-test", {"ddpdiag", "allreduce-test", "-b", "1M", "-e", "1K"});
  usage.set_error({"usage", "-e 1K is below -b 1M", "flags", 0, -1, "", 2});
  CHECK_FALSE(measured_nothing(usage.finish()).empty());
  // What measured rows compares as before: a failed run, and one that
  // ended with an error part-way.
  CHECK(measured_nothing(allreduce_report(baseline_points(), CheckStatus::kFail)).empty());
  json partial = allreduce_report(baseline_points());
  partial["verdict"] = "ERROR";
  partial["error"] = {{"kind", "timeout"}, {"message", "stuck"}};
  CHECK(measured_nothing(partial).empty());
  CHECK(measured_nothing(allreduce_report(baseline_points())).empty());
}

TEST_CASE("compare: memory's workspace, model's bucket algorithm, links and fit range, Gloo's threads are "
          "settings",
          "[reports][compare]") {
  SECTION("memory --workspace-mb") {
    json base = memory_report("mlp", 1.6e7), now = memory_report("mlp", 1.6e7 + 64 * 1048576.0);
    base["results"]["workspace_mb"] = 1.0;
    now["results"]["workspace_mb"] = 64.0;
    auto c = compare_reports(base, now);
    CHECK_FALSE(c.regressed());
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "workspace_mb");
    CHECK(c.rows(ChangeKind::kMissing) == 2);
    CHECK(c.rows(ChangeKind::kNew) == 2);
    // An older report without the field is not called different.
    json old = base;
    old["results"].erase("workspace_mb");
    CHECK(compare_reports(old, now).settings_changed.empty());
  }
  auto model_report = [](const std::string& algorithm, const json& inter_gbps, double time_us) {
    Report r("model", {"ddpdiag", "model"});
    auto& res = r.results();
    res["backend_as"] = "ring";
    res["predicted_world_size"] = 64;
    res["predicted_ranks_per_host"] = 8;
    res["intra_gbps"] = nullptr;
    res["intra_latency_us"] = nullptr;
    res["inter_gbps"] = inter_gbps;
    res["inter_latency_us"] = nullptr;
    res["fit_min_bytes"] = 0;
    res["fit_max_bytes"] = nullptr;
    res["model"] = "mlp";
    res["bucket_algorithm"] = algorithm;
    res["caps"] = json::array({{{"bucket_cap_mb", 25}, {"bucket_count", 2}, {"comm_time_us", time_us},
                                {"exposed_comm_time_us", time_us / 2}}});
    return r.finish();
  };
  SECTION("model --bucket-algorithm") {
    auto c = compare_reports(model_report("ring", nullptr, 100), model_report("tree", nullptr, 300));
    CHECK_FALSE(c.regressed());
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "bucket_algorithm");
    CHECK(c.rows(ChangeKind::kRegressed) == 0);
  }
  SECTION("model's link flags: one given against none") {
    auto c = compare_reports(model_report("ring", nullptr, 100), model_report("ring", 1.25, 300));
    CHECK_FALSE(c.regressed());
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "inter_gbps");
    CHECK(c.settings_changed[0].base == "not given");
    CHECK(c.settings_changed[0].now == "1.25");
    // The same flags compare as before: a slower prediction regresses.
    CHECK(compare_reports(model_report("ring", 1.25, 100), model_report("ring", 1.25, 300)).regressed());
  }
  SECTION("Gloo's worker threads") {
    json base = allreduce_report(baseline_points()), now = allreduce_report(baseline_points());
    base["world"]["gloo_threads"] = 2;
    now["world"]["gloo_threads"] = 1;
    for (auto& s : now["results"]["sizes"]) s["out_of_place"]["busbw_gbps"] = 0.1;
    auto c = compare_reports(base, now);
    CHECK_FALSE(c.regressed());
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "gloo threads");
  }
  SECTION("--desync-check") {
    json base = allreduce_report(baseline_points()), now = allreduce_report(baseline_points());
    base["world"]["desync_check"] = false;
    now["world"]["desync_check"] = true;
    for (auto& s : now["results"]["sizes"]) s["out_of_place"]["time_us"] = 1000.0;
    auto c = compare_reports(base, now);
    CHECK_FALSE(c.regressed());
    REQUIRE(c.settings_changed.size() == 1);
    CHECK(c.settings_changed[0].name == "desync check");
    CHECK(validate_report(now).empty());
  }
}

TEST_CASE("compare and render: control characters from a report are shown escaped", "[reports][compare][render]") {
  json base = allreduce_report(baseline_points());
  json now = allreduce_report(baseline_points(), CheckStatus::kFail);
  const std::string evil = "x\x1b]0;pwned\x07y\x7f\xc2\x9bz\nresult: no regression";
  now["started_at"] = evil;
  now["world"]["backend"] = evil;
  now["checks"][0]["name"] = evil;
  now["results"]["sizes"][0]["dtype"] = evil;
  auto c = compare_reports(base, now);
  for (const std::string& out : {render_comparison_text(c), render_comparison_markdown(c), render_markdown(now)}) {
    const bool raw = std::any_of(out.begin(), out.end(), [](char ch) {
      const auto u = static_cast<unsigned char>(ch);
      return (u < 0x20 && ch != '\n') || u == 0x7f;
    });
    CHECK_FALSE(raw);
    CHECK(out.find("\xc2\x9b") == std::string::npos);
    CHECK(out.find("x\\x1b") != std::string::npos);
    CHECK(out.find("pwned\\x07y\\x7f\\u009bz") != std::string::npos);
    CHECK(out.find("\nresult: no regression") == std::string::npos);
  }
  CHECK(escape_controls("a\tb\nc", true) == "a\tb\nc");
  CHECK(escape_controls("a\tb\nc") == "a\\x09b\\x0ac");
  CHECK(escape_controls("±5 µs") == "±5 µs");  // other non-ASCII text stays
  // HTML escapes markup as before.
  json html_doc = now;
  html_doc["results"]["sizes"][0]["dtype"] = "<script>alert(1)</script>";
  const std::string html = render_html(html_doc);
  CHECK(html.find("<script>alert") == std::string::npos);
  CHECK(html.find("&lt;script&gt;") != std::string::npos);
}

TEST_CASE("compare: a tolerance of hundreds of digits is out of range, not malformed", "[reports][compare]") {
  const std::string huge(400, '9');
  for (const std::string& s : {huge, huge + "%", "0." + std::string(400, '0') + "1%"}) {
    try {
      parse_percentage(s);
      FAIL("accepted " << s.substr(0, 30));
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      CHECK(what.find("out of range") != std::string::npos);
      CHECK(what.find("not a percentage") == std::string::npos);
      CHECK(what.size() < 200);
    }
  }
  CHECK_THROWS_WITH(parse_percentage("1e5"), Catch::Contains("not a percentage"));
}

TEST_CASE("reading a report: a key repeated in one object is refused with its pointer", "[reports][schema]") {
  using ddpdiag::JsonDuplicateKey;
  using ddpdiag::parse_json_bounded;
  const auto pointer_of = [](const std::string& text) -> std::string {
    try {
      parse_json_bounded(text, true);
    } catch (const JsonDuplicateKey& e) {
      return e.pointer();
    }
    return "(accepted)";
  };
  CHECK(pointer_of(R"({"verdict": "FAIL", "verdict": "PASS"})") == "/verdict");
  CHECK(pointer_of(R"({"a": [1, {"x": 1}, {"y": 2, "y": 3}]})") == "/a/2/y");
  CHECK(pointer_of(R"({"a/b": {"c~d": 1, "c~d": 2}})") == "/a~1b/c~0d");
  CHECK(pointer_of(R"({"a": {"k": 1}, "b": {"k": 1}, "c": [[], [{"k": 1}]]})") == "(accepted)");
  // Without the option (model layouts), the last one still wins.
  CHECK(parse_json_bounded(R"({"v": 1, "v": 2})")["v"] == 2);
  CHECK_THROWS_AS(parse_json_bounded(std::string(65, '[') + std::string(65, ']'), true), ddpdiag::JsonTooDeep);
}
