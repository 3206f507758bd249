// ddpdiag sampler: the indices DistributedSampler gives one rank, index for
// index with torch, or from the O(1)-memory streaming permutation.
#include <charconv>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/errors.h"
#include "ddp_core/sampler.h"
#include "reports/render.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/launcher.h"
#include "reports/report.h"

namespace ddpdiag::cli {

namespace {

using nlohmann::json;
using namespace ddpdiag::ddp_core;

struct SamplerCliOptions {
  std::int64_t dataset_size = -1;
  std::int64_t world_size = -1;
  std::int64_t rank = -1;
  std::string seed = "0";
  std::string epoch = "0";
  bool drop_last = false;
  bool no_shuffle = false;
  std::int64_t start = 0;
  std::int64_t count = -1;
  bool streaming = false;
  std::string torch_version = "2.x";
  std::string json_path;
  std::string markdown_path;
  bool benchmark = false;
};

// A Python int literal (sign and decimal digits) for --seed and --epoch:
// DistributedSampler takes any Python int for both and only seed + epoch
// must suit manual_seed, so neither is cut to 64 bits here (a CLI int64
// option would clamp 2^63 to 2^63 - 1 without a word). Up to 37 digits are
// held exactly (and two such still sum inside __int128), far beyond the
// range the sum is checked against later. Without shuffling torch never
// seeds, so any length is taken then (a longer one is held as +-10^37 and
// reported as null, like any value beyond 64 bits).
SeedInt parse_python_int(const char* flag, const std::string& s, bool shuffle) {
  const auto hint = "seed + epoch must lie in [-2^63, 2^64), the range torch.manual_seed takes";
  std::size_t i = 0;
  bool neg = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) neg = s[i++] == '-';
  const bool digits = i < s.size() && s.find_first_not_of("0123456789", i) == std::string::npos;
  if (!digits)
    throw UsageError(fmt::format("{} '{}' is not an integer", flag, s), ErrorContext{"sampler", -1, -1, hint});
  const std::size_t first = std::min(s.find_first_not_of('0', i), s.size());
  if (s.size() - first > 37 && !shuffle) {
    SeedInt big = 1;
    for (int k = 0; k < 37; ++k) big *= 10;
    return neg ? -big : big;
  }
  if (s.size() - first > 37)
    throw UsageError(fmt::format("{} {} is far outside the range torch's manual_seed accepts", flag, s),
                     ErrorContext{"sampler", -1, -1, hint});
  SeedInt v = 0;
  for (std::size_t k = first; k < s.size(); ++k) v = v * 10 + (s[k] - '0');
  return neg ? -v : v;
}

// A seed or epoch as a JSON number; beyond 64 bits (possible for one of the
// two when their sum is in range, and for both without shuffling) its
// decimal digits as a string, as JSON readers take no such number.
json python_int_json(SeedInt v) {
  if (v >= 0 && v <= static_cast<SeedInt>(UINT64_MAX)) return static_cast<std::uint64_t>(v);
  if (v < 0 && v >= static_cast<SeedInt>(INT64_MIN)) return static_cast<std::int64_t>(v);
  std::string digits;
  const bool neg = v < 0;
  for (SeedInt m = v; m != 0; m /= 10) {
    const int d = static_cast<int>(m % 10);
    digits.insert(digits.begin(), static_cast<char>('0' + (d < 0 ? -d : d)));
  }
  return (neg ? "-" : "") + digits;
}


// Prints indices one a line through a large buffer: printing 10^7 numbers
// with printf would dominate the run time.
class IndexPrinter {
 public:
  void put(std::int64_t v) {
    if (buf_.size() - used_ < 32) flush();
    auto r = std::to_chars(buf_.data() + used_, buf_.data() + buf_.size(), v);
    used_ = static_cast<std::size_t>(r.ptr - buf_.data());
    buf_[used_++] = '\n';
  }
  void flush() {
    std::fwrite(buf_.data(), 1, used_, stdout);
    used_ = 0;
  }
  ~IndexPrinter() { flush(); }

