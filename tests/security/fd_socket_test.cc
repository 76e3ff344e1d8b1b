// The fd socket takes bytes from any process that can reach it: every frame is decoded with
// typed checks, a bad one is refused or dropped, and the daemon keeps serving everyone.
#include <grp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "hostile_client.h"
#include "hostile_frames.h"
#include "ulysses/client/client.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

// What the daemon answers a hello it does not accept: an error frame, or the socket closes.
void ExpectRefused(int sock, const std::string& sent) {
  absl::StatusOr<bool> ready = ipc::WaitReadable(sock, 20000);
  ASSERT_TRUE(ready.ok() && *ready) << "no answer to hello " << sent;
  absl::StatusOr<ipc::ReceivedMessage> answer = ipc::RecvMessage(sock);
  if (answer.ok()) {
    EXPECT_NE(answer->payload.find("false"), std::string::npos) << answer->payload;
    EXPECT_TRUE(answer->fds.empty()) << "a refused hello got descriptors";
  }
}

class FdSocketTest : public DaemonTest {
 protected:
  // Attaches and binds a client (a_, sock_), then notes the daemon's descriptors (baseline_).
  void AttachAndBind() {
    absl::StatusOr<Attached> a = Attach();
    ASSERT_TRUE(a.ok()) << a.status();
    a_ = *a;
    absl::StatusOr<ipc::UniqueFd> sock = Bind(a_);
    ASSERT_TRUE(sock.ok()) << sock.status();
    sock_ = std::move(*sock);
    baseline_ = CountFds(daemon_.pid());
    ASSERT_GT(baseline_, 0);
  }
  Attached a_;
  ipc::UniqueFd sock_;
  int baseline_ = 0;
};

TEST_F(FdSocketTest, MalformedHellosAreRefusedAndTheDaemonKeepsServing) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  const std::vector<std::string> hellos = MalformedHellos(a->client_id, a->token);
  for (const std::string& hello : hellos) {
    absl::StatusOr<ipc::UniqueFd> sock = ipc::ConnectUnix(a->fd_socket);
    ASSERT_TRUE(sock.ok()) << sock.status();
    ASSERT_TRUE(ipc::SendMessage(sock->get(), hello).ok());
    ExpectRefused(sock->get(), hello);
    ASSERT_TRUE(Serving()) << "daemon died on hello " << hello;
  }
  // The client whose id the bad hellos used can still bind, and others are served.
  EXPECT_TRUE(Bind(*a).ok());
  auto c = client::Client::Connect({daemon_.socket(), "bystander", absl::Seconds(10)});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->AllocBuffer(4096, "b").ok());
}

TEST_F(FdSocketTest, MalformedFdFramesAreDroppedAndTheClientStaysServed) {
  ASSERT_NO_FATAL_FAILURE(AttachAndBind());
  const Attached* a = &a_;
  const ipc::UniqueFd* sock = &sock_;
  const int baseline = baseline_;

  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("hostile", 4096);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  const int two[2] = {memfd->get(), memfd->get()};
  for (const HostileFrame& f : MalformedFdFrames()) {
    const std::span<const int> fds = f.fds == 0   ? std::span<const int>()
                                     : f.fds == 1 ? std::span<const int>(one)
                                                  : std::span<const int>(two);
    ASSERT_TRUE(ipc::SendMessage(sock->get(), f.payload, fds).ok());
    ASSERT_TRUE(Serving()) << "daemon died on fd frame " << f.payload;
  }
  // The stream is still in step: a correct frame registers.
  ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({9}), one).ok());
  v1::RegisterBufferRequest req;
  req.set_tag(9);
  req.set_name("after");
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  Authenticate(&ctx, *a);
  grpc::Status s = control_->RegisterBuffer(&ctx, req, &info);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(info.size_bytes(), 4096u);
  // Every descriptor of the dropped frames was closed, and the registered buffer keeps none
  // (its mapping keeps the memory).
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline; }))
      << CountFds(daemon_.pid()) << " descriptors, baseline " << baseline;
}

