// TcpStoreServer: one epoll thread serving every connection of both c10d
// protocols.
//
// Invariants of the event loop:
// - Only the loop thread touches the key map, the connections and the
//   waiters; other threads see num_keys/num_connections through atomics and
//   stop the loop through the eventfd.
// - Sockets are non-blocking. Each connection has an input buffer that the
//   incremental parser reads complete requests from, and an output buffer
//   holding what the kernel did not take yet (EPOLLOUT is armed only while it
//   is non-empty). A request is handled only once all its bytes are there,
//   so a slow or silent client never blocks the others.
// - A connection's protocol is decided by its first bytes (sniff_protocol):
//   the 2.x preamble (VALIDATE + magic) or anything else, which is 1.13.
// - Anything the protocol does not allow (unknown op, oversized key or value,
//   GET of a missing key, a counter std::stoll cannot read) closes that
//   connection and only that one, as the c10d servers do. What is oversized
//   depends on the connection's protocol: 2.x gets torch 2.x's limits
//   (8 KiB keys, 8 MiB values, 128 Ki keys per request); 1.13, whose server
//   has none, only sanity bounds (see tcp_protocol::kV1Limits).
// - WAIT parks a waiter holding the set of missing keys; every op that
//   creates or changes a key (SET, ADD, APPEND, COMPARE_SET when it writes,
//   MULTI_SET) wakes the waiters of that key, and a waiter whose set becomes
//   empty is answered STOP_WAITING. CANCEL_WAIT (2.x) drops the connection's
//   waiters and answers WAIT_CANCELED; closing a connection drops them too.
// - Queues (2.x QUEUE_PUSH/POP/LEN) live beside the keys, not among them
//   (GETNUMKEYS does not count them), but a non-empty queue makes its name
//   count as present for CHECK and WAIT, and a push wakes its waiters: that
//   is how a blocking queue_pop of a 2.x client waits. Matched against
//   torch 2.11's server: POP answers the length before the pop, then the
//   value when that length was not 0.
// - GET (and MULTI_GET) of a missing key: a 1.13 server closes the
//   connection, a 2.x server answers an empty value; each connection gets
//   the behaviour of its protocol.
// - LIST_KEYS (2.x, torch 2.10 and later) answers the number of keys, then
//   each key as stored, queues left out (as torch's server does).
// - 1.13's WATCH_KEY (the callback connection of its Python client) is
//   answered by closing the connection: ddpdiag does not implement key-change
//   notifications, and a close makes torch's watch call fail instead of hang.
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "comm/errors.h"
#include "comm/ip_text.h"
#include "comm/store/tcp_protocol.h"
#include "comm/store/tcp_store.h"

namespace ddpdiag {
namespace {

namespace tp = tcp_protocol;

constexpr std::size_t kReadChunkBytes = 64 * 1024;
// Per readiness event, read at most this much from one connection before
// serving the others (level-triggered epoll brings us back).
constexpr std::size_t kMaxReadPerEventBytes = 1u << 20;
// How long the loop keeps polling after events before it blocks (see loop()).
constexpr std::chrono::microseconds kSpinAfterEvents{50};
constexpr std::uint64_t kEventFdTag = 0;
constexpr std::uint64_t kListenTag = 1;
constexpr std::uint64_t kFirstConnId = 16;
// Keys one connection may wait on at once, over all its unanswered WAITs: a
// client has one at a time (of at most 128 Ki keys), but a torch 1.13 client
// whose wait timed out leaves its waiter behind, so a few hundred stale ones
// of a few keys are normal. At about 100 bytes a key, this bounds what one
// connection can make the store hold to ~100 MiB.
constexpr std::size_t kMaxWaitedKeys = std::size_t{1} << 20;

void raise_fd_limit() {
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_NOFILE, &lim);
  }
}

std::string errno_text(int err) { return std::strerror(err); }

}  // namespace

struct TcpStoreServer::Impl {
  struct Waiter {
    std::uint64_t conn_id = 0;
    std::unordered_set<std::string> missing;
    std::size_t keys = 0;  // missing when it began: its share of its connection's waited_keys
  };
  struct Conn {
    int fd = -1;
    std::uint64_t id = 0;
    std::optional<StoreProtocol> protocol;
    Bytes in;
    std::size_t in_off = 0;
    std::size_t need = 0;  // don't parse again until in holds this many bytes
    Bytes out;
    std::size_t out_off = 0;
    bool epollout_armed = false;
    bool closing = false;
    std::vector<std::uint64_t> waits;
    std::size_t waited_keys = 0;  // over its waits not yet answered (kMaxWaitedKeys)
  };

