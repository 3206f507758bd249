#include "reports/report.h"

#include "comm/input_file.h"
#include "comm/json_bounded.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <climits>
#include <cstdint>
#include <random>
#include <filesystem>
#include <optional>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include <fmt/core.h>

#include "ddpdiag/config.h"

namespace ddpdiag::reports {

std::string_view check_status_name(CheckStatus s) {
  switch (s) {
    case CheckStatus::kPass: return "pass";
    case CheckStatus::kFail: return "fail";
    case CheckStatus::kSkip: return "skip";
  }
  return "unknown";
}

int link_speed_to(const RankInfo& r, int peer) {
  for (const auto& e : r.egress)
    if (std::find(e.peers.begin(), e.peers.end(), peer) != e.peers.end()) return e.speed_mbps > 0 ? e.speed_mbps : -1;
  return r.net_speed_mbps > 0 ? r.net_speed_mbps : -1;
}

int slowest_link_of(const RankInfo& r) {
  int slowest = r.net_speed_mbps > 0 ? r.net_speed_mbps : -1;
  for (const auto& e : r.egress) {
    if (slowest < 0) break;
    slowest = e.speed_mbps > 0 ? std::min(slowest, e.speed_mbps) : -1;
  }
  return slowest;
}

std::string utc_timestamp(std::chrono::system_clock::time_point t) {
  auto secs = std::chrono::system_clock::to_time_t(t);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count() %
            1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, static_cast<int>(ms));
}

Report::Report(std::string command, std::vector<std::string> argv)
    : started_(std::chrono::steady_clock::now()) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  doc_ = {
      {"schema", kSchema},
      {"tool", {{"name", "ddpdiag"}, {"version", config::kVersion},
                {"git_revision", config::kGitRevision}}},
      {"command", std::move(command)},
      {"argv", std::move(argv)},
      {"started_at", utc_timestamp(std::chrono::system_clock::now())},
      {"duration_s", nullptr},
      {"world", nullptr},
      {"environment", nlohmann::json::object()},
      {"results", nlohmann::json::object()},
      {"checks", nlohmann::json::array()},
      {"verdict", nullptr},
      {"error", nullptr},
  };
  doc_["context_host"] = host;
}

void Report::set_world(int world_size, const std::string& backend, const std::string& launcher,
                       const std::vector<RankInfo>& ranks,
                       const std::map<std::string, std::string>& library_versions) {
  nlohmann::json jranks = nlohmann::json::array();
  std::vector<std::string> hosts;
  for (const auto& r : ranks) {
    jranks.push_back({{"rank", r.rank}, {"local_rank", r.local_rank}, {"host", r.host},
                      {"pid", r.pid}, {"device", r.device}});
    if (std::find(hosts.begin(), hosts.end(), r.host) == hosts.end()) hosts.push_back(r.host);
  }
  doc_["world"] = {{"size", world_size},      {"backend", backend},
                   {"launcher", launcher},    {"hosts", hosts},
                   {"ranks", jranks},         {"library_versions", library_versions}};
}

void Report::set_gloo_threads(int threads) { doc_["world"]["gloo_threads"] = threads; }

void Report::set_world_field(const std::string& key, const nlohmann::json& value) {
  if (!doc_["world"].is_object()) return;  // no world yet: nothing to add to
  doc_["world"][key] = value;
}

void Report::set_environment(const std::map<std::string, std::string>& env) {
  doc_["environment"] = env;
}

void Report::add_check(const Check& c) { checks_.push_back(c); }

void Report::set_error(const ErrorInfo& e) { error_ = e; }

bool Report::has_failed_check() const {
  for (const auto& c : checks_)
    if (c.status == CheckStatus::kFail) return true;
  return false;
}

std::vector<std::string> Report::failed_checks() const {
  std::vector<std::string> out;
  for (const auto& c : checks_)
    if (c.status == CheckStatus::kFail) out.push_back(c.name);
  return out;
}

std::string Report::verdict() const {
  if (error_ && error_->kind != "check") return "ERROR";
  if (has_failed_check() || error_) return "FAIL";
  return "PASS";
}

nlohmann::json Report::finish() const {
  nlohmann::json out = doc_;
  out.erase("context_host");
  out["duration_s"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started_).count();
  nlohmann::json checks = nlohmann::json::array();
  for (const auto& c : checks_)
    checks.push_back({{"name", c.name},
                      {"status", check_status_name(c.status)},
                      {"detail", c.detail}});
  out["checks"] = checks;
  out["verdict"] = verdict();
  if (error_) {
    out["error"] = {{"kind", error_->kind},
                    {"message", error_->message},
                    {"phase", error_->phase},
                    {"rank", error_->rank >= 0 ? nlohmann::json(error_->rank) : nlohmann::json()},
                    {"peer", error_->peer >= 0 ? nlohmann::json(error_->peer) : nlohmann::json()},
                    {"hint", error_->hint},
                    {"exit_code", error_->exit_code}};
  }
  return out;
}

