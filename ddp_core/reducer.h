// DDP's reducer on a Communicator: gradients are marked ready one by one in
// backward order; a bucket's all_reduce is launched as soon as its last
// gradient is ready, buckets strictly in order 0, 1, 2, ... (a full bucket
// waits for its predecessors, as DDP does), asynchronously, so communication
// overlaps the rest of the backward pass. finalize() waits for every bucket.
//
// Protocol of one iteration (all calls from one thread; the reducer is not
// thread-safe):
//   prepare_for_backward([locally unused params]);
//   for each parameter in backward order: write grad(p), mark_ready(p);
//   (optionally poll() while computing, to observe completions early)
//   finalize();
// Every rank must issue the same collectives in the same order, which holds
// because every rank launches the same buckets in the same order, followed,
// with find_unused_parameters, by one all_reduce of the used-bitmap.
//
// Memory. Buckets are flat buffers from comm.alloc (host memory for Gloo,
// device memory for NCCL). With gradient_as_bucket_view each gradient is a
// slice of its bucket (no copy); without, each gradient owns its buffer
// (made when its first gradient is, as torch makes a .grad: a parameter no
// rank ever uses has none) and is copied into the bucket when marked ready
// and back after the reduction.
//
// The stream path. On device memory (NCCL) every step between gradients and
// collectives is enqueued on the communicator's own stream through its
// StreamOps (comm/stream_ops.h): zeroing of unused gradients, the views-off
// flatten into the bucket and unflatten back (one batched kernel per bucket),
// the division by the world size, the fp16/bf16 hooks' casts. Nothing waits
// on the host between a bucket's launch and finalize(). The same path runs on
// host memory with ReducerOptions::stream_path (Gloo runs the steps on its
// worker thread), which is how it is tested without a GPU; results are
// identical to the default host path.
//
// Sparse gradients. A parameter whose layout entry expects_sparse
// (nn.Embedding(sparse=True)) has a bucket of its own and is handed over as
// rows and values (set_sparse_grad), not through grad(). Its bucket is
// reduced as torch's Gloo backend reduces a sparse tensor: the gradient is
// divided by the world size (as DDP does without a comm hook) and coalesced
// (duplicate rows summed, rows sorted); the ranks allgather their nnz, then
// their row indices (int64) and values, padded to the largest nnz; every
// rank sums all of them into the coalesced result (sparse_grad(p): the rows
// touched anywhere, sorted, and their sums), which is torch's coalesced
// sparse gradient. Only the touched rows travel, and the dense table is never
// allocated: a sparse parameter has no grad() buffer, as in DDP.
// The index and value allgathers need every rank's nnz, so they are issued
// after the nnz allgather completes: by poll() when it has, or at the latest
// just before the reducer's next collective (the next bucket's, the
// used-bitmap all_reduce, or finalize's waits), which waits for it there.
// Every rank thus issues nnz(b), indices(b), values(b) and then the next
// collective, in the same order. The sum into sparse_grad(p) happens in
// finalize().
// Compression hooks do not apply to sparse gradients (values stay in the
// parameter's dtype, divided by the world size). float32 and float64 only;
// host memory (Gloo) only: the constructor refuses sparse parameters on
// device memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "ddp_core/bucket_assignment.h"
#include "ddp_core/model_layout.h"

