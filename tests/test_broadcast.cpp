// Coalesced parameter broadcast and the checksum verdict, ranks as threads
// over Gloo: ranks start with different parameters and end bit-identical to
// rank 0's; a rank corrupted afterwards is named with the tensor.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "ddp_core/param_broadcast.h"
#include "tests/forwarding_communicator.h"
#include "tests/paced_communicator.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using namespace ddpdiag::ddp_core;
using namespace ddpdiag::testing;
using namespace std::chrono_literals;

namespace {

ModelLayout bcast_layout() {
  ModelLayout l;
  l.name = "bcast";
  l.tensors = {{"a.weight", {300}, DType::kFloat32, false},
               {"a.bias", {3}, DType::kFloat32, false},
               {"b.weight", {5000}, DType::kFloat32, false},  // 20000 B: over a 4 KiB chunk
               {"b.running_mean", {17}, DType::kFloat64, false},
               {"c.weight", {129}, DType::kFloat16, false},
               {"c.num_batches_tracked", {}, DType::kInt64, false},
               {"d.weight", {777}, DType::kFloat32, false}};
  return l;
}

void fill_rank(std::uint8_t* p, std::uint64_t bytes, int rank, std::size_t tensor) {
  for (std::uint64_t i = 0; i < bytes; ++i)
    p[i] = static_cast<std::uint8_t>(i * 31 + tensor * 7 + static_cast<std::uint64_t>(rank) * 101 + 1);
}

}  // namespace

TEST_CASE("broadcast: checksum64 tells apart what differs", "[broadcast]") {
  std::vector<std::uint8_t> a(1000);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<std::uint8_t>(i);
  auto b = a;
  CHECK(checksum64(a.data(), a.size()) == checksum64(b.data(), b.size()));
  for (std::size_t at : {0u, 7u, 31u, 32u, 500u, 999u}) {
    b = a;
    b[at] ^= 1;
    CHECK(checksum64(a.data(), a.size()) != checksum64(b.data(), b.size()));
  }
  CHECK(checksum64(a.data(), 999) != checksum64(a.data(), 1000));
  CHECK(checksum64(a.data(), 0) != checksum64(a.data(), 1));
  CHECK(checksum64(a.data(), 16, 1) != checksum64(a.data(), 16, 2));
}

