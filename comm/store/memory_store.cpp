// In-process store for tests that run ranks as threads. One mutex guards the
// map; every mutation notifies one condition variable that all waiters share
// (waiters re-check their own keys), which is plenty for a handful of ranks.
#include <condition_variable>
#include <map>
#include <mutex>
#include <string>

#include "comm/errors.h"
#include "comm/store/store.h"

namespace ddpdiag {

struct MemoryStore::Impl {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::string, Bytes> data;

  bool has_all(const std::vector<std::string>& keys) const {
    for (const auto& k : keys)
      if (!data.count(k)) return false;
    return true;
  }

  // Waits with the lock held; on timeout throws naming the keys still absent.
  void wait_locked(std::unique_lock<std::mutex>& lock, const std::vector<std::string>& keys,
                   Millis timeout, const char* phase) {
    if (changed.wait_for(lock, timeout, [&] { return has_all(keys); })) return;
    std::string missing;
    for (const auto& k : keys) {
      if (data.count(k)) continue;
      if (!missing.empty()) missing += ", ";
      missing += "'" + k + "'";
    }
    throw TimeoutError("memory store: timed out after " + std::to_string(timeout.count()) +
                           " ms waiting for key(s) " + missing,
                       ErrorContext{phase, -1, -1,
                                    "a rank did not publish its key in time; check that "
                                    "every rank started"});
  }
};

MemoryStore::MemoryStore() : impl_(std::make_unique<Impl>()) {}
MemoryStore::~MemoryStore() = default;

void MemoryStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->data[key] = value;
  }
  impl_->changed.notify_all();
}

Bytes MemoryStore::get(const std::string& key, Millis timeout) {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->wait_locked(lock, {key}, timeout, "store.get");
  return impl_->data.at(key);
}

std::int64_t MemoryStore::add(const std::string& key, std::int64_t delta) {
  std::int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    auto it = impl_->data.find(key);
    if (it != impl_->data.end()) {
      const std::string text = to_string(it->second);
      try {
        std::size_t used = 0;
        value = std::stoll(text, &used);
        if (used != text.size()) throw std::invalid_argument("trailing characters");
      } catch (const std::exception&) {
        throw UsageError("memory store: add on key '" + key +
                             "' whose value is not a decimal counter: '" + text + "'",
                         ErrorContext{"store.add", -1, -1, "use a separate key for counters"});
      }
    }
    value += delta;
    impl_->data[key] = to_bytes(std::to_string(value));
  }
  impl_->changed.notify_all();
  return value;
}

bool MemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->has_all(keys);
}

void MemoryStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::unique_lock<std::mutex> lock(impl_->mutex);
  impl_->wait_locked(lock, keys, timeout, "store.wait");
}

Bytes MemoryStore::compare_set(const std::string& key, const Bytes& expected,
                               const Bytes& desired) {
  Bytes current;
  bool changed = false;
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    auto it = impl_->data.find(key);
    if (it == impl_->data.end()) {
      // c10d: a missing key is created only when the caller expected it to
      // be absent (empty expected); otherwise the caller's expectation is
      // echoed back, which tells it the swap did not happen.
      if (expected.empty()) {
        impl_->data.emplace(key, desired);
        current = desired;
        changed = true;
      } else {
        current = expected;
      }
    } else {
      if (it->second == expected) {
        it->second = desired;
        changed = true;
      }
      current = it->second;
    }
  }
  if (changed) impl_->changed.notify_all();
  return current;
}

bool MemoryStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->data.erase(key) > 0;
}

std::int64_t MemoryStore::num_keys() {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return static_cast<std::int64_t>(impl_->data.size());
}

}  // namespace ddpdiag
