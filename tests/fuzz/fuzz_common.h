// Shared by the store fuzz targets and their seed generator: valid requests
// of every op of both protocols, and a failure path that aborts, so libFuzzer
// records the input as a crash.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "comm/store/tcp_protocol.h"

namespace ddpdiag::fuzz {

namespace tp = tcp_protocol;

[[noreturn]] inline void fail(const char* fmt, ...) {
  std::va_list ap;
  va_start(ap, fmt);
  std::fputs("store fuzz invariant violated: ", stderr);
  std::vfprintf(stderr, fmt, ap);
  std::fputc('\n', stderr);
  va_end(ap);
  std::abort();
}

// One valid request of every op protocol p has, with keys and values small
// enough for the tightest limits the targets use (ParseLimitSet below).
inline std::vector<tp::Request> every_request(StoreProtocol p) {
  std::vector<tp::Request> reqs = {
      {tp::Op::kSet, {"k"}, {to_bytes("v")}, 0, 0},
      {tp::Op::kCompareSet, {"k"}, {to_bytes(""), to_bytes("new")}, 0, 0},
      {tp::Op::kGet, {"k"}, {}, 0, 0},
      {tp::Op::kAdd, {"c"}, {}, -7, 0},
      {tp::Op::kCheck, {"a", "b"}, {}, 0, 0},
      {tp::Op::kWait, {"k"}, {}, 0, 0},
      {tp::Op::kNumKeys, {}, {}, 0, 0},
      {tp::Op::kDeleteKey, {"k"}, {}, 0, 0},
  };
  if (p == StoreProtocol::kV1) {
    reqs.push_back({tp::Op::kWatchKey, {"w"}, {}, 0, 0});
  } else {
    reqs.push_back({tp::Op::kValidate, {}, {}, 0, tp::kValidationMagic});
    reqs.push_back({tp::Op::kAppend, {"k"}, {to_bytes("xyz")}, 0, 0});
    reqs.push_back({tp::Op::kMultiGet, {"a", "b"}, {}, 0, 0});
    reqs.push_back({tp::Op::kMultiSet, {"a", "b"}, {to_bytes("1"), to_bytes("22")}, 0, 0});
    reqs.push_back({tp::Op::kCancelWait, {}, {}, 0, 0});
    reqs.push_back({tp::Op::kPing, {}, {}, 0, 0xdeadbeef});
    reqs.push_back({tp::Op::kQueuePush, {"q"}, {to_bytes("item")}, 0, 0});
    reqs.push_back({tp::Op::kQueuePop, {"q"}, {}, 0, 0});
    reqs.push_back({tp::Op::kQueueLen, {"q"}, {}, 0, 0});
    reqs.push_back({tp::Op::kListKeys, {}, {}, 0, 0});
  }
  return reqs;
}

// What a client of protocol p sends on a fresh connection before reqs: the
// 2.x preamble (VALIDATE + magic) or nothing.
inline Bytes connection_start(StoreProtocol p) {
  if (p == StoreProtocol::kV2) return Bytes(std::begin(tp::kV2Preamble), std::end(tp::kV2Preamble));
  return {};
}

// Parse limits the targets choose between (two bits of the input): the
// defaults (torch 2.x's; the server gives 1.13 connections its own), and
// tight ones that inputs of a few bytes can reach.
inline tp::ParseLimits parse_limits(unsigned which) {
  tp::ParseLimits lim;
  switch (which & 3u) {
    case 0: break;  // the server's defaults
    case 1: lim.max_key_bytes = 16; lim.max_value_bytes = 64; lim.max_keys_per_request = 4; break;
    case 2: lim.max_key_bytes = 1; lim.max_value_bytes = 4; lim.max_keys_per_request = 2; break;
    default: lim.max_key_bytes = 0; lim.max_value_bytes = 0; lim.max_keys_per_request = 0; break;
  }
  return lim;
}

}  // namespace ddpdiag::fuzz
