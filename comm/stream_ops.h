// Data movement and element-wise work on a communicator's own memory,
// ordered with its collectives: what DDP's reducer needs between the
// all_reduces of its buckets (flatten gradients into a bucket, divide by the
// world size, cast to 16 bits for a compression hook and back, unflatten).
//
// Every call only enqueues: NCCL runs it as a kernel (or cudaMemcpyAsync /
// cudaMemsetAsync) on the communicator's stream, Gloo as a task on the
// communicator's worker thread. So an op issued after an all_reduce sees the
// reduced data, and an all_reduce issued after an op sees its result, with no
// host synchronisation in between. fence() returns a Work that completes when
// everything issued before it has.
//
// Buffers must stay valid until a later fence (or a later collective's Work)
// completes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "comm/types.h"

namespace ddpdiag {

class Work;

// One tensor of a flat buffer: `bytes` at `ptr`, kept at byte `offset` of the
// flat buffer.
struct FlatPiece {
  void* ptr = nullptr;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
};

class StreamOps {
 public:
  // A flatten/unflatten between one flat buffer and its pieces, prepared once
  // (on a GPU its descriptors are uploaded once), run many times.
  class CopyPlan {
   public:
    virtual ~CopyPlan() = default;
    std::uint64_t bytes() const { return bytes_; }

   protected:
    std::uint64_t bytes_ = 0;
  };

  virtual ~StreamOps() = default;

  // Pieces must lie inside flat's range [0, flat_bytes) without overlapping.
  // Throws UsageError otherwise.
  virtual std::unique_ptr<CopyPlan> plan(void* flat, std::uint64_t flat_bytes,
                                         std::span<const FlatPiece> pieces) = 0;
  virtual void flatten(const CopyPlan& plan) = 0;    // pieces -> flat
  virtual void unflatten(const CopyPlan& plan) = 0;  // flat -> pieces
  virtual void copy(void* dst, const void* src, std::size_t bytes) = 0;
  virtual void zero(void* dst, std::size_t bytes) = 0;
  // buf[i] /= divisor, as host_ops::divide computes it.
  virtual void divide(void* buf, std::size_t n, DType t, int divisor) = 0;
  // DDP's fp16/bf16 compression hooks: dst16[i] = to16(to16(src[i]) / divisor)
  // (cast, then divide in the 16-bit type), dst_type kFloat16 or kBFloat16;
  // src_type a floating type.
  virtual void compress(const void* src, DType src_type, void* dst16, DType dst_type,
                        std::size_t n, int divisor) = 0;
  // dst[i] = float(src16[i]) stored as dst_type (a floating type).
  virtual void decompress(const void* src16, DType src_type, void* dst, DType dst_type,
                          std::size_t n) = 0;
  // Completes when everything issued before it (ops and collectives) has.
  virtual std::shared_ptr<Work> fence() = 0;
};

// The same work on host memory, done at once on the calling thread: what the
// Gloo backend's worker runs, and the reference the device kernels are
// tested against.
namespace host_ops {
void flatten(void* flat, std::span<const FlatPiece> pieces);
void unflatten(const void* flat, std::span<const FlatPiece> pieces);
// float32: a float division (what torch's div_ computes on a float tensor);
// other types as divide_host.
void divide(void* buf, std::size_t n, DType t, int divisor);
void compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
              int divisor);
void decompress(const void* src16, DType src_type, void* dst, DType dst_type, std::size_t n);
// Throws UsageError unless `floating` is a floating type and `sixteen` is
// float16 or bfloat16 (what compress/decompress accept).
void check_compress_types(const char* what, DType floating, DType sixteen);
// Checks a plan's pieces (inside the flat buffer, no overlap); throws UsageError.
void check_pieces(std::uint64_t flat_bytes, std::span<const FlatPiece> pieces);
}  // namespace host_ops

}  // namespace ddpdiag
