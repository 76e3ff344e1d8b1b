#include "ulysses/ipc/doorbell.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <thread>
#include <utility>

#include "gtest/gtest.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {
namespace {

std::pair<Doorbell, Doorbell> MakeBell() {
  absl::StatusOr<std::pair<Doorbell, Doorbell>> bell = Doorbell::Create();
  EXPECT_TRUE(bell.ok()) << bell.status();
  return bell.ok() ? std::move(*bell) : std::pair<Doorbell, Doorbell>();
}

TEST(DoorbellTest, RingsCoalesceAndAreConsumedByOneWait) {
  std::pair<Doorbell, Doorbell> bell = MakeBell();
  Doorbell& ring = bell.first;  // named, not a structured binding: a lambda captures it
  Doorbell& wait = bell.second;
  for (int fd : {ring.fd(), wait.fd()}) EXPECT_TRUE(::fcntl(fd, F_GETFD) & FD_CLOEXEC);
  EXPECT_FALSE(wait.Wait(0).value());
  ASSERT_TRUE(ring.Signal().ok());
  ASSERT_TRUE(ring.Signal().ok());
  EXPECT_TRUE(wait.Wait(0).value());
  EXPECT_FALSE(wait.Wait(0).value());  // both rings consumed
  // A ring from another thread wakes a waiter.
  std::thread ringer([&] { ASSERT_TRUE(ring.Signal().ok()); });
  EXPECT_TRUE(wait.Wait(5000).value());
  ringer.join();
}

// Either side may make its descriptor blocking: neither end ever blocks. A full buffer is a
// bell rung many times over, and one Wait consumes it all.
TEST(DoorbellTest, NeitherEndBlocksWhateverTheOtherSets) {
  auto [ring, wait] = MakeBell();
  for (int fd : {ring.fd(), wait.fd()})
    ASSERT_EQ(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK), 0);
  EXPECT_FALSE(wait.Wait(0).value());  // nothing pending: no blocking receive
  // Far more rings than the socket buffer holds (a few hundred KiB).
  for (int i = 0; i < (1 << 20); ++i) ASSERT_TRUE(ring.Signal().ok()) << "ring " << i;
  EXPECT_TRUE(wait.Wait(0).value());
  EXPECT_FALSE(wait.Wait(0).value());
}

// An end whose other side closed is an error, never a wait and never a SIGPIPE; a waiting end
// cannot ring back.
TEST(DoorbellTest, AClosedOtherEndIsAnErrorAndTheWaitingEndCannotRing) {
  {
    auto [ring, wait] = MakeBell();
    const char one = 1;
    EXPECT_EQ(::send(wait.fd(), &one, 1, MSG_DONTWAIT | MSG_NOSIGNAL), -1);
    EXPECT_EQ(errno, EPIPE);
    ASSERT_TRUE(ring.Signal().ok());
    ring = Doorbell();  // closed
    EXPECT_TRUE(wait.Wait(0).value());  // the ring sent before the close is still there
    const absl::StatusOr<bool> gone = wait.Wait(1000);
    EXPECT_EQ(gone.status().code(), absl::StatusCode::kUnavailable) << gone.status();
  }
  {
    auto [ring, wait] = MakeBell();
    wait = Doorbell();
    const absl::Status st = ring.Signal();
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
  }
}

// An end received from another process is adopted; anything but an AF_UNIX stream socket is
// refused, naming the descriptor.
TEST(DoorbellTest, AdoptTakesAReceivedEndAndRefusesOtherDescriptors) {
  auto [ring, wait] = MakeBell();
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  const int fds[1] = {ring.fd()};
  ASSERT_TRUE(SendMessage(a.get(), "bell", fds).ok());
  absl::StatusOr<ReceivedMessage> got = RecvMessage(b.get());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->fds.size(), 1u);
  absl::StatusOr<Doorbell> adopted = Doorbell::Adopt(std::move(got->fds[0]));
  ASSERT_TRUE(adopted.ok()) << adopted.status();
  ASSERT_TRUE(adopted->Signal().ok());
  EXPECT_TRUE(wait.Wait(1000).value());

  absl::StatusOr<UniqueFd> memfd = CreateMemfd("not-a-bell", 4096);
  ASSERT_TRUE(memfd.ok());
  const int memfd_number = memfd->get();
  const absl::StatusOr<Doorbell> refused = Doorbell::Adopt(std::move(*memfd));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find(std::to_string(memfd_number)), std::string::npos)
      << refused.status();
  int pipe_ends[2];
  ASSERT_EQ(::pipe2(pipe_ends, O_CLOEXEC), 0);
  UniqueFd keep(pipe_ends[1]);
  EXPECT_EQ(Doorbell::Adopt(UniqueFd(pipe_ends[0])).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Doorbell::Adopt(UniqueFd()).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ulysses::ipc
