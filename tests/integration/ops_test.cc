// Operations against real daemons: metrics over HTTP, drain and health, SIGTERM, the flight
// recorder, and ranks that disagree about a call.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include "cluster_util.h"
#include "demo_lib.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "nlohmann/json.hpp"
#include "ulysses/client/client.h"
#include "ulysses/common/strings.h"
#include "ulysses/kernels/reference.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulysses/v1/control.grpc.pb.h"

namespace ulysses {
namespace {

using ::testing::HasSubstr;
using testing_util::Eventually;

// Parses Prometheus text into "name{labels}" -> value (comments skipped).
std::map<std::string, double> ParseMetrics(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    out[line.substr(0, sp)] = std::stod(line.substr(sp + 1));
  }
  return out;
}

class Ops : public testing_util::ClusterTest {
 protected:
  std::string ReadyFile(int r) {
    std::ifstream in(StrCat(dir_, "/gpu", r, ".ready"));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  // A client of daemon 0 alone in a group `name`, a float32 session (H = 4, D = 8, S = 8,
  // 2 slots) and an input buffer of that session's shape.
  struct Alone {
    std::unique_ptr<client::Client> client;
    std::optional<client::Group> group;
    std::unique_ptr<client::Session> session;
    client::Buffer x;
  };
  void OpenAlone(const std::string& name, Alone* a) {
    auto c = client::Client::Connect({daemons_[0].socket(), name});
    ASSERT_TRUE(c.ok()) << c.status();
    a->client = std::move(*c);
    auto g = a->client->JoinGroup({name, 1, 0, Members(1), "auto", 0});
    ASSERT_TRUE(g.ok()) << g.status();
    a->group = std::move(*g);
    auto s = a->client->CreateSession(*a->group, {4, 8, DType::kFloat32, 8, 2, {}, 0});
    ASSERT_TRUE(s.ok()) << s.status();
    a->session = std::move(*s);
    auto x = a->client->AllocBuffer(8 * 4 * 8 * 4);
    ASSERT_TRUE(x.ok()) << x.status();
    a->x = *x;
  }
  // Whether daemon `r`'s log holds `text`.
  bool LogHas(int r, const std::string& text) {
    std::ifstream in(StrCat(dir_, "/gpu", r, ".log"));
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str().find(text) != std::string::npos;
  }
  // Runs the demo workload on all ranks from threads.
  void RunWorkload(int n, const std::string& group) {
    std::vector<demo::RankReport> reps(n);
    std::vector<std::thread> ts;
    for (int r = 0; r < n; ++r)
      ts.emplace_back([&, r] {
        demo::Workload w;
        w.members = Members(n);
        w.socket = w.members[r];
        w.world_size = n;
        w.rank = r;
        w.group = group;
        w.num_heads = 4 * n;
        w.head_dim = 16;
        w.seq_local = 8;
        w.iterations = 1;
        reps[r] = demo::RunRank(w);
      });
    for (auto& t : ts) t.join();
    for (auto& rep : reps) ASSERT_TRUE(rep.ok) << rep.error;
  }
};

TEST_F(Ops, MetricsAreScrapedOverHttpAndCountersMoveAfterCalls) {
  Start(2, {"--metrics-address", "127.0.0.1:0"});
  const std::string addr = State(0).metrics_address();
  // No GPU on the host backend: its identity is unknown, so the fields are unset.
  EXPECT_FALSE(State(0).has_device_uuid());
  EXPECT_FALSE(State(0).has_device_pci_bus_id());
  EXPECT_FALSE(State(0).has_device_numa_node());
  ASSERT_THAT(addr, HasSubstr("127.0.0.1:"));
  EXPECT_THAT(ReadyFile(0), HasSubstr(addr));
  const int port = std::stoi(addr.substr(addr.rfind(':') + 1));
  httplib::Client http("127.0.0.1", port);
  auto before_res = http.Get("/metrics");
  ASSERT_TRUE(before_res) << "no answer from " << addr;
  ASSERT_EQ(before_res->status, 200);
  EXPECT_THAT(before_res->get_header_value("Content-Type"), HasSubstr("text/plain"));
  auto before = ParseMetrics(before_res->body);
  EXPECT_EQ(before["ulyssesd_up"], 1);
  EXPECT_EQ(before["ulyssesd_calls_total{op=\"scatter_heads\"}"], 0);
  EXPECT_EQ(before["ulyssesd_clients"], 0);
  // The host backend has no GPU: its identity labels are there, empty.
  EXPECT_EQ(before["ulyssesd_info{version=\"" ULYSSES_VERSION
                   "\",device=\"0\",backend=\"host\",UUID=\"\",pci_bus_id=\"\",numa_node=\"\"}"],
            1);

  RunWorkload(2, "metrics");
  auto after = ParseMetrics(http.Get("/metrics")->body);
  // The workload: 1 scatter, 1 gather, and per band of (1,6,1) one chunk scatter + one merge.
  EXPECT_EQ(after["ulyssesd_calls_total{op=\"scatter_heads\"}"], 1);
  EXPECT_EQ(after["ulyssesd_calls_total{op=\"gather_heads\"}"], 1);
  EXPECT_EQ(after["ulyssesd_calls_total{op=\"scatter_qkv_head_chunk\"}"], 3);
  EXPECT_EQ(after["ulyssesd_calls_total{op=\"gather_output_head_chunk\"}"], 3);
  EXPECT_EQ(after["ulyssesd_call_duration_seconds_count"], 8);
  EXPECT_EQ(after["ulyssesd_call_duration_seconds_bucket{le=\"+Inf\"}"], 8);
  EXPECT_GT(after["ulyssesd_call_duration_seconds_sum"], 0);
  // bf16, B=1, S_l=8, H=8, D=16: each op moves 1*8*8*16*2 = 2048 bytes per rank (the chunk
  // scatter three times that for its band, summed over the bands).
  EXPECT_EQ(after["ulyssesd_bytes_sent_total"], 2048 + 2048 + 3 * 2048 + 2048);
  EXPECT_EQ(after["ulyssesd_call_errors_total{code=\"INVALID_ARGUMENT\"}"], 0);
  auto health = http.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
}

TEST_F(Ops, FailedCallsAreCountedByCodeAndRecorded) {
  Start(1);
  auto c = client::Client::Connect({daemons_[0].socket(), "f"});
  ASSERT_TRUE(c.ok());
  auto g = (*c)->JoinGroup({"f", 1, 0, Members(1), "auto", 0});
  ASSERT_TRUE(g.ok());
  auto s = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 8, 2, {}, 0});
  ASSERT_TRUE(s.ok());
  auto x = (*c)->AllocBuffer(8 * 4 * 8 * 4);
  ASSERT_TRUE(x.ok());
  ASSERT_TRUE((*s)->ScatterHeads(x->Ref(), 1, 8).ok());
  ASSERT_TRUE((*s)->GatherHeads(x->Ref(), 1, 8).ok());
  // A call the daemon refuses: another process's session id, through the raw Control service.
  auto control = testing_util::ControlStub(daemons_[0].socket());
  v1::AttachResponse att;
  {
    grpc::ClientContext actx;
    ASSERT_TRUE(control->Attach(&actx, {}, &att).ok());
  }
  v1::CallRequest bad;
  bad.set_session_id((*s)->id());
  bad.set_op(v1::OP_KIND_GATHER_HEADS);
  v1::CallResponse bad_resp;
  grpc::ClientContext bctx;
  bctx.AddMetadata("ulysses-client-id", std::to_string(att.client_id()));
  bctx.AddMetadata("ulysses-token", att.token());
  EXPECT_EQ(control->Call(&bctx, bad, &bad_resp).error_code(), grpc::StatusCode::PERMISSION_DENIED);
  v1::ListRecentCallsResponse recent;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Admin(0)->ListRecentCalls(&ctx, {}, &recent).ok());
  ASSERT_EQ(recent.calls_size(), 3);
  EXPECT_EQ(recent.calls(0).status(), "PERMISSION_DENIED");  // newest first
  EXPECT_THAT(recent.calls(0).message(), HasSubstr("belongs to another client"));
  EXPECT_EQ(recent.calls(0).client_id(), att.client_id());
  EXPECT_EQ(recent.calls(1).op(), "gather_heads");
  EXPECT_EQ(recent.calls(1).epoch(), 2u);
  EXPECT_EQ(recent.calls(2).op(), "scatter_heads");
  EXPECT_EQ(recent.calls(2).status(), "OK");
  EXPECT_EQ(recent.calls(2).client_id(), (*c)->client_id());
  EXPECT_EQ(recent.calls(2).sent_bytes(), 8u * 4 * 8 * 4);
  EXPECT_LE(recent.calls(2).queued_unix_us(), recent.calls(2).done_unix_us());
  EXPECT_EQ(recent.capacity(), 1024);
  v1::GetMetricsResponse m;
  grpc::ClientContext ctx2;
  ASSERT_TRUE(Admin(0)->GetMetrics(&ctx2, {}, &m).ok());
  auto metrics = ParseMetrics(m.text());
  EXPECT_EQ(metrics["ulyssesd_calls_total{op=\"scatter_heads\"}"], 1);
  EXPECT_EQ(metrics["ulyssesd_call_errors_total{code=\"PERMISSION_DENIED\"}"], 1);
  EXPECT_EQ(metrics["ulyssesd_clients"], 2);
}

