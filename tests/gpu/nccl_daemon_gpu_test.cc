// The nccl backend end to end: W ulyssesd processes with `--backend nccl` and real clients. NCCL
// refuses two ranks on one GPU, so each daemon gets its own NCCL_HOSTID: every rank is then its
// own host and NCCL moves the blocks over its socket transport (a test mode: correct, not
// fast). Results are checked bit for bit against the index semantics. Skips without a CUDA
// device.
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "cluster_util.h"
#include "gpu_workload.h"
#include "gtest/gtest.h"
#include "proc_util.h"
#include "ulysses/client/client.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"

namespace ulysses {
namespace {

class NcclCluster : public testing_util::ClusterTest {
 protected:
  void SetUp() override {
    if (ipc::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = "nccl";
    env_ = [](int r) { return std::vector<std::string>{StrCat("NCCL_HOSTID=ulysses-test-", r)}; };
  }

  // Joins group `name` of `world` ranks from every rank's client at once.
  std::vector<client::Group> JoinAll(std::vector<std::unique_ptr<client::Client>>& clients,
                                     const std::string& name, const std::string& backend = "nccl") {
    const int world = static_cast<int>(clients.size());
    std::vector<absl::StatusOr<client::Group>> groups(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] {
        groups[r] = clients[r]->JoinGroup({name, world, r, Members(world), backend, 0});
      });
    for (auto& t : threads) t.join();
    std::vector<client::Group> out;
    for (auto& g : groups) {
      EXPECT_TRUE(g.ok()) << g.status();
      if (g.ok()) out.push_back(*g);
    }
    return out;
  }

  // Runs fn(r) for every rank r at once, one thread each; fn returns "" or what went wrong.
  // The ranks' answers, by rank.
  static std::vector<std::string> OnEveryRank(int world, const std::function<std::string(int)>& fn) {
    std::vector<std::string> errors(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { errors[r] = fn(r); });
    for (auto& t : threads) t.join();
    return errors;
  }

  std::vector<std::unique_ptr<client::Session>> CreateAll(
      std::vector<std::unique_ptr<client::Client>>& clients, std::vector<client::Group>& groups,
      const client::SessionSpec& spec) {
    const int world = static_cast<int>(clients.size());
    std::vector<absl::StatusOr<std::unique_ptr<client::Session>>> sessions(world);
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&, r] { sessions[r] = clients[r]->CreateSession(groups[r], spec); });
    for (auto& t : threads) t.join();
    std::vector<std::unique_ptr<client::Session>> out;
    for (auto& s : sessions) {
      EXPECT_TRUE(s.ok()) << s.status();
      if (s.ok()) out.push_back(std::move(*s));
    }
    return out;
  }
};

using testing_util::WorkloadShape;

class NcclSemantics : public NcclCluster, public testing::WithParamInterface<WorkloadShape> {};

// Every op, bit-exact, through NCCL (gpu_workload.h).
TEST_P(NcclSemantics, EveryOpBitExact) {
  Start(GetParam().world);
  testing_util::RunWorkloadOnEveryRank(Members(GetParam().world), GetParam(), "nccl");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, NcclSemantics,
    testing::Values(WorkloadShape{1, 1, 64, 8, 128, DType::kBFloat16, {}},
                    WorkloadShape{2, 2, 200, 14, 128, DType::kBFloat16, {2, 10, 2}},
                    WorkloadShape{2, 1, 33, 6, 64, DType::kFloat32, {1, 4, 1}},
                    WorkloadShape{2, 2, 21, 5, 64, DType::kFloat16, {1, 3, 1}},
                    WorkloadShape{4, 2, 17, 28, 128, DType::kBFloat16, {7, 14, 7}},
                    WorkloadShape{4, 1, 9, 3, 3, DType::kFloat32, {1, 1, 1}},  // scalar, odd D
                    WorkloadShape{4, 1, 11, 2, 3, DType::kFloat16, {1, 1}},    // scalar, odd D
                    WorkloadShape{4, 2, 5, 2, 96, DType::kFloat32, {2}}),
    testing_util::WorkloadName);

