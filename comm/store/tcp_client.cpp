// TcpStoreClient: one connection to a c10d-compatible store, every I/O under
// poll() with a deadline.
//
// Protocol detection (opts.protocol == kAuto), on a fresh connection:
//   1. send the 2.x handshake: VALIDATE (00 ce f7 85 3c) then PING (0d) with
//      a 32-bit nonce, and read 4 bytes under a short deadline
//      (kDetectTimeout, bounded by io_timeout);
//   2. the nonce echoed back => 2.x; the connection is kept;
//   3. anything else (EOF, other bytes, silence) => close, reconnect, speak
//      1.13 and confirm with GETNUMKEYS (an int64 reply) within what is left
//      of io_timeout.
// Why this is harmless to a 1.13 server: it reads 00 as SET, then takes the
// next eight bytes (ce f7 85 3c 0d n0 n1 n2) as the key length. The nonce is
// chosen with bit 23 set, so n2 >= 0x80 and the length is >= 2^63, beyond
// std::vector's max_size(): 1.13's recvString throws before it allocates or
// stores anything, and its daemon closes just that connection. So the probe
// neither hangs (deadline, and the server closes at once) nor leaves a key or
// a memory spike behind.
//
// After a timed-out request the reply may still arrive later and would be
// read as the answer to the next request, so the connection is dropped and
// the next call reconnects (same protocol, no new detection). The one
// exception is a 2.x WAIT: CANCEL_WAIT makes the server answer WAIT_CANCELED
// (after a STOP_WAITING if the keys arrived meanwhile), which resynchronises
// the stream, and the connection stays in use.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/core.h>

#include "comm/errors.h"
#include "comm/splitmix64.h"
#include "comm/store/tcp_protocol.h"
#include "comm/store/tcp_store.h"

namespace ddpdiag {
namespace {

namespace tp = tcp_protocol;
using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// A torch server answers PING within a round trip; 2 s leaves room for a
// loaded machine without making detection against a silent peer slow.
constexpr Millis kDetectTimeout{2000};
constexpr Millis kFirstBackoff{20};
constexpr Millis kMaxBackoff{1000};
// A store that answered before (this connection, or another of this
// process) and now refuses connections has ended: nothing will listen on
// its port again, so a reconnect stops trying after this long, not after
// connect_timeout (a watchdog's heartbeat, and the exit that joins it, were
// held 10 s by a store whose host rank had died).
constexpr Millis kGoneStoreGrace{1000};
// A store, of either version, answers in microseconds: a first request left
// unanswered this long is the server's answer (another program on the port,
// or a protocol it does not speak), not a deadline too short for it.
constexpr Millis kSilenceIsAnAnswer{1000};

enum class IoStatus { kOk, kTimeout, kClosed, kError };

int poll_timeout_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<long long>(left + 1, 1 << 30));
}

std::string join_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (const auto& k : keys) s += (s.empty() ? "" : ", ") + k;
  return s;
}

// A seed for each client's generator (handshake nonces, backoff jitter).
// std::random_device is read once per process: constructing one costs a
// CPUID probe, which traps to the hypervisor on a VM and made up an eighth
// of the CPU time of a 1,024-client rendezvous. Later clients mix a counter
// into that seed (splitmix64), so clients still get distinct streams.
std::uint64_t client_seed() {
  static const std::uint64_t base = [] {
    std::random_device rd;
    return (std::uint64_t{rd()} << 32) ^ rd();
  }();
  static std::atomic<std::uint64_t> counter{0};
  const std::uint64_t n = counter.fetch_add(1, std::memory_order_relaxed) + 1;
  return splitmix64_mix(base + kSplitmix64Gamma * n);
}

// The largest value a reply may announce (16 GiB): a length beyond it is
// not a store's value but other bytes (an HTTP server's "HTTP/1.1 ...")
// read as a length.
constexpr std::uint64_t kMaxReplyValueBytes = std::uint64_t{1} << 34;

// A 1.13 GETNUMKEYS count beyond this is not a count of keys: 8 bytes of
// text read as an int64 are >= 2^56 (the last byte is a printable one).
constexpr std::uint64_t kMaxPlausibleKeys = std::uint64_t{1} << 40;

// Whether bytes received look like text (a line of an HTTP server, an SSH
// banner ...) rather than a binary reply.
bool looks_like_text(const std::uint8_t* p, std::size_t n) {
  if (n == 0) return false;
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = p[i];
    if (c == '\r' || c == '\n') return i >= 2;
    if (c != '\t' && (c < 0x20 || c > 0x7e)) return false;
  }
  return true;
}

