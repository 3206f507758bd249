// The bucketed reducer and the backward simulator, ranks as threads over
// Gloo. Gradients are checked element for element against the true mean on
// every rank after every iteration (see backward_sim.h for why the expected
// values are exact).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>
#include <thread>
#include <mutex>

#include <fmt/core.h>

#include "comm/memory.h"
#include "comm/monitored_communicator.h"
#include "ddp_core/backward_sim.h"
#include "ddp_core/reducer.h"
#include "tests/forwarding_communicator.h"
#include "tests/paced_communicator.h"
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

TEST_CASE("simulated gradients: no two ranks, parameters or shifts share a pattern", "[reducer]") {
  // The check adds up every rank's values: a reducer that counts one rank
  // twice and another never, swaps two parameters of one size, or reads its
  // bucket at a wrong offset passes wherever the patterns coincide (with
  // (i + 7p + 3r + 5t) mod 16 they did every 16 ranks, parameters and
  // elements).
  const int world = 64;
  const std::size_t n = 256;
  const auto pattern = [&](int r, std::size_t p, std::uint64_t it, std::size_t shift) {
    std::vector<double> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = sim_gradient_value(world, r, p, i + shift, it, 1.0);
    return v;
  };
  std::vector<std::vector<double>> seen;
  for (int r = 0; r < world; ++r)
    for (std::size_t p = 0; p < 40; ++p)
      for (std::uint64_t it = 0; it < 3; ++it) seen.push_back(pattern(r, p, it, 0));
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
  const auto base = pattern(5, 3, 1, 0);
  for (std::size_t shift = 1; shift <= 64; ++shift) {
    INFO("shift " << shift);
    CHECK(pattern(5, 3, 1, shift) != base);
  }
  for (std::size_t i = 0; i < n; ++i) {  // the range the exactness rests on
    const double k = sim_gradient_value(world, 7, 2, i, 0, 1.0) / world;
    CHECK(k >= -8);
    CHECK(k <= 7);
  }
}

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

