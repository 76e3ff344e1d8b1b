// Private helper: a status from errno for a failed system call.
#pragma once

#include <cerrno>

#include "absl/status/status.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {

/// ErrnoError for the current errno, with `what` (the call and its path/fd) concatenated.
/// errno is read before the message is built: building it allocates, which may change errno.
template <typename... Args>
absl::Status LastError(const Args&... what) {
  const int err = errno;
  return ErrnoError(ulysses::StrCat(what...), err);
}

}  // namespace ulysses::ipc