TEST_F(Ops, DrainFlipsHealthRefusesNewWorkAndUndrainRestores) {
  Start(1);
  // grpc.health.v1 through ulyssesctl: exit 0 when SERVING, 1 otherwise.
  auto health = [&] {
    const std::string cmd =
        StrCat(ULYSSESCTL_PATH, " --socket ", daemons_[0].socket(), " health > /dev/null 2>&1");
    const int st = std::system(cmd.c_str());
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 1 : 2;
  };
  auto c = client::Client::Connect({daemons_[0].socket(), "before-drain"});
  ASSERT_TRUE(c.ok());
  auto g = (*c)->JoinGroup({"d", 1, 0, Members(1), "auto", 0});
  ASSERT_TRUE(g.ok());
  auto s = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 8, 2, {}, 0});
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(health(), 1);

  v1::DrainResponse dr;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Operator(0)->Drain(&ctx, {}, &dr).ok());
  EXPECT_TRUE(dr.draining());
  EXPECT_TRUE(dr.idle());
  EXPECT_EQ(dr.num_sessions(), 1);
  EXPECT_EQ(health(), 2);
  EXPECT_TRUE(State(0).draining());
  // New sessions and clients are refused; the running session keeps working.
  auto s2 = (*c)->CreateSession(*g, {4, 8, DType::kFloat32, 8, 2, {}, 0});
  EXPECT_EQ(s2.status().code(), absl::StatusCode::kUnavailable);
  auto c2 = client::Client::Connect({daemons_[0].socket(), "during-drain"});
  EXPECT_EQ(c2.status().code(), absl::StatusCode::kUnavailable);
  auto x = (*c)->AllocBuffer(8 * 4 * 8 * 4);
  ASSERT_TRUE(x.ok());
  EXPECT_TRUE((*s)->ScatterHeads(x->Ref(), 1, 8).ok());

  grpc::ClientContext ctx2;
  v1::UndrainResponse ur;
  ASSERT_TRUE(Operator(0)->Undrain(&ctx2, {}, &ur).ok());
  EXPECT_EQ(health(), 1);
  EXPECT_FALSE(State(0).draining());
  EXPECT_TRUE((*c)->CreateSession(*g, {4, 8, DType::kFloat32, 8, 2, {}, 0}).ok());
}

