// DistributedSampler, index for index with torch.utils.data.DistributedSampler
// (1.13 and 2.x), including torch's CPU randperm (MT19937), and a streaming
// variant with O(1) memory that uses a different, documented permutation.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace ddpdiag::ddp_core {

// Python ints as DistributedSampler sees them: seed + epoch may be anything
// torch.Generator.manual_seed accepts, i.e. [-2^63, 2^64). GCC and Clang
// provide __int128; __extension__ keeps -Wpedantic builds quiet.
__extension__ typedef __int128 SeedInt;

enum class TorchVersion : std::uint8_t {
  k1_13,  // randperm: swap-based Fisher-Yates with 32-bit draws for every n
  k2,     // same for n < kRandpermLargeN; the "inside-out" variant with 64-bit draws above
};
std::optional<TorchVersion> parse_torch_version(std::string_view s);  // "1.13", "2", "2.x", ...
std::string_view torch_version_name(TorchVersion v);                   // "1.13", "2.x"

// torch 2.x switches randperm's algorithm at uint32 max / 20 (= 214,748,364),
// where a 32-bit draw modulo n would start to be visibly non-uniform.
inline constexpr std::int64_t kRandpermLargeN = 4294967295ll / 20;

// The bits torch.Generator().manual_seed(seed) stores: negative seeds wrap to
// uint64 (two's complement). Throws UsageError outside [-2^63, 2^64), where
// torch raises OverflowError.
std::uint64_t torch_manual_seed(SeedInt seed);

// The standard 32-bit Mersenne Twister as torch's CPU generator holds it:
// seeded with the low 32 bits of the 64-bit seed; one draw = one tempered
// 32-bit output; draw64 = (first << 32) | second.
class Mt19937 {
 public:
  explicit Mt19937(std::uint64_t seed);
  std::uint32_t next() {
    if (pos_ == kN) twist();
    return temper(state_[pos_++]);
  }
  std::uint64_t next64() {
    const std::uint64_t hi = next();
    return (hi << 32) | next();
  }
  // n consecutive draws, same as n calls of next(), a block at a time.
  void fill(std::uint32_t* out, std::size_t n);

 private:
  static constexpr std::size_t kN = 624;
  static std::uint32_t temper(std::uint32_t y) {
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
  }
  void twist();
  std::array<std::uint32_t, kN> state_;
  std::size_t pos_ = kN;
};

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)) on CPU.
// The span overloads permute r (r.size() = n) in place; uint32 storage
// needs n <= 2^32 and halves memory. settled_prefix > 0 asks only for
// r[0, settled_prefix) to be final (the swap algorithm fixes position i at
// step i, so later steps can be skipped); the large-n 2.x algorithm ignores
// it and always runs to the end.
std::vector<std::int64_t> randperm(std::int64_t n, std::uint64_t seed, TorchVersion version);
void randperm_into(std::span<std::uint32_t> r, std::uint64_t seed, TorchVersion version,
                   std::uint64_t settled_prefix = 0);
void randperm_into(std::span<std::int64_t> r, std::uint64_t seed, TorchVersion version,
                   std::uint64_t settled_prefix = 0);

struct SamplerOptions {
  std::int64_t dataset_size = 0;  // len(dataset), N
  std::int64_t world_size = 1;    // num_replicas, R
  std::int64_t rank = 0;
  SeedInt seed = 0;
  SeedInt epoch = 0;  // set_epoch takes any Python int; only seed + epoch must suit manual_seed
  bool shuffle = true;
  bool drop_last = false;
  TorchVersion torch_version = TorchVersion::k1_13;
};

struct SamplerShape {
  std::int64_t num_samples = 0;  // indices per rank
  std::int64_t total_size = 0;   // num_samples * world_size
  std::int64_t padding = 0;      // repeated indices added (not drop_last)
  std::int64_t dropped = 0;      // tail indices dropped (drop_last)
};

// num_samples = ceil((N - R) / R) if drop_last and N % R != 0, else ceil(N / R)
// (in integers: floor(N / R) for the first case, which is 0 when N < R).
SamplerShape sampler_shape(std::int64_t dataset_size, std::int64_t world_size, bool drop_last);
// UsageError for N < 0, R < 1, rank outside [0, R), N >= 2^53 (where
// torch's float ceil stops being exact), and, when shuffling, a seed + epoch
// torch's manual_seed would reject. With shuffle=False torch never seeds a
// generator, so any seed and epoch pass, as they do there.
void validate_sampler_options(const SamplerOptions& o);

// This rank's indices [start, start + count) out of num_samples (count < 0:
// to the end), exactly as list(iter(DistributedSampler(range(N), ...))).
// Memory: the whole permutation (4 bytes an index for N <= 2^32, else 8).
std::vector<std::int64_t> distributed_sampler_indices(const SamplerOptions& o,
                                                      std::int64_t start = 0,
                                                      std::int64_t count = -1);

// A keyed bijection of [0, n): a 6-round unbalanced Feistel network on
// k-bit words (2^k the smallest power of two >= n, at least 16) whose round
// function is splitmix64's finaliser of (half ^ round key), made a
// permutation of [0, n) by cycle walking (apply again while the value is
// >= n; fewer than 2 rounds trips on average once n > 8). Round keys come
// from the seed through splitmix64. O(1) memory, ~tens of ns per index.
class FeistelPermutation {
 public:
  FeistelPermutation(std::uint64_t n, std::uint64_t seed);
  std::uint64_t operator()(std::uint64_t x) const;
  std::uint64_t size() const { return n_; }

 private:
  std::uint64_t once(std::uint64_t x) const;
  static constexpr int kRounds = 6;
  std::uint64_t n_;
  int lo_bits_ = 0;  // width of the right half in even rounds
  int hi_bits_ = 0;
  std::array<std::uint64_t, kRounds> keys_{};
};

// The streaming sampler: the same num_samples, padding, dropping and
// striding as DistributedSampler (position p of the padded list holds
// perm(p mod N), this rank takes positions rank, rank + R, ...), but perm is
// FeistelPermutation(N, manual_seed(seed + epoch)) instead of torch's
// randperm, so the indices differ from torch's while every epoch is still a
// permutation split disjointly across ranks. O(1) memory for any N the
// sampler takes (N < 2^53, as above);
// the torch version option does not apply.
class StreamingSampler {
 public:
  explicit StreamingSampler(const SamplerOptions& o);
  std::int64_t size() const { return shape_.num_samples; }
  const SamplerShape& shape() const { return shape_; }
  // The j-th index of this rank, 0 <= j < size().
  std::int64_t at(std::int64_t j) const;
  // Iteration: next() yields indices from the current position on.
  void seek(std::int64_t j);
  std::int64_t position() const { return pos_; }
  std::optional<std::int64_t> next();

 private:
  SamplerOptions opts_;
  SamplerShape shape_;
  FeistelPermutation perm_;
  std::int64_t pos_ = 0;
  std::uint64_t q_ = 0;     // padded position of pos_, mod N
  std::uint64_t step_ = 0;  // R mod N
};

}  // namespace ddpdiag::ddp_core
