// ddpdiag: one executable, one subcommand a file. Errors from every layer
// arrive here as exceptions and become exit codes and stderr messages in
// this one place.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "comm/errors.h"
#include "comm/world.h"
#include "ddpdiag/config.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/launcher.h"
#include "reports/render.h"
#include "reports/report.h"

namespace {

// An exception that escapes a thread we do not own ends in std::terminate.
// The one seen in practice: Gloo's network thread throws when a peer's socket
// closes in the middle of the connection handshake (the peer exited or was
// killed during setup). Say so on stderr and exit as "a peer failed" (5),
// instead of dying of SIGABRT with a bare library message.
[[noreturn]] void on_terminate() {
  std::string what = "no exception";
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      what = x.what();
    } catch (...) {
      what = "an exception of unknown type";
    }
  }
  const int rank = ddpdiag::cli::current_rank();
  // Gloo checks in its own thread that a message fits the buffer posted for
  // it: a bigger one means the ranks disagree on what this collective is.
  const bool size_mismatch = what.find("preamble.length <= op.nbytes") != std::string::npos;
  const char* hint =
      size_mismatch
          ? "a peer sent more data than this rank expected for the same collective: the ranks "
            "issued different collectives (a skipped or extra call, or different sizes); rerun "
            "with --desync-check to name the rank and the call"
          : "this happens when a peer exits or is killed while the ranks are still connecting; "
            "see the other ranks' messages for the first failure";
  std::fprintf(stderr, "ddpdiag: error%s: a library thread failed: %s\nddpdiag: hint: %s\n",
               rank >= 0 ? fmt::format(" on rank {}", rank).c_str() : "", what.c_str(), hint);
  // A failed run still writes its report: the error, with what this rank
  // knew before its command ran (argv, environment, world).
  const std::string written = ddpdiag::cli::write_report_on_terminate(
      fmt::format("a library thread failed: {}", what), hint);
  if (!written.empty()) std::fprintf(stderr, "ddpdiag: report of the failure: %s\n", written.c_str());
  std::fflush(stderr);
  std::_Exit(static_cast<int>(ddpdiag::ExitCode::kPeerFailed));
}

// CLI11 answers a value its integer option cannot hold with "Could not
// convert: --iters = 2147483648". Say what was wrong instead: not a whole
// number, or out of range, with the range. Integer options here are int
// (32 bits) unless they check cli::int64_value(), whose own message comes
// first for a value beyond 64 bits; so a whole number that still fails to
// convert is out of the 32-bit range.
std::string explain_conversion(const CLI::App& app, const CLI::ConversionError& e) {
  const std::string msg = e.what();
  const std::string prefix = "Could not convert: ";
  const auto eq = msg.find(" = ");
  if (msg.rfind(prefix, 0) != 0 || eq == std::string::npos) return msg;
  const std::string name = msg.substr(prefix.size(), eq - prefix.size());
  const std::string value = msg.substr(eq + 3);
  const CLI::Option* opt = nullptr;
  std::vector<const CLI::App*> todo = {&app};
  while (!todo.empty() && !opt) {
    const CLI::App* a = todo.back();
    todo.pop_back();
    opt = a->get_option_no_throw(name);
    for (const CLI::App* s : a->get_subcommands([](const CLI::App* c) { return c->parsed(); }))
      todo.push_back(s);
  }
  if (opt && opt->get_type_name().rfind("FLOAT", 0) == 0)
    return fmt::format("{}: '{}' is not a number", name, value);
  if (!opt || opt->get_type_name().rfind("INT", 0) != 0) return msg;
  // Read as CLI11 reads integers: base 0 (0x hex, a leading 0 octal).
  errno = 0;
  char* end = nullptr;
  const long long v = value.empty() ? 0 : std::strtoll(value.c_str(), &end, 0);
  if (value.empty() || !end || *end != '\0')
    return fmt::format("{}: '{}' is not a whole number", name, value);
  const bool negative = errno == ERANGE ? value[0] == '-' : v < 0;
  if (errno == ERANGE || v > 2147483647LL || v < -2147483648LL)
    return fmt::format("{}: {} is out of range; it takes {}", name, value,
                       negative ? "at least -2147483648" : "at most 2147483647");
  return msg;
}

