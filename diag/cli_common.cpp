#include "reports/render.h"
#include "diag/cli_common.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <csignal>
#include <netdb.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <limits>
#include <map>
#include <mutex>
#include <functional>
#include <optional>
#include <tuple>
#include <sstream>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <string_view>
#include <thread>

#include <fmt/core.h>
#include <fmt/format.h>

#include "ddpdiag/config.h"
#include "comm/input_file.h"
#include "comm/ip_text.h"
#include "comm/memory.h"
#include "comm/net_info.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"
#include "ddp_core/param_broadcast.h"
#include "ddp_core/reducer.h"
#include "diag/launcher.h"
#include "diag/placement.h"

namespace ddpdiag::cli {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

std::string rank_report_path(const std::string& path, const std::string& ext, int rank) {
  if (path.empty()) return path;
  const std::string tag = fmt::format(".rank{}", rank);
  if (path.size() > ext.size() && path.compare(path.size() - ext.size(), ext.size(), ext) == 0)
    return path.substr(0, path.size() - ext.size()) + tag + ext;
  return path + tag;
}

namespace {
std::atomic<int> g_rank{-1};

// What a rank knew of its report before the command's body ran (argv,
// environment, world), for write_report_on_terminate: the live report may
// be in the middle of a change on another thread, this copy never is.
struct ArmedReport {
  reports::Report report;
  std::string json_path;
  std::string markdown_path;
};
std::mutex g_armed_mutex;
std::optional<ArmedReport> g_armed;

}  // namespace

void arm_report(const reports::Report& report, const CommonOptions& o) {
  if (o.json_path.empty() && o.markdown_path.empty()) return;
  std::lock_guard<std::mutex> lock(g_armed_mutex);
  g_armed = ArmedReport{report, o.json_path, o.markdown_path};
}

void disarm_report() {
  std::lock_guard<std::mutex> lock(g_armed_mutex);
  g_armed.reset();
}

namespace {
struct StopText {
  std::string text;
  bool running = false;
  std::string running_prefix;
  std::chrono::steady_clock::time_point since;
};
std::mutex g_stop_text_mutex;
StopText g_stop_text;

// On the signal's thread: the armed stop text on stdout (skipped if the
// main thread holds the lock: never wait on it there).
void print_stop_text() {
  std::unique_lock<std::mutex> lock(g_stop_text_mutex, std::try_to_lock);
  if (!lock.owns_lock() || g_stop_text.text.empty()) return;
  std::string out = g_stop_text.text;
  if (g_stop_text.running)
    out += fmt::format("{}running for {:.1f} s when stopped\n", g_stop_text.running_prefix,
                       std::chrono::duration<double>(std::chrono::steady_clock::now() - g_stop_text.since).count());
  std::fputs(out.c_str(), stdout);
  std::fflush(stdout);
}
}  // namespace

void arm_stop_text(std::string text, bool running, std::string running_prefix,
                   std::chrono::steady_clock::time_point since) {
  std::lock_guard<std::mutex> lock(g_stop_text_mutex);
  g_stop_text = StopText{std::move(text), running, std::move(running_prefix), since};
}

void note_current_rank(int rank) { g_rank.store(rank, std::memory_order_relaxed); }

namespace {

// A field of world learnt after the report was armed (the run the ranks
// met in), for a report written on a signal.
void note_armed_world_field(const std::string& key, const nlohmann::json& value) {
  std::lock_guard<std::mutex> lock(g_armed_mutex);
  if (g_armed) g_armed->report.set_world_field(key, value);
}
}  // namespace

int current_rank() { return g_rank.load(std::memory_order_relaxed); }

namespace {

// Writes the armed report with `error` (rank 0: the job's; another rank its
// own beside it). Returns the path written, or "".
std::string write_armed_report(reports::ErrorInfo error) {
  std::unique_lock<std::mutex> lock(g_armed_mutex, std::try_to_lock);
  if (!lock.owns_lock() || !g_armed) return {};
  const int rank = current_rank();
  error.rank = rank;
  g_armed->report.set_error(error);
  // Rank 0 writes the job's report; another rank its own beside it, since
  // rank 0 will write the job's from what it saw of this failure.
  const bool own = rank > 0;
  const std::string json_path =
      own ? rank_report_path(g_armed->json_path, ".json", rank) : g_armed->json_path;
  const std::string md_path =
      own ? rank_report_path(g_armed->markdown_path, ".md", rank) : g_armed->markdown_path;
  try {
    reports::write_report_outputs(g_armed->report.finish(), json_path, md_path);
  } catch (const std::exception&) {
    return {};
  }
  g_armed.reset();
  return json_path.empty() ? md_path : json_path;
}

// What ddpdiag's launcher wrote about the rank that failed first ("rank 1
// (pid 123) was killed by signal 9 (SIGKILL) ..."), or "".
std::string launcher_note() {
  const char* path = std::getenv("DDPDIAG_LAUNCHER_NOTE");
  if (!path || !*path) return {};
  std::ifstream f(path);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return text;
}

// The rank a note names ("rank 1 (pid ...") or -1.
int note_rank(const std::string& note) {
  int r = -1;
  return std::sscanf(note.c_str(), "rank %d", &r) == 1 ? r : -1;
}

// The other ranks on this machine (rank, pid), known once the rendezvous
// passed: a rank stopped by SIGTERM (torchrun ends every worker once one
// has failed) looks for the one whose process is gone.
// Waits for `key` until `deadline` in slices of at most 500 ms, calling
// between() after each slice that ended without it (to look for a reason to
// stop waiting; it throws one). At the deadline the store's own
// TimeoutError ("store wait timed out ...") comes through.
// The store's own "the key did not come in time" (a wait, or the wait of a
// get), not a connection that timed out.
bool is_store_wait_timeout(const TimeoutError& e) {
  return std::string_view(e.what()).rfind("store wait timed out", 0) == 0;
}

void wait_in_slices(Store& store, const std::string& key,
                    std::chrono::steady_clock::time_point deadline,
                    const std::function<void()>& between) {
  for (;;) {
    const auto left =
        std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    try {
      store.wait({key}, std::clamp(left, Millis(1), Millis(500)));
      return;
    } catch (const TimeoutError& e) {
      if (left <= Millis(500)) throw;
      if (!is_store_wait_timeout(e)) throw;
    }
    between();
  }
}

// The start time of a process (clock ticks since boot, field 22 of
// /proc/<pid>/stat) as text: with the pid, it names one process even after
// the pid is reused. "0" when there is no such process.
// Field `n` (numbered as in proc(5): 3 is the state, 4 the parent's pid, 22
// the start time) of /proc/<pid>/stat, or "" when it cannot be read. The
// fields are counted after the name, which may hold spaces and ')'.
std::string proc_stat_field(long pid, int n) {
  const std::string all = read_proc_stat(pid);
  auto close = all.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream fields(all.substr(close + 1));
  std::string f;
  for (int i = 3; i <= n; ++i)
    if (!(fields >> f)) return {};
  return f;
}

std::string process_start_ticks(long pid) {
  std::string ticks = proc_stat_field(pid, 22);
  return ticks.empty() ? "0" : ticks;
}

struct LocalPeer {
  int rank = -1;
  long pid = 0;
  std::string start_ticks;  // while it ran ("0": unknown)
};
std::mutex g_local_peers_mutex;
std::vector<LocalPeer> g_local_peers;

// A rank that ends without being the cause of a failure (it finished, a
// check failed, another rank's failure or a signal stopped it) leaves an
// empty file named after its pid and start time here, so that a peer on
// this machine that torchrun then stops (with SIGTERM, every worker at once)
// does not take it for the rank that failed. Files older than an hour are
// removed as new ones come.
std::string ended_mark_dir() { return fmt::format("/tmp/ddpdiag-ended-{}", static_cast<long>(getuid())); }

std::string ended_mark_path(long pid, const std::string& ticks) {
  return fmt::format("{}/{}-{}", ended_mark_dir(), pid, ticks);
}

bool blameless_exit(int rc) {
  return rc == 0 || rc == static_cast<int>(ExitCode::kCheckFailed) ||
         rc == static_cast<int>(ExitCode::kPeerFailed) || rc > 128;
}

// ---- torchrun's workers on this machine, before the ranks met ----------
// Until the ranks meet, a worker knows its siblings only from /proc: the
// processes torchrun's agent started (directly, or through a wrapper that
// did not exec) with LOCAL_RANK in their environment.

// A non-negative decimal number, whole string; nullopt otherwise.
std::optional<long> decimal(const char* text) {
  if (!text || !*text) return std::nullopt;
  long v = 0;
  for (const char* c = text; *c; ++c) {
    if (*c < '0' || *c > '9' || v > 100000000) return std::nullopt;
    v = v * 10 + (*c - '0');
  }
  return v;
}

// Some variables of a process's environment ("" where not set, or where it
// cannot be read).
std::map<std::string, std::string> proc_environ(long pid, const std::vector<std::string>& names) {
  std::map<std::string, std::string> out;
  std::ifstream f(fmt::format("/proc/{}/environ", pid), std::ios::binary);
  std::string entry;
  while (f && std::getline(f, entry, '\0'))
    for (const auto& n : names)
      if (entry.size() > n.size() && entry.compare(0, n.size(), n) == 0 && entry[n.size()] == '=')
        out[n] = entry.substr(n.size() + 1);
  return out;
}

long parent_pid(long pid) { return decimal(proc_stat_field(pid, 4).c_str()).value_or(0); }

// torchrun's agent above a worker: the nearest ancestor (within a few
// wrappers) without LOCAL_RANK in its environment; 0 when none is found.
long torchrun_agent_of(long pid) {
  long p = parent_pid(pid);
  for (int depth = 0; depth < 4 && p > 1; ++depth) {
    if (proc_environ(p, {"LOCAL_RANK"}).count("LOCAL_RANK") == 0) return p;
    p = parent_pid(p);
  }
  return 0;
}

// This process's torchrun worker identity, when torchrun (not ddpdiag's own
// launcher) started it: the agent, its start time, the restart and local
// rank. nullopt otherwise.
struct TorchrunWorker {
  long agent = 0;
  std::string agent_ticks;
  std::string restart;
  int local_rank = -1;
  int local_world_size = -1;
  int rank = -1;
};
std::optional<TorchrunWorker> this_torchrun_worker() {
  if (!std::getenv("TORCHELASTIC_RUN_ID") || std::getenv("DDPDIAG_LAUNCHER")) return std::nullopt;
  const auto num = [](const char* name) {
    const char* v = std::getenv(name);
    return static_cast<int>(decimal(v).value_or(-1));
  };
  TorchrunWorker w;
  w.local_rank = num("LOCAL_RANK");
  w.local_world_size = num("LOCAL_WORLD_SIZE");
  w.rank = num("RANK");
  const char* restart = std::getenv("TORCHELASTIC_RESTART_COUNT");
  w.restart = restart ? restart : "0";
  w.agent = torchrun_agent_of(getpid());
  if (w.agent <= 1 || w.local_rank < 0 || w.local_rank >= w.local_world_size) return std::nullopt;
  w.agent_ticks = process_start_ticks(w.agent);
  return w;
}

std::string torchrun_mark_path(const TorchrunWorker& w, int local_rank) {
  return fmt::format("{}/torchrun-{}-{}-{}-{}", ended_mark_dir(), w.agent, w.agent_ticks, w.restart, local_rank);
}

// The local ranks of this torchrun agent (this restart) whose processes are
// gone without the mark of a blameless end: the worker(s) that failed.
std::vector<int> gone_torchrun_siblings(const TorchrunWorker& me) {
  std::vector<bool> alive(static_cast<std::size_t>(me.local_world_size), false);
  alive[static_cast<std::size_t>(me.local_rank)] = true;
  if (DIR* d = ::opendir("/proc")) {
    while (const dirent* e = ::readdir(d)) {
      const auto pid = decimal(e->d_name);
      if (!pid || *pid == getpid() || process_gone(*pid)) continue;
      const auto env = proc_environ(*pid, {"TORCHELASTIC_RUN_ID", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"});
      if (!env.count("TORCHELASTIC_RUN_ID") || !env.count("LOCAL_RANK")) continue;
      const auto restart = env.count("TORCHELASTIC_RESTART_COUNT") ? env.at("TORCHELASTIC_RESTART_COUNT") : "0";
      const auto lr = decimal(env.at("LOCAL_RANK").c_str());
      if (restart != me.restart || !lr || *lr < 0 || *lr >= me.local_world_size) continue;
      if (torchrun_agent_of(*pid) != me.agent) continue;
      alive[static_cast<std::size_t>(*lr)] = true;
    }
    ::closedir(d);
  }
  std::vector<int> gone;
  for (int lr = 0; lr < me.local_world_size; ++lr) {
    struct stat st {};
    if (!alive[static_cast<std::size_t>(lr)] && ::stat(torchrun_mark_path(me, lr).c_str(), &st) != 0)
      gone.push_back(lr);
  }
  return gone;
}

void touch_mark(const std::string& path) {
  const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd >= 0) ::close(fd);
}

// Only where a peer on this machine could look for it. Best effort.
void leave_ended_mark(int rc) {
  if (!blameless_exit(rc)) return;
  std::vector<std::string> marks;
  // Under torchrun, for the agent's other workers (before the ranks met
  // they know this one only as a local rank).
  if (const auto w = this_torchrun_worker(); w && w->local_world_size > 1)
    marks.push_back(torchrun_mark_path(*w, w->local_rank));
  bool peers = false;
  {
    std::unique_lock<std::mutex> lock(g_local_peers_mutex, std::try_to_lock);
    peers = lock.owns_lock() && !g_local_peers.empty();
  }
  if (peers)
    if (const std::string ticks = process_start_ticks(getpid()); ticks != "0")
      marks.push_back(ended_mark_path(getpid(), ticks));
  if (marks.empty()) return;
  const std::string dir = ended_mark_dir();
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return;
  for (const auto& m : marks) touch_mark(m);
  if (DIR* d = ::opendir(dir.c_str())) {
    const auto old = std::chrono::system_clock::now() - std::chrono::hours(1);
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      const std::string path = dir + "/" + e->d_name;
      struct stat st {};
      if (::lstat(path.c_str(), &st) == 0 &&
          std::chrono::system_clock::from_time_t(st.st_mtime) < old)
        ::unlink(path.c_str());
    }
    ::closedir(d);
  }
}

bool left_ended_mark(const LocalPeer& p) {
  if (p.start_ticks.empty() || p.start_ticks == "0") return false;
  struct stat st {};
  return ::stat(ended_mark_path(p.pid, p.start_ticks).c_str(), &st) == 0;
}

// `rank`'s process on this machine, if it runs here (a copy: the list is
// shared with the signal's thread).
std::optional<LocalPeer> local_peer(int rank) {
  std::lock_guard<std::mutex> lock(g_local_peers_mutex);
  for (const auto& p : g_local_peers)
    if (p.rank == rank) return p;
  return std::nullopt;
}

bool peer_on_this_machine(int rank) { return local_peer(rank).has_value(); }

// `rank` runs on this machine and its process is stopped (state T or t).
bool local_peer_stopped(int rank) {
  const auto peer = local_peer(rank);
  return peer && stopped_state(process_state(peer->pid));
}

// "rank 1 (pid 4889 on this machine) had ended" when `rank` runs on this
// machine and its process is gone without the mark of a blameless end; ""
// otherwise.
std::string local_peer_gone(int rank) {
  const auto peer = local_peer(rank);
  if (!peer || !process_gone(peer->pid) || left_ended_mark(*peer)) return {};
  return fmt::format("rank {} (pid {} on this machine) had ended", rank, peer->pid);
}

// The other ranks on this machine, from the ranks' registrations (once they
// met), for the signal's thread and the ended marks.
void publish_local_peers(const Job& job) {
  const std::string here = machine_id();
  std::vector<LocalPeer> local_peers;
  for (const auto& r : job.ranks)
    if (r.rank != job.world.rank && r.pid > 0 && r.rank < static_cast<int>(job.machines.size()) &&
        job.machines[static_cast<std::size_t>(r.rank)] == here)
      local_peers.push_back({r.rank, static_cast<long>(r.pid), process_start_ticks(r.pid)});
  std::lock_guard<std::mutex> lock(g_local_peers_mutex);
  g_local_peers = std::move(local_peers);
}

// The first rank on this machine whose process is gone without leaving the
// mark of a blameless end, as "rank 1 (pid 4889)"; "" when none is known to
// be.
std::string gone_local_peer(int* rank_out) {
  std::unique_lock<std::mutex> lock(g_local_peers_mutex, std::try_to_lock);
  if (!lock.owns_lock()) return {};
  for (const auto& peer : g_local_peers) {
    const int rank = peer.rank;
    const long pid = peer.pid;
    if (process_gone(pid) && !left_ended_mark(peer)) {
      *rank_out = rank;
      return fmt::format("rank {} (pid {} on this machine) had ended", rank, pid);
    }
  }
  return {};
}

int g_signal_pipe[2] = {-1, -1};

// Set by the handler, before the signal's thread is woken: a SIGINT or
// SIGTERM has come (lock-free, so safe in a handler).
std::atomic<bool> g_interrupt_seen{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void on_interrupt(int sig) {
  g_interrupt_seen.store(true);
  const char c = static_cast<char>(sig);
  (void)!::write(g_signal_pipe[1], &c, 1);
}

}  // namespace

std::string write_report_on_terminate(const std::string& message, const std::string& hint) {
  write_torchelastic_error_file(fmt::format("ddpdiag error on rank {}: {}{}", current_rank(), message,
                                            hint.empty() ? "" : " (hint: " + hint + ")"));
  return write_armed_report({"backend", message, "library thread", -1, -1, hint,
                             static_cast<int>(ExitCode::kPeerFailed)});
}

// Held by the signal's thread while it writes the report, and taken for
// good once the process exits normally: the exit's destructors must not run
// under a report being written, nor a report be written from destroyed
// globals (the signal came as the command finished).
std::mutex g_interrupt_mutex;
// The run's exit code once its final report is written (FinalReportWindow);
// -1 before.
std::atomic<int> g_final_rc{-1};
// TORCHELASTIC_ERROR_FILE's text of a failure caused by another rank's,
// held back until the end (run_distributed); a SIGTERM that ends the
// process first writes it. Set before FinalReportWindow::written, read
// after it (g_interrupt_mutex orders the two).
std::string g_pending_error_file;

FinalReportWindow::FinalReportWindow() {
  // A signal's thread already writing the armed report ends the process
  // while this waits.
  g_interrupt_mutex.lock();
  if (g_interrupt_seen.load()) {
    // The signal came before this rank's own end, and its thread has not
    // yet taken the report: what ended the run here is most likely that
    // signal's doing (a launcher or Ctrl-C stops every rank, and a peer
    // that stopped first closes its connections, which this rank saw as a
    // peer failure). The signal's thread writes the report and ends the
    // process, as it does when it comes first.
    g_interrupt_mutex.unlock();
    for (;;) ::pause();
  }
  held_ = true;
  disarm_report();
}

FinalReportWindow::~FinalReportWindow() {
  if (held_) g_interrupt_mutex.unlock();
}

void FinalReportWindow::written(int rc) {
  g_final_rc.store(rc);
  if (held_) g_interrupt_mutex.unlock();
  held_ = false;
}

void write_report_on_interrupt() {
  if (g_signal_pipe[0] >= 0 || ::pipe2(g_signal_pipe, O_CLOEXEC) != 0) return;
  // Runs before the destructors of every global built before this call.
  std::atexit([] { g_interrupt_mutex.lock(); });
  std::thread([] {
    char c = 0;
    while (::read(g_signal_pipe[0], &c, 1) < 0 && errno == EINTR) {
    }
    // Tests only: DDPDIAG_TEST_SIGNAL_DELAY=R:MS holds rank R's signal
    // thread MS ms here, so that rank's own end (a peer stopped by the same
    // signal closed its connection) comes first, as on a busy machine.
    if (const char* d = std::getenv("DDPDIAG_TEST_SIGNAL_DELAY"); d && *d) {
      int r = -1;
      long ms = 0;
      if (std::sscanf(d, "%d:%ld", &r, &ms) == 2 && r == current_rank() && ms > 0 && ms <= 60000)
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    }
    // Never released: this thread ends the process. Held by the main thread
    // while it writes its final report (then this waits for the write), and
    // for good once the process exits normally (then this waits for ever).
    g_interrupt_mutex.lock();
    const int sig = static_cast<unsigned char>(c);
    const char* abbrev = sigabbrev_np(sig);
    const std::string name = abbrev ? std::string("SIG") + abbrev : std::to_string(sig);
    const int rank = current_rank();
    if (const int final_rc = g_final_rc.load(); final_rc >= 0) {
      if (!g_pending_error_file.empty()) write_torchelastic_error_file(g_pending_error_file);
      std::fflush(stdout);
      std::fprintf(stderr, "ddpdiag: %s%s came after the run had finished and written its report; "
                   "exit code %d is the run's\n",
                   rank >= 0 ? fmt::format("rank {}: ", rank).c_str() : "", name.c_str(), final_rc);
      std::fflush(stderr);
      leave_ended_mark(final_rc);
      std::_Exit(final_rc);
    }
    // Stopped because another rank failed: by ddpdiag's launcher (its note
    // names the rank), or by torchrun, which ends every worker with SIGTERM
    // once one has failed (a worker of this machine whose process is gone
    // is that one). That, not an interruption, is the story.
    std::string message, peer_text;
    int peer = -1;
    if (sig == SIGTERM) {
      if (const std::string note = launcher_note(); !note.empty()) {
        peer = note_rank(note);
        peer_text = note;
        message = fmt::format("the launcher stopped this rank, which had not run into the failure "
                              "within its grace period: {}",
                              note);
      } else if (std::getenv("TORCHELASTIC_RUN_ID") && !std::getenv("DDPDIAG_LAUNCHER")) {
        // (ddpdiag's launcher sets torchrun's variables too, but says in its
        // note when it stops a rank for another's failure: without a note,
        // the signal came from outside, to every rank at once.)
        peer_text = gone_local_peer(&peer);
        // Before the ranks met, no peer is known by its registration: the
        // agent's other workers are looked up in /proc.
        if (peer_text.empty())
          if (const auto w = this_torchrun_worker()) {
            const std::vector<int> gone = gone_torchrun_siblings(*w);
            const auto rank_of = [&](int lr) { return w->rank >= 0 ? w->rank - w->local_rank + lr : -1; };
            if (gone.size() == 1) {
              peer = rank_of(gone[0]);
              peer_text = peer >= 0 ? fmt::format("rank {} (local rank {} on this machine) had ended", peer, gone[0])
                                    : fmt::format("local rank {} on this machine had ended", gone[0]);
            } else if (!gone.empty()) {
              std::vector<std::string> names;
              for (int lr : gone)
                names.push_back(rank_of(lr) >= 0 ? fmt::format("rank {} (local rank {})", rank_of(lr), lr)
                                                 : fmt::format("local rank {}", lr));
              peer_text = fmt::format("{} on this machine had ended", fmt::join(names, ", "));
            }
          }
        if (!peer_text.empty())
          message = fmt::format("torchrun stopped this rank with SIGTERM, as it ends every worker "
                                "once one has failed: {}",
                                peer_text);
      }
    }
    print_stop_text();
    if (!message.empty()) {
      const std::string written = write_armed_report(
          {"peer", message, "launcher", -1, peer,
           "that rank's own output says why it ended; this report has what was known when this "
           "rank was stopped",
           static_cast<int>(ExitCode::kPeerFailed)});
      std::fprintf(stderr, "ddpdiag: %sstopped by the launcher: %s%s\n",
                   rank >= 0 ? fmt::format("rank {}: ", rank).c_str() : "", peer_text.c_str(),
                   written.empty() ? "" : fmt::format("; report: {}", written).c_str());
      std::fflush(stderr);
      // No TORCHELASTIC_ERROR_FILE here: written within the second torchrun
      // saw the peer end, it would tie with that failure, and ties go to the
      // lower rank, so torchrun could name this rank as the root cause.
      leave_ended_mark(static_cast<int>(ExitCode::kPeerFailed));
      std::_Exit(static_cast<int>(ExitCode::kPeerFailed));
    }
    const std::string written = write_armed_report(
        {"interrupted", fmt::format("interrupted by {} before the command finished", name),
         "signal", -1, -1,
         "the run was stopped from outside (Ctrl-C, the launcher, the scheduler's time limit); "
         "this report has what was known when it stopped",
         128 + sig});
    std::fprintf(stderr, "ddpdiag: %sinterrupted by %s%s\n",
                 rank >= 0 ? fmt::format("rank {}: ", rank).c_str() : "", name.c_str(),
                 written.empty() ? "" : fmt::format("; report: {}", written).c_str());
    std::fflush(stderr);
    leave_ended_mark(128 + sig);
    std::_Exit(128 + sig);
  }).detach();
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

void check_host_memory(const Job& job, long double per_rank, const std::string& what,
                       const std::string& hint, long double this_rank_extra,
                       const std::string& extra_what) {
  const auto gib = [](long double b) { return fmt::format("{:.1f} GiB", static_cast<double>(b / (1ULL << 30))); };
  const std::string extra =
      this_rank_extra > 0
          ? fmt::format(", and {} more on this rank ({})", gib(this_rank_extra), extra_what)
          : std::string();
  // This process's own address-space limit (ulimit -v) binds first: an
  // allocation past it fails however much memory the host has. What is
  // mapped now leaves out what the run maps later besides the buffers: the
  // backend's and the watchdog's threads (their stacks) and the allocator's
  // per-thread arenas (64 MiB of address space each with glibc), so 1 GiB
  // is kept for those.
  constexpr std::uint64_t kAddressSpaceMargin = std::uint64_t{1} << 30;
  if (const auto as = address_space_left();
      as && per_rank + this_rank_extra + kAddressSpaceMargin >
                static_cast<long double>(as->bytes))
    throw UsageError(
        fmt::format("{} take about {} per rank{}, and the run's threads and allocator about {} "
                    "more, but this process may map only {} more: its address-space limit "
                    "(ulimit -v) is {}",
                    what, gib(per_rank), extra, gib(kAddressSpaceMargin), gib(as->bytes),
                    gib(as->limit)),
        {"flags", job.rank(), -1,
         "the limit is this process's own, whatever the host has: raise it (ulimit -v "
         "unlimited, or the scheduler's memory setting for the job), or make the run smaller "
         "(a smaller -e or model)"});
  const auto avail = host_memory_available();
  if (!avail) return;
  // Where no launcher or flag said how many ranks share this host, count
  // this one only: refusing a run that fits is worse than missing one.
  const int here = job.world.local_world_size_given ? std::max(1, job.world.local_world_size) : 1;
  const long double need = per_rank * here + this_rank_extra;
  if (need <= static_cast<long double>(avail->bytes)) return;
  throw UsageError(
      fmt::format("{} take about {} per rank{}{}, but this host has {} of memory left ({}): the "
                  "ranks would be killed by the OOM killer or swap",
                  what, gib(per_rank),
                  here > 1 ? fmt::format(", {} for the {} ranks on this host",
                                         gib(per_rank * here), here)
                           : std::string(),
                  extra, gib(avail->bytes), avail->source),
      {"flags", job.rank(), -1, hint});
}

void refuse_sparse_on_device(const Job& job, const std::string& model) {
  if (job.backend == Backend::kGloo) return;
  ddp_core::ModelLayout layout;
  try {
    layout = ddp_core::trainable_parameters(ddp_core::load_model(model));
  } catch (const std::exception&) {
    return;
  }
  ddp_core::refuse_sparse_on_device(layout, backend_name(job.backend), job.rank());
}

void check_layout_memory(const Job& job, const std::string& model, int grad_copies,
                         int param_copies, std::optional<std::int64_t> sparse_rows,
                         long double extra_bytes, const std::string& extra_what) {
  std::uint64_t grads = 0, params = 0;
  long double sparse = 0;  // the simulated sparse gradients, on the host
  try {
    const auto layout = ddp_core::load_model(model);
    grads = layout.gradient_bytes();
    params = layout.total_bytes();
    if (sparse_rows)
      for (const auto& t : layout.tensors) {
        if (!t.expects_sparse || !t.requires_grad || t.shape.empty() || t.shape[0] <= 0) continue;
        // A row's values and its index; the rows a rank draws (with
        // repeats), and every rank's coalesced rows (at most the table's)
        // gathered.
        const long double row = static_cast<long double>(t.bytes()) / static_cast<long double>(t.shape[0]) + 8;
        const long double drawn = static_cast<long double>(*sparse_rows);
        const long double kept = std::min<long double>(drawn, static_cast<long double>(t.shape[0]));
        sparse += row * (drawn + kept * (job.size() + 1));
      }
  } catch (const std::exception&) {
    return;
  }
  if (job.backend != Backend::kGloo) {  // NCCL: the buffers are the device's; the sparse rows the host's
    if (sparse > 0)
      check_host_memory(job, sparse,
                        fmt::format("the sparse gradients of --sparse-rows {} (rows drawn per rank, and "
                                    "every rank's gathered)",
                                    *sparse_rows),
                        "lower --sparse-rows");
    return;
  }
  const long double per_rank = static_cast<long double>(grads) * grad_copies +
                               static_cast<long double>(params) * param_copies + sparse + extra_bytes;
  std::string what =
      sparse > 0 ? fmt::format("the buffers of model {} ({:.1f} GiB of parameters) and its "
                               "sparse gradients of --sparse-rows {}",
                               model, static_cast<double>(params) / (1ULL << 30), *sparse_rows)
                 : fmt::format("the buffers of model {} ({:.1f} GiB of parameters)", model,
                               static_cast<double>(params) / (1ULL << 30));
  std::string hint = sparse > 0 ? "lower --sparse-rows, use a smaller model layout, or fewer ranks on this host"
                                : "use a smaller model layout, or fewer ranks on this host";
  // Named where it weighs (the default 1 MiB workspace does not).
  if (extra_bytes > 0.1L * per_rank) {
    what += fmt::format(" and {} ({:.1f} GiB)", extra_what, static_cast<double>(extra_bytes / (1ULL << 30)));
    hint = "make " + extra_what + " smaller, " + hint;
  }
  check_host_memory(job, per_rank, what, hint);
}

UsageError report_write_error(const reports::WriteError& e, int rank) {
  const int err = e.error_number();
  return UsageError(e.what(), {"report", rank, -1,
                               err == ENOSPC || err == EDQUOT
                                   ? "the disk is full (or over quota): free space, or pass a "
                                     "path on another disk"
                                   : "check that the directory exists and is writable, or pass "
                                     "another path"});
}

namespace {

// " on rank 0 (peer rank 1) during gather"
std::string error_where(const Error& e) {
  const auto& c = e.context();
  std::string where;
  if (c.rank >= 0) where += fmt::format(" on rank {}", c.rank);
  // A peer is another rank: a rank never names itself as its own peer.
  if (c.peer >= 0 && c.peer != c.rank) where += fmt::format(" (peer rank {})", c.peer);
  if (!c.phase.empty()) where += fmt::format(" during {}", c.phase);
  return where;
}

}  // namespace

std::string error_file_text(const Error& e) {
  const auto& c = e.context();
  return fmt::format("ddpdiag error{}: {}{}", error_where(e), e.what(),
                     c.hint.empty() ? "" : " (hint: " + c.hint + ")");
}

void print_error(const Error& e, bool error_file) {
  const auto& c = e.context();
  std::fprintf(stderr, "ddpdiag: error%s: %s\n", error_where(e).c_str(), e.what());
  if (!c.hint.empty()) std::fprintf(stderr, "ddpdiag: hint: %s\n", c.hint.c_str());
  if (error_file) write_torchelastic_error_file(error_file_text(e));
}

void write_torchelastic_error_file(const std::string& message) {
  // torchrun gives each worker a file to describe its failure in
  // (TORCHELASTIC_ERROR_FILE), in the form torch's @record writes, and
  // shows it in its summary, taking the earliest as the root cause.
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const nlohmann::json doc = {
      {"message",
       {{"message", message},
        {"extraInfo",
         {{"py_callstack", message},
          {"timestamp", std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
  try {
    reports::write_file_atomic(path, doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } catch (const std::exception&) {
  }
}

void print_checks_and_verdict(const reports::Report& report) {
  const auto doc = report.finish();  // keep it alive: the loop walks into it
  for (const auto& c : doc["checks"])
    std::printf("# Check %-26s: %s (%s)\n", c["name"].get<std::string>().c_str(),
                c["status"].get<std::string>().c_str(), c["detail"].get<std::string>().c_str());
  // Warnings do not change the verdict. The whole text (with what to do)
  // went to stderr and is in the report; beside the verdict, its first
  // sentence.
  if (doc["results"].contains("warnings"))
    for (const auto& w : doc["results"]["warnings"]) {
      const auto detail = w["detail"].get<std::string>();
      std::printf("# Warning %-24s: %s\n", w["name"].get<std::string>().c_str(),
                  detail.substr(0, detail.find(". ")).c_str());
    }
  std::printf("# Verdict: %s\n", report.verdict().c_str());
  std::fflush(stdout);
}

namespace {
// The flag's value as a number, or nullopt when it is not one. Overflow
// ("1e999") reads as infinity and NaN as NaN, for the checks to refuse as
// not finite; underflow (a subnormal such as 1e-310, or what rounds to 0)
// is a number, which the range checks judge.
std::optional<double> as_number(const std::string& s) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0') return std::nullopt;
  return v;
}
std::string shortest(double v) { return fmt::format("{}", v); }
// What an option given '' is told (refuse_empty_values, number checks).
constexpr const char* kEmptyValue =
    "an empty value ('') is not one: give a value, or leave the option out for its default";
// Why a flag's value that is not a number is refused; an empty one is said
// to be empty, as main says of any option given ''.
std::string not_a_number(const std::string& s) {
  return s.empty() ? std::string(kEmptyValue) : "'" + s + "' is not a number";
}
}  // namespace

namespace {
// A number check: `ok` on the value, else "must be <wanted>, not <value>";
// a value that is not a number is said to be so.
CLI::Validator number_check(std::function<bool(double)> ok, const std::string& wanted,
                            const std::string& desc, const std::string& name) {
  return CLI::Validator(
      [ok = std::move(ok), wanted](std::string& s) -> std::string {
        const auto v = as_number(s);
        if (!v) return not_a_number(s);
        if (!std::isfinite(*v)) return "must be " + wanted + " (a finite number), not " + s;
        return ok(*v) ? "" : "must be " + wanted + ", not " + s;
      },
      desc, name);
}
}  // namespace

CLI::Validator number_above(double lo) {
  const std::string bound = "> " + shortest(lo);
  return number_check([lo](double v) { return v > lo; }, "a number " + bound, bound, "ABOVE");
}
CLI::Validator positive_number() { return number_above(0); }
CLI::Validator non_negative_number() {
  return number_check([](double v) { return v >= 0; }, "a number >= 0", ">= 0", "NONNEGATIVE");
}
CLI::Validator number_in_range(double lo, double hi) {
  const std::string lo_s = shortest(lo), hi_s = shortest(hi);
  return number_check([lo, hi](double v) { return v >= lo && v <= hi; },
                      "between " + lo_s + " and " + hi_s, lo_s + " to " + hi_s, "RANGE");
}

CLI::Validator int64_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        // As CLI11 reads it (strtoll, base 0), so that only what it would
        // clamp is refused; other mistakes keep CLI11's own message.
        errno = 0;
        char* end = nullptr;
        (void)std::strtoll(s.c_str(), &end, 0);
        if (errno == ERANGE)
          return "must be a 64-bit integer (-9223372036854775808 to 9223372036854775807), not " + s;
        return std::string();
      },
      "", "INT64");
}

void add_common_options(CLI::App* app, CommonOptions& o) {
  auto* g = app;
  g->add_option("--nproc", o.nproc,
                "Start this many ranks on this machine (built-in launcher). Default with no "
                "launcher: one rank per GPU with NCCL, else 2 CPU ranks with Gloo")
      ->check(positive_number());
  g->add_option("--backend", o.backend, "Communication backend: auto, gloo or nccl")
      ->check(CLI::IsMember({"auto", "gloo", "nccl"}));
  g->add_option("--timeout", o.timeout_s,
                "Seconds to wait on any peer (rendezvous, init, each collective)")
      ->check(timeout_value());
  g->add_option("--json", o.json_path,
                "Write the job's report (from rank 0) to this file; a rank that loses the "
                "store writes its own beside it, with .rank<R> before the .json "
                "(--json out.json: rank 1 writes out.rank1.json)")
      ->check(report_path_value());
  g->add_option("--markdown", o.markdown_path,
                "Write the job's report as Markdown (from rank 0) to this file")
      ->check(report_path_value());
  g->add_option("--rank", o.world.rank, "This process's rank (overrides RANK)");
  g->add_option("--world-size", o.world.world_size, "Number of ranks (overrides WORLD_SIZE)");
  g->add_option("--local-rank", o.world.local_rank, "Rank on this host (overrides LOCAL_RANK)");
  g->add_option("--local-world-size", o.world.local_world_size,
                "Ranks on this host (overrides LOCAL_WORLD_SIZE)");
  g->add_option("--master-addr", o.world.master_addr,
                "Host of the store (overrides MASTER_ADDR)");
  g->add_option("--master-port", o.world.master_port,
                "Port of the store (overrides MASTER_PORT)");
  g->add_option("--gloo-interface", o.gloo_interface,
                "Network interface for Gloo (overrides GLOO_SOCKET_IFNAME)");
  g->add_option("--gloo-threads", o.gloo_threads,
                "Gloo worker threads: collectives on distinct buffers in flight at once (2, as "
                "torch's ProcessGroupGloo; 1 runs every op alone)")
      ->check(cli::number_in_range(1, 16));
  g->add_option("--store-protocol", o.store_protocol,
                "Store wire protocol: auto (detect), 1.13 or 2.x")
      ->check(CLI::IsMember({"auto", "1.13", "2.x"}));
  g->add_flag("--desync-check", o.desync_check,
              "All-gather every collective's fingerprint before it runs and stop at the first "
              "rank that disagrees (as TORCH_DISTRIBUTED_DEBUG=DETAIL; costs latency)");
  // Tests only (hidden): fault injection in the monitored communicator and
  // per-rank host names, so fault tests need no sleeps and bisect can see
  // "hosts" on one machine. See comm/monitor.h for the fault syntax.
  g->add_option("--inject-fault", o.inject_fault, "")->group("");
  g->add_option("--test-hosts", o.test_hosts, "")->group("");
}

void refuse_empty_values(const CLI::App& app) {
  for (const CLI::Option* opt : app.get_options())
    if (opt->count() > 0 && opt->nonpositional() && opt->get_items_expected_min() > 0)
      for (const std::string& r : opt->results())
        if (r.empty())
          throw CLI::ValidationError(opt->get_name(), kEmptyValue);
}

std::size_t parse_size(const std::string& s) {
  const std::string looks = "sizes look like 8, 1K, 64M or 1G (binary: K = 1024)";
  if (s.empty()) throw UsageError("empty size", {"flags", -1, -1, looks});
  // long double holds every 64-bit integer exactly (x86's 64-bit mantissa,
  // or a wider one), so "18446744073709551615" is not rounded up to 2^64.
  char* end = nullptr;
  errno = 0;
  const long double v = std::strtold(s.c_str(), &end);
  if (end == s.c_str() || std::isspace(static_cast<unsigned char>(s[0])))
    throw UsageError(fmt::format("'{}' is not a size", s), {"flags", -1, -1, looks});
  const std::string suffix(end);
  long double mult = 1;
  if (suffix == "K" || suffix == "k" || suffix == "KB" || suffix == "KiB") mult = 1024.0L;
  else if (suffix == "M" || suffix == "m" || suffix == "MB" || suffix == "MiB") mult = 1024.0L * 1024;
  else if (suffix == "G" || suffix == "g" || suffix == "GB" || suffix == "GiB")
    mult = 1024.0L * 1024 * 1024;
  else if (!suffix.empty() && suffix != "B" && suffix != "b")
    throw UsageError(fmt::format("'{}' has an unknown unit '{}'", s, suffix),
                     {"flags", -1, -1, "use K, M or G (binary: K = 1024)"});
  if (v < 0 || std::isnan(v)) throw UsageError(fmt::format("'{}' is not a valid size", s), {"flags", -1, -1, looks});
  // Anything from 2^64 bytes on (also "inf" and strtold's overflow) would
  // wrap around in a 64-bit size.
  const long double bytes = v * mult;
  if (!(bytes < 18446744073709551616.0L)) throw UsageError(size_too_large(s), {"flags", -1, -1, ""});
  return static_cast<std::size_t>(bytes);
}

std::string size_too_large(const std::string& s) {
  return fmt::format("'{}' is too large (at most {} bytes, 16 EiB - 1)", s, kMaxSizeBytes);
}

std::optional<std::string> size_order_problem(const std::string& min_flag, const std::string& min_value,
                                              const std::string& max_value) {
  std::size_t lo = 0, hi = 0;
  try {
    lo = parse_size(min_value);
    hi = parse_size(max_value);
  } catch (const UsageError&) {
    return std::nullopt;  // the flag's own check names it
  }
  if (hi >= lo) return std::nullopt;
  return fmt::format("{} is below {} {} (swap them)", max_value, min_flag, min_value);
}

namespace {
// Why a bucket cap in MiB is refused, or "".
std::string bucket_mb_problem(double mb, bool zero_ok) {
  if (!std::isfinite(mb) || mb < 0 || (!zero_ok && mb == 0))
    return zero_ok ? "must be a number >= 0" : "must be a number > 0";
  if (mb > 1e12) return "must be at most 1e12";
  if (!zero_ok && static_cast<std::uint64_t>(mb * kMiB) == 0)
    return "must be at least one byte (1/1048576 = 9.5367e-07 MiB)";
  return "";
}
}  // namespace

std::uint64_t bucket_cap_bytes(double mb, const char* flag, int rank, bool zero_ok) {
  if (const std::string why = bucket_mb_problem(mb, zero_ok); !why.empty())
    throw UsageError(fmt::format("{} {} (MiB), got {}", flag, why, mb),
                     {"flags", rank, -1,
                      "DDP's defaults: bucket_cap_mb 25, and a first bucket of 1 MiB "
                      "(dist._DEFAULT_FIRST_BUCKET_BYTES)"});
  return static_cast<std::uint64_t>(mb * kMiB);
}

CLI::Validator bucket_mb_value(bool zero_ok) {
  return CLI::Validator(
      [zero_ok](std::string& s) -> std::string {
        const auto v = as_number(s);
        if (!v) return not_a_number(s);
        const std::string why = bucket_mb_problem(*v, zero_ok);
        return why.empty() ? "" : why + ", not " + s + " (MiB; DDP's default is 25, first bucket 1)";
      },
      zero_ok ? "MiB >= 0" : "MiB > 0", "BUCKET_MB");
}

std::uint64_t BucketCapList::max_bytes() const {
  return bytes.empty() ? 0 : *std::max_element(bytes.begin(), bytes.end());
}

double BucketCapList::max_mb() const { return mb.empty() ? 0 : *std::max_element(mb.begin(), mb.end()); }

std::string BucketCapList::text() const {
  std::string out = "[";
  for (std::size_t i = 0; i < mb.size(); ++i) out += fmt::format("{}{:g}", i ? ", " : "", mb[i]);
  return out + "]";
}

BucketCapList parse_cap_list(const std::string& s, int rank, bool zero_ok) {
  constexpr const char* kFlag = "--bucket-cap-mb-list";
  const std::string example = "--bucket-cap-mb-list 1,4,25 (MiB)";
  BucketCapList out;
  for (const auto& item : split_list(s, kFlag, "1,4,25", rank)) {
    const auto v = as_number(item);
    const std::string why = v ? bucket_mb_problem(*v, zero_ok) : std::string("must be a number");
    if (!why.empty())
      throw UsageError(fmt::format("{}: each value {} (MiB), got '{}'", kFlag, why, item),
                       {"flags", rank, -1, "e.g. " + example});
    out.mb.push_back(*v);
    out.bytes.push_back(static_cast<std::uint64_t>(*v * kMiB));
  }
  if (!s.empty() && out.max_bytes() == 0)
    throw UsageError(fmt::format("{}: '{}' has no value of a byte or more (torch refuses a list "
                                 "whose largest cap is 0)",
                                 kFlag, s),
                     {"flags", rank, -1, "e.g. " + example});
  return out;
}

std::vector<std::uint64_t> BucketSizes::limits() const {
  return list.empty() ? ddp_core::ddp_bucket_limits(cap_bytes, first_bytes) : list.bytes;
}

BucketSizes bucket_sizes(double cap_mb, double first_mb, const std::string& cap_list, int rank, bool zero_ok) {
  BucketSizes s;
  s.list = parse_cap_list(cap_list, rank, zero_ok);
  if (s.list.empty()) {
    s.cap_bytes = bucket_cap_bytes(cap_mb, "--bucket-cap-mb", rank, zero_ok);
    s.first_bytes = bucket_cap_bytes(first_mb, "--first-bucket-mb", rank, zero_ok);
  } else {
    s.cap_bytes = s.list.max_bytes();
    s.first_bytes = s.list.bytes.front();
  }
  return s;
}

CLI::Option* add_skip_unused_flag(CLI::App* app, bool& value, const std::string& what) {
  return app->add_flag("--skip-all-reduce-unused-params", value,
                "torch 2.x's DDP(skip_all_reduce_unused_params=True): " + what);
}

CLI::Option* add_set_last_bucket_cap_flag(CLI::App* app, bool& value) {
  return app->add_flag("--set-last-bucket-cap", value,
                       "as DDP with DDP_SET_LAST_BUCKET_CAP=1 in its environment (also read here): the "
                       "buckets it rebuilds are filled from the other end, so the first bucket's small "
                       "limit goes to the bucket reduced last");
}

bool set_last_bucket_cap(bool flag) {
  const char* env = std::getenv("DDP_SET_LAST_BUCKET_CAP");
  return flag || (env != nullptr && std::string_view(env) == "1");
}

std::string set_last_bucket_cap_note(bool on, bool find_unused, bool static_graph, bool first_iteration) {
  if (!on) return "";
  const bool rebuilt = !first_iteration && (static_graph || !find_unused);
  return rebuilt ? ", DDP_SET_LAST_BUCKET_CAP=1 (the first limit on the bucket reduced last)"
                 : ", DDP_SET_LAST_BUCKET_CAP=1 (no effect: DDP does not rebuild these buckets)";
}

CLI::Validator cap_list_value(bool zero_ok) {
  return CLI::Validator(
      [zero_ok](std::string& v) -> std::string {
        try {
          parse_cap_list(v, -1, zero_ok);
          return "";
        } catch (const UsageError& e) {
          // CLI11 names the flag itself.
          std::string what = e.what();
          if (const auto colon = what.find(": "); colon != std::string::npos) what.erase(0, colon + 2);
          return what + " (" + e.context().hint + ")";
        }
      },
      "MIB,MIB,...", "CAP_LIST");
}

CLI::Option* add_cap_list_option(CLI::App* app, std::string& value, bool zero_ok,
                                 std::initializer_list<CLI::Option*> replaces) {
  auto* opt = app->add_option("--bucket-cap-mb-list", value,
                              "torch 2.x's DDP(bucket_cap_mb_list=[...]): the size limit of each "
                              "bucket in order, the last repeating (MiB, e.g. 1,4,25), in place of "
                              "--bucket-cap-mb and --first-bucket-mb")
                  ->check(cap_list_value(zero_ok));
  for (CLI::Option* r : replaces) opt->excludes(r);
  return opt;
}

CLI::Validator timeout_value() { return number_in_range(kMinTimeoutS, kMaxTimeoutS); }

void add_gradient_view_flags(CLI::App* app, bool& views) {
  auto* on = app->add_flag("--gradient-as-bucket-view,--gradient-views", views,
                           "gradient_as_bucket_view=True: gradients are slices of the buckets "
                           "(default: False, as DDP)");
  app->add_flag_callback("--no-views,--no-gradient-views", [&views] { views = false; },
                         "gradient_as_bucket_view=False (the default, as DDP): each gradient in "
                         "a buffer of its own, copied into and out of the buckets")
      ->excludes(on);
}

void check_backward_rate(std::uint64_t gradient_bytes, double gbps, int rank) {
  if (!(gbps > 0)) return;
  const double s = static_cast<double>(gradient_bytes) / (gbps * 1e9);
  if (s > 3600)
    throw UsageError(fmt::format("--compute-gbps {}: the simulated backward of {:.1f} MiB of "
                                 "gradients would take {:.0f} s per step",
                                 gbps, static_cast<double>(gradient_bytes) / kMiB, s),
                     {"flags", rank, -1,
                      fmt::format("give at least {:.3g} GB/s (an hour a step), or 0 for no compute time",
                                  static_cast<double>(gradient_bytes) / 3600e9)});
}

namespace {
// Adds ranks from..to (ascending, after those already there) to `ranges`,
// joining the last range when they follow it.
void append_rank_range(std::vector<std::pair<int, int>>& ranges, int from, int to) {
  if (!ranges.empty() && ranges.back().second + 1 == from)
    ranges.back().second = to;
  else
    ranges.emplace_back(from, to);
}
}  // namespace

std::string format_rank_ranges(const std::vector<std::pair<int, int>>& ranges, std::size_t max_ranges) {
  std::string out;
  std::int64_t left = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const auto [from, to] = ranges[i];
    if (i >= max_ranges) {
      left += static_cast<std::int64_t>(to) - from + 1;
      continue;
    }
    out += (out.empty() ? "" : ",") + (from == to ? std::to_string(from) : fmt::format("{}-{}", from, to));
  }
  if (left > 0) out += fmt::format(" and {} more", left);
  return out;
}

std::string rank_ranges(std::vector<int> ranks, std::size_t max_ranges) {
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<std::pair<int, int>> ranges;
  for (int r : ranks) append_rank_range(ranges, r, r);
  return format_rank_ranges(ranges, max_ranges);
}

std::vector<std::string> split_list(const std::string& s, const std::string& flag,
                                    const std::string& example, int rank) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  std::size_t start = 0;
  for (;;) {
    const auto comma = s.find(',', start);
    out.push_back(s.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  for (const auto& item : out)
    if (item.empty())
      throw UsageError(fmt::format("{}: '{}' has an empty entry", flag, s),
                       {"flags", rank, -1,
                        fmt::format("separate the values with single commas and no comma at either "
                                    "end, e.g. {} {}",
                                    flag, example)});
  return out;
}

namespace {
// What is wrong with a --caps value, if anything: empty, an empty entry
// ("1,,5"), or the first item that is not a positive number of MiB. Fills
// `out` (sorted, no repeats).
struct CapsProblem {
  enum Kind { kEmpty, kEmptyEntry, kBadItem } kind = kBadItem;
  std::string item;
};
std::optional<CapsProblem> read_caps(const std::string& s, std::vector<double>& out) {
  out.clear();
  std::vector<std::string> items;
  try {
    items = split_list(s, "--caps", "1,5,25");
  } catch (const UsageError&) {
    return CapsProblem{CapsProblem::kEmptyEntry, s};
  }
  for (const auto& item : items) {
    double v = -1;
    try {
      std::size_t used = 0;
      v = std::stod(item, &used);
      if (used != item.size()) v = -1;
    } catch (const std::exception&) {
    }
    if (!(v > 0) || v > 1e6 || static_cast<std::uint64_t>(v * kMiB) == 0)
      return CapsProblem{CapsProblem::kBadItem, item};
    out.push_back(v);
  }
  if (out.empty()) return CapsProblem{CapsProblem::kEmpty, ""};
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return std::nullopt;
}

// The message without the flag's name (CLI11 puts it in front) and the hint.
std::pair<std::string, std::string> caps_message(const CapsProblem& p) {
  switch (p.kind) {
    case CapsProblem::kEmpty: return {"is empty", "e.g. --caps 1,5,25"};
    case CapsProblem::kEmptyEntry:
      return {fmt::format("'{}' has an empty entry", p.item),
              "separate the values with single commas and no comma at either end, e.g. --caps "
              "1,5,25"};
    case CapsProblem::kBadItem: break;
  }
  return {fmt::format("'{}' is not a positive number of MiB (at least one byte, 9.5367e-07, and "
                      "at most 1e6)",
                      p.item),
          "e.g. --caps 1,5,10,25,50,100"};
}
}  // namespace

std::vector<double> parse_caps(const std::string& s, int rank) {
  std::vector<double> out;
  if (const auto p = read_caps(s, out)) {
    const auto [message, hint] = caps_message(*p);
    throw UsageError("--caps" + std::string(p->kind == CapsProblem::kEmpty ? " " : ": ") + message,
                     {"flags", rank, -1, hint});
  }
  return out;
}

CLI::Validator caps_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        std::vector<double> caps;
        const auto p = read_caps(s, caps);
        if (!p) return "";
        // CLI11 names the flag itself.
        const auto [message, hint] = caps_message(*p);
        return message + " (" + hint + ")";
      },
      "CAPS", "CAPS");
}

CLI::Validator size_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        try {
          parse_size(s);
          return "";
        } catch (const UsageError& e) {
          const auto& hint = e.context().hint;
          return std::string(e.what()) + (hint.empty() ? "" : " (" + hint + ")");
        }
      },
      "SIZE", "SIZE");
}

