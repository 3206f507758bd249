// Who am I and where is the store: rank, world size, local rank, local world
// size and the store address, from explicit flags or the environment of the
// launcher (torchrun, Slurm, Open MPI, ddpdiag's own), flags winning.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ddpdiag {

enum class Launcher : std::uint8_t {
  kNone,      // no launcher variables: a single process or the built-in launcher is to be used
  kFlags,     // everything came from flags
  kDdpdiag,   // ddpdiag --nproc (sets DDPDIAG_LAUNCHER=1 plus torchrun's variables)
  kTorchrun,  // torchrun / torch.distributed.run (TORCHELASTIC_RUN_ID)
  kEnv,       // plain RANK/WORLD_SIZE without a known launcher
  kSlurm,     // srun (SLURM_PROCID)
  kOpenMpi,   // Open MPI's mpirun (OMPI_COMM_WORLD_RANK)
  kMvapich,   // MVAPICH's mpirun_rsh (MV2_COMM_WORLD_RANK)
  kMpich,     // MPICH's and Intel MPI's mpirun / mpiexec (Hydra: PMI_RANK)
};

// The variables a launcher gives each rank its rank in, in the order they
// are read (the first set wins: torchrun inside srun sets RANK and
// SLURM_PROCID, and RANK is the true one; MVAPICH under Hydra sets
// MV2_COMM_WORLD_RANK and PMI_RANK alike).
// In the order they are read: torchrun's (and ddpdiag's own launcher's)
// RANK, the MPI launchers', then Slurm's. An MPI launcher run inside a Slurm
// allocation leaves Slurm's variables of the batch shell (or of the srun step
// that started its daemons) in every rank's environment, SLURM_PROCID=0 on
// every rank of a node: its own are the true ones. SLURM_PROCID counts only
// in a task that srun started (in_srun_step()): a batch script's own shell
// has SLURM_PROCID=0 and SLURM_NTASKS too, and is no rank.
inline constexpr const char* kRankVariables[] = {"RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK",
                                                 "PMI_RANK", "SLURM_PROCID"};

std::string_view launcher_name(Launcher l);

// The most ranks one world may have (2^20): more than any job runs, and a
// world size beyond it is refused as a typo.
inline constexpr long kMaxWorldSize = 1L << 20;

// Flags given on the command line; unset fields fall back to the environment.
struct WorldFlags {
  std::optional<int> rank;
  std::optional<int> world_size;
  std::optional<int> local_rank;
  std::optional<int> local_world_size;
  std::optional<std::string> master_addr;
  std::optional<int> master_port;
};

struct World {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // Whether a launcher's variable or a flag gave local_world_size; without
  // one it is taken to be the world size (every rank on this host).
  bool local_world_size_given = false;
  // Whether a launcher's variable or a flag gave local_rank; without one it
  // is the rank (every rank on this host) until the ranks meet and the
  // machines they registered from say which share this one.
  bool local_rank_given = false;
  std::string master_addr = "127.0.0.1";
  // Where master_addr came from: "--master-addr", "MASTER_ADDR", the Slurm
  // node list it was taken from (e.g. "SLURM_STEP_NODELIST"), or "default".
  std::string master_addr_source = "default";
  // Where the rank and the world size came from: a variable (RANK,
  // SLURM_PROCID, ...) or a flag (--rank, --world-size); empty by default.
  std::string rank_source, world_size_source;
  int master_port = 29500;
  Launcher launcher = Launcher::kNone;
  // torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE=True):
  // every rank is a client. The agent's store outlives the workers of a
  // restart, and under torch 2.x each node counts its own restarts, so
  // ddpdiag's keys do not go under an attempt prefix: the ranks agree on a
  // run of their own through the store (register_rank in cli_common.cpp).
  bool agent_store = false;
  // TORCHELASTIC_RESTART_COUNT under torchrun (this node's restarts so far),
  // -1 elsewhere.
  int restart_count = -1;
  // Every variable that was read, with its value, for the report.
  std::map<std::string, std::string> env_read;

  // Rank 0 hosts the store unless an agent does.
  bool hosts_store() const { return !agent_store && rank == 0; }
};

// Environment lookup; tests pass a map instead of the process environment.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();
EnvLookup map_env(std::map<std::string, std::string> vars);

// Resolves the world. Throws UsageError (exit 2) naming the variable or flag
// and its value on: a non-number, a missing companion (RANK without
// WORLD_SIZE, ...), rank >= world size, negative values, port outside
// 1..65535, local rank >= local world size, and — when visible_gpus is
// given and the backend is NCCL — LOCAL_RANK beyond the visible GPUs.
//
// Under srun: the local world size is SLURM_NTASKS_PER_NODE when set, else
// this node's entry (SLURM_NODEID) of SLURM_STEP_TASKS_PER_NODE (or the
// job's SLURM_TASKS_PER_NODE), which may differ between nodes ("3,2"). A job
// on several nodes without MASTER_ADDR takes the first host of
// SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST, SLURM_NODELIST): srun puts
// task 0 there under its block and cyclic distributions.
World discover_world(const WorldFlags& flags, const EnvLookup& env,
                     std::optional<int> visible_gpus = std::nullopt);

// Slurm's per-node task counts, e.g. SLURM_STEP_TASKS_PER_NODE="2(x3),1",
// one count per node in node order: {2, 2, 2, 1}. Throws
// std::invalid_argument naming the bad part.
std::vector<int> expand_slurm_tasks_per_node(std::string_view s);

// The first host of a Slurm host list, e.g. "node[07-09,12],login1" ->
// "node07" (zero padding kept; several bracket groups in one name, as
// "rack[1-2]-n[01-04]", each give their first value). Throws
// std::invalid_argument naming the list when it is empty or malformed.
std::string first_slurm_host(std::string_view list);

// True when the environment was set by some launcher (any of
// kRankVariables, or DDPDIAG_LAUNCHER), i.e. this process is one rank of a
// job rather than the user's shell.
bool launched_by_launcher(const EnvLookup& env);

// True in a task that srun started: SLURM_STEP_ID (or the older
// SLURM_STEPID) is a step number. A batch script's shell (sbatch) and an
// salloc shell have none; Slurm's special steps (batch, extern,
// interactive) are numbers from 0xfffffff0 up and are no srun step either.
bool in_srun_step(const EnvLookup& env);

// Whether the launcher variable `var` (one of kRankVariables) names this
// process's rank here: SLURM_PROCID only in a task srun started.
bool rank_variable_applies(std::string_view var, const EnvLookup& env);

// The text of the first of kRankVariables that is set: this process's rank
// as its launcher gave it, before any check; nullopt when none is set.
std::optional<std::string> launcher_rank_text(const EnvLookup& env);

// Where the store is when it was given outright (--master-addr/--master-port,
// else MASTER_ADDR/MASTER_PORT), read as discover_world reads them but
// without its checks, for a rank whose world was refused; nullopt when
// either is missing or the port is no port. agent_store: torchrun's agent
// hosts it (TORCHELASTIC_USE_AGENT_STORE).
struct GivenStore {
  std::string addr;
  int port = 0;
  bool agent_store = false;
};
std::optional<GivenStore> given_store(const WorldFlags& flags, const EnvLookup& env);

// Environment variables recorded in reports: NCCL_*, GLOO_*, MASTER_*,
// TORCHELASTIC_*, the rank variables, CUDA_VISIBLE_DEVICES, SLURM_*,
// OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_* and MPI_LOCAL* (all that are set).
std::map<std::string, std::string> recorded_environment();

}  // namespace ddpdiag
