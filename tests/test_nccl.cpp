// The NCCL backend at world size 1 over a MemoryStore. Built only with CUDA
// and NCCL; the "[gpu]" cases skip with a reason where there is no GPU (fail with
// DDPDIAG_REQUIRE_GPU=1: tests/gpu_skip.h), and
// the no-GPU case checks the error a CPU machine gets.
#include <catch2/catch.hpp>

#include <dlfcn.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/store/store.h"
#include "comm/types.h"
#include "ddp_core/param_broadcast.h"
#include "tests/gpu_skip.h"

using namespace ddpdiag;
using namespace std::chrono_literals;

namespace {

CommOptions nccl_options() {
  CommOptions o;
  o.backend = Backend::kNccl;
  o.rank = 0;
  o.world_size = 1;
  o.store = std::make_shared<MemoryStore>();
  o.timeout = 30s;  // under gpu-check's limit for the whole GPU suite
  return o;
}

}  // namespace

TEST_CASE("nccl: the build has NCCL", "[nccl]") { CHECK(nccl_supported()); }

TEST_CASE("nccl: without a GPU make_communicator says so", "[nccl]") {
  if (cuda_device_count() > 0) {
    WARN("a GPU is present: the no-GPU error path is not exercised here");
    return;
  }
  CHECK_FALSE(cuda_unavailable_reason().empty());
  try {
    auto comm = make_communicator(nccl_options());
    FAIL("make_communicator(NCCL) succeeded without a GPU");
  } catch (const BackendError& e) {
    const std::string msg = e.what();
    INFO(msg);
    CHECK(msg.find("no GPU") != std::string::npos);
    // What to do is the hint's, said once: the CLI prints message and hint.
    CHECK(msg.find("--backend gloo") == std::string::npos);
    CHECK(e.context().hint.find("--backend gloo") != std::string::npos);
    CHECK(e.context().phase == "backend.init");
  }
}

namespace {

// Sets an environment variable for one scope, then puts back what was there.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace

TEST_CASE("nccl: the no-GPU reason names the driver and CUDA_VISIBLE_DEVICES", "[nccl]") {
  if (cuda_device_count() > 0) {
    WARN("a GPU is present: the no-GPU reason is not exercised here");
    return;
  }
  // Without libcuda.so.1 CUDA answers "driver version is insufficient",
  // which is not what is wrong; with it, CUDA's own message stays.
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  const std::string plain = cuda_unavailable_reason();
  INFO(plain);
  if (!driver) {
    CHECK(plain.find("no NVIDIA driver (libcuda.so.1 not found)") != std::string::npos);
    CHECK(plain.find("insufficient") == std::string::npos);
  } else {
    dlclose(driver);
    CHECK(plain.find("libcuda.so.1 not found") == std::string::npos);
  }
  {
    // CUDA reports these as cudaErrorNoDevice (or, here, as no driver),
    // never as a count of 0: the variable must be named all the same.
    ScopedEnv env("CUDA_VISIBLE_DEVICES", "GPU-00000000-0000-0000-0000-000000000000");
    const std::string why = cuda_unavailable_reason();
    INFO(why);
    CHECK(why.find("CUDA_VISIBLE_DEVICES=GPU-00000000-0000-0000-0000-000000000000") !=
          std::string::npos);
    try {
      auto comm = make_communicator(nccl_options());
      FAIL("make_communicator(NCCL) succeeded without a GPU");
    } catch (const BackendError& e) {
      CHECK(std::string(e.what()).find("CUDA_VISIBLE_DEVICES=GPU-0000") != std::string::npos);
    }
  }
  {
    ScopedEnv env("CUDA_VISIBLE_DEVICES", "");
    const std::string why = cuda_unavailable_reason();
    INFO(why);
    CHECK(why.find("CUDA_VISIBLE_DEVICES is set and empty") != std::string::npos);
  }
}

TEST_CASE("nccl: collectives on device memory at world size 1", "[nccl][gpu]") {
  if (ddpdiag::test::no_gpu_skip()) return;
  auto comm = make_communicator(nccl_options());
  REQUIRE(comm->memory_kind() == MemoryKind::kDevice);
  INFO(comm->library_version() << " on " << comm->device_name());
  CHECK(comm->library_version().rfind("nccl ", 0) == 0);
  const std::size_t count = 1000;
  std::vector<float> host(count), back(count);
  for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(i % 17);
  CommBuffer a(*comm, count * sizeof(float)), b(*comm, count * sizeof(float));
  comm->copy_from_host(a.get(), host.data(), count * sizeof(float));

  for (ReduceOp op : kAllReduceOps) {
    comm->allreduce(a.get(), b.get(), count, DType::kFloat32, op)->wait(30s);
    comm->copy_to_host(back.data(), b.get(), count * sizeof(float));
    CHECK(back == host);  // one rank: every op is the identity
  }
  comm->allreduce(a.get(), a.get(), count, DType::kFloat32, ReduceOp::kSum)->wait(30s);
  comm->broadcast(a.get(), count, DType::kFloat32, 0)->wait(30s);
  comm->copy_to_host(back.data(), a.get(), count * sizeof(float));
  CHECK(back == host);

  comm->allgather(a.get(), b.get(), count, DType::kFloat32)->wait(30s);
  comm->copy_to_host(back.data(), b.get(), count * sizeof(float));
  CHECK(back == host);

  comm->reduce_scatter(a.get(), b.get(), count, DType::kFloat32, ReduceOp::kSum)->wait(30s);
  comm->copy_to_host(back.data(), b.get(), count * sizeof(float));
  CHECK(back == host);

  // Every dtype goes through NCCL's type mapping.
  for (DType t : kAllDTypes) {
    std::vector<std::uint8_t> h(64 * dtype_size(t)), r(h.size());
    for (std::size_t i = 0; i < 64; ++i) store_from_double(t, h.data(), i, static_cast<double>(i % 5));
    CommBuffer d(*comm, h.size());
    comm->copy_from_host(d.get(), h.data(), h.size());
    comm->allreduce(d.get(), d.get(), 64, t, ReduceOp::kMax)->wait(30s);
    comm->copy_to_host(r.data(), d.get(), r.size());
    CHECK(r == h);
  }
  comm->barrier()->wait(30s);
}

TEST_CASE("nccl: parameter broadcast packs scattered tensors with device copies", "[nccl][gpu]") {
  if (ddpdiag::test::no_gpu_skip()) return;
  auto comm = make_communicator(nccl_options());
  // One allocation per tensor: no chunk is contiguous, so each is packed
  // into a staging buffer on the device (the root's side of the staging; the
  // unpacking needs a second rank).
  const std::uint64_t sizes[] = {1200, 12, 20000, 136, 258, 8, 3108};
  std::vector<CommBuffer> own;
  std::vector<ddp_core::ParamTensor> tensors;
  for (std::uint64_t b : sizes) {
    own.emplace_back(*comm, b);
    tensors.push_back({"t" + std::to_string(tensors.size()), own.back().get(), b, DType::kUInt8});
  }
  ddp_core::fill_start_values(*comm, tensors, 0);
  ddp_core::BroadcastOptions o;
  o.chunk_bytes = 4096;
  o.timeout = 30s;
  const auto st = ddp_core::broadcast_parameters(*comm, tensors, o);
  CHECK(st.staged_chunks > 0);
  CHECK(ddp_core::tensor_checksums(*comm, tensors) == ddp_core::start_pattern_checksums(tensors, 0));
}
