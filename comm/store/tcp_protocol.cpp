#include "comm/store/tcp_protocol.h"

#include <cstring>
#include <stdexcept>

namespace ddpdiag {

std::string_view store_protocol_name(StoreProtocol p) {
  switch (p) {
    case StoreProtocol::kAuto: return "auto";
    case StoreProtocol::kV1: return "torch-1.13";
    case StoreProtocol::kV2: return "torch-2.x";
  }
  return "unknown";
}

namespace tcp_protocol {
namespace {

constexpr std::uint8_t kNone = 0xff;

// Index: Op. Value: query-type byte, kNone when the version lacks the op.
constexpr std::uint8_t kV1Codes[] = {
    kNone, /*SET*/ 0, /*COMPARE_SET*/ 1, /*GET*/ 2, /*ADD*/ 3, /*CHECK*/ 4, /*WAIT*/ 5,
    /*GETNUMKEYS*/ 6, /*WATCH_KEY*/ 7, /*DELETE_KEY*/ 8, kNone, kNone, kNone, kNone, kNone,
    kNone, kNone, kNone, kNone};
constexpr std::uint8_t kV2Codes[] = {
    /*VALIDATE*/ 0, /*SET*/ 1, /*COMPARE_SET*/ 2, /*GET*/ 3, /*ADD*/ 4, /*CHECK*/ 5, /*WAIT*/ 6,
    /*GETNUMKEYS*/ 7, kNone, /*DELETE_KEY*/ 8, /*APPEND*/ 9, /*MULTI_GET*/ 10,
    /*MULTI_SET*/ 11, /*CANCEL_WAIT*/ 12, /*PING*/ 13,
    /*QUEUE_PUSH*/ 14, /*QUEUE_POP*/ 15, /*QUEUE_LEN*/ 16, /*LIST_KEYS*/ 17};
constexpr std::size_t kNumOps = sizeof(kV1Codes);
static_assert(sizeof(kV2Codes) == kNumOps);
static_assert(static_cast<std::size_t>(Op::kListKeys) + 1 == kNumOps);

const std::uint8_t* codes(StoreProtocol p) {
  if (p == StoreProtocol::kV1) return kV1Codes;
  if (p == StoreProtocol::kV2) return kV2Codes;
  return nullptr;
}

// Cursor over a partially received request. Every read checks the bytes are
// there; a short read turns into kNeedMore with the total bytes needed.
class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t len) : data_(data), len_(len) {}
  bool have(std::size_t n) {
    if (len_ - pos_ >= n) return true;
    need_ = pos_ + n;
    return false;
  }
  std::uint8_t u8() { return data_[pos_++]; }
  std::uint32_t u32() {
    auto v = load_u32(data_ + pos_);
    pos_ += 4;
    return v;
  }
  std::uint64_t u64() {
    auto v = load_u64(data_ + pos_);
    pos_ += 8;
    return v;
  }
  const std::uint8_t* take(std::size_t n) {
    auto p = data_ + pos_;
    pos_ += n;
    return p;
  }
  std::size_t pos() const { return pos_; }
  std::size_t need() const { return need_; }

 private:
  const std::uint8_t* data_;
  std::size_t len_;
  std::size_t pos_ = 0;
  std::size_t need_ = 0;
};

enum class Step { kOk, kNeedMore, kBad };

Step read_field(Reader& r, std::size_t max, const char* what, std::string& error,
                const std::uint8_t** out, std::size_t* out_len) {
  if (!r.have(8)) return Step::kNeedMore;
  std::uint64_t n = r.u64();
  if (n > max) {
    error = std::string(what) + " of " + std::to_string(n) + " bytes exceeds the limit of " +
            std::to_string(max);
    return Step::kBad;
  }
  if (!r.have(static_cast<std::size_t>(n))) return Step::kNeedMore;
  *out_len = static_cast<std::size_t>(n);
  *out = r.take(*out_len);
  return Step::kOk;
}

Step read_key(Reader& r, const ParseLimits& lim, std::string& error, std::vector<std::string>& keys) {
  const std::uint8_t* p = nullptr;
  std::size_t n = 0;
  Step s = read_field(r, lim.max_key_bytes, "key", error, &p, &n);
  if (s == Step::kOk) keys.emplace_back(reinterpret_cast<const char*>(p), n);
  return s;
}

Step read_value(Reader& r, const ParseLimits& lim, std::string& error, std::vector<Bytes>& values) {
  const std::uint8_t* p = nullptr;
  std::size_t n = 0;
  Step s = read_field(r, lim.max_value_bytes, "value", error, &p, &n);
  if (s == Step::kOk) values.emplace_back(p, p + n);
  return s;
}

Step read_count(Reader& r, const ParseLimits& lim, std::string& error, std::size_t* count) {
  if (!r.have(8)) return Step::kNeedMore;
  std::uint64_t n = r.u64();
  if (n > lim.max_keys_per_request) {
    error = "key count " + std::to_string(n) + " exceeds the limit of " +
            std::to_string(lim.max_keys_per_request);
    return Step::kBad;
  }
  *count = static_cast<std::size_t>(n);
  return Step::kOk;
}

#define DDPDIAG_STEP(expr)                         \
  do {                                             \
    Step s_ = (expr);                              \
    if (s_ == Step::kNeedMore) return need_more(); \
    if (s_ == Step::kBad) return bad();            \
  } while (0)

}  // namespace

