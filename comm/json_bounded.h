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
// than kMaxJsonDepth; its own exceptions pass through as they are. The depth
// is counted by a SAX handler around the parser's own DOM builder, in one
// linear pass: the callback form of parse() re-examines the enclosing array
// each time one of its objects ends, which made a report of a few hundred
// thousand rows take seconds to minutes.
namespace detail {
class BoundedDomBuilder : public nlohmann::detail::json_sax_dom_parser<nlohmann::json> {
  using Base = nlohmann::detail::json_sax_dom_parser<nlohmann::json>;

 public:
  explicit BoundedDomBuilder(nlohmann::json& root) : Base(root, true) {}
  // `enclosing_`: the objects and arrays around the one that starts.
  bool start_object(std::size_t n) {
    if (enclosing_++ >= kMaxJsonDepth) throw JsonTooDeep();
    return Base::start_object(n);
  }
  bool start_array(std::size_t n) {
    if (enclosing_++ >= kMaxJsonDepth) throw JsonTooDeep();
    return Base::start_array(n);
  }
  bool end_object() {
    --enclosing_;
    return Base::end_object();
  }
  bool end_array() {
    --enclosing_;
    return Base::end_array();
  }

 private:
  int enclosing_ = 0;
};
}  // namespace detail

inline nlohmann::json parse_json_bounded(std::string_view text) {
  nlohmann::json root;
  detail::BoundedDomBuilder builder(root);
  nlohmann::json::sax_parse(text.begin(), text.end(), &builder);
  return root;
}

}  // namespace ddpdiag
