#include "ddp_core/bucket_assignment.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <unordered_map>

#include <fmt/core.h>

#include "comm/errors.h"

namespace ddpdiag::ddp_core {

namespace {

// The open bucket of one (dtype, device) group and where the group stands in
// the limits list.
struct Group {
  std::vector<std::size_t> indices;
  std::uint64_t bytes = 0;
  std::size_t limit_pos = 0;  // index into size_limits; never past the last entry
};

// torch's c10::ScalarType numbers for our dtypes.
std::int8_t torch_scalar_type(DType d) {
  switch (d) {
    case DType::kUInt8: return 0;
    case DType::kInt8: return 1;
    case DType::kInt32: return 3;
    case DType::kInt64: return 4;
    case DType::kFloat16: return 5;
    case DType::kFloat32: return 6;
    case DType::kFloat64: return 7;
    case DType::kBFloat16: return 15;
  }
  return 6;
}

// torch's group key (reducer.cpp's BucketKey) and its hash,
// c10::get_hash(type, device): c10::hash_combine(hash(device), hash(type)),
// where a device hashes as std::hash<uint32_t> of (type << 16 | uint8 index)
// and a ScalarType as std::hash of its int8 value. torch iterates its
// std::unordered_map of these keys to emit the leftover buckets; the same
// map with the same hash, filled in the same order, iterates alike.
struct GroupKey {
  std::int8_t scalar_type;
  TorchDevice device;
  friend bool operator==(const GroupKey&, const GroupKey&) = default;
};

struct TorchGroupKeyHash {
  std::size_t operator()(const GroupKey& k) const {
    const std::uint32_t bits = static_cast<std::uint32_t>(k.device.type) << 16 |
                               static_cast<std::uint32_t>(static_cast<std::uint8_t>(k.device.index));
    const std::size_t seed = std::hash<std::uint32_t>{}(bits);
    const std::size_t value = std::hash<std::int8_t>{}(k.scalar_type);
    return seed ^ (value + 0x9e3779b9 + (seed << 6u) + (seed >> 2u));
  }
};

}  // namespace

std::optional<TorchDevice> parse_torch_device(std::string_view text) {
  if (text == "cpu") return kTorchCpu;
  if (text == "meta") return TorchDevice{14, -1};
  if (text == "cuda") return TorchDevice{1, -1};
  if (text.starts_with("cuda:") && text.size() > 5 && text.size() <= 8) {
    int n = 0;
    for (char c : text.substr(5)) {
      if (c < '0' || c > '9') return std::nullopt;
      n = n * 10 + (c - '0');
    }
    if (n < 128) return TorchDevice{1, static_cast<std::int8_t>(n)};
  }
  return std::nullopt;
}

BucketAssignment compute_bucket_assignment_by_size(std::span<const BucketTensor> tensors,
                                                   std::span<const std::uint64_t> size_limits,
                                                   std::span<const std::int64_t> tensor_indices) {
  if (size_limits.empty())
    throw UsageError("bucket assignment needs at least one bucket size limit",
                     ErrorContext{"buckets", -1, -1, "pass e.g. [first_bucket_bytes, cap_bytes]"});
  if (!tensor_indices.empty() && tensor_indices.size() != tensors.size())
    throw UsageError(fmt::format("bucket assignment: {} tensor indices for {} tensors",
                                 tensor_indices.size(), tensors.size()),
                     ErrorContext{"buckets", -1, -1, "give one index per tensor, or none"});
  for (std::size_t i = 0; i < tensor_indices.size(); ++i)
    if (tensor_indices[i] < 0)
      throw UsageError(fmt::format("bucket assignment: tensor index {} at position {} is negative",
                                   tensor_indices[i], i),
                       ErrorContext{"buckets", -1, -1, "indices name parameters: 0, 1, 2, ..."});

  BucketAssignment out;
  // The open bucket of each group, in a map as torch holds it: its
  // iteration order is the order of the leftovers (see the header).
  std::unordered_map<GroupKey, Group, TorchGroupKeyHash> groups;
  auto emit = [&](std::vector<std::size_t>&& idx, std::uint64_t limit) {
    out.buckets.push_back(std::move(idx));
    out.size_limits.push_back(limit);
  };

  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const BucketTensor& t = tensors[i];
    const std::size_t index =
        tensor_indices.empty() ? i : static_cast<std::size_t>(tensor_indices[i]);
    if (t.expects_sparse) {
      emit({index}, 0);
      continue;
    }
    Group& g = groups[GroupKey{torch_scalar_type(t.dtype), t.device}];
    g.indices.push_back(index);
    g.bytes += t.bytes;
    const std::uint64_t limit = size_limits[g.limit_pos];
    // ">=": a bucket that lands exactly on its limit closes.
    if (g.bytes >= limit) {
      emit(std::move(g.indices), limit);
      g.indices = {};
      g.bytes = 0;
      if (g.limit_pos + 1 < size_limits.size()) ++g.limit_pos;
    }
  }
  for (auto& [key, g] : groups)
    if (!g.indices.empty()) emit(std::move(g.indices), size_limits[g.limit_pos]);

