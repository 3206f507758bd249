#include "ddp_core/reducer.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include <fmt/core.h>

#include "ddp_core/deadline.h"

namespace ddpdiag::ddp_core {

namespace {

bool happened(ReducerClock::time_point t) { return t != ReducerClock::time_point{}; }

double us_between(ReducerClock::time_point a, ReducerClock::time_point b) {
  if (!happened(a) || !happened(b)) return 0;
  return std::chrono::duration<double, std::micro>(b - a).count();
}

std::uint8_t* at(void* base, std::uint64_t offset) {
  return static_cast<std::uint8_t*>(base) + offset;
}

// dst = src / world, element-wise. For float32, the common case, a float
// division, which is what torch's div_ computes on a float tensor: its
// Reducer divides so when the gradient is a view of its bucket
// (gradient_as_bucket_view=True). With views off it multiplies by the
// factor 1.0 / world instead (at::mul_out on the way into the bucket), which
// at world sizes that are not powers of two can differ in the last bit of a
// float32 or float64 (5 / 3: 1.6666666269 here, 1.6666667461 there); 16-bit
// dtypes agree. Not modelled: the simulated gradients (world * k, k whole)
// come out exact either way, which is what the checks compare. Other dtypes
// go through the shared host helper.
void copy_divided(DType t, void* dst, const void* src, std::size_t n, int world) {
  if (t == DType::kFloat32) {
    const float w = static_cast<float>(world);
    const auto* s = static_cast<const float*>(src);
    auto* d = static_cast<float*>(dst);
    for (std::size_t i = 0; i < n; ++i) d[i] = s[i] / w;
    return;
  }
  if (dst != src) std::memcpy(dst, src, n * dtype_size(t));
  divide_host(t, dst, n, world);
}

// Grows a communicator buffer to at least bytes (contents not kept).
void ensure(CommBuffer& b, Communicator& comm, std::size_t bytes) {
  if (b.bytes() >= bytes) return;
  b = CommBuffer(comm, std::max(bytes, 2 * b.bytes()));
}

}  // namespace

// A sparse bucket's gradient of this iteration and its communication buffers
// (host memory).
struct SparseState {
  std::size_t param = 0;
  std::int64_t num_rows = 0;    // shape[0]
  std::size_t row_numel = 0;    // product of shape[1:]
  std::size_t row_bytes = 0;
  std::vector<std::int64_t> rows;   // as handed over, uncoalesced
  std::vector<std::byte> values;
  CommBuffer nnz_send, nnz_all;     // int64: 1 and world
  CommBuffer idx_send, idx_all;     // int64: max_nnz and world * max_nnz
  CommBuffer val_send, val_all;     // dtype: max_nnz and world * max_nnz rows
  std::int64_t max_nnz = 0;
  // Between the two stages: this rank's coalesced (and divided) gradient.
  std::vector<std::int64_t> coalesced_rows;
  std::vector<std::byte> coalesced_values;
  // The reduced gradient after finalize: rows sorted and unique, values row
  // after row (torch's coalesced sparse result).
  std::vector<std::int64_t> result_rows;
  std::vector<std::byte> result_values;
};

std::string_view compression_hook_name(CompressionHook h) {
  switch (h) {
    case CompressionHook::kNone: return "none";
    case CompressionHook::kFp16: return "fp16";
    case CompressionHook::kBf16: return "bf16";
  }
  return "?";
}

std::optional<CompressionHook> parse_compression_hook(std::string_view s) {
  if (s == "none" || s.empty()) return CompressionHook::kNone;
  if (s == "fp16" || s == "half" || s == "float16") return CompressionHook::kFp16;
  if (s == "bf16" || s == "bfloat16") return CompressionHook::kBf16;
  return std::nullopt;
}

double IterationTiming::exposed_comm_us() const {
  return std::max(0.0, us_between(last_mark_ready, finalize_end));
}

double IterationTiming::comm_span_us() const {
  ReducerClock::time_point first{}, last{};
  for (const auto& b : buckets) {
    if (b.skipped) continue;  // no collective
    if (happened(b.launched) && (!happened(first) || b.launched < first)) first = b.launched;
    if (happened(b.completed) && b.completed > last) last = b.completed;
  }
  return std::max(0.0, us_between(first, last));
}

double IterationTiming::iteration_us() const { return us_between(backward_start, finalize_end); }

void refuse_sparse_on_device(const ModelLayout& layout, std::string_view backend, int rank) {
  for (std::size_t p = 0; p < layout.tensors.size(); ++p) {
    const auto& t = layout.tensors[p];
    if (!t.expects_sparse) continue;
    throw UsageError(
        fmt::format("parameter {} (index {}) has a sparse gradient, which the reducer does not "
                    "reduce on device memory ({} communicator); torch reduces sparse gradients "
                    "with an allgather of indices and values, as the Gloo backend does",
                    t.name, p, backend),
        {"reducer.init", rank, -1,
         "use --backend gloo for layouts with sparse (nn.Embedding(sparse=True)) parameters"});
  }
}

Reducer::Reducer(Communicator& comm, ModelLayout layout, ReducerOptions options)
    : comm_(comm), layout_(std::move(layout)), options_(options) {
  device_ = comm_.memory_kind() == MemoryKind::kDevice;
  if (options_.bucket_size_limits.empty()) {
    if (options_.bucket_cap_bytes == 0 || options_.first_bucket_bytes == 0)
      throw UsageError("the bucket cap and the first bucket size must be positive",
                       {"reducer.init", comm_.rank(), -1, "pass --bucket-cap-mb > 0"});
  } else if (std::find(options_.bucket_size_limits.begin(), options_.bucket_size_limits.end(), 0u) !=
             options_.bucket_size_limits.end()) {
    throw UsageError("every bucket size limit of the list must be positive",
                     {"reducer.init", comm_.rank(), -1, "pass --bucket-cap-mb-list values > 0"});
  }
  if (layout_.tensors.empty())
    throw UsageError("the model layout '" + layout_.name + "' has no parameters",
                     {"reducer.init", comm_.rank(), -1, "use a layout with at least one tensor"});
  // DDP's reducer holds only parameters that require grad; a frozen one
  // here would be in no bucket, and its gradient nowhere.
  for (std::size_t p = 0; p < layout_.tensors.size(); ++p)
    if (!layout_.tensors[p].requires_grad)
      throw UsageError(fmt::format("parameter {} (index {}) does not require grad: DDP reduces no "
                                   "gradient for it",
                                   layout_.tensors[p].name, p),
                       {"reducer.init", comm_.rank(), -1,
                        "build the reducer from trainable_parameters(layout)"});
  if (device_ || options_.stream_path) {
    ops_ = comm_.stream_ops();
    if (!ops_)
      throw UsageError(fmt::format("the {} communicator has no stream operations, which the "
                                   "reducer needs on {} memory",
                                   backend_name(comm_.backend()), device_ ? "device" : "host"),
                       {"reducer.init", comm_.rank(), -1, "use --backend gloo or nccl"});
  }
  if (options_.averaging == Averaging::kAvgOp) sum_op_ = ReduceOp::kAvg;

  for (std::size_t p = 0; p < layout_.tensors.size(); ++p) {
    const auto& t = layout_.tensors[p];
    if (!t.expects_sparse) continue;
    if (device_) refuse_sparse_on_device(layout_, backend_name(comm_.backend()), comm_.rank());
    if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat64)
      throw UsageError(fmt::format("parameter {} (index {}) has a sparse gradient of dtype {}; "
                                   "sparse gradients are reduced in float32 or float64 only",
                                   t.name, p, dtype_name(t.dtype)),
                       {"reducer.init", comm_.rank(), -1,
                        "make the embedding float32, or mark it dense in the layout"});
    if (t.shape.empty() || t.shape[0] <= 0)
      throw UsageError(fmt::format("parameter {} (index {}) has a sparse gradient but no rows "
                                   "(shape needs a first dimension > 0)",
                                   t.name, p),
                       {"reducer.init", comm_.rank(), -1, "check the layout's shape"});
  }
  // With find_unused_parameters DDP never rebuilds its buckets from the
  // ready order: it keeps the constructor's.
  limits_ = options_.bucket_size_limits.empty()
                ? ddp_bucket_limits(options_.bucket_cap_bytes, options_.first_bucket_bytes)
                : options_.bucket_size_limits;
  if (options_.rebuild_buckets && options_.first_iteration_buckets)
    throw UsageError("rebuild_buckets and first_iteration_buckets exclude each other",
                     {"reducer.init", comm_.rank(), -1,
                      "rebuild_buckets starts on the first-iteration buckets by itself"});
  // As DDP's Reducer::should_rebuild_buckets(): not with find_unused_parameters
  // unless static_graph.
  if (options_.rebuild_buckets && (options_.static_graph || !options_.find_unused_parameters))
    record_iteration_ = options_.static_graph ? 2 : 1;
  const bool first = options_.first_iteration_buckets || options_.rebuild_buckets;
  const auto specs =
      first ? ddp_buckets_first_iteration(layout_, limits_, options_.find_unused_parameters, options_.static_graph,
                                          !options_.bucket_size_limits.empty())
            : ddp_buckets_as_run(layout_, limits_, options_.find_unused_parameters, options_.static_graph,
                                 options_.set_last_bucket_small);
  where_.resize(layout_.tensors.size());
  install_buckets(specs);
  // Views off: each parameter's own gradient buffer is allocated when its
  // first gradient is (own_grad), as torch allocates a .grad; one no rank
  // ever uses has none, as torch leaves its .grad None.
  if (!options_.gradient_as_bucket_view) own_grads_.resize(layout_.tensors.size());
  marked_.assign(layout_.tensors.size(), 0);
  if (allows_unused()) {
    used_map_.assign(layout_.tensors.size(), 0);
    used_map_buffer_ = CommBuffer(comm_, used_map_.size() * sizeof(std::int32_t));
  }
}

