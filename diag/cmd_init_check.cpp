// ddpdiag init-check: initialisation one phase at a time on every rank, each
// phase with its own deadline, and a per-rank timeline of what happened:
//
//   environment        rank/size/launcher from flags and env, every variable echoed
//   resolve_master     MASTER_ADDR through getaddrinfo: families and addresses
//   store_connect      rank 0 (no agent) binds the store; TCP connect with
//                      retries; refused / timed out / unreachable told apart
//   store_handshake    wire protocol detected (torch 1.13 or 2.x), round trip
//   register           rank, host, pid, device written (duplicates named)
//   wait_for_ranks     every rank arrived (missing ranks and world size
//                      disagreements named)
//   backend_init       Gloo full mesh / NCCL id exchange + non-blocking init
//   first_allreduce    1024 floats, result checked
//   barrier
//
// Timelines meet on rank 0 through the store (a rank that never reached the
// store prints its own on stderr); rank 0 prints the table and writes the
// report (results.ranks[].phases, one check per phase). Each failure ends
// with a hint for its usual cause.
#include <netdb.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <future>
#include <sstream>
#include <thread>

#include <fmt/core.h>

#include "comm/ip_text.h"
#include "comm/monitored_communicator.h"
#include "reports/render.h"
#include "diag/bisect.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/launcher.h"
#include "diag/tools_analysis.h"

namespace ddpdiag::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct InitCheckOptions {
  CommonOptions common;
  bool nccl_debug = false;
  bool bisect = false;
};

struct PhaseRecord {
  explicit PhaseRecord(std::string n) : name(std::move(n)) {}
  std::string name;
  double start_s = 0;
  double duration_ms = 0;
  std::string status = "skip";  // ok | fail | skip
  std::string detail;
  std::string hint;
};

// The phases in order; a phase after a failed one is recorded as skipped.
const char* const kPhases[] = {"environment",    "resolve_master", "store_connect",
                               "store_handshake", "register",       "wait_for_ranks",
                               "backend_init",    "first_allreduce", "barrier"};

class Timeline {
 public:
  explicit Timeline(Clock::time_point t0) : t0_(t0) {
    for (const char* p : kPhases) phases_.emplace_back(p);
  }

  // Runs f (returns the detail) as phase `name`; records ok / fail. On
  // failure the error is kept and rethrown.
  template <typename F>
  void run(const std::string& name, F&& f) {
    PhaseRecord& p = find(name);
    const auto start = Clock::now();
    p.start_s = std::chrono::duration<double>(start - t0_).count();
    try {
      p.detail = f();
      p.status = "ok";
      p.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    } catch (const Error& e) {
      p.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      p.status = "fail";
      p.detail = e.what();
      p.hint = e.context().hint;
      throw;
    }
  }
  // Phase `name` ended at `end` (a later part of its run belongs to the
  // next phase).
  void end_at(const std::string& name, Clock::time_point end) {
    PhaseRecord& p = find(name);
    const double end_s = std::chrono::duration<double>(end - t0_).count();
    if (end_s >= p.start_s) p.duration_ms = (end_s - p.start_s) * 1000.0;
  }
  // Phase `name` ran from `start` to `end` and failed with `e`.
  void failed(const std::string& name, Clock::time_point start, Clock::time_point end, const Error& e) {
    PhaseRecord& p = find(name);
    p.start_s = std::chrono::duration<double>(start - t0_).count();
    p.duration_ms = std::chrono::duration<double, std::milli>(end - start).count();
    p.status = "fail";
    p.detail = e.what();
    p.hint = e.context().hint;
  }
  void skip(const std::string& name, const std::string& why) {
    PhaseRecord& p = find(name);
    p.status = "skip";
    p.detail = why;
  }
  nlohmann::json to_json() const {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& p : phases_)
      out.push_back({{"name", p.name},
                     {"start_s", p.start_s},
                     {"end_s", p.start_s + p.duration_ms / 1000.0},
                     {"duration_ms", p.duration_ms},
                     {"status", p.status},
                     {"detail", p.detail},
                     {"hint", p.hint}});
    return out;
  }
  PhaseRecord& find(const std::string& name) {
    for (auto& p : phases_)
      if (p.name == name) return p;
    phases_.emplace_back(name);
    return phases_.back();
  }

 private:
  Clock::time_point t0_;
  std::vector<PhaseRecord> phases_;
};

