#include "ddp_core/param_broadcast.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>

#include <fmt/core.h>

#include "comm/splitmix64.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/deadline.h"

namespace ddpdiag::ddp_core {

namespace {

using Clock = std::chrono::steady_clock;

Millis effective(Communicator& comm, Millis t) {
  return t.count() > 0 ? t : comm.default_timeout();
}

constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ull;
constexpr std::uint64_t kP2 = 0xC2B2AE3D27D4EB4Full;
constexpr std::uint64_t kP3 = 0x165667B19E3779F9ull;
constexpr std::uint64_t kP4 = 0x85EBCA77C2B2AE63ull;
constexpr std::uint64_t kP5 = 0x27D4EB2F165667C5ull;

inline std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline std::uint64_t round64(std::uint64_t acc, std::uint64_t w) {
  return rotl(acc + w * kP2, 31) * kP1;
}
inline std::uint64_t read64(const std::uint8_t* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

}  // namespace

std::vector<BroadcastChunk> broadcast_chunks(std::span<const ParamTensor> tensors,
                                             std::uint64_t chunk_bytes) {
  if (chunk_bytes == 0)
    throw UsageError("the broadcast chunk size must be at least 1 byte",
                     {"broadcast", -1, -1, "pass --chunk-mb 0.000001 or more"});
  std::vector<BucketTensor> bt;
  bt.reserve(tensors.size());
  for (const auto& t : tensors) bt.push_back({t.bytes, t.dtype, 0, false});
  const std::uint64_t limits[] = {chunk_bytes};
  std::vector<BroadcastChunk> chunks;
  if (tensors.empty()) return chunks;
  for (auto& indices : compute_bucket_assignment_by_size(bt, limits).buckets) {
    BroadcastChunk c;
    c.dtype = tensors[indices.front()].dtype;
    for (std::size_t k = 0; k < indices.size(); ++k) {
      const auto& t = tensors[indices[k]];
      c.bytes += t.bytes;
      if (k > 0) {
        const auto& prev = tensors[indices[k - 1]];
        if (static_cast<const std::uint8_t*>(prev.data) + prev.bytes != t.data) c.contiguous = false;
      }
    }
    c.tensors = std::move(indices);
    chunks.push_back(std::move(c));
  }
  return chunks;
}

LayoutParams allocate_layout_params(Communicator& comm, const ModelLayout& layout) {
  LayoutParams lp;
  lp.flat = CommBuffer(comm, layout.total_bytes());
  std::uint64_t off = 0;
  for (const auto& t : layout.tensors) {
    lp.tensors.push_back({t.name, static_cast<std::uint8_t*>(lp.flat.get()) + off, t.bytes(), t.dtype});
    off += t.bytes();
  }
  return lp;
}

BroadcastStats broadcast_parameters(Communicator& comm, std::span<const ParamTensor> tensors,
                                    const BroadcastOptions& o) {
  if (o.chunk_bytes == 0)
    throw UsageError("the broadcast chunk size must be at least 1 byte",
                     {"broadcast", comm.rank(), -1, "pass --chunk-mb 0.000001 or more"});
  if (o.root < 0 || o.root >= comm.size())
    throw UsageError(fmt::format("broadcast root {} is outside the world of {}", o.root, comm.size()),
                     {"broadcast", comm.rank(), -1, "use root 0"});
  const auto start = Clock::now();
  const Millis timeout = effective(comm, o.timeout);
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  const bool root = comm.rank() == o.root;
  const auto chunks = broadcast_chunks(tensors, o.chunk_bytes);

  BroadcastStats st;
  // One staging buffer per in-flight slot, grown on demand; chunk i uses
  // slot i % 2, so it is reused only after chunk i - 2 was waited for.
  CommBuffer staging[kBroadcastChunksInFlight];
  // On the device, packing and unpacking are device-to-device copies on the
  // communicator's stream (ordered with its broadcasts, no host round trip);
  // a device backend without stream ops goes through `host`.
  StreamOps* ops = device ? comm.stream_ops() : nullptr;
  std::vector<std::uint8_t> host;
  struct InFlight {
    std::size_t chunk;
    std::shared_ptr<Work> work;
    Clock::time_point issued;
  };
  std::deque<InFlight> in_flight;
  // Each chunk has a deadline of its own: the timeout counted from the later
  // of its start and the completion of the chunk before it, as the watchdog
  // counts a collective's. A model whose broadcast takes longer than the
  // timeout in all is no hang while every chunk completes within it, and a
  // chunk that stalls is still caught a timeout after it could have ended.
  Clock::time_point previous_done = start;
  auto deadline_of = [&](const InFlight& f) {
    return std::max(f.issued, previous_done) + timeout;
  };

  auto copy = [&](void* dst, const void* src, std::uint64_t n) {
    if (!device) {
      std::memcpy(dst, src, n);
      return;
    }
    if (ops) {
      ops->copy(dst, src, n);
      return;
    }
    host.resize(n);
    comm.copy_to_host(host.data(), src, n);
    comm.copy_from_host(dst, host.data(), n);
  };
  auto complete_oldest = [&] {
    InFlight f = std::move(in_flight.front());
    in_flight.pop_front();
    f.work->wait(left_until(deadline_of(f)));
    previous_done = Clock::now();
    const BroadcastChunk& c = chunks[f.chunk];
    if (!c.contiguous && !root) {
      auto* base = static_cast<std::uint8_t*>(staging[f.chunk % kBroadcastChunksInFlight].get());
      std::uint64_t off = 0;
      for (std::size_t i : c.tensors) {
        copy(tensors[i].data, base + off, tensors[i].bytes);
        off += tensors[i].bytes;
      }
    }
  };

  try {
    for (std::size_t k = 0; k < chunks.size(); ++k) {
      const BroadcastChunk& c = chunks[k];
      if (in_flight.size() == kBroadcastChunksInFlight) complete_oldest();
      void* buf = tensors[c.tensors.front()].data;
      if (!c.contiguous) {
        auto& s = staging[k % kBroadcastChunksInFlight];
        if (s.bytes() < c.bytes) s = CommBuffer(comm, c.bytes);
        buf = s.get();
        if (root) {
          std::uint64_t off = 0;
          for (std::size_t i : c.tensors) {
            copy(static_cast<std::uint8_t*>(buf) + off, tensors[i].data, tensors[i].bytes);
            off += tensors[i].bytes;
          }
        }
        ++st.staged_chunks;
      }
      in_flight.push_back({k, comm.broadcast(buf, c.bytes, DType::kUInt8, o.root), Clock::now()});
      st.bytes += c.bytes;
      ++st.chunks;
    }
    while (!in_flight.empty()) complete_oldest();
    // The last unpacking copies are only enqueued: the tensors are the
    // caller's once they have landed.
    if (ops && st.staged_chunks > 0) ops->fence()->wait(timeout);
  } catch (...) {
    // Outstanding broadcasts write into buffers that die with this frame.
    // Each gets the timeout from the completion of the one before (after a
    // chunk that timed out, that has passed: the backend is stopped at once).
    for (auto& f : in_flight) {
      try {
        f.work->wait(left_until(previous_done + timeout));
        previous_done = Clock::now();
      } catch (...) {
        comm.abort();
        break;
      }
    }
    throw;
  }
  st.time_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  return st;
}

std::uint64_t checksum64(const void* data, std::size_t n, std::uint64_t seed) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  std::uint64_t h;
  std::size_t i = 0;
  if (n >= 32) {
    std::uint64_t a = seed + kP1 + kP2, b = seed + kP2, c = seed, d = seed - kP1;
    for (; i + 32 <= n; i += 32) {
      a = round64(a, read64(p + i));
      b = round64(b, read64(p + i + 8));
      c = round64(c, read64(p + i + 16));
      d = round64(d, read64(p + i + 24));
    }
    h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18);
    for (std::uint64_t v : {a, b, c, d}) h = (h ^ round64(0, v)) * kP1 + kP4;
  } else {
    h = seed + kP5;
  }
  h += static_cast<std::uint64_t>(n);
  for (; i + 8 <= n; i += 8) h = rotl(h ^ round64(0, read64(p + i)), 27) * kP1 + kP4;
  for (; i < n; ++i) h = rotl(h ^ (p[i] * kP5), 11) * kP1;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  h *= kP3;
  h ^= h >> 32;
  return h;
}

