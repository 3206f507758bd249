// Pieces shared by the diagnostic tools (bucket-sweep, dp-vs-ring, memory,
// link-health): timing an operation the nccl-tests way on every rank, the
// statistics the tools flag outliers with, and extra communicators over the
// job's store.
#pragma once

#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/communicator.h"
#include "comm/measure.h"
#include "diag/cli_common.h"
#include "diag/tools_analysis.h"

namespace ddpdiag::cli::tools {

// Runs `judge` if the scope it guards is left by an exception and not
// disarmed: the checks of a run that failed part-way, added before the
// error's report is written. Whatever judge throws is dropped (the error
// that is unwinding is the one to report).
class OnFailure {
 public:
  explicit OnFailure(std::function<void()> judge) : judge_(std::move(judge)) {}
  OnFailure(const OnFailure&) = delete;
  OnFailure& operator=(const OnFailure&) = delete;
  ~OnFailure() {
    if (!judge_ || std::uncaught_exceptions() <= unwinding_) return;
    try {
      judge_();
    } catch (...) {
    }
  }
  void disarm() { judge_ = nullptr; }

 private:
  std::function<void()> judge_;
  int unwinding_ = std::uncaught_exceptions();
};

// Times `op` on every rank: warm-up calls, a barrier, then `iters` calls
// back to back; each rank's time per call is gathered onto every rank and
// summarised as nccl-tests does (mean over ranks, fastest and slowest rank).
// algbw = bytes / time, busbw = algbw x the all_reduce factor. wrong is left
// at -1 for the caller.
TimingBlock time_on_every_rank(Communicator& comm, int iters, int warmup, std::size_t bytes,
                               Millis timeout, const std::function<void()>& op);

// A communicator over ranks 0..world_size-1 of the job (world_size <= the
// job's), rendezvousing under its own store prefix `name`; nullptr on the
// ranks outside it. Every rank of the job must call it with the same
// arguments. Used to run one measurement at several world sizes, and to
// measure what a communicator's initialisation costs.
std::unique_ptr<Communicator> make_extra_communicator(Job& job, const CommonOptions& common,
                                                      const std::string& name, int world_size);


// The report's check statuses, shortened.
inline reports::CheckStatus pass_if(bool ok) {
  return ok ? reports::CheckStatus::kPass : reports::CheckStatus::kFail;
}

}  // namespace ddpdiag::cli::tools
