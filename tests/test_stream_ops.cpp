// StreamOps (comm/stream_ops.h): the host reference, Gloo's ordering with
// its collectives, and, on a GPU, the device kernels against the host
// reference bit for bit.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include <fmt/core.h>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/store/store.h"
#include "comm/stream_ops.h"
#include "comm/types.h"
#include "ddp_core/backward_sim.h"
#include "ddp_core/reducer.h"
#include "tests/gpu_skip.h"
#include "tests/rank_threads.h"

using namespace ddpdiag;
using namespace ddpdiag::testing;
using namespace std::chrono_literals;

namespace {

// Deterministic values with the awkward cases mixed in: values that round
// in 16 bits, subnormals, infinities, NaN, negative zero, large magnitudes.
std::vector<double> test_values(std::size_t n, std::uint64_t seed) {
  std::vector<double> v(n);
  std::uint64_t x = seed * 6364136223846793005ULL + 1442695040888963407ULL;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    const double u = static_cast<double>(x >> 11) * 0x1p-53;  // [0, 1)
    switch (i % 16) {
      case 0: v[i] = 1e-7 * u; break;          // fp16 subnormal range
      case 1: v[i] = -70000.0 * u; break;      // beyond fp16's max at times
      case 2: v[i] = (i % 32 == 2) ? std::numeric_limits<double>::infinity() : -0.0; break;
      case 3: v[i] = (i % 64 == 3) ? std::numeric_limits<double>::quiet_NaN() : 3.0; break;
      default: v[i] = (u - 0.5) * 200.0; break;
    }
  }
  return v;
}

std::vector<std::uint8_t> encode(DType t, const std::vector<double>& v) {
  std::vector<std::uint8_t> out(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) store_from_double(t, out.data(), i, v[i]);
  return out;
}

// Equal bits, except that any NaN equals any NaN of the same type (payloads
// are not part of the contract).
bool same_values(DType t, const std::vector<std::uint8_t>& a, const std::vector<std::uint8_t>& b,
                 std::size_t* first_diff) {
  if (a.size() != b.size()) return false;
  const std::size_t n = a.size() / dtype_size(t);
  for (std::size_t i = 0; i < n; ++i) {
    const double x = load_as_double(t, a.data(), i), y = load_as_double(t, b.data(), i);
    if (std::isnan(x) && std::isnan(y)) continue;
    if (std::memcmp(a.data() + i * dtype_size(t), b.data() + i * dtype_size(t), dtype_size(t))) {
      *first_diff = i;
      return false;
    }
  }
  return true;
}

const DType kFloatTypes[] = {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16};

}  // namespace

