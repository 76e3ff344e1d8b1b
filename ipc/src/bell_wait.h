// The wait loop both doorbells share (EventFd, Doorbell): private to ulysses::ipc.
#pragma once

#include <chrono>

#include "absl/status/statusor.h"
#include "ulysses/common/status.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc::bell_internal {

/// Waits up to `timeout_ms` (negative: forever; 0: just check) for `fd` to be readable, then
/// calls `consume()`: true once it consumed the rings, false when another waiter took them
/// between the poll and the read (wait again, against the original deadline), or an error.
/// True when rung, false on timeout.
template <typename Consume>
absl::StatusOr<bool> WaitThenConsume(int fd, int timeout_ms, Consume consume) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  int wait_ms = timeout_ms;
  for (;;) {
    ULY_ASSIGN_OR_RETURN(const bool readable, WaitReadable(fd, wait_ms));
    if (!readable) return false;
    ULY_ASSIGN_OR_RETURN(const bool rung, consume());
    if (rung) return true;
    if (timeout_ms >= 0) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) return false;
      wait_ms = static_cast<int>(left);
    }
  }
}

}  // namespace ulysses::ipc::bell_internal
