#include "comm/monitored_communicator.h"

#include <fcntl.h>
#include <signal.h>
#include <cerrno>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <stdexcept>
#include <sstream>
#include <tuple>

#include <fmt/core.h>

#include "comm/net_info.h"

namespace ddpdiag {

namespace {

using Clock = std::chrono::steady_clock;

// Fingerprint words exchanged by --desync-check: seq, op, dtype, count, root,
// reduce op. Ops and dtypes travel as small codes (index in the lists below).
constexpr std::size_t kFpWords = 6;
const char* const kOps[] = {"all_reduce", "broadcast", "reduce",  "all_gather", "reduce_scatter",
                            "barrier",    "send",      "recv",    "sendrecv"};

// "allreduce #6 (4 x float, sum) failed" -> "allreduce (4 x float, sum) failed":
// the backends number their own ops, and that count (barriers and the
// watchdog's own all_gathers included) is not the collective number.
std::string without_backend_op_numbers(const std::string& text) {
  static const std::regex numbered(R"(\b([a-z_]+) #[0-9]+\b)");
  return std::regex_replace(text, numbered, "$1");
}

std::int64_t op_code(const std::string& op) {
  for (std::size_t i = 0; i < std::size(kOps); ++i)
    if (op == kOps[i]) return static_cast<std::int64_t>(i);
  return -1;
}

Fingerprint make_fp(const char* op, std::size_t count, DType dtype, int root,
                    std::optional<ReduceOp> rop) {
  Fingerprint f;
  f.op = op;
  f.dtype = std::string(dtype_name(dtype));
  f.count = count;
  f.root = root;
  if (rop) f.reduce_op = std::string(reduce_op_name(*rop));
  return f;
}

class MonitoredWork final : public Work {
 public:
  MonitoredWork(MonitoredCommunicator* owner, std::int64_t seq, Fingerprint fp,
                std::shared_ptr<Work> inner, void* corrupt_target, DType dtype, std::size_t count)
      : owner_(owner), seq_(seq), fp_(std::move(fp)), inner_(std::move(inner)),
        corrupt_target_(corrupt_target), dtype_(dtype), count_(count) {}

  bool is_completed() override { return !inner_ || inner_->is_completed(); }

  void wait(Millis timeout) override {
    if (finished_) return;
    if (!inner_) {
      // A phantom collective (injected desync): it never completes, as a
      // collective that no peer joins; it ends at its deadline or the alarm.
      const auto deadline = Clock::now() + timeout;
      while (Clock::now() < deadline && !owner_->alarm_seen())
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      owner_->fail(seq_, TimeoutError(no_result(timeout), ErrorContext{fp_.op, owner_->rank(), -1, ""}),
                   &fp_);
    }
    try {
      inner_->wait(timeout);
    } catch (const TimeoutError& e) {
      // The backend's text names the op by its own counter, which is not the
      // collective number users see (it also counts barriers, the watchdog's
      // own ops, ...): say it in the monitor's terms.
      if (seq_ > 0)
        owner_->fail(seq_, TimeoutError(no_result(timeout), e.context()),
                     &fp_);
      owner_->fail(seq_, e, &fp_);
    } catch (const Error& e) {
      owner_->fail(seq_, e, &fp_);
    }
    if (seq_ > 0) owner_->mark_completed(seq_);
    finished_ = true;
    if (corrupt_target_) {
      // A point-to-point op has no sequence number; its count is in bytes.
      if (seq_ > 0) owner_->corrupt_result(corrupt_target_, dtype_, count_);
      else owner_->corrupt_received(corrupt_target_, count_);
    }
  }

  void abort() override {
    if (inner_) inner_->abort();
  }

  // A caller may wait for a whole queue of collectives at once (its timeout
  // covers them all); the watchdog still ends each that makes no progress
  // within --timeout. The message quotes the shorter.
  std::string no_result(Millis waited) const {
    return fmt::format("no result within {} ms", std::min(waited, owner_->op_timeout()).count());
  }

 private:
  MonitoredCommunicator* owner_;
  std::int64_t seq_;
  Fingerprint fp_;
  std::shared_ptr<Work> inner_;
  void* corrupt_target_;
  DType dtype_;
  std::size_t count_;
  bool finished_ = false;  // waited for (and corrupted) once: later waits return
};

class DoneWork final : public Work {
 public:
  bool is_completed() override { return true; }
  void wait(Millis) override {}
  void abort() override {}
};

}  // namespace

std::string read_proc_stat(long pid) {
  const std::string path = fmt::format("/proc/{}/stat", pid);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  std::string all;
  char buf[1024];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      all.append(buf, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) all.clear();  // ESRCH: it ended as we read
    break;
  }
  ::close(fd);
  return all;
}

char process_state(long pid) {
  const std::string all = read_proc_stat(pid);
  if (all.empty()) return 0;
  auto close = all.rfind(')');
  if (close == std::string::npos || close + 2 >= all.size()) return 0;
  return all[close + 2];
}

MonitoredCommunicator::MonitoredCommunicator(std::unique_ptr<Communicator> inner,
                                             MonitorOptions opts)
    : inner_(std::move(inner)), opts_(std::move(opts)), t0_(Clock::now()) {
  if (opts_.world_rank < 0) opts_.world_rank = opts_.rank;
  timeout_ = inner_->default_timeout();
  if (opts_.desync_check) fp_buf_ = inner_->alloc(kFpWords * sizeof(std::int64_t) * (size() + 1));
  if (opts_.store) watchdog_ = std::thread([this] { watchdog_loop(); });
}

MonitoredCommunicator::~MonitoredCommunicator() {
  {
    std::lock_guard<std::mutex> lock(wd_mutex_);
    stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (fp_buf_) inner_->free(fp_buf_);
}

double MonitoredCommunicator::now_s() const {
  return std::chrono::duration<double>(Clock::now() - t0_).count();
}

const Fault* MonitoredCommunicator::fault_at(Fault::Kind kind, std::int64_t seq) const {
  for (const auto& f : opts_.faults)
    if (f.kind == kind && f.rank == opts_.world_rank && (f.seq == 0 || f.seq == seq)) return &f;
  return nullptr;
}

template <typename MakeFn>
std::shared_ptr<Work> MonitoredCommunicator::issue(Fingerprint fp, MakeFn make,
                                                   void* corrupt_target, DType dtype,
                                                   std::size_t count) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
  }
  const std::int64_t seq = started_.load() + 1;
  // Another rank raised the alarm (or our watchdog did) and the backend was
  // aborted: stop here with the diagnosis rather than queue more doomed ops.
  if (alarm_seen_)
    fail(seq, BackendError("not started: the watchdog stopped the communicator after an alarm",
                           ErrorContext{fp.op, rank(), -1, ""}),
         &fp);
  if (fault_at(Fault::Kind::kExit, seq)) {
    std::fprintf(stderr, "ddpdiag: injected fault: rank %d kills itself before collective #%lld\n",
                 opts_.world_rank, static_cast<long long>(seq));
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
  if (fault_at(Fault::Kind::kThrow, seq)) {
    // An exception in a thread nobody can catch it in, as in Gloo's network
    // thread: the process ends in std::terminate. The main thread waits.
    std::thread([seq] {
      throw std::runtime_error(fmt::format("injected fault: a library thread throws before "
                                           "collective #{}", seq));
    }).join();
  }
  if (fault_at(Fault::Kind::kSkip, seq) && !skipped_) {
    // The call is dropped and not counted: the next one takes this number.
    skipped_ = true;
    return std::make_shared<DoneWork>();
  }
  if (const Fault* slow = fault_at(Fault::Kind::kSlow, seq))
    std::this_thread::sleep_for(std::chrono::milliseconds(slow->ms));
  if (fault_at(Fault::Kind::kHang, seq)) stall(seq, fp);
  const bool phantom = fault_at(Fault::Kind::kDesync, seq) != nullptr;
  if (phantom) {
    fp.op = "broadcast";
    fp.root = 0;
    fp.reduce_op.clear();
  }
  if (opts_.desync_check) check_fingerprints(seq, fp);

  // A rank stuck in a collective that no peer joins runs nothing after it
  // either (backends execute in order): later ops queue behind the phantom.
  if (phantom) blocked_ = true;
  std::shared_ptr<Work> work = blocked_ ? nullptr : make();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = Clock::now();
    ring_.push_back({{seq, fp, now_s(), -1, "started"}, now});
    while (ring_.size() > opts_.flight_size) ring_.pop_front();
    open_.push_back({seq, fp, now, work});
  }
  started_.store(seq);
  if (!fault_at(Fault::Kind::kCorrupt, seq)) corrupt_target = nullptr;
  const bool corrupt_now = corrupt_target && work;
  auto monitored = std::make_shared<MonitoredWork>(this, seq, std::move(fp), std::move(work),
                                                   corrupt_target, dtype, count);
  // The injected corruption lands before this call returns: on a stream (NCCL,
  // the reducer's stream path) the caller queues work after the op at once
  // (unflatten, a hook's decompress), which would otherwise read the result
  // before the wait corrupted it, and the check would see a clean gradient.
  if (corrupt_now) monitored->wait(op_timeout());
  return monitored;
}

