// Test shim, loaded with LD_PRELOAD into ddpdiag by tests/mp/test_hangs_mp.py:
// a rename() whose new name ends in $SLOW_RENAME_SUFFIX first creates the
// file $SLOW_RENAME_FLAG (the test's sign that the report is being written)
// and then sleeps $SLOW_RENAME_MS. It holds a process inside its final
// report's write, so that a signal can be sent there.
#include <dlfcn.h>
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

extern "C" int rename(const char* from, const char* to) {
  using Rename = int (*)(const char*, const char*);
  static const auto real = reinterpret_cast<Rename>(dlsym(RTLD_NEXT, "rename"));
  const char* suffix = std::getenv("SLOW_RENAME_SUFFIX");
  const std::size_t n = suffix ? std::strlen(suffix) : 0;
  const std::size_t len = std::strlen(to);
  if (n > 0 && len >= n && std::strcmp(to + len - n, suffix) == 0) {
    if (const char* flag = std::getenv("SLOW_RENAME_FLAG")) {
      const int fd = ::open(flag, O_CREAT | O_WRONLY | O_CLOEXEC, 0644);
      if (fd >= 0) ::close(fd);
    }
    const char* ms = std::getenv("SLOW_RENAME_MS");
    std::this_thread::sleep_for(std::chrono::milliseconds(ms ? std::atoi(ms) : 0));
  }
  return real(from, to);
}