namespace ddpdiag::ddp_core {

struct SparseState;  // reducer.cpp

using ReducerClock = std::chrono::steady_clock;

// DDP's default_hooks.fp16_compress_hook / bf16_compress_hook: cast the
// bucket to 16 bits, divide by the world size, all_reduce (SUM), cast back.
enum class CompressionHook : std::uint8_t { kNone, kFp16, kBf16 };
std::string_view compression_hook_name(CompressionHook h);  // none, fp16, bf16
std::optional<CompressionHook> parse_compression_hook(std::string_view s);

enum class Averaging : std::uint8_t {
  // As torch without a comm hook: each gradient is divided by the world size
  // as it enters the bucket, and the all_reduce is a SUM.
  kDivideThenSum,
  // The all_reduce uses ReduceOp::kAvg (Gloo sums then divides; NCCL's
  // ncclAvg divides in the kernel).
  kAvgOp,
};

struct ReducerOptions {
  std::uint64_t bucket_cap_bytes = kDefaultBucketCapBytes;
  std::uint64_t first_bucket_bytes = kDefaultFirstBucketBytes;
  // torch 2.x's DDP(bucket_cap_mb_list=[...]) in bytes: when not empty, the
  // size limits of the buckets in order (the last repeating), in place of
  // [first_bucket_bytes, bucket_cap_bytes] (ddp_bucket_limits).
  std::vector<std::uint64_t> bucket_size_limits;
  bool gradient_as_bucket_view = true;
  bool find_unused_parameters = false;
  // DDP's static_graph=True: the buckets it rebuilds
  // (ddp_buckets_static_graph); parameters may go unused in backward, as
  // with find_unused_parameters, but the ranks agree on which are used
  // anywhere once, at the first finalize() (torch does so in its first
  // iteration only), and every later iteration must use the same parameters
  // as the first (torch: "Your training graph has changed in this
  // iteration"), else finalize() throws UsageError.
  bool static_graph = false;
  // torch 2.x's DDP(skip_all_reduce_unused_params=True): a bucket whose
  // parameters are all unused on this rank in this iteration (declared to
  // prepare_for_backward or missing at finalize) is not all-reduced; its
  // gradients stay as they were (torch leaves such a .grad None). Every rank
  // must leave the same parameters unused, or the ranks issue different
  // collectives: torch's job then fails or hangs, and this reducer's
  // collectives fail or run out of their deadline.
  // Matters only with find_unused_parameters or static_graph.
  bool skip_all_reduce_unused_params = false;
  // Run the buckets DDP reduces before it rebuilds them (its first
  // iteration; the first two with static_graph): ddp_buckets_first_iteration,
  // for every iteration.
  bool first_iteration_buckets = false;
  // Run the buckets as DDP does over a run: the first iteration (the first
  // two with static_graph) on ddp_buckets_first_iteration, while each rank
  // records the order it marks gradients ready (with static_graph in the
  // second iteration, the parameters it left unused following in index
  // order); then, in the next prepare_for_backward, the buckets rebuilt
  // from rank 0's order (ddp_buckets_rebuilt_from), which every rank gets by
  // a broadcast of it (DDP's sync_bucket_indices), so all ranks reduce the
  // same buckets whatever their own order. With find_unused_parameters and
  // no static_graph DDP never rebuilds, and neither does this. Excludes
  // first_iteration_buckets. At the rebuild the old buckets are freed before
  // the new ones are made; with gradient_as_bucket_view the gradients are
  // slices of the new, zeroed buckets (torch's .grad after the default
  // zero_grad(set_to_none=True)); own gradient buffers (views off) keep
  // their contents.
  bool rebuild_buckets = false;
  // DDP_SET_LAST_BUCKET_CAP=1: the rebuilt buckets filled from the other
  // end, the first limit going to the bucket reduced last (ddp_buckets).
  // No effect on the buckets DDP does not rebuild (find_unused_parameters
  // without static_graph, first_iteration_buckets).
  bool set_last_bucket_small = false;
  CompressionHook hook = CompressionHook::kNone;
  Averaging averaging = Averaging::kDivideThenSum;
  // Deadline of each collective finalize() waits for, counted from the later
  // of its start and the completion of the one before it; zero means the
  // communicator's default.
  Millis timeout{0};
  // Use the stream path on host memory too (always used on device memory).
  bool stream_path = false;
  // Where the parameters' own gradients (gradient_as_bucket_view off) are
  // allocated: the reducer's communicator when null. Memory accounting
  // passes one that tallies them as gradients, whenever they are allocated.
  // Same memory kind as the reducer's.
  Communicator* gradient_allocator = nullptr;
};

// Timestamps of one bucket in the last iteration. A time point equal to the
// clock's epoch means "did not happen".
struct BucketTiming {
  ReducerClock::time_point ready{};      // its last gradient was marked ready
  ReducerClock::time_point launched{};   // its all_reduce was issued
  ReducerClock::time_point completed{};  // completion first observed (poll or finalize)
  // Bytes of the bucket's collectives as issued: a dense bucket's all_reduce
  // buffer (16-bit with a hook); a sparse bucket's allgathers counted at
  // their gathered size, world * (8 + max_nnz * (8 + row bytes)).
  std::uint64_t payload_bytes = 0;
  bool sparse = false;
  // skip_all_reduce_unused_params: every parameter of the bucket was unused
  // on this rank, and its all_reduce was not issued (payload 0).
  bool skipped = false;
};

// A sparse parameter's reduced gradient (valid until the next
// prepare_for_backward): rows sorted and unique, values row after row in the
// parameter's dtype, row_numel elements a row.
struct SparseGrad {
  std::span<const std::int64_t> rows;
  std::span<const std::byte> values;
  std::size_t row_numel = 0;
};

struct IterationTiming {
  ReducerClock::time_point backward_start{};   // prepare_for_backward
  ReducerClock::time_point last_mark_ready{};  // the last mark_ready of the iteration
  ReducerClock::time_point finalize_start{};
  ReducerClock::time_point finalize_end{};
  std::vector<BucketTiming> buckets;

