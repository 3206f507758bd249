// Everything that depends on the NCCL version lives here, so the backend
// itself is written against one API.
#pragma once

#include <nccl.h>

#include <string>

// The backend relies on the config API (ncclCommInitRankConfig with
// blocking = 0, ncclCommFinalize, ncclGetLastError), which NCCL 2.14
// introduced; ncclAvg and ncclBfloat16 are older (2.10).
static_assert(NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0),
              "ddpdiag's NCCL backend needs NCCL 2.14 or newer");

namespace ddpdiag::nccl_backend::compat {

// ncclGetVersion's code is X*1000 + Y*100 + Z up to 2.8 and
// X*10000 + Y*100 + Z from 2.9 on (22809 is 2.28.9).
inline std::string version_string(int code) {
  int major = 0, minor = 0, patch = 0;
  if (code >= 10000) {
    major = code / 10000;
    minor = (code % 10000) / 100;
    patch = code % 100;
  } else {
    major = code / 1000;
    minor = (code % 1000) / 100;
    patch = code % 100;
  }
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

}  // namespace ddpdiag::nccl_backend::compat
