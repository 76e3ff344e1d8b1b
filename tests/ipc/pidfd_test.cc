#include "ulysses/ipc/pidfd.h"

#include <fcntl.h>
#include <unistd.h>

#include "gtest/gtest.h"
#include "test_util.h"
#include "ulysses/ipc/unix_socket.h"

namespace ulysses::ipc {
namespace {

TEST(PidfdTest, BecomesReadableWhenChildExits) {
  int gate[2];
  ASSERT_EQ(::pipe2(gate, O_CLOEXEC), 0);
  UniqueFd gate_read(gate[0]);
  UniqueFd gate_write(gate[1]);

  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    gate_write.reset();
    char c;
    // Returns 0 (EOF) once the parent closes its write end.
    while (::read(gate_read.get(), &c, 1) < 0 && errno == EINTR) {
    }
    ::_exit(0);
  }
  gate_read.reset();

  auto pidfd = PidfdOpen(pid);
  if (pidfd.status().code() == absl::StatusCode::kUnimplemented) {
    gate_write.reset();
    testing::WaitChild(pid);
    GTEST_SKIP() << pidfd.status();
  }
  ASSERT_TRUE(pidfd.ok()) << pidfd.status();
  EXPECT_TRUE(::fcntl(pidfd->get(), F_GETFD) & FD_CLOEXEC);
  EXPECT_TRUE(ProcessAlive(pid));

  auto running = WaitReadable(pidfd->get(), 0);
  ASSERT_TRUE(running.ok()) << running.status();
  EXPECT_FALSE(*running);

  gate_write.reset();  // lets the child exit
  auto exited = WaitReadable(pidfd->get(), -1);
  ASSERT_TRUE(exited.ok()) << exited.status();
  EXPECT_TRUE(*exited);
  EXPECT_EQ(testing::WaitChild(pid), 0);
  EXPECT_FALSE(ProcessAlive(pid));
}

TEST(PidfdTest, OwnProcessIsAlive) {
  EXPECT_TRUE(ProcessAlive(::getpid()));
  EXPECT_FALSE(ProcessAlive(0));
  EXPECT_FALSE(ProcessAlive(-1));
  auto self = PidfdOpen(::getpid());
  if (self.status().code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << self.status();
  ASSERT_TRUE(self.ok()) << self.status();
  auto readable = WaitReadable(self->get(), 0);
  ASSERT_TRUE(readable.ok());
  EXPECT_FALSE(*readable);
}

TEST(PidfdTest, BadPids) {
  EXPECT_EQ(PidfdOpen(0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PidfdOpen(-3).status().code(), absl::StatusCode::kInvalidArgument);

  // A reaped child's pid names no process (until the kernel reuses it, which it does not do
  // right away: pids are handed out in increasing order).
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) ::_exit(0);
  ASSERT_EQ(testing::WaitChild(pid), 0);
  auto gone = PidfdOpen(pid);
  if (gone.status().code() == absl::StatusCode::kUnimplemented) GTEST_SKIP() << gone.status();
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
}

}  // namespace
}  // namespace ulysses::ipc
