// Rendezvous time of N local clients against a running store server, with
// our C++ client side (c10d wire protocol) and one connection per client, so
// that the same client side can be pointed at `ddpdiag store serve` and at
// torch's TCPStore server and the two servers compared.
//
// Two drivers for the same N connections and the same requests:
//   threads (default): one thread per client running TcpStoreClient, as N
//     ranks would each run a blocking client;
//   epoll: every client a non-blocking connection driven by one thread
//     (--epoll-threads K spreads them over K threads). On a machine with few
//     cores, N client threads take most of the CPU the server needs (each of
//     the server's replies wakes a thread); in a real job the ranks run on
//     other hosts. This driver keeps the clients' side cheap, so the time is
//     mostly the server's. Each connection still sends each request on its
//     own, and waits for a reply before the next request that needs it, as
//     the blocking client does.
//
// One rendezvous, as a job's ranks meet:
//   every client connects, SETs its own key, ADDs 1 to a shared counter;
//   the client whose ADD returns N SETs a "done" key; every client WAITs
//   for "done".
// Time: from the moment the client threads, started beforehand and parked
// at a gate (as a job's ranks are running before they meet), are released
// until the last client has returned from its WAIT. Every repeat uses fresh keys on the
// same server; connections are closed between repeats (outside the time).
//
// Prints one JSON object on stdout:
//   {"clients":N,"protocol":"torch-1.13","driver":"threads","times_s":[...],
//    "connect_s":[...]}
// where connect_s is, per repeat, when the last client had connected.
//
// Usage: ddpdiag_rendezvous_bench --port P [--host 127.0.0.1] [--clients 1024]
//          [--repeats 3] [--protocol 1.13|2.x] [--prefix KEY] [--timeout 120]
//          [--driver threads|epoll] [--epoll-threads 1]
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/store/tcp_protocol.h"
#include "comm/store/tcp_store.h"

namespace {

using namespace ddpdiag;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string host = "127.0.0.1";
  int port = -1;
  int clients = 1024;
  int repeats = 3;
  StoreProtocol protocol = StoreProtocol::kV1;
  std::string prefix = "rdzv_bench";
  int timeout_s = 120;
  bool epoll_driver = false;
  int epoll_threads = 1;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ddpdiag_rendezvous_bench: %s\n"
               "usage: ddpdiag_rendezvous_bench --port P [--host H] [--clients N] [--repeats R] "
               "[--protocol 1.13|2.x] [--prefix KEY] [--timeout S] [--driver threads|epoll] "
               "[--epoll-threads K]\n",
               why.c_str());
  std::exit(2);
}

int parse_int(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) usage(flag + ": '" + v + "' is not an integer");
  return static_cast<int>(x);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("rendezvous time of N local store clients");
    if (i + 1 >= argc) usage(flag + " needs a value");
    std::string v = argv[++i];
    if (flag == "--host") o.host = v;
    else if (flag == "--port") o.port = parse_int(flag, v);
    else if (flag == "--clients") o.clients = parse_int(flag, v);
    else if (flag == "--repeats") o.repeats = parse_int(flag, v);
    else if (flag == "--prefix") o.prefix = v;
    else if (flag == "--timeout") o.timeout_s = parse_int(flag, v);
    else if (flag == "--epoll-threads") o.epoll_threads = parse_int(flag, v);
    else if (flag == "--driver") {
      if (v == "threads") o.epoll_driver = false;
      else if (v == "epoll") o.epoll_driver = true;
      else usage("--driver is threads or epoll");
    }
    else if (flag == "--protocol") {
      if (v == "1.13") o.protocol = StoreProtocol::kV1;
      else if (v == "2.x") o.protocol = StoreProtocol::kV2;
      else usage("--protocol is 1.13 or 2.x");
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (o.port <= 0 || o.port > 65535) usage("--port is required");
  if (o.clients < 1 || o.repeats < 1 || o.timeout_s < 1 || o.epoll_threads < 1)
    usage("--clients, --repeats, --timeout and --epoll-threads are at least 1");
  return o;
}