void Reducer::install_buckets(const std::vector<DdpBucket>& specs) {
  buckets_.clear();
  state_.clear();
  buckets_.reserve(specs.size());
  state_.resize(specs.size());
  for (std::size_t b = 0; b < specs.size(); ++b) {
    ReducerBucket rb;
    rb.spec = specs[b];
    std::uint64_t off = 0;
    for (std::size_t p : rb.spec.param_indices) {
      DDPDIAG_ASSERT(layout_.tensors[p].dtype == rb.spec.dtype);
      rb.offsets.push_back(off);
      where_[p] = {b, off};
      off += layout_.tensors[p].bytes();
    }
    DDPDIAG_ASSERT(off == rb.spec.bytes);
    rb.numel = off / dtype_size(rb.spec.dtype);
    // A sparse bucket has no flat buffer (as in DDP): its gradient travels
    // and ends as rows and values, never as the dense table.
    if (!rb.spec.sparse) state_[b].buffer = CommBuffer(comm_, off);
    if (rb.spec.sparse) {
      DDPDIAG_ASSERT(rb.spec.param_indices.size() == 1);
      auto sp = std::make_unique<SparseState>();
      sp->param = rb.spec.param_indices[0];
      const auto& t = layout_.tensors[sp->param];
      sp->num_rows = t.shape[0];
      sp->row_numel = static_cast<std::size_t>(t.numel() / t.shape[0]);
      sp->row_bytes = sp->row_numel * dtype_size(t.dtype);
      sp->nnz_send = CommBuffer(comm_, sizeof(std::int64_t));
      sp->nnz_all = CommBuffer(comm_, sizeof(std::int64_t) * static_cast<std::size_t>(comm_.size()));
      state_[b].sparse = std::move(sp);
    } else if (options_.hook != CompressionHook::kNone) {
      state_[b].compressed = CommBuffer(comm_, rb.numel * 2);
    }
    // Zeroed buckets: a gradient view reads as zero before its first
    // backward, as DDP's bucket views do.
    if (off && !rb.spec.sparse) {
      if (ops_)
        ops_->zero(state_[b].buffer.get(), off);
      else
        std::memset(state_[b].buffer.get(), 0, off);
    }
    buckets_.push_back(std::move(rb));
  }
  if (ops_) ops_->fence()->wait(timeout());
  timing_.buckets.assign(buckets_.size(), BucketTiming{});
}

Reducer::~Reducer() {
  drain_in_flight(ReducerClock::now());
}