// The first bytes a server sent, for an error message: quoted up to the end
// of the first line when they read as text, else in hex.
std::string describe_reply(const std::uint8_t* p, std::size_t n) {
  constexpr std::size_t kShown = 64;
  std::string s;
  if (looks_like_text(p, n)) {
    for (std::size_t i = 0; i < n && i < kShown && p[i] != '\r' && p[i] != '\n'; ++i)
      s += static_cast<char>(p[i]);
    return "'" + s + (n > kShown && s.size() == kShown ? "...'" : "'");
  }
  static constexpr char kHex[] = "0123456789abcdef";
  for (std::size_t i = 0; i < n && i < 16; ++i) {
    if (i) s += ' ';
    s += kHex[p[i] >> 4];
    s += kHex[p[i] & 15];
  }
  return "bytes " + s + (n > 16 ? " ..." : "");
}

// Why a connection attempt failed, in the user's words.
enum class ConnectFailure { kNone, kRefused, kTimedOut, kUnreachable, kDns, kOther };

// A timeout says only that no answer came in time; a refusal, an unreachable
// network or a failed name lookup are answers. Retries run until the
// deadline, so the last attempt often starts with next to no time left and
// "times out" against a host whose every earlier attempt was refused: an
// answer seen on any attempt must not be masked by that. Among answers the
// latest wins; a timeout is reported only when no attempt got an answer.
bool replaces(ConnectFailure seen, ConnectFailure latest) {
  if (latest == ConnectFailure::kTimedOut)
    return seen == ConnectFailure::kNone || seen == ConnectFailure::kTimedOut;
  return latest != ConnectFailure::kNone;
}

}  // namespace

struct TcpStoreClient::Impl {
  TcpStoreClientOptions opts;
  std::mutex mu;
  int fd = -1;
  StoreProtocol protocol = StoreProtocol::kAuto;  // resolved after the first connect
  int attempts = 0;
  bool connected_once = false;  // a connect of this client succeeded
  std::mt19937_64 rng{client_seed()};

  ~Impl() { drop(); }

  std::string where() const {
    bool v6 = opts.host.find(':') != std::string::npos;
    return (v6 ? "[" + opts.host + "]" : opts.host) + ":" + std::to_string(opts.port);
  }
  ErrorContext ctx(std::string phase, std::string hint = {}) const {
    return ErrorContext{std::move(phase), opts.rank, -1, std::move(hint)};
  }
  std::string key(const std::string& k) const { return opts.torch_key_prefix ? "/" + k : k; }
  std::string protocol_hint() const {
    return "protocol mismatch? try " + opts.protocol_flag + " 1.13 or 2.x";
  }

  // Bytes received and not yet consumed (replies are read through it, so a
  // reply usually takes one poll and one recv, not one recv per field).
  // Small: replies are a byte, an int64 or a short value; larger reads go
  // straight to their destination. Inline, so a client costs no extra pages.
  static constexpr std::size_t kRecvChunk = 1024;
  std::array<std::uint8_t, kRecvChunk> rbuf{};
  std::size_t rpos = 0, rend = 0;

  void drop() {
    if (fd >= 0) ::close(fd);
    fd = -1;
    rpos = rend = 0;
  }

  // ---- connecting -------------------------------------------------------

  // One non-blocking connect to one address, bounded by deadline.
  int connect_addr(const addrinfo* ai, Deadline deadline, int* err) {
    int s = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (s < 0) {
      *err = errno;
      return -1;
    }
    if (::connect(s, ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        *err = errno;
        ::close(s);
        return -1;
      }
      pollfd p{s, POLLOUT, 0};
      int r;
      do {
        r = ::poll(&p, 1, poll_timeout_ms(deadline));
      } while (r < 0 && errno == EINTR);
      if (r == 0) {
        *err = ETIMEDOUT;
        ::close(s);
        return -1;
      }
      int so = 0;
      socklen_t len = sizeof(so);
      ::getsockopt(s, SOL_SOCKET, SO_ERROR, &so, &len);
      if (r < 0 || so != 0) {
        *err = r < 0 ? errno : so;
        ::close(s);
        return -1;
      }
    }
    int one = 1;
    ::setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return s;
  }

