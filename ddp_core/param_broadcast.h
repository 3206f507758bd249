// DDP's start-of-training synchronisation: every parameter and buffer is
// broadcast from rank 0 in coalesced chunks (250 MiB by default, at most two
// in flight, as torch's _broadcast_coalesced), then every rank checksums what
// it holds and the checksums are all-gathered, which proves that all ranks
// hold identical parameters, or names the ranks and tensors that differ.
//
// broadcast-test's proof (broadcast_series) goes further: every rank starts
// each broadcast from its own known pattern, and after each one compares its
// checksums with those of the root's pattern, computed locally without any
// communication. A broadcast that delivers nothing, or a root whose own copy
// went bad, is then caught after any iteration, and the wrong rank is named
// at any world size, the root included.
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
#include <functional>
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
  // Each chunk's deadline, counted from the later of its start and the
  // completion of the chunk before it; zero: the communicator's default.
  Millis timeout{0};
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
// unflattened after (on device memory by device-to-device copies on the
// communicator's stream, StreamOps::copy, waited for before it returns; only
// a device backend without stream ops goes through the host). At most two
// broadcasts are outstanding.
BroadcastStats broadcast_parameters(Communicator& comm, std::span<const ParamTensor> tensors,
                                    const BroadcastOptions& options = {});

// A 64-bit checksum of bytes (xxHash64-style rounds on 8-byte words, 4 lanes;
// not cryptographic: it detects accidental differences).
std::uint64_t checksum64(const void* data, std::size_t bytes, std::uint64_t seed = 0);

struct ParamMismatch {
  int rank = 0;            // the rank whose copy differs from root's (or from the expected values)
  std::size_t tensor = 0;  // index into the tensor list
  std::string name;
  std::uint64_t checksum = 0;       // what the rank held (checked series: after its last wrong iteration)
  std::uint64_t root_checksum = 0;  // what the root held; checked series: what every rank must hold
  // Checked series only (gather_broadcast_checks): the iterations, warm-ups
  // included and counted from 0, after which this tensor was wrong, and the first.
  std::size_t wrong_iterations = 0;
  int first_iteration = -1;
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
  // Checked series (gather_broadcast_checks): every rank was compared with
  // the values it must hold, not with the root, so differing_ranks are the
  // wrong ones at any world size (the root included); iterations is the
  // number checked (warm-ups included, the first `warmup` of them), and
  // wrong_iterations[r] the iterations after which rank r held wrong values.
  bool against_expected = false;
  int iterations = 0;
  int warmup = 0;
  std::vector<std::vector<int>> wrong_iterations;  // per rank
  std::string describe() const;  // "rank 2 differs in 1 tensor(s): fc.weight ..."
};

// Checksums every tensor on every rank, all-gathers them, and compares each
// rank's with root's.
ChecksumVerdict verify_identical(Communicator& comm, std::span<const ParamTensor> tensors,
                                 int root = 0, Millis timeout = Millis(0));

// --- Checked broadcasts: every rank against the values it must hold --------

// The bytes rank `rank` starts tensor `tensor` with, written to host memory:
// a splitmix64 stream seeded by a hash of (rank, tensor), so no two ranks
// (at any world size: no period in the rank) and no two tensors share a
// pattern. After a broadcast from root every rank must hold root's pattern.
void fill_start_pattern(void* host, std::uint64_t bytes, int rank, std::size_t tensor);
// Writes rank's pattern into every tensor, in comm's memory kind (device
// memory through a host buffer of the largest tensor).
void fill_start_values(Communicator& comm, std::span<const ParamTensor> tensors, int rank);
// checksum64 of each tensor's pattern for rank, computed on this rank alone
// (only the tensors' sizes are read): what every rank must hold after a
// broadcast from `rank`.
std::vector<std::uint64_t> start_pattern_checksums(std::span<const ParamTensor> tensors, int rank);
// checksum64 of each tensor as this rank holds it (device memory through the host).
std::vector<std::uint64_t> tensor_checksums(Communicator& comm, std::span<const ParamTensor> tensors);

// This rank's record of a series of checks, one after each broadcast: what
// it held against `expected`, per tensor and per iteration. Local only;
// gather_broadcast_checks() all-gathers it once for the series.
struct BroadcastChecks {
  std::vector<std::uint64_t> expected;      // per tensor: the root's pattern's checksum
  std::vector<std::uint64_t> checksums;     // per tensor: the last check's
  std::vector<std::uint64_t> wrong_count;   // per tensor: iterations after which it was wrong
  std::vector<std::int64_t> first_wrong;    // per tensor: the first such iteration, -1 for none
  std::vector<std::uint64_t> wrong_checksum;  // per tensor: what it held in its last wrong iteration
  std::vector<std::uint64_t> wrong_tensors;   // per iteration: how many tensors were wrong after it
  std::vector<double> time_us;                // per iteration: the check's time
};
BroadcastChecks start_broadcast_checks(std::vector<std::uint64_t> expected, int iterations);
// Checksums this rank's tensors and records iteration's result in checks.
// Returns how many tensors were wrong. No communication.
std::size_t check_broadcast(Communicator& comm, std::span<const ParamTensor> tensors, int iteration,
                            BroadcastChecks& checks);
// All-gathers every rank's checks (one all_gather of 3 words per tensor and
// one per iteration) into a verdict, the same on every rank, that names
// each wrong rank with its tensors and iterations.
ChecksumVerdict gather_broadcast_checks(Communicator& comm, std::span<const ParamTensor> tensors,
                                        const BroadcastChecks& checks, int root, int warmup,
                                        Millis timeout = Millis(0));

struct BroadcastSeriesOptions {
  BroadcastOptions broadcast;
  int warmup = 0;
  int iters = 1;
  // Testing seam (--corrupt-rank): called on every rank after each
  // broadcast, before that iteration's check and outside the timing.
  std::function<void(int iteration)> after_broadcast;
};

struct BroadcastSeries {
  std::vector<double> times_us;   // this rank's broadcast times, timed iterations only
  std::vector<double> check_us;   // this rank's check times, every iteration
  BroadcastStats stats;           // the last broadcast's
  ChecksumVerdict verdict;        // every rank's checks, gathered (the same on every rank)
};

// broadcast-test's loop: warmup + iters broadcasts from options.broadcast.root,
// each preceded by a refill of every non-root rank's tensors with its own
// start pattern (the root refills only after a failed check: otherwise it
// already holds its pattern) and a barrier, and followed by a check against
// `expected` (start_pattern_checksums(tensors, root)). Only the broadcast is
// timed (BroadcastStats::time_us); refills and checks are not. Every
// rank's tensors, the root's too, are filled before the first broadcast.
BroadcastSeries broadcast_series(Communicator& comm, std::span<const ParamTensor> tensors,
                                 std::span<const std::uint64_t> expected,
                                 const BroadcastSeriesOptions& options);

}  // namespace ddpdiag::ddp_core
