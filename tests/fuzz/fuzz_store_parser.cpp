// libFuzzer target: the store server's request parsing, fed the way the
// server feeds it (tcp_server.cpp, process_input): the protocol sniffed from
// a connection's first bytes, then a stream of requests parsed incrementally
// from an input buffer that grows by arbitrary reads.
//
// Input: byte 0 chooses the parse limits (bits 0-1) and how the stream is cut
// into reads (bits 2-7: 0 = one read of everything); the other bytes are what
// a client sent on one connection.
//
// Invariants (a violation aborts, so libFuzzer keeps the input as a crash):
// - parse_request never reads past len (the one-read pass parses straight
//   from libFuzzer's exactly-sized buffer, and every prefix check from an
//   exactly-sized copy, so AddressSanitizer sees an over-read);
// - a complete request has 0 < consumed <= len, fields within the limits and
//   in the shape its op has, and re-encodes (encode_request) to exactly the
//   consumed bytes: the protocol is canonical in both versions;
// - every strict prefix of a complete request is kNeedMore with a `need`
//   above the prefix and not above the request's size (the server sleeps on
//   `need`, so a larger one would stall the connection);
// - kNeedMore at the end of the stream asks for more than there is; a
//   malformed request carries an error text;
// - cutting the stream into reads changes nothing: the requests parsed and
//   the final verdict are those of the one-read pass;
// - sniffing a prefix of the first bytes answers nothing or the same protocol
//   as the whole, and nothing only while those bytes are a prefix of the 2.x
//   preamble shorter than it.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "tests/fuzz/fuzz_common.h"

