// Shared pieces of the distributed subcommands: the common flags, the
// built-in launcher hand-off, rendezvous through the store, communicator
// setup, gathering to rank 0, the report and the mapping of errors to exit
// codes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/errors.h"
#include "comm/store/tcp_store.h"
#include "comm/world.h"
#include "reports/report.h"

namespace ddpdiag::cli {

void print_error(const Error& e);

struct CommonOptions {
  WorldFlags world;
  std::string backend = "auto";  // auto | gloo | nccl
  int nproc = 0;                 // > 0: start this many local ranks (built-in launcher)
  double timeout_s = 60;         // every wait on a peer
  std::string json_path;
  std::string gloo_interface;
  std::string store_protocol = "auto";  // auto | 1.13 | 2.x
  bool quiet = false;
};

// Adds --rank, --world-size, --local-rank, --master-addr, --master-port,
// --backend, --nproc, --timeout, --json, --gloo-interface, --store-protocol.
void add_common_options(CLI::App* app, CommonOptions& o);

// One rank of a running job.
struct Job {
  World world;
  Backend backend = Backend::kGloo;
  Millis timeout{60000};
  std::unique_ptr<TcpStoreServer> server;  // rank 0 when it hosts the store
  std::shared_ptr<Store> store;            // under this job's ddpdiag prefix
  std::unique_ptr<Communicator> comm;
  std::vector<reports::RankInfo> ranks;    // every rank's identity, from rendezvous
  bool progress = false;                   // rank 0 shows progress on stderr

  int rank() const { return world.rank; }
  int size() const { return world.world_size; }
  // Every rank's JSON value, on rank 0 (empty elsewhere); through the store,
  // so it works whatever state the communicator is in.
  std::vector<nlohmann::json> gather_to_root(const std::string& key, const nlohmann::json& mine);
  void progress_line(const std::string& line) const;
};

using JobBody = std::function<void(Job&, reports::Report&)>;

// Runs a distributed command from start to end on this process: hands off to
// the built-in launcher when asked (--nproc, or no launcher and no rank flags:
// the default world), else discovers the world, rendezvouses, creates the
// communicator, runs the body, writes the report on rank 0 (also after a
// failure, with what was measured) and returns the exit code.
int run_distributed(const CommonOptions& o, const std::string& command, const JobBody& body);

// Parses sizes with binary suffixes as nccl-tests does: 8, 1K, 64M, 1G.
std::size_t parse_size(const std::string& s);
std::string format_size(std::size_t bytes);  // 1K, 64M, 3 ...

}  // namespace ddpdiag::cli