namespace {

// "0, 1, 2" (the first eight, then how many more).
std::string iteration_list(const std::vector<int>& its) {
  std::string s;
  for (std::size_t i = 0; i < its.size() && i < 8; ++i) s += fmt::format("{}{}", i ? ", " : "", its[i]);
  if (its.size() > 8) s += fmt::format(" and {} more", its.size() - 8);
  return s;
}

}  // namespace

std::string ChecksumVerdict::describe() const {
  if (identical)
    return against_expected ? "every rank holds the root's values after every broadcast"
                            : "every rank holds identical parameters";
  if (against_expected) {
    std::string s;
    for (int r : differing_ranks) {
      std::vector<const ParamMismatch*> mine;
      for (const auto& m : mismatches)
        if (m.rank == r) mine.push_back(&m);
      const auto& its = wrong_iterations[static_cast<std::size_t>(r)];
      if (!s.empty()) s += "; ";
      s += fmt::format("rank {}{} holds wrong values after {} of {} broadcast(s) (iteration {}; "
                       "the first {} warm-up) in {} tensor(s):",
                       r, r == root ? " (the root)" : "", its.size(), iterations,
                       iteration_list(its), warmup, mine.size());
      for (std::size_t i = 0; i < mine.size() && i < 5; ++i)
        s += fmt::format(" {} (index {})", mine[i]->name, mine[i]->tensor);
      if (mine.size() > 5) s += fmt::format(" and {} more", mine.size() - 5);
    }
    return s;
  }
  // The tensors a rank's copy differs in, named (the first five).
  const auto tensors_of = [&](int r) {
    std::vector<const ParamMismatch*> mine;
    for (const auto& m : mismatches)
      if (m.rank == r) mine.push_back(&m);
    std::string t = fmt::format("{} tensor(s):", mine.size());
    for (std::size_t i = 0; i < mine.size() && i < 5; ++i)
      t += fmt::format(" {} (index {})", mine[i]->name, mine[i]->tensor);
    if (mine.size() > 5) t += fmt::format(" and {} more", mine.size() - 5);
    return t;
  };
  if (root_is_odd) {
    const int other = root == 0 ? 1 : 0;
    return fmt::format("rank {} (the root) differs from all {} other ranks, which agree with each "
                       "other, in {}",
                       root, world - 1, tensors_of(other));
  }
  if (world == 2 && differing_ranks.size() == 1)
    return fmt::format("ranks 0 and 1 hold different values in {}; with two ranks, which copy "
                       "went bad cannot be told (a third rank would tell)",
                       tensors_of(differing_ranks.front()));
  std::string s;
  for (int r : differing_ranks) {
    std::vector<const ParamMismatch*> mine;
    for (const auto& m : mismatches)
      if (m.rank == r) mine.push_back(&m);
    if (!s.empty()) s += "; ";
    s += fmt::format("rank {} differs from rank 0 in {} tensor(s):", r, mine.size());
    for (std::size_t i = 0; i < mine.size() && i < 5; ++i)
      s += fmt::format(" {} (index {})", mine[i]->name, mine[i]->tensor);
    if (mine.size() > 5) s += fmt::format(" and {} more", mine.size() - 5);
  }
  return s;
}

