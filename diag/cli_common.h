// Shared pieces of the distributed subcommands: the common flags, the
// built-in launcher hand-off, rendezvous through the store, communicator
// setup, gathering to rank 0, the report and the mapping of errors to exit
// codes.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/monitored_communicator.h"
#include "comm/store/tcp_store.h"
#include "comm/world.h"
#include "reports/report.h"

namespace ddpdiag::cli {

inline constexpr double kMiB = 1024.0 * 1024.0;
// DDP's default bucket_cap_mb.
inline constexpr double kDefaultCapMb = 25;

// The median (mean of the middle two for an even count; 0 when empty).
double median(std::vector<double> v);

// Prints the error the way every subcommand does.
// A report that could not be written, as the error users read (exit 2,
// phase "report", a hint for a full disk or a bad directory).
UsageError report_write_error(const reports::WriteError& e, int rank);
// error_file: also write it into TORCHELASTIC_ERROR_FILE (under torchrun).
void print_error(const Error& e, bool error_file = true);
// The text print_error writes into TORCHELASTIC_ERROR_FILE.
std::string error_file_text(const Error& e);
// Under torchrun: the worker's failure as torch's @record writes it into
// TORCHELASTIC_ERROR_FILE, so torchrun's summary shows it (print_error does
// this for every error it prints). Nothing without that variable.
void write_torchelastic_error_file(const std::string& message);

// This process's rank once the world is known, else -1.
int current_rank();

// Writes this rank's report of a failure in a library thread, when --json or
// --markdown was given: rank 0 the job's, another rank its own (out.json ->
// out.rank<R>.json, see rank_report_path).
// Returns the path written, or "" (none asked for, or no command running).
std::string write_report_on_terminate(const std::string& message, const std::string& hint);
// A rank's SIGINT or SIGTERM (Ctrl-C, the launcher, the scheduler) writes the
// same report with an "interrupted" error, then exits 128 + the signal, as
// it would have. Installed once per rank process.
void write_report_on_interrupt();

// The path of a rank's own report beside the job's: .rank<R> before the
// extension ext when the path ends in it (out.json -> out.rank1.json), else
// after the whole path (out -> out.rank1). "" stays "".
std::string rank_report_path(const std::string& path, const std::string& ext, int rank);

// Prints the report's checks and verdict under a command's table (rank 0).
void print_checks_and_verdict(const reports::Report& report);

struct CommonOptions {
  WorldFlags world;
  std::string backend = "auto";  // auto | gloo | nccl
  int nproc = 0;                 // > 0: start this many local ranks (built-in launcher)
  double timeout_s = 60;         // every wait on a peer
  std::string json_path;
  std::string markdown_path;
  std::string gloo_interface;
  int gloo_threads = 2;  // Gloo worker threads (collectives in flight at once)
  std::string store_protocol = "auto";  // auto | 1.13 | 2.x
  bool quiet = false;
  bool desync_check = false;      // all-gather fingerprints before every collective
  std::string inject_fault;       // hidden, tests only: monitor.h's Fault spec
  std::string test_hosts;         // hidden, tests only: host name per rank "a,a,b,b"
};

// Adds --rank, --world-size, --local-rank, --master-addr, --master-port,
// --backend, --nproc, --timeout, --json, --gloo-interface, --gloo-threads, --store-protocol,
// --desync-check and the hidden test flags --inject-fault and --test-hosts.
void add_common_options(CLI::App* app, CommonOptions& o);
// Throws CLI::ValidationError for an option of `app` (not its subcommands)
// given an empty value (`-f ''`, `--json "$OUT"` with OUT unset), which
// would read as 0 or as no option at all. main checks every parsed app;
// a parse-complete callback that reads values calls it first, so the empty
// value is named rather than the 0 it read as.
void refuse_empty_values(const CLI::App& app);

// One rank of a running job.
struct Job {
  World world;
  Backend backend = Backend::kGloo;
  // world and backend hold what this rank was started with (discover_world
  // succeeded and the backend was chosen); before that they are defaults.
  bool world_known = false;
  // The rendezvous met a rank's refusal to start ("refused"): rank 0 keeps
  // the store up for the ranks still to come.
  bool world_refused = false;
  // This rank counted itself in the store's "joined" (it registered):
  // only such a rank counts itself in "left", which rank 0 waits on.
  bool joined = false;
  Millis timeout{60000};
  std::unique_ptr<TcpStoreServer> server;  // rank 0 when it hosts the store
  std::shared_ptr<Store> store;            // under this job's ddpdiag prefix
  std::unique_ptr<Communicator> comm;     // a MonitoredCommunicator over the backend's
  MonitoredCommunicator* monitor = nullptr;  // comm, as its watchdog
  CommOptions comm_options;                // what comm was made with (sub-groups reuse it)
  std::vector<reports::RankInfo> ranks;    // every rank's identity, from rendezvous (after
                                           // one that failed: the ranks that had registered)
  std::vector<std::string> rank_builds;     // every rank's ddpdiag version and revision
  std::vector<std::string> rank_libraries;  // every rank's backend library version
  std::vector<reports::Warning> warnings;   // collect_warnings: what the rendezvous found
  std::vector<std::string> machines;       // every rank's real host name (ranks[].host may be
                                           // a --test-hosts name)
  std::optional<TcpStoreClientOptions> store_client;  // how this rank reached the store
  // When the store's TCP connection was last made ({}: never).
  std::chrono::steady_clock::time_point store_connected_at{};
  // Under an agent's store that outlives a run (torchrun): the run this
  // job's ranks agreed on (register_rank), whose keys job.store holds; 0
  // elsewhere. store_root is the store above it (ddpdiag's prefix).
  std::int64_t store_run = 0;
  std::shared_ptr<Store> store_root;
  // Rank 0's side of that agreement while it waits for the others: the
  // hellos it has answered up to, those still to answer, and the deadline
  // the rendezvous started with.
  std::int64_t hellos_scanned = 0;
  std::vector<std::int64_t> hellos_pending;
  std::optional<std::chrono::steady_clock::time_point> rendezvous_deadline;
  bool progress = false;                   // rank 0 shows progress on stderr

