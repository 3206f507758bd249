// TCP store speaking the c10d TCPStore wire protocol of PyTorch 1.13 ("v1")
// and 2.x ("v2"); see reference/torch.md for the byte layouts.
//
// The server serves both protocols on one port: it looks at the first bytes
// of each connection (a v2 client opens with VALIDATE = 00 ce f7 85 3c).
// One event loop (epoll) serves every connection; no thread per client.
// A connection that sends anything malformed, truncated or oversized is
// closed; the others are not disturbed.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "comm/store/store.h"

namespace ddpdiag {

enum class StoreProtocol : std::uint8_t {
  kAuto,  // client only: detect on connect
  kV1,    // PyTorch 1.13
  kV2,    // PyTorch 2.x
};
std::string_view store_protocol_name(StoreProtocol p);  // "auto", "torch-1.13", "torch-2.x"

struct TcpStoreServerOptions {
  std::string host = "0.0.0.0";   // bind address ("::" for IPv6)
  int port = 0;                   // 0 picks a free port (see TcpStoreServer::port())
  // The largest key and value a request may carry on a 2.x connection:
  // torch 2.x's libuv server's limits, so both refuse the same requests.
  std::size_t max_key_bytes = 8 * 1024;
  std::size_t max_value_bytes = 8 * 1024 * 1024;
  // The same on a 1.13 connection. torch 1.13's server has no limits; these
  // bounds (1 GiB each, as tcp_protocol::kV1Limits) are ddpdiag's own and
  // only keep a garbage length from making the server buffer gigabytes.
  std::size_t v1_max_key_bytes = std::size_t{1} << 30;
  std::size_t v1_max_value_bytes = std::size_t{1} << 30;
  // APPEND (2.x) checks each appended piece against max_value_bytes, as
  // torch does, and torch lets the value grow without bound. This bound on
  // the value after appending (1 GiB) is ddpdiag's own sanity bound.
  std::size_t max_appended_value_bytes = std::size_t{1} << 30;
  int max_connections = 65536;
  // A client that does not read its replies cannot make the server buffer
  // without bound: a reply that finds more than this much output still
  // waiting for that client closes its connection. So at most this plus one
  // reply is held, and one large reply (a big value) still goes out whole.
  std::size_t max_pending_output_bytes = std::size_t{64} << 20;
  // Called on the server's thread when it closes a connection for a request
  // the protocol does not allow (unknown query type, oversized key or
  // value, ADD to a value that is not a number, ...), with the client's
  // address and why: "127.0.0.1:50144 (torch-2.x): unknown query type 18".
  // GET of a missing key on 1.13, and WATCH_KEY, are how those clients
  // work and are not reported. Must not block.
  std::function<void(const std::string&)> on_refused;
  // Called on the server's thread, once, when the process runs out of file
  // descriptors and new clients are turned away until some close, with
  // what to do about it. Must not block.
  std::function<void(const std::string&)> on_out_of_fds;
};

class TcpStoreServer {
 public:
  // Binds and starts serving on a background thread. Throws RendezvousError
  // with a hint when the port is taken ("address in use"), UsageError when
  // opts.port is outside 0..65535.
  explicit TcpStoreServer(TcpStoreServerOptions opts);
  ~TcpStoreServer();  // stops the loop, closes every connection

  int port() const;
  std::size_t num_connections() const;  // open client connections now
  std::int64_t num_keys() const;
  std::uint64_t requests_served() const;  // complete requests handled since start

  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct TcpStoreClientOptions {
  std::string host = "127.0.0.1";
  int port = 29500;
  StoreProtocol protocol = StoreProtocol::kAuto;
  // How long connect() keeps retrying (exponential backoff with jitter) before
  // it throws RendezvousError telling refused / timed out / unreachable apart.
  Millis connect_timeout = Store::kDefaultTimeout;
  // Upper bound for calls that do not wait on keys (set, add, ...): a silent
  // server raises TimeoutError instead of blocking forever.
  Millis io_timeout = Store::kDefaultTimeout;
  // c10d clients put "/" in front of every user key; true matches them, so
  // torch and ddpdiag see the same keys.
  bool torch_key_prefix = true;
  int rank = -1;  // for error messages only
  // The server is ddpdiag's own. On the 2.x protocol it answers GET of a
  // missing key with an empty value (as torch's libuv server does), so get()
  // sends GET first and falls back to WAIT + GET only when the value is
  // empty: one round trip instead of two when the key is there. Leave it off
  // for servers of unknown make: torch's older (non-libuv) daemon closes the
  // connection on a GET of a missing key.
  bool one_trip_get = false;
  // The flag that chooses the protocol where this client is used, named in
  // the hints of protocol errors ("ddpdiag store" calls it --protocol).
  std::string protocol_flag = "--store-protocol";
  // The address already answered as a store (another connection of this
  // process): a server silent through the handshake is then a stalled
  // store, a timeout, not another program on the port.
  bool known_store = false;
  // Where the connection attempts are counted as they are made, so that a
  // connect that failed still tells how many it made (store ping's report).
  int* attempts_out = nullptr;
  // Where the time the first TCP connection was made is written, so that a
  // handshake (or protocol detection, which may reconnect) that then failed
  // can be told from the connect (init-check's timeline).
  std::chrono::steady_clock::time_point* connected_at_out = nullptr;
};

// One TCP connection to a store (v1: a second, silent connection is not
// opened; the v1 server does not require it). Calls are serialised with a
// mutex; the store may be shared between threads.
class TcpStoreClient : public Store {
 public:
  // Connects (and detects or checks the protocol). Throws RendezvousError:
  // phase "store.connect" when no TCP connection could be made (refused,
  // timed out, unreachable, name not resolved); phase "store.handshake" when
  // the host accepted the connection but did not speak the store protocol
  // asked for (or, with kAuto, either one).
  explicit TcpStoreClient(TcpStoreClientOptions opts);
  ~TcpStoreClient() override;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool delete_key(const std::string& key) override;
  std::int64_t num_keys() override;

  // Every key in the store as its server holds it, sorted (a torch client's
  // keys, and this client's with torch_key_prefix, start with "/"). Needs
  // the 2.x protocol and a server with LIST_KEYS (torch 2.10 and later, and
  // ddpdiag's): UsageError on 1.13; RendezvousError (phase store.list_keys)
  // when the server closes the connection at the request, as older 2.x
  // servers do.
  std::vector<std::string> list_keys();

  // The protocol in use (detected when opts.protocol was kAuto).
  StoreProtocol protocol() const;
  // Round trip of one cheap request (v2: PING; v1: GETNUMKEYS), in microseconds.
  double ping_us();
  // How many connection attempts connect() made before it succeeded.
  int connect_attempts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddpdiag
