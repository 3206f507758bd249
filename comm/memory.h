// Memory with accounting: buffers allocated through a Communicator (host
// memory for Gloo, device memory for NCCL) and tallied by category, so a
// memory summary says exactly what ddpdiag itself holds; plus the process's
// resident set from /proc and, on a GPU, the device's free/total memory.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>

#include "comm/communicator.h"

namespace ddpdiag {

enum class MemoryCategory : std::uint8_t {
  kParameters,
  kGradients,
  kBuckets,
  kCommBuffers,
  kWorkspace,
};
inline constexpr std::size_t kMemoryCategoryCount = 5;
inline constexpr MemoryCategory kAllMemoryCategories[] = {
    MemoryCategory::kParameters, MemoryCategory::kGradients, MemoryCategory::kBuckets,
    MemoryCategory::kCommBuffers, MemoryCategory::kWorkspace};
// "parameters", "gradients", "buckets", "communication_buffers", "workspace"
std::string_view memory_category_name(MemoryCategory c);

// Tallies what is allocated through it, by category: current and peak bytes
// per category and in all (the total's peak is the peak of the sum, not the
// sum of the peaks). Thread-safe.
class MemoryAccount {
 public:
  explicit MemoryAccount(Communicator& comm) : comm_(comm) {}
  ~MemoryAccount();
  MemoryAccount(const MemoryAccount&) = delete;
  MemoryAccount& operator=(const MemoryAccount&) = delete;

  void* allocate(MemoryCategory c, std::size_t bytes);
  void release(void* ptr);  // nullptr is a no-op; unknown pointers are a logic_error

  std::uint64_t current_bytes(MemoryCategory c) const;
  std::uint64_t peak_bytes(MemoryCategory c) const;
  // Starts c's peak again from its current bytes (the total's is kept): the
  // peak of a later phase alone.
  void reset_peak(MemoryCategory c);
  std::uint64_t total_current_bytes() const;
  std::uint64_t total_peak_bytes() const;
  MemoryKind kind() const { return comm_.memory_kind(); }
  Communicator& comm() { return comm_; }

 private:
  Communicator& comm_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::pair<MemoryCategory, std::size_t>> live_;
  std::array<std::uint64_t, kMemoryCategoryCount> current_{};
  std::array<std::uint64_t, kMemoryCategoryCount> peak_{};
  std::uint64_t total_current_ = 0;
  std::uint64_t total_peak_ = 0;
};

// RAII buffer from a MemoryAccount.
class AccountedBuffer {
 public:
  AccountedBuffer(MemoryAccount& account, MemoryCategory c, std::size_t bytes)
      : account_(&account), ptr_(account.allocate(c, bytes)), bytes_(bytes) {}
  ~AccountedBuffer() {
    if (account_) account_->release(ptr_);
  }
  AccountedBuffer(const AccountedBuffer&) = delete;
  AccountedBuffer& operator=(const AccountedBuffer&) = delete;
  void* get() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  MemoryAccount* account_;
  void* ptr_;
  std::size_t bytes_;
};

// A communicator that routes alloc/free through a MemoryAccount under the
// category currently set, and forwards everything else to the inner
// communicator. Code that allocates through a Communicator (the reducer, the
// send/recv algorithms) gets its memory accounted without knowing it: set
// the category before handing it over. Both must outlive it.
class AccountingCommunicator final : public Communicator {
 public:
  AccountingCommunicator(Communicator& inner, MemoryAccount& account,
                         MemoryCategory category = MemoryCategory::kWorkspace)
      : inner_(inner), account_(account), category_(category) {
    timeout_ = inner.default_timeout();
  }
  void set_category(MemoryCategory c) { category_ = c; }
  MemoryCategory category() const { return category_; }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  Backend backend() const override { return inner_.backend(); }
  MemoryKind memory_kind() const override { return inner_.memory_kind(); }
  std::string library_version() const override { return inner_.library_version(); }
  std::string device_name() const override { return inner_.device_name(); }
  std::string listen_address() const override { return inner_.listen_address(); }
  std::map<int, std::string> peer_addresses() const override { return inner_.peer_addresses(); }
  std::vector<StalledLink> stalled_links() const override { return inner_.stalled_links(); }
  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    return inner_.allreduce(send, recv, count, dtype, op);
  }
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    return inner_.broadcast(buf, count, dtype, root);
  }
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root) override {
    return inner_.reduce(send, recv, count, dtype, op, root);
  }
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                  DType dtype) override {
    return inner_.allgather(send, recv, count, dtype);
  }
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                       DType dtype, ReduceOp op) override {
    return inner_.reduce_scatter(send, recv, recv_count, dtype, op);
  }
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    return inner_.send(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    return inner_.recv(buf, count, dtype, peer, tag);
  }
  std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count, int send_peer,
                                 void* recv_buf, std::size_t recv_count, int recv_peer,
                                 DType dtype, std::uint32_t tag) override {
    return inner_.sendrecv(send_buf, send_count, send_peer, recv_buf, recv_count, recv_peer,
                           dtype, tag);
  }
  std::shared_ptr<Work> barrier() override { return inner_.barrier(); }
  void* alloc(std::size_t bytes) override { return account_.allocate(category_, bytes); }
  void free(void* ptr) override { account_.release(ptr); }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    inner_.copy_to_host(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    inner_.copy_from_host(dst, host_src, bytes);
  }
  void abort() override { inner_.abort(); }
  StreamOps* stream_ops() override { return inner_.stream_ops(); }
  bool can_split() const override { return inner_.can_split(); }
  std::unique_ptr<Communicator> split(int color, int key, Millis timeout) override {
    return inner_.split(color, key, timeout);
  }

 private:
  Communicator& inner_;
  MemoryAccount& account_;
  MemoryCategory category_;
};

// The process's resident set and its peak (VmRSS and VmHWM of
// /proc/self/status).
struct ProcessMemory {
  std::uint64_t rss_bytes = 0;
  std::uint64_t peak_rss_bytes = 0;
};
// Parses the text of /proc/<pid>/status; nullopt when a field is missing.
std::optional<ProcessMemory> parse_proc_status(std::string_view text);
// nullopt where /proc is not available.
std::optional<ProcessMemory> read_process_memory();

// Host memory this process can still take: MemAvailable (/proc/meminfo),
// lowered to what its memory cgroup's limit leaves (v2: memory.max less
// memory.current; v1: memory.limit_in_bytes less memory.usage_in_bytes;
// the tightest along the cgroup's path to the root). `source` says which
// bound it is. nullopt where neither can be read. The roots are for tests.
struct HostMemoryAvailable {
  std::uint64_t bytes = 0;
  std::string source;  // "MemAvailable" or "cgroup <dir> limit"
};
std::optional<HostMemoryAvailable> host_memory_available(const std::string& proc_root = "/proc",
                                                         const std::string& cgroup_root =
                                                             "/sys/fs/cgroup");

// What this process may still map under its address-space limit
// (RLIMIT_AS, `ulimit -v`, which some clusters set per job): the limit less
// VmSize (/proc/self/status). nullopt without such a limit. Unlike host
// memory it is per process: ranks sharing a host do not share it.
struct AddressSpaceLeft {
  std::uint64_t bytes = 0;
  std::uint64_t limit = 0;
};
std::optional<AddressSpaceLeft> address_space_left();

// cudaMemGetInfo of a device. Only comm/nccl/ talks to CUDA: in builds
// without CUDA, or without a driver/GPU, available is false and reason says
// why.
struct DeviceMemoryInfo {
  bool available = false;
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::string reason;
};
DeviceMemoryInfo device_memory_info(int device);

}  // namespace ddpdiag
