// Built-in gradient layouts, generated layer by layer in the order
// named_parameters() yields them (module registration order). Checked
// name-for-name and shape-for-shape against torch.nn re-creations of the
// same modules in tests/compat/test_ddp_core_torch.py. Totals:
//   resnet50    161 tensors,  25,557,032 params (torchvision.models.resnet50)
//   bert-large  391 tensors, 335,141,888 params (BertModel, bert-large-uncased)
//   gpt2        148 tensors, 124,439,808 params (GPT2Model, "gpt2")
//   mlp           6 tensors,   1,863,690 params (784-1024-1024-10 nn.Sequential)
#include <string>
#include <vector>

#include <fmt/core.h>

#include "ddp_core/model_layout.h"

namespace ddpdiag::ddp_core {

namespace {

using Shape = std::vector<std::int64_t>;

// Builds a layout layer by layer. Besides the tensors in registration
// order, it records the order backward makes their gradients ready, as
// torch's autograd does (recorded with a hook on every parameter of the real
// modules, torch 2.11): layers in the reverse of the order the forward uses
// them; within nn.Linear (and transformers' Conv1D), the bias's gradient
// before the weight's (the weight's passes through one more node); within a
// normalization layer, the weight's before the bias's (both leave its
// backward node together, in argument order).
struct Builder {
  ModelLayout layout;
  // Per layer, in the order the forward uses the layers: its tensors'
  // indices in the order their gradients become ready.
  std::vector<std::vector<std::size_t>> used;

