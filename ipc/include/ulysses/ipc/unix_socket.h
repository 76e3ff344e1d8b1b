// Unix-domain stream sockets: listener, connect, peer credentials and framed messages with
// file-descriptor passing (SCM_RIGHTS).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "ulysses/ipc/fd.h"

namespace ulysses::ipc {

/// A listening SOCK_STREAM unix socket bound to a filesystem path.
///
/// Move-only. Accept() may block in one thread while another calls Shutdown(); everything else
/// (moves, destruction) must not race with other uses of the object. The listening socket is
/// non-blocking (so TryAccept never waits); Accept() waits with poll(2). On destruction the socket
/// is closed and its path unlinked, unless the path no longer refers to this socket (someone
/// replaced it).
class UnixListener {
 public:
  /// Empty listener (fd() == -1).
  UnixListener() noexcept = default;
  /// Closes the socket and unlinks path() if it still names this socket.
  ~UnixListener();

  UnixListener(const UnixListener&) = delete;
  UnixListener& operator=(const UnixListener&) = delete;
  /// Transfers the socket and the path; `other` is left empty. Not while `other` is in Accept.
  UnixListener(UnixListener&& other) noexcept;
  /// Closes/unlinks the current socket as the destructor would, then takes `other`'s.
  UnixListener& operator=(UnixListener&& other) noexcept;

  /// Binds a listening socket at `path` with permissions `mode` (applied with chmod before the
  /// socket starts listening, so no connection is accepted under looser permissions).
  /// The parent directory must exist (NOT_FOUND otherwise; it is not created). A leftover socket
  /// file that nobody listens on (connect fails with ECONNREFUSED) is removed; when a live
  /// process accepts on it the result is ALREADY_EXISTS "socket PATH is in use". A path that
  /// exists but is not a socket is never removed (FAILED_PRECONDITION). INVALID_ARGUMENT naming
  /// `path` when it is empty or longer than a sockaddr_un allows (107 bytes).
  /// Two processes racing to replace the same stale socket are not serialised; run one listener
  /// per path (one daemon per GPU).
  static absl::StatusOr<UnixListener> Listen(std::string path, mode_t mode = 0660);

  /// The listening descriptor (owned), e.g. for poll(2); -1 when empty.
  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  /// The filesystem path the socket is bound to.
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// Blocks until a client connects and returns the connected socket (SOCK_CLOEXEC, blocking).
  /// Retries on EINTR and on connections aborted before they were accepted. Returns CANCELLED
  /// once Shutdown() has been called (also when called afterwards); the errno of accept4
  /// otherwise (e.g. RESOURCE_EXHAUSTED on EMFILE). Thread-safe with respect to Shutdown().
  absl::StatusOr<UniqueFd> Accept();

  /// Accepts one pending connection without waiting, for a poll(2) loop that watches fd():
  /// the connected socket (SOCK_CLOEXEC | SOCK_NONBLOCK), or an empty UniqueFd when none is
  /// pending. Errors as Accept() (CANCELLED after Shutdown; RESOURCE_EXHAUSTED on EMFILE, after
  /// which the pending connection stays queued, so the caller should back off).
  absl::StatusOr<UniqueFd> TryAccept();

  /// Stops accepting: wakes every thread blocked in Accept() (which then returns CANCELLED) and
  /// makes new connection attempts fail with ECONNREFUSED. The path stays bound until
  /// destruction. Idempotent; callable from any thread, e.g. a signal-handling thread.
  void Shutdown() noexcept;

 private:
  UnixListener(UniqueFd fd, std::string path, dev_t dev, ino_t ino) noexcept
      : fd_(std::move(fd)), path_(std::move(path)), dev_(dev), ino_(ino) {}
  void CloseAndUnlink() noexcept;

