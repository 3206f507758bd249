// What the harness costs: ddpdiag's all_reduce loop (Communicator on Gloo,
// ops launched back to back and ended by one wait, as allreduce-test times
// them) against a bare loop of gloo::allreduce calls on the same buffers,
// 2 ranks on this machine, 4 B to 64 MiB.
//
// Three views. paired/SIZE: one bare and one ddpdiag batch per iteration,
// side by side, and the median over 21 pairs of ours/bare time: on a shared
// 2-core machine a 2-rank op's time swings by tens of percent from second
// to second, and pairing is what keeps that out of the ratio.
// harness_cost_ws1[_monitored]/SIZE: the same two loops at world size 1,
// where nothing crosses the network, so ours - bare is the harness's own
// cost per op (plain, and wrapped as the commands wrap it); divide it by a
// 2-rank op's time for the harness's share without the network's noise.
// bare_gloo, ddpdiag, ddpdiag_wait_each: each loop on its own (medians of
// 5 repetitions), the last waiting on every op (the hand-off's cost).
//
// The binary starts its own two ranks (it forks itself; rank 1's output is
// discarded, --benchmark_out included: only rank 0 writes that file). Both ranks must run exactly the same collectives, so every
// benchmark has a fixed iteration and repetition count: Google Benchmark's
// automatic iteration estimate differs between processes and would
// deadlock them. Time is manual: one batch of K all_reduces per iteration.
//
// Run: build/bench/ddpdiag_bench_allreduce_overhead [--benchmark_format=json ...]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>

#include "comm/communicator.h"
#include "comm/monitored_communicator.h"
#include "comm/store/tcp_store.h"

namespace {

using namespace ddpdiag;
using Clock = std::chrono::steady_clock;

// Gloo's store interface over ours, for the bare context.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  explicit GlooStore(std::shared_ptr<ddpdiag::Store> s) : s_(std::move(s)) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto b = s_->get(key, std::chrono::seconds(60));
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    s_->wait(keys, std::chrono::seconds(60));
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    s_->wait(keys, t);
  }

 private:
  std::shared_ptr<ddpdiag::Store> s_;
};

struct Rank {
  int rank = 0;
  std::shared_ptr<gloo::Context> bare;
  std::unique_ptr<Communicator> comm;
  // World size 1 (this rank alone): the same two loops with no network,
  // so what is left of ours over bare is the harness's own cost per op.
  std::shared_ptr<gloo::Context> solo_bare;
  std::unique_ptr<Communicator> solo;
  // The same wrapped as every ddpdiag command wraps it: sequence numbers,
  // fingerprints, the flight record and the watchdog thread.
  std::unique_ptr<Communicator> solo_monitored;
  float* buf = nullptr;  // shared by both loops: the same memory, the same sizes
};
Rank* g_rank = nullptr;  // benchmark functions take no context argument

constexpr std::size_t kMaxBytes = 64u << 20;

