// The JSON report model: one report per job, written by rank 0. Reports are
// data (nlohmann::json with snake_case keys, real numbers, null and booleans);
// renderers only format them. Writes are atomic: a temporary file in the same
// directory, fsync, then rename, so a killed run never leaves half a file.
#pragma once

#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace ddpdiag::reports {

inline constexpr const char* kSchema = "ddpdiag.report/1";

enum class CheckStatus { kPass, kFail, kSkip };
std::string_view check_status_name(CheckStatus s);  // "pass", "fail", "skip"

struct Check {
  std::string name;    // e.g. "correctness", "min_busbw"
  CheckStatus status = CheckStatus::kPass;
  std::string detail;  // what was measured against what
};

struct ErrorInfo {
  std::string kind;     // usage, rendezvous, timeout, peer, backend, check, internal
  std::string message;
  std::string phase;
  int rank = -1;
  int peer = -1;
  std::string hint;
  int exit_code = 0;
};

// One rank's identity, as gathered to rank 0.
struct RankInfo {
  int rank = 0;
  int local_rank = 0;
  std::string host;
  int pid = 0;
  std::string device;
  std::string cpus;  // the CPUs the rank may run on, "0-3,8" ("" when unknown);
                     // reported in results.rank_cpus, not in world.ranks
  // Gloo runs: the interface the rank's backend listens on (its traffic to
  // other hosts), its address and link speed; and, when the rank's host has
  // an interface with a higher known speed, that one. Reported in
  // results.rank_network. "" / -1 when unknown.
  std::string net_interface{};
  std::string net_address{};
  int net_speed_mbps = -1;
  std::string faster_interface{};
  int faster_speed_mbps = -1;
  std::vector<std::string> faster_networks{};  // "10.1.0.3/24": the faster interface's networks
  std::vector<std::string> host_addresses{};   // every non-loopback address of the rank's host
  // Where the rank's host routes its traffic to some peers out by another
  // interface than net_interface (`ip route get PEER`): per such
  // interface, its speed (-1 unknown), the gateway ("" on-link) and the
  // peers. Empty when every route to a peer on another host leaves by
  // net_interface. Reported in results.rank_network (egress).
  struct Egress {
    std::string interface;
    int speed_mbps = -1;
    std::string gateway;
    std::vector<int> peers;
  };
  std::vector<Egress> egress{};
};

// The speed (Mb/s) of the link rank r's traffic to `peer` leaves by: the
// egress interface that carries it, else net_interface's; -1 when unknown.
int link_speed_to(const RankInfo& r, int peer);
// The slowest link rank r's traffic to other hosts leaves by (its
// listener's and every egress interface's); -1 when any is unknown.
int slowest_link_of(const RankInfo& r);

// Something the user should know that is not a failed check (the verdict
// does not change), e.g. ranks placed so that Gloo's threads lack a CPU.
// Reported in results.warnings.
struct Warning {
  std::string name;    // e.g. "cpu_oversubscribed"
  std::string detail;  // what was found and what to do
};

class Report {
 public:
  Report(std::string command, std::vector<std::string> argv);

  void set_world(int world_size, const std::string& backend, const std::string& launcher,
                 const std::vector<RankInfo>& ranks,
                 const std::map<std::string, std::string>& library_versions);
  // Gloo runs only: how many collectives may be in flight at once.
  // One more field of world (set after set_world).
  void set_world_field(const std::string& key, const nlohmann::json& value);
  void set_gloo_threads(int threads);
  void set_environment(const std::map<std::string, std::string>& env);
  // Command-specific results; merged into "results".
  nlohmann::json& results() { return doc_["results"]; }
  void add_check(const Check& c);
  void set_error(const ErrorInfo& e);

  // "PASS" when every check passed (skips allowed) and there is no error,
  // "FAIL" when a check failed, "ERROR" when the run ended with an error.
  std::string verdict() const;
  bool has_failed_check() const;
  // The names of the checks that failed, in the order they were added.
  std::vector<std::string> failed_checks() const;

  // Fills duration and verdict and returns the document.
  nlohmann::json finish() const;

 private:
  nlohmann::json doc_;
  std::vector<Check> checks_;
  std::optional<ErrorInfo> error_;
  std::chrono::steady_clock::time_point started_;
};

// A report file that could not be written (the path and errno text): the
// caller's path is wrong more often than not, so the command line maps it to
// a usage error (exit 2) with a hint.
class WriteError : public std::runtime_error {
 public:
  WriteError(const std::string& what, int error_number)
      : std::runtime_error(what), error_number_(error_number) {}
  int error_number() const { return error_number_; }  // errno of the failed call

 private:
  int error_number_;
};

// Atomic write: a temporary .ddpdiag.<pid>.<random hex>.tmp in the same
// directory (short, so any valid FILE name works), fsync, rename. A file
// replaced keeps its permission bits; a new one is 0644 less the umask.
// Throws WriteError with the path and errno text on failure.
// A symbolic link is followed (the file it names is replaced, the link kept);
// a device or pipe (/dev/stdout, a FIFO) is written through, not replaced.
// The temporary is created with O_EXCL | O_NOFOLLOW under an unguessable name.
void write_file_atomic(const std::string& path, const std::string& content);
// Why a report could not be written at `path`, found before any work is done
// (its directory missing or not writable, the path a directory), or nullopt.
std::optional<std::string> output_path_problem(const std::string& path);
// Why content could not be appended to `path` (GitHub's step summary), found
// before any work is done: a directory, a file that cannot be written, or,
// for a file not there yet, what output_path_problem finds; or nullopt.
std::optional<std::string> append_path_problem(const std::string& path);
// A regular file with no write permission for anyone (a kept report):
// never replaced or appended to, even by root, whom access() lets write.
bool is_read_only_file(const std::string& path);
// Appends content to path (created if missing). A write that fails part-way
// (a full disk, a file size limit) is taken back, so the file keeps what it
// had. Where the file does not end in a newline, one goes first, so that
// what is appended starts on a line of its own. Throws WriteError ("cannot
// append to PATH: ...").
void append_file(const std::string& path, const std::string& content);
// Whether two paths name the same regular file (links followed; for files
// that do not exist yet, the same normalised path). A device is never "the
// same file": /dev/null may take two outputs.
bool same_file(const std::string& a, const std::string& b);
void write_json_atomic(const std::string& path, const nlohmann::json& doc);
// Reads and parses a report; throws std::runtime_error naming the file.
nlohmann::json read_json(const std::string& path);
// What read_json throws for a file that repeats a key in one object
// ({"verdict": "FAIL", "verdict": "PASS"}): JSON's own rules leave which one
// counts open, so a report that does is refused rather than read as the last
// one says. `pointer`: the repeated key's JSON pointer ("/verdict").
class DuplicateKeyError : public std::runtime_error {
 public:
  DuplicateKeyError(const std::string& what, std::string pointer)
      : std::runtime_error(what), pointer_(std::move(pointer)) {}
  const std::string& pointer() const { return pointer_; }

 private:
  std::string pointer_;
};

// ISO 8601 UTC with milliseconds, e.g. 2026-11-29T11:30:26.123Z.
std::string utc_timestamp(std::chrono::system_clock::time_point t);

}  // namespace ddpdiag::reports