void MonitoredCommunicator::prune_p2p() {
  std::erase_if(p2p_open_, [](const OpenP2P& o) {
    auto w = o.work.lock();
    return !w || w->is_completed();
  });
}

std::shared_ptr<Work> MonitoredCommunicator::issue_p2p(Fingerprint fp, std::vector<int> peers,
                                                       std::shared_ptr<Work> work, void* received,
                                                       std::size_t received_bytes) {
  // Point-to-point ops differ between ranks by design; they get no sequence
  // number but are watched like collectives.
  // Watched only where the heartbeat stall is on; listed in the published
  // state always (a rank waiting on a peer that died is not behind).
  if (work) {
    std::lock_guard<std::mutex> lock(mutex_);
    // Ops nobody holds any more, or that completed, leave the list here too
    // (the watchdog prunes it only while no collective is open).
    prune_p2p();
    p2p_open_.push_back({++p2p_issued_, fp, std::move(peers), Clock::now(), work});
  }
  // A corrupt fault without seq reaches what this rank receives too.
  if (!fault_at(Fault::Kind::kCorrupt, 0)) received = nullptr;
  return std::make_shared<MonitoredWork>(this, 0, std::move(fp), std::move(work), received,
                                         DType::kUInt8, received_bytes);
}

std::shared_ptr<Work> MonitoredCommunicator::allreduce(const void* send, void* recv,
                                                       std::size_t count, DType dtype,
                                                       ReduceOp op) {
  return issue(make_fp("all_reduce", count, dtype, -1, op),
               [&] { return inner_->allreduce(send, recv, count, dtype, op); }, recv, dtype, count);
}

std::shared_ptr<Work> MonitoredCommunicator::broadcast(void* buf, std::size_t count, DType dtype,
                                                       int root) {
  return issue(make_fp("broadcast", count, dtype, root, std::nullopt),
               [&] { return inner_->broadcast(buf, count, dtype, root); });
}

std::shared_ptr<Work> MonitoredCommunicator::reduce(const void* send, void* recv,
                                                    std::size_t count, DType dtype, ReduceOp op,
                                                    int root) {
  return issue(make_fp("reduce", count, dtype, root, op),
               [&] { return inner_->reduce(send, recv, count, dtype, op, root); });
}

std::shared_ptr<Work> MonitoredCommunicator::allgather(const void* send, void* recv,
                                                       std::size_t count, DType dtype) {
  return issue(make_fp("all_gather", count, dtype, -1, std::nullopt),
               [&] { return inner_->allgather(send, recv, count, dtype); });
}

std::shared_ptr<Work> MonitoredCommunicator::reduce_scatter(const void* send, void* recv,
                                                            std::size_t recv_count, DType dtype,
                                                            ReduceOp op) {
  return issue(make_fp("reduce_scatter", recv_count, dtype, -1, op),
               [&] { return inner_->reduce_scatter(send, recv, recv_count, dtype, op); });
}

std::shared_ptr<Work> MonitoredCommunicator::barrier() {
  Fingerprint f;
  f.op = "barrier";
  return issue(f, [&] { return inner_->barrier(); });
}

std::shared_ptr<Work> MonitoredCommunicator::send(const void* buf, std::size_t count, DType dtype,
                                                  int peer, std::uint32_t tag) {
  return issue_p2p(make_fp("send", count, dtype, peer, std::nullopt), {peer},
                   inner_->send(buf, count, dtype, peer, tag));
}

std::shared_ptr<Work> MonitoredCommunicator::recv(void* buf, std::size_t count, DType dtype,
                                                  int peer, std::uint32_t tag) {
  return issue_p2p(make_fp("recv", count, dtype, peer, std::nullopt), {peer},
                   inner_->recv(buf, count, dtype, peer, tag), buf, count * dtype_size(dtype));
}

std::shared_ptr<Work> MonitoredCommunicator::sendrecv(const void* send_buf, std::size_t send_count,
                                                      int send_peer, void* recv_buf,
                                                      std::size_t recv_count, int recv_peer,
                                                      DType dtype, std::uint32_t tag) {
  return issue_p2p(make_fp("sendrecv", send_count, dtype, send_peer, std::nullopt),
                   {send_peer, recv_peer}, inner_->sendrecv(send_buf, send_count, send_peer, recv_buf, recv_count,
                                    recv_peer, dtype, tag),
                   recv_buf, recv_count * dtype_size(dtype));
}

void MonitoredCommunicator::abort() {
  aborted_ = true;
  halt();
}

// Collective `seq` completed. Earlier ones may still run (Gloo runs
// collectives on distinct buffers side by side), so they count as complete
// only when their own Work says so; last_completed is the end of the
// completed prefix.
void MonitoredCommunicator::mark_completed(std::int64_t seq) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto now = Clock::now();
  if (Open* o = open_at(seq)) {
    o->done = true;
    if (Entry* e = recorded(seq); e && e->rec.state == "started") {
      e->rec.state = "completed";
      e->rec.duration_ms = std::chrono::duration<double, std::milli>(now - o->started).count();
    }
  }
  finish_prefix(now);
}

void MonitoredCommunicator::finish_prefix(Clock::time_point now) {
  while (!open_.empty()) {
    Open& o = open_.front();
    // A collective that failed (a peer's connection reset) is not complete:
    // it stays the one this rank names as stuck.
    if (!o.done && (halted_ || !o.work || !o.work->is_completed() || o.work->failed())) break;
    if (Entry* e = recorded(o.seq); e && e->rec.state == "started") {
      e->rec.state = "completed";
      e->rec.duration_ms = std::chrono::duration<double, std::milli>(now - o.started).count();
    }
    completed_.store(o.seq);
    open_.pop_front();
    prefix_advanced_ = now;
  }
}

