#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <string>

#include "comm/errors.h"
#include "comm/json_bounded.h"
#include "ddp_core/model_layout.h"

using namespace ddpdiag;
using namespace ddpdiag::ddp_core;

namespace {

std::string error_of(const std::string& text, const std::string& source = "bad.json") {
  try {
    parse_model_layout_json(text, source);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace

TEST_CASE("presets have the real totals", "[layout]") {
  struct Expect {
    const char* name;
    std::size_t tensors;
    std::int64_t params;
  };
  const Expect expected[] = {
      {"resnet50", 161, 25'557'032},
      {"bert-large", 391, 335'141'888},
      {"gpt2", 148, 124'439'808},
      {"mlp", 6, 1'863'690},
  };
  for (const auto& e : expected) {
    INFO(e.name);
    auto m = model_preset(e.name);
    REQUIRE(m.has_value());
    CHECK(m->tensors.size() == e.tensors);
    CHECK(m->total_numel() == e.params);
    CHECK(m->total_bytes() == static_cast<std::uint64_t>(e.params) * 4);
    std::set<std::string> names;
    for (const auto& t : m->tensors) names.insert(t.name);
    CHECK(names.size() == m->tensors.size());
  }
  auto r = *model_preset("resnet50");
  CHECK(r.tensors.front().name == "conv1.weight");
  CHECK(r.tensors[14].name == "layer1.0.downsample.1.bias");
  CHECK(r.tensors.back().name == "fc.bias");
  auto g = *model_preset("gpt2");
  CHECK(g.tensors[4].name == "h.0.attn.c_attn.weight");
  CHECK(g.tensors[4].shape == std::vector<std::int64_t>{768, 2304});
  CHECK(!model_preset("resnet51").has_value());
}

TEST_CASE("torch dtype spellings", "[layout]") {
  CHECK(parse_torch_dtype("torch.float32") == DType::kFloat32);
  CHECK(parse_torch_dtype("torch.float") == DType::kFloat32);
  CHECK(parse_torch_dtype("torch.half") == DType::kFloat16);
  CHECK(parse_torch_dtype("torch.bfloat16") == DType::kBFloat16);
  CHECK(parse_torch_dtype("torch.double") == DType::kFloat64);
  CHECK(parse_torch_dtype("torch.long") == DType::kInt64);
  CHECK(parse_torch_dtype("torch.int") == DType::kInt32);
  CHECK(parse_torch_dtype("torch.int8") == DType::kInt8);
  CHECK(parse_torch_dtype("torch.uint8") == DType::kUInt8);
  CHECK(parse_torch_dtype("float16") == DType::kFloat16);
  CHECK(!parse_torch_dtype("torch.complex64"));
  for (DType t : kAllDTypes) CHECK(parse_torch_dtype(torch_dtype_name(t)) == t);
}

TEST_CASE("both JSON forms parse", "[layout]") {
  auto a = parse_model_layout_json(
      R"([["fc.weight", [10, 20], "torch.float32"], ["fc.bias", [10], "torch.float16"], ["scale", [], "torch.float64"]])",
      "m.json");
  REQUIRE(a.tensors.size() == 3);
  CHECK(a.tensors[0].bytes() == 800);
  CHECK(a.tensors[1].bytes() == 20);
  CHECK(a.tensors[2].numel() == 1);
  CHECK(a.tensors[2].bytes() == 8);
  CHECK(a.name == "m.json");

  auto b = parse_model_layout_json(
      R"({"name": "emb", "tensors": [{"name": "emb.weight", "shape": [1000, 64], "sparse": true},
                                      {"name": "out.weight", "shape": [2, 64], "dtype": "bfloat16"}]})",
      "e.json");
  CHECK(b.name == "emb");
  CHECK(b.tensors[0].expects_sparse);
  CHECK(b.tensors[0].dtype == DType::kFloat32);
  CHECK(b.tensors[1].dtype == DType::kBFloat16);

  // Round trip through the object form.
  auto r = *model_preset("mlp");
  auto back = parse_model_layout_json(model_layout_to_json(r), "x");
  REQUIRE(back.tensors.size() == r.tensors.size());
  for (std::size_t i = 0; i < r.tensors.size(); ++i) {
    CHECK(back.tensors[i].name == r.tensors[i].name);
    CHECK(back.tensors[i].shape == r.tensors[i].shape);
  }
}

