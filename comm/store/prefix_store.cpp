// PrefixStore: a namespace inside another store. Keys become
// "<prefix>/<key>"; a PrefixStore over a PrefixStore therefore stores
// "<outer>/<inner>/<key>", as c10d's and Gloo's PrefixStore do, so torch
// clients using the same prefixes see the same keys.
#include <stdexcept>

#include "comm/store/store.h"

namespace ddpdiag {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : prefix_(std::move(prefix)), base_(std::move(base)) {
  if (!base_) throw std::invalid_argument("PrefixStore needs a base store");
}

std::string PrefixStore::join(const std::string& key) const { return prefix_ + "/" + key; }

void PrefixStore::set(const std::string& key, const Bytes& value) { base_->set(join(key), value); }

Bytes PrefixStore::get(const std::string& key, Millis timeout) { return base_->get(join(key), timeout); }

std::int64_t PrefixStore::add(const std::string& key, std::int64_t delta) {
  return base_->add(join(key), delta);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> joined;
  joined.reserve(keys.size());
  for (const auto& k : keys) joined.push_back(join(k));
  return base_->check(joined);
}

// The base store's TimeoutError names the keys with the prefix, which is
// what a user sees with torch too and what they need to find them.
void PrefixStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> joined;
  joined.reserve(keys.size());
  for (const auto& k : keys) joined.push_back(join(k));
  base_->wait(joined, timeout);
}

Bytes PrefixStore::compare_set(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return base_->compare_set(join(key), expected, desired);
}

bool PrefixStore::delete_key(const std::string& key) { return base_->delete_key(join(key)); }

std::int64_t PrefixStore::num_keys() { return base_->num_keys(); }

}  // namespace ddpdiag
