// Rendezvous time of N local clients against a running store server, with
// our C++ client (c10d wire protocol) on one thread and one connection per
// client, so that the same client side can be pointed at `ddpdiag store
// serve` and at torch's TCPStore server and the two servers compared.
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
//   {"clients":N,"protocol":"torch-1.13","times_s":[...],"connect_s":[...]}
// where connect_s is, per repeat, when the last client had connected.
//
// Usage: ddpdiag_rendezvous_bench --port P [--host 127.0.0.1] [--clients 1024]
//          [--repeats 3] [--protocol 1.13|2.x] [--prefix KEY] [--timeout 120]
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

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
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ddpdiag_rendezvous_bench: %s\n"
               "usage: ddpdiag_rendezvous_bench --port P [--host H] [--clients N] [--repeats R] "
               "[--protocol 1.13|2.x] [--prefix KEY] [--timeout S]\n",
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
    else if (flag == "--protocol") {
      if (v == "1.13") o.protocol = StoreProtocol::kV1;
      else if (v == "2.x") o.protocol = StoreProtocol::kV2;
      else usage("--protocol is 1.13 or 2.x");
    } else {
      usage("unknown flag " + flag);
    }
  }
  if (o.port <= 0 || o.port > 65535) usage("--port is required");
  if (o.clients < 1 || o.repeats < 1 || o.timeout_s < 1)
    usage("--clients, --repeats and --timeout are at least 1");
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

Outcome rendezvous_once(const Options& o, int repeat) {
  const std::string base = o.prefix + "/" + std::to_string(repeat) + "/";
  const Millis timeout{std::chrono::seconds(o.timeout_s)};
  std::vector<std::unique_ptr<TcpStoreClient>> held(o.clients);
  std::vector<Clock::time_point> connected(o.clients), done(o.clients);
  std::mutex err_mu;
  std::string first_error;
  std::vector<std::thread> threads;
  threads.reserve(o.clients);
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  bool open = false;

  auto release = [&] {
    Clock::time_point at;
    {
      std::lock_guard<std::mutex> lk(gate_mu);
      open = true;
      at = Clock::now();
    }
    gate_cv.notify_all();
    return at;
  };
  auto client = [&](int i) {
    {
      std::unique_lock<std::mutex> lk(gate_mu);
      gate_cv.wait(lk, [&] { return open; });
    }
    try {
      TcpStoreClientOptions co;
      co.host = o.host;
      co.port = o.port;
      co.protocol = o.protocol;
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
      std::lock_guard<std::mutex> lk(err_mu);
      if (first_error.empty()) first_error = "client " + std::to_string(i) + ": " + e.what();
    }
  };
  for (int i = 0; i < o.clients; ++i) {
    try {
      threads.emplace_back(client, i);
    } catch (const std::system_error& e) {  // out of threads: let the others go, then fail
      release();
      for (auto& t : threads) t.join();
      throw std::runtime_error("could not start client thread " + std::to_string(i) + " of " +
                               std::to_string(o.clients) + ": " + e.what() +
                               " (raise ulimit -u or use fewer --clients)");
    }
  }
  const Clock::time_point t0 = release();
  for (auto& t : threads) t.join();
  if (!first_error.empty()) throw std::runtime_error(first_error);
  Outcome out;
  out.total_s = std::chrono::duration<double>(*std::max_element(done.begin(), done.end()) - t0).count();
  out.connect_s =
      std::chrono::duration<double>(*std::max_element(connected.begin(), connected.end()) - t0).count();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o = parse(argc, argv);
  raise_fd_limit(o.clients);
  try {
    nlohmann::json times = nlohmann::json::array(), connects = nlohmann::json::array();
    for (int r = 0; r < o.repeats; ++r) {
      Outcome out = rendezvous_once(o, r);
      times.push_back(out.total_s);
      connects.push_back(out.connect_s);
    }
    nlohmann::json j = {{"clients", o.clients},
                        {"protocol", std::string(store_protocol_name(o.protocol))},
                        {"times_s", times},
                        {"connect_s", connects}};
    std::printf("%s\n", j.dump().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddpdiag_rendezvous_bench: %s\n", e.what());
    return 1;
  }
}