TEST_CASE("requires_grad: an integer parameter is frozen, and cannot be marked trainable", "[layout]") {
  // torch: nn.Parameter(torch.zeros(3, dtype=torch.int64)) raises "Only
  // Tensors of floating point dtype can require gradients";
  // requires_grad=False is the only way to hold one (torch 1.13 and 2.11).
  auto a = parse_model_layout_json(
      R"([["steps", [1], "torch.int64"], ["w", [4], "torch.float32"],
          ["mask", [4], "torch.uint8", false]])",
      "m.json");
  CHECK(!a.tensors[0].requires_grad);
  CHECK(a.tensors[1].requires_grad);
  CHECK(!a.tensors[2].requires_grad);
  CHECK(a.frozen_count() == 2);
  auto b = parse_model_layout_json(R"({"tensors": [{"name": "n", "shape": [2], "dtype": "int32"}]})", "o.json");
  CHECK(!b.tensors[0].requires_grad);
  CHECK_THAT(error_of(R"([["steps", [1], "torch.int64", true]])"),
             Catch::Contains("tensor 0 ('steps')") && Catch::Contains("dtype torch.int64 cannot require grad"));
  CHECK_THAT(error_of(R"({"tensors": [{"name": "n", "shape": [2], "dtype": "int8", "requires_grad": true}]})"),
             Catch::Contains("cannot require grad"));
}

TEST_CASE("requires_grad: a fourth item, or a field; frozen tensors are not DDP's parameters", "[layout]") {
  // The README's export line on a model whose first layer is frozen.
  auto a = parse_model_layout_json(
      R"([["0.weight", [512, 784], "torch.float32", false], ["0.bias", [512], "torch.float32", false],
          ["2.weight", [10, 512], "torch.float32", true], ["2.bias", [10], "torch.float32"]])",
      "m.json");
  REQUIRE(a.tensors.size() == 4);
  CHECK(!a.tensors[0].requires_grad);
  CHECK(!a.tensors[1].requires_grad);
  CHECK(a.tensors[2].requires_grad);
  CHECK(a.tensors[3].requires_grad);  // three items: requires grad
  CHECK(a.frozen_count() == 2);
  CHECK(a.total_bytes() == (512 * 784 + 512 + 10 * 512 + 10) * 4);
  CHECK(a.gradient_bytes() == (10 * 512 + 10) * 4);
  const auto t = trainable_parameters(a);
  REQUIRE(t.tensors.size() == 2);
  CHECK(t.tensors[0].name == "2.weight");
  CHECK(t.tensors[1].name == "2.bias");

  auto b = parse_model_layout_json(
      R"({"tensors": [{"name": "x", "shape": [3], "requires_grad": false}, {"name": "y", "shape": [2]}]})", "o.json");
  CHECK(!b.tensors[0].requires_grad);
  CHECK(b.tensors[1].requires_grad);
  // The object form round-trips the flag.
  auto back = parse_model_layout_json(model_layout_to_json(b), "x");
  CHECK(!back.tensors[0].requires_grad);
  CHECK(back.tensors[1].requires_grad);

  CHECK_THAT(error_of(R"([["a", [1], "torch.float32", "no"]])"),
             Catch::Contains("tensor 0 ('a')") && Catch::Contains("'requires_grad'"));
  CHECK_THAT(error_of(R"({"tensors": [{"name": "x", "shape": [1], "requires_grad": 0}]})"),
             Catch::Contains("'requires_grad'"));
  CHECK_THAT(error_of(R"([["a", [1], "torch.float32", true, 5]])"), Catch::Contains("5 items"));
  // Nothing trainable: torch refuses to wrap such a module in DDP.
  auto frozen = parse_model_layout_json(R"([["a", [1], "torch.float32", false]])", "f.json");
  CHECK_THROWS_AS(trainable_parameters(frozen), UsageError);
}

