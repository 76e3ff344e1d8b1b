// Bounds and quotas: names, attached clients, clients per uid, buffers and their bytes per
// client and per uid, unclaimed descriptors, and a client that never reads its fd socket. Each
// limit refuses with RESOURCE_EXHAUSTED naming it, counts the refusal in the metrics, and the
// daemon keeps serving everyone else.
#include <grp.h>
#include <poll.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "../util/peer_close.h"
#include "hostile_client.h"
#include "ulysses/common/logging.h"
#include "ulysses/common/sockets.h"
#include "ulysses/client/client.h"
#include "ulysses/ipc/shm.h"

namespace ulysses::security {
namespace {

// RESOURCE_EXHAUSTED naming limits.`limit`.
void ExpectExhausted(const absl::Status& s, const std::string& limit);

class QuotaTest : public DaemonTest {
 protected:
  void SetUp() override {}

  void StartWithLimits(const std::string& limits, const std::vector<std::string>& env = {}) {
    StartWithConfig(StrCat("{\"limits\": ", limits, "}"), env);
  }

  // (Re)starts the daemon with the config file `json`.
  void StartWithConfig(const std::string& json, const std::vector<std::string>& env = {}) {
    if (dir_.empty()) {
      absl::StatusOr<std::string> dir = demo::MakeRunDir();
      ASSERT_TRUE(dir.ok()) << dir.status();
      dir_ = *dir;
    }
    const std::string config = dir_ + "/limits.json";
    std::ofstream(config) << json;
    StartDaemon({"--config", config}, env);
  }

  // Receive-slot memory the daemon's sessions hold (GetState).
  uint64_t SlotBytesInUse() {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(admin_->GetState(&ctx, {}, &st).ok());
    return st.slot_budget_used_bytes();
  }

  std::string Metrics() {
    v1::GetMetricsResponse resp;
    grpc::ClientContext ctx;
    EXPECT_TRUE(admin_->GetMetrics(&ctx, {}, &resp).ok());
    return resp.text();
  }