// A command line refused while it was parsed (a bad flag value) still
// writes its report where --json/--markdown ask, as a run refused later
// does: verdict ERROR, error.kind usage, exit 2, world null. Not when the
// report path is what was refused, not for `report` (its outputs are not
// run reports), and from rank 0 or a process with no rank only: every rank
// of a job refuses the same line, and rank 0 writes the job's report.
// A flag the parser refused, in ddpdiag's own form (prefix, then a hint
// naming the subcommand's --help).
void print_flag_error(const CLI::App& app, const std::string& message) {
  std::string command = "ddpdiag";
  for (const CLI::App* a = &app; a;) {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : a->get_subcommands()) next = sub;
    if (next) command += " " + next->get_name();
    a = next;
  }
  std::fprintf(stderr, "ddpdiag: error: %s\nddpdiag: hint: `%s --help` lists the flags and their values\n",
               message.c_str(), command.c_str());
}

// The deepest subcommand parsed (nullptr if none), and its path
// ("report render") in `command`.
const CLI::App* parsed_subcommand(const CLI::App& app, std::string& command) {
  const CLI::App* sub = nullptr;
  command.clear();
  for (const CLI::App* a = &app;;) {
    const auto parsed = a->get_subcommands([](const CLI::App* c) { return c->parsed(); });
    if (parsed.empty()) return sub;
    a = sub = parsed.front();
    command += (command.empty() ? "" : " ") + sub->get_name();
  }
}

void write_flag_error_report(const CLI::App& app, const CLI::ParseError& e) {
  std::string command;
  const CLI::App* sub = parsed_subcommand(app, command);
  if (!sub || command.rfind("report", 0) == 0) return;
  const auto value_of = [&](const char* name) -> std::string {
    const CLI::Option* opt = sub->get_option_no_throw(name);
    return opt && !opt->results().empty() ? opt->results().back() : std::string();
  };
  const std::string json_path = value_of("--json"), markdown_path = value_of("--markdown");
  if (json_path.empty() && markdown_path.empty()) return;
  const std::string what = e.what();
  if (what.rfind("--json", 0) == 0 || what.rfind("--markdown", 0) == 0) return;
  // Never over a file the line names for something else (model's input
  // reports): a typo must not cost the user a report.
  for (const CLI::Option* opt : sub->get_options()) {
    if (opt->check_name("--json") || opt->check_name("--markdown")) continue;
    for (const std::string& v : opt->results())
      if (ddpdiag::reports::same_file(json_path, v) || ddpdiag::reports::same_file(markdown_path, v)) return;
  }
  // This process's rank, as --rank or the launchers' variables give it
  // (as comm/world.cpp reads them): only rank 0 writes the job's report.
  std::string rank_text;
  if (const CLI::Option* opt = sub->get_option_no_throw("--rank"); opt && !opt->results().empty())
    rank_text = opt->results().back();
  else
    rank_text = ddpdiag::launcher_rank_text(ddpdiag::process_env()).value_or("");
  if (!rank_text.empty()) {
    char* end = nullptr;
    const long r = std::strtol(rank_text.c_str(), &end, 10);
    if (!end || *end != '\0' || r != 0) return;
  }
  try {
    ddpdiag::cli::check_report_outputs(json_path, markdown_path);
    ddpdiag::reports::Report report(command, ddpdiag::cli::recorded_command_line());
    report.set_environment(ddpdiag::recorded_environment());
    report.set_error({"usage", what, "flags", -1, -1, "run with --help for the flags and what they take",
                      static_cast<int>(ddpdiag::ExitCode::kUsage)});
    ddpdiag::reports::write_report_outputs(report.finish(), json_path, markdown_path);
  } catch (const std::exception&) {
    // The flag error is what the user reads; a report that cannot be
    // written as well adds nothing to it.
  }
}

// A report written over a file the command line names for something else
// (--model's layout, model's input reports) would destroy that file, the
// failure's report too: refused before anything runs. Only an existing
// regular file can be lost; `report` checks its own outputs.
void refuse_report_over_an_input(const CLI::App& app) {
  std::string command;
  const CLI::App* sub = parsed_subcommand(app, command);
  if (!sub || command.rfind("report", 0) == 0) return;
  const auto same_regular_file = [](const std::string& a, const std::string& b) {
    struct stat sa {}, sb {};
    return !a.empty() && !b.empty() && ::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0 &&
           S_ISREG(sa.st_mode) && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  };
  for (const char* out_flag : {"--json", "--markdown"}) {
    const CLI::Option* out_opt = sub->get_option_no_throw(out_flag);
    if (!out_opt || out_opt->results().empty()) continue;
    const std::string& out = out_opt->results().back();
    for (const CLI::Option* opt : sub->get_options()) {
      if (opt == out_opt || opt->check_name("--json") || opt->check_name("--markdown")) continue;
      for (const std::string& v : opt->results()) {
        if (!same_regular_file(out, v)) continue;
        const std::string what = opt->nonpositional()
                                     ? fmt::format("the file {} reads ({})", opt->get_name(), v)
                                     : fmt::format("an input {} reads ({})", command, v);
        throw ddpdiag::UsageError(
            fmt::format("{} {} is also {}: writing the report would replace it", out_flag, out, what),
            ddpdiag::ErrorContext{"flags", -1, -1, "write the report to another file"});
      }
    }
  }
}

