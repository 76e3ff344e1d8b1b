#include "ulysses/ipc/eventfd.h"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <thread>
#include <utility>

#include "gtest/gtest.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {
namespace {

TEST(EventFdTest, SignalThenWait) {
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  EXPECT_GE(bell->fd(), 0);
  EXPECT_TRUE(::fcntl(bell->fd(), F_GETFD) & FD_CLOEXEC);

  ASSERT_TRUE(bell->Signal().ok());
  ASSERT_TRUE(bell->Signal().ok());
  auto rung = bell->Wait(0);
  ASSERT_TRUE(rung.ok()) << rung.status();
  EXPECT_TRUE(*rung);
  // Both rings were consumed by the one Wait.
  auto again = bell->Wait(0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(*again);
}

TEST(EventFdTest, WaitTimesOut) {
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  auto rung = bell->Wait(10);
  ASSERT_TRUE(rung.ok()) << rung.status();
  EXPECT_FALSE(*rung);
}

TEST(EventFdTest, WakesWaiterInAnotherThread) {
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  absl::StatusOr<bool> rung = false;
  std::thread waiter([&] { rung = bell->Wait(-1); });
  ASSERT_TRUE(bell->Signal().ok());
  waiter.join();
  ASSERT_TRUE(rung.ok()) << rung.status();
  EXPECT_TRUE(*rung);
}

TEST(EventFdTest, AdoptAfterPassingOverSocket) {
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  const int fds[] = {bell->fd()};
  ASSERT_TRUE(SendMessage(a.get(), "doorbell", fds).ok());
  auto msg = RecvMessage(b.get());
  ASSERT_TRUE(msg.ok()) << msg.status();
  ASSERT_EQ(msg->fds.size(), 1u);
  auto remote = EventFd::Adopt(std::move(msg->fds[0]));
  ASSERT_TRUE(remote.ok()) << remote.status();

  ASSERT_TRUE(remote->Signal().ok());
  auto rung = bell->Wait(-1);
  ASSERT_TRUE(rung.ok()) << rung.status();
  EXPECT_TRUE(*rung);
}

TEST(EventFdTest, AdoptRejectsOtherFds) {
  auto memfd = CreateMemfd("not-an-eventfd", 4096);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  auto adopted = EventFd::Adopt(*std::move(memfd));
  EXPECT_EQ(adopted.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(EventFdTest, MoveKeepsTheDoorbell) {
  auto bell = EventFd::Create();
  ASSERT_TRUE(bell.ok()) << bell.status();
  const int fd = bell->fd();
  EventFd moved(*std::move(bell));
  EXPECT_EQ(moved.fd(), fd);
  EXPECT_EQ(bell->fd(), -1);  // NOLINT(bugprone-use-after-move): moved-from state is specified
  ASSERT_TRUE(moved.Signal().ok());
  auto rung = moved.Wait(0);
  ASSERT_TRUE(rung.ok());
  EXPECT_TRUE(*rung);
}

}  // namespace
}  // namespace ulysses::ipc