MonitoredCommunicator::Entry* MonitoredCommunicator::recorded(std::int64_t seq) {
  auto it = std::lower_bound(ring_.begin(), ring_.end(), seq,
                             [](const Entry& e, std::int64_t s) { return e.rec.seq < s; });
  return it != ring_.end() && it->rec.seq == seq ? &*it : nullptr;
}

MonitoredCommunicator::Open* MonitoredCommunicator::open_at(std::int64_t seq) {
  auto it = std::lower_bound(open_.begin(), open_.end(), seq,
                             [](const Open& o, std::int64_t s) { return o.seq < s; });
  return it != open_.end() && it->seq == seq ? &*it : nullptr;
}

void MonitoredCommunicator::note_halt_reason(const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (halt_reason_.empty()) halt_reason_ = why;
}

void MonitoredCommunicator::halt() {
  halted_ = true;
  inner_->abort();
}

void MonitoredCommunicator::corrupt_result(void* recv, DType dtype, std::size_t count) {
  if (count == 0) return;
  std::vector<std::uint8_t> first(dtype_size(dtype));
  inner_->copy_to_host(first.data(), recv, first.size());
  store_from_double(dtype, first.data(), 0, load_as_double(dtype, first.data(), 0) + 1);
  inner_->copy_from_host(recv, first.data(), first.size());
}

void MonitoredCommunicator::corrupt_received(void* buf, std::size_t bytes) {
  if (bytes == 0) return;
  auto* middle = static_cast<std::uint8_t*>(buf) + bytes / 2;
  std::uint8_t b = 0;
  inner_->copy_to_host(&b, middle, 1);
  b = static_cast<std::uint8_t>(~b);
  inner_->copy_from_host(middle, &b, 1);
}

RankState MonitoredCommunicator::state(const std::string& reason) const {
  RankState s;
  s.rank = rank();
  s.host = opts_.host;
  s.pid = static_cast<long>(::getpid());
  s.last_started = started_.load();
  s.last_completed = completed_.load();
  s.reason = reason;
  s.reset_by = reset_by_.load();
  try {
    s.stalled_links = inner_->stalled_links();
  } catch (const std::exception&) {
    // Only a diagnostic aid.
  }
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& o : p2p_open_) {
    if (s.open_p2p.size() >= 4) break;
    const auto w = o.work.lock();
    if (w && !w->is_completed()) s.open_p2p.push_back(o.fp);
  }
  if (failed_p2p_ && std::find(s.open_p2p.begin(), s.open_p2p.end(), *failed_p2p_) == s.open_p2p.end())
    s.open_p2p.insert(s.open_p2p.begin(), *failed_p2p_);
  for (const auto& e : ring_) {
    FlightEntry f = e.rec;
    if (f.state == "started")
      f.duration_ms = std::chrono::duration<double, std::milli>(Clock::now() - e.started).count();
    s.recent.push_back(std::move(f));
  }
  return s;
}

nlohmann::json MonitoredCommunicator::failure_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return failure_report_;
}

void MonitoredCommunicator::note_store_lost(const Error& e) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!store_lost_) {
    store_error_ = e.what();
    store_timed_out_ = dynamic_cast<const TimeoutError*>(&e) != nullptr;
    store_lost_since_ = Clock::now();
  }
  store_lost_ = true;
}

void MonitoredCommunicator::write_heartbeat() {
  ++heartbeats_;
  const double wall_s =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  opts_.store->set(fmt::format("heartbeat/{}", rank()),
                   to_bytes(nlohmann::json{{"n", heartbeats_}, {"wall_s", wall_s}}.dump()));
}

void MonitoredCommunicator::publish(const std::string& reason) {
  if (!opts_.store || store_lost_) return;
  try {
    opts_.store->set(fmt::format("state/{}", rank()), to_bytes(to_json(state(reason)).dump()));
  } catch (const Error& e) {
    // The others will list this rank as gone; we diagnose from our own state.
    note_store_lost(e);
  }
}

bool MonitoredCommunicator::raise_alarm(const std::string& reason) {
  if (!opts_.store || store_lost_) return false;
  try {
    const Bytes mine = to_bytes(reason);
    return opts_.store->compare_set("alarm", {}, mine) == mine;
  } catch (const Error& e) {
    note_store_lost(e);
    return false;
  }
}

std::vector<std::optional<RankState>> MonitoredCommunicator::gather_states(
    std::vector<Heartbeat>& heartbeats) {
  const int n = size();
  std::vector<std::optional<RankState>> states(n);
  heartbeats.assign(n, Heartbeat{});
  if (!opts_.store || store_lost_) {
    states[rank()] = state("");
    return states;
  }
  const auto deadline = Clock::now() + opts_.gather_wait;
  std::vector<std::string> keys;
  for (int r = 0; r < n; ++r) keys.push_back(fmt::format("state/{}", r));
  auto read_heartbeat = [&](int r) -> nlohmann::json {
    const std::string key = fmt::format("heartbeat/{}", r);
    if (!opts_.store->check({key})) return nullptr;
    auto j = nlohmann::json::parse(to_string(opts_.store->get(key, Millis(1000))), nullptr, false);
    return j.is_object() ? j : nlohmann::json();
  };
  try {
    // Heartbeats of the ranks still silent now, to compare with the same
    // after the wait: a rank whose heartbeat stood still for the whole wait
    // (at least two watchdog polls) is not merely slow to publish.
    std::vector<nlohmann::json> before(n);
    if (!opts_.store->check(keys))
      for (int r = 0; r < n; ++r)
        if (r != rank() && !opts_.store->check({keys[r]})) before[r] = read_heartbeat(r);
    // A rank on this machine whose process is gone, or stopped (SIGSTOP, a
    // debugger: it publishes nothing until resumed), will publish nothing:
    // not waited for.
    const auto awaited = [&] {
      std::vector<std::string> k;
      for (int r = 0; r < n; ++r) {
        bool silent = false;
        if (r != rank() && r < static_cast<int>(opts_.peers.size()) && opts_.peers[r].same_machine &&
            opts_.peers[r].pid > 0) {
          const char st = process_state(opts_.peers[r].pid);
          silent = gone_state(st) || stopped_state(st);
        }
        if (!silent) k.push_back(keys[r]);
      }
      return k;
    };
    while (Clock::now() < deadline && !opts_.store->check(awaited()))
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const double wall_now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    for (int r = 0; r < n; ++r) {
      if (!opts_.store->check({keys[r]})) {
        if (r == rank()) continue;
        const nlohmann::json after = read_heartbeat(r);
        Heartbeat& hb = heartbeats[r];
        hb.seen = after.is_object();
        hb.advanced = hb.seen && (!before[r].is_object() ||
                                  before[r].value("n", -1L) != after.value("n", -1L));
        if (hb.seen) hb.age_s = wall_now - after.value("wall_s", wall_now);
        continue;
      }
      try {
        states[r] = rank_state_from_json(
            nlohmann::json::parse(to_string(opts_.store->get(keys[r], Millis(1000)))));
      } catch (const std::invalid_argument&) {
      } catch (const nlohmann::json::exception&) {
      }
    }
  } catch (const Error& e) {
    // Store unreachable: only what we know about ourselves.
    note_store_lost(e);
  }
  if (!states[rank()]) states[rank()] = state("");
  return states;
}