  // Runs phase_client in `phase` as uid and gid 65534 (else as this process's uid), with the
  // daemon's group as a supplementary one (the control and fd sockets are 0660 of that group),
  // and waits until it reports the phase done. -1 once it is ready (its pid in *child, for the
  // caller to reap), else its exit status (77: uid 65534 cannot reach the program). As uid
  // 65534: needs root.
  int OtherUidClient(const std::string& phase, pid_t* child, bool other_uid = true) {
    EXPECT_EQ(::chmod(dir_.c_str(), 0711), 0);
    const std::string drop = dir_ + "/other-uid-" + phase;  // where it writes its ready file
    EXPECT_EQ(::mkdir(drop.c_str(), 0777), 0);
    EXPECT_EQ(::chmod(drop.c_str(), 0777), 0);
    const std::string ready = drop + "/ready", socket = daemon_.socket();
    *child = ::fork();
    if (*child < 0) return 79;
    if (*child == 0) {
      const gid_t groups[] = {::getegid()};
      if (other_uid &&
          (::setgroups(1, groups) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0))
        ::_exit(76);
      if (::access(PHASE_CLIENT_PATH, X_OK) != 0) ::_exit(77);
      ::execl(PHASE_CLIENT_PATH, PHASE_CLIENT_PATH, "--socket", socket.c_str(), "--members",
              socket.c_str(), "--rank", "0", "--phase", phase.c_str(), "--ready", ready.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(78);
    }
    int exited = -1;
    const bool done = Eventually([&] {
      int status = 0;
      if (::waitpid(*child, &status, WNOHANG) == *child) {
        exited = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        return true;
      }
      return ::access(ready.c_str(), F_OK) == 0;
    });
    return done ? exited : 80;
  }

  // As root: a client of uid 65534 attaches and allocates a buffer (else nothing).
  void ExpectAnotherUidServed() {
    if (::geteuid() != 0) return;
    pid_t child = -1;
    const int exited = OtherUidClient("buffer", &child);
    if (child > 0) {
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
    }
    if (exited != 77) {
      EXPECT_EQ(exited, -1) << "the other uid's client exited with " << exited;
    }
  }

  // Two clients of this uid, "a" and "b", each the one rank of a group of its own.
  struct SoloPair {
    std::unique_ptr<client::Client> a, b;
    absl::StatusOr<client::Group> ga = absl::UnknownError("not joined"), gb = ga;
    bool ok() const { return ga.ok() && gb.ok(); }
  };
  SoloPair TwoSoloClients() {
    SoloPair p;
    p.a = Connect("a");
    p.b = Connect("b");
    if (p.a != nullptr && p.b != nullptr) {
      p.ga = Solo(*p.a, "a");
      p.gb = Solo(*p.b, "b");
    }
    EXPECT_TRUE(p.ok()) << p.ga.status() << p.gb.status();
    return p;
  }

  // A bound on what all clients hold together that three buffers of `unit` bytes reach: with
  // two of a's and one of b's, b's next is refused naming `limit`; a buffer a frees, and a's
  // last one once a goes, come back to b.
  void ExpectBoundInAll(const std::string& limit, uint64_t unit) {
    auto a = Connect("a");
    auto b = Connect("b");
    ASSERT_NE(a, nullptr);
    ASSERT_NE(b, nullptr);
    absl::StatusOr<client::Buffer> a1 = a->AllocBuffer(unit, "a1");
    ASSERT_TRUE(a1.ok()) << a1.status();
    ASSERT_TRUE(a->AllocBuffer(unit, "a2").ok());
    ASSERT_TRUE(b->AllocBuffer(unit, "b1").ok());
    ExpectExhausted(b->AllocBuffer(unit, "b2").status(), limit);
    ASSERT_TRUE(a->FreeBuffer(a1->id).ok());
    EXPECT_TRUE(b->AllocBuffer(unit, "b2").ok());
    a.reset();  // its buffer left goes with it
    EXPECT_TRUE(Eventually([&] { return b->AllocBuffer(unit, "b3").ok(); }));
    ExpectExhausted(b->AllocBuffer(unit, "b4").status(), limit);
  }

  // A one-rank group of `c` on this daemon.
  absl::StatusOr<client::Group> Solo(client::Client& c, const std::string& name) {
    return c.JoinGroup({name, 1, 0, {daemon_.socket()}, "auto", 10000});
  }

  // The smallest session: one head of 4 floats, 4 tokens, one slot.
  static client::SessionSpec TinySpec() {
    client::SessionSpec spec;
    spec.num_heads = 1;
    spec.head_dim = 4;
    spec.dtype = DType::kFloat32;
    spec.max_tokens = 4;
    spec.num_slots = 1;
    return spec;
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

// Attach needs no proof: the clients attached on one uid's control connections and not bound
// yet are bounded apart from max_clients, so one uid cannot hold every place of it.
TEST_F(QuotaTest, UnboundClientsPerUidAreBounded) {
  StartWithLimits(R"({"unbound_clients_per_uid": 3, "max_clients": 8})");
  std::vector<Attached> attached;
  for (int i = 0; i < 3; ++i) {
    absl::StatusOr<Attached> a = Attach();
    ASSERT_TRUE(a.ok()) << a.status();
    attached.push_back(*a);
  }
  ExpectExhausted(Attach().status(), "unbound_clients_per_uid");
  const std::string gauge = StrCat("ulyssesd_uid_unbound_clients{uid=\"", ::getuid(), "\"} ");
  EXPECT_NE(Metrics().find(gauge + "3"), std::string::npos) << Metrics();
  // A client that binds no longer counts: its place among the unbound is free.
  absl::StatusOr<ipc::UniqueFd> sock = Bind(attached[0]);
  ASSERT_TRUE(sock.ok()) << sock.status();
  EXPECT_TRUE(Eventually([&] { return Metrics().find(gauge + "2") != std::string::npos; }));
  absl::StatusOr<Attached> again = Attach();
  EXPECT_TRUE(again.ok()) << again.status();
  ExpectExhausted(Attach().status(), "unbound_clients_per_uid");
  // Another uid still attaches (run as root: uid 65534).
  ExpectAnotherUidServed();
  const std::string m = Metrics();
  EXPECT_NE(m.find("ulyssesd_limit_refusals_total{limit=\"unbound_clients_per_uid\"} 2"),
            std::string::npos) << m;
  EXPECT_NE(m.find("ulyssesd_limit{limit=\"unbound_clients_per_uid\"} 3"), std::string::npos);
}

TEST_F(QuotaTest, UnboundClientsAreGivenBackWhenTheyAreReclaimed) {
  StartWithConfig(R"({"limits": {"unbound_clients_per_uid": 2}, "timeouts": {"bind_ms": 300}})");
  ASSERT_TRUE(Attach().ok());
  ASSERT_TRUE(Attach().ok());
  ExpectExhausted(Attach().status(), "unbound_clients_per_uid");
  // Neither binds: both are reclaimed after timeouts.bind_ms, and their places come back.
  EXPECT_TRUE(Eventually([&] { return NumClients() == 0; }));
  EXPECT_TRUE(Attach().ok());
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

// A client of a second uid (65534, in the daemon's group) is counted against its own uid's
// quota: the first uid at its limit leaves it served, and it leaves the first uid's count as
// it was.
TEST_F(QuotaTest, OneUidAtItsQuotaLeavesAnotherUidServed) {
  if (::geteuid() != 0) GTEST_SKIP() << "a client of a second uid needs root";
  StartWithLimits(R"({"clients_per_uid": 2})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  pid_t child = -1;
  const int exited = OtherUidClient("attach", &child);
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  if (exited == 77) GTEST_SKIP() << "uid 65534 cannot reach " << PHASE_CLIENT_PATH;
  ASSERT_EQ(exited, -1) << "the other uid's client exited with " << exited;
  EXPECT_EQ(NumClients(), 3);
  const std::string m = Metrics();
  EXPECT_NE(m.find(StrCat("ulyssesd_uid_clients{uid=\"", ::getuid(), "\"} 2")), std::string::npos)
      << m;
  EXPECT_NE(m.find("ulyssesd_uid_clients{uid=\"65534\"} 1"), std::string::npos) << m;
  // The first uid is still at its limit.
  auto c = client::Client::Connect({daemon_.socket(), "c", absl::Seconds(10)});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("limits.clients_per_uid"), std::string::npos) << c.status();
  ::kill(child, SIGKILL);
  EXPECT_TRUE(Eventually([&] { return NumClients() == 2; })) << "the killed client stayed";
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

// All clients of one uid together hold at most buffers_per_uid buffers (each is a mapping of
// the daemon's); a freed buffer, and those of a client that went, count again. A buffer the
// daemon allocated keeps no descriptor of the daemon's once its client has it.
TEST_F(QuotaTest, BuffersPerUidAreBounded) {
  StartWithLimits(R"({"buffers_per_uid": 3})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  const int before = CountFds(daemon_.pid());
  absl::StatusOr<client::Buffer> a1 = a->AllocBuffer(4096, "a1");
  ASSERT_TRUE(a1.ok()) << a1.status();
  ASSERT_TRUE(a->AllocBuffer(4096, "a2").ok());
  ASSERT_TRUE(b->AllocBuffer(4096, "b1").ok());
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == before; }))
      << CountFds(daemon_.pid()) << " descriptors, " << before << " before the buffers";
  ExpectExhausted(b->AllocBuffer(4096, "b2").status(), "buffers_per_uid");
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("m", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  ExpectExhausted(b->RegisterBuffer(memfd->get(), "m").status(), "buffers_per_uid");
  const std::string held = StrCat("ulyssesd_uid_buffers{uid=\"", ::getuid(), "\"} ");
  EXPECT_NE(Metrics().find(held + "3"), std::string::npos) << Metrics();
  EXPECT_NE(Metrics().find("ulyssesd_limit_refusals_total{limit=\"buffers_per_uid\"} 2"),
            std::string::npos);
  ASSERT_TRUE(a->FreeBuffer(a1->id).ok());
  EXPECT_TRUE(b->RegisterBuffer(memfd->get(), "m").ok());
  a.reset();  // its one buffer left goes with it
  EXPECT_TRUE(Eventually([&] { return Metrics().find(held + "2") != std::string::npos; }));
  EXPECT_TRUE(b->AllocBuffer(4096, "b3").ok());
  ExpectExhausted(b->AllocBuffer(4096, "b4").status(), "buffers_per_uid");
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

TEST_F(QuotaTest, AClientsBadFramesCannotFillTheDaemonsLog) {
  StartWithLimits("{}");
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);
  ASSERT_TRUE(sock.ok()) << sock.status();
  // Each frame is ignored with a warning: it carries no descriptor.
  constexpr int kFrames = 200;
  for (uint64_t tag = 1; tag <= kFrames; ++tag)
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({tag}), {}).ok());
  // The client's budget writes 5 lines at once and one more every 10 s: unless the daemon took
  // more than 15 minutes over the frames, at least 100 of them were dropped.
  auto dropped = [&]() -> int64_t {
    const std::string m = Metrics();
    const std::string key = "\nulyssesd_log_lines_dropped_total ";
    const size_t at = m.find(key);
    return at == std::string::npos ? -1 : std::stoll(m.substr(at + key.size()));
  };
  EXPECT_TRUE(Eventually([&] { return dropped() >= 100; })) << dropped();
  EXPECT_LE(dropped(), kFrames - LogBudget::kBurst);
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
  const int threads = CountThreadsOutsideTimers(daemon_.pid());
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
  EXPECT_TRUE(Eventually([&] { return CountThreadsOutsideTimers(daemon_.pid()) <= threads; }))
      << CountThreadsOutsideTimers(daemon_.pid()) << " threads, " << threads << " before";
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
}

// Requests in progress per client: two RegisterBuffer requests wait for descriptors that have
// not come, and hold the client's two places; every further request of that client is
// RESOURCE_EXHAUSTED naming the limit (and counted) until a place frees up, while another
// client is served. Once the descriptors arrive both registrations complete, and the client
// is served again.
TEST_F(QuotaTest, RequestsInProgressPerClientAreBounded) {
  StartWithLimits(R"({"calls_in_progress_per_client": 2})");
  absl::StatusOr<Attached> a = Attach();
  ASSERT_TRUE(a.ok()) << a.status();
  absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);
  ASSERT_TRUE(sock.ok()) << sock.status();
  auto register_tag = [&](uint64_t tag) {
    v1::RegisterBufferRequest req;
    req.set_tag(tag);
    req.set_name(StrCat("waits-", tag));
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, *a);
    return control_->RegisterBuffer(&ctx, req, &info);
  };
  auto free_unknown = [&] {
    v1::FreeBufferRequest req;
    req.set_buffer_id(987654321);
    v1::FreeBufferResponse resp;
    grpc::ClientContext ctx;
    Authenticate(&ctx, *a);
    return control_->FreeBuffer(&ctx, req, &resp);
  };
  grpc::Status waited[2];
  std::thread first([&] { waited[0] = register_tag(1); });
  std::thread second([&] { waited[1] = register_tag(2); });
  // Once both wait inside the daemon, a third request is refused at once.
  grpc::Status refused;
  EXPECT_TRUE(Eventually([&] {
    refused = free_unknown();
    return refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  })) << refused.error_message();
  EXPECT_NE(refused.error_message().find("limits.calls_in_progress_per_client"), std::string::npos)
      << refused.error_message();
  EXPECT_NE(Metrics().find("ulyssesd_limit{limit=\"calls_in_progress_per_client\"} 2"),
            std::string::npos);
  EXPECT_EQ(Metrics().find("ulyssesd_limit_refusals_total{limit=\"calls_in_progress_per_client\"} 0"),
            std::string::npos);
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
  // The descriptors come: both registrations complete.
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("late", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  for (uint64_t tag : {1, 2})
    ASSERT_TRUE(ipc::SendMessage(sock->get(), ipc::EncodeFdFrame({tag}), one).ok());
  first.join();
  second.join();
  EXPECT_TRUE(waited[0].ok()) << waited[0].error_message();
  EXPECT_TRUE(waited[1].ok()) << waited[1].error_message();
  // Places free again: the client's next request is answered on its merits.
  EXPECT_EQ(free_unknown().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

// Requests in progress of all clients of one uid together are bounded too: two clients of
// the test's uid hold one request each, and a third is refused though its client has only one
// in progress; a client of another uid is served meanwhile.
TEST_F(QuotaTest, RequestsInProgressPerUidAreBounded) {
  StartWithLimits(R"({"calls_in_progress_per_client": 8, "calls_in_progress_per_uid": 2})");
  absl::StatusOr<Attached> a = Attach("a"), b = Attach("b");
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<ipc::UniqueFd> sock_a = Bind(*a), sock_b = Bind(*b);
  ASSERT_TRUE(sock_a.ok() && sock_b.ok());
  auto register_tag = [&](const Attached& who, uint64_t tag) {
    v1::RegisterBufferRequest req;
    req.set_tag(tag);
    req.set_name(StrCat("waits-", tag));
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, who);
    return control_->RegisterBuffer(&ctx, req, &info);
  };
  auto free_unknown = [&](const Attached& who) {
    v1::FreeBufferRequest req;
    req.set_buffer_id(987654321);
    v1::FreeBufferResponse resp;
    grpc::ClientContext ctx;
    Authenticate(&ctx, who);
    return control_->FreeBuffer(&ctx, req, &resp);
  };
  grpc::Status waited[2];
  std::thread first([&] { waited[0] = register_tag(*a, 1); });
  std::thread second([&] { waited[1] = register_tag(*b, 2); });
  grpc::Status refused;
  EXPECT_TRUE(Eventually([&] {
    refused = free_unknown(*a);
    return refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  })) << refused.error_message();
  EXPECT_NE(refused.error_message().find("limits.calls_in_progress_per_uid"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Metrics().find("ulyssesd_limit_refusals_total{limit=\"calls_in_progress_per_uid\"} 0"),
            std::string::npos);
  ExpectAnotherUidServed();
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("late", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  ASSERT_TRUE(ipc::SendMessage(sock_a->get(), ipc::EncodeFdFrame({1}), one).ok());
  ASSERT_TRUE(ipc::SendMessage(sock_b->get(), ipc::EncodeFdFrame({2}), one).ok());
  first.join();
  second.join();
  EXPECT_TRUE(waited[0].ok()) << waited[0].error_message();
  EXPECT_TRUE(waited[1].ok()) << waited[1].error_message();
  EXPECT_EQ(free_unknown(*a).error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // served again
}

// Admin requests carry no client identity and each holds a server thread: each socket takes
// only so many at once. Two ListClients are held inside the daemon (a failpoint); a third
// Admin request on the control socket is refused, while the operator socket (counted apart)
// and every client's Control requests are served.
TEST_F(QuotaTest, AdminRequestsInProgressAreBoundedPerSocket) {
  const std::string release = StrCat(::testing::TempDir(), "release-admin-", ::getpid());
  ::unlink(release.c_str());
  StartWithLimits(R"({"admin_calls_in_progress": 2})",
                  {StrCat("ULYSSES_FAILPOINTS=admin.list_clients=", release)});
  auto list_clients = [&] {
    v1::ListClientsResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    return admin_->ListClients(&ctx, {}, &resp);
  };
  auto get_state = [](v1::Admin::Stub& stub) {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    return stub.GetState(&ctx, {}, &st);
  };
  grpc::Status held[2];
  std::thread first([&] { held[0] = list_clients(); });
  std::thread second([&] { held[1] = list_clients(); });
  grpc::Status refused;
  EXPECT_TRUE(Eventually([&] {
    refused = get_state(*admin_);
    return refused.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
  })) << refused.error_message();
  EXPECT_NE(refused.error_message().find("limits.admin_calls_in_progress"), std::string::npos)
      << refused.error_message();
  auto op = v1::Admin::NewStub(grpc::CreateChannel(
      "unix://" + daemon_.socket() + std::string(kOperatorSocketSuffix),
      grpc::InsecureChannelCredentials()));
  EXPECT_TRUE(get_state(*op).ok());
  v1::GetMetricsResponse metrics;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(op->GetMetrics(&ctx, {}, &metrics).ok());
  }
  EXPECT_EQ(metrics.text().find("ulyssesd_limit_refusals_total{limit=\"admin_calls_in_progress\"} 0"),
            std::string::npos);
  EXPECT_NE(metrics.text().find("ulyssesd_limit{limit=\"admin_calls_in_progress\"} 2"),
            std::string::npos);
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
  { std::ofstream(release.c_str()) << "go"; }
  first.join();
  second.join();
  EXPECT_TRUE(held[0].ok()) << held[0].error_message();
  EXPECT_TRUE(held[1].ok()) << held[1].error_message();
  EXPECT_TRUE(get_state(*admin_).ok());  // places free again
  ::unlink(release.c_str());
}

// The slot memory budget is the daemon's; with slots.uid_share_percent below 100, the sessions
// of one uid's clients hold at most that part of it, and the rest stays for the other uids.
TEST_F(QuotaTest, OneUidHoldsNoMoreThanItsShareOfTheSlotBudget) {
  StartWithLimits("{}");
  uint64_t one = 0;
  {
    auto probe = Connect("probe");
    ASSERT_NE(probe, nullptr);
    absl::StatusOr<client::Group> g = Solo(*probe, "probe");
    ASSERT_TRUE(g.ok()) << g.status();
    auto s = probe->CreateSession(*g, TinySpec());
    ASSERT_TRUE(s.ok()) << s.status();
    one = SlotBytesInUse();
  }
  ASSERT_GT(one, 0u);
  // A budget of 4.5 sessions, of which one uid may hold half: 2 sessions.
  const uint64_t budget = 4 * one + one / 2;
  StartWithConfig(StrCat(R"({"slots": {"memory_budget_bytes": )", budget,
                         R"(, "uid_share_percent": 50}})"));
  SoloPair pair = TwoSoloClients();
  ASSERT_TRUE(pair.ok());
  auto a1 = pair.a->CreateSession(*pair.ga, TinySpec());
  auto b1 = pair.b->CreateSession(*pair.gb, TinySpec());
  ASSERT_TRUE(a1.ok() && b1.ok()) << a1.status() << b1.status();
  // Both clients are of this uid: the third session passes the share, not the budget.
  absl::StatusOr<std::unique_ptr<client::Session>> a2 =
      pair.a->CreateSession(*pair.ga, TinySpec());
  EXPECT_EQ(a2.status().code(), absl::StatusCode::kResourceExhausted) << a2.status();
  EXPECT_NE(a2.status().message().find("slots.uid_share_percent"), std::string::npos)
      << a2.status();
  EXPECT_EQ(SlotBytesInUse(), 2 * one);
  const std::string gauge = StrCat("ulyssesd_uid_slot_bytes{uid=\"", ::getuid(), "\"} ");
  EXPECT_NE(Metrics().find(gauge + std::to_string(2 * one)), std::string::npos) << Metrics();
  // A closed session gives its part back.
  a1->reset();
  EXPECT_TRUE(Eventually([&] { return SlotBytesInUse() == one; }));
  auto a3 = pair.a->CreateSession(*pair.ga, TinySpec());
  EXPECT_TRUE(a3.ok()) << a3.status();
  // With the whole budget for one uid (the default), the same three sessions fit.
  a1->reset();
  b1->reset();
  a3->reset();
  pair.a.reset();
  pair.b.reset();
  StartWithConfig(StrCat(R"({"slots": {"memory_budget_bytes": )", budget, "}}"));
  auto c = Connect("c");
  ASSERT_NE(c, nullptr);
  absl::StatusOr<client::Group> gc = Solo(*c, "c");
  ASSERT_TRUE(gc.ok()) << gc.status();
  std::vector<std::unique_ptr<client::Session>> held;
  for (int i = 0; i < 3; ++i) {
    auto s = c->CreateSession(*gc, TinySpec());
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
    held.push_back(std::move(*s));
  }
}

// Admin listings are as long as what the clients hold: they come in pages, each of a bounded
// size, which together list every entry once, in order.
TEST_F(QuotaTest, AdminListingsComeInPages) {
  StartWithLimits("{}");
  SoloPair pair = TwoSoloClients();
  ASSERT_TRUE(pair.ok());
  client::SessionSpec spec = TinySpec();
  spec.num_slots = 2;
  std::vector<std::unique_ptr<client::Session>> held;
  for (int i = 0; i < 5; ++i) {
    auto s = (i % 2 ? pair.b : pair.a)->CreateSession(i % 2 ? *pair.gb : *pair.ga, spec);
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  std::vector<uint64_t> sessions;
  std::vector<std::pair<uint64_t, int>> slots;
  std::string token;
  int pages = 0;
  do {
    v1::ListSessionsRequest req;
    req.set_page_size(2);
    req.set_page_token(token);
    v1::ListSessionsResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->ListSessions(&ctx, req, &resp).ok());
    EXPECT_LE(resp.sessions_size(), 2);
    for (const auto& s : resp.sessions()) sessions.push_back(s.info().session_id());
    token = resp.next_page_token();
    ASSERT_LT(++pages, 10);
  } while (!token.empty());
  EXPECT_EQ(pages, 3);
  ASSERT_EQ(sessions.size(), 5u);
  EXPECT_TRUE(std::is_sorted(sessions.begin(), sessions.end()));
  EXPECT_EQ(std::adjacent_find(sessions.begin(), sessions.end()), sessions.end());
  do {
    v1::ListSlotsRequest req;
    req.set_page_size(3);
    req.set_page_token(token);
    v1::ListSlotsResponse resp;
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->ListSlots(&ctx, req, &resp).ok());
    EXPECT_LE(resp.slots_size(), 3);
    for (const auto& s : resp.slots()) slots.push_back({s.session_id(), s.slot()});
    token = resp.next_page_token();
  } while (!token.empty());
  std::vector<std::pair<uint64_t, int>> want;
  for (uint64_t id : sessions) want.insert(want.end(), {{id, 0}, {id, 1}});
  EXPECT_EQ(slots, want);
  // The default page holds them all; groups and clients page alike.
  v1::ListGroupsRequest groups_req;
  groups_req.set_page_size(1);
  v1::ListGroupsResponse groups;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->ListGroups(&ctx, groups_req, &groups).ok());
  }
  EXPECT_EQ(groups.groups_size(), 1);
  EXPECT_FALSE(groups.next_page_token().empty());
  v1::ListClientsResponse clients;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(admin_->ListClients(&ctx, {}, &clients).ok());
  }
  EXPECT_EQ(clients.clients_size(), 2);
  EXPECT_EQ(clients.next_page_token(), "");
  // A size below zero, or a token the daemon cannot read, names its argument.
  for (auto [size, bad] : {std::pair<int, const char*>{-1, ""}, {0, "not-a-token"}}) {
    v1::ListSessionsRequest req;
    req.set_page_size(size);
    req.set_page_token(bad);
    v1::ListSessionsResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = admin_->ListSessions(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(st.error_message().find(size < 0 ? "page_size" : "page_token"), std::string::npos)
        << st.error_message();
  }
}

// Sessions: each holds descriptors and mappings of the daemon's, so one client, the clients
// of one uid, and all clients together may have only so many open (or being created). A
// closed session, and every session of a client that goes, gives its place back; the daemon's
// descriptors return to where they were.
TEST_F(QuotaTest, SessionsArePerClientPerUidAndInAll) {
  StartWithLimits(R"({"sessions_per_client": 3, "sessions_per_uid": 4, "max_sessions": 5})");
  SoloPair pair = TwoSoloClients();
  ASSERT_TRUE(pair.ok());
  const client::SessionSpec spec = TinySpec();
  const int baseline = CountFds(daemon_.pid());
  std::vector<std::unique_ptr<client::Session>> held;
  for (int i = 0; i < 3; ++i) {
    auto s = pair.a->CreateSession(*pair.ga, spec);
    ASSERT_TRUE(s.ok()) << s.status();
    held.push_back(std::move(*s));
  }
  ExpectExhausted(pair.a->CreateSession(*pair.ga, spec).status(), "sessions_per_client");
  auto b1 = pair.b->CreateSession(*pair.gb, spec);
  ASSERT_TRUE(b1.ok()) << b1.status();
  ExpectExhausted(pair.b->CreateSession(*pair.gb, spec).status(), "sessions_per_uid");
  const std::string sessions = StrCat("ulyssesd_uid_sessions{uid=\"", ::getuid(), "\"} ");
  EXPECT_NE(Metrics().find(sessions + "4"), std::string::npos) << Metrics();
  // The daemon-wide bound, with the per-uid one out of the way.
  held.pop_back();  // closes one of a's
  EXPECT_TRUE(Eventually([&] { return Metrics().find(sessions + "3") != std::string::npos; }));
  auto b2 = pair.b->CreateSession(*pair.gb, spec);
  ASSERT_TRUE(b2.ok()) << b2.status();
  const std::string m = Metrics();
  EXPECT_NE(m.find("ulyssesd_limit_refusals_total{limit=\"sessions_per_client\"} 1"),
            std::string::npos) << m;
  EXPECT_NE(m.find("ulyssesd_limit_refusals_total{limit=\"sessions_per_uid\"} 1"),
            std::string::npos) << m;
  EXPECT_NE(m.find("ulyssesd_limit{limit=\"max_sessions\"} 5"), std::string::npos) << m;
  held.clear();
  pair.a.reset();
  EXPECT_TRUE(Eventually([&] { return Metrics().find(sessions + "2") != std::string::npos; }));
  // A client that goes gives back every session it had: a process of this uid with a session
  // open is killed.
  pid_t child = -1;
  ASSERT_EQ(OtherUidClient("session", &child, /*other_uid=*/false), -1);
  EXPECT_TRUE(Eventually([&] { return Metrics().find(sessions + "3") != std::string::npos; }));
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  EXPECT_TRUE(Eventually([&] { return Metrics().find(sessions + "2") != std::string::npos; }))
      << Metrics();
  b1->reset();
  b2->reset();
  EXPECT_TRUE(Eventually([&] { return Metrics().find(sessions + "0") != std::string::npos; }))
      << Metrics();
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) <= baseline; }))
      << CountFds(daemon_.pid()) << " descriptors, " << baseline << " before the sessions\n"
      << DescribeFds(daemon_.pid());
  auto again = pair.b->CreateSession(*pair.gb, spec);
  EXPECT_TRUE(again.ok()) << again.status();
}

