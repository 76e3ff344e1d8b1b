// Helpers shared by the integration tests: stubs of a daemon's services and bounded polling
// of conditions the daemon reaches asynchronously.
#pragma once

#include <chrono>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"
#include "demo_lib.h"
#include "gtest/gtest.h"
#include "ulysses/client/client.h"
#include "ulysses/common/sockets.h"

namespace ulysses::testing_util {

inline std::shared_ptr<grpc::Channel> ChannelTo(const std::string& socket) {
  return grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials());
}
inline std::unique_ptr<v1::Admin::Stub> AdminStub(const std::string& socket) {
  return v1::Admin::NewStub(ChannelTo(socket));
}
inline std::unique_ptr<v1::Control::Stub> ControlStub(const std::string& socket) {
  return v1::Control::NewStub(ChannelTo(socket));
}

/// Polls `cond` until it holds or `limit` passes; returns its last value. For state the daemon
/// reaches on its own (reclaim after a client dies), never as a readiness sleep.
template <typename F>
bool Eventually(F cond, absl::Duration limit = absl::Seconds(20)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

/// Fixture: n real daemons (host backend) in a fresh run directory, stopped in TearDown.
/// The ulyssesd the tests start: $ULYSSESD when set (a build copied to another machine), else
/// the one this build made.
inline std::string UlyssesdPath() {
  const char* e = std::getenv("ULYSSESD");
  return e != nullptr && *e != '\0' ? e : ULYSSESD_PATH;
}

class ClusterTest : public ::testing::Test {
 protected:
  void TearDown() override {
    daemons_.clear();  // SIGTERM each daemon
    if (!dir_.empty()) demo::RemoveRunDir(dir_);
  }

  void Start(int n, std::vector<std::string> extra = {}) {
    auto dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    for (int r = 0; r < n; ++r) {
      auto d = demo::StartDaemon(UlyssesdPath(), dir_, r, backend_, extra, absl::Seconds(30),
                                 env_ ? env_(r) : std::vector<std::string>{});
      ASSERT_TRUE(d.ok()) << d.status();
      daemons_.push_back(std::move(*d));
    }
  }

  std::vector<std::string> Members(int n) const {
    std::vector<std::string> m;
    for (int r = 0; r < n; ++r) m.push_back(daemons_[r].socket());
    return m;
  }

  std::unique_ptr<v1::Admin::Stub> Admin(int r) { return AdminStub(daemons_[r].socket()); }
  /// Admin on rank `r`'s operator socket, where Drain and Undrain are allowed.
  std::unique_ptr<v1::Admin::Stub> Operator(int r) {
    return AdminStub(daemons_[r].socket() + std::string(kOperatorSocketSuffix));
  }

  std::string backend_ = "host";  // what Start asks every daemon for
  /// Extra environment ("NAME=value") of rank r's daemon, when set.
  std::function<std::vector<std::string>(int)> env_;

  v1::DaemonState State(int r) {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(r)->GetState(&ctx, {}, &st).ok());
    return st;
  }

  std::vector<v1::ClientState> ListClients(int r) {
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(r)->ListClients(&ctx, {}, &resp).ok());
    return {resp.clients().begin(), resp.clients().end()};
  }

  int NumSessions(int r) {
    v1::ListSessionsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(r)->ListSessions(&ctx, {}, &resp).ok());
    return resp.sessions_size();
  }

  std::unique_ptr<client::Client> Connect(int r, const std::string& name) {
    auto c = client::Client::Connect({daemons_[r].socket(), name, absl::Seconds(10)});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::string dir_;
  std::vector<demo::DaemonProcess> daemons_;
};

}  // namespace ulysses::testing_util
