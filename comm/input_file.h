// Reading a file a user names as input (a report, a model layout), bounded:
// a device such as /dev/zero would be read until memory runs out, a FIFO
// nobody writes to would block forever, and a read error (EIO) must be an
// error naming the file, not an exception from deep in a stream.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

namespace ddpdiag {

// What went wrong, in words that follow the path ("x.json: <what>").
class InputFileError : public std::runtime_error {
 public:
  enum class Kind { kNotAFile, kTooLarge, kUnreadable };
  InputFileError(Kind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

namespace input_file_detail {
// What a pipe gave, by path and pipe: a pipe is read once, and a process
// that reads its input twice (a check of the layout's memory before the run,
// then the run) must find the same text the second time, not an empty pipe.
struct PipeTexts {
  std::mutex mu;
  std::map<std::pair<std::string, ino_t>, std::string> texts;
};
inline PipeTexts& pipe_texts() {
  static PipeTexts p;
  return p;
}
}  // namespace input_file_detail

// The whole of `path`, at most max_bytes. Regular files, and pipes or FIFOs
// (`<(...)`), whose writer must send something every `pipe_wait_ms`;
// directories, devices and sockets are refused. Throws InputFileError. A
// pipe is read once per process: reading it again returns what it gave.
inline std::string read_input_file(const std::string& path, std::size_t max_bytes,
                                   int pipe_wait_ms = 10000) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    throw InputFileError(InputFileError::Kind::kUnreadable, "cannot open it: " + std::string(std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw InputFileError(InputFileError::Kind::kNotAFile, "it is a directory");
  const bool pipe = S_ISFIFO(st.st_mode);
  if (!S_ISREG(st.st_mode) && !pipe)
    throw InputFileError(InputFileError::Kind::kNotAFile, "it is a device or socket");
  if (!pipe && static_cast<std::uint64_t>(st.st_size) > max_bytes)
    throw InputFileError(InputFileError::Kind::kTooLarge, "it is larger than " + std::to_string(max_bytes >> 20) + " MiB");
  const auto key = std::make_pair(path, st.st_ino);
  if (pipe) {
    auto& seen = input_file_detail::pipe_texts();
    std::lock_guard<std::mutex> lock(seen.mu);
    if (auto it = seen.texts.find(key); it != seen.texts.end()) {
      if (it->second.size() > max_bytes)
        throw InputFileError(InputFileError::Kind::kTooLarge,
                             "it is larger than " + std::to_string(max_bytes >> 20) + " MiB");
      return it->second;
    }
  }
  // A FIFO opens at once without O_NONBLOCK only once a writer is there.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (pipe ? O_NONBLOCK : 0));
  if (fd < 0) throw InputFileError(InputFileError::Kind::kUnreadable, "cannot open it: " + std::string(std::strerror(errno)));
  std::string text;
  char buf[1 << 16];
  for (;;) {
    if (pipe) {
      pollfd p{fd, POLLIN, 0};
      const int n = ::poll(&p, 1, pipe_wait_ms);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        ::close(fd);
        throw InputFileError(InputFileError::Kind::kUnreadable, text.empty() ? "nothing came through it in " + std::to_string(pipe_wait_ms / 1000) +
                                                " s (a FIFO nothing writes to?)"
                                          : "it stopped sending for " + std::to_string(pipe_wait_ms / 1000) +
                                                " s before its end");
      }
    }
    const ssize_t r = ::read(fd, buf, sizeof buf);
    if (r == 0) break;
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      const int err = errno;
      ::close(fd);
      throw InputFileError(InputFileError::Kind::kUnreadable, "cannot read it: " + std::string(std::strerror(err)));
    }
    text.append(buf, static_cast<std::size_t>(r));
    if (text.size() > max_bytes) {
      ::close(fd);
      throw InputFileError(InputFileError::Kind::kTooLarge, "it is larger than " + std::to_string(max_bytes >> 20) + " MiB");
    }
  }
  ::close(fd);
  if (pipe) {
    auto& seen = input_file_detail::pipe_texts();
    std::lock_guard<std::mutex> lock(seen.mu);
    seen.texts.emplace(key, text);
  }
  return text;
}

}  // namespace ddpdiag