  TcpStoreServerOptions opts;
  tp::ParseLimits limits_v1 = tp::kV1Limits;
  tp::ParseLimits limits_v2 = tp::kV2Limits;
  int listen_fd = -1;
  int epoll_fd = -1;
  int event_fd = -1;
  int spare_fd = -1;  // closed to accept-and-drop when the process runs out of fds
  // Out of descriptors with no way to drop the pending client (another
  // thread of the process took the spare's slot): the listening socket is
  // taken out of epoll until then, so the loop neither spins nor stops
  // answering the clients it has.
  std::optional<std::chrono::steady_clock::time_point> listen_paused_until;
  bool told_out_of_fds = false;
  int bound_port = 0;
  std::thread loop_thread;
  std::atomic<std::size_t> open_connections{0};
  std::atomic<std::int64_t> key_count{0};
  std::atomic<std::uint64_t> requests{0};

  // Loop-thread state.
  std::unordered_map<std::string, Bytes> kv;
  std::unordered_map<std::string, std::deque<Bytes>> queues;  // never holds an empty deque
  std::unordered_map<std::uint64_t, Conn> conns;
  std::unordered_map<std::uint64_t, Waiter> waiters;
  std::unordered_map<std::string, std::vector<std::uint64_t>> waiters_by_key;
  std::vector<std::uint64_t> to_close;
  std::vector<std::uint8_t> read_buf;  // the loop's scratch for recv
  std::uint64_t next_conn_id = kFirstConnId;
  std::optional<bool> nodelay_inherited;  // known from the first accepted socket
  std::uint64_t next_wait_id = 1;

  ~Impl() {
    for (auto& [id, c] : conns) ::close(c.fd);
    for (int fd : {listen_fd, epoll_fd, event_fd, spare_fd})
      if (fd >= 0) ::close(fd);
  }

