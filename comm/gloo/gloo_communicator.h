// The Gloo backend: collectives on host memory over Gloo's TCP transport.
// Only this folder includes Gloo headers; the rest of ddpdiag reaches the
// backend through make_communicator().
#pragma once

#include <map>
#include <memory>
#include <string>

#include "comm/communicator.h"

namespace ddpdiag::gloo_backend {

// Rendezvouses through opts.store (keys under "gloo/") and connects a full
// mesh. Throws RendezvousError/TimeoutError/BackendError with phase
// "backend.init".
std::unique_ptr<Communicator> make_gloo_communicator(const CommOptions& opts);

// "gloo 0.5.0": the version of the Gloo headers this build used.
std::string gloo_version();

// Gloo's message with every address it shows ("[10.0.0.2]:26386") written
// with its real port: the Gloo Debian ships prints ports byte-swapped. The
// backend's own errors already pass Gloo's text through this.
std::string right_ports(std::string gloo_message);

// The rank a Gloo message names, given the peers' listening addresses as
// Gloo shows them ("[10.0.0.2]:26386" -> rank), or -1. A message from the
// side that accepted a connection names the peer's ephemeral port, not the
// one it listens on; then the host alone names the rank, when exactly one
// peer listens on it (several ranks on that host stay unnamed).
int peer_named_in(const std::string& gloo_message, const std::map<std::string, int>& peer_addresses);

}  // namespace ddpdiag::gloo_backend