// out= into a strided view: [1, 2S, HL, D] with the token stride doubled, the result is copied
// there and the slot given back at once.
TEST_F(NcclCluster, OutCopiesIntoAStridedView) {
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "strided"));
  auto groups = JoinAll(clients, "strided");
  ASSERT_EQ(groups.size(), 2u);
  const int H = 4, D = 32, S = 8, HL = H / 2;
  auto sessions = CreateAll(clients, groups, {H, D, DType::kFloat32, S, 2, {}, 0});
  ASSERT_EQ(sessions.size(), 2u);
  const std::vector<std::string> errors = OnEveryRank(2, [&](int r) -> std::string {
    const size_t n = static_cast<size_t>(S) * H * D;
    auto x = clients[r]->AllocBuffer(n * 4, "x");
    auto out = clients[r]->AllocBuffer(2 * n * 4, "out");
    if (!x.ok() || !out.ok()) return "alloc";
    std::vector<float> xh(n);
    for (size_t i = 0; i < n; ++i) xh[i] = static_cast<float>(r * 100000 + i);
    if (!ipc::cuda::Copy(x->data, xh.data(), n * 4).ok()) return "upload";
    if (!ipc::cuda::Fill(out->data, 0xff, 2 * n * 4).ok()) return "fill";
    const std::array<int64_t, 4> strides{2 * S * HL * D * 2, HL * D * 2, D, 1};
    auto res = sessions[r]->ScatterHeads(x->Ref(), 1, S, out->Ref(0, strides));
    if (!res.ok()) return res.status().ToString();
    std::vector<float> outh(2 * n);
    if (!ipc::cuda::Copy(outh.data(), out->data, 2 * n * 4).ok()) return "read out";
    return testing_util::CheckScatterOut(outh, r, S, H, HL, D, 2 * HL * D);
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Staging is made with the session: calls allocate no device memory, and the daemons' device
// memory returns to its baseline once the sessions and clients go.
TEST_F(NcclCluster, NoDeviceAllocationPerCallAndMemoryBackToBaseline) {
  Start(2);
  uint64_t baseline[2];
  for (int r = 0; r < 2; ++r) baseline[r] = State(r).device_bytes();
  std::vector<std::string> errors(2);
  std::vector<uint64_t> after_first(2), after_many(2), host_first(2), host_many(2);
  {
    std::vector<std::unique_ptr<client::Client>> clients;
    for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "alloc"));
    auto groups = JoinAll(clients, "alloc");
    ASSERT_EQ(groups.size(), 2u);
    auto sessions = CreateAll(clients, groups, {8, 128, DType::kBFloat16, 256, 2, {}, 0});
    ASSERT_EQ(sessions.size(), 2u);
    errors = OnEveryRank(2, [&](int r) -> std::string {
      auto x = clients[r]->AllocBuffer(256 * 8 * 128 * 2, "x");
      auto out = clients[r]->AllocBuffer(2 * 256 * 4 * 128 * 2, "out");
      if (!x.ok() || !out.ok()) return "alloc";
      for (int i = 0; i < 21; ++i) {
        auto res = sessions[r]->ScatterHeads(x->Ref(), 1, 256, out->Ref());
        if (!res.ok()) return res.status().ToString();
        if (i == 0) {
          after_first[r] = State(r).device_allocations();
          host_first[r] = State(r).call_path_host_allocations();
        }
      }
      after_many[r] = State(r).device_allocations();
      host_many[r] = State(r).call_path_host_allocations();
      return "";
    });
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    EXPECT_GT(after_first[r], 0u);
    EXPECT_EQ(after_many[r], after_first[r]) << "rank " << r << " allocated during calls";
    EXPECT_TRUE(State(r).host_allocations_counted()) << "rank " << r;
    EXPECT_EQ(host_many[r], host_first[r]) << "rank " << r << "'s call path allocated host memory";
    EXPECT_TRUE(testing_util::Eventually([&] { return State(r).device_bytes() == baseline[r]; }))
        << "rank " << r << ": " << State(r).device_bytes() << " bytes held, baseline "
        << baseline[r];
  }
}

// Listening TCP sockets of process `pid` and of its children (rank 0's daemon runs NCCL's
// bootstrap root in a helper process).
int ListeningWithChildren(pid_t pid) {
  int n = testing_util::ListeningTcpSockets(pid);
  for (pid_t child : testing_util::ChildrenOf(pid)) n += testing_util::ListeningTcpSockets(child);
  return n;
}