TEST_CASE("bad layout files get errors naming the file, entry and field", "[layout]") {
  auto e = error_of("[[\"a\", [1, 2], \"torch.float32\"],\n [\"b\", [3], \"torch.complex64\"]]");
  CHECK_THAT(e, Catch::Contains("bad.json") && Catch::Contains("tensor 1 ('b')") &&
                    Catch::Contains("'dtype'") && Catch::Contains("complex64"));
  e = error_of(R"([["a", [1, -2], "torch.float32"]])");
  CHECK_THAT(e, Catch::Contains("tensor 0 ('a')") && Catch::Contains("'shape'") &&
                    Catch::Contains("dimension 1"));
  e = error_of(R"([["a", "12", "torch.float32"]])");
  CHECK_THAT(e, Catch::Contains("'shape'"));
  e = error_of(R"([[7, [1], "torch.float32"]])");
  CHECK_THAT(e, Catch::Contains("tensor 0") && Catch::Contains("'name'"));
  e = error_of(R"({"tensors": [{"name": "x", "shape": [1]}, {"shape": [2]}]})");
  CHECK_THAT(e, Catch::Contains("tensor 1") && Catch::Contains("'name'"));
  e = error_of(R"({"tensors": [{"name": "x", "shape": [1], "sprase": true}]})");
  CHECK_THAT(e, Catch::Contains("unknown field 'sprase'"));
  e = error_of(R"({"tensors": [{"name": "x", "shape": [1], "sparse": 1}]})");
  CHECK_THAT(e, Catch::Contains("'sparse'"));
  e = error_of(R"({"layers": []})");
  CHECK_THAT(e, Catch::Contains("'tensors'"));
  e = error_of("[]");
  CHECK_THAT(e, Catch::Contains("no tensors"));
  e = error_of("42");
  CHECK_THAT(e, Catch::Contains("top level"));
  // Malformed JSON: byte offset, line and column of the syntax error.
  e = error_of("[\n  [\"a\", [1], \"torch.float32\"],\n  [\"b\" [2]]\n]");
  CHECK_THAT(e, Catch::Contains("bad.json") && Catch::Contains("invalid JSON") &&
                    Catch::Contains("line 3"));
}

TEST_CASE("layouts whose element or byte counts overflow 64 bits are refused", "[layout]") {
  // 2^62 x 4 elements wrapped around to 0: "1 tensors, 0 parameters".
  auto e = error_of(R"([["a", [4611686018427387904, 4], "torch.float32"]])");
  CHECK_THAT(e, Catch::Contains("bad.json") && Catch::Contains("tensor 0 ('a')") &&
                    Catch::Contains("'shape' [4611686018427387904, 4]") &&
                    Catch::Contains("more elements than torch allows"));
  e = error_of(R"({"tensors": [{"name": "w", "shape": [3037000500, 3037000500]}]})");
  CHECK_THAT(e, Catch::Contains("tensor 0 ('w')") && Catch::Contains("more elements"));
  // The elements fit, their bytes do not.
  e = error_of(R"([["ok", [2]], ["b", [2305843009213693952, 2], "torch.float64"]])");
  CHECK_THAT(e, Catch::Contains("tensor 1 ('b')") && Catch::Contains("'dtype' torch.float64") &&
                    Catch::Contains("more bytes than torch allows"));
  // Each tensor fits, the model does not.
  e = error_of(R"([["a", [4611686018427387904], "torch.uint8"], ["b", [4611686018427387904], "torch.uint8"]])");
  CHECK_THAT(e, Catch::Contains("tensor 1 ('b')") && Catch::Contains("add up to more bytes"));
  // A zero dimension makes an empty tensor, whatever the others.
  const auto l = parse_model_layout_json(R"([["z", [0, 4611686018427387904, 4]]])", "z.json");
  CHECK(l.tensors.at(0).bytes() == 0);
}

TEST_CASE("load_model: presets, files, and a helpful error", "[layout]") {
  CHECK(load_model("gpt2").tensors.size() == 148);
  const std::string path = "test_model_layout_tmp.json";
  {
    std::ofstream f(path);
    f << R"([["w", [4, 4], "torch.float32"]])";
  }
  CHECK(load_model(path).tensors.size() == 1);
  std::remove(path.c_str());
  try {
    load_model("no-such-model");
    FAIL("expected an error");
  } catch (const UsageError& e) {
    CHECK_THAT(std::string(e.what()),
               Catch::Contains("resnet50") && Catch::Contains("bert-large") &&
                   Catch::Contains("gpt2") && Catch::Contains("mlp") &&
                   Catch::Contains("no-such-model"));
  }
}

