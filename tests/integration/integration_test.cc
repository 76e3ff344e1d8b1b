// Real daemons as separate processes, real clients over real unix sockets (host backend).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <iostream>
#include <thread>

#include "cluster_util.h"
#include "demo_lib.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/shm.h"
#include "ulysses/ipc/unix_socket.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses {
namespace {

using testing_util::Eventually;

using ::testing::HasSubstr;

using Cluster = testing_util::ClusterTest;

demo::Workload MakeWorkload(const std::vector<std::string>& members, int rank,
                            const std::string& group) {
  demo::Workload w;
  w.members = members;
  w.socket = members[rank];
  w.world_size = static_cast<int32_t>(members.size());
  w.rank = rank;
  w.group = group;
  w.batch = 2;
  w.seq_local = 7;
  w.num_heads = 14 * w.world_size;
  w.head_dim = 32;
  w.schedule = {3, 8, 3};
  w.iterations = 2;
  return w;
}

TEST_F(Cluster, FourRanksBitExactFromClientThreads) {
  Start(4);
  std::vector<demo::RankReport> reports(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r)
    threads.emplace_back([&, r] { reports[r] = demo::RunRank(MakeWorkload(Members(4), r, "g4")); });
  for (auto& t : threads) t.join();
  for (auto& rep : reports) {
    EXPECT_TRUE(rep.ok) << "rank " << rep.rank << ": " << rep.error;
    EXPECT_GT(rep.checks, 0);
    EXPECT_EQ(rep.backend, "host");
  }
}

TEST_F(Cluster, TwoClientsShareEachDaemonWithSeparateGroups) {
  Start(2);
  std::vector<demo::RankReport> reports(4);
  std::vector<std::thread> threads;
  for (int g = 0; g < 2; ++g)
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, g, r] {
        demo::Workload w = MakeWorkload(Members(2), r, StrCat("replica-", g));
        w.dtype = g == 0 ? DType::kBFloat16 : DType::kFloat32;  // different sessions, geometries
        reports[g * 2 + r] = demo::RunRank(w);
      });
  for (auto& t : threads) t.join();
  for (auto& rep : reports) EXPECT_TRUE(rep.ok) << rep.error;
}