// A thousand clients need a thousand descriptors, plus the server's share
// when it runs on this machine.
void raise_fd_limit(int clients) {
  rlimit rl{};
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return;
  const rlim_t want = static_cast<rlim_t>(clients) * 2 + 64;
  if (rl.rlim_cur >= want) return;
  rl.rlim_cur = std::min(want, rl.rlim_max);
  setrlimit(RLIMIT_NOFILE, &rl);
}

struct Outcome {
  double total_s = 0;
  double connect_s = 0;
};

// Both times from the gate's opening: the last client's connect and the
// last client's release.
Outcome outcome_since(Clock::time_point t0, Clock::time_point last_connect,
                      Clock::time_point last_done) {
  return {std::chrono::duration<double>(last_done - t0).count(),
          std::chrono::duration<double>(last_connect - t0).count()};
}

// The first failure among the client threads, reported once they are done.
class FirstError {
 public:
  void note(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu_);
    if (what_.empty()) what_ = what;
  }
  void rethrow() const {
    if (!what_.empty()) throw std::runtime_error(what_);
  }

 private:
  std::mutex mu_;
  std::string what_;
};

// Where the client threads wait for the clock to start. It opens once every
// thread has parked (thread start-up stays outside the time), with one futex
// wake for all of them and no mutex for them to queue on afterwards (a
// condition variable's waiters each take its mutex again on waking, one
// after the other, which 1,024 threads on a few cores would add to the time).
class Gate {
 public:
  void park() {
    parked_.fetch_add(1);
    open_.wait(0);
  }
  // Waits up to `limit` for n threads to park; opens; returns when it opened.
  Clock::time_point open_when_parked(int n, std::chrono::milliseconds limit) {
    const auto until = Clock::now() + limit;
    while (parked_.load() < n && Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    return open();
  }
  Clock::time_point open() {
    const Clock::time_point at = Clock::now();
    open_.store(1);
    open_.notify_all();
    return at;
  }

 private:
  std::atomic<int> parked_{0};
  std::atomic<int> open_{0};  // int: a futex word of its own
};

Outcome rendezvous_once(const Options& o, int repeat) {
  const std::string base = o.prefix + "/" + std::to_string(repeat) + "/";
  const Millis timeout{std::chrono::seconds(o.timeout_s)};
  std::vector<std::unique_ptr<TcpStoreClient>> held(o.clients);
  std::vector<Clock::time_point> connected(o.clients), done(o.clients);
  FirstError first_error;
  std::vector<std::thread> threads;
  threads.reserve(o.clients);
  Gate gate;
  auto client = [&](int i) {
    gate.park();
    try {
      TcpStoreClientOptions co;
      co.host = o.host;
      co.port = o.port;
      co.protocol = o.protocol;
      co.protocol_flag = "--protocol";
      co.connect_timeout = timeout;
      co.io_timeout = timeout;
      co.rank = i;
      auto c = std::make_unique<TcpStoreClient>(co);
      connected[i] = Clock::now();
      c->set(base + "client/" + std::to_string(i), Bytes{'1'});
      if (c->add(base + "arrived", 1) == o.clients) c->set(base + "done", Bytes{'1'});
      c->wait({base + "done"}, timeout);
      done[i] = Clock::now();
      held[i] = std::move(c);  // closed after the clock stops
    } catch (const std::exception& e) {
      first_error.note("client " + std::to_string(i) + ": " + e.what());
    }
  };
  for (int i = 0; i < o.clients; ++i) {
    try {
      threads.emplace_back(client, i);
    } catch (const std::system_error& e) {  // out of threads: let the others go, then fail
      gate.open();
      for (auto& t : threads) t.join();
      throw std::runtime_error("could not start client thread " + std::to_string(i) + " of " +
                               std::to_string(o.clients) + ": " + e.what() +
                               " (raise ulimit -u or use fewer --clients)");
    }
  }
  const Clock::time_point t0 = gate.open_when_parked(o.clients, timeout);
  for (auto& t : threads) t.join();
  first_error.rethrow();
  return outcome_since(t0, *std::max_element(connected.begin(), connected.end()),
                       *std::max_element(done.begin(), done.end()));
}

// ---- the epoll driver -------------------------------------------------------

namespace tp = tcp_protocol;

// The server's address, resolved once (the threads driver resolves per
// client, as each rank would).
struct Address {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};

Address resolve(const Options& o) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(o.port);
  int rc = ::getaddrinfo(o.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    throw std::runtime_error("cannot resolve " + o.host + ": " + ::gai_strerror(rc));
  Address a;
  std::memcpy(&a.addr, res->ai_addr, res->ai_addrlen);
  a.len = res->ai_addrlen;
  a.family = res->ai_family;
  ::freeaddrinfo(res);
  return a;
}

// One client's connection and where it is in its rendezvous.
struct MuxClient {
  enum class Step { kConnecting, kPing, kAdd, kWait, kDone };
  int fd = -1;
  int index = 0;
  Step step = Step::kConnecting;
  Bytes out;  // what the kernel did not take yet
  std::size_t out_off = 0;
  std::uint8_t in[8] = {};
  std::size_t in_len = 0;
  std::size_t need = 0;  // reply bytes the current step waits for
  std::uint32_t nonce = 0;
  Clock::time_point connected, done;
};

const char* step_name(MuxClient::Step s) {
  switch (s) {
    case MuxClient::Step::kConnecting: return "connect";
    case MuxClient::Step::kPing: return "the 2.x handshake (VALIDATE, PING)";
    case MuxClient::Step::kAdd: return "ADD";
    case MuxClient::Step::kWait: return "WAIT";
    case MuxClient::Step::kDone: return "done";
  }
  return "?";
}

// Drives clients [first, last) of one rendezvous on one thread.
class MuxDriver {
 public:
  MuxDriver(const Options& o, const Address& addr, const std::string& base, int first, int last,
            const std::atomic<bool>& abort)
      : o_(o), addr_(addr), base_(base), abort_(abort), clients_(static_cast<std::size_t>(last - first)) {
    for (int i = first; i < last; ++i) clients_[static_cast<std::size_t>(i - first)].index = i;
  }
  ~MuxDriver() {
    for (auto& c : clients_)
      if (c.fd >= 0) ::close(c.fd);
    if (ep_ >= 0) ::close(ep_);
  }
  MuxDriver(const MuxDriver&) = delete;
  MuxDriver& operator=(const MuxDriver&) = delete;

