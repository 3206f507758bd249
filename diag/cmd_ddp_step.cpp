// ddpdiag ddp-step: one DDP training step without a model. A simulated
// backward pass produces the layout's gradients in backward's order (the
// layout's ready order: by default the reverse of the parameters; with a
// compute time proportional to size, or none) while the bucketed reducer
// all-reduces them; reports the time per iteration, the communication time,
// the part of it not hidden behind backward, and whether every gradient
// element is the true mean on every rank.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <optional>

#include <fmt/core.h>

#include "ddp_core/backward_sim.h"
#include "ddp_core/model_layout.h"
#include "ddp_core/reducer.h"
#include "diag/cli_common.h"
#include "diag/commands.h"

namespace ddpdiag::cli {

namespace {

using namespace ddp_core;

struct DdpStepOptions {
  CommonOptions common;
  std::string model = "resnet50";
  double bucket_cap_mb = 25;
  double first_bucket_mb = 1;
  std::string bucket_cap_mb_list;  // torch 2.x's bucket_cap_mb_list, "" when not given
  int iters = 10;
  int warmup = 2;
  double compute_gbps = 0;
  bool views = false;  // DDP's gradient_as_bucket_view, False by default as in torch
  std::string hook = "none";
  bool find_unused = false;
  bool static_graph = false;
  bool skip_unused = false;  // torch 2.x's skip_all_reduce_unused_params
  bool first_iteration = false;  // the buckets DDP reduces before it rebuilds them
  bool set_last_bucket_cap = false;  // DDP_SET_LAST_BUCKET_CAP=1 (also read from the environment)
  bool avg_op = false;
  bool no_check = false;
  std::optional<std::int64_t> sparse_rows;  // unset: the simulator's default
};

void run(Job& job, reports::Report& report, const DdpStepOptions& o) {
  // Frozen parameters have no gradient: DDP reduces the others only.
  const ModelLayout layout = trainable_parameters(load_model(o.model));
  check_unused_parameters(layout, o.find_unused || o.static_graph, "ddp-step", true);
  // Parameters unused in forward (left out of the layout's ready_order):
  // with find_unused_parameters DDP finds them before backward and reduces
  // the rest (with static_graph it knows them from its first iteration, and
  // marks them ready at backward's first gradient); no rank gives them a
  // gradient.
  const std::vector<std::size_t> unused = layout.unused_in_backward();
  const UsedBy used_by = used_by_all_but(unused, layout.tensors.size());
  ReducerOptions ro;
  const BucketSizes sizes = bucket_sizes(o.bucket_cap_mb, o.first_bucket_mb, o.bucket_cap_mb_list, job.rank(), false);
  const BucketCapList& cap_list = sizes.list;
  ro.bucket_cap_bytes = sizes.cap_bytes;
  ro.first_bucket_bytes = sizes.first_bytes;
  ro.bucket_size_limits = cap_list.bytes;
  ro.gradient_as_bucket_view = o.views;
  ro.find_unused_parameters = o.find_unused;
  ro.static_graph = o.static_graph;
  ro.skip_all_reduce_unused_params = o.skip_unused;
  ro.first_iteration_buckets = o.first_iteration;
  // As DDP over a run: its first iteration (two with static_graph) on the
  // constructor's buckets, then the ones it rebuilds from rank 0's order
  // (never with find_unused_parameters alone).
  ro.rebuild_buckets = !o.first_iteration;
  ro.set_last_bucket_small = set_last_bucket_cap(o.set_last_bucket_cap);
  ro.averaging = o.avg_op ? Averaging::kAvgOp : Averaging::kDivideThenSum;
  ro.timeout = job.timeout;
  const auto hook = parse_compression_hook(o.hook);
  if (!hook)
    throw UsageError(fmt::format("unknown --hook '{}'", o.hook),
                     {"flags", job.rank(), -1, "use none, fp16 or bf16"});
  ro.hook = *hook;
  if (o.compute_gbps < 0)
    throw UsageError("--compute-gbps must be >= 0", {"flags", job.rank(), -1, "0 means no compute time"});
  check_backward_rate(layout.gradient_bytes(), o.compute_gbps, job.rank());

  if (o.sparse_rows && *o.sparse_rows < 0)
    throw UsageError(fmt::format("--sparse-rows must be >= 0, got {}", *o.sparse_rows),
                     {"flags", job.rank(), -1,
                      "rows touched per sparse parameter per iteration (default min(rows, 512))"});

  // torch calls the comm hook on a sparse bucket too: fp16_compress_hook
  // then fails in backward on Gloo ("cadd_sparse" not implemented for
  // 'Half'), and bf16_compress_hook rounds the sparse values to bf16. The
  // sparse path here reduces exactly: refused rather than passed.
  if (ro.hook != CompressionHook::kNone &&
      std::any_of(layout.tensors.begin(), layout.tensors.end(),
                  [](const TensorSpec& t) { return t.expects_sparse && t.requires_grad; }))
    throw UsageError(
        fmt::format("--hook {} with sparse gradients is not modelled: torch calls the hook on the "
                    "sparse bucket too, where fp16_compress_hook fails on Gloo (\"cadd_sparse\" not "
                    "implemented for 'Half') and bf16_compress_hook rounds the sparse values",
                    o.hook),
        {"flags", job.rank(), -1,
         "run without --hook, or with a layout without sparse tensors (\"sparse\": false)"});

  Reducer red(*job.comm, layout, ro);
  // The buckets of the run once rebuilt (every rank makes its gradients
  // ready in the layout's order, so rank 0's order is that one), and the
  // iteration (from 0) that first runs them.
  const std::size_t first_buckets = red.buckets().size();
  const std::size_t run_buckets =
      o.first_iteration ? first_buckets
                        : ddp_buckets_as_run(layout, red.bucket_size_limits(), ro.find_unused_parameters,
                                             ro.static_graph, ro.set_last_bucket_small)
                              .size();
  const int rebuild_at = static_cast<int>(red.rebuild_planned_before_iteration().value_or(0));
  BackwardSimOptions so;
  so.compute_gbps = o.compute_gbps;
  so.sparse_rows = o.sparse_rows;
  so.unused = unused;
  const bool any_sparse = std::any_of(layout.tensors.begin(), layout.tensors.end(),
                                      [](const TensorSpec& t) { return t.expects_sparse; });
  // Hooks round in 16 bits: the values are small integers, exact there too,
  // so the check stays exact with every option.
  auto& res = report.results();
  res["model"] = layout.name;
  res["params"] = layout.tensors.size();
  res["param_bytes"] = layout.total_bytes();
  res["bucket_cap_bytes"] = ro.bucket_cap_bytes;
  res["first_bucket_bytes"] = ro.first_bucket_bytes;
  // null when not given: report compare tells a run with a list from one without.
  res["bucket_cap_mb_list"] = cap_list.empty() ? nlohmann::json(nullptr) : nlohmann::json(cap_list.mb);
  res["buckets"] = run_buckets;
  res["first_iteration_buckets"] = first_buckets;
  res["gradient_as_bucket_view"] = ro.gradient_as_bucket_view;
  res["hook"] = std::string(compression_hook_name(ro.hook));
  res["find_unused_parameters"] = ro.find_unused_parameters;
  res["static_graph"] = ro.static_graph;
  res["skip_all_reduce_unused_params"] = o.skip_unused;
  res["first_iteration"] = o.first_iteration;
  res["set_last_bucket_cap"] = ro.set_last_bucket_small;
  res["averaging"] = o.avg_op ? "avg_op" : "divide_then_sum";
  res["compute_gbps"] = o.compute_gbps;
  res["iters"] = o.iters;
  res["warmup_iters"] = o.warmup;
  if (any_sparse) res["sparse_rows"] = o.sparse_rows.value_or(kDefaultSparseRows);

  if (job.rank() == 0) {
    std::printf("# ddpdiag ddp-step: %d rank(s), backend %s, model %s (%zu tensors, %.1f MiB)\n",
                job.size(), std::string(backend_name(job.backend)).c_str(), layout.name.c_str(),
                layout.tensors.size(), static_cast<double>(layout.total_bytes()) / (1 << 20));
    const std::string caps = cap_list.empty()
                                 ? fmt::format("cap {:.1f} MiB, first {:.1f} MiB", o.bucket_cap_mb, o.first_bucket_mb)
                                 : fmt::format("bucket_cap_mb_list {} MiB", cap_list.text());
    std::printf("# %zu buckets, %s, views %s, hook %s, averaging %s, "
                "find_unused_parameters %s%s, compute %.3g GB/s\n",
                run_buckets, caps.c_str(),
                ro.gradient_as_bucket_view ? "on" : "off", o.hook.c_str(),
                o.avg_op ? "avg op" : ro.hook != CompressionHook::kNone ? "cast, divide, then sum" : "divide then sum",
                o.find_unused ? "on" : "off",
                (std::string(o.static_graph ? ", static_graph on" : "") +
                 (o.skip_unused ? ", skip_all_reduce_unused_params on" : "") +
                 (o.first_iteration ? ", DDP's first-iteration buckets" : "") +
                 set_last_bucket_cap_note(ro.set_last_bucket_small, o.find_unused, o.static_graph, o.first_iteration))
                    .c_str(),
                o.compute_gbps);
    if (rebuild_at > 0)
      std::printf("# as DDP: iteration%s on its first-iteration buckets (%zu), then the %zu it "
                  "rebuilds from rank 0's gradient order%s\n",
                  rebuild_at == 1 ? " 0" : "s 0 and 1", first_buckets, run_buckets,
                  o.warmup >= rebuild_at
                      ? " (within the warm-up)"
                      : fmt::format("; with -w {} the {} the first-iteration buckets", o.warmup,
                                    rebuild_at - o.warmup == 1 ? "first timed iteration runs"
                                                               : "first two timed iterations run")
                            .c_str());
    std::fflush(stdout);
  }

  std::vector<double> iter_us, backward_us, comm_us, exposed_us;
  std::int64_t wrong = 0, checked = 0, unused_elements = 0;
  nlohmann::json first_wrong;  // this rank's first wrong element
  nlohmann::json timeline = nlohmann::json::array();
  int done = 0;  // iterations this rank completed
  std::vector<nlohmann::json> all;
  try {
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      job.comm->barrier()->wait(job.timeout);
      const auto bw = simulate_backward(red, *job.comm, static_cast<std::uint64_t>(it), so);
      red.finalize();
      const auto& tm = red.last_timing();
      if (!o.no_check) {
        const auto c = check_gradients(red, *job.comm, static_cast<std::uint64_t>(it), 1.0, 0, used_by,
                                       so.sparse_rows);
        if (c.wrong > 0 && wrong == 0) {
          const auto& t = red.layout().tensors[static_cast<std::size_t>(c.first_wrong_param)];
          first_wrong = {{"iteration", it},
                         {"parameter", t.name},
                         {"parameter_index", c.first_wrong_param},
                         {"element", c.first_wrong_element},
                         {"got", c.first_wrong_have},
                         {"expected", c.first_wrong_want}};
        }
        wrong += c.wrong;
        checked += c.checked;
        unused_elements += c.unused;
      }
      done = it + 1;
      if (it < o.warmup) continue;
      iter_us.push_back(tm.iteration_us());
      backward_us.push_back(bw.backward_us());
      comm_us.push_back(tm.comm_span_us());
      exposed_us.push_back(tm.exposed_comm_us());
      if (it == o.warmup + o.iters - 1) {
        auto rel = [&](ReducerClock::time_point t) {
          return t == ReducerClock::time_point{} ? nlohmann::json(nullptr)
                                                  : nlohmann::json(std::chrono::duration<double, std::micro>(t - bw.start).count());
        };
        for (std::size_t b = 0; b < tm.buckets.size(); ++b)
          timeline.push_back({{"bucket", b},
                              {"bytes", red.buckets()[b].spec.bytes},
                              {"tensors", red.buckets()[b].spec.tensor_count()},
                              {"sparse", tm.buckets[b].sparse},
                              {"payload_bytes", tm.buckets[b].payload_bytes},
                              {"all_reduce_skipped", tm.buckets[b].skipped},
                              {"ready_us", rel(tm.buckets[b].ready)},
                              {"launched_us", rel(tm.buckets[b].launched)},
                              {"completed_us", rel(tm.buckets[b].completed)}});
        timeline.push_back({{"backward_end_us", rel(bw.end)}, {"finalize_end_us", rel(tm.finalize_end)}});
      }
      job.progress_line(fmt::format("[progress] iteration {} of {}", it + 1, o.warmup + o.iters));
    }

    const nlohmann::json mine = {{"time_per_iter_us", median(iter_us)},
                                 {"backward_us", median(backward_us)},
                                 {"comm_us", median(comm_us)},
                                 {"exposed_comm_us", median(exposed_us)},
                                 {"wrong", wrong},
                                 {"checked", checked},
                                 {"unused_elements", unused_elements},
                                 {"first_wrong", first_wrong},
                                 {"timeline", timeline}};
    all = job.gather_to_root("ddp-step/result", mine);
    const auto at = red.rebuilt_before_iteration();
    res["buckets_rebuilt_before_iteration"] = at ? nlohmann::json(*at) : nlohmann::json(nullptr);
  } catch (...) {
    // A run that fails part-way: rank 0 knows its own gradients only. Wrong
    // ones fail the check; else it is skip, saying how far the run came.
    if (job.rank() == 0) {
      if (o.no_check)
        report.add_check({"gradients_correct", reports::CheckStatus::kSkip, "--no-check"});
      else
        report.add_check({"gradients_correct",
                          wrong > 0 ? reports::CheckStatus::kFail : reports::CheckStatus::kSkip,
                          fmt::format("the run ended with an error before every rank's gradients "
                                      "were gathered; rank 0 alone: {} wrong of {} gradient "
                                      "elements over {} of {} iteration(s)",
                                      wrong, checked, done, o.warmup + o.iters)});
    }
    throw;
  }
  if (job.rank() != 0) return;
  double t = 0, b = 0, c = 0, e = 0;
  std::int64_t wrong_total = 0, checked_total = 0, unused_total = 0;
  nlohmann::json per_rank = nlohmann::json::array();
  for (std::size_t r = 0; r < all.size(); ++r) {
    const auto& j = all[r];
    // The slowest rank sets the step time, as in training.
    t = std::max(t, j["time_per_iter_us"].get<double>());
    b = std::max(b, j["backward_us"].get<double>());
    c = std::max(c, j["comm_us"].get<double>());
    e = std::max(e, j["exposed_comm_us"].get<double>());
    wrong_total += j["wrong"].get<std::int64_t>();
    checked_total += j["checked"].get<std::int64_t>();
    unused_total += j["unused_elements"].get<std::int64_t>();
    nlohmann::json pr = j;
    pr.erase("timeline");
    pr["rank"] = r;
    per_rank.push_back(pr);
  }
  res["time_per_iter_us"] = t;
  res["backward_us"] = b;
  res["comm_us"] = c;
  res["exposed_comm_us"] = e;
  res["wrong"] = wrong_total;
  res["checked_elements"] = checked_total;
  // Parameters no rank used (find_unused_parameters): torch leaves their
  // .grad None, so they are no part of the check. The same on every rank.
  nlohmann::json unused_names = nlohmann::json::array();
  for (std::size_t p : red.globally_unused()) unused_names.push_back(red.layout().tensors[p].name);
  res["unused_parameters"] = unused_names;
  std::string unused_note;
  if (!unused_names.empty()) {
    std::string names;
    for (std::size_t i = 0; i < unused_names.size() && i < 8; ++i)
      names += (i ? ", " : "") + unused_names[i].get<std::string>();
    if (unused_names.size() > 8) names += fmt::format(", ... ({} in all)", unused_names.size());
    unused_note = fmt::format("; not compared: {} element(s) of the parameter(s) no rank used ({}), "
                              "which torch leaves without a gradient (.grad None)",
                              unused_total, names);
  }
  res["per_rank"] = per_rank;
  res["timeline_rank0"] = all.empty() ? nlohmann::json::array() : all[0]["timeline"];
  if (o.no_check)
    report.add_check({"gradients_correct", reports::CheckStatus::kSkip, "--no-check"});
  else {
    // Which ranks got wrong gradients, and where the first one was.
    std::string where;
    for (std::size_t r = 0; r < all.size(); ++r) {
      const auto w = all[r]["wrong"].get<std::int64_t>();
      if (w == 0) continue;
      where += fmt::format("{}rank {}: {}", where.empty() ? "; wrong on " : ", ", r, w);
      const auto& f = all[r]["first_wrong"];
      if (f.is_object())
        where += fmt::format(" (first: {}[{}] = {} instead of {}, iteration {})",
                             f.value("parameter", std::string("?")), f.value("element", -1L),
                             f.value("got", 0.0), f.value("expected", 0.0), f.value("iteration", -1));
    }
    report.add_check({"gradients_correct",
                      wrong_total == 0 ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                      fmt::format("{} wrong of {} gradient elements, summed over {} rank(s) and "
                                  "{} iteration(s){}{}",
                                  wrong_total, checked_total, job.size(), o.warmup + o.iters,
                                  where, unused_note)});
  }
  std::printf("# %14s %14s %14s %14s %10s\n", "time/iter(us)", "backward(us)", "comm(us)",
              "exposed(us)", "#wrong");
  std::printf("  %14.1f %14.1f %14.1f %14.1f %10lld\n", t, b, c, e,
              static_cast<long long>(wrong_total));
  print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_ddp_step_command(CLI::App& parent) {
  auto opts = std::make_shared<DdpStepOptions>();
  auto* app = parent.add_subcommand(
      "ddp-step",
      "Simulated backward + DDP's bucketed reducer: time per step, exposed communication, "
      "gradient correctness");
  add_common_options(app, opts->common);
  app->add_option("--model", opts->model, "Preset (resnet50, bert-large, gpt2, mlp) or JSON layout file")
      ->capture_default_str();
  auto* cap = app->add_option("--bucket-cap-mb", opts->bucket_cap_mb, "DDP's bucket_cap_mb")
                   ->capture_default_str()
                   ->check(cli::bucket_mb_value(false));
  auto* first = app->add_option("--first-bucket-mb", opts->first_bucket_mb, "Size limit of the first bucket")
                    ->capture_default_str()
                    ->check(cli::bucket_mb_value(false));
  add_cap_list_option(app, opts->bucket_cap_mb_list, false, {cap, first});
  app->add_option("-n,--iters", opts->iters, "Timed iterations")->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up iterations")
      ->check(cli::non_negative_number());
  app->add_option("--compute-gbps", opts->compute_gbps,
                  "Simulated gradient compute rate in GB/s (0: no compute time)")
      ->capture_default_str()
      ->check(cli::non_negative_number());
  cli::add_gradient_view_flags(app, opts->views);
  app->add_option("--hook", opts->hook, "Compression hook: none, fp16, bf16")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            return parse_compression_hook(s) ? "" : "'" + s + "' is not none, fp16 or bf16";
          },
          "HOOK", "HOOK"));
  app->add_flag("--find-unused-parameters", opts->find_unused, "DDP's find_unused_parameters=True");
  app->add_flag("--static-graph", opts->static_graph,
                "DDP's static_graph=True: the buckets it rebuilds (see buckets --static-graph), "
                "parameters unused in backward allowed, used ones agreed once");
  add_skip_unused_flag(app, opts->skip_unused,
                       "no all_reduce for a bucket whose parameters are all unused (with "
                       "--find-unused-parameters or --static-graph)");
  app->add_flag("--first-iteration", opts->first_iteration,
                "Run the buckets DDP reduces before it rebuilds them (its first iteration; see buckets "
                "--first-iteration) in every iteration: what DDP's first step costs");
  add_set_last_bucket_cap_flag(app, opts->set_last_bucket_cap);
  app->add_flag("--avg-op", opts->avg_op, "Average with the AVG op instead of dividing first");
  app->add_flag("--no-check", opts->no_check, "Skip the gradient check");
  app->add_option(
      "--sparse-rows", opts->sparse_rows,
      "Rows each rank touches per sparse parameter per iteration (default min(rows, 512))")
      ->check(cli::int64_value());
  return {app, [opts] {
            return run_distributed(
                opts->common, "ddp-step",
                [opts](Job& job, reports::Report& r) { run(job, r, *opts); },
                // The buckets, and each gradient's own buffer unless they
                // are views of the buckets.
                [opts](const Job& job) {
                  refuse_sparse_on_device(job, opts->model);
                  check_layout_memory(job, opts->model, opts->views ? 1 : 2, 0, opts->sparse_rows);
                });
          }};
}

}  // namespace ddpdiag::cli