Millis Reducer::timeout() const {
  return options_.timeout.count() > 0 ? options_.timeout : comm_.default_timeout();
}

void Reducer::check_dense(std::size_t param_index, const char* what) const {
  check_index(param_index, what);
  const auto& t = layout_.tensors[param_index];
  if (t.expects_sparse)
    throw UsageError(fmt::format("{}: parameter {} (index {}) has a sparse gradient, which has no "
                                 "dense buffer; its result is read with sparse_grad()",
                                 what, t.name, param_index),
                     {"reducer", comm_.rank(), -1, "hand sparse gradients over with set_sparse_grad()"});
}

void* Reducer::own_grad(std::size_t p) const {
  CommBuffer& g = own_grads_[p];
  const std::uint64_t bytes = layout_.tensors[p].bytes();
  if (!g.get() && bytes > 0 && !layout_.tensors[p].expects_sparse)
    g = CommBuffer(options_.gradient_allocator ? *options_.gradient_allocator : comm_, bytes);
  return g.get();
}

std::uint64_t Reducer::own_gradient_bytes() const {
  std::uint64_t total = 0;
  for (const auto& g : own_grads_) total += g.bytes();
  return total;
}

void Reducer::make_plan(std::size_t b) {
  auto& s = state_[b];
  if (s.plan) return;
  const auto& rb = buckets_[b];
  std::vector<FlatPiece> pieces;
  pieces.reserve(rb.spec.param_indices.size());
  for (std::size_t k = 0; k < rb.spec.param_indices.size(); ++k) {
    const std::size_t p = rb.spec.param_indices[k];
    pieces.push_back({own_grad(p), rb.offsets[k], layout_.tensors[p].bytes()});
  }
  s.plan = ops_->plan(s.buffer.get(), rb.spec.bytes, pieces);
}

void* Reducer::grad(std::size_t param_index) const {
  check_dense(param_index, "grad");
  if (!options_.gradient_as_bucket_view) return own_grad(param_index);
  const auto& w = where_[param_index];
  return at(state_[w.bucket].buffer.get(), w.offset);
}

std::uint64_t Reducer::grad_bytes(std::size_t param_index) const {
  check_dense(param_index, "grad_bytes");
  return layout_.tensors[param_index].bytes();
}

SparseGrad Reducer::sparse_grad(std::size_t param_index) const {
  check_index(param_index, "sparse_grad");
  const auto& t = layout_.tensors[param_index];
  if (!t.expects_sparse)
    throw UsageError(fmt::format("sparse_grad: parameter {} (index {}) has a dense gradient",
                                 t.name, param_index),
                     {"reducer", comm_.rank(), -1, "read it with grad()"});
  const auto& sp = *state_[where_[param_index].bucket].sparse;
  return {sp.result_rows, sp.result_values, sp.row_numel};
}

void Reducer::check_index(std::size_t param_index, const char* what) const {
  if (param_index >= layout_.tensors.size())
    throw UsageError(fmt::format("{}: parameter index {} is outside the layout '{}' of {} tensors",
                                 what, param_index, layout_.name, layout_.tensors.size()),
                     {"reducer", comm_.rank(), -1, "pass an index in 0..num_params-1"});
}

std::string Reducer::describe_params(const std::vector<std::size_t>& params) const {
  constexpr std::size_t kMaxNamed = 20;  // enough to recognise the module; the count says the rest
  std::string s;
  for (std::size_t i = 0; i < params.size() && i < kMaxNamed; ++i) {
    if (i) s += ", ";
    s += fmt::format("{} (index {})", layout_.tensors[params[i]].name, params[i]);
  }
  if (params.size() > kMaxNamed) s += fmt::format(" and {} more", params.size() - kMaxNamed);
  return s;
}

void Reducer::prepare_for_backward(std::span<const std::size_t> locally_unused) {
  if (in_iteration_) {
    std::vector<std::size_t> missing;
    for (std::size_t p = 0; p < marked_.size(); ++p)
      if (!marked_[p]) missing.push_back(p);
    throw UsageError(
        fmt::format("rank {}: expected to have finished reduction in the prior iteration before "
                    "starting a new one (finalize() was not called); parameters still without a "
                    "gradient: {}",
                    comm_.rank(), missing.empty() ? std::string("none") : describe_params(missing)),
        {"reducer.prepare_for_backward", comm_.rank(), -1,
         "call finalize() after every backward pass"});
  }
  if (!locally_unused.empty() && !allows_unused())
    throw UsageError("parameters declared unused while find_unused_parameters is off",
                     {"reducer.prepare_for_backward", comm_.rank(), -1,
                      "pass --find-unused-parameters (or --static-graph)"});
  // DDP rebuilds its buckets in the forward pass after the iteration it
  // recorded, before this backward.
  if (rebuild_pending_) rebuild();
  if (iteration_ + 1 == record_iteration_) recorded_order_.clear();
  // Collectives of the last iteration are all complete (finalize waited for
  // them), so the buffers are free to be written again.
  for (std::size_t b = 0; b < buckets_.size(); ++b) {
    auto& s = state_[b];
    s.pending = buckets_[b].spec.param_indices.size();
    s.launched = false;
    s.done = false;
    s.skipped = false;
    s.work.reset();
    s.post.reset();
    s.reissued = {};
    if (s.sparse) {
      s.sparse->rows.clear();
      s.sparse->values.clear();
    }
  }
  std::fill(marked_.begin(), marked_.end(), 0);
  marked_count_ = 0;
  next_to_launch_ = 0;
  if (!static_fixed()) globally_unused_.clear();  // static_graph keeps the first iteration's
  timing_ = IterationTiming{};
  timing_.buckets.resize(buckets_.size());
  timing_.backward_start = ReducerClock::now();
  sparse_second_stage_.reset();
  in_iteration_ = true;
  ++iteration_;
  for (std::size_t p : locally_unused) mark_ready_impl(p, false);
}

