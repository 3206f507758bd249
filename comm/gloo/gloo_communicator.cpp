// The Gloo backend.
//
// Execution model. Every operation is queued to the communicator's worker
// threads (CommOptions::gloo_threads, default 2, as torch's ProcessGroupGloo
// runs its collectives on two threads) and STARTS in issue order; the issuing
// thread gets a Work at once. A collective may start while earlier ones still
// run when its buffers overlap none of theirs: each collective has its own
// tag (its order among collectives, the same on every rank), hence its own
// Gloo slots, so concurrent collectives never take each other's messages.
// What must not overtake or be overtaken runs alone: point-to-point ops
// (the caller's tags may repeat), barriers (which, as in c10d, follow
// everything before them) and stream tasks (host work in stream order).
// An op that touches the buffers of a running one waits for it, so a loop
// on one buffer (allreduce-test) runs one op at a time, as before.
//
// Starting strictly in issue order keeps this free of deadlock: the
// earliest op not yet done on every rank has every earlier op done on every
// rank, so on each rank it is running or at the head of the queue with a
// free thread.
//
// Two hand-offs sit on the hot path of a loop of small collectives (issue ->
// worker, worker -> waiter). A futex wake-up costs several microseconds, as
// much as a whole 4-byte all_reduce on loopback, so both sides first spin
// briefly (yielding, so an oversubscribed machine is not starved) before they
// block on a condition variable:
//  - the first worker drains the queue without sleeping while ops are
//    queued, and after the queue empties it spins for kWorkerSpin before it
//    sleeps (the others sleep at once: two spinning threads per rank would
//    starve Gloo's own on a small machine); a producer signals the condition
//    variable only when the op can start and no worker is spinning, and a
//    worker that takes an op wakes another when the next can start too;
//  - Work::wait spins for kWaiterSpin before it blocks.
//
// Timeouts. Each Gloo op gets the communicator's default timeout at issue
// time, so a stuck op ends on the worker by itself; Work::wait takes its own,
// possibly shorter, deadline. When Gloo times out it closes every pair of the
// context (its own design), so the communicator is unusable afterwards.
#include "comm/gloo/gloo_communicator.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <limits>
#include <array>
#include <atomic>
#include <cctype>
#include <condition_variable>
#include <functional>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/config.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/attr.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "comm/ip_text.h"
#include "comm/net_info.h"
#include "comm/store/sliced_wait.h"

namespace ddpdiag::gloo_backend {
namespace {

using Clock = std::chrono::steady_clock;

// Spin budgets of the two hand-offs (see the top of the file). 100 us covers
// a small all_reduce among a few ranks on one host, so a back-to-back loop of
// small ops never sleeps; for large ops it is noise next to the op itself.
constexpr auto kWorkerSpin = std::chrono::microseconds(100);
constexpr auto kWaiterSpin = std::chrono::microseconds(100);

// More worker threads than this only add contention.
constexpr int kMaxGlooThreads = 16;

// Slot prefixes of our own protocols; Gloo's collectives use 0x01..0x08.
constexpr std::uint8_t kPointToPointSlotPrefix = 0x40;
constexpr std::uint8_t kReduceScatterSlotPrefix = 0x41;

// Host buffers are aligned for AVX-512 loads and whole cache lines.
constexpr std::size_t kHostAlignment = 64;

std::string local_hostname() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

bool hostname_resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (res) ::freeaddrinfo(res);
  return rc == 0;
}

// "10.0.0.2:4711" or "[fe80::1]:4711". (Gloo's own Address::str() shows
// the port byte-swapped in this version, as "[10.0.0.2]:26386", so messages
// use ours.)
std::string endpoint_str(const sockaddr_storage& ss) {
  return endpoint_text(reinterpret_cast<const sockaddr*>(&ss));
}

// Where `shown` (Gloo's text for an address) occurs in msg at or after
// `from` as a whole address: "[h]:392" is not found in "[h]:3920".
std::size_t find_address(const std::string& msg, const std::string& shown, std::size_t from = 0) {
  for (auto at = msg.find(shown, from); at != std::string::npos; at = msg.find(shown, at + 1)) {
    const std::size_t end = at + shown.size();
    if (end == msg.size() || !std::isdigit(static_cast<unsigned char>(msg[end]))) return at;
  }
  return std::string::npos;
}

// Whether this Gloo's Address::str() shows ports byte-swapped (the version
// Debian ships prints sin_port as it lies in memory: 4711 as "26386").
bool gloo_swaps_ports() {
  static const bool swaps = [] {
    sockaddr_storage ss{};
    auto& in = reinterpret_cast<sockaddr_in&>(ss);
    in.sin_family = AF_INET;
    in.sin_port = htons(0x1234);
    in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    const std::string shown = gloo::transport::tcp::Address(ss).str();
    return shown.find(":" + std::to_string(0x1234)) == std::string::npos &&
           shown.find(":" + std::to_string(htons(0x1234))) != std::string::npos;
  }();
  return swaps;
}

}  // namespace

// Gloo's message with every address it shows ("[10.0.0.2]:26386") written
// with its real port ("[10.0.0.2]:4711").
std::string right_ports(std::string msg) {
  if (!gloo_swaps_ports()) return msg;
  for (auto at = msg.find("]:"); at != std::string::npos; at = msg.find("]:", at + 2)) {
    const std::size_t begin = at + 2;
    std::size_t end = begin;
    while (end < msg.size() && end - begin < 6 && std::isdigit(static_cast<unsigned char>(msg[end]))) ++end;
    if (end == begin || end - begin > 5) continue;
    const unsigned long shown = std::stoul(msg.substr(begin, end - begin));
    if (shown > 0xffff) continue;
    const auto port = static_cast<std::uint16_t>(shown);
    msg.replace(begin, end - begin, std::to_string(ntohs(port)));
  }
  return msg;
}

int peer_named_in(const std::string& msg, const std::map<std::string, int>& peer_addresses) {
  for (const auto& [address, peer] : peer_addresses)
    if (find_address(msg, address) != std::string::npos) return peer;
  int by_host = -1;
  for (const auto& [address, peer] : peer_addresses) {
    const std::size_t colon = address.rfind("]:");
    if (colon == std::string::npos || msg.find(address.substr(0, colon + 2)) == std::string::npos) continue;
    if (by_host >= 0 && by_host != peer) return -1;  // two ranks on that host
    by_host = peer;
  }
  return by_host;
}

namespace {

// ---------------------------------------------------------------------------
// Rendezvous: Gloo's store interface over ours.
//
// connectFullMesh publishes "rank_<r>" (hostname) and "<r>" (the listening
// addresses of r's pairs, one per peer in rank order without r itself) and
// reads the others'. All keys go under "gloo/". While Gloo reads a peer's
// addresses we remember the one it will connect to, so that an IoException
// naming that address can be attributed to a rank later.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<ddpdiag::Store> store, Millis timeout, int rank, int size)
      : store_(std::move(store)), timeout_(timeout), rank_(rank), size_(size) {}

  static std::string key_of(const std::string& key) { return "gloo/" + key; }

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key_of(key), Bytes(data.begin(), data.end()));
  }

  std::vector<char> get(const std::string& key) override {
    const Bytes value = sliced(timeout_, [&](Millis slice) { return store_->get(key_of(key), slice); });
    std::vector<char> out(value.begin(), value.end());
    remember_peer_address(key, out);
    return out;
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> ours;
    ours.reserve(keys.size());
    for (const auto& k : keys) ours.push_back(key_of(k));
    sliced(timeout, [&](Millis slice) {
      store_->wait(ours, slice);
      return 0;
    });
  }

  // The init gave up on this connector thread (make_gloo_communicator): its
  // store waits end within one slice, so that the rank's own store calls,
  // which share the connection, are not held for a whole timeout.
  void abandon() { abandoned_.store(true); }

  std::map<std::string, int> take_peer_addresses() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::move(peer_addresses_);
  }

  // A peer whose address Gloo has read, in the order it read them (it then
  // connects to them in that order, one at a time).
  struct PeerRead {
    int peer;
    sockaddr_storage address;
    Clock::time_point when;
  };
  std::vector<PeerRead> reads() const {
    std::lock_guard<std::mutex> lock(mu_);
    return reads_;
  }

 private:
  void remember_peer_address(const std::string& key, const std::vector<char>& all) {
    if (key.empty() || key.find_first_not_of("0123456789") != std::string::npos) return;
    const int peer = std::atoi(key.c_str());
    if (peer == rank_ || peer < 0 || peer >= size_ || size_ < 2) return;
    const std::size_t each = all.size() / static_cast<std::size_t>(size_ - 1);
    const std::size_t index = static_cast<std::size_t>(rank_ > peer ? rank_ - 1 : rank_);
    if (each == 0 || (index + 1) * each > all.size()) return;
    try {
      std::vector<char> mine(all.begin() + static_cast<std::ptrdiff_t>(index * each),
                             all.begin() + static_cast<std::ptrdiff_t>((index + 1) * each));
      const gloo::transport::tcp::Address address(mine);
      // Gloo's text for the address, as its messages show it; a pair's
      // sequence number ("$3") is not always shown, so it is left out.
      std::string shown = address.str();
      shown = shown.substr(0, shown.find('$'));
      std::lock_guard<std::mutex> lock(mu_);
      peer_addresses_[shown] = peer;
      reads_.push_back({peer, address.getSockaddr(), Clock::now()});
    } catch (const std::exception&) {
      // Only a diagnostic aid: an address we cannot parse is simply not named.
    }
  }

  // A blocking store call in slices (comm/store/sliced_wait.h), so that an
  // abandoned connector stops between them.
  template <typename Call>
  std::invoke_result_t<Call, Millis> sliced(Millis timeout, Call call) {
    return in_slices(timeout, call, [this] {
      if (abandoned_.load())
        throw RendezvousError("gloo: rank " + std::to_string(rank_) + "'s init was abandoned",
                              ErrorContext{"backend.init", rank_, -1, ""});
    });
  }

  std::shared_ptr<ddpdiag::Store> store_;
  Millis timeout_;
  int rank_;
  int size_;
  std::atomic<bool> abandoned_{false};
  mutable std::mutex mu_;
  std::map<std::string, int> peer_addresses_;
  std::vector<PeerRead> reads_;
};