// Ops per timed batch: enough that small sizes are not dominated by the
// clock, few enough that 64 MiB stays quick on two cores.
int batch_for(std::size_t bytes) {
  if (bytes <= (16u << 10)) return 200;
  if (bytes <= (256u << 10)) return 50;
  if (bytes <= (1u << 20)) return 20;
  if (bytes <= (4u << 20)) return 10;
  if (bytes <= (16u << 20)) return 4;
  return 2;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

// Plain figures from the measured batch times (no rate flags, so the
// console shows them in the units their names say).
void report(benchmark::State& state, std::size_t bytes, int batch, double total_s) {
  const double ops = static_cast<double>(state.iterations()) * batch;
  const double factor = busbw_factor(Collective::kAllReduce, 2);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["us_per_op"] = total_s * 1e6 / ops;
  state.counters["busbw_GBps"] = static_cast<double>(bytes) * factor * ops / total_s / 1e9;
}

// Seconds per op of `batch` bare gloo::allreduce calls on ctx, in place.
double bare_loop(const std::shared_ptr<gloo::Context>& ctx, std::size_t count, int batch) {
  const auto t0 = Clock::now();
  for (int i = 0; i < batch; ++i) {
    gloo::AllreduceOptions o(ctx);
    o.setOutput(g_rank->buf, count);
    o.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    gloo::allreduce(o);
  }
  return std::chrono::duration<double>(Clock::now() - t0).count() / batch;
}

// Seconds per op of ddpdiag's loop: `batch` all_reduces launched back to
// back and one wait on the last, in place, as allreduce-test times them.
double ours_loop(Communicator& comm, std::size_t count, int batch) {
  // As allreduce-test times a block: every op issued back to back, then one
  // wait, on the last.
  const auto t0 = Clock::now();
  std::shared_ptr<Work> last;
  for (int i = 0; i < batch; ++i)
    last = comm.allreduce(g_rank->buf, g_rank->buf, count, DType::kFloat32, ReduceOp::kSum);
  last->wait(std::chrono::seconds(60));
  return std::chrono::duration<double>(Clock::now() - t0).count() / batch;
}

void barrier_bare() {
  gloo::BarrierOptions bo(g_rank->bare);
  gloo::barrier(bo);
}

void barrier_ours() { g_rank->comm->barrier()->wait(std::chrono::seconds(60)); }

void BM_BareGloo(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const int batch = batch_for(bytes);
  double total_s = 0;
  for (auto _ : state) {
    barrier_bare();
    const double dt = bare_loop(g_rank->bare, bytes / sizeof(float), batch) * batch;
    state.SetIterationTime(dt);
    total_s += dt;
  }
  report(state, bytes, batch, total_s);
}

void BM_Ddpdiag(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const int batch = batch_for(bytes);
  double total_s = 0;
  for (auto _ : state) {
    barrier_ours();
    const double dt = ours_loop(*g_rank->comm, bytes / sizeof(float), batch) * batch;
    state.SetIterationTime(dt);
    total_s += dt;
  }
  report(state, bytes, batch, total_s);
}

// Per iteration one bare and one ddpdiag batch back to back, the order
// alternating, so that a change of load on this shared machine hits both of
// a pair alike. Returns each side's seconds per op, one entry per iteration.
struct Pairs {
  std::vector<double> bare, ours;
};
template <typename Bare, typename Ours>
Pairs run_pairs(benchmark::State& state, int batch, Bare bare_batch, Ours ours_batch) {
  Pairs p;
  for (auto _ : state) {
    double b = 0, o = 0;
    if (p.bare.size() % 2 == 0) {
      b = bare_batch();
      o = ours_batch();
    } else {
      o = ours_batch();
      b = bare_batch();
    }
    p.bare.push_back(b);
    p.ours.push_back(o);
    state.SetIterationTime((b + o) * batch);
  }
  state.counters["bare_us"] = median_of(p.bare) * 1e6;
  state.counters["ours_us"] = median_of(p.ours) * 1e6;
  return p;
}

// 2 ranks side by side. Counters: the median time per op of each, and the
// median over pairs of ours / bare (time; > 1 means the harness is slower,
// and the busbw ratio is 1 / it).
void BM_Paired(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t count = bytes / sizeof(float);
  const int batch = batch_for(bytes);
  const Pairs p = run_pairs(
      state, batch,
      [&] {
        barrier_bare();
        return bare_loop(g_rank->bare, count, batch);
      },
      [&] {
        barrier_ours();
        return ours_loop(*g_rank->comm, count, batch);
      });
  std::vector<double> ratio;
  for (std::size_t i = 0; i < p.bare.size(); ++i) ratio.push_back(p.ours[i] / p.bare[i]);
  const double factor = busbw_factor(Collective::kAllReduce, 2);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["bare_busbw_GBps"] = static_cast<double>(bytes) * factor / median_of(p.bare) / 1e9;
  state.counters["ours_busbw_GBps"] = static_cast<double>(bytes) * factor / median_of(p.ours) / 1e9;
  state.counters["ours_over_bare"] = median_of(ratio);
}

// The harness's own cost per op, at world size 1 where Gloo sends nothing:
// ours (queue, worker hand-off, completion) minus bare gloo::allreduce, both
// in place, paired as above. Divided by a 2-rank op's time (paired/...) it is
// the harness's share of that op, free of the network's noise.
void BM_HarnessCost(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t count = bytes / sizeof(float);
  constexpr int kBatch = 2000;
  auto& comm = state.range(1) ? *g_rank->solo_monitored : *g_rank->solo;
  const Pairs p = run_pairs(
      state, kBatch, [&] { return bare_loop(g_rank->solo_bare, count, kBatch); },
      [&] { return ours_loop(comm, count, kBatch); });
  std::vector<double> diff;
  for (std::size_t i = 0; i < p.bare.size(); ++i) diff.push_back(p.ours[i] - p.bare[i]);
  state.counters["bytes"] = static_cast<double>(bytes);
  state.counters["harness_us"] = median_of(diff) * 1e6;
}

// The same, waiting on every op: what a caller that needs each result pays
// for the hand-off to the worker thread and back.
void BM_DdpdiagWaitEach(benchmark::State& state) {
  const std::size_t bytes = static_cast<std::size_t>(state.range(0));
  const std::size_t count = bytes / sizeof(float);
  const int batch = batch_for(bytes);
  double total_s = 0;
  auto& comm = *g_rank->comm;
  for (auto _ : state) {
    barrier_ours();
    auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i)
      comm.allreduce(g_rank->buf, g_rank->buf, count, DType::kFloat32, ReduceOp::kSum)
          ->wait(std::chrono::seconds(60));
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    total_s += dt;
  }
  report(state, bytes, batch, total_s);
}

