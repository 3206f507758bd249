// Runs the sub-groups of plan_bisect (bisect_plan.h) on a live job: every
// rank walks the same list; the members of a group create a communicator
// among themselves (comm/group.h, over the job's store, so it works even when
// the world communicator failed), time a small all_reduce with a correctness
// check and publish the outcome; everyone meets at a store barrier before the
// next group. Rank 0 judges and returns the verdict; rank 0 also prints it.
#pragma once

#include <cstddef>

#include <nlohmann/json.hpp>

#include "diag/bisect_plan.h"
#include "diag/cli_common.h"

namespace ddpdiag::cli {

struct BisectOptions {
  std::size_t bytes = 256 * 1024;  // per all_reduce
  int iters = 5;
  int warmup = 1;
  bool world_passed = false;  // the full world ran the command without a failure (rank 0's view)
};

// Returns the verdict's JSON on rank 0 (null elsewhere) and adds the
// "bisect" check to the report (fail when some sub-group failed or was slow).
// Prints nothing: the caller prints the verdict with print_bisect where its
// output has room for it. Throws TimeoutError when a rank does not reach a
// group barrier in time.
nlohmann::json run_bisect(Job& job, const CommonOptions& o, const BisectOptions& bo,
                          reports::Report& report);

// The sub-group table and the "# bisect: ..." summary line of run_bisect's
// verdict, on stdout (rank 0).
void print_bisect(const nlohmann::json& verdict, int world_size);

}  // namespace ddpdiag::cli