// All clients together: the daemon-wide bound refuses what no per-client or per-uid bound
// would.
TEST_F(QuotaTest, SessionsOfAllClientsAreBounded) {
  StartWithLimits(R"({"max_sessions": 2})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<client::Group> ga = Solo(*a, "a"), gb = Solo(*b, "b");
  ASSERT_TRUE(ga.ok() && gb.ok());
  const client::SessionSpec spec = TinySpec();
  auto s1 = a->CreateSession(*ga, spec);
  auto s2 = b->CreateSession(*gb, spec);
  ASSERT_TRUE(s1.ok() && s2.ok()) << s1.status() << s2.status();
  ExpectExhausted(a->CreateSession(*ga, spec).status(), "max_sessions");
  s2->reset();
  EXPECT_TRUE(Eventually([&] { return a->CreateSession(*ga, spec).ok(); }));
}

// Groups: each joined group (and each join in progress) is kept for its client; a client may
// have only so many. Leaving one frees its place.
TEST_F(QuotaTest, GroupsPerClientAreBounded) {
  StartWithLimits(R"({"groups_per_client": 2})");
  auto a = Connect("a");
  auto b = Connect("b");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  absl::StatusOr<client::Group> g1 = Solo(*a, "g1");
  ASSERT_TRUE(g1.ok()) << g1.status();
  ASSERT_TRUE(Solo(*a, "g2").ok());
  ExpectExhausted(Solo(*a, "g3").status(), "groups_per_client");
  EXPECT_TRUE(Solo(*b, "other").ok());  // another client is not held back
  ASSERT_TRUE(a->LeaveGroup(*g1).ok());
  EXPECT_TRUE(Solo(*a, "g3").ok());
  EXPECT_NE(Metrics().find("ulyssesd_limit_refusals_total{limit=\"groups_per_client\"} 1"),
            std::string::npos);
}

// JoinGroup and CreateSession count among a client's requests in progress: two joins wait for
// a rank that never comes, and the client's next request is refused until they end. A join
// that failed gives its place among the client's groups back.
TEST_F(QuotaTest, CollectiveRequestsCountAmongRequestsInProgress) {
  StartWithLimits(R"({"calls_in_progress_per_client": 2, "groups_per_client": 2})");
  auto a = Connect("a");
  ASSERT_NE(a, nullptr);
  const std::vector<std::string> members = {daemon_.socket(), daemon_.socket()};
  absl::StatusOr<client::Group> joined[2];
  std::thread first([&] { joined[0] = a->JoinGroup({"w1", 2, 0, members, "auto", 4000}); });
  std::thread second([&] { joined[1] = a->JoinGroup({"w2", 2, 0, members, "auto", 4000}); });
  // Both wait in this daemon's rendezvous table (Admin takes none of the client's places).
  EXPECT_TRUE(Eventually([&] {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    return admin_->GetState(&ctx, {}, &st).ok() && st.pending_rendezvous() == 2;
  }));
  const absl::Status refused = a->FreeBuffer(987654321);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("limits.calls_in_progress_per_client"), std::string::npos)
      << refused;
  auto bystander = Connect("bystander");
  ASSERT_NE(bystander, nullptr);
  EXPECT_TRUE(bystander->AllocBuffer(4096, "b").ok());
  first.join();
  second.join();
  EXPECT_EQ(joined[0].status().code(), absl::StatusCode::kDeadlineExceeded) << joined[0].status();
  EXPECT_EQ(joined[1].status().code(), absl::StatusCode::kDeadlineExceeded) << joined[1].status();
  EXPECT_EQ(a->FreeBuffer(987654321).code(), absl::StatusCode::kInvalidArgument);  // served again
  // The failed joins hold no group: two more fit, and a third does not.
  EXPECT_TRUE(Solo(*a, "s1").ok());
  EXPECT_TRUE(Solo(*a, "s2").ok());
  ExpectExhausted(Solo(*a, "s3").status(), "groups_per_client");
}

