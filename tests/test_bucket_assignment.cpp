#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "comm/errors.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"

using namespace ddpdiag;
using namespace ddpdiag::ddp_core;

namespace {

using Buckets = std::vector<std::vector<std::size_t>>;

BucketTensor f32(std::uint64_t numel) { return BucketTensor{numel * 4, DType::kFloat32, 0, false}; }
BucketTensor f64(std::uint64_t numel) { return BucketTensor{numel * 8, DType::kFloat64, 0, false}; }

}  // namespace

TEST_CASE("a bucket closes when its bytes reach the limit exactly (>=)", "[buckets]") {
  // 4 tensors of 100 bytes, limit 200: [0,1] closes at exactly 200.
  std::vector<BucketTensor> t(4, f32(25));
  const std::uint64_t limits[] = {200};
  auto a = compute_bucket_assignment_by_size(t, limits);
  CHECK(a.buckets == Buckets{{0, 1}, {2, 3}});
  CHECK(a.size_limits == std::vector<std::uint64_t>{200, 200});

  // One byte more and three tensors fit: 100+100 = 200 < 201.
  const std::uint64_t limits2[] = {201};
  auto b = compute_bucket_assignment_by_size(t, limits2);
  CHECK(b.buckets == Buckets{{0, 1, 2}, {3}});
  CHECK(b.size_limits == std::vector<std::uint64_t>{201, 201});
}

TEST_CASE("tensors are never split: a bucket can exceed its limit", "[buckets]") {
  std::vector<BucketTensor> t = {f32(10), f32(1000), f32(10)};
  const std::uint64_t limits[] = {100};
  auto a = compute_bucket_assignment_by_size(t, limits);
  CHECK(a.buckets == Buckets{{0, 1}, {2}});
}

TEST_CASE("the limits list advances per group and stays on its last entry", "[buckets]") {
  // Limits [40, 200, 400] with 40-byte tensors: 1 tensor, then 5, then 10 each.
  std::vector<BucketTensor> t(26, f32(10));
  const std::uint64_t limits[] = {40, 200, 400};
  auto a = compute_bucket_assignment_by_size(t, limits);
  REQUIRE(a.buckets.size() == 4);
  CHECK(a.buckets[0].size() == 1);
  CHECK(a.buckets[1].size() == 5);
  CHECK(a.buckets[2].size() == 10);
  CHECK(a.buckets[3].size() == 10);
  CHECK(a.size_limits == std::vector<std::uint64_t>{40, 200, 400, 400});
}

TEST_CASE("dtypes form separate groups with their own limit positions", "[buckets]") {
  // f32 (100 B) and f64 (200 B) interleaved, limits [150, 400].
  std::vector<BucketTensor> t = {f32(25), f64(25), f32(25), f64(25), f32(25), f64(25), f32(25)};
  const std::uint64_t limits[] = {150, 400};
  auto a = compute_bucket_assignment_by_size(t, limits);
  // f32: [0,2] closes at 200 >= 150; then 4,6 = 200 < 400 stays open.
  // f64: [1] closes at 200 >= 150; then [3,5] = 400 >= 400 closes.
  // Sorted by smallest index.
  CHECK(a.buckets == Buckets{{0, 2}, {1}, {3, 5}, {4, 6}});
  CHECK(a.size_limits == std::vector<std::uint64_t>{150, 150, 400, 400});
}

TEST_CASE("devices form separate groups", "[buckets]") {
  std::vector<BucketTensor> t = {f32(25), f32(25), f32(25), f32(25)};
  t[1].device = *parse_torch_device("meta");
  t[3].device = *parse_torch_device("meta");
  const std::uint64_t limits[] = {200};
  auto a = compute_bucket_assignment_by_size(t, limits);
  CHECK(a.buckets == Buckets{{0, 2}, {1, 3}});
}

TEST_CASE("sparse tensors get a bucket of their own with limit 0", "[buckets]") {
  std::vector<BucketTensor> t = {f32(25), f32(25), f32(25), f32(25)};
  t[1].expects_sparse = true;
  const std::uint64_t limits[] = {1000};
  auto a = compute_bucket_assignment_by_size(t, limits);
  CHECK(a.buckets == Buckets{{0, 2, 3}, {1}});
  CHECK(a.size_limits == std::vector<std::uint64_t>{1000, 0});
}

