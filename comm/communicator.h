// The communicator: collectives and point-to-point on one backend (Gloo on
// host memory, NCCL on device memory). Every operation returns a Work handle;
// waiting takes a deadline, so a hang becomes an ordinary TimeoutError.
//
// Operations start in the order they were issued, on the backend's own
// execution context: a CUDA stream for NCCL, where they also run one at a
// time; worker threads for Gloo, where a collective whose buffers overlap
// none of the running ones' may run beside them (CommOptions::gloo_threads)
// while point-to-point ops, barriers and stream tasks run alone. So an op
// always sees the results of earlier ops on the same buffers, and a barrier
// completes after everything issued before it. Buffers must stay valid until
// the Work completes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "comm/errors.h"
#include "comm/store/store.h"
#include "comm/stream_ops.h"
#include "comm/types.h"

namespace ddpdiag {

enum class MemoryKind : std::uint8_t { kHost, kDevice };
enum class Backend : std::uint8_t { kGloo, kNccl };
std::string_view backend_name(Backend b);  // "gloo", "nccl"

class Work {
 public:
  virtual ~Work() = default;
  virtual bool is_completed() = 0;
  // Completed with an error (wait() would rethrow it); never blocks. A
  // backend that keeps a failed operation not completed may leave it false.
  virtual bool failed() { return false; }
  // Blocks until done or until timeout passes (TimeoutError). Rethrows the
  // operation's error if it failed.
  virtual void wait(Millis timeout) = 0;
  // Best effort: stop waiting for this operation; the communicator is unusable
  // afterwards.
  virtual void abort() = 0;
};

// What to try when the ranks' world was called off at rendezvous (a rank
// found it inconsistent and posted why).
inline constexpr const char* kWorldAbortedHint =
    "every rank must be started the same way: the same world size, the same subcommand flags, "
    "and a distinct rank";

struct CommOptions {
  Backend backend = Backend::kGloo;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  // The store shared by all ranks, already prefixed for this communicator.
  std::shared_ptr<Store> store;
  // Timeout of init and the default for every collective.
  Millis timeout = Store::kDefaultTimeout;
  // Gloo: the interface to bind (GLOO_SOCKET_IFNAME when empty), or the
  // hostname/address to bind; empty means the address of this host's
  // hostname, falling back to loopback.
  std::string gloo_interface;
  std::string gloo_hostname;
  // Gloo: worker threads, so many collectives on distinct buffers in flight
  // at once (torch's ProcessGroupGloo runs two); 1 runs every op alone.
  int gloo_threads = 2;
  // Gloo: the ranks run on more than one machine. Loopback is then no
  // fallback for an address: peers on other hosts could never reach it.
  bool spans_hosts = false;
  // NCCL: device ordinal (defaults to local_rank).
  int device = -1;
  // While init waits for its peers, asked about every kWaitSlice whether
  // another rank has already failed (its backend would not start): that
  // rank and its error, or nothing to go on waiting. It must not use
  // `store`, which the init itself is using. Empty: init waits to its
  // deadline.
  struct PeerFailure {
    int rank = -1;
    std::string message;
    // Not one rank's backend: the world was called off at rendezvous (a
    // rank found it inconsistent, e.g. rank 0 claimed twice, after this
    // rank had met its peers). `message` says why; the init stops with a
    // rendezvous error.
    bool world_aborted = false;
  };
  std::function<std::optional<PeerFailure>()> peer_failure;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual Backend backend() const = 0;
  virtual MemoryKind memory_kind() const = 0;
  // Library version, e.g. "gloo 0.5.0" or "nccl 2.28.9".
  virtual std::string library_version() const = 0;
  // A short description of the device this rank uses ("cpu", "cuda:0 NVIDIA H200").
  virtual std::string device_name() const = 0;
  // The IP address this rank's backend listens on for its peers (Gloo: its
  // TCP listener, whose interface carries the traffic to other hosts); ""
  // where the backend does not say (NCCL chooses its own transports).
  virtual std::string listen_address() const { return ""; }
  // The IP address each peer's backend listens at, by rank (Gloo: the
  // address its pairs were connected to); empty where the backend does not
  // say (NCCL).
  virtual std::map<int, std::string> peer_addresses() const { return {}; }

  // Whether peer `peer`'s host answers on the network now, asked by a TCP
  // connection to the address that peer's backend listened at: refused or
  // accepted, the host and the path to it are up (kAnswers); no answer
  // within `timeout`, or no route, they are not (kSilent). kUnknown where
  // the backend has no address for the peer.
  enum class HostProbe { kUnknown, kAnswers, kSilent };
  virtual HostProbe probe_peer_host(int /*peer*/, Millis /*timeout*/) { return HostProbe::kUnknown; }