// getaddrinfo has no timeout of its own: run it on a thread and stop waiting
// at the deadline (the thread finishes on its own; it owns its data).
// `what` names the address for messages: "MASTER_ADDR", or where it came
// from when the user did not set it.
std::string resolve(const std::string& host, const std::string& what, Millis timeout, int rank) {
  auto task = std::make_shared<std::packaged_task<std::pair<int, std::vector<std::string>>()>>(
      [host] {
        addrinfo hints{};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        addrinfo* res = nullptr;
        int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
        std::vector<std::string> out;
        if (rc != 0) {
          out.push_back(gai_strerror(rc));
          return std::pair{rc, out};
        }
        for (addrinfo* ai = res; ai; ai = ai->ai_next) {
          std::string s = fmt::format("{} ({})", ip_text(ai->ai_addr),
                                      ai->ai_family == AF_INET ? "IPv4" : "IPv6");
          if (std::find(out.begin(), out.end(), s) == out.end()) out.push_back(s);
        }
        freeaddrinfo(res);
        return std::pair{0, out};
      });
  auto fut = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  const std::string hint =
      "wrong MASTER_ADDR? Set MASTER_ADDR (or --master-addr) to the host name or IP address of "
      "the machine that hosts the store (rank 0's, or the launcher agent's), one that resolves "
      "on every node; an IP address avoids DNS altogether";
  if (fut.wait_for(timeout) != std::future_status::ready)
    throw TimeoutError(fmt::format("resolving {}='{}' took longer than {} ms", what, host,
                                   timeout.count()),
                       {"resolve_master", rank, -1, hint + " (DNS does not answer)"});
  auto [rc, list] = fut.get();
  if (rc != 0)
    throw RendezvousError(fmt::format("{}='{}' does not resolve: {}", what, host,
                                      list.empty() ? "" : list.front()),
                          {"resolve_master", rank, -1, hint});
  std::string joined;
  for (const auto& a : list) joined += (joined.empty() ? "" : ", ") + a;
  return fmt::format("{} '{}' -> {}", what, host, joined);
}

// NCCL's own log, when --nccl-debug asked for it (INIT, BOOTSTRAP, NET and
// ENV lines, and warnings): its key lines and its last 80
// (tools::select_nccl_log_lines).
nlohmann::json nccl_log_lines(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json(tools::select_nccl_log_lines(text.str()));
}

std::string describe_env(const World& w) {
  // Flags over a launcher's variables: say so, beside the variables shown.
  std::string given;
  if (w.rank_source.rfind("--", 0) == 0 || w.world_size_source.rfind("--", 0) == 0)
    given = fmt::format(" (from {} and {})", w.rank_source, w.world_size_source);
  std::string s = fmt::format("launcher {}; rank {} of {}{}, local rank {} of {}",
                              launcher_name(w.launcher), w.rank, w.world_size, given, w.local_rank,
                              w.local_world_size);
  if (w.agent_store) s += "; store hosted by the launcher's agent";
  else if (w.world_size > 1) s += w.hosts_store() ? "; this rank hosts the store" : "";
  std::string vars;
  for (const auto& [k, v] : w.env_read) vars += fmt::format(" {}={}", k, v);
  for (const auto& [k, v] : recorded_environment())
    if ((k.rfind("NCCL_", 0) == 0 || k.rfind("GLOO_", 0) == 0) && !w.env_read.count(k))
      vars += fmt::format(" {}={}", k, v);
  if (!vars.empty()) s += ";" + vars;
  return s;
}

std::string timeline_header() {
  return fmt::format("# {:>4} {:<12} {:<16} {:>9} {:>10}  {:<4}  {}\n", "rank", "host", "phase", "start(s)", "dur(ms)",
                     "stat", "detail");
}

// The table's lines for one rank's phases; rank < 0: the environment was
// rejected, so the rank is unknown ("?"). ran_only: leave out the phases not
// reached yet (skipped, with no reason given).
std::string timeline_lines(int rank, const std::string& host, const nlohmann::json& phases,
                           bool ran_only = false) {
  const std::string who = rank >= 0 ? std::to_string(rank) : std::string("?");
  std::string out;
  for (const auto& p : phases) {
    std::string detail = p.value("detail", std::string());
    const std::string status = p.value("status", std::string());
    if (ran_only && status == "skip" && detail.empty()) continue;
    if (detail.size() > 110) detail = detail.substr(0, 107) + "...";
    out += fmt::format("  {:>4} {:<12} {:<16} {:>9.3f} {:>10.1f}  {:<4}  {}\n", who, host,
                       p.value("name", std::string()), p.value("start_s", 0.0), p.value("duration_ms", 0.0),
                       status, detail);
  }
  return out;
}

void print_timeline(FILE* to, int rank, const std::string& host, const nlohmann::json& phases) {
  std::fputs(timeline_lines(rank, host, phases).c_str(), to);
}