TEST_CASE("explicit indices: no sort, leftovers in torch's hash-map order", "[buckets]") {
  // Reverse order as DDP's rebuild passes it.
  std::vector<BucketTensor> t = {f32(25), f64(10), f32(25), f32(25), f64(10)};
  const std::vector<std::int64_t> idx = {4, 3, 2, 1, 0};
  const std::uint64_t limits[] = {200};
  auto a = compute_bucket_assignment_by_size(t, limits, idx);
  // f32: 4,2 close at 200; 1 is left over. f64: 3,0 (160 B) are left over.
  // Leftovers come in the order torch 1.13 and 2.11 emit them (their
  // _compute_bucket_assignment_by_size on these tensors): f64, then f32,
  // the reverse of first appearance.
  CHECK(a.buckets == Buckets{{4, 2}, {3, 0}, {1}});
}

TEST_CASE("leftovers of many groups follow torch's map, not first appearance", "[buckets]") {
  // One tensor per group, all left open; the orders torch 1.13 and 2.11 give
  // (_compute_bucket_assignment_by_size with tensor_indices 0..n-1).
  auto order = [](std::vector<std::pair<DType, const char*>> groups) {
    std::vector<BucketTensor> t;
    std::vector<std::int64_t> idx;
    for (auto& [dt, dev] : groups) {
      t.push_back(BucketTensor{8, dt, *parse_torch_device(dev), false});
      idx.push_back(static_cast<std::int64_t>(idx.size()));
    }
    const std::uint64_t limits[] = {1u << 30};
    std::vector<std::size_t> out;
    for (auto& b : compute_bucket_assignment_by_size(t, limits, idx).buckets) out.push_back(b.front());
    return out;
  };
  CHECK(order({{DType::kFloat32, "cpu"}, {DType::kFloat16, "cpu"}}) == std::vector<std::size_t>{1, 0});
  CHECK(order({{DType::kBFloat16, "cpu"}, {DType::kFloat32, "cpu"}, {DType::kFloat64, "cpu"},
               {DType::kFloat16, "cpu"}}) == std::vector<std::size_t>{3, 2, 1, 0});
  // Groups on two devices with integer dtypes: neither first appearance nor
  // its reverse.
  CHECK(order({{DType::kUInt8, "meta"}, {DType::kFloat64, "meta"}, {DType::kInt64, "cpu"},
               {DType::kInt32, "cpu"}}) == std::vector<std::size_t>{3, 1, 2, 0});
}

TEST_CASE("torch device names", "[buckets]") {
  CHECK(parse_torch_device("cpu") == TorchDevice{0, -1});
  CHECK(parse_torch_device("meta") == TorchDevice{14, -1});
  CHECK(parse_torch_device("cuda:3") == TorchDevice{1, 3});
  CHECK_FALSE(parse_torch_device("cuda:x"));
  CHECK_FALSE(parse_torch_device("cuda:128"));
  CHECK_FALSE(parse_torch_device("gpu"));
}

TEST_CASE("bucket assignment rejects bad arguments", "[buckets]") {
  std::vector<BucketTensor> t = {f32(1), f32(1)};
  CHECK_THROWS_AS(compute_bucket_assignment_by_size(t, std::vector<std::uint64_t>{}), UsageError);
  const std::uint64_t limits[] = {10};
  CHECK_THROWS_AS(compute_bucket_assignment_by_size(t, limits, std::vector<std::int64_t>{0}),
                  UsageError);
  CHECK_THROWS_AS(compute_bucket_assignment_by_size(t, limits, std::vector<std::int64_t>{0, -1}),
                  UsageError);
  CHECK(compute_bucket_assignment_by_size({}, limits).buckets.empty());
}

TEST_CASE("ddp_buckets: reverse order, small first bucket, every parameter once", "[buckets]") {
  const auto layout = *model_preset("resnet50");
  auto buckets = ddp_buckets(layout, kDefaultBucketCapBytes, kDefaultFirstBucketBytes);
  REQUIRE(!buckets.empty());
  // The first bucket holds the last parameters: fc.bias, fc.weight (8 MB
  // >= 1 MiB closes it).
  CHECK(buckets[0].param_indices == std::vector<std::size_t>{160, 159});
  CHECK(buckets[0].size_limit_bytes == kDefaultFirstBucketBytes);
  std::vector<int> seen(layout.tensors.size(), 0);
  std::uint64_t total = 0;
  for (const auto& b : buckets) {
    total += b.bytes;
    for (auto p : b.param_indices) ++seen[p];
    // Only the last bucket may stay under its limit.
    if (&b != &buckets.back()) CHECK(b.bytes >= b.size_limit_bytes);
  }
  CHECK(total == layout.total_bytes());
  for (int s : seen) CHECK(s == 1);
  CHECK(buckets.back().param_indices.back() == 0);  // conv1.weight arrives last
}

