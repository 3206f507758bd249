// The NCCL backend.
//
// Init protocol (every step has the caller's deadline):
//  1. cudaGetDeviceCount: no driver or no GPU is a BackendError naming CUDA's
//     message, never a crash.
//  2. cudaSetDevice(opts.device, else local_rank).
//  3. Every rank publishes "nccl/device/<rank>" = uuid|pci bus id|host|ordinal
//     and waits for all the others; two ranks on one GPU are a UsageError
//     naming both ranks and the device, found before NCCL would fail with
//     "Duplicate GPU detected".
//  4. Rank 0 creates the unique id and publishes "nccl/unique_id"; the others
//     wait for it.
//  5. ncclCommInitRankConfig with blocking = 0, then ncclCommGetAsyncError is
//     polled until the state leaves ncclInProgress; on error or at the
//     deadline the communicator is aborted (ncclCommAbort) and we throw.
//
// Operations are enqueued on one non-blocking stream; each Work records a
// CUDA event after its op and waits by polling cudaEventQuery together with
// ncclCommGetAsyncError, so a peer that never joins becomes a TimeoutError
// and an asynchronous NCCL failure an error, not a hang. Aborting is the
// caller's choice (Work::abort / Communicator::abort).
#include "comm/nccl/nccl_communicator.h"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>
#include <thread>

#include "comm/nccl/device_kernels.h"
#include "comm/nccl/nccl_compat.h"
#include "comm/store/sliced_wait.h"

namespace ddpdiag::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;

// Polling of events and of NCCL's state: spin (yielding) for the first
// kPollSpin, then sleep kPollSleep between queries so a long wait does not
// burn a core. The spin covers a timed burst of small collectives (the sweep
// waits once, on the last of -n ops): with 200 us, a burst of 20 ops ending
// after the spin was seen up to one sleep (50 us and the timer's slack) late,
// a few us per op in the small sizes' latency. Past 10 ms that error is
// under 1% of the burst.
constexpr auto kPollSpin = std::chrono::milliseconds(10);
constexpr auto kPollSleep = std::chrono::microseconds(50);

void poll_pause(Clock::time_point started) {
  if (Clock::now() - started < kPollSpin)
    std::this_thread::yield();
  else
    std::this_thread::sleep_for(kPollSleep);
}

std::string cuda_message(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

// cudaEventQuery on an op still running answers cudaErrorNotReady, and that
// answer can stay behind as the thread's "last error", where the next kernel
// launch's cudaGetLastError() would report it as its own failure. PyTorch
// clears it after every such query; so do we.
cudaError_t query_event(cudaEvent_t ev) {
  const cudaError_t q = cudaEventQuery(ev);
  if (q == cudaErrorNotReady) (void)cudaGetLastError();
  return q;
}

// A synchronous cudaMemcpy from pageable host memory may return before its
// DMA has landed, and it runs on the legacy default stream, which our
// non-blocking stream does not wait for. Work enqueued on `stream` after
// this waits for everything on the legacy stream so far, without blocking
// the host.
cudaError_t order_after_legacy_stream(cudaStream_t stream) {
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ev, cudaStreamLegacy);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream, ev, 0);
  if (ev) cudaEventDestroy(ev);  // released once the wait no longer needs it
  return e;
}

std::string nccl_message(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last && *last) s += " (" + std::string(last) + ")";
  return s;
}

std::string hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

ncclDataType_t to_nccl(DType t) {
  switch (t) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kFloat64: return ncclFloat64;
    case DType::kFloat16: return ncclFloat16;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kInt32: return ncclInt32;
    case DType::kInt64: return ncclInt64;
    case DType::kInt8: return ncclInt8;
    case DType::kUInt8: return ncclUint8;
  }
  return ncclUint8;
}

ncclRedOp_t to_nccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProd: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg: return ncclAvg;
  }
  return ncclSum;
}

// An asynchronous NCCL failure: a remote error is the peer's fault.
[[noreturn]] void throw_async(ncclResult_t st, ncclComm_t comm, const std::string& where,
                              int rank) {
  const std::string msg = where + " failed on rank " + std::to_string(rank) + ": NCCL " +
                          nccl_message(st, comm);
  if (st == ncclRemoteError)
    throw PeerError(msg, ErrorContext{where, rank, -1,
                                      "a peer failed or closed its connection; check the logs "
                                      "of the other ranks (NCCL_DEBUG=INFO shows which)"});
  throw BackendError(msg, ErrorContext{where, rank, -1,
                                       "rerun with NCCL_DEBUG=INFO for NCCL's own diagnosis"});
}

// State shared by the communicator and its Work handles, so that a Work can
// abort the communicator and outlive it safely.
struct Shared {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int device = 0;
  std::mutex mutex;  // serialises abort against destruction
  std::atomic<bool> aborted{false};
  // A wait gave up on an op (its deadline, or NCCL's asynchronous error)
  // while the op may still run on the GPU.
  std::atomic<bool> gave_up{false};
  bool destroyed = false;

