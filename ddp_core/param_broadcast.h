// DDP's start-of-training synchronisation: every parameter and buffer is
// broadcast from rank 0 in coalesced chunks (250 MiB by default, at most two
// in flight, as torch's _broadcast_coalesced), then every rank checksums what
// it holds and the checksums are all-gathered, which proves that all ranks
// hold identical parameters, or names the ranks and tensors that differ.
//
// The chunks are torch's: DDP's _sync_module_states calls
// dist._broadcast_coalesced(pg, tensors, broadcast_bucket_size, src), whose
// C++ (c10d broadcast_coalesced in torch/csrc/distributed/c10d/comm.cpp)
// groups the tensors with compute_bucket_assignment_by_size(tensors,
// {buffer_size}) -- the reducer's bucket assignment with one limit, not
// tensor_flatten's take_tensors -- and broadcasts each group flattened.
// Observed in torch 1.13 and 2.x with a tracing process group
// (tests/compat/test_ddp_core_torch.py checks it): a tensor joins the open
// chunk of its dtype; the chunk closes once its bytes reach the cap (>=), so
// the tensor that crosses the cap is still in it; chunks of different dtypes
// fill side by side and go out ordered by their first tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "ddp_core/model_layout.h"

namespace ddpdiag::ddp_core {

inline constexpr std::uint64_t kDefaultBroadcastChunkBytes = 250ull * 1024 * 1024;
// Two chunks in flight: one on the wire while the next is flattened (and the
// one before unflattened), bounding staging memory to two chunks.
inline constexpr int kBroadcastChunksInFlight = 2;

// A tensor in the communicator's memory kind.
struct ParamTensor {
  std::string name;
  void* data = nullptr;
  std::uint64_t bytes = 0;
  DType dtype = DType::kFloat32;  // chunks hold one dtype each, as torch's
};

// One broadcast: tensors (indices into the list, ascending) of one dtype.
struct BroadcastChunk {
  std::vector<std::size_t> tensors;
  std::uint64_t bytes = 0;
  DType dtype = DType::kFloat32;
  bool contiguous = true;  // back to back in memory, in order: broadcast in place
};

// torch's chunks for a cap (see the file comment): every tensor in exactly
// one chunk, chunks ordered by their first tensor. Zero-byte tensors count
// as torch's do (they join their dtype's open chunk). Throws UsageError for
// a cap of 0.
std::vector<BroadcastChunk> broadcast_chunks(std::span<const ParamTensor> tensors,
                                             std::uint64_t chunk_bytes);

// All tensors of a layout in one allocation through comm, back to back in
// layout order (so chunks are contiguous and need no staging copy).
struct LayoutParams {
  CommBuffer flat;
  std::vector<ParamTensor> tensors;
};
LayoutParams allocate_layout_params(Communicator& comm, const ModelLayout& layout);

struct BroadcastOptions {
  std::uint64_t chunk_bytes = kDefaultBroadcastChunkBytes;
  int root = 0;
  Millis timeout{0};  // every wait; zero: the communicator's default
};

struct BroadcastStats {
  std::uint64_t bytes = 0;      // total bytes broadcast
  std::size_t chunks = 0;
  std::size_t staged_chunks = 0;  // chunks that needed a flatten/unflatten copy
  double time_us = 0;
};

// Groups the tensors into broadcast_chunks() (tensors are never split; a
// chunk closes once it reaches chunk_bytes, so it may exceed it by its last
// tensor), and broadcasts each from root. A chunk whose tensors lie back to back in memory
// is broadcast in place; other chunks are flattened into a staging buffer and
// unflattened after (on device memory through the host: the Communicator has
// no device-to-device copy). At most two broadcasts are outstanding.
BroadcastStats broadcast_parameters(Communicator& comm, std::span<const ParamTensor> tensors,
                                    const BroadcastOptions& options = {});

// A 64-bit checksum of bytes (xxHash64-style rounds on 8-byte words, 4 lanes;
// not cryptographic: it detects accidental differences).
std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

struct ParamMismatch {
  int rank = 0;            // the rank whose copy differs from root's
  std::size_t tensor = 0;  // index into the tensor list
  std::string name;
  std::uint64_t checksum = 0;
  std::uint64_t root_checksum = 0;
};

struct ChecksumVerdict {
  bool identical = true;
  std::vector<std::uint64_t> checksums;  // this rank's, one per tensor
  std::vector<ParamMismatch> mismatches;  // the same list on every rank
  std::vector<int> differing_ranks;       // sorted, unique
  int world = 0;
  int root = 0;
  // Every other rank differs from the root, and they all agree with each
  // other (3 ranks or more): the root's copy is the odd one, and
  // differing_ranks is {root}.
  bool root_is_odd = false;
  double time_us = 0;
  std::string describe() const;  // "rank 2 differs in 1 tensor(s): fc.weight ..."
};

// Checksums every tensor on every rank, all-gathers them, and compares each
// rank's with root's.
ChecksumVerdict verify_identical(Communicator& comm, std::span<const ParamTensor> tensors,
                                 int root = 0, Millis timeout = Millis(0));

}  // namespace ddpdiag::ddp_core