TEST_CASE("ddp_buckets: frozen parameters are in no bucket", "[buckets]") {
  // torch 1.13.0 and 2.11.0, DistributedDataParallel (Gloo, one rank) of a
  // module with parameters [512, 784] and [512] frozen, then [10, 512] and
  // [10] (float32), default caps: from the second iteration on one bucket
  // holding parameters [3, 2] (recorded by a comm hook).
  ModelLayout layout;
  layout.name = "frozen-first-layer";
  layout.tensors = {{"0.weight", {512, 784}, DType::kFloat32, false, false},
                    {"0.bias", {512}, DType::kFloat32, false, false},
                    {"2.weight", {10, 512}, DType::kFloat32, false, true},
                    {"2.bias", {10}, DType::kFloat32, false, true}};
  auto buckets = ddp_buckets(layout, kDefaultBucketCapBytes, kDefaultFirstBucketBytes);
  REQUIRE(buckets.size() == 1);
  CHECK(buckets[0].param_indices == std::vector<std::size_t>{3, 2});
  CHECK(buckets[0].bytes == (10 * 512 + 10) * 4);
  // The frozen tensors' bytes do not count towards a bucket's cap either:
  // with a 20 KiB cap the trainable ones fill the first bucket alone.
  buckets = ddp_buckets(layout, 20 * 1024, 20 * 1024);
  REQUIRE(buckets.size() == 1);
  CHECK(buckets[0].param_indices == std::vector<std::size_t>{3, 2});
}

TEST_CASE("ddp_buckets with a cap larger than the model gives two buckets", "[buckets]") {
  const auto layout = *model_preset("mlp");
  auto buckets = ddp_buckets(layout, 1ull << 40, kDefaultFirstBucketBytes);
  REQUIRE(buckets.size() == 2);
  // 4.bias, 4.weight (40 KB), 2.bias, 2.weight (4 MB) reach 1 MiB.
  CHECK(buckets[0].param_indices == std::vector<std::size_t>{5, 4, 3, 2});
  CHECK(buckets[1].param_indices == std::vector<std::size_t>{1, 0});
}

TEST_CASE("ddp_buckets: a recorded ready order is the order buckets fill in", "[buckets]") {
  // conv (no bias), norm weight, norm bias, linear weight, linear bias; the
  // order torch's backward gives: linear bias, weight, norm weight, bias, conv.
  ModelLayout layout;
  layout.name = "conv-norm-linear";
  layout.tensors = {{"conv.weight", {100}, DType::kFloat32, false, true},
                    {"norm.weight", {10}, DType::kFloat32, false, true},
                    {"norm.bias", {10}, DType::kFloat32, false, true},
                    {"fc.weight", {50}, DType::kFloat32, false, true},
                    {"fc.bias", {5}, DType::kFloat32, false, true}};
  // Caps of 240 bytes: fc (220 B) + norm.weight (40 B) closes the first.
  auto indices = [&] {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : ddp_buckets(layout, 240, 240)) out.push_back(b.param_indices);
    return out;
  };
  CHECK(indices() == Buckets{{4, 3, 2}, {1, 0}});  // no order given: the exact reverse
  layout.ready_order = {4, 3, 1, 2, 0};
  CHECK(indices() == Buckets{{4, 3, 1}, {2, 0}});
}

