#include "diag/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <string_view>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/errors.h"
#include "comm/monitored_communicator.h"
#include "comm/store/tcp_store.h"
#include "diag/tools_analysis.h"
#include "reports/report.h"

extern char** environ;

namespace ddpdiag::cli {

namespace {

std::atomic<int> g_forward_signal{0};

void on_signal(int sig) { g_forward_signal.store(sig); }

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out_fd = -1;
  int err_fd = -1;
  std::string out_partial;
  std::string err_partial;
  bool exited = false;
  int status = 0;
  // The launcher signalled it (after another rank's failure, or stopped):
  // its end is no failure of its own.
  bool signalled = false;
  // The peer its first error line names ("ddpdiag: error on rank 0 (peer
  // rank 1) ..."): its watchdog's verdict on whom the failure comes from.
  int named_peer = -1;
};

// The N of "(peer rank N)" in a rank's error line, or -1.
int peer_named_in_error_line(std::string_view line) {
  if (line.rfind("ddpdiag: error on rank ", 0) != 0) return -1;
  const auto at = line.find("(peer rank ");
  if (at == std::string_view::npos) return -1;
  int peer = -1;
  const char* first = line.data() + at + std::strlen("(peer rank ");
  const auto [end, ec] = std::from_chars(first, line.data() + line.size(), peer);
  return ec == std::errc() && end < line.data() + line.size() && *end == ')' ? peer : -1;
}

// Writes each complete line of `data` (plus what was left from before) to
// `to`, prefixed. Rank 0's standard output stays unprefixed: it carries the
// result table the user came for, and only rank 0 prints one.
// Each line also goes to `seen` (when given), without its newline.
void emit_lines(std::string& partial, const char* data, std::size_t n, FILE* to,
                const std::string& prefix, bool flush_all,
                const std::function<void(std::string_view)>& seen = {}) {
  partial.append(data, n);
  std::size_t start = 0;
  for (;;) {
    auto nl = partial.find('\n', start);
    if (nl == std::string::npos) break;
    std::fprintf(to, "%s%.*s\n", prefix.c_str(), static_cast<int>(nl - start),
                 partial.data() + start);
    if (seen) seen(std::string_view(partial).substr(start, nl - start));
    start = nl + 1;
  }
  partial.erase(0, start);
  if (flush_all && !partial.empty()) {
    std::fprintf(to, "%s%s\n", prefix.c_str(), partial.c_str());
    if (seen) seen(partial);
    partial.clear();
  }
  std::fflush(to);
}

// sent_here: this launcher signalled the rank (a stopped rank is killed; the
// others get SIGTERM, then SIGKILL), so a SIGKILL is not the OOM killer's.
std::string describe_status(int status, bool sent_here = false) {
  if (WIFEXITED(status)) {
    // ddpdiag's own exit codes (README, Exit codes), named.
    const int code = WEXITSTATUS(status);
    const char* what = code == 2   ? "a usage or configuration error"
                       : code == 3 ? "could not rendezvous or initialise"
                       : code == 4 ? "timed out"
                       : code == 5 ? "a peer failed"
                       : code == 70 ? "an internal error"
                                    : nullptr;
    return what ? fmt::format("exited with code {} ({})", code, what)
                : fmt::format("exited with code {}", code);
  }
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    if (sent_here && (sig == SIGKILL || sig == SIGTERM))
      return fmt::format("was killed by signal {} (SIG{}), sent by this launcher to end the job{}", sig,
                         name ? name : "?",
                         sig == SIGKILL ? " (the rank was stopped, or did not end after SIGTERM)" : "");
    return fmt::format("was killed by signal {} (SIG{}){}", sig, name ? name : "?",
                       sig == SIGKILL ? "; the kernel's OOM killer ends processes this way when "
                                        "memory runs out (dmesg says whether it did)"
                                      : "");
  }
  return "ended in an unknown way";
}

