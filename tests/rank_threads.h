// Ranks as threads over one MemoryStore with the Gloo backend, for the
// ddp_core tests. Catch2 assertions are not thread-safe, so each rank
// collects failure messages and the test thread checks them.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/store/store.h"

namespace ddpdiag::testing {

using Failures = std::vector<std::string>;
using RankBody = std::function<void(Communicator&, int rank, Failures&)>;

// The options of rank `rank` of n on the Gloo backend over loopback.
inline CommOptions gloo_rank_options(int rank, int n, std::shared_ptr<Store> store,
                                     Millis timeout) {
  CommOptions o;
  o.backend = Backend::kGloo;
  o.rank = rank;
  o.world_size = n;
  o.local_rank = rank;
  o.store = std::move(store);
  o.timeout = timeout;
  o.gloo_hostname = "127.0.0.1";
  return o;
}

// Runs body on n ranks (threads) and returns every failure of every rank.
// bind: changes a rank's options before it connects (default: loopback).
inline Failures run_gloo_ranks(int n, const RankBody& body,
                               Millis timeout = std::chrono::seconds(20),
                               const std::function<void(CommOptions&)>& bind = {}) {
  auto store = std::make_shared<MemoryStore>();
  std::vector<Failures> per_rank(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Failures& f = per_rank[static_cast<std::size_t>(r)];
      try {
        CommOptions o = gloo_rank_options(r, n, store, timeout);
        if (bind) bind(o);
        auto comm = make_communicator(o);
        body(*comm, r, f);
      } catch (const std::exception& e) {
        f.push_back("rank " + std::to_string(r) + " threw: " + e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  Failures all;
  for (auto& f : per_rank) all.insert(all.end(), f.begin(), f.end());
  return all;
}

inline std::string describe(const Failures& f) {
  std::string s;
  for (std::size_t i = 0; i < f.size() && i < 10; ++i) s += f[i] + "\n";
  if (f.size() > 10) s += "... and " + std::to_string(f.size() - 10) + " more\n";
  return s;
}

}  // namespace ddpdiag::testing