  // Communication not hidden behind backward: finalize end - last mark_ready.
  double exposed_comm_us() const;
  // From the first launch to the last observed completion.
  double comm_span_us() const;
  // From prepare_for_backward to the end of finalize.
  double iteration_us() const;
};

// One reducer bucket: DDP's bucket plus where each gradient lives in it.
struct ReducerBucket {
  DdpBucket spec;                      // params in ready order, bytes, dtype
  std::vector<std::uint64_t> offsets;  // byte offset of spec.param_indices[k]
  std::uint64_t numel = 0;
};

// The reducer reduces sparse gradients only on host memory (torch's Gloo
// way: an allgather of indices and values): a UsageError naming the first
// sparse parameter of `layout` (its trainable parameters, indexed as the
// reducer indexes them), for a communicator on device memory of `backend`.
// Called by the Reducer, and by the commands before their ranks meet.
void refuse_sparse_on_device(const ModelLayout& layout, std::string_view backend, int rank);

class Reducer {
 public:
  // Builds DDP's buckets for the layout and allocates them through comm:
  // ddp_buckets_as_run() (the gradient ready order, limits [first_bucket_bytes,
  // bucket_cap_bytes] or bucket_size_limits; with find_unused_parameters the
  // ones DDP keeps unrebuilt; with static_graph its rebuilt ones), or with
  // first_iteration_buckets or rebuild_buckets ddp_buckets_first_iteration().
  // Throws UsageError for options this communicator cannot run.
  Reducer(Communicator& comm, ModelLayout layout, ReducerOptions options = {});
  // Waits (bounded by the timeout) for collectives still in flight, so no
  // backend writes into freed buffers; aborts the communicator if they do
  // not finish.
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Starts an iteration. locally_unused: parameters this rank knows will get
  // no gradient (what DDP finds by walking the autograd graph); they are
  // marked ready at once with zero gradients. Only with find_unused_parameters
  // or static_graph.
  // Throws UsageError when the previous iteration was not finalized. With
  // rebuild_buckets the rebuild happens here, after the iteration DDP
  // records: a broadcast from rank 0 (bounded by the timeout, TimeoutError)
  // that every rank takes part in.
  void prepare_for_backward(std::span<const std::size_t> locally_unused = {});
  // The sparse gradient of a parameter whose layout entry expects_sparse:
  // rows.size() row indices in [0, shape[0]) (any order, repeats allowed, as
  // in an uncoalesced torch sparse gradient) and rows.size() * row_numel
  // values of the parameter's dtype, row after row (row_numel = product of
  // shape[1:]), in host memory, copied before the call returns. Between
  // prepare_for_backward and the parameter's mark_ready; a second call in the
  // same iteration adds its rows to the first's. A sparse parameter marked
  // ready without a call contributes no rows. Throws UsageError for a dense
  // parameter, a row out of range or a values size that does not match.
  void set_sparse_grad(std::size_t param_index, std::span<const std::int64_t> rows,
                       std::span<const std::byte> values);
  // The gradient of parameter param_index is complete in grad(param_index)
  // (a sparse parameter's in set_sparse_grad).
  void mark_ready(std::size_t param_index);
  // Records completions of launched buckets without blocking.
  void poll();
  // Waits for every bucket (with the timeout), copies back / casts back, and
  // with find_unused_parameters agrees with the other ranks on which
  // parameters were used anywhere. As DDP, the gradient of a parameter used
  // nowhere is left untouched: with gradient_as_bucket_view it is its
  // bucket's slice (zeros), without it its own buffer keeps what it held
  // (never allocated if never used: torch's .grad stays None). Without
  // find_unused_parameters, parameters that never arrived end the iteration
  // with a UsageError that names them.
  void finalize();