void Reducer::set_sparse_grad(std::size_t p, std::span<const std::int64_t> rows,
                              std::span<const std::byte> values) {
  check_index(p, "set_sparse_grad");
  const auto& t = layout_.tensors[p];
  if (!t.expects_sparse)
    throw UsageError(
        fmt::format("set_sparse_grad: parameter {} (index {}) has a dense gradient (its layout "
                    "entry is not sparse)",
                    t.name, p),
        {"reducer.set_sparse_grad", comm_.rank(), -1,
         "write a dense gradient into grad(p), or mark the tensor \"sparse\": true in the layout"});
  if (!in_iteration_)
    throw UsageError(fmt::format("set_sparse_grad for {} outside an iteration", t.name),
                     {"reducer.set_sparse_grad", comm_.rank(), -1,
                      "call prepare_for_backward() first"});
  if (marked_[p])
    throw UsageError(
        fmt::format("set_sparse_grad: parameter {} (index {}) was already marked ready in "
                    "iteration {}",
                    t.name, p, iteration_),
        {"reducer.set_sparse_grad", comm_.rank(), -1,
         "hand the sparse gradient over before mark_ready"});
  auto& sp = *state_[where_[p].bucket].sparse;
  if (values.size() != rows.size() * sp.row_bytes)
    throw UsageError(
        fmt::format("set_sparse_grad: parameter {} (index {}): {} rows of {} {} element(s) need "
                    "{} value bytes, got {}",
                    t.name, p, rows.size(), sp.row_numel, dtype_name(t.dtype),
                    rows.size() * sp.row_bytes, values.size()),
        {"reducer.set_sparse_grad", comm_.rank(), -1,
         "values hold rows.size() * product(shape[1:]) elements of the parameter's dtype"});
  for (std::size_t j = 0; j < rows.size(); ++j)
    if (rows[j] < 0 || rows[j] >= sp.num_rows)
      throw UsageError(
          fmt::format("set_sparse_grad: parameter {} (index {}): row {} (entry {}) is outside "
                      "[0, {})",
                      t.name, p, rows[j], j, sp.num_rows),
          {"reducer.set_sparse_grad", comm_.rank(), -1,
           "row indices index the first dimension of the parameter"});
  sp.rows.insert(sp.rows.end(), rows.begin(), rows.end());
  sp.values.insert(sp.values.end(), values.begin(), values.end());
}

void Reducer::mark_ready(std::size_t param_index) {
  if (!in_iteration_)
    throw UsageError("mark_ready outside an iteration",
                     {"reducer.mark_ready", comm_.rank(), -1, "call prepare_for_backward() first"});
  mark_ready_impl(param_index, true);
  timing_.last_mark_ready = ReducerClock::now();
}

void Reducer::copy_into_bucket(std::size_t p, bool zero) {
  if (ops_) return;  // the stream path moves whole buckets at launch
  const auto& w = where_[p];
  const auto& t = layout_.tensors[p];
  void* dst = at(state_[w.bucket].buffer.get(), w.offset);
  const std::uint64_t bytes = t.bytes();
  if (bytes == 0) return;
  if (zero) {
    std::memset(dst, 0, bytes);
    return;
  }
  // Hooks divide after casting, and the AVG op divides in the collective;
  // otherwise the gradient is divided on its way in.
  const bool divide = options_.hook == CompressionHook::kNone && sum_op_ == ReduceOp::kSum &&
                      comm_.size() > 1;
  const void* src = options_.gradient_as_bucket_view ? dst : own_grad(p);
  if (divide)
    copy_divided(t.dtype, dst, src, static_cast<std::size_t>(t.numel()), comm_.size());
  else if (src != dst)
    std::memcpy(dst, src, bytes);
}

void Reducer::copy_out_of_bucket(std::size_t p) {
  if (options_.gradient_as_bucket_view) return;
  const auto& w = where_[p];
  const std::uint64_t bytes = layout_.tensors[p].bytes();
  if (bytes == 0) return;
  const void* src = at(state_[w.bucket].buffer.get(), w.offset);
  if (ops_)
    ops_->copy(own_grad(p), src, bytes);  // enqueued on the stream
  else
    std::memcpy(own_grad(p), src, bytes);
}

void Reducer::copy_out_locally_unused() {
  if (options_.gradient_as_bucket_view) return;
  std::vector<std::uint8_t> nowhere(marked_.size(), 0);
  for (std::size_t p : globally_unused_) nowhere[p] = 1;
  bool enqueued = false;
  for (std::size_t p = 0; p < marked_.size(); ++p) {
    if (marked_[p] != 2 || nowhere[p] || layout_.tensors[p].expects_sparse) continue;
    const auto& w = where_[p];
    if (state_[w.bucket].skipped) continue;  // nothing was reduced
    copy_out_of_bucket(p);
    enqueued = ops_ != nullptr;
  }
  if (enqueued) ops_->fence()->wait(timeout());
}

void Reducer::mark_ready_impl(std::size_t p, bool used) {
  check_index(p, "mark_ready");
  if (marked_[p])
    throw UsageError(
        fmt::format("rank {}: parameter {} (index {}) was marked ready twice in iteration {}",
                    comm_.rank(), layout_.tensors[p].name, p, iteration_),
        {"reducer.mark_ready", comm_.rank(), -1,
         "each parameter takes part in the loss once per iteration (or declare it unused)"});
  marked_[p] = used ? 1 : 2;
  ++marked_count_;
  if (used && iteration_ == record_iteration_ && !rebuilt_before_) recorded_order_.push_back(p);
  auto& s = state_[where_[p].bucket];
  if (s.sparse) {
    // Unused: no rows, whatever was handed over.
    if (!used) {
      s.sparse->rows.clear();
      s.sparse->values.clear();
    }
  } else {
    copy_into_bucket(p, !used);
  }
  DDPDIAG_ASSERT(s.pending > 0);
  if (--s.pending == 0) {
    timing_.buckets[where_[p].bucket].ready = ReducerClock::now();
    launch_ready_buckets();
  }
}

// Buckets go out strictly in order: a ready bucket whose predecessor is not
// launched yet waits, so every rank issues the same collective sequence
// whatever the order its gradients arrive in.
void Reducer::launch_ready_buckets() {
  while (next_to_launch_ < buckets_.size() && state_[next_to_launch_].pending == 0)
    launch(next_to_launch_++);
}

