// ddpdiag broadcast-test: DDP's start-of-training parameter broadcast for a
// model layout, timed per chunk size (coalesced chunks from rank 0, at most
// two in flight). Before every broadcast each rank other than 0 refills its
// tensors with its own pattern, and after it every rank checksums what it
// holds against the checksums of rank 0's pattern, computed locally: a
// broadcast that delivers nothing, or corrupts rank 0's own copy, fails the
// iteration it happened in, and the wrong ranks are named at any world size.
// One all_gather per chunk size collects the checks (ddp_core::broadcast_series).
#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>

#include <fmt/core.h>

#include "ddp_core/model_layout.h"
#include "ddp_core/param_broadcast.h"
#include "diag/cli_common.h"
#include "diag/commands.h"

namespace ddpdiag::cli {

namespace {

using namespace ddp_core;

struct BroadcastTestOptions {
  CommonOptions common;
  std::string model = "resnet50";
  std::string chunk_mb = "250,64,16";
  int iters = 5;
  int warmup = 1;
  int corrupt_rank = -1;  // testing seam: this rank flips a byte after every broadcast
};

// The largest --chunk-mb, as --caps' largest bucket cap.
constexpr double kMaxChunkMb = 1e6;

// --chunk-mb's sizes in bytes, in the order given. Throws UsageError naming
// the entry that is not a size of at least one byte.
std::vector<std::uint64_t> parse_chunks(const std::string& s, int rank) {
  std::vector<std::uint64_t> out;
  for (const auto& item : split_list(s, "--chunk-mb", "250,64,16", rank)) {
    double v = 0;
    try {
      std::size_t used = 0;
      v = std::stod(item, &used);
      if (used != item.size()) v = -1;
    } catch (const std::exception&) {
      v = -1;
    }
    if (!(v > 0) || v > kMaxChunkMb)
      throw UsageError(fmt::format("--chunk-mb: '{}' is not a positive number of MiB (at most 1e6)", item),
                       {"flags", rank, -1, "pass a comma-separated list such as 250,64,16"});
    // Chunks are whole bytes: what rounds down to none cannot be broadcast.
    const auto bytes = static_cast<std::uint64_t>(v * kMiB);
    if (bytes == 0)
      throw UsageError(fmt::format("--chunk-mb: '{}' MiB rounds down to 0 bytes", item),
                       {"flags", rank, -1,
                        "the smallest chunk is 1 byte, --chunk-mb 0.000001 (a chunk holds at least "
                        "one tensor whatever its size)"});
    // Named twice, measured once (as bucket-sweep's --caps).
    if (std::find(out.begin(), out.end(), bytes) == out.end()) out.push_back(bytes);
  }
  if (out.empty())
    throw UsageError("--chunk-mb is empty", {"flags", rank, -1, "pass e.g. 250,64,16"});
  return out;
}

void run(Job& job, reports::Report& report, const BroadcastTestOptions& o) {
  const ModelLayout layout = load_model(o.model);
  // DDP broadcasts every parameter, frozen ones too, but torch refuses to
  // wrap a module without a trainable one, so no broadcast ever happens.
  (void)trainable_parameters(layout);
  const auto chunk_sizes = parse_chunks(o.chunk_mb, job.rank());
  if (o.corrupt_rank >= job.size())
    throw UsageError(fmt::format("--corrupt-rank {} is outside the world of {}", o.corrupt_rank,
                                 job.size()),
                     {"flags", job.rank(), -1, "pass a rank in 0..world_size-1"});
  Communicator& comm = *job.comm;
  LayoutParams lp = allocate_layout_params(comm, layout);
  // What every rank must hold after each broadcast: rank 0's start pattern,
  // hashed here without any communication, so a wrong rank 0 is seen too.
  const std::vector<std::uint64_t> expected = start_pattern_checksums(lp.tensors, 0);

  auto& res = report.results();
  res["model"] = layout.name;
  res["tensors"] = layout.tensors.size();
  res["bytes"] = layout.total_bytes();
  res["iters"] = o.iters;
  res["warmup_iters"] = o.warmup;
  res["rows"] = nlohmann::json::array();
  if (job.rank() == 0) {
    std::printf("# ddpdiag broadcast-test: %d rank(s), backend %s, model %s (%zu tensors, %.1f MiB)\n",
                job.size(), std::string(backend_name(job.backend)).c_str(), layout.name.c_str(),
                layout.tensors.size(), static_cast<double>(layout.total_bytes()) / (1 << 20));
    std::printf("# %12s %8s %12s %10s %12s %10s\n", "chunk(B)", "chunks", "time(us)",
                "algbw(GB/s)", "checksum(us)", "identical");
    std::fflush(stdout);
  }

  bool all_identical = true;
  std::string detail;
  std::size_t measured = 0;  // chunk sizes rank 0 has judged
  // Rank 0's check, also when the run fails part-way (complete false): on
  // the chunk sizes measured so far, or skip when none was.
  const auto judge = [&](bool complete) {
    if (job.rank() != 0) return;
    if (!complete && measured == 0) {
      report.add_check({"parameters_identical", reports::CheckStatus::kSkip,
                        "the run ended with an error before any chunk size was measured"});
      return;
    }
    const std::string partial =
        complete ? std::string()
                 : fmt::format(" (the run ended with an error after {} of {} chunk size(s))",
                               measured, chunk_sizes.size());
    report.add_check({"parameters_identical",
                      all_identical ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                      (all_identical ? fmt::format("every rank's checksums of all {} tensors match "
                                                   "rank 0's known values after each of the {} "
                                                   "broadcast(s) per chunk size on {} rank(s)",
                                                   layout.tensors.size(), o.warmup + o.iters,
                                                   job.size())
                                     : detail) +
                          partial});
  };
  try {
    for (std::size_t ci = 0; ci < chunk_sizes.size(); ++ci) {
      BroadcastSeriesOptions so;
      so.broadcast.chunk_bytes = chunk_sizes[ci];
      so.broadcast.timeout = job.timeout;
      so.warmup = o.warmup;
      so.iters = o.iters;
      if (job.rank() == o.corrupt_rank && !lp.tensors.empty())
        so.after_broadcast = [&](int) {
          // The middle tensor's first byte, so the message has a name to show.
          const auto& t = lp.tensors[lp.tensors.size() / 2];
          std::uint8_t b = 0;
          comm.copy_to_host(&b, t.data, 1);
          b ^= 0x5a;
          comm.copy_from_host(t.data, &b, 1);
        };
      const BroadcastSeries series = broadcast_series(comm, lp.tensors, expected, so);
      const BroadcastOptions& bo = so.broadcast;
      const BroadcastStats& st = series.stats;
      const ChecksumVerdict& verdict = series.verdict;
      const auto gathered = job.gather_to_root(
          fmt::format("broadcast-test/{}", ci),
          nlohmann::json{{"time_us", median(series.times_us)}, {"check_us", median(series.check_us)}});
      if (job.rank() != 0) continue;
      double t = 0, check_us = 0;  // the slowest rank's
      for (const auto& g : gathered) {
        t = std::max(t, g.at("time_us").get<double>());
        check_us = std::max(check_us, g.at("check_us").get<double>());
      }
      const double algbw = t > 0 ? static_cast<double>(st.bytes) / (t * 1e3) : 0;
      // What each broadcast carried: torch's grouping (param_broadcast.h).
      nlohmann::json chunk_list = nlohmann::json::array();
      for (const auto& c : broadcast_chunks(lp.tensors, bo.chunk_bytes))
        chunk_list.push_back({{"dtype", torch_dtype_name(c.dtype)}, {"bytes", c.bytes}, {"tensors", c.tensors}});
      nlohmann::json mism = nlohmann::json::array();
      for (const auto& m : verdict.mismatches)
        mism.push_back({{"rank", m.rank},
                        {"tensor", m.tensor},
                        {"name", m.name},
                        {"wrong_iterations", m.wrong_iterations},
                        {"first_iteration", m.first_iteration}});
      // Iterations count from 0, the warm-ups first.
      nlohmann::json wrong_its = nlohmann::json::array();
      for (int r : verdict.differing_ranks)
        wrong_its.push_back({{"rank", r}, {"iterations", verdict.wrong_iterations[static_cast<std::size_t>(r)]}});
      res["rows"].push_back({{"chunk_bytes", bo.chunk_bytes},
                             {"chunks", st.chunks},
                             {"chunk_list", chunk_list},
                             {"bytes", st.bytes},
                             {"time_us", t},
                             {"algbw_gbps", algbw},
                             {"busbw_gbps", algbw * busbw_factor(Collective::kBroadcast, job.size())},
                             {"checksum_us", check_us},
                             {"checked_iterations", verdict.iterations},
                             {"identical", verdict.identical},
                             {"differing_ranks", verdict.differing_ranks},
                             {"wrong_iterations", wrong_its},
                             {"mismatches", mism}});
      std::printf("  %12llu %8zu %12.1f %10.3f %12.1f %10s\n",
                  static_cast<unsigned long long>(bo.chunk_bytes), st.chunks, t, algbw,
                  check_us, verdict.identical ? "true" : "false");
      std::fflush(stdout);
      if (!verdict.identical) {
        all_identical = false;
        if (detail.empty()) detail = verdict.describe();
      }
      ++measured;
    }
  } catch (...) {
    judge(false);
    throw;
  }
  if (job.rank() != 0) return;
  judge(true);
  print_checks_and_verdict(report);
}

}  // namespace

Subcommand add_broadcast_test_command(CLI::App& parent) {
  auto opts = std::make_shared<BroadcastTestOptions>();
  auto* app = parent.add_subcommand(
      "broadcast-test",
      "DDP's initial parameter broadcast per chunk size, then a checksum proof that all ranks agree");
  add_common_options(app, opts->common);
  app->add_option("--model", opts->model, "Preset (resnet50, bert-large, gpt2, mlp) or JSON layout file")
      ->capture_default_str();
  app->add_option("--chunk-mb", opts->chunk_mb,
                  "Chunk sizes in MiB, comma-separated (DDP's broadcast_bucket_size is 250)")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& s) -> std::string {
            try {
              parse_chunks(s, -1);
              return "";
            } catch (const UsageError& e) {
              // CLI11 names the flag itself.
              std::string what = e.what();
              if (what.rfind("--chunk-mb: ", 0) == 0) what = what.substr(12);
              return what + " (" + e.context().hint + ")";
            }
          },
          "MIB,...", "CHUNKS"));
  app->add_option("-n,--iters", opts->iters, "Timed broadcasts per chunk size")
      ->check(cli::positive_number());
  app->add_option("-w,--warmup-iters", opts->warmup, "Warm-up broadcasts per chunk size")
      ->check(cli::non_negative_number());
  app->add_option("--corrupt-rank", opts->corrupt_rank,
                  "(testing) this rank alters one byte after every broadcast; the check must name it")
      ->group("");
  return {app, [opts] {
            return run_distributed(
                opts->common, "broadcast-test",
                [opts](Job& job, reports::Report& r) { run(job, r, *opts); },
                // Every parameter, broadcast in place.
                [opts](const Job& job) { check_layout_memory(job, opts->model, 0, 1); });
          }};
}

}  // namespace ddpdiag::cli