std::string_view op_name(Op op) {
  static constexpr std::string_view kNames[] = {
      "VALIDATE",   "SET",    "COMPARE_SET", "GET",       "ADD",       "CHECK",       "WAIT", "GETNUMKEYS",
      "WATCH_KEY",  "DELETE_KEY", "APPEND",  "MULTI_GET", "MULTI_SET", "CANCEL_WAIT", "PING",
      "QUEUE_PUSH", "QUEUE_POP", "QUEUE_LEN", "LIST_KEYS"};
  auto i = static_cast<std::size_t>(op);
  return i < kNumOps ? kNames[i] : "UNKNOWN";
}

std::optional<std::uint8_t> op_code(StoreProtocol p, Op op) {
  const auto* c = codes(p);
  auto i = static_cast<std::size_t>(op);
  if (!c || i >= kNumOps || c[i] == kNone) return std::nullopt;
  return c[i];
}

std::optional<Op> op_from_code(StoreProtocol p, std::uint8_t code) {
  const auto* c = codes(p);
  // kNone marks the ops a version lacks; as a query byte it is unknown.
  if (!c || code == kNone) return std::nullopt;
  for (std::size_t i = 0; i < kNumOps; ++i)
    if (c[i] == code) return static_cast<Op>(i);
  return std::nullopt;
}

