// LineProcess: a child driven by lines on its stdin and stdout ends on every path, answers in
// order, and a silent, gone or stubborn child is an error, not a hang or a signal.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

#include "bench_util.h"
#include "fd_count.h"
#include "gtest/gtest.h"

namespace ulysses::bench {
namespace {

// Echoes "got <line>" for every line; exits 3 on "quit".
const std::vector<std::string> kEcho = {
    "/bin/sh", "-c", "while read l; do [ \"$l\" = quit ] && exit 3; echo \"got $l\"; done"};

TEST(LineProcess, AnswersInOrderAndQuitsWhenAsked) {
  LineProcess p;
  ASSERT_TRUE(p.Start(kEcho).ok());
  ASSERT_TRUE(p.Send("a").ok());
  ASSERT_TRUE(p.Send("b c").ok());
  absl::StatusOr<std::string> first = p.ReadLine(absl::Seconds(30));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(*first, "got a");
  absl::StatusOr<std::string> second = p.ReadLine(absl::Seconds(30));
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second, "got b c");
  const int status = p.Stop("quit");
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 3);
  EXPECT_EQ(p.pid(), -1);
  EXPECT_EQ(p.Stop(), -1) << "a second Stop has no child";
}

TEST(LineProcess, ASilentChildIsADeadlineNotAHang) {
  LineProcess p;
  ASSERT_TRUE(p.Start(kEcho).ok());
  absl::StatusOr<std::string> line = p.ReadLine(absl::Milliseconds(50));
  EXPECT_EQ(line.status().code(), absl::StatusCode::kDeadlineExceeded);
  // It still answers afterwards: nothing was lost.
  ASSERT_TRUE(p.Send("late").ok());
  line = p.ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "got late");
}

TEST(LineProcess, AChildThatEndedIsAnErrorOnReadAndOnSend) {
  LineProcess p;
  ASSERT_TRUE(p.Start({"/bin/sh", "-c", "echo last; exit 0"}).ok());
  absl::StatusOr<std::string> line = p.ReadLine(absl::Seconds(30));
  ASSERT_TRUE(line.ok()) << line.status();
  EXPECT_EQ(*line, "last");
  line = p.ReadLine(absl::Seconds(30));
  EXPECT_EQ(line.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(line.status().message()).find("ended"), std::string::npos);
  // Its stdin's reader is gone: EPIPE, reported, and this process is not killed by SIGPIPE.
  absl::Status sent;
  for (int i = 0; i < 64 && sent.ok(); ++i) sent = p.Send(std::string(4096, 'x'));
  EXPECT_EQ(sent.code(), absl::StatusCode::kInternal);
}

TEST(LineProcess, AChildThatIgnoresQuitIsKilledAfterTheGrace) {
  LineProcess p;
  ASSERT_TRUE(p.Start({"/bin/sh", "-c", "trap '' TERM; exec sleep 1000"}).ok());
  const int status = p.Stop("quit", absl::Milliseconds(20));
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGKILL);
}

TEST(LineProcess, AProgramThatCannotRunIsAnErrorNamingIt) {
  LineProcess p;
  absl::Status st = p.Start({"/nonexistent/program"});
  // posix_spawn reports the exec failure (glibc), or the child exits 127 at once.
  if (st.ok()) {
    const int status = p.Stop();
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 127);
  } else {
    EXPECT_NE(std::string(st.message()).find("/nonexistent/program"), std::string::npos);
  }
  EXPECT_FALSE(p.Start({}).ok()) << "an empty argv";
}

TEST(LineProcess, LeavesNoDescriptorBehind) {
  const int before = CountFdsButPipes(::getpid());
  for (int i = 0; i < 8; ++i) {
    LineProcess p;
    ASSERT_TRUE(p.Start(kEcho).ok());
    ASSERT_TRUE(p.Send("x").ok());
    ASSERT_TRUE(p.ReadLine(absl::Seconds(30)).ok());
  }  // destroyed without Stop: the destructor ends it
  EXPECT_EQ(CountFdsButPipes(::getpid()), before);
  // Pipes too: count every descriptor.
  int all = 0;
  for (int fd = 0; fd < 1024; ++fd)
    if (::fcntl(fd, F_GETFD) != -1) ++all;
  LineProcess p;
  ASSERT_TRUE(p.Start(kEcho).ok());
  p.Stop();
  int after = 0;
  for (int fd = 0; fd < 1024; ++fd)
    if (::fcntl(fd, F_GETFD) != -1) ++after;
  EXPECT_EQ(after, all);
}

}  // namespace
}  // namespace ulysses::bench
