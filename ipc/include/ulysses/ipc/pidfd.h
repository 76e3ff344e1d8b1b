// Process liveness: pidfds and pid probes.
#pragma once

#include <sys/types.h>

#include "absl/status/statusor.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc {

/// Opens a pidfd for process `pid` (pidfd_open(2), close-on-exec). The descriptor becomes
/// readable (poll POLLIN, see WaitReadable) when the process exits, and keeps referring to that
/// process even if its pid is reused. Errors: INVALID_ARGUMENT naming `pid` when it is <= 0;
/// NOT_FOUND when no such process exists; UNIMPLEMENTED when the kernel lacks pidfd_open
/// (Linux < 5.3); the errno otherwise. Thread-safe.
absl::StatusOr<UniqueFd> PidfdOpen(pid_t pid);

/// Whether a process with id `pid` exists (kill(pid, 0); a process we may not signal counts as
/// alive, and so does an unreaped zombie). Racy by nature (pids are reused); prefer PidfdOpen for
/// watching a particular process. False for pid <= 0. Thread-safe.
bool ProcessAlive(pid_t pid);

}  // namespace ulysses::ipc
