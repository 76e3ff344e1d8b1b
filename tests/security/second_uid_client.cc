// Hostile input from a process of its own, which the security tests run as another uid than
// the daemon's:
//   second_uid_client SOCKET [OTHER_SESSION OTHER_BUFFER]
// Attaches, sends every malformed hello of the fd socket (each must be refused), binds with a
// correct one, sends every malformed frame of a bound client, then Control requests that must
// each be refused (bad buffers, groups, sessions, calls, and another client's token), then
// forged descriptors on its call rings that must each complete with an error (a session and a
// buffer of another client, OTHER_SESSION and OTHER_BUFFER, among them), and at last
// registers a buffer through a correct frame and runs one correct call through the rings.
// Exits 0 when the daemon refused and dropped each and still served this client; otherwise it
// says what went wrong on stderr and exits 1.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>

#include "grpcpp/grpcpp.h"
#include "hostile_frames.h"
#include "ulysses/common/geometry.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/client_segment.h"
#include "ulysses/ipc/doorbell.h"
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

// The call rings of a bound client, mapped from the hello's answer (segment, submit bell,
// completion bell).
struct Rings {
  ipc::Mapping segment;
  ipc::SubmitRing* submit = nullptr;
  ipc::CompletionRing* complete = nullptr;
  std::optional<ipc::Doorbell> submit_bell, complete_bell;

  absl::Status Map(ipc::ReceivedMessage& ack) {
    if (ack.fds.size() != 3) return absl::InternalError("the hello's answer has no rings");
    ULY_ASSIGN_OR_RETURN(segment,
                         ipc::Mapping::Map(ack.fds[0].get(), ipc::ClientSegmentLayout::kTotal, true));
    auto* base = static_cast<uint8_t*>(segment.data());
    ULY_ASSIGN_OR_RETURN(submit, ipc::SubmitRing::Attach(base + ipc::ClientSegmentLayout::kSubmit,
                                                         sizeof(ipc::SubmitRing)));
    ULY_ASSIGN_OR_RETURN(complete,
                         ipc::CompletionRing::Attach(base + ipc::ClientSegmentLayout::kComplete,
                                                     sizeof(ipc::CompletionRing)));
    ULY_ASSIGN_OR_RETURN(ipc::Doorbell s, ipc::Doorbell::Adopt(std::move(ack.fds[1])));
    ULY_ASSIGN_OR_RETURN(ipc::Doorbell c, ipc::Doorbell::Adopt(std::move(ack.fds[2])));
    submit_bell.emplace(std::move(s));
    complete_bell.emplace(std::move(c));
    return absl::OkStatus();
  }
  // Pushes `d` and waits (at most 20 s) for its completion.
  absl::StatusOr<ipc::Completion> Roundtrip(const ipc::CallDescriptor& d) {
    ULY_ASSIGN_OR_RETURN(bool pushed, submit->TryPush(d));
    if (!pushed) return absl::ResourceExhaustedError("the submit ring is full");
    ULY_RETURN_IF_ERROR(submit_bell->Signal());
    ipc::Completion c{};
    ULY_ASSIGN_OR_RETURN(bool got, ipc::PopWait(*complete, &c, *complete_bell,
                                                absl::Now() + absl::Seconds(20)));
    if (!got) return absl::DeadlineExceededError("no completion within 20 s");
    return c;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 4) return Fail("usage: second_uid_client SOCKET [OTHER_SESSION OTHER_BUFFER]");
  const std::string socket = argv[1];
  const uint64_t other_session = argc == 4 ? std::strtoull(argv[2], nullptr, 10) : 0;
  const uint64_t other_buffer = argc == 4 ? std::strtoull(argv[3], nullptr, 10) : 0;
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