TEST_F(Cluster, AdminListsClientsWithTheirProcessAndSessions) {
  Start(1);
  auto c = Connect(0, "lister");
  ASSERT_NE(c, nullptr);
  auto buf = c->AllocBuffer(4096, "x");
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto g = c->JoinGroup({"solo", 1, 0, Members(1), "auto", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->backend, "host");
  auto s = c->CreateSession(*g, {8, 16, DType::kBFloat16, 32, 2, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  auto clients = ListClients(0);
  ASSERT_EQ(clients.size(), 1u);
  EXPECT_EQ(clients[0].name(), "lister");
  EXPECT_EQ(clients[0].pid(), ::getpid());
  EXPECT_EQ(clients[0].reported_pid(), ::getpid());  // one PID namespace: both agree
  EXPECT_EQ(clients[0].uid(), static_cast<int64_t>(::getuid()));
  EXPECT_EQ(clients[0].num_buffers(), 1);
  EXPECT_EQ(clients[0].buffer_bytes(), 4096u);
  EXPECT_EQ(clients[0].num_sessions(), 1);
  EXPECT_EQ(NumSessions(0), 1);
  ASSERT_TRUE((*s)->Close().ok());
  EXPECT_EQ(NumSessions(0), 0);
  ASSERT_TRUE(c->Close().ok());
  EXPECT_TRUE(Eventually([&] { return ListClients(0).empty(); }));
}

// The pid a client reports is only shown; one that no process can have is refused, naming it,
// and the refused attach leaves no client behind.
TEST_F(Cluster, AReportedPidThatIsNoPidIsRefused) {
  Start(1);
  auto stub = testing_util::ControlStub(daemons_[0].socket());
  for (int64_t bad : {int64_t{-1}, int64_t{1} << 22, int64_t{1} << 40}) {
    v1::AttachRequest req;
    req.set_client_name("liar");
    req.set_reported_pid(bad);
    v1::AttachResponse resp;
    grpc::ClientContext ctx;
    const grpc::Status st = stub->Attach(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
    EXPECT_NE(st.error_message().find("reported_pid"), std::string::npos) << st.error_message();
  }
  EXPECT_TRUE(ListClients(0).empty());
}

// A client that goes away while its JoinGroup waits for the other ranks (its process died, or
// it gave up) ends the step for every rank: the ranks already waiting get ABORTED naming it at
// once, not DEADLINE_EXCEEDED at the end of the rendezvous timeout (60 s here).
// A buffer freed while a call that names it waits in the ring: the daemon finds it gone when
// it takes the descriptor, refuses that call and spends its epoch, so the peer's call of the
// same epoch ends with ABORTED at once instead of waiting out the call timeout, and the
// earlier call is unaffected.
TEST_F(Cluster, ABufferFreedUnderAQueuedCallAbortsThatCallOnEveryRank) {
  Start(2, {"--call-timeout-ms", "600000"});
  const std::vector<std::string> members = Members(2);
  std::vector<std::unique_ptr<client::Client>> c;
  for (int r = 0; r < 2; ++r) c.push_back(Connect(r, "freed"));
  ASSERT_NE(c[0], nullptr);
  ASSERT_NE(c[1], nullptr);
  std::vector<absl::StatusOr<client::Group>> g(2);
  {
    std::thread t([&] { g[1] = c[1]->JoinGroup({"freed", 2, 1, members, "host", 0}); });
    g[0] = c[0]->JoinGroup({"freed", 2, 0, members, "host", 0});
    t.join();
  }
  ASSERT_TRUE(g[0].ok() && g[1].ok()) << g[0].status() << " " << g[1].status();
  const client::SessionSpec spec{4, 8, DType::kFloat32, 16, 2, {}, 0};
  std::vector<absl::StatusOr<std::unique_ptr<client::Session>>> s(2);
  {
    std::thread t([&] { s[1] = c[1]->CreateSession(*g[1], spec); });
    s[0] = c[0]->CreateSession(*g[0], spec);
    t.join();
  }
  ASSERT_TRUE(s[0].ok() && s[1].ok()) << s[0].status() << " " << s[1].status();
  const uint64_t bytes = 16 * 4 * 8 * 4;
  auto a0 = c[0]->AllocBuffer(bytes, "a");
  auto b0 = c[0]->AllocBuffer(bytes, "b");
  auto x1 = c[1]->AllocBuffer(bytes, "x");
  ASSERT_TRUE(a0.ok() && b0.ok() && x1.ok());
  CallArgs first;
  first.op = OpKind::kScatterHeads;
  first.batch = 1;
  first.seq = 16;
  first.inputs[0] = a0->Ref();
  CallArgs second = first;
  second.inputs[0] = b0->Ref();
  // Rank 0 queues both calls: its worker takes the first, which waits for rank 1; the second
  // stays in the ring while its buffer is freed.
  auto e1 = (*s[0])->Submit(first);
  auto e2 = (*s[0])->Submit(second);
  ASSERT_TRUE(e1.ok() && e2.ok()) << e1.status() << " " << e2.status();
  ASSERT_TRUE(Eventually([&] { return State(0).active_calls() == 1; }));
  ASSERT_TRUE(c[0]->FreeBuffer(b0->id).ok());
  // Rank 1 makes both calls.
  absl::StatusOr<client::Result> r1_first, r1_second;
  std::thread rank1([&] {
    r1_first = (*s[1])->ScatterHeads(x1->Ref(), 1, 16);
    if (r1_first.ok()) (void)r1_first->Release();
    r1_second = (*s[1])->ScatterHeads(x1->Ref(), 1, 16);
  });
  auto w1 = (*s[0])->Wait(*e1, absl::Seconds(60));
  EXPECT_TRUE(w1.ok()) << w1.status();
  if (w1.ok()) {
    EXPECT_TRUE(w1->Release().ok());
  }
  auto w2 = (*s[0])->Wait(*e2, absl::Seconds(60));
  rank1.join();
  EXPECT_TRUE(r1_first.ok()) << r1_first.status();
  std::cout << "rank 0's second call: " << w2.status() << "\nrank 1's: " << r1_second.status()
            << "\n";
  ASSERT_FALSE(w2.ok());
  EXPECT_THAT(std::string(w2.status().message()), HasSubstr("buffer")) << w2.status();
  ASSERT_FALSE(r1_second.ok());
  EXPECT_EQ(r1_second.status().code(), absl::StatusCode::kAborted) << r1_second.status();
}

TEST_F(Cluster, AClientThatLeavesDuringJoinGroupAbortsTheRanksWaiting) {
  Start(3);
  const std::vector<std::string> members = Members(3);
  // Rank 0 joins first and waits for ranks 1 and 2 (rank 2 never comes).
  auto c0 = Connect(0, "stayer");
  ASSERT_NE(c0, nullptr);
  absl::Status joined;
  std::thread stayer([&] { joined = c0->JoinGroup({"left", 3, 0, members, "host", 60000}).status(); });
  ASSERT_TRUE(Eventually([&] { return State(0).pending_rendezvous() == 1; }));
  // Rank 1: a raw client whose JoinGroup gives up after 3 s (its call's deadline), while the
  // step still waits for rank 2.
  auto stub = testing_util::ControlStub(members[1]);
  v1::AttachRequest areq;
  areq.set_client_name("leaver");
  v1::AttachResponse ares;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Attach(&ctx, areq, &ares).ok());
  }
  v1::JoinGroupRequest jreq;
  jreq.set_name("left");
  jreq.set_world_size(3);
  jreq.set_rank(1);
  for (const std::string& m : members) jreq.add_members(m);
  jreq.set_backend("host");
  jreq.set_timeout_ms(60000);
  grpc::ClientContext jctx;
  jctx.AddMetadata("ulysses-client-id", std::to_string(ares.client_id()));
  jctx.AddMetadata("ulysses-token", ares.token());
  jctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  v1::GroupInfo info;
  const grpc::Status left = stub->JoinGroup(&jctx, jreq, &info);
  stayer.join();
  EXPECT_EQ(left.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << left.error_message();
  EXPECT_EQ(joined.code(), absl::StatusCode::kAborted) << joined;
  EXPECT_THAT(std::string(joined.message()), ::testing::HasSubstr("rank 1's client went away"))
      << joined;
  EXPECT_TRUE(Eventually([&] { return State(0).pending_rendezvous() == 0; }));
}

TEST_F(Cluster, KilledClientProcessIsForgottenAndItsSessionReleased) {
  Start(1);
  // A real client process (the demo's rank program) that holds its session open.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(ULYSSES_DEMO_PATH, ULYSSES_DEMO_PATH, "--client-rank", "0", "--ranks", "1",
            "--run-dir", dir_.c_str(), "--hold-seconds", "120", "--iterations", "1",
            static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_TRUE(Eventually([&] { return NumSessions(0) == 1; }));
  auto clients = ListClients(0);
  ASSERT_EQ(clients.size(), 1u);
  EXPECT_EQ(clients[0].pid(), pid);
  EXPECT_EQ(clients[0].reported_pid(), pid);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  EXPECT_TRUE(Eventually([&] { return ListClients(0).empty() && NumSessions(0) == 0; }));
  // The daemon still serves new clients.
  auto c = Connect(0, "after");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(ListClients(0).size(), 1u);
}

std::string RunCtl(const std::string& socket, const std::string& args, int* exit_code) {
  const std::string cmd = StrCat(ULYSSESCTL_PATH, " --socket ", socket, " ", args, " 2>&1");
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = ::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int st = ::pclose(p);
  *exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return out;
}

TEST_F(Cluster, UlyssesctlShowsTheClientsAndSessionsOfARunningDemo) {
  Start(2);
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string rank = std::to_string(r);
      ::execl(ULYSSES_DEMO_PATH, ULYSSES_DEMO_PATH, "--client-rank", rank.c_str(), "--ranks", "2",
              "--run-dir", dir_.c_str(), "--hold-seconds", "120", "--iterations", "1",
              static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  ASSERT_TRUE(Eventually([&] { return NumSessions(0) == 1 && NumSessions(1) == 1; }));
  for (int r = 0; r < 2; ++r) {
    int rc = -1;
    auto clients = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json clients", &rc));
    EXPECT_EQ(rc, 0);
    ASSERT_EQ(clients["clients"].size(), 1u);
    EXPECT_EQ(clients["clients"][0]["pid"].get<int64_t>(), pids[r]);
    EXPECT_EQ(clients["clients"][0]["name"].get<std::string>(), StrCat("demo-rank-", r));
    EXPECT_EQ(clients["clients"][0]["num_sessions"].get<int>(), 1);
    auto sessions = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json sessions", &rc));
    EXPECT_EQ(rc, 0);
    ASSERT_EQ(sessions["sessions"].size(), 1u);
    EXPECT_EQ(sessions["sessions"][0]["info"]["world_size"].get<int>(), 2);
    EXPECT_EQ(sessions["sessions"][0]["info"]["rank"].get<int>(), r);
    EXPECT_EQ(sessions["sessions"][0]["info"]["backend"].get<std::string>(), "host");
    EXPECT_GT(sessions["sessions"][0]["calls"].get<int>(), 0);
    auto groups = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json groups", &rc));
    EXPECT_EQ(rc, 0);
    ASSERT_EQ(groups["groups"].size(), 1u);
    EXPECT_EQ(groups["groups"][0]["info"]["name"].get<std::string>(), "demo");
    auto status = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json status", &rc));
    EXPECT_EQ(rc, 0);
    EXPECT_EQ(status["num_clients"].get<int>(), 1);
    EXPECT_EQ(status["num_sessions"].get<int>(), 1);
    EXPECT_EQ(status["backend"].get<std::string>(), "host");
    const std::string table = RunCtl(daemons_[r].socket(), "sessions", &rc);
    EXPECT_EQ(rc, 0);
    EXPECT_THAT(table, HasSubstr("host"));
    RunCtl(daemons_[r].socket(), "health", &rc);
    EXPECT_EQ(rc, 0);
    // Slots: the demo's session has two, owned by its client, with the epochs it reached.
    auto slots = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json slots", &rc));
    EXPECT_EQ(rc, 0);
    ASSERT_EQ(slots["slots"].size(), 2u);
    for (const auto& s : slots["slots"]) {
      EXPECT_EQ(s["owner_client_id"], clients["clients"][0]["client_id"]);
      EXPECT_GT(s["epoch"].get<uint64_t>(), 0u);
    }
    EXPECT_THAT(RunCtl(daemons_[r].socket(), "slots", &rc), HasSubstr("OWNER"));
    // The flight recorder holds the demo's calls.
    auto recent = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json recent --limit 3", &rc));
    EXPECT_EQ(rc, 0);
    ASSERT_EQ(recent["calls"].size(), 3u);
    EXPECT_EQ(recent["calls"][0]["status"], "OK");
    EXPECT_THAT(RunCtl(daemons_[r].socket(), "recent", &rc), HasSubstr("scatter_qkv_head_chunk"));
    // Metrics, parsed by ulyssesctl from the daemon's exposition.
    auto metrics = nlohmann::json::parse(RunCtl(daemons_[r].socket(), "--json metrics", &rc));
    EXPECT_EQ(rc, 0);
    double scatter_calls = -1;
    for (const auto& m : metrics["metrics"])
      if (m["name"] == "ulyssesd_calls_total" && m["labels"]["op"] == "scatter_heads")
        scatter_calls = m["value"].get<double>();
    EXPECT_EQ(scatter_calls, 1);
    EXPECT_THAT(RunCtl(daemons_[r].socket(), "metrics", &rc), HasSubstr("ulyssesd_clients 1"));
  }
  // Drain and undrain flip health; drain --wait returns once idle.
  int rc = -1;
  auto drained = nlohmann::json::parse(RunCtl(daemons_[0].socket(), "--json drain --wait", &rc));
  EXPECT_EQ(rc, 0);
  EXPECT_TRUE(drained["draining"].get<bool>());
  EXPECT_TRUE(drained["idle"].get<bool>());
  RunCtl(daemons_[0].socket(), "health", &rc);
  EXPECT_EQ(rc, 1);
  EXPECT_THAT(RunCtl(daemons_[0].socket(), "undrain", &rc), HasSubstr("serving"));
  EXPECT_EQ(rc, 0);
  RunCtl(daemons_[0].socket(), "health", &rc);
  EXPECT_EQ(rc, 0);
  for (pid_t pid : pids) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  EXPECT_TRUE(Eventually([&] { return ListClients(0).empty() && ListClients(1).empty(); }));
}

TEST_F(Cluster, ClientsCannotUseEachOthersSessionsOrBuffers) {
  Start(1);
  auto a = Connect(0, "a");
  auto b = Connect(0, "b");
  ASSERT_TRUE(a && b);
  auto ga = a->JoinGroup({"ga", 1, 0, Members(1), "host", 0});
  ASSERT_TRUE(ga.ok()) << ga.status();
  auto sa = a->CreateSession(*ga, {4, 8, DType::kFloat32, 16, 2, {}, 0});
  ASSERT_TRUE(sa.ok()) << sa.status();
  auto xb = b->AllocBuffer(4 * 16 * 4 * 8, "b's");
  ASSERT_TRUE(xb.ok());

  // b's buffer through a's session: the client library does not know that id.
  auto r1 = (*sa)->ScatterHeads(xb->Ref(), 1, 16);
  EXPECT_EQ(r1.status().code(), absl::StatusCode::kInvalidArgument);
  // The daemon never trusts a client: a raw call with b's buffer id is refused with
  // PERMISSION_DENIED naming the operand, and a's session id from b likewise.
  auto stub = testing_util::ControlStub(daemons_[0].socket());
  v1::AttachRequest areq;
  v1::AttachResponse ares;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->Attach(&ctx, areq, &ares).ok());
  }
  v1::CallRequest call;
  call.set_session_id((*sa)->id());
  call.set_op(v1::OP_KIND_SCATTER_HEADS);
  call.set_batch(1);
  call.set_seq(16);
  call.add_inputs()->set_buffer_id(xb->id);
  v1::CallResponse cresp;
  grpc::ClientContext ctx;
  ctx.AddMetadata("ulysses-client-id", std::to_string(ares.client_id()));
  ctx.AddMetadata("ulysses-token", ares.token());
  grpc::Status st = stub->Call(&ctx, call, &cresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_THAT(st.error_message(), HasSubstr("session_id"));
  // A forged token is refused.
  grpc::ClientContext ctx2;
  ctx2.AddMetadata("ulysses-client-id", std::to_string(a->client_id()));
  ctx2.AddMetadata("ulysses-token", "forged");
  st = stub->Call(&ctx2, call, &cresp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
}

TEST_F(Cluster, DaemonRevalidatesAndWritesNothingOnBadCalls) {
  Start(1);
  auto a = Connect(0, "a");
  ASSERT_NE(a, nullptr);
  auto g = a->JoinGroup({"v", 1, 0, Members(1), "auto", 0});
  ASSERT_TRUE(g.ok());
  auto s = a->CreateSession(*g, {4, 8, DType::kBFloat16, 16, 2, {}, 0});
  ASSERT_TRUE(s.ok());
  auto x = a->AllocBuffer(16 * 4 * 8 * 2, "x");
  ASSERT_TRUE(x.ok());
  // Client-side verdicts, same codes and argument names as the daemon's.
  auto r = (*s)->ScatterHeads(x->Ref(), 1, 17);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("max_tokens"));
  r = (*s)->ScatterHeads(x->Ref(2), 1, 16);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("x: bytes"));
  r = (*s)->ScatterQkvHeadChunk(x->Ref(), x->Ref(), x->Ref(), 1, 4, 3, 2);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("exceeds local_heads"));
  // A good call afterwards is epoch 1: nothing was submitted before it.
  r = (*s)->ScatterHeads(x->Ref(), 1, 16);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->epoch, 1u);
}

