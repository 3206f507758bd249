// ddpdiag memory: a per-rank memory summary of a real DDP step, gathered to
// rank 0. On every rank: the model's parameters are allocated and broadcast
// from rank 0, DDP's reducer is built for the layout and runs --iters steps
// with a simulated backward, and a metrics buffer is all-reduced, all through
// an accounting communicator (comm/memory.h), so the figures per category
// (parameters, gradients, buckets, communication_buffers, workspace) are
// exactly what ddpdiag holds, in the backend's memory kind (host for Gloo,
// device for NCCL). Beside them: the process's resident set and its peak
// (/proc/self/status VmRSS/VmHWM), on a GPU cudaMemGetInfo's free/total, and
// what a communicator costs: the change of device free memory (NCCL) or of
// the resident set (Gloo) around the initialisation and first collectives of
// a second communicator over the same ranks, as nccl-tests -M measures it.
//
// Categories. parameters: one flat allocation of the layout (frozen
// parameters included); buckets: the reducer's flat buffers of its dense
// buckets, as DDP's (a sparse bucket has none); gradients: with
// --no-gradient-views the reducer's per-parameter gradient buffers, made when
// a parameter's first gradient is (one no rank uses has none, as torch
// leaves its .grad None), with --gradient-as-bucket-view zero, the gradients
// being slices of the buckets. The reducer's constructor allocates its
// buckets and its communication buffers under one category, told apart by
// the dense buckets' known bytes; the rest of it is communication.
// communication_buffers: staging of the coalesced parameter broadcast (zero
// when the parameters are contiguous, as here) and a sparse gradient's
// communication (its nnz, rows and values and their allgathers), which
// depends on the rows touched, and the used-parameter map (int32 a parameter,
// with find_unused_parameters or static_graph); workspace: the metrics buffer. total_bytes is
// their sum; peak_bytes the peak of that sum over the run. Checked against
// torch 1.13 and 2.x DDP (tests/compat/test_ddp_core_torch.py, MemoryTest).
//
// Imbalance: a rank whose peak resident set (host) or used device memory
// (GPU), or whose accounted total, is more than --imbalance-pct above the
// median of the other ranks is named, as in the classic "rank 0 uses more".
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "comm/measure.h"
#include "comm/memory.h"
#include "ddp_core/backward_sim.h"
#include "ddp_core/model_layout.h"
#include "ddp_core/param_broadcast.h"
#include "ddp_core/reducer.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/tools_analysis.h"
#include "diag/tools_common.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
using namespace ddpdiag::ddp_core;


struct MemoryOptions {
  CommonOptions common;
  std::string model = "resnet50";
  double bucket_cap_mb = 25;
  double first_bucket_mb = 1;
  std::string bucket_cap_mb_list;  // torch 2.x's bucket_cap_mb_list, "" when not given
  // DDP's gradient_as_bucket_view, False by default as in torch.
  bool gradient_views = false;
  bool find_unused = false;
  bool static_graph = false;
  bool set_last_bucket_cap = false;  // DDP_SET_LAST_BUCKET_CAP=1 (also read from the environment)
  int iters = 2;
  double workspace_mb = 1;
  double imbalance_pct = 10;
  bool no_comm_probe = false;
  // Test-only fault injection: "R:MB" makes rank R hold MB more workspace.
  std::string inject_extra = "";
};

// The largest --workspace-mb (MiB), as --caps' largest bucket cap.
constexpr double kMaxWorkspaceMb = 1e6;
json device_json(const DeviceMemoryInfo& d) {
  if (!d.available) return nullptr;
  return {{"free_bytes", d.free_bytes},
          {"total_bytes", d.total_bytes},
          {"used_bytes", d.total_bytes - d.free_bytes}};
}