ChecksumVerdict verify_identical(Communicator& comm, std::span<const ParamTensor> tensors,
                                 int root, Millis timeout) {
  const auto start = Clock::now();
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  ChecksumVerdict v;
  std::vector<std::uint8_t> host;
  for (const auto& t : tensors) {
    const void* p = t.data;
    if (device) {
      host.resize(t.bytes);
      comm.copy_to_host(host.data(), t.data, t.bytes);
      p = host.data();
    }
    v.checksums.push_back(checksum64(p, t.bytes));
  }
  const std::size_t n = tensors.size(), world = static_cast<std::size_t>(comm.size());
  CommBuffer send(comm, n * 8), recv(comm, n * 8 * world);
  if (n) {
    comm.copy_from_host(send.get(), v.checksums.data(), n * 8);
    comm.allgather(send.get(), recv.get(), n, DType::kInt64)->wait(effective(comm, timeout));
  }
  std::vector<std::uint64_t> all(n * world);
  if (n) comm.copy_to_host(all.data(), recv.get(), n * 8 * world);
  const std::uint64_t* ref = all.data() + static_cast<std::size_t>(root) * n;
  for (std::size_t r = 0; r < world; ++r) {
    bool differs = false;
    for (std::size_t i = 0; i < n; ++i)
      if (all[r * n + i] != ref[i]) {
        v.mismatches.push_back({static_cast<int>(r), i, tensors[i].name, all[r * n + i], ref[i]});
        differs = true;
      }
    if (differs) v.differing_ranks.push_back(static_cast<int>(r));
  }
  v.identical = v.mismatches.empty();
  v.world = static_cast<int>(world);
  v.root = root;
  if (world >= 3 && v.differing_ranks.size() == world - 1) {
    // Do the others agree among themselves? Then the root is the odd one.
    const std::size_t other = root == 0 ? 1 : 0;
    bool agree = true;
    for (std::size_t r = 0; r < world && agree; ++r) {
      if (static_cast<int>(r) == root) continue;
      for (std::size_t i = 0; i < n && agree; ++i) agree = all[r * n + i] == all[other * n + i];
    }
    if (agree) {
      v.root_is_odd = true;
      v.differing_ranks = {root};
    }
  }
  v.time_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  return v;
}