  // Runs every client to the end of its WAIT; throws on the first failure.
  void run() {
    ep_ = ::epoll_create1(EPOLL_CLOEXEC);
    if (ep_ < 0) throw std::runtime_error(std::string("epoll_create1: ") + std::strerror(errno));
    const auto deadline = Clock::now() + std::chrono::seconds(o_.timeout_s);
    for (std::size_t k = 0; k < clients_.size(); ++k) start_connect(k);
    std::vector<epoll_event> events(256);
    while (finished_ < clients_.size()) {
      if (abort_.load(std::memory_order_relaxed)) throw std::runtime_error("stopped: another driver thread failed");
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) throw std::runtime_error(stuck_message());
      int n = ::epoll_wait(ep_, events.data(), static_cast<int>(events.size()),
                           static_cast<int>(std::min<long long>(left, 200)));
      if (n < 0) {
        if (errno == EINTR) continue;
        throw std::runtime_error(std::string("epoll_wait: ") + std::strerror(errno));
      }
      for (int e = 0; e < n; ++e) on_event(events[static_cast<std::size_t>(e)].data.u32, events[static_cast<std::size_t>(e)].events);
    }
  }

  const std::vector<MuxClient>& clients() const { return clients_; }

 private:
  [[noreturn]] void fail(const MuxClient& c, const std::string& what) const {
    throw std::runtime_error("client " + std::to_string(c.index) + ", at " + step_name(c.step) + ": " + what);
  }

  std::string stuck_message() const {
    for (const auto& c : clients_)
      if (c.step != MuxClient::Step::kDone)
        return "client " + std::to_string(c.index) + " still at " + step_name(c.step) + " after " +
               std::to_string(o_.timeout_s) + " s (" + std::to_string(clients_.size() - finished_) +
               " of this thread's clients unfinished)";
    return "timed out";
  }