TEST_CASE("broadcast: ranks end bit-identical to rank 0, contiguous and scattered tensors",
          "[broadcast]") {
  const int n = GENERATE(2, 3, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    const ModelLayout l = bcast_layout();
    for (std::uint64_t chunk : {std::uint64_t{4096}, std::uint64_t{1000}, kDefaultBroadcastChunkBytes}) {
      for (bool contiguous : {true, false}) {
        const std::string what = fmt::format("chunk {} contiguous {}", chunk, contiguous);
        LayoutParams lp;
        std::vector<CommBuffer> own;  // scattered: one allocation per tensor
        if (contiguous) {
          lp = allocate_layout_params(c, l);
        } else {
          for (const auto& t : l.tensors) {
            own.emplace_back(c, t.bytes());
            lp.tensors.push_back({t.name, own.back().get(), t.bytes(), t.dtype});
          }
        }
        for (std::size_t i = 0; i < lp.tensors.size(); ++i)
          fill_rank(static_cast<std::uint8_t*>(lp.tensors[i].data), lp.tensors[i].bytes, rank, i);
        if (n > 1) {
          const auto before = verify_identical(c, lp.tensors);
          if (before.identical) fail.push_back(what + ": ranks agreed before the broadcast");
          if (before.differing_ranks.size() != static_cast<std::size_t>(n - 1))
            fail.push_back(what + ": before: " + before.describe());
        }
        BroadcastOptions o;
        o.chunk_bytes = chunk;
        o.timeout = 20s;
        const auto st = broadcast_parameters(c, lp.tensors, o);
        if (st.bytes != l.total_bytes()) fail.push_back(what + ": bytes broadcast");
        // 4 KiB, as torch groups: [a.weight, a.bias, b.weight] (closed once
        // it reached the cap) and one chunk each for the other dtypes and
        // d.weight, which opens the next float32 chunk.
        if (chunk == 4096 && st.chunks != 5) fail.push_back(what + ": chunks " + std::to_string(st.chunks));
        std::size_t scattered = 0;
        for (const auto& ch : broadcast_chunks(lp.tensors, chunk)) scattered += ch.contiguous ? 0 : 1;
        if (st.staged_chunks != scattered) fail.push_back(what + ": staged chunks");
        if (contiguous && chunk == 4096 && st.staged_chunks) fail.push_back(what + ": staged a contiguous chunk");
        if (!contiguous && !st.staged_chunks) fail.push_back(what + ": no staging");
        std::vector<std::uint8_t> want;
        for (std::size_t i = 0; i < lp.tensors.size(); ++i) {
          want.resize(lp.tensors[i].bytes);
          fill_rank(want.data(), want.size(), 0, i);
          if (std::memcmp(want.data(), lp.tensors[i].data, want.size()) != 0)
            fail.push_back(fmt::format("rank {} {}: tensor {} differs from rank 0's", rank, what,
                                       lp.tensors[i].name));
        }
        const auto v = verify_identical(c, lp.tensors);
        if (!v.identical) fail.push_back(what + ": " + v.describe());
      }
    }
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: chunks are torch's _broadcast_coalesced groups", "[broadcast]") {
  // Each case as torch 1.13 and 2.x broadcast it (traced with a process
  // group that records every broadcast): per dtype, a chunk closes once it
  // reaches the cap, and chunks go out in the order of their first tensor.
  constexpr std::uint64_t KiB = 1024, MiB = 1024 * 1024;
  using F = DType;
  struct Case {
    std::vector<std::pair<std::uint64_t, DType>> tensors;
    std::vector<std::vector<std::size_t>> want;
  };
  const std::vector<Case> cases = {
      // The tensor that crosses the cap stays in the chunk (not 4 chunks).
      {{{600 * KiB, F::kFloat32}, {600 * KiB, F::kFloat32}, {600 * KiB, F::kFloat32}, {600 * KiB, F::kFloat32}},
       {{0, 1}, {2, 3}}},
      // Reaching the cap exactly closes it.
      {{{512 * KiB, F::kFloat32}, {512 * KiB, F::kFloat32}, {512 * KiB, F::kFloat32}, {512 * KiB, F::kFloat32}},
       {{0, 1}, {2, 3}}},
      // Dtypes fill side by side.
      {{{400 * KiB, F::kFloat32}, {400 * KiB, F::kFloat16}, {400 * KiB, F::kFloat32}, {400 * KiB, F::kFloat16},
        {400 * KiB, F::kFloat32}, {8, F::kInt64}},
       {{0, 2, 4}, {1, 3}, {5}}},
      // Ordered by first tensor, not by closing.
      {{{8, F::kFloat16}, {2 * MiB, F::kFloat32}, {8, F::kFloat16}, {8, F::kFloat32}}, {{0, 2}, {1}, {3}}},
      {{{8, F::kInt64}, {8, F::kFloat32}}, {{0}, {1}}},
      // Empty tensors join their dtype's open chunk, or open one.
      {{{8, F::kInt64}, {8, F::kFloat32}, {0, F::kFloat32}, {MiB, F::kFloat16}, {0, F::kFloat16}, {4, F::kFloat32}},
       {{0}, {1, 2, 5}, {3}, {4}}},
  };
  for (std::size_t k = 0; k < cases.size(); ++k) {
    CAPTURE(k);
    std::vector<ParamTensor> ts;
    for (const auto& [bytes, dtype] : cases[k].tensors) ts.push_back({"t", nullptr, bytes, dtype});
    std::vector<std::vector<std::size_t>> got;
    for (const auto& c : broadcast_chunks(ts, MiB)) {
      got.push_back(c.tensors);
      std::uint64_t bytes = 0;
      for (auto i : c.tensors) {
        bytes += ts[i].bytes;
        CHECK(ts[i].dtype == c.dtype);
      }
      CHECK(bytes == c.bytes);
    }
    CHECK(got == cases[k].want);
  }
  CHECK_THROWS_AS(broadcast_chunks(std::vector<ParamTensor>{{"t", nullptr, 4}}, 0), UsageError);
}

TEST_CASE("broadcast: a root whose own copy went bad is the odd one, not every other rank",
          "[broadcast]") {
  const int n = 4;
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    const ModelLayout l = bcast_layout();
    auto lp = allocate_layout_params(c, l);
    for (std::size_t i = 0; i < lp.tensors.size(); ++i)
      fill_rank(static_cast<std::uint8_t*>(lp.tensors[i].data), lp.tensors[i].bytes, rank, i);
    broadcast_parameters(c, lp.tensors);
    if (rank == 0) static_cast<std::uint8_t*>(lp.tensors[4].data)[100] ^= 0x10;  // c.weight
    const auto v = verify_identical(c, lp.tensors);
    if (!v.root_is_odd || v.differing_ranks != std::vector<int>{0})
      fail.push_back(fmt::format("rank {}: root not named: {}", rank, v.describe()));
    const auto d = v.describe();
    if (d.find("rank 0 (the root) differs from all 3 other ranks") == std::string::npos ||
        d.find("c.weight") == std::string::npos)
      fail.push_back("describe(): " + d);
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: a corrupted rank is named with the tensor", "[broadcast]") {
  const int n = GENERATE(2, 4);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& c, int rank, Failures& fail) {
    const ModelLayout l = bcast_layout();
    auto lp = allocate_layout_params(c, l);
    for (std::size_t i = 0; i < lp.tensors.size(); ++i)
      fill_rank(static_cast<std::uint8_t*>(lp.tensors[i].data), lp.tensors[i].bytes, rank, i);
    broadcast_parameters(c, lp.tensors);
    const int bad = n - 1;
    if (rank == bad) static_cast<std::uint8_t*>(lp.tensors[4].data)[100] ^= 0x10;  // c.weight
    const auto v = verify_identical(c, lp.tensors);
    if (v.identical) fail.push_back("corruption not detected");
    if (v.differing_ranks != std::vector<int>{bad})
      fail.push_back(fmt::format("rank {}: differing ranks wrong: {}", rank, v.describe()));
    if (v.mismatches.size() != 1 || v.mismatches[0].name != "c.weight" ||
        v.mismatches[0].tensor != 4)
      fail.push_back(fmt::format("rank {}: mismatch not named: {}", rank, v.describe()));
    const auto d = v.describe();
    // With two ranks nobody can tell which copy went bad: both are named.
    const std::string who = n == 2 ? "ranks 0 and 1 hold different values" : fmt::format("rank {}", bad);
    if (d.find(who) == std::string::npos || d.find("c.weight") == std::string::npos)
      fail.push_back("describe(): " + d);
  });
  INFO(describe(f));
  CHECK(f.empty());
}

