// A doorbell between two processes on a connected socket pair: one end rings, the other waits.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc {

/// One end of a one-way doorbell on an AF_UNIX stream socket pair. The ringing end's Signal()
/// sends a byte; the waiting end's Wait() consumes every ring made so far (rings coalesce) or
/// times out.
///
/// Why not an eventfd: an eventfd passed to another process is one open file shared with it,
/// so that process can clear O_NONBLOCK and fill the counter, and the next write(2) of the first
/// process then blocks for ever. Here each end is an open file of its own, and every send and
/// receive is non-blocking by its own flags (MSG_DONTWAIT), whatever either process set on its
/// descriptor; a send never raises SIGPIPE (MSG_NOSIGNAL). A full buffer is a bell already
/// rung, and an end whose other side closed is an error, never a wait. Each end is shut down in
/// the direction it does not use, so a waiting end cannot ring back.
///
/// Move-only. Signal() and Wait() are thread-safe.
class Doorbell {
 public:
  /// Empty (fd() == -1).
  Doorbell() noexcept = default;
  Doorbell(const Doorbell&) = delete;
  Doorbell& operator=(const Doorbell&) = delete;
  Doorbell(Doorbell&&) noexcept = default;
  Doorbell& operator=(Doorbell&&) noexcept = default;

  /// A fresh bell: its ringing end (first) and its waiting end (second), close-on-exec.
  static absl::StatusOr<std::pair<Doorbell, Doorbell>> Create();
  /// Takes ownership of `fd`, an end of a bell received from another process.
  /// INVALID_ARGUMENT naming `fd` when it is not an AF_UNIX stream socket.
  static absl::StatusOr<Doorbell> Adopt(UniqueFd fd);

  /// Rings (a ringing end). A full buffer counts as rung. FAILED_PRECONDITION once the waiting
  /// end is closed; other errors: the errno of send(2).
  absl::Status Signal();
  /// Waits up to `timeout_ms` milliseconds (negative: forever; 0: just check) for a ring and
  /// consumes all pending rings (a waiting end). True when rung, false on timeout; UNAVAILABLE
  /// once the ringing end is closed and no ring is left.
  absl::StatusOr<bool> Wait(int timeout_ms);

  /// The descriptor (owned; -1 when empty).
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }

 private:
  explicit Doorbell(UniqueFd fd) noexcept : fd_(std::move(fd)) {}
  UniqueFd fd_;
};

}  // namespace ulysses::ipc
