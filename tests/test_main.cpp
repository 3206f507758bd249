// The unit tests' main: Catch2's, with SIGPIPE ignored as ddpdiag's own main
// does, so a test whose peer (a thread's communicator, a fake client) closes
// a socket early sees EPIPE instead of the whole test binary being killed.
#define CATCH_CONFIG_RUNNER
#include <csignal>

#include <catch2/catch.hpp>

int main(int argc, char* argv[]) {
  std::signal(SIGPIPE, SIG_IGN);
  return Catch::Session().run(argc, argv);
}