// A daemon whose device stops serving it (here the failpoint device.lost; on a GPU a sticky
// CUDA error or a torn-down MPS client) notices within about a second, turns health to
// NOT_SERVING, stops, and exits with status 3 for its supervisor to start a new one. Its
// client's next call fails instead of hanging.
TEST_F(Ops, ALostDeviceStopsTheDaemonWithExitStatusThree) {
  const std::string lost = StrCat(::testing::TempDir(), "/device-lost-", ::getpid());
  ::unlink(lost.c_str());
  env_ = [&](int) { return std::vector<std::string>{StrCat("ULYSSES_FAILPOINTS=device.lost=", lost)}; };
  Start(1);
  Alone a;
  ASSERT_NO_FATAL_FAILURE(OpenAlone("on-a-lost-device", &a));
  ASSERT_TRUE(a.session->ScatterHeads(a.x.Ref(), 1, 8).ok());
  // Still serving: the check runs every second and finds nothing.
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_FALSE(State(0).draining());
  { std::ofstream(lost) << "lost\n"; }
  auto st = daemons_[0].WaitExit(absl::Seconds(20));
  ::unlink(lost.c_str());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 3) << *st;
  auto after = a.session->ScatterHeads(a.x.Ref(), 1, 8);
  EXPECT_FALSE(after.ok());
}