 private:
  std::vector<char> buf_ = std::vector<char>(1 << 20);
  std::size_t used_ = 0;
};

// A report of this many indices takes about 65 bytes an index at its peak
// (the list, its JSON value and its text): 10^7 indices, 650 MB.
constexpr std::int64_t kMaxReportIndices = 10'000'000;

int run_sampler_checked(const SamplerCliOptions& c, reports::Report& report);

int run_sampler(const SamplerCliOptions& c) {
  // The report paths first: an error after this point is written into the
  // report too, as every command does.
  check_report_outputs(c.json_path, c.markdown_path);
  // Made before the work so that started_at and duration_s cover it.
  reports::Report report("sampler", own_command_line());
  const auto write_error = [&](const Error& e) {
    if (c.json_path.empty() && c.markdown_path.empty()) return;
    report.set_error(to_error_info(e));
    try {
      reports::write_report_outputs(report.finish(), c.json_path, c.markdown_path);
    } catch (const std::exception&) {
    }
  };
  try {
    return run_sampler_checked(c, report);
  } catch (const Error& e) {
    write_error(e);
    throw;
  } catch (const std::bad_alloc&) {
    const bool reports = !c.json_path.empty() || !c.markdown_path.empty();
    UsageError e("out of memory for this rank's indices",
                 ErrorContext{"sampler", -1, -1,
                              std::string("use --streaming (constant memory) or a window (--start, "
                                          "--count)") +
                                  (reports ? ", or leave out --json and --markdown, which hold "
                                             "every index"
                                           : "")});
    write_error(e);
    throw e;
  }
}

int run_sampler_checked(const SamplerCliOptions& c, reports::Report& report) {
  if (c.dataset_size < 0 || c.world_size < 0 || c.rank < 0)
    throw UsageError("sampler needs --dataset-size, --world-size and --rank",
                     ErrorContext{"sampler", -1, -1, "e.g. --dataset-size 50000 --world-size 4 --rank 0"});
  SamplerOptions o;
  o.dataset_size = c.dataset_size;
  o.world_size = c.world_size;
  o.rank = c.rank;
  o.shuffle = !c.no_shuffle;
  o.seed = parse_python_int("--seed", c.seed, o.shuffle);
  o.epoch = parse_python_int("--epoch", c.epoch, o.shuffle);
  o.drop_last = c.drop_last;
  auto tv = parse_torch_version(c.torch_version);
  if (!tv)
    throw UsageError(fmt::format("--torch-version '{}' is not 1.13 or 2.x", c.torch_version),
                     ErrorContext{"sampler", -1, -1, "the two differ only in randperm for N >= 214748364"});
  o.torch_version = *tv;
  validate_sampler_options(o);
  const SamplerShape shape = sampler_shape(o.dataset_size, o.world_size, o.drop_last);
  if (c.start < 0 || c.start > shape.num_samples)
    throw UsageError(fmt::format("--start {} is outside this rank's {} indices", c.start, shape.num_samples),
                     ErrorContext{"sampler", -1, -1, "use 0 <= --start <= num_samples"});
  const std::int64_t count =
      (c.count < 0 || c.count > shape.num_samples - c.start) ? shape.num_samples - c.start : c.count;

  const bool keep = !c.json_path.empty() || !c.markdown_path.empty();  // reports list the indices
  if (keep && count > kMaxReportIndices) {
    const bool window = c.start > 0 || c.count >= 0;
    throw UsageError(fmt::format("a report would hold {} {} indices of this rank (about {} MB "
                                 "of memory); reports hold at most {}",
                                 window ? "the window's" : "all", count, count * 65 / 1'000'000,
                                 kMaxReportIndices),
                     ErrorContext{"sampler", -1, -1,
                                  fmt::format("report {} (--count {} or less), or print them "
                                              "without --json / --markdown (--streaming runs in "
                                              "constant memory)",
                                              window ? "a smaller window" : "a window of them (--start, --count)",
                                              kMaxReportIndices)});
  }
  std::vector<std::int64_t> indices;
  std::uint64_t checksum = 0;              // sum of the indices mod 2^64, to compare runs cheaply
  const auto t0 = std::chrono::steady_clock::now();
  if (c.streaming) {
    StreamingSampler s(o);
    s.seek(c.start);
    if (keep) indices.reserve(static_cast<std::size_t>(count));
    IndexPrinter* printer = nullptr;
    std::unique_ptr<IndexPrinter> owned;
    if (!c.benchmark) {
      owned = std::make_unique<IndexPrinter>();
      printer = owned.get();
    }
    for (std::int64_t j = 0; j < count; ++j) {
      const std::int64_t v = *s.next();
      checksum += static_cast<std::uint64_t>(v);
      if (keep) indices.push_back(v);
      if (printer) printer->put(v);
    }
  } else {
    indices = distributed_sampler_indices(o, c.start, count);
    for (auto v : indices) checksum += static_cast<std::uint64_t>(v);
    if (!c.benchmark) {
      IndexPrinter p;
      for (auto v : indices) p.put(v);
    }
  }
  const double elapsed_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double per_s = elapsed_s > 0 ? static_cast<double>(count) / elapsed_s : 0.0;
  if (c.benchmark)
    std::printf("sampler %s: N=%lld R=%lld rank=%lld: %lld indices in %.3f s, %.4g indices/s (checksum %llu)\n",
                c.streaming ? "streaming" : fmt::format("torch {}", torch_version_name(o.torch_version)).c_str(),
                static_cast<long long>(o.dataset_size), static_cast<long long>(o.world_size),
                static_cast<long long>(o.rank), static_cast<long long>(count), elapsed_s, per_s,
                static_cast<unsigned long long>(checksum));

  if (!c.json_path.empty() || !c.markdown_path.empty()) {
    report.results() = {
        {"dataset_size", o.dataset_size},
        {"world_size", o.world_size},
        {"rank", o.rank},
        {"seed", python_int_json(o.seed)},
        {"epoch", python_int_json(o.epoch)},
        {"shuffle", o.shuffle},
        {"drop_last", o.drop_last},
        {"mode", c.streaming ? "streaming" : "torch"},
        {"torch_version", c.streaming ? json(nullptr) : json(torch_version_name(o.torch_version))},
        {"num_samples", shape.num_samples},
        {"total_size", shape.total_size},
        {"padding", shape.padding},
        {"dropped", shape.dropped},
        {"start", c.start},
        {"count", count},
        {"checksum", checksum},
        {"elapsed_s", elapsed_s},
        {"indices_per_second", per_s},
        {"indices", std::move(indices)},
    };
    reports::write_report_outputs(report.finish(), c.json_path, c.markdown_path);
  }
  return 0;
}

}  // namespace

