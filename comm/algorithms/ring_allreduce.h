// Ring all_reduce built on point-to-point: reduce-scatter then all-gather
// around the ring rank -> rank+1, each in n-1 steps of one chunk, as NCCL's
// ring and Gloo's ring do. Every rank sends and receives 2(n-1)/n·S bytes,
// independent of n in the limit, which is why it scales and the gather does
// not.
//
// Chunking rule (exact traffic). The buffer of `count` elements is cut into n
// chunks by elements: chunk c has floor(count/n) elements, plus one for the
// first count mod n chunks, and chunks are contiguous in order. In the
// reduce-scatter rank r sends every chunk but (r+1) mod n, in the all-gather
// every chunk but (r+2) mod n, and receives what its left neighbour sends.
// So rank r sends exactly
//     2·S − bytes(chunk (r+1) mod n) − bytes(chunk (r+2) mod n)
// and receives 2·S − bytes(chunk r) − bytes(chunk (r+1) mod n); both are
// exactly 2(n−1)/n·S when count is a multiple of n (S a multiple of
// n × element size). Otherwise the ranks' figures differ by at most two
// elements, and the sum over ranks is exactly 2(n−1)·S.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/algorithms/gather_reduce.h"
#include "comm/algorithms/traffic.h"
#include "comm/communicator.h"

namespace ddpdiag::algorithms {

struct RingChunk {
  std::size_t offset = 0;  // elements
  std::size_t count = 0;   // elements
};

// Chunk c of a buffer of count elements split over world_size ranks (the
// rule above).
RingChunk ring_chunk(std::size_t count, int world_size, int c);

// Exact bytes rank `rank` sends and receives, and its extra memory (one
// staging chunk, the largest), for count elements of elem_size bytes.
TrafficTheory ring_allreduce_theory(std::size_t count, std::size_t elem_size, int world_size,
                                    int rank);
// The textbook figure 2(n−1)/n·S per rank and direction (a double: it is not
// an integer when S is not a multiple of n).
double ring_nominal_bytes(std::uint64_t bytes, int world_size);

// In-place ring all_reduce of buf (count elements, the communicator's
// memory). Steps use Communicator::sendrecv, so both directions of a step
// are in flight together. Same contract as gather_reduce_allreduce.
void ring_allreduce(CountingLinks& links, ScratchMemory& scratch, void* buf, std::size_t count,
                    DType dtype, ReduceOp op, Millis timeout);

}  // namespace ddpdiag::algorithms
