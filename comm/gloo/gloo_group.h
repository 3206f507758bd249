// Sub-groups on the Gloo backend: a new Gloo context among a subset of the
// world's ranks, rendezvousing through the same store under a prefix of its
// own, so any number of groups can be formed one after another without
// restarting the job (the Gloo counterpart of ncclCommSplit).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace ddpdiag::gloo_backend {

// world: the options the world communicator was made with (world rank and
// size, the job's store). ranks: the world ranks of the group, in group-rank
// order; world.rank must be one of them. name: unique per group in the job
// (the store prefix "group/<name>"). Throws UsageError when world.rank is not
// in ranks, else what make_gloo_communicator throws.
std::unique_ptr<Communicator> make_gloo_group_communicator(const CommOptions& world,
                                                           const std::vector<int>& ranks,
                                                           const std::string& name);

}  // namespace ddpdiag::gloo_backend