  void abort() {
    std::lock_guard<std::mutex> lock(mutex);
    if (aborted.exchange(true) || destroyed || !comm) return;
    cudaSetDevice(device);
    ncclCommAbort(comm);
    comm = nullptr;
  }

  // NCCL's state of the communicator (ncclCommGetAsyncError), one query
  // under the mutex; nullopt once it was aborted or destroyed.
  std::optional<ncclResult_t> async_state() {
    std::lock_guard<std::mutex> lock(mutex);
    if (aborted.load() || !comm) return std::nullopt;
    ncclResult_t st = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &st) != ncclSuccess) return ncclInternalError;
    return st;
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<Shared> shared, cudaEvent_t event, std::string what)
      : shared_(std::move(shared)), event_(event), what_(std::move(what)) {}
  ~NcclWork() override {
    if (event_) cudaEventDestroy(event_);
  }

  // Also called from the monitor's watchdog thread: the device is set first,
  // or that thread's first CUDA call would make a context on device 0.
  bool is_completed() override {
    if (done_) return true;
    if (shared_->aborted.load()) return true;
    cudaSetDevice(shared_->device);
    const cudaError_t q = query_event(event_);
    if (q == cudaSuccess) done_ = true;
    return q != cudaErrorNotReady;
  }

  void wait(Millis timeout) override {
    if (done_) return;
    const auto started = Clock::now();
    const auto deadline = deadline_after(timeout);
    for (;;) {
      if (shared_->aborted.load())
        throw BackendError(what_ + " on rank " + std::to_string(shared_->rank) +
                               " was aborted: the communicator is no longer usable",
                           ErrorContext{what_, shared_->rank, -1, "create a new communicator"});
      const cudaError_t q = query_event(event_);
      if (q == cudaSuccess) {
        done_ = true;
        return;
      }
      if (q != cudaErrorNotReady)
        throw BackendError(what_ + " failed on rank " + std::to_string(shared_->rank) + ": CUDA " +
                               cuda_message(q),
                           ErrorContext{what_, shared_->rank, -1, "a CUDA error; check the GPU"});
      {
        std::lock_guard<std::mutex> lock(shared_->mutex);
        ncclResult_t st = ncclSuccess;
        if (shared_->comm && ncclCommGetAsyncError(shared_->comm, &st) != ncclSuccess)
          st = ncclInternalError;
        if (st != ncclSuccess && st != ncclInProgress) {
          shared_->gave_up = true;
          throw_async(st, shared_->comm, what_, shared_->rank);
        }
      }
      if (Clock::now() >= deadline) {
        shared_->gave_up = true;
        throw TimeoutError(what_ + " did not complete within " + std::to_string(timeout.count()) +
                               " ms on rank " + std::to_string(shared_->rank),
                           ErrorContext{what_, shared_->rank, -1,
                                        "a peer has not joined this operation or is stuck; every "
                                        "rank must issue the same collectives in the same order; "
                                        "abort the communicator before giving up"});
      }
      poll_pause(started);
    }
  }

  void abort() override { shared_->abort(); }

 private:
  std::shared_ptr<Shared> shared_;
  cudaEvent_t event_ = nullptr;
  std::string what_;
  // Set by the thread that sees the event complete: the main thread, or the
  // watchdog's through is_completed().
  std::atomic<bool> done_{false};
};

// Waits for the communicator to leave ncclInProgress (after a non-blocking
// init, an enqueue that returned ncclInProgress, or ncclCommFinalize).
// Returns the final state, or ncclInProgress at the deadline.
// `between`, when given, runs about every kWaitSlice and throws to give up.
ncclResult_t wait_comm_state(ncclComm_t comm, Clock::time_point deadline,
                             const std::function<void()>& between = {}) {
  const auto started = Clock::now();
  auto next_between = started + kWaitSlice;
  for (;;) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r != ncclSuccess) return r;
    if (st != ncclInProgress) return st;
    const auto now = Clock::now();
    if (now >= deadline) return ncclInProgress;
    if (between && now >= next_between) {
      between();
      next_between = now + kWaitSlice;
    }
    poll_pause(started);
  }
}

// StreamOps as kernels on the communicator's stream (comm/nccl/device_kernels.h):
// ordered with its collectives, no host synchronisation.
class NcclStreamOps final : public StreamOps {
 public:
  NcclStreamOps(std::shared_ptr<Shared> shared, cudaStream_t stream)
      : shared_(std::move(shared)), stream_(stream) {}