TEST_CASE("load_model: a directory or an endless file is refused, not read forever", "[layout]") {
  // A directory used to read as an empty file ("invalid JSON at byte 0"),
  // and /dev/zero was read until memory ran out.
  CHECK_THROWS_WITH(load_model("/"), Catch::Contains("is a directory"));
  if (std::ifstream("/dev/zero")) CHECK_THROWS_WITH(load_model("/dev/zero"), Catch::Contains("it is a device"));
  // A file larger than any layout: refused from its size, unread.
  const std::string big = "/tmp/ddpdiag-test-big-layout-" + std::to_string(::getpid()) + ".json";
  {
    std::ofstream f(big, std::ios::binary);
    f.seekp((std::streamoff{256} << 20) + 10);
    f.put(' ');
  }
  CHECK_THROWS_WITH(load_model(big), Catch::Contains("larger than 256 MiB"));
  std::remove(big.c_str());
}

TEST_CASE("ready_order: parsed, checked, renumbered without frozen tensors", "[layout]") {
  const std::string base =
      R"({"name": "m", "tensors": [{"name": "a", "shape": [2]}, {"name": "b", "shape": [3]},
          {"name": "c", "shape": [4], "requires_grad": false}, {"name": "d", "shape": [5]}]})";
  auto with = [&](const std::string& order) {
    return base.substr(0, base.size() - 1) + R"(, "ready_order": )" + order + "}";
  };
  const ModelLayout plain = parse_model_layout_json(base, "m.json");
  CHECK(plain.ready_order.empty());
  CHECK(plain.gradient_ready_order() == std::vector<std::size_t>{3, 1, 0});

  const ModelLayout l = parse_model_layout_json(with("[1, 3, 0]"), "m.json");
  CHECK(l.gradient_ready_order() == std::vector<std::size_t>{1, 3, 0});
  // Without the frozen tensor "c", "d" becomes index 2.
  CHECK(trainable_parameters(l).gradient_ready_order() == std::vector<std::size_t>{1, 2, 0});
  // It round-trips through the dump.
  CHECK(parse_model_layout_json(model_layout_to_json(l), "dump").ready_order == l.ready_order);

  CHECK_THAT(error_of(with("[1, 3, 0, 7]")), Catch::Contains("item 3 is 7") && Catch::Contains("4 tensors"));
  CHECK_THAT(error_of(with("[1, 3, 0, 2]")), Catch::Contains("tensor 2 ('c')") &&
                                                 Catch::Contains("does not require grad"));
  CHECK_THAT(error_of(with("[1, 3, 1, 0]")), Catch::Contains("tensor 1 ('b') twice (items 0 and 2)"));
  // A tensor left out got no gradient in the recorded backward (unused in
  // forward): DDP needs find_unused_parameters for such a model.
  const ModelLayout partial = parse_model_layout_json(with("[1, 3]"), "m.json");
  CHECK(partial.unused_in_backward() == std::vector<std::size_t>{0});
  CHECK(l.unused_in_backward().empty());
  CHECK(plain.unused_in_backward().empty());
  CHECK(trainable_parameters(partial).unused_in_backward() == std::vector<std::size_t>{0});
  CHECK_NOTHROW(check_unused_parameters(partial, true, "buckets", true));
  CHECK_NOTHROW(check_unused_parameters(l, false, "buckets", true));
  try {
    check_unused_parameters(partial, false, "buckets", true);
    FAIL("no error");
  } catch (const UsageError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Contains("leaves out 1 tensor(s)") && Catch::Contains("0 ('a')") &&
                                          Catch::Contains("find_unused_parameters=False"));
    CHECK_THAT(e.context().hint, Catch::Contains("--find-unused-parameters"));
  }
  CHECK_THROWS_WITH(check_unused_parameters(partial, false, "memory", false),
                    Catch::Contains("leaves out 1 tensor(s)"));
  // An unused sparse parameter: DDP raises in backward even with find_unused.
  const std::string sparse =
      R"({"name": "s", "tensors": [{"name": "emb", "shape": [10, 4], "sparse": true},
          {"name": "w", "shape": [3]}], "ready_order": [1]})";
  CHECK_THROWS_WITH(check_unused_parameters(parse_model_layout_json(sparse, "s.json"), true, "buckets", true),
                    Catch::Contains("tensor 0 ('emb') is sparse and unused"));
  CHECK_THAT(error_of(with("[]")), Catch::Contains("'ready_order' is empty"));
  CHECK_THAT(error_of(with("[1, -3, 0]")), Catch::Contains("item 1 must be a tensor index"));
  CHECK_THAT(error_of(with("\"reverse\"")), Catch::Contains("must be a list of tensor indices"));
  CHECK_THAT(error_of(with("[1, 3, 0]"), "x.json"), Catch::Contains("(no error)"));
}

