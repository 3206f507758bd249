#include "comm/algorithms/traffic.h"

namespace ddpdiag::algorithms {

void reduce_into(Communicator& comm, DType dtype, ReduceOp op, void* dst, const void* src,
                 std::size_t count, std::vector<std::uint8_t>& host_staging) {
  if (count == 0) return;
  if (comm.memory_kind() == MemoryKind::kHost) {
    reduce_host(dtype, op, dst, dst, src, count);
    return;
  }
  const std::size_t bytes = count * dtype_size(dtype);
  if (host_staging.size() < 2 * bytes) host_staging.resize(2 * bytes);
  std::uint8_t* a = host_staging.data();
  std::uint8_t* b = a + bytes;
  comm.copy_to_host(a, dst, bytes);
  comm.copy_to_host(b, src, bytes);
  reduce_host(dtype, op, a, a, b, count);
  comm.copy_from_host(dst, a, bytes);
}

void divide_in_place(Communicator& comm, DType dtype, void* buf, std::size_t count, double d,
                     std::vector<std::uint8_t>& host_staging) {
  if (count == 0) return;
  if (comm.memory_kind() == MemoryKind::kHost) {
    divide_host(dtype, buf, count, d);
    return;
  }
  const std::size_t bytes = count * dtype_size(dtype);
  if (host_staging.size() < bytes) host_staging.resize(bytes);
  comm.copy_to_host(host_staging.data(), buf, bytes);
  divide_host(dtype, host_staging.data(), count, d);
  comm.copy_from_host(buf, host_staging.data(), bytes);
}

}  // namespace ddpdiag::algorithms