  class DevicePlan final : public CopyPlan {
   public:
    DevicePlan(int device, std::uint64_t bytes, std::vector<kernels::CopyChunk> chunks)
        : device_(device), count_(chunks.size()) {
      bytes_ = bytes;
      if (chunks.empty()) return;
      cudaSetDevice(device_);
      const std::size_t size = chunks.size() * sizeof(kernels::CopyChunk);
      cudaError_t e = cudaMalloc(&chunks_, size);
      if (e == cudaSuccess) e = cudaMemcpy(chunks_, chunks.data(), size, cudaMemcpyHostToDevice);
      if (e != cudaSuccess) {
        if (chunks_) cudaFree(chunks_);
        chunks_ = nullptr;
        const std::string msg = "uploading a flatten plan of " + std::to_string(count_) +
                                " chunks failed: " + cuda_message(e);
        if (e == cudaErrorMemoryAllocation)
          throw UsageError(msg, ErrorContext{"stream_ops.plan", -1, -1,
                                             "the GPU is full: use a smaller model or bucket cap, or "
                                             "free GPU memory (nvidia-smi shows who holds it)"});
        throw BackendError(msg, ErrorContext{"stream_ops.plan", -1, -1, "a CUDA error; check the GPU"});
      }
    }
    ~DevicePlan() override {
      if (chunks_) cudaFree(chunks_);
    }
    DevicePlan(const DevicePlan&) = delete;
    DevicePlan& operator=(const DevicePlan&) = delete;
    const kernels::CopyChunk* chunks() const { return chunks_; }
    std::size_t count() const { return count_; }

   private:
    int device_;
    kernels::CopyChunk* chunks_ = nullptr;
    std::size_t count_;
  };