TEST_F(Cluster, MismatchedGroupOrSessionArgumentsFailOnEveryRank) {
  Start(2);
  auto c0 = Connect(0, "r0");
  auto c1 = Connect(1, "r1");
  ASSERT_TRUE(c0 && c1);
  absl::StatusOr<client::Group> g0, g1;
  std::thread t([&] { g0 = c0->JoinGroup({"m", 2, 0, Members(2), "auto", 5000}); });
  g1 = c1->JoinGroup({"m", 2, 1, Members(2), "host", 5000});
  t.join();
  EXPECT_EQ(g0.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(g1.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(g0.status().message()), HasSubstr("mismatch"));

  std::thread t2([&] { g0 = c0->JoinGroup({"m2", 2, 0, Members(2), "auto", 5000}); });
  g1 = c1->JoinGroup({"m2", 2, 1, Members(2), "auto", 5000});
  t2.join();
  ASSERT_TRUE(g0.ok() && g1.ok()) << g0.status() << g1.status();
  absl::StatusOr<std::unique_ptr<client::Session>> s0, s1;
  std::thread t3([&] { s0 = c0->CreateSession(*g0, {8, 16, DType::kBFloat16, 32, 2, {}, 5000}); });
  s1 = c1->CreateSession(*g1, {8, 16, DType::kBFloat16, 64, 2, {}, 5000});
  t3.join();
  EXPECT_EQ(s0.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s1.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s1.status().message()), HasSubstr("max_tokens=32"));
  EXPECT_EQ(NumSessions(0), 0);
  EXPECT_EQ(NumSessions(1), 0);
}

