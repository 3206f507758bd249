// Data types, reduction ops and their host-side arithmetic.
//
// reduce_host is on the hot path of the Gloo backend (Gloo calls it for every
// segment it receives), so the element loops are written to vectorise: each
// (dtype, op) pair gets its own monomorphic loop, and the loops carry
// `#pragma GCC ivdep` because the only aliasing the contract allows is exact
// (out == a or out == b, element by element), which has no loop-carried
// dependency.
#include "comm/types.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "comm/errors.h"

namespace ddpdiag {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kInt8: return 1;
    case DType::kUInt8: return 1;
  }
  DDPDIAG_ASSERT(false && "unknown dtype");
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float";
    case DType::kFloat64: return "double";
    case DType::kFloat16: return "half";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kInt8: return "int8";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProd: return "prod";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kAvg: return "avg";
  }
  return "unknown";
}

bool dtype_is_floating(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 ||
         t == DType::kBFloat16;
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

std::optional<DType> parse_dtype(std::string_view s) {
  // The spellings of nccl-tests (-d), PyTorch (torch.float16) and numpy.
  struct Spelling {
    const char* name;
    DType type;
  };
  static constexpr Spelling kSpellings[] = {
      {"float32", DType::kFloat32}, {"float", DType::kFloat32},   {"fp32", DType::kFloat32},
      {"f32", DType::kFloat32},     {"float64", DType::kFloat64}, {"double", DType::kFloat64},
      {"fp64", DType::kFloat64},    {"f64", DType::kFloat64},     {"float16", DType::kFloat16},
      {"half", DType::kFloat16},    {"fp16", DType::kFloat16},    {"f16", DType::kFloat16},
      {"bfloat16", DType::kBFloat16}, {"bf16", DType::kBFloat16}, {"int32", DType::kInt32},
      {"int", DType::kInt32},       {"i32", DType::kInt32},       {"int64", DType::kInt64},
      {"long", DType::kInt64},      {"i64", DType::kInt64},       {"int8", DType::kInt8},
      {"i8", DType::kInt8},         {"char", DType::kInt8},       {"uint8", DType::kUInt8},
      {"u8", DType::kUInt8},        {"byte", DType::kUInt8},
  };
  std::string key = lower(s);
  if (key.starts_with("torch.")) key.erase(0, 6);
  for (const auto& sp : kSpellings)
    if (key == sp.name) return sp.type;
  return std::nullopt;
}

std::optional<ReduceOp> parse_reduce_op(std::string_view s) {
  std::string key = lower(s);
  if (key == "sum") return ReduceOp::kSum;
  if (key == "prod" || key == "product") return ReduceOp::kProd;
  if (key == "min") return ReduceOp::kMin;
  if (key == "max") return ReduceOp::kMax;
  if (key == "avg" || key == "mean" || key == "average") return ReduceOp::kAvg;
  return std::nullopt;
}

// ---------------------------------------------------------------------------
// half and bfloat16

std::uint16_t float_to_half(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) {
    // Inf stays Inf; NaN keeps its top payload bits and is forced quiet so a
    // payload that lives only in the low bits does not turn into Inf.
    if (abs == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
  }
  // 0x477ff000 is 65520.0f: the midpoint between the largest half (65504) and
  // 2^16; from there on round-to-nearest-even gives Inf.
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): |f| < 2^-14. The half subnormal step is
    // 2^-24; shift the full significand (with its implicit bit) accordingly.
    // Anything below 2^-25 rounds to zero (2^-25 exactly ties to even = 0).
    if (abs < 0x33000000u) return sign;
    const std::uint32_t exp = abs >> 23;                 // biased, 102..112
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126 - exp;               // 14..24
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1);
    const std::uint32_t half_ulp = 1u << (shift - 1);
    if (rem > half_ulp || (rem == half_ulp && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  // Normal: rebias the exponent (127 -> 15) and round 13 dropped bits to
  // nearest even; a carry out of the mantissa correctly bumps the exponent.
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  std::uint32_t x;
  if (exp == 0x1f) {
    x = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    x = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    x = sign;
  } else {
    // Subnormal half: normalise into a float.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    x = sign | static_cast<std::uint32_t>(112 - e) << 23 | ((mant & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(x);
}

std::uint16_t float_to_bfloat16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) {
    // NaN: keep it a (quiet) NaN even when the payload sits in the low half.
    return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  }
  // Round to nearest even on the 16 dropped bits; overflow carries into Inf.
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

float bfloat16_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

// ---------------------------------------------------------------------------
// Element-wise reduction

namespace {

struct Half {
  static float load(std::uint16_t v) { return half_to_float(v); }
  static std::uint16_t store(float v) { return float_to_half(v); }
};
struct BFloat {
  static float load(std::uint16_t v) { return bfloat16_to_float(v); }
  static std::uint16_t store(float v) { return float_to_bfloat16(v); }
};

// Integer sum and product wrap around (two's complement), as on NCCL; the
// arithmetic is done in the unsigned type so that overflow is defined.
template <typename T>
T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <typename T>
T wrap_mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    // Promote 8-bit operands through unsigned int so the multiply cannot
    // overflow a signed int; the narrowing conversion then wraps.
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

template <typename T, ReduceOp Op>
T apply(T a, T b) {
  if constexpr (Op == ReduceOp::kSum || Op == ReduceOp::kAvg) return wrap_add(a, b);
  if constexpr (Op == ReduceOp::kProd) return wrap_mul(a, b);
  if constexpr (Op == ReduceOp::kMin) return b < a ? b : a;
  if constexpr (Op == ReduceOp::kMax) return a < b ? b : a;
}

// One plain loop. The library builds at -O3 (DDPDIAG_HOT_PATH_OPTIONS),
// where GCC vectorises it with an unrolled main loop and a vector epilogue;
// ivdep spares the runtime overlap check, the contract allowing only exact
// aliasing. (Cache-line blocks with a fixed inner trip count, which GCC's
// -O2 cost model needs to vectorise at all, run 2-3 times slower at -O3 on
// data in cache: bench_ddp_core's reduce_host rows show it.)
template <typename T, ReduceOp Op>
void reduce_native(void* out, const void* a, const void* b, std::size_t n) {
  T* o = static_cast<T*>(out);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
#pragma GCC ivdep
  for (std::size_t i = 0; i < n; ++i) o[i] = apply<T, Op>(x[i], y[i]);
}

// 16-bit floats are reduced in float and rounded once, as NCCL does.
template <typename Conv, ReduceOp Op>
void reduce_16(void* out, const void* a, const void* b, std::size_t n) {
  auto* o = static_cast<std::uint16_t*>(out);
  const auto* x = static_cast<const std::uint16_t*>(a);
  const auto* y = static_cast<const std::uint16_t*>(b);
  for (std::size_t i = 0; i < n; ++i)
    o[i] = Conv::store(apply<float, Op>(Conv::load(x[i]), Conv::load(y[i])));
}

template <ReduceOp Op>
void reduce_typed(DType t, void* out, const void* a, const void* b, std::size_t n) {
  switch (t) {
    case DType::kFloat32: return reduce_native<float, Op>(out, a, b, n);
    case DType::kFloat64: return reduce_native<double, Op>(out, a, b, n);
    case DType::kFloat16: return reduce_16<Half, Op>(out, a, b, n);
    case DType::kBFloat16: return reduce_16<BFloat, Op>(out, a, b, n);
    case DType::kInt32: return reduce_native<std::int32_t, Op>(out, a, b, n);
    case DType::kInt64: return reduce_native<std::int64_t, Op>(out, a, b, n);
    case DType::kInt8: return reduce_native<std::int8_t, Op>(out, a, b, n);
    case DType::kUInt8: return reduce_native<std::uint8_t, Op>(out, a, b, n);
  }
}

template <typename T>
void divide_int(void* buf, std::size_t n, double d) {
  T* p = static_cast<T*>(buf);
  // An integral divisor (the world size, in practice) divides exactly in the
  // integer domain, so int64 values beyond 2^53 are not rounded through a
  // double; C++ integer division truncates toward zero.
  if (d == std::floor(d) && std::abs(d) >= 1.0 && std::abs(d) < 9.0e18) {
    const auto q = static_cast<std::int64_t>(d);
    for (std::size_t i = 0; i < n; ++i)
      p[i] = static_cast<T>(static_cast<std::int64_t>(p[i]) / q);
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const double v = std::trunc(static_cast<double>(p[i]) / d);
    p[i] = static_cast<T>(std::clamp(v, static_cast<double>(std::numeric_limits<T>::lowest()),
                                     static_cast<double>(std::numeric_limits<T>::max())));
  }
}

template <typename T>
T from_double_int(double v) {
  // Round to nearest and saturate: check values are integral in practice and
  // an out-of-range cast would be undefined behaviour.
  if (std::isnan(v)) return 0;
  v = std::nearbyint(v);
  if (v <= static_cast<double>(std::numeric_limits<T>::lowest())) return std::numeric_limits<T>::lowest();
  if (v >= static_cast<double>(std::numeric_limits<T>::max())) return std::numeric_limits<T>::max();
  return static_cast<T>(v);
}

}  // namespace

void reduce_host(DType t, ReduceOp op, void* out, const void* a, const void* b, std::size_t n) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return reduce_typed<ReduceOp::kSum>(t, out, a, b, n);
    case ReduceOp::kProd: return reduce_typed<ReduceOp::kProd>(t, out, a, b, n);
    case ReduceOp::kMin: return reduce_typed<ReduceOp::kMin>(t, out, a, b, n);
    case ReduceOp::kMax: return reduce_typed<ReduceOp::kMax>(t, out, a, b, n);
  }
}