CLI::Validator positive_size_value(const std::string& hint) {
  const auto sized = size_value();
  return CLI::Validator(
      [sized, hint](std::string& s) -> std::string {
        if (auto problem = sized(s); !problem.empty()) return problem;
        return parse_size(s) > 0 ? "" : "must be a size > 0, not " + s + " (" + hint + ")";
      },
      "SIZE > 0", "POSITIVE_SIZE");
}

std::string format_size(std::size_t b) {
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) return fmt::format("{}G", b >> 30);
  if (b >= (1ull << 20) && b % (1ull << 20) == 0) return fmt::format("{}M", b >> 20);
  if (b >= (1ull << 10) && b % (1ull << 10) == 0) return fmt::format("{}K", b >> 10);
  return std::to_string(b);
}

std::string machine_name() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return host;
}

std::string every_address() {
  if (int probe = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0); probe >= 0) {
    ::close(probe);
    return "::";
  }
  return "0.0.0.0";
}

std::string machine_id() {
  // Host names repeat on cloned machines; the kernel's boot id does not
  // (network namespaces of one machine share it, and they do share its CPUs
  // and process ids). Read once per process.
  static const std::string boot = [] {
    std::string b;
    if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
      char buf[64] = {0};
      if (std::fgets(buf, sizeof buf, f)) b = buf;
      std::fclose(f);
    }
    while (!b.empty() && std::isspace(static_cast<unsigned char>(b.back()))) b.pop_back();
    return b;
  }();
  // Containers on one host (host networking) share its name and boot id
  // but not its process ids: a pid is only meaningful in its pid namespace.
  static const std::string pid_ns = [] {
    char buf[64] = {0};
    const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof buf - 1);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  }();
  std::string id = boot.empty() ? machine_name() : machine_name() + "#" + boot;
  return pid_ns.empty() ? id : id + "#" + pid_ns;
}