  std::unique_ptr<CopyPlan> plan(void* flat, std::uint64_t flat_bytes,
                                 std::span<const FlatPiece> pieces) override {
    host_ops::check_pieces(flat_bytes, pieces);
    auto p = std::make_unique<DevicePlan>(shared_->device, flat_bytes,
                                          kernels::make_chunks(flat, pieces));
    check(order_after_legacy_stream(stream_), "plan");  // the kernels read the uploaded chunks
    return p;
  }
  void flatten(const CopyPlan& p) override { run_plan(p, true, "flatten"); }
  void unflatten(const CopyPlan& p) override { run_plan(p, false, "unflatten"); }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (!bytes || dst == src) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "copy");
  }
  void zero(void* dst, std::size_t bytes) override {
    if (bytes) check(cudaMemsetAsync(dst, 0, bytes, stream_), "zero");
  }
  void divide(void* buf, std::size_t n, DType t, int divisor) override {
    check(kernels::divide(buf, n, t, divisor, stream_), "divide");
  }
  void compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
                int divisor) override {
    host_ops::check_compress_types("compress", src_type, dst_type);
    check(kernels::compress(src, src_type, dst16, dst_type, n, divisor, stream_), "compress");
  }
  void decompress(const void* src16, DType src_type, void* dst, DType dst_type,
                  std::size_t n) override {
    host_ops::check_compress_types("decompress", dst_type, src_type);
    check(kernels::decompress(src16, src_type, dst, dst_type, n, stream_), "decompress");
  }
  std::shared_ptr<Work> fence() override {
    cudaSetDevice(shared_->device);
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ev, stream_);
    if (e != cudaSuccess) {
      if (ev) cudaEventDestroy(ev);
      check(e, "fence");
    }
    return std::make_shared<NcclWork>(shared_, ev, "fence #" + std::to_string(++fences_));
  }

 private:
  void run_plan(const CopyPlan& p, bool to_flat, const char* what) {
    const auto& d = dynamic_cast<const DevicePlan&>(p);
    check(kernels::copy_chunks(d.chunks(), d.count(), to_flat, stream_), what);
  }
  void check(cudaError_t e, const char* what) {
    if (e == cudaSuccess) return;
    throw BackendError(std::string(what) + " on rank " + std::to_string(shared_->rank) +
                           " could not be enqueued: CUDA " + cuda_message(e),
                       ErrorContext{what, shared_->rank, -1, "a CUDA error; check the GPU"});
  }

  std::shared_ptr<Shared> shared_;
  cudaStream_t stream_;
  std::uint64_t fences_ = 0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const CommOptions& opts, std::shared_ptr<Shared> shared, cudaStream_t stream,
                   std::string device_name)
      : shared_(std::move(shared)),
        size_(opts.world_size),
        stream_(stream),
        device_name_(std::move(device_name)) {
    timeout_ = opts.timeout;
  }

  ~NcclCommunicator() override {
    // Normal shutdown: finalize (flushes outstanding work; the state goes
    // through ncclInProgress), then destroy. If finalize does not finish
    // within the default timeout, a peer is gone: abort instead.
    {
      std::lock_guard<std::mutex> lock(shared_->mutex);
      if (!shared_->aborted.load() && shared_->comm) {
        cudaSetDevice(shared_->device);
        // A wait gave up on an op (a peer stuck or gone): finalize would only
        // wait for it until the timeout again, so abort at once.
        ncclResult_t st = ncclInternalError;
        if (!shared_->gave_up) {
          st = ncclCommFinalize(shared_->comm);
          if (st == ncclSuccess || st == ncclInProgress)
            st = wait_comm_state(shared_->comm, deadline_after(timeout_));
        }
        if (st == ncclSuccess)
          ncclCommDestroy(shared_->comm);
        else
          ncclCommAbort(shared_->comm);
        shared_->comm = nullptr;
        if (shared_->gave_up) shared_->aborted = true;
      }
      shared_->destroyed = true;
    }
    if (barrier_buf_) cudaFree(barrier_buf_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  int rank() const override { return shared_->rank; }
  int size() const override { return size_; }
  Backend backend() const override { return Backend::kNccl; }
  MemoryKind memory_kind() const override { return MemoryKind::kDevice; }
  std::string library_version() const override { return nccl_backend::library_version(); }
  std::string device_name() const override { return device_name_; }

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    return enqueue("allreduce", [&](ncclComm_t c) {
      return ncclAllReduce(send, recv, count, to_nccl(dtype), to_nccl(op), c, stream_);
    });
  }
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    check_rank("broadcast", root);
    return enqueue("broadcast", [&](ncclComm_t c) {
      return ncclBroadcast(buf, buf, count, to_nccl(dtype), root, c, stream_);
    });
  }
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root) override {
    check_rank("reduce", root);
    return enqueue("reduce", [&](ncclComm_t c) {
      return ncclReduce(send, recv, count, to_nccl(dtype), to_nccl(op), root, c, stream_);
    });
  }
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                  DType dtype) override {
    return enqueue("allgather", [&](ncclComm_t c) {
      return ncclAllGather(send, recv, count, to_nccl(dtype), c, stream_);
    });
  }
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                       DType dtype, ReduceOp op) override {
    return enqueue("reduce_scatter", [&](ncclComm_t c) {
      return ncclReduceScatter(send, recv, recv_count, to_nccl(dtype), to_nccl(op), c, stream_);
    });
  }
  // NCCL has no tags: messages between one pair match in issue order, which
  // is what callers that issue in the same order on both sides get anyway.
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t /*tag*/) override {
    check_peer("send", peer);
    return enqueue("send", [&](ncclComm_t c) {
      return ncclSend(buf, count, to_nccl(dtype), peer, c, stream_);
    });
  }
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t /*tag*/) override {
    check_peer("recv", peer);
    return enqueue("recv", [&](ncclComm_t c) {
      return ncclRecv(buf, count, to_nccl(dtype), peer, c, stream_);
    });
  }
  // Both halves in one NCCL group, so they progress together.
  std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count, int send_peer,
                                void* recv_buf, std::size_t recv_count, int recv_peer, DType dtype,
                                std::uint32_t /*tag*/) override {
    check_peer("sendrecv", send_peer);
    check_peer("sendrecv", recv_peer);
    return enqueue("sendrecv", [&](ncclComm_t c) {
      ncclResult_t r = ncclGroupStart();
      if (r != ncclSuccess) return r;
      // ncclGroupEnd must follow ncclGroupStart even when a call in between failed.
      ncclResult_t s = send_count ? ncclSend(send_buf, send_count, to_nccl(dtype), send_peer, c, stream_)
                                  : ncclSuccess;
      ncclResult_t v = (s == ncclSuccess && recv_count)
                           ? ncclRecv(recv_buf, recv_count, to_nccl(dtype), recv_peer, c, stream_)
                           : ncclSuccess;
      const ncclResult_t e = ncclGroupEnd();
      if (s != ncclSuccess) return s;
      if (v != ncclSuccess) return v;
      return e;
    });
  }
  // A barrier is an all_reduce of one int on the device: it completes only
  // when every rank has issued it.
  std::shared_ptr<Work> barrier() override {
    if (!barrier_buf_) barrier_buf_ = alloc(sizeof(int));
    return enqueue("barrier", [&](ncclComm_t c) {
      return ncclAllReduce(barrier_buf_, barrier_buf_, 1, ncclInt32, ncclSum, c, stream_);
    });
  }

  void* alloc(std::size_t bytes) override {
    cudaSetDevice(shared_->device);
    void* p = nullptr;
    const cudaError_t e = cudaMalloc(&p, std::max<std::size_t>(bytes, 1));
    if (e == cudaErrorMemoryAllocation)
      throw UsageError("cudaMalloc of " + std::to_string(bytes) + " bytes failed on rank " +
                           std::to_string(rank()) + ": " + cuda_message(e),
                       ErrorContext{"alloc", rank(), -1,
                                    "use smaller sizes (-e / --maxbytes, --bytes, --workspace-mb, the model), or "
                                    "free GPU memory (nvidia-smi shows who holds it)"});
    if (e != cudaSuccess)
      throw BackendError("cudaMalloc of " + std::to_string(bytes) + " bytes failed on rank " +
                             std::to_string(rank()) + ": " + cuda_message(e),
                         ErrorContext{"alloc", rank(), -1, "use smaller sizes or free GPU memory"});
    return p;
  }
  // cudaFree waits for the device: after a wait gave up on an op that may
  // never finish (a peer that never joins), that would hang. Freeing then
  // means the caller has given up too, so the communicator is aborted first
  // (ncclCommAbort ends the op's kernels), as NCCL asks after a timeout.
  //
  // cudaFree also waits for the device when nobody gave up yet: a buffer
  // freed while the last collective still waits for a peer (the stack
  // unwinding past an error of another kind) would hang there. So the last
  // collective gets the communicator's timeout to finish first; if it does
  // not, or NCCL reports an error, the communicator is aborted.
  void free(void* ptr) override {
    if (!ptr) return;
    if (shared_->gave_up.load() && !shared_->aborted.load()) shared_->abort();
    settle_last_op();
    cudaSetDevice(shared_->device);
    cudaFree(ptr);
  }
  // Synchronous copies; the caller waits on the Work of an op before it
  // copies that op's buffers (our stream does not synchronise with them).
  // What is enqueued after a copy_from_host is ordered after its DMA.
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    copy(host_dst, src, bytes, cudaMemcpyDeviceToHost, "copy_to_host");
  }
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    copy(dst, host_src, bytes, cudaMemcpyHostToDevice, "copy_from_host");
    if (bytes == 0) return;
    if (const cudaError_t e = order_after_legacy_stream(stream_); e != cudaSuccess)
      throw BackendError("copy_from_host of " + std::to_string(bytes) +
                             " bytes: ordering it before later work failed: " + cuda_message(e),
                         ErrorContext{"copy_from_host", rank(), -1, "a CUDA error; check the GPU"});
  }

  void abort() override { shared_->abort(); }

  StreamOps* stream_ops() override {
    if (!stream_ops_) stream_ops_ = std::make_unique<NcclStreamOps>(shared_, stream_);
    return stream_ops_.get();
  }

  // Not once aborted (split() would refuse at once; bisect asks every rank
  // before any of them enters ncclCommSplit).
  bool can_split() const override { return !shared_->aborted.load(); }
  // ncclCommSplit, non-blocking like init: the parent's state and then the
  // child's are polled until they leave ncclInProgress or the deadline.
  std::unique_ptr<Communicator> split(int color, int key, Millis timeout) override {
    const auto deadline = deadline_after(timeout);
    const auto aborted_error = [&] {
      return BackendError("split on rank " + std::to_string(rank()) +
                              ": the communicator was aborted",
                          ErrorContext{"split", rank(), -1, "create a new communicator"});
    };
    // NCCL calls on one communicator from two threads at once are not
    // allowed: the call is made under the mutex that abort takes, and the
    // parent's state is then polled one query at a time under it (as in
    // enqueue), so an abort can still get in and end the wait.
    std::unique_lock<std::mutex> lock(shared_->mutex);
    if (shared_->aborted.load() || !shared_->comm) throw aborted_error();
    cudaSetDevice(shared_->device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    ncclResult_t r = ncclCommSplit(shared_->comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key,
                                   &child, &config);
    if (r == ncclSuccess || r == ncclInProgress) {
      lock.unlock();
      const auto polled = poll_comm_state(deadline);
      if (!polled) {
        if (child) ncclCommAbort(child);
        throw aborted_error();
      }
      r = *polled;
      if (r == ncclSuccess && child) r = wait_comm_state(child, deadline);  // ours alone
      lock.lock();
    }
    if (r != ncclSuccess) {
      const std::string msg = r == ncclInProgress ? "" : nccl_message(r, shared_->comm);
      if (child) ncclCommAbort(child);
      if (r == ncclInProgress)
        throw TimeoutError("ncclCommSplit did not finish within " +
                               std::to_string(timeout.count()) + " ms on rank " +
                               std::to_string(rank()),
                           ErrorContext{"split", rank(), -1,
                                        "every rank of the parent must call split; a rank "
                                        "that does not (or is stuck) blocks the others"});
      throw BackendError("ncclCommSplit failed on rank " + std::to_string(rank()) + ": " + msg,
                         ErrorContext{"split", rank(), -1,
                                      "rerun with NCCL_DEBUG=INFO for NCCL's own diagnosis"});
    }
    lock.unlock();
    if (color < 0 || !child) return nullptr;
    int child_rank = 0, child_size = 0;
    ncclCommUserRank(child, &child_rank);
    ncclCommCount(child, &child_size);
    auto shared = std::make_shared<Shared>();
    shared->comm = child;
    shared->rank = child_rank;
    shared->device = shared_->device;
    cudaStream_t stream = nullptr;
    if (const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
        e != cudaSuccess) {
      shared->abort();
      throw BackendError("cudaStreamCreateWithFlags failed: " + cuda_message(e),
                         ErrorContext{"split", rank(), -1, "a CUDA error; check the GPU"});
    }
    CommOptions o;
    o.backend = Backend::kNccl;
    o.rank = child_rank;
    o.world_size = child_size;
    o.timeout = timeout_;
    return std::make_unique<NcclCommunicator>(o, std::move(shared), stream, device_name_);
  }

 private:
  template <typename Launch>
  std::shared_ptr<Work> enqueue(const char* what, Launch&& launch) {
    // Under the mutex: NCCL calls on one communicator from two threads at
    // once are not allowed, and an abort from the watchdog thread frees the
    // communicator. While NCCL answers ncclInProgress the mutex is taken per
    // query only, so an abort can get in between and end the wait.
    std::unique_lock<std::mutex> lock(shared_->mutex);
    const auto aborted_error = [&](const std::string& when) {
      return BackendError(std::string(what) + " on rank " + std::to_string(rank()) +
                              ": the communicator was aborted" + when,
                          ErrorContext{what, rank(), -1, "create a new communicator"});
    };
    if (shared_->aborted.load() || !shared_->comm) throw aborted_error("");
    cudaSetDevice(shared_->device);
    const std::string label = std::string(what) + " #" + std::to_string(++issued_);
    ncclResult_t r = launch(shared_->comm);
    // A non-blocking communicator may answer ncclInProgress while it
    // enqueues; it must be ncclSuccess before the next NCCL call.
    if (r == ncclInProgress) {
      lock.unlock();
      const auto polled = poll_comm_state(deadline_after(timeout_));
      lock.lock();
      if (!polled) throw aborted_error(" while the op was being enqueued");
      r = *polled;
    }
    // An op that may be half enqueued: whoever frees its buffers must abort
    // first (see free()).
    if (r != ncclSuccess) shared_->gave_up = true;
    if (r == ncclInProgress)
      throw TimeoutError(label + " could not be enqueued within " + std::to_string(timeout_.count()) +
                             " ms on rank " + std::to_string(rank()),
                         ErrorContext{what, rank(), -1, "abort the communicator"});
    if (r != ncclSuccess) throw_async(r, shared_->comm, label, rank());
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ev, stream_);
    if (e != cudaSuccess) {
      if (ev) cudaEventDestroy(ev);
      throw BackendError(label + ": recording its CUDA event failed: " + cuda_message(e),
                         ErrorContext{what, rank(), -1, "a CUDA error; check the GPU"});
    }
    last_op_ = std::make_shared<NcclWork>(shared_, ev, label);
    return last_op_;
  }

  // NCCL's state of the communicator, queried under the mutex one query at
  // a time, until it leaves ncclInProgress or the deadline (ncclInProgress);
  // nullopt when the communicator was aborted meanwhile.
  std::optional<ncclResult_t> poll_comm_state(Clock::time_point deadline) {
    const auto started = Clock::now();
    for (;;) {
      const auto st = shared_->async_state();
      if (!st || *st != ncclInProgress) return st;
      if (Clock::now() >= deadline) return ncclInProgress;
      poll_pause(started);
    }
  }

  // Waits (bounded) for the last collective before a cudaFree; see free().
  void settle_last_op() {
    if (!last_op_ || shared_->aborted.load()) return;
    const auto started = Clock::now();
    const auto deadline = deadline_after(timeout_);
    while (!last_op_->is_completed()) {
      const auto st = shared_->async_state();
      if (!st) return;  // aborted meanwhile
      if ((*st != ncclSuccess && *st != ncclInProgress) || Clock::now() >= deadline) {
        shared_->gave_up = true;
        shared_->abort();
        return;
      }
      poll_pause(started);
    }
  }

  void copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, const char* what) {
    if (bytes == 0) return;
    cudaSetDevice(shared_->device);
    const cudaError_t e = cudaMemcpy(dst, src, bytes, kind);
    if (e != cudaSuccess)
      throw BackendError(std::string(what) + " of " + std::to_string(bytes) + " bytes failed: " +
                             cuda_message(e),
                         ErrorContext{what, rank(), -1, "a CUDA error; check the GPU"});
  }

  void check_rank(const char* op, int r) const {
    if (r < 0 || r >= size_)
      throw UsageError(std::string(op) + ": root " + std::to_string(r) + " is outside the world of " +
                           std::to_string(size_) + " ranks",
                       ErrorContext{op, rank(), r, "pass a rank in 0..world_size-1"});
  }
  void check_peer(const char* op, int r) const {
    check_rank(op, r);
    if (r == rank())
      throw UsageError(std::string(op) + ": peer " + std::to_string(r) + " is this rank itself",
                       ErrorContext{op, rank(), r, "pass another rank"});
  }

  std::shared_ptr<Shared> shared_;
  int size_;
  cudaStream_t stream_ = nullptr;
  std::string device_name_;
  void* barrier_buf_ = nullptr;
  std::uint64_t issued_ = 0;
  std::shared_ptr<NcclWork> last_op_;  // the last collective enqueued
  std::unique_ptr<NcclStreamOps> stream_ops_;
};

