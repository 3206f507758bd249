#include "comm/ip_text.h"
#include "comm/world.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <stdexcept>

#include <fmt/core.h>

#include "comm/errors.h"

extern char** environ;

namespace ddpdiag {

std::string_view launcher_name(Launcher l) {
  switch (l) {
    case Launcher::kNone: return "none";
    case Launcher::kFlags: return "flags";
    case Launcher::kDdpdiag: return "ddpdiag";
    case Launcher::kTorchrun: return "torchrun";
    case Launcher::kEnv: return "env";
    case Launcher::kSlurm: return "slurm";
    case Launcher::kOpenMpi: return "openmpi";
    case Launcher::kMvapich: return "mvapich";
    case Launcher::kMpich: return "mpich";
  }
  return "unknown";
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

EnvLookup map_env(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

namespace {

UsageError world_error(const std::string& msg, const std::string& hint) {
  return UsageError(msg, ErrorContext{"world", -1, -1, hint});
}

// Reads an integer variable; records it; throws naming the variable and value.
class EnvReader {
 public:
  EnvReader(const EnvLookup& env, std::map<std::string, std::string>& read)
      : env_(env), read_(read) {}

  std::optional<std::string> str(const std::string& name) {
    auto v = env_(name);
    if (v) read_[name] = *v;
    return v;
  }

  std::optional<int> integer(const std::string& name) {
    auto v = str(name);
    if (!v) return std::nullopt;
    return parse(name, *v, /*leading_only=*/false);
  }

  // Slurm writes per-node task counts as "4" or "4(x2)" or "2,1": the first
  // number is this layout's first node; callers only use it when it is uniform.
  std::optional<int> leading_integer(const std::string& name) {
    auto v = str(name);
    if (!v) return std::nullopt;
    return parse(name, *v, /*leading_only=*/true);
  }

 private:
  static int parse(const std::string& name, const std::string& v, bool leading_only) {
    std::string s = v;
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    int out = 0;
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    if (ec == std::errc::result_out_of_range && (leading_only || p == s.data() + s.size()))
      throw world_error(fmt::format("environment variable {}='{}' is out of range ({} {})", name, v,
                                    s.rfind('-', 0) == 0 ? "at least" : "at most",
                                    s.rfind('-', 0) == 0 ? std::numeric_limits<int>::min()
                                                         : std::numeric_limits<int>::max()),
                        fmt::format("set {} to the value the launcher meant, or unset it", name));
    bool ok = ec == std::errc() && p != s.data() && (leading_only || p == s.data() + s.size());
    if (!ok)
      throw world_error(fmt::format("environment variable {}='{}' is not an integer", name, v),
                        fmt::format("set {} to an integer or unset it", name));
    return out;
  }

  const EnvLookup& env_;
  std::map<std::string, std::string>& read_;
};

bool truthy(const std::string& v) {
  std::string s;
  for (char c : v) s.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

}  // namespace

std::vector<int> expand_slurm_tasks_per_node(std::string_view s) {
  // Items "N" or "N(xK)", comma-separated.
  auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format("'{}': {}", s, why));
  };
  auto number = [&](std::string_view t) {
    int v = 0;
    auto [p, ec] = std::from_chars(t.data(), t.data() + t.size(), v);
    if (t.empty() || ec != std::errc() || p != t.data() + t.size() || v < 1)
      throw bad(fmt::format("'{}' is not a positive count", t));
    return v;
  };
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos <= s.size()) {
    std::size_t comma = s.find(',', pos);
    if (comma == std::string_view::npos) comma = s.size();
    std::string_view item = s.substr(pos, comma - pos);
    int repeat = 1;
    if (auto open = item.find("(x"); open != std::string_view::npos) {
      if (item.back() != ')') throw bad(fmt::format("'{}' lacks its ')'", item));
      repeat = number(item.substr(open + 2, item.size() - open - 3));
      item = item.substr(0, open);
    }
    const int count = number(item);
    if (out.size() + static_cast<std::size_t>(repeat) > 1000000) throw bad("more than 10^6 nodes");
    out.insert(out.end(), static_cast<std::size_t>(repeat), count);
    pos = comma + 1;
  }
  return out;
}

std::string first_slurm_host(std::string_view list) {
  auto bad = [&](std::string_view why) {
    return std::invalid_argument(fmt::format("'{}': {}", list, why));
  };
  // The first name: up to the first comma outside brackets.
  std::string out;
  std::size_t i = 0;
  while (i < list.size() && list[i] != ',') {
    if (list[i] == ']') throw bad("']' without '['");
    if (list[i] != '[') {
      out.push_back(list[i++]);
      continue;
    }
    const std::size_t close = list.find(']', i);
    if (close == std::string_view::npos) throw bad("'[' without ']'");
    // The group's first value: up to the first ',' or '-' ("07-09,12" -> "07").
    std::string_view group = list.substr(i + 1, close - i - 1);
    std::string_view first = group.substr(0, group.find_first_of(",-"));
    if (first.empty() || first.find_first_not_of("0123456789") != std::string_view::npos)
      throw bad(fmt::format("'[{}]' does not start with a number", group));
    out.append(first);
    i = close + 1;
  }
  if (out.empty()) throw bad("no host name");
  return out;
}

bool in_srun_step(const EnvLookup& env) {
  for (const char* var : {"SLURM_STEP_ID", "SLURM_STEPID"}) {
    const auto text = env(var);
    if (!text || text->empty()) continue;
    std::uint64_t id = 0;
    const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), id);
    if (ec == std::errc() && end == text->data() + text->size() && id < 0xfffffff0ULL) return true;
  }
  return false;
}

