// DDP bucket assignment: PyTorch's compute_bucket_assignment_by_size
// (torch/csrc/distributed/c10d/reducer.cpp; Python:
// torch.distributed._compute_bucket_assignment_by_size), reimplemented as a
// pure function that gives the same buckets index for index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "comm/types.h"
#include "ddp_core/model_layout.h"

namespace ddpdiag::ddp_core {

// DDP's defaults: bucket_cap_mb=25, and dist._DEFAULT_FIRST_BUCKET_BYTES
// (1 MiB) for the first bucket, which is small so that the first gradients
// of backward start communicating early.
inline constexpr std::uint64_t kDefaultBucketCapBytes = 25ull * 1024 * 1024;
inline constexpr std::uint64_t kDefaultFirstBucketBytes = 1ull * 1024 * 1024;

// A device as torch keys its bucket groups by: c10::DeviceType's number
// (CPU 0, CUDA 1, Meta 14) and the index (-1 where the device has none, as
// "cpu" and "meta").
struct TorchDevice {
  std::uint8_t type = 0;
  std::int8_t index = -1;
  friend bool operator==(const TorchDevice&, const TorchDevice&) = default;
};

inline constexpr TorchDevice kTorchCpu{0, -1};

// "cpu", "meta", "cuda" or "cuda:N" (N < 128); nullopt for anything else.
std::optional<TorchDevice> parse_torch_device(std::string_view text);

struct BucketTensor {
  std::uint64_t bytes = 0;  // numel * element size
  DType dtype = DType::kFloat32;
  TorchDevice device = kTorchCpu;
  // This tensor's gradient is sparse: it gets a bucket of its own (size
  // limit 0). With explicit indices torch reads the flag of parameter
  // tensor_indices[i]; here the flag travels with the tensor at position i,
  // which is the same thing.
  bool expects_sparse = false;
};

struct BucketAssignment {
  // Tensor indices (position i, or tensor_indices[i] when given), in the
  // order the tensors were added.
  std::vector<std::vector<std::size_t>> buckets;
  // The size limit each bucket was filled against (0 for sparse buckets).
  std::vector<std::uint64_t> size_limits;
};

// The algorithm, for each tensor in input order:
//  - sparse: a bucket of its own;
//  - otherwise it joins the open bucket of its (dtype, device) group; that
//    group's limit is the next unused entry of size_limits (staying on the
//    last one); when the bucket's bytes reach >= the limit it closes and the
//    group moves on to the next limit. Tensors are never split.
// Open buckets left at the end are emitted. Without tensor_indices the
// buckets are sorted by their smallest tensor index. With tensor_indices
// (the gradient-ready order, as DDP's rebuild passes it) there is no sort:
// closed buckets stay in closing order and the leftovers follow in the
// iteration order of torch's group map: a std::unordered_map keyed by
// (dtype, device) with c10's hash, which is reproduced here with the same
// hash and the same standard library. For groups of floating-point dtypes on
// one device that order is the reverse of the order the groups were first
// seen.
// Throws UsageError when size_limits is empty or tensor_indices has the
// wrong length. Empty input gives no buckets (torch asserts instead).
BucketAssignment compute_bucket_assignment_by_size(std::span<const BucketTensor> tensors,
                                                   std::span<const std::uint64_t> size_limits,
                                                   std::span<const std::int64_t> tensor_indices = {});

// One bucket as DDP builds it for a model.
struct DdpBucket {
  // Parameter indices into layout.tensors, in gradient-ready order, as DDP's
  // reducer holds them.
  std::vector<std::size_t> param_indices;
  std::uint64_t bytes = 0;
  std::uint64_t size_limit_bytes = 0;
  DType dtype = DType::kFloat32;
  bool sparse = false;
  std::size_t tensor_count() const { return param_indices.size(); }
};

// The buckets DDP ends up with for a layout once it has rebuilt them from
// the observed gradient order (from the second iteration on): limits
// [first_bucket_bytes, bucket_cap_bytes] over the parameters in the
// layout's gradient ready order (ModelLayout::gradient_ready_order), with
// their indices passed explicitly. Bucket 0 is the first to be reduced.
// Frozen tensors (requires_grad false) are in no bucket, as in DDP; a layout
// with no trainable tensor gives no buckets.
std::vector<DdpBucket> ddp_buckets(const ModelLayout& layout,
                                   std::uint64_t bucket_cap_bytes = kDefaultBucketCapBytes,
                                   std::uint64_t first_bucket_bytes = kDefaultFirstBucketBytes);

// The buckets DDP builds in its constructor, which it keeps for the whole
// run when it never rebuilds them: with find_unused_parameters=True (and no
// static_graph), torch's Reducer::should_rebuild_buckets() is false. Limits
// [first_bucket_bytes, bucket_cap_bytes] over the trainable parameters in
// registration order (no explicit indices, so buckets sorted by their
// smallest index), and the list reversed, as DDP passes it to its reducer:
// bucket 0 (the first reduced) holds the last parameters, and the bucket of
// parameter 0, under the first limit, is reduced last. Within a bucket the
// parameters stay in registration order. The layout's ready_order plays no
// part, as in DDP.
std::vector<DdpBucket> ddp_buckets_unrebuilt(const ModelLayout& layout,
                                             std::uint64_t bucket_cap_bytes = kDefaultBucketCapBytes,
                                             std::uint64_t first_bucket_bytes = kDefaultFirstBucketBytes);

// The buckets DDP rebuilds with static_graph=True (find_unused_parameters
// or not): from the order of its second iteration, the parameters whose
// gradients backward made ready (the layout's ready order), then those it
// never reached (unused_in_backward), in registration order, with their
// indices passed explicitly as in ddp_buckets(). DDP runs its first two
// iterations with one bucket per dtype and these from the third on. Checked
// against torch 1.13's and 2.x's DDP.
std::vector<DdpBucket> ddp_buckets_static_graph(const ModelLayout& layout,
                                                std::uint64_t bucket_cap_bytes = kDefaultBucketCapBytes,
                                                std::uint64_t first_bucket_bytes = kDefaultFirstBucketBytes);

// The buckets DDP reduces for the whole run (once rebuilt):
// ddp_buckets_static_graph() with static_graph, else ddp_buckets_unrebuilt()
// with find_unused_parameters (DDP never rebuilds them then), else
// ddp_buckets().
std::vector<DdpBucket> ddp_buckets_as_run(const ModelLayout& layout, std::uint64_t bucket_cap_bytes,
                                          std::uint64_t first_bucket_bytes, bool find_unused_parameters,
                                          bool static_graph = false);

// DDP's bucket size limits, in bytes, for the variants below that take
// them: compute_bucket_assignment_by_size walks them per dtype, staying on
// the last. [first_bucket_bytes, bucket_cap_bytes] by default; torch 2.x's
// DDP(bucket_cap_mb_list=[...]) gives its list (each int(mb * 1024 * 1024))
// in their place, for its constructor's buckets and when it rebuilds them.
std::vector<std::uint64_t> ddp_bucket_limits(std::uint64_t bucket_cap_bytes, std::uint64_t first_bucket_bytes);

// The same buckets as above for any limits: ddp_buckets(layout, cap, first)
// is ddp_buckets(layout, ddp_bucket_limits(cap, first)), and so on. Throws
// UsageError for empty limits.
//
// set_last_bucket_small: the environment variable DDP_SET_LAST_BUCKET_CAP=1,
// which DDP's reducer reads (torch 1.13 and 2.x) and applies when it
// rebuilds its buckets (not to its constructor's, so not with
// find_unused_parameters alone): it reverses the parameters' order before
// it assigns them and the buckets after, so the limits are walked from the
// bucket reduced last: the first limit (the small first bucket) goes to the
// last bucket, each bucket keeps its parameters in the reversed order, and
// a dtype's leftover bucket is reduced first. Checked against torch 1.13's
// and 2.x's DDP.
std::vector<DdpBucket> ddp_buckets(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                   bool set_last_bucket_small = false);
std::vector<DdpBucket> ddp_buckets_unrebuilt(const ModelLayout& layout, std::span<const std::uint64_t> limits);
std::vector<DdpBucket> ddp_buckets_static_graph(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                                bool set_last_bucket_small = false);
std::vector<DdpBucket> ddp_buckets_as_run(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                          bool find_unused_parameters, bool static_graph = false,
                                          bool set_last_bucket_small = false);

// The buckets DDP rebuilds from an observed gradient order: `order` lists
// every trainable parameter of the layout once (indices into
// layout.tensors), in the order DDP recorded them (rank 0's, which DDP's
// rebuild broadcasts to every rank), passed with their indices explicitly.
// ddp_buckets() is this with the layout's ready order, and
// ddp_buckets_static_graph() with the ready order followed by the parameters
// backward never reaches. Throws UsageError unless `order` is a permutation
// of the layout's trainable parameters.
std::vector<DdpBucket> ddp_buckets_rebuilt_from(const ModelLayout& layout, std::span<const std::size_t> order,
                                                std::span<const std::uint64_t> limits,
                                                bool set_last_bucket_small = false);

// The buckets DDP reduces before it rebuilds them: in its first iteration,
// and in its first two with static_graph. Those its constructor fills, in
// registration order, reversed (ddp_buckets_unrebuilt): with `limits` when
// find_unused_parameters is set without static_graph (DDP keeps them then)
// or when `limits` is a torch 2.x bucket_cap_mb_list (cap_list); otherwise
// with no limit, one bucket per dtype (torch's [sys.maxsize]). Checked
// against torch 1.13's and 2.x's DDP.
std::vector<DdpBucket> ddp_buckets_first_iteration(const ModelLayout& layout, std::span<const std::uint64_t> limits,
                                                   bool find_unused_parameters, bool static_graph, bool cap_list);

// torch 2.x's DDP(skip_all_reduce_unused_params=True): for each bucket,
// whether every parameter in it is one backward never reaches
// (layout.unused_in_backward()), so that DDP issues no all_reduce for it.
std::vector<bool> buckets_all_unused(const ModelLayout& layout, const std::vector<DdpBucket>& buckets);

// The bucket with the most bytes (the first of equals); `buckets` is not empty.
const DdpBucket& largest_bucket(const std::vector<DdpBucket>& buckets);

}  // namespace ddpdiag::ddp_core
