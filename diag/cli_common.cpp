#include "diag/cli_common.h"

#include <cstdio>

#include <fmt/core.h>

namespace ddpdiag::cli {

void print_error(const Error& e) {
  const auto& c = e.context();
  std::string where;
  if (c.rank >= 0) where += fmt::format(" on rank {}", c.rank);
  if (c.peer >= 0) where += fmt::format(" (peer rank {})", c.peer);
  if (!c.phase.empty()) where += fmt::format(" during {}", c.phase);
  std::fprintf(stderr, "ddpdiag: error%s: %s\n", where.c_str(), e.what());
  if (!c.hint.empty()) std::fprintf(stderr, "ddpdiag: hint: %s\n", c.hint.c_str());
}

}  // namespace ddpdiag::cli