  int rank() const { return world.rank; }
  int size() const { return world.world_size; }
  // Every rank's JSON value, on rank 0 (empty elsewhere); through the store,
  // so it works whatever state the communicator is in.
  std::vector<nlohmann::json> gather_to_root(const std::string& key, const nlohmann::json& mine);
  void progress_line(const std::string& line) const;
};

// The phases of starting a job, in order (start_job in cli_common.cpp runs
// them all; init-check runs and times them one by one).
Backend choose_backend(const CommonOptions& o);
StoreProtocol parse_store_protocol(const std::string& s);
// This rank's host name as reported at rendezvous (--test-hosts overrides it).
std::string reported_host_name(const CommonOptions& o, int rank);
std::string machine_name();  // gethostname()
// What tells machines apart: the host name and the kernel's boot id
// ("node1#<uuid>"), so that clones sharing a host name are not taken for one
// machine. Ranks compare it to decide who shares CPUs and process ids.
std::string machine_id();
// The bind address for "every address of this host": "::" (IPv6 and, v4
// mapped, IPv4, as torch's server binds), or "0.0.0.0" where the kernel has
// no IPv6.
std::string every_address();
// Rank 0 hosts the store unless an agent does (no-op otherwise).
void host_store(Job& job);
// The store server's error: its port is held by another process.
bool store_port_taken(const Error& e);
// Connects this rank to the store (a MemoryStore for a world of 1) and sets
// job.store under the job's ddpdiag prefix. Returns the raw client.
// connect_timeout: how long to try (default --timeout).
std::shared_ptr<Store> connect_store(Job& job, const CommonOptions& o,
                                     std::optional<Millis> connect_timeout = std::nullopt);
// Rendezvous: registers this rank (rank/<r>, compare_set so duplicates are
// named), then waits for every rank, naming the missing ones at the deadline
// and the ones that disagree on the world size.
void register_rank(Job& job, const std::string& device, const std::string& host);
// The subcommand's settings every rank must share (each option's value as
// given, or its default), recorded once the command line is parsed. The
// rendezvous compares them: ranks started with different sizes, models or
// dtypes would otherwise run different collectives, and one rank could pass
// while its peers hang. Flags that legitimately differ per rank (rank, sizes
// of the world, store address, report paths, interface, timeout) are left out.
void record_rank_settings(const CLI::App& subcommand);
// --json / --markdown: refused (UsageError) when they name the same file, or
// a path whose directory is missing or not writable, before any work.
void check_report_outputs(const CommonOptions& o);
// The same for a command without CommonOptions (sampler, buckets).
void check_report_outputs(const std::string& json_path, const std::string& markdown_path);
// Whether check_report_outputs would refuse these paths (a rank that did has
// said so, and does not try to write there).
bool report_outputs_refused(const std::string& json_path, const std::string& markdown_path);
void wait_for_ranks(Job& job);
// Once the communicator is up: every rank's device as its backend chose it
// and, on Gloo, the interface, address and link speed it listens on
// (job.ranks; results.rank_network), with rank 0's warnings about them.
void gather_rank_devices(Job& job);
// The device this rank asks its backend for ("cuda:<local rank>" or "cpu"),
// as registered at the rendezvous.
std::string requested_device(const Job& job);
// The world as far as this rank knows it, into report.world: nothing before
// the world was known (job.world_known; the world stays null); then its size,
// backend, launcher and the backend library this process runs, and the ranks
// whose identity it has: every rank after the rendezvous, the ones that had
// registered when it failed, and at least this rank itself. Called again as
// the job gets further, it replaces what was recorded before.
void record_known_world(const Job& job, const CommonOptions& o, reports::Report& report);
// The report a SIGINT/SIGTERM writes (with the error "interrupted"), as it
// stands now (a copy): rank 0's to --json, another rank's beside it.
void arm_report(const reports::Report& report, const CommonOptions& o);
void disarm_report();
// What a SIGINT/SIGTERM prints on stdout before it ends a run that has not
// finished (init-check: the timeline so far). `text` is printed as it is;
// with `running` set, one more line follows: running_prefix, then how long
// ago `since` was ("running for 12.3 s when stopped"), for the step the run
// was in. An empty text prints nothing.
void arm_stop_text(std::string text, bool running = false, std::string running_prefix = {},
                   std::chrono::steady_clock::time_point since = {});
// The window in which a command writes its final report itself (the armed
// one is disarmed): a SIGINT/SIGTERM that comes meanwhile waits for the
// write, so no report is lost or left half-written, and once written(rc) is
// called it ends the process at once with rc, the run's own exit code
// (rather than calling a finished run interrupted, or blaming a peer that
// ended normally).
class FinalReportWindow {
 public:
  FinalReportWindow();
  ~FinalReportWindow();
  FinalReportWindow(const FinalReportWindow&) = delete;
  FinalReportWindow& operator=(const FinalReportWindow&) = delete;
  void written(int rc);

