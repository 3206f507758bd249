// A communicator whose broadcasts and all_reduces take a set time each, one
// after another, as on a link that moves one collective at a time: op k
// completes `per_op` after the later of its issue and op k-1's completion.
// One op (stall_at, counted from 0 over both kinds) can be made to never
// complete; its wait fails with a TimeoutError at its timeout, as a
// backend's does. The wrapped Gloo op still runs underneath (every rank
// issues it), so nothing is left half done; abort() only counts, leaving the
// Gloo communicator usable for the test's own checks.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "comm/errors.h"
#include "tests/forwarding_communicator.h"

namespace ddpdiag::test {

class PacedCommunicator final : public ForwardingCommunicator {
 public:
  using Clock = std::chrono::steady_clock;

  PacedCommunicator(Communicator& inner, Millis per_op, int stall_at = -1)
      : ForwardingCommunicator(inner), per_op_(per_op), stall_at_(stall_at) {}

  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    return paced(ForwardingCommunicator::broadcast(buf, count, dtype, root));
  }
  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    return paced(ForwardingCommunicator::allreduce(send, recv, count, dtype, op));
  }
  void abort() override { ++aborts_; }
  int aborts() const { return aborts_; }
  int ops() const { return ops_; }

 private:
  class PacedWork final : public Work {
   public:
    // done_at: when it completes; max(): never.
    PacedWork(std::shared_ptr<Work> inner, Clock::time_point done_at, int index)
        : inner_(std::move(inner)), done_at_(done_at), index_(index) {}
    bool is_completed() override { return Clock::now() >= done_at_ && inner_->is_completed(); }
    void wait(Millis timeout) override {
      const auto deadline = Clock::now() + timeout;
      if (done_at_ > deadline) {
        std::this_thread::sleep_until(deadline);
        throw TimeoutError("paced op " + std::to_string(index_) + ": no result within " +
                               std::to_string(timeout.count()) + " ms",
                           ErrorContext{"paced", -1, -1, ""});
      }
      std::this_thread::sleep_until(done_at_);
      inner_->wait(
          std::max(Millis(1), std::chrono::duration_cast<Millis>(deadline - Clock::now())));
    }
    void abort() override {}

   private:
    std::shared_ptr<Work> inner_;
    Clock::time_point done_at_;
    int index_;
  };

  std::shared_ptr<Work> paced(std::shared_ptr<Work> inner) {
    const int index = ops_++;
    if (index == stall_at_) {
      last_done_ = Clock::time_point::max();
      return std::make_shared<PacedWork>(std::move(inner), last_done_, index);
    }
    // Ops after a stalled one never complete either: they queue behind it.
    if (last_done_ != Clock::time_point::max())
      last_done_ = std::max(Clock::now(), last_done_) + per_op_;
    return std::make_shared<PacedWork>(std::move(inner), last_done_, index);
  }

  Millis per_op_;
  int stall_at_;
  int ops_ = 0;
  int aborts_ = 0;
  Clock::time_point last_done_{};
};

// Milliseconds from t0 to now.
inline double ms_since(PacedCommunicator::Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(PacedCommunicator::Clock::now() - t0).count();
}

}  // namespace ddpdiag::test
