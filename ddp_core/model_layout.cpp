#include "ddp_core/model_layout.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/errors.h"
#include "comm/input_file.h"
#include "comm/json_bounded.h"

namespace ddpdiag::ddp_core {

namespace {

using nlohmann::json;

constexpr const char* kFormatHint =
    "a layout file is either the list written by json.dump([(n, list(p.shape), str(p.dtype), "
    "p.requires_grad) for n, p in model.named_parameters()], f) or an object {\"name\": ..., "
    "\"tensors\": [{\"name\", \"shape\", \"dtype\", \"sparse\", \"requires_grad\"}]}";

[[noreturn]] void fail(const std::string& source, const std::string& what,
                       const std::string& hint = kFormatHint) {
  throw UsageError(fmt::format("model layout {}: {}", source, what),
                   ErrorContext{"model.load", -1, -1, hint});
}

struct DTypeSpelling {
  std::string_view name;
  DType dtype;
};

// Every alias torch prints or accepts for the dtypes we model; the first
// spelling of each dtype is the one str(dtype) gives.
constexpr DTypeSpelling kTorchDTypes[] = {
    {"float32", DType::kFloat32}, {"float", DType::kFloat32},   {"float16", DType::kFloat16},
    {"half", DType::kFloat16},    {"bfloat16", DType::kBFloat16}, {"float64", DType::kFloat64},
    {"double", DType::kFloat64},  {"int64", DType::kInt64},     {"long", DType::kInt64},
    {"int32", DType::kInt32},     {"int", DType::kInt32},       {"int8", DType::kInt8},
    {"uint8", DType::kUInt8},
};

std::string entry_label(std::size_t index, const std::string& name) {
  if (name.empty()) return fmt::format("tensor {}", index);
  return fmt::format("tensor {} ('{}')", index, name);
}

std::vector<std::int64_t> parse_shape(const json& j, const std::string& source,
                                      const std::string& where) {
  if (!j.is_array())
    fail(source, fmt::format("{}: field 'shape' must be a list of integers, got {}", where,
                             j.type_name()));
  std::vector<std::int64_t> shape;
  shape.reserve(j.size());
  for (std::size_t d = 0; d < j.size(); ++d) {
    const json& v = j[d];
    if (!v.is_number_integer())
      fail(source, fmt::format("{}: field 'shape' dimension {} must be an integer, got {}", where,
                               d, v.dump()));
    // number_integer covers both signed and unsigned storage.
    if (v.is_number_unsigned() ? v.get<std::uint64_t>() >
                                     static_cast<std::uint64_t>(
                                         std::numeric_limits<std::int64_t>::max())
                               : v.get<std::int64_t>() < 0)
      fail(source, fmt::format("{}: field 'shape' dimension {} is out of range: {}", where, d,
                               v.dump()));
    shape.push_back(v.get<std::int64_t>());
  }
  return shape;
}

DType parse_dtype_field(const json& j, const std::string& source, const std::string& where) {
  if (!j.is_string())
    fail(source, fmt::format("{}: field 'dtype' must be a string like \"torch.float32\", got {}",
                             where, j.dump()));
  auto t = parse_torch_dtype(j.get<std::string>());
  if (!t)
    fail(source, fmt::format("{}: field 'dtype' has unsupported dtype \"{}\" (supported: "
                             "torch.float32/float, float16/half, bfloat16, float64/double, "
                             "int64/long, int32/int, int8, uint8)",
                             where, j.get<std::string>()));
  return *t;
}

// Element and byte counts must fit torch's int64 (numel(), nbytes()), and
// the whole layout's bytes too: a shape whose product wraps around would
// otherwise pass as a tiny (or empty) tensor.
constexpr std::int64_t kMaxCount = std::numeric_limits<std::int64_t>::max();
constexpr const char* kSizeHint =
    "check the shapes: torch cannot make a tensor (or model) this large, so the file was not "
    "written from a real model, or a dimension was mistyped";

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

void check_size(const TensorSpec& t, const std::string& source, const std::string& where) {
  std::int64_t n = 1;
  bool zero = false;
  for (auto d : t.shape) zero = zero || d == 0;
  if (zero) return;  // an empty tensor, whatever its other dimensions
  for (auto d : t.shape)
    if (__builtin_mul_overflow(n, d, &n))
      fail(source, fmt::format("{}: field 'shape' {} has more elements than torch allows ({}, "
                               "2^63 - 1)",
                               where, shape_text(t.shape), kMaxCount),
           kSizeHint);
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(t.dtype)), &bytes))
    fail(source, fmt::format("{}: fields 'shape' {} and 'dtype' {} make {} elements of {} bytes, "
                             "more bytes than torch allows (at most {}, 2^63 - 1)",
                             where, shape_text(t.shape), torch_dtype_name(t.dtype), n,
                             dtype_size(t.dtype), kMaxCount),
         kSizeHint);
}

