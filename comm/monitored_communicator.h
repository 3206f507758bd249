// A Communicator that wraps another and watches it, as c10d's NCCL watchdog
// and flight recorder do:
//
//  - every collective gets a sequence number (1, 2, ...) and a fingerprint
//    (op, dtype, count, root); the last N are kept in a flight recorder;
//  - when a Work's wait fails (its deadline passed, a peer closed its
//    connection) or the watchdog thread sees a collective outstanding past its
//    deadline, this rank publishes its state through the STORE (never the
//    stuck communicator) under "<prefix>/state/<rank>", raises the job-wide
//    alarm key, aborts the wrapped communicator, waits briefly for the other
//    ranks' states and throws one error that says which ranks are behind,
//    which run a different collective and which are gone;
//  - the watchdog thread polls the alarm key, so a rank that is not inside a
//    collective (stuck in its own code) still publishes its state when another
//    rank raises the alarm, and a rank blocked in a healthy-looking collective
//    stops at once instead of at its own deadline.
//
// Protocol (keys under the monitor's store prefix):
//   alarm          first writer wins (compare_set): "rank R: <what failed>"
//   state/<r>      JSON of RankState (monitor.h), rewritten on each publication
//   heartbeat/<r>  {"n": count, "wall_s": seconds since the epoch}, rewritten
//                  by the watchdog every poll until this rank fails. A rank
//                  that published no state and whose heartbeat did not move
//                  while the others waited for it is reported unreachable.
//
// The watchdog's store client has a short I/O deadline (cli_common.cpp: the
// monitor's own connection). The first store call that fails marks the store
// lost: the monitor makes no further store calls (each would wait out its
// deadline again) and a failure is diagnosed from this rank's own state
// alone, naming the store as unreachable.
//
// Optional: --desync-check all-gathers the fingerprint before every
// collective (TORCH_DISTRIBUTED_DEBUG=DETAIL style) and fails at once on a
// mismatch, at the price of one extra small all_gather per collective.
// Fault injection for tests (monitor.h: Fault) is applied here.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <limits>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/monitor.h"

namespace ddpdiag {

// The text of /proc/<pid>/stat, or "" when it cannot be read. A process can
// end between the open and the read (the read then fails with ESRCH): that
// reads as "" too, never as an error.
std::string read_proc_stat(long pid);
// Linux: the state letter of /proc/<pid>/stat ('R', 'S', 'T' for stopped,
// 'Z', ...), or 0 when the process does not exist.
char process_state(long pid);
// A state of a process that has exited (no such pid, a zombie, or dead).
inline bool gone_state(char st) { return st == 0 || st == 'Z' || st == 'X'; }
// Stopped (SIGSTOP, job control) or traced (a debugger): exists, does not run.
inline bool stopped_state(char st) { return st == 'T' || st == 't'; }
inline bool process_gone(long pid) { return gone_state(process_state(pid)); }

struct MonitorOptions {
  int rank = 0;       // in this communicator
  int world_rank = -1;  // for fault specs; defaults to rank
  int size = 1;
  // A store connection of its own (so that a main thread blocked in a store
  // wait does not block the watchdog), prefixed for this communicator.
  std::shared_ptr<Store> store;
  Millis timeout = Store::kDefaultTimeout;  // deadline of a collective
  // How long a rank that detected a failure waits for the others' states.
  Millis gather_wait{3000};
  Millis poll_interval{500};  // watchdog: alarm key and overdue collectives
  // A collective open this long while a peer on another machine writes no
  // heartbeat (dead, frozen, or cut off from the store: its backend may
  // never say so) ends before its deadline. 0: only the deadline.
  Millis heartbeat_stall{0};
  std::size_t flight_size = 32;
  bool desync_check = false;
  std::vector<Fault> faults;
  // Every rank's host and pid (from rendezvous), and whether it runs on this
  // machine, so a rank that published nothing can be told dead or stopped.
  struct Peer {
    std::string host;
    long pid = 0;
    bool same_machine = false;
  };
  std::vector<Peer> peers;
  std::string host;  // this rank's host name as reported
  std::string store_address;  // "host:port" of the store, for messages
  // The rank whose process hosts the store (0, as torch's env:// has it), or
  // -1 when another process does (torchrun's agent, a store of its own).
  int store_host_rank = -1;
};

class MonitoredCommunicator final : public Communicator {
 public:
  MonitoredCommunicator(std::unique_ptr<Communicator> inner, MonitorOptions opts);
  ~MonitoredCommunicator() override;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  Backend backend() const override { return inner_->backend(); }
  MemoryKind memory_kind() const override { return inner_->memory_kind(); }
  std::string library_version() const override { return inner_->library_version(); }
  std::string device_name() const override { return inner_->device_name(); }
  std::string listen_address() const override { return inner_->listen_address(); }
  std::map<int, std::string> peer_addresses() const override { return inner_->peer_addresses(); }
  std::vector<StalledLink> stalled_links() const override { return inner_->stalled_links(); }
  HostProbe probe_peer_host(int peer, Millis timeout) override {
    return inner_->probe_peer_host(peer, timeout);
  }