  // Connects to opts.host:opts.port, retrying with exponential backoff and
  // jitter until connect_timeout. Throws RendezvousError naming the cause.
  void connect_socket() {
    drop();
    const auto start = Clock::now();
    const Deadline deadline = start + opts.connect_timeout;
    Millis backoff = kFirstBackoff;
    ConnectFailure failure = ConnectFailure::kNone;
    std::string detail;
    int tries = 0;
    bool gone = false;  // refused by a store that answered before
    for (;;) {
      ++tries;
      ++attempts;
      if (opts.attempts_out) *opts.attempts_out = attempts;
      addrinfo hints{};
      hints.ai_family = AF_UNSPEC;
      hints.ai_socktype = SOCK_STREAM;
      hints.ai_flags = AI_NUMERICSERV;
      addrinfo* res = nullptr;
      std::string port_s = std::to_string(opts.port);
      int rc = ::getaddrinfo(opts.host.c_str(), port_s.c_str(), &hints, &res);
      if (rc != 0) {
        if (replaces(failure, ConnectFailure::kDns)) {
          failure = ConnectFailure::kDns;
          detail = gai_strerror(rc);
        }
      } else {
        for (addrinfo* ai = res; ai; ai = ai->ai_next) {
          int err = 0;
          int s = connect_addr(ai, deadline, &err);
          if (s >= 0) {
            ::freeaddrinfo(res);
            fd = s;
            if (opts.connected_at_out && !connected_once) *opts.connected_at_out = Clock::now();
            connected_once = true;
            return;
          }
          ConnectFailure f = ConnectFailure::kOther;
          if (err == ECONNREFUSED) f = ConnectFailure::kRefused;
          else if (err == ETIMEDOUT) f = ConnectFailure::kTimedOut;
          else if (err == ENETUNREACH || err == EHOSTUNREACH || err == EHOSTDOWN || err == ENETDOWN)
            f = ConnectFailure::kUnreachable;
          if (replaces(failure, f)) {
            failure = f;
            detail = std::strerror(err);
          }
        }
        ::freeaddrinfo(res);
      }
      auto now = Clock::now();
      if (now >= deadline) break;
      if (failure == ConnectFailure::kRefused && (connected_once || opts.known_store) &&
          now - start >= kGoneStoreGrace) {
        gone = true;
        break;
      }
      // Jitter spreads the reconnects of many ranks that all started at once.
      std::uniform_real_distribution<double> jitter(0.5, 1.5);
      auto sleep = Millis(static_cast<long long>(static_cast<double>(backoff.count()) * jitter(rng)));
      // Until the deadline at most, on the clock itself: a sleep rounded down
      // to whole milliseconds was 0 in the last one, and turned it into a
      // busy loop of dozens of attempts.
      std::this_thread::sleep_until(std::min(now + sleep, deadline));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
    auto took = std::chrono::duration_cast<Millis>(Clock::now() - start).count();
    std::string what, hint;
    switch (failure) {
      case ConnectFailure::kRefused:
        // strerror would only repeat "Connection refused".
        detail.clear();
        if (gone) {
          what = "connection refused: the store at " + where() +
                 " answered before, and nothing listens there now: its process has ended";
          hint = "the store's host (rank 0, or the launcher's agent) has ended: its own log says "
                 "why";
          break;
        }
        what = "connection refused: nothing listens on " + where() + " (yet)";
        hint = "the store is not up yet, or it listens on another port: start rank 0 (or the "
               "launcher whose agent hosts it) first, or start one with `ddpdiag store serve`; "
               "rank 0 may also have stopped at once (a flag or path it refused: its own log "
               "says why); "
               "check that MASTER_ADDR/MASTER_PORT name the store's host and port; if the "
               "store is up there, a firewall rejects the port (firewalld/ufw REJECT answers "
               "as a closed port does)";
        break;
      case ConnectFailure::kTimedOut:
        what = "connection timed out";
        hint = "the host does not answer on port " + std::to_string(opts.port) +
               ": a firewall may drop the packets, or the address is wrong";
        break;
      case ConnectFailure::kUnreachable:
        what = "host unreachable";
        hint = "no route to " + opts.host + ": check the address and the network interface, "
               "and whether a firewall there rejects the port (firewalld's default REJECT "
               "answers 'host prohibited', which reads as no route)";
        break;
      case ConnectFailure::kDns:
        what = "cannot resolve host name";
        hint = "check that '" + opts.host + "' (the store's host: MASTER_ADDR, --master-addr or --addr) "
               "resolves on this machine, or use an IP address";
        break;
      default:
        what = "connection failed";
        hint = "check MASTER_ADDR/MASTER_PORT";
        break;
    }
    throw RendezvousError("cannot connect to the store at " + where() + " after " + std::to_string(tries) +
                              " attempt(s) in " + std::to_string(took) + " ms: " + what + (detail.empty() ? "" : " (" + detail + ")"),
                          ctx("store.connect", hint));
  }

  // ---- raw I/O under deadlines -------------------------------------------

  IoStatus send_all(const Bytes& b, Deadline deadline) {
    std::size_t off = 0;
    while (off < b.size()) {
      ssize_t w = ::send(fd, b.data() + off, b.size() - off, MSG_NOSIGNAL);
      if (w > 0) {
        off += static_cast<std::size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        pollfd p{fd, POLLOUT, 0};
        int r = ::poll(&p, 1, poll_timeout_ms(deadline));
        if (r == 0) return IoStatus::kTimeout;
        if (r < 0 && errno != EINTR) return IoStatus::kError;
        continue;
      }
      return errno == EPIPE || errno == ECONNRESET ? IoStatus::kClosed : IoStatus::kError;
    }
    return IoStatus::kOk;
  }

  // Reads exactly n bytes: first what the buffer holds, then from the socket.
  // The socket is polled before each read (after a request the reply is
  // rarely there yet, so reading first would mostly cost an EAGAIN); reads of
  // at least kRecvChunk go straight into buf, smaller ones fill the buffer.
  // Whether the server has answered anything since this client first
  // connected (a forced protocol that never got one answer is the first
  // suspect).
  bool answered = false;

  IoStatus recv_exact(std::uint8_t* buf, std::size_t n, Deadline deadline) {
    const IoStatus st = recv_exact_unmarked(buf, n, deadline);
    if (st == IoStatus::kOk && n > 0) answered = true;
    return st;
  }
  IoStatus recv_exact_unmarked(std::uint8_t* buf, std::size_t n, Deadline deadline) {
    std::size_t off = std::min(n, rend - rpos);
    if (off) std::memcpy(buf, rbuf.data() + rpos, off);
    rpos += off;
    while (off < n) {
      rpos = rend = 0;  // the buffer is empty here
      pollfd p{fd, POLLIN, 0};
      int pr = ::poll(&p, 1, poll_timeout_ms(deadline));
      if (pr == 0) return IoStatus::kTimeout;
      if (pr < 0) {
        if (errno == EINTR) continue;
        return IoStatus::kError;
      }
      const bool direct = n - off >= kRecvChunk;
      ssize_t r = direct ? ::recv(fd, buf + off, n - off, 0) : ::recv(fd, rbuf.data(), kRecvChunk, 0);
      if (r > 0) {
        if (direct) {
          off += static_cast<std::size_t>(r);
        } else {
          rend = static_cast<std::size_t>(r);
          rpos = std::min(n - off, rend);
          std::memcpy(buf + off, rbuf.data(), rpos);
          off += rpos;
        }
        continue;
      }
      if (r == 0) return IoStatus::kClosed;
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return errno == ECONNRESET ? IoStatus::kClosed : IoStatus::kError;
    }
    return IoStatus::kOk;
  }

  // The bytes of a reply just read (head) and whatever else of it the
  // buffer already holds, described for an error message.
  std::string received(const std::uint8_t* head, std::size_t n) const {
    std::vector<std::uint8_t> b(head, head + n);
    b.insert(b.end(), rbuf.begin() + static_cast<std::ptrdiff_t>(rpos),
             rbuf.begin() + static_cast<std::ptrdiff_t>(rend));
    return describe_reply(b.data(), b.size());
  }

  // Whether silence through `limit` says what the server is (exit 3) rather
  // than that the deadline was short (exit 4). Not for a process that has
  // already met a store here (opts.known_store): that store has stalled.
  bool silence_is_an_answer(Millis limit) const {
    return limit >= kSilenceIsAnAnswer && !opts.known_store;
  }

  // The server answered, but not as a store: another service on the port.
  [[noreturn]] void not_a_store(const std::string& what, std::string phase) {
    drop();
    throw RendezvousError("the server at " + where() + " speaks neither the torch 2.x nor the torch 1.13 "
                          "store protocol" + (what.empty() ? "" : ": " + what),
                          ctx(std::move(phase), "check MASTER_PORT points at the TCPStore, not at another "
                                                "service"));
  }

  // Turns a failed I/O status into the error to throw; the connection is
  // dropped first because its reply stream can no longer be trusted.
  [[noreturn]] void fail(IoStatus st, std::string_view op, Millis limit) {
    drop();
    if (st == IoStatus::kTimeout) {
      // 1.13 named by the user has no handshake to fail: a torch 2.x server
      // reads a 1.13 request as another command (1.13's GETNUMKEYS is 2.x's
      // WAIT) and may wait for good. The protocol, not the server, is the
      // first suspect. As with a server silent to both protocols
      // (silence_is_an_answer): exit 3, could not initialise, like the
      // mismatch the other way round; a shorter deadline may only be too
      // short (exit 4).
      if (opts.protocol == StoreProtocol::kV1 && !answered) {
        std::string what = "the store at " + where() + " did not answer " + std::string(op) + " within " +
                           std::to_string(limit.count()) + " ms, on the torch 1.13 protocol that " +
                           opts.protocol_flag + " 1.13 asked for";
        ErrorContext c = ctx("store.handshake",
                             "a torch 2.x store reads a 1.13 request as another command and may never "
                             "answer it: drop " + opts.protocol_flag + " 1.13 (auto finds the server's "
                             "protocol), or give " + opts.protocol_flag + " 2.x");
        if (silence_is_an_answer(limit)) throw RendezvousError(std::move(what), std::move(c));
        throw TimeoutError(std::move(what), std::move(c));
      }
      throw TimeoutError("the store at " + where() + " did not answer " + std::string(op) + " within " +
                             std::to_string(limit.count()) + " ms",
                         ctx("store.io", "the store server is overloaded or stuck; is it a TCPStore "
                                         "speaking " + std::string(store_protocol_name(protocol)) + "?"));
    }
    // Closed at the very first request of a protocol the user forced: torch
    // 2.x's non-libuv server drops a connection whose first bytes are not
    // its handshake. The protocol is the first suspect, named as such.
    if (opts.protocol == StoreProtocol::kV1 && !answered)
      throw RendezvousError("the store at " + where() + " closed the connection at the first request (" +
                                std::string(op) + ") on the torch 1.13 protocol that " + opts.protocol_flag +
                                " 1.13 asked for: a torch 2.x store does that",
                            ctx("store.handshake",
                                "drop " + opts.protocol_flag + " 1.13 (auto finds the server's protocol), or "
                                "give " + opts.protocol_flag + " 2.x (a store that closes every "
                                "connection may also be out of file descriptors)"));
    throw RendezvousError("the store at " + where() + " closed the connection during " + std::string(op),
                          ctx("store.io",
                              "the store server exited, or rejected the request (key over 8 KiB, value "
                              "over 8 MiB, or a " + protocol_hint() + ")"));
  }

  void send_req(const tp::Request& q, Deadline deadline) {
    Bytes b = tp::encode_request(protocol, q);
    IoStatus st = send_all(b, deadline);
    if (st != IoStatus::kOk) fail(st, tp::op_name(q.op), opts.io_timeout);
  }
  void recv_or_fail(std::uint8_t* buf, std::size_t n, Deadline deadline, tp::Op op) {
    IoStatus st = recv_exact(buf, n, deadline);
    if (st != IoStatus::kOk) fail(st, tp::op_name(op), opts.io_timeout);
  }
  std::int64_t recv_i64(Deadline d, tp::Op op) {
    std::uint8_t b[8];
    recv_or_fail(b, 8, d, op);
    return static_cast<std::int64_t>(tp::load_u64(b));
  }
  std::uint8_t recv_u8(Deadline d, tp::Op op) {
    std::uint8_t b = 0;
    recv_or_fail(&b, 1, d, op);
    return b;
  }
  Bytes recv_value(Deadline d, tp::Op op) {
    std::uint8_t b[8];
    recv_or_fail(b, 8, d, op);
    std::uint64_t n = tp::load_u64(b);
    if (n > kMaxReplyValueBytes)
      not_a_store(fmt::format("it answered {} with {} (read as a value of {} bytes, more than the {} "
                              "a store value may hold)",
                              tp::op_name(op), received(b, 8), n, kMaxReplyValueBytes),
                  "store.io");
    Bytes v(static_cast<std::size_t>(n));
    if (n) recv_or_fail(v.data(), v.size(), d, op);
    return v;
  }

  // ---- handshake and detection ----------------------------------------

  std::uint32_t make_nonce() {
    // Bit 23 set: see the file comment (makes a 1.13 server reject the probe
    // before allocating).
    return static_cast<std::uint32_t>(rng()) | 0x00800000u;
  }

  // 2.x handshake on the current socket; true when the server echoed the
  // nonce before the deadline.
  bool v2_handshake(Deadline deadline) {
    tp::Request validate{tp::Op::kValidate, {}, {}, 0, tp::kValidationMagic};
    tp::Request ping{tp::Op::kPing, {}, {}, 0, make_nonce()};
    Bytes b = tp::encode_request(StoreProtocol::kV2, validate);
    Bytes p = tp::encode_request(StoreProtocol::kV2, ping);
    b.insert(b.end(), p.begin(), p.end());
    closed_unanswered = false;
    timed_out = false;
    if (const IoStatus sent = send_all(b, deadline); sent != IoStatus::kOk) {
      timed_out = sent == IoStatus::kTimeout;
      return false;
    }
    std::uint8_t r[4];
    const IoStatus st = recv_exact(r, 4, deadline);
    if (st != IoStatus::kOk) {
      closed_unanswered = st == IoStatus::kClosed && rend == 0;
      timed_out = st == IoStatus::kTimeout;
      return false;
    }
    if (tp::load_u32(r) == ping.nonce) return true;
    // Any other reply rules out both versions: a 2.x store echoes the
    // nonce, a 1.13 store closes the connection (see the file comment). A
    // server that sends zeros would otherwise pass the 1.13 probe next.
    text_reply = received(r, 4);
    return false;
  }

  // What a server sent in place of a handshake or probe reply, described
  // ("" if none).
  std::string text_reply;
  // The last handshake or probe ended with the server closing the
  // connection before a byte of reply.
  bool closed_unanswered = false;
  // ...or with its deadline passing before the reply.
  bool timed_out = false;

  // A server that closes every connection at once, before answering: a
  // store turning clients away (out of file descriptors), or something that
  // is not a store.
  [[noreturn]] void closed_without_answer(const std::string& asked) {
    drop();
    throw RendezvousError(
        "the server at " + where() + " accepted the connection and closed it without answering " +
            asked + ": a store that turns clients away (its process out of file descriptors: its "
            "log says so), or a service that is not a TCPStore",
        ctx("store.handshake", "raise the open-file limit where the store runs (ulimit -n 65536), "
                               "or run fewer ranks per host; else check MASTER_PORT points at "
                               "the TCPStore"));
  }

  // A server that accepted the connection and sent nothing back to `asked`
  // since `began`, within the I/O deadline.
  [[noreturn]] void silent_server(const std::string& asked, Clock::time_point began) {
    drop();
    const std::string silent = "the server at " + where() + " accepted the connection but answered " + asked +
                               " in " +
                               std::to_string(std::chrono::duration_cast<Millis>(Clock::now() - began).count()) +
                               " ms";
    // Silence for a second or more: a store, of either version, answers in
    // microseconds, so this is most likely another program on the port,
    // waiting for a request in its own protocol (an HTTP server does), and a
    // longer wait will not help. Or a store frozen whole.
    if (silence_is_an_answer(opts.io_timeout))
      throw RendezvousError(
          silent + ": a store answers at once, so another program probably holds this port "
                   "(or the store's process is frozen)",
          ctx("store.handshake",
              "check what listens on port " + std::to_string(opts.port) + " of " + opts.host +
                  " (ss -ltnp 'sport = :" + std::to_string(opts.port) +
                  "' there) and point MASTER_PORT / --master-port at the store; if it is the "
                  "store, look at its process (ps state T is stopped; swapping)"));
    // A shorter deadline: too short for a busy store, perhaps; the protocol
    // is not known to be wrong.
    throw TimeoutError(silent, ctx("store.handshake",
                                   "raise --timeout (a store answers in well under a second), "
                                   "or check that the store is not stalled"));
  }

  bool v1_probe(Deadline deadline) {
    Bytes b = tp::encode_request(StoreProtocol::kV1, tp::Request{tp::Op::kNumKeys, {}, {}, 0, 0});
    closed_unanswered = false;
    timed_out = false;
    if (const IoStatus sent = send_all(b, deadline); sent != IoStatus::kOk) {
      timed_out = sent == IoStatus::kTimeout;
      return false;
    }
    std::uint8_t r[8];
    const IoStatus st = recv_exact(r, 8, deadline);
    if (st != IoStatus::kOk) {
      closed_unanswered = st == IoStatus::kClosed && rend == 0;
      timed_out = st == IoStatus::kTimeout;
      return false;
    }
    // Eight bytes came back; a store's are a small count of keys.
    if (tp::load_u64(r) <= kMaxPlausibleKeys) return true;
    text_reply = received(r, 8);
    return false;
  }

  void connect() {
    connect_socket();
    text_reply.clear();
    const Deadline io = Clock::now() + opts.io_timeout;
    if (protocol == StoreProtocol::kV2) {
      const auto began = Clock::now();
      if (v2_handshake(io)) return;
      if (!text_reply.empty())
        not_a_store("it answered the torch 2.x handshake with " + text_reply, "store.handshake");
      // Silence is no sign of the other version: a 1.13 store closes the
      // connection at once. A stalled store, or another program.
      if (timed_out) silent_server("nothing to the torch 2.x handshake", began);
      const bool closed = closed_unanswered;
      drop();
      // Phase store.handshake, not store.connect: the host accepted the
      // connection, so it is reachable; only the protocol did not match.
      throw RendezvousError("the server at " + where() + " accepted the connection but did not complete the "
                            "torch 2.x handshake" +
                                std::string(closed ? " (it closed the connection unanswered: a torch 1.13 "
                                                     "store does, and so does a store whose process is out "
                                                     "of file descriptors)"
                                                   : ""),
                            ctx("store.handshake", "is it a torch 1.13 store? use " + opts.protocol_flag +
                                                       " 1.13 or auto"));
    }
    if (protocol == StoreProtocol::kV1) return;  // 1.13 has no handshake: the first request tells
    const auto detect_began = Clock::now();
    if (v2_handshake(std::min(io, Clock::now() + kDetectTimeout))) {
      protocol = StoreProtocol::kV2;
      return;
    }
    if (!text_reply.empty())
      not_a_store("it answered the torch 2.x handshake with " + text_reply, "store.handshake");
    const bool v2_closed = closed_unanswered;
    connect_socket();
    // The reconnect after the probe is part of detection, not a retry: keep
    // connect_attempts() meaning "tries until the server answered".
    --attempts;
    if (opts.attempts_out) *opts.attempts_out = attempts;
    // Under the same deadline as the handshake: a silent server has then had
    // the whole timeout in all, not the timeout plus the handshake's wait.
    if (v1_probe(io)) {
      protocol = StoreProtocol::kV1;
      return;
    }
    if (v2_closed && closed_unanswered && text_reply.empty())
      closed_without_answer("the torch 2.x handshake or a torch 1.13 request");
    if (timed_out && text_reply.empty())
      silent_server("neither the torch 2.x handshake nor a torch 1.13 request", detect_began);
    not_a_store(text_reply.empty() ? "" : "it answered a torch 1.13 request with " + text_reply,
                "store.handshake");
  }

  void ensure_connected() {
    if (fd < 0) connect();
  }

  Deadline io_deadline() const { return Clock::now() + opts.io_timeout; }

  // ---- operations ---------------------------------------------------------

  // Keys the user named and that are still missing, for error messages.
  std::vector<std::string> missing_of(const std::vector<std::string>& keys) {
    std::vector<std::string> missing;
    try {
      for (const auto& k : keys) {
        send_req(tp::Request{tp::Op::kCheck, {key(k)}, {}, 0, 0}, io_deadline());
        if (recv_u8(io_deadline(), tp::Op::kCheck) != static_cast<std::uint8_t>(tp::CheckReply::kReady))
          missing.push_back(k);
      }
    } catch (const Error&) {
      return keys;
    }
    return missing;
  }

  void wait(const std::vector<std::string>& keys, Millis timeout) {
    ensure_connected();
    tp::Request q{tp::Op::kWait, {}, {}, 0, 0};
    for (const auto& k : keys) q.keys.push_back(key(k));
    send_req(q, io_deadline());
    std::uint8_t r = 0;
    IoStatus st = recv_exact(&r, 1, Clock::now() + timeout);
    if (st == IoStatus::kOk) {
      if (r != static_cast<std::uint8_t>(tp::WaitReply::kStopWaiting)) {
        if (looks_like_text(&r, 1) && rend > rpos && looks_like_text(rbuf.data() + rpos, rend - rpos))
          not_a_store("it answered WAIT with " + received(&r, 1), "store.wait");
        drop();
        throw RendezvousError("unexpected reply " + std::to_string(r) + " to WAIT from the store at " + where(),
                              ctx("store.wait", protocol_hint()));
      }
      return;
    }
    if (st != IoStatus::kTimeout) fail(st, "WAIT", timeout);
    std::vector<std::string> missing = keys;
    if (protocol == StoreProtocol::kV2) {
      // The cancel gets a second at most: a store that let the wait run out
      // may be frozen, and the caller's --timeout is already spent.
      const Deadline cancel_by = Clock::now() + std::min<Millis>(opts.io_timeout, Millis(1000));
      try {
        send_req(tp::Request{tp::Op::kCancelWait, {}, {}, 0, 0}, cancel_by);
        std::uint8_t c = recv_u8(cancel_by, tp::Op::kCancelWait);
        // The keys may have arrived between our deadline and the cancel: the
        // server then sent STOP_WAITING first and WAIT_CANCELED after it.
        if (c == static_cast<std::uint8_t>(tp::WaitReply::kStopWaiting)) c = recv_u8(cancel_by, tp::Op::kCancelWait);
        if (c != static_cast<std::uint8_t>(tp::WaitReply::kWaitCanceled)) {
          drop();
        } else {
          missing = missing_of(keys);
        }
      } catch (const Error&) {
        drop();  // no answer to the cancel: the wait's timeout is the error
      }
    } else {
      drop();  // 1.13 cannot cancel: a late STOP_WAITING would desync the stream
    }
    throw TimeoutError("store wait timed out after " + std::to_string(timeout.count()) + " ms; keys: " +
                           join_keys(keys) + (missing.empty() ? "" : "; missing: " + join_keys(missing)),
                       ctx("store.wait",
                           "the ranks that set these keys did not get there in time: check that they all "
                           "started, that WORLD_SIZE matches, and that they use the same "
                           "MASTER_ADDR:MASTER_PORT (" + where() + ")"));
  }
};

TcpStoreClient::TcpStoreClient(TcpStoreClientOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
  impl_->protocol = impl_->opts.protocol;
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->connect();
}

TcpStoreClient::~TcpStoreClient() = default;

void TcpStoreClient::set(const std::string& key, const Bytes& value) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kSet, {impl_->key(key)}, {value}, 0, 0},
                  impl_->io_deadline());
}

