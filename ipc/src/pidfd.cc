#include "ulysses/ipc/pidfd.h"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434  // same number on every architecture
#endif

namespace ulysses::ipc {

absl::StatusOr<UniqueFd> PidfdOpen(pid_t pid) {
  if (pid <= 0) {
    return absl::InvalidArgumentError(ulysses::StrCat("pid: ", pid, " is not a process id"));
  }
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOSYS) {
      return absl::UnimplementedError(
          ulysses::StrCat("pidfd_open(", pid, "): not supported by this kernel (needs Linux 5.3)"));
    }
    if (err == ESRCH) {
      return absl::NotFoundError(ulysses::StrCat("pidfd_open(", pid, "): no such process"));
    }
    return ErrnoError(ulysses::StrCat("pidfd_open(", pid, ")"), err);
  }
  return UniqueFd(static_cast<int>(fd));
}

bool ProcessAlive(pid_t pid) {
  if (pid <= 0) return false;
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

}  // namespace ulysses::ipc
