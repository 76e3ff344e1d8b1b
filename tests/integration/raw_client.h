// A client that speaks the Control protocol by hand (attach, fd socket, rings), for tests that
// send what the library never would, so that the daemon's own verdict is what they check.
#pragma once

#include <memory>
#include <string>

#include "cluster_util.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/doorbell.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses::testing_util {

struct RawClient {
  std::unique_ptr<v1::Control::Stub> stub;
  uint64_t id = 0;
  std::string token;
  ipc::UniqueFd fd_socket;
  ipc::Mapping segment;
  ipc::ClientSegmentHeader* header = nullptr;
  ipc::SubmitRing* submit = nullptr;
  ipc::CompletionRing* complete = nullptr;
  ipc::Doorbell submit_bell, complete_bell;

  void Prepare(grpc::ClientContext* ctx) {
    ctx->AddMetadata("ulysses-client-id", std::to_string(id));
    ctx->AddMetadata("ulysses-token", token);
  }
  absl::Status Connect(const std::string& socket) {
    stub = testing_util::ControlStub(socket);
    v1::AttachResponse a;
    grpc::ClientContext ctx;
    if (!stub->Attach(&ctx, {}, &a).ok()) return absl::UnavailableError("attach");
    id = a.client_id();
    token = a.token();
    auto sock = ipc::ConnectUnix(a.fd_socket());
    if (!sock.ok()) return sock.status();
    fd_socket = std::move(*sock);
    nlohmann::json hello = {{"client_id", id}, {"token", token}};
    if (auto s = ipc::SendMessage(fd_socket.get(), hello.dump()); !s.ok()) return s;
    auto ack = ipc::RecvMessage(fd_socket.get());
    if (!ack.ok()) return ack.status();
    if (ack->fds.size() != 3) return absl::InternalError("no rings in the ack");
    auto m = ipc::Mapping::Map(ack->fds[0].get(), ipc::ClientSegmentLayout::kTotal, true);
    if (!m.ok()) return m.status();
    segment = std::move(*m);
    auto* base = static_cast<uint8_t*>(segment.data());
    header = reinterpret_cast<ipc::ClientSegmentHeader*>(base);
    submit = *ipc::SubmitRing::Attach(base + ipc::ClientSegmentLayout::kSubmit, sizeof(ipc::SubmitRing));
    complete = *ipc::CompletionRing::Attach(base + ipc::ClientSegmentLayout::kComplete,
                                            sizeof(ipc::CompletionRing));
    submit_bell = *ipc::Doorbell::Adopt(std::move(ack->fds[1]));
    complete_bell = *ipc::Doorbell::Adopt(std::move(ack->fds[2]));
    return absl::OkStatus();
  }
  uint64_t Alloc(uint64_t bytes, ipc::Mapping* map) {
    v1::AllocBufferRequest req;
    req.set_size_bytes(bytes);
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    EXPECT_TRUE(stub->AllocBuffer(&ctx, req, &info).ok());
    auto frame = ipc::RecvMessage(fd_socket.get());
    EXPECT_TRUE(frame.ok());
    *map = std::move(*ipc::Mapping::Map(frame->fds[0].get(), bytes, true));
    return info.buffer_id();
  }
  // Joins a one-rank group (once) and creates a session; maps its segment read-only.
  uint64_t Session(const std::string& socket, ipc::Mapping* seg) {
    if (group == 0) {
      v1::JoinGroupRequest j;
      j.set_name(StrCat("raw-", id));
      j.set_world_size(1);
      j.add_members(socket);
      v1::GroupInfo gi;
      grpc::ClientContext ctx;
      Prepare(&ctx);
      EXPECT_TRUE(stub->JoinGroup(&ctx, j, &gi).ok());
      group = gi.group_id();
    }
    v1::CreateSessionRequest req;
    req.set_group_id(group);
    req.mutable_spec()->set_num_heads(4);
    req.mutable_spec()->set_head_dim(8);
    req.mutable_spec()->set_dtype(v1::DTYPE_FLOAT32);
    req.mutable_spec()->set_max_tokens(16);
    req.mutable_spec()->set_num_slots(2);
    v1::SessionInfo info;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    EXPECT_TRUE(stub->CreateSession(&ctx, req, &info).ok());
    auto frame = ipc::RecvMessage(fd_socket.get());
    EXPECT_TRUE(frame.ok());
    *seg = std::move(*ipc::Mapping::Map(frame->fds[0].get(), info.segment_bytes(), false));
    v1::PoisonSlotsRequest p;
    p.set_session_id(info.session_id());
    v1::PoisonSlotsResponse pr;
    grpc::ClientContext pctx;
    Prepare(&pctx);
    EXPECT_TRUE(stub->PoisonSlots(&pctx, p, &pr).ok());
    return info.session_id();
  }
  ipc::Completion Roundtrip(const ipc::CallDescriptor& d) {
    EXPECT_TRUE(*submit->TryPush(d));
    EXPECT_TRUE(submit_bell.Signal().ok());
    ipc::Completion c{};
    auto got = ipc::PopWait(*complete, &c, complete_bell, absl::Now() + absl::Seconds(20));
    EXPECT_TRUE(got.ok() && *got) << "no completion";
    return c;
  }
  uint64_t group = 0;
};

}  // namespace ulysses::testing_util