GoneNotes MonitoredCommunicator::gone_notes(const std::vector<std::optional<RankState>>& states,
                                            const std::vector<Heartbeat>& heartbeats,
                                            std::vector<int>& unreachable, std::vector<int>& silent,
                                            bool peer_reset,
                                            const std::vector<bool>& reset) const {
  GoneNotes notes(states.size());
  std::map<std::string, HostProbe> probed;  // by host: its ranks share the answer
  // 1 s a host, 2 s in all: where many hosts are silent (a switch), the
  // rest stay unknown rather than hold this rank's report.
  const auto probe_until = Clock::now() + Millis(2000);
  for (std::size_t r = 0; r < states.size() && r < opts_.peers.size(); ++r) {
    if (states[r]) continue;
    const auto& p = opts_.peers[r];
    if (!p.same_machine || p.pid <= 0) {
      const Heartbeat hb = r < heartbeats.size() ? heartbeats[r] : Heartbeat{};
      if (hb.advanced) {
        notes[r] = fmt::format("is alive and reaches the store (its heartbeat advanced while the "
                               "others waited) but did not publish its state in time: its "
                               "watchdog is stuck or very slow (host {}, pid {})",
                               p.host, p.pid);
        continue;
      }
      // Its host answers on the network, or not (1 s): this tells a host
      // cut off from one that is up with its process silent, whatever the
      // backend's error said.
      auto known = probed.find(p.host);
      if (known == probed.end()) {
        const auto left =
            std::chrono::duration_cast<Millis>(probe_until - Clock::now());
        known = probed
                    .emplace(p.host, left.count() > 0
                                         ? inner_->probe_peer_host(static_cast<int>(r),
                                                                   std::min(left, Millis(1000)))
                                         : HostProbe::kUnknown)
                    .first;
      }
      const HostProbe probe = known->second;
      const bool was_reset = peer_reset || (r < reset.size() && reset[r]);
      if (probe == HostProbe::kAnswers && !was_reset) {
        notes[r] = fmt::format("is silent: no state and no heartbeat (host {}, pid {}), yet its "
                               "host answers on the network, so the process is frozen (SIGSTOP, "
                               "a debugger, a machine swapping) or ended with its connections "
                               "left open",
                               p.host, p.pid);
        silent.push_back(static_cast<int>(r));
        continue;
      }
      if (was_reset && probe != HostProbe::kSilent) {
        // Its host's kernel answered for it: the host and the network are
        // up, and the process is gone (crashed, or killed: the OOM killer).
        notes[r] = fmt::format("is dead: no state and no heartbeat (host {}, pid {}), and its "
                               "host closed or reset the connection to it, so that host and the "
                               "network are up and the process ended: it crashed or was killed "
                               "(the OOM killer? dmesg on {})",
                               p.host, p.pid, p.host);
        continue;
      }
      unreachable.push_back(static_cast<int>(r));
      std::string silent = !hb.seen           ? std::string("no state and no heartbeat at all")
                           : hb.age_s >= 0.05 ? fmt::format("no state and no heartbeat for {:.1f} s",
                                                            hb.age_s)
                                              : std::string("no state, and its heartbeat stopped");
      notes[r] = fmt::format("is unreachable: {} (host {}, pid {}); that host lost its network "
                             "(link down, cable or switch port), a firewall blocks it, or the "
                             "host or the process crashed or froze",
                             silent, p.host, p.pid);
      continue;
    }
    const char st = process_state(p.pid);
    if (gone_state(st))
      notes[r] = fmt::format("is dead: its process {} on this machine has exited or was killed",
                             p.pid);
    else if (stopped_state(st))
      notes[r] = fmt::format("is stopped: its process {} on this machine exists but does not "
                             "run (SIGSTOP or a debugger)", p.pid);
    else
      notes[r] = fmt::format("is alive (process {}, state {}) but did not answer: stuck without "
                             "its watchdog, or cannot reach the store", p.pid, st);
  }
  return notes;
}

void MonitoredCommunicator::stall(std::int64_t seq, const Fingerprint& fp) {
  std::fprintf(stderr, "ddpdiag: injected fault: rank %d stalls before collective #%lld %s\n",
               opts_.world_rank, static_cast<long long>(seq), fp.describe().c_str());
  std::fflush(stderr);
  const auto until = Clock::now() + 3 * timeout_;
  while (Clock::now() < until && !alarm_seen_ && !aborted_)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  fail(seq, TimeoutError(fmt::format("rank {} stalled before issuing it (injected hang)", rank()),
                         ErrorContext{fp.op, rank(), -1, ""}),
       &fp);
}

namespace {
// The all_gather of --desync-check is ours, not the user's: its error says
// what it was for, keeping its type (timeout or peer) and context.
template <typename E>
E named_fingerprint_exchange(const E& e) {
  return E(std::string("the fingerprint exchange of --desync-check before it: ") + e.what(),
           e.context());
}
}  // namespace

void MonitoredCommunicator::check_fingerprints(std::int64_t seq, const Fingerprint& fp) {
  const int n = size();
  std::vector<std::int64_t> mine = {seq,
                                    op_code(fp.op),
                                    fp.dtype.empty() ? -1 : static_cast<std::int64_t>(
                                                               parse_dtype(fp.dtype).value_or(DType::kUInt8)),
                                    static_cast<std::int64_t>(fp.count),
                                    fp.root,
                                    fp.reduce_op.empty() ? -1 : static_cast<std::int64_t>(
                                                                    parse_reduce_op(fp.reduce_op).value_or(ReduceOp::kSum))};
  auto* base = static_cast<std::uint8_t*>(fp_buf_);
  const std::size_t row = kFpWords * sizeof(std::int64_t);
  inner_->copy_from_host(base, mine.data(), row);
  try {
    inner_->allgather(base, base + row, kFpWords, DType::kInt64)->wait(timeout_);
  } catch (const TimeoutError& e) {
    fail(seq, named_fingerprint_exchange(e), &fp);
  } catch (const PeerError& e) {
    fail(seq, named_fingerprint_exchange(e), &fp);
  } catch (const Error& e) {
    fail(seq, e, &fp);
  }
  std::vector<std::int64_t> all(kFpWords * n);
  inner_->copy_to_host(all.data(), base + row, row * n);
  std::vector<std::optional<RankState>> states(n);
  bool differ = false;
  for (int r = 0; r < n; ++r) {
    const std::int64_t* w = &all[kFpWords * r];
    Fingerprint f;
    f.op = w[1] >= 0 && w[1] < static_cast<std::int64_t>(std::size(kOps)) ? kOps[w[1]] : "?";
    if (w[2] >= 0) f.dtype = std::string(dtype_name(static_cast<DType>(w[2])));
    f.count = static_cast<std::uint64_t>(w[3]);
    f.root = static_cast<int>(w[4]);
    if (w[5] >= 0) f.reduce_op = std::string(reduce_op_name(static_cast<ReduceOp>(w[5])));
    RankState s;
    s.rank = r;
    s.last_started = w[0];
    s.last_completed = w[0] - 1;
    s.recent.push_back({w[0], f, 0, -1, "checked"});
    if (w[0] != seq || !(f == fp)) differ = true;
    states[r] = std::move(s);
  }
  if (!differ) return;
  Diagnosis d = diagnose(states);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    nlohmann::json ranks = nlohmann::json::array();
    for (auto& s : states) ranks.push_back(to_json(*s));
    failure_report_ = {{"diagnosis", d.to_json()}, {"ranks", ranks},
                       {"cause", "--desync-check: fingerprints differ before the collective ran"},
                       {"detected_by", "desync_check"}};
  }
  // The peer is a rank on the other side of the disagreement from this one.
  int peer = -1;
  if (!d.mismatches.empty() && d.mismatches.front().groups.size() > 1) {
    const auto& g = d.mismatches.front().groups;
    peer = g[1].second.front();
    if (std::find(g[1].second.begin(), g[1].second.end(), rank()) != g[1].second.end())
      peer = g[0].second.front();
  }
  PeerError err(fmt::format("collective #{} on rank {}: the ranks disagree on the collective "
                            "(--desync-check). {}",
                            seq, rank(), d.summary()),
                ErrorContext{fp.op, rank(), peer,
                             "every rank must issue the same collectives in the same order with "
                             "the same dtype, count and root; the named rank took a different "
                             "code path"});
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_ = std::make_exception_ptr(err);
  }
  halt();
  throw err;
}