Bytes TcpStoreClient::get(const std::string& key, Millis timeout) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  if (impl_->opts.one_trip_get && impl_->protocol == StoreProtocol::kV2) {
    impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kGet, {impl_->key(key)}, {}, 0, 0},
                    impl_->io_deadline());
    Bytes v = impl_->recv_value(impl_->io_deadline(), tcp_protocol::Op::kGet);
    if (!v.empty()) return v;
    // Missing, or present and empty: WAIT tells them apart.
  }
  impl_->wait({key}, timeout);
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kGet, {impl_->key(key)}, {}, 0, 0}, impl_->io_deadline());
  return impl_->recv_value(impl_->io_deadline(), tcp_protocol::Op::kGet);
}

std::int64_t TcpStoreClient::add(const std::string& key, std::int64_t delta) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kAdd, {impl_->key(key)}, {}, delta, 0},
                  impl_->io_deadline());
  return impl_->recv_i64(impl_->io_deadline(), tcp_protocol::Op::kAdd);
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  tcp_protocol::Request q{tcp_protocol::Op::kCheck, {}, {}, 0, 0};
  for (const auto& k : keys) q.keys.push_back(impl_->key(k));
  impl_->send_req(q, impl_->io_deadline());
  return impl_->recv_u8(impl_->io_deadline(), tcp_protocol::Op::kCheck) ==
         static_cast<std::uint8_t>(tcp_protocol::CheckReply::kReady);
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->wait(keys, timeout);
}