// --- Checked series: every rank against the root's known values -----------

namespace {

class DoneWork final : public Work {
 public:
  bool is_completed() override { return true; }
  void wait(Millis) override {}
  void abort() override {}
};

// A Gloo communicator whose broadcast path goes wrong on purpose: after the
// first `deliver` broadcasts it delivers nothing (every rank skips the call,
// so the ranks stay in step), or the root's own buffer is altered before it
// is sent (every rank, the root too, then holds the same wrong bytes).
// device: says its memory is the device's, so fills and checks go through
// copy_to_host/copy_from_host.
class BrokenBroadcast final : public test::ForwardingCommunicator {
 public:
  BrokenBroadcast(Communicator& inner, int deliver, bool corrupt_root, bool device = false)
      : ForwardingCommunicator(inner), deliver_(deliver), corrupt_root_(corrupt_root), device_(device) {}
  MemoryKind memory_kind() const override { return device_ ? MemoryKind::kDevice : MemoryKind::kHost; }
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    if (deliver_ >= 0 && broadcasts_++ >= deliver_) return std::make_shared<DoneWork>();
    if (corrupt_root_ && rank() == root && count > 0) static_cast<std::uint8_t*>(buf)[count / 2] ^= 0x24;
    return ForwardingCommunicator::broadcast(buf, count, dtype, root);
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) override {
    ++copies_;
    ForwardingCommunicator::copy_to_host(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) override {
    ++copies_;
    ForwardingCommunicator::copy_from_host(dst, src, bytes);
  }
  int copies() const { return copies_; }

 private:
  int deliver_;  // broadcasts delivered before the rest do nothing; -1: all
  bool corrupt_root_;
  bool device_;
  int broadcasts_ = 0;
  int copies_ = 0;
};

BroadcastSeriesOptions series_options(std::uint64_t chunk, int warmup, int iters) {
  BroadcastSeriesOptions o;
  o.broadcast.chunk_bytes = chunk;
  o.broadcast.timeout = 20s;
  o.warmup = warmup;
  o.iters = iters;
  return o;
}

}  // namespace