// ---------------------------------------------------------------------------
// Operations and their Work handles

enum class OpKind : std::uint8_t {
  kAllreduce,
  kBroadcast,
  kReduce,
  kAllgather,
  kReduceScatter,
  kSend,
  kRecv,
  kSendRecv,
  kBarrier,
  kLocal,  // a StreamOps task: host work in issue order, no traffic
};

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kReduce: return "reduce";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reduce_scatter";
    case OpKind::kSend: return "send";
    case OpKind::kRecv: return "recv";
    case OpKind::kSendRecv: return "sendrecv";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kLocal: return "local";
  }
  return "op";
}

bool is_collective(OpKind k) {
  return k != OpKind::kSend && k != OpKind::kRecv && k != OpKind::kSendRecv &&
         k != OpKind::kLocal;
}

// Ops that run alone: nothing runs beside them (see the top of the file).
bool runs_alone(OpKind k) { return !is_collective(k) || k == OpKind::kBarrier; }

struct OpArgs {
  OpKind kind = OpKind::kBarrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  int root_or_peer = -1;  // root of broadcast/reduce, peer of send/recv
  std::uint32_t tag = 0;  // user tag (p2p) or the collective's sequence tag
  Millis timeout{0};      // Gloo's own timeout for this op
  // sendrecv only: the receiving half (count/root_or_peer are the sending half).
  std::size_t recv_count = 0;
  int recv_peer = -1;
  // kLocal only: the task.
  std::function<void()> local{};
};

// The bytes an op reads or writes: [lo, hi) of its input and its output.
struct ByteRange {
  const std::uint8_t* lo = nullptr;
  const std::uint8_t* hi = nullptr;
  bool overlaps(const ByteRange& o) const { return lo < o.hi && o.lo < hi; }
};

ByteRange byte_range(const void* p, std::size_t bytes) {
  if (p == nullptr || bytes == 0) return {};
  const auto* b = static_cast<const std::uint8_t*>(p);
  return {b, b + bytes};
}

// Input and output ranges of a collective on `size` ranks.
std::array<ByteRange, 2> buffer_ranges(const OpArgs& a, int size) {
  const std::size_t bytes = a.count * dtype_size(a.dtype);
  const auto n = static_cast<std::size_t>(size);
  switch (a.kind) {
    case OpKind::kAllgather: return {byte_range(a.send, bytes), byte_range(a.recv, bytes * n)};
    case OpKind::kReduceScatter: return {byte_range(a.send, bytes * n), byte_range(a.recv, bytes)};
    case OpKind::kSendRecv:
      return {byte_range(a.send, bytes), byte_range(a.recv, a.recv_count * dtype_size(a.dtype))};
    default: return {byte_range(a.send, bytes), byte_range(a.recv, bytes)};
  }
}

class Core;
std::vector<StalledLink> stalled_links_of(int rank, const std::map<int, sockaddr_storage>& peer_listeners,
                                          const std::vector<sockaddr_storage>& own_listeners);

class GlooWork final : public Work {
 public:
  GlooWork(std::weak_ptr<Core> core, const OpArgs& args, int rank)
      : args(args), rank(rank), core_(std::move(core)) {}

  bool is_completed() override { return done_.load(std::memory_order_acquire); }
  // error_ is written before done_ is released, and never after.
  bool failed() override { return done_.load(std::memory_order_acquire) && error_ != nullptr; }
  void wait(Millis timeout) override;
  void abort() override;

  // First call wins: an abort may complete a running op before the worker
  // finishes it.
  void complete(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (done_.load(std::memory_order_relaxed)) return;
      error_ = std::move(error);
      done_.store(true, std::memory_order_release);
    }
    cv_.notify_all();
  }

  std::string describe() const {
    std::string s = std::string(op_name(args.kind)) + " #" + std::to_string(seq);
    if (args.kind == OpKind::kBarrier || args.kind == OpKind::kLocal) return s;
    s += " (" + std::to_string(args.count) + " x " + std::string(dtype_name(args.dtype));
    if (args.kind == OpKind::kAllreduce || args.kind == OpKind::kReduce ||
        args.kind == OpKind::kReduceScatter)
      s += ", " + std::string(reduce_op_name(args.op));
    if (args.kind == OpKind::kBroadcast || args.kind == OpKind::kReduce)
      s += ", root " + std::to_string(args.root_or_peer);
    if (args.kind == OpKind::kSend) s += ", to rank " + std::to_string(args.root_or_peer);
    if (args.kind == OpKind::kRecv) s += ", from rank " + std::to_string(args.root_or_peer);
    if (args.kind == OpKind::kSendRecv)
      s += ", to rank " + std::to_string(args.root_or_peer) + ", " + std::to_string(args.recv_count) +
           " from rank " + std::to_string(args.recv_peer);
    return s + ")";
  }

  OpArgs args;
  std::uint64_t seq = 0;  // 1-based issue order on this rank
  int rank;

 private:
  std::weak_ptr<Core> core_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;  // written before done_ is released
  std::mutex mutex_;
  std::condition_variable cv_;
};

// FIFO of queued ops: a ring over a vector that only grows (doubling), so a
// steady stream of ops allocates nothing, unlike std::deque, which frees and
// allocates a block every few dozen push/pop pairs.
template <typename T>
class RingQueue {
 public:
  bool empty() const { return size_ == 0; }
  void push_back(T v) {
    if (size_ == slots_.size()) grow();
    slots_[(head_ + size_) % slots_.size()] = std::move(v);
    ++size_;
  }
  const T& front() const { return slots_[head_]; }
  T pop_front() {
    T v = std::move(slots_[head_]);
    head_ = (head_ + 1) % slots_.size();
    --size_;
    return v;
  }
  template <typename F>
  bool any_of(F&& f) const {
    for (std::size_t i = 0; i < size_; ++i)
      if (f(slots_[(head_ + i) % slots_.size()])) return true;
    return false;
  }
  std::vector<T> take_all() {
    std::vector<T> out;
    out.reserve(size_);
    while (!empty()) out.push_back(pop_front());
    return out;
  }

 private:
  void grow() {
    std::vector<T> bigger(std::max<std::size_t>(16, slots_.size() * 2));
    for (std::size_t i = 0; i < size_; ++i) bigger[i] = std::move(slots_[(head_ + i) % slots_.size()]);
    slots_ = std::move(bigger);
    head_ = 0;
  }
  std::vector<T> slots_;
  std::size_t head_ = 0;
  std::size_t size_ = 0;
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  Core(const CommOptions& opts, std::shared_ptr<gloo::rendezvous::Context> context,
       std::map<std::string, int> peer_addresses, std::map<int, sockaddr_storage> peer_sockaddrs)
      : rank_(opts.rank),
        size_(opts.world_size),
        context_(std::move(context)),
        peer_addresses_(std::move(peer_addresses)),
        peer_sockaddrs_(std::move(peer_sockaddrs)) {}

  // Communicator::probe_peer_host: a non-blocking connect to the address the
  // peer listened at for its pairs. Gloo closes a pair's listening socket
  // once connected, so a refusal is the usual answer of a live host.
  Communicator::HostProbe probe_peer_host(int peer, Millis timeout) const {
    using P = Communicator::HostProbe;
    const auto it = peer_sockaddrs_.find(peer);
    if (it == peer_sockaddrs_.end()) return P::kUnknown;
    switch (tcp_probe(it->second, timeout)) {
      case TcpReach::kAnswers: return P::kAnswers;
      case TcpReach::kSilent: return P::kSilent;
      default: return P::kUnknown;
    }
  }

  std::map<int, std::string> peer_addresses() const {
    std::map<int, std::string> out;
    for (const auto& [peer, address] : peer_sockaddrs_)
      if (auto ip = ip_text(reinterpret_cast<const sockaddr*>(&address)); !ip.empty()) out[peer] = ip;
    return out;
  }