Bytes TcpStoreClient::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  impl_->send_req(
      tcp_protocol::Request{tcp_protocol::Op::kCompareSet, {impl_->key(key)}, {expected, desired}, 0, 0},
      impl_->io_deadline());
  return impl_->recv_value(impl_->io_deadline(), tcp_protocol::Op::kCompareSet);
}

bool TcpStoreClient::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kDeleteKey, {impl_->key(key)}, {}, 0, 0},
                  impl_->io_deadline());
  return impl_->recv_i64(impl_->io_deadline(), tcp_protocol::Op::kDeleteKey) > 0;
}

std::int64_t TcpStoreClient::num_keys() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kNumKeys, {}, {}, 0, 0}, impl_->io_deadline());
  const std::int64_t n = impl_->recv_i64(impl_->io_deadline(), tcp_protocol::Op::kNumKeys);
  // No store holds a negative count, or 2^40 keys: another program's bytes.
  if (n < 0 || static_cast<std::uint64_t>(n) > kMaxPlausibleKeys)
    impl_->not_a_store("it answered GETNUMKEYS with a count of " + std::to_string(n), "store.io");
  return n;
}

std::vector<std::string> TcpStoreClient::list_keys() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  if (impl_->protocol != StoreProtocol::kV2)
    throw UsageError("the store at " + impl_->where() + " speaks the torch 1.13 protocol, which has no "
                     "way to list keys",
                     impl_->ctx("store.list_keys", "list the keys of a torch 2.10 (or later) store or of "
                                                   "`ddpdiag store serve`; on 1.13, get the keys you "
                                                   "expect by name"));
  impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kListKeys, {}, {}, 0, 0}, impl_->io_deadline());
  const auto deadline = impl_->io_deadline();
  // A 2.x server that predates LIST_KEYS closes the connection at it.
  std::uint8_t count[8];
  const IoStatus st = impl_->recv_exact(count, sizeof(count), deadline);
  if (st == IoStatus::kClosed) {
    impl_->drop();
    throw RendezvousError("the store at " + impl_->where() + " closed the connection when asked to list "
                          "its keys",
                          impl_->ctx("store.list_keys", "its server is older than torch 2.10, which "
                                                        "added listing keys; get the keys you expect "
                                                        "by name"));
  }
  if (st != IoStatus::kOk) impl_->fail(st, "LIST_KEYS", impl_->opts.io_timeout);
  const auto n = static_cast<std::int64_t>(tcp_protocol::load_u64(count));
  if (n < 0 || static_cast<std::uint64_t>(n) > kMaxPlausibleKeys)
    impl_->not_a_store("it answered LIST_KEYS with a count of " + std::to_string(n), "store.list_keys");
  std::vector<std::string> keys;
  for (std::int64_t i = 0; i < n; ++i) {
    Bytes k = impl_->recv_value(deadline, tcp_protocol::Op::kListKeys);
    keys.emplace_back(k.begin(), k.end());
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

StoreProtocol TcpStoreClient::protocol() const { return impl_->protocol; }

double TcpStoreClient::ping_us() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->ensure_connected();
  const auto t0 = Clock::now();
  if (impl_->protocol == StoreProtocol::kV2) {
    std::uint32_t nonce = impl_->make_nonce();
    impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kPing, {}, {}, 0, nonce}, impl_->io_deadline());
    std::uint8_t r[4];
    impl_->recv_or_fail(r, 4, impl_->io_deadline(), tcp_protocol::Op::kPing);
    if (tcp_protocol::load_u32(r) != nonce) {
      impl_->drop();
      throw RendezvousError("the store at " + impl_->where() + " answered PING with a wrong nonce",
                            impl_->ctx("store.ping", "another client may share this connection; a bug"));
    }
  } else {
    impl_->send_req(tcp_protocol::Request{tcp_protocol::Op::kNumKeys, {}, {}, 0, 0}, impl_->io_deadline());
    const std::int64_t n = impl_->recv_i64(impl_->io_deadline(), tcp_protocol::Op::kNumKeys);
    // 1.13 has no handshake: this reply is the first sign of what answers.
    if (n < 0 || static_cast<std::uint64_t>(n) > kMaxPlausibleKeys)
      impl_->not_a_store("it answered GETNUMKEYS with a count of " + std::to_string(n), "store.ping");
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

int TcpStoreClient::connect_attempts() const { return impl_->attempts; }

}  // namespace ddpdiag