TEST_F(Cluster, MissingPeerTimesOutAndClosedPeerAborts) {
  Start(2, {"--call-timeout-ms", "1500"});
  auto c0 = Connect(0, "r0");
  auto c1 = Connect(1, "r1");
  ASSERT_TRUE(c0 && c1);
  absl::StatusOr<client::Group> g0, g1;
  std::thread t([&] { g0 = c0->JoinGroup({"p", 2, 0, Members(2), "auto", 5000}); });
  g1 = c1->JoinGroup({"p", 2, 1, Members(2), "auto", 5000});
  t.join();
  ASSERT_TRUE(g0.ok() && g1.ok());
  absl::StatusOr<std::unique_ptr<client::Session>> s0, s1;
  std::thread t2([&] { s0 = c0->CreateSession(*g0, {4, 8, DType::kFloat32, 8, 2, {}, 5000}); });
  s1 = c1->CreateSession(*g1, {4, 8, DType::kFloat32, 8, 2, {}, 5000});
  t2.join();
  ASSERT_TRUE(s0.ok() && s1.ok());
  auto x0 = c0->AllocBuffer(8 * 4 * 8 * 4);
  ASSERT_TRUE(x0.ok());
  // Rank 1 never calls: rank 0's call ends with DEADLINE_EXCEEDED, and the session is broken.
  auto r = (*s0)->ScatterHeads(x0->Ref(), 1, 8);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  r = (*s0)->ScatterHeads(x0->Ref(), 1, 8);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  // Rank 1's next call sees rank 0's abort at once instead of waiting out its timeout.
  auto x1 = c1->AllocBuffer(8 * 4 * 8 * 4);
  ASSERT_TRUE(x1.ok());
  r = (*s1)->ScatterHeads(x1->Ref(), 1, 8);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted);
}

