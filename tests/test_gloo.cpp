// The Gloo backend with ranks as threads over one MemoryStore.
//
// Catch2 assertions are not thread-safe, so rank threads collect failure
// messages and the test thread checks them. Values are small integers (and
// {1, 2} for prod) so every reduction is exact in any order and results are
// compared bit for bit.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <gloo/transport/tcp/address.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/gloo/gloo_communicator.h"
#include "comm/store/store.h"
#include "comm/types.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using namespace ddpdiag::testing;
using namespace std::chrono_literals;

namespace {

double input_value(DType t, ReduceOp op, int rank, std::size_t i) {
  if (op == ReduceOp::kProd) return 1.0 + static_cast<double>((i + static_cast<std::size_t>(rank)) % 2);
  const double v = static_cast<double>((i * 7 + static_cast<std::size_t>(rank) * 3) % 11);
  return t == DType::kUInt8 ? v : v - 5.0;
}

std::vector<std::uint8_t> fill(DType t, ReduceOp op, int rank, std::size_t count) {
  std::vector<std::uint8_t> b(count * dtype_size(t));
  for (std::size_t i = 0; i < count; ++i) store_from_double(t, b.data(), i, input_value(t, op, rank, i));
  return b;
}

// The reduction over ranks computed in double (exact for our values), stored
// in the dtype and, for avg, divided by the same routine the backend uses.
std::vector<std::uint8_t> expected_reduction(DType t, ReduceOp op, int n, std::size_t count,
                                             std::size_t offset = 0) {
  std::vector<std::uint8_t> b(count * dtype_size(t));
  for (std::size_t i = 0; i < count; ++i) {
    double acc = input_value(t, op, 0, offset + i);
    for (int r = 1; r < n; ++r) {
      const double v = input_value(t, op, r, offset + i);
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: acc += v; break;
        case ReduceOp::kProd: acc *= v; break;
        case ReduceOp::kMin: acc = std::min(acc, v); break;
        case ReduceOp::kMax: acc = std::max(acc, v); break;
      }
    }
    store_from_double(t, b.data(), i, acc);
  }
  if (op == ReduceOp::kAvg) divide_host(t, b.data(), count, n);
  return b;
}

void compare(const std::vector<std::uint8_t>& got, const std::vector<std::uint8_t>& want, DType t,
             const std::string& what, int rank, Failures& f) {
  if (got == want) return;
  const std::size_t es = dtype_size(t);
  for (std::size_t i = 0; i * es < want.size(); ++i) {
    if (std::memcmp(got.data() + i * es, want.data() + i * es, es) != 0) {
      f.push_back("rank " + std::to_string(rank) + " " + what + ": element " + std::to_string(i) +
                  " is " + std::to_string(load_as_double(t, got.data(), i)) + ", expected " +
                  std::to_string(load_as_double(t, want.data(), i)));
      return;
    }
  }
}

std::string label(const char* op, DType t, ReduceOp r, bool in_place) {
  return std::string(op) + " " + std::string(dtype_name(t)) + " " + std::string(reduce_op_name(r)) +
         (in_place ? " in-place" : " out-of-place");
}

}  // namespace

