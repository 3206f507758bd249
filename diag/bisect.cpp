#include "diag/bisect.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <cstdio>
#include <thread>

#include <fmt/core.h>

#include "comm/group.h"
#include "comm/monitored_communicator.h"

namespace ddpdiag::cli {

namespace {

using Clock = std::chrono::steady_clock;

// One group's test on one member: init, warm-up, timed all_reduces, then a
// checked one. Inputs are rank+1 so the sum is exact in float.
GroupOutcome test_group(Job& job, const std::vector<Fault>& faults, const BisectGroup& g,
                        const BisectOptions& bo,
                        std::unique_ptr<Communicator> split, const std::string& name) {
  GroupOutcome out;
  out.group = g;
  out.ran = true;
  try {
    auto inner = split ? std::move(split)
                       : make_group_communicator(job.comm_options, g.ranks, name);
    inner->set_default_timeout(job.timeout);
    MonitorOptions mo;  // no store: faults only, no watchdog
    mo.rank = inner->rank();
    mo.world_rank = job.rank();
    mo.size = inner->size();
    mo.timeout = job.timeout;
    for (const auto& f : faults)
      if (f.kind == Fault::Kind::kSlow || f.kind == Fault::Kind::kCorrupt) mo.faults.push_back(f);
    MonitoredCommunicator comm(std::move(inner), mo);
    const std::size_t count = std::max<std::size_t>(bo.bytes / sizeof(float), 1);
    CommBuffer buf(comm, count * sizeof(float));
    std::vector<float> host(count, static_cast<float>(job.rank() + 1));
    comm.copy_from_host(buf.get(), host.data(), count * sizeof(float));
    for (int i = 0; i < bo.warmup; ++i)
      comm.allreduce(buf.get(), buf.get(), count, DType::kFloat32, ReduceOp::kSum)
          ->wait(job.timeout);
    // Each call timed on its own and the median kept: a fault (or a bad
    // link) slows every call, while a preemption on a loaded machine slows
    // one, and a mean would let one 4 ms scheduler tick mark a healthy
    // group slow.
    std::vector<double> per_call;
    per_call.reserve(static_cast<std::size_t>(std::max(bo.iters, 1)));
    for (int i = 0; i < std::max(bo.iters, 1); ++i) {
      const auto t0 = Clock::now();
      comm.allreduce(buf.get(), buf.get(), count, DType::kFloat32, ReduceOp::kSum)
          ->wait(job.timeout);
      per_call.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    std::nth_element(per_call.begin(), per_call.begin() + per_call.size() / 2, per_call.end());
    out.time_us = per_call[per_call.size() / 2];
    comm.copy_from_host(buf.get(), host.data(), count * sizeof(float));
    comm.allreduce(buf.get(), buf.get(), count, DType::kFloat32, ReduceOp::kSum)
        ->wait(job.timeout);
    comm.copy_to_host(host.data(), buf.get(), count * sizeof(float));
    float expect = 0;
    for (int r : g.ranks) expect += static_cast<float>(r + 1);
    for (float v : host) out.wrong += v != expect;
  } catch (const Error& e) {
    out.error = e.what();
  }
  return out;
}

}  // namespace

nlohmann::json run_bisect(Job& job, const CommonOptions& o, const BisectOptions& bo,
                          reports::Report& report) {
  std::vector<std::string> hosts(job.size());
  for (const auto& r : job.ranks)
    if (r.rank >= 0 && r.rank < job.size()) hosts[r.rank] = r.host;
  const auto groups = plan_bisect(hosts);
  std::vector<Fault> faults;
  if (!o.inject_fault.empty()) faults = parse_faults(o.inject_fault);
  // A fresh key space per call: init-check and allreduce-test may both run it.
  const std::string base = fmt::format("bisect/{}", job.store->add("bisect/runs", 0));
  // stdout gets the whole block from print_bisect, where the command puts it.
  job.progress_line(fmt::format("[progress] bisect: {} sub-group(s) of {} rank(s)", groups.size(), job.size()));
  // NCCL: sub-groups are split off the world communicator (ncclCommSplit,
  // every rank taking part, members with color 0) while it is healthy; once
  // a split fails on this rank, or on a backend without split (Gloo), each
  // group is a fresh communicator over the store (Gloo sub-contexts), which
  // does not need a healthy parent.
  // Whether to split is decided by every rank together: a rank whose world
  // communicator was aborted (a phase of init-check failed there only) cannot
  // split, and the others would wait in ncclCommSplit, a collective of the
  // whole world, for it until --timeout.
  // store_barrier: every rank, members of a group or not, counts itself in at
  // `key` and waits for the others (2 x --timeout + 5 s); `what` says what
  // they did not all finish in time.
  auto store_barrier = [&](const std::string& key, const std::string& what) {
    job.store->add(key, 1);
    const auto deadline = Clock::now() + 2 * job.timeout + Millis(5000);
    while (job.store->add(key, 0) < job.size()) {
      if (Clock::now() >= deadline)
        throw TimeoutError(fmt::format("bisect: not every rank {} in time", what),
                           {"bisect", job.rank(), -1, "a rank is gone or stuck; see the other ranks' logs"});
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  // all_agree: true when every rank said `mine` is true (one store round).
  auto all_agree = [&](const std::string& key, bool mine) {
    if (mine) job.store->add(key + "/yes", 1);
    store_barrier(key + "/votes", fmt::format("said whether it can split ({})", key));
    return job.store->add(key + "/yes", 0) == job.size();
  };
  bool try_split = job.comm && job.comm->can_split();
  // Only NCCL splits; the backend is the same on every rank.
  if (job.backend == Backend::kNccl) try_split = all_agree(base + "/can_split", try_split);
  // Tests groups[i] for each i in `which`, in that order, every rank taking
  // part; returns the merged outcomes on rank 0 (empty elsewhere).
  auto run_pass = [&](const std::vector<std::size_t>& which, const std::string& pass) {
    std::vector<GroupOutcome> merged_all;
    for (std::size_t i : which) {
      const auto& g = groups[i];
      const bool member = std::find(g.ranks.begin(), g.ranks.end(), job.rank()) != g.ranks.end();
      const std::string key = fmt::format("{}/{}{}", base, pass, i);
      std::unique_ptr<Communicator> split;
      if (try_split) {
        bool split_ok = true;
        try {
          split = job.comm->split(member ? 0 : -1, job.rank(), job.timeout);
        } catch (const Error& e) {
          split_ok = false;
          std::fprintf(stderr,
                       "[rank %d] bisect: splitting the world communicator failed (%s); this "
                       "and the remaining sub-groups are created over the store\n",
                       job.rank(), e.what());
        }
        // One rank's failed split sends every rank to the store's groups, so
        // that no member waits in a split communicator its peers left.
        if (!all_agree(key + "/split", split_ok)) {
          if (split_ok)
            std::fprintf(stderr,
                         "[rank %d] bisect: another rank could not split the world communicator; "
                         "this and the remaining sub-groups are created over the store\n",
                         job.rank());
          split.reset();
          try_split = false;
        }
      }
      if (member) {
        // The group's own store keys live under this bisect run's base, so
        // a later run in the same store (a torchrun restart, say) never
        // reads a stale address.
        GroupOutcome mine = test_group(job, faults, g, bo, std::move(split), key);
        job.store->set(fmt::format("{}/result/{}", key, job.rank()),
                       to_bytes(nlohmann::json({{"error", mine.error},
                                                {"wrong", mine.wrong},
                                                {"time_us", mine.time_us}})
                                    .dump()));
      }
      // Barrier: every rank, members or not, before the next group forms.
      store_barrier(key + "/done", fmt::format("finished sub-group {} ({})", i, g.label));
      if (job.rank() != 0) continue;
      GroupOutcome merged;
      merged.group = g;
      merged.ran = true;
      for (int r : g.ranks) {
        auto j = nlohmann::json::parse(
            to_string(job.store->get(fmt::format("{}/result/{}", key, r), job.timeout)), nullptr,
            false);
        if (!j.is_object()) continue;
        std::string err = j.value("error", std::string());
        if (!err.empty() && merged.error.empty()) merged.error = fmt::format("rank {}: {}", r, err);
        merged.wrong += j.value("wrong", std::int64_t{0});
        merged.time_us = std::max(merged.time_us, j.value("time_us", 0.0));
      }
      merged_all.push_back(merged);
    }
    return merged_all;
  };
  std::vector<std::size_t> all(groups.size());
  std::iota(all.begin(), all.end(), std::size_t{0});
  std::vector<GroupOutcome> outcomes = run_pass(all, "");
  // Second look at slowness: a group judged slow is timed once more and
  // keeps the lower of its two times. A slow rank or link is slow both
  // times; a group that only caught a busy moment of a shared machine is
  // not. Rank 0 decides which groups and tells the others through the store
  // (an empty list when none: nothing more runs).
  std::vector<std::size_t> again;
  if (job.rank() == 0) {
    // Not when a group failed outright: slowness is not judged then.
    const bool any_hard =
        std::any_of(outcomes.begin(), outcomes.end(), [](const auto& o) { return o.failed(); });
    if (!any_hard) {
      std::vector<GroupOutcome> first = outcomes;
      judge_bisect(first, hosts);
      for (std::size_t i = 0; i < first.size(); ++i)
        if (first[i].slow) again.push_back(i);
    }
    job.store->set(base + "/again", to_bytes(nlohmann::json(again).dump()));
  } else {
    auto j = nlohmann::json::parse(to_string(job.store->get(base + "/again", job.timeout)),
                                   nullptr, false);
    if (j.is_array())
      for (const auto& x : j)
        if (x.is_number_unsigned() && x.get<std::size_t>() < groups.size())
          again.push_back(x.get<std::size_t>());
  }
  if (!again.empty()) {
    auto second = run_pass(again, "again/");
    for (std::size_t k = 0; k < second.size(); ++k) {
      GroupOutcome& o = outcomes[again[k]];
      const GroupOutcome& t = second[k];
      if (!t.error.empty() && o.error.empty()) o.error = t.error;
      o.wrong += t.wrong;
      if (t.time_us > 0) o.time_us = std::min(o.time_us, t.time_us);
    }
  }
  // Bump the run counter only after everyone read it above.
  if (job.rank() != 0) return nullptr;
  job.store->add("bisect/runs", 1);
  BisectVerdict v = judge_bisect(outcomes, hosts, 3.0, 1000.0, bo.world_passed);
  report.add_check({"bisect",
                    v.smallest_failing ? reports::CheckStatus::kFail : reports::CheckStatus::kPass,
                    v.summary});
  return v.to_json(outcomes);
}

void print_bisect(const nlohmann::json& verdict, int world_size) {
  if (!verdict.is_object()) return;
  if (verdict.contains("groups") && verdict["groups"].is_array()) {
    std::printf("# bisect: %zu sub-group(s) of %d rank(s)\n", verdict["groups"].size(), world_size);
    std::printf("# %-28s %-6s %12s %8s  %s\n", "sub-group", "ranks", "time (us)", "#wrong",
                "verdict");
    for (const auto& g : verdict["groups"]) {
      const std::string error = g.value("error", nlohmann::json()).is_string() ? g["error"].get<std::string>() : "";
      const bool bad = g.value("verdict", std::string()) == "fail";
      std::printf("  %-28s %-6zu %12.1f %8lld  %s%s\n", g.value("label", std::string()).c_str(),
                  g.value("ranks", nlohmann::json::array()).size(), g.value("time_us", 0.0),
                  static_cast<long long>(g.value("wrong", std::int64_t{0})),
                  bad ? (g.value("slow", false) ? "SLOW" : "FAIL") : "ok",
                  error.empty() ? "" : (" (" + error.substr(0, 120) + ")").c_str());
    }
  }
  if (verdict.contains("summary") && verdict["summary"].is_string())
    std::printf("# bisect: %s\n", verdict["summary"].get<std::string>().c_str());
  else if (verdict.contains("error") && verdict["error"].is_string())
    std::printf("# bisect: could not finish: %s\n", verdict["error"].get<std::string>().c_str());
  std::fflush(stdout);
}

}  // namespace ddpdiag::cli
