// Whether the other end of a stream socket closes it, for the tests of refused connections.
#pragma once

#include <poll.h>
#include <unistd.h>

#include <cerrno>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ulysses {

/// Whether the peer closes `fd` within `wait` (a refused connection: closed before anything
/// is sent); what an admitted one receives (gRPC's settings) is read past.
inline bool ClosedByPeer(int fd, absl::Duration wait) {
  const absl::Time until = absl::Now() + wait;
  char buf[256];
  for (;;) {
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(until - absl::Now()));
    pollfd p{fd, POLLIN, 0};
    if (ms <= 0 || ::poll(&p, 1, ms) != 1) return false;
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return true;
  }
}

}  // namespace ulysses
