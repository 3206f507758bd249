// The c10d TCPStore wire protocol of PyTorch 1.13 ("v1") and 2.x ("v2") as
// pure functions: request encoding (client side), incremental request parsing
// (server side) and reply encoding. No sockets here, so every byte layout is
// unit-testable.
//
// Framing (both versions): a request is one byte of query type followed by
// its arguments; strings and byte values are a uint64 LE length then the
// bytes; key counts are uint64 LE (MULTI_SET's count is int64 LE, same bytes
// for any sane count); integers are int64 LE; PING's nonce and VALIDATE's
// magic are uint32 LE. Replies are bare values with no framing of their own,
// so a client must know which reply shape each request has. One request at a
// time per connection, no request ids: the reply stream is in request order.
//
// The two versions differ in the query-type numbering (2.x inserted VALIDATE
// at 0 and dropped WATCH_KEY) and in the handshake: a 2.x client opens every
// connection with VALIDATE (00 ce f7 85 3c); a 1.13 client sends no handshake.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "comm/store/store.h"
#include "comm/store/tcp_store.h"

namespace ddpdiag::tcp_protocol {

inline constexpr std::uint32_t kValidationMagic = 0x3C85F7CE;
// The first five bytes of every 2.x connection: VALIDATE (0) + magic, LE.
inline constexpr std::uint8_t kV2Preamble[5] = {0x00, 0xce, 0xf7, 0x85, 0x3c};

// Protocol-independent operation names; the codes differ per version.
enum class Op : std::uint8_t {
  kValidate,
  kSet,
  kCompareSet,
  kGet,
  kAdd,
  kCheck,
  kWait,
  kNumKeys,
  kWatchKey,  // 1.13 only
  kDeleteKey,
  kAppend,     // 2.x only from here on
  kMultiGet,
  kMultiSet,
  kCancelWait,
  kPing,
  kQueuePush,  // QUEUE_PUSH(key, value), no reply
  kQueuePop,   // QUEUE_POP(key) -> int64 length before the pop, then the value if it was > 0
  kQueueLen,   // QUEUE_LEN(key) -> int64
  kListKeys,   // LIST_KEYS -> int64 count, then each key (length-prefixed); torch 2.10 and later
};
std::string_view op_name(Op op);

// Query-type byte of op in protocol p (kV1 or kV2); nullopt when p lacks op.
std::optional<std::uint8_t> op_code(StoreProtocol p, Op op);
// Inverse of op_code; nullopt for an unknown code.
std::optional<Op> op_from_code(StoreProtocol p, std::uint8_t code);

// Reply enums (one byte on the wire, same values in both versions).
enum class CheckReply : std::uint8_t { kReady = 0, kNotReady = 1 };
enum class WaitReply : std::uint8_t { kStopWaiting = 0, kWaitCanceled = 1 };
// 1.13's reply to WATCH_KEY (WatchResponseType::KEY_CALLBACK_REGISTERED).
inline constexpr std::uint8_t kWatchCallbackRegistered = 3;

// One decoded request. Which fields are used depends on op:
//   SET/APPEND/QUEUE_PUSH: keys[0], values[0]      COMPARE_SET: keys[0], values[0]=expected, values[1]=desired
//   GET/DELETE_KEY/WATCH_KEY/QUEUE_POP/QUEUE_LEN: keys[0]   ADD: keys[0], delta
//   CHECK/WAIT/MULTI_GET: keys          MULTI_SET: keys, values (same count)
//   PING: nonce   VALIDATE: nonce = magic   GETNUMKEYS/CANCEL_WAIT/LIST_KEYS: nothing
struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  std::vector<Bytes> values;
  std::int64_t delta = 0;
  std::uint32_t nonce = 0;
};

// Bytes of req in protocol p. Throws std::invalid_argument when p lacks req.op.
Bytes encode_request(StoreProtocol p, const Request& req);

