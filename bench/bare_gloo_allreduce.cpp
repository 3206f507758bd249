// A bare Gloo all_reduce loop, one process per rank: the baseline that
// bench/compare_peers.sh sets ddpdiag and torch.distributed against. No
// ddpdiag communicator, no worker thread: gloo::allreduce (Gloo's default
// algorithm, as torch's ProcessGroupGloo calls it) on a float32 buffer,
// sum, in place, called back to back from the main thread.
//
// Each size is timed as `ddpdiag allreduce-test` times it: warm-up calls,
// a barrier, then `iters` calls between two clock reads; a rank's time per
// op is that span / iters, and the reported time is the mean over ranks
// (with the fastest and slowest rank's time).
//
// Rendezvous goes through our TCP store (c10d wire protocol): rank 0 hosts
// it on --master-port, as torch's env:// rendezvous does. Rank 0 prints one
// JSON object on stdout:
//   {"impl":"bare_gloo","world_size":N,"dtype":"float","op":"sum",
//    "sizes":[{"bytes":B,"count":C,"time_us":T,"min_rank_time_us":..,
//              "max_rank_time_us":..,"iters":I,"warmup_iters":W},...]}
//
// Usage: ddpdiag_bare_gloo_allreduce [--rank R] [--world-size N]
//          [--master-addr A] [--master-port P] [--sizes 4,1024,...]
//          [--iters 20[,...]] [--warmup-iters 5[,...]] [--timeout 120]
// RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (as torchrun sets them) are
// read when the flags are absent.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <nlohmann/json.hpp>

#include "comm/store/tcp_store.h"

namespace {

using namespace ddpdiag;
using Clock = std::chrono::steady_clock;

struct Options {
  int rank = -1;
  int world_size = -1;
  std::string master_addr = "127.0.0.1";
  int master_port = -1;
  std::vector<std::size_t> sizes;
  std::vector<int> iters{20};   // one value, or one per size
  std::vector<int> warmup{5};
  int timeout_s = 120;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "ddpdiag_bare_gloo_allreduce: %s\n"
               "usage: ddpdiag_bare_gloo_allreduce [--rank R] [--world-size N] "
               "[--master-addr A] [--master-port P] [--sizes B1,B2,...] [--iters I] "
               "[--warmup-iters W] [--timeout S]\n",
               why.c_str());
  std::exit(2);
}

long parse_long(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long x = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno != 0) usage(flag + ": '" + v + "' is not an integer");
  return x;
}

std::vector<long> parse_list(const std::string& flag, const std::string& v) {
  std::vector<long> out;
  std::size_t pos = 0;
  while (pos <= v.size()) {
    std::size_t comma = v.find(',', pos);
    out.push_back(parse_long(flag, v.substr(pos, comma == std::string::npos ? std::string::npos
                                                                            : comma - pos)));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::vector<std::size_t> parse_sizes(const std::string& v) {
  std::vector<std::size_t> out;
  for (long b : parse_list("--sizes", v)) {
    if (b < 4 || b % 4 != 0) usage("--sizes: " + std::to_string(b) + " is not a positive multiple of 4 bytes");
    out.push_back(static_cast<std::size_t>(b));
  }
  return out;
}

// One value for every size, or one per size.
std::vector<int> per_size(const std::string& flag, std::vector<int> v, std::size_t n, int min) {
  if (v.size() == 1) v.assign(n, v[0]);
  if (v.size() != n)
    usage(flag + ": " + std::to_string(v.size()) + " values for " + std::to_string(n) + " sizes");
  for (int x : v)
    if (x < min) usage(flag + " must be at least " + std::to_string(min));
  return v;
}

std::vector<int> ints(const std::string& flag, const std::string& v) {
  std::vector<int> out;
  for (long x : parse_list(flag, v)) out.push_back(static_cast<int>(x));
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  if (const char* e = std::getenv("RANK")) o.rank = static_cast<int>(parse_long("RANK", e));
  if (const char* e = std::getenv("WORLD_SIZE"))
    o.world_size = static_cast<int>(parse_long("WORLD_SIZE", e));
  if (const char* e = std::getenv("MASTER_ADDR")) o.master_addr = e;
  if (const char* e = std::getenv("MASTER_PORT"))
    o.master_port = static_cast<int>(parse_long("MASTER_PORT", e));
  for (int i = 1; i < argc; ++i) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") usage("a bare gloo::allreduce loop");
    if (i + 1 >= argc) usage(flag + " needs a value");
    std::string v = argv[++i];
    if (flag == "--rank") o.rank = static_cast<int>(parse_long(flag, v));
    else if (flag == "--world-size") o.world_size = static_cast<int>(parse_long(flag, v));
    else if (flag == "--master-addr") o.master_addr = v;
    else if (flag == "--master-port") o.master_port = static_cast<int>(parse_long(flag, v));
    else if (flag == "--sizes") o.sizes = parse_sizes(v);
    else if (flag == "--iters") o.iters = ints(flag, v);
    else if (flag == "--warmup-iters") o.warmup = ints(flag, v);
    else if (flag == "--timeout") o.timeout_s = static_cast<int>(parse_long(flag, v));
    else usage("unknown flag " + flag);
  }
  if (o.world_size < 1) usage("no world size (--world-size or WORLD_SIZE)");
  if (o.rank < 0 || o.rank >= o.world_size)
    usage("rank " + std::to_string(o.rank) + " is not in [0, " + std::to_string(o.world_size) +
          ") (--rank or RANK)");
  if (o.master_port <= 0 || o.master_port > 65535) usage("no store port (--master-port or MASTER_PORT)");
  if (o.timeout_s < 1) usage("--timeout must be at least 1");
  if (o.sizes.empty())
    for (std::size_t b = 4; b <= (64u << 20); b *= 4) o.sizes.push_back(b);
  o.iters = per_size("--iters", o.iters, o.sizes.size(), 1);
  o.warmup = per_size("--warmup-iters", o.warmup, o.sizes.size(), 0);
  return o;
}

// Gloo's rendezvous store interface over ours.
class GlooStore final : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<ddpdiag::Store> s, Millis timeout) : s_(std::move(s)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    s_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto b = s_->get(key, timeout_);
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { s_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    s_->wait(keys, t);
  }

 private:
  std::shared_ptr<ddpdiag::Store> s_;
  Millis timeout_;
};

