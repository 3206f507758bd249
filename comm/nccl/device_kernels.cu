#include "comm/nccl/device_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace ddpdiag::nccl_backend::kernels {

namespace {

constexpr int kCopyThreads = 256;
constexpr int kElementThreads = 256;
constexpr unsigned kMaxBlocks = 65535;

__device__ void copy_bytes(unsigned char* dst, const unsigned char* src, std::uint64_t n) {
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  std::uint64_t done = 0;
  if (((d | s) & 15) == 0) {
    // 16-byte vectors, four in flight per thread.
    const std::uint64_t vecs = n / 16;
    auto* dv = reinterpret_cast<uint4*>(dst);
    const auto* sv = reinterpret_cast<const uint4*>(src);
    std::uint64_t i = threadIdx.x;
    const std::uint64_t stride = blockDim.x;
    for (; i + 3 * stride < vecs; i += 4 * stride) {
      const uint4 a = sv[i], b = sv[i + stride], c = sv[i + 2 * stride], e = sv[i + 3 * stride];
      dv[i] = a;
      dv[i + stride] = b;
      dv[i + 2 * stride] = c;
      dv[i + 3 * stride] = e;
    }
    for (; i < vecs; i += stride) dv[i] = sv[i];
    done = vecs * 16;
  } else if (((d | s) & 3) == 0) {
    const std::uint64_t words = n / 4;
    auto* dw = reinterpret_cast<unsigned*>(dst);
    const auto* sw = reinterpret_cast<const unsigned*>(src);
    for (std::uint64_t i = threadIdx.x; i < words; i += blockDim.x) dw[i] = sw[i];
    done = words * 4;
  }
  for (std::uint64_t i = done + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}

__global__ void copy_chunks_kernel(const CopyChunk* chunks, std::size_t count, bool to_flat) {
  for (std::size_t c = blockIdx.x; c < count; c += gridDim.x) {
    const CopyChunk k = chunks[c];
    auto* piece = static_cast<unsigned char*>(k.piece);
    auto* flat = static_cast<unsigned char*>(k.flat);
    if (to_flat)
      copy_bytes(flat, piece, k.bytes);
    else
      copy_bytes(piece, flat, k.bytes);
  }
}

// What a launch returns: its own error only. cudaGetLastError() reports the
// last error of ANY runtime call on this thread, and an event or stream
// query that answered cudaErrorNotReady can leave that value behind (PyTorch
// clears it after every such query for this reason), so each wrapper clears
// the slate just before its launch and reads it right after. A sticky error
// (a faulted context) comes back at once anyway.
void clear_last_error() { (void)cudaGetLastError(); }

unsigned blocks_for(std::size_t n, int threads) {
  const std::size_t b = (n + static_cast<std::size_t>(threads) - 1) / static_cast<std::size_t>(threads);
  return static_cast<unsigned>(std::min<std::size_t>(std::max<std::size_t>(b, 1), kMaxBlocks));
}

// 16-bit floats as raw bits, converted the way comm/types.cpp does on the
// host (round to nearest even).
struct Half {
  __device__ static float to_float(unsigned short v) { return __half2float(__ushort_as_half(v)); }
  __device__ static unsigned short from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};
struct BFloat {
  __device__ static float to_float(unsigned short v) {
    return __bfloat162float(__ushort_as_bfloat16(v));
  }
  __device__ static unsigned short from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

// The host reference (host_ops::divide): float x / float(w) (IEEE division:
// this file is not built with fast math); double x / w; 16-bit values
// through float, divided in double, rounded to float then to 16 bits.
__global__ void divide_f32(float* p, std::size_t n, float w) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = p[i] / w;
}
__global__ void divide_f64(double* p, std::size_t n, double w) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = p[i] / w;
}
// Integers as divide_int on the host: an integral divisor (the world size)
// divides in the integer domain, truncating toward zero.
template <typename T>
__global__ void divide_int(T* p, std::size_t n, long long q) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<T>(static_cast<long long>(p[i]) / q);
}
template <typename F>
__global__ void divide_16(unsigned short* p, std::size_t n, double w) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    p[i] = F::from_float(static_cast<float>(static_cast<double>(F::to_float(p[i])) / w));
}

// dst = to16(to16(x) / w), the division in float as the hooks do.
template <typename Src, typename F>
__global__ void compress_kernel(const Src* src, unsigned short* dst, std::size_t n, float w) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = F::from_float(F::to_float(F::from_float(static_cast<float>(src[i]))) / w);
}
template <typename SrcF, typename F>
__global__ void compress_16(const unsigned short* src, unsigned short* dst, std::size_t n, float w) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = F::from_float(F::to_float(F::from_float(SrcF::to_float(src[i]))) / w);
}

template <typename F, typename Dst>
__global__ void decompress_kernel(const unsigned short* src, Dst* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = static_cast<Dst>(F::to_float(src[i]));
}
template <typename F, typename DstF>
__global__ void decompress_16(const unsigned short* src, unsigned short* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x)
    dst[i] = DstF::from_float(F::to_float(src[i]));
}

