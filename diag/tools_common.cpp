#include "diag/tools_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include <fmt/core.h>

#include "comm/store/store.h"

namespace ddpdiag::cli::tools {

TimingBlock time_on_every_rank(Communicator& comm, int iters, int warmup, std::size_t bytes,
                               Millis timeout, const std::function<void()>& op) {
  for (int i = 0; i < warmup; ++i) op();
  comm.barrier()->wait(timeout);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) op();
  const auto t1 = std::chrono::steady_clock::now();
  const double mine =
      std::chrono::duration<double, std::micro>(t1 - t0).count() / std::max(1, iters);
  const auto all = allgather_doubles(comm, {mine}, timeout);
  TimingBlock b;
  double sum = 0;
  b.min_rank_time_us = all.empty() ? mine : all[0];
  b.max_rank_time_us = b.min_rank_time_us;
  for (std::size_t r = 0; r < all.size(); ++r) {
    sum += all[r];
    if (all[r] < b.min_rank_time_us) {
      b.min_rank_time_us = all[r];
      b.fastest_rank = static_cast<int>(r);
    }
    if (all[r] > b.max_rank_time_us) {
      b.max_rank_time_us = all[r];
      b.slowest_rank = static_cast<int>(r);
    }
  }
  b.time_us = all.empty() ? mine : sum / static_cast<double>(all.size());
  b.algbw_gbps = b.time_us > 0 ? static_cast<double>(bytes) / b.time_us / 1e3 : 0;
  b.busbw_gbps = b.algbw_gbps * busbw_factor(Collective::kAllReduce, comm.size());
  b.wrong = -1;
  return b;
}

std::unique_ptr<Communicator> make_extra_communicator(Job& job, const CommonOptions& common,
                                                      const std::string& name, int world_size) {
  if (world_size < 1 || world_size > job.size())
    throw UsageError(fmt::format("world size {} is outside 1..{}", world_size, job.size()),
                     ErrorContext{"flags", job.rank(), -1,
                                  "ask for world sizes up to the job's number of ranks"});
  if (job.rank() >= world_size) return nullptr;
  CommOptions co;
  co.backend = job.backend;
  co.rank = job.rank();
  co.world_size = world_size;
  co.local_rank = job.world.local_rank;
  co.store = std::make_shared<PrefixStore>(name, job.store);
  co.timeout = job.timeout;
  co.gloo_interface = common.gloo_interface;
  co.gloo_threads = common.gloo_threads;
  auto comm = make_communicator(co);
  comm->set_default_timeout(job.timeout);
  return comm;
}

}  // namespace ddpdiag::cli::tools
