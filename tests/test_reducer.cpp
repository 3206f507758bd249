// The bucketed reducer and the backward simulator, ranks as threads over
// Gloo. Gradients are checked element for element against the true mean on
// every rank after every iteration (see backward_sim.h for why the expected
// values are exact).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>

#include <fmt/core.h>

#include "ddp_core/backward_sim.h"
#include "ddp_core/reducer.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using namespace ddpdiag::ddp_core;
using namespace ddpdiag::testing;
using namespace std::chrono_literals;

namespace {

// Eight tensors; with a 1 KiB cap and a 256 B first bucket the reverse order
// gives several buckets, and "big.weight" (8000 B) is larger than the cap.
ModelLayout small_layout() {
  ModelLayout l;
  l.name = "test-small";
  l.tensors = {{"emb.weight", {37, 5}, DType::kFloat32, false},
               {"big.weight", {2000}, DType::kFloat32, false},
               {"big.bias", {3}, DType::kFloat32, false},
               {"l1.weight", {16, 9}, DType::kFloat32, false},
               {"l1.bias", {16}, DType::kFloat32, false},
               {"l2.weight", {7, 11}, DType::kFloat32, false},
               {"l2.bias", {1}, DType::kFloat32, false},
               {"head.weight", {50}, DType::kFloat32, false}};
  return l;
}

ReducerOptions small_options() {
  ReducerOptions o;
  o.bucket_cap_bytes = 1024;
  o.first_bucket_bytes = 256;
  o.timeout = 20s;
  return o;
}

void expect_exact(const Reducer& red, Communicator& c, std::uint64_t it, const std::string& what,
                  Failures& fail, const UsedBy& used = {}) {
  const auto chk = check_gradients(red, c, it, 1.0, 0, used);
  if (chk.wrong)
    fail.push_back(fmt::format("rank {} {} iteration {}: {} of {} elements wrong (max error {})",
                               c.rank(), what, it, chk.wrong, chk.checked, chk.max_abs_error));
}

}  // namespace

