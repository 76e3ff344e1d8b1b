// The daemon's own descriptors and mappings, which every client's state uses: a client that
// makes the daemon hold what its clients may (limits.*) can still, with sessions of many
// ranks, come near the process's bounds (RLIMIT_NOFILE, vm.max_map_count). Past them the
// daemon could no longer accept a connection, make a segment or start a thread, for anyone.
// So what adds to them for long (Attach, CreateSession) is refused while less than a
// headroom of either is left, and the headroom stays for what the daemon serves meanwhile.
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ulysses::daemon {

/// What the process holds of its two bounds.
struct ProcessUse {
  int64_t descriptors = 0;      ///< open descriptors (/proc/self/fd)
  int64_t descriptor_limit = 0; ///< RLIMIT_NOFILE, soft
  int64_t mappings = 0;         ///< memory mappings (/proc/self/maps)
  int64_t mapping_limit = 0;    ///< vm.max_map_count
};

/// Reads them. INTERNAL naming what could not be read.
absl::StatusOr<ProcessUse> ReadProcessUse();

/// What is kept free of a bound `limit`: an eighth of it, at least 64.
int64_t Headroom(int64_t limit);

/// OK while both have more than their headroom left; else RESOURCE_EXHAUSTED naming the
/// bound and `what` was refused ("CreateSession: the daemon holds 230 of its 256 descriptors
/// (RLIMIT_NOFILE); the last 64 are kept for the work it serves").
absl::Status CheckHeadroom(const ProcessUse& use, std::string_view what);

/// Raises the soft RLIMIT_NOFILE to the hard one. Returns the soft limit before and after.
absl::StatusOr<std::pair<int64_t, int64_t>> RaiseDescriptorLimit();

}  // namespace ulysses::daemon
