#include "ulysses/ipc/eventfd.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>

#include "bell_wait.h"
#include "errno_status.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {

absl::StatusOr<EventFd> EventFd::Create() {
  UniqueFd fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!fd.valid()) return ErrnoError("eventfd()", errno);
  return EventFd(std::move(fd));
}

absl::StatusOr<EventFd> EventFd::Adopt(UniqueFd fd) {
  if (!fd.valid()) return absl::InvalidArgumentError("fd: no descriptor to adopt");
  // An eventfd is an anonymous inode; its /proc link reads "anon_inode:[eventfd]".
  const std::string link = ulysses::StrCat("/proc/self/fd/", fd.get());
  char target[64] = {};
  const ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
  if (n < 0) return LastError("readlink(", link, ")");
  if (std::string_view(target, static_cast<size_t>(n)) != "anon_inode:[eventfd]") {
    return absl::InvalidArgumentError(
        ulysses::StrCat("fd: ", fd.get(), " is not an eventfd (",
                        std::string_view(target, static_cast<size_t>(n)), ")"));
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  if (flags < 0) return LastError("fcntl(fd ", fd.get(), ", F_GETFL)");
  if ((flags & O_NONBLOCK) == 0 && ::fcntl(fd.get(), F_SETFL, flags | O_NONBLOCK) != 0) {
    return LastError("fcntl(fd ", fd.get(), ", F_SETFL, O_NONBLOCK)");
  }
  return EventFd(std::move(fd));
}

absl::Status EventFd::Signal() {
  const uint64_t one = 1;
  for (;;) {
    if (::write(fd_.get(), &one, sizeof(one)) == sizeof(one)) return absl::OkStatus();
    if (errno == EINTR) continue;
    // EAGAIN: the counter is at its maximum, i.e. already rung many times over.
    if (errno == EAGAIN) return absl::OkStatus();
    return LastError("write(eventfd ", fd_.get(), ")");
  }
}

absl::StatusOr<bool> EventFd::Wait(int timeout_ms) {
  return bell_internal::WaitThenConsume(fd_.get(), timeout_ms, [&]() -> absl::StatusOr<bool> {
    uint64_t count = 0;
    if (::read(fd_.get(), &count, sizeof(count)) == sizeof(count)) return true;
    const int err = errno;
    // EAGAIN: another waiter consumed the ring between poll and read; wait for the next one.
    if (err == EAGAIN || err == EINTR) return false;
    return ErrnoError(ulysses::StrCat("read(eventfd ", fd_.get(), ")"), err);
  });
}

}  // namespace ulysses::ipc