template <typename F>
cudaError_t compress_as(const void* src, DType src_type, unsigned short* dst, std::size_t n,
                        int divisor, cudaStream_t stream) {
  const unsigned blocks = blocks_for(n, kElementThreads);
  const float w = static_cast<float>(divisor);
  clear_last_error();
  switch (src_type) {
    case DType::kFloat32:
      compress_kernel<float, F><<<blocks, kElementThreads, 0, stream>>>(
          static_cast<const float*>(src), dst, n, w);
      break;
    case DType::kFloat64:
      compress_kernel<double, F><<<blocks, kElementThreads, 0, stream>>>(
          static_cast<const double*>(src), dst, n, w);
      break;
    case DType::kFloat16:
      compress_16<Half, F><<<blocks, kElementThreads, 0, stream>>>(
          static_cast<const unsigned short*>(src), dst, n, w);
      break;
    case DType::kBFloat16:
      compress_16<BFloat, F><<<blocks, kElementThreads, 0, stream>>>(
          static_cast<const unsigned short*>(src), dst, n, w);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

template <typename F>
cudaError_t decompress_as(const unsigned short* src, void* dst, DType dst_type, std::size_t n,
                          cudaStream_t stream) {
  const unsigned blocks = blocks_for(n, kElementThreads);
  clear_last_error();
  switch (dst_type) {
    case DType::kFloat32:
      decompress_kernel<F, float><<<blocks, kElementThreads, 0, stream>>>(
          src, static_cast<float*>(dst), n);
      break;
    case DType::kFloat64:
      decompress_kernel<F, double><<<blocks, kElementThreads, 0, stream>>>(
          src, static_cast<double*>(dst), n);
      break;
    case DType::kFloat16:
      decompress_16<F, Half><<<blocks, kElementThreads, 0, stream>>>(
          src, static_cast<unsigned short*>(dst), n);
      break;
    case DType::kBFloat16:
      decompress_16<F, BFloat><<<blocks, kElementThreads, 0, stream>>>(
          src, static_cast<unsigned short*>(dst), n);
      break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

std::vector<CopyChunk> make_chunks(void* flat, std::span<const FlatPiece> pieces) {
  std::vector<CopyChunk> out;
  auto* base = static_cast<unsigned char*>(flat);
  for (const auto& p : pieces) {
    if (!p.bytes || base + p.offset == p.ptr) continue;
    for (std::uint64_t at = 0; at < p.bytes; at += kChunkBytes)
      out.push_back({static_cast<unsigned char*>(p.ptr) + at, base + p.offset + at,
                     std::min(kChunkBytes, p.bytes - at)});
  }
  return out;
}

cudaError_t copy_chunks(const CopyChunk* device_chunks, std::size_t count, bool to_flat,
                        cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>(count, kMaxBlocks));
  clear_last_error();
  copy_chunks_kernel<<<blocks, kCopyThreads, 0, stream>>>(device_chunks, count, to_flat);
  return cudaGetLastError();
}

cudaError_t divide(void* buf, std::size_t n, DType t, int divisor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned blocks = blocks_for(n, kElementThreads);
  const double w = divisor;
  const long long q = divisor;
  clear_last_error();
  switch (t) {
    case DType::kFloat32:
      divide_f32<<<blocks, kElementThreads, 0, stream>>>(static_cast<float*>(buf), n,
                                                          static_cast<float>(divisor));
      break;
    case DType::kFloat64:
      divide_f64<<<blocks, kElementThreads, 0, stream>>>(static_cast<double*>(buf), n, w);
      break;
    case DType::kFloat16:
      divide_16<Half><<<blocks, kElementThreads, 0, stream>>>(static_cast<unsigned short*>(buf), n, w);
      break;
    case DType::kBFloat16:
      divide_16<BFloat><<<blocks, kElementThreads, 0, stream>>>(static_cast<unsigned short*>(buf), n, w);
      break;
    case DType::kInt32:
      divide_int<<<blocks, kElementThreads, 0, stream>>>(static_cast<std::int32_t*>(buf), n, q);
      break;
    case DType::kInt64:
      divide_int<<<blocks, kElementThreads, 0, stream>>>(static_cast<long long*>(buf), n, q);
      break;
    case DType::kInt8:
      divide_int<<<blocks, kElementThreads, 0, stream>>>(static_cast<std::int8_t*>(buf), n, q);
      break;
    case DType::kUInt8:
      divide_int<<<blocks, kElementThreads, 0, stream>>>(static_cast<std::uint8_t*>(buf), n, q);
      break;
    default:
      return cudaErrorInvalidValue;  // a dtype without a kernel: never silently undivided
  }
  return cudaGetLastError();
}

cudaError_t compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
                     int divisor, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  auto* d = static_cast<unsigned short*>(dst16);
  if (dst_type == DType::kFloat16) return compress_as<Half>(src, src_type, d, n, divisor, stream);
  if (dst_type == DType::kBFloat16) return compress_as<BFloat>(src, src_type, d, n, divisor, stream);
  return cudaErrorInvalidValue;
}

cudaError_t decompress(const void* src16, DType src_type, void* dst, DType dst_type,
                       std::size_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const auto* s = static_cast<const unsigned short*>(src16);
  if (src_type == DType::kFloat16) return decompress_as<Half>(s, dst, dst_type, n, stream);
  if (src_type == DType::kBFloat16) return decompress_as<BFloat>(s, dst, dst_type, n, stream);
  return cudaErrorInvalidValue;
}

}  // namespace ddpdiag::nccl_backend::kernels