  std::shared_ptr<Work> allreduce(const void* send, void* recv, std::size_t count, DType dtype,
                                  ReduceOp op) override;
  std::shared_ptr<Work> broadcast(void* buf, std::size_t count, DType dtype, int root) override;
  std::shared_ptr<Work> reduce(const void* send, void* recv, std::size_t count, DType dtype,
                               ReduceOp op, int root) override;
  std::shared_ptr<Work> allgather(const void* send, void* recv, std::size_t count,
                                  DType dtype) override;
  std::shared_ptr<Work> reduce_scatter(const void* send, void* recv, std::size_t recv_count,
                                       DType dtype, ReduceOp op) override;
  std::shared_ptr<Work> send(const void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override;
  std::shared_ptr<Work> recv(void* buf, std::size_t count, DType dtype, int peer,
                             std::uint32_t tag) override;
  std::shared_ptr<Work> sendrecv(const void* send_buf, std::size_t send_count, int send_peer,
                                 void* recv_buf, std::size_t recv_count, int recv_peer,
                                 DType dtype, std::uint32_t tag) override;
  std::shared_ptr<Work> barrier() override;

  void* alloc(std::size_t bytes) override { return inner_->alloc(bytes); }
  void free(void* ptr) override { inner_->free(ptr); }
  void copy_to_host(void* host_dst, const void* src, std::size_t bytes) override {
    inner_->copy_to_host(host_dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, std::size_t bytes) override {
    inner_->copy_from_host(dst, host_src, bytes);
  }
  void abort() override;
  // Local work carries no fingerprint: it cannot desynchronise the ranks.
  StreamOps* stream_ops() override { return inner_->stream_ops(); }
  bool can_split() const override { return inner_->can_split(); }
  std::unique_ptr<Communicator> split(int color, int key, Millis timeout) override {
    return inner_->split(color, key, timeout);
  }

  Communicator& inner() { return *inner_; }
  std::int64_t last_started() const { return started_.load(); }
  std::int64_t last_completed() const { return completed_.load(); }
  // This rank's state now (flight recorder included).
  RankState state(const std::string& reason) const;
  // After a failure: {"diagnosis", "ranks" (every published state), "cause"};
  // null before.
  nlohmann::json failure_report() const;

  // Called by the Work handles.
  // `fp`: what collective #seq is (the message names it); the cause's text
  // keeps no number of the backend's own (it counts its ops differently).
  [[noreturn]] void fail(std::int64_t seq, const Error& cause, const Fingerprint* fp = nullptr);
  void mark_completed(std::int64_t seq);
  void corrupt_result(void* recv, DType dtype, std::size_t count);
  // The corrupt fault on a received point-to-point buffer: its middle byte
  // inverted.
  void corrupt_received(void* buf, std::size_t bytes);
  bool alarm_seen() const { return alarm_seen_.load(); }
  // The deadline of one collective (--timeout): what a message about a
  // collective that never completed quotes, whatever its caller waited.
  Millis op_timeout() const { return opts_.timeout; }
  // True once a store call of the monitor failed (timed out, connection lost):
  // the store is out of reach from this rank, and callers should not wait on
  // it either.
  bool store_lost() const { return store_lost_.load(); }
  // The gather faults (monitor.h) set for this rank: the error, the
  // SIGKILL or the SIGSTOP as it hands its results to rank 0.
  bool fault_on_gather(Fault::Kind kind) const { return fault_at(kind, 0) != nullptr; }

 private:
  // The flight recorder's entry: the last flight_size collectives.
  struct Entry {
    FlightEntry rec;
    std::chrono::steady_clock::time_point started;
  };
  // A collective not yet known complete. Every one is kept, however many are
  // queued (the recorder keeps only the last flight_size): completion is
  // judged on the oldest, and a stuck one must stay nameable.
  struct Open {
    std::int64_t seq = 0;
    Fingerprint fp;
    std::chrono::steady_clock::time_point started;
    std::shared_ptr<Work> work;  // null for a phantom (injected desync)
    bool done = false;           // its own wait returned
  };
  // Under mutex_: pops the completed prefix of open_ (done, or its Work says
  // it completed without an error, unless halted_), advancing completed_
  // and the recorder.
  void finish_prefix(std::chrono::steady_clock::time_point now);
  // When finish_prefix last popped a collective: the oldest open one has
  // been first in line since then (or since it started, if later). Its
  // deadline counts from there, so collectives queued behind a slow but
  // moving one are not overdue.
  std::chrono::steady_clock::time_point prefix_advanced_{};
  Entry* recorded(std::int64_t seq);
  Open* open_at(std::int64_t seq);
  // Aborts the backend. From here on a Work that reports completion may
  // have ended with an error, so none is taken as complete by polling.
  void halt();
  // Why the watchdog halted the communicator, for the error of the op that
  // then fails ("aborted" alone says nothing). The first reason stays.
  void note_halt_reason(const std::string& why);
  template <typename MakeFn>
  std::shared_ptr<Work> issue(Fingerprint fp, MakeFn make, void* corrupt_target = nullptr,
                              DType dtype = DType::kFloat32, std::size_t count = 0);
  // peers: the ranks the op sends to or receives from; received: the
  // buffer it receives into (received_bytes long), null for a send.
  std::shared_ptr<Work> issue_p2p(Fingerprint fp, std::vector<int> peers,
                                  std::shared_ptr<Work> work, void* received = nullptr,
                                  std::size_t received_bytes = 0);
  const Fault* fault_at(Fault::Kind kind, std::int64_t seq) const;
  void stall(std::int64_t seq, const Fingerprint& fp);
  void check_fingerprints(std::int64_t seq, const Fingerprint& fp);
  void publish(const std::string& reason);
  bool raise_alarm(const std::string& reason);
  // What the store holds of a rank's heartbeat, read twice around the wait
  // for the states: `advanced` when it changed in between.
  struct Heartbeat {
    bool seen = false;
    bool advanced = false;
    double age_s = -1;  // by the writer's wall clock; -1 when never seen
  };
  std::vector<std::optional<RankState>> gather_states(std::vector<Heartbeat>& heartbeats);
  // reset[r]: a backend's error, this rank's or one another rank
  // published, says rank r's host answered by closing or resetting the
  // connection (peer_reset: this rank's own error says so of a peer it
  // could not name, which counts for every silent rank), so a silent rank
  // on another host is a process that ended, not a host cut off. Ranks
  // named unreachable, and those whose host answers while they are silent
  // (frozen), are added to `unreachable` and `silent`.
  GoneNotes gone_notes(const std::vector<std::optional<RankState>>& states,
                       const std::vector<Heartbeat>& heartbeats, std::vector<int>& unreachable,
                       std::vector<int>& silent, bool peer_reset,
                       const std::vector<bool>& reset) const;
  void note_store_lost(const Error& e);
  void write_heartbeat();
  // Watchdog thread: what ends the op watched (key: a collective's number,
  // or minus a point-to-point op's id; open for a while) because one of
  // `watched` wrote no new heartbeat for heartbeat_stall; "" if nothing.
  // what(): the op, as the message names it.
  std::string stalled_peer(std::int64_t key, const std::vector<int>& watched,
                           const std::function<std::string()>& what);
  // Watchdog thread: why rank r, a process on this machine, cannot take
  // part: "has ended" (its process is gone), "has been stopped for N s ..."
  // (state T or t for heartbeat_stall, when that is on); "" if neither, or
  // r is on another machine.
  std::string local_peer_problem(int r, std::chrono::steady_clock::time_point now);
  // The rank that hosts the store is on this machine and its process is
  // gone or stopped: retrying the store would only wait out its deadline.
  bool store_host_here_silent() const;
  // With the store lost for the heartbeat stall: why the rank that hosts it,
  // on another machine, is to blame (its host refuses the store's port: the
  // process ended; accepts it while the store stays silent: the process is
  // frozen); empty when that is not known.
  std::string remote_store_host_problem(std::chrono::steady_clock::time_point now);
  std::vector<std::optional<std::chrono::steady_clock::time_point>> stopped_since_;
  std::vector<std::chrono::steady_clock::time_point> stopped_seen_;  // last look at a stop
  void watchdog_loop();
  double now_s() const;

  std::unique_ptr<Communicator> inner_;
  MonitorOptions opts_;
  std::chrono::steady_clock::time_point t0_;
  std::atomic<std::int64_t> started_{0};
  std::atomic<std::int64_t> completed_{0};
  mutable std::mutex mutex_;  // ring_, open_, failure_*
  std::deque<Entry> ring_;
  std::deque<Open> open_;  // in sequence order
  // A point-to-point op not yet known complete (link-health's pairs,
  // dp-vs-ring): no sequence number and no deadline of the watchdog's (its
  // wait has one), but a peer on another machine that goes silent ends it
  // as it ends a collective. Dropped once complete or no longer held.
  struct OpenP2P {
    std::int64_t id = 0;
    Fingerprint fp;
    std::vector<int> peers;
    std::chrono::steady_clock::time_point started;
    std::weak_ptr<Work> work;
  };
  std::deque<OpenP2P> p2p_open_;  // under mutex_, in issue order
  void prune_p2p();               // under mutex_: drops ops complete or no longer held
  std::int64_t p2p_issued_ = 0;   // under mutex_
  // The point-to-point op that failed on this rank (under mutex_): still the
  // op it waits in, as far as the others' diagnosis goes.
  std::optional<Fingerprint> failed_p2p_;
  std::atomic<bool> halted_{false};
  std::exception_ptr failure_;
  nlohmann::json failure_report_;
  std::mutex fail_mutex_;     // one failure analysis at a time
  bool skipped_ = false;      // skip fault: applied once
  bool blocked_ = false;      // desync fault: a phantom collective blocks the rest
  std::atomic<bool> alarm_seen_{false};
  std::atomic<int> reset_by_{-1};  // RankState::reset_by of this rank
  std::atomic<bool> store_lost_{false};
  std::string store_error_;  // what the failed store call said; under mutex_
  bool store_timed_out_ = false;  // that call ran out of time (not refused or closed); under mutex_
  std::chrono::steady_clock::time_point store_lost_since_;  // under mutex_
  std::string halt_reason_;  // note_halt_reason; under mutex_
  std::int64_t heartbeats_ = 0;  // watchdog thread only
  // stalled_peer's view of the peers' heartbeats (watchdog thread only): the
  // op watched, each peer's last count and since when it stood.
  std::int64_t hb_watch_key_ = std::numeric_limits<std::int64_t>::min();  // none yet
  std::vector<std::int64_t> hb_count_;
  std::vector<std::chrono::steady_clock::time_point> hb_since_;
  std::chrono::steady_clock::time_point hb_next_read_;
  int hb_cursor_ = 0;  // where the next sweep of heartbeats starts
  // After a store error, when the watchdog next tries to write its
  // heartbeat (watchdog thread only).
  static constexpr Millis kStoreRetry{2000};
  std::chrono::steady_clock::time_point store_retry_at_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> stop_{false};
  std::mutex wd_mutex_;
  std::condition_variable wd_cv_;
  std::thread watchdog_;
  void* fp_buf_ = nullptr;  // desync check: size() x kFpWords int64, in the backend's memory
};

}  // namespace ddpdiag