void register_all() {
  std::vector<std::int64_t> sizes;
  for (std::size_t b = 4; b <= kMaxBytes; b *= 4) sizes.push_back(static_cast<std::int64_t>(b));
  // Per size: the paired comparison (21 pairs), then each loop on its own
  // (medians of 5 repetitions), ours waiting on each op last.
  for (std::int64_t s : {std::int64_t{4}, std::int64_t{1} << 20, std::int64_t{64} << 20})
    for (int monitored : {0, 1})
      benchmark::RegisterBenchmark(monitored ? "harness_cost_ws1_monitored" : "harness_cost_ws1",
                                   &BM_HarnessCost)
        ->Args({s, monitored})
        ->UseManualTime()
        ->Iterations(21)
        ->Unit(benchmark::kMicrosecond);
  for (auto s : sizes) {
    benchmark::RegisterBenchmark("paired", &BM_Paired)
        ->Arg(s)
        ->UseManualTime()
        ->Iterations(21)
        ->Unit(benchmark::kMicrosecond);
    for (auto [name, fn] : {std::pair{"bare_gloo", &BM_BareGloo},
                            std::pair{"ddpdiag", &BM_Ddpdiag},
                            std::pair{"ddpdiag_wait_each", &BM_DdpdiagWaitEach}}) {
      benchmark::RegisterBenchmark(name, fn)
          ->Arg(s)
          ->UseManualTime()
          ->Iterations(5)
          ->Repetitions(5)
          ->ReportAggregatesOnly(true)
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

int run_rank(int rank, int port, int argc, char** argv) {
  TcpStoreClientOptions co;
  co.port = port;
  co.rank = rank;
  auto store = std::make_shared<TcpStoreClient>(co);

  Rank r;
  r.rank = rank;
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(rank, 2);
  GlooStore gs(std::make_shared<PrefixStore>("bare", store));
  ctx->connectFullMesh(gs, dev);
  ctx->setTimeout(std::chrono::seconds(60));
  r.bare = ctx;

  CommOptions opts;
  opts.backend = Backend::kGloo;
  opts.rank = rank;
  opts.world_size = 2;
  opts.store = std::make_shared<PrefixStore>("ddpdiag", store);
  opts.gloo_hostname = "127.0.0.1";
  r.comm = make_communicator(opts);
  {
    auto solo_dev = gloo::transport::tcp::CreateDevice(attr);
    auto solo = std::make_shared<gloo::rendezvous::Context>(0, 1);
    GlooStore solo_store(std::make_shared<PrefixStore>("solo" + std::to_string(rank) + "/bare", store));
    solo->connectFullMesh(solo_store, solo_dev);
    r.solo_bare = solo;
    CommOptions so = opts;
    so.rank = 0;
    so.world_size = 1;
    so.store = std::make_shared<PrefixStore>("solo" + std::to_string(rank) + "/ddpdiag", store);
    r.solo = make_communicator(so);
    so.store = std::make_shared<PrefixStore>("solo" + std::to_string(rank) + "/monitored", store);
    MonitorOptions mo;
    mo.store = std::make_shared<PrefixStore>("monitor", so.store);
    mo.peers.push_back({"localhost", static_cast<long>(getpid()), true});
    r.solo_monitored = std::make_unique<MonitoredCommunicator>(make_communicator(so), mo);
  }
  r.buf = static_cast<float*>(r.comm->alloc(kMaxBytes));
  for (std::size_t i = 0; i < kMaxBytes / sizeof(float); ++i) r.buf[i] = 1.0f;
  g_rank = &r;

  register_all();
  // Rank 1 writes no --benchmark_out file: it would open rank 0's path and
  // its figures could end up there. (BENCHMARK_OUT in its environment is
  // left out by main().)
  std::vector<char*> args(argv, argv + argc);
  if (rank != 0)
    std::erase_if(args, [](const char* a) {
      return std::strncmp(a, "--benchmark_out=", 16) == 0 || std::strncmp(a, "--benchmark_out_format=", 23) == 0;
    });
  int nargs = static_cast<int>(args.size());
  args.push_back(nullptr);
  benchmark::Initialize(&nargs, args.data());
  if (rank == 0) {
    benchmark::RunSpecifiedBenchmarks();
  } else {
    // Same collectives, output discarded.
    std::ofstream null("/dev/null");
    benchmark::ConsoleReporter quiet;
    quiet.SetOutputStream(&null);
    quiet.SetErrorStream(&null);
    benchmark::RunSpecifiedBenchmarks(&quiet);
  }
  benchmark::Shutdown();
  r.comm->free(r.buf);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a dead peer is an error, not a silent kill
  if (const char* rank = std::getenv("DDPDIAG_BENCH_RANK"))
    return run_rank(std::atoi(rank), std::atoi(std::getenv("DDPDIAG_BENCH_PORT")), argc, argv);
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  TcpStoreServer server(so);
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    // The child's environment is made before the fork: the server's thread
    // runs, so the child may not allocate before it execs.
    std::vector<std::string> env = {"DDPDIAG_BENCH_RANK=" + std::to_string(r),
                                    "DDPDIAG_BENCH_PORT=" + std::to_string(server.port())};
    // Google Benchmark reads --benchmark_out from BENCHMARK_OUT too: rank 1
    // gets neither (run_rank drops the flag).
    for (char** e = environ; e && *e; ++e)
      if (std::strncmp(*e, "DDPDIAG_BENCH_", 14) != 0 &&
          (r == 0 || std::strncmp(*e, "BENCHMARK_OUT", 13) != 0))
        env.emplace_back(*e);
    std::vector<char*> envp;
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    pid_t pid = fork();
    if (pid == 0) {
      execve("/proc/self/exe", argv, envp.data());
      static const char kFailed[] = "bench_allreduce_overhead: cannot exec a rank\n";
      [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, kFailed, sizeof kFailed - 1);
      _exit(127);
    }
    pids.push_back(pid);
  }
  int rc = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) rc = 1;
  }
  return rc;
}