// A ring worker held inside one step past the call timeout by timeouts.worker_stall_ms (a
// failpoint holds it, as a CUDA call waiting for the device would) is reported while it is
// still there, once, and again when the step returns; the call then completes.
TEST_F(Ops, ARingWorkerHeldInOneStepIsReportedOnceAndWhenItReturns) {
  const std::string release = StrCat(::testing::TempDir(), "release-worker-", ::getpid());
  const std::string config = StrCat(::testing::TempDir(), "stall-", ::getpid(), ".json");
  ::unlink(release.c_str());
  { std::ofstream(config) << R"({"timeouts": {"worker_stall_ms": 200}})"; }
  env_ = [&](int) {
    return std::vector<std::string>{StrCat("ULYSSES_FAILPOINTS=ring_worker.execute=", release)};
  };
  Start(1, {"--config", config, "--call-timeout-ms", "1000"});
  ::unlink(config.c_str());
  Alone a;
  ASSERT_NO_FATAL_FAILURE(OpenAlone("held", &a));
  auto stalls = [&] {
    v1::GetMetricsResponse m;
    grpc::ClientContext ctx;
    EXPECT_TRUE(Admin(0)->GetMetrics(&ctx, {}, &m).ok());
    return ParseMetrics(m.text())["ulyssesd_worker_stalls_total"];
  };
  EXPECT_EQ(stalls(), 0);
  absl::StatusOr<client::Result> r;
  std::thread caller([&] { r = a.session->ScatterHeads(a.x.Ref(), 1, 8); });
  const std::string held =
      StrCat("its ring worker has been executing a call (session ", a.session->id(), ")");
  EXPECT_TRUE(Eventually([&] { return stalls() == 1 && LogHas(0, held); })) << "never reported";
  { std::ofstream(release) << "go\n"; }
  caller.join();
  ::unlink(release.c_str());
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(Eventually([&] {
    return LogHas(0, StrCat("its ring worker returned from executing a call (session ",
                            a.session->id(), ")"));
  })) << "the return was not logged";
  EXPECT_EQ(stalls(), 1) << "one step, reported once";
}

