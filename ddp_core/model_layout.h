// Gradient layouts: the ordered list of a model's parameters (name, shape,
// dtype, whether its gradient is sparse), in named_parameters() order. DDP's
// bucketing, the reducer and the broadcast only need this, not the model.
//
// JSON file format (either form):
//   1. what three lines of Python write from any torch.nn.Module:
//        json.dump([(n, list(p.shape), str(p.dtype), p.requires_grad)
//                   for n, p in model.named_parameters()], f)
//      i.e. a list of [name, [shape...], "torch.float32", true] items (the
//      dtype and the requires_grad flag may be left out);
//   2. an object {"name": "my-model", "tensors": [{"name": ..., "shape": [...],
//      "dtype": "torch.float32" | "float32" | ..., "sparse": false,
//      "requires_grad": true}, ...], "ready_order": [...]} ("dtype" defaults
//      to float32, "sparse" to false, "requires_grad" to true; "ready_order",
//      optional, lists the indices of the tensors that require grad in the
//      order backward makes their gradients ready, as recorded by a hook on
//      each parameter; without it, the reverse of the tensors' order).
// A parameter with requires_grad false (frozen) is one DDP broadcasts but
// never reduces: DDP builds its buckets from the parameters that require
// grad only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/types.h"

namespace ddpdiag::ddp_core {

struct TensorSpec {
  std::string name;
  std::vector<std::int64_t> shape;  // empty = a scalar (one element)
  DType dtype = DType::kFloat32;
  bool expects_sparse = false;  // sparse gradient (nn.Embedding(sparse=True)): bucketed alone
  bool requires_grad = true;    // false: frozen, no gradient, in no DDP bucket

  std::int64_t numel() const;
  std::uint64_t bytes() const;
};

struct ModelLayout {
  std::string name;
  std::vector<TensorSpec> tensors;
  // Indices of the tensors that require grad, in the order backward makes
  // their gradients ready (the order DDP rebuilds its buckets from). Empty:
  // the reverse of the tensors' order. Autograd does not always walk
  // parameters exactly backwards: a normalization layer's weight gradient
  // is ready before its bias's, as both come out of one node.
  std::vector<std::size_t> ready_order;

  // ready_order, or the reverse order of the tensors that require grad.
  std::vector<std::size_t> gradient_ready_order() const;
  // The tensors that require grad and that ready_order leaves out: the
  // recorded backward gave them no gradient (unused in forward, the case
  // DDP's find_unused_parameters=True is for). Empty when ready_order is.
  std::vector<std::size_t> unused_in_backward() const;

  std::int64_t total_numel() const;
  std::uint64_t total_bytes() const;           // every parameter (what DDP broadcasts)
  std::uint64_t gradient_bytes() const;        // those that require grad (what DDP reduces)
  std::size_t frozen_count() const;            // tensors with requires_grad false
};

// DDP's parameters for reduction: the layout without its frozen tensors, in
// the same order (DistributedDataParallel keeps only parameters that require
// grad for its reducer), ready_order renumbered to match. Throws UsageError when none is left, where torch
// refuses to wrap the module.
ModelLayout trainable_parameters(const ModelLayout& layout);

// torch's str(dtype) spellings ("torch.float32", "torch.half", ...) and, for
// convenience, the same without the "torch." prefix.
std::optional<DType> parse_torch_dtype(std::string_view s);
// The canonical torch spelling: "torch.float32", "torch.bfloat16", ...
std::string torch_dtype_name(DType t);

// Throws UsageError unless ready_order is empty or lists tensors that
// require grad, each at most once. One it leaves out is unused in backward
// (unused_in_backward). source names the layout.
void check_ready_order(const ModelLayout& layout, const std::string& source);

// DDP with find_unused_parameters=False stops at its second iteration when a
// parameter got no gradient ("Expected to have finished reduction in the
// prior iteration ..."). Throws UsageError naming the layout's unused
// parameters when it has some and find_unused_parameters is false (pass
// true for static_graph=True too, which copes with them);
// `command` names the subcommand and `has_flag` whether it takes
// --find-unused-parameters, for the hint.
void check_unused_parameters(const ModelLayout& layout, bool find_unused_parameters,
                             const std::string& command, bool has_flag);

// Parses a layout in either JSON form above. source names the file in
// errors. Throws UsageError naming the source, the tensor entry and the field
// (or the byte offset of a JSON syntax error).
ModelLayout parse_model_layout_json(std::string_view text, const std::string& source);
ModelLayout load_model_layout_file(const std::string& path);
// The layout as the object form of the JSON format (round-trips through
// parse_model_layout_json).
std::string model_layout_to_json(const ModelLayout& layout);

// Built-in presets (model_presets.cpp), parameters in named_parameters()
// order with the real names and shapes: resnet50 (torchvision), bert-large
// (transformers BertModel, bert-large-uncased), gpt2 (transformers GPT2Model,
// the 124 M one), mlp (a small 3-layer nn.Sequential).
std::vector<std::string> model_preset_names();
std::optional<ModelLayout> model_preset(std::string_view name);

// A preset name, or else a path to a JSON layout file. Throws UsageError
// listing the presets when it is neither.
ModelLayout load_model(const std::string& name_or_path);

}  // namespace ddpdiag::ddp_core
