// The time left until a deadline, for the waits of the reducer and the
// parameter broadcast.
#pragma once

#include <algorithm>
#include <chrono>

#include "comm/store/store.h"  // Millis

namespace ddpdiag::ddp_core {

// What is left of a wait until `deadline`: 1 ms at least, so a Work that has
// completed still returns, and one that has not fails at once.
inline Millis left_until(std::chrono::steady_clock::time_point deadline) {
  return std::max(Millis(1),
                  std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now()));
}

}  // namespace ddpdiag::ddp_core
