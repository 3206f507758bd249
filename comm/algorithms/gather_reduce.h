// DataParallel-style all_reduce built on point-to-point: every rank sends its
// whole buffer to the root, the root reduces, then sends the result back to
// every rank. What torch.nn.DataParallel does with gradients (gather on one
// device, reduce, broadcast), and why it loses to the ring as the world
// grows: the root moves 2(n-1)·S bytes while every other rank moves 2·S, and
// the root holds all (n-1) incoming buffers at once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/algorithms/traffic.h"
#include "comm/communicator.h"

namespace ddpdiag::algorithms {

// The bytes one rank moves and the extra memory it needs, from theory.
struct TrafficTheory {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t extra_bytes = 0;  // scratch beyond the user's buffer, at the peak
};

// Gather-reduce-broadcast of S = bytes per rank on n ranks:
//   root:   sends (n-1)·S, receives (n-1)·S (2(n-1)·S in all), extra (n-1)·S;
//   others: sends S, receives S, no extra memory (the result lands in place).
TrafficTheory gather_reduce_theory(int world_size, int rank, int root, std::uint64_t bytes);

// In-place all_reduce of buf (count elements, the communicator's memory) by
// gather to root, reduce in rank order, send back. Every rank must call it
// with the same count, dtype, op and root. Every wait is bounded by timeout
// (TimeoutError). On an error the communicator is aborted before scratch
// buffers are freed, so no transfer can write into freed memory.
void gather_reduce_allreduce(CountingLinks& links, ScratchMemory& scratch, void* buf,
                             std::size_t count, DType dtype, ReduceOp op, Millis timeout,
                             int root = 0);

}  // namespace ddpdiag::algorithms