void divide_host(DType t, void* buf, std::size_t n, double d) {
  switch (t) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(buf);
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] / d);
      return;
    }
    case DType::kFloat64: {
      auto* p = static_cast<double*>(buf);
      for (std::size_t i = 0; i < n; ++i) p[i] = p[i] / d;
      return;
    }
    case DType::kFloat16: {
      auto* p = static_cast<std::uint16_t*>(buf);
      for (std::size_t i = 0; i < n; ++i)
        p[i] = float_to_half(static_cast<float>(half_to_float(p[i]) / d));
      return;
    }
    case DType::kBFloat16: {
      auto* p = static_cast<std::uint16_t*>(buf);
      for (std::size_t i = 0; i < n; ++i)
        p[i] = float_to_bfloat16(static_cast<float>(bfloat16_to_float(p[i]) / d));
      return;
    }
    case DType::kInt32: return divide_int<std::int32_t>(buf, n, d);
    case DType::kInt64: return divide_int<std::int64_t>(buf, n, d);
    case DType::kInt8: return divide_int<std::int8_t>(buf, n, d);
    case DType::kUInt8: return divide_int<std::uint8_t>(buf, n, d);
  }
}

double load_as_double(DType t, const void* buf, std::size_t i) {
  switch (t) {
    case DType::kFloat32: return static_cast<const float*>(buf)[i];
    case DType::kFloat64: return static_cast<const double*>(buf)[i];
    case DType::kFloat16: return half_to_float(static_cast<const std::uint16_t*>(buf)[i]);
    case DType::kBFloat16: return bfloat16_to_float(static_cast<const std::uint16_t*>(buf)[i]);
    case DType::kInt32: return static_cast<double>(static_cast<const std::int32_t*>(buf)[i]);
    case DType::kInt64: return static_cast<double>(static_cast<const std::int64_t*>(buf)[i]);
    case DType::kInt8: return static_cast<const std::int8_t*>(buf)[i];
    case DType::kUInt8: return static_cast<const std::uint8_t*>(buf)[i];
  }
  return 0.0;
}