// Buffers of all clients together: each is a mapping of the daemon's, whatever uid holds it;
// and their bytes.
TEST_F(QuotaTest, BuffersOfAllClientsAreBounded) {
  StartWithLimits(R"({"max_buffers": 3})");
  ExpectBoundInAll("max_buffers", 4096);
}

TEST_F(QuotaTest, BufferBytesOfAllClientsAreBounded) {
  StartWithLimits(R"({"max_buffer_bytes": 12288})");
  ExpectBoundInAll("max_buffer_bytes", 4096);
}

// Descriptors sent and not claimed, of all clients together: past the bound a frame is
// dropped (and counted), whichever client sent it, until a claim, or a client that goes,
// frees places.
TEST_F(QuotaTest, UnclaimedDescriptorsOfAllClientsAreBounded) {
  StartWithLimits(R"({"max_pending_fds": 8})");
  absl::StatusOr<Attached> a = Attach("a"), b = Attach("b");
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<ipc::UniqueFd> sock_a = Bind(*a), sock_b = Bind(*b);
  ASSERT_TRUE(sock_a.ok() && sock_b.ok());
  const int baseline = CountFds(daemon_.pid());
  absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("unclaimed", 4096);
  ASSERT_TRUE(memfd.ok());
  ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
  const int one[1] = {memfd->get()};
  auto send = [&](const ipc::UniqueFd& sock, uint64_t first, uint64_t last) {
    for (uint64_t tag = first; tag <= last; ++tag)
      ASSERT_TRUE(ipc::SendMessage(sock.get(), ipc::EncodeFdFrame({tag}), one).ok());
  };
  auto refusals = [&](int n) {
    return Metrics().find(StrCat("ulyssesd_limit_refusals_total{limit=\"max_pending_fds\"} ",
                                 n)) != std::string::npos;
  };
  // a's six first, then b's six: b's last four find no place.
  send(*sock_a, 1, 6);
  ASSERT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline + 6; }));
  send(*sock_b, 1, 6);
  EXPECT_TRUE(Eventually([&] { return refusals(4); })) << Metrics();
  EXPECT_TRUE(Eventually([&] { return CountFds(daemon_.pid()) == baseline + 8; }));
  // A claim frees a place: a's registration of tag 1 takes one of its descriptors.
  {
    v1::RegisterBufferRequest req;
    req.set_tag(1);
    req.set_name("claimed");
    v1::BufferInfo info;
    grpc::ClientContext ctx;
    Authenticate(&ctx, *a);
    ASSERT_TRUE(control_->RegisterBuffer(&ctx, req, &info).ok());
  }
  send(*sock_b, 7, 7);
  send(*sock_b, 8, 8);  // no place
  EXPECT_TRUE(Eventually([&] { return refusals(5); })) << Metrics();
  const std::string pending = StrCat("ulyssesd_uid_pending_fds{uid=\"", ::getuid(), "\"} ");
  EXPECT_NE(Metrics().find(pending + "8"), std::string::npos) << Metrics();
  // A client that goes gives its five unclaimed descriptors back: b's next five fit, and the
  // sixth does not (frames of one socket are taken in order).
  sock_a->reset();
  ASSERT_TRUE(Eventually([&] { return Metrics().find(pending + "3") != std::string::npos; }))
      << Metrics();
  send(*sock_b, 9, 14);
  EXPECT_TRUE(Eventually([&] { return refusals(6); })) << Metrics();
  EXPECT_NE(Metrics().find(pending + "8"), std::string::npos) << Metrics();
}

