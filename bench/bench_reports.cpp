// Writing the JSON report of a 4,096-rank run: a report with every rank's
// identity and, per rank, a 20-size sweep of times (what allreduce-test and
// link-health record at scale), built, serialised and written atomically.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "reports/report.h"

namespace {

using namespace ddpdiag;

constexpr int kSizes = 20;

reports::Report make_report(int ranks) {
  reports::Report r("allreduce-test", {"ddpdiag", "allreduce-test", "-b", "8", "-e", "4G"});
  std::vector<reports::RankInfo> info;
  info.reserve(static_cast<std::size_t>(ranks));
  for (int i = 0; i < ranks; ++i)
    info.push_back({i, i % 8, "node" + std::to_string(i / 8), 100000 + i,
                    "cuda:" + std::to_string(i % 8) + " NVIDIA H200", ""});
  r.set_world(ranks, "nccl", "torchrun", info, {{"nccl", "2.28.9"}});
  auto& sizes = r.results()["sizes"];
  sizes = nlohmann::json::array();
  for (int s = 0; s < kSizes; ++s) {
    nlohmann::json per_rank = nlohmann::json::array();
    for (int i = 0; i < ranks; ++i) per_rank.push_back(12.5 + 0.001 * i + s);
    sizes.push_back({{"bytes", 8ULL << s}, {"time_us", 12.5 + s}, {"per_rank_time_us", per_rank}});
  }
  r.add_check({"correctness", reports::CheckStatus::kPass, "0 wrong element(s)"});
  return r;
}

void BM_ReportBuild(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  for (auto _ : state) benchmark::DoNotOptimize(make_report(ranks).finish());
}
BENCHMARK(BM_ReportBuild)->Arg(4096)->Unit(benchmark::kMillisecond);

void BM_ReportWrite(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const auto doc = make_report(ranks).finish();
  const std::string path = "/tmp/ddpdiag_bench_report_" + std::to_string(::getpid()) + ".json";
  std::size_t bytes = 0;
  for (auto _ : state) {
    const std::string text = doc.dump(2);
    bytes = text.size();
    reports::write_file_atomic(path, text);
  }
  std::remove(path.c_str());
  state.counters["file_bytes"] = static_cast<double>(bytes);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}
BENCHMARK(BM_ReportWrite)->Arg(4096)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
