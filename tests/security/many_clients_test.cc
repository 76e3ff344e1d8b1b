// Many attached clients (item 13). Each attached client holds its Control.Watch stream open for
// as long as it lives, and before, the daemon's synchronous gRPC server held one thread for each
// such stream, and one ring worker thread more for each client: the server's threads were a
// pool that clients could exhaust. Here 1,000 clients attach, bind their fd socket (with call
// rings) and hold their Watch stream open, each on a connection of its own; a new client is
// still served, the daemon's thread count stays far below one per client, and ending the
// streams reclaims every client.
#include <sys/resource.h>

#include <condition_variable>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hostile_client.h"
#include "ulysses/client/client.h"

namespace ulysses::security {
namespace {

constexpr int kClients = 1000;
// Descriptors the daemon holds per client: two for its connection (gRPC's and the connection
// gate's), its fd socket, pidfd, client segment and four doorbell ends; the daemon keeps an
// eighth of its limit free (headroom.h), and the test holds two per client of its own (a
// connection and an fd socket). With room for the rest.
constexpr rlim_t kDescriptorsNeeded = 11 * kClients + 1024;

// One attached, bound client with its own connection and its Watch stream.
struct HeldClient {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Control::Stub> stub;
  ipc::UniqueFd fd_socket;
  std::unique_ptr<Watcher> watch;
};

class ManyClientsTest : public DaemonTest {
 protected:
  void SetUp() override {
    ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved_), 0);
    if (saved_.rlim_max < kDescriptorsNeeded)
      GTEST_SKIP() << "RLIMIT_NOFILE's hard limit (" << saved_.rlim_max << ") is below the "
                   << kDescriptorsNeeded << " descriptors " << kClients << " clients need";
    // The daemon inherits the raised limit.
    rlimit raised = saved_;
    raised.rlim_cur = std::max(saved_.rlim_cur, kDescriptorsNeeded);
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &raised), 0);
    restore_ = true;
    absl::StatusOr<std::string> dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    const std::string config = dir_ + "/many.json";
    std::ofstream(config) << "{\"limits\": {\"max_clients\": " << kClients + 16
                          << ", \"clients_per_uid\": " << kClients + 16
                          << ", \"connections_per_uid\": " << kClients + 16
                          << ", \"max_connections\": " << kClients + 16 << "}}";
    StartDaemon({"--config", config});
  }
  void TearDown() override {
    // A stream still open ends before its reactor goes.
    for (HeldClient& h : held_)
      if (h.watch) {
        h.watch->Cancel();
        EXPECT_TRUE(h.watch->AwaitEnd());
      }
    held_.clear();
    DaemonTest::TearDown();
    if (restore_) ::setrlimit(RLIMIT_NOFILE, &saved_);
  }

  // Attaches on a connection of its own (as a client process has), binds the fd socket (its
  // ack brings the call rings) and opens the Watch stream.
  absl::StatusOr<HeldClient> AttachAndWatch(int i) {
    HeldClient h;
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    h.channel = grpc::CreateCustomChannel("unix://" + daemon_.socket(),
                                          grpc::InsecureChannelCredentials(), args);
    h.stub = v1::Control::NewStub(h.channel);
    v1::AttachRequest req;
    req.set_client_name(StrCat("held-", i));
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    grpc::Status s = h.stub->Attach(&ctx, req, &resp);
    if (!s.ok()) return absl::UnavailableError(StrCat("attach ", i, ": ", s.error_message()));
    const Attached a{resp.client_id(), resp.token(), resp.fd_socket()};
    ipc::ReceivedMessage ack;
    absl::StatusOr<ipc::UniqueFd> sock = Bind(a, &ack);
    if (!sock.ok()) return sock.status();
    if (ack.fds.size() != 3) return absl::InternalError(StrCat("client ", i, ": no call rings"));
    h.fd_socket = std::move(*sock);
    h.watch = std::make_unique<Watcher>(*h.stub, a);
    return h;
  }

  rlimit saved_{};
  bool restore_ = false;
  std::vector<HeldClient> held_;
};

TEST_F(ManyClientsTest, AThousandWatchingClientsCostNoThreadEachAndANewClientIsServed) {
  const int threads_before = CountThreads(daemon_.pid());
  ASSERT_GT(threads_before, 0);
  for (int i = 0; i < kClients; ++i) {
    absl::StatusOr<HeldClient> h = AttachAndWatch(i);
    ASSERT_TRUE(h.ok()) << h.status();
    held_.push_back(std::move(*h));
  }
  ASSERT_EQ(NumClients(), kClients);

  // A new client attaches through the library (rings, Watch) and is served: a buffer, a
  // one-rank group and session, and a call on its rings.
  auto c = client::Client::Connect({daemon_.socket(), "newcomer", absl::Seconds(10)});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->uses_rings());
  constexpr int32_t kH = 4, kD = 8;
  constexpr int64_t kTokens = 16;
  constexpr uint64_t kBytes = kTokens * kH * kD * 4;
  absl::StatusOr<client::Buffer> x = (*c)->AllocBuffer(kBytes, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  for (uint64_t e = 0; e < kBytes / 4; ++e) {
    const float v = static_cast<float>(e);
    std::memcpy(static_cast<uint8_t*>(x->data) + e * 4, &v, 4);
  }
  auto g = (*c)->JoinGroup({"newcomer", 1, 0, {daemon_.socket()}, "host", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto session = (*c)->CreateSession(*g, {kH, kD, DType::kFloat32, kTokens, 2, {}, 0});
  ASSERT_TRUE(session.ok()) << session.status();
  // With one rank, scatter_heads gives back its input.
  absl::StatusOr<client::Result> r = (*session)->ScatterHeads(x->Ref(), 1, kTokens);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_NE(r->data, nullptr);
  EXPECT_EQ(std::memcmp(r->data, x->data, kBytes), 0);
  EXPECT_EQ(NumClients(), kClients + 1);

  // Far below one thread per client: with a thread per Watch stream and a ring worker per
  // client, the daemon had 2,000 more.
  const int threads_attached = CountThreads(daemon_.pid());
  std::cout << "daemon threads: " << threads_before << " before, " << threads_attached << " with "
            << kClients + 1 << " attached clients\n";
  RecordProperty("threads_before", threads_before);
  RecordProperty("threads_attached", threads_attached);
  EXPECT_LT(threads_attached - threads_before, kClients / 20);

  // Each stream was being served: its end reclaims its client, every one.
  for (HeldClient& h : held_) h.watch->Cancel();
  for (HeldClient& h : held_) ASSERT_TRUE(h.watch->AwaitEnd());
  EXPECT_TRUE(Eventually([&] { return NumClients() == 1; })) << NumClients() << " clients left";
  r->Release().IgnoreError();
  session->reset();
  ASSERT_TRUE((*c)->Close().ok());
  EXPECT_TRUE(Eventually([&] { return NumClients() == 0; }));
  EXPECT_TRUE(Serving());
}

}  // namespace
}  // namespace ulysses::security
