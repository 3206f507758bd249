// The rendezvous store: a small key-value service with blocking waits, as
// c10d's Store. Every call that can wait takes a timeout; when it passes the
// call throws TimeoutError naming the keys it was waiting for.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ddpdiag {

using Bytes = std::vector<std::uint8_t>;
using Millis = std::chrono::milliseconds;

// steady_clock::now() + timeout without overflow for "forever"-like values.
inline std::chrono::steady_clock::time_point deadline_after(Millis timeout) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto room = std::chrono::duration_cast<Millis>(Clock::time_point::max() - now);
  return timeout >= room ? Clock::time_point::max() : now + timeout;
}

// Time left until a deadline, at least 1 ms: every wait that takes a timeout
// (ours and Gloo's, which reads 0 as "no timeout") gets a positive one.
inline Millis time_left(std::chrono::steady_clock::time_point deadline) {
  const auto left =
      std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
  return left.count() > 0 ? left : Millis(1);
}

inline Bytes to_bytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string to_string(const Bytes& b) { return std::string(b.begin(), b.end()); }

class Store {
 public:
  // torch.distributed's default store timeout is 300 s; ddpdiag is a
  // pre-flight tool and users expect an answer within a minute.
  static constexpr Millis kDefaultTimeout{std::chrono::seconds(60)};

  virtual ~Store() = default;

  virtual void set(const std::string& key, const Bytes& value) = 0;
  // Waits up to `timeout` for the key to exist, then returns its value.
  virtual Bytes get(const std::string& key, Millis timeout) = 0;
  // Atomically adds delta to the counter at key (missing counts as 0) and
  // returns the new value. Counters are stored as decimal ASCII, as c10d does.
  virtual std::int64_t add(const std::string& key, std::int64_t delta) = 0;
  // True when every key exists (no waiting).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits until every key exists; TimeoutError names the missing ones.
  virtual void wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  // c10d semantics: missing key and empty expected -> set desired, return it;
  // missing key and non-empty expected -> return expected; present key ->
  // replaced by desired only if equal to expected; returns the current value.
  virtual Bytes compare_set(const std::string& key, const Bytes& expected,
                            const Bytes& desired) = 0;
  // True when the key existed.
  virtual bool delete_key(const std::string& key) = 0;
  virtual std::int64_t num_keys() = 0;
};

// Keys are stored as "<prefix>/<key>". Nests: a PrefixStore over a
// PrefixStore joins the prefixes.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool delete_key(const std::string& key) override;
  std::int64_t num_keys() override;  // of the whole underlying store

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& base() const { return base_; }

 private:
  std::string join(const std::string& key) const;
  std::string prefix_;
  std::shared_ptr<Store> base_;
};

// In-process store for tests that run ranks as threads.
class MemoryStore : public Store {
 public:
  MemoryStore();
  ~MemoryStore() override;
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, Millis timeout) override;
  Bytes compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  bool delete_key(const std::string& key) override;
  std::int64_t num_keys() override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ddpdiag
