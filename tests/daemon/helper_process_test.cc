// HelperProcess: a child that answers one line and lives until its standard input closes, on
// every path reaped; and ulyssesd's own NCCL bootstrap-root helper mode.
#include "helper_process.h"

#include <signal.h>
#include <sys/wait.h>

#include <cerrno>

#include "gtest/gtest.h"
#include "proc_util.h"
#include "transport.h"

namespace ulysses::daemon {
namespace {

// True while `pid` is a child of this process not yet reaped (or any process at all).
bool Exists(pid_t pid) { return kill(pid, 0) == 0 || errno != ESRCH; }

std::vector<std::string> Sh(const std::string& script) { return {"/bin/sh", "-c", script}; }

TEST(HelperProcessTest, AnswersItsFirstLineAndEndsWhenItsInputCloses) {
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start(Sh("echo 'ok 1234'; echo more; cat >/dev/null; exit 0"),
                           absl::Seconds(20));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->answer(), "ok 1234");
  const pid_t pid = h->pid();
  EXPECT_TRUE(h->running());
  EXPECT_TRUE(Exists(pid));
  h->Stop();
  EXPECT_FALSE(h->running());
  EXPECT_FALSE(Exists(pid)) << "the helper was not reaped";
  h->Stop();  // idempotent
}

TEST(HelperProcessTest, OneThatExitsBeforeAnsweringIsAnErrorWithItsStatusAndIsReaped) {
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start(Sh("printf 'half a line'; exit 3"), absl::Seconds(20));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(h.status().message().find("exited with status 3"), std::string::npos) << h.status();
  EXPECT_NE(h.status().message().find("half a line"), std::string::npos) << h.status();
  EXPECT_TRUE(testing_util::ChildrenOf(getpid()).empty()) << "a child was left unreaped";
}

TEST(HelperProcessTest, OneThatDoesNotAnswerInTimeIsKilledAndReaped) {
  absl::StatusOr<HelperProcess> h = HelperProcess::Start(Sh("exec sleep 60"), absl::Milliseconds(200));
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(h.status().message().find("/bin/sh"), std::string::npos) << h.status();
  EXPECT_TRUE(testing_util::ChildrenOf(getpid()).empty()) << "a child was left unreaped";
}

TEST(HelperProcessTest, OneThatIgnoresItsClosedInputIsKilledAfterTheGrace) {
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start(Sh("echo ok; exec sleep 60"), absl::Seconds(20));
  ASSERT_TRUE(h.ok()) << h.status();
  const pid_t pid = h->pid();
  h->Stop(absl::Milliseconds(50));
  EXPECT_FALSE(Exists(pid));
}

TEST(HelperProcessTest, AProgramThatCannotStartIsAnErrorNamingIt) {
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start({"/nonexistent/helper"}, absl::Seconds(1));
  ASSERT_FALSE(h.ok());
  EXPECT_NE(h.status().message().find("/nonexistent/helper"), std::string::npos) << h.status();
  EXPECT_EQ(HelperProcess::Start({}, absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HelperProcessTest, MovedTheChildGoesWithTheObject) {
  absl::StatusOr<HelperProcess> h = HelperProcess::Start(Sh("echo ok; cat >/dev/null"),
                                                         absl::Seconds(20));
  ASSERT_TRUE(h.ok()) << h.status();
  const pid_t pid = h->pid();
  HelperProcess moved = std::move(*h);
  EXPECT_FALSE(h->running());
  EXPECT_EQ(moved.pid(), pid);
  HelperProcess other;
  other = std::move(moved);
  EXPECT_TRUE(Exists(pid));
  other = HelperProcess();  // stops it
  EXPECT_FALSE(Exists(pid));
}

// ulyssesd --nccl-root-helper: an NCCL unique id in hex (NCCL makes one without a GPU), its
// bootstrap root listening on a TCP socket in the helper until the helper's input closes.
TEST(NcclRootHelperTest, AnswersAUniqueIdAndListensUntilStopped) {
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start({ULYSSESD_PATH, kNcclRootHelperArg}, absl::Seconds(30));
  ASSERT_TRUE(h.ok()) << h.status();
  if (h->answer() == "error this build has no NCCL") GTEST_SKIP() << "this build has no NCCL";
  ASSERT_EQ(h->answer().rfind("ok ", 0), 0u) << h->answer();
  const std::string hex = h->answer().substr(3);
  EXPECT_EQ(hex.size(), 256u);
  EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
  EXPECT_EQ(testing_util::ListeningTcpSockets(h->pid()), 1);
  const pid_t pid = h->pid();
  h->Stop();
  EXPECT_FALSE(Exists(pid));
}

}  // namespace
}  // namespace ulysses::daemon