TEST_CASE("stream ops: the host reference", "[stream_ops]") {
  SECTION("plans refuse pieces outside the flat buffer or overlapping") {
    std::vector<std::uint8_t> a(16), b(16);
    const FlatPiece outside[] = {{a.data(), 10, 8}};
    CHECK_THROWS_AS(host_ops::check_pieces(16, outside), UsageError);
    const FlatPiece overlap[] = {{a.data(), 0, 8}, {b.data(), 4, 8}};
    CHECK_THROWS_WITH(host_ops::check_pieces(16, overlap), Catch::Contains("overlap at byte 4"));
    const FlatPiece fine[] = {{a.data(), 8, 8}, {b.data(), 0, 8}};
    CHECK_NOTHROW(host_ops::check_pieces(16, fine));
  }
  SECTION("flatten then unflatten moves every byte and only them") {
    std::vector<std::uint8_t> t1(7, 1), t2(13, 2), t3(5, 3), flat(40, 0xee);
    const FlatPiece pieces[] = {{t1.data(), 0, 7}, {t2.data(), 7, 13}, {t3.data(), 30, 5}};
    host_ops::flatten(flat.data(), pieces);
    for (std::size_t i = 0; i < 40; ++i) {
      const int want = i < 7 ? 1 : i < 20 ? 2 : (i >= 30 && i < 35) ? 3 : 0xee;
      CHECK(flat[i] == want);
    }
    for (auto& x : flat) x = static_cast<std::uint8_t>(x + 10);
    host_ops::unflatten(flat.data(), pieces);
    CHECK(t1 == std::vector<std::uint8_t>(7, 11));
    CHECK(t2 == std::vector<std::uint8_t>(13, 12));
    CHECK(t3 == std::vector<std::uint8_t>(5, 13));
  }
  SECTION("divide: a float division for float32, as torch's div_") {
    std::vector<float> v = {1.0f, 10.0f, -7.5f, 0.1f};
    host_ops::divide(v.data(), v.size(), DType::kFloat32, 3);
    CHECK(v[0] == 1.0f / 3.0f);
    CHECK(v[1] == 10.0f / 3.0f);
    CHECK(v[2] == -2.5f);
    CHECK(v[3] == 0.1f / 3.0f);
  }
  SECTION("compress: cast to 16 bits, divide in 16 bits; decompress back") {
    const float x[] = {1.0f, 3.0f, 0.1f, 65504.0f * 4};
    std::uint16_t h[4];
    host_ops::compress(x, DType::kFloat32, h, DType::kFloat16, 4, 2);
    CHECK(half_to_float(h[0]) == 0.5f);
    CHECK(half_to_float(h[1]) == 1.5f);
    // 0.1 rounds to fp16 first (0.0999755859375), then halves exactly.
    CHECK(half_to_float(h[2]) == half_to_float(float_to_half(0.1f)) / 2);
    CHECK(std::isinf(half_to_float(h[3])));  // overflow before the divide, as torch's .to(half)
    float back[4];
    host_ops::decompress(h, DType::kFloat16, back, DType::kFloat32, 4);
    CHECK(back[1] == 1.5f);
    std::uint16_t b[4];
    host_ops::compress(x, DType::kFloat32, b, DType::kBFloat16, 4, 2);
    // bf16 has float32's range: 262016 rounds to 2^18, then halves.
    CHECK(bfloat16_to_float(b[3]) == 131072.0f);
    CHECK_THROWS_AS(host_ops::compress(x, DType::kInt32, b, DType::kBFloat16, 1, 2), UsageError);
    CHECK_THROWS_AS(host_ops::compress(x, DType::kFloat32, b, DType::kFloat32, 1, 2), UsageError);
  }
}

TEST_CASE("stream ops: Gloo runs them in order with its collectives", "[stream_ops]") {
  const Failures f = run_gloo_ranks(2, [](Communicator& c, int rank, Failures& fail) {
    StreamOps* ops = c.stream_ops();
    if (!ops) {
      fail.push_back("Gloo has no stream ops");
      return;
    }
    const std::size_t n = 4096;
    CommBuffer buf(c, n * sizeof(float)), c16(c, n * 2), piece(c, n * sizeof(float));
    std::vector<float> mine(n);
    for (std::size_t i = 0; i < n; ++i) mine[i] = static_cast<float>((rank + 1) * (i % 9));
    std::memcpy(piece.get(), mine.data(), n * sizeof(float));
    const FlatPiece pieces[] = {{piece.get(), 0, n * sizeof(float)}};
    auto plan = ops->plan(buf.get(), n * sizeof(float), pieces);
    // The whole bucket journey, enqueued without waiting in between.
    ops->zero(buf.get(), n * sizeof(float));
    ops->flatten(*plan);
    ops->compress(buf.get(), DType::kFloat32, c16.get(), DType::kFloat16, n, 2);
    auto w = c.allreduce(c16.get(), c16.get(), n, DType::kFloat16, ReduceOp::kSum);
    ops->decompress(c16.get(), DType::kFloat16, buf.get(), DType::kFloat32, n);
    ops->unflatten(*plan);
    auto fence = ops->fence();
    w->wait(20s);
    fence->wait(20s);
    const auto* got = static_cast<const float*>(piece.get());
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (got[i] != 1.5f * static_cast<float>(i % 9)) ++wrong;  // mean of 1x and 2x
    if (wrong) fail.push_back(fmt::format("rank {}: {} of {} wrong", rank, wrong, n));
  });
  INFO(describe(f));
  CHECK(f.empty());
}

