// The built-in launcher: `ddpdiag <command> --nproc N` starts N ranks of the
// same command on this machine, the way torchrun does: it hosts the store,
// sets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, ...,
// TORCHELASTIC_USE_AGENT_STORE=True), prefixes each rank's output lines with
// its rank, forwards Ctrl-C, and when one rank fails it lets the others end
// on their own for a grace period, then stops them, and reports which rank
// failed first and how.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ddpdiag::cli {

struct LaunchOptions {
  int nproc = 2;
  // argv of the children (argv[0] included), without the --nproc flag.
  std::vector<std::string> child_args;
  std::chrono::milliseconds grace{std::chrono::seconds(65)};
  bool progress = false;  // ask rank 0 to show progress (stderr is a terminal)
};

// Returns the job's exit code: 0 when every rank exited 0, else the exit
// code of the first rank that failed (5 when it was killed by a signal).
int launch_local(const LaunchOptions& o);

// This process's own command line, from /proc/self/cmdline.
std::vector<std::string> own_command_line();

}  // namespace ddpdiag::cli
