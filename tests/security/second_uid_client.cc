// Hostile input from a process of its own, which the security tests run as another uid than
// the daemon's:
//   second_uid_client SOCKET
// Attaches, sends every malformed hello of the fd socket (each must be refused), binds with a
// correct one, sends every malformed frame of a bound client, then Control requests that must
// each be refused (bad buffers, groups, sessions, calls, and another client's token), and at
// last registers a buffer through a correct frame. Exits 0 when the daemon refused and dropped
// each and still served this client; otherwise it says what went wrong on stderr and exits 1.
#include <cstdio>
#include <span>
#include <string>

#include "grpcpp/grpcpp.h"
#include "hostile_frames.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/frames.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/v1/control.grpc.pb.h"

using namespace ulysses;

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "second_uid_client: %s\n", what.c_str());
  return 1;
}

void Deadline(grpc::ClientContext* ctx) {
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
}

// Whether the daemon refused a hello on `sock`: an error frame without descriptors, or the
// socket closed. Empty when it did; what it did instead otherwise.
std::string Refused(int sock) {
  absl::StatusOr<bool> ready = ipc::WaitReadable(sock, 20000);
  if (!ready.ok() || !*ready) return "no answer within 20 s";
  absl::StatusOr<ipc::ReceivedMessage> answer = ipc::RecvMessage(sock);
  if (!answer.ok()) return "";  // closed
  if (answer->payload.find("false") == std::string::npos) return "accepted: " + answer->payload;
  if (!answer->fds.empty()) return "refused, with descriptors";
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return Fail("usage: second_uid_client SOCKET");
  const std::string socket = argv[1];
  auto stub = v1::Control::NewStub(
      grpc::CreateChannel("unix://" + socket, grpc::InsecureChannelCredentials()));
  v1::AttachResponse attached;
  {
    grpc::ClientContext ctx;
    Deadline(&ctx);
    v1::AttachRequest req;
    req.set_client_name("hostile-other-uid");
    grpc::Status s = stub->Attach(&ctx, req, &attached);
    if (!s.ok()) return Fail("attach: " + s.error_message());
  }
  int refused = 0;
  for (const std::string& hello : security::MalformedHellos(attached.client_id(), attached.token())) {
    absl::StatusOr<ipc::UniqueFd> sock = ipc::ConnectUnix(attached.fd_socket());
    if (!sock.ok()) return Fail("fd socket: " + sock.status().ToString());
    if (!ipc::SendMessage(sock->get(), hello).ok()) return Fail("send hello " + hello);
    const std::string verdict = Refused(sock->get());
    if (!verdict.empty()) return Fail("hello " + hello.substr(0, 80) + ": " + verdict);
    ++refused;
  }
  absl::StatusOr<ipc::UniqueFd> sock = ipc::ConnectUnix(attached.fd_socket());
  if (!sock.ok()) return Fail("fd socket: " + sock.status().ToString());
  if (!ipc::SendMessage(sock->get(), ipc::EncodeHello({attached.client_id(), attached.token()})).ok())
    return Fail("send the correct hello");
  absl::StatusOr<ipc::ReceivedMessage> ack = ipc::RecvMessage(sock->get(), 4096, 3);
  if (!ack.ok() || ack->payload.find("true") == std::string::npos)
    return Fail("the correct hello was not accepted");

  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("hostile-other-uid", 4096);
  if (!memfd.ok() || !ipc::SealSize(memfd->get()).ok()) return Fail("memfd");
  const int one[1] = {memfd->get()};
  const int two[2] = {memfd->get(), memfd->get()};
  int dropped = 0;
  for (const security::HostileFrame& f : security::MalformedFdFrames()) {
    const std::span<const int> fds = f.fds == 0   ? std::span<const int>()
                                     : f.fds == 1 ? std::span<const int>(one)
                                                  : std::span<const int>(two);
    if (!ipc::SendMessage(sock->get(), f.payload, fds).ok()) return Fail("send " + f.payload);
    ++dropped;
  }
  // Control requests that must each be refused, the daemon serving on.
  auto authed = [&](grpc::ClientContext* ctx) {
    Deadline(ctx);
    ctx->AddMetadata("ulysses-client-id", std::to_string(attached.client_id()));
    ctx->AddMetadata("ulysses-token", attached.token());
  };
  int requests = 0;
  // Refused at once: an error other than a deadline (a stall would end in one).
  auto expect_refused = [&](const char* what, const grpc::Status& s) -> bool {
    ++requests;
    const bool refused = !s.ok() && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED;
    if (!refused)
      std::fprintf(stderr, "second_uid_client: %s: %s\n", what,
                   s.ok() ? "accepted" : s.error_message().c_str());
    return refused;
  };
  bool all_refused = true;
  {
    v1::RegisterBufferRequest r;
    for (int i = 0; i < 65; ++i) {
      v1::VmmMapping* m = r.add_vmm_mappings();
      m->set_tag(100 + i);
      m->set_size_bytes(2 << 20);
    }
    v1::BufferInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("65 VMM mappings", stub->RegisterBuffer(&ctx, r, &out));
  }
  {
    v1::AllocBufferRequest r;
    r.set_size_bytes(uint64_t{1} << 41);
    v1::BufferInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("a 2 TiB buffer", stub->AllocBuffer(&ctx, r, &out));
  }
  {
    v1::JoinGroupRequest r;
    r.set_name("hostile");
    r.set_world_size(2147483647);
    r.set_rank(0);
    r.add_members(socket);
    v1::GroupInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("world_size 2^31-1", stub->JoinGroup(&ctx, r, &out));
  }
  {
    v1::JoinGroupRequest r;
    r.set_name("hostile");
    r.set_world_size(2);
    r.set_rank(1);
    r.add_members("dns:///127.0.0.1:1");
    r.add_members(socket);
    v1::GroupInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("a TCP member", stub->JoinGroup(&ctx, r, &out));
  }
  {
    v1::CreateSessionRequest r;
    r.set_group_id(987654321);
    v1::SessionInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("a session of no group", stub->CreateSession(&ctx, r, &out));
  }
  {
    v1::CallRequest r;
    r.set_session_id(987654321);
    v1::CallResponse out;
    grpc::ClientContext ctx;
    authed(&ctx);
    all_refused &= expect_refused("a call of no session", stub->Call(&ctx, r, &out));
  }
  {
    v1::FreeBufferRequest r;
    r.set_buffer_id(1);
    v1::FreeBufferResponse out;
    grpc::ClientContext ctx;
    Deadline(&ctx);
    ctx.AddMetadata("ulysses-client-id", std::to_string(attached.client_id()));
    ctx.AddMetadata("ulysses-token", "not-the-token");
    all_refused &= expect_refused("a wrong token", stub->FreeBuffer(&ctx, r, &out));
  }
  if (!all_refused) return Fail("a hostile request was accepted");
  // Still in step and served: a correct frame registers.
  if (!ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({9}), one).ok())
    return Fail("send the correct frame");
  v1::RegisterBufferRequest req;
  req.set_tag(9);
  req.set_name("after");
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  Deadline(&ctx);
  ctx.AddMetadata("ulysses-client-id", std::to_string(attached.client_id()));
  ctx.AddMetadata("ulysses-token", attached.token());
  grpc::Status s = stub->RegisterBuffer(&ctx, req, &info);
  if (!s.ok()) return Fail("register after the hostile frames: " + s.error_message());
  if (info.size_bytes() != 4096) return Fail(StrCat("registered ", info.size_bytes(), " bytes"));
  std::printf("second_uid_client: %d hellos refused, %d frames sent, %d requests refused, then "
              "served\n", refused, dropped, requests);
  return 0;
}