bool rank_variable_applies(std::string_view var, const EnvLookup& env) {
  return var != "SLURM_PROCID" || in_srun_step(env);
}

bool launched_by_launcher(const EnvLookup& env) {
  for (const char* v : kRankVariables)
    if (env(v) && rank_variable_applies(v, env)) return true;
  return env("DDPDIAG_LAUNCHER").has_value();
}

std::optional<GivenStore> given_store(const WorldFlags& flags, const EnvLookup& env) {
  const std::optional<std::string> addr = flags.master_addr ? flags.master_addr : env("MASTER_ADDR");
  std::optional<int> port = flags.master_port;
  if (!port)
    if (const auto text = env("MASTER_PORT")) {
      int p = 0;
      const auto [end, ec] = std::from_chars(text->data(), text->data() + text->size(), p);
      if (ec == std::errc() && end == text->data() + text->size()) port = p;
    }
  if (!addr || addr->empty() || !port || *port < 1 || *port > 65535) return std::nullopt;
  const auto agent = env("TORCHELASTIC_USE_AGENT_STORE");
  return GivenStore{without_ipv6_brackets(*addr), *port, agent && truthy(*agent)};
}

std::optional<std::string> launcher_rank_text(const EnvLookup& env) {
  for (const char* v : kRankVariables)
    if (auto text = env(v); text && !text->empty() && rank_variable_applies(v, env)) return text;
  return std::nullopt;
}

