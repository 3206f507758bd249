// Subcommand registry. Each subcommand lives in its own file (cmd_*.cpp) and
// defines one add_*_command function that adds its CLI11 subcommand with its
// options and returns the function that runs it once the command line is
// parsed. The run function returns the process exit code (ExitCode) and
// throws ddpdiag::Error for failures; main() maps errors to exit codes.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

namespace ddpdiag::cli {

using RunFn = std::function<int()>;

struct Subcommand {
  CLI::App* app = nullptr;
  RunFn run;
};

Subcommand add_allreduce_test_command(CLI::App& parent);
Subcommand add_store_command(CLI::App& parent);    // store ping | serve
Subcommand add_buckets_command(CLI::App& parent);  // DDP bucket layout of a model
Subcommand add_sampler_command(CLI::App& parent);  // DistributedSampler indices
Subcommand add_report_command(CLI::App& parent);   // report validate | compare | render
Subcommand add_ddp_step_command(CLI::App& parent);        // simulated backward + reducer
Subcommand add_broadcast_test_command(CLI::App& parent);  // parameter broadcast + checksums
Subcommand add_init_check_command(CLI::App& parent);  // init phase by phase, per-rank timeline
Subcommand add_dp_vs_ring_command(CLI::App& parent);  // gather vs ring vs backend all_reduce
Subcommand add_link_health_command(CLI::App& parent);  // per-pair bandwidth/latency matrix
Subcommand add_bucket_sweep_command(CLI::App& parent);  // bucket_cap_mb sweep, recommendation
Subcommand add_memory_command(CLI::App& parent);  // per-rank memory of a DDP step
Subcommand add_model_command(CLI::App& parent);   // alpha-beta scale model from measured sweeps

}  // namespace ddpdiag::cli
