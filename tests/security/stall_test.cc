// One client must never stall the fd socket for the others: a partial hello, silent
// connections and a bound client's partial frame only cost their own sender; connections and
// attached clients that never say hello are dropped after timeouts.bind_ms.
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "hostile_client.h"
#include "ulysses/client/client.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

// Four bytes of a frame header that announces a 100-byte hello, and nothing more.
void SendPartialFrame(int sock) {
  const uint32_t length = 100;
  ASSERT_EQ(::write(sock, &length, 2), 2);
}

// A library client connects (hello, ack, Watch) and its buffers work. Its Connect waits at most
// 10 s for the fd socket's ack, so a stalled fd thread fails it.
void ExpectBystanderServed(const std::string& socket) {
  auto c = client::Client::Connect({socket, "bystander", absl::Seconds(10)});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->AllocBuffer(4096, "a").ok());
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("bystander", 8192);
  ASSERT_TRUE(memfd.ok()) << memfd.status();
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  absl::StatusOr<client::Buffer> b = (*c)->RegisterBuffer(memfd->get(), "r");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->size, 8192u);
}

using StallTest = DaemonTest;

TEST_F(StallTest, APartialHelloDoesNotHoldTheAcceptLoop) {
  absl::StatusOr<ipc::UniqueFd> stuck = ipc::ConnectUnix(daemon_.socket() + ".fd");
  ASSERT_TRUE(stuck.ok()) << stuck.status();
  SendPartialFrame(stuck->get());
  ExpectBystanderServed(daemon_.socket());
}

TEST_F(StallTest, SilentConnectionsDoNotDelayOthers) {
  std::vector<ipc::UniqueFd> silent;
  for (int i = 0; i < 32; ++i) {
    absl::StatusOr<ipc::UniqueFd> s = ipc::ConnectUnix(daemon_.socket() + ".fd");
    ASSERT_TRUE(s.ok()) << s.status();
    silent.push_back(std::move(*s));
  }
  ExpectBystanderServed(daemon_.socket());
}

TEST_F(StallTest, APartialFrameOfABoundClientDoesNotBlockOthers) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);
  ASSERT_TRUE(sock.ok()) << sock.status();
  SendPartialFrame(sock->get());
  ExpectBystanderServed(daemon_.socket());
  // Reclaim still works for everyone: a client that detaches is gone.
  auto other = client::Client::Connect({daemon_.socket(), "leaver", absl::Seconds(10)});
  ASSERT_TRUE(other.ok()) << other.status();
  const int before = NumClients();
  ASSERT_TRUE((*other)->Close().ok());
  EXPECT_TRUE(Eventually([&] { return NumClients() == before - 1; }));
  // The stuck client finishes its frame later and is served: its bytes were kept.
  const std::string rest = std::string(R"({"tag": 1})") + std::string(90, ' ');
  const uint32_t length = 100;
  ASSERT_EQ(::write(sock->get(), reinterpret_cast<const char*>(&length) + 2, 2), 2);
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("late", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  ASSERT_EQ(::write(sock->get(), rest.data(), rest.size()), static_cast<ssize_t>(rest.size()));
  // The partial frame carried no descriptor, so the daemon drops it; the next one registers.
  const int fds[1] = {memfd->get()};
  ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({2}), fds).ok());
  v1::RegisterBufferRequest req;
  req.set_tag(2);
  v1::BufferInfo info;
  grpc::ClientContext ctx;
  Authenticate(&ctx, *a);
  grpc::Status s = control_->RegisterBuffer(&ctx, req, &info);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

class BindTimeoutTest : public DaemonTest {
 protected:
  void SetUp() override {
    absl::StatusOr<std::string> dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    const std::string config = dir_ + "/bind.json";
    std::ofstream(config) << R"({"timeouts": {"bind_ms": 300}})";
    StartDaemon({"--config", config});
  }
};

TEST_F(BindTimeoutTest, AnAttachedClientThatNeverBindsIsReclaimed) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Attach().ok());
  EXPECT_EQ(NumClients(), 5);
  EXPECT_TRUE(Eventually([&] { return NumClients() == 0; })) << NumClients() << " clients left";
  ExpectBystanderServed(daemon_.socket());
}

TEST_F(BindTimeoutTest, TheWatchStreamOfAReclaimedClientEnds) {
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  grpc::ClientContext ctx;
  Authenticate(&ctx, *a);
  auto watch = control_->Watch(&ctx);
  v1::WatchEvent ev;
  // The daemon ends the stream when it reclaims the client that never bound; Read returns.
  EXPECT_FALSE(watch->Read(&ev));
  grpc::Status end = watch->Finish();
  EXPECT_NE(end.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << "the stream outlived its client";
  EXPECT_EQ(NumClients(), 0);
}

TEST_F(BindTimeoutTest, AConnectionThatSaysNothingIsClosed) {
  absl::StatusOr<ipc::UniqueFd> silent = ipc::ConnectUnix(daemon_.socket() + ".fd");
  ASSERT_TRUE(silent.ok()) << silent.status();
  absl::StatusOr<bool> ready = ipc::WaitReadable(silent->get(), 20000);
  ASSERT_TRUE(ready.ok() && *ready) << "the daemon kept a silent connection open";
  char byte;
  EXPECT_EQ(::read(silent->get(), &byte, 1), 0);  // end of stream: closed by the daemon
}

}  // namespace
}  // namespace ulysses::security
