// The daemon's own descriptors and mappings, which every client's state uses: a client that
// makes the daemon hold what its clients may (limits.*) can still, with sessions of many
// ranks, come near the process's bounds (RLIMIT_NOFILE, vm.max_map_count). Past them the
// daemon could no longer accept a connection, make a segment or start a thread, for anyone.
// So what adds to them for long (Attach, CreateSession) is refused while less than a
// headroom of either is left, and the headroom stays for what the daemon serves meanwhile.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ulysses::daemon {

/// What the process holds of its two bounds; -1 where it could not be read (that bound is
/// then not checked).
struct ProcessUse {
  int64_t descriptors = -1;      ///< open descriptors (/proc/self/fd)
  int64_t descriptor_limit = -1; ///< RLIMIT_NOFILE, soft
  int64_t mappings = -1;         ///< memory mappings (/proc/self/maps)
  int64_t mapping_limit = -1;    ///< vm.max_map_count
};

/// Reads the descriptors and their limit; the mappings and theirs too when `mappings`.
/// Descriptors that cannot be listed for want of a descriptor (EMFILE, ENFILE) count as all
/// used.
ProcessUse ReadProcessUse(bool mappings = true);

/// What is kept free of a bound `limit`: an eighth of it, at least 64.
int64_t Headroom(int64_t limit);

/// OK while both bounds that were read have more than their headroom left; else
/// RESOURCE_EXHAUSTED naming the bound and `what` was refused ("CreateSession: the daemon
/// holds 230 of its 256 descriptors (RLIMIT_NOFILE); the last 64 are kept for the work it
/// serves").
absl::Status CheckHeadroom(const ProcessUse& use, std::string_view what);

/// The check as the daemon makes it, before each Attach and CreateSession: descriptors are
/// counted every time, the mappings (a longer read) at most every 100 ms. Logs once when
/// refusals start and once when they end. Thread-safe.
class HeadroomGuard {
 public:
  absl::Status Check(std::string_view what);
  /// What Check reads: the descriptors now, the mappings as read at most 100 ms ago (for the
  /// metrics, which anyone who reaches the Admin socket may ask for).
  ProcessUse Use();
  uint64_t refusals() const { return refusals_.load(std::memory_order_relaxed); }

 private:
  ProcessUse UseLocked(absl::Time now);

  std::mutex mu_;
  absl::Time mappings_read_ = absl::InfinitePast();
  int64_t mappings_ = -1, mapping_limit_ = -1;
  bool refusing_ = false;
  std::atomic<uint64_t> refusals_{0};
};

/// Raises the soft RLIMIT_NOFILE to the hard one. Returns the soft limit before and after.
absl::StatusOr<std::pair<int64_t, int64_t>> RaiseDescriptorLimit();

}  // namespace ulysses::daemon
