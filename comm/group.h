// Sub-groups of the world: a communicator among some of the world's ranks,
// created while the job runs (for bisecting a failure: each host alone, pairs
// of hosts, halves). Gloo: a new context over the job's store under its own
// prefix "group/<name>", so groups can be formed one after another without
// restarting the job (Gloo's counterpart of ncclCommSplit). NCCL: a new communicator whose unique id is
// exchanged through the store under the group's prefix; it does not need a
// healthy parent, which matters when the parent is the thing that failed.
// With a healthy NCCL parent, Communicator::split (ncclCommSplit) is the
// cheaper way, which diag/bisect.cpp tries first.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace ddpdiag {

// world: the options the world communicator was created with. ranks: world
// ranks of the group, ascending or in the order group ranks should take;
// world.rank must be among them. name: unique for the job. The group's
// communicator has rank = index of world.rank in ranks.
std::unique_ptr<Communicator> make_group_communicator(const CommOptions& world,
                                                      const std::vector<int>& ranks,
                                                      const std::string& name);

}  // namespace ddpdiag