// The stream path: the bucket's whole journey enqueued at once, in stream
// order: gradients in (flatten, or zeros for unused parameters), the divide
// or the hook's cast, the all_reduce, the cast back and the unflatten, then a
// fence that finalize() waits for.
void Reducer::launch_stream(std::size_t b) {
  auto& s = state_[b];
  const auto& rb = buckets_[b];
  const auto n = static_cast<std::size_t>(rb.numel);
  void* flat = s.buffer.get();
  bool any_unused = false;
  for (std::size_t p : rb.spec.param_indices) any_unused |= marked_[p] == 2;
  if (!options_.gradient_as_bucket_view && !any_unused) {
    make_plan(b);  // every parameter of the bucket has its gradient now
    ops_->flatten(*s.plan);
  } else {
    for (std::size_t k = 0; k < rb.spec.param_indices.size(); ++k) {
      const std::size_t p = rb.spec.param_indices[k];
      void* slice = at(flat, rb.offsets[k]);
      const std::uint64_t bytes = layout_.tensors[p].bytes();
      if (marked_[p] == 2)
        ops_->zero(slice, bytes);
      else if (!options_.gradient_as_bucket_view)
        ops_->copy(slice, own_grad(p), bytes);
    }
  }
  if (options_.hook == CompressionHook::kNone) {
    if (sum_op_ == ReduceOp::kSum && comm_.size() > 1)
      ops_->divide(flat, n, rb.spec.dtype, comm_.size());
    s.work = comm_.allreduce(flat, flat, n, rb.spec.dtype, sum_op_);
  } else {
    const DType t16 = options_.hook == CompressionHook::kFp16 ? DType::kFloat16 : DType::kBFloat16;
    void* c = s.compressed.get();
    ops_->compress(flat, rb.spec.dtype, c, t16, n, comm_.size());
    s.work = comm_.allreduce(c, c, n, t16, ReduceOp::kSum);
    ops_->decompress(c, t16, flat, rb.spec.dtype, n);
  }
  if (!options_.gradient_as_bucket_view) {
    if (!any_unused) {
      ops_->unflatten(*s.plan);
    } else {
      // The parameters unused here get theirs in finalize(), once it is
      // known whether another rank used them.
      for (std::size_t p : rb.spec.param_indices)
        if (marked_[p] != 2) copy_out_of_bucket(p);
    }
  }
  s.post = ops_->fence();
}

void Reducer::launch(std::size_t b) {
  auto& s = state_[b];
  const auto& rb = buckets_[b];
  if (options_.skip_all_reduce_unused_params &&
      std::all_of(rb.spec.param_indices.begin(), rb.spec.param_indices.end(),
                  [&](std::size_t p) { return marked_[p] == 2; })) {
    // As torch: no collective for a bucket of unused parameters.
    s.launched = true;
    s.skipped = true;
    auto& t = timing_.buckets[b];
    t.skipped = true;
    t.sparse = s.sparse != nullptr;
    t.launched = t.completed = ReducerClock::now();
    return;
  }
  issue_sparse_second_stage(true);  // before any other collective of ours
  const auto n = static_cast<std::size_t>(rb.numel);
  if (s.sparse) {
    launch_sparse(b);
    return;
  }
  timing_.buckets[b].payload_bytes =
      options_.hook == CompressionHook::kNone ? rb.spec.bytes : rb.numel * 2;
  if (ops_) {
    launch_stream(b);
    s.launched = true;
    timing_.buckets[b].launched = ReducerClock::now();
    return;
  }
  switch (options_.hook) {
    case CompressionHook::kNone:
      s.work = comm_.allreduce(s.buffer.get(), s.buffer.get(), n, rb.spec.dtype, sum_op_);
      break;
    case CompressionHook::kFp16: {
      auto* c = static_cast<std::uint16_t*>(s.compressed.get());
      host_ops::compress(s.buffer.get(), rb.spec.dtype, c, DType::kFloat16, n, comm_.size());
      s.work = comm_.allreduce(c, c, n, DType::kFloat16, ReduceOp::kSum);
      break;
    }
    case CompressionHook::kBf16: {
      auto* c = static_cast<std::uint16_t*>(s.compressed.get());
      host_ops::compress(s.buffer.get(), rb.spec.dtype, c, DType::kBFloat16, n, comm_.size());
      s.work = comm_.allreduce(c, c, n, DType::kBFloat16, ReduceOp::kSum);
      break;
    }
  }
  s.launched = true;
  timing_.buckets[b].launched = ReducerClock::now();
}

namespace {

// Divides (optionally) and coalesces: out_rows sorted and unique, out_vals
// the sum of each row's entries in the order they were handed over.
template <typename T>
void coalesce(const std::vector<std::int64_t>& rows, const std::byte* values,
              std::size_t row_numel, int divisor, std::vector<std::int64_t>& out_rows,
              std::vector<std::byte>& out_vals) {
  std::vector<std::size_t> order(rows.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return rows[a] < rows[b]; });
  out_rows.clear();
  std::vector<T> sums;
  for (std::size_t j : order) {
    const bool fresh = out_rows.empty() || out_rows.back() != rows[j];
    if (fresh) {
      out_rows.push_back(rows[j]);
      sums.resize(sums.size() + row_numel);
    }
    T* dst = sums.data() + sums.size() - row_numel;
    for (std::size_t e = 0; e < row_numel; ++e) {
      T v;
      std::memcpy(&v, values + (j * row_numel + e) * sizeof(T), sizeof(T));
      if (divisor > 1) v = v / static_cast<T>(divisor);
      dst[e] = fresh ? v : dst[e] + v;
    }
  }
  out_vals.resize(sums.size() * sizeof(T));
  if (!sums.empty()) std::memcpy(out_vals.data(), sums.data(), out_vals.size());
}

// coalesce() for a sparse gradient's dtype (float32 or float64, checked at
// construction).
void coalesce_as(DType t, const std::vector<std::int64_t>& rows, const std::byte* values,
                 std::size_t row_numel, int divisor, std::vector<std::int64_t>& out_rows,
                 std::vector<std::byte>& out_vals) {
  if (t == DType::kFloat32)
    coalesce<float>(rows, values, row_numel, divisor, out_rows, out_vals);
  else
    coalesce<double>(rows, values, row_numel, divisor, out_rows, out_vals);
}

}  // namespace

