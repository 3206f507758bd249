// The NCCL backend: collectives on device memory, one non-blocking CUDA
// stream per communicator, non-blocking init with a deadline. This header
// does not include nccl.h or cuda_runtime.h, so the rest of ddpdiag stays
// free of CUDA types; it is compiled only in builds with CUDA and NCCL.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace ddpdiag::nccl_backend {

// Exchanges NCCL's unique id through opts.store (key "nccl/unique_id"),
// checks that no two ranks share a GPU, and initialises the communicator
// within opts.timeout. Throws UsageError (two ranks on one GPU),
// BackendError (no GPU, NCCL/CUDA failure) or TimeoutError.
std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& opts);

// Usable CUDA devices; 0 when the driver or the GPU is missing.
int device_count();
// "nccl X.Y.Z" of the NCCL library loaded (ncclGetVersion; needs no GPU).
std::string library_version();
// Why device_count() is 0, in words (CUDA's own message).
std::string unavailable_reason();

}  // namespace ddpdiag::nccl_backend
