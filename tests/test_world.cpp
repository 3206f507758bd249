#include <catch2/catch.hpp>

#include "comm/errors.h"
#include "comm/world.h"

using namespace ddpdiag;

namespace {
using Catch::Matchers::Contains;

World discover(std::map<std::string, std::string> env, WorldFlags flags = {},
               std::optional<int> gpus = std::nullopt) {
  return discover_world(flags, map_env(std::move(env)), gpus);
}

// The error must be a UsageError whose message names `needle`.
void require_usage_error(std::map<std::string, std::string> env, const std::string& needle,
                         WorldFlags flags = {}, std::optional<int> gpus = std::nullopt) {
  try {
    discover(std::move(env), flags, gpus);
    FAIL("expected a UsageError mentioning " << needle);
  } catch (const UsageError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(needle) != std::string::npos);
    CHECK(e.exit_code() == ExitCode::kUsage);
    CHECK(!e.context().hint.empty());
  }
}
}  // namespace

TEST_CASE("no launcher: a single rank on localhost", "[world]") {
  auto w = discover({});
  CHECK(w.rank == 0);
  CHECK(w.world_size == 1);
  CHECK(w.launcher == Launcher::kNone);
  CHECK(w.master_port == 29500);
  CHECK(w.hosts_store());
}

TEST_CASE("torchrun environment with the agent store", "[world]") {
  auto w = discover({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                     {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "node0"},
                     {"MASTER_PORT", "29400"}, {"TORCHELASTIC_RUN_ID", "abc"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                     {"TORCHELASTIC_RESTART_COUNT", "2"}});
  CHECK(w.launcher == Launcher::kTorchrun);
  CHECK(w.rank == 3);
  CHECK(w.world_size == 8);
  CHECK(w.local_rank == 1);
  CHECK(w.local_world_size == 2);
  CHECK(w.master_addr == "node0");
  CHECK(w.master_port == 29400);
  CHECK(w.agent_store);
  CHECK_FALSE(w.hosts_store());
  CHECK(w.restart_count == 2);
  CHECK(w.env_read.at("TORCHELASTIC_RUN_ID") == "abc");
}

TEST_CASE("torchrun without the agent store: rank 0 hosts", "[world]") {
  auto w = discover({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_RUN_ID", "x"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  CHECK_FALSE(w.agent_store);
  CHECK(w.hosts_store());
  CHECK(w.restart_count == 0);  // torchrun without the variable: none yet
}

TEST_CASE("Slurm and Open MPI variables", "[world]") {
  auto s = discover({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                     {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"MASTER_ADDR", "n1"}});
  CHECK(s.launcher == Launcher::kSlurm);
  CHECK(s.rank == 5);
  CHECK(s.world_size == 8);
  CHECK(s.local_rank == 1);
  CHECK(s.local_world_size == 4);
  auto m = discover({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"MASTER_ADDR", "10.0.0.1"}, {"MASTER_PORT", "1234"}});
  CHECK(m.launcher == Launcher::kOpenMpi);
  CHECK(m.rank == 2);
  CHECK(m.world_size == 4);
  CHECK(m.local_world_size == 2);
  CHECK(m.master_port == 1234);
}

TEST_CASE("Slurm's variables name a rank only in a task srun started", "[world]") {
  // A batch script's shell (sbatch -n 2): SLURM_PROCID=0 and SLURM_NTASKS,
  // but no step. It is no rank of the allocation.
  const std::map<std::string, std::string> batch = {
      {"SLURM_JOB_ID", "777"},  {"SLURM_PROCID", "0"},         {"SLURM_NTASKS", "2"},
      {"SLURM_LOCALID", "0"},   {"SLURM_NODEID", "0"},         {"SLURM_TASKS_PER_NODE", "2"},
      {"SLURM_JOB_NODELIST", "vm"}};
  auto b = discover(batch);
  CHECK(b.launcher == Launcher::kNone);
  CHECK(b.world_size == 1);
  CHECK_FALSE(in_srun_step(map_env(batch)));
  CHECK_FALSE(launched_by_launcher(map_env(batch)));
  CHECK_FALSE(launcher_rank_text(map_env(batch)).has_value());
  // Slurm's special steps (batch 0xfffffffb, extern 0xfffffffc) are no srun
  // step; a step number, SLURM_STEP_ID or the older SLURM_STEPID, is.
  for (const char* id : {"4294967291", "4294967292", "", "x"}) {
    auto e = batch;
    e["SLURM_STEP_ID"] = id;
    INFO(id);
    CHECK_FALSE(in_srun_step(map_env(e)));
  }
  for (const char* var : {"SLURM_STEP_ID", "SLURM_STEPID"}) {
    auto e = batch;
    e[var] = "3";
    auto w = discover(e);
    CHECK(w.launcher == Launcher::kSlurm);
    CHECK((w.rank == 0 && w.world_size == 2 && w.local_world_size == 2));
    CHECK(launcher_rank_text(map_env(e)) == "0");
  }
  // Open MPI's mpirun inside the allocation: every rank has the batch
  // shell's (or its daemon step's) SLURM_PROCID=0; Open MPI's variables are
  // the true ones, with or without a step.
  for (const char* step : {"", "0"}) {
    auto e = batch;
    if (*step) e["SLURM_STEP_ID"] = step;
    e.insert({{"OMPI_COMM_WORLD_RANK", "1"},
              {"OMPI_COMM_WORLD_SIZE", "2"},
              {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    auto w = discover(e);
    CHECK(w.launcher == Launcher::kOpenMpi);
    CHECK((w.rank == 1 && w.world_size == 2 && w.local_rank == 1));
    CHECK(launcher_rank_text(map_env(e)) == "1");
  }
  // Hydra under Slurm alike.
  auto e = batch;
  e["SLURM_STEP_ID"] = "0";
  e.insert({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"},
            {"MASTER_ADDR", "n1"}});
  auto h = discover(e);
  CHECK(h.launcher == Launcher::kMpich);
  CHECK(h.rank == 3);
}

TEST_CASE("MPICH, Intel MPI and MVAPICH variables", "[world]") {
  // Hydra (MPICH's and Intel MPI's mpirun / mpiexec).
  auto h = discover({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"},
                     {"MPI_LOCALNRANKS", "2"}, {"PMI_FD", "7"}, {"MASTER_ADDR", "10.0.0.1"}});
  CHECK(h.launcher == Launcher::kMpich);
  CHECK(launcher_name(h.launcher) == "mpich");
  CHECK((h.rank == 3 && h.world_size == 4 && h.local_rank == 1 && h.local_world_size == 2));
  // MVAPICH's mpirun_rsh; under Hydra it sets PMI_RANK too, which agrees.
  auto m = discover({{"MV2_COMM_WORLD_RANK", "5"}, {"MV2_COMM_WORLD_SIZE", "8"},
                     {"MV2_COMM_WORLD_LOCAL_RANK", "1"}, {"MV2_COMM_WORLD_LOCAL_SIZE", "4"},
                     {"PMI_RANK", "5"}, {"PMI_SIZE", "8"}, {"MASTER_ADDR", "n1"}});
  CHECK(m.launcher == Launcher::kMvapich);
  CHECK((m.rank == 5 && m.world_size == 8 && m.local_rank == 1 && m.local_world_size == 4));
  // torchrun inside such a job: RANK wins.
  auto t = discover({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"PMI_RANK", "7"}, {"PMI_SIZE", "8"},
                     {"TORCHELASTIC_RUN_ID", "x"}});
  CHECK(t.launcher == Launcher::kTorchrun);
  CHECK(t.rank == 0);
  // Half a world is named, with the launcher's own variable.
  CHECK_THROWS_WITH(discover({{"PMI_RANK", "1"}}), Contains("PMI_RANK=1 is set but PMI_SIZE is not"));
  CHECK_THROWS_WITH(discover({{"MV2_COMM_WORLD_RANK", "1"}}),
                    Contains("MV2_COMM_WORLD_RANK=1 is set but MV2_COMM_WORLD_SIZE is not"));
  CHECK_THROWS_WITH(discover({{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}}),
                    Contains("PMI_RANK=4 is out of range for PMI_SIZE=4"));
  // Several hosts without MASTER_ADDR: the hint says how Hydra passes it.
  try {
    discover({{"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"MPI_LOCALNRANKS", "2"}});
    FAIL("no error without MASTER_ADDR");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Contains("MASTER_ADDR is not set"));
    CHECK_THAT(e.context().hint, Contains("mpirun -genv MASTER_ADDR"));
  }
}

TEST_CASE("Slurm: uneven task layouts and the store host from the node list", "[world]") {
  // 5 tasks on 2 nodes, 3 + 2 (srun -n5 -N2): this is the second node, whose
  // local world is 2, not the layout's leading 3. No MASTER_ADDR: the first
  // host of the step's node list, where task 0 runs.
  std::map<std::string, std::string> env = {
      {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "4"},          {"SLURM_NTASKS", "5"},
      {"SLURM_LOCALID", "1"},         {"SLURM_NODEID", "1"},
      {"SLURM_STEP_TASKS_PER_NODE", "3,2"},
      {"SLURM_TASKS_PER_NODE", "4(x2)"},  // the job's allocation: the step's wins
      {"SLURM_STEP_NODELIST", "gpu[07-08]"},
      {"SLURM_JOB_NODELIST", "gpu[01-08]"}};
  auto w = discover(env);
  CHECK(w.local_world_size == 2);
  CHECK(w.local_rank == 1);
  CHECK(w.master_addr == "gpu07");
  CHECK(w.master_addr_source == "SLURM_STEP_NODELIST");
  CHECK(w.env_read.at("SLURM_STEP_NODELIST") == "gpu[07-08]");

  // The job's layout and node list when the step's are missing (sbatch
  // scripts that run ddpdiag through another launcher's environment).
  env.erase("SLURM_STEP_TASKS_PER_NODE");
  env.erase("SLURM_STEP_NODELIST");
  env["SLURM_TASKS_PER_NODE"] = "3,2";
  w = discover(env);
  CHECK(w.local_world_size == 2);
  CHECK(w.master_addr == "gpu01");
  CHECK(w.master_addr_source == "SLURM_JOB_NODELIST");

  // MASTER_ADDR, when set, wins; a single node keeps 127.0.0.1.
  env["MASTER_ADDR"] = "10.0.0.9";
  CHECK(discover(env).master_addr == "10.0.0.9");
  CHECK(discover(env).master_addr_source == "MASTER_ADDR");
  auto one = discover({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"},
                       {"SLURM_NODEID", "0"}, {"SLURM_STEP_TASKS_PER_NODE", "2"},
                       {"SLURM_STEP_NODELIST", "vm"}});
  CHECK(one.local_world_size == 2);
  CHECK(one.master_addr == "127.0.0.1");
  CHECK(one.master_addr_source == "default");

  // Broken layouts and lists are usage errors naming the variable.
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2"}},
                      "SLURM_STEP_TASKS_PER_NODE='2(x2'");
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODEID", "2"},
                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}},
                      "SLURM_NODEID=2 but SLURM_STEP_TASKS_PER_NODE='2(x2)' lists 2 node(s)");
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}, {"SLURM_STEP_NODELIST", "n[a-b]"}},
                      "SLURM_STEP_NODELIST='n[a-b]' is not a Slurm host list");
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"},
                       {"SLURM_STEP_TASKS_PER_NODE", "2(x2)"}},
                      "Slurm gave no node list");
}

