// eventfd(2) doorbell.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc {

/// A doorbell on an eventfd: Signal() rings it, Wait() consumes every ring made so far (rings
/// coalesce) or times out. The descriptor is non-blocking and close-on-exec; it can be passed to
/// another process with SendMessage and wrapped there with Adopt(), or polled with epoll.
///
/// Move-only. Signal() and Wait() are thread-safe; with several waiters one ring wakes at least
/// one of them and is consumed by exactly one.
class EventFd {
 public:
  /// Empty (fd() == -1); use Create() or Adopt().
  EventFd() noexcept = default;

  EventFd(const EventFd&) = delete;
  EventFd& operator=(const EventFd&) = delete;
  /// Transfers the descriptor; `other` is left empty.
  EventFd(EventFd&&) noexcept = default;
  /// Closes the current descriptor, then takes `other`'s.
  EventFd& operator=(EventFd&&) noexcept = default;

  /// Creates a fresh eventfd with a zero counter (EFD_CLOEXEC | EFD_NONBLOCK).
  static absl::StatusOr<EventFd> Create();
  /// Takes ownership of `fd`, which must be an eventfd (e.g. received over a unix socket);
  /// sets O_NONBLOCK on it (a flag shared with every holder of the same open file).
  /// INVALID_ARGUMENT naming `fd` when it is not an eventfd.
  static absl::StatusOr<EventFd> Adopt(UniqueFd fd);

  /// Rings the doorbell (adds 1 to the counter). A counter already at its maximum counts as
  /// rung. Errors: the errno of write(2).
  absl::Status Signal();
  /// Waits up to `timeout_ms` milliseconds (negative: forever; 0: just check) for a ring and
  /// consumes all pending rings. True when rung, false on timeout.
  absl::StatusOr<bool> Wait(int timeout_ms);

  /// The eventfd (owned; -1 when empty).
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }

 private:
  explicit EventFd(UniqueFd fd) noexcept : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

}  // namespace ulysses::ipc