  // Communicator::stalled_links: this process's connections to the peers'
  // listeners, or to its own pairs' listeners from a peer's address.
  std::vector<StalledLink> stalled_links() const {
    std::vector<sockaddr_storage> own;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      try {
        const auto& pair = context_->getPair(p);
        if (const auto* a = pair ? dynamic_cast<const gloo::transport::tcp::Address*>(&pair->address()) : nullptr)
          own.push_back(a->getSockaddr());
      } catch (const std::exception&) {
      }
    }
    return stalled_links_of(rank_, peer_sockaddrs_, own);
  }

  void start(int threads) {
    threads_ = threads;  // before any worker reads it
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
  }

  std::shared_ptr<Work> submit(OpArgs args) {
    auto work = std::make_shared<GlooWork>(weak_from_this(), args, rank_);
    bool wake = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      work->seq = ++issued_;
      if (is_collective(args.kind)) work->args.tag = next_collective_tag_++;
      if (aborted_.load(std::memory_order_relaxed) || stop_.load(std::memory_order_relaxed)) {
        work->complete(std::make_exception_ptr(unusable_error(*work)));
        return work;
      }
      queue_.push_back(work);
      queued_.fetch_add(1, std::memory_order_release);
      wake = sleepers_ > 0 && !spinning_ && head_can_start();
    }
    if (wake) cv_.notify_one();
    return work;
  }

  // Fails queued ops and the running one (best effort: the running Gloo op
  // itself ends at its own timeout or when a peer's connection drops), and
  // closes our connections so that peers notice at once.
  void abort(const std::string& why) {
    std::vector<std::shared_ptr<GlooWork>> pending;
    std::vector<std::shared_ptr<GlooWork>> running;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_.load()) return;
      abort_reason_ = why;  // published by the store to aborted_ below
      aborted_.store(true);
      pending = queue_.take_all();
      queued_.store(0, std::memory_order_relaxed);
      running = running_;
    }
    for (auto& w : running) w->complete(std::make_exception_ptr(unusable_error(*w)));
    for (auto& w : pending) w->complete(std::make_exception_ptr(unusable_error(*w)));
    try {
      context_->closeConnections();
    } catch (const std::exception&) {
      // Already closed or never connected: nothing left to tell the peers.
    }
  }

  bool running_ops_end_within(std::chrono::milliseconds grace) {
    const auto until = Clock::now() + grace;
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (running_.empty()) return true;
      }
      if (Clock::now() >= until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

  // Stops the workers after the running ops (bounded by their timeouts, or
  // after an abort by a short grace) and fails what was still queued.
  void shutdown() {
    std::vector<std::shared_ptr<GlooWork>> pending;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true, std::memory_order_relaxed);
      pending = queue_.take_all();
      queued_.store(0, std::memory_order_relaxed);
    }
    cv_.notify_all();
    for (auto& w : pending) w->complete(std::make_exception_ptr(unusable_error(*w)));
    if (aborted_.load() && !running_ops_end_within(std::chrono::seconds(2))) {
      // After an abort, a Gloo op blocked on a peer that went silent (a
      // frozen process, a host cut off) ends only at its own timeout, and
      // the abort has already told every waiter. The process is on its way
      // out with its report: it must not wait for that op. The workers are
      // let go, and this core (the context and buffers they use) stays
      // alive for the rest of the process.
      static auto* kept = new std::vector<std::shared_ptr<Core>>;
      static std::mutex kept_mutex;
      {
        std::lock_guard<std::mutex> lock(kept_mutex);
        kept->push_back(shared_from_this());
      }
      for (auto& t : workers_)
        if (t.joinable()) t.detach();
      return;
    }
    for (auto& t : workers_)
      if (t.joinable()) t.join();
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& r : deferred_frees_) std::free(const_cast<std::uint8_t*>(r.lo));
    deferred_frees_.clear();
  }

  // Communicator::alloc and ::free. A wait that ran out of time, the
  // monitor's failing of a collective and abort() all complete a Work while
  // its Gloo op may still run on a worker, reading or writing the buffers;
  // the caller then frees them as it unwinds. Such a buffer is freed only
  // once no running or queued op uses it any more (at the latest when the
  // workers stop).
  void note_alloc(void* p, std::size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    allocations_[p] = bytes;
  }
  void release(void* p) {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = allocations_.find(p);
    if (it == allocations_.end()) {  // not ours: nothing to guard
      std::free(p);
      return;
    }
    const ByteRange r = byte_range(p, it->second);
    allocations_.erase(it);
    if (in_use(r))
      deferred_frees_.push_back(r);
    else
      std::free(p);
  }

  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  BackendError unusable_error(const GlooWork& w) const {
    const std::string why = aborted_.load() ? "the communicator was aborted (" + abort_reason_ + ")"
                                            : "the communicator was destroyed";
    return BackendError(w.describe() + " on rank " + std::to_string(rank_) + " did not run: " + why,
                        ErrorContext{op_name(w.args.kind), rank_, -1,
                                     "create a new communicator after an abort"});
  }

  // Whether a running or queued op reads or writes r (mutex_ held). Barriers
  // and stream tasks have no buffers: their ranges are empty.
  bool in_use(const ByteRange& r) const {
    const auto uses = [&](const std::shared_ptr<GlooWork>& w) {
      for (const auto& b : buffer_ranges(w->args, size_))
        if (b.overlaps(r)) return true;
      return false;
    };
    return std::any_of(running_.begin(), running_.end(), uses) || queue_.any_of(uses);
  }

  // Frees the deferred buffers no op uses any more (mutex_ held).
  void free_deferred() {
    std::erase_if(deferred_frees_, [&](const ByteRange& r) {
      if (in_use(r)) return false;
      std::free(const_cast<std::uint8_t*>(r.lo));
      return true;
    });
  }

  // Whether the op at the head of the queue may start now (mutex_ held):
  // a thread is free and it conflicts with no running op.
  bool head_can_start() const {
    if (queue_.empty() || running_.size() >= static_cast<std::size_t>(threads_)) return false;
    if (running_.empty()) return true;
    const OpArgs& head = queue_.front()->args;
    if (runs_alone(head.kind)) return false;
    const auto mine = buffer_ranges(head, size_);
    for (const auto& w : running_) {
      if (runs_alone(w->args.kind)) return false;
      for (const auto& theirs : buffer_ranges(w->args, size_))
        if (theirs.overlaps(mine[0]) || theirs.overlaps(mine[1])) return false;
    }
    return true;
  }

  void worker_loop(int index) {
    std::vector<std::uint8_t> scratch;  // this thread's (see scratch_for)
    for (;;) {
      std::shared_ptr<GlooWork> work;
      bool wake_another = false;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        const auto stopping = [&] { return stop_.load(std::memory_order_relaxed); };
        if (!head_can_start() && !stopping()) {
          if (index == 0 && queue_.empty()) {
            spinning_ = true;
            lock.unlock();
            const auto until = Clock::now() + kWorkerSpin;
            while (queued_.load(std::memory_order_acquire) == 0 && !stopping() &&
                   Clock::now() < until)
              std::this_thread::yield();
            lock.lock();
            spinning_ = false;
          }
          ++sleepers_;
          cv_.wait(lock, [&] { return head_can_start() || stopping(); });
          --sleepers_;
        }
        if (stopping()) return;  // shutdown() failed what was queued
        work = queue_.pop_front();
        queued_.fetch_sub(1, std::memory_order_relaxed);
        running_.push_back(work);
        wake_another = sleepers_ > 0 && head_can_start();
      }
      if (wake_another) cv_.notify_one();
      work->complete(execute(*work, scratch));
      std::lock_guard<std::mutex> lock(mutex_);
      running_.erase(std::find(running_.begin(), running_.end(), work));
      if (!deferred_frees_.empty()) free_deferred();
      // No wake-up here: this thread takes the next op itself, and wakes
      // another when it does if a second can start.
    }
  }

  std::exception_ptr execute(GlooWork& w, std::vector<std::uint8_t>& scratch) {
    try {
      if (aborted_.load(std::memory_order_relaxed))
        return std::make_exception_ptr(unusable_error(w));
      dispatch(w.args, scratch);
      return nullptr;
    } catch (const Error&) {
      return std::current_exception();
    } catch (const gloo::IoException& e) {
      return map_io_error(w, e.what());
    } catch (const std::exception& e) {
      // gloo::Exception, gloo::EnforceNotMet and the like: Gloo refused the op.
      return std::make_exception_ptr(BackendError(
          "gloo: " + w.describe() + " failed on rank " + std::to_string(rank_) + ": " + e.what(),
          ErrorContext{op_name(w.args.kind), rank_, -1,
                       "this is Gloo's own message; check buffer sizes and that every rank "
                       "issues the same op with the same count"}));
    }
  }

  // Gloo reports a peer by address ("[10.0.0.2]:4711$3"); we map the
  // addresses we saw at rendezvous to ranks (peer_named_in).
  int peer_from_message(const std::string& msg, const OpArgs& args) const {
    if (const int peer = peer_named_in(msg, peer_addresses_); peer >= 0) return peer;
    if (args.kind == OpKind::kSend || args.kind == OpKind::kRecv) return args.root_or_peer;
    if (args.kind == OpKind::kSendRecv && args.root_or_peer == args.recv_peer) return args.recv_peer;
    return -1;
  }

  std::exception_ptr map_io_error(const GlooWork& w, const std::string& raw) const {
    const int peer = peer_from_message(raw, w.args);
    const std::string msg = right_ports(raw);
    const std::string op = op_name(w.args.kind);
    const std::string where = w.describe() + " on rank " + std::to_string(rank_);
    if (msg.find("Timed out waiting") != std::string::npos)
      return std::make_exception_ptr(TimeoutError(
          where + " timed out after " + std::to_string(w.args.timeout.count()) +
              " ms in Gloo: a peer did not take part in time (gloo: " + msg + ")",
          ErrorContext{op, rank_, -1,
                       "every rank must issue the same collectives in the same order; look "
                       "for a rank that is stuck or slow; raise --timeout if it is only slow"}));
    if (msg.find("Application timeout caused pair closure") != std::string::npos)
      return std::make_exception_ptr(TimeoutError(
          where + " failed: an earlier operation timed out and Gloo closed every connection "
                  "(gloo: " + msg + ")",
          ErrorContext{op, rank_, -1, "the first timeout on any rank is the cause"}));
    const std::string who = peer >= 0 ? "rank " + std::to_string(peer) : "a peer";
    return std::make_exception_ptr(PeerError(
        where + " failed: " + who + " closed its connection or failed (gloo: " + msg + ")",
        ErrorContext{op, rank_, peer,
                     peer >= 0 ? "check the log of rank " + std::to_string(peer) +
                                     ": it died, was killed or hit an error first"
                               : "check the logs of the other ranks: one died, was killed or "
                                 "hit an error first"}));
  }

  // Grow-only scratch of each worker thread (reduce on non-roots,
  // reduce_scatter staging), so steady-state ops do not allocate.
  static std::uint8_t* scratch_for(std::vector<std::uint8_t>& scratch, std::size_t bytes) {
    if (scratch.size() < bytes) scratch.resize(bytes);
    return scratch.data();
  }

  template <typename F>
  static void with_element_type(DType t, F&& f) {
    // Gloo's options only need sizeof(T); the arithmetic is our reduce_host.
    switch (dtype_size(t)) {
      case 1: return f(std::uint8_t{});
      case 2: return f(std::uint16_t{});
      case 4: return f(std::uint32_t{});
      case 8: return f(std::uint64_t{});
    }
    DDPDIAG_ASSERT(false && "unsupported element size");
  }

  static auto reduce_function(DType dtype, ReduceOp op) {
    // Two bytes of capture: fits std::function's small buffer, no allocation.
    return [dtype, op](void* out, const void* a, const void* b, std::size_t n) {
      reduce_host(dtype, op, out, a, b, n);
    };
  }

  void dispatch(const OpArgs& a, std::vector<std::uint8_t>& scratch) {
    switch (a.kind) {
      case OpKind::kAllreduce: return run_allreduce(a);
      case OpKind::kBroadcast: return run_broadcast(a);
      case OpKind::kReduce: return run_reduce(a, scratch);
      case OpKind::kAllgather: return run_allgather(a);
      case OpKind::kReduceScatter: return run_reduce_scatter(a, scratch);
      case OpKind::kSend: return run_send(a);
      case OpKind::kRecv: return run_recv(a);
      case OpKind::kSendRecv: return run_sendrecv(a);
      case OpKind::kBarrier: return run_barrier(a);
      case OpKind::kLocal:
        if (a.local) a.local();
        return;
    }
  }

  void run_allreduce(const OpArgs& a) {
    if (a.count == 0) return;
    with_element_type(a.dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::AllreduceOptions o(context_);
      // Without an input Gloo reduces the output in place.
      if (a.send != a.recv) o.setInput<T>(const_cast<T*>(static_cast<const T*>(a.send)), a.count);
      o.setOutput<T>(static_cast<T*>(a.recv), a.count);
      o.setReduceFunction(reduce_function(a.dtype, a.op));
      o.setTag(a.tag);
      o.setTimeout(a.timeout);
      gloo::allreduce(o);
    });
    if (a.op == ReduceOp::kAvg) divide_host(a.dtype, a.recv, a.count, size_);
  }

  void run_broadcast(const OpArgs& a) {
    if (a.count == 0) return;
    with_element_type(a.dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::BroadcastOptions o(context_);
      o.setOutput<T>(static_cast<T*>(a.recv), a.count);  // the root sends from it in place
      o.setRoot(a.root_or_peer);
      o.setTag(a.tag);
      o.setTimeout(a.timeout);
      gloo::broadcast(o);
    });
  }

  void run_reduce(const OpArgs& a, std::vector<std::uint8_t>& scratch) {
    if (a.count == 0) return;
    const bool root = rank_ == a.root_or_peer;
    // Gloo's ring reduce uses the output as working memory on every rank;
    // off the root the caller's recv "does not matter", so it is not touched.
    void* out = root ? a.recv : scratch_for(scratch, a.count * dtype_size(a.dtype));
    with_element_type(a.dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::ReduceOptions o(context_);
      if (a.send != out) o.setInput<T>(const_cast<T*>(static_cast<const T*>(a.send)), a.count);
      o.setOutput<T>(static_cast<T*>(out), a.count);
      o.setRoot(a.root_or_peer);
      o.setReduceFunction(reduce_function(a.dtype, a.op));
      o.setTag(a.tag);
      o.setTimeout(a.timeout);
      gloo::reduce(o);
    });
    if (root && a.op == ReduceOp::kAvg) divide_host(a.dtype, a.recv, a.count, size_);
  }

  void run_allgather(const OpArgs& a) {
    if (a.count == 0) return;
    const std::size_t block = a.count * dtype_size(a.dtype);
    auto* out = static_cast<std::uint8_t*>(a.recv);
    const bool in_place = a.send == out + static_cast<std::size_t>(rank_) * block;
    with_element_type(a.dtype, [&](auto zero) {
      using T = decltype(zero);
      gloo::AllgatherOptions o(context_);
      if (!in_place) o.setInput<T>(const_cast<T*>(static_cast<const T*>(a.send)), a.count);
      o.setOutput<T>(static_cast<T*>(a.recv), a.count * static_cast<std::size_t>(size_));
      o.setTag(a.tag);
      o.setTimeout(a.timeout);
      gloo::allgather(o);
    });
  }

  // Gloo has no new-style reduce_scatter, so this is our own ring over
  // unbound buffers (bandwidth-optimal: each rank sends and receives n-1
  // blocks). The partial sum of block b starts at rank b+1 and travels
  // b+1 -> b+2 -> ... -> b, each rank adding its own block b, so it arrives
  // complete at its owner after n-1 steps. At step s (0..n-2) rank r
  //   sends the partial of block (r-s-1) to r+1 (its raw block at s = 0),
  //   receives the partial of block (r-s-2) from r-1 and adds its own block.
  // Two staging buffers alternate (receive into one while the other is on
  // the wire); the last step receives into recv itself when recv does not
  // overlap send, so the result needs no extra copy.
  void run_reduce_scatter(const OpArgs& a, std::vector<std::uint8_t>& scratch) {
    if (a.count == 0) return;
    const int n = size_;
    const int r = rank_;
    const std::size_t block = a.count * dtype_size(a.dtype);
    const auto* send = static_cast<const std::uint8_t*>(a.send);
    auto* recv = static_cast<std::uint8_t*>(a.recv);
    if (n == 1) {
      if (recv != send) std::memmove(recv, send, block);
      return;  // avg over one rank is the value itself
    }
    const auto deadline = deadline_after(a.timeout);
    const auto block_index = [n](int b) { return static_cast<std::size_t>(((b % n) + n) % n); };
    const bool overlaps = recv < send + static_cast<std::size_t>(n) * block && send < recv + block;
    std::uint8_t* stage[2];
    const int last = (n - 2) % 2;
    if (overlaps) {
      std::uint8_t* s = scratch_for(scratch, 2 * block);
      stage[0] = s;
      stage[1] = s + block;
    } else {
      stage[last] = recv;
      stage[1 - last] = scratch_for(scratch, block);
    }
    auto own = context_->createUnboundBuffer(const_cast<std::uint8_t*>(send),
                                             static_cast<std::size_t>(n) * block);
    std::unique_ptr<gloo::transport::UnboundBuffer> staged[2] = {
        context_->createUnboundBuffer(stage[0], block),
        context_->createUnboundBuffer(stage[1], block)};
    const int right = (r + 1) % n;
    const int left = (r - 1 + n) % n;
    const std::uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, a.tag);
    for (int s = 0; s + 1 < n; ++s) {
      auto& in = staged[s % 2];
      in->recv(left, slot);
      gloo::transport::UnboundBuffer* out = nullptr;
      if (s == 0) {
        out = own.get();
        out->send(right, slot, block_index(r - 1) * block, block);
      } else {
        out = staged[(s - 1) % 2].get();
        out->send(right, slot);
      }
      if (!in->waitRecv(time_left(deadline)) || !out->waitSend(time_left(deadline)))
        throw BackendError("reduce_scatter: a Gloo wait was aborted",
                           ErrorContext{"reduce_scatter", rank_, -1, ""});
      reduce_host(a.dtype, a.op, stage[s % 2], stage[s % 2], send + block_index(r - s - 2) * block,
                  a.count);
    }
    if (overlaps) std::memmove(recv, stage[last], block);
    if (a.op == ReduceOp::kAvg) divide_host(a.dtype, recv, a.count, n);
  }

  void run_send(const OpArgs& a) {
    const std::size_t bytes = a.count * dtype_size(a.dtype);
    if (bytes == 0) return;
    auto buf = context_->createUnboundBuffer(const_cast<void*>(a.send), bytes);
    buf->send(a.root_or_peer, gloo::Slot::build(kPointToPointSlotPrefix, a.tag));
    if (!buf->waitSend(a.timeout))
      throw BackendError("send: the Gloo wait was aborted", ErrorContext{"send", rank_, a.root_or_peer, ""});
  }

  void run_recv(const OpArgs& a) {
    const std::size_t bytes = a.count * dtype_size(a.dtype);
    if (bytes == 0) return;
    auto buf = context_->createUnboundBuffer(a.recv, bytes);
    buf->recv(a.root_or_peer, gloo::Slot::build(kPointToPointSlotPrefix, a.tag));
    if (!buf->waitRecv(a.timeout))
      throw BackendError("recv: the Gloo wait was aborted", ErrorContext{"recv", rank_, a.root_or_peer, ""});
  }

  // Both halves are posted before either is waited for, so the peers' ring
  // steps proceed together. Same slot as send/recv, so either side may use
  // the plain calls.
  void run_sendrecv(const OpArgs& a) {
    const std::size_t es = dtype_size(a.dtype);
    const std::uint64_t slot = gloo::Slot::build(kPointToPointSlotPrefix, a.tag);
    const auto deadline = deadline_after(a.timeout);
    std::unique_ptr<gloo::transport::UnboundBuffer> in, out;
    if (a.recv_count > 0) {
      in = context_->createUnboundBuffer(a.recv, a.recv_count * es);
      in->recv(a.recv_peer, slot);
    }
    if (a.count > 0) {
      out = context_->createUnboundBuffer(const_cast<void*>(a.send), a.count * es);
      out->send(a.root_or_peer, slot);
    }
    if ((in && !in->waitRecv(time_left(deadline))) || (out && !out->waitSend(time_left(deadline))))
      throw BackendError("sendrecv: a Gloo wait was aborted", ErrorContext{"sendrecv", rank_, -1, ""});
  }

  void run_barrier(const OpArgs& a) {
    gloo::BarrierOptions o(context_);
    o.setTag(a.tag);
    o.setTimeout(a.timeout);
    gloo::barrier(o);
  }

  const int rank_;
  const int size_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  const std::map<std::string, int> peer_addresses_;
  const std::map<int, sockaddr_storage> peer_sockaddrs_;  // where each peer listened

  std::mutex mutex_;  // guards queue_, running_, sleepers_, spinning_, issued_, tags
  std::condition_variable cv_;
  RingQueue<std::shared_ptr<GlooWork>> queue_;
  std::vector<std::shared_ptr<GlooWork>> running_;  // at most threads_
  std::atomic<std::size_t> queued_{0};  // mirrors queue_.size() for the lock-free spin
  int threads_ = 1;
  int sleepers_ = 0;       // workers blocked on cv_
  bool spinning_ = false;  // the first worker is spinning on queued_
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;  // written once, before aborted_ is observed by completions
  std::uint64_t issued_ = 0;
  // Collectives are tagged by their order among collectives, the same on
  // every rank; point-to-point ops keep the caller's tag.
  std::uint32_t next_collective_tag_ = 0;
  std::vector<std::thread> workers_;
  std::unordered_map<void*, std::size_t> allocations_;  // Communicator::alloc's, by address
  std::vector<ByteRange> deferred_frees_;  // freed by the caller while an op still used them
};

