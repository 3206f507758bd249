// Store throughput: set/get/add/wait against our epoll server over loopback,
// with 1, 64 and 1024 concurrent clients (one thread and one connection per
// client, as ranks of a job would have). Reported as items_per_second = store
// ops per second summed over all clients. SET has no reply in the c10d
// protocol: a SET is done when it is sent, though the server may not have
// read it yet. So that store_set is the rate the server sustains, not what
// the socket buffers absorb, each client makes a round trip (NUM_KEYS, which
// the server answers after every SET before it) every kSetsPerDrain SETs and
// after its last one, inside the timed loop (the round trips are not counted
// as ops), and its timing ends only when every client's last SET is served
// (Google Benchmark divides the ops by the clients' mean time, and a client
// done early would otherwise count the time the others still took as its
// own idle time: runs of 0.01 s came out about twice those of 1 s). store_get is how ddpdiag's ranks read from ddpdiag's own server
// (one_trip_get: one GET round trip on the 2.x protocol, WAIT + GET on 1.13);
// store_get_c10d is WAIT + GET (two round trips), as c10d's client does it
// and as ddpdiag does against a server of unknown make.
#include <condition_variable>
#include <mutex>
#include <string>

#include <benchmark/benchmark.h>

#include "comm/store/tcp_store.h"

namespace {

using namespace ddpdiag;

TcpStoreServer& server() {
  static TcpStoreServer s(TcpStoreServerOptions{});
  return s;
}

TcpStoreClientOptions options(const benchmark::State& state, bool one_trip_get) {
  TcpStoreClientOptions o;
  o.one_trip_get = one_trip_get;
  o.host = "127.0.0.1";
  o.port = server().port();
  o.protocol = static_cast<StoreProtocol>(state.range(0));
  o.connect_timeout = Millis(60000);
  o.io_timeout = Millis(60000);
  return o;
}

enum class Kind { kSet, kGet, kGetC10d, kAdd, kWait };

// At most this many SETs of a client are in flight (sent, maybe unread by
// the server): about 25 KB, well under a loopback socket's buffers, and one
// round trip per 256 SETs costs the figure well under 1 %.
constexpr benchmark::IterationCount kSetsPerDrain = 256;

// Every client of a run waits here until all have arrived (the run's
// client count differs between runs, so std::barrier, fixed at
// construction, does not fit).
class Gate {
 public:
  void arrive_and_wait(int clients) {
    std::unique_lock lock(mu_);
    const long generation = generation_;
    if (++arrived_ == clients) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  long generation_ = 0;
};

template <Kind kind>
void BM_store(benchmark::State& state) {
  TcpStoreClient client(options(state, kind == Kind::kGet));
  const std::string key = "bench/" + std::to_string(state.thread_index());
  const Bytes value(64, 0x5a);
  client.set(key, value);
  client.num_keys();  // the key is there before timing starts
  benchmark::IterationCount sets = 0;
  for (auto _ : state) {
    switch (kind) {
      case Kind::kSet:
        client.set(key, value);
        // Drained inside the timing: the last SETs are counted once served,
        // and by every client only once all clients' are.
        if (++sets % kSetsPerDrain == 0 || sets == state.max_iterations) client.num_keys();
        if (sets == state.max_iterations) {
          static Gate all_served;
          all_served.arrive_and_wait(state.threads());
        }
        break;
      case Kind::kGet:
      case Kind::kGetC10d: benchmark::DoNotOptimize(client.get(key, Millis(10000))); break;
      case Kind::kAdd: benchmark::DoNotOptimize(client.add("bench/counter", 1)); break;
      case Kind::kWait: client.wait({key}, Millis(10000)); break;
    }
  }
  state.SetItemsProcessed(state.iterations());
  state.SetLabel(std::string(store_protocol_name(client.protocol())));
}

void clients(benchmark::internal::Benchmark* b) {
  // Every protocol with every client count (Google Benchmark crosses them).
  b->ArgName("protocol")->Arg(static_cast<int>(StoreProtocol::kV2))->Arg(static_cast<int>(StoreProtocol::kV1));
  b->Threads(1)->Threads(64)->Threads(1024)->UseRealTime();
}

BENCHMARK_TEMPLATE(BM_store, Kind::kSet)->Name("store_set")->Apply(clients);
BENCHMARK_TEMPLATE(BM_store, Kind::kGet)->Name("store_get")->Apply(clients);
BENCHMARK_TEMPLATE(BM_store, Kind::kGetC10d)->Name("store_get_c10d")->Apply(clients);
BENCHMARK_TEMPLATE(BM_store, Kind::kAdd)->Name("store_add")->Apply(clients);
BENCHMARK_TEMPLATE(BM_store, Kind::kWait)->Name("store_wait")->Apply(clients);

}  // namespace

BENCHMARK_MAIN();