// A sparse bucket, first stage: divide and coalesce, then allgather the nnz.
// The second stage (indices and values, padded to the largest nnz) needs
// every rank's nnz, so it is issued later: by poll() once the nnz allgather
// has completed, or at the latest just before this reducer issues its next
// collective (the next bucket, the used-bitmap all_reduce, or finalize's
// waits). Either way every rank issues the same collectives in the same
// order: nnz(b), indices(b), values(b), then whatever follows.
void Reducer::launch_sparse(std::size_t b) {
  auto& s = state_[b];
  auto& sp = *s.sparse;
  const auto& t = layout_.tensors[sp.param];
  // Without a hook DDP divides the sparse gradient before the SUM; hooks do
  // not apply to sparse gradients, so with one the same happens; the AVG op
  // sums, then divides (finish_sparse).
  const bool divide_first = sum_op_ == ReduceOp::kSum || options_.hook != CompressionHook::kNone;
  const int divisor = divide_first ? comm_.size() : 1;
  coalesce_as(t.dtype, sp.rows, sp.values.data(), sp.row_numel, divisor, sp.coalesced_rows,
              sp.coalesced_values);
  const auto nnz = static_cast<std::int64_t>(sp.coalesced_rows.size());
  std::memcpy(sp.nnz_send.get(), &nnz, sizeof nnz);
  auto& timing = timing_.buckets[b];
  timing.sparse = true;
  s.work = comm_.allgather(sp.nnz_send.get(), sp.nnz_all.get(), 1, DType::kInt64);
  s.launched = true;
  timing.launched = ReducerClock::now();
  sparse_second_stage_ = b;
}

// The second stage of the sparse bucket whose nnz allgather is out, if any.
// With block false it is issued only when that allgather has completed.
void Reducer::issue_sparse_second_stage(bool block) {
  if (!sparse_second_stage_) return;
  const std::size_t b = *sparse_second_stage_;
  auto& s = state_[b];
  auto& sp = *s.sparse;
  if (!block) {
    if (!s.work->is_completed()) return;
    try {
      s.work->wait(Millis(1));  // done: returns at once, or rethrows its error
    } catch (...) {
      return;  // failed: reported by the blocking call (next launch or finalize)
    }
  } else {
    try {
      s.work->wait(timeout());
    } catch (const TimeoutError& e) {
      throw TimeoutError(
          fmt::format("rank {}: the nnz allgather of sparse bucket {} ({}) did not complete "
                      "within {} ms: {}",
                      comm_.rank(), b, describe_params({sp.param}), timeout().count(), e.what()),
          {"reducer.sparse", comm_.rank(), e.context().peer,
           "another rank may not have produced gradients for the buckets before it (pass "
           "--find-unused-parameters there), or a peer is slow or dead"});
    }
  }
  sparse_second_stage_.reset();
  const int world = comm_.size();
  const auto* all = static_cast<const std::int64_t*>(sp.nnz_all.get());
  sp.max_nnz = 0;
  for (int r = 0; r < world; ++r) sp.max_nnz = std::max(sp.max_nnz, all[r]);
  const auto m = static_cast<std::size_t>(sp.max_nnz);
  const auto w = static_cast<std::size_t>(world);
  timing_.buckets[b].payload_bytes =
      w * (sizeof(std::int64_t) + m * (sizeof(std::int64_t) + sp.row_bytes));
  if (m == 0) return;  // nothing touched anywhere: s.work (done) stands for the bucket
  const auto& t = layout_.tensors[sp.param];
  ensure(sp.idx_send, comm_, m * sizeof(std::int64_t));
  ensure(sp.idx_all, comm_, w * m * sizeof(std::int64_t));
  ensure(sp.val_send, comm_, m * sp.row_bytes);
  ensure(sp.val_all, comm_, w * m * sp.row_bytes);
  std::memset(sp.idx_send.get(), 0, m * sizeof(std::int64_t));
  std::memset(sp.val_send.get(), 0, m * sp.row_bytes);
  if (!sp.coalesced_rows.empty()) {
    std::memcpy(sp.idx_send.get(), sp.coalesced_rows.data(),
                sp.coalesced_rows.size() * sizeof(std::int64_t));
    std::memcpy(sp.val_send.get(), sp.coalesced_values.data(), sp.coalesced_values.size());
  }
  s.work = comm_.allgather(sp.idx_send.get(), sp.idx_all.get(), m, DType::kInt64);
  s.post = comm_.allgather(sp.val_send.get(), sp.val_all.get(), m * sp.row_numel, t.dtype);
  s.reissued = ReducerClock::now();
}

// Every rank's rows summed, in rank order, into the coalesced result: the
// union of the rows, sorted, each with the sum of its entries.
void Reducer::finish_sparse(std::size_t b) {
  auto& sp = *state_[b].sparse;
  const auto& t = layout_.tensors[sp.param];
  sp.result_rows.clear();
  sp.result_values.clear();
  const int world = comm_.size();
  const auto m = static_cast<std::size_t>(sp.max_nnz);
  if (m == 0) return;
  const auto* nnz = static_cast<const std::int64_t*>(sp.nnz_all.get());
  const auto* idx = static_cast<const std::int64_t*>(sp.idx_all.get());
  const auto* vals = static_cast<const std::byte*>(sp.val_all.get());
  // Each rank's entries without its padding, rank after rank.
  std::vector<std::int64_t> rows;
  std::vector<std::byte> values;
  for (int r = 0; r < world; ++r) {
    const auto* ri = idx + static_cast<std::size_t>(r) * m;
    const auto* rv = vals + static_cast<std::size_t>(r) * m * sp.row_bytes;
    const auto n = static_cast<std::size_t>(nnz[r]);
    for (std::size_t j = 0; j < n; ++j)
      if (ri[j] < 0 || ri[j] >= sp.num_rows)
        throw BackendError(fmt::format("rank {}: rank {} sent row {} for {}, outside [0, {})",
                                       comm_.rank(), r, ri[j], t.name, sp.num_rows),
                           {"reducer.finalize", comm_.rank(), r,
                            "the ranks disagree on the layout (pass the same --model everywhere)"});
    rows.insert(rows.end(), ri, ri + n);
    values.insert(values.end(), rv, rv + n * sp.row_bytes);
  }
  coalesce_as(t.dtype, rows, values.data(), sp.row_numel, 1, sp.result_rows, sp.result_values);
  // The AVG op: the sum, then the division, as Gloo's AVG does.
  if (sum_op_ == ReduceOp::kAvg && options_.hook == CompressionHook::kNone && world > 1)
    divide_host(t.dtype, sp.result_values.data(), sp.result_rows.size() * sp.row_numel, world);
}

