#include "ddp_core/backward_sim.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <span>
#include <thread>

#include <fmt/core.h>

#include "comm/splitmix64.h"

namespace ddpdiag::ddp_core {

namespace {

// The seed of k's sequence for one (rank, parameter, iteration).
struct KSequence {
  std::uint32_t seed = 0;
};

// The header's formula: k = top 4 bits of a 32-bit mix of (seed, i), - 8.
// (Cheap, and it vectorises: the fill runs inside the simulated backward.)
inline int k_of(const KSequence& q, std::size_t i) {
  std::uint32_t x = q.seed + static_cast<std::uint32_t>(i) * 0x9e3779b9u;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return static_cast<int>(x >> 28) - 8;
}

KSequence base_of(int rank, std::size_t param, std::uint64_t iteration) {
  const std::uint64_t h = splitmix64_mix(
      splitmix64_mix(splitmix64_mix(static_cast<std::uint64_t>(param) + kSplitmix64Gamma) ^
                     static_cast<std::uint64_t>(static_cast<std::uint32_t>(rank))) ^
      iteration);
  return {static_cast<std::uint32_t>(h ^ (h >> 32))};
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// The mix's 32-bit multiplies have no SSE2 instruction; with AVX2 (picked
// at load time, where the CPU has it) the float fill runs about twice as
// fast, so gradients are written at a rate closer to a real backward's.
#define DDPDIAG_FILL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DDPDIAG_FILL_CLONES
#endif

DDPDIAG_FILL_CLONES
void fill(DType t, void* buf, std::size_t n, int world, int rank, std::size_t p,
          std::uint64_t it, double scale) {
  const KSequence base = base_of(rank, p, it);
  if (t == DType::kFloat32) {
    auto* d = static_cast<float*>(buf);
    const float m = static_cast<float>(world * scale);
    for (std::size_t i = 0; i < n; ++i) d[i] = m * static_cast<float>(k_of(base, i));
    return;
  }
  for (std::size_t i = 0; i < n; ++i)
    store_from_double(t, buf, i, world * scale * k_of(base, i));
}

std::size_t row_numel_of(const TensorSpec& t) {
  return static_cast<std::size_t>(t.numel() / t.shape[0]);
}

// Waits until t, polling the reducer: sleeps while far away (the machine may
// have fewer cores than ranks, and the communicators' threads need them),
// spins for the last stretch, where sleeps overshoot.
void wait_until(ReducerClock::time_point t, Reducer& reducer) {
  using namespace std::chrono;
  constexpr auto kSpinWindow = microseconds(300);
  for (;;) {
    reducer.poll();
    const auto now = ReducerClock::now();
    if (now >= t) return;
    if (t - now > kSpinWindow)
      std::this_thread::sleep_for(std::min<ReducerClock::duration>(t - now - kSpinWindow,
                                                                   microseconds(500)));
    else
      std::this_thread::yield();
  }
}

}  // namespace

double BackwardSimResult::backward_us() const {
  return std::chrono::duration<double, std::micro>(end - start).count();
}

double sim_gradient_value(int world_size, int rank, std::size_t param, std::size_t i,
                          std::uint64_t iteration, double scale) {
  return world_size * scale * k_of(base_of(rank, param, iteration), i);
}

std::vector<std::int64_t> sim_sparse_rows(const TensorSpec& t, int rank, std::size_t param,
                                          std::uint64_t iteration,
                                          std::optional<std::int64_t> sparse_rows) {
  if (t.shape.empty() || t.shape[0] <= 0) return {};
  const std::int64_t v = t.shape[0];
  const std::int64_t m = sparse_rows ? std::max<std::int64_t>(0, *sparse_rows)
                                     : std::min(v, kDefaultSparseRows);
  std::uint64_t state = 0x5eed0000ULL ^ (static_cast<std::uint64_t>(param) << 40) ^
                        (static_cast<std::uint64_t>(rank) << 24) ^ iteration;
  splitmix64_next(state);
  std::vector<std::int64_t> rows(static_cast<std::size_t>(m));
  for (auto& r : rows) r = static_cast<std::int64_t>(splitmix64_next(state) % static_cast<std::uint64_t>(v));
  return rows;
}

UsedBy used_by_all_but(const std::vector<std::size_t>& unused, std::size_t param_count) {
  if (unused.empty()) return {};
  std::vector<std::uint8_t> is_unused(param_count, 0);
  for (std::size_t p : unused)
    if (p < param_count) is_unused[p] = 1;
  return [is_unused = std::move(is_unused)](int, std::size_t p) { return p >= is_unused.size() || !is_unused[p]; };
}

BackwardSimResult simulate_backward(Reducer& reducer, Communicator& comm, std::uint64_t iteration,
                                    const BackwardSimOptions& o) {
  const auto& tensors = reducer.layout().tensors;
  const int world = comm.size(), rank = comm.rank();
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  std::vector<std::uint8_t> skip(tensors.size(), 0);
  for (std::size_t p : o.unused)
    if (p < skip.size()) skip[p] = 1;
  if (o.sparse_rows && *o.sparse_rows < 0)
    throw UsageError(fmt::format("sparse_rows must be >= 0, got {}", *o.sparse_rows),
                     {"backward_sim", rank, -1, "pass --sparse-rows 0 or more"});
  if (o.declare_unused && !o.unused.empty())
    reducer.prepare_for_backward(o.unused);
  else
    reducer.prepare_for_backward();

  BackwardSimResult r;
  r.start = ReducerClock::now();
  // Each tensor's end time is on a schedule from the start, so sleeping
  // overshoots do not accumulate over 161 (or 400) tensors.
  double scheduled_s = 0;
  std::vector<std::uint8_t> staging;
  for (std::size_t k : reducer.layout().gradient_ready_order()) {
    if (skip[k]) continue;
    const auto& t = tensors[k];
    const auto n = static_cast<std::size_t>(t.numel());
    std::uint64_t bytes = t.bytes();
    if (t.expects_sparse) {
      const auto rows = sim_sparse_rows(t, rank, k, iteration, o.sparse_rows);
      const std::size_t values = rows.empty() ? 0 : rows.size() * row_numel_of(t);
      bytes = values * dtype_size(t.dtype);
      staging.resize(bytes);
      fill(t.dtype, staging.data(), values, world, rank, k, iteration, o.value_scale);
      reducer.set_sparse_grad(k, rows,
                              std::as_bytes(std::span<const std::uint8_t>(staging.data(), bytes)));
    } else if (device) {
      staging.resize(t.bytes());
      fill(t.dtype, staging.data(), n, world, rank, k, iteration, o.value_scale);
      comm.copy_from_host(reducer.grad(k), staging.data(), t.bytes());
    } else {
      fill(t.dtype, reducer.grad(k), n, world, rank, k, iteration, o.value_scale);
    }
    if (o.compute_gbps > 0) {
      scheduled_s += static_cast<double>(bytes) / (o.compute_gbps * 1e9);
      wait_until(r.start + std::chrono::duration_cast<ReducerClock::duration>(
                               std::chrono::duration<double>(scheduled_s)),
                 reducer);
    }
    reducer.mark_ready(k);
    // Without a compute rate there is no wait_until to poll from: observe
    // completions between gradients all the same, or every bucket's
    // completion would first be seen in finalize, at the end of backward.
    if (o.compute_gbps <= 0) reducer.poll();
  }
  r.end = ReducerClock::now();
  return r;
}

GradientCheck check_gradients(const Reducer& reducer, Communicator& comm, std::uint64_t iteration,
                              double scale, double tol, const UsedBy& used_by,
                              std::optional<std::int64_t> sparse_rows) {
  const auto& tensors = reducer.layout().tensors;
  const int world = comm.size();
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  GradientCheck c;
  std::vector<std::uint8_t> host;
  std::vector<int> users;
  std::size_t at_param = 0, at_element = 0;  // what judge is looking at
  auto judge = [&](double have, long sum, long abs_sum) {
    const double want = scale * static_cast<double>(sum);
    const double err = std::fabs(have - want);
    c.max_abs_error = std::max(c.max_abs_error, err);
    const bool ok = tol == 0 ? have == static_cast<double>(static_cast<float>(want)) || have == want
                             : err <= tol * std::fabs(scale) * static_cast<double>(abs_sum + 1) +
                                          1e-30;
    if (ok && !std::isnan(have)) return;
    if (c.wrong++ == 0) {
      c.first_wrong_param = static_cast<std::int64_t>(at_param);
      c.first_wrong_element = static_cast<std::int64_t>(at_element);
      c.first_wrong_have = have;
      c.first_wrong_want = want;
    }
  };
  for (std::size_t p = 0; p < tensors.size(); ++p) {
    const auto& t = tensors[p];
    const auto n = static_cast<std::size_t>(t.numel());
    at_param = p;
    users.clear();
    for (int r = 0; r < world; ++r)
      if (!used_by || used_by(r, p)) users.push_back(r);
    std::vector<KSequence> bases;
    for (int r : users) bases.push_back(base_of(r, p, iteration));
    if (t.expects_sparse) {
      // The coalesced result: exactly the rows some user touched, each with
      // the sum of every user's entries at that row.
      const std::size_t rn = row_numel_of(t);
      std::map<std::int64_t, std::pair<std::vector<long>, std::vector<long>>> want;
      for (std::size_t u = 0; u < users.size(); ++u) {
        const auto rows = sim_sparse_rows(t, users[u], p, iteration, sparse_rows);
        for (std::size_t j = 0; j < rows.size(); ++j) {
          auto& [sum, abs_sum] = want[rows[j]];
          sum.resize(rn, 0);
          abs_sum.resize(rn, 0);
          for (std::size_t e = 0; e < rn; ++e) {
            const int k = k_of(bases[u], j * rn + e);
            sum[e] += k;
            abs_sum[e] += k < 0 ? -k : k;
          }
        }
      }
      const SparseGrad g = reducer.sparse_grad(p);
      const std::size_t elem = dtype_size(t.dtype);
      std::size_t matched = 0;
      for (const auto& [row, sums] : want) {
        const auto it = std::lower_bound(g.rows.begin(), g.rows.end(), row);
        if (it == g.rows.end() || *it != row) {
          c.wrong += static_cast<std::int64_t>(rn);  // a touched row is missing
          continue;
        }
        ++matched;
        const auto* vals = g.values.data() +
                           static_cast<std::size_t>(it - g.rows.begin()) * rn * elem;
        for (std::size_t e = 0; e < rn; ++e) {
          at_element = static_cast<std::size_t>(row) * rn + e;
          judge(load_as_double(t.dtype, vals, e), sums.first[e], sums.second[e]);
        }
      }
      // Rows in the result that nobody touched.
      c.wrong += static_cast<std::int64_t>((g.rows.size() - matched) * rn);
      c.checked += static_cast<std::int64_t>(std::max(want.size(), g.rows.size()) * rn);
      continue;
    }
    if (users.empty()) {
      c.unused += static_cast<std::int64_t>(n);
      continue;
    }
    const void* got = reducer.grad(p);
    if (device) {
      host.resize(t.bytes());
      comm.copy_to_host(host.data(), got, t.bytes());
      got = host.data();
    }
    for (std::size_t i = 0; i < n; ++i) {
      long sum = 0, abs_sum = 0;
      for (const auto& b : bases) {
        const int k = k_of(b, i);
        sum += k;
        abs_sum += k < 0 ? -k : k;
      }
      at_element = i;
      judge(t.dtype == DType::kFloat32 ? static_cast<const float*>(got)[i]
                                       : load_as_double(t.dtype, got, i),
            sum, abs_sum);
    }
    c.checked += static_cast<std::int64_t>(n);
  }
  return c;
}

}  // namespace ddpdiag::ddp_core