  // This rank's connections to its peers that the network stalls now (data
  // unacknowledged, retransmitted): read from the kernel's socket tables,
  // cheap enough for a hang's diagnosis. Empty where the backend cannot tell
  // (NCCL owns its sockets and transports).
  virtual std::vector<StalledLink> stalled_links() const { return {}; }

  // send == recv is in-place.
  virtual std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count,
                                          DType dtype, ReduceOp op) = 0;
  virtual std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype,
                                          int root) = 0;
  // recv only matters on root.
  virtual std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count,
                                       DType dtype, ReduceOp op, int root) = 0;
  // recv holds size() * count elements, rank r's block at offset r * count.
  virtual std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                          DType dtype) = 0;
  // send holds size() * recv_count elements; rank r receives block r reduced.
  virtual std::shared_ptr<Work> reduce_scatter(const void* send, void* recv,
                                               std::size_t recv_count, DType dtype,
                                               ReduceOp op) = 0;
  // Point-to-point. tag distinguishes concurrent messages between one pair.
  virtual std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                                     std::uint32_t tag = 0) = 0;
  virtual std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                                     std::uint32_t tag = 0) = 0;
  // One ring step: sends send_count elements to send_peer and receives
  // recv_count elements from recv_peer as ONE operation, with both directions
  // in flight together. Plain send then recv would run one at a time, so two
  // ranks that both send first would wait for each other; sendrecv never
  // does. Matches plain send/recv with the same tag on the other side (Gloo)
  // or any send/recv (NCCL, which has no tags). Backends that do not
  // implement it throw BackendError.
  virtual std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count,
                                         int send_peer, void* recv_buf, std::size_t recv_count,
                                         int recv_peer, DType dtype, std::uint32_t tag = 0);
  virtual std::shared_ptr<Work> barrier() = 0;

  // Memory in the kind this backend works on (device memory for NCCL).
  virtual void* alloc(std::size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, std::size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, std::size_t bytes) = 0;

  // Abort every outstanding operation; the communicator is unusable afterwards.
  virtual void abort() = 0;

  // Splits this communicator the way ncclCommSplit does: collective over all
  // of its ranks (every rank calls it, in the same order as its other
  // collectives); ranks passing the same color >= 0 form a new communicator,
  // ranked by key; a rank passing color < 0 takes no part and gets nullptr.
  // Only where can_split() (NCCL); elsewhere BackendError, and sub-groups
  // come from make_group_communicator (comm/group.h). TimeoutError at the
  // deadline (the half-made communicator is aborted).
  virtual bool can_split() const { return false; }
  virtual std::unique_ptr<Communicator> split(int color, int key, Millis timeout);

  // Copies and element-wise work ordered with this communicator's
  // collectives (comm/stream_ops.h); owned by the communicator. nullptr for
  // a communicator that has none.
  virtual StreamOps* stream_ops() { return nullptr; }

  Millis default_timeout() const { return timeout_; }
  void set_default_timeout(Millis t) { timeout_ = t; }

 protected:
  Millis timeout_ = Store::kDefaultTimeout;
};

// Creates the backend's communicator, rendezvousing through opts.store.
// Throws RendezvousError/TimeoutError/BackendError with the phase set.
std::unique_ptr<Communicator> make_communicator(const CommOptions& opts);

// The library a backend's communicator would use, as its library_version()
// says it ("gloo 0.5.0", "nccl 2.28.9"), without creating one; "" when this
// build lacks the backend.
std::string backend_library_version(Backend b);

// True when this build has the NCCL backend.
bool nccl_supported();
// Number of usable CUDA devices (0 without a driver or a build without CUDA).
int cuda_device_count();
// Why there is no GPU, in words, when cuda_device_count() == 0.
std::string cuda_unavailable_reason();

// RAII buffer owned by a communicator.
class CommBuffer {
 public:
  CommBuffer() = default;
  CommBuffer(Communicator& comm, std::size_t bytes)
      : comm_(&comm), ptr_(bytes ? comm.alloc(bytes) : nullptr), bytes_(bytes) {}
  ~CommBuffer() { reset(); }
  CommBuffer(CommBuffer&& o) noexcept { *this = std::move(o); }
  CommBuffer& operator=(CommBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      comm_ = o.comm_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }
  void reset() {
    if (ptr_ && comm_) comm_->free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

 private:
  Communicator* comm_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace ddpdiag
