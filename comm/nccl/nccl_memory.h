// cudaMemGetInfo for comm/memory.h: the CUDA side lives here, in the one
// folder that may include CUDA headers; compiled only in builds with CUDA.
#pragma once

#include "comm/memory.h"

namespace ddpdiag::nccl_backend {

// Free and total memory of `device` (cudaSetDevice on the calling thread,
// then cudaMemGetInfo); available false with CUDA's message on failure.
DeviceMemoryInfo device_memory_info(int device);

}  // namespace ddpdiag::nccl_backend
