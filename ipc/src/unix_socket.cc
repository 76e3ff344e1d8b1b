#include "ulysses/ipc/unix_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <limits>

#include "errno_status.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::ipc {
namespace {

// The kernel caps the backlog at net.core.somaxconn; ask for plenty so a burst of clients
// attaching at once is never refused.
constexpr int kListenBacklog = 4096;
constexpr size_t kFrameHeaderBytes = sizeof(uint32_t);

absl::StatusOr<sockaddr_un> MakeAddress(std::string_view path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path) ||
      path.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(ulysses::StrCat("path: unix socket path '", path,
                                                      "' must be 1..", sizeof(addr.sun_path) - 1,
                                                      " bytes without NUL"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  return addr;
}

std::string ParentDirectory(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// poll(2) for `events` on `fd` for up to `timeout_ms` (negative: forever), restarting after
// EINTR with the time that is left. Returns the revents, or 0 on timeout.
absl::StatusOr<short> PollFd(int fd, short events, int timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  int wait_ms = timeout_ms;
  for (;;) {
    pollfd pfd{fd, events, 0};
    const int n = ::poll(&pfd, 1, wait_ms);
    if (n > 0) {
      if (pfd.revents & POLLNVAL) {
        return absl::InvalidArgumentError(
            ulysses::StrCat("fd: ", fd, " is not an open descriptor"));
      }
      return pfd.revents;
    }
    if (n == 0) return static_cast<short>(0);
    if (errno != EINTR) return LastError("poll(fd ", fd, ")");
    if (timeout_ms >= 0) {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
      wait_ms = left > 0 ? static_cast<int>(left) : 0;
    }
  }
}

// Moves every descriptor carried by `msg`'s control data into `fds`.
void CollectFds(const msghdr& msg, std::vector<UniqueFd>& fds) {
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr;
       c = CMSG_NXTHDR(const_cast<msghdr*>(&msg), c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    const unsigned char* data = CMSG_DATA(c);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, data + i * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
}

// Control buffer big enough for kMaxFdsPerMessage descriptors, aligned for cmsghdr.
union ControlBuffer {
  cmsghdr align;
  char bytes[CMSG_SPACE(kMaxFdsPerMessage * sizeof(int))];
};

}  // namespace

UnixListener::~UnixListener() { CloseAndUnlink(); }

UnixListener::UnixListener(UnixListener&& other) noexcept
    : fd_(std::move(other.fd_)),
      path_(std::move(other.path_)),
      dev_(std::exchange(other.dev_, 0)),
      ino_(std::exchange(other.ino_, 0)),
      shut_down_(other.shut_down_.exchange(false)) {
  other.path_.clear();
}

UnixListener& UnixListener::operator=(UnixListener&& other) noexcept {
  if (this != &other) {
    CloseAndUnlink();
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
    other.path_.clear();
    dev_ = std::exchange(other.dev_, 0);
    ino_ = std::exchange(other.ino_, 0);
    shut_down_.store(other.shut_down_.exchange(false));
  }
  return *this;
}

void UnixListener::CloseAndUnlink() noexcept {
  if (fd_.valid() && !path_.empty()) {
    // Only remove the path while it still names our socket: a successor may have replaced it.
    struct stat st {};
    if (::lstat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) {
      ::unlink(path_.c_str());
    }
  }
  fd_.reset();
  path_.clear();
}

absl::Status ClaimSocketPath(const std::string& path) {
  ULY_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));

  const std::string parent = ParentDirectory(path);
  struct stat st {};
  if (::stat(parent.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT || err == ENOTDIR) {
      return absl::NotFoundError(
          ulysses::StrCat("socket ", path, ": parent directory ", parent, " does not exist"));
    }
    return ErrnoError(ulysses::StrCat("stat(", parent, ") for socket ", path), err);
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::NotFoundError(
        ulysses::StrCat("socket ", path, ": parent ", parent, " is not a directory"));
  }

  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          ulysses::StrCat("socket ", path, ": path exists and is not a socket; not removing it"));
    }
    // Probe with a non-blocking connect: a live listener with a full backlog answers EAGAIN
    // instead of blocking us.
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!probe.valid()) return LastError("socket() to probe ", path);
    int rc;
    do {
      rc = ::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
    } while (rc != 0 && errno == EINTR);
    if (rc == 0 || errno == EAGAIN || errno == EINPROGRESS) {
      return absl::AlreadyExistsError(ulysses::StrCat("socket ", path, " is in use"));
    }
    if (errno != ECONNREFUSED) {
      return LastError("connect(", path, ") probing an existing socket");
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return LastError("unlink(", path, ") of a stale socket");
    }
    Logger("ipc")->info("removed stale socket {} (nobody was listening on it)", path);
  } else if (errno != ENOENT) {
    return LastError("lstat(", path, ")");
  }
  return absl::OkStatus();
}