  // Forged descriptors on the call rings: each completes with an error, at once.
  Rings rings;
  if (absl::Status m = rings.Map(*ack); !m.ok()) return Fail("rings: " + m.ToString());
  uint64_t group_id = 0;
  {
    v1::JoinGroupRequest r;
    r.set_name("hostile-solo");
    r.set_world_size(1);
    r.add_members(socket);
    v1::GroupInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    grpc::Status s = stub->JoinGroup(&ctx, r, &out);
    if (!s.ok()) return Fail("join a group of one: " + s.error_message());
    group_id = out.group_id();
  }
  // A session of this client (its segment arrives as a frame), and a buffer for its input.
  auto make_session = [&]() -> absl::StatusOr<uint64_t> {
    v1::CreateSessionRequest r;
    r.set_group_id(group_id);
    r.mutable_spec()->set_num_heads(4);
    r.mutable_spec()->set_head_dim(8);
    r.mutable_spec()->set_dtype(v1::DTYPE_FLOAT32);
    r.mutable_spec()->set_max_tokens(16);
    r.mutable_spec()->set_num_slots(2);
    v1::SessionInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    grpc::Status s = stub->CreateSession(&ctx, r, &out);
    if (!s.ok()) return absl::InternalError("create a session: " + s.error_message());
    ULY_RETURN_IF_ERROR(ipc::RecvMessage(sock->get()).status());
    return out.session_id();
  };
  absl::StatusOr<uint64_t> session = make_session();
  if (!session.ok()) return Fail(session.status().ToString());
  constexpr uint64_t kInputBytes = 16 * 4 * 8 * 4;  // 16 tokens of 4 heads of 8 floats
  uint64_t buffer_id = 0;
  {
    v1::AllocBufferRequest r;
    r.set_size_bytes(kInputBytes);
    v1::BufferInfo out;
    grpc::ClientContext ctx;
    authed(&ctx);
    grpc::Status s = stub->AllocBuffer(&ctx, r, &out);
    if (!s.ok()) return Fail("alloc: " + s.error_message());
    if (!ipc::RecvMessage(sock->get()).ok()) return Fail("the buffer's frame");
    buffer_id = out.buffer_id();
  }
  uint64_t next_epoch = 1;
  auto scatter = [&](uint64_t session_id, uint64_t buffer) {
    ipc::CallDescriptor d{};
    d.session_id = session_id;
    d.epoch = next_epoch;
    d.op = static_cast<uint32_t>(OpKind::kScatterHeads);
    d.num_inputs = 1;
    d.batch = 1;
    d.seq = 16;
    d.inputs[0].buffer_id = buffer;
    return d;
  };
  int descriptors = 0;
  // Pushes `d`: its completion must be an error (`hostile`) or a success; the session's next
  // epoch is taken from it.
  auto roundtrip = [&](const char* what, const ipc::CallDescriptor& d, bool hostile) -> bool {
    ++descriptors;
    absl::StatusOr<ipc::Completion> c = rings.Roundtrip(d);
    if (!c.ok()) {
      std::fprintf(stderr, "second_uid_client: %s: %s\n", what, c.status().ToString().c_str());
      return false;
    }
    if (c->session_id == *session && c->next_epoch != 0) next_epoch = c->next_epoch;
    if (hostile != (c->code != 0)) {
      std::fprintf(stderr, "second_uid_client: %s: code %d (%s)\n", what, c->code, c->message);
      return false;
    }
    return true;
  };
  bool ring_ok = true;
  {
    ipc::CallDescriptor d = scatter(*session, buffer_id);
    d.epoch = 0;
    ring_ok &= roundtrip("epoch 0", d, true);
    d = scatter(987654321, buffer_id);
    ring_ok &= roundtrip("a session of nobody", d, true);
    ring_ok &= roundtrip("a correct call between them", scatter(*session, buffer_id), false);
    if (other_session != 0) {
      ring_ok &= roundtrip("another uid's session", scatter(other_session, buffer_id), true);
    }
  }
  // Descriptors that break the session they name (its epoch is spent on an error every rank
  // sees), each on a session of its own.
  auto on_fresh_session = [&](const char* what, auto forge) -> bool {
    absl::StatusOr<uint64_t> s = make_session();
    if (!s.ok()) {
      std::fprintf(stderr, "second_uid_client: %s: %s\n", what, s.status().ToString().c_str());
      return false;
    }
    const uint64_t kept_session = *session, kept_epoch = next_epoch;
    *session = *s;
    next_epoch = 1;
    ipc::CallDescriptor d = scatter(*s, buffer_id);
    forge(d);
    const bool ok = roundtrip(what, d, true);
    *session = kept_session;
    next_epoch = kept_epoch;
    return ok;
  };
  ring_ok &= on_fresh_session("an unknown op", [](ipc::CallDescriptor& d) { d.op = 77; });
  ring_ok &= on_fresh_session("nine inputs", [](ipc::CallDescriptor& d) { d.num_inputs = 9; });
  if (other_buffer != 0)
    ring_ok &= on_fresh_session("another uid's buffer",
                                [&](ipc::CallDescriptor& d) { d.inputs[0].buffer_id = other_buffer; });
  ring_ok &= on_fresh_session("an offset past the buffer's end",
                              [](ipc::CallDescriptor& d) { d.inputs[0].offset_bytes = kInputBytes; });
  ring_ok &= on_fresh_session("2^40 tokens", [](ipc::CallDescriptor& d) { d.seq = int64_t{1} << 40; });
  ring_ok &= on_fresh_session("a negative stride",
                              [](ipc::CallDescriptor& d) { d.inputs[0].strides[1] = -1; });
  ring_ok &= roundtrip("a correct call after them", scatter(*session, buffer_id), false);
  if (!ring_ok) return Fail("a forged descriptor was not refused, or a correct one failed");
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
  std::printf("second_uid_client: %d hellos refused, %d frames sent, %d requests refused, %d "
              "descriptors answered, then served\n", refused, dropped, requests, descriptors);
  return 0;
}