TEST_CASE("ddp_buckets_static_graph: the ready order, then the unused in registration order",
          "[buckets]") {
  // What torch 2.x's and 1.13's DDP(static_graph=True) reduce from their third
  // iteration on: float32 tensors of 300000, 100000, 200000, 50000, 400000
  // and 10 elements, caps of 1 MiB (and 2 MiB with a 1 MiB first bucket).
  ModelLayout layout;
  layout.name = "six";
  for (std::int64_t numel : {300000, 100000, 200000, 50000, 400000, 10})
    layout.tensors.push_back({"p" + std::to_string(layout.tensors.size()), {numel}, DType::kFloat32, false, true});
  auto indices = [&](std::uint64_t cap, std::uint64_t first) {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : ddp_buckets_static_graph(layout, cap, first)) out.push_back(b.param_indices);
    return out;
  };
  constexpr std::uint64_t kMiB = 1 << 20;
  // Forward uses 2, 0, 1, 3, 4, 5: all used, as ddp_buckets.
  layout.ready_order = {5, 4, 3, 1, 0, 2};
  CHECK(indices(kMiB, kMiB) == Buckets{{5, 4}, {3, 1, 0}, {2}});
  CHECK(indices(kMiB, kMiB) == [&] {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : ddp_buckets(layout, kMiB, kMiB)) out.push_back(b.param_indices);
    return out;
  }());
  // Parameter 1 unused: after the used ones.
  layout.ready_order = {5, 4, 3, 0, 2};
  CHECK(indices(kMiB, kMiB) == Buckets{{5, 4}, {3, 0}, {2, 1}});
  // 0, 3 and 4 unused, listed by index whatever the forward order.
  layout.ready_order = {1, 5, 2};
  CHECK(indices(kMiB, kMiB) == Buckets{{1, 5, 2}, {0}, {3, 4}});
  // 4 and 0 unused, cap 2 MiB: torch 2.x (first bucket at the cap) and 1.13 (1 MiB).
  layout.ready_order = {3, 2, 1, 5};
  CHECK(indices(2 * kMiB, 2 * kMiB) == Buckets{{3, 2, 1, 5, 0}, {4}});
  CHECK(indices(2 * kMiB, kMiB) == Buckets{{3, 2, 1}, {5, 0, 4}});
  // ddp_buckets_as_run: static_graph wins over find_unused_parameters.
  std::vector<std::vector<std::size_t>> as_run;
  for (const auto& b : ddp_buckets_as_run(layout, 2 * kMiB, kMiB, true, true)) as_run.push_back(b.param_indices);
  CHECK(as_run == Buckets{{3, 2, 1}, {5, 0, 4}});
}

TEST_CASE("torch 2.x's bucket_cap_mb_list: a limit a bucket in order, the last repeating", "[buckets]") {
  // What torch 2.11's DDP(bucket_cap_mb_list=[...]) reduces: ten float32
  // tensors of 400 bytes, forward using 0, 2, 1, 3 .. 9 (so gradients ready
  // 9 .. 3, 1, 2, 0); lists in bytes.
  ModelLayout layout;
  layout.name = "ten";
  for (int i = 0; i < 10; ++i)
    layout.tensors.push_back({"p" + std::to_string(i), {100}, DType::kFloat32, false, true});
  layout.ready_order = {9, 8, 7, 6, 5, 4, 3, 1, 2, 0};
  auto indices = [](const std::vector<DdpBucket>& buckets) {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets) out.push_back(b.param_indices);
    return out;
  };
  const std::vector<std::uint64_t> two{800, 1200}, three{1200, 400, 2000};
  // Rebuilt from the ready order (the default, and after static_graph's second iteration).
  CHECK(indices(ddp_buckets(layout, two)) == Buckets{{9, 8}, {7, 6, 5}, {4, 3, 1}, {2, 0}});
  CHECK(indices(ddp_buckets(layout, three)) == Buckets{{9, 8, 7}, {6}, {5, 4, 3, 1, 2}, {0}});
  // A list of two is [first, cap]: the same buckets as the two numbers.
  CHECK(indices(ddp_buckets(layout, two)) == indices(ddp_buckets(layout, 1200, 800)));
  // The constructor's (find_unused_parameters, and every first iteration
  // with a list): parameter order, reversed.
  CHECK(indices(ddp_buckets_unrebuilt(layout, three)) == Buckets{{9}, {4, 5, 6, 7, 8}, {3}, {0, 1, 2}});
  CHECK(indices(ddp_buckets_as_run(layout, three, true, false)) == indices(ddp_buckets_unrebuilt(layout, three)));
  CHECK(indices(ddp_buckets_as_run(layout, three, false, true)) == indices(ddp_buckets(layout, three)));
  // Each bucket keeps the limit it was filled against.
  std::vector<std::uint64_t> limits;
  for (const auto& b : ddp_buckets(layout, three)) limits.push_back(b.size_limit_bytes);
  CHECK(limits == std::vector<std::uint64_t>{1200, 400, 2000, 2000});
  CHECK_THROWS_AS(ddp_buckets(layout, std::vector<std::uint64_t>{}), UsageError);
}