  if (tensor_indices.empty()) {
    // Indices within a bucket ascend here, so a bucket's first index is its
    // smallest, and the smallest indices of two buckets never tie.
    std::vector<std::size_t> order(out.buckets.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return out.buckets[a].front() < out.buckets[b].front();
    });
    BucketAssignment sorted;
    sorted.buckets.reserve(order.size());
    sorted.size_limits.reserve(order.size());
    for (std::size_t k : order) {
      sorted.buckets.push_back(std::move(out.buckets[k]));
      sorted.size_limits.push_back(out.size_limits[k]);
    }
    return sorted;
  }
  return out;
}

namespace {

// DdpBuckets from an assignment whose tensor index i stands for
// layout.tensors[layout_index[i]].
std::vector<DdpBucket> to_ddp_buckets(const ModelLayout& layout, BucketAssignment a,
                                      const std::vector<std::size_t>& layout_index) {
  std::vector<DdpBucket> out;
  out.reserve(a.buckets.size());
  for (std::size_t b = 0; b < a.buckets.size(); ++b) {
    DdpBucket db;
    db.param_indices.reserve(a.buckets[b].size());
    for (std::size_t i : a.buckets[b]) db.param_indices.push_back(layout_index[i]);
    db.size_limit_bytes = a.size_limits[b];
    for (std::size_t p : db.param_indices) db.bytes += layout.tensors[p].bytes();
    db.dtype = layout.tensors[db.param_indices.front()].dtype;
    db.sparse = layout.tensors[db.param_indices.front()].expects_sparse;
    out.push_back(std::move(db));
  }
  return out;
}

BucketTensor bucket_tensor(const TensorSpec& s) {
  // Hashed as the CPU. The device only matters to the order of the
  // leftover buckets of a layout of three or more dtypes (torch iterates
  // its (dtype, device) map), and DDP runs the buckets rank 0 built: the
  // CPU and cuda:0 give the same order, while by the same hash cuda:2 or
  // cuda:6 would order some three-dtype mixes differently (not modelled).
  return BucketTensor{s.bytes(), s.dtype, kTorchCpu, s.expects_sparse};
}

// DDP's rebuilt buckets: the layout's tensors `order` (indices) passed
// with their indices explicitly, as rebuild_buckets passes them. With
// set_last_bucket_small (DDP_SET_LAST_BUCKET_CAP=1) DDP reverses that order
// before it assigns, and the buckets after: the first limit then applies to
// the bucket reduced last.
std::vector<DdpBucket> rebuilt_buckets(const ModelLayout& layout, std::vector<std::size_t> order,
                                       std::span<const std::uint64_t> limits, bool set_last_bucket_small) {
  const std::size_t n = layout.tensors.size();
  if (set_last_bucket_small) std::reverse(order.begin(), order.end());
  std::vector<BucketTensor> tensors;
  std::vector<std::int64_t> indices;
  tensors.reserve(order.size());
  indices.reserve(order.size());
  for (std::size_t k : order) {
    tensors.push_back(bucket_tensor(layout.tensors[k]));
    indices.push_back(static_cast<std::int64_t>(k));
  }
  // With explicit indices the assignment's entries are those indices.
  std::vector<std::size_t> identity(n);
  for (std::size_t k = 0; k < n; ++k) identity[k] = k;
  auto out = to_ddp_buckets(layout, compute_bucket_assignment_by_size(tensors, limits, indices), identity);
  if (set_last_bucket_small) std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<std::uint64_t> ddp_bucket_limits(std::uint64_t bucket_cap_bytes, std::uint64_t first_bucket_bytes) {
  return {first_bucket_bytes, bucket_cap_bytes};
}

std::vector<DdpBucket> ddp_buckets(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                   bool set_last_bucket_small) {
  // In the order backward makes the gradients ready (the layout's
  // ready_order: by default from the last parameter back to the first), as
  // DDP rebuilds its buckets after its first iteration. A frozen parameter
  // has none: DDP leaves it out of its reducer, so out of every bucket (the
  // indices stay those of the layout).
  return rebuilt_buckets(layout, layout.gradient_ready_order(), limits, set_last_bucket_small);
}

std::vector<DdpBucket> ddp_buckets_rebuilt_from(const ModelLayout& layout, std::span<const std::size_t> order,
                                                std::span<const std::uint64_t> limits,
                                                bool set_last_bucket_small) {
  std::vector<std::uint8_t> seen(layout.tensors.size(), 0);
  std::size_t trainable = 0;
  for (const auto& t : layout.tensors) trainable += t.requires_grad ? 1 : 0;
  for (std::size_t p : order) {
    if (p >= layout.tensors.size() || seen[p] || !layout.tensors[p].requires_grad)
      throw UsageError(fmt::format("a rebuild order names parameter index {} {} (layout '{}' of {} "
                                   "tensors)",
                                   p,
                                   p >= layout.tensors.size() ? "outside the layout"
                                   : seen[p]                  ? "twice"
                                                              : "that does not require grad",
                                   layout.name, layout.tensors.size()),
                       {"buckets", -1, -1, "list every trainable parameter once"});
    seen[p] = 1;
  }
  if (order.size() != trainable)
    throw UsageError(fmt::format("a rebuild order lists {} of the {} trainable parameters of layout '{}'",
                                 order.size(), trainable, layout.name),
                     {"buckets", -1, -1, "list every trainable parameter once"});
  return rebuilt_buckets(layout, std::vector<std::size_t>(order.begin(), order.end()), limits,
                         set_last_bucket_small);
}

std::vector<DdpBucket> ddp_buckets(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                   std::uint64_t first_bucket_bytes) {
  return ddp_buckets(layout, ddp_bucket_limits(bucket_cap_bytes, first_bucket_bytes));
}

std::vector<DdpBucket> ddp_buckets_static_graph(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                                bool set_last_bucket_small) {
  std::vector<std::size_t> order = layout.gradient_ready_order();
  const auto unused = layout.unused_in_backward();  // in registration order
  order.insert(order.end(), unused.begin(), unused.end());
  return rebuilt_buckets(layout, std::move(order), limits, set_last_bucket_small);
}

std::vector<DdpBucket> ddp_buckets_static_graph(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                                std::uint64_t first_bucket_bytes) {
  return ddp_buckets_static_graph(layout, ddp_bucket_limits(bucket_cap_bytes, first_bucket_bytes));
}

std::vector<DdpBucket> ddp_buckets_unrebuilt(const ModelLayout& layout, std::span<const std::uint64_t> limits) {
  // The trainable parameters in registration order, as DDP's parameter list
  // (a frozen one is not in it); the assignment's positions map back to the
  // layout's indices, in the same order, so its sort is the same.
  std::vector<BucketTensor> tensors;
  std::vector<std::size_t> layout_index;
  for (std::size_t k = 0; k < layout.tensors.size(); ++k) {
    if (!layout.tensors[k].requires_grad) continue;
    tensors.push_back(bucket_tensor(layout.tensors[k]));
    layout_index.push_back(k);
  }
  auto out = to_ddp_buckets(layout, compute_bucket_assignment_by_size(tensors, limits), layout_index);
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<DdpBucket> ddp_buckets_unrebuilt(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                             std::uint64_t first_bucket_bytes) {
  return ddp_buckets_unrebuilt(layout, ddp_bucket_limits(bucket_cap_bytes, first_bucket_bytes));
}

std::vector<DdpBucket> ddp_buckets_as_run(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                          bool find_unused_parameters, bool static_graph,
                                          bool set_last_bucket_small) {
  if (static_graph) return ddp_buckets_static_graph(layout, limits, set_last_bucket_small);
  // DDP never rebuilds these, so DDP_SET_LAST_BUCKET_CAP does not touch them.
  return find_unused_parameters ? ddp_buckets_unrebuilt(layout, limits)
                                : ddp_buckets(layout, limits, set_last_bucket_small);
}

std::vector<DdpBucket> ddp_buckets_as_run(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                          std::uint64_t first_bucket_bytes, bool find_unused_parameters,
                                          bool static_graph) {
  return ddp_buckets_as_run(layout, ddp_bucket_limits(bucket_cap_bytes, first_bucket_bytes),
                            find_unused_parameters, static_graph);
}

std::vector<DdpBucket> ddp_buckets_first_iteration(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                                   bool find_unused_parameters, bool static_graph, bool cap_list) {
  if (cap_list || (find_unused_parameters && !static_graph)) return ddp_buckets_unrebuilt(layout, limits);
  // torch's sys.maxsize
  const std::uint64_t unlimited[1] = {static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())};
  return ddp_buckets_unrebuilt(layout, unlimited);
}

std::vector<bool> buckets_all_unused(const ModelLayout& layout, const std::vector<DdpBucket>& buckets) {
  std::vector<bool> unused(layout.tensors.size(), false);
  for (std::size_t p : layout.unused_in_backward()) unused[p] = true;
  std::vector<bool> out;
  out.reserve(buckets.size());
  for (const auto& b : buckets)
    out.push_back(std::all_of(b.param_indices.begin(), b.param_indices.end(),
                              [&](std::size_t p) { return unused[p]; }));
  return out;
}

const DdpBucket& largest_bucket(const std::vector<DdpBucket>& buckets) {
  DDPDIAG_ASSERT(!buckets.empty());
  return *std::max_element(buckets.begin(), buckets.end(),
                           [](const DdpBucket& a, const DdpBucket& b) { return a.bytes < b.bytes; });
}

}  // namespace ddpdiag::ddp_core
