// Device benchmarks on one GPU (run by scripts/gpu-check.sh):
//  1. NCCL all_reduce at world size 1, per size: host-timed (a burst of
//     back-to-back ops, then one synchronisation, as nccl-tests times) and
//     CUDA-graph replay (the burst captured once, replayed, as nccl-tests -G).
//     At one rank NCCL runs no all_reduce kernel (see kNcclWs1Note): the main
//     columns are out of place, where each op is a device-to-device copy;
//     in place is shown as launch overhead only, NCCL doing nothing there.
//  2. The reducer's bucket flatten/unflatten (StreamOps on the NCCL
//     communicator's stream) for the largest bucket of each model preset,
//     as a fraction of a device-to-device cudaMemcpyAsync of the same bytes
//     measured the same way (target: at least 0.9 for every one). GB/s counts
//     the bucket's bytes once, though each op reads and writes them.
// Prints tables and writes every figure to --json FILE.
// --iters: ops per timed burst (at least; the flatten part doubles it until a
// burst lasts 20 ms). Exit 1 when a part failed (its error is in the JSON's
// "errors"; what it and the other parts measured is still written) or when a
// flatten or unflatten ratio is under the 0.9 target (the last table line
// names the worst and where it was). Exit 2 for a bad flag or a --json FILE
// that cannot be written. Exit 77
// (the test runners' "skipped") when there is no GPU to measure: it prints
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
// A check failed (flatten or unflatten under kFlattenTarget of the copy) or
// a part failed; a bad flag or an unwritable --json FILE.
constexpr int kExitCheckFailed = 1;
constexpr int kExitUsage = 2;
constexpr double kFlattenTarget = 0.9;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "ddpdiag_bench_device: %s\n", what.c_str());
  std::exit(kExitUsage);
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

// What the NCCL table times, and why. At world size 1 NCCL runs no
// collective kernel at all: for sum, prod, min and max it returns after, at
// most, a cudaMemcpyAsync from send to receive buffer when they differ (only
// avg, a pre-multiplied sum, gets a small kernel of its own). So:
//  - out of place (send != receive) is the main figure: every op is NCCL's
//    host-side enqueue plus a real device-to-device copy of `bytes` on the
//    stream, which the synchronisation (or the graph replay) waits for;
//  - in place (send == receive) is kept as NCCL's launch overhead only: there
//    NCCL enqueues nothing, so the stream is idle and the CUDA graph captured
//    is empty. It is no all_reduce time and no bandwidth.
// ncclAvg would time a kernel, but NCCL's one-rank scalar-multiply kernel,
// not a ring or tree all_reduce and not the sum DDP issues; the copy is the
// only device work a one-rank sum ever does, so that is what is shown.
constexpr const char* kNcclWs1Note =
    "NCCL runs no all_reduce kernel at world size 1: out of place it copies send to "
    "receive (cudaMemcpyAsync), in place it does nothing. 'oop' columns time that copy plus "
    "NCCL's per-call overhead; 'in-place' columns are launch overhead only (NCCL does no work "
    "for an in-place sum at one rank). copy GB/s = bytes / oop host time (the bytes counted "
    "once; the copy reads and writes them). Neither is a multi-rank all_reduce figure.";

// The stream, buffers and communicator of the NCCL part, released however it
// ends.
struct NcclSetup {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  void* send = nullptr;
  void* recv = nullptr;
  NcclSetup() = default;
  NcclSetup(const NcclSetup&) = delete;
  NcclSetup& operator=(const NcclSetup&) = delete;
  ~NcclSetup() {
    if (send) cudaFree(send);
    if (recv) cudaFree(recv);
    if (stream) cudaStreamDestroy(stream);
    if (comm) ncclCommDestroy(comm);
  }
};

