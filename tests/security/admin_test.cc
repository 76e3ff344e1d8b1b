// Admin calls that change the daemon's state need the operator socket: anyone who can reach
// the control socket (mode 0660, the clients' group) could drain the daemon before. Server
// reflection is there alone too.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "grpcpp/generic/generic_stub.h"
#include "hostile_client.h"
#include "ulysses/common/sockets.h"

namespace ulysses::security {
namespace {

// Sends one server reflection request (list_services) on `socket` and returns the answer's
// bytes, or the call's status when there is none.
absl::StatusOr<std::string> ListServicesByReflection(const std::string& socket) {
  grpc::GenericStub stub(
      grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  // One operation at a time: each completes before the next starts.
  auto await = [&cq] {
    void* tag = nullptr;
    bool ok = false;
    return cq.Next(&tag, &ok) && ok;
  };
  call->StartCall(nullptr);
  await();
  // ServerReflectionRequest{list_services: ""}: field 7, length-delimited, empty.
  const char request[] = {0x3a, 0x00};
  grpc::Slice slice(request, sizeof request);
  call->Write(grpc::ByteBuffer(&slice, 1), nullptr);
  await();
  call->WritesDone(nullptr);
  await();
  grpc::ByteBuffer response;
  call->Read(&response, nullptr);
  const bool answered = await();
  grpc::Status status;
  call->Finish(&status, nullptr);
  await();
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
  if (!answered)
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::InternalError("unreadable answer");
  std::string bytes;
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

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
  // The run folder lets others through, so that only the socket's own mode refuses them.
  ASSERT_EQ(::chmod(dir_.c_str(), 0711), 0);
  EXPECT_EQ(ConnectErrnoAs(65534, daemon_.socket()), EACCES)
      << "the control socket (0660, the daemon's group) let uid 65534 in";
  // A process of another uid cannot connect, so it cannot drain.
  EXPECT_EQ(ConnectErrnoAs(65534, OperatorSocket()), EACCES)
      << "uid 65534 could connect to the operator socket";
  EXPECT_FALSE(Draining());
}

// With admin.operator_group the operator socket is 0660 with that group: its members get in,
// others still do not, and the control socket keeps its own mode.
TEST_F(AdminTest, AnOperatorsGroupMayUseTheOperatorSocket) {
  const gid_t operators = 65534;
  StartDaemon({"--operator-group", std::to_string(operators)});
  struct stat st {};
  ASSERT_EQ(::lstat(OperatorSocket().c_str(), &st), 0) << OperatorSocket();
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  EXPECT_EQ(st.st_gid, operators);
  EXPECT_EQ(st.st_uid, ::geteuid());
  auto op = Operator();  // the daemon's uid still drains there
  ASSERT_TRUE(Drain(op.get()).ok());
  ASSERT_TRUE(Undrain(op.get()).ok());
  if (::geteuid() != 0) GTEST_SKIP() << "connecting as a second uid needs root";
  ASSERT_EQ(::chmod(dir_.c_str(), 0711), 0);
  EXPECT_EQ(ConnectErrnoAs(65534, OperatorSocket()), 0)
      << "a member of the operators' group (uid and gid 65534) could not connect";
  EXPECT_EQ(ConnectErrnoAs(65533, OperatorSocket()), EACCES)
      << "uid and gid 65533, outside the group, could connect";
}

TEST_F(AdminTest, AnUnknownOperatorsGroupStopsTheStartNamingIt) {
  daemon_ = demo::DaemonProcess();
  absl::StatusOr<demo::DaemonProcess> d =
      demo::StartDaemon(ULYSSESD_PATH, dir_, 1, "host", {"--operator-group", "no-such-group-x"});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().ToString().find("admin.operator_group (--operator-group): no group named "
                                       "'no-such-group-x'"),
            std::string::npos)
      << d.status();
}

// Server reflection's stream is served by gRPC's synchronous API, a thread for each stream for as
// long as its caller keeps it open: it is on the operator socket alone, where only the daemon's
// uid connects, and not on the control socket, which every client reaches.
TEST_F(AdminTest, ReflectionIsServedOnTheOperatorSocketAlone) {
  absl::StatusOr<std::string> op = ListServicesByReflection(OperatorSocket());
  ASSERT_TRUE(op.ok()) << op.status();
  EXPECT_NE(op->find("ulysses.v1.Admin"), std::string::npos);
  for (const std::string& socket :
       {daemon_.socket(), daemon_.socket() + std::string(kNodeSocketSuffix)}) {
    absl::StatusOr<std::string> other = ListServicesByReflection(socket);
    EXPECT_EQ(other.status().code(), absl::StatusCode::kUnimplemented)
        << socket << ": " << other.status();
  }
  EXPECT_TRUE(Serving());
}

}  // namespace
}  // namespace ulysses::security