TEST_F(Ops, SigtermWaitsForARunningCallThenExitsZero) {
  Start(2, {"--call-timeout-ms", "20000"});
  std::unique_ptr<client::Client> c0, c1;
  auto a = client::Client::Connect({daemons_[0].socket(), "r0"});
  auto b = client::Client::Connect({daemons_[1].socket(), "r1"});
  ASSERT_TRUE(a.ok() && b.ok());
  c0 = std::move(*a);
  c1 = std::move(*b);
  absl::StatusOr<client::Group> g0, g1;
  std::thread t([&] { g0 = c0->JoinGroup({"t", 2, 0, Members(2), "auto", 5000}); });
  g1 = c1->JoinGroup({"t", 2, 1, Members(2), "auto", 5000});
  t.join();
  ASSERT_TRUE(g0.ok() && g1.ok());
  absl::StatusOr<std::unique_ptr<client::Session>> s0, s1;
  std::thread t2([&] { s0 = c0->CreateSession(*g0, {4, 8, DType::kFloat32, 8, 2, {}, 5000}); });
  s1 = c1->CreateSession(*g1, {4, 8, DType::kFloat32, 8, 2, {}, 5000});
  t2.join();
  ASSERT_TRUE(s0.ok() && s1.ok());
  auto x0 = c0->AllocBuffer(8 * 4 * 8 * 4);
  auto x1 = c1->AllocBuffer(8 * 4 * 8 * 4);
  ASSERT_TRUE(x0.ok() && x1.ok());
  // Rank 0's call waits for rank 1; SIGTERM to rank 0's daemon arrives meanwhile.
  absl::StatusOr<client::Result> r0;
  std::thread caller([&] { r0 = (*s0)->ScatterHeads(x0->Ref(), 1, 8); });
  ASSERT_TRUE([&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      if (State(0).active_calls() == 1) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }());
  ::kill(daemons_[0].pid(), SIGTERM);
  ASSERT_TRUE([&] {  // draining: health NOT_SERVING while the call still runs
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      if (State(0).draining()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }());
  EXPECT_EQ(State(0).active_calls(), 1);
  // Rank 1 now calls: both calls complete, then rank 0's daemon exits 0.
  auto r1 = (*s1)->ScatterHeads(x1->Ref(), 1, 8);
  caller.join();
  EXPECT_TRUE(r0.ok()) << r0.status();
  EXPECT_TRUE(r1.ok()) << r1.status();
  auto st = daemons_[0].Stop(absl::Seconds(20));  // already exiting: this reaps it
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << *st;
}

// A rank that completed an epoch and then left owes its peers nothing for that epoch: the
// peers still waiting in it finish it with the right data. Rank 1 is held (a failpoint)
// between its first arrival store (into rank 0) and the others, so rank 0 completes epoch 1
// while rank 2 still waits for rank 1's block; rank 0's daemon then drains and exits. Ranks 1
// and 2 complete epoch 1; their next call fails at once, naming rank 0.
TEST_F(Ops, ARankThatCompletedAnEpochAndExitedDoesNotFailItsPeersInThatEpoch) {
  constexpr int W = 3, H = 6, D = 8, kSeqLocal = 4;
  const std::string release = StrCat(::testing::TempDir(), "release-rank1-", ::getpid());
  ::unlink(release.c_str());
  env_ = [&](int r) {
    return r == 1 ? std::vector<std::string>{StrCat("ULYSSES_FAILPOINTS=session.after_first_arrival=",
                                                    release)}
                  : std::vector<std::string>{};
  };
  Start(W, {"--call-timeout-ms", "30000"});
  std::vector<std::unique_ptr<client::Client>> c(W);
  for (int r = 0; r < W; ++r) {
    c[r] = Connect(r, StrCat("r", r));
    ASSERT_NE(c[r], nullptr);
  }
  std::vector<absl::StatusOr<client::Group>> g(W);
  std::vector<absl::StatusOr<std::unique_ptr<client::Session>>> s(W);
  std::vector<absl::StatusOr<client::Buffer>> x(W);
  const int64_t elems = int64_t{kSeqLocal} * H * D;
  {
    std::vector<std::thread> ts;
    for (int r = 0; r < W; ++r)
      ts.emplace_back([&, r] {
        g[r] = c[r]->JoinGroup({"left", W, r, Members(W), "auto", 10000});
        if (!g[r].ok()) return;
        s[r] = c[r]->CreateSession(*g[r], {H, D, DType::kFloat32, kSeqLocal, 2, {}, 10000});
        x[r] = c[r]->AllocBuffer(elems * 4);
      });
    for (auto& t : ts) t.join();
  }
  for (int r = 0; r < W; ++r) {
    ASSERT_TRUE(g[r].ok()) << g[r].status();
    ASSERT_TRUE(s[r].ok()) << s[r].status();
    ASSERT_TRUE(x[r].ok()) << x[r].status();
    float* p = static_cast<float*>(x[r]->data);
    for (int64_t i = 0; i < elems; ++i) p[i] = static_cast<float>(r * 100000 + i);
  }
  std::vector<absl::StatusOr<client::Result>> res(W);
  std::vector<std::thread> callers;
  for (int r = 1; r < W; ++r)
    callers.emplace_back([&, r] { res[r] = (*s[r])->ScatterHeads(x[r]->Ref(), 1, kSeqLocal); });
  res[0] = (*s[0])->ScatterHeads(x[0]->Ref(), 1, kSeqLocal);  // completes: rank 1 stored into it
  ASSERT_TRUE(res[0].ok()) << res[0].status();
  ASSERT_TRUE(res[0]->Release().ok());
  ::kill(daemons_[0].pid(), SIGTERM);  // idle: drains at once and exits, closing its session
  auto st = daemons_[0].Stop(absl::Seconds(20));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(WIFEXITED(*st) && WEXITSTATUS(*st) == 0) << *st;
  // Give ranks 1 and 2 time to see the hang-up of rank 0's peer link before rank 1 goes on.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  { std::ofstream(release.c_str()) << "go"; }
  for (auto& t : callers) t.join();
  kernels::ExchangeShape sh{W, 1, kSeqLocal, H, D, 4};
  std::vector<kernels::ConstView> views;
  for (int r = 0; r < W; ++r)
    views.push_back(kernels::ContiguousConstView(x[r]->data, kSeqLocal, H, D));
  auto want = kernels::ScatterHeadsRef(sh, views);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int r = 1; r < W; ++r) {
    ASSERT_TRUE(res[r].ok()) << "rank " << r << ": " << res[r].status();
    ASSERT_EQ(res[r]->bytes, (*want)[r].size());
    EXPECT_EQ(std::memcmp(res[r]->data, (*want)[r].data(), res[r]->bytes), 0) << "rank " << r;
    ASSERT_TRUE(res[r]->Release().ok());
  }
  // Epoch 2 cannot complete without rank 0: it fails at once, naming it.
  auto next = (*s[2])->ScatterHeads(x[2]->Ref(), 1, kSeqLocal);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kAborted) << next.status();
  EXPECT_THAT(next.status().message(), HasSubstr("rank 0"));
  ::unlink(release.c_str());
}

