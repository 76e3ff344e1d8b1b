#include "ulysses/ipc/fd.h"

#include <fcntl.h>
#include <unistd.h>

#include <utility>

#include "gtest/gtest.h"

namespace ulysses::ipc {
namespace {

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

int OpenDevNull() { return ::open("/dev/null", O_RDONLY | O_CLOEXEC); }

TEST(UniqueFdTest, DefaultOwnsNothing) {
  UniqueFd fd;
  EXPECT_FALSE(fd.valid());
  EXPECT_EQ(fd.get(), -1);
  UniqueFd negative(-5);
  EXPECT_FALSE(negative.valid());
  EXPECT_EQ(negative.get(), -1);
}

TEST(UniqueFdTest, ClosesOnDestruction) {
  int raw = OpenDevNull();
  ASSERT_GE(raw, 0);
  {
    UniqueFd fd(raw);
    EXPECT_TRUE(fd.valid());
    EXPECT_EQ(fd.get(), raw);
    EXPECT_TRUE(IsOpen(raw));
  }
  EXPECT_FALSE(IsOpen(raw));
}

TEST(UniqueFdTest, ReleaseGivesUpOwnership) {
  int raw = OpenDevNull();
  ASSERT_GE(raw, 0);
  {
    UniqueFd fd(raw);
    EXPECT_EQ(fd.release(), raw);
    EXPECT_FALSE(fd.valid());
  }
  EXPECT_TRUE(IsOpen(raw));
  ::close(raw);
}

TEST(UniqueFdTest, ResetClosesPrevious) {
  int a = OpenDevNull();
  int b = OpenDevNull();
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  UniqueFd fd(a);
  fd.reset(b);
  EXPECT_FALSE(IsOpen(a));
  EXPECT_EQ(fd.get(), b);
  fd.reset(b);  // same descriptor: no-op
  EXPECT_TRUE(IsOpen(b));
  fd.reset();
  EXPECT_FALSE(IsOpen(b));
  EXPECT_FALSE(fd.valid());
}

TEST(UniqueFdTest, MoveTransfersOwnership) {
  int a = OpenDevNull();
  int b = OpenDevNull();
  ASSERT_GE(a, 0);
  ASSERT_GE(b, 0);
  UniqueFd first(a);
  UniqueFd second(std::move(first));
  EXPECT_FALSE(first.valid());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(second.get(), a);

  UniqueFd third(b);
  third = std::move(second);
  EXPECT_FALSE(IsOpen(b));
  EXPECT_EQ(third.get(), a);
  EXPECT_TRUE(IsOpen(a));
}

}  // namespace
}  // namespace ulysses::ipc