// The process's own bound: sessions of many ranks could take the daemon's descriptors though
// every limit holds. With the daemon's RLIMIT_NOFILE lowered to 200 more than it holds, one
// client's sessions stop short of it: the last eighth (at least 64) stays for the work the
// daemon serves, a client already attached still registers buffers, a new one is refused
// until the sessions go, and nothing fails with EMFILE.
TEST_F(QuotaTest, SessionsStopShortOfTheDaemonsDescriptorLimit) {
  StartWithLimits(R"({"sessions_per_client": 100000, "sessions_per_uid": 100000,
                      "max_sessions": 100000})");
  auto a = Connect("a");
  auto bystander = Connect("bystander");
  ASSERT_NE(a, nullptr);
  ASSERT_NE(bystander, nullptr);
  absl::StatusOr<client::Group> g = Solo(*a, "solo");
  ASSERT_TRUE(g.ok()) << g.status();
  const int open = CountFds(daemon_.pid());
  const rlimit lowered{static_cast<rlim_t>(open + 200), static_cast<rlim_t>(open + 200)};
  ASSERT_EQ(::prlimit(daemon_.pid(), RLIMIT_NOFILE, &lowered, nullptr), 0) << std::strerror(errno);
  const client::SessionSpec spec = TinySpec();
  std::vector<std::unique_ptr<client::Session>> held;
  absl::Status refused;
  while (held.size() < 1000) {
    auto s = a->CreateSession(*g, spec);
    if (!s.ok()) {
      refused = s.status();
      break;
    }
    held.push_back(std::move(*s));
  }
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  const int limit = open + 200;
  const int kept = std::max(64, limit / 8);
  EXPECT_NE(refused.message().find(
                StrCat("descriptors (RLIMIT_NOFILE); the last ", kept, " are kept")),
            std::string::npos) << refused;
  EXPECT_GE(held.size(), 10u);
  // Refused once no more than `kept` were free: the last session took 3 of them.
  EXPECT_LE(CountFds(daemon_.pid()), limit - kept + 3) << held.size() << " sessions";
  // The one attached already is served: its buffers take descriptors for a moment.
  for (int i = 0; i < 20; ++i) {
    absl::StatusOr<client::Buffer> b = bystander->AllocBuffer(4096, "b");
    ASSERT_TRUE(b.ok()) << i << ": " << b.status();
    absl::StatusOr<ipc::UniqueFd> memfd = ipc::CreateMemfd("m", 4096);
    ASSERT_TRUE(memfd.ok());
    ASSERT_TRUE(ipc::SealSize(memfd->get()).ok());
    EXPECT_TRUE(bystander->RegisterBuffer(memfd->get(), "m").ok());
  }
  absl::StatusOr<std::unique_ptr<client::Client>> late =
      client::Client::Connect({daemon_.socket(), "late", absl::Seconds(10)});
  EXPECT_EQ(late.status().code(), absl::StatusCode::kResourceExhausted) << late.status();
  const std::string m = Metrics();
  EXPECT_NE(m.find(StrCat("process_max_fds ", limit)), std::string::npos) << m;
  EXPECT_NE(m.find("ulyssesd_headroom_refusals_total 2"), std::string::npos) << m;
  held.clear();
  EXPECT_TRUE(Eventually([&] {
    return client::Client::Connect({daemon_.socket(), "later", absl::Seconds(10)}).ok();
  }));
  EXPECT_TRUE(a->CreateSession(*g, spec).ok());
}

