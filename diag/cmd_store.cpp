// `ddpdiag store`: talk to or host a c10d-compatible TCPStore.
//   store ping HOST:PORT   is the store there, which protocol, how fast
//   store serve            host a store (both protocols) until SIGINT/SIGTERM
//   store set KEY VALUE    write a key (as torch's store.set does)
//   store get KEY          wait for a key and print its value
//   store keys             list a store's keys (torch 2.x protocol, LIST_KEYS)
#include <arpa/inet.h>
#include <netinet/in.h>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "comm/ip_text.h"
#include "comm/errors.h"
#include "comm/store/tcp_protocol.h"
#include "comm/store/tcp_store.h"
#include "ddpdiag/config.h"
#include "comm/world.h"
#include "reports/render.h"
#include "diag/cli_common.h"
#include "diag/commands.h"
#include "diag/launcher.h"
#include "diag/placement.h"
#include "reports/report.h"

namespace ddpdiag::cli {
namespace {

constexpr int kDefaultStorePort = 29500;  // torchrun's MASTER_PORT default

struct Address {
  std::string host;
  int port = kDefaultStorePort;
};

// HOST:PORT, [IPv6]:PORT, HOST (default port) or a bare IPv6 address.
Address parse_address(const std::string& s) {
  Address a;
  std::string port;
  if (!s.empty() && s.front() == '[') {
    auto close = s.find(']');
    if (close == std::string::npos) throw UsageError("bad address '" + s + "': missing ']'", {"cli", -1, -1, "write IPv6 as [::1]:29500"});
    a.host = s.substr(1, close - 1);
    if (close + 1 < s.size()) {
      if (s[close + 1] != ':') throw UsageError("bad address '" + s + "'", {"cli", -1, -1, "write IPv6 as [::1]:29500"});
      port = s.substr(close + 2);
    }
  } else if (std::count(s.begin(), s.end(), ':') == 1) {
    auto colon = s.find(':');
    a.host = s.substr(0, colon);
    port = s.substr(colon + 1);
  } else {
    // Two colons or more: an IPv6 address alone, on the default port. One
    // that is not an address (::1:29615, a port glued on) is refused.
    a.host = s;
    in6_addr v6{};
    if (std::count(s.begin(), s.end(), ':') > 1 && ::inet_pton(AF_INET6, s.c_str(), &v6) != 1)
      throw UsageError("bad address '" + s + "': not an IPv6 address (with a port?)",
                       {"cli", -1, -1, "write an IPv6 address with its port as [::1]:29500"});
  }
  if (a.host.empty()) throw UsageError("bad address '" + s + "': no host", {"cli", -1, -1, "e.g. 127.0.0.1:29500"});
  if (!port.empty()) {
    try {
      std::size_t used = 0;
      a.port = std::stoi(port, &used);
      if (used != port.size()) throw std::invalid_argument(port);
    } catch (const std::exception&) {
      a.port = -1;
    }
    if (a.port <= 0 || a.port > 65535)
      throw UsageError("bad port in '" + s + "'", {"cli", -1, -1, "a port is a number from 1 to 65535"});
  }
  return a;
}

std::string format_address(const Address& a) {
  bool v6 = a.host.find(':') != std::string::npos;
  return (v6 ? "[" + a.host + "]" : a.host) + ":" + std::to_string(a.port);
}

StoreProtocol parse_protocol(const std::string& s) {
  if (s == "auto") return StoreProtocol::kAuto;
  if (s == "1.13" || s == "v1" || s == "torch-1.13") return StoreProtocol::kV1;
  if (s == "2.x" || s == "2" || s == "v2" || s == "torch-2.x") return StoreProtocol::kV2;
  throw UsageError("unknown store protocol '" + s + "'", {"cli", -1, -1, "use auto, 1.13 or 2.x"});
}

Millis seconds_to_ms(double s) {
  if (!(s > 0)) throw UsageError("--timeout must be positive", {"cli", -1, -1, ""});
  return Millis(static_cast<long long>(s * 1000.0));
}

struct PingOptions {
  std::string address;
  std::string protocol = "auto";
  double timeout_s = 10;
  int count = 20;
  std::string json_path;
  std::string markdown_path;
};

struct PingResult {
  bool reachable = false;  // the host accepted a TCP connection
  bool answered = false;   // and answered as a store over the protocol in use
  std::string protocol;
  std::vector<double> rtt_us;
  std::int64_t num_keys = -1;
  int connect_attempts = 0;
  std::optional<nlohmann::json> error;
  bool timed_out = false;  // reachable, and silent until a --timeout under a second
};

int run_ping(const PingOptions& o) {
  Address addr = parse_address(o.address);
  StoreProtocol requested = parse_protocol(o.protocol);
  Millis timeout = seconds_to_ms(o.timeout_s);
  if (o.count < 1) throw UsageError("--count must be at least 1", {"cli", -1, -1, ""});
  // A report path that cannot be written is refused before the ping, not
  // after it (where the exit 2 would hide what the ping found).
  check_report_outputs(o.json_path, o.markdown_path);

  // Made before the ping so that started_at and duration_s cover it (an
  // unreachable store takes the whole --timeout).
  reports::Report report("store ping", own_command_line());
  PingResult r;
  try {
    TcpStoreClientOptions co;
    co.host = addr.host;
    co.port = addr.port;
    co.protocol = requested;
    co.protocol_flag = "--protocol";
    co.connect_timeout = timeout;
    co.io_timeout = timeout;
    co.attempts_out = &r.connect_attempts;  // also when the connect fails
    TcpStoreClient client(co);
    r.reachable = true;
    r.connect_attempts = client.connect_attempts();
    r.protocol = std::string(store_protocol_name(client.protocol()));
    client.ping_us();  // warm-up: first request pays for cold caches
    for (int i = 0; i < o.count; ++i) r.rtt_us.push_back(client.ping_us());
    r.num_keys = client.num_keys();
    r.answered = true;
  } catch (const Error& e) {
    // A handshake that failed still means the host took the connection: it
    // is reachable and speaks another protocol (or is not a store at all).
    if (e.context().phase == "store.handshake") r.reachable = true;
    // Silence under a --timeout below a second is a timeout (exit 4), as for
    // get and set; over a second the client calls it a mismatch (exit 3).
    // A host that never took the connection is unreachable (exit 3) whatever
    // the time.
    r.timed_out = r.reachable && e.exit_code() == ExitCode::kTimeout;
    r.error = nlohmann::json{{"kind", e.kind()},
                             {"phase", e.context().phase},
                             {"message", e.what()},
                             {"hint", e.context().hint}};
  }

  std::string where = format_address(addr);
  // What a reachable host that did not answer as a store did wrong, in words.
  std::string mismatch;
  if (r.reachable && !r.answered && r.timed_out) {
    mismatch = fmt::format("reachable, but it did not answer within --timeout {:g} s (a store answers in "
                           "well under a second)",
                           o.timeout_s);
  } else if (r.reachable && !r.answered) {
    if ((*r.error)["phase"].get<std::string>() != "store.handshake") {
      mismatch = fmt::format("reachable, but it did not answer as a {} store", r.protocol);
      if (requested != StoreProtocol::kAuto) {
        // 1.13 has no handshake to fail: a 2.x server just stays silent.
        mismatch += " (it may speak the other protocol)";
        (*r.error)["hint"] = (*r.error)["hint"].get<std::string>() + "; --protocol auto detects which one it speaks";
      }
    }
    else if (requested == StoreProtocol::kAuto)
      mismatch = fmt::format("reachable, but it speaks neither the {} nor the {} store protocol",
                             store_protocol_name(StoreProtocol::kV1), store_protocol_name(StoreProtocol::kV2));
    else
      mismatch = fmt::format("reachable, but it does not speak the {} store protocol (another protocol, "
                             "or not a store)",
                             store_protocol_name(requested));
  }
  if (r.answered) {
    std::string how = requested == StoreProtocol::kAuto ? "detected" : "as requested";
    double mn = *std::min_element(r.rtt_us.begin(), r.rtt_us.end());
    double mx = *std::max_element(r.rtt_us.begin(), r.rtt_us.end());
    fmt::print("store {}: reachable\n", where);
    fmt::print("  protocol  {} ({})\n", r.protocol, how);
    fmt::print("  rtt       median {:.1f} us over {} pings (min {:.1f}, max {:.1f})\n", median(r.rtt_us),
               r.rtt_us.size(), mn, mx);
    fmt::print("  keys      {}\n", r.num_keys);
    fmt::print("  connect   {} attempt(s)\n", r.connect_attempts);
  } else {
    fmt::print("store {}: {}\n", where, r.reachable ? mismatch : std::string("unreachable"));
    fmt::print("  why       {}\n", (*r.error)["message"].get<std::string>());
    std::string hint = (*r.error)["hint"].get<std::string>();
    if (!hint.empty()) fmt::print("  hint      {}\n", hint);
  }
  std::fflush(stdout);

  if (!o.json_path.empty() || !o.markdown_path.empty()) {
    nlohmann::json results{{"address", where},
                           {"host", addr.host},
                           {"port", addr.port},
                           {"protocol_requested", std::string(store_protocol_name(requested))},
                           {"reachable", r.reachable},
                           {"answered", r.answered},
                           {"protocol", r.answered ? nlohmann::json(r.protocol) : nlohmann::json(nullptr)},
                           {"pings", r.rtt_us.size()},
                           {"rtt_us_median", r.rtt_us.empty() ? nlohmann::json(nullptr) : nlohmann::json(median(r.rtt_us))},
                           {"rtt_us", r.rtt_us},
                           {"num_keys", r.answered ? nlohmann::json(r.num_keys) : nlohmann::json(nullptr)},
                           {"connect_attempts", r.connect_attempts},
                           {"error", r.error ? *r.error : nlohmann::json(nullptr)}};
    report.set_environment(recorded_environment());
    report.results() = results;
    report.add_check({"store_reachable",
                      r.answered ? reports::CheckStatus::kPass : reports::CheckStatus::kFail,
                      r.answered    ? fmt::format("{} answered over {}", where, r.protocol)
                      : r.reachable ? fmt::format("{}: {}", where, mismatch)
                                    : (*r.error)["message"].get<std::string>()});
    if (r.error)
      report.set_error({(*r.error)["kind"].get<std::string>(),
                        (*r.error)["message"].get<std::string>(),
                        (*r.error)["phase"].get<std::string>(), -1, -1,
                        (*r.error)["hint"].get<std::string>(),
                        static_cast<int>(r.timed_out ? ExitCode::kTimeout : ExitCode::kRendezvous)});
    reports::write_report_outputs(report.finish(), o.json_path, o.markdown_path);
  }
  return static_cast<int>(r.answered ? ExitCode::kOk : r.timed_out ? ExitCode::kTimeout : ExitCode::kRendezvous);
}

struct ServeOptions {
  std::string host;  // "": every address (cli::every_address)
  int port = kDefaultStorePort;
};

// One line of the serving store's log on stderr; a failed write is ignored
// (fmt::print would throw it on the server's thread, ending the store).
void log_line(const std::string& line) noexcept {
  std::fprintf(stderr, "ddpdiag store: %s\n", line.c_str());
  std::fflush(stderr);
}

int run_serve(const ServeOptions& o) {
  // As --master-port and HOST:PORT are checked, before anything binds (a
  // port of 70000 would otherwise be taken modulo 65536).
  if (o.port < 0 || o.port > 65535)
    throw UsageError(fmt::format("--port={} is not a valid TCP port (0..65535; 0 picks a free one)", o.port),
                     {"cli", -1, -1, "pick a free port, e.g. 29500, or 0 to let the system choose"});
  // Block the signals before the server thread exists so that it inherits
  // the mask and sigwait below is the only place they are delivered.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  TcpStoreServerOptions so;
  so.host = o.host.empty() ? cli::every_address() : without_ipv6_brackets(o.host);
  so.port = o.port;
  // Connections closed for a request the protocol does not allow, each said
  // on stderr, up to a bound: a client in a loop must not flood the log.
  constexpr std::uint64_t kShownRefusals = 20;
  auto refusals = std::make_shared<std::atomic<std::uint64_t>>(0);
  // The log is written as well as it can be: a store whose stderr went away
  // (a full disk, a log pipe whose reader ended) keeps serving its clients.
  so.on_refused = [refusals](const std::string& why) {
    std::uint64_t n = ++*refusals;
    if (n <= kShownRefusals) log_line("closed the connection of " + why);
    if (n == kShownRefusals)
      log_line(fmt::format("{} connections closed so far; further ones are counted, not shown", n));
  };
  so.on_out_of_fds = [](const std::string& what) { log_line(what); };
  TcpStoreServer server(so);
  Address bound{so.host, server.port()};
  fmt::print("ddpdiag store serving on {} (protocols: {}, {})\n", format_address(bound),
             store_protocol_name(StoreProtocol::kV1), store_protocol_name(StoreProtocol::kV2));
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  const std::uint64_t refused = refusals->load();
  log_line(fmt::format("stopping on {} ({} keys, {} open connections{})", sig == SIGINT ? "SIGINT" : "SIGTERM",
                       server.num_keys(), server.num_connections(),
                       refused ? fmt::format(", {} closed for requests the protocol does not allow", refused)
                               : ""));
  return 0;
}

struct KeyOptions {
  std::string address = "127.0.0.1:29500";
  std::string protocol = "auto";
  double timeout_s = 10;
  std::string key;
  std::string value;
  bool values = false;  // store keys --values
  int world_size = 0;   // store keys --world-size: which ranks' keys are missing
};

// torch 2.x's server (and ddpdiag's, on a 2.x connection) close the
// connection on a key over 8 KiB, and the key goes out with the '/' torch's
// client puts in front: refused, by name, instead of failing as the
// connection closes. torch 1.13's server has no limit.
void check_key_size(const std::string& key, const TcpStoreClient& c) {
  if (key.size() >= 8 * 1024 && c.protocol() != StoreProtocol::kV1)
    throw UsageError(fmt::format("the key is {} bytes; stores of torch 2.x take at most 8191 (8192 with the "
                                 "'/' torch's client puts in front)",
                                 key.size()),
                     {"cli", -1, -1, "use a shorter key (a store of torch 1.13, --protocol 1.13, takes longer ones)"});
}

TcpStoreClientOptions client_options(const KeyOptions& o) {
  Address a = parse_address(o.address);
  TcpStoreClientOptions co;
  co.host = a.host;
  co.port = a.port;
  co.protocol = parse_protocol(o.protocol);
  co.protocol_flag = "--protocol";
  co.connect_timeout = seconds_to_ms(o.timeout_s);
  co.io_timeout = co.connect_timeout;
  return co;
}

void add_key_flags(CLI::App* app, KeyOptions& o) {
  app->add_option("--addr", o.address, "store address HOST:PORT")->capture_default_str();
  app->add_option("--protocol", o.protocol, "auto | 1.13 | 2.x")->capture_default_str();
  app->add_option("--timeout", o.timeout_s, "seconds for connecting and waiting")
      ->capture_default_str()
      ->check(cli::timeout_value());
}

// `store keys`: one key per line, as torch's store.get(KEY) names it (the
// "/" every torch client puts in front taken off). Keys set without that
// prefix (by a raw client) are listed after them, marked. Bytes that are not
// printable are shown as \xNN; --values cuts each value after 200 bytes.
int run_keys(const KeyOptions& o) {
  if (parse_protocol(o.protocol) == StoreProtocol::kV1)
    throw UsageError(fmt::format("--protocol {}: the torch 1.13 protocol has no way to list keys",
                                 o.protocol),
                     {"cli", -1, -1, "leave --protocol out, or give 2.x"});
  TcpStoreClientOptions co = client_options(o);
  co.torch_key_prefix = false;  // keys are read back as listed
  TcpStoreClient c(co);
  std::vector<std::string> keys = c.list_keys();
  std::vector<std::string> torch_keys, raw_keys;
  for (const auto& k : keys) (!k.empty() && k.front() == '/' ? torch_keys : raw_keys).push_back(k);
  auto show = [&](const std::string& stored, bool torch_key) {
    std::string name = torch_key ? stored.substr(1) : stored;
    std::string line = name.empty() ? "(the empty key)" : tcp_protocol::printable(name, std::string::npos);
    if (!torch_key) line += "  (set without torch's '/' prefix: torch's clients do not see it)";
    if (o.values) {
      // A key deleted since the listing prints as such, not as a wait.
      if (c.check({stored})) {
        Bytes v = c.get(stored, co.io_timeout);
        line += " = " + tcp_protocol::printable(
                            std::string_view(reinterpret_cast<const char*>(v.data()), v.size()), 200);
      } else {
        line += " (deleted since the listing)";
      }
    }
    std::fputs((line + "\n").c_str(), stdout);
  };
  for (const auto& k : torch_keys) show(k, true);
  for (const auto& k : raw_keys) show(k, false);
  if (o.world_size > 0) {
    // Keys whose last part is a number, grouped by what comes before it:
    // the per-rank keys of a rendezvous (torch's Gloo writes
    // default_pg/0//cpu//0/<rank>, ddpdiag ddpdiag/rank/<rank>), with the numbers
    // of 0..world_size-1 that are absent: the ranks that did not get there.
    // torchrun's own keys (torchelastic/...) count nodes, and are shown so.
    std::map<std::string, std::vector<int>> by_prefix;
    for (const auto& k : torch_keys) {
      std::string name = k.substr(1);
      auto slash = name.rfind('/');
      std::string last = slash == std::string::npos ? name : name.substr(slash + 1);
      if (last.empty() || last.size() > 9 ||
          !std::all_of(last.begin(), last.end(), [](char ch) { return ch >= '0' && ch <= '9'; }))
        continue;
      // ddpdiag's agreement on a run under torchrun numbers hellos and
      // runs, not ranks (its per-rank keys are ddpdiag/run/<N>/rank/<r>).
      const std::string before = slash == std::string::npos ? "" : name.substr(0, slash + 1);
      const bool rank_key = before.size() >= 5 && before.compare(before.size() - 5, 5, "rank/") == 0;
      if (name.rfind("ddpdiag/", 0) == 0 && !rank_key) continue;
      by_prefix[slash == std::string::npos ? "" : name.substr(0, slash + 1)].push_back(std::stoi(last));
    }
    std::printf("# keys ending in a number, by prefix, against --world-size %d:\n", o.world_size);
    if (by_prefix.empty()) std::printf("#   none\n");
    for (auto& [prefix, numbers] : by_prefix) {
      std::sort(numbers.begin(), numbers.end());
      std::vector<int> missing;
      for (int r = 0; r < o.world_size; ++r)
        if (!std::binary_search(numbers.begin(), numbers.end(), r)) missing.push_back(r);
      const auto present = static_cast<int>(
          std::count_if(numbers.begin(), numbers.end(), [&](int n) { return n < o.world_size; }));
      std::string shown = tcp_protocol::printable(prefix, std::string::npos) + "<N>";
      if (prefix.find("torchelastic/") != std::string::npos) {
        // torchrun's agents write these, one per node (N: the node's rank).
        std::printf("#   %s: written by torchrun's agent of each node, N = node rank: %s\n", shown.c_str(),
                    format_cpu_list(numbers).c_str());
        continue;
      }
      if (missing.empty())
        std::printf("#   %s: all %d present\n", shown.c_str(), o.world_size);
      else
        std::printf("#   %s: %d of %d present (%s); missing: %s\n", shown.c_str(), present, o.world_size,
                    format_cpu_list(numbers).c_str(), format_cpu_list(missing).c_str());
    }
  }
  std::fflush(stdout);
  fmt::print(stderr, "# {} key(s) in the store at {} ({})\n", keys.size(),
             format_address(parse_address(o.address)), store_protocol_name(c.protocol()));
  return 0;
}

}  // namespace

Subcommand add_store_command(CLI::App& parent) {
  CLI::App* store = parent.add_subcommand("store", "talk to or host a c10d TCPStore (torch 1.13 and 2.x protocols)");
  store->require_subcommand(1);

  auto ping = std::make_shared<PingOptions>();
  CLI::App* p = store->add_subcommand("ping", "is a store reachable, which protocol it speaks, round-trip time, key count (exit 0 when it answers as a store, 3 unreachable or not a store, 4 no answer within --timeout)");
  p->add_option("address", ping->address, "HOST:PORT (IPv6 as [::1]:29500)")->required();
  p->add_option("--protocol", ping->protocol, "auto | 1.13 | 2.x")->capture_default_str();
  p->add_option("--timeout", ping->timeout_s, "seconds for connecting and for each reply")
      ->capture_default_str()
      ->check(cli::timeout_value());
  p->add_option("--count", ping->count, "pings timed (the median is reported)")->capture_default_str();
  p->add_option("--json", ping->json_path, "write the result as JSON to this file")
      ->check(cli::report_path_value());
  p->add_option("--markdown", ping->markdown_path, "write the result as Markdown to this file")
      ->check(cli::report_path_value());

  auto serve = std::make_shared<ServeOptions>();
  CLI::App* s = store->add_subcommand("serve", "host a store speaking both protocols until SIGINT/SIGTERM");
  s->add_option("--port", serve->port, "port to listen on (0: any free port)")->capture_default_str();
  s->add_option("--host", serve->host,
                "address to bind (default: every address, IPv6 and IPv4; 0.0.0.0 for IPv4 only)");

  auto setk = std::make_shared<KeyOptions>();
  CLI::App* st = store->add_subcommand("set", "set KEY to VALUE in a store (key as torch's store.set(KEY) sees it)");
  st->add_option("key", setk->key, "key (at most 8191 bytes on a torch 2.x connection)")->required();
  st->add_option("value", setk->value, "value")->required();
  add_key_flags(st, *setk);

  auto getk = std::make_shared<KeyOptions>();
  CLI::App* gt = store->add_subcommand("get", "wait up to --timeout for KEY and print its value");
  gt->add_option("key", getk->key, "key (at most 8191 bytes on a torch 2.x connection)")->required();
  add_key_flags(gt, *getk);

  auto keysk = std::make_shared<KeyOptions>();
  CLI::App* ks = store->add_subcommand(
      "keys", "list a store's keys, sorted (torch 2.x protocol; a store of torch 2.10 or later, or ddpdiag's)");
  ks->add_flag("--values", keysk->values, "print each key's value beside it");
  ks->add_option("--world-size", keysk->world_size,
                 "also group the keys that end in a number (a rank) by prefix and name the numbers of "
                 "0..N-1 that are missing: which ranks have not registered")
      ->check(CLI::Range(1, 1 << 24));
  add_key_flags(ks, *keysk);

  RunFn run = [=]() -> int {
    if (ks->parsed()) return run_keys(*keysk);
    if (p->parsed()) return run_ping(*ping);
    if (s->parsed()) return run_serve(*serve);
    if (st->parsed()) {
      TcpStoreClient c(client_options(*setk));
      check_key_size(setk->key, c);
      c.set(setk->key, to_bytes(setk->value));
      c.num_keys();  // SET has no reply: a round trip proves the server took it
      return 0;
    }
    if (gt->parsed()) {
      TcpStoreClientOptions co = client_options(*getk);
      TcpStoreClient c(co);
      check_key_size(getk->key, c);
      // --protocol 1.13 has no handshake, and GET waits for the key: a torch
      // 2.x store that never answers a 1.13 request would read as a key
      // never set. A round trip that must answer at once (1.13's GETNUMKEYS,
      // which a 2.x store reads as a WAIT and leaves unanswered) tells the
      // two apart, and fails with the protocol named.
      if (co.protocol == StoreProtocol::kV1) c.num_keys();
      Bytes v;
      try {
        v = c.get(getk->key, co.io_timeout);
      } catch (const TimeoutError& e) {
        // The store's own message speaks of ranks and WORLD_SIZE, which is
        // right inside a job; here a person asked for one key by hand.
        if (e.context().phase != "store.wait") throw;
        Address a = parse_address(getk->address);
        throw TimeoutError(
            fmt::format("key '{}' was not set in the store at {} within {:g} s (--timeout)", getk->key,
                        format_address(a), getk->timeout_s),
            {"store.get", -1, -1,
             "check the key's name (as torch's store.set(KEY) names it), set it with `ddpdiag store "
             "set KEY VALUE`, or wait longer with --timeout"});
      }
      std::fwrite(v.data(), 1, v.size(), stdout);
      std::fputc('\n', stdout);
      return 0;
    }
    return static_cast<int>(ExitCode::kUsage);
  };
  return Subcommand{store, run};
}

}  // namespace ddpdiag::cli
