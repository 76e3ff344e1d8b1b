// Bounds and quotas: names, attached clients, clients per uid, buffers and their bytes per
// client and per uid, unclaimed descriptors, and a client that never reads its fd socket. Each
// limit refuses with RESOURCE_EXHAUSTED naming it, counts the refusal in the metrics, and the
// daemon keeps serving everyone else.
#include <unistd.h>

#include <fstream>
#include <string>
#include <vector>

#include "hostile_client.h"
#include "ulysses/client/client.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

// Threads of process `pid` (from /proc/PID/status), -1 when unreadable.
int CountThreads(pid_t pid) {
  std::ifstream status(StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "Threads:") {
      int n = -1;
      status >> n;
      return n;
    }
  }
  return -1;
}

class QuotaTest : public DaemonTest {
 protected:
  void SetUp() override {}

  void StartWithLimits(const std::string& limits) {
    absl::StatusOr<std::string> dir = demo::MakeRunDir();
    ASSERT_TRUE(dir.ok()) << dir.status();
    dir_ = *dir;
    const std::string config = dir_ + "/limits.json";
    std::ofstream(config) << "{\"limits\": " << limits << "}";
    StartDaemon({"--config", config});
  }

  std::string Metrics() {
    v1::GetMetricsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(admin_->GetMetrics(&ctx, {}, &resp).ok());
    return resp.text();
  }

  std::unique_ptr<client::Client> Connect(const std::string& name) {
    auto c = client::Client::Connect({daemon_.socket(), name, absl::Seconds(10)});
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }
};

void ExpectExhausted(const absl::Status& s, const std::string& limit) {
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("limits." + limit), std::string::npos) << s;
}

TEST_F(QuotaTest, NamesAreBounded) {
  StartWithLimits("{}");
  absl::StatusOr<Attached> huge = Attach(std::string(1 << 20, 'n'));
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("client_name"), std::string::npos) << huge.status();
  EXPECT_EQ(Attach(std::string(257, 'n')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(Attach(std::string(256, 'n')).ok());
  auto c = Connect("names");
  ASSERT_NE(c, nullptr);
  absl::StatusOr<client::Buffer> b = c->AllocBuffer(4096, std::string(4096, 'b'));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  EXPECT_TRUE(c->AllocBuffer(4096, std::string(256, 'b')).ok());
  EXPECT_EQ(NumClients(), 2);  // the listing works, and holds no 1 MiB name
}

TEST_F(QuotaTest, AttachedClientsAreBounded) {
  StartWithLimits(R"({"max_clients": 3})");
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Attach().ok());
  ExpectExhausted(Attach().status(), "max_clients");
  const std::string m = Metrics();
  EXPECT_NE(m.find("ulyssesd_limit{limit=\"max_clients\"} 3"), std::string::npos) << m;
  EXPECT_NE(m.find("ulyssesd_limit_refusals_total{limit=\"max_clients\"} 1"), std::string::npos);
}

TEST_F(QuotaTest, BoundClientsPerUidAreBounded) {
  StartWithLimits(R"({"clients_per_uid": 2})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto c = client::Client::Connect({daemon_.socket(), "c", absl::Seconds(10)});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("limits.clients_per_uid"), std::string::npos) << c.status();
  EXPECT_TRUE(Eventually([&] { return NumClients() == 2; })) << "the refused client stayed";
  EXPECT_NE(Metrics().find(StrCat("ulyssesd_uid_clients{uid=\"", ::getuid(), "\"} 2")),
            std::string::npos);
  a.reset();  // a slot of the uid frees up
  EXPECT_TRUE(Eventually([&] { return NumClients() == 1; }));
  EXPECT_NE(Connect("d"), nullptr);
}

TEST_F(QuotaTest, BufferBytesArePerClientAndPerUid) {
  StartWithLimits(R"({"buffer_bytes_per_client": 1048576, "buffer_bytes_per_uid": 1572864})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<client::Buffer> a1 = a->AllocBuffer(1 << 20, "a1");
  ASSERT_TRUE(a1.ok()) << a1.status();
  ExpectExhausted(a->AllocBuffer(4096, "a2").status(), "buffer_bytes_per_client");
  ExpectExhausted(b->AllocBuffer(600 << 10, "b1").status(), "buffer_bytes_per_uid");
  EXPECT_NE(Metrics().find(StrCat("ulyssesd_uid_buffer_bytes{uid=\"", ::getuid(), "\"} 1048576")),
            std::string::npos);
  // A registered memfd over the limit is dropped again, descriptor and all.
  const int before = CountFds(daemon_.pid());
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("big", 2 << 20);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  ExpectExhausted(b->RegisterBuffer(memfd->get(), "big").status(), "buffer_bytes_per_client");
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == before; }));
  // Freed bytes count again.
  ASSERT_TRUE(a->FreeBuffer(a1->id).ok());
  EXPECT_TRUE(b->AllocBuffer(600 << 10, "b1").ok());
  EXPECT_TRUE(a->AllocBuffer(900 << 10, "a3").ok());
}

TEST_F(QuotaTest, BuffersPerClientAreBounded) {
  StartWithLimits(R"({"buffers_per_client": 3})");
  auto a = Connect("a");
  ASSERT_NE(a, nullptr);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(a->AllocBuffer(4096, "x").ok());
  ExpectExhausted(a->AllocBuffer(4096, "x").status(), "buffers_per_client");
}

TEST_F(QuotaTest, UnclaimedDescriptorsAreBounded) {
  StartWithLimits(R"({"pending_fds_per_client": 8})");
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);
  ASSERT_TRUE(sock.ok()) << sock.status();
  const int baseline = CountFds(daemon_.pid());
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("unclaimed", 4096);
  ASSERT_TRUE(memfd.ok());
  const int one[1] = {memfd->get()};
  for (uint64_t tag = 1; tag <= 40; ++tag)
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({tag}), one).ok());
  EXPECT_TRUE(Eventually([&] {
    return Metrics().find("ulyssesd_limit_refusals_total{limit=\"pending_fds_per_client\"} 32") !=
           std::string::npos;
  }));
  EXPECT_EQ(CountFds(daemon_.pid()), baseline + 8);
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
}

TEST_F(QuotaTest, AClientThatNeverReadsItsFdSocketIsReclaimedNotWaitedFor) {
  StartWithLimits("{}");
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);  // and never read again
  ASSERT_TRUE(sock.ok()) << sock.status();
  const int threads = CountThreads(daemon_.pid());
  grpc::Status s;
  int calls = 0;
  for (; calls < 4000 && s.ok(); ++calls) {
    v1::AllocBufferRequest req;
    req.set_size_bytes(4096);
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, *a);
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    s = control_->AllocBuffer(&ctx, req, &info);
  }
  // Its frames filled the socket; the daemon gave up on it instead of holding a thread.
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << calls << " calls: " << s.error_message();
  EXPECT_EQ(NumClients(), 0);
  EXPECT_TRUE(Eventually([&] { return CountThreads(daemon_.pid()) <= threads; }))
      << CountThreads(daemon_.pid()) << " threads, " << threads << " before";
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
}

}  // namespace
}  // namespace ulysses::security