// "uuid|pci bus id|host|ordinal" of a device, as published at rendezvous.
struct DeviceIdentity {
  std::string uuid, bus_id, host;
  int ordinal = 0;

  std::string encode() const { return uuid + "|" + bus_id + "|" + host + "|" + std::to_string(ordinal); }
  static DeviceIdentity decode(const std::string& s) {
    DeviceIdentity d;
    std::size_t a = s.find('|'), b = s.find('|', a + 1), c = s.find('|', b + 1);
    if (a == std::string::npos || b == std::string::npos || c == std::string::npos) return d;
    d.uuid = s.substr(0, a);
    d.bus_id = s.substr(a + 1, b - a - 1);
    d.host = s.substr(b + 1, c - b - 1);
    d.ordinal = std::atoi(s.c_str() + c + 1);
    return d;
  }
};

std::string hex(const char* bytes, std::size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<unsigned char>(bytes[i]);
    out += digits[v >> 4];
    out += digits[v & 15];
  }
  return out;
}

Millis left_until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<Millis>(deadline - Clock::now()), Millis(1));
}

}  // namespace

std::string library_version() {
  int code = 0;
  if (ncclGetVersion(&code) != ncclSuccess) return "nccl unknown";
  return "nccl " + compat::version_string(code);
}

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls start clean
    return 0;
  }
  return n;
}