absl::StatusOr<UnixListener> UnixListener::Listen(std::string path, mode_t mode) {
  ULY_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));
  ULY_RETURN_IF_ERROR(ClaimSocketPath(path));
  struct stat st {};

  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return LastError("socket() for ", path);
  // Linux creates the file with the socket's own mode less the umask: set to `mode` first, the
  // file is never seen with looser permissions, whatever the umask (the chmod below makes it
  // exactly `mode`).
  if (::fchmod(fd.get(), mode) != 0) return LastError("fchmod() of the socket for ", path);
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno == EADDRINUSE) {
      return absl::AlreadyExistsError(
          ulysses::StrCat("bind(", path, "): socket ", path, " is in use"));
    }
    return LastError("bind(", path, ")");
  }
  if (::lstat(path.c_str(), &st) != 0) {
    const int err = errno;
    ::unlink(path.c_str());
    return ErrnoError(ulysses::StrCat("lstat(", path, ") after bind"), err);
  }
  // From here on the listener's destructor removes the path again on failure.
  UnixListener listener(std::move(fd), std::move(path), st.st_dev, st.st_ino);
  // chmod before listen: until listen() every connect is refused, so no client ever connects
  // through the umask-derived permissions bind() created the file with.
  if (::chmod(listener.path_.c_str(), mode) != 0) {
    const int err = errno;
    char octal[16];
    std::snprintf(octal, sizeof(octal), "0%o", static_cast<unsigned>(mode));
    return ErrnoError(ulysses::StrCat("chmod(", listener.path_, ", ", octal, ")"), err);
  }
  if (::listen(listener.fd(), kListenBacklog) != 0) {
    return LastError("listen(", listener.path_, ")");
  }
  return listener;
}

absl::StatusOr<UniqueFd> UnixListener::Accept() {
  for (;;) {
    ULY_ASSIGN_OR_RETURN(UniqueFd conn, TryAccept());
    if (conn.valid()) {
      // Accept() hands out blocking sockets; only TryAccept's callers poll.
      const int flags = ::fcntl(conn.get(), F_GETFL);
      if (flags < 0 || ::fcntl(conn.get(), F_SETFL, flags & ~O_NONBLOCK) != 0)
        return LastError("fcntl(accepted socket of ", path_, ", ~O_NONBLOCK)");
      return conn;
    }
    // shutdown(2) wakes this poll (the listener reads as hung up); TryAccept then cancels.
    ULY_ASSIGN_OR_RETURN(short revents, PollFd(fd_.get(), POLLIN, -1));
    (void)revents;
  }
}

absl::StatusOr<UniqueFd> UnixListener::TryAccept() {
  for (;;) {
    if (shut_down_.load(std::memory_order_acquire)) {
      return absl::CancelledError(ulysses::StrCat("accept(", path_, "): listener shut down"));
    }
    UniqueFd conn(::accept4(fd_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (conn.valid()) return conn;
    const int err = errno;
    if (err == EINTR || err == ECONNABORTED) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return UniqueFd();
    // shutdown(2) makes accept fail (EINVAL on Linux); report that as cancellation.
    if (shut_down_.load(std::memory_order_acquire)) {
      return absl::CancelledError(ulysses::StrCat("accept(", path_, "): listener shut down"));
    }
    return ErrnoError(ulysses::StrCat("accept4(", path_, ")"), err);
  }
}

void UnixListener::Shutdown() noexcept {
  shut_down_.store(true, std::memory_order_release);
  if (fd_.valid()) ::shutdown(fd_.get(), SHUT_RDWR);
}

absl::StatusOr<UniqueFd> ConnectUnix(std::string_view path, absl::Duration timeout) {
  ULY_ASSIGN_OR_RETURN(const sockaddr_un addr, MakeAddress(path));
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return LastError("socket() for ", path);
  // A unix socket's connect waits for room in a full backlog as long as its send timeout.
  const bool bounded = timeout != absl::InfiniteDuration();
  auto send_timeout = [&](absl::Duration d) {
    const timeval tv = absl::ToTimeval(std::max(d, absl::Microseconds(1)));
    return ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) == 0;
  };
  if (bounded && !send_timeout(timeout)) return LastError("setsockopt(SO_SNDTIMEO) for ", path);
  for (;;) {
    if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) break;
    if (errno == EINTR) continue;
    if (errno == EISCONN) break;  // an interrupted attempt completed meanwhile
    if (bounded && (errno == EAGAIN || errno == EINPROGRESS))
      return absl::DeadlineExceededError(ulysses::StrCat(
          "connect(", path, "): its backlog stayed full for ", absl::FormatDuration(timeout)));
    return LastError("connect(", path, ")");
  }
  if (bounded) {
    const timeval none{};
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &none, sizeof none) != 0)
      return LastError("setsockopt(SO_SNDTIMEO) for ", path);
  }
  return fd;
}

