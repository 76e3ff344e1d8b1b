// HelperProcess: a child that answers one line and lives until its standard input closes, on
// every path reaped; and ulyssesd's own NCCL bootstrap-root helper mode.
#include "helper_process.h"

#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdint>
#include <string>

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
      HelperProcess::Start(Sh("echo 'ok 1234'; cat >/dev/null; exit 7"), absl::Seconds(20));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->answer(), "ok 1234");
  const pid_t pid = h->pid();
  EXPECT_TRUE(h->running());
  EXPECT_TRUE(Exists(pid));
  // It ends on its own once its input closes (the status is its own, not a kill's), well
  // within a grace that ctest's timeout alone bounds.
  const int status = h->Stop(absl::Seconds(60));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 7) << "wait status " << status;
  EXPECT_FALSE(h->running());
  EXPECT_FALSE(Exists(pid)) << "the helper was not reaped";
  EXPECT_EQ(h->Stop(), -1);  // idempotent
}

// The daemon blocks its stop signals and ignores SIGPIPE; a helper starts with neither.
TEST(HelperProcessTest, AHelperStartsWithNoSignalBlockedAndSigpipeAtItsDefault) {
  sigset_t block, old;
  sigemptyset(&block);
  sigaddset(&block, SIGTERM);
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &block, &old), 0);
  struct sigaction ignore {}, old_pipe {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGPIPE, &ignore, &old_pipe), 0);
  // SigBlk and SigIgn of /proc/self/status, in hex: SIGTERM is bit 14, SIGPIPE bit 12.
  absl::StatusOr<HelperProcess> h = HelperProcess::Start(
      Sh("echo \"$(grep -E '^Sig(Blk|Ign)' /proc/self/status | tr -d '\\t\\n ')\"; cat >/dev/null"),
      absl::Seconds(20));
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  sigaction(SIGPIPE, &old_pipe, nullptr);
  ASSERT_TRUE(h.ok()) << h.status();
  const std::string& line = h->answer();
  const size_t blk = line.find("SigBlk:"), ign = line.find("SigIgn:");
  ASSERT_NE(blk, std::string::npos) << line;
  ASSERT_NE(ign, std::string::npos) << line;
  const uint64_t blocked = std::stoull(line.substr(blk + 7, 16), nullptr, 16);
  const uint64_t ignored = std::stoull(line.substr(ign + 7, 16), nullptr, 16);
  EXPECT_EQ(blocked & (uint64_t{1} << (SIGTERM - 1)), 0u) << line;
  EXPECT_EQ(ignored & (uint64_t{1} << (SIGPIPE - 1)), 0u) << line;
  h->Stop();
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
  absl::StatusOr<HelperProcess> h =
      HelperProcess::Start(Sh("exec sleep 60"), absl::Milliseconds(200));
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