TEST_CASE("Slurm's list formats", "[world]") {
  CHECK(expand_slurm_tasks_per_node("4") == std::vector<int>{4});
  CHECK(expand_slurm_tasks_per_node("2(x3),1") == std::vector<int>{2, 2, 2, 1});
  CHECK(expand_slurm_tasks_per_node("3,2") == std::vector<int>{3, 2});
  for (const char* bad : {"", "x", "2,", ",2", "2(x)", "2(x3", "0", "2(x0)", "-1", "2(y3)"})
    CHECK_THROWS_AS(expand_slurm_tasks_per_node(bad), std::invalid_argument);
  CHECK(first_slurm_host("node1") == "node1");
  CHECK(first_slurm_host("node[07-09,12],login1") == "node07");
  CHECK(first_slurm_host("login1,node[07-09]") == "login1");
  CHECK(first_slurm_host("n[3,1-2]") == "n3");
  CHECK(first_slurm_host("rack[1-2]-n[001-004]") == "rack1-n001");
  CHECK(first_slurm_host("a-b.example.org") == "a-b.example.org");
  for (const char* bad : {"", ",n1", "n[1-2", "n]1", "n[]", "n[a]"})
    CHECK_THROWS_AS(first_slurm_host(bad), std::invalid_argument);
}

