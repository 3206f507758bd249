// The pure parts of hang and desync detection: what a collective looks like
// (its fingerprint), what a rank knows about its own progress (its state, with
// a flight recorder of its last collectives), how the states of every rank
// turn into a diagnosis ("rank 1 is behind", "rank 0 runs all_reduce but rank
// 2 runs broadcast", "rank 3 is gone"), and the test-only fault injection
// spec. No I/O here: MonitoredCommunicator (monitored_communicator.h) moves
// the states through the store and calls diagnose().
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/types.h"

namespace ddpdiag {

// What every rank must agree on for one collective: c10d's
// TORCH_DISTRIBUTED_DEBUG=DETAIL compares the same fields.
struct Fingerprint {
  std::string op;          // "all_reduce", "broadcast", "reduce", "all_gather",
                           // "reduce_scatter", "barrier", "send", "recv", "sendrecv"
  std::string dtype;       // dtype_name(), "" for barrier
  std::uint64_t count = 0; // elements (per rank for all_gather / reduce_scatter)
  int root = -1;           // root of broadcast/reduce, peer of send/recv, -1 otherwise
  std::string reduce_op;   // "sum", ... for reductions, "" otherwise

  // "all_reduce(float, 1024, sum)", "broadcast(float, 1024, root=0)", "barrier()".
  std::string describe() const;
  bool operator==(const Fingerprint& o) const = default;
  // Point-to-point ops legitimately differ between ranks (send on one side,
  // recv on the other), so they never count as a desync.
  bool is_collective() const;
};

// One entry of the flight recorder: a collective this rank issued.
struct FlightEntry {
  std::int64_t seq = 0;
  Fingerprint fp;
  double started_s = 0;     // seconds since the monitor started
  double duration_ms = -1;  // -1 while not completed
  std::string state;        // "started", "completed", "failed"
};

// What one rank publishes when a hang or failure is suspected.
struct RankState {
  int rank = 0;
  std::string host;
  long pid = 0;
  std::int64_t last_started = 0;    // sequence number of the last collective issued (0: none)
  std::int64_t last_completed = 0;  // ... of the last one known complete
  std::string reason;               // why it published ("timeout in all_reduce #5", "alarm from rank 0")
  // The peer whose host closed or reset this rank's connection, by the
  // backend's error (-1: none). The host answered, so its network was up:
  // the others read it to call that peer dead, not unreachable, when they
  // were stopped by the alarm before they met the reset themselves.
  int reset_by = -1;
  std::vector<FlightEntry> recent;  // flight recorder, oldest first
  // Point-to-point ops issued and not complete, or failed (they have no
  // sequence number), the failed one first, at most 5: whom this rank waits
  // on.
  std::vector<Fingerprint> open_p2p;
  // Its backend's connections to peers that the network stalls (data
  // unacknowledged, retransmitted) when it published: the link that drops.
  std::vector<StalledLink> stalled_links;

