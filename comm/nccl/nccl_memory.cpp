#include "comm/nccl/nccl_memory.h"

#include <cuda_runtime.h>

#include <string>

namespace ddpdiag::nccl_backend {

DeviceMemoryInfo device_memory_info(int device) {
  DeviceMemoryInfo d;
  if (cudaError_t e = cudaSetDevice(device < 0 ? 0 : device); e != cudaSuccess) {
    d.reason = std::string("cudaSetDevice: ") + cudaGetErrorString(e);
    return d;
  }
  std::size_t free_b = 0, total_b = 0;
  if (cudaError_t e = cudaMemGetInfo(&free_b, &total_b); e != cudaSuccess) {
    d.reason = std::string("cudaMemGetInfo: ") + cudaGetErrorString(e);
    return d;
  }
  d.available = true;
  d.free_bytes = free_b;
  d.total_bytes = total_b;
  return d;
}

}  // namespace ddpdiag::nccl_backend
