// What the send/recv-built collectives of comm/algorithms need around the
// Communicator: a thin wrapper that counts every byte each rank sends and
// receives (so the bytes moved can be checked against theory), scratch
// buffers whose peak is tracked (the extra memory an algorithm needs beyond
// the user's buffer), and an element-wise reduction that works on either
// memory kind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/communicator.h"

namespace ddpdiag::algorithms {

// Per-rank traffic. Counted when an operation is issued, for the bytes the
// operation moves (count x element size), so it is what the algorithm asked
// the transport to carry, not what the transport adds (headers, retries).
struct Traffic {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
};

// Point-to-point through a communicator, counted. The algorithms talk to
// peers only through this wrapper.
class CountingLinks {
 public:
  explicit CountingLinks(Communicator& comm) : comm_(comm) {}

  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) {
    count_send(count, dtype);
    return comm_.send(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) {
    count_recv(count, dtype);
    return comm_.recv(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count, int send_peer,
                                 void* recv_buf, std::size_t recv_count, int recv_peer,
                                 DType dtype, std::uint32_t tag) {
    count_send(send_count, dtype);
    count_recv(recv_count, dtype);
    return comm_.sendrecv(send_buf, send_count, send_peer, recv_buf, recv_count, recv_peer, dtype,
                          tag);
  }

  Communicator& comm() { return comm_; }
  const Traffic& traffic() const { return traffic_; }
  void reset() { traffic_ = {}; }

 private:
  void count_send(std::size_t count, DType dtype) {
    if (count == 0) return;
    traffic_.bytes_sent += count * dtype_size(dtype);
    ++traffic_.messages_sent;
  }
  void count_recv(std::size_t count, DType dtype) {
    if (count == 0) return;
    traffic_.bytes_received += count * dtype_size(dtype);
    ++traffic_.messages_received;
  }

  Communicator& comm_;
  Traffic traffic_;
};

// Scratch memory of one algorithm, in the communicator's memory kind, with
// its current and peak bytes. Not thread-safe (one algorithm call at a time).
class ScratchMemory {
 public:
  explicit ScratchMemory(Communicator& comm) : comm_(comm) {}

  // A buffer that gives its bytes back to the tally when it goes.
  class Buffer {
   public:
    Buffer(ScratchMemory& owner, std::size_t bytes) : owner_(owner), buf_(owner.comm_, bytes) {
      owner_.current_ += bytes;
      if (owner_.current_ > owner_.peak_) owner_.peak_ = owner_.current_;
    }
    ~Buffer() { owner_.current_ -= buf_.bytes(); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    void* get() const { return buf_.get(); }
    std::size_t bytes() const { return buf_.bytes(); }

   private:
    ScratchMemory& owner_;
    CommBuffer buf_;
  };

  std::uint64_t current_bytes() const { return current_; }
  std::uint64_t peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = current_; }

 private:
  Communicator& comm_;
  std::uint64_t current_ = 0;
  std::uint64_t peak_ = 0;
};

// dst[i] = op(dst[i], src[i]) for count elements in the communicator's
// memory. Host memory reduces in place; device memory (NCCL) goes through
// host staging (two copies in, one out), because this build has no device
// kernels: correct, but it makes the send/recv algorithms slow on GPUs and
// their times there are not representative. AVG reduces as SUM.
void reduce_into(Communicator& comm, DType dtype, ReduceOp op, void* dst, const void* src,
                 std::size_t count, std::vector<std::uint8_t>& host_staging);
// Divides every element by d (finishing AVG), either memory kind.
void divide_in_place(Communicator& comm, DType dtype, void* buf, std::size_t count, double d,
                     std::vector<std::uint8_t>& host_staging);

}  // namespace ddpdiag::algorithms