std::string reported_host_name(const CommonOptions& o, int rank) {
  if (!o.test_hosts.empty()) {
    std::vector<std::string> names;
    std::size_t start = 0;
    for (;;) {
      auto comma = o.test_hosts.find(',', start);
      names.push_back(o.test_hosts.substr(start, comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    if (rank >= 0 && rank < static_cast<int>(names.size()) && !names[rank].empty())
      return names[rank];
  }
  return machine_name();
}

Backend choose_backend(const CommonOptions& o) {
  if (o.backend == "gloo") return Backend::kGloo;
  if (o.backend == "nccl") return Backend::kNccl;
  return (nccl_supported() && cuda_device_count() > 0) ? Backend::kNccl : Backend::kGloo;
}

StoreProtocol parse_store_protocol(const std::string& s) {
  if (s == "1.13") return StoreProtocol::kV1;
  if (s == "2.x") return StoreProtocol::kV2;
  return StoreProtocol::kAuto;
}

namespace {

bool is_loopback_name(const std::string& addr) {
  return addr == "localhost" || addr == "ip6-localhost" || addr == "::1" ||
         addr.rfind("127.", 0) == 0 || addr.rfind("localhost.", 0) == 0;
}

}  // namespace

// On the rank that hosts the store, after the rendezvous timed out: whether
// MASTER_ADDR, where the other ranks look for the store, leads here at all.
// "" when it does (or was not given).
std::string master_addr_problem(const World& w) {
  if (w.master_addr_source == "default" || w.master_addr.empty()) return {};
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (int rc = ::getaddrinfo(w.master_addr.c_str(), nullptr, &hints, &res); rc != 0)
    return fmt::format("{}='{}' does not resolve on this host ({}), so the other ranks may not "
                       "find the store either; set it to a name or address of this host",
                       w.master_addr_source, w.master_addr, gai_strerror(rc));
  std::string first;
  bool local = false;
  for (addrinfo* ai = res; ai && !local; ai = ai->ai_next) {
    if (first.empty()) first = ip_text(ai->ai_addr);
    // Binding to an address works only where this host has it.
    int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
      local = ::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (local) return {};
  if (w.master_addr_source.rfind("SLURM_", 0) == 0)
    // Taken from Slurm's node list, which the user does not set.
    return fmt::format("MASTER_ADDR is unset, so the first host of {}, '{}' ({}), was taken for "
                       "rank 0's, but rank 0 runs on this host ({}): export MASTER_ADDR=<this "
                       "host> on every rank (task 0 is not on the list's first node, e.g. under "
                       "srun --distribution=arbitrary)",
                       w.master_addr_source, w.master_addr, first, machine_name());
  return fmt::format("{}='{}' ({}) is not an address of this host, where rank 0 hosts the store: "
                     "the other ranks look for it there (unless a NAT or service address leads "
                     "here); set it to this host's name or address",
                     w.master_addr_source, w.master_addr, first);
}

std::string loopback_hint(const World& w) {
  if (w.local_world_size >= w.world_size || !is_loopback_name(w.master_addr)) return {};
  return fmt::format(
      "MASTER_ADDR={} is a loopback address, but this job spans several hosts ({} ranks, {} on "
      "this one): ranks on other hosts than the store's reach their own loopback. Set "
      "MASTER_ADDR (or --master-addr) to the address of the store's host; under torchrun with "
      "--rdzv-backend c10d, pass --local-addr <the node's address> on every node (torch "
      "otherwise gives its workers the node's fully qualified name, often localhost)",
      w.master_addr, w.world_size, w.local_world_size);
}

namespace {

// The backend library this rank runs. DDPDIAG_TEST_LIBRARY_VERSION (tests
// only) stands in for it, so that a test can start ranks that disagree.
std::string reported_library_version(Backend b) {
  if (const char* v = std::getenv("DDPDIAG_TEST_LIBRARY_VERSION"); v && *v) return v;
  return backend_library_version(b);
}

}  // namespace

namespace {

// Option name -> {"value": what is compared, "shown": what a message says},
// for the options that must agree across ranks.
nlohmann::json g_rank_settings = nlohmann::json::object();
std::string g_rank_command;  // the subcommand this rank runs
bool g_rank_reports = false;  // this rank was given --json or --markdown

// A file named on the command line (a model layout) may sit at different
// paths on different hosts: its contents are compared, not its path.
std::optional<std::string> file_digest(const std::string& path) {
  std::error_code ec;
  if (path.empty() || !std::filesystem::is_regular_file(path, ec)) return std::nullopt;
  std::string bytes;
  try {
    // As large as a layout may be; the layout's own load names any error.
    bytes = read_input_file(path, std::size_t{256} << 20);
  } catch (const InputFileError&) {
    return std::nullopt;
  }
  return fmt::format("a file of {} bytes, checksum {:016x}", bytes.size(),
                     ddp_core::checksum64(bytes.data(), bytes.size()));
}

// Every rank's settings against rank 0's: one line per option that differs.
// The recorded value of a setting left at its default that is the job's
// world size: resolved when the ranks' settings are compared.
constexpr const char* kJobWorldSizeSetting = "(the job's world size)";

std::vector<std::string> settings_differences(const std::vector<nlohmann::json>& infos) {
  std::vector<std::string> out;
  if (infos.empty() || !infos[0].is_object()) return out;
  const nlohmann::json ref = infos[0].value("settings", nlohmann::json::object());
  auto field = [](const nlohmann::json& settings, const std::string& name, const char* f) {
    if (!settings.contains(name) || !settings[name].is_object()) return std::string("?");
    return settings[name].value(f, std::string("?"));
  };
  auto shown = [&](const nlohmann::json& settings, const std::string& name) {
    if (!settings.contains(name)) return std::string("no such option");
    const std::string v = field(settings, name, "shown");
    if (v == "(default)") return std::string("its default");
    return v.empty() ? name : name + " " + v;
  };
  for (std::size_t r = 1; r < infos.size(); ++r) {
    if (!infos[r].is_object()) continue;
    const nlohmann::json mine = infos[r].value("settings", nlohmann::json::object());
    std::vector<std::string> names;
    for (const auto& [k, _] : ref.items()) names.push_back(k);
    for (const auto& [k, _] : mine.items())
      if (!ref.contains(k)) names.push_back(k);
    // A setting whose default is the job's world size (dp-vs-ring's
    // --world-sizes) agrees with that size given.
    const auto value = [&](const nlohmann::json& settings, const std::string& name) {
      const std::string v = field(settings, name, "value");
      return v == kJobWorldSizeSetting ? std::to_string(infos.size()) : v;
    };
    for (const auto& k : names)
      if (value(mine, k) != value(ref, k))
        out.push_back(fmt::format("{}: rank {} has {}, rank 0 has {}", k, r, shown(mine, k),
                                  shown(ref, k)));
  }
  return out;
}

}  // namespace

namespace {

// One value of an option as the rank will use it, so that two spellings of
// the same setting (-e 16K and -e 16384, -w 5 and the default 5, 1 and 1.0)
// do not count as ranks that disagree: a whole integer without its leading
// zeros (exact, at any length), a number as the double it reads as, a size
// in bytes; anything else as written.
std::string canonical_setting(const std::string& item) {
  if (item.empty() || std::isspace(static_cast<unsigned char>(item[0]))) return item;
  const bool negative = item[0] == '-' || item[0] == '+';
  const std::string digits = item.substr(negative ? 1 : 0);
  if (!digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos) {
    const auto first = digits.find_first_not_of('0');
    const std::string magnitude = first == std::string::npos ? "0" : digits.substr(first);
    return (item[0] == '-' && magnitude != "0" ? "-" : "") + magnitude;
  }
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(item.c_str(), &end);
  if (end == item.c_str() + item.size() && std::isfinite(v)) return fmt::format("{}", v);
  try {
    return std::to_string(parse_size(item));
  } catch (const UsageError&) {
    return item;
  }
}

std::string canonical_settings(const std::string& value) {
  std::string out;
  std::size_t from = 0;
  for (;;) {
    const auto comma = value.find(',', from);
    out += canonical_setting(value.substr(from, comma == std::string::npos ? std::string::npos
                                                                           : comma - from));
    if (comma == std::string::npos) return out;
    out += ',';
    from = comma + 1;
  }
}

}  // namespace

void record_rank_settings(const CLI::App& subcommand) {
  static const std::set<std::string> per_rank = {
      "--rank",        "--world-size",     "--local-rank", "--local-world-size",
      "--master-addr", "--master-port",    "--nproc",      "--json",
      "--markdown",    "--timeout",        "--gloo-interface", "--store-protocol",
      "--test-hosts",  "--inject-fault",   "--help"};
  nlohmann::json settings = nlohmann::json::object();
  for (const CLI::Option* opt : subcommand.get_options()) {
    const std::string name = opt->get_name();
    if (name.empty() || per_rank.count(name)) continue;
    // Not given: its default where it has one (so that a rank that names
    // the default agrees with one that leaves it out).
    std::string value = opt->get_default_str().empty() ? "(default)" : opt->get_default_str();
    if (opt->count() > 0) {
      value.clear();
      for (const auto& r : opt->results()) value += (value.empty() ? "" : ",") + r;
    }
    std::string shown = opt->count() > 0 ? value : "(default)";
    if (auto digest = file_digest(value)) {
      shown = value + " (" + *digest + ")";
      value = *digest;
    } else {
      value = canonical_settings(value);
    }
    // Names that read as the same setting (-d float and -d float32, -o avg
    // and -o mean, --backend auto and the backend it picks here), and a
    // default that is the job's world size.
    if (name == "--datatype" || name == "--op") {
      std::string named;
      for (std::size_t from = 0; from <= value.size();) {
        const auto comma = std::min(value.find(',', from), value.size());
        const std::string item = value.substr(from, comma - from);
        from = comma + 1;
        std::string one = item;
        if (name == "--datatype") {
          if (const auto t = parse_dtype(item)) one = std::string(dtype_name(*t));
        } else if (const auto op = parse_reduce_op(item)) {
          one = std::string(reduce_op_name(*op));
        }
        named += (named.empty() ? "" : ",") + one;
      }
      value = named;
    } else if (name == "--backend" && value == "auto") {
      value = (nccl_supported() && cuda_device_count() > 0) ? "nccl" : "gloo";
    } else if (name == "--world-sizes" && opt->count() == 0) {
      value = kJobWorldSizeSetting;
    }
    settings[name] = {{"value", value}, {"shown", shown}};
  }
  g_rank_settings = std::move(settings);
  g_rank_command = subcommand.get_name();
  g_rank_reports = false;
  for (const char* flag : {"--json", "--markdown"})
    if (const CLI::Option* opt = subcommand.get_option_no_throw(flag); opt && opt->count() > 0)
      g_rank_reports = true;
}

namespace {

// Under an agent's store (torchrun's) the store outlives the workers. A
// restart's workers find the keys of the run before: torch 2.x keeps one
// store across restarts and each node counts its own restarts, so
// TORCHELASTIC_RESTART_COUNT does not tell runs apart, and a rank cannot tell
// a dead process's keys from a live one's. So the ranks first agree on a run
// of their own, in which no key can be stale (under ddpdiag's prefix):
//   runs         counter: rank 0 takes the next number as its run N
//   hello/last   counter: every other rank takes the next number k, which no
//                process took before it
//   hello/<k>    "<rank> <pid> <host>", set by that rank
//   welcome/<k>  "<N> <pid> <host>", set (compare_set) by rank 0 for every
//                hello it finds while it waits for the others
//   hello/done   the last hello the rank 0 of a run that met had looked at:
//                the next rank 0 starts after it
// A rank waits for the answer to its own hello, a key no earlier process can
// have set, and keeps every key of the job under run/<N> from then on.
// ddpdiag's own launcher starts a fresh store for every job: no need there.

bool agrees_on_run(const Job& job) {
  return job.world.agent_store && job.world.launcher != Launcher::kDdpdiag &&
         job.store_client.has_value();
}

void join_store_run(Job& job, const std::string& host) {
  const int me = job.rank();
  job.rendezvous_deadline = std::chrono::steady_clock::now() + job.timeout;
  auto* root = static_cast<PrefixStore*>(job.store.get());
  job.store_root = job.store;
  Store& store = *job.store_root;
  std::int64_t run = 0;
  if (me == 0) {
    run = store.add("runs", 1);
    // Who took it, for a second rank 0 to name.
    store.set(fmt::format("runs/{}", run),
              to_bytes(fmt::format("pid {} on host {}", static_cast<long>(getpid()), host)));
    // Which process holds this run, for a later rank 0 on this machine to
    // tell whether it still runs (pid, its start time, the machine's boot).
    store.set(fmt::format("runs/{}/proc", run),
              to_bytes(fmt::format("{} {} {}", static_cast<long>(getpid()),
                                   process_start_ticks(getpid()), machine_id())));
    // The rank 0 of the run before: its ranks may have met already, and then
    // it no longer looks for later runs. On this machine, a process still
    // alive there means two processes were given rank 0 (a restart stops the
    // old workers first; a script's next command waits for this one).
    if (run > 1 && store.check({fmt::format("runs/{}/proc", run - 1)})) {
      std::istringstream in(to_string(store.get(fmt::format("runs/{}/proc", run - 1), job.timeout)));
      long pid = 0;
      std::string ticks, machine;
      in >> pid >> ticks >> machine;
      if (in && pid > 0 && pid != static_cast<long>(getpid()) && machine == machine_id() &&
          !ticks.empty() && ticks != "0" && process_start_ticks(pid) == ticks &&
          !process_gone(pid)) {
        const std::string who = to_string(store.get(fmt::format("runs/{}", run - 1), job.timeout));
        const std::string msg = fmt::format(
            "rank 0 is claimed twice: by {} (run {}, still running) and by pid {} on host {} "
            "(run {})",
            who, run - 1, static_cast<long>(getpid()), host, run);
        store.set(fmt::format("duplicate/{}", run - 1), to_bytes(msg));
        store.set(fmt::format("duplicate/{}", run), to_bytes(msg));  // for the waiting ranks
        throw RendezvousError(msg, {"rendezvous", 0, -1,
                                    "two processes were given rank 0; check RANK / --rank / the "
                                    "launcher's node ranks and task counts"});
      }
    }
    if (store.check({"hello/done"})) {
      try {
        job.hellos_scanned = std::stoll(to_string(store.get("hello/done", job.timeout)));
      } catch (const std::exception&) {
        job.hellos_scanned = 0;  // not ours to trust: look at every hello
      }
    }
  } else {
    const std::int64_t k = store.add("hello/last", 1);
    store.set(fmt::format("hello/{}", k), to_bytes(fmt::format("{} {} {}", me,
                                                               static_cast<long>(getpid()), host)));
    const std::string key = fmt::format("welcome/{}", k);
    try {
      // In slices: a rank 0 that finds another rank 0 leaves its message
      // under duplicate/<newest run>, for the ranks that wait too.
      wait_in_slices(store, key, job.rendezvous_deadline.value(), [&] {
        if (const std::int64_t latest = store.add("runs", 0); latest > 0) {
          const std::string dup = fmt::format("duplicate/{}", latest);
          if (store.check({dup}))
            throw RendezvousError(to_string(store.get(dup, job.timeout)),
                                  {"rendezvous", me, 0,
                                   "two processes were given rank 0; check RANK / --rank / the "
                                   "launcher's node ranks and task counts"});
        }
      });
    } catch (const TimeoutError& e) {
      if (!is_store_wait_timeout(e)) throw;
      throw RendezvousError(
          fmt::format("rendezvous timed out after {:.0f} s: rank 0 never took this rank into its "
                      "run (hello {} in the agent's store at {}:{} was not answered); rank(s) "
                      "that never arrived: 0",
                      job.timeout.count() / 1000.0, k, job.world.master_addr,
                      job.world.master_port),
          {"rendezvous", me, 0,
           "check that rank 0 was started (its log says why it is missing) and that it uses "
           "the same store (MASTER_ADDR:MASTER_PORT)"});
    }
    const std::string answer = to_string(store.get(key, job.timeout));
    std::istringstream in(answer);
    in >> run;
    if (!in || run <= 0)
      throw RendezvousError(
          fmt::format("rank 0's answer in the store ({}) is not a run number: '{}'", key, answer),
          {"rendezvous", me, 0,
           "every rank must run the same ddpdiag build; something else writes ddpdiag's keys"});
  }
  job.store_run = run;
  job.store = std::make_shared<PrefixStore>(fmt::format("{}/run/{}", root->prefix(), run),
                                            root->base());
  note_armed_world_field("store_run", run);
}

// Rank 0, while it waits for the others: answers every hello it has not
// answered. A hello already answered by a rank 0 that started after this one
// (a higher run number) means two live processes hold rank 0.
void answer_hellos(Job& job) {
  if (job.rank() != 0 || !job.store_root) return;
  Store& store = *job.store_root;
  // Two live processes given rank 0: each took a run. No rank 0 of a later
  // run starts while this job's ranks still wait (a restart stops the old
  // workers first; a script's next command waits for this one), so a newer
  // run is another rank 0, now. The older names the newer, and tells it.
  // A rank 0 names its run right after taking it: a newer run seen between
  // the two steps is waited for briefly, so both processes are named.
  const auto other_run = [&](std::int64_t r) {
    const std::string key = fmt::format("runs/{}", r);
    try {
      return to_string(store.get(key, std::min(job.timeout, Millis(2000))));
    } catch (const TimeoutError& e) {
      if (!is_store_wait_timeout(e)) throw;
      return std::string("another process");
    }
  };
  const auto duplicate = [&](const std::string& msg) {
    job.store->set("abort", to_bytes(msg));
    throw RendezvousError(msg, {"rendezvous", 0, -1,
                                "two processes were given rank 0; check RANK / --rank / the "
                                "launcher's node ranks and task counts"});
  };
  const std::string dup_key = fmt::format("duplicate/{}", job.store_run);
  if (store.check({dup_key})) duplicate(to_string(store.get(dup_key, job.timeout)));
  if (const std::int64_t latest = store.add("runs", 0); latest > job.store_run) {
    const std::string msg = fmt::format(
        "rank 0 is claimed twice: by {} (run {}) and by {} (run {}), while the ranks met",
        other_run(job.store_run), job.store_run, other_run(latest), latest);
    store.set(fmt::format("duplicate/{}", latest), to_bytes(msg));
    duplicate(msg);
  }
  const std::int64_t last = store.add("hello/last", 0);
  for (std::int64_t k = job.hellos_scanned + 1; k <= last; ++k) job.hellos_pending.push_back(k);
  job.hellos_scanned = std::max(job.hellos_scanned, last);
  if (job.hellos_pending.empty()) return;
  const std::string mine =
      fmt::format("{} {} {}", job.store_run, static_cast<long>(getpid()), machine_name());
  std::vector<std::int64_t> unset;
  for (std::int64_t k : job.hellos_pending) {
    if (!store.check({fmt::format("hello/{}", k)})) {
      unset.push_back(k);  // taken, not yet set (or by a process that died)
      continue;
    }
    const std::string key = fmt::format("welcome/{}", k);
    const std::string current = to_string(store.compare_set(key, {}, to_bytes(mine)));
    if (current == mine) {
      // The same value again: a compare_set does not wake the rank waiting
      // for the key on every server (torch's wakes waiters only on set/add).
      store.set(key, to_bytes(mine));
      continue;
    }
    std::istringstream in(current);
    std::int64_t other_run = 0;
    long pid = 0;
    std::string other_host;
    in >> other_run >> pid >> other_host;
    if (other_run > job.store_run) {
      const std::string msg = fmt::format(
          "rank 0 is claimed twice: by pid {} on host {} and by pid {} on host {}", pid,
          other_host.empty() ? "?" : other_host, static_cast<long>(getpid()), machine_name());
      job.store->set("abort", to_bytes(msg));
      throw RendezvousError(msg, {"rendezvous", 0, -1,
                                  "two processes were given rank 0; check RANK / --rank / the "
                                  "launcher's node ranks and task counts"});
    }
    // Answered by a rank 0 of an earlier run: that rank's process is gone.
  }
  job.hellos_pending = std::move(unset);
}

}  // namespace

namespace {

// What names the job this rank was launched in, where a launcher says:
// ranks of two jobs that share a store address (a node, a port) must not
// meet. "" when no launcher names it.
std::string job_identity() {
  for (const char* var : {"SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "OMPI_MCA_ess_base_jobid",
                          "PMIX_NAMESPACE"}) {
    const char* v = std::getenv(var);
    if (!v || !*v) continue;
    // Not the Slurm step: one job's nodes may be started by several steps.
    return fmt::format("{}={}", var, v);
  }
  return "";
}

// The "refused" key's value: "<rank>\n<job_identity()>\n<the message>".
struct Refusal {
  int rank = -1;
  std::string job, message;
};

std::string refusal_text(int rank, const std::string& message) {
  return fmt::format("{}\n{}\n{}", rank, job_identity(), message);
}

Refusal parse_refusal(const std::string& text) {
  const auto nl = text.find('\n');
  const auto nl2 = nl == std::string::npos ? nl : text.find('\n', nl + 1);
  if (nl2 == std::string::npos) return {-1, "", text};
  return {std::atoi(text.substr(0, nl).c_str()), text.substr(nl + 1, nl2 - nl - 1),
          text.substr(nl2 + 1)};
}

}  // namespace

// Rendezvous protocol, under the job's ddpdiag prefix:
//   rank/<r>   JSON {rank, world_size, local_rank, host, machine, pid, device,
//              cpus, ddpdiag (build), library (backend library version),
//              settings (record_rank_settings)},
//              set by compare_set so a second process claiming the same rank
//              sees the first one's value and both are named;
//   joined     counter of ranks that registered;
//   abort      set by a rank that found the world inconsistent, so the others
//              stop waiting at once and report the same cause.
// Ranks poll (joined, abort) rather than blocking in WAIT, so a rank that
// never comes is named when the deadline passes.
void register_rank(Job& job, const std::string& device, const std::string& host) {
  const int n = job.size();
  const int me = job.rank();
  nlohmann::json info = {{"rank", me},          {"world_size", n},
                         {"local_rank", job.world.local_rank},
                         {"host", host},        {"machine", machine_id()},
                         {"pid", static_cast<long>(getpid())},
                         {"device", device},
                         {"cpus", format_cpu_list(allowed_cpus())},
                         {"ddpdiag", fmt::format("{} ({})", config::kVersion, config::kGitRevision)},
                         {"library", reported_library_version(job.backend)},
                         {"job", job_identity()},
                         {"command", g_rank_command},
                         {"reports", g_rank_reports},
                         {"settings", g_rank_settings}};
  const std::string mine = info.dump();
  if (agrees_on_run(job) && !job.store_run) join_store_run(job, host);
  Bytes current = job.store->compare_set("rank/" + std::to_string(me), {}, to_bytes(mine));
  if (to_string(current) != mine) {
    auto other = nlohmann::json::parse(to_string(current), nullptr, false);
    std::string who = other.is_object()
                          ? fmt::format("pid {} on host {}", other.value("pid", 0L),
                                        other.value("host", std::string("?")))
                          : "another process";
    // A rank of another job that uses the same store address (two jobs on
    // one node with the default port): named as such, and the job whose
    // store it is left alone.
    const std::string theirs = other.is_object() ? other.value("job", std::string()) : "";
    const std::string ours = info.value("job", std::string());
    if (!theirs.empty() && !ours.empty() && theirs != ours)
      throw RendezvousError(
          fmt::format("ranks of different jobs met at the store {}:{}: rank {} there is {} from "
                      "{}, and this process (pid {} on host {}) is rank {} of {}",
                      job.world.master_addr, job.world.master_port, me, who, theirs,
                      static_cast<long>(getpid()), host, me, ours),
          {"rendezvous", me, -1,
           "two jobs use the same MASTER_ADDR:MASTER_PORT: give each job a port of its own (e.g. "
           "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000)))"});
    std::string msg = fmt::format("rank {} is claimed twice: by {} and by pid {} on host {}", me,
                                  who, static_cast<long>(getpid()), host);
    job.store->set("abort", to_bytes(msg));
    throw RendezvousError(msg, {"rendezvous", me, -1,
                                "two processes were given the same rank (check RANK / --rank / "
                                "the launcher's task counts), or a second job uses the same "
                                "MASTER_ADDR:MASTER_PORT: give each job a port of its own (with "
                                "SLURM_JOB_ID or TORCHELASTIC_RUN_ID set, the ranks of different "
                                "jobs are told apart)"});
  }
  job.store->add("joined", 1);
  job.joined = true;
}

namespace {

// A rank's identity from its rank/<r> entry.
reports::RankInfo rank_info_of(int r, const nlohmann::json& j) {
  return {r, j.value("local_rank", 0), j.value("host", std::string()),
          static_cast<int>(j.value("pid", 0L)), j.value("device", ""), j.value("cpus", "")};
}

}  // namespace

struct MissingRanks {
  std::string text;  // format_rank_ranges: "1-3,7"
  int first = -1;    // the lowest missing rank, -1 if none is known
};

// After the rendezvous deadline: which of the n ranks never set their
// rank/<r> key. job.ranks gets the ones that did.
MissingRanks find_missing_ranks(Job& job, int n, std::int64_t joined) {
  const auto look_until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::vector<std::pair<int, int>> ranges;  // missing [from, to]
  const auto add_missing = [&](int from, int to) { append_rank_range(ranges, from, to); };
  job.ranks.clear();
  job.machines.clear();
  std::int64_t found = 0;
  int r = 0;
  bool unchecked = false;
  for (; r < n; ++r) {
    if (found >= joined) {  // every rank that joined is found: the rest never came
      add_missing(r, n - 1);
      r = n;
      break;
    }
    if (std::chrono::steady_clock::now() >= look_until) {
      unchecked = true;
      break;
    }
    const std::string key = "rank/" + std::to_string(r);
    if (!job.store->check({key})) {
      add_missing(r, r);
      continue;
    }
    ++found;
    try {
      auto j = nlohmann::json::parse(to_string(job.store->get(key, Millis(2000))), nullptr, false);
      if (j.is_object()) {
        job.ranks.push_back(rank_info_of(r, j));
        // Which machine it is on: init-check tells a rank here whose
        // process ended from one still stuck.
        if (job.machines.size() <= static_cast<std::size_t>(r)) job.machines.resize(static_cast<std::size_t>(r) + 1);
        job.machines[static_cast<std::size_t>(r)] = j.value("machine", j.value("host", std::string()));
      }
    } catch (const Error&) {
      // Only the report's world misses it; the timeout is what to report.
    }
  }
  MissingRanks out;
  if (!ranges.empty()) out.first = ranges.front().first;
  out.text = format_rank_ranges(ranges);
  if (unchecked)
    out.text += fmt::format("{}ranks {}-{} not checked (the store answered too slowly)",
                            out.text.empty() ? "" : "; ", r, n - 1);
  return out;
}

void wait_for_ranks(Job& job) {
  const int n = job.size();
  const int me = job.rank();
  const auto deadline =
      job.rendezvous_deadline.value_or(std::chrono::steady_clock::now() + job.timeout);
  for (;;) {
    answer_hellos(job);
    if (job.store->check({"abort"})) {
      std::string why = to_string(job.store->get("abort", job.timeout));
      throw RendezvousError(why, {"rendezvous", me, -1, kWorldAbortedHint});
    }
    // A rank refused to start (its flags, its input files, its memory):
    // tell_world_of_refusal. A rank of another job on this port is not this
    // world's.
    if (job.store->check({"refused"}))
      if (const Refusal r = parse_refusal(to_string(job.store->get("refused", job.timeout)));
          r.job.empty() || job_identity().empty() || r.job == job_identity()) {
        job.world_refused = true;
        throw RendezvousError(
            fmt::format("{} refused to start, so this world cannot meet: {}",
                        r.rank >= 0 ? fmt::format("rank {}", r.rank) : std::string("a rank whose rank is not valid"),
                        r.message),
            {"rendezvous", me, r.rank,
             "fix what that rank refused (its own message says the same) and start every rank "
             "again"});
      }
    // Under ddpdiag's launcher a rank that ended before the ranks met (a
    // refusal of its own: flags, memory) is in the launcher's note at once,
    // while the launcher lets the others end on their own for --timeout.
    if (job.world.launcher == Launcher::kDdpdiag)
      if (const std::string note = launcher_note(); !note.empty() && note_rank(note) != me)
        throw RendezvousError(
            fmt::format("{} before the ranks met, so this world cannot meet", note),
            {"rendezvous", me, note_rank(note),
             "that rank's own message says why: fix it and start the run again"});
    std::int64_t joined = job.store->add("joined", 0);
    if (joined >= n) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string loopback = loopback_hint(job.world);
      if (job.server)
        if (auto problem = master_addr_problem(job.world); !problem.empty()) loopback = problem;
      // The ranks that did arrive are known: job.ranks keeps them for the
      // report's world. Once as many are found as joined, the rest are
      // missing without asking the store one rank at a time (a world of
      // 10^6 where a few ranks came); the look itself has a deadline.
      const MissingRanks missing = find_missing_ranks(job, n, joined);
      throw RendezvousError(
          fmt::format("rendezvous timed out after {:.0f} s: {} of {} ranks joined; rank(s) "
                      "that never arrived: {}",
                      job.timeout.count() / 1000.0, joined, n, missing.text.empty() ? "?" : missing.text),
          {"rendezvous", me, missing.first,
           loopback.empty()
               ? "check that every rank was started, that they all use the same MASTER_ADDR:"
                 "MASTER_PORT and WORLD_SIZE, and that the missing ranks can reach the store "
                 "(firewall, wrong interface)"
               : loopback});
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(joined + 1 >= n ? 2 : 20));
  }

  // Every hello up to here was answered: the next run's rank 0 starts after
  // them.
  if (job.rank() == 0 && job.store_root)
    job.store_root->set("hello/done", to_bytes(std::to_string(job.hellos_scanned)));

  // Everyone registered: check that they agree on the world.
  job.ranks.clear();
  job.machines.assign(n, std::string());
  job.rank_builds.assign(n, std::string());
  job.rank_libraries.assign(n, std::string());
  std::vector<std::string> disagree;
  int disagreeing = -1;  // the first other rank with another world size
  std::vector<nlohmann::json> infos(n);
  for (int r = 0; r < n; ++r) {
    auto j = nlohmann::json::parse(
        to_string(job.store->get("rank/" + std::to_string(r), job.timeout)), nullptr, false);
    if (!j.is_object()) continue;
    infos[r] = j;
    int ws = j.value("world_size", -1);
    if (ws != n) {
      disagree.push_back(fmt::format("rank {} (pid {} on {}) has world size {}", r,
                                     j.value("pid", 0L), j.value("host", ""), ws));
      if (disagreeing < 0 && r != me) disagreeing = r;
    }
    job.ranks.push_back(rank_info_of(r, j));
    job.machines[r] = j.value("machine", j.value("host", std::string()));
    job.rank_builds[r] = j.value("ddpdiag", std::string());
    job.rank_libraries[r] = j.value("library", std::string());
  }
  // Where no launcher or flag said which ranks share this host (--rank and
  // --world-size, or RANK and WORLD_SIZE alone, as on a cluster's pods),
  // every rank was taken to be on it. The machines the ranks registered
  // from say which are: a rank's local rank, and on NCCL its GPU
  // (cuda:<local rank>), is its place among the ranks of its machine, so
  // rank 1 alone on a second one-GPU machine takes cuda:0, not cuda:1.
  if (!job.world.local_rank_given && !job.world.local_world_size_given &&
      std::none_of(job.machines.begin(), job.machines.end(), [](const std::string& m) { return m.empty(); })) {
    std::map<std::string, int> placed;
    for (auto& ri : job.ranks) {
      ri.local_rank = placed[job.machines[static_cast<std::size_t>(ri.rank)]]++;
      if (job.backend == Backend::kNccl) ri.device = fmt::format("cuda:{}", ri.local_rank);
      if (ri.rank == me) job.world.local_rank = ri.local_rank;
    }
    job.world.local_world_size = placed[job.machines[static_cast<std::size_t>(me)]];
  }
  if (std::int64_t joined = job.store->add("joined", 0); joined > n)
    disagree.push_back(fmt::format("{} processes joined a world of {}", joined, n));
  // Ranks of another job that uses the same store address.
  if (infos[0].is_object()) {
    const std::string job0 = infos[0].value("job", std::string());
    std::vector<std::string> strangers;
    for (int r = 1; r < n; ++r) {
      if (!infos[r].is_object()) continue;
      const std::string jr = infos[r].value("job", std::string());
      if (!job0.empty() && !jr.empty() && jr != job0)
        strangers.push_back(fmt::format("rank {} (pid {} on {}) is from {}", r,
                                        infos[r].value("pid", 0L),
                                        infos[r].value("host", std::string()), jr));
    }
    if (!strangers.empty()) {
      std::string msg = fmt::format("ranks of different jobs met at the store {}:{} (rank 0 is from {}): ",
                                    job.world.master_addr, job.world.master_port, job0);
      for (std::size_t i = 0; i < strangers.size() && i < 8; ++i)
        msg += (i ? "; " : "") + strangers[i];
      job.store->set("abort", to_bytes(msg));
      throw RendezvousError(msg, {"rendezvous", me, -1,
                                  "two jobs use the same MASTER_ADDR:MASTER_PORT: give each job a "
                                  "port of its own (e.g. MASTER_PORT=$((20000 + SLURM_JOB_ID % "
                                  "20000)))"});
    }
  }
  if (!disagree.empty()) {
    std::string msg = fmt::format("ranks disagree on the world size (rank {} has {}): ", me, n);
    for (std::size_t i = 0; i < disagree.size(); ++i) msg += (i ? "; " : "") + disagree[i];
    job.store->set("abort", to_bytes(msg));
    throw RendezvousError(msg, {"rendezvous", me, disagreeing,
                                "start every rank with the same WORLD_SIZE / --world-size"});
  }
  // Ranks of different subcommands (a worker script whose command on one
  // node failed at once and went on to its next): say that, not every
  // option one has and the other lacks.
  if (infos[0].is_object()) {
    const std::string cmd0 = infos[0].value("command", std::string());
    std::vector<std::string> others;
    for (int r = 1; r < n; ++r) {
      const std::string c = infos[r].is_object() ? infos[r].value("command", std::string()) : "";
      if (!cmd0.empty() && !c.empty() && c != cmd0)
        others.push_back(fmt::format("rank {} (pid {} on {}) runs {}", r, infos[r].value("pid", 0L),
                                     infos[r].value("host", std::string()), c));
    }
    if (!others.empty()) {
      std::string msg = fmt::format("ranks run different subcommands: rank 0 runs {}, ", cmd0);
      for (std::size_t i = 0; i < others.size() && i < 8; ++i) msg += (i ? "; " : "") + others[i];
      job.store->set("abort", to_bytes(msg));
      throw RendezvousError(msg, {"rendezvous", me, -1,
                                  "every rank must run the same ddpdiag command; under a launcher, "
                                  "an earlier command that failed on one node lets that node go on "
                                  "to the next one: check each node's earlier output"});
    }
  }
  // --json / --markdown are each rank's own (rank 0 writes the job's
  // report), so ranks may differ there; but given to other ranks and not to
  // rank 0, no report is written, which the user should hear of.
  if (infos[0].is_object() && !infos[0].value("reports", true)) {
    std::string with;
    for (int r = 1; r < n; ++r)
      if (infos[r].is_object() && infos[r].value("reports", false))
        with += (with.empty() ? "" : ", ") + std::to_string(r);
    if (!with.empty() && (me == 0 || g_rank_reports))
      std::fprintf(stderr,
                   "ddpdiag: warning on rank %d: rank(s) %s were given --json or --markdown and "
                   "rank 0 was not; rank 0 writes the job's report, so none will be written: "
                   "give the same --json to every rank\n",
                   me, with.c_str());
  }
  if (auto diff = settings_differences(infos); !diff.empty()) {
    std::string msg = "ranks were started with different settings: ";
    for (std::size_t i = 0; i < diff.size() && i < 8; ++i) msg += (i ? "; " : "") + diff[i];
    if (diff.size() > 8) msg += fmt::format("; and {} more", diff.size() - 8);
    job.store->set("abort", to_bytes(msg));
    throw RendezvousError(msg, {"rendezvous", me, -1,
                                "start every rank with the same subcommand flags (the ranks "
                                "would run different collectives, and one could pass while "
                                "its peers hang); under a launcher, pass the flags once to "
                                "the command it starts"});
  }
  // From here the ranks on this machine are known: a SIGTERM from torchrun
  // while the backend starts (a peer here failed in its own init) names
  // that peer rather than calling this rank interrupted.
  publish_local_peers(job);
}

namespace {
// This rank 0 found the store's port taken. When a ddpdiag rank 0 serves
// there (a second process given rank 0: two ranks with RANK=0, an MPI
// launcher's ranks reading the allocation's SLURM_PROCID=0), say so: the
// port is not taken by some other job. The first rank 0 of the same job is
// told too, through the store's "abort", so it stops at once instead of
// waiting --timeout for a rank that never comes. Throws the finding; returns
// where the port is held by anything else (which the caller's error says).
void name_the_other_rank_0(const Job& job) {
  nlohmann::json other;
  std::shared_ptr<Store> store;
  try {
    TcpStoreClientOptions co;
    co.host = "127.0.0.1";
    co.port = job.world.master_port;
    co.connect_timeout = Millis(2000);
    co.io_timeout = Millis(2000);
    co.rank = job.world.rank;
    store = std::make_shared<PrefixStore>("ddpdiag", std::make_shared<TcpStoreClient>(co));
    if (!store->check({"rank/0"})) {
      // Another program's store (a torch job's TCPStore on the default
      // port): this job's other ranks reach it and would wait --timeout
      // for a rank 0 that never registers. Tell them there, under ddpdiag's
      // own prefix, as a rank that refused to start does.
      if (job.world.world_size > 1 && !store->check({"refused"}))
        store->set("refused",
                   to_bytes(refusal_text(
                       0, fmt::format("rank 0 cannot serve the store: port {} is taken by another "
                                      "program, which answers as a store (this job's other ranks "
                                      "reached that program's store, not rank 0's)",
                                      job.world.master_port))));
      return;
    }
    other = nlohmann::json::parse(to_string(store->get("rank/0", Millis(2000))), nullptr, false);
  } catch (const std::exception&) {
    return;  // not a store that answers, or not ddpdiag's: the port is taken, as said
  }
  if (!other.is_object()) return;
  const long pid = other.value("pid", 0L);
  const std::string host = other.value("host", std::string("?"));
  const std::string other_job = other.value("job", std::string());
  const std::string mine = job_identity();
  if (!mine.empty() && other_job == mine) {
    const std::string msg = fmt::format(
        "rank 0 is claimed twice: by pid {} on host {}, which serves the store on port {}, and by "
        "pid {} on host {} ({})",
        pid, host, job.world.master_port, static_cast<long>(getpid()), machine_name(), mine);
    try {
      store->set("abort", to_bytes(msg));
    } catch (const std::exception&) {
      // The other rank 0 then waits for its missing ranks as before.
    }
    throw RendezvousError(msg, {"store.serve", 0, 0,
                                "two processes were given rank 0; check RANK / --rank / the launcher's "
                                "rank variables (under mpirun inside a Slurm allocation, every rank "
                                "inherits SLURM_PROCID=0: ddpdiag reads mpirun's own)"});
  }
  throw RendezvousError(
      fmt::format("port {} is held by the store of another ddpdiag rank 0 (pid {} on host {}{}), while "
                  "this process (pid {}{}) is rank 0 too",
                  job.world.master_port, pid, host, other_job.empty() ? "" : ", " + other_job,
                  static_cast<long>(getpid()), mine.empty() ? "" : ", " + mine),
      {"store.serve", 0, -1,
       !mine.empty() && !other_job.empty()
           ? std::string("that is another job (the job names differ): give each job a MASTER_PORT of "
                         "its own")
           : std::string("if that process belongs to this job, two processes were given rank 0 (check "
                         "RANK / the launcher's rank variables); else give each job a MASTER_PORT of "
                         "its own")});
}
}  // namespace

bool store_port_taken(const Error& e) {
  return std::string_view(e.what()).find("address already in use") != std::string_view::npos;
}

void host_store(Job& job) {
  if (job.world.world_size == 1 && !job.world.agent_store) return;
  if (!job.world.hosts_store()) return;
  TcpStoreServerOptions so;
  so.port = job.world.master_port;
  so.on_out_of_fds = [rank = job.world.rank](const std::string& what) {
    fmt::print(stderr, "[rank {}] ddpdiag: the store this rank hosts: {}\n", rank, what);
  };
  // Every address of this host, IPv6 and IPv4 alike (as torch's server):
  // MASTER_ADDR may name rank 0 by either.
  so.host = every_address();
  try {
    job.server = std::make_unique<TcpStoreServer>(so);
  } catch (Error& e) {
    e.context().rank = job.world.rank;
    if (e.context().phase.empty()) e.context().phase = "store.serve";
    if (store_port_taken(e)) name_the_other_rank_0(job);
    throw;
  }
}

std::shared_ptr<Store> connect_store(Job& job, const CommonOptions& o,
                                     std::optional<Millis> connect_timeout) {
  std::shared_ptr<Store> base;
  if (job.world.world_size == 1 && !job.world.agent_store) {
    base = std::make_shared<MemoryStore>();
  } else {
    TcpStoreClientOptions co;
    co.host = job.world.hosts_store() ? std::string("127.0.0.1") : job.world.master_addr;
    co.port = job.world.master_port;
    co.protocol = parse_store_protocol(o.store_protocol);
    co.connect_timeout = connect_timeout.value_or(job.timeout);
    co.io_timeout = job.timeout;
    co.rank = job.world.rank;
    co.connected_at_out = &job.store_connected_at;
    // Our own server when rank 0 hosts it or ddpdiag's launcher does; under
    // an agent store of unknown make, get() keeps c10d's WAIT + GET.
    co.one_trip_get = !job.world.agent_store || job.world.launcher == Launcher::kDdpdiag;
    try {
      base = std::make_shared<TcpStoreClient>(co);
    } catch (RendezvousError& e) {
      if (!job.world.hosts_store())
        if (auto hint = loopback_hint(job.world); !hint.empty()) e.context().hint = hint;
      throw;
    }
    job.store_client = co;
    // Copies connect from other threads (the watchdog's own connection):
    // only this connection writes when it connected.
    job.store_client->connected_at_out = nullptr;
  }
  // Our keys live under our own prefix, so we never collide with other store
  // users (under an agent's store, under the run the ranks agree on too:
  // register_rank).
  job.store = std::make_shared<PrefixStore>("ddpdiag", base);
  return base;
}

namespace {

// The prefix every key of this job lives under (job.store's).
std::string job_store_prefix(const Job& job) {
  return std::static_pointer_cast<PrefixStore>(job.store)->prefix();
}

// A connection of its own to the job's store, under the job's prefix: for a
// thread (the watchdog, the init's watch for a failed peer) that must not
// queue behind the main thread's waits on job.store.
std::shared_ptr<Store> connect_own_store(TcpStoreClientOptions client, const std::string& prefix,
                                         Millis connect_timeout, Millis io_timeout) {
  client.connect_timeout = connect_timeout;
  client.io_timeout = io_timeout;
  client.known_store = true;  // the job's main connection got its answers
  return std::make_shared<PrefixStore>(prefix, std::make_shared<TcpStoreClient>(client));
}

}  // namespace

void create_communicator(Job& job, const CommonOptions& o) {
  const int me = job.world.rank;
  std::vector<Fault> faults;
  try {
    if (!o.inject_fault.empty()) faults = parse_faults(o.inject_fault);
  } catch (const std::invalid_argument& e) {
    throw UsageError(fmt::format("--inject-fault: {}", e.what()),
                     {"flags", me, -1, "see comm/monitor.h for the fault syntax"});
  }
  CommOptions co;
  co.backend = job.backend;
  co.rank = me;
  co.world_size = job.world.world_size;
  co.local_rank = job.world.local_rank;
  co.store = std::make_shared<PrefixStore>("comm", job.store);
  co.timeout = job.timeout;
  co.gloo_interface = o.gloo_interface;
  co.gloo_threads = o.gloo_threads;
  co.spans_hosts = std::any_of(job.machines.begin(), job.machines.end(), [&](const std::string& m) {
    return !m.empty() && !job.machines.front().empty() && m != job.machines.front();
  });
  // Ranks wait in their backend's init for each other: one whose backend
  // cannot start (a bad interface, no GPU) posts "backend_failed", and the
  // others, polling it over a connection of their own (the init is using
  // job.store), stop at once instead of at --timeout.
  struct Watch {
    std::shared_ptr<Store> store;
    bool broken = false;
    bool aborted = false;  // the world was called off ("abort")
  };
  auto watch = std::make_shared<Watch>();
  // The watch's connection is for the init only: closed once it is over.
  struct CloseWatch {
    std::shared_ptr<Watch> w;
    ~CloseWatch() {
      w->store.reset();
      w->broken = true;
    }
  } close_watch{watch};
  if (job.store_client) {
    const Millis io = std::min(job.timeout, Millis(2000));
    co.peer_failure = [watch, client = *job.store_client, prefix = job_store_prefix(job),
                       io]() -> std::optional<CommOptions::PeerFailure> {
      if (watch->broken) return std::nullopt;
      try {
        if (!watch->store) watch->store = connect_own_store(client, prefix, io, io);
        // A rank that found the world inconsistent after this one had met
        // its peers (a second rank 0 named by the first) posts "abort":
        // the peer it names will never come to the init.
        if (watch->store->check({"abort"})) {
          CommOptions::PeerFailure f;
          f.message = to_string(watch->store->get("abort", io));
          f.world_aborted = true;
          watch->aborted = true;
          return f;
        }
        if (!watch->store->check({"backend_failed"})) return std::nullopt;
        // "<rank>\n<message>", as posted below.
        const std::string posted = to_string(watch->store->get("backend_failed", io));
        const auto nl = posted.find('\n');
        CommOptions::PeerFailure f;
        f.message = nl == std::string::npos ? posted : posted.substr(nl + 1);
        try {
          f.rank = std::stoi(posted.substr(0, nl));
        } catch (const std::exception&) {
          f.rank = -1;
        }
        return f;
      } catch (const Error&) {
        watch->broken = true;  // the init's own deadline still holds
        return std::nullopt;
      }
    };
  }
  job.comm_options = co;
  std::unique_ptr<Communicator> inner;
  try {
    inner = make_communicator(co);
  } catch (const Error& e) {
    // Only a rank whose own backend failed posts: one that stopped because
    // another did (a PeerError) has nothing to add.
    if (!dynamic_cast<const PeerError*>(&e) && !watch->aborted) {
      try {
        job.store->set("backend_failed", to_bytes(fmt::format("{}\n{}", me, e.what())));
      } catch (const Error&) {
      }
    }
    throw;
  }
  inner->set_default_timeout(job.timeout);
  // No rank goes on until every rank has its connections up. Otherwise a rank
  // that fails at once (a bad flag, a bad model file) exits while a peer's
  // Gloo is still finishing the handshake with it, and Gloo's own thread
  // aborts that peer's process (getpeername on the closed socket) before it
  // can report anything.
  inner->barrier()->wait(job.timeout);

  // The watchdog talks to the store over a connection of its own, so a main
  // thread blocked in a store wait never delays it.
  MonitorOptions mo;
  mo.rank = me;
  mo.size = job.world.world_size;
  // Bounds every store call of the watchdog (I/O of its own connection) and
  // its wait for the other ranks' states: a store that has become unreachable
  // costs the failure path one such deadline, not --timeout.
  const Millis monitor_deadline =
      std::clamp(Millis(job.timeout.count() / 4), Millis(1000), Millis(5000));
  std::shared_ptr<Store> monitor_base = job.store;
  if (job.store_client) {
    mo.store_address = fmt::format("{}:{}", job.world.hosts_store() ? std::string("127.0.0.1")
                                                                    : job.world.master_addr,
                                   job.store_client->port);
    monitor_base = connect_own_store(*job.store_client, job_store_prefix(job),
                                     std::min(job.timeout, Millis(10000)), monitor_deadline);
  }
  mo.store = std::make_shared<PrefixStore>("monitor", monitor_base);
  mo.store_host_rank = job.world.agent_store ? -1 : 0;
  mo.timeout = job.timeout;
  mo.gather_wait = monitor_deadline;
  // A peer on another machine that stops its heartbeat (killed with its
  // connections closed but not reset, frozen, its host gone) may never make
  // the backend fail: after a quarter of --timeout (10 s at least) of
  // silence the collective ends. Only where that comes well before the
  // deadline.
  if (const Millis stall = std::max(Millis(10000), Millis(job.timeout.count() / 4));
      stall + Millis(5000) <= job.timeout)
    mo.heartbeat_stall = stall;
  mo.desync_check = o.desync_check;
  mo.faults = std::move(faults);
  const std::string here = machine_id();
  for (const auto& r : job.ranks) {
    MonitorOptions::Peer p;
    p.host = r.host;
    p.pid = r.pid;
    p.same_machine = r.rank < static_cast<int>(job.machines.size()) &&
                     job.machines[r.rank] == here;
    mo.peers.push_back(p);
  }
  mo.host = reported_host_name(o, me);
  auto monitored = std::make_unique<MonitoredCommunicator>(std::move(inner), std::move(mo));
  job.monitor = monitored.get();
  job.comm = std::move(monitored);
}

std::string requested_device(const Job& job) {
  return job.backend == Backend::kNccl ? fmt::format("cuda:{}", job.world.local_rank)
                                       : std::string("cpu");
}

void record_known_world(const Job& job, const CommonOptions& o, reports::Report& report) {
  if (!job.world_known) return;
  std::vector<reports::RankInfo> ranks = job.ranks;
  if (std::none_of(ranks.begin(), ranks.end(),
                   [&](const reports::RankInfo& r) { return r.rank == job.rank(); })) {
    ranks.push_back({job.rank(), job.world.local_rank, reported_host_name(o, job.rank()),
                     static_cast<int>(getpid()), requested_device(job), ""});
    std::sort(ranks.begin(), ranks.end(),
              [](const reports::RankInfo& a, const reports::RankInfo& b) { return a.rank < b.rank; });
  }
  // The library this process runs, whether or not its communicator came up
  // ("" where the backend is not built in).
  std::map<std::string, std::string> libs;
  const std::string version =
      job.comm ? job.comm->library_version() : backend_library_version(job.backend);
  if (!version.empty()) libs[job.backend == Backend::kNccl ? "nccl" : "gloo"] = version;
  report.set_world(job.size(), std::string(backend_name(job.backend)),
                   std::string(launcher_name(job.world.launcher)), ranks, libs);
  if (job.backend == Backend::kGloo) report.set_gloo_threads(o.gloo_threads);
  // An all-gather before every collective: what each timed collective costs
  // changes, so report compare reads it as a setting.
  report.set_world_field("desync_check", o.desync_check);
  // Under torchrun: which of this node's restarts the report comes from, and
  // the run its ranks met in (the keys' run/<N> in the agent's store).
  if (job.world.restart_count >= 0) report.set_world_field("restart_count", job.world.restart_count);
  if (job.store_run > 0) report.set_world_field("store_run", job.store_run);
}

namespace {

// The world of this rank from flags and environment, and its backend.
void discover_job(Job& job, const CommonOptions& o) {
  job.world = discover_world(o.world, process_env());
  g_rank.store(job.world.rank, std::memory_order_relaxed);
  job.backend = choose_backend(o);
  job.timeout = Millis(static_cast<std::int64_t>(o.timeout_s * 1000));
  job.world_known = true;
  // Rank 0 writes the job's report: a path it cannot write fails now, not
  // after the measurement.
  if (job.world.rank == 0) {
    check_report_outputs(o);
    return;
  }
  // Another rank writes its own report (FILE.rank<R>.json) only when it
  // fails apart from rank 0. Its host may not have rank 0's directory (one
  // command line for every node): a warning now, not a refusal, rather than
  // a report lost at the failure.
  for (const auto& [flag, path, ext] : {std::tuple<const char*, const std::string&, const char*>{
                                            "--json", o.json_path, ".json"},
                                        {"--markdown", o.markdown_path, ".md"}}) {
    const std::string own = rank_report_path(path, ext, job.world.rank);
    if (auto problem = reports::output_path_problem(own))
      std::fprintf(stderr,
                   "ddpdiag: warning on rank %d: %s %s: should this rank fail on its own, it could "
                   "not write its report %s: %s\n",
                   job.world.rank, flag, path.c_str(), own.c_str(), problem->c_str());
  }
}

// The interfaces other than `used` by which this host's routes send the
// traffic to peers on other hosts (peers: rank -> the address its backend
// listens at): a peer whose address is this host's own is on this host.
std::vector<reports::RankInfo::Egress> egress_of(const std::string& used,
                                                 const std::map<int, std::string>& peers) {
  std::vector<reports::RankInfo::Egress> out;
  if (used.empty() || peers.empty()) return out;
  std::map<std::string, std::vector<int>> by_address;
  // A link-local IPv6 address has a route on every link: without its zone
  // the kernel's answer would name any of them.
  for (const auto& [peer, ip] : peers)
    if (!is_link_local(ip)) by_address[ip].push_back(peer);
  std::vector<std::string> ips;
  for (const auto& [ip, ranks] : by_address) ips.push_back(ip);
  const auto routes = routes_to(ips);
  std::map<std::string, reports::RankInfo::Egress> ways;  // by interface, so in name order
  for (std::size_t i = 0; i < ips.size(); ++i) {
    const auto& route = routes[i];
    if (!route || route->local || route->interface.empty() || route->interface == used) continue;
    auto& way = ways[route->interface];
    if (way.gateway.empty()) way.gateway = route->gateway;
    const auto& ranks = by_address[ips[i]];
    way.peers.insert(way.peers.end(), ranks.begin(), ranks.end());
  }
  for (auto& [name, way] : ways) {
    way.interface = name;
    way.speed_mbps = link_speed_mbps(name).value_or(-1);
    std::sort(way.peers.begin(), way.peers.end());
    out.push_back(std::move(way));
  }
  return out;
}

// An egress entry of results.rank_network (and of the network round).
nlohmann::json egress_json(const reports::RankInfo::Egress& e) {
  return {{"interface", e.interface},
          {"speed_mbps", e.speed_mbps > 0 ? nlohmann::json(e.speed_mbps) : nullptr},
          {"gateway", e.gateway.empty() ? nullptr : nlohmann::json(e.gateway)},
          {"ranks", format_cpu_list(e.peers)},
          {"rank_count", e.peers.size()}};
}

// What this rank tells rank 0 about its network: the interface holding
// the address its backend listens on, that link's speed, a faster
// interface of this host if there is one, and the interfaces other than
// that one its routes to peers leave by. null when the backend does not
// say where it listens (NCCL).
nlohmann::json network_of(const std::string& listen_ip, const std::map<int, std::string>& peers) {
  if (listen_ip.empty()) return nullptr;
  const auto interfaces = host_interfaces();
  const std::string used = interface_with_address(interfaces, listen_ip);
  nlohmann::json net = {{"interface", used}, {"address", listen_ip}, {"speed_mbps", nullptr}};
  for (const auto& e : egress_of(used, peers)) net["egress"].push_back(egress_json(e));
  const NetInterface* in_use = nullptr;
  for (const auto& i : interfaces)
    if (i.name == used) in_use = &i;
  if (!in_use || in_use->loopback || !in_use->speed_mbps) return net;
  net["speed_mbps"] = *in_use->speed_mbps;
  const NetInterface* faster = nullptr;
  for (const auto& i : interfaces)
    if (!i.loopback && i.speed_mbps && *i.speed_mbps > *in_use->speed_mbps &&
        (!faster || *i.speed_mbps > *faster->speed_mbps))
      faster = &i;
  if (faster)
    net["faster"] = {{"interface", faster->name},
                     {"speed_mbps", *faster->speed_mbps},
                     {"networks", faster->networks}};
  // So that rank 0 can tell whether the other hosts are on that network.
  nlohmann::json addresses = nlohmann::json::array();
  for (const auto& i : interfaces)
    if (!i.loopback)
      for (const auto& a : i.addresses)
        if (!is_link_local(a)) addresses.push_back(a);
  net["host_addresses"] = addresses;
  return net;
}

}  // namespace

std::string network_text(const std::string& iface, const std::string& ip, int speed_mbps) {
  return fmt::format("{} {}{}", iface.empty() ? "?" : iface, ip,
                     speed_mbps > 0 ? " (" + format_link_speed(speed_mbps) + ")" : "");
}

std::string rank_network_text(const reports::RankInfo& r, bool gateways) {
  if (r.net_address.empty()) return "";
  std::string out = network_text(r.net_interface, r.net_address, r.net_speed_mbps);
  for (const auto& e : r.egress)
    out += fmt::format(", to {} {} by {}{}{}", e.peers.size() == 1 ? "rank" : "ranks", format_cpu_list(e.peers),
                       e.interface, e.speed_mbps > 0 ? " (" + format_link_speed(e.speed_mbps) + ")" : "",
                       gateways && !e.gateway.empty() ? " via gateway " + e.gateway : "");
  return out;
}

namespace {

// Sets up store and communicator for this rank, once discover_job has run.
void start_job(Job& job, const CommonOptions& o) {
  host_store(job);
  connect_store(job, o);
  register_rank(job, requested_device(job), reported_host_name(o, job.world.rank));
  wait_for_ranks(job);
  collect_warnings(job);
  create_communicator(job, o);
  gather_rank_devices(job);
}

}  // namespace

void gather_rank_devices(Job& job) {
  // Record the device each rank's backend actually chose.
  auto devices = job.gather_to_root("device", job.comm->device_name());
  for (std::size_t r = 0; r < devices.size() && r < job.ranks.size(); ++r)
    if (devices[r].is_string()) job.ranks[r].device = devices[r].get<std::string>();
  // And, on Gloo, the network interface its traffic to other hosts goes
  // over (a key of its own, so that "device" keeps what every build writes
  // there; NCCL does not say where it listens, so it skips the round).
  if (job.backend != Backend::kGloo) return;
  const auto mine = network_of(job.comm->listen_address(), job.comm->peer_addresses());
  auto nets = job.gather_to_root("network", mine);
  // Rank 0 learns every rank's; the others keep their own (init-check shows it).
  if (job.rank() != 0 && job.rank() < static_cast<int>(job.ranks.size())) {
    nets.assign(job.ranks.size(), nullptr);
    nets[job.rank()] = mine;
  }
  const auto text = [](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j[key].is_string() ? j[key].get<std::string>() : std::string();
  };
  const auto mbps = [](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j[key].is_number_integer() ? j[key].get<int>() : -1;
  };
  const auto texts = [](const nlohmann::json& j, const char* key) {
    std::vector<std::string> out;
    if (j.contains(key) && j[key].is_array())
      for (const auto& x : j[key])
        if (x.is_string()) out.push_back(x.get<std::string>());
    return out;
  };
  for (std::size_t r = 0; r < nets.size() && r < job.ranks.size(); ++r) {
    const auto& net = nets[r];
    if (!net.is_object()) continue;
    auto& info = job.ranks[r];
    info.net_interface = text(net, "interface");
    info.net_address = text(net, "address");
    info.net_speed_mbps = mbps(net, "speed_mbps");
    info.host_addresses = texts(net, "host_addresses");
    if (net.contains("faster") && net["faster"].is_object()) {
      info.faster_interface = text(net["faster"], "interface");
      info.faster_speed_mbps = mbps(net["faster"], "speed_mbps");
      info.faster_networks = texts(net["faster"], "networks");
    }
    if (net.contains("egress") && net["egress"].is_array())
      for (const auto& e : net["egress"]) {
        if (!e.is_object()) continue;
        reports::RankInfo::Egress way{text(e, "interface"), mbps(e, "speed_mbps"), text(e, "gateway"), {}};
        try {
          way.peers = parse_cpu_list(text(e, "ranks"));
        } catch (const std::invalid_argument&) {
          continue;  // a peer's odd value: left out, not a reason to fail the job
        }
        if (!way.interface.empty()) info.egress.push_back(std::move(way));
      }
  }
  if (job.rank() == 0)
    for (auto& w : network_warnings(job.ranks, job.machines)) {
      std::fprintf(stderr, "ddpdiag: warning: %s\n", w.detail.c_str());
      job.warnings.push_back(std::move(w));
    }
}

// Rank 0 hosts the store in-process; it must outlive every other rank's last
// use of it. Each rank counts itself out; rank 0 waits (bounded) for all.
// After an error the wait is short: it only gives the others time to read the
// cause (the "abort" key) before the store goes away.
//
// Ranks the watchdog found gone (dead, stopped, unreachable) never count
// themselves out, so they are not waited for; and a rank whose watchdog lost
// the store does not touch it again (each call would wait out its deadline).
namespace {

// The ranks the watchdog's diagnosis found gone (dead, stopped, cut off);
// none before a failure.
std::vector<int> gone_ranks(const Job& job) {
  std::vector<int> out;
  if (!job.monitor) return out;
  const auto failure = job.monitor->failure_report();
  if (failure.is_object() && failure.contains("diagnosis"))
    for (const auto& r : failure["diagnosis"].value("gone_ranks", nlohmann::json::array()))
      out.push_back(r.get<int>());
  return out;
}

}  // namespace

void leave_job(Job& job, bool after_error) {
  // A rank that never joined (a second claimant of a rank, turned away at
  // registration) is not among those rank 0 waits for: counting it would
  // let rank 0 close the store before a rank that did join has read why.
  if (!job.store || !job.joined) return;
  if (job.monitor && job.monitor->store_lost()) return;
  const auto absent = static_cast<std::int64_t>(gone_ranks(job).size());
  try {
    job.store->add("left", 1);
    if (job.server) {
      // Only ranks that joined can still need the store: after a rendezvous
      // that timed out, the missing ones are not waited for a second time.
      const std::int64_t expected =
          std::min<std::int64_t>(job.size() - absent, job.store->add("joined", 0));
      auto bound = std::min(job.timeout, Millis(after_error ? 3000 : 10000));
      auto deadline = std::chrono::steady_clock::now() + bound;
      while (job.store->add("left", 0) < expected &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const Error&) {
    // The job is over; a store that went away now changes nothing.
  }
}

reports::ErrorInfo to_error_info(const Error& e) {
  const auto& c = e.context();
  return {e.kind(), e.what(), c.phase, c.rank, c.peer, c.hint, static_cast<int>(e.exit_code())};
}

namespace {

// Watches one peer while this rank waits at the store for something only
// that peer can post (its results, rank 0's verdict). check() throws a
// PeerError naming it once it has posted an error of its own (error/<r>),
// its process is gone from this machine, or its watchdog's heartbeat has
// stood still a quarter of --timeout (10 s at least; the watchdog's own
// rule, and only where that comes well before --timeout): it is dead,
// frozen or cut off.
class PeerWatch {
 public:
  // store: where to look (default the job's; under the job's prefix).
  PeerWatch(Job& job, int peer, std::string phase, std::string what,
            std::shared_ptr<Store> store = nullptr)
      : job_(job), peer_(peer), phase_(std::move(phase)), what_(std::move(what)),
        store_(store ? std::move(store) : job.store), stall_(stall_of(job)),
        watch_heartbeat_(job.monitor && stall_ + Millis(5000) <= job.timeout),
        heartbeat_key_(fmt::format("monitor/heartbeat/{}", peer)),
        since_(std::chrono::steady_clock::now()) {}

  // How long a heartbeat may stand still before its rank is taken for gone.
  static Millis stall_of(const Job& job) {
    return std::max(Millis(10000), Millis(job.timeout.count() / 4));
  }

  void check() {
    Store& store = *store_;
    const std::string failed = fmt::format("error/{}", peer_);
    if (store.check({failed}))
      throw PeerError(fmt::format("rank {} failed {}: {}", peer_, what_,
                                  to_string(store.get(failed, job_.timeout))),
                      {phase_, job_.rank(), peer_,
                       fmt::format("rank {}'s own error, in its log, is the cause", peer_)});
    if (const std::string who = local_peer_gone(peer_); !who.empty())
      throw PeerError(fmt::format("{} {}", who, what_),
                      {phase_, job_.rank(), peer_,
                       "it was killed or crashed: its log, and the kernel's (dmesg: the OOM "
                       "killer), say why"});
    if (!watch_heartbeat_ || !store.check({heartbeat_key_})) return;
    const std::string now_heartbeat = to_string(store.get(heartbeat_key_, job_.timeout));
    const auto now = std::chrono::steady_clock::now();
    if (now_heartbeat != heartbeat_) {
      heartbeat_ = now_heartbeat;
      since_ = now;
    } else if (now - since_ >= stall_) {
      throw PeerError(
          fmt::format("rank {} wrote no heartbeat for {:.0f} s {}: it is dead, frozen (stopped) "
                      "or cut off from the store",
                      peer_, std::chrono::duration<double>(now - since_).count(), what_),
          {phase_, job_.rank(), peer_, fmt::format("look at rank {}'s host and log", peer_)});
    }
  }

 private:
  Job& job_;
  int peer_;
  std::string phase_, what_;
  std::shared_ptr<Store> store_;
  Millis stall_;
  bool watch_heartbeat_;
  std::string heartbeat_key_;
  std::string heartbeat_;
  std::chrono::steady_clock::time_point since_;
};

}  // namespace

std::vector<nlohmann::json> Job::gather_to_root(const std::string& key,
                                                const nlohmann::json& mine) {
  // Not the start-up gathers (gather_rank_devices): the fault is the
  // command's own hand-over.
  if (monitor && key != "device" && key != "network") {
    if (monitor->fault_on_gather(Fault::Kind::kGather))
      throw BackendError(fmt::format("injected fault: rank {} failed as it handed its results ({}) "
                                     "to rank 0",
                                     rank(), key),
                         {"gather", rank(), -1, "a test's fault (--inject-fault gather@rank=R)"});
    if (monitor->fault_on_gather(Fault::Kind::kGatherExit)) ::kill(::getpid(), SIGKILL);
    if (monitor->fault_on_gather(Fault::Kind::kGatherHang)) ::kill(::getpid(), SIGSTOP);
  }
  store->set(fmt::format("gather/{}/{}", key, rank()), to_bytes(mine.dump()));
  std::vector<nlohmann::json> out;
  if (rank() != 0) return out;
  for (int r = 0; r < size(); ++r) {
    // In slices: a rank that failed before handing its part over (an error
    // of its own after its last collective, a crash, the OOM killer, a
    // freeze) is named at once, not waited for until --timeout.
    const std::string part = fmt::format("gather/{}/{}", key, r);
    PeerWatch watch(*this, r, "gather", "before handing its results to rank 0");
    wait_in_slices(*store, part, std::chrono::steady_clock::now() + timeout, [&] { watch.check(); });
    out.push_back(nlohmann::json::parse(to_string(store->get(part, timeout))));
  }
  return out;
}

void Job::progress_line(const std::string& line) const {
  if (progress && world.rank == 0) std::fprintf(stderr, "%s\n", line.c_str());
}

void check_report_outputs(const CommonOptions& o) { check_report_outputs(o.json_path, o.markdown_path); }

bool report_outputs_refused(const std::string& json_path, const std::string& markdown_path) {
  return reports::same_file(json_path, markdown_path) || reports::output_path_problem(json_path) ||
         reports::output_path_problem(markdown_path);
}

void check_report_outputs(const std::string& json_path, const std::string& markdown_path) {
  if (reports::same_file(json_path, markdown_path))
    throw UsageError(fmt::format("--json and --markdown name the same file ({}): one would "
                                 "overwrite the other",
                                 json_path),
                     {"flags", -1, -1, "give each its own path, e.g. --json out.json --markdown out.md"});
  for (const auto& [flag, path] : {std::pair<const char*, const std::string&>{"--json", json_path},
                                   {"--markdown", markdown_path}})
    if (auto problem = reports::output_path_problem(path))
      throw UsageError(fmt::format("{} {}: cannot write the report there: {}", flag, path, *problem),
                       {"flags", current_rank(), -1,
                        "give a path that can be written: an existing, writable directory, "
                        "and not a read-only file (checked before anything is measured)"});
}

namespace {
// A model layout given as a pipe (--model <(...)) to the built-in launcher:
// every rank would open the one pipe, and all but the first would find it
// empty. The launcher reads it once into a file of its own, which the ranks
// read instead, and removes that file when they are done (a launcher killed
// by SIGKILL leaves it in TMPDIR).
class PipedModelFile {
 public:
  PipedModelFile() = default;
  PipedModelFile(const PipedModelFile&) = delete;
  PipedModelFile& operator=(const PipedModelFile&) = delete;
  ~PipedModelFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }

  // Replaces a --model value naming a pipe or FIFO in `args` with the path
  // of a file holding what it gave.
  void take_from(std::vector<std::string>& args) {
    for (std::size_t i = 0; i < args.size(); ++i) {
      std::string* value = nullptr;
      std::string prefix;
      if (args[i] == "--model" && i + 1 < args.size()) {
        value = &args[i + 1];
      } else if (args[i].rfind("--model=", 0) == 0) {
        value = &args[i];
        prefix = "--model=";
      }
      if (!value) continue;
      const std::string path = value->substr(prefix.size());
      struct stat st {};
      if (::stat(path.c_str(), &st) != 0 || !S_ISFIFO(st.st_mode)) continue;
      std::string text;
      try {
        text = read_input_file(path, std::size_t{256} << 20);
      } catch (const InputFileError& e) {
        throw UsageError(fmt::format("--model '{}': {}", path, e.what()),
                         {"flags", -1, -1, "give the layout as a file: python ... > layout.json"});
      }
      // Checked here, where its errors can name the pipe, and copied in the
      // object form with the pipe's name (as the ranks would name it).
      ddp_core::ModelLayout layout = ddp_core::parse_model_layout_json(text, path);
      if (path_.empty()) path_ = write_copy(ddp_core::model_layout_to_json(layout));
      *value = prefix + path_;
    }
  }

 private:
  static std::string write_copy(const std::string& text) {
    const char* dir = std::getenv("TMPDIR");
    std::string name = std::string(dir && *dir ? dir : "/tmp") + "/ddpdiag-model-XXXXXX.json";
    const int fd = ::mkstemps(name.data(), 5);
    if (fd < 0)
      throw UsageError(fmt::format("--model: the layout came through a pipe, and the launcher cannot "
                                   "keep a copy for its ranks in {}: {}",
                                   name.substr(0, name.rfind('/')), std::strerror(errno)),
                       {"flags", -1, -1, "give the layout as a file, or set TMPDIR to a writable directory"});
    ::close(fd);  // the name is ours; the writer fills it whole or not at all
    try {
      reports::write_file_atomic(name, text);
    } catch (const reports::WriteError& e) {
      ::unlink(name.c_str());
      throw UsageError(fmt::format("--model: cannot keep the piped layout for the ranks: {}", e.what()),
                       {"flags", -1, -1, "give the layout as a file, or set TMPDIR to a writable directory"});
    }
    return name;
  }

  std::string path_;
};

std::optional<int> launch_if_asked_unreported(const CommonOptions& o) {
  auto env = process_env();
  const bool under_launcher = launched_by_launcher(env);
  const bool explicit_world = o.world.rank.has_value() || o.world.world_size.has_value();
  const bool builtin = o.nproc > 0 || (!under_launcher && !explicit_world);
  if (builtin) {
    // --nproc starts a world of its own: it hosts the store and gives every
    // rank its rank, sizes and store address. Flags that set those would
    // override what it gives each rank (and meet its checks as a variable
    // the user never set), so they cannot go with it.
    std::vector<std::string> clash;
    if (o.world.rank) clash.push_back("--rank");
    if (o.world.world_size) clash.push_back("--world-size");
    if (o.world.local_rank) clash.push_back("--local-rank");
    if (o.world.local_world_size) clash.push_back("--local-world-size");
    if (o.world.master_addr) clash.push_back("--master-addr");
    if (o.world.master_port) clash.push_back("--master-port");
    if (!clash.empty()) {
      std::string list;
      for (std::size_t i = 0; i < clash.size(); ++i)
        list += (i == 0 ? "" : i + 1 == clash.size() ? " and " : ", ") + clash[i];
      // Without --nproc: no launcher and no --rank/--world-size, so ddpdiag
      // starts the default world itself, and the same holds.
      if (o.nproc <= 0)
        throw UsageError(
            fmt::format("{} cannot be used without --rank and --world-size: with neither a "
                        "launcher nor those flags, ddpdiag starts a world of its own on this "
                        "machine (it hosts the store on a free port and sets each rank's rank "
                        "and sizes)",
                        list),
            {"flags", -1, -1,
             fmt::format("drop {} to let ddpdiag start its local ranks, or give --rank and "
                         "--world-size (or RANK and WORLD_SIZE) to run one rank of a world you "
                         "start yourself",
                         list)});
      throw UsageError(
          fmt::format("--nproc {} cannot be combined with {}: --nproc starts a world of its own "
                      "on this machine (it hosts the store and sets each rank's rank and sizes)",
                      o.nproc, list),
          {"flags", -1, -1,
           fmt::format("drop {} to start {} local rank(s), or drop --nproc to run one rank of a "
                       "world started elsewhere",
                       list, o.nproc)});
    }
  }
  // --nproc in every rank of a launcher's job: each would start a world of
  // its own, and the job would run as so many separate worlds, all passing.
  // (Slurm's variables count only in a task srun started: a batch script's
  // shell has them too, with SLURM_PROCID=0, and --nproc there is a world on
  // the allocation's first node.)
  if (o.nproc > 0 && !env("DDPDIAG_LAUNCHER")) {
    for (const auto& [rank_var, size_var, who] :
         {std::tuple<const char*, const char*, const char*>{"RANK", "WORLD_SIZE", "torchrun"},
          {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"},
          {"PMI_RANK", "PMI_SIZE", "mpiexec (MPICH, Intel MPI)"},
          {"MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "mpirun_rsh (MVAPICH)"},
          {"SLURM_PROCID", "SLURM_NTASKS", "srun"}}) {
      if (!rank_variable_applies(rank_var, env)) continue;
      const auto rank_text = env(rank_var);
      const auto size_text = env(size_var);
      if (!rank_text || !size_text) continue;
      char* end = nullptr;
      const long size = std::strtol(size_text->c_str(), &end, 10);
      if (!end || *end != '\0' || size < 2) continue;
      throw UsageError(
          fmt::format("--nproc {} cannot be used in one rank of a launcher's job: this process "
                      "is rank {} of {} ({}={}, {}={}, as {} sets them), and every rank would "
                      "start a world of {} of its own",
                      o.nproc, *rank_text, *size_text, rank_var, *rank_text, size_var, *size_text,
                      who, o.nproc),
          {"flags", -1, -1,
           fmt::format("drop --nproc to run as one rank of the launcher's world, or run ddpdiag "
                       "--nproc {} once, outside the launcher",
                       o.nproc)});
    }
  }
  if (builtin && o.nproc <= 0 && !under_launcher) {
    // WORLD_SIZE alone, without RANK, is half of a world started by hand
    // (RANK forgotten, or lost on the way); starting a world of our own
    // instead, with another size, would hide that.
    if (const auto ws = env("WORLD_SIZE"))
      throw UsageError(
          fmt::format("WORLD_SIZE={} is set but RANK is not: ddpdiag would start a world of its "
                      "own on this machine instead of joining yours",
                      *ws),
          {"flags", -1, -1,
           "set RANK (and MASTER_ADDR, MASTER_PORT) in each rank's environment, or pass --rank; "
           "to let ddpdiag start local ranks, unset WORLD_SIZE or give --nproc N"});
    // The same for the MPI launchers' pairs.
    for (const auto& [size_var, rank_var] :
         {std::pair<const char*, const char*>{"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"},
          {"PMI_SIZE", "PMI_RANK"},
          {"MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"}})
      if (const auto ws = env(size_var))
        throw UsageError(
            fmt::format("{}={} is set but {} is not: ddpdiag would start a world of its own on "
                        "this machine instead of joining the launcher's",
                        size_var, *ws, rank_var),
            {"flags", -1, -1,
             fmt::format("run ddpdiag under the launcher that sets both, or pass --rank and "
                         "--world-size; to let ddpdiag start local ranks, unset {} or give "
                         "--nproc N",
                         size_var)});
  }
  if (builtin) {
    check_report_outputs(o);
    // Built-in launcher: default world is one rank per GPU with NCCL, else 2
    // Gloo ranks on loopback.
    int nproc = o.nproc;
    if (nproc <= 0) {
      bool gpu = o.backend != "gloo" && nccl_supported() && cuda_device_count() > 0;
      nproc = gpu ? cuda_device_count() : 2;
    }
    // A batch script's shell has Slurm's variables (SLURM_PROCID=0,
    // SLURM_NTASKS) but is no task of the allocation: say which world runs.
    if (!under_launcher && env("SLURM_PROCID") && !in_srun_step(env) && !o.quiet)
      std::fprintf(stderr,
                   "ddpdiag: note: Slurm job %s: this shell is not a task srun started (no "
                   "SLURM_STEP_ID), so ddpdiag starts %d local rank(s) of its own on this node; "
                   "to test the allocation's tasks, run it under srun (srun ddpdiag ...)\n",
                   env("SLURM_JOB_ID").value_or("?").c_str(), nproc);
    LaunchOptions lo;
    lo.nproc = nproc;
    auto args = own_command_line();
    // Drop --nproc N / --nproc=N from the children's command line.
    std::vector<std::string> child;
    for (std::size_t i = 0; i < args.size(); ++i) {
      if (args[i] == "--nproc") {
        ++i;
        continue;
      }
      if (args[i].rfind("--nproc=", 0) == 0) continue;
      child.push_back(args[i]);
    }
    PipedModelFile piped_model;
    piped_model.take_from(child);
    lo.child_args = child;
    lo.user_args = args;
    lo.grace = Millis(static_cast<std::int64_t>(o.timeout_s * 1000) + 5000);
    lo.progress = isatty(STDERR_FILENO) && !o.quiet;
    return launch_local(lo);
  }
  return std::nullopt;
}
}  // namespace

void collect_warnings(Job& job) {
  job.warnings = mismatch_warnings(job.rank_builds, job.rank_libraries,
                                   std::string(backend_name(job.backend)));
  if (job.backend == Backend::kGloo)
    for (auto& w : placement_warnings(job.ranks, job.machines)) job.warnings.push_back(std::move(w));
  if (job.rank() == 0)
    for (const auto& w : job.warnings) std::fprintf(stderr, "ddpdiag: warning: %s\n", w.detail.c_str());
}

void record_warnings(const Job& job, reports::Report& report) {
  if (job.backend == Backend::kGloo && !job.ranks.empty()) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& r : job.ranks) {
      std::size_t count = 0;
      std::string cpus = r.cpus;
      try {
        count = parse_cpu_list(cpus).size();
      } catch (const std::invalid_argument&) {
        cpus.clear();  // a peer's odd value: unknown, not a reason to fail the job
      }
      rows.push_back({{"rank", r.rank}, {"host", r.host}, {"cpus", cpus}, {"cpu_count", count}});
    }
    report.results()["rank_cpus"] = rows;
    // Known once the backend started (the interface its listener holds).
    if (std::any_of(job.ranks.begin(), job.ranks.end(), [](const auto& r) { return !r.net_address.empty(); })) {
      nlohmann::json net = nlohmann::json::array();
      for (const auto& r : job.ranks) {
        nlohmann::json row = {{"rank", r.rank},
                              {"host", r.host},
                              {"interface", r.net_interface},
                              {"address", r.net_address},
                              {"speed_mbps", r.net_speed_mbps > 0 ? nlohmann::json(r.net_speed_mbps) : nullptr}};
        if (!r.faster_interface.empty())
          row["faster"] = {{"interface", r.faster_interface},
                           {"speed_mbps", r.faster_speed_mbps},
                           {"networks", r.faster_networks}};
        for (const auto& e : r.egress) row["egress"].push_back(egress_json(e));
        net.push_back(row);
      }
      report.results()["rank_network"] = net;
    }
  }
  if (job.warnings.empty()) return;
  nlohmann::json jw = nlohmann::json::array();
  for (const auto& w : job.warnings) jw.push_back({{"name", w.name}, {"detail", w.detail}});
  report.results()["warnings"] = jw;
}

// Rank 0, hosting the store, once the world cannot meet because a rank
// refused to start (its own refusal or another's): keeps the store up so
// that the other ranks, those still to come too, read why instead of
// waiting out --timeout for a store that is gone. Until every rank has
// refused or left, or no new rank has come for 5 s (ranks a launcher starts
// together come within moments), at most 30 s (or --timeout if shorter).
// Rank 0 has counted itself (refused_ranks or left) before.
void keep_store_for_the_others(Job& job) {
  if (!job.server || !job.store) return;
  const Millis bound = std::min(job.timeout, Millis(30000));
  const Millis quiet = std::min(bound, Millis(5000));
  std::fprintf(stderr,
               "ddpdiag: rank 0 keeps the store (port %d) up so that the other ranks learn why "
               "the world cannot meet instead of waiting out --timeout: until %.0f s pass "
               "without a rank coming, at most %.0f s\n",
               job.world.master_port, quiet.count() / 1000.0, bound.count() / 1000.0);
  try {
    const auto start = std::chrono::steady_clock::now();
    auto last_arrival = start;
    std::int64_t arrived = -1;
    for (;;) {
      const std::int64_t refused = job.store->add("refused_ranks", 0);
      // Every other rank either refused too or met the refusal at the
      // rendezvous and left.
      if (job.store->add("left", 0) + refused >= job.size()) break;
      const auto now = std::chrono::steady_clock::now();
      if (const std::int64_t came = job.store->add("joined", 0) + refused; came != arrived) {
        arrived = came;
        last_arrival = now;
      }
      if (now - start >= bound || now - last_arrival >= quiet) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const Error&) {
  }
}

// A rank that refused to start before the rendezvous (a flag, an input
// file, memory it lacks) would leave the others waiting out --timeout for it
// at the store. So it tells them: rank 0 hosts the store anyway, posts why
// it stopped ("refused") and keeps it up (keep_store_for_the_others);
// another rank posts its reason at rank 0's store, where rank 0 reads it
// while it waits for the world (and then keeps the store up too). The value
// names the job (job_identity), so a rank of another job that shares the
// port calls off nothing. Not under torchrun's agent store or ddpdiag's
// launcher: those end every rank once one has failed, and name it.
void tell_world_of_refusal(Job& job, const CommonOptions& o, const std::string& why) {
  if (job.size() < 2 || job.world.agent_store || job.world.launcher == Launcher::kDdpdiag) return;
  try {
    if (job.world.hosts_store()) host_store(job);
    // Another rank only tries briefly: rank 0, when it started at all,
    // hosts the store within moments. Said first: that wait is no hang.
    const Millis wait = job.world.hosts_store() ? job.timeout : std::min(job.timeout, Millis(5000));
    if (!job.world.hosts_store()) {
      std::fprintf(stderr,
                   "ddpdiag: %s posts why it stopped at the store %s:%d, so that the other ranks "
                   "end at once instead of waiting out --timeout (for at most %.0f s)\n",
                   job.rank() >= 0 ? fmt::format("rank {}", job.rank()).c_str() : "this rank",
                   job.world.master_addr.c_str(), job.world.master_port, wait.count() / 1000.0);
      std::fflush(stderr);
    }
    connect_store(job, o, wait);
    if (!job.store->check({"refused"}))
      job.store->set("refused", to_bytes(refusal_text(job.rank(), why)));
    job.store->add("refused_ranks", 1);
    keep_store_for_the_others(job);
  } catch (const Error&) {
    // The store could not be hosted or reached: the others wait out
    // --timeout, as they would have.
  }
  job.store.reset();
  job.server.reset();
}

// A rank refused its place in the world before it knew one (RANK=3 where
// its own WORLD_SIZE says 3: a node's script exported another size; RANK=-1;
// WORLD_SIZE=0) leaves the others waiting out --timeout for it, then naming
// it as never arrived. Where the store's address was given outright
// (MASTER_ADDR and MASTER_PORT, or the flags), it posts its reason there as
// a rank that refused a flag does, so rank 0 ends the world at once naming
// it; a rank 0 (RANK=0) hosts the store to say so. A rank given as no valid
// number posts as rank -1 ("a rank whose rank is not valid").
void tell_store_of_world_refusal(Job& job, const CommonOptions& o, const EnvLookup& env,
                                 const std::string& why) {
  const std::optional<std::string> rank_text =
      o.world.rank ? std::optional<std::string>(std::to_string(*o.world.rank)) : launcher_rank_text(env);
  if (!rank_text) return;  // no rank given at all: nothing says it belongs to a world
  const bool rank0 = *rank_text == "0";
  // Rank 0 of a world of one, as given: no other rank waits to be told (a
  // rank 1 given a world of one is wrong itself, and others may wait).
  if (rank0) {
    const auto size_text = o.world.world_size ? std::optional<std::string>(std::to_string(*o.world.world_size))
                                              : env("WORLD_SIZE");
    if (size_text && *size_text == "1") return;
  }
  if (!rank0 && job.world.rank <= 0) job.world.rank = -1;
  if (rank0) job.world.rank = 0;
  if (env("DDPDIAG_LAUNCHER")) return;  // the launcher ends the others and names this rank
  const auto store = given_store(o.world, env);
  if (!store || store->agent_store) return;  // torchrun's agent ends the others too
  job.world.master_addr = store->addr;
  job.world.master_port = store->port;
  // The world's size as far as it can be told; rank 0 keeps the store up
  // until every other rank has read the refusal, or no rank came for 5 s
  // (an unknown size: only the latter ends it).
  job.world.world_size = std::max({job.world.world_size, job.world.rank + 1, 2});
  if (rank0) {
    const auto size_text = o.world.world_size ? std::optional<std::string>(std::to_string(*o.world.world_size))
                                              : env("WORLD_SIZE");
    char* end = nullptr;
    const long n = size_text ? std::strtol(size_text->c_str(), &end, 10) : 0;
    job.world.world_size = size_text && end && *end == '\0' && n >= 2 && n < (1L << 30) ? static_cast<int>(n)
                                                                                         : (1 << 30);
  }
  job.timeout = Millis(static_cast<std::int64_t>(o.timeout_s * 1000));
  tell_world_of_refusal(job, o, why);
}

// Rank 0 judges most runs alone: it gathers every rank's figures and adds
// the checks. Its verdict goes to every rank through the store, so that
// each rank exits as the job does (1 on a FAIL on every rank): launchers
// (torchrun, srun, mpirun) and scripts read the status of every rank, or of
// whichever rank ends last. A rank whose own checks failed keeps its 1.
// Rank 0 posts it once its report is written (a report it could not write
// fails the run: exit 2 there, 1 on the others).
void post_verdict(Job& job, const reports::Report& report, int rc) {
  if (job.size() < 2 || !job.store || job.rank() != 0) return;
  std::string failed;
  for (const auto& name : report.failed_checks()) failed += (failed.empty() ? "" : ", ") + name;
  if (rc != 0 && rc != static_cast<int>(ExitCode::kCheckFailed))
    failed += std::string(failed.empty() ? "" : ", ") + "report (rank 0 could not write it)";
  try {
    job.store->set("verdict", to_bytes(failed.empty() ? std::string("pass") : "fail: " + failed));
  } catch (const Error&) {
    // The others name the store's failure, or rank 0's silence.
  }
}

void await_verdict(Job& job, int& rc) {
  if (job.size() < 2 || !job.store || job.rank() == 0) return;
  if (job.monitor && job.monitor->store_lost()) return;
  const std::string key = "verdict";
  // Where rank 0 hosts the store, its death or freeze takes the store with
  // it; on the job's connection (--timeout's deadlines) a wait would then
  // reconnect or wait that long. So a connection of its own with short
  // deadlines, and rank 0 named once its process is gone or the store has
  // not answered for as long as a stalled heartbeat takes.
  const bool rank0_hosts = !job.world.agent_store && job.store_client.has_value();
  std::shared_ptr<Store> store = job.store;
  const auto deadline = std::chrono::steady_clock::now() + job.timeout;
  const Millis stall = PeerWatch::stall_of(job);
  std::optional<std::chrono::steady_clock::time_point> unanswered_since;
  std::optional<PeerWatch> watch;
  for (;;) {
    try {
      if (rank0_hosts && store == job.store)
        store = connect_own_store(*job.store_client, job_store_prefix(job), Millis(2000), Millis(2000));
      if (!watch) watch.emplace(job, 0, "verdict", "while judging the run", store);
      wait_in_slices(*store, key, deadline, [&] {
        unanswered_since.reset();
        watch->check();
      });
      break;
    } catch (const PeerError&) {
      throw;
    } catch (const Error& e) {
      const auto now = std::chrono::steady_clock::now();
      if (!rank0_hosts || now >= deadline) throw;
      if (std::string why = local_peer_gone(0); !why.empty())
        throw PeerError(fmt::format("{} while judging the run (it hosted the store)", why),
                        {"verdict", job.rank(), 0,
                         "it was killed or crashed: its log, and the kernel's (dmesg: the OOM "
                         "killer), say why"});
      if (!unanswered_since) unanswered_since = now;
      if (now - *unanswered_since >= stall)
        throw PeerError(fmt::format("rank 0, which hosts the store, has not answered for {:.0f} s "
                                    "while judging the run: it is dead, frozen (stopped) or cut "
                                    "off ({})",
                                    std::chrono::duration<double>(now - *unanswered_since).count(),
                                    e.what()),
                        {"verdict", job.rank(), 0, "look at rank 0's host and log"});
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  const std::string verdict = to_string(store->get(key, job.timeout));
  // A rank that judged the run itself (allreduce-test: every rank has every
  // figure) has said so already.
  if (verdict.rfind("fail", 0) != 0 || rc != 0) return;
  rc = static_cast<int>(ExitCode::kCheckFailed);
  const bool no_report = verdict.find("could not write it") != std::string::npos;
  std::fprintf(stderr, "ddpdiag: rank %d: rank 0 judged the run FAIL (failed check(s): %s); %s\n",
               job.rank(), verdict.size() > 6 ? verdict.c_str() + 6 : "?",
               no_report ? "rank 0's own output says why"
                         : "the job's report, written by rank 0, has the details");
}

namespace {

// A line refused before any rank starts (--nproc with --master-port, ...)
// still writes its report where --json/--markdown ask, as a value refused
// while parsing does: verdict ERROR, error.kind usage. Not when the report
// path is what was refused, and from rank 0 or a process with no rank only.
void write_refusal_report(const CommonOptions& o, const std::string& command, const Error& e) {
  if (o.json_path.empty() && o.markdown_path.empty()) return;
  const std::string what = e.what();
  if (what.rfind("--json", 0) == 0 || what.rfind("--markdown", 0) == 0) return;
  if (o.world.rank.value_or(0) != 0) return;
  if (!o.world.rank)
    if (const auto text = launcher_rank_text(process_env()); text && *text != "0") return;
  try {
    check_report_outputs(o.json_path, o.markdown_path);
    reports::Report report(command, recorded_command_line());
    report.set_environment(recorded_environment());
    report.set_error(to_error_info(e));
    reports::write_report_outputs(report.finish(), o.json_path, o.markdown_path);
  } catch (const std::exception&) {
    // The refusal is what the user reads; a report that cannot be written
    // as well adds nothing to it.
  }
}

}  // namespace

std::optional<int> launch_if_asked(const CommonOptions& o, const std::string& command) {
  try {
    return launch_if_asked_unreported(o);
  } catch (const UsageError& e) {
    write_refusal_report(o, command, e);
    throw;
  }
}

int run_distributed(const CommonOptions& o, const std::string& command, const JobBody& body,
                    const std::function<void(const Job&)>& before_start) {
  if (auto rc = launch_if_asked(o, command)) return *rc;
  write_report_on_interrupt();
  auto env = process_env();
  reports::Report report(command, recorded_command_line());
  report.set_environment(recorded_environment());
  arm_report(report, o);
  Job job;
  job.progress = (isatty(STDERR_FILENO) || env("DDPDIAG_PROGRESS")) && !o.quiet;
  int rc = 0;
  bool store_unreachable = false;  // this rank never reached the store, or lost it
  bool checked = false;            // before_start passed
  // Opened when the body has ended, by success or by an error: from then on
  // a signal (torchrun ending every worker once one has failed) waits for
  // this rank's own report, which keeps the diagnosis it reached.
  std::optional<FinalReportWindow> final_report;
  std::optional<std::string> refusal;  // this rank refused to start, before the rendezvous
  bool report_error = false;           // the run ended with an error (posted as error/<r>)
  // Set when this rank's error file waits for torchrun to see the failure
  // that caused it (the catch below).
  std::optional<std::string> world_refusal;  // its place in the world refused (RANK=3 of 3)
  std::optional<std::chrono::steady_clock::time_point> defer_error_file_since;
  try {
    discover_job(job, o);
    // A report written from here on (a signal during the rendezvous) has the
    // world as far as it is known.
    record_known_world(job, o, report);
    arm_report(report, o);
    if (before_start) before_start(job);
    checked = true;
    start_job(job, o);
    record_known_world(job, o, report);
    record_warnings(job, report);
    arm_report(report, o);
    body(job, report);
    if (report.has_failed_check()) rc = static_cast<int>(ExitCode::kCheckFailed);
    await_verdict(job, rc);
  } catch (const Error& e) {
    report_error = true;
    final_report.emplace();
    // Under torchrun, a failure caused by another rank's (a peer died, its
    // connection dropped) goes into the error file last. torchrun names as
    // root cause the failure with the earliest timestamp, in whole seconds,
    // ties going to the lowest rank, so a survivor that stopped within the
    // second its peer died was named instead of it (rank 0 for rank 1).
    // Its error file now comes after torchrun has seen the death: when
    // torchrun ends this rank (SIGTERM) or after a pause (end of this
    // function).
    // Only for a peer of this machine: torchrun sees the workers of its own
    // node alone.
    // Not for a peer that is stopped (SIGSTOP, a debugger): torchrun never
    // sees it end, so the pause would only hold this rank's exit.
    const bool defer_error_file = e.exit_code() == ExitCode::kPeerFailed &&
                                  std::getenv("TORCHELASTIC_RUN_ID") && !std::getenv("DDPDIAG_LAUNCHER") &&
                                  std::getenv("TORCHELASTIC_ERROR_FILE") &&
                                  peer_on_this_machine(e.context().peer) &&
                                  !local_peer_stopped(e.context().peer);
    print_error(e, !defer_error_file);
    if (defer_error_file) {
      g_pending_error_file = error_file_text(e);
      defer_error_file_since = std::chrono::steady_clock::now();
    }
    report.set_error(to_error_info(e));
    // The world as far as this rank got to know it: its size, backend and
    // launcher once the environment was read, every rank's identity once the
    // rendezvous passed.
    record_known_world(job, o, report);
    // What the rendezvous found (a version mismatch explains many a failed
    // backend init) belongs in the report of the failure too.
    if (!job.warnings.empty() && !report.results().contains("warnings")) record_warnings(job, report);
    rc = static_cast<int>(e.exit_code());
    if (rc == static_cast<int>(ExitCode::kUsage) && !job.store && job.world_known) refusal = e.what();
    if (rc == static_cast<int>(ExitCode::kUsage) && !job.world_known) world_refusal = e.what();
    store_unreachable = !job.store || e.context().phase.rfind("store.connect", 0) == 0;
    if (job.monitor) {
      auto watchdog = job.monitor->failure_report();
      if (!watchdog.is_null()) report.results()["watchdog"] = watchdog;
    }
    if (job.comm) job.comm->abort();
    if (job.store && !(job.monitor && job.monitor->store_lost())) {
      try {
        job.store->set(fmt::format("error/{}", job.rank()), to_bytes(e.what()));
      } catch (const Error&) {
      }
    }
  }
  if (!final_report) final_report.emplace();
  // The job's report comes from rank 0. A rank cut off from the store (it
  // never reached it, or lost it) cannot hand its view to rank 0, so it
  // writes its own next to it: out.json -> out.rank<R>.json.
  // Rank 0 gone (killed, crashed) cannot write the job's report either.
  const auto gone = gone_ranks(job);
  const bool rank0_gone = std::find(gone.begin(), gone.end(), 0) != gone.end();
  // A rank whose world was refused (RANK=2 in a world of 2) is not rank 0:
  // its report goes beside the job's, under the rank it was given, rather
  // than over the job's.
  if (!job.world_known)
    if (const auto text = launcher_rank_text(env)) {
      char* end = nullptr;
      const long r = std::strtol(text->c_str(), &end, 10);
      if (end && *end == '\0' && r > 0 && r < (1L << 30)) job.world.rank = static_cast<int>(r);
    }
  const bool own_report = job.world.rank > 0 && (store_unreachable || rank0_gone || !job.world_known ||
                                                 (job.monitor && job.monitor->store_lost()));
  // A rank that refused its report paths has said so: no second error from
  // trying to write there anyway.
  const bool paths_refused = refusal && report_outputs_refused(o.json_path, o.markdown_path);
  if ((job.world.rank == 0 || own_report) && !paths_refused &&
      (!o.json_path.empty() || !o.markdown_path.empty())) {
    auto path_of = [&](const std::string& path, const std::string& ext) {
      return own_report ? rank_report_path(path, ext, job.world.rank) : path;
    };
    try {
      const std::string json_path = path_of(o.json_path, ".json");
      reports::write_report_outputs(report.finish(), json_path, path_of(o.markdown_path, ".md"));
      if (own_report && !json_path.empty())
        std::fprintf(stderr, "ddpdiag: rank %d %s; its own report: %s\n", job.world.rank,
                     !job.world_known ? "was refused its place in the world"
                     : !checked       ? "stopped before the rendezvous"
                     : store_unreachable || (job.monitor && job.monitor->store_lost())
                         ? "could not reach the store"
                         : "saw rank 0, which writes the job's report, gone",
                     json_path.c_str());
    } catch (const reports::WriteError& e) {
      print_error(report_write_error(e, job.world.rank));
      if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddpdiag: error on rank %d: %s\n", job.world.rank, e.what());
      if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
    }
  }
  final_report->written(rc);
  if (!report_error) post_verdict(job, report, rc);
  if (refusal) tell_world_of_refusal(job, o, *refusal);
  if (world_refusal) tell_store_of_world_refusal(job, o, env, *world_refusal);
  leave_job(job, rc != 0 && rc != static_cast<int>(ExitCode::kCheckFailed));
  if (job.world_refused) keep_store_for_the_others(job);
  leave_ended_mark(rc);
  if (defer_error_file_since) {
    // torchrun polls its workers every 0.1 s (--monitor-interval; 5 s in
    // torch 1.x): within this pause it has seen the peer that died and ends
    // this rank (the signal's thread writes the file then). The pause also
    // puts this file's timestamp past the second of the death.
    const auto until = *defer_error_file_since + std::chrono::milliseconds(5500);
    std::this_thread::sleep_until(until);
    write_torchelastic_error_file(g_pending_error_file);
  }
  return rc;
}

}  // namespace ddpdiag::cli
