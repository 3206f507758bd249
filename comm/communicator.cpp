// Backend dispatch. The NCCL backend exists only in builds with CUDA and
// NCCL; the single #if below is the one place that knows it.
#include "comm/communicator.h"

#include "comm/gloo/gloo_communicator.h"
#include "ddpdiag/config.h"

#if DDPDIAG_HAVE_CUDA
#include "comm/nccl/nccl_communicator.h"
#else
namespace ddpdiag::nccl_backend {
namespace {
std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& opts) {
  throw UsageError(
      "this build of ddpdiag has no NCCL backend (CUDA or NCCL was not found at build time); "
      "rebuild with -DDDPDIAG_WITH_CUDA=ON or use --backend gloo",
      ErrorContext{"backend.init", opts.rank, -1,
                   "rebuild with -DDDPDIAG_WITH_CUDA=ON (CUDA and NCCL installed), or use "
                   "--backend gloo"});
}
int device_count() { return 0; }
std::string library_version() { return ""; }
std::string unavailable_reason() {
  return "this build has no CUDA support (configured without CUDA/NCCL)";
}
}  // namespace
}  // namespace ddpdiag::nccl_backend
#endif

namespace ddpdiag {

static_assert(config::kCudaSupported == static_cast<bool>(DDPDIAG_HAVE_CUDA));

std::string_view backend_name(Backend b) {
  switch (b) {
    case Backend::kGloo: return "gloo";
    case Backend::kNccl: return "nccl";
  }
  return "unknown";
}

std::unique_ptr<Communicator> make_communicator(const CommOptions& opts) {
  if (!opts.store)
    throw UsageError("make_communicator: no store given",
                     ErrorContext{"backend.init", opts.rank, -1, "internal: pass CommOptions.store"});
  if (opts.world_size < 1 || opts.rank < 0 || opts.rank >= opts.world_size)
    throw UsageError("make_communicator: rank " + std::to_string(opts.rank) +
                         " is outside world size " + std::to_string(opts.world_size),
                     ErrorContext{"backend.init", opts.rank, -1,
                                  "check --rank/--world-size or RANK/WORLD_SIZE"});
  switch (opts.backend) {
    case Backend::kGloo: return gloo_backend::make_gloo_communicator(opts);
    case Backend::kNccl: return nccl_backend::make_nccl_communicator(opts);
  }
  throw UsageError("make_communicator: unknown backend",
                   ErrorContext{"backend.init", opts.rank, -1, "use --backend gloo or nccl"});
}

std::unique_ptr<Communicator> Communicator::split(int, int, Millis) {
  throw BackendError("split is not implemented by the " + std::string(backend_name(backend())) +
                         " backend",
                     ErrorContext{"split", rank(), -1,
                                  "create sub-groups with make_group_communicator"});
}

std::shared_ptr<Work> Communicator::sendrecv(const void*, std::size_t, int, void*, std::size_t, int,
                                             DType, std::uint32_t) {
  throw BackendError("sendrecv is not implemented by the " + std::string(backend_name(backend())) +
                         " communicator",
                     ErrorContext{"sendrecv", rank(), -1, "use send and recv ordered by rank parity"});
}

std::string backend_library_version(Backend b) {
  return b == Backend::kGloo ? gloo_backend::gloo_version() : nccl_backend::library_version();
}

bool nccl_supported() { return config::kCudaSupported; }

int cuda_device_count() { return nccl_backend::device_count(); }

std::string cuda_unavailable_reason() {
  if (nccl_backend::device_count() > 0) return "";
  return nccl_backend::unavailable_reason();
}

}  // namespace ddpdiag