namespace {

// Where a write to `path` lands: a symbolic link is followed to the file it
// names (a "latest.json" link keeps pointing at its file), relative links
// from the link's own directory.
std::string resolve_links(const std::string& path) {
  std::string p = path;
  for (int depth = 0; depth < 40; ++depth) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p;
    std::string target(PATH_MAX, '\0');
    const ssize_t n = ::readlink(p.c_str(), target.data(), target.size());
    if (n <= 0) return p;
    target.resize(static_cast<std::size_t>(n));
    if (target.front() != '/') {
      const auto slash = p.rfind('/');
      if (slash != std::string::npos) target = p.substr(0, slash + 1) + target;
    }
    p = target;
  }
  return p;
}

void write_all(int fd, const std::string& content, const std::string& path, const std::string& what) {
  const char* p = content.data();
  std::size_t left = content.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw WriteError(fmt::format("cannot write report {}: {} ({})", path, std::strerror(errno), what),
                       errno);
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

// The directory part of a path, with its trailing slash ("" for a bare name).
std::string directory_prefix(const std::string& path) {
  const auto slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// The temporary for `target` (links resolved): short and in the target's
// directory, whatever the length of the target's own name (a 250-byte name
// plus a suffix would pass NAME_MAX). Hidden, so a glob for reports skips it.
std::string temporary_name(const std::string& target, std::uint32_t nonce) {
  return fmt::format("{}.ddpdiag.{}.{:08x}.tmp", directory_prefix(target), static_cast<long>(::getpid()), nonce);
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& content) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    if (S_ISDIR(st.st_mode))
      throw WriteError(fmt::format("cannot write report {}: it is a directory", path), EISDIR);
    // A device or a pipe (/dev/stdout, /dev/null, a FIFO a tool reads):
    // written through, never replaced by a file of our own.
    // A FIFO opens for writing only once a reader has it open: waited for
    // 10 s (O_NONBLOCK fails with ENXIO meanwhile), then an error rather
    // than a process blocked for good in open().
    const bool fifo = S_ISFIFO(st.st_mode);
    int fd = -1;
    for (int waited_ms = 0;; waited_ms += 50) {
      fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY | (fifo ? O_NONBLOCK : 0));
      if (fd >= 0 || !fifo || errno != ENXIO || waited_ms >= 10000) break;
      ::usleep(50 * 1000);
    }
    if (fd < 0 && fifo && errno == ENXIO)
      throw WriteError(fmt::format("cannot write report {}: it is a FIFO that nothing read from for 10 s", path),
                       ENXIO);
    if (fd < 0)
      throw WriteError(fmt::format("cannot write report {}: {}", path, std::strerror(errno)), errno);
    if (fifo) (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    try {
      write_all(fd, content, path, "writing to the device");
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    return;
  }
  const std::string target = resolve_links(path);
  // A fresh temporary of a name nobody can have prepared: O_EXCL and
  // O_NOFOLLOW refuse one that exists (a link planted to redirect the write).
  std::random_device rd;
  std::string tmp;
  int fd = -1;
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    tmp = temporary_name(target, rd());
    fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0) {
    const int err = errno;
    throw WriteError(
        fmt::format("cannot write report {}: {} (creating {})", path, std::strerror(err), tmp), err);
  }
  try {
    // A file replaced keeps its permissions (a report kept private stays so).
    struct stat old {};
    if (::stat(target.c_str(), &old) == 0 && S_ISREG(old.st_mode) && ::fchmod(fd, old.st_mode & 07777) != 0)
      throw WriteError(fmt::format("cannot write report {}: {} (setting the mode of {})", path,
                                   std::strerror(errno), tmp),
                       errno);
    write_all(fd, content, path, "writing " + tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  // The data must be on disk before the rename makes it visible under the
  // final name; otherwise a crash could leave an empty file there.
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw WriteError(fmt::format("cannot write report {}: {} (writing {})", path, std::strerror(err), tmp), err);
  }
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw WriteError(
        fmt::format("cannot move report into place at {}: {}", path, std::strerror(err)), err);
  }
}

bool is_read_only_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && !(st.st_mode & (S_IWUSR | S_IWGRP | S_IWOTH));
}

void append_file(const std::string& path, const std::string& content) {
  // Read access only to see the last byte (a file that may be written but
  // not read is appended to as it is).
  int fd = ::open(path.c_str(), O_RDWR | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EACCES) fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    throw WriteError(fmt::format("cannot append to {}: {}", path, std::strerror(err)), err);
  }
  char last = '\n';
  if (S_ISREG(st.st_mode) && st.st_size > 0 && ::pread(fd, &last, 1, st.st_size - 1) != 1) last = '\n';
  try {
    write_all(fd, last == '\n' ? content : "\n" + content, path, "appending");
  } catch (const WriteError& e) {
    if (S_ISREG(st.st_mode)) (void)!::ftruncate(fd, st.st_size);
    ::close(fd);
    throw WriteError(fmt::format("cannot append to {}: {} (what was written of it was taken back)", path,
                                 std::strerror(e.error_number())),
                     e.error_number());
  }
  if (::close(fd) != 0)
    throw WriteError(fmt::format("cannot append to {}: {}", path, std::strerror(errno)), errno);
}

