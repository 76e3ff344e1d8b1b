// Admin calls that change the daemon's state need the operator socket: anyone who can reach
// the control socket (mode 0660, the clients' group) could drain the daemon before.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "hostile_client.h"
#include "ulysses/common/sockets.h"

namespace ulysses::security {
namespace {

class AdminTest : public DaemonTest {
 protected:
  std::string OperatorSocket() const {
    return daemon_.socket() + std::string(kOperatorSocketSuffix);
  }
  std::unique_ptr<v1::Admin::Stub> Operator() {
    return v1::Admin::NewStub(
        grpc::CreateChannel("unix://" + OperatorSocket(), grpc::InsecureChannelCredentials()));
  }
  grpc::Status Drain(v1::Admin::Stub* stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::DrainResponse resp;
    return stub->Drain(&ctx, {}, &resp);
  }
  grpc::Status Undrain(v1::Admin::Stub* stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::UndrainResponse resp;
    return stub->Undrain(&ctx, {}, &resp);
  }
  bool Draining() {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return admin_->GetState(&ctx, {}, &st).ok() && st.draining();
  }
};

TEST_F(AdminTest, DrainAndUndrainOnTheControlSocketArePermissionDenied) {
  const grpc::Status drain = Drain(admin_.get());
  EXPECT_EQ(drain.error_code(), grpc::StatusCode::PERMISSION_DENIED) << drain.error_message();
  EXPECT_NE(drain.error_message().find(OperatorSocket()), std::string::npos)
      << drain.error_message();
  EXPECT_FALSE(Draining());
  // New clients are still taken.
  EXPECT_TRUE(Attach("after-refused-drain").ok());
  const grpc::Status undrain = Undrain(admin_.get());
  EXPECT_EQ(undrain.error_code(), grpc::StatusCode::PERMISSION_DENIED);
}

TEST_F(AdminTest, TheOperatorSocketDrainsAndUndrains) {
  auto op = Operator();
  ASSERT_TRUE(Drain(op.get()).ok());
  EXPECT_TRUE(Draining());
  EXPECT_EQ(Attach("during-drain").status().code(), absl::StatusCode::kUnavailable);
  ASSERT_TRUE(Undrain(op.get()).ok());
  EXPECT_FALSE(Draining());
  EXPECT_TRUE(Attach("after-undrain").ok());
  // Read-only calls are served there too.
  v1::DaemonState st;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  EXPECT_TRUE(op->GetState(&ctx, {}, &st).ok());
}

TEST_F(AdminTest, TheOperatorSocketIsTheDaemonsUidAlone) {
  struct stat st {};
  ASSERT_EQ(::lstat(OperatorSocket().c_str(), &st), 0) << OperatorSocket();
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  if (::geteuid() != 0) GTEST_SKIP() << "connecting as a second uid needs root";
  // A process of another uid cannot connect, so it cannot drain. The child makes only system
  // calls (the parent has threads); the address is built before the fork.
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = OperatorSocket();
  ASSERT_LT(path.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) ::_exit(4);
    const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
    ::_exit(rc != 0 && errno == EACCES ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "uid 65534 could connect to the operator socket";
  EXPECT_FALSE(Draining());
}

}  // namespace
}  // namespace ulysses::security