bool failed(int status) { return !(WIFEXITED(status) && WEXITSTATUS(status) == 0); }


}  // namespace

std::vector<std::string> own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> out;
  std::string cur;
  for (char c : all) {
    if (c == '\0') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

std::vector<std::string> recorded_command_line() {
  const char* launched = std::getenv("DDPDIAG_LAUNCHER");
  const char* argv = std::getenv("DDPDIAG_LAUNCHER_ARGV");
  if (launched && std::string(launched) == "1" && argv) {
    const auto j = nlohmann::json::parse(argv, nullptr, false);
    if (j.is_array() && !j.empty()) {
      std::vector<std::string> out;
      for (const auto& a : j) {
        if (!a.is_string()) return own_command_line();
        out.push_back(a.get<std::string>());
      }
      return out;
    }
  }
  return own_command_line();
}

int launch_local(const LaunchOptions& o) {
  if (o.nproc < 1)
    throw UsageError(fmt::format("--nproc {} must be at least 1", o.nproc),
                     {"launcher", -1, -1, "pass the number of ranks to start on this machine"});
  // The launcher hosts the store, as torchrun's agent does; ranks are pure
  // clients. Port 0: the kernel picks a free one, so two jobs never collide.
  if (o.nproc > kMaxLocalRanks)
    throw UsageError(fmt::format("--nproc {} is more ranks than ddpdiag starts on one machine "
                                 "(at most {})",
                                 o.nproc, kMaxLocalRanks),
                     {"launcher", -1, -1,
                      "start fewer ranks, or one launcher per host (torchrun, srun, mpirun) for "
                      "a larger world"});
  TcpStoreServerOptions so;
  so.host = "127.0.0.1";
  so.port = 0;
  so.on_out_of_fds = [](const std::string& what) {
    fmt::print(stderr, "ddpdiag launcher: the job's store: {}\n", what);
  };
  TcpStoreServer server(so);
  const int port = server.port();
  const std::string run_id = fmt::format("ddpdiag-{}", static_cast<long>(getpid()));

  // Where the launcher tells the ranks why it stops them: a rank it ends
  // after another failed writes that into its report, not "interrupted".
  const char* tmp = std::getenv("TMPDIR");
  const std::string note_path = fmt::format("{}/ddpdiag-launcher-{}.note",
                                            tmp && *tmp ? tmp : "/tmp", static_cast<long>(getpid()));
  struct RemoveNote {
    std::string path;
    ~RemoveNote() { ::unlink(path.c_str()); }
  } remove_note{note_path};
  ::unlink(note_path.c_str());  // one left by an earlier launcher of this pid, killed

  std::vector<Child> children(o.nproc);
  std::fflush(stdout);
  std::fflush(stderr);
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  for (int r = 0; r < o.nproc; ++r) {
    int out_pipe[2], err_pipe[2];
    if (pipe2(out_pipe, O_CLOEXEC) != 0 || pipe2(err_pipe, O_CLOEXEC) != 0)
      throw BackendError(fmt::format("cannot create pipes: {}", std::strerror(errno)),
                         {"launcher", r, -1, "too many open files? raise `ulimit -n`"});
    std::map<std::string, std::string> env;
    for (char** e = environ; e && *e; ++e) {
      std::string kv(*e);
      auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    // The variables torchrun's agent gives its workers.
    env["RANK"] = std::to_string(r);
    env["LOCAL_RANK"] = std::to_string(r);
    env["WORLD_SIZE"] = std::to_string(o.nproc);
    env["LOCAL_WORLD_SIZE"] = std::to_string(o.nproc);
    env["GROUP_RANK"] = "0";
    env["GROUP_WORLD_SIZE"] = "1";
    env["ROLE_RANK"] = std::to_string(r);
    env["ROLE_WORLD_SIZE"] = std::to_string(o.nproc);
    env["ROLE_NAME"] = "default";
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
    env["TORCHELASTIC_RESTART_COUNT"] = "0";
    env["TORCHELASTIC_MAX_RESTARTS"] = "0";
    env["TORCHELASTIC_RUN_ID"] = run_id;
    if (!env.count("OMP_NUM_THREADS")) env["OMP_NUM_THREADS"] = "1";
    env["DDPDIAG_LAUNCHER"] = "1";
    env["DDPDIAG_LAUNCHER_NOTE"] = note_path;
    // The command the user typed (with --nproc), for the ranks' reports.
    env["DDPDIAG_LAUNCHER_ARGV"] =
        nlohmann::json(o.user_args.empty() ? o.child_args : o.user_args)
            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (o.progress && r == 0) env["DDPDIAG_PROGRESS"] = "1";
    std::vector<std::string> env_strings;
    for (auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    // Everything the child needs, made before the fork: the launcher has
    // threads (its store server), and a child of a threaded process may call
    // only async-signal-safe functions until it execs. An allocation there
    // can wait forever on a lock another thread held at the fork (seen under
    // AddressSanitizer's allocator: the rank never started).
    std::vector<char*> argv;
    for (auto& a : o.child_args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    const std::string exec_failed = fmt::format("ddpdiag launcher: cannot exec rank {}: ", r);

    const pid_t launcher_pid = getpid();
    pid_t pid = fork();
    if (pid < 0)
      throw BackendError(fmt::format("cannot fork rank {}: {}", r, std::strerror(errno)),
                         {"launcher", r, -1, "the machine may be out of processes or memory"});
    if (pid == 0) {
      dup2(out_pipe[1], STDOUT_FILENO);
      dup2(err_pipe[1], STDERR_FILENO);
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      // A launcher killed outright (SIGKILL: `timeout -s KILL`, a CI runner,
      // the OOM killer) cannot pass anything on: the kernel sends its ranks
      // SIGTERM, as the launcher would, rather than leave them running
      // unseen until their deadlines. Kept across the exec; a launcher gone
      // before this line is caught by the parent check.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != launcher_pid) _exit(128 + SIGTERM);
      execve("/proc/self/exe", argv.data(), envp.data());
      const char* why = strerrordesc_np(errno);  // async-signal-safe, unlike strerror
      [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      if (why) w = ::write(STDERR_FILENO, why, std::strlen(why));
      w = ::write(STDERR_FILENO, "\n", 1);
      _exit(127);
    }
    close(out_pipe[1]);
    close(err_pipe[1]);
    children[r].rank = r;
    children[r].pid = pid;
    children[r].out_fd = out_pipe[0];
    children[r].err_fd = err_pipe[0];
  }

  using Clock = std::chrono::steady_clock;
  std::optional<int> first_failed;
  std::vector<std::pair<int, int>> failed_in_order;  // (rank, wait status) of failures, as reaped
  std::optional<Clock::time_point> kill_at;
  bool terminated = false;
  bool killed = false;
  std::optional<Clock::time_point> first_signal_at;
  // The signal (SIGINT / SIGTERM) the launcher itself received and passed
  // on: the job was interrupted, and the ranks it ends are no one's fault.
  int interrupted_by = 0;
  auto running = [&] {
    for (auto& c : children)
      if (!c.exited || c.out_fd >= 0 || c.err_fd >= 0) return true;
    return false;
  };
  char buf[65536];
  while (running()) {
    if (int sig = g_forward_signal.exchange(0); sig != 0) {
      // Ctrl-C: pass it on once; a second one, a second or more later,
      // kills. One that comes sooner is the same interrupt delivered again:
      // a wrapper (GNU timeout, a CI runner) passes the signal to its child
      // and to its process group, so it arrives twice within milliseconds.
      const auto now = Clock::now();
      if (!first_signal_at) {
        first_signal_at = now;
        interrupted_by = sig;
        for (auto& c : children)
          if (!c.exited) kill(c.pid, sig);
      } else if (now - *first_signal_at >= std::chrono::seconds(1)) {
        for (auto& c : children)
          if (!c.exited) kill(c.pid, SIGKILL);
      }
      const auto soon = now + std::chrono::seconds(5);
      if (!kill_at || *kill_at > soon) kill_at = soon;
    }
    std::vector<pollfd> fds;
    std::vector<std::pair<int, bool>> who;  // child index, is stderr
    for (int i = 0; i < o.nproc; ++i) {
      if (children[i].out_fd >= 0) {
        fds.push_back({children[i].out_fd, POLLIN, 0});
        who.push_back({i, false});
      }
      if (children[i].err_fd >= 0) {
        fds.push_back({children[i].err_fd, POLLIN, 0});
        who.push_back({i, true});
      }
    }
    if (!fds.empty()) {
      int n = poll(fds.data(), fds.size(), 100);
      if (n < 0 && errno != EINTR) break;
      for (std::size_t k = 0; n > 0 && k < fds.size(); ++k) {
        if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        auto [i, is_err] = who[k];
        Child& c = children[i];
        ssize_t got = read(fds[k].fd, buf, sizeof buf);
        std::string prefix = fmt::format("[rank {}] ", c.rank);
        if (!is_err && c.rank == 0) prefix.clear();
        std::function<void(std::string_view)> seen;
        if (is_err && c.named_peer < 0)
          seen = [&c](std::string_view line) {
            if (c.named_peer < 0) c.named_peer = peer_named_in_error_line(line);
          };
        if (got > 0) {
          emit_lines(is_err ? c.err_partial : c.out_partial, buf, static_cast<std::size_t>(got),
                     is_err ? stderr : stdout, prefix, false, seen);
        } else if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) {
          emit_lines(is_err ? c.err_partial : c.out_partial, "", 0, is_err ? stderr : stdout,
                     prefix, true, seen);
          close(fds[k].fd);
          (is_err ? c.err_fd : c.out_fd) = -1;
        }
      }
    } else {
      usleep(20 * 1000);
    }
    for (auto& c : children) {
      if (c.exited) continue;
      int status = 0;
      pid_t p = waitpid(c.pid, &status, WNOHANG);
      if (p == c.pid) {
        c.exited = true;
        c.status = status;
        if (failed(status) && !c.signalled) failed_in_order.emplace_back(c.rank, status);
        // A rank ended by the signal the launcher is about to forward (Ctrl-C
        // reaches the whole process group at once) failed for no reason of
        // its own.
        if (failed(status) && !first_failed && !interrupted_by &&
            g_forward_signal.load() == 0) {
          first_failed = c.rank;
          kill_at = Clock::now() + o.grace;
          // As a whole (write, then rename), so a rank never reads half.
          try {
            reports::write_file_atomic(note_path, fmt::format("rank {} (pid {}) {}", c.rank,
                                                              static_cast<long>(c.pid),
                                                              describe_status(status)));
          } catch (const std::exception&) {
            // The ranks then say they were interrupted; the launcher's own
            // lines still name the rank.
          }
        }
      }
    }
    if (kill_at && !terminated && first_failed) {
      // A rank that is stopped (SIGSTOP, a debugger) can write no report:
      // when every rank still running is stopped, the grace is over.
      bool any = false, all_stopped = true;
      for (const auto& c : children)
        if (!c.exited) {
          any = true;
          const char st = process_state(static_cast<long>(c.pid));
          all_stopped = all_stopped && stopped_state(st);
        }
      if (any && all_stopped) {
        for (const auto& c : children)
          if (!c.exited)
            std::fprintf(stderr, "ddpdiag launcher: rank %d (pid %ld) is stopped; killing it\n",
                         c.rank, static_cast<long>(c.pid));
        terminated = true;  // straight to SIGKILL: a stopped process keeps SIGTERM pending
        kill_at = Clock::now();
      }
    }
    if (kill_at && Clock::now() >= *kill_at) {
      // The others had their grace period to notice the failure and write
      // their reports; stop them now (TERM first, KILL 3 s later).
      for (auto& c : children)
        if (!c.exited) {
          kill(c.pid, terminated ? SIGKILL : SIGTERM);
          c.signalled = true;
        }
      if (terminated) killed = true;
      terminated = true;
      kill_at = Clock::now() + std::chrono::seconds(3);
      if (killed) kill_at = Clock::now() + std::chrono::hours(1);
    }
  }
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);

  if (interrupted_by) {
    // As a shell, torchrun and Python do: 128 + the signal, no rank blamed.
    // A rank that had failed before the signal came is still named.
    const char* name = sigabbrev_np(interrupted_by);
    std::string failure;
    const auto by_the_signal = [&](int status) {
      return (WIFSIGNALED(status) && WTERMSIG(status) == interrupted_by) ||
             (WIFEXITED(status) && WEXITSTATUS(status) == 128 + interrupted_by);
    };
    if (first_failed && !by_the_signal(children[*first_failed].status)) {
      const Child& f = children[*first_failed];
      failure = fmt::format("; before that, rank {} (pid {}) had failed: it {}", f.rank,
                            static_cast<long>(f.pid), describe_status(f.status));
    }
    std::fprintf(stderr,
                 "ddpdiag launcher: interrupted by signal %d (SIG%s): passed it to the %d "
                 "rank(s) and stopped the job%s\n",
                 interrupted_by, name ? name : "?", o.nproc, failure.c_str());
    return 128 + interrupted_by;
  }
  if (!first_failed) return 0;
  const Child& f = children[*first_failed];
  // Exit 1 is a failed check (the verdict FAIL), which the ranks reach
  // together: no rank failed first, and rank 0's output says what failed.
  const bool check_failed = std::all_of(children.begin(), children.end(), [](const Child& c) {
    return !failed(c.status) || (WIFEXITED(c.status) && WEXITSTATUS(c.status) == 1);
  });
  if (check_failed) {
    std::string ranks;
    for (const auto& c : children)
      if (failed(c.status)) ranks += (ranks.empty() ? "" : ", ") + std::to_string(c.rank);
    std::fprintf(stderr,
                 "ddpdiag launcher: a check failed (verdict FAIL): rank(s) %s exited with code 1; "
                 "rank 0's output and report say which check\n",
                 ranks.c_str());
    return 1;
  }
  // A rank that exited 1 followed a verdict (FAIL) it reached with the
  // others; a rank that failed of its own (exit 2 for a report it could not
  // write, a crash) is the one to name, whichever was reaped first.
  const Child* blamed = &f;
  if (const auto r = tools::rank_that_failed_first(failed_in_order)) blamed = &children[static_cast<std::size_t>(*r)];
  // A rank that timed out or lost a peer ends first, but its own diagnosis
  // names the rank the failure comes from (a rank that stopped issuing
  // collectives, a dead one): the last line read should not contradict it.
  std::string naming;
  if (WIFEXITED(blamed->status) && (WEXITSTATUS(blamed->status) == 4 || WEXITSTATUS(blamed->status) == 5) &&
      blamed->named_peer >= 0 && blamed->named_peer != blamed->rank && blamed->named_peer < o.nproc)
    naming = fmt::format(", naming rank {} as the cause (its diagnosis above says why)", blamed->named_peer);
  std::fprintf(stderr, "ddpdiag launcher: rank %d (pid %ld) failed first: it %s%s\n", blamed->rank,
               static_cast<long>(blamed->pid), describe_status(blamed->status, blamed->signalled).c_str(),
               naming.c_str());
  for (const auto& c : children)
    if (c.rank != blamed->rank && failed(c.status))
      std::fprintf(stderr, "ddpdiag launcher: rank %d %s\n", c.rank,
                   describe_status(c.status, c.signalled).c_str());
  if (WIFEXITED(blamed->status)) return WEXITSTATUS(blamed->status);
  return 5;
}

}  // namespace ddpdiag::cli