World discover_world(const WorldFlags& flags, const EnvLookup& env,
                     std::optional<int> visible_gpus) {
  World w;
  EnvReader r(env, w.env_read);

  // Which launcher: our own and torchrun set RANK & co; the MPI launchers
  // and Slurm have their own names. RANK wins over the others because
  // torchrun inside an srun allocation sets both and RANK is the true one;
  // the MPI launchers' win over Slurm's (kRankVariables says why), and
  // Slurm's count only in a task srun started.
  std::optional<int> rank, size, local_rank, local_size;
  std::string rank_var = "RANK", size_var = "WORLD_SIZE", lrank_var = "LOCAL_RANK",
              lsize_var = "LOCAL_WORLD_SIZE";
  if (auto v = r.integer("RANK")) {
    rank = v;
    size = r.integer("WORLD_SIZE");
    local_rank = r.integer("LOCAL_RANK");
    local_size = r.integer("LOCAL_WORLD_SIZE");
    if (r.str("DDPDIAG_LAUNCHER"))
      w.launcher = Launcher::kDdpdiag;
    else if (r.str("TORCHELASTIC_RUN_ID"))
      w.launcher = Launcher::kTorchrun;
    else
      w.launcher = Launcher::kEnv;
    if (!size && !flags.world_size)
      throw world_error(fmt::format("RANK={} is set but WORLD_SIZE is not", *rank),
                        "set WORLD_SIZE to the number of ranks, or pass --world-size");
  } else {
    // The MPI launchers: each names the rank, the size and the rank and
    // count on this node in variables of its own.
    struct MpiVariables {
      Launcher launcher;
      const char *rank, *size, *local_rank, *local_size, *how_to_run;
    };
    static constexpr MpiVariables kMpi[] = {
        {Launcher::kOpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE", "run under mpirun"},
        {Launcher::kMvapich, "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
         "MV2_COMM_WORLD_LOCAL_SIZE", "run under mpirun_rsh"},
        // MPICH's and Intel MPI's Hydra.
        {Launcher::kMpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
         "run under mpirun / mpiexec"},
    };
    for (const MpiVariables& m : kMpi) {
      const auto v = r.integer(m.rank);
      if (!v) continue;
      w.launcher = m.launcher;
      rank = v;
      rank_var = m.rank;
      size_var = m.size;
      lrank_var = m.local_rank;
      lsize_var = m.local_size;
      size = r.integer(size_var);
      local_rank = r.integer(lrank_var);
      local_size = r.integer(lsize_var);
      if (!size && !flags.world_size)
        throw world_error(fmt::format("{}={} is set but {} is not", m.rank, *rank, m.size),
                          fmt::format("{}, or pass --world-size", m.how_to_run));
      break;
    }
    if (!rank && in_srun_step(env)) {
      if (auto v = r.integer("SLURM_PROCID")) {
        w.launcher = Launcher::kSlurm;
        rank = v;
        rank_var = "SLURM_PROCID";
        size_var = "SLURM_NTASKS";
        lrank_var = "SLURM_LOCALID";
        lsize_var = "SLURM_NTASKS_PER_NODE";
        size = r.integer("SLURM_NTASKS");
        if (!size) {
          size = r.integer("SLURM_NPROCS");
          size_var = "SLURM_NPROCS";
        }
        local_rank = r.integer("SLURM_LOCALID");
        // --ntasks-per-node: the same on every node. Otherwise this node's entry
        // of the step's (else the job's) layout, which may differ between nodes.
        local_size = r.leading_integer("SLURM_NTASKS_PER_NODE");
        for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
          if (local_size) break;
          auto layout = r.str(var);
          if (!layout) continue;
          lsize_var = var;
          std::vector<int> counts;
          try {
            counts = expand_slurm_tasks_per_node(*layout);
          } catch (const std::invalid_argument& e) {
            throw world_error(fmt::format("environment variable {}='{}' is not a Slurm task layout: {}",
                                          var, *layout, e.what()),
                              fmt::format("unset {} or pass --local-world-size", var));
          }
          const int node = r.integer("SLURM_NODEID").value_or(0);
          if (node < 0 || node >= static_cast<int>(counts.size()))
            throw world_error(fmt::format("SLURM_NODEID={} but {}='{}' lists {} node(s)", node, var,
                                          *layout, counts.size()),
                              "run under srun, or pass --local-world-size");
          local_size = counts[static_cast<std::size_t>(node)];
        }
        if (!size && !flags.world_size)
          throw world_error(fmt::format("SLURM_PROCID={} is set but SLURM_NTASKS is not", *rank),
                            "run under srun with --ntasks, or pass --world-size");
      }
    }
  }

  // Flags win over the environment.
  bool any_flag = flags.rank || flags.world_size;
  if (flags.rank) {
    rank = flags.rank;
    rank_var = "--rank";
  }
  if (flags.world_size) {
    size = flags.world_size;
    size_var = "--world-size";
  } else if (flags.rank && !size) {
    // --rank with the size in the environment (WORLD_SIZE=4 ddpdiag ... --rank 1):
    // each value from where it was given, the flag winning where both are.
    if (auto v = r.integer("WORLD_SIZE")) {
      size = v;
      size_var = "WORLD_SIZE";
    }
  }
  if (flags.local_rank) {
    local_rank = flags.local_rank;
    lrank_var = "--local-rank";
  }
  if (flags.local_world_size) {
    local_size = flags.local_world_size;
    lsize_var = "--local-world-size";
  }
  if (any_flag && w.launcher == Launcher::kNone) w.launcher = Launcher::kFlags;
  if (rank.has_value() != size.has_value()) {
    if (rank)
      throw world_error(fmt::format("{}={} is given but the world size is not", rank_var, *rank),
                        "pass --world-size (or set WORLD_SIZE) together with --rank");
    throw world_error(fmt::format("{}={} is given but the rank is not", size_var, *size),
                      "pass --rank (or set RANK) together with --world-size");
  }

  if (size) {
    if (*size < 1)
      throw world_error(fmt::format("{}={} must be at least 1", size_var, *size),
                        "the world size counts every rank of the job");
    // Rank 0 keeps a few bytes per rank (whom it waits for, their
    // timelines): a typo of a billion ranks would take gigabytes of it.
    if (*size > kMaxWorldSize)
      throw world_error(fmt::format("{}={} is more ranks than ddpdiag meets in one world (at most {})",
                                    size_var, *size, kMaxWorldSize),
                        "check the world size for a typo: it counts every rank of the job");
    if (*rank < 0 || *rank >= *size)
      throw world_error(
          fmt::format("{}={} is out of range for {}={} (ranks are 0..{})", rank_var, *rank,
                      size_var, *size, *size - 1),
          "every rank needs a distinct rank below the world size; check the launcher's counts");
    w.rank = *rank;
    w.rank_source = rank_var;
    w.world_size_source = size_var;
    w.world_size = *size;
  }

  if (local_size) {
    if (*local_size < 1 || *local_size > w.world_size)
      throw world_error(fmt::format("{}={} must be between 1 and the world size {}", lsize_var,
                                    *local_size, w.world_size),
                        "the local world size is the number of ranks on this host");
    w.local_world_size = *local_size;
    w.local_world_size_given = true;
  } else {
    // Without the variable, assume every rank is on this host when there is no
    // launcher telling otherwise (single node is the common case for flags).
    w.local_world_size = w.world_size;
  }
  if (local_rank) {
    if (*local_rank < 0 || *local_rank >= w.local_world_size)
      throw world_error(fmt::format("{}={} is out of range for a local world size of {}",
                                    lrank_var, *local_rank, w.local_world_size),
                        "the local rank must be below the number of ranks on this host");
    w.local_rank = *local_rank;
    w.local_rank_given = true;
  } else {
    w.local_rank = w.local_world_size == w.world_size ? w.rank : 0;
  }

  if (visible_gpus && *visible_gpus > 0 && w.local_rank >= *visible_gpus)
    throw world_error(
        fmt::format("{}={} but only {} GPU(s) are visible{}", lrank_var, w.local_rank,
                    *visible_gpus,
                    env("CUDA_VISIBLE_DEVICES")
                        ? fmt::format(" (CUDA_VISIBLE_DEVICES={})", *env("CUDA_VISIBLE_DEVICES"))
                        : std::string()),
        "run at most one rank per visible GPU, or use --backend gloo");

  // Store address.
  auto addr_var = flags.master_addr ? std::string("--master-addr") : std::string("MASTER_ADDR");
  std::optional<std::string> addr = flags.master_addr ? flags.master_addr : r.str("MASTER_ADDR");
  if (addr) {
    if (addr->empty())
      throw world_error(fmt::format("{} is empty", addr_var),
                        "set it to the host name or address of rank 0 (or of the store)");
    // Forms that no resolver takes, said at once rather than after
    // --timeout of failed lookups ("cannot resolve host name").
    const std::string& a = *addr;
    const auto colons = std::count(a.begin(), a.end(), ':');
    const std::size_t close = a.find(']');
    std::string problem;
    if (a.find("://") != std::string::npos)
      problem = "is a URL";
    else if (std::any_of(a.begin(), a.end(), [](char c) { return static_cast<unsigned char>(c) <= ' ' || c == 0x7f; }))
      problem = "holds a space or a control character";
    else if (a.front() == '[' && close != std::string::npos && close + 1 < a.size() && a[close + 1] == ':')
      problem = fmt::format("holds a port ('{}')", a.substr(close + 1));
    else if ((a.front() == '[') != (close != std::string::npos) || (close != std::string::npos && close + 1 != a.size()) ||
             a.find('[', 1) != std::string::npos || a == "[]")
      problem = "has unbalanced brackets (an IPv6 address is written ::1 or [::1])";
    else if (colons == 1)
      problem = fmt::format("holds a port ('{}')", a.substr(a.find(':')));
    if (!problem.empty())
      throw world_error(fmt::format("{}='{}' {}: it must be a host name or an address alone", addr_var, a, problem),
                        problem.rfind("holds a port", 0) == 0
                            ? fmt::format("put the host in {} and the port in {}", addr_var,
                                          flags.master_addr ? "--master-port" : "MASTER_PORT")
                            : "give the host name or address of rank 0 (or of the store), e.g. node0, "
                              "10.0.0.1 or ::1");
    w.master_addr = without_ipv6_brackets(*addr);
    w.master_addr_source = addr_var;
  } else if (w.local_world_size < w.world_size && w.launcher == Launcher::kSlurm) {
    // Several nodes under srun: task 0 runs on the first node of the step.
    for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      auto list = r.str(var);
      if (!list) continue;
      try {
        w.master_addr = first_slurm_host(*list);
      } catch (const std::invalid_argument& e) {
        throw world_error(fmt::format("MASTER_ADDR is not set and {}='{}' is not a Slurm host "
                                      "list: {}",
                                      var, *list, e.what()),
                          "export MASTER_ADDR=<host of rank 0> or pass --master-addr");
      }
      w.master_addr_source = var;
      break;
    }
    if (w.master_addr_source == "default")
      throw world_error(
          fmt::format("MASTER_ADDR is not set, the job spans several hosts ({} ranks, {} on this "
                      "host) and Slurm gave no node list (SLURM_STEP_NODELIST, "
                      "SLURM_JOB_NODELIST)",
                      w.world_size, w.local_world_size),
          "export MASTER_ADDR=<host of rank 0> or pass --master-addr");
  } else if (w.local_world_size < w.world_size) {
    throw world_error(
        fmt::format("MASTER_ADDR is not set and the job spans several hosts ({} ranks, {} on "
                    "this host)",
                    w.world_size, w.local_world_size),
        w.launcher == Launcher::kOpenMpi
            ? "pass MASTER_ADDR to every rank: mpirun -x MASTER_ADDR=<host of rank 0> ..., or "
              "pass --master-addr"
        : w.launcher == Launcher::kMpich
            ? "pass MASTER_ADDR to every rank: mpirun -genv MASTER_ADDR <host of rank 0> ..., or "
              "pass --master-addr"
        : w.launcher == Launcher::kMvapich
            ? "pass MASTER_ADDR to every rank: mpirun_rsh ... MASTER_ADDR=<host of rank 0> "
              "ddpdiag ..., or pass --master-addr"
            : "export MASTER_ADDR=<host of rank 0> (e.g. the first host of $SLURM_JOB_NODELIST) "
              "or pass --master-addr");
  }
  std::optional<int> port;
  std::string port_var = "MASTER_PORT";
  if (flags.master_port) {
    port = flags.master_port;
    port_var = "--master-port";
  } else {
    port = r.integer("MASTER_PORT");
  }
  if (port) {
    if (*port < 1 || *port > 65535)
      throw world_error(fmt::format("{}={} is not a valid TCP port (1..65535)", port_var, *port),
                        "pick a free port, e.g. 29500");
    w.master_port = *port;
  }

  // torchrun: the agent hosts the store; workers are clients.
  if (auto v = r.str("TORCHELASTIC_USE_AGENT_STORE"); v && truthy(*v)) w.agent_store = true;
  if (w.launcher == Launcher::kTorchrun)
    w.restart_count = r.integer("TORCHELASTIC_RESTART_COUNT").value_or(0);
  for (const char* extra : {"TORCHELASTIC_RUN_ID", "GROUP_RANK", "GROUP_WORLD_SIZE",
                            "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_MAX_RESTARTS"})
    r.str(extra);
  return w;
}