// A gRPC channel of its own connection (gRPC shares one between channels of a process that
// name the same target), connected within `wait` or not.
bool NewConnectionServed(const std::string& socket, absl::Duration wait) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto channel = grpc::CreateCustomChannel("unix://" + socket, grpc::InsecureChannelCredentials(),
                                           args);
  return channel->WaitForConnected(absl::ToChronoTime(absl::Now() + wait));
}

// Connections to the control socket hold descriptors of the daemon's whether they ever attach
// or not, so the daemon accepts them itself and bounds them per uid and in all. One past the
// bound is closed at once; one that ends, whether its client hangs up or gRPC drops it (bytes
// that are not HTTP/2), gives its place back. The operator socket is not counted, and
// another uid connects while this one is at its bound.
TEST_F(QuotaTest, ControlConnectionsArePerUidAndInAll) {
  StartWithLimits(R"({"connections_per_uid": 6})");
  const std::string prefix = StrCat("ulyssesd_uid_connections{uid=\"", ::getuid(), "\"} ");
  auto connections = [&] {
    const std::string m = Metrics();
    const size_t at = m.find(prefix);
    return at == std::string::npos ? 0 : std::atoi(m.c_str() + at + prefix.size());
  };
  // This fixture's channel alone, once the start-up's health check has hung up.
  ASSERT_TRUE(Eventually([&] { return connections() == 1; })) << Metrics();
  std::vector<ipc::UniqueFd> raw;
  for (int i = 1; i < 6; ++i) {
    absl::StatusOr<ipc::UniqueFd> fd = ipc::ConnectUnix(daemon_.socket(), absl::Seconds(5));
    ASSERT_TRUE(fd.ok()) << fd.status();
    raw.push_back(*std::move(fd));
  }
  EXPECT_TRUE(Eventually([&] { return connections() == 6; })) << Metrics();
  // One more: closed by the daemon at once; a gRPC client's connection too.
  absl::StatusOr<ipc::UniqueFd> extra = ipc::ConnectUnix(daemon_.socket(), absl::Seconds(5));
  ASSERT_TRUE(extra.ok()) << extra.status();
  EXPECT_TRUE(ClosedByPeer(extra->get(), absl::Seconds(10)));
  EXPECT_NE(Metrics().find("ulyssesd_limit_refusals_total{limit=\"connections_per_uid\"} 1"),
            std::string::npos) << Metrics();
  EXPECT_FALSE(NewConnectionServed(daemon_.socket(), absl::Seconds(2)));
  EXPECT_EQ(connections(), 6);
  auto op = v1::Admin::NewStub(grpc::CreateChannel(
      "unix://" + daemon_.socket() + std::string(kOperatorSocketSuffix),
      grpc::InsecureChannelCredentials()));
  {
    v1::DaemonState st;
    grpc::ClientContext ctx;
    EXPECT_TRUE(op->GetState(&ctx, {}, &st).ok());
  }
  ExpectAnotherUidServed();
  // Bytes gRPC cannot take: it drops the connection, and its place is free again.
  const std::string junk = "GET / HTTP/1.1\r\n\r\n";
  ASSERT_EQ(::write(raw[0].get(), junk.data(), junk.size()), static_cast<ssize_t>(junk.size()));
  EXPECT_TRUE(Eventually([&] { return connections() == 5; })) << Metrics();
  EXPECT_TRUE(NewConnectionServed(daemon_.socket(), absl::Seconds(10)));
  // A client that hangs up frees its place too (the channel above did).
  raw.pop_back();
  EXPECT_TRUE(Eventually([&] { return connections() == 4; })) << Metrics();
}