// The same hellos and frames, and hostile Control requests, from a process of another uid
// (65534, with the daemon's group so that it reaches the sockets): each is refused or dropped,
// that client is still served, and once it exits the daemon is back to its descriptors and
// clients, with a bystander served.
TEST_F(FdSocketTest, TheSameFramesFromASecondUidAreRefusedAndEveryoneStaysServed) {
  if (::geteuid() != 0) GTEST_SKIP() << "a process of a second uid needs root";
  ASSERT_EQ(::chmod(dir_.c_str(), 0711), 0);
  ASSERT_TRUE(Serving());  // this test's own channel is connected before the baseline
  // A client of this uid with a session and a buffer, whose ids the other uid is given to
  // forge descriptors with; its calls stay exact.
  auto owner = client::Client::Connect({daemon_.socket(), "owner", absl::Seconds(10)});
  ASSERT_TRUE(owner.ok()) << owner.status();
  auto group = (*owner)->JoinGroup({"owner", 1, 0, {daemon_.socket()}, "auto", 0});
  ASSERT_TRUE(group.ok()) << group.status();
  auto session = (*owner)->CreateSession(*group, {4, 8, DType::kFloat32, 16, 2, {}, 0});
  ASSERT_TRUE(session.ok()) << session.status();
  auto x = (*owner)->AllocBuffer(16 * 4 * 8 * 4, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  auto* xf = static_cast<float*>(x->data);
  for (int i = 0; i < 16 * 4 * 8; ++i) xf[i] = static_cast<float>(i) * 0.5f - 3.0f;
  auto exact = [&]() -> bool {
    auto r = (*session)->ScatterHeads(x->Ref(), 1, 16);
    if (!r.ok()) return false;
    const bool same = std::memcmp(r->data, xf, 16 * 4 * 8 * 4) == 0;  // a group of one
    return r->Release().ok() && same;
  };
  ASSERT_TRUE(exact());
  const int baseline = CountFdsButPipes(daemon_.pid());
  ASSERT_GT(baseline, 0);
  const std::string before = DescribeFds(daemon_.pid());
  const std::string socket = daemon_.socket();
  const std::string other_session = std::to_string((*session)->id());
  const std::string other_buffer = std::to_string(x->id);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const gid_t groups[] = {::getegid()};
    if (::setgroups(1, groups) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(76);
    if (::access(SECOND_UID_CLIENT_PATH, X_OK) != 0) ::_exit(77);
    ::execl(SECOND_UID_CLIENT_PATH, SECOND_UID_CLIENT_PATH, socket.c_str(), other_session.c_str(),
            other_buffer.c_str(), static_cast<char*>(nullptr));
    ::_exit(78);
  }
  int exited = -1;
  for (int i = 0; i < 1200 && exited < 0; ++i) {  // at most 120 s
    int status = 0;
    if (::waitpid(child, &status, WNOHANG) == child)
      exited = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (exited < 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  if (exited == 77) GTEST_SKIP() << "uid 65534 cannot reach " << SECOND_UID_CLIENT_PATH;
  ASSERT_EQ(exited, 0) << "the other uid's client failed (its stderr says why)";
  ASSERT_TRUE(Serving());
  EXPECT_TRUE(exact()) << "the owner's session after the other uid's forged descriptors";
  {
    auto c = client::Client::Connect({daemon_.socket(), "bystander", absl::Seconds(10)});
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_TRUE((*c)->AllocBuffer(4096, "b").ok());
  }
  EXPECT_TRUE(Eventually([&] { return NumClients() == 1; })) << NumClients() << " clients left";
  EXPECT_TRUE(Eventually([&] { return CountFdsButPipes(daemon_.pid()) == baseline; }))
      << CountFdsButPipes(daemon_.pid()) << " descriptors, baseline " << baseline << "\nbefore:\n"
      << before << "after:\n" << DescribeFds(daemon_.pid());
}

// Device memory as CUDA VMM mappings (one fd frame per mapping): the request is checked before
// any descriptor is taken, and a registration that fails takes and closes every descriptor of
// it that arrived, so none stays held against the client's quota.
TEST_F(FdSocketTest, VmmRegistrationsAreCheckedAndLeaveNoDescriptorBehind) {
  ASSERT_NO_FATAL_FAILURE(AttachAndBind());
  const Attached* a = &a_;
  const ipc::UniqueFd* sock = &sock_;
  const int baseline = baseline_;
  auto register_vmm = [&](const std::vector<std::pair<uint64_t, uint64_t>>& mappings,
                          const std::string& ipc_handle = "") {
    v1::RegisterBufferRequest req;
    req.set_name("vmm");
    req.set_cuda_ipc_handle(ipc_handle);
    for (const auto& [tag, size] : mappings) {
      v1::VmmMapping* m = req.add_vmm_mappings();
      m->set_tag(tag);
      m->set_size_bytes(size);
    }
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, *a);
    return control_->RegisterBuffer(&ctx, req, &info);
  };
  auto expect = [](const grpc::Status& s, grpc::StatusCode code, const std::string& text) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos) << s.error_message();
  };
  const uint64_t mib = 1 << 20;
  std::vector<std::pair<uint64_t, uint64_t>> many;
  for (uint64_t i = 0; i < 65; ++i) many.push_back({100 + i, 2 * mib});
  expect(register_vmm(many), grpc::StatusCode::INVALID_ARGUMENT, "vmm_mappings: 65 mappings");
  expect(register_vmm({{1, 2 * mib}, {2, 0}}), grpc::StatusCode::INVALID_ARGUMENT,
         "vmm_mappings[1].size_bytes: 0");
  expect(register_vmm({{1, 1ull << 40}, {2, 2 * mib}}), grpc::StatusCode::INVALID_ARGUMENT,
         "vmm_mappings[1].size_bytes");
  expect(register_vmm({{1, 2 * mib}}, std::string(64, 'h')), grpc::StatusCode::INVALID_ARGUMENT,
         "not both");

  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("vmm", 4096);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  const int one[1] = {memfd->get()};
  // Three descriptors sent: the host backend refuses the memory, and all three are closed.
  for (uint64_t tag : {21, 22, 23})
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({tag}), one).ok());
  expect(register_vmm({{21, 2 * mib}, {22, 2 * mib}, {23, 2 * mib}}),
         grpc::StatusCode::FAILED_PRECONDITION, "vmm_mappings: this daemon runs the host backend");
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline; }))
      << CountFds(daemon_.pid()) << " descriptors, baseline " << baseline;
  // The second of three never sent: the call names it, and the other two are closed.
  for (uint64_t tag : {31, 33})
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({tag}), one).ok());
  expect(register_vmm({{31, 2 * mib}, {32, 2 * mib}, {33, 2 * mib}}),
         grpc::StatusCode::INVALID_ARGUMENT, "vmm_mappings[1]: tag: no fd arrived");
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline; }))
      << CountFds(daemon_.pid()) << " descriptors, baseline " << baseline;
  // The client is still served: a memfd registers.
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({40}), one).ok());
  v1::RegisterBufferRequest req;
  req.set_tag(40);
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  Authenticate(&ctx, *a);
  grpc::Status s = control_->RegisterBuffer(&ctx, req, &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A memfd on hugetlbfs is refused even sealed (its owner could punch a hole in it while no huge
// page is free: the daemon's next touch of that page would be a SIGBUS), and its descriptor is
// not kept. A registered memfd holds no descriptor of the daemon's either: the mapping keeps
// the memory, so registering one many times leaves the daemon's descriptors where they were.
TEST_F(FdSocketTest, AHugetlbMemfdIsRefusedAndNoRegistrationHoldsADescriptor) {
  ASSERT_NO_FATAL_FAILURE(AttachAndBind());
  auto register_tag = [&](uint64_t tag) {
    v1::RegisterBufferRequest req;
    req.set_tag(tag);
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, a_);
    return control_->RegisterBuffer(&ctx, req, &info);
  };
  ipc::UniqueFd huge(::memfd_create("huge", MFD_HUGETLB | MFD_ALLOW_SEALING | MFD_CLOEXEC));
  if (huge.valid() && ::ftruncate(huge.get(), 2 << 20) == 0 && ipc::SealSize(huge.get()).ok()) {
    const int one[1] = {huge.get()};
    ASSERT_TRUE(ipc::SendMessage(sock_.get(), ipc::EncodeFdFrame({50}), one).ok());
    const grpc::Status s = register_tag(50);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << s.error_message();
    EXPECT_NE(s.error_message().find("hugetlbfs"), std::string::npos) << s.error_message();
  } else {
    std::cout << "no sealed hugetlbfs memfd on this kernel; that part is not run\n";
  }
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("again", 4096);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  for (uint64_t tag = 60; tag < 92; ++tag) {
    ASSERT_TRUE(ipc::SendMessage(sock_.get(), ipc::EncodeFdFrame({tag}), one).ok());
    const grpc::Status s = register_tag(tag);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline_; }))
      << CountFds(daemon_.pid()) << " descriptors, baseline " << baseline_;
}

}  // namespace
}  // namespace ulysses::security