  // The gradient buffer of a dense parameter, in the communicator's memory
  // kind. UsageError for a sparse one. With gradient_as_bucket_view its
  // bucket's slice, valid until the buckets are rebuilt (rebuild_buckets);
  // without, the
  // parameter's own buffer, allocated on the first call (or when a reduced
  // gradient first reaches it: a parameter unused on this rank and used on
  // another), as torch allocates a .grad when one is first produced.
  void* grad(std::size_t param_index) const;
  // The bytes of the own gradient buffers allocated so far (0 with
  // gradient_as_bucket_view).
  std::uint64_t own_gradient_bytes() const;
  std::uint64_t grad_bytes(std::size_t param_index) const;
  // A sparse parameter's reduced gradient after finalize (empty before the
  // first). UsageError for a dense one.
  SparseGrad sparse_grad(std::size_t param_index) const;

  const ModelLayout& layout() const { return layout_; }
  const ReducerOptions& options() const { return options_; }
  // The buckets the last (or, before the first, the next) iteration reduces.
  const std::vector<ReducerBucket>& buckets() const { return buckets_; }
  // rebuild_buckets: the index (from 0) of the first iteration run on the
  // rebuilt buckets, once they are; and rank 0's order they were rebuilt
  // from (empty until then).
  std::optional<std::uint64_t> rebuilt_before_iteration() const { return rebuilt_before_; }
  // rebuild_buckets: the index (from 0) of the first iteration that will run
  // on rebuilt buckets (1, or 2 with static_graph); nullopt where DDP keeps
  // its buckets.
  std::optional<std::uint64_t> rebuild_planned_before_iteration() const {
    return record_iteration_ ? std::optional<std::uint64_t>(record_iteration_) : std::nullopt;
  }
  // The bucket size limits in bytes: [first, cap] or the cap list.
  const std::vector<std::uint64_t>& bucket_size_limits() const { return limits_; }
  const std::vector<std::size_t>& rebuild_order() const { return rebuild_order_; }
  // Bucket index and position within it of each parameter.
  std::size_t bucket_of(std::size_t param_index) const { return where_[param_index].bucket; }
  const IterationTiming& last_timing() const { return timing_; }
  // Parameters that no rank used in the last finalized iteration.
  const std::vector<std::size_t>& globally_unused() const { return globally_unused_; }
  std::uint64_t iteration() const { return iteration_; }

 private:
  struct Where {
    std::size_t bucket = 0;
    std::uint64_t offset = 0;
  };
  struct BucketState {
    CommBuffer buffer;
    CommBuffer compressed;  // 16-bit scratch of the hooks
    std::size_t pending = 0;
    bool launched = false;
    bool done = false;
    bool skipped = false;  // skip_all_reduce_unused_params: nothing issued
    std::shared_ptr<Work> work;
    std::shared_ptr<Work> post;  // stream path: the fence after the bucket's post-processing
    // A sparse bucket: when its second stage (work and post) was issued.
    ReducerClock::time_point reissued{};
    std::unique_ptr<StreamOps::CopyPlan> plan;  // stream path, views off
    // A sparse bucket: work is the index allgather, post the value allgather.
    std::unique_ptr<SparseState> sparse;
  };