std::optional<std::string> output_path_problem(const std::string& path) {
  if (path.empty()) return std::nullopt;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) return fmt::format("{} is a directory", path);
    // A report made read-only (a kept baseline) is not replaced, even by
    // root, whom access() would let write anything.
    if (is_read_only_file(path)) return fmt::format("{} is read-only (a kept report?); it is not replaced", path);
    if (!S_ISREG(st.st_mode)) return ::access(path.c_str(), W_OK) == 0
                                         ? std::nullopt
                                         : std::optional<std::string>(fmt::format(
                                               "{} is not writable: {}", path, std::strerror(errno)));
  }
  const std::string target = resolve_links(path);
  const auto slash = target.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : target.substr(0, slash);
  if (::stat(dir.c_str(), &st) != 0)
    return fmt::format("the directory {} of {} does not exist", dir, path);
  if (!S_ISDIR(st.st_mode)) return fmt::format("{} (in the path {}) is not a directory", dir, path);
  if (::access(dir.c_str(), W_OK | X_OK) != 0)
    return fmt::format("the directory {} of {} is not writable: {}", dir, path, std::strerror(errno));
  // access() lets root through where creating a file still fails (/proc,
  // some special file systems): create (and remove) a file beside the
  // target, as the report's own write will.
  const std::string probe = fmt::format("{}.ddpdiag.probe.{}.tmp", directory_prefix(target), static_cast<long>(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    if (errno == EEXIST) return std::nullopt;
    return fmt::format("cannot create a file in the directory {} of {}: {}", dir, path,
                       std::strerror(errno));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return std::nullopt;
}

std::optional<std::string> append_path_problem(const std::string& path) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return output_path_problem(path);  // created by the append
  if (S_ISDIR(st.st_mode)) return fmt::format("{} is a directory", path);
  if (is_read_only_file(path)) return fmt::format("{} is read-only", path);
  if (::access(path.c_str(), W_OK) != 0) return fmt::format("{} is not writable: {}", path, std::strerror(errno));
  return std::nullopt;
}

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  const std::string ra = resolve_links(a), rb = resolve_links(b);
  struct stat sa {}, sb {};
  if (::stat(a.c_str(), &sa) == 0 && ::stat(b.c_str(), &sb) == 0)
    // A device or pipe (/dev/null) takes both writes; only a file would lose one.
    return S_ISREG(sa.st_mode) && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
  // Absolute first: weakly_canonical leaves a relative path none of whose
  // leading parts exists as it is, so "r.json" and "./r.json" (neither
  // written yet) would compare unequal.
  std::error_code ec1, ec2;
  const auto ca = std::filesystem::weakly_canonical(std::filesystem::absolute(ra, ec1), ec1);
  const auto cb = std::filesystem::weakly_canonical(std::filesystem::absolute(rb, ec2), ec2);
  return !ec1 && !ec2 ? ca == cb : ra == rb;
}

void write_json_atomic(const std::string& path, const nlohmann::json& doc) {
  // Bytes that are not UTF-8 (a Latin-1 path in argv, say) become U+FFFD
  // rather than failing the whole report.
  write_file_atomic(path, doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n");
}

nlohmann::json read_json(const std::string& path) {
  // A sampler report of 10^7 indices is about 100 MB; no report nears 1 GiB.
  constexpr std::size_t kMaxReportBytes = std::size_t{1} << 30;
  std::string text;
  try {
    text = read_input_file(path, kMaxReportBytes);
  } catch (const InputFileError& e) {
    throw std::runtime_error(fmt::format("{}: {}{}", path, e.what(),
                                         e.kind() == InputFileError::Kind::kNotAFile ? ", not a report file" : ""));
  }
  try {
    return parse_json_bounded(text, true);
  } catch (const JsonDuplicateKey& e) {
    throw DuplicateKeyError(fmt::format("{}: {}; a report names each field once, so it is not read (edited "
                                        "by hand?)",
                                        path, e.what()),
                            e.pointer());
  } catch (const JsonTooDeep& e) {
    throw std::runtime_error(
        fmt::format("{}: {}; no ddpdiag report does, so it is not read (is it a report?)", path, e.what()));
  } catch (const nlohmann::json::parse_error& e) {
    throw std::runtime_error(fmt::format("{} is not valid JSON: {}", path, e.what()));
  } catch (const nlohmann::json::exception& e) {
    // Valid syntax that cannot be held, e.g. a number past the range of a
    // double (1e400): out_of_range.406.
    throw std::runtime_error(fmt::format("{} cannot be read as a report: {}", path, e.what()));
  } catch (const std::bad_alloc&) {
    // Parsed, JSON takes many times its text (a number of 2 bytes becomes a
    // node of 16, plus its array's share): a file of hundreds of MB can
    // exhaust a process's memory limit.
    const double mib = static_cast<double>(text.size()) / (1 << 20);
    text = std::string();  // its memory back for the message
    throw std::runtime_error(fmt::format(
        "{}: out of memory reading its {:.0f} MiB as JSON (parsed, JSON takes up to 16 times its "
        "size): raise this process's memory limit (ulimit -v, the container's), or give a "
        "smaller report",
        path, mib));
  }
}

}  // namespace ddpdiag::reports