TEST_CASE("reducer: a frozen parameter is refused; trainable_parameters() drops it", "[reducer]") {
  ModelLayout frozen = small_layout();
  frozen.tensors[2].requires_grad = false;
  const Failures f = run_gloo_ranks(1, [&](Communicator& c, int, Failures& fail) {
    try {
      Reducer red(c, frozen, small_options());
      fail.push_back("a layout with a frozen parameter was taken");
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("big.bias") == std::string::npos)
        fail.push_back(std::string("the error does not name the parameter: ") + e.what());
    }
    Reducer red(c, trainable_parameters(frozen), small_options());
    if (red.buckets().size() != ddp_buckets(frozen, 1024, 256).size())
      fail.push_back("bucket count differs from ddp_buckets of the full layout");
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

namespace {

// One finalized iteration in which this rank gives no gradient to the
// parameters p with unused_on(rank, p), declared to prepare_for_backward
// when `declare` (else they are found missing at finalize).
void iteration_without(Reducer& red, Communicator& c, int rank, std::uint64_t it, bool declare,
                       const std::function<bool(int, std::size_t)>& unused_on) {
  BackwardSimOptions so;
  so.declare_unused = declare;
  for (std::size_t p = 0; p < red.layout().tensors.size(); ++p)
    if (unused_on(rank, p)) so.unused.push_back(p);
  simulate_backward(red, c, it, so);
  red.finalize();
}

}  // namespace

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
          iteration_without(red, c, rank, it, declare, unused_on);
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

TEST_CASE("reducer: views off, a gradient buffer only for parameters used somewhere, as torch's .grad",
          "[reducer]") {
  // torch allocates a parameter's .grad when its first gradient is made, and
  // DDP leaves the gradient of a parameter no rank used untouched: None if it
  // was never used, else what it last held. A parameter unused here and used
  // on another rank gets the reduced gradient (a buffer made for it then).
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (bool stream : {false, true})
      for (bool static_graph : {false, true}) {
        auto o = small_options();
        o.find_unused_parameters = !static_graph;
        o.static_graph = static_graph;
        o.gradient_as_bucket_view = false;
        o.stream_path = stream;
        const auto layout = small_layout();
        Reducer red(c, layout, o);
        const std::string what = fmt::format("rank {} stream {} static_graph {}", rank, stream, static_graph);
        std::uint64_t all = 0;
        for (const auto& t : layout.tensors) all += t.bytes();
        const std::uint64_t bias = layout.tensors[2].bytes();
        if (red.own_gradient_bytes() != 0)
          fail.push_back(fmt::format("{}: {} B of gradients before any was made", what, red.own_gradient_bytes()));
        // big.bias (2) unused everywhere; l1.weight (3) unused on rank 1 only.
        auto unused_on = [&](int r, std::size_t p) { return p == 2 || (p == 3 && r == 1); };
        for (std::uint64_t it = 0; it < 2; ++it) {
          iteration_without(red, c, rank, it, true, unused_on);
          expect_exact(red, c, it, what, fail, [&](int r, std::size_t p) { return !unused_on(r, p); });
          if (red.own_gradient_bytes() != all - bias)
            fail.push_back(fmt::format("{} iteration {}: {} B of gradients, want {} (all but big.bias)", what, it,
                                       red.own_gradient_bytes(), all - bias));
        }
        if (static_graph) continue;  // its graph may not change
        // Iteration 2 uses every parameter; iteration 3 none uses big.bias,
        // whose gradient keeps iteration 2's reduced values.
        iteration_without(red, c, rank, 2, true, [](int, std::size_t) { return false; });
        expect_exact(red, c, 2, what, fail);
        if (red.own_gradient_bytes() != all)
          fail.push_back(fmt::format("{} iteration 2: {} B of gradients, want {}", what, red.own_gradient_bytes(), all));
        std::vector<float> kept(3);
        std::memcpy(kept.data(), red.grad(2), bias);
        iteration_without(red, c, rank, 3, true, unused_on);
        expect_exact(red, c, 3, what, fail, [&](int r, std::size_t p) { return !unused_on(r, p); });
        if (std::memcmp(kept.data(), red.grad(2), bias) != 0)
          fail.push_back(what + " iteration 3: the gradient of big.bias, used nowhere, changed");
        if (kept == std::vector<float>(3, 0.0f))
          fail.push_back(what + ": iteration 2 left big.bias's gradient zero");
      }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: static_graph, the first iteration's unused parameters and a graph that changes",
          "[reducer]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (bool declare : {true, false}) {
      auto o = small_options();
      o.static_graph = true;
      // The recorded backward (rank 0's, whose buckets DDP runs) never
      // reaches big.bias.
      auto layout = small_layout();
      layout.ready_order = {7, 6, 5, 4, 3, 1, 0};
      Reducer red(c, layout, o);
      const std::string what = fmt::format("declared {}", declare);
      // The buckets are static_graph's: the ready order, then the unused.
      std::vector<std::size_t> order;
      for (const auto& b : red.buckets())
        order.insert(order.end(), b.spec.param_indices.begin(), b.spec.param_indices.end());
      // Parameter 2 (big.bias) unused everywhere, l1.weight (3) on rank 1 only.
      auto unused_on = [&](int r, std::size_t p) { return p == 2 || (p == 3 && r == 1); };
      for (std::uint64_t it = 0; it < 3; ++it) {
        iteration_without(red, c, rank, it, declare, unused_on);
        expect_exact(red, c, it, what, fail, [&](int r, std::size_t p) { return !unused_on(r, p); });
        if (red.globally_unused() != std::vector<std::size_t>{2})
          fail.push_back(fmt::format("{} iteration {}: globally unused has {} entries", what, it,
                                     red.globally_unused().size()));
      }
      if (order.back() != 2) fail.push_back(what + ": big.bias is not in the last bucket's end");
      // Iteration 3 uses big.bias: torch refuses a graph that changes.
      BackwardSimOptions so;
      so.declare_unused = declare;
      if (rank == 1) so.unused.push_back(3);
      simulate_backward(red, c, 3, so);  // fires the layout's ready order, without big.bias
      red.mark_ready(2);
      try {
        red.finalize();
        fail.push_back(what + ": finalize did not throw for a changed graph");
      } catch (const UsageError& e) {
        const std::string m = e.what();
        for (const char* want : {"the training graph changed in iteration 4", "static_graph=True",
                                 "unused in the first iteration got a gradient: big.bias (index 2)"})
          if (m.find(want) == std::string::npos)
            fail.push_back(what + ": message lacks '" + std::string(want) + "': " + m);
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: skip_all_reduce_unused_params issues no all_reduce for a bucket of unused "
          "parameters",
          "[reducer]") {
  // torch 2.x's skip_all_reduce_unused_params: the first bucket's
  // parameters unused on every rank; its all_reduce is left out, the other
  // gradients are still the true mean.
  struct Counting : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    std::vector<std::size_t> counts;  // elements of each all_reduce issued
    StreamOps* stream_ops() override { return inner().stream_ops(); }
    std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                    ReduceOp op) override {
      counts.push_back(count);
      return ForwardingCommunicator::allreduce(send, recv, count, dtype, op);
    }
  };
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& inner, int rank, Failures& fail) {
    for (bool static_graph : {false, true})
      for (bool stream : {false, true})
        for (bool views : {true, false}) {
          Counting c(inner);
          auto o = small_options();
          o.find_unused_parameters = !static_graph;
          o.static_graph = static_graph;
          o.gradient_as_bucket_view = views;
          o.stream_path = stream;
          o.skip_all_reduce_unused_params = true;
          const std::string what = fmt::format("static_graph {} views {} stream {}", static_graph, views, stream);
          // Which parameters fill bucket 0 (find_unused_parameters: the
          // constructor's buckets) when none is unused yet.
          auto layout = small_layout();
          const auto first = Reducer(c, layout, o).buckets().front().spec.param_indices;
          // static_graph's buckets put the unused last: bucket 0's
          // parameters, unused, fill the last ones instead.
          if (static_graph) {
            layout.ready_order.clear();
            for (std::size_t p = layout.tensors.size(); p-- > 0;)
              if (std::find(first.begin(), first.end(), p) == first.end()) layout.ready_order.push_back(p);
          }
          Reducer red(c, layout, o);
          auto unused_on = [&](int, std::size_t p) { return std::find(first.begin(), first.end(), p) != first.end(); };
          for (std::uint64_t it = 0; it < 3; ++it) {
            c.counts.clear();
            iteration_without(red, c, rank, it, true, unused_on);
            expect_exact(red, c, it, what, fail, [&](int r, std::size_t p) { return !unused_on(r, p); });
            const auto& tm = red.last_timing();
            std::size_t skipped = 0;
            for (std::size_t b = 0; b < red.buckets().size(); ++b) {
              const bool all_unused = std::all_of(red.buckets()[b].spec.param_indices.begin(),
                                                  red.buckets()[b].spec.param_indices.end(),
                                                  [&](std::size_t p) { return unused_on(rank, p); });
              if (tm.buckets[b].skipped != all_unused)
                fail.push_back(fmt::format("{} iteration {}: bucket {} skipped {}", what, it, b, tm.buckets[b].skipped));
              if (tm.buckets[b].skipped && tm.buckets[b].payload_bytes != 0)
                fail.push_back(fmt::format("{} iteration {}: skipped bucket {} has a payload", what, it, b));
              skipped += tm.buckets[b].skipped;
            }
            if (skipped == 0) fail.push_back(fmt::format("{} iteration {}: no bucket skipped", what, it));
            // One all_reduce a bucket not skipped, and the used map's (with
            // static_graph in the first iteration only).
            const std::size_t used_map = !static_graph || it == 0;
            if (c.counts.size() != red.buckets().size() - skipped + used_map)
              fail.push_back(fmt::format("{} iteration {}: {} all_reduces for {} buckets, {} skipped", what, it,
                                         c.counts.size(), red.buckets().size(), skipped));
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

TEST_CASE("reducer: with no compute rate completions are still observed during backward", "[reducer]") {
  // --compute-gbps 0 (ddp-step's default): gradients come as fast as the
  // fill writes them, and no rate is waited for. A bucket whose all_reduce
  // has ended must be seen complete during backward, not first in finalize
  // (the timeline's completed_us was the end of backward for every bucket).
  // The all_reduces here end before they are handed back (one rank, waited
  // for at issue), so the test does not depend on how the machine schedules
  // the backend's threads.
  struct DoneAtIssue : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                    ReduceOp op) override {
      auto w = ForwardingCommunicator::allreduce(send, recv, count, dtype, op);
      w->wait(Millis(60000));
      return w;
    }
  };
  ModelLayout l;
  l.name = "no_rate";
  for (int i = 0; i < 16; ++i)
    l.tensors.push_back({fmt::format("layer{}.weight", i), {4096}, DType::kFloat32, false});
  int before_end = 0;
  std::size_t buckets = 0;
  const Failures f = run_gloo_ranks(1, [&](Communicator& c, int, Failures& fail) {
    DoneAtIssue done(c);
    ReducerOptions o;
    o.bucket_cap_bytes = 32 * 1024;
    o.first_bucket_bytes = 16 * 1024;
    Reducer red(done, l, o);
    BackwardSimOptions so;
    so.compute_gbps = 0;
    const auto bw = simulate_backward(red, done, 0, so);
    red.finalize();
    expect_exact(red, done, 0, "no_rate", fail);
    buckets = red.last_timing().buckets.size();
    for (const auto& b : red.last_timing().buckets)
      if (b.completed < bw.end) ++before_end;
  });
  INFO(describe(f));
  CHECK(f.empty());
  // Every bucket but the last (launched by the last gradient, after which
  // backward ends) was seen complete before backward ended.
  REQUIRE(buckets >= 3);
  CHECK(before_end >= static_cast<int>(buckets) - 1);
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

// --inject-fault corrupt on the stream path (the one NCCL always takes): the
// reducer queues the unflatten or a hook's decompress right after each
// bucket's all_reduce, so a corruption applied at the wait came after the
// gradient had been copied out, and the check passed in about half the runs.
// The fault now lands before the all_reduce call returns.
TEST_CASE("reducer: an injected corrupt fault reaches the checked gradient on both paths",
          "[reducer][monitor]") {
  for (int trial = 0; trial < 3; ++trial)
    for (CompressionHook h : {CompressionHook::kNone, CompressionHook::kFp16})
      for (bool views : {false, true})
        for (bool stream : {false, true}) {
          CAPTURE(trial, compression_hook_name(h), views, stream);
          std::int64_t wrong_on_1 = -1, wrong_on_0 = -1;
          // Ranks as threads, each owning its Gloo communicator (the monitor
          // takes it, with its stream operations).
          auto store = std::make_shared<MemoryStore>();
          Failures f;
          std::mutex f_mutex;
          const auto body = [&](int r) {
            auto c = make_communicator(gloo_rank_options(r, 2, store, 20s));
            MonitorOptions mo;
            mo.rank = r;
            mo.world_rank = r;
            mo.size = 2;
            mo.timeout = 20s;
            Fault fault;
            fault.kind = Fault::Kind::kCorrupt;
            fault.rank = 1;
            mo.faults.push_back(fault);
            MonitoredCommunicator mc(std::move(c), mo);
            auto o = small_options();
            o.hook = h;
            o.gradient_as_bucket_view = views;
            o.stream_path = stream;
            Reducer red(mc, small_layout(), o);
            simulate_backward(red, mc, 0);
            red.finalize();
            const auto chk = check_gradients(red, mc, 0, 1.0, 0, {});
            (r == 1 ? wrong_on_1 : wrong_on_0) = chk.wrong;
            mc.barrier()->wait(20s);
          };
          std::vector<std::thread> threads;
          for (int r = 0; r < 2; ++r)
            threads.emplace_back([&, r] {
              try {
                body(r);
              } catch (const std::exception& e) {
                std::lock_guard<std::mutex> lock(f_mutex);
                f.push_back(fmt::format("rank {} threw: {}", r, e.what()));
              }
            });
          for (auto& t : threads) t.join();
          INFO(describe(f));
          REQUIRE(f.empty());
          CHECK(wrong_on_1 > 0);
          CHECK(wrong_on_0 == 0);
        }
}

// Sparse gradients (nn.Embedding(sparse=True)): reduced as torch's Gloo
// backend reduces a sparse tensor, the embedding between two dense tensors.
namespace {

ModelLayout sparse_layout(DType emb_dtype = DType::kFloat32) {
  ModelLayout l;
  l.name = "test-sparse";
  l.tensors = {{"fc.weight", {16, 8}, DType::kFloat32, false},
               {"emb.weight", {1000, 8}, emb_dtype, true},
               {"out.bias", {8}, DType::kFloat32, false}};
  return l;
}

constexpr std::size_t kEmb = 1;
constexpr std::size_t kRowNumel = 8;

// Rank r's rows in iteration it: duplicates within the rank (7, 100 + r),
// rows shared by every rank (7, 500 + it), rows of its own; rank 1 touches
// nothing in odd iterations (nnz 0).
std::vector<std::int64_t> rows_of(int r, std::uint64_t it) {
  if (r == 1 && it % 2 == 1) return {};
  return {7, 100 + r, 7, 999 - r, static_cast<std::int64_t>(500 + it), 100 + r, 3 * r,
          static_cast<std::int64_t>(20 * it + r)};
}

// Small integers; the world size times them, so the division is exact.
int sparse_k(int r, std::uint64_t it, std::size_t j, std::size_t e) {
  return static_cast<int>((j + 3 * e + 5 * static_cast<std::size_t>(r) + it) % 7) - 3;
}
int dense_k(int r, std::uint64_t it, std::size_t p, std::size_t i) {
  return static_cast<int>((i + 2 * p + 3 * static_cast<std::size_t>(r) + it) % 9) - 4;
}

template <typename T>
std::vector<T> sparse_values(int world, int r, std::uint64_t it) {
  const auto rows = rows_of(r, it);
  std::vector<T> v(rows.size() * kRowNumel);
  for (std::size_t j = 0; j < rows.size(); ++j)
    for (std::size_t e = 0; e < kRowNumel; ++e)
      v[j * kRowNumel + e] = static_cast<T>(world * sparse_k(r, it, j, e));
  return v;
}

// One backward by hand: dense gradients written into grad(p), the sparse one
// handed over, in reverse order. unused: parameters this rank declares unused.
template <typename T>
void sparse_backward(Reducer& red, Communicator& c, std::uint64_t it,
                     const std::vector<std::size_t>& unused = {}) {
  const int world = c.size(), r = c.rank();
  red.prepare_for_backward(unused);
  const auto& ts = red.layout().tensors;
  for (std::size_t p = ts.size(); p-- > 0;) {
    if (std::find(unused.begin(), unused.end(), p) != unused.end()) continue;
    if (ts[p].expects_sparse) {
      const auto rows = rows_of(r, it);
      const auto vals = sparse_values<T>(world, r, it);
      red.set_sparse_grad(p, rows, std::as_bytes(std::span<const T>(vals)));
    } else {
      auto* g = static_cast<float*>(red.grad(p));
      for (std::size_t i = 0; i < static_cast<std::size_t>(ts[p].numel()); ++i)
        g[i] = static_cast<float>(world * dense_k(r, it, p, i));
    }
    red.mark_ready(p);
  }
}

// A sparse parameter's reduced gradient written out as the dense table;
// fails when its rows are not sorted and unique.
template <typename T>
std::vector<T> densify(const Reducer& red, std::size_t p, Failures& fail) {
  const auto& t = red.layout().tensors[p];
  const SparseGrad g = red.sparse_grad(p);
  std::vector<T> dense(static_cast<std::size_t>(t.numel()), T(0));
  if (g.values.size() != g.rows.size() * g.row_numel * sizeof(T))
    fail.push_back(fmt::format("{}: {} value bytes for {} rows", t.name, g.values.size(),
                               g.rows.size()));
  const auto* v = reinterpret_cast<const T*>(g.values.data());
  for (std::size_t j = 0; j < g.rows.size(); ++j) {
    if (j && g.rows[j] <= g.rows[j - 1]) fail.push_back(t.name + ": rows not sorted and unique");
    for (std::size_t e = 0; e < g.row_numel; ++e)
      dense[static_cast<std::size_t>(g.rows[j]) * g.row_numel + e] = v[j * g.row_numel + e];
  }
  return dense;
}

// The densified mean, and every gradient compared element for element; a
// sparse result holds exactly the rows some rank touched.
// used(r, p): whether rank r used p.
template <typename T>
void expect_sparse_exact(const Reducer& red, Communicator& c, std::uint64_t it,
                         const std::string& what, Failures& fail,
                         const std::function<bool(int, std::size_t)>& used = {}) {
  const int world = c.size();
  const auto& ts = red.layout().tensors;
  for (std::size_t p = 0; p < ts.size(); ++p) {
    const auto n = static_cast<std::size_t>(ts[p].numel());
    std::vector<double> want(n, 0);
    for (int r = 0; r < world; ++r) {
      if (used && !used(r, p)) continue;
      if (ts[p].expects_sparse) {
        const auto rows = rows_of(r, it);
        for (std::size_t j = 0; j < rows.size(); ++j)
          for (std::size_t e = 0; e < kRowNumel; ++e)
            want[static_cast<std::size_t>(rows[j]) * kRowNumel + e] += sparse_k(r, it, j, e);
      } else {
        for (std::size_t i = 0; i < n; ++i) want[i] += dense_k(r, it, p, i);
      }
    }
    std::vector<T> sparse_dense;
    if (ts[p].expects_sparse) {
      sparse_dense = densify<T>(red, p, fail);
      std::vector<std::int64_t> touched;
      for (int r = 0; r < world; ++r)
        if (!used || used(r, p))
          for (auto row : rows_of(r, it)) touched.push_back(row);
      std::sort(touched.begin(), touched.end());
      touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
      const auto g = red.sparse_grad(p);
      if (!std::equal(touched.begin(), touched.end(), g.rows.begin(), g.rows.end()))
        fail.push_back(fmt::format("rank {} {} iteration {}: {} rows in the result, {} touched",
                                   c.rank(), what, it, g.rows.size(), touched.size()));
    }
    std::size_t wrong = 0, first = n;
    double have_first = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double have = ts[p].expects_sparse ? static_cast<double>(sparse_dense[i])
                                               : static_cast<const float*>(red.grad(p))[i];
      if (have != want[i]) {
        if (!wrong) first = i, have_first = have;
        ++wrong;
      }
    }
    if (wrong)
      fail.push_back(fmt::format("rank {} {} iteration {}: {} of {} elements of {} wrong, first at "
                                 "{}: {} instead of {}",
                                 c.rank(), what, it, wrong, n, ts[p].name, first, have_first,
                                 want[first]));
  }
}

std::size_t unique_rows(int r, std::uint64_t it) {
  auto rows = rows_of(r, it);
  std::sort(rows.begin(), rows.end());
  return static_cast<std::size_t>(std::unique(rows.begin(), rows.end()) - rows.begin());
}

}  // namespace

TEST_CASE("reducer: a sparse gradient is the densified mean on every rank", "[reducer][sparse]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    for (bool stream : {false, true})
      for (bool views : {true, false})
        for (Averaging avg : {Averaging::kDivideThenSum, Averaging::kAvgOp}) {
          ReducerOptions o;
          // out.bias (32 B) fills the first bucket, so the buckets are
          // [out.bias], [emb.weight], [fc.weight]: dense, sparse, dense.
          o.bucket_cap_bytes = 256;
          o.first_bucket_bytes = 32;
          o.timeout = 20s;
          o.gradient_as_bucket_view = views;
          o.averaging = avg;
          o.stream_path = stream;
          Reducer red(c, sparse_layout(), o);
          const std::string what = fmt::format("views {} avg-op {} stream {}", views,
                                               avg == Averaging::kAvgOp, stream);
          // The embedding alone in its bucket, between the dense ones.
          const auto& eb = red.buckets()[red.bucket_of(kEmb)];
          if (!eb.spec.sparse || eb.spec.param_indices.size() != 1)
            fail.push_back(what + ": the embedding is not alone in a sparse bucket");
          if (red.buckets().size() != 3 || red.bucket_of(2) != 0 || red.bucket_of(kEmb) != 1 ||
              red.bucket_of(0) != 2)
            fail.push_back(what + ": the sparse bucket is not between the dense ones");
          // Iterations 0..3: rank 1 touches nothing in 1 and 3, so rows of
          // iteration 0 must not survive into 1 (buffers re-zeroed).
          for (std::uint64_t it = 0; it < 4; ++it) {
            sparse_backward<float>(red, c, it);
            red.finalize();
            expect_sparse_exact<float>(red, c, it, what, fail);
            const auto& tm = red.last_timing();
            for (const auto& b : tm.buckets)
              if (b.launched < b.ready || b.completed < b.launched)
                fail.push_back(what + ": bucket timestamps out of order");
            const auto& sb = tm.buckets[red.bucket_of(kEmb)];
            std::size_t max_nnz = 0;
            for (int r = 0; r < n; ++r) max_nnz = std::max(max_nnz, unique_rows(r, it));
            const std::uint64_t want_bytes =
                static_cast<std::uint64_t>(n) * (8 + max_nnz * (8 + kRowNumel * 4));
            if (!sb.sparse || sb.payload_bytes != want_bytes)
              fail.push_back(fmt::format("{}: sparse bucket moved {} B, want {} B (max nnz {})",
                                         what, sb.payload_bytes, want_bytes, max_nnz));
            if (sb.payload_bytes >= eb.spec.bytes / 10)
              fail.push_back(what + ": the sparse bucket moved nearly the dense table");
            for (std::size_t b = 0; b < tm.buckets.size(); ++b)
              if (b != red.bucket_of(kEmb) && tm.buckets[b].payload_bytes != red.buckets()[b].spec.bytes)
                fail.push_back(what + ": a dense bucket's payload is not its size");
          }
        }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: sparse float64, with a compression hook (not applied to it)",
          "[reducer][sparse]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    for (CompressionHook h : {CompressionHook::kNone, CompressionHook::kFp16, CompressionHook::kBf16}) {
      ReducerOptions o;
      o.timeout = 20s;
      o.hook = h;
      Reducer red(c, sparse_layout(DType::kFloat64), o);
      for (std::uint64_t it = 0; it < 2; ++it) {
        sparse_backward<double>(red, c, it);
        red.finalize();
        expect_sparse_exact<double>(red, c, it,
                                    fmt::format("float64 hook {}", compression_hook_name(h)), fail);
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: sparse gradients with find_unused_parameters", "[reducer][sparse]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    ReducerOptions o;
    o.timeout = 20s;
    o.find_unused_parameters = true;
    Reducer red(c, sparse_layout(), o);
    // 0: all used; 1: the embedding unused on rank 0; 2: unused everywhere
    // (its rows of iteration 1 must be gone); 3: used again.
    for (std::uint64_t it = 0; it < 4; ++it) {
      auto used = [&](int r, std::size_t p) {
        return p != kEmb || !((it == 1 && r == 0) || it == 2);
      };
      std::vector<std::size_t> unused;
      if (!used(rank, kEmb)) unused.push_back(kEmb);
      sparse_backward<float>(red, c, it, unused);
      red.finalize();
      expect_sparse_exact<float>(red, c, it, "find_unused", fail, used);
      const std::vector<std::size_t> want = it == 2 ? std::vector<std::size_t>{kEmb}
                                                    : std::vector<std::size_t>{};
      if (red.globally_unused() != want)
        fail.push_back(fmt::format("iteration {}: {} globally unused", it,
                                   red.globally_unused().size()));
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: set_sparse_grad misuse is a UsageError naming the parameter",
          "[reducer][sparse]") {
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int, Failures& fail) {
    ReducerOptions o;
    o.timeout = 20s;
    Reducer red(c, sparse_layout(), o);
    auto expect_usage = [&](const char* what, const std::function<void()>& call,
                            std::vector<std::string> wants) {
      try {
        call();
        fail.push_back(std::string(what) + ": no error");
      } catch (const UsageError& e) {
        for (const auto& w : wants)
          if (std::string(e.what()).find(w) == std::string::npos)
            fail.push_back(fmt::format("{}: message lacks '{}': {}", what, w, e.what()));
      }
    };
    const std::vector<std::int64_t> good = {1, 2};
    const std::vector<float> vals(2 * kRowNumel, 1.0f);
    const auto bytes = std::as_bytes(std::span<const float>(vals));
    expect_usage("outside an iteration", [&] { red.set_sparse_grad(kEmb, good, bytes); },
                 {"emb.weight", "outside an iteration"});
    red.prepare_for_backward();
    const std::vector<std::int64_t> out_of_range = {3, 1000};
    expect_usage("row out of range", [&] { red.set_sparse_grad(kEmb, out_of_range, bytes); },
                 {"emb.weight", "row 1000", "[0, 1000)"});
    const std::vector<std::int64_t> negative = {-1, 3};
    expect_usage("negative row", [&] { red.set_sparse_grad(kEmb, negative, bytes); },
                 {"emb.weight", "row -1"});
    expect_usage("dense parameter", [&] { red.set_sparse_grad(0, good, bytes); },
                 {"fc.weight", "dense gradient"});
    expect_usage("values size", [&] { red.set_sparse_grad(kEmb, good, bytes.first(60)); },
                 {"emb.weight", "64", "60"});
    expect_usage("grad of a sparse parameter", [&] { (void)red.grad(kEmb); },
                 {"emb.weight", "sparse gradient", "sparse_grad()"});
    expect_usage("sparse_grad of a dense parameter", [&] { (void)red.sparse_grad(0); },
                 {"fc.weight", "dense gradient"});
    // Nothing of the refused calls was kept: the embedding gets rows 1 and 2
    // only (twice: two calls add up), then the iteration completes.
    red.set_sparse_grad(kEmb, good, bytes);
    red.set_sparse_grad(kEmb, good, bytes);
    for (std::size_t p = 3; p-- > 0;) red.mark_ready(p);
    expect_usage("after mark_ready", [&] { red.set_sparse_grad(kEmb, good, bytes); },
                 {"emb.weight", "already marked ready"});
    red.finalize();
    const auto g = densify<float>(red, kEmb, fail);
    if (red.sparse_grad(kEmb).rows.size() != 2) fail.push_back("expected rows 1 and 2 only");
    // Each rank: 2 * 1.0 per element of rows 1 and 2, divided by 2, summed
    // over the 2 ranks: 2.
    for (std::size_t i = 0; i < 1000 * kRowNumel; ++i) {
      const std::size_t row = i / kRowNumel;
      const float want = row == 1 || row == 2 ? 2.0f : 0.0f;
      if (g[i] != want) {
        fail.push_back(fmt::format("element {}: {} instead of {}", i, g[i], want));
        break;
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: a sparse table is never allocated densely", "[reducer][sparse]") {
  // 5 M rows of 64 floats (1.28 GB) beside a small dense tensor: the
  // reducer's buffers are the dense bucket and the touched rows only, with
  // views on and off.
  ModelLayout l;
  l.name = "test-huge-embedding";
  l.tensors = {{"fc.weight", {16, 8}, DType::kFloat32, false},
               {"emb.weight", {5'000'000, 64}, DType::kFloat32, true}};
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    for (bool views : {true, false}) {
      MemoryAccount account(c);
      AccountingCommunicator ac(c, account, MemoryCategory::kBuckets);
      ReducerOptions o;
      o.timeout = 20s;
      o.gradient_as_bucket_view = views;
      Reducer red(ac, l, o);
      BackwardSimOptions so;
      so.sparse_rows = 1000;
      simulate_backward(red, ac, 0, so);
      red.finalize();
      const auto chk = check_gradients(red, ac, 0, 1.0, 0, {}, so.sparse_rows);
      if (chk.wrong) fail.push_back(fmt::format("views {}: {} wrong", views, chk.wrong));
      const std::uint64_t peak = account.total_peak_bytes();
      if (peak > 16u << 20)
        fail.push_back(fmt::format("rank {} views {}: the reducer's peak is {} bytes", rank, views,
                                   peak));
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: launching a sparse bucket does not wait for a late peer", "[reducer][sparse]") {
  // Dense buckets on both sides of the sparse one (out.weight, over the
  // first bucket's 1 MiB, closes bucket 0 before the embedding is reached in
  // reverse order). Rank 1 reaches the embedding's gradient 1 s late: rank
  // 0's mark_ready of the embedding returns at once (only the nnz allgather
  // goes out), and the index and value allgathers follow before the next
  // bucket's all_reduce, which is where rank 0 waits.
  ModelLayout l;
  l.name = "test-sparse-middle";
  l.tensors = {{"fc.weight", {16, 8}, DType::kFloat32, false},
               {"emb.weight", {100, 4}, DType::kFloat32, true},
               {"out.weight", {300000}, DType::kFloat32, false}};
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    ReducerOptions o;
    o.timeout = 20s;
    Reducer red(c, l, o);
    if (red.buckets().size() != 3 || red.bucket_of(1) != 1) {
      fail.push_back("expected three buckets with the embedding's in the middle");
      return;
    }
    red.prepare_for_backward();
    std::fill_n(static_cast<float*>(red.grad(2)), 300000, 2.0f);
    red.mark_ready(2);
    if (rank == 1) std::this_thread::sleep_for(1000ms);
    const std::vector<std::int64_t> rows = {rank, 50};
    const std::vector<float> vals(8, static_cast<float>(2 * (rank + 1)));  // world * (rank + 1)
    red.set_sparse_grad(1, rows, std::as_bytes(std::span<const float>(vals)));
    const auto t0 = std::chrono::steady_clock::now();
    red.mark_ready(1);
    const auto took = std::chrono::steady_clock::now() - t0;
    if (rank == 0 && took > 500ms)
      fail.push_back(fmt::format("rank 0's mark_ready of the sparse parameter took {} ms",
                                 std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
    std::fill_n(static_cast<float*>(red.grad(0)), 16 * 8, 2.0f);
    red.mark_ready(0);
    red.finalize();
    // Means: row 0 gets rank 0's 1, row 1 rank 1's 2, row 50 both (3).
    const auto emb = densify<float>(red, 1, fail);
    for (int row = 0; row < 100; ++row)
      for (int e = 0; e < 4; ++e) {
        const float want = row == 0 ? 1.0f : row == 1 ? 2.0f : row == 50 ? 3.0f : 0.0f;
        if (emb[row * 4 + e] != want) {
          fail.push_back(fmt::format("rank {}: emb[{}][{}] = {}, want {}", rank, row, e,
                                     emb[row * 4 + e], want));
          return;
        }
      }
    if (static_cast<const float*>(red.grad(0))[5] != 2.0f ||
        static_cast<const float*>(red.grad(2))[299999] != 2.0f)
      fail.push_back(fmt::format("rank {}: a dense gradient is not the mean", rank));
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: sparse parameters of an unsupported dtype are refused at construction",
          "[reducer][sparse]") {
  const Failures f = run_gloo_ranks(1, [&](Communicator& c, int, Failures& fail) {
    try {
      Reducer red(c, sparse_layout(DType::kFloat16), {});
      fail.push_back("a float16 sparse parameter was accepted");
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("emb.weight") == std::string::npos)
        fail.push_back(std::string("no name in ") + e.what());
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: the backward simulator's sparse gradients check exactly",
          "[reducer][sparse]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int, Failures& fail) {
    for (std::optional<std::int64_t> rows : {std::optional<std::int64_t>{},
                                              std::optional<std::int64_t>{0},
                                              std::optional<std::int64_t>{37},
                                              std::optional<std::int64_t>{3000}})
      for (bool views : {true, false}) {
        // With compute time the simulator polls the reducer between
        // gradients, which issues the sparse bucket's second stage early.
        for (double gbps : {0.0, 0.05}) {
          ReducerOptions o;
          o.timeout = 20s;
          o.gradient_as_bucket_view = views;
          Reducer red(c, sparse_layout(), o);
          BackwardSimOptions so;
          so.sparse_rows = rows;
          so.compute_gbps = gbps;
          const std::string what =
              fmt::format("sparse_rows {} views {} compute {} GB/s", rows ? *rows : -1, views,
                          gbps);
          for (std::uint64_t it = 0; it < 2; ++it) {
            simulate_backward(red, c, it, so);
            red.finalize();
            const auto chk = check_gradients(red, c, it, 1.0, 0, {}, rows);
            if (chk.wrong)
              fail.push_back(fmt::format("rank {} {}: {} of {} wrong", c.rank(), what, chk.wrong,
                                         chk.checked));
            // The checker is not vacuous: another row count expects other rows.
            if (rows && *rows == 37 &&
                check_gradients(red, c, it, 1.0, 0, {}, std::int64_t{36}).wrong == 0)
              fail.push_back(what + ": the check accepts the wrong rows");
          }
          // The rows: as many as asked (default min(1000, 512)), repeating.
          const auto r0 =
              sim_sparse_rows(sparse_layout().tensors[kEmb], c.rank(), kEmb, 0, rows);
          const std::size_t want = rows ? static_cast<std::size_t>(*rows) : 512;
          if (r0.size() != want) fail.push_back(what + ": wrong number of rows");
          const auto& sb = red.last_timing().buckets[red.bucket_of(kEmb)];
          if (!(sb.launched <= sb.completed && sb.completed <= red.last_timing().finalize_end))
            fail.push_back(what + ": the sparse bucket's times are out of order");
        }
      }
    BackwardSimOptions bad;
    bad.sparse_rows = -1;
    Reducer red(c, sparse_layout(), {});
    try {
      simulate_backward(red, c, 0, bad);
      fail.push_back("sparse_rows -1 accepted");
    } catch (const UsageError&) {
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

// --- Deadlines: each bucket's own, not one for the whole finalize ----------

namespace {

// Ten tensors of 4 KiB with a 4 KiB cap: ten buckets, one all_reduce each.
ModelLayout ten_bucket_layout() {
  ModelLayout l;
  l.name = "ten-buckets";
  for (int i = 0; i < 10; ++i)
    l.tensors.push_back({fmt::format("l{}.weight", i), {1024}, DType::kFloat32, false});
  return l;
}

ReducerOptions ten_bucket_options(bool find_unused) {
  ReducerOptions o;
  o.bucket_cap_bytes = 4096;
  o.first_bucket_bytes = 4096;
  o.find_unused_parameters = find_unused;
  o.timeout = 300ms;
  return o;
}

}  // namespace

TEST_CASE("reducer: buckets that each complete within the timeout pass however long "
          "finalize takes",
          "[reducer]") {
  // 60 ms an all_reduce, one after another: 600 ms for the buckets (660 ms
  // with the used-parameter all_reduce) against a 300 ms timeout.
  const bool find_unused = GENERATE(false, true);
  CAPTURE(find_unused);
  const Failures f = run_gloo_ranks(2, [&](Communicator& gloo, int rank, Failures& fail) {
    test::PacedCommunicator c(gloo, 60ms);
    Reducer red(c, ten_bucket_layout(), ten_bucket_options(find_unused));
    if (red.buckets().size() != 10) {
      fail.push_back(fmt::format("{} buckets, not 10", red.buckets().size()));
      return;
    }
    const auto t0 = test::PacedCommunicator::Clock::now();
    simulate_backward(red, c, 0);
    try {
      red.finalize();
      expect_exact(red, c, 0, "paced", fail);
    } catch (const std::exception& e) {
      fail.push_back(fmt::format("rank {}: after {:.0f} ms: {}", rank, test::ms_since(t0),
                                 e.what()));
    }
    const double took = test::ms_since(t0);
    if (took < 600) fail.push_back(fmt::format("rank {}: took only {:.0f} ms", rank, took));
    if (c.aborts()) fail.push_back(fmt::format("rank {}: the backend was aborted", rank));
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: a bucket that never completes times out a timeout after the one before it",
          "[reducer]") {
  // Bucket 6's all_reduce stalls. Bucket 5's completes 360 ms in at the
  // earliest, so bucket 6 cannot time out before 660 ms; it must not go
  // unreported much longer.
  const Failures f = run_gloo_ranks(2, [&](Communicator& gloo, int rank, Failures& fail) {
    {
      test::PacedCommunicator c(gloo, 60ms, 6);
      Reducer red(c, ten_bucket_layout(), ten_bucket_options(false));
      const auto t0 = test::PacedCommunicator::Clock::now();
      simulate_backward(red, c, 0);
      try {
        red.finalize();
        fail.push_back(fmt::format("rank {}: the stalled bucket went unreported", rank));
      } catch (const TimeoutError& e) {
        const double took = test::ms_since(t0);
        const std::string m = e.what();
        if (m.find("all_reduce of bucket 6 ") == std::string::npos ||
            m.find("paced op 6:") == std::string::npos)
          fail.push_back(fmt::format("rank {}: not the stalled bucket's error: {}", rank, m));
        if (took < 660 || took > 660 + 2000)
          fail.push_back(fmt::format("rank {}: reported after {:.0f} ms, not 660 ms and a little",
                                     rank, took));
        if (e.context().phase != "reducer.finalize") fail.push_back("phase " + e.context().phase);
      }
      // The stalled all_reduce is still outstanding: the backend is stopped.
      if (c.aborts() < 1)
        fail.push_back(fmt::format("rank {}: the backend was not aborted", rank));
    }
    gloo.barrier()->wait(20s);  // the Gloo ops underneath, done on every rank
  });
  INFO(describe(f));
  CHECK(f.empty());
}

namespace {

std::vector<std::vector<std::size_t>> bucket_params(const std::vector<ReducerBucket>& bs) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& b : bs) out.push_back(b.spec.param_indices);
  return out;
}

std::vector<std::vector<std::size_t>> bucket_params(const std::vector<DdpBucket>& bs) {
  std::vector<std::vector<std::size_t>> out;
  for (const auto& b : bs) out.push_back(b.param_indices);
  return out;
}

std::string show(const std::vector<std::vector<std::size_t>>& bs) {
  std::string s;
  for (const auto& b : bs) {
    s += "[";
    for (std::size_t i = 0; i < b.size(); ++i) s += (i ? " " : "") + std::to_string(b[i]);
    s += "]";
  }
  return s;
}

}  // namespace

TEST_CASE("reducer: rebuild_buckets runs DDP's first-iteration buckets, then rebuilds them from "
          "rank 0's gradient order",
          "[reducer]") {
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  // Rank 0 makes the gradients ready in one order, the other ranks in
  // others: the rebuilt buckets are rank 0's on every rank.
  const std::vector<std::size_t> rank0_order = {7, 5, 6, 3, 4, 1, 2, 0};
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    for (bool stream : {false, true})
      for (bool views : {true, false})
        for (bool set_last : {false, true}) {
          auto layout = small_layout();
          layout.tensors[3].dtype = DType::kFloat64;  // two dtypes
          layout.ready_order = rank0_order;
          if (rank == 1) std::reverse(layout.ready_order.begin(), layout.ready_order.end());
          if (rank == 2) layout.ready_order = {0, 1, 2, 3, 4, 5, 6, 7};
          auto o = small_options();
          o.rebuild_buckets = true;
          o.gradient_as_bucket_view = views;
          o.stream_path = stream;
          o.set_last_bucket_small = set_last;
          const auto limits = ddp_bucket_limits(o.bucket_cap_bytes, o.first_bucket_bytes);
          Reducer red(c, layout, o);
          const std::string what =
              fmt::format("rank {} stream {} views {} set_last {}", rank, stream, views, set_last);
          // One bucket per dtype, in registration order reversed.
          const auto first = bucket_params(ddp_buckets_first_iteration(layout, limits, false, false, false));
          auto rank0_layout = layout;
          rank0_layout.ready_order = rank0_order;
          const auto rebuilt = bucket_params(ddp_buckets(rank0_layout, limits, set_last));
          if (bucket_params(ddp_buckets_rebuilt_from(layout, rank0_order, limits, set_last)) != rebuilt)
            fail.push_back(what + ": ddp_buckets_rebuilt_from differs from ddp_buckets");
          if (first.size() != 2) fail.push_back(what + ": expected one first-iteration bucket per dtype");
          for (std::uint64_t it = 0; it < 4; ++it) {
            simulate_backward(red, c, it);
            red.finalize();
            expect_exact(red, c, it, what, fail);
            const auto& want = it == 0 ? first : rebuilt;
            if (bucket_params(red.buckets()) != want)
              fail.push_back(fmt::format("{} iteration {}: buckets {} instead of {}", what, it,
                                         show(bucket_params(red.buckets())), show(want)));
            if (red.last_timing().buckets.size() != want.size())
              fail.push_back(fmt::format("{} iteration {}: {} bucket timings", what, it,
                                         red.last_timing().buckets.size()));
            const auto at = red.rebuilt_before_iteration();
            if (it == 0 ? at.has_value() : at != std::optional<std::uint64_t>(1))
              fail.push_back(fmt::format("{} iteration {}: rebuilt_before_iteration {}", what, it,
                                         at ? std::to_string(*at) : "none"));
          }
          if (red.rebuild_order() != rank0_order) fail.push_back(what + ": rebuild_order is not rank 0's");
        }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: rebuild_buckets with static_graph rebuilds after the second iteration, with "
          "find_unused_parameters never",
          "[reducer]") {
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    for (bool views : {true, false}) {
      // static_graph: big.bias (2) never reached; the ranks' orders differ.
      {
        auto layout = small_layout();
        layout.ready_order = rank == 0 ? std::vector<std::size_t>{6, 7, 5, 4, 3, 1, 0}
                                       : std::vector<std::size_t>{0, 1, 3, 4, 5, 6, 7};
        auto o = small_options();
        o.rebuild_buckets = true;
        o.static_graph = true;
        o.gradient_as_bucket_view = views;
        const auto limits = ddp_bucket_limits(o.bucket_cap_bytes, o.first_bucket_bytes);
        Reducer red(c, layout, o);
        auto rank0_layout = layout;
        rank0_layout.ready_order = {6, 7, 5, 4, 3, 1, 0};
        const auto first = bucket_params(ddp_buckets_first_iteration(layout, limits, false, true, false));
        const auto rebuilt = bucket_params(ddp_buckets_static_graph(rank0_layout, limits));
        auto unused_on = [](int, std::size_t p) { return p == 2; };
        for (std::uint64_t it = 0; it < 4; ++it) {
          iteration_without(red, c, rank, it, true, unused_on);
          expect_exact(red, c, it, "static_graph", fail, [&](int r, std::size_t p) { return !unused_on(r, p); });
          const auto& want = it < 2 ? first : rebuilt;
          if (bucket_params(red.buckets()) != want)
            fail.push_back(fmt::format("static_graph views {} iteration {}: buckets {} instead of {}", views, it,
                                       show(bucket_params(red.buckets())), show(want)));
        }
        if (red.rebuilt_before_iteration() != std::optional<std::uint64_t>(2))
          fail.push_back("static_graph: not rebuilt before iteration 2");
      }
      // find_unused_parameters: the constructor's buckets for good.
      {
        auto o = small_options();
        o.rebuild_buckets = true;
        o.find_unused_parameters = true;
        o.gradient_as_bucket_view = views;
        const auto limits = ddp_bucket_limits(o.bucket_cap_bytes, o.first_bucket_bytes);
        Reducer red(c, small_layout(), o);
        const auto want = bucket_params(ddp_buckets_unrebuilt(small_layout(), limits));
        for (std::uint64_t it = 0; it < 3; ++it) {
          simulate_backward(red, c, it);
          red.finalize();
          expect_exact(red, c, it, "find_unused", fail);
          if (bucket_params(red.buckets()) != want)
            fail.push_back(fmt::format("find_unused iteration {}: buckets {}", it, show(bucket_params(red.buckets()))));
        }
        if (red.rebuilt_before_iteration()) fail.push_back("find_unused: rebuilt");
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("reducer: rebuild_buckets keeps a sparse parameter's reduced gradient, and refuses "
          "first_iteration_buckets beside it",
          "[reducer][sparse]") {
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    auto layout = small_layout();
    layout.tensors[0].expects_sparse = true;  // emb.weight
    auto o = small_options();
    o.rebuild_buckets = true;
    Reducer red(c, layout, o);
    simulate_backward(red, c, 0);
    red.finalize();
    expect_exact(red, c, 0, "sparse, first iteration", fail);
    const SparseGrad g0 = red.sparse_grad(0);
    const std::vector<std::int64_t> rows(g0.rows.begin(), g0.rows.end());
    const std::vector<std::byte> values(g0.values.begin(), g0.values.end());
    // The rebuild happens in the next prepare_for_backward: the gradient of
    // iteration 0 is still there until that iteration's sparse bucket is
    // reduced.
    red.prepare_for_backward();
    if (!red.rebuilt_before_iteration()) fail.push_back("sparse: not rebuilt");
    const SparseGrad g1 = red.sparse_grad(0);
    if (std::vector<std::int64_t>(g1.rows.begin(), g1.rows.end()) != rows ||
        std::vector<std::byte>(g1.values.begin(), g1.values.end()) != values)
      fail.push_back("sparse: the reduced gradient did not survive the rebuild");
    for (std::size_t p : red.layout().gradient_ready_order()) red.mark_ready(p);
    red.finalize();
    o.first_iteration_buckets = true;
    try {
      Reducer bad(c, layout, o);
      fail.push_back(fmt::format("rank {}: rebuild_buckets with first_iteration_buckets accepted", rank));
    } catch (const UsageError& e) {
      if (std::string(e.what()).find("exclude each other") == std::string::npos)
        fail.push_back(std::string("unexpected message: ") + e.what());
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("ddp_buckets_rebuilt_from refuses an order that is not a permutation of the trainable "
          "parameters",
          "[buckets]") {
  const auto layout = small_layout();
  const auto limits = ddp_bucket_limits(1024, 256);
  CHECK_THROWS_WITH(ddp_buckets_rebuilt_from(layout, std::vector<std::size_t>{7, 6, 5}, limits),
                    Catch::Contains("lists 3 of the 8 trainable parameters"));
  CHECK_THROWS_WITH(ddp_buckets_rebuilt_from(layout, std::vector<std::size_t>{7, 7, 6, 5, 4, 3, 2, 1}, limits),
                    Catch::Contains("parameter index 7 twice"));
  CHECK_THROWS_WITH(ddp_buckets_rebuilt_from(layout, std::vector<std::size_t>{8, 6, 5, 4, 3, 2, 1, 0}, limits),
                    Catch::Contains("outside the layout"));
}
