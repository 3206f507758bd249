#include "comm/measure.h"
#include "comm/splitmix64.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "comm/errors.h"

namespace ddpdiag {

std::vector<std::size_t> sweep_sizes(std::size_t min_bytes, std::size_t max_bytes, double factor,
                                     std::size_t step_bytes, std::size_t elem_size) {
  if (elem_size == 0) elem_size = 1;
  auto round = [&](std::size_t b) { return std::max(elem_size, b / elem_size * elem_size); };
  std::vector<std::size_t> out;
  if (max_bytes < min_bytes) return out;
  if (step_bytes == 0 && factor <= 1.0) factor = 2.0;
  for (std::size_t b = min_bytes; b <= max_bytes;) {
    std::size_t r = round(b);
    if (out.empty() || out.back() != r) out.push_back(r);
    // The next size, unless it would pass max_bytes (checked before it is
    // computed: near 2^64 it would wrap around and the sweep never end).
    if (step_bytes) {
      if (step_bytes > max_bytes - b) break;
      b += step_bytes;
      continue;
    }
    const double next = std::ceil(static_cast<double>(b) * factor);
    if (next > static_cast<double>(max_bytes) || next >= 18446744073709551616.0) break;
    const auto n = static_cast<std::size_t>(next);
    if (n <= b) {
      if (b == max_bytes) break;
      b = b + 1;
    } else {
      b = n;
    }
  }
  return out;
}

namespace {

// Largest integer n such that every integer in [0, n] is exactly
// representable (floats), or the largest positive value (integers).
double exact_limit(DType t) {
  switch (t) {
    case DType::kFloat16: return 2048;
    case DType::kBFloat16: return 256;
    case DType::kFloat32: return 16777216.0;
    case DType::kFloat64: return 9007199254740992.0;
    case DType::kInt8: return 127;
    case DType::kUInt8: return 255;
    case DType::kInt32: return 2147483647.0;
    case DType::kInt64: return 9.2e18;
  }
  return 0;
}

bool is_integer_type(DType t) { return !dtype_is_floating(t); }

// A value whose sum over 2 ranks or more leaves the dtype's range, so that
// the check sees integers wrap (two's complement, as torch and the backends
// do); 0 for types whose wrap the check cannot compute exactly (int64).
double wrapping_value(DType t) {
  switch (t) {
    case DType::kInt8: return 100;
    case DType::kUInt8: return 200;
    case DType::kInt32: return 1073741824.0 + 7;
    default: return 0;
  }
}

// The value a rank contributes to element i. Each op's inputs differ from
// rank to rank, so that an all_reduce that leaves a rank's buffer alone, or
// computes another op, is caught (sum, prod and max give different results).
// A pseudo-random number for element i of rank r (splitmix64's
// finaliser): small values taken from it have no period in r, so no two
// ranks' buffers are alike, and a backend that adds one peer's data twice
// and another's never cannot pass (a pattern like (i + r) % 3 repeats every
// 3 ranks).
std::uint64_t element_hash(std::size_t i, int r) {
  return splitmix64_mix(splitmix64_mix(static_cast<std::uint64_t>(i) + kSplitmix64Gamma) ^
                        static_cast<std::uint64_t>(static_cast<std::uint32_t>(r)));
}

double input_value(DType t, ReduceOp op, int n, int r, std::size_t i) {
  const double limit = exact_limit(t);
  switch (op) {
    case ReduceOp::kSum:
      // Integers wrap exactly, so any world size is fine for them; every
      // fifth element is large, so that its sum wraps.
      if (is_integer_type(t)) {
        if (i % 5 == 4 && wrapping_value(t) > 0) return wrapping_value(t);
        return static_cast<double>(element_hash(i, r) % 3);
      }
      if (2.0 * n <= limit) return static_cast<double>(element_hash(i, r) % 3);
      // Too many ranks for the small-integer range: one rank per element
      // contributes, so each sum is a single value 1..3.
      return (i % static_cast<std::size_t>(n) == static_cast<std::size_t>(r))
                 ? 1.0 + static_cast<double>((i / n) % 3)
                 : 0.0;
    case ReduceOp::kAvg: {
      // One rank contributes base + (n - 1), the others base - 1: the sum is
      // n * base in any order (no partial sum passes 4n), so the average is
      // base exactly, and no rank's own input equals it.
      const double base = 1.0 + static_cast<double>(i % 3);
      if (n >= 2 && 4.0 * n <= limit)
        return i % static_cast<std::size_t>(n) == static_cast<std::size_t>(r) ? base + (n - 1)
                                                                               : base - 1;
      // More ranks than that: every rank the same value, so the average is
      // that value as long as the sum n*x stays exact.
      if (2.0 * n <= limit) return static_cast<double>(i % 3);
      if (1.0 * n <= limit) return static_cast<double>(i % 2);
      return 0.0;
    }
    case ReduceOp::kProd: {
      // Two ranks contribute factors (3 and 2 on even elements, 2 and 2 on
      // odd ones), the others 1: products 6 and 4, never the max, and at
      // every world size one of them differs from the sum.
      if (n == 1) return 2.0;
      const auto first = i % static_cast<std::size_t>(n);
      const auto second = (i + 1) % static_cast<std::size_t>(n);
      if (static_cast<std::size_t>(r) == first) return i % 2 == 0 ? 3.0 : 2.0;
      if (static_cast<std::size_t>(r) == second) return 2.0;
      return 1.0;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      // Every rank holds the only extreme of some elements (i = r mod n:
      // 0, the minimum, or 17, the maximum, in turn), so a reduction that
      // drops any one rank's data is caught; elsewhere 1..16 at random.
      if (i % static_cast<std::size_t>(n) == static_cast<std::size_t>(r))
        return (i / static_cast<std::size_t>(n)) % 2 == 0 ? 0.0 : 17.0;
      return static_cast<double>(1 + element_hash(i, r) % 16);
  }
  return 0;
}

// Wraps an exact integer result into the dtype's range, as two's complement
// arithmetic of that width does.
double wrap_integer(DType t, long double v) {
  auto iv = static_cast<std::int64_t>(v);
  switch (t) {
    case DType::kInt8: return static_cast<std::int8_t>(static_cast<std::uint8_t>(iv & 0xff));
    case DType::kUInt8: return static_cast<std::uint8_t>(iv & 0xff);
    case DType::kInt32:
      return static_cast<std::int32_t>(static_cast<std::uint32_t>(iv & 0xffffffffLL));
    default: return static_cast<double>(iv);
  }
}

double expected_value(DType t, ReduceOp op, int n, std::size_t i) {
  long double acc = 0;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      for (int r = 0; r < n; ++r) acc += input_value(t, op, n, r, i);
      if (op == ReduceOp::kAvg) return static_cast<double>(acc / n);
      return is_integer_type(t) ? wrap_integer(t, acc) : static_cast<double>(acc);
    case ReduceOp::kProd:
      acc = 1;
      for (int r = 0; r < n; ++r) acc *= input_value(t, op, n, r, i);
      return static_cast<double>(acc);
    case ReduceOp::kMin:
      acc = std::numeric_limits<double>::infinity();
      for (int r = 0; r < n; ++r) acc = std::min<long double>(acc, input_value(t, op, n, r, i));
      return static_cast<double>(acc);
    case ReduceOp::kMax:
      acc = -std::numeric_limits<double>::infinity();
      for (int r = 0; r < n; ++r) acc = std::max<long double>(acc, input_value(t, op, n, r, i));
      return static_cast<double>(acc);
  }
  return 0;
}

}  // namespace

void fill_exact_inputs(DType dtype, ReduceOp op, int world_size, int rank, void* host,
                       std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    store_from_double(dtype, host, i, input_value(dtype, op, world_size, rank, i));
}

void fill_expected_allreduce(DType dtype, ReduceOp op, int world_size, void* host,
                             std::size_t count) {
  for (std::size_t i = 0; i < count; ++i)
    store_from_double(dtype, host, i, expected_value(dtype, op, world_size, i));
}

namespace {

// Bits of the dtype's significand after the point.
int fraction_bits(DType t) {
  switch (t) {
    case DType::kFloat16: return 10;
    case DType::kBFloat16: return 7;
    case DType::kFloat32: return 23;
    default: return 52;
  }
}

// One unit in the last place of v (> 0, normal) in the dtype.
double ulp_of(DType t, double v) {
  int e = 0;
  std::frexp(v, &e);  // v = m * 2^e, 0.5 <= m < 1
  return std::ldexp(1.0, e - 1 - fraction_bits(t));
}

}  // namespace

WrongElements find_wrong_allreduce(DType dtype, ReduceOp op, int world_size, const void* got,
                                   std::size_t count, AvgRounding avg) {
  const std::size_t es = dtype_size(dtype);
  const int n = world_size;
  WrongElements out;
  auto note = [&](std::size_t i) {
    if (out.count++ > 0) return;
    out.first = static_cast<std::int64_t>(i);
    out.got = load_as_double(dtype, got, i);
    out.expected = expected_value(dtype, op, n, i);
  };
  if (avg == AvgRounding::kPreMultiplied && op == ReduceOp::kAvg && dtype_is_floating(dtype) &&
      n > 1 && (n & (n - 1)) != 0) {
    for (std::size_t i = 0; i < count; ++i) {
      const double want = expected_value(dtype, op, n, i);
      const double have = load_as_double(dtype, got, i);
      // NaN compares false: wrong.
      const double tolerance = want > 0 ? (n + 1) * ulp_of(dtype, want) : 0.0;
      if (!(std::fabs(have - want) <= tolerance)) note(i);
    }
    return out;
  }
  // The expected pattern repeats; compare in chunks to bound the scratch.
  constexpr std::size_t kChunk = 1 << 16;
  std::vector<std::uint8_t> expect(kChunk * es);
  const auto* g = static_cast<const std::uint8_t*>(got);
  for (std::size_t base = 0; base < count; base += kChunk) {
    std::size_t m = std::min(kChunk, count - base);
    for (std::size_t j = 0; j < m; ++j)
      store_from_double(dtype, expect.data(), j, expected_value(dtype, op, world_size, base + j));
    if (std::memcmp(expect.data(), g + base * es, m * es) == 0) continue;
    for (std::size_t j = 0; j < m; ++j)
      if (std::memcmp(expect.data() + j * es, g + (base + j) * es, es) != 0) note(base + j);
  }
  return out;
}

std::int64_t count_wrong_allreduce(DType dtype, ReduceOp op, int world_size, const void* got,
                                   std::size_t count, AvgRounding avg) {
  return find_wrong_allreduce(dtype, op, world_size, got, count, avg).count;
}

std::vector<double> allgather_doubles(Communicator& comm, const std::vector<double>& mine,
                                      Millis timeout) {
  const std::size_t k = mine.size();
  const std::size_t n = static_cast<std::size_t>(comm.size());
  CommBuffer send(comm, k * sizeof(double));
  CommBuffer recv(comm, n * k * sizeof(double));
  comm.copy_from_host(send.get(), mine.data(), k * sizeof(double));
  comm.allgather(send.get(), recv.get(), k, DType::kFloat64)->wait(timeout);
  std::vector<double> all(n * k);
  comm.copy_to_host(all.data(), recv.get(), n * k * sizeof(double));
  return all;
}

namespace {

using Clock = std::chrono::steady_clock;

// Ops are issued back to back, as nccl-tests launches them, with at most
// kMaxInFlight outstanding: a CUDA stream's launch queue bounds NCCL the same
// way, and it keeps `-n 1000000` from queueing a million ops (memory, and a
// deadline that would start only after the last one was issued).
constexpr std::size_t kMaxInFlight = 1024;

// Issues n all_reduces; window keeps the last kMaxInFlight of them (slot
// i % kMaxInFlight). Before reusing a slot it waits for the op there, the
// oldest one outstanding.
// `slots` sizes of buffer fit in send and recv: iteration i uses slot
// i mod slots (1: always the start).
void issue_allreduces(Communicator& comm, const SweepOptions& o, void* send, void* recv,
                      std::size_t count, int n, std::vector<std::shared_ptr<Work>>& window,
                      std::size_t slots) {
  const std::size_t bytes = count * dtype_size(o.dtype);
  for (int i = 0; i < n; ++i) {
    auto& slot = window[static_cast<std::size_t>(i) % kMaxInFlight];
    if (slot) slot->wait(o.timeout);
    const std::size_t off = (static_cast<std::size_t>(i) % slots) * bytes;
    slot = comm.allreduce(static_cast<std::uint8_t*>(send) + off, static_cast<std::uint8_t*>(recv) + off,
                          count, o.dtype, o.op);
  }
}

// Waits for the ops issue_allreduces left outstanding: one wait, on the
// newest. Waiting for each in turn woke this thread once per op, a context
// switch that Gloo's threads pay for on a busy machine (256 KiB all_reduces
// at 2 ranks took twice as long). The wait's deadline covers the queue; what
// bounds each op is the watchdog (MonitoredCommunicator), which stops a
// collective that makes no progress for --timeout after the one before it,
// so a long `-n` at a large size is no hang and a stuck op still ends the
// wait.
void wait_outstanding(std::vector<std::shared_ptr<Work>>& window, int n, Millis timeout) {
  if (n <= 0) return;
  const auto outstanding = std::min<std::int64_t>(n, static_cast<std::int64_t>(kMaxInFlight));
  const Millis cap = std::chrono::hours(24 * 365);
  const Millis queue = timeout > cap / outstanding ? cap : timeout * outstanding;
  window[static_cast<std::size_t>(n - 1) % kMaxInFlight]->wait(queue);
}

// Times one block (in-place or out-of-place) of one size; returns this rank's
// time per op in microseconds.
double time_block(Communicator& comm, const SweepOptions& o, void* send, void* recv,
                  std::size_t count, std::size_t slots) {
  std::vector<std::shared_ptr<Work>> window(kMaxInFlight);
  issue_allreduces(comm, o, send, recv, count, o.warmup, window, slots);
  wait_outstanding(window, o.warmup, o.timeout);
  comm.barrier()->wait(o.timeout);
  std::fill(window.begin(), window.end(), nullptr);
  auto t0 = Clock::now();
  issue_allreduces(comm, o, send, recv, count, o.iters, window, slots);
  wait_outstanding(window, o.iters, o.timeout);
  auto t1 = Clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, o.iters);
}

// Runs check_iters correct-input all_reduces and returns this rank's wrong
// elements: those of the check that had the most (an element wrong in every
// iteration counts once), with its first wrong element.
WrongElements check_block(Communicator& comm, const SweepOptions& o, void* send, void* recv,
                         bool in_place, std::size_t count, std::vector<std::uint8_t>& host) {
  const std::size_t bytes = count * dtype_size(o.dtype);
  WrongElements wrong;
  for (int c = 0; c < o.check_iters; ++c) {
    fill_exact_inputs(o.dtype, o.op, comm.size(), comm.rank(), host.data(), count);
    comm.copy_from_host(in_place ? recv : send, host.data(), bytes);
    if (!in_place) {
      // Poison the output so a collective that writes nothing is caught.
      std::memset(host.data(), 0xa5, bytes);
      comm.copy_from_host(recv, host.data(), bytes);
    }
    comm.allreduce(in_place ? recv : send, recv, count, o.dtype, o.op)->wait(o.timeout);
    comm.copy_to_host(host.data(), recv, bytes);
    const auto w = find_wrong_allreduce(
        o.dtype, o.op, comm.size(), host.data(), count,
        comm.backend() == Backend::kNccl ? AvgRounding::kPreMultiplied : AvgRounding::kExact);
    if (w.count > wrong.count) wrong = w;
  }
  return wrong;
}

}  // namespace

