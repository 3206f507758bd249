// Data types, reduction ops and the small pure helpers around them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddpdiag {

enum class DType : std::uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kInt8,
  kUInt8,
};

enum class ReduceOp : std::uint8_t { kSum, kProd, kMin, kMax, kAvg };

inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16,
                                       DType::kBFloat16, DType::kInt32,   DType::kInt64,
                                       DType::kInt8,    DType::kUInt8};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kProd, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kAvg};

std::size_t dtype_size(DType t);
// Names as nccl-tests prints them: float, double, half, bfloat16, int32, int64, int8, uint8.
std::string_view dtype_name(DType t);
std::string_view reduce_op_name(ReduceOp op);  // sum, prod, min, max, avg
bool dtype_is_floating(DType t);
// Parse user spellings ("float32", "float", "fp32", "f32", "half", "fp16", "bf16", ...).
std::optional<DType> parse_dtype(std::string_view s);
std::optional<ReduceOp> parse_reduce_op(std::string_view s);

// IEEE half and bfloat16 conversions (round to nearest even).
std::uint16_t float_to_half(float f);
float half_to_float(std::uint16_t h);
std::uint16_t float_to_bfloat16(float f);
float bfloat16_to_float(std::uint16_t b);

// Element-wise reduction on host memory: out[i] = op(a[i], b[i]) for n
// elements of type t. AVG reduces as SUM (the caller divides at the end).
// out may alias a or b.
void reduce_host(DType t, ReduceOp op, void* out, const void* a, const void* b, std::size_t n);
// Divide every element by d (used to finish AVG). Integers divide truncating.
void divide_host(DType t, void* buf, std::size_t n, double d);
// Convert between a dtype buffer and doubles (tests, checks).
double load_as_double(DType t, const void* buf, std::size_t i);
void store_from_double(DType t, void* buf, std::size_t i, double v);

// Bus-bandwidth factors of nccl-tests: all_reduce 2(n-1)/n; all_gather and
// reduce_scatter (n-1)/n; broadcast, reduce, send/recv 1.
enum class Collective : std::uint8_t {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kReduce,
  kSendRecv,
};
std::string_view collective_name(Collective c);
double busbw_factor(Collective c, int world_size);

// A connection of this rank's backend to a peer whose sent data the peer
// has not acknowledged while the kernel retransmits it: that link drops the
// traffic (a cable, a route, a firewall that started dropping).
struct StalledLink {
  int peer = -1;                    // -1: more than one rank at that address
  std::string remote;               // the peer's end, "10.0.0.3:41234"
  std::uint64_t unacked_bytes = 0;  // sent (or queued) and not acknowledged
  int retransmits = 0;              // retransmission timeouts without an answer
};

}  // namespace ddpdiag