TEST_CASE("stream ops: device kernels give the host reference's bits", "[nccl][gpu]") {
  if (ddpdiag::test::no_gpu_skip()) return;
  CommOptions o;
  o.backend = Backend::kNccl;
  o.store = std::make_shared<MemoryStore>();
  o.timeout = 30s;  // under gpu-check's limit for the whole GPU suite
  auto comm = make_communicator(o);
  StreamOps* ops = comm->stream_ops();
  REQUIRE(ops);
  const std::size_t n = 100003;  // not a multiple of any vector width
  const auto check_divide = [&](DType t, const std::vector<std::uint8_t>& host, CommBuffer& d) {
    for (int divisor : {1, 3, 8}) {
      comm->copy_from_host(d.get(), host.data(), host.size());
      ops->divide(d.get(), n, t, divisor);
      ops->fence()->wait(30s);
      std::vector<std::uint8_t> got(host.size()), want = host;
      comm->copy_to_host(got.data(), d.get(), got.size());
      host_ops::divide(want.data(), n, t, divisor);
      std::size_t at = 0;
      const bool same = same_values(t, got, want, &at);
      INFO("divide by " << divisor << ", first difference at element " << at);
      CHECK(same);
    }
  };
  // Integer buckets (a layout with an integer tensor): divided in the
  // integer domain, truncating toward zero. Every bit pattern, negatives too.
  for (DType t : {DType::kInt32, DType::kInt64, DType::kInt8, DType::kUInt8}) {
    CAPTURE(dtype_name(t));
    std::vector<std::uint8_t> host(n * dtype_size(t));
    std::uint64_t x = 12345;
    for (auto& b : host) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      b = static_cast<std::uint8_t>(x >> 56);
    }
    CommBuffer d(*comm, host.size());
    check_divide(t, host, d);
  }
  for (DType t : kFloatTypes) {
    CAPTURE(dtype_name(t));
    const auto host = encode(t, test_values(n, 7));
    CommBuffer d(*comm, host.size());
    check_divide(t, host, d);
    for (DType t16 : {DType::kFloat16, DType::kBFloat16}) {
      CAPTURE(dtype_name(t16));
      comm->copy_from_host(d.get(), host.data(), host.size());
      CommBuffer c16(*comm, n * 2);
      ops->compress(d.get(), t, c16.get(), t16, n, 3);
      ops->fence()->wait(30s);
      std::vector<std::uint8_t> got(n * 2), want(n * 2);
      comm->copy_to_host(got.data(), c16.get(), got.size());
      host_ops::compress(host.data(), t, want.data(), t16, n, 3);
      std::size_t at = 0;
      CHECK(same_values(t16, got, want, &at));
      ops->decompress(c16.get(), t16, d.get(), t, n);
      ops->fence()->wait(30s);
      std::vector<std::uint8_t> back(host.size()), want_back(host.size());
      comm->copy_to_host(back.data(), d.get(), back.size());
      host_ops::decompress(want.data(), t16, want_back.data(), t, n);
      CHECK(same_values(t, back, want_back, &at));
    }
  }
  // Flatten/unflatten with pieces of odd sizes and alignments, and one piece
  // larger than a kernel chunk.
  const std::vector<std::uint64_t> sizes = {1, 3, 16, 17, 4096, 200001, 12, 64 * 1024 + 5};
  std::uint64_t total = 0;
  for (auto s : sizes) total += s + 1;  // one byte gap: misaligns the next piece
  CommBuffer flat(*comm, total);
  std::vector<CommBuffer> bufs;
  std::vector<FlatPiece> pieces;
  std::vector<std::uint8_t> want_flat(total, 0);
  std::uint64_t off = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    bufs.emplace_back(*comm, sizes[k] + 1);
    std::vector<std::uint8_t> h(sizes[k] + 1);
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = static_cast<std::uint8_t>(k * 31 + i * 7);
    comm->copy_from_host(bufs.back().get(), h.data(), h.size());
    // Odd pieces start one byte into their buffer: unaligned sources.
    const std::uint64_t skew = k % 2;
    pieces.push_back({static_cast<std::uint8_t*>(bufs.back().get()) + skew, off, sizes[k]});
    std::memcpy(want_flat.data() + off, h.data() + skew, sizes[k]);
    off += sizes[k] + 1;
  }
  std::vector<std::uint8_t> zeros(total, 0);
  comm->copy_from_host(flat.get(), zeros.data(), total);
  auto plan = ops->plan(flat.get(), total, pieces);
  ops->flatten(*plan);
  ops->fence()->wait(30s);
  std::vector<std::uint8_t> got(total);
  comm->copy_to_host(got.data(), flat.get(), total);
  CHECK(got == want_flat);
  // Unflatten: change the flat buffer, the pieces follow, their gaps stay.
  for (auto& x : want_flat) x = static_cast<std::uint8_t>(x ^ 0x5a);
  comm->copy_from_host(flat.get(), want_flat.data(), total);
  ops->unflatten(*plan);
  ops->fence()->wait(30s);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    std::vector<std::uint8_t> h(sizes[k]);
    comm->copy_to_host(h.data(), pieces[k].ptr, sizes[k]);
    CHECK(std::memcmp(h.data(), want_flat.data() + pieces[k].offset, sizes[k]) == 0);
  }
}

