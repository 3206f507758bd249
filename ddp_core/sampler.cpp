#include "ddp_core/sampler.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <numeric>
#include <string>

#include <fmt/core.h>
#include <sys/mman.h>

#include "comm/errors.h"
#include "comm/splitmix64.h"

namespace ddpdiag::ddp_core {

namespace {

// Fisher-Yates touches the permutation at random places; with the draws
// known ahead, prefetching the slot a few steps before the swap hides most
// of the memory latency (the whole point of being faster than torch, whose
// loop takes a cache miss per step for large n).
constexpr std::size_t kDrawBlock = 2048;
constexpr std::size_t kPrefetchDistance = 16;

std::string seed_to_string(SeedInt v) {
  const bool neg = v < 0;
  unsigned __int128 u = neg ? static_cast<unsigned __int128>(-(v + 1)) + 1
                            : static_cast<unsigned __int128>(v);
  std::string s;
  do {
    s.push_back(static_cast<char>('0' + static_cast<int>(u % 10)));
    u /= 10;
  } while (u != 0);
  if (neg) s.push_back('-');
  std::reverse(s.begin(), s.end());
  return s;
}

// torch 1.13 and 2.x for n < kRandpermLargeN: for i in [0, n-1):
// swap(r[i], r[i + draw32() % (n - i)]). Position i is final after step i,
// so only the first `steps` steps run.
template <class T>
void randperm_swap(T* r, std::uint64_t n, Mt19937& gen, std::uint64_t steps) {
  std::uint32_t draws[kDrawBlock];
  std::uint64_t target[kDrawBlock];
  for (std::uint64_t base = 0; base < steps; base += kDrawBlock) {
    const std::size_t m = static_cast<std::size_t>(std::min<std::uint64_t>(kDrawBlock, steps - base));
    gen.fill(draws, m);
    for (std::size_t j = 0; j < m; ++j) {
      const std::uint64_t i = base + j;
      const std::uint64_t left = n - i;
      // A 32-bit draw modulo a range above 2^32 is the draw itself; below,
      // a 32-bit division is several times cheaper than a 64-bit one.
      const std::uint64_t z =
          left > 0xffffffffull ? draws[j]
                               : static_cast<std::uint32_t>(draws[j] % static_cast<std::uint32_t>(left));
      target[j] = i + z;
    }
    for (std::size_t j = 0; j < std::min(kPrefetchDistance, m); ++j)
      __builtin_prefetch(r + target[j], 1);
    for (std::size_t j = 0; j < m; ++j) {
      if (j + kPrefetchDistance < m) __builtin_prefetch(r + target[j + kPrefetchDistance], 1);
      const std::uint64_t i = base + j;
      std::swap(r[i], r[target[j]]);
    }
  }
}

// torch 2.x for n >= kRandpermLargeN ("inside-out" Fisher-Yates):
// for i in [0, n): z = draw64() % (i + 1); r[i] = r[z]; r[z] = i.
// r need not be initialised.
template <class T>
void randperm_inside_out(T* r, std::uint64_t n, Mt19937& gen) {
  std::uint32_t draws[2 * kDrawBlock];
  std::uint64_t target[kDrawBlock];
  for (std::uint64_t base = 0; base < n; base += kDrawBlock) {
    const std::size_t m = static_cast<std::size_t>(std::min<std::uint64_t>(kDrawBlock, n - base));
    gen.fill(draws, 2 * m);
    for (std::size_t j = 0; j < m; ++j) {
      const std::uint64_t d = (static_cast<std::uint64_t>(draws[2 * j]) << 32) | draws[2 * j + 1];
      target[j] = d % (base + j + 1);
    }
    for (std::size_t j = 0; j < std::min(kPrefetchDistance, m); ++j)
      __builtin_prefetch(r + target[j], 1);
    for (std::size_t j = 0; j < m; ++j) {
      if (j + kPrefetchDistance < m) __builtin_prefetch(r + target[j + kPrefetchDistance], 1);
      const std::uint64_t i = base + j;
      const std::uint64_t z = target[j];
      r[i] = r[z];  // z == i reads the not-yet-written slot; the next line fixes it
      r[z] = static_cast<T>(i);
    }
  }
}

template <class T>
void randperm_impl(std::span<T> r, std::uint64_t seed, TorchVersion version,
                   std::uint64_t settled_prefix) {
  const std::uint64_t n = r.size();
  Mt19937 gen(seed);
  if (version == TorchVersion::k2 && n >= static_cast<std::uint64_t>(kRandpermLargeN)) {
    randperm_inside_out(r.data(), n, gen);
    return;
  }
  std::iota(r.begin(), r.end(), T{0});
  if (n < 2) return;
  std::uint64_t steps = n - 1;
  if (settled_prefix > 0) steps = std::min(steps, settled_prefix);
  randperm_swap(r.data(), n, gen, steps);
}

// Fills out[j] = padded[p_j] for p_j = rank + (start + j) * R, where
// padded[p] = perm(p mod N). The padded list is never built: position mod N
// advances by R mod N each step.
// Storage for a whole permutation. Uninitialised (randperm writes every slot
// before reading it: no zero-fill pass over gigabytes), and backed by
// transparent huge pages where the kernel offers them: Fisher-Yates reads
// and writes at random places, and with 4 KiB pages nearly every step would
// also miss the TLB.
template <class T>
class PermBuffer {
 public:
  explicit PermBuffer(std::uint64_t n) : n_(n), bytes_(std::max<std::uint64_t>(n, 1) * sizeof(T)) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
      throw UsageError(fmt::format("cannot allocate {} MiB for a permutation of {} indices",
                                   bytes_ >> 20, n),
                       ErrorContext{"sampler", -1, -1, "use --streaming for O(1) memory"});
    (void)madvise(p, bytes_, MADV_HUGEPAGE);  // advice only: fine to fail
    data_ = static_cast<T*>(p);
  }
  ~PermBuffer() { munmap(data_, bytes_); }
  PermBuffer(const PermBuffer&) = delete;
  PermBuffer& operator=(const PermBuffer&) = delete;
  std::span<T> span() { return {data_, n_}; }
  T operator[](std::uint64_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  std::uint64_t n_;
  std::uint64_t bytes_;
};

// Position j of this rank in the padded list, reduced mod N. The padded
// list is never built: padded[p] = perm(p mod N). rank + j * R stays below
// total_size + R <= N + 2R, which fits in 64 bits for the sizes validated.
std::uint64_t padded_position(const SamplerOptions& o, std::int64_t j) {
  return (static_cast<std::uint64_t>(j) * static_cast<std::uint64_t>(o.world_size) +
          static_cast<std::uint64_t>(o.rank)) %
         static_cast<std::uint64_t>(o.dataset_size);
}

// Fills out[j] = padded[p_j] for p_j = rank + (start + j) * R; the position
// mod N advances by R mod N each step.
template <class PermAt>
void stride_positions(const SamplerOptions& o, std::int64_t start, std::int64_t count,
                      std::int64_t* out, PermAt&& perm_at) {
  const auto n = static_cast<std::uint64_t>(o.dataset_size);
  const std::uint64_t step = static_cast<std::uint64_t>(o.world_size) % n;
  std::uint64_t q = padded_position(o, start);
  for (std::int64_t j = 0; j < count; ++j) {
    out[j] = perm_at(q);
    q += step;
    if (q >= n) q -= n;
  }
}

}  // namespace

std::optional<TorchVersion> parse_torch_version(std::string_view s) {
  // 1.13.N: every 1.13 release draws the same permutations.
  const auto patch = s.substr(std::min(s.size(), std::size_t{5}));
  if (s == "1.13" || s == "1" ||
      (s.starts_with("1.13.") && !patch.empty() && patch.find_first_not_of("0123456789") == std::string_view::npos))
    return TorchVersion::k1_13;
  if (s == "2" || s == "2.x" || s.starts_with("2.")) return TorchVersion::k2;
  return std::nullopt;
}

std::string_view torch_version_name(TorchVersion v) {
  return v == TorchVersion::k1_13 ? "1.13" : "2.x";
}

std::uint64_t torch_manual_seed(SeedInt seed) {
  const SeedInt lo = -(SeedInt{1} << 63);
  const SeedInt hi = SeedInt{1} << 64;  // exclusive
  if (seed < lo || seed >= hi)
    throw UsageError(
        fmt::format("seed + epoch = {} is outside the range torch's manual_seed accepts", seed_to_string(seed)),
        ErrorContext{"sampler", -1, -1,
                     "keep seed + epoch in [-2^63, 2^64) (outside, torch's manual_seed refuses it: \"Overflow when unpacking long\")"});
  // Two's complement wrap of negative seeds, as torch reinterprets int64 as uint64.
  return static_cast<std::uint64_t>(static_cast<unsigned __int128>(seed));
}

Mt19937::Mt19937(std::uint64_t seed) {
  state_[0] = static_cast<std::uint32_t>(seed);
  for (std::size_t i = 1; i < kN; ++i)
    state_[i] = 1812433253u * (state_[i - 1] ^ (state_[i - 1] >> 30)) + static_cast<std::uint32_t>(i);
  pos_ = kN;
}

void Mt19937::twist() {
  constexpr std::size_t kM = 397;
  auto mix = [](std::uint32_t upper, std::uint32_t lower, std::uint32_t far) {
    const std::uint32_t y = (upper & 0x80000000u) | (lower & 0x7fffffffu);
    return far ^ (y >> 1) ^ ((y & 1u) ? 0x9908b0dfu : 0u);
  };
  // Split into ranges so no index needs a modulo (lets the compiler vectorise).
  std::size_t i = 0;
  for (; i < kN - kM; ++i) state_[i] = mix(state_[i], state_[i + 1], state_[i + kM]);
  for (; i < kN - 1; ++i) state_[i] = mix(state_[i], state_[i + 1], state_[i + kM - kN]);
  state_[kN - 1] = mix(state_[kN - 1], state_[0], state_[kM - 1]);
  pos_ = 0;
}

void Mt19937::fill(std::uint32_t* out, std::size_t n) {
  while (n > 0) {
    if (pos_ == kN) twist();
    const std::size_t m = std::min(n, kN - pos_);
    for (std::size_t j = 0; j < m; ++j) out[j] = temper(state_[pos_ + j]);
    pos_ += m;
    out += m;
    n -= m;
  }
}

std::vector<std::int64_t> randperm(std::int64_t n, std::uint64_t seed, TorchVersion version) {
  if (n < 0)
    throw UsageError(fmt::format("randperm: n must be non-negative, got {}", n),
                     ErrorContext{"sampler", -1, -1, ""});
  std::vector<std::int64_t> r(static_cast<std::size_t>(n));
  randperm_into(std::span<std::int64_t>(r), seed, version);
  return r;
}

void randperm_into(std::span<std::uint32_t> r, std::uint64_t seed, TorchVersion version,
                   std::uint64_t settled_prefix) {
  DDPDIAG_ASSERT(r.size() <= (std::uint64_t{1} << 32));
  randperm_impl(r, seed, version, settled_prefix);
}

void randperm_into(std::span<std::int64_t> r, std::uint64_t seed, TorchVersion version,
                   std::uint64_t settled_prefix) {
  randperm_impl(r, seed, version, settled_prefix);
}

SamplerShape sampler_shape(std::int64_t dataset_size, std::int64_t world_size, bool drop_last) {
  DDPDIAG_ASSERT(dataset_size >= 0 && world_size >= 1);
  SamplerShape s;
  if (drop_last && dataset_size % world_size != 0) {
    // ceil((N - R) / R) = floor(N / R) when R does not divide N (0 for N < R).
    s.num_samples = dataset_size / world_size;
  } else {
    s.num_samples = dataset_size / world_size + (dataset_size % world_size != 0 ? 1 : 0);
  }
  s.total_size = s.num_samples * world_size;
  if (s.total_size >= dataset_size)
    s.padding = s.total_size - dataset_size;
  else
    s.dropped = dataset_size - s.total_size;
  return s;
}

void validate_sampler_options(const SamplerOptions& o) {
  auto bad = [](std::string msg, std::string hint) {
    throw UsageError(std::move(msg), ErrorContext{"sampler", -1, -1, std::move(hint)});
  };
  if (o.world_size < 1)
    bad(fmt::format("world size must be at least 1, got {}", o.world_size),
        "pass --world-size R with R >= 1");
  if (o.rank < 0 || o.rank >= o.world_size)
    bad(fmt::format("rank {} is out of range for world size {}", o.rank, o.world_size),
        fmt::format("ranks run from 0 to {} (DistributedSampler raises ValueError here)",
                    o.world_size - 1));
  // Keeps rank + j * R (< N + 2R) and num_samples * R inside 64-bit integers.
  if (o.world_size > (std::int64_t{1} << 40))
    bad(fmt::format("world size {} is larger than any real job (limit 2^40)", o.world_size),
        "pass the job's number of ranks (--world-size, at most 1099511627776)");
  if (o.dataset_size < 0)
    bad(fmt::format("dataset size must be >= 0, got {}", o.dataset_size),
        "pass the dataset's length, len(dataset)");
  if (o.dataset_size >= (std::int64_t{1} << 53))
    bad(fmt::format("dataset size {} is not below 2^53, where DistributedSampler's float "
                    "arithmetic is no longer exact",
                    o.dataset_size),
        "use a smaller dataset size");
  if (o.shuffle) (void)torch_manual_seed(o.seed + o.epoch);
}

std::vector<std::int64_t> distributed_sampler_indices(const SamplerOptions& o, std::int64_t start,
                                                      std::int64_t count) {
  validate_sampler_options(o);
  const SamplerShape shape = sampler_shape(o.dataset_size, o.world_size, o.drop_last);
  if (start < 0 || start > shape.num_samples)
    throw UsageError(fmt::format("start {} is outside this rank's {} indices", start, shape.num_samples),
                     ErrorContext{"sampler", -1, -1, "use 0 <= --start <= num_samples"});
  if (count < 0 || count > shape.num_samples - start) count = shape.num_samples - start;
  std::vector<std::int64_t> out(static_cast<std::size_t>(count));
  if (count == 0) return out;
  const auto n = static_cast<std::uint64_t>(o.dataset_size);
  if (!o.shuffle) {
    stride_positions(o, start, count, out.data(), [](std::uint64_t q) { return static_cast<std::int64_t>(q); });
    return out;
  }
  const std::uint64_t seed = torch_manual_seed(o.seed + o.epoch);
  // The last padded position this call reads; below N it bounds the steps
  // the swap algorithm must run (position i is final after step i).
  const std::uint64_t last_pos = static_cast<std::uint64_t>(start + count - 1) *
                                     static_cast<std::uint64_t>(o.world_size) +
                                 static_cast<std::uint64_t>(o.rank);
  const std::uint64_t settled = last_pos < n ? last_pos + 1 : 0;
  if (n <= (std::uint64_t{1} << 32)) {
    PermBuffer<std::uint32_t> perm(n);
    randperm_into(perm.span(), seed, o.torch_version, settled);
    stride_positions(o, start, count, out.data(),
                     [&](std::uint64_t q) { return static_cast<std::int64_t>(perm[q]); });
  } else {
    PermBuffer<std::int64_t> perm(n);
    randperm_into(perm.span(), seed, o.torch_version, settled);
    stride_positions(o, start, count, out.data(), [&](std::uint64_t q) { return perm[q]; });
  }
  return out;
}

FeistelPermutation::FeistelPermutation(std::uint64_t n, std::uint64_t seed) : n_(n) {
  int k = 4;  // at least 16 values, so tiny n still get some mixing
  while (k < 64 && (std::uint64_t{1} << k) < n) ++k;
  lo_bits_ = k / 2;
  hi_bits_ = k - lo_bits_;
  std::uint64_t s = seed;
  for (auto& key : keys_) key = splitmix64_next(s);
}

std::uint64_t FeistelPermutation::once(std::uint64_t x) const {
  // x = (L << b) | R with L of a bits and R of b bits. A round maps it to
  // (R << a) | (L ^ F(R)): invertible, and the halves swap widths, so after
  // an even number of rounds the widths are back where they started.
  int a = hi_bits_, b = lo_bits_;
  for (int round = 0; round < kRounds; ++round) {
    const std::uint64_t right = x & ((std::uint64_t{1} << b) - 1);
    const std::uint64_t left = x >> b;
    const std::uint64_t f = splitmix64_mix(right ^ keys_[round]) & ((std::uint64_t{1} << a) - 1);
    x = (right << a) | (left ^ f);
    std::swap(a, b);
  }
  return x;
}

std::uint64_t FeistelPermutation::operator()(std::uint64_t x) const {
  DDPDIAG_ASSERT(x < n_);
  // Cycle walking: the cycle of the 2^k-permutation through x returns into
  // [0, n) before it returns to x, so this is a bijection of [0, n).
  do {
    x = once(x);
  } while (x >= n_);
  return x;
}

StreamingSampler::StreamingSampler(const SamplerOptions& o)
    : opts_(o),
      shape_((validate_sampler_options(o), sampler_shape(o.dataset_size, o.world_size, o.drop_last))),
      perm_(static_cast<std::uint64_t>(std::max<std::int64_t>(o.dataset_size, 1)),
            o.shuffle ? torch_manual_seed(o.seed + o.epoch) : 0) {
  if (o.dataset_size > 0) {
    step_ = static_cast<std::uint64_t>(o.world_size) % static_cast<std::uint64_t>(o.dataset_size);
    q_ = padded_position(o, 0);
  }
}

std::int64_t StreamingSampler::at(std::int64_t j) const {
  DDPDIAG_ASSERT(j >= 0 && j < shape_.num_samples);
  const std::uint64_t q = padded_position(opts_, j);
  return static_cast<std::int64_t>(opts_.shuffle ? perm_(q) : q);
}

void StreamingSampler::seek(std::int64_t j) {
  pos_ = j;
  if (j >= 0 && j < shape_.num_samples) q_ = padded_position(opts_, j);
}

std::optional<std::int64_t> StreamingSampler::next() {
  if (pos_ < 0 || pos_ >= shape_.num_samples) return std::nullopt;
  // q_ is padded_position(pos_), advanced without a division.
  const std::uint64_t q = q_;
  ++pos_;
  q_ += step_;
  if (q_ >= static_cast<std::uint64_t>(opts_.dataset_size)) q_ -= static_cast<std::uint64_t>(opts_.dataset_size);
  return static_cast<std::int64_t>(opts_.shuffle ? perm_(q) : q);
}

}  // namespace ddpdiag::ddp_core
