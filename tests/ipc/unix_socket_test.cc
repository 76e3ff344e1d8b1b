#include "ulysses/ipc/unix_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "../util/fd_count.h"
#include "test_util.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::ipc {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using testing::WaitChild;

bool PathExists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// A unix socket bound at `path` and listening with `backlog`, without UnixListener (invalid
// when that fails).
UniqueFd RawListener(const std::string& path, int backlog) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return fd;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(fd.get(), backlog) != 0)
    return UniqueFd();
  return fd;
}

// Leaves a socket file at `path` that nobody listens on, as a crashed daemon would.
void MakeStaleSocket(const std::string& path) {
  UniqueFd fd = RawListener(path, 1);
  ASSERT_TRUE(fd.valid());
}  // closed here without unlink: the file stays behind

std::pair<UniqueFd, UniqueFd> SocketPair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return {};
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

// Writes `text` at offset 0 of memfd `fd` through a fresh mapping.
void WriteThrough(int fd, const std::string& text) {
  auto m = Mapping::Map(fd, 4096, /*writable=*/true);
  ASSERT_TRUE(m.ok()) << m.status();
  std::memcpy(m->data(), text.c_str(), text.size() + 1);
}

std::string ReadThrough(int fd) {
  auto m = Mapping::Map(fd, 4096, /*writable=*/false);
  if (!m.ok()) return "<map failed: " + std::string(m.status().message()) + ">";
  return std::string(static_cast<const char*>(m->data()));
}

TEST(UnixListenerTest, ListenAcceptAndPeerCred) {
  TempDir dir;
  const std::string path = dir.File("gpu0.sock");
  auto listener = UnixListener::Listen(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  EXPECT_EQ(listener->path(), path);
  EXPECT_GE(listener->fd(), 0);

  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0660u);

  auto client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  auto server = listener->Accept();
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(::fcntl(server->get(), F_GETFD) & FD_CLOEXEC);

  auto cred = GetPeerCred(server->get());
  ASSERT_TRUE(cred.ok()) << cred.status();
  EXPECT_EQ(cred->pid, ::getpid());
  EXPECT_EQ(cred->uid, ::geteuid());
  EXPECT_EQ(cred->gid, ::getegid());

  auto client_side = GetPeerCred(client->get());
  ASSERT_TRUE(client_side.ok()) << client_side.status();
  EXPECT_EQ(client_side->pid, ::getpid());

  // The accepted connection carries data both ways.
  ASSERT_TRUE(SendMessage(client->get(), "hello").ok());
  auto msg = RecvMessage(server->get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload, "hello");
}

