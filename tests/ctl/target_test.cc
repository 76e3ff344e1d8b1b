#include "ulyssesctl/target.h"

#include <unistd.h>

#include <filesystem>
#include <string>

#include "gtest/gtest.h"

namespace ulysses::ctl {
namespace {

TEST(SocketTest, FlagThenEnvironmentThenDefault) {
  EXPECT_EQ(ChooseSocket("/a.sock", "/b.sock"), "/a.sock");
  EXPECT_EQ(ChooseSocket("", "/b.sock"), "/b.sock");
  EXPECT_EQ(ChooseSocket("", ""), "/run/ulysses/gpu0.sock");
  EXPECT_EQ(ChooseSocket("", nullptr), "/run/ulysses/gpu0.sock");
}

TEST(SocketTest, AbsolutePathBecomesUnixTarget) {
  const DaemonAddress a = ResolveSocket("/run/ulysses/gpu0.sock");
  EXPECT_EQ(a.target, "unix:///run/ulysses/gpu0.sock");
  EXPECT_EQ(a.display, "/run/ulysses/gpu0.sock");
  EXPECT_EQ(a.path, "/run/ulysses/gpu0.sock");
}

TEST(SocketTest, RelativePathIsMadeAbsolute) {
  const std::string cwd = std::filesystem::current_path().string();
  const DaemonAddress a = ResolveSocket("sub/../d.sock");
  EXPECT_EQ(a.path, (std::filesystem::path(cwd) / "d.sock").string());
  EXPECT_EQ(a.target, "unix://" + a.path);
  EXPECT_EQ(a.display, a.path);
}

TEST(SocketTest, UnixTargetsAreKeptAsGiven) {
  DaemonAddress a = ResolveSocket("unix:/tmp/x.sock");
  EXPECT_EQ(a.target, "unix:/tmp/x.sock");
  EXPECT_EQ(a.display, "unix:/tmp/x.sock");
  EXPECT_EQ(a.path, "/tmp/x.sock");
  a = ResolveSocket("unix:///tmp/y.sock");
  EXPECT_EQ(a.target, "unix:///tmp/y.sock");
  EXPECT_EQ(a.path, "/tmp/y.sock");
  a = ResolveSocket("unix:rel.sock");
  EXPECT_EQ(a.target, "unix:rel.sock");
  EXPECT_EQ(a.path, "rel.sock");
  a = ResolveSocket("unix-abstract:ulysses");
  EXPECT_EQ(a.target, "unix-abstract:ulysses");
  EXPECT_EQ(a.path, "");
}

TEST(UnreachableTest, TellsTransportFailureFromDaemonError) {
  EXPECT_TRUE(IsUnreachable(grpc::StatusCode::DEADLINE_EXCEEDED, GRPC_CHANNEL_READY));
  EXPECT_TRUE(IsUnreachable(grpc::StatusCode::UNAVAILABLE, GRPC_CHANNEL_TRANSIENT_FAILURE));
  EXPECT_TRUE(IsUnreachable(grpc::StatusCode::UNAVAILABLE, GRPC_CHANNEL_IDLE));
  EXPECT_TRUE(IsUnreachable(grpc::StatusCode::UNAVAILABLE, GRPC_CHANNEL_CONNECTING));
  // A draining daemon answers UNAVAILABLE over a connected channel.
  EXPECT_FALSE(IsUnreachable(grpc::StatusCode::UNAVAILABLE, GRPC_CHANNEL_READY));
  EXPECT_FALSE(IsUnreachable(grpc::StatusCode::FAILED_PRECONDITION, GRPC_CHANNEL_READY));
  EXPECT_FALSE(IsUnreachable(grpc::StatusCode::UNIMPLEMENTED, GRPC_CHANNEL_READY));
}

TEST(UnreachableTest, ReasonNamesTheSocketProblem) {
  const grpc::Status unavailable(grpc::StatusCode::UNAVAILABLE, "failed to connect");
  EXPECT_EQ(UnreachableReason(ResolveSocket("/nonexistent/ulyssesctl.sock"), unavailable, 100),
            "No such file or directory");

  char dir_template[] = "/tmp/ulyssesctl_target_test.XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::filesystem::path dir = dir_template;
  const std::filesystem::path file = dir / "plain";
  { std::FILE* f = std::fopen(file.c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  EXPECT_EQ(UnreachableReason(ResolveSocket(file.string()), unavailable, 100), "not a socket");
  std::filesystem::remove_all(dir);

  const DaemonAddress abstract = ResolveSocket("unix-abstract:x");
  EXPECT_EQ(UnreachableReason(abstract, grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "d"), 250),
            "no answer within 250 ms");
  EXPECT_EQ(UnreachableReason(
                abstract,
                grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "failed to connect to all addresses; last error: UNAVAILABLE: "
                             "unix:/x: Connection refused"),
                100),
            "Connection refused");
  EXPECT_EQ(UnreachableReason(abstract, grpc::Status(grpc::StatusCode::UNAVAILABLE, "a\nb"), 100),
            "a b");
}

}  // namespace
}  // namespace ulysses::ctl
