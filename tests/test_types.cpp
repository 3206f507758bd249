// dtypes, half/bfloat16 conversions, host reductions and nccl-tests factors.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "comm/types.h"

using namespace ddpdiag;

TEST_CASE("dtype sizes, names and parsing", "[types]") {
  CHECK(dtype_size(DType::kFloat32) == 4);
  CHECK(dtype_size(DType::kFloat64) == 8);
  CHECK(dtype_size(DType::kFloat16) == 2);
  CHECK(dtype_size(DType::kBFloat16) == 2);
  CHECK(dtype_size(DType::kInt32) == 4);
  CHECK(dtype_size(DType::kInt64) == 8);
  CHECK(dtype_size(DType::kInt8) == 1);
  CHECK(dtype_size(DType::kUInt8) == 1);
  CHECK(dtype_name(DType::kFloat32) == "float");
  CHECK(dtype_name(DType::kFloat64) == "double");
  CHECK(dtype_name(DType::kFloat16) == "half");
  CHECK(dtype_name(DType::kBFloat16) == "bfloat16");
  for (DType t : kAllDTypes) {
    auto back = parse_dtype(dtype_name(t));
    REQUIRE(back.has_value());
    CHECK(*back == t);
  }
  CHECK(parse_dtype("fp32") == DType::kFloat32);
  CHECK(parse_dtype("F32") == DType::kFloat32);
  CHECK(parse_dtype("float32") == DType::kFloat32);
  CHECK(parse_dtype("fp16") == DType::kFloat16);
  CHECK(parse_dtype("float16") == DType::kFloat16);
  CHECK(parse_dtype("bf16") == DType::kBFloat16);
  CHECK(parse_dtype("torch.bfloat16") == DType::kBFloat16);
  CHECK(parse_dtype("fp64") == DType::kFloat64);
  CHECK(parse_dtype("i64") == DType::kInt64);
  CHECK(parse_dtype("u8") == DType::kUInt8);
  CHECK_FALSE(parse_dtype("float8").has_value());
  CHECK_FALSE(parse_dtype("").has_value());
  CHECK(dtype_is_floating(DType::kBFloat16));
  CHECK_FALSE(dtype_is_floating(DType::kInt8));

  for (ReduceOp op : kAllReduceOps) CHECK(parse_reduce_op(reduce_op_name(op)) == op);
  CHECK(parse_reduce_op("MEAN") == ReduceOp::kAvg);
  CHECK_FALSE(parse_reduce_op("xor").has_value());
}

TEST_CASE("half conversions round to nearest even", "[types]") {
  // Exactly representable values survive a round trip.
  for (float f : {0.0f, -0.0f, 1.0f, -1.0f, 0.5f, 2.0f, 1024.0f, 65504.0f, -65504.0f,
                  std::ldexp(1023.0f, -24) /* largest subnormal */,
                  std::ldexp(1.0f, -24) /* smallest subnormal */,
                  std::ldexp(1.0f, -14) /* smallest normal */, 3.140625f}) {
    CHECK(half_to_float(float_to_half(f)) == f);
    CHECK(std::signbit(half_to_float(float_to_half(f))) == std::signbit(f));
  }
  CHECK(float_to_half(1.0f) == 0x3c00);
  CHECK(float_to_half(-2.0f) == 0xc000);
  CHECK(float_to_half(65504.0f) == 0x7bff);
  // Ties go to even: 1 + 2^-11 lies halfway between 1 and 1 + 2^-10.
  CHECK(float_to_half(1.0f + std::ldexp(1.0f, -11)) == 0x3c00);
  // 1 + 3*2^-11 lies halfway between 1+2^-10 (odd mantissa) and 1+2^-9: up.
  CHECK(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3c02);
  // Just above a tie rounds up.
  CHECK(float_to_half(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)) == 0x3c01);
  // Overflow: 65520 is the midpoint to 2^16 and rounds to Inf; below stays finite.
  CHECK(float_to_half(65519.0f) == 0x7bff);
  CHECK(float_to_half(65520.0f) == 0x7c00);
  CHECK(float_to_half(-1e10f) == 0xfc00);
  CHECK(float_to_half(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(std::isinf(half_to_float(0x7c00)));
  // Subnormals: 2^-25 is a tie between 0 and the smallest subnormal: even = 0;
  // 3*2^-25 ties between 1 and 2 subnormal steps: even = 2.
  CHECK(float_to_half(std::ldexp(1.0f, -25)) == 0x0000);
  CHECK(float_to_half(std::ldexp(1.0f, -25) * 1.5f) == 0x0001);
  CHECK(float_to_half(3 * std::ldexp(1.0f, -25)) == 0x0002);
  CHECK(float_to_half(std::ldexp(1.0f, -30)) == 0x0000);
  CHECK(half_to_float(0x0001) == std::ldexp(1.0f, -24));
  CHECK(half_to_float(0x03ff) == std::ldexp(1023.0f, -24));
  // Largest subnormal + half a step rounds up to the smallest normal.
  CHECK(float_to_half(std::ldexp(1023.5f, -24)) == 0x0400);

  // Every half value converts to float and back to itself (NaNs stay NaN).
  for (std::uint32_t h = 0; h <= 0xffff; ++h) {
    const float f = half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      CHECK(std::isnan(half_to_float(float_to_half(f))));
      continue;
    }
    if (float_to_half(f) != h) FAIL("half round trip broke at 0x" << std::hex << h);
  }
}