TEST_CASE("broadcast: start patterns differ for every rank and tensor, with no period in the rank",
          "[broadcast]") {
  const std::vector<ParamTensor> ts = {{"a", nullptr, 4096}, {"b", nullptr, 13}, {"c", nullptr, 0}};
  std::vector<std::uint8_t> a(4096), b(4096);
  for (int r : {0, 1, 255, 256, 257, 4095, 65536}) {
    fill_start_pattern(a.data(), a.size(), r, 0);
    for (int q : {0, 1, 255, 256, 257, 4095, 65536}) {
      if (q == r) continue;
      fill_start_pattern(b.data(), b.size(), q, 0);
      CAPTURE(r, q);
      CHECK(a != b);
      CHECK(start_pattern_checksums(ts, r)[0] != start_pattern_checksums(ts, q)[0]);
    }
    fill_start_pattern(b.data(), b.size(), r, 1);
    CHECK(a != b);  // tensors differ too
  }
  // Deterministic, and the checksums are those of the bytes.
  fill_start_pattern(a.data(), 13, 7, 1);
  fill_start_pattern(b.data(), 13, 7, 1);
  CHECK(std::memcmp(a.data(), b.data(), 13) == 0);
  CHECK(start_pattern_checksums(ts, 7)[1] == checksum64(a.data(), 13));
  CHECK(start_pattern_checksums(ts, 7)[2] == checksum64(nullptr, 0));
}