// The burst captured once as a CUDA graph, then replayed: time per op (µs).
// When anything fails or throws while capturing, the capture is ended and
// the partial graph destroyed before the error goes on, so the stream is
// usable again and the parts after this one still run.
template <typename F>
double graph_replay_us(cudaStream_t s, int iters, F&& burst) {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  struct Release {
    cudaGraph_t& graph;
    cudaGraphExec_t& exec;
    ~Release() {
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
    }
  } release{graph, exec};
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  try {
    burst();
  } catch (...) {
    cudaGraph_t partial = nullptr;
    if (cudaStreamEndCapture(s, &partial) == cudaSuccess && partial) cudaGraphDestroy(partial);
    (void)cudaGetLastError();  // an invalidated capture leaves its error behind
    throw;
  }
  check(cudaStreamEndCapture(s, &graph), "cudaStreamEndCapture");
  check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");  // warm-up
  check(cudaStreamSynchronize(s), "sync");
  return median_us(5, iters, [&] {
    check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    check(cudaStreamSynchronize(s), "sync");
  });
}

// Rows go into `rows` as they are measured, so a failure part-way keeps them.
void nccl_latency(std::size_t max_bytes, int iters, nlohmann::json& rows) {
  rows = nlohmann::json::array();
  NcclSetup n;
  const int dev = 0;
  check(cudaSetDevice(dev), "cudaSetDevice");
  check(ncclCommInitAll(&n.comm, 1, &dev), "ncclCommInitAll");
  check(cudaStreamCreateWithFlags(&n.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaMalloc(&n.send, max_bytes), "cudaMalloc");
  check(cudaMalloc(&n.recv, max_bytes), "cudaMalloc");
  // On the benchmark's stream (cudaMemset runs on the legacy stream, which a
  // non-blocking stream does not wait for), finished before any timing.
  check(cudaMemsetAsync(n.send, 0, max_bytes, n.stream), "cudaMemsetAsync");
  check(cudaMemsetAsync(n.recv, 0, max_bytes, n.stream), "cudaMemsetAsync");
  check(cudaStreamSynchronize(n.stream), "cudaStreamSynchronize");
  int version = 0;
  ncclGetVersion(&version);
  const cudaStream_t s = n.stream;

  std::printf("# NCCL all_reduce, world size 1, float32 sum (NCCL code %d), time per op\n",
              version);
  std::printf("# %s\n", kNcclWs1Note);
  std::printf("# %12s %13s %13s %9s %10s | %15s %15s\n", "bytes", "oop host(us)",
              "oop graph(us)", "graph/host", "copy GB/s", "in-place host", "in-place graph");
  std::printf("# %12s %13s %13s %9s %10s | %15s %15s\n", "", "", "", "", "",
              "(launch only,us)", "(launch only,us)");
  for (std::size_t bytes = 8; bytes <= max_bytes; bytes *= 4) {
    const std::size_t count = bytes / 4;
    auto burst_from = [&](const void* src) {
      return [&, src] {
        for (int i = 0; i < iters; ++i)
          check(ncclAllReduce(src, n.recv, count, ncclFloat32, ncclSum, n.comm, s),
                "ncclAllReduce");
      };
    };
    auto host_us = [&](auto&& burst) {
      burst();  // warm-up
      check(cudaStreamSynchronize(s), "sync");
      return median_us(5, iters, [&] {
        burst();
        check(cudaStreamSynchronize(s), "sync");
      });
    };
    const auto oop = burst_from(n.send), in_place = burst_from(n.recv);
    const double oop_host = host_us(oop), oop_graph = graph_replay_us(s, iters, oop);
    const double ip_host = host_us(in_place), ip_graph = graph_replay_us(s, iters, in_place);
    const double copy_gbps = static_cast<double>(bytes) / (oop_host * 1e3);
    std::printf("  %12zu %13.2f %13.2f %9.3f %10.2f | %15.2f %15.2f\n", bytes, oop_host,
                oop_graph, oop_graph / oop_host, copy_gbps, ip_host, ip_graph);
    rows.push_back({{"bytes", bytes},
                    {"out_of_place_host_us", oop_host},
                    {"out_of_place_graph_us", oop_graph},
                    {"out_of_place_copy_gbps", copy_gbps},
                    {"in_place_launch_only_host_us", ip_host},
                    {"in_place_launch_only_graph_us", ip_graph}});
  }
}

// Bursts of `iters` ops are timed to one fence; `iters` grows until a burst
// takes at least kMinBurst, so the last poll of the fence (which sleeps
// between queries once it has waited 200 us) is noise next to the burst.
constexpr double kMinBurstUs = 20000;

void flatten_throughput(int min_iters, nlohmann::json& rows) {
  rows = nlohmann::json::array();
  CommOptions o;
  o.backend = Backend::kNccl;
  o.store = std::make_shared<MemoryStore>();
  o.timeout = std::chrono::seconds(60);
  auto comm = make_communicator(o);
  StreamOps* ops = comm->stream_ops();
  if (!ops) throw std::runtime_error("the NCCL communicator has no stream ops");

  std::printf("\n# bucket flatten/unflatten on the GPU vs a D2D cudaMemcpyAsync of the same "
              "bytes\n# (both on the communicator's stream, timed to a fence, the same number "
              "of ops per burst;\n# GB/s = the bucket's bytes / time: the bytes are counted "
              "once, though each op reads and writes them)\n");
  std::printf("# %-11s %8s %10s %6s %12s %12s %12s %9s %9s\n", "model", "tensors", "bytes",
              "iters", "flatten GB/s", "unflat GB/s", "memcpy GB/s", "flat/cpy", "unfl/cpy");
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
  // Each part that fails is named in "errors"; what it and the others
  // measured is still printed and written.
  nlohmann::json doc;
  doc["errors"] = nlohmann::json::array();
  auto part = [&](const char* key, auto&& run) {
    try {
      run(doc[key]);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddpdiag_bench_device: %s failed: %s\n", key, e.what());
      doc["errors"].push_back({{"part", key}, {"error", e.what()}});
    }
  };
  part("nccl_allreduce_ws1", [&](nlohmann::json& rows) { nccl_latency(max_bytes, iters, rows); });
  doc["nccl_allreduce_ws1_note"] = kNcclWs1Note;
  std::fflush(stdout);
  part("bucket_flatten", [&](nlohmann::json& rows) { flatten_throughput(iters, rows); });
  doc["flatten_target"] = kFlattenTarget;
  bool target_missed = false;
  if (!doc["bucket_flatten"].empty()) {
    // The worst of every flatten and unflatten ratio, with where it was.
    double worst = 1e9;
    std::string where;
    for (const auto& r : doc["bucket_flatten"])
      for (const char* kind : {"flatten", "unflatten"}) {
        const double v = r[std::string(kind) + "_vs_memcpy"].get<double>();
        if (v >= worst) continue;
        worst = v;
        where = std::string(kind) + " of " + r["model"].get<std::string>() + "'s largest bucket, " +
                std::to_string(r["bytes"].get<std::uint64_t>()) + " B";
      }
    target_missed = worst < kFlattenTarget;
    doc["flatten_worst_ratio"] = worst;
    doc["flatten_worst_at"] = where;
    doc["flatten_target_met"] = !target_missed;
    // One line gpu-check.sh copies into its summary.
    std::printf("\n# flatten/unflatten worst ratio to memcpy: %.3f at %s (target >= %.1f): %s\n",
                worst, where.c_str(), kFlattenTarget, target_missed ? "NOT met" : "met");
  }
  if (!json_path.empty()) {
    try {
      reports::write_json_atomic(json_path, doc);
    } catch (const std::exception& e) {
      die("writing " + json_path + " failed: " + e.what());
    }
  }
  return !doc["errors"].empty() || target_missed ? kExitCheckFailed : 0;
}