void fill_start_pattern(void* host, std::uint64_t bytes, int rank, std::size_t tensor) {
  // Distinct from the other splitmix64 users' seeds; the rank is hashed
  // whole, so ranks r and r + 256 (or any period) differ.
  constexpr std::uint64_t kStartSalt = 0x62726f6164636173ull;  // "broadcas"
  std::uint64_t state =
      splitmix64_mix(splitmix64_mix(kStartSalt + static_cast<std::uint64_t>(rank)) +
                     static_cast<std::uint64_t>(tensor));
  auto* p = static_cast<std::uint8_t*>(host);
  std::uint64_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    const std::uint64_t w = splitmix64_next(state);
    std::memcpy(p + i, &w, 8);
  }
  if (i < bytes) {
    const std::uint64_t w = splitmix64_next(state);
    std::memcpy(p + i, &w, static_cast<std::size_t>(bytes - i));
  }
}

namespace {

std::uint64_t largest(std::span<const ParamTensor> tensors) {
  std::uint64_t m = 0;
  for (const auto& t : tensors) m = std::max(m, t.bytes);
  return m;
}

}  // namespace

void fill_start_values(Communicator& comm, std::span<const ParamTensor> tensors, int rank) {
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  std::vector<std::uint8_t> host(device ? largest(tensors) : 0);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!device) {
      fill_start_pattern(t.data, t.bytes, rank, i);
      continue;
    }
    fill_start_pattern(host.data(), t.bytes, rank, i);
    if (t.bytes) comm.copy_from_host(t.data, host.data(), t.bytes);
  }
}

std::vector<std::uint64_t> start_pattern_checksums(std::span<const ParamTensor> tensors, int rank) {
  std::vector<std::uint8_t> host(largest(tensors));
  std::vector<std::uint64_t> out;
  out.reserve(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    fill_start_pattern(host.data(), tensors[i].bytes, rank, i);
    out.push_back(checksum64(host.data(), tensors[i].bytes));
  }
  return out;
}

std::vector<std::uint64_t> tensor_checksums(Communicator& comm, std::span<const ParamTensor> tensors) {
  const bool device = comm.memory_kind() == MemoryKind::kDevice;
  std::vector<std::uint8_t> host(device ? largest(tensors) : 0);
  std::vector<std::uint64_t> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    const void* p = t.data;
    if (device) {
      if (t.bytes) comm.copy_to_host(host.data(), t.data, t.bytes);
      p = host.data();
    }
    out.push_back(checksum64(p, t.bytes));
  }
  return out;
}

BroadcastChecks start_broadcast_checks(std::vector<std::uint64_t> expected, int iterations) {
  BroadcastChecks c;
  const std::size_t n = expected.size();
  c.expected = std::move(expected);
  c.checksums.assign(n, 0);
  c.wrong_count.assign(n, 0);
  c.first_wrong.assign(n, -1);
  c.wrong_checksum.assign(n, 0);
  c.wrong_tensors.assign(static_cast<std::size_t>(std::max(iterations, 0)), 0);
  c.time_us.assign(c.wrong_tensors.size(), 0);
  return c;
}

std::size_t check_broadcast(Communicator& comm, std::span<const ParamTensor> tensors, int iteration,
                            BroadcastChecks& c) {
  DDPDIAG_ASSERT(tensors.size() == c.expected.size());
  DDPDIAG_ASSERT(iteration >= 0 && static_cast<std::size_t>(iteration) < c.wrong_tensors.size());
  const auto start = Clock::now();
  c.checksums = tensor_checksums(comm, tensors);
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (c.checksums[i] == c.expected[i]) continue;
    ++wrong;
    if (c.wrong_count[i]++ == 0) c.first_wrong[i] = iteration;
    c.wrong_checksum[i] = c.checksums[i];
  }
  const auto it = static_cast<std::size_t>(iteration);
  c.wrong_tensors[it] = wrong;
  c.time_us[it] = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  return wrong;
}

