// Micro-benchmarks of ddp_core's pure parts: bucket assignment over many
// tensors, sampler index generation (torch-exact and streaming), the host
// flatten/unflatten of a bucket, and the host reduction the Gloo backend
// hands to gloo::allreduce (against gloo::sum, which bare Gloo and torch's
// ProcessGroupGloo hand it).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>
#include <gloo/math.h>

#include "comm/stream_ops.h"
#include "comm/types.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"
#include "ddp_core/sampler.h"

namespace {

using namespace ddpdiag;
using namespace ddpdiag::ddp_core;

std::vector<BucketTensor> random_tensors(std::size_t n) {
  std::mt19937_64 rng(1);
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
  std::vector<BucketTensor> t(n);
  for (auto& x : t) {
    x.dtype = dtypes[rng() % 3];
    x.bytes = (rng() % 4096 + 1) * 1024;
    x.expects_sparse = rng() % 1000 == 0;
  }
  return t;
}

void BM_BucketAssignment(benchmark::State& state) {
  const auto tensors = random_tensors(static_cast<std::size_t>(state.range(0)));
  const std::uint64_t limits[] = {kDefaultFirstBucketBytes, kDefaultBucketCapBytes};
  for (auto _ : state) {
    auto a = compute_bucket_assignment_by_size(tensors, limits);
    benchmark::DoNotOptimize(a);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_BucketAssignment)->Arg(100000)->Unit(benchmark::kMillisecond);

void BM_BucketAssignmentExplicitIndices(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto tensors = random_tensors(n);
  std::vector<std::int64_t> idx(n);
  for (std::size_t i = 0; i < n; ++i) idx[i] = static_cast<std::int64_t>(n - 1 - i);
  const std::uint64_t limits[] = {kDefaultFirstBucketBytes, kDefaultBucketCapBytes};
  for (auto _ : state) {
    auto a = compute_bucket_assignment_by_size(tensors, limits, idx);
    benchmark::DoNotOptimize(a);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_BucketAssignmentExplicitIndices)->Arg(100000)->Unit(benchmark::kMillisecond);

SamplerOptions sampler_options(std::int64_t n) {
  SamplerOptions o;
  o.dataset_size = n;
  o.world_size = 8;
  o.rank = 3;
  o.seed = 42;
  o.epoch = 1;
  return o;
}

// One rank's full list, as list(iter(DistributedSampler)) produces it: the
// whole randperm of N, then every R-th index.
void BM_SamplerTorchExact(benchmark::State& state) {
  const auto o = sampler_options(state.range(0));
  for (auto _ : state) {
    auto v = distributed_sampler_indices(o);
    benchmark::DoNotOptimize(v.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0) / o.world_size);
}
BENCHMARK(BM_SamplerTorchExact)->Arg(10'000'000)->Unit(benchmark::kMillisecond);

void BM_SamplerStreaming(benchmark::State& state) {
  const auto o = sampler_options(state.range(0));
  for (auto _ : state) {
    StreamingSampler s(o);
    std::int64_t sum = 0;
    while (auto v = s.next()) sum += *v;
    benchmark::DoNotOptimize(sum);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0) / o.world_size);
}
BENCHMARK(BM_SamplerStreaming)->Arg(10'000'000)->Unit(benchmark::kMillisecond);

void BM_Randperm(benchmark::State& state) {
  std::vector<std::uint32_t> r(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) {
    randperm_into(std::span<std::uint32_t>(r), 42, TorchVersion::k1_13);
    benchmark::DoNotOptimize(r.data());
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Randperm)->Arg(10'000'000)->Unit(benchmark::kMillisecond);

// Flatten/unflatten of DDP's largest resnet50 bucket (default 25 MiB cap)
// with its real tensors, on host memory, against one memcpy of the same
// bytes: the ratio is what the per-tensor copies cost over a bare copy.
struct BucketCopy {
  std::vector<std::vector<std::uint8_t>> tensors;
  std::vector<std::uint8_t> flat;
  std::vector<ddpdiag::FlatPiece> pieces;
};

BucketCopy largest_resnet50_bucket() {
  const auto layout = *model_preset("resnet50");
  const auto buckets = ddp_buckets(layout, kDefaultBucketCapBytes, kDefaultFirstBucketBytes);
  const DdpBucket* big = &largest_bucket(buckets);
  BucketCopy c;
  c.flat.assign(big->bytes, 1);
  std::uint64_t off = 0;
  c.tensors.reserve(big->param_indices.size());
  for (std::size_t p : big->param_indices) {
    const auto bytes = layout.tensors[p].bytes();
    c.tensors.emplace_back(bytes, 2);
    c.pieces.push_back({c.tensors.back().data(), off, bytes});
    off += bytes;
  }
  return c;
}

void BM_FlattenHost(benchmark::State& state) {
  auto c = largest_resnet50_bucket();
  for (auto _ : state) {
    if (state.range(0) == 0)
      ddpdiag::host_ops::flatten(c.flat.data(), c.pieces);
    else
      ddpdiag::host_ops::unflatten(c.flat.data(), c.pieces);
    benchmark::ClobberMemory();
  }
  state.counters["tensors"] = static_cast<double>(c.pieces.size());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * c.flat.size()));
  state.SetLabel(state.range(0) == 0 ? "flatten" : "unflatten");
}
BENCHMARK(BM_FlattenHost)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

void BM_MemcpyHostSameBytes(benchmark::State& state) {
  auto c = largest_resnet50_bucket();
  std::vector<std::uint8_t> src(c.flat.size(), 3);
  for (auto _ : state) {
    std::memcpy(c.flat.data(), src.data(), src.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * c.flat.size()));
}
BENCHMARK(BM_MemcpyHostSameBytes)->Unit(benchmark::kMicrosecond);

// float32 sum in place (out == a), as Gloo's ring reduces each received
// segment into its buffer; Arg = bytes: 512 KiB stays in cache (a segment),
// 64 MiB streams from memory. Bytes processed count the three streams.
using ReduceFn = void (*)(void*, const void*, const void*, std::size_t);

void reduce_bench(benchmark::State& state, ReduceFn fn) {
  const std::size_t n = static_cast<std::size_t>(state.range(0)) / sizeof(float);
  std::vector<float> a(n, 1.0f), b(n, 2.0f);
  for (auto _ : state) {
    fn(a.data(), a.data(), b.data(), n);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * sizeof(float) * 3));
}

void BM_ReduceHostFloatSum(benchmark::State& state) {
  reduce_bench(state, [](void* o, const void* a, const void* b, std::size_t n) {
    ddpdiag::reduce_host(DType::kFloat32, ReduceOp::kSum, o, a, b, n);
  });
}
BENCHMARK(BM_ReduceHostFloatSum)->Arg(512 << 10)->Arg(64 << 20)->Unit(benchmark::kMicrosecond);

void BM_GlooSumFloat(benchmark::State& state) {
  // Through a function pointer, as Gloo calls it.
  static volatile ReduceFn fn = static_cast<ReduceFn>(&gloo::sum<float>);
  reduce_bench(state, fn);
}
BENCHMARK(BM_GlooSumFloat)->Arg(512 << 10)->Arg(64 << 20)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