TEST_CASE("stream ops: the reducer on a GPU gives Gloo's bits", "[nccl][gpu]") {
  if (ddpdiag::test::no_gpu_skip()) return;
  using namespace ddpdiag::ddp_core;
  CommOptions o;
  o.backend = Backend::kNccl;
  o.store = std::make_shared<MemoryStore>();
  o.timeout = 30s;  // under gpu-check's limit for the whole GPU suite
  auto gpu = make_communicator(o);
  CommOptions g = o;
  g.backend = Backend::kGloo;
  g.store = std::make_shared<MemoryStore>();
  auto cpu = make_communicator(g);
  ModelLayout l;
  l.name = "mixed";
  l.tensors = {{"a", {37, 5}, DType::kFloat32, false}, {"b", {2000}, DType::kFloat32, false},
               {"c", {3}, DType::kFloat64, false},     {"d", {16, 9}, DType::kBFloat16, false},
               {"e", {300}, DType::kFloat16, false}};
  for (CompressionHook h : {CompressionHook::kNone, CompressionHook::kFp16, CompressionHook::kBf16})
    for (bool views : {true, false}) {
      CAPTURE(compression_hook_name(h), views);
      ReducerOptions ro;
      ro.bucket_cap_bytes = 2048;
      ro.first_bucket_bytes = 512;
      ro.hook = h;
      ro.gradient_as_bucket_view = views;
      ro.timeout = 30s;
      Reducer on_gpu(*gpu, l, ro), on_cpu(*cpu, l, ro);
      BackwardSimOptions so;
      so.value_scale = 0.1;
      simulate_backward(on_gpu, *gpu, 3, so);
      on_gpu.finalize();
      simulate_backward(on_cpu, *cpu, 3, so);
      on_cpu.finalize();
      for (std::size_t p = 0; p < l.tensors.size(); ++p) {
        std::vector<std::uint8_t> a(on_gpu.grad_bytes(p)), b(a.size());
        gpu->copy_to_host(a.data(), on_gpu.grad(p), a.size());
        std::memcpy(b.data(), on_cpu.grad(p), b.size());
        std::size_t at = 0;
        INFO(l.tensors[p].name);
        CHECK(same_values(l.tensors[p].dtype, a, b, &at));
      }
    }
}
