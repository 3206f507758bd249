// Error hierarchy shared by every layer. Errors are typed by who is at fault
// and carry the phase, the rank that saw it, the peer involved (if any) and a
// hint for the user. The CLI turns them into exit codes and report entries in
// one place (diag/main.cpp); libraries never exit().
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

namespace ddpdiag {

// Exit codes of DESIGN.md.
enum class ExitCode : int {
  kOk = 0,
  kCheckFailed = 1,
  kUsage = 2,
  kRendezvous = 3,
  kTimeout = 4,
  kPeerFailed = 5,
};

struct ErrorContext {
  // A constructor rather than an aggregate, so partial initialisation such as
  // ErrorContext{"store.connect", rank} is complete and warning-free.
  ErrorContext(std::string phase_ = {}, int rank_ = -1, int peer_ = -1, std::string hint_ = {})
      : phase(std::move(phase_)), rank(rank_), peer(peer_), hint(std::move(hint_)) {}

  std::string phase;  // "world", "store.connect", "backend.init", "allreduce", ...
  int rank = -1;      // the rank that raised it, -1 when unknown
  int peer = -1;      // the peer involved, -1 when none
  std::string hint;   // what to try next, in plain words
};

class Error : public std::runtime_error {
 public:
  Error(std::string message, ErrorContext ctx = {})
      : std::runtime_error(std::move(message)), ctx_(std::move(ctx)) {}

  const ErrorContext& context() const { return ctx_; }
  ErrorContext& context() { return ctx_; }
  virtual ExitCode exit_code() const = 0;
  virtual const char* kind() const = 0;

 private:
  ErrorContext ctx_;
};

// Bad flags, environment or input files: the user can fix it by changing input.
class UsageError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kUsage; }
  const char* kind() const override { return "usage"; }
};

// Could not reach or talk to the store, or the ranks disagree at rendezvous,
// or a backend failed to initialise.
class RendezvousError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kRendezvous; }
  const char* kind() const override { return "rendezvous"; }
};

// Something we waited on did not happen before its deadline.
class TimeoutError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kTimeout; }
  const char* kind() const override { return "timeout"; }
};

// A peer closed its connection, died or reported an error of its own.
class PeerError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kPeerFailed; }
  const char* kind() const override { return "peer"; }
};

// An error reported by the communication library (NCCL, CUDA, Gloo) that is
// not attributable to a peer. Initialisation failures count as rendezvous
// failures for the exit code.
class BackendError : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kRendezvous; }
  const char* kind() const override { return "backend"; }
};

// A check failed (wrong data, bandwidth under threshold). Not a crash: the
// run completed and the verdict is FAIL.
class CheckFailed : public Error {
 public:
  using Error::Error;
  ExitCode exit_code() const override { return ExitCode::kCheckFailed; }
  const char* kind() const override { return "check"; }
};

// Internal invariant; a bug in ddpdiag, never the user's fault.
#define DDPDIAG_ASSERT(cond)                                                   \
  do {                                                                         \
    if (!(cond))                                                               \
      throw std::logic_error(std::string("internal error: ") + #cond + " at " + \
                             __FILE__ + ":" + std::to_string(__LINE__));       \
  } while (0)

}  // namespace ddpdiag
