#include "comm/algorithms/ring_allreduce.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <vector>

#include "comm/errors.h"

namespace ddpdiag::algorithms {

namespace {

constexpr std::uint32_t kRingTag = 0x7219e001;

using Clock = std::chrono::steady_clock;

int mod(int a, int n) { return ((a % n) + n) % n; }

}  // namespace

RingChunk ring_chunk(std::size_t count, int world_size, int c) {
  DDPDIAG_ASSERT(world_size >= 1 && c >= 0 && c < world_size);
  const auto n = static_cast<std::size_t>(world_size);
  const auto i = static_cast<std::size_t>(c);
  const std::size_t base = count / n, extra = count % n;
  return {i * base + std::min(i, extra), base + (i < extra ? 1 : 0)};
}

TrafficTheory ring_allreduce_theory(std::size_t count, std::size_t elem_size, int world_size,
                                    int rank) {
  TrafficTheory t;
  if (world_size <= 1) return t;
  const std::uint64_t total = static_cast<std::uint64_t>(count) * elem_size;
  const std::uint64_t skip_rs = ring_chunk(count, world_size, mod(rank + 1, world_size)).count * elem_size;
  const std::uint64_t skip_ag = ring_chunk(count, world_size, mod(rank + 2, world_size)).count * elem_size;
  t.bytes_sent = 2 * total - skip_rs - skip_ag;
  // What the left neighbour sends: every chunk but (r) and (r+1).
  const std::uint64_t left_rs = ring_chunk(count, world_size, mod(rank, world_size)).count * elem_size;
  t.bytes_received = 2 * total - left_rs - skip_rs;
  t.extra_bytes = ring_chunk(count, world_size, 0).count * elem_size;  // chunk 0 is the largest
  return t;
}

double ring_nominal_bytes(std::uint64_t bytes, int world_size) {
  if (world_size <= 1) return 0;
  return 2.0 * (world_size - 1) / world_size * static_cast<double>(bytes);
}

void ring_allreduce(CountingLinks& links, ScratchMemory& scratch, void* buf, std::size_t count,
                    DType dtype, ReduceOp op, Millis timeout) {
  Communicator& comm = links.comm();
  const int n = comm.size(), r = comm.rank();
  if (n == 1 || count == 0) return;
  const std::size_t es = dtype_size(dtype);
  const int right = mod(r + 1, n), left = mod(r - 1, n);
  const auto deadline = Clock::now() + timeout;
  std::vector<std::uint8_t> host_staging;
  auto* data = static_cast<std::uint8_t*>(buf);
  auto at = [&](int c) { return data + ring_chunk(count, n, c).offset * es; };
  auto len = [&](int c) { return ring_chunk(count, n, c).count; };

  // One staging chunk receives the left neighbour's partial sum while this
  // rank's own chunk is still being sent; the all-gather receives in place.
  ScratchMemory::Buffer stage(scratch, len(0) * es);
  std::shared_ptr<Work> w;
  try {
    // Reduce-scatter: after step s rank r holds the sum of s+2 ranks' chunk
    // (r-s-1); after n-1 steps chunk (r+1) is complete.
    for (int s = 0; s + 1 < n; ++s) {
      const int send_c = mod(r - s, n), recv_c = mod(r - s - 1, n);
      w = links.sendrecv(at(send_c), len(send_c), right, stage.get(), len(recv_c), left, dtype,
                         kRingTag);
      w->wait(time_left(deadline));
      w.reset();
      reduce_into(comm, dtype, op, at(recv_c), stage.get(), len(recv_c), host_staging);
    }
    // All-gather: pass the complete chunks on around the ring.
    for (int s = 0; s + 1 < n; ++s) {
      const int send_c = mod(r + 1 - s, n), recv_c = mod(r - s, n);
      w = links.sendrecv(at(send_c), len(send_c), right, at(recv_c), len(recv_c), left, dtype,
                         kRingTag);
      w->wait(time_left(deadline));
      w.reset();
    }
  } catch (...) {
    if (w) comm.abort();  // a transfer into `stage` may still be posted
    throw;
  }
  if (op == ReduceOp::kAvg) divide_in_place(comm, dtype, data, count, n, host_staging);
}

}  // namespace ddpdiag::algorithms
