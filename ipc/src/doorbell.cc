#include "ulysses/ipc/doorbell.h"

#include <sys/socket.h>
#include <sys/stat.h>

#include <cerrno>

#include "bell_wait.h"
#include "errno_status.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {

absl::StatusOr<std::pair<Doorbell, Doorbell>> Doorbell::Create() {
  int ends[2] = {-1, -1};
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, ends) != 0)
    return ErrnoError("socketpair()", errno);
  UniqueFd ring(ends[0]), wait(ends[1]);
  if (::shutdown(ring.get(), SHUT_RD) != 0) return LastError("shutdown(bell, SHUT_RD)");
  if (::shutdown(wait.get(), SHUT_WR) != 0) return LastError("shutdown(bell, SHUT_WR)");
  return std::make_pair(Doorbell(std::move(ring)), Doorbell(std::move(wait)));
}

absl::StatusOr<Doorbell> Doorbell::Adopt(UniqueFd fd) {
  if (!fd.valid()) return absl::InvalidArgumentError("fd: no descriptor to adopt");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return LastError("fstat(fd ", fd.get(), ")");
  int domain = 0, type = 0;
  socklen_t len = sizeof domain;
  const bool unix_stream =
      S_ISSOCK(st.st_mode) &&
      ::getsockopt(fd.get(), SOL_SOCKET, SO_DOMAIN, &domain, &len) == 0 && domain == AF_UNIX &&
      (len = sizeof type, ::getsockopt(fd.get(), SOL_SOCKET, SO_TYPE, &type, &len) == 0) &&
      type == SOCK_STREAM;
  if (!unix_stream) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("fd: ", fd.get(), " is not a doorbell (an AF_UNIX stream socket)"));
  }
  return Doorbell(std::move(fd));
}

absl::Status Doorbell::Signal() {
  const char one = 1;
  for (;;) {
    if (::send(fd_.get(), &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL) == 1) return absl::OkStatus();
    if (errno == EINTR) continue;
    // EAGAIN: the buffer is full, i.e. rung many times over and not yet consumed.
    if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::OkStatus();
    if (errno == EPIPE || errno == ECONNRESET) {
      return absl::FailedPreconditionError(
          ulysses::StrCat("doorbell ", fd_.get(), ": its waiting end is closed"));
    }
    return LastError("send(doorbell ", fd_.get(), ")");
  }
}

absl::StatusOr<bool> Doorbell::Wait(int timeout_ms) {
  return bell_internal::WaitThenConsume(fd_.get(), timeout_ms, [&]() -> absl::StatusOr<bool> {
    char rings[256];
    const ssize_t n = ::recv(fd_.get(), rings, sizeof rings, MSG_DONTWAIT);
    if (n > 0) {
      // The rest of what is pending; a ring sent meanwhile is consumed too, which the caller's
      // look at its ring after the wait covers.
      if (n == static_cast<ssize_t>(sizeof rings)) {
        while (::recv(fd_.get(), rings, sizeof rings, MSG_DONTWAIT) ==
               static_cast<ssize_t>(sizeof rings)) {
        }
      }
      return true;
    }
    const int err = n == 0 ? 0 : errno;
    if (n == 0 || err == ECONNRESET) {
      return absl::UnavailableError(
          ulysses::StrCat("doorbell ", fd_.get(), ": its ringing end is closed"));
    }
    // EAGAIN: another waiter consumed the rings between poll and recv; wait for the next one.
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR) return false;
    return ErrnoError(ulysses::StrCat("recv(doorbell ", fd_.get(), ")"), err);
  });
}

}  // namespace ulysses::ipc