void Reducer::poll() {
  issue_sparse_second_stage(false);
  for (std::size_t b = 0; b < next_to_launch_; ++b) {
    if (sparse_second_stage_ == b) continue;  // its nnz allgather alone is not the bucket
    auto& t = timing_.buckets[b];
    const auto& w = state_[b].post ? state_[b].post : state_[b].work;
    if (!happened(t.completed) && w && w->is_completed()) t.completed = ReducerClock::now();
  }
}

// Each wait has a deadline of its own, the timeout counted from when the
// collective could start: the later of its issue and `since` (when the
// collective before it completed, or finalize began); s.post (the fence
// after the post-processing, or the values allgather) from s.work's
// completion.
void Reducer::wait_bucket(std::size_t b, ReducerClock::time_point since) {
  auto& s = state_[b];
  if (s.skipped) return;
  const auto started = std::max({since, timing_.buckets[b].launched, s.reissued});
  try {
    s.work->wait(left_until(started + timeout()));
    if (s.post) s.post->wait(timeout());
  } catch (const TimeoutError& e) {
    const auto& params = buckets_[b].spec.param_indices;
    std::vector<std::size_t> first(params.begin(),
                                   params.begin() + static_cast<std::ptrdiff_t>(
                                                        std::min<std::size_t>(params.size(), 3)));
    throw TimeoutError(
        fmt::format("rank {}: the {} of bucket {} ({} parameter(s), {} B, e.g. {}) did not "
                    "complete within {} ms: {}",
                    comm_.rank(), s.sparse ? "sparse allgathers" : "all_reduce", b,
                    params.size(), buckets_[b].spec.bytes, describe_params(first),
                    timeout().count(), e.what()),
        {"reducer.finalize", comm_.rank(), e.context().peer,
         "another rank may not have produced gradients for these parameters (pass "
         "--find-unused-parameters there), or a peer is slow or dead"});
  }
  if (!happened(timing_.buckets[b].completed)) timing_.buckets[b].completed = ReducerClock::now();
}

void Reducer::finish_bucket(std::size_t b) {
  auto& s = state_[b];
  if (s.skipped) {
    // Nothing was reduced: the gradients of its (unused) parameters stay.
  } else if (s.sparse) {
    finish_sparse(b);
  } else if (!ops_) {
    const auto& rb = buckets_[b];
    const auto n = static_cast<std::size_t>(rb.numel);
    if (options_.hook == CompressionHook::kFp16)
      host_ops::decompress(s.compressed.get(), DType::kFloat16, s.buffer.get(), rb.spec.dtype, n);
    else if (options_.hook == CompressionHook::kBf16)
      host_ops::decompress(s.compressed.get(), DType::kBFloat16, s.buffer.get(), rb.spec.dtype, n);
    // The parameters unused here get theirs in finalize(), once it is known
    // whether another rank used them.
    for (std::size_t p : rb.spec.param_indices)
      if (marked_[p] != 2) copy_out_of_bucket(p);
  }
  s.done = true;
}

void Reducer::drain_in_flight(ReducerClock::time_point since) noexcept {
  bool stuck = false;
  auto drain = [&](const std::shared_ptr<Work>& w) {
    if (!w || stuck) return;
    try {
      // One already complete moves nothing on: when it completed is unknown.
      if (w->is_completed()) {
        w->wait(Millis(1));
        return;
      }
      w->wait(left_until(since + timeout()));
      since = std::max(since, ReducerClock::now());
    } catch (const TimeoutError&) {
      stuck = true;
    } catch (...) {
      // The op failed: it no longer touches our buffers.
    }
  };
  for (std::size_t b = 0; b < state_.size(); ++b)
    if (state_[b].launched && !state_[b].done) {
      drain(state_[b].work);
      drain(state_[b].post);
    }
  drain(used_map_work_);
  used_map_work_.reset();
  sparse_second_stage_.reset();
  // A collective that is still running may write into buffers we are about
  // to free or reuse: stop the backend.
  if (stuck) {
    try {
      comm_.abort();
    } catch (...) {
    }
  }
}

void Reducer::check_static_graph() const {
  std::vector<std::size_t> now_used, now_unused;
  for (std::size_t p = 0; p < marked_.size(); ++p) {
    const bool used = marked_[p] == 1;
    if (used && !static_used_[p]) now_used.push_back(p);
    if (!used && static_used_[p]) now_unused.push_back(p);
  }
  if (now_used.empty() && now_unused.empty()) return;
  std::string what;
  if (!now_used.empty())
    what = fmt::format("{} unused in the first iteration got a gradient: {}", now_used.size(),
                       describe_params(now_used));
  if (!now_unused.empty())
    what += fmt::format("{}{} used in the first iteration got none: {}", what.empty() ? "" : "; ",
                        now_unused.size(), describe_params(now_unused));
  throw UsageError(
      fmt::format("rank {}: the training graph changed in iteration {}, which static_graph=True "
                  "does not allow (torch: \"Your training graph has changed in this iteration\"): "
                  "parameter(s) {}",
                  comm_.rank(), iteration_, what),
      {"reducer.finalize", comm_.rank(), -1,
       "use the same parameters in every iteration, or run without --static-graph "
       "(--find-unused-parameters copes with a graph that changes)"});
}

