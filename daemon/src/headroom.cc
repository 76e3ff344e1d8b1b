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

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::daemon {
namespace {

absl::Status Errno(std::string_view what) {
  return absl::InternalError(StrCat(what, ": ", std::strerror(errno)));
}

absl::StatusOr<int64_t> CountDescriptors() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return Errno("/proc/self/fd");
  int64_t n = 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

absl::StatusOr<int64_t> CountMappings() {
  ipc::UniqueFd fd(::open("/proc/self/maps", O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return Errno("/proc/self/maps");
  char buf[1 << 16];
  int64_t lines = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno("/proc/self/maps");
    if (n == 0) break;
    lines += std::count(buf, buf + n, '\n');
  }
  return lines;
}

absl::StatusOr<int64_t> MaxMapCount() {
  std::ifstream in("/proc/sys/vm/max_map_count");
  int64_t v = 0;
  if (!(in >> v) || v <= 0) return absl::InternalError("/proc/sys/vm/max_map_count: unreadable");
  return v;
}

}  // namespace

absl::StatusOr<ProcessUse> ReadProcessUse() {
  ProcessUse u;
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return Errno("getrlimit(RLIMIT_NOFILE)");
  u.descriptor_limit = r.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(r.rlim_cur);
  ULY_ASSIGN_OR_RETURN(u.descriptors, CountDescriptors());
  ULY_ASSIGN_OR_RETURN(u.mappings, CountMappings());
  ULY_ASSIGN_OR_RETURN(u.mapping_limit, MaxMapCount());
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
    const int64_t kept = Headroom(b.limit);
    if (b.limit - b.used <= kept)
      return absl::ResourceExhaustedError(
          StrCat(what, ": the daemon holds ", b.used, " of its ", b.limit, " ", b.noun, " (",
                 b.bound, "); the last ", kept, " are kept for the work it serves"));
  }
  return absl::OkStatus();
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