TEST_CASE("bfloat16 conversions round to nearest even", "[types]") {
  CHECK(float_to_bfloat16(1.0f) == 0x3f80);
  CHECK(bfloat16_to_float(0x3f80) == 1.0f);
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7: even (1).
  CHECK(float_to_bfloat16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  // 1 + 3*2^-8 is a tie between odd 1+2^-7 and 1+2^-6: up.
  CHECK(float_to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  CHECK(float_to_bfloat16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)) == 0x3f81);
  CHECK(float_to_bfloat16(std::numeric_limits<float>::max()) == 0x7f80);  // rounds to Inf
  CHECK(std::isnan(bfloat16_to_float(float_to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low 16 bits stays NaN.
  CHECK(std::isnan(bfloat16_to_float(float_to_bfloat16(std::bit_cast<float>(0x7f800001u)))));
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    const float f = bfloat16_to_float(static_cast<std::uint16_t>(b));
    if (std::isnan(f)) continue;
    if (float_to_bfloat16(f) != b) FAIL("bf16 round trip broke at 0x" << std::hex << b);
  }
}

namespace {

double expected(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kProd: return a * b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
  }
  return 0;
}

}  // namespace

TEST_CASE("reduce_host for every dtype and op", "[types]") {
  const DType t = GENERATE(from_range(std::begin(kAllDTypes), std::end(kAllDTypes)));
  const ReduceOp op = GENERATE(from_range(std::begin(kAllReduceOps), std::end(kAllReduceOps)));
  CAPTURE(dtype_name(t), reduce_op_name(op));
  // 37 elements: not a multiple of any vector width, so loop tails run too.
  const std::size_t n = 37;
  const std::size_t es = dtype_size(t);
  std::vector<std::uint8_t> a(n * es), b(n * es), out(n * es);
  const bool is_signed = t != DType::kUInt8;
  for (std::size_t i = 0; i < n; ++i) {
    // Small values whose sums and products are exact in every dtype.
    const double x = static_cast<double>(i % 7) - (is_signed ? 3.0 : 0.0);
    const double y = static_cast<double>((i * 3) % 5) - (is_signed ? 2.0 : 0.0);
    store_from_double(t, a.data(), i, x);
    store_from_double(t, b.data(), i, y);
  }
  SECTION("out of place") {
    reduce_host(t, op, out.data(), a.data(), b.data(), n);
    for (std::size_t i = 0; i < n; ++i)
      CHECK(load_as_double(t, out.data(), i) ==
            expected(op, load_as_double(t, a.data(), i), load_as_double(t, b.data(), i)));
  }
  SECTION("in place (out aliases a)") {
    std::vector<std::uint8_t> a0 = a;
    reduce_host(t, op, a.data(), a.data(), b.data(), n);
    for (std::size_t i = 0; i < n; ++i)
      CHECK(load_as_double(t, a.data(), i) ==
            expected(op, load_as_double(t, a0.data(), i), load_as_double(t, b.data(), i)));
  }
}

TEST_CASE("reduce_host rounds 16-bit floats once from float", "[types]") {
  // 2048 + 1 is not representable in half (step 2 there): the float sum 2049
  // ties to even, 2048.
  std::uint16_t a = float_to_half(2048.0f), b = float_to_half(1.0f), out = 0;
  reduce_host(DType::kFloat16, ReduceOp::kSum, &out, &a, &b, 1);
  CHECK(half_to_float(out) == 2048.0f);
  a = float_to_half(2050.0f);
  reduce_host(DType::kFloat16, ReduceOp::kSum, &out, &a, &b, 1);
  CHECK(half_to_float(out) == 2052.0f);  // 2051 ties to even 2052
  std::uint16_t c = float_to_bfloat16(256.0f), d = float_to_bfloat16(1.0f);
  reduce_host(DType::kBFloat16, ReduceOp::kSum, &out, &c, &d, 1);
  CHECK(bfloat16_to_float(out) == 256.0f);  // bf16 step at 256 is 2
}

TEST_CASE("integer sums wrap and divide_host truncates", "[types]") {
  std::int8_t a = 127, b = 1, o = 0;
  reduce_host(DType::kInt8, ReduceOp::kSum, &o, &a, &b, 1);
  CHECK(o == -128);
  std::int32_t x = std::numeric_limits<std::int32_t>::max(), y = 2, z = 0;
  reduce_host(DType::kInt32, ReduceOp::kProd, &z, &x, &y, 1);
  CHECK(z == -2);
  std::int64_t big[2] = {(std::int64_t{1} << 60) + 3, -7};
  divide_host(DType::kInt64, big, 2, 2.0);
  CHECK(big[0] == (std::int64_t{1} << 59) + 1);
  CHECK(big[1] == -3);
  std::uint8_t u[1] = {255};
  divide_host(DType::kUInt8, u, 1, 4.0);
  CHECK(u[0] == 63);
  float f[2] = {3.0f, -1.0f};
  divide_host(DType::kFloat32, f, 2, 4.0);
  CHECK(f[0] == 0.75f);
  CHECK(f[1] == -0.25f);
  std::uint16_t h = float_to_half(3.0f);
  divide_host(DType::kFloat16, &h, 1, 2.0);
  CHECK(half_to_float(h) == 1.5f);
  std::uint16_t bf = float_to_bfloat16(3.0f);
  divide_host(DType::kBFloat16, &bf, 1, 4.0);
  CHECK(bfloat16_to_float(bf) == 0.75f);
}

TEST_CASE("store_from_double saturates integers", "[types]") {
  std::int8_t v = 0;
  store_from_double(DType::kInt8, &v, 0, 1000.0);
  CHECK(v == 127);
  store_from_double(DType::kInt8, &v, 0, -1000.0);
  CHECK(v == -128);
  std::uint8_t u = 0;
  store_from_double(DType::kUInt8, &u, 0, -5.0);
  CHECK(u == 0);
  std::int64_t w = 0;
  store_from_double(DType::kInt64, &w, 0, 1e30);
  CHECK(w == std::numeric_limits<std::int64_t>::max());
  store_from_double(DType::kInt64, &w, 0, 42.0);
  CHECK(load_as_double(DType::kInt64, &w, 0) == 42.0);
}

TEST_CASE("busbw factors and names follow nccl-tests", "[types]") {
  CHECK(busbw_factor(Collective::kAllReduce, 8) == Approx(2.0 * 7 / 8));
  CHECK(busbw_factor(Collective::kAllReduce, 2) == Approx(1.0));
  CHECK(busbw_factor(Collective::kAllReduce, 1) == 0.0);
  CHECK(busbw_factor(Collective::kAllGather, 4) == Approx(0.75));
  CHECK(busbw_factor(Collective::kReduceScatter, 4) == Approx(0.75));
  CHECK(busbw_factor(Collective::kBroadcast, 4) == 1.0);
  CHECK(busbw_factor(Collective::kReduce, 4) == 1.0);
  CHECK(busbw_factor(Collective::kSendRecv, 2) == 1.0);
  CHECK(collective_name(Collective::kAllReduce) == "all_reduce");
  CHECK(collective_name(Collective::kReduceScatter) == "reduce_scatter");
}
