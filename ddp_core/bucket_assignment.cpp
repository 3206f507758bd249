#include "ddp_core/bucket_assignment.h"

#include <algorithm>
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

}  // namespace

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
  // Groups in the order first seen: this is the leftover order with
  // explicit indices (see the header).
  std::vector<Group> groups;
  std::unordered_map<std::uint64_t, std::size_t> group_of;  // (dtype, device) -> groups index
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
    const std::uint64_t key = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t.device))
                               << 8) |
                              static_cast<std::uint64_t>(t.dtype);
    auto [it, inserted] = group_of.try_emplace(key, groups.size());
    if (inserted) groups.emplace_back();
    Group& g = groups[it->second];
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
  for (Group& g : groups)
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

std::vector<DdpBucket> ddp_buckets(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                   std::uint64_t first_bucket_bytes) {
  const std::size_t n = layout.tensors.size();
  std::vector<BucketTensor> tensors;
  std::vector<std::int64_t> indices;
  tensors.reserve(n);
  indices.reserve(n);
  // Gradients become ready from the last layer back to the first. A frozen
  // parameter has none: DDP leaves it out of its reducer, so out of every
  // bucket (the indices stay those of the layout).
  for (std::size_t k = n; k-- > 0;) {
    const TensorSpec& s = layout.tensors[k];
    if (!s.requires_grad) continue;
    tensors.push_back(BucketTensor{s.bytes(), s.dtype, 0, s.expects_sparse});
    indices.push_back(static_cast<std::int64_t>(k));
  }
  const std::uint64_t limits[2] = {first_bucket_bytes, bucket_cap_bytes};
  BucketAssignment a = compute_bucket_assignment_by_size(tensors, limits, indices);
  std::vector<DdpBucket> out;
  out.reserve(a.buckets.size());
  for (std::size_t b = 0; b < a.buckets.size(); ++b) {
    DdpBucket db;
    db.param_indices = std::move(a.buckets[b]);
    db.size_limit_bytes = a.size_limits[b];
    for (std::size_t p : db.param_indices) db.bytes += layout.tensors[p].bytes();
    db.dtype = layout.tensors[db.param_indices.front()].dtype;
    db.sparse = layout.tensors[db.param_indices.front()].expects_sparse;
    out.push_back(std::move(db));
  }
  return out;
}

const DdpBucket& largest_bucket(const std::vector<DdpBucket>& buckets) {
  DDPDIAG_ASSERT(!buckets.empty());
  return *std::max_element(buckets.begin(), buckets.end(),
                           [](const DdpBucket& a, const DdpBucket& b) { return a.bytes < b.bytes; });
}

}  // namespace ddpdiag::ddp_core