absl::StatusOr<PeerCred> GetPeerCred(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return LastError("getsockopt(fd ", fd, ", SO_PEERCRED)");
  }
  return PeerCred{cred.pid, cred.uid, cred.gid};
}

absl::Status SendMessage(int sock, std::string_view payload, std::span<const int> fds,
                         int timeout_ms) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms < 0 ? 0 : timeout_ms);
  if (payload.size() > std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("payload: ", payload.size(), " bytes exceed the 4 GiB frame limit"));
  }
  if (fds.size() > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(ulysses::StrCat("fds: ", fds.size(), " descriptors exceed ",
                                                      kMaxFdsPerMessage, " per message"));
  }
  for (int fd : fds) {
    if (fd < 0) return absl::InvalidArgumentError(ulysses::StrCat("fds: invalid descriptor ", fd));
  }

  const uint32_t length = static_cast<uint32_t>(payload.size());
  char header[kFrameHeaderBytes];
  std::memcpy(header, &length, sizeof(header));

  ControlBuffer control;
  const size_t control_len = fds.empty() ? 0 : CMSG_SPACE(fds.size() * sizeof(int));
  if (!fds.empty()) {
    std::memset(control.bytes, 0, control_len);
    cmsghdr* c = &control.align;
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(c), fds.data(), fds.size() * sizeof(int));
  }

  const size_t total = kFrameHeaderBytes + payload.size();
  size_t sent = 0;
  while (sent < total) {
    iovec iov[2];
    int iov_count = 0;
    if (sent < kFrameHeaderBytes) {
      iov[iov_count++] = {header + sent, kFrameHeaderBytes - sent};
      if (!payload.empty()) {
        iov[iov_count++] = {const_cast<char*>(payload.data()), payload.size()};
      }
    } else {
      const size_t at = sent - kFrameHeaderBytes;
      iov[iov_count++] = {const_cast<char*>(payload.data()) + at, payload.size() - at};
    }
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = iov_count;
    // The descriptors go with the first byte of the frame; once any byte is out, they are too.
    if (sent == 0 && control_len != 0) {
      msg.msg_control = control.bytes;
      msg.msg_controllen = control_len;
    }
    const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) {
      int wait_ms = -1;
      if (timeout_ms >= 0) {
        const auto left =
            std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
        if (left <= 0) {
          return absl::DeadlineExceededError(ulysses::StrCat(
              "sendmsg(socket fd ", sock, "): the peer took nothing for ", timeout_ms, " ms (",
              sent, " of ", total, " bytes sent)"));
        }
        wait_ms = static_cast<int>(left);
      }
      ULY_ASSIGN_OR_RETURN(short revents, PollFd(sock, POLLOUT, wait_ms));
      (void)revents;  // errors and hang-ups surface from the next sendmsg
      continue;
    }
    return ErrnoError(ulysses::StrCat("sendmsg(socket fd ", sock, ", frame of ", total, " bytes, ",
                                      sent, " sent)"),
                      err);
  }
  return absl::OkStatus();
}

FrameReader::FrameReader(size_t max_payload, size_t max_fds)
    : max_payload_(max_payload), max_fds_(std::min(max_fds, kMaxFdsPerMessage)) {}

void FrameReader::Reset() {
  length_ = 0;
  got_ = 0;
  fds_truncated_ = false;
  frame_ = ReceivedMessage();
}

ReceivedMessage FrameReader::Take() {
  ReceivedMessage out = std::move(frame_);
  Reset();
  return out;
}

