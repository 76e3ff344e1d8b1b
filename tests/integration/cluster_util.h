// Helpers shared by the integration tests: stubs of a daemon's services and bounded polling
// of conditions the daemon reaches asynchronously.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

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

/// Polls `cond` until it holds or 20 s pass; returns its last value. For state the daemon
/// reaches on its own (reclaim after a client dies), never as a readiness sleep.
template <typename F>
bool Eventually(F cond) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return cond();
}

}  // namespace ulysses::testing_util