 private:
  bool held_ = false;
};
// This process's rank, once known, for messages and the armed report.
void note_current_rank(int rank);
// Creates the backend's communicator, wrapped in a MonitoredCommunicator.
void create_communicator(Job& job, const CommonOptions& o);
// Rank 0 keeps the store up until every rank has left (bounded).
void leave_job(Job& job, bool after_error);
// A rank that refused to start before the rendezvous (a usage error, the
// world known, no store yet) posts why at the store, rank 0 hosting it all
// the same, so that the others stop at once instead of waiting out
// --timeout (cli_common.cpp says when and how long).
void tell_world_of_refusal(Job& job, const CommonOptions& o, const std::string& why);
void tell_store_of_world_refusal(Job& job, const CommonOptions& o, const EnvLookup& env,
                                 const std::string& why);
reports::ErrorInfo to_error_info(const Error& e);
// After the rendezvous: the warnings of diag/placement.h (ranks that run
// different ddpdiag builds or backend library versions; Gloo ranks short of
// CPUs) into job.warnings, each printed on rank 0's stderr as a
// "ddpdiag: warning:" line, before the backend starts (a mismatch may make
// it fail).
void collect_warnings(Job& job);
// Gloo jobs: each rank's allowed CPUs in results.rank_cpus; job.warnings in
// results.warnings.
void record_warnings(const Job& job, reports::Report& report);
// The hint for a loopback MASTER_ADDR in a job that spans hosts ("" when
// that is not the case): ranks on other hosts reach their own loopback.
std::string loopback_hint(const World& w);
// On the rank that hosts the store: why MASTER_ADDR, where the other ranks
// look for it, does not lead here ("" when it does, or was not given).
std::string master_addr_problem(const World& w);

using JobBody = std::function<void(Job&, reports::Report&)>;

// Runs a distributed command from start to end on this process: hands off to
// the built-in launcher when asked (--nproc, or no launcher and no rank flags:
// the default world), else discovers the world, rendezvouses, creates the
// communicator, runs the body, writes the report on rank 0 (also after a
// failure, with what was measured) and returns the exit code.
// Hands off to the built-in launcher when asked (--nproc, or no launcher and
// no rank flags) and returns its exit code; nullopt when this process is a rank.
// A refused line (--nproc with --master-port, ...) throws UsageError after
// writing the `command`'s report where --json/--markdown ask.
std::optional<int> launch_if_asked(const CommonOptions& o, const std::string& command);

// `before_start`: checks of this rank's own (its host's memory) once the
// world is known and before the rendezvous, so that no rank has allocated
// anything yet when any rank checks; what it throws is that rank's error.
int run_distributed(const CommonOptions& o, const std::string& command, const JobBody& body,
                    const std::function<void(const Job&)>& before_start = {});

// An interface, its address and link speed as the tables show them:
// "eth0 10.0.0.1 (25 Gb/s)", "lo 127.0.0.1" (speed unknown: <= 0), "?" for
// an interface not known.
std::string network_text(const std::string& iface, const std::string& ip, int speed_mbps);
// The same for where rank r's backend listens (its net_* fields), then the
// interfaces other than that one its routes to peers leave by (", to rank 2
// by eno1 (1 Gb/s)", with " via gateway 10.0.0.254" when `gateways`); ""
// where the backend does not say (NCCL).
std::string rank_network_text(const reports::RankInfo& r, bool gateways);

// Flag checks with plain messages ("--iters: must be a number > 0, not '0'"):
// CLI11's own print the whole double range and call a non-number "out of
// range".
CLI::Validator number_above(double lo);
CLI::Validator positive_number();  // number_above(0)
CLI::Validator non_negative_number();
CLI::Validator number_in_range(double lo, double hi);
// For flags held in a 64-bit integer: a value beyond its range is refused
// with that value ("99999999999999999999 does not fit ..."), where CLI11
// alone would go on with 2^63 - 1 in its place.
CLI::Validator int64_value();

// bucket_cap_mb values from "1,5,25" (MiB, each at least a byte and <= 1e6): sorted,
// without repeats. Throws UsageError naming --caps, with `rank` in its context.
std::vector<double> parse_caps(const std::string& s, int rank = -1);
// The flag check of --caps: the same parse, so the launcher refuses a typo
// before any rank starts.
CLI::Validator caps_value();

// Parses sizes with binary suffixes as nccl-tests does: 8, 1K, 64M, 1G.
// Throws UsageError for what is not a size, and for a size of 2^64 bytes or
// more (it would wrap around): at most kMaxSizeBytes.
std::size_t parse_size(const std::string& s);
inline constexpr std::uint64_t kMaxSizeBytes = 18446744073709551615ull;
std::string size_too_large(const std::string& s);  // "'1E30' is too large (at most ...)"
// "<max> is below <min_flag> <min> (swap them)" when both parse and max < min.
std::optional<std::string> size_order_problem(const std::string& min_flag, const std::string& min_value,
                                              const std::string& max_value);

// A bucket cap in MiB (--bucket-cap-mb, --first-bucket-mb) as DDP turns it
// into bytes: int(mb * 1024 * 1024) in double arithmetic, as Python's floats.
// Refused (UsageError naming `flag` and `rank`) below 0, above 1e12 MiB
// (the bytes would leave uint64), and at 0 unless `zero_ok` (torch 1.13's
// DDP takes a cap of 0; the reducer needs a positive one).
std::uint64_t bucket_cap_bytes(double mb, const char* flag, int rank, bool zero_ok = false);

// The flag check of a bucket cap in MiB: what bucket_cap_bytes refuses
// (a cap under one byte, unless zero_ok and 0), before any rank starts.
CLI::Validator bucket_mb_value(bool zero_ok);

// torch 2.x's DDP(bucket_cap_mb_list=[...]): the size limits of the buckets
// in order, the last repeating, in place of bucket_cap_mb and the first
// bucket's 1 MiB. --bucket-cap-mb-list takes them as "1,4,25" (MiB, kept in
// the order given, repeats allowed).
struct BucketCapList {
  std::vector<double> mb;              // as given
  std::vector<std::uint64_t> bytes;    // each int(mb * 1024 * 1024), as DDP
  bool empty() const { return mb.empty(); }
  std::uint64_t max_bytes() const;     // DDP's bucket_bytes_cap with a list
  double max_mb() const;               // and its bucket_cap_mb
  std::string text() const;            // "[1, 4, 25]"
};
// Parses --bucket-cap-mb-list: each value a number of MiB as
// bucket_cap_bytes takes it (0 only with `zero_ok`, and never all of them:
// torch refuses a list whose largest value is 0). "" gives an empty list.
// Throws UsageError naming the flag and `rank`.
BucketCapList parse_cap_list(const std::string& s, int rank, bool zero_ok);
// The flag check of a --bucket-cap-mb-list value: parse_cap_list's.
CLI::Validator cap_list_value(bool zero_ok);
// The bucket sizes a command runs with: --bucket-cap-mb-list when given
// (its largest is DDP's cap then, its first the first bucket's limit), else
// --bucket-cap-mb and --first-bucket-mb, each checked by bucket_cap_bytes
// (0 only with `zero_ok`). limits() is what the bucket functions take.
struct BucketSizes {
  BucketCapList list;
  std::uint64_t cap_bytes = 0;
  std::uint64_t first_bytes = 0;
  std::vector<std::uint64_t> limits() const;
};
BucketSizes bucket_sizes(double cap_mb, double first_mb, const std::string& cap_list, int rank, bool zero_ok);
// Adds --skip-all-reduce-unused-params (torch 2.x's
// DDP(skip_all_reduce_unused_params=True)) to `app`; `what` says what the
// command does with it.
CLI::Option* add_skip_unused_flag(CLI::App* app, bool& value, const std::string& what);
// Adds --set-last-bucket-cap: what DDP does when the environment variable
// DDP_SET_LAST_BUCKET_CAP is 1 (the first bucket's small limit goes to the
// bucket reduced last, in the buckets DDP rebuilds).
CLI::Option* add_set_last_bucket_cap_flag(CLI::App* app, bool& value);
// Whether a command runs with DDP_SET_LAST_BUCKET_CAP's buckets: its
// --set-last-bucket-cap flag, or the variable set to "1" in this process's
// environment, as torch's reducer reads it (any other value is off there).
bool set_last_bucket_cap(bool flag);
// For a command's header: "" when `on` is false; else ", DDP_SET_LAST_BUCKET_CAP=1"
// and what it does to these buckets: the first limit on the last bucket when
// DDP rebuilds them (static_graph, or neither find_unused_parameters nor the
// first iteration's buckets), else no effect.
std::string set_last_bucket_cap_note(bool on, bool find_unused, bool static_graph, bool first_iteration = false);
// Adds --bucket-cap-mb-list to `app`, checked as parse_cap_list checks it
// before any rank starts, and excluding the options it replaces (the
// command's --bucket-cap-mb and --first-bucket-mb).
CLI::Option* add_cap_list_option(CLI::App* app, std::string& value, bool zero_ok,
                                 std::initializer_list<CLI::Option*> replaces);

// --timeout: seconds from kMinTimeoutS to kMaxTimeoutS (about 115 days,
// far inside what the clocks' deadlines hold; a larger one overflowed them).
inline constexpr double kMinTimeoutS = 0.001;
inline constexpr double kMaxTimeoutS = 1e7;
CLI::Validator timeout_value();

// Refuses (UsageError naming --compute-gbps) a rate at which the simulated
// backward of gradient_bytes would take over an hour a step; 0 is no
// compute time.
void check_backward_rate(std::uint64_t gradient_bytes, double gbps, int rank);
// --gradient-as-bucket-view (and --gradient-views) sets views; --no-views
// and --no-gradient-views say DDP's default (False) explicitly.
void add_gradient_view_flags(CLI::App* app, bool& views);

// Ranks as ranges, "0-3,8" (a run of consecutive ranks as first-last), at
// most max_ranges of them and then how many ranks more: the lists of
// missing or failed ranks stay one short line in a world of any size.
std::string format_rank_ranges(const std::vector<std::pair<int, int>>& ranges, std::size_t max_ranges = 32);
std::string rank_ranges(std::vector<int> ranks, std::size_t max_ranges = 32);

// The entries of a comma-separated flag value ("" gives none). Throws
// UsageError naming `flag` (and `rank`) for an empty entry ("1,,5", "1,5,").
std::vector<std::string> split_list(const std::string& s, const std::string& flag,
                                    const std::string& example, int rank = -1);
// Refuses (exit 2) a run whose buffers cannot fit in this host's memory:
// `per_rank` bytes for each of the job's ranks on this host, against what
// host_memory_available says is left (MemAvailable, or the cgroup's limit).
// `what` names the buffers; the hint says to use smaller sizes.
// `this_rank_extra` is what this rank alone holds beyond that (dp-vs-ring's
// gather root), named by `extra_what`. Called from
// run_distributed's before_start, so no rank reads memory another one has
// already taken.
// Byte counts in long double: products of sizes up to 2^64 - 1 must not wrap.
void check_host_memory(const Job& job, long double per_rank, const std::string& what,
                       const std::string& hint, long double this_rank_extra = 0,
                       const std::string& extra_what = {});
// For the commands that reduce a model's gradients with the reducer
// (ddp-step, bucket-sweep, memory), before the rendezvous: on NCCL a layout
// with a sparse trainable parameter is refused (UsageError, exit 2) as the
// reducer would refuse it after NCCL's init. A layout that cannot be read is
// left to the command.
void refuse_sparse_on_device(const Job& job, const std::string& model);  // ddp_core::refuse_sparse_on_device

// check_host_memory for a command that runs a model layout (ddp-step,
// bucket-sweep, memory, broadcast-test), on Gloo: per rank, `grad_copies`
// times the layout's trainable bytes plus `param_copies` times all its
// parameter bytes, a lower bound of what the command holds. A layout that
// cannot be read is left to the command, which says why.
// With sparse_rows (ddp-step --sparse-rows), the simulated sparse gradients
// too (on the host, with either backend). extra_bytes: more the command
// holds beside them on Gloo (memory's --workspace-mb), named by extra_what.
void check_layout_memory(const Job& job, const std::string& model, int grad_copies,
                         int param_copies, std::optional<std::int64_t> sparse_rows = std::nullopt,
                         long double extra_bytes = 0, const std::string& extra_what = {});
std::string format_size(std::size_t bytes);  // 1K, 64M, 3 ...
// A flag check that the value parses as a size, so that a typo is refused by
// the launcher before any rank starts.
CLI::Validator size_value();
// The same, and the size must not be 0 ("must be a size > 0, not 0 (<hint>)").
CLI::Validator positive_size_value(const std::string& hint);

// The check of a run subcommand's --json and --markdown: a path. "-" is
// refused (exit 2) rather than taken as a file named "-": the command prints
// its table on stdout, so a report there would be mixed with it. (report
// render --markdown - is the way to a report on stdout.)
inline CLI::Validator report_path_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        if (s.empty())
          return "an empty path: give a file path (is the variable that should hold it set?)";
        if (s != "-") return "";
        return "'-' (stdout) is not supported here, the command prints its own output there: give a "
               "file path, e.g. out.json, then ddpdiag report render --markdown - out.json";
      },
      "PATH", "REPORT_PATH");
}

}  // namespace ddpdiag::cli