// This rank's time per op for one size, in microseconds.
double time_size(const std::shared_ptr<gloo::Context>& ctx, float* buf, std::size_t count,
                 int iters, int warmup) {
  auto one = [&] {
    gloo::AllreduceOptions ao(ctx);
    ao.setOutput(buf, count);
    ao.setReduceFunction(
        static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    gloo::allreduce(ao);
  };
  for (int i = 0; i < warmup; ++i) one();
  gloo::BarrierOptions bo(ctx);
  gloo::barrier(bo);
  auto t0 = Clock::now();
  for (int i = 0; i < iters; ++i) one();
  auto t1 = Clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
}

int run(const Options& o) {
  const Millis timeout{std::chrono::seconds(o.timeout_s)};
  std::optional<TcpStoreServer> server;
  if (o.rank == 0) {
    TcpStoreServerOptions so;
    so.host = o.master_addr;
    so.port = o.master_port;
    server.emplace(so);
  }
  TcpStoreClientOptions co;
  co.host = o.master_addr;
  co.port = o.master_port;
  co.rank = o.rank;
  co.connect_timeout = timeout;
  co.io_timeout = timeout;
  auto store = std::make_shared<PrefixStore>("bare_gloo", std::make_shared<TcpStoreClient>(co));

  gloo::transport::tcp::attr attr;
  attr.hostname = o.master_addr;
  auto dev = gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
  GlooStore gs(store, timeout);
  ctx->connectFullMesh(gs, dev);
  ctx->setTimeout(timeout);

  const std::size_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  std::vector<float> buf(max_bytes / sizeof(float));
  // Small integers, as allreduce-test starts from: no NaNs or denormals.
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>((i + o.rank) % 3);

  std::vector<double> mine;
  for (std::size_t s = 0; s < o.sizes.size(); ++s)
    mine.push_back(time_size(ctx, buf.data(), o.sizes[s] / sizeof(float), o.iters[s], o.warmup[s]));

  std::vector<double> all(mine.size() * o.world_size);
  gloo::AllgatherOptions go(ctx);
  go.setInput(mine.data(), mine.size());
  go.setOutput(all.data(), all.size());
  gloo::allgather(go);

  if (o.rank == 0) {
    nlohmann::json sizes = nlohmann::json::array();
    for (std::size_t s = 0; s < o.sizes.size(); ++s) {
      double sum = 0, lo = 1e300, hi = 0;
      for (int r = 0; r < o.world_size; ++r) {
        double t = all[r * mine.size() + s];
        sum += t;
        lo = std::min(lo, t);
        hi = std::max(hi, t);
      }
      sizes.push_back({{"bytes", o.sizes[s]},
                       {"count", o.sizes[s] / sizeof(float)},
                       {"time_us", sum / o.world_size},
                       {"min_rank_time_us", lo},
                       {"max_rank_time_us", hi},
                       {"iters", o.iters[s]},
                       {"warmup_iters", o.warmup[s]}});
    }
    nlohmann::json out = {{"impl", "bare_gloo"}, {"world_size", o.world_size},
                          {"dtype", "float"},    {"op", "sum"},
                          {"sizes", sizes}};
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
  }
  // Nobody leaves (and rank 0 does not stop the store) before all are done.
  gloo::BarrierOptions bo(ctx);
  gloo::barrier(bo);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);  // a dead peer is an error, not a silent kill
  Options o = parse(argc, argv);
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddpdiag_bare_gloo_allreduce: rank %d: %s\n", o.rank, e.what());
    return 1;
  }
}