Subcommand add_sampler_command(CLI::App& parent) {
  auto o = std::make_shared<SamplerCliOptions>();
  CLI::App* app = parent.add_subcommand(
      "sampler", "Print one rank's DistributedSampler indices (index for index with torch, or streaming)");
  app->add_option("--dataset-size", o->dataset_size, "len(dataset), N")
      ->required()
      ->check(cli::int64_value())
      ->check(cli::non_negative_number());
  app->add_option("--world-size", o->world_size, "num_replicas, R")
      ->required()
      ->check(cli::int64_value())
      ->check(cli::positive_number());
  app->add_option("--rank", o->rank, "this rank, 0 <= rank < R")
      ->required()
      ->check(cli::int64_value())
      ->check(cli::non_negative_number());
  app->add_option("--seed", o->seed, "sampler seed (an integer; seed + epoch must be one torch.manual_seed takes)")
      ->capture_default_str();
  app->add_option("--epoch", o->epoch, "sampler.set_epoch(e): the permutation uses seed + epoch (any integer)")
      ->capture_default_str();
  app->add_flag("--drop-last", o->drop_last, "drop the tail instead of padding");
  app->add_flag("--no-shuffle", o->no_shuffle, "shuffle=False: indices in order");
  app->add_option("--start", o->start, "first position in this rank's list")
      ->capture_default_str()
      ->check(cli::int64_value());
  app->add_option("--count", o->count, "how many indices from --start (default: to the end)")
      ->check(cli::int64_value())
      ->check(cli::non_negative_number());
  app->add_flag("--streaming", o->streaming,
                "O(1)-memory mode with a different (Feistel) permutation: not torch's indices");
  app->add_option("--torch-version", o->torch_version,
                  "1.13 or 2.x (they differ only in randperm for N >= 214748364)")
      ->capture_default_str();
  app->add_option("--json", o->json_path, "write a JSON report (with the indices) to FILE")
      ->check(report_path_value());
  app->add_option("--markdown", o->markdown_path, "write the report as Markdown to FILE")
      ->check(report_path_value());
  app->add_flag("--benchmark,--count-only", o->benchmark, "print the time and indices/s, not the indices");
  return {app, [o] { return run_sampler(*o); }};
}

}  // namespace ddpdiag::cli