TEST_CASE("reducer: buckets follow DDP's assignment, one larger than the cap", "[reducer]") {
  const Failures f = run_gloo_ranks(1, [](Communicator& c, int, Failures& fail) {
    Reducer red(c, small_layout(), small_options());
    const auto want = ddp_buckets(small_layout(), 1024, 256);
    if (red.buckets().size() != want.size()) fail.push_back("bucket count differs from ddp_buckets");
    bool over_cap = false;
    for (std::size_t b = 0; b < red.buckets().size(); ++b) {
      const auto& rb = red.buckets()[b];
      if (rb.spec.param_indices != want[b].param_indices) fail.push_back("bucket params differ");
      // big.weight (index 1, 8000 B) alone exceeds the 1 KiB cap; tensors
      // are never split, so its bucket does too.
      const auto& ps = rb.spec.param_indices;
      if (rb.spec.bytes > 1024 && std::find(ps.begin(), ps.end(), 1u) != ps.end()) over_cap = true;
      // Views: consecutive slices of one buffer in ready order.
      for (std::size_t k = 0; k + 1 < rb.spec.param_indices.size(); ++k) {
        const auto p = rb.spec.param_indices[k], q = rb.spec.param_indices[k + 1];
        if (static_cast<std::uint8_t*>(red.grad(p)) + red.grad_bytes(p) != red.grad(q))
          fail.push_back("gradient views are not consecutive in their bucket");
      }
    }
    if (!over_cap) fail.push_back("no bucket over the cap holding big.weight");
    // Bucket 0 holds the last parameters (reverse order).
    if (red.buckets().front().spec.param_indices.front() != small_layout().tensors.size() - 1)
      fail.push_back("bucket 0 does not start with the last parameter");
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: every gradient is the true mean on every rank", "[reducer]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    for (bool stream : {false, true})
    for (bool views : {true, false})
      for (Averaging avg : {Averaging::kDivideThenSum, Averaging::kAvgOp}) {
        auto o = small_options();
        o.gradient_as_bucket_view = views;
        o.averaging = avg;
        o.stream_path = stream;
        Reducer red(c, small_layout(), o);
        const std::string what = fmt::format("views {} avg-op {} stream {}", views,
                                             avg == Averaging::kAvgOp, stream);
        for (std::uint64_t it = 0; it < 3; ++it) {
          simulate_backward(red, c, it);
          red.finalize();
          expect_exact(red, c, it, what, fail);
          const auto& tm = red.last_timing();
          for (const auto& b : tm.buckets)
            if (b.launched < b.ready || b.completed < b.launched)
              fail.push_back(what + ": bucket timestamps out of order");
          if (tm.finalize_end < tm.last_mark_ready) fail.push_back(what + ": finalize before backward");
        }
      }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: mixed dtypes get buckets of their own", "[reducer]") {
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int, Failures& fail) {
    ModelLayout l = small_layout();
    l.tensors[3].dtype = DType::kFloat64;
    l.tensors[5].dtype = DType::kFloat16;
    for (bool stream : {false, true}) {
    auto o = small_options();
    o.stream_path = stream;
    Reducer red(c, l, o);
    for (const auto& b : red.buckets())
      for (auto p : b.spec.param_indices)
        if (l.tensors[p].dtype != b.spec.dtype) fail.push_back("bucket mixes dtypes");
    for (std::uint64_t it = 0; it < 2; ++it) {
      simulate_backward(red, c, it);
      red.finalize();
      expect_exact(red, c, it, stream ? "mixed dtypes, stream path" : "mixed dtypes", fail);
    }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: fp16 and bf16 compression hooks", "[reducer]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    for (bool stream : {false, true})
    for (CompressionHook h : {CompressionHook::kFp16, CompressionHook::kBf16})
      for (bool views : {true, false}) {
        auto o = small_options();
        o.hook = h;
        o.gradient_as_bucket_view = views;
        o.stream_path = stream;
        Reducer red(c, small_layout(), o);
        const std::string what = fmt::format("hook {} views {} stream {}",
                                             compression_hook_name(h), views, stream);
        // Small integers: exact in 16 bits, so exact through the hook.
        simulate_backward(red, c, 0);
        red.finalize();
        expect_exact(red, c, 0, what, fail);
        // 0.1 * integers are not representable: within a few roundings of
        // the 16-bit type (fp16: 2^-11 relative, bf16: 2^-8), counted
        // against the magnitudes summed.
        const double tol = h == CompressionHook::kFp16 ? 4 * 0x1p-11 : 4 * 0x1p-8;
        BackwardSimOptions so;
        so.value_scale = 0.1;
        for (std::uint64_t it = 1; it < 3; ++it) {
          simulate_backward(red, c, it, so);
          red.finalize();
          const auto chk = check_gradients(red, c, it, 0.1, tol);
          if (chk.wrong)
            fail.push_back(fmt::format("rank {} {}: {} elements out of tolerance (max error {})",
                                       c.rank(), what, chk.wrong, chk.max_abs_error));
          if (chk.max_abs_error == 0)
            fail.push_back(what + ": no rounding at all, the hook did not run in 16 bits");
        }
      }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: find_unused_parameters, unused on some ranks and on all", "[reducer]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (bool stream : {false, true})
    for (bool views : {true, false})
      for (bool declare : {true, false}) {
        auto o = small_options();
        o.find_unused_parameters = true;
        o.gradient_as_bucket_view = views;
        o.stream_path = stream;
        Reducer red(c, small_layout(), o);
        const std::string what =
            fmt::format("views {} declared {} stream {}", views, declare, stream);
        for (std::uint64_t it = 0; it < 3; ++it) {
          // Parameter 2 (big.bias) unused everywhere in iteration 1; l1.weight
          // (3) unused on rank 1 only; head.weight (7, the first bucket's)
          // unused on the last rank in even iterations.
          auto unused_on = [&](int r, std::size_t p) {
            return (p == 2 && it == 1) || (p == 3 && r == 1) ||
                   (p == 7 && r == n - 1 && it % 2 == 0);
          };
          BackwardSimOptions so;
          so.declare_unused = declare;
          for (std::size_t p = 0; p < small_layout().tensors.size(); ++p)
            if (unused_on(rank, p)) so.unused.push_back(p);
          simulate_backward(red, c, it, so);
          red.finalize();
          expect_exact(red, c, it, what, fail,
                       [&](int r, std::size_t p) { return !unused_on(r, p); });
          const std::vector<std::size_t> want_global =
              it == 1 ? std::vector<std::size_t>{2} : std::vector<std::size_t>{};
          if (red.globally_unused() != want_global)
            fail.push_back(fmt::format("{} iteration {}: globally unused has {} entries", what, it,
                                       red.globally_unused().size()));
        }
      }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: without find_unused_parameters a missing gradient names the parameter",
          "[reducer]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    Reducer red(c, small_layout(), small_options());
    BackwardSimOptions so;
    so.unused = {4, 6};  // l1.bias, l2.bias: on every rank, so no rank hangs
    so.declare_unused = false;
    simulate_backward(red, c, 0, so);
    try {
      red.finalize();
      fail.push_back("finalize did not throw");
    } catch (const UsageError& e) {
      const std::string m = e.what();
      for (const char* want : {"l1.bias", "l2.bias", "never received a gradient"})
        if (m.find(want) == std::string::npos) fail.push_back("message lacks '" + std::string(want) + "': " + m);
      if (e.context().hint.find("--find-unused-parameters") == std::string::npos)
        fail.push_back("hint lacks --find-unused-parameters: " + e.context().hint);
      if (e.context().phase != "reducer.finalize") fail.push_back("phase " + e.context().phase);
    }
    // The reducer recovers: the next full iteration is correct.
    simulate_backward(red, c, 1);
    red.finalize();
    expect_exact(red, c, 1, "after the error", fail);
    // Misuse: twice marked, and a new iteration before finalize.
    red.prepare_for_backward();
    try {
      red.prepare_for_backward();
      fail.push_back("prepare_for_backward twice did not throw");
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("prior iteration") == std::string::npos)
        fail.push_back(std::string("unexpected message: ") + e.what());
    }
    red.mark_ready(7);
    try {
      red.mark_ready(7);
      fail.push_back("marking twice did not throw");
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("head.weight") == std::string::npos)
        fail.push_back(std::string("twice: no name in ") + e.what());
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: early buckets' all_reduce overlaps the backward pass", "[reducer]") {
  // 16 tensors of 64 KiB (1 MiB in all) at 0.01 GB/s: backward takes ~105 ms,
  // each tensor ~6.6 ms. Buckets of 128 KiB (first 64 KiB): 9 buckets, the
  // first launched after the first tensor, ~100 ms before backward ends. A
  // 64 KiB all_reduce on loopback takes well under a millisecond.
  ModelLayout l;
  l.name = "overlap";
  for (int i = 0; i < 16; ++i)
    l.tensors.push_back({fmt::format("layer{}.weight", i), {16384}, DType::kFloat32, false});
  struct Seen {
    double backward_us = 0, first_launch_us = 0, first_complete_us = 0, exposed_us = 0;
    int buckets_done_before_end = 0;
    std::size_t buckets = 0;
  };
  std::vector<Seen> seen(2);
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    ReducerOptions o;
    o.bucket_cap_bytes = 128 * 1024;
    o.first_bucket_bytes = 64 * 1024;
    Reducer red(c, l, o);
    BackwardSimOptions so;
    so.compute_gbps = 0.01;
    simulate_backward(red, c, 0, so);  // warm-up: connections, page faults
    red.finalize();
    const auto bw = simulate_backward(red, c, 1, so);
    red.finalize();
    expect_exact(red, c, 1, "overlap", fail);
    const auto& tm = red.last_timing();
    auto us = [&](ReducerClock::time_point t) {
      return std::chrono::duration<double, std::micro>(t - bw.start).count();
    };
    Seen& s = seen[static_cast<std::size_t>(rank)];
    s.backward_us = us(bw.end);
    s.first_launch_us = us(tm.buckets[0].launched);
    s.first_complete_us = us(tm.buckets[0].completed);
    s.exposed_us = tm.exposed_comm_us();
    s.buckets = tm.buckets.size();
    for (const auto& b : tm.buckets)
      if (b.completed < bw.end) ++s.buckets_done_before_end;
  });
  INFO(describe(f));
  CHECK(f.empty());
  for (std::size_t r = 0; r < seen.size(); ++r) {
    const auto& s = seen[r];
    // The evidence, printed for the record.
    std::printf("overlap rank %zu: backward %.0f us; bucket 0 launched at %.0f us, completion "
                "observed at %.0f us; %d of %zu buckets complete before backward ended; exposed "
                "%.0f us\n",
                r, s.backward_us, s.first_launch_us, s.first_complete_us,
                s.buckets_done_before_end, s.buckets, s.exposed_us);
    CAPTURE(r, s.backward_us, s.first_launch_us, s.first_complete_us);
    CHECK(s.backward_us > 80000);
    CHECK(s.first_launch_us < s.backward_us / 4);
    CHECK(s.first_complete_us < s.backward_us);
    CHECK(s.buckets_done_before_end >= static_cast<int>(s.buckets) - 2);
  }
}