void Reducer::finalize() {
  if (!in_iteration_)
    throw UsageError("finalize without prepare_for_backward",
                     {"reducer.finalize", comm_.rank(), -1, "call prepare_for_backward() first"});
  timing_.finalize_start = ReducerClock::now();
  // Each collective waited for here has a deadline of its own: the timeout
  // counted from the later of its start and the completion of the one before
  // it (this finalize's start at the earliest), as the watchdog counts a
  // collective's. Buckets that take longer than the timeout in all are no
  // hang while each completes within it; one that stalls is still caught a
  // timeout after it could have completed.
  auto since = timing_.finalize_start;
  std::vector<std::size_t> missing;
  for (std::size_t p = 0; p < marked_.size(); ++p)
    if (!marked_[p]) missing.push_back(p);

  if (!missing.empty() && !allows_unused()) {
    // The buckets holding these parameters were never launched here; the
    // ones launched before them must finish before the buffers are reused.
    drain_in_flight(since);
    in_iteration_ = false;
    throw UsageError(
        fmt::format("rank {}: expected to have finished reduction in this iteration, but {} "
                    "parameter(s) never received a gradient: {}. This happens when a module has "
                    "parameters that were not used in producing the loss; DDP cannot tell them "
                    "from gradients that are merely late without find_unused_parameters",
                    comm_.rank(), missing.size(), describe_params(missing)),
        {"reducer.finalize", comm_.rank(), -1,
         "pass --find-unused-parameters (DDP's find_unused_parameters=True) or make sure every "
         "parameter takes part in the loss"});
  }
  ReducerClock::time_point used_map_issued{};
  try {
    // Parameters that never arrived count as locally unused: zero
    // contributions, so their buckets complete on every rank.
    for (std::size_t p : missing) mark_ready_impl(p, false);
    issue_sparse_second_stage(true);
    if (static_fixed()) check_static_graph();
    // Every iteration with find_unused_parameters; with static_graph the
    // first only.
    if (allows_unused() && !static_fixed()) {
      // After every bucket, so all ranks issue it at the same position.
      for (std::size_t p = 0; p < marked_.size(); ++p) used_map_[p] = marked_[p] == 1 ? 1 : 0;
      // As DDP's local_used_map_: int32, summed (a parameter is used when
      // any rank used it), so the traffic is DDP's 4 bytes a parameter.
      comm_.copy_from_host(used_map_buffer_.get(), used_map_.data(), used_map_.size() * sizeof(std::int32_t));
      used_map_work_ = comm_.allreduce(used_map_buffer_.get(), used_map_buffer_.get(),
                                       used_map_.size(), DType::kInt32, ReduceOp::kSum);
      used_map_issued = ReducerClock::now();
    }
    DDPDIAG_ASSERT(next_to_launch_ == buckets_.size());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      wait_bucket(b, since);
      since = std::max(since, timing_.buckets[b].completed);
      finish_bucket(b);
    }
    if (used_map_work_) {
      used_map_work_->wait(left_until(std::max(since, used_map_issued) + timeout()));
      used_map_work_.reset();
      comm_.copy_to_host(used_map_.data(), used_map_buffer_.get(), used_map_.size() * sizeof(std::int32_t));
      // Every rank contributed zeros for these, so their reduced gradients
      // are zero already; the list is for the caller.
      for (std::size_t p = 0; p < used_map_.size(); ++p)
        if (!used_map_[p]) globally_unused_.push_back(p);
      if (options_.static_graph) {
        static_used_.assign(marked_.begin(), marked_.end());
        for (auto& u : static_used_) u = u == 1;
      }
    }
    copy_out_locally_unused();
  } catch (...) {
    // After a collective that timed out, its deadline has passed: the drain
    // stops the backend at once.
    drain_in_flight(since);
    in_iteration_ = false;
    throw;
  }
  timing_.finalize_end = ReducerClock::now();
  in_iteration_ = false;
  if (iteration_ == record_iteration_ && !rebuilt_before_) {
    // The parameters that got no gradient here (static_graph) follow the
    // ready ones in index order, as DDP rebuilds them.
    for (std::size_t p = 0; p < marked_.size(); ++p)
      if (marked_[p] != 1) recorded_order_.push_back(p);
    rebuild_pending_ = true;
  }
}

void Reducer::rebuild() {
  rebuild_pending_ = false;
  const std::size_t n = layout_.tensors.size();
  DDPDIAG_ASSERT(recorded_order_.size() == n);
  std::vector<std::int64_t> order(recorded_order_.begin(), recorded_order_.end());
  if (comm_.size() > 1) {
    // Rank 0's order, as DDP broadcasts rank 0's rebuilt bucket indices.
    CommBuffer buf(comm_, n * sizeof(std::int64_t));
    comm_.copy_from_host(buf.get(), order.data(), n * sizeof(std::int64_t));
    auto w = comm_.broadcast(buf.get(), n, DType::kInt64, 0);
    try {
      w->wait(timeout());
    } catch (const TimeoutError& e) {
      try {
        comm_.abort();  // it may still write into buf
      } catch (...) {
      }
      throw TimeoutError(
          fmt::format("rank {}: the broadcast of rank 0's gradient order, from which the buckets "
                      "are rebuilt before iteration {}, did not complete within {} ms: {}",
                      comm_.rank(), iteration_, timeout().count(), e.what()),
          {"reducer.prepare_for_backward", comm_.rank(), e.context().peer,
           "every rank must run the same iterations; a peer may be slow or dead"});
    }
    comm_.copy_to_host(order.data(), buf.get(), n * sizeof(std::int64_t));
  }
  std::vector<std::size_t> rank0(n);
  for (std::size_t k = 0; k < n; ++k)
    rank0[k] = order[k] < 0 ? std::numeric_limits<std::size_t>::max() : static_cast<std::size_t>(order[k]);
  std::vector<DdpBucket> specs;
  try {
    specs = ddp_buckets_rebuilt_from(layout_, rank0, limits_, options_.set_last_bucket_small);
  } catch (const UsageError& e) {
    throw UsageError(fmt::format("rank {}: rank 0's gradient order does not fit this rank's layout "
                                 "'{}' ({})",
                                 comm_.rank(), layout_.name, e.what()),
                     {"reducer.prepare_for_backward", comm_.rank(), 0,
                      "every rank must run the same model layout"});
  }
  // A sparse parameter's reduced gradient outlives the rebuild, as its .grad
  // does in torch.
  std::vector<std::unique_ptr<SparseState>> sparse(n);
  for (auto& st : state_)
    if (st.sparse) sparse[st.sparse->param] = std::move(st.sparse);
  install_buckets(specs);
  for (auto& st : state_)
    if (st.sparse && sparse[st.sparse->param]) st.sparse = std::move(sparse[st.sparse->param]);
  rebuild_order_ = std::move(rank0);
  rebuilt_before_ = iteration_;
}

}  // namespace ddpdiag::ddp_core
