// Micro-benchmarks of ddp_core's pure parts: bucket assignment over many
// tensors, and sampler index generation (torch-exact and streaming).
#include <cstdint>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include "ddp_core/bucket_assignment.h"
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

}  // namespace

BENCHMARK_MAIN();