// The stream path (what runs on a GPU) against the host path on values that
// round: both must produce the same bits, gradient for gradient.
TEST_CASE("reducer: the stream path gives the host path's bits", "[reducer]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    ModelLayout l = small_layout();
    l.tensors[3].dtype = DType::kFloat64;
    l.tensors[5].dtype = DType::kBFloat16;
    for (CompressionHook h : {CompressionHook::kNone, CompressionHook::kFp16, CompressionHook::kBf16})
      for (bool views : {true, false}) {
        std::vector<std::vector<std::uint8_t>> got[2];
        for (int stream = 0; stream < 2; ++stream) {
          auto o = small_options();
          o.hook = h;
          o.gradient_as_bucket_view = views;
          o.stream_path = stream == 1;
          Reducer red(c, l, o);
          BackwardSimOptions so;
          so.value_scale = 0.1;
          simulate_backward(red, c, 5, so);
          red.finalize();
          for (std::size_t p = 0; p < l.tensors.size(); ++p) {
            const auto* g = static_cast<const std::uint8_t*>(red.grad(p));
            got[stream].emplace_back(g, g + red.grad_bytes(p));
          }
        }
        for (std::size_t p = 0; p < l.tensors.size(); ++p)
          if (got[0][p] != got[1][p])
            fail.push_back(fmt::format("rank {} hook {} views {}: {} differs between the paths",
                                       c.rank(), compression_hook_name(h), views,
                                       l.tensors[p].name));
      }
  });
  INFO(describe(f));
  CHECK(f.empty());
}