TEST_F(Ops, RanksIssuingDifferentCallsFailInsteadOfMixingData) {
  Start(2);
  auto a = client::Client::Connect({daemons_[0].socket(), "r0"});
  auto b = client::Client::Connect({daemons_[1].socket(), "r1"});
  ASSERT_TRUE(a.ok() && b.ok());
  absl::StatusOr<client::Group> g0, g1;
  std::thread t([&] { g0 = (*a)->JoinGroup({"x", 2, 0, Members(2), "auto", 5000}); });
  g1 = (*b)->JoinGroup({"x", 2, 1, Members(2), "auto", 5000});
  t.join();
  ASSERT_TRUE(g0.ok() && g1.ok());
  absl::StatusOr<std::unique_ptr<client::Session>> s0, s1;
  std::thread t2([&] { s0 = (*a)->CreateSession(*g0, {4, 8, DType::kFloat32, 16, 2, {}, 5000}); });
  s1 = (*b)->CreateSession(*g1, {4, 8, DType::kFloat32, 16, 2, {}, 5000});
  t2.join();
  ASSERT_TRUE(s0.ok() && s1.ok());
  auto x0 = (*a)->AllocBuffer(16 * 4 * 8 * 4);
  auto x1 = (*b)->AllocBuffer(16 * 4 * 8 * 4);
  ASSERT_TRUE(x0.ok() && x1.ok());
  absl::StatusOr<client::Result> r0, r1;
  std::thread c([&] { r0 = (*s0)->ScatterHeads(x0->Ref(), 1, 8); });
  r1 = (*s1)->ScatterHeads(x1->Ref(), 1, 16);  // a different S_l at the same epoch
  c.join();
  EXPECT_FALSE(r0.ok());
  EXPECT_FALSE(r1.ok());
  // At least one rank names the disagreement; the other sees the abort it causes.
  const std::string msgs = StrCat(r0.status().message(), " | ", r1.status().message());
  EXPECT_THAT(msgs, HasSubstr("ranks issued different calls"));
}

}  // namespace
}  // namespace ulysses