void GlooWork::wait(Millis timeout) {
  if (!done_.load(std::memory_order_acquire)) {
    const auto deadline = deadline_after(timeout);
    const auto spin_until = std::min(deadline, Clock::now() + kWaiterSpin);
    while (!done_.load(std::memory_order_acquire) && Clock::now() < spin_until)
      std::this_thread::yield();
    if (!done_.load(std::memory_order_acquire)) {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!cv_.wait_until(lock, deadline, [&] { return done_.load(std::memory_order_relaxed); }))
        throw TimeoutError(describe() + " did not complete within " +
                               std::to_string(timeout.count()) + " ms on rank " +
                               std::to_string(rank),
                           ErrorContext{op_name(args.kind), rank, -1,
                                        "a peer has not joined this operation or is stuck; every "
                                        "rank must issue the same collectives in the same order"});
    }
  }
  if (error_) std::rethrow_exception(error_);
}

void GlooWork::abort() {
  if (auto core = core_.lock()) core->abort("Work::abort on " + describe());
}

// ---------------------------------------------------------------------------
// StreamOps on the worker thread: host work queued with the collectives, so
// it runs after the ops issued before it and before those issued after it.

class GlooStreamOps final : public StreamOps {
 public:
  explicit GlooStreamOps(std::shared_ptr<Core> core) : core_(std::move(core)) {}