std::map<std::string, std::string> recorded_environment() {
  static const char* kPrefixes[] = {"NCCL_",  "GLOO_",        "MASTER_",           "TORCHELASTIC_",
                                    "SLURM_", "OMPI_COMM_WORLD_", "DDPDIAG_",       "TORCH_",
                                    "MV2_COMM_WORLD_", "PMI_", "MPI_LOCAL"};
  static const char* kNames[] = {"RANK",        "WORLD_SIZE", "LOCAL_RANK",
                                 "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                                 "ROLE_RANK",   "ROLE_NAME",  "ROLE_WORLD_SIZE",
                                 "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DDP_SET_LAST_BUCKET_CAP"};
  std::map<std::string, std::string> out;
  for (char** e = environ; e && *e; ++e) {
    std::string_view kv(*e);
    auto eq = kv.find('=');
    if (eq == std::string_view::npos) continue;
    std::string name(kv.substr(0, eq));
    bool keep = std::any_of(std::begin(kNames), std::end(kNames),
                            [&](const char* n) { return name == n; }) ||
                std::any_of(std::begin(kPrefixes), std::end(kPrefixes),
                            [&](const char* p) { return name.rfind(p, 0) == 0; });
    // The launcher's command line for the ranks: the report's argv already.
    if (name == "DDPDIAG_LAUNCHER_ARGV") keep = false;
    if (keep) out[name] = std::string(kv.substr(eq + 1));
  }
  return out;
}

}  // namespace ddpdiag