void MonitoredCommunicator::fail(std::int64_t seq, const Error& cause, const Fingerprint* fp) {
  std::lock_guard<std::mutex> guard(fail_mutex_);
  // The collective that is stuck on this rank is the first one not done:
  // a rank that queued more waits on a later one, which runs after it.
  std::int64_t stuck = seq;
  std::optional<Fingerprint> stuck_fp;
  if (fp) stuck_fp = *fp;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    if (Entry* e = recorded(seq); e && e->rec.state == "started") e->rec.state = "failed";
    if (seq == 0 && fp && !failed_p2p_) failed_p2p_ = *fp;
    const std::int64_t first_open = completed_.load() + 1;
    if (seq > 0 && first_open > 0 && first_open < seq)
      if (const Open* o = open_at(first_open)) {
        stuck = first_open;
        stuck_fp = o->fp;
      }
  }
  // One numbering in what users read: the monitor's collective number. The
  // backend's own op counter ("allreduce #6") is dropped from its text.
  const std::string where =
      (seq > 0 ? fmt::format("collective #{}", stuck) : std::string("a point-to-point op")) +
      (stuck_fp ? " " + stuck_fp->describe() : std::string());
  std::string cause_text =
      seq > 0 ? without_backend_op_numbers(cause.what()) : std::string(cause.what());
  if (stuck != seq)
    cause_text += fmt::format(" (waiting for collective #{}, which runs after it)", seq);
  {
    // The op failed because the watchdog stopped the communicator: say why.
    std::lock_guard<std::mutex> lock(mutex_);
    if (!halt_reason_.empty() && cause_text.find("aborted") != std::string::npos)
      cause_text += "; the watchdog stopped it: " + halt_reason_;
  }
  const std::string what = fmt::format("rank {}: {}: {}", rank(), where, cause_text);
  // The backend says a peer's host closed or reset the connection: that
  // host answered, so its network is up.
  const std::string said = cause.what();
  bool peer_reset = said.find("reset by peer") != std::string::npos ||
                    said.find("closed by peer") != std::string::npos ||
                    said.find("Connection closed") != std::string::npos;
  const int closed_by = cause.context().peer;
  // Published with the state: a rank the alarm stops before it meets the
  // reset itself learns it from here.
  if (peer_reset && closed_by >= 0 && closed_by != rank() && closed_by < size())
    reset_by_ = closed_by;
  publish(what);
  raise_alarm(what);
  alarm_seen_ = true;
  halt();
  std::vector<Heartbeat> heartbeats;
  auto states = gather_states(heartbeats);
  const bool store_lost = store_lost_.load();
  std::string store_error;
  bool store_timed_out = false;
  Clock::time_point store_lost_since;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    store_error = store_error_;
    store_timed_out = store_timed_out_;
    store_lost_since = store_lost_since_;
  }
  Diagnosis d;
  long store_host_gone = 0;     // pid of the store's host rank, when its process is gone
  long store_host_stopped = 0;  // its pid, when its process is stopped (SIGSTOP, a debugger)
  // The same for a store's host rank on another machine, by how its host
  // answers on the store's port: refused (the process is gone) or accepted
  // with the store silent (the process is frozen).
  bool store_host_remote = false;
  // Unless the rank that closed it published its state: that rank is alive,
  // and closed its connections as it stopped (it raised or saw the alarm
  // before this rank's watchdog did), which says nothing of the silent ones.
  if (const int by = reset_by_; by >= 0 && states[by]) peer_reset = false;
  // Which silent ranks' hosts closed or reset a connection to another
  // rank, by what that rank published with its state (this rank's own
  // error, peer_reset, counts for every silent rank).
  std::vector<bool> reset(states.size(), false);
  for (const auto& s : states)
    if (s && s->rank != rank() && s->reset_by >= 0 && s->reset_by < static_cast<int>(reset.size()) &&
        !states[s->reset_by])
      reset[s->reset_by] = true;

  // Every silent rank's host answers on the network: the processes, not
  // the network, are to blame.
  bool all_gone_silent = false;
  if (store_lost) {
    std::vector<std::string> hosts;
    std::vector<bool> same_machine;
    for (const auto& p : opts_.peers) {
      hosts.push_back(p.host);
      same_machine.push_back(p.same_machine);
    }
    // The rank that hosted the store runs on this machine and its process
    // is gone: the store went with it, and no network is to blame.
    // Stopped instead (SIGSTOP, a debugger): the store lives in a process
    // that does not run, and cannot answer until it is resumed.
    const int host = opts_.store_host_rank;
    if (host >= 0 && host != rank() && host < static_cast<int>(opts_.peers.size()) &&
        opts_.peers[host].same_machine && opts_.peers[host].pid > 0) {
      const char st = process_state(opts_.peers[host].pid);
      if (gone_state(st))
        store_host_gone = opts_.peers[host].pid;
      else if (stopped_state(st))
        store_host_stopped = opts_.peers[host].pid;
    } else if (host >= 0 && host != rank() && host < static_cast<int>(opts_.peers.size()) &&
               opts_.peers[host].pid > 0) {
      // Frozen only on the watchdog's kind of evidence: the store silent
      // for a while (half the heartbeat stall; the rank whose watchdog
      // named it first lost it at about the same time), not for one call
      // that ran out of time (a slow store).
      const PortReach port = tcp_port_probe(opts_.store_address, Millis(1000));
      const bool silent_long = opts_.heartbeat_stall.count() > 0 && store_timed_out &&
                               Clock::now() - store_lost_since >= opts_.heartbeat_stall / 2;
      if (port == PortReach::kRefused) {
        store_host_gone = opts_.peers[host].pid;
        store_host_remote = true;
      } else if (port == PortReach::kAccepts && silent_long) {
        store_host_stopped = opts_.peers[host].pid;
        store_host_remote = true;
      }
    }
    d = diagnose_store_unreachable(*states[rank()], size(), opts_.store_address, store_error,
                                   hosts, same_machine,
                                   store_host_gone || store_host_stopped ? host : -1);
    const std::string on_host = host >= 0 && host < static_cast<int>(opts_.peers.size())
                                    ? opts_.peers[host].host
                                    : std::string();
    if (store_host_gone && store_host_remote)
      d.lines.insert(d.lines.begin(),
                     fmt::format("Rank {} (host {}, pid {}), which hosted the store, has ended: "
                                 "its host refuses connections to the store's port {}, so that "
                                 "host and the network are up and the process is gone (after an "
                                 "error of its own, or a crash or kill), and the store with it.",
                                 host, on_host, store_host_gone, opts_.store_address));
    else if (store_host_stopped && store_host_remote)
      d.lines.insert(d.lines.begin(),
                     fmt::format("Rank {} (host {}, pid {}), which hosts the store, is frozen: its "
                                 "host accepts connections to the store's port {}, but the store "
                                 "in its process has not answered for {:.0f} s: that process does "
                                 "not run (SIGSTOP, a debugger, a machine swapping), or its store "
                                 "is stuck.",
                                 host, on_host, store_host_stopped, opts_.store_address,
                                 std::chrono::duration<double>(Clock::now() - store_lost_since).count()));
    else if (store_host_gone)
      d.lines.insert(d.lines.begin(),
                     fmt::format("Rank {} (pid {} on this machine), which hosted the store, has "
                                 "ended: its process is gone, and the store with it.",
                                 host, store_host_gone));
    else if (store_host_stopped)
      d.lines.insert(d.lines.begin(),
                     fmt::format("Rank {} (pid {} on this machine), which hosts the store, is "
                                 "stopped: its process exists but does not run (SIGSTOP or a "
                                 "debugger), so the store in it cannot answer.",
                                 host, store_host_stopped));
  } else {
    std::vector<int> unreachable, silent;
    GoneNotes notes = gone_notes(states, heartbeats, unreachable, silent, peer_reset, reset);
    d = diagnose(states, notes);
    d.unreachable = std::move(unreachable);
    all_gone_silent = !d.gone.empty() && std::all_of(d.gone.begin(), d.gone.end(), [&](int r) {
      return std::find(silent.begin(), silent.end(), r) != silent.end();
    });
  }

  std::string hint;
  int peer = cause.context().peer;
  const std::string store_host_name =
      opts_.store_host_rank >= 0 && opts_.store_host_rank < static_cast<int>(opts_.peers.size())
          ? opts_.peers[opts_.store_host_rank].host
          : std::string();
  if (store_lost && store_host_gone > 0 && store_host_remote) {
    peer = opts_.store_host_rank;
    hint = fmt::format("look at rank {}'s log and report (its own error), and, if it has none, at "
                       "the kernel log on {} (dmesg: the OOM killer?): its process ended, and the "
                       "job's store lived in it",
                       opts_.store_host_rank, store_host_name);
  } else if (store_lost && store_host_stopped > 0 && store_host_remote) {
    peer = opts_.store_host_rank;
    hint = fmt::format("look at rank {}'s process (pid {}) on {}: ps state T is stopped (kill "
                       "-CONT {} resumes it), or a debugger holds it, or the machine swaps; the "
                       "job's store lives in its process, so every rank waits on it",
                       opts_.store_host_rank, store_host_stopped, store_host_name, store_host_stopped);
  } else if (store_lost && store_host_gone > 0) {
    peer = opts_.store_host_rank;
    hint = fmt::format("look at rank {}'s log and report: it died or was killed (the OOM "
                       "killer? dmesg says), and the job's store lived in its process",
                       opts_.store_host_rank);
  } else if (store_lost && store_host_stopped > 0) {
    peer = opts_.store_host_rank;
    hint = fmt::format("resume rank {} (kill -CONT {}) or detach its debugger; the job's store "
                       "lives in its process, so every rank waits on it while it is stopped",
                       opts_.store_host_rank, store_host_stopped);
  } else if (store_lost) {
    peer = -1;
    hint = fmt::format("this rank can reach neither the store at {} nor its peers: check this "
                       "host's network link (ip link, cable, switch port) and firewall, and "
                       "whether the store's host is up; the reports of the other ranks say "
                       "which side was cut off",
                       opts_.store_address);
  } else if (!d.unreachable.empty()) {
    peer = d.unreachable.front();
    std::vector<std::string> hosts;
    for (int r : d.unreachable)
      if (r < static_cast<int>(opts_.peers.size()) &&
          std::find(hosts.begin(), hosts.end(), opts_.peers[r].host) == hosts.end())
        hosts.push_back(opts_.peers[r].host);
    std::string on;
    for (std::size_t i = 0; i < hosts.size(); ++i) on += (i ? ", " : "") + hosts[i];
    hint = fmt::format("{} {} unreachable{}: check that host's network link (ip link, cable, "
                       "switch port), the firewall between the hosts, and whether the host is "
                       "up (dmesg, its own ddpdiag report)",
                       d.unreachable.size() == 1 ? "rank " + rank_list(d.unreachable)
                                                 : "ranks " + rank_list(d.unreachable),
                       d.unreachable.size() == 1 ? "is" : "are",
                       on.empty() ? std::string() : " (host " + on + ")");
  } else if (all_gone_silent) {
    peer = d.gone.front();
    hint = fmt::format("look at the process of {}{} on its host (ps: state T is stopped; a "
                       "debugger; swapping) and at its log: its host is up and reachable",
                       d.gone.size() == 1 ? "rank " : "ranks ", rank_list(d.gone));
  } else if (!d.gone.empty() &&
             (peer_reset || std::any_of(d.gone.begin(), d.gone.end(), [&](int r) {
               return r < static_cast<int>(reset.size()) && reset[r];
             }))) {
    peer = d.gone.front();
    hint = fmt::format("look at the log of {}{} and at its host's kernel log (dmesg): its process "
                       "ended, by a crash or a kill (the OOM killer?), while its host stayed up",
                       d.gone.size() == 1 ? "rank " : "ranks ", rank_list(d.gone));
  } else if (!d.gone.empty()) {
    peer = d.gone.front();
    hint = fmt::format("look at the log and host of {}{}: it died, was killed (OOM killer?), was "
                       "stopped or lost its network",
                       d.gone.size() == 1 ? "rank " : "ranks ", rank_list(d.gone));
  } else if (!d.stalled_pairs.empty()) {
    // The kernel says a link drops the data: whatever else the states show
    // (a rank whose queued collectives cannot complete looks behind) follows
    // from it.
    auto [a, b] = d.stalled_pairs.front();
    for (const auto& pr : d.stalled_pairs)
      if (pr.first == rank() || pr.second == rank()) std::tie(a, b) = pr;
    peer = a == rank() ? b : a;
    const auto host_of = [&](int r) {
      return r >= 0 && r < static_cast<int>(opts_.peers.size()) && !opts_.peers[r].host.empty()
                 ? " (host " + opts_.peers[r].host + ")"
                 : std::string();
    };
    hint = fmt::format("check the route, cable, switch port and firewall between {} (`ip route "
                       "get`, `ip -s link` on both hosts); `ddpdiag link-health` measures every "
                       "pair of ranks",
                       b >= 0 ? fmt::format("rank {}{} and rank {}{}", a, host_of(a), b, host_of(b))
                              : fmt::format("rank {}{} and the peer it names", a, host_of(a)));
  } else if (d.desync()) {
    const auto& g = d.mismatches.front().groups;
    if (g.size() > 1) {
      peer = g[1].second.front();
      if (std::find(g[1].second.begin(), g[1].second.end(), rank()) != g[1].second.end())
        peer = g[0].second.front();
    }
    hint = "every rank must issue the same collectives in the same order with the same dtype, "
           "count and root; the minority rank took a different code path";
  } else if (!d.behind.empty()) {
    peer = d.behind.front();
    hint = fmt::format("{} stopped issuing collectives: see what it does between collectives "
                       "(data loading, a deadlock, a branch the others did not take); rerun "
                       "with --desync-check to catch skipped calls at once",
                       d.behind.size() == 1 ? "rank " + rank_list(d.behind)
                                            : "ranks " + rank_list(d.behind));
  } else {
    hint = "every rank is in the same collective: check the network between the hosts "
           "(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, firewall), or raise --timeout if it is "
           "only slow";
  }
  // The peer is another rank: a rank that is itself the one behind (or in
  // the minority of a desync) names none.
  if (peer == rank()) peer = -1;
  std::string msg = fmt::format("{} did not complete on rank {}: {}. Watchdog: {}", where, rank(),
                                cause_text, d.summary());
  std::string phase = stuck_fp ? stuck_fp->op : cause.context().phase;
  if (phase.empty()) phase = "collective";
  ErrorContext ctx{phase, rank(), peer, hint};
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& s : states)
    if (s) ranks.push_back(to_json(*s));
  const nlohmann::json recorder = to_json(state(""))["flight_recorder"];
  std::exception_ptr ep;
  if (!d.gone.empty()) ep = std::make_exception_ptr(PeerError(msg, ctx));
  else ep = std::make_exception_ptr(TimeoutError(msg, ctx));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    failure_report_ = {{"diagnosis", d.to_json()},
                       {"ranks", ranks},
                       {"cause", where + ": " + cause_text},
                       {"detected_by", "watchdog"},
                       {"flight_recorder", recorder},
                       {"store", {{"address", opts_.store_address},
                                  {"reachable", !store_lost},
                                  {"error", store_error}}}};
    failure_ = ep;
  }
  std::rethrow_exception(ep);
}

