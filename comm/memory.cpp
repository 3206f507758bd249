#include "comm/memory.h"

#include <sys/resource.h>

#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>

#include "ddpdiag/config.h"

#if DDPDIAG_HAVE_CUDA
#include "comm/nccl/nccl_memory.h"
#endif

namespace ddpdiag {

std::string_view memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::kParameters: return "parameters";
    case MemoryCategory::kGradients: return "gradients";
    case MemoryCategory::kBuckets: return "buckets";
    case MemoryCategory::kCommBuffers: return "communication_buffers";
    case MemoryCategory::kWorkspace: return "workspace";
  }
  return "unknown";
}

MemoryAccount::~MemoryAccount() {
  // Whatever is still live goes back to the communicator.
  for (auto& [ptr, what] : live_) comm_.free(ptr);
}

void* MemoryAccount::allocate(MemoryCategory c, std::size_t bytes) {
  void* p = comm_.alloc(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  live_[p] = {c, bytes};
  const auto i = static_cast<std::size_t>(c);
  current_[i] += bytes;
  if (current_[i] > peak_[i]) peak_[i] = current_[i];
  total_current_ += bytes;
  if (total_current_ > total_peak_) total_peak_ = total_current_;
  return p;
}

void MemoryAccount::release(void* ptr) {
  if (!ptr) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.find(ptr);
    DDPDIAG_ASSERT(it != live_.end());
    const auto i = static_cast<std::size_t>(it->second.first);
    current_[i] -= it->second.second;
    total_current_ -= it->second.second;
    live_.erase(it);
  }
  comm_.free(ptr);
}

std::uint64_t MemoryAccount::current_bytes(MemoryCategory c) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_[static_cast<std::size_t>(c)];
}
std::uint64_t MemoryAccount::peak_bytes(MemoryCategory c) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_[static_cast<std::size_t>(c)];
}
void MemoryAccount::reset_peak(MemoryCategory c) {
  std::lock_guard<std::mutex> lock(mutex_);
  peak_[static_cast<std::size_t>(c)] = current_[static_cast<std::size_t>(c)];
}
std::uint64_t MemoryAccount::total_current_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return total_current_;
}
std::uint64_t MemoryAccount::total_peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return total_peak_;
}

std::optional<ProcessMemory> parse_proc_status(std::string_view text) {
  // Lines such as "VmRSS:\t   12345 kB".
  auto field = [&](std::string_view name) -> std::optional<std::uint64_t> {
    std::size_t pos = 0;
    while (pos < text.size()) {
      std::size_t eol = text.find('\n', pos);
      if (eol == std::string_view::npos) eol = text.size();
      std::string_view line = text.substr(pos, eol - pos);
      pos = eol + 1;
      if (line.size() <= name.size() || line.substr(0, name.size()) != name ||
          line[name.size()] != ':')
        continue;
      std::istringstream in{std::string(line.substr(name.size() + 1))};
      std::uint64_t v = 0;
      std::string unit;
      if (!(in >> v)) return std::nullopt;
      in >> unit;
      return unit == "kB" ? v * 1024 : v;
    }
    return std::nullopt;
  };
  auto rss = field("VmRSS"), hwm = field("VmHWM");
  if (!rss || !hwm) return std::nullopt;
  return ProcessMemory{*rss, *hwm};
}

std::optional<ProcessMemory> read_process_memory() {
  std::ifstream f("/proc/self/status");
  if (!f) return std::nullopt;
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  return parse_proc_status(text);
}

DeviceMemoryInfo device_memory_info(int device) {
#if DDPDIAG_HAVE_CUDA
  return nccl_backend::device_memory_info(device);
#else
  (void)device;
  DeviceMemoryInfo d;
  d.reason = "this build has no CUDA support (configured without CUDA/NCCL)";
  return d;
#endif
}

