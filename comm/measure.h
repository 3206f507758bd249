// Timing and checking of collectives the way nccl-tests does it, on any
// backend: back-to-back launches ended by one wait, after warm-up and a
// barrier; time per op = elapsed / iterations; algbw = bytes / time; busbw =
// algbw x the collective's factor; a correctness pass with inputs whose
// reduction is exact in any order, compared bit for bit on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "comm/types.h"

namespace ddpdiag {

// Sizes of a sweep: from min to max (inclusive), multiplied by factor, or
// increased by step_bytes when it is non-zero (nccl-tests -f / -i). Every size
// is rounded down to a multiple of elem_size (and is at least one element).
std::vector<std::size_t> sweep_sizes(std::size_t min_bytes, std::size_t max_bytes, double factor,
                                     std::size_t step_bytes, std::size_t elem_size);

// Inputs whose all_reduce is exact in any order of reduction, for any world
// size: small integers kept below the dtype's exact-integer range (sum, avg),
// one factor of 2 per element (prod), values 0..17 (min, max; each rank the only extreme of some elements). Integer sums
// may wrap, which is exact too (modular arithmetic is associative).
void fill_exact_inputs(DType dtype, ReduceOp op, int world_size, int rank, void* host,
                       std::size_t count);
// The exact all_reduce result, element by element, in the dtype's bytes.
void fill_expected_allreduce(DType dtype, ReduceOp op, int world_size, void* host,
                             std::size_t count);
// How a backend computes a floating-point average. Gloo here sums, then
// divides: exact on these inputs. NCCL's ncclAvg on a floating dtype
// multiplies each input by 1/n rounded to the dtype, then sums (nccl-tests
// calls it PreMulSum): inexact wherever 1/n is (a world size that is not a
// power of two), so the result may differ from the exact average by a few
// units in the last place, in an order that depends on the ring.
enum class AvgRounding { kExact, kPreMultiplied };

// Elements of `got` that differ bit for bit from the expected result. With
// kPreMultiplied, a floating-point average at a world size that is not a
// power of two may instead be within (n + 1) units in the last place of it
// (the bound of n rounded products summed in any order; nccl-tests allows
// rounding there too); every other case stays bit for bit.
std::int64_t count_wrong_allreduce(DType dtype, ReduceOp op, int world_size, const void* got,
                                   std::size_t count, AvgRounding avg = AvgRounding::kExact);

// The wrong elements of one result: how many, and the first of them (its
// index, the value found and the value expected, as doubles).
struct WrongElements {
  std::int64_t count = 0;
  std::int64_t first = -1;  // -1 when none is wrong
  double got = 0;
  double expected = 0;
};
WrongElements find_wrong_allreduce(DType dtype, ReduceOp op, int world_size, const void* got,
                                   std::size_t count, AvgRounding avg = AvgRounding::kExact);

struct TimingBlock {
  double time_us = 0;           // mean over ranks of each rank's time per op
  double min_rank_time_us = 0;  // fastest rank
  double max_rank_time_us = 0;  // slowest rank
  int fastest_rank = 0;
  int slowest_rank = 0;
  double algbw_gbps = 0;        // bytes / time_us, G = 1e9
  double busbw_gbps = 0;
  std::int64_t wrong = 0;       // summed over ranks; -1 when not checked
  // Each rank's wrong elements (empty when not checked): which rank's
  // result was wrong, for the bad-rank hunt.
  std::vector<std::int64_t> wrong_by_rank;
  // Each rank's first wrong element (count 0 where none was), from the
  // check that found the most (empty when not checked).
  std::vector<WrongElements> first_wrong_by_rank;
};

struct SizeResult {
  std::size_t bytes = 0;
  std::size_t count = 0;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = -1;  // -1 when the collective has none
  std::optional<TimingBlock> out_of_place;
  std::optional<TimingBlock> in_place;
};

struct SweepOptions {
  Collective collective = Collective::kAllReduce;
  std::vector<std::size_t> sizes;  // bytes, from sweep_sizes()
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int iters = 20;
  int warmup = 5;
  int check_iters = 1;  // 0: no correctness check (wrong = -1)
  bool out_of_place = true;
  bool in_place = true;
  Millis timeout = std::chrono::seconds(60);
  // Timed iterations move through the sweep's buffers (of its largest size):
  // iteration i at offset (i mod (largest / size)) * size, as nccl-tests
  // does, so a size smaller than a cache is not timed from that cache.
  // Default: on device memory (NCCL), where one stream runs the ops in order.
  // Gloo runs ops on distinct buffers concurrently (its worker threads), so
  // there rotating would time overlapped all_reduces: off unless asked.
  std::optional<bool> rotate_buffers;
  // Called on every rank after each size completes (for progress output).
  std::function<void(std::size_t index, const SizeResult&)> on_size_done;
};

// Runs the sweep. Collective over the communicator: every rank must call it
// with the same options. Results are identical on every rank. Completed sizes
// are appended to `out` as they finish, so a failure part-way keeps them.
void run_allreduce_sweep(Communicator& comm, const SweepOptions& opts,
                         std::vector<SizeResult>& out);

// Gathers one double per rank onto every rank (through the communicator's
// own memory kind).
std::vector<double> allgather_doubles(Communicator& comm, const std::vector<double>& mine,
                                      Millis timeout);

}  // namespace ddpdiag