// All uids together: the same, with the daemon-wide bound, of which the last eighth is kept
// for the daemon's own uid (its probes and tools).
TEST_F(QuotaTest, ControlConnectionsOfAllUidsAreBounded) {
  StartWithLimits(R"({"max_connections": 8})");
  const std::string prefix = StrCat("ulyssesd_uid_connections{uid=\"", ::getuid(), "\"} ");
  ASSERT_TRUE(Eventually([&] { return Metrics().find(prefix + "1") != std::string::npos; }))
      << Metrics();
  std::vector<ipc::UniqueFd> raw;
  absl::Status refused;
  int kept = 1;  // the fixture's
  for (int i = 0; i < 12 && refused.ok(); ++i) {
    absl::StatusOr<ipc::UniqueFd> fd = ipc::ConnectUnix(daemon_.socket(), absl::Seconds(5));
    ASSERT_TRUE(fd.ok()) << fd.status();
    if (ClosedByPeer(fd->get(), absl::Milliseconds(300))) {
      refused = absl::UnavailableError(StrCat("connection ", i));
    } else {
      ++kept;
      raw.push_back(*std::move(fd));
    }
  }
  EXPECT_EQ(kept, 8);  // this process runs as the daemon's uid: every place is open to it
  EXPECT_NE(Metrics().find("ulyssesd_limit_refusals_total{limit=\"max_connections\"} 1"),
            std::string::npos) << Metrics();
  EXPECT_FALSE(NewConnectionServed(daemon_.socket(), absl::Seconds(2)));
  if (::geteuid() == 0) {
    // 7 held: another uid finds no place, the daemon's uid finds the last one.
    raw.pop_back();
    ASSERT_TRUE(Eventually([&] { return Metrics().find(prefix + "7") != std::string::npos; }))
        << Metrics();
    pid_t child = -1;
    const int exited = OtherUidClient("attach", &child);
    if (child > 0 && exited == -1) {
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
    }
    if (exited != 77) {
      EXPECT_NE(exited, -1) << "another uid connected past its bound";
    }
    EXPECT_TRUE(NewConnectionServed(daemon_.socket(), absl::Seconds(10)));
  }
  raw.clear();
  EXPECT_TRUE(NewConnectionServed(daemon_.socket(), absl::Seconds(10)));
}