  class HostPlan final : public CopyPlan {
   public:
    HostPlan(void* flat, std::uint64_t bytes, std::vector<FlatPiece> pieces)
        : flat(flat), pieces(std::move(pieces)) {
      bytes_ = bytes;
    }
    void* flat;
    std::vector<FlatPiece> pieces;
  };

  std::unique_ptr<CopyPlan> plan(void* flat, std::uint64_t flat_bytes,
                                 std::span<const FlatPiece> pieces) override {
    host_ops::check_pieces(flat_bytes, pieces);
    return std::make_unique<HostPlan>(flat, flat_bytes,
                                      std::vector<FlatPiece>(pieces.begin(), pieces.end()));
  }
  void flatten(const CopyPlan& p) override {
    const auto* h = &dynamic_cast<const HostPlan&>(p);
    run([h] { host_ops::flatten(h->flat, h->pieces); });
  }
  void unflatten(const CopyPlan& p) override {
    const auto* h = &dynamic_cast<const HostPlan&>(p);
    run([h] { host_ops::unflatten(h->flat, h->pieces); });
  }
  void copy(void* dst, const void* src, std::size_t bytes) override {
    if (bytes && dst != src) run([=] { std::memcpy(dst, src, bytes); });
  }
  void zero(void* dst, std::size_t bytes) override {
    if (bytes) run([=] { std::memset(dst, 0, bytes); });
  }
  void divide(void* buf, std::size_t n, DType t, int divisor) override {
    if (n) run([=] { host_ops::divide(buf, n, t, divisor); });
  }
  void compress(const void* src, DType src_type, void* dst16, DType dst_type, std::size_t n,
                int divisor) override {
    host_ops::check_compress_types("compress", src_type, dst_type);
    if (n) run([=] { host_ops::compress(src, src_type, dst16, dst_type, n, divisor); });
  }
  void decompress(const void* src16, DType src_type, void* dst, DType dst_type,
                  std::size_t n) override {
    host_ops::check_compress_types("decompress", dst_type, src_type);
    if (n) run([=] { host_ops::decompress(src16, src_type, dst, dst_type, n); });
  }
  std::shared_ptr<Work> fence() override { return run(nullptr); }

 private:
  std::shared_ptr<Work> run(std::function<void()> task) {
    OpArgs args;
    args.kind = OpKind::kLocal;
    args.local = std::move(task);
    return core_->submit(std::move(args));
  }

  std::shared_ptr<Core> core_;
};