TEST_CASE("flags win over the environment", "[world]") {
  WorldFlags f;
  f.rank = 1;
  f.world_size = 2;
  f.master_addr = "10.1.1.1";
  f.master_port = 4000;
  auto w = discover({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"MASTER_PORT", "29500"}}, f);
  CHECK(w.rank == 1);
  CHECK(w.world_size == 2);
  CHECK(w.master_addr == "10.1.1.1");
  CHECK(w.master_port == 4000);
}

TEST_CASE("a flag and the environment each give half of the world", "[world]") {
  WorldFlags size_flag;
  size_flag.world_size = 2;
  auto a = discover({{"RANK", "1"}, {"MASTER_PORT", "4000"}}, size_flag);
  CHECK(a.rank == 1);
  CHECK(a.world_size == 2);
  CHECK(a.rank_source == "RANK");
  CHECK(a.world_size_source == "--world-size");
  WorldFlags ompi_size;
  ompi_size.world_size = 3;
  auto b = discover({{"OMPI_COMM_WORLD_RANK", "2"}, {"MASTER_ADDR", "h0"}}, ompi_size);
  CHECK(b.rank == 2);
  CHECK(b.world_size == 3);
  WorldFlags rank_flag;
  rank_flag.rank = 1;
  auto c = discover({{"WORLD_SIZE", "2"}}, rank_flag);
  CHECK(c.rank == 1);
  CHECK(c.world_size == 2);
  // Checked against the size it came from.
  WorldFlags too_big;
  too_big.rank = 2;
  require_usage_error({{"WORLD_SIZE", "2"}}, "--rank=2 is out of range for WORLD_SIZE=2", too_big);
}