void store_from_double(DType t, void* buf, std::size_t i, double v) {
  switch (t) {
    case DType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); return;
    case DType::kFloat64: static_cast<double*>(buf)[i] = v; return;
    case DType::kFloat16:
      static_cast<std::uint16_t*>(buf)[i] = float_to_half(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(buf)[i] = float_to_bfloat16(static_cast<float>(v));
      return;
    case DType::kInt32: static_cast<std::int32_t*>(buf)[i] = from_double_int<std::int32_t>(v); return;
    case DType::kInt64: static_cast<std::int64_t*>(buf)[i] = from_double_int<std::int64_t>(v); return;
    case DType::kInt8: static_cast<std::int8_t*>(buf)[i] = from_double_int<std::int8_t>(v); return;
    case DType::kUInt8: static_cast<std::uint8_t*>(buf)[i] = from_double_int<std::uint8_t>(v); return;
  }
}

// ---------------------------------------------------------------------------
// nccl-tests conventions

std::string_view collective_name(Collective c) {
  // The stems of the nccl-tests binaries (all_reduce_perf, ...).
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kReduce: return "reduce";
    case Collective::kSendRecv: return "sendrecv";
  }
  return "unknown";
}

double busbw_factor(Collective c, int world_size) {
  if (world_size < 1) return 0.0;
  const double n = world_size;
  switch (c) {
    case Collective::kAllReduce: return 2.0 * (n - 1.0) / n;
    case Collective::kAllGather:
    case Collective::kReduceScatter: return (n - 1.0) / n;
    case Collective::kBroadcast:
    case Collective::kReduce:
    case Collective::kSendRecv: return 1.0;
  }
  return 1.0;
}

}  // namespace ddpdiag
