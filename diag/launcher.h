// The built-in launcher: `ddpdiag <command> --nproc N` starts N ranks of the
// same command on this machine, the way torchrun does: it hosts the store,
// sets the variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, ...,
// TORCHELASTIC_USE_AGENT_STORE=True), prefixes each rank's output lines with
// its rank, forwards Ctrl-C and SIGTERM (and then exits 128 + the signal),
// and when one rank fails it lets the others end on their own for a grace
// period, then stops them, and reports which rank failed first and how.
// It passes its own command line to the ranks in DDPDIAG_LAUNCHER_ARGV (a
// JSON array), so their reports record the command the user typed.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ddpdiag::cli {

// The most ranks --nproc starts on one machine: beyond it a typo (--nproc
// 100000) would fork until the machine runs out of processes or file
// descriptors.
inline constexpr int kMaxLocalRanks = 1024;

struct LaunchOptions {
  int nproc = 2;
  // argv of the children (argv[0] included), without the --nproc flag.
  std::vector<std::string> child_args;
  // The launcher's own command line, --nproc included: what the reports
  // record as argv (DDPDIAG_LAUNCHER_ARGV). Empty: child_args.
  std::vector<std::string> user_args;
  std::chrono::milliseconds grace{std::chrono::seconds(65)};
  bool progress = false;  // ask rank 0 to show progress (stderr is a terminal)
};

// Returns the job's exit code: 0 when every rank exited 0, else the exit
// code of the first rank that failed (5 when it was killed by a signal);
// 128 + the signal when the launcher itself got SIGINT or SIGTERM (it passes
// it to the ranks and blames none of them).
int launch_local(const LaunchOptions& o);

// This process's own command line, from /proc/self/cmdline.
std::vector<std::string> own_command_line();

// The command line a report records: under ddpdiag's launcher
// (DDPDIAG_LAUNCHER=1) the launcher's own, from DDPDIAG_LAUNCHER_ARGV, so that
// rerunning it starts the same world; else this process's.
std::vector<std::string> recorded_command_line();

}  // namespace ddpdiag::cli
