#include "comm/algorithms/gather_reduce.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/errors.h"

namespace ddpdiag::algorithms {

namespace {

// Tag of the gather's point-to-point messages, apart from the ring's.
constexpr std::uint32_t kGatherTag = 0x6a7e0001;

using Clock = std::chrono::steady_clock;

void check_args(Communicator& comm, int root, const char* phase) {
  if (root < 0 || root >= comm.size())
    throw UsageError(std::string(phase) + ": root " + std::to_string(root) +
                         " is outside the world of " + std::to_string(comm.size()) + " ranks",
                     ErrorContext{phase, comm.rank(), -1, "pass a root in 0..world_size-1"});
}

}  // namespace

TrafficTheory gather_reduce_theory(int world_size, int rank, int root, std::uint64_t bytes) {
  TrafficTheory t;
  if (world_size <= 1) return t;
  const auto others = static_cast<std::uint64_t>(world_size - 1);
  if (rank == root) {
    t.bytes_sent = others * bytes;
    t.bytes_received = others * bytes;
    t.extra_bytes = others * bytes;
  } else {
    t.bytes_sent = bytes;
    t.bytes_received = bytes;
  }
  return t;
}

void gather_reduce_allreduce(CountingLinks& links, ScratchMemory& scratch, void* buf,
                             std::size_t count, DType dtype, ReduceOp op, Millis timeout,
                             int root) {
  Communicator& comm = links.comm();
  check_args(comm, root, "gather_reduce");
  const int n = comm.size(), me = comm.rank();
  if (n == 1 || count == 0) return;
  const std::size_t bytes = count * dtype_size(dtype);
  const auto deadline = Clock::now() + timeout;
  std::vector<std::uint8_t> host_staging;
  auto* data = static_cast<std::uint8_t*>(buf);

  if (me != root) {
    try {
      links.send(data, count, dtype, root, kGatherTag)->wait(time_left(deadline));
      links.recv(data, count, dtype, root, kGatherTag)->wait(time_left(deadline));
    } catch (Error& e) {
      if (e.context().peer < 0) e.context().peer = root;
      throw;
    }
    return;
  }

  // The root receives every peer's buffer into its own slot (all of them are
  // held at once, as DataParallel's gather on one device), reduces them in
  // rank order, and sends the result back.
  ScratchMemory::Buffer gathered(scratch, static_cast<std::size_t>(n - 1) * bytes);
  auto* slots = static_cast<std::uint8_t*>(gathered.get());
  auto slot_of = [&](int peer) { return static_cast<std::size_t>(peer < root ? peer : peer - 1); };
  std::vector<std::shared_ptr<Work>> works;
  try {
    for (int p = 0; p < n; ++p)
      if (p != root) works.push_back(links.recv(slots + slot_of(p) * bytes, count, dtype, p, kGatherTag));
    for (auto& w : works) w->wait(time_left(deadline));
    works.clear();
    for (int p = 0; p < n; ++p)
      if (p != root) reduce_into(comm, dtype, op, data, slots + slot_of(p) * bytes, count, host_staging);
    if (op == ReduceOp::kAvg) divide_in_place(comm, dtype, data, count, n, host_staging);
    for (int p = 0; p < n; ++p)
      if (p != root) works.push_back(links.send(data, count, dtype, p, kGatherTag));
    for (auto& w : works) w->wait(time_left(deadline));
  } catch (...) {
    // Receives may still be posted into `gathered`: stop them before it goes.
    if (!works.empty()) comm.abort();
    throw;
  }
}

}  // namespace ddpdiag::algorithms