  UniqueFd fd_;
  std::string path_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
  std::atomic<bool> shut_down_{false};
};

/// Makes `path` free for a new socket, as Listen does before it binds: OK when nothing is
/// there, or a leftover socket nobody listens on was removed; ALREADY_EXISTS "socket PATH is in
/// use" when a live process accepts on it; FAILED_PRECONDITION when the path is not a socket
/// (never removed); NOT_FOUND when the parent directory does not exist; INVALID_ARGUMENT naming
/// `path` when it is empty or too long. Binds nothing. For a socket another library binds.
absl::Status ClaimSocketPath(const std::string& path);

/// Connects a blocking SOCK_STREAM (SOCK_CLOEXEC) socket to the unix socket at `path`, waiting
/// at most `timeout` while the listener's backlog is full (a listener that stopped accepting).
/// Errors: INVALID_ARGUMENT naming `path` (empty or too long); NOT_FOUND when nothing exists at
/// `path`; UNAVAILABLE when nobody listens (ECONNREFUSED); DEADLINE_EXCEEDED past `timeout`;
/// PERMISSION_DENIED; otherwise the errno of socket/connect. The socket keeps no send timeout.
/// Thread-safe.
absl::StatusOr<UniqueFd> ConnectUnix(std::string_view path,
                                     absl::Duration timeout = absl::InfiniteDuration());

/// Credentials of the process at the other end of a connected unix socket, as the kernel
/// recorded them when the connection was made (connect(2) or listen(2) time).
struct PeerCred {
  /// Process id of the peer (in the caller's pid namespace; 0 if not mappable).
  pid_t pid;
  /// Effective user id of the peer.
  uid_t uid;
  /// Effective group id of the peer.
  gid_t gid;
};

/// Reads SO_PEERCRED of the connected unix socket `fd`. Thread-safe.
absl::StatusOr<PeerCred> GetPeerCred(int fd);

/// One framed message received by RecvMessage.
struct ReceivedMessage {
  /// The payload bytes exactly as sent.
  std::string payload;
  /// Descriptors that travelled with the frame, in the order they were sent; owned by the
  /// receiver, close-on-exec.
  std::vector<UniqueFd> fds;
};

/// Most descriptors one message may carry (the kernel's SCM_MAX_FD).
inline constexpr size_t kMaxFdsPerMessage = 253;

/// Sends one frame on the connected SOCK_STREAM unix socket `sock`: a 4-byte length (host byte
/// order; both ends are on one host) followed by `payload`, with `fds` attached (SCM_RIGHTS) to
/// the first byte of the frame. The descriptors are duplicated into the receiver; the caller
/// keeps its own. Handles partial sends and EINTR, and waits (poll) when `sock` is non-blocking
/// and full: for ever when `timeout_ms` is negative, else for at most `timeout_ms` in all, then
/// DEADLINE_EXCEEDED. Never raises SIGPIPE (MSG_NOSIGNAL). Errors: INVALID_ARGUMENT naming
/// `payload` (over 4 GiB - 1) or `fds` (more than kMaxFdsPerMessage, or a negative descriptor);
/// UNAVAILABLE when the peer has gone (EPIPE/ECONNRESET); the errno of sendmsg otherwise. After
/// an error in the middle of a frame (a timeout included) the stream is out of sync and must be
/// closed. Thread-safety: concurrent senders on one socket must serialise themselves (frames
/// would interleave otherwise).
absl::Status SendMessage(int sock, std::string_view payload, std::span<const int> fds = {},
                         int timeout_ms = -1);

/// Receives exactly one frame sent by SendMessage from `sock`, blocking until the whole frame has
/// arrived (also when `sock` is non-blocking), never reading into the next frame. Descriptors are
/// received with MSG_CMSG_CLOEXEC. Errors:
/// - UNAVAILABLE "peer closed" when the peer closed the connection between frames; UNAVAILABLE
///   also when it closed in the middle of a frame, or reset the connection;
/// - RESOURCE_EXHAUSTED when the frame's payload exceeds `max_payload` (the payload is left
///   unread: the stream is out of sync and must be closed), or when it carried more than
///   `max_fds` descriptors (the frame is consumed, the excess descriptors were closed by the
///   kernel, the received ones are closed; the stream stays usable);
/// - INVALID_ARGUMENT naming `max_fds` when it exceeds kMaxFdsPerMessage;
/// - the errno of recvmsg otherwise.
/// Thread-safety: concurrent receivers on one socket must serialise themselves.
absl::StatusOr<ReceivedMessage> RecvMessage(int sock, size_t max_payload = 4096,
                                            size_t max_fds = 16);

/// Reads frames sent by SendMessage from one socket piece by piece, for a poll(2) loop that
/// must never wait on a slow or silent peer: each Read takes what has arrived (MSG_DONTWAIT) and
/// keeps a partial frame until the rest comes. Like RecvMessage it never reads past the end of
/// the current frame, so descriptors stay with the frame they were sent with.
///
/// Not thread-safe: one reader per socket, used by one thread at a time.
class FrameReader {
 public:
  /// Frames longer than `max_payload`, or carrying more than `max_fds` descriptors, are errors
  /// as in RecvMessage. `max_fds` is clamped to kMaxFdsPerMessage.
  explicit FrameReader(size_t max_payload = 4096, size_t max_fds = 16);

  /// Reads what `sock` has of the current frame: true when the frame is complete (Take() it),
  /// false when more bytes must arrive first (wait for POLLIN). Errors as RecvMessage: UNAVAILABLE
  /// when the peer closed (between frames or in the middle of one); RESOURCE_EXHAUSTED when the
  /// frame is over `max_payload` (the stream is out of sync: close it; later calls repeat the
  /// error) or carried too many descriptors (the frame is consumed and dropped; the stream stays
  /// usable); the errno of recvmsg otherwise.
  absl::StatusOr<bool> Read(int sock);
  /// The completed frame; the reader starts on the next one. Only after Read returned true.
  ReceivedMessage Take();
  /// True while part of a frame has been read and the rest has not.
  [[nodiscard]] bool mid_frame() const noexcept { return got_ > 0; }

 private:
  void Reset();

  size_t max_payload_;
  size_t max_fds_;
  char header_[4] = {};
  uint32_t length_ = 0;
  size_t got_ = 0;  // bytes of the current frame read so far, header included
  bool fds_truncated_ = false;
  bool out_of_sync_ = false;
  ReceivedMessage frame_;
};

/// Waits up to `timeout_ms` milliseconds (negative: forever; 0: just check) for `fd` to become
/// readable. Returns true when it is readable or has hung up / failed (a read then reports what
/// happened), false on timeout. Retries EINTR against the original deadline. INVALID_ARGUMENT
/// naming `fd` when it is not an open descriptor. Thread-safe.
absl::StatusOr<bool> WaitReadable(int fd, int timeout_ms);

/// Whether the other end of stream socket `sock` closed (or shut down its writing side), without
/// waiting and without reading: true once nothing more can arrive. Data still queued does not
/// count. INVALID_ARGUMENT naming `fd` when it is not an open descriptor. Thread-safe.
absl::StatusOr<bool> HungUp(int sock);

/// Blocks until the other end of stream socket `sock` closed (true) or `stop` is set (false),
/// looking at `stop` at least every `check_ms` milliseconds. Reads nothing. INVALID_ARGUMENT
/// naming `sock` when it is negative or not an open descriptor, or `check_ms` when it is not
/// positive.
absl::StatusOr<bool> WaitHungUp(int sock, const std::atomic<bool>& stop, int check_ms);

}  // namespace ulysses::ipc