void run_allreduce_sweep(Communicator& comm, const SweepOptions& o, std::vector<SizeResult>& out) {
  if (o.collective != Collective::kAllReduce)
    throw UsageError("only all_reduce sweeps are implemented", {"sweep", comm.rank(), -1, ""});
  if (o.sizes.empty()) return;
  const std::size_t max_bytes = *std::max_element(o.sizes.begin(), o.sizes.end());
  CommBuffer send(comm, max_bytes);
  CommBuffer recv(comm, max_bytes);
  std::vector<std::uint8_t> host(max_bytes);
  // Timed iterations run on whatever the buffers hold; start from ordinary
  // numbers (no NaNs or denormals, which are slow on some CPUs). In-place
  // timing lets values grow (even to inf for half), which costs nothing on
  // the hardware we time; the check pass re-seeds its inputs.
  fill_exact_inputs(o.dtype, o.op, comm.size(), comm.rank(), host.data(),
                    max_bytes / dtype_size(o.dtype));
  comm.copy_from_host(send.get(), host.data(), max_bytes);
  comm.copy_from_host(recv.get(), host.data(), max_bytes);
  const double factor = busbw_factor(o.collective, comm.size());
  const int n = comm.size();
  const bool rotate = o.rotate_buffers.value_or(comm.memory_kind() == MemoryKind::kDevice);

  for (std::size_t idx = 0; idx < o.sizes.size(); ++idx) {
    SizeResult res;
    res.bytes = o.sizes[idx];
    res.dtype = o.dtype;
    res.op = o.op;
    res.count = res.bytes / dtype_size(o.dtype);
    // Both blocks' times and wrong elements of this rank, gathered in one
    // go: per block time, wrong count, first wrong index, its value found
    // and expected (indices and counts are exact as doubles up to 2^53).
    constexpr int kPerBlock = 5, kPerRank = 2 * kPerBlock;
    std::vector<double> mine(kPerRank, 0.0);
    mine[2] = mine[kPerBlock + 2] = -1;
    const std::size_t slots = rotate ? std::max<std::size_t>(1, max_bytes / res.bytes) : 1;
    auto put_wrong = [&](int block, const WrongElements& w) {
      mine[block * kPerBlock + 1] = static_cast<double>(w.count);
      mine[block * kPerBlock + 2] = static_cast<double>(w.first);
      mine[block * kPerBlock + 3] = w.got;
      mine[block * kPerBlock + 4] = w.expected;
    };
    if (o.out_of_place) {
      mine[0] = time_block(comm, o, send.get(), recv.get(), res.count, slots);
      if (o.check_iters > 0)
        put_wrong(0, check_block(comm, o, send.get(), recv.get(), false, res.count, host));
    }
    if (o.in_place) {
      mine[kPerBlock] = time_block(comm, o, recv.get(), recv.get(), res.count, slots);
      if (o.check_iters > 0)
        put_wrong(1, check_block(comm, o, send.get(), recv.get(), true, res.count, host));
    }
    auto all = allgather_doubles(comm, mine, o.timeout);
    auto make_block = [&](int block) {
      TimingBlock b;
      b.min_rank_time_us = std::numeric_limits<double>::infinity();
      b.max_rank_time_us = -1;
      double sum_t = 0, wrong = 0;
      for (int r = 0; r < n; ++r) {
        const double* v = &all[static_cast<std::size_t>(r * kPerRank + block * kPerBlock)];
        double t = v[0];
        sum_t += t;
        wrong += v[1];
        if (o.check_iters > 0) {
          b.wrong_by_rank.push_back(static_cast<std::int64_t>(v[1]));
          b.first_wrong_by_rank.push_back({static_cast<std::int64_t>(v[1]),
                                           static_cast<std::int64_t>(v[2]), v[3], v[4]});
        }
        if (t < b.min_rank_time_us) {
          b.min_rank_time_us = t;
          b.fastest_rank = r;
        }
        if (t > b.max_rank_time_us) {
          b.max_rank_time_us = t;
          b.slowest_rank = r;
        }
      }
      b.time_us = sum_t / n;
      b.algbw_gbps = b.time_us > 0 ? static_cast<double>(res.bytes) / (b.time_us * 1e3) : 0;
      b.busbw_gbps = b.algbw_gbps * factor;
      b.wrong = o.check_iters > 0 ? static_cast<std::int64_t>(wrong) : -1;
      return b;
    };
    if (o.out_of_place) res.out_of_place = make_block(0);
    if (o.in_place) res.in_place = make_block(1);
    out.push_back(res);
    if (o.on_size_done) o.on_size_done(idx, out.back());
  }
}

}  // namespace ddpdiag
