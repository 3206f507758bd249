#include "comm/gloo/gloo_group.h"

#include <algorithm>

#include "comm/gloo/gloo_communicator.h"

namespace ddpdiag::gloo_backend {

std::unique_ptr<Communicator> make_gloo_group_communicator(const CommOptions& world,
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
  o.store = std::make_shared<PrefixStore>("group/" + name, world.store);
  return make_gloo_communicator(o);
}

}  // namespace ddpdiag::gloo_backend