TEST(UnixListenerTest, ModeIsApplied) {
  TempDir dir;
  const std::string path = dir.File("private.sock");
  auto listener = UnixListener::Listen(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
}

TEST(UnixListenerTest, DestructorUnlinksPath) {
  TempDir dir;
  const std::string path = dir.File("gone.sock");
  {
    auto listener = UnixListener::Listen(path);
    ASSERT_TRUE(listener.ok()) << listener.status();
    EXPECT_TRUE(PathExists(path));
  }
  EXPECT_FALSE(PathExists(path));
  auto connect = ConnectUnix(path);
  EXPECT_EQ(connect.status().code(), absl::StatusCode::kNotFound);
}

TEST(UnixListenerTest, MovedListenerKeepsPath) {
  TempDir dir;
  const std::string path = dir.File("moved.sock");
  auto listener = UnixListener::Listen(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  UnixListener moved(*std::move(listener));
  { UnixListener empty(std::move(*listener)); }  // moved-from: must not unlink
  EXPECT_TRUE(PathExists(path));
  EXPECT_EQ(moved.path(), path);
  auto client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(moved.Accept().ok());
}

TEST(UnixListenerTest, RemovesStaleSocket) {
  TempDir dir;
  const std::string path = dir.File("stale.sock");
  MakeStaleSocket(path);
  ASSERT_TRUE(PathExists(path));
  auto refused = ConnectUnix(path);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable);

  auto listener = UnixListener::Listen(path);
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(listener->Accept().ok());
}

// A listener that stopped accepting (a stopped daemon) and whose backlog is full: a bounded
// connect ends with DEADLINE_EXCEEDED naming the path instead of waiting for room, and the
// connection made before it works (no send timeout left on it).
TEST(UnixListenerTest, ABoundedConnectToAFullBacklogEnds) {
  TempDir dir;
  const std::string path = dir.File("full.sock");
  UniqueFd listener = RawListener(path, 0);
  ASSERT_TRUE(listener.valid());
  // Fill the backlog with connections nobody accepts.
  std::vector<UniqueFd> queued;
  for (int i = 0; i < 4; ++i) {
    auto c = ConnectUnix(path, absl::Milliseconds(100));
    if (!c.ok()) {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kDeadlineExceeded) << c.status();
      EXPECT_THAT(std::string(c.status().message()), HasSubstr(path));
      break;
    }
    queued.push_back(std::move(*c));
  }
  ASSERT_FALSE(queued.empty());
  ASSERT_LT(queued.size(), 4u) << "the backlog never filled";
  // The queued connection has no send timeout: it is accepted and carries bytes.
  UniqueFd accepted(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  ASSERT_TRUE(accepted.valid());
  timeval tv{};
  socklen_t len = sizeof tv;
  ASSERT_EQ(::getsockopt(queued[0].get(), SOL_SOCKET, SO_SNDTIMEO, &tv, &len), 0);
  EXPECT_EQ(tv.tv_sec, 0);
  EXPECT_EQ(tv.tv_usec, 0);
  ASSERT_EQ(::write(queued[0].get(), "x", 1), 1);
  char got = 0;
  ASSERT_EQ(::read(accepted.get(), &got, 1), 1);
  EXPECT_EQ(got, 'x');
}

TEST(UnixListenerTest, LiveSocketIsInUse) {
  TempDir dir;
  const std::string path = dir.File("live.sock");
  auto first = UnixListener::Listen(path);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = UnixListener::Listen(path);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr("socket " + path + " is in use"));
  // The failed attempt left the live socket alone.
  auto client = ConnectUnix(path);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_TRUE(first->Accept().ok());
}

TEST(UnixListenerTest, MissingParentIsNotFound) {
  TempDir dir;
  const std::string path = dir.File("no-such-dir/gpu0.sock");
  auto listener = UnixListener::Listen(path);
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(listener.status().message()), HasSubstr(dir.File("no-such-dir")));
  EXPECT_FALSE(PathExists(dir.File("no-such-dir")));
}