int run_init_check(const InitCheckOptions& io) {
  const CommonOptions& o = io.common;
  if (auto rc = launch_if_asked(o, "init-check")) return *rc;
  write_report_on_interrupt();
  const auto t0 = Clock::now();
  // Wall clock of this rank's start: rank 0 shifts every timeline onto the
  // earliest rank's start, so offsets compare across ranks (same machine or
  // synchronised clocks).
  const double t0_unix_s =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  reports::Report report("init-check", recorded_command_line());
  report.set_environment(recorded_environment());
  Timeline tl(t0);
  Job job;
  job.timeout = Millis(static_cast<std::int64_t>(o.timeout_s * 1000));
  std::optional<reports::ErrorInfo> failure;
  std::optional<std::string> refusal;  // this rank refused to start, before the store
  int rc = 0;
  bool reached_store = false, rendezvous_ok = false;
  std::string host;
  std::string nccl_log_path;
  nlohmann::json nccl_log;

  // After each phase the report a signal would write (torchrun stops a
  // worker with SIGTERM on every restart) holds the timeline so far.
  // What a signal prints on stdout (torchrun stops every worker once one
  // has failed; a scheduler ends a job at its time limit): this rank's
  // timeline so far and, when it came during a phase, which one, and for
  // how long it had run; the phase a hang is in is the question init-check
  // is run to answer.
  const auto arm_timeline_text = [&](const std::string& running, Clock::time_point since) {
    if (!job.world_known) return;
    const std::string who = host.empty() ? std::string("-") : host;
    std::string text = fmt::format("# init-check timeline of rank {} ({}), stopped before it finished:\n",
                                   job.world.rank, who);
    text += timeline_header();
    text += timeline_lines(job.world.rank, who, tl.to_json(), true);
    arm_stop_text(std::move(text), !running.empty(),
                  running.empty() ? std::string()
                                  : fmt::format("  {:>4} {:<12} {:<16} {:>9.3f} {:>10}  {:<4}  ", job.world.rank,
                                                who, running,
                                                std::chrono::duration<double>(since - t0).count(), "-", "run"),
                  since);
  };
  const auto rearm = [&] {
    if (!job.world_known) return;
    arm_timeline_text({}, {});
    note_current_rank(job.world.rank);
    reports::Report now = report;
    record_known_world(job, o, now);
    now.results()["ranks"] = nlohmann::json::array(
        {{{"rank", job.world.rank}, {"host", host}, {"phases", tl.to_json()},
          {"started_unix_s", t0_unix_s}}});
    now.results()["timeout_s"] = o.timeout_s;
    arm_report(now, o);
  };
  auto phase = [&](const std::string& name, auto&& f) {
    arm_timeline_text(name, Clock::now());
    tl.run(name, f);
    rearm();
  };
  // The store rank 0 hosts closed this rank's connection mid-request: when
  // it no longer takes a connection either, rank 0's process has ended (it
  // failed, was killed, or stopped on an error of its own), and that, not
  // the request, is the cause: a peer failure (exit 5) naming rank 0.
  const auto rank0_store_lost = [&](const Error& e, const std::string& during) {
    if (e.context().phase != "store.io" || !job.store_client || job.world.agent_store ||
        job.world.hosts_store())
      return;
    try {
      TcpStoreClientOptions probe = *job.store_client;
      probe.connect_timeout = Millis(3000);
      probe.io_timeout = Millis(3000);
      probe.known_store = true;
      TcpStoreClient again(probe);
      return;  // the store is up: the request itself was refused
    } catch (const Error& gone) {
      if (gone.context().phase.rfind("store.connect", 0) != 0) return;
    }
    throw PeerError(
        fmt::format("rank 0, which hosted the store at {}:{}, is gone: the store closed this "
                    "rank's connection {} and no longer accepts one",
                    job.world.master_addr, job.world.master_port, during),
        {during == "while the ranks met" ? "wait_for_ranks" : "backend_init", job.world.rank, 0,
         "rank 0's process ended (killed, crashed, or stopped on an error of its own): its log "
         "says why; its host's kernel log (dmesg) says whether the OOM killer ended it"});
  };
  try {
    phase("environment", [&] {
      try {
        job.world = discover_world(o.world, process_env());
      } catch (Error& e) {
        if (e.context().phase.empty() || e.context().phase == "world") e.context().phase = "environment";
        throw;
      }
      job.backend = choose_backend(o);
      job.world_known = true;
      if (job.world.rank == 0) check_report_outputs(o);
      host = reported_host_name(o, job.world.rank);
      return describe_env(job.world) + fmt::format("; backend {}", backend_name(job.backend));
    });
    const int me = job.world.rank;
    if (io.nccl_debug) {
      if (job.backend == Backend::kNccl) {
        // NCCL reads these when it initialises; %h/%p are NCCL's own
        // placeholders, the rank makes the file ours.
        nccl_log_path = fmt::format("/tmp/ddpdiag-nccl-{}-rank{}.log", static_cast<long>(getpid()), me);
        setenv("NCCL_DEBUG", "INFO", 1);
        // ENV too: the NCCL_* settings NCCL says it read (naming any
        // subsystem drops NCCL's default INIT,BOOTSTRAP,ENV).
        setenv("NCCL_DEBUG_SUBSYS", "INIT,BOOTSTRAP,NET,ENV", 1);
        setenv("NCCL_DEBUG_FILE", nccl_log_path.c_str(), 1);
      }
    }
    const bool single = job.world.world_size == 1 && !job.world.agent_store;
    if (single) {
      tl.skip("resolve_master", "world of 1 rank: no store to reach");
    } else {
      phase("resolve_master", [&] {
        const std::string& src = job.world.master_addr_source;
        const std::string what = src.rfind("SLURM_", 0) == 0
                                     ? fmt::format("MASTER_ADDR (unset; the first host of {})", src)
                                 : src == "default"       ? std::string("MASTER_ADDR (unset; the default)")
                                 : src == "--master-addr" ? std::string("--master-addr")
                                                          : std::string("MASTER_ADDR");
        return resolve(job.world.master_addr, what, job.timeout, me);
      });
    }
    std::exception_ptr handshake_error;  // connect_store's, in the handshake's row
    Clock::time_point handshake_failed_at{};
    phase("store_connect", [&] {
      try {
        host_store(job);
      } catch (Error& e) {
        e.context().phase = "store_connect";
        // A port held by another ddpdiag rank 0 is named with its own hint.
        if (store_port_taken(e))
          e.context().hint = fmt::format(
            "port {} is taken, probably by another job (or an earlier run that is still "
            "alive): pick another MASTER_PORT / --master-port, or stop the other job",
            job.world.master_port);
        throw;
      }
      std::shared_ptr<Store> base;
      try {
        base = connect_store(job, o);
      } catch (const Error& e) {
        // The host accepted the connection, and the wire protocol failed:
        // the handshake's row fails, not the connect's.
        if (e.context().phase != "store.handshake") throw;
        handshake_error = std::current_exception();
        handshake_failed_at = Clock::now();
        return fmt::format("{}:{} accepted the connection", job.world.master_addr,
                           job.world.master_port);
      }
      reached_store = true;
      if (single) return std::string("in-process store (world of 1)");
      auto* client = dynamic_cast<TcpStoreClient*>(base.get());
      std::string where = job.world.hosts_store() ? fmt::format("127.0.0.1:{} (hosted here)", job.world.master_port)
                                                  : fmt::format("{}:{}", job.world.master_addr, job.world.master_port);
      return fmt::format("connected to {} after {} attempt(s)", where,
                         client ? client->connect_attempts() : 1);
    });
    if (single) {
      tl.skip("store_handshake", "in-process store");
    } else {
      // The connection was made and the handshake then failed (a silent
      // server waits out the I/O timeout): that time is the handshake's, not
      // the connect's.
      if (handshake_error && job.store_connected_at != Clock::time_point{}) {
        tl.end_at("store_connect", job.store_connected_at);
        try {
          std::rethrow_exception(handshake_error);
        } catch (const Error& e) {
          tl.failed("store_handshake", job.store_connected_at, handshake_failed_at, e);
          throw;
        }
      }
      phase("store_handshake", [&] {
        if (handshake_error) std::rethrow_exception(handshake_error);
        auto* prefixed = static_cast<PrefixStore*>(job.store.get());
        auto* client = dynamic_cast<TcpStoreClient*>(prefixed->base().get());
        if (!client) return std::string("not a TCP store");
        double rtt = client->ping_us();
        return fmt::format("protocol {}, round trip {:.0f} us", store_protocol_name(client->protocol()),
                           rtt);
      });
    }
    const std::string device = requested_device(job);
    phase("register", [&] {
      register_rank(job, device, host);
      return fmt::format("rank {} host {} pid {} device {} world size {}", me, host,
                         static_cast<long>(getpid()), device, job.world.world_size);
    });
    phase("wait_for_ranks", [&] {
      try {
        wait_for_ranks(job);
        collect_warnings(job);
      } catch (Error& e) {
        rank0_store_lost(e, "while the ranks met");
        e.context().phase = "wait_for_ranks";
        const std::string loopback = loopback_hint(job.world);
        const std::string not_here = job.server ? master_addr_problem(job.world) : std::string();
        if (!not_here.empty())
          e.context().hint = not_here;  // the others look for the store elsewhere
        else if (std::string(e.what()).find("never arrived") != std::string::npos)
          e.context().hint = !loopback.empty()
                                 ? loopback
                                 : "a rank that never started, or one that cannot reach the "
                                   "store: check that every rank was launched, that they all use "
                                   "the same MASTER_ADDR:MASTER_PORT and WORLD_SIZE, and that the "
                                   "missing ranks' hosts can reach it (firewall, wrong interface)";
        else if (std::string(e.what()).find("world size") != std::string::npos)
          e.context().hint = "world size mismatch: start every rank with the same WORLD_SIZE / "
                             "--world-size (the launcher's --nnodes x --nproc-per-node)";
        throw;
      }
      rendezvous_ok = true;
      return fmt::format("all {} rank(s) arrived", job.world.world_size);
    });
    phase("backend_init", [&] {
      try {
        create_communicator(job, o);
      } catch (Error& e) {
        rank0_store_lost(e, "during the backend's init");
        e.context().phase = "backend_init";
        if (e.context().hint.empty() || dynamic_cast<TimeoutError*>(&e))
          e.context().hint =
              job.backend == Backend::kGloo
                  ? "the ranks met at the store but cannot connect to each other: a firewall "
                    "or the wrong interface (set GLOO_SOCKET_IFNAME / --gloo-interface to the "
                    "interface the hosts share)"
                  : "the ranks met at the store but NCCL could not connect them: a firewall or "
                    "the wrong interface (set NCCL_SOCKET_IFNAME; rerun with --nccl-debug)";
        throw;
      }
      // Every rank's device and, on Gloo, where it listens: the report's
      // rank_network, for the "wrong interface" questions init-check is for.
      gather_rank_devices(job);
      const std::string net =
          me < static_cast<int>(job.ranks.size()) ? rank_network_text(job.ranks[me], true) : std::string();
      return fmt::format("{} ({}), device {}{}", backend_name(job.backend), job.comm->library_version(),
                         job.comm->device_name(), net.empty() ? "" : ", listening on " + net);
    });
    phase("first_allreduce", [&] {
      const std::size_t count = 1024;
      CommBuffer buf(*job.comm, count * sizeof(float));
      std::vector<float> host_buf(count, static_cast<float>(me + 1));
      job.comm->copy_from_host(buf.get(), host_buf.data(), count * sizeof(float));
      const auto t = Clock::now();
      job.comm->allreduce(buf.get(), buf.get(), count, DType::kFloat32, ReduceOp::kSum)
          ->wait(job.timeout);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - t).count();
      job.comm->copy_to_host(host_buf.data(), buf.get(), count * sizeof(float));
      const int n = job.world.world_size;
      const float expect = static_cast<float>(n) * static_cast<float>(n + 1) / 2;
      std::size_t wrong = 0;
      for (float v : host_buf) wrong += v != expect;
      if (wrong)
        throw CheckFailed(fmt::format("all_reduce(float, 1024) gave {} wrong element(s) (expected "
                                      "{} everywhere, got {} first)",
                                      wrong, expect, host_buf[0]),
                          {"first_allreduce", me, -1,
                           "the data path is broken: run allreduce-test --bisect to find the "
                           "rank or host"});
      return fmt::format("all_reduce(float, 1024) correct in {:.0f} us", us);
    });
    phase("barrier", [&] {
      const auto t = Clock::now();
      job.comm->barrier()->wait(job.timeout);
      return fmt::format("barrier in {:.0f} us",
                         std::chrono::duration<double, std::micro>(Clock::now() - t).count());
    });
    // NCCL's log after the first collectives: NCCL connects the ranks' rings
    // and trees at the first collective (NCCL_RUNTIME_CONNECT, on by
    // default), and logs their transports or a failure to connect then.
    if (!nccl_log_path.empty()) nccl_log = nccl_log_lines(nccl_log_path);
  } catch (const Error& e) {
    print_error(e);
    if (e.exit_code() == ExitCode::kUsage && !job.store && job.world_known) refusal = e.what();
    failure = to_error_info(e);
    if (failure->phase.empty()) failure->phase = "init";
    rc = static_cast<int>(e.exit_code());
    bool after = false;
    for (const char* p : kPhases) {
      auto& rec = tl.find(p);
      if (after && rec.status != "skip") continue;
      if (after) rec.detail = rec.detail.empty() ? "not run: an earlier phase failed" : rec.detail;
      if (rec.status == "fail") after = true;
    }
    if (job.comm) job.comm->abort();
    // Read again whatever phase failed: its warnings came last.
    if (!nccl_log_path.empty()) nccl_log = nccl_log_lines(nccl_log_path);
  }

  // Whether this process knows its rank: not when the environment (or the
  // flags) were rejected; then nothing past it was tried, the store included.
  const bool world_known = tl.find("environment").status == "ok";
  // This rank's timeline, to rank 0 through the store.
  nlohmann::json mine = {{"rank", world_known ? nlohmann::json(job.world.rank) : nlohmann::json()},
                         {"host", host}, {"phases", tl.to_json()},
                         {"started_unix_s", t0_unix_s},
                         {"error", failure ? nlohmann::json{{"kind", failure->kind},
                                                            {"message", failure->message},
                                                            {"phase", failure->phase},
                                                            {"hint", failure->hint},
                                                            {"peer", failure->peer},
                                                            {"exit_code", failure->exit_code}}
                                           : nlohmann::json()}};
  if (!nccl_log.is_null()) mine["nccl_log"] = nccl_log;
  else if (io.nccl_debug && job.backend != Backend::kNccl)
    mine["nccl_log"] = nlohmann::json::array({"--nccl-debug: backend is gloo, no NCCL log"});
  bool published = false;
  if (reached_store) {
    try {
      job.store->set(fmt::format("initcheck/timeline/{}", job.world.rank), to_bytes(mine.dump()));
      published = true;
    } catch (const Error&) {
    }
  }
  // (With the environment rejected, the table below on stdout is the
  // timeline: there is no rank to speak for and no store was tried.)
  if (world_known && (!published || (failure && job.world.rank != 0))) {
    std::fprintf(stderr, "# init-check timeline of rank %d (%s):\n", job.world.rank,
                 published      ? "also sent to rank 0"
                 : reached_store ? "the store was lost before it could be sent to rank 0"
                                 : "could not reach the store");
    print_timeline(stderr, job.world.rank, host, mine["phases"]);
    if (failure && !failure->hint.empty())
      std::fprintf(stderr, "# hint: %s\n", failure->hint.c_str());
  }

  // A rank other than 0 that could not hand its timeline to rank 0, or that
  // failed, writes its own report beside the job's: out.json ->
  // out.rank<R>.json. (Rank 0 reads a failed rank's timeline only until its
  // own deadline, and may not get to write the job's report at all.)
  if (world_known && (!published || failure) && job.world.rank > 0 &&
      (!o.json_path.empty() || !o.markdown_path.empty())) {
    record_known_world(job, o, report);
    nlohmann::json entry = mine;
    entry["reported"] = true;
    entry["clock_shift_s"] = 0.0;
    auto& res = report.results();
    res["ranks"] = nlohmann::json::array({entry});
    res["timeout_s"] = o.timeout_s;
    for (const auto& ph : mine["phases"]) {
      const std::string st = ph.value("status", "");
      const std::string name = ph.value("name", "");
      report.add_check({name,
                        st == "ok"     ? reports::CheckStatus::kPass
                        : st == "fail" ? reports::CheckStatus::kFail
                                       : reports::CheckStatus::kSkip,
                        st == "ok"     ? fmt::format("ok on rank {}", job.world.rank)
                        : st == "fail" ? fmt::format("failed on rank {}", job.world.rank)
                                       : std::string("not reached")});
    }
    if (failure) report.set_error(*failure);
    const std::string json_path = rank_report_path(o.json_path, ".json", job.world.rank);
    // This one replaces what a signal would have written; a signal waits
    // for it.
    FinalReportWindow window;
    try {
      reports::write_report_outputs(report.finish(), json_path,
                                    rank_report_path(o.markdown_path, ".md", job.world.rank));
      if (!json_path.empty() && !published)
        std::fprintf(stderr, "ddpdiag: rank %d %s; its own report: %s\n", job.world.rank,
                     reached_store ? "lost the store" : "could not reach the store", json_path.c_str());
      else if (!json_path.empty())
        std::fprintf(stderr,
                     "ddpdiag: rank %d failed in %s; its own report: %s (its timeline went to "
                     "rank 0 through the store as well)\n",
                     job.world.rank, failure->phase.c_str(), json_path.c_str());
    } catch (const reports::WriteError& e) {
      print_error(report_write_error(e, job.world.rank));
      if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ddpdiag: error on rank %d: %s\n", job.world.rank, e.what());
      if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
    }
  }

  nlohmann::json bisect;
  if (io.bisect && rendezvous_ok) {
    try {
      BisectOptions bo;
      bo.world_passed = !failure;  // every phase passed here, the world's barrier included
      bisect = run_bisect(job, o, bo, report);
    } catch (const Error& e) {
      print_error(e);
      bisect = {{"error", e.what()}};
    }
  }

  if (job.world.rank == 0) {
    // Gather: bounded, and only for ranks that registered.
    const int n = job.world.world_size;
    std::vector<nlohmann::json> all(n);
    all[0] = mine;
    // Ranks that registered at the store (rank/<r>): they reached it, even
    // when no timeline of theirs comes in time.
    std::vector<bool> registered(n, false);
    registered[0] = reached_store;
    const auto deadline = Clock::now() + std::min(job.timeout, Millis(failure ? 5000 : 15000));
    // How many other ranks registered: once that many are found, the rest
    // never reached the store, and are not asked for one by one.
    std::int64_t others_joined = n;
    if (reached_store) try {
        others_joined = job.store->add("joined", 0) - (job.joined ? 1 : 0);
      } catch (const Error&) {
      }
    std::int64_t others_found = 0;
    // A registered rank on this machine whose process has ended sends no
    // timeline: not waited for, and named as ended.
    const std::string here = machine_id();
    std::vector<long> ended_pid(n, 0);
    const auto ended_here = [&](int r) -> long {
      if (static_cast<std::size_t>(r) >= job.machines.size() || job.machines[r] != here) return 0;
      for (const auto& k : job.ranks)
        if (k.rank == r && k.pid > 0 && process_gone(k.pid)) return k.pid;
      return 0;
    };
    for (int r = 1; r < n && reached_store && others_found < others_joined && Clock::now() < deadline; ++r) {
      const std::string key = fmt::format("initcheck/timeline/{}", r);
      try {
        for (;;) {
          if (job.store->check({key})) {
            all[r] = nlohmann::json::parse(to_string(job.store->get(key, Millis(2000))), nullptr, false);
            registered[r] = true;
            break;
          }
          registered[r] = job.store->check({"rank/" + std::to_string(r)});
          if (!registered[r] || Clock::now() >= deadline) break;
          if ((ended_pid[r] = ended_here(r)) != 0) break;
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
      } catch (const Error&) {
      }
      others_found += registered[r] ? 1 : 0;
    }
    auto host_of = [&](int r) -> nlohmann::json {
      for (const auto& k : job.ranks)
        if (k.rank == r && !k.host.empty()) return k.host;
      return nullptr;
    };
    double first_start = t0_unix_s;
    for (const auto& t : all)
      if (t.is_object()) first_start = std::min(first_start, t.value("started_unix_s", t0_unix_s));
    for (auto& t : all) {
      if (!t.is_object()) continue;
      const double shift = t.value("started_unix_s", t0_unix_s) - first_start;
      t["clock_shift_s"] = shift;
      for (auto& p : t["phases"])
        if (p.value("status", "") != "skip" || p.value("duration_ms", 0.0) > 0) {
          p["start_s"] = p.value("start_s", 0.0) + shift;
          p["end_s"] = p.value("end_s", 0.0) + shift;
        }
    }
    nlohmann::json ranks = nlohmann::json::array();
    double slowest_end = -1;
    int slowest = -1;
    // The job's error is the cause, not its echo. A rank's error is its own
    // (2: it could not bind its interface, had no GPU, got a wrong result),
    // about meeting the others (1: rendezvous), or a wait on another rank
    // that failed (0: timeout, peer). The most owned one wins, rank 0's on a
    // tie: rank 0 timing out in backend_init because rank 1's Gloo could not
    // start reports rank 1's failure, with rank 0's own in its timeline.
    auto ownership = [](const std::string& kind) {
      return kind == "timeout" || kind == "peer" ? 0 : kind == "rendezvous" ? 1 : 2;
    };
    std::optional<reports::ErrorInfo> cause;
    for (int r = 0; r < n; ++r) {
      if (!all[r].is_object() || !all[r]["error"].is_object()) continue;
      const auto& e = all[r]["error"];
      reports::ErrorInfo info{e.value("kind", std::string("rendezvous")),
                              e.value("message", std::string()), e.value("phase", std::string()),
                              r, e.value("peer", -1), e.value("hint", std::string()),
                              e.value("exit_code", 3)};
      if (r == 0 && failure) info = *failure;
      if (!cause || ownership(info.kind) > ownership(cause->kind)) cause = info;
    }
    // In a world of more than kListEveryRank ranks, those that never reached
    // the store (no host known either) are one range list, not an entry each:
    // a million absent ranks would make the report 150 MB.
    constexpr int kListEveryRank = 1024;
    std::vector<int> absent;
    for (int r = 0; r < n; ++r) {
      if (!all[r].is_object()) {
        const nlohmann::json h = host_of(r);
        if (n > kListEveryRank && !registered[r] && !h.is_string()) {
          absent.push_back(r);
          continue;
        }
        ranks.push_back({{"rank", r}, {"host", h}, {"phases", nlohmann::json::array()},
                         {"reported", false}, {"registered", static_cast<bool>(registered[r])}});
        continue;
      }
      nlohmann::json entry = all[r];
      entry["reported"] = true;
      for (const auto& p : entry["phases"])
        if (p.value("status", "") != "skip") {
          double end = p.value("end_s", 0.0);
          if (end > slowest_end) {
            slowest_end = end;
            slowest = r;
          }
        }
      ranks.push_back(entry);
    }
    auto& res = report.results();
    res["ranks"] = ranks;
    if (!absent.empty()) {
      res["absent_ranks"] = rank_ranges(absent, std::numeric_limits<std::size_t>::max());
      res["absent_rank_count"] = absent.size();
    }
    res["slowest_rank"] = slowest >= 0 ? nlohmann::json(slowest) : nlohmann::json();
    res["timeout_s"] = o.timeout_s;
    if (!bisect.is_null()) res["bisect"] = bisect;
    if (job.monitor) {
      auto wd = job.monitor->failure_report();
      if (!wd.is_null()) res["watchdog"] = wd;
    }
    // One check per phase over every rank that reported.
    std::vector<int> unreported, never_registered, late;
    for (int r = 0; r < n; ++r)
      if (!all[r].is_object()) {
        unreported.push_back(r);
        (registered[r] ? late : never_registered).push_back(r);
      }
    auto list = [](const std::vector<int>& v) { return rank_ranges(v); };
    for (const char* p : kPhases) {
      std::vector<int> failed, ok, skipped;
      for (int r = 0; r < n; ++r) {
        if (!all[r].is_object()) continue;
        for (const auto& ph : all[r]["phases"])
          if (ph.value("name", "") == p) {
            const std::string st = ph.value("status", "");
            (st == "ok" ? ok : st == "fail" ? failed : skipped).push_back(r);
          }
      }
      reports::Check c{p, reports::CheckStatus::kPass, ""};
      if (!failed.empty()) {
        c.status = reports::CheckStatus::kFail;
        c.detail = fmt::format("failed on rank(s) {}", list(failed));
      } else if (ok.empty()) {
        c.status = reports::CheckStatus::kSkip;
        c.detail = "not reached";
      } else {
        c.detail = fmt::format("ok on {} rank(s)", ok.size());
        if (!skipped.empty()) c.detail += fmt::format(", skipped on rank(s) {}", list(skipped));
      }
      report.add_check(c);
    }
    if (world_known)
      report.add_check({"all_ranks_reported",
                        unreported.empty() ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                        unreported.empty()
                            ? fmt::format("{} of {} rank(s) sent a timeline", n, n)
                        : late.empty()
                            ? fmt::format("no timeline from rank(s) {}", list(unreported))
                            : fmt::format("no timeline from rank(s) {} ({}registered at the "
                                          "store, then sent none in time: {})",
                                          list(unreported),
                                          never_registered.empty()
                                              ? std::string()
                                              : fmt::format("never reached the store: {}; ",
                                                            list(never_registered)),
                                          list(late))});
    // Rank 0's own failure, when another rank's is the job's.
    std::optional<reports::ErrorInfo> echo;
    if (cause && (!failure || cause->rank != failure->rank)) {
      if (failure) echo = failure;
      failure = cause;
      rc = cause->exit_code;
    }
    if (failure) report.set_error(*failure);
    if (world_known) {
      record_known_world(job, o, report);
      record_warnings(job, report);
    }
    if (rc == 0 && report.has_failed_check()) rc = static_cast<int>(ExitCode::kCheckFailed);

    if (world_known)
      std::printf("# ddpdiag init-check: %d rank(s), backend %s, launcher %s, timeout %.0f s per phase\n",
                  n, std::string(backend_name(job.backend)).c_str(),
                  std::string(launcher_name(job.world.launcher)).c_str(), o.timeout_s);
    else
      std::printf("# ddpdiag init-check: the environment was rejected, so this process's rank and "
                  "the world size are unknown; timeout %.0f s per phase\n",
                  o.timeout_s);
    std::fputs(timeline_header().c_str(), stdout);
    for (int r = 0; r < n; ++r) {
      if (!all[r].is_object()) {
        const nlohmann::json h = host_of(r);
        // A run of such ranks with no host known is one line (a world whose
        // ranks mostly never came).
        int last = r;
        if (!h.is_string() && ended_pid[r] == 0)
          while (last + 1 < n && !all[last + 1].is_object() && registered[last + 1] == registered[r] &&
                 ended_pid[last + 1] == 0 &&
                 !host_of(last + 1).is_string())
            ++last;
        const std::string who = last == r ? std::to_string(r) : fmt::format("{}-{}", r, last);
        std::printf("  %4s %-12s %-16s %9s %10s  %-4s  %s\n", who.c_str(),
                    h.is_string() ? h.get<std::string>().c_str() : "?", "-", "-", "-", "-",
                    ended_pid[r] != 0
                        ? fmt::format("no timeline: this rank registered at the store, then its process "
                                      "(pid {} on this machine) ended: see its own output",
                                      ended_pid[r]).c_str()
                    : registered[r] ? (last == r ? "no timeline: this rank registered at the store, then sent "
                                                 "none in time (it died, or is still stuck: see its own output)"
                                               : "no timeline: these ranks registered at the store, then sent "
                                                 "none in time (they died, or are still stuck: see their output)")
                    : last == r ? "no timeline: this rank never reached the store"
                                : "no timeline: these ranks never reached the store");
        r = last;
        continue;
      }
      print_timeline(stdout, world_known ? r : -1, all[r].value("host", std::string("?")),
                     all[r]["phases"]);
    }
    if (failure) {
      if (failure->rank >= 0)
        std::printf("# FAILED on rank %d in %s: %s\n", failure->rank, failure->phase.c_str(),
                    failure->message.c_str());
      else
        std::printf("# FAILED in %s (the rank could not be determined): %s\n",
                    failure->phase.c_str(), failure->message.c_str());
      if (!failure->hint.empty()) std::printf("# hint: %s\n", failure->hint.c_str());
      if (echo)
        std::printf("# also on rank %d in %s: %s\n", job.world.rank, echo->phase.c_str(),
                    echo->message.c_str());
    }
    if (!bisect.is_null()) print_bisect(bisect, n);
    // The checks the timeline does not show row by row, as other commands
    // print theirs: a failing bisect or a missing timeline says why the
    // verdict is FAIL when every phase was ok.
    {
      const auto doc = report.finish();
      for (const auto& c : doc["checks"]) {
        const std::string name = c.value("name", std::string());
        if (std::find(std::begin(kPhases), std::end(kPhases), name) != std::end(kPhases)) continue;
        std::printf("# Check %-26s: %s (%s)\n", name.c_str(), c.value("status", std::string()).c_str(),
                    c.value("detail", std::string()).c_str());
      }
      // What the rendezvous warned of, beside the verdict as other commands
      // print it: its first sentence (the whole text went to stderr).
      if (doc["results"].contains("warnings"))
        for (const auto& w : doc["results"]["warnings"]) {
          const auto detail = w.value("detail", std::string());
          std::printf("# Warning %-24s: %s\n", w.value("name", std::string()).c_str(),
                      detail.substr(0, detail.find(". ")).c_str());
        }
    }
    std::printf("# Verdict: %s\n", report.verdict().c_str());
    std::fflush(stdout);
    FinalReportWindow window;
    // A rank that refused its report paths has said so: no second error.
    const bool paths_refused = refusal && report_outputs_refused(o.json_path, o.markdown_path);
    if (!paths_refused && (!o.json_path.empty() || !o.markdown_path.empty())) {
      try {
        reports::write_report_outputs(report.finish(), o.json_path, o.markdown_path);
      } catch (const reports::WriteError& e) {
        // With what to do about it, as every command says it.
        print_error(report_write_error(e, 0));
        if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "ddpdiag: error on rank 0: %s\n", e.what());
        if (rc == 0) rc = static_cast<int>(ExitCode::kUsage);
      }
    }
    window.written(rc);
  }
  FinalReportWindow().written(rc);  // a signal from here on ends the process with rc
  if (refusal) tell_world_of_refusal(job, o, *refusal);
  leave_job(job, rc != 0);
  return rc;
}

}  // namespace

Subcommand add_init_check_command(CLI::App& parent) {
  auto opts = std::make_shared<InitCheckOptions>();
  auto* app = parent.add_subcommand(
      "init-check",
      "Debug an init that hangs or fails: every init phase on every rank with its own deadline, "
      "a per-rank timeline, the cause and a hint");
  add_common_options(app, opts->common);
  app->add_flag("--nccl-debug", opts->nccl_debug,
                "Capture NCCL's INIT/BOOTSTRAP/NET log per rank (NCCL_DEBUG=INFO, "
                "NCCL_DEBUG_FILE) and attach it to the report");
  app->add_flag("--bisect", opts->bisect,
                "After the phases, test sub-groups (hosts alone, pairs, halves) and name the "
                "smallest failing set");
  return {app, [opts] { return run_init_check(*opts); }};
}

}  // namespace ddpdiag::cli