// ---------------------------------------------------------------------------
// The communicator

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const CommOptions& opts, std::shared_ptr<Core> core, std::string device,
                   std::string listen_address)
      : core_(std::move(core)), device_(std::move(device)), listen_address_(std::move(listen_address)) {
    timeout_ = opts.timeout;
  }
  ~GlooCommunicator() override { core_->shutdown(); }

  int rank() const override { return core_->rank(); }
  int size() const override { return core_->size(); }
  Backend backend() const override { return Backend::kGloo; }
  MemoryKind memory_kind() const override { return MemoryKind::kHost; }
  std::string library_version() const override { return gloo_version(); }
  std::string device_name() const override { return device_; }
  std::string listen_address() const override { return listen_address_; }
  std::map<int, std::string> peer_addresses() const override { return core_->peer_addresses(); }
  std::vector<StalledLink> stalled_links() const override { return core_->stalled_links(); }
  HostProbe probe_peer_host(int peer, Millis timeout) override {
    return core_->probe_peer_host(peer, timeout);
  }

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override {
    check_buffers("allreduce", count, send, recv);
    return submit({OpKind::kAllreduce, send, recv, count, dtype, op, -1, 0, timeout_});
  }
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override {
    check_rank("broadcast", "root", root, true);
    check_buffers("broadcast", count, buf, buf);
    return submit({OpKind::kBroadcast, buf, buf, count, dtype, ReduceOp::kSum, root, 0, timeout_});
  }
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root) override {
    check_rank("reduce", "root", root, true);
    check_buffers("reduce", count, send, rank() == root ? recv : send);
    return submit({OpKind::kReduce, send, recv, count, dtype, op, root, 0, timeout_});
  }
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                  DType dtype) override {
    check_buffers("allgather", count, send, recv);
    return submit({OpKind::kAllgather, send, recv, count, dtype, ReduceOp::kSum, -1, 0, timeout_});
  }
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                       DType dtype, ReduceOp op) override {
    check_buffers("reduce_scatter", recv_count, send, recv);
    return submit({OpKind::kReduceScatter, send, recv, recv_count, dtype, op, -1, 0, timeout_});
  }
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    check_rank("send", "peer", peer, false);
    check_buffers("send", count, buf, buf);
    return submit({OpKind::kSend, buf, nullptr, count, dtype, ReduceOp::kSum, peer, tag, timeout_});
  }
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override {
    check_rank("recv", "peer", peer, false);
    check_buffers("recv", count, buf, buf);
    return submit({OpKind::kRecv, nullptr, buf, count, dtype, ReduceOp::kSum, peer, tag, timeout_});
  }
  std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count, int send_peer,
                                void* recv_buf, std::size_t recv_count, int recv_peer, DType dtype,
                                std::uint32_t tag) override {
    check_rank("sendrecv", "send peer", send_peer, false);
    check_rank("sendrecv", "recv peer", recv_peer, false);
    check_buffers("sendrecv", send_count, send_buf, send_buf);
    check_buffers("sendrecv", recv_count, recv_buf, recv_buf);
    OpArgs args{OpKind::kSendRecv, send_buf, recv_buf, send_count, dtype, ReduceOp::kSum, send_peer,
                tag, timeout_};
    args.recv_count = recv_count;
    args.recv_peer = recv_peer;
    return submit(args);
  }
  std::shared_ptr<Work> barrier() override {
    return submit({OpKind::kBarrier, nullptr, nullptr, 0, DType::kUInt8, ReduceOp::kSum, -1, 0,
                   timeout_});
  }

  void* alloc(std::size_t bytes) override {
    // (A size within an alignment of 2^64 would wrap to a tiny one.)
    const std::size_t rounded =
        bytes > std::numeric_limits<std::size_t>::max() - kHostAlignment
            ? 0
            : (std::max<std::size_t>(bytes, 1) + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    void* p = rounded ? std::aligned_alloc(kHostAlignment, rounded) : nullptr;
    if (!p)
      // Sizes that do not fit are a matter of configuration (exit 2), not
      // of the backend's initialisation.
      throw UsageError("gloo: could not allocate " + std::to_string(bytes) +
                           " bytes of host memory on rank " + std::to_string(rank()),
                       ErrorContext{"alloc", rank(), -1,
                                    "use smaller sizes (-e / --maxbytes, --bytes, --workspace-mb, the model), or "
                                    "fewer ranks on this host"});
    core_->note_alloc(p, rounded);
    return p;
  }
  // Deferred while an op that failed or was abandoned still runs on it.
  void free(void* ptr) override { core_->release(ptr); }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    if (bytes) std::memcpy(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    if (bytes) std::memcpy(dst, host_src, bytes);
  }

  void abort() override { core_->abort("Communicator::abort"); }

  StreamOps* stream_ops() override {
    if (!stream_ops_) stream_ops_ = std::make_unique<GlooStreamOps>(core_);
    return stream_ops_.get();
  }

 private:
  std::shared_ptr<Work> submit(const OpArgs& args) { return core_->submit(args); }

  void check_rank(const char* op, const char* what, int r, bool self_ok) const {
    if (r < 0 || r >= size() || (!self_ok && r == rank()))
      throw UsageError(std::string(op) + ": " + what + " " + std::to_string(r) +
                           (r == rank() ? " is this rank itself" : " is outside the world of " +
                                                                      std::to_string(size()) + " ranks"),
                       ErrorContext{op, rank(), r, "pass a rank in 0..world_size-1"});
  }
  void check_buffers(const char* op, std::size_t count, const void* a, const void* b) const {
    if (count > 0 && (a == nullptr || b == nullptr))
      throw UsageError(std::string(op) + ": null buffer with a non-zero count",
                       ErrorContext{op, rank(), -1, "allocate the buffers with Communicator::alloc"});
  }

  std::shared_ptr<Core> core_;
  std::unique_ptr<GlooStreamOps> stream_ops_;
  std::string device_;
  std::string listen_address_;
};

std::string device_ip(const gloo::transport::Device& device);

// Picks where Gloo binds, in order: the interface the caller named, the
// GLOO_SOCKET_IFNAME variable (first entry of a comma-separated list, as
// PyTorch reads it), the hostname/address the caller named, this host's
// hostname if it resolves, loopback.
std::shared_ptr<gloo::transport::Device> create_device(const CommOptions& opts) {
  gloo::transport::tcp::attr attr;
  std::string iface = opts.gloo_interface;
  if (iface.empty()) {
    if (const char* env = std::getenv("GLOO_SOCKET_IFNAME")) {
      iface = env;
      iface = iface.substr(0, iface.find(','));
    }
  }
  const auto fail = [&](const std::string& what, const std::exception& e) -> UsageError {
    return UsageError("gloo: cannot bind to " + what + ": " + e.what(),
                      ErrorContext{"backend.init", opts.rank, -1,
                                   "pass an existing interface (--gloo-interface / "
                                   "GLOO_SOCKET_IFNAME) or an address of this host"});
  };
  if (!iface.empty()) {
    attr.iface = iface;
    try {
      return gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw fail("interface '" + iface + "'", e);
    }
  }
  if (!opts.gloo_hostname.empty()) {
    attr.hostname = opts.gloo_hostname;
    try {
      return gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      throw fail("'" + opts.gloo_hostname + "'", e);
    }
  }
  const std::string host = local_hostname();
  const auto no_reachable_address = [&](const std::string& why) {
    return RendezvousError(
        "gloo: rank " + std::to_string(opts.rank) + " has no address its peers on other hosts "
            "can reach: this host's name '" + host + "' " + why +
            ", so Gloo would listen on loopback only, while the ranks run on several hosts",
        ErrorContext{"backend.init", opts.rank, -1,
                     "set GLOO_SOCKET_IFNAME (or --gloo-interface) to the network interface the "
                     "hosts share, e.g. eth0, on every rank; or make each host's name resolve to "
                     "its address (/etc/hosts, DNS)"});
  };
  if (hostname_resolves(host)) {
    attr.hostname = host;
    std::shared_ptr<gloo::transport::Device> device;
    try {
      device = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception&) {
      // The hostname resolves to an address this host cannot bind: loopback.
    }
    if (device) {
      // Debian's installer maps the host's name to 127.0.1.1 in /etc/hosts:
      // any 127.x.y.z (or ::1) is loopback, no address for other hosts.
      const std::string ip = device_ip(*device);
      const bool loopback = ip.rfind("127.", 0) == 0 || ip == "::1" || ip.rfind("::ffff:127.", 0) == 0;
      if (loopback && opts.spans_hosts)
        throw no_reachable_address("resolves to the loopback address " + ip +
                                   " (a line '" + ip + " " + host + "' in /etc/hosts?)");
      return device;
    }
  }
  if (opts.spans_hosts)
    // Gloo would listen on 127.0.0.1 and every peer on another host would
    // try to connect there until its deadline (several of them, in Gloo's
    // own retries): say so now.
    throw no_reachable_address(hostname_resolves(host)
                                   ? "resolves to an address this host cannot listen on"
                                   : "does not resolve");
  attr = gloo::transport::tcp::attr("127.0.0.1");
  try {
    return gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    throw fail("127.0.0.1", e);
  }
}

// The IP a Gloo TCP device listens on, from its description ("tcp, pci=,
// iface=eth0, speed=-1, addr=[10.0.0.2]"); "" when it has none.
std::string device_ip(const gloo::transport::Device& device) {
  const std::string s = device.str();
  const auto at = s.find("addr=[");
  if (at == std::string::npos) return "";
  const auto end = s.find(']', at + 6);
  return end == std::string::npos ? "" : s.substr(at + 6, end - at - 6);
}

bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in&>(b);
    return x.sin_port == y.sin_port && x.sin_addr.s_addr == y.sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto& y = reinterpret_cast<const sockaddr_in6&>(b);
    return x.sin6_port == y.sin6_port &&
           std::memcmp(&x.sin6_addr, &y.sin6_addr, sizeof x.sin6_addr) == 0;
  }
  return false;
}