TEST(UnixListenerTest, RegularFileIsNotRemoved) {
  TempDir dir;
  const std::string path = dir.File("not-a-socket");
  UniqueFd file(::open(path.c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600));
  ASSERT_TRUE(file.valid());
  auto listener = UnixListener::Listen(path);
  EXPECT_EQ(listener.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(PathExists(path));
}

TEST(UnixListenerTest, BadPathIsInvalidArgument) {
  auto empty = UnixListener::Listen("");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  auto too_long = UnixListener::Listen("/tmp/" + std::string(200, 'x'));
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("path"));
  auto connect = ConnectUnix("/tmp/" + std::string(200, 'x'));
  EXPECT_EQ(connect.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(UnixListenerTest, ShutdownWakesBlockedAccept) {
  TempDir dir;
  const std::string path = dir.File("shutdown.sock");
  auto listener = UnixListener::Listen(path);
  ASSERT_TRUE(listener.ok()) << listener.status();

  absl::Status accept_status;
  std::thread acceptor([&] { accept_status = listener->Accept().status(); });
  listener->Shutdown();
  acceptor.join();
  EXPECT_EQ(accept_status.code(), absl::StatusCode::kCancelled) << accept_status;
  // Later calls fail the same way, and new clients are turned away.
  EXPECT_EQ(listener->Accept().status().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(ConnectUnix(path).ok());
  listener->Shutdown();  // idempotent
}

TEST(MessageTest, FramesWithZeroOneAndThreeFds) {
  auto [a, b] = SocketPair();
  ASSERT_TRUE(a.valid());
  std::vector<UniqueFd> memfds;
  for (int i = 0; i < 4; ++i) {
    auto fd = CreateMemfd("msg-test", 4096);
    ASSERT_TRUE(fd.ok()) << fd.status();
    WriteThrough(fd->get(), "buffer " + std::to_string(i));
    memfds.push_back(*std::move(fd));
  }
  const int one[] = {memfds[0].get()};
  const int three[] = {memfds[1].get(), memfds[2].get(), memfds[3].get()};

  // Back to back, before anything is read: the framing alone must delimit them.
  ASSERT_TRUE(SendMessage(a.get(), "no fds").ok());
  ASSERT_TRUE(SendMessage(a.get(), "one fd", one).ok());
  ASSERT_TRUE(SendMessage(a.get(), "three fds", three).ok());
  ASSERT_TRUE(SendMessage(a.get(), "").ok());
  ASSERT_TRUE(SendMessage(a.get(), "", one).ok());

  auto m0 = RecvMessage(b.get());
  ASSERT_TRUE(m0.ok()) << m0.status();
  EXPECT_EQ(m0->payload, "no fds");
  EXPECT_TRUE(m0->fds.empty());

  auto m1 = RecvMessage(b.get());
  ASSERT_TRUE(m1.ok()) << m1.status();
  EXPECT_EQ(m1->payload, "one fd");
  ASSERT_EQ(m1->fds.size(), 1u);
  EXPECT_EQ(ReadThrough(m1->fds[0].get()), "buffer 0");

  auto m3 = RecvMessage(b.get());
  ASSERT_TRUE(m3.ok()) << m3.status();
  EXPECT_EQ(m3->payload, "three fds");
  ASSERT_EQ(m3->fds.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(ReadThrough(m3->fds[i].get()), "buffer " + std::to_string(i + 1));
    EXPECT_TRUE(::fcntl(m3->fds[i].get(), F_GETFD) & FD_CLOEXEC);
  }

  auto empty = RecvMessage(b.get());
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->payload, "");
  EXPECT_TRUE(empty->fds.empty());

  auto empty_with_fd = RecvMessage(b.get());
  ASSERT_TRUE(empty_with_fd.ok()) << empty_with_fd.status();
  EXPECT_EQ(empty_with_fd->payload, "");
  EXPECT_EQ(empty_with_fd->fds.size(), 1u);

  // Nothing more is queued.
  auto readable = WaitReadable(b.get(), 0);
  ASSERT_TRUE(readable.ok());
  EXPECT_FALSE(*readable);
}

TEST(MessageTest, ReceivedFdIsTheSameMemfd) {
  auto [a, b] = SocketPair();
  auto fd = CreateMemfd("same-memfd", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int fds[] = {fd->get()};
  ASSERT_TRUE(SendMessage(a.get(), "buf", fds).ok());
  auto msg = RecvMessage(b.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  ASSERT_EQ(msg->fds.size(), 1u);
  const int received = msg->fds[0].get();
  EXPECT_NE(received, fd->get());

  auto size = FdSize(received);
  ASSERT_TRUE(size.ok());
  EXPECT_EQ(*size, 4096u);
  WriteThrough(fd->get(), "sender wrote this");
  EXPECT_EQ(ReadThrough(received), "sender wrote this");
  WriteThrough(received, "receiver answered");
  EXPECT_EQ(ReadThrough(fd->get()), "receiver answered");
}

TEST(MessageTest, LargePayloadWithFdsArrivesWhole) {
  auto [a, b] = SocketPair();
  auto fd = CreateMemfd("large", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  std::string big(3 << 20, '\0');
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);

  // Bigger than the socket buffer: the sender blocks in partial sends until the reader drains.
  absl::Status send_status;
  std::thread sender([&, sock = a.get(), memfd = fd->get()] {
    const int fds[] = {memfd, memfd};
    send_status = SendMessage(sock, big, fds);
    if (send_status.ok()) send_status = SendMessage(sock, "after");
  });
  auto msg = RecvMessage(b.get(), big.size());
  auto after = RecvMessage(b.get());
  sender.join();
  ASSERT_TRUE(send_status.ok()) << send_status;
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload.size(), big.size());
  EXPECT_TRUE(msg->payload == big);
  EXPECT_EQ(msg->fds.size(), 2u);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(after->payload, "after");
}

TEST(MessageTest, PeerCloseIsUnavailable) {
  auto [a, b] = SocketPair();
  ASSERT_TRUE(SendMessage(a.get(), "last words").ok());
  a.reset();
  auto msg = RecvMessage(b.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload, "last words");
  auto closed = RecvMessage(b.get());
  EXPECT_EQ(closed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(closed.status().message()), HasSubstr("peer closed"));

  // Sending to a closed peer fails without SIGPIPE.
  auto send = SendMessage(b.get(), "anyone?");
  EXPECT_EQ(send.code(), absl::StatusCode::kUnavailable) << send;
}

// HungUp and WaitHungUp see the other end's close, not data queued before it; WaitHungUp also
// ends when told to stop, and names a descriptor that is not open.
TEST(HungUpTest, TheOtherEndsCloseIsSeenAndQueuedDataIsNot) {
  auto [a, b] = SocketPair();
  ASSERT_TRUE(SendMessage(a.get(), "queued").ok());
  absl::StatusOr<bool> gone = HungUp(b.get());
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_FALSE(*gone);
  std::atomic<bool> stop{false};
  UniqueFd* writer = &a;  // clang 14 cannot capture a structured binding
  std::thread closer([writer] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    writer->reset();
  });
  // A hang-up never seen stops the wait (and fails below) instead of hanging the test.
  std::atomic<bool> done{false};
  std::thread watchdog([&] {
    for (int i = 0; i < 1000 && !done.load(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stop.store(true);
  });
  gone = WaitHungUp(b.get(), stop, 5);
  done.store(true);
  closer.join();
  watchdog.join();
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_TRUE(*gone);
  gone = HungUp(b.get());
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_TRUE(*gone);
  // The data sent before the close is still there to read.
  auto msg = RecvMessage(b.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload, "queued");
}

TEST(HungUpTest, WaitHungUpEndsWhenToldToStop) {
  auto [a, b] = SocketPair();
  std::atomic<bool> stop{false};
  std::thread stopper([&stop] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    stop.store(true);
  });
  absl::StatusOr<bool> gone = WaitHungUp(b.get(), stop, 5);
  stopper.join();
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_FALSE(*gone);  // a still open: not a hang-up
  // Already stopped: returns at once without looking.
  gone = WaitHungUp(b.get(), stop, 5);
  ASSERT_TRUE(gone.ok()) << gone.status();
  EXPECT_FALSE(*gone);
  std::atomic<bool> run{false};
  gone = WaitHungUp(-1, run, 5);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kInvalidArgument) << gone.status();
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("sock"));
  gone = WaitHungUp(b.get(), run, 0);
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kInvalidArgument) << gone.status();
  EXPECT_THAT(std::string(gone.status().message()), HasSubstr("check_ms"));
}