// One liveness stream per client: a second one is refused, so that a client's record (its rings
// and their descriptors) cannot outlive its reclaim on a stream Reclaim does not cancel.
TEST_F(QuotaTest, AClientHasOneLivenessStream) {
  StartWithLimits("{}");
  ASSERT_EQ(NumClients(), 0);  // this fixture's connection is made (two descriptors of its own)
  const int baseline = CountFdsButPipes(daemon_.pid());
  for (int lap = 0; lap < 3; ++lap) {
    absl::StatusOr<Attached> a = Attach();
    ASSERT_TRUE(a.ok()) << a.status();
    absl::StatusOr<ipc::UniqueFd> sock = Bind(*a);
    ASSERT_TRUE(sock.ok()) << sock.status();
    // Two at once: whichever the daemon takes first is the client's, the other is refused.
    Watcher first(*control_, *a), second(*control_, *a);
    ASSERT_TRUE(Eventually([&] { return first.done() || second.done(); }));
    Watcher& refused = first.done() ? first : second;
    Watcher& kept = first.done() ? second : first;
    EXPECT_EQ(refused.code(), grpc::StatusCode::ALREADY_EXISTS);
    EXPECT_FALSE(kept.done());
    // Detach: the kept stream ends with the client, and nothing of it stays.
    {
      grpc::ClientContext ctx;
      Authenticate(&ctx, *a);
      v1::DetachResponse resp;
      ASSERT_TRUE(control_->Detach(&ctx, {}, &resp).ok());
    }
    EXPECT_TRUE(kept.AwaitEnd());
  }
  EXPECT_TRUE(Eventually([&] { return CountFdsButPipes(daemon_.pid()) <= baseline; }))
      << CountFdsButPipes(daemon_.pid()) << " descriptors, " << baseline << " before\n"
      << DescribeFds(daemon_.pid());
}

// A registered memfd is sized and charged before the daemon maps it: one past the client's
// bytes, or past 1 TiB (sparse memfds cost their owner nothing), is refused unmapped.
TEST_F(QuotaTest, ARegisteredMemfdIsCheckedBeforeItIsMapped) {
  StartWithLimits(R"({"buffer_bytes_per_client": 1048576})");
  auto a = Connect("a");
  ASSERT_NE(a, nullptr);
  auto sparse = [](uint64_t bytes) {
    absl::StatusOr<ipc::UniqueFd> fd = ipc::CreateMemfd("sparse", 4096);
    EXPECT_TRUE(fd.ok());
    EXPECT_EQ(::ftruncate(fd->get(), static_cast<off_t>(bytes)), 0);
    EXPECT_TRUE(ipc::SealSize(fd->get()).ok());
    return *std::move(fd);
  };
  ipc::UniqueFd huge = sparse(2ull << 40);
  absl::StatusOr<client::Buffer> refused = a->RegisterBuffer(huge.get(), "huge");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("exceed"), std::string::npos) << refused.status();
  ipc::UniqueFd big = sparse(1ull << 30);
  ExpectExhausted(a->RegisterBuffer(big.get(), "big").status(), "buffer_bytes_per_client");
  ipc::UniqueFd fits = sparse(1ull << 20);
  EXPECT_TRUE(a->RegisterBuffer(fits.get(), "fits").ok());
}

}  // namespace
}  // namespace ulysses::security

