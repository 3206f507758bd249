// JSON read from a user's file, with a bound on how deep it nests. The
// parser itself keeps its nesting on the heap, but every recursive walk over
// the result (a dump in an error message, a copy, the renderer) uses the
// stack: a file nested a hundred thousand levels deep (hand-made or hostile)
// would end the process with SIGSEGV instead of an error naming the file.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace ddpdiag {

// No file ddpdiag reads (reports, model layouts) nests more than a few levels.
inline constexpr int kMaxJsonDepth = 64;

class JsonTooDeep : public std::runtime_error {
 public:
  JsonTooDeep()
      : std::runtime_error("it nests JSON objects or arrays more than " + std::to_string(kMaxJsonDepth) +
                           " levels deep") {}
};

// nlohmann::json::parse, refusing (JsonTooDeep) an object or array deeper
// than kMaxJsonDepth; its own exceptions pass through as they are.
inline nlohmann::json parse_json_bounded(std::string_view text) {
  const nlohmann::json::parser_callback_t limit = [](int depth, nlohmann::json::parse_event_t event,
                                                     nlohmann::json&) {
    if (depth > kMaxJsonDepth && (event == nlohmann::json::parse_event_t::object_start ||
                                  event == nlohmann::json::parse_event_t::array_start))
      throw JsonTooDeep();
    return true;
  };
  return nlohmann::json::parse(text.begin(), text.end(), limit);
}

}  // namespace ddpdiag
