// A communicator that hands every call to another one: the base of the test
// wrappers that change one thing (what an op does, what memory it claims)
// and leave the rest as the wrapped Gloo communicator does it.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace ddpdiag::test {

class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator& inner) : inner_(inner) {
    set_default_timeout(inner.default_timeout());
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::vector<StalledLink> stalled_links() const override { return inner_.stalled_links(); }
  Backend backend() const override { return inner_.backend(); }
  MemoryKind memory_kind() const override { return inner_.memory_kind(); }
  std::string library_version() const override { return inner_.library_version(); }
  std::string device_name() const override { return inner_.device_name(); }
  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    return inner_.allreduce(send, recv, count, dtype, op);
  }
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    return inner_.broadcast(buf, count, dtype, root);
  }
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root) override {
    return inner_.reduce(send, recv, count, dtype, op, root);
  }
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                  DType dtype) override {
    return inner_.allgather(send, recv, count, dtype);
  }
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                       DType dtype, ReduceOp op) override {
    return inner_.reduce_scatter(send, recv, recv_count, dtype, op);
  }
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    return inner_.send(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    return inner_.recv(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> barrier() override { return inner_.barrier(); }
  void* alloc(std::size_t bytes) override { return inner_.alloc(bytes); }
  void free(void* ptr) override { inner_.free(ptr); }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    inner_.copy_to_host(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    inner_.copy_from_host(dst, src, bytes);
  }
  void abort() override { inner_.abort(); }

 protected:
  Communicator& inner() { return inner_; }

 private:
  Communicator& inner_;
};

}  // namespace ddpdiag::test