TEST_CASE("every invalid input is a usage error naming the variable", "[world]") {
  require_usage_error({{"RANK", "x1"}, {"WORLD_SIZE", "2"}}, "RANK='x1'");
  require_usage_error({{"RANK", "1"}, {"WORLD_SIZE", "2 ranks"}}, "WORLD_SIZE='2 ranks'");
  require_usage_error({{"RANK", "1"}}, "WORLD_SIZE is not");
  // An integer too large for an int is out of range, not "not an integer".
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "99999999999"}},
                      "WORLD_SIZE='99999999999' is out of range (at most 2147483647)");
  require_usage_error({{"RANK", "99999999999"}, {"WORLD_SIZE", "2"}}, "RANK='99999999999' is out of range");
  require_usage_error({{"RANK", "2"}, {"WORLD_SIZE", "2"}}, "RANK=2 is out of range");
  require_usage_error({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}, "RANK=-1");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "0"}}, "WORLD_SIZE=0");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}},
                      "MASTER_PORT=70000");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "0"}}, "MASTER_PORT=0");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"},
                       {"LOCAL_WORLD_SIZE", "2"}},
                      "LOCAL_RANK=3");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}},
                      "LOCAL_WORLD_SIZE=3");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}},
                      "MASTER_ADDR is not set");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}, "MASTER_ADDR is empty");
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "0"}}, "SLURM_NTASKS is not");
  require_usage_error({{"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}, "SLURM_PROCID=4");
  require_usage_error({{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_SIZE is not");
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"},
                       {"CUDA_VISIBLE_DEVICES", "0"}},
                      "only 1 GPU(s) are visible", {}, 1);
  WorldFlags f;
  f.rank = 5;
  f.world_size = 4;
  require_usage_error({}, "--rank=5", f);
  WorldFlags g;
  g.rank = 1;
  require_usage_error({}, "world size is not", g);
  WorldFlags p;
  p.master_port = -3;
  require_usage_error({}, "--master-port=-3", p);
}

TEST_CASE("every variable read is recorded", "[world]") {
  auto w = discover({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "1234"}});
  CHECK(w.env_read.count("RANK") == 1);
  CHECK(w.env_read.count("WORLD_SIZE") == 1);
  CHECK(w.env_read.count("MASTER_PORT") == 1);
}

TEST_CASE("a world of more than 2^20 ranks is refused as a typo", "[world]") {
  require_usage_error({{"RANK", "0"}, {"WORLD_SIZE", "1048577"}},
                      "WORLD_SIZE=1048577 is more ranks than ddpdiag meets in one world (at most 1048576)");
  WorldFlags f;
  f.rank = 3;
  f.world_size = 2000000000;
  require_usage_error({}, "--world-size=2000000000 is more ranks", f);
  const World w = discover({{"RANK", "1048575"}, {"WORLD_SIZE", "1048576"}});
  CHECK(w.world_size == 1048576);
  CHECK(w.rank == 1048575);
}