void run(Job& job, reports::Report& report, const MemoryOptions& o) {
  const int me = job.rank(), n = job.size();
  const bool set_last = set_last_bucket_cap(o.set_last_bucket_cap);  // the flag, or the variable
  const BucketSizes sizes = bucket_sizes(o.bucket_cap_mb, o.first_bucket_mb, o.bucket_cap_mb_list, me, false);
  const BucketCapList& cap_list = sizes.list;
  const std::uint64_t cap_bytes = sizes.cap_bytes, first_bucket_bytes = sizes.first_bytes;
  if (!(o.workspace_mb >= 0 && o.workspace_mb <= kMaxWorkspaceMb))
    throw UsageError(fmt::format("--workspace-mb {} is not between 0 and {}", o.workspace_mb, kMaxWorkspaceMb),
                     {"flags", me, -1, "the default is 1"});
  const ModelLayout layout = load_model(o.model);
  check_unused_parameters(layout, o.find_unused || o.static_graph, "memory", true);
  const bool device = job.comm->memory_kind() == MemoryKind::kDevice;
  const int device_ordinal = job.world.local_rank;
  std::uint64_t inject_bytes = 0;
  if (!o.inject_extra.empty()) {
    const auto colon = o.inject_extra.find(':');
    try {
      if (colon == std::string::npos) throw std::invalid_argument("no colon");
      std::size_t used = 0;
      const int rank = std::stoi(o.inject_extra.substr(0, colon), &used);
      if (used != colon) throw std::invalid_argument("rank");
      const std::string mb_text = o.inject_extra.substr(colon + 1);
      const double mb = std::stod(mb_text, &used);
      // Bounded as --workspace-mb: a negative MB would wrap to 16 EiB.
      if (used != mb_text.size() || !(mb >= 0 && mb <= kMaxWorkspaceMb)) throw std::invalid_argument("MB");
      if (rank == me) inject_bytes = static_cast<std::uint64_t>(mb * kMiB);
    } catch (const std::exception&) {
      throw UsageError(fmt::format("--inject-extra '{}' is not RANK:MB (MB from 0 to {})", o.inject_extra,
                                   kMaxWorkspaceMb),
                       {"flags", me, -1, "e.g. --inject-extra 0:64"});
    }
  }

  // What a communicator costs: a second one over the same ranks, measured
  // around its initialisation and first collectives.
  json comm_probe = nullptr;
  if (!o.no_comm_probe) {
    const auto rss0 = read_process_memory();
    const auto dev0 = device ? device_memory_info(device_ordinal) : DeviceMemoryInfo{};
    auto probe = tools::make_extra_communicator(job, o.common, "memory/probe", n);
    const auto dev1 = device ? device_memory_info(device_ordinal) : DeviceMemoryInfo{};
    {
      CommBuffer one(*probe, 4 * 1024);
      std::vector<std::uint8_t> zeros(4 * 1024, 0);
      probe->copy_from_host(one.get(), zeros.data(), zeros.size());
      probe->allreduce(one.get(), one.get(), 1024, DType::kFloat32, ReduceOp::kSum)->wait(job.timeout);
      probe->barrier()->wait(job.timeout);
    }
    const auto dev2 = device ? device_memory_info(device_ordinal) : DeviceMemoryInfo{};
    const auto rss2 = read_process_memory();
    auto delta = [](std::uint64_t before, std::uint64_t after) {
      return static_cast<std::int64_t>(before) - static_cast<std::int64_t>(after);
    };
    comm_probe = {{"backend", std::string(backend_name(job.backend))},
                  {"rss_delta_bytes", rss0 && rss2 ? json(-delta(rss0->rss_bytes, rss2->rss_bytes)) : json()},
                  {"device_delta_init_bytes",
                   dev0.available && dev1.available ? json(delta(dev0.free_bytes, dev1.free_bytes)) : json()},
                  {"device_delta_first_collectives_bytes",
                   dev1.available && dev2.available ? json(delta(dev1.free_bytes, dev2.free_bytes)) : json()}};
    probe->barrier()->wait(job.timeout);
  }

  MemoryAccount account(*job.comm);
  AccountingCommunicator ac(*job.comm, account);
  // The reducer allocates the parameters' own gradients (views off) when
  // their first gradient is made, as torch its .grad: through this one, so
  // they are counted as gradients whenever that happens.
  AccountingCommunicator grads_ac(*job.comm, account, MemoryCategory::kGradients);
  json categories, peaks;
  std::int64_t wrong = 0;
  std::size_t bucket_count = 0;
  // What the reducer's constructor allocated beyond its dense buckets and
  // own gradients: a sparse bucket's nnz buffers (communication, not a
  // bucket: DDP gives a sparse bucket no flat buffer).
  std::uint64_t reducer_comm_bytes = 0;
  std::optional<ProcessMemory> rss;
  DeviceMemoryInfo dev;
  std::vector<json> all;
  int steps_done = 0;  // DDP steps this rank completed
  // A run that fails part-way (a peer lost, a timeout) still judges what it
  // can: rank 0's own gradients, and no imbalance without every rank's
  // summary.
  try {
    {
      ac.set_category(MemoryCategory::kParameters);
      LayoutParams params = allocate_layout_params(ac, layout);
      {
        std::vector<std::uint8_t> init(params.flat.bytes(), static_cast<std::uint8_t>(me + 1));
        ac.copy_from_host(params.flat.get(), init.data(), init.size());
      }
      ac.set_category(MemoryCategory::kCommBuffers);
      BroadcastOptions bo;
      bo.timeout = job.timeout;
      broadcast_parameters(ac, params.tensors, bo);

      // The broadcast's staging is freed before the reducer allocates its own
      // communication buffers: the category's peak is the larger of the two
      // phases', not their sum.
      const std::uint64_t comm_peak_before_reducer = account.peak_bytes(MemoryCategory::kCommBuffers);
      ac.set_category(MemoryCategory::kBuckets);
      ReducerOptions ro;
      ro.bucket_cap_bytes = cap_bytes;
      ro.first_bucket_bytes = first_bucket_bytes;
      ro.bucket_size_limits = cap_list.bytes;
      ro.gradient_as_bucket_view = o.gradient_views;
      ro.find_unused_parameters = o.find_unused;
      ro.static_graph = o.static_graph;
      ro.set_last_bucket_small = set_last;
      ro.gradient_allocator = &grads_ac;
      ro.timeout = job.timeout;
      // Every parameter is held and broadcast; only those that require grad
      // have gradients and buckets.
      const ModelLayout trainable = trainable_parameters(layout);
      Reducer red(ac, trainable, ro);
      // Parameters forward leaves unused (find_unused_parameters or
      // static_graph): no rank gives them a gradient.
      BackwardSimOptions sim;
      sim.unused = trainable.unused_in_backward();
      const UsedBy used_by = used_by_all_but(sim.unused, trainable.tensors.size());
      bucket_count = red.buckets().size();
      // Everything the constructor allocated was counted as buckets; keep there
      // only the dense buckets' flat buffers, the ones DDP allocates.
      std::uint64_t dense_bucket_bytes = 0;
      for (const auto& b : red.buckets())
        if (!b.spec.sparse) dense_bucket_bytes += b.spec.bytes;
      const std::uint64_t constructed = account.current_bytes(MemoryCategory::kBuckets);
      DDPDIAG_ASSERT(constructed >= dense_bucket_bytes);
      reducer_comm_bytes = constructed - dense_bucket_bytes;
      account.reset_peak(MemoryCategory::kCommBuffers);

      ac.set_category(MemoryCategory::kWorkspace);
      const std::size_t ws_bytes = std::max<std::size_t>(4, static_cast<std::size_t>(o.workspace_mb * kMiB) / 4 * 4);
      AccountedBuffer metrics(account, MemoryCategory::kWorkspace, ws_bytes);
      std::unique_ptr<AccountedBuffer> injected;
      if (inject_bytes) {
        injected = std::make_unique<AccountedBuffer>(account, MemoryCategory::kWorkspace, inject_bytes);
        // Touch it, so it is resident too.
        std::vector<std::uint8_t> ones(inject_bytes, 1);
        ac.copy_from_host(injected->get(), ones.data(), ones.size());
      }
      {
        std::vector<std::uint8_t> zeros(ws_bytes, 0);
        ac.copy_from_host(metrics.get(), zeros.data(), zeros.size());
      }
      // What the steps allocate through the communicator is communication
      // staging: a sparse gradient's rows and values and their allgathers.
      ac.set_category(MemoryCategory::kCommBuffers);
      for (int it = 0; it < o.iters; ++it) {
        ac.barrier()->wait(job.timeout);
        simulate_backward(red, ac, static_cast<std::uint64_t>(it), sim);
        red.finalize();
        wrong += check_gradients(red, ac, static_cast<std::uint64_t>(it), 1.0, 0, used_by).wrong;
        ac.allreduce(metrics.get(), metrics.get(), ws_bytes / 4, DType::kFloat32, ReduceOp::kSum)
            ->wait(job.timeout);
        ++steps_done;
      }
      // The snapshot of a DDP step: everything is still allocated here.
      rss = read_process_memory();
      if (device) dev = device_memory_info(device_ordinal);
      for (auto c : kAllMemoryCategories) {
        std::uint64_t cur = account.current_bytes(c), peak = account.peak_bytes(c);
        // The bucket category only grows (in the reducer's constructor), so
        // its peak is its current size and both split the same way.
        if (c == MemoryCategory::kBuckets) {
          cur -= reducer_comm_bytes;
          peak -= reducer_comm_bytes;
        }
        if (c == MemoryCategory::kCommBuffers) {
          cur += reducer_comm_bytes;
          peak = std::max(comm_peak_before_reducer, peak + reducer_comm_bytes);
        }
        categories[std::string(memory_category_name(c))] = cur;
        peaks[std::string(memory_category_name(c))] = peak;
      }
    }
    std::uint64_t total = 0;
    for (auto& [k, v] : categories.items()) total += v.get<std::uint64_t>();
    json mine = {{"rank", me},
                 {"host", job.ranks.size() > static_cast<std::size_t>(me) ? job.ranks[me].host : ""},
                 {"memory_kind", device ? "device" : "host"},
                 {"categories", categories},
                 {"category_peak_bytes", peaks},
                 {"total_bytes", total},
                 {"peak_bytes", account.total_peak_bytes()},
                 {"rss_bytes", rss ? json(rss->rss_bytes) : json()},
                 {"peak_rss_bytes", rss ? json(rss->peak_rss_bytes) : json()},
                 {"device", device_json(dev)},
                 {"device_note", device && !dev.available ? json(dev.reason) : json()},
                 {"communicator_probe", comm_probe},
                 {"wrong", wrong}};
    all = job.gather_to_root("memory/summary", mine);
  } catch (...) {
    if (me == 0) {
      report.add_check({"imbalance", reports::CheckStatus::kSkip,
                        "the run ended with an error before every rank's memory summary was gathered"});
      report.add_check({"correctness", wrong > 0 ? reports::CheckStatus::kFail : reports::CheckStatus::kSkip,
                        fmt::format("the run ended with an error before every rank's gradients were "
                                    "gathered; rank 0 alone: {} wrong gradient element(s) over {} of {} "
                                    "step(s)",
                                    wrong, steps_done, o.iters)});
    }
    throw;
  }
  if (me != 0) return;

  auto& res = report.results();
  res["model"] = layout.name;
  res["model_bytes"] = layout.total_bytes();
  res["bucket_cap_mb"] = cap_list.empty() ? o.bucket_cap_mb : cap_list.max_mb();
  // null when not given: report compare tells a run with a list from one without.
  res["bucket_cap_mb_list"] = cap_list.empty() ? json(nullptr) : json(cap_list.mb);
  res["bucket_cap_bytes"] = cap_bytes;
  res["first_bucket_bytes"] = first_bucket_bytes;
  res["bucket_count"] = bucket_count;
  res["gradient_as_bucket_view"] = o.gradient_views;
  res["find_unused_parameters"] = o.find_unused;
  res["static_graph"] = o.static_graph;
  res["set_last_bucket_cap"] = set_last;
  res["iters"] = o.iters;
  // The metrics buffer's size (--workspace-mb): the workspace category and
  // every total and peak grow with it, so compare treats it as a setting.
  res["workspace_mb"] = o.workspace_mb;
  res["memory_kind"] = device ? "device" : "host";
  res["categories"] = json::array();
  for (auto c : kAllMemoryCategories) res["categories"].push_back(std::string(memory_category_name(c)));
  res["ranks"] = all;
  res["imbalance_pct"] = o.imbalance_pct;

  // Imbalance, per metric.
  std::vector<double> totals, process;
  const char* process_metric = device ? "device_used_bytes" : "peak_rss_bytes";
  bool have_process = true;
  std::int64_t wrong_total = 0;
  for (const auto& r : all) {
    totals.push_back(r["total_bytes"].get<double>());
    wrong_total += r["wrong"].get<std::int64_t>();
    const json& v = device ? (r["device"].is_object() ? r["device"]["used_bytes"] : json()) : r["peak_rss_bytes"];
    if (v.is_number()) process.push_back(v.get<double>());
    else have_process = false;
  }
  json flagged = json::array();
  std::vector<std::string> named;
  auto flag = [&](const char* metric, const std::vector<double>& v) {
    for (int r : tools::ranks_above_median(v, o.imbalance_pct)) {
      const double med = tools::median_of_others(v, static_cast<std::size_t>(r));
      const double pct = med > 0 ? 100 * (v[r] / med - 1) : 0;
      flagged.push_back({{"rank", r}, {"metric", metric}, {"bytes", v[r]}, {"median_bytes", med},
                         {"pct_above_median", pct}});
      named.push_back(fmt::format("rank {} {} {:.1f} MiB is {:.1f}% above the other ranks' median {:.1f} MiB",
                                  r, metric, v[r] / kMiB, pct, med / kMiB));
    }
  };
  flag("total_bytes", totals);
  if (have_process) flag(process_metric, process);
  res["imbalanced_ranks"] = flagged;
  res["median_total_bytes"] = median(totals);
  res["wrong_total"] = wrong_total;

  std::string detail;
  for (std::size_t i = 0; i < named.size(); ++i) detail += (i ? "; " : "") + named[i];
  report.add_check({"imbalance", tools::pass_if(named.empty()),
                    named.empty() ? fmt::format("every rank within {}% of the other ranks' median", o.imbalance_pct)
                                  : detail});
  std::string wrong_ranks;  // "rank 1: 4, rank 2: 1"
  for (std::size_t r = 0; r < all.size(); ++r)
    if (const auto w = all[r]["wrong"].get<std::int64_t>(); w > 0)
      wrong_ranks += fmt::format("{}rank {}: {}", wrong_ranks.empty() ? "" : ", ", r, w);
  report.add_check({"correctness", tools::pass_if(wrong_total == 0),
                    wrong_total == 0
                        ? fmt::format("0 wrong gradient elements over {} step(s) on each of {} rank(s)", o.iters, n)
                        : fmt::format("{} wrong gradient element(s) over {} step(s), summed over {} rank(s) "
                                      "({})",
                                      wrong_total, o.iters, n, wrong_ranks)});

  std::printf("# ddpdiag memory: %d rank(s), backend %s (%s memory), model %s (%.1f MiB), %zu "
              "bucket(s) of %s MiB, gradient views %s, %d DDP step(s)%s\n",
              n, std::string(backend_name(job.backend)).c_str(), device ? "device" : "host",
              layout.name.c_str(), static_cast<double>(layout.total_bytes()) / kMiB, bucket_count,
              cap_list.empty() ? fmt::format("cap {:g}", o.bucket_cap_mb).c_str()
                               : fmt::format("caps {}", cap_list.text()).c_str(),
              o.gradient_views ? "on" : "off", o.iters,
              set_last_bucket_cap_note(set_last, o.find_unused, o.static_graph)
                  .c_str());
  std::printf("# %4s %10s %10s %10s %10s %10s %10s %10s %10s %10s %12s\n", "rank", "params",
              "grads", "buckets", "comm", "workspace", "total", "peak", "rss", "peak rss",
              device ? "dev used" : "comm init");
  std::printf("# %4s %10s %10s %10s %10s %10s %10s %10s %10s %10s %12s\n", "", "(MiB)", "(MiB)",
              "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)", "(MiB)");
  auto mib = [](const json& v) { return v.is_number() ? fmt::format("{:.2f}", v.get<double>() / kMiB) : std::string("-"); };
  for (const auto& r : all) {
    const auto& c = r["categories"];
    std::string last;
    if (device) last = r["device"].is_object() ? mib(r["device"]["used_bytes"]) : "-";
    else last = r["communicator_probe"].is_object() ? mib(r["communicator_probe"]["rss_delta_bytes"]) : "-";
    std::printf("  %4d %10s %10s %10s %10s %10s %10s %10s %10s %10s %12s\n", r["rank"].get<int>(),
                mib(c["parameters"]).c_str(), mib(c["gradients"]).c_str(), mib(c["buckets"]).c_str(),
                mib(c["communication_buffers"]).c_str(), mib(c["workspace"]).c_str(),
                mib(r["total_bytes"]).c_str(), mib(r["peak_bytes"]).c_str(), mib(r["rss_bytes"]).c_str(),
                mib(r["peak_rss_bytes"]).c_str(), last.c_str());
  }
  if (device)
    for (const auto& r : all)
      if (r["communicator_probe"].is_object())
        std::printf("# rank %d: NCCL communicator init took %s MiB of device memory, its first "
                    "collectives %s MiB\n",
                    r["rank"].get<int>(), mib(r["communicator_probe"]["device_delta_init_bytes"]).c_str(),
                    mib(r["communicator_probe"]["device_delta_first_collectives_bytes"]).c_str());
  print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_memory_command(CLI::App& parent) {
  auto opts = std::make_shared<MemoryOptions>();
  auto* app = parent.add_subcommand(
      "memory",
      "Per-rank memory of a DDP step by category (parameters, gradients, buckets, communication "
      "buffers, workspace), RSS and peak, GPU free/total and NCCL's share; flags imbalance");
  add_common_options(app, opts->common);
  app->add_option("--model", opts->model, "Preset (resnet50, bert-large, gpt2, mlp) or JSON layout file")
      ->capture_default_str();
  auto* cap = app->add_option("--bucket-cap-mb", opts->bucket_cap_mb, "DDP's bucket_cap_mb")
                   ->check(cli::bucket_mb_value(false));
  // torch 2.x caps the first bucket with an explicit bucket_cap_mb too
  // (DDP(..., bucket_cap_mb=X): pass --first-bucket-mb X); 1.13 always 1 MiB.
  auto* first = app->add_option("--first-bucket-mb", opts->first_bucket_mb,
                                "Size limit of DDP's first bucket (MiB; 1; torch 2.x with an explicit "
                                "bucket_cap_mb X uses X)")
                    ->check(cli::bucket_mb_value(false));
  cli::add_cap_list_option(app, opts->bucket_cap_mb_list, false, {cap, first});
  cli::add_gradient_view_flags(app, opts->gradient_views);
  app->add_flag("--find-unused-parameters", opts->find_unused,
                "DDP's find_unused_parameters=True: the buckets it keeps unrebuilt (a model with "
                "parameters forward never uses needs it, or --static-graph)");
  app->add_flag("--static-graph", opts->static_graph,
                "DDP's static_graph=True: the buckets it rebuilds (see buckets --static-graph)");
  cli::add_set_last_bucket_cap_flag(app, opts->set_last_bucket_cap);
  app->add_option("-n,--iters", opts->iters, "DDP steps to run")->check(cli::positive_number());
  // Bounded as --caps: a value beyond it is a typo, not a buffer to allocate
  // (and a negative one would wrap around to 16 EiB).
  app->add_option("--workspace-mb", opts->workspace_mb,
                  "Size of the all-reduced metrics buffer (MiB, 0 to 1e6; 0: 4 bytes)")
      ->check(cli::number_in_range(0, kMaxWorkspaceMb));
  app->add_option("--imbalance-pct", opts->imbalance_pct,
                  "Flag a rank more than this % above the median of the other ranks")
      ->check(cli::non_negative_number());
  app->add_flag("--no-comm-probe", opts->no_comm_probe,
                "Skip measuring a second communicator's initialisation");
  app->add_option("--inject-extra", opts->inject_extra,
                  "Test only: RANK:MB makes that rank hold MB more workspace")
      ->group("");
  return {app, [opts] {
            return run_distributed(
                opts->common, "memory",
                [opts](Job& job, reports::Report& report) { run(job, report, *opts); },
                // Every parameter, and the buckets; the gradients' own
                // buffers unless they are views of the buckets.
                [opts](const Job& job) {
                  // The workspace too, where its size is one run() takes.
                  const bool ws = opts->workspace_mb >= 0 && opts->workspace_mb <= kMaxWorkspaceMb;
                  refuse_sparse_on_device(job, opts->model);
                  check_layout_memory(job, opts->model, opts->gradient_views ? 1 : 2, 1, std::nullopt,
                                      ws ? static_cast<long double>(opts->workspace_mb) * kMiB : 0,
                                      "the workspace of --workspace-mb");
                });
          }};
}

}  // namespace ddpdiag::cli