  void bind_and_listen() {
    // getaddrinfo would take 70000 as 70000 % 65536 and serve on 4464.
    if (opts.port < 0 || opts.port > 65535)
      throw UsageError("cannot serve the store on port " + std::to_string(opts.port) +
                           ": not a TCP port (0..65535, 0 picks a free one)",
                       {"store.serve", -1, -1, "pick a free port, e.g. 29500, or 0 to let the system choose"});
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    addrinfo* res = nullptr;
    std::string port_s = std::to_string(opts.port);
    const char* host = opts.host.empty() ? nullptr : opts.host.c_str();
    int rc = ::getaddrinfo(host, port_s.c_str(), &hints, &res);
    // An IPv6 host in brackets, as the first line's address ([::]:29500).
    std::string where =
        (opts.host.find(':') != std::string::npos ? "[" + opts.host + "]" : opts.host) + ":" + port_s;
    if (rc != 0)
      throw RendezvousError("cannot resolve the store bind address " + where + ": " + gai_strerror(rc),
                            {"store.serve", -1, -1, "use a numeric address such as 0.0.0.0 or ::"});
    int last_err = 0;
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        last_err = errno;
        continue;
      }
      int one = 1;
      ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // inherited: set_nodelay
      if (ai->ai_family == AF_INET6) {
        // "::" serves IPv4 clients too (v4-mapped), as torch's server does.
        int zero = 0;
        ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
      }
      if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
        listen_fd = fd;
        break;
      }
      last_err = errno;
      ::close(fd);
    }
    ::freeaddrinfo(res);
    if (listen_fd >= 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      ::getsockname(listen_fd, reinterpret_cast<sockaddr*>(&ss), &len);
      bound_port = ss.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port)
                                            : ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
      return;
    }
    if (last_err == EADDRINUSE)
      throw RendezvousError(
          "cannot serve the store on " + where + ": address already in use",
          {"store.serve", -1, -1,
           "port " + port_s +
               " is held by another process: another job, a leftover ddpdiag, a launcher's "
               "agent (torchrun's agent hosts its TCPStore on MASTER_PORT), or a second process "
               "of this job started as rank 0 (check RANK / --rank). Pick a free port, or "
               "connect to that store as a client instead of hosting one"});
    throw RendezvousError("cannot serve the store on " + where + ": " + errno_text(last_err),
                          {"store.serve", -1, -1,
                           last_err == EACCES ? "ports below 1024 need privileges; pick another port"
                                              : "check the host is an address of this machine"});
  }

  void start() {
    raise_fd_limit();
    limits_v1.max_key_bytes = opts.v1_max_key_bytes;
    limits_v1.max_value_bytes = opts.v1_max_value_bytes;
    limits_v2.max_key_bytes = opts.max_key_bytes;
    limits_v2.max_value_bytes = opts.max_value_bytes;
    bind_and_listen();
    epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
    event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (epoll_fd < 0 || event_fd < 0)
      throw RendezvousError("cannot start the store event loop: " + errno_text(errno), {"store.serve", -1, -1, ""});
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = kEventFdTag;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, event_fd, &ev);
    ev.data.u64 = kListenTag;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, listen_fd, &ev);
    loop_thread = std::thread([this] { loop(); });
  }

  void stop() {
    std::uint64_t one = 1;
    if (event_fd >= 0) (void)!::write(event_fd, &one, sizeof(one));
    if (loop_thread.joinable()) loop_thread.join();
  }

  void loop() {
    std::vector<epoll_event> events(256);
    // After a batch of events the loop polls (epoll_wait with no timeout)
    // for kSpinAfterEvents before it blocks: a client's next request
    // usually comes within a round trip, and a blocked thread's wake-up
    // costs tens of microseconds on a VM. One client's round trip went from
    // 66 to 25 us on a 2-core VM (bench_store, store_get threads:1); an
    // idle store never spins.
    std::chrono::steady_clock::time_point spin_until{};
    for (;;) {
      int wait_ms = -1;
      if (listen_paused_until) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            *listen_paused_until - std::chrono::steady_clock::now());
        wait_ms = static_cast<int>(std::max<std::int64_t>(1, left.count() + 1));
      }
      int n = 0;
      if (!listen_paused_until && std::chrono::steady_clock::now() < spin_until) {
        do {
          n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), 0);
        } while (n == 0 && std::chrono::steady_clock::now() < spin_until);
      }
      if (n == 0) n = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), wait_ms);
      if (n > 0) spin_until = std::chrono::steady_clock::now() + kSpinAfterEvents;
      if (n < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (listen_paused_until && std::chrono::steady_clock::now() >= *listen_paused_until) {
        listen_paused_until.reset();
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.u64 = kListenTag;
        ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
        accept_all();
      }
      for (int i = 0; i < n; ++i) {
        std::uint64_t tag = events[i].data.u64;
        if (tag == kEventFdTag) return;
        if (tag == kListenTag) {
          accept_all();
          continue;
        }
        auto it = conns.find(tag);
        if (it == conns.end() || it->second.closing) continue;
        Conn& c = it->second;
        std::uint32_t e = events[i].events;
        if (e & EPOLLOUT) flush(c);
        if (!c.closing && (e & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR))) on_readable(c);
      }
      close_pending();
    }
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE) {
          out_of_fds(errno);
          // Out of descriptors: accept and drop one pending client so the
          // listening socket stops being readable, as long as that works.
          int drop = -1, drop_err = EMFILE;
          if (spare_fd >= 0) {
            ::close(spare_fd);
            drop = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
            drop_err = errno;
            if (drop >= 0) ::close(drop);
            spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          }
          if (drop >= 0) continue;
          if (drop_err == EAGAIN || drop_err == EWOULDBLOCK) return;
          // No descriptor to drop it with: stop listening for a while.
          listen_paused_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
          epoll_event ev{};
          ev.events = 0;
          ev.data.u64 = kListenTag;
          ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, listen_fd, &ev);
          return;
        }
        return;  // EAGAIN or a transient error: back to epoll
      }
      if (conns.size() >= static_cast<std::size_t>(opts.max_connections)) {
        ::close(fd);
        continue;
      }
      set_nodelay(fd);
      std::uint64_t id = next_conn_id++;
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.u64 = id;
      if (::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        ::close(fd);
        continue;
      }
      Conn& c = conns[id];
      c.fd = fd;
      c.id = id;
      open_connections.store(conns.size(), std::memory_order_relaxed);
    }
  }

  // Replies go out at once (no Nagle delay). Linux hands the listening
  // socket's TCP_NODELAY down to the sockets it accepts, which saves a
  // system call per client; the first accepted socket shows whether this
  // kernel does, and where it does not every socket gets its own.
  void set_nodelay(int fd) {
    if (!nodelay_inherited) {
      int on = 0;
      socklen_t len = sizeof(on);
      nodelay_inherited = ::getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, &len) == 0 && on != 0;
    }
    if (*nodelay_inherited) return;
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }

  // Says once that the process has run out of file descriptors: clients
  // beyond that are turned away until some close.
  void out_of_fds(int err) {
    if (told_out_of_fds || !opts.on_out_of_fds) return;
    told_out_of_fds = true;
    rlimit rl{};
    const bool known = ::getrlimit(RLIMIT_NOFILE, &rl) == 0;
    // Plain concatenation: this file is also built alone, for the fuzzers.
    // What the callback throws (a log that cannot be written) must not end
    // the event loop, and with it the store.
    try {
      opts.on_out_of_fds("this process has run out of file descriptors (" + errno_text(err) + ")" +
                         (known ? " (ulimit -n is " + std::to_string(rl.rlim_cur) + ")" : std::string()) +
                         ": new clients are turned away until some close (raise the limit, e.g. "
                         "ulimit -n 65536, or start fewer ranks per host)");
    } catch (...) {
    }
  }

  // Closes c for a request its protocol does not allow, and says why.
  void refuse(Conn& c, const std::string& why) {
    if (!c.closing && opts.on_refused) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      std::string peer = "a client";
      if (::getpeername(c.fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0)
        peer = endpoint_text(reinterpret_cast<const sockaddr*>(&ss));
      try {
        opts.on_refused(peer + " (" +
                        std::string(c.protocol ? store_protocol_name(*c.protocol) : "unknown protocol") +
                        "): " + why);
      } catch (...) {
        // As above: the connection is closed all the same, the store goes on.
      }
    }
    mark_close(c);
  }

  void mark_close(Conn& c) {
    if (c.closing) return;
    c.closing = true;
    to_close.push_back(c.id);
  }

  void close_pending() {
    for (std::uint64_t id : to_close) {
      auto it = conns.find(id);
      if (it == conns.end()) continue;
      drop_waiters(it->second);
      // close() takes the socket out of the epoll set (no EPOLL_CTL_DEL: a
      // system call per client). Should a forked child still hold it for a
      // moment before its exec, events of the old id find no connection
      // and are skipped.
      ::close(it->second.fd);
      conns.erase(it);
    }
    to_close.clear();
    open_connections.store(conns.size(), std::memory_order_relaxed);
  }

  void on_readable(Conn& c) {
    std::size_t got_total = 0;
    bool eof = false;
    // Read into the loop's scratch buffer and append what came: growing
    // c.in by a whole chunk first would zero-fill 64 KiB per event, which
    // costs more than serving a small request.
    if (read_buf.size() < kReadChunkBytes) read_buf.resize(kReadChunkBytes);
    while (got_total < kMaxReadPerEventBytes) {
      ssize_t r = ::recv(c.fd, read_buf.data(), kReadChunkBytes, 0);
      if (r > 0) {
        c.in.insert(c.in.end(), read_buf.data(), read_buf.data() + r);
        got_total += static_cast<std::size_t>(r);
        if (static_cast<std::size_t>(r) < kReadChunkBytes) break;
        continue;
      }
      if (r == 0) {
        eof = true;
      } else if (errno == EINTR) {
        continue;
      } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
        eof = true;
      }
      break;
    }
    // At the end of the stream parse whatever came, whatever `need` said: a
    // many-key request asks for the length prefixes of all its remaining
    // keys before it is parsed again, and a malformed field among what came
    // is then refused (and logged) rather than dropped unread.
    if (eof) c.need = 0;
    process_input(c);
    // Requests that arrived before the FIN are served; the replies are lost
    // with the socket, as they are on a c10d server.
    if (eof) mark_close(c);
  }

  void process_input(Conn& c) {
    while (!c.closing) {
      std::size_t avail = c.in.size() - c.in_off;
      if (avail == 0 || avail < c.need) break;
      const std::uint8_t* p = c.in.data() + c.in_off;
      if (!c.protocol) {
        c.protocol = tp::sniff_protocol(p, avail);
        if (!c.protocol) break;  // "00" then fewer than 5 bytes: wait
      }
      tp::ParseResult pr = tp::parse_request(*c.protocol, p, avail,
                                             *c.protocol == StoreProtocol::kV1 ? limits_v1 : limits_v2);
      if (pr.status == tp::ParseStatus::kNeedMore) {
        c.need = pr.need;
        break;
      }
      if (pr.status == tp::ParseStatus::kMalformed) {
        bool unknown_op = pr.error.rfind("unknown query type", 0) == 0;
        refuse(c, pr.error + (unknown_op && *c.protocol == StoreProtocol::kV2
                                  ? " (an operation of a torch newer than this ddpdiag knows?)"
                                  : ""));
        break;
      }
      c.need = 0;
      c.in_off += pr.consumed;
      requests.store(requests.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
      handle(c, pr.request);
    }
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > 0 && c.in_off >= c.in.size() / 2) {
      c.in.erase(c.in.begin(), c.in.begin() + static_cast<std::ptrdiff_t>(c.in_off));
      c.in_off = 0;
    }
  }

  void reply(Conn& c, const Bytes& bytes) {
    if (c.closing) return;
    if (c.out_off == c.out.size()) {
      c.out.clear();
      c.out_off = 0;
      std::size_t sent = 0;
      while (sent < bytes.size()) {
        ssize_t w = ::send(c.fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
        if (w > 0) {
          sent += static_cast<std::size_t>(w);
        } else if (w < 0 && errno == EINTR) {
          continue;
        } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
          break;
        } else {
          mark_close(c);
          return;
        }
      }
      if (sent == bytes.size()) return;
      c.out.assign(bytes.begin() + static_cast<std::ptrdiff_t>(sent), bytes.end());
    } else {
      // Judged on what waited before this reply: one reply may be larger
      // than the bound by itself (a 1.13 value can be up to 1 GiB, a 2.x one
      // grown by APPEND too) and is still sent whole to a client that reads.
      const std::size_t waiting = c.out.size() - c.out_off;
      if (waiting > opts.max_pending_output_bytes) {
        refuse(c, "it does not read its replies (" + std::to_string(waiting) +
                      " bytes waiting, over the limit of " + std::to_string(opts.max_pending_output_bytes) + ")");
        return;
      }
      c.out.insert(c.out.end(), bytes.begin(), bytes.end());
    }
    arm_epollout(c, true);
  }

  void arm_epollout(Conn& c, bool on) {
    if (c.epollout_armed == on) return;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP | (on ? EPOLLOUT : 0u);
    ev.data.u64 = c.id;
    ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
    c.epollout_armed = on;
  }

  void flush(Conn& c) {
    while (c.out_off < c.out.size()) {
      ssize_t w = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (w > 0) {
        c.out_off += static_cast<std::size_t>(w);
      } else if (w < 0 && errno == EINTR) {
        continue;
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        return;
      } else {
        mark_close(c);
        return;
      }
    }
    c.out.clear();
    c.out_off = 0;
    arm_epollout(c, false);
  }

  bool present(const std::string& key) const { return kv.count(key) > 0 || queues.count(key) > 0; }

  void set_key(const std::string& key, Bytes value, bool wake_now = true) {
    kv[key] = std::move(value);
    key_count.store(static_cast<std::int64_t>(kv.size()), std::memory_order_relaxed);
    if (wake_now) wake(key);
  }

  void wake(const std::string& key) {
    auto it = waiters_by_key.find(key);
    if (it == waiters_by_key.end()) return;
    std::vector<std::uint64_t> ids = std::move(it->second);
    waiters_by_key.erase(it);
    for (std::uint64_t wid : ids) {
      auto w = waiters.find(wid);
      if (w == waiters.end()) continue;
      w->second.missing.erase(key);
      if (!w->second.missing.empty()) continue;
      auto cit = conns.find(w->second.conn_id);
      const std::size_t keys = w->second.keys;
      waiters.erase(w);
      if (cit == conns.end()) continue;
      Conn& wc = cit->second;
      std::erase(wc.waits, wid);
      wc.waited_keys -= std::min(wc.waited_keys, keys);
      Bytes out;
      tp::append_u8(out, static_cast<std::uint8_t>(tp::WaitReply::kStopWaiting));
      reply(wc, out);
    }
  }

  void drop_waiters(Conn& c) {
    for (std::uint64_t wid : c.waits) {
      auto w = waiters.find(wid);
      if (w == waiters.end()) continue;
      for (const auto& key : w->second.missing) {
        auto k = waiters_by_key.find(key);
        if (k == waiters_by_key.end()) continue;
        std::erase(k->second, wid);
        if (k->second.empty()) waiters_by_key.erase(k);
      }
      waiters.erase(w);
    }
    c.waits.clear();
    c.waited_keys = 0;
  }

  void handle(Conn& c, tp::Request& q) {
    Bytes out;
    switch (q.op) {
      case tp::Op::kValidate:
        return;  // no reply; sniffing already required it first on 2.x connections
      case tp::Op::kPing:
        tp::append_u32(out, q.nonce);
        break;
      case tp::Op::kSet:
        set_key(q.keys[0], std::move(q.values[0]));
        return;
      case tp::Op::kAppend: {
        auto it = kv.find(q.keys[0]);
        const std::size_t grown = (it == kv.end() ? 0 : it->second.size()) + q.values[0].size();
        if (grown > opts.max_appended_value_bytes) {
          refuse(c, "APPEND to key '" + tp::printable(q.keys[0]) + "' would make its value " +
                        std::to_string(grown) + " bytes, over ddpdiag's bound of " +
                        std::to_string(opts.max_appended_value_bytes) +
                        " (torch's server has none; keep large data out of the store)");
          return;
        }
        Bytes& v = it == kv.end() ? kv[q.keys[0]] : it->second;
        v.insert(v.end(), q.values[0].begin(), q.values[0].end());
        key_count.store(static_cast<std::int64_t>(kv.size()), std::memory_order_relaxed);
        wake(q.keys[0]);
        return;
      }
      case tp::Op::kMultiSet:
        for (std::size_t i = 0; i < q.keys.size(); ++i) set_key(q.keys[i], std::move(q.values[i]));
        return;
      case tp::Op::kCompareSet: {
        const std::string& key = q.keys[0];
        Bytes& expected = q.values[0];
        Bytes& desired = q.values[1];
        auto it = kv.find(key);
        if (it == kv.end()) {
          if (expected.empty()) {
            tp::append_bytes(out, desired);
            set_key(key, std::move(desired));
          } else {
            tp::append_bytes(out, expected);
          }
        } else {
          if (it->second == expected) {
            tp::append_bytes(out, desired);
            set_key(key, std::move(desired));
          } else {
            tp::append_bytes(out, it->second);
          }
        }
        break;
      }
      case tp::Op::kGet: {
        auto it = kv.find(q.keys[0]);
        if (it == kv.end()) {
          if (*c.protocol == StoreProtocol::kV1) {
            mark_close(c);  // as 1.13: clients WAIT before GET
            return;
          }
          tp::append_bytes(out, Bytes{});  // as 2.x
          break;
        }
        tp::append_bytes(out, it->second);
        break;
      }
      case tp::Op::kMultiGet: {
        for (const auto& k : q.keys) {
          auto it = kv.find(k);
          tp::append_bytes(out, it == kv.end() ? Bytes{} : it->second);
        }
        break;
      }
      case tp::Op::kAdd: {
        std::int64_t current = 0;
        auto it = kv.find(q.keys[0]);
        if (it != kv.end()) {
          bool out_of_range = false;
          auto v = tp::parse_counter(it->second, &out_of_range);
          if (!v) {
            // torch's std::stoll throws here, and its server drops the
            // connection; the value stays as it was.
            refuse(c, "ADD to key '" + tp::printable(q.keys[0]) +
                          (out_of_range ? "', whose value '" + tp::printable(to_string(it->second), 40) +
                                              "' is an integer outside the int64 range"
                                        : "', whose value is not an integer (" +
                                              std::to_string(it->second.size()) + " bytes)"));
            return;
          }
          current = *v;
        }
        std::int64_t next = static_cast<std::int64_t>(static_cast<std::uint64_t>(current) +
                                                      static_cast<std::uint64_t>(q.delta));
        tp::append_i64(out, next);
        set_key(q.keys[0], tp::format_counter(next), false);
        // torch 1.13's server answers the ADD before it wakes the key's
        // waiters (2.x's wakes them first). A 1.13 client whose wait timed
        // out leaves its waiter behind (it has no cancel): its next ADD of
        // that key must read its own answer first, then the stale wake-up,
        // or it reads the wake-up's bytes as the counter.
        if (*c.protocol == StoreProtocol::kV1) reply(c, out);
        wake(q.keys[0]);
        if (*c.protocol == StoreProtocol::kV1) return;
        break;
      }
      case tp::Op::kCheck: {
        bool all = std::all_of(q.keys.begin(), q.keys.end(), [&](const std::string& k) { return present(k); });
        tp::append_u8(out, static_cast<std::uint8_t>(all ? tp::CheckReply::kReady : tp::CheckReply::kNotReady));
        break;
      }
      case tp::Op::kWait: {
        Waiter w;
        w.conn_id = c.id;
        for (const auto& k : q.keys)
          if (!present(k)) w.missing.insert(k);
        if (w.missing.empty()) {
          tp::append_u8(out, static_cast<std::uint8_t>(tp::WaitReply::kStopWaiting));
          break;
        }
        w.keys = w.missing.size();
        if (c.waited_keys + w.keys > kMaxWaitedKeys) {
          refuse(c, "it waits on more than " + std::to_string(kMaxWaitedKeys) +
                        " keys at once over its unanswered WAITs (" + std::to_string(c.waits.size()) +
                        " of them): a client waits on one at a time");
          return;
        }
        c.waited_keys += w.keys;
        std::uint64_t wid = next_wait_id++;
        for (const auto& k : w.missing) waiters_by_key[k].push_back(wid);
        waiters.emplace(wid, std::move(w));
        c.waits.push_back(wid);
        return;
      }
      case tp::Op::kCancelWait:
        drop_waiters(c);
        tp::append_u8(out, static_cast<std::uint8_t>(tp::WaitReply::kWaitCanceled));
        break;
      case tp::Op::kNumKeys:
        tp::append_i64(out, static_cast<std::int64_t>(kv.size()));
        break;
      case tp::Op::kDeleteKey: {
        std::int64_t n = static_cast<std::int64_t>(kv.erase(q.keys[0]));
        key_count.store(static_cast<std::int64_t>(kv.size()), std::memory_order_relaxed);
        tp::append_i64(out, n);
        break;
      }
      case tp::Op::kWatchKey:
        mark_close(c);  // see the file comment
        return;
      case tp::Op::kQueuePush:
        queues[q.keys[0]].push_back(std::move(q.values[0]));
        wake(q.keys[0]);
        return;
      case tp::Op::kQueuePop: {
        auto it = queues.find(q.keys[0]);
        std::size_t n = it == queues.end() ? 0 : it->second.size();
        tp::append_i64(out, static_cast<std::int64_t>(n));
        if (n > 0) {
          tp::append_bytes(out, it->second.front());
          it->second.pop_front();
          if (it->second.empty()) queues.erase(it);
        }
        break;
      }
      case tp::Op::kQueueLen: {
        auto it = queues.find(q.keys[0]);
        tp::append_i64(out, static_cast<std::int64_t>(it == queues.end() ? 0 : it->second.size()));
        break;
      }
      case tp::Op::kListKeys: {
        // The keys as stored (a torch client's carry its "/" prefix), not the
        // queues, as torch's server lists them; sorted, so a listing reads
        // the same every time (torch's order is its hash map's).
        std::vector<const std::string*> keys;
        keys.reserve(kv.size());
        for (const auto& [k, v] : kv) keys.push_back(&k);
        std::sort(keys.begin(), keys.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
        tp::append_i64(out, static_cast<std::int64_t>(keys.size()));
        for (const std::string* k : keys)
          tp::append_bytes(out, reinterpret_cast<const std::uint8_t*>(k->data()), k->size());
        break;
      }
    }
    reply(c, out);
  }
};

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions opts) : impl_(std::make_unique<Impl>()) {
  impl_->opts = std::move(opts);
  impl_->start();
}

TcpStoreServer::~TcpStoreServer() { impl_->stop(); }

int TcpStoreServer::port() const { return impl_->bound_port; }
std::size_t TcpStoreServer::num_connections() const {
  return impl_->open_connections.load(std::memory_order_relaxed);
}
std::int64_t TcpStoreServer::num_keys() const { return impl_->key_count.load(std::memory_order_relaxed); }
std::uint64_t TcpStoreServer::requests_served() const { return impl_->requests.load(std::memory_order_relaxed); }

}  // namespace ddpdiag
