// Device benchmarks on one GPU (run by scripts/gpu-check.sh):
//  1. NCCL all_reduce at world size 1, per size: host-timed (a burst of
//     back-to-back ops, then one synchronisation, as nccl-tests times) and
//     CUDA-graph replay (the burst captured once, replayed, as nccl-tests -G).
//  2. The reducer's bucket flatten/unflatten (StreamOps on the NCCL
//     communicator's stream) for the largest bucket of each model preset,
//     as a fraction of a device-to-device cudaMemcpyAsync of the same bytes
//     measured the same way (target: at least 0.9).
// Prints tables and writes every figure to --json FILE.
// --iters: ops per timed burst (at least; the flatten part doubles it until a
// burst lasts 20 ms). Exit 1 when a part failed (its error is in the JSON's
// "errors"; the other parts are still measured and written). Exit 77 (the
// test runners' "skipped") when there is no GPU to measure: it prints
// "no GPU" and why, and --json FILE gets {"no_gpu": why}, so a script on a
// CPU-only machine tells that apart from a failure, and gpu-check.sh, which
// expects a GPU, still counts it as one.
// Usage: ddpdiag_bench_device [--json FILE] [--max-bytes N] [--iters N]
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/store/store.h"
#include "comm/stream_ops.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"
#include "reports/report.h"

namespace {

using namespace ddpdiag;
using Clock = std::chrono::steady_clock;

// No GPU to measure: the exit status test runners read as "skipped".
constexpr int kExitNoGpu = 77;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "ddpdiag_bench_device: %s\n", what.c_str());
  std::exit(1);
}

// A failed CUDA or NCCL call ends the part it is in; main() still writes
// what the parts before it measured.
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
}
void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw std::runtime_error(std::string(what) + ": " + ncclGetErrorString(r));
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Median of `reps` timings of f(), each divided by `per`.
template <typename F>
double median_us(int reps, int per, F&& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    f();
    t.push_back(seconds_since(t0) * 1e6 / per);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

nlohmann::json nccl_latency(std::size_t max_bytes, int iters) {
  ncclComm_t comm = nullptr;
  const int dev = 0;
  check(cudaSetDevice(dev), "cudaSetDevice");
  check(ncclCommInitAll(&comm, 1, &dev), "ncclCommInitAll");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  void* buf = nullptr;
  check(cudaMalloc(&buf, max_bytes), "cudaMalloc");
  check(cudaMemset(buf, 0, max_bytes), "cudaMemset");
  int version = 0;
  ncclGetVersion(&version);

  std::printf("# NCCL all_reduce, world size 1, float32 sum, in place (NCCL code %d)\n", version);
  std::printf("# %12s %14s %14s %10s\n", "bytes", "host (us)", "graph (us)", "graph/host");
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / 4;
    auto burst = [&] {
      for (int i = 0; i < iters; ++i)
        check(ncclAllReduce(buf, buf, count, ncclFloat32, ncclSum, comm, s), "ncclAllReduce");
    };
    burst();  // warm-up
    check(cudaStreamSynchronize(s), "sync");
    const double host_us = median_us(5, iters, [&] {
      burst();
      check(cudaStreamSynchronize(s), "sync");
    });
    // The same burst as one CUDA graph.
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
    burst();
    check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");  // warm-up
    check(cudaStreamSynchronize(s), "sync");
    const double graph_us = median_us(5, iters, [&] {
      check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
      check(cudaStreamSynchronize(s), "sync");
    });
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    std::printf("  %12zu %14.2f %14.2f %10.3f\n", bytes, host_us, graph_us, graph_us / host_us);
    rows.push_back({{"bytes", bytes}, {"host_us", host_us}, {"graph_us", graph_us}});
  }
  cudaFree(buf);
  cudaStreamDestroy(s);
  ncclCommDestroy(comm);
  return rows;
}

// Bursts of `iters` ops are timed to one fence; `iters` grows until a burst
// takes at least kMinBurst, so the last poll of the fence (which sleeps
// between queries once it has waited 200 us) is noise next to the burst.
constexpr double kMinBurstUs = 20000;