std::string MonitoredCommunicator::stalled_peer(std::int64_t key, const std::vector<int>& watched,
                                                const std::function<std::string()>& what) {
  const auto now = Clock::now();
  if (key != hb_watch_key_) {
    hb_watch_key_ = key;
    hb_count_.assign(size(), -2);
    hb_since_.assign(size(), now);
    hb_next_read_ = now;
    hb_cursor_ = 0;
  }
  if (now < hb_next_read_ || watched.empty()) return "";
  hb_next_read_ = now + std::max(opts_.poll_interval, Millis(1000));
  // A sweep takes at most 200 ms of this thread, which also writes this
  // rank's heartbeat: where the store is slow or the world large, the next
  // sweep goes on from where this one stopped.
  const auto sweep_end = now + Millis(200);
  const int n = static_cast<int>(watched.size());
  for (int i = 0; i < n; ++i) {
    const int at = (hb_cursor_ + i) % n;
    const int r = watched[at];
    if (Clock::now() >= sweep_end) {
      hb_cursor_ = at;
      hb_next_read_ = now;  // the rest at the next poll
      return "";
    }
    const std::string hb_key = fmt::format("heartbeat/{}", r);
    std::int64_t count = -1;
    if (opts_.store->check({hb_key})) {
      auto j = nlohmann::json::parse(to_string(opts_.store->get(hb_key, Millis(1000))), nullptr,
                                     false);
      if (j.is_object()) count = j.value("n", -1L);
    }
    const auto read_at = Clock::now();
    if (count != hb_count_[r]) {
      hb_count_[r] = count;
      hb_since_[r] = read_at;
      continue;
    }
    if (read_at - hb_since_[r] < opts_.heartbeat_stall) continue;
    const auto& p = opts_.peers[r];
    return fmt::format("{} cannot complete: rank {} (pid {} on host {}) {} for "
                       "{:.0f} s (it is dead, frozen, or cut off from the store)",
                       what(), r, p.pid, p.host,
                       count < 0 ? "wrote no heartbeat" : "wrote no new heartbeat",
                       std::chrono::duration<double>(read_at - hb_since_[r]).count());
  }
  hb_cursor_ = 0;
  return "";
}

