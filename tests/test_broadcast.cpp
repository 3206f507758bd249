// Coalesced parameter broadcast and the checksum verdict, ranks as threads
// over Gloo: ranks start with different parameters and end bit-identical to
// rank 0's; a rank corrupted afterwards is named with the tensor.
#include <catch2/catch.hpp>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "ddp_core/param_broadcast.h"
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