// This process's TCP sockets as the kernel lists them (/proc/net/tcp and
// tcp6, this network namespace), kept to sockets open in this process.
// Empty where /proc is not readable.
struct TcpRow {
  int state = 0;  // 1 ESTABLISHED, 2 SYN_SENT, ... (the kernel's numbering)
  sockaddr_storage local{}, remote{};
  std::uint64_t tx_queue = 0;  // bytes not yet acknowledged
  int retransmits = 0;         // retransmission timeouts without an answer
};

std::vector<TcpRow> tcp_sockets_of_this_process() {
  std::set<unsigned long> ours;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(dir)) {
      char target[64] = {0};
      const std::string link = std::string("/proc/self/fd/") + e->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
      unsigned long inode = 0;
      if (n > 0 && std::sscanf(target, "socket:[%lu]", &inode) == 1) ours.insert(inode);
    }
    ::closedir(dir);
  }
  const auto is_hex = [](const std::string& t) {
    return !t.empty() && t.find_first_not_of("0123456789ABCDEFabcdef") == std::string::npos;
  };
  // "0100007F:1F90": the address as the kernel prints each 32-bit word of
  // it as it lies in memory, then the port.
  const auto endpoint = [&](const std::string& text, bool v6, sockaddr_storage& ss) {
    const auto colon = text.find(':');
    if (colon == std::string::npos) return false;
    const std::string host = text.substr(0, colon), port_hex = text.substr(colon + 1);
    if (!is_hex(host) || !is_hex(port_hex) || port_hex.size() > 4) return false;
    const auto port = static_cast<std::uint16_t>(std::stoul(port_hex, nullptr, 16));
    ss = {};
    if (!v6 && host.size() == 8) {
      auto& in4 = reinterpret_cast<sockaddr_in&>(ss);
      in4.sin_family = AF_INET;
      in4.sin_port = htons(port);
      in4.sin_addr.s_addr = static_cast<std::uint32_t>(std::stoul(host, nullptr, 16));
      return true;
    }
    if (v6 && host.size() == 32) {
      auto& in6 = reinterpret_cast<sockaddr_in6&>(ss);
      in6.sin6_family = AF_INET6;
      in6.sin6_port = htons(port);
      for (int w = 0; w < 4; ++w) {
        const auto word = static_cast<std::uint32_t>(std::stoul(host.substr(w * 8, 8), nullptr, 16));
        std::memcpy(reinterpret_cast<char*>(&in6.sin6_addr) + w * 4, &word, 4);
      }
      return true;
    }
    return false;
  };
  std::vector<TcpRow> out;
  if (ours.empty()) return out;
  for (const bool v6 : {false, true}) {
    std::ifstream in(v6 ? "/proc/net/tcp6" : "/proc/net/tcp");
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      // sl local_address rem_address st tx_queue:rx_queue tr:when retrnsmt uid timeout inode
      std::istringstream f(line);
      std::string sl, local, remote, st, queues, timer, retr, uid, tmo;
      unsigned long inode = 0;
      if (!(f >> sl >> local >> remote >> st >> queues >> timer >> retr >> uid >> tmo >> inode))
        continue;
      if (!ours.count(inode) || !is_hex(st) || !is_hex(retr) || retr.size() > 8) continue;
      TcpRow row;
      if (!endpoint(local, v6, row.local) || !endpoint(remote, v6, row.remote)) continue;
      row.state = static_cast<int>(std::stoul(st, nullptr, 16));
      const std::string tx = queues.substr(0, queues.find(':'));
      if (is_hex(tx) && tx.size() <= 16) row.tx_queue = std::stoull(tx, nullptr, 16);
      row.retransmits = static_cast<int>(std::stoul(retr, nullptr, 16));
      out.push_back(row);
    }
  }
  return out;
}

// The remote ends of this process's TCP connections still in SYN_SENT: the
// connection requests nobody has answered.
std::vector<sockaddr_storage> unanswered_connects() {
  std::vector<sockaddr_storage> out;
  for (const auto& row : tcp_sockets_of_this_process())
    if (row.state == 2) out.push_back(row.remote);  // TCP_SYN_SENT
  return out;
}

bool same_ip(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  return ip_text(reinterpret_cast<const sockaddr*>(&a)) == ip_text(reinterpret_cast<const sockaddr*>(&b));
}

// The established connections whose data waits for acknowledgement while
// the kernel retransmits it, that are this rank's Gloo pairs: the ones it
// opened to a peer's listener (the peer is known exactly), and the ones a
// peer opened to one of this rank's listeners (the peer is known by its
// address when no other rank shares it). Other sockets (the store's) are
// left out.
std::vector<StalledLink> stalled_links_of(int rank, const std::map<int, sockaddr_storage>& peer_listeners,
                                          const std::vector<sockaddr_storage>& own_listeners) {
  std::vector<StalledLink> out;
  for (const auto& row : tcp_sockets_of_this_process()) {
    if (row.state != 1 || row.tx_queue == 0 || row.retransmits == 0) continue;  // 1: ESTABLISHED
    int peer = -1;
    bool ours = false;
    for (const auto& [p, at] : peer_listeners)
      if (p != rank && same_endpoint(row.remote, at)) {
        peer = p;
        ours = true;
      }
    if (!ours && std::any_of(own_listeners.begin(), own_listeners.end(),
                             [&](const auto& l) { return same_endpoint(row.local, l); })) {
      ours = true;
      std::vector<int> at_that_ip;
      for (const auto& [p, at] : peer_listeners)
        if (p != rank && same_ip(row.remote, at)) at_that_ip.push_back(p);
      if (at_that_ip.size() == 1) peer = at_that_ip[0];
    }
    if (!ours) continue;
    out.push_back({peer, endpoint_text(reinterpret_cast<const sockaddr*>(&row.remote)), row.tx_queue,
                   row.retransmits});
  }
  return out;
}

// Gloo connects to its peers one at a time and waits up to 5 x its timeout
// for each (its own rule), so a firewall that lets the store's port through
// but drops the ports Gloo listens on held a rank for several timeouts. We
// give each connection one timeout, and then say which one is stuck: the
// peer whose address Gloo read last. `gloo_error` is Gloo's own message when
// Gloo gave up first, empty when our deadline passed.
// The peers' Gloo addresses as this rank read them from the store, for an
// error that the addresses explain (" Addresses published: rank 0 at
// 10.0.0.1:41234, rank 2 at ..."); at most 16, then how many more.
std::string published_addresses(const std::vector<StoreAdapter::PeerRead>& reads) {
  std::map<int, std::string> by_peer;
  for (const auto& r : reads) by_peer[r.peer] = endpoint_str(r.address);
  if (by_peer.empty()) return "";
  std::string out = ". Gloo addresses the peers published: ";
  std::size_t shown = 0;
  for (const auto& [peer, at] : by_peer) {
    if (shown == 16) {
      out += " and " + std::to_string(by_peer.size() - shown) + " more";
      break;
    }
    out += std::string(shown++ ? ", " : "") + "rank " + std::to_string(peer) + " at " + at;
  }
  return out;
}

// The peer whose address Gloo's error names ("connect [10.0.0.2]:4711:
// ..."; msg with its ports put right), or nullptr.
const StoreAdapter::PeerRead* read_named_in(const std::string& msg,
                                            const std::vector<StoreAdapter::PeerRead>& reads) {
  for (const auto& r : reads) {
    const std::string ep = endpoint_str(r.address);
    const auto colon = ep.rfind(':');
    if (colon == std::string::npos) continue;
    const std::string shown = ep.front() == '[' ? ep : "[" + ep.substr(0, colon) + "]" + ep.substr(colon);
    if (find_address(msg, shown) != std::string::npos) return &r;
  }
  return nullptr;
}

// The first peer whose published address this host cannot reach (no route,
// or no answer within 500 ms; 3 s in all), or nullptr. A probe that reaches
// a pair still listening for this rank would be taken for this rank's
// connection; connectFullMesh reads and connects in order, so the peers
// before the failed one are connected already (their listeners closed) and
// the search stops at the first silent one.
const StoreAdapter::PeerRead* unreachable_peer(const std::vector<StoreAdapter::PeerRead>& reads) {
  const auto until = Clock::now() + std::chrono::seconds(3);
  std::set<int> tried;
  for (const auto& r : reads) {
    if (!tried.insert(r.peer).second) continue;
    const auto left = std::chrono::duration_cast<Millis>(until - Clock::now());
    if (left.count() <= 0) break;
    if (tcp_probe(r.address, std::min(left, Millis(500))) == TcpReach::kSilent) return &r;
  }
  return nullptr;
}

