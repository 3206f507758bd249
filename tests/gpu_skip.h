// The "[gpu]" test cases' guard: where no GPU can be used they skip with the
// reason (a warning), so the suite runs on CPU-only machines, unless
// DDPDIAG_REQUIRE_GPU=1 is set (scripts/gpu-check.sh sets it): then a GPU
// that cannot be used fails the case, and the GPU step of the check cannot
// pass having tested nothing.
#pragma once

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>

#include "comm/communicator.h"

namespace ddpdiag::test {

// True when the calling case must return (no GPU and none required).
inline bool no_gpu_skip() {
  if (cuda_device_count() > 0) return false;
  const char* required = std::getenv("DDPDIAG_REQUIRE_GPU");
  if (required && std::strcmp(required, "1") == 0)
    FAIL("DDPDIAG_REQUIRE_GPU=1 but no GPU can be used: " << cuda_unavailable_reason());
  WARN("skipped: no GPU (" << cuda_unavailable_reason() << ")");
  return true;
}

}  // namespace ddpdiag::test