// Standard input, output or error closed by the caller (`>&-`): each is
// held by /dev/null opened read-only, so no socket or report file of this
// process takes its number (output meant for the terminal would go into it),
// and a write there still fails (EBADF), as it would have.
void hold_closed_standard_fds() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    const int held = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (held >= 0 && held != fd) {
      ::dup2(held, fd);  // without O_CLOEXEC: a rank started by the launcher keeps it
      ::close(held);
    } else if (held == fd) {
      ::fcntl(fd, F_SETFD, 0);
    }
  }
}

// A command whose output is its result (sampler's indices, store get's
// value, the tables) must not exit 0 when standard output could not take it
// (a full disk, a closed descriptor): exit 2, saying so. A reader that went
// away (`| head`) stopped the output on purpose: no message, the run's code.
int finish_standard_output(int rc) {
  std::cout.flush();
  errno = 0;
  const bool flush_failed = std::fflush(stdout) != 0;
  int err = flush_failed ? errno : 0;
  if (!flush_failed && !std::ferror(stdout) && !std::cout.fail()) return rc;
  // An earlier write failed and nothing was left to flush: a write of
  // nothing tells a bad descriptor; a pipe whose reader is gone polls as an
  // error.
  if (err == 0 && ::write(STDOUT_FILENO, "", 0) < 0) err = errno;
  if (struct stat st {}; err == 0 && ::fstat(STDOUT_FILENO, &st) == 0 && S_ISFIFO(st.st_mode)) {
    pollfd p{STDOUT_FILENO, POLLOUT, 0};
    if (::poll(&p, 1, 0) == 1 && (p.revents & POLLERR)) err = EPIPE;
  }
  if (err == EPIPE) return rc;
  std::fprintf(stderr,
               "ddpdiag: cannot write the output to standard output: %s; what it printed is incomplete\n"
               "ddpdiag: hint: check where standard output goes (a full disk? a closed descriptor?), or "
               "write the results to a file with --json\n",
               err != 0 ? std::strerror(err) : "a write failed");
  return rc == 0 ? static_cast<int>(ddpdiag::ExitCode::kUsage) : rc;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace ddpdiag;
  hold_closed_standard_fds();
  // A peer that dies leaves its sockets half-closed; Gloo's transport writes
  // to them without MSG_NOSIGNAL, and the default SIGPIPE would kill this
  // rank before it can report which peer went away. Ignored, the write fails
  // with EPIPE and becomes an error naming the peer (as under Python, which
  // ignores SIGPIPE for torch.distributed). Ranks the launcher starts inherit
  // this across exec.
  std::signal(SIGPIPE, SIG_IGN);
  // Likewise a file-size limit (ulimit -f): a write past it fails with
  // EFBIG, and the report writers take back what they wrote and exit 2
  // naming the limit, instead of the process dying half-way through a file.
  std::signal(SIGXFSZ, SIG_IGN);
  std::set_terminate(on_terminate);
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
  // One walk over every option of every subcommand:
  // - CLI11 reads an integer with a leading 0 as octal: `-n 010` would run 8
  //   iterations and `--master-port 029500` dial another port. Refused on
  //   every integer option.
  // - Each option's default in --help (`--timeout FLOAT=60`), as torchrun
  //   prints its own. Not where the default stands for "not given": the
  //   launcher's variables an option overrides, --nproc's and model's
  //   --world-size's, one its description explains ("default: the fit"), a
  //   value the option's own check would refuse (-1 for a required count, 0
  //   for a size > 0), an empty list.
  {
    const CLI::Validator no_octal(
        [](std::string& v) -> std::string {
          const std::size_t i = (!v.empty() && (v[0] == '+' || v[0] == '-')) ? 1 : 0;
          if (v.size() > i + 1 && v[i] == '0' && v.find_first_not_of("0123456789", i) == std::string::npos)
            return fmt::format("'{}' has a leading 0, which would read it as octal: write it without", v);
          return {};
        },
        "", "no_octal");
    const auto refused = [](CLI::Option* opt, const std::string& value) {
      for (int i = 0;; ++i) {
        try {
          if (!(*opt->get_validator(i))(value).empty()) return true;
        } catch (const CLI::OptionNotFound&) {
          return false;
        }
      }
    };
    const auto shows_default = [](const CLI::Option* opt) {
      const std::string& what = opt->get_description();
      return opt->get_type_size() != 0 && opt->get_name() != "--nproc" &&
             opt->get_name() != "--world-size" && what.find("(overrides ") == std::string::npos &&
             what.find("default:") == std::string::npos;
    };
    std::vector<CLI::App*> todo = {&app};
    while (!todo.empty()) {
      CLI::App* a = todo.back();
      todo.pop_back();
      for (CLI::Option* opt : a->get_options()) {
        if (opt->get_type_name().rfind("INT", 0) == 0) opt->check(no_octal);
        if (!shows_default(opt)) continue;
        opt->capture_default_str();
        const std::string value = opt->get_default_str();
        if (value == "[]" || refused(opt, value)) opt->default_str("");
      }
      for (CLI::App* sub : a->get_subcommands([](CLI::App*) { return true; })) todo.push_back(sub);
    }
  }
  // CLI11 would answer "A subcommand is required" to a misspelt one, at
  // the top (`ddpdiag alreduce-test`) or below (`ddpdiag report rendr`), and
  // to an option given before any subcommand.
  {
    CLI::App* level = &app;
    std::string path = "ddpdiag";
    for (int i = 1; i < argc; ++i) {
      const auto subs_here = level->get_subcommands([](CLI::App*) { return true; });
      if (subs_here.empty()) break;
      const std::string arg = argv[i];
      std::string names;
      CLI::App* next = nullptr;
      for (CLI::App* sub : subs_here) {
        if (sub->get_name() == arg) next = sub;
        names += (names.empty() ? "" : ", ") + sub->get_name();
      }
      if (next) {
        level = next;
        path += " " + arg;
        continue;
      }
      if (arg == "-h" || arg == "--help" || (level == &app && arg == "--version")) break;
      if (arg.rfind("-", 0) == 0)
        std::fprintf(stderr, "ddpdiag: unknown option '%s' before a subcommand of %s; the subcommands are: "
                             "%s (options go after the subcommand: %s SUBCOMMAND --help)\n",
                     arg.c_str(), path.c_str(), names.c_str(), path.c_str());
      else
        std::fprintf(stderr, "ddpdiag: unknown subcommand '%s' of %s; the subcommands are: %s (%s --help)\n",
                     arg.c_str(), path.c_str(), names.c_str(), path.c_str());
      return static_cast<int>(ExitCode::kUsage);
    }
  }
  try {
    app.parse(argc, argv);
    // An option given an empty value (`--first-bucket-mb ''`, `--json "$OUT"`
    // with OUT unset) would read as 0 or as no option at all: refused, as a
    // value that is not a number is.
    for (CLI::App* a = &app; a;) {
      cli::refuse_empty_values(*a);
      CLI::App* next = nullptr;
      for (CLI::App* sub : a->get_subcommands()) next = sub;
      a = next;
    }
  } catch (const CLI::ConversionError& e) {
    const std::string message = explain_conversion(app, e);
    print_flag_error(app, message);
    cli::write_torchelastic_error_file("ddpdiag usage error: " + message);
    write_flag_error_report(app, CLI::ConversionError(message));
    return static_cast<int>(ExitCode::kUsage);
  } catch (const CLI::ParseError& e) {
    // --help, --version: their output is what was asked for, so standard
    // output that cannot take it is an error (exit 2), as for any result.
    if (e.get_exit_code() == 0) return finish_standard_output(app.exit(e));
    std::string message = e.what();
    // An empty value shows as nothing between the flag and the reason
    // ("--store-protocol:  not in {...}").
    if (const auto at = message.find(":  "); at != std::string::npos && message.rfind("--", 0) == 0)
      message.replace(at, 3, ": '' ");
    print_flag_error(app, message);
    // Under torchrun: its summary shows the error, not "<N/A>".
    cli::write_torchelastic_error_file("ddpdiag usage error: " + message);
    write_flag_error_report(app, e);
    return static_cast<int>(ExitCode::kUsage);
  }
  try {
    refuse_report_over_an_input(app);
    for (auto& s : subs)
      if (s.app && s.app->parsed() && s.run) {
        cli::record_rank_settings(*s.app);
        return finish_standard_output(s.run());
      }
    return static_cast<int>(ExitCode::kUsage);
  } catch (const Error& e) {
    cli::print_error(e);
    return static_cast<int>(e.exit_code());
  } catch (const reports::WriteError& e) {
    const UsageError u = cli::report_write_error(e, -1);
    cli::print_error(u);
    return static_cast<int>(u.exit_code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddpdiag: internal error: %s\n", e.what());
    return 70;
  }
}