absl::StatusOr<bool> FrameReader::Read(int sock) {
  auto oversized = [&] {
    return absl::ResourceExhaustedError(ulysses::StrCat(
        "recvmsg(socket fd ", sock, "): frame of ", length_, " bytes exceeds max_payload ",
        max_payload_, "; the stream is out of sync"));
  };
  if (out_of_sync_) return oversized();
  ControlBuffer control;
  const size_t control_len = max_fds_ == 0 ? 0 : CMSG_SPACE(max_fds_ * sizeof(int));
  for (;;) {
    // Ask only for what the current frame still lacks, so the next frame (and descriptors
    // riding on its first byte) stays in the socket.
    char* dst;
    size_t want;
    if (got_ < kFrameHeaderBytes) {
      dst = header_ + got_;
      want = kFrameHeaderBytes - got_;
    } else {
      const size_t at = got_ - kFrameHeaderBytes;
      if (at == length_) break;
      dst = frame_.payload.data() + at;
      want = length_ - at;
    }
    iovec iov{dst, want};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    // Always offer control space: a read without it would make the kernel discard (close)
    // descriptors attached to the bytes it returns.
    if (control_len != 0) {
      msg.msg_control = control.bytes;
      msg.msg_controllen = control_len;
    }
    const ssize_t n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n > 0) {
      CollectFds(msg, frame_.fds);
      if ((msg.msg_flags & MSG_CTRUNC) != 0 || frame_.fds.size() > max_fds_) fds_truncated_ = true;
      // A frame past its descriptors is dropped once complete; what it carries is closed as it
      // comes, so that a sender who never completes it holds no more than one read's worth.
      if (fds_truncated_) frame_.fds.clear();
      got_ += static_cast<size_t>(n);
      if (got_ == kFrameHeaderBytes) {
        std::memcpy(&length_, header_, sizeof(length_));
        if (length_ > max_payload_) {
          out_of_sync_ = true;
          frame_.fds.clear();
          return oversized();
        }
        frame_.payload.resize(length_);
      }
      continue;
    }
    if (n == 0) {
      if (got_ == 0) {
        return absl::UnavailableError(ulysses::StrCat("recvmsg(socket fd ", sock, "): peer closed"));
      }
      return absl::UnavailableError(ulysses::StrCat(
          "recvmsg(socket fd ", sock, "): peer closed in the middle of a frame (got ", got_,
          " of ", got_ < kFrameHeaderBytes ? kFrameHeaderBytes : kFrameHeaderBytes + length_,
          " bytes)"));
    }
    const int err = errno;
    if (err == EINTR) continue;
    if (err == EAGAIN || err == EWOULDBLOCK) return false;
    return ErrnoError(ulysses::StrCat("recvmsg(socket fd ", sock, ")"), err);
  }
  if (fds_truncated_) {
    Reset();  // the frame is consumed; its received descriptors close here
    return absl::ResourceExhaustedError(
        ulysses::StrCat("recvmsg(socket fd ", sock, "): frame carried more than max_fds ",
                        max_fds_, " descriptors; all of them were closed"));
  }
  return true;
}

absl::StatusOr<ReceivedMessage> RecvMessage(int sock, size_t max_payload, size_t max_fds) {
  if (max_fds > kMaxFdsPerMessage) {
    return absl::InvalidArgumentError(
        ulysses::StrCat("max_fds: ", max_fds, " exceeds ", kMaxFdsPerMessage));
  }
  FrameReader reader(max_payload, max_fds);
  for (;;) {
    ULY_ASSIGN_OR_RETURN(const bool complete, reader.Read(sock));
    if (complete) return reader.Take();
    ULY_ASSIGN_OR_RETURN(short revents, PollFd(sock, POLLIN, -1));
    (void)revents;  // hang-ups and errors surface from the next read
  }
}

absl::StatusOr<bool> WaitReadable(int fd, int timeout_ms) {
  ULY_ASSIGN_OR_RETURN(short revents, PollFd(fd, POLLIN, timeout_ms));
  return revents != 0;
}

// What poll reports once the other end of a stream socket closed.
constexpr short kHangUp = POLLRDHUP | POLLHUP | POLLERR;

absl::StatusOr<bool> HungUp(int sock) {
  ULY_ASSIGN_OR_RETURN(short revents, PollFd(sock, POLLRDHUP, 0));
  return (revents & kHangUp) != 0;
}

absl::StatusOr<bool> WaitHungUp(int sock, const std::atomic<bool>& stop, int check_ms) {
  if (sock < 0)
    return absl::InvalidArgumentError(ulysses::StrCat("sock: ", sock, " is not a descriptor"));
  if (check_ms <= 0)
    return absl::InvalidArgumentError(ulysses::StrCat("check_ms: ", check_ms, " is not positive"));
  while (!stop.load(std::memory_order_acquire)) {
    ULY_ASSIGN_OR_RETURN(short revents, PollFd(sock, POLLRDHUP, check_ms));
    if ((revents & kHangUp) != 0) return true;
  }
  return false;
}

}  // namespace ulysses::ipc