  // The driver's own system calls are kept few, so that its time is mostly
  // the kernel's TCP work that every client needs: the socket is watched
  // edge-triggered for input and output from the start (never modified),
  // TCP_NODELAY is set before connecting, and a complete reply is not
  // followed by a read that would only say "nothing more" (the server sends
  // nothing until the next request).
  void start_connect(std::size_t k) {
    MuxClient& c = clients_[k];
    c.fd = ::socket(addr_.family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c.fd < 0) fail(c, std::string("socket: ") + std::strerror(errno) + " (raise ulimit -n)");
    int one = 1;
    ::setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // as the blocking client
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET;
    ev.data.u32 = static_cast<std::uint32_t>(k);
    if (::epoll_ctl(ep_, EPOLL_CTL_ADD, c.fd, &ev) != 0) fail(c, std::string("epoll_ctl: ") + std::strerror(errno));
    int rc = ::connect(c.fd, reinterpret_cast<const sockaddr*>(&addr_.addr), addr_.len);
    if (rc != 0 && errno != EINPROGRESS)
      fail(c, "cannot connect to " + o_.host + ":" + std::to_string(o_.port) + ": " + std::strerror(errno));
    if (rc == 0) on_connected(k);
  }

  void on_connected(std::size_t k) {
    MuxClient& c = clients_[k];
    c.connected = Clock::now();
    if (o_.protocol == StoreProtocol::kV2) {
      c.nonce = static_cast<std::uint32_t>(0x00800000u | static_cast<std::uint32_t>(c.index));
      Bytes b = tp::encode_request(StoreProtocol::kV2,
                                   tp::Request{tp::Op::kValidate, {}, {}, 0, tp::kValidationMagic});
      Bytes p = tp::encode_request(StoreProtocol::kV2, tp::Request{tp::Op::kPing, {}, {}, 0, c.nonce});
      b.insert(b.end(), p.begin(), p.end());
      expect(c, MuxClient::Step::kPing, 4);
      send(k, b);  // one write, as the blocking client sends it
    } else {
      send_set_add(k);
    }
  }

  void expect(MuxClient& c, MuxClient::Step step, std::size_t bytes) {
    c.step = step;
    c.need = bytes;
    c.in_len = 0;
  }

  void send_set_add(std::size_t k) {
    MuxClient& c = clients_[k];
    expect(c, MuxClient::Step::kAdd, 8);
    send(k, tp::encode_request(o_.protocol, tp::Request{tp::Op::kSet,
                                                        {base_ + "client/" + std::to_string(c.index)},
                                                        {Bytes{'1'}}, 0, 0}));
    send(k, tp::encode_request(o_.protocol, tp::Request{tp::Op::kAdd, {base_ + "arrived"}, {}, 1, 0}));
  }

  // One request, one write: queued behind what the kernel did not take yet,
  // then written out as far as the kernel takes it now (EPOLLOUT brings the
  // rest).
  void send(std::size_t k, const Bytes& b) {
    MuxClient& c = clients_[k];
    c.out.insert(c.out.end(), b.begin(), b.end());
    flush(k);
  }

  void flush(std::size_t k) {
    MuxClient& c = clients_[k];
    while (c.out_off < c.out.size()) {
      ssize_t w = ::send(c.fd, c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
      if (w > 0) c.out_off += static_cast<std::size_t>(w);
      else if (w < 0 && errno == EINTR) continue;
      else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
      else fail(c, std::string("send: ") + std::strerror(errno));
    }
    c.out.clear();
    c.out_off = 0;
  }

  void on_event(std::uint32_t k, std::uint32_t events) {
    MuxClient& c = clients_[k];
    if (c.step == MuxClient::Step::kConnecting) {
      if (events & (EPOLLERR | EPOLLHUP)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(c.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        fail(c, "cannot connect to " + o_.host + ":" + std::to_string(o_.port) + ": " +
                    std::strerror(err != 0 ? err : ECONNRESET));
      }
      if (!(events & EPOLLOUT)) return;
      on_connected(k);
      // A reply may have come with the same edge.
    }
    if (events & EPOLLOUT) flush(k);
    if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) on_readable(k);
  }

  void on_readable(std::size_t k) {
    MuxClient& c = clients_[k];
    for (;;) {
      if (c.step == MuxClient::Step::kDone) {
        std::uint8_t extra;
        ssize_t r = ::recv(c.fd, &extra, 1, MSG_DONTWAIT);
        if (r > 0) fail(c, "the server sent bytes after the WAIT's reply");
        return;  // EOF after the end is the server's business
      }
      ssize_t r = ::recv(c.fd, c.in + c.in_len, c.need - c.in_len, 0);
      if (r == 0) fail(c, "the server closed the connection");
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        fail(c, std::string("recv: ") + std::strerror(errno));
      }
      c.in_len += static_cast<std::size_t>(r);
      if (c.in_len < c.need) continue;
      on_reply(k);
      return;  // nothing follows a reply before the next request
    }
  }