TEST(MessageTest, PeerCloseMidFrameIsUnavailable) {
  auto [a, b] = SocketPair();
  const uint32_t length = 100;
  ASSERT_EQ(::write(a.get(), &length, sizeof(length)), 4);
  ASSERT_EQ(::write(a.get(), "partial", 7), 7);
  a.reset();
  auto msg = RecvMessage(b.get());
  EXPECT_EQ(msg.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(msg.status().message()), HasSubstr("middle of a frame"));
}

TEST(MessageTest, OversizedPayloadIsResourceExhausted) {
  auto [a, b] = SocketPair();
  ASSERT_TRUE(SendMessage(a.get(), std::string(100, 'x')).ok());
  auto msg = RecvMessage(b.get(), /*max_payload=*/10);
  EXPECT_EQ(msg.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(msg.status().message()), HasSubstr("max_payload"));
}

TEST(MessageTest, TooManyFdsIsResourceExhaustedAndStreamStaysInSync) {
  auto [a, b] = SocketPair();
  auto fd = CreateMemfd("too-many", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int three[] = {fd->get(), fd->get(), fd->get()};
  ASSERT_TRUE(SendMessage(a.get(), "three", three).ok());
  ASSERT_TRUE(SendMessage(a.get(), "next", three).ok());
  auto msg = RecvMessage(b.get(), 4096, /*max_fds=*/2);
  EXPECT_EQ(msg.status().code(), absl::StatusCode::kResourceExhausted);
  auto next = RecvMessage(b.get(), 4096, 3);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->payload, "next");
  EXPECT_EQ(next->fds.size(), 3u);
}

