// A blocking store call (wait, get) made in slices, so that the waiter can
// give up between them: another rank has already failed, or the caller
// abandoned the wait. Each slice that passes without the keys is an ordinary
// store timeout (the client cancels its wait on the server, or reconnects
// under torch 1.13's protocol), so slices are kept to a few per second.
#pragma once

#include <algorithm>
#include <chrono>
#include <string>
#include <type_traits>

#include "comm/errors.h"
#include "comm/store/store.h"

namespace ddpdiag {

inline constexpr Millis kWaitSlice{250};

// Runs call(slice) until it returns, with slice at most `slice` and never past
// `timeout` from now; between two slices runs between(), which throws to give
// up (a call that returns within its first slice never runs it). A call that
// outlasts `timeout` in all throws the last slice's TimeoutError, saying how
// long it waited in all.
template <typename Call, typename Between>
std::invoke_result_t<Call, Millis> in_slices(Millis timeout, Call call, Between between,
                                             Millis slice = kWaitSlice) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = deadline_after(timeout);
  for (bool first = true;; first = false) {
    if (!first) between();
    const Millis left = time_left(deadline);
    try {
      return call(std::min(left, slice));
    } catch (const TimeoutError& e) {
      if (Clock::now() < deadline) continue;
      throw TimeoutError(std::string(e.what()) + " (" + std::to_string(timeout.count()) +
                             " ms in all)",
                         e.context());
    }
  }
}

}  // namespace ddpdiag