TEST_CASE("gloo: world size 1 and communicator facts", "[gloo]") {
  const Failures f = run_gloo_ranks(1, [](Communicator& c, int rank, Failures& fail) {
    if (c.backend() != Backend::kGloo || c.memory_kind() != MemoryKind::kHost)
      fail.push_back("wrong backend or memory kind");
    if (c.library_version().rfind("gloo ", 0) != 0) fail.push_back("version " + c.library_version());
    if (c.device_name().rfind("cpu (", 0) != 0) fail.push_back("device " + c.device_name());
    CommBuffer buf(c, 3 * sizeof(float));
    if (reinterpret_cast<std::uintptr_t>(buf.get()) % 64 != 0) fail.push_back("alloc not 64-byte aligned");
    float v[3] = {1, 2, 3};
    c.copy_from_host(buf.get(), v, sizeof(v));
    c.allreduce(buf.get(), buf.get(), 3, DType::kFloat32, ReduceOp::kAvg)->wait(5s);
    float out[3] = {};
    c.copy_to_host(out, buf.get(), sizeof(out));
    if (out[0] != 1 || out[1] != 2 || out[2] != 3) fail.push_back("allreduce on one rank changed data");
    std::vector<float> rs(3);
    c.reduce_scatter(v, rs.data(), 3, DType::kFloat32, ReduceOp::kSum)->wait(5s);
    if (rs[2] != 3) fail.push_back("reduce_scatter on one rank");
    c.barrier()->wait(5s);
    (void)rank;
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: allreduce, every dtype x op, in-place and out-of-place", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const std::size_t count = 67;  // not a multiple of the world size or segment counts
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (DType t : kAllDTypes) {
      for (ReduceOp op : kAllReduceOps) {
        const auto want = expected_reduction(t, op, n, count);
        // Out of place: send is untouched.
        auto send = fill(t, op, rank, count);
        const auto send0 = send;
        std::vector<std::uint8_t> recv(send.size());
        c.allreduce(send.data(), recv.data(), count, t, op)->wait(10s);
        compare(recv, want, t, label("allreduce", t, op, false), rank, fail);
        if (send != send0) fail.push_back(label("allreduce", t, op, false) + ": send modified");
        // In place.
        auto buf = fill(t, op, rank, count);
        c.allreduce(buf.data(), buf.data(), count, t, op)->wait(10s);
        compare(buf, want, t, label("allreduce", t, op, true), rank, fail);
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: large allreduce spans several segments; back-to-back ops", "[gloo]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  // 2^19 floats = 2 MiB: more than Gloo's 1 MiB segment, so the ring pipelines.
  const std::size_t count = std::size_t{1} << 19;
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    auto buf = fill(DType::kFloat32, ReduceOp::kSum, rank, count);
    c.allreduce(buf.data(), buf.data(), count, DType::kFloat32, ReduceOp::kSum)->wait(20s);
    compare(buf, expected_reduction(DType::kFloat32, ReduceOp::kSum, n, count), DType::kFloat32,
            "large allreduce", rank, fail);
    // Several ops issued before any wait run in issue order on the worker.
    std::vector<std::vector<std::uint8_t>> bufs;
    std::vector<std::shared_ptr<Work>> works;
    // 40 > the initial 16 queue slots, so the queue grows while it wraps.
    for (int k = 0; k < 40; ++k) bufs.push_back(fill(DType::kInt32, ReduceOp::kSum, rank, 33));
    for (auto& b : bufs) works.push_back(c.allreduce(b.data(), b.data(), 33, DType::kInt32, ReduceOp::kSum));
    for (auto& w : works) w->wait(10s);
    for (auto& b : bufs)
      compare(b, expected_reduction(DType::kInt32, ReduceOp::kSum, n, 33), DType::kInt32,
              "queued allreduce", rank, fail);
    if (!works.back()->is_completed()) fail.push_back("is_completed false after wait");
  });
  INFO(describe(f));
  CHECK(f.empty());
}

// Ops start in issue order; with more than one worker thread a collective
// whose buffers overlap no running op's runs beside it. Chains on one buffer
// must see each other's results, whatever the number of threads.
TEST_CASE("gloo: worker threads: ops on shared buffers stay ordered, all results exact", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  const int threads = GENERATE(1, 2, 3);
  CAPTURE(n, threads);
  const auto with_threads = [&](CommOptions& o) { o.gloo_threads = threads; };
  const Failures f = run_gloo_ranks(
      n,
      [&](Communicator& c, int rank, Failures& fail) {
        const std::size_t count = 65539;  // 256 KiB of int32: still running when the next is issued
        const auto sum_of = [&](DType t, ReduceOp op, std::size_t k) {
          return expected_reduction(t, op, n, k);
        };
        for (int round = 0; round < 3; ++round) {
          // x: allreduce twice in place; the second must reduce the first's
          // result, so every element ends as n * (sum over ranks).
          auto x = fill(DType::kInt32, ReduceOp::kSum, rank, count);
          // y -> z out of place, then z in place: z = n * sum.
          auto y = fill(DType::kInt64, ReduceOp::kSum, rank, count);
          std::vector<std::uint8_t> z(y.size());
          // b: broadcast from the last rank, then an allreduce of its second
          // half, which overlaps it.
          auto b = fill(DType::kFloat32, ReduceOp::kSum, rank, count);
          // Independent ops between them, on their own buffers.
          std::vector<std::vector<std::uint8_t>> small;
          std::vector<std::shared_ptr<Work>> w;
          const std::size_t half = count / 2;
          auto* b2 = b.data() + half * 4;
          for (int k = 0; k < 8; ++k) small.push_back(fill(DType::kFloat64, ReduceOp::kMax, rank, 17 + k));
          // Round 0: each dependent pair back to back (the second is issued
          // while the first runs); later rounds: independent ops between.
          const int spacing = round == 0 ? 0 : 2;
          int next_small = 0;
          const auto independents = [&](int k) {
            for (int i = 0; i < k && next_small < 8; ++i, ++next_small)
              w.push_back(c.allreduce(small[next_small].data(), small[next_small].data(),
                                      17 + next_small, DType::kFloat64, ReduceOp::kMax));
          };
          w.push_back(c.allreduce(x.data(), x.data(), count, DType::kInt32, ReduceOp::kSum));
          independents(spacing);
          w.push_back(c.allreduce(x.data(), x.data(), count, DType::kInt32, ReduceOp::kSum));
          w.push_back(c.allreduce(y.data(), z.data(), count, DType::kInt64, ReduceOp::kSum));
          independents(spacing);
          w.push_back(c.allreduce(z.data(), z.data(), count, DType::kInt64, ReduceOp::kSum));
          w.push_back(c.broadcast(b.data(), count, DType::kFloat32, n - 1));
          independents(spacing);
          w.push_back(c.allreduce(b2, b2, count - half, DType::kFloat32, ReduceOp::kSum));
          independents(8);
          // Wait in reverse: completion of a later op says nothing of an
          // earlier one on other buffers, but every Work completes.
          for (auto it = w.rbegin(); it != w.rend(); ++it) (*it)->wait(20s);
          auto times_n = [&](DType t, std::vector<std::uint8_t> v, std::size_t k) {
            for (std::size_t i = 0; i < k; ++i)
              store_from_double(t, v.data(), i, load_as_double(t, v.data(), i) * n);
            return v;
          };
          const std::string r = " (round " + std::to_string(round) + ")";
          compare(x, times_n(DType::kInt32, sum_of(DType::kInt32, ReduceOp::kSum, count), count),
                  DType::kInt32, "allreduce twice in place" + r, rank, fail);
          compare(z, times_n(DType::kInt64, sum_of(DType::kInt64, ReduceOp::kSum, count), count),
                  DType::kInt64, "out of place, then in place on the output" + r, rank, fail);
          auto want_b = fill(DType::kFloat32, ReduceOp::kSum, n - 1, count);
          for (std::size_t i = half; i < count; ++i)
            store_from_double(DType::kFloat32, want_b.data(), i,
                              load_as_double(DType::kFloat32, want_b.data(), i) * n);
          compare(b, want_b, DType::kFloat32, "broadcast, then allreduce of its second half" + r,
                  rank, fail);
          for (int k = 0; k < 8; ++k)
            compare(small[k], sum_of(DType::kFloat64, ReduceOp::kMax, 17 + k), DType::kFloat64,
                    "independent max allreduce " + std::to_string(k) + r, rank, fail);
        }
      },
      20s, with_threads);
  INFO(describe(f));
  CHECK(f.empty());
}

// A large op and a small one on another buffer: with two threads the small
// one does not wait behind the large one; with one it must. A barrier
// completes after everything issued before it either way.
TEST_CASE("gloo: worker threads: a small op on its own buffer overtakes a large one", "[gloo]") {
  const int threads = GENERATE(1, 2);
  CAPTURE(threads);
  const auto with_threads = [&](CommOptions& o) { o.gloo_threads = threads; };
  std::atomic<int> overtaken{0};
  const Failures f = run_gloo_ranks(
      2,
      [&](Communicator& c, int rank, Failures& fail) {
        const std::size_t big_count = std::size_t{16} << 20;  // 64 MiB of float32
        std::vector<float> big(big_count, static_cast<float>(rank + 1));
        float small = static_cast<float>(rank + 1);
        // 3 tries: a scheduling hiccup on a loaded machine may let the large
        // op finish first once; three times in a row means no overlap.
        for (int attempt = 0; attempt < 3; ++attempt) {
          c.barrier()->wait(20s);
          auto large = c.allreduce(big.data(), big.data(), big_count, DType::kFloat32, ReduceOp::kSum);
          auto quick = c.allreduce(&small, &small, 1, DType::kFloat32, ReduceOp::kSum);
          quick->wait(20s);
          const bool large_done = large->is_completed();
          if (threads == 1 && !large_done)
            fail.push_back("rank " + std::to_string(rank) +
                           ": with one thread the small op completed before the large one");
          c.barrier()->wait(20s);
          if (!large->is_completed())
            fail.push_back("rank " + std::to_string(rank) + ": a barrier completed before an earlier op");
          large->wait(1s);
          if (!large_done && rank == 0) overtaken.fetch_add(1);
        }
      },
      20s, with_threads);
  INFO(describe(f));
  CHECK(f.empty());
  if (threads == 2) CHECK(overtaken.load() >= 1);
}

TEST_CASE("gloo: --gloo-threads out of range is a usage error", "[gloo]") {
  for (int bad : {0, -1, 17}) {
    CommOptions o = gloo_rank_options(0, 1, std::make_shared<MemoryStore>(), 5s);
    o.gloo_threads = bad;
    try {
      make_communicator(o);
      FAIL("gloo_threads " << bad << " was accepted");
    } catch (const UsageError& e) {
      CHECK(std::string(e.what()).find(std::to_string(bad) + " worker threads") != std::string::npos);
    }
  }
}

TEST_CASE("gloo: broadcast, reduce, allgather", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const std::size_t count = 29;
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (DType t : {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kUInt8}) {
      for (int root = 0; root < n; ++root) {
        // Broadcast: every rank ends with the root's values.
        auto buf = fill(t, ReduceOp::kSum, rank, count);
        c.broadcast(buf.data(), count, t, root)->wait(10s);
        compare(buf, fill(t, ReduceOp::kSum, root, count), t,
                "broadcast root " + std::to_string(root), rank, fail);
        // Reduce: the root gets the reduction; non-roots' send stays as it was.
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
          auto send = fill(t, op, rank, count);
          const auto send0 = send;
          std::vector<std::uint8_t> recv(send.size(), 0xee);
          const auto recv0 = recv;
          c.reduce(send.data(), recv.data(), count, t, op, root)->wait(10s);
          const std::string what = label("reduce", t, op, false) + " root " + std::to_string(root);
          if (rank == root)
            compare(recv, expected_reduction(t, op, n, count), t, what, rank, fail);
          else if (recv != recv0)
            fail.push_back(what + ": non-root recv was written");
          if (send != send0) fail.push_back(what + ": send modified");
        }
      }
      // Allgather, out of place and in place (send is this rank's block of recv).
      std::vector<std::uint8_t> want;
      for (int r = 0; r < n; ++r) {
        auto b = fill(t, ReduceOp::kSum, r, count);
        want.insert(want.end(), b.begin(), b.end());
      }
      auto send = fill(t, ReduceOp::kSum, rank, count);
      std::vector<std::uint8_t> recv(want.size());
      c.allgather(send.data(), recv.data(), count, t)->wait(10s);
      compare(recv, want, t, "allgather out-of-place", rank, fail);
      std::vector<std::uint8_t> inplace(want.size(), 0);
      std::memcpy(inplace.data() + static_cast<std::size_t>(rank) * send.size(), send.data(), send.size());
      c.allgather(inplace.data() + static_cast<std::size_t>(rank) * send.size(), inplace.data(), count, t)
          ->wait(10s);
      compare(inplace, want, t, "allgather in-place", rank, fail);
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: reduce_scatter (ring over unbound buffers)", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (std::size_t count : {std::size_t{1}, std::size_t{13}, std::size_t{4096}}) {
      for (DType t : kAllDTypes) {
        for (ReduceOp op : kAllReduceOps) {
          const std::size_t total = count * static_cast<std::size_t>(n);
          const auto full = expected_reduction(t, op, n, total);
          const std::size_t block = count * dtype_size(t);
          const std::vector<std::uint8_t> want(full.begin() + static_cast<std::ptrdiff_t>(rank * block),
                                               full.begin() + static_cast<std::ptrdiff_t>((rank + 1) * block));
          auto send = fill(t, op, rank, total);
          const auto send0 = send;
          std::vector<std::uint8_t> recv(block);
          c.reduce_scatter(send.data(), recv.data(), count, t, op)->wait(10s);
          const std::string what = label("reduce_scatter", t, op, false) + " count " + std::to_string(count);
          compare(recv, want, t, what, rank, fail);
          if (send != send0) fail.push_back(what + ": send modified");
          if (count != 13) continue;  // in place once per dtype x op is enough
          auto buf = fill(t, op, rank, total);
          std::uint8_t* mine = buf.data() + static_cast<std::size_t>(rank) * block;
          c.reduce_scatter(buf.data(), mine, count, t, op)->wait(10s);
          compare(std::vector<std::uint8_t>(mine, mine + block), want, t,
                  label("reduce_scatter", t, op, true), rank, fail);
        }
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: send/recv around a ring, with tags", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    const int right = (rank + 1) % n;
    const int left = (rank + n - 1) % n;
    const std::size_t count = 1000;
    std::vector<std::int32_t> out(count), in(count, -1), out7(count), in7(count, -1);
    for (std::size_t i = 0; i < count; ++i) {
      out[i] = rank * 100000 + static_cast<int>(i);
      out7[i] = -out[i] - 7;
    }
    // Point-to-point ops run alone, in issue order, so an exchange is ordered by
    // parity (like a blocking send/recv): even ranks send first. Rank n-1
    // of an odd ring is even and sends to 0, which receives after its send.
    std::vector<std::shared_ptr<Work>> w;
    auto send_both = [&] {
      w.push_back(c.send(out.data(), count, DType::kInt32, right, 0));
      w.push_back(c.send(out7.data(), count, DType::kInt32, right, 7));
    };
    auto recv_both = [&] {
      w.push_back(c.recv(in.data(), count, DType::kInt32, left, 0));
      w.push_back(c.recv(in7.data(), count, DType::kInt32, left, 7));
    };
    if (rank % 2 == 0) {
      send_both();
      recv_both();
    } else {
      recv_both();
      send_both();
    }
    for (auto& x : w) x->wait(10s);
    for (std::size_t i = 0; i < count; ++i) {
      if (in[i] != left * 100000 + static_cast<int>(i) || in7[i] != -(left * 100000 + static_cast<int>(i)) - 7) {
        fail.push_back("rank " + std::to_string(rank) + " recv from " + std::to_string(left) +
                       " wrong at " + std::to_string(i));
        break;
      }
    }
    c.barrier()->wait(10s);
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: barrier holds until every rank arrives", "[gloo]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  std::atomic<int> arrived{0};
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    if (rank == n - 1) std::this_thread::sleep_for(200ms);
    arrived.fetch_add(1);
    c.barrier()->wait(10s);
    if (arrived.load() != n) fail.push_back("rank " + std::to_string(rank) + " left the barrier early");
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: bad arguments are usage errors", "[gloo]") {
  const Failures f = run_gloo_ranks(2, [](Communicator& c, int rank, Failures& fail) {
    int x = 0;
    try {
      c.send(&x, 1, DType::kInt32, rank);
      fail.push_back("send to self accepted");
    } catch (const UsageError&) {
    }
    try {
      c.broadcast(&x, 1, DType::kInt32, 5);
      fail.push_back("root 5 accepted");
    } catch (const UsageError&) {
    }
    c.barrier()->wait(10s);
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: a peer that never joins gives a TimeoutError, not a hang", "[gloo]") {
  const auto started = std::chrono::steady_clock::now();
  const Failures f = run_gloo_ranks(
      2,
      [](Communicator& c, int rank, Failures& fail) {
        if (rank == 1) {
          // Never issues the allreduce; stays alive past rank 0's wait.
          std::this_thread::sleep_for(1200ms);
          return;
        }
        float v = 1;
        auto w = c.allreduce(&v, &v, 1, DType::kFloat32, ReduceOp::kSum);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          w->wait(1000ms);
          fail.push_back("allreduce without a peer completed");
        } catch (const TimeoutError& e) {
          const std::string msg = e.what();
          if (msg.find("allreduce #1") == std::string::npos)
            fail.push_back("timeout message does not name the op: " + msg);
          if (e.context().phase != "allreduce") fail.push_back("phase " + e.context().phase);
        }
        const auto waited = std::chrono::steady_clock::now() - t0;
        if (waited < 900ms || waited > 1500ms)
          fail.push_back("wait returned after " +
                         std::to_string(std::chrono::duration_cast<Millis>(waited).count()) + " ms");
      },
      1500ms);
  INFO(describe(f));
  CHECK(f.empty());
  // Both communicators are gone, the stuck op included.
  CHECK(std::chrono::steady_clock::now() - started < 6s);
}

TEST_CASE("gloo: a peer that dies mid-way fails the others within the timeout", "[gloo]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const auto started = std::chrono::steady_clock::now();
  const Failures f = run_gloo_ranks(
      n,
      [&](Communicator& c, int rank, Failures& fail) {
        std::int64_t v = rank;
        c.allreduce(&v, &v, 1, DType::kInt64, ReduceOp::kSum)->wait(10s);
        c.barrier()->wait(10s);
        if (rank == n - 1) return;  // dies: run_ranks destroys its communicator
        std::this_thread::sleep_for(100ms);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          std::vector<float> buf(1024, 1.0f);
          c.allreduce(buf.data(), buf.data(), buf.size(), DType::kFloat32, ReduceOp::kSum)->wait(4s);
          fail.push_back("rank " + std::to_string(rank) + ": allreduce with a dead peer succeeded");
        } catch (const PeerError&) {
        } catch (const TimeoutError&) {
        } catch (const std::exception& e) {
          fail.push_back("rank " + std::to_string(rank) + ": unexpected error " + e.what());
        }
        if (std::chrono::steady_clock::now() - t0 > 3500ms)
          fail.push_back("rank " + std::to_string(rank) + " took too long to fail");
      },
      2000ms);
  INFO(describe(f));
  CHECK(f.empty());
  CHECK(std::chrono::steady_clock::now() - started < 10s);
}

TEST_CASE("gloo: a buffer freed after its wait ran out stays valid until the op ends", "[gloo]") {
  // A wait that runs out of time (or the monitor failing an op, or an abort)
  // leaves the Gloo op running on a worker; a caller that unwinds frees its
  // buffers at once. 64 MiB is beyond malloc's mmap threshold, so a buffer
  // released there and then would be unmapped under the running op.
  constexpr std::size_t kCount = 16u << 20;
  const Failures f = run_gloo_ranks(
      2,
      [&](Communicator& c, int rank, Failures& fail) {
        auto* buf = static_cast<float*>(c.alloc(kCount * sizeof(float)));
        std::fill(buf, buf + kCount, static_cast<float>(rank + 1));
        c.barrier()->wait(10s);
        if (rank == 0) {
          auto w = c.allreduce(buf, buf, kCount, DType::kFloat32, ReduceOp::kSum);
          try {
            w->wait(50ms);
            fail.push_back("rank 0: the allreduce completed before its peer joined");
          } catch (const TimeoutError&) {
          }
          c.free(buf);
          // New memory of the same size must not be the old buffer.
          auto* other = static_cast<float*>(c.alloc(kCount * sizeof(float)));
          std::fill(other, other + kCount, 7.0f);
          c.barrier()->wait(10s);  // after the allreduce, in issue order
          if (std::any_of(other, other + kCount, [](float v) { return v != 7.0f; }))
            fail.push_back("rank 0: new memory was written by the old allreduce");
          c.free(other);
          return;
        }
        std::this_thread::sleep_for(400ms);
        c.allreduce(buf, buf, kCount, DType::kFloat32, ReduceOp::kSum)->wait(10s);
        const auto bad = std::find_if(buf, buf + kCount, [](float v) { return v != 3.0f; });
        if (bad != buf + kCount)
          fail.push_back("rank 1: element " + std::to_string(bad - buf) + " is " +
                         std::to_string(*bad) + ", expected 3");
        c.barrier()->wait(10s);
        c.free(buf);
      },
      10s);
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("gloo: abort fails queued work and later ops", "[gloo]") {
  const Failures f = run_gloo_ranks(
      2,
      [](Communicator& c, int rank, Failures& fail) {
        c.barrier()->wait(10s);
        if (rank == 0) {
          float v = 1;
          auto w = c.allreduce(&v, &v, 1, DType::kFloat32, ReduceOp::kSum);  // never matched
          c.abort();
          try {
            w->wait(2s);
            fail.push_back("aborted work succeeded");
          } catch (const Error&) {
          }
          try {
            c.barrier()->wait(2s);
            fail.push_back("barrier after abort succeeded");
          } catch (const Error&) {
          }
        }
      },
      1500ms);
  INFO(describe(f));
  CHECK(f.empty());
}

// The store under every test above, and under Gloo's rendezvous: the
// behaviours the rendezvous relies on.
TEST_CASE("MemoryStore: waits, timeouts naming keys, counters, compare_set", "[memory_store]") {
  MemoryStore m;
  // get waits for a key set later by another thread.
  std::thread setter([&] {
    std::this_thread::sleep_for(30ms);
    m.set("late", to_bytes("v"));
  });
  CHECK(to_string(m.get("late", 5s)) == "v");
  setter.join();
  // A timeout names exactly the missing keys.
  m.set("here", {});
  try {
    m.wait({"here", "gone1", "gone2"}, 20ms);
    FAIL("wait did not time out");
  } catch (const TimeoutError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("gone1") != std::string::npos);
    CHECK(msg.find("gone2") != std::string::npos);
    CHECK(msg.find("'here'") == std::string::npos);
  }
  CHECK_THROWS_AS(m.get("never", 10ms), TimeoutError);
  // Counters are decimal ASCII; a non-counter value is a usage error.
  CHECK(m.add("c", 5) == 5);
  CHECK(m.add("c", -7) == -2);
  CHECK(to_string(m.get("c", 10ms)) == "-2");
  m.set("text", to_bytes("abc"));
  CHECK_THROWS_AS(m.add("text", 1), UsageError);
  // compare_set, c10d semantics.
  CHECK(to_string(m.compare_set("k", {}, to_bytes("new"))) == "new");       // missing, empty expected: set
  CHECK(to_string(m.compare_set("k2", to_bytes("x"), to_bytes("y"))) == "x");  // missing: echo expected
  CHECK_FALSE(m.check({"k2"}));
  CHECK(to_string(m.compare_set("k", to_bytes("old"), to_bytes("z"))) == "new");  // mismatch: unchanged
  CHECK(to_string(m.compare_set("k", to_bytes("new"), to_bytes("z"))) == "z");    // match: swapped
  // compare_set wakes a waiter.
  std::thread cas([&] {
    std::this_thread::sleep_for(20ms);
    m.compare_set("woken", {}, to_bytes("1"));
  });
  m.wait({"woken"}, 5s);
  cas.join();
  const auto before = m.num_keys();
  CHECK(m.delete_key("k"));
  CHECK_FALSE(m.delete_key("k"));
  CHECK(m.num_keys() == before - 1);
}

TEST_CASE("make_communicator: NCCL in a build without it is a usage error", "[gloo]") {
  CHECK(backend_name(Backend::kGloo) == "gloo");
  CHECK(backend_name(Backend::kNccl) == "nccl");
  if (nccl_supported()) {
    WARN("this build has NCCL: the CPU-only dispatch is checked in CPU-only builds");
    return;
  }
  CHECK(cuda_device_count() == 0);
  CHECK_FALSE(cuda_unavailable_reason().empty());
  CommOptions o;
  o.backend = Backend::kNccl;
  o.store = std::make_shared<MemoryStore>();
  try {
    make_communicator(o);
    FAIL("NCCL accepted in a build without it");
  } catch (const UsageError& e) {
    const std::string msg = std::string(e.what()) + " " + e.context().hint;
    CHECK(msg.find("-DDDPDIAG_WITH_CUDA=ON") != std::string::npos);
    CHECK(msg.find("--backend gloo") != std::string::npos);
  }
}

TEST_CASE("gloo: addresses in Gloo's messages show their real ports", "[gloo]") {
  sockaddr_storage ss{};
  auto& in = reinterpret_cast<sockaddr_in&>(ss);
  in.sin_family = AF_INET;
  in.sin_port = htons(4711);
  ::inet_pton(AF_INET, "10.0.0.2", &in.sin_addr);
  const std::string shown = gloo::transport::tcp::Address(ss, 3).str();
  const std::string msg = "[./gloo/transport/tcp/pair.cc:589] Read error " + shown + ": Connection reset by peer";
  const std::string fixed = gloo_backend::right_ports(msg);
  INFO(msg << " -> " << fixed);
  CHECK(fixed.find("Read error [10.0.0.2]:4711") != std::string::npos);
  CHECK(fixed.find("pair.cc:589]") != std::string::npos);  // the source line is no address
  CHECK(gloo_backend::right_ports("connect [::1]:" + std::to_string(htons(29500)) + ": refused") ==
        "connect [::1]:29500: refused");
}

TEST_CASE("gloo: the rank a Gloo message names, by listening address or by its host alone", "[gloo]") {
  const auto shown = [](const char* ip, std::uint16_t port) {
    sockaddr_storage ss{};
    auto& in = reinterpret_cast<sockaddr_in&>(ss);
    in.sin_family = AF_INET;
    in.sin_port = htons(port);
    ::inet_pton(AF_INET, ip, &in.sin_addr);
    std::string text = gloo::transport::tcp::Address(ss).str();
    return text.substr(0, text.find('$'));
  };
  // Ranks 1 and 2 share host 10.0.0.2; rank 3 is alone on 10.0.0.3.
  const std::map<std::string, int> peers{{shown("10.0.0.2", 4711), 1},
                                         {shown("10.0.0.2", 4712), 2},
                                         {shown("10.0.0.3", 4713), 3}};
  const auto closed = [](const std::string& who) { return "Connection closed by peer " + who; };
  // The listening address names the rank, even on a shared host.
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.2", 4712)), peers) == 2);
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.3", 4713)), peers) == 3);
  // The accepting side sees an ephemeral port: the host alone names rank 3,
  // but not one of the two ranks on 10.0.0.2.
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.3", 47988)), peers) == 3);
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.2", 47988)), peers) == -1);
  // A host no peer listens on, or one whose address only begins the same.
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.4", 4713)), peers) == -1);
  CHECK(gloo_backend::peer_named_in(closed(shown("10.0.0.33", 4713)), peers) == -1);
  CHECK(gloo_backend::peer_named_in("Timed out waiting", peers) == -1);
}

TEST_CASE("gloo: where ranks bind (hostname, interface) and a bad interface", "[gloo]") {
  const RankBody exchange = [](Communicator& c, int rank, Failures& fail) {
    std::int32_t v = rank + 1;
    c.allreduce(&v, &v, 1, DType::kInt32, ReduceOp::kSum)->wait(10s);
    if (v != 3) fail.push_back("allreduce over the chosen address gave " + std::to_string(v));
  };
  SECTION("this host's hostname, falling back to loopback") {
    const Failures f = run_gloo_ranks(2, exchange, 10s, [](CommOptions& o) { o.gloo_hostname.clear(); });
    INFO(describe(f));
    CHECK(f.empty());
  }
  SECTION("the loopback interface by name") {
    const Failures f = run_gloo_ranks(2, exchange, 10s, [](CommOptions& o) {
      o.gloo_hostname.clear();
      o.gloo_interface = "lo";
    });
    INFO(describe(f));
    CHECK(f.empty());
  }
  SECTION("an interface that does not exist is a usage error") {
    CommOptions o = gloo_rank_options(0, 1, std::make_shared<MemoryStore>(), 5s);
    o.gloo_interface = "ddpdiag-no-such-if0";
    CHECK_THROWS_AS(make_communicator(o), UsageError);
  }
}

TEST_CASE("gloo: sendrecv ring steps need no ordering; they match plain send/recv", "[gloo]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    const int right = (rank + 1) % n;
    const int left = (rank + n - 1) % n;
    // Every rank sends right and receives left at once, n-1 times: the
    // all-gather half of a ring, which deadlocks with send-then-recv.
    const std::size_t count = 257;
    std::vector<std::int64_t> blocks(count * static_cast<std::size_t>(n), -1);
    for (std::size_t i = 0; i < count; ++i)
      blocks[static_cast<std::size_t>(rank) * count + i] = rank * 1000 + static_cast<std::int64_t>(i);
    for (int step = 0; step + 1 < n; ++step) {
      const auto send_block = static_cast<std::size_t>((rank - step + n) % n);
      const auto recv_block = static_cast<std::size_t>((rank - step - 1 + 2 * n) % n);
      c.sendrecv(blocks.data() + send_block * count, count, right, blocks.data() + recv_block * count,
                 count, left, DType::kInt64, 3)
          ->wait(10s);
    }
    for (int r = 0; r < n; ++r)
      for (std::size_t i = 0; i < count; ++i)
        if (blocks[static_cast<std::size_t>(r) * count + i] != r * 1000 + static_cast<std::int64_t>(i)) {
          fail.push_back("rank " + std::to_string(rank) + ": block " + std::to_string(r) + " wrong");
          r = n;
          break;
        }
    // Against plain calls: rank 0 exchanges with rank 1, which uses recv then send.
    if (rank < 2) {
      std::int32_t mine = 10 + rank, theirs = -1;
      const int other = 1 - rank;
      if (rank == 0) {
        c.sendrecv(&mine, 1, other, &theirs, 1, other, DType::kInt32, 9)->wait(10s);
      } else {
        c.recv(&theirs, 1, DType::kInt32, other, 9)->wait(10s);
        c.send(&mine, 1, DType::kInt32, other, 9)->wait(10s);
      }
      if (theirs != 10 + other) fail.push_back("sendrecv vs send/recv: got " + std::to_string(theirs));
    }
    c.barrier()->wait(10s);
  });
  INFO(describe(f));
  CHECK(f.empty());
}