// A session some rank fails to create (here the ranks disagree on its arguments) makes no
// NCCL unique id: making one starts NCCL's bootstrap root, a thread listening on a TCP socket
// until every rank has joined. Rank 0's daemon and its children listen on as many TCP sockets
// after such failures as before, and it has no child left; a session that opens then does
// listen on more (NCCL's bootstrap), so the count can see them.
TEST_F(NcclCluster, ASessionSomeRankCouldNotCreateLeavesNoNcclListenerBehind) {
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "bootstrap"));
  std::vector<client::Group> groups = JoinAll(clients, "bootstrap");
  ASSERT_EQ(groups.size(), 2u);
  const pid_t rank0 = daemons_[0].pid();
  const int before = ListeningWithChildren(rank0);
  for (int attempt = 0; attempt < 3; ++attempt) {
    const std::vector<std::string> errors = OnEveryRank(2, [&](int r) -> std::string {
      // The ranks disagree on num_slots: every rank's CreateSession fails.
      const client::SessionSpec spec{8, 64, DType::kBFloat16, 64, 2 + r, {}, 5000};
      auto s = clients[r]->CreateSession(groups[r], spec);
      return s.ok() ? "created" : "";
    });
    ASSERT_EQ(errors[0], "") << "attempt " << attempt;
    ASSERT_EQ(errors[1], "") << "attempt " << attempt;
  }
  EXPECT_EQ(ListeningWithChildren(rank0), before);
  EXPECT_TRUE(testing_util::ChildrenOf(rank0).empty());
  std::vector<std::unique_ptr<client::Session>> sessions =
      CreateAll(clients, groups, {8, 64, DType::kBFloat16, 64, 2, {}, 0});
  ASSERT_EQ(sessions.size(), 2u);
  EXPECT_GT(ListeningWithChildren(rank0), before)
      << "an open nccl session listens on no TCP socket";
  // The root's helper is over once the communicator is made.
  EXPECT_TRUE(testing_util::ChildrenOf(rank0).empty());
  for (auto& s : sessions) EXPECT_TRUE(s->Close().ok());
}

// A rank that fails after rank 0 made the unique id (the failpoint session.connect_transport
// fires on rank 1 after the third round: it never joins the communicator) fails the session
// on both ranks, rank 0's within its timeout, and leaves rank 0 with no bootstrap root: its
// helper process is gone, and no TCP socket more listens than the two NCCL's aborted init
// leaves (below). Then a session opens and calls.
TEST_F(NcclCluster, ARankFailingAfterTheUniqueIdLeavesNoBootstrapRootBehind) {
  const std::string fire = StrCat(testing::TempDir(), "/connect_transport_", getpid());
  std::filesystem::remove(fire);
  env_ = [fire](int r) {
    std::vector<std::string> env{StrCat("NCCL_HOSTID=ulysses-test-", r)};
    if (r == 1) env.push_back(StrCat("ULYSSES_FAILPOINTS=session.connect_transport=", fire));
    return env;
  };
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "late"));
  std::vector<client::Group> groups = JoinAll(clients, "late");
  ASSERT_EQ(groups.size(), 2u);
  const pid_t rank0 = daemons_[0].pid();
  const int before = ListeningWithChildren(rank0);
  { std::ofstream(fire) << "fire"; }
  const std::vector<std::string> errors = OnEveryRank(2, [&](int r) -> std::string {
    const client::SessionSpec spec{8, 64, DType::kBFloat16, 64, 2, {}, 3000};
    auto s = clients[r]->CreateSession(groups[r], spec);
    return s.ok() ? std::string("created") : s.status().ToString();
  });
  std::filesystem::remove(fire);
  EXPECT_NE(errors[0], "created");
  EXPECT_NE(errors[1].find("connect_transport"), std::string::npos) << errors[1];
  // The root's helper is gone. Rank 0's own communicator was aborted in its init, waiting in
  // NCCL's bootstrap for the root's answer: NCCL's bootstrapInit returns from that wait
  // without closing the socket it listened on for the root (a local of that function), and
  // the aborted communicator's other listening socket stayed open too, so rank 0's daemon
  // keeps those two (H100, 2026-12-06: 2 listening 20 s after the abort), and nothing more.
  // That leak is NCCL's and happens only on this path (a rank lost between the last
  // rendezvous round and its init); what the daemon owns, the root, it ends.
  int listening = -1;
  testing_util::Eventually([&] {
    listening = ListeningWithChildren(rank0);
    return listening <= before + 2 && testing_util::ChildrenOf(rank0).empty();
  }, absl::Seconds(5));
  EXPECT_LE(listening, before + 2) << listening << " TCP sockets listening in rank 0's daemon "
                                   << "and its children, " << before << " before";
  EXPECT_TRUE(testing_util::ChildrenOf(rank0).empty());
  std::vector<std::unique_ptr<client::Session>> sessions =
      CreateAll(clients, groups, {8, 64, DType::kBFloat16, 64, 2, {}, 0});
  ASSERT_EQ(sessions.size(), 2u);
  const std::vector<std::string> calls = OnEveryRank(2, [&](int r) -> std::string {
    auto x = clients[r]->AllocBuffer(64 * 8 * 64 * 2, "x");
    auto out = clients[r]->AllocBuffer(64 * 8 * 64 * 2, "out");
    if (!x.ok() || !out.ok()) return "alloc";
    auto res = sessions[r]->ScatterHeads(x->Ref(), 1, 64, out->Ref());
    return res.ok() ? "" : res.status().ToString();
  });
  EXPECT_EQ(calls[0], "");
  EXPECT_EQ(calls[1], "");
  for (auto& s : sessions) EXPECT_TRUE(s->Close().ok());
}

