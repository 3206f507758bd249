// Shared pieces of the subcommands: world flags, store and communicator
// setup, error printing.
#pragma once

#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/world.h"

namespace ddpdiag::cli {

void print_error(const Error& e);

}  // namespace ddpdiag::cli
