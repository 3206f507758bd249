// splitmix64: the 64-bit finaliser and the generator that steps a state by
// the golden-ratio gamma and finalises it. One definition for the streaming
// sampler's round keys (whose permutation is documented, so these constants
// must not change), the backward simulator's sparse rows and the store
// client's seeds.
#pragma once

#include <cstdint>

namespace ddpdiag {

inline constexpr std::uint64_t kSplitmix64Gamma = 0x9e3779b97f4a7c15ull;

inline std::uint64_t splitmix64_mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Advances state by the gamma and returns the finalised new state.
inline std::uint64_t splitmix64_next(std::uint64_t& state) {
  return splitmix64_mix(state += kSplitmix64Gamma);
}

}  // namespace ddpdiag