// The slot budget counts NCCL's send and receive staging with the slots: what a session
// holds against it covers every device byte the session allocated, and its close gives it
// all back.
TEST_F(NcclCluster, TheSlotBudgetCountsTheStagingAndGetsItBack) {
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "budget"));
  std::vector<client::Group> groups = JoinAll(clients, "budget");
  ASSERT_EQ(groups.size(), 2u);
  uint64_t device0[2], used0[2];
  for (int r = 0; r < 2; ++r) {
    device0[r] = State(r).device_bytes();
    used0[r] = State(r).slot_budget_used_bytes();
  }
  std::vector<std::unique_ptr<client::Session>> sessions =
      CreateAll(clients, groups, {8, 64, DType::kBFloat16, 1000, 2, {}, 0});
  ASSERT_EQ(sessions.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    const uint64_t allocated = State(r).device_bytes() - device0[r];
    const uint64_t held = State(r).slot_budget_used_bytes() - used0[r];
    EXPECT_GE(held, allocated) << "rank " << r << ": the budget holds less than the session "
                               << "allocated (slots and staging)";
  }
  for (auto& s : sessions) ASSERT_TRUE(s->Close().ok());
  // Given back once each session is destroyed, which may be just after its close returns.
  for (int r = 0; r < 2; ++r)
    EXPECT_TRUE(testing_util::Eventually(
        [&] { return State(r).slot_budget_used_bytes() == used0[r]; }))
        << r << ": " << State(r).slot_budget_used_bytes();
}

