// Writes the seed corpus of a store fuzz target into a directory: valid
// requests of every op of both protocols, alone and as whole sessions, in
// the input layout of that target (see the targets' file comments).
// Usage: store_fuzz_seeds parser|server DIR
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_common.h"

namespace {

using namespace ddpdiag;
using namespace ddpdiag::fuzz;

int g_written = 0;

void write_seed(const std::filesystem::path& dir, const std::string& name, const Bytes& bytes) {
  std::ofstream f(dir / name, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) fail("cannot write %s", (dir / name).c_str());
  ++g_written;
}

Bytes session(StoreProtocol p, const std::vector<tp::Request>& reqs) {
  Bytes b = connection_start(p);
  for (const auto& q : reqs) {
    Bytes r = tp::encode_request(p, q);
    b.insert(b.end(), r.begin(), r.end());
  }
  return b;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
  return out;
}

// Parser layout: control byte (limits, read cutting), then the stream.
void parser_seeds(const std::filesystem::path& dir) {
  for (StoreProtocol p : {StoreProtocol::kV1, StoreProtocol::kV2}) {
    const std::string tag = p == StoreProtocol::kV1 ? "v1" : "v2";
    auto reqs = every_request(p);
    for (const auto& q : reqs) {
      Bytes b{0x04};  // default limits, cut into reads
      Bytes s = session(p, {q});
      b.insert(b.end(), s.begin(), s.end());
      write_seed(dir, tag + "-" + lower(tp::op_name(q.op)), b);
    }
    Bytes all = session(p, reqs);
    for (std::uint8_t control : {0x00, 0x05, 0x0a, 0xfd}) {
      Bytes b{control};
      b.insert(b.end(), all.begin(), all.end());
      char name[32];
      std::snprintf(name, sizeof(name), "%s-session-%02x", tag.c_str(), control);
      write_seed(dir, name, b);
    }
  }
  // Found by fuzzing: 0xff, the table's marker for "no such op", was taken
  // as the query byte of VALIDATE on 1.13 and of WATCH_KEY on 2.x.
  Bytes v1_ff{0x04, 0xff, 0xce, 0xf7, 0x85, 0x3c};
  write_seed(dir, "regression-v1-query-ff", v1_ff);
  Bytes v2_ff{0x04};
  Bytes start = connection_start(StoreProtocol::kV2);
  v2_ff.insert(v2_ff.end(), start.begin(), start.end());
  for (int b : {0xff, 1, 0, 0, 0, 0, 0, 0, 0, int('w')}) v2_ff.push_back(static_cast<std::uint8_t>(b));
  write_seed(dir, "regression-v2-query-ff", v2_ff);
}

// Server layout: control byte (limits, connections), then records of a
// header byte (connection, payload length) and the payload.
void append_records(Bytes& out, unsigned conn, const Bytes& stream) {
  for (std::size_t off = 0; off < stream.size();) {
    std::size_t n = std::min<std::size_t>(64, stream.size() - off);
    out.push_back(static_cast<std::uint8_t>(((n - 1) << 2) | conn));
    out.insert(out.end(), stream.begin() + static_cast<std::ptrdiff_t>(off),
               stream.begin() + static_cast<std::ptrdiff_t>(off + n));
    off += n;
  }
}

void server_seeds(const std::filesystem::path& dir) {
  for (StoreProtocol p : {StoreProtocol::kV1, StoreProtocol::kV2}) {
    const std::string tag = p == StoreProtocol::kV1 ? "v1" : "v2";
    auto reqs = every_request(p);
    for (const auto& q : reqs) {
      Bytes b{0x00};  // default limits, one connection
      append_records(b, 0, session(p, {q}));
      write_seed(dir, tag + "-" + lower(tp::op_name(q.op)), b);
    }
    Bytes b{0x00};
    append_records(b, 0, session(p, reqs));
    write_seed(dir, tag + "-session", b);
  }
  // A WAIT on one connection woken by a SET on another, a queue pop that
  // waits for a push, and CANCEL_WAIT: two 2.x connections.
  Bytes b{0x04};
  append_records(b, 0, session(StoreProtocol::kV2, {{tp::Op::kWait, {"w", "q"}, {}, 0, 0},
                                                    {tp::Op::kCancelWait, {}, {}, 0, 0}}));
  append_records(b, 1, session(StoreProtocol::kV2, {{tp::Op::kSet, {"w"}, {to_bytes("1")}, 0, 0},
                                                    {tp::Op::kQueuePush, {"q"}, {to_bytes("x")}, 0, 0},
                                                    {tp::Op::kQueuePop, {"q"}, {}, 0, 0}}));
  write_seed(dir, "v2-wait-wake", b);
  // A 1.13 and a 2.x client side by side on tight limits.
  Bytes mixed{0x05};
  append_records(mixed, 0, session(StoreProtocol::kV1, every_request(StoreProtocol::kV1)));
  append_records(mixed, 1, session(StoreProtocol::kV2, every_request(StoreProtocol::kV2)));
  write_seed(dir, "mixed-tight", mixed);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || (std::strcmp(argv[1], "parser") != 0 && std::strcmp(argv[1], "server") != 0)) {
    std::fprintf(stderr, "usage: %s parser|server DIR\n", argv[0]);
    return 2;
  }
  std::filesystem::path dir = argv[2];
  std::filesystem::create_directories(dir);
  if (std::strcmp(argv[1], "parser") == 0) parser_seeds(dir);
  else server_seeds(dir);
  std::printf("%d seeds for the %s target in %s\n", g_written, argv[1], dir.c_str());
  return 0;
}