  // The fingerprint of collective `seq` if the recorder still holds it.
  const Fingerprint* at(std::int64_t seq) const;
};

nlohmann::json to_json(const Fingerprint& f);
Fingerprint fingerprint_from_json(const nlohmann::json& j);
nlohmann::json to_json(const RankState& s);
// Throws std::invalid_argument (nlohmann's parse/type errors) on bad input.
RankState rank_state_from_json(const nlohmann::json& j);

// A mismatch: at collective `seq`, ranks run different collectives.
struct Mismatch {
  std::int64_t seq = 0;
  // Ranks grouped by what they run at seq; the largest group first.
  std::vector<std::pair<Fingerprint, std::vector<int>>> groups;
};

struct Diagnosis {
  std::vector<int> gone;       // published no state: dead, stopped or unreachable
  // Of `gone`, those judged unreachable (the caller decides: no heartbeat on
  // the store, or the store itself out of reach from this rank).
  std::vector<int> unreachable;
  std::vector<int> behind;     // issued fewer collectives than the most advanced rank
  std::vector<Mismatch> mismatches;
  // Pairs of ranks (a < b; b = -1 when a's peer is not told apart) whose
  // connection stalls by the kernel's count of unacknowledged data.
  std::vector<std::pair<int, int>> stalled_pairs;
  std::int64_t stuck_seq = 0;  // the first collective not completed everywhere (0: unknown)
  std::vector<std::string> lines;  // one sentence per finding, most telling first
  // One paragraph: lines joined.
  std::string summary() const;
  bool desync() const { return !mismatches.empty(); }
  nlohmann::json to_json() const;
};

// Why a rank that published nothing is gone, when the caller could tell
// (same host: "was killed (process gone)", "is stopped (SIGSTOP)"), indexed by
// rank; empty strings where unknown.
using GoneNotes = std::vector<std::string>;

// states[r] is rank r's state, or nullopt when it published none in time.
Diagnosis diagnose(const std::vector<std::optional<RankState>>& states,
                   const GoneNotes& gone_notes = {});

// The diagnosis of a rank that cannot reach the store: it knows only its own
// state, so every other rank is listed as gone; the ranks on other hosts are
// unreachable from here, and those on this host (`same_machine[r]`) are cut
// off with it, not unreachable. The first line says that the store at
// `store_address` is out of reach (`store_error`: what the store client
// said). `hosts[r]` names rank r's host where known. `ended`: the rank that
// hosted the store, known to have ended or to be frozen (its process on
// this machine, or its host's answer on the store's port), which the
// caller names itself: gone, but neither unreachable nor cut off; the
// ranks on other hosts are then unheard, not unreachable.
Diagnosis diagnose_store_unreachable(const RankState& self, int size,
                                     const std::string& store_address,
                                     const std::string& store_error,
                                     const std::vector<std::string>& hosts = {},
                                     const std::vector<bool>& same_machine = {},
                                     int ended = -1);

// Ranks as "1", "1 and 2", "0, 2 and 3".
std::string rank_list(const std::vector<int>& ranks);

// ---------------------------------------------------------------------------
// Fault injection (tests only; hidden flag --inject-fault). A spec is a list
// separated by ';' of KIND@key=value,...:
//   hang@seq=5,rank=1     rank 1 stalls before issuing collective 5 (until
//                         another rank raises the alarm, or 3 x timeout)
//   skip@seq=3,rank=2     rank 2 does not issue collective 3 (a rank that
//                         skipped a call: its later collectives shift by one)
//   desync@seq=3,rank=1   rank 1 runs broadcast(root=0) instead of
//                         collective 3, which never completes (a rank in a
//                         different collective)
//   exit@seq=4,rank=1     rank 1 is SIGKILLed just before collective 4
//   throw@seq=4,rank=1    a thread of rank 1 throws just before collective 4,
//                         as Gloo's network thread does on a protocol error
//                         (the process ends in std::terminate)
//   slow@rank=2,ms=20     rank 2 adds 20 ms before every collective
//   corrupt@rank=2        rank 2's all_reduce results are off by one (their
//                         first element), and the middle byte of every
//                         point-to-point buffer it receives (recv, sendrecv)
//                         is inverted
//   gather@rank=2         rank 2 fails (an error of its own, posted at the
//                         store) as it hands its results to rank 0, after
//                         its last collective
//   gather-exit@rank=2    rank 2 is SIGKILLed there instead (no error posted)
//   gather-hang@rank=2    rank 2 stops itself there (SIGSTOP: every thread,
//                         its heartbeat too)
// seq is 1-based and counts this communicator's collectives; seq-free kinds
// apply to every collective (corrupt with a seq: collective seq only, and no
// point-to-point op, which has no seq). rank is the world rank.
struct Fault {
  enum class Kind { kHang, kSkip, kDesync, kExit, kThrow, kSlow, kCorrupt, kGather, kGatherExit, kGatherHang };
  Kind kind = Kind::kHang;
  int rank = -1;
  std::int64_t seq = 0;  // 0: every collective (slow, corrupt)
  int ms = 0;            // slow
};
// Throws std::invalid_argument naming the bad part.
std::vector<Fault> parse_faults(const std::string& spec);

}  // namespace ddpdiag