  std::size_t add_tensor(std::string name, Shape shape) {
    layout.tensors.push_back(TensorSpec{std::move(name), std::move(shape), DType::kFloat32, false});
    return layout.tensors.size() - 1;
  }
  // A layer whose one tensor is used alone (an embedding, a conv without bias).
  void add(std::string name, Shape shape) { used.push_back({add_tensor(std::move(name), std::move(shape))}); }
  // nn.Linear(in, out): weight [out, in], then bias [out]; bias ready first.
  void linear(const std::string& prefix, std::int64_t in, std::int64_t out) {
    const std::size_t w = add_tensor(prefix + ".weight", {out, in});
    const std::size_t b = add_tensor(prefix + ".bias", {out});
    used.push_back({b, w});
  }
  // nn.LayerNorm / nn.BatchNorm2d affine parameters (running stats are
  // buffers); weight ready first.
  void norm(const std::string& prefix, std::int64_t n) {
    const std::size_t w = add_tensor(prefix + ".weight", {n});
    const std::size_t b = add_tensor(prefix + ".bias", {n});
    used.push_back({w, b});
  }
  void conv_nobias(const std::string& prefix, std::int64_t in, std::int64_t out, std::int64_t k) {
    add(prefix + ".weight", {out, in, k, k});
  }
  ModelLayout finish() {
    for (auto layer = used.rbegin(); layer != used.rend(); ++layer)
      layout.ready_order.insert(layout.ready_order.end(), layer->begin(), layer->end());
    return std::move(layout);
  }
};

// torchvision ResNet-50: Bottleneck blocks [3, 4, 6, 3], expansion 4. A
// Bottleneck registers conv1, bn1, conv2, bn2, conv3, bn3, then downsample
// (only the first block of each stage has one: Conv 1x1 then BatchNorm).
ModelLayout resnet50() {
  Builder b;
  b.layout.name = "resnet50";
  b.conv_nobias("conv1", 3, 64, 7);
  b.norm("bn1", 64);
  const int blocks[4] = {3, 4, 6, 3};
  std::int64_t inplanes = 64;
  for (int stage = 0; stage < 4; ++stage) {
    const std::int64_t planes = std::int64_t{64} << stage;
    for (int blk = 0; blk < blocks[stage]; ++blk) {
      const std::string p = fmt::format("layer{}.{}", stage + 1, blk);
      b.conv_nobias(p + ".conv1", inplanes, planes, 1);
      b.norm(p + ".bn1", planes);
      b.conv_nobias(p + ".conv2", planes, planes, 3);
      b.norm(p + ".bn2", planes);
      b.conv_nobias(p + ".conv3", planes, planes * 4, 1);
      b.norm(p + ".bn3", planes * 4);
      if (blk == 0) {
        b.conv_nobias(p + ".downsample.0", inplanes, planes * 4, 1);
        b.norm(p + ".downsample.1", planes * 4);
      }
      inplanes = planes * 4;
    }
  }
  b.linear("fc", 2048, 1000);
  return b.finish();
}

// transformers BertModel with bert-large-uncased's config: vocab 30522,
// hidden 1024, 24 layers, intermediate 4096, 512 positions, 2 token types,
// with the pooler.
ModelLayout bert_large() {
  constexpr std::int64_t kVocab = 30522, kHidden = 1024, kLayers = 24, kInter = 4096;
  Builder b;
  b.layout.name = "bert-large";
  // Registered word, position, token type; the forward adds the token type
  // embeddings to the word embeddings first, then the position embeddings
  // (transformers 4.46), so backward reaches position before token type.
  const std::size_t word = b.add_tensor("embeddings.word_embeddings.weight", {kVocab, kHidden});
  const std::size_t position = b.add_tensor("embeddings.position_embeddings.weight", {512, kHidden});
  const std::size_t token_type = b.add_tensor("embeddings.token_type_embeddings.weight", {2, kHidden});
  b.used.push_back({word});
  b.used.push_back({token_type});
  b.used.push_back({position});
  b.norm("embeddings.LayerNorm", kHidden);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const std::string p = fmt::format("encoder.layer.{}", l);
    b.linear(p + ".attention.self.query", kHidden, kHidden);
    b.linear(p + ".attention.self.key", kHidden, kHidden);
    b.linear(p + ".attention.self.value", kHidden, kHidden);
    b.linear(p + ".attention.output.dense", kHidden, kHidden);
    b.norm(p + ".attention.output.LayerNorm", kHidden);
    b.linear(p + ".intermediate.dense", kHidden, kInter);
    b.linear(p + ".output.dense", kInter, kHidden);
    b.norm(p + ".output.LayerNorm", kHidden);
  }
  b.linear("pooler.dense", kHidden, kHidden);
  return b.finish();
}

// transformers GPT2Model ("gpt2", 124 M): vocab 50257, 1024 positions,
// hidden 768, 12 blocks. Its Conv1D stores weight as [in, out] (transposed
// against nn.Linear), which is what the shapes below follow.
ModelLayout gpt2() {
  constexpr std::int64_t kVocab = 50257, kPositions = 1024, kHidden = 768, kLayers = 12;
  Builder b;
  b.layout.name = "gpt2";
  b.add("wte.weight", {kVocab, kHidden});
  b.add("wpe.weight", {kPositions, kHidden});
  // addmm(bias, x, weight): the bias's gradient is ready first.
  auto conv1d = [&](const std::string& prefix, std::int64_t in, std::int64_t out) {
    const std::size_t w = b.add_tensor(prefix + ".weight", {in, out});
    const std::size_t bias = b.add_tensor(prefix + ".bias", {out});
    b.used.push_back({bias, w});
  };
  for (std::int64_t l = 0; l < kLayers; ++l) {
    const std::string p = fmt::format("h.{}", l);
    b.norm(p + ".ln_1", kHidden);
    conv1d(p + ".attn.c_attn", kHidden, 3 * kHidden);
    conv1d(p + ".attn.c_proj", kHidden, kHidden);
    b.norm(p + ".ln_2", kHidden);
    conv1d(p + ".mlp.c_fc", kHidden, 4 * kHidden);
    conv1d(p + ".mlp.c_proj", 4 * kHidden, kHidden);
  }
  b.norm("ln_f", kHidden);
  return b.finish();
}

// nn.Sequential(Linear(784, 1024), ReLU(), Linear(1024, 1024), ReLU(),
// Linear(1024, 10)): the ReLUs take indices 1 and 3.
ModelLayout mlp() {
  Builder b;
  b.layout.name = "mlp";
  b.linear("0", 784, 1024);
  b.linear("2", 1024, 1024);
  b.linear("4", 1024, 10);
  return b.finish();
}

}  // namespace

std::vector<std::string> model_preset_names() { return {"resnet50", "bert-large", "gpt2", "mlp"}; }

std::optional<ModelLayout> model_preset(std::string_view name) {
  if (name == "resnet50") return resnet50();
  if (name == "bert-large") return bert_large();
  if (name == "gpt2") return gpt2();
  if (name == "mlp") return mlp();
  return std::nullopt;
}

}  // namespace ddpdiag::ddp_core