  void mark_ready_impl(std::size_t param_index, bool used);
  // Allocates and zeroes the buckets of specs (the old ones freed first).
  void install_buckets(const std::vector<DdpBucket>& specs);
  // rebuild_buckets: rank 0's recorded order to every rank, then the
  // buckets rebuilt from it.
  void rebuild();
  void launch_ready_buckets();
  void launch(std::size_t b);
  // since: when the collective before the bucket's completed (finalize's
  // start at the earliest).
  void wait_bucket(std::size_t b, ReducerClock::time_point since);
  void finish_bucket(std::size_t b);
  // Waits for every collective in flight, each for the timeout counted from
  // `since` or the completion of the one before, whichever is later; aborts
  // the communicator at the first that does not complete.
  void drain_in_flight(ReducerClock::time_point since) noexcept;
  void agree_on_used(ReducerClock::time_point deadline);
  void check_index(std::size_t param_index, const char* what) const;
  void check_dense(std::size_t param_index, const char* what) const;
  Millis timeout() const;
  // static_graph, after the first iteration: throws UsageError when this
  // iteration used other parameters than the first.
  void check_static_graph() const;
  // static_graph: whether the first iteration has fixed the used parameters
  // (a layout has at least one).
  bool static_fixed() const { return !static_used_.empty(); }
  // Whether parameters may go without a gradient in an iteration.
  bool allows_unused() const { return options_.find_unused_parameters || options_.static_graph; }
  std::string describe_params(const std::vector<std::size_t>& params) const;
  void copy_into_bucket(std::size_t param_index, bool zero);
  void copy_out_of_bucket(std::size_t param_index);
  // Views off, after the used map: a parameter unused on this rank gets its
  // reduced gradient when another rank used it (its buffer made then if it
  // had none); one used nowhere keeps its gradient untouched, as in DDP.
  void copy_out_locally_unused();
  void launch_stream(std::size_t b);
  void launch_sparse(std::size_t b);
  void issue_sparse_second_stage(bool block);
  void finish_sparse(std::size_t b);

  Communicator& comm_;
  ModelLayout layout_;
  ReducerOptions options_;
  bool device_ = false;
  StreamOps* ops_ = nullptr;  // the stream path when set
  std::vector<ReducerBucket> buckets_;
  std::vector<std::uint64_t> limits_;  // the bucket size limits, in bytes
  // rebuild_buckets: the iteration (from 1, as iteration_) whose ready
  // order is recorded, 0 when DDP would not rebuild; this rank's order in
  // it; a rebuild due at the next prepare_for_backward; and when it happened.
  std::uint64_t record_iteration_ = 0;
  std::vector<std::size_t> recorded_order_;
  bool rebuild_pending_ = false;
  std::optional<std::uint64_t> rebuilt_before_;
  std::vector<std::size_t> rebuild_order_;
  std::vector<BucketState> state_;
  std::vector<Where> where_;
  // Views off: one buffer per parameter, allocated on first use (own_grad).
  mutable std::vector<CommBuffer> own_grads_;
  void* own_grad(std::size_t param_index) const;
  // A stream-path bucket's flatten/unflatten plan is made once every one of
  // its parameters has its own gradient buffer.
  void make_plan(std::size_t b);
  std::vector<std::uint8_t> marked_;   // this iteration: 0 no, 1 used, 2 unused
  std::vector<std::int32_t> used_map_;  // host copy of the used map (> 0 = used on some rank)
  CommBuffer used_map_buffer_;          // comm memory for its all_reduce
  std::shared_ptr<Work> used_map_work_;
  ReduceOp sum_op_ = ReduceOp::kSum;    // the op of the buckets' all_reduce
  std::vector<std::size_t> globally_unused_;
  // static_graph: the parameters the first iteration used on this rank (1 =
  // used); empty until then. Those used nowhere are globally_unused_.
  std::vector<std::uint8_t> static_used_;
  std::size_t next_to_launch_ = 0;
  // A sparse bucket whose nnz allgather is out and whose index and value
  // allgathers are not yet issued.
  std::optional<std::size_t> sparse_second_stage_;
  std::size_t marked_count_ = 0;
  bool in_iteration_ = false;
  std::uint64_t iteration_ = 0;
  IterationTiming timing_;
};

}  // namespace ddpdiag::ddp_core