void append_u8(Bytes& out, std::uint8_t v) { out.push_back(v); }
void append_u32(Bytes& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void append_u64(Bytes& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void append_i64(Bytes& out, std::int64_t v) { append_u64(out, static_cast<std::uint64_t>(v)); }
void append_bytes(Bytes& out, const std::uint8_t* data, std::size_t len) {
  append_u64(out, len);
  out.insert(out.end(), data, data + len);
}

std::uint64_t load_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint32_t load_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::optional<std::int64_t> parse_counter(const Bytes& value, bool* out_of_range) {
  if (out_of_range) *out_of_range = false;
  // By hand rather than strtoll: the value is bytes, not a C string, and
  // isspace would depend on the locale; the c10d servers run in the "C" one.
  auto is_space = [](std::uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); };
  auto is_digit = [](std::uint8_t c) { return c >= '0' && c <= '9'; };
  std::size_t i = 0;
  const std::size_t n = value.size();
  while (i < n && is_space(value[i])) ++i;
  bool negative = false;
  if (i < n && (value[i] == '+' || value[i] == '-')) negative = value[i++] == '-';
  if (i == n || !is_digit(value[i])) return std::nullopt;  // NUL ends the value too
  // The magnitude, up to 2^63 for a negative number and 2^63 - 1 otherwise.
  const std::uint64_t max_mag = negative ? std::uint64_t{1} << 63 : (std::uint64_t{1} << 63) - 1;
  std::uint64_t mag = 0;
  for (; i < n && is_digit(value[i]); ++i) {
    const std::uint64_t d = value[i] - '0';
    if (mag > (max_mag - d) / 10) {
      if (out_of_range) *out_of_range = true;
      return std::nullopt;
    }
    mag = mag * 10 + d;
  }
  // -2^63 has no positive counterpart: negate in unsigned arithmetic.
  return negative ? static_cast<std::int64_t>(~mag + 1) : static_cast<std::int64_t>(mag);
}

Bytes format_counter(std::int64_t v) { return to_bytes(std::to_string(v)); }

std::string printable(std::string_view bytes, std::size_t max_bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  std::size_t chars = 0;
  for (char ch : bytes) {
    if (chars == max_bytes) return out + "...";
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c >= 0x20 && c <= 0x7e) {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
    ++chars;
  }
  return out;
}

Bytes encode_request(StoreProtocol p, const Request& req) {
  auto code = op_code(p, req.op);
  if (!code)
    throw std::invalid_argument(std::string(op_name(req.op)) + " does not exist in protocol " +
                                std::string(store_protocol_name(p)));
  Bytes out;
  std::size_t payload = 16;
  for (const auto& k : req.keys) payload += 8 + k.size();
  for (const auto& v : req.values) payload += 8 + v.size();
  out.reserve(payload);
  out.push_back(*code);
  auto key = [&](std::size_t i) {
    const auto& k = req.keys.at(i);
    append_bytes(out, reinterpret_cast<const std::uint8_t*>(k.data()), k.size());
  };
  switch (req.op) {
    case Op::kValidate: append_u32(out, kValidationMagic); break;
    case Op::kPing: append_u32(out, req.nonce); break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      key(0);
      append_bytes(out, req.values.at(0));
      break;
    case Op::kCompareSet:
      key(0);
      append_bytes(out, req.values.at(0));
      append_bytes(out, req.values.at(1));
      break;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueuePop:
    case Op::kQueueLen: key(0); break;
    case Op::kAdd:
      key(0);
      append_i64(out, req.delta);
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
      append_u64(out, req.keys.size());
      for (std::size_t i = 0; i < req.keys.size(); ++i) key(i);
      break;
    case Op::kMultiSet:
      if (req.values.size() != req.keys.size())
        throw std::invalid_argument("MULTI_SET needs as many values as keys");
      append_i64(out, static_cast<std::int64_t>(req.keys.size()));
      for (std::size_t i = 0; i < req.keys.size(); ++i) {
        key(i);
        append_bytes(out, req.values[i]);
      }
      break;
    case Op::kNumKeys:
    case Op::kCancelWait:
    case Op::kListKeys: break;
  }
  return out;
}

std::optional<StoreProtocol> sniff_protocol(const std::uint8_t* data, std::size_t len) {
  std::size_t n = len < sizeof(kV2Preamble) ? len : sizeof(kV2Preamble);
  if (std::memcmp(data, kV2Preamble, n) != 0) return StoreProtocol::kV1;
  if (n < sizeof(kV2Preamble)) return std::nullopt;
  return StoreProtocol::kV2;
}

ParseResult parse_request(StoreProtocol p, const std::uint8_t* data, std::size_t len,
                          const ParseLimits& lim) {
  ParseResult res;
  Reader r(data, len);
  auto need_more = [&]() {
    res.status = ParseStatus::kNeedMore;
    res.need = r.need();
    res.request = Request{};
    return res;
  };
  // A request of many keys that stops short still needs at least the
  // 8-byte length of every field after the one it stopped in. Asking for
  // those too means a request that trickles in is parsed again only when
  // that much more has come (a geometric series of re-parses, not one per
  // key: a 1 Mi-key WAIT sent a key at a time would otherwise be parsed
  // from its start a million times).
  auto need_more_items = [&](std::size_t items_left, std::size_t min_item_bytes,
                             std::size_t min_rest_of_this_item = 0) {
    ParseResult out = need_more();
    out.need += items_left * min_item_bytes + min_rest_of_this_item;
    return out;
  };
  auto bad = [&]() {
    res.status = ParseStatus::kMalformed;
    res.request = Request{};
    return res;
  };
  if (!r.have(1)) return need_more();
  std::uint8_t code = r.u8();
  auto op = op_from_code(p, code);
  if (!op) {
    res.error = "unknown query type " + std::to_string(code) + " for protocol " +
                std::string(store_protocol_name(p));
    return bad();
  }
  Request& q = res.request;
  q.op = *op;
  switch (*op) {
    case Op::kValidate:
      if (!r.have(4)) return need_more();
      q.nonce = r.u32();
      if (q.nonce != kValidationMagic) {
        res.error = "VALIDATE with a wrong magic number";
        return bad();
      }
      break;
    case Op::kPing:
      if (!r.have(4)) return need_more();
      q.nonce = r.u32();
      break;
    case Op::kSet:
    case Op::kAppend:
    case Op::kQueuePush:
      DDPDIAG_STEP(read_key(r, lim, res.error, q.keys));
      DDPDIAG_STEP(read_value(r, lim, res.error, q.values));
      break;
    case Op::kCompareSet:
      DDPDIAG_STEP(read_key(r, lim, res.error, q.keys));
      DDPDIAG_STEP(read_value(r, lim, res.error, q.values));
      DDPDIAG_STEP(read_value(r, lim, res.error, q.values));
      break;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
    case Op::kQueuePop:
    case Op::kQueueLen: DDPDIAG_STEP(read_key(r, lim, res.error, q.keys)); break;
    case Op::kAdd:
      DDPDIAG_STEP(read_key(r, lim, res.error, q.keys));
      if (!r.have(8)) return need_more();
      q.delta = static_cast<std::int64_t>(r.u64());
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet: {
      std::size_t n = 0;
      DDPDIAG_STEP(read_count(r, lim, res.error, &n));
      // No reserve(n): n is only trusted once the bytes have arrived.
      for (std::size_t i = 0; i < n; ++i) {
        Step s = read_key(r, lim, res.error, q.keys);
        if (s == Step::kNeedMore) return need_more_items(n - i - 1, 8);
        if (s == Step::kBad) return bad();
      }
      break;
    }
    case Op::kMultiSet: {
      std::size_t n = 0;
      DDPDIAG_STEP(read_count(r, lim, res.error, &n));
      for (std::size_t i = 0; i < n; ++i) {
        Step s = read_key(r, lim, res.error, q.keys);
        if (s == Step::kNeedMore) return need_more_items(n - i - 1, 16, 8);
        if (s == Step::kBad) return bad();
        s = read_value(r, lim, res.error, q.values);
        if (s == Step::kNeedMore) return need_more_items(n - i - 1, 16);
        if (s == Step::kBad) return bad();
      }
      break;
    }
    case Op::kNumKeys:
    case Op::kCancelWait:
    case Op::kListKeys: break;
  }
  res.status = ParseStatus::kComplete;
  res.consumed = r.pos();
  return res;
}

}  // namespace tcp_protocol
}  // namespace ddpdiag
