#include "headroom.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(StrCat(what, ": ", std::strerror(errno)));
}

// Open descriptors; all of `limit` when none is left to list them with, -1 when unknown.
int64_t CountDescriptors(int64_t limit) {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return errno == EMFILE || errno == ENFILE ? limit : -1;
  int64_t n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

int64_t CountMappings() {
  ipc::UniqueFd fd(::open("/proc/self/maps", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return -1;
  char buf[1 << 16];
  int64_t lines = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    lines += std::count(buf, buf + n, '\n');
  }
  return lines;
}

int64_t MaxMapCount() {
  std::ifstream in("/proc/sys/vm/max_map_count");
  int64_t v = 0;
  return in >> v && v > 0 ? v : -1;
}

}  // namespace

ProcessUse ReadProcessUse(bool mappings) {
  ProcessUse u;
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0)
    u.descriptor_limit =
        r.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(r.rlim_cur);
  u.descriptors = CountDescriptors(u.descriptor_limit);
  if (mappings) {
    u.mappings = CountMappings();
    u.mapping_limit = MaxMapCount();
  }
  return u;
}

int64_t Headroom(int64_t limit) { return std::max<int64_t>(64, limit / 8); }

absl::Status CheckHeadroom(const ProcessUse& use, std::string_view what) {
  const struct {
    int64_t used, limit;
    const char* noun;
    const char* bound;
  } bounds[] = {{use.descriptors, use.descriptor_limit, "descriptors", "RLIMIT_NOFILE"},
                {use.mappings, use.mapping_limit, "memory mappings", "vm.max_map_count"}};
  for (const auto& b : bounds) {
    if (b.used < 0 || b.limit < 0) continue;  // not read
    const int64_t kept = Headroom(b.limit);
    if (b.limit - b.used <= kept)
      return absl::ResourceExhaustedError(
          StrCat(what, ": the daemon holds ", b.used, " of its ", b.limit, " ", b.noun, " (",
                 b.bound, "); the last ", kept, " are kept for the work it serves"));
  }
  return absl::OkStatus();
}

ProcessUse HeadroomGuard::Use() {
  const absl::Time now = absl::Now();
  std::lock_guard<std::mutex> lock(mu_);
  return UseLocked(now);
}

ProcessUse HeadroomGuard::UseLocked(absl::Time now) {
  const bool read_mappings = now - mappings_read_ >= absl::Milliseconds(100);
  ProcessUse use = ReadProcessUse(read_mappings);
  if (read_mappings) {
    mappings_ = use.mappings;
    mapping_limit_ = use.mapping_limit;
    mappings_read_ = now;
  } else {
    use.mappings = mappings_;
    use.mapping_limit = mapping_limit_;
  }
  return use;
}

absl::Status HeadroomGuard::Check(std::string_view what) {
  std::lock_guard<std::mutex> lock(mu_);
  absl::Status s = CheckHeadroom(UseLocked(absl::Now()), what);
  if (!s.ok()) refusals_.fetch_add(1, std::memory_order_relaxed);
  if (!s.ok() && !refusing_)
    Logger("main")->warn("{}; refusing new clients and sessions until more is free (logged once)",
                         std::string(s.message()));
  else if (s.ok() && refusing_)
    Logger("main")->info("descriptors and mappings free again: new clients and sessions served");
  refusing_ = !s.ok();
  return s;
}

absl::StatusOr<std::pair<int64_t, int64_t>> RaiseDescriptorLimit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return Errno("getrlimit(RLIMIT_NOFILE)");
  const auto before = static_cast<int64_t>(r.rlim_cur);
  if (r.rlim_cur == r.rlim_max) return std::make_pair(before, before);
  r.rlim_cur = r.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &r) != 0) return Errno("setrlimit(RLIMIT_NOFILE)");
  return std::make_pair(before, static_cast<int64_t>(r.rlim_cur));
}

}  // namespace ulysses::daemon
