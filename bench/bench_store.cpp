// Store throughput: set/get/add/wait against our epoll server over loopback,
// with 1, 64 and 1024 concurrent clients (one thread and one connection per
// client, as ranks of a job would have). Reported as items_per_second = store
// ops per second summed over all clients. SET has no reply in the c10d
// protocol, so set figures measure what the server and the socket buffers
// absorb. store_get is how ddpdiag's ranks read from ddpdiag's own server
// (one_trip_get: one GET round trip on the 2.x protocol, WAIT + GET on 1.13);
// store_get_c10d is WAIT + GET (two round trips), as c10d's client does it
// and as ddpdiag does against a server of unknown make.
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

template <Kind kind>
void BM_store(benchmark::State& state) {
  TcpStoreClient client(options(state, kind == Kind::kGet));
  const std::string key = "bench/" + std::to_string(state.thread_index());
  const Bytes value(64, 0x5a);
  client.set(key, value);
  client.num_keys();  // the key is there before timing starts
  for (auto _ : state) {
    switch (kind) {
      case Kind::kSet: client.set(key, value); break;
      case Kind::kGet:
      case Kind::kGetC10d: benchmark::DoNotOptimize(client.get(key, Millis(10000))); break;
      case Kind::kAdd: benchmark::DoNotOptimize(client.add("bench/counter", 1)); break;
      case Kind::kWait: client.wait({key}, Millis(10000)); break;
    }
  }
  if (kind == Kind::kSet) client.num_keys();  // drain: every SET was served
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