namespace {

// Whether the CUDA driver's library can be loaded at all. Without it the CUDA
// runtime answers cudaErrorInsufficientDriver ("CUDA driver version is
// insufficient for CUDA runtime version"), which reads as an old driver
// where there is none.
bool driver_library_present() {
  if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
    dlclose(h);
    return true;
  }
  void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (!h) return false;
  dlclose(h);
  return true;
}

// Why cudaGetDeviceCount gave no device (e: its answer, n: its count), with
// CUDA_VISIBLE_DEVICES whenever it is set: CUDA answers cudaErrorNoDevice,
// not a count of 0, when it is empty or names no GPU of this machine.
std::string no_device_reason(cudaError_t e, int n) {
  std::string why;
  if (e == cudaErrorInsufficientDriver && !driver_library_present())
    why = "no NVIDIA driver (libcuda.so.1 not found)";
  else if (e != cudaSuccess)
    why = cuda_message(e);
  else if (n == 0)
    why = "no CUDA device is visible";
  else
    return "";
  if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES"))
    why += *visible ? " (CUDA_VISIBLE_DEVICES=" + std::string(visible) +
                          " is set: this process sees only the GPUs it names)"
                    : std::string(" (CUDA_VISIBLE_DEVICES is set and empty: it hides every GPU)");
  return why;
}

}  // namespace

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) cudaGetLastError();
  return no_device_reason(e, n);
}