// What one request may carry; a field or a count over its limit makes the
// request malformed. The defaults are torch 2.x's libuv server's limits
// (kV2Limits): it refuses a key over 8 KiB, a value over 8 MiB and more than
// 128 Ki keys in one CHECK/WAIT/MULTI_GET/MULTI_SET (the same requests,
// measured against torch 2.11's server).
struct ParseLimits {
  std::size_t max_key_bytes = 8 * 1024;
  std::size_t max_value_bytes = 8 * 1024 * 1024;
  std::size_t max_keys_per_request = 128 * 1024;
};
inline constexpr ParseLimits kV2Limits{};
// torch 1.13's server has no limits at all. These bounds are ddpdiag's own
// sanity bounds, far above what a real 1.13 client sends: 1 GiB per key or
// value, so a garbage length cannot make the server buffer gigabytes; and
// 1 Mi keys per request (8 times what 2.x allows), because a request still
// arriving is parsed again from its start as more of it comes (only once
// at least the length prefixes of all its remaining keys could have come,
// see ParseResult::need, so a request trickling in is re-parsed a few dozen
// times, not once per key).
inline constexpr ParseLimits kV1Limits{std::size_t{1} << 30, std::size_t{1} << 30, std::size_t{1} << 20};
// The bounds a connection of protocol p gets by default (kV1Limits or
// kV2Limits).
inline constexpr const ParseLimits& default_limits(StoreProtocol p) {
  return p == StoreProtocol::kV1 ? kV1Limits : kV2Limits;
}

enum class ParseStatus : std::uint8_t {
  kNeedMore,   // a valid prefix; wait for `need` bytes in total
  kComplete,   // `consumed` bytes form `request`
  kMalformed,  // unknown op, oversized field, bad magic: close the connection
};
struct ParseResult {
  ParseStatus status = ParseStatus::kNeedMore;
  std::size_t consumed = 0;  // kComplete: bytes of the request
  std::size_t need = 0;      // kNeedMore: lower bound on the bytes the request needs
                             // (counting 8 bytes for every field not yet seen)
  Request request;
  std::string error;         // kMalformed: why, for logs and tests
};

// Parses at most one request from the front of data[0, len). Never reads
// past len, never allocates for a field before checking it against limits.
ParseResult parse_request(StoreProtocol p, const std::uint8_t* data, std::size_t len,
                          const ParseLimits& limits);

// Which protocol a server connection speaks, from its first bytes: kV2 when
// they are the 2.x preamble, kV1 when they cannot be, nullopt while too few
// bytes have arrived to tell (only possible when the first byte is 0).
std::optional<StoreProtocol> sniff_protocol(const std::uint8_t* data, std::size_t len);

// Reply encoders (server side).
void append_u8(Bytes& out, std::uint8_t v);
void append_u32(Bytes& out, std::uint32_t v);
void append_i64(Bytes& out, std::int64_t v);
void append_u64(Bytes& out, std::uint64_t v);
void append_bytes(Bytes& out, const std::uint8_t* data, std::size_t len);  // length-prefixed
inline void append_bytes(Bytes& out, const Bytes& b) { append_bytes(out, b.data(), b.size()); }

// Little-endian loads (client side reply decoding).
std::uint64_t load_u64(const std::uint8_t* p);
std::uint32_t load_u32(const std::uint8_t* p);

// ADD's counter format: decimal ASCII, read as the c10d servers read it,
// with std::stoll (base 10): leading whitespace (" \t\n\v\f\r"), an
// optional sign, then digits; whatever follows the digits is ignored, and the
// value ends at a NUL byte as a C string does ("5\n", "+5", "5abc" are 5,
// "0x10" is 0). Returns nullopt where std::stoll throws: no digits at all
// (*out_of_range false), or a number outside int64 (*out_of_range true).
// The c10d servers drop the connection then.
std::optional<std::int64_t> parse_counter(const Bytes& value, bool* out_of_range = nullptr);
Bytes format_counter(std::int64_t v);

// Key or value bytes for a message or a listing: printable ASCII as is,
// backslash and other bytes as \\ and \xNN, cut after max_bytes of input
// with "..." (so a binary or 8 KiB key stays one short line).
std::string printable(std::string_view bytes, std::size_t max_bytes = 80);

}  // namespace ddpdiag::tcp_protocol