  void on_reply(std::size_t k) {
    MuxClient& c = clients_[k];
    switch (c.step) {
      case MuxClient::Step::kPing:
        if (tp::load_u32(c.in) != c.nonce) fail(c, "PING answered with a wrong nonce");
        send_set_add(k);
        break;
      case MuxClient::Step::kAdd: {
        const auto arrived = static_cast<std::int64_t>(tp::load_u64(c.in));
        if (arrived < 1 || arrived > o_.clients)
          fail(c, "ADD answered " + std::to_string(arrived) + " (1.." + std::to_string(o_.clients) + " expected)");
        if (arrived == o_.clients)
          send(k, tp::encode_request(o_.protocol, tp::Request{tp::Op::kSet, {base_ + "done"}, {Bytes{'1'}}, 0, 0}));
        expect(c, MuxClient::Step::kWait, 1);
        send(k, tp::encode_request(o_.protocol, tp::Request{tp::Op::kWait, {base_ + "done"}, {}, 0, 0}));
        break;
      }
      case MuxClient::Step::kWait:
        if (c.in[0] != static_cast<std::uint8_t>(tp::WaitReply::kStopWaiting))
          fail(c, "WAIT answered " + std::to_string(c.in[0]) + ", not STOP_WAITING");
        c.done = Clock::now();
        c.step = MuxClient::Step::kDone;
        ++finished_;
        break;
      default:
        break;
    }
  }

  const Options& o_;
  const Address& addr_;
  const std::string base_;
  const std::atomic<bool>& abort_;
  std::vector<MuxClient> clients_;
  std::size_t finished_ = 0;
  int ep_ = -1;
};

Outcome rendezvous_once_epoll(const Options& o, const Address& addr, int repeat) {
  const std::string base = o.prefix + "/" + std::to_string(repeat) + "/";
  const int k = std::min(o.epoll_threads, o.clients);
  std::atomic<bool> abort{false};
  std::vector<std::unique_ptr<MuxDriver>> drivers;
  for (int t = 0; t < k; ++t)
    drivers.push_back(std::make_unique<MuxDriver>(o, addr, base, o.clients * t / k, o.clients * (t + 1) / k, abort));
  Gate gate;
  FirstError first_error;
  std::vector<std::thread> threads;
  for (int t = 0; t < k; ++t) {
    threads.emplace_back([&, t] {
      gate.park();
      try {
        drivers[static_cast<std::size_t>(t)]->run();
      } catch (const std::exception& e) {
        abort.store(true);
        first_error.note(e.what());
      }
    });
  }
  const Clock::time_point t0 = gate.open_when_parked(k, std::chrono::seconds(o.timeout_s));
  for (auto& t : threads) t.join();
  first_error.rethrow();
  Clock::time_point last_connect = t0, last_done = t0;
  for (const auto& d : drivers)
    for (const auto& c : d->clients()) {
      last_connect = std::max(last_connect, c.connected);
      last_done = std::max(last_done, c.done);
    }
  return outcome_since(t0, last_connect, last_done);  // the drivers close their connections after
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  raise_fd_limit(o.clients);
  try {
    nlohmann::json times = nlohmann::json::array(), connects = nlohmann::json::array();
    const Address addr = o.epoll_driver ? resolve(o) : Address{};
    for (int r = 0; r < o.repeats; ++r) {
      Outcome out = o.epoll_driver ? rendezvous_once_epoll(o, addr, r) : rendezvous_once(o, r);
      times.push_back(out.total_s);
      connects.push_back(out.connect_s);
    }
    nlohmann::json j = {{"clients", o.clients},
                        {"protocol", std::string(store_protocol_name(o.protocol))},
                        {"driver", o.epoll_driver ? "epoll" : "threads"},
                        {"times_s", times},
                        {"connect_s", connects}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddpdiag_rendezvous_bench: %s\n", e.what());
    return 1;
  }
}