std::unique_ptr<Communicator> make_nccl_communicator(const CommOptions& opts) {
  const auto deadline = deadline_after(opts.timeout);
  const int rank = opts.rank;
  const auto ctx = [&](std::string hint, int peer = -1) {
    return ErrorContext{"backend.init", rank, peer, std::move(hint)};
  };

  // 1. A GPU at all.
  int count = 0;
  const cudaError_t ce = cudaGetDeviceCount(&count);
  if (ce != cudaSuccess || count == 0) {
    if (ce != cudaSuccess) cudaGetLastError();
    throw BackendError("no GPU: " + no_device_reason(ce, count),
                       ctx("run on a machine with a GPU and its driver, or use --backend gloo"));
  }

  // 2. Our device.
  const int device = opts.device >= 0 ? opts.device : opts.local_rank;
  if (device >= count)
    throw UsageError("rank " + std::to_string(rank) + " wants cuda:" + std::to_string(device) +
                         " but only " + std::to_string(count) + " GPU(s) are visible",
                     ctx("start at most one rank per visible GPU on each host (--nproc), or "
                         "give each rank its own LOCAL_RANK below the GPU count (check "
                         "CUDA_VISIBLE_DEVICES)"));
  if (const cudaError_t e = cudaSetDevice(device); e != cudaSuccess)
    throw BackendError("cudaSetDevice(" + std::to_string(device) + ") failed on rank " +
                           std::to_string(rank) + ": " + cuda_message(e),
                       ctx("check the GPU with nvidia-smi"));
  cudaDeviceProp prop{};
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, device); e != cudaSuccess)
    throw BackendError("cudaGetDeviceProperties(" + std::to_string(device) + ") failed: " +
                           cuda_message(e),
                       ctx("check the GPU with nvidia-smi"));
  char bus_id[64] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) != cudaSuccess) {
    cudaGetLastError();
    std::strcpy(bus_id, "unknown");
  }

  // 3. One GPU per rank, checked before NCCL's own "Duplicate GPU detected".
  DeviceIdentity me{hex(prop.uuid.bytes, sizeof(prop.uuid.bytes)), bus_id, hostname(), device};
  opts.store->set("nccl/device/" + std::to_string(rank), to_bytes(me.encode()));
  std::vector<std::string> keys;
  for (int r = 0; r < opts.world_size; ++r) keys.push_back("nccl/device/" + std::to_string(r));
  // Another rank whose backend could not start (no GPU, a CUDA error) posts
  // why (opts.peer_failure): the others stop waiting for it at once.
  const auto stop_if_peer_failed = [&] {
    if (!opts.peer_failure) return;
    const auto failed = opts.peer_failure();
    if (failed && failed->world_aborted)
      throw RendezvousError("NCCL: rank " + std::to_string(rank) +
                                " stopped waiting for its peers: the world was called off at "
                                "rendezvous: " + failed->message,
                            ctx(kWorldAbortedHint, failed->rank));
    if (failed)
      throw PeerError("NCCL: rank " + std::to_string(rank) + " stopped waiting for its peers: rank " +
                          std::to_string(failed->rank) + " failed in backend init: " + failed->message,
                      ctx("rank " + std::to_string(failed->rank) + "'s own error, in its log, is the cause",
                          failed->rank));
  };
  try {
    in_slices(
        left_until(deadline),
        [&](Millis slice) {
          opts.store->wait(keys, slice);
          return 0;
        },
        stop_if_peer_failed);
  } catch (const TimeoutError&) {
    std::string missing;
    for (int r = 0; r < opts.world_size; ++r)
      if (!opts.store->check({keys[static_cast<std::size_t>(r)]}))
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    throw TimeoutError("NCCL rendezvous timed out on rank " + std::to_string(rank) +
                           ": rank(s) " + missing + " never published their GPU",
                       ctx("check that every rank started and has a GPU"));
  }
  for (int r = 0; r < opts.world_size; ++r) {
    if (r == rank) continue;
    const auto other =
        DeviceIdentity::decode(to_string(opts.store->get(keys[static_cast<std::size_t>(r)], left_until(deadline))));
    if (other.uuid == me.uuid) {
      const int lo = std::min(r, rank), hi = std::max(r, rank);
      throw UsageError(
          "ranks " + std::to_string(lo) + " and " + std::to_string(hi) +
              " both use the same GPU (cuda:" + std::to_string(device) + ", PCI " + me.bus_id +
              ", host " + me.host + "); NCCL needs one GPU per rank (it would fail with "
              "\"Duplicate GPU detected\")",
          ctx("start at most one rank per GPU (--nproc <= number of GPUs), give each rank its "
              "own device (LOCAL_RANK, CUDA_VISIBLE_DEVICES); to test multi-rank "
              "logic on one GPU use --backend gloo",
              r));
    }
  }

  // 4. The unique id, from rank 0.
  ncclUniqueId id{};
  const std::string id_key = "nccl/unique_id";
  if (rank == 0) {
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess)
      throw BackendError("ncclGetUniqueId failed: " + nccl_message(r, nullptr),
                         ctx("rerun with NCCL_DEBUG=INFO; check NCCL_SOCKET_IFNAME"));
    opts.store->set(id_key, Bytes(reinterpret_cast<const std::uint8_t*>(id.internal),
                                  reinterpret_cast<const std::uint8_t*>(id.internal) + sizeof(id.internal)));
  } else {
    Bytes b;
    try {
      b = in_slices(
          left_until(deadline), [&](Millis slice) { return opts.store->get(id_key, slice); },
          stop_if_peer_failed);
    } catch (const TimeoutError&) {
      throw TimeoutError("rank " + std::to_string(rank) +
                             " timed out waiting for NCCL's unique id from rank 0",
                         ctx("check that rank 0 is running and reached NCCL init", 0));
    }
    if (b.size() != sizeof(id.internal))
      throw RendezvousError("NCCL unique id from the store has " + std::to_string(b.size()) +
                                " bytes, expected " + std::to_string(sizeof(id.internal)),
                            ctx("another program uses the same store keys; use a fresh port", 0));
    std::memcpy(id.internal, b.data(), b.size());
  }

  // 5. Non-blocking init with a deadline.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, opts.world_size, id, rank, &config);
  if ((r == ncclSuccess || r == ncclInProgress) && comm) {
    try {
      r = wait_comm_state(comm, deadline, stop_if_peer_failed);
    } catch (const Error&) {
      ncclCommAbort(comm);
      throw;
    }
  }
  if (r != ncclSuccess) {
    const std::string msg = r == ncclInProgress ? "" : nccl_message(r, comm);
    if (comm) ncclCommAbort(comm);
    if (r == ncclInProgress)
      throw TimeoutError("NCCL init did not finish within " + std::to_string(opts.timeout.count()) +
                             " ms on rank " + std::to_string(rank),
                         ctx("a rank did not reach init or the network between ranks is blocked; "
                             "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,BOOTSTRAP,NET,ENV"));
    if (msg.find("Duplicate GPU") != std::string::npos)
      throw UsageError("NCCL refused two ranks on one GPU: " + msg,
                       ctx("start at most one rank per GPU, or use --backend gloo"));
    throw BackendError("NCCL init failed on rank " + std::to_string(rank) + ": " + msg,
                       ctx("rerun with NCCL_DEBUG=INFO for NCCL's own diagnosis"));
  }

  auto shared = std::make_shared<Shared>();
  shared->comm = comm;
  shared->rank = rank;
  shared->device = device;
  cudaStream_t stream = nullptr;
  if (const cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking); e != cudaSuccess) {
    shared->abort();
    throw BackendError("cudaStreamCreateWithFlags failed: " + cuda_message(e),
                       ctx("a CUDA error; check the GPU"));
  }
  return std::make_unique<NcclCommunicator>(
      opts, std::move(shared), stream, "cuda:" + std::to_string(device) + " " + prop.name);
}

}  // namespace ddpdiag::nccl_backend
