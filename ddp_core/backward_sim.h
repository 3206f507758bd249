// A backward pass without a model: walks the layout's parameters in the
// order autograd makes their gradients ready (ModelLayout::
// gradient_ready_order: recorded, or the reverse of the parameters), "computes" each gradient (writes
// its values and, optionally, spends time proportional to its size) and marks
// it ready on the reducer.
//
// Gradient values are chosen so that their mean over ranks is exactly
// representable and exactly computed whatever the order of reduction:
// element i of parameter p on rank r in iteration t is
//     world_size * k * scale,   k = (top 4 bits of mix32(seed + i * 0x9e3779b9)) - 8,
// mix32 a 32-bit integer hash, seed a hash of (p, r, t): k lies in -8..7, and no
// two ranks, parameters or iterations share a pattern (a reducer that adds
// one rank's gradient twice, swaps two parameters or shifts by some elements
// is caught); so after division by the world size every rank contributes k * scale, and
// with scale 1 every partial sum is a small integer (exact in float32, fp16
// and bf16). The true mean is scale * (sum over the ranks that used p of k).
// A scale that is not a power of two (0.1) makes the values inexact in 16
// bits, to exercise the compression hooks' rounding.
//
// A sparse parameter (expects_sparse) gets a sparse gradient instead: on rank
// r in iteration t it touches sparse_rows rows (default min(shape[0], 512)),
// entry j at row sim_sparse_rows(...)[j], drawn with replacement from a
// generator seeded by (p, r, t), so rows repeat within a rank and are shared
// across ranks; element e of entry j has the value of element
// j * row_numel + e above. The true mean of element (row, e) is scale times
// the sum of k over every rank's entries at that row; rows no rank touched
// are absent from the reduced (coalesced) gradient.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "ddp_core/reducer.h"

namespace ddpdiag::ddp_core {

struct BackwardSimOptions {
  // Gradient "compute" rate: each tensor takes bytes / (compute_gbps * 1e9)
  // seconds. 0: no compute time beyond writing the values.
  double compute_gbps = 0;
  double value_scale = 1.0;
  // Parameters this rank produces no gradient for (a branch not taken).
  std::vector<std::size_t> unused;
  // Declare them to prepare_for_backward (as DDP's graph walk does) rather
  // than leaving them for finalize() to discover.
  bool declare_unused = true;
  // Rows touched per sparse parameter and iteration; nullopt: min(shape[0],
  // kDefaultSparseRows). Must be >= 0.
  std::optional<std::int64_t> sparse_rows;
};

inline constexpr std::int64_t kDefaultSparseRows = 512;

// The rows rank `rank` touches in parameter `param` (a sparse one) in this
// iteration, in the order they are handed to the reducer.
std::vector<std::int64_t> sim_sparse_rows(const TensorSpec& spec, int rank, std::size_t param,
                                          std::uint64_t iteration,
                                          std::optional<std::int64_t> sparse_rows = std::nullopt);

struct BackwardSimResult {
  ReducerClock::time_point start{};
  ReducerClock::time_point end{};  // after the last mark_ready
  double backward_us() const;
};

// The value of element i of parameter p, before any division.
double sim_gradient_value(int world_size, int rank, std::size_t param, std::size_t i,
                          std::uint64_t iteration, double scale);

// prepare_for_backward, then every parameter in ready order: write, spend
// its compute time (sleeping for long waits, spinning for short ones, polling
// the reducer meanwhile so completions are timestamped when they happen),
// mark_ready. The caller calls reducer.finalize(). iteration selects the
// values (use reducer.iteration() after the call... or any counter shared by
// the ranks).
BackwardSimResult simulate_backward(Reducer& reducer, Communicator& comm, std::uint64_t iteration,
                                    const BackwardSimOptions& options = {});

// Whether rank r used parameter p in this iteration (for the expected mean).
using UsedBy = std::function<bool(int rank, std::size_t param)>;

// The parameters of `unused` used by no rank, the others by every rank; an
// empty UsedBy (every rank uses every parameter) when `unused` is empty.
UsedBy used_by_all_but(const std::vector<std::size_t>& unused, std::size_t param_count);

struct GradientCheck {
  std::int64_t wrong = 0;    // elements outside tolerance
  std::int64_t checked = 0;  // elements compared
  // Elements of dense parameters no rank used (find_unused_parameters): not
  // compared, as torch gives them no gradient (their .grad stays None).
  std::int64_t unused = 0;
  double max_abs_error = 0;
  // The first element outside tolerance (parameters in layout order): its
  // parameter's index, its index in that parameter (a sparse one: row *
  // row_numel + e), the value found and the true mean; -1 when none.
  std::int64_t first_wrong_param = -1;
  std::int64_t first_wrong_element = -1;
  double first_wrong_have = 0;
  double first_wrong_want = 0;
};

// Compares every gradient element with the true mean. relative_tolerance 0
// asks for exact equality; otherwise an element may differ by
// tolerance * (sum over ranks of |contribution|) + 1e-30. A sparse
// parameter's coalesced result must hold exactly the rows some rank touched
// (each of their elements is compared; a missing or extra row counts all its
// elements wrong).
GradientCheck check_gradients(const Reducer& reducer, Communicator& comm, std::uint64_t iteration,
                              double value_scale = 1.0, double relative_tolerance = 0,
                              const UsedBy& used_by = {},
                              std::optional<std::int64_t> sparse_rows = std::nullopt);

}  // namespace ddpdiag::ddp_core