namespace {

using namespace ddpdiag;
using namespace ddpdiag::fuzz;

struct Parsed {
  tp::Request request;
  std::size_t consumed = 0;
};

enum class End { kClean, kNeedMore, kMalformed, kUnknownProtocol };

struct Outcome {
  std::optional<StoreProtocol> protocol;
  std::vector<Parsed> requests;
  End end = End::kClean;
};

bool same_request(const tp::Request& a, const tp::Request& b) {
  return a.op == b.op && a.keys == b.keys && a.values == b.values && a.delta == b.delta &&
         a.nonce == b.nonce;
}

std::unique_ptr<std::uint8_t[]> exact_copy(const std::uint8_t* p, std::size_t n) {
  // new[] of exactly n bytes: one byte more is outside the allocation.
  std::unique_ptr<std::uint8_t[]> b(new std::uint8_t[n]);
  if (n) std::memcpy(b.get(), p, n);
  return b;
}

void check_shape(const tp::Request& q, const tp::ParseLimits& lim) {
  for (const auto& k : q.keys)
    if (k.size() > lim.max_key_bytes) fail("key of %zu bytes over the limit of %zu", k.size(), lim.max_key_bytes);
  for (const auto& v : q.values)
    if (v.size() > lim.max_value_bytes)
      fail("value of %zu bytes over the limit of %zu", v.size(), lim.max_value_bytes);
  std::size_t want_keys = 0, want_values = 0;
  switch (q.op) {
    case tp::Op::kSet:
    case tp::Op::kAppend:
    case tp::Op::kQueuePush: want_keys = 1; want_values = 1; break;
    case tp::Op::kCompareSet: want_keys = 1; want_values = 2; break;
    case tp::Op::kGet:
    case tp::Op::kDeleteKey:
    case tp::Op::kWatchKey:
    case tp::Op::kQueuePop:
    case tp::Op::kQueueLen:
    case tp::Op::kAdd: want_keys = 1; break;
    case tp::Op::kCheck:
    case tp::Op::kWait:
    case tp::Op::kMultiGet:
    case tp::Op::kMultiSet:
      if (q.keys.size() > lim.max_keys_per_request)
        fail("%zu keys over the limit of %zu", q.keys.size(), lim.max_keys_per_request);
      want_keys = q.keys.size();
      want_values = q.op == tp::Op::kMultiSet ? q.keys.size() : 0;
      break;
    case tp::Op::kValidate:
      if (q.nonce != tp::kValidationMagic) fail("VALIDATE accepted with magic %08x", q.nonce);
      break;
    case tp::Op::kPing:
    case tp::Op::kNumKeys:
    case tp::Op::kCancelWait:
    case tp::Op::kListKeys: break;
  }
  if (q.keys.size() != want_keys || q.values.size() != want_values)
    fail("%.*s parsed with %zu keys and %zu values", static_cast<int>(tp::op_name(q.op).size()),
         tp::op_name(q.op).data(), q.keys.size(), q.values.size());
  if (q.op != tp::Op::kAdd && q.delta != 0) fail("delta set on a request that has none");
}

// Every strict prefix of the complete request at req[0, n) must be kNeedMore
// with prefix < need <= n. Checks a handful of prefixes, not all: a request
// can be megabytes.
void check_prefixes(StoreProtocol p, const std::uint8_t* req, std::size_t n, const tp::ParseLimits& lim) {
  std::size_t cuts[] = {0, 1, n / 2, n > 9 ? n - 9 : 0, n - 1};
  for (std::size_t cut : cuts) {
    if (cut >= n) continue;
    auto copy = exact_copy(req, cut);
    tp::ParseResult r = tp::parse_request(p, copy.get(), cut, lim);
    if (r.status != tp::ParseStatus::kNeedMore)
      fail("a %zu-byte prefix of a complete %zu-byte request is not kNeedMore (status %d)", cut, n,
           static_cast<int>(r.status));
    if (r.need <= cut || r.need > n)
      fail("a %zu-byte prefix of a %zu-byte request asks for %zu bytes", cut, n, r.need);
  }
}

void check_sniff(const std::uint8_t* data, std::size_t len) {
  auto whole = tp::sniff_protocol(data, len);
  std::size_t upto = len < sizeof(tp::kV2Preamble) ? len : sizeof(tp::kV2Preamble);
  bool preamble_prefix = std::memcmp(data, tp::kV2Preamble, upto) == 0;
  if (!whole && !(preamble_prefix && len < sizeof(tp::kV2Preamble)))
    fail("sniffing %zu bytes answered nothing", len);
  if (whole == StoreProtocol::kV2 && !(preamble_prefix && len >= sizeof(tp::kV2Preamble)))
    fail("2.x sniffed without the preamble");
  for (std::size_t k = 1; k < upto; ++k) {
    auto copy = exact_copy(data, k);
    auto part = tp::sniff_protocol(copy.get(), k);
    if (part && whole && part != whole) fail("sniffing %zu bytes and %zu bytes disagree", k, len);
    if (part && !whole) fail("sniffing %zu bytes decided, %zu bytes did not", k, len);
  }
}

// One read holding the whole stream; parses from the caller's buffer, whose
// end is the end of an allocation.
Outcome parse_in_one_read(const std::uint8_t* data, std::size_t len, const tp::ParseLimits& lim) {
  Outcome o;
  if (len == 0) return o;
  check_sniff(data, len);
  o.protocol = tp::sniff_protocol(data, len);
  if (!o.protocol) {
    o.end = End::kUnknownProtocol;
    return o;
  }
  std::size_t off = 0;
  while (off < len) {
    const std::uint8_t* p = data + off;
    std::size_t avail = len - off;
    tp::ParseResult r = tp::parse_request(*o.protocol, p, avail, lim);
    if (r.status == tp::ParseStatus::kNeedMore) {
      if (r.need <= avail) fail("kNeedMore for %zu bytes with %zu there", r.need, avail);
      o.end = End::kNeedMore;
      return o;
    }
    if (r.status == tp::ParseStatus::kMalformed) {
      if (r.error.empty()) fail("malformed request without an error text");
      o.end = End::kMalformed;
      return o;
    }
    if (r.consumed == 0 || r.consumed > avail) fail("consumed %zu of %zu bytes", r.consumed, avail);
    check_shape(r.request, lim);
    Bytes again = tp::encode_request(*o.protocol, r.request);
    if (again.size() != r.consumed || std::memcmp(again.data(), p, r.consumed) != 0)
      fail("%.*s of %zu bytes re-encodes to %zu different bytes",
           static_cast<int>(tp::op_name(r.request.op).size()), tp::op_name(r.request.op).data(),
           r.consumed, again.size());
    check_prefixes(*o.protocol, p, r.consumed, lim);
    o.requests.push_back({std::move(r.request), r.consumed});
    off += r.consumed;
  }
  return o;
}

// The server's loop (TcpStoreServer::Impl::process_input) over reads whose
// sizes come from seed: an input buffer with a read offset, parsing only once
// `need` bytes are there, compacting the buffer as the server does; at the
// end of the stream (the server's EOF) it parses once more whatever `need`
// said, as the server does, so a malformed field that came before the bytes
// `need` asked for is still found.
Outcome parse_in_reads(const std::uint8_t* data, std::size_t len, const tp::ParseLimits& lim,
                       unsigned seed) {
  Outcome o;
  std::vector<std::uint8_t> in;
  std::size_t in_off = 0, need = 0, fed = 0;
  std::uint32_t x = 0x9e3779b9u ^ (seed * 0x85ebca6bu);
  bool closed = false;
  while (fed < len && !closed) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    // Mostly tiny reads, so requests split everywhere, sometimes large ones.
    std::size_t chunk = (x & 7u) == 0 ? 1 + (x >> 8) % 512 : 1 + (x >> 8) % 7;
    if (chunk > len - fed) chunk = len - fed;
    in.insert(in.end(), data + fed, data + fed + chunk);
    fed += chunk;
    if (fed == len) need = 0;  // the end of the stream: the server's EOF
    for (;;) {
      std::size_t avail = in.size() - in_off;
      if (avail == 0 || avail < need) break;
      const std::uint8_t* p = in.data() + in_off;
      if (!o.protocol) {
        o.protocol = tp::sniff_protocol(p, avail);
        if (!o.protocol) break;
      }
      tp::ParseResult r = tp::parse_request(*o.protocol, p, avail, lim);
      if (r.status == tp::ParseStatus::kNeedMore) {
        need = r.need;
        break;
      }
      if (r.status == tp::ParseStatus::kMalformed) {
        closed = true;
        o.end = End::kMalformed;
        break;
      }
      need = 0;
      in_off += r.consumed;
      o.requests.push_back({std::move(r.request), r.consumed});
    }
    if (in_off == in.size()) {
      in.clear();
      in_off = 0;
    } else if (in_off > 0 && in_off >= in.size() / 2) {
      in.erase(in.begin(), in.begin() + static_cast<std::ptrdiff_t>(in_off));
      in_off = 0;
    }
  }
  if (!closed && len > 0) {
    if (!o.protocol) o.end = End::kUnknownProtocol;
    else if (in.size() > in_off) o.end = End::kNeedMore;
  }
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const unsigned control = data[0];
  const tp::ParseLimits lim = parse_limits(control & 3u);
  const std::uint8_t* stream = data + 1;
  const std::size_t len = size - 1;

  Outcome whole = parse_in_one_read(stream, len, lim);
  const unsigned seed = control >> 2;
  if (seed == 0) return 0;
  Outcome split = parse_in_reads(stream, len, lim, seed);
  if (split.protocol != whole.protocol) fail("the protocol depends on how the stream was read");
  if (split.end != whole.end)
    fail("the stream ends %d in one read, %d in several", static_cast<int>(whole.end), static_cast<int>(split.end));
  if (split.requests.size() != whole.requests.size())
    fail("%zu requests in one read, %zu in several", whole.requests.size(), split.requests.size());
  for (std::size_t i = 0; i < whole.requests.size(); ++i)
    if (split.requests[i].consumed != whole.requests[i].consumed ||
        !same_request(split.requests[i].request, whole.requests[i].request))
      fail("request %zu differs between one read and several", i);
  return 0;
}
