// The control socket's connection gate (daemon/src/connection_gate.h) on its own: what it
// admits reaches the gRPC server, what it refuses is closed before anything is sent, and
// every admitted connection's place is given back once, when the connection ends or the gate
// stops.
#include "connection_gate.h"

#include <poll.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <string>

#include "absl/time/clock.h"
#include "../util/peer_close.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/v1/admin.grpc.pb.h"

namespace ulysses::daemon {
namespace {

bool Eventually(const std::function<bool()>& f) {
  const absl::Time until = absl::Now() + absl::Seconds(20);
  while (absl::Now() < until) {
    if (f()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return f();
}

// Admin with ListClients alone, which records the peer gRPC names for the call.
class PeerRecorder final : public v1::Admin::Service {
 public:
  grpc::Status ListClients(grpc::ServerContext* ctx, const v1::ListClientsRequest*,
                           v1::ListClientsResponse*) override {
    std::lock_guard<std::mutex> lock(mu_);
    peer_ = ctx->peer();
    return grpc::Status::OK;
  }
  std::string peer() {
    std::lock_guard<std::mutex> lock(mu_);
    return peer_;
  }

 private:
  std::mutex mu_;
  std::string peer_;
};

class ConnectionGateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "gate-" + std::to_string(::getpid());
    ::mkdir(dir_.c_str(), 0700);
    path_ = dir_ + "/s";
    grpc::ServerBuilder builder;
    builder.RegisterService(&admin_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    absl::StatusOr<ipc::UnixListener> listener = ipc::UnixListener::Listen(path_, 0600);
    ASSERT_TRUE(listener.ok()) << listener.status();
    ASSERT_TRUE(gate_
                    .Start(
                        *std::move(listener), server_.get(),
                        [this](uid_t uid) {
                          std::lock_guard<std::mutex> lock(mu_);
                          if (held_ >= limit_) return absl::ResourceExhaustedError("full");
                          ++held_;
                          ++admitted_[uid];
                          return absl::OkStatus();
                        },
                        [this](uid_t) {
                          std::lock_guard<std::mutex> lock(mu_);
                          --held_;
                          ++ended_;
                        })
                    .ok());
  }
  void TearDown() override {
    gate_.Stop();
    server_->Shutdown(std::chrono::system_clock::now());
    ::rmdir(dir_.c_str());
  }
  // A stub on a channel of its own to the gate's socket.
  std::unique_ptr<v1::Admin::Stub> NewStub() {
    return v1::Admin::NewStub(
        grpc::CreateChannel("unix://" + path_, grpc::InsecureChannelCredentials()));
  }
  int held() {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }
  int ended() {
    std::lock_guard<std::mutex> lock(mu_);
    return ended_;
  }
  int admitted(uid_t uid) {
    std::lock_guard<std::mutex> lock(mu_);
    return admitted_[uid];
  }

  std::string dir_, path_;
  PeerRecorder admin_;  // other methods unimplemented: an answer is what is asked for
  std::unique_ptr<grpc::Server> server_;
  ConnectionGate gate_;
  std::mutex mu_;
  int limit_ = 2, held_ = 0, ended_ = 0;
  std::map<uid_t, int> admitted_;
};

TEST_F(ConnectionGateTest, AdmittedConnectionsAreServedAndTheRestClosed) {
  auto stub = NewStub();
  v1::DaemonState st;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  // Served by the server through the gate: the method's own answer, not a transport error.
  EXPECT_EQ(stub->GetState(&ctx, {}, &st).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(held(), 1);
  EXPECT_EQ(admitted(::geteuid()), 1);  // its uid, from the socket
  absl::StatusOr<ipc::UniqueFd> second = ipc::ConnectUnix(path_, absl::Seconds(5));
  ASSERT_TRUE(second.ok());
  EXPECT_FALSE(ClosedByPeer(second->get(), absl::Milliseconds(300)));
  EXPECT_EQ(held(), 2);
  absl::StatusOr<ipc::UniqueFd> third = ipc::ConnectUnix(path_, absl::Seconds(5));
  ASSERT_TRUE(third.ok());
  EXPECT_TRUE(ClosedByPeer(third->get(), absl::Seconds(10)));
  EXPECT_EQ(gate_.size(), 2u);
  // The second hangs up: its place comes back, once.
  second->reset();
  EXPECT_TRUE(Eventually([&] { return held() == 1; }));
  EXPECT_EQ(ended(), 1);
  EXPECT_EQ(gate_.size(), 1u);
}

TEST_F(ConnectionGateTest, StopGivesBackEveryPlaceAndRefusesNewConnections) {
  absl::StatusOr<ipc::UniqueFd> a = ipc::ConnectUnix(path_, absl::Seconds(5));
  absl::StatusOr<ipc::UniqueFd> b = ipc::ConnectUnix(path_, absl::Seconds(5));
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_TRUE(Eventually([&] { return held() == 2; }));
  gate_.Stop();
  EXPECT_EQ(held(), 0);
  EXPECT_EQ(ended(), 2);
  EXPECT_EQ(gate_.size(), 0u);
  EXPECT_FALSE(ipc::ConnectUnix(path_, absl::Seconds(1)).ok());
  gate_.Stop();  // idempotent
  EXPECT_EQ(ended(), 2);
}

TEST_F(ConnectionGateTest, ACallsPeerNamesTheUidOfItsConnection) {
  auto stub = NewStub();
  v1::ListClientsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  ASSERT_TRUE(stub->ListClients(&ctx, {}, &resp).ok());
  const std::string peer = admin_.peer();
  EXPECT_EQ(peer.rfind("fd:", 0), 0u) << peer;
  EXPECT_EQ(gate_.UidOfPeer(peer), std::optional<uid_t>(::geteuid())) << peer;
  for (const char* other :
       {"", "unix:/x", "fd:", "fd:12x", "fd:-1", "fd:999999", "ipv4:1.2.3.4:5"})
    EXPECT_EQ(gate_.UidOfPeer(other), std::nullopt) << other;
}

}  // namespace
}  // namespace ulysses::daemon