// torch lets only floating-point parameters require grad: an integer one is
// frozen whatever the file says, and one marked trainable is an error (torch
// raises "Only Tensors of floating point dtype can require gradients").
void settle_requires_grad(TensorSpec& t, bool stated, const std::string& source,
                          const std::string& where) {
  if (dtype_is_floating(t.dtype)) return;
  if (stated && t.requires_grad)
    fail(source, fmt::format("{}: a parameter of dtype {} cannot require grad (torch allows it "
                             "for floating-point dtypes only)",
                             where, torch_dtype_name(t.dtype)),
         "mark it \"requires_grad\": false, or give it a floating-point dtype");
  t.requires_grad = false;
}

TensorSpec parse_triple(const json& e, std::size_t i, const std::string& source) {
  const std::string where0 = entry_label(i, "");
  if (e.size() < 2 || e.size() > 4)
    fail(source, fmt::format("{}: expected [name, [shape...], \"torch.dtype\", requires_grad], got "
                             "a list of {} items",
                             where0, e.size()));
  if (!e[0].is_string())
    fail(source, fmt::format("{}: field 'name' (item 0) must be a string, got {}", where0,
                             e[0].dump()));
  TensorSpec t;
  t.name = e[0].get<std::string>();
  const std::string where = entry_label(i, t.name);
  t.shape = parse_shape(e[1], source, where);
  if (e.size() >= 3) t.dtype = parse_dtype_field(e[2], source, where);
  if (e.size() == 4) {
    if (!e[3].is_boolean())
      fail(source, fmt::format("{}: field 'requires_grad' (item 3) must be true or false, got {}",
                               where, e[3].dump()));
    t.requires_grad = e[3].get<bool>();
  }
  settle_requires_grad(t, e.size() == 4, source, where);
  check_size(t, source, where);
  return t;
}

TensorSpec parse_object_entry(const json& e, std::size_t i, const std::string& source) {
  const std::string where0 = entry_label(i, "");
  auto name_it = e.find("name");
  if (name_it == e.end() || !name_it->is_string())
    fail(source, fmt::format("{}: field 'name' is missing or not a string", where0));
  TensorSpec t;
  t.name = name_it->get<std::string>();
  const std::string where = entry_label(i, t.name);
  auto shape_it = e.find("shape");
  if (shape_it == e.end()) fail(source, fmt::format("{}: field 'shape' is missing", where));
  t.shape = parse_shape(*shape_it, source, where);
  if (auto it = e.find("dtype"); it != e.end()) t.dtype = parse_dtype_field(*it, source, where);
  if (auto it = e.find("sparse"); it != e.end()) {
    if (!it->is_boolean())
      fail(source,
           fmt::format("{}: field 'sparse' must be true or false, got {}", where, it->dump()));
    t.expects_sparse = it->get<bool>();
  }
  if (auto it = e.find("requires_grad"); it != e.end()) {
    if (!it->is_boolean())
      fail(source, fmt::format("{}: field 'requires_grad' must be true or false, got {}", where,
                               it->dump()));
    t.requires_grad = it->get<bool>();
  }
  settle_requires_grad(t, e.contains("requires_grad"), source, where);
  check_size(t, source, where);
  for (const auto& [key, value] : e.items()) {
    (void)value;
    if (key != "name" && key != "shape" && key != "dtype" && key != "sparse" && key != "requires_grad")
      fail(source, fmt::format("{}: unknown field '{}' (expected name, shape, dtype, sparse, "
                               "requires_grad)",
                               where, key));
  }
  return t;
}

