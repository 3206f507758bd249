// libFuzzer target: a real TcpStoreServer (its event loop, connection
// handling and every op's handler) fed arbitrary bytes over loopback
// connections. The server's handler sits behind its socket loop, so the
// bytes go through sockets; one server per input keeps inputs independent.
//
// Input: byte 0: bits 0-1 choose the server's key/value limits, bits 2-3 the
// number of connections (1 to 4). Then records: a header byte h (connection
// h % connections, payload of 1 + (h >> 2) bytes) and its payload, sent as
// one write on that connection. The connections then half-close (the
// server serves what arrived, then closes them, as on a c10d server).
//
// Invariants (abort on violation): the server closes every connection within
// a bound once the client has half-closed it (no hang, no lost EOF);
// afterwards it still answers a fresh 2.x client correctly (PING
// echoes its nonce, GETNUMKEYS equals num_keys()) and its connection count
// drops back to that one client. AddressSanitizer and UBSan watch the server
// thread throughout.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "comm/store/tcp_store.h"
#include "tests/fuzz/fuzz_common.h"

namespace {

using namespace ddpdiag;
using namespace ddpdiag::fuzz;
using namespace std::chrono_literals;

constexpr int kIoBoundMs = 5000;  // far above any honest answer on loopback

// libFuzzer's -timeout is a SIGALRM timer, so every blocking call here can
// return EINTR; each one retries.

int connect_to(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fail("socket: %s", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) return fd;
  if (errno != EINTR) fail("connect: %s", std::strerror(errno));
  // Interrupted: the connection goes on in the background; wait for it.
  pollfd p{fd, POLLOUT, 0};
  while (::poll(&p, 1, kIoBoundMs) < 0 && errno == EINTR) {
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (!(p.revents & POLLOUT) || err != 0) fail("connect: %s", std::strerror(err ? err : ETIMEDOUT));
  return fd;
}

// Closes with a reset: no TIME_WAIT left behind by thousands of inputs.
void close_hard(int fd) {
  linger l{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  ::close(fd);
}

// Writes what the server takes; a server that closed the connection (it
// may, on malformed input) ends the write.
void send_some(int fd, const std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads until EOF (or reset); fails when the server stays silent past the
// bound.
void drain_to_eof(int fd) {
  std::uint8_t buf[4096];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, kIoBoundMs);
    if (rc == 0) fail("the server did not close a half-closed connection within %d ms", kIoBoundMs);
    if (rc < 0) {
      if (errno == EINTR) continue;
      fail("poll: %s", std::strerror(errno));
    }
    ssize_t r = ::recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;
  }
}

bool recv_exact(int fd, std::uint8_t* out, std::size_t n) {
  std::size_t off = 0;
  while (off < n) {
    pollfd p{fd, POLLIN, 0};
    int rc = ::poll(&p, 1, kIoBoundMs);
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return false;
    ssize_t r = ::recv(fd, out + off, n - off, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    off += static_cast<std::size_t>(r);
  }
  return true;
}

// A well-behaved 2.x client after the fuzzed ones: the server must still be
// serving, with consistent state.
void check_still_serving(TcpStoreServer& server) {
  int fd = connect_to(server.port());
  Bytes req = connection_start(StoreProtocol::kV2);
  tp::Request ping{tp::Op::kPing, {}, {}, 0, 0x5eed1234u};
  tp::Request numkeys{tp::Op::kNumKeys, {}, {}, 0, 0};
  for (const auto& q : {ping, numkeys}) {
    Bytes b = tp::encode_request(StoreProtocol::kV2, q);
    req.insert(req.end(), b.begin(), b.end());
  }
  send_some(fd, req.data(), req.size());
  std::uint8_t reply[12];
  if (!recv_exact(fd, reply, sizeof(reply))) fail("the server stopped answering after a fuzzed input");
  if (tp::load_u32(reply) != 0x5eed1234u) fail("PING answered %08x", tp::load_u32(reply));
  auto keys = static_cast<std::int64_t>(tp::load_u64(reply + 4));
  if (keys != server.num_keys())
    fail("GETNUMKEYS answered %lld, num_keys() is %lld", static_cast<long long>(keys),
         static_cast<long long>(server.num_keys()));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(kIoBoundMs);
  while (server.num_connections() != 1) {
    if (std::chrono::steady_clock::now() > deadline)
      fail("%zu connections open with one client left", server.num_connections());
    std::this_thread::sleep_for(100us);
  }
  close_hard(fd);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned control = data[0];
  tp::ParseLimits lim = parse_limits(control & 3u);
  TcpStoreServerOptions opts;
  opts.host = "127.0.0.1";
  opts.port = 0;
  // Both protocols' connections get the limits chosen (by default, each
  // protocol its own).
  if ((control & 3u) != 0) {
    opts.max_key_bytes = opts.v1_max_key_bytes = lim.max_key_bytes;
    opts.max_value_bytes = opts.v1_max_value_bytes = opts.max_appended_value_bytes =
        lim.max_value_bytes;
  }
  TcpStoreServer server(opts);

  const std::size_t nconn = 1 + ((control >> 2) & 3u);
  std::vector<int> fds;
  for (std::size_t i = 0; i < nconn; ++i) fds.push_back(connect_to(server.port()));
  for (std::size_t off = 1; off < size;) {
    const unsigned h = data[off++];
    std::size_t n = 1 + (h >> 2);
    if (n > size - off) n = size - off;
    send_some(fds[h % nconn], data + off, n);
    off += n;
  }
  for (int fd : fds) ::shutdown(fd, SHUT_WR);
  for (int fd : fds) drain_to_eof(fd);
  for (int fd : fds) close_hard(fd);
  check_still_serving(server);
  return 0;
}