std::string MonitoredCommunicator::local_peer_problem(int r, std::chrono::steady_clock::time_point now) {
  if (r == rank() || r < 0 || r >= static_cast<int>(opts_.peers.size())) return "";
  const auto& p = opts_.peers[r];
  if (!p.same_machine || p.pid <= 0) return "";
  if (stopped_since_.size() != opts_.peers.size()) {
    stopped_since_.assign(opts_.peers.size(), {});
    stopped_seen_.assign(opts_.peers.size(), {});
  }
  const char st = process_state(p.pid);
  if (gone_state(st)) return "has ended";
  if (!stopped_state(st) || opts_.heartbeat_stall.count() <= 0) {
    stopped_since_[r].reset();
    return "";
  }
  // A stop counts from when it was first seen in an unbroken run of looks:
  // a rank looked at only while an op is open may have run (and been
  // stopped again: a debugger's next breakpoint) in between.
  if (!stopped_since_[r] || now - stopped_seen_[r] > 3 * opts_.poll_interval)
    stopped_since_[r] = now;
  stopped_seen_[r] = now;
  const auto stopped = now - *stopped_since_[r];
  if (stopped < opts_.heartbeat_stall) return "";
  return fmt::format("has been stopped for {:.0f} s (state {}: SIGSTOP, or a debugger)",
                     std::chrono::duration<double>(stopped).count(), st);
}

std::string MonitoredCommunicator::remote_store_host_problem(Clock::time_point now) {
  const int h = opts_.store_host_rank;
  if (opts_.heartbeat_stall.count() <= 0 || h < 0 || h == rank() ||
      h >= static_cast<int>(opts_.peers.size()) || opts_.peers[h].same_machine || opts_.peers[h].pid <= 0)
    return "";
  bool timed_out = false;
  Clock::time_point since;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    timed_out = store_timed_out_;
    since = store_lost_since_;
  }
  if (now - since < opts_.heartbeat_stall) return "";
  const auto& p = opts_.peers[h];
  switch (tcp_port_probe(opts_.store_address, Millis(500))) {
    case PortReach::kRefused:
      return fmt::format("rank {} (host {}, pid {}), which hosts the store, has ended: its host "
                         "refuses connections to the store's port {}",
                         h, p.host, p.pid, opts_.store_address);
    case PortReach::kAccepts:
      if (!timed_out) return "";
      return fmt::format("rank {} (host {}, pid {}), which hosts the store, has not answered for "
                         "{:.0f} s though its host accepts connections to the store's port {}: "
                         "its process is frozen (SIGSTOP, a debugger, a machine swapping) or its "
                         "store is stuck",
                         h, p.host, p.pid, std::chrono::duration<double>(now - since).count(),
                         opts_.store_address);
    default:
      return "";
  }
}

bool MonitoredCommunicator::store_host_here_silent() const {
  // Its kernel still accepts connections for a stopped process, so a retry
  // would hold this thread for the store's deadline each time, and the
  // watch of that rank's stop (looked at every poll) would start over.
  const int h = opts_.store_host_rank;
  if (h < 0 || h == rank() || h >= static_cast<int>(opts_.peers.size())) return false;
  const auto& p = opts_.peers[h];
  if (!p.same_machine || p.pid <= 0) return false;
  const char st = process_state(p.pid);
  return gone_state(st) || stopped_state(st);
}

