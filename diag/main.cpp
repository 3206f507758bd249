// ddpdiag: one executable, one subcommand a file. Errors from every layer
// arrive here as exceptions and become exit codes and stderr messages in
// this one place.
#include <csignal>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "comm/errors.h"
#include "ddpdiag/config.h"
#include "diag/commands.h"

namespace ddpdiag::cli {
// Prints the error the way every subcommand does; defined in cli_common.cpp.
void print_error(const Error& e);
}  // namespace ddpdiag::cli

int main(int argc, char** argv) {
  using namespace ddpdiag;
  // A peer that dies leaves its sockets half-closed; Gloo's transport writes
  // to them without MSG_NOSIGNAL, and the default SIGPIPE would kill this
  // rank before it can report which peer went away. Ignored, the write fails
  // with EPIPE and becomes an error naming the peer (as under Python, which
  // ignores SIGPIPE for torch.distributed). Ranks the launcher starts inherit
  // this across exec.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"ddpdiag: diagnostics for data-parallel training (NCCL and Gloo)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ddpdiag ") + config::kVersion + " (" +
                                        config::kGitRevision + ")");
  std::vector<cli::Subcommand> subs = {
      cli::add_allreduce_test_command(app),
      cli::add_store_command(app),
      cli::add_buckets_command(app),
      cli::add_sampler_command(app),
      cli::add_report_command(app),
      cli::add_ddp_step_command(app),
      cli::add_broadcast_test_command(app),
      cli::add_init_check_command(app),
      cli::add_dp_vs_ring_command(app),
      cli::add_link_health_command(app),
      cli::add_bucket_sweep_command(app),
      cli::add_memory_command(app),
      cli::add_model_command(app),
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : static_cast<int>(ExitCode::kUsage);
  }
  try {
    for (auto& s : subs)
      if (s.app && s.app->parsed() && s.run) return s.run();
    return static_cast<int>(ExitCode::kUsage);
  } catch (const Error& e) {
    cli::print_error(e);
    return static_cast<int>(e.exit_code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddpdiag: internal error: %s\n", e.what());
    return 70;
  }
}