namespace {

std::optional<std::string> read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::optional<std::uint64_t> read_number(const std::string& path) {
  auto t = read_text(path);
  if (!t) return std::nullopt;
  std::istringstream in(*t);
  std::uint64_t v = 0;
  if (!(in >> v)) return std::nullopt;  // "max" (v2: no limit) too
  return v;
}

// "name value" lines (a cgroup's memory.stat): the value of `name`.
std::optional<std::uint64_t> stat_field(const std::string& path, const std::string& name) {
  auto t = read_text(path);
  if (!t) return std::nullopt;
  std::istringstream in(*t);
  std::string key;
  std::uint64_t v = 0;
  while (in >> key >> v)
    if (key == name) return v;
  return std::nullopt;
}

// A "Name:   1234 kB" line of a /proc file (meminfo, self/status), in
// bytes; nullopt when the file or the line is missing.
std::optional<std::uint64_t> proc_kib_field(const std::string& path, const std::string& name) {
  auto text = read_text(path);
  if (!text) return std::nullopt;
  std::istringstream in(*text);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name, 0) == 0) {
      std::istringstream f(line.substr(name.size()));
      std::uint64_t kib = 0;
      if (f >> kib) return kib * 1024;
    }
  return std::nullopt;
}

}  // namespace

std::optional<HostMemoryAvailable> host_memory_available(const std::string& proc_root,
                                                         const std::string& cgroup_root) {
  std::optional<HostMemoryAvailable> best;
  const auto consider = [&](std::uint64_t bytes, std::string source) {
    if (!best || bytes < best->bytes) best = HostMemoryAvailable{bytes, std::move(source)};
  };
  if (auto bytes = proc_kib_field(proc_root + "/meminfo", "MemAvailable:"))
    consider(*bytes, "MemAvailable");
  // A v1 limit of "none" reads as the largest page-aligned int64.
  constexpr std::uint64_t kNoLimit = std::uint64_t{1} << 60;
  if (auto groups = read_text(proc_root + "/self/cgroup")) {
    std::istringstream in(*groups);
    std::string line;
    while (std::getline(in, line)) {
      // "hierarchy-ID:controllers:path": v2 is "0::/path", v1's memory
      // controller "N:memory:/path" (or a list holding "memory").
      const auto c1 = line.find(':');
      const auto c2 = c1 == std::string::npos ? c1 : line.find(':', c1 + 1);
      if (c2 == std::string::npos) continue;
      const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
      std::string path = line.substr(c2 + 1);
      bool v1 = false;
      if (controllers.empty()) {
        v1 = false;
      } else {
        std::istringstream list(controllers);
        std::string c;
        bool memory = false;
        while (std::getline(list, c, ',')) memory = memory || c == "memory";
        if (!memory) continue;
        v1 = true;
      }
      const std::string base = v1 ? cgroup_root + "/memory" : cgroup_root;
      const std::string limit_file = v1 ? "/memory.limit_in_bytes" : "/memory.max";
      const std::string usage_file = v1 ? "/memory.usage_in_bytes" : "/memory.current";
      // This cgroup and each parent: a parent's limit binds too.
      for (;;) {
        while (path.size() > 1 && path.back() == '/') path.pop_back();
        const std::string dir = base + (path == "/" ? "" : path);
        const auto limit = read_number(dir + limit_file);
        auto usage = read_number(dir + usage_file);
        if (limit && usage && *limit < kNoLimit) {
          // The usage counts the page cache, which the kernel reclaims
          // before it kills: less its inactive file pages, as MemAvailable
          // leaves them out (and as kubelet's working set does).
          if (auto cache = stat_field(dir + "/memory.stat", v1 ? "total_inactive_file" : "inactive_file"))
            *usage -= std::min(*usage, *cache);
          consider(*limit > *usage ? *limit - *usage : 0,
                   "the limit of cgroup " + (path.empty() ? std::string("/") : path));
        }
        if (path.empty() || path == "/") break;
        const auto slash = path.rfind('/');
        path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
      }
    }
  }
  return best;
}

std::optional<AddressSpaceLeft> address_space_left() {
  rlimit rl{};
  if (::getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return std::nullopt;
  const std::uint64_t mapped = proc_kib_field("/proc/self/status", "VmSize:").value_or(0);
  const std::uint64_t limit = rl.rlim_cur;
  return AddressSpaceLeft{limit > mapped ? limit - mapped : 0, limit};
}

}  // namespace ddpdiag