nlohmann::json flatten_throughput(int min_iters) {
  CommOptions o;
  o.backend = Backend::kNccl;
  o.store = std::make_shared<MemoryStore>();
  o.timeout = std::chrono::seconds(60);
  auto comm = make_communicator(o);
  StreamOps* ops = comm->stream_ops();
  if (!ops) throw std::runtime_error("the NCCL communicator has no stream ops");

  std::printf("\n# bucket flatten/unflatten on the GPU vs a D2D cudaMemcpyAsync of the same "
              "bytes\n# (both on the communicator's stream, timed to a fence, the same number "
              "of ops per burst)\n");
  std::printf("# %-11s %8s %10s %6s %12s %12s %12s %9s %9s\n", "model", "tensors", "bytes",
              "iters", "flatten GB/s", "unflat GB/s", "memcpy GB/s", "flat/cpy", "unfl/cpy");
  nlohmann::json rows = nlohmann::json::array();
  for (const std::string name : {"resnet50", "bert-large", "gpt2"}) {
    const auto layout = *ddp_core::model_preset(name);
    const auto buckets = ddp_core::ddp_buckets(layout, ddp_core::kDefaultBucketCapBytes,
                                               ddp_core::kDefaultFirstBucketBytes);
    const ddp_core::DdpBucket* big = &ddp_core::largest_bucket(buckets);
    CommBuffer flat(*comm, big->bytes), src(*comm, big->bytes);
    std::vector<CommBuffer> tensors;
    std::vector<FlatPiece> pieces;
    std::uint64_t off = 0;
    for (std::size_t p : big->param_indices) {
      const auto bytes = layout.tensors[p].bytes();
      tensors.emplace_back(*comm, bytes);
      pieces.push_back({tensors.back().get(), off, bytes});
      off += bytes;
    }
    auto plan = ops->plan(flat.get(), big->bytes, pieces);
    const double gb = static_cast<double>(big->bytes) / 1e9;
    // One burst of n ops of a kind, ended by a fence.
    enum Kind { kFlatten, kUnflatten, kMemcpy };
    auto burst = [&](Kind k, int n) {
      for (int i = 0; i < n; ++i) {
        if (k == kFlatten)
          ops->flatten(*plan);
        else if (k == kUnflatten)
          ops->unflatten(*plan);
        else
          ops->copy(flat.get(), src.get(), big->bytes);
      }
      ops->fence()->wait(std::chrono::seconds(60));
    };
    // Calibrate on the copy (the fastest of the three), then warm each up.
    int iters = min_iters;
    for (;;) {
      const auto t0 = Clock::now();
      burst(kMemcpy, iters);
      if (seconds_since(t0) * 1e6 >= kMinBurstUs || iters >= (1 << 20)) break;
      iters *= 2;
    }
    auto timed = [&](Kind k) {
      burst(k, iters);
      return median_us(5, iters, [&] { burst(k, iters); });
    };
    const double flat_us = timed(kFlatten), unflat_us = timed(kUnflatten),
                 copy_us = timed(kMemcpy);
    const double fg = gb / (flat_us * 1e-6), ug = gb / (unflat_us * 1e-6),
                 cg = gb / (copy_us * 1e-6);
    std::printf("  %-11s %8zu %10llu %6d %12.1f %12.1f %12.1f %9.3f %9.3f\n", name.c_str(),
                pieces.size(), static_cast<unsigned long long>(big->bytes), iters, fg, ug, cg,
                fg / cg, ug / cg);
    rows.push_back({{"model", name},
                    {"tensors", pieces.size()},
                    {"bytes", big->bytes},
                    {"iters", iters},
                    {"flatten_gbps", fg},
                    {"unflatten_gbps", ug},
                    {"memcpy_d2d_gbps", cg},
                    {"flatten_vs_memcpy", fg / cg},
                    {"unflatten_vs_memcpy", ug / cg}});
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  std::size_t max_bytes = 256u << 20;
  int iters = 50;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) die(a + " needs a value");
      return argv[++i];
    };
    if (a == "--json")
      json_path = value();
    else if (a == "--max-bytes" || a == "--iters") {
      const std::string v = value();
      char* end = nullptr;
      const unsigned long long n = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end || n < 1 || n > (1ull << 40))
        die(a + ": '" + v + "' is not a positive integer");
      if (a == "--max-bytes")
        max_bytes = n;
      else
        iters = static_cast<int>(std::min<unsigned long long>(n, 1 << 20));
    }
    else
      die("unknown flag " + a + " (flags: --json FILE --max-bytes N --iters N)");
  }
  if (cuda_device_count() == 0) {
    const std::string why = cuda_unavailable_reason();
    std::fprintf(stderr, "ddpdiag_bench_device: no GPU (%s); nothing measured\n", why.c_str());
    if (!json_path.empty()) {
      try {
        reports::write_json_atomic(json_path, nlohmann::json{{"no_gpu", why}});
      } catch (const std::exception& e) {
        die("writing " + json_path + " failed: " + e.what());
      }
    }
    return kExitNoGpu;
  }
  // Each part that fails is named in "errors"; what the others measured is
  // still printed and written.
  nlohmann::json doc;
  doc["errors"] = nlohmann::json::array();
  auto part = [&](const char* key, auto&& run) {
    try {
      doc[key] = run();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddpdiag_bench_device: %s failed: %s\n", key, e.what());
      doc["errors"].push_back({{"part", key}, {"error", e.what()}});
    }
  };
  part("nccl_allreduce_ws1", [&] { return nccl_latency(max_bytes, iters); });
  std::fflush(stdout);
  part("bucket_flatten", [&] { return flatten_throughput(iters); });
  doc["flatten_target"] = 0.9;
  if (doc.contains("bucket_flatten")) {
    double worst = 1e9;
    for (const auto& r : doc["bucket_flatten"])
      worst = std::min({worst, r["flatten_vs_memcpy"].get<double>(),
                        r["unflatten_vs_memcpy"].get<double>()});
    doc["flatten_worst_ratio"] = worst;
    std::printf("\n# flatten/unflatten worst ratio to memcpy: %.3f (target >= 0.9): %s\n", worst,
                worst >= 0.9 ? "met" : "NOT met");
  }
  if (!json_path.empty()) {
    try {
      reports::write_json_atomic(json_path, doc);
    } catch (const std::exception& e) {
      die("writing " + json_path + " failed: " + e.what());
    }
  }
  return doc["errors"].empty() ? 0 : 1;
}