// Line and column (1-based) of a byte offset, for JSON syntax errors.
std::pair<std::size_t, std::size_t> line_col(std::string_view text, std::size_t byte) {
  byte = std::min(byte, text.size());
  std::size_t line = 1, col = 1;
  for (std::size_t i = 0; i < byte; ++i) {
    if (text[i] == '\n') {
      ++line;
      col = 1;
    } else {
      ++col;
    }
  }
  return {line, col};
}

}  // namespace

std::int64_t TensorSpec::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::uint64_t TensorSpec::bytes() const {
  return static_cast<std::uint64_t>(numel()) * dtype_size(dtype);
}

std::int64_t ModelLayout::total_numel() const {
  std::int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

std::uint64_t ModelLayout::total_bytes() const {
  std::uint64_t n = 0;
  for (const auto& t : tensors) n += t.bytes();
  return n;
}

std::uint64_t ModelLayout::gradient_bytes() const {
  std::uint64_t n = 0;
  for (const auto& t : tensors)
    if (t.requires_grad) n += t.bytes();
  return n;
}

std::size_t ModelLayout::frozen_count() const {
  return static_cast<std::size_t>(
      std::count_if(tensors.begin(), tensors.end(), [](const TensorSpec& t) { return !t.requires_grad; }));
}

std::vector<std::size_t> ModelLayout::gradient_ready_order() const {
  if (!ready_order.empty()) return ready_order;
  std::vector<std::size_t> order;
  order.reserve(tensors.size());
  for (std::size_t k = tensors.size(); k-- > 0;)
    if (tensors[k].requires_grad) order.push_back(k);
  return order;
}

void check_ready_order(const ModelLayout& layout, const std::string& source) {
  if (layout.ready_order.empty()) return;
  const std::size_t n = layout.tensors.size();
  std::vector<std::size_t> seen_at(n, SIZE_MAX);
  for (std::size_t pos = 0; pos < layout.ready_order.size(); ++pos) {
    const std::size_t k = layout.ready_order[pos];
    if (k >= n)
      fail(source, fmt::format("'ready_order' item {} is {}, but the layout has {} tensors (indices "
                               "0 to {})", pos, k, n, n - 1));
    if (!layout.tensors[k].requires_grad)
      fail(source, fmt::format("'ready_order' item {} is tensor {} ('{}'), which does not require "
                               "grad: a frozen parameter has no gradient to be ready",
                               pos, k, layout.tensors[k].name));
    if (seen_at[k] != SIZE_MAX)
      fail(source, fmt::format("'ready_order' lists tensor {} ('{}') twice (items {} and {})", k,
                               layout.tensors[k].name, seen_at[k], pos));
    seen_at[k] = pos;
  }
}

std::vector<std::size_t> ModelLayout::unused_in_backward() const {
  std::vector<std::size_t> out;
  if (ready_order.empty()) return out;
  std::vector<std::uint8_t> listed(tensors.size(), 0);
  for (std::size_t k : ready_order)
    if (k < listed.size()) listed[k] = 1;
  for (std::size_t k = 0; k < tensors.size(); ++k)
    if (tensors[k].requires_grad && !listed[k]) out.push_back(k);
  return out;
}

void check_unused_parameters(const ModelLayout& layout, bool find_unused_parameters,
                             const std::string& command, bool has_flag) {
  const auto unused = layout.unused_in_backward();
  if (find_unused_parameters) {
    // DDP marks an unused parameter ready at backward's first hook, and a
    // sparse one needs a gradient there: torch raises in backward.
    for (std::size_t k : unused)
      if (layout.tensors[k].expects_sparse)
        throw UsageError(
            fmt::format("model {}: tensor {} ('{}') is sparse and unused in the recorded backward "
                        "(its 'ready_order' leaves it out); DDP with find_unused_parameters=True "
                        "or static_graph=True raises in backward for such a parameter (\"Expected sparse gradient to be "
                        "defined\")",
                        layout.name, k, layout.tensors[k].name),
            ErrorContext{command, -1, -1,
                         "use the sparse embedding in forward on every iteration, or mark it "
                         "\"requires_grad\": false if it is frozen"});
    return;
  }
  if (unused.empty()) return;
  std::string list;
  for (std::size_t i = 0; i < unused.size() && i < 5; ++i)
    list += fmt::format("{}{} ('{}')", i ? ", " : "", unused[i], layout.tensors[unused[i]].name);
  if (unused.size() > 5) list += fmt::format(" and {} more", unused.size() - 5);
  throw UsageError(
      fmt::format("model {}: its 'ready_order' leaves out {} tensor(s) that require grad: {}. The "
                  "recorded backward gave them no gradient (unused in forward), and DDP with "
                  "find_unused_parameters=False stops at its second iteration with such a model "
                  "(\"Expected to have finished reduction in the prior iteration before starting "
                  "a new one\")",
                  layout.name, unused.size(), list),
      ErrorContext{command, -1, -1,
                   has_flag ? "give --find-unused-parameters, as DDP(..., find_unused_parameters=True) "
                              "needs for this model (or --static-graph for static_graph=True); or "
                              "mark parameters that are frozen \"requires_grad\": false"
                            : command + " models DDP without find_unused_parameters: mark parameters "
                                        "that are frozen \"requires_grad\": false, or record "
                                        "'ready_order' from a backward that reaches every parameter"});
}

ModelLayout trainable_parameters(const ModelLayout& layout) {
  ModelLayout out;
  out.name = layout.name;
  std::vector<std::size_t> renumbered(layout.tensors.size(), 0);
  for (std::size_t k = 0; k < layout.tensors.size(); ++k)
    if (layout.tensors[k].requires_grad) {
      renumbered[k] = out.tensors.size();
      out.tensors.push_back(layout.tensors[k]);
    }
  for (std::size_t k : layout.ready_order) out.ready_order.push_back(renumbered[k]);
  if (out.tensors.empty())
    throw UsageError(fmt::format("no parameter of the model layout '{}' requires grad ({} tensors, "
                                 "all frozen): DDP has no gradient to reduce",
                                 layout.name, layout.tensors.size()),
                     ErrorContext{"model.load", -1, -1,
                                  "torch refuses to wrap such a module in DistributedDataParallel; "
                                  "check the 'requires_grad' fields of the layout"});
  return out;
}

std::optional<DType> parse_torch_dtype(std::string_view s) {
  if (s.starts_with("torch.")) s.remove_prefix(6);
  for (const auto& sp : kTorchDTypes)
    if (sp.name == s) return sp.dtype;
  return std::nullopt;
}

std::string torch_dtype_name(DType t) {
  for (const auto& sp : kTorchDTypes)
    if (sp.dtype == t) return "torch." + std::string(sp.name);
  DDPDIAG_ASSERT(false && "dtype without a torch spelling");
  return {};
}

ModelLayout parse_model_layout_json(std::string_view text, const std::string& source) {
  json doc;
  try {
    doc = parse_json_bounded(text);
  } catch (const JsonTooDeep& e) {
    fail(source, std::string(e.what()) + "; a layout nests four levels at most");
  } catch (const json::parse_error& e) {
    // e.byte is 1-based: the byte at which parsing stopped.
    const std::size_t byte = e.byte > 0 ? e.byte - 1 : 0;
    auto [line, col] = line_col(text, byte);
    fail(source, fmt::format("invalid JSON at byte {} (line {}, column {}): {}", byte, line, col,
                             e.what()));
  } catch (const json::exception& e) {
    // Valid syntax that cannot be held: a number past a double's range
    // (1e999, out_of_range.406).
    fail(source, fmt::format("a value cannot be read: {}", e.what()));
  }
  ModelLayout layout;
  const json* entries = nullptr;
  bool triples = false;
  if (doc.is_array()) {
    entries = &doc;
    triples = true;
  } else if (doc.is_object()) {
    if (auto it = doc.find("name"); it != doc.end()) {
      if (!it->is_string()) fail(source, "field 'name' of the model must be a string");
      layout.name = it->get<std::string>();
    }
    auto it = doc.find("tensors");
    if (it == doc.end() || !it->is_array())
      fail(source, "the object form needs a field 'tensors' holding a list");
    entries = &*it;
  } else {
    fail(source, fmt::format("expected a list or an object at the top level, got {}",
                             doc.type_name()));
  }
  layout.tensors.reserve(entries->size());
  for (std::size_t i = 0; i < entries->size(); ++i) {
    const json& e = (*entries)[i];
    // The list form may also hold objects, and the object form triples:
    // accept whichever shape each entry has.
    if (e.is_array()) {
      layout.tensors.push_back(parse_triple(e, i, source));
    } else if (e.is_object()) {
      layout.tensors.push_back(parse_object_entry(e, i, source));
    } else {
      fail(source, fmt::format("{}: expected {} , got {}", entry_label(i, ""),
                               triples ? "[name, [shape...], \"torch.dtype\"]"
                                       : "an object {\"name\", \"shape\", \"dtype\"}",
                               e.dump()));
    }
  }
  if (layout.tensors.empty()) fail(source, "the layout holds no tensors");
  std::int64_t total = 0;
  for (std::size_t i = 0; i < layout.tensors.size(); ++i)
    if (__builtin_add_overflow(total, static_cast<std::int64_t>(layout.tensors[i].bytes()), &total))
      fail(source, fmt::format("the tensors up to {} add up to more bytes than fit in 64 bits "
                               "(at most {} bytes, 2^63 - 1)",
                               entry_label(i, layout.tensors[i].name), kMaxCount),
           kSizeHint);
  if (doc.is_object())
    if (auto it = doc.find("ready_order"); it != doc.end()) {
      if (!it->is_array())
        fail(source, fmt::format("field 'ready_order' must be a list of tensor indices, got {}",
                                 it->type_name()));
      for (std::size_t pos = 0; pos < it->size(); ++pos) {
        const json& v = (*it)[pos];
        if (!v.is_number_unsigned())
          fail(source, fmt::format("'ready_order' item {} must be a tensor index (0, 1, ...), got {}",
                                   pos, v.dump()));
        layout.ready_order.push_back(v.get<std::size_t>());
      }
      if (layout.ready_order.empty())
        fail(source, "'ready_order' is empty: leave it out for the reverse order, or list the "
                     "indices of the tensors that require grad");
      check_ready_order(layout, source);
    }
  if (layout.name.empty()) layout.name = source;
  return layout;
}

ModelLayout load_model_layout_file(const std::string& path) {
  // A million tensors make about 60 MB of JSON.
  constexpr std::size_t kMaxLayoutFileBytes = std::size_t{256} << 20;
  std::string text;
  try {
    text = read_input_file(path, kMaxLayoutFileBytes);
  } catch (const InputFileError& e) {
    using Kind = InputFileError::Kind;
    throw UsageError(fmt::format("model layout '{}': {}{}", path, e.what(),
                                 e.kind() == Kind::kTooLarge    ? ", far beyond any model's list of parameters"
                                 : e.kind() == Kind::kNotAFile ? ", not a JSON file"
                                                               : ""),
                     ErrorContext{"model.load", -1, -1, kFormatHint});
  }
  return parse_model_layout_json(text, path);
}

std::string model_layout_to_json(const ModelLayout& layout) {
  json tensors = json::array();
  for (const auto& t : layout.tensors)
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"dtype", torch_dtype_name(t.dtype)},
                       {"sparse", t.expects_sparse},
                       {"requires_grad", t.requires_grad}});
  json doc = {{"name", layout.name}, {"tensors", std::move(tensors)}};
  if (!layout.ready_order.empty()) doc["ready_order"] = layout.ready_order;
  return doc.dump(1);
}

ModelLayout load_model(const std::string& name_or_path) {
  if (auto preset = model_preset(name_or_path)) return *std::move(preset);
  // Whether it names a file at all (opening it here would block on a FIFO).
  struct stat st {};
  if (::stat(name_or_path.c_str(), &st) != 0) {
    std::string names;
    for (const auto& n : model_preset_names()) names += (names.empty() ? "" : ", ") + n;
    throw UsageError(
        fmt::format("--model '{}' is neither a built-in preset ({}) nor a readable JSON file",
                    name_or_path, names),
        ErrorContext{"model.load", -1, -1, kFormatHint});
  }
  return load_model_layout_file(name_or_path);
}

}  // namespace ddpdiag::ddp_core