RendezvousError connect_failed(const CommOptions& opts, const StoreAdapter::PeerRead& last,
                               const std::string& gloo_error,
                               const std::vector<StoreAdapter::PeerRead>& reads = {}) {
  const std::string me = "rank " + std::to_string(opts.rank);
  const std::string peer = "rank " + std::to_string(last.peer);
  const std::string at = endpoint_str(last.address);
  const std::string ms = std::to_string(opts.timeout.count()) + " ms";
  const bool refused = gloo_error.find("refused") != std::string::npos;
  // The kernel said at once that it has no path there (this host's routes,
  // or an ICMP unreachable from a router): nothing waited out the timeout.
  const bool no_route = gloo_error.find("No route to host") != std::string::npos ||
                        gloo_error.find("Network is unreachable") != std::string::npos;
  // The side that connects (Gloo's rule: the pair's larger address) has a
  // socket in SYN_SENT, or Gloo's own connect error; the side that listens
  // waits for the peer.
  bool unanswered = gloo_error.find("connect [") != std::string::npos &&
                    gloo_error.find("timed out") != std::string::npos;
  if (gloo_error.empty()) {
    const auto open = unanswered_connects();
    unanswered = std::any_of(open.begin(), open.end(),
                             [&](const auto& a) { return same_endpoint(a, last.address); });
  }
  // Where this host sends that traffic: a route out by the wrong interface
  // (a default route over a management NIC) shows here.
  const std::string route = route_text(ip_text(reinterpret_cast<const sockaddr*>(&last.address)));
  std::string what;
  if (no_route)
    what = me + "'s connection to " + peer + "'s Gloo listener at " + at +
           " failed at once: this host has no route to that address, or a router on the way "
           "answered that it has none (check `ip route get " + ip_text(reinterpret_cast<const sockaddr*>(&last.address)) +
           "` on " + me + "'s host)";
  else if (refused)
    what = me + "'s connection to " + peer + "'s Gloo listener at " + at +
           " was refused (nothing listens there any more, or a firewall rejects it)";
  else if (unanswered)
    what = me + "'s connection request to " + peer + "'s Gloo listener at " + at +
           " got no answer within " + ms;
  else
    what = peer + " did not open its connection to " + me + " within " + ms + " (" + peer +
           " listens at " + at + "; it may be stuck connecting to another rank first, as its "
           "own message says)";
  if (!route.empty()) what += " (" + route + ")";
  return RendezvousError(
      "gloo: " + me + " could not connect to " + peer + ": " + what +
          ". The store is reachable (" + peer + " published its address there), but the ports "
          "Gloo listens on, a random one on each rank, are not reachable between these ranks: "
          "a firewall that lets only the store's port through, or an address on a network the "
          "other host cannot reach" +
          (gloo_error.empty() ? std::string() : " (gloo: " + gloo_error + ")") +
          published_addresses(reads),
      ErrorContext{"backend.init", opts.rank, last.peer,
                   "allow TCP between the hosts on all ports (Gloo picks its ports at random), "
                   "or set GLOO_SOCKET_IFNAME (--gloo-interface) on every rank to the interface "
                   "the hosts share; 'ddpdiag init-check' shows each rank's address"});
}

}  // namespace

std::string gloo_version() {
  return "gloo " + std::to_string(GLOO_VERSION_MAJOR) + "." + std::to_string(GLOO_VERSION_MINOR) +
         "." + std::to_string(GLOO_VERSION_PATCH);
}

std::unique_ptr<Communicator> make_gloo_communicator(const CommOptions& opts) {
  if (opts.gloo_threads < 1 || opts.gloo_threads > kMaxGlooThreads)
    throw UsageError("gloo: " + std::to_string(opts.gloo_threads) +
                         " worker threads asked for; between 1 and " +
                         std::to_string(kMaxGlooThreads) + " are possible",
                     ErrorContext{"backend.init", opts.rank, -1,
                                  "pass --gloo-threads 1 to run one op at a time, 2 as torch "
                                  "does (the default)"});
  auto device = create_device(opts);
  auto context = std::make_shared<gloo::rendezvous::Context>(opts.rank, opts.world_size);
  context->setTimeout(opts.timeout);
  auto adapter = std::make_shared<StoreAdapter>(opts.store, opts.timeout, opts.rank, opts.world_size);
  // connectFullMesh runs on its own thread, so that one stuck connection
  // ends at --timeout (plus a grace for the handshake) from the moment Gloo
  // read that peer's address, not at Gloo's 5 x timeout per peer. A thread
  // left stuck keeps what it uses alive and ends with the process.
  auto connected = std::make_shared<std::promise<void>>();
  auto result = connected->get_future();
  std::thread connector([context, adapter, device, connected]() mutable {
    try {
      context->connectFullMesh(*adapter, device);
      connected->set_value();
    } catch (...) {
      connected->set_exception(std::current_exception());
    }
  });
  constexpr auto kGrace = std::chrono::seconds(2);
  const Millis allowance = opts.timeout > Millis(std::chrono::hours(24 * 365))
                               ? Millis(std::chrono::hours(24 * 365))
                               : opts.timeout + kGrace;
  // A rank whose own backend failed to start says so (opts.peer_failure),
  // looked at every kWaitSlice: waiting on for it would only end at the
  // deadline.
  const auto started = Clock::now();
  for (;;) {
    const auto reads = adapter->reads();
    const auto progress = reads.empty() ? started : std::max(started, reads.back().when);
    const auto deadline = progress + allowance;
    if (result.wait_until(std::min(deadline, Clock::now() + kWaitSlice)) == std::future_status::ready)
      break;
    if (opts.peer_failure)
      if (const auto failed = opts.peer_failure()) {
        adapter->abandon();
        connector.detach();
        if (failed->world_aborted)
          throw RendezvousError("gloo: rank " + std::to_string(opts.rank) +
                                    " stopped waiting for its peers' connections: the world was "
                                    "called off at rendezvous: " + failed->message,
                                ErrorContext{"backend.init", opts.rank, failed->rank,
                                             kWorldAbortedHint});
        throw PeerError("gloo: rank " + std::to_string(opts.rank) +
                            " stopped waiting for its peers' connections: rank " +
                            std::to_string(failed->rank) + " failed in backend init: " +
                            failed->message,
                        ErrorContext{"backend.init", opts.rank, failed->rank,
                                     "rank " + std::to_string(failed->rank) +
                                         "'s own error, in its log, is the cause"});
      }
    // Still waiting for the first peer's address: the store's own timeout
    // ends that wait, and Gloo's error says who never published.
    if (Clock::now() < deadline || adapter->reads().size() != reads.size() || reads.empty())
      continue;
    adapter->abandon();
    connector.detach();
    throw connect_failed(opts, reads.back(), "", reads);
  }
  connector.join();
  try {
    result.get();
  } catch (const TimeoutError& e) {
    // Name the ranks that never published their addresses.
    std::string missing;
    for (int r = 0; r < opts.world_size; ++r) {
      // Gloo's key for a rank's address: "rank_<r>" (older Gloo: "<r>").
      if (opts.store->check({StoreAdapter::key_of("rank_" + std::to_string(r))}) ||
          opts.store->check({StoreAdapter::key_of(std::to_string(r))}))
        continue;
      missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    throw TimeoutError(
        "gloo rendezvous timed out after " + std::to_string(opts.timeout.count()) + " ms on rank " +
            std::to_string(opts.rank) +
            (missing.empty() ? std::string(" (") + e.what() + ")"
                             : ": rank(s) " + missing + " never published their address"),
        ErrorContext{"backend.init", opts.rank, -1,
                     "start every rank with the same world size and store address; check that "
                     "the missing ranks are running"});
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string msg = right_ports(e.what());
    const auto reads = adapter->reads();
    if (!reads.empty() && (msg.find("connect [") != std::string::npos ||
                           msg.find("Connect timeout") != std::string::npos)) {
      const auto* named = read_named_in(msg, reads);
      throw connect_failed(opts, named ? *named : reads.back(), msg, reads);
    }
    // A connect that failed without naming its address (Gloo's
    // "connect: Network is unreachable"): the peer whose published address
    // this host cannot reach is the one, found by trying each.
    if (!reads.empty() && msg.find("connect") != std::string::npos)
      if (const auto* culprit = unreachable_peer(reads)) throw connect_failed(opts, *culprit, msg, reads);
    throw RendezvousError("gloo: rank " + std::to_string(opts.rank) +
                              " could not connect to its peers: " + msg + published_addresses(reads),
                          ErrorContext{"backend.init", opts.rank, -1,
                                       "check that the ranks can reach each other (firewall, "
                                       "--gloo-interface / GLOO_SOCKET_IFNAME)"});
  }
  std::map<int, sockaddr_storage> peer_sockaddrs;
  for (const auto& read : adapter->reads()) peer_sockaddrs[read.peer] = read.address;
  auto core = std::make_shared<Core>(opts, std::move(context), adapter->take_peer_addresses(),
                                     std::move(peer_sockaddrs));
  core->start(opts.gloo_threads);
  return std::make_unique<GlooCommunicator>(opts, std::move(core), "cpu (" + local_hostname() + ")",
                                            device_ip(*device));
}

}  // namespace ddpdiag::gloo_backend