TEST(MessageTest, InvalidArguments) {
  auto [a, b] = SocketPair();
  const int bad[] = {-1};
  auto send = SendMessage(a.get(), "x", bad);
  EXPECT_EQ(send.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(send.message()), HasSubstr("fds"));
  std::vector<int> too_many(kMaxFdsPerMessage + 1, a.get());
  EXPECT_EQ(SendMessage(a.get(), "x", too_many).code(), absl::StatusCode::kInvalidArgument);
  auto recv = RecvMessage(b.get(), 16, kMaxFdsPerMessage + 1);
  EXPECT_EQ(recv.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(recv.status().message()), HasSubstr("max_fds"));
}

TEST(MessageTest, ForkedChildSendsFdToParent) {
  auto [parent_end, child_end] = SocketPair();
  ASSERT_TRUE(parent_end.valid());
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    parent_end.reset();
    auto fd = CreateMemfd("from-child", 4096);
    if (!fd.ok()) ::_exit(2);
    auto m = Mapping::Map(fd->get(), 4096, true);
    if (!m.ok()) ::_exit(3);
    std::memcpy(m->data(), "written by the child", 21);
    const int fds[] = {fd->get()};
    if (!SendMessage(child_end.get(), "memfd", fds).ok()) ::_exit(4);
    // Wait until the parent has written its answer into the shared memory and says so.
    auto ack = RecvMessage(child_end.get());
    if (!ack.ok() || ack->payload != "ack") ::_exit(5);
    if (std::string(static_cast<const char*>(m->data())) != "answered by the parent") ::_exit(6);
    ::_exit(0);
  }
  child_end.reset();
  auto msg = RecvMessage(parent_end.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  EXPECT_EQ(msg->payload, "memfd");
  ASSERT_EQ(msg->fds.size(), 1u);
  EXPECT_EQ(ReadThrough(msg->fds[0].get()), "written by the child");
  WriteThrough(msg->fds[0].get(), "answered by the parent");
  ASSERT_TRUE(SendMessage(parent_end.get(), "ack").ok());
  EXPECT_EQ(WaitChild(pid), 0);
  // The child is gone: its end of the socket closed.
  EXPECT_EQ(RecvMessage(parent_end.get()).status().code(), absl::StatusCode::kUnavailable);
}

