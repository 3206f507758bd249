// Device kernels of the NCCL backend's StreamOps (comm/stream_ops.h): a
// batched copy between a flat bucket and its tensors, and the element-wise
// divide / compress / decompress of DDP's reducer. Every launch is
// asynchronous on the given stream; results match comm/stream_ops.h's host
// reference bit for bit (same formulas, round to nearest even).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "comm/stream_ops.h"

namespace ddpdiag::nccl_backend::kernels {

// One block's share of a flatten/unflatten: `bytes` between `piece` (a
// tensor) and `flat` (its place in the bucket).
struct CopyChunk {
  void* piece = nullptr;
  void* flat = nullptr;
  std::uint64_t bytes = 0;
};

// Chunk size: big enough that a block moves a lot per launch, small enough
// that a 1 MiB bucket still spreads over many SMs.
constexpr std::uint64_t kChunkBytes = 64 * 1024;

// Splits the pieces (skipping those already in place) into chunks.
std::vector<CopyChunk> make_chunks(void* flat, std::span<const FlatPiece> pieces);

// to_flat: piece -> flat (flatten), else flat -> piece (unflatten).
cudaError_t copy_chunks(const CopyChunk* device_chunks, std::size_t count, bool to_flat,
                        cudaStream_t stream);
cudaError_t divide(void* buf, std::size_t n, DType t, int divisor, cudaStream_t stream);
cudaError_t compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
                     int divisor, cudaStream_t stream);
cudaError_t decompress(const void* src16, DType src_type, void* dst, DType dst_type,
                       std::size_t n, cudaStream_t stream);

}  // namespace ddpdiag::nccl_backend::kernels