ChecksumVerdict gather_broadcast_checks(Communicator& comm, std::span<const ParamTensor> tensors,
                                        const BroadcastChecks& c, int root, int warmup,
                                        Millis timeout) {
  const auto start = Clock::now();
  const std::size_t n = c.expected.size(), iters = c.wrong_tensors.size();
  const std::size_t world = static_cast<std::size_t>(comm.size());
  DDPDIAG_ASSERT(tensors.size() == n);
  // Per rank: wrong_count[n], first_wrong[n], wrong_checksum[n], wrong_tensors[iters].
  const std::size_t words = 3 * n + iters;
  std::vector<std::uint64_t> mine;
  mine.reserve(words);
  mine.insert(mine.end(), c.wrong_count.begin(), c.wrong_count.end());
  for (auto f : c.first_wrong) mine.push_back(static_cast<std::uint64_t>(f));
  mine.insert(mine.end(), c.wrong_checksum.begin(), c.wrong_checksum.end());
  mine.insert(mine.end(), c.wrong_tensors.begin(), c.wrong_tensors.end());
  std::vector<std::uint64_t> all(words * world);
  if (words) {
    CommBuffer send(comm, words * 8), recv(comm, words * 8 * world);
    comm.copy_from_host(send.get(), mine.data(), words * 8);
    comm.allgather(send.get(), recv.get(), words, DType::kInt64)->wait(effective(comm, timeout));
    comm.copy_to_host(all.data(), recv.get(), words * 8 * world);
  }
  ChecksumVerdict v;
  v.checksums = c.checksums;
  v.world = static_cast<int>(world);
  v.root = root;
  v.against_expected = true;
  v.iterations = static_cast<int>(iters);
  v.warmup = warmup;
  v.wrong_iterations.resize(world);
  for (std::size_t r = 0; r < world; ++r) {
    const std::uint64_t* w = all.data() + r * words;
    for (std::size_t i = 0; i < n; ++i) {
      if (w[i] == 0) continue;
      ParamMismatch m{static_cast<int>(r), i, tensors[i].name, w[2 * n + i], c.expected[i]};
      m.wrong_iterations = w[i];
      m.first_iteration = static_cast<int>(static_cast<std::int64_t>(w[n + i]));
      v.mismatches.push_back(std::move(m));
    }
    for (std::size_t it = 0; it < iters; ++it)
      if (w[3 * n + it]) v.wrong_iterations[r].push_back(static_cast<int>(it));
    if (!v.wrong_iterations[r].empty()) v.differing_ranks.push_back(static_cast<int>(r));
  }
  v.identical = v.mismatches.empty();
  v.time_us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  return v;
}

BroadcastSeries broadcast_series(Communicator& comm, std::span<const ParamTensor> tensors,
                                 std::span<const std::uint64_t> expected,
                                 const BroadcastSeriesOptions& o) {
  const int root = o.broadcast.root;
  const int total = o.warmup + o.iters;
  const Millis timeout = effective(comm, o.broadcast.timeout);
  BroadcastSeries s;
  BroadcastChecks checks =
      start_broadcast_checks(std::vector<std::uint64_t>(expected.begin(), expected.end()), total);
  bool root_ok = false;  // the root holds its pattern (its last check passed)
  for (int it = 0; it < total; ++it) {
    // A broadcast that delivers nothing leaves the refilled values, which
    // the check sees; the root keeps what it holds unless that went bad.
    if (comm.rank() != root || !root_ok) fill_start_values(comm, tensors, comm.rank());
    comm.barrier()->wait(timeout);
    s.stats = broadcast_parameters(comm, tensors, o.broadcast);
    if (it >= o.warmup) s.times_us.push_back(s.stats.time_us);
    if (o.after_broadcast) o.after_broadcast(it);
    root_ok = check_broadcast(comm, tensors, it, checks) == 0;
  }
  s.check_us = checks.time_us;
  s.verdict = gather_broadcast_checks(comm, tensors, checks, root, o.warmup, timeout);
  return s;
}

}  // namespace ddpdiag::ddp_core
