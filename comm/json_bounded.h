// JSON read from a user's file, with a bound on how deep it nests. The
// parser itself keeps its nesting on the heap, but every recursive walk over
// the result (a dump in an error message, a copy, the renderer) uses the
// stack: a file nested a hundred thousand levels deep (hand-made or hostile)
// would end the process with SIGSEGV instead of an error naming the file.
#pragma once

#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

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

// A key that appears twice in one object ({"verdict": "FAIL", "verdict":
// "PASS"}): nlohmann keeps the last, so what a reader sees would depend on
// the order of the text. `pointer` is the JSON pointer of the repeated key.
class JsonDuplicateKey : public std::runtime_error {
 public:
  explicit JsonDuplicateKey(const std::string& pointer)
      : std::runtime_error("the key at " + pointer + " appears twice in one object"), pointer_(pointer) {}
  const std::string& pointer() const { return pointer_; }

 private:
  std::string pointer_;
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
  BoundedDomBuilder(nlohmann::json& root, bool refuse_duplicate_keys)
      : Base(root, true), refuse_duplicates_(refuse_duplicate_keys) {}
  // `enclosing_`: the objects and arrays around the one that starts.
  bool start_object(std::size_t n) {
    if (enclosing_++ >= kMaxJsonDepth) throw JsonTooDeep();
    open(false);
    return Base::start_object(n);
  }
  bool start_array(std::size_t n) {
    if (enclosing_++ >= kMaxJsonDepth) throw JsonTooDeep();
    open(true);
    return Base::start_array(n);
  }
  bool end_object() {
    --enclosing_;
    close();
    return Base::end_object();
  }
  bool end_array() {
    --enclosing_;
    close();
    return Base::end_array();
  }
  bool key(std::string& k) {
    if (refuse_duplicates_) {
      Frame& f = frames_.back();
      f.name = k;
      if (!f.keys.insert(k).second) throw JsonDuplicateKey(pointer());
    }
    return Base::key(k);
  }
  bool null() { return element(), Base::null(); }
  bool boolean(bool v) { return element(), Base::boolean(v); }
  bool number_integer(nlohmann::json::number_integer_t v) { return element(), Base::number_integer(v); }
  bool number_unsigned(nlohmann::json::number_unsigned_t v) { return element(), Base::number_unsigned(v); }
  bool number_float(nlohmann::json::number_float_t v, const std::string& s) {
    return element(), Base::number_float(v, s);
  }
  bool string(std::string& v) { return element(), Base::string(v); }
  bool binary(nlohmann::json::binary_t& v) { return element(), Base::binary(v); }

 private:
  // Where the parser is, for the pointer of a repeated key: per enclosing
  // object its keys so far and the current one, per array its elements.
  struct Frame {
    bool array = false;
    std::size_t elements = 0;
    std::string name;
    std::set<std::string> keys;
  };
  void element() {
    if (refuse_duplicates_ && !frames_.empty() && frames_.back().array) ++frames_.back().elements;
  }
  void open(bool array) {
    if (!refuse_duplicates_) return;
    element();
    frames_.push_back({array, 0, {}, {}});
  }
  void close() {
    if (refuse_duplicates_) frames_.pop_back();
  }
  std::string pointer() const {
    std::string out;
    for (const Frame& f : frames_) {
      out += '/';
      if (f.array) {
        out += std::to_string(f.elements - 1);
        continue;
      }
      for (char c : f.name) out += c == '~' ? std::string("~0") : c == '/' ? std::string("~1") : std::string(1, c);
    }
    return out;
  }

  int enclosing_ = 0;
  bool refuse_duplicates_;
  std::vector<Frame> frames_;
};
}  // namespace detail

// With `refuse_duplicate_keys`, a key repeated in one object is refused
// (JsonDuplicateKey) instead of the last one winning.
inline nlohmann::json parse_json_bounded(std::string_view text, bool refuse_duplicate_keys = false) {
  nlohmann::json root;
  detail::BoundedDomBuilder builder(root, refuse_duplicate_keys);
  nlohmann::json::sax_parse(text.begin(), text.end(), &builder);
  return root;
}

}  // namespace ddpdiag