TEST_F(Cluster, UnavailableDaemonIsAClearError) {
  auto c = client::Client::Connect({"/tmp/ulysses-no-such-daemon.sock", "x", absl::Milliseconds(200)});
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("no ulyssesd answers"));
}

// A daemon forced onto the nccl backend where it cannot run (no GPU, or a build without NCCL)
// refuses to start and names the backend and why; a host daemon asked for an nccl group says
// which backend it runs instead. The same verdict on every rank, before any rendezvous.
TEST_F(Cluster, NcclWhereItCannotRunIsAClearFailedPrecondition) {
  if (ipc::cuda::DeviceCount() > 0 && ULYSSES_TEST_HAVE_NCCL)
    GTEST_SKIP() << "this machine runs the nccl backend (tests/gpu cover it)";
  auto dir = demo::MakeRunDir();
  ASSERT_TRUE(dir.ok()) << dir.status();
  auto d = demo::StartDaemon(testing_util::UlyssesdPath(), *dir, 0, "nccl");
  demo::RemoveRunDir(*dir);
  ASSERT_FALSE(d.ok()) << "ulyssesd --backend nccl started without a GPU or NCCL";
  EXPECT_THAT(std::string(d.status().message()), HasSubstr("backend: 'nccl' cannot run: "));

  Start(2);
  std::vector<absl::StatusOr<client::Group>> groups(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      auto c = client::Client::Connect({Members(2)[r], "nccl", absl::Seconds(10)});
      if (!c.ok()) return void(groups[r] = c.status());
      groups[r] = (*c)->JoinGroup({"nccl", 2, r, Members(2), "nccl", 2000});
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(groups[r].status().code(), absl::StatusCode::kFailedPrecondition) << groups[r].status();
    EXPECT_THAT(std::string(groups[r].status().message()),
                HasSubstr("backend: 'nccl' is not available: this daemon runs the host backend"));
  }
}

TEST_F(Cluster, SigtermStopsTheDaemonCleanly) {
  Start(1);
  auto c = Connect(0, "c");
  ASSERT_NE(c, nullptr);
  const std::string sock = daemons_[0].socket();
  auto st = daemons_[0].Stop();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(WIFEXITED(*st));
  EXPECT_EQ(WEXITSTATUS(*st), 0);
  EXPECT_NE(::access(sock.c_str(), F_OK), 0) << "socket left behind";
}

}  // namespace
}  // namespace ulysses