TEST_CASE("presets carry the gradient ready order torch's autograd gives", "[layout]") {
  // Recorded with a hook on every parameter, one backward of the real
  // module (torch 2.11; torchvision 0.26 resnet50, transformers 4.46
  // BertModel and GPT2Model), and checked against the buckets DDP reduces.
  auto head = [](const std::string& name, std::size_t n) {
    auto order = model_preset(name)->gradient_ready_order();
    return std::vector<std::size_t>(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(n));
  };
  auto tail = [](const std::string& name, std::size_t n) {
    auto order = model_preset(name)->gradient_ready_order();
    return std::vector<std::size_t>(order.end() - static_cast<std::ptrdiff_t>(n), order.end());
  };
  // fc bias, fc weight, then layer4.2's bn3 weight before its bias, conv3, ...
  CHECK(head("resnet50", 10) == std::vector<std::size_t>{160, 159, 157, 158, 156, 154, 155, 153, 151, 152});
  CHECK(tail("resnet50", 3) == std::vector<std::size_t>{1, 2, 0});
  CHECK(head("bert-large", 8) == std::vector<std::size_t>{390, 389, 387, 388, 386, 385, 384, 383});
  // The embeddings' LayerNorm, then position before token type, then word.
  CHECK(tail("bert-large", 5) == std::vector<std::size_t>{3, 4, 1, 2, 0});
  CHECK(head("gpt2", 6) == std::vector<std::size_t>{146, 147, 145, 144, 143, 142});
  CHECK(tail("gpt2", 4) == std::vector<std::size_t>{2, 3, 1, 0});
  CHECK(model_preset("mlp")->gradient_ready_order() == std::vector<std::size_t>{5, 4, 3, 2, 1, 0});
  for (const auto& name : model_preset_names()) {
    INFO(name);
    const auto layout = *model_preset(name);
    CHECK_NOTHROW(check_ready_order(layout, name));
    CHECK(layout.ready_order.size() == layout.tensors.size());
  }
}

TEST_CASE("a layout nested thousands deep is an error naming the file, not a crash", "[layout]") {
  // The shape's value is dumped into the error message: a recursive dump of
  // 100,000 levels overflowed the stack (SIGSEGV).
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  CHECK_THAT(error_of(R"({"tensors": [{"name": "a", "shape": )" + deep + "}]}", "deep.json"),
             Catch::Contains("deep.json") && Catch::Contains("more than 64 levels deep"));
  CHECK_THAT(error_of(R"([["a", )" + deep + R"(, "torch.float32", true]])"),
             Catch::Contains("more than 64 levels deep"));
  // The bound is exact: 64 levels are read, 65 refused.
  CHECK_NOTHROW(parse_json_bounded(std::string(64, '[') + std::string(64, ']')));
  CHECK_THROWS_AS(parse_json_bounded(std::string(65, '[') + std::string(65, ']')), JsonTooDeep);
  CHECK_THROWS_AS(parse_json_bounded(std::string(64, '[') + "{}" + std::string(64, ']')), JsonTooDeep);
  // A legitimate layout nests four levels.
  CHECK_NOTHROW(parse_model_layout_json(R"({"tensors": [{"name": "n", "shape": [2, 3]}]})", "o.json"));
}