TEST_CASE("ddp_buckets_first_iteration: one bucket per dtype, or the constructor's", "[buckets]") {
  // Before DDP rebuilds: float64 tensors 0, 2, 4 and float32 1, 3 (400 B
  // each), limits [400, 800].
  ModelLayout layout;
  layout.name = "mixed";
  for (int i = 0; i < 5; ++i)
    layout.tensors.push_back({"p" + std::to_string(i), {i % 2 ? 100 : 50}, i % 2 ? DType::kFloat32 : DType::kFloat64,
                              false, true});
  auto indices = [](const std::vector<DdpBucket>& buckets) {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets) out.push_back(b.param_indices);
    return out;
  };
  const std::vector<std::uint64_t> limits{400, 800};
  // No limit: a bucket per dtype, by smallest index, reversed.
  for (bool static_graph : {false, true}) {
    const auto first = ddp_buckets_first_iteration(layout, limits, false, static_graph, false);
    CHECK(indices(first) == Buckets{{1, 3}, {0, 2, 4}});
    CHECK(first[0].size_limit_bytes == 9223372036854775807ull);  // torch's sys.maxsize
  }
  // find_unused_parameters: the constructor's buckets it keeps; a list: its limits.
  const auto kept = ddp_buckets_unrebuilt(layout, limits);
  CHECK(indices(ddp_buckets_first_iteration(layout, limits, true, false, false)) == indices(kept));
  CHECK(indices(ddp_buckets_first_iteration(layout, limits, false, false, true)) == indices(kept));
  CHECK(indices(ddp_buckets_first_iteration(layout, limits, false, true, true)) == indices(kept));
  // float64: [0] at 400 B, [2, 4] at 800; float32: [1], then 3 left open.
  CHECK(indices(kept) == Buckets{{3}, {2, 4}, {1}, {0}});
  // find_unused_parameters with static_graph rebuilds: one bucket per dtype first.
  CHECK(indices(ddp_buckets_first_iteration(layout, limits, true, true, false)) == Buckets{{1, 3}, {0, 2, 4}});
}

TEST_CASE("DDP_SET_LAST_BUCKET_CAP: the rebuilt buckets filled from the one reduced last", "[buckets]") {
  // Six float32 tensors of 400 B, gradients ready 5, 4, .., 0; limits
  // [first 500, cap 1000].
  ModelLayout layout;
  layout.name = "six";
  for (int i = 0; i < 6; ++i) layout.tensors.push_back({"p" + std::to_string(i), {100}, DType::kFloat32, false, true});
  auto indices = [](const std::vector<DdpBucket>& buckets) {
    std::vector<std::vector<std::size_t>> out;
    for (const auto& b : buckets) out.push_back(b.param_indices);
    return out;
  };
  auto limits_of = [](const std::vector<DdpBucket>& buckets) {
    std::vector<std::uint64_t> out;
    for (const auto& b : buckets) out.push_back(b.size_limit_bytes);
    return out;
  };
  const std::vector<std::uint64_t> limits{500, 1000};
  // Without it: [5, 4] closes at 800 >= 500, [3, 2, 1] at 1200 >= 1000, [0] left.
  CHECK(indices(ddp_buckets(layout, limits)) == Buckets{{5, 4}, {3, 2, 1}, {0}});
  // With it, torch assigns 0, 1, .., 5: [0, 1] under 500, [2, 3, 4] under
  // 1000, [5] left; then reverses the buckets: the small one is reduced last.
  const auto last = ddp_buckets(layout, limits, true);
  CHECK(indices(last) == Buckets{{5}, {2, 3, 4}, {0, 1}});
  CHECK(limits_of(last) == std::vector<std::uint64_t>{1000, 1000, 500});
  // static_graph rebuilds too; the buckets DDP keeps unrebuilt
  // (find_unused_parameters alone) are as without it.
  CHECK(indices(ddp_buckets_as_run(layout, limits, false, true, true)) == indices(last));
  CHECK(indices(ddp_buckets_as_run(layout, limits, false, false, true)) == indices(last));
  CHECK(indices(ddp_buckets_as_run(layout, limits, true, false, true)) == indices(ddp_buckets_unrebuilt(layout, limits)));
}