// Both ranks call in a loop and rank 1's daemon is killed while they do, so rank 0's call is
// caught anywhere in its protocol, NCCL transfer included: it ends with ABORTED or
// DEADLINE_EXCEEDED within the call timeout, and the survivor keeps serving new sessions.
TEST_F(NcclCluster, PeerDaemonKilledMidCallEndsTheCallAndTheSurvivorServes) {
  Start(2, {"--call-timeout-ms", "3000"});
  std::vector<std::unique_ptr<client::Client>> clients;
  clients.push_back(Connect(0, "survivor"));
  clients.push_back(Connect(1, "victim"));
  auto groups = JoinAll(clients, "kill");
  ASSERT_EQ(groups.size(), 2u);
  // 8 MiB per rank: each call spends a while in NCCL's socket transfer.
  const int S = 2048, H = 16, D = 128;
  const client::SessionSpec spec{H, D, DType::kBFloat16, S, 2, {}, 0};
  auto sessions = CreateAll(clients, groups, spec);
  ASSERT_EQ(sessions.size(), 2u);
  auto x = clients[0]->AllocBuffer(static_cast<uint64_t>(S) * H * D * 2, "x");
  auto out = clients[0]->AllocBuffer(static_cast<uint64_t>(S) * H * D * 2, "out");
  ASSERT_TRUE(x.ok() && out.ok());
  std::atomic<int> calls{0};
  std::atomic<bool> done{false};
  absl::Status failure;
  absl::Duration took;
  std::thread victim([&] {
    auto x = clients[1]->AllocBuffer(static_cast<uint64_t>(S) * H * D * 2, "x");
    auto out = clients[1]->AllocBuffer(static_cast<uint64_t>(S) * H * D * 2, "out");
    if (!x.ok() || !out.ok()) return;
    for (int i = 0; i < 100000; ++i) {
      auto res = sessions[1]->ScatterHeads(x->Ref(), 1, S, out->Ref());
      if (!res.ok()) return;
    }
  });
  std::thread killer([&] {
    while (calls.load() < 3 && !done.load())
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    daemons_[1].Kill();
  });
  for (int i = 0; i < 100000; ++i) {
    const absl::Time t0 = absl::Now();
    auto res = sessions[0]->ScatterHeads(x->Ref(), 1, S, out->Ref());
    if (!res.ok()) {
      failure = res.status();
      took = absl::Now() - t0;
      break;
    }
    calls.fetch_add(1);
  }
  done.store(true);
  killer.join();
  victim.join();
  ASSERT_FALSE(failure.ok()) << "rank 0's calls never failed";
  EXPECT_TRUE(failure.code() == absl::StatusCode::kDeadlineExceeded ||
              failure.code() == absl::StatusCode::kAborted)
      << failure;
  EXPECT_LT(took, absl::Seconds(20)) << "the call waited " << took;
  auto solo = clients[0]->JoinGroup({"solo", 1, 0, {Members(2)[0]}, "nccl", 0});
  ASSERT_TRUE(solo.ok()) << solo.status();
  auto s = clients[0]->CreateSession(*solo, spec);
  ASSERT_TRUE(s.ok()) << s.status();
  auto ok = (*s)->ScatterHeads(x->Ref(), 1, S, out->Ref());
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// An `auto` daemon on nvlink holds nccl too: on one GPU every pair of ranks maps each other's
// memory, so an `auto` group runs nvlink; a group that asks for nccl runs nccl; both give the
// same bytes, and each group records why it runs its backend.
TEST_F(NcclCluster, AutoDaemonsRunNvlinkAndNcclWhenAskedFor) {
  backend_ = "auto";
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "both"));
  auto via_nvlink = JoinAll(clients, "auto", "auto");
  auto via_nccl = JoinAll(clients, "asked", "nccl");
  ASSERT_EQ(via_nvlink.size(), 2u);
  ASSERT_EQ(via_nccl.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(via_nvlink[r].backend, "nvlink");
    EXPECT_NE(via_nvlink[r].backend_reason.find("every pair of ranks' devices maps"),
              std::string::npos)
        << via_nvlink[r].backend_reason;
    EXPECT_EQ(via_nccl[r].backend, "nccl");
    EXPECT_EQ(via_nccl[r].backend_reason, "requested nccl: every rank's daemon also runs nccl");
  }
  const int H = 8, D = 64, S = 16;
  const client::SessionSpec spec{H, D, DType::kBFloat16, S, 2, {}, 0};
  auto nvlink_sessions = CreateAll(clients, via_nvlink, spec);
  auto nccl_sessions = CreateAll(clients, via_nccl, spec);
  ASSERT_EQ(nvlink_sessions.size(), 2u);
  ASSERT_EQ(nccl_sessions.size(), 2u);
  const std::vector<std::string> errors = OnEveryRank(2, [&](int r) -> std::string {
    const size_t n = static_cast<size_t>(S) * H * D;
    auto x = clients[r]->AllocBuffer(n * 2, "x");
    if (!x.ok()) return "alloc";
    std::vector<uint16_t> xh(n);
    for (size_t i = 0; i < n; ++i) xh[i] = static_cast<uint16_t>(0x3c00 + (r * 7919 + i) % 1024);
    if (!ipc::cuda::Copy(x->data, xh.data(), n * 2).ok()) return "upload";
    auto a = nvlink_sessions[r]->ScatterHeads(x->Ref(), 1, S);
    auto b = nccl_sessions[r]->ScatterHeads(x->Ref(), 1, S);
    if (!a.ok() || !b.ok()) return StrCat(a.status(), " / ", b.status());
    std::vector<uint16_t> ah(a->bytes / 2), bh(b->bytes / 2);
    if (a->bytes != b->bytes || !ipc::cuda::Copy(ah.data(), a->data, a->bytes).ok() ||
        !ipc::cuda::Copy(bh.data(), b->data, b->bytes).ok())
      return "read";
    return ah != bh ? "nvlink and nccl results differ" : "";
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// A fused session on nccl runs the per-operator path (auto picks it); the paths whose kernels
// store straight into the peers' slots are refused on every rank, naming the path, before any
// rendezvous. (Its results: fused_daemon_gpu_test.cc.)
TEST_F(NcclCluster, FusedSessionRunsPerOperatorAndRefusesThePathsThatStoreIntoPeers) {
  Start(2);
  std::vector<std::unique_ptr<client::Client>> clients;
  for (int r = 0; r < 2; ++r) clients.push_back(Connect(r, "fused"));
  const int32_t H = 2, D = kFusedGpuHeadDim, hidden = H * D, max_pos = 64, S = 8;
  const uint64_t w_bytes = uint64_t{3} * hidden * hidden * 2, norm_at = AlignUp(w_bytes, 256);
  const uint64_t cos_at = norm_at + 512, total = cos_at + uint64_t{max_pos} * D * 4;
  int combo = 0;
  for (FusedPath path : {FusedPath::kChunked, FusedPath::kEpilogue, FusedPath::kAuto}) {
    SCOPED_TRACE(FusedPathName(path));
    auto groups = JoinAll(clients, StrCat("fused", combo++));
    ASSERT_EQ(groups.size(), 2u);
    const std::vector<std::string> errors = OnEveryRank(2, [&](int r) -> std::string {
      auto w = clients[r]->AllocBuffer(total, "weights");
      auto x = clients[r]->AllocBuffer(uint64_t{S} * hidden * 2, "x");
      auto pos = clients[r]->AllocBuffer(S * 4, "positions");
      if (!w.ok() || !x.ok() || !pos.ok()) return "alloc";
      client::FusedSessionSpec spec;
      spec.hidden = hidden;
      spec.num_heads = H;
      spec.layout = QkvLayout::kFused;
      spec.max_tokens = S;
      spec.max_pos = max_pos;
      spec.path = path;
      spec.weights.w_qkv = w->Tensor(DType::kBFloat16, {3 * hidden, hidden}, 0);
      spec.weights.q_norm = w->Tensor(DType::kBFloat16, {D}, norm_at);
      spec.weights.k_norm = w->Tensor(DType::kBFloat16, {D}, norm_at + 256);
      spec.weights.cos_sin = w->Tensor(DType::kFloat32, {max_pos, D}, cos_at);
      spec.timeout_ms = 60000;
      auto session = clients[r]->CreateFusedSession(groups[r], spec);
      if (path != FusedPath::kAuto) {
        if (session.ok()) return "created";
        if (session.status().code() != absl::StatusCode::kFailedPrecondition ||
            session.status().message().find(StrCat("path: ", FusedPathName(path))) ==
                std::string::npos)
          return session.status().ToString();
        return "";
      }
      if (!session.ok()) return session.status().ToString();
      auto views = (*session)->QkvNormRopeExchange(x->Ref(), pos->Ref(), 1, S);
      if (!views.ok()) return views.status().ToString();
      auto described = (*session)->Describe();
      if (!described.ok()) return described.status().ToString();
      if (described->rfind("nccl: ", 0) != 0 ||
          described->find(StrCat("rows ", S, ": per_operator (auto: ")) == std::string::npos)
        return "describe: " + *described;
      return "";
    });
    EXPECT_EQ(errors[0], "");
    EXPECT_EQ(errors[1], "");
  }
}

}  // namespace
}  // namespace ulysses