TEST(WaitReadableTest, ReportsReadabilityAndTimeout) {
  auto [a, b] = SocketPair();
  auto idle = WaitReadable(b.get(), 10);
  ASSERT_TRUE(idle.ok()) << idle.status();
  EXPECT_FALSE(*idle);
  ASSERT_TRUE(SendMessage(a.get(), "ping").ok());
  auto ready = WaitReadable(b.get(), -1);
  ASSERT_TRUE(ready.ok()) << ready.status();
  EXPECT_TRUE(*ready);

  int closed_fd;
  {
    auto [c, d] = SocketPair();
    closed_fd = c.get();
  }
  auto bad = WaitReadable(closed_fd, 0);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ulysses::ipc

namespace ulysses::ipc {
namespace {

std::pair<UniqueFd, UniqueFd> NonBlockingPair() {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv) != 0) return {};
  return {UniqueFd(sv[0]), UniqueFd(sv[1])};
}

TEST(FrameReaderTest, KeepsAPartialFrameUntilTheRestArrives) {
  auto [a, b] = NonBlockingPair();
  FrameReader reader;
  auto none = reader.Read(b.get());
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(*none);
  EXPECT_FALSE(reader.mid_frame());
  // The header in two pieces, then the payload in two.
  const uint32_t length = 5;
  const char* bytes = reinterpret_cast<const char*>(&length);
  ASSERT_EQ(::write(a.get(), bytes, 3), 3);
  EXPECT_FALSE(*reader.Read(b.get()));
  EXPECT_TRUE(reader.mid_frame());
  ASSERT_EQ(::write(a.get(), bytes + 3, 1), 1);
  ASSERT_EQ(::write(a.get(), "he", 2), 2);
  EXPECT_FALSE(*reader.Read(b.get()));
  ASSERT_EQ(::write(a.get(), "llo", 3), 3);
  auto done = reader.Read(b.get());
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_TRUE(*done);
  EXPECT_EQ(reader.Take().payload, "hello");
  EXPECT_FALSE(reader.mid_frame());
}

TEST(FrameReaderTest, NeverReadsIntoTheNextFrameSoDescriptorsStayWithTheirFrame) {
  auto [a, b] = NonBlockingPair();
  auto fd = CreateMemfd("reader", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const int one[] = {fd->get()};
  ASSERT_TRUE(SendMessage(a.get(), "first").ok());
  ASSERT_TRUE(SendMessage(a.get(), "second", one).ok());
  FrameReader reader;
  ASSERT_TRUE(*reader.Read(b.get()));
  ReceivedMessage first = reader.Take();
  EXPECT_EQ(first.payload, "first");
  EXPECT_TRUE(first.fds.empty());
  ASSERT_TRUE(*reader.Read(b.get()));
  ReceivedMessage second = reader.Take();
  EXPECT_EQ(second.payload, "second");
  EXPECT_EQ(second.fds.size(), 1u);
}

// A frame whose bytes come one at a time, each carrying descriptors past max_fds, and which
// never completes: the reader closes them as they come instead of holding them all (a sender
// could otherwise fill the receiver's descriptor table with one frame).
TEST(FrameReaderTest, DescriptorsPastTheBoundAreClosedBeforeTheFrameCompletes) {
  std::pair<UniqueFd, UniqueFd> ends = NonBlockingPair();  // named: the lambda below uses one
  UniqueFd& a = ends.first;
  UniqueFd& b = ends.second;
  auto fd = CreateMemfd("many", 4096);
  ASSERT_TRUE(fd.ok()) << fd.status();
  const uint32_t length = 64;
  ASSERT_EQ(::write(a.get(), &length, sizeof(length)), 4);
  FrameReader reader(/*max_payload=*/4096, /*max_fds=*/1);
  auto send_byte_with_fds = [&](int n) {
    char byte = 'x';
    iovec iov{&byte, 1};
    alignas(cmsghdr) char control[CMSG_SPACE(8 * sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(n * sizeof(int));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(n * sizeof(int));
    const int raw = fd->get();
    for (int i = 0; i < n; ++i) std::memcpy(CMSG_DATA(c) + i * sizeof(int), &raw, sizeof(int));
    return ::sendmsg(a.get(), &msg, 0) == 1;
  };
  const int before = CountFdsButPipes(::getpid());
  for (int i = 0; i < 40; ++i) {
    ASSERT_TRUE(send_byte_with_fds(8));
    auto got = reader.Read(b.get());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_FALSE(*got);
  }
  // 320 descriptors came; at most one read's worth stays (the control space of max_fds).
  EXPECT_LE(CountFdsButPipes(::getpid()), before + 1);
  // The frame completes and is dropped; the stream stays in step.
  ASSERT_EQ(::write(a.get(), std::string(24, 'y').data(), 24), 24);
  EXPECT_EQ(reader.Read(b.get()).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(SendMessage(a.get(), "next").ok());
  auto next = reader.Read(b.get());
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_TRUE(*next);
  EXPECT_EQ(reader.Take().payload, "next");
  EXPECT_EQ(CountFdsButPipes(::getpid()), before);
}

TEST(FrameReaderTest, OversizedFrameIsAnErrorEveryTime) {
  auto [a, b] = NonBlockingPair();
  ASSERT_TRUE(SendMessage(a.get(), std::string(100, 'x')).ok());
  FrameReader reader(/*max_payload=*/10);
  EXPECT_EQ(reader.Read(b.get()).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(reader.Read(b.get()).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(FrameReaderTest, PeerCloseMidFrameIsUnavailable) {
  auto [a, b] = NonBlockingPair();
  const uint32_t length = 100;
  ASSERT_EQ(::write(a.get(), &length, sizeof(length)), 4);
  FrameReader reader;
  EXPECT_FALSE(*reader.Read(b.get()));
  a.reset();
  auto r = reader.Read(b.get());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("middle of a frame"));
}

TEST(UnixListenerTest, TryAcceptReturnsAtOnce) {
  TempDir dir;
  auto listener = UnixListener::Listen(dir.File("try.sock"));
  ASSERT_TRUE(listener.ok()) << listener.status();
  auto none = listener->TryAccept();
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_FALSE(none->valid());
  auto client = ConnectUnix(dir.File("try.sock"));
  ASSERT_TRUE(client.ok()) << client.status();
  auto conn = listener->TryAccept();
  ASSERT_TRUE(conn.ok()) << conn.status();
  ASSERT_TRUE(conn->valid());
  EXPECT_NE(::fcntl(conn->get(), F_GETFL) & O_NONBLOCK, 0);
  listener->Shutdown();
  EXPECT_EQ(listener->TryAccept().status().code(), absl::StatusCode::kCancelled);
}

TEST(MessageTest, SendToAPeerThatReadsNothingTimesOut) {
  auto [a, b] = NonBlockingPair();
  const std::string chunk(64 << 10, 'x');
  absl::Status s;
  // Fill the socket until the bounded send gives up; it must not wait for ever.
  for (int i = 0; i < 1024 && s.ok(); ++i) s = SendMessage(a.get(), chunk, {}, /*timeout_ms=*/50);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

}  // namespace
}  // namespace ulysses::ipc

namespace ulysses::ipc {
namespace {

TEST(ClaimSocketPathTest, FreesAStaleSocketRefusesALiveOneAndBindsNothing) {
  TempDir dir;
  const std::string path = dir.File("claim.sock");
  EXPECT_TRUE(ClaimSocketPath(path).ok());
  EXPECT_FALSE(PathExists(path)) << "a claim binds nothing";
  MakeStaleSocket(path);
  ASSERT_TRUE(PathExists(path));
  EXPECT_TRUE(ClaimSocketPath(path).ok());
  EXPECT_FALSE(PathExists(path));
  auto live = UnixListener::Listen(path);
  ASSERT_TRUE(live.ok()) << live.status();
  EXPECT_EQ(ClaimSocketPath(path).code(), absl::StatusCode::kAlreadyExists);
}

}  // namespace
}  // namespace ulysses::ipc