void MonitoredCommunicator::watchdog_loop() {
  while (true) {
    bool failed = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      failed = failure_ != nullptr;
    }
    if (!failed && !store_lost_) {
      try {
        write_heartbeat();
      } catch (const Error& e) {
        note_store_lost(e);
        store_retry_at_ = Clock::now() + kStoreRetry;
      }
    } else if (!failed && Clock::now() >= store_retry_at_ && !store_host_here_silent()) {
      // One failed store call (a stall longer than the store deadline) must
      // not silence this rank's heartbeat for good: its peers would take it
      // for dead. The client reconnects; once the store answers again, it
      // is no longer lost.
      store_retry_at_ = Clock::now() + kStoreRetry;
      // Only where the store's host answers at once: a reconnect to a host
      // that is gone would hold this thread (and the exit that joins it)
      // for the connect's deadline.
      try {
        if (tcp_probe(opts_.store_address, Millis(500)) == TcpReach::kAnswers) {
          write_heartbeat();
          std::lock_guard<std::mutex> lock(mutex_);
          store_lost_ = false;
          store_error_.clear();
          store_timed_out_ = false;
        }
      } catch (const Error&) {
      }
    }
    {
      std::unique_lock<std::mutex> lock(wd_mutex_);
      wd_cv_.wait_for(lock, opts_.poll_interval, [&] { return stop_.load(); });
      if (stop_) return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failure_) continue;
    }
    // Completion of ops nobody waits for yet; then the oldest still open.
    bool overdue = false;
    std::string overdue_what;
    std::int64_t watch_seq = -1;  // the oldest collective, open for a while
    // Else the oldest point-to-point op open for a while with a peer on
    // another machine: its id and what it is.
    std::optional<OpenP2P> watch_p2p;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto now = Clock::now();
      finish_prefix(now);
      // A grace of one poll over the deadline: the waiting thread, if any,
      // reports first with its own wording.
      if (!open_.empty() &&
          now - std::max(open_.front().started, prefix_advanced_) > timeout_ + 2 * opts_.poll_interval) {
        const Open& o = open_.front();
        overdue = true;
        overdue_what = fmt::format("collective #{} {} outstanding for more than {} ms", o.seq,
                                   o.fp.describe(), timeout_.count());
      } else if (!open_.empty() && now - open_.front().started > 2 * opts_.poll_interval) {
        // A peer on this machine whose process is gone (killed: the OOM
        // killer's SIGKILL) ends the collective now: its backend may only
        // notice at the deadline (a connection closed rather than reset).
        // So does one stopped (SIGSTOP, a debugger) for the heartbeat stall,
        // as a silent rank on another machine does.
        const Open& o = open_.front();
        for (int r = 0; r < static_cast<int>(opts_.peers.size()); ++r) {
          const std::string problem = local_peer_problem(r, now);
          if (problem.empty()) continue;
          overdue = true;
          overdue_what = fmt::format("collective #{} {} cannot complete: rank {} (pid {} on this "
                                     "machine) {}",
                                     o.seq, o.fp.describe(), r, opts_.peers[r].pid, problem);
          break;
        }
        if (!overdue) watch_seq = o.seq;
      }
      if (!overdue && watch_seq < 0 && opts_.heartbeat_stall.count() > 0) {
        prune_p2p();
        if (!p2p_open_.empty() && now - p2p_open_.front().started > 2 * opts_.poll_interval) {
          watch_p2p = p2p_open_.front();
          for (int r : watch_p2p->peers) {
            const std::string problem = local_peer_problem(r, now);
            if (problem.empty()) continue;
            overdue = true;
            overdue_what = fmt::format("point-to-point op {} cannot complete: rank {} (pid {} on "
                                       "this machine) {}",
                                       watch_p2p->fp.describe(), r, opts_.peers[r].pid, problem);
            watch_p2p.reset();
            break;
          }
        }
      }
    }
    if (store_lost_) {
      // What this machine tells without the store still ends the op: a peer
      // here whose process is gone or stopped (the rank that hosted the
      // store, most often: it took the store with it), or an op past its
      // deadline. No alarm can be raised; each rank's own watchdog sees it.
      if (overdue && !alarm_seen_) {
        alarm_seen_ = true;
        note_halt_reason(fmt::format("rank {}: {}", rank(), overdue_what));
        halt();
        continue;
      }
      // Nothing more to learn from a store that is gone, but where it went:
      // its rank's host answers for it on the store's port. A store that
      // lives in a frozen rank leaves no heartbeat to watch, so this is how
      // the other hosts' ranks tell it before the deadline.
      if (!overdue && watch_seq >= 0 && !alarm_seen_) {
        const std::string problem = remote_store_host_problem(Clock::now());
        if (!problem.empty()) {
          std::string op = "?";
          {
            std::lock_guard<std::mutex> lock(mutex_);
            if (const Open* o = open_at(watch_seq)) op = o->fp.describe();
          }
          alarm_seen_ = true;
          note_halt_reason(fmt::format("rank {}: collective #{} {} cannot complete: {}", rank(),
                                       watch_seq, op, problem));
          halt();
        }
      }
      continue;
    }
    try {
      if (!overdue && watch_seq >= 0 && opts_.heartbeat_stall.count() > 0 && !alarm_seen_) {
        // Rank 0 watches every rank on another machine, the others watch
        // rank 0: one rank's alarm stops them all, and the store serves n
        // reads a second, not n^2.
        std::vector<int> watched;
        for (int r = 0; r < size(); ++r)
          if (r != rank() && r < static_cast<int>(opts_.peers.size()) &&
              !opts_.peers[r].same_machine && (rank() == 0 || r == 0))
            watched.push_back(r);
        overdue_what = stalled_peer(watch_seq, watched, [&] {
          std::string op = "?";
          std::lock_guard<std::mutex> lock(mutex_);
          if (const Open* o = open_at(watch_seq)) op = o->fp.describe();
          return fmt::format("collective #{} {}", watch_seq, op);
        });
        overdue = !overdue_what.empty();
      } else if (!overdue && watch_p2p && !alarm_seen_) {
        // The op's own peers on other machines: a rank blocked on a frozen
        // partner is the only one that can tell (the others may wait in a
        // collective whose watch sees every heartbeat move).
        std::vector<int> watched;
        for (int r : watch_p2p->peers)
          if (r != rank() && r >= 0 && r < size() && r < static_cast<int>(opts_.peers.size()) &&
              !opts_.peers[r].same_machine &&
              std::find(watched.begin(), watched.end(), r) == watched.end())
            watched.push_back(r);
        overdue_what = stalled_peer(-watch_p2p->id, watched, [&] {
          return "point-to-point op " + watch_p2p->fp.describe();
        });
        overdue = !overdue_what.empty();
      }
      if (!alarm_seen_ && opts_.store->check({"alarm"})) {
        alarm_seen_ = true;
        std::string why = to_string(opts_.store->get("alarm", Millis(1000)));
        publish("alarm raised by " + why);
        note_halt_reason("an alarm raised by " + why);
        halt();
      } else if (overdue && !alarm_seen_) {
        const std::string what = fmt::format("rank {}: {}", rank(), overdue_what);
        publish(what);
        raise_alarm(what);
        alarm_seen_ = true;
        note_halt_reason(what);
        halt();
      }
    } catch (const Error& e) {
      note_store_lost(e);
    }
  }
}

}  // namespace ddpdiag
