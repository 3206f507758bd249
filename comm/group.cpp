#include "comm/group.h"

#include <algorithm>

namespace ddpdiag {

std::unique_ptr<Communicator> make_group_communicator(const CommOptions& world,
                                                      const std::vector<int>& ranks,
                                                      const std::string& name) {
  auto it = std::find(ranks.begin(), ranks.end(), world.rank);
  if (it == ranks.end())
    throw UsageError("rank " + std::to_string(world.rank) + " is not a member of group " + name,
                     ErrorContext{"group.init", world.rank, -1,
                                  "only the group's members create its communicator"});
  CommOptions o = world;
  o.rank = static_cast<int>(it - ranks.begin());
  o.world_size = static_cast<int>(ranks.size());
  // NCCL: the device stays the one of this process (local rank), not the
  // group rank.
  if (o.device < 0) o.device = world.local_rank;
  o.store = std::make_shared<PrefixStore>("group/" + name, world.store);
  // The world's watch for a failed peer is about the world's init: a group
  // (bisect tests them after that init failed) waits on its own members only.
  o.peer_failure = nullptr;
  return make_communicator(o);
}

}  // namespace ddpdiag