TEST_CASE("broadcast: a checked series passes when every broadcast delivers", "[broadcast]") {
  const int n = GENERATE(1, 2, 3);
  const bool device = GENERATE(false, true);
  CAPTURE(n, device);
  const Failures f = run_gloo_ranks(n, [&](Communicator& gloo, int rank, Failures& fail) {
    BrokenBroadcast c(gloo, -1, false, device);
    auto lp = allocate_layout_params(c, bcast_layout());
    const auto expected = start_pattern_checksums(lp.tensors, 0);
    const auto s = broadcast_series(c, lp.tensors, expected, series_options(4096, 1, 3));
    if (!s.verdict.identical) fail.push_back(fmt::format("rank {}: {}", rank, s.verdict.describe()));
    if (s.times_us.size() != 3 || s.check_us.size() != 4 || s.verdict.iterations != 4)
      fail.push_back(fmt::format("rank {}: {} times, {} checks", rank, s.times_us.size(), s.check_us.size()));
    if (s.stats.chunks != 5) fail.push_back(fmt::format("rank {}: {} chunks", rank, s.stats.chunks));
    if (device && c.copies() == 0) fail.push_back("device memory not reached through copies");
    if (tensor_checksums(c, lp.tensors) != expected) fail.push_back(fmt::format("rank {}: final values", rank));
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: a broadcast that delivers nothing after the first iteration is caught",
          "[broadcast]") {
  // The old proof filled once and compared with the root's checksums after
  // the last broadcast: after the first broadcast every rank held the root's
  // bytes, so broadcasts that did nothing later still passed.
  const int n = GENERATE(2, 3);
  const bool device = GENERATE(false, true);
  CAPTURE(n, device);
  const Failures f = run_gloo_ranks(n, [&](Communicator& gloo, int rank, Failures& fail) {
    auto lp = allocate_layout_params(gloo, bcast_layout());
    // 4 KiB chunks: 5 broadcasts per iteration; all of the first iteration's arrive.
    BrokenBroadcast c(gloo, 5, false, device);
    const auto expected = start_pattern_checksums(lp.tensors, 0);
    const auto s = broadcast_series(c, lp.tensors, expected, series_options(4096, 1, 2));
    const auto& v = s.verdict;
    std::vector<int> others;
    for (int r = 1; r < n; ++r) others.push_back(r);
    if (v.identical) fail.push_back(fmt::format("rank {}: not caught", rank));
    if (v.differing_ranks != others) fail.push_back(fmt::format("rank {}: named {}", rank, v.describe()));
    for (int r = 0; r < n; ++r) {
      const auto want = r == 0 ? std::vector<int>{} : std::vector<int>{1, 2};
      if (v.wrong_iterations.at(static_cast<std::size_t>(r)) != want)
        fail.push_back(fmt::format("rank {}: rank {}'s iterations: {}", rank, r, v.describe()));
    }
    // Every tensor is wrong on every other rank, first after iteration 1.
    if (v.mismatches.size() != lp.tensors.size() * static_cast<std::size_t>(n - 1))
      fail.push_back(fmt::format("rank {}: {} mismatches", rank, v.mismatches.size()));
    for (const auto& m : v.mismatches)
      if (m.first_iteration != 1 || m.wrong_iterations != 2)
        fail.push_back(fmt::format("rank {}: {} of rank {}: first {}, {} iterations", rank, m.name,
                                   m.rank, m.first_iteration, m.wrong_iterations));
    const auto d = v.describe();
    if (d.find("rank 1 holds wrong values after 2 of 3 broadcast(s) (iteration 1, 2;") ==
            std::string::npos ||
        d.find("a.weight") == std::string::npos)
      fail.push_back("describe(): " + d);
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: a root whose own tensors the broadcast alters is named with every rank",
          "[broadcast]") {
  // The old proof compared each rank with the root's current checksums: all
  // ranks agreed on the root's altered bytes, and it passed.
  const int n = GENERATE(2, 3);
  CAPTURE(n);
  const Failures f = run_gloo_ranks(n, [&](Communicator& gloo, int rank, Failures& fail) {
    BrokenBroadcast c(gloo, -1, true);
    auto lp = allocate_layout_params(c, bcast_layout());
    const auto s =
        broadcast_series(c, lp.tensors, start_pattern_checksums(lp.tensors, 0), series_options(4096, 1, 1));
    const auto& v = s.verdict;
    std::vector<int> all;
    for (int r = 0; r < n; ++r) all.push_back(r);
    if (v.differing_ranks != all) fail.push_back(fmt::format("rank {}: named {}", rank, v.describe()));
    for (int r = 0; r < n; ++r)
      if (v.wrong_iterations.at(static_cast<std::size_t>(r)) != std::vector<int>{0, 1})
        fail.push_back(fmt::format("rank {}: rank {}'s iterations: {}", rank, r, v.describe()));
    // And yet every rank holds the same bytes: agreement alone passes it.
    if (!verify_identical(c, lp.tensors).identical) fail.push_back("ranks disagree");
    if (v.describe().find("rank 0 (the root) holds wrong values") == std::string::npos)
      fail.push_back("describe(): " + v.describe());
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: a rank altered after the broadcast is named at 2 ranks, the root too",
          "[broadcast]") {
  const int bad = GENERATE(0, 1);
  CAPTURE(bad);
  const Failures f = run_gloo_ranks(2, [&](Communicator& c, int rank, Failures& fail) {
    auto lp = allocate_layout_params(c, bcast_layout());
    auto o = series_options(kDefaultBroadcastChunkBytes, 0, 3);
    // Only in iteration 1: the root refills after a failed check, so
    // iteration 2 passes again.
    if (rank == bad)
      o.after_broadcast = [&](int it) {
        if (it == 1) static_cast<std::uint8_t*>(lp.tensors[4].data)[100] ^= 0x10;  // c.weight
      };
    const auto s = broadcast_series(c, lp.tensors, start_pattern_checksums(lp.tensors, 0), o);
    const auto& v = s.verdict;
    if (v.differing_ranks != std::vector<int>{bad} || v.mismatches.size() != 1 ||
        v.mismatches[0].name != "c.weight" || v.mismatches[0].first_iteration != 1 ||
        v.wrong_iterations[static_cast<std::size_t>(bad)] != std::vector<int>{1})
      fail.push_back(fmt::format("rank {}: {}", rank, v.describe()));
    const std::string who = fmt::format("rank {}{} holds wrong values after 1 of 3", bad,
                                        bad == 0 ? " (the root)" : "");
    if (v.describe().find(who) == std::string::npos) fail.push_back("describe(): " + v.describe());
  });
  INFO(describe(f));
  CHECK(f.empty());
}

// --- Deadlines: each chunk's own, not one for the whole broadcast ----------

namespace {

// Ten chunks of 4 KiB, back to back (broadcast in place).
ModelLayout ten_chunk_layout() {
  ModelLayout l;
  l.name = "ten-chunks";
  for (int i = 0; i < 10; ++i)
    l.tensors.push_back({fmt::format("l{}.weight", i), {1024}, DType::kFloat32, false});
  return l;
}

}  // namespace

TEST_CASE("broadcast: chunks that each complete within the timeout pass however long the "
          "whole takes",
          "[broadcast]") {
  // 60 ms a chunk, one after another: 600 ms in all against a 300 ms timeout.
  const Failures f = run_gloo_ranks(2, [&](Communicator& gloo, int rank, Failures& fail) {
    test::PacedCommunicator c(gloo, 60ms);
    auto lp = allocate_layout_params(c, ten_chunk_layout());
    for (std::size_t i = 0; i < lp.tensors.size(); ++i)
      fill_rank(static_cast<std::uint8_t*>(lp.tensors[i].data), lp.tensors[i].bytes, rank, i);
    BroadcastOptions o;
    o.chunk_bytes = 4096;
    o.timeout = 300ms;
    const auto t0 = test::PacedCommunicator::Clock::now();
    try {
      const auto st = broadcast_parameters(c, lp.tensors, o);
      if (st.chunks != 10) fail.push_back(fmt::format("rank {}: {} chunks", rank, st.chunks));
    } catch (const std::exception& e) {
      fail.push_back(fmt::format("rank {}: after {:.0f} ms: {}", rank, test::ms_since(t0),
                                 e.what()));
    }
    const double took = test::ms_since(t0);
    if (took < 600) fail.push_back(fmt::format("rank {}: took only {:.0f} ms", rank, took));
    if (c.aborts()) fail.push_back(fmt::format("rank {}: the backend was aborted", rank));
    const auto v = verify_identical(gloo, lp.tensors, 0, 20s);
    if (!v.identical) fail.push_back(fmt::format("rank {}: {}", rank, v.describe()));
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("broadcast: a chunk that never completes times out a timeout after the one before it",
          "[broadcast]") {
  // Chunk 6 stalls. Chunk 5 completes 360 ms in at the earliest, so chunk 6
  // cannot time out before 660 ms; it must not go unreported much longer.
  const Failures f = run_gloo_ranks(2, [&](Communicator& gloo, int rank, Failures& fail) {
    test::PacedCommunicator c(gloo, 60ms, 6);
    auto lp = allocate_layout_params(c, ten_chunk_layout());
    BroadcastOptions o;
    o.chunk_bytes = 4096;
    o.timeout = 300ms;
    const auto t0 = test::PacedCommunicator::Clock::now();
    try {
      broadcast_parameters(c, lp.tensors, o);
      fail.push_back(fmt::format("rank {}: the stalled chunk went unreported", rank));
    } catch (const TimeoutError& e) {
      const double took = test::ms_since(t0);
      if (std::string(e.what()).find("paced op 6:") == std::string::npos)
        fail.push_back(fmt::format("rank {}: not the stalled chunk's error: {}", rank, e.what()));
      if (took < 660 || took > 660 + 2000)
        fail.push_back(fmt::format("rank {}: reported after {:.0f} ms, not 660 ms and a little",
                                   rank, took));
    }
    // The chunk issued after it is outstanding too: the backend is stopped.
    if (c.aborts() != 1) fail.push_back(fmt::format("rank {}: {} aborts", rank, c.aborts()));
    gloo.barrier()->wait(20s);  // the Gloo ops underneath, done on every rank
  });
  INFO(describe(f));
  CHECK(f.empty());
}
