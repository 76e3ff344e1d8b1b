#include "ulysses/ipc/fd.h"

#include <unistd.h>

namespace ulysses::ipc {

UniqueFd::~UniqueFd() { reset(); }

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() noexcept {
  int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) noexcept {
  if (fd < 0) fd = -1;
  if (fd == fd_) return;
  // No retry on EINTR: Linux releases the descriptor even then, and retrying could close a
  // descriptor another thread just received.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

}  // namespace ulysses::ipc
